"""SharedTable: the handle actors and learners use on a table, from any process.

All batched operations make one C call per batch (plus one per column for gathers). Every
argument is validated here before anything reaches shared memory. Thread-safe: the C core
locks the table; a SharedTable may be shared between threads.
"""
import math
import operator
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from reverb_shm import errors, specs
from reverb_shm import step_inserter as step_inserter_lib
from reverb_shm._internal import chunks, counters, hot_plans, structure, timeouts
from reverb_shm._internal import columns as columns_lib
from reverb_shm._internal._lib import check, ffi, hot, lib
from reverb_shm._internal.shm import Segment
from reverb_shm._internal.table_info import TableInfo, table_info
from reverb_shm.replay_sample import ReplaySample, SampleInfo
from reverb_shm.selectors import PRIORITIZED

__all__ = ["SharedTable"]


_INF = math.inf
_MAX_PLANS = 64   # validated column layouts remembered per table (SharedTable.insert)
_GATHER_TEMPLATES: dict = {}   # column layout -> rs_gather_col[] with its out pointers unset


def _as_u64(ptr_array):
  return ffi.from_buffer("uint64_t[]", ptr_array)


class SharedTable:
  """A table of a running server.

  Args:
    segment: the server's :class:`~reverb_shm._internal.shm.Segment`.
    table_index: index of the table in the segment.
  """

  def __init__(self, segment: Segment, table_index: int):
    self._seg = segment
    self._index = int(table_index)
    self._name = segment.table_names()[self._index]
    self._quoted_name = errors.quoted_name(self._name)   # (error texts of the hot paths)
    self._signature = None
    self._signature_loaded = False
    self._signature_tree: Any = None   # (number of leaves, treedef) of the signature
    self._validates_negative: Optional[bool] = None
    self._priority_bound: Optional[float] = None
    self._column_writers: dict = {}     # (dtype, shape) per column -> chunks.ColumnWriter
    self._insert_plans: dict = {}       # (dtype, batch shape) per leaf of a valid batch -> writer
    self._hot_plans = hot_plans.PlanCache(batched=True)   # C one-call plans by batch layout
    self._hot_plan = None         # the plan of the last batch layout inserted
    self._gather_layout: Any = None   # ((dtype, item shape, bytes) per column) of sampled items
    self._out_cache: Any = None   # (layout, out, leaves, rows, rs_gather_col[], address, dtypes)

  @classmethod
  def attach(cls, name: str) -> "SharedTable":
    """Attaches to 'SERVER/TABLE' (see Server.shared_table_name).

    Raises:
      ValueError: malformed name.
      ServerUnavailableError: no such server.
      UnknownTableError: no such table (the message lists the available ones).
    """
    if not isinstance(name, str) or name.count("/") != 1:
      raise ValueError(f"shared table name must look like 'SERVER/TABLE', got "
                       f"{errors.quoted_name(name)}")
    server, table = name.split("/")
    seg = Segment.attach(server)
    return cls(seg, seg.table_index(table))

  def __reduce__(self):
    return SharedTable.attach, (f"{self._seg.name}/{self._name}",)

  # ---- properties
  name = property(lambda self: self._name)
  segment = property(lambda self: self._seg)
  index = property(lambda self: self._index)

  @property
  def signature(self):
    """The table's signature nest of TensorSpec, or None."""
    if not self._signature_loaded:
      config = self._seg.table_config(self._index)
      self._signature = specs.decode_signature(config.get("signature"))
      self._signature_loaded = True
    return self._signature

  def _prioritized(self) -> bool:
    if self._validates_negative is None:
      s = self._seg.stats(self._index)
      self._validates_negative = PRIORITIZED in (s["sampler_kind"], s["remover_kind"])
    return bool(self._validates_negative)

  @property
  def priority_bound(self) -> float:
    """Priorities up to this value are within the sum-tree weight cap of every Prioritized
    selector of the table (+inf without one); a larger one is checked exactly by
    check_priority_cap. Read once from the table's fixed configuration."""
    bound = self._priority_bound
    if bound is None:
      raw = lib.rs_table_priority_bound(self._seg.base, self._index)
      bound = self._priority_bound = raw * (1 - 1e-9) if raw < _INF else _INF
    return bound

  def check_priority_cap(self, priorities) -> None:
    """Raises, changing nothing, unless an insert would admit every one of `priorities`.

    Args:
      priorities: float or float64[n].

    Raises:
      InvalidArgumentError (a ValueError): a priority that is not finite, negative on a
        Prioritized table, or whose weight priority ** exponent exceeds the table's sum-tree
        cap (float64 max / (2 * leaves)), so that the weights' total stays finite.
    """
    p = np.ascontiguousarray(priorities, np.float64).reshape(-1)
    check(lib.rs_check_priorities(self._seg.base, self._index, len(p),
                                  ffi.from_buffer("double[]", p)),
          "checking priorities")

  def __repr__(self):
    return f"SharedTable({self._seg.name}/{self._name})"

  # ---- validation helpers
  def _priorities(self, priorities, n: int, what: str = "priorities") -> np.ndarray:
    try:
      if type(priorities) is float or (type(priorities) is np.ndarray
                                       and priorities.dtype.kind == "f"):
        p = np.asarray(priorities, dtype=np.float64)   # (the common calls: nothing to refuse)
      else:
        p = np.asarray(priorities)
        if p.dtype.kind not in "biuf":   # (numpy would parse strings: '2.5' -> 2.5)
          raise TypeError
        p = p.astype(np.float64, copy=False)
    except (TypeError, ValueError):
      raise ValueError(f"{what} must be numbers, got {priorities!r:.80}") from None
    if p.ndim == 0:
      p = np.full(n, float(p))
    if p.shape != (n,):
      raise ValueError(f"{what} must have shape ({n},) (one per item), got {p.shape}")
    if n:
      if n <= 32:  # plain floats beat numpy reductions on the writer's small batches
        values = p.tolist()
        finite = all(map(math.isfinite, values))
        negative = finite and min(values) < 0
      else:
        finite = bool(np.isfinite(p).all())
        negative = finite and bool((p < 0).any())
      if not finite:
        bad = p[~np.isfinite(p)][0]
        raise ValueError(f"{what} must be finite, got {bad} (table {self._quoted_name})")
      if negative and self._prioritized():
        raise ValueError(f"{what} must be >= 0 for a Prioritized table, got {p[p < 0][0]} "
                         f"(table {self._quoted_name})")
    return np.ascontiguousarray(p)

  @staticmethod
  def _keys(keys, n: Optional[int] = None, what: str = "keys") -> np.ndarray:
    if isinstance(keys, np.ndarray) or np.isscalar(keys) and not isinstance(keys, int):
      arr = np.asarray(keys)
    else:
      # Python ints: numpy would turn a mix of keys above and below 2**63 into float64.
      items = [keys] if isinstance(keys, int) else list(keys)
      bad = [k for k in items if isinstance(k, bool) or not isinstance(k, (int, np.integer))]
      if bad:
        raise ValueError(f"{what} must be unsigned 64-bit integers, got {bad[0]!r}")
      try:
        arr = np.array(items, dtype=np.uint64)
      except OverflowError:
        raise ValueError(f"{what} must be in [0, 2**64), got "
                         f"{next(k for k in items if not 0 <= int(k) < 2**64)}") from None
    if arr.ndim == 0:
      arr = arr[None]
    if arr.size and arr.dtype.kind not in "ui":
      raise ValueError(f"{what} must be unsigned 64-bit integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and (arr < 0).any():
      raise ValueError(f"{what} must be >= 0, got {arr[arr < 0][0]}")
    arr = np.ascontiguousarray(arr, dtype=np.uint64)
    if arr.ndim != 1 or (n is not None and len(arr) != n):
      raise ValueError(f"{what} must have shape ({n if n is not None else 'n'},), "
                       f"got {arr.shape}")
    return arr

  def limiter_message(self, side: str, timeout_ms) -> str:
    """Why `side` ('insert' / 'sample') timed out after `timeout_ms`: the limiter's counters."""
    return self._limiter_message(side, timeout_ms)

  def _limiter_message(self, side: str, timeout_ms) -> str:
    s = self._seg.stats(self._index)
    return (f"Rate limiter timeout on table {self._quoted_name}: {side} blocked for {timeout_ms} "
            f"ms "
            f"(size={s['size']}, inserts={s['inserts']}, samples={s['samples']}, "
            f"deletes={s['deletes']}, min_size_to_sample={s['min_size_to_sample']}, "
            f"samples_per_insert={s['samples_per_insert']}, min_diff={s['min_diff']}, "
            f"max_diff={s['max_diff']})")

  # ---- low level
  def insert_descriptors(self, keys, priorities, blob: bytes, offs, timeout_ms=None, *,
                         deadline_ns: Optional[int] = None) -> int:
    """Inserts n items described by descriptor blobs, in order (see chunks.encode_descriptor).

    The one low-level insert: Client.insert, TrajectoryWriter and :meth:`insert` use it. It
    waits for the rate limiter in slices of timeouts.SLICE_NS so Ctrl-C works.

    Args:
      keys: uint64[n] item keys (an existing key updates that item's priority).
      priorities: float64[n], finite (>= 0 for Prioritized tables).
      blob: concatenated descriptors; item i is blob[offs[i]:offs[i+1]].
      offs: uint64[n+1].
      timeout_ms: None waits forever for the rate limiter, 0 polls, else milliseconds.
      deadline_ns: absolute CLOCK_MONOTONIC deadline (-1: none, 0: do not wait) used instead
        of `timeout_ms`, for callers sharing one deadline between calls; `timeout_ms` then
        only appears in the message.

    Returns:
      n.

    Raises:
      ValueError: malformed input (nothing inserted).
      DeadlineExceededError: the limiter did not admit every item in time. Its `inserted`
        attribute says how many of the first items were inserted (the rest were not); the
        message gives the limiter counters.
      TableClosedError: the server stopped.
      ResourceExhaustedError: the descriptor arena is full.
    """
    keys = self._keys(keys)
    n = len(keys)
    prios = self._priorities(priorities, n)
    offs = np.ascontiguousarray(offs, dtype=np.uint64)
    if offs.shape != (n + 1,):
      raise ValueError(f"offs must have shape ({n + 1},), got {offs.shape}")
    # The C core checks that offs never decrease and validates every descriptor.
    if n and (offs[0] != 0 or offs[-1] != len(blob)):
      raise ValueError(f"offs must increase from 0 to len(blob)={len(blob)}, got {offs}")
    if deadline_ns is None:
      deadline_ns = timeouts.deadline_from_ms(timeout_ms)
    if n == 0:
      return 0
    return self._insert_validated(n, _as_u64(keys), ffi.from_buffer("double[]", prios),
                                  ffi.from_buffer("uint8_t[]", blob), _as_u64(offs),
                                  deadline_ns, timeout_ms)

  def _insert_validated(self, n: int, keys_c, prios_c, blob_c, offs_c, deadline_ns: int,
                        timeout_ms) -> int:
    """insert_descriptors after validation: C buffers of n keys/priorities, blob, n+1 offsets."""
    base, slot, table = self._seg.base, self._seg.slot, self._index
    return self._insert_loop(n, lambda i, done: lib.rs_insert(
        base, slot, table, n - i, keys_c + i, prios_c + i, blob_c, offs_c + i, deadline_ns,
        timeouts.SLICE_NS, done), timeout_ms)

  def _insert_slices_validated(self, n: int, keys_c, prios_c, writer: chunks.ColumnWriter,
                               slices_c, squeeze: int, deadline_ns: int, timeout_ms) -> int:
    """rs_insert_slices of n validated items (keys_c NULL: random keys); as _insert_validated."""
    base, slot, table, ncols = self._seg.base, self._seg.slot, self._index, writer.ncols
    flags = writer.squeeze_flags[squeeze]
    return self._insert_loop(n, lambda i, done: lib.rs_insert_slices(
        base, slot, table, n - i, keys_c if keys_c == ffi.NULL else keys_c + i, prios_c + i,
        ncols, slices_c + i * ncols, flags, deadline_ns, timeouts.SLICE_NS, done), timeout_ms)

  def _insert_rows(self, writer: chunks.ColumnWriter, n: int, keys_c, prios_c, buffers,
                   squeeze: int, flags: int, deadline_ns: int, timeout_ms,
                   episode_id: int = 0) -> int:
    """rs_insert_rows of n validated items: column c of item i is row i of buffers[c] (n rows
    of the writer's column c each); one C call writes, inserts and releases the chunks.
    `episode_id` goes into the chunk headers (unless flags draw one).

    When the rate limiter makes the call wait past a slice, the chunks it wrote and still holds
    are inserted by _insert_slices_validated and released here. Returns n.

    Raises:
      DeadlineExceededError: with `inserted` = items inserted before the deadline.
      ResourceExhaustedError: the arena is full (nothing written).
      ReverbError: the C core's error (via _lib.check).
    """
    seg = self._seg
    slot, generation = seg.registration()
    ncols = writer.ncols
    out = ffi.new("uint64_t[]", ncols + ncols // 2 + 1)   # chunk offsets, pins, done
    pins_c = ffi.cast("uint32_t *", out + ncols)
    done_c = pins_c + ncols
    rc = lib.rs_insert_rows(seg.base, slot, self._index, n, keys_c, prios_c, ncols, writer.metas,
                            buffers, writer.squeeze_flags[squeeze], episode_id, flags, deadline_ns,
                            timeouts.SLICE_NS, out, pins_c, done_c)
    if rc == lib.RS_OK:
      return n
    return self._finish_rows(rc, done_c[0], list(out[0:ncols]),
                             np.frombuffer(ffi.buffer(pins_c, 4 * ncols), np.uint32), generation,
                             writer, n, keys_c, prios_c, squeeze, deadline_ns, timeout_ms)

  def _finish_rows(self, rc: int, done: int, chunk_offs: list, pins, generation: int,
                   writer: chunks.ColumnWriter, n: int, keys_c, prios_c, squeeze: int,
                   deadline_ns: int, timeout_ms) -> int:
    """Finishes an rs_insert_rows call (_insert_rows, or reverb_shm._hot's InsertPlan) that
    returned `rc` != RS_OK having inserted `done` items: raises its error, or (RS_EAGAIN) inserts
    the rest from the chunks it still holds (chunk_offs / pins per column, taken under
    registration `generation`) and releases them. Returns n; raises as _insert_rows."""
    if rc != lib.RS_EAGAIN:
      if rc == lib.RS_ETIMEDOUT:
        raise errors.DeadlineExceededError(
            f"{self._limiter_message('insert', timeout_ms)}; {done} of {n} items inserted",
            inserted=done)
      check(rc, f"inserting into table {self._quoted_name} ({done} of {n} items inserted)"
            + (self._seg.arena_hint if rc == lib.RS_ENOSPC else ""))
    # Waiting past one slice: finish the held chunks' items here so Ctrl-C is handled.
    pins = chunks.Pins(self._seg, generation, np.asarray(pins, np.uint32))
    try:
      slices = writer.row_slices(chunk_offs, n)
      try:
        self._insert_slices_validated(n - done, keys_c + done, prios_c + done, writer,
                                      slices + done * writer.ncols, squeeze, deadline_ns,
                                      timeout_ms)
      except errors.DeadlineExceededError as e:
        total = done + e.inserted
        raise errors.DeadlineExceededError(
            f"{self._limiter_message('insert', timeout_ms)}; {total} of {n} items inserted",
            inserted=total) from None
    finally:
      pins.release()
    return n

  def _insert_loop(self, n: int, insert_from, timeout_ms) -> int:
    """Calls insert_from(i, done) -- one C insert of items [i, n) reporting progress in
    done[0] -- again after each wait slice (RS_EAGAIN) until all n are in; returns n.

    Raises:
      DeadlineExceededError: with `inserted` = items inserted before the deadline.
      ReverbError: the C core's error (via _lib.check).
    """
    done = ffi.new("uint32_t *")
    total = 0
    while True:
      rc = insert_from(total, done)
      total += done[0]
      if rc == lib.RS_OK and total >= n:
        return n
      if rc == lib.RS_ETIMEDOUT:
        raise errors.DeadlineExceededError(
            f"{self._limiter_message('insert', timeout_ms)}; {total} of {n} items inserted",
            inserted=total)
      if rc != lib.RS_EAGAIN and rc != lib.RS_OK:
        check(rc, f"inserting into table {self._quoted_name} ({total} of {n} items inserted)")

  def sample_records(self, n: int, timeout_ms=None) -> Tuple[np.ndarray, chunks.Pins]:
    """Samples up to n items; returns (records of dtype chunks.SAMPLE_REC, their Pins).

    A flexible batch: at the deadline, the items collected so far are returned if >= 1.

    Raises:
      ValueError: n < 1.
      DeadlineExceededError: no item could be sampled before the deadline.
      TableClosedError: the server stopped.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n < 2**31:
      raise ValueError(f"number of samples must be an int >= 1, got {n!r}")
    deadline = timeouts.deadline_from_ms(timeout_ms)
    slot, generation = self._seg.registration()
    recs = np.zeros(int(n), chunks.SAMPLE_REC)
    out = ffi.cast("rs_sample_rec *", ffi.from_buffer(recs, require_writable=True))
    got = ffi.new("uint32_t *", 0)
    rc = lib.RS_EAGAIN
    try:
      while rc == lib.RS_EAGAIN:
        rc = lib.rs_sample(self._seg.base, slot, self._index, n, deadline, timeouts.SLICE_NS,
                           out, got)
    finally:
      pins = chunks.Pins(self._seg, generation, recs["pin"][:got[0]])
    if rc == lib.RS_OK or (rc == lib.RS_ETIMEDOUT and got[0] > 0):
      return recs[:got[0]], pins
    pins.release()
    if rc == lib.RS_ETIMEDOUT:
      raise errors.DeadlineExceededError(self._limiter_message("sample", timeout_ms))
    check(rc, f"sampling from table {self._quoted_name}")
    raise AssertionError(f"rs_sample returned {rc}")

  def _sample_now(self, n: int) -> Tuple[np.ndarray, Optional[chunks.Pins]]:
    """Samples up to n >= 1 items that the rate limiter allows without waiting (maybe none).

    Returns:
      (records of dtype chunks.SAMPLE_REC, their Pins or None when no item was sampled).
    """
    slot, generation = self._seg.registration()
    recs = np.empty(n, chunks.SAMPLE_REC)
    got = ffi.new("uint32_t *", 0)
    rc = lib.rs_sample(self._seg.base, slot, self._index, n, 0, 0,
                       ffi.cast("rs_sample_rec *", ffi.from_buffer(recs, require_writable=True)),
                       got)
    b = got[0]
    pins = chunks.Pins(self._seg, generation, recs["pin"][:b]) if b else None
    if rc != lib.RS_OK and rc != lib.RS_ETIMEDOUT:
      if pins is not None:
        pins.release()
      check(rc, f"sampling from table {self._quoted_name}")
    return recs[:b], pins

  def mutate(self, updates: Optional[Dict[int, float]] = None,
             deletes: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """Deletes then updates (unknown keys ignored); all-or-nothing validation.

    Returns:
      (number of priorities updated, number of items deleted).
    """
    updates = updates or {}
    if not isinstance(updates, dict):
      raise TypeError(f"updates must be a dict key -> priority, got {type(updates).__name__}")
    upd_keys = self._keys(list(updates.keys()), what="update keys")
    upd_prios = self._priorities(list(updates.values()), len(upd_keys), "updated priorities")
    return self._mutate(upd_keys, upd_prios, self._keys(list(deletes or []), what="deletes"))

  def _mutate(self, upd_keys, upd_prios, del_keys):
    nu, nd = ffi.new("uint32_t *"), ffi.new("uint32_t *")
    check(lib.rs_mutate(self._seg.base, self._index, len(upd_keys), _as_u64(upd_keys),
                        ffi.from_buffer("double[]", upd_prios), len(del_keys),
                        _as_u64(del_keys), nu, nd),
          f"mutating table {self._quoted_name}")
    return nu[0], nd[0]

  def update_priorities(self, keys, priorities) -> int:
    """Sets priorities of existing keys (batched); returns how many keys existed."""
    keys = self._keys(keys)
    return self._mutate(keys, self._priorities(priorities, len(keys)), keys[:0])[0]

  def delete(self, keys) -> int:
    """Deletes items by key (batched; unknown keys ignored); returns how many were deleted."""
    return self._mutate(np.zeros(0, np.uint64), np.zeros(0), self._keys(keys))[1]

  def reset(self) -> None:
    """Removes every item and zeroes the limiter and episode counters."""
    check(lib.rs_reset(self._seg.base, self._index), f"resetting table {self._quoted_name}")

  def stats(self) -> dict:
    """Configuration, rate-limiter counters and operation counters of the table.

    Keys of the table's state (read under its lock): max_size, max_times_sampled, sampler_kind,
    remover_kind, sampler_exponent, remover_exponent, samples_per_insert, min_size_to_sample,
    min_diff, max_diff, size, inserts / samples / deletes (the rate limiter's counters, zeroed
    by reset), num_episodes, num_deleted_episodes, num_unique_samples, closed, inserting_ns /
    sampling_ns (lock-held time), waiting_for_sampling_ns / waiting_for_inserts_ns (blocked
    time), repairs. Plus `counters`: the lock-free operation counters since the server started
    (see :func:`reverb_shm._internal.counters.read_table`: inserts, samples, updates, deletes,
    evictions, expirations, insert_bytes, blocked_inserters, blocked_samplers, lock-hold
    percentiles...).
    """
    stats = self._table_stats()
    stats["counters"] = counters.read_table(self._seg, self._index)
    return stats

  def _table_stats(self) -> dict:
    return self._seg.stats(self._index)

  def _open_stats(self) -> dict:
    stats = self._table_stats()
    if stats["closed"]:
      raise errors.TableClosedError(f"table {self._quoted_name} of server "
                                    f"{errors.quoted_name(self._seg.name)} is "
                                    "closed (the server stopped)")
    return stats

  @property
  def info(self) -> TableInfo:
    """Live TableInfo. Raises TableClosedError once the server stopped."""
    return table_info(self._name, self._open_stats(), self.signature)

  @property
  def size(self) -> int:
    """Items in the table now. Raises TableClosedError once the server stopped."""
    return int(self._open_stats()["size"])

  def _count(self, n, what) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
      raise TypeError(f"{what} must be an int, got {n!r}")
    return int(n)

  def can_sample(self, num_samples: int) -> bool:
    """Rate-limiter predicate of Reverb (ignores max_size and max_times_sampled)."""
    return bool(check(lib.rs_can_sample(self._seg.base, self._index,
                                        self._count(num_samples, "num_samples"))))

  def can_insert(self, num_inserts: int) -> bool:
    """Rate-limiter predicate of Reverb (ignores max_size)."""
    return bool(check(lib.rs_can_insert(self._seg.base, self._index,
                                        self._count(num_inserts, "num_inserts"))))

  def items(self) -> np.ndarray:
    """Every item (dtype chunks.ITEM_REC) in insertion order."""
    cap = max(16, self.size + 16)
    while True:
      out = np.zeros(cap, chunks.ITEM_REC)
      n, size = ffi.new("uint64_t *"), ffi.new("uint64_t *")
      check(lib.rs_table_items(self._seg.base, self._index,
                               ffi.cast("rs_item_rec *", ffi.from_buffer(out)), cap, n, size))
      if size[0] <= cap:
        return out[:n[0]]
      cap = size[0] + 16

  def check(self) -> None:
    """Runs the C invariant checker over the whole segment (see Segment.check).

    Raises:
      CorruptError: an invariant does not hold (the message is the checker's report).
      TableClosedError: the server stopped.
    """
    self._open_stats()
    self._seg.check()

  # ---- high level
  def _columns_of(self, data) -> Tuple[List[np.ndarray], int]:
    leaves, _ = structure.flatten(data)
    if not leaves:
      raise ValueError("data must contain at least one array")
    arrays = [structure.to_array(x) for x in leaves]
    for i, a in enumerate(arrays):
      if a.ndim == 0:
        raise ValueError(f"column {i} is a scalar; every leaf needs a leading batch dimension")
    b = arrays[0].shape[0]
    for i, a in enumerate(arrays):
      if a.shape[0] != b:
        raise ValueError(f"every leaf must have the same batch size: column 0 has {b} rows, "
                         f"column {i} has {a.shape[0]}")
    if b == 0:
      raise ValueError("batch must hold at least one item")
    signature = self.signature
    if signature is not None:
      spec_leaves, _ = structure.flatten(signature)
      if len(spec_leaves) != len(arrays):
        raise ValueError(f"table {self._quoted_name} signature has {len(spec_leaves)} columns, "
                         f"data "
                         f"has {len(arrays)}")
      paths, _, _ = structure.flatten_with_paths(signature)
      for path, spec, a in zip(paths, spec_leaves, arrays):
        dtype = np.dtype(object) if a.dtype.kind == "O" else a.dtype
        if spec is not None and (dtype != spec.dtype or
                                 not specs.shapes_compatible(spec.shape, a.shape[1:])):
          raise ValueError(f"column {path} of table {self._quoted_name}: got dtype {dtype} and "
                           f"item shape {a.shape[1:]}, signature expects {spec.dtype} and "
                           f"{spec.shape}")
    return arrays, b

  def _insert_plan(self, data) -> Tuple[List[np.ndarray], Optional[chunks.ColumnWriter]]:
    """(column arrays, ColumnWriter or None for object columns) of a valid insert batch.

    The checks that depend only on the columns' dtypes and shapes (_columns_of) run once per
    distinct (dtype, shape) tuple; then a batch costs a flatten and a dict lookup.

    Raises:
      ValueError: as _columns_of.
    """
    arrays = columns_lib.step_arrays(data)
    columns = tuple([(a.dtype, a.shape) for a in arrays])
    plans = self._insert_plans
    if columns in plans:
      return arrays, plans[columns]
    arrays, _ = self._columns_of(data)   # raises on invalid input
    writer = None
    if not any(a.dtype.kind == "O" for a in arrays):
      item_columns = tuple((a.dtype, a.shape[1:]) for a in arrays)
      writer = self._column_writers.get(item_columns)
      if writer is None:
        writer = self._column_writers[item_columns] = chunks.ColumnWriter(item_columns)
    if len(plans) >= _MAX_PLANS:
      plans.clear()
    if all(a.dtype.kind != "O" for a in arrays):   # object batches are converted every time
      plans[columns] = writer
    return arrays, writer

  def insert(self, data, priorities, *, keys=None, timeout_ms=None) -> np.ndarray:
    """Inserts B items; item i is row i of every leaf of `data` (no time dimension).

    Args:
      data: nest whose leaves are arrays with a leading batch dim B (same B for all).
      priorities: float or float64[B], finite (>= 0 for Prioritized tables).
      keys: optional uint64[B]; random keys by default.
      timeout_ms: rate limiter wait, None forever, 0 poll.

    Returns:
      uint64[B] keys of the items.

    Raises:
      ValueError: malformed data/priorities/keys or data not matching the signature.
      ResourceExhaustedError: the arena cannot hold the data.
      DeadlineExceededError: the rate limiter did not admit every item in time.
    """
    plan = self._hot_plan
    if plan is not None and keys is None:   # the common case in one C call (hot_plans)
      result = plan.insert(data, priorities, timeout_ms)
      if result is not None:
        return result if type(result) is not tuple else hot_plans.finish(
            result, self, priorities, timeout_ms)
    arrays, writer = self._insert_plan(data)
    b = arrays[0].shape[0]
    if (type(priorities) is float and b == 1 and -_INF < priorities < _INF
        and (priorities >= 0 or not self._prioritized())):
      prios_c = ffi.new("double *", priorities)   # the 1-step hot path: no numpy
    else:
      prios_c = ffi.from_buffer("double[]", self._priorities(priorities, b))
    flags = 0
    if keys is None:
      keys, flags = np.empty(b, np.uint64), lib.RS_ROWS_RANDOM_KEYS
    else:
      keys = self._keys(keys, b)
    deadline = timeouts.deadline_from_ms(timeout_ms)  # validated before anything is written
    if writer is not None:  # numeric columns: one C call
      if flags:   # later batches of this layout: in one C call with the plan
        self._hot_plan = self._hot_plans.get(
            self, data, tuple([(a.dtype, a.shape[1:]) for a in arrays]), writer)
      self._insert_rows(writer, b, _as_u64(keys), prios_c, chunks.row_buffers(arrays),
                        chunks.SQUEEZE, flags, deadline, timeout_ms)
      return keys
    if flags:
      keys[:] = np.frombuffer(os.urandom(8 * b), np.uint64)
    prios = np.frombuffer(ffi.buffer(prios_c, 8 * b), np.float64)
    written = []
    try:
      for a in arrays:
        if a.dtype.kind == "O":
          written.append(chunks.object_chunk(self._seg, list(a)))
        else:
          c = chunks.alloc_chunk(self._seg, a.dtype, a.shape[1:], b)
          written.append(c)
          c.write_rows(a)
      blob, offs = chunks.encode_row_descriptors([c.off for c in written], b)
      self.insert_descriptors(keys, prios, blob, offs, timeout_ms)
    finally:
      for c in written:
        c.release()
    return keys

  def step_inserter(self, capacity: int = 256,
                    timeout_ms: Optional[float] = None) -> step_inserter_lib.StepInserter:
    """A StepInserter: single-step items staged privately and inserted `capacity` at a time.

    The fastest path for one step per call (see reverb_shm.step_inserter): items become
    visible when the staged steps are flushed (buffer full, flush(), close(), end of `with`).

    Args:
      capacity: steps staged before an automatic flush (1..65536).
      timeout_ms: rate limiter wait of each flush (None forever, 0 do not wait).

    Raises:
      ValueError: capacity out of range or a negative timeout.
    """
    return step_inserter_lib.StepInserter(self, capacity, timeout_ms)

  def _structure(self, columns: list):
    """Nests an item's columns as the table signature (when it has one with as many leaves)."""
    if self._signature_tree is None:
      signature = self.signature
      leaves, treedef = ([], None) if signature is None else structure.flatten(signature)
      self._signature_tree = (len(leaves), treedef)
    num_leaves, treedef = self._signature_tree
    if treedef is None or len(columns) != num_leaves:
      return columns
    return structure.unflatten(treedef, columns)

  def sample(self, n: int = 1, timeout_ms=None) -> List[ReplaySample]:
    """Samples up to n items (fewer only at the deadline).

    Returns:
      list of ReplaySample; data columns are read-only zero-copy views into shared memory
      that stay valid while any of them lives (multi-slice and string columns are copies).
    """
    recs, pins = self.sample_records(n, timeout_ms)
    columns = chunks.read_items(self._seg, recs["desc_off"], pins)
    infos = map(SampleInfo, recs["key"].tolist(), recs["probability"].tolist(),
                recs["table_size"].tolist(), recs["priority"].tolist(),
                recs["times_sampled"].tolist())
    structure_of = self._structure
    return [ReplaySample(info, structure_of(cols)) for info, cols in zip(infos, columns)]

  def sample_batch(self, n: int, timeout_ms=None, out=None) -> ReplaySample:
    """Samples up to n items and gathers each column into one (B, ...) array.

    After the first call has learnt the items' column layout (dtype and item shape per column)
    from the first item it samples, one C call samples, gathers every column into the output
    arrays and releases the items. An item of another layout ends the batch before it (it stays
    in the table, unsampled, and its layout is learnt by the next call): B < n then, and
    ValueError if it is the first item.

    Args:
      n: batch size requested.
      timeout_ms: rate limiter wait (flexible batch: B < n only at the deadline).
      out: optional nest (same as the returned data) of arrays of shape (>= n, ...) to fill; the
        returned arrays are out[:B]. Pass the same arrays on every call: they are validated
        once.

    Returns:
      ReplaySample whose info fields are arrays of length B (key uint64, probability float64,
      table_size int64, priority float64, times_sampled int32) and whose data is the signature
      nest (if the table has one) or a flat list of arrays.

    Raises:
      ValueError: n < 1; `out` not matching the items' columns (on the first call: after one
        item was sampled); the first item has another layout than the one learnt.
      DeadlineExceededError: no item could be sampled before the deadline.
      TableClosedError: the server stopped.
    """
    if type(n) is not int and (isinstance(n, bool) or not isinstance(n, (int, np.integer))) or \
        not 1 <= n < 2**31:
      raise ValueError(f"number of samples must be an int >= 1, got {n!r}")
    layout = self._gather_layout
    if layout is None:
      return self._sample_batch_first(n, timeout_ms, out)
    if out is None:
      targets = [np.empty((n,) + shape, dtype) for dtype, shape, _ in layout]
      cols = _gather_cols(layout, targets)
      cols_address = _address(cols)
    else:
      targets, cols, cols_address = self._out_plan(out, layout, n)
    deadline = -1 if timeout_ms is None else timeouts.deadline_from_ms(timeout_ms)
    info = self._gather(n, n, deadline, timeout_ms, layout, cols_address)
    b = len(info.key)
    data = [t if len(t) == b else t[:b] for t in targets]
    return ReplaySample(info, self._structure(data))

  def _gather(self, n: int, wait_n: int, deadline_ns: int, timeout_ms, layout, cols_address: int,
              stop_at_other_layout: bool = False) -> SampleInfo:
    """rs_sample_gather of up to n items (waiting only for the first wait_n) into the columns
    that the rs_gather_col[] at `cols_address` describes (the caller keeps it alive).

    An item of another layout is left unsampled and the layout forgotten (to be learnt again);
    then the items gathered before it are returned (a partial batch), or, when there are none
    and not `stop_at_other_layout`, ValueError is raised.

    Returns:
      SampleInfo of arrays of length B, the items gathered into rows [0, B) of the targets.

    Raises:
      DeadlineExceededError: no item before the deadline. ValueError: an item of another
      layout (see above). TableClosedError: the server stopped.
    """
    seg = self._seg
    # One C call (reverb_shm._hot): the info buffer, rs_sample_gather with the GIL released and
    # the SampleInfo of five arrays viewing that buffer (its layout is rs_sample_gather's).
    rc, info = hot.sample_gather(seg.address, seg.slot, self._index, n, wait_n, deadline_ns,
                                 timeouts.SLICE_NS, len(layout), cols_address, SampleInfo)
    b = len(info.key)
    if rc == lib.RS_ETIMEDOUT and b == 0:
      raise errors.DeadlineExceededError(self._limiter_message("sample", timeout_ms))
    if rc == lib.RS_EINVAL:
      self._gather_layout = None   # relearn on the next call
      if stop_at_other_layout or b:   # items gathered before the other one: a partial batch
        rc = lib.RS_OK
    if rc != lib.RS_OK and rc != lib.RS_ETIMEDOUT:
      check(rc, f"sampling from table {self._quoted_name}")
    return info

  def gather_admitted(self, n: int) -> Optional[Tuple[SampleInfo, List[np.ndarray]]]:
    """Up to n items that the rate limiter admits now, sampled and gathered by one C call into
    new flat (B, ...) columns, once the items' column layout is known (learnt by sample_batch
    or learn_layout); None while it is not.

    B < n when the limiter admits fewer, or before an item of another layout: that item stays
    unsampled and the layout is forgotten (B may then be 0; later calls return None until a
    layout is learnt again).

    Returns:
      (SampleInfo of arrays of length B as sample_batch's, list of (B, ...) column arrays).

    Raises:
      DeadlineExceededError: the limiter admits no item now.
      TableClosedError: the server stopped.
    """
    return self._gather_fresh(n, n, timeouts.deadline_from_ms(0), 0)

  def gather_layout_known(self) -> bool:
    """Whether gather_admitted gathers in C now (a column layout is known)."""
    return self._gather_layout is not None

  def learn_layout(self, columns: Sequence[Tuple[np.dtype, tuple]]) -> None:
    """Remembers the column layout of the table's items for sample_batch / gather_admitted:
    (dtype, per-item shape) of each column. Object columns are never gathered in C: a layout
    with one is not remembered. An item of another layout is still detected when sampled."""
    self._learn_layout([(np.dtype(d), tuple(shape)) for d, shape in columns])

  def _learn_layout(self, columns: Sequence[Tuple[np.dtype, tuple]]) -> None:
    """Remembers the (dtype, item shape, bytes) of each column of a sampled item, unless a
    column holds objects (those items are never gathered in C)."""
    if all(dtype.kind != "O" for dtype, _ in columns):
      self._gather_layout = tuple((dtype, shape, dtype.itemsize * math.prod(shape))
                                  for dtype, shape in columns)

  def _gather_fresh(self, n: int, wait_n: int, deadline_ns: int, timeout_ms):
    """(SampleInfo, columns) of up to n items gathered into new arrays, stopping before an item
    of another layout (see _gather); None while no layout is known."""
    layout = self._gather_layout
    if layout is None:
      return None
    targets = [np.empty((n,) + shape, dtype) for dtype, shape, _ in layout]
    cols = _gather_cols(layout, targets)   # (kept alive for the call)
    info = self._gather(n, wait_n, deadline_ns, timeout_ms, layout, _address(cols),
                        stop_at_other_layout=True)
    b = len(info.key)
    return info, [t if b == n else t[:b] for t in targets]

  def _out_plan(self, out, layout, n: int):
    """(target arrays, rs_gather_col array, its address) for `out`, validated once per (out,
    layout)."""
    plan = self._out_cache
    if plan is not None and plan[0] is layout and plan[1] is out:
      leaves = plan[2]
      same = (type(out) in (list, tuple) and len(out) == len(leaves) and
              all(map(operator.is_, out, leaves)))
      if not same:
        same = all(a is b for a, b in zip(structure.flatten(out)[0], leaves))
      # (an array made read-only, or given another dtype in place, since: validated again)
      if same and plan[3] >= n and all(o.flags.writeable and o.dtype is d
                                       for o, d in zip(leaves, plan[6])):
        return plan[2], plan[4], plan[5]
    leaves, _ = structure.flatten(out)
    if len(leaves) != len(layout):
      raise ValueError(f"out has {len(leaves)} arrays, items have {len(layout)} columns")
    for i, (o, (dtype, shape, _)) in enumerate(zip(leaves, layout)):
      if (not isinstance(o, np.ndarray) or o.dtype != dtype or o.shape[1:] != shape
          or o.ndim == 0 or o.shape[0] < n or not o.flags.writeable
          or not o.flags.c_contiguous):
        raise ValueError(f"out leaf {i} must be a writeable C-contiguous array of dtype {dtype} "
                         f"and shape ({n} or more, *{shape}), got dtype "
                         f"{getattr(o, 'dtype', type(o).__name__)} and shape "
                         f"{getattr(o, 'shape', None)}")
    cols = _gather_cols(layout, leaves)
    self._out_cache = (layout, out, list(leaves), min(o.shape[0] for o in leaves), cols,
                       _address(cols), [o.dtype for o in leaves])
    return self._out_cache[2], cols, self._out_cache[5]

  def _sample_batch_first(self, n: int, timeout_ms, out) -> ReplaySample:
    """sample_batch while no column layout is known: samples one item (waiting as sample_batch
    does), learns its layout and validates `out` against it, then gathers up to n - 1 more of
    that layout in C (waiting until the same deadline), stopping before an item of another
    layout, which stays unsampled. An `out` that does not fit the first item's columns is
    rejected after that one item was sampled (nothing else is)."""
    out_leaves = None
    if out is not None:
      out_leaves, _ = structure.flatten(out)
      for i, o in enumerate(out_leaves):
        if (not isinstance(o, np.ndarray) or o.ndim == 0 or o.shape[0] < n
            or not o.flags.writeable or not o.flags.c_contiguous):
          raise ValueError(f"out leaf {i} must be a writeable C-contiguous array with at least "
                           f"{n} rows, got {getattr(o, 'shape', type(o).__name__)}")
    deadline = -1 if timeout_ms is None else timeouts.deadline_from_ms(timeout_ms)
    recs, pins = self.sample_records(1, timeout_ms)
    try:
      desc = np.ascontiguousarray(recs["desc_off"])
      specs_ = [chunks.column_spec(self._seg, int(desc[0]), c)
                for c in range(len(chunks.item_columns(self._seg, int(desc[0]))))]
      if out_leaves is not None:
        if len(out_leaves) != len(specs_):
          raise ValueError(f"out has {len(out_leaves)} arrays, items have {len(specs_)} columns")
        for i, (o, (dtype, shape, _)) in enumerate(zip(out_leaves, specs_)):
          if o.dtype != dtype or o.shape[1:] != shape:
            raise ValueError(f"out leaf {i} must have dtype {dtype} and shape ({n} or more, "
                             f"*{shape}) as the sampled item's column, got dtype {o.dtype} and "
                             f"shape {o.shape}")
      targets = ([o[:n] for o in out_leaves] if out_leaves is not None else
                 [np.empty((n,) + shape, dtype) for dtype, shape, _ in specs_])
      for c, t in enumerate(targets):
        chunks.gather_column(self._seg, desc, c, t[:1])
    finally:
      pins.release()
    self._learn_layout([(dtype, shape) for dtype, shape, _ in specs_])
    infos = [recs[f].copy() for f in SampleInfo._fields]
    layout = self._gather_layout
    if n > 1 and layout is not None:   # the rest in C (object columns: never gathered in C)
      rest = [t[1:] for t in targets]
      cols = _gather_cols(layout, rest)   # (kept alive for the call)
      try:
        more = self._gather(n - 1, n - 1, deadline, timeout_ms, layout, _address(cols),
                            stop_at_other_layout=True)
      except errors.DeadlineExceededError:   # one item is a batch at the deadline
        more = None
      if more is not None and len(more.key):
        infos = [np.concatenate([a, b]) for a, b in zip(infos, more)]
    elif n > 1:   # object columns: up to n - 1 more, read in Python (all of the first's layout)
      more_pins: Optional[chunks.Pins]
      try:
        more_recs, more_pins = self.sample_records(n - 1, timeouts.remaining_ms(deadline))
      except errors.DeadlineExceededError:
        more_recs, more_pins = recs[:0], None
      if len(more_recs):
        assert more_pins is not None   # (records come with their pins)
        try:
          desc = np.ascontiguousarray(more_recs["desc_off"])
          for c, t in enumerate(targets):
            chunks.gather_column(self._seg, desc, c, t[1:1 + len(desc)])
        finally:
          more_pins.release()
        infos = [np.concatenate([a, more_recs[f]]) for a, f in zip(infos, SampleInfo._fields)]
    b = len(infos[0])
    return ReplaySample(SampleInfo(*infos), self._structure([t[:b] for t in targets]))

def _address(cdata) -> int:
  """The address of a cffi array (for reverb_shm._hot, which takes addresses as ints)."""
  return int(ffi.cast("uintptr_t", cdata))


def _gather_cols(layout, targets):
  """rs_gather_col[] writing column c of sampled item i to row i of targets[c] (C-contiguous).

  The pointers are only valid while `targets` live: callers keep them. The fields that depend
  only on the layout are copied from a template made once per layout.
  """
  template = _GATHER_TEMPLATES.get(layout)
  if template is None:
    template = ffi.new("rs_gather_col[]", len(layout))
    for g, (dtype, shape, col_bytes) in zip(template, layout):
      g.stride = col_bytes
      g.col_bytes = col_bytes
      g.dtype = dtype.str.encode()
      g.ndim = len(shape)
      g.shape[0:len(shape)] = shape
    if len(_GATHER_TEMPLATES) >= _MAX_PLANS:
      _GATHER_TEMPLATES.clear()
    _GATHER_TEMPLATES[layout] = template
  cols = ffi.new("rs_gather_col[]", len(layout))
  ffi.memmove(cols, template, ffi.sizeof(template))
  for g, t in zip(cols, targets):
    g.out = ffi.from_buffer("uint8_t[]", t, require_writable=True)
  return cols
