/* Per-table invariant checker (rs_table_check); the caller holds the table lock.
 *
 * Verified: size == valid records == index entries == dense length; the index maps every valid
 * key to its record; every item's (shifted) slices lie within its chunks' published rows; the free list holds exactly the invalid records; the insertion-order list
 * is consistent and sorted by insert_seq; heaps are heaps with correct back-pointers; every
 * sum-tree node equals the sum of its children and every leaf equals its record's weight; the
 * episode map matches a recount; inserts - deletes == size; limiter parameters are sane. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "index.h"
#include "limiter.h"
#include "selectors.h"
#include "sumtree.h"
#include "table.h"

typedef struct report {
  char *buf;
  uint64_t cap;
  const char *table;
  int bad;
} report_t;

__attribute__((format(printf, 2, 3))) static void fail(report_t *rep, const char *fmt, ...) {
  rep->bad++;
  if (!rep->buf || rep->cap == 0) return;
  size_t used = strnlen(rep->buf, rep->cap - 1);
  if (used + 1 >= rep->cap) return;
  int n = snprintf(rep->buf + used, rep->cap - used, "table '%s': ", rep->table);
  if (n < 0 || (uint64_t)(used + n) + 1 >= rep->cap) return;
  used += (size_t)n;
  va_list ap;
  va_start(ap, fmt);
  n = vsnprintf(rep->buf + used, rep->cap - used, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  used = strnlen(rep->buf, rep->cap - 1);
  if (used + 2 <= rep->cap) {
    rep->buf[used] = '\n';
    rep->buf[used + 1] = '\0';
  }
}

static void check_records(void *base, rs_table_hdr *th, report_t *rep) {
  rs_rec *recs = rs_recs(base, th);
  uint32_t *dense = rs_dense(base, th);
  rs_index_entry *ix = rs_tindex(base, th);
  uint64_t valid = 0, entries = 0;
  for (uint32_t r = 0; r < th->cap; r++) {
    if (recs[r].valid > 1) fail(rep, "record %u has valid=%u", r, recs[r].valid);
    if (recs[r].valid != 1) continue;
    valid++;
    if (rs_index_find(ix, th->index_cap, recs[r].key) != r)
      fail(rep, "index does not map key %llu to its record %u", (unsigned long long)recs[r].key, r);
    if (recs[r].dense_pos >= th->size || dense[recs[r].dense_pos] != r)
      fail(rep, "record %u has dense_pos %u but dense[] disagrees", r, recs[r].dense_pos);
    if (!rs_item_ref_valid(base, recs[r].desc_off)) {
      fail(rep, "record %u (key %llu): item reference %llu is not a live descriptor whose slices lie in "
           "live chunks", r, (unsigned long long)recs[r].key, (unsigned long long)recs[r].desc_off);
      continue;
    }
    const rs_desc_hdr *d = rs_desc_blob(base, recs[r].desc_off);
    const rs_desc_slice *sl = rs_desc_slices(d);
    uint64_t shift = rs_ref_shift(recs[r].desc_off);
    for (uint32_t k = 0; k < d->nslices; k++)
      if (sl[k].row_offset + shift + sl[k].nrows > rs_chunk(base, sl[k].chunk_off)->rows)
        fail(rep, "record %u (key %llu): slice %u rows [%llu, +%u) beyond its chunk's published rows", r,
             (unsigned long long)recs[r].key, k, (unsigned long long)(sl[k].row_offset + shift), sl[k].nrows);
  }
  for (uint32_t i = 0; i < th->index_cap; i++) {
    if (!ix[i].rec_plus1) continue;
    entries++;
    uint32_t r = ix[i].rec_plus1 - 1;
    if (r >= th->cap || !recs[r].valid || recs[r].key != ix[i].key)
      fail(rep, "index entry %u (key %llu) points at record %u which is not that live item", i,
           (unsigned long long)ix[i].key, r);
  }
  if (th->size < 0 || (uint64_t)th->size != valid || entries != valid || (uint64_t)th->size > th->max_size)
    fail(rep, "size %lld, valid records %llu, index entries %llu, max_size %llu disagree",
         (long long)th->size, (unsigned long long)valid, (unsigned long long)entries,
         (unsigned long long)th->max_size);
  for (int64_t i = 0; i < th->size && i < th->cap; i++)
    if (dense[i] >= th->cap || !recs[dense[i]].valid)
      fail(rep, "dense[%lld] = %u is not a live record", (long long)i, dense[i]);
  uint64_t nfree = 0;
  for (uint32_t r = th->free_rec_head; r != RS_NONE && nfree <= th->cap; r = recs[r].next_free) {
    if (r >= th->cap) {
      fail(rep, "free list holds out-of-range record %u", r);
      break;
    }
    if (recs[r].valid) fail(rep, "free list holds live record %u", r);
    nfree++;
  }
  if (nfree != th->cap - valid)
    fail(rep, "free list has %llu records, expected %llu", (unsigned long long)nfree,
         (unsigned long long)(th->cap - valid));
}

static void check_order(void *base, rs_table_hdr *th, report_t *rep) {
  rs_rec *recs = rs_recs(base, th);
  uint32_t prev = RS_NONE, r = th->order_head;
  uint64_t n = 0;
  for (; r != RS_NONE && n <= th->cap; r = recs[r].next, n++) {
    if (r >= th->cap || !recs[r].valid) {
      fail(rep, "order list holds %u which is not a live record", r);
      return;
    }
    if (recs[r].prev != prev) fail(rep, "order list: record %u has prev %u, expected %u", r, recs[r].prev, prev);
    if (prev != RS_NONE && recs[prev].insert_seq >= recs[r].insert_seq)
      fail(rep, "order list not sorted by insert_seq at record %u", r);
    if (recs[r].insert_seq >= th->next_insert_seq)
      fail(rep, "record %u has insert_seq beyond next_insert_seq", r);
    prev = r;
  }
  if (th->order_tail != prev) fail(rep, "order_tail %u, expected %u", th->order_tail, prev);
  if (n != (uint64_t)th->size) fail(rep, "order list has %llu items, size is %lld", (unsigned long long)n, (long long)th->size);
}

static void check_selector(void *base, rs_table_hdr *th, int si, report_t *rep) {
  rs_selector *s = &th->sel[si];
  rs_rec *recs = rs_recs(base, th);
  if (rs_sel_is_heap(s->kind)) {
    uint32_t *heap = rs_heap(base, s);
    rs_heap_aux *aux = rs_aux(base, th);
    if (s->heap_len != (uint64_t)th->size) fail(rep, "selector %d: heap has %u items, size %lld", si, s->heap_len, (long long)th->size);
    for (uint32_t i = 0; i < s->heap_len && i < th->cap; i++) {
      uint32_t r = heap[i];
      if (r >= th->cap || !recs[r].valid || aux[r].heap_pos[si] != i) {
        fail(rep, "selector %d: heap[%u] = %u has a wrong back-pointer or is not live", si, i, r);
        continue;
      }
      if (i > 0 && heap[(i - 1) / 2] < th->cap && rs_heap_before(s->kind, recs, aux, r, heap[(i - 1) / 2]))
        fail(rep, "selector %d: heap property violated at position %u", si, i);
    }
  } else if (s->kind == RS_SEL_PRIORITIZED) {
    const double *tree = rs_tree(base, s);
    uint32_t L = th->tree_leaves;
    for (uint32_t r = 0; r < L; r++) {
      double want = r < th->cap && recs[r].valid ? rs_sel_weight(s->exponent, recs[r].priority) : 0.0;
      if (tree[L + r] != want)
        fail(rep, "selector %d: sum-tree leaf %u is %.17g, expected %.17g", si, r, tree[L + r], want);
    }
    uint32_t level = 0, index = 0;
    uint64_t bad = L > 0 ? rs_sumtree_check(tree, L, &level, &index) : 0;
    if (bad)
      fail(rep, "selector %d: %llu sum-tree entries differ from the sum of their children, the "
           "first at level %u entry %u", si, (unsigned long long)bad, level, index);
    if (L > 0 && !isfinite(rs_sumtree_total(tree)))
      fail(rep, "selector %d: sum-tree total is %g, expected a finite sum of weights <= %g", si,
           rs_sumtree_total(tree), rs_sel_weight_cap(L));
  }
}

typedef struct recount {
  rs_episode_entry *em;
  uint32_t cap;
  int64_t distinct;
  int overflow;   /* more distinct episodes than the map has room for */
} recount_t;

