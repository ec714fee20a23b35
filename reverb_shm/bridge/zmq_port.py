"""The bridge's side of its ZeroMQ port (pyzmq; see wire.py for the messages, zmq_client.py for
the client's side).

One ROUTER socket on the bridge's event loop serves every call: its descriptor is watched by
the loop, each message is dispatched by the routing id of the client's DEALER. A stream call
runs the bridge's gRPC handler for it with a `_StreamContext` (what the handlers use of
grpc.aio's ServicerContext); an insert connection handles each message as the Insert stream
does, the common one-step insert within the dispatch. A ZeroMQ ROUTER does not tell which
client went away: when its monitor reports a closed connection, every call is pinged (sends to
a gone client fail, ROUTER_MANDATORY) and the calls of gone clients are cancelled.
"""
import asyncio
import collections
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, Optional

import grpc
import zmq
from zmq.utils import monitor as zmq_monitor

from reverb_shm.bridge import security, wire, zmq_client

__all__ = ["ZmqPort"]

_log = logging.getLogger(__name__)
_PROBE_AFTER_S = (0.1, 2.0)   # pings after a connection closed (the router drops it meanwhile)
EVENTS, POLLIN = zmq_client.EVENTS, zmq_client.POLLIN
_SPIN_S = zmq_client.SPIN_S
_SPIN_BUDGET_S = 0.002   # the most one drain spins for inserts before the loop's other work runs


