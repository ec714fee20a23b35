/* reverb_shm C core: shared-memory layout and the internal interfaces between modules.
 *
 * Segment layout (one POSIX shm segment per server; all positions are byte offsets from base):
 *
 *   rs_seg_hdr | table offsets (u64[num_tables]) | rs_slot[max_procs] |
 *   operation counters (per slot and table, counters.h) |
 *   per-table regions (rs_table_hdr + its arrays + config blob) | arena (arena_size, room for
 *   arena_max) | pin logs (per slot: u64 entries[pins_per_proc] + u32 free stack[pins_per_proc])
 *
 * A growable segment (rs_segment_init_ex) is a sparse file as large as its layout, mapped whole
 * by every process, of which only the used part holds memory: everything up to the arena's end,
 * plus the first pin_cap entries (and free-stack slots) of each slot's pin log. Growth reserves
 * the pages of a further extent (MADV_POPULATE_WRITE: allocated, or a clean error when
 * /dev/shm is full: never a SIGBUS later) and then publishes it with one store (arena_size, a
 * slot's pin_cap) under the arena lock. Offsets stay offsets from base: no process maps
 * anything when the arena grows, and no translation is added to any access.
 *
 * Layers (one .c/.h pair per concept; a file calls only files of lower layers, checked by
 * tests/test_layers.py, which parses these sources):
 *   0  util.c      errors, clocks, per-process RNG, rs_copy_stream (non-temporal copies)
 *   1  lock.c      robust process-shared mutexes, futex wait/wake. After a dead lock owner it
 *                  runs the table and arena repairs through hooks registered by layout.c at
 *                  load time (rs_lock_register_repairs): the one call that goes upward.
 *      sumtree.c   float64 sum tree, exact recompute along the path (Schaul et al. 2016)
 *      index.c     key -> record hash (open addressing, backward-shift delete), episode map
 *      layout_cache.c  per-thread cache of checked item layouts across sample rounds
 *      limiter.c   Reverb's rate limiter: samples_per_insert, min_size_to_sample and the
 *                  [min_diff, max_diff] window on inserts * samples_per_insert - samples
 *      writer_items.c  window item descriptors of a trajectory writer
 *      extent.c    reserving a growable segment's extents (pages, or disk-tier file blocks)
 *      liveness.c  liveness locks: the owner's and each slot's process's, across pid namespaces
 *      gather_thread.c  the per-process helper thread that shares large gathers (rs_run_units)
 *      fd_spin.c   polling a descriptor briefly for a reply due soon (the bridge's direct port)
 *   2  selectors.c Uniform/Prioritized/Fifo/Lifo/MinHeap/MaxHeap
 *      arena.c     block allocator, chunks, descriptors, refcounts
 *      counters.c  per-slot operation counters (merged lock-free on read), process list
 *   3  slots.c     process slots, pin logs, reaping, stop-the-world recount, owner liveness
 *      bridge_layout.c  chunk layouts shipped by the gRPC bridge
 *   4  table.c     insert/sample/mutate/reset/items/stats + repair after a dead lock owner
 *      table_check.c    per-table invariants (rs_table_check)
 *   5  layout.c    segment size/init/validate/info/close, table directory; registers the repairs
 *      fastpath.c  fused small inserts (rs_insert_rows)
 *      snapshot.c  checkpoint snapshot and restore of a table
 *      table_wait.c     sleeping until a table changes (background delivery of held-back items)
 *   6  check.c     rs_check: validates the segment header and table layouts (layout.c), then
 *                  takes every lock and runs the arena and table checks
 *   hot/ (a separate CPython extension, reverb_shm._hot) calls the core only through function
 *   pointers taken from reverb_shm._core at import (one copy of the core in a process).
 */
#ifndef RS_INTERNAL_H
#define RS_INTERNAL_H

#include <stdint.h>
#include <stddef.h>
#include <pthread.h>

#include "rs_api.h"

