/* Issue 6 (round 3): fused small-insert path (rs_insert_rows). See rs_api.h. */
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "rs_internal.h"

#define ROWS_STACK_SLICES 256   /* slices built on the stack up to this many (4 KiB) */

int rs_insert_rows(void *base, uint32_t slot, uint32_t table, uint32_t n, uint64_t *keys,
                   const double *priorities, uint32_t ncols, const rs_chunk_hdr *metas,
                   const uint8_t *const *data, const uint32_t *col_flags, uint64_t episode_id,
                   uint32_t flags, int64_t deadline_ns, int64_t slice_ns,
                   uint64_t *chunk_offs_out, uint32_t *pins_out, uint32_t *done_out) {
  if (!done_out) return rs_set_error(RS_EINVAL, "rs_insert_rows: done_out is NULL");
  *done_out = 0;
  if (n == 0) return rs_set_error(RS_EINVAL, "rs_insert_rows: n must be >= 1, got 0");
  if (!keys || !priorities || !col_flags || !chunk_offs_out || !pins_out)
    return rs_set_error(RS_EINVAL, "rs_insert_rows: NULL argument");
  if (ncols == 0) return rs_set_error(RS_EINVAL, "rs_insert_rows: expected >= 1 column, got 0");
  uint64_t total = (uint64_t)n * ncols;
  rs_desc_slice stack_slices[ROWS_STACK_SLICES];
  rs_desc_slice *slices = total <= ROWS_STACK_SLICES ? stack_slices
                                                     : malloc(total * sizeof *slices);
  if (!slices)
    return rs_set_error(RS_ESYS, "rs_insert_rows: out of memory for %llu slices",
                        (unsigned long long)total);
  if (flags & RS_ROWS_RANDOM_EPISODE) episode_id = rs_rand_u64();
  int rc = rs_write_chunks(base, slot, ncols, metas, data, n, episode_id, 0, chunk_offs_out,
                           pins_out);
  if (rc == RS_OK) {
    if (flags & RS_ROWS_RANDOM_KEYS)
      for (uint32_t i = 0; i < n; i++) keys[i] = rs_rand_u64();
    for (uint32_t i = 0; i < n; i++)
      for (uint32_t c = 0; c < ncols; c++) {
        rs_desc_slice *s = &slices[(uint64_t)i * ncols + c];
        s->chunk_off = chunk_offs_out[c];
        s->row_offset = i;
        s->nrows = 1;
      }
    rc = rs_insert_slices(base, slot, table, n, keys, priorities, ncols, slices, col_flags,
                          deadline_ns, slice_ns, done_out);
    if (rc != RS_EAGAIN) {   /* the items (if any) hold the chunks now; pins of this call */
      int urc = rs_unpin_fresh(base, slot, ncols, pins_out);
      if (rc == RS_OK) rc = urc;
    }
  }
  if (slices != stack_slices) free(slices);
  return rc;
}

void rs_copy_stream(void *dst, const void *src, uint64_t n) {
#if defined(__SSE2__)
  if (n >= RS_STREAM_MIN_BYTES) {
    uint8_t *d = dst;
    const uint8_t *s = src;
    uint64_t head = (RS_ALIGN - ((uintptr_t)d & (RS_ALIGN - 1))) & (RS_ALIGN - 1);
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= RS_ALIGN; d += RS_ALIGN, s += RS_ALIGN, n -= RS_ALIGN) {
      __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
      __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
      _mm_stream_si128((__m128i *)d, a);
      _mm_stream_si128((__m128i *)(d + 16), b);
      _mm_stream_si128((__m128i *)(d + 32), c);
      _mm_stream_si128((__m128i *)(d + 48), e);
    }
    _mm_sfence();   /* the stores are globally visible before rows is published */
    memcpy(d, s, n);
    return;
  }
#endif
  memcpy(dst, src, n);
}
