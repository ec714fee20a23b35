/*
 * reverb_shm._hot.Prefetcher: the native background threads of the learner's batch iterator
 * (reverb_shm/learner.py, BatchIterator), which never take the GIL.
 *
 * - The sampler thread gathers batches of exactly n items (rs_sample_gather, waiting in slices
 *   so that it sees stop requests) into a ring of caller-owned buffers ("slots": one
 *   rs_gather_col[] per slot, each column's `out` a buffer the Python object keeps alive).
 *   A gathered slot becomes READY; the consumer's take() moves the oldest READY slot to HELD
 *   and frees the HELD ones beyond `keep` (the consumer's batches stay valid until it has taken
 *   `keep` more), so the sampler gathers only into slots nobody reads. A consumer that keeps
 *   its batches for good (batches of their own) swaps a held slot's buffers for new ones
 *   (swap()), so the sampler never writes a buffer it handed out again.
 * - Queued priority updates are applied (rs_mutate) in the order queued, everything queued
 *   meanwhile in one call; keys no longer in the table are counted as skipped. The sampler
 *   applies them itself, before each gather, and the consumer's take() applies them while it
 *   waits for a batch (so a learner faster than the sampler lends it its idle time); the updater
 *   thread only while the sampler does not run (before it starts, after it ended, or when Python
 *   gathers) and the last ones at close.
 * - Both threads are SCHED_BATCH: waking them never preempts the learner's thread.
 *
 * The handshake is one mutex and condition variables: take() of a READY slot is a few loads and
 * stores under an uncontended mutex with the GIL held; it releases the GIL only to wait. The
 * mutex is never held while the GIL is taken (threads holding the GIL may lock it).
 *
 * Errors: the sampler ends on any status other than OK / EAGAIN / ETIMEDOUT and keeps it with
 * the core's message (its thread's rs_last_error), which take() returns once no READY slot is
 * left; an update's error is kept and returned once by update_error() (RS_ECLOSED ends updating:
 * the server stopped). Python maps the codes to exceptions (reverb_shm/_internal/_lib.py).
 *
 * Fork: the threads exist only in the creating process; every method refuses to run in a child
 * (the mutex may have been held at fork) and the child's deallocation leaks the state.
 */
#include "hot.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int (*mutate_fn)(void *base, uint32_t table, uint32_t n_upd, const uint64_t *upd_keys,
                         const double *upd_prios, uint32_t n_del, const uint64_t *del_keys,
                         uint32_t *updated_out, uint32_t *deleted_out);
typedef void (*seed_fn)(uint64_t seed);
typedef const char *(*last_error_fn)(void);

enum { SLOT_FREE = 0, SLOT_FILLING, SLOT_READY, SLOT_HELD };
#define MSG_BYTES 512

typedef struct {
  uint64_t *keys;
  double *prios;
  size_t len, cap;
} update_buf;

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t produce;   /* sampler: a slot became free, or stop */
  pthread_cond_t consume;   /* take(): a slot became ready, or the sampler ended */
  pthread_cond_t update;    /* updater: updates queued, or stop */
  pthread_cond_t applied;   /* flush(): the queue drained */
  pid_t pid;
  /* configuration */
  void *base;
  uint32_t proc_slot, table, n, ncols, nslots, keep;
  int64_t slice_ns;
  mutate_fn mutate;
  seed_fn seed_thread;
  last_error_fn last_error;
  /* ring (set by start_sampling) */
  rs_gather_col *cols;      /* nslots * ncols */
  uint64_t *info;           /* nslots * info_words, rs_sample_gather's info layout */
  size_t info_words;
  uint8_t *state;           /* per slot */
  uint32_t *ready, *held;   /* circular FIFOs of slot indices, capacity nslots */
  uint32_t ready_head, ready_len, held_head, held_len;
  int seeded;
  uint64_t seed;
  int stop_sampling, stop_updates;   /* written under mu, read without it atomically */
  int sampler_started, sampler_done, updater_started, updater_done, joined;
  int fail_rc;
  char fail_msg[MSG_BYTES];
  /* priority updates */
  update_buf queue, spare;
  uint64_t queued_calls;
  size_t applying;
  int upd_rc;
  char upd_msg[MSG_BYTES];
  uint64_t n_batches, n_update_calls, n_keys_updated, n_keys_skipped;
  uint64_t n_applied_waiting;   /* update calls applied by take() while it waited */
  pthread_t sampler, updater;
} pf_state;

typedef struct {
  PyObject_HEAD
  pf_state *s;
  PyObject *keepalive;   /* what owns the ring's buffers and the segment mapping */
  PyObject *swapped;     /* None, or a list: per slot, the buffers swap() gave it (or None) */
  PyObject *info_type;   /* SampleInfo */
} pf_object;