#define RS_MAGIC 0x3130304d48535652ULL /* "RVSHM001" little-endian */
#define RS_LAYOUT_VERSION 6ULL
#define RS_ALIGN 64u
#define RS_NONE 0xFFFFFFFFu
#define RS_MAX_NDIM 8
#define RS_MAX_BLOB (1u << 20)
#define RS_NBINS 48
#define RS_PIN_START 1024u      /* pins of each slot's log reserved when a growable segment starts */
/* Largest table max_size: its record capacity (max_size + 1) stays below 2**30, which keeps
 * every map and sum-tree capacity within uint32. */
#define RS_MAX_TABLE_SIZE ((1u << 30) - 2)
#define RS_RECENT_TEMPLATES 8   /* rs_table_hdr.recent_recs */
#define RS_HOLD_BUCKETS 24      /* lock-hold histogram buckets (counters.h) */

static inline uint64_t rs_align_up(uint64_t x, uint64_t a) { return (x + a - 1) & ~(a - 1); }
static inline void *rs_at(void *base, uint64_t off) { return (char *)base + off; }

/* ------------------------------------------------------------------ segment header */
typedef struct rs_seg_hdr {
  uint64_t magic;
  uint64_t layout_version;
  uint64_t total_size;
  uint64_t generation;
  int32_t owner_pid;
  int32_t closed;            /* set by rs_segment_close */
  uint64_t owner_start_time;
  uint32_t num_tables;
  uint32_t max_procs;
  uint32_t pins_per_proc;
  uint32_t ready;            /* written last by rs_segment_init (release) */
  uint64_t tables_off;       /* u64[num_tables]: offset of each rs_table_hdr */
  uint64_t slots_off;        /* rs_slot[max_procs] */
  uint64_t pins_off;         /* pin logs */
  uint64_t pin_log_stride;   /* bytes per slot's pin log */
  uint64_t arena_off;
  uint64_t arena_size;
  pthread_mutex_t registry_lock;  /* slot claims and reaping */
  pthread_mutex_t arena_lock;     /* allocator, every refcount change, pin logs */
  /* allocator state (derived from the block walk; rebuilt after a dead owner) */
  uint64_t free_heads[RS_NBINS];  /* offset of first free block per size bin, 0 = none */
  uint64_t arena_used;            /* bytes in allocated blocks */
  uint64_t num_chunks;
  uint64_t num_descs;
  uint32_t refcounts_suspect;     /* set after an arena-lock EOWNERDEAD; cleared by recount */
  uint32_t growable;              /* 1: pin logs and arena reserve pages as they grow */
  /* growth (rs_segment_init_ex): arena_size <= arena_max; budget of reserved bytes */
  uint64_t arena_max;             /* room laid out for the arena (its size can reach this) */
  uint64_t max_bytes;             /* most bytes arena_end + pin logs may hold; 0 = no budget */
  uint64_t pins_reserved;         /* bytes of pin logs reserved, sum of 12 x pin_cap (derived) */
  uint64_t extents;               /* growth steps of the arena so far (generation number) */
  uint64_t tail_size;             /* size of the arena's last block (derived) */
  uint32_t arena_file;            /* 1: the arena is a file mapped over its range (disk tier) */
  uint32_t _pad2;
  uint64_t counters_off;          /* rs_tcounters[(max_procs + 1) * num_tables] (counters.h) */
  uint64_t frees;                 /* block frees and chunk shrinks so far (layout_cache.h) */
  uint64_t desc_serial;           /* serial of the last DESC block allocated (layout_cache.h) */
  uint64_t reserved[7];
} rs_seg_hdr;

typedef struct rs_slot {
  int32_t pid;           /* 0 = free */
  uint32_t npins;        /* live pin entries */
  uint64_t start_time;
  uint32_t free_top;     /* number of entries on the free stack */
  uint32_t pin_cap;      /* pin ids 0..pin_cap-1 are usable (pages reserved); <= pins_per_proc */
} rs_slot;

/* ------------------------------------------------------------------ tables */
/* Item reference (rs_rec.desc_off, rs_sample_rec.desc_off, rs_item_rec.desc_off): the payload
 * offset of a DESC block in the low RS_REF_OFF_BITS bits and a row shift in the high bits. The
 * item's descriptor is the block's blob with the shift added to every slice's row_offset, so
 * items that differ only by a common row offset (a batch of rows, sliding windows) share one
 * DESC block, each item holding one reference to it. */
