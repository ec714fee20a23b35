/* Waiting for a table to change outside any operation.
 *
 * The background delivery of a writer's held-back items (reverb_shm/_internal/delivery.py)
 * sleeps here until something that may let the rate limiter admit an insert happens, instead
 * of polling: every operation that publishes a change bumps the table's futex word `seq` and
 * wakes the processes counted in `waiters` (table.c op_publish/op_release, snapshot.c,
 * layout.c's close), so counting ourselves in `waiters` (and `change_waiters`, which op_publish
 * never skips a wake-up for) before sleeping on `seq` is enough.
 */
#include "rs_internal.h"

static int table_ok(void *base, uint32_t table) {
  if (!base) return rs_set_error(RS_EINVAL, "segment base is NULL");
  uint32_t nt = rs_seg(base)->num_tables;
  if (table >= nt)
    return rs_set_error(RS_EINVAL, "table index %u out of range (segment has %u tables)", table, nt);
  return RS_OK;
}

int rs_table_seq(void *base, uint32_t table, uint32_t *seq_out) {
  if (!seq_out) return rs_set_error(RS_EINVAL, "rs_table_seq: NULL seq_out");
  int rc = table_ok(base, table);
  if (rc) return rc;
  *seq_out = __atomic_load_n(&rs_table(base, table)->seq, __ATOMIC_ACQUIRE);
  return RS_OK;
}

int rs_table_wait_change(void *base, uint32_t table, uint32_t seen, int64_t deadline_ns) {
  int rc = table_ok(base, table);
  if (rc) return rc;
  rs_table_hdr *th = rs_table(base, table);
  /* Counted before seq is read again (both are full-barrier atomics): a publisher that bumps
   * seq after that read sees waiters > 0 and wakes us. */
  __atomic_add_fetch(&th->waiters, 1, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&th->change_waiters, 1, __ATOMIC_SEQ_CST);   /* never skipped (op_publish) */
  if (__atomic_load_n(&th->seq, __ATOMIC_SEQ_CST) == seen) {
    if (deadline_ns >= 0 && rs_now_ns() >= deadline_ns) rc = RS_ETIMEDOUT;
    else rc = rs_futex_wait(&th->seq, seen, deadline_ns);
  }
  __atomic_sub_fetch(&th->change_waiters, 1, __ATOMIC_SEQ_CST);
  __atomic_sub_fetch(&th->waiters, 1, __ATOMIC_SEQ_CST);
  if (rc == RS_EAGAIN) rc = RS_OK;   /* interrupted by a signal: the caller reads seq again */
  if (rc == RS_ETIMEDOUT) return rs_set_error(RS_ETIMEDOUT, "table %u did not change before the deadline", table);
  return rc;
}
