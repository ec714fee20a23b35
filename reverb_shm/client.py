"""Client: Reverb's client API over a server's shared-memory segment (SPEC §5).

A Client names a server by address ('localhost:PORT', 'HOST:PORT' of this host, or
'shm://NAME'). It attaches lazily on first use and again after a fork; it pickles as its
address, so it can be handed to spawned processes.
"""
import os
import time
from typing import Any, Dict, Generator, List, Optional, Sequence, Tuple, Union

import numpy as np

from reverb_shm import chunks, errors, shm, structure, timeouts
from reverb_shm import table as table_lib
from reverb_shm import trajectory_writer as trajectory_writer_lib
from reverb_shm.replay_sample import ReplaySample, SampleInfo
from reverb_shm.selectors import PRIORITIZED
from reverb_shm.shared_table import SharedTable

__all__ = ["Client"]

# Polling interval while server_info waits for a server to appear.
_SERVER_POLL_S = 0.02


class _TableHandle:
  """What the client and its writers need of one table, cached per attached segment."""

  __slots__ = ("name", "index", "seg", "table", "signature", "flat_signature", "prioritized")

  def __init__(self, seg: shm.Segment, name: str):
    self.seg = seg
    self.name = name
    self.index = seg.table_index(name)
    self.table = SharedTable(seg, self.index)
    self.signature = self.table.signature
    self.flat_signature = (None if self.signature is None
                           else structure.flatten(self.signature)[0])
    stats = seg.stats(self.index)
    self.prioritized = PRIORITIZED in (stats["sampler_kind"], stats["remover_kind"])


