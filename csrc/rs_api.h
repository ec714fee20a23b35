/*
 * reverb_shm C core: the public API seen by cffi (this file is fed verbatim to
 * ffibuilder.cdef, so it holds no preprocessor directives and no macros).
 *
 * Conventions
 * - Every function returns an int status: RS_OK (0) or a negative RS_E* code.
 *   On error, rs_last_error() returns a thread-local, human readable message
 *   naming what was wrong and what was expected. Python maps codes to
 *   exceptions in exactly one place (reverb_shm/_internal/_lib.py).
 * - `base` is the address at which the calling process mapped the segment.
 *   Everything inside shared memory is addressed by byte offsets from base
 *   (uint64_t "off"), never by pointers, since every process maps it elsewhere.
 * - `slot` is the calling process's registered process slot (rs_proc_register).
 * - Deadlines are absolute CLOCK_MONOTONIC nanoseconds (rs_now_ns()); a
 *   deadline < 0 means "no deadline". Blocking calls also take `slice_ns`:
 *   they return RS_EAGAIN (with partial progress reported) when the slice
 *   expires before the deadline, so the Python layer can check signals and
 *   call again. Blocking is a futex wait on the table's sequence word; it never
 *   holds a lock while asleep. cffi releases the GIL around every call.
 * - Every operation validates all of its input before changing any state.
 */

/* ---- status codes ---- */
enum {
  RS_OK = 0,
  RS_EINVAL = -1,     /* bad argument (message says which / what expected) -> ValueError */
  RS_ENOSPC = -2,     /* arena has no room for the allocation -> MemoryError-ish (ResourceExhausted) */
  RS_ETIMEDOUT = -3,  /* deadline passed -> DeadlineExceededError */
  RS_ECLOSED = -4,    /* table / server closed (server stopped) -> RuntimeError */
  RS_ENOTFOUND = -5,  /* unknown table / key -> KeyError/RuntimeError per call site */
  RS_ECORRUPT = -6,   /* layout/version/magic mismatch or invariant violated -> RuntimeError */
  RS_EFULL = -7,      /* a fixed capacity is exhausted (process slots, pin log, episode map) */
  RS_EAGAIN = -8,     /* wait slice expired before the deadline; call again (partial progress reported) */
  RS_ESYS = -9,       /* a system call failed (message carries strerror) -> OSError */
  RS_EDEADOWNER = -10 /* the segment's owner (server process) is dead -> RuntimeError */
};

/* ---- selector kinds (sampler / remover) ---- */
enum {
  RS_SEL_UNIFORM = 0,
  RS_SEL_PRIORITIZED = 1,
  RS_SEL_FIFO = 2,
  RS_SEL_LIFO = 3,
  RS_SEL_MINHEAP = 4,
  RS_SEL_MAXHEAP = 5
};

/* ---- block types in the arena ---- */
enum { RS_BLOCK_FREE = 0, RS_BLOCK_CHUNK = 1, RS_BLOCK_DESC = 2 };

/* Configuration of one table, given at segment creation. */
typedef struct rs_table_config {
  char name[64];               /* NUL-terminated, 1..63 bytes, validated in Python */
  uint64_t max_size;           /* >= 1 */
  int32_t max_times_sampled;   /* < 1 means unlimited */
  int32_t sampler_kind;        /* RS_SEL_* */
  double sampler_exponent;     /* prioritized only */
  int32_t remover_kind;        /* RS_SEL_* */
  int32_t _pad0;
  double remover_exponent;     /* prioritized only */
  double samples_per_insert;   /* > 0 */
  int64_t min_size_to_sample;  /* >= 1 */
  double min_diff;
  double max_diff;
  const uint8_t *blob;         /* opaque msgpack config (Python: signature etc.), copied in */
  uint32_t blob_len;           /* <= 1 MiB */
  uint32_t _pad1;
} rs_table_config;

/* Header of a chunk: T rows ("steps") of one column, stored raw and C-contiguous
 * so that a slice of it is a numpy view. Lives at chunk_off; data at
 * chunk_off + data_offset (64-byte aligned). Written once by its writer: rows
 * grow monotonically (rs_chunk_publish_rows), rows already published never change. */
typedef struct rs_chunk_hdr {
  uint64_t episode_id;
  uint64_t start_step;   /* episode step index of row 0 */
  uint64_t row_bytes;    /* bytes per row; for object (variable) columns: 0 */
  uint64_t nbytes;       /* payload capacity in bytes */
  uint64_t data_offset;  /* from chunk_off to the first payload byte */
  uint32_t capacity;     /* rows that fit */
  uint32_t rows;         /* rows published (readers may use rows < this) */
  uint32_t ndim;         /* element rank (without the time dim), <= 8 */
  uint32_t flags;
  int64_t shape[8];      /* element shape */
  char dtype[16];        /* numpy dtype.str, e.g. "<f4", "|u1", "|b1", "<c16"; "O" = msgpack payload */
} rs_chunk_hdr;