class ZmqPort:
  """A ROUTER socket bound to `host` on a free port, serving the bridge's calls.

  Args:
    host: the bridge's host address. token: the bridge's token (None: none needed).
    max_message_bytes: largest insert message accepted. streams: handler(request_iterator,
      context) coroutine functions by stream name. step_at_once(msg) -> seq or None, ack(seq)
      -> reply bytes, insert(msg, cancelled) -> ack dict: the bridge's Insert paths.
  Must be made and used on the bridge's event loop thread.
  """

  def __init__(self, host: str, token: Optional[str], max_message_bytes: int,
               streams: Dict[str, Callable], step_at_once: Callable, ack: Callable,
               insert: Callable):
    self._token, self._max_bytes, self._streams = token, max_message_bytes, streams
    self._step_at_once, self._ack, self._insert = step_at_once, ack, insert
    self._loop = asyncio.get_running_loop()
    sock: Any = zmq.Context.instance().socket(zmq.ROUTER)
    try:
      sock.setsockopt(zmq.LINGER, 0)
      sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
      sock.setsockopt(zmq.SNDHWM, 0)   # (bounded by the streams' credits and acks)
      sock.setsockopt(zmq.RCVHWM, 0)
      sock.setsockopt(zmq.MAXMSGSIZE, max(max_message_bytes, wire.FRAME_BYTES) + (1 << 16))
      sock.setsockopt(zmq.HEARTBEAT_IVL, zmq_client.HEARTBEAT_IVL_MS)
      sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, zmq_client.HEARTBEAT_TIMEOUT_MS)
      if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
      self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
      sock.bind(zmq_client.endpoint(host, 0).rsplit(":", 1)[0] + ":*")
      self.port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    except BaseException:
      sock.close(0)
      raise
    self._sock = sock
    self._calls: Dict[bytes, Any] = {}   # routing id -> _StreamContext or _InsertConn
    self._closed = False
    self._answered = False   # the last message handled was an insert answered at once
    self._loop.add_reader(sock.getsockopt(zmq.FD), self._drain)
    self._loop.add_reader(self._monitor.getsockopt(zmq.FD), self._read_monitor)
    # (the descriptors signal edges: whatever came before they were watched is read now)
    self._loop.call_soon(self._drain)
    self._loop.call_soon(self._read_monitor)

  # ---- sending and receiving (on the loop thread)
  def send(self, ident: bytes, kind: bytes, payload: Optional[bytes] = None) -> bool:
    """Sends one message to a client; False (and its call is cancelled) if it is gone."""
    if self._closed:
      return False
    frames = [ident] + wire.zmq_frames(kind, payload)
    try:
      self._sock.send_multipart(frames, zmq.NOBLOCK, copy=len(frames) == 2)
      sent = True
    except zmq.ZMQError:   # EHOSTUNREACH: the client's connection is gone
      sent = False
    # A send (also a failed one) may take in messages without the descriptor signalling.
    if self._sock.getsockopt(EVENTS) & POLLIN:
      self._loop.call_soon(self._drain)
    if not sent:
      self._drop(ident)
    return sent

  def _drain(self) -> None:
    sock = self._sock
    spin_until = None   # (after an insert answered at once: see _next_insert)
    while not self._closed:
      if not sock.getsockopt(EVENTS) & POLLIN:
        if not self._answered or not self._next_insert(spin_until):
          break
        if spin_until is None:
          spin_until = time.perf_counter() + _SPIN_BUDGET_S
      self._answered = False
      frames = sock.recv_multipart(zmq.NOBLOCK)
      try:
        self._dispatch(frames[0], *wire.zmq_message(frames[1:]))
      except wire.BadMessage:
        self._drop(frames[0])
      except Exception:  # pylint: disable=broad-except  (one bad message ends only its call)
        _log.exception("bridge: ZeroMQ message")
        self._drop(frames[0])

  def _next_insert(self, spin_until: Optional[float]) -> bool:
    """After an insert answered at once, polls for the next message for up to SPIN_S (its
    client sends the next insert soon, mostly), yielding the CPU between polls, so that this
    CPU does not go idle in between (see zmq_client.SPIN_S). The loop's other work waits
    meanwhile: one drain spins for at most _SPIN_BUDGET_S in all, then lets it run and goes on
    after it. True: a message is waiting."""
    self._answered = False
    now = time.perf_counter()
    if spin_until is not None and now >= spin_until:
      self._answered = True
      self._loop.call_soon(self._drain)
      return False
    end = now + _SPIN_S if spin_until is None else min(now + _SPIN_S, spin_until)
    sock = self._sock
    while True:
      os.sched_yield()
      if sock.getsockopt(EVENTS) & POLLIN:
        return True
      if time.perf_counter() >= end:
        return False

  def _dispatch(self, ident: bytes, kind: bytes, payload: bytes) -> None:
    call = self._calls.get(ident)
    if kind == wire.ZMQ_OPEN:
      if call is not None:
        self._drop(ident)
      self._open(ident, payload)
    elif call is None:
      if kind == wire.ZMQ_MSG:   # (a bridge restarted on the same port knows no calls)
        self.send(ident, wire.ZMQ_STATUS, wire.pack(
            {"code": "UNAVAILABLE", "details": "the bridge does not know this call (restarted?)"}))
    elif kind == wire.ZMQ_CANCEL:
      self._drop(ident)
    elif kind == wire.ZMQ_MSG:
      call.message(payload)
    elif kind == wire.ZMQ_EOF:
      call.eof()

  def _open(self, ident: bytes, payload: bytes) -> None:
    try:
      hello = wire.unpack(payload, 1 << 12)
    except wire.BadMessage as e:
      self.send(ident, wire.ZMQ_OPEN, wire.pack({"err": [wire.error_name(e), str(e)]}))
      return
    token = hello.get("token")
    metadata = () if not isinstance(token, str) else (
        (security.TOKEN_METADATA, f"Bearer {token}"),)
    if not security.token_ok(self._token, metadata):
      self.send(ident, wire.ZMQ_OPEN, wire.pack(
          {"err": ["PermissionError", "missing or wrong auth token"]}))
      return
    if not self.send(ident, wire.ZMQ_OPEN, wire.pack({"ok": True})):
      return
    method = hello.get("stream")
    if method is None:
      self._calls[ident] = _InsertConn(self, ident)
      return
    context = self._calls[ident] = _StreamContext(self, ident, metadata)
    handler = self._streams.get(method) if isinstance(method, str) else None
    if handler is None:
      context.finish(grpc.StatusCode.UNIMPLEMENTED, f"no stream {method!r}")
    else:
      context.start(handler(None, context))

  def forget(self, ident: bytes, call) -> None:
    """Removes a call that ended."""
    if self._calls.get(ident) is call:
      del self._calls[ident]

  def _drop(self, ident: bytes) -> None:
    call = self._calls.pop(ident, None)
    if call is not None:
      call.cancel()

  # ---- clients that went away
  def _read_monitor(self) -> None:
    closed = False
    monitor = self._monitor
    while not self._closed and monitor.getsockopt(EVENTS) & POLLIN:
      event = zmq_monitor.parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
      closed = closed or bool(event["event"] & zmq.EVENT_DISCONNECTED)
    if closed:
      for delay in _PROBE_AFTER_S:
        self._loop.call_later(delay, self._probe)

  def _probe(self) -> None:
    for ident in list(self._calls):
      self.send(ident, wire.ZMQ_PING)

  def close(self) -> None:
    """Stops serving: cancels every call, closes the socket."""
    if self._closed:
      return
    for ident in list(self._calls):
      self._drop(ident)
    self._closed = True
    self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
    self._loop.remove_reader(self._monitor.getsockopt(zmq.FD))
    self._sock.disable_monitor()
    self._monitor.close(0)
    self._sock.close(0)

  # ---- insert connections
  def insert_message(self, conn: "_InsertConn", payload: bytes) -> None:
    """Handles one message of an insert connection that is idle: the one-step insert at once,
    anything else in a task of the connection's."""
    try:
      msg = wire.unpack(payload, self._max_bytes)
    except wire.BadMessage as e:
      self._fatal(conn, e)
      return
    seq = self._step_at_once(msg)
    if seq is not None:
      self._answered = self.send(conn.ident, wire.ZMQ_MSG, self._ack(seq)) and _SPIN_S > 0
      return
    conn.task = self._loop.create_task(self._insert_general(conn, msg))

  async def _insert_general(self, conn: "_InsertConn", msg: dict) -> None:
    try:
      ack = await self._insert(msg, conn.cancelled)
    except Exception as e:  # pylint: disable=broad-except  (reported, then the end)
      if not conn.cancelled.is_set():
        self._fatal(conn, e)
      return
    finally:
      conn.task = None
    if conn.cancelled.is_set() or not self.send(conn.ident, wire.ZMQ_MSG, wire.pack(ack)):
      return
    while conn.pending and conn.task is None and not conn.cancelled.is_set():
      self.insert_message(conn, conn.pending.popleft())

  def _fatal(self, conn: "_InsertConn", error: Exception) -> None:
    """Reports an error that ends an insert connection (the client closes it)."""
    self.send(conn.ident, wire.ZMQ_MSG, wire.pack(
        {"fatal": [wire.error_name(error), str(error) or type(error).__name__]}))
    self._drop(conn.ident)


