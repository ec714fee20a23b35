/* Float64 sum tree with exact recompute along the path (see sumtree.h). */
#include "sumtree.h"

void rs_sumtree_set(double *tree, uint32_t leaves, uint32_t i, double w) {
  uint32_t node = leaves + i;
  tree[node] = w;
  for (node >>= 1; node >= 1; node >>= 1) tree[node] = tree[2 * node] + tree[2 * node + 1];
}

/* One step down from `node` holding `*target`: left when the target falls in the left sum or
 * the right subtree is empty; never into a subtree of weight 0. */
static inline uint32_t step(const double *tree, uint32_t node, double *target) {
  uint32_t l = 2 * node;
  double lw = tree[l], rw = tree[l + 1];
  /* branch-free: random targets make the direction unpredictable, and a mispredicted branch
   * would discard the other descents' loads in flight (weights are finite, so lw * 0 == 0) */
  uint32_t right = !(((*target < lw) & (lw > 0)) | (rw <= 0));
  *target -= lw * (double)right;
  return l + right;
}

uint32_t rs_sumtree_find(const double *tree, uint32_t leaves, double u) {
  double target = u * tree[1];
  uint32_t node = 1;
  while (node < leaves) node = step(tree, node, &target);
  return node - leaves;
}

#define FIND_BATCH 64

void rs_sumtree_find_many(const double *tree, uint32_t leaves, uint32_t k, const double *u,
                          uint32_t *out) {
  double total = tree[1];
  for (uint32_t b = 0; b < k; b += FIND_BATCH) {
    uint32_t m = k - b < FIND_BATCH ? k - b : FIND_BATCH;
    double target[FIND_BATCH];
    uint32_t node[FIND_BATCH];
    for (uint32_t j = 0; j < m; j++) {
      target[j] = u[b + j] * total;
      node[j] = 1;
    }
    /* leaves need not be a power of two: leaf nodes [leaves, 2 * leaves) lie on two levels */
    for (uint32_t level = leaves; level > 1; level >>= 1)
      for (uint32_t j = 0; j < m; j++) {
        node[j] = step(tree, node[j], &target[j]);
        __builtin_prefetch(&tree[2 * node[j]], 0);   /* the children read at the next level */
      }
    for (uint32_t j = 0; j < m; j++)
      if (node[j] < leaves) node[j] = step(tree, node[j], &target[j]);
    for (uint32_t j = 0; j < m; j++) out[b + j] = node[j] - leaves;
  }
}

void rs_sumtree_rebuild(double *tree, uint32_t leaves) {
  for (uint32_t node = leaves - 1; node >= 1; node--) tree[node] = tree[2 * node] + tree[2 * node + 1];
}
