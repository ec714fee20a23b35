/* Checkpoint support: consistent snapshots of every table, chunk holds, and restore of items and
 * counters (declarations and contract: the "checkpoint support" section of rs_api.h).
 *
 * Snapshot: every table lock is taken in index order (the lock order of rs_reap), the items of
 * each table are listed in insertion order with copies of their descriptors, the distinct chunks
 * they reference are collected in a hash map, and holds are created for them (table lock ->
 * arena lock, as everywhere). Then the locks are released; descriptors are rewritten to chunk ids
 * after that, so the pause others see is the listing and the holds only.
 *
 * Restore writes records into the free records of an empty table and lets rs_table_repair derive
 * every structure (index, dense array, insertion order list sorted by insert_seq, heaps ordered by
 * (priority, update_seq), sum trees, episode map), which is exactly what makes Fifo/Lifo/heap
 * order identical to the saved table. */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "index.h"
#include "selectors.h"
#include "table.h"

#define HOLD_CHUNKS 16384u   /* chunks per hold descriptor (512 KiB blob) */

/* ================================================================== u64 -> id hash map */

typedef struct idmap {
  uint64_t *keys;   /* key + 1 (0 = empty) */
  uint64_t *ids;
  uint64_t mask;
  uint64_t n;
} idmap;

static int idmap_init(idmap *m, uint64_t expected) {
  uint64_t cap = 16;
  while (cap < 2 * expected + 2) cap <<= 1;
  m->keys = calloc(cap, sizeof *m->keys);
  m->ids = malloc(cap * sizeof *m->ids);
  m->mask = cap - 1;
  m->n = 0;
  if (m->keys && m->ids) return RS_OK;
  free(m->keys);
  free(m->ids);
  m->keys = m->ids = NULL;
  return rs_set_error(RS_ESYS, "out of memory for a hash map of %llu entries", (unsigned long long)cap);
}

static void idmap_free(idmap *m) {
  free(m->keys);
  free(m->ids);
  m->keys = m->ids = NULL;
}

/* Id of `key`, inserting it with id m->n if new (*added = 1). The map never fills: capacity was
 * sized for the number of keys offered. */
static uint64_t idmap_get(idmap *m, uint64_t key, int *added) {
  uint64_t i = rs_mix64(key) & m->mask;
  for (;; i = (i + 1) & m->mask) {
    if (m->keys[i] == key + 1) {
      *added = 0;
      return m->ids[i];
    }
    if (m->keys[i] == 0) {
      m->keys[i] = key + 1;
      m->ids[i] = m->n++;
      *added = 1;
      return m->ids[i];
    }
  }
}

/* ================================================================== descriptor helpers */

static uint64_t desc_len(const rs_desc_hdr *d) {
  return sizeof *d + (uint64_t)d->ncols * sizeof(rs_desc_col) + (uint64_t)d->nslices * sizeof(rs_desc_slice);
}

static rs_desc_slice *slices_of(uint8_t *blob) {
  rs_desc_hdr *d = (rs_desc_hdr *)blob;
  return (rs_desc_slice *)(blob + sizeof *d + (size_t)d->ncols * sizeof(rs_desc_col));
}

static int slot_ok(void *base, uint32_t slot) {
  rs_seg_hdr *h = rs_seg(base);
  if (slot >= h->max_procs || __atomic_load_n(&rs_slots(base)[slot].pid, __ATOMIC_ACQUIRE) == 0)
    return rs_set_error(RS_EINVAL, "process slot %u is not registered (max_procs %u)", slot, h->max_procs);
  return RS_OK;
}

static int table_ok(void *base, uint32_t t) {
  if (!base) return rs_set_error(RS_EINVAL, "segment base is NULL");
  uint32_t nt = rs_seg(base)->num_tables;
  if (t >= nt) return rs_set_error(RS_EINVAL, "table index %u out of range (segment has %u tables)", t, nt);
  return RS_OK;
}

/* Bump the table's futex word and wake waiters; caller holds the lock and unlocks after. */
static void publish_and_unlock(void *base, uint32_t t) {
  rs_table_hdr *th = rs_table(base, t);
  __atomic_add_fetch(&th->seq, 1, __ATOMIC_RELEASE);
  int wake = __atomic_load_n(&th->waiters, __ATOMIC_ACQUIRE) > 0;
  rs_tunlock(base, t);
  if (wake) rs_futex_wake_all(&th->seq);
}

/* ================================================================== holds */

