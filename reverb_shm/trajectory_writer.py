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
(SPEC "Our decisions" 14). Positions outside that range raise IndexError (decision 8); positions
within it whose step has left the keep-alive window, came before the column existed or skipped
the column read as None, which a TrajectoryColumn rejects with ValueError (SPEC §6).
"""
import collections
import math
import os
import warnings
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from reverb_shm import chunks, errors, structure, timeouts
from reverb_shm._lib import check, ffi, hot, lib

__all__ = ["TrajectoryWriter", "TrajectoryColumn", "CellRef"]

# Auto chunk length: as many rows as fit in this byte budget, clamped to [1, _AUTO_MAX_ROWS].
_AUTO_CHUNK_BYTES = 64 * 1024
_AUTO_MAX_ROWS = 1024
# Items queued behind the rate limiter before create_item blocks on the oldest one.
_MAX_PENDING = 1024
# Window items batched by create_item before they are inserted with one C call.
_BATCH_ITEMS = 256
# Distinct validated item kinds (table, column windows) remembered per writer.
_MAX_KINDS = 4096
# Descriptor sizes (rs_desc_hdr, rs_desc_col, rs_desc_slice) and the squeeze flag.
_DESC_FIXED, _DESC_COL, _DESC_SLICE = (chunks.DESC_HDR.itemsize, chunks.DESC_COL.itemsize,
                                       chunks.DESC_SLICE.itemsize)
SQUEEZE_FLAG = chunks.SQUEEZE

_SUPPORTED_KINDS = {"f": (2, 4, 8), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "b": (1,),
                    "c": (8, 16), "O": (8,)}


# --------------------------------------------------------------------------------------------
# Helpers shared with client.py


class _RandomU64:
  """Random uint64 values (item keys, episode ids), re-seeded from the OS after a fork."""

  def __init__(self):
    self._pid = None
    self._rng = None
    self._pool = []

  def __call__(self, n: int) -> np.ndarray:
    """n random uint64 values."""
    pid = os.getpid()
    if pid != self._pid:
      self._rng = np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
      self._pool = []
      self._pid = pid
    return self._rng.bit_generator.random_raw(n)

  def one(self) -> int:
    """One random uint64 as a Python int (drawn from a pool refilled 1024 at a time)."""
    if self._pid != os.getpid() or not self._pool:
      self._pool = self(1024).tolist()
    return self._pool.pop()


random_u64 = _RandomU64()


def check_supported_dtype(dtype: np.dtype, path) -> None:
  """Raises ValueError naming `path` unless `dtype` can be stored in a column."""
  if dtype.itemsize not in _SUPPORTED_KINDS.get(dtype.kind, ()) or dtype.fields is not None:
    raise ValueError(
        f"Unsupported dtype {dtype} for column {path}: expected one of float16/32/64, "
        "int8/16/32/64, uint8/16/32/64, bool, complex64/128, or str/bytes (object)")


def check_priority(priority, table_name: str, prioritized: bool) -> float:
  """Returns `priority` as a float; ValueError if NaN, infinite or negative on Prioritized."""
  try:
    value = float(priority)
  except (TypeError, ValueError):
    raise ValueError(f"`priority` must be a number, got {priority!r}") from None
  if math.isnan(value):
    raise ValueError("`priority` must not be nan.")
  if math.isinf(value):
    raise ValueError(f"`priority` must be finite, got {value}")
  if value < 0 and prioritized:
    raise ValueError(f"`priority` must not be negative for table '{table_name}' (it uses a "
                     f"Prioritized selector), got {value}")
  return value


def _shape_matches(spec_shape, shape) -> bool:
  if spec_shape is None:
    return True
  spec_shape = tuple(spec_shape)
  return len(spec_shape) == len(shape) and all(
      s is None or s == d for s, d in zip(spec_shape, shape))


def _dtype_matches(spec_dtype, dtype: np.dtype) -> bool:
  spec_dtype = np.dtype(getattr(spec_dtype, "as_numpy_dtype", spec_dtype))
  if spec_dtype.kind in "OSU":
    return dtype.kind == "O"
  return spec_dtype == dtype


def check_signature(table_name: str, flat_signature: Optional[list], columns: Sequence[tuple],
                    *, allow_unbatched: bool = False) -> None:
  """Checks item columns against a table's flattened signature.

  Args:
    table_name: for messages.
    flat_signature: flattened signature specs (objects with .shape/.dtype) or None (no check).
    columns: (dtype, shape) of each item column as the sample will return it (time dim
      included unless squeezed).
    allow_unbatched: also accept a spec matching the shape without its leading dim (Client.insert,
      whose items are single steps described per step or per trajectory).

  Raises:
    ValueError: column count, dtype or shape incompatible with the signature.
  """
  if flat_signature is None:
    return
  if len(flat_signature) != len(columns):
    raise ValueError(
        f"Unable to create item in table '{table_name}': the table signature has "
        f"{len(flat_signature)} columns but the item has {len(columns)}.")
  for i, (spec, (dtype, shape)) in enumerate(zip(flat_signature, columns)):
    if not _dtype_matches(spec.dtype, dtype):
      raise ValueError(
          f"Unable to create item in table '{table_name}': column {i} has dtype {dtype} but the "
          f"table signature expects {np.dtype(getattr(spec.dtype, 'as_numpy_dtype', spec.dtype))}"
          f" (spec {spec!r}).")
    ok = _shape_matches(spec.shape, shape) or (
        allow_unbatched and len(shape) >= 1 and _shape_matches(spec.shape, shape[1:]))
    if not ok:
      raise ValueError(
          f"Unable to create item in table '{table_name}': column {i} has shape {list(shape)} "
          f"which is incompatible with the table signature shape "
          f"{None if spec.shape is None else list(spec.shape)} (spec {spec!r}).")


def _window_starts(starts) -> np.ndarray:
  """int64 copy of create_window_items' `starts`; IndexError for values no int64 holds
  (an unsigned 2**64 - 1 must not wrap to -1, the last step)."""
  starts = np.asarray(starts)
  if starts.dtype.kind == "u" and starts.size and int(starts.max()) > np.iinfo(np.int64).max:
    raise IndexError(f"window start {int(starts.max())} is out of range (starts are step "
                     f"positions in the history, negative counting from the end)")
  return np.ascontiguousarray(starts, np.int64)


def _check_priorities(prios: np.ndarray, handle) -> None:
  """ValueError (check_priority's) for the first priority that is not finite, or negative on a
  Prioritized table."""
  bad = np.flatnonzero(~np.isfinite(prios) | ((prios < 0) & handle.prioritized))
  if len(bad):
    check_priority(prios[bad[0]], handle.name, handle.prioritized)


def _flat_dict_keys(nest, num_leaves: int) -> Optional[tuple]:
  """`nest`'s str keys in flatten order when `nest` is a non-empty dict of `num_leaves` leaves
  with str keys (the C fast paths then take leaves by key); else None."""
  if type(nest) is not dict or len(nest) != num_leaves or not nest or not all(
      type(k) is str for k in nest):
    return None
  return tuple(sorted(nest))


def _as_column_array(leaf) -> np.ndarray:
  if type(leaf) is np.ndarray and leaf.dtype.kind not in "USO":
    return leaf
  return structure.to_array(leaf)


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
    return max(1, min(_AUTO_MAX_ROWS, _AUTO_CHUNK_BYTES // max(1, self.row_bytes)))

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
    IndexError: a position (or explicit slice bound) outside the column's steps.
    ValueError: a selected position is None (expired, skipped or before the column existed).
    TypeError: another index type.
  """

  __slots__ = ()

  def __init__(self, column: _Column):
    self._column = column

  @property
  def path(self) -> tuple:
    return self._column.path

  def __len__(self) -> int:
    return self._column.n

  def _position(self, i) -> int:
    n = self._column.n
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
      raise TypeError(f"History positions must be ints, got {i!r} of type {type(i).__name__}")
    p = int(i) + n if i < 0 else int(i)
    if not 0 <= p < n:
      raise IndexError(f"Position {i} is out of range for column {self._column.path}, which has "
                       f"{n} steps since its buffers were last cleared")
    return p

  def _positions(self, s: slice) -> range:
    n = self._column.n
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
          raise IndexError(f"Slice {s} is out of range for column {self._column.path}, which "
                           f"has {n} steps since its buffers were last cleared")
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
    return f"ColumnHistory(path={self._column.path}, len={self._column.n})"


class TrajectoryColumn(hot.WindowBase):
  """Steps of one column selected for an item (SPEC §6).

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
    self._win = None    # (column, generation, start, stop, index) of a history window
    refs = list(data_references)
    if None in refs:   # CellRefs compare by identity
      raise ValueError(
          f"TrajectoryColumns cannot contain any None data references, got {refs} for "
          f"TrajectoryColumn at path {path}: the selected steps expired (left the keep-alive "
          "window), were skipped, or precede the column's first value.")
    if squeeze and len(refs) != 1:
      raise ValueError(f"Columns must contain exactly one data reference when squeeze is set, "
                       f"got {len(refs)} (path {path}).")
    self._cells = refs
    self._squeeze = bool(squeeze)
    self._path = path

  @property
  def _refs(self) -> List[CellRef]:
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


def _column_slices(refs: List[CellRef]) -> Tuple[list, list]:
  """Merges consecutive rows of one chunk into (chunk_off, row_offset, nrows) slices; also
  returns the holders (refs must be alive)."""
  slices = []
  holders = []
  last_holder = None
  last_end = -1
  for ref in refs:
    holder, row = ref._column.locate(ref._pos)
    if holder is last_holder and row == last_end:
      off, start, nrows = slices[-1]
      slices[-1] = (off, start, nrows + 1)
    else:
      slices.append((holder.off, row, 1))
      holders.append(holder)
    last_holder, last_end = holder, row + 1
  return slices, holders


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
  room = _AUTO_MAX_ROWS << 20
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


# --------------------------------------------------------------------------------------------
# The writer


class TrajectoryWriter(hot.WriterBase):
  """Writes steps into shared memory and inserts items referencing them (SPEC §6).

  Obtain one with `Client.trajectory_writer(num_keep_alive_refs)`. Not thread-safe: use a writer
  from one thread at a time.

  Args:
    client: the Client whose tables receive the items.
    num_keep_alive_refs: steps each column keeps referenceable (>= 1).
    validate_items: check items against their table's signature in `create_item`.
    item_batch_size: window items `create_item` batches before inserting them with one C
      call, or (a bridge client's writer) sending them in one message (reverb_shm extension;
      1 inserts or sends every item at once).

  Raises:
    ValueError: `num_keep_alive_refs < 1` or `item_batch_size < 1`.
  """

  def __init__(self, client, num_keep_alive_refs: int, *, validate_items: bool = True,
               item_batch_size: int = _BATCH_ITEMS):
    self._closed = True   # until fully constructed (so __del__ is harmless)
    num_keep_alive_refs = _check_positive_int(num_keep_alive_refs, "num_keep_alive_refs")
    self._item_batch_size = _check_positive_int(item_batch_size, "item_batch_size")
    self._client = _writer_client(client)
    self._segment = client._segment()  # pylint: disable=protected-access
    self._default_keep_alive = num_keep_alive_refs
    self._validate_items = bool(validate_items)
    self._columns: List[_Column] = []
    self._by_path = {}
    self._configs = {}           # path -> (num_keep_alive_refs, max_chunk_length)
    self._plans = {}             # treedef -> ([column or None per leaf], [path per leaf])
    self._structure = None       # union skeleton (leaves: _ColumnHistory)
    self._hist_step = 0          # closed steps since the last clear
    self._step_open = False      # a partial append opened the current step
    self._episode_steps = 0
    self._episode_id = random_u64.one()
    self._pending = collections.deque()
    self._batch = []             # (item kind, priority, starts) of window items not yet inserted
    self._kinds = {}             # (handle, ((column, length, squeeze), ...)) -> itself, validated
    self._last_kind = None       # the kind _kind() returned last (create_item's C fast path)
    self._fast = None            # hot.FastAppend of the last complete step, or None
    self._item_keys = None       # sorted keys of the last flat-dict trajectory, or None
    self._window_cols = None     # (history, its columns) for create_window_items
    self._tables = {}
    self._last_deadline_error = None
    self._closed = False

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
      arr = _as_column_array(leaf)
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
        self._fast = self._make_fast(plan[0], treedef, _flat_dict_keys(data, len(leaves)))

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
      arr = _as_column_array(leaf)
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
    new_columns = []
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
          allocated.append([_Holder(chunk, values=[_object_row(r, col.shape) for r in rows])])
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
    self._item_keys = _flat_dict_keys(trajectory, len(leaves))
    entry = self._window_entry(handle, priority, leaves)
    if entry is None:
      self._create_general(handle, [priority], [trajectory])
      return
    batch = self._batch
    batch.append(entry)
    if len(batch) >= self._item_batch_size or self._pending:
      self._flush_batch()

  def create_items(self, table: str, priorities: Sequence[float],
                   trajectories: Sequence[Any]) -> None:
    """Creates many items, in order, and inserts them at once (reverb_shm extension).

    Args:
      table: name of the table.
      priorities: one priority per item.
      trajectories: one trajectory nest per item (as in `create_item`).

    Raises:
      As `create_item`; nothing is inserted or queued when any item is invalid.
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
      IndexError: a window outside a column's steps.
      Nothing is created when any item is invalid.
    """
    self._check_open()
    handle = self._table(table)
    cols = self._window_columns(columns)
    length = _check_positive_int(num_timesteps, "num_timesteps")
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
    starts = _window_starts(starts)
    kind = self._kind(handle, tuple((col, length, False) for col in cols))
    self._flush_batch()
    self._publish()
    try:      # the C call validates every priority and window (alive steps only)
      blob, offs = self._encode_windows(kind, starts, prios, handle.prioritized, alive=True)
    except errors.InvalidArgumentError:
      _check_priorities(prios, handle)
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
      raise IndexError(f"create_window_items: item {bad[0]}'s window [{starts[bad[0]]}, "
                       f"+{length}) is out of range for column {col.path}, which has {col.n} "
                       "steps since its buffers were last cleared")
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
    return kind

  def _check_usable(self) -> None:
    """TableClosedError (Chunk.publish's) once the server stopped or in a fork child: rows are
    published later, so appends check here that their chunks can still be written."""
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
    """Inserts the batched window items: one rs_encode_windows + one insert per run of items
    of one kind (table and column windows); what the rate limiter holds back is queued.
    insert=False queues them all (before their steps are cleared; never raises
    TableClosedError)."""
    batch = self._batch
    if not batch:
      return
    try:
      self._publish()
    except errors.TableClosedError:
      if insert:
        raise
    self._batch = []
    i = 0
    try:
      while i < len(batch):
        kind = batch[i][0]
        j, positions, priorities = hot.batch_run(batch, i)
        blob, offs = self._encode_windows(kind, positions)
        i = j
        self._insert_encoded(kind[0], priorities, blob, offs, kind[1], positions, insert)
    except BaseException:
      self._batch = batch[i:] + self._batch
      raise
    self._collect()     # runs kept for the batch (queued items hold their chunks)

  @staticmethod
  def _encode_windows(kind: tuple, starts: np.ndarray, priorities: Optional[np.ndarray] = None,
                      nonneg: bool = False, alive: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """Descriptors of items whose column c covers kind's length c steps from starts[i, c]
    (starts of shape (n, ncols), positions) or starts[i] (shape (n,), negative ones counting
    from each column's end). Validates priorities when given, and (alive) that every step is
    inside its keep-alive window; InvalidArgumentError names the first bad item."""
    _, sig, flags, lengths = kind
    n, ncols = len(starts), len(sig)
    segs, col_segs, ends, bound = [], [0], [], 0
    for col, length, _ in sig:
      col_runs = col.segments(col.alive_from() if alive else 0)
      segs += col_runs
      col_segs.append(len(segs))
      ends.append(col.n)
      bound += min(length, len(col_runs))
    cap = n * (_DESC_FIXED + _DESC_COL * ncols + _DESC_SLICE * bound)
    blob = np.empty(cap, np.uint8)
    offs = np.empty(n + 1, np.uint64)
    size = ffi.new("uint64_t *")
    check(lib.rs_encode_windows(
        n, ncols, ffi.new("rs_window_seg[]", segs), ffi.new("uint32_t[]", col_segs),
        ffi.new("int64_t[]", ends), flags, lengths, ffi.from_buffer("int64_t[]", starts),
        1 if starts.ndim == 1 else ncols,
        ffi.NULL if priorities is None else ffi.from_buffer("double[]", priorities),
        bool(nonneg), ffi.from_buffer("uint8_t[]", blob, require_writable=True), cap,
        ffi.from_buffer("uint64_t[]", offs, require_writable=True), size), "creating items")
    return blob[:size[0]], offs

  def _insert_encoded(self, handle, priorities, blob: np.ndarray, offs: np.ndarray, sig: tuple,
                      positions: np.ndarray, insert: bool = True) -> None:
    """Inserts encoded window items (positions as _encode_windows' starts); those the rate
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
    encoded = [self._encode_item(handle, trajectory) for trajectory in trajectories]
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
    items = []
    for blob, prio, holders in zip(blobs, priorities, holder_sets):
      for h in holders:
        h.pending += 1
      items.append(_Pending(handle.table, random_u64.one(), float(prio), blob, holders))
    self._pending.extend(items)
    if not insert:
      return
    self._drain(0, 0)     # whatever the limiters admit right now, in FIFO order
    while len(self._pending) > _MAX_PENDING:
      self._drain(len(self._pending) - 1, -1)

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

  def _encode_item(self, handle, trajectory):
    leaves, _ = structure.flatten(trajectory)
    if not leaves:
      raise ValueError("trajectory must not be empty.")
    desc_columns = []
    holders = {}
    shapes = []
    for i, leaf in enumerate(leaves):
      if not isinstance(leaf, TrajectoryColumn):
        raise TypeError(f"All leaves of the trajectory must be TrajectoryColumns, but leaf {i} "
                        f"is a {type(leaf).__name__}: {leaf!r}")
      refs = leaf._refs
      if not refs:
        raise ValueError(f"Error in column {i}: the column references no steps.")
      first = refs[0]
      first_column = first._column
      if first_column.writer is not self:
        raise ValueError(f"Error in column {i}: the column references data of another "
                         "TrajectoryWriter.")
      for ref in refs:
        if ref.expired:
          raise ValueError(f"Error in column {i}: Column contains expired CellRef.")
        column = ref._column
        if column is not first_column:   # refs of one column agree by construction
          if column.writer is not self:
            raise ValueError(f"Error in column {i}: the column references data of another "
                             "TrajectoryWriter.")
          if column.dtype != first_column.dtype:
            raise ValueError(f"Error in column {i}: Column contains mixed dtypes "
                             f"({first.dtype} and {ref.dtype}).")
          if column.shape != first_column.shape:
            raise ValueError(f"Error in column {i}: Column contains incompatible shapes "
                             f"({list(first.shape)} and {list(ref.shape)}).")
      slices, column_holders = _column_slices(refs)
      for holder in column_holders:
        holders[id(holder)] = holder
      desc_columns.append((slices, leaf._squeeze))
      if self._validate_items and handle.flat_signature is not None:
        shapes.append((first_column.dtype, leaf.shape))
    if shapes:
      check_signature(handle.name, handle.flat_signature, shapes)
    return desc_columns, tuple(holders.values())

  def _table(self, name: str):
    handle = self._tables.get(name)
    if handle is None:
      if not isinstance(name, str):
        raise TypeError(f"table must be a str, got {type(name).__name__}")
      try:
        handle = self._client._table_handle(name)  # pylint: disable=protected-access
      except errors.UnknownTableError as e:
        raise errors.UnknownTableError(
            f"Unable to create item in table '{name}' since the table could not be found. "
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
      run = []
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
        f"are inserted by later create_item/flush/end_episode calls. "
        f"({self._last_deadline_error})")

  def end_episode(self, clear_buffers: bool = True, timeout_ms: Optional[int] = None) -> None:
    """Flushes every queued item, then starts a new episode.

    The episode ends even when the flush times out (SPEC "Our decisions" 3): the next append
    starts a new episode with a new random id. Open chunks are shrunk to their rows.

    Args:
      clear_buffers: expire every ref and empty the history (else refs stay usable).
      timeout_ms: None waits forever, 0 does not wait, > 0 milliseconds.

    Raises:
      ValueError: negative `timeout_ms`.
      DeadlineExceededError: items remain queued after the deadline (the episode was ended).
      TableClosedError: the server stopped (the episode was ended).
    """
    self._check_open()
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
    num_keep_alive_refs = _check_positive_int(num_keep_alive_refs, "num_keep_alive_refs")
    if max_chunk_length is not None:
      max_chunk_length = _check_positive_int(max_chunk_length, "max_chunk_length")
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

  def close(self) -> None:
    """Closes the writer without waiting: releases every chunk it holds.

    Queued items that their rate limiter admits right now are inserted; the others are dropped
    with a RuntimeWarning (call `flush()` or `end_episode()` first to wait for them). Never
    blocks, also after the server stopped. Idempotent; other methods raise RuntimeError after it.
    """
    if self._closed:
      return
    try:
      self._drain(0, 0)
    except errors.ReverbError:
      pass      # server stopped or an item was rejected: the queue is dropped below
    finally:
      _close_inserts(self._client)
      self._release_all()

  def _release_all(self) -> None:
    self._closed = True
    self._fast = None
    dropped = len(self._pending) + len(self._batch)
    self._batch = []
    self._finish(len(self._pending))
    for col in self._columns:
      col.close_chunk()
      col.clear()
    if dropped:
      warnings.warn(f"TrajectoryWriter closed with {dropped} items that their rate limiter did "
                    "not admit; they were dropped (call flush() before close() to wait)",
                    RuntimeWarning, stacklevel=3)

  def __del__(self):
    if getattr(self, "_closed", True):
      return
    try:
      _finalising(self._client)
      self.close()
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
# Asynchronous clients (issue 7b). A client may offer `writer_session()`: the client object a
# new writer then uses (with `_segment` and `_table_handle`), whose tables confirm inserts
# asynchronously; it offers `in_flight()` (items sent, not yet confirmed), `await_inserts(until,
# deadline_ns, timeout_ms, what)` (returns a DeadlineExceededError on timeout, raises the tables'
# errors), `close_inserts()` and `finalising()` (the writer is closed from its __del__: no new
# streams, whose threads must not start inside the garbage collector). Local clients offer none
# of these: the hooks do nothing then.


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


def _object_row(value, shape):
  if not shape:
    return value
  return np.asarray(value, dtype=object).reshape(shape)


def _check_positive_int(value, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be an int >= 1, got {value!r}")
  return int(value)
