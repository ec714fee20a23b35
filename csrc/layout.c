/* Segment layout: size planning, initialisation, validation on attach, info, close, and the
 * table directory (find by name, name, config blob).
 *
 *   rs_seg_hdr | u64 table offsets | rs_slot[max_procs] | counters | table regions | arena |
 *   pin logs
 *
 * Every part starts on a 64-byte boundary (pin logs on a page). The plan is a pure function of
 * the configuration, so rs_segment_size(_ex) and rs_segment_init(_ex) always agree. A fixed
 * segment (rs_segment_init) has arena_max = arena_bytes and every pin log laid out at once; a
 * growable one (rs_segment_init_ex) reserves pages as its arena and pin logs grow (arena.c).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <string.h>

#include "counters.h"
#include "layout_cache.h"
#include "rs_internal.h"

#define MAX_TABLES 1024u
#define MAX_PROCS 4096u
#define MIN_PINS 16u
#define MAX_PINS (1u << 20)
/* Record capacity (max_size + 1) and the power-of-two index/episode capacities (>= 2 * cap)
 * must fit in uint32. */

#define PAGE 4096ull

typedef struct plan {
  uint64_t tables_off, slots_off, pins_off, pin_stride, counters_off, regions_off, arena_off,
      arena_size, arena_max, total;
} plan;

static int check_config(const rs_table_config *c, uint32_t i) {
  if (!memchr(c->name, 0, sizeof c->name) || !c->name[0])
    return rs_set_error(RS_EINVAL, "table %u: name must be 1..63 bytes and NUL-terminated", i);
  if (c->max_size < 1 || c->max_size > RS_MAX_TABLE_SIZE)
    return rs_set_error(RS_EINVAL, "table '%s': max_size %llu, expected 1..%llu", c->name,
                        (unsigned long long)c->max_size, (unsigned long long)RS_MAX_TABLE_SIZE);
  if (c->sampler_kind < RS_SEL_UNIFORM || c->sampler_kind > RS_SEL_MAXHEAP)
    return rs_set_error(RS_EINVAL, "table '%s': sampler kind %d, expected %d..%d", c->name, c->sampler_kind,
                        RS_SEL_UNIFORM, RS_SEL_MAXHEAP);
  if (c->remover_kind < RS_SEL_UNIFORM || c->remover_kind > RS_SEL_MAXHEAP)
    return rs_set_error(RS_EINVAL, "table '%s': remover kind %d, expected %d..%d", c->name, c->remover_kind,
                        RS_SEL_UNIFORM, RS_SEL_MAXHEAP);
  if (!(c->samples_per_insert > 0) || !isfinite(c->samples_per_insert))
    return rs_set_error(RS_EINVAL, "table '%s': samples_per_insert %g, expected a finite value > 0", c->name,
                        c->samples_per_insert);
  if (c->min_size_to_sample < 1)
    return rs_set_error(RS_EINVAL, "table '%s': min_size_to_sample %lld, expected >= 1", c->name,
                        (long long)c->min_size_to_sample);
  if (isnan(c->min_diff) || isnan(c->max_diff))
    return rs_set_error(RS_EINVAL, "table '%s': min_diff/max_diff must not be NaN", c->name);
  if (c->blob_len > RS_MAX_BLOB)
    return rs_set_error(RS_EINVAL, "table '%s': config blob of %u bytes, expected <= %u", c->name, c->blob_len,
                        RS_MAX_BLOB);
  if (c->blob_len && !c->blob)
    return rs_set_error(RS_EINVAL, "table '%s': config blob pointer is NULL with length %u", c->name, c->blob_len);
  return RS_OK;
}

