"""Client: Reverb's client API over a server's shared-memory segment.

A Client names a server by address ('localhost:PORT', 'HOST:PORT' of this host, or
'shm://NAME'). It attaches lazily on first use and again after a fork; it pickles as its
address, so it can be handed to spawned processes.
"""
import collections.abc
import operator
import os
import time
from itertools import repeat
from typing import Any, Dict, Generator, List, Optional, Sequence, Tuple, Union

import numpy as np

from reverb_shm import errors
from reverb_shm import table as table_lib
from reverb_shm import trajectory_writer as trajectory_writer_lib
from reverb_shm._internal import addresses, chunks, counters, hot_plans, shm, structure, timeouts
from reverb_shm._internal import columns as columns_lib
from reverb_shm._internal._lib import check, ffi, hot, lib
from reverb_shm._internal.keys import random_u64
from reverb_shm.replay_sample import ReplaySample, SampleInfo
from reverb_shm.selectors import PRIORITIZED
from reverb_shm.shared_table import SharedTable
from reverb_shm.writer import Writer

__all__ = ["Client", "Writer"]

# Polling interval while server_info waits for a server to appear.
_SERVER_POLL_S = 0.02
# Client.sample decodes up to this many items per batch (the first waits, the rest are taken
# only if the rate limiter allows them right away).
_SAMPLE_AHEAD = 256
_INF = float("inf")
_MAX_EXACT = 2**53   # ints a float64 priority holds exactly
_MAX_PLANS = 64      # step layouts remembered per table handle
_NO_PLAN = object()
_KEY_TYPES = frozenset([int, np.uint64])   # item keys mutate_priorities converts in one pass
_NO_KEYS = np.zeros(0, np.uint64)
_RANDOM_KEY_AND_EPISODE = lib.RS_ROWS_RANDOM_KEYS | lib.RS_ROWS_RANDOM_EPISODE


class _TableHandle:
  """What the client and its writers need of one table, cached per attached segment."""

  __slots__ = ("name", "index", "seg", "table", "signature", "flat_signature", "prioritized",
               "priority_bound", "insert_plans", "hot_plans")

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
    self.priority_bound = self.table.priority_bound   # above it: the exact sum-tree cap check
    self.insert_plans: dict = {}   # (dtype, shape) per step leaf -> ColumnWriter, or None: not fast
    self.hot_plans = hot_plans.PlanCache(batched=False, owner=self.table)   # C one-call plans

  def insert_plan(self, columns: tuple) -> Optional[chunks.ColumnWriter]:
    """The ColumnWriter of Client.insert's one-call path for steps of `columns` ((dtype, shape)
    per leaf), checked once against the table; None when such steps must take the general path
    (object or unsupported dtypes, a signature mismatch: it raises the error)."""
    plan = self.insert_plans.get(columns, _NO_PLAN)
    if plan is _NO_PLAN:
      try:
        for i, (dtype, _) in enumerate(columns):
          columns_lib.check_supported_dtype(dtype, i)
        columns_lib.check_signature(
            self.name, self.flat_signature, [(d, (1,) + shape) for d, shape in columns],
            allow_unbatched=True)
        plan = chunks.ColumnWriter(columns)
      except ValueError:   # (object dtypes too)
        plan = None
      if len(self.insert_plans) >= _MAX_PLANS:
        self.insert_plans.clear()
      self.insert_plans[columns] = plan
    return plan


