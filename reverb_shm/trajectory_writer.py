"""TrajectoryWriter: appends steps in place into shared-memory chunks and inserts items over them.

Every column (one leaf path of the appended nests) owns a current chunk allocated in the shared
arena; `append` writes the step's row straight into it and publishes it, so an item referencing
rows already appended can be inserted at once. The writer holds a pin on each chunk until every
row of it has left the column's keep-alive window (its last `num_keep_alive_refs` steps) and no
queued item needs it (nor a batched window item: while some are batched, rows that left the
window are kept until the batch is inserted); items in tables keep chunks alive by refcount in
the C core.

Items are inserted as soon as the table's rate limiter allows it without waiting; otherwise they
wait in a bounded FIFO queue that `create_item`, `flush`, `end_episode` and `close` drain.

Positions in `writer.history` count the column's steps since the last buffer clear
(`end_episode(clear_buffers=True)`), so `history[c][0:n]` after n appends covers all n steps
(Reverb's slicing loses steps there; see docs/differences.md#trajectory-writer). Positions
outside that range raise an error that is both an IndexError and a ValueError; positions within
it whose step has left the keep-alive window, came before the column existed or skipped the
column read as None, which a TrajectoryColumn rejects with ValueError.
"""
import collections
import functools
import math
import warnings
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from reverb_shm import errors
from reverb_shm._internal import chunks, delivery, items, structure, timeouts
from reverb_shm._internal._lib import ffi, hot
from reverb_shm._internal.columns import (
  as_column_array,
  check_positive_int,
  check_priorities,
  check_priority,
  check_signature,
  check_supported_dtype,
  flat_dict_keys,
  object_row,
  window_starts,
)
from reverb_shm._internal.history import (
  _COUNT,
  _HOLDER,
  _POS,
  AUTO_MAX_ROWS,
  CellRef,
  TrajectoryColumn,
  _Column,
  _ColumnHistory,
  _Holder,
  _prune,
  _union,
)
from reverb_shm._internal.items import SQUEEZE_FLAG
from reverb_shm._internal.keys import random_u64

__all__ = ["TrajectoryWriter", "TrajectoryColumn", "CellRef"]

# Items queued behind the rate limiter before create_item blocks on the oldest one.
_MAX_PENDING = 1024
# close()'s default longest wait for the items that rate limiters hold back (milliseconds).
CLOSE_TIMEOUT_MS = 5000
# Window items batched by create_item before they are inserted with one C call.
_BATCH_ITEMS = 256
# ... before a bridge client's writer sends them: fewer, so that the bridge handles a batch
# while the writer makes the next one (measured on 2 CPUs: 64 items/s beat 256's by ~20% when
# the bridge has a CPU of its own, and trail them by ~15% when the CPUs are shared).
_REMOTE_BATCH_ITEMS = 64
# Distinct validated item kinds (table, column windows) remembered per writer.
_MAX_KINDS = 4096
_TABLE_KINDS = 4   # kinds per table create_item's C fast path tries after the last one


class _Pending:
  """An item waiting for its table's rate limiter."""

  __slots__ = ("table", "key", "priority", "blob", "holders")

  def __init__(self, table, key, priority, blob, holders):
    self.table = table          # SharedTable
    self.key = key
    self.priority = priority
    self.blob = blob            # this item's descriptor bytes
    self.holders = holders      # distinct _Holders it references


def _fast_append(writer, columns: list, treedef, keys: Optional[tuple]
                 ) -> Optional[hot.FastAppend]:
  """The fast append after a complete step that wrote every one of `columns` (one per leaf of
  `treedef`; `keys` its sorted keys when steps are flat dicts), if it applies: steps like it
  (same structure; every leaf an ndarray of its column's dtype and shape, or a scalar of its
  dtype's type for shape ()) are then one row write per column, with no flattening of flat
  dicts and no C core call (rows are published with the next item batch), until a column's
  chunk is full or a run leaves a keep-alive window (the C path then asks `_renew_fast`). Made
  before a fork, it declines in the child (the slow path refuses)."""
  if len(columns) != len(writer._columns) or len({id(c) for c in columns}) != len(columns):  # pylint: disable=protected-access
    return None
  cols = []
  room = AUTO_MAX_ROWS << 20
  for col in columns:
    run = col.open if col is not None else None
    if col is None or col.is_object or run is None or run[_HOLDER] is not col.holder:
      return None
    col.sync()
    holder = col.holder
    room = min(room, holder.capacity - holder.used)
    cols.append((col, holder.data[holder.used:], col.dtype))
  base = writer._hist_step  # pylint: disable=protected-access
  limit = base + room
  for col in columns:      # next run to leave the keep-alive window (expired ones wait for
    for run in col.runs:   # the batch insert)
      if run is col.open:
        break
      expiry = run[_POS] + run[_COUNT] + col.keep_alive
      if expiry > base:
        limit = min(limit, expiry)
        break
  if limit <= base:
    return None
  segment = writer._segment  # pylint: disable=protected-access
  return hot.FastAppend(treedef, keys, tuple(cols), base, limit, segment, segment.generation)


# --------------------------------------------------------------------------------------------
# The writer


def _exclusive(method):
  """Marks a call of the writer's owner in progress (the delivery thread leaves the writer alone
  meanwhile; the C methods append and create_item do the same)."""

  @functools.wraps(method)
  def call(self, *args, **kwargs):
    hot.writer_enter(self)
    try:
      return method(self, *args, **kwargs)
    finally:
      hot.writer_exit(self)
  return call


def _runs(batch: list) -> int:
  """Number of runs of consecutive entries of one kind in a batch of window items."""
  return sum(1 for i, entry in enumerate(batch) if i == 0 or entry[0] is not batch[i - 1][0])


