/* Arena: a block allocator over [arena_off, arena_off + arena_size) holding chunks and item
 * descriptors, with their reference counts and the per-process pin logs.
 *
 * Structure and crash safety
 * - The arena is a chain of blocks, each starting with a 64-byte rs_blk header. Walking the chain
 *   from arena_off by block size is the single source of truth. Every change of the chain (split,
 *   merge, type change) commits with ONE aligned 8-byte release store of a header's `word`
 *   (size | type), made after every header it exposes has been fully written. A process killed
 *   at any instruction therefore leaves either the old chain or the new one.
 * - Everything else is derived and rebuilt by rs_arena_repair: the segregated free lists
 *   (power-of-two size classes, doubly linked), prev_size (O(1) backward merge), arena_used,
 *   num_chunks, num_descs and the pin-log free stacks.
 * - Reference counts are exact while every process lives; after a dead arena-lock owner they are
 *   "suspect" and rs_recount (stop the world) recomputes them from the truth: table records,
 *   pin-log entries and the descriptors' slices.
 *
 * - Growth (growable segments): when no free block fits, the arena reserves the pages of a further
 *   extent past its end, writes a free block header there (not yet in the chain), then commits
 *   with ONE release store of arena_size (the block joins the chain; extents counts the step),
 *   and finally merges it into a free last block. Killed before the commit: the old arena, with
 *   some spare reserved pages; after it: two adjacent free blocks, which repair merges. The same
 *   holds for pin logs: pages reserved first, then pin_cap stored; free stacks are derived.
 *
 * Offsets handed out (chunk_off, desc_off, pin-log entries) point just past the block header:
 * a chunk's rs_chunk_hdr or a descriptor's blob copy. All locking is by the caller unless a
 * function says it takes the arena lock.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rs_internal.h"

#define BLK_MAGIC 0x6b6c4252u      /* "RBlk" */
#define TYPE_MASK 63ull            /* low bits of the commit word (sizes are multiples of 64) */
#define PIN_MARK (1ull << 63)      /* temporary duplicate marker in rs_unpin (never stored long) */
#define CHUNK_DATA_OFF ((uint64_t)((sizeof(rs_chunk_hdr) + RS_ALIGN - 1) & ~(uint64_t)(RS_ALIGN - 1)))
#define FIRST_FIT_PROBES 16        /* free-list entries tried in the exact class before going up */
#define DEDUP_STACK 64             /* slices deduplicated on the stack; more uses qsort */
#define MAX_REPORTED 16            /* per kind of problem in a check report */

typedef struct rs_blk {
  uint64_t word;       /* commit word: size (multiple of 64, header included) | type */
  uint64_t prev_size;  /* size of the preceding block, 0 for the first (derived) */
  uint64_t refcount;   /* CHUNK/DESC: references (records, descriptors, pins) */
  uint64_t next_free;  /* FREE: offsets of neighbouring free-list headers, 0 = none (derived) */
  uint64_t prev_free;
  uint64_t aux;        /* DESC: blob length */
  uint32_t magic;      /* BLK_MAGIC on every live block header; cleared when absorbed */
  int32_t owner;       /* CHUNK: slot that allocated it (diagnostic), -1 otherwise */
  uint64_t serial;     /* DESC: allocation serial (rs_desc_serial); 0 otherwise */
} rs_blk;

_Static_assert(sizeof(rs_blk) == RS_ALIGN, "block header must be one 64-byte unit");
_Static_assert(RS_BLOCK_FREE == 0 && RS_BLOCK_CHUNK == 1 && RS_BLOCK_DESC == 2, "block types");

/* ------------------------------------------------------------------ block helpers */

static inline rs_blk *blk(void *base, uint64_t off) { return (rs_blk *)rs_at(base, off); }
static inline uint64_t bword(const rs_blk *b) { return __atomic_load_n(&b->word, __ATOMIC_ACQUIRE); }
static inline uint64_t bsize(const rs_blk *b) { return bword(b) & ~TYPE_MASK; }
static inline uint32_t btype(const rs_blk *b) { return (uint32_t)(bword(b) & TYPE_MASK); }
static inline void bcommit(rs_blk *b, uint64_t size, uint32_t type) {
  __atomic_store_n(&b->word, size | type, __ATOMIC_RELEASE);
}
static inline uint64_t arena_end(const rs_seg_hdr *h) {
  return h->arena_off + __atomic_load_n(&h->arena_size, __ATOMIC_RELAXED);   /* grows under the lock */
}

static unsigned bin_of(uint64_t size) {
  uint64_t units = size / RS_ALIGN;
  unsigned b = 63u - (unsigned)__builtin_clzll(units ? units : 1);
  return b < RS_NBINS ? b : RS_NBINS - 1;
}

static const char *type_name(uint32_t t) {
  return t == RS_BLOCK_FREE ? "free" : t == RS_BLOCK_CHUNK ? "chunk" : t == RS_BLOCK_DESC ? "descriptor" : "invalid";
}

/* Header of a fresh block at `off` (not yet part of the chain until a commit exposes it). */
static void write_header(void *base, uint64_t off, uint64_t size, uint32_t type, uint64_t prev_size) {
  rs_blk *b = blk(base, off);
  b->prev_size = prev_size;
  b->refcount = 0;
  b->next_free = b->prev_free = 0;
  b->aux = 0;
  b->owner = -1;
  b->serial = 0;
  b->magic = BLK_MAGIC;
  bcommit(b, size, type);
}

static void set_next_prev_size(void *base, uint64_t off, uint64_t size) {
  uint64_t next = off + size;
  if (next < arena_end(rs_seg(base))) blk(base, next)->prev_size = size;
  else rs_seg(base)->tail_size = size;   /* the last block: growth appends after it */
}

static void list_push(void *base, uint64_t off) {
  rs_seg_hdr *h = rs_seg(base);
  rs_blk *b = blk(base, off);
  unsigned bin = bin_of(bsize(b));
  b->prev_free = 0;
  b->next_free = h->free_heads[bin];
  if (b->next_free) blk(base, b->next_free)->prev_free = off;
  h->free_heads[bin] = off;
}

static void list_remove(void *base, uint64_t off) {
  rs_seg_hdr *h = rs_seg(base);
  rs_blk *b = blk(base, off);
  if (b->prev_free) blk(base, b->prev_free)->next_free = b->next_free;
  else h->free_heads[bin_of(bsize(b))] = b->next_free;
  if (b->next_free) blk(base, b->next_free)->prev_free = b->prev_free;
  b->next_free = b->prev_free = 0;
}

/* Caller holds the arena lock. The stores are relaxed atomics (plain moves on x86) because
 * rs_segment_get_info reads these figures without the lock. */
static void account(rs_seg_hdr *h, uint32_t type, uint64_t size, int sign) {
  __atomic_store_n(&h->arena_used, sign > 0 ? h->arena_used + size : h->arena_used - size,
                   __ATOMIC_RELAXED);
  if (type == RS_BLOCK_CHUNK)
    __atomic_store_n(&h->num_chunks, h->num_chunks + (uint64_t)(int64_t)sign, __ATOMIC_RELAXED);
  if (type == RS_BLOCK_DESC)
    __atomic_store_n(&h->num_descs, h->num_descs + (uint64_t)(int64_t)sign, __ATOMIC_RELAXED);
}

/* A free block of at least `need` bytes: first fit among a few of the exact class, then the head
 * of any larger class (always fits), then the rest of the exact class. 0 if none. */
static uint64_t find_free(void *base, uint64_t need) {
  rs_seg_hdr *h = rs_seg(base);
  unsigned b0 = bin_of(need);
  uint64_t off = h->free_heads[b0];
  for (int i = 0; off && i < FIRST_FIT_PROBES; i++, off = blk(base, off)->next_free)
    if (bsize(blk(base, off)) >= need) return off;
  for (unsigned b = b0 + 1; b < RS_NBINS; b++) {
    for (uint64_t o = h->free_heads[b]; o; o = blk(base, o)->next_free)
      if (bsize(blk(base, o)) >= need) return o;   /* only the top class can ever loop */
  }
  for (; off; off = blk(base, off)->next_free)
    if (bsize(blk(base, off)) >= need) return off;
  return 0;
}

static uint64_t largest_free(void *base) {
  rs_seg_hdr *h = rs_seg(base);
  for (int b = RS_NBINS - 1; b >= 0; b--) {
    uint64_t best = 0;
    for (uint64_t o = h->free_heads[b]; o; o = blk(base, o)->next_free)
      if (bsize(blk(base, o)) > best) best = bsize(blk(base, o));
    if (best) return best;
  }
  return 0;
}

#define GROW_MIN (4ull << 20)     /* smallest extent */
#define GROW_MAX (256ull << 20)   /* largest extent beyond the need (bounds the reservation time) */
#define GROW_ALIGN (2ull << 20)

/* Bytes the budget (max_bytes) still allows the arena to add; UINT64_MAX without a budget.
 * The disk tier's max_bytes bounds its arena file: the pin logs (in /dev/shm) are not charged. */