/* Item descriptor blob (built by Python, copied into a DESC block by rs_insert):
 *   rs_desc_hdr, then ncols rs_desc_col, then nslices rs_desc_slice.
 * Column c of the item is the concatenation (along rows) of its slices
 * slices[first_slice .. first_slice+nslices). */
typedef struct rs_desc_hdr { uint32_t ncols; uint32_t nslices; } rs_desc_hdr;
typedef struct rs_desc_col { uint32_t first_slice; uint32_t nslices; uint32_t flags; uint32_t _pad; } rs_desc_col; /* flags bit0: squeeze (exactly one row, no time dim) */
typedef struct rs_desc_slice { uint64_t chunk_off; uint32_t row_offset; uint32_t nrows; } rs_desc_slice;

/* One sampled item. */
typedef struct rs_sample_rec {
  uint64_t key;
  double probability;
  int64_t table_size;     /* items in the table when sampled (before a max_times_sampled removal) */
  double priority;
  int32_t times_sampled;  /* including this sample */
  uint32_t pin;           /* pin-log index holding desc alive; release with rs_unpin */
  uint64_t desc_off;      /* item reference (see rs_desc_ref_off_bits at the end of this file) */
} rs_sample_rec;

/* One item as listed by rs_table_items (checkpoint, tests, introspection). */
typedef struct rs_item_rec {
  uint64_t key;
  double priority;
  int64_t times_sampled;
  uint64_t insert_seq;     /* insertion order (Fifo/Lifo) */
  uint64_t update_seq;     /* heap tie-break counter (last insert or update) */
  int64_t inserted_at_ns;  /* CLOCK_REALTIME at insert */
  uint64_t desc_off;
} rs_item_rec;

typedef struct rs_table_stats {
  uint64_t max_size;
  int64_t max_times_sampled;
  int32_t sampler_kind; int32_t remover_kind;
  double sampler_exponent; double remover_exponent;
  double samples_per_insert; int64_t min_size_to_sample; double min_diff; double max_diff;
  int64_t size;
  int64_t inserts; int64_t samples; int64_t deletes;   /* rate limiter counters */
  int64_t num_episodes; int64_t num_deleted_episodes; int64_t num_unique_samples;
  int64_t closed;
  /* cumulative time in ns: holding the lock for inserts / samples; blocked waiting */
  int64_t inserting_ns; int64_t sampling_ns; int64_t waiting_for_sampling_ns; int64_t waiting_for_inserts_ns;
  int64_t repairs;          /* times the table was repaired after a dead lock owner */
  /* Prioritized sampler: the sum tree's root, the sum of priority**exponent over the items
   * (what a sample's probability divides by); 0 for other samplers. */
  double sampler_total_weight;
} rs_table_stats;

typedef struct rs_segment_info {
  uint64_t total_size;
  uint64_t arena_size;      /* bytes */
  uint64_t arena_used;      /* bytes in allocated blocks (incl. headers) */
  uint64_t arena_free;
  uint64_t num_chunks;
  uint64_t num_descs;
  uint32_t num_tables;
  uint32_t max_procs;
  uint32_t pins_per_proc;
  uint32_t live_procs;
  int32_t owner_pid;
  int32_t closed;
  uint64_t owner_start_time; /* /proc/<pid>/stat starttime (clock ticks since boot) */
  uint64_t generation;       /* random id of this incarnation */
  uint64_t layout_version;
  uint64_t arena_max;        /* the arena may grow up to this many bytes */
  uint64_t max_bytes;        /* budget of reserved bytes (arena end + pin logs); 0 = none */
  uint64_t reserved_bytes;   /* bytes reserved now: everything up to the arena's end + pin logs */
  uint64_t extents;          /* growth steps of the arena so far */
  uint64_t pins_reserved;    /* bytes of pin logs reserved */
  uint32_t growable;
  uint32_t arena_file;       /* 1: chunk data and descriptors live in a file (disk tier) */
  uint64_t arena_off;
} rs_segment_info;

/* ---- time, processes ---- */
int64_t rs_now_ns(void);                                  /* CLOCK_MONOTONIC */
/* Seeds the calling thread's random number generator, the one this thread's sampling (selectors'
 * picks) and random keys draw from: the same seed gives the same draws, so the same picks on the
 * same table content. Threads start seeded at random; a forked child is reseeded at random. */
void rs_rand_seed_thread(uint64_t seed);
uint64_t rs_proc_start_time(int32_t pid);   /* 0 if no such process, or it exited (a zombie) */
const char *rs_last_error(void);

/* ---- segment ---- */
/* Bytes needed for a segment holding these tables (0 and rs_last_error on bad config). */
uint64_t rs_segment_size(const rs_table_config *cfgs, uint32_t ntables, uint32_t max_procs,
                         uint32_t pins_per_proc, uint64_t arena_bytes);
