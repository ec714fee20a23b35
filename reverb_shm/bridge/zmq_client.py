"""The client's side of a bridge's ZeroMQ port (pyzmq; see wire.py for the messages).

A bridge without TLS serves its streams (Insert, Write, Sample, SampleBatches) on a ZeroMQ
ROUTER socket as well as on gRPC. Each call here is a DEALER socket of its own, so the bridge
tells calls apart by their routing ids. `Dealer` lets one thread send and another receive on
that socket (ZeroMQ sockets are not thread-safe): every socket operation runs under a lock and
never blocks, and the receiver waits on the sockets' file descriptors outside the lock. A
socket monitor reports a connection that was refused or broke (the bridge stopped or died):
the call then fails with UNAVAILABLE, as a broken gRPC call does.

`InsertConnection` is Client.insert's path: one message each way per insert, sent and received
in the calling thread. `StreamCall` is a stream call with the surface of a grpc stream-stream
call that the clients use (iterate for replies, cancel()).

No TLS: ZeroMQ's CURVE security is not used; a bridge configured with TLS offers no ZeroMQ port
and its clients stay on gRPC.
"""
import os
import select
import threading
import time
from typing import Any, Callable, Optional, Tuple

import grpc

from reverb_shm.bridge import wire

try:
  import zmq
  from zmq.utils import monitor as zmq_monitor
except ImportError:   # (pyzmq comes with the bridge extra; without it, clients stay on gRPC)
  zmq = None  # type: ignore[assignment]

__all__ = ["AVAILABLE", "Dealer", "InsertConnection", "StreamCall", "StreamError", "endpoint"]

AVAILABLE = zmq is not None
# Monitor events that end a call: the bridge's port refused the connection, or it broke.
_BROKEN_EVENTS = 0 if zmq is None else (
    zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED
    | getattr(zmq, "EVENT_HANDSHAKE_FAILED_NO_DETAIL", 0)
    | getattr(zmq, "EVENT_HANDSHAKE_FAILED_PROTOCOL", 0))
_CANCEL_LINGER_MS = 200      # how long a cancelled call's socket tries to deliver ZMQ_CANCEL
# (plain ints: pyzmq's enum flags cost ~0.6 us per check on the hot path)
EVENTS, POLLIN = (0, 0) if zmq is None else (int(zmq.EVENTS), int(zmq.POLLIN))


def _spin_seconds() -> float:
  raw = os.environ.get("REVERB_SHM_BRIDGE_SPIN_US", "300")
  try:
    value = float(raw)
  except ValueError:
    raise ValueError(f"REVERB_SHM_BRIDGE_SPIN_US must be a number of microseconds >= 0, "
                     f"got {raw!r}") from None
  if not value >= 0:
    raise ValueError(f"REVERB_SHM_BRIDGE_SPIN_US must be a number of microseconds >= 0, "
                     f"got {raw!r}")
  return min(value, 100_000.0) / 1e6


# How long an insert's caller polls for the bridge's reply (and the bridge for an insert
# connection's next message) before blocking, yielding the CPU between polls
# (REVERB_SHM_BRIDGE_SPIN_US, microseconds; 0: block at once). A thread that blocks lets its
# CPU go idle, and waking an idle CPU is what a round trip mostly costs on a quiet virtual
# machine (the halted vCPU's wake-up, paid by the waker and the woken: ~40 us each measured
# per hop, and a ZeroMQ round trip has six thread hops).
SPIN_S = _spin_seconds()
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 5_000, 20_000   # ZMTP pings on idle connections


def endpoint(host: str, port: int) -> str:
  """ZeroMQ's TCP endpoint of host:port ("[v6]" or v6 as given)."""
  host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
  return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def split_host(address: str) -> str:
  """The host of "host:port" or "[v6]:port"."""
  host = address.rsplit(":", 1)[0]
  return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class StreamError(grpc.RpcError):
  """A stream that ended (not on gRPC, or for a reason of the client's), with the accessors of
  grpc's errors."""

  def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata=()):
    super().__init__(details)
    self._code, self._details, self._trailing = code, details, tuple(trailing_metadata)

  def code(self) -> grpc.StatusCode:
    return self._code

  def details(self) -> str:
    return self._details

  def trailing_metadata(self) -> tuple:
    return self._trailing