static int64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* pthread_cond_timedwait on CLOCK_MONOTONIC (the conds are made with that clock) until `until`. */
static int wait_until(pthread_cond_t *c, pthread_mutex_t *mu, int64_t until) {
  struct timespec ts = {(time_t)(until / 1000000000), (long)(until % 1000000000)};
  return pthread_cond_timedwait(c, mu, &ts);
}

static void keep_message(char *dst, const char *src) {
  snprintf(dst, MSG_BYTES, "%s", src ? src : "");
}

/* The calling thread is scheduled as SCHED_BATCH (Linux; same CPU share as SCHED_OTHER, nice
 * unchanged): a batch thread that wakes up never preempts a running normal thread. Without it,
 * the learner's own wake-ups of these threads (take() freeing a buffer, push() queueing an
 * update) made the kernel switch to them on the learner's CPU whenever the other CPUs were busy,
 * and the learner waited for a whole gather or rs_mutate. Best effort: left as it is where the
 * policy does not exist or is refused. */
static void background_policy(void) {
#ifdef SCHED_BATCH
  struct sched_param param = {0};
  (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
#endif
}

/* ---- priority updates */
/* (Under mu) whether the native sampler runs: it then applies the queued updates itself. */
static int sampler_alive(const pf_state *s) { return s->sampler_started && !s->sampler_done; }

/* (Under mu; unlocked during rs_mutate) applies everything queued, in the order queued, in one
 * call. Only one thread applies at a time (`applying`), so the order holds across threads.
 * Returns the number of update calls applied (0 on an error). */
static uint64_t apply_queue(pf_state *s, int final) {
  update_buf work = s->queue;
  s->queue = s->spare;
  s->queue.len = 0;
  uint64_t calls = s->queued_calls;
  s->queued_calls = 0;
  s->applying = work.len;
  pthread_mutex_unlock(&s->mu);
  uint32_t updated = 0, skipped = 0;
  int rc = RS_OK;
  for (size_t off = 0; off < work.len && rc == RS_OK;) {   /* (rs_mutate takes uint32 counts) */
    uint32_t part = work.len - off > (1u << 30) ? (1u << 30) : (uint32_t)(work.len - off);
    uint32_t upd = 0, del = 0;
    rc = s->mutate(s->base, s->table, part, work.keys + off, work.prios + off, 0, NULL, &upd, &del);
    if (rc == RS_OK) {
      updated += upd;
      skipped += part - upd;
    }
    off += part;
  }
  const char *msg = rc == RS_OK ? NULL : s->last_error();
  pthread_mutex_lock(&s->mu);
  work.len = 0;
  s->spare = work;
  s->applying = 0;
  if (rc == RS_OK) {
    s->n_update_calls += calls;
    s->n_keys_updated += updated;
    s->n_keys_skipped += skipped;
  } else if (rc == RS_ECLOSED) {   /* the server stopped: no update can land any more */
    if (!final && s->fail_rc == 0) {
      s->fail_rc = rc;
      keep_message(s->fail_msg, msg);
    }
    __atomic_store_n(&s->stop_updates, 1, __ATOMIC_RELEASE);
    s->queue.len = 0;
    pthread_cond_broadcast(&s->consume);
  } else if (s->upd_rc == 0) {
    s->upd_rc = rc;
    keep_message(s->upd_msg, msg);
  }
  pthread_cond_broadcast(&s->applied);
  return rc == RS_OK ? calls : 0;
}

/* (Under mu) whether the queue should be applied now (by the sampler, or by take() waiting). */
static int should_apply(const pf_state *s) {
  return s->queue.len && !s->applying && !s->stop_updates;
}

/* ---- sampler thread */
/* The sampler applies the queued priority updates before each gather, in the thread (and on the
 * CPU, with the sum tree in its cache) that gathers next: no second thread contends for the
 * table's lock and cache lines while it gathers (in a learner loop without a training step, a
 * separate updater thread made the iterator slower than one thread sampling and updating in
 * turn). While a gather waits for items (an empty table, a rate limiter), it applies them
 * between waits of at most APPLY_WAIT_NS, so flush() never waits long for a blocked sampler.
 * A consumer that finds no batch ready applies the queue itself before it waits (take()): it
 * would idle otherwise, and the sampler then only samples and gathers. Measured on a 2-CPU VM,
 * the learner loop with no training step (L1: prioritized 256 of 1M items + an update of the
 * batch), the same process alternating 0.4-s rounds: 3.26M -> 4.53M samples/s (medians of 16). */
#define APPLY_WAIT_NS 2000000

/* Keys queued beyond which push() applies the queue itself (or waits while another thread
 * does): a learner producing updates faster than they land is slowed down, not left to grow the
 * queue without bound (16 MiB of keys and priorities at this size). */
#define QUEUE_LIMIT_KEYS (1u << 20)

static int free_slot(pf_state *s) {
  for (uint32_t k = 0; k < s->nslots; k++)
    if (s->state[k] == SLOT_FREE) return (int)k;
  return -1;
}

static void *sampler_main(void *arg) {
  pf_state *s = arg;
  background_policy();
  if (s->seeded) s->seed_thread(s->seed);
  pthread_mutex_lock(&s->mu);
  for (;;) {
    int k = -1;
    while (!s->stop_sampling && (k = free_slot(s)) < 0 && !should_apply(s))
      pthread_cond_wait(&s->produce, &s->mu);
    if (s->stop_sampling) break;
    if (should_apply(s)) apply_queue(s, 0);
    if (s->stop_sampling) break;
    if ((k = free_slot(s)) < 0) continue;
    s->state[k] = SLOT_FILLING;
    pthread_mutex_unlock(&s->mu);
    uint32_t got = 0;
    int rc;
    int64_t wait_ns = s->slice_ns < APPLY_WAIT_NS ? s->slice_ns : APPLY_WAIT_NS;
    for (;;) {
      rc = hot_core.sample_gather(s->base, s->proc_slot, s->table, s->n, s->n,
                                  mono_ns() + wait_ns, wait_ns, s->ncols,
                                  s->cols + (size_t)k * s->ncols, s->info + (size_t)k * s->info_words,
                                  &got);
      if (rc == RS_OK && got == s->n) break;
      if (rc != RS_OK && rc != RS_EAGAIN && rc != RS_ETIMEDOUT) break;
      if (__atomic_load_n(&s->stop_sampling, __ATOMIC_ACQUIRE)) break;
      pthread_mutex_lock(&s->mu);   /* (waiting for items: apply what the learner sent meanwhile) */
      if (should_apply(s)) apply_queue(s, 0);
      pthread_mutex_unlock(&s->mu);
    }
    const char *msg = rc == RS_OK ? NULL : s->last_error();
    pthread_mutex_lock(&s->mu);
    if (rc == RS_OK && got == s->n) {
      s->state[k] = SLOT_READY;
      s->ready[(s->ready_head + s->ready_len++) % s->nslots] = (uint32_t)k;
      s->n_batches++;
      pthread_cond_signal(&s->consume);
      continue;
    }
    s->state[k] = SLOT_FREE;
    if (s->stop_sampling) break;
    if (s->fail_rc == 0) {   /* (the items gathered into this slot are dropped) */
      s->fail_rc = rc;
      keep_message(s->fail_msg, msg);
    }
    break;
  }
  s->sampler_done = 1;
  pthread_cond_broadcast(&s->consume);
  pthread_cond_broadcast(&s->update);   /* (the updater thread applies from now on) */
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* ---- updater thread: applies the queued updates while the native sampler does not run (before
 * it starts, after it ended, or never: batches gathered by Python), and the last ones at close. */
static void *updater_main(void *arg) {
  pf_state *s = arg;
  background_policy();
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while ((s->queue.len == 0 || s->applying || sampler_alive(s)) && !s->stop_updates)
      pthread_cond_wait(&s->update, &s->mu);
    while (s->applying) pthread_cond_wait(&s->applied, &s->mu);   /* (stopped: the sampler's) */
    if (s->queue.len == 0) {
      if (s->stop_updates) break;   /* stopped, all applied */
      continue;
    }
    apply_queue(s, s->stop_updates);
  }
  s->updater_done = 1;
  pthread_cond_broadcast(&s->applied);
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* ---- lifetime */
static void stop_and_join(pf_state *s) {
  pthread_mutex_lock(&s->mu);
  __atomic_store_n(&s->stop_sampling, 1, __ATOMIC_RELEASE);
  __atomic_store_n(&s->stop_updates, 1, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&s->produce);
  pthread_cond_broadcast(&s->update);
  int join = !s->joined;
  s->joined = 1;
  pthread_mutex_unlock(&s->mu);
  if (!join) return;
  if (s->sampler_started) pthread_join(s->sampler, NULL);
  if (s->updater_started) pthread_join(s->updater, NULL);
}

static void free_state(pf_state *s) {
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->produce);
  pthread_cond_destroy(&s->consume);
  pthread_cond_destroy(&s->update);
  pthread_cond_destroy(&s->applied);
  free(s->cols);
  free(s->info);
  free(s->state);
  free(s->ready);
  free(s->held);
  free(s->queue.keys);
  free(s->queue.prios);
  free(s->spare.keys);
  free(s->spare.prios);
  free(s);
}

static int in_creator(pf_object *self) {
  if (self->s == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "Prefetcher is not initialised");
    return 0;
  }
  if (self->s->pid != getpid()) {
    PyErr_SetString(PyExc_RuntimeError, "this Prefetcher was made in another process (its threads "
                    "do not exist after fork): re-create the iterator in this process");
    return 0;
  }
  return 1;
}

