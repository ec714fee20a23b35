/* The gather helper: one thread per process that shares large gathers with the thread that
 * asked for them (rs_run_units).
 *
 * A single core copies random rows out of a 4 KiB-paged /dev/shm mapping at well under the
 * memory system's bandwidth (each page starts with a TLB miss and a cold prefetcher); a second
 * core nearly doubles it. Measured on W5's 84x84x4 frames, batches of 64 (2-core VM, load ~1,
 * C loop): one thread 7.5 GB/s, two 11.6-13.5 GB/s; sample_batch(64) A/B (load ~3): 1.39x.
 *
 * Work is shared by claiming grains (a few consecutive units: a gather's items) from one atomic
 * word, so the calling thread never waits for the helper to start: a helper that is asleep,
 * descheduled or busy with another thread's gather simply takes fewer grains (none at worst),
 * and the caller waits only for grains the helper has claimed and is copying. The word holds the
 * job's generation, its grain count and the next grain: a claim succeeds only for the
 * generation the claimer saw, so a helper that is late never runs a grain of the next job with
 * the previous job's function.
 *
 * REVERB_SHM_GATHER_THREADS=1 (read on first use) or rs_set_gather_threads(1) turns the helper
 * off (rs_set_gather_threads joins it); the default is 2 threads when the process may run on
 * at least 2 CPUs. A forked child starts without a helper and starts its own on first use. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "rs_internal.h"

#define HELPER_SPIN_NS 20000   /* a woken helper waits this long for its job before sleeping */

