/* Reverb's rate limiter, evaluated in doubles exactly as Reverb does. */
#ifndef RS_LIMITER_H
#define RS_LIMITER_H

#include "rs_internal.h"

/* False if inserts - deletes < min_size_to_sample, else inserts*spi - samples - n >= min_diff. */
int rs_limiter_can_sample(const rs_table_hdr *th, int64_t n);
/* True if inserts + n - deletes <= min_size_to_sample, else (inserts+n)*spi - samples <= max_diff. */
int rs_limiter_can_insert(const rs_table_hdr *th, int64_t n);
/* Largest k <= limit such that k samples may be taken one after another now (0..limit). */
uint32_t rs_limiter_sample_budget(const rs_table_hdr *th, uint32_t limit);
/* RS_OK if the parameters are usable (spi > 0 and finite, min_size >= 1, diffs not NaN). */
int rs_limiter_validate(double spi, int64_t min_size, double min_diff, double max_diff);

#endif
