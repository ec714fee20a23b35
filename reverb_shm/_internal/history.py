"""The trajectory writer's history: chunks it holds, columns of runs, cell refs and windows.

A TrajectoryWriter keeps, per column (one leaf path of the appended steps), the chunks it wrote
rows into and the runs of history positions those rows hold; `writer.history[path]` reads them as
TrajectoryColumn windows. The C fast paths (csrc/hot/hot_writer.c) read and write the fields of
the C base classes (ColumnBase, HistoryBase, WindowBase) directly.
"""
import collections
import math
from typing import Any, List, Optional, Sequence

import numpy as np

from reverb_shm import errors
from reverb_shm._internal._lib import hot

__all__ = ["CellRef", "TrajectoryColumn"]

# Auto chunk length: as many rows as fit in this byte budget, clamped to [1, AUTO_MAX_ROWS].
AUTO_CHUNK_BYTES = 64 * 1024
AUTO_MAX_ROWS = 1024


# --------------------------------------------------------------------------------------------
# Chunks, runs, refs and columns
#
# A column stores its steps as runs: [first_pos, holder, first_row, count] says that history
# positions first_pos .. first_pos+count-1 are rows first_row.. of holder's chunk. Positions in no
# run were skipped (or precede the column). The column's open run (the one `append` extends) keeps
# its count implicit, n - first_pos, so that appending a step costs one row write per column.
# Refs (CellRef, TrajectoryColumn windows) are (column, clear generation, position) and are checked
# against the column's keep-alive window when used; a holder is released once every run on it has
# left that window (and no window item is batched), no queued item needs it and it is no longer
# the column's current chunk.

_POS, _HOLDER, _ROW, _COUNT = range(4)



class _Holder:
  """A chunk this writer holds a pin on, with the reasons it still needs it."""

  __slots__ = ("chunk", "off", "data", "values", "used", "capacity", "live", "pending",
               "open")

  def __init__(self, chunk, values=None):
    self.chunk = chunk
    self.off = chunk.off
    self.data = chunk.data          # writable (capacity, *shape) view; None for object columns
    self.values = values            # object columns: the rows as written
    self.used = len(values) if values is not None else 0   # rows written (see _Column.sync)
    self.capacity = chunk.capacity
    self.live = 0                   # runs of this chunk inside a keep-alive window
    self.pending = 0                # queued items referencing it
    self.open = values is None      # still the column's current chunk (rows may be added)

  def publish(self) -> None:
    """Makes the written rows visible to items (TableClosedError once the server stopped)."""
    chunk = self.chunk
    if chunk is not None and chunk.rows < self.used:
      chunk.publish(self.used)

  def maybe_release(self) -> None:
    if self.live == 0 and self.pending == 0 and not self.open and self.chunk is not None:
      chunk, self.chunk, self.data = self.chunk, None, None
      chunk.release()   # a no-op once Server.stop() dropped this process's pins

  def close(self) -> None:
    """No more rows will be written: publish them, return the unused tail to the arena."""
    if self.open:
      self.open = False
      if self.chunk is not None and 0 < self.used:
        try:
          self.publish()
          if self.used < self.capacity:
            self.chunk.shrink()
            self.capacity = self.used
        except errors.TableClosedError:
          pass        # the server stopped: the chunk is gone with it
      self.maybe_release()

  def force_release(self) -> None:
    self.open = False
    self.live = self.pending = 0
    self.maybe_release()


