/* Cross-round cache of checked item layouts: this thread's cache, its memory, and forgetting
 * (see layout_cache.h). */
#define _GNU_SOURCE
#include "layout_cache.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define LC_BYTES ((size_t)sizeof(rs_lc_entry) << RS_LC_BITS)
#define LC_ALIGN ((size_t)2 << 20)   /* one 2 MiB page where transparent huge pages are on */

static uint64_t lc_mappings;   /* bumped by rs_lcache_forget */
static __thread rs_lcache lcache;
static pthread_key_t lc_key;
static pthread_once_t lc_once = PTHREAD_ONCE_INIT;
static int lc_key_ok;

static void lc_free(void *p) {   /* (at thread exit) */
  if (lcache.e == p) lcache.e = NULL;
  free(p);
}

static void lc_key_init(void) { lc_key_ok = pthread_key_create(&lc_key, lc_free) == 0; }

/* The entries (zeroed: never valid), freed when the thread exits. */
static rs_lc_entry *lc_alloc(void) {
  pthread_once(&lc_once, lc_key_init);
  if (!lc_key_ok) return NULL;
  void *p = aligned_alloc(LC_ALIGN, LC_BYTES);
  if (!p) return NULL;
#ifdef MADV_HUGEPAGE
  (void)madvise(p, LC_BYTES, MADV_HUGEPAGE);   /* (a hint: one TLB entry for the whole cache) */
#endif
  memset(p, 0, LC_BYTES);
  if (pthread_setspecific(lc_key, p) != 0) {
    free(p);
    return NULL;
  }
  return p;
}

void rs_lcache_forget(void) { __atomic_add_fetch(&lc_mappings, 1, __ATOMIC_RELEASE); }

static int same_layout(const rs_gather_col *a, const rs_gather_col *b) {
  if (a->col_bytes != b->col_bytes || a->ndim != b->ndim || memcmp(a->dtype, b->dtype, sizeof a->dtype))
    return 0;
  for (uint32_t k = 0; k < a->ndim && k < 9; k++)
    if (a->shape[k] != b->shape[k]) return 0;
  return 1;
}

rs_lcache *rs_lcache_for(void *base, uint32_t ncols, const rs_gather_col *cols) {
  rs_lcache *lc = &lcache;
  if (ncols == 0 || ncols > RS_LC_COLS) return NULL;
  if (!lc->e && !(lc->e = lc_alloc())) return NULL;
  uint64_t mapping = __atomic_load_n(&lc_mappings, __ATOMIC_ACQUIRE);
  uint64_t generation = rs_seg(base)->generation;
  int same = lc->version && lc->base == base && lc->generation == generation &&
             lc->mapping == mapping && lc->ncols == ncols;
  for (uint32_t c = 0; same && c < ncols; c++) same = same_layout(&lc->layout[c], &cols[c]);
  if (same) return lc;
  if (++lc->version == 0) {   /* (versions wrapped: empty every entry) */
    memset(lc->e, 0, LC_BYTES);
    lc->version = 1;
  }
  lc->base = base;
  lc->generation = generation;
  lc->mapping = mapping;
  lc->ncols = ncols;
  for (uint32_t c = 0; c < ncols; c++) {
    lc->layout[c] = cols[c];
    lc->layout[c].out = NULL;
    lc->layout[c].stride = 0;
  }
  return lc;
}
