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
    for (uint32_t level = leaves; level > 1; level >>= 1)
      for (uint32_t j = 0; j < m; j++) {
        node[j] = step(tree, node[j], &target[j]);
        __builtin_prefetch(&tree[2 * node[j]], 0);   /* the children read at the next level */
      }
    for (uint32_t j = 0; j < m; j++) out[b + j] = node[j] - leaves;
  }
}

void rs_sumtree_rebuild(double *tree, uint32_t leaves) {
  for (uint32_t node = leaves - 1; node >= 1; node--) tree[node] = tree[2 * node] + tree[2 * node + 1];
}

void rs_sumtree_set_many(double *tree, uint32_t leaves, uint32_t k, const uint32_t *idx,
                         const double *w, uint32_t *scratch) {
  if (k == 0) return;
  /* Leaves in order (a repeated leaf ends with its last weight, as k single sets would) */
  for (uint32_t j = 0; j < k; j++) __builtin_prefetch(&tree[leaves + idx[j]], 1);
  for (uint32_t j = 0; j < k; j++) {
    tree[leaves + idx[j]] = w[j];
    scratch[j] = (leaves + idx[j]) >> 1;
    __builtin_prefetch(&tree[scratch[j]], 1);
  }
  /* ... then the ancestors one level at a time, bottom up: every node of a level is recomputed
   * after all of its children are final, so the result is the one the single sets leave, and the
   * k paths' cache misses of one level are all in flight together. A node shared by several
   * paths is recomputed more than once (same value). Once a level has no more nodes than k,
   * recomputing every node from there to the root is cheaper than following the paths. */
  uint32_t width = leaves >> 1;   /* nodes of the level scratch[] is in: [width, 2 * width) */
  for (; width > k; width >>= 1)
    for (uint32_t j = 0; j < k; j++) {
      uint32_t node = scratch[j];
      tree[node] = tree[2 * node] + tree[2 * node + 1];
      scratch[j] = node >> 1;
      __builtin_prefetch(&tree[node >> 1], 1);
    }
  for (uint32_t node = 2 * width - 1; node >= 1; node--) tree[node] = tree[2 * node] + tree[2 * node + 1];
}
