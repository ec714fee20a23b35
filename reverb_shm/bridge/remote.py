"""RemoteClient: the Client API over a gRPC bridge.

Writers are not re-implemented: a RemoteClient hands the ordinary Client.insert and
TrajectoryWriter a private *staging* segment in this process (unlinked at once, so nothing
outlives the process) and `_RemoteTable` handles whose `insert_descriptors` forward items over
a pipelined Write stream (writes.py): each TrajectoryWriter has a stream of its own, whose items
are confirmed asynchronously (flush / end_episode / close wait for them); Client.insert sends
everything of one call as one message (a "step" op for numeric data) and waits for its
confirmation. Without TLS, the bridge also serves its streams on a ZeroMQ port (zmq_client.py)
and Client.insert on a direct TCP port (direct_client.py): the client then uses the ZeroMQ
port for every stream and the direct port for Client.insert (one send and one receive in the
calling thread), else gRPC (Client.insert: a persistent Insert stream).

Sampling streams grant the bridge credits for `max_in_flight_samples` samples, refilled when
half of them were consumed; the bridge sends samples in batches and never samples further
ahead. A sampling stream that breaks is reopened with backoff for up to `reconnect_timeout_s`
(samples in flight are lost, as if never sampled), then ServerUnavailableError is raised.
"""
import contextlib
import math
import os
import queue
import secrets
import threading
import time
import weakref
from typing import Any, Dict, Optional

import grpc
import numpy as np

from reverb_shm import client as client_lib
from reverb_shm import errors, specs
from reverb_shm import table as table_lib
from reverb_shm._internal import chunks, shm, structure, timeouts
from reverb_shm._internal import columns as columns_lib
from reverb_shm._internal._lib import ffi
from reverb_shm._internal.keys import random_u64
from reverb_shm.bridge import security, watchdog, wire, writes, zmq_client
from reverb_shm.replay_sample import ReplaySample, SampleInfo
from reverb_shm.selectors import PRIORITIZED

__all__ = ["RemoteClient"]

DEFAULT_STAGING_BYTES = 128 << 20
DEFAULT_SENT_BYTES_BUDGET = 64 << 20
# A bridge that went away is tried again at least every second (grpc's default reconnect
# backoff grows to 120 s, so a client would see a restarted bridge only minutes later).
_CHANNEL_OPTIONS = (("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                    ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.max_pings_without_data", 0),
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1_000))
_MAX_STEP_LAYOUTS = 64   # step layouts cached per remote table handle
_SAMPLE_BATCH = 128     # samples per bridge reply at most (the bridge also caps its bytes)
_CODE_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: errors.UnknownTableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceededError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.TableClosedError,
    grpc.StatusCode.UNAVAILABLE: errors.ServerUnavailableError,
}

_staging_lock = threading.Lock()
_staging: Dict[tuple, shm.Segment] = {}   # (pid, arena bytes) -> staging segment


def _staging_segment(arena_bytes: int) -> shm.Segment:
  """This process's staging segment of that size (created on first use; its name is unlinked
  at once)."""
  pid = os.getpid()
  with _staging_lock:
    seg = _staging.get((pid, arena_bytes))
    if seg is None:
      name = f"stage.{pid}.{secrets.token_hex(4)}"
      seg = shm.Segment.create(name, [table_lib.Table.queue("staging", 1)],
                               arena_bytes=arena_bytes, max_procs=4)
      seg.unlink()
      seg.arena_hint = (f" (the staging arena of this process's remote client, {arena_bytes} "
                        "bytes: raise REVERB_SHM_STAGING_MB or RemoteClient(staging_bytes=...))")
      for key in [k for k in _staging if k[0] != pid]:
        del _staging[key]     # a fork child must not use its parent's
      _staging[(pid, arena_bytes)] = seg
    return seg


