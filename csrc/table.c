/* Tables: region layout, insert / sample / gather / mutate / reset / listing / stats, blocking
 * on the rate limiter, and repair after a lock owner died.
 *
 * Every structure of a table is derived from its records (rs_rec with valid == 1): the key index,
 * the dense array (Uniform), the insertion-order list (Fifo/Lifo), the selector heaps and sum
 * trees, the episode map and the size. A removal clears `valid` first and a new record sets it
 * only once its fields are written, so rs_table_repair can always rebuild the rest.
 *
 * Lock order: table lock, then arena lock (rs_desc_create / rs_desc_release / rs_pin_descs take
 * the arena lock while the table lock is held). Payload bytes are never copied under a lock.
 *
 * Blocking (DESIGN.md "Concurrency and speed rules"): a caller that cannot progress reads the
 * table's `seq` word under the mutex, registers in `waiters`, unlocks, spins briefly re-reading
 * `seq`, then futex-waits on it (as an inserter or a sampler: a futex bitset) until its deadline
 * or slice ends. Anything that may unblock others bumps `seq` and wakes one waiter of the kind
 * whose limiter condition now holds (op_publish), skipping the system call when none of them
 * waits or one of them is already on its way; that waiter, once it holds the lock again, takes
 * what it can and its own publish wakes the next one while the condition still holds. */
#define _GNU_SOURCE
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "counters.h"
#include "index.h"
#include "layout_cache.h"
#include "limiter.h"
#include "selectors.h"
#include "sumtree.h"
#include "table.h"

#define SAMPLE_ROUND 256             /* items sampled (and pinned) per arena-lock acquisition */
#define SPIN_NS 4000                 /* re-read seq this long before sleeping in the kernel */

/* ================================================================== region layout */

static int kind_ok(int32_t k) { return k >= RS_SEL_UNIFORM && k <= RS_SEL_MAXHEAP; }

static int config_check(const rs_table_config *cfg) {
  if (!cfg) return rs_set_error(RS_EINVAL, "table config is NULL");
  size_t nlen = strnlen(cfg->name, sizeof cfg->name);
  if (nlen == 0 || nlen == sizeof cfg->name)
    return rs_set_error(RS_EINVAL, "table name must be 1..63 bytes, NUL-terminated");
  if (cfg->max_size < 1 || cfg->max_size > RS_MAX_TABLE_SIZE)
    return rs_set_error(RS_EINVAL, "table '%s': max_size must be in [1, %u], got %llu", cfg->name,
                        RS_MAX_TABLE_SIZE, (unsigned long long)cfg->max_size);
  if (!kind_ok(cfg->sampler_kind) || !kind_ok(cfg->remover_kind))
    return rs_set_error(RS_EINVAL, "table '%s': selector kinds must be RS_SEL_* (0..5), got %d / %d",
                        cfg->name, cfg->sampler_kind, cfg->remover_kind);
  if ((cfg->sampler_kind == RS_SEL_PRIORITIZED && !isfinite(cfg->sampler_exponent)) ||
      (cfg->remover_kind == RS_SEL_PRIORITIZED && !isfinite(cfg->remover_exponent)))
    return rs_set_error(RS_EINVAL, "table '%s': priority exponent must be finite", cfg->name);
  int rc = rs_limiter_validate(cfg->samples_per_insert, cfg->min_size_to_sample, cfg->min_diff,
                               cfg->max_diff);
  if (rc) return rc;
  if (cfg->blob_len > RS_MAX_BLOB || (cfg->blob_len && !cfg->blob))
    return rs_set_error(RS_EINVAL, "table '%s': config blob must be <= %u bytes (got %u)", cfg->name,
                        RS_MAX_BLOB, cfg->blob_len);
  return RS_OK;
}

typedef struct region_plan {
  uint32_t cap, index_cap, tree_leaves, episodes_cap;
  uint64_t recs, index, dense, heap[2], tree[2], aux, episodes, blob, total; /* relative offsets */
} region_plan;

static void plan_region(const rs_table_config *cfg, region_plan *p) {
  memset(p, 0, sizeof *p);
  p->cap = (uint32_t)cfg->max_size + 1; /* an overflow insert adds before the remover deletes */
  p->index_cap = rs_index_capacity(p->cap);
  p->episodes_cap = rs_map_capacity(p->cap);
  int prio = cfg->sampler_kind == RS_SEL_PRIORITIZED || cfg->remover_kind == RS_SEL_PRIORITIZED;
  /* one leaf per record, rounded up to whole 64-byte groups of 8 (sumtree.h) */
  p->tree_leaves = prio ? (p->cap + 7) / 8 * 8 : 0;
  uint64_t at = rs_align_up(sizeof(rs_table_hdr), RS_ALIGN);
#define PLACE(field, bytes) (p->field = at, at = rs_align_up(at + (uint64_t)(bytes), RS_ALIGN))
  PLACE(recs, (uint64_t)p->cap * sizeof(rs_rec));
  PLACE(index, (uint64_t)p->index_cap * sizeof(rs_index_entry));
  PLACE(dense, (uint64_t)p->cap * sizeof(uint32_t));
  int32_t kinds[2] = {cfg->sampler_kind, cfg->remover_kind};
  for (int si = 0; si < 2; si++) {
    if (rs_sel_is_heap(kinds[si])) PLACE(heap[si], (uint64_t)p->cap * sizeof(uint32_t));
    if (kinds[si] == RS_SEL_PRIORITIZED) PLACE(tree[si], 2ull * p->tree_leaves * sizeof(double));
  }
  if (rs_sel_is_heap(kinds[0]) || rs_sel_is_heap(kinds[1])) PLACE(aux, (uint64_t)p->cap * sizeof(rs_heap_aux));
  PLACE(episodes, (uint64_t)p->episodes_cap * sizeof(rs_episode_entry));
  PLACE(blob, cfg->blob_len);
#undef PLACE
  p->total = at;
}

uint64_t rs_table_region_size(const rs_table_config *cfg) {
  if (config_check(cfg)) return 0;
  region_plan p;
  plan_region(cfg, &p);
  return p.total;
}

int rs_table_layout_check(void *base, uint32_t t) {
  const rs_seg_hdr *h = rs_seg(base);
  uint64_t off = ((const uint64_t *)rs_at(base, h->tables_off))[t];
  const rs_table_hdr *th = (const rs_table_hdr *)rs_at(base, off);
  rs_table_config cfg;
  memset(&cfg, 0, sizeof cfg);
  memcpy(cfg.name, th->name, sizeof cfg.name);
  cfg.max_size = th->max_size;
  cfg.max_times_sampled = th->max_times_sampled;
  cfg.sampler_kind = th->sel[0].kind;
  cfg.sampler_exponent = th->sel[0].exponent;
  cfg.remover_kind = th->sel[1].kind;
  cfg.remover_exponent = th->sel[1].exponent;
  cfg.samples_per_insert = th->samples_per_insert;
  cfg.min_size_to_sample = th->min_size_to_sample;
  cfg.min_diff = th->min_diff;
  cfg.max_diff = th->max_diff;
  cfg.blob = (const uint8_t *)th;   /* not read: only its length matters to the plan */
  cfg.blob_len = th->blob_len;
  if (config_check(&cfg)) {
    char why[512];
    snprintf(why, sizeof why, "%s", rs_last_error());
    return rs_set_error(RS_ECORRUPT, "table %u header holds an invalid configuration: %s", t, why);
  }
  region_plan p;
  plan_region(&cfg, &p);
  int heaps = rs_sel_is_heap(cfg.sampler_kind) || rs_sel_is_heap(cfg.remover_kind);
  int bad = th->cap != p.cap || th->index_cap != p.index_cap || th->episodes_cap != p.episodes_cap ||
            th->tree_leaves != p.tree_leaves || th->recs_off != off + p.recs ||
            th->index_off != off + p.index || th->dense_off != off + p.dense ||
            th->episodes_off != off + p.episodes || th->blob_off != off + p.blob ||
            th->aux_off != (heaps ? off + p.aux : 0) || off + p.total > h->arena_off ||
            th->sel[0].heap_len > p.cap || th->sel[1].heap_len > p.cap ||
            (th->free_rec_head != RS_NONE && th->free_rec_head >= p.cap) ||
            (th->order_head != RS_NONE && th->order_head >= p.cap) ||
            (th->order_tail != RS_NONE && th->order_tail >= p.cap) || th->size < 0 ||
            (uint64_t)th->size > th->max_size + 1;
  for (int si = 0; si < 2; si++) {
    int32_t kind = si ? cfg.remover_kind : cfg.sampler_kind;
    bad |= th->sel[si].heap_off != (rs_sel_is_heap(kind) ? off + p.heap[si] : 0);
    bad |= th->sel[si].tree_off != (kind == RS_SEL_PRIORITIZED ? off + p.tree[si] : 0);
  }
  if (bad)
    return rs_set_error(RS_ECORRUPT, "table %u ('%.63s') header: capacities, array offsets or list "
                        "heads differ from the layout of its configuration (max_size %llu): the "
                        "segment is damaged", t, th->name, (unsigned long long)th->max_size);
  return RS_OK;
}

static void free_list_rebuild(rs_rec *recs, rs_table_hdr *th) {
  th->free_rec_head = RS_NONE;
  for (uint32_t r = th->cap; r-- > 0;) {
    if (recs[r].valid) continue;
    recs[r].next_free = th->free_rec_head;
    th->free_rec_head = r;
  }
}

int rs_table_region_init(void *base, uint64_t off, const rs_table_config *cfg) {
  int rc = config_check(cfg);
  if (rc) return rc;
  region_plan p;
  plan_region(cfg, &p);
  rs_table_hdr *th = (rs_table_hdr *)rs_at(base, off);
  memset(th, 0, sizeof *th);
  memcpy(th->name, cfg->name, sizeof th->name);
  th->max_size = cfg->max_size;
  th->max_times_sampled = cfg->max_times_sampled;
  th->cap = p.cap;
  int32_t kinds[2] = {cfg->sampler_kind, cfg->remover_kind};
  double exps[2] = {cfg->sampler_exponent, cfg->remover_exponent};
  for (int si = 0; si < 2; si++) {
    th->sel[si].kind = kinds[si];
    th->sel[si].exponent = kinds[si] == RS_SEL_PRIORITIZED ? exps[si] : 0.0;
    th->sel[si].heap_off = rs_sel_is_heap(kinds[si]) ? off + p.heap[si] : 0;
    th->sel[si].tree_off = kinds[si] == RS_SEL_PRIORITIZED ? off + p.tree[si] : 0;
    th->sel[si].heap_len = 0;
  }
  th->samples_per_insert = cfg->samples_per_insert;
  th->min_size_to_sample = cfg->min_size_to_sample;
  th->min_diff = cfg->min_diff;
  th->max_diff = cfg->max_diff;
  th->order_head = th->order_tail = RS_NONE;
  th->recs_off = off + p.recs;
  th->index_off = off + p.index;
  th->index_cap = p.index_cap;
  th->tree_leaves = p.tree_leaves;
  th->dense_off = off + p.dense;
  th->episodes_off = off + p.episodes;
  th->episodes_cap = p.episodes_cap;
  th->blob_off = off + p.blob;
  th->blob_len = cfg->blob_len;
  th->aux_off = p.aux ? off + p.aux : 0;
  th->last_rec = RS_NONE;
  for (uint32_t i = 0; i < RS_RECENT_TEMPLATES; i++) th->recent_recs[i] = RS_NONE;
  if (cfg->blob_len) memcpy(rs_at(base, th->blob_off), cfg->blob, cfg->blob_len);

  rs_rec *recs = rs_recs(base, th);
  for (uint32_t r = 0; r < p.cap; r++) {
    memset(&recs[r], 0, sizeof recs[r]);
    recs[r].prev = recs[r].next = RS_NONE;
    if (th->aux_off) rs_aux(base, th)[r] = (rs_heap_aux){0, {RS_NONE, RS_NONE}};
  }
  free_list_rebuild(recs, th);
  rs_index_clear(rs_tindex(base, th), th->index_cap);
  rs_epmap_clear(rs_tepisodes(base, th), th->episodes_cap);
  for (int si = 0; si < 2; si++)
    if (th->sel[si].kind == RS_SEL_PRIORITIZED)
      memset(rs_tree(base, &th->sel[si]), 0, 2ull * th->tree_leaves * sizeof(double));
  return rs_mutex_init(&th->lock);
}

/* ================================================================== argument checks */

static int table_arg(void *base, uint32_t t, rs_table_hdr **out) {
  if (!base) return rs_set_error(RS_EINVAL, "segment base is NULL");
  uint32_t nt = rs_seg(base)->num_tables;
  if (t >= nt) return rs_set_error(RS_EINVAL, "table index %u out of range (segment has %u tables)", t, nt);
  *out = rs_table(base, t);
  return RS_OK;
}

/* Checks `table` and the caller's output arguments (outputs_ok), then takes the table lock for
 * a read-only query; on RS_OK the caller reads *th_out and calls rs_tunlock. */
static int query_lock(void *base, uint32_t table, int outputs_ok, const char *fn,
                      rs_table_hdr **th_out) {
  int rc = table_arg(base, table, th_out);
  if (rc) return rc;
  if (!outputs_ok) return rs_set_error(RS_EINVAL, "%s: NULL output argument", fn);
  return rs_tlock(base, table);
}

static int slot_arg(void *base, uint32_t slot) {
  rs_seg_hdr *h = rs_seg(base);
  if (slot >= h->max_procs || __atomic_load_n(&rs_slots(base)[slot].pid, __ATOMIC_ACQUIRE) == 0)
    return rs_set_error(RS_EINVAL, "process slot %u is not registered (max_procs %u)", slot, h->max_procs);
  return RS_OK;
}

static int has_prioritized(const rs_table_hdr *th) {
  return th->sel[0].kind == RS_SEL_PRIORITIZED || th->sel[1].kind == RS_SEL_PRIORITIZED;
}

/* Priorities must be finite; >= 0 with a Prioritized sampler or remover, whose weight
 * priority**exponent must also be at most rs_sel_weight_cap: finite
 * weights could otherwise sum to an infinite tree total. */