static int make_plan(const rs_table_config *cfgs, uint32_t ntables, uint32_t max_procs, uint32_t pins_per_proc,
                     uint64_t arena_bytes, uint64_t arena_max, plan *p, uint64_t *table_offs) {
  if (!cfgs || ntables < 1 || ntables > MAX_TABLES)
    return rs_set_error(RS_EINVAL, "%u tables, expected 1..%u", ntables, MAX_TABLES);
  if (max_procs < 1 || max_procs > MAX_PROCS)
    return rs_set_error(RS_EINVAL, "max_procs %u, expected 1..%u", max_procs, MAX_PROCS);
  if (pins_per_proc < MIN_PINS || pins_per_proc > MAX_PINS)
    return rs_set_error(RS_EINVAL, "pins_per_proc %u, expected %u..%u", pins_per_proc, MIN_PINS, MAX_PINS);
  if (arena_bytes < rs_arena_min_size() || arena_bytes > (1ull << 46))
    return rs_set_error(RS_EINVAL, "arena of %llu bytes, expected %llu..%llu", (unsigned long long)arena_bytes,
                        (unsigned long long)rs_arena_min_size(), 1ull << 46);
  if (arena_max < arena_bytes || arena_max > (1ull << 46))
    return rs_set_error(RS_EINVAL, "arena room of %llu bytes, expected arena_bytes %llu..%llu",
                        (unsigned long long)arena_max, (unsigned long long)arena_bytes, 1ull << 46);
  for (uint32_t i = 0; i < ntables; i++) {
    int rc = check_config(&cfgs[i], i);
    if (rc) return rc;
    for (uint32_t j = 0; j < i; j++)
      if (!strncmp(cfgs[i].name, cfgs[j].name, sizeof cfgs[i].name))
        return rs_set_error(RS_EINVAL, "tables %u and %u are both named '%s', expected unique names", j, i,
                            cfgs[i].name);
  }
  uint64_t off = rs_align_up(sizeof(rs_seg_hdr), RS_ALIGN);
  p->tables_off = off;
  off = rs_align_up(off + (uint64_t)ntables * sizeof(uint64_t), RS_ALIGN);
  p->slots_off = off;
  off = rs_align_up(off + (uint64_t)max_procs * sizeof(rs_slot), RS_ALIGN);
  p->counters_off = off;
  off = rs_align_up(off + rs_counters_region_size(max_procs, ntables), RS_ALIGN);
  p->regions_off = off;
  for (uint32_t i = 0; i < ntables; i++) {
    if (table_offs) table_offs[i] = off;
    off = rs_align_up(off + rs_table_region_size(&cfgs[i]), RS_ALIGN);   /* includes the config blob */
  }
  p->arena_off = off = rs_align_up(off, PAGE);   /* a page: the disk tier maps a file there */
  p->arena_size = rs_align_up(arena_bytes, RS_ALIGN);
  p->arena_max = rs_align_up(arena_max, RS_ALIGN);
  /* Pin logs after the arena's room, each on its own pages (entries, then the free stack). */
  p->pins_off = rs_align_up(off + p->arena_max, PAGE);
  p->pin_stride = rs_align_up((uint64_t)pins_per_proc * (sizeof(uint64_t) + sizeof(uint32_t)), PAGE);
  p->total = p->pins_off + p->pin_stride * max_procs;
  return RS_OK;
}

/* A growable segment starts with the first RS_PIN_START pins of every slot's pin log reserved
 * (about 12 KiB a slot), so that any process can attach, sample and insert even once the arena
 * has taken all of max_bytes or /dev/shm is full. */
static uint32_t start_pins(uint32_t pins_per_proc) {
  return pins_per_proc < RS_PIN_START ? pins_per_proc : RS_PIN_START;
}

static uint64_t start_pins_bytes(uint32_t pins_per_proc, uint32_t max_procs) {
  return (uint64_t)start_pins(pins_per_proc) * (sizeof(uint64_t) + sizeof(uint32_t)) * max_procs;
}

uint64_t rs_segment_start_pin_bytes(uint32_t max_procs, uint32_t pins_per_proc) {
  return start_pins_bytes(pins_per_proc, max_procs);
}

uint64_t rs_segment_size(const rs_table_config *cfgs, uint32_t ntables, uint32_t max_procs,
                         uint32_t pins_per_proc, uint64_t arena_bytes) {
  plan p;
  return make_plan(cfgs, ntables, max_procs, pins_per_proc, arena_bytes, arena_bytes, &p, NULL) ? 0 : p.total;
}

uint64_t rs_segment_size_ex(const rs_table_config *cfgs, uint32_t ntables, uint32_t max_procs,
                            uint32_t pins_per_proc, uint64_t arena_bytes, uint64_t arena_max,
                            uint64_t *initial_out) {
  plan p;
  if (make_plan(cfgs, ntables, max_procs, pins_per_proc, arena_bytes, arena_max, &p, NULL)) return 0;
  if (initial_out) *initial_out = p.arena_off + p.arena_size;
  return p.total;
}