class Cancelled(Exception):
  """The Dealer was closed (the call was cancelled) while or before receiving."""


class Dealer:
  """One DEALER socket connected to a bridge's ZeroMQ port, with a monitor of its connection.

  Thread-safe for one sender and one receiver at a time (see the module docstring). `recv`
  returns the messages that arrived before the connection broke, then raises ConnectionError.
  """

  def __init__(self, host: str, port: int):
    sock: Any = zmq.Context.instance().socket(zmq.DEALER)
    try:
      sock.setsockopt(zmq.LINGER, 0)
      sock.setsockopt(zmq.SNDHWM, 0)   # (bounded by the streams' own credits and acks)
      sock.setsockopt(zmq.RCVHWM, 0)
      sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
      sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
      if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
      self._monitor = sock.get_monitor_socket(_BROKEN_EVENTS)
      sock.connect(endpoint(host, port))
    except BaseException:
      sock.close(0)
      raise
    self._sock = sock
    self._lock = threading.Lock()
    self._wake_r, self._wake_w = os.pipe()
    os.set_blocking(self._wake_r, False)
    os.set_blocking(self._wake_w, False)
    self._poll = select.poll()
    for fd in (sock.getsockopt(zmq.FD), self._monitor.getsockopt(zmq.FD), self._wake_r):
      self._poll.register(fd, select.POLLIN)
    self._closed = False
    self.broken: Optional[str] = None   # why the connection broke, once it did

  def send(self, kind: bytes, payload: Optional[bytes] = None) -> None:
    """Queues one message (ConnectionError once closed or broken)."""
    frames = wire.zmq_frames(kind, payload)
    with self._lock:
      if self._closed:
        raise ConnectionError("the call was closed")
      sock = self._sock
      try:
        if len(frames) == 1:
          sock.send(frames[0], zmq.NOBLOCK)
        else:
          sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
      except zmq.ZMQError as e:
        raise ConnectionError(f"could not send to the bridge: {e}") from None
      finally:
        # A send (also a failed one) may take in the reply that a receiver waits for without
        # its descriptor signalling again: wake it.
        if sock.getsockopt(EVENTS) & POLLIN:
          self._wake()

  def recv(self, timeout_s: Optional[float]) -> Tuple[bytes, bytes]:
    """The next message's (kind, payload), waiting at most `timeout_s` seconds (None: as long as the
    connection lives).

    Raises:
      TimeoutError: nothing came in time. ConnectionError: the connection broke or could not
      be made, or the bridge sent a malformed message. Cancelled: the Dealer was closed.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
      with self._lock:
        if self._closed:
          raise Cancelled()
        self._read_monitor()
        if self._sock.getsockopt(EVENTS) & POLLIN:
          try:
            return wire.zmq_message(self._sock.recv_multipart(zmq.NOBLOCK))
          except wire.BadMessage as e:
            raise ConnectionError(str(e)) from None
        if self.broken is not None:
          raise ConnectionError(self.broken)
      wait_ms = -1
      if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
          raise TimeoutError(f"no message within {timeout_s} s")
        wait_ms = max(1, int(left * 1000))
      self._poll.poll(wait_ms)
      try:
        os.read(self._wake_r, 4096)
      except BlockingIOError:
        pass

  def spin(self, seconds: float) -> None:
    """Returns once a message is waiting (or the Dealer is closed), or after `seconds`: polls
    the socket without blocking, yielding the CPU between polls (see SPIN_S)."""
    end = time.perf_counter() + seconds
    sock, lock = self._sock, self._lock
    while True:
      with lock:
        if self._closed or sock.getsockopt(EVENTS) & POLLIN:
          return
      if time.perf_counter() >= end:
        return
      os.sched_yield()

  def _read_monitor(self) -> None:
    monitor = self._monitor
    while monitor.getsockopt(EVENTS) & POLLIN:
      event = zmq_monitor.parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
      if event["event"] & _BROKEN_EVENTS and self.broken is None:
        endpoint_ = event["endpoint"]
        where = endpoint_.decode() if isinstance(endpoint_, bytes) else str(endpoint_)
        self.broken = f"{where}: connection refused or broken ({event['event']})"

  def _wake(self) -> None:
    try:
      os.write(self._wake_w, b"\0")
    except BlockingIOError:
      pass   # (already woken)

  def close(self, last: Optional[bytes] = None) -> None:
    """Closes the socket (a waiting recv raises Cancelled); `last`, if given, is sent first and
    delivered for up to a short linger."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      linger = 0
      if last is not None and self.broken is None:
        try:
          self._sock.send(last, zmq.NOBLOCK)
          linger = _CANCEL_LINGER_MS
        except zmq.ZMQError:
          pass
      self._sock.disable_monitor()
      self._monitor.close(0)
      self._sock.close(linger)
      self._wake()

  def __del__(self):
    if hasattr(self, "_closed"):
      self.close()
    for fd in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
      if fd is not None:
        os.close(fd)


