/* rs_check: stop the world (every table lock in index order, then the arena lock) and verify
 * every table's invariants (rs_table_check) and the allocator's (rs_arena_check). */
#include <stdio.h>
#include <string.h>

#include "rs_internal.h"

int rs_check(void *base, char *report, uint64_t report_len) {
  if (report && report_len) report[0] = 0;
  rs_seg_hdr *h = rs_seg(base);
  /* The header and table layouts first (a segment damaged after it was attached): every later
   * check follows their offsets. */
  int vrc = rs_segment_validate(base, h->total_size);
  if (vrc) {
    if (report && report_len) snprintf(report, report_len, "%s\n", rs_last_error());
    return vrc;
  }
  uint32_t locked = 0;
  int rc = RS_OK;
  for (; locked < h->num_tables; locked++)
    if ((rc = rs_tlock(base, locked))) break;
  int bad = 0;
  if (rc == RS_OK && (rc = rs_alock(base)) == RS_OK) {
    for (uint32_t t = 0; t < h->num_tables; t++) bad |= rs_table_check(base, t, report, report_len) != RS_OK;
    bad |= rs_arena_check(base, report, report_len) != RS_OK;
    rs_aunlock(base);
  }
  while (locked-- > 0) rs_tunlock(base, locked);
  if (rc) return rc;
  if (bad)
    return rs_set_error(RS_ECORRUPT, "invariant check failed: %s",
                        report && report_len && report[0] ? report : "(no report buffer)");
  return RS_OK;
}
