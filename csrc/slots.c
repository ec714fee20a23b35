/* Process slots: registration, unregistration, and reaping of dead processes with a
 * stop-the-world recount of every reference count.
 *
 * A slot is claimed under the registry lock by writing pid last; its pin log (entries + free
 * stack) belongs to the arena and changes only under the arena lock. Lock order everywhere:
 * registry -> tables (by index) -> arena.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "counters.h"
#include "rs_internal.h"

uint64_t rs_proc_start_time(int32_t pid) {
  if (pid <= 0) return 0;
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE *f = fopen(path, "re");
  if (!f) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  /* "pid (comm) state ppid ...": comm may hold spaces and ')', so fields start after the last ')'.
   * The first field after it is field 3 (state); starttime is field 22. */
  char *p = strrchr(buf, ')');
  if (!p) return 0;
  p++;
  while (*p == ' ') p++;
  char state = *p;
  long threads = 0;
  for (int field = 3; field < 22; field++) {
    while (*p == ' ') p++;
    if (field == 20) threads = strtol(p, NULL, 10);   /* num_threads */
    while (*p && *p != ' ') p++;
    if (!*p) return 0;
  }
  /* A process that has exited but is not reaped yet (a zombie: a killed server whose parent has
   * not waited for it) still answers kill(pid, 0): it counts as gone. A zombie leader whose other
   * threads still run (its main thread called pthread_exit) is alive. */
  if ((state == 'Z' || state == 'X') && threads <= 1) return 0;
  char *end;
  unsigned long long v = strtoull(p, &end, 10);
  return end == p ? 0 : (uint64_t)v;
}

int rs_owner_check(void *base) {
  rs_seg_hdr *h = rs_seg(base);
  int32_t pid = h->owner_pid;
  int dead = pid <= 0 || (kill(pid, 0) == -1 && errno == ESRCH);
  if (!dead && h->owner_start_time != 0) dead = rs_proc_start_time(pid) != h->owner_start_time;
  /* pid gone here: in another pid namespace, the owner's liveness lock tells (liveness.c) */
  if (dead && rs_live_probe_base(base, 0) == 1) dead = 0;
  if (!dead) return RS_OK;
  return rs_set_error(RS_EDEADOWNER,
                      "the server process (pid %d) that owns this segment is dead; data already "
                      "mapped stays readable, but blocking calls cannot complete: restart the server "
                      "(which reclaims the stale segment) or run `reverb-shm gc`", (int)pid);
}

static int registry_lock(void *base) {
  rs_seg_hdr *h = rs_seg(base);
  int recovered = 0;
  int rc = rs_mutex_lock(&h->registry_lock, &recovered);
  if (rc) return rc;
  /* A claim is a single store of pid (written last): nothing to repair after a dead owner. */
  if (recovered) rs_mutex_consistent(&h->registry_lock);
  return RS_OK;
}

static void registry_unlock(void *base) { rs_mutex_unlock(&rs_seg(base)->registry_lock); }

/* Empty a slot's pin log (entries and free stack). Caller holds the arena lock or owns the slot
 * exclusively (being claimed, pid still 0). */
static void pin_log_reset(void *base, uint32_t slot) {
  uint32_t ppp = rs_slots(base)[slot].pin_cap;   /* the reserved part; a slot keeps its pages */
  uint64_t *e = rs_pin_entries(base, slot);
  uint32_t *stack = rs_pin_free_stack(base, slot);
  for (uint32_t i = 0; i < ppp; i++) {
    e[i] = 0;
    stack[i] = ppp - 1 - i;
  }
  rs_slot *s = &rs_slots(base)[slot];
  s->free_top = ppp;
  s->npins = 0;
}

