/* The six item selectors, each usable as the sampler (si 0) or the remover (si 1).
 *
 * Uniform draws record ids directly (rejecting free records) while >= 3/4 of the records hold
 * items, else uses the table's dense array; Fifo/Lifo use its insertion-order list (both kept by
 * table.c for every table); Prioritized keeps a sum tree (leaf = record id) and MinHeap/MaxHeap
 * a binary heap of record ids per selector. Callers hold the table lock. */
#ifndef RS_SELECTORS_H
#define RS_SELECTORS_H

#include <float.h>
#include <math.h>

#include "rs_internal.h"

static inline uint32_t *rs_dense(void *base, rs_table_hdr *th) { return (uint32_t *)rs_at(base, th->dense_off); }
static inline uint32_t *rs_heap(void *base, const rs_selector *s) { return (uint32_t *)rs_at(base, s->heap_off); }
static inline double *rs_tree(void *base, const rs_selector *s) { return (double *)rs_at(base, s->tree_off); }
static inline int rs_sel_is_heap(int kind) { return kind == RS_SEL_MINHEAP || kind == RS_SEL_MAXHEAP; }

/* Prioritized weight: 0 if priority == 0 (whatever the exponent), else priority**exponent. */
static inline double rs_sel_weight(double exponent, double priority) {
  return priority == 0 ? 0.0 : pow(priority, exponent);
}

/* Largest Prioritized weight a table accepts: the sum of `tree_leaves` such weights (the tree
 * total) stays finite with a factor 2 to spare, so sampling never meets an infinite total. */
static inline double rs_sel_weight_cap(uint32_t tree_leaves) {
  return DBL_MAX / (2.0 * (double)tree_leaves);
}

/* Heap order: (sign * priority, update_seq) ascending, sign +1 for MinHeap, -1 for MaxHeap. */
static inline int rs_heap_before(int kind, const rs_rec *recs, const rs_heap_aux *aux, uint32_t a,
                                 uint32_t b) {
  double pa = kind == RS_SEL_MINHEAP ? recs[a].priority : -recs[a].priority;
  double pb = kind == RS_SEL_MINHEAP ? recs[b].priority : -recs[b].priority;
  if (pa != pb) return pa < pb;
  return aux[a].update_seq < aux[b].update_seq;
}

/* Structure upkeep for record r (already in the dense array and order list). */
void rs_sel_insert(void *base, rs_table_hdr *th, int si, uint32_t r);
void rs_sel_remove(void *base, rs_table_hdr *th, int si, uint32_t r);
void rs_sel_update(void *base, rs_table_hdr *th, int si, uint32_t r); /* priority/update_seq changed */
/* Rebuild selector si from the valid records listed in the dense array (repair, reset). */
void rs_sel_rebuild(void *base, rs_table_hdr *th, int si);

/* Pick k records (table size > 0, no change in between) into recs[], with their reported
 * probabilities in probs[]. */
void rs_sel_pick(void *base, rs_table_hdr *th, int si, uint32_t k, uint32_t *recs, double *probs);

#endif