static int check_priorities(const rs_table_hdr *th, uint32_t n, const double *p, const char *what) {
  for (uint32_t i = 0; i < n; i++) {
    if (!isfinite(p[i]))
      return rs_set_error(RS_EINVAL, "table '%s': %s priority [%u] is %g; priorities must be finite",
                          th->name, what, i, p[i]);
    if (!has_prioritized(th)) continue;
    if (p[i] < 0)
      return rs_set_error(RS_EINVAL,
                          "table '%s': %s priority [%u] is %g; a table with a Prioritized selector "
                          "needs priorities >= 0", th->name, what, i, p[i]);
    for (int si = 0; si < 2; si++) {
      if (th->sel[si].kind != RS_SEL_PRIORITIZED) continue;
      double cap = rs_sel_weight_cap(th->tree_leaves), e = th->sel[si].exponent;
      /* p**e <= max(p, 1) for e in [0, 1]: no pow needed far below the cap */
      if (e >= 0 && e <= 1 && p[i] <= 0.5 * cap) continue;
      if (!(rs_sel_weight(th->sel[si].exponent, p[i]) <= cap))
        return rs_set_error(RS_EINVAL,
                            "table '%s': %s priority [%u] = %g gives weight priority**%g above the "
                            "cap %g of this table (float64 max / (2 * %u sum-tree leaves), so the "
                            "weights' total stays finite); expected a smaller priority", th->name,
                            what, i, p[i], th->sel[si].exponent, cap, th->tree_leaves);
    }
  }
  return RS_OK;
}

static int is_closed(void *base, rs_table_hdr *th) {
  return __atomic_load_n(&th->closed, __ATOMIC_ACQUIRE) ||
         __atomic_load_n(&rs_seg(base)->closed, __ATOMIC_ACQUIRE);
}

/* ================================================================== one locked operation */

typedef struct op {
  void *base;
  uint32_t t;
  rs_table_hdr *th;
  const char *what;        /* "insert" / "sample": names the blocked side in messages */
  int64_t *held_ns;        /* stat charged with lock-held time (may be NULL) */
  int64_t *waited_ns;      /* stat charged with blocked time */
  int64_t locked_at;
  rs_tcounters *c;         /* the caller's counter row for this table (counters.h) */
  int dirty;               /* made a change that may unblock a waiter */
  int woke;                /* holds the lock again after waiting (op_wait): passes a wake-up on */
  int64_t deadline, slice_end; /* monotonic ns, < 0 = none */
} op_t;

static void op_init(op_t *op, void *base, uint32_t t, const char *what, int64_t *held, int64_t *waited,
                    int64_t deadline_ns, int64_t slice_ns) {
  memset(op, 0, sizeof *op);
  op->base = base;
  op->t = t;
  op->th = rs_table(base, t);
  op->what = what;
  op->held_ns = held;
  op->waited_ns = waited;
  op->deadline = deadline_ns < 0 ? -1 : deadline_ns;
  op->slice_end = slice_ns > 0 ? rs_now_ns() + slice_ns : -1;
}

static int op_lock(op_t *op) {
  int rc = rs_tlock(op->base, op->t);
  if (rc) return rc;
  op->locked_at = op->th->locked_at_ns;   /* (rs_tlock's clock reading) */
  return RS_OK;
}

/* Kinds of waiters on a table's seq word (futex bitset bits) and their shares of `waiters`. */
#define WAIT_INSERT 1u
#define WAIT_SAMPLE 2u
#define WAKE_ALL 4u    /* (op_publish's answer) wake every waiter of the kinds, not one of each */
#define WAITER_ONE(kind) ((kind) == WAIT_INSERT ? 1u : 1u << 16)

/* Bump seq if something changed; returns the kinds of waiters to wake (0: none) and WAKE_ALL.
 * A kind is woken only when some of its waiters sleep and its limiter condition now holds (an
 * inserter can add one item; a sampler can take one), so a sample never wakes a sampler, an
 * insert never wakes an inserter, and nobody is woken only to find the limiter still closed.
 * Waiters register under the lock, so the counts read here include everyone who may sleep on
 * the old seq.
 *
 * One waiter of a kind is woken at a time (a chain): the publisher marks the kind in `woken`
 * (under the lock) until a waiter of it holds the lock again (op_wait clears the mark), and
 * publishers skip the kind meanwhile; that waiter takes what it can, and its own publish wakes
 * the next one if the condition still holds. Waking them all let every writer of a pipeline
 * wake for the room one sample makes, all but one only to sleep again, each wake-up a context
 * switch (~40 us to wake an idle vCPU here) that could preempt the process doing the work.
 * Every waiter counted when the mark is made registered on an older seq, so one of them comes
 * back to the lock after it (woken, or finding seq changed) and clears it, and a waiter that
 * registers later clears it too (op_wait): a mark whose waiter never comes back (a process
 * that died between marking and waking, or after being woken) only holds the sleepers counted
 * with it to their slice. A woken waiter that made no change still passes the wake-up on here
 * (what it was woken for may still hold for the next one: a sampler that stopped at an item
 * of another layout). Waiters that register without the lock (rs_table_wait_change, counted
 * in change_waiters) are woken all at once, with every inserter, and leave no mark. */
static uint32_t op_publish(op_t *op) {
  if (!op->dirty && !op->woke) return 0;
  rs_table_hdr *th = op->th;
  int changed = op->dirty;
  if (changed) __atomic_add_fetch(&th->seq, 1, __ATOMIC_RELEASE);
  op->dirty = op->woke = 0;
  uint32_t w = __atomic_load_n(&th->waiters, __ATOMIC_ACQUIRE);
  if (w == 0) return 0;
  if (is_closed(op->base, th)) return WAIT_INSERT | WAIT_SAMPLE | WAKE_ALL;
  uint32_t kinds = 0;
  if ((w & 0xffffu) && rs_limiter_can_insert(th, 1)) kinds |= WAIT_INSERT;
  if ((w >> 16) && th->size > 0 && rs_limiter_can_sample(th, 1)) kinds |= WAIT_SAMPLE;
  if (!kinds) return 0;
  /* (a pass-on bumps seq too: a waiter between registering and sleeping then sees it) */
  if (!changed) __atomic_add_fetch(&th->seq, 1, __ATOMIC_RELEASE);
  if ((kinds & WAIT_INSERT) && __atomic_load_n(&th->change_waiters, __ATOMIC_SEQ_CST))
    return kinds | WAKE_ALL;   /* (everyone is woken: nothing to mark) */
  uint32_t on_way = __atomic_fetch_or(&th->woken, kinds, __ATOMIC_SEQ_CST);
  return kinds & ~on_way;
}

static void op_release(op_t *op, uint32_t wake) {
  int64_t held = rs_now_ns() - op->locked_at;
  if (op->held_ns) *op->held_ns += held;
  rs_counters_hold(op->c, held);
  rs_tunlock(op->base, op->t);
  if (!wake) return;
  if (wake & WAKE_ALL) {
    rs_futex_wake_bits(&op->th->seq, wake & (WAIT_INSERT | WAIT_SAMPLE), INT_MAX);
    return;
  }
  for (uint32_t kind = WAIT_INSERT; kind <= WAIT_SAMPLE; kind <<= 1)
    if (wake & kind) rs_futex_wake_bits(&op->th->seq, kind, 1);
}

static void op_unlock(op_t *op) { op_release(op, op_publish(op)); }

/* With the lock held: RS_OK while the table is open, else RS_ECLOSED with the lock released. */
static int op_check_open(op_t *op) {
  if (!is_closed(op->base, op->th)) return RS_OK;
  int rc = rs_set_error(RS_ECLOSED, "table '%s' is closed", op->th->name);
  op_unlock(op);
  return rc;
}

static int blocked_error(op_t *op, int code) {
  rs_table_hdr *th = op->th;
  return rs_set_error(code,
                      "table '%s': %s %s waiting for the rate limiter (size %lld, inserts %lld, "
                      "samples %lld, deletes %lld, min_size_to_sample %lld, min_diff %g, max_diff %g)",
                      th->name, op->what, code == RS_ETIMEDOUT ? "timed out" : "slice expired",
                      (long long)th->size, (long long)th->inserts, (long long)th->samples,
                      (long long)th->deletes, (long long)th->min_size_to_sample, th->min_diff,
                      th->max_diff);
}

/* Called with the lock held when no progress is possible. Returns RS_OK with the lock held
 * again after a wake-up, or an error code (RS_ETIMEDOUT, RS_EAGAIN, ...) with it released. */
static int op_wait(op_t *op) {
  rs_table_hdr *th = op->th;
  int64_t now = rs_now_ns();
  if (op->deadline >= 0 && now >= op->deadline) {
    int rc = blocked_error(op, RS_ETIMEDOUT);
    op_unlock(op);
    return rc;
  }
  if (op->slice_end >= 0 && now >= op->slice_end) {
    /* Once per slice: a dead server would otherwise leave this waiter retrying forever. */
    int rc = rs_owner_check(op->base);
    if (rc == RS_OK) rc = blocked_error(op, RS_EAGAIN);
    op_unlock(op);
    return rc;
  }
  int64_t until = op->deadline;
  if (op->slice_end >= 0 && (until < 0 || op->slice_end < until)) until = op->slice_end;
  /* Only inserts and samples wait; an insert charges its lock time to inserting_ns. */
  int inserter = op->held_ns == &th->inserting_ns;
  uint32_t kind = inserter ? WAIT_INSERT : WAIT_SAMPLE;
  uint32_t wake = op_publish(op);
  uint32_t seen = __atomic_load_n(&th->seq, __ATOMIC_ACQUIRE);
  __atomic_add_fetch(&th->waiters, WAITER_ONE(kind), __ATOMIC_ACQ_REL);
  /* A new sleeper needs a wake-up of its own: a mark made before it registered (whose waiter
   * may have died, or been a change waiter that left) must not keep publishers from waking it. */
  __atomic_and_fetch(&th->woken, ~kind, __ATOMIC_SEQ_CST);
  op_release(op, wake);
  uint32_t *blocked = inserter ? &op->c->blocked_inserters : &op->c->blocked_samplers;
  __atomic_add_fetch(blocked, 1, __ATOMIC_RELAXED);

  int rc = RS_OK;
  int64_t t0 = rs_now_ns();
  while (__atomic_load_n(&th->seq, __ATOMIC_ACQUIRE) == seen && rs_now_ns() - t0 < SPIN_NS)
    rs_cpu_relax();
  if (__atomic_load_n(&th->seq, __ATOMIC_ACQUIRE) == seen)
    rc = rs_futex_wait_bits_batch(&th->seq, seen, until, kind);
  __atomic_sub_fetch(&th->waiters, WAITER_ONE(kind), __ATOMIC_ACQ_REL);
  __atomic_sub_fetch(blocked, 1, __ATOMIC_RELAXED);
  int64_t waited = rs_now_ns() - t0;
  if (rc == RS_ESYS) return rc;
  rc = op_lock(op);
  if (rc) return rc;
  /* Back under the lock: a wake-up of this kind is no longer on its way (op_publish); this
   * waiter's own publish wakes the next one if what it leaves still admits one. */
  __atomic_and_fetch(&th->woken, ~kind, __ATOMIC_SEQ_CST);
  op->woke = 1;
  *op->waited_ns += waited;
  return RS_OK;
}

/* ================================================================== item structures */

typedef struct ep_ctx {
  rs_table_hdr *th;
  rs_episode_entry *em;
  uint32_t count;
} ep_ctx;

#define EP_NEW_SEEN 64   /* distinct new episodes of one item told apart exactly */

typedef struct ep_new_ctx {
  ep_ctx c;
  uint32_t nseen;
  uint64_t seen[EP_NEW_SEEN];   /* the new episodes counted so far */
} ep_new_ctx;

/* The episode-map entry this thread last found for adding (and for dropping) an episode's
 * references: the items of one insert call, and the victims evicted in a row, mostly name the
 * same episodes, so their map operations start here instead of hashing and probing each time.
 * A hint only: used (with the table lock held) only when that entry holds that episode now. */
typedef struct ep_hint {
  const rs_episode_entry *em;   /* the map (this process's address of it) */
  uint32_t cap, slot;
} ep_hint;
static __thread ep_hint ep_hint_add, ep_hint_drop;

static rs_episode_entry *ep_hinted(const ep_hint *h, rs_episode_entry *em, uint32_t cap, uint64_t ep) {
  if (h->em != em || h->cap != cap || h->slot >= cap) return NULL;
  rs_episode_entry *e = &em[h->slot];
  return e->count && e->episode_id == ep ? e : NULL;
}

static void ep_remember(ep_hint *h, rs_episode_entry *em, uint32_t cap, const rs_episode_entry *e) {
  if (!e) return;
  h->em = em;
  h->cap = cap;
  h->slot = (uint32_t)(e - em);
}

/* Counts the episodes of an item that the map does not hold yet, each once: the chunks of one
 * episode (one per column) need one new entry, not one each. Past EP_NEW_SEEN distinct new
 * episodes the rest are counted per chunk (an overestimate: the capacity check stays safe). */
static void ep_count_new(void *c, uint64_t ep) {
  ep_new_ctx *x = c;
  uint32_t cap = x->c.th->episodes_cap;
  if (ep_hinted(&ep_hint_add, x->c.em, cap, ep)) return;
  rs_episode_entry *e = rs_epmap_find(x->c.em, cap, ep);
  if (e) {
    ep_remember(&ep_hint_add, x->c.em, cap, e);
    return;
  }
  for (uint32_t i = 0; i < x->nseen; i++)
    if (x->seen[i] == ep) return;
  if (x->nseen < EP_NEW_SEEN) x->seen[x->nseen++] = ep;
  x->c.count++;
}

static void ep_add(void *c, uint64_t ep) {
  ep_ctx *x = c;
  uint32_t cap = x->th->episodes_cap;
  rs_episode_entry *e = ep_hinted(&ep_hint_add, x->em, cap, ep);
  if (e) {
    e->count++;
    return;
  }
  if (rs_epmap_incr(x->em, cap, ep) == 1) x->th->num_episodes++;
  ep_remember(&ep_hint_add, x->em, cap, rs_epmap_find(x->em, cap, ep));
}

