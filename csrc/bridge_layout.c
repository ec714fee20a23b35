/* Grouping sampled items by column layout, so the gRPC bridge can
 * gather each group's columns into one array per column (rs_gather) with exact layouts. */
#include <string.h>

#include "rs_internal.h"
#include "table.h"

/* Same element type: row bytes, dtype and element shape. */
static int same_element(const rs_chunk_hdr *a, const rs_chunk_hdr *b) {
  return a->row_bytes == b->row_bytes && a->ndim == b->ndim && a->ndim <= 8 &&
         memcmp(a->dtype, b->dtype, sizeof a->dtype) == 0 &&
         memcmp(a->shape, b->shape, (size_t)a->ndim * sizeof a->shape[0]) == 0;
}

/* Total rows of column c of item d if every chunk it reads is numeric with the element type of
 * its first chunk (*first_out), else 0. */
static uint64_t uniform_rows(void *base, const rs_desc_hdr *d, uint32_t c,
                             const rs_chunk_hdr **first_out) {
  const rs_desc_col *col = &((const rs_desc_col *)(d + 1))[c];
  if (col->nslices == 0) return 0;
  const rs_desc_slice *s = rs_desc_slices(d) + col->first_slice;
  const rs_chunk_hdr *first = rs_chunk(base, s[0].chunk_off);
  if (rs_dtype_is_object(first->dtype)) return 0;
  uint64_t rows = 0;
  for (uint32_t j = 0; j < col->nslices; j++) {
    if (j && !same_element(first, rs_chunk(base, s[j].chunk_off))) return 0;
    rows += s[j].nrows;
  }
  *first_out = first;
  return rows;
}

static int gatherable(void *base, const rs_desc_hdr *d) {
  const rs_chunk_hdr *first;
  for (uint32_t c = 0; c < d->ncols; c++)
    if (!uniform_rows(base, d, c, &first)) return 0;
  return d->ncols > 0;
}

/* Both items gatherable: same columns, squeeze flags, rows and element types. */
static int same_layout(void *base, const rs_desc_hdr *a, const rs_desc_hdr *b) {
  if (a->ncols != b->ncols) return 0;
  const rs_desc_col *ca = (const rs_desc_col *)(a + 1), *cb = (const rs_desc_col *)(b + 1);
  for (uint32_t c = 0; c < a->ncols; c++) {
    const rs_chunk_hdr *fa, *fb;
    if ((ca[c].flags & 1u) != (cb[c].flags & 1u)) return 0;
    if (uniform_rows(base, a, c, &fa) != uniform_rows(base, b, c, &fb)) return 0;
    if (!same_element(fa, fb)) return 0;
  }
  return 1;
}

int rs_group_layouts(void *base, uint32_t n, const uint64_t *desc_offs, uint32_t max_groups,
                     uint32_t *group_out, uint32_t *ngroups_out) {
  if (!base || (n && (!desc_offs || !group_out)) || !ngroups_out)
    return rs_set_error(RS_EINVAL, "rs_group_layouts: NULL argument");
  if (max_groups > 64) max_groups = 64;
  const rs_desc_hdr *reps[64];
  uint32_t ngroups = 0;
  for (uint32_t i = 0; i < n; i++) {
    const rs_desc_hdr *d = rs_desc_blob(base, desc_offs[i]);
    uint32_t g = UINT32_MAX;
    if (rs_item_in_arena(base, desc_offs[i]) && gatherable(base, d)) {   /* damaged: ungrouped */
      for (uint32_t k = 0; k < ngroups && g == UINT32_MAX; k++)
        if (same_layout(base, reps[k], d)) g = k;
      if (g == UINT32_MAX && ngroups < max_groups) {
        reps[ngroups] = d;
        g = ngroups++;
      }
    }
    group_out[i] = g;
  }
  *ngroups_out = ngroups;
  return RS_OK;
}