/* Lay out a fresh, zero-filled segment of `size` bytes (size from rs_segment_size). */
int rs_segment_init(void *base, uint64_t size, const rs_table_config *cfgs, uint32_t ntables,
                    uint32_t max_procs, uint32_t pins_per_proc, uint64_t arena_bytes,
                    int32_t owner_pid, uint64_t owner_start_time, uint64_t generation);
/* A growable segment: the arena starts at arena_bytes and may grow to arena_max bytes, and pin
 * logs start with their first pins reserved and grow to pins_per_proc, while arena end + pin logs stay within max_bytes
 * (0 = no budget). Returns the layout's (virtual) size; *initial_out = the bytes from offset 0
 * the creator must reserve before rs_segment_init_ex (header, tables, first arena). The mapping
 * must be shared and file-backed (pages beyond the reservation are reserved as they are used). */
uint64_t rs_segment_size_ex(const rs_table_config *cfgs, uint32_t ntables, uint32_t max_procs,
                            uint32_t pins_per_proc, uint64_t arena_bytes, uint64_t arena_max,
                            uint64_t *initial_out);
/* Bytes of /dev/shm the pin logs of a growable segment reserve when it starts (the first pins of
 * every slot's log, so that any process can always attach and sample), beyond *initial_out. */
uint64_t rs_segment_start_pin_bytes(uint32_t max_procs, uint32_t pins_per_proc);
int rs_segment_init_ex(void *base, uint64_t size, const rs_table_config *cfgs, uint32_t ntables,
                       uint32_t max_procs, uint32_t pins_per_proc, uint64_t arena_bytes,
                       uint64_t arena_max, uint64_t max_bytes, int32_t owner_pid,
                       uint64_t owner_start_time, uint64_t generation);
/* Disk tier: map `len` bytes of file `fd` over [base + arena_off, ...) of this process's mapping
 * of a growable segment (MAP_FIXED; arena_off page-aligned) and remember fd for the arena's
 * growth (posix_fallocate instead of reserving shared-memory pages). Call before
 * rs_segment_init_ex (creator) or before any access to the arena (attacher).
 * rs_unmap_arena_file forgets the fd (the caller closes it). */
int rs_map_arena_file(void *base, uint64_t arena_off, uint64_t len, int fd);
void rs_unmap_arena_file(void *base);
void rs_segment_set_arena_file(void *base);
/* Validate magic, layout version, sizes and ready flag of a mapped segment of `size` bytes. */
int rs_segment_validate(void *base, uint64_t size);
int rs_segment_get_info(void *base, rs_segment_info *out);
/* Close every table: blocked and future inserts/samples fail with RS_ECLOSED. Wakes all waiters. */
int rs_segment_close(void *base);

/* ---- liveness across pid namespaces (liveness.c) ---- */
/* Each live process holds an open-file-description read lock on one byte of its segment's file:
 * the owner byte 0, the process of slot s byte 1 + s. rs_live_lock takes (hold 1) or drops (0)
 * one through `fd`; rs_live_probe tells whether another open file description holds a byte
 * (1 held, 0 free, -1 error: e.g. a kernel without OFD locks). rs_set_liveness_fd registers this
 * process's fd of the file of the segment mapped at `base`: rs_proc_register / unregister then
 * take / drop the slot's byte through it (under the registry lock, so a reaper never sees a
 * new slot without its lock), and rs_owner_check, rs_reap and rs_proc_list count a held byte
 * as alive. rs_forget_liveness_fd forgets it if `fd` is the one registered (call it before
 * closing fd). */
int rs_set_liveness_fd(void *base, int fd);
void rs_forget_liveness_fd(void *base, int fd);
int rs_live_lock(int fd, uint64_t byte, int hold);
int rs_live_probe(int fd, uint64_t byte);

/* ---- process slots ---- */
int rs_proc_register(void *base, int32_t pid, uint64_t start_time, uint32_t *slot_out);
/* Release every pin still held by the slot, then free the slot. */
int rs_proc_unregister(void *base, uint32_t slot);
/* Find slots whose process is dead (pid gone or start time differs); if any, stop the world
 * (every table lock + arena lock), free their slots and recount every refcount from scratch,
 * freeing unreferenced blocks (their pins, half-written chunks). *reaped_out = slots reaped. */
int rs_reap(void *base, uint32_t *reaped_out);

/* ---- tables ---- */
int rs_table_find(void *base, const char *name, uint32_t *table_out);  /* RS_ENOTFOUND */
int rs_table_name(void *base, uint32_t table, char *out64);
int rs_table_blob(void *base, uint32_t table, uint64_t *off_out, uint32_t *len_out);
int rs_table_get_stats(void *base, uint32_t table, rs_table_stats *out);
/* Pure rate-limiter predicates (Reverb semantics, see limiter.h). 1 = true, 0 = false, <0 error. */
int rs_can_insert(void *base, uint32_t table, int64_t n);
int rs_can_sample(void *base, uint32_t table, int64_t n);

