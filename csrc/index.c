/* Key index and episode map: open addressing with linear probing and backward-shift deletion.
 * Deleting shifts later members of the probe run back into the hole, so lookups never meet
 * tombstones and the load never creeps up over a long run of inserts and deletes. Capacities
 * need not be powers of two: a key's home slot is the high half of (32-bit hash * cap), a
 * multiply instead of a division (Lemire's range reduction), and probes wrap at cap. Every probe
 * loop stops after cap slots: a map the capacity rules keep from filling can still be full when
 * the segment was damaged, and a reader of a damaged segment must get an answer, not a hang. */
#include <string.h>

#include "index.h"

static inline uint32_t home_of(uint64_t key, uint32_t cap) {
  return (uint32_t)(((rs_mix64(key) >> 32) * (uint64_t)cap) >> 32);
}
static inline uint32_t next_slot(uint32_t i, uint32_t cap) { return i + 1 == cap ? 0 : i + 1; }

/* True when an entry whose home is `h`, stored at `j`, may move back to the hole at `i`
 * (i.e. `h` is not cyclically inside (i, j]). */
static inline int may_fill(uint32_t i, uint32_t j, uint32_t h) {
  if (i <= j) return h <= i || h > j;
  return h <= i && h > j;
}

uint32_t rs_index_find_slot(const rs_index_entry *ix, uint32_t cap, uint64_t key, uint32_t *empty) {
  uint32_t i = home_of(key, cap);
  for (uint32_t n = 0; n < cap; n++, i = next_slot(i, cap)) {
    if (ix[i].rec_plus1 == 0) {
      *empty = i;
      return RS_NONE;
    }
    if (ix[i].key == key) return ix[i].rec_plus1 - 1;
  }
  *empty = cap;
  return RS_NONE;
}

uint32_t rs_index_find(const rs_index_entry *ix, uint32_t cap, uint64_t key) {
  uint32_t empty;
  return rs_index_find_slot(ix, cap, key, &empty);
}

void rs_index_find_many(const rs_index_entry *ix, uint32_t cap, uint32_t n, const uint64_t *keys,
                        uint32_t *out) {
  for (uint32_t i = 0; i < n; i++) __builtin_prefetch(&ix[home_of(keys[i], cap)], 0);
  for (uint32_t i = 0; i < n; i++) out[i] = rs_index_find(ix, cap, keys[i]);
}

void rs_index_prefetch(const rs_index_entry *ix, uint32_t cap, uint32_t n, const uint64_t *keys) {
  /* Two lines: at load 0.75 a probe run (and the run a removal shifts back) is ~8 entries of
   * 12 bytes, past the home entry's line more often than not. (A prefetch past the array's end
   * is harmless: it never faults.) */
  for (uint32_t i = 0; i < n; i++) {
    const char *home = (const char *)&ix[home_of(keys[i], cap)];
    __builtin_prefetch(home, 1);
    __builtin_prefetch(home + 64, 1);
  }
}

int rs_index_put(rs_index_entry *ix, uint32_t cap, uint64_t key, uint32_t rec) {
  uint32_t i = home_of(key, cap);
  for (uint32_t n = 0; ix[i].rec_plus1 != 0; n++, i = next_slot(i, cap))
    if (n + 1 >= cap) return 0;
  ix[i].key = key;
  ix[i].rec_plus1 = rec + 1;
  return 1;
}

int rs_index_put_at(rs_index_entry *ix, uint32_t cap, uint32_t slot, uint64_t key, uint32_t rec) {
  if (slot >= cap || ix[slot].rec_plus1 != 0) return rs_index_put(ix, cap, key, rec);
  ix[slot].key = key;
  ix[slot].rec_plus1 = rec + 1;
  return 1;
}

int rs_index_remove(rs_index_entry *ix, uint32_t cap, uint64_t key) {
  uint32_t i = home_of(key, cap), n = 0;
  for (;; i = next_slot(i, cap)) {
    if (ix[i].rec_plus1 == 0 || n++ == cap) return 0;
    if (ix[i].key == key) break;
  }
  n = 0;
  for (uint32_t j = next_slot(i, cap); ix[j].rec_plus1 != 0 && ++n < cap; j = next_slot(j, cap)) {
    if (may_fill(i, j, home_of(ix[j].key, cap))) {
      ix[i] = ix[j];
      i = j;
    }
  }
  ix[i].rec_plus1 = 0;
  ix[i].key = 0;
  return 1;
}

void rs_index_clear(rs_index_entry *ix, uint32_t cap) { memset(ix, 0, (size_t)cap * sizeof *ix); }

rs_episode_entry *rs_epmap_find(rs_episode_entry *em, uint32_t cap, uint64_t episode_id) {
  uint32_t i = home_of(episode_id, cap);
  for (uint32_t n = 0; n < cap; n++, i = next_slot(i, cap)) {
    if (!em[i].count) return NULL;
    if (em[i].episode_id == episode_id) return &em[i];
  }
  return NULL;
}

int rs_epmap_incr(rs_episode_entry *em, uint32_t cap, uint64_t episode_id) {
  uint32_t i = home_of(episode_id, cap), n = 0;
  for (; em[i].count; i = next_slot(i, cap)) {
    if (em[i].episode_id == episode_id) {
      em[i].count++;
      return 0;
    }
    if (++n >= cap) return -1;
  }
  em[i].episode_id = episode_id;
  em[i].count = 1;
  return 1;
}

int rs_epmap_decr(rs_episode_entry *em, uint32_t cap, uint64_t episode_id) {
  uint32_t i = home_of(episode_id, cap), n = 0;
  for (;; i = next_slot(i, cap)) {
    if (!em[i].count || n++ == cap) return -1;
    if (em[i].episode_id == episode_id) break;
  }
  if (--em[i].count > 0) return 0;
  for (uint32_t j = next_slot(i, cap); em[j].count; j = next_slot(j, cap)) {
    if (may_fill(i, j, home_of(em[j].episode_id, cap))) {
      em[i] = em[j];
      i = j;
    }
  }
  memset(&em[i], 0, sizeof em[i]);
  return 1;
}

void rs_epmap_clear(rs_episode_entry *em, uint32_t cap) { memset(em, 0, (size_t)cap * sizeof *em); }

uint32_t rs_map_capacity(uint32_t cap) { return cap + cap / 3 + 2; }

uint32_t rs_index_capacity(uint32_t cap) { return cap + (uint32_t)((uint64_t)cap * 2 / 3) + 2; }