static uint64_t budget_left(const rs_seg_hdr *h) {
  if (!h->max_bytes) return UINT64_MAX;
  uint64_t used = arena_end(h) + (h->arena_file ? 0 : h->pins_reserved);
  return used >= h->max_bytes ? 0 : h->max_bytes - used;
}

/* Grow the arena so that a free block of `need` bytes exists at its end. RS_OK; 1 when the arena
 * may not grow that far (no message); or RS_ENOSPC when its pages could not be reserved
 * (message set). Caller holds the arena lock. See the file comment for the commit protocol. */
static int arena_grow(void *base, uint64_t need) {
  rs_seg_hdr *h = rs_seg(base);
  uint64_t end = arena_end(h), tail = h->tail_size;
  int tail_free = h->arena_size && tail && btype(blk(base, end - tail)) == RS_BLOCK_FREE;
  uint64_t want = need - (tail_free && tail < need ? tail : 0);
  uint64_t room = h->arena_max - h->arena_size, budget = budget_left(h);
  if (budget < room) room = budget & ~(uint64_t)(RS_ALIGN - 1);
  if (!h->growable || want > room) return 1;
  uint64_t step = h->arena_size / 4;
  step = step < GROW_MIN ? GROW_MIN : step > GROW_MAX ? GROW_MAX : step;
  if (step < want) step = want;
  step = rs_align_up(step, GROW_ALIGN);
  if (step > room) step = room;
  int rc = rs_reserve(base, end, step, "the arena");
  if (rc && step > want) {   /* no room for a whole extent: just what is needed, if that fits */
    step = rs_align_up(want, GROW_ALIGN) < step ? rs_align_up(want, GROW_ALIGN) : step;
    rc = rs_reserve(base, end, step, "the arena");
    if (rc && step > want) rc = rs_reserve(base, end, step = want, "the arena");
  }
  if (rc) return rc;
  write_header(base, end, step, RS_BLOCK_FREE, tail);                  /* beyond the end: unseen */
  __atomic_store_n(&h->arena_size, h->arena_size + step, __ATOMIC_RELEASE);   /* commit */
  __atomic_add_fetch(&h->extents, 1, __ATOMIC_RELAXED);
  h->tail_size = step;
  if (tail_free) {                                                     /* merge into the free tail */
    uint64_t last = end - tail;
    list_remove(base, last);
    bcommit(blk(base, last), tail + step, RS_BLOCK_FREE);
    blk(base, end)->magic = 0;
    h->tail_size = tail + step;
    list_push(base, last);
  } else {
    list_push(base, end);
  }
  return RS_OK;
}

/* Allocate a block of `need` bytes (header included, multiple of 64) of `type`, refcount 1.
 * Returns the block header offset or 0 (RS_ENOSPC set). Caller holds the arena lock. */
static uint64_t block_alloc(void *base, uint64_t need, uint32_t type, int32_t owner) {
  rs_seg_hdr *h = rs_seg(base);
  uint64_t off = need <= h->arena_size ? find_free(base, need) : 0;
  if (!off && need <= h->arena_max) {
    int rc = arena_grow(base, need);
    if (rc == RS_OK) off = find_free(base, need);
    else if (rc != 1) return 0;   /* reserving pages failed: that message stands */
  }
  if (!off) {
    if (h->max_bytes)
      rs_set_error(RS_ENOSPC,
                   "arena full: need %llu bytes, largest free block %llu bytes, free %llu of %llu bytes,"
                   " and the arena cannot grow by that much within max_bytes (%.1f MiB of max_bytes"
                   " %.1f MiB reserved); free space returns when items are removed and samples"
                   " released; or create the server with a larger max_bytes (%s)",
                   (unsigned long long)need, (unsigned long long)largest_free(base),
                   (unsigned long long)(h->arena_size - h->arena_used), (unsigned long long)h->arena_size,
                   (double)(arena_end(h) + h->pins_reserved) / (1 << 20), (double)h->max_bytes / (1 << 20),
                   h->arena_file ? "and room for it on the disk of the server's storage= directory"
                                 : "and give /dev/shm the room: docker run --shm-size");
    else
      rs_set_error(RS_ENOSPC,
                   "arena full: need %llu bytes, largest free block %llu bytes, free %llu of %llu bytes"
                   " (free space returns when items are removed and samples released; or create the"
                   " server with a larger arena)",
                   (unsigned long long)need, (unsigned long long)largest_free(base),
                   (unsigned long long)(h->arena_size - h->arena_used), (unsigned long long)h->arena_size);
    return 0;
  }
  rs_blk *b = blk(base, off);
  uint64_t size = bsize(b);
  list_remove(base, off);
  b->refcount = 1;
  b->aux = 0;
  b->owner = owner;
  b->magic = BLK_MAGIC;
  b->serial = type == RS_BLOCK_DESC ? ++h->desc_serial : 0;
  if (size - need >= RS_ALIGN) {
    uint64_t rest = off + need;
    write_header(base, rest, size - need, RS_BLOCK_FREE, need);  /* inside b: not yet visible */
    bcommit(b, need, type);                                     /* commit: b shrinks, rest appears */
    set_next_prev_size(base, rest, size - need);
    list_push(base, rest);
    size = need;
  } else {
    bcommit(b, size, type);
  }
  account(h, type, size, +1);
  return off;
}

/* Return an allocated block to the free space, merging with free neighbours. Returns the header
 * offset of the resulting free block. Caller holds the arena lock. */
/* One more block free or chunk shrink (caller holds the arena lock): the bytes at an offset may
 * no longer be those a reader cached (layout_cache.h). */
static void count_free(rs_seg_hdr *h) { __atomic_store_n(&h->frees, h->frees + 1, __ATOMIC_RELEASE); }

uint64_t rs_desc_serial(void *base, uint64_t desc_off) {
  if (desc_off < RS_ALIGN || !rs_arena_span_ok(base, desc_off - RS_ALIGN, RS_ALIGN)) return 0;
  return __atomic_load_n(&blk(base, desc_off - RS_ALIGN)->serial, __ATOMIC_RELAXED);
}

static uint64_t block_free(void *base, uint64_t off) {
  rs_seg_hdr *h = rs_seg(base);
  rs_blk *b = blk(base, off);
  count_free(h);
  uint64_t size = bsize(b), start = off, total = size, next = off + size, absorbed_next = 0;
  account(h, btype(b), size, -1);
  if (next < arena_end(h) && btype(blk(base, next)) == RS_BLOCK_FREE) {
    list_remove(base, next);
    total += bsize(blk(base, next));
    absorbed_next = next;
  }
  if (b->prev_size && off - b->prev_size >= h->arena_off &&
      btype(blk(base, off - b->prev_size)) == RS_BLOCK_FREE) {
    start = off - b->prev_size;
    list_remove(base, start);
    total += bsize(blk(base, start));
  }
  if (start == off) {
    b->refcount = 0;
    b->aux = 0;
    b->owner = -1;
  }
  bcommit(blk(base, start), total, RS_BLOCK_FREE);   /* commit */
  if (start != off) b->magic = 0;
  if (absorbed_next) blk(base, absorbed_next)->magic = 0;
  set_next_prev_size(base, start, total);
  list_push(base, start);
  return start;
}

/* Is `off` (a payload offset) the payload of a block of `type` in this arena? With `live`, its
 * refcount must also be >= 1. Cheap structural check, no walk. */
static int is_block(void *base, uint64_t off, uint32_t type, int live) {
  rs_seg_hdr *h = rs_seg(base);
  if (off < h->arena_off + RS_ALIGN || off >= arena_end(h) || (off - h->arena_off) % RS_ALIGN) return 0;
  rs_blk *b = blk(base, off - RS_ALIGN);
  if (b->magic != BLK_MAGIC || btype(b) != type) return 0;
  uint64_t size = bsize(b);
  if (size < RS_ALIGN || size > arena_end(h) - (off - RS_ALIGN)) return 0;
  if (type == RS_BLOCK_CHUNK && size < RS_ALIGN + CHUNK_DATA_OFF) return 0;
  return !live || __atomic_load_n(&b->refcount, __ATOMIC_RELAXED) >= 1;
}

/* ------------------------------------------------------------------ descriptors */