/* ---- chunks (writer side) ---- */
/* Allocate a chunk with room for `capacity` rows of `row_bytes` (object columns: row_bytes 0 and
 * nbytes explicit). The chunk is held by `slot` through a pin (returned in *pin_out) until
 * rs_unpin; data is written by the caller at off + hdr->data_offset. RS_ENOSPC when it cannot fit
 * (the message says how many bytes were needed and how many are free). */
int rs_chunk_alloc(void *base, uint32_t slot, const rs_chunk_hdr *meta, uint64_t *off_out,
                   uint32_t *pin_out);
/* Publish rows [0, rows) as written (monotonic; release ordering). */
int rs_chunk_publish_rows(void *base, uint64_t chunk_off, uint32_t rows);
/* Return the unused tail (rows beyond `rows`) to the arena; capacity becomes rows (>= 1). */
int rs_chunk_shrink(void *base, uint64_t chunk_off, uint32_t rows);
/* Drop pins (chunk holds or sample pins) held by `slot`. Frees blocks whose refcount reaches 0. */
int rs_unpin(void *base, uint32_t slot, uint32_t n, const uint32_t *pins);
uint64_t rs_desc_data_offset(void);   /* descriptor blob = desc_off + this */

/* ---- items ---- */
/* Insert n items. blob holds n descriptor blobs; item i is blob[blob_offs[i] .. blob_offs[i+1]).
 * All input is validated first (priorities finite, >= 0 for a Prioritized sampler/remover; every
 * descriptor well formed, chunk offsets valid, rows published, consistent dtypes within a column);
 * nothing changes on error. Then each item waits (deadline/slice) for can_insert(1) and is
 * inserted; an existing key is a priority update (no counter change). Overflow beyond max_size
 * removes the remover's choice (may be the new item). *done_out = items inserted so far
 * (on RS_EAGAIN / RS_ETIMEDOUT / RS_ECLOSED the caller retries or reports the rest). */
int rs_insert(void *base, uint32_t slot, uint32_t table, uint32_t n, const uint64_t *keys,
              const double *priorities, const uint8_t *blob, const uint64_t *blob_offs,
              int64_t deadline_ns, int64_t slice_ns, uint32_t *done_out);
/* Sample up to n items (independently, with replacement, each subject to can_sample(1)).
 * Results are appended to out[*got_io ...]: the caller passes *got_io = items already collected
 * (0 on the first call) and calls again after RS_EAGAIN. Returns RS_OK when *got_io == n;
 * RS_ETIMEDOUT at the deadline (partial batch if *got_io > 0: flexible batch);
 * RS_EAGAIN when the slice expires first. Each returned item's descriptor is pinned for `slot`
 * (out[i].pin) and must be released with rs_unpin. */
int rs_sample(void *base, uint32_t slot, uint32_t table, uint32_t n, int64_t deadline_ns,
              int64_t slice_ns, rs_sample_rec *out, uint32_t *got_io);
/* Copy column `col` of n items (descriptors desc_offs[i]) into out + i*out_stride. Each item's
 * column must be exactly `col_bytes` bytes (rows * row_bytes), else RS_EINVAL naming the item. */
int rs_gather(void *base, uint32_t n, const uint64_t *desc_offs, uint32_t col,
              uint8_t *out, uint64_t out_stride, uint64_t col_bytes);
/* Deletes first, then updates (as Reverb does); unknown keys ignored; all priorities validated
 * before anything changes. Counts of effective updates/deletes returned. Wakes waiters. */
int rs_mutate(void *base, uint32_t table, uint32_t n_upd, const uint64_t *upd_keys,
              const double *upd_prios, uint32_t n_del, const uint64_t *del_keys,
              uint32_t *updated_out, uint32_t *deleted_out);
/* Remove all items, zero the limiter counters and episode/unique counters; wakes waiters. */
int rs_reset(void *base, uint32_t table);
/* List up to cap items ordered by insert_seq; *n_out = number written, *size_out = table size. */
int rs_table_items(void *base, uint32_t table, rs_item_rec *out, uint64_t cap, uint64_t *n_out,
                   uint64_t *size_out);
/* Lookup one key: RS_ENOTFOUND if absent. */
int rs_table_get(void *base, uint32_t table, uint64_t key, rs_item_rec *out);

/* ---- invariants ---- */
/* Take every lock and verify every invariant (see csrc/check.c); on violation returns
 * RS_ECORRUPT and writes a report (NUL-terminated) into report[0..report_len). */
int rs_check(void *base, char *report, uint64_t report_len);

/* ================================================================ checkpoint support
 * A snapshot lists every table's items, descriptors and counters under all table locks (taken
 * in index order, held only for the listing) and keeps every referenced chunk alive through
 * "holds": descriptor blocks naming up to a few thousand chunks each, pinned once each by the
 * snapshotting process. A hold is an ordinary pinned descriptor, so a dead process's holds are
 * reclaimed by rs_reap's recount like any pin, and one pin covers thousands of chunks (a 1M-item
 * table needs a few hundred pins, far below pins_per_proc). Restore rebuilds tables from saved
 * records, bypassing the rate limiter and keeping keys, priorities, times_sampled and the
 * insertion/update order. */

