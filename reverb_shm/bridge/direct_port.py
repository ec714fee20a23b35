"""The bridge's side of its direct port: Client.insert's connections served on threads.

A listening TCP socket (without TLS only, like the ZeroMQ port) whose connections each get a
thread of their own that reads a message, handles it and writes the reply, with no hop through
the bridge's event loop (see direct_client.py for the messages). After a reply the thread polls
briefly for the next message before it blocks (zmq_client.SPIN_S), as back-to-back inserts
come soon. A connection that sends garbage or an oversized frame gets a fatal reply and is
closed; one that stalls mid-frame is closed after _FRAME_TIMEOUT_S; neither holds up the
others. At most `max_connections` connections are served at once.
"""
import concurrent.futures
import logging
import math
import select
import socket
import threading
import time
from typing import Callable, Optional, Set

from reverb_shm import errors
from reverb_shm.bridge import frames, security, wire, zmq_client

__all__ = ["DirectPort"]

_log = logging.getLogger(__name__)
_HELLO_TIMEOUT_S = 10.0     # a new connection's hello must come within this
_FRAME_TIMEOUT_S = 30.0     # a frame that began must be complete within this
_SEND_TIMEOUT_S = 30.0      # a reply must be taken by the client within this
_WAIT_SLICE_S = 0.1         # a waiting insert checks for its client's hang-up this often
_JOIN_S = 2.0               # close() waits this long for the connection threads
_HELLO_BYTES = 1 << 12      # largest hello
_HANGUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


