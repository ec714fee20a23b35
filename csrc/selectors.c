/* Uniform, Prioritized, Fifo, Lifo, MinHeap and MaxHeap selectors. */
#include "selectors.h"
#include "sumtree.h"

/* ---------------------------------------------------------------- binary heap of record ids */
/* Heap positions and tie-break counters live in the table's rs_heap_aux array. */
static void heap_place(rs_heap_aux *aux, uint32_t *heap, int si, uint32_t pos, uint32_t r) {
  heap[pos] = r;
  aux[r].heap_pos[si] = pos;
}

static void sift_up(const rs_rec *recs, rs_heap_aux *aux, uint32_t *heap, int si, int kind, uint32_t pos) {
  uint32_t r = heap[pos];
  while (pos > 0) {
    uint32_t parent = (pos - 1) / 2;
    if (!rs_heap_before(kind, recs, aux, r, heap[parent])) break;
    heap_place(aux, heap, si, pos, heap[parent]);
    pos = parent;
  }
  heap_place(aux, heap, si, pos, r);
}

static void sift_down(const rs_rec *recs, rs_heap_aux *aux, uint32_t *heap, uint32_t len, int si, int kind,
                      uint32_t pos) {
  uint32_t r = heap[pos];
  for (;;) {
    uint32_t c = 2 * pos + 1;
    if (c >= len) break;
    if (c + 1 < len && rs_heap_before(kind, recs, aux, heap[c + 1], heap[c])) c++;
    if (!rs_heap_before(kind, recs, aux, heap[c], r)) break;
    heap_place(aux, heap, si, pos, heap[c]);
    pos = c;
  }
  heap_place(aux, heap, si, pos, r);
}

/* ---------------------------------------------------------------- upkeep */
/* A new record: a heap appends it as its last leaf, then both kinds place it as rs_sel_update
 * does (sum-tree leaf = its weight; the heap sifts it up, sifting down a leaf does nothing). */
void rs_sel_insert(void *base, rs_table_hdr *th, int si, uint32_t r) {
  rs_selector *s = &th->sel[si];
  if (rs_sel_is_heap(s->kind)) heap_place(rs_aux(base, th), rs_heap(base, s), si, s->heap_len++, r);
  rs_sel_update(base, th, si, r);
}

void rs_sel_remove(void *base, rs_table_hdr *th, int si, uint32_t r) {
  rs_selector *s = &th->sel[si];
  rs_rec *recs = rs_recs(base, th);
  if (s->kind == RS_SEL_PRIORITIZED) {
    rs_sumtree_set(rs_tree(base, s), th->tree_leaves, r, 0.0);
  } else if (rs_sel_is_heap(s->kind)) {
    uint32_t *heap = rs_heap(base, s);
    rs_heap_aux *aux = rs_aux(base, th);
    uint32_t pos = aux[r].heap_pos[si];
    uint32_t last = --s->heap_len;
    aux[r].heap_pos[si] = RS_NONE;
    if (pos == last) return;
    uint32_t moved = heap[last];
    heap_place(aux, heap, si, pos, moved);
    sift_down(recs, aux, heap, s->heap_len, si, s->kind, pos);
    if (aux[moved].heap_pos[si] == pos) sift_up(recs, aux, heap, si, s->kind, pos);
  }
}

void rs_sel_update(void *base, rs_table_hdr *th, int si, uint32_t r) {
  rs_selector *s = &th->sel[si];
  rs_rec *recs = rs_recs(base, th);
  if (s->kind == RS_SEL_PRIORITIZED) {
    rs_sumtree_set(rs_tree(base, s), th->tree_leaves, r, rs_sel_weight(s->exponent, recs[r].priority));
  } else if (rs_sel_is_heap(s->kind)) {
    uint32_t *heap = rs_heap(base, s);
    rs_heap_aux *aux = rs_aux(base, th);
    sift_up(recs, aux, heap, si, s->kind, aux[r].heap_pos[si]);
    sift_down(recs, aux, heap, s->heap_len, si, s->kind, aux[r].heap_pos[si]);
  }
}

void rs_sel_rebuild(void *base, rs_table_hdr *th, int si) {
  rs_selector *s = &th->sel[si];
  rs_rec *recs = rs_recs(base, th);
  uint32_t *dense = rs_dense(base, th);
  uint32_t n = (uint32_t)th->size;
  if (s->kind == RS_SEL_PRIORITIZED) {
    double *tree = rs_tree(base, s);
    for (uint32_t i = 0; i < 2 * th->tree_leaves; i++) tree[i] = 0.0;
    for (uint32_t i = 0; i < n; i++) {
      uint32_t r = dense[i];
      tree[th->tree_leaves + r] = rs_sel_weight(s->exponent, recs[r].priority);
    }
    rs_sumtree_rebuild(tree, th->tree_leaves);
  } else if (rs_sel_is_heap(s->kind)) {
    uint32_t *heap = rs_heap(base, s);
    rs_heap_aux *aux = rs_aux(base, th);
    for (uint32_t r = 0; r < th->cap; r++) aux[r].heap_pos[si] = RS_NONE;
    for (uint32_t i = 0; i < n; i++) heap_place(aux, heap, si, i, dense[i]);
    s->heap_len = n;
    for (uint32_t i = n / 2; i-- > 0;) sift_down(recs, aux, heap, n, si, s->kind, i);
  }
}

