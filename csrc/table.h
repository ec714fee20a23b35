/* Helpers shared by table.c and table_check.c (private to the table module). */
#ifndef RS_TABLE_H
#define RS_TABLE_H

#include "rs_internal.h"

static inline rs_index_entry *rs_tindex(void *base, rs_table_hdr *th) {
  return (rs_index_entry *)rs_at(base, th->index_off);
}
static inline rs_episode_entry *rs_tepisodes(void *base, rs_table_hdr *th) {
  return (rs_episode_entry *)rs_at(base, th->episodes_off);
}
static inline const rs_desc_slice *rs_desc_slices(const rs_desc_hdr *d) {
  return (const rs_desc_slice *)((const char *)(d + 1) + (size_t)d->ncols * sizeof(rs_desc_col));
}

/* Call fn(ctx, episode_id) once per distinct chunk referenced by descriptor d (the unit in which
 * a table counts episode references, SPEC §2 num_episodes). */
static inline void rs_desc_each_episode(void *base, const rs_desc_hdr *d,
                                        void (*fn)(void *ctx, uint64_t episode_id), void *ctx) {
  const rs_desc_slice *s = rs_desc_slices(d);
  for (uint32_t i = 0; i < d->nslices; i++) {
    uint32_t j = 0;
    while (j < i && s[j].chunk_off != s[i].chunk_off) j++;
    if (j == i) fn(ctx, rs_chunk(base, s[i].chunk_off)->episode_id);
  }
}

#endif
