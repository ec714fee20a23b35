/* Open-addressing hash maps of a table: key -> record id, episode id -> reference count.
 * Linear probing, backward-shift deletion (no tombstones); any capacity (rs_map_capacity keeps
 * the load <= 0.75 for cap entries, rs_index_capacity <= 0.6 for a key index) and the callers
 * keep at least one slot empty so every probe terminates. */
#ifndef RS_INDEX_H
#define RS_INDEX_H

#include "rs_internal.h"

/* 64-bit finalizer (splitmix64 / Stafford variant 13): every key bit affects every hash bit. */
static inline uint64_t rs_mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

/* key -> record id. Empty entry: rec_plus1 == 0. */
uint32_t rs_index_find(const rs_index_entry *ix, uint32_t cap, uint64_t key); /* RS_NONE if absent */
/* rs_index_find that also tells where an absent key would go: *empty is the empty slot its probe
 * ended at (cap: none), for rs_index_put_at while the index has not changed since. */
uint32_t rs_index_find_slot(const rs_index_entry *ix, uint32_t cap, uint64_t key, uint32_t *empty);
/* rs_index_find of n keys into out[], their probes' first cache misses all in flight at once. */
void rs_index_find_many(const rs_index_entry *ix, uint32_t cap, uint32_t n, const uint64_t *keys,
                        uint32_t *out);
/* Requests the home entries of n keys about to be looked up and inserted (no effect otherwise). */
void rs_index_prefetch(const rs_index_entry *ix, uint32_t cap, uint32_t n, const uint64_t *keys);
/* key absent; returns 1, or 0 (nothing written) when no slot is empty. */
int rs_index_put(rs_index_entry *ix, uint32_t cap, uint64_t key, uint32_t rec);
/* rs_index_put of a key whose empty slot rs_index_find_slot found (one probe instead of two);
 * a slot out of range or taken meanwhile falls back to rs_index_put. */
int rs_index_put_at(rs_index_entry *ix, uint32_t cap, uint32_t slot, uint64_t key, uint32_t rec);
int rs_index_remove(rs_index_entry *ix, uint32_t cap, uint64_t key);            /* 1 if removed */
void rs_index_clear(rs_index_entry *ix, uint32_t cap);

/* episode id -> count. Empty entry: count == 0. */
rs_episode_entry *rs_epmap_find(rs_episode_entry *em, uint32_t cap, uint64_t episode_id);
/* Add one reference; returns 1 when the episode is new (count went 0 -> 1), 0 when it was
 * there, -1 (nothing changed) when it is new and no slot is empty. */
int rs_epmap_incr(rs_episode_entry *em, uint32_t cap, uint64_t episode_id);
/* Drop one reference; returns 1 when the count reached 0 (entry removed), 0 otherwise,
 * -1 if the episode was not in the map. */
int rs_epmap_decr(rs_episode_entry *em, uint32_t cap, uint64_t episode_id);
void rs_epmap_clear(rs_episode_entry *em, uint32_t cap);

/* Slots of a map that holds up to `cap` entries at load <= 0.75 (and always one empty slot). */
uint32_t rs_map_capacity(uint32_t cap);
/* Slots of a table's key index for `cap` records: load <= 0.6. Every insert into a full table
 * also removes its oldest key, and a removal scans the rest of its probe run (backward shift):
 * ~10 entries at load 0.75, ~4 at 0.6, for 4 more bytes per record; the insert's lock hold was
 * 17% shorter (64-item inserts into a full 100k-item table, Fifo remover). */
uint32_t rs_index_capacity(uint32_t cap);

#endif