class Client:
  """Client of a reverb_shm server on this host.

  Args:
    server_address: 'localhost:PORT' (or another name of this host), or 'shm://NAME'.

  Thread-safe: calls may come from several threads (each call is independent).
  """

  def __new__(cls, server_address=None, *args, **kwargs):
    # Dispatch: a remote bridge address gives a RemoteClient, several addresses a
    # ShardedClient (reverb_shm._internal.addresses describes the rules).
    if cls is Client and (isinstance(server_address, (list, tuple)) or (
        isinstance(server_address, str) and not server_address.startswith("shm://"))):
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
    self._seg: Optional[shm.Segment] = None
    self._seg_pid: Optional[int] = None
    self._handles: Dict[str, Any] = {}   # _TableHandle (a RemoteClient's: _RemoteHandle)
    # table name -> its handle's C plan of the last step layout inserted
    self._hot_plans: dict = {}
    self._column_writers: dict = {}   # (dtype, shape) per column -> chunks.ColumnWriter

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
    # A segment closed in this process (its Server stopped here), or whose server died, is
    # never used again: attaching anew finds a restarted server or raises DeadOwnerError.
    if (seg is None or self._seg_pid != os.getpid() or seg._closed  # pylint: disable=protected-access
        or seg.owner_dead):
      if seg is not None and seg.owner_dead and self._seg_pid == os.getpid():
        try:   # a server restarted at the address is used; else the dead one's error
          seg = shm.Segment.attach(shm.resolve_address(self._address))
        except (errors.ServerUnavailableError, errors.DeadOwnerError):
          raise seg.dead_owner_error() from None
      else:
        seg = shm.Segment.attach(shm.resolve_address(self._address))
      self._seg, self._seg_pid, self._handles, self._hot_plans = seg, os.getpid(), {}, {}
      seg.add_death_listener(self)
    return seg

  def _on_server_death(self) -> None:
    """The server died (called from the owner watcher's thread): drop the one-call insert
    plans, so that every later call takes a path that checks the segment and raises."""
    self._hot_plans.clear()

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
  def insert(self, data: Any, priorities: Dict[str, float],
             timeout_ms: Optional[float] = None) -> None:
    """Inserts `data` as one single-step item into each table of `priorities`.

    The data is written to shared memory once and referenced by every table's item; each
    column is stored with a leading time dim of 1 (np.ones([3, 3]) samples as [1, 3, 3]).
    Blocks until every table's rate limiter admits its item.

    Args:
      data: nest of arrays / Python values (one step).
      priorities: table name -> priority (finite; >= 0 for Prioritized tables).
      timeout_ms: None (default, as Reverb) waits for the rate limiters forever; else the
        milliseconds all tables together may wait (0: do not wait) (reverb_shm extension).

    Raises:
      DeadlineExceededError: a rate limiter did not admit the item in time; the items of the
        tables named before it in `priorities` stay inserted.
      ValueError: empty `priorities`, empty data, None leaves, unsupported dtypes, bad
        priorities, data not matching a table's signature, or an unknown table (an
        UnknownTableError naming the available tables). Nothing is inserted then.
      ResourceExhaustedError: the chunk arena is full.
      TableClosedError: the server stopped.
    """
    result = hot_plans.client_insert(self._hot_plans, data, priorities, timeout_ms)
    if result is True:   # the common case, done in one C call (reverb_shm/_internal/hot_plans.py)
      return
    if result is not None:   # the core call failed or waited past a slice: finish or raise
      # (the priority is used only to finish a one-table call that waited past a slice)
      hot_plans.finish(result, None, next(iter(priorities.values())), timeout_ms)
      return
    if self._insert_fast(data, priorities, timeout_ms) or self._insert_fast_multi(
        data, priorities, timeout_ms):
      return
    handles, prios, arrays = checked_insert(self, data, priorities)
    deadline = timeouts.deadline_from_ms(timeout_ms)
    seg = self._segment()
    episode_id = random_u64.one()
    if not any(a.dtype.kind == "O" for a in arrays):
      self._insert_numeric(seg, handles, prios, arrays, episode_id, deadline, timeout_ms)
      return
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
        key = np.array([random_u64.one()], np.uint64)
        h.table.insert_descriptors(key, prio[None], blob, offs, timeouts.remaining_ms(deadline))
    finally:
      for c in written:
        c.release()

  def _insert_fast(self, data, priorities, timeout_ms) -> bool:
    """Client.insert's Python hot path: one numeric step into one known table whose layout was
    checked before (_TableHandle.insert_plan), with one rs_insert_rows call; it also makes the C
    plan that inserts later steps of this layout (hot_plans). Returns False, having done
    nothing, for anything else; the general path then checks everything (and raises)."""
    found = one_step(self, data, priorities, self._segment, _TableHandle.insert_plan)
    if found is None:
      return False
    handle, prio, arrays, writer = found
    plan = handle.hot_plans.get(handle.table, data, tuple([(a.dtype, a.shape) for a in arrays]),
                                writer)
    if plan is not None:
      self._hot_plans[handle.name] = plan
    handle.table._insert_rows(  # pylint: disable=protected-access
        writer, 1, ffi.new("uint64_t *"), ffi.new("double *", prio),
        chunks.row_buffers(arrays), 0, _RANDOM_KEY_AND_EPISODE,
        timeouts.deadline_from_ms(timeout_ms), timeout_ms)
    return True

  def _insert_fast_multi(self, data, priorities, timeout_ms) -> bool:
    """Client.insert of one numeric step into several known tables: each table's layout check
    is its handle's cached plan (as _insert_fast's), the step is written once and each table
    gets one rs_insert_slices. Returns False, having done nothing, for anything else."""
    if type(priorities) is not dict or len(priorities) < 2:
      return False
    seg = self._segment()   # (drops stale handles first, as one_step's refresh)
    handles, prios = [], []
    for name, prio in priorities.items():
      handle = self._handles.get(name)
      if type(prio) is int and -_MAX_EXACT < prio < _MAX_EXACT:
        prio = float(prio)
      if (handle is None or type(prio) is not float or not -_INF < prio < _INF
          or (prio < 0 and handle.prioritized) or prio > handle.priority_bound):
        return False
      handles.append(handle)
      prios.append(prio)
    try:
      arrays = columns_lib.step_arrays(data)
    except ValueError:
      return False
    columns = tuple([(a.dtype, a.shape) for a in arrays])
    writers = [h.insert_plan(columns) for h in handles]
    if any(w is None for w in writers):
      return False
    self._insert_numeric(seg, handles, np.array(prios, np.float64), arrays, random_u64.one(),
                         timeouts.deadline_from_ms(timeout_ms), timeout_ms)
    for h, w in zip(handles, writers):   # C plans: later steps of this layout take one C call
      plan = h.hot_plans.get(h.table, data, columns, w)
      if plan is not None:
        self._hot_plans[h.name] = plan
    return True

  def _insert_numeric(self, seg, handles, prios, arrays, episode_id, deadline, timeout_ms) -> None:
    """Client.insert's hot path for numeric steps: one ColumnWriter call, one rs_insert per
    table."""
    columns = tuple((a.dtype, a.shape) for a in arrays)
    writer = self._column_writers.get(columns)
    if writer is None:
      writer = self._column_writers[columns] = chunks.ColumnWriter(columns)
    offs, pins = writer.write(seg, [np.ascontiguousarray(a) for a in arrays], 1, episode_id)
    try:
      slices = writer.slices
      for c, off in enumerate(offs):
        slices[c].chunk_off = off
      for h, prio in zip(handles, prios.tolist()):   # random keys drawn in C
        h.table._insert_slices_validated(1, ffi.NULL, ffi.new("double *", prio), writer, slices, 0,
                                         deadline, timeout_ms)
    finally:
      pins.release()

  # ---- sample
  def sample(self, table: str, num_samples: int = 1, *, emit_timesteps: bool = True,
             unpack_as_table_signature: bool = False,
             rate_limiter_timeout_ms: Optional[float] = None
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
      list[ReplaySample] (emit_timesteps) or ReplaySample. Items are sampled ahead in batches
      (see _SAMPLE_AHEAD); once the table's column layout is known, a batch is copied into
      private arrays by one C call and each item's columns are views of them (Reverb returns
      copies too); otherwise numeric columns are read-only zero-copy views of shared memory
      that stay valid while any of them lives.

    Raises:
      UnknownTableError (a RuntimeError and ValueError): no such table, raised at the call.
      ValueError: num_samples < 1 (not an int: ArgumentTypeError, a TypeError too), negative
        timeout; an item that cannot be split into steps.
      DeadlineExceededError: the limiter did not allow a sample in time (the message names the
        table and its counters).
      TableClosedError: the server stopped.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or (
        num_samples < 1):
      error = ValueError if isinstance(num_samples, (int, np.integer)) else \
          errors.ArgumentTypeError
      raise error(f"num_samples must be an int >= 1, got {num_samples!r}")
    timeouts.deadline_from_ms(rate_limiter_timeout_ms, "rate_limiter_timeout_ms")
    handle = self._table_handle(table)
    treedef = None
    if unpack_as_table_signature and handle.signature is not None:
      treedef = structure.flatten(handle.signature)[1]
    return self._sample_gen(handle, int(num_samples), emit_timesteps, treedef,
                            rate_limiter_timeout_ms)

  @staticmethod
  def _sample_gen(handle, num_samples, emit_timesteps, treedef, timeout_ms):
    """Yields num_samples items: each batch starts with one item sampled as Reverb does
    (waiting up to timeout_ms for the rate limiter), then takes up to _SAMPLE_AHEAD - 1 more
    that the limiter allows right away (never more than remain), decoded together."""
    seg, st = handle.seg, handle.table
    remaining = num_samples
    deadline = None
    while remaining:
      if st._gather_layout is not None:   # one C call gathers the batch into private arrays
        if deadline is None or timeout_ms is not None:
          deadline = timeouts.deadline_from_ms(timeout_ms)
        batch = st._gather_fresh(min(remaining, _SAMPLE_AHEAD), 1, deadline, timeout_ms)
        if batch is not None and len(batch[0].key):   # else: another layout came up
          infos, columns = batch
          remaining -= len(infos.key)
          # The samples built in one C call (None: the items have no shared time dim).
          samples = hot.split_batch(ReplaySample, SampleInfo, infos, columns, emit_timesteps,
                                    None if treedef is None else treedef.unflatten)
          if samples is not None:
            yield from samples
            continue
          infos = _new_tuples(SampleInfo, zip(*[field.tolist() for field in infos]))
          # Row views of the private batch arrays (iterating one; 0-d views for scalar columns).
          items = map(list, zip(*[c if c.ndim > 1 else _row_views(c) for c in columns]))
          yield from Client._emit(infos, items, emit_timesteps, treedef)
          continue
      recs, pins = st.sample_records(1, timeout_ms)
      items = [chunks.read_item(seg, int(recs["desc_off"][0]), pins)]
      more_pins = None
      if remaining > 1:
        more, more_pins = st._sample_now(min(remaining - 1, _SAMPLE_AHEAD - 1))
        if len(more):
          recs = np.concatenate([recs, more])
          items += chunks.read_items(seg, more["desc_off"], more_pins)
      del pins, more_pins   # the views keep their pins (and items) alive as long as they live
      remaining -= len(recs)
      st._learn_layout([(col.dtype, col.shape) for col in items[0]])
      infos = _new_tuples(SampleInfo, zip(recs["key"].tolist(), recs["probability"].tolist(),
                                          recs["table_size"].tolist(), recs["priority"].tolist(),
                                          recs["times_sampled"].tolist()))
      yield from Client._emit(infos, items, emit_timesteps, treedef)

  @staticmethod
  def _emit(infos, items, emit_timesteps, treedef):
    """Iterator of the ReplaySample (or, with emit_timesteps, lists of them) of each
    (info, columns)."""
    if not emit_timesteps:   # no Python frame per item
      return _new_tuples(ReplaySample, zip(
          infos, items if treedef is None else map(_unpack, repeat(treedef), items)))
    return map(to_samples, infos, items, repeat(True), repeat(treedef))

  # ---- mutation
  def mutate_priorities(self, table: str, updates: Optional[Dict[int, float]] = None,
                        deletes: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """Deletes `deletes`, then sets `updates` (as Reverb does); unknown keys ignored.

    Every key and priority is validated before anything changes.

    Returns:
      (number of priorities updated, number of items deleted).

    Args:
      table: table name.
      updates: dict item key -> new priority, or None.
      deletes: sequence (or other iterable) of item keys, or None.

    Raises:
      UnknownTableError: no such table.
      TypeError: `updates` is not a dict or `deletes` not an iterable of keys.
      ValueError: a key outside [0, 2**64); a NaN/infinite priority, or a negative one on a
        Prioritized table.
      TableClosedError: the server stopped.
    """
    if type(updates) is dict and deletes is None:   # the common call
      handle = self._table_handle(table)
      if type(handle.table) is SharedTable:
        done = hot.mutate_dict(handle.seg.address, handle.index, updates, handle.prioritized)
        if done is not None:   # plain keys and priorities: read and applied in one C call
          if done[0]:
            check(done[0], f"mutating table {errors.quoted_name(handle.name)}")
          return done[1], 0
    if updates is not None and not isinstance(updates, collections.abc.Mapping):
      raise TypeError(f"updates must be a dict item key -> priority, got "
                      f"{type(updates).__name__} {updates!r:.60}")
    if deletes is not None:
      if isinstance(deletes, (str, bytes)) or not isinstance(deletes, collections.abc.Iterable):
        raise TypeError(f"deletes must be a sequence of item keys, got "
                        f"{type(deletes).__name__} {deletes!r:.60}")
      deletes = list(deletes)
    st = self._table_handle(table).table
    if (type(updates) is dict and not deletes and type(st) is SharedTable
        and _KEY_TYPES.issuperset(map(type, updates))):
      try:   # the common case (keys of sampled items): one pass into arrays, one C call
        keys = np.fromiter(updates, np.uint64, len(updates))
      except OverflowError:   # a key outside [0, 2**64): the checks below name it
        keys = None
      if keys is not None:
        # pylint: disable=protected-access
        prios = st._priorities(list(updates.values()), len(keys), "updated priorities")
        return st._mutate(keys, prios, _NO_KEYS)
    # Python ints above 2**63 would make numpy guess float64: pass uint64 scalars instead.
    upd: Optional[dict] = {_key(k): v for k, v in updates.items()} if updates else updates
    dels: Optional[list] = (
        [_key(k) for k in deletes] if deletes is not None and len(deletes) else deletes)
    return st.mutate(upd, dels)

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
      AccessDeniedError: the server belongs to a user this process may not attach as (at once).
    """
    if timeout is not None and (isinstance(timeout, bool) or not timeout >= 0):
      raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
    deadline = None if not timeout else time.monotonic() + timeout
    while True:
      try:
        seg = self._segment()
        if seg.is_closed():      # stopped by another process: look for a new server
          self._seg = None
          raise errors.ServerUnavailableError(f"the server at {self._address!r} stopped")
        break
      except errors.ServerUnavailableError as e:
        if isinstance(e, errors.AccessDeniedError):
          raise                  # another user's server: waiting does not help
        now = time.monotonic()
        if deadline is not None and now >= deadline:
          raise errors.DeadlineExceededError(
              f"Deadline Exceeded: no server answered at {self._address!r} within "
              f"{timeout} s ({e})") from None
        time.sleep(_SERVER_POLL_S if deadline is None else min(_SERVER_POLL_S, deadline - now))
    return {name: self._table_handle(name).table.info for name in seg.table_names()}

  def stats(self) -> Dict[str, Any]:
    """Counters and state of the server and each of its tables, for logging (reverb_shm
    extension; TensorBoard, W&B and the like take the numbers as they are).

    Read without taking any lock, so calling it often never slows inserts or samples. Totals
    count since the server started. Returns a dict with name, owner_pid, arena_bytes,
    arena_used_bytes, arena_free_bytes, chunks, descriptors, max_procs, processes (pid, slot,
    pins, alive per attached process), closed, and tables: {table name: counters} where the
    counters are inserts, samples, updates, deletes, evictions, expirations, insert_bytes,
    items, max_size, full, blocked_inserters, blocked_samplers, can_insert, can_sample, diff,
    lock-hold and blocked times (see :func:`reverb_shm._internal.counters.read_table`).

    Raises:
      ServerUnavailableError: no server answers to the address.
    """
    return counters.read_server(self._segment())

  # ---- writers
  def trajectory_writer(self, num_keep_alive_refs: int, *,
                        get_signature_timeout_ms: Optional[int] = None,
                        validate_items: bool = True) -> trajectory_writer_lib.TrajectoryWriter:
    """A TrajectoryWriter inserting into this server's tables.

    Args:
      num_keep_alive_refs: steps each column keeps referenceable (>= 1).
      get_signature_timeout_ms: accepted for callers written for dm-reverb <= 0.7 (Acme 0.4
        passes it), where the writer fetched the tables' signatures over gRPC within this
        time; here they are read from the segment when needed, with no wait.
      validate_items: check items against their table's signature in create_item.

    Raises:
      ValueError: num_keep_alive_refs < 1.
      ServerUnavailableError: no server answers to the address.
    """
    del get_signature_timeout_ms
    return trajectory_writer_lib.TrajectoryWriter(self, num_keep_alive_refs,
                                                  validate_items=validate_items)

  def writer(self, max_sequence_length: int, delta_encoded: bool = False,
             chunk_length: Optional[int] = None, max_in_flight_items: Optional[int] = 25):
    """Legacy Writer whose items span the last N appended steps.

    Args:
      max_sequence_length: most steps an item may span (>= 1).
      delta_encoded: ignored (accepted for compatibility).
      chunk_length: rows per chunk, 1..max_sequence_length (default min(10, that)).
      max_in_flight_items: items waiting for their rate limiter before create_item blocks
        (>= 1, None = 1,000,000).

    Raises:
      ValueError: an argument out of range.
    """
    return Writer(self, max_sequence_length, delta_encoded, chunk_length,
                             max_in_flight_items)

  def structured_writer(self, configs):
    """StructuredWriter creating items from declarative configs.

    Args:
      configs: non-empty sequence of configs from `structured_writer.create_config`.

    Raises:
      ValueError: no configs or an invalid one ("Invalid configuration at position i: ...").
    """
    from reverb_shm import structured_writer as sw  # pylint: disable=g-import-not-at-top
    return sw.StructuredWriter(self, configs)

  def checkpoint(self) -> str:
    """Writes a checkpoint of every table with the server's checkpointer.

    The snapshot is taken in this process: every table lock is held only while items and
    counters are listed; chunk data is then streamed while inserts and samples continue.

    Returns:
      Absolute path of the new checkpoint directory.

    Raises:
      ValueError: the checkpointer has a non-empty group, or the server's checkpointer cannot
        be used from another process.
      ServerUnavailableError: no server answers to the address.
      ResourceExhaustedError: the arena cannot hold the snapshot's chunk holds.
      OSError: the checkpoint could not be written.
    """
    from reverb_shm import checkpointers  # pylint: disable=g-import-not-at-top
    seg = self._segment()
    return checkpointers.for_server(seg.name).save(seg)


def one_step(client, data: Any, priorities: Dict[str, float], refresh, plan):
  """(table handle, float priority, leaf arrays, plan) of a Client.insert call its one-call
  paths may take: one table whose handle `client` has cached, a finite priority (>= 0 on
  Prioritized tables), a step whose leaves are numeric numpy values or convert by
  structure.to_array, and `plan(handle, ((dtype, shape) per leaf))` not None (the handle's
  cached, checked plan for that layout). `refresh()` runs before the handle lookup (it drops
  stale handles, e.g. after a fork).

  Returns None, having done nothing else, for anything else: the general path (see
  checked_insert) then validates and raises. Shared with the bridge's RemoteClient.insert.
  """
  if type(priorities) is not dict or len(priorities) != 1:
    return None
  (name, prio), = priorities.items()
  if type(prio) is not float or not -_INF < prio < _INF:
    if type(prio) is not int or not -_MAX_EXACT < prio < _MAX_EXACT:
      return None
    prio = float(prio)
  refresh()
  handle = client._handles.get(name)  # pylint: disable=protected-access
  if handle is None or (prio < 0 and handle.prioritized):
    return None
  try:
    arrays = columns_lib.step_arrays(data)
  except ValueError:
    return None
  found = plan(handle, tuple([(a.dtype, a.shape) for a in arrays]))
  return None if found is None else (handle, prio, arrays, found)


def checked_insert(client, data: Any, priorities: Dict[str, float]):
  """(table handles, float64 priorities, column arrays) of a valid Client.insert call.

  Shared with the bridge's RemoteClient.insert. Raises as Client.insert.
  """
  if not priorities:
    raise ValueError("priorities must not be empty: name at least one table to insert into")
  if not isinstance(priorities, dict):
    raise TypeError(f"priorities must be a dict table -> priority, got "
                    f"{type(priorities).__name__}")
  handles = [client._table_handle(name) for name in priorities]  # pylint: disable=protected-access
  prios = np.array([columns_lib.check_priority(p, h.name, h.prioritized)
                    for h, p in zip(handles, priorities.values())], dtype=np.float64)
  for h, p in zip(handles, prios.tolist()):
    if p > getattr(h, "priority_bound", _INF):   # (a remote table's bridge checks)
      h.table.check_priority_cap(p)   # above the sum-tree cap: raises, nothing inserted
  leaves, _ = structure.flatten(data)
  if not leaves:
    raise ValueError("data must contain at least one value")
  arrays = []
  for i, leaf in enumerate(leaves):
    if leaf is None:
      raise ValueError(f"data leaf {i} is None; every field of an inserted step needs a value")
    try:
      arr = structure.to_array(leaf)
    except ValueError as e:
      raise ValueError(f"data leaf {i}: {e}") from None
    columns_lib.check_supported_dtype(arr.dtype, i)
    arrays.append(arr)
  columns = [(a.dtype, (1,) + a.shape) for a in arrays]
  for h in handles:
    columns_lib.check_signature(h.name, h.flat_signature, columns,
                                          allow_unbatched=True)
  return handles, prios, arrays


def _new_tuples(cls, values):
  """Iterator of cls(*v) for each tuple v of `values`, for a NamedTuple cls, without a Python
  call per item (what its __new__ would return)."""
  return map(tuple.__new__, repeat(cls), values)


_ROW_GETTERS: dict = {}   # n -> itemgetter of the 0-d row views of a 1-d column of n rows


def _row_views(column: np.ndarray) -> tuple:
  """The 0-d views column[i, ...] of each row i of a 1-d batch column, taken in one C call
  (an itemgetter of every row's index; a map of column.__getitem__ costs half as much again)."""
  n = len(column)
  getter = _ROW_GETTERS.get(n)
  if getter is None:
    if n < 2:   # (an itemgetter of one index returns the item, not a tuple)
      return tuple(column[i, ...] for i in range(n))
    if len(_ROW_GETTERS) >= _SAMPLE_AHEAD:
      _ROW_GETTERS.clear()
    getter = _ROW_GETTERS[n] = operator.itemgetter(*[(i, Ellipsis) for i in range(n)])
  return getter(column)


def _key(key) -> np.uint64:
  """An item key as np.uint64; ArgumentTypeError (a TypeError and ValueError) naming it if it is
  not an int in [0, 2**64)."""
  if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or not 0 <= key < 2**64:
    raise errors.ArgumentTypeError(f"item keys must be ints in [0, 2**64), got {key!r}")
  return np.uint64(key)


def to_samples(info: SampleInfo, data: list, emit_timesteps: bool, treedef):
  """One sampled item as Client.sample yields it (shared with the bridge's remote client).

  Raises:
    ValueError: emit_timesteps and the columns do not share one leading (time) length.
  """
  if not emit_timesteps:
    return ReplaySample(info, _unpack(treedef, data))
  lengths: set = {col.shape[0] if col.ndim else None for col in data}
  if len(lengths) != 1 or None in lengths:
    raise ValueError("Can't split non timestep trajectory into timesteps.")
  steps = lengths.pop()
  # (a numeric step is a 0-d array, as Reverb's; an object column's step is its object)
  objects = [col.dtype == object for col in data]
  return [ReplaySample(info, _unpack(treedef, [col[t] if obj else col[t, ...]
                                               for col, obj in zip(data, objects)]))
          for t in range(steps)]


def _unpack(treedef, columns: list):
  if treedef is None:
    return columns
  return structure.unflatten(treedef, columns)