class CellRef:
  """A reference to one step of one column (Reverb's WeakCellRef).

  Attributes:
    expired: True once the step left the column's keep-alive window or the writer cleared its
      buffers; an expired ref can no longer be read or put into an item.
    shape: element shape (tuple of ints, no time dim).
    dtype: numpy dtype of the element.
  """

  __slots__ = ("_column", "_gen", "_pos")

  def __init__(self, column: "_Column", gen: int, position: int):
    self._column = column
    self._gen = gen
    self._pos = position

  @property
  def expired(self) -> bool:
    column = self._column
    return self._gen != column.gen or self._pos < column.alive_from()

  @property
  def shape(self) -> tuple:
    return self._column.shape

  @property
  def dtype(self) -> np.dtype:
    return self._column.dtype

  def numpy(self) -> np.ndarray:
    """A copy of the referenced value (shape `self.shape`).

    Raises:
      RuntimeError: the ref has expired.
    """
    where = None if self.expired else self._column.locate(self._pos)
    if where is None:
      raise RuntimeError(f"Cannot read an expired reference of column {self._column.path}: the "
                         "step has left the writer's keep-alive window (num_keep_alive_refs).")
    holder, row = where
    if holder.values is not None:
      return holder.values[row]
    return np.array(holder.data[row])

  def __repr__(self):
    state = "expired" if self.expired else "alive"
    return f"CellRef(column={self._column.path}, {state})"