/* ---------------------------------------------------------------- picking */
#define PICK_BATCH 64
/* Uniform picks draw record ids directly (rejecting free records) while at least
 * DENSE_NUM/DENSE_DEN of the records hold items: fewer than 4/3 draws per pick on average, and
 * no dense[] read (one cache miss per pick fewer). */
#define DENSE_NUM 3u
#define DENSE_DEN 4u

/* k uniform positions in [0, bound) into out[], each element of `array` (elem bytes apart) at
 * those positions requested as it is drawn, so the scattered reads are all in flight at once
 * (for writing: the records that sample_round updates). */
static inline void draw_positions(uint32_t k, uint32_t bound, uint32_t *out, const void *array,
                                  uint64_t elem, int for_write) {
  for (uint32_t b = 0; b < k; b += PICK_BATCH) {
    uint32_t m = k - b < PICK_BATCH ? k - b : PICK_BATCH;
    uint64_t bits[PICK_BATCH];
    rs_rand_fill(bits, m);
    for (uint32_t j = 0; j < m; j++) {
      out[b + j] = rs_rand_below(bits[j], bound);
      const char *at = (const char *)array + out[b + j] * elem;
      if (for_write) __builtin_prefetch(at, 1, 1);   /* hint L2: measured faster here */
      else __builtin_prefetch(at, 0);
    }
  }
}

/* Draws per pick_records pick before it takes the pick from the dense array instead (each
 * draw is rejected with probability < 1/4: 1 pick in 4**REJECT_DRAWS goes there). */
#define REJECT_DRAWS 32

/* k uniform picks among the table's live records by rejection: a draw over all cap records is
 * kept when the record is valid, so every live item has probability 1/size (exact); a pick
 * that draws REJECT_DRAWS free records in a row is drawn from the dense array, uniform too,
 * so that the loop is bounded. The record lines read here are the ones sample_round reads
 * next. */
static void pick_records(void *base, rs_table_hdr *th, uint32_t k, uint32_t *recs_out, double *probs) {
  const rs_rec *recs = rs_recs(base, th);
  uint32_t cap = th->cap, n = (uint32_t)th->size;
  double p = 1.0 / (double)n;
  draw_positions(k, cap, recs_out, recs, sizeof *recs, 1);
  for (uint32_t j = 0; j < k; j++) {
    uint32_t r = recs_out[j];
    for (int draws = 1; !recs[r].valid; draws++)
      r = draws < REJECT_DRAWS ? rs_rand_below(rs_rand_u64(), cap)
                               : rs_dense(base, th)[rs_rand_below(rs_rand_u64(), n)];
    recs_out[j] = r;
    probs[j] = p;
  }
}

void rs_sel_pick(void *base, rs_table_hdr *th, int si, uint32_t k, uint32_t *recs_out,
                 double *probs) {
  rs_selector *s = &th->sel[si];
  uint32_t *dense = rs_dense(base, th);
  uint32_t n = (uint32_t)th->size;
  switch (s->kind) {
    case RS_SEL_PRIORITIZED: {
      const double *tree = rs_tree(base, s);
      double total = rs_sumtree_total(tree);
      if (total > 0) {
        for (uint32_t b = 0; b < k; b += PICK_BATCH) {
          uint32_t m = k - b < PICK_BATCH ? k - b : PICK_BATCH;
          uint64_t bits[PICK_BATCH];
          double u[PICK_BATCH];
          rs_rand_fill(bits, m);
          for (uint32_t j = 0; j < m; j++) u[j] = rs_rand_to_unit(bits[j]);
          rs_sumtree_find_many(tree, th->tree_leaves, m, u, recs_out + b);
          for (uint32_t j = 0; j < m; j++)
            probs[b + j] = rs_sumtree_leaf(tree, th->tree_leaves, recs_out[b + j]) / total;
        }
        return;
      }
      /* every weight is 0: uniform over all items */
    } /* fall through */
    case RS_SEL_UNIFORM:
      if ((uint64_t)n * DENSE_DEN >= (uint64_t)th->cap * DENSE_NUM) {
        pick_records(base, th, k, recs_out, probs);
        return;
      }
      draw_positions(k, n, recs_out, dense, sizeof *dense, 0);
      for (uint32_t j = 0; j < k; j++) {
        recs_out[j] = dense[recs_out[j]];
        probs[j] = 1.0 / n;
      }
      return;
    case RS_SEL_FIFO:
    case RS_SEL_LIFO: {
      uint32_t r = s->kind == RS_SEL_FIFO ? th->order_head : th->order_tail;
      for (uint32_t j = 0; j < k; j++) {
        recs_out[j] = r;
        probs[j] = 1.0;
      }
      return;
    }
    default: { /* heaps */
      uint32_t r = rs_heap(base, s)[0];
      for (uint32_t j = 0; j < k; j++) {
        recs_out[j] = r;
        probs[j] = 1.0;
      }
      return;
    }
  }
}