static void pf_dealloc(pf_object *self) {
  pf_state *s = self->s;
  if (s != NULL && s->pid == getpid()) {
    Py_BEGIN_ALLOW_THREADS
    stop_and_join(s);
    Py_END_ALLOW_THREADS
    free_state(s);
  }   /* (in a forked child: leaked, its mutex may be held by a thread that does not exist) */
  Py_XDECREF(self->keepalive);
  Py_XDECREF(self->swapped);
  Py_XDECREF(self->info_type);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static int init_conds(pf_state *s) {
  pthread_condattr_t attr;
  if (pthread_condattr_init(&attr) || pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)) return -1;
  int rc = pthread_mutex_init(&s->mu, NULL) || pthread_cond_init(&s->produce, &attr) ||
           pthread_cond_init(&s->consume, &attr) || pthread_cond_init(&s->update, &attr) ||
           pthread_cond_init(&s->applied, &attr);
  pthread_condattr_destroy(&attr);
  return rc ? -1 : 0;
}

/* Prefetcher(address, proc_slot, table, n, slice_ns, (mutate, seed_thread, last_error addresses),
 *            info_type, keepalive): starts the updater thread. */
static int pf_init(pf_object *self, PyObject *args, PyObject *kwds) {
  unsigned long long address, f_mutate, f_seed, f_error;
  unsigned int proc_slot, table, n;
  long long slice_ns;
  PyObject *info_type, *keepalive;
  if (self->s != NULL) {
    PyErr_SetString(PyExc_RuntimeError, "Prefetcher is already initialised");
    return -1;
  }
  if (!PyArg_ParseTuple(args, "KIIIL(KKK)OO:Prefetcher", &address, &proc_slot, &table, &n,
                        &slice_ns, &f_mutate, &f_seed, &f_error, &info_type, &keepalive))
    return -1;
  if (!hot_core_bound || !address || !f_mutate || !f_seed || !f_error) {
    PyErr_SetString(PyExc_ValueError, "Prefetcher: null address (or _hot is not bound)");
    return -1;
  }
  if (n == 0 || n >= (1u << 31) || slice_ns <= 0) {
    PyErr_SetString(PyExc_ValueError, "Prefetcher: n must be in [1, 2**31), slice_ns > 0");
    return -1;
  }
  pf_state *s = calloc(1, sizeof *s);
  if (s == NULL || init_conds(s) < 0) {
    free(s);
    PyErr_NoMemory();
    return -1;
  }
  s->pid = getpid();
  s->base = (void *)(uintptr_t)address;
  s->proc_slot = proc_slot;
  s->table = table;
  s->n = n;
  s->slice_ns = slice_ns;
  s->mutate = (mutate_fn)(uintptr_t)f_mutate;
  s->seed_thread = (seed_fn)(uintptr_t)f_seed;
  s->last_error = (last_error_fn)(uintptr_t)f_error;
  s->info_words = ((size_t)9 * n + 1) / 2;   /* 36 bytes per item, 8-byte aligned */
  if (pthread_create(&s->updater, NULL, updater_main, s) != 0) {
    free_state(s);
    PyErr_SetString(PyExc_OSError, "Prefetcher: pthread_create failed");
    return -1;
  }
  s->updater_started = 1;
  Py_INCREF(info_type);
  Py_INCREF(keepalive);
  self->info_type = info_type;
  self->keepalive = keepalive;
  self->s = s;
  return 0;
}