int rs_hold_chunks(void *base, uint32_t slot, uint32_t n, const uint64_t *chunk_offs, uint32_t *pin_out) {
  if (!base || !pin_out || (n && !chunk_offs)) return rs_set_error(RS_EINVAL, "rs_hold_chunks: NULL argument");
  if (n < 1 || n > (UINT32_MAX - sizeof(rs_desc_hdr)) / (sizeof(rs_desc_col) + sizeof(rs_desc_slice)))
    return rs_set_error(RS_EINVAL, "rs_hold_chunks: n = %u, expected 1..%zu", n,
                        (UINT32_MAX - sizeof(rs_desc_hdr)) / (sizeof(rs_desc_col) + sizeof(rs_desc_slice)));
  int rc = slot_ok(base, slot);
  if (rc) return rc;
  /* One column per chunk, one row each: a well-formed descriptor, so the arena's own validation,
   * reference counting, recount and checker treat the hold like any item descriptor. */
  uint32_t len = (uint32_t)(sizeof(rs_desc_hdr) + (uint64_t)n * (sizeof(rs_desc_col) + sizeof(rs_desc_slice)));
  uint8_t *blob = malloc(len);
  if (!blob) return rs_set_error(RS_ESYS, "out of memory for a hold of %u chunks", n);
  rs_desc_hdr *d = (rs_desc_hdr *)blob;
  d->ncols = d->nslices = n;
  rs_desc_col *cols = (rs_desc_col *)(d + 1);
  rs_desc_slice *sl = slices_of(blob);
  for (uint32_t i = 0; i < n; i++) {
    cols[i] = (rs_desc_col){i, 1, 0, 0};
    sl[i] = (rs_desc_slice){chunk_offs[i], 0, 1};
  }
  uint64_t desc = 0;
  rc = rs_desc_create(base, blob, len, &desc);    /* refcount 1, +1 per chunk */
  free(blob);
  if (rc) return rc;
  rc = rs_pin_descs(base, slot, 1, &desc, pin_out);
  rs_desc_release(base, desc, 0);                 /* the pin is now the only owner */
  return rc;
}

/* ================================================================== snapshot */

static void snapshot_free(rs_snapshot *s) {
  if (!s) return;
  for (uint32_t t = 0; s->tables && t < s->num_tables; t++) {
    free(s->tables[t].items);
    free(s->tables[t].descs);
  }
  free(s->tables);
  free(s->chunk_offs);
  free(s->hold_pins);
  free(s);
}

static void unpin_holds(void *base, uint32_t slot, rs_snapshot *s) {
  if (s->num_holds) rs_unpin(base, slot, s->num_holds, s->hold_pins);
  s->num_holds = 0;
}

/* List table t (locked): items, descriptor copies and their chunks (into `chunks`). */
static int list_table(void *base, uint32_t t, rs_snapshot_table *out, idmap *chunks, uint64_t **chunk_list,
                      uint64_t *chunk_cap) {
  rs_table_hdr *th = rs_table(base, t);
  rs_rec *recs = rs_recs(base, th);
  out->counters = (rs_table_counters){th->size, th->inserts, th->samples, th->deletes,
                                      th->num_episodes, th->num_deleted_episodes, th->num_unique_samples};
  uint64_t n = (uint64_t)th->size, bytes = 0, slices = 0;
  for (uint32_t r = th->order_head; r != RS_NONE; r = recs[r].next) {
    const rs_desc_hdr *d = rs_desc_blob(base, recs[r].desc_off);
    bytes += desc_len(d);
    slices += d->nslices;
  }
  out->items = malloc((n ? n : 1) * sizeof *out->items);
  out->descs = malloc(bytes ? bytes : 1);
  if (!out->items || !out->descs) return rs_set_error(RS_ESYS, "out of memory listing table '%s'", th->name);
  /* Grow the chunk map to hold every slice of this table in the worst case. */
  if (2 * (chunks->n + slices) + 2 > chunks->mask + 1) {
    idmap bigger;
    int rc = idmap_init(&bigger, chunks->n + slices);
    if (rc) return rc;
    for (uint64_t i = 0; i <= chunks->mask; i++) {
      if (!chunks->keys[i]) continue;
      uint64_t j = rs_mix64(chunks->keys[i] - 1) & bigger.mask;
      while (bigger.keys[j]) j = (j + 1) & bigger.mask;
      bigger.keys[j] = chunks->keys[i];
      bigger.ids[j] = chunks->ids[i];
    }
    bigger.n = chunks->n;
    idmap_free(chunks);
    *chunks = bigger;
  }
  if (*chunk_cap < chunks->n + slices) {
    uint64_t cap = chunks->n + slices;
    uint64_t *grown = realloc(*chunk_list, (cap ? cap : 1) * sizeof *grown);
    if (!grown) return rs_set_error(RS_ESYS, "out of memory listing the chunks of table '%s'", th->name);
    *chunk_list = grown;
    *chunk_cap = cap;
  }
  uint64_t i = 0, at = 0;
  for (uint32_t r = th->order_head; r != RS_NONE; r = recs[r].next, i++) {
    rs_item_rec *it = &out->items[i];
    const rs_rec *rec = &recs[r];
    *it = (rs_item_rec){rec->key, rec->priority, rec->times_sampled, rec->insert_seq,
                        rs_rec_update_seq(base, th, r), rec->inserted_at_ns, at};
    const rs_desc_hdr *d = rs_desc_blob(base, rec->desc_off);
    uint64_t len = desc_len(d);
    memcpy(out->descs + at, d, len);
    rs_desc_slice *sl = slices_of(out->descs + at);
    for (uint32_t k = 0; k < d->nslices; k++) {
      sl[k].row_offset += rs_ref_shift(rec->desc_off);   /* the item's own descriptor */
      int added;
      idmap_get(chunks, sl[k].chunk_off, &added);
      if (added) (*chunk_list)[chunks->n - 1] = sl[k].chunk_off;
    }
    at += len;
  }
  out->n_items = i;
  out->descs_len = at;
  return RS_OK;
}

