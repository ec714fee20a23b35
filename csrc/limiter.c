/* Rate limiter predicates (Reverb's: see limiter.h). */
#include <math.h>

#include "limiter.h"

int rs_limiter_can_sample(const rs_table_hdr *th, int64_t n) {
  if (th->inserts - th->deletes < th->min_size_to_sample) return 0;
  double diff = (double)th->inserts * th->samples_per_insert - (double)th->samples - (double)n;
  return diff >= th->min_diff;
}

int rs_limiter_can_insert(const rs_table_hdr *th, int64_t n) {
  if (th->inserts + n - th->deletes <= th->min_size_to_sample) return 1;
  double diff = (double)(th->inserts + n) * th->samples_per_insert - (double)th->samples;
  return diff <= th->max_diff;
}

uint32_t rs_limiter_sample_budget(const rs_table_hdr *th, uint32_t limit) {
  /* Sample j (1-based) of a run needs can_sample(1) after j-1 samples, i.e. can_sample(j) now;
   * the predicate is monotone in j, so count up to the first failure. */
  if (th->inserts - th->deletes < th->min_size_to_sample) return 0;
  uint32_t k = 0;
  while (k < limit && rs_limiter_can_sample(th, (int64_t)k + 1)) k++;
  return k;
}

int rs_limiter_validate(double spi, int64_t min_size, double min_diff, double max_diff) {
  if (!(spi > 0) || !isfinite(spi))
    return rs_set_error(RS_EINVAL, "samples_per_insert must be a finite number > 0, got %g", spi);
  if (min_size < 1)
    return rs_set_error(RS_EINVAL, "min_size_to_sample must be >= 1, got %lld", (long long)min_size);
  if (isnan(min_diff) || isnan(max_diff))
    return rs_set_error(RS_EINVAL, "min_diff and max_diff must not be NaN (got %g, %g)", min_diff,
                        max_diff);
  return RS_OK;
}
