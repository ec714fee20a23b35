/* Fused small-insert path (rs_insert_rows). See rs_api.h. */
#include <stdlib.h>
#include <string.h>

#include "rs_internal.h"

#define ROWS_STACK_SLICES 256   /* slices built on the stack up to this many (4 KiB) */

/* rs_insert_slices of n items where item i is row first_row + i of every chunk chunk_offs[c]
 * (random keys first with RS_ROWS_RANDOM_KEYS). */
static int insert_row_items(void *base, uint32_t slot, uint32_t table, uint32_t n, uint64_t *keys,
                            const double *priorities, uint32_t ncols, const uint64_t *chunk_offs,
                            uint32_t first_row, const uint32_t *col_flags, uint32_t flags,
                            int64_t deadline_ns, int64_t slice_ns, uint32_t *done_out) {
  uint64_t total = (uint64_t)n * ncols;
  rs_desc_slice stack_slices[ROWS_STACK_SLICES];
  rs_desc_slice *slices = total <= ROWS_STACK_SLICES ? stack_slices
                                                     : malloc(total * sizeof *slices);
  if (!slices)
    return rs_set_error(RS_ESYS, "rs_insert_rows: out of memory for %llu slices",
                        (unsigned long long)total);
  if (flags & RS_ROWS_RANDOM_KEYS)
    for (uint32_t i = 0; i < n; i++) keys[i] = rs_rand_u64();
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t c = 0; c < ncols; c++) {
      rs_desc_slice *s = &slices[(uint64_t)i * ncols + c];
      s->chunk_off = chunk_offs[c];
      s->row_offset = first_row + i;
      s->nrows = 1;
    }
  int rc = rs_insert_slices(base, slot, table, n, keys, priorities, ncols, slices, col_flags,
                            deadline_ns, slice_ns, done_out);
  if (slices != stack_slices) free(slices);
  return rc;
}

static int rows_args(const char *fn, uint32_t n, uint32_t ncols, const uint64_t *keys,
                     const double *priorities, const uint32_t *col_flags, const void *offs,
                     const uint32_t *done_out) {
  if (!done_out) return rs_set_error(RS_EINVAL, "%s: done_out is NULL", fn);
  if (n == 0) return rs_set_error(RS_EINVAL, "%s: n must be >= 1, got 0", fn);
  if (!keys || !priorities || !col_flags || !offs) return rs_set_error(RS_EINVAL, "%s: NULL argument", fn);
  if (ncols == 0) return rs_set_error(RS_EINVAL, "%s: expected >= 1 column, got 0", fn);
  return RS_OK;
}

int rs_insert_rows(void *base, uint32_t slot, uint32_t table, uint32_t n, uint64_t *keys,
                   const double *priorities, uint32_t ncols, const rs_chunk_hdr *metas,
                   const uint8_t *const *data, const uint32_t *col_flags, uint64_t episode_id,
                   uint32_t flags, int64_t deadline_ns, int64_t slice_ns,
                   uint64_t *chunk_offs_out, uint32_t *pins_out, uint32_t *done_out) {
  if (done_out) *done_out = 0;
  int rc = rows_args("rs_insert_rows", n, ncols, keys, priorities, col_flags, chunk_offs_out, done_out);
  if (rc == RS_OK && !pins_out) rc = rs_set_error(RS_EINVAL, "rs_insert_rows: NULL argument");
  if (rc) return rc;
  if (flags & RS_ROWS_RANDOM_EPISODE) episode_id = rs_rand_u64();
  rc = rs_write_chunks(base, slot, ncols, metas, data, n, episode_id, 0, chunk_offs_out, pins_out);
  if (rc == RS_OK) {
    rc = insert_row_items(base, slot, table, n, keys, priorities, ncols, chunk_offs_out, 0, col_flags,
                          flags, deadline_ns, slice_ns, done_out);
    if (rc != RS_EAGAIN) {   /* the items (if any) hold the chunks now; pins of this call */
      int urc = rs_unpin_fresh(base, slot, ncols, pins_out);
      if (rc == RS_OK) rc = urc;
    }
  }
  return rc;
}

int rs_insert_rows_at(void *base, uint32_t slot, uint32_t table, uint32_t n, uint64_t *keys,
                      const double *priorities, uint32_t ncols, const uint64_t *chunk_offs,
                      uint32_t first_row, const uint8_t *const *data, const uint32_t *col_flags,
                      uint32_t flags, int64_t deadline_ns, int64_t slice_ns, uint32_t *done_out) {
  if (done_out) *done_out = 0;
  int rc = rows_args("rs_insert_rows_at", n, ncols, keys, priorities, col_flags, chunk_offs, done_out);
  if (rc) return rc;
  if (data) {
    rc = rs_check_priorities(base, table, n, priorities);   /* nothing written for bad ones */
    if (rc) return rc;
    rs_seg_hdr *h = rs_seg(base);
    for (uint32_t c = 0; c < ncols; c++) {   /* the caller's pins keep the chunks: check, no lock */
      uint64_t off = chunk_offs[c];
      const rs_chunk_hdr *ch = rs_chunk(base, off);
      if (off < h->arena_off + RS_ALIGN || off >= h->arena_off + h->arena_size || off % RS_ALIGN ||
          rs_dtype_is_object(ch->dtype) || (uint64_t)first_row + n > ch->capacity ||
          (ch->row_bytes && !data[c]))
        return rs_set_error(RS_EINVAL, "rs_insert_rows_at: column %u: rows [%u, %llu) do not fit open "
                            "numeric chunk %llu", c, first_row, (unsigned long long)first_row + n,
                            (unsigned long long)off);
    }
    for (uint32_t c = 0; c < ncols; c++) {
      rs_chunk_hdr *ch = rs_chunk(base, chunk_offs[c]);
      rs_copy_stream((char *)ch + ch->data_offset + (uint64_t)first_row * ch->row_bytes, data[c],
                     (uint64_t)n * ch->row_bytes);
      uint32_t rows = __atomic_load_n(&ch->rows, __ATOMIC_RELAXED);   /* publish: rows only grow */
      while (rows < first_row + n &&
             !__atomic_compare_exchange_n(&ch->rows, &rows, first_row + n, 1, __ATOMIC_RELEASE,
                                          __ATOMIC_RELAXED)) {
      }
    }
  }
  return insert_row_items(base, slot, table, n, keys, priorities, ncols, chunk_offs, first_row, col_flags,
                          flags, deadline_ns, slice_ns, done_out);
}