def rpc_error(e: grpc.RpcError, address: str) -> Exception:
  """The reverb_shm exception for a failed call."""
  code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
  details = (e.details() if hasattr(e, "details") else None) or str(e)
  name = None
  for key, value in (e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else ():
    if key == "rs-error":
      name = value
  if name in wire.ERROR_CLASSES:
    return wire.make_error(name, details)
  if code is grpc.StatusCode.UNIMPLEMENTED:
    return NotImplementedError(f"bridge {address}: {code.name}: {details}")
  if code is grpc.StatusCode.UNAUTHENTICATED:
    return PermissionError(f"bridge {address} refused the call: {details}")
  if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
    return errors.ServerUnavailableError(f"bridge {address} unavailable: {details}")
  return _CODE_ERRORS.get(code, errors.ReverbError)(f"bridge {address}: {code.name}: {details}")


class _Connection:
  """A channel to one bridge (unary calls retried while it is unreachable)."""

  def __init__(self, client: "RemoteClient"):
    self.client = client
    self.address = client.server_address
    self.creds = client._creds  # pylint: disable=protected-access
    self.channel = self.creds.channel(self.address, _CHANNEL_OPTIONS)
    self.metadata = self.creds.metadata()
    self.insert_streams: list = []   # idle persistent Insert streams (writes.InsertStream)
    self.batch_stream: Optional[_BatchStream] = None   # the SampleBatches stream, once opened
    # The bridge's ZeroMQ port (None: not offered, not known yet, or not to be used) and the
    # idle insert connections to it (zmq_client.InsertConnection).
    self.zmq_port: Optional[int] = None
    self.port_asked = False
    self.zmq_inserts: list = []
    self.zmq_max_bytes: Optional[int] = None   # the bridge's max_message_bytes
    # The bridge's direct port for Client.insert (None: not offered, not known yet, or not to
    # be used) and the idle connections to it (direct_client.InsertConnection).
    self.direct_port: Optional[int] = None
    self.direct_inserts: list = []
    self.zmq_calls: weakref.WeakSet = weakref.WeakSet()   # stream calls on the ZeroMQ port
    self.closed = False

  def method(self, name: str, kind: str = "unary_unary"):
    return getattr(self.channel, kind)(f"/{wire.SERVICE}/{name}")

  def stream(self, name: str, requests, direct: bool = False):
    """A stream call of the bridge's: on its ZeroMQ port when it offers one
    (zmq_client.StreamCall; with `direct`, the caller sends its requests with the call's send()
    instead of through `requests`), else on gRPC. A call whose port is unreachable fails with
    UNAVAILABLE, and the next call asks the bridge for its port again."""
    if not self.port_asked and not self.closed:
      try:
        self.learn_ports(self.unary("ServerInfo", {}))
      except (errors.ReverbError, PermissionError, ValueError):
        pass   # (the gRPC call reports the bridge's state)
    if self.zmq_port is not None and not self.closed:
      call = zmq_client.StreamCall(zmq_client.split_host(self.address), self.zmq_port,
                                   self.creds.token, name, None if direct else requests,
                                   on_unavailable=self._forget_port)
      self.zmq_calls.add(call)   # (cancelled by close(), as the channel's calls are)
      if self.closed:
        call.cancel()
      return call
    return self.method(name, "stream_stream")(requests, metadata=self.metadata)

  def _forget_port(self) -> None:
    self.port_asked = False

  def learn_ports(self, info: dict) -> None:
    """Records the ZeroMQ and direct ports (and their largest message) a ServerInfo reply
    offered (see zmq_client, direct_client); idle connections to ports that changed are
    closed."""
    limit = info.get("max_message_bytes")
    self.port_asked = True
    self.zmq_max_bytes = limit if type(limit) is int and limit > 0 else None
    zmq_port = self._usable(info.get("zmq_port"), writes.ZMQ_ENABLED)
    if zmq_port != self.zmq_port:
      _close_all(self.zmq_inserts)
      self.zmq_port = zmq_port
    direct = self._usable(info.get("direct_port"), writes.ZMQ_ENABLED and writes.DIRECT_ENABLED)
    if direct != self.direct_port:
      _close_all(self.direct_inserts)
      self.direct_port = direct

  def _usable(self, port: Any, enabled: bool) -> Optional[int]:
    """`port` if it is a port number to use (no TLS: side ports are plain), else None."""
    return port if (enabled and not self.creds.tls and type(port) is int
                    and 0 < port < 65536) else None

  def close(self) -> None:
    self.closed = True
    while self.insert_streams:
      self.insert_streams.pop().close()
    _close_all(self.zmq_inserts)
    _close_all(self.direct_inserts)
    for call in list(self.zmq_calls):
      call.cancel()
    if self.batch_stream is not None:
      self.batch_stream.close()
    self.channel.close()

  def batches(self) -> "_BatchStream":
    """The connection's SampleBatches stream (a new one if the last one ended)."""
    stream = self.batch_stream
    if stream is None or stream.error is not None:
      stream = self.batch_stream = _BatchStream(self)
    return stream

  # ---- unary calls (retried while the bridge is unreachable)
  def unary(self, name: str, msg: dict, timeout: Optional[float] = None,
            wait_for_ready: bool = False) -> dict:
    """One unary call, retried while the bridge is unreachable, for at most the client's
    reconnect_timeout_s (a call waiting for the channel to become ready, with no `timeout` of its
    own, waits that long too), then ServerUnavailableError."""
    reconnect_s = self.client.reconnect_timeout_s
    deadline = time.monotonic() + reconnect_s
    backoff = writes.BACKOFF_START_S
    while True:
      bounded = wait_for_ready and timeout is None
      attempt = max(0.001, deadline - time.monotonic()) if bounded else timeout
      try:
        reply = self.method(name)(wire.pack(msg), timeout=attempt, metadata=self.metadata,
                                  wait_for_ready=wait_for_ready)
        return wire.unpack(reply)
      except grpc.RpcError as e:
        if bounded and e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
          raise errors.ServerUnavailableError(
              f"bridge {self.address} unavailable: no answer to {name} within "
              f"reconnect_timeout_s={reconnect_s} s") from None
        if e.code() is not grpc.StatusCode.UNAVAILABLE or time.monotonic() >= deadline:
          raise rpc_error(e, self.address) from None
      time.sleep(backoff)
      backoff = min(2 * backoff, writes.BACKOFF_MAX_S)


def _close_all(connections: list) -> None:
  """Closes and forgets idle insert connections."""
  while connections:
    connections.pop().close()


class _RemoteTable:
  """The part of SharedTable that Client and TrajectoryWriter use, over the bridge."""

  def __init__(self, client: "RemoteClient", name: str, signature,
               session: Optional[writes.WriteSession]):
    self._client = client
    self._session = session
    self.name = name
    self.signature = signature

  def insert_descriptors(self, keys, priorities, blob: bytes, offs, timeout_ms=None, *,
                         deadline_ns: Optional[int] = None) -> int:
    """As SharedTable.insert_descriptors, with the descriptors' chunks in the staging segment."""
    keys = np.ascontiguousarray(keys, np.uint64)
    prios = np.ascontiguousarray(priorities, np.float64)
    if prios.shape != keys.shape:
      raise ValueError(f"{len(keys)} keys but {prios.size} priorities")
    if deadline_ns is None:
      deadline_ns = timeouts.deadline_from_ms(timeout_ms)
    if not len(keys):
      return 0
    if self._session is None:
      raise NotImplementedError("a RemoteClient inserts through insert() and its writers")
    return self._session.insert(self.name, keys, prios, bytes(blob),
                                np.asarray(offs, np.uint64), deadline_ns, timeout_ms)

  def _insert_validated(self, n, keys_c, prios_c, blob_c, offs_c, deadline_ns, timeout_ms) -> int:
    """SharedTable's immediate-insert fast path (the TrajectoryWriter's create_item): the items
    (C buffers of n keys / priorities, the descriptor blob and n+1 offsets) join the writer's
    stream at once when its in-flight bound allows, as insert_descriptors would; returns n.

    Returns 0 (the writer then queues the items and its queue path reports the problem) while
    the stream holds an error to report, or when the in-flight bound is reached.
    """
    session = self._session
    if session is None or session.has_error():
      return 0
    offs = ffi.unpack(offs_c, n + 1)   # ints
    try:
      return session.insert(self.name, ffi.buffer(keys_c, 8 * n)[:],
                            ffi.buffer(prios_c, 8 * n)[:], ffi.buffer(blob_c, offs[-1])[:], offs,
                            deadline_ns, timeout_ms)
    except errors.DeadlineExceededError:
      return 0

  def mutate(self, updates=None, deletes=None):
    updates = updates or {}
    if not isinstance(updates, dict):
      raise TypeError(f"updates must be a dict key -> priority, got {type(updates).__name__}")
    upd_keys = np.array([int(k) for k in updates], np.uint64)
    upd_prios = np.array(list(updates.values()), np.float64)
    del_keys = np.array([int(k) for k in (deletes or [])], np.uint64)
    reply = self._client._connection().unary("Mutate", {  # pylint: disable=protected-access
        "table": self.name, "upd_keys": upd_keys.tobytes(), "upd_prios": upd_prios.tobytes(),
        "del_keys": del_keys.tobytes()})
    return int(reply["updated"]), int(reply["deleted"])

  def reset(self) -> None:
    self._client._connection().unary("Reset", {"table": self.name})  # pylint: disable=protected-access

  @property
  def info(self) -> table_lib.TableInfo:
    return self._client.server_info()[self.name]


class _RemoteHandle:
  """What Client and TrajectoryWriter need of one remote table (cf. client._TableHandle)."""

  __slots__ = ("name", "index", "seg", "table", "signature", "flat_signature", "prioritized",
               "_step_columns")

  def __init__(self, client: "RemoteClient", index: int, entry: dict,
               session: Optional[writes.WriteSession]):
    self.name = entry["name"]
    self.index = index
    self.seg = None
    self.signature = specs.decode_signature(entry["signature"])
    self.table = _RemoteTable(client, self.name, self.signature, session)
    self.flat_signature = (None if self.signature is None
                           else structure.flatten(self.signature)[0])
    stats = entry["stats"]
    self.prioritized = PRIORITIZED in (stats["sampler_kind"], stats["remover_kind"])
    self._step_columns: dict = {}

  def step_columns(self, columns: tuple) -> Optional[list]:
    """The "cols" of RemoteClient.insert's step op for steps of `columns` ((dtype, shape) per
    leaf), checked once against the table's signature; None when such steps take the general
    path (object or unsupported dtypes, a mismatch: it raises the error)."""
    cols = self._step_columns.get(columns, False)
    if cols is False:
      try:
        for i, (dtype, _) in enumerate(columns):
          columns_lib.check_supported_dtype(dtype, i)
          if dtype.kind == "O":
            raise ValueError("object column")
        columns_lib.check_signature(self.name, self.flat_signature,
                           [(d, (1,) + shape) for d, shape in columns], allow_unbatched=True)
        cols = [[d.str, list(shape)] for d, shape in columns]
      except ValueError:
        cols = None
      if len(self._step_columns) >= _MAX_STEP_LAYOUTS:
        self._step_columns.clear()
      self._step_columns[columns] = cols
    return cols


class _WriterClient:
  """What a TrajectoryWriter needs of a RemoteClient, with a Write stream of its own.

  TrajectoryWriter takes it from `RemoteClient.writer_session()` and calls `await_inserts` /
  `close_inserts` in flush, end_episode and close (the writers' hooks for asynchronous clients).
  """

  def __init__(self, client: "RemoteClient"):
    self._client = client
    self._session = client._new_session()  # pylint: disable=protected-access
    self._session.open()
    self._handles: dict = {}

  def _segment(self) -> shm.Segment:
    return self._client._segment()  # pylint: disable=protected-access

  def _table_handle(self, table: str) -> _RemoteHandle:
    handle = self._handles.get(table)
    if handle is None:
      index, entry = self._client._table_entry(table)  # pylint: disable=protected-access
      handle = self._handles[table] = _RemoteHandle(self._client, index, entry, self._session)
    return handle

  def in_flight(self) -> int:
    return self._session.in_flight

  def await_inserts(self, until: int, deadline_ns: int, timeout_ms,
                    what: str) -> Optional[errors.DeadlineExceededError]:
    try:
      self._session.await_inserts(until, deadline_ns, timeout_ms, what)
    except errors.DeadlineExceededError as e:
      return e
    return None

  def close_inserts(self) -> None:
    self._session.close()

  def finalising(self) -> None:
    self._session.finalising()

  def __getattr__(self, name):   # the rest of the Client API (server_info, ...)
    return getattr(self._client, name)


class RemoteClient(client_lib.Client):
  """Client of a reverb_shm server reached through its gRPC bridge (same API as Client).

  `Client('HOST:PORT')` returns one when HOST:PORT is not a local server.

  Args:
    server_address: 'HOST:PORT' of the bridge.
    credentials: token / TLS material; default from the REVERB_SHM_BRIDGE_* environment.
    staging_bytes: size of this process's staging arena, which bounds the data a writer keeps
      alive plus one item being inserted (default 128 MiB; REVERB_SHM_STAGING_MB overrides).
    sent_bytes_budget: bytes of sent chunks the bridge keeps pinned for this client before
      the least recently used are dropped.
    reconnect_timeout_s: how long a call retries an unreachable bridge before raising
      ServerUnavailableError.
    max_in_flight_samples: samples a sampling stream may prefetch (default 256; credits are
      refilled when half of them were consumed). The bridge sends them in replies of up to
      128 samples and about 4 MiB; lower this for large items to bound the memory held.
  """

  def __init__(self, server_address: str,
               credentials: Optional[security.ClientCredentials] = None, *,
               staging_bytes: Optional[int] = None,
               sent_bytes_budget: int = DEFAULT_SENT_BYTES_BUDGET,
               reconnect_timeout_s: float = 10.0, max_in_flight_samples: int = 256):
    super().__init__(server_address)
    self._explicit_creds = credentials
    self._creds = credentials or security.ClientCredentials.from_env()
    env_mb = os.environ.get("REVERB_SHM_STAGING_MB")
    self.staging_bytes = staging_bytes or (int(env_mb) << 20 if env_mb else
                                           DEFAULT_STAGING_BYTES)
    self.sent_bytes_budget = sent_bytes_budget
    self.reconnect_timeout_s = reconnect_timeout_s
    if isinstance(max_in_flight_samples, bool) or not 1 <= max_in_flight_samples <= 1024:
      raise ValueError(f"max_in_flight_samples must be in [1, 1024], got "
                       f"{max_in_flight_samples!r}")
    self.max_in_flight_samples = int(max_in_flight_samples)
    self._conn: Optional[_Connection] = None
    self._conn_pid: Optional[int] = None
    self._conn_lock = threading.Lock()
    self._inserter = writes.OneMessageInserter(server_address, self._connection,
                                               reconnect_timeout_s, rpc_error)
    self._entries: dict = {}
    self._layouts: dict = {}   # (dtype, shape) per column -> the "cols" of Client.insert's step op

  def __reduce__(self):
    return _rebuild, (self.server_address, self._explicit_creds, self.staging_bytes,
                      self.sent_bytes_budget, self.reconnect_timeout_s,
                      self.max_in_flight_samples)

  def __repr__(self):
    return f"RemoteClient(server_address={self.server_address!r})"

  def close(self) -> None:
    """Closes the channel (open writers' next calls reconnect)."""
    with self._conn_lock:
      conn, self._conn = self._conn, None
    if conn is not None and self._conn_pid == os.getpid():
      conn.close()

  def insert(self, data, priorities: Dict[str, float], timeout_ms=None) -> None:
    """As Client.insert: returns when the bridge confirmed the items.

    Everything of one call (every table's item and the chunks they share) travels to the
    bridge as one message: one round trip. The data is validated as Client.insert does and
    encoded straight from the arrays (no staging copy).

    Raises:
      ServerUnavailableError: the bridge stays unreachable for reconnect_timeout_s.
      ValueError: as Client.insert (and the other errors Client.insert raises).
    """
    if self._insert_fast(data, priorities, timeout_ms):
      return
    handles, prios, arrays = client_lib.checked_insert(self, data, priorities)
    # Validated here; the bridge applies it (whole milliseconds, None = forever) per table.
    wire_timeout = (None if timeouts.deadline_from_ms(timeout_ms) < 0
                    else int(math.ceil(timeout_ms)))
    episode_id = random_u64.one()
    if not any(a.dtype.kind == "O" for a in arrays):
      # One "step" op: the bridge writes every column with one C call (see service._step).
      layout = tuple((a.dtype.str, a.shape) for a in arrays)
      cols = self._layouts.get(layout)
      if cols is None:
        cols = self._layouts[layout] = [[d, list(s)] for d, s in layout]
      items = [[seq, h.name, random_u64.one(), prio]
               for seq, (h, prio) in enumerate(zip(handles, prios.tolist()), 1)]
      self._inserter.send([{"op": "step", "cols": cols, "ep": episode_id, "items": items,
                            "timeout_ms": wire_timeout,
                            "b": b"".join([np.ascontiguousarray(a) for a in arrays])}],  # type: ignore[misc]
                          wire_timeout)
      return
    ops = []
    for cid, a in enumerate(arrays, 1):
      if a.dtype.kind == "O":
        chunks.pack_object_rows([a])   # (the local client's error, before anything is sent)
        ops.append({"op": "obj", "id": cid, "s": list(a.shape), "ep": episode_id, "step": 0,
                    "rows": [[x.item() if isinstance(x, np.generic) else x
                              for x in a.reshape(-1)]]})
      else:
        ops.append({"op": "chunk", "id": cid, "d": a.dtype.str, "s": list(a.shape), "cap": 1,
                    "ep": episode_id, "step": 0, "b": np.ascontiguousarray(a).tobytes()})
    desc = [[[[cid, 0, 1]], False] for cid in range(1, len(arrays) + 1)]
    for seq, (h, prio) in enumerate(zip(handles, prios), 1):
      ops.append({"op": "items", "seq": seq, "table": h.name,
                  "keys": np.array([random_u64.one()], "<u8").tobytes(),
                  "prios": np.array([prio], "<f8").tobytes(), "descs": [desc],
                  "timeout_ms": wire_timeout})
    self._inserter.send(ops, wire_timeout)

  def _insert_fast(self, data, priorities, timeout_ms) -> bool:
    """insert's common case: one numeric step into one table whose handle is cached and whose
    layout was checked before (_RemoteHandle.step_columns), without a timeout or with whole
    milliseconds; sends the same "step" op as the general path. Returns False, having done
    nothing, for anything else: the general path then checks everything (and raises)."""
    if not (timeout_ms is None or type(timeout_ms) is int and timeout_ms >= 0):
      return False
    # (_connection: a fork child drops the cached handles)
    found = client_lib.one_step(self, data, priorities, self._connection,
                                _RemoteHandle.step_columns)
    if found is None:
      return False
    handle, prio, arrays, cols = found
    try:
      payload = b"".join(arrays)
    except (BufferError, TypeError, ValueError):   # not C-contiguous
      payload = b"".join([np.ascontiguousarray(a) for a in arrays])  # type: ignore[misc]
    self._inserter.send([{"op": "step", "cols": cols, "ep": random_u64.one(),
                          "items": [[1, handle.name, random_u64.one(), prio]],
                          "timeout_ms": timeout_ms, "b": payload}], timeout_ms)
    return True

  def writer_session(self) -> _WriterClient:
    """The client a new TrajectoryWriter uses: its own pipelined Write stream."""
    return _WriterClient(self)

  # ---- plumbing used by Client's methods and TrajectoryWriter
  def _connection(self) -> _Connection:
    with self._conn_lock:
      conn = self._conn
      if conn is None or self._conn_pid != os.getpid():
        conn = _Connection(self)
        self._conn, self._conn_pid, self._handles, self._entries = conn, os.getpid(), {}, {}
      return conn

  def _new_session(self) -> writes.WriteSession:
    return writes.WriteSession(self.server_address, self._connection, self._segment,
                               self.sent_bytes_budget, self.reconnect_timeout_s, rpc_error,
                               self._limiter_state)

  def _limiter_state(self, table: str) -> str:
    """The limiter counters of `table`, for timeout messages ('' if the bridge is down)."""
    try:
      info = self.server_info(timeout=1)[table]
    except errors.ReverbError:
      return ""
    rl = info.rate_limiter_info
    return (f"table {errors.quoted_name(table)}: size={info.current_size}, inserts="
            f"{rl.insert_stats.completed}, samples={rl.sample_stats.completed}")

  def _segment(self) -> shm.Segment:
    return _staging_segment(self.staging_bytes)

  def _table_entry(self, table: str):
    """(index, ServerInfo entry) of `table`, cached; UnknownTableError if the bridge lacks it."""
    self._connection()
    found = self._entries.get(table)
    if found is None:
      if not isinstance(table, str):
        raise TypeError(f"table name must be a str, got {type(table).__name__}")
      entries = self._fetch_tables()
      for index, entry in enumerate(entries):
        if entry["name"] == table:
          found = self._entries[table] = (index, entry)
          break
      else:
        raise errors.UnknownTableError(
            f"Could not find table {errors.quoted_name(table, plain=True)} at bridge "
            f"{self.server_address}. Available "
            f"tables: {sorted(e['name'] for e in entries)}")
    return found

  def _table_handle(self, table: str) -> Any:   # a _RemoteHandle (Client's is a _TableHandle)
    self._connection()
    handle = self._handles.get(table)
    if handle is None:
      index, entry = self._table_entry(table)
      handle = self._handles[table] = _RemoteHandle(self, index, entry, None)
    return handle

  def _fetch_tables(self, timeout: Optional[float] = None, wait: bool = False) -> list:
    conn = self._connection()
    reply = conn.unary("ServerInfo", {}, timeout=timeout, wait_for_ready=wait)
    conn.learn_ports(reply)
    tables = reply.get("tables")
    if not isinstance(tables, list):
      raise errors.ReverbError(f"bridge {self.server_address} sent a malformed ServerInfo")
    return tables

  def shared_table(self, table: str):
    raise ValueError(f"shared_table() needs a server on this host; {self.server_address} is a "
                     "remote bridge")

  # ---- Client API that differs from the local one
  def server_info(self, timeout: Optional[float] = None) -> Dict[str, table_lib.TableInfo]:
    """TableInfo of every table, waiting up to `timeout` s for the bridge (None/0: up to the
    client's reconnect_timeout_s).

    Raises:
      ValueError: negative timeout.
      DeadlineExceededError: the bridge did not answer within `timeout`.
      ServerUnavailableError: no `timeout` and the bridge did not answer within
        reconnect_timeout_s.
    """
    if timeout is not None and (isinstance(timeout, bool) or not timeout >= 0):
      raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
    try:
      entries = self._fetch_tables(timeout=timeout or None, wait=True)
    except errors.DeadlineExceededError as e:
      raise errors.DeadlineExceededError(
          f"Deadline Exceeded: no bridge answered at {self.server_address!r} within {timeout} s "
          f"({e})") from None
    return {e["name"]: table_lib.table_info(e["name"], e["stats"],
                                            specs.decode_signature(e["signature"]))
            for e in entries}

  def checkpoint(self) -> str:
    """Checkpoints the remote server; returns the path on the server's host."""
    return str(self._connection().unary("Checkpoint", {})["path"])

  def sample_batch_with_stats(self, table: str, n: int, timeout_ms: Optional[int] = None,
                              rpc_timeout: Optional[float] = None):
    """Up to n items sampled in one round trip (the bridge's SampleBatch), and the table's
    counters after the draw (reverb_shm extension, for samplers spanning several servers).

    Args:
      table: table name.
      n: items to sample, 0 .. 65536 (0: only the counters).
      timeout_ms: rate limiter wait (None: forever); fewer than n items come back only when
        the limiter admitted fewer by then (at least one, else DeadlineExceededError).
      rpc_timeout: seconds the whole call may take (None: no limit).

    Returns:
      (batch, stats): batch is None for n == 0, else a ReplaySample whose info fields are arrays
      of length B and whose data is the flat list of (B, ...) columns; stats is the table's
      rs_table_stats dict (size, sampler_kind, sampler_total_weight, ...).

    Raises:
      ValueError: items of different column layouts in one batch; bad n.
      DeadlineExceededError, UnknownTableError, ServerUnavailableError: as sample().
    """
    return self.sample_batch_async(table, n, timeout_ms, rpc_timeout)()

  def sample_batch_async(self, table: str, n: int, timeout_ms: Optional[int] = None,
                         rpc_timeout: Optional[float] = None):
    """Sends sample_batch_with_stats's request without waiting for the answer; returns a
    callable that waits for it and returns (batch, stats) or raises as
    sample_batch_with_stats does (its cancel() cancels the call). Unlike other unary calls, an
    unreachable bridge is not retried: the error is raised at once (the caller decides).

    Raises (at once):
      ValueError: bad n.
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 1 << 16:
      raise ValueError(f"n must be an int in [0, 65536], got {n!r}")
    msg = {"table": table, "n": n}
    if timeout_ms is not None:
      msg["timeout_ms"] = int(timeout_ms)
    stream = self._connection().batches()
    return _BatchCall(stream, stream.send(msg), n, rpc_timeout)

  def _sample_gen(self, handle, n, emit_timesteps, treedef, timeout_ms):
    """Client.sample's generator over a Sample stream (Client.sample validated the arguments).

    The bridge samples at most `max_in_flight_samples` items ahead of the consumer; closing
    the generator cancels the stream (and any sample the bridge is waiting for). Numeric
    columns are read-only arrays received from the bridge.
    """
    timeout = None if timeout_ms is None else int(timeout_ms)
    return self._remote_samples(handle.name, n, emit_timesteps, treedef, timeout)

  def _remote_samples(self, table, n, emit_timesteps, treedef, timeout_ms):
    conn = self._connection()
    got = 0
    give_up = None
    backoff = writes.BACKOFF_START_S
    while True:
      try:
        with contextlib.closing(self._sample_stream(conn, table, n - got, timeout_ms)) as stream:
          for info, columns in stream:
            got += 1
            give_up = None
            yield client_lib.to_samples(info, columns, emit_timesteps, treedef)
        return
      except grpc.RpcError as e:
        now = time.monotonic()
        if give_up is None:
          give_up, backoff = now + self.reconnect_timeout_s, writes.BACKOFF_START_S
        if e.code() not in writes.RETRYABLE or conn is not self._conn:   # or close() was called
          raise rpc_error(e, self.server_address) from None
        if now >= give_up:
          raise errors.ServerUnavailableError(
              f"lost the Sample stream to bridge {self.server_address} after {got} of {n} "
              f"samples and could not reopen it within reconnect_timeout_s="
              f"{self.reconnect_timeout_s}: {rpc_error(e, self.server_address)}") from None
        time.sleep(min(backoff, give_up - now))
        backoff = min(2 * backoff, writes.BACKOFF_MAX_S)

  def _sample_stream(self, conn: _Connection, table, n, timeout_ms):
    """(SampleInfo, columns) of up to n samples over one Sample stream (raises RpcError)."""
    window = self.max_in_flight_samples
    granted = min(n, window)
    requests: queue.SimpleQueue = queue.SimpleQueue()
    requests.put({"table": table, "n": n, "timeout_ms": timeout_ms, "credit": granted,
                  "batch": min(max(1, window // 2), _SAMPLE_BATCH)})

    def frames():
      while True:
        item = requests.get()
        if item is None:
          return
        yield from wire.frames(wire.pack(item))
    call = conn.stream("Sample", frames())
    asm = wire.Reassembler()
    got = 0
    try:
      for frame in _frames_in_time(call, timeout_ms, self.server_address):
        msg = asm.feed(frame)
        if msg is None:
          continue
        for sample in _decode_samples(msg):
          got += 1
          # Refill the bridge's credit once half of the window was consumed.
          if granted < n and granted - got <= window // 2:
            more = min(n - granted, window - (granted - got))
            requests.put({"credit": more})
            granted += more
          yield sample
        if got >= n:
          return
    finally:
      requests.put(None)
      call.cancel()


class _BatchStream:
  """A connection's persistent SampleBatches stream: requests go out as they are made (several
  may be in flight), replies come back in request order. Thread-safe.

  A reply not read within its caller's timeout cancels the stream (the watchdog): that read
  and every later one raise, and the connection opens a new stream for the next request.
  """

  def __init__(self, conn: _Connection):
    self._address = conn.address
    self._out: queue.SimpleQueue = queue.SimpleQueue()
    self._asm = wire.Reassembler()
    self._lock = threading.Lock()        # requests' numbering
    self._read_lock = threading.Lock()   # one reader of the replies at a time
    self._sent = 0
    self._read = 0                       # replies read
    self._replies: Dict[int, dict] = {}  # replies read ahead of their caller
    self._abandoned: set = set()
    self.error: Optional[Exception] = None   # set once the call ended
    self._call = conn.stream("SampleBatches", writes.queued(self._out), direct=True)
    # On the ZeroMQ port, requests go out from the caller's thread: no thread to wake (and to
    # take the GIL from a local draw) per request.
    self._direct = isinstance(self._call, zmq_client.StreamCall)

  def send(self, msg: dict) -> int:
    """Sends one request; returns its number (for reply())."""
    with self._lock:
      if self.error is not None:
        raise self.error
      index, self._sent = self._sent, self._sent + 1
      for frame in wire.frames(wire.pack(msg)):
        if self._direct:
          self._call.send(frame)
        else:
          self._out.put(frame)
    return index

  def abandon(self, index: int) -> None:
    """Request `index`'s reply is not wanted: it is dropped when read."""
    with self._read_lock:
      if self._replies.pop(index, None) is None and index >= self._read:
        self._abandoned.add(index)

  def reply(self, index: int, timeout: Optional[float]) -> dict:
    """Request `index`'s reply, waiting at most `timeout` seconds (None: forever).

    Raises:
      ServerUnavailableError: the stream ended (the bridge went away, or a timeout ended it).
      DeadlineExceededError: no reply within `timeout` (the stream is cancelled).
    """
    with self._read_lock:
      while index not in self._replies:
        if self.error is not None:
          raise self.error
        token = None if timeout is None else watchdog.WATCHDOG.watch(
            time.monotonic() + timeout, self._call.cancel)
        try:
          frame = next(self._call)
        except grpc.RpcError as e:
          timed_out = token is not None and not watchdog.WATCHDOG.unwatch(token)
          token = None
          self.error = (errors.DeadlineExceededError(
              f"bridge {self._address} did not answer a SampleBatch within {timeout} s")
              if timed_out else rpc_error(e, self._address))
          continue
        except StopIteration:
          self.error = errors.ServerUnavailableError(
              f"bridge {self._address} ended the SampleBatches stream")
          continue
        finally:
          if token is not None:
            watchdog.WATCHDOG.unwatch(token)
        msg = self._asm.feed(frame)
        if msg is None:
          continue
        if self._read in self._abandoned:
          self._abandoned.discard(self._read)
        else:
          self._replies[self._read] = msg
        self._read += 1
      return self._replies.pop(index)

  def close(self) -> None:
    self._out.put(None)
    self._call.cancel()
    if self.error is None:
      self.error = errors.ServerUnavailableError(f"bridge {self._address}: stream closed")