static void ep_drop(void *c, uint64_t ep) {
  ep_ctx *x = c;
  uint32_t cap = x->th->episodes_cap;
  rs_episode_entry *e = ep_hinted(&ep_hint_drop, x->em, cap, ep);
  if (!e) ep_remember(&ep_hint_drop, x->em, cap, e = rs_epmap_find(x->em, cap, ep));
  if (e && e->count > 1) {   /* (the last reference removes the entry: rs_epmap_decr) */
    e->count--;
    return;
  }
  if (rs_epmap_decr(x->em, cap, ep) == 1) {
    x->th->num_episodes--;
    x->th->num_deleted_episodes++;
  }
}

/* Link a committed record into the index (at index slot `slot`, rs_index_find_slot's), dense
 * array, order list, selectors and episode map. */
static void item_link(void *base, rs_table_hdr *th, uint32_t r, uint32_t slot) {
  rs_rec *recs = rs_recs(base, th);
  rs_rec *rec = &recs[r];
  rs_index_put_at(rs_tindex(base, th), th->index_cap, slot, rec->key, r);
  uint32_t *dense = rs_dense(base, th);
  rec->dense_pos = (uint32_t)th->size;
  dense[th->size] = r;
  rec->prev = th->order_tail;
  rec->next = RS_NONE;
  if (th->order_tail != RS_NONE) recs[th->order_tail].next = r;
  else th->order_head = r;
  th->order_tail = r;
  th->size++;
  for (int si = 0; si < 2; si++) rs_sel_insert(base, th, si, r);
  ep_ctx ctx = {th, rs_tepisodes(base, th), 0};
  rs_item_each_episode(base, rec->desc_off, ep_add, &ctx);
}

/* Remove record r from every structure (valid cleared first). The caller then releases its
 * descriptor (rec->desc_off) and counts the delete. */
static void item_unlink(void *base, rs_table_hdr *th, uint32_t r) {
  rs_rec *recs = rs_recs(base, th);
  rs_rec *rec = &recs[r];
  __atomic_store_n(&rec->valid, 0, __ATOMIC_RELEASE);
  rs_index_remove(rs_tindex(base, th), th->index_cap, rec->key);
  for (int si = 0; si < 2; si++) rs_sel_remove(base, th, si, r);
  uint32_t *dense = rs_dense(base, th);
  uint32_t last = dense[th->size - 1];
  dense[rec->dense_pos] = last;
  recs[last].dense_pos = rec->dense_pos;
  th->size--;
  if (rec->prev != RS_NONE) recs[rec->prev].next = rec->next;
  else th->order_head = rec->next;
  if (rec->next != RS_NONE) recs[rec->next].prev = rec->prev;
  else th->order_tail = rec->prev;
  rec->prev = rec->next = RS_NONE;
  ep_ctx ctx = {th, rs_tepisodes(base, th), 0};
  rs_item_each_episode(base, rec->desc_off, ep_drop, &ctx);
  rec->next_free = th->free_rec_head;
  th->free_rec_head = r;
}

static void item_remove(void *base, rs_table_hdr *th, uint32_t r, int arena_locked) {
  uint64_t desc = rs_recs(base, th)[r].desc_off;
  item_unlink(base, th, r);
  th->deletes++;
  rs_desc_release(base, desc, arena_locked);
}

static void update_priority(void *base, rs_table_hdr *th, uint32_t r, double priority) {
  rs_rec *rec = &rs_recs(base, th)[r];
  rec->priority = priority;
  if (th->aux_off) rs_aux(base, th)[r].update_seq = th->next_update_seq++;
  for (int si = 0; si < 2; si++) rs_sel_update(base, th, si, r);
}

/* Descriptors of the items an insert call evicted, released together under one arena-lock hold
 * (still under the table lock, as sample_round's expired items) instead of one hold each. */
#define EVICT_BATCH 64
typedef struct evicted {
  uint32_t n;
  uint64_t descs[EVICT_BATCH];
  uint64_t spare_ref;   /* references to this item reference's block taken and not used ... */
  uint32_t spare_n;     /* ... (shared_run), released with the evicted ones */
} evicted;

static void evicted_release(void *base, evicted *ev) {
  if ((ev->n || ev->spare_n) && rs_alock(base) == RS_OK) {
    /* Items evicted in a row were mostly inserted together, holding one block: one release of
     * each run of references to the same block. */
    for (uint32_t i = 0, j; i < ev->n; i = j) {
      for (j = i + 1; j < ev->n && rs_ref_off(ev->descs[j]) == rs_ref_off(ev->descs[i]); j++) {}
      rs_desc_release_n(base, ev->descs[i], j - i);
    }
    rs_desc_release_n(base, ev->spare_ref, ev->spare_n);
    rs_aunlock(base);
  }
  ev->n = ev->spare_n = 0;
}

/* What evicting the next items of a full Fifo-removal table reads (their key index slots,
 * dense-array entries and descriptor blocks) requested ahead of the evictions, found by following
 * the insertion order from its head: the evictions then hit in cache instead of missing on each
 * in turn, one after the other. A walk stays VICTIMS_AHEAD records ahead of the evictions of one
 * lock hold (victims_start, then victims_step at each eviction). Only reads: the order ahead of
 * the head does not change while the hold inserts (new items join its tail). */
#define VICTIMS_AHEAD 32
typedef struct victim_walk {
  uint32_t r;      /* the next record to request */
  uint32_t left;   /* evictions still to come in this hold that are not requested yet */
} victim_walk;

static void victims_step(void *base, rs_table_hdr *th, victim_walk *w) {
  if (w->left == 0 || w->r >= th->cap) return;
  const rs_rec *recs = rs_recs(base, th);
  const rs_rec *rec = &recs[w->r];
  rs_index_prefetch(rs_tindex(base, th), th->index_cap, 1, &rec->key);
  __builtin_prefetch(&rs_dense(base, th)[rec->dense_pos], 1);
  __builtin_prefetch(rs_at(base, rs_ref_off(rec->desc_off) - RS_ALIGN), 1);
  /* Records are mostly reused in eviction order (an insert takes the record its previous
   * eviction freed), so the chain's later ones usually lie just after: requested ahead, the
   * walk's own dependent loads hit (in-process W6 inserts held the lock ~2.6% less). */
  if (w->r + 16 < th->cap) __builtin_prefetch(&recs[w->r + 16], 1);
  w->r = rec->next;
  w->left--;
}

/* A walk for the evictions that inserting `n` items into `th` will make (none unless it has
 * Fifo removal and would overflow), with its first VICTIMS_AHEAD requested. */
static victim_walk victims_start(void *base, rs_table_hdr *th, uint32_t n) {
  victim_walk w = {RS_NONE, 0};
  uint64_t over = (uint64_t)th->size + n;
  if (th->sel[1].kind != RS_SEL_FIFO || over <= th->max_size) return w;
  over -= th->max_size;
  w.r = th->order_head;
  w.left = over < n ? (uint32_t)over : n;
  for (uint32_t j = 0; j < VICTIMS_AHEAD; j++) victims_step(base, th, &w);
  return w;
}

/* Insert (or update) one item; the limiter has already admitted it. An item evicted to make
 * room leaves every table structure here; its descriptor joins `ev` (the caller releases it).
 * `held`: an item reference to the item's descriptor that the caller already holds a block
 * reference for (shared_run), or 0 to find or create one here; *used_held tells whether the
 * new record took it (else it is still the caller's: the key existed, or an error). */
static int insert_one(void *base, rs_table_hdr *th, uint64_t key, double priority,
                      const uint8_t *blob, uint32_t len, int64_t now_ns, evicted *ev, uint64_t held,
                      int *used_held) {
  *used_held = 0;
  uint32_t slot;   /* where the key goes (nothing below changes the index before item_link) */
  uint32_t r = rs_index_find_slot(rs_tindex(base, th), th->index_cap, key, &slot);
  if (r != RS_NONE) { /* existing key: priority update, no counter change, descriptor unused */
    update_priority(base, th, r, priority);
    return RS_OK;
  }
  ep_new_ctx ctx;
  ctx.c = (ep_ctx){th, rs_tepisodes(base, th), 0};
  ctx.nseen = 0;
  rs_desc_each_episode(base, (const rs_desc_hdr *)blob, 0, ep_count_new, &ctx);
  if ((uint64_t)th->num_episodes + ctx.c.count >= th->episodes_cap)
    return rs_set_error(RS_EFULL, "table '%s': episode map full (%lld episodes, capacity %u)",
                        th->name, (long long)th->num_episodes, th->episodes_cap - 1);
  if (th->free_rec_head == RS_NONE) /* cannot happen: size <= max_size < cap */
    return rs_set_error(RS_ECORRUPT, "table '%s': no free record (size %lld)", th->name,
                        (long long)th->size);
  /* The last inserted item's block, then recently created ones, are templates to share while a
   * live record holds them (a stale offset could name memory that is no longer a block). */
  rs_rec *recs = rs_recs(base, th);
  uint64_t desc = held;
  if (held) {   /* the block's newest record holds it longest: it replaces the block's recent one */
    r = th->free_rec_head;
    for (uint32_t i = 0; i < RS_RECENT_TEMPLATES; i++) {
      uint32_t cand = th->recent_recs[i];
      if (cand < th->cap && recs[cand].valid && rs_ref_off(recs[cand].desc_off) == rs_ref_off(held))
        th->recent_recs[i] = r;
    }
    *used_held = 1;
  } else {
    uint64_t tmpls[1 + RS_RECENT_TEMPLATES];
    uint32_t from[1 + RS_RECENT_TEMPLATES], ntmpl = 0;   /* recent_recs slot of each, or RS_NONE */
    for (uint32_t i = 0; i <= RS_RECENT_TEMPLATES; i++) {
      uint32_t cand = i == 0 ? th->last_rec : th->recent_recs[i - 1];
      if (cand < th->cap && recs[cand].valid && (i == 0 || cand != th->last_rec)) {
        tmpls[ntmpl] = recs[cand].desc_off;
        from[ntmpl++] = i == 0 ? RS_NONE : i - 1;
      }
    }
    int used;
    int rc = rs_desc_create_shared_any(base, blob, len, tmpls, ntmpl, &desc, &used);
    if (rc) return rc;
    r = th->free_rec_head;
    if (used < 0) {   /* a new block: remembered in place of the oldest */
      th->recent_recs[th->recent_next % RS_RECENT_TEMPLATES] = r;
      th->recent_next = (th->recent_next + 1) % RS_RECENT_TEMPLATES;
    } else if (from[used] != RS_NONE) {   /* the block's newest record holds it longest */
      th->recent_recs[from[used]] = r;
    }
  }
  th->last_rec = r;
  rs_rec *rec = &recs[r];
  th->free_rec_head = rec->next_free;
  rec->key = key;
  rec->priority = priority;
  rec->insert_seq = th->next_insert_seq++;
  rec->desc_off = desc;
  rec->inserted_at_ns = now_ns;
  rec->times_sampled = 0;
  rec->next_free = RS_NONE;
  if (th->aux_off) rs_aux(base, th)[r] = (rs_heap_aux){th->next_update_seq++, {RS_NONE, RS_NONE}};
  __atomic_store_n(&rec->valid, 1, __ATOMIC_RELEASE); /* commit */
  item_link(base, th, r, slot);

  if ((uint64_t)th->size > th->max_size) {
    uint32_t victim;
    double prob;
    rs_sel_pick(base, th, 1, 1, &victim, &prob);
    if (ev->n == EVICT_BATCH) evicted_release(base, ev);
    ev->descs[ev->n++] = recs[victim].desc_off;
    item_unlink(base, th, victim);
    th->deletes++;
  }
  th->inserts++;
  return RS_OK;
}

/* ================================================================== insert */

/* Items of one insert call that differ only by a row shift (a batch of rows of the same chunks)
 * share one DESC block. Found before the lock from the caller's descriptors: the items form
 * groups of consecutive items; item i's group starts at item grp[i], and its rows lie shift[i]
 * rows after that first item's (rs_desc_blob_shift). Without memory for the arrays (a call of
 * more than GROUP_STACK items), every item is its own group: each then finds a block to share
 * under the lock, one arena-lock hold per item. */
#define GROUP_STACK 256
typedef struct shift_groups {
  uint32_t n;
  uint32_t *grp;
  int32_t *shift;
  uint32_t stack_grp[GROUP_STACK];
  int32_t stack_shift[GROUP_STACK];
} shift_groups;

static void shift_groups_find(shift_groups *g, uint32_t n, const uint8_t *blob, const uint64_t *offs) {
  g->n = n;
  g->grp = n <= GROUP_STACK ? g->stack_grp : malloc(n * sizeof *g->grp);
  g->shift = n <= GROUP_STACK ? g->stack_shift : malloc(n * sizeof *g->shift);
  if (!g->grp || !g->shift) {
    if (g->grp != g->stack_grp) free(g->grp);
    if (g->shift != g->stack_shift) free(g->shift);
    g->grp = NULL;
    g->shift = NULL;
    return;
  }
  uint32_t first = 0;
  for (uint32_t i = 0; i < n; i++) {
    uint32_t len = (uint32_t)(offs[i + 1] - offs[i]);
    int64_t d = i && len == offs[first + 1] - offs[first]
                    ? rs_desc_blob_shift(blob + offs[first], blob + offs[i], len) : -1;
    if (d < 0) first = i, d = 0;
    g->grp[i] = first;
    g->shift[i] = (int32_t)d;
  }
}

static void shift_groups_free(shift_groups *g) {
  if (g->grp != g->stack_grp) free(g->grp);
  if (g->shift != g->stack_shift) free(g->shift);
}

/* Block references taken in advance for the rest of a group, under the table lock: the item
 * that found or made its group's block (`ref`, at `shift0` in its group) takes one reference
 * for each later item of the group in a single arena-lock hold, instead of one hold per item;
 * the references those items do not use (existing keys; the round ended) are released with the
 * round's evicted items. */
typedef struct shared_run {
  uint64_t ref;      /* the item reference whose block the references are to */
  uint32_t grp;      /* its group */
  uint32_t end;      /* items before `end` may use them */
  int32_t shift0;    /* its shift in the group */
  uint32_t held;     /* references held and not used */
} shared_run;

