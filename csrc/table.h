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
 * a table counts episode references, TableInfo.num_episodes); for a chunk whose rows are episodes
 * of their own (RS_CHUNK_ROW_EPISODES), once per row of each of its slices instead. `shift` is
 * the item reference's row shift (rs_ref_shift), 0 for a blob of its own. */
static inline void rs_desc_each_episode(void *base, const rs_desc_hdr *d, uint32_t shift,
                                        void (*fn)(void *ctx, uint64_t episode_id), void *ctx) {
  const rs_desc_slice *s = rs_desc_slices(d);
  for (uint32_t i = 0; i < d->nslices; i++) {
    const rs_chunk_hdr *c = rs_chunk(base, s[i].chunk_off);
    if (c->flags & RS_CHUNK_ROW_EPISODES) {
      for (uint64_t r = (uint64_t)s[i].row_offset + shift, end = r + s[i].nrows; r < end; r++)
        fn(ctx, c->episode_id + r);
      continue;
    }
    uint32_t j = 0;
    while (j < i && s[j].chunk_off != s[i].chunk_off) j++;
    if (j == i) fn(ctx, c->episode_id);
  }
}

/* rs_desc_each_episode of the item with reference `ref`. */
static inline void rs_item_each_episode(void *base, uint64_t ref, void (*fn)(void *ctx, uint64_t episode_id),
                                        void *ctx) {
  rs_desc_each_episode(base, rs_desc_blob(base, ref), rs_ref_shift(ref), fn, ctx);
}

#endif