class _BatchCall:
  """A SampleBatch request in flight: calling it waits for (batch, stats); cancel() drops it."""

  def __init__(self, stream: _BatchStream, index: int, n: int, timeout: Optional[float]):
    self._stream, self._index, self._n, self._timeout = stream, index, n, timeout

  def cancel(self) -> None:
    self._stream.abandon(self._index)

  def __call__(self):
    reply = self._stream.reply(self._index, self._timeout)
    err = reply.get("err")
    if err is not None:
      raise wire.make_error(*err) if isinstance(err, list) and len(err) == 2 else \
          errors.ReverbError(f"bridge {self._stream._address} sent a malformed error")  # pylint: disable=protected-access
    stats = reply.get("stats")
    if not isinstance(stats, dict):
      raise errors.ReverbError(f"bridge {self._stream._address} sent a malformed SampleBatch")  # pylint: disable=protected-access
    return (None if not self._n else _decode_batch(reply["sample"])), stats


def _frames_in_time(call, timeout_ms, address: str):
  """The reply frames of a Sample call. With timeout_ms (each reply of the bridge is due
  within it: it waits that long for one sample), a bridge that does not answer within
  timeout_ms + writes.ANSWER_GRACE_S (stopped, or cut off without its connection closing) ends
  the call with DeadlineExceededError instead of a wait until gRPC keepalive gives up."""
  if timeout_ms is None:
    yield from call
    return
  frames = iter(call)
  while True:
    token = watchdog.WATCHDOG.watch(
        time.monotonic() + timeout_ms / 1000 + writes.ANSWER_GRACE_S, call.cancel)
    try:
      frame = next(frames, None)
    except grpc.RpcError:
      if not watchdog.WATCHDOG.unwatch(token):   # the watchdog cancelled the call
        raise errors.DeadlineExceededError(
            f"bridge {address} sent no sample within rate_limiter_timeout_ms={timeout_ms} + "
            f"{writes.ANSWER_GRACE_S:g} s (stopped or unreachable without closing its "
            f"connection?)") from None
      raise
    watchdog.WATCHDOG.unwatch(token)
    if frame is None:
      return
    yield frame