/* The item reference item i uses from the references held, or 0 (none held for it). */
static uint64_t shared_run_ref(const shared_run *run, const shift_groups *g, uint32_t i) {
  if (!run->held || !g->grp || g->grp[i] != run->grp || i >= run->end) return 0;
  return rs_ref_make(rs_ref_off(run->ref),
                     (uint32_t)((int64_t)rs_ref_shift(run->ref) + g->shift[i] - run->shift0));
}

/* Item i has just been inserted with a block found or made for it (the table's newest record):
 * take references to that block for the later items of its group when their shifts fit. The
 * references left of an earlier group (its items were existing keys) join `ev` to be released. */
static void shared_run_take(void *base, rs_table_hdr *th, shared_run *run, const shift_groups *g,
                            uint32_t i, const uint8_t *blob, const uint64_t *offs, evicted *ev) {
  if (!g->grp) return;
  for (; run->held; run->held--) {
    if (ev->n == EVICT_BATCH) evicted_release(base, ev);
    ev->descs[ev->n++] = run->ref;
  }
  uint32_t end = i + 1, far = i;
  int32_t lo = g->shift[i], hi = g->shift[i];
  for (; end < g->n && g->grp[end] == g->grp[i]; end++) {
    if (g->shift[end] < lo) lo = g->shift[end];
    if (g->shift[end] > hi) hi = g->shift[end], far = end;
  }
  if (end == i + 1) return;
  const rs_rec *rec = &rs_recs(base, th)[th->last_rec];
  if (!rec->valid) return;   /* (a remover that took the newest item at once) */
  uint64_t ref = rec->desc_off;
  int64_t s = rs_ref_shift(ref);
  if (s + lo - g->shift[i] < 0 || s + hi - g->shift[i] > RS_REF_MAX_SHIFT) return;
  if (rs_desc_add_refs(base, ref, end - i - 1, blob + offs[far], (uint32_t)(offs[far + 1] - offs[far])))
    return;   /* (the items then take the per-item path, which reports what is wrong) */
  *run = (shared_run){ref, g->grp[i], end, g->shift[i], end - i - 1};
}

int rs_insert(void *base, uint32_t slot, uint32_t table, uint32_t n, const uint64_t *keys,
              const double *priorities, const uint8_t *blob, const uint64_t *blob_offs,
              int64_t deadline_ns, int64_t slice_ns, uint32_t *done_out) {
  if (!done_out) return rs_set_error(RS_EINVAL, "rs_insert: done_out is NULL");
  *done_out = 0;
  rs_table_hdr *th = NULL;
  int rc = table_arg(base, table, &th);
  if (rc) return rc;
  if (n == 0) return RS_OK;
  if (!keys || !priorities || !blob || !blob_offs)
    return rs_set_error(RS_EINVAL, "rs_insert: keys, priorities, blob and blob_offs must not be NULL");
  rc = check_priorities(th, n, priorities, "insert");
  if (rc) return rc;
  for (uint32_t i = 0; i < n; i++) {
    if (blob_offs[i + 1] < blob_offs[i] || blob_offs[i + 1] - blob_offs[i] > UINT32_MAX)
      return rs_set_error(RS_EINVAL, "rs_insert: blob_offs must be non-decreasing with items < 4 GiB "
                          "(item %u: %llu..%llu)", i, (unsigned long long)blob_offs[i],
                          (unsigned long long)blob_offs[i + 1]);
    rc = rs_desc_validate(base, blob + blob_offs[i], (uint32_t)(blob_offs[i + 1] - blob_offs[i]));
    if (rc) {
      char why[768];
      snprintf(why, sizeof why, "%s", rs_last_error());
      return rs_set_error(rc, "table '%s': item %u has a bad descriptor: %s", th->name, i, why);
    }
  }

  shift_groups g;
  shift_groups_find(&g, n, blob, blob_offs);
  shared_run run = {0, 0, 0, 0, 0};

  op_t op;
  op_init(&op, base, table, "insert", &th->inserting_ns, &th->waiting_for_sampling_ns, deadline_ns,
          slice_ns);
  op.c = rs_counters_row(base, slot, table);
  /* Each key's index probe is a cache miss in a large table: request them all at once, before
   * the lock (the index's place and size never change), so that they overlap taking it. */
  rs_index_prefetch(rs_tindex(base, th), th->index_cap, n < 256 ? n : 256, keys);
  rc = op_lock(&op);
  uint32_t done = 0;
  evicted ev = {0};
  while (rc == RS_OK && (rc = op_check_open(&op)) == RS_OK) {
    /* One insertion time for the items of one lock hold (they become visible together). */
    int64_t now_ns = rs_realtime_ns();
    victim_walk walk = victims_start(base, th, n - done);
    while (done < n && rs_limiter_can_insert(th, 1)) {
      int64_t inserts0 = th->inserts, deletes0 = th->deletes;
      uint64_t held = shared_run_ref(&run, &g, done);
      int used_held;
      uint32_t len = (uint32_t)(blob_offs[done + 1] - blob_offs[done]);
      rc = insert_one(base, th, keys[done], priorities[done], blob + blob_offs[done], len, now_ns,
                      &ev, held, &used_held);
      if (rc) break;
      if (used_held) run.held--;
      else if (!held && th->inserts != inserts0)   /* a block found or made here: share it on */
        shared_run_take(base, th, &run, &g, done, blob, blob_offs, &ev);
      if (th->inserts != inserts0) {
        op.c->inserts++;
        op.c->insert_bytes += rs_desc_bytes(base, (const rs_desc_hdr *)(blob + blob_offs[done]));
      } else {
        op.c->updates++;
      }
      op.c->evictions += (uint64_t)(th->deletes - deletes0);
      if (th->deletes != deletes0) victims_step(base, th, &walk);
      done++;
      op.dirty = 1;
    }
    ev.spare_ref = run.ref;   /* references the items after this round would have used */
    ev.spare_n = run.held;
    run.held = 0;
    evicted_release(base, &ev);
    if (rc || done == n) {
      op_unlock(&op);
      break;
    }
    rc = op_wait(&op);
  }
  shift_groups_free(&g);
  *done_out = done;
  return rc;
}

/* ================================================================== sample */

/* Where this process last sampled each key (direct-mapped by key): a priority update of keys
 * just sampled (prioritized replay's sample -> learn -> update) finds their records here instead
 * of probing the key index, whose random cache misses are most of an update's cost in a large
 * table. Shared by the process's threads, as a learner iterator samples in one thread and may
 * apply the updates in another. An entry is only a guess, its fields written and read with
 * relaxed atomics (two threads may interleave them): update_round uses it only if the record,
 * read under the table lock, is valid and holds that key (keys are unique in a table). */
#define HINT_BITS 12   /* 4096 ways */
typedef struct sample_hint {
  const rs_table_hdr *th;   /* the table (header address in this process's mapping) */
  uint64_t key;
  uint32_t rec;
} sample_hint;
static sample_hint sample_hints[1u << HINT_BITS];

static inline sample_hint *hint_of(uint64_t key) {
  return &sample_hints[(key * 0x9E3779B97F4A7C15ull) >> (64 - HINT_BITS)];
}

/* Does the item at desc_off have exactly the columns `cols` describe (bytes and dtype)? -1 when
 * its descriptor or chunks lie outside the arena (a damaged segment; rs_item_in_arena). */
static int layout_ok(void *base, uint64_t desc_off, uint32_t ncols, const rs_gather_col *cols) {
  if (!rs_item_in_arena(base, desc_off)) return -1;
  const rs_desc_hdr *d = rs_desc_blob(base, desc_off);
  if (d->ncols != ncols) return 0;
  const rs_desc_col *dc = (const rs_desc_col *)(d + 1);
  const rs_desc_slice *s = rs_desc_slices(d);
  for (uint32_t c = 0; c < ncols; c++) {
    uint64_t bytes = 0, rows = 0;
    const rs_chunk_hdr *ch = NULL;
    for (uint32_t j = dc[c].first_slice, end = j + dc[c].nslices; j < end; j++) {
      ch = rs_chunk(base, s[j].chunk_off);
      if (rs_dtype_is_object(ch->dtype) || memcmp(ch->dtype, cols[c].dtype, sizeof ch->dtype)) return 0;
      bytes += (uint64_t)s[j].nrows * ch->row_bytes;
      rows += s[j].nrows;
    }
    if (bytes != cols[c].col_bytes || ch == NULL) return 0;
    /* The shape as sampled (the slices of a column share the element shape). */
    uint32_t lead = (dc[c].flags & 1u) ? 0 : 1;
    if (cols[c].ndim != ch->ndim + lead) return 0;
    if (lead && cols[c].shape[0] != (int64_t)rows) return 0;
    for (uint32_t k = 0; k < ch->ndim; k++)
      if (cols[c].shape[k + lead] != ch->shape[k]) return 0;
  }
  return 1;
}

#define GATHER_COLS 8   /* up to this many columns, gathers remember where each row starts */
#define MEMO_WAYS 16     /* item blobs a gather round remembers (direct-mapped) */
_Static_assert(GATHER_COLS <= RS_LC_COLS, "a memo way must fit a cross-round cache entry");

/* One round of rs_sample_gather (up to GATHER_COLS columns): the item blobs (one blob serves
 * every item of a descriptor block, each at its own row shift) already checked against cols,
 * where each single-slice column's row 0 of shift 0 is, and the distinct blobs the round pins.
 * Valid only while the round holds its pins (a freed blob's offset can be reused): reset every
 * round. */
typedef struct gather_memo {
  uint64_t blob[MEMO_WAYS];                   /* rs_ref_off of the item reference; 0 = empty */
  const char *row0[MEMO_WAYS][GATHER_COLS];   /* NULL: the column has several slices */
  uint64_t row_bytes[MEMO_WAYS][GATHER_COLS];
  uint64_t max_shift[MEMO_WAYS];              /* largest row shift whose rows lie in the chunks */
  uint32_t npins;
  uint64_t pin_descs[SAMPLE_ROUND];
  uint32_t pins[SAMPLE_ROUND];
  rs_lcache *lc;   /* this thread's cache of blobs checked in earlier rounds, or NULL */
  int defer_rows;  /* the round's rows are requested by the threads that copy them, not here */
} gather_memo;

static inline uint32_t memo_way(uint64_t blob) {
  return (uint32_t)(((blob >> 4) * 0x9E3779B97F4A7C15ull) >> 60);   /* 16 ways */
}

static inline const char *slice_src(void *base, const rs_desc_slice *sl, uint64_t shift,
                                    uint64_t *nb);

/* Keeps memo way w (just checked) in the cross-round cache, unless a size does not fit it. */
static void lc_store(rs_lcache *lc, void *base, const gather_memo *m, uint32_t w, uint32_t ncols) {
  if (m->max_shift[w] > UINT32_MAX) return;
  for (uint32_t c = 0; c < ncols; c++)
    if (m->row_bytes[w][c] > UINT32_MAX) return;
  rs_lc_entry *e = rs_lc_slot(lc, m->blob[w]);
  e->blob = m->blob[w];
  e->frees = lc->frees;
  e->serial = rs_desc_serial(base, m->blob[w]);
  e->version = lc->version;
  e->max_shift = (uint32_t)m->max_shift[w];
  for (uint32_t c = 0; c < ncols; c++) {
    e->col[c].row0 = m->row0[w][c] ? (uint64_t)(m->row0[w][c] - (const char *)base) : 0;
    e->col[c].row_bytes = (uint32_t)m->row_bytes[w][c];
  }
}

/* Fills memo way w from cross-round cache entry e of the same blob. */
static void memo_from_lc(void *base, gather_memo *m, uint32_t w, const rs_lc_entry *e, uint32_t ncols) {
  m->max_shift[w] = e->max_shift;
  for (uint32_t c = 0; c < ncols; c++) {
    m->row0[w][c] = e->col[c].row0 ? (const char *)rs_at(base, e->col[c].row0) : NULL;
    m->row_bytes[w][c] = e->col[c].row_bytes;
  }
  m->blob[w] = e->blob;
}

/* Is the blob of item reference `ref` known to have cols' layout? Checks and remembers it (and
 * lists it for pinning) if not. 0: it has another layout; -1: its rows (at the reference's
 * row shift) or its descriptor lie outside the arena (rs_item_in_arena). */
static int memo_layout_ok(void *base, gather_memo *m, uint64_t ref, uint32_t ncols,
                          const rs_gather_col *cols) {
  uint64_t blob = rs_ref_off(ref);
  uint32_t w = memo_way(blob);
  if (m->blob[w] == blob) return rs_ref_shift(ref) <= m->max_shift[w] ? 1 : -1;
  const rs_lc_entry *e = m->lc ? rs_lc_find(m->lc, base, blob) : NULL;
  if (e) {   /* checked in an earlier round, nothing freed since */
    if (rs_ref_shift(ref) > e->max_shift) return -1;
    memo_from_lc(base, m, w, e, ncols);
    m->pin_descs[m->npins++] = blob;
    return 1;
  }
  int ok = layout_ok(base, blob, ncols, cols);
  if (ok <= 0) return ok;
  const rs_desc_hdr *d = rs_desc_blob(base, blob);
  const rs_desc_col *dc = (const rs_desc_col *)(d + 1);
  const rs_desc_slice *sl = rs_desc_slices(d);
  uint64_t max_shift = UINT64_MAX;   /* rows stay within every chunk's capacity */
  for (uint32_t k = 0; k < d->nslices; k++) {
    /* (capacity may shrink concurrently, rs_chunk_shrink, never below published rows) */
    uint64_t room = __atomic_load_n(&rs_chunk(base, sl[k].chunk_off)->capacity, __ATOMIC_RELAXED) -
                    ((uint64_t)sl[k].row_offset + sl[k].nrows);
    if (room < max_shift) max_shift = room;   /* (layout_ok checked row_offset + nrows <= capacity) */
  }
  if (rs_ref_shift(ref) > max_shift) return -1;
  m->max_shift[w] = max_shift;
  for (uint32_t c = 0; c < ncols; c++) {
    const rs_desc_slice *first = &sl[dc[c].first_slice];
    uint64_t nb;
    const char *row0 = slice_src(base, first, 0, &nb);
    m->row_bytes[w][c] = rs_chunk(base, first->chunk_off)->row_bytes;
    m->row0[w][c] = dc[c].nslices == 1 ? row0 : NULL;
  }
  m->blob[w] = blob;
  m->pin_descs[m->npins++] = blob;   /* (a blob evicted and met again is pinned twice: fine) */
  if (m->lc) lc_store(m->lc, base, m, w, ncols);
  return 1;
}