/* Counters of one table. */
typedef struct rs_table_counters {
  int64_t size;
  int64_t inserts; int64_t samples; int64_t deletes;
  int64_t num_episodes; int64_t num_deleted_episodes; int64_t num_unique_samples;
} rs_table_counters;

typedef struct rs_snapshot_table {
  rs_table_counters counters;
  uint64_t n_items;
  rs_item_rec *items;      /* insertion order; desc_off = byte offset of the item's descriptor in descs */
  uint64_t descs_len;
  uint8_t *descs;          /* descriptor copies (8-byte aligned), each slice's chunk_off replaced by the
                            * chunk's id: its index in rs_snapshot.chunk_offs */
} rs_snapshot_table;

/* Process-local (malloc'd) result of rs_snapshot_take; free with rs_snapshot_release. */
typedef struct rs_snapshot {
  uint32_t num_tables;
  uint32_t num_holds;
  uint64_t n_chunks;
  uint64_t *chunk_offs;    /* chunk id -> chunk offset; every chunk stays alive until release */
  uint32_t *hold_pins;     /* pins of `slot` holding the chunks */
  rs_snapshot_table *tables;
  int64_t locked_ns;       /* how long every table lock was held (the pause others saw) */
} rs_snapshot;

/* Consistent snapshot of every table (see above). RS_ENOSPC if the arena cannot hold the hold
 * descriptors (about 32 bytes per distinct chunk), RS_EFULL without free pins. */
int rs_snapshot_take(void *base, uint32_t slot, rs_snapshot **out);
/* Drop the snapshot's holds (chunks whose items are gone are freed) and free its memory. */
int rs_snapshot_release(void *base, uint32_t slot, rs_snapshot *snap);
/* Keep n live chunks alive with one pin of `slot` (*pin_out; release with rs_unpin). */
int rs_hold_chunks(void *base, uint32_t slot, uint32_t n, const uint64_t *chunk_offs,
                   uint32_t *pin_out);
/* Restore n items into EMPTY table `table`, bypassing the rate limiter: item i gets key,
 * priority, times_sampled, insert_seq, update_seq and inserted_at_ns of items[i]; its descriptor
 * is at descs + items[i].desc_off with chunk ids (indexes into chunk_map, which gives live chunk
 * offsets). Everything is validated first (keys distinct, n <= max_size, priorities valid for
 * the selectors, times_sampled below max_times_sampled, descriptors well formed); nothing
 * changes on error. Limiter counters become inserts = n, samples = deletes = 0. */
int rs_restore_items(void *base, uint32_t table, uint64_t n, const rs_item_rec *items,
                     const uint8_t *descs, uint64_t descs_len, const uint64_t *chunk_map,
                     uint64_t n_chunks);
/* Set inserts, samples, deletes, num_deleted_episodes, num_unique_samples (size and
 * num_episodes are derived from the items and must equal the table's). Wakes waiters. */
int rs_restore_counters(void *base, uint32_t table, const rs_table_counters *c);
/* Forget the limiter history without dropping items: inserts = size, deletes = 0 and samples
 * the smallest count >= 0 that puts inserts * samples_per_insert - samples within
 * [min_diff, max_diff] (as if the items had just been inserted). Wakes waiters. */
int rs_table_reset_limiter(void *base, uint32_t table);

/* ---- batched fast paths (one C call per batch) ---- */

/* Where rs_sample_gather copies column c of the i-th sampled item: out + i * stride, exactly
 * col_bytes bytes (rows x row_bytes, all slices concatenated). Every chunk the column reads must
 * have dtype `dtype` (rs_chunk_hdr.dtype, compared over all 16 bytes). */
typedef struct rs_gather_col {
  uint8_t *out;
  uint64_t stride;
  uint64_t col_bytes;
  char dtype[16];
  /* The column's shape as sampled: (rows, *element shape), or the element shape when the item
   * squeezes the column. Items whose column has another shape (same dtype and bytes, e.g. 2 rows
   * of [] vs 1 row of [2], or a squeezed [3] vs 1 row of [3]) are of another layout. */
  uint32_t ndim;         /* <= 9 */
  uint32_t _pad;
  int64_t shape[9];
} rs_gather_col;