#define RS_REF_OFF_BITS 48
#define RS_REF_MAX_SHIFT 0xFFFFu
static inline uint64_t rs_ref_off(uint64_t ref) { return ref & ((1ull << RS_REF_OFF_BITS) - 1); }
static inline uint32_t rs_ref_shift(uint64_t ref) { return (uint32_t)(ref >> RS_REF_OFF_BITS); }
static inline uint64_t rs_ref_make(uint64_t off, uint32_t shift) {
  return off | ((uint64_t)shift << RS_REF_OFF_BITS);
}

/* One record per item slot (64 bytes). Fields only the heap selectors need live in rs_heap_aux. */
typedef struct rs_rec {
  uint64_t key;
  double priority;
  uint64_t insert_seq;
  uint64_t desc_off;     /* item reference (see rs_ref_off / rs_ref_shift) */
  int64_t inserted_at_ns;
  int32_t times_sampled;
  uint32_t valid;        /* 1 = live item; written last on insert (commit), first on delete */
  union {
    uint32_t dense_pos;  /* live: position in the dense array */
    uint32_t next_free;  /* free: next record of the free-record list */
  };
  uint32_t prev, next;   /* insertion-order list (Fifo/Lifo) */
  uint32_t _pad;
} rs_rec;

/* Per-record heap data, an array of cap entries only when a selector is a heap. */
typedef struct rs_heap_aux {
  uint64_t update_seq;   /* heap tie-break: last insert or priority update */
  uint32_t heap_pos[2];  /* position in the heap of selector 0 (sampler) / 1 (remover) */
} rs_heap_aux;

/* Hash-map entries: 12 bytes, 4-byte aligned. Index empty: rec_plus1 == 0; episodes: count == 0. */
typedef struct __attribute__((packed, aligned(4))) rs_index_entry {
  uint64_t key;
  uint32_t rec_plus1;
} rs_index_entry;
typedef struct __attribute__((packed, aligned(4))) rs_episode_entry {
  uint64_t episode_id;
  uint32_t count;
} rs_episode_entry;

_Static_assert(sizeof(rs_rec) == 64, "rs_rec is one cache line");
_Static_assert(sizeof(rs_index_entry) == 12 && sizeof(rs_episode_entry) == 12, "12-byte map entries");

typedef struct rs_selector {
  int32_t kind;          /* RS_SEL_* */
  int32_t _pad;
  double exponent;
  uint64_t heap_off;     /* u32[cap] record ids, heap kinds only */
  uint64_t tree_off;     /* double[2*tree_leaves], prioritized only; leaf i = record i */
  uint32_t heap_len;
  uint32_t _pad2;
} rs_selector;