static struct {
  pthread_mutex_t mu;         /* serializes starting and stopping the helper */
  uint32_t threads;           /* setting: 1 or 2; 0 = not read from the environment yet */
  int running;                /* the helper thread exists (in this process) */
  pthread_t thread;
  uint32_t busy;              /* a job is using the helper (the caller's CAS 0 -> 1) */
  uint32_t gen;               /* futex word: bumped for every job, and to stop */
  uint32_t sleeping;          /* the helper is in (or entering) its futex wait */
  uint32_t stop;
  uint64_t claim;             /* gen << 32 | grains << 16 | next grain */
  rs_units_fn fn;             /* the current job (valid while its grains are unclaimed) */
  void *ctx;
  uint32_t n, grain;          /* units [0, n), claimed `grain` units at a time */
  uint32_t linger_ns;         /* how long the helper waits for the next job after this one */
  uint32_t done;              /* grains of the current job finished */
} pool = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, 0, NULL, NULL, 0, 0, 0, 0};

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void futex_wait_private(uint32_t *word, uint32_t expected) {
  syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_private(uint32_t *word) {
  syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

/* Claims and runs grains of job generation `gen` until none is left; returns the units run. */
static uint32_t take_units(uint32_t gen) {
  uint32_t ran = 0;
  for (;;) {
    uint64_t w = __atomic_load_n(&pool.claim, __ATOMIC_SEQ_CST);
    uint32_t next = (uint32_t)(w & 0xFFFF), grains = (uint32_t)((w >> 16) & 0xFFFF);
    if ((uint32_t)(w >> 32) != gen || next >= grains) return ran;
    /* The job's fields are this job's: they change only after every grain of the job is
     * claimed, and the claim below fails if any grain was claimed since w was read. */
    rs_units_fn fn = __atomic_load_n(&pool.fn, __ATOMIC_SEQ_CST);
    void *ctx = __atomic_load_n(&pool.ctx, __ATOMIC_SEQ_CST);
    uint32_t n = __atomic_load_n(&pool.n, __ATOMIC_SEQ_CST), grain = __atomic_load_n(&pool.grain, __ATOMIC_SEQ_CST);
    if (!__atomic_compare_exchange_n(&pool.claim, &w, w + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
      continue;
    uint32_t begin = next * grain, end = n - begin < grain ? n : begin + grain;
    fn(ctx, begin, end);
    ran += end - begin;
    __atomic_fetch_add(&pool.done, 1, __ATOMIC_SEQ_CST);
  }
}

/* The helper sleeps as soon as a job is done (no CPU spent between gathers). Woken, by a job or
 * by rs_gather_prewake, it spins up to HELPER_SPIN_NS for the job before sleeping again: a
 * gatherer wakes it before it samples, so that the wake-up (an inter-processor interrupt to an
 * idle CPU: ~15% of a W5 gather's time on a 2-core VM when paid at the copy) overlaps the
 * sampling. Measured on W5 (load ~3): +10.6% over waking it at the copy; spinning 50-100 us
 * after every job instead was 10-12% slower than not spinning on a loaded machine.
 * A job may also ask the helper to wait for the next one (linger_ns: the rounds shared only
 * because they copy slowly, which follow each other too closely for a wake-up, ~60-90 us on a
 * VM): it then polls with sched_yield, so that any other runnable thread on its CPU (the
 * learner's) runs first. Measured on L2 at 1e7 steps (2-core VM, loaded by other processes):
 * 0.55-0.61 us per window lingering this way, 0.60-1.49 spinning with pause instead, and
 * 0.65-0.96 without lingering (the helper was asleep at nearly every job). */
static void *helper_main(void *arg) {
  uint32_t seen = (uint32_t)(uintptr_t)arg;
  int64_t spin_end = 0;
  int lingering = 0;   /* waiting after a job (yielding the CPU), not after a wake-up */
  for (;;) {
    uint32_t g;
    for (uint32_t spins = 0; (g = __atomic_load_n(&pool.gen, __ATOMIC_SEQ_CST)) == seen; spins++) {
      if (lingering && rs_now_ns() < spin_end) {
        sched_yield();
        continue;
      }
      if (!lingering && (spins % 64 || rs_now_ns() < spin_end)) {
        rs_cpu_relax();
        continue;
      }
      lingering = 0;
      __atomic_store_n(&pool.sleeping, 1, __ATOMIC_SEQ_CST);
      if (__atomic_load_n(&pool.gen, __ATOMIC_SEQ_CST) == seen) futex_wait_private(&pool.gen, seen);
      __atomic_store_n(&pool.sleeping, 0, __ATOMIC_SEQ_CST);
      spin_end = rs_now_ns() + HELPER_SPIN_NS;
    }
    seen = g;
    if (__atomic_load_n(&pool.stop, __ATOMIC_SEQ_CST)) return NULL;
    uint32_t linger = __atomic_load_n(&pool.linger_ns, __ATOMIC_SEQ_CST);
    take_units(seen);
    spin_end = linger ? rs_now_ns() + linger : 0;
    lingering = linger != 0;
  }
}

/* In a forked child the helper thread does not exist: forget it (and any job of the parent's
 * other threads that was in flight at the fork). */
static void atfork_child(void) {
  pthread_mutex_init(&pool.mu, NULL);
  pool.running = 0;
  pool.busy = pool.sleeping = pool.stop = pool.done = 0;
  pool.claim = (uint64_t)pool.gen << 32;
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, atfork_child); }

static uint32_t default_threads(void) {
  const char *env = getenv("REVERB_SHM_GATHER_THREADS");
  if (env && (env[0] == '1' || env[0] == '2') && env[1] == 0) return (uint32_t)(env[0] - '0');
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) < 2) return 1;
  return 2;
}

/* Starts the helper (pool.mu held). 0: running. */
static int start_helper(void) {
  if (pool.running) return 0;
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);   /* signals go to the application's threads */
  __atomic_store_n(&pool.stop, 0, __ATOMIC_SEQ_CST);
  uint32_t gen = __atomic_load_n(&pool.gen, __ATOMIC_SEQ_CST);
  int rc = pthread_create(&pool.thread, NULL, helper_main, (void *)(uintptr_t)gen);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc) return rc;
  pthread_setname_np(pool.thread, "rs-gather");
  __atomic_store_n(&pool.running, 1, __ATOMIC_RELEASE);
  return 0;
}

/* Stops and joins the helper (pool.mu held, pool.busy taken by the caller). */
static void stop_helper(void) {
  if (!pool.running) return;
  __atomic_store_n(&pool.stop, 1, __ATOMIC_SEQ_CST);
  __atomic_fetch_add(&pool.gen, 1, __ATOMIC_SEQ_CST);
  futex_wake_private(&pool.gen);
  pthread_join(pool.thread, NULL);
  __atomic_store_n(&pool.running, 0, __ATOMIC_RELEASE);
}