static void recount_add(void *c, uint64_t ep) {
  recount_t *x = c;
  int rc = rs_epmap_incr(x->em, x->cap, ep);
  if (rc == 1) x->distinct++;
  else if (rc < 0) x->overflow = 1;
}

static void check_episodes(void *base, rs_table_hdr *th, report_t *rep) {
  rs_rec *recs = rs_recs(base, th);
  recount_t rc = {calloc(th->episodes_cap, sizeof(rs_episode_entry)), th->episodes_cap, 0, 0};
  if (!rc.em) {
    fail(rep, "out of memory while recounting episodes");
    return;
  }
  for (uint32_t r = 0; r < th->cap; r++)
    if (recs[r].valid == 1 && rs_item_ref_valid(base, recs[r].desc_off))
      rs_item_each_episode(base, recs[r].desc_off, recount_add, &rc);
  if (rc.overflow)
    fail(rep, "the items name more distinct episodes than the episode map holds (%u entries)",
         th->episodes_cap);
  rs_episode_entry *em = rs_tepisodes(base, th);
  int64_t used = 0;
  for (uint32_t i = 0; i < th->episodes_cap; i++) {
    if (!em[i].count) continue;
    used++;
    rs_episode_entry *want = rs_epmap_find(rc.em, rc.cap, em[i].episode_id);
    if (!want || want->count != em[i].count)
      fail(rep, "episode %llu counted %u times, recount says %u", (unsigned long long)em[i].episode_id,
           em[i].count, want ? want->count : 0);
    if (rs_epmap_find(em, th->episodes_cap, em[i].episode_id) != &em[i])
      fail(rep, "episode %llu is not reachable by lookup", (unsigned long long)em[i].episode_id);
  }
  if (used != rc.distinct || th->num_episodes != rc.distinct)
    fail(rep, "num_episodes %lld, map entries %lld, recount %lld", (long long)th->num_episodes,
         (long long)used, (long long)rc.distinct);
  free(rc.em);
}