static inline const rs_desc_col *desc_cols(const rs_desc_hdr *d) { return (const rs_desc_col *)(d + 1); }
static inline const rs_desc_slice *desc_slices(const rs_desc_hdr *d) {
  return (const rs_desc_slice *)(desc_cols(d) + d->ncols);
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

/* Distinct chunk offsets named by a descriptor, into out[0..nslices). Returns the count. */
static uint32_t distinct_chunks(const rs_desc_hdr *d, uint64_t *out) {
  const rs_desc_slice *s = desc_slices(d);
  uint32_t n = d->nslices, k = 0;
  if (n <= DEDUP_STACK) {
    for (uint32_t i = 0; i < n; i++) {
      uint32_t j = 0;
      while (j < k && out[j] != s[i].chunk_off) j++;
      if (j == k) out[k++] = s[i].chunk_off;
    }
    return k;
  }
  for (uint32_t i = 0; i < n; i++) out[i] = s[i].chunk_off;
  qsort(out, n, sizeof *out, cmp_u64);
  for (uint32_t i = 0; i < n; i++)
    if (!k || out[k - 1] != out[i]) out[k++] = out[i];
  return k;
}

/* Calls fn(base, chunk_off, arg) once per distinct chunk of the descriptor at desc_off.
 * Returns 0, or -1 when memory for a large descriptor could not be had. */
static int for_each_chunk(void *base, const rs_desc_hdr *d, void (*fn)(void *, uint64_t, void *), void *arg) {
  uint64_t stack[DEDUP_STACK];
  uint64_t *buf = d->nslices <= DEDUP_STACK ? stack : malloc((size_t)d->nslices * sizeof *buf);
  if (!buf) return -1;
  uint32_t k = distinct_chunks(d, buf);
  for (uint32_t i = 0; i < k; i++) fn(base, buf[i], arg);
  if (buf != stack) free(buf);
  return 0;
}

static void decref(void *base, uint64_t off);

static void decref_chunk_cb(void *base, uint64_t chunk_off, void *arg) {
  (void)arg;
  if (is_block(base, chunk_off, RS_BLOCK_CHUNK, 1)) decref(base, chunk_off);
  else rs_seg(base)->refcounts_suspect = 1;
}

static void incref_chunk_cb(void *base, uint64_t chunk_off, void *arg) {
  (void)arg;
  /* (atomic: rs_insert's validation reads chunk refcounts before it takes any lock, is_block) */
  __atomic_add_fetch(&blk(base, chunk_off - RS_ALIGN)->refcount, 1, __ATOMIC_RELAXED);
}

/* Drop one reference to the block whose payload is at `off`; free it at zero (a descriptor first
 * drops its chunk references). Caller holds the arena lock. */
static void decref(void *base, uint64_t off) {
  rs_blk *b = blk(base, off - RS_ALIGN);
  if (__atomic_load_n(&b->refcount, __ATOMIC_RELAXED) == 0) {   /* only if counts are off */
    rs_seg(base)->refcounts_suspect = 1;
    return;
  }
  if (__atomic_sub_fetch(&b->refcount, 1, __ATOMIC_RELAXED)) return;   /* (atomic: see incref_chunk_cb) */
  if (btype(b) == RS_BLOCK_DESC &&
      for_each_chunk(base, rs_desc_blob(base, off), decref_chunk_cb, NULL) != 0)
    rs_seg(base)->refcounts_suspect = 1;   /* out of memory: recount will free the chunks */
  block_free(base, off - RS_ALIGN);
}

uint64_t rs_desc_data_offset(void) { return 0; }
uint32_t rs_desc_ref_off_bits(void) { return RS_REF_OFF_BITS; }

const rs_desc_hdr *rs_desc_blob(void *base, uint64_t desc_off) {
  return (const rs_desc_hdr *)rs_at(base, rs_ref_off(desc_off) + rs_desc_data_offset());
}

rs_chunk_hdr *rs_chunk(void *base, uint64_t chunk_off) { return (rs_chunk_hdr *)rs_at(base, chunk_off); }

static int same_element(const rs_chunk_hdr *a, const rs_chunk_hdr *b) {
  if (a->ndim != b->ndim || a->row_bytes != b->row_bytes) return 0;
  if (strncmp(a->dtype, b->dtype, sizeof a->dtype) != 0) return 0;
  for (uint32_t i = 0; i < a->ndim && i < RS_MAX_NDIM; i++)
    if (a->shape[i] != b->shape[i]) return 0;
  return 1;
}

int rs_desc_validate(void *base, const uint8_t *blob, uint32_t len) {
  if (!blob || len < sizeof(rs_desc_hdr))
    return rs_set_error(RS_EINVAL, "item descriptor is %u bytes, expected at least %zu", len,
                        sizeof(rs_desc_hdr));
  rs_desc_hdr dh;
  memcpy(&dh, blob, sizeof dh);
  if (dh.ncols < 1 || dh.nslices < 1)
    return rs_set_error(RS_EINVAL, "item descriptor has %u columns and %u slices, expected at least 1 of each",
                        dh.ncols, dh.nslices);
  uint64_t want = sizeof(rs_desc_hdr) + (uint64_t)dh.ncols * sizeof(rs_desc_col) +
                  (uint64_t)dh.nslices * sizeof(rs_desc_slice);
  if (want != len)
    return rs_set_error(RS_EINVAL,
                        "item descriptor is %u bytes, expected %llu for %u columns and %u slices", len,
                        (unsigned long long)want, dh.ncols, dh.nslices);
  if ((uintptr_t)blob % _Alignof(rs_desc_slice))
    return rs_set_error(RS_EINVAL, "item descriptor buffer is not 8-byte aligned");
  const rs_desc_hdr *d = (const rs_desc_hdr *)blob;
  const rs_desc_col *cols = desc_cols(d);
  const rs_desc_slice *sl = desc_slices(d);
  for (uint32_t c = 0; c < dh.ncols; c++) {
    const rs_desc_col *col = &cols[c];
    if (col->flags & ~1u)
      return rs_set_error(RS_EINVAL, "column %u: unknown flags 0x%x (only bit 0, squeeze, is defined)", c,
                          col->flags);
    if (col->nslices < 1 || (uint64_t)col->first_slice + col->nslices > dh.nslices)
      return rs_set_error(RS_EINVAL,
                          "column %u: slices [%u, %u) out of range, expected a non-empty range within"
                          " the descriptor's %u slices",
                          c, col->first_slice, col->first_slice + col->nslices, dh.nslices);
    const rs_chunk_hdr *first = NULL;
    uint64_t total_rows = 0;
    for (uint32_t k = 0; k < col->nslices; k++) {
      uint32_t si = col->first_slice + k;
      const rs_desc_slice *s = &sl[si];
      if (!is_block(base, s->chunk_off, RS_BLOCK_CHUNK, 1))
        return rs_set_error(RS_EINVAL,
                            "column %u slice %u: chunk offset %llu is not a live chunk in the arena"
                            " [%llu, %llu)",
                            c, k, (unsigned long long)s->chunk_off,
                            (unsigned long long)rs_seg(base)->arena_off,
                            (unsigned long long)arena_end(rs_seg(base)));
      const rs_chunk_hdr *ch = rs_chunk(base, s->chunk_off);
      uint32_t rows = __atomic_load_n(&ch->rows, __ATOMIC_ACQUIRE);
      if (s->nrows < 1 || (uint64_t)s->row_offset + s->nrows > rows)
        return rs_set_error(RS_EINVAL,
                            "column %u slice %u: rows [%u, %llu) of chunk %llu, expected a non-empty"
                            " range within its %u published rows",
                            c, k, s->row_offset, (unsigned long long)s->row_offset + s->nrows,
                            (unsigned long long)s->chunk_off, rows);
      if (!first) first = ch;
      else if (!same_element(first, ch))
        return rs_set_error(RS_EINVAL,
                            "column %u slice %u: chunk has dtype %.16s with %u dims, expected the same"
                            " dtype and shape as the column's first slice (%.16s with %u dims)",
                            c, k, ch->dtype, ch->ndim, first->dtype, first->ndim);
      total_rows += s->nrows;
    }
    if ((col->flags & 1u) && total_rows != 1)
      return rs_set_error(RS_EINVAL, "column %u is squeezed but spans %llu rows, expected exactly 1", c,
                          (unsigned long long)total_rows);
  }
  return RS_OK;
}

int rs_desc_create(void *base, const uint8_t *blob, uint32_t len, uint64_t *off_out) {
  int rc = rs_alock(base);
  if (rc) return rc;
  rc = rs_desc_validate(base, blob, len);   /* under the lock: the chunks cannot go away now */
  uint64_t off = 0;
  if (rc == RS_OK) {
    uint64_t need = rs_align_up(RS_ALIGN + rs_desc_data_offset() + len, RS_ALIGN);
    off = block_alloc(base, need, RS_BLOCK_DESC, -1);
    if (!off) rc = RS_ENOSPC;
  }
  if (rc == RS_OK) {
    uint64_t desc_off = off + RS_ALIGN;
    blk(base, off)->aux = len;
    memcpy(rs_at(base, desc_off + rs_desc_data_offset()), blob, len);
    if (for_each_chunk(base, rs_desc_blob(base, desc_off), incref_chunk_cb, NULL) != 0) {
      block_free(base, off);
      rc = rs_set_error(RS_ESYS, "out of memory while referencing the chunks of a %u-slice descriptor",
                        ((const rs_desc_hdr *)blob)->nslices);
    } else {
      *off_out = desc_off;
    }
  }
  rs_aunlock(base);
  return rc;
}

int64_t rs_desc_blob_shift(const uint8_t *from, const uint8_t *to, uint32_t len) {
  const rs_desc_hdr *t = (const rs_desc_hdr *)from, *d = (const rs_desc_hdr *)to;
  uint64_t head = sizeof *t + (uint64_t)t->ncols * sizeof(rs_desc_col);
  if (head > len || memcmp(t, d, head) != 0) return -1;
  const rs_desc_slice *ts = desc_slices(t), *ds = desc_slices(d);
  if (ds[0].row_offset < ts[0].row_offset || ds[0].row_offset - ts[0].row_offset > RS_REF_MAX_SHIFT) return -1;
  uint32_t shift = ds[0].row_offset - ts[0].row_offset;
  for (uint32_t k = 0; k < d->nslices; k++)
    if (ds[k].chunk_off != ts[k].chunk_off || ds[k].nrows != ts[k].nrows ||
        ds[k].row_offset - ts[k].row_offset != shift || ds[k].row_offset < ts[k].row_offset)
      return -1;
  return shift;
}

/* rs_desc_blob_shift from the live DESC block at `tmpl` (an item reference) to `blob`; -1 if
 * there is none. Caller holds the arena lock. */
static int64_t share_shift(void *base, const uint8_t *blob, uint32_t len, uint64_t tmpl) {
  uint64_t off = rs_ref_off(tmpl);
  if (!tmpl || !is_block(base, off, RS_BLOCK_DESC, 1) || blk(base, off - RS_ALIGN)->aux != len) return -1;
  return rs_desc_blob_shift((const uint8_t *)rs_desc_blob(base, off), blob, len);   /* (a live block's blob is sane) */
}

int rs_desc_create_shared_any(void *base, const uint8_t *blob, uint32_t len, const uint64_t *tmpls,
                              uint32_t n, uint64_t *off_out, int *used_out) {
  *used_out = -1;
  if (!n || !blob || len < sizeof(rs_desc_hdr)) return rs_desc_create(base, blob, len, off_out);
  int rc = rs_alock(base);
  if (rc) return rc;
  int64_t shift = -1;
  uint32_t i = 0;
  for (; i < n && shift < 0; i++) shift = share_shift(base, blob, len, tmpls[i]);
  if (shift >= 0) rc = rs_desc_validate(base, blob, len);   /* the item's own rows are in range */
  if (shift >= 0 && rc == RS_OK) {
    uint64_t tmpl = tmpls[i - 1];
    blk(base, rs_ref_off(tmpl) - RS_ALIGN)->refcount++;
    *off_out = rs_ref_make(rs_ref_off(tmpl), (uint32_t)shift);
    *used_out = (int)(i - 1);
  }
  rs_aunlock(base);
  if (rc || shift >= 0) return rc;
  return rs_desc_create(base, blob, len, off_out);
}

int rs_desc_create_shared(void *base, const uint8_t *blob, uint32_t len, uint64_t tmpl, uint64_t *off_out) {
  int used;
  return rs_desc_create_shared_any(base, blob, len, &tmpl, tmpl ? 1 : 0, off_out, &used);
}

int rs_desc_add_refs(void *base, uint64_t ref, uint32_t n, const uint8_t *blob, uint32_t len) {
  int rc = rs_alock(base);
  if (rc) return rc;
  uint64_t off = rs_ref_off(ref);
  if (!is_block(base, off, RS_BLOCK_DESC, 1))
    rc = rs_set_error(RS_EINVAL, "item reference %llu does not name a live descriptor block",
                      (unsigned long long)ref);
  if (rc == RS_OK) rc = rs_desc_validate(base, blob, len);   /* under the lock: chunks stay */
  if (rc == RS_OK) blk(base, off - RS_ALIGN)->refcount += n;
  rs_aunlock(base);
  return rc;
}

void rs_desc_release_n(void *base, uint64_t ref, uint32_t n) {
  uint64_t off = rs_ref_off(ref);
  while (n) {
    if (!is_block(base, off, RS_BLOCK_DESC, 1)) {
      rs_seg(base)->refcounts_suspect = 1;
      return;
    }
    /* The block keeps other references: drop these n at once (the caller holds the arena lock,
     * which every decrement takes: the count cannot fall meanwhile). */
    rs_blk *b = blk(base, off - RS_ALIGN);
    if (__atomic_load_n(&b->refcount, __ATOMIC_RELAXED) > n) {
      __atomic_sub_fetch(&b->refcount, n, __ATOMIC_RELAXED);
      return;
    }
    decref(base, off);
    n--;
  }
}

void rs_desc_release(void *base, uint64_t desc_off, int locked) {
  if (!locked && rs_alock(base) != RS_OK) return;
  desc_off = rs_ref_off(desc_off);
  if (is_block(base, desc_off, RS_BLOCK_DESC, 1)) decref(base, desc_off);
  else rs_seg(base)->refcounts_suspect = 1;
  if (!locked) rs_aunlock(base);
}

/* ------------------------------------------------------------------ pins */

static int slot_check(void *base, uint32_t slot) {
  rs_seg_hdr *h = rs_seg(base);
  if (slot >= h->max_procs)
    return rs_set_error(RS_EINVAL, "process slot %u out of range, expected < %u", slot, h->max_procs);
  if (__atomic_load_n(&rs_slots(base)[slot].pid, __ATOMIC_ACQUIRE) == 0)
    return rs_set_error(RS_EINVAL, "process slot %u is not registered (reaped or unregistered?)", slot);
  return RS_OK;
}

/* Record a pin of the block at payload `off` for `slot` (refcount already accounted by caller). */
static uint32_t pin_push(void *base, uint32_t slot, uint64_t off) {
  rs_slot *s = &rs_slots(base)[slot];
  /* free_top: atomic stores, since sample_round reads it without the arena lock */
  uint32_t top = s->free_top - 1;
  __atomic_store_n(&s->free_top, top, __ATOMIC_RELAXED);
  uint32_t idx = rs_pin_free_stack(base, slot)[top];
  __atomic_store_n(&rs_pin_entries(base, slot)[idx], off, __ATOMIC_RELEASE);
  s->npins++;
  return idx;
}

/* Clear pin entry p of `slot` and return its block offset (refcount still to be dropped). */
static uint64_t pin_pop(void *base, uint32_t slot, uint32_t p) {
  rs_slot *s = &rs_slots(base)[slot];
  uint64_t *e = &rs_pin_entries(base, slot)[p];
  uint64_t off = *e & ~PIN_MARK;
  __atomic_store_n(e, 0, __ATOMIC_RELEASE);
  rs_pin_free_stack(base, slot)[s->free_top] = p;
  __atomic_store_n(&s->free_top, s->free_top + 1, __ATOMIC_RELAXED);
  s->npins--;
  return off;
}

static int pins_full(void *base, uint32_t slot, uint32_t n) {
  rs_slot *s = &rs_slots(base)[slot];
  return rs_set_error(RS_EFULL,
                      "pin log of process slot %u is full: %u of %u pins in use, %u more needed; release"
                      " sampled data and finished chunks (or create the server with more pins per process)",
                      slot, s->npins, rs_seg(base)->pins_per_proc, n);
}

#define PIN_GROW_MIN RS_PIN_START   /* pins added at least per growth step (12 KiB of pages) */

int rs_pins_grow(void *base, uint32_t slot, uint32_t n) {
  rs_seg_hdr *h = rs_seg(base);
  rs_slot *s = &rs_slots(base)[slot];
  if (s->free_top >= n) return RS_OK;
  uint32_t cap = s->pin_cap, ppp = h->pins_per_proc;
  uint64_t want = (uint64_t)cap + (n - s->free_top);
  if (want > ppp) return pins_full(base, slot, n);
  uint64_t newcap = cap * 2ull > want ? cap * 2ull : want;
  newcap = rs_align_up(newcap < PIN_GROW_MIN ? PIN_GROW_MIN : newcap, PIN_GROW_MIN);
  if (newcap > ppp) newcap = ppp;
  uint64_t add = (newcap - cap) * (sizeof(uint64_t) + sizeof(uint32_t));
  if (h->max_bytes && !h->arena_file && arena_end(h) + h->pins_reserved + add > h->max_bytes)
    return rs_set_error(RS_ENOSPC,
                        "cannot grow the pin log of process slot %u to %llu pins: the server's max_bytes"
                        " (%.1f MiB) is reserved (arena %.1f MiB + pin logs %.1f MiB); create the server"
                        " with a larger max_bytes, or release samples",
                        slot, (unsigned long long)newcap, (double)h->max_bytes / (1 << 20),
                        (double)arena_end(h) / (1 << 20), (double)h->pins_reserved / (1 << 20));
  uint64_t log_off = h->pins_off + (uint64_t)slot * h->pin_log_stride;
  int rc = rs_reserve(base, log_off + cap * sizeof(uint64_t), (newcap - cap) * sizeof(uint64_t),
                      "a pin log");
  if (rc == RS_OK)
    rc = rs_reserve(base, log_off + (uint64_t)ppp * sizeof(uint64_t) + cap * sizeof(uint32_t),
                    (newcap - cap) * sizeof(uint32_t), "a pin log");
  if (rc) return rc;
  /* Entries cap..newcap-1 are zero (never written: ids >= pin_cap are never handed out). */
  __atomic_store_n(&s->pin_cap, (uint32_t)newcap, __ATOMIC_RELEASE);   /* commit */
  __atomic_store_n(&h->pins_reserved, h->pins_reserved + add, __ATOMIC_RELAXED);   /* read unlocked by info */
  uint32_t *stack = rs_pin_free_stack(base, slot);
  for (uint32_t i = (uint32_t)newcap; i-- > cap;) stack[s->free_top++] = i;   /* pops hand out cap first */
  return RS_OK;
}

int rs_pins_ensure(void *base, uint32_t slot, uint32_t n) {
  int rc = rs_alock(base);
  if (rc) return rc;
  rc = slot_check(base, slot);
  if (rc == RS_OK) rc = rs_pins_grow(base, slot, n);
  rs_aunlock(base);
  return rc;
}

int rs_pin_descs(void *base, uint32_t slot, uint32_t n, const uint64_t *desc_offs, uint32_t *pins_out) {
  int rc = rs_alock(base);
  if (rc) return rc;
  rc = slot_check(base, slot);
  if (rc == RS_OK) rc = rs_pins_grow(base, slot, n);
  for (uint32_t i = 0; rc == RS_OK && i < n; i++)
    if (!is_block(base, rs_ref_off(desc_offs[i]), RS_BLOCK_DESC, 1))
      rc = rs_set_error(RS_EINVAL, "descriptor %u of %u: offset %llu is not a live item descriptor", i, n,
                        (unsigned long long)rs_ref_off(desc_offs[i]));
  for (uint32_t i = 0; rc == RS_OK && i < n; i++) {
    uint64_t off = rs_ref_off(desc_offs[i]);   /* the pin holds the block */
    blk(base, off - RS_ALIGN)->refcount++;
    pins_out[i] = pin_push(base, slot, off);
  }
  rs_aunlock(base);
  return rc;
}

int rs_unpin(void *base, uint32_t slot, uint32_t n, const uint32_t *pins) {
  int rc = rs_alock(base);
  if (rc) return rc;
  rc = slot_check(base, slot);
  uint64_t *e = rc == RS_OK ? rs_pin_entries(base, slot) : NULL;
  uint32_t ppp = rc == RS_OK ? rs_slots(base)[slot].pin_cap : 0, marked = 0;
  for (; rc == RS_OK && marked < n; marked++) {   /* validate, marking to catch duplicates */
    uint32_t p = pins[marked];
    if (p >= ppp) rc = rs_set_error(RS_EINVAL, "pin %u out of range, expected < %u", p, ppp);
    else if (e[p] == 0) rc = rs_set_error(RS_EINVAL, "pin %u of slot %u is not held (already released?)", p, slot);
    else if (e[p] & PIN_MARK) rc = rs_set_error(RS_EINVAL, "pin %u appears twice in one release", p);
    else e[p] |= PIN_MARK;
  }
  if (rc != RS_OK) {
    for (uint32_t i = 0; i + 1 < marked; i++) e[pins[i]] &= ~PIN_MARK;
    rs_aunlock(base);
    return rc;
  }
  for (uint32_t i = 0; i < n; i++) {
    uint64_t off = pin_pop(base, slot, pins[i]);
    if (is_block(base, off, RS_BLOCK_CHUNK, 1) || is_block(base, off, RS_BLOCK_DESC, 1)) decref(base, off);
    else rs_seg(base)->refcounts_suspect = 1;
  }
  rs_aunlock(base);
  return RS_OK;
}

int rs_unpin_fresh(void *base, uint32_t slot, uint32_t n, const uint32_t *pins) {
  int rc = rs_alock(base);
  if (rc) return rc;
  rc = slot_check(base, slot);
  for (uint32_t i = 0; rc == RS_OK && i < n; i++) {
    uint64_t off = pin_pop(base, slot, pins[i]);
    if (off) decref(base, off);
    else rs_seg(base)->refcounts_suspect = 1;
  }
  rs_aunlock(base);
  return rc;
}

/* ------------------------------------------------------------------ chunks */

/* Bytes per element from a numpy dtype.str ("<f4", "|u1", "<U5", "<M8[ns]"); 0 if unparsable. */
static uint64_t dtype_itemsize(const char *s) {
  if (*s == '<' || *s == '>' || *s == '|' || *s == '=') s++;
  char kind = *s++;
  if (!kind || *s < '0' || *s > '9') return 0;
  uint64_t n = 0;
  while (*s >= '0' && *s <= '9' && n < (1ull << 40)) n = n * 10 + (uint64_t)(*s++ - '0');
  if (*s && *s != '[') return 0;
  return kind == 'U' ? 4 * n : n;
}

/* Validate chunk metadata; on success *nbytes is the payload capacity in bytes. */
static int chunk_meta_check(const rs_chunk_hdr *m, uint64_t *nbytes) {
  if (!memchr(m->dtype, 0, sizeof m->dtype) || !m->dtype[0])
    return rs_set_error(RS_EINVAL, "chunk dtype must be a non-empty NUL-terminated string of < %zu bytes",
                        sizeof m->dtype);
  if (m->ndim > RS_MAX_NDIM)
    return rs_set_error(RS_EINVAL, "chunk element rank %u, expected <= %d", m->ndim, RS_MAX_NDIM);
  if (m->capacity < 1) return rs_set_error(RS_EINVAL, "chunk capacity 0 rows, expected >= 1");
  if (m->flags & ~(uint32_t)RS_CHUNK_ROW_EPISODES)
    return rs_set_error(RS_EINVAL, "chunk flags 0x%x, expected 0 or RS_CHUNK_ROW_EPISODES (1)", m->flags);
  uint64_t elems = 1;
  for (uint32_t i = 0; i < m->ndim; i++) {
    if (m->shape[i] < 0)
      return rs_set_error(RS_EINVAL, "chunk shape dim %u is %lld, expected >= 0", i, (long long)m->shape[i]);
    if (__builtin_mul_overflow(elems, (uint64_t)m->shape[i], &elems))
      return rs_set_error(RS_EINVAL, "chunk element shape too large (overflows 64 bits)");
  }
  if (rs_dtype_is_object(m->dtype)) {
    if (m->row_bytes != 0)
      return rs_set_error(RS_EINVAL, "object chunk row_bytes %llu, expected 0 (sizes are in nbytes)",
                          (unsigned long long)m->row_bytes);
    if (m->nbytes < 1) return rs_set_error(RS_EINVAL, "object chunk nbytes 0, expected >= 1");
    *nbytes = m->nbytes;
    return RS_OK;
  }
  uint64_t item = dtype_itemsize(m->dtype), row;
  if (!item) return rs_set_error(RS_EINVAL, "chunk dtype '%s' is not a numpy dtype.str like '<f4'", m->dtype);
  if (__builtin_mul_overflow(item, elems, &row) || row != m->row_bytes)
    return rs_set_error(RS_EINVAL, "chunk row_bytes %llu, expected itemsize %llu x %llu elements = %llu",
                        (unsigned long long)m->row_bytes, (unsigned long long)item,
                        (unsigned long long)elems, (unsigned long long)row);
  if (__builtin_mul_overflow(row, (uint64_t)m->capacity, nbytes))
    return rs_set_error(RS_EINVAL, "chunk payload of %u rows x %llu bytes overflows 64 bits", m->capacity,
                        (unsigned long long)row);
  if (m->nbytes != 0 && m->nbytes != *nbytes)
    return rs_set_error(RS_EINVAL, "chunk nbytes %llu, expected 0 or capacity x row_bytes = %llu",
                        (unsigned long long)m->nbytes, (unsigned long long)*nbytes);
  return RS_OK;
}

int rs_chunk_alloc(void *base, uint32_t slot, const rs_chunk_hdr *meta, uint64_t *off_out, uint32_t *pin_out) {
  uint64_t nbytes = 0;
  int rc = chunk_meta_check(meta, &nbytes);
  if (rc) return rc;
  uint64_t need = RS_ALIGN + CHUNK_DATA_OFF;
  need = nbytes > UINT64_MAX / 2 ? (UINT64_MAX / 2) & ~TYPE_MASK : rs_align_up(need + nbytes, RS_ALIGN);
  if ((rc = rs_alock(base))) return rc;
  rc = slot_check(base, slot);
  if (rc == RS_OK) rc = rs_pins_grow(base, slot, 1);
  uint64_t off = 0;
  if (rc == RS_OK && !(off = block_alloc(base, need, RS_BLOCK_CHUNK, (int32_t)slot))) rc = RS_ENOSPC;
  if (rc == RS_OK) {
    uint64_t chunk_off = off + RS_ALIGN;
    rs_chunk_hdr *c = rs_chunk(base, chunk_off);
    memcpy(c, meta, sizeof *c);
    c->nbytes = nbytes;
    c->data_offset = CHUNK_DATA_OFF;
    c->rows = 0;
    *pin_out = pin_push(base, slot, chunk_off);   /* holds the refcount of 1 set by block_alloc */
    *off_out = chunk_off;
  }
  rs_aunlock(base);
  return rc;
}

int rs_chunk_publish_rows(void *base, uint64_t chunk_off, uint32_t rows) {
  if (!is_block(base, chunk_off, RS_BLOCK_CHUNK, 1))
    return rs_set_error(RS_EINVAL, "offset %llu is not a live chunk", (unsigned long long)chunk_off);
  rs_chunk_hdr *c = rs_chunk(base, chunk_off);
  uint32_t cur = __atomic_load_n(&c->rows, __ATOMIC_RELAXED);
  if (rows < cur || rows > c->capacity)
    return rs_set_error(RS_EINVAL, "cannot publish %u rows of chunk %llu: %u already published, capacity %u"
                        " (rows only grow, up to capacity)",
                        rows, (unsigned long long)chunk_off, cur, c->capacity);
  __atomic_store_n(&c->rows, rows, __ATOMIC_RELEASE);
  return RS_OK;
}

int rs_chunk_shrink(void *base, uint64_t chunk_off, uint32_t rows) {
  int rc = rs_alock(base);
  if (rc) return rc;
  rs_chunk_hdr *c = rs_chunk(base, chunk_off);
  if (!is_block(base, chunk_off, RS_BLOCK_CHUNK, 1)) {
    rc = rs_set_error(RS_EINVAL, "offset %llu is not a live chunk", (unsigned long long)chunk_off);
  } else if (rows < 1 || rows > c->capacity || rows < __atomic_load_n(&c->rows, __ATOMIC_ACQUIRE)) {
    rc = rs_set_error(RS_EINVAL, "cannot shrink chunk %llu to %u rows: expected 1 <= rows <= capacity %u"
                      " and rows >= the %u published rows",
                      (unsigned long long)chunk_off, rows, c->capacity, c->rows);
  }
  if (rc) {
    rs_aunlock(base);
    return rc;
  }
  rs_seg_hdr *h = rs_seg(base);
  uint64_t off = chunk_off - RS_ALIGN;
  rs_blk *b = blk(base, off);
  uint64_t size = bsize(b);
  uint64_t nbytes = c->row_bytes ? c->row_bytes * rows : c->nbytes;   /* object chunks keep bytes */
  uint64_t keep = rs_align_up(RS_ALIGN + c->data_offset + nbytes, RS_ALIGN);
  count_free(h);
  __atomic_store_n(&c->capacity, rows, __ATOMIC_RELAXED);   /* read unlocked by rs_chunk_rows_ok */
  __atomic_store_n(&c->nbytes, nbytes, __ATOMIC_RELAXED);
  if (keep < size && size - keep >= RS_ALIGN) {
    uint64_t tail = off + keep, tail_size = size - keep, next = off + size, absorbed = 0;
    if (next < arena_end(h) && btype(blk(base, next)) == RS_BLOCK_FREE) {
      list_remove(base, next);
      tail_size += bsize(blk(base, next));
      absorbed = next;
    }
    write_header(base, tail, tail_size, RS_BLOCK_FREE, keep);   /* inside b: not yet visible */
    bcommit(b, keep, RS_BLOCK_CHUNK);                           /* commit */
    if (absorbed) blk(base, absorbed)->magic = 0;
    set_next_prev_size(base, tail, tail_size);
    list_push(base, tail);
    h->arena_used -= size - keep;
  }
  rs_aunlock(base);
  return RS_OK;
}

/* ------------------------------------------------------------------ init and repair */

uint64_t rs_arena_min_size(void) { return 4096; }

void rs_arena_init(void *base) {
  rs_seg_hdr *h = rs_seg(base);
  count_free(h);
  memset(h->free_heads, 0, sizeof h->free_heads);
  h->arena_used = h->num_chunks = h->num_descs = 0;
  h->refcounts_suspect = 0;
  write_header(base, h->arena_off, h->arena_size, RS_BLOCK_FREE, 0);
  h->tail_size = h->arena_size;
  list_push(base, h->arena_off);
}

void rs_arena_repair(void *base) {
  rs_seg_hdr *h = rs_seg(base);
  count_free(h);
  uint64_t end = arena_end(h), prev = 0, prev_size = 0;
  memset(h->free_heads, 0, sizeof h->free_heads);
  h->arena_used = h->num_chunks = h->num_descs = 0;
  for (uint64_t off = h->arena_off; off < end;) {
    rs_blk *b = blk(base, off);
    uint64_t size = bsize(b);
    uint32_t type = btype(b);
    if (size < RS_ALIGN || size > end - off || type > RS_BLOCK_DESC) {
      /* Unreadable chain (not produced by any crash of ours): keep what precedes, free the rest. */
      size = end - off;
      type = RS_BLOCK_FREE;
      write_header(base, off, size, RS_BLOCK_FREE, prev_size);
    }
    if (type == RS_BLOCK_FREE && prev && btype(blk(base, prev)) == RS_BLOCK_FREE) {
      bcommit(blk(base, prev), prev_size + size, RS_BLOCK_FREE);   /* merge into the previous */
      b->magic = 0;
      prev_size += size;
      off += size;
      continue;
    }
    b->magic = BLK_MAGIC;
    b->prev_size = prev ? prev_size : 0;
    prev = off;
    prev_size = size;
    off += size;
  }
  h->tail_size = prev_size;
  for (uint64_t off = h->arena_off; off < end; off += bsize(blk(base, off))) {
    rs_blk *b = blk(base, off);
    if (btype(b) == RS_BLOCK_FREE) {
      b->refcount = 0;
      list_push(base, off);
    } else {
      account(h, btype(b), bsize(b), +1);
    }
  }
  /* Pin-log free stacks are derived from the entries (nonzero = held), as is pins_reserved. */
  h->pins_reserved = 0;
  for (uint32_t s = 0; s < h->max_procs; s++) {
    rs_slot *sl = &rs_slots(base)[s];
    uint64_t *e = rs_pin_entries(base, s);
    uint32_t *stack = rs_pin_free_stack(base, s), top = 0, held = 0;
    if (sl->pin_cap > h->pins_per_proc) sl->pin_cap = h->pins_per_proc;   /* not produced by a crash */
    if (h->growable) h->pins_reserved += (uint64_t)sl->pin_cap * (sizeof(uint64_t) + sizeof(uint32_t));
    for (uint32_t i = sl->pin_cap; i-- > 0;) {
      e[i] &= ~PIN_MARK;
      if (e[i]) held++;
      else stack[top++] = i;
    }
    __atomic_store_n(&sl->free_top, top, __ATOMIC_RELAXED);
    sl->npins = held;
  }
}

/* ------------------------------------------------------------------ reference counting */

typedef struct bref { uint64_t off; uint64_t count; uint32_t type; uint32_t dead; } bref;

typedef struct reporter { char *buf; uint64_t cap; int errors; } reporter;

static void report(reporter *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void report(reporter *r, const char *fmt, ...) {
  r->errors++;
  if (!r->buf || r->cap < 2) return;
  size_t len = strnlen(r->buf, r->cap);
  if (len + 2 >= r->cap) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->buf + len, r->cap - len, fmt, ap);
  va_end(ap);
  len = strnlen(r->buf, r->cap);
  if (len + 1 < r->cap) { r->buf[len] = '\n'; r->buf[len + 1] = 0; }
}

/* Allocated blocks in chain order (sorted by offset). NULL with *n = 0 when there are none;
 * NULL with *n = UINT64_MAX when out of memory. */
static bref *collect_blocks(void *base, uint64_t *n_out) {
  rs_seg_hdr *h = rs_seg(base);
  uint64_t n = 0, end = arena_end(h);
  for (uint64_t off = h->arena_off; off < end; off += bsize(blk(base, off)))
    if (btype(blk(base, off)) != RS_BLOCK_FREE) n++;
  *n_out = n;
  if (!n) return NULL;
  bref *a = calloc(n, sizeof *a);
  if (!a) { *n_out = UINT64_MAX; return NULL; }
  n = 0;
  for (uint64_t off = h->arena_off; off < end; off += bsize(blk(base, off))) {
    uint32_t t = btype(blk(base, off));
    if (t != RS_BLOCK_FREE) a[n++] = (bref){off + RS_ALIGN, 0, t, 0};
  }
  return a;
}

static bref *find_ref(bref *a, uint64_t n, uint64_t off) {
  uint64_t lo = 0, hi = n;
  while (lo < hi) {
    uint64_t mid = lo + (hi - lo) / 2;
    if (a[mid].off < off) lo = mid + 1; else hi = mid;
  }
  return lo < n && a[lo].off == off && !a[lo].dead ? &a[lo] : NULL;
}

/* Count pins (chunks and descs) and table records (descs). Problems go to r (may be NULL). */
static void count_pins_and_records(void *base, bref *a, uint64_t n, reporter *r) {
  rs_seg_hdr *h = rs_seg(base);
  int shown = 0;
  for (uint32_t s = 0; s < h->max_procs; s++) {
    uint64_t *e = rs_pin_entries(base, s);
    int live = rs_slots(base)[s].pid != 0;
    uint32_t cap = rs_slots(base)[s].pin_cap;
    if (cap > h->pins_per_proc) cap = h->pins_per_proc;   /* (a corrupt count: the log ends there) */
    for (uint32_t i = 0; i < cap; i++) {
      if (!e[i]) continue;
      bref *b = live ? find_ref(a, n, e[i]) : NULL;
      if (b) b->count++;
      else if (r && shown++ < MAX_REPORTED)
        report(r, "arena: pin %u of %s slot %u holds offset %llu, which is not an allocated block", i,
               live ? "live" : "free", s, (unsigned long long)e[i]);
    }
  }
  for (uint32_t t = 0; t < h->num_tables; t++) {
    rs_table_hdr *th = rs_table(base, t);
    rs_rec *recs = rs_recs(base, th);
    for (uint32_t i = 0; i < th->cap; i++) {
      if (!recs[i].valid) continue;
      bref *b = find_ref(a, n, rs_ref_off(recs[i].desc_off));
      if (b && b->type == RS_BLOCK_DESC) b->count++;
      else if (r && shown++ < MAX_REPORTED)
        report(r, "arena: table %u record %u (key %llu) names descriptor %llu, which is not a descriptor block",
               t, i, (unsigned long long)recs[i].key, (unsigned long long)recs[i].desc_off);
    }
  }
}

typedef struct chunk_count_ctx { bref *a; uint64_t n; reporter *r; uint64_t desc_off; int shown; } chunk_count_ctx;

static void count_chunk_cb(void *base, uint64_t chunk_off, void *arg) {
  chunk_count_ctx *c = arg;
  bref *b = find_ref(c->a, c->n, chunk_off);
  if (b && b->type == RS_BLOCK_CHUNK) b->count++;
  else if (c->r && c->shown++ < MAX_REPORTED)
    report(c->r, "arena: descriptor %llu names chunk %llu, which is not a chunk block",
           (unsigned long long)c->desc_off, (unsigned long long)chunk_off);
}

/* Does the DESC block at payload `off` hold a blob whose header matches its recorded length? */
static int desc_sane(void *base, uint64_t off) {
  rs_blk *b = blk(base, off - RS_ALIGN);
  const rs_desc_hdr *d = rs_desc_blob(base, off);
  uint64_t len = sizeof *d + (uint64_t)d->ncols * sizeof(rs_desc_col) + (uint64_t)d->nslices * sizeof(rs_desc_slice);
  return b->aux == len && RS_ALIGN + rs_desc_data_offset() + len <= bsize(b);
}

int rs_item_ref_valid(void *base, uint64_t ref) {
  uint64_t off = rs_ref_off(ref);
  if (!is_block(base, off, RS_BLOCK_DESC, 1) || !desc_sane(base, off)) return 0;
  const rs_desc_hdr *d = rs_desc_blob(base, off);
  const rs_desc_slice *s = desc_slices(d);
  for (uint32_t k = 0; k < d->nslices; k++)
    if (!is_block(base, s[k].chunk_off, RS_BLOCK_CHUNK, 1)) return 0;
  return rs_item_in_arena(base, ref);
}

/* Add one reference per distinct chunk of every (live) descriptor. Returns -1 on out of memory. */
static int count_desc_chunks(void *base, bref *a, uint64_t n, reporter *r) {
  chunk_count_ctx c = {a, n, r, 0, 0};
  for (uint64_t i = 0; i < n; i++) {
    if (a[i].type != RS_BLOCK_DESC || a[i].dead) continue;
    if (!desc_sane(base, a[i].off)) {
      if (r) report(r, "arena: descriptor %llu: blob header does not match its recorded length %llu",
                    (unsigned long long)a[i].off, (unsigned long long)blk(base, a[i].off - RS_ALIGN)->aux);
      continue;
    }
    c.desc_off = a[i].off;
    if (for_each_chunk(base, rs_desc_blob(base, a[i].off), count_chunk_cb, &c) != 0) return -1;
  }
  return 0;
}

void rs_recount(void *base) {
  rs_seg_hdr *h = rs_seg(base);
  uint64_t n;
  bref *a = collect_blocks(base, &n);
  if (n == UINT64_MAX) return;             /* out of memory: counts stay suspect, retried later */
  count_pins_and_records(base, a, n, NULL);
  for (uint64_t i = 0; i < n; i++) {       /* unreferenced descriptors go first ... */
    if (a[i].type == RS_BLOCK_DESC && a[i].count == 0) {
      block_free(base, a[i].off - RS_ALIGN);
      a[i].dead = 1;
    }
  }
  if (count_desc_chunks(base, a, n, NULL) != 0) { free(a); return; }
  for (uint64_t i = 0; i < n; i++) {       /* ... then every count is final */
    if (a[i].dead) continue;
    blk(base, a[i].off - RS_ALIGN)->refcount = a[i].count;
    if (a[i].count == 0) block_free(base, a[i].off - RS_ALIGN);
  }
  free(a);
  h->refcounts_suspect = 0;
}

/* ------------------------------------------------------------------ invariant check */

int rs_arena_check(void *base, char *report_buf, uint64_t report_len) {
  rs_seg_hdr *h = rs_seg(base);
  reporter r = {report_buf, report_len, 0};
  uint64_t end = arena_end(h), used = 0, freeb = 0, nfree = 0, nchunks = 0, ndescs = 0, prev_size = 0;
  int prev_free = 0, shown = 0;
  uint64_t off = h->arena_off;
  while (off < end) {
    rs_blk *b = blk(base, off);
    uint64_t size = bsize(b);
    uint32_t type = btype(b);
    if (size < RS_ALIGN || size > end - off || type > RS_BLOCK_DESC) {
      report(&r, "arena: block at %llu has size %llu and type %u, expected a multiple of 64 within the"
             " arena's %llu bytes left and a known type; walk stopped",
             (unsigned long long)off, (unsigned long long)size, type, (unsigned long long)(end - off));
      break;
    }
    if (b->magic != BLK_MAGIC && shown++ < MAX_REPORTED)
      report(&r, "arena: block at %llu has magic 0x%x, expected 0x%x", (unsigned long long)off, b->magic, BLK_MAGIC);
    if (b->prev_size != prev_size && shown++ < MAX_REPORTED)
      report(&r, "arena: block at %llu records prev_size %llu, expected %llu", (unsigned long long)off,
             (unsigned long long)b->prev_size, (unsigned long long)prev_size);
    if (type == RS_BLOCK_FREE) {
      if (prev_free && shown++ < MAX_REPORTED)
        report(&r, "arena: free block at %llu follows another free block (not coalesced)", (unsigned long long)off);
      freeb += size;
      nfree++;
    } else {
      used += size;
      nchunks += type == RS_BLOCK_CHUNK;
      ndescs += type == RS_BLOCK_DESC;
      if (type == RS_BLOCK_CHUNK) {
        rs_chunk_hdr *c = rs_chunk(base, off + RS_ALIGN);
        if ((size < RS_ALIGN + CHUNK_DATA_OFF || c->data_offset != CHUNK_DATA_OFF ||
             c->rows > c->capacity || RS_ALIGN + c->data_offset + c->nbytes > size) && shown++ < MAX_REPORTED)
          report(&r, "arena: chunk at %llu (block %llu bytes) has data_offset %llu, nbytes %llu, rows %u of"
                 " capacity %u: expected the payload inside the block and rows <= capacity",
                 (unsigned long long)(off + RS_ALIGN), (unsigned long long)size,
                 (unsigned long long)c->data_offset, (unsigned long long)c->nbytes, c->rows, c->capacity);
      }
    }
    prev_free = type == RS_BLOCK_FREE;
    prev_size = size;
    off += size;
  }
  int walked = off == end;
  if (walked && h->tail_size != prev_size)
    report(&r, "arena: records its last block as %llu bytes, the walk finds %llu", (unsigned long long)h->tail_size,
           (unsigned long long)prev_size);
  if (walked && h->arena_size > h->arena_max)
    report(&r, "arena: %llu bytes, more than its room of %llu", (unsigned long long)h->arena_size,
           (unsigned long long)h->arena_max);
  if (walked && used + freeb != h->arena_size)
    report(&r, "arena: used %llu + free %llu bytes, expected the arena size %llu", (unsigned long long)used,
           (unsigned long long)freeb, (unsigned long long)h->arena_size);
  if (walked && (used != h->arena_used || nchunks != h->num_chunks || ndescs != h->num_descs))
    report(&r, "arena: accounting says %llu bytes used, %llu chunks, %llu descriptors; the walk finds %llu, %llu, %llu",
           (unsigned long long)h->arena_used, (unsigned long long)h->num_chunks, (unsigned long long)h->num_descs,
           (unsigned long long)used, (unsigned long long)nchunks, (unsigned long long)ndescs);
  if (!walked) return RS_ECORRUPT;

  /* Free lists hold exactly the free blocks: every node is a free block of its class, links are
   * mutual, no cycles (bounded by the count), and the node count equals the walk's. */
  uint64_t listed = 0;
  for (unsigned bin = 0; bin < RS_NBINS; bin++) {
    uint64_t prevn = 0;
    for (uint64_t o = h->free_heads[bin]; o; o = blk(base, o)->next_free) {
      if (++listed > nfree) {
        report(&r, "arena: free lists hold more than the %llu free blocks (a cycle or a stale entry)",
               (unsigned long long)nfree);
        return RS_ECORRUPT;
      }
      if (o < h->arena_off || o >= end || (o - h->arena_off) % RS_ALIGN || blk(base, o)->magic != BLK_MAGIC ||
          btype(blk(base, o)) != RS_BLOCK_FREE || bin_of(bsize(blk(base, o))) != bin ||
          blk(base, o)->prev_free != prevn) {
        report(&r, "arena: free list %u entry %llu is not a correctly linked free block of that size class",
               bin, (unsigned long long)o);
        return RS_ECORRUPT;
      }
      prevn = o;
    }
  }
  if (listed != nfree)
    report(&r, "arena: free lists hold %llu blocks, the walk finds %llu free blocks", (unsigned long long)listed,
           (unsigned long long)nfree);

  /* Pin logs: stacks and counts agree with the entries. */
  for (uint32_t s = 0; s < h->max_procs; s++) {
    rs_slot *sl = &rs_slots(base)[s];
    uint64_t *e = rs_pin_entries(base, s);
    uint32_t held = 0;
    if (sl->pin_cap > h->pins_per_proc) {   /* (its entries would run past the slot's pin log) */
      report(&r, "arena: slot %u (pid %d) has a pin log of %u entries, beyond pins_per_proc %u", s, sl->pid,
             sl->pin_cap, h->pins_per_proc);
      continue;
    }
    for (uint32_t i = 0; i < sl->pin_cap; i++) held += e[i] != 0;
    if ((sl->pid == 0 && held) || held != sl->npins || sl->free_top != sl->pin_cap - held ||
        sl->pin_cap > h->pins_per_proc || (!h->growable && sl->pin_cap != h->pins_per_proc))
      report(&r, "arena: slot %u (pid %d) has %u pin entries, npins %u, free stack %u of %u (pins_per_proc %u)",
             s, sl->pid, held, sl->npins, sl->free_top, sl->pin_cap, h->pins_per_proc);
  }

  /* Every refcount equals the recount value. */
  uint64_t n;
  bref *a = collect_blocks(base, &n);
  if (n == UINT64_MAX) {
    report(&r, "arena: out of memory while checking reference counts");
    return RS_ECORRUPT;
  }
  count_pins_and_records(base, a, n, &r);
  if (count_desc_chunks(base, a, n, &r) != 0) report(&r, "arena: out of memory while checking descriptors");
  shown = 0;
  for (uint64_t i = 0; i < n; i++) {
    rs_blk *b = blk(base, a[i].off - RS_ALIGN);
    if ((b->refcount != a[i].count || a[i].count == 0) && shown++ < MAX_REPORTED)
      report(&r, "arena: %s at %llu has refcount %llu, expected %llu (%s)", type_name(a[i].type),
             (unsigned long long)a[i].off, (unsigned long long)b->refcount, (unsigned long long)a[i].count,
             a[i].count ? "records, descriptors and pins referencing it" : "nothing references it: leaked");
  }
  free(a);
  if (r.errors && h->refcounts_suspect)
    report(&r, "arena: refcounts are marked suspect after a dead process (rs_reap recounts them)");
  return r.errors ? RS_ECORRUPT : RS_OK;
}

/* ------------------------------------------------------------------ rs_write_chunks */

#define WRITE_CHUNKS_MAX 64   /* columns per rs_write_chunks call (stack bookkeeping) */

/* Allocate and pin one chunk per column: metas[c] with `capacity` rows, episode_id, start_step
 * and chunk flags `cflags`, no row published. All or nothing (RS_ENOSPC / RS_EFULL / RS_EINVAL
 * with nothing allocated); *nbytes_out[c] is column c's payload capacity. */
static int alloc_chunks(void *base, uint32_t slot, uint32_t ncols, const rs_chunk_hdr *metas,
                        uint32_t capacity, uint64_t episode_id, uint64_t start_step, uint32_t cflags,
                        const char *fn, uint64_t *offs_out, uint32_t *pins_out, uint64_t *nbytes) {
  if (!base || (ncols && (!metas || !offs_out || !pins_out)))
    return rs_set_error(RS_EINVAL, "%s: NULL argument", fn);
  if (ncols > WRITE_CHUNKS_MAX)
    return rs_set_error(RS_EINVAL, "%s: %u columns, expected <= %d", fn, ncols, WRITE_CHUNKS_MAX);
  if (capacity < 1) return rs_set_error(RS_EINVAL, "%s: rows must be >= 1, got 0", fn);
  uint64_t need[WRITE_CHUNKS_MAX];
  for (uint32_t c = 0; c < ncols; c++) {
    rs_chunk_hdr m = metas[c];
    m.capacity = capacity;
    m.flags = cflags;
    int rc = chunk_meta_check(&m, &nbytes[c]);
    if (rc == RS_OK && rs_dtype_is_object(m.dtype))
      rc = rs_set_error(RS_EINVAL, "%s: column %u is an object column; expected fixed-size rows", fn, c);
    if (rc) return rc;
    need[c] = nbytes[c] > UINT64_MAX / 2 ? (UINT64_MAX / 2) & ~TYPE_MASK
                                          : rs_align_up(RS_ALIGN + CHUNK_DATA_OFF + nbytes[c], RS_ALIGN);
  }
  int rc = rs_alock(base);
  if (rc) return rc;
  rc = slot_check(base, slot);
  if (rc == RS_OK) rc = rs_pins_grow(base, slot, ncols);
  uint32_t made = 0;
  for (; rc == RS_OK && made < ncols; made++) {
    uint64_t off = block_alloc(base, need[made], RS_BLOCK_CHUNK, (int32_t)slot);
    if (!off) {
      rc = RS_ENOSPC;   /* block_alloc set the message */
      break;
    }
    offs_out[made] = off + RS_ALIGN;
  }
  if (rc != RS_OK) {
    for (uint32_t c = 0; c < made; c++) decref(base, offs_out[c]);   /* refcount 1 -> freed */
    rs_aunlock(base);
    return rc;
  }
  for (uint32_t c = 0; c < ncols; c++) {
    rs_chunk_hdr *h = rs_chunk(base, offs_out[c]);
    memcpy(h, &metas[c], sizeof *h);
    h->capacity = capacity;
    h->nbytes = nbytes[c];
    h->data_offset = CHUNK_DATA_OFF;
    h->rows = 0;
    h->flags = cflags;
    h->episode_id = episode_id;
    h->start_step = start_step;
    pins_out[c] = pin_push(base, slot, offs_out[c]);   /* holds the refcount of 1 */
  }
  rs_aunlock(base);
  return RS_OK;
}

int rs_write_chunks(void *base, uint32_t slot, uint32_t ncols, const rs_chunk_hdr *metas,
                    const uint8_t *const *data, uint32_t rows, uint64_t episode_id,
                    uint64_t start_step, uint64_t *offs_out, uint32_t *pins_out) {
  if (ncols && !data) return rs_set_error(RS_EINVAL, "rs_write_chunks: NULL argument");
  for (uint32_t c = 0; c < ncols && c < WRITE_CHUNKS_MAX && metas; c++)
    if (!data[c] && metas[c].row_bytes)
      return rs_set_error(RS_EINVAL, "rs_write_chunks: data[%u] is NULL", c);
  uint64_t nbytes[WRITE_CHUNKS_MAX];
  int rc = alloc_chunks(base, slot, ncols, metas, rows, episode_id, start_step, 0, "rs_write_chunks",
                        offs_out, pins_out, nbytes);
  if (rc) return rc;
  /* The chunks are private to this writer until published: copy without any lock. */
  for (uint32_t c = 0; c < ncols; c++) {
    rs_chunk_hdr *h = rs_chunk(base, offs_out[c]);
    rs_copy_stream((char *)h + CHUNK_DATA_OFF, data[c], nbytes[c]);
    __atomic_store_n(&h->rows, rows, __ATOMIC_RELEASE);
  }
  return RS_OK;
}

int rs_open_chunks(void *base, uint32_t slot, uint32_t ncols, const rs_chunk_hdr *metas,
                   uint32_t capacity, uint64_t episode_id, uint32_t flags, uint64_t *offs_out,
                   uint32_t *pins_out) {
  uint32_t cflags = ncols && metas ? metas[0].flags : 0;
  if (flags & RS_ROWS_RANDOM_EPISODE) {
    episode_id = rs_rand_u64();
    cflags = RS_CHUNK_ROW_EPISODES;
  }
  uint64_t nbytes[WRITE_CHUNKS_MAX];
  return alloc_chunks(base, slot, ncols, metas, capacity, episode_id, 0, cflags, "rs_open_chunks",
                      offs_out, pins_out, nbytes);
}