class TrajectoryWriter(hot.WriterBase):
  """Writes steps into shared memory and inserts items referencing them.

  Obtain one with `Client.trajectory_writer(num_keep_alive_refs)`. Not thread-safe: use a writer
  from one thread at a time.

  Args:
    client: the Client whose tables receive the items.
    num_keep_alive_refs: steps each column keeps referenceable (>= 1).
    validate_items: check items against their table's signature in `create_item`.
    item_batch_size: window items `create_item` batches before inserting them with one C
      call (default 256), or (a bridge client's writer) sending them in one message (default
      64) (reverb_shm extension; 1 inserts or sends every item at once).

  Raises:
    ValueError: `num_keep_alive_refs < 1` or `item_batch_size < 1`.
  """

  def __init__(self, client, num_keep_alive_refs: int, *, validate_items: bool = True,
               item_batch_size: Optional[int] = None):
    self._closed = True   # until fully constructed (so __del__ is harmless)
    num_keep_alive_refs = check_positive_int(num_keep_alive_refs, "num_keep_alive_refs")
    remote = hasattr(client, "writer_session")
    if item_batch_size is None:
      item_batch_size = _REMOTE_BATCH_ITEMS if remote else _BATCH_ITEMS
    self._item_batch_size = check_positive_int(item_batch_size, "item_batch_size")
    self._client = _writer_client(client)
    self._segment = client._segment()  # pylint: disable=protected-access
    self._default_keep_alive = num_keep_alive_refs
    self._validate_items = bool(validate_items)
    self._columns: List[_Column] = []
    self._by_path: dict = {}
    self._configs: dict = {}           # path -> (num_keep_alive_refs, max_chunk_length)
    self._plans: dict = {}             # treedef -> ([column or None per leaf], [path per leaf])
    self._structure = None       # union skeleton (leaves: _ColumnHistory)
    self._hist_step = 0          # closed steps since the last clear
    self._step_open = False      # a partial append opened the current step
    self._episode_steps = 0
    self._episode_id = random_u64.one()
    self._pending: collections.deque = collections.deque()
    self._batch: list = []   # (item kind, priority, starts) of window items not yet inserted
    self._kinds: dict = {}   # (handle, ((column, length, squeeze), ...)) -> itself, validated
    self._last_kind: Any = None  # the kind _kind() returned last (create_item's C fast path)
    self._table_kinds: dict = {}  # table name -> its last _TABLE_KINDS kinds (same), newest first
    self._fast = None            # hot.FastAppend of the last complete step, or None
    self._item_keys: Any = None  # sorted keys of the last flat-dict trajectory, or None
    self._window_cols: Any = None  # (history, its columns) for create_window_items
    self._tables: dict = {}
    self._last_deadline_error = None
    # Batches and items held back by a rate limiter are delivered by a background thread when
    # the owner makes no further call (local tables only; a bridge client's writer sends them).
    self._background = not remote
    self._closed = False

  # ---- background delivery (reverb_shm/_internal/delivery.py)

  def _note_batch(self) -> None:
    """A batch was started: the delivery thread inserts it if the owner does not soon."""
    if self._background:
      delivery.notify(self)

  def _deliver_now(self, deadline_ns: int = 0) -> None:
    """Inserts the batch and the queued items their rate limiters admit before `deadline_ns`
    (0: now). Called by the delivery thread holding the writer."""
    if self._batch and not self._closed:
      self._flush_batch()
    self._drain(0, deadline_ns)
    if self._closed and not self._pending:
      _close_inserts(self._client)

  def _undelivered(self) -> int:
    return len(self._pending) + len(self._batch)

  # ---- properties

  # history (the union structure of the appended steps, leaves: column histories) is the C
  # base's property: `_structure`, else _no_history().

  @staticmethod
  def _no_history():
    raise RuntimeError("history is not available before the first append() call")

  @property
  def episode_steps(self) -> int:
    """Non-partial appends since the last end_episode."""
    return self._episode_steps

  @property
  def max_num_keep_alive_refs(self) -> int:
    """Largest keep-alive window of the default and every configured column."""
    return max([self._default_keep_alive] + [k for k, _ in self._configs.values()])

  @property
  @_exclusive
  def num_pending_items(self) -> int:
    """Items created but not yet admitted by their table's rate limiter (reverb_shm extension).

    Inserts the batched items first (see `create_item`), so that the count is exact.
    """
    if self._batch and not self._closed:
      self._flush_batch()
    return len(self._pending) + len(self._batch) + _in_flight(self._client)

  # ---- appending
  # append(data, *, partial_step=False) is the C base's (documented there): a flat-dict step
  # that the fast append takes is written in C, any other call comes here.

  def _append(self, data: Any, *, partial_step: bool = False) -> None:
    """append()'s general path."""
    fast = self._fast
    if fast is not None and not partial_step:
      leaves, treedef = structure.flatten(data)
      if treedef == fast.treedef and fast.write(self, leaves):
        return
    self._check_open()
    self._fast = None
    self._check_usable()
    self._flush_batch()
    leaves, treedef = structure.flatten(data)
    plan = self._plans.get(treedef)
    if plan is None:
      plan = self._make_plan(data, treedef)
    columns, paths = plan
    hist_step = self._hist_step
    writes = []     # (column or None, path, array, leaf index)
    for i, leaf in enumerate(leaves):
      if leaf is None:
        continue
      col = columns[i]
      if col is None:
        col = self._by_path.get(paths[i])
      arr = as_column_array(leaf)
      if col is None:
        check_supported_dtype(arr.dtype, paths[i])
      else:
        if arr.dtype != col.dtype:
          raise ValueError(f"Tensor of wrong dtype provided for column {col.path}. Got "
                           f"{arr.dtype} but expected {col.dtype}.")
        if arr.shape != col.shape:
          raise ValueError(f"Tensor of incompatible shape provided for column {col.path}. Got "
                           f"{list(arr.shape)} which is incompatible with {list(col.shape)}.")
        if col.n > hist_step:
          raise ValueError(
              f"Field {col.path} has already been set in the active step by previous (partial) "
              f"append call and thus must be omitted or set to None but got: {leaf}")
      writes.append((col, paths[i], arr, i))
    if any(col is None or col.needs_chunk() for col, _, _, _ in writes):
      self._write_steps(writes, 1, bool(partial_step), treedef, plan)
    else:   # every column exists and its current chunk has room for the row
      for col, _, arr, i in writes:
        columns[i] = col
        holder = col.holder
        row = holder.used
        holder.data[row] = arr
        col.add_rows(holder, row, 1, keep_open=True)
      if partial_step:
        self._step_open = True
      else:
        self._close_steps(1)
    if not partial_step:
      self._collect()
      if len(writes) == len(leaves):
        self._fast = self._make_fast(plan[0], treedef, flat_dict_keys(data, len(leaves)))

  @_exclusive
  def extend(self, steps: Any) -> None:
    """Appends T complete steps at once (reverb_shm extension; one chunk write per column).

    Equivalent to `for t in range(T): append(nest of leaf[t])`, but much faster.

    Args:
      steps: a nest like `append`'s whose every non-None leaf has the same leading dim T >= 1.

    Raises:
      ValueError: leaves disagree on T, T == 0, a dtype/shape mismatch, or a partial step open.
      ResourceExhaustedError: the chunk arena is full.
    """
    self._check_open()
    self._fast = None
    self._check_usable()
    self._flush_batch()
    if self._step_open:
      raise ValueError("extend() cannot be called while a partial step is open; finish it "
                       "with append(..., partial_step=False) first")
    leaves, treedef = structure.flatten(steps)
    plan = self._plans.get(treedef)
    if plan is None:
      plan = self._make_plan(steps, treedef)
    columns, paths = plan
    writes = []
    num_steps = None
    for i, leaf in enumerate(leaves):
      if leaf is None:
        continue
      col = columns[i] or self._by_path.get(paths[i])
      arr = as_column_array(leaf)
      if arr.ndim == 0:
        raise ValueError(f"extend() needs a leading time dim, but column {paths[i]} got a scalar")
      if num_steps is None:
        num_steps = arr.shape[0]
      elif arr.shape[0] != num_steps:
        raise ValueError(f"extend() leaves must share the leading dim: column {paths[i]} has "
                         f"{arr.shape[0]} steps, earlier columns have {num_steps}")
      if col is None:
        check_supported_dtype(arr.dtype, paths[i])
      elif arr.dtype != col.dtype:
        raise ValueError(f"Tensor of wrong dtype provided for column {col.path}. Got "
                         f"{arr.dtype} but expected {col.dtype}.")
      elif arr.shape[1:] != col.shape:
        raise ValueError(f"Tensor of incompatible shape provided for column {col.path}. Got "
                         f"{list(arr.shape[1:])} which is incompatible with {list(col.shape)}.")
      writes.append((col, paths[i], arr, i))
    if num_steps is None:
      raise ValueError("extend() needs at least one non-None leaf")
    if num_steps == 0:
      raise ValueError("extend() needs at least one step (leading dim 0 given)")
    self._write_steps(writes, num_steps, None, treedef, plan)
    self._collect()

  _make_fast = _fast_append

  def _renew_fast(self) -> Optional[hot.FastAppend]:
    """Called by the C fast append when a step reaches its FastAppend's limit: releases the
    runs that left their keep-alive window (see _Column.collect), starts new chunks for the
    columns whose chunk is full (after inserting the batched items, as the slow path does at a
    chunk boundary) and returns the next FastAppend, also set as `_fast` (None: the step takes
    the slow path).

    Raises:
      ResourceExhaustedError: the chunk arena is full (nothing changed but the batch insert).
      TableClosedError: the server stopped (from the batch insert).
    """
    fast, self._fast = self._fast, None
    self._collect()
    if fast is None:
      return None
    columns = [entry[0] for entry in fast.cols]
    full = [col for col in columns if col.needs_chunk()]
    if full:
      self._flush_batch()
      fresh = []
      try:
        for col in full:
          fresh += self._fresh_holders(col, 1, self._episode_steps)
      except BaseException:
        for holder in fresh:
          holder.force_release()
        raise
      for col, holder in zip(full, fresh):
        col.close_chunk()
        col.holder = holder
        col.add_rows(holder, 0, 0, keep_open=True)   # the fast append writes its rows
    self._fast = self._make_fast(columns, fast.treedef, fast.keys)
    return self._fast

  def _make_plan(self, data, treedef):
    paths, _, _ = structure.flatten_with_paths(data)
    plan = ([self._by_path.get(p) for p in paths], paths)
    self._plans[treedef] = plan
    return plan

  def _new_column(self, path, dtype, shape, index) -> _Column:
    keep_alive, max_chunk = self._configs.get(path, (self._default_keep_alive, None))
    return _Column(self, index, path, dtype, shape, keep_alive, max_chunk, self._hist_step)

  def _write_steps(self, writes, num_steps: int, partial, treedef, plan) -> None:
    """Allocates every chunk needed (all-or-nothing), then writes rows and records refs.

    Args:
      writes: (column or None, path, array, leaf index) per non-None leaf; a None column is
        created here. Arrays hold one row (append) or num_steps rows (extend).
      num_steps: steps written.
      partial: True/False for append's partial_step; None for extend (batched arrays).
      treedef, plan: the flattened step's structure and per-leaf columns.
    """
    seg = self._segment
    batched = partial is None
    new_columns: list = []
    resolved = []
    for col, path, arr, _ in writes:
      if col is None:
        shape = arr.shape[1:] if batched else arr.shape
        col = self._new_column(path, arr.dtype, tuple(shape),
                               len(self._columns) + len(new_columns))
        new_columns.append(col)
      resolved.append(col)
    skeleton = None
    if new_columns:
      # Union structure first: a conflicting nest raises before anything changes.
      leaves = [None] * len(plan[0])
      for (_, _, _, i), col in zip(writes, resolved):
        leaves[i] = col.history
      skeleton = _union(self._structure, _prune(structure.unflatten(treedef, leaves)))

    allocated = []    # fresh holders per write
    start_step = self._episode_steps
    try:
      for (_, _, arr, _), col in zip(writes, resolved):
        if col.is_object:
          rows = list(arr) if batched else [arr]
          chunk = chunks.object_chunk(seg, rows, episode_id=self._episode_id,
                                      start_step=start_step, owned=True)
          allocated.append([_Holder(chunk, values=[object_row(r, col.shape) for r in rows])])
        else:
          allocated.append(self._fresh_holders(col, num_steps, start_step))
    except BaseException:
      for fresh in allocated:
        for holder in fresh:
          holder.force_release()
      raise

    # Commit: nothing below raises on valid input.
    for col in new_columns:
      self._columns.append(col)
      self._by_path[col.path] = col
    columns = plan[0]
    for (_, _, arr, i), col, fresh in zip(writes, resolved, allocated):
      columns[i] = col
      if col.is_object:
        holder = fresh[0]
        col.add_rows(holder, 0, holder.used, keep_open=False)
        continue
      values = arr if batched else arr.reshape((1,) + col.shape)
      done = 0
      holders = ([] if col.needs_chunk() else [col.holder]) + fresh
      for holder in holders:
        if holder is not col.holder:
          col.close_chunk()
          col.holder = holder
        first = holder.used
        take = min(holder.capacity - first, num_steps - done)
        holder.data[first:first + take] = values[done:done + take]   # published before use
        col.add_rows(holder, first, take, keep_open=True)
        done += take
        if done == num_steps:
          break
    if new_columns:
      self._structure = skeleton
    if partial:
      self._step_open = True
      return
    self._close_steps(num_steps)

  def _fresh_holders(self, col: _Column, num_steps: int, start_step: int) -> List[_Holder]:
    """New chunks for the rows of `num_steps` steps (from episode step `start_step`) of numeric
    column `col` that its current chunk has no room for; all or nothing."""
    room = 0 if col.needs_chunk() else col.holder.capacity - col.holder.used
    step = start_step + room
    remaining = num_steps - room
    fresh = []
    try:
      while remaining > 0:
        capacity = col.chunk_length()
        chunk = chunks.alloc_chunk(self._segment, col.dtype, col.shape, capacity,
                                   episode_id=self._episode_id, start_step=step,
                                   owned=True)   # released by close(), also from __del__
        fresh.append(_Holder(chunk))
        remaining -= capacity
        step += capacity
    except BaseException:
      for holder in fresh:
        holder.force_release()
      raise
    return fresh

  def _close_steps(self, num_steps: int) -> None:
    """Closes the open step (num_steps = 1) or the num_steps steps extend() wrote; columns
    that were not written read as None at those positions."""
    end = self._hist_step + num_steps
    for col in self._columns:
      if col.n < end:
        col.close_run()
        col.n = end
    self._hist_step = end
    self._episode_steps += num_steps
    self._step_open = False

  def _collect(self) -> None:
    for col in self._columns:
      col.collect()

  # ---- items

  # create_item(table, priority, trajectory) is the C base's (documented there): a flat-dict
  # window item of the last item kind is batched in C, any other call comes here.

  def _create_item(self, table: str, priority: float, trajectory: Any) -> None:
    """create_item()'s general path."""
    handle = self._tables.get(table)
    if handle is None or self._closed:
      self._check_open()
      handle = self._table(table)
    if type(priority) is not float or not 0.0 <= priority < math.inf:   # not NaN either
      priority = check_priority(priority, handle.name, handle.prioritized)
    if priority > getattr(handle, "priority_bound", math.inf):   # (remote: the bridge checks)
      handle.table.check_priority_cap(priority)   # above the sum-tree cap: raises now
    leaves, _ = structure.flatten(trajectory)
    self._item_keys = flat_dict_keys(trajectory, len(leaves))
    entry = self._window_entry(handle, priority, leaves)
    if entry is None:
      self._create_general(handle, [priority], [trajectory])
      return
    batch = self._batch
    batch.append(entry)
    if len(batch) == 1:
      self._note_batch()
    if len(batch) >= self._item_batch_size or self._pending:
      self._flush_batch()

  @_exclusive
  def create_items(self, table: str, priorities: Sequence[float],
                   trajectories: Sequence[Any]) -> None:
    """Creates many items, in order, and inserts them at once (reverb_shm extension).

    Args:
      table: name of the table.
      priorities: one priority per item.
      trajectories: one trajectory nest per item (as in `create_item`).

    Raises:
      ValueError: as `create_item` (TypeError too); nothing is inserted or queued when any
        item is invalid.
    """
    self._check_open()
    if len(priorities) != len(trajectories):
      raise ValueError(f"create_items got {len(priorities)} priorities for "
                       f"{len(trajectories)} trajectories")
    handle = self._table(table)
    prios = [check_priority(p, handle.name, handle.prioritized) for p in priorities]
    entries = []
    for prio, trajectory in zip(prios, trajectories):
      entry = self._window_entry(handle, prio, structure.flatten(trajectory)[0])
      if entry is None:
        self._create_general(handle, prios, trajectories)
        return
      entries.append(entry)
    self._batch.extend(entries)
    self._flush_batch()

  @_exclusive
  def create_window_items(self, table: str, priorities, starts, num_timesteps: int,
                          columns: Any = None) -> None:
    """Creates one item per start position over the next `num_timesteps` steps of every column,
    with one C call (reverb_shm extension: n-step transitions / sequences in bulk).

    Item i equals `create_item(table, priorities[i], nest)` where nest is `columns` with each
    column history h replaced by `h[starts[i]:starts[i] + num_timesteps]`. The items are
    inserted in order, after every item created before, and are in the table when this call
    returns unless their rate limiter holds them back (they then wait in the queue, as
    `create_item`'s).

    Args:
      table: name of the table.
      priorities: float array-like of shape [n], finite (non-negative for Prioritized tables).
      starts: int array-like of shape [n]: history positions of each item's first step
        (negative ones count from the end of each column, as history indexing does).
      num_timesteps: steps per item (>= 1); the time dim of every column of the sample.
      columns: a nest of column histories (leaves of `history`), e.g. `{"obs": h["obs"]}`;
        None selects the whole `history`.

    Raises:
      TypeError: a leaf of `columns` is not a column history of this writer.
      ValueError: `num_timesteps` < 1, `starts` not 1-D integers, `priorities` not n finite
        values (non-negative for Prioritized tables), a window that includes an expired or
        skipped step, or (validate_items) a signature mismatch.
      HistoryIndexError (an IndexError and a ValueError): a window outside a column's steps.

    Nothing is created when any item is invalid.
    """
    self._check_open()
    handle = self._table(table)
    cols = self._window_columns(columns)
    length = check_positive_int(num_timesteps, "num_timesteps")
    starts = np.asarray(starts)
    if starts.ndim != 1 or (starts.size and starts.dtype.kind not in "iu"):
      raise ValueError(f"starts must be a 1-D array of ints, got shape {starts.shape} and dtype "
                       f"{starts.dtype}")
    n = len(starts)
    try:
      prios = np.ascontiguousarray(priorities, dtype=np.float64)
    except (TypeError, ValueError):
      raise ValueError(f"priorities must be {n} numbers, got {priorities!r}") from None
    if prios.shape != (n,):
      raise ValueError(f"priorities must have shape ({n},) (one per item), got {prios.shape}")
    if n == 0:
      return
    if prios.max() > getattr(handle, "priority_bound", math.inf):
      handle.table.check_priority_cap(prios)   # above the sum-tree cap: nothing is created
    starts = window_starts(starts)
    kind = self._kind(handle, tuple((col, length, False) for col in cols))
    self._flush_batch()
    self._publish()
    try:      # the C call validates every priority and window (alive steps only)
      blob, offs = items.encode_windows(kind, starts, prios, handle.prioritized, alive=True)
    except errors.InvalidArgumentError:
      check_priorities(prios, handle)
      for col in cols:
        self._window_positions(col, starts, length)
      raise      # a window over a skipped step: the C message names it
    self._insert_encoded(handle, prios, blob, offs, kind[1], starts)

  def _window_columns(self, columns) -> List[_Column]:
    """The columns of create_window_items' `columns` nest, in flatten order."""
    structure_ = self.history if columns is None else columns
    cached = self._window_cols
    if cached is not None and cached[0] is structure_:
      return cached[1]
    leaves, _ = structure.flatten(structure_)
    cols = []
    for i, leaf in enumerate(leaves):
      if not isinstance(leaf, _ColumnHistory) or leaf._column.writer is not self:  # pylint: disable=protected-access
        raise TypeError(f"create_window_items: leaf {i} of columns must be a column history of "
                        f"this writer (a leaf of writer.history), got {type(leaf).__name__}")
      cols.append(leaf._column)  # pylint: disable=protected-access
    if not cols:
      raise ValueError("create_window_items: columns must hold at least one column history")
    if columns is None:
      self._window_cols = (structure_, cols)
    return cols

  @staticmethod
  def _window_positions(col: _Column, starts: np.ndarray, length: int) -> np.ndarray:
    """Positions in `col` of windows starting at `starts`; raises for the first bad one."""
    pos = np.where(starts < 0, starts + col.n, starts)
    bad = np.flatnonzero((pos < 0) | (pos + length > col.n))
    if len(bad):
      raise errors.HistoryIndexError(f"create_window_items: item {bad[0]}'s window "
                                     f"[{starts[bad[0]]}, +{length}) is out of range for column "
                                     f"{col.path}, which has {col.n} steps since its buffers "
                                     "were last cleared")
    bad = np.flatnonzero(pos < col.alive_from())
    if len(bad):
      raise ValueError(f"create_window_items: item {bad[0]}'s window starting at "
                       f"{starts[bad[0]]} includes expired steps of column {col.path} (it "
                       f"keeps the last {col.keep_alive}: num_keep_alive_refs)")
    return pos

  # ---- items: internals

  def _window_entry(self, handle, priority: float, leaves) -> Optional[tuple]:
    """(kind, priority, starts) when every leaf is an alive window of one of this writer's
    columns, else None (the general path validates and reports)."""
    sig = []
    starts = []
    for leaf in leaves:
      if type(leaf) is not TrajectoryColumn:
        return None
      win = leaf._win
      if win is None:
        win = leaf.window()
        if win is None:
          return None
      col, gen, start, stop, _ = win
      if (col.writer is not self or gen != col.gen or start < col.n - col.keep_alive or
          start < col.floor):    # not alive: the general path says why
        return None
      sig.append((col, stop - start, leaf._squeeze))
      starts.append(start)
    if not sig:
      return None
    return self._kind(handle, tuple(sig)), priority, tuple(starts)

  def _kind(self, handle, sig: tuple) -> tuple:
    """The validated, shared (handle, sig, C flags, C lengths) of items with these column
    windows; sig is ((column, length, squeeze), ...)."""
    key = (handle, sig)
    kind = self._kinds.get(key)
    if kind is None:
      if self._validate_items and handle.flat_signature is not None:
        check_signature(handle.name, handle.flat_signature, [
            (col.dtype, col.shape if squeeze else (length,) + col.shape)
            for col, length, squeeze in sig])
      if len(self._kinds) >= _MAX_KINDS:
        self._kinds.clear()      # batched items keep their own kind objects
      kind = self._kinds[key] = (
          handle, sig, ffi.new("uint32_t[]", [SQUEEZE_FLAG if sq else 0 for _, _, sq in sig]),
          ffi.new("uint32_t[]", [length for _, length, _ in sig]))
    self._last_kind = kind
    recent = self._table_kinds.get(handle.name, ())
    if not any(k is kind for k in recent):
      self._table_kinds[handle.name] = (kind,) + recent[:_TABLE_KINDS - 1]
    return kind

  def _check_usable(self) -> None:
    """TableClosedError (Chunk.publish's) once the server stopped or in a fork child: rows are
    published later, so appends check here that their chunks can still be written.
    DeadOwnerError once the server process died (as every Client call then raises)."""
    if self._segment.owner_dead:
      raise self._segment.dead_owner_error()
    for col in self._columns:
      holder = col.holder
      if holder is not None and holder.chunk is not None:
        holder.chunk.publish(holder.chunk.rows)
        return

  def _publish(self) -> None:
    """Makes every written row visible to items (once per batch, not per append)."""
    for col in self._columns:
      holder = col.holder
      if holder is not None:
        col.sync()
        holder.publish()

  def _flush_batch(self, insert: bool = True) -> None:
    """Inserts the batched window items: one items.encode_windows + one insert per run of items
    of one kind (table and column windows); what the rate limiter holds back is queued.
    insert=False queues them all (before their steps are cleared; never raises
    TableClosedError)."""
    batch = self._batch
    if not batch:
      return
    if insert and self._segment.owner_dead:
      raise self._segment.dead_owner_error()
    try:
      self._publish()
    except errors.TableClosedError:
      if insert:
        raise
    self._batch = []
    i, run = 0, None
    try:
      if insert and not self._pending and len(batch) > 2:
        run = hot.batch_run(batch, 0)   # (its first run, used below unless it regroups)
        if run[0] < len(batch):
          batch, run = self._grouped(batch), None
      while i < len(batch):
        kind = batch[i][0]
        j, positions, priorities = run or hot.batch_run(batch, i)
        run = None
        blob, offs = items.encode_windows(kind, positions)
        queued = len(self._pending)
        try:
          self._insert_encoded(kind[0], priorities, blob, offs, kind[1], positions, insert)
        except BaseException:
          if len(self._pending) != queued:   # the run is queued (then the drain raised)
            i = j
          raise                              # else nothing of it went in: it stays batched
        i = j
    except BaseException:
      self._batch = batch[i:] + self._batch
      raise
    self._collect()     # runs kept for the batch (queued items hold their chunks)

  @staticmethod
  def _grouped(batch: list) -> list:
    """The batch with each table's entries together, each table's creation order kept, when
    that makes fewer runs of one kind (items created in turn in several tables) and every
    table's rate limiter admits all of its items now: one encode and one insert per run.
    Otherwise the batch unchanged, whose creation order then decides what is held back. Items
    of one table are never reordered (a FIFO table samples them in creation order). (A batch
    of one run never gets here.)"""
    groups: Dict[int, list] = {}
    for entry in batch:
      groups.setdefault(id(entry[0][0].table), []).append(entry)
    grouped = [entry for group in groups.values() for entry in group]
    if _runs(grouped) >= _runs(batch):
      return batch
    counts = [(group[0][0][0].table, len(group)) for group in groups.values()]
    if not all(table.can_insert(n) for table, n in counts):
      return batch
    return grouped

  def _insert_encoded(self, handle, priorities, blob: np.ndarray, offs: np.ndarray, sig: tuple,
                      positions: np.ndarray, insert: bool = True) -> None:
    """Inserts encoded window items (positions as items.encode_windows' starts); those the rate
    limiter does not admit now are queued (all of them when not `insert`)."""
    n = len(offs) - 1
    done = 0 if self._pending or not insert else self._insert_now(handle, priorities, blob, offs)
    if done == n:
      return
    blobs = [bytes(blob[offs[i]:offs[i + 1]]) for i in range(done, n)]
    holder_sets = []
    for starts in positions[done:].tolist():
      holders = {}
      for c, (col, length, _) in enumerate(sig):
        start = starts[c] if isinstance(starts, list) else starts
        start += col.n if start < 0 else 0
        for h in col.holders_between(start, start + length):
          holders[id(h)] = h
      holder_sets.append(tuple(holders.values()))
    self._enqueue(handle, list(priorities)[done:], blobs, holder_sets, insert)

  def _create_general(self, handle, priorities: List[float], trajectories) -> None:
    """Items with any column that is not one window: encoded one by one, inserted now."""
    encoded = [items.encode_item(self, handle, trajectory, self._validate_items)
               for trajectory in trajectories]
    if not encoded:
      return
    self._flush_batch()     # keeps creation order
    self._publish()
    blobs = [chunks.encode_descriptor(desc) for desc, _ in encoded]
    holder_sets = [holders for _, holders in encoded]
    done = 0
    if not self._pending:
      blob, offs = chunks.join_descriptors(blobs)
      done = self._insert_now(handle, priorities, blob, offs)
    if done < len(blobs):
      self._enqueue(handle, priorities[done:], blobs[done:], holder_sets[done:])

  def _enqueue(self, handle, priorities, blobs, holder_sets, insert: bool = True) -> None:
    """Queues items behind the rate limiter, then (if `insert`) inserts what it admits now."""
    queued = []
    for blob, prio, holders in zip(blobs, priorities, holder_sets):
      for h in holders:
        h.pending += 1
      queued.append(_Pending(handle.table, random_u64.one(), float(prio), blob, holders))
    self._pending.extend(queued)
    if insert:
      self._drain(0, 0)     # whatever the limiters admit right now, in FIFO order
      while len(self._pending) > _MAX_PENDING:
        self._drain(len(self._pending) - 1, -1)
    if self._pending and self._background:
      delivery.notify(self, 0.0)   # delivered when the limiter admits them

  @staticmethod
  def _insert_now(handle, priorities, blob, offs) -> int:
    """Inserts the leading items that the table's rate limiter admits without waiting, with one
    C call and no queue bookkeeping (the common case). Returns how many were inserted; 0 also
    when an item is invalid (the queue path then finds and reports it)."""
    n = len(offs) - 1
    keys = ffi.new("uint64_t *", random_u64.one()) if n == 1 else ffi.from_buffer(
        "uint64_t[]", random_u64(n))
    prios = np.ascontiguousarray(priorities, np.float64)
    try:
      return handle.table._insert_validated(  # pylint: disable=protected-access
          n, keys, ffi.from_buffer("double[]", prios), ffi.from_buffer("uint8_t[]", blob),
          ffi.from_buffer("uint64_t[]", np.ascontiguousarray(offs, np.uint64)), 0, 0)
    except errors.DeadlineExceededError as e:
      return e.inserted
    except errors.InvalidArgumentError:
      return 0

  def _table(self, name: str):
    handle = self._tables.get(name)
    if handle is None:
      if not isinstance(name, str):
        raise TypeError(f"table must be a str, got {type(name).__name__}")
      try:
        handle = self._client._table_handle(name)  # pylint: disable=protected-access
      except errors.UnknownTableError as e:
        raise errors.UnknownTableError(
            f"Unable to create item in table {errors.quoted_name(name, plain=True)} since the "
            f"table could not be found. "
            f"({e})") from None
      self._tables[name] = handle
    return handle

  def _drain(self, until: int, deadline_ns: int, timeout_ms=0) -> bool:
    """Inserts queued items (oldest first) until at most `until` remain.

    Consecutive items of one table go to the C core in one call.

    Args:
      until: target queue length.
      deadline_ns: absolute monotonic deadline; 0 = only what fits without waiting, -1 = none.
      timeout_ms: the caller's timeout, for messages.

    Returns:
      True when the target was reached, False when a rate limiter did not admit the next item
      before the deadline (the error is kept in self._last_deadline_error).
    """
    self._flush_batch()
    pending = self._pending
    single = False
    while len(pending) > until:
      head = pending[0].table
      run: list = []
      limit = 1 if single else len(pending) - until
      for item in pending:
        if item.table is not head or len(run) >= limit:
          break
        run.append(item)
      try:
        done, timeout_error = self._insert_run(run, deadline_ns, timeout_ms)
      except errors.InvalidArgumentError:
        if len(run) > 1:
          single = True     # find the rejected item one by one
          continue
        self._finish(1)     # drop it: it can never be inserted
        raise
      self._finish(done)
      if timeout_error is not None:
        self._last_deadline_error = timeout_error
        return False
      single = False
    return True

  @staticmethod
  def _insert_run(run, deadline_ns, timeout_ms):
    """Inserts the items of `run` (one table); returns (inserted, DeadlineExceededError or None)."""
    blob, offs = chunks.join_descriptors([item.blob for item in run])
    try:
      done = run[0].table.insert_descriptors(
          np.array([item.key for item in run], np.uint64),
          np.array([item.priority for item in run], np.float64), blob, offs, timeout_ms,
          deadline_ns=deadline_ns)
    except errors.DeadlineExceededError as e:
      return e.inserted, e
    return done, None

  def _finish(self, n: int) -> None:
    """The n oldest queued items left the queue: drop their holds on chunks."""
    for _ in range(n):
      item = self._pending.popleft()
      for holder in item.holders:
        holder.pending -= 1
        if holder.pending == 0:
          holder.maybe_release()

  @_exclusive
  def flush(self, block_until_num_items: int = 0, timeout_ms: Optional[int] = None) -> None:
    """Waits until at most `block_until_num_items` created items are not yet in their tables.

    Args:
      block_until_num_items: queued items allowed to remain (>= 0).
      timeout_ms: None waits forever, 0 does not wait, > 0 milliseconds.

    Raises:
      ValueError: negative `block_until_num_items` or `timeout_ms`.
      DeadlineExceededError: the rate limiter did not admit enough items in time; the rest stay
        queued for later calls. The message names the table and its limiter counters.
      TableClosedError: the server stopped.
    """
    self._check_open()
    if isinstance(block_until_num_items, bool) or not isinstance(
        block_until_num_items, (int, np.integer)) or block_until_num_items < 0:
      raise ValueError(f"block_until_num_items must be an int >= 0, got "
                       f"{block_until_num_items!r}")
    if self._segment.owner_dead:
      raise self._segment.dead_owner_error()
    deadline = timeouts.deadline_from_ms(timeout_ms)
    if not self._drain(int(block_until_num_items), deadline, timeout_ms):
      raise self._deadline_error("flush", timeout_ms)
    timeout_error = _await_inserts(self._client, int(block_until_num_items) - len(self._pending),
                                   deadline, timeout_ms, "flush")
    if timeout_error is not None:
      raise timeout_error

  def _deadline_error(self, what: str, timeout_ms) -> errors.DeadlineExceededError:
    return errors.DeadlineExceededError(
        f"Timeout exceeded: {what}(timeout_ms={timeout_ms}) gave up with "
        f"{len(self._pending)} items still waiting for the rate limiter; they stay queued and "
        f"are inserted as soon as it admits them. "
        f"({self._last_deadline_error})")

  @_exclusive
  def end_episode(self, clear_buffers: bool = True, timeout_ms: Optional[int] = None) -> None:
    """Flushes every queued item, then starts a new episode.

    The episode ends even when the flush times out (as Reverb documents but does not do): the
    next append starts a new episode with a new random id. Open chunks are shrunk to their rows.

    Args:
      clear_buffers: expire every ref and empty the history (else refs stay usable).
      timeout_ms: None waits forever, 0 does not wait, > 0 milliseconds.

    Raises:
      ValueError: negative `timeout_ms`.
      DeadlineExceededError: items remain queued after the deadline (the episode was ended).
      TableClosedError: the server stopped (the episode was ended).
    """
    self._check_open()
    if self._segment.owner_dead:
      raise self._segment.dead_owner_error()
    deadline = timeouts.deadline_from_ms(timeout_ms)
    try:
      reached = self._drain(0, deadline, timeout_ms)
      timeout_error = reached and _await_inserts(self._client, 0, deadline, timeout_ms,
                                                 "end_episode")
    finally:
      self._new_episode(bool(clear_buffers))
    if timeout_error:
      raise errors.DeadlineExceededError(f"{timeout_error} The episode was ended anyway.")
    if not reached:
      raise errors.DeadlineExceededError(
          f"{self._deadline_error('end_episode', timeout_ms)} The episode was ended anyway.")

  def _new_episode(self, clear: bool) -> None:
    self._fast = None
    if self._step_open:
      self._close_steps(1)
    if clear:
      self._flush_batch(insert=False)   # left by a failed flush: their steps are cleared now
    for col in self._columns:
      col.close_chunk()
      if clear:
        col.clear()
    if clear:
      self._hist_step = 0
    self._episode_steps = 0
    self._episode_id = random_u64.one()

  @_exclusive
  def configure(self, path: tuple, *, num_keep_alive_refs: int,
                max_chunk_length: Optional[int]) -> None:
    """Overrides chunking and keep-alive for one column (now or when it first appears).

    Args:
      path: the column's path in the step structure, e.g. ('obs',).
      num_keep_alive_refs: steps the column keeps referenceable (>= 1).
      max_chunk_length: rows per chunk (1 <= m <= num_keep_alive_refs), or None for the
        automatic byte budget (64 KiB, 1..1024 rows). Applies from the column's next chunk.

    Raises:
      ValueError: out-of-range values.
    """
    self._check_open()
    self._fast = None
    num_keep_alive_refs = check_positive_int(num_keep_alive_refs, "num_keep_alive_refs")
    if max_chunk_length is not None:
      max_chunk_length = check_positive_int(max_chunk_length, "max_chunk_length")
      if max_chunk_length > num_keep_alive_refs:
        raise ValueError(f"max_chunk_length ({max_chunk_length}) must be None or <= "
                         f"num_keep_alive_refs ({num_keep_alive_refs})")
    path = tuple(path)
    self._configs[path] = (num_keep_alive_refs, max_chunk_length)
    col = self._by_path.get(path)
    if col is not None:
      col.max_chunk_length = max_chunk_length
      col.set_keep_alive(num_keep_alive_refs)

  # ---- lifetime

  @_exclusive
  def close(self, timeout_ms: Optional[int] = CLOSE_TIMEOUT_MS) -> None:
    """Inserts the created items, waiting up to `timeout_ms` for those that their rate limiter
    holds back, then closes the writer: releases every chunk no item needs.

    Items still held back when the wait ends are not dropped: they go on in the background,
    inserted as soon as their limiter admits them (the chunks they reference stay pinned
    until then), with a RuntimeWarning that says how many. At interpreter exit those get one
    more bounded wait (5 s for all writers) and are then dropped with a RuntimeWarning.
    Returns at once after the server stopped (its items cannot be inserted any more; they are
    dropped with a RuntimeWarning). Idempotent; other methods raise RuntimeError after it.

    Args:
      timeout_ms: the longest wait for held-back items (CLOSE_TIMEOUT_MS, 5000, by default);
        0 does not wait; None waits until every item is in its table.

    Raises:
      ValueError: `timeout_ms` is negative or not a number (nothing is closed).
    """
    deadline_ns = timeouts.deadline_from_ms(timeout_ms)
    self._close(hand_over=self._background, deadline_ns=deadline_ns, timeout_ms=timeout_ms)

  def _close(self, hand_over: bool, deadline_ns: int = 0, timeout_ms=0) -> None:
    """Closes after inserting what the limiters admit before `deadline_ns` (0: now); the rest
    is handed to the delivery thread (`hand_over`) or dropped, each with a warning."""
    if self._closed:
      return
    cause = None   # why the items left are dropped, when it is not their limiter
    try:
      self._drain(0, deadline_ns, timeout_ms)
    except errors.ReverbError as e:
      hand_over = False   # server stopped or an item was rejected: the queue is dropped below
      cause = e
    finally:
      if not (hand_over and self._pending):
        _close_inserts(self._client)
      if hand_over and self._pending:
        warnings.warn(f"TrajectoryWriter.close(timeout_ms={timeout_ms}): {len(self._pending)} "
                      "items are still held back by their rate limiter; they are inserted in "
                      "the background as soon as it admits them", RuntimeWarning, stacklevel=4)
      self._release_all(keep_pending=hand_over, cause=cause)

  def _release_all(self, keep_pending: bool = False,
                   cause: Optional[BaseException] = None) -> None:
    self._closed = True
    self._fast = None
    dropped = len(self._batch)
    self._batch = []
    if keep_pending and self._pending:
      delivery.adopt(self)
    else:
      dropped += len(self._pending)
      self._finish(len(self._pending))
    for col in self._columns:
      col.close_chunk()
      col.clear()
    if dropped and cause is not None:
      warnings.warn(f"TrajectoryWriter closed with {dropped} items that could not be inserted "
                    f"({type(cause).__name__}: {cause}); they were dropped", RuntimeWarning,
                    stacklevel=3)
    elif dropped:
      warnings.warn(f"TrajectoryWriter closed with {dropped} items that their rate limiter did "
                    "not admit; they were dropped (call flush() before close() to wait)",
                    RuntimeWarning, stacklevel=3)

  def __del__(self):
    if getattr(self, "_closed", True):
      return
    try:
      _finalising(self._client)
      self._close(hand_over=False)
    except Exception:  # pylint: disable=broad-except  (never raise from a finaliser)
      pass

  def __enter__(self) -> "TrajectoryWriter":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None or not issubclass(exc_type, errors.ReverbError):
      self.flush()

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("TrajectoryWriter is closed")

  def __repr__(self):
    return (f"TrajectoryWriter(columns={len(self._columns)}, episode_steps={self._episode_steps}"
            f", pending_items={len(self._pending)}, closed={self._closed})")


