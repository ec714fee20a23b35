/* Array sum tree over float64 weights (Schaul et al. 2016, prioritized experience replay).
 * tree[1] is the root, leaf i is tree[leaves + i], tree[0] is unused; `leaves` is a power of
 * two. Every internal node is recomputed as the sum of its two children whenever a leaf below
 * it changes, so nodes are exact sums of their children and never drift. */
#ifndef RS_SUMTREE_H
#define RS_SUMTREE_H

#include <stdint.h>

void rs_sumtree_set(double *tree, uint32_t leaves, uint32_t i, double w);
static inline double rs_sumtree_total(const double *tree) { return tree[1]; }
static inline double rs_sumtree_leaf(const double *tree, uint32_t leaves, uint32_t i) {
  return tree[leaves + i];
}
/* Leaf whose cumulative range holds u * total (u in [0, 1)); requires total > 0. The descent
 * never enters a zero-weight subtree, so the leaf returned always has weight > 0. */
uint32_t rs_sumtree_find(const double *tree, uint32_t leaves, double u);
/* The same for k values of u at once, descending level by level so that the memory accesses of
 * the k descents overlap. */
void rs_sumtree_find_many(const double *tree, uint32_t leaves, uint32_t k, const double *u,
                          uint32_t *out);
/* Set leaf idx[j] to w[j] for j = 0..k-1 in order (a repeated leaf ends with its last weight)
 * and recompute their ancestors level by level; the tree ends exactly as after k calls of
 * rs_sumtree_set. scratch holds k entries. */
void rs_sumtree_set_many(double *tree, uint32_t leaves, uint32_t k, const uint32_t *idx,
                         const double *w, uint32_t *scratch);
/* Recompute every internal node from the leaves (O(leaves)). */
void rs_sumtree_rebuild(double *tree, uint32_t leaves);

#endif
