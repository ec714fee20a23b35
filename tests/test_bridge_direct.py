"""The bridge's direct port (direct_port.DirectPort, direct_client.InsertConnection): results
read back, clients that die or misbehave, a bridge killed mid-call, and what close() releases
(the token and fatal replies: test_bridge_insert.py, with the ZeroMQ port's)."""
import os
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

import reverb_shm  # pylint: disable=g-bad-import-order
from reverb_shm import errors
from reverb_shm.bridge import Bridge, BridgeConfig, RemoteClient, direct_client, frames, wire

from conftest import bridge_process, stop_process

pytestmark = pytest.mark.timeout(120)


def _direct_threads() -> list:
  return [t for t in threading.enumerate() if t.name.startswith("reverb_shm-direct")]


def _wait_for(predicate, what: str, timeout: float = 10.0) -> None:
  deadline = time.monotonic() + timeout
  while not predicate():
    assert time.monotonic() < deadline, what
    time.sleep(0.02)


def _raw(port: int, hello=True) -> socket.socket:
  """A plain socket to the direct port, greeted (no token) if `hello`."""
  sock = socket.create_connection(("127.0.0.1", port), timeout=10)
  if hello:
    payload = wire.pack({"token": None})
    sock.sendall(struct.pack("<Q", len(payload)) + payload)
    assert _read_frame(sock) == {"ok": True}
  return sock


def _read_frame(sock: socket.socket):
  """The next frame's message, or None once the bridge closed the connection."""
  data = b""
  while True:
    if len(data) >= 8 and len(data) >= 8 + struct.unpack_from("<Q", data)[0]:
      return wire.unpack(data[8:8 + struct.unpack_from("<Q", data)[0]])
    part = sock.recv(1 << 16)
    if not part:
      return None
    data += part


def test_inserts_and_a_writer_read_back_over_the_direct_port(server_factory):
  server = server_factory([reverb_shm.Table.queue("t", 1000)], bridge=BridgeConfig())
  client = RemoteClient(server.bridge_address)
  for i in range(50):
    client.insert({"obs": np.full(3, i, np.float32), "a": np.int64(i)}, {"t": float(i + 1)})
  conn = client._connection()  # pylint: disable=protected-access
  assert conn.direct_port and len(conn.direct_inserts) == 1
  with client.trajectory_writer(2) as writer:
    for i in range(50, 60):
      writer.append({"obs": np.full(3, i, np.float32), "a": np.int64(i)})
      writer.create_item("t", 1.0, {"obs": writer.history["obs"][-1],
                                    "a": writer.history["a"][-1]})
    writer.flush()
  samples = list(server.localhost_client().sample("t", 60, emit_timesteps=False))
  # (data: flattened {"a", "obs"}, with a time axis of 1 for the inserted steps)
  assert [int(np.ravel(s.data[0])[0]) for s in samples] == list(range(60))
  assert [float(s.info.priority) for s in samples[:50]] == [float(i + 1) for i in range(50)]
  assert all(np.ravel(s.data[1]).tolist() == [i] * 3 for i, s in enumerate(samples))
  client.close()


def test_garbage_oversized_and_dying_clients_do_not_wedge_the_bridge(server_factory,
                                                                     monkeypatch):
  from reverb_shm.bridge import direct_port  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(direct_port, "_FRAME_TIMEOUT_S", 1.0)
  monkeypatch.setattr(direct_port, "_HELLO_TIMEOUT_S", 1.0)
  server = server_factory([reverb_shm.Table.queue("queue", 100)],
                          bridge=BridgeConfig(max_message_bytes=1 << 20))
  client = RemoteClient(server.bridge_address)
  client.insert(np.int32(0), {"queue": 1.0})
  port = client._connection().direct_port  # pylint: disable=protected-access
  served = server._bridge._direct  # pylint: disable=protected-access
  assert served.connections() == 1

  garbage = _raw(port)                        # a frame that is not msgpack
  garbage.sendall(struct.pack("<Q", 5) + b"\xc1\xc1\xc1\xc1\xc1")
  reply = _read_frame(garbage)
  assert reply["fatal"][0] == "InvalidArgumentError" and "undecodable" in reply["fatal"][1]
  assert _read_frame(garbage) is None         # then closed

  oversized = _raw(port)                      # refused before it is read
  oversized.sendall(struct.pack("<Q", 1 << 40))
  reply = _read_frame(oversized)
  assert reply["fatal"][0] == "ReverbError" and "exceeds the limit" in reply["fatal"][1]
  assert _read_frame(oversized) is None

  not_a_map = _raw(port)
  payload = wire.pack([1, 2, 3])
  not_a_map.sendall(struct.pack("<Q", len(payload)) + payload)
  assert _read_frame(not_a_map)["fatal"][0] == "InvalidArgumentError"

  no_hello = _raw(port, hello=False)          # garbage instead of a hello
  no_hello.sendall(struct.pack("<Q", 3) + b"abc")
  assert "err" in _read_frame(no_hello)
  big_hello = _raw(port, hello=False)         # a hello is small: refused before it is read
  big_hello.sendall(struct.pack("<Q", 1 << 20))
  assert "exceeds the limit" in _read_frame(big_hello)["err"][1]
  assert _read_frame(big_hello) is None

  stalled = _raw(port)                        # half a frame, then nothing
  stalled.sendall(struct.pack("<Q", 100) + b"x" * 10)
  silent = _raw(port, hello=False)            # no hello at all
  died = _raw(port)                           # half a frame, then gone
  died.sendall(struct.pack("<Q", 100) + b"x" * 10)
  died.close()

  for i in range(1, 20):                      # meanwhile another client is served at once
    start = time.monotonic()
    client.insert(np.int32(i), {"queue": 1.0})
    assert time.monotonic() - start < 0.5
  assert _read_frame(stalled) is None          # dropped after the frame timeout
  assert _read_frame(silent) is None           # and the hello timeout
  _wait_for(lambda: served.connections() == 1, "misbehaving connections were kept")
  for sock in (garbage, oversized, not_a_map, no_hello, big_hello, stalled, silent):
    sock.close()
  local = server.localhost_client()
  assert [int(s.data[0][0]) for s in local.sample("queue", 20, emit_timesteps=False)] == \
      list(range(20))


