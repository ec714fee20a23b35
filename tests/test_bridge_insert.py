"""Remote Client.insert on its three transports: the bridge's direct port
(direct_client.InsertConnection), its ZeroMQ port (zmq_client.InsertConnection, with
REVERB_SHM_BRIDGE_DIRECT=0) and the Insert stream through grpcio's public API (without the
ports: TLS, or REVERB_SHM_BRIDGE_ZMQ=0); each scenario runs on each and must give the same results
and errors. Also the bridge's end of it: its one-call insert path (remembered step layout, open
chunks) against the general path.
"""
import os
import re
import signal
import socket
import threading
import time

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

import reverb_shm  # pylint: disable=g-bad-import-order
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm.bridge import (Bridge, BridgeConfig, ClientCredentials, RemoteClient,
                               ServerTLS, direct_client, service, wire, writes, zmq_client)
from reverb_shm.specs import TensorSpec

from conftest import bridge_process, stop_process

pytestmark = pytest.mark.timeout(120)

TRANSPORTS = ("direct", "zmq", "grpc")


@pytest.fixture
def use_transport(monkeypatch):
  """use(name): later remote clients insert over that transport."""
  def use(name):
    monkeypatch.setattr(writes, "ZMQ_ENABLED", name != "grpc")
    monkeypatch.setattr(writes, "DIRECT_ENABLED", name == "direct")
  return use


def _stream_kinds(client: RemoteClient) -> set:
  """The transports of the client's idle insert connections (a subset of TRANSPORTS)."""
  conn = client._connection()  # pylint: disable=protected-access
  return ({"direct"} if conn.direct_inserts else set()) | (
      {"zmq"} if conn.zmq_inserts else set()) | ({"grpc"} if conn.insert_streams else set())


def _outcome(fn, address: str = ""):
  try:
    fn()
    return "ok"
  except Exception as e:  # pylint: disable=broad-except  (compared across transports)
    text = str(e).replace(address, "ADDRESS") if address else str(e)
    return type(e).__name__, re.sub(r"\d+ ms", "N ms", text)   # (waits vary)