/* start_sampling(cols_addresses, ncols, keep, first_held, seed, keepalive): the ring of
 * len(cols_addresses) slots (each an rs_gather_col[ncols], copied), slot first_held (or -1)
 * already held by the consumer; seed None or an int for the sampler thread's generator. */
static PyObject *pf_start_sampling(pf_object *self, PyObject *args) {
  PyObject *addresses, *seed, *keepalive;
  unsigned int ncols, keep;
  int first_held;
  if (!in_creator(self)) return NULL;
  if (!PyArg_ParseTuple(args, "O!IIiOO:start_sampling", &PyTuple_Type, &addresses, &ncols, &keep,
                        &first_held, &seed, &keepalive))
    return NULL;
  pf_state *s = self->s;
  Py_ssize_t nslots = PyTuple_GET_SIZE(addresses);
  if (nslots < 1 || nslots > (1 << 20) || ncols < 1 || keep < 1 || first_held >= nslots ||
      first_held < -1) {
    PyErr_SetString(PyExc_ValueError, "start_sampling: bad ring (slots, columns, keep, first)");
    return NULL;
  }
  uint64_t seed_value = 0;
  if (seed != Py_None) {
    seed_value = PyLong_AsUnsignedLongLongMask(seed);
    if (PyErr_Occurred()) return NULL;
  }
  if (s->sampler_started || s->stop_sampling) {
    PyErr_SetString(PyExc_RuntimeError, "start_sampling: already started or stopped");
    return NULL;
  }
  rs_gather_col *cols = calloc((size_t)nslots * ncols, sizeof *cols);
  uint64_t *info = calloc((size_t)nslots * s->info_words, sizeof *info);
  uint8_t *state = calloc((size_t)nslots, 1);
  uint32_t *ready = calloc((size_t)nslots, sizeof *ready), *held = calloc((size_t)nslots + 1,
                                                                          sizeof *held);
  if (!cols || !info || !state || !ready || !held) {
    free(cols), free(info), free(state), free(ready), free(held);
    PyErr_NoMemory();
    return NULL;
  }
  for (Py_ssize_t k = 0; k < nslots; k++) {
    void *p = PyLong_AsVoidPtr(PyTuple_GET_ITEM(addresses, k));
    if (p == NULL) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "start_sampling: null address");
      free(cols), free(info), free(state), free(ready), free(held);
      return NULL;
    }
    memcpy(cols + (size_t)k * ncols, p, ncols * sizeof *cols);
  }
  pthread_mutex_lock(&s->mu);
  s->cols = cols;
  s->info = info;
  s->state = state;
  s->ready = ready;
  s->held = held;
  s->nslots = (uint32_t)nslots;
  s->ncols = ncols;
  s->keep = keep;
  s->seeded = seed != Py_None;
  s->seed = seed_value;
  if (first_held >= 0) {
    s->state[first_held] = SLOT_HELD;
    s->held[0] = (uint32_t)first_held;
    s->held_len = 1;
  }
  int ok = pthread_create(&s->sampler, NULL, sampler_main, s) == 0;
  s->sampler_started = ok;
  pthread_mutex_unlock(&s->mu);
  if (!ok) {
    PyErr_SetString(PyExc_OSError, "start_sampling: pthread_create failed");
    return NULL;
  }
  PyObject *both = PyTuple_Pack(2, self->keepalive, keepalive);
  if (both == NULL) {   /* (out of memory: the sampler writes into them, so leak a reference) */
    PyErr_Clear();
    Py_INCREF(keepalive);
    Py_RETURN_NONE;
  }
  Py_SETREF(self->keepalive, both);
  Py_RETURN_NONE;
}