def test_too_many_connections_are_refused_with_a_clear_error(server_factory):
  server = server_factory([reverb_shm.Table.queue("queue", 10)],
                          bridge=BridgeConfig(max_concurrent_rpcs=2))
  client = RemoteClient(server.bridge_address)
  client.insert(np.int32(0), {"queue": 1.0})
  port = client._connection().direct_port  # pylint: disable=protected-access
  other = direct_client.InsertConnection("127.0.0.1", port, None, 5.0)
  with pytest.raises(errors.ResourceExhaustedError, match="max_concurrent_rpcs"):
    direct_client.InsertConnection("127.0.0.1", port, None, 5.0)
  other.close()
  served = server._bridge._direct  # pylint: disable=protected-access
  _wait_for(lambda: served.connections() == 1, "the closed connection was kept")
  direct_client.InsertConnection("127.0.0.1", port, None, 5.0).close()


def test_a_bridge_killed_mid_insert_gives_unavailable_within_the_deadline(server_factory):
  """The bridge process is killed while an insert waits there for its rate limiter: the
  insert raises ServerUnavailableError within reconnect_timeout_s (no hang)."""
  server = server_factory([reverb_shm.Table.queue("queue", 1)])
  with bridge_process(server) as (proc, address):
    client = RemoteClient(address, reconnect_timeout_s=1.0)
    client.insert(np.int32(0), {"queue": 1.0})
    assert client._connection().direct_inserts  # pylint: disable=protected-access
    outcome = []

    def insert():
      start = time.monotonic()
      try:
        client.insert(np.int32(1), {"queue": 1.0})   # waits: the queue is full
        outcome.append(("ok", time.monotonic() - start))
      except Exception as e:  # pylint: disable=broad-except
        outcome.append((e, time.monotonic() - start))
    thread = threading.Thread(target=insert, daemon=True)
    thread.start()
    time.sleep(0.5)
    assert not outcome
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    thread.join(timeout=30)
    assert outcome, "the insert hung"
    error, _ = outcome[0]
    assert isinstance(error, errors.ServerUnavailableError), error
    assert time.monotonic() - killed < 1.0 + 3.0


def test_close_releases_connections_threads_and_the_port(server_factory):
  server = server_factory([reverb_shm.Table.queue("queue", 100)])
  bridge = Bridge(server.name, BridgeConfig())
  clients = [RemoteClient(bridge.address) for _ in range(3)]
  for i, client in enumerate(clients):
    client.insert(np.int32(i), {"queue": 1.0})
  port = clients[0]._connection().direct_port  # pylint: disable=protected-access
  served = bridge._direct  # pylint: disable=protected-access
  assert served.connections() == 3
  clients[0].close()
  _wait_for(lambda: served.connections() == 2, "a closed client's connection was kept")
  idle = _raw(port)
  bridge.stop()
  assert served.connections() == 0
  _wait_for(lambda: not _direct_threads(), "the direct port's threads outlived stop()")
  assert _read_frame(idle) is None
  with pytest.raises(OSError):
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
  with pytest.raises(errors.ServerUnavailableError):
    RemoteClient(bridge.address, reconnect_timeout_s=0.5).insert(np.int32(9), {"queue": 1.0})
  idle.close()