/* rs_sample, then copy every column of the sampled items into caller buffers: rounds of up to
 * 256 items are sampled and pinned under the table lock, gathered with no lock held and unpinned.
 * Only items with exactly ncols columns matching cols[] are taken (checked under the lock before
 * anything changes): an item of another layout stays unsampled and, when it is the first pick of
 * a round, the call returns RS_EINVAL naming it (the *got_io items gathered before are valid).
 * `info` (8-byte aligned, 36 * n bytes) receives the info of sampled item i at index i of five
 * arrays laid out one after the other: uint64 key[n], double probability[n], int64 table_size[n],
 * double priority[n], int32 times_sampled[n] (one caller buffer instead of five).
 * It waits (deadline, slice) only while *got_io < wait_n (0..n); past that it takes just what the
 * rate limiter allows right away and returns RS_OK, so wait_n = n behaves as rs_sample and
 * wait_n = 1 is Reverb's client: one item when available, plus whatever else is ready.
 * *got_io, the other return codes and flexible batches as rs_sample. */
int rs_sample_gather(void *base, uint32_t slot, uint32_t table, uint32_t n, uint32_t wait_n,
                     int64_t deadline_ns, int64_t slice_ns, uint32_t ncols,
                     const rs_gather_col *cols, void *info, uint32_t *got_io);

/* Threads that this process's large gathers use (rs_sample_gather rounds of >= 256 KiB copied
 * from memory: frames; of 128-256 KiB that copy slowly: rs_set_gather_share_ns): 1, the calling thread only; 2, shared with one helper thread per process,
 * started by the first such gather. `threads` 0 only reports the setting in *previous (when
 * non-NULL); 1 stops and joins the helper (after a gather in flight); 2 lets the next large
 * gather start it. The default is REVERB_SHM_GATHER_THREADS (1 or 2) when set, else 2 when the
 * process may run on >= 2 CPUs. RS_EINVAL for threads > 2. */
int rs_set_gather_threads(uint32_t threads, uint32_t *previous);
/* 1 while this process's gather helper thread exists, else 0. */
int rs_gather_helper_running(void);
/* Rounds of 128-256 KiB are shared with the helper too when the calling thread's recent rounds
 * copied slowly enough that the round is expected to take at least `ns` nanoseconds (rows that
 * miss the caches; default 20000). 0 shares every such round, UINT32_MAX none. The previous
 * value goes to *previous (when non-NULL). Process-wide; always RS_OK. */
int rs_set_gather_share_ns(uint32_t ns, uint32_t *previous);

/* rs_insert of n items whose every column is a single slice: column c of item i is
 * slices[i * ncols + c], squeezed (no time dim) when col_flags[c] & 1. The descriptors are built
 * in C; validation, blocking and *done_out as rs_insert. keys NULL: random keys (rs_rand_u64). */
int rs_insert_slices(void *base, uint32_t slot, uint32_t table, uint32_t n, const uint64_t *keys,
                     const double *priorities, uint32_t ncols, const rs_desc_slice *slices,
                     const uint32_t *col_flags, int64_t deadline_ns, int64_t slice_ns,
                     uint32_t *done_out);

/* Allocate one chunk per column (header metas[c] with capacity = rows, nbytes = rows x row_bytes
 * and episode_id / start_step set here), copy rows x row_bytes bytes from data[c] and publish the
 * rows. All or nothing: on error no chunk stays allocated. The chunks are held by `slot` through
 * pins_out[c] (release with rs_unpin once items reference them); offsets in offs_out[c]. */
int rs_write_chunks(void *base, uint32_t slot, uint32_t ncols, const rs_chunk_hdr *metas,
                    const uint8_t *const *data, uint32_t rows, uint64_t episode_id,
                    uint64_t start_step, uint64_t *offs_out, uint32_t *pins_out);

/* ---- metadata ---- */
/* Item references. rs_sample_rec.desc_off, rs_item_rec.desc_off (of rs_table_items/rs_table_get)
 * and the desc_offs of rs_gather/rs_pin are item references: bits 0..N-1 (N = the value returned
 * here) are the DESC block's offset, the bits above a row shift to add to every slice's
 * row_offset of the blob stored there. Items that differ only by one row offset (a batch of
 * rows, the sliding windows of a trajectory writer) share a DESC block this way. Snapshot
 * descriptors (rs_snapshot_table.descs) are per item with the shift already applied. */
uint32_t rs_desc_ref_off_bits(void);

/* ---- hot paths: one C call per small insert ---- */
enum {
  RS_ROWS_RANDOM_KEYS = 1,     /* rs_insert_rows: draw keys[0..n) here (rs_rand_u64) first */
  RS_ROWS_RANDOM_EPISODE = 2   /* rs_insert_rows: draw the chunks' episode id here */
};
/* rs_write_chunks of n rows per column, then rs_insert_slices of n items where item i is row i
 * of every column (squeezed when col_flags[c] & 1, else one row with a time dim), then the
 * chunks' writer pins are dropped: alloc, copy, descriptors and insert in one call.
 * keys: uint64[n], filled here when flags & RS_ROWS_RANDOM_KEYS. Validation, blocking and
 * *done_out as rs_insert; nothing is written when the input is invalid or the arena is full.
 * On RS_EAGAIN (the wait slice expired; *done_out items inserted) the chunks stay held by
 * `slot`: chunk_offs_out[c] / pins_out[c] (ncols each) let the caller finish with
 * rs_insert_slices and release them with rs_unpin. On every other return they are released. */
