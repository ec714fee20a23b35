"""Reading the C core's operation counters (csrc/counters.c) into plain dicts.

The core counts every insert, sample, update, delete, eviction and table-lock hold in a row of
counters per process slot and table, written only by the process doing the work; reading sums
the rows without taking any lock. `reverb-shm top`, the Prometheus exporter and the ``stats()``
methods of Client and SharedTable all read through here, so a watcher never slows the server it
watches. Totals are cumulative since the server started (a table reset does not zero them).

Thread-safety: the functions only read shared memory; any thread may call them.
"""
from typing import Dict, List

from reverb_shm._internal import shm
from reverb_shm._internal._lib import check, ffi, lib

# Upper bounds (seconds) of the lock-hold histogram buckets: bucket 0 holds < 128 ns, bucket b
# [2**(b+6), 2**(b+7)) ns, the last bucket everything longer (its bound is +inf).
HOLD_BUCKET_BOUNDS = tuple([2.0 ** (b + 7) * 1e-9 for b in range(23)] + [float("inf")])

# (dict key, rs_table_counts field, type) of the figures read_table copies as they are.
_FIELDS = tuple(
    [(k, k, int) for k in ("inserts", "samples", "updates", "deletes", "evictions", "expirations",
                           "insert_bytes", "lock_holds", "max_size", "blocked_inserters",
                           "blocked_samplers", "limiter_inserts", "limiter_samples",
                           "limiter_deletes", "min_size_to_sample")]
    + [("items", "size", int), ("episodes", "num_episodes", int)]
    + [(k, k, float) for k in ("diff", "min_diff", "max_diff", "samples_per_insert")]
    + [(k, k, bool) for k in ("can_insert", "can_sample", "closed")])
# (dict key, rs_table_counts field in ns) of the durations, converted to seconds.
_SECONDS = (("lock_hold_seconds", "lock_hold_ns"), ("insert_blocked_seconds", "insert_blocked_ns"),
            ("sample_blocked_seconds", "sample_blocked_ns"))


def _quantile(hist: List[int], q: float) -> float:
  """Upper bound (s) of the bucket holding quantile q of the hold histogram; 0.0 when empty.

  The true quantile lies within a factor of 2 below the value returned (log2 buckets); the
  last bucket reports its lower bound, 2**29 ns.
  """
  total = sum(hist)
  if total == 0:
    return 0.0
  rank, seen = q * total, 0
  for b, count in enumerate(hist):
    seen += count
    if seen >= rank and count:
      bound = HOLD_BUCKET_BOUNDS[b]
      return bound if bound != float("inf") else HOLD_BUCKET_BOUNDS[b - 1]
  return HOLD_BUCKET_BOUNDS[-2]


def read_table(seg, index: int) -> dict:
  """Counters and rate-limiter state of table `index` of segment `seg`, without locking.

  Returns a dict with
    name; totals since the server started: inserts, samples, updates (priority updates,
    including inserts of an existing key), deletes (by mutate_priorities), evictions (removed
    by the remover of a full table), expirations (removed on reaching max_times_sampled),
    insert_bytes (payload bytes referenced by inserted items), lock_holds, lock_hold_seconds,
    lock_hold_histogram (counts per bucket of HOLD_BUCKET_BOUNDS), lock_hold_p50_seconds and
    lock_hold_p99_seconds (upper bound of the bucket holding the quantile: within 2x),
    insert_blocked_seconds / sample_blocked_seconds (time callers spent blocked on the rate
    limiter);
    gauges: items, max_size, episodes, full (items == max_size), blocked_inserters and
    blocked_samplers (threads blocked on the rate limiter now), can_insert and can_sample (the
    limiter admits one more now), limiter_inserts / limiter_samples / limiter_deletes (the
    limiter's counters, zeroed by a reset), diff (limiter_inserts * samples_per_insert -
    limiter_samples), min_diff, max_diff, samples_per_insert, min_size_to_sample, closed.

  Each figure is a moment's value of a table in use, not one consistent snapshot.
  """
  out = ffi.new("rs_table_counts *")
  check(lib.rs_counters_read(seg.base, index, out), f"reading counters of table {index}")
  hist = list(out.hold_hist)
  stats = {"name": seg.table_names()[index]}
  for key, field, kind in _FIELDS:
    stats[key] = kind(getattr(out, field))
  for key, field in _SECONDS:
    stats[key] = getattr(out, field) * 1e-9
  stats.update(lock_hold_histogram=hist, lock_hold_p50_seconds=_quantile(hist, 0.5),
               lock_hold_p99_seconds=_quantile(hist, 0.99), full=out.size >= out.max_size)
  return stats


def processes(seg) -> List[dict]:
  """The processes attached to `seg`: dicts of pid, slot, pins (live pins: chunks held by
  writers and sampled items held) and alive (False for a dead process not reaped yet)."""
  info = seg.info()
  cap = info["max_procs"]
  out = ffi.new("rs_proc_info[]", cap)
  n = ffi.new("uint32_t *")
  check(lib.rs_proc_list(seg.base, out, cap, n), "listing attached processes")
  # The core checks that each pid exists; its start time tells a reused pid from the process,
  # and the slot's liveness lock a process of another pid namespace.
  return [{"pid": int(p.pid), "slot": int(p.slot), "pins": int(p.pins),
           "alive": bool(p.alive) and (shm._owner_alive(p.pid, p.start_time)  # pylint: disable=protected-access
                                       or seg.slot_locked(int(p.slot)))}
          for p in out[0:n[0]]]


def read_server(seg) -> dict:
  """Server-wide figures of segment `seg` plus read_table of every table, without locking.

  Returns a dict with name, owner_pid, arena_bytes, arena_used_bytes, arena_free_bytes, chunks
  (chunks in the arena), descriptors (item descriptor blocks), max_procs, processes (see
  processes()), closed, and tables: {table name: read_table(...)}.
  """
  info = seg.info()
  tables: Dict[str, dict] = {}
  for i, name in enumerate(seg.table_names()):
    tables[name] = read_table(seg, i)
  return {
      "name": seg.name,
      "owner_pid": int(info["owner_pid"]),
      "arena_bytes": int(info["arena_size"]),
      "arena_used_bytes": int(info["arena_used"]),
      "arena_free_bytes": int(info["arena_free"]),
      "chunks": int(info["num_chunks"]),
      "descriptors": int(info["num_descs"]),
      "max_procs": int(info["max_procs"]),
      "processes": processes(seg),
      "closed": bool(info["closed"]),
      "tables": tables,
  }