def test_no_direct_port_with_tls_and_none_when_disabled(server_factory, monkeypatch):
  from reverb_shm.bridge import writes  # pylint: disable=g-import-not-at-top
  server = server_factory([reverb_shm.Table.queue("queue", 10)], bridge=BridgeConfig())
  monkeypatch.setattr(writes, "DIRECT_ENABLED", False)
  client = RemoteClient(server.bridge_address)
  client.insert(np.int32(0), {"queue": 1.0})
  conn = client._connection()  # pylint: disable=protected-access
  assert conn.direct_port is None and conn.zmq_inserts and not conn.direct_inserts


def test_frames_keep_pipelined_frames_and_time_out():
  with socket.create_server(("127.0.0.1", 0)) as listener:
    left = socket.create_connection(listener.getsockname())
    right, _ = listener.accept()
  a, b = frames.FrameSocket(left, 1 << 20), frames.FrameSocket(right, 1 << 20)
  for payload in (b"one", b"", b"x" * 300_000):
    a.send(payload, 5.0)
  assert [b.recv(5.0) for _ in range(3)] == [b"one", b"", b"x" * 300_000]
  with pytest.raises(TimeoutError):
    b.recv(0.05)
  with pytest.raises(TimeoutError):
    b.recv(5.0, spin_s=0.001, idle_s=0.05)
  left.sendall(struct.pack("<Q", 10) + b"abc")     # a frame that stops halfway
  with pytest.raises(TimeoutError):
    b.recv(0.1)
  a.close()
  with pytest.raises(ConnectionError):
    b.recv(5.0)
  b.close()


def test_spin_readable_polls_without_blocking():
  from reverb_shm._internal._lib import lib  # pylint: disable=g-import-not-at-top
  with socket.create_server(("127.0.0.1", 0)) as listener:
    left = socket.create_connection(listener.getsockname())
    right, _ = listener.accept()
  start = time.monotonic()
  assert lib.rs_spin_readable(right.fileno(), 2_000_000) == 0     # nothing within 2 ms
  assert 0.002 <= time.monotonic() - start < 1.0
  left.sendall(b"x")
  assert lib.rs_spin_readable(right.fileno(), 1_000_000_000) == 1
  left.close()
  assert right.recv(1) == b"x" and lib.rs_spin_readable(right.fileno(), 0) == 1   # hung up
  right.close()


def test_a_long_wait_at_the_bridge_is_kept_alive_by_heartbeats(server_factory, monkeypatch):
  """An insert without a timeout waits at the bridge (full queue) far beyond the heartbeat
  timeout: the bridge's heartbeats keep it, and it completes once there is room."""
  monkeypatch.setattr(frames, "HEARTBEAT_S", 0.05)
  monkeypatch.setattr(frames, "HEARTBEAT_TIMEOUT_S", 0.3)
  server = server_factory([reverb_shm.Table.queue("queue", 1)], bridge=BridgeConfig())
  client = RemoteClient(server.bridge_address, reconnect_timeout_s=0.5)
  client.insert(np.int32(0), {"queue": 1.0})
  outcome = []
  thread = threading.Thread(target=lambda: outcome.append(
      client.insert(np.int32(1), {"queue": 1.0})), daemon=True)
  thread.start()
  time.sleep(1.5)
  assert not outcome and thread.is_alive()
  local = server.localhost_client()
  assert int(next(local.sample("queue", emit_timesteps=False)).data[0][0]) == 0
  thread.join(timeout=10)
  assert outcome == [None]
  assert int(next(local.sample("queue", emit_timesteps=False)).data[0][0]) == 1


def test_an_insert_without_timeout_ends_when_a_stopped_bridge_sends_no_heartbeat(
    server_factory, monkeypatch):
  """A bridge process stopped (SIGSTOP) keeps its connections (its kernel answers TCP
  keepalive): an insert without a timeout ends with ServerUnavailableError once no heartbeat
  came for HEARTBEAT_TIMEOUT_S."""
  monkeypatch.setattr(frames, "HEARTBEAT_TIMEOUT_S", 1.0)
  server = server_factory([reverb_shm.Table.queue("queue", 10)])
  with bridge_process(server) as (proc, address):
    client = RemoteClient(address, reconnect_timeout_s=0.5)
    client.insert(np.int32(0), {"queue": 1.0})
    stop_process(proc.pid)
    start = time.monotonic()
    with pytest.raises(errors.ServerUnavailableError):
      client.insert(np.int32(1), {"queue": 1.0})
    assert 1.0 <= time.monotonic() - start < 1.0 + 10.0