class InsertConnection:
  """An insert connection to the bridge's ZeroMQ port: a hello with the token, then one message
  each way per Client.insert (the Insert stream's message and its ack), sent and received in
  the calling thread. Used by one caller at a time.

  Raises (constructor):
    ConnectionError: the port is unreachable. TimeoutError: no answer within `timeout_s`.
    PermissionError: the bridge refused the token.
  """

  def __init__(self, host: str, port: int, token: Optional[str], timeout_s: float):
    self._dealer = Dealer(host, port)
    try:
      self._dealer.send(wire.ZMQ_OPEN, wire.pack({"token": token}))
      kind, hello = _answer(self._dealer, timeout_s)
    except BaseException:
      self._dealer.close()
      raise
    if kind != wire.ZMQ_OPEN:
      self._dealer.close()
      raise ConnectionError(f"bridge port {port} did not answer the hello")
    answer = wire.unpack(hello, 1 << 16)
    if answer.get("ok") is not True:
      self._dealer.close()
      raise PermissionError(f"bridge {host}:{port} refused the connection: {answer.get('err')}")

  def round_trip(self, payload: bytes, timeout_s: Optional[float]) -> dict:
    """Sends one encoded message; returns the reply. TimeoutError when no reply came within
    `timeout_s` (None: wait as long as the connection lives); ConnectionError when the
    connection broke or the bridge no longer knows it (restarted on the same port)."""
    self._dealer.send(wire.ZMQ_MSG, payload)
    if SPIN_S > 0:
      self._dealer.spin(SPIN_S if timeout_s is None else min(SPIN_S, timeout_s))
    kind, reply = _answer(self._dealer, timeout_s)
    if kind != wire.ZMQ_MSG:
      raise ConnectionError("the bridge ended the insert connection")
    return wire.unpack(reply)

  def fatal(self, reply: dict) -> Optional[Exception]:
    """The error of a reply that ended the connection (the bridge could not handle the
    message), else None."""
    error = wire.fatal_error(reply)
    if error is not None:
      self.close()
    return error

  def close(self) -> None:
    """Ends the connection; the bridge stops waiting for an insert still in progress."""
    self._dealer.close(wire.ZMQ_CANCEL)


def _answer(dealer: Dealer, timeout_s: Optional[float]) -> Tuple[bytes, bytes]:
  """The next message that is not a ping (Cancelled maps to ConnectionError)."""
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  while True:
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
      kind, payload = dealer.recv(left)
    except Cancelled:
      raise ConnectionError("the connection was closed") from None
    if kind != wire.ZMQ_PING:
      return kind, payload


