/* Key index and episode map: open addressing with linear probing and backward-shift deletion.
 * Deleting shifts later members of the probe run back into the hole, so lookups never meet
 * tombstones and the load never creeps up over a long run of inserts and deletes. */
#include <string.h>

#include "index.h"

static inline uint32_t home_of(uint64_t key, uint32_t mask) { return (uint32_t)rs_mix64(key) & mask; }

/* True when an entry whose home is `h`, stored at `j`, may move back to the hole at `i`
 * (i.e. `h` is not cyclically inside (i, j]). */
static inline int may_fill(uint32_t i, uint32_t j, uint32_t h) {
  if (i <= j) return h <= i || h > j;
  return h <= i && h > j;
}

uint32_t rs_index_find(const rs_index_entry *ix, uint32_t cap, uint64_t key) {
  uint32_t mask = cap - 1;
  for (uint32_t i = home_of(key, mask);; i = (i + 1) & mask) {
    if (ix[i].rec_plus1 == 0) return RS_NONE;
    if (ix[i].key == key) return ix[i].rec_plus1 - 1;
  }
}

void rs_index_find_many(const rs_index_entry *ix, uint32_t cap, uint32_t n, const uint64_t *keys,
                        uint32_t *out) {
  uint32_t mask = cap - 1;
  for (uint32_t i = 0; i < n; i++) __builtin_prefetch(&ix[home_of(keys[i], mask)], 0);
  for (uint32_t i = 0; i < n; i++) out[i] = rs_index_find(ix, cap, keys[i]);
}

void rs_index_put(rs_index_entry *ix, uint32_t cap, uint64_t key, uint32_t rec) {
  uint32_t mask = cap - 1;
  uint32_t i = home_of(key, mask);
  while (ix[i].rec_plus1 != 0) i = (i + 1) & mask;
  ix[i].key = key;
  ix[i].rec_plus1 = rec + 1;
}

int rs_index_remove(rs_index_entry *ix, uint32_t cap, uint64_t key) {
  uint32_t mask = cap - 1;
  uint32_t i = home_of(key, mask);
  for (;; i = (i + 1) & mask) {
    if (ix[i].rec_plus1 == 0) return 0;
    if (ix[i].key == key) break;
  }
  for (uint32_t j = (i + 1) & mask; ix[j].rec_plus1 != 0; j = (j + 1) & mask) {
    if (may_fill(i, j, home_of(ix[j].key, mask))) {
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
  uint32_t mask = cap - 1;
  for (uint32_t i = home_of(episode_id, mask);; i = (i + 1) & mask) {
    if (!em[i].used) return NULL;
    if (em[i].episode_id == episode_id) return &em[i];
  }
}

int rs_epmap_incr(rs_episode_entry *em, uint32_t cap, uint64_t episode_id) {
  uint32_t mask = cap - 1;
  uint32_t i = home_of(episode_id, mask);
  for (; em[i].used; i = (i + 1) & mask) {
    if (em[i].episode_id == episode_id) {
      em[i].count++;
      return 0;
    }
  }
  em[i].episode_id = episode_id;
  em[i].count = 1;
  em[i].used = 1;
  return 1;
}

int rs_epmap_decr(rs_episode_entry *em, uint32_t cap, uint64_t episode_id) {
  uint32_t mask = cap - 1;
  uint32_t i = home_of(episode_id, mask);
  for (;; i = (i + 1) & mask) {
    if (!em[i].used) return -1;
    if (em[i].episode_id == episode_id) break;
  }
  if (--em[i].count > 0) return 0;
  for (uint32_t j = (i + 1) & mask; em[j].used; j = (j + 1) & mask) {
    if (may_fill(i, j, home_of(em[j].episode_id, mask))) {
      em[i] = em[j];
      i = j;
    }
  }
  memset(&em[i], 0, sizeof em[i]);
  return 1;
}

void rs_epmap_clear(rs_episode_entry *em, uint32_t cap) { memset(em, 0, (size_t)cap * sizeof *em); }