static int create_holds(void *base, uint32_t slot, rs_snapshot *s) {
  uint64_t nholds = (s->n_chunks + HOLD_CHUNKS - 1) / HOLD_CHUNKS;
  s->hold_pins = malloc((nholds ? nholds : 1) * sizeof *s->hold_pins);
  if (!s->hold_pins) return rs_set_error(RS_ESYS, "out of memory for %llu hold pins", (unsigned long long)nholds);
  if (rs_slots(base)[slot].free_top < nholds)
    return rs_set_error(RS_EFULL, "snapshot needs %llu pins to hold %llu chunks, process slot %u has %u free",
                        (unsigned long long)nholds, (unsigned long long)s->n_chunks, slot,
                        rs_slots(base)[slot].free_top);
  for (uint64_t c = 0; c < s->n_chunks; c += HOLD_CHUNKS) {
    uint32_t k = s->n_chunks - c < HOLD_CHUNKS ? (uint32_t)(s->n_chunks - c) : HOLD_CHUNKS;
    int rc = rs_hold_chunks(base, slot, k, s->chunk_offs + c, &s->hold_pins[s->num_holds]);
    if (rc) return rc;
    s->num_holds++;
  }
  return RS_OK;
}

int rs_snapshot_take(void *base, uint32_t slot, rs_snapshot **out) {
  if (!base || !out) return rs_set_error(RS_EINVAL, "rs_snapshot_take: NULL argument");
  *out = NULL;
  int rc = slot_ok(base, slot);
  if (rc) return rc;
  uint32_t nt = rs_seg(base)->num_tables;
  rs_snapshot *s = calloc(1, sizeof *s);
  if (!s || !(s->tables = calloc(nt, sizeof *s->tables))) {
    free(s);
    return rs_set_error(RS_ESYS, "out of memory for a snapshot of %u tables", nt);
  }
  s->num_tables = nt;
  idmap chunks = {0};
  uint64_t chunk_cap = 0;
  rc = idmap_init(&chunks, 1024);
  uint32_t locked = 0;
  int64_t t0 = rs_now_ns();
  for (; rc == RS_OK && locked < nt; locked++)
    if ((rc = rs_tlock(base, locked))) break;
  for (uint32_t t = 0; rc == RS_OK && t < nt; t++)
    rc = list_table(base, t, &s->tables[t], &chunks, &s->chunk_offs, &chunk_cap);
  s->n_chunks = chunks.n;
  if (rc == RS_OK) rc = create_holds(base, slot, s);
  if (rc) unpin_holds(base, slot, s);
  s->locked_ns = rs_now_ns() - t0;
  while (locked-- > 0) rs_tunlock(base, locked);
  /* Outside the locks: chunk offsets -> chunk ids in the descriptor copies. */
  for (uint32_t t = 0; rc == RS_OK && t < nt; t++) {
    rs_snapshot_table *st = &s->tables[t];
    for (uint64_t i = 0; i < st->n_items; i++) {
      uint8_t *blob = st->descs + st->items[i].desc_off;
      rs_desc_slice *sl = slices_of(blob);
      for (uint32_t k = 0; k < ((rs_desc_hdr *)blob)->nslices; k++) {
        int added;
        sl[k].chunk_off = idmap_get(&chunks, sl[k].chunk_off, &added);
      }
    }
  }
  idmap_free(&chunks);
  if (rc) {
    snapshot_free(s);
    return rc;
  }
  *out = s;
  return RS_OK;
}