int rs_insert_rows(void *base, uint32_t slot, uint32_t table, uint32_t n, uint64_t *keys,
                   const double *priorities, uint32_t ncols, const rs_chunk_hdr *metas,
                   const uint8_t *const *data, const uint32_t *col_flags, uint64_t episode_id,
                   uint32_t flags, int64_t deadline_ns, int64_t slice_ns,
                   uint64_t *chunk_offs_out, uint32_t *pins_out, uint32_t *done_out);

/* ---- trajectory writer ---- */
/* One run of a writer column: history positions [first_pos, first_pos + nrows) stored as rows
 * [row_offset, row_offset + nrows) of the chunk at chunk_off. */
typedef struct rs_window_seg { int64_t first_pos; uint64_t chunk_off; uint32_t row_offset; uint32_t nrows; } rs_window_seg;
/* Descriptors (rs_insert layout) of n items over column windows. Column c's runs are
 * segs[col_segs[c] .. col_segs[c+1]), sorted by first_pos, not overlapping. Column c of item i
 * covers lengths[c] positions from starts[i * starts_stride + c] (starts_stride ncols) or
 * starts[i] (starts_stride 1); a negative start counts from col_ends[c] (col_ends NULL: none
 * are negative). It gets one slice per run it crosses; squeezed when col_flags[c] & 1 (the
 * window must then hold one step). Validated first, for every item: priorities[i] (unless NULL)
 * finite, and >= 0 when nonneg; every window non-empty and inside the runs. RS_EINVAL names the
 * item and column. *size_out = descriptor bytes needed; blob NULL only validates and sizes.
 * RS_EFULL when blob_cap < *size_out. Otherwise item i is blob[offs[i] .. offs[i+1]). */
int rs_encode_windows(uint32_t n, uint32_t ncols, const rs_window_seg *segs,
                      const uint32_t *col_segs, const int64_t *col_ends, const uint32_t *col_flags,
                      const uint32_t *lengths, const int64_t *starts, uint32_t starts_stride,
                      const double *priorities, uint32_t nonneg, uint8_t *blob, uint64_t blob_cap,
                      uint64_t *offs, uint64_t *size_out);

/* ---- gRPC bridge ---- */
/* Groups n sampled items (pinned by the caller) by column layout: group_out[i] is the group of
 * item i, numbered from 0 in order of first appearance. Items of one group have the same number
 * of columns and, per column, the same squeeze flag, total rows, and dtype / element shape in
 * every chunk the column reads, so rs_gather copies each column of a group into one array.
 * An item with an object column (row_bytes 0) or mixed element types within a column, and the
 * items of layouts beyond the first max_groups (<= 64), get UINT32_MAX. *ngroups_out = groups. */
int rs_group_layouts(void *base, uint32_t n, const uint64_t *desc_offs, uint32_t max_groups,
                     uint32_t *group_out, uint32_t *ngroups_out);

/* ---- priority caps checked before staging ---- */
/* Largest priority whose weight (priority ** exponent) every Prioritized selector of the table
 * admits, computed with pow (callers compare with a small margin and confirm a priority above
 * it with rs_check_priorities); +inf without a Prioritized selector, NaN for a bad table. */
double rs_table_priority_bound(void *base, uint32_t table);
/* RS_OK when every priority would be admitted by an insert into the table (finite; >= 0 and
 * weight within the sum-tree cap for Prioritized selectors), else RS_EINVAL naming the first
 * bad one. Reads only the table's fixed configuration: no lock, no state change. */
int rs_check_priorities(void *base, uint32_t table, uint32_t n, const double *priorities);

/* ---- open chunks: per-step inserts appending to chunks held open ---- */
enum {
  RS_CHUNK_ROW_EPISODES = 1   /* rs_chunk_hdr.flags: row r is its own episode, episode_id + r */
};
/* Allocate one chunk per column with room for `capacity` rows (header metas[c], with capacity,
 * nbytes, episode_id and flags set here) and no row published: open chunks that a writer fills
 * row by row (rs_insert_rows_at). flags & RS_ROWS_RANDOM_EPISODE: the chunks get a random
 * episode id and RS_CHUNK_ROW_EPISODES (each row its own episode, as each Client.insert item);
 * else episode_id and the metas' flags. All or nothing; held by `slot` through pins_out[c]. */
int rs_open_chunks(void *base, uint32_t slot, uint32_t ncols, const rs_chunk_hdr *metas,
                   uint32_t capacity, uint64_t episode_id, uint32_t flags, uint64_t *offs_out,
                   uint32_t *pins_out);