/* Sampling from a large table is a chain of dependent cache and TLB misses per item: its record,
 * its descriptor, the chunk headers its slices name, its rows. sample_round takes a round's
 * picks through these stages one stage at a time, requesting the next stage of every pick
 * before it reads the first, so that the misses of a stage are in flight together instead of
 * one after another. Every address requested is formed from offsets already bounded (a
 * prefetch of a wild address is harmless, but reading the offset it is formed from is not). */
#define PREFETCH_SLICES 16   /* chunk headers requested per item at most */

/* Stage 3: request the chunk headers (the 3 lines that the layout check reads) of up to
 * PREFETCH_SLICES slices of item reference `ref`. Nothing is read before its bounds are checked:
 * the descriptor header and the slices read must lie inside the arena, and a chunk header's
 * address is formed only when it lies 64-aligned inside the arena. (The layout check validates
 * the whole descriptor afterwards.) */
static inline void prefetch_chunk_hdrs(void *base, uint64_t ref) {
  uint64_t off = rs_ref_off(ref);
  if (off % RS_ALIGN || !rs_arena_span_ok(base, off, sizeof(rs_desc_hdr))) return;
  const rs_desc_hdr *d = rs_at(base, off);
  uint32_t n = d->nslices < PREFETCH_SLICES ? d->nslices : PREFETCH_SLICES;
  uint64_t at = off + sizeof *d + (uint64_t)d->ncols * sizeof(rs_desc_col);
  if (!rs_arena_span_ok(base, at, (uint64_t)n * sizeof(rs_desc_slice))) return;
  const rs_desc_slice *s = rs_at(base, at);
  for (uint32_t q = 0; q < n; q++) {
    uint64_t c = s[q].chunk_off;
    if (c % RS_ALIGN || !rs_arena_span_ok(base, c, sizeof(rs_chunk_hdr))) continue;
    for (uint32_t line = 0; line < sizeof(rs_chunk_hdr); line += RS_ALIGN)
      __builtin_prefetch((const char *)rs_at(base, c) + line, 0);
  }
}

/* Stage 4: request the first line of each slice's rows of item reference `ref`, whose layout
 * the round has checked (rs_item_in_arena: every slice's rows lie in its chunk and the arena). */
static inline void prefetch_item_rows(void *base, uint64_t ref) {
  const rs_desc_hdr *d = rs_desc_blob(base, ref);
  const rs_desc_slice *s = rs_desc_slices(d);
  uint64_t shift = rs_ref_shift(ref);
  uint32_t n = d->nslices < PREFETCH_SLICES ? d->nslices : PREFETCH_SLICES;
  for (uint32_t q = 0; q < n; q++) {
    const rs_chunk_hdr *ch = rs_chunk(base, s[q].chunk_off);
    __builtin_prefetch((const char *)ch + ch->data_offset + ((uint64_t)s[q].row_offset + shift) * ch->row_bytes, 0, 1);
  }
}

/* Stages 2-4 at once for an item whose blob the cross-round cache holds (rs_lc_find bounded its
 * rows up to max_shift): request the first line of each single-slice column's rows. */
static inline void prefetch_cached_rows(void *base, const rs_lc_entry *e, uint32_t ncols, uint64_t ref) {
  uint64_t shift = rs_ref_shift(ref);
  if (shift > e->max_shift) return;
  for (uint32_t c = 0; c < ncols; c++)
    if (e->col[c].row0)
      __builtin_prefetch((const char *)rs_at(base, e->col[c].row0) + shift * e->col[c].row_bytes, 0, 1);
}

/* Take up to `want` samples now (no waiting) into out[]; returns the number taken (0 when the
 * limiter blocks) or a negative error code. With `cols` (rs_sample_gather), only
 * items of that layout are taken: the round stops before the first other one, which stays
 * unsampled (RS_EINVAL if it is the first pick). With `memo` (rs_sample_gather, <= GATHER_COLS
 * columns), the layout is checked once per item blob, and the round pins each distinct blob
 * once (memo->pins) instead of each item (out[].pin is then not set). */
static int sample_round(op_t *op, uint32_t slot, uint32_t want, rs_sample_rec *out,
                        uint32_t ncols, const rs_gather_col *cols, gather_memo *memo) {
  void *base = op->base;
  rs_table_hdr *th = op->th;
  rs_seg_hdr *h = rs_seg(base);
  uint32_t avail = __atomic_load_n(&rs_slots(base)[slot].free_top, __ATOMIC_ACQUIRE);
  uint32_t wanted = want < SAMPLE_ROUND ? want : SAMPLE_ROUND;
  if (avail < wanted && h->growable && rs_slots(base)[slot].pin_cap < h->pins_per_proc) {
    int grc = rs_pins_ensure(base, slot, wanted);   /* grows the pin log; on failure take what there is */
    avail = __atomic_load_n(&rs_slots(base)[slot].free_top, __ATOMIC_ACQUIRE);
    if (avail == 0 && grc) return grc;   /* its message says why the log could not grow */
  }
  if (avail == 0)
    return rs_set_error(RS_EFULL, "process slot %u holds all of its %u pins; release samples "
                        "before sampling more", slot, rs_slots(base)[slot].pin_cap);
  uint32_t limit = want < SAMPLE_ROUND ? want : SAMPLE_ROUND;
  if (limit > avail) limit = avail;

  uint32_t picks[SAMPLE_ROUND], pins[SAMPLE_ROUND];
  double probs[SAMPLE_ROUND];
  uint64_t descs[SAMPLE_ROUND], doomed[SAMPLE_ROUND];
  uint32_t k = 0, ndoomed = 0;
  rs_rec *recs = rs_recs(base, th);
  rs_lcache *lc = memo ? memo->lc : NULL;
  uint8_t cached[SAMPLE_ROUND];   /* pick j's blob is in the cross-round cache (stage 2) */
  const int defer_rows = memo && memo->defer_rows;
  if (memo) {
    memset(memo->blob, 0, sizeof memo->blob);
    memo->npins = 0;
  }
  if (lc) lc->frees = rs_lcache_frees(base);   /* (under the table lock: see layout_cache.h) */
  int32_t mts = th->max_times_sampled;

  /* Without max_times_sampled nothing leaves the table while sampling: pick the whole run at
   * once (batched sum-tree descent). Otherwise pick one at a time, removing as we go. */
  uint32_t batch = mts > 0 ? 1 : limit;
  while (k < limit && th->size > 0) {
    uint32_t m = rs_limiter_sample_budget(th, batch < limit - k ? batch : limit - k);
    if (m == 0) break;
    rs_sel_pick(base, th, 0, m, picks + k, probs + k);
    /* The records are scattered: request them all before the first is needed, then the
     * descriptors (block header + blob) that the layout check, pinning and gathering read. */
    for (uint32_t j = k; j < k + m; j++) {
      __builtin_prefetch(&recs[picks[j]], 1);
      __builtin_prefetch((const char *)&recs[picks[j]] + sizeof(rs_rec) - 1, 1);
    }
    for (uint32_t j = k; j < k + m; j++)
      __builtin_prefetch(rs_at(base, rs_ref_off(recs[picks[j]].desc_off) - RS_ALIGN), 1);
    for (uint32_t j = k; j < k + m; j++) {   /* (a cache entry older than a free reads the header) */
      uint64_t d = recs[picks[j]].desc_off;
      const rs_lc_entry *e = lc ? rs_lc_find(lc, base, rs_ref_off(d)) : NULL;
      cached[j] = e != NULL;
      if (e) {   /* (its descriptor and chunk headers are not read: its rows can be requested now) */
        if (!defer_rows) prefetch_cached_rows(base, e, ncols, d);
        continue;
      }
      __builtin_prefetch(rs_desc_blob(base, d), 0);
      __builtin_prefetch((const char *)rs_desc_blob(base, d) + RS_ALIGN, 0);
    }
    /* Disk tier: descriptors live in the arena file; ask the kernel to read every pick's
     * descriptor page now, so that the layout check below waits for one disk read, not one per
     * item in turn. Only offsets inside the arena are passed (a hint: errors change nothing). */
    if (h->arena_file)
      for (uint32_t j = k; j < k + m; j++) {
        uint64_t off = rs_ref_off(recs[picks[j]].desc_off);
        if (rs_arena_span_ok(base, off, sizeof(rs_desc_hdr)))
          rs_prefetch_file_rows(rs_at(base, off), sizeof(rs_desc_hdr));
      }
    if (cols)
      for (uint32_t j = k; j < k + m; j++)
        if (!lc || !cached[j]) prefetch_chunk_hdrs(base, recs[picks[j]].desc_off);
    int other_layout = 0;
    if (cols) {
      uint32_t good = 0;
      int lok = 1;
      if (memo)
        while (good < m && (lok = memo_layout_ok(base, memo, recs[picks[k + good]].desc_off, ncols, cols)) > 0)
          good++;
      else
        while (good < m && (lok = layout_ok(base, recs[picks[k + good]].desc_off, ncols, cols)) > 0) good++;
      if (good < m) {
        other_layout = 1;
        m = good;
        if (k + m == 0 && lok < 0)
          return rs_set_error(RS_ECORRUPT, "table '%s': sampled item %llu has a descriptor or chunk "
                              "outside the shared-memory arena: the segment is damaged (reverb-shm "
                              "check names what); it was left unsampled", th->name,
                              (unsigned long long)recs[picks[k]].key);
        if (k + m == 0)
          return rs_set_error(RS_EINVAL, "table '%s': sampled item %llu does not have the expected "
                              "column layout (%u columns of the given dtypes and sizes); it was "
                              "left unsampled", th->name,
                              (unsigned long long)recs[picks[k]].key, ncols);
      }
    }
    if (cols && !defer_rows)   /* (every item up to k + m passed the layout check; a blob not
                                * cached in stage 2 was checked in this round) */
      for (uint32_t j = k; j < k + m; j++)
        if (!lc || !cached[j]) prefetch_item_rows(base, recs[picks[j]].desc_off);
    for (uint32_t j = k; j < k + m; j++) {
      rs_rec *rec = &recs[picks[j]];
      rec->times_sampled++;
      if (rec->times_sampled == 1) th->num_unique_samples++;
      th->samples++;
      out[j].key = rec->key;
      sample_hint *hint = hint_of(rec->key);
      __atomic_store_n(&hint->th, th, __ATOMIC_RELAXED);
      __atomic_store_n(&hint->key, rec->key, __ATOMIC_RELAXED);
      __atomic_store_n(&hint->rec, picks[j], __ATOMIC_RELAXED);
      out[j].probability = probs[j];
      out[j].table_size = th->size;
      out[j].priority = rec->priority;
      out[j].times_sampled = rec->times_sampled;
      out[j].desc_off = descs[j] = rec->desc_off;
      if (mts > 0 && rec->times_sampled == mts) {
        doomed[ndoomed++] = rec->desc_off;
        item_unlink(base, th, picks[j]);
        th->deletes++;
      }
    }
    k += m;
    if (other_layout) break;
  }
  if (k == 0) return 0;
  op->dirty = 1;
  op->c->samples += k;
  op->c->expirations += ndoomed;
  /* Pin before dropping the table's references, so removed items' data stays alive. */
  int rc = memo ? rs_pin_descs(base, slot, memo->npins, memo->pin_descs, memo->pins)
                : rs_pin_descs(base, slot, k, descs, pins);
  if (ndoomed) {
    if (rs_alock(base) == RS_OK) {
      for (uint32_t i = 0; i < ndoomed; i++) rs_desc_release(base, doomed[i], 1);
      rs_aunlock(base);
    }
  }
  if (rc) return rc;
  if (!memo)
    for (uint32_t j = 0; j < k; j++) out[j].pin = pins[j];
  return (int)k;
}

int rs_sample(void *base, uint32_t slot, uint32_t table, uint32_t n, int64_t deadline_ns,
              int64_t slice_ns, rs_sample_rec *out, uint32_t *got_io) {
  rs_table_hdr *th = NULL;
  int rc = table_arg(base, table, &th);
  if (rc) return rc;
  if (!got_io) return rs_set_error(RS_EINVAL, "rs_sample: got_io is NULL");
  if (*got_io > n)
    return rs_set_error(RS_EINVAL, "rs_sample: *got_io (%u) exceeds n (%u)", *got_io, n);
  if (n > 0 && !out) return rs_set_error(RS_EINVAL, "rs_sample: out is NULL");
  rc = slot_arg(base, slot);
  if (rc) return rc;
  if (*got_io == n) return RS_OK;

  op_t op;
  op_init(&op, base, table, "sample", &th->sampling_ns, &th->waiting_for_inserts_ns, deadline_ns,
          slice_ns);
  op.c = rs_counters_row(base, slot, table);
  rc = op_lock(&op);
  while (rc == RS_OK && (rc = op_check_open(&op)) == RS_OK) {
    int took = 0;
    while (*got_io < n && (took = sample_round(&op, slot, n - *got_io, out + *got_io, 0, NULL, NULL)) > 0)
      *got_io += (uint32_t)took;
    if (*got_io == n || took < 0) {
      rc = *got_io == n ? RS_OK : took;
      op_unlock(&op);
      break;
    }
    rc = op_wait(&op);
  }
  return rc;
}

/* ================================================================== gather (no lock) */
/* memcpy of nb bytes, with the row sizes of small fixed-size columns inlined. */
static inline void copy_row(uint8_t *dst, const char *src, uint64_t nb) {
  switch (nb) {
    case 1: memcpy(dst, src, 1); break;
    case 2: memcpy(dst, src, 2); break;
    case 4: memcpy(dst, src, 4); break;
    case 8: memcpy(dst, src, 8); break;
    case 12: memcpy(dst, src, 12); break;
    case 16: memcpy(dst, src, 16); break;
    case 24: memcpy(dst, src, 24); break;
    case 32: memcpy(dst, src, 32); break;
    case 64: memcpy(dst, src, 64); break;
    default: memcpy(dst, src, nb);
  }
}

