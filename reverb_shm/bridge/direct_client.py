"""The client's side of a bridge's direct port: Client.insert over one TCP connection.

A bridge without TLS also listens on a plain TCP port (ServerInfo's "direct_port") whose
connections carry length-framed msgpack messages (frames.py): the client's hello
{"token": str or None}, answered {"ok": true} or {"err": [class, message]}; then one Insert
message (as on the Insert stream: {"ops": [...]}) per Client.insert, answered by its ack
{"upto", "errs"} or {"fatal": [class, message]} (the bridge could not handle the message and
closes the connection); while an insert waits there (for its rate limiter), the bridge sends
an empty frame every frames.HEARTBEAT_S seconds. The calling thread sends and receives itself,
polling briefly for the reply before it blocks, and the bridge serves each connection on a
thread of its own: no other thread is woken on either side (see zmq_client.SPIN_S).
"""
import socket
import time
from typing import Optional

from reverb_shm.bridge import frames, wire, zmq_client

__all__ = ["InsertConnection"]

_HELLO_BYTES = 1 << 12     # largest hello or hello answer
_REPLY_BYTES = 1 << 24     # largest reply (an ack lists at most a few errors)


class InsertConnection:
  """An insert connection to a bridge's direct port, used by one caller at a time.

  Raises (constructor):
    ConnectionError: the port is unreachable (refused, or the connection broke).
    TimeoutError: no connection or no answer to the hello within `timeout_s`.
    PermissionError: the bridge refused the token. ResourceExhaustedError: the bridge serves
    as many connections as it may.
  """

  def __init__(self, host: str, port: int, token: Optional[str], timeout_s: float):
    try:
      sock = socket.create_connection((host, port), timeout=timeout_s)
    except (TimeoutError, socket.timeout):
      raise TimeoutError(f"no connection to {host}:{port} within {timeout_s} s") from None
    except OSError as e:
      raise ConnectionError(f"could not connect to {host}:{port}: {e}") from None
    self._sock = frames.FrameSocket(sock, _REPLY_BYTES)
    try:
      self._sock.send(wire.pack({"token": token}), timeout_s)
      answer = wire.unpack(self._sock.recv(timeout_s), _HELLO_BYTES)
    except BaseException:
      self._sock.close()
      raise
    if answer.get("ok") is not True:
      self._sock.close()
      err = answer.get("err")
      if isinstance(err, list) and len(err) == 2 and err[0] != "PermissionError":
        raise wire.make_error(*err)   # (e.g. ResourceExhaustedError: too many connections)
      raise PermissionError(f"bridge {host}:{port} refused the connection: {err}")

  def round_trip(self, payload: bytes, timeout_s: Optional[float]) -> dict:
    """Sends one encoded message; returns the reply. TimeoutError when no reply came within
    `timeout_s` (None: wait as long as the bridge lives); ConnectionError when the connection
    broke or the bridge sent nothing, not even a heartbeat, for frames.HEARTBEAT_TIMEOUT_S;
    BadMessage when the reply is malformed."""
    sock = self._sock
    sock.send(payload, timeout_s)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    spin = zmq_client.SPIN_S if timeout_s is None else min(zmq_client.SPIN_S, timeout_s)
    while True:
      wait = frames.HEARTBEAT_TIMEOUT_S
      if deadline is not None:
        wait = min(wait, max(0.0, deadline - time.monotonic()))
      try:
        reply = sock.recv(wait, spin)
      except TimeoutError:
        if deadline is not None and time.monotonic() >= deadline:
          raise
        raise ConnectionError(f"the bridge sent nothing for {frames.HEARTBEAT_TIMEOUT_S:g} s "
                              "(stopped, or cut off without its connection closing?)") from None
      if reply:   # (else a heartbeat: the bridge works on it)
        return wire.unpack(reply)
      spin = 0.0

  def fatal(self, reply: dict) -> Optional[Exception]:
    """The error of a reply that ended the connection, else None."""
    error = wire.fatal_error(reply)
    if error is not None:
      self.close()
    return error

  def close(self) -> None:
    """Ends the connection; the bridge stops waiting for an insert still in progress."""
    self._sock.close()