/* (Under mu) the oldest READY slot becomes HELD; HELD slots beyond `keep` become FREE. */
static uint32_t take_ready(pf_state *s) {
  uint32_t k = s->ready[s->ready_head];
  s->ready_head = (s->ready_head + 1) % s->nslots;
  s->ready_len--;
  s->state[k] = SLOT_HELD;
  s->held[(s->held_head + s->held_len++) % (s->nslots + 1)] = k;
  while (s->held_len > s->keep) {
    uint32_t j = s->held[s->held_head];
    s->held_head = (s->held_head + 1) % (s->nslots + 1);
    s->held_len--;
    s->state[j] = SLOT_FREE;
    pthread_cond_signal(&s->produce);
  }
  return k;
}

/* take(wait_ns) -> (status, slot, SampleInfo | None): the oldest gathered batch (status RS_OK;
 * the info a fresh copy), waiting up to wait_ns with the GIL released; RS_ETIMEDOUT when none
 * came; the sampler's error status once it ended and no batch is left (fail_message() says
 * more); RS_ECLOSED when stopped. */
static PyObject *pf_take(pf_object *self, PyObject *arg) {
  if (!in_creator(self)) return NULL;
  long long wait_ns = PyLong_AsLongLong(arg);
  if (wait_ns == -1 && PyErr_Occurred()) return NULL;
  pf_state *s = self->s;
  if (!s->sampler_started) {
    PyErr_SetString(PyExc_RuntimeError, "take: sampling has not started");
    return NULL;
  }
  int rc = RS_OK;
  long k = -1;
  pthread_mutex_lock(&s->mu);
  if (s->ready_len == 0 && !s->sampler_done && !s->fail_rc && wait_ns > 0) {
    pthread_mutex_unlock(&s->mu);
    Py_BEGIN_ALLOW_THREADS
    int64_t until = mono_ns() + wait_ns;
    pthread_mutex_lock(&s->mu);
    while (s->ready_len == 0 && !s->sampler_done && !s->fail_rc && mono_ns() < until) {
      if (should_apply(s)) {   /* (the sampler is busy: apply the queue meanwhile) */
        s->n_applied_waiting += apply_queue(s, 0);
        continue;
      }
      wait_until(&s->consume, &s->mu, until);
    }
    if (s->ready_len) k = (long)take_ready(s);
    pthread_mutex_unlock(&s->mu);
    Py_END_ALLOW_THREADS
    pthread_mutex_lock(&s->mu);
  } else if (s->ready_len) {
    k = (long)take_ready(s);
  }
  if (k < 0) rc = s->fail_rc ? s->fail_rc : s->sampler_done ? RS_ECLOSED : RS_ETIMEDOUT;
  pthread_mutex_unlock(&s->mu);
  if (k < 0) return Py_BuildValue("(ilO)", rc, k, Py_None);
  /* The slot is HELD: the sampler does not write it until the consumer's next take. */
  npy_intp words = (npy_intp)s->info_words;
  PyObject *buf = PyArray_SimpleNew(1, &words, NPY_UINT64);
  if (buf == NULL) return NULL;
  char *info = PyArray_BYTES((PyArrayObject *)buf);
  memcpy(info, s->info + (size_t)k * s->info_words, s->info_words * 8);
  PyObject *infos = hot_sample_info(buf, info, s->n, s->n, (PyTypeObject *)self->info_type);
  Py_DECREF(buf);
  if (infos == NULL) return NULL;
  return Py_BuildValue("(ilN)", RS_OK, k, infos);
}