/* Source of a slice's rows in its chunk; `shift` is the item reference's row shift. */
static inline const char *slice_src(void *base, const rs_desc_slice *sl, uint64_t shift,
                                    uint64_t *nb) {
  const rs_chunk_hdr *ch = rs_chunk(base, sl->chunk_off);
  *nb = (uint64_t)sl->nrows * ch->row_bytes;
  return (const char *)ch + ch->data_offset + ((uint64_t)sl->row_offset + shift) * ch->row_bytes;
}


int rs_gather(void *base, uint32_t n, const uint64_t *desc_offs, uint32_t col, uint8_t *out,
              uint64_t out_stride, uint64_t col_bytes) {
  if (n == 0) return RS_OK;
  if (!base || !desc_offs || !out) return rs_set_error(RS_EINVAL, "rs_gather: NULL argument");
  for (uint32_t i = 0; i < n; i++) {
    if (!rs_item_in_arena(base, desc_offs[i]))
      return rs_set_error(RS_ECORRUPT, "rs_gather: item %u (reference %llu) has a descriptor or chunk "
                          "outside the shared-memory arena: the segment is damaged", i,
                          (unsigned long long)desc_offs[i]);
    const rs_desc_hdr *d = rs_desc_blob(base, desc_offs[i]);
    if (col >= d->ncols)
      return rs_set_error(RS_EINVAL, "rs_gather: item %u has %u columns, column %u requested", i,
                          d->ncols, col);
    const rs_desc_col *c = &((const rs_desc_col *)(d + 1))[col];
    const rs_desc_slice *s = rs_desc_slices(d) + c->first_slice;
    uint64_t bytes = 0;
    for (uint32_t j = 0; j < c->nslices; j++) {
      const rs_chunk_hdr *ch = rs_chunk(base, s[j].chunk_off);
      if (rs_dtype_is_object(ch->dtype))
        return rs_set_error(RS_EINVAL, "rs_gather: item %u column %u is an object column (no fixed "
                            "row size); it cannot be gathered", i, col);
      bytes += (uint64_t)s[j].nrows * ch->row_bytes;
    }
    if (bytes != col_bytes)
      return rs_set_error(RS_EINVAL, "rs_gather: item %u column %u holds %llu bytes, expected %llu",
                          i, col, (unsigned long long)bytes, (unsigned long long)col_bytes);
    uint8_t *dst = out + (uint64_t)i * out_stride;
    uint64_t shift = rs_ref_shift(desc_offs[i]);
    for (uint32_t j = 0; j < c->nslices; j++) {
      uint64_t nb;
      const char *src = slice_src(base, &s[j], shift, &nb);
      copy_row(dst, src, nb);
      dst += nb;
    }
  }
  return RS_OK;
}

/* ================================================================== mutate, reset */

#define MUTATE_ROUND 256   /* priority updates looked up and applied together */

/* Priority updates of n <= MUTATE_ROUND keys (unknown keys skipped), in order: the same records,
 * update_seq values, heaps and sum trees as n update_priority calls. Index probes and records
 * are requested all at once, and each sum tree is updated level by level for the whole round.
 * `weights`: NULL, or for each Prioritized selector si the weight of every key's new priority
 * (weights[si][i], computed before the lock: see rs_mutate). Returns the number of keys found. */
static uint32_t update_round(void *base, rs_table_hdr *th, uint32_t n, const uint64_t *keys,
                             const double *prios, const double (*weights)[MUTATE_ROUND]) {
  uint32_t found[MUTATE_ROUND], leaf[MUTATE_ROUND], scratch[MUTATE_ROUND], from[MUTATE_ROUND];
  double prio[MUTATE_ROUND], w[MUTATE_ROUND];
  rs_rec *recs = rs_recs(base, th);
  /* Keys this process just sampled: their records from the hints (checked); others: the index. */
  uint64_t probe_keys[MUTATE_ROUND];
  uint32_t probe_at[MUTATE_ROUND], nprobe = 0;
  for (uint32_t i = 0; i < n; i++) {
    const sample_hint *h = hint_of(keys[i]);
    uint32_t hr = __atomic_load_n(&h->rec, __ATOMIC_RELAXED);
    if (__atomic_load_n(&h->th, __ATOMIC_RELAXED) == th &&
        __atomic_load_n(&h->key, __ATOMIC_RELAXED) == keys[i] && hr < th->cap && recs[hr].valid &&
        recs[hr].key == keys[i]) {
      found[i] = hr;
    } else {
      probe_at[nprobe] = i;
      probe_keys[nprobe++] = keys[i];
    }
  }
  if (nprobe) {
    rs_index_find_many(rs_tindex(base, th), th->index_cap, nprobe, probe_keys, scratch);
    for (uint32_t j = 0; j < nprobe; j++) found[probe_at[j]] = scratch[j];
  }
  uint32_t m = 0;
  for (uint32_t i = 0; i < n; i++)
    if (found[i] != RS_NONE) {
      __builtin_prefetch(&recs[found[i]], 1);
      __builtin_prefetch((const char *)&recs[found[i]] + sizeof(rs_rec) - 1, 1);
      leaf[m] = found[i];
      from[m] = i;
      prio[m++] = prios[i];
    }
  for (uint32_t j = 0; j < m; j++) {
    rs_rec *rec = &recs[leaf[j]];
    rec->priority = prio[j];
    if (th->aux_off) rs_aux(base, th)[leaf[j]].update_seq = th->next_update_seq++;
    for (int si = 0; si < 2; si++)   /* a heap sifts each record at once, as update_priority */
      if (rs_sel_is_heap(th->sel[si].kind)) rs_sel_update(base, th, si, leaf[j]);
  }
  for (int si = 0; si < 2; si++) {
    rs_selector *s = &th->sel[si];
    if (s->kind != RS_SEL_PRIORITIZED) continue;
    for (uint32_t j = 0; j < m; j++)
      w[j] = weights ? weights[si][from[j]] : rs_sel_weight(s->exponent, prio[j]);
    rs_sumtree_set_many(rs_tree(base, s), th->tree_leaves, m, leaf, w, scratch);
  }
  return m;
}

int rs_mutate(void *base, uint32_t table, uint32_t n_upd, const uint64_t *upd_keys,
              const double *upd_prios, uint32_t n_del, const uint64_t *del_keys,
              uint32_t *updated_out, uint32_t *deleted_out) {
  rs_table_hdr *th = NULL;
  int rc = table_arg(base, table, &th);
  if (rc) return rc;
  if ((n_upd && (!upd_keys || !upd_prios)) || (n_del && !del_keys))
    return rs_set_error(RS_EINVAL, "rs_mutate: key/priority arrays must not be NULL when counts > 0");
  rc = check_priorities(th, n_upd, upd_prios, "update");
  if (rc) return rc;
  /* A round's weights (priority**exponent, ~10 ns each) are computed before the lock: the
   * selectors' kinds and exponents never change once the table exists. */
  double weights[2][MUTATE_ROUND];
  int early = n_upd <= MUTATE_ROUND && has_prioritized(th);
  for (int si = 0; early && si < 2; si++)
    if (th->sel[si].kind == RS_SEL_PRIORITIZED)
      for (uint32_t i = 0; i < n_upd; i++) weights[si][i] = rs_sel_weight(th->sel[si].exponent, upd_prios[i]);
  op_t op;
  op_init(&op, base, table, "mutate", NULL, NULL, -1, 0);
  op.c = rs_counters_row(base, rs_counters_self(base), table);
  rc = op_lock(&op);
  if (rc) return rc;
  uint32_t updated = 0, deleted = 0;
  rs_index_entry *ix = rs_tindex(base, th);
  int arena_locked = 0;
  for (uint32_t i = 0; i < n_del; i++) { /* deletes first, as Reverb does */
    uint32_t r = rs_index_find(ix, th->index_cap, del_keys[i]);
    if (r == RS_NONE) continue;
    if (!arena_locked) arena_locked = rs_alock(base) == RS_OK;
    item_remove(base, th, r, arena_locked);
    deleted++;
  }
  if (arena_locked) rs_aunlock(base);
  for (uint32_t b = 0; b < n_upd; b += MUTATE_ROUND)
    updated += update_round(base, th, n_upd - b < MUTATE_ROUND ? n_upd - b : MUTATE_ROUND,
                            upd_keys + b, upd_prios + b, early ? weights : NULL);
  op.dirty = deleted > 0;
  op.c->updates += updated;
  op.c->deletes += deleted;
  op_unlock(&op);
  if (updated_out) *updated_out = updated;
  if (deleted_out) *deleted_out = deleted;
  return RS_OK;
}

/* Reset derived structures to "no items" (records must all be invalid). */
static void clear_structures(void *base, rs_table_hdr *th) {
  rs_index_clear(rs_tindex(base, th), th->index_cap);
  rs_epmap_clear(rs_tepisodes(base, th), th->episodes_cap);
  th->size = 0;
  th->num_episodes = 0;
  th->order_head = th->order_tail = RS_NONE;
  free_list_rebuild(rs_recs(base, th), th);
  for (int si = 0; si < 2; si++) rs_sel_rebuild(base, th, si);
}

int rs_reset(void *base, uint32_t table) {
  rs_table_hdr *th = NULL;
  int rc = table_arg(base, table, &th);
  if (rc) return rc;
  op_t op;
  op_init(&op, base, table, "reset", NULL, NULL, -1, 0);
  op.c = rs_counters_row(base, rs_counters_self(base), table);
  rc = op_lock(&op);
  if (rc) return rc;
  rs_rec *recs = rs_recs(base, th);
  uint32_t *dense = rs_dense(base, th);
  int64_t n = th->size;
  for (int64_t i = 0; i < n; i++) __atomic_store_n(&recs[dense[i]].valid, 0, __ATOMIC_RELEASE);
  int arena_locked = n > 0 && rs_alock(base) == RS_OK;
  for (int64_t i = 0; i < n; i++) rs_desc_release(base, recs[dense[i]].desc_off, arena_locked);
  if (arena_locked) rs_aunlock(base);
  clear_structures(base, th);
  th->inserts = th->samples = th->deletes = 0;
  th->num_deleted_episodes = th->num_unique_samples = 0;
  op.dirty = 1;
  op_unlock(&op);
  return RS_OK;
}

/* ================================================================== introspection */

/* update_seq of record r: its heap tie-break counter, or insert_seq in a table without heaps. */
uint64_t rs_rec_update_seq(void *base, rs_table_hdr *th, uint32_t r) {
  return th->aux_off ? rs_aux(base, th)[r].update_seq : rs_recs(base, th)[r].insert_seq;
}

static void item_rec(void *base, rs_table_hdr *th, uint32_t r, rs_item_rec *out) {
  const rs_rec *rec = &rs_recs(base, th)[r];
  out->key = rec->key;
  out->priority = rec->priority;
  out->times_sampled = rec->times_sampled;
  out->insert_seq = rec->insert_seq;
  out->update_seq = rs_rec_update_seq(base, th, r);
  out->inserted_at_ns = rec->inserted_at_ns;
  out->desc_off = rec->desc_off;
}

int rs_table_items(void *base, uint32_t table, rs_item_rec *out, uint64_t cap, uint64_t *n_out,
                   uint64_t *size_out) {
  rs_table_hdr *th = NULL;
  int rc = query_lock(base, table, n_out && size_out && (!cap || out), "rs_table_items", &th);
  if (rc) return rc;
  rs_rec *recs = rs_recs(base, th);
  uint64_t n = 0;
  for (uint32_t r = th->order_head; r != RS_NONE && n < cap; r = recs[r].next) item_rec(base, th, r, &out[n++]);
  *n_out = n;
  *size_out = (uint64_t)th->size;
  rs_tunlock(base, table);
  return RS_OK;
}

int rs_table_get(void *base, uint32_t table, uint64_t key, rs_item_rec *out) {
  rs_table_hdr *th = NULL;
  int rc = query_lock(base, table, out != NULL, "rs_table_get", &th);
  if (rc) return rc;
  uint32_t r = rs_index_find(rs_tindex(base, th), th->index_cap, key);
  if (r != RS_NONE) item_rec(base, th, r, out);
  rs_tunlock(base, table);
  if (r == RS_NONE)
    return rs_set_error(RS_ENOTFOUND, "table '%s' has no item with key %llu", th->name,
                        (unsigned long long)key);
  return RS_OK;
}

int rs_table_get_stats(void *base, uint32_t table, rs_table_stats *out) {
  rs_table_hdr *th = NULL;
  int rc = query_lock(base, table, out != NULL, "rs_table_get_stats", &th);
  if (rc) return rc;
  memset(out, 0, sizeof *out);
  out->max_size = th->max_size;
  out->max_times_sampled = th->max_times_sampled;
  out->sampler_kind = th->sel[0].kind;
  out->remover_kind = th->sel[1].kind;
  out->sampler_exponent = th->sel[0].exponent;
  out->remover_exponent = th->sel[1].exponent;
  out->samples_per_insert = th->samples_per_insert;
  out->min_size_to_sample = th->min_size_to_sample;
  out->min_diff = th->min_diff;
  out->max_diff = th->max_diff;
  out->size = th->size;
  out->inserts = th->inserts;
  out->samples = th->samples;
  out->deletes = th->deletes;
  out->num_episodes = th->num_episodes;
  out->num_deleted_episodes = th->num_deleted_episodes;
  out->num_unique_samples = th->num_unique_samples;
  out->closed = is_closed(base, th);
  out->inserting_ns = th->inserting_ns;
  out->sampling_ns = th->sampling_ns;
  out->waiting_for_sampling_ns = th->waiting_for_sampling_ns;
  out->waiting_for_inserts_ns = th->waiting_for_inserts_ns;
  out->repairs = th->repairs;
  if (th->sel[0].kind == RS_SEL_PRIORITIZED)
    out->sampler_total_weight = rs_sumtree_total(rs_tree(base, &th->sel[0]));
  rs_tunlock(base, table);
  return RS_OK;
}