class _Column(hot.ColumnBase):
  """One leaf path of the union structure: dtype/shape, runs and keep-alive window.

  writer, open, n, gen, floor and keep_alive are fields of the C base, which the C fast paths
  (csrc/hot/hot_writer.c) read and write directly.
  """

  __slots__ = ("index", "path", "dtype", "shape", "is_object", "row_bytes",
               "max_chunk_length", "holder", "runs", "history")

  def __init__(self, writer, index, path, dtype, shape, keep_alive, max_chunk_length, n):
    self.writer = writer
    self.index = index
    self.path = path
    self.dtype = dtype
    self.shape = shape
    self.is_object = dtype.kind == "O"
    self.row_bytes = dtype.itemsize * math.prod(shape)
    self.keep_alive = keep_alive
    self.max_chunk_length = max_chunk_length
    self.holder = None            # current (open) numeric chunk
    self.runs = collections.deque()   # [first_pos, holder, first_row, count], by position
    self.open = None              # the last run while appends extend it (count implicit)
    self.n = n                    # positions since the last clear (including skipped ones)
    self.gen = 0                  # bumped by clear(): refs of an older generation are expired
    self.floor = 0                # positions below it expired (keep-alive shrunk by configure)
    self.history = _ColumnHistory(self)

  def chunk_length(self) -> int:
    if self.max_chunk_length is not None:
      return self.max_chunk_length
    return max(1, min(AUTO_MAX_ROWS, AUTO_CHUNK_BYTES // max(1, self.row_bytes)))

  def alive_from(self) -> int:
    """First position still inside the keep-alive window."""
    first = self.n - self.keep_alive
    return first if first > self.floor else self.floor

  def sync(self) -> None:
    """Brings the open run's holder.used up to date (append leaves it behind)."""
    run = self.open
    if run is not None:
      run[_HOLDER].used = run[_ROW] + self.n - run[_POS]

  def needs_chunk(self) -> bool:
    self.sync()
    holder = self.holder
    return self.is_object or holder is None or holder.used >= holder.capacity

  def close_run(self) -> None:
    run = self.open
    if run is not None:
      run[_COUNT] = self.n - run[_POS]
      run[_HOLDER].used = run[_ROW] + run[_COUNT]
      self.open = None

  def add_rows(self, holder: _Holder, first_row: int, count: int, keep_open: bool) -> None:
    """Rows [first_row, first_row + count) of holder now hold the next `count` positions."""
    run = self.open
    if run is None or run[_HOLDER] is not holder:
      self.close_run()
      run = [self.n, holder, first_row, count]
      self.runs.append(run)
      holder.live += 1
      self.open = run
    self.n += count
    if not keep_open:
      self.close_run()
    else:
      holder.used = first_row + count

  def skip(self) -> None:
    """The closing step did not write this column: its position reads as None."""
    self.close_run()
    self.n += 1

  def run_end(self, run) -> int:
    return self.n if run is self.open else run[_POS] + run[_COUNT]

  def locate(self, position: int):
    """(holder, row) of a stored position inside the keep-alive window, else None."""
    if not self.alive_from() <= position < self.n:
      return None
    for run in reversed(self.runs):
      if position >= run[_POS]:
        if position < self.run_end(run):
          return run[_HOLDER], run[_ROW] + position - run[_POS]
        return None
    return None

  def covers(self, start: int, stop: int) -> bool:
    """True when every position of [start, stop) is stored and alive (stop > start)."""
    if start < self.alive_from() or stop > self.n:
      return False
    run = self.open
    if run is not None and start >= run[_POS]:
      return True
    return all(self.locate(p) is not None for p in range(start, stop))

  def get(self, position: int) -> Optional[CellRef]:
    return CellRef(self, self.gen, position) if self.locate(position) is not None else None

  def segments(self, first: int = 0) -> list:
    """(first_pos, chunk_off, first_row, count) of every run from position `first` on, for
    rs_encode_windows."""
    out = []
    for run in self.runs:
      pos, end = run[_POS], self.run_end(run)
      if end > first:
        skip = first - pos if first > pos else 0
        out.append((pos + skip, run[_HOLDER].off, run[_ROW] + skip, end - pos - skip))
    return out

  def holders_between(self, start: int, stop: int) -> list:
    return [run[_HOLDER] for run in self.runs
            if run[_POS] < stop and self.run_end(run) > start]

  def collect(self) -> None:
    """Releases the holders of runs that left the keep-alive window, unless window items are
    batched: those may use the runs, which the writer's next batch insert then releases."""
    if self.writer._batch:  # pylint: disable=protected-access
      return
    first = self.alive_from()
    runs = self.runs
    while runs and runs[0] is not self.open and runs[0][_POS] + runs[0][_COUNT] <= first:
      self._drop(runs.popleft())

  @staticmethod
  def _drop(run) -> None:
    holder = run[_HOLDER]
    holder.live -= 1
    if holder.live == 0:
      holder.maybe_release()

  def set_keep_alive(self, keep_alive: int) -> None:
    self.floor = self.alive_from()      # expired positions stay expired
    self.keep_alive = keep_alive
    self.collect()

  def clear(self) -> None:
    self.close_run()
    runs, self.runs = self.runs, collections.deque()
    for run in runs:
      self._drop(run)
    self.n = 0
    self.floor = 0
    self.gen += 1

  def close_chunk(self) -> None:
    self.close_run()
    if self.holder is not None:
      holder, self.holder = self.holder, None
      holder.close()


class _ColumnHistory(hot.HistoryBase):
  """The history of one column, as found in `writer.history` (a leaf for nest libraries).

  Index with an int (a squeezed single-step TrajectoryColumn), a slice or a list of ints (a
  TrajectoryColumn with a time dim; any order, repeats allowed). Positions count the column's
  steps since the writer last cleared its buffers; negative positions count from the end.
  Deliberately not a Sequence, so that nest libraries treat it as a leaf.

  Indexing is the C base's: `h[-k:]` and `h[i]` over the column's open chunk are built in C,
  everything else by `_getitem`.

  Raises (on indexing):
    HistoryIndexError (an IndexError and a ValueError): a position (or explicit slice bound)
      outside the column's steps.
    ValueError: a selected position is None (expired, skipped or before the column existed).
    TypeError: another index type.
  """

  __slots__ = ()

  def __init__(self, column: _Column):
    self._column = column  # type: ignore[misc]  # a slot of the C base

  @property
  def path(self) -> tuple:
    return self._column.path

  def __len__(self) -> int:
    return self._length()

  def _length(self) -> int:
    """Positions of the column; an open partial step counts in every column as soon as it is
    opened (as in Reverb), and reads as None in the columns it has not set yet."""
    column = self._column
    writer = column.writer
    if writer._step_open and column.n <= writer._hist_step:  # pylint: disable=protected-access
      return writer._hist_step + 1  # pylint: disable=protected-access
    return column.n

  def _position(self, i) -> int:
    n = self._length()
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
      raise TypeError(f"History positions must be ints, got {i!r} of type {type(i).__name__}")
    p = int(i) + n if i < 0 else int(i)
    if not 0 <= p < n:
      raise errors.HistoryIndexError(f"Position {i} is out of range for column "
                                     f"{self._column.path}, which has {n} steps since its "
                                     "buffers were last cleared")
    return p

  def _positions(self, s: slice) -> range:
    n = self._length()
    for bound in (s.start, s.stop, s.step):
      if bound is not None and (isinstance(bound, bool) or
                                not isinstance(bound, (int, np.integer))):
        raise TypeError(f"Slice bounds must be ints or None, got {s}")
    if s.step == 0:
      raise ValueError("slice step cannot be zero")
    for bound in (s.start, s.stop):
      if bound is not None:
        b = int(bound) + n if bound < 0 else int(bound)
        if not 0 <= b <= n:
          raise errors.HistoryIndexError(f"Slice {s} is out of range for column "
                                         f"{self._column.path}, which has {n} steps since its "
                                         "buffers were last cleared")
    return range(*s.indices(n))

  def _getitem(self, index) -> "TrajectoryColumn":
    """The general path of indexing (see the class docstring)."""
    column = self._column
    if type(index) is slice:
      positions = self._positions(index)
      if positions.step == 1 and positions.stop > positions.start and column.covers(
          positions.start, positions.stop):
        return _window(column, positions.start, positions.stop, False, index)
      return TrajectoryColumn([column.get(p) for p in positions], path=column.path + (index,))
    if isinstance(index, list):
      return TrajectoryColumn([column.get(self._position(i)) for i in index],
                              path=column.path + (tuple(index),))
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
      p = self._position(index)
      if column.locate(p) is not None:
        return _window(column, p, p + 1, True, int(index))
      return TrajectoryColumn([None], squeeze=True, path=column.path + (int(index),))
    raise TypeError(f"Unsupported index type {type(index).__name__} for column history "
                    f"{column.path}: use an int, a slice or a list of ints")

  def __repr__(self):
    return f"ColumnHistory(path={self._column.path}, len={self._length()})"


class TrajectoryColumn(hot.WindowBase):
  """Steps of one column selected for an item.

  Args:
    data_references: CellRefs, one per step, in the order the sample returns them.
    squeeze: the column holds exactly one step and the sample drops its time dim.
    path: where the column came from, for messages.

  Raises:
    ValueError: a reference is None, or `squeeze` with other than one reference.
  """

  __slots__ = ()   # _cells, _squeeze, _path and _win are the C base's

  def __init__(self, data_references: Sequence[Optional[CellRef]], *, squeeze: bool = False,
               path: Optional[tuple] = None):
    # (column, generation, start, stop, index) of a history window
    self._win = None  # type: ignore[misc]  # a slot of the C base
    refs: List[Any] = list(data_references)
    if None in refs:   # CellRefs compare by identity
      raise ValueError(
          f"TrajectoryColumns cannot contain any None data references, got {refs} for "
          f"TrajectoryColumn at path {path}: the selected steps expired (left the keep-alive "
          "window), were skipped, or precede the column's first value.")
    if squeeze and len(refs) != 1:
      raise ValueError(f"Columns must contain exactly one data reference when squeeze is set, "
                       f"got {len(refs)} (path {path}).")
    self._cells = refs  # type: ignore[misc]  # a slot of the C base
    self._squeeze = bool(squeeze)  # type: ignore[misc]  # a slot of the C base
    self._path = path  # type: ignore[misc]  # a slot of the C base

  @property
  def _refs(self) -> List[Any]:
    cells = self._cells
    if cells is None:
      column, gen, start, stop, _ = self._win
      cells = self._cells = [CellRef(column, gen, p) for p in range(start, stop)]
    return cells

  @property
  def is_squeezed(self) -> bool:
    return self._squeeze

  @property
  def path(self) -> Optional[tuple]:
    win = self._win
    return self._path if win is None else win[0].path + (win[4],)

  @property
  def dtype(self) -> Optional[np.dtype]:
    """numpy dtype of the first reference (None when empty)."""
    if self._win is not None:
      return self._win[0].dtype
    return self._cells[0].dtype if self._cells else None

  @property
  def shape(self) -> tuple:
    """(steps, *element shape), or the element shape when squeezed."""
    refs = self._refs
    elem = refs[0].shape if refs else ()
    return tuple(elem) if self._squeeze else (len(refs),) + tuple(elem)

  def __len__(self) -> int:
    win = self._win
    return len(self._cells) if win is None else win[3] - win[2]

  def __iter__(self):
    return iter(self._refs)

  def __getitem__(self, index) -> "TrajectoryColumn":
    if isinstance(index, slice):
      return TrajectoryColumn(self._refs[index], path=self.path)
    if isinstance(index, list):
      return TrajectoryColumn([self._refs[i] for i in index], path=self.path)
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
      return TrajectoryColumn([self._refs[index]], squeeze=True, path=self.path)
    raise TypeError(f"Unsupported index type {type(index).__name__}")

  def numpy(self) -> np.ndarray:
    """The referenced values, stacked along a new time dim unless squeezed.

    Raises:
      RuntimeError: a reference has expired.
    """
    refs = self._refs
    values = [r.numpy() for r in refs]
    if self._squeeze:
      return values[0]
    if refs and refs[0].dtype.kind == "O":
      out = np.empty((len(values),) + tuple(refs[0].shape), dtype=object)
      for i, v in enumerate(values):
        out[i] = v
      return out
    return np.stack(values)

  def window(self):
    """(column, generation, start, stop, None) when the column is contiguous steps of one
    writer column, else None (the batched item path needs that)."""
    refs = self._cells
    if self._win is not None:
      return self._win
    if not refs:
      return None
    first = refs[0]
    column, gen, start = first._column, first._gen, first._pos
    for i, ref in enumerate(refs):
      if ref._column is not column or ref._gen != gen or ref._pos != start + i:
        return None
    return column, gen, start, start + len(refs), None

  def __repr__(self):
    return f"TrajectoryColumn(path={self.path}, shape={self.shape}, squeeze={self._squeeze})"


hot.writer_setup(TrajectoryColumn)
# _window(column, start, stop, squeeze, index): a TrajectoryColumn over positions [start, stop)
# of column (all stored and alive).
_window = hot.new_window


# --------------------------------------------------------------------------------------------
# Union structure


def _union(a, b):
  """Union of two history skeletons (leaves: _ColumnHistory or None)."""
  if a is None:
    return b
  if b is None or a is b:
    return a
  if isinstance(a, dict) and isinstance(b, dict):
    keys = set(a) | set(b)
    try:
      keys = sorted(keys)
    except TypeError:
      keys = list(a) + [k for k in b if k not in a]
    return {k: _union(a.get(k), b.get(k)) for k in keys}
  if isinstance(a, tuple) and hasattr(a, "_fields"):
    if type(a) is not type(b):
      raise ValueError(f"Cannot merge step structures: {type(a).__name__} vs {type(b).__name__}")
    return type(a)(*[_union(x, y) for x, y in zip(a, b)])
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    longer = a if len(a) >= len(b) else b
    merged = [_union(a[i] if i < len(a) else None, b[i] if i < len(b) else None)
              for i in range(len(longer))]
    return type(longer)(merged)
  raise ValueError(f"Cannot merge step structures: a {type(a).__name__} and a "
                   f"{type(b).__name__} appear at the same path")


def _prune(node):
  """Drops dict entries that hold no column (fields only ever None); None if nothing remains."""
  if isinstance(node, dict):
    out = {k: v for k, v in ((k, _prune(v)) for k, v in node.items()) if v is not None}
    return out or None
  if isinstance(node, tuple) and hasattr(node, "_fields"):
    return type(node)(*[_prune(x) for x in node])
  if isinstance(node, (list, tuple)):
    return type(node)(_prune(x) for x in node)
  return node