static int segment_init(void *base, uint64_t size, const rs_table_config *cfgs, uint32_t ntables,
                        uint32_t max_procs, uint32_t pins_per_proc, uint64_t arena_bytes, uint64_t arena_max,
                        uint64_t max_bytes, int growable, int32_t owner_pid, uint64_t owner_start_time,
                        uint64_t generation) {
  plan p;
  int rc = make_plan(cfgs, ntables, max_procs, pins_per_proc, arena_bytes, arena_max, &p, NULL);
  if (rc) return rc;
  uint64_t start = p.arena_off + p.arena_size + start_pins_bytes(pins_per_proc, max_procs);
  if (growable && max_bytes && max_bytes < start)
    return rs_set_error(RS_EINVAL, "max_bytes %llu is below the %llu bytes the segment needs to start",
                        (unsigned long long)max_bytes, (unsigned long long)start);
  if (!base || size < p.total)
    return rs_set_error(RS_EINVAL, "segment of %llu bytes, expected at least %llu for this configuration",
                        (unsigned long long)size, (unsigned long long)p.total);
  rs_lcache_forget();
  rs_seg_hdr *h = rs_seg(base);
  h->magic = RS_MAGIC;
  h->layout_version = RS_LAYOUT_VERSION;
  h->total_size = size;
  h->generation = generation;
  h->owner_pid = owner_pid;
  h->closed = 0;
  h->owner_start_time = owner_start_time;
  h->num_tables = ntables;
  h->max_procs = max_procs;
  h->pins_per_proc = pins_per_proc;
  h->tables_off = p.tables_off;
  h->slots_off = p.slots_off;
  h->pins_off = p.pins_off;
  h->pin_log_stride = p.pin_stride;
  h->counters_off = p.counters_off;   /* zero-filled memory: every counter starts at 0 */
  h->arena_off = p.arena_off;
  h->arena_size = p.arena_size;
  h->arena_max = p.arena_max;
  h->growable = growable ? 1u : 0u;
  h->max_bytes = growable ? max_bytes : 0;
  h->pins_reserved = 0;
  h->extents = 0;
  if ((rc = rs_mutex_init(&h->registry_lock)) || (rc = rs_mutex_init(&h->arena_lock))) return rc;

  uint64_t *toffs = (uint64_t *)rs_at(base, p.tables_off);
  make_plan(cfgs, ntables, max_procs, pins_per_proc, arena_bytes, arena_max, &p, toffs);
  for (uint32_t i = 0; i < ntables; i++)   /* lays out the table and copies its config blob */
    if ((rc = rs_table_region_init(base, toffs[i], &cfgs[i]))) return rc;

  rs_slot *slots = rs_slots(base);
  /* Growable: the first pins of each log are reserved now, the rest grow on demand (rs_pins_grow). */
  uint32_t cap = growable ? start_pins(pins_per_proc) : pins_per_proc;
  for (uint32_t s = 0; s < max_procs; s++) {
    slots[s] = (rs_slot){0};
    uint64_t log_off = p.pins_off + (uint64_t)s * p.pin_stride;
    if (growable &&
        ((rc = rs_reserve(base, log_off, (uint64_t)cap * sizeof(uint64_t), "the pin logs")) ||
         (rc = rs_reserve(base, log_off + (uint64_t)pins_per_proc * sizeof(uint64_t),
                          (uint64_t)cap * sizeof(uint32_t), "the pin logs"))))
      return rc;
    uint64_t *e = rs_pin_entries(base, s);
    uint32_t *stack = rs_pin_free_stack(base, s);
    for (uint32_t i = 0; i < cap; i++) {
      e[i] = 0;
      stack[i] = cap - 1 - i;   /* pops hand out pin 0 first */
    }
    slots[s].free_top = cap;
    slots[s].pin_cap = cap;
  }
  if (growable) h->pins_reserved = start_pins_bytes(pins_per_proc, max_procs);
  rs_arena_init(base);
  __atomic_store_n(&h->ready, 1u, __ATOMIC_RELEASE);
  return RS_OK;
}

int rs_segment_init(void *base, uint64_t size, const rs_table_config *cfgs, uint32_t ntables,
                    uint32_t max_procs, uint32_t pins_per_proc, uint64_t arena_bytes,
                    int32_t owner_pid, uint64_t owner_start_time, uint64_t generation) {
  return segment_init(base, size, cfgs, ntables, max_procs, pins_per_proc, arena_bytes, arena_bytes, 0, 0,
                      owner_pid, owner_start_time, generation);
}

