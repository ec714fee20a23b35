/* Cross-round cache of checked item layouts (used by rs_sample_gather, table.c).
 *
 * Gathering an item of a large table reads, besides its record and rows, its descriptor blob and
 * the header of every chunk its slices name, to check the item's layout against the requested
 * columns and to find where its rows are. Those are cache and TLB misses of their own (a chunk
 * header is a page of its own), each round again. This process-local, per-thread cache keeps the
 * outcome per descriptor blob (where each single-slice column's row 0 is, its row size, and the
 * largest row shift whose rows lie in the chunks), so that a later round sampling an item of the
 * same blob reads neither.
 *
 * Validity. An entry is used while nothing was freed in the arena since it was filled: every
 * block free and chunk shrink (arena.c, under the arena lock) bumps the segment's `frees` count,
 * which a round reads once at its start under the table lock. A blob that is not freed keeps its
 * bytes, and so do the chunks it references (the blob holds a reference to each); a blob offset
 * met again after a free may be another blob. So an entry of an older count is used only when
 * the blob now at its offset is the allocation it was filled from: the same allocation serial
 * (rs_desc_serial, in the block header that sampling reads and pins anyway). In a table that
 * evicts as it is written (every insert into a full table frees the evicted items' blocks) the
 * count changes between any two rounds, and without serials every entry would be stale. (A chunk
 * shrink never takes rows that a live blob's items reference: the entry of a live blob stays
 * right.) Entries
 * are also tied to one mapping (base address, the segment's generation, and the process-wide
 * count of segments created, validated or checked: rs_lcache_forget) and to one requested column
 * layout (dtype, bytes, shape per column). Before its rows are read, an entry's row spans are
 * checked again against the arena's current bounds, so that even an entry stale by damage to the
 * segment never forms an address outside the arena. */
#ifndef RS_LAYOUT_CACHE_H
#define RS_LAYOUT_CACHE_H

#include "rs_internal.h"

#define RS_LC_COLS 8    /* columns an entry holds */
#define RS_LC_BITS 14   /* 16384 entries of 128 bytes: 2 MiB per sampling thread, allocated on use */

typedef struct __attribute__((packed)) rs_lc_col {
  uint64_t row0;        /* arena offset of the column's row 0 at row shift 0; 0: several slices */
  uint32_t row_bytes;
} rs_lc_col;

typedef struct rs_lc_entry {
  uint64_t blob;        /* rs_ref_off of the item reference; 0: empty */
  uint64_t frees;       /* the segment's free count when checked */
  uint32_t version;     /* rs_lcache.version when filled (0: never valid) */
  uint32_t max_shift;   /* largest row shift whose rows lie within every chunk's capacity */
  rs_lc_col col[RS_LC_COLS];   /* (3 columns fit the entry's first cache line) */
  uint64_t serial;      /* the blob's allocation serial (rs_desc_serial) when checked */
} __attribute__((aligned(128))) rs_lc_entry;

_Static_assert(sizeof(rs_lc_entry) == 128, "a cache entry is two cache lines");

typedef struct rs_lcache {
  rs_lc_entry *e;       /* 1 << RS_LC_BITS entries */
  const void *base;     /* the mapping the entries are of */
  uint64_t generation, mapping;
  uint32_t version, ncols;
  uint64_t frees;       /* the segment's free count at the start of the current round */
  rs_gather_col layout[RS_LC_COLS];   /* the requested columns (out and stride zeroed) */
} rs_lcache;

/* This thread's cache for gathers of `cols` from the segment at `base`, emptied when either
 * changed; NULL when there is none (more than RS_LC_COLS columns, or no memory). */
rs_lcache *rs_lcache_for(void *base, uint32_t ncols, const rs_gather_col *cols);

/* Every thread's cache is stale from now on: a segment was created, validated or checked (it
 * may be a different segment, or damaged bytes, at an address seen before). */
void rs_lcache_forget(void);

/* The segment's count of block frees and chunk shrinks (bumped under the arena lock). */
static inline uint64_t rs_lcache_frees(void *base) {
  return __atomic_load_n(&rs_seg(base)->frees, __ATOMIC_ACQUIRE);
}

static inline rs_lc_entry *rs_lc_slot(rs_lcache *lc, uint64_t blob) {
  return &lc->e[((blob >> 6) * 0x9E3779B97F4A7C15ull) >> (64 - RS_LC_BITS)];
}

/* The valid entry of `blob` whose every single-slice column's rows, at any shift up to its
 * max_shift, lie inside the arena; NULL when none. `blob` must be held (by a table record read
 * under the table lock, or a pin) when frees happened since the entry was filled: its block
 * header is then read for its serial. */
static inline const rs_lc_entry *rs_lc_find(rs_lcache *lc, void *base, uint64_t blob) {
  rs_lc_entry *e = rs_lc_slot(lc, blob);
  if (e->blob != blob || e->version != lc->version) return NULL;
  if (e->frees != lc->frees) {   /* the same allocation still? then its layout is unchanged */
    if (!e->serial || e->serial != rs_desc_serial(base, blob)) return NULL;
    e->frees = lc->frees;
  }
  for (uint32_t c = 0; c < lc->ncols; c++) {
    uint64_t row0 = e->col[c].row0, len;
    if (row0 && (__builtin_add_overflow((uint64_t)e->max_shift * e->col[c].row_bytes,
                                        lc->layout[c].col_bytes, &len) ||
                 !rs_arena_span_ok(base, row0, len)))
      return NULL;
  }
  return e;
}

#endif