# --------------------------------------------------------------------------------------------
# Asynchronous clients (the bridge's remote clients). A client may offer `writer_session()`: the
# client object a new writer then uses (with `_segment` and `_table_handle`), whose tables confirm
# inserts asynchronously; it offers `in_flight()` (items sent, not yet confirmed),
# `await_inserts(until, deadline_ns, timeout_ms, what)` (returns a DeadlineExceededError on
# timeout, raises the tables' errors), `close_inserts()` and `finalising()` (the writer is closed
# from its __del__: no new streams, whose threads must not start inside the garbage collector).
# Local clients offer none of these: the hooks do nothing then.


def _writer_client(client):
  session = getattr(client, "writer_session", None)
  return client if session is None else session()


def _in_flight(client) -> int:
  in_flight = getattr(client, "in_flight", None)
  return 0 if in_flight is None else in_flight()


def _await_inserts(client, until: int, deadline_ns: int, timeout_ms,
                   what: str) -> Optional[errors.DeadlineExceededError]:
  wait = getattr(client, "await_inserts", None)
  return None if wait is None else wait(until, deadline_ns, timeout_ms, what)


def _finalising(client) -> None:
  hook = getattr(client, "finalising", None)
  if hook is not None:
    hook()


def _close_inserts(client) -> None:
  close = getattr(client, "close_inserts", None)
  if close is not None:
    close()


