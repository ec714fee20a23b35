"""Legacy Writer: `client.writer(max_sequence_length)`.

Every appended step is a flat list of leaves (the number of leaves is fixed by the first step);
`create_item(table, num_timesteps, priority)` references the last `num_timesteps` steps of every
leaf, so a sample of the item has one column per leaf with a leading time dim of
`num_timesteps`. Built on :class:`~reverb_shm.trajectory_writer.TrajectoryWriter`, which keeps
the last `max_sequence_length` steps referenceable and writes them in place into shared memory.

`delta_encoded` is accepted for compatibility and ignored: chunks are stored raw so that samples
are zero-copy views.
"""
from typing import Any, Optional

from reverb_shm import errors
from reverb_shm import trajectory_writer as trajectory_writer_lib
from reverb_shm._internal import columns as columns_lib
from reverb_shm._internal import structure, timeouts

__all__ = ["Writer"]

_UNLIMITED_IN_FLIGHT = 1_000_000


def _positive_int(value, name: str) -> int:
  if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < 1:
    raise ValueError(f"{name} must be an int >= 1, got {value!r}")
  return int(value)


class Writer:
  """Writes fixed-layout steps and inserts items over the last N of them.

  Args:
    client: the Client whose tables receive the items.
    max_sequence_length: most steps an item may span (>= 1); that many steps stay buffered.
    delta_encoded: ignored (accepted for compatibility).
    chunk_length: rows per chunk, 1..max_sequence_length; default min(10, max_sequence_length).
    max_in_flight_items: items created but not yet admitted by their rate limiter before
      `create_item` blocks (>= 1; None means 1,000,000).

  Raises:
    ValueError: an argument out of range.

  Not thread-safe: use a writer from one thread at a time.
  """

  def __init__(self, client, max_sequence_length: int, delta_encoded: bool = False,
               chunk_length: Optional[int] = None, max_in_flight_items: Optional[int] = 25):
    self._closed = True   # until constructed, so __del__ is harmless
    del delta_encoded
    self._max_sequence_length = _positive_int(max_sequence_length, "max_sequence_length")
    if chunk_length is None:
      chunk_length = min(10, self._max_sequence_length)
    chunk_length = _positive_int(chunk_length, "chunk_length")
    if chunk_length > self._max_sequence_length:
      raise ValueError(f"chunk_length ({chunk_length}) must be <= max_sequence_length "
                       f"({self._max_sequence_length})")
    self._chunk_length = chunk_length
    self._max_in_flight = (_UNLIMITED_IN_FLIGHT if max_in_flight_items is None
                           else _positive_int(max_in_flight_items, "max_in_flight_items"))
    # Items are checked here, per step as Reverb's legacy writer does (its table signature
    # describes one timestep), not by the TrajectoryWriter, which checks whole items.
    self._writer = trajectory_writer_lib.TrajectoryWriter(client, self._max_sequence_length,
                                                          validate_items=False)
    self._client = client
    self._num_leaves: Optional[int] = None
    self._step_columns: Any = None   # (dtype, shape) of each leaf of one step
    self._checked_tables: set = set()   # tables whose signature the step layout matches
    self._buffered = 0
    self._closed = False

  @property
  def max_sequence_length(self) -> int:
    return self._max_sequence_length

  def append(self, data: Any) -> None:
    """Appends one step.

    Args:
      data: a nest of arrays / Python values; its flattened leaf count must be the same at
        every step.

    Raises:
      ValueError: a different leaf count, a None leaf, or a dtype/shape change in a leaf; the
        writer is closed.
    """
    self._check_open()
    leaves = self._leaves(data)
    self._writer.append(leaves)
    if self._step_columns is None:
      self._step_columns = [(a.dtype, a.shape) for a in map(structure.to_array, leaves)]
    self._buffered = min(self._buffered + 1, self._max_sequence_length)

  def append_sequence(self, sequence: Any) -> None:
    """Appends T steps given as a nest whose leaves share the leading dim T (>= 1).

    Raises:
      ValueError: a scalar leaf, leaves with different leading dims, or as `append`.
    """
    self._check_open()
    leaves = self._leaves(sequence)
    lengths = set()
    for i, leaf in enumerate(leaves):
      arr = structure.to_array(leaf)
      if arr.ndim == 0:
        raise ValueError(f"append_sequence needs a leading (time) dim, but leaf {i} is a scalar")
      lengths.add(arr.shape[0])
    if len(lengths) != 1:
      raise ValueError(f"append_sequence leaves must share the leading dim, got {sorted(lengths)}")
    if lengths.pop() == 0:
      return
    self._writer.extend(leaves)
    if self._step_columns is None:
      self._step_columns = [(a.dtype, a.shape[1:]) for a in map(structure.to_array, leaves)]
    self._buffered = min(self._buffered + len(structure.to_array(leaves[0])),
                         self._max_sequence_length)

  def _leaves(self, data) -> list:
    leaves, _ = structure.flatten(data)
    if not leaves:
      raise ValueError("data must contain at least one value")
    if any(leaf is None for leaf in leaves):
      raise ValueError("the legacy Writer needs a value for every leaf; got None")
    if self._num_leaves is None:
      for i in range(len(leaves)):
        self._writer.configure((i,), num_keep_alive_refs=self._max_sequence_length,
                               max_chunk_length=self._chunk_length)
      self._num_leaves = len(leaves)
    elif len(leaves) != self._num_leaves:
      raise ValueError(f"Flattened data has an unexpected length, got {len(leaves)} but wanted "
                       f"{self._num_leaves}.")
    return leaves

  def create_item(self, table: str, num_timesteps: int, priority: float) -> None:
    """Inserts an item over the last `num_timesteps` appended steps of every leaf.

    Blocks while more than `max_in_flight_items` items wait for their rate limiter.

    Raises:
      ValueError: num_timesteps < 1, more than buffered or than max_sequence_length; a NaN or
        otherwise invalid priority; an unknown table; steps not matching the table's signature
        (which describes one timestep: a [T, 3] item of steps of shape [3] matches a signature
        of shape [3], as in Reverb).
    """
    self._check_open()
    if isinstance(num_timesteps, bool) or not hasattr(num_timesteps, "__index__") or (
        num_timesteps < 1):
      raise ValueError(f"num_timesteps must be an int >= 1, got {num_timesteps!r}")
    if num_timesteps > self._max_sequence_length:
      raise ValueError(f"num_timesteps ({num_timesteps}) must be <= max_sequence_length "
                       f"({self._max_sequence_length})")
    if num_timesteps > self._buffered:
      raise ValueError(f"num_timesteps ({num_timesteps}) is larger than the number of steps "
                       f"appended so far ({self._buffered})")
    n = int(num_timesteps)
    if table not in self._checked_tables:
      self._check_signature(table)
    trajectory = [column[-n:] for column in self._writer.history]
    self._writer.create_item(table, priority, trajectory)
    if self._writer.num_pending_items > self._max_in_flight:
      self._writer.flush(self._max_in_flight)

  def _check_signature(self, table: str) -> None:
    """Checks the step layout against `table`'s signature, once per table (the layout of every
    step is the first step's: append rejects any other)."""
    handle = self._client._table_handle(table)  # pylint: disable=protected-access
    try:
      columns_lib.check_signature(table, handle.flat_signature, self._step_columns)
    except ValueError as e:
      raise ValueError(f"{e} The legacy Writer's table signature describes one step of the "
                       "appended data (without the time dim of the item).") from None
    self._checked_tables.add(table)

  def flush(self) -> None:
    """Blocks until every created item is in its table."""
    self._check_open()
    self._writer.flush()

  def close(self, retry_on_unavailable: bool = True,
            timeout_ms: Optional[int] = trajectory_writer_lib.CLOSE_TIMEOUT_MS) -> None:
    """Flushes and closes the writer, as TrajectoryWriter.close: waits up to `timeout_ms` for
    the items that their rate limiter holds back; those still held back then are inserted in
    the background as soon as it admits them (with a RuntimeWarning), never dropped.

    Args:
      retry_on_unavailable: accepted for Reverb's signature (there is no connection to retry).
      timeout_ms: the longest wait (5000 by default); 0 does not wait; None waits for all.

    Raises:
      ValueError: close() was already called; `timeout_ms` is negative or not a number.
    """
    del retry_on_unavailable
    if self._closed:
      raise ValueError("close() has already been called on this Writer.")
    timeouts.deadline_from_ms(timeout_ms)   # (checked before anything changes)
    self._closed = True
    try:
      self._writer.flush(0, timeout_ms)
    except errors.DeadlineExceededError:
      pass   # what is left goes on in the background (close warns how many)
    finally:
      self._writer.close(timeout_ms=0)

  def _check_open(self) -> None:
    if self._closed:
      raise errors.WriterClosedError("This Writer has already been closed.")

  def __enter__(self) -> "Writer":
    self._check_open()
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if not self._closed:
      self.close()

  def __del__(self):
    if not getattr(self, "_closed", True):
      try:
        self._closed = True
        self._writer.close(timeout_ms=0)   # (a finaliser does not wait: the rest goes on)
      except Exception:  # pylint: disable=broad-except  (never raise from a finaliser)
        pass

  def __repr__(self):
    return (f"Writer(max_sequence_length={self._max_sequence_length}, "
            f"chunk_length={self._chunk_length}, closed={self._closed})")