class _InsertConn:
  """An insert connection: its messages are handled one at a time, in order."""

  def __init__(self, port: ZmqPort, ident: bytes):
    self.port, self.ident = port, ident
    self.task: Optional[asyncio.Task] = None
    self.pending: collections.deque = collections.deque()
    self.cancelled = threading.Event()   # the client gave up (the waits on the pool end)

  def message(self, payload: bytes) -> None:
    if self.task is None and not self.pending:
      self.port.insert_message(self, payload)
    else:
      self.pending.append(payload)

  def eof(self) -> None:
    pass

  def cancel(self) -> None:
    self.cancelled.set()
    self.pending.clear()


class _Abort(Exception):
  """A handler ended with a status (_StreamContext.abort)."""


class _StreamContext:
  """What the bridge's stream handlers use of grpc.aio's ServicerContext, for a call on the
  ZeroMQ port: read() returns the client's frames (then grpc.aio.EOF after its half-close),
  write() sends one, abort() ends the call with a status. A cancelled call (by its client, or
  gone) cancels the handler's task, as gRPC does."""

  def __init__(self, port: ZmqPort, ident: bytes, metadata):
    self._port, self._ident, self._metadata = port, ident, metadata
    self._queue: asyncio.Queue = asyncio.Queue()
    self._callbacks: list = []
    self._task: Optional[asyncio.Task] = None
    self._cancelled = False
    self._status: tuple = (grpc.StatusCode.OK, "", ())

  def start(self, coroutine) -> None:
    self._task = asyncio.get_running_loop().create_task(self._run(coroutine))

  async def _run(self, coroutine) -> None:
    try:
      await coroutine
    except _Abort:
      pass
    except asyncio.CancelledError:
      self._cancelled = True
    finally:
      for fn in self._callbacks:
        fn(self)
    if not self._cancelled:
      self.finish(*self._status)

  def finish(self, code: grpc.StatusCode, details: str, trailing: tuple = ()) -> None:
    """Sends the call's status and forgets the call."""
    self._port.forget(self._ident, self)
    self._port.send(self._ident, wire.ZMQ_STATUS, wire.pack(
        {"code": code.name, "details": details, "md": [list(kv) for kv in trailing]}))

  def message(self, frame: bytes) -> None:
    self._queue.put_nowait(frame)

  def eof(self) -> None:
    self._queue.put_nowait(grpc.aio.EOF)

  def cancel(self) -> None:
    self._cancelled = True
    if self._task is not None and not self._task.done():
      self._task.cancel()

  async def read(self):
    return await self._queue.get()

  async def write(self, frame: bytes) -> None:
    if not self._port.send(self._ident, wire.ZMQ_MSG, frame):
      raise asyncio.CancelledError()   # (the client is gone: its call was cancelled)

  def invocation_metadata(self):
    return self._metadata

  @staticmethod
  def time_remaining():
    return None

  def add_done_callback(self, fn) -> None:
    self._callbacks.append(fn)

  async def abort(self, code, details: str = "", trailing_metadata=()):
    self._status = (code, details, tuple(trailing_metadata or ()))
    raise _Abort(details)