/* swap(slot, buffers) -> None: the consumer hands the batch it holds in `slot` (the one take()
 * returned last, still HELD) over for good and gives the slot new buffers to gather into from
 * now on: `buffers` a tuple of ncols numpy arrays, C-contiguous, aligned, writable, each of at
 * least n * the column's row bytes. The object keeps a reference to them while it may write
 * them; the old buffers are never written again (their owner is whoever holds the batch).
 * ValueError (nothing changed) for a slot that is not held or buffers that do not fit. */
static PyObject *pf_swap(pf_object *self, PyObject *args) {
  unsigned int k;
  PyObject *buffers;
  if (!in_creator(self)) return NULL;
  if (!PyArg_ParseTuple(args, "IO!:swap", &k, &PyTuple_Type, &buffers)) return NULL;
  pf_state *s = self->s;
  if (!s->sampler_started || k >= s->nslots || PyTuple_GET_SIZE(buffers) != (Py_ssize_t)s->ncols) {
    PyErr_SetString(PyExc_ValueError, "swap: no such slot, or not one buffer per column");
    return NULL;
  }
  uint8_t *outs[64];
  uint8_t **out = s->ncols <= 64 ? outs : malloc(s->ncols * sizeof *out);
  if (out == NULL) return PyErr_NoMemory();
  for (uint32_t c = 0; c < s->ncols; c++) {
    PyObject *o = PyTuple_GET_ITEM(buffers, c);
    const rs_gather_col *col = s->cols + (size_t)k * s->ncols + c;
    if (!PyArray_Check(o) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o) ||
        !PyArray_ISALIGNED((PyArrayObject *)o) || !PyArray_ISWRITEABLE((PyArrayObject *)o) ||
        (uint64_t)PyArray_NBYTES((PyArrayObject *)o) < (uint64_t)s->n * col->stride) {
      if (out != outs) free(out);
      PyErr_Format(PyExc_ValueError, "swap: buffer %u is not a C-contiguous, aligned, writable "
                   "array of at least %llu bytes", c, (unsigned long long)s->n * col->stride);
      return NULL;
    }
    out[c] = (uint8_t *)PyArray_BYTES((PyArrayObject *)o);
  }
  if (self->swapped == NULL) {
    PyObject *list = PyList_New((Py_ssize_t)s->nslots);
    if (list == NULL) {
      if (out != outs) free(out);
      return NULL;
    }
    for (uint32_t j = 0; j < s->nslots; j++) {
      Py_INCREF(Py_None);
      PyList_SET_ITEM(list, j, Py_None);
    }
    self->swapped = list;
  }
  pthread_mutex_lock(&s->mu);
  int held = s->state[k] == SLOT_HELD;
  if (held)   /* (the sampler reads a slot's columns only once it made it FILLING, under mu) */
    for (uint32_t c = 0; c < s->ncols; c++) s->cols[(size_t)k * s->ncols + c].out = out[c];
  pthread_mutex_unlock(&s->mu);
  if (out != outs) free(out);
  if (!held) {
    PyErr_Format(PyExc_ValueError, "swap: slot %u is not held by the consumer", k);
    return NULL;
  }
  Py_INCREF(buffers);   /* (the previous buffers of the slot, if swapped before, are released) */
  PyObject *old = PyList_GET_ITEM(self->swapped, k);
  PyList_SET_ITEM(self->swapped, k, buffers);
  Py_DECREF(old);
  Py_RETURN_NONE;
}

/* Checks m priorities (float32 or float64, per `f32`): all finite, and >= 0 when `nonneg`. */
static int prios_ok(const void *p, int f32, size_t m, int nonneg) {
  for (size_t i = 0; i < m; i++) {
    double v = f32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
    if (!hot_priority_ok(v, nonneg)) return 0;
  }
  return 1;
}