static int limiter_query(void *base, uint32_t table, int64_t n, int sample) {
  rs_table_hdr *th = NULL;
  int rc = query_lock(base, table, 1, sample ? "rs_can_sample" : "rs_can_insert", &th);
  if (rc) return rc;
  int yes = n < 0 ? rs_set_error(RS_EINVAL, "table '%s': n must be >= 0, got %lld", th->name,
                                 (long long)n)
          : sample ? rs_limiter_can_sample(th, n) : rs_limiter_can_insert(th, n);
  rs_tunlock(base, table);
  return yes;
}

int rs_can_insert(void *base, uint32_t table, int64_t n) { return limiter_query(base, table, n, 0); }
int rs_can_sample(void *base, uint32_t table, int64_t n) { return limiter_query(base, table, n, 1); }

/* ================================================================== repair */

static int by_insert_seq(const void *a, const void *b, void *recs_) {
  const rs_rec *recs = recs_;
  uint64_t x = recs[*(const uint32_t *)a].insert_seq, y = recs[*(const uint32_t *)b].insert_seq;
  return x < y ? -1 : x > y;
}

void rs_table_repair(void *base, uint32_t t) {
  rs_table_hdr *th = rs_table(base, t);
  rs_rec *recs = rs_recs(base, th);
  uint32_t *dense = rs_dense(base, th);
  rs_index_entry *ix = rs_tindex(base, th);
  rs_index_clear(ix, th->index_cap);
  /* valid records, de-duplicated by key (a duplicate cannot be committed, but be safe) */
  uint32_t n = 0;
  uint64_t max_ins = 0, max_upd = 0;
  for (uint32_t r = 0; r < th->cap; r++) {
    if (!recs[r].valid) continue;
    if (rs_index_find(ix, th->index_cap, recs[r].key) != RS_NONE) {
      recs[r].valid = 0;
      continue;
    }
    rs_index_put(ix, th->index_cap, recs[r].key, r);
    dense[n++] = r;
    if (recs[r].insert_seq + 1 > max_ins) max_ins = recs[r].insert_seq + 1;
    if (th->aux_off && rs_aux(base, th)[r].update_seq + 1 > max_upd) max_upd = rs_aux(base, th)[r].update_seq + 1;
  }
  free_list_rebuild(recs, th);
  qsort_r(dense, n, sizeof *dense, by_insert_seq, recs);
  th->order_head = th->order_tail = RS_NONE;
  for (uint32_t i = 0; i < n; i++) {
    rs_rec *rec = &recs[dense[i]];
    rec->dense_pos = i;
    rec->prev = i ? dense[i - 1] : RS_NONE;
    rec->next = i + 1 < n ? dense[i + 1] : RS_NONE;
  }
  if (n) {
    th->order_head = dense[0];
    th->order_tail = dense[n - 1];
  }
  th->size = n;
  for (int si = 0; si < 2; si++) rs_sel_rebuild(base, th, si);
  rs_episode_entry *em = rs_tepisodes(base, th);
  rs_epmap_clear(em, th->episodes_cap);
  th->num_episodes = 0;
  ep_ctx ctx = {th, em, 0};
  for (uint32_t i = 0; i < n; i++)
    rs_item_each_episode(base, recs[dense[i]].desc_off, ep_add, &ctx);
  if (th->next_insert_seq < max_ins) th->next_insert_seq = max_ins;
  if (th->next_update_seq < max_upd) th->next_update_seq = max_upd;
  if (th->inserts < th->size) th->inserts = th->size; /* died between commit and inserts++ */
  th->deletes = th->inserts - th->size;
  if (th->samples < 0) th->samples = 0;
  th->woken = 0;   /* (a dead owner's mark of a wake-up on its way: op_publish) */
  /* died between committing an overflow insert and the remover's deletion: finish it */
  while ((uint64_t)th->size > th->max_size) {
    uint32_t victim;
    double prob;
    rs_sel_pick(base, th, 1, 1, &victim, &prob);
    item_remove(base, th, victim, 0);
  }
}

/* ================================================================== batched fast paths */

/* Copy every column of `n` pinned items (recs) into cols[] at rows first..first+n and their info
 * into info at the same rows. Validates each item's layout against cols[] as it goes. */
/* The five info arrays of rs_sample_gather's `info` buffer for a batch of n items. */
typedef struct sample_info {
  uint64_t *key;
  double *probability;
  int64_t *table_size;
  double *priority;
  int32_t *times_sampled;
} sample_info;

static sample_info sample_info_at(void *info, uint32_t n) {
  uint64_t *w = info;
  sample_info si = {w, (double *)(w + n), (int64_t *)(w + 2ull * n), (double *)(w + 3ull * n),
                    (int32_t *)(w + 4ull * n)};
  return si;
}


/* Rows of at least GATHER_PAGE bytes (frames) are copied page by page with the copy of each page
 * requesting the first PAGE_LINES lines of the page PAGE_AHEAD pages further on, over the round's
 * large rows in copy order. Shared-memory mappings have 4 KiB pages (no transparent huge pages
 * for shmem here): the hardware prefetchers stop at every 4 KiB boundary and a page's first
 * access is a TLB miss, so each page of a random row starts with a full miss. Requesting pages
 * ahead starts those misses (page walk, first lines) early. Measured on W5's 84x84x4 frames
 * (4 KiB-paged /dev/shm source, loaded machine): 7.1 -> 10.4 GB/s (p90 of 40 rounds) for 3 pages
 * ahead x 8 lines; 1 page or 4 lines were slower, 16 lines or 4-6 pages the same. */
#define GATHER_PAGE 4096u
#define PAGE_AHEAD 3
#define PAGE_LINES 8

/* The next page start to request among rows [i, n) x columns of the round's large single-slice
 * rows (src[i * ncols + c] non-NULL and cols[c].col_bytes >= GATHER_PAGE), in copy order. */
typedef struct page_cursor {
  const char *const *src;
  const rs_gather_col *cols;
  uint32_t n, ncols, i, c;
  const char *at, *end;   /* next page start to request in row (i, c), end of that row */
} page_cursor;

static void cursor_start(page_cursor *pc, const char *const *src, const rs_gather_col *cols,
                         uint32_t first, uint32_t n, uint32_t ncols) {
  pc->src = src, pc->cols = cols, pc->n = n, pc->ncols = ncols, pc->i = first, pc->c = 0;
  pc->at = pc->end = NULL;
}

/* Requests the next page of the cursor (nothing once past the last large row). */
static inline void request_page(page_cursor *pc) {
  while (pc->at >= pc->end) {   /* on to the next large row */
    if (pc->i >= pc->n) return;
    uint32_t i = pc->i, c = pc->c;
    if (++pc->c == pc->ncols) pc->c = 0, pc->i++;
    const char *s = pc->src[i * pc->ncols + c];
    if (s && pc->cols[c].col_bytes >= GATHER_PAGE) pc->at = s, pc->end = s + pc->cols[c].col_bytes;
  }
  for (uint32_t l = 0; l < PAGE_LINES && pc->at + l * RS_ALIGN < pc->end; l++)
    __builtin_prefetch(pc->at + l * RS_ALIGN, 0, 1);
  pc->at = (const char *)(((uintptr_t)pc->at & ~(uintptr_t)(GATHER_PAGE - 1)) + GATHER_PAGE);
}

/* memcpy of a large row, one source page at a time, each page requesting one more ahead. */
static void copy_paged(uint8_t *dst, const char *s, uint64_t nb, page_cursor *pc) {
  const char *end = s + nb;
  while (s < end) {
    const char *next = (const char *)(((uintptr_t)s & ~(uintptr_t)(GATHER_PAGE - 1)) + GATHER_PAGE);
    uint64_t len = (uint64_t)((next < end ? next : end) - s);
    request_page(pc);
    memcpy(dst, s, len);
    dst += len, s += len;
  }
}

/* Requests the first line of a row of `nb` (< GATHER_PAGE) bytes at `src` (NULL: none) and, if
 * it runs into the next page, that page's first line (its TLB miss starts now, too). */
static inline void request_row(const char *src, uint64_t nb) {
  if (!src) return;
  __builtin_prefetch(src, 0, 1);
  const char *next = (const char *)(((uintptr_t)src & ~(uintptr_t)(GATHER_PAGE - 1)) + GATHER_PAGE);
  if (next < src + nb) __builtin_prefetch(next, 0, 1);
}

/* The copy of one gather round, shared by rs_run_units between the caller and the helper. */
typedef struct gather_job {
  void *base;
  const rs_sample_rec *recs;
  uint32_t first, ncols, keep;
  uint32_t paged;           /* keep, and some column has rows of >= GATHER_PAGE bytes */
  uint32_t spread;          /* keep, shared, not paged: each range requests its own rows (the
                             * misses of a round start on both cores, not all on the caller's) */
  const rs_gather_col *cols;
  const char *const *src;   /* src[i * ncols + c]: row of a single-slice column (keep only) */
  const sample_info *info;
} gather_job;

/* Copies every column and the info of the round's items [begin, end) to their rows; `paged`
 * is g->paged (a constant where inlined: rounds of small rows get a loop without the cursor). */
static inline __attribute__((always_inline)) void copy_items(const gather_job *g, uint32_t begin,
                                                             uint32_t end, int paged) {
  void *base = g->base;
  const rs_gather_col *cols = g->cols;
  uint32_t ncols = g->ncols;
  page_cursor pc;
  cursor_start(&pc, g->src, cols, begin, paged ? end : begin, ncols);
  if (paged)
    for (int a = 0; a < PAGE_AHEAD; a++) request_page(&pc);
  if (!paged && g->spread)
    for (uint32_t i = begin; i < end; i++)
      for (uint32_t c = 0; c < ncols; c++) request_row(g->src[i * ncols + c], cols[c].col_bytes);
  for (uint32_t i = begin; i < end; i++) {
    uint64_t row = (uint64_t)g->first + i;
    uint64_t shift = rs_ref_shift(g->recs[i].desc_off);
    const rs_desc_hdr *d = NULL;
    for (uint32_t c = 0; c < ncols; c++) {
      uint8_t *dst = cols[c].out + row * cols[c].stride;
      const char *src = g->keep ? g->src[i * ncols + c] : NULL;
      if (src) {   /* one slice of exactly col_bytes */
        if (paged && cols[c].col_bytes >= GATHER_PAGE)
          copy_paged(dst, src, cols[c].col_bytes, &pc);
        else
          copy_row(dst, src, cols[c].col_bytes);
        continue;
      }
      if (!d) d = rs_desc_blob(base, g->recs[i].desc_off);
      const rs_desc_col *dc = (const rs_desc_col *)(d + 1);
      const rs_desc_slice *s = rs_desc_slices(d);
      for (uint32_t j = dc[c].first_slice, e = j + dc[c].nslices; j < e; j++) {
        uint64_t nb;
        const char *p = slice_src(base, &s[j], shift, &nb);
        copy_row(dst, p, nb);
        dst += nb;
      }
    }
    const sample_info *info = g->info;
    info->key[row] = g->recs[i].key;
    info->probability[row] = g->recs[i].probability;
    info->table_size[row] = g->recs[i].table_size;
    info->priority[row] = g->recs[i].priority;
    info->times_sampled[row] = g->recs[i].times_sampled;
  }
}

/* copy_items as an rs_units_fn (rs_run_units). */
static void gather_items(void *arg, uint32_t begin, uint32_t end) {
  const gather_job *g = arg;
  copy_items(g, begin, end, (int)g->paged);
}

/* A round of rows in memory (not in disk-tier files) is shared with the gather helper thread,
 * GATHER_GRAIN_BYTES of items per claim (at least one item), when its copy is expected to take
 * long enough to repay handing work over (waking the helper, claiming grains): from
 * GATHER_SHARE_BYTES on, and from GATHER_SHARE_MIN_BYTES on when this thread's recent rounds
 * copied slowly enough that this one is expected to take GATHER_SHARE_NS or more. Rows that
 * miss every cache (a large table on 4 KiB pages: a TLB miss and a DRAM latency per row, the
 * misses in flight bounded by one core's fill buffers and page walkers) copy several times
 * slower than rows in the cache, and a second core nearly doubles the misses in flight.
 * Measured on L2 (64 windows of 80 steps, 225 KB a round; 2-core VM, loaded): sharing every
 * round was 1.20x the speed at 1e7 table steps (copy ~150 ns/KiB alone) but 0.91x at 1e5
 * (rows in the cache, ~52 ns/KiB: the hand-over cost more than it saved). Rounds shared for
 * being slow ask the helper to linger GATHER_LINGER_NS for the next one (gather_thread.c), and
 * have their rows requested by the thread that copies them (gather_job.spread). */
#define GATHER_SHARE_BYTES (256u << 10)
#define GATHER_SHARE_MIN_BYTES (128u << 10)
#define GATHER_SHARE_NS 20000u
#define GATHER_LINGER_NS 60000u
#define GATHER_GRAIN_BYTES (64u << 10)
#define GATHER_GRAINS 8   /* grains per shared round at least (when it has that many items):
                           * fewer leave one thread waiting for the other's last grain */

/* This thread's copy time per KiB of its gather rounds of >= GATHER_SHARE_MIN_BYTES in memory
 * (ns; of a shared round, the time until the round was done per KiB this thread copied itself);
 * 0 until one was timed. A moving average that follows faster rounds at once (halfway) and
 * slower ones over ~16 rounds: a round slowed by preemption or a busy machine (the copy of rows
 * in the cache taking 2x) moves it little, rounds that are all slow (rows that miss) move it
 * all the way. */
static __thread uint32_t copy_ns_per_kib;

static uint32_t share_ns = GATHER_SHARE_NS;   /* rs_set_gather_share_ns */

int rs_set_gather_share_ns(uint32_t ns, uint32_t *previous) {
  uint32_t was = __atomic_exchange_n(&share_ns, ns, __ATOMIC_RELAXED);
  if (previous) *previous = was;
  return RS_OK;
}

