/* Item descriptors over column windows (the trajectory writer's batched create_items path).
 *
 * A writer column stores its steps as runs: consecutive history positions written as consecutive
 * rows of one chunk. An item's column is a window of positions [start, start + length); it becomes
 * one descriptor slice per run it crosses. Building every descriptor of a batch here replaces a
 * Python loop per item and column.
 */
#include <string.h>

#include "rs_internal.h"

/* Index of the run of segs[0..nsegs) holding position pos, or -1. */
static int64_t find_run(const rs_window_seg *segs, uint32_t nsegs, int64_t pos) {
  uint32_t lo = 0, hi = nsegs;          /* first run with first_pos > pos is in [lo, hi] */
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (segs[mid].first_pos <= pos) lo = mid + 1; else hi = mid;
  }
  if (lo == 0) return -1;
  const rs_window_seg *s = &segs[lo - 1];
  return pos < s->first_pos + (int64_t)s->nrows ? (int64_t)lo - 1 : -1;
}

/* Slices of one window (written to out when not NULL); returns their count or a negative code. */
static int64_t window_slices(const rs_window_seg *segs, uint32_t nsegs, int64_t start,
                             uint32_t length, rs_desc_slice *out, uint32_t item, uint32_t col) {
  int64_t r = find_run(segs, nsegs, start);
  if (r < 0)
    return rs_set_error(RS_EINVAL, "item %u, column %u: position %lld is not a stored step of "
                        "the column", item, col, (long long)start);
  int64_t pos = start, end = start + (int64_t)length, count = 0;
  while (pos < end) {
    if (r >= (int64_t)nsegs || segs[r].first_pos > pos)
      return rs_set_error(RS_EINVAL, "item %u, column %u: position %lld of window [%lld, %lld) is "
                          "not a stored step of the column", item, col, (long long)pos,
                          (long long)start, (long long)end);
    const rs_window_seg *s = &segs[r];
    int64_t run_end = s->first_pos + (int64_t)s->nrows;
    int64_t take = (run_end < end ? run_end : end) - pos;
    if (out) {
      out[count].chunk_off = s->chunk_off;
      out[count].row_offset = s->row_offset + (uint32_t)(pos - s->first_pos);
      out[count].nrows = (uint32_t)take;
    }
    count++;
    pos += take;
    r++;
  }
  return count;
}

/* Start position of column c of item i (negative: counted from the column's end). */
static int64_t window_start(const int64_t *starts, uint32_t stride, const int64_t *col_ends,
                            uint32_t i, uint32_t c) {
  int64_t s = starts[(uint64_t)i * stride + (stride > 1 ? c : 0)];
  return s < 0 && col_ends ? s + col_ends[c] : s;
}

int rs_encode_windows(uint32_t n, uint32_t ncols, const rs_window_seg *segs,
                      const uint32_t *col_segs, const int64_t *col_ends, const uint32_t *col_flags,
                      const uint32_t *lengths, const int64_t *starts, uint32_t starts_stride,
                      const double *priorities, uint32_t nonneg, uint8_t *blob, uint64_t blob_cap,
                      uint64_t *offs, uint64_t *size_out) {
  if (!size_out || !offs || !col_segs || !col_flags || !lengths || (n && !starts))
    return rs_set_error(RS_EINVAL, "rs_encode_windows: NULL argument");
  if (ncols == 0 || ncols > (1u << 16))
    return rs_set_error(RS_EINVAL, "rs_encode_windows: expected 1..65536 columns, got %u", ncols);
  if (starts_stride != 1 && starts_stride != ncols)
    return rs_set_error(RS_EINVAL, "rs_encode_windows: starts_stride must be 1 or ncols (%u), got %u",
                        ncols, starts_stride);
  for (uint32_t c = 0; c < ncols; c++) {
    if (col_segs[c + 1] < col_segs[c])
      return rs_set_error(RS_EINVAL, "rs_encode_windows: col_segs must not decrease");
    if (lengths[c] == 0)
      return rs_set_error(RS_EINVAL, "column %u: empty window", c);
    if ((col_flags[c] & 1u) && lengths[c] != 1)
      return rs_set_error(RS_EINVAL, "column %u: a squeezed column holds exactly one step, got a "
                          "window of %u", c, lengths[c]);
  }
  /* Pass 1: validate every priority and window, and size the descriptors. */
  uint64_t total = 0;
  for (uint32_t i = 0; i < n; i++) {
    if (priorities) {
      double p = priorities[i];
      if (!(p == p) || p - p != 0.0 || (nonneg && p < 0))
        return rs_set_error(RS_EINVAL, "item %u: priority %g is %s", i, p,
                            nonneg ? "not a finite number >= 0" : "not finite");
    }
    uint64_t nslices = 0;
    for (uint32_t c = 0; c < ncols; c++) {
      int64_t k = window_slices(segs + col_segs[c], col_segs[c + 1] - col_segs[c],
                                window_start(starts, starts_stride, col_ends, i, c), lengths[c],
                                NULL, i, c);
      if (k < 0) return (int)k;
      nslices += (uint64_t)k;
    }
    total += sizeof(rs_desc_hdr) + (uint64_t)ncols * sizeof(rs_desc_col) +
             nslices * sizeof(rs_desc_slice);
  }
  *size_out = total;
  if (!blob) return RS_OK;
  if (total > blob_cap)
    return rs_set_error(RS_EFULL, "rs_encode_windows: %llu descriptor bytes do not fit in %llu",
                        (unsigned long long)total, (unsigned long long)blob_cap);
  /* Pass 2: write them (every window is known to be valid). */
  uint64_t at = 0;
  for (uint32_t i = 0; i < n; i++) {
    offs[i] = at;
    rs_desc_hdr *d = (rs_desc_hdr *)(blob + at);
    rs_desc_col *dc = (rs_desc_col *)(d + 1);
    rs_desc_slice *ds = (rs_desc_slice *)(dc + ncols);
    uint32_t nslices = 0;
    for (uint32_t c = 0; c < ncols; c++) {
      int64_t k = window_slices(segs + col_segs[c], col_segs[c + 1] - col_segs[c],
                                window_start(starts, starts_stride, col_ends, i, c), lengths[c],
                                ds + nslices, i, c);
      dc[c].first_slice = nslices;
      dc[c].nslices = (uint32_t)k;
      dc[c].flags = col_flags[c] & 1u;
      dc[c]._pad = 0;
      nslices += (uint32_t)k;
    }
    d->ncols = ncols;
    d->nslices = nslices;
    at += sizeof *d + (uint64_t)ncols * sizeof *dc + (uint64_t)nslices * sizeof *ds;
  }
  offs[n] = at;
  return RS_OK;
}