int rs_segment_init_ex(void *base, uint64_t size, const rs_table_config *cfgs, uint32_t ntables,
                       uint32_t max_procs, uint32_t pins_per_proc, uint64_t arena_bytes,
                       uint64_t arena_max, uint64_t max_bytes, int32_t owner_pid,
                       uint64_t owner_start_time, uint64_t generation) {
  return segment_init(base, size, cfgs, ntables, max_procs, pins_per_proc, arena_bytes, arena_max, max_bytes,
                      1, owner_pid, owner_start_time, generation);
}


static int inside(uint64_t off, uint64_t len, uint64_t total) { return off <= total && len <= total - off; }

int rs_segment_validate(void *base, uint64_t size) {
  rs_seg_hdr *h = rs_seg(base);
  rs_lcache_forget();   /* (another segment, or damaged bytes, may now be at a mapping seen before) */
  if (!base || size < sizeof *h)
    return rs_set_error(RS_ECORRUPT, "segment of %llu bytes is smaller than its %zu-byte header",
                        (unsigned long long)size, sizeof *h);
  if (h->magic != RS_MAGIC)
    return rs_set_error(RS_ECORRUPT, "bad segment magic: expected 0x%016llx, found 0x%016llx (not a reverb_shm"
                        " segment, or not initialised yet)",
                        (unsigned long long)RS_MAGIC, (unsigned long long)h->magic);
  if (h->layout_version != RS_LAYOUT_VERSION)
    return rs_set_error(RS_ECORRUPT, "segment layout version: expected %llu, found %llu (created by another"
                        " reverb_shm version)",
                        (unsigned long long)RS_LAYOUT_VERSION, (unsigned long long)h->layout_version);
  if (h->total_size != size)
    return rs_set_error(RS_ECORRUPT, "segment size: header says %llu bytes, mapped %llu bytes",
                        (unsigned long long)h->total_size, (unsigned long long)size);
  if (__atomic_load_n(&h->ready, __ATOMIC_ACQUIRE) != 1)
    return rs_set_error(RS_ECORRUPT, "segment not ready: expected ready flag 1, found %u (creator still"
                        " initialising it, or died while doing so)", h->ready);
  if (h->num_tables < 1 || h->num_tables > MAX_TABLES || h->max_procs < 1 || h->max_procs > MAX_PROCS ||
      h->pins_per_proc < MIN_PINS || h->pins_per_proc > MAX_PINS)
    return rs_set_error(RS_ECORRUPT, "segment header counts out of range: %u tables, %u process slots, %u pins"
                        " per process", h->num_tables, h->max_procs, h->pins_per_proc);
  if (!inside(h->tables_off, (uint64_t)h->num_tables * 8, size) ||
      !inside(h->slots_off, (uint64_t)h->max_procs * sizeof(rs_slot), size) ||
      h->pin_log_stride < (uint64_t)h->pins_per_proc * 12 ||
      !inside(h->pins_off, h->pin_log_stride * h->max_procs, size) || !inside(h->arena_off, h->arena_max, size) ||
      h->arena_size > h->arena_max || h->arena_off + h->arena_max > h->pins_off ||
      !inside(h->counters_off, rs_counters_region_size(h->max_procs, h->num_tables), size) ||
      h->counters_off % RS_ALIGN || h->tables_off % 8 || h->slots_off % 8 || h->pins_off % 8 ||
      h->pin_log_stride % 8 || h->arena_off % RS_ALIGN || h->arena_size % RS_ALIGN || h->arena_size < RS_ALIGN)
    return rs_set_error(RS_ECORRUPT, "segment offsets outside the %llu mapped bytes: tables %llu, slots %llu,"
                        " pins %llu (stride %llu), arena %llu + %llu", (unsigned long long)size,
                        (unsigned long long)h->tables_off, (unsigned long long)h->slots_off,
                        (unsigned long long)h->pins_off, (unsigned long long)h->pin_log_stride,
                        (unsigned long long)h->arena_off, (unsigned long long)h->arena_size);
  const uint64_t *toffs = (const uint64_t *)rs_at(base, h->tables_off);
  for (uint32_t t = 0; t < h->num_tables; t++)
    if (!inside(toffs[t], sizeof(rs_table_hdr), h->arena_off) || toffs[t] % RS_ALIGN)
      return rs_set_error(RS_ECORRUPT, "table %u header offset %llu, expected a 64-aligned offset before the"
                          " arena at %llu", t, (unsigned long long)toffs[t], (unsigned long long)h->arena_off);
  for (uint32_t t = 0; t < h->num_tables; t++) {
    int rc = rs_table_layout_check(base, t);
    if (rc) return rc;
  }
  return RS_OK;
}