/* rs_insert_rows into rows [first_row, first_row + n) of open chunks the caller holds
 * (chunk_offs[c], one per column; rows not written before): copies n rows per column from
 * data[c] and publishes them (a chunk's row count only grows, so concurrent writers of other
 * rows may publish in any order), then inserts n items (item i = row first_row + i of every
 * column) as rs_insert_slices. data NULL: the rows are already written and published (the
 * continuation after RS_EAGAIN with keys + done, priorities + done, first_row + done and flags
 * without RS_ROWS_RANDOM_KEYS). Rows of items not inserted stay unreferenced (wasted space,
 * never visible). RS_EINVAL, with nothing written, for an invalid priority or rows that do not
 * fit a numeric chunk of the arena. Validation, blocking and *done_out as rs_insert. */
int rs_insert_rows_at(void *base, uint32_t slot, uint32_t table, uint32_t n, uint64_t *keys,
                      const double *priorities, uint32_t ncols, const uint64_t *chunk_offs,
                      uint32_t first_row, const uint8_t *const *data, const uint32_t *col_flags,
                      uint32_t flags, int64_t deadline_ns, int64_t slice_ns, uint32_t *done_out);

/* ---- operation counters (csrc/counters.c) ----
 * Counted per process slot and table by the process that does the work (no shared cache line
 * is written for them), summed over slots here. Reading takes no lock and writes nothing: the
 * figures of a busy table are each a moment's value, not one consistent snapshot. Totals are
 * cumulative since the segment was created (a table reset does not zero them). */
typedef struct rs_table_counts {
  uint64_t inserts;         /* items inserted (new keys) */
  uint64_t samples;         /* items sampled */
  uint64_t updates;         /* priority updates (mutate_priorities, and inserts of an existing key) */
  uint64_t deletes;         /* items deleted by mutate_priorities */
  uint64_t evictions;       /* items removed by the remover because the table was full */
  uint64_t expirations;     /* items removed on reaching max_times_sampled */
  uint64_t insert_bytes;    /* payload bytes referenced by inserted items (a step in several
                             * items counts once per item) */
  uint64_t lock_holds;      /* table-lock holds by insert / sample / mutate / reset calls */
  uint64_t lock_hold_ns;    /* their total duration (ns) */
  uint64_t hold_hist[24];   /* holds by duration: [0] < 128 ns, [b] in [2**(b+6), 2**(b+7)) ns,
                             * [23] >= 2**29 ns */
  uint32_t blocked_inserters;  /* threads of live processes blocked on the rate limiter now */
  uint32_t blocked_samplers;
  /* table state, read without the lock */
  int64_t size;
  uint64_t max_size;
  int64_t num_episodes;
  int64_t limiter_inserts;  /* the rate limiter's counters (zeroed by a reset) */
  int64_t limiter_samples;
  int64_t limiter_deletes;
  double samples_per_insert;
  int64_t min_size_to_sample;
  double min_diff;
  double max_diff;
  double diff;              /* limiter_inserts * samples_per_insert - limiter_samples */
  int32_t can_insert;       /* the limiter admits one more insert / sample now */
  int32_t can_sample;
  int64_t insert_blocked_ns;   /* cumulative time inserts spent blocked (ns) */
  int64_t sample_blocked_ns;   /* cumulative time samples spent blocked (ns) */
  int32_t closed;
  int32_t _pad;
} rs_table_counts;

int rs_counters_read(void *base, uint32_t table, rs_table_counts *out);

/* One attached process (a registered slot). */
typedef struct rs_proc_info {
  int32_t pid;
  uint32_t slot;
  uint32_t pins;           /* live pins: chunks held by writers plus sampled items held */
  uint32_t alive;          /* 0: the process is gone (its slot waits to be reaped) */
  uint64_t start_time;     /* /proc/<pid>/stat starttime */
} rs_proc_info;

/* List up to cap registered slots in slot order; *n_out = number written. */
int rs_proc_list(void *base, rs_proc_info *out, uint32_t cap, uint32_t *n_out);

/* ---- waiting for a table to change (table_wait.c) ---- */
/* *seq_out = the table's change counter: every insert, sample, delete, priority update,
 * reset, restore and close moves it (and wakes rs_table_wait_change's waiters). */
int rs_table_seq(void *base, uint32_t table, uint32_t *seq_out);
/* Sleeps until the table's change counter differs from `seen` (RS_OK, also on a spurious
 * wake-up: read it again) or until deadline_ns (CLOCK_MONOTONIC; -1: none): RS_ETIMEDOUT.
 * Takes no lock and changes nothing; the caller keeps the segment mapped meanwhile. */
int rs_table_wait_change(void *base, uint32_t table, uint32_t seen, int64_t deadline_ns);

/* ---- polling a descriptor (fd_spin.c) ---- */
/* 1 once descriptor fd has an event (readable, hung up or in error) within spin_ns
 * nanoseconds, polled without blocking and yielding the CPU between polls; else 0 (also when
 * a signal interrupted a poll). Never blocks: the bridge's direct port polls for a reply due
 * soon with this (the GIL released) before it blocks in a poll of its own. */
int rs_spin_readable(int fd, int64_t spin_ns);