/* The helper, started if need be: 1 when a job may use it (pool.busy is then held). */
static int acquire_helper(void) {
  uint32_t threads = __atomic_load_n(&pool.threads, __ATOMIC_ACQUIRE);
  if (threads == 1) return 0;
  pthread_once(&atfork_once, register_atfork);
  uint32_t zero = 0;
  if (!__atomic_compare_exchange_n(&pool.busy, &zero, 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
    return 0;   /* another thread's gather has it */
  if (__atomic_load_n(&pool.running, __ATOMIC_ACQUIRE)) return 1;
  int ok = 0;
  pthread_mutex_lock(&pool.mu);
  if (pool.threads == 0) __atomic_store_n(&pool.threads, default_threads(), __ATOMIC_RELEASE);
  if (pool.threads == 2) ok = start_helper() == 0;
  pthread_mutex_unlock(&pool.mu);
  if (!ok) __atomic_store_n(&pool.busy, 0, __ATOMIC_SEQ_CST);
  return ok;
}

uint32_t rs_run_units(rs_units_fn fn, void *ctx, uint32_t n, uint32_t grain, uint32_t linger_ns) {
  if (grain == 0) grain = 1;
  uint32_t grains = n / grain + (n % grain != 0);
  if (grains < 2 || grains > 0xFFFF || !acquire_helper()) {
    if (n) fn(ctx, 0, n);
    return n;
  }
  __atomic_store_n(&pool.fn, fn, __ATOMIC_SEQ_CST);
  __atomic_store_n(&pool.ctx, ctx, __ATOMIC_SEQ_CST);
  __atomic_store_n(&pool.n, n, __ATOMIC_SEQ_CST);
  __atomic_store_n(&pool.grain, grain, __ATOMIC_SEQ_CST);
  __atomic_store_n(&pool.linger_ns, linger_ns, __ATOMIC_SEQ_CST);
  __atomic_store_n(&pool.done, 0, __ATOMIC_SEQ_CST);
  uint32_t gen = __atomic_load_n(&pool.gen, __ATOMIC_SEQ_CST) + 1;
  __atomic_store_n(&pool.claim, (uint64_t)gen << 32 | (uint64_t)grains << 16, __ATOMIC_SEQ_CST);
  __atomic_store_n(&pool.gen, gen, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&pool.sleeping, __ATOMIC_SEQ_CST)) futex_wake_private(&pool.gen);
  uint32_t ran = take_units(gen);
  /* Only grains the helper claimed are left: wait for it to finish them. */
  for (uint32_t spins = 0; __atomic_load_n(&pool.done, __ATOMIC_SEQ_CST) < grains; spins++) {
    if (spins < 4096) rs_cpu_relax();
    else sched_yield();   /* the helper was descheduled mid-unit: let it run */
  }
  __atomic_store_n(&pool.busy, 0, __ATOMIC_SEQ_CST);
  return ran;
}

void rs_gather_prewake(void) {
  if (__atomic_load_n(&pool.running, __ATOMIC_ACQUIRE) && __atomic_load_n(&pool.sleeping, __ATOMIC_SEQ_CST) &&
      !__atomic_load_n(&pool.busy, __ATOMIC_SEQ_CST))
    futex_wake_private(&pool.gen);
}

int rs_set_gather_threads(uint32_t threads, uint32_t *previous) {
  if (threads > 2)
    return rs_set_error(RS_EINVAL, "rs_set_gather_threads: expected 0 (query), 1 or 2 threads, got %u",
                        threads);
  pthread_mutex_lock(&pool.mu);
  if (pool.threads == 0) __atomic_store_n(&pool.threads, default_threads(), __ATOMIC_RELEASE);
  if (previous) *previous = pool.threads;
  if (threads == 1 && pool.running) {
    __atomic_store_n(&pool.threads, 1, __ATOMIC_RELEASE);   /* no new job takes the helper */
    uint32_t zero = 0;
    while (!__atomic_compare_exchange_n(&pool.busy, &zero, 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
      zero = 0;
      sched_yield();   /* a job in flight finishes first */
    }
    stop_helper();
    __atomic_store_n(&pool.busy, 0, __ATOMIC_SEQ_CST);
  }
  if (threads) __atomic_store_n(&pool.threads, threads, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&pool.mu);
  return RS_OK;
}

int rs_gather_helper_running(void) { return __atomic_load_n(&pool.running, __ATOMIC_ACQUIRE); }
