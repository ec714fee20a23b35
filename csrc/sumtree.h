/* Float64 sum tree over `leaves` weights (Schaul et al. 2016, prioritized experience replay),
 * 8 children per node so that a descent or an update reads one cache line per level.
 *
 * Layout, inside the 2 * leaves doubles of a tree region (`leaves` a power of two >= 2):
 *   - leaf i (the weight of record i) is tree[leaves + i];
 *   - level 0 is the leaves; level k + 1 holds ceil(n_k / 8) sums, its entry j being the sum of
 *     entries 8j .. 8j+7 of level k (as many as exist), in the fixed order of rs_sumtree_group;
 *   - the internal levels sit in tree[0, leaves), the root (the single entry of the top level)
 *     at tree[0], then the levels below it; with leaves >= 64 each level starts on a 64-byte
 *     line so that every group of 8 children is one line.
 * Every internal entry is recomputed from its children whenever a leaf below it changes, so
 * entries are exact sums of their children (in that order) and never drift. */
#ifndef RS_SUMTREE_H
#define RS_SUMTREE_H

#include <stdint.h>

#define RS_SUMTREE_FANOUT 8
#define RS_SUMTREE_MAX_LEVELS 16   /* levels incl. the leaves: 8**15 > 2**32 */

/* Where each level is: level 0 the leaves, level `top` the root. */
typedef struct rs_sumtree_shape {
  uint32_t top;
  uint32_t n[RS_SUMTREE_MAX_LEVELS];     /* entries of each level */
  uint64_t off[RS_SUMTREE_MAX_LEVELS];   /* index of each level's first entry in tree[] */
} rs_sumtree_shape;

void rs_sumtree_shape_of(uint32_t leaves, rs_sumtree_shape *s);

/* Sum of the cnt (1..8) children at c, in the order every internal entry is computed in:
 * pairwise, ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)), missing children counting as 0
 * (adding 0 changes no sum), so that a descent can reuse the partial sums as the weights of
 * the halves and quarters of the group. */
static inline double rs_sumtree_group(const double *c, uint32_t cnt) {
  double x[RS_SUMTREE_FANOUT] = {0};
  for (uint32_t j = 0; j < cnt; j++) x[j] = c[j];
  return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

void rs_sumtree_set(double *tree, uint32_t leaves, uint32_t i, double w);
static inline double rs_sumtree_total(const double *tree) { return tree[0]; }
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
/* Recompute every internal entry from the leaves (O(leaves)). */
void rs_sumtree_rebuild(double *tree, uint32_t leaves);
/* Internal entries that differ from the sum of their children; the first one's level (>= 1)
 * and index within its level in *level / *index. 0 when the tree is consistent. */
uint64_t rs_sumtree_check(const double *tree, uint32_t leaves, uint32_t *level, uint32_t *index);

#endif
