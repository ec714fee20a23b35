"""Length-framed messages on a TCP socket: the bridge's direct port (both ends).

A frame is an 8-byte little-endian payload length, then the payload (one msgpack message of
wire.py). Nothing else: no kinds, no pickle. A `FrameSocket` is used by one thread at a time;
reads may poll briefly before blocking (see `recv`; in C, the GIL released), which is what keeps
a round trip free of thread wake-ups on a quiet machine.
"""
import math
import select
import socket
import struct
import time
from typing import Optional

from reverb_shm._internal._lib import lib

__all__ = ["FrameSocket", "FrameError", "configure", "HEARTBEAT_S", "HEARTBEAT_TIMEOUT_S"]

_HEADER = struct.Struct("<Q")
_READ_BYTES = 1 << 16          # bytes asked of the kernel per read
_INLINE_BYTES = 1 << 16        # payloads below this are sent in one buffer with their header
# TCP keepalive on idle connections: a peer host that vanished is noticed within ~25 s.
_KEEPALIVE = (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
# A peer working on a request for long (a rate limiter's wait) sends an empty frame every
# HEARTBEAT_S seconds; a requester that hears nothing for HEARTBEAT_TIMEOUT_S seconds takes the
# peer for stopped or cut off (which TCP keepalive, answered by the peer's kernel, misses).
HEARTBEAT_S, HEARTBEAT_TIMEOUT_S = 5.0, 20.0


class FrameError(ConnectionError):
  """The peer sent something that is not a frame within the limits (the connection is
  unusable afterwards)."""


def configure(sock: socket.socket) -> None:
  """TCP_NODELAY (a frame leaves at once) and keepalive on a connected socket."""
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
  for name, value in _KEEPALIVE:
    if hasattr(socket, name):
      sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class FrameSocket:
  """Frames over one connected TCP socket (its descriptor is non-blocking; waits are polls
  with a timeout).

  Args:
    sock: a connected socket (configured here; owned from now on).
    max_bytes: largest payload accepted; a longer frame raises FrameError before any of it
      is read.
  """

  def __init__(self, sock: socket.socket, max_bytes: int):
    configure(sock)
    sock.setblocking(False)
    self.sock = sock
    self._max = max_bytes
    self._buf = bytearray()     # bytes received and not returned yet
    self._fd = sock.fileno()
    self._poll = select.poll()
    self._poll.register(self._fd, select.POLLIN)
    self._out_poll = select.poll()
    self._out_poll.register(sock.fileno(), select.POLLOUT)

  def send(self, payload: bytes, timeout_s: Optional[float]) -> None:
    """Sends one frame, within `timeout_s` seconds (None: no limit).

    Raises:
      TimeoutError: the peer did not take it in time. ConnectionError: the connection broke.
    """
    header = _HEADER.pack(len(payload))
    if len(payload) < _INLINE_BYTES:
      self._send_all(header + payload, timeout_s)
    else:
      deadline = None if timeout_s is None else time.monotonic() + timeout_s
      self._send_all(header, timeout_s)
      self._send_all(payload, _left(deadline))

  def _send_all(self, data: bytes, timeout_s: Optional[float]) -> None:
    sock = self.sock
    view = memoryview(data)
    deadline = None
    while view:
      try:
        view = view[sock.send(view):]
        continue
      except (BlockingIOError, InterruptedError):
        pass
      except OSError as e:
        raise ConnectionError(f"the connection broke: {e}") from None
      if deadline is None and timeout_s is not None:
        deadline = time.monotonic() + timeout_s
      _wait(self._out_poll, _left(deadline), "the peer took no data")

  def recv(self, timeout_s: Optional[float], spin_s: float = 0.0,
           idle_s: Optional[float] = None, max_bytes: Optional[int] = None) -> bytes:
    """The next frame's payload.

    Args:
      timeout_s: seconds the whole frame may take (None: no limit).
      spin_s: seconds to poll for its first bytes before blocking, yielding the CPU between
        polls (a reply due soon comes without the wake-up of a blocked thread).
      idle_s: instead of timeout_s until the frame's first byte arrives (None: timeout_s;
        math.inf: no limit); from then on the frame may take timeout_s.
      max_bytes: a lower limit than the socket's for this frame (e.g. a hello's).

    Raises:
      TimeoutError: nothing (or not the whole frame) in time. ConnectionError: the peer closed
      the connection or it broke (also mid-frame). FrameError: a frame beyond max_bytes.
    """
    if not self._buf and spin_s > 0:
      self._spin(spin_s)
    if not self._buf and idle_s is not None:
      self._read(None if idle_s == math.inf else idle_s)
    limit = self._max if max_bytes is None else min(max_bytes, self._max)
    return self._recv_by(None if timeout_s is None else time.monotonic() + timeout_s, limit)

  def _recv_by(self, deadline: Optional[float], limit: int) -> bytes:
    buf = self._buf
    while len(buf) < _HEADER.size:
      self._read(_left(deadline))
    (size,) = _HEADER.unpack_from(buf)
    if size > limit:
      raise FrameError(f"a frame of {size} bytes exceeds the limit of {limit} bytes")
    end = _HEADER.size + size
    while len(buf) < end:
      self._read(_left(deadline), end - len(buf))
    payload = bytes(buf[_HEADER.size:end])
    del buf[:end]
    return payload

  def _spin(self, seconds: float) -> None:
    # (in C with the GIL released: other threads of this process, such as a bridge in it,
    # run meanwhile instead of contending for the GIL with a Python loop)
    if lib.rs_spin_readable(self._fd, int(seconds * 1e9)):
      self._read_now(_READ_BYTES)

  def _read_now(self, want: int) -> bool:
    """Appends what the kernel holds (up to `want` bytes, at least _READ_BYTES asked);
    False if nothing."""
    try:
      data = self.sock.recv(max(_READ_BYTES, min(want, 1 << 24)))
    except (BlockingIOError, InterruptedError):
      return False
    except OSError as e:
      raise ConnectionError(f"the connection broke: {e}") from None
    if not data:
      raise ConnectionError("the peer closed the connection")
    self._buf += data
    return True

  def _read(self, timeout_s: Optional[float], want: int = _READ_BYTES) -> None:
    """Appends the next bytes, waiting at most `timeout_s` (None: no limit) for them."""
    deadline = None
    while not self._read_now(want):
      if deadline is None and timeout_s is not None:
        deadline = time.monotonic() + timeout_s
      _wait(self._poll, _left(deadline), "no data")

  def shutdown(self) -> None:
    """Ends the connection (from any thread): a thread waiting on it sees it end."""
    try:
      self.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass

  def close(self) -> None:
    """Ends the connection and closes the socket (idempotent)."""
    self.shutdown()
    self.sock.close()


def _wait(poll, timeout_s: Optional[float], what: str) -> None:
  """Waits for `poll`'s event (or an error: the next socket call reports it)."""
  if not poll.poll(-1 if timeout_s is None else max(1, math.ceil(timeout_s * 1000))):
    raise TimeoutError(f"{what} within {timeout_s:.3g} s")


def _left(deadline: Optional[float]) -> Optional[float]:
  if deadline is None:
    return None
  left = deadline - time.monotonic()
  if left <= 0:
    raise TimeoutError("the deadline passed")
  return left
