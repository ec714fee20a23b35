/* Float64 sum tree with 8 children per node and exact recompute along the path (sumtree.h). */
#include "sumtree.h"

#define F RS_SUMTREE_FANOUT

void rs_sumtree_shape_of(uint32_t leaves, rs_sumtree_shape *s) {
  uint32_t k = 0;
  s->n[0] = leaves;
  s->off[0] = leaves;
  while (s->n[k] > 1) {
    s->n[k + 1] = (s->n[k] + F - 1) / F;
    k++;
  }
  s->top = k;
  /* top down from tree[0]; with leaves >= 64 the levels are line-aligned and still fit in
   * [0, leaves): they take at most leaves / 7 + 8 entries per level */
  uint64_t at = 0;
  for (uint32_t lvl = k; lvl >= 1; lvl--) {
    s->off[lvl] = at;
    at += leaves >= 64 ? (s->n[lvl] + F - 1) / F * F : s->n[lvl];
  }
}

/* Children of entry g of level lvl + 1: how many there are at level lvl. */
static inline uint32_t group_count(const rs_sumtree_shape *s, uint32_t lvl, uint32_t g) {
  uint32_t rest = s->n[lvl] - F * g;
  return rest < F ? rest : F;
}

static inline void recompute(double *tree, const rs_sumtree_shape *s, uint32_t lvl, uint32_t g) {
  tree[s->off[lvl + 1] + g] = rs_sumtree_group(tree + s->off[lvl] + (uint64_t)F * g, group_count(s, lvl, g));
}

/* Every entry of levels `from` .. top (children first). */
static void recompute_levels(double *tree, const rs_sumtree_shape *s, uint32_t from) {
  for (uint32_t lvl = from; lvl <= s->top; lvl++)
    for (uint32_t g = 0; g < s->n[lvl]; g++) recompute(tree, s, lvl - 1, g);
}

void rs_sumtree_set(double *tree, uint32_t leaves, uint32_t i, double w) {
  rs_sumtree_shape s;
  rs_sumtree_shape_of(leaves, &s);
  tree[leaves + i] = w;
  for (uint32_t lvl = 0; lvl < s.top; lvl++) {
    i /= F;
    recompute(tree, &s, lvl, i);
  }
}

/* The child of an entry (children c[0..cnt-1]) whose cumulative range holds *target, and the
 * target within it. The prefix sums P1..P7 of the children are built from the pairwise partial
 * sums of rs_sumtree_group (so P_{j+1} = P_j when child j weighs 0, and P_j <= P_{j+1}); the
 * child is the number of prefixes <= target, which never lands on a zero-weight child, except
 * past the last prefix (rounding of u * total): then the last child of weight > 0. */
static inline uint32_t choose(const double *c, uint32_t cnt, double *target) {
  double x[F] = {0};
  if (__builtin_expect(cnt < F, 0)) {
    for (uint32_t j = 0; j < cnt; j++) x[j] = c[j];
    c = x;
  }
  double t = *target;
  double q0 = c[0] + c[1], q2 = c[4] + c[5];
  double h0 = q0 + (c[2] + c[3]), p6 = h0 + q2;
  double p[F] = {0.0, c[0], q0, q0 + c[2], h0, h0 + c[4], p6, p6 + c[6]};
  uint32_t j = (p[1] <= t) + (p[2] <= t) + (p[3] <= t) + (p[4] <= t) + (p[5] <= t) +
               (p[6] <= t) + (p[7] <= t);
  if (__builtin_expect(j == F - 1 && !(c[F - 1] > 0), 0))
    while (j > 0 && !(c[j] > 0)) j--;
  *target = t - p[j];
  return j;
}

#define FIND_BATCH 64

void rs_sumtree_find_many(const double *tree, uint32_t leaves, uint32_t k, const double *u,
                          uint32_t *out) {
  rs_sumtree_shape s;
  rs_sumtree_shape_of(leaves, &s);
  double total = rs_sumtree_total(tree);
  for (uint32_t b = 0; b < k; b += FIND_BATCH) {
    uint32_t m = k - b < FIND_BATCH ? k - b : FIND_BATCH;
    double target[FIND_BATCH];
    uint32_t idx[FIND_BATCH];   /* entry within the current level */
    for (uint32_t j = 0; j < m; j++) {
      target[j] = u[b + j] * total;
      idx[j] = 0;
    }
    for (uint32_t lvl = s.top; lvl >= 1; lvl--) {
      const double *below = tree + s.off[lvl - 1];
      for (uint32_t j = 0; j < m; j++) {
        uint32_t g = idx[j];
        idx[j] = F * g + choose(below + (uint64_t)F * g, group_count(&s, lvl - 1, g), &target[j]);
        if (lvl >= 2) __builtin_prefetch(tree + s.off[lvl - 2] + (uint64_t)F * idx[j], 0);
      }
    }
    for (uint32_t j = 0; j < m; j++) out[b + j] = idx[j];
  }
}

uint32_t rs_sumtree_find(const double *tree, uint32_t leaves, double u) {
  uint32_t leaf;
  rs_sumtree_find_many(tree, leaves, 1, &u, &leaf);
  return leaf;
}

void rs_sumtree_set_many(double *tree, uint32_t leaves, uint32_t k, const uint32_t *idx,
                         const double *w, uint32_t *scratch) {
  if (k == 0) return;
  rs_sumtree_shape s;
  rs_sumtree_shape_of(leaves, &s);
  /* Leaves in order (a repeated leaf ends with its last weight, as k single sets would) */
  for (uint32_t j = 0; j < k; j++) __builtin_prefetch(&tree[leaves + idx[j]], 1);
  for (uint32_t j = 0; j < k; j++) {
    tree[leaves + idx[j]] = w[j];
    scratch[j] = idx[j];
    __builtin_prefetch(&tree[s.off[1] + idx[j] / F], 1);
  }
  /* ... then the ancestors one level at a time, bottom up: every entry of a level is recomputed
   * after all of its children are final, so the result is the one the single sets leave, and the
   * k paths' cache misses of one level are all in flight together. An entry shared by several
   * paths is recomputed more than once (same value). Once a level has no more entries than k,
   * recomputing all of it and every level above is cheaper than following the paths. */
  for (uint32_t lvl = 0; lvl < s.top; lvl++) {
    if (s.n[lvl + 1] <= k) {
      recompute_levels(tree, &s, lvl + 1);
      return;
    }
    for (uint32_t j = 0; j < k; j++) {
      uint32_t g = scratch[j] / F;
      recompute(tree, &s, lvl, g);
      scratch[j] = g;
      if (lvl + 2 <= s.top) __builtin_prefetch(&tree[s.off[lvl + 2] + g / F], 1);
    }
  }
}

void rs_sumtree_rebuild(double *tree, uint32_t leaves) {
  rs_sumtree_shape s;
  rs_sumtree_shape_of(leaves, &s);
  recompute_levels(tree, &s, 1);
}

uint64_t rs_sumtree_check(const double *tree, uint32_t leaves, uint32_t *level, uint32_t *index) {
  rs_sumtree_shape s;
  rs_sumtree_shape_of(leaves, &s);
  uint64_t bad = 0;
  for (uint32_t lvl = 1; lvl <= s.top; lvl++)
    for (uint32_t g = 0; g < s.n[lvl]; g++) {
      double want = rs_sumtree_group(tree + s.off[lvl - 1] + (uint64_t)F * g, group_count(&s, lvl - 1, g));
      if (tree[s.off[lvl] + g] != want && bad++ == 0) {
        *level = lvl;
        *index = g;
      }
    }
  return bad;
}