/* push(keys, priorities, nonneg) -> status: queues an update (copied; priorities converted to
 * float64). Keys uint64[m] or int64[m] (each >= 0), priorities float64[m] or float32[m]
 * (finite; >= 0 when nonneg), both 1-D contiguous. RS_EINVAL (nothing queued) for anything
 * else, or while an earlier update's error is kept: the caller then takes its general path,
 * which validates and raises. RS_ECLOSED once updating stopped. */
static PyObject *pf_push(pf_object *self, PyObject *args) {
  PyObject *ko, *po;
  int nonneg;
  if (!in_creator(self)) return NULL;
  if (!PyArg_ParseTuple(args, "OOp:push", &ko, &po, &nonneg)) return NULL;
  if (!PyArray_Check(ko) || !PyArray_Check(po)) return PyLong_FromLong(RS_EINVAL);
  PyArrayObject *keys = (PyArrayObject *)ko, *prios = (PyArrayObject *)po;
  int ktype = PyArray_TYPE(keys), ptype = PyArray_TYPE(prios);
  if ((ktype != NPY_UINT64 && ktype != NPY_INT64) || (ptype != NPY_FLOAT64 && ptype != NPY_FLOAT32) ||
      PyArray_NDIM(keys) != 1 || PyArray_NDIM(prios) != 1 || !PyArray_IS_C_CONTIGUOUS(keys) ||
      !PyArray_IS_C_CONTIGUOUS(prios) || PyArray_DIM(keys, 0) != PyArray_DIM(prios, 0) ||
      !PyArray_ISNOTSWAPPED(keys) || !PyArray_ISNOTSWAPPED(prios))
    return PyLong_FromLong(RS_EINVAL);
  size_t m = (size_t)PyArray_DIM(keys, 0);
  const uint64_t *kd = PyArray_DATA(keys);
  const void *pd = PyArray_DATA(prios);
  int f32 = ptype == NPY_FLOAT32;
  if (ktype == NPY_INT64)
    for (size_t i = 0; i < m; i++)
      if ((int64_t)kd[i] < 0) return PyLong_FromLong(RS_EINVAL);
  if (!prios_ok(pd, f32, m, nonneg)) return PyLong_FromLong(RS_EINVAL);
  pf_state *s = self->s;
  int rc = RS_OK;
  pthread_mutex_lock(&s->mu);
  if (s->stop_updates || s->updater_done) {
    rc = RS_ECLOSED;
  } else if (s->upd_rc) {
    rc = RS_EINVAL;
  } else if (m) {
    update_buf *q = &s->queue;
    if (q->len + m > q->cap) {
      size_t cap = q->cap ? q->cap : 1024;
      while (cap < q->len + m) cap *= 2;
      uint64_t *nk = realloc(q->keys, cap * sizeof *nk);
      if (nk) q->keys = nk;
      double *np_ = nk ? realloc(q->prios, cap * sizeof *np_) : NULL;
      if (np_) q->prios = np_;
      if (!nk || !np_) {
        pthread_mutex_unlock(&s->mu);
        return PyErr_NoMemory();
      }
      q->cap = cap;
    }
    memcpy(q->keys + q->len, kd, m * sizeof *q->keys);
    double *dst = q->prios + q->len;
    if (f32)
      for (size_t i = 0; i < m; i++) dst[i] = ((const float *)pd)[i];
    else
      memcpy(dst, pd, m * sizeof *dst);
    q->len += m;
    s->queued_calls++;
    pthread_cond_signal(sampler_alive(s) ? &s->produce : &s->update);
  } else {
    s->n_update_calls++;
  }
  /* (pending: queued, and taken by a thread applying them; stats() reports the sum) */
  int over = rc == RS_OK && s->queue.len + s->applying > QUEUE_LIMIT_KEYS;
  pthread_mutex_unlock(&s->mu);
  if (over) {   /* backpressure (the queue keeps its order: one thread applies at a time) */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&s->mu);
    while (s->queue.len + s->applying > QUEUE_LIMIT_KEYS && !s->stop_updates &&
           !s->updater_done) {
      if (should_apply(s))
        apply_queue(s, 0);
      else
        pthread_cond_wait(&s->applied, &s->mu);   /* (another thread applies) */
    }
    pthread_mutex_unlock(&s->mu);
    Py_END_ALLOW_THREADS
  }
  return PyLong_FromLong(rc);
}

/* flush(wait_ns) -> True when every queued update was applied (waits up to wait_ns, GIL
 * released). */