class Client:
  """Client of a reverb_shm server on this host.

  Args:
    server_address: 'localhost:PORT' (or another name of this host), or 'shm://NAME'.

  Thread-safe: calls may come from several threads (each call is independent).
  """

  def __new__(cls, server_address=None, *args, **kwargs):
    # Dispatch (issue 7): a remote bridge address gives a RemoteClient, several addresses a
    # ShardedClient (reverb_shm.bridge.addresses describes the rules).
    if cls is Client and (isinstance(server_address, (list, tuple)) or (
        isinstance(server_address, str) and not server_address.startswith("shm://"))):
      from reverb_shm.bridge import addresses  # pylint: disable=g-import-not-at-top
      remote = addresses.remote_client_for(server_address)
      if isinstance(remote, type):
        return super().__new__(remote)
      if remote is not None:
        return remote
    return super().__new__(cls)

  def __init__(self, server_address: str):
    if not isinstance(server_address, str):
      raise TypeError(f"server_address must be a str, got {type(server_address).__name__}")
    self._address = server_address
    self._seg = None
    self._seg_pid = None
    self._handles: Dict[str, _TableHandle] = {}

  def __reduce__(self):
    return Client, (self._address,)

  @property
  def server_address(self) -> str:
    return self._address

  def __repr__(self):
    return f"Client(server_address={self._address!r})"

  # ---- attachment
  def _segment(self) -> shm.Segment:
    """The server's segment in this process (attached on first use and after a fork).

    Raises:
      ServerUnavailableError: no server answers to the address.
    """
    seg = self._seg
    if seg is None or self._seg_pid != os.getpid():
      seg = shm.Segment.attach(shm.resolve_address(self._address))
      self._seg, self._seg_pid, self._handles = seg, os.getpid(), {}
    return seg

  def _table_handle(self, table: str) -> _TableHandle:
    """Cached handle of `table`; UnknownTableError (naming the available tables) if absent."""
    seg = self._segment()
    handle = self._handles.get(table)
    if handle is None:
      if not isinstance(table, str):
        raise TypeError(f"table name must be a str, got {type(table).__name__}")
      handle = self._handles[table] = _TableHandle(seg, table)
    return handle

  def shared_table(self, table: str) -> SharedTable:
    """The low-level batched handle of `table` (reverb_shm extension).

    Raises:
      UnknownTableError: no such table (the message lists the available ones).
    """
    seg = self._segment()
    return SharedTable(seg, seg.table_index(table))

  # ---- insert
  def insert(self, data: Any, priorities: Dict[str, float]) -> None:
    """Inserts `data` as one single-step item into each table of `priorities`.

    The data is written to shared memory once and referenced by every table's item; each
    column is stored with a leading time dim of 1 (np.ones([3, 3]) samples as [1, 3, 3]).
    Blocks until every table's rate limiter admits its item.

    Args:
      data: nest of arrays / Python values (one step).
      priorities: table name -> priority (finite; >= 0 for Prioritized tables).

    Raises:
      ValueError: empty `priorities`, empty data, None leaves, unsupported dtypes, bad
        priorities, data not matching a table's signature, or an unknown table (an
        UnknownTableError naming the available tables). Nothing is inserted then.
      ResourceExhaustedError: the chunk arena is full.
      TableClosedError: the server stopped.
    """
    handles, prios, arrays = checked_insert(self, data, priorities)
    seg = self._segment()
    episode_id = trajectory_writer_lib.random_u64.one()
    written = []
    try:
      for a in arrays:
        if a.dtype.kind == "O":
          written.append(chunks.object_chunk(seg, [a], episode_id=episode_id))
        else:
          chunk = chunks.alloc_chunk(seg, a.dtype, a.shape, 1, episode_id=episode_id)
          written.append(chunk)
          chunk.append(a)
      blob = chunks.encode_descriptor([([(c.off, 0, 1)], False) for c in written])
      offs = np.array([0, len(blob)], np.uint64)
      for h, prio in zip(handles, prios):
        key = np.array([trajectory_writer_lib.random_u64.one()], np.uint64)
        h.table.insert_descriptors(key, prio[None], blob, offs)
    finally:
      for c in written:
        c.release()

  # ---- sample
  def sample(self, table: str, num_samples: int = 1, *, emit_timesteps: bool = True,
             unpack_as_table_signature: bool = False,
             rate_limiter_timeout_ms: Optional[int] = None
             ) -> Generator[Union[List[ReplaySample], ReplaySample], None, None]:
    """Samples `num_samples` items one at a time, each when the rate limiter allows.

    Args:
      table: table name.
      num_samples: items to yield (>= 1).
      emit_timesteps: yield each item as a list of ReplaySample, one per time step (every
        column must have the same leading length); else one ReplaySample whose data is the
        flat list of columns (squeezed columns have no time dim).
      unpack_as_table_signature: data is nested as the table's signature (if it has one).
      rate_limiter_timeout_ms: per item: None waits forever, 0 does not wait, > 0 ms
        (reverb_shm extension).

    Yields:
      list[ReplaySample] (emit_timesteps) or ReplaySample. Numeric columns are read-only
      zero-copy views of shared memory that stay valid while any of them lives.

    Raises:
      UnknownTableError (a RuntimeError and ValueError): no such table, raised at the call.
      ValueError: num_samples < 1, negative timeout; an item that cannot be split into steps.
      DeadlineExceededError: the limiter did not allow a sample in time (the message names the
        table and its counters).
      TableClosedError: the server stopped.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or (
        num_samples < 1):
      raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    timeouts.deadline_from_ms(rate_limiter_timeout_ms, "rate_limiter_timeout_ms")
    handle = self._table_handle(table)
    treedef = None
    if unpack_as_table_signature and handle.signature is not None:
      treedef = structure.flatten(handle.signature)[1]
    return self._sample_gen(handle, int(num_samples), emit_timesteps, treedef,
                            rate_limiter_timeout_ms)

  @staticmethod
  def _sample_gen(handle, num_samples, emit_timesteps, treedef, timeout_ms):
    seg, st = handle.seg, handle.table
    for _ in range(num_samples):
      recs, pins = st.sample_records(1, timeout_ms)
      key, probability, table_size, priority, times_sampled, _, desc_off = recs[0].tolist()
      info = SampleInfo(key, probability, table_size, priority, times_sampled)
      data = chunks.read_item(seg, desc_off, pins)
      del pins  # the views keep it (and the item) alive as long as they live
      yield to_samples(info, data, emit_timesteps, treedef)

  # ---- mutation
  def mutate_priorities(self, table: str, updates: Optional[Dict[int, float]] = None,
                        deletes: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """Deletes `deletes`, then sets `updates` (SPEC "Our decisions" 1); unknown keys ignored.

    Every key and priority is validated before anything changes.

    Returns:
      (number of priorities updated, number of items deleted).

    Raises:
      UnknownTableError: no such table.
      ValueError: a NaN/infinite priority, or a negative one on a Prioritized table.
      TableClosedError: the server stopped.
    """
    st = self._table_handle(table).table
    # Python ints above 2**63 would make numpy guess float64: pass uint64 scalars instead.
    if updates:
      updates = {_key(k): v for k, v in updates.items()}
    if deletes is not None and len(deletes):
      deletes = [_key(k) for k in deletes]
    return st.mutate(updates, deletes)

  def reset(self, table: str) -> None:
    """Removes every item of `table` and zeroes its limiter and episode counters.

    Raises:
      UnknownTableError: no such table. TableClosedError: the server stopped.
    """
    self._table_handle(table).table.reset()

  def server_info(self, timeout: Optional[float] = None) -> Dict[str, table_lib.TableInfo]:
    """TableInfo of every table of the server, waiting for the server to come up.

    Args:
      timeout: seconds to wait for the server; None or 0 waits forever.

    Raises:
      ValueError: negative timeout.
      DeadlineExceededError: no server answered in time.
    """
    if timeout is not None and (isinstance(timeout, bool) or not timeout >= 0):
      raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
    deadline = None if not timeout else time.monotonic() + timeout
    while True:
      try:
        seg = self._segment()
        break
      except errors.ServerUnavailableError as e:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
          raise errors.DeadlineExceededError(
              f"Deadline Exceeded: no server answered at {self._address!r} within "
              f"{timeout} s ({e})") from None
        time.sleep(_SERVER_POLL_S if deadline is None else min(_SERVER_POLL_S, deadline - now))
    return {name: self._table_handle(name).table.info for name in seg.table_names()}

  # ---- writers
  def trajectory_writer(self, num_keep_alive_refs: int, *,
                        validate_items: bool = True) -> trajectory_writer_lib.TrajectoryWriter:
    """A TrajectoryWriter inserting into this server's tables (SPEC §6).

    Args:
      num_keep_alive_refs: steps each column keeps referenceable (>= 1).
      validate_items: check items against their table's signature in create_item.

    Raises:
      ValueError: num_keep_alive_refs < 1.
      ServerUnavailableError: no server answers to the address.
    """
    return trajectory_writer_lib.TrajectoryWriter(self, num_keep_alive_refs,
                                                  validate_items=validate_items)

  def writer(self, max_sequence_length: int, delta_encoded: bool = False,
             chunk_length: Optional[int] = None, max_in_flight_items: Optional[int] = 25):
    """Legacy Writer whose items span the last N appended steps (SPEC §5).

    Args:
      max_sequence_length: most steps an item may span (>= 1).
      delta_encoded: ignored (accepted for compatibility).
      chunk_length: rows per chunk, 1..max_sequence_length (default min(10, that)).
      max_in_flight_items: items waiting for their rate limiter before create_item blocks
        (>= 1, None = 1,000,000).

    Raises:
      ValueError: an argument out of range.
    """
    from reverb_shm import writer as writer_lib  # pylint: disable=g-import-not-at-top
    return writer_lib.Writer(self, max_sequence_length, delta_encoded, chunk_length,
                             max_in_flight_items)

  def structured_writer(self, configs):
    """StructuredWriter creating items from declarative configs (SPEC §6b).

    Args:
      configs: non-empty sequence of configs from `structured_writer.create_config`.

    Raises:
      ValueError: no configs or an invalid one ("Invalid configuration at position i: ...").
    """
    from reverb_shm import structured_writer as sw  # pylint: disable=g-import-not-at-top
    return sw.StructuredWriter(self, configs)

  def checkpoint(self) -> str:
    """Not available yet.

    Raises:
      NotImplementedError: always, until checkpointing lands.
    """
    raise NotImplementedError("Client.checkpoint() is not implemented yet in reverb_shm: "
                              "checkpointing is tracked as a separate issue")


def checked_insert(client, data: Any, priorities: Dict[str, float]):
  """(table handles, float64 priorities, column arrays) of a valid Client.insert call.

  Shared with the bridge's RemoteClient.insert (issue 7b). Raises as Client.insert.
  """
  if not priorities:
    raise ValueError("priorities must not be empty: name at least one table to insert into")
  if not isinstance(priorities, dict):
    raise TypeError(f"priorities must be a dict table -> priority, got "
                    f"{type(priorities).__name__}")
  handles = [client._table_handle(name) for name in priorities]  # pylint: disable=protected-access
  prios = np.array([trajectory_writer_lib.check_priority(p, h.name, h.prioritized)
                    for h, p in zip(handles, priorities.values())], dtype=np.float64)
  leaves, _ = structure.flatten(data)
  if not leaves:
    raise ValueError("data must contain at least one value")
  arrays = []
  for i, leaf in enumerate(leaves):
    if leaf is None:
      raise ValueError(f"data leaf {i} is None; every field of an inserted step needs a value")
    arr = structure.to_array(leaf)
    trajectory_writer_lib.check_supported_dtype(arr.dtype, i)
    arrays.append(arr)
  columns = [(a.dtype, (1,) + a.shape) for a in arrays]
  for h in handles:
    trajectory_writer_lib.check_signature(h.name, h.flat_signature, columns,
                                          allow_unbatched=True)
  return handles, prios, arrays


def _key(key) -> np.uint64:
  """An item key as np.uint64; ValueError naming it if it is not an int in [0, 2**64)."""
  if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or not 0 <= key < 2**64:
    raise ValueError(f"item keys must be ints in [0, 2**64), got {key!r}")
  return np.uint64(key)


def to_samples(info: SampleInfo, data: list, emit_timesteps: bool, treedef):
  """One sampled item as Client.sample yields it (shared with the bridge's remote client).

  Raises:
    ValueError: emit_timesteps and the columns do not share one leading (time) length.
  """
  if not emit_timesteps:
    return ReplaySample(info, _unpack(treedef, data))
  lengths = {col.shape[0] if col.ndim else None for col in data}
  if len(lengths) != 1 or None in lengths:
    raise ValueError("Can't split non timestep trajectory into timesteps.")
  steps = lengths.pop()
  return [ReplaySample(info, _unpack(treedef, [col[t] for col in data])) for t in range(steps)]


def _unpack(treedef, columns: list):
  if treedef is None:
    return columns
  return structure.unflatten(treedef, columns)
