"""C insert plans: Client.insert of one step and SharedTable.insert of a batch in one C call
(and StepInserter.insert's staging of a step, `stager`).

A plan (reverb_shm._hot.InsertPlan, csrc/hot/hot_insert.c) is made for one table, one
registration of this process with the segment and one data layout (nest structure, and per
leaf its kind, dtype and shape) that the Python insert path has already checked against the
table. Its insert() takes data of exactly that layout, copies it into shared memory and inserts
the item(s) with one core call (rs_insert_rows, GIL released); for anything else it does nothing
and returns None, and the caller takes its Python path, which validates and raises. A plan is
never used after its registration ends (segment closed, fork: the C side checks the segment's
registration object and a fork counter), so a forked child makes its own.

Client.insert into several tables (client_insert) takes one C call when every table has a plan
of the same layout: the step is written once, into the first table's open chunks, and each
table's item references that row.

Open chunks: a plan appends the rows of small inserts (one step, or a batch of at most a quarter
of its chunk capacity) to chunks it holds open (16 rows growing to _OPEN_MAX_ROWS, about
_OPEN_CHUNK_BYTES per column; rs_open_chunks, rs_insert_rows_at), so consecutive items cost
their payload plus a few bytes and share one descriptor block. A full set is released (pins
dropped) by its last user; the set in use is released, shrunk to the rows used, when the plan
is garbage collected (_open_release).

Layouts a plan takes: nests of dicts with str keys, lists and tuples (exactly those types) whose
leaves are numeric numpy arrays, numpy scalars, or Python float / int / bool (numpy's float64 /
int64 / bool); for batched plans (SharedTable.insert), arrays with a leading batch dim only.
"""
import math
import os
from typing import Any, Optional

import numpy as np

from reverb_shm._internal import timeouts
from reverb_shm._internal._lib import check, ffi, hot, lib

__all__ = ["PlanCache", "client_insert", "finish", "open_release", "open_rows", "stager",
           "template"]

_MAX_PLANS = 64   # layouts remembered per table and registration
_MAX_NODES = 256  # containers and leaves of a template (csrc/hot/hot_insert.c HOT_MAX_NODES)
_MAX_LEAVES = 64  # ColumnWriter's limit
_PY_VALUES = {float: np.dtype(np.float64), int: np.dtype(np.int64), bool: np.dtype(np.bool_)}
_NUMPY_SCALARS = frozenset(t for t in np.sctypeDict.values()
                           if issubclass(t, np.generic) and np.dtype(t).kind in "biufc")
_INT64_MIN, _INT64_END = -2**63, 2**63
# Open chunks (csrc/hot/hot_insert.c): a plan appends small inserts to chunks it holds open, of
# up to _OPEN_MAX_ROWS rows and about _OPEN_CHUNK_BYTES per column, but at least _OPEN_MIN_ROWS
# rows (opening and releasing a set costs a few us: a 28 KB frame still takes 16 rows); rows
# above _OPEN_ROW_BYTES get chunks of their own.
_OPEN_MAX_ROWS = 256
_OPEN_MIN_ROWS = 16
_OPEN_CHUNK_BYTES = 64 << 10
_OPEN_ROW_BYTES = 64 << 10
# rs_insert_rows flags: Client.insert draws each item's key and episode id; SharedTable.insert
# draws keys (episode id 0).
_ROWS_FLAGS = {False: lib.RS_ROWS_RANDOM_KEYS | lib.RS_ROWS_RANDOM_EPISODE,
               True: lib.RS_ROWS_RANDOM_KEYS}

client_insert = hot.client_insert