int rs_snapshot_release(void *base, uint32_t slot, rs_snapshot *snap) {
  if (!snap) return RS_OK;
  int rc = RS_OK;
  if (snap->num_holds) rc = rs_unpin(base, slot, snap->num_holds, snap->hold_pins);
  snapshot_free(snap);
  return rc;
}

/* ================================================================== restore */

static int cmp_key(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

static int check_item(const rs_table_hdr *th, uint64_t i, const rs_item_rec *it) {
  int prio = th->sel[0].kind == RS_SEL_PRIORITIZED || th->sel[1].kind == RS_SEL_PRIORITIZED;
  if (!isfinite(it->priority) || (prio && it->priority < 0))
    return rs_set_error(RS_EINVAL, "table '%s': restored item %llu (key %llu) has priority %g, expected a "
                        "finite value%s", th->name, (unsigned long long)i, (unsigned long long)it->key,
                        it->priority, prio ? " >= 0 (the table has a Prioritized selector)" : "");
  for (int si = 0; si < 2; si++)
    if (th->sel[si].kind == RS_SEL_PRIORITIZED && !isfinite(rs_sel_weight(th->sel[si].exponent, it->priority)))
      return rs_set_error(RS_EINVAL, "table '%s': restored item key %llu: priority %g overflows priority**%g",
                          th->name, (unsigned long long)it->key, it->priority, th->sel[si].exponent);
  if (it->times_sampled < 0 || it->times_sampled > INT32_MAX ||
      (th->max_times_sampled > 0 && it->times_sampled >= th->max_times_sampled))
    return rs_set_error(RS_EINVAL, "table '%s': restored item key %llu was sampled %lld times, expected 0..%d "
                        "(below max_times_sampled %d)", th->name, (unsigned long long)it->key,
                        (long long)it->times_sampled,
                        th->max_times_sampled > 0 ? th->max_times_sampled - 1 : INT32_MAX, th->max_times_sampled);
  return RS_OK;
}

/* Translate the descriptors of items (chunk ids) into `out` (chunk offsets); validate them. */
static int translate_descs(void *base, const rs_table_hdr *th, uint64_t n, const rs_item_rec *items,
                           const uint8_t *descs, uint64_t descs_len, const uint64_t *chunk_map,
                           uint64_t n_chunks, uint8_t *out, uint64_t *out_offs) {
  uint64_t at = 0;
  for (uint64_t i = 0; i < n; i++) {
    uint64_t off = items[i].desc_off;
    if (off % 8 || off > descs_len || descs_len - off < sizeof(rs_desc_hdr))
      return rs_set_error(RS_EINVAL, "table '%s': restored item %llu: descriptor offset %llu outside the %llu "
                          "descriptor bytes or not 8-byte aligned", th->name, (unsigned long long)i,
                          (unsigned long long)off, (unsigned long long)descs_len);
    uint64_t len = desc_len((const rs_desc_hdr *)(descs + off));
    if (len > descs_len - off || len > UINT32_MAX)
      return rs_set_error(RS_EINVAL, "table '%s': restored item %llu: descriptor of %llu bytes overruns the "
                          "descriptor buffer", th->name, (unsigned long long)i, (unsigned long long)len);
    memcpy(out + at, descs + off, len);
    rs_desc_slice *sl = slices_of(out + at);
    for (uint32_t k = 0; k < ((rs_desc_hdr *)(out + at))->nslices; k++) {
      if (sl[k].chunk_off >= n_chunks)
        return rs_set_error(RS_EINVAL, "table '%s': restored item %llu names chunk id %llu, expected < %llu",
                            th->name, (unsigned long long)i, (unsigned long long)sl[k].chunk_off,
                            (unsigned long long)n_chunks);
      sl[k].chunk_off = chunk_map[sl[k].chunk_off];
    }
    int rc = rs_desc_validate(base, out + at, (uint32_t)len);
    if (rc) {
      char why[512];
      strncpy(why, rs_last_error(), sizeof why - 1);
      why[sizeof why - 1] = 0;
      return rs_set_error(rc, "table '%s': restored item %llu: %s", th->name, (unsigned long long)i, why);
    }
    out_offs[i] = at;
    at += len;
  }
  return RS_OK;
}

/* Distinct episodes referenced by the translated descriptors (for the episode map capacity). */
static int count_episodes(void *base, uint64_t n, const uint8_t *descs, const uint64_t *offs, uint64_t *out) {
  uint64_t ids = 0;   /* episode ids named (with repeats): one per slice, or per row (RS_CHUNK_ROW_EPISODES) */
  for (uint64_t i = 0; i < n; i++) {
    const rs_desc_hdr *d = (const rs_desc_hdr *)(descs + offs[i]);
    const rs_desc_slice *sl = rs_desc_slices(d);
    for (uint32_t k = 0; k < d->nslices; k++)
      ids += rs_chunk(base, sl[k].chunk_off)->flags & RS_CHUNK_ROW_EPISODES ? sl[k].nrows : 1;
  }
  idmap eps;
  int rc = idmap_init(&eps, ids);
  if (rc) return rc;
  for (uint64_t i = 0; i < n; i++) {
    const rs_desc_hdr *d = (const rs_desc_hdr *)(descs + offs[i]);
    const rs_desc_slice *sl = rs_desc_slices(d);
    for (uint32_t k = 0; k < d->nslices; k++) {
      const rs_chunk_hdr *c = rs_chunk(base, sl[k].chunk_off);
      int added;
      if (!(c->flags & RS_CHUNK_ROW_EPISODES)) {
        idmap_get(&eps, c->episode_id, &added);
        continue;
      }
      for (uint32_t r = 0; r < sl[k].nrows; r++) idmap_get(&eps, c->episode_id + sl[k].row_offset + r, &added);
    }
  }
  *out = eps.n;
  idmap_free(&eps);
  return RS_OK;
}

static int validate_restore(void *base, rs_table_hdr *th, uint64_t n, const rs_item_rec *items) {
  if (n > th->max_size)
    return rs_set_error(RS_EINVAL, "table '%s': cannot restore %llu items, max_size is %llu", th->name,
                        (unsigned long long)n, (unsigned long long)th->max_size);
  for (uint64_t i = 0; i < n; i++) {
    int rc = check_item(th, i, &items[i]);
    if (rc) return rc;
  }
  uint64_t *keys = malloc((n ? n : 1) * sizeof *keys);
  if (!keys) return rs_set_error(RS_ESYS, "out of memory checking %llu keys", (unsigned long long)n);
  for (uint64_t i = 0; i < n; i++) keys[i] = items[i].key;
  qsort(keys, n, sizeof *keys, cmp_key);
  int rc = RS_OK;
  for (uint64_t i = 1; i < n && rc == RS_OK; i++)
    if (keys[i] == keys[i - 1])
      rc = rs_set_error(RS_EINVAL, "table '%s': restored items repeat key %llu", th->name,
                        (unsigned long long)keys[i]);
  free(keys);
  return rc;
}

int rs_restore_items(void *base, uint32_t table, uint64_t n, const rs_item_rec *items, const uint8_t *descs,
                     uint64_t descs_len, const uint64_t *chunk_map, uint64_t n_chunks) {
  int rc = table_ok(base, table);
  if (rc) return rc;
  if (n && (!items || !descs || (n_chunks && !chunk_map)))
    return rs_set_error(RS_EINVAL, "rs_restore_items: NULL argument");
  rs_table_hdr *th = rs_table(base, table);
  if ((rc = validate_restore(base, th, n, items))) return rc;
  uint8_t *blobs = malloc(descs_len ? descs_len : 1);
  uint64_t *offs = malloc((n ? n : 1) * sizeof *offs), *desc_offs = calloc(n ? n : 1, sizeof *desc_offs);
  uint64_t episodes = 0;
  if (!blobs || !offs || !desc_offs) rc = rs_set_error(RS_ESYS, "out of memory restoring %llu items",
                                                       (unsigned long long)n);
  if (rc == RS_OK)
    rc = translate_descs(base, th, n, items, descs, descs_len, chunk_map, n_chunks, blobs, offs);
  if (rc == RS_OK) rc = count_episodes(base, n, blobs, offs, &episodes);
  if (rc == RS_OK && episodes >= th->episodes_cap)
    rc = rs_set_error(RS_EFULL, "table '%s': restored items span %llu episodes, the episode map holds %u",
                      th->name, (unsigned long long)episodes, th->episodes_cap - 1);
  if (rc == RS_OK) rc = rs_tlock(base, table);
  if (rc) goto out;
  if (th->size != 0) {
    rc = rs_set_error(RS_EINVAL, "table '%s' holds %lld items; restore needs an empty table", th->name,
                      (long long)th->size);
    rs_tunlock(base, table);
    goto out;
  }
  uint64_t made = 0;
  for (; made < n; made++) {   /* consecutive items of one batch share a DESC block again */
    const rs_desc_hdr *d = (const rs_desc_hdr *)(blobs + offs[made]);
    if ((rc = rs_desc_create_shared(base, blobs + offs[made], (uint32_t)desc_len(d),
                                    made ? desc_offs[made - 1] : 0, &desc_offs[made])))
      break;
  }
  if (rc) {   /* nothing committed yet: drop what was created */
    for (uint64_t i = 0; i < made; i++) rs_desc_release(base, desc_offs[i], 0);
    rs_tunlock(base, table);
    goto out;
  }
  rs_rec *recs = rs_recs(base, th);
  uint32_t r = 0;
  for (uint64_t i = 0; i < n; i++, r++) {
    while (recs[r].valid) r++;   /* the table is empty: every record is free */
    rs_rec *rec = &recs[r];
    rec->key = items[i].key;
    rec->priority = items[i].priority;
    rec->insert_seq = items[i].insert_seq;
    rec->desc_off = desc_offs[i];
    rec->inserted_at_ns = items[i].inserted_at_ns;
    rec->times_sampled = (int32_t)items[i].times_sampled;
    if (th->aux_off) rs_aux(base, th)[r] = (rs_heap_aux){items[i].update_seq, {RS_NONE, RS_NONE}};
    __atomic_store_n(&rec->valid, 1, __ATOMIC_RELEASE);
  }
  th->inserts = th->samples = th->deletes = 0;
  rs_table_repair(base, table);   /* derives every structure; inserts = size, deletes = 0 */
  publish_and_unlock(base, table);
out:
  free(blobs);
  free(offs);
  free(desc_offs);
  return rc;
}

int rs_restore_counters(void *base, uint32_t table, const rs_table_counters *c) {
  int rc = table_ok(base, table);
  if (rc) return rc;
  if (!c) return rs_set_error(RS_EINVAL, "rs_restore_counters: NULL counters");
  if (c->inserts < 0 || c->samples < 0 || c->deletes < 0 || c->num_deleted_episodes < 0 ||
      c->num_unique_samples < 0)
    return rs_set_error(RS_EINVAL, "restored counters must be >= 0 (inserts %lld, samples %lld, deletes %lld, "
                        "deleted episodes %lld, unique samples %lld)", (long long)c->inserts,
                        (long long)c->samples, (long long)c->deletes, (long long)c->num_deleted_episodes,
                        (long long)c->num_unique_samples);
  if ((rc = rs_tlock(base, table))) return rc;
  rs_table_hdr *th = rs_table(base, table);
  if (c->inserts - c->deletes != th->size || c->size != th->size || c->num_episodes != th->num_episodes) {
    rc = rs_set_error(RS_EINVAL, "table '%s': restored counters say size %lld (inserts %lld - deletes %lld) "
                      "and %lld episodes; the table holds %lld items of %lld episodes", th->name,
                      (long long)c->size, (long long)c->inserts, (long long)c->deletes,
                      (long long)c->num_episodes, (long long)th->size, (long long)th->num_episodes);
    rs_tunlock(base, table);
    return rc;
  }
  th->inserts = c->inserts;
  th->samples = c->samples;
  th->deletes = c->deletes;
  th->num_deleted_episodes = c->num_deleted_episodes;
  th->num_unique_samples = c->num_unique_samples;
  publish_and_unlock(base, table);
  return RS_OK;
}

int rs_table_reset_limiter(void *base, uint32_t table) {
  int rc = table_ok(base, table);
  if (rc) return rc;
  if ((rc = rs_tlock(base, table))) return rc;
  rs_table_hdr *th = rs_table(base, table);
  double credit = (double)th->size * th->samples_per_insert;   /* inserts * spi with no samples */
  double diff = credit < th->min_diff ? th->min_diff : credit > th->max_diff ? th->max_diff : credit;
  double samples = ceil(credit - diff);
  th->inserts = th->size;
  th->deletes = 0;
  th->samples = samples > 0 ? (int64_t)samples : 0;
  publish_and_unlock(base, table);
  return RS_OK;
}