def _scenario(server_factory) -> tuple:
  """Inserts that succeed and fail in every way a table can answer; returns what happened
  and the tables' contents."""
  typed = reverb_shm.Table("typed", selectors.Uniform(), selectors.Fifo(), 10,
                           rate_limiters.MinSize(1), signature={"x": TensorSpec([3], np.int32)})
  prio = reverb_shm.Table("p", selectors.Prioritized(1.0), selectors.Fifo(), 10,
                          rate_limiters.MinSize(1))
  server = server_factory([reverb_shm.Table.queue("queue", 1), typed, prio],
                          bridge=BridgeConfig())
  client = RemoteClient(server.bridge_address, reconnect_timeout_s=2.0)
  big = np.arange((wire.FRAME_BYTES // 4) * 2 + 5, dtype=np.float32)   # three frames
  calls = [
      lambda: client.insert({"x": np.arange(3, dtype=np.int32)}, {"typed": 1.0}),
      lambda: client.insert({"x": np.arange(3, dtype=np.int32)}, {"typed": 2.0}),  # fast path
      lambda: client.insert({"x": np.arange(4, dtype=np.int32)}, {"typed": 1.0}),  # signature
      lambda: client.insert({"x": np.arange(3, dtype=np.int64)}, {"typed": 1.0}),
      lambda: client.insert(np.int32(0), {"nope": 1.0}),
      lambda: client.insert(np.int32(1), {"queue": 1.0}),
      lambda: client.insert(np.int32(2), {"queue": 1.0}, timeout_ms=0),  # full queue
      lambda: client.insert(np.int32(2), {"queue": 1.0}, timeout_ms=50),
      lambda: client.insert(np.int32(3), {"p": 1e308}),                  # beyond the cap
      lambda: client.insert(big, {"p": 0.5}),
      lambda: client.insert(np.int32(4), {"p": 0.25, "queue": 1.0}, timeout_ms=0),
      lambda: client.insert(np.array([object()]), {"p": 1.0}),   # not storable
  ]
  outcomes = [_outcome(fn, server.bridge_address) for fn in calls]
  kinds = _stream_kinds(client)
  local = server.localhost_client()
  contents = {}
  for table in ("queue", "typed", "p"):
    size = local.server_info()[table].current_size
    # (with replacement: 100 samples see every item of these tables but for ~1e-17)
    n = size if table == "queue" else 100 * bool(size)
    samples = {s.info.key: s for s in local.sample(table, n, emit_timesteps=False)}
    assert len(samples) == size
    contents[table] = sorted((s.info.priority, [d.tolist() for d in s.data])
                             for s in samples.values())
  return outcomes, contents, kinds


def test_inserts_give_the_same_results_and_errors_on_every_transport(server_factory,
                                                                      use_transport):
  results = {}
  for transport in TRANSPORTS:
    use_transport(transport)
    results[transport] = _scenario(server_factory)
  for transport, (_, _, kinds) in results.items():
    assert kinds == {transport}   # each took the transport it was given
  (outcomes, contents, _), *others = results.values()
  for outcomes2, contents2, _ in others:
    assert outcomes == outcomes2
    assert contents == contents2
  assert outcomes[:2] == ["ok", "ok"] and outcomes[5] == "ok" and outcomes[9] == "ok"
  assert [o[0] for o in outcomes[2:5]] == ["ValueError", "ValueError",   # checked locally
                                          "UnknownTableError"]
  assert [o[0] for o in outcomes[6:9]] == ["DeadlineExceededError", "DeadlineExceededError",
                                          "InvalidArgumentError"]
  assert outcomes[10][0] == "DeadlineExceededError"   # "p" took it, the full queue did not
  # The local client's error for an object it cannot store, with its message.
  local = _outcome(lambda: server_factory([reverb_shm.Table.queue("q", 1)]).localhost_client()
                   .insert(np.array([object()]), {"q": 1.0}))
  assert outcomes[11][0] == local[0] == "ValueError"
  assert outcomes[11][1] == local[1] and "object column rows must hold" in local[1]
  assert [c[0] for c in contents["p"]] == [0.25, 0.5]
  assert contents["p"][1][1][0] == [np.arange(len(contents["p"][1][1][0][0])).tolist()]
  assert len(contents["p"][1][1][0][0]) == (wire.FRAME_BYTES // 4) * 2 + 5
  assert contents["queue"] == [(1.0, [[1]])]
  assert [c[1] for c in contents["typed"]] == [[[[0, 1, 2]]]] * 2


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_refused_token_and_restarted_bridge(server_factory, use_transport, transport):
  use_transport(transport)
  server = server_factory([reverb_shm.Table.queue("queue", 100)])
  bridge = Bridge(server.name, BridgeConfig(token="s3cret"))
  port = bridge.port
  wrong = RemoteClient(bridge.address, ClientCredentials(token="nope"), reconnect_timeout_s=0.5)
  wrong._table_handle = lambda name: RemoteClient._table_handle(good, name)  # pylint: disable=protected-access
  good = RemoteClient(bridge.address, ClientCredentials(token="s3cret"), reconnect_timeout_s=5)
  good.insert(np.int32(0), {"queue": 1.0})
  with pytest.raises(PermissionError, match="token"):
    wrong.insert(np.int32(1), {"queue": 1.0})
  assert _stream_kinds(good) == {transport}
  bridge.stop()
  restart = threading.Timer(0.5, lambda: restarted.append(
      Bridge(server.name, BridgeConfig(port=port, token="s3cret"))))
  restarted = []
  restart.start()
  try:
    good.insert(np.int32(2), {"queue": 1.0})   # reconnects with backoff
  finally:
    restart.join(timeout=30)
    for b in restarted:
      b.stop()
  assert restarted
  with pytest.raises(errors.ServerUnavailableError, match="reconnect_timeout_s"):
    good.insert(np.int32(3), {"queue": 1.0})   # no bridge now: a clear error in ~5 s
  local = server.localhost_client()
  assert [int(s.data[0][0]) for s in local.sample("queue", 2, emit_timesteps=False)] == [0, 2]


class _Interrupt(Exception):
  pass


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_interrupted_insert_cancels_its_stream(server_factory, use_transport, transport):
  """A signal handler's exception (Ctrl-C) ends an insert waiting at the bridge; the client
  goes on with a new stream and the bridge stops waiting for the cancelled item."""
  if threading.current_thread() is not threading.main_thread():
    pytest.skip("signals reach the main thread only")
  use_transport(transport)
  server = server_factory([reverb_shm.Table.queue("queue", 1)], bridge=BridgeConfig())
  client = RemoteClient(server.bridge_address, reconnect_timeout_s=2.0)
  client.insert(np.int32(0), {"queue": 1.0})

  def interrupt(*_):
    raise _Interrupt()
  previous = signal.signal(signal.SIGALRM, interrupt)
  start = time.monotonic()
  try:
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    with pytest.raises(_Interrupt):
      client.insert(np.int32(1), {"queue": 1.0})   # the queue is full: waits at the bridge
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)
  assert time.monotonic() - start < 5
  time.sleep(0.5)   # the bridge notices the cancellation within its wait slice
  local = server.localhost_client()
  assert int(next(local.sample("queue", emit_timesteps=False)).data[0][0]) == 0
  client.insert(np.int32(2), {"queue": 1.0}, timeout_ms=5000)
  assert int(next(local.sample("queue", emit_timesteps=False)).data[0][0]) == 2
  assert _stream_kinds(client) == {transport}


@pytest.mark.parametrize("port_name,connection", [
    ("direct_port", direct_client.InsertConnection), ("zmq_port", zmq_client.InsertConnection)])
def test_a_port_refuses_a_wrong_token_and_reports_fatal_errors(server_factory, port_name,
                                                               connection):
  server = server_factory([reverb_shm.Table.queue("queue", 10)])
  bridge = Bridge(server.name, BridgeConfig(token="s3cret"))
  try:
    client = RemoteClient(bridge.address, ClientCredentials(token="s3cret"))
    client.insert(np.int32(0), {"queue": 1.0})
    port = getattr(client._connection(), port_name)  # pylint: disable=protected-access
    assert port and port != bridge.port
    for token in ("nope", None):
      with pytest.raises(PermissionError, match="token"):
        connection("127.0.0.1", port, token, 5.0)
    sock = connection("127.0.0.1", port, "s3cret", 5.0)
    bad = {"ops": [{"op": "bogus"}]}
    error = sock.fatal(sock.round_trip(wire.pack(bad), 5.0))
    assert isinstance(error, errors.InvalidArgumentError), error
    ok = {"ops": [{"op": "step", "cols": [["<i4", []]], "ep": 7, "timeout_ms": None,
                   "b": np.int32(5).tobytes(), "items": [[1, "queue", 42, 1.0]]}]}
    with pytest.raises(ConnectionError):   # that connection ended
      sock.round_trip(wire.pack(ok), 5.0)
    sock = connection("127.0.0.1", port, "s3cret", 5.0)
    assert sock.round_trip(wire.pack(ok), 5.0) == {"upto": 1, "errs": []}
    sock.close()
    client.close()
  finally:
    bridge.stop()
  assert server.localhost_client().server_info()["queue"].current_size == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_closed_client_inserts_again_over_a_new_connection(server_factory, use_transport,
                                                             transport):
  use_transport(transport)
  server = server_factory([reverb_shm.Table.queue("queue", 10)], bridge=BridgeConfig())
  client = RemoteClient(server.bridge_address, reconnect_timeout_s=2.0)
  client.insert(np.int32(0), {"queue": 1.0})
  old = client._connection()  # pylint: disable=protected-access
  client.close()
  client.insert(np.int32(1), {"queue": 1.0})
  assert client._connection() is not old and _stream_kinds(client) == {transport}  # pylint: disable=protected-access
  local = server.localhost_client()
  assert [int(s.data[0][0]) for s in local.sample("queue", 2, emit_timesteps=False)] == [0, 1]


def test_the_bridges_one_call_path_follows_the_step_layout_of_each_message(server_factory,
                                                                           monkeypatch):
  """The bridge remembers the last step layout it saw; alternating layouts (and a message of
  a remembered layout whose data does not fit it) still get what the general path gives."""
  server = server_factory([reverb_shm.Table.queue("a", 100)], bridge=BridgeConfig())
  client = RemoteClient(server.bridge_address)
  taken = []
  original = service.Bridge._step_at_once  # pylint: disable=protected-access
  monkeypatch.setattr(service.Bridge, "_step_at_once",
                      lambda self, msg: taken.append(original(self, msg)) or taken[-1])
  steps = [{"x": np.full(3, i, np.int16)} if i % 2 else
           {"x": np.full(2, i, np.int32), "y": np.float64(-i)} for i in range(6)]
  for i, step in enumerate(steps):
    client.insert(step, {"a": float(i)})
  # The first step of each layout is checked by the general path, the rest take one call.
  assert [s is not None for s in taken] == [False, False, True, True, True, True]
  with grpc.insecure_channel(server.bridge_address) as channel:
    bad = {"op": "step", "cols": [["<i2", [3]]], "ep": 1, "timeout_ms": None, "b": b"\0" * 5,
           "items": [[1, "a", 77, 1.0]]}
    call = channel.stream_stream(f"/{wire.SERVICE}/Insert")(
        iter(list(wire.frames(wire.pack({"ops": [bad]})))))
    with pytest.raises(grpc.RpcError) as e:
      list(call)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "step data holds 5 bytes, its columns need 6" in e.value.details()
  assert taken[-1] is None
  got = [(s.info.priority, [d.tolist() for d in s.data])
         for s in server.localhost_client().sample("a", 6, emit_timesteps=False)]
  assert got == [(float(i), [[[i] * 3]] if i % 2 else [[[i] * 2], [float(-i)]])
                 for i in range(6)]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_inserts_over_tls_with_a_client_certificate(server_factory, use_transport, transport,
                                                   tmp_path):
  import test_bridge  # pylint: disable=g-import-not-at-top  (its throwaway certificate)
  use_transport(transport)
  cert, key = test_bridge._self_signed(tmp_path)  # pylint: disable=protected-access
  server = server_factory([reverb_shm.Table.queue("queue", 10)],
                          bridge=BridgeConfig(tls=ServerTLS(cert, key, client_ca=cert)))
  client = RemoteClient(server.bridge_address, ClientCredentials(
      root_certificates=cert, certificate_chain=cert, private_key=key))
  for i in range(3):
    client.insert({"x": np.full(2, i, np.int64)}, {"queue": 1.0})
  assert _stream_kinds(client) == {"grpc"}   # no ZeroMQ port with TLS
  local = server.localhost_client()
  assert [s.data[0].tolist() for s in local.sample("queue", 3, emit_timesteps=False)] == [
      [[i, i]] for i in range(3)]


def test_bridge_inserts_append_to_open_chunks_and_stopping_releases_them(server_factory):
  """The bridge's one-call inserts append rows to chunks it holds open (as a local
  Client.insert does): an item costs about its payload, data and episodes are as with the
  general path, and a stopped bridge leaves nothing behind once the items are gone."""
  from test_open_chunks import W1_PAYLOAD, assert_items_are, step  # pylint: disable=g-import-not-at-top
  n = 3000
  server = server_factory([reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10 * n,
                                            rate_limiters.MinSize(1))])
  bridge = Bridge(server.name)
  try:
    client = RemoteClient(bridge.address)
    seg = server.segment
    client.insert(step(0), {"t": 1.0})   # the general path checks the layout
    before = seg.info()
    for i in range(1, n + 1):
      client.insert(step(i), {"t": 1.0})
    after = seg.info()
    assert (after["arena_used"] - before["arena_used"]) / n - W1_PAYLOAD <= 16  # (~1100 B before)
    assert after["num_chunks"] - before["num_chunks"] <= 3 * (n // 256 + 2)
    st = server.shared_table("t")
    assert_items_are(seg, st, [(i, 0) for i in range(n + 1)])
    assert client.server_info()["t"].num_episodes == n + 1   # one per item, as Client.insert
  finally:
    bridge.stop()
  seg.check()
  st.reset()
  info = seg.info()
  assert (info["num_chunks"], info["num_descs"], info["arena_used"]) == (0, 0, 0)


def test_forgotten_step_layouts_release_their_open_chunks(server_factory, monkeypatch):
  from test_open_chunks import assert_items_are, step  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(service, "_MAX_LAYOUTS", 1)   # a new layout makes the bridge forget the last
  server = server_factory([reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100,
                                            rate_limiters.MinSize(1))], bridge=BridgeConfig())
  client = RemoteClient(server.bridge_address)
  seg, st = server.segment, server.shared_table("t")
  for i in range(3):   # the general path, then two one-call inserts into the open chunks
    client.insert(step(i), {"t": 1.0})
  assert_items_are(seg, st, [(0, 0), (1, 0), (2, 0)])
  st.reset()
  assert seg.info()["num_chunks"] == 3   # the open set, held by the bridge
  client.insert({"x": np.int16(7)}, {"t": 1.0})   # another layout: the first one is forgotten
  st.reset()
  info = seg.info()
  assert (info["num_chunks"], info["num_descs"], info["arena_used"]) == (0, 0, 0)
  seg.check()


def test_the_bridge_holds_open_chunks_for_a_bounded_number_of_step_layouts(server_factory,
                                                                            monkeypatch):
  """Clients inserting steps of many layouts: only the most recently opened sets stay open
  (each holds up to 64 KiB per column of the arena); the others are released, shrunk to their
  rows, and reopened when their layout comes back."""
  monkeypatch.setattr(service, "_MAX_OPEN_SETS", 2)
  server = server_factory([reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100,
                                            rate_limiters.MinSize(1))], bridge=BridgeConfig())
  client = RemoteClient(server.bridge_address)
  seg, st = server.segment, server.shared_table("t")
  for rnd in range(2):
    for k in range(1, 5):   # 4 one-column layouts, 2 inserts each (the second: an open set)
      for j in range(2):
        client.insert({"x": np.full(k, 10 * k + j + rnd, np.float32)}, {"t": 1.0})
  got = sorted((len(s.data[0][0]), float(s.data[0][0][0])) for s in
               server.localhost_client().sample("t", 200, emit_timesteps=False))
  assert {v for v in got} == {(k, 10 * k + j + rnd) for k in range(1, 5) for j in range(2)
                              for rnd in range(2)}
  st.reset()
  assert seg.info()["num_chunks"] == 2   # the open sets of the last 2 layouts, one column each
  seg.check()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_insert_with_a_timeout_ends_when_a_stopped_bridge_does_not_answer(
    server_factory, use_transport, transport):
  """A bridge process that stops answering without closing its connection (SIGSTOP): an insert
  with timeout_ms raises DeadlineExceededError after timeout_ms + the answer grace, instead of
  blocking until gRPC keepalive gives up; once the bridge runs again, inserts work."""
  use_transport(transport)
  server = server_factory([reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100,
                                            rate_limiters.MinSize(1))])
  with bridge_process(server) as (proc, address):
    client = RemoteClient(address, reconnect_timeout_s=0.5)
    client.insert(np.ones(2), {"t": 1.0}, timeout_ms=100)   # a stream open, the layout known
    stop_process(proc.pid)
    start = time.monotonic()
    with pytest.raises(errors.DeadlineExceededError, match="did not answer an insert"):
      client.insert(np.ones(2), {"t": 1.0}, timeout_ms=100)
    took = time.monotonic() - start
    assert writes.ANSWER_GRACE_S < took < writes.ANSWER_GRACE_S + 3
    os.kill(proc.pid, signal.SIGCONT)
    client.insert(np.ones(2), {"t": 1.0}, timeout_ms=1000)
    assert server.shared_table("t").size in (2, 3)   # (the timed-out one may have gone in)