def template(nest: Any, batched: bool) -> Optional[tuple]:
  """The InsertPlan template of `nest` (format in csrc/hot/hot_insert.c), or None when a plan
  cannot take its layout. Equal templates mean equal layouts: it is the plan cache key.

  Args:
    nest: one step (Client.insert) or a batch whose array leaves share a leading dim (batched).
    batched: the leaves' leading dim is the batch (not part of the layout).
  """
  t = type(nest)
  if t is dict:
    if not all(type(k) is str for k in nest):
      return None
    keys = tuple(sorted(nest))
    children = tuple([template(nest[k], batched) for k in keys])
    return None if any(c is None for c in children) else (0, keys, children)
  if t is list or t is tuple:
    children = tuple([template(x, batched) for x in nest])
    return None if any(c is None for c in children) else (1 if t is list else 2, children)
  if t is np.ndarray:
    dtype = nest.dtype
    if dtype.kind not in "biufc" or dtype.fields is not None or (batched and nest.ndim == 0):
      return None
    return (3, "a", dtype, nest.shape[1:] if batched else nest.shape)
  if batched:
    return None
  if t in _PY_VALUES:
    if t is int and not _INT64_MIN <= nest < _INT64_END:   # numpy makes it uint64 or refuses
      return None
    return (3, "v", _PY_VALUES[t])
  if t in _NUMPY_SCALARS:
    return (3, "v", np.dtype(t))
  return None


def _columns(spec: tuple, out: list) -> list:
  """(dtype, item shape) of each leaf of template `spec`, in order, appended to `out`."""
  if spec[0] == 3:
    out.append((spec[2], spec[3] if spec[1] == "a" else ()))
  else:
    for child in spec[-1]:
      _columns(child, out)
  return out


def _count_nodes(spec: tuple) -> int:
  return 1 if spec[0] == 3 else 1 + sum(_count_nodes(c) for c in spec[-1])


class PlanCache:
  """InsertPlans of one table by layout, for the segment registration current when made.

  Args:
    batched: plans for SharedTable.insert batches (True) or Client.insert steps (False).
    owner: stored in each plan's context for `finish` (Client plans: their SharedTable); None
      when the caller passes the table to `finish` (a SharedTable caching its own plans must not
      be referenced by them).
  """

  __slots__ = ("_batched", "_owner", "_registration", "_plans")

  def __init__(self, batched: bool, owner=None):
    self._batched = batched
    self._owner = owner
    self._registration = None
    self._plans: dict = {}

  def get(self, table, data, columns: tuple, writer) -> Optional[Any]:
    """The plan inserting data shaped like `data` into `table` through `writer`, or None.

    Args:
      table: the SharedTable.
      data: the step (or batch) just inserted by the Python path.
      columns: (dtype, item shape) per leaf of `data`, which `writer` was made for after the
        Python path checked them against the table.
      writer: the chunks.ColumnWriter of `columns`.
    """
    spec = template(data, self._batched)
    if spec is None:
      return None
    seg = table._seg  # pylint: disable=protected-access
    slot, generation = seg.registration()
    registration = seg._registration  # pylint: disable=protected-access
    if registration is None or registration[1:] != (slot, generation):
      return None   # closed or re-registered meanwhile: the next call tries again
    if registration is not self._registration:
      self._registration, self._plans = registration, {}
    plan = self._plans.get(spec)
    if plan is None:
      plan = _make_plan(table, spec, self._batched, columns, writer, registration,
                        (writer, generation, 1 if self._batched else 0, self._owner))
      if plan is None:
        return None
      if len(self._plans) >= _MAX_PLANS:
        self._plans.clear()
      self._plans[spec] = plan
    return plan


def _make_plan(table, spec: tuple, batched: bool, columns: tuple, writer, registration,
               context: tuple, **stager):
  """The InsertPlan of template `spec` for `table` (None if `spec` does not describe `columns`
  or is too large); `stager`: InsertPlan's stage_rows, stage_priorities and capacity."""
  if (_count_nodes(spec) > _MAX_NODES or len(columns) > _MAX_LEAVES
      or _columns(spec, []) != [(np.dtype(d), tuple(s)) for d, s in columns]):
    return None
  seg, squeeze = table.segment, 1 if batched else 0
  if not stager:
    rows = _open_rows(columns)
    if rows:
      stager = {"open_rows": rows, "release": _open_release(seg, registration),
                "open_flags": _ROWS_FLAGS[batched] & lib.RS_ROWS_RANDOM_EPISODE}
  return hot.InsertPlan(
      spec, batched, seg, registration, seg.address, registration[1], table.index,
      int(ffi.cast("uintptr_t", writer.metas)),
      int(ffi.cast("uintptr_t", writer.squeeze_flags[squeeze])),
      _ROWS_FLAGS[batched], table._prioritized(),  # pylint: disable=protected-access
      timeouts.SLICE_NS, timeouts.deadline_from_ms, context, **stager)