int rs_segment_get_info(void *base, rs_segment_info *out) {
  rs_seg_hdr *h = rs_seg(base);
  memset(out, 0, sizeof *out);
  out->total_size = h->total_size;
  out->arena_size = __atomic_load_n(&h->arena_size, __ATOMIC_ACQUIRE);
  out->arena_used = __atomic_load_n(&h->arena_used, __ATOMIC_RELAXED);
  out->arena_max = h->arena_max;
  out->max_bytes = h->max_bytes;
  out->growable = h->growable;
  out->arena_file = h->arena_file;
  out->arena_off = h->arena_off;
  out->extents = __atomic_load_n(&h->extents, __ATOMIC_RELAXED);
  out->pins_reserved = h->growable ? __atomic_load_n(&h->pins_reserved, __ATOMIC_RELAXED)
                                   : h->pin_log_stride * h->max_procs;
  out->reserved_bytes = h->growable ? h->arena_off + out->arena_size + out->pins_reserved : h->total_size;
  out->arena_free = out->arena_size - out->arena_used;
  out->num_chunks = __atomic_load_n(&h->num_chunks, __ATOMIC_RELAXED);
  out->num_descs = __atomic_load_n(&h->num_descs, __ATOMIC_RELAXED);
  out->num_tables = h->num_tables;
  out->max_procs = h->max_procs;
  out->pins_per_proc = h->pins_per_proc;
  for (uint32_t s = 0; s < h->max_procs; s++)
    out->live_procs += __atomic_load_n(&rs_slots(base)[s].pid, __ATOMIC_RELAXED) != 0;
  out->owner_pid = h->owner_pid;
  out->closed = __atomic_load_n(&h->closed, __ATOMIC_ACQUIRE);
  out->owner_start_time = h->owner_start_time;
  out->generation = h->generation;
  out->layout_version = h->layout_version;
  return RS_OK;
}

int rs_segment_close(void *base) {
  rs_seg_hdr *h = rs_seg(base);
  __atomic_store_n(&h->closed, 1, __ATOMIC_RELEASE);
  int first_error = RS_OK;
  for (uint32_t t = 0; t < h->num_tables; t++) {
    rs_table_hdr *th = rs_table(base, t);
    int rc = rs_tlock(base, t);
    /* Even without the lock (unrecoverable mutex) the flag and wake-up must get through. */
    __atomic_store_n(&th->closed, 1, __ATOMIC_RELEASE);
    __atomic_add_fetch(&th->seq, 1u, __ATOMIC_RELEASE);
    if (rc == RS_OK) rs_tunlock(base, t);
    else if (first_error == RS_OK) first_error = rc;
    rs_futex_wake_all(&th->seq);
  }
  return first_error;
}

static int table_check_index(void *base, uint32_t table) {
  if (table >= rs_seg(base)->num_tables)
    return rs_set_error(RS_ENOTFOUND, "table index %u out of range, expected < %u", table,
                        rs_seg(base)->num_tables);
  return RS_OK;
}

int rs_table_find(void *base, const char *name, uint32_t *table_out) {
  rs_seg_hdr *h = rs_seg(base);
  for (uint32_t t = 0; t < h->num_tables; t++) {
    if (!strncmp(rs_table(base, t)->name, name, sizeof rs_table(base, t)->name)) {
      *table_out = t;
      return RS_OK;
    }
  }
  return rs_set_error(RS_ENOTFOUND, "no table named '%.63s' (the server has %u tables)", name, h->num_tables);
}

int rs_table_name(void *base, uint32_t table, char *out64) {
  int rc = table_check_index(base, table);
  if (rc) return rc;
  memcpy(out64, rs_table(base, table)->name, 64);
  out64[63] = 0;
  return RS_OK;
}

int rs_table_blob(void *base, uint32_t table, uint64_t *off_out, uint32_t *len_out) {
  int rc = table_check_index(base, table);
  if (rc) return rc;
  *off_out = rs_table(base, table)->blob_off;
  *len_out = rs_table(base, table)->blob_len;
  return RS_OK;
}

/* The one upward link of the C layers: lock.c runs the table and arena repairs after a dead
 * lock owner through hooks registered here, when the core library is loaded (before any lock
 * can be taken in this process). */
__attribute__((constructor)) static void register_repairs(void) {
  rs_lock_register_repairs(rs_table_repair, rs_arena_repair);
}