typedef struct rs_table_hdr {
  char name[64];
  uint64_t max_size;
  int32_t max_times_sampled;
  uint32_t cap;          /* record capacity = max_size + 1 */
  rs_selector sel[2];    /* 0 = sampler, 1 = remover */
  /* rate limiter: samples_per_insert, min_diff, max_diff, min_size_to_sample */
  double samples_per_insert;
  int64_t min_size_to_sample;
  double min_diff;
  double max_diff;
  int64_t inserts, samples, deletes;
  /* counters */
  int64_t size;
  int64_t num_episodes, num_deleted_episodes, num_unique_samples;
  uint64_t next_insert_seq, next_update_seq;
  uint32_t free_rec_head;          /* RS_NONE if no free record */
  uint32_t order_head, order_tail; /* oldest / newest in insertion order, RS_NONE if empty */
  int32_t closed;
  /* Lines of their own for what waiters poll (rs_tlock spins reading the lock's line, op_wait
   * reading seq's): the fields a lock holder writes for every item (free_rec_head, order_*,
   * size, ...) sharing a polled line took the holder a cache miss at each write after a poll. */
  pthread_mutex_t lock __attribute__((aligned(64)));   /* robust, process-shared */
  int64_t locked_at_ns;            /* when the lock's holder took it (rs_now_ns; a hint for
                                      rs_tlock's spinning, written by each holder) */
  uint32_t seq __attribute__((aligned(64)));   /* futex word: bumped by anything that may
                                                  unblock waiters */
  uint32_t waiters;                /* threads inside a futex wait on seq: blocked inserters in
                                      the low 16 bits, blocked samplers from bit 16 (table.c) */
  uint32_t woken;                  /* kinds of waiters (table.c WAIT_*) with a woken waiter on
                                      its way back to the lock and none registered since:
                                      publishers skip waking that kind meanwhile (the woken
                                      one wakes the next: op_publish) */
  uint32_t change_waiters;         /* threads in rs_table_wait_change (also in `waiters`): they
                                      register without the lock, so they are always woken */
  /* arrays */
  uint64_t recs_off;               /* rs_rec[cap] */
  uint64_t index_off;              /* rs_index_entry[index_cap] */
  uint32_t index_cap;              /* rs_index_capacity(cap): load <= 0.6 */
  uint32_t tree_leaves;            /* cap (0 if no prioritized selector) */
  uint64_t dense_off;              /* u32[cap] */
  uint64_t episodes_off;           /* rs_episode_entry[episodes_cap] */
  uint32_t episodes_cap;           /* cap + cap/3 + 2 */
  uint32_t blob_len;
  uint64_t blob_off;
  /* stats (ns) */
  int64_t inserting_ns, sampling_ns, waiting_for_sampling_ns, waiting_for_inserts_ns;
  int64_t repairs;
  uint64_t aux_off;                /* rs_heap_aux[cap] when a selector is a heap, else 0 */
  uint32_t last_rec;               /* record of the last insert: its DESC block may be shared */
  uint32_t recent_next;            /* next slot of recent_recs to replace */
  /* Records of recently created DESC blocks (RS_NONE = none), tried as templates after last_rec
   * so that writers inserting in turn (several processes' open chunks) each keep sharing theirs.
   * Hints only: a candidate counts only while its record is valid. */
  uint32_t recent_recs[RS_RECENT_TEMPLATES];
} rs_table_hdr;

/* A spin-wait loop's pause (lets the sibling hyperthread run; saves power). */
static inline void rs_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static inline rs_seg_hdr *rs_seg(void *base) { return (rs_seg_hdr *)base; }
static inline rs_table_hdr *rs_table(void *base, uint32_t t) {
  uint64_t *offs = (uint64_t *)rs_at(base, rs_seg(base)->tables_off);
  return (rs_table_hdr *)rs_at(base, offs[t]);
}
static inline rs_rec *rs_recs(void *base, rs_table_hdr *th) { return (rs_rec *)rs_at(base, th->recs_off); }
static inline rs_heap_aux *rs_aux(void *base, rs_table_hdr *th) {
  return (rs_heap_aux *)rs_at(base, th->aux_off);
}
static inline rs_slot *rs_slots(void *base) { return (rs_slot *)rs_at(base, rs_seg(base)->slots_off); }
static inline uint64_t *rs_pin_entries(void *base, uint32_t slot) {
  rs_seg_hdr *h = rs_seg(base);
  return (uint64_t *)rs_at(base, h->pins_off + (uint64_t)slot * h->pin_log_stride);
}
static inline uint32_t *rs_pin_free_stack(void *base, uint32_t slot) {
  return (uint32_t *)(rs_pin_entries(base, slot) + rs_seg(base)->pins_per_proc);
}