def _open_rows(columns: tuple) -> int:
  """Largest open-chunk capacity in rows for steps of `columns` ((dtype, item shape) per leaf);
  0 when a row is too large to share a chunk."""
  row = max(np.dtype(d).itemsize * math.prod(s) for d, s in columns)
  if row > _OPEN_ROW_BYTES:
    return 0
  return min(_OPEN_MAX_ROWS, max(_OPEN_MIN_ROWS, _OPEN_CHUNK_BYTES // max(row, 1)))


def _open_release(seg, registration: tuple):
  """release(offs, pins, rows, capacity) of a plan's retired open chunks (offsets and pins, one
  per column; rows published of capacity): shrinks each chunk to its rows and drops its pin,
  only while `registration` is this process's current one (after Segment.close or a fork the
  pins are gone or not ours: nothing to do)."""

  slot = registration[1]

  def release(offs: tuple, pins: tuple, rows: int, capacity: int) -> None:
    with seg._slot_lock:  # pylint: disable=protected-access  (against a concurrent close)
      if seg._registration is not registration or os.getpid() != registration[0]:  # pylint: disable=protected-access
        return
      if 0 < rows < capacity:   # (a chunk with no row is freed by the unpin)
        for off in offs:
          check(lib.rs_chunk_shrink(seg.base, off, rows), "shrinking an open chunk")
      check(lib.rs_unpin(seg.base, slot, len(pins), pins), f"releasing {len(pins)} pins")
  return release


open_rows = _open_rows          # (also used by the gRPC bridge's one-call inserts)
open_release = _open_release


def stager(table, step, columns: tuple, writer, rows: list, priorities: np.ndarray):
  """StepInserter's one-call staging of steps shaped like `step` (its first, checked step), or
  None when a plan cannot take that layout.

  Returns:
    stage(step, priority, row) -> bool: copies a step of exactly that layout into row `row` of
    `rows` (one C-contiguous (capacity, *item shape) array per leaf) and the priority (a
    finite float or an int a float64 holds exactly, >= 0 on a Prioritized table) into
    priorities[row]; False, writing nothing, for anything else.
  """
  spec = template(step, False)
  if spec is None:
    return None
  registration = (None, 0, 0)   # (stage() never inserts: it is never compared)
  plan = _make_plan(table, spec, False, columns, writer, registration, (rows, priorities),
                    stage_rows=tuple(r.ctypes.data for r in rows),
                    stage_priorities=priorities.ctypes.data, capacity=len(priorities))
  return None if plan is None else plan.stage


def finish(result: tuple, table, priorities, timeout_ms):
  """Completes an InsertPlan.insert whose core call returned a status other than RS_OK (the
  tuple it returned as `result`), as the Python path would: raises the error, or inserts the
  items still to insert after a rate-limiter wait slice. Returns the keys (uint64[n] for a
  batch, an int for one step).

  Args:
    result: (plan, status, done, deadline_ns, keys, chunk offsets, pins).
    table: the plan's SharedTable, or None when its context holds it.
    priorities: the priority (one step) or the batch's priorities, as passed to insert().
    timeout_ms: as passed to insert() (for messages).

  Raises:
    As SharedTable._finish_rows (DeadlineExceededError with `inserted`, the core's errors).
  """
  # pylint: disable=protected-access
  plan, rc, done, deadline_ns, keys, chunk_offs, pins = result
  writer, generation, squeeze, owner = plan.context
  table = owner if table is None else table
  if type(keys) is int:
    n, keys_c, prios_c = 1, ffi.new("uint64_t *", keys), ffi.new("double *", float(priorities))
  else:
    n, keys_c = len(keys), ffi.from_buffer("uint64_t[]", keys)
    prios_c = ffi.from_buffer("double[]", table._priorities(priorities, n))
  table._finish_rows(rc, done, chunk_offs, pins, generation, writer, n, keys_c, prios_c, squeeze,
                     deadline_ns, timeout_ms)
  return keys

