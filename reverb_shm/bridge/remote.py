"""RemoteClient: the Client API over a gRPC bridge.

Writers are not re-implemented: a RemoteClient hands the ordinary Client.insert and
TrajectoryWriter a private *staging* segment in this process (unlinked at once, so nothing
outlives the process) and `_RemoteTable` handles whose `insert_descriptors` forward items over
one Write stream per client. Each staging chunk an item refers to is sent once (new rows of
an open chunk are sent as they are first needed) and named by a stream chunk id; the bridge
keeps the chunk pinned until the client drops it. Sent chunks are tracked in an LRU bounded by
`sent_bytes_budget`; an evicted chunk is dropped on the bridge and re-sent if needed again.

If the Write stream breaks (bridge died or restarted), the client reconnects with exponential
backoff for up to `reconnect_timeout_s` and re-sends the unconfirmed items with their original
keys (re-inserting an existing key only updates its priority), then raises
ServerUnavailableError. Sampling streams grant the bridge `max_in_flight_samples` credits:
the bridge never samples further ahead of the consumer.
"""
import collections
import itertools
import os
import queue
import secrets
import threading
import time
from typing import Any, Dict, Optional

import grpc
import numpy as np

from reverb_shm import chunks, errors, shm, specs, structure, timeouts
from reverb_shm import client as client_lib
from reverb_shm import table as table_lib
from reverb_shm.bridge import security, wire
from reverb_shm.replay_sample import SampleInfo
from reverb_shm.selectors import PRIORITIZED

__all__ = ["RemoteClient"]

DEFAULT_STAGING_BYTES = 128 << 20
DEFAULT_SENT_BYTES_BUDGET = 64 << 20
_CHANNEL_OPTIONS = (("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                    ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.max_pings_without_data", 0))
_BACKOFF_START_S, _BACKOFF_MAX_S = 0.05, 1.0
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
_CODE_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: errors.UnknownTableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceededError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.TableClosedError,
    grpc.StatusCode.UNAVAILABLE: errors.ServerUnavailableError,
}

_staging_lock = threading.Lock()
_staging: Dict[int, shm.Segment] = {}   # pid -> staging segment of that process


def _staging_segment(arena_bytes: int) -> shm.Segment:
  """This process's staging segment (created on first use; its name is unlinked at once)."""
  pid = os.getpid()
  with _staging_lock:
    seg = _staging.get(pid)
    if seg is None:
      name = f"stage.{pid}.{secrets.token_hex(4)}"
      seg = shm.Segment.create(name, [table_lib.Table.queue("staging", 1)],
                               arena_bytes=arena_bytes, max_procs=4)
      seg.unlink()
      _staging.clear()        # a fork child must not use its parent's
      _staging[pid] = seg
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
    return NotImplementedError(details)
  if code is grpc.StatusCode.UNAUTHENTICATED:
    return PermissionError(f"bridge {address} refused the call: {details}")
  if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
    return errors.ServerUnavailableError(f"bridge {address} unavailable: {details}")
  return _CODE_ERRORS.get(code, errors.ReverbError)(f"bridge {address}: {code.name}: {details}")