/* ------------------------------------------------------------------ util.c */
int rs_set_error(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int64_t rs_realtime_ns(void);
uint64_t rs_rand_u64(void);   /* per-process xoshiro256** seeded from getrandom; fork-safe */
double rs_rand_unit(void);    /* uniform in [0, 1) with 53 random bits */
void rs_rand_fill(uint64_t *out, uint32_t n);   /* n numbers of rs_rand_u64's stream at once */
/* Uniform in [0, n) from 64 random bits (multiply-high: bias below n / 2**64). */
static inline uint32_t rs_rand_below(uint64_t bits, uint32_t n) {
  return (uint32_t)(((unsigned __int128)bits * n) >> 64);
}
/* Uniform in [0, 1) from the top 53 of 64 random bits (as rs_rand_unit). */
static inline double rs_rand_to_unit(uint64_t bits) { return (double)(bits >> 11) * 0x1.0p-53; }

/* ------------------------------------------------------------------ lock.c */
int rs_mutex_init(pthread_mutex_t *m);                 /* robust + process-shared */
/* Lock; *recovered = 1 when the previous owner died holding it: the caller repairs what the
 * mutex protects and then calls rs_mutex_consistent before unlocking. */
int rs_mutex_lock(pthread_mutex_t *m, int *recovered);
void rs_mutex_consistent(pthread_mutex_t *m);
void rs_mutex_unlock(pthread_mutex_t *m);
/* Sleep while *word == expected, until woken or deadline (monotonic ns, <0 = none).
 * Returns RS_OK (woken or value changed), RS_ETIMEDOUT, or RS_EAGAIN (EINTR). */
int rs_futex_wait(uint32_t *word, uint32_t expected, int64_t deadline_ns);
/* rs_futex_wait as a waiter of kind `bits` (non-zero): only wakes naming one of them (and
 * rs_futex_wake_all) reach it. */
int rs_futex_wait_bits(uint32_t *word, uint32_t expected, int64_t deadline_ns, uint32_t bits);
/* rs_futex_wait_bits for a call blocked by a rate limiter: the calling thread sleeps under
 * SCHED_BATCH (when its policy is the default SCHED_OTHER; restored once it runs again), so
 * that its wake-up does not preempt the process running on the CPU it wakes on (often one
 * holding the table's lock, or the learner) but waits for that process's time slice or an idle
 * CPU. REVERB_SHM_BATCH_WAITS=0 in the environment turns this off. */
int rs_futex_wait_bits_batch(uint32_t *word, uint32_t expected, int64_t deadline_ns, uint32_t bits);
void rs_futex_wake_all(uint32_t *word);
/* Wakes up to n (>= 1; INT_MAX: every) waiters on word whose kind shares a bit with `bits`. */
void rs_futex_wake_bits(uint32_t *word, uint32_t bits, int n);
/* The repairs rs_tlock / rs_alock run after a dead lock owner. lock.c is below table.c and
 * arena.c: they reach it only through this registration, made once by layout.c at load time. */
typedef void (*rs_table_repair_fn)(void *base, uint32_t t);
typedef void (*rs_arena_repair_fn)(void *base);
void rs_lock_register_repairs(rs_table_repair_fn table_repair, rs_arena_repair_fn arena_repair);
/* Lock table t, repairing it (the registered rs_table_repair) if the previous owner died. */
int rs_tlock(void *base, uint32_t t);
void rs_tunlock(void *base, uint32_t t);
/* Lock the arena; after a dead owner: the registered rs_arena_repair + refcounts_suspect = 1. */
int rs_alock(void *base);
void rs_aunlock(void *base);

/* ------------------------------------------------------------------ slots.c: owner liveness */
/* RS_OK while the segment's owner (the server process) lives, else RS_EDEADOWNER with a message
 * naming the dead pid and the way out. Cheap (kill(pid, 0) + /proc/<pid>/stat); blocked calls
 * run it once per wait slice so a waiter never sleeps forever on a dead server. */
int rs_owner_check(void *base);
/* liveness.c: whether byte `byte` of the file of the segment at `base` is held by another open
 * file description (1), free (0), or unknown (-1: no fd registered, or the probe failed). */
int rs_live_probe_base(void *base, uint64_t byte);
/* liveness.c: take (hold 1) or drop (0) byte `byte` through the registered fd (RS_OK if none). */
int rs_live_lock_base(void *base, uint64_t byte, int hold);

/* ------------------------------------------------------------------ table.c (and friends) */
uint64_t rs_table_region_size(const rs_table_config *cfg);
/* Lay out one table region at `off` (zero-filled memory). */
int rs_table_region_init(void *base, uint64_t off, const rs_table_config *cfg);
/* Rebuild every derived structure of table t (index, dense array, order list, heaps, sum trees,
 * episode map, counters size/deletes) from the records; caller holds the table lock. */
void rs_table_repair(void *base, uint32_t t);
/* update_seq of record r: its heap tie-break counter, or insert_seq in a table without heaps. */
uint64_t rs_rec_update_seq(void *base, rs_table_hdr *th, uint32_t r);
/* Verify table t's invariants; caller holds the table lock. Appends to report. */
int rs_table_check(void *base, uint32_t t, char *report, uint64_t report_len);

/* ------------------------------------------------------------------ arena.c */
uint64_t rs_arena_min_size(void);
void rs_arena_init(void *base);               /* one free block spanning the arena */
void rs_arena_repair(void *base);             /* rebuild free lists/accounting by walking blocks */
/* Validate one descriptor blob against the chunks it references (no state change). */
int rs_desc_validate(void *base, const uint8_t *blob, uint32_t len);
/* Allocate a DESC block holding a copy of the blob, refcount 1 (owned by the caller's table
 * record), and add one reference to each distinct chunk it names; *off_out is its item reference
 * (shift 0). Takes the arena lock. */
int rs_desc_create(void *base, const uint8_t *blob, uint32_t len, uint64_t *off_out);
/* As rs_desc_create, but when `tmpl` (an item reference the caller knows to be held, e.g. by a
 * live record; 0 = none) names a live DESC block whose
 * blob equals `blob` except that every slice's row_offset is lower by one common d <=
 * RS_REF_MAX_SHIFT, take one more reference to that block instead and return it with shift d. */
int rs_desc_create_shared(void *base, const uint8_t *blob, uint32_t len, uint64_t tmpl, uint64_t *off_out);
/* rs_desc_create_shared over n candidate templates (each held, or 0), tried in order under one
 * arena lock; *used_out = index of the template shared, or -1 when a new block was created. */
int rs_desc_create_shared_any(void *base, const uint8_t *blob, uint32_t len, const uint64_t *tmpls,
                              uint32_t n, uint64_t *off_out, int *used_out);
/* d such that `to` equals `from` (both descriptor blobs of len bytes; `from` sane) except that
 * every slice's row_offset is higher by d <= RS_REF_MAX_SHIFT, or -1. Reads only the two blobs. */
int64_t rs_desc_blob_shift(const uint8_t *from, const uint8_t *to, uint32_t len);
/* Take n more references to the live DESC block of item reference `ref` for n items that differ
 * from it only by row shifts, after checking (rs_desc_validate) `blob`, the descriptor of the one
 * of them whose rows lie farthest: the others' rows then lie within the published rows too.
 * Takes the arena lock. */
int rs_desc_add_refs(void *base, uint64_t ref, uint32_t n, const uint8_t *blob, uint32_t len);
/* Drop n references to the DESC block of item reference `ref` (rs_desc_release n times); the
 * caller holds the arena lock. */
void rs_desc_release_n(void *base, uint64_t ref, uint32_t n);
/* Drop one reference (an item reference) to a DESC block; at zero drop its chunk references and
 * free it. Takes the arena lock unless `locked` (caller already holds it). */
void rs_desc_release(void *base, uint64_t desc_off, int locked);
/* Pin n descriptors (item references) for `slot` (refcount + pin-log entry of the block each).
 * Takes the arena lock. */
int rs_pin_descs(void *base, uint32_t slot, uint32_t n, const uint64_t *desc_offs, uint32_t *pins_out);
/* rs_unpin of pins that this call of the process took a moment ago (rs_sample_gather): their
 * log entries hold live blocks, so rs_unpin's per-pin validation is skipped. Takes the arena
 * lock. */
int rs_unpin_fresh(void *base, uint32_t slot, uint32_t n, const uint32_t *pins);
/* Read helpers (no lock; caller holds a pin or the table lock). rs_desc_blob takes an item
 * reference and returns its block's blob (add rs_ref_shift(ref) to every row_offset). */
const rs_desc_hdr *rs_desc_blob(void *base, uint64_t desc_off);
rs_chunk_hdr *rs_chunk(void *base, uint64_t chunk_off);
/* Is a chunk dtype ("O" / "|O") the object (msgpack payload) kind? Numeric chunks may also have
 * row_bytes 0 (zero-element rows such as shape (0, 3)), so row_bytes is no object marker. */
static inline int rs_dtype_is_object(const char *dtype) {
  return (dtype[0] == 'O' && dtype[1] == 0) || (dtype[0] == '|' && dtype[1] == 'O' && dtype[2] == 0);
}
/* Make at least n pins free for `slot`, growing its pin log (reserving pages) up to
 * pins_per_proc when needed. RS_OK, or RS_EFULL / RS_ENOSPC with a message. Caller holds the
 * arena lock (rs_pins_ensure takes it). */
int rs_pins_grow(void *base, uint32_t slot, uint32_t n);
int rs_pins_ensure(void *base, uint32_t slot, uint32_t n);
/* Reserve the pages of [off, off + len) of a growable segment (MADV_POPULATE_WRITE). RS_OK or
 * RS_ENOSPC with a message naming the settings that size the segment. */
int rs_reserve(void *base, uint64_t off, uint64_t len, const char *what);
/* Disk tier: start reading the pages of [p, p + len) of an arena file (MADV_WILLNEED), so that
 * the rows of a sampled batch are read from disk concurrently instead of one fault at a time. */
void rs_prefetch_file_rows(const void *p, uint64_t len);
/* The allocation serial of the DESC block whose blob is at arena offset desc_off (unique per
 * allocation in a segment: a blob freed and another allocated at its offset has another one), or
 * 0 when desc_off's block header lies outside the arena. Reads the header only (no lock): call it
 * for a blob that a table record or a pin holds. */
uint64_t rs_desc_serial(void *base, uint64_t desc_off);
/* Checker: is item reference `ref` a live DESC block whose blob fits it, every slice naming a
 * live chunk, with rs_item_in_arena? (Walks nothing; reads the blocks' headers.) */
int rs_item_ref_valid(void *base, uint64_t ref);
/* Verify allocator and refcount invariants; caller holds every lock. */
int rs_arena_check(void *base, char *report, uint64_t report_len);
/* Stop-the-world recount (caller holds every table lock and the arena lock). */
void rs_recount(void *base);

/* ------------------------------------------------------------------ bounds of read paths
 * Offsets that readers take from shared memory (descriptor blobs, their slices' chunk offsets,
 * chunk headers) are checked against the arena before they are dereferenced, so that a damaged
 * segment gives RS_ECORRUPT instead of a SIGSEGV. Arithmetic on header fields only: no walk. */
static inline int rs_arena_span_ok(void *base, uint64_t off, uint64_t len) {
  const rs_seg_hdr *h = rs_seg(base);
  uint64_t end = h->arena_off + h->arena_size;
  return off >= h->arena_off && off <= end && len <= end - off;
}
/* Is the chunk header at chunk_off (64-aligned, as every block payload) inside the arena, with
 * rows [first, first + n) within its capacity and its whole payload (capacity x row_bytes, and
 * nbytes) inside the arena? */
static inline int rs_chunk_rows_ok(void *base, uint64_t chunk_off, uint64_t first, uint64_t n) {
  if (chunk_off % RS_ALIGN || !rs_arena_span_ok(base, chunk_off, sizeof(rs_chunk_hdr))) return 0;
  const rs_chunk_hdr *c = (const rs_chunk_hdr *)rs_at(base, chunk_off);
  /* capacity and nbytes may shrink concurrently (rs_chunk_shrink, arena lock), never below the
   * published rows an item references: relaxed atomic loads, either value is safe here. */
  uint64_t cap = __atomic_load_n(&c->capacity, __ATOMIC_RELAXED);
  uint64_t nbytes = __atomic_load_n(&c->nbytes, __ATOMIC_RELAXED);
  uint64_t data = c->data_offset, bytes;
  if (first + n < first || first + n > cap) return 0;
  if (__builtin_mul_overflow(cap, c->row_bytes, &bytes)) return 0;
  if (!rs_arena_span_ok(base, chunk_off, data)) return 0;
  return rs_arena_span_ok(base, chunk_off + data, bytes) && rs_arena_span_ok(base, chunk_off + data, nbytes);
}
/* Is the descriptor blob of item reference `ref` 64-aligned inside the arena, with every
 * column's slices inside the blob? (Its slices' chunks are checked by rs_chunk_rows_ok where they are read.) */
static inline int rs_desc_in_arena(void *base, uint64_t ref) {
  uint64_t off = ref & ((1ull << RS_REF_OFF_BITS) - 1);
  if (off % RS_ALIGN || !rs_arena_span_ok(base, off, sizeof(rs_desc_hdr))) return 0;
  const rs_desc_hdr *d = (const rs_desc_hdr *)rs_at(base, off);
  uint64_t len = sizeof *d + (uint64_t)d->ncols * sizeof(rs_desc_col) + (uint64_t)d->nslices * sizeof(rs_desc_slice);
  if (!rs_arena_span_ok(base, off, len)) return 0;
  const rs_desc_col *cols = (const rs_desc_col *)(d + 1);
  for (uint32_t c = 0; c < d->ncols; c++)
    if ((uint64_t)cols[c].first_slice + cols[c].nslices > d->nslices) return 0;
  return 1;
}
/* rs_desc_in_arena, and every slice's rows (shifted by the reference's row shift) inside its
 * chunk's capacity and the arena. */
static inline int rs_item_in_arena(void *base, uint64_t ref) {
  if (!rs_desc_in_arena(base, ref)) return 0;
  const rs_desc_hdr *d = (const rs_desc_hdr *)rs_at(base, ref & ((1ull << RS_REF_OFF_BITS) - 1));
  const rs_desc_slice *s = (const rs_desc_slice *)((const char *)(d + 1) + (uint64_t)d->ncols * sizeof(rs_desc_col));
  uint64_t shift = ref >> RS_REF_OFF_BITS;
  for (uint32_t k = 0; k < d->nslices; k++)
    if (!rs_chunk_rows_ok(base, s[k].chunk_off, s[k].row_offset + shift, s[k].nrows)) return 0;
  return 1;
}
/* Is table t's header consistent with the layout its own configuration implies (every array
 * where rs_table_region_init put it, inside the segment before the arena)? RS_ECORRUPT naming
 * the first difference otherwise. */
int rs_table_layout_check(void *base, uint32_t t);

/* ------------------------------------------------------------------ util.c: streaming copy */
#define RS_STREAM_MIN_BYTES (16u << 10)
/* memcpy of n bytes into shared memory that no one reads soon (a fresh chunk): from
 * RS_STREAM_MIN_BYTES on, the 64-byte-aligned part of dst is written with non-temporal stores
 * (the destination lines are neither read first nor kept in the cache), then fenced. */
void rs_copy_stream(void *dst, const void *src, uint64_t n);

/* gather_thread.c: runs fn(ctx, begin, end) over the units [0, n), in grains of `grain` units
 * (the last may be shorter), shared between the calling thread and the process's gather helper
 * thread when it is enabled and free; otherwise one call fn(ctx, 0, n) on the calling thread.
 * Returns when every unit is done: the number of units the calling thread ran itself. fn must be
 * safe to run on two threads at once for distinct units. linger_ns > 0: afterwards the helper
 * waits up to that long for the next job (yielding its CPU) instead of sleeping at once. */
typedef void (*rs_units_fn)(void *ctx, uint32_t begin, uint32_t end);
uint32_t rs_run_units(rs_units_fn fn, void *ctx, uint32_t n, uint32_t grain, uint32_t linger_ns);
/* Wakes the gather helper, if it sleeps and no job has it, to wait briefly for a job that the
 * caller is about to hand over: its wake-up overlaps the caller's work before the copy. */
void rs_gather_prewake(void);

#endif