def test_a_sample_with_a_timeout_ends_when_a_stopped_bridge_does_not_answer(server_factory):
  server = server_factory([reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100,
                                            rate_limiters.MinSize(1))])
  server.localhost_client().insert(np.ones(2), {"t": 1.0})
  with bridge_process(server) as (proc, address):
    client = RemoteClient(address, reconnect_timeout_s=0.5)
    assert len(list(client.sample("t", 2, emit_timesteps=False))) == 2
    stop_process(proc.pid)
    start = time.monotonic()
    with pytest.raises(errors.DeadlineExceededError, match="sent no sample"):
      list(client.sample("t", 2, emit_timesteps=False, rate_limiter_timeout_ms=100))
    assert writes.ANSWER_GRACE_S < time.monotonic() - start < writes.ANSWER_GRACE_S + 3
    os.kill(proc.pid, signal.SIGCONT)
    assert len(list(client.sample("t", 3, emit_timesteps=False,
                                  rate_limiter_timeout_ms=1000))) == 3


def test_the_zmq_port_cancels_the_calls_of_a_killed_client(server_factory):
  """A ZeroMQ ROUTER does not say which client went away: the bridge pings its calls when a
  connection closes. A client process killed (SIGKILL) while its sample waits at the bridge
  loses its call there; another client's waiting call is kept and still answered."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  server = server_factory([reverb_shm.Table.queue("queue", 10)], bridge=BridgeConfig())
  port = server._bridge._zmq  # pylint: disable=protected-access
  code = ("import sys, reverb_shm.bridge as b\n"
          "c = b.RemoteClient(sys.argv[1])\n"
          "print('waiting', flush=True)\n"
          "next(c.sample('queue', emit_timesteps=False))\n")
  proc = subprocess.Popen([sys.executable, "-c", code, server.bridge_address],
                          stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "waiting"
    survivor = RemoteClient(server.bridge_address)
    got = []
    reader = threading.Thread(target=lambda: got.append(
        next(survivor.sample("queue", emit_timesteps=False))), daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while len(port._calls) < 2:  # pylint: disable=protected-access
      assert time.monotonic() < deadline, port._calls  # pylint: disable=protected-access
      time.sleep(0.05)
  finally:
    proc.kill()
    proc.wait(timeout=30)
  deadline = time.monotonic() + 10
  while len(port._calls) > 1:  # pylint: disable=protected-access
    assert time.monotonic() < deadline, "the killed client's call was kept"
    time.sleep(0.05)
  time.sleep(0.5)   # its wait on the bridge's pool ends within a wait slice
  server.localhost_client().insert(np.int32(7), {"queue": 1.0})
  reader.join(timeout=10)
  assert [int(s.data[0][0]) for s in got] == [7]


def test_inserts_without_polling_for_replies_give_the_same_results(server_factory,
                                                                   monkeypatch):
  """REVERB_SHM_BRIDGE_SPIN_US=0: the client blocks for each reply at once and the bridge
  for each next message; same outcomes and contents as with the default polling."""
  with_spin = _scenario(server_factory)
  monkeypatch.setattr(zmq_client, "SPIN_S", 0.0)
  from reverb_shm.bridge import zmq_port  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(zmq_port, "_SPIN_S", 0.0)
  assert _scenario(server_factory) == with_spin


@pytest.mark.parametrize("value", ["fast", "-1", "nan"])
def test_a_bad_spin_setting_is_refused_with_its_name(value):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  proc = subprocess.run([sys.executable, "-c", "import reverb_shm.bridge.remote"],
                        capture_output=True,
                        text=True, timeout=60,
                        env=dict(os.environ, REVERB_SHM_BRIDGE_SPIN_US=value))
  assert proc.returncode != 0
  assert (f"REVERB_SHM_BRIDGE_SPIN_US must be a number of microseconds >= 0, got {value!r}"
          in proc.stderr)


def test_a_bridge_polling_for_back_to_back_inserts_still_serves_other_calls(server_factory):
  """A client process inserts back to back through a bridge process that polls 50 ms for each
  next insert: the bridge's loop still answers another client's calls (it polls for at most
  a few ms at a time), and every insert is in the table."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  server = server_factory([reverb_shm.Table("t", selectors.Fifo(), selectors.Fifo(), 10**6,
                                            rate_limiters.MinSize(1))])
  env = dict(os.environ, REVERB_SHM_BRIDGE_SPIN_US="50000")
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  bridge = subprocess.Popen([sys.executable, "-m", "reverb_shm.cli", "bridge", server.name,
                             "--port", str(port)], stdout=subprocess.PIPE, text=True, env=env,
                            cwd=os.path.dirname(os.path.dirname(reverb_shm.__file__)))
  inserter = None
  try:
    assert "listening" in bridge.stdout.readline()
    address = f"127.0.0.1:{port}"
    code = ("import sys, time, numpy as np, reverb_shm.bridge as b\n"
            "c = b.RemoteClient(sys.argv[1])\n"
            "c.insert(np.int32(0), {'t': 1.0})\n"
            "print('inserting', flush=True)\n"
            "n, end = 1, time.monotonic() + 6\n"
            "while time.monotonic() < end:\n"
            "  c.insert(np.int32(n), {'t': 1.0}); n += 1\n"
            "print(n, time.monotonic(), flush=True)\n")
    inserter = subprocess.Popen([sys.executable, "-c", code, address], stdout=subprocess.PIPE,
                                text=True, env=env)
    assert inserter.stdout.readline().strip() == "inserting"
    other = RemoteClient(address, reconnect_timeout_s=5.0)
    sizes = []
    for _ in range(5):
      sizes.append(other.server_info(timeout=10)["t"].current_size)
      got = list(other.sample("t", 2, emit_timesteps=False, rate_limiter_timeout_ms=5000))
      assert len(got) == 2
      time.sleep(0.2)
    answered = time.monotonic()   # (CLOCK_MONOTONIC: comparable with the inserter's)
    n, inserted = inserter.communicate(timeout=60)[0].split()
    assert inserter.returncode == 0
  finally:
    if inserter is not None and inserter.poll() is None:
      inserter.kill()
      inserter.wait(timeout=10)
    bridge.terminate()
    bridge.wait(timeout=10)
  # (a loop held by the polling would answer only once the inserter stopped)
  assert answered < float(inserted), (answered, inserted)
  assert sizes == sorted(sizes) and sizes[-1] > sizes[0]   # answered while it inserted
  assert server.localhost_client().server_info()["t"].current_size == int(n)