class StreamCall:
  """A stream of the bridge (Write, Sample, SampleBatches, Insert) on its ZeroMQ port, with the
  surface of a grpc stream-stream call that the clients use: iterate for the reply messages
  (the calling thread receives them itself), cancel() to end it. The request messages of
  `requests` go out from a thread of their own (the iterator's end is a half-close), or, with
  requests=None, are sent by `send` in the caller's thread. The bridge's status ends the
  iteration (OK) or raises StreamError.

  As with gRPC, making the call does not fail: an unreachable port (UNAVAILABLE; then
  `on_unavailable()` is called) or a refused token (UNAUTHENTICATED) is raised by a read.
  """

  def __init__(self, host: str, port: int, token: Optional[str], method: str, requests,
               on_unavailable: Optional[Callable[[], None]] = None):
    self._cancelled = False
    self._done = False
    self._greeted = False   # the bridge's answer to the hello is the first message read
    self._on_unavailable = on_unavailable
    self._dealer = Dealer(host, port)
    self._dealer.send(wire.ZMQ_OPEN, wire.pack({"token": token, "stream": method}))
    if requests is not None:
      threading.Thread(target=self._send_all, args=(requests,), daemon=True,
                       name="reverb_shm-zmq-requests").start()

  def send(self, frame: bytes) -> None:
    """Sends one request message from the calling thread (a call made with requests=None);
    a broken call is reported by the next read."""
    try:
      self._dealer.send(wire.ZMQ_MSG, frame)
    except ConnectionError:
      pass

  def half_close(self) -> None:
    """Ends the requests of a call made with requests=None (the bridge sees their end)."""
    try:
      self._dealer.send(wire.ZMQ_EOF)
    except ConnectionError:
      pass

  def _send_all(self, requests) -> None:
    dealer = self._dealer
    try:
      for frame in requests:
        if self._cancelled:
          return
        dealer.send(wire.ZMQ_MSG, frame)
      if not self._cancelled:
        dealer.send(wire.ZMQ_EOF)
    except ConnectionError:
      pass   # the call broke: its reader reports why

  def __iter__(self):
    return self

  def __next__(self) -> bytes:
    if self._done:
      raise StopIteration
    while True:
      try:
        kind, payload = self._dealer.recv(None)
      except Cancelled:
        self._done = True
        raise StreamError(grpc.StatusCode.CANCELLED, "cancelled by the client") from None
      except ConnectionError as e:
        self._done = True
        self._dealer.close()
        if self._on_unavailable is not None:
          self._on_unavailable()
        raise StreamError(grpc.StatusCode.UNAVAILABLE, f"the stream ended: {e}") from None
      if kind == wire.ZMQ_PING:
        continue
      if not self._greeted and kind == wire.ZMQ_OPEN:
        self._greeted = True
        hello = wire.unpack(payload, 1 << 16)
        if hello.get("ok") is not True:
          self._end()
          raise StreamError(grpc.StatusCode.UNAUTHENTICATED, f"{hello.get('err')}")
        continue
      if kind == wire.ZMQ_MSG:
        return payload
      self._end()
      if kind != wire.ZMQ_STATUS:
        raise StreamError(grpc.StatusCode.INTERNAL, f"unexpected message kind {kind!r}")
      status = wire.unpack(payload)
      code = getattr(grpc.StatusCode, str(status.get("code")), grpc.StatusCode.UNKNOWN)
      if code is grpc.StatusCode.OK:
        raise StopIteration
      md = tuple(tuple(kv) for kv in status.get("md") or ()
                 if isinstance(kv, list) and len(kv) == 2)
      raise StreamError(code, str(status.get("details")), md)

  def _end(self) -> None:
    self._done = True
    self._dealer.close()

  def cancel(self) -> None:
    """Ends the call (also from another thread): a waiting or later read raises CANCELLED."""
    self._cancelled = True
    self._dealer.close(wire.ZMQ_CANCEL)