static void check_counters(rs_table_hdr *th, report_t *rep) {
  if (th->inserts - th->deletes != th->size)
    fail(rep, "inserts %lld - deletes %lld != size %lld", (long long)th->inserts,
         (long long)th->deletes, (long long)th->size);
  if (th->inserts < 0 || th->deletes < 0 || th->samples < 0 || th->num_deleted_episodes < 0 ||
      th->num_unique_samples < 0)
    fail(rep, "negative counter");
  if (rs_limiter_validate(th->samples_per_insert, th->min_size_to_sample, th->min_diff, th->max_diff))
    fail(rep, "rate limiter parameters invalid: %s", rs_last_error());
}

int rs_table_check(void *base, uint32_t t, char *report, uint64_t report_len) {
  rs_table_hdr *th = rs_table(base, t);
  report_t rep = {report, report_len, th->name, 0};
  int heaps = rs_sel_is_heap(th->sel[0].kind) || rs_sel_is_heap(th->sel[1].kind);
  if (th->cap != th->max_size + 1 || th->index_cap != rs_index_capacity(th->cap) ||
      th->episodes_cap != rs_map_capacity(th->cap) || !th->aux_off != !heaps) {
    fail(&rep, "capacities inconsistent (cap %u, max_size %llu, index_cap %u, episodes_cap %u, heap data %s)",
         th->cap, (unsigned long long)th->max_size, th->index_cap, th->episodes_cap,
         th->aux_off ? "present" : "absent");
    return RS_ECORRUPT;
  }
  check_records(base, th, &rep);
  check_order(base, th, &rep);
  for (int si = 0; si < 2; si++) check_selector(base, th, si, &rep);
  check_episodes(base, th, &rep);
  check_counters(th, &rep);
  return rep.bad ? RS_ECORRUPT : RS_OK;
}
