"""StepInserter: single-step items staged in private rows and inserted in batches.

The fastest way to insert one step per call: `insert(step, priority)` copies the step into
preallocated staging rows; every `capacity` steps (and on flush(), close() or leaving a `with`
block) one C call writes the staged rows to shared memory and inserts them as items, as
SharedTable.insert of the batch would. Items become visible to samplers only at that flush, as
with Reverb's writers, which send items in batches.
"""
import math
import operator
import os
import warnings
from typing import Any, Optional

import numpy as np

from reverb_shm import errors
from reverb_shm._internal import chunks, hot_plans, structure, timeouts
from reverb_shm._internal import columns as columns_lib
from reverb_shm._internal._lib import ffi, lib

__all__ = ["StepInserter"]

class StepInserter:
  """Inserts single-step items into one table in batches of up to `capacity`.

  Build it with :meth:`SharedTable.step_inserter`. The first step fixes the layout: its nest
  structure and, per leaf, the dtype and shape (Python scalars as numpy converts them: int ->
  int64, float -> float64, bool -> bool). Every later step must have exactly that layout.
  Each item holds one step with no time dimension, exactly as
  `SharedTable.insert(batch of the staged steps, priorities)` stores it.

  Items become visible (sampleable, counted by the rate limiter) only when the staged steps
  are flushed: when `capacity` steps are staged, on flush(), close(), or leaving a `with`
  block (also when the block raises). Numeric leaves only (strings: use SharedTable.insert).

  Not thread-safe: use one per thread.

  Args:
    table: the SharedTable to insert into.
    capacity: steps staged before an automatic flush (1..65536).
    timeout_ms: rate limiter wait of each flush: None waits forever, 0 does not wait.

  Raises:
    ValueError: capacity out of range or a negative timeout.
  """

  def __init__(self, table, capacity: int = 256, timeout_ms: Optional[float] = None):
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or not (
        1 <= capacity <= 65536):
      raise ValueError(f"capacity must be an int in [1, 65536], got {capacity!r}")
    timeouts.deadline_from_ms(timeout_ms)
    self._table = table
    self._capacity = int(capacity)
    self._timeout_ms = timeout_ms
    self._staged = 0
    self._closed = False
    self._layout: Any = None  # (treedef, ((dtype, shape) per leaf)) of the first step
    self._rows: Any = None    # staging array (capacity, *shape) per leaf
    self._buffers: Any = None  # their uint8_t[] cdata
    self._writer: Any = None  # chunks.ColumnWriter of the layout
    self._fast: Any = None    # what _stage_same_layout compares (flat dict first steps)
    self._stage = None        # insert()'s one-call staging (hot_plans.stager), or None
    self._priorities = np.zeros(self._capacity, np.float64)
    self._keys = np.zeros(self._capacity, np.uint64)
    self._priorities_c = ffi.from_buffer("double[]", self._priorities)
    self._keys_c = ffi.from_buffer("uint64_t[]", self._keys)
    self._prioritized = table._prioritized()  # pylint: disable=protected-access
    self._priority_bound = table.priority_bound
    self._pid = os.getpid()

  @property
  def capacity(self) -> int:
    """Steps staged before an automatic flush."""
    return self._capacity

  @property
  def pending(self) -> int:
    """Steps staged and not yet inserted."""
    return self._staged

  @property
  def closed(self) -> bool:
    return self._closed

  def __repr__(self):
    return (f"StepInserter({self._table!r}, capacity={self._capacity}, pending={self._staged}"
            f"{', closed' if self._closed else ''})")

  def insert(self, step: Any, priority: float = 1.0) -> None:
    """Stages `step` as one item of priority `priority`; flushes when `capacity` are staged.

    Args:
      step: nest of numeric arrays / numpy or Python scalars (one step, no batch dim), of the
        layout of the first step.
      priority: finite float (>= 0 for a Prioritized table).

    Raises:
      ValueError: a bad priority, a step whose structure, dtypes or shapes differ from the
        first step's, non-numeric leaves, or a step not matching the table signature (checked
        on the first step). Nothing is staged then.
      RuntimeError: the inserter is closed.
      Errors of flush() when this step fills the staging rows: the step stays staged (with the
        others) and the next insert() or flush() tries again.
    """
    stage, row = self._stage, self._staged   # (the one-call path; None until the first step
    if (stage is not None and row < self._capacity and type(priority) is float  # and closed)
        and priority <= self._priority_bound and stage(step, priority, row)):
      self._staged = row = row + 1
      if row == self._capacity:
        self.flush()
      return
    if self._closed:
      raise RuntimeError("StepInserter is closed")
    if type(priority) is not float or not -math.inf < priority < math.inf:
      priority = columns_lib.check_priority(priority, self._table.name, self._prioritized)
    if priority < 0 and self._prioritized:
      columns_lib.check_priority(priority, self._table.name, True)   # raises
    if priority > self._priority_bound:   # the exact sum-tree cap check (raises if above it)
      self._table.check_priority_cap(priority)
    if self._staged == self._capacity:   # a flush failed before: try again first
      self.flush()
    row = self._staged
    if not self._stage_same_layout(step, row):
      arrays = self._check_step(step)   # (learns the layout from the first step)
      for rows, a in zip(self._rows, arrays):
        rows[row] = a
    self._priorities[row] = priority
    self._staged = row + 1
    if row + 1 == self._capacity:
      self.flush()

  def _stage_same_layout(self, step, row: int) -> bool:
    """Writes `step` into staging row `row` when it is a flat dict with the first step's keys
    and leaf types (arrays of its dtypes and shapes); False (row unused) otherwise."""
    fast = self._fast
    if fast is None or type(step) is not dict or tuple(step) != fast[0]:
      return False
    leaves = fast[1](step)
    if tuple(map(type, leaves)) != fast[2]:
      return False
    for i, dtype, shape in fast[3]:   # array leaves: numpy would cast any dtype silently
      a = leaves[i]
      if a.dtype != dtype or a.shape != shape:
        return False
    try:   # Python and numpy scalars convert exactly, or raise (an int beyond int64)
      for rows, value in zip(self._rows, leaves):
        rows[row] = value
    except (OverflowError, ValueError, TypeError):
      return False
    return True

  def _check_step(self, step) -> list:
    """The step's leaves as arrays of the layout (learnt from the first step)."""
    layout = self._layout
    if layout is None:
      return self._learn(step)
    treedef, columns, flat_keys, flat_order = layout
    leaves = None
    if type(step) is dict and flat_keys is not None and tuple(step) == flat_keys:
      leaves = [step[k] for k in flat_order]   # the first step's flat dict layout
      if not columns_lib.LEAF_TYPES.issuperset(map(type, leaves)):
        leaves = None
    if leaves is None:
      if structure.structure_of(step) != treedef:
        raise ValueError(f"step structure {structure.structure_of(step)} differs from the "
                         f"first step's {treedef}")
      leaves = structure.flatten(step)[0]
    try:
      arrays = [x if type(x) in columns_lib.NUMERIC_VALUES else structure.to_array(x)
                for x in leaves]
    except ValueError as e:
      raise ValueError(f"step: {e}") from None
    for i, (a, (dtype, shape)) in enumerate(zip(arrays, columns)):
      if a.dtype != dtype or a.shape != shape:
        raise ValueError(f"step leaf {i} has dtype {a.dtype} and shape {a.shape}; every step "
                         f"of this StepInserter has the first step's {dtype} and {shape}")
    return arrays

  def _learn(self, step) -> list:
    """Checks the first step against the table (as SharedTable.insert of one row) and builds
    the staging rows of its layout."""
    leaves, treedef = structure.flatten(step)
    try:
      arrays = [structure.to_array(x) for x in leaves]
    except ValueError as e:
      raise ValueError(f"step: {e}") from None
    if not arrays:
      raise ValueError("step must contain at least one value")
    for i, a in enumerate(arrays):
      if a.dtype.kind not in "biufc" or a.dtype.fields is not None:
        raise ValueError(f"step leaf {i} has dtype {a.dtype}: StepInserter takes numeric "
                         "leaves only (use SharedTable.insert for strings)")
    batch = structure.unflatten(treedef, [a[None] for a in arrays])
    self._table._columns_of(batch)   # pylint: disable=protected-access  (signature check)
    columns = tuple((a.dtype, a.shape) for a in arrays)
    self._writer = chunks.ColumnWriter(columns)
    self._rows = [np.zeros((self._capacity,) + shape, dtype) for dtype, shape in columns]
    self._buffers = chunks.row_buffers(self._rows)
    flat = type(step) is dict and all(type(k) is str for k in step) and all(
        type(v) in columns_lib.LEAF_TYPES for v in step.values())
    self._layout = (treedef, columns, tuple(step) if flat else None,
                    tuple(sorted(step)) if flat else None)
    if flat:   # (keys, leaves getter, leaf types, (index, dtype, shape) of array leaves)
      order = self._layout[3]
      getter = ((lambda d, k=order[0]: (d[k],)) if len(order) == 1
                else operator.itemgetter(*order))
      self._fast = (tuple(step), getter, tuple(map(type, getter(step))),
                    tuple((i, dtype, shape) for i, (v, (dtype, shape))
                          in enumerate(zip(getter(step), columns)) if type(v) is np.ndarray))
    self._stage = hot_plans.stager(self._table, step, columns, self._writer, self._rows,
                                   self._priorities)
    return arrays

  def flush(self) -> np.ndarray:
    """Inserts every staged step (one C call) and returns their keys.

    Returns:
      uint64[n] keys of the items inserted, in staging order (n = pending before the call).

    Raises:
      DeadlineExceededError: the rate limiter did not admit every item within timeout_ms; the
        items it admitted are inserted and the others stay staged (`inserted` says how many,
        `keys` holds their keys).
      ResourceExhaustedError: the arena is full; TableClosedError: the server stopped. The
        steps stay staged.
    """
    if os.getpid() != self._pid:
      raise RuntimeError("StepInserter used across a fork: its staged steps belong to the parent; "
                         "create a StepInserter in each process")
    n = self._staged
    if n == 0:
      return np.zeros(0, np.uint64)
    rows = self._rows if n == self._capacity else [r[:n] for r in self._rows]
    buffers = self._buffers if n == self._capacity else chunks.row_buffers(rows)
    try:
      self._table._insert_rows(  # pylint: disable=protected-access
          self._writer, n, self._keys_c, self._priorities_c, buffers, chunks.SQUEEZE,
          lib.RS_ROWS_RANDOM_KEYS, timeouts.deadline_from_ms(self._timeout_ms),
          self._timeout_ms)
    except Exception as e:  # pylint: disable=broad-except
      done = getattr(e, "inserted", 0)
      if done:   # keep the steps the limiter did not admit, at the front
        if isinstance(e, errors.DeadlineExceededError):
          e.keys = self._keys[:done].copy()
        for r in self._rows:
          r[:n - done] = r[done:n].copy()
        self._priorities[:n - done] = self._priorities[done:n].copy()
        self._staged = n - done
      raise
    self._staged = 0
    return self._keys[:n].copy()

  def close(self) -> None:
    """Flushes the staged steps, then refuses further inserts (idempotent).

    Raises:
      DeadlineExceededError: as flush(); the inserter stays open then (close() can be called
        again), as for every other error of flush().
    """
    if not self._closed:
      self.flush()
      self._closed = True
      self._stage = None

  def __enter__(self) -> "StepInserter":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
      return
    try:   # the block raised: still insert what was staged, but never hide the block's error
      self.close()
    except Exception as flush_error:  # pylint: disable=broad-except
      warnings.warn(f"StepInserter: flushing on exit after {exc_type.__name__} failed "
                    f"({type(flush_error).__name__}: {flush_error}); {self._staged} staged "
                    f"steps were not inserted", RuntimeWarning, stacklevel=2)

