/* Robust process-shared mutexes and futex waits on shared words.
 *
 * The futex is used without FUTEX_PRIVATE_FLAG (the word lives in memory shared between
 * processes) and with FUTEX_WAIT_BITSET without FUTEX_CLOCK_REALTIME, so the timeout is an
 * absolute CLOCK_MONOTONIC deadline, matching rs_now_ns(). */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>

#include "rs_internal.h"

/* What rs_tlock / rs_alock run after a lock owner died. lock.c sits below table.c and arena.c,
 * so it reaches their repairs only through this one registration (rs_lock_register_repairs,
 * made by layout.c when the core library is loaded). Process-local; inherited across fork. */
static rs_table_repair_fn table_repair_hook = NULL;
static rs_arena_repair_fn arena_repair_hook = NULL;

void rs_lock_register_repairs(rs_table_repair_fn table_repair, rs_arena_repair_fn arena_repair) {
  table_repair_hook = table_repair;
  arena_repair_hook = arena_repair;
}

int rs_mutex_init(pthread_mutex_t *m) {
  pthread_mutexattr_t a;
  int rc = pthread_mutexattr_init(&a);
  if (rc) return rs_set_error(RS_ESYS, "pthread_mutexattr_init: %s", strerror(rc));
  rc = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
  if (!rc) rc = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
  if (!rc) rc = pthread_mutex_init(m, &a);
  pthread_mutexattr_destroy(&a);
  if (rc) return rs_set_error(RS_ESYS, "cannot create a robust process-shared mutex: %s", strerror(rc));
  return RS_OK;
}

int rs_mutex_lock(pthread_mutex_t *m, int *recovered) {
  *recovered = 0;
  int rc = pthread_mutex_lock(m);
  if (rc == 0) return RS_OK;
  if (rc == EOWNERDEAD) {
    *recovered = 1;
    return RS_OK;
  }
  if (rc == ENOTRECOVERABLE)
    return rs_set_error(RS_ECORRUPT,
                        "mutex is not recoverable (a previous owner died and it was not repaired)");
  return rs_set_error(RS_ESYS, "pthread_mutex_lock: %s", strerror(rc));
}

void rs_mutex_consistent(pthread_mutex_t *m) { pthread_mutex_consistent(m); }

void rs_mutex_unlock(pthread_mutex_t *m) { pthread_mutex_unlock(m); }

int rs_futex_wait(uint32_t *word, uint32_t expected, int64_t deadline_ns) {
  return rs_futex_wait_bits(word, expected, deadline_ns, FUTEX_BITSET_MATCH_ANY);
}

int rs_futex_wait_bits(uint32_t *word, uint32_t expected, int64_t deadline_ns, uint32_t bits) {
  struct timespec ts, *tsp = NULL;
  if (deadline_ns >= 0) {
    ts.tv_sec = (time_t)(deadline_ns / 1000000000LL);
    ts.tv_nsec = (long)(deadline_ns % 1000000000LL);
    tsp = &ts;
  }
  long rc = syscall(SYS_futex, word, FUTEX_WAIT_BITSET, expected, tsp, NULL, bits);
  if (rc == 0) return RS_OK;
  switch (errno) {
    case EAGAIN: return RS_OK; /* the word had already changed */
    case ETIMEDOUT: return RS_ETIMEDOUT;
    case EINTR: return RS_EAGAIN;
    default: return rs_set_error(RS_ESYS, "futex wait: %s", strerror(errno));
  }
}

void rs_futex_wake_all(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

void rs_futex_wake_bits(uint32_t *word, uint32_t bits) {
  syscall(SYS_futex, word, FUTEX_WAKE_BITSET, INT_MAX, NULL, NULL, bits);
}

int rs_tlock(void *base, uint32_t t) {
  rs_table_hdr *th = rs_table(base, t);
  int recovered;
  int rc = rs_mutex_lock(&th->lock, &recovered);
  if (rc) return rc;
  if (recovered) {
    if (!table_repair_hook) {   /* never: layout.c registers at load; leave the lock marked */
      rs_mutex_unlock(&th->lock);
      return rs_set_error(RS_ECORRUPT, "table %u needs repair but no repair is registered", t);
    }
    table_repair_hook(base, t);
    th->repairs++;
    rs_mutex_consistent(&th->lock);
  }
  return RS_OK;
}

void rs_tunlock(void *base, uint32_t t) { rs_mutex_unlock(&rs_table(base, t)->lock); }

int rs_alock(void *base) {
  rs_seg_hdr *h = rs_seg(base);
  int recovered;
  int rc = rs_mutex_lock(&h->arena_lock, &recovered);
  if (rc) return rc;
  if (recovered) {
    if (!arena_repair_hook) {   /* never: layout.c registers at load; leave the lock marked */
      rs_mutex_unlock(&h->arena_lock);
      return rs_set_error(RS_ECORRUPT, "the arena needs repair but no repair is registered");
    }
    arena_repair_hook(base);
    h->refcounts_suspect = 1;
    rs_mutex_consistent(&h->arena_lock);
  }
  return RS_OK;
}

void rs_aunlock(void *base) { rs_mutex_unlock(&rs_seg(base)->arena_lock); }