class _Connection:
  """A channel to one bridge, and the client's Write stream on it (lazily opened)."""

  def __init__(self, client: "RemoteClient"):
    self.client = client
    self.address = client.server_address
    self.creds = client._creds  # pylint: disable=protected-access
    self.channel = self.creds.channel(self.address, _CHANNEL_OPTIONS)
    self.metadata = self.creds.metadata()
    self.lock = threading.RLock()
    self._ids = itertools.count(1)
    self._seq = itertools.count(1)
    self._stream = None
    self._sent: "collections.OrderedDict[int, list]" = collections.OrderedDict()
    self._sent_bytes = 0

  def method(self, name: str, kind: str = "unary_unary"):
    return getattr(self.channel, kind)(f"/{wire.SERVICE}/{name}")

  def close(self) -> None:
    self._close_stream()
    self.channel.close()

  # ---- unary calls (retried while the bridge is unreachable)
  def unary(self, name: str, msg: dict, timeout: Optional[float] = None,
            wait_for_ready: bool = False) -> dict:
    deadline = time.monotonic() + self.client.reconnect_timeout_s
    backoff = _BACKOFF_START_S
    while True:
      try:
        reply = self.method(name)(wire.pack(msg), timeout=timeout, metadata=self.metadata,
                                  wait_for_ready=wait_for_ready)
        return wire.unpack(reply)
      except grpc.RpcError as e:
        if e.code() is not grpc.StatusCode.UNAVAILABLE or time.monotonic() >= deadline:
          raise rpc_error(e, self.address) from None
      time.sleep(backoff)
      backoff = min(2 * backoff, _BACKOFF_MAX_S)

  # ---- the Write stream
  def _open_stream(self):
    requests = queue.SimpleQueue()

    def frames():
      while True:
        item = requests.get()
        if item is None:
          return
        yield item
    responses = self.method("Write", "stream_stream")(frames(), metadata=self.metadata)
    self._stream = (requests, responses, wire.Reassembler())
    self._sent.clear()
    self._sent_bytes = 0
    return self._stream

  def _close_stream(self) -> None:
    stream, self._stream = self._stream, None
    if stream is not None:
      stream[0].put(None)
      stream[1].cancel()

  def insert(self, table: str, keys, prios, blob: bytes, offs, deadline_ns: int,
             timeout_ms) -> int:
    """Sends the chunks the items need and the items; returns how many were inserted.

    Raises:
      DeadlineExceededError (with .inserted), the table's errors, ServerUnavailableError.
    """
    staging = self.client._segment()  # pylint: disable=protected-access
    descs = [_decode_descriptor(blob[int(offs[i]):int(offs[i + 1])]) for i in range(len(keys))]
    backoff = _BACKOFF_START_S
    give_up = time.monotonic() + self.client.reconnect_timeout_s
    with self.lock:
      while True:
        try:
          return self._insert_once(staging, table, keys, prios, descs, deadline_ns, timeout_ms)
        except grpc.RpcError as e:
          self._close_stream()
          if e.code() not in _RETRYABLE or time.monotonic() >= give_up:
            raise errors.ServerUnavailableError(
                f"lost the Write stream to bridge {self.address} and could not re-send "
                f"{len(keys)} unconfirmed item(s) within reconnect_timeout_s="
                f"{self.client.reconnect_timeout_s}: {rpc_error(e, self.address)}") from None
        time.sleep(backoff)
        backoff = min(2 * backoff, _BACKOFF_MAX_S)

  def _insert_once(self, staging, table, keys, prios, descs, deadline_ns, timeout_ms) -> int:
    requests, responses, asm = self._stream or self._open_stream()
    wire_descs = []
    in_use = set()
    for desc in descs:
      cols = []
      for slices, squeeze in desc:
        ids = []
        for off, row, nrows in slices:
          ids.append([self._ensure_sent(requests, staging, off, row + nrows, in_use), row, nrows])
        cols.append([ids, squeeze])
      wire_descs.append(cols)
    self._evict(requests, in_use)
    if deadline_ns < 0:
      wait = None
    else:
      wait = max(0, (deadline_ns - time.monotonic_ns()) // 1_000_000)
    seq = next(self._seq)
    msg = {"op": "items", "seq": seq, "table": table,
           "keys": np.ascontiguousarray(keys, "<u8").tobytes(),
           "prios": np.ascontiguousarray(prios, "<f8").tobytes(), "descs": wire_descs,
           "timeout_ms": wait}
    for frame in wire.frames(wire.pack(msg)):
      requests.put(frame)
    while True:
      reply = asm.feed(next(responses))
      if reply is not None and reply.get("seq") == seq:
        break
    inserted = int(reply.get("n", 0))
    err = reply.get("err")
    if err:
      if isinstance(err, list) and err and err[0] == "DeadlineExceededError":
        raise errors.DeadlineExceededError(err[1] if len(err) > 1 else "deadline exceeded",
                                           inserted=inserted)
      # The bridge may have failed to store a chunk: forget them all, so they are re-sent.
      for off in in_use:
        if off in self._sent:
          self._drop(requests, off)
      raise wire.make_error(*(list(err) + [""])[:2])
    return inserted

  def _ensure_sent(self, requests, staging, off: int, rows_needed: int, in_use: set) -> int:
    """The stream id of staging chunk `off`, sending it (or its new rows) first if needed."""
    meta = chunks._ChunkMeta(staging, off)  # pylint: disable=protected-access
    identity = (meta.dtype.str, meta.shape, meta.episode_id, meta.start_step)
    entry = self._sent.get(off)
    if entry is not None and entry[1] != identity:   # the staging block was reused
      self._drop(requests, off)
      entry = None
    if entry is None:
      cid = next(self._ids)
      size = max(1, meta.capacity * meta.row_bytes)
      if meta.dtype.kind == "O":
        rows = chunks._read_object_rows(staging, meta, 0, meta.rows)  # pylint: disable=protected-access
        flat = [[x.item() if isinstance(x, np.generic) else x for x in np.asarray(r).reshape(-1)]
                for r in rows]
        self._put(requests, {"op": "obj", "id": cid, "s": list(meta.shape), "rows": flat,
                             "ep": meta.episode_id, "step": meta.start_step})
        entry = [cid, identity, meta.rows, size]
      else:
        self._put(requests, {"op": "chunk", "id": cid, "d": meta.dtype.str,
                             "s": list(meta.shape), "cap": meta.capacity,
                             "ep": meta.episode_id, "step": meta.start_step})
        entry = [cid, identity, 0, size]
      self._sent[off] = entry
      self._sent_bytes += size
    self._sent.move_to_end(off)
    in_use.add(off)
    if entry[2] < rows_needed:
      start = meta.data_address - staging.address
      first, last = entry[2], meta.rows
      self._put(requests, {"op": "rows", "id": entry[0], "first": first,
                           "b": bytes(staging.buf[start + first * meta.row_bytes:
                                                  start + last * meta.row_bytes])})
      entry[2] = last
    return entry[0]

  def _evict(self, requests, in_use: set) -> None:
    budget = self.client.sent_bytes_budget
    while self._sent_bytes > budget:
      off = next(iter(self._sent))
      if off in in_use:
        break
      self._drop(requests, off)

  def _drop(self, requests, off: int) -> None:
    cid, _, _, size = self._sent.pop(off)
    self._sent_bytes -= size
    self._put(requests, {"op": "drop", "ids": [cid]})

  @staticmethod
  def _put(requests, msg: dict) -> None:
    for frame in wire.frames(wire.pack(msg)):
      requests.put(frame)


def _decode_descriptor(blob: bytes):
  """[(slices [(chunk_off, row, nrows)], squeeze)] of one descriptor from encode_descriptor."""
  ncols, nslices = np.frombuffer(blob, chunks.DESC_HDR, 1)[0].tolist()
  cols = np.frombuffer(blob, chunks.DESC_COL, ncols, chunks.DESC_HDR.itemsize)
  slices = np.frombuffer(blob, chunks.DESC_SLICE, nslices,
                         chunks.DESC_HDR.itemsize + ncols * chunks.DESC_COL.itemsize).tolist()
  return [(slices[first:first + n], bool(flags & chunks.SQUEEZE))
          for first, n, flags, _ in cols.tolist()]


class _RemoteTable:
  """The part of SharedTable that Client and TrajectoryWriter use, over the bridge."""

  def __init__(self, client: "RemoteClient", name: str, signature):
    self._client = client
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
    conn = self._client._connection()  # pylint: disable=protected-access
    return conn.insert(self.name, keys, prios, bytes(blob), np.asarray(offs, np.uint64),
                       deadline_ns, timeout_ms)

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

  __slots__ = ("name", "index", "seg", "table", "signature", "flat_signature", "prioritized")

  def __init__(self, client: "RemoteClient", index: int, entry: dict):
    self.name = entry["name"]
    self.index = index
    self.seg = None
    self.signature = specs.decode_signature(entry["signature"])
    self.table = _RemoteTable(client, self.name, self.signature)
    self.flat_signature = (None if self.signature is None
                           else structure.flatten(self.signature)[0])
    stats = entry["stats"]
    self.prioritized = PRIORITIZED in (stats["sampler_kind"], stats["remover_kind"])


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
    max_in_flight_samples: samples a sampling stream may prefetch.
  """

  def __init__(self, server_address: str,
               credentials: Optional[security.ClientCredentials] = None, *,
               staging_bytes: Optional[int] = None,
               sent_bytes_budget: int = DEFAULT_SENT_BYTES_BUDGET,
               reconnect_timeout_s: float = 10.0, max_in_flight_samples: int = 16):
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
    self._conn = None
    self._conn_pid = None
    self._conn_lock = threading.Lock()
    self._infos = None

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

  # ---- plumbing used by Client's methods and TrajectoryWriter
  def _connection(self) -> _Connection:
    with self._conn_lock:
      if self._conn is None or self._conn_pid != os.getpid():
        self._conn, self._conn_pid, self._handles = _Connection(self), os.getpid(), {}
      return self._conn

  def _segment(self) -> shm.Segment:
    return _staging_segment(self.staging_bytes)

  def _table_handle(self, table: str) -> _RemoteHandle:
    handle = self._handles.get(table) if self._conn_pid == os.getpid() else None
    if handle is None:
      if not isinstance(table, str):
        raise TypeError(f"table name must be a str, got {type(table).__name__}")
      entries = self._fetch_tables()
      for index, entry in enumerate(entries):
        if entry["name"] == table:
          handle = self._handles[table] = _RemoteHandle(self, index, entry)
          break
      else:
        raise errors.UnknownTableError(
            f"Could not find table '{table}' at bridge {self.server_address}. Available "
            f"tables: {sorted(e['name'] for e in entries)}")
    return handle

  def _fetch_tables(self, timeout: Optional[float] = None, wait: bool = False) -> list:
    reply = self._connection().unary("ServerInfo", {}, timeout=timeout, wait_for_ready=wait)
    tables = reply.get("tables")
    if not isinstance(tables, list):
      raise errors.ReverbError(f"bridge {self.server_address} sent a malformed ServerInfo")
    return tables

  def shared_table(self, table: str):
    raise ValueError(f"shared_table() needs a server on this host; {self.server_address} is a "
                     "remote bridge")

  # ---- Client API that differs from the local one
  def server_info(self, timeout: Optional[float] = None) -> Dict[str, table_lib.TableInfo]:
    """TableInfo of every table, waiting up to `timeout` s (None/0: forever) for the bridge.

    Raises:
      ValueError: negative timeout.
      DeadlineExceededError: the bridge did not answer in time.
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
    credit = min(n, self.max_in_flight_samples)
    requests = queue.SimpleQueue()
    requests.put(wire.pack({"table": table, "n": n, "timeout_ms": timeout_ms,
                            "credit": credit}))

    def frames():
      while True:
        item = requests.get()
        if item is None:
          return
        yield from wire.frames(item)
    call = conn.method("Sample", "stream_stream")(frames(), metadata=conn.metadata)
    asm = wire.Reassembler()
    got = 0
    try:
      for frame in call:
        msg = asm.feed(frame)
        if msg is None:
          continue
        got += 1
        if credit < n:
          requests.put(wire.pack({"credit": 1}))
          credit += 1
        yield client_lib.to_samples(_sample_info(msg), _columns(msg), emit_timesteps, treedef)
        if got == n:
          break
    except grpc.RpcError as e:
      raise rpc_error(e, self.server_address) from None
    finally:
      requests.put(None)
      call.cancel()


def _rebuild(address, creds, staging_bytes, budget, reconnect_s, in_flight):
  return RemoteClient(address, creds, staging_bytes=staging_bytes, sent_bytes_budget=budget,
                      reconnect_timeout_s=reconnect_s, max_in_flight_samples=in_flight)


def _sample_info(msg: dict) -> SampleInfo:
  info = wire.get_list(msg, "info", 5, what="sample")
  key, probability, table_size, priority, times_sampled = info
  return SampleInfo(key, probability, table_size, priority, times_sampled)


def _columns(msg: dict) -> list:
  out = []
  for col in wire.get_list(msg, "cols", 1 << 16, what="sample"):
    if isinstance(col, dict) and "o" in col:
      shape = wire.check_shape(col.get("s"), "object column")
      arr = np.empty(len(col["o"]), dtype=object)
      arr[:] = col["o"]
      out.append(arr.reshape(shape))
    else:
      out.append(wire.decode_array(col, "sample column"))
  return out
