/* Robust process-shared mutexes and futex waits on shared words.
 *
 * The futex is used without FUTEX_PRIVATE_FLAG (the word lives in memory shared between
 * processes) and with FUTEX_WAIT_BITSET without FUTEX_CLOCK_REALTIME, so the timeout is an
 * absolute CLOCK_MONOTONIC deadline, matching rs_now_ns(). */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdlib.h>
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

/* RS_OK (taken; *recovered = 1 when a holder died), or an error, from what pthread_mutex_lock
 * or pthread_mutex_trylock (not EBUSY) returned. */
static int mutex_taken(int rc, int *recovered) {
  *recovered = 0;
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

int rs_mutex_lock(pthread_mutex_t *m, int *recovered) { return mutex_taken(pthread_mutex_lock(m), recovered); }

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

/* Whether blocked calls sleep as SCHED_BATCH (rs_futex_wait_bits_batch): 1 unless the
 * environment says REVERB_SHM_BATCH_WAITS=0 (read once per process). */
static int batch_waits(void) {
  static int on = -1;
  if (on < 0) {
    const char *env = getenv("REVERB_SHM_BATCH_WAITS");
    on = !(env && env[0] == '0' && env[1] == 0);
  }
  return on;
}

int rs_futex_wait_bits_batch(uint32_t *word, uint32_t expected, int64_t deadline_ns, uint32_t bits) {
  struct sched_param none = {0};
  /* (sched_* with pid 0 act on the calling thread; only the default policy is switched, and
   * back: a thread the application made SCHED_BATCH, SCHED_IDLE or real-time keeps its own) */
  int switched = batch_waits() && sched_getscheduler(0) == SCHED_OTHER &&
                 sched_setscheduler(0, SCHED_BATCH, &none) == 0;
  int rc = rs_futex_wait_bits(word, expected, deadline_ns, bits);
  if (switched) sched_setscheduler(0, SCHED_OTHER, &none);
  return rc;
}

void rs_futex_wake_all(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

void rs_futex_wake_bits(uint32_t *word, uint32_t bits, int n) {
  syscall(SYS_futex, word, FUTEX_WAKE_BITSET, n, NULL, NULL, bits);
}

/* A held table lock is waited for by spinning while its hold is young, then by sleeping in
 * the kernel (pthread_mutex_lock). Holds of inserts and samples of tens of items last ~5-20 us,
 * while a sleeper wakes ~50-100 us after the unlock on a virtual machine (the woken thread's
 * vCPU must be woken first): sleeping on every contended acquisition left the sampler of a
 * writers + sampler pipeline asleep most of its time. A hold older than TLOCK_YOUNG_NS is
 * probably a holder preempted or a long operation: waiters then sleep at once.
 *
 * The arena lock is waited for the same way, for at most ALOCK_SPIN_NS (it has no hold clock:
 * its holds are refcount changes, pin-log writes and allocations of a few microseconds). It is
 * often taken while a table lock is held (an insert's evictions and shared descriptor blocks,
 * a sample's pins), by processes that meet on it at every call (a sampler's unpinning after
 * its gather overlaps a writer's insert): a writer that slept on it, 12-20% of its inserts in a
 * 2-writer + 1-sampler pipeline, kept its table lock ~14 us longer each time, and the pipeline
 * ran 1.09x the one-process rate instead of 1.28x (medians of 8 runs each). */
#define TLOCK_SPIN_NS 40000    /* spin at most this long per acquisition */
#define TLOCK_YOUNG_NS 40000   /* spin only while the current hold is younger than this */
#define ALOCK_SPIN_NS 30000    /* the arena lock: spin at most this long per acquisition */

static int mutex_held(pthread_mutex_t *m) {
#ifdef __GLIBC__
  return __atomic_load_n(&m->__data.__lock, __ATOMIC_RELAXED) != 0;   /* owner's tid, or 0 */
#else
  (void)m;
  return 1;   /* (no peek: every check is a trylock) */
#endif
}

/* pthread_mutex_trylock of m, retried while spinning is worth it: for at most spin_ns and, with
 * locked_at (the holder's rs_now_ns when it took m), while the hold is younger than
 * TLOCK_YOUNG_NS. 0 (taken), EOWNERDEAD (taken, a holder died), EBUSY (still held: sleep), or
 * another error. */
static int spin_trylock(pthread_mutex_t *m, int64_t spin_ns, const int64_t *locked_at) {
  int rc = pthread_mutex_trylock(m);
  if (rc != EBUSY) return rc;
  int64_t t0 = rs_now_ns(), now = t0;
  while (now - t0 < spin_ns &&
         (!locked_at || now - __atomic_load_n(locked_at, __ATOMIC_RELAXED) < TLOCK_YOUNG_NS)) {
    for (int i = 0; i < 16; i++) rs_cpu_relax();
    now = rs_now_ns();
    if (mutex_held(m)) continue;
    rc = pthread_mutex_trylock(m);
    if (rc != EBUSY) return rc;
  }
  return EBUSY;
}

int rs_tlock(void *base, uint32_t t) {
  rs_table_hdr *th = rs_table(base, t);
  int recovered, rc = spin_trylock(&th->lock, TLOCK_SPIN_NS, &th->locked_at_ns);
  rc = rc == EBUSY ? rs_mutex_lock(&th->lock, &recovered) : mutex_taken(rc, &recovered);
  if (rc) return rc;
  __atomic_store_n(&th->locked_at_ns, rs_now_ns(), __ATOMIC_RELAXED);
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
  int recovered, rc = spin_trylock(&h->arena_lock, ALOCK_SPIN_NS, NULL);
  rc = rc == EBUSY ? rs_mutex_lock(&h->arena_lock, &recovered) : mutex_taken(rc, &recovered);
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
