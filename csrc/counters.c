/* Operation counters (counters.h): the per-process slot binding, merging rows on read, and the
 * list of attached processes. Nothing here takes a lock: readers (`reverb-shm top`, the metrics
 * exporter, stats()) must never slow the processes they watch. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <string.h>

#include "counters.h"
#include "limiter.h"

_Static_assert(sizeof(((rs_table_counts *)0)->hold_hist) == sizeof(((rs_tcounters *)0)->hold_hist),
               "public and shared histograms have the same buckets");

/* This process's slot per mapped segment. A process maps few segments; an entry is replaced
 * when the same base registers again (after fork, the child claims a slot of its own). */
#define SELF_MAX 16
static struct { void *base; uint32_t slot; } self_slots[SELF_MAX];
static pthread_mutex_t self_mu = PTHREAD_MUTEX_INITIALIZER;

uint32_t rs_counters_self(void *base) {
  for (uint32_t i = 0; i < SELF_MAX; i++)
    if (__atomic_load_n(&self_slots[i].base, __ATOMIC_ACQUIRE) == base)
      return __atomic_load_n(&self_slots[i].slot, __ATOMIC_RELAXED);
  return UINT32_MAX;
}

void rs_counters_claimed(void *base, uint32_t slot) {
  rs_seg_hdr *h = rs_seg(base);
  for (uint32_t t = 0; t < h->num_tables; t++) {
    rs_tcounters *c = rs_counters_row(base, slot, t);
    __atomic_store_n(&c->blocked_inserters, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&c->blocked_samplers, 0, __ATOMIC_RELAXED);
  }
  pthread_mutex_lock(&self_mu);
  uint32_t at = SELF_MAX;
  for (uint32_t i = 0; i < SELF_MAX && at == SELF_MAX; i++)
    if (self_slots[i].base == base) at = i;
  for (uint32_t i = 0; i < SELF_MAX && at == SELF_MAX; i++)
    if (self_slots[i].base == NULL) at = i;
  if (at == SELF_MAX) at = 0;   /* more segments than entries: the oldest binding is dropped */
  __atomic_store_n(&self_slots[at].slot, slot, __ATOMIC_RELAXED);
  __atomic_store_n(&self_slots[at].base, base, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&self_mu);
}

static int slot_alive(void *base, uint32_t slot) {
  int32_t pid = __atomic_load_n(&rs_slots(base)[slot].pid, __ATOMIC_ACQUIRE);
  if (pid <= 0) return 0;
  /* pid gone here: a process of another pid namespace still holds its liveness lock */
  return !(kill(pid, 0) == -1 && errno == ESRCH) || rs_live_probe_base(base, 1 + (uint64_t)slot) == 1;
}

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)

int rs_counters_read(void *base, uint32_t table, rs_table_counts *out) {
  if (!base || !out) return rs_set_error(RS_EINVAL, "rs_counters_read: NULL argument");
  rs_seg_hdr *h = rs_seg(base);
  if (table >= h->num_tables)
    return rs_set_error(RS_EINVAL, "table index %u out of range (segment has %u tables)", table,
                        h->num_tables);
  memset(out, 0, sizeof *out);
  for (uint32_t s = 0; s <= h->max_procs; s++) {
    const rs_tcounters *c = rs_counters_row(base, s, table);
    out->inserts += LOAD(c->inserts);
    out->samples += LOAD(c->samples);
    out->updates += LOAD(c->updates);
    out->deletes += LOAD(c->deletes);
    out->evictions += LOAD(c->evictions);
    out->expirations += LOAD(c->expirations);
    out->insert_bytes += LOAD(c->insert_bytes);
    out->lock_holds += LOAD(c->lock_holds);
    out->lock_hold_ns += LOAD(c->lock_hold_ns);
    for (uint32_t b = 0; b < RS_HOLD_BUCKETS; b++) out->hold_hist[b] += LOAD(c->hold_hist[b]);
    uint32_t bi = LOAD(c->blocked_inserters), bs = LOAD(c->blocked_samplers);
    if ((bi || bs) && s < h->max_procs && slot_alive(base, s)) {
      out->blocked_inserters += bi;
      out->blocked_samplers += bs;
    }
  }
  /* The limiter predicates read a private copy of the header: no lock, no write. */
  rs_table_hdr th;
  memcpy(&th, rs_table(base, table), sizeof th);
  out->size = th.size;
  out->max_size = th.max_size;
  out->num_episodes = th.num_episodes;
  out->limiter_inserts = th.inserts;
  out->limiter_samples = th.samples;
  out->limiter_deletes = th.deletes;
  out->samples_per_insert = th.samples_per_insert;
  out->min_size_to_sample = th.min_size_to_sample;
  out->min_diff = th.min_diff;
  out->max_diff = th.max_diff;
  out->diff = (double)th.inserts * th.samples_per_insert - (double)th.samples;
  out->can_insert = rs_limiter_can_insert(&th, 1);
  out->can_sample = th.size > 0 && rs_limiter_can_sample(&th, 1);
  out->insert_blocked_ns = th.waiting_for_sampling_ns;
  out->sample_blocked_ns = th.waiting_for_inserts_ns;
  out->closed = th.closed || LOAD(h->closed);
  return RS_OK;
}

int rs_proc_list(void *base, rs_proc_info *out, uint32_t cap, uint32_t *n_out) {
  if (!base || !n_out || (cap && !out)) return rs_set_error(RS_EINVAL, "rs_proc_list: NULL argument");
  rs_seg_hdr *h = rs_seg(base);
  rs_slot *slots = rs_slots(base);
  uint32_t n = 0;
  for (uint32_t s = 0; s < h->max_procs && n < cap; s++) {
    int32_t pid = __atomic_load_n(&slots[s].pid, __ATOMIC_ACQUIRE);
    if (pid == 0) continue;
    out[n] = (rs_proc_info){.pid = pid, .slot = s, .pins = LOAD(slots[s].npins),
                            .alive = (uint32_t)slot_alive(base, s),
                            .start_time = LOAD(slots[s].start_time)};
    n++;
  }
  *n_out = n;
  return RS_OK;
}