static PyObject *pf_flush(pf_object *self, PyObject *arg) {
  if (!in_creator(self)) return NULL;
  long long wait_ns = PyLong_AsLongLong(arg);
  if (wait_ns == -1 && PyErr_Occurred()) return NULL;
  pf_state *s = self->s;
  int done;
  Py_BEGIN_ALLOW_THREADS
  int64_t until = mono_ns() + (wait_ns > 0 ? wait_ns : 0);
  pthread_mutex_lock(&s->mu);
  while ((s->queue.len || s->applying) && !s->updater_done && mono_ns() < until)
    wait_until(&s->applied, &s->mu, until);
  done = !(s->queue.len || s->applying);
  pthread_mutex_unlock(&s->mu);
  Py_END_ALLOW_THREADS
  return PyBool_FromLong(done);
}

/* None or (status, message): the error of an update (`update`: cleared, returned once) or the
 * one the threads ended on (kept). */
static PyObject *kept_error(pf_object *self, int update) {
  if (!in_creator(self)) return NULL;
  pf_state *s = self->s;
  int *rc_field = update ? &s->upd_rc : &s->fail_rc;
  char msg[MSG_BYTES];
  pthread_mutex_lock(&s->mu);
  int rc = *rc_field;
  memcpy(msg, update ? s->upd_msg : s->fail_msg, MSG_BYTES);
  if (update) *rc_field = 0;
  pthread_mutex_unlock(&s->mu);
  if (rc == 0) Py_RETURN_NONE;
  return Py_BuildValue("(is)", rc, msg);
}

static PyObject *pf_update_error(pf_object *self, PyObject *unused) { return kept_error(self, 1); }

static PyObject *pf_failure(pf_object *self, PyObject *unused) { return kept_error(self, 0); }

/* stats() -> (batches, update calls applied, keys updated, keys skipped, keys pending,
 * sampler running, updater running, update calls applied by take() while it waited). */
static PyObject *pf_stats(pf_object *self, PyObject *unused) {
  if (!in_creator(self)) return NULL;
  pf_state *s = self->s;
  pthread_mutex_lock(&s->mu);
  PyObject *out = Py_BuildValue(
      "(KKKKniiK)", (unsigned long long)s->n_batches, (unsigned long long)s->n_update_calls,
      (unsigned long long)s->n_keys_updated, (unsigned long long)s->n_keys_skipped,
      (Py_ssize_t)(s->queue.len + s->applying), s->sampler_started && !s->sampler_done,
      s->updater_started && !s->updater_done, (unsigned long long)s->n_applied_waiting);
  pthread_mutex_unlock(&s->mu);
  return out;
}

/* close(): stops both threads (the updater applies what is queued first) and joins them. */
static PyObject *pf_close(pf_object *self, PyObject *unused) {
  if (!in_creator(self)) return NULL;
  Py_BEGIN_ALLOW_THREADS
  stop_and_join(self->s);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyMethodDef pf_methods[] = {
    {"start_sampling", (PyCFunction)pf_start_sampling, METH_VARARGS,
     "start_sampling(cols_addresses, ncols, keep, first_held, seed, keepalive)"},
    {"take", (PyCFunction)pf_take, METH_O, "take(wait_ns) -> (status, slot, SampleInfo | None)"},
    {"swap", (PyCFunction)pf_swap, METH_VARARGS,
     "swap(slot, buffers): the held slot's batch is handed over; it gathers into buffers next"},
    {"push", (PyCFunction)pf_push, METH_VARARGS, "push(keys, priorities, nonneg) -> status"},
    {"flush", (PyCFunction)pf_flush, METH_O, "flush(wait_ns) -> all applied"},
    {"update_error", (PyCFunction)pf_update_error, METH_NOARGS,
     "update_error() -> None | (status, message), once"},
    {"failure", (PyCFunction)pf_failure, METH_NOARGS, "failure() -> None | (status, message)"},
    {"stats", (PyCFunction)pf_stats, METH_NOARGS,
     "stats() -> (batches, update_calls, keys_updated, keys_skipped, pending, sampling, updating)"},
    {"close", (PyCFunction)pf_close, METH_NOARGS, "close(): stop and join the threads"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject pf_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "reverb_shm._hot.Prefetcher",
    .tp_basicsize = sizeof(pf_object),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Prefetcher(address, proc_slot, table, n, slice_ns, (rs_mutate, rs_rand_seed_thread, "
              "rs_last_error addresses), SampleInfo, keepalive): the learner iterator's native "
              "sampler and priority-updater threads (private; see csrc/hot/hot_prefetch.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)pf_init,
    .tp_dealloc = (destructor)pf_dealloc,
    .tp_methods = pf_methods,
};

int hot_prefetch_init(PyObject *module) {
  if (PyType_Ready(&pf_type) < 0) return -1;
  Py_INCREF(&pf_type);
  if (PyModule_AddObject(module, "Prefetcher", (PyObject *)&pf_type) < 0) {
    Py_DECREF(&pf_type);
    return -1;
  }
  return 0;
}