int rs_proc_register(void *base, int32_t pid, uint64_t start_time, uint32_t *slot_out) {
  if (pid <= 0) return rs_set_error(RS_EINVAL, "pid %d, expected > 0", pid);
  int rc = registry_lock(base);
  if (rc) return rc;
  rs_seg_hdr *h = rs_seg(base);
  rs_slot *slots = rs_slots(base);
  for (uint32_t s = 0; s < h->max_procs; s++) {
    if (__atomic_load_n(&slots[s].pid, __ATOMIC_ACQUIRE) != 0) continue;
    if (slots[s].npins != 0 || slots[s].free_top != slots[s].pin_cap) {
      /* Left over by an interrupted unregister/reap: clean it under the arena lock. */
      if ((rc = rs_alock(base))) break;
      pin_log_reset(base, s);
      rs_aunlock(base);
    }
    /* The slot's liveness lock before its pid: a reaper (which holds the registry lock to
     * judge) never sees the slot of a process of another pid namespace without it. */
    if ((rc = rs_live_lock_base(base, 1 + (uint64_t)s, 1))) break;
    slots[s].start_time = start_time;
    rs_counters_claimed(base, s);
    __atomic_store_n(&slots[s].pid, pid, __ATOMIC_RELEASE);
    *slot_out = s;
    registry_unlock(base);
    return RS_OK;
  }
  registry_unlock(base);
  if (rc) return rc;
  return rs_set_error(RS_EFULL,
                      "all %u process slots are in use (max_procs=%u): raise max_procs when creating the "
                      "server; the server frees the slot of a process that exited within about "
                      "0.5 s, so retrying may succeed if processes are coming and going",
                      h->max_procs, h->max_procs);
}

int rs_proc_unregister(void *base, uint32_t slot) {
  rs_seg_hdr *h = rs_seg(base);
  if (slot >= h->max_procs)
    return rs_set_error(RS_EINVAL, "process slot %u out of range, expected < %u", slot, h->max_procs);
  int rc = registry_lock(base);
  if (rc) return rc;
  if (rs_slots(base)[slot].pid == 0) {
    registry_unlock(base);
    return rs_set_error(RS_EINVAL, "process slot %u is not registered", slot);
  }
  /* Release every pin through the ordinary path (refcounts drop, blocks at zero are freed). */
  uint32_t *pins = malloc(((size_t)rs_slots(base)[slot].pin_cap + 1) * sizeof *pins);
  if (!pins) {
    registry_unlock(base);
    return rs_set_error(RS_ESYS, "out of memory while unregistering slot %u", slot);
  }
  if ((rc = rs_alock(base)) == RS_OK) {
    uint64_t *e = rs_pin_entries(base, slot);
    uint32_t n = 0;
    for (uint32_t i = 0; i < rs_slots(base)[slot].pin_cap; i++)
      if (e[i]) pins[n++] = i;
    rs_aunlock(base);
    /* Only this process touches its own pin log, so the list cannot go stale in between. */
    rc = n ? rs_unpin(base, slot, n, pins) : RS_OK;
  }
  free(pins);
  if (rc == RS_OK) {
    __atomic_store_n(&rs_slots(base)[slot].pid, 0, __ATOMIC_RELEASE);
    rs_live_lock_base(base, 1 + (uint64_t)slot, 0);
  }
  registry_unlock(base);
  return rc;
}

static int slot_is_dead(void *base, uint32_t slot) {
  const rs_slot *s = &rs_slots(base)[slot];
  int dead = kill(s->pid, 0) == -1 && errno == ESRCH;
  if (!dead) dead = s->start_time != 0 && rs_proc_start_time(s->pid) != s->start_time;   /* pid reused */
  /* a process of another pid namespace: alive while it holds its slot's liveness lock */
  return dead && rs_live_probe_base(base, 1 + (uint64_t)slot) != 1;
}

int rs_reap(void *base, uint32_t *reaped_out) {
  rs_seg_hdr *h = rs_seg(base);
  *reaped_out = 0;
  int rc = registry_lock(base);
  if (rc) return rc;
  rs_slot *slots = rs_slots(base);
  uint32_t ndead = 0;
  uint8_t *dead = calloc(h->max_procs, 1);
  if (!dead) {
    registry_unlock(base);
    return rs_set_error(RS_ESYS, "out of memory while reaping process slots");
  }
  for (uint32_t s = 0; s < h->max_procs; s++)
    if (slots[s].pid != 0 && slot_is_dead(base, s)) dead[s] = 1, ndead++;
  if (ndead || __atomic_load_n(&h->refcounts_suspect, __ATOMIC_ACQUIRE)) {
    uint32_t locked = 0;
    for (; locked < h->num_tables; locked++)
      if ((rc = rs_tlock(base, locked))) break;
    if (rc == RS_OK && (rc = rs_alock(base)) == RS_OK) {
      for (uint32_t s = 0; s < h->max_procs; s++) {
        if (!dead[s]) continue;
        pin_log_reset(base, s);
        __atomic_store_n(&slots[s].pid, 0, __ATOMIC_RELEASE);
      }
      rs_recount(base);
      rs_aunlock(base);
      *reaped_out = ndead;
    }
    while (locked-- > 0) rs_tunlock(base, locked);
  }
  free(dead);
  registry_unlock(base);
  return rc;
}