def _rebuild(address, creds, staging_bytes, budget, reconnect_s, in_flight):
  return RemoteClient(address, creds, staging_bytes=staging_bytes, sent_bytes_budget=budget,
                      reconnect_timeout_s=reconnect_s, max_in_flight_samples=in_flight)


def _decode_samples(msg: dict, nested: bool = False):
  """[(SampleInfo, columns)] of one Sample reply (see service.py); BadMessage if malformed."""
  n = wire.get_int(msg, "n", 1, 1 << 16, what="sample reply")
  if "parts" in msg and not nested:   # samples of several layouts, each with their positions
    out = [None] * n
    for part in wire.get_list(msg, "parts", n, what="sample reply"):
      if not isinstance(part, dict):
        raise wire.BadMessage("sample reply parts must be maps")
      samples = _decode_samples(part, nested=True)
      pos = wire.get(part, "pos", bytes, what="sample part")
      if len(pos) != 4 * len(samples):
        raise wire.BadMessage("sample part positions do not match its samples")
      for i, sample in zip(np.frombuffer(pos, "<u4").tolist(), samples):
        if i >= n or out[i] is not None:
          raise wire.BadMessage(f"sample part position {i} is out of range or repeated")
        out[i] = sample
    if any(x is None for x in out):
      raise wire.BadMessage("sample reply parts do not cover every sample")
    return out
  fields = []
  for key, dtype in _INFO_DTYPES:
    data = wire.get(msg, key, bytes, what="sample reply")
    if len(data) != 8 * n:
      raise wire.BadMessage(f"sample reply field {key!r} must hold {n} 8-byte values")
    fields.append(np.frombuffer(data, dtype).tolist())
  infos = [SampleInfo(*info) for info in zip(*fields)]
  if "items" in msg:
    items = [_columns(cols) for cols in wire.get_list(msg, "items", n, what="sample reply")]
  else:
    per_column = []
    for col in wire.get_list(msg, "cols", 1 << 16, what="sample reply"):
      if isinstance(col, dict) and "l" in col:
        values = [_column(c) for c in wire.get_list(col, "l", n, what="sample column")]
      else:
        values = list(wire.decode_array(col, "sample column"))
      if len(values) != n:
        raise wire.BadMessage(f"sample column holds {len(values)} items, expected {n}")
      per_column.append(values)
    items = [list(cols) for cols in zip(*per_column)] if per_column else [[] for _ in range(n)]
  if len(items) != n:
    raise wire.BadMessage(f"sample reply holds {len(items)} items, expected {n}")
  return list(zip(infos, items))


