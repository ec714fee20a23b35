/* Operation counters: one row of counters per (process slot, table), written only by the process
 * that owns the slot (with the table lock held, so threads of one process never race on a row),
 * and summed over slots on read (rs_counters_read). A row lives on cache lines no other process
 * writes, so counting adds no shared cache-line traffic to inserts and samples.
 *
 * Region: rs_tcounters[(max_procs + 1) * num_tables] at rs_seg_hdr.counters_off, slot-major
 * (row slot * num_tables + table); rows of slot max_procs count operations of a process with no
 * slot of its own in this segment (rs_mutate / rs_reset from a tool that never registered).
 * Rows are cumulative over every process that held the slot: totals never go down while the
 * segment lives. The blocked_* gauges belong to the slot's current process and are zeroed when
 * a process claims the slot; readers count them for live slots only. */
#ifndef RS_COUNTERS_H
#define RS_COUNTERS_H

#include "rs_internal.h"

typedef struct rs_tcounters {
  uint64_t inserts;        /* items inserted (a new key; a re-insert of a key is an update) */
  uint64_t samples;        /* items sampled */
  uint64_t updates;        /* priority updates (mutate_priorities and re-inserts of a key) */
  uint64_t deletes;        /* items deleted by mutate_priorities */
  uint64_t evictions;      /* items removed by the remover because the table was full */
  uint64_t expirations;    /* items removed on reaching max_times_sampled */
  uint64_t insert_bytes;   /* payload bytes referenced by inserted items */
  uint64_t lock_holds;     /* table-lock holds by insert / sample / mutate / reset */
  uint64_t lock_hold_ns;   /* their total duration */
  uint32_t blocked_inserters, blocked_samplers;   /* threads blocked on the rate limiter now */
  uint64_t _pad[6];
  uint64_t hold_hist[RS_HOLD_BUCKETS];            /* see rs_counters_bucket */
} rs_tcounters;

_Static_assert(sizeof(rs_tcounters) % RS_ALIGN == 0, "counter rows fill whole cache lines");

/* Bytes of the counters region. */
static inline uint64_t rs_counters_region_size(uint32_t max_procs, uint32_t num_tables) {
  return (uint64_t)(max_procs + 1) * num_tables * sizeof(rs_tcounters);
}

/* The row of (slot, table); slot >= max_procs selects the shared row of unregistered callers. */
static inline rs_tcounters *rs_counters_row(void *base, uint32_t slot, uint32_t table) {
  rs_seg_hdr *h = rs_seg(base);
  if (slot > h->max_procs) slot = h->max_procs;
  return (rs_tcounters *)rs_at(base, h->counters_off) + (uint64_t)slot * h->num_tables + table;
}

/* Histogram bucket of a lock hold of ns nanoseconds: bucket 0 holds < 128 ns, bucket b in
 * 1..RS_HOLD_BUCKETS-2 holds [2**(b+6), 2**(b+7)) ns, the last bucket everything from
 * 2**(RS_HOLD_BUCKETS+5) ns (about 0.5 s) on. */
static inline uint32_t rs_counters_bucket(int64_t ns) {
  if (ns < 128) return 0;
  uint32_t b = 63u - (uint32_t)__builtin_clzll((uint64_t)ns) - 6u;
  return b < RS_HOLD_BUCKETS ? b : RS_HOLD_BUCKETS - 1;
}

/* Count one lock hold (caller holds the table lock of the row's table). */
static inline void rs_counters_hold(rs_tcounters *c, int64_t ns) {
  c->lock_holds++;
  c->lock_hold_ns += (uint64_t)ns;
  c->hold_hist[rs_counters_bucket(ns)]++;
}

/* The calling process's slot in the segment mapped at base (bound by rs_proc_register), or
 * UINT32_MAX when it has none. */
uint32_t rs_counters_self(void *base);
/* A process claimed `slot`: zero the slot's gauges and remember it as this process's slot. */
void rs_counters_claimed(void *base, uint32_t slot);

#endif