class DirectPort:
  """A TCP port on `host` (a free port number: `port`) serving insert connections.

  Args:
    host: the bridge's host address. token: the bridge's token (None: none needed).
    max_message_bytes: largest message accepted. max_connections: connections served at once
      (more are refused with ResourceExhaustedError).
    handle: handle(msg, cancelled) -> the reply's bytes, or a concurrent.futures.Future of
      the reply map; runs on the connection's thread. `cancelled` (threading.Event) is set
      when the connection ends. An exception ends the connection with a fatal reply.
  """

  def __init__(self, host: str, token: Optional[str], max_message_bytes: int,
               max_connections: int, handle: Callable):
    self._token, self._max_bytes, self._max_conns = token, max_message_bytes, max_connections
    self._handle = handle
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    self._listener = socket.create_server((host.strip("[]"), 0), family=family, backlog=128)
    self.port: int = self._listener.getsockname()[1]
    self._lock = threading.Lock()
    self._conns: Set[frames.FrameSocket] = set()
    self._threads: Set[threading.Thread] = set()
    self._closed = False
    self._acceptor = threading.Thread(target=self._accept, daemon=True,
                                      name="reverb_shm-direct-accept")
    self._acceptor.start()

  def connections(self) -> int:
    """Connections served now."""
    with self._lock:
      return len(self._conns)

  def close(self) -> None:
    """Stops serving: closes the port and every connection and waits (briefly) for their
    threads. Idempotent."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      conns = list(self._conns)
      threads = list(self._threads) + [self._acceptor]
    try:
      self._listener.shutdown(socket.SHUT_RDWR)   # (wakes the accepting thread)
    except OSError:
      pass
    self._listener.close()
    for conn in conns:
      conn.shutdown()   # (each thread closes its own socket)
    for thread in threads:
      if thread is not threading.current_thread():
        thread.join(_JOIN_S)

  # ---- accepting
  def _accept(self) -> None:
    while True:
      try:
        sock, _ = self._listener.accept()
      except OSError as e:
        if self._closed:
          return
        _log.warning("bridge: direct port accept failed: %s", e)
        threading.Event().wait(0.05)   # (out of descriptors: try again shortly)
        continue
      try:
        conn = frames.FrameSocket(sock, max(self._max_bytes, _HELLO_BYTES))
      except OSError:   # (the client is gone already)
        sock.close()
        continue
      with self._lock:
        refused = self._closed or len(self._conns) >= self._max_conns
        if not refused:
          thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                    name="reverb_shm-direct-conn")
          self._conns.add(conn)
          self._threads.add(thread)
      if refused:
        self._refuse(conn)
        continue
      try:
        thread.start()
      except RuntimeError:   # (no thread to be had: served as a refused one)
        with self._lock:
          self._conns.discard(conn)
          self._threads.discard(thread)
        self._refuse(conn)

  def _refuse(self, conn: frames.FrameSocket) -> None:
    try:
      conn.send(wire.pack({"err": ["ResourceExhaustedError",
                                   f"the bridge serves {self._max_conns} direct connections "
                                   "already (BridgeConfig.max_concurrent_rpcs)"]}), 1.0)
    except (ConnectionError, TimeoutError):
      pass
    conn.close()

  # ---- one connection (on its thread)
  def _serve(self, conn: frames.FrameSocket) -> None:
    cancelled = threading.Event()
    try:
      if self._greet(conn):
        self._loop(conn, cancelled)
    except (ConnectionError, TimeoutError):
      pass     # the client went away, or stalled
    except Exception:  # pylint: disable=broad-except  (ends this connection only)
      _log.exception("bridge: direct connection")
    finally:
      cancelled.set()
      conn.close()
      with self._lock:
        self._conns.discard(conn)
        self._threads.discard(threading.current_thread())

  def _greet(self, conn: frames.FrameSocket) -> bool:
    """Reads the hello and answers it; whether the token was right."""
    try:
      hello = wire.unpack(conn.recv(_HELLO_TIMEOUT_S, max_bytes=_HELLO_BYTES), _HELLO_BYTES)
    except (wire.BadMessage, frames.FrameError) as e:
      conn.send(wire.pack({"err": [wire.error_name(e), str(e)]}), _SEND_TIMEOUT_S)
      return False
    token = hello.get("token")
    metadata = () if not isinstance(token, str) else (
        (security.TOKEN_METADATA, f"Bearer {token}"),)
    if not security.token_ok(self._token, metadata):
      conn.send(wire.pack({"err": ["PermissionError", "missing or wrong auth token"]}),
                _SEND_TIMEOUT_S)
      return False
    conn.send(wire.pack({"ok": True}), _SEND_TIMEOUT_S)
    return True

  def _loop(self, conn: frames.FrameSocket, cancelled: threading.Event) -> None:
    spin = 0.0
    while not self._closed:
      try:
        msg = wire.unpack(conn.recv(_FRAME_TIMEOUT_S, spin, idle_s=math.inf), self._max_bytes)
        reply = self._handle(msg, cancelled)
        if isinstance(reply, concurrent.futures.Future):
          reply = self._await(conn, reply, cancelled)
          if reply is None:
            return
      except (ConnectionError, TimeoutError) as e:
        if not isinstance(e, frames.FrameError):
          raise
        self._fatal(conn, e)
        return
      except Exception as e:  # pylint: disable=broad-except  (reported; ends the connection)
        if not isinstance(e, (errors.ReverbError, ValueError, TypeError, KeyError)):
          _log.exception("bridge: direct connection message")
        self._fatal(conn, e)
        return
      conn.send(reply, _SEND_TIMEOUT_S)
      spin = zmq_client.SPIN_S

  @staticmethod
  def _fatal(conn: frames.FrameSocket, error: Exception) -> None:
    """Reports an error that ends the connection (its thread closes it)."""
    conn.send(wire.pack({"fatal": [wire.error_name(error), str(error) or type(error).__name__]}),
              _SEND_TIMEOUT_S)

  def _await(self, conn: frames.FrameSocket, future: concurrent.futures.Future,
             cancelled: threading.Event) -> Optional[bytes]:
    """The packed reply of `future`; None (the insert cancelled) once the client hung up or
    the port closed. Sends a heartbeat (an empty frame) every frames.HEARTBEAT_S meanwhile."""
    poll = select.poll()
    poll.register(conn.sock.fileno(), _HANGUP)
    beat = time.monotonic() + frames.HEARTBEAT_S
    while True:
      try:
        return wire.pack(future.result(_WAIT_SLICE_S))
      except concurrent.futures.TimeoutError:
        pass
      except concurrent.futures.CancelledError:
        return None   # (the bridge stopped)
      if self._closed or poll.poll(0):
        cancelled.set()
        future.cancel()
        return None
      if time.monotonic() >= beat:   # (the client tells a waiting bridge from a stopped one)
        conn.send(b"", _SEND_TIMEOUT_S)
        beat = time.monotonic() + frames.HEARTBEAT_S