def _decode_batch(msg: dict) -> ReplaySample:
  """One Sample reply as a ReplaySample of (B,)-arrays of info and (B, ...) columns (flat)."""
  if "parts" in msg or "items" in msg or any(
      isinstance(c, dict) and "l" in c for c in msg.get("cols", ())):
    samples = _decode_samples(msg)   # several layouts or object columns: stack item by item
    info = SampleInfo(*[np.asarray(f) for f in zip(*[i for i, _ in samples])])
    try:
      cols = [np.stack(c) for c in zip(*[cols for _, cols in samples])]
    except ValueError as e:
      raise ValueError(f"sampled items of different column layouts in one batch: {e}") from None
    return ReplaySample(info, cols)
  n = wire.get_int(msg, "n", 1, 1 << 16, what="sample reply")
  fields = []
  for key, dtype in _INFO_DTYPES:
    data = wire.get(msg, key, bytes, what="sample reply")
    if len(data) != 8 * n:
      raise wire.BadMessage(f"sample reply field {key!r} must hold {n} 8-byte values")
    fields.append(np.frombuffer(data, dtype))
  fields[-1] = fields[-1].astype(np.int32)   # times_sampled
  cols = [wire.decode_array(c, "sample column")
          for c in wire.get_list(msg, "cols", 1 << 16, what="sample reply")]
  if any(c.shape[:1] != (n,) for c in cols):
    raise wire.BadMessage(f"sample reply columns must hold {n} items")
  return ReplaySample(SampleInfo(*fields), cols)


_INFO_DTYPES = (("keys", "<u8"), ("probs", "<f8"), ("sizes", "<i8"), ("prios", "<f8"),
                ("times", "<i8"))


def _column(col) -> np.ndarray:
  if isinstance(col, dict) and "o" in col:
    shape = wire.check_shape(col.get("s"), "object column")
    arr = np.empty(len(col["o"]), dtype=object)
    arr[:] = col["o"]
    return arr.reshape(shape)
  return wire.decode_array(col, "sample column")


def _columns(cols) -> list:
  if not isinstance(cols, list):
    raise wire.BadMessage("sample item must be a list of columns")
  return [_column(c) for c in cols]