/* Whether a round of `bytes` bytes of rows in memory is shared with the gather helper. */
static inline int share_round(uint64_t bytes) {
  if (bytes >= GATHER_SHARE_BYTES) return 1;
  uint32_t ns = __atomic_load_n(&share_ns, __ATOMIC_RELAXED);
  return bytes >= GATHER_SHARE_MIN_BYTES && ns != UINT32_MAX && (bytes >> 10) * copy_ns_per_kib >= ns;
}

/* Folds a timed round into copy_ns_per_kib: `bytes` copied by this thread in `ns`. */
static void note_copy_rate(uint64_t bytes, int64_t ns) {
  if (bytes < 1024 || ns <= 0) return;
  uint64_t sample = (uint64_t)ns * 1024 / bytes;
  if (sample > UINT32_MAX / 2) sample = UINT32_MAX / 2;
  int64_t now = copy_ns_per_kib, diff = (int64_t)sample - now;
  copy_ns_per_kib = now ? (uint32_t)(now + (diff < 0 ? diff / 2 : diff / 16)) : (uint32_t)sample;
}

/* Whether a round of up to `want` items of cols' layout (<= GATHER_COLS columns) is expected to
 * be shared with rows smaller than GATHER_PAGE: its rows are then requested by the thread that
 * copies them (gather_job.spread), not by sample_round. */
static int spread_round(void *base, uint32_t ncols, const rs_gather_col *cols, uint32_t want) {
  uint64_t item_bytes = 0;
  for (uint32_t c = 0; c < ncols; c++) {
    if (cols[c].col_bytes >= GATHER_PAGE) return 0;
    item_bytes += cols[c].col_bytes;
  }
  return !rs_seg(base)->arena_file && share_round(item_bytes * (want < SAMPLE_ROUND ? want : SAMPLE_ROUND));
}

/* Where the rows of the round's items are: src[i * ncols + c] for a single-slice column of item i
 * when `keep` (from the memo of the item's blob when it has one), NULL for one of several slices.
 * Every item's layout was checked against cols by sample_round (descriptors and chunk headers
 * never change once written). Rows of random items are cache misses: with `request` (a
 * constant where inlined) the first line of every row is requested here, up front; without,
 * only the first slice of a column of several (the copy requests the others: gather_job.spread).
 * `disk`: also asks the kernel to read the rows now. */
static inline __attribute__((always_inline)) void find_rows(void *base, const rs_sample_rec *recs,
                                                            uint32_t n, uint32_t ncols,
                                                            const rs_gather_col *cols,
                                                            const gather_memo *memo, int keep,
                                                            int disk, const char **src, int request) {
  for (uint32_t i = 0; i < n; i++) {
    uint64_t blob = rs_ref_off(recs[i].desc_off);
    uint32_t w = memo_way(blob);
    const rs_lc_entry *e = memo && memo->blob[w] != blob && memo->lc ?   /* (evicted from the memo) */
        rs_lc_find(memo->lc, base, blob) : NULL;
    if (e && rs_ref_shift(recs[i].desc_off) > e->max_shift) e = NULL;
    if (e || (memo && memo->blob[w] == blob)) {
      uint64_t shift = rs_ref_shift(recs[i].desc_off);
      for (uint32_t c = 0; c < ncols; c++) {
        const char *p = !e ? memo->row0[w][c] : e->col[c].row0 ? (const char *)rs_at(base, e->col[c].row0) : NULL;
        if (p) {
          p += shift * (e ? e->col[c].row_bytes : memo->row_bytes[w][c]);
          if (request) __builtin_prefetch(p, 0, 1);
          if (disk) rs_prefetch_file_rows(p, cols[c].col_bytes);
        }
        src[i * ncols + c] = p;
      }
      continue;
    }
    const rs_desc_hdr *d = rs_desc_blob(base, recs[i].desc_off);
    const rs_desc_col *dc = (const rs_desc_col *)(d + 1);
    const rs_desc_slice *s = rs_desc_slices(d);
    uint64_t shift = rs_ref_shift(recs[i].desc_off);
    for (uint32_t c = 0; c < ncols; c++) {
      uint64_t nb;
      const char *p = slice_src(base, &s[dc[c].first_slice], shift, &nb);
      if (request || dc[c].nslices != 1)
        __builtin_prefetch(p, 0, 1);   /* hint L2: measured ~5% faster than L1 on W3 here */
      if (disk) rs_prefetch_file_rows(p, nb);
      if (keep) src[i * ncols + c] = dc[c].nslices == 1 ? p : NULL;
    }
  }
}

static void gather_round(void *base, const rs_sample_rec *recs, uint32_t n, uint32_t first,
                         uint32_t ncols, const rs_gather_col *cols, const sample_info *info,
                         const gather_memo *memo) {
  const char *src[SAMPLE_ROUND * GATHER_COLS];
  int keep = ncols <= GATHER_COLS;
  int disk = rs_seg(base)->arena_file;
  gather_job job = {base, recs, first, ncols, (uint32_t)keep, 0, 0, cols, src, info};
  uint64_t item_bytes = 0;
  for (uint32_t c = 0; c < ncols; c++) {
    item_bytes += cols[c].col_bytes;
    if (keep && cols[c].col_bytes >= GATHER_PAGE) job.paged = 1;
  }
  uint64_t bytes = item_bytes * n;
  int share = !disk && share_round(bytes);
  job.spread = share && keep && !job.paged;
  if (job.spread)
    find_rows(base, recs, n, ncols, cols, memo, keep, disk, src, 0);
  else
    find_rows(base, recs, n, ncols, cols, memo, keep, disk, src, 1);
  int timed = !disk && bytes >= GATHER_SHARE_MIN_BYTES;
  int64_t t0 = timed ? rs_now_ns() : 0;
  uint32_t mine = n;   /* items this thread copied */
  if (share) {
    uint64_t grain = item_bytes ? GATHER_GRAIN_BYTES / item_bytes : n;
    if (grain > n / GATHER_GRAINS) grain = n / GATHER_GRAINS;
    mine = rs_run_units(gather_items, &job, n, grain ? (uint32_t)(grain < n ? grain : n) : 1,
                        bytes >= GATHER_SHARE_BYTES ? 0 : GATHER_LINGER_NS);
  } else {
    if (job.paged)
      copy_items(&job, 0, n, 1);
    else
      copy_items(&job, 0, n, 0);
  }
  if (timed) note_copy_rate(item_bytes * mine, rs_now_ns() - t0);
}

int rs_sample_gather(void *base, uint32_t slot, uint32_t table, uint32_t n, uint32_t wait_n,
                     int64_t deadline_ns, int64_t slice_ns, uint32_t ncols,
                     const rs_gather_col *cols, void *info, uint32_t *got_io) {
  rs_table_hdr *th = NULL;
  int rc = table_arg(base, table, &th);
  if (rc) return rc;
  if (!got_io || !info || (uintptr_t)info % 8)
    return rs_set_error(RS_EINVAL, "rs_sample_gather: got_io must be non-NULL and info non-NULL and "
                        "8-byte aligned");
  if (*got_io > n || wait_n > n)
    return rs_set_error(RS_EINVAL, "rs_sample_gather: *got_io (%u) and wait_n (%u) must not exceed "
                        "n (%u)", *got_io, wait_n, n);
  if (ncols == 0 || !cols) return rs_set_error(RS_EINVAL, "rs_sample_gather: expected >= 1 column");
  for (uint32_t c = 0; c < ncols; c++)
    if (!cols[c].out || cols[c].stride < cols[c].col_bytes || !memchr(cols[c].dtype, 0, sizeof cols[c].dtype) ||
        cols[c].ndim > 9)
      return rs_set_error(RS_EINVAL, "rs_sample_gather: column %u needs a non-NULL out, stride >= "
                          "col_bytes (%llu >= %llu), a NUL-terminated dtype and ndim <= 9", c,
                          (unsigned long long)cols[c].stride, (unsigned long long)cols[c].col_bytes);
  rc = slot_arg(base, slot);
  if (rc) return rc;
  if (*got_io == n) return RS_OK;

  rs_sample_rec recs[SAMPLE_ROUND];
  gather_memo memo_space, *memo = ncols <= GATHER_COLS ? &memo_space : NULL;
  uint64_t item_bytes = 0, first_round = n - *got_io < SAMPLE_ROUND ? n - *got_io : SAMPLE_ROUND;
  for (uint32_t c = 0; c < ncols; c++) item_bytes += cols[c].col_bytes;
  if (!rs_seg(base)->arena_file && share_round(item_bytes * first_round))
    rs_gather_prewake();   /* it wakes while this thread samples */
  sample_info si = sample_info_at(info, n);
  op_t op;
  op_init(&op, base, table, "sample", &th->sampling_ns, &th->waiting_for_inserts_ns, deadline_ns,
          slice_ns);
  op.c = rs_counters_row(base, slot, table);
  if (memo) memo->lc = rs_lcache_for(base, ncols, cols);
  rc = op_lock(&op);
  while (rc == RS_OK && (rc = op_check_open(&op)) == RS_OK) {
    if (memo) memo->defer_rows = spread_round(base, ncols, cols, n - *got_io);
    int took = sample_round(&op, slot, n - *got_io, recs, ncols, cols, memo);
    if (took == 0 && *got_io >= wait_n) { /* enough: take no more than what is ready */
      op_unlock(&op);
      break;
    }
    if (took == 0) {
      rc = op_wait(&op);
      continue;
    }
    op_unlock(&op);
    if (took < 0) {
      rc = took;
      break;
    }
    /* Pinned: copy the payload with no lock held, then drop the pins. */
    gather_round(base, recs, (uint32_t)took, *got_io, ncols, cols, &si, memo);
    if (memo) {
      rc = rs_unpin_fresh(base, slot, memo->npins, memo->pins);
    } else {
      uint32_t pins[SAMPLE_ROUND];
      for (int j = 0; j < took; j++) pins[j] = recs[j].pin;
      rc = rs_unpin_fresh(base, slot, (uint32_t)took, pins);
    }
    if (rc) break;
    *got_io += (uint32_t)took;
    if (*got_io == n) break;
    rc = op_lock(&op);
  }
  return rc;
}

#define DESC_STACK_BYTES 4096   /* descriptors of rs_insert_slices built on the stack up to this */

int rs_insert_slices(void *base, uint32_t slot, uint32_t table, uint32_t n, const uint64_t *keys,
                     const double *priorities, uint32_t ncols, const rs_desc_slice *slices,
                     const uint32_t *col_flags, int64_t deadline_ns, int64_t slice_ns,
                     uint32_t *done_out) {
  if (!done_out) return rs_set_error(RS_EINVAL, "rs_insert_slices: done_out is NULL");
  *done_out = 0;
  if (n == 0) return RS_OK;
  if (!priorities) return rs_set_error(RS_EINVAL, "rs_insert_slices: priorities is NULL");
  if (ncols == 0 || ncols > (1u << 16) || !slices || !col_flags)
    return rs_set_error(RS_EINVAL, "rs_insert_slices: expected 1..65536 columns with slices and "
                        "col_flags, got %u", ncols);
  uint64_t item = sizeof(rs_desc_hdr) + (uint64_t)ncols * (sizeof(rs_desc_col) + sizeof(rs_desc_slice));
  uint64_t total = item * n;
  if (total / n != item || total > (1ull << 32))
    return rs_set_error(RS_EINVAL, "rs_insert_slices: %u items of %u columns exceed 4 GiB of "
                        "descriptors", n, ncols);
  uint8_t stack_blob[DESC_STACK_BYTES];
  uint64_t stack_offs[DESC_STACK_BYTES / 64 + 1], stack_keys[DESC_STACK_BYTES / 64];
  int small = total <= sizeof stack_blob && n < sizeof stack_keys / sizeof *stack_keys;
  uint8_t *blob = small ? stack_blob : malloc(total);
  uint64_t *offs = small ? stack_offs : malloc((n + 1ull) * sizeof *offs);
  uint64_t *random_keys = keys ? NULL : small ? stack_keys : malloc(n * sizeof *random_keys);
  if (!blob || !offs || (!keys && !random_keys)) {
    if (!small) { free(blob); free(offs); free(random_keys); }
    return rs_set_error(RS_ESYS, "rs_insert_slices: out of memory for %llu descriptor bytes",
                        (unsigned long long)total);
  }
  if (!keys) {
    for (uint32_t i = 0; i < n; i++) random_keys[i] = rs_rand_u64();
    keys = random_keys;
  }
  for (uint32_t i = 0; i < n; i++) {
    uint8_t *p = blob + item * i;
    rs_desc_hdr *d = (rs_desc_hdr *)p;
    d->ncols = d->nslices = ncols;
    rs_desc_col *dc = (rs_desc_col *)(d + 1);
    for (uint32_t c = 0; c < ncols; c++) {
      dc[c].first_slice = c;
      dc[c].nslices = 1;
      dc[c].flags = col_flags[c] & 1u;
      dc[c]._pad = 0;
    }
    memcpy(dc + ncols, slices + (uint64_t)i * ncols, ncols * sizeof *slices);
    offs[i] = item * i;
  }
  offs[n] = total;
  int rc = rs_insert(base, slot, table, n, keys, priorities, blob, offs, deadline_ns, slice_ns,
                     done_out);
  if (!small) {
    free(blob);
    free(offs);
    free(random_keys);
  }
  return rc;
}

/* ================================================================== priority checks (no state) */
double rs_table_priority_bound(void *base, uint32_t table) {
  rs_table_hdr *th = NULL;
  if (table_arg(base, table, &th)) return NAN;
  double bound = INFINITY;
  for (int si = 0; si < 2; si++) {
    const rs_selector *s = &th->sel[si];
    if (s->kind != RS_SEL_PRIORITIZED || !(s->exponent > 0)) continue;
    double b = pow(rs_sel_weight_cap(th->tree_leaves), 1.0 / s->exponent);
    if (b < bound) bound = b;
  }
  return bound;
}

int rs_check_priorities(void *base, uint32_t table, uint32_t n, const double *priorities) {
  rs_table_hdr *th = NULL;
  int rc = table_arg(base, table, &th);
  if (rc) return rc;
  if (n && !priorities) return rs_set_error(RS_EINVAL, "rs_check_priorities: priorities is NULL");
  return check_priorities(th, n, priorities, "insert");
}
