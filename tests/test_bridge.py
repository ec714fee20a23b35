"""gRPC bridge: large items, security, deadlines, prefetch, restarts, sharding, processes, fuzz."""
import datetime
import multiprocessing
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

import reverb_shm  # pylint: disable=g-bad-import-order
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm.bridge import (Bridge, BridgeConfig, ClientCredentials, RemoteClient,
                               ServerTLS, ShardedClient, wire)

from conftest import bridge_process

pytestmark = pytest.mark.timeout(60)


def _uniform(name="dist", max_size=1000):
  return reverb_shm.Table(name, selectors.Uniform(), selectors.Fifo(), max_size,
                          rate_limiters.MinSize(1))


@pytest.fixture
def served(server_factory):
  server = server_factory([_uniform("dist"), reverb_shm.Table.queue("queue", 10)],
                          bridge=BridgeConfig())
  return server, RemoteClient(server.bridge_address, reconnect_timeout_s=2.0)


def test_client_dispatch_picks_transport(served):
  server, _ = served
  assert type(reverb_shm.Client(server.bridge_address)) is RemoteClient
  assert type(reverb_shm.Client(f"localhost:{server.port}")) is reverb_shm.Client
  assert type(reverb_shm.Client([server.bridge_address, f"localhost:{server.port}"])) is (
      ShardedClient)


def test_64_mib_item_round_trips(server_factory):
  server = server_factory([_uniform("dist")], bridge=BridgeConfig(), arena_bytes=200 << 20)
  client = RemoteClient(server.bridge_address)
  value = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
  client.insert(value, {"dist": 1.0})
  sample = next(client.sample("dist", emit_timesteps=False))
  np.testing.assert_array_equal(sample.data[0][0], value)
  local = next(server.localhost_client().sample("dist", emit_timesteps=False))
  np.testing.assert_array_equal(local.data[0][0], value)


def test_message_limit_is_named_in_the_error(server_factory):
  server = server_factory([_uniform("dist")], bridge=BridgeConfig(max_message_bytes=1 << 20))
  client = RemoteClient(server.bridge_address, reconnect_timeout_s=0.5)
  with pytest.raises(errors.ReverbError, match="max_message_bytes"):
    client.insert(np.zeros(1 << 19), {"dist": 1.0})   # 4 MiB of rows > 1 MiB limit
  assert server.localhost_client().server_info()["dist"].current_size == 0


def test_sample_deadline_propagates(served):
  _, client = served
  start = time.monotonic()
  with pytest.raises(errors.DeadlineExceededError, match="dist"):
    next(client.sample("dist", rate_limiter_timeout_ms=200))
  assert 0.15 < time.monotonic() - start < 5


def test_cancelled_sample_stops_waiting_on_the_bridge(served):
  server, client = served
  gen = client.sample("queue", 1)
  import threading  # pylint: disable=g-import-not-at-top
  outcome = []
  t = threading.Thread(target=lambda: outcome.append(pytest.raises(errors.ReverbError, next, gen)),
                       daemon=True)
  t.start()
  time.sleep(0.3)
  client.close()            # cancels the stream: the bridge gives up its blocked sample
  t.join(timeout=5)
  assert not t.is_alive() and outcome
  time.sleep(0.3)
  server.localhost_client().insert(np.ones(1), {"queue": 1.0})
  assert server.localhost_client().server_info()["queue"].current_size == 1


def test_sampling_prefetch_is_bounded(server_factory):
  server = server_factory([_uniform("dist")], bridge=BridgeConfig())
  local = server.localhost_client()
  for i in range(20):
    local.insert(np.full(1, i), {"dist": 1.0})
  client = RemoteClient(server.bridge_address, max_in_flight_samples=4)
  gen = client.sample("dist", 1000)
  next(gen)
  time.sleep(0.5)
  sampled = local.server_info()["dist"].rate_limiter_info.sample_stats.completed
  assert 2 <= sampled <= 1 + 4 + 1
  gen.close()


def test_token_is_checked_on_every_call(server_factory):
  server = server_factory([_uniform("dist")], bridge=BridgeConfig(token="s3cret"))
  anonymous = RemoteClient(server.bridge_address, ClientCredentials(), reconnect_timeout_s=0.5)
  with pytest.raises(PermissionError, match="token"):
    anonymous.server_info()
  wrong = RemoteClient(server.bridge_address, ClientCredentials(token="nope"))
  with pytest.raises(PermissionError):
    wrong.insert(np.ones(1), {"dist": 1.0})
  good = RemoteClient(server.bridge_address, ClientCredentials(token="s3cret"))
  good.insert(np.ones(1), {"dist": 1.0})
  assert next(good.sample("dist", emit_timesteps=False)).data[0].tolist() == [[1.0]]


def test_non_loopback_bind_needs_tls_or_token(served):
  server, _ = served
  with pytest.raises(ValueError, match="TLS"):
    Bridge(server.name, BridgeConfig(host="0.0.0.0"))


def _self_signed(tmp_path):
  """(cert_pem, key_pem) for 'localhost'/127.0.0.1, via cryptography or the openssl CLI."""
  try:
    from cryptography import x509  # pylint: disable=g-import-not-at-top
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress  # pylint: disable=g-import-not-at-top
  except ImportError:
    if not shutil.which("openssl"):
      pytest.skip("neither cryptography nor openssl is available")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(tmp_path / "k.pem"), "-out", str(tmp_path / "c.pem")],
                   check=True, capture_output=True, timeout=30)
    return (tmp_path / "c.pem").read_bytes(), (tmp_path / "k.pem").read_bytes()
  key = ec.generate_private_key(ec.SECP256R1())
  name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
  now = datetime.datetime.now(datetime.timezone.utc)
  cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
          .public_key(key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.SubjectAlternativeName(
              [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
              critical=False)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(key, hashes.SHA256()))
  return (cert.public_bytes(serialization.Encoding.PEM),
          key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()))


def test_tls_with_client_certificates(server_factory, tmp_path):
  cert, key = _self_signed(tmp_path)
  tls = ServerTLS(cert, key, client_ca=cert)     # clients must present a cert from this CA
  server = server_factory([_uniform("dist")], bridge=BridgeConfig(tls=tls))
  good = RemoteClient(server.bridge_address, ClientCredentials(
      root_certificates=cert, certificate_chain=cert, private_key=key))
  good.insert(np.arange(3), {"dist": 1.0})
  assert good.server_info()["dist"].current_size == 1
  plaintext = RemoteClient(server.bridge_address, ClientCredentials(), reconnect_timeout_s=0.3)
  with pytest.raises((errors.ServerUnavailableError, errors.DeadlineExceededError)):
    plaintext.server_info(timeout=1)
  no_client_cert = RemoteClient(server.bridge_address, ClientCredentials(root_certificates=cert),
                                reconnect_timeout_s=0.3)
  with pytest.raises(errors.ReverbError):
    no_client_cert.server_info(timeout=1)


def test_writer_survives_bridge_restart_and_tables_are_unaffected(server_factory):
  server = server_factory([_uniform("dist")])
  bridge = Bridge(server.name)
  port = bridge.port
  client = RemoteClient(bridge.address, reconnect_timeout_s=5.0)
  writer = client.trajectory_writer(2)
  writer.append({"x": np.float32(0)})
  writer.append({"x": np.float32(1)})
  writer.create_item("dist", 1.0, {"x": writer.history["x"][-2:]})
  bridge.stop()   # the item may still be unconfirmed: the writer re-sends it
  assert server.localhost_client().server_info()["dist"].current_size in (0, 1)
  bridge = Bridge(server.name, BridgeConfig(port=port))
  try:
    writer.append({"x": np.float32(2)})
    writer.create_item("dist", 1.0, {"x": writer.history["x"][-2:]})   # refers to a re-sent chunk
    writer.flush()
    items = {tuple(s.data[0].tolist()) for s in
             server.localhost_client().sample("dist", 20, emit_timesteps=False)}
    assert items == {(0.0, 1.0), (1.0, 2.0)}
  finally:
    writer.close()
    bridge.stop()


def test_dead_bridge_gives_a_clear_error_without_hanging(server_factory):
  server = server_factory([_uniform("dist")])
  bridge = Bridge(server.name)
  client = RemoteClient(bridge.address, reconnect_timeout_s=0.5)
  client.insert(np.ones(1), {"dist": 1.0})
  bridge.stop()
  start = time.monotonic()
  with pytest.raises(errors.ServerUnavailableError, match="reconnect_timeout_s"):
    client.insert(np.ones(1), {"dist": 1.0})
  assert time.monotonic() - start < 10
  assert server.localhost_client().server_info()["dist"].current_size == 1


def _pairs_writer(client, table: str, n: int):
  """A remote writer with n - 1 items (pairs of its n steps) created in `table`, unflushed."""
  writer = client.trajectory_writer(2)
  for i in range(n):
    writer.append({"x": np.float32(i)})
    if i:
      writer.create_item(table, 1.0, {"x": writer.history["x"][-2:]})
  return writer


def test_writer_closed_after_its_bridge_stopped_warns_of_unconfirmed_items(server_factory):
  server = server_factory([_uniform("dist")])
  bridge = Bridge(server.name)
  client = RemoteClient(bridge.address, reconnect_timeout_s=0.5)
  writer = _pairs_writer(client, "dist", 50)
  bridge.stop()
  with pytest.warns(RuntimeWarning) as got:
    writer.close()
  text = " ".join(str(w.message) for w in got)
  assert "49 items" in text and "not confirmed" in text and "stream ended" in text, text
  assert "rate limiter" not in text   # (not the limiter's doing)
  assert server.localhost_client().server_info()["dist"].current_size == 0


def test_writer_closed_with_items_its_limiter_did_not_admit_warns_of_the_limiter(served):
  server, client = served   # "queue": a queue of 10 items, blocking inserts beyond
  writer = _pairs_writer(client, "queue", 16)
  with pytest.warns(RuntimeWarning, match="5 items .* rate limiter did not admit") as got:
    writer.close()
  assert not any("not confirmed" in str(w.message) for w in got)
  assert server.localhost_client().server_info()["queue"].current_size == 10


@pytest.mark.timeout(30)
def test_server_info_after_the_bridge_stopped_raises_within_reconnect_timeout(server_factory):
  server = server_factory([_uniform("dist")])
  bridge = Bridge(server.name)
  client = RemoteClient(bridge.address, reconnect_timeout_s=1.0)
  assert client.server_info()["dist"].current_size == 0
  bridge.stop()
  start = time.monotonic()
  with pytest.raises(errors.ServerUnavailableError, match="reconnect_timeout_s"):
    client.server_info()   # no timeout of its own: it waited for the bridge forever
  assert 0.9 < time.monotonic() - start < 10
  client.close()


def test_sharding_spreads_inserts_and_samples_every_shard(server_factory):
  servers = [server_factory([_uniform("dist")], bridge=BridgeConfig()) for _ in range(2)]
  client = reverb_shm.Client([s.bridge_address for s in servers])
  for i in range(10):
    client.insert(np.full(1, i), {"dist": 1.0})
  sizes = [s.localhost_client().server_info()["dist"].current_size for s in servers]
  assert sizes == [5, 5]
  assert client.server_info()["dist"].current_size == 10
  samples = list(client.sample("dist", 6, emit_timesteps=False))
  assert len(samples) == 6
  assert [s.localhost_client().server_info()["dist"].rate_limiter_info.sample_stats.completed
          for s in servers] == [3, 3]
  keys = [s.info.key for s in samples[:2]]
  assert client.mutate_priorities("dist", deletes=keys) == (0, 2)
  client.reset("dist")
  assert client.server_info()["dist"].current_size == 0


def _actor(address, actor_id, episodes):
  client = reverb_shm.Client(address)
  with client.trajectory_writer(2) as writer:
    for _ in range(episodes):
      for t in range(4):
        writer.append({"obs": np.full(3, actor_id, np.float32), "t": np.int32(t)})
        if t:
          writer.create_item("dist", 1.0, {"obs": writer.history["obs"][-2:],
                                           "t": writer.history["t"][-1]})
      writer.end_episode()


def test_remote_actor_processes_feed_a_local_learner(server_factory):
  server = server_factory([_uniform("dist")], bridge=BridgeConfig())
  ctx = multiprocessing.get_context("spawn")
  procs = [ctx.Process(target=_actor, args=(server.bridge_address, i, 3)) for i in range(2)]
  for p in procs:
    p.start()
  for p in procs:
    p.join(timeout=45)
    assert p.exitcode == 0
  learner = server.localhost_client()
  assert learner.server_info()["dist"].current_size == 2 * 3 * 3
  for s in learner.sample("dist", 30, emit_timesteps=False):
    obs, t = s.data
    assert obs.shape == (2, 3) and obs[0, 0] in (0.0, 1.0) and 1 <= int(t) <= 3


def test_cli_bridge_serves_a_server(server_factory):
  server = server_factory([_uniform("dist")])
  with bridge_process(server) as (_, address):
    client = RemoteClient(address)
    client.insert(np.ones(2), {"dist": 1.0})
    assert server.localhost_client().server_info()["dist"].current_size == 1


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # pylint: disable=g-import-not-at-top,g-bad-import-order

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.binary(max_size=64)
    | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=4), max_leaves=12)
_keys = st.sampled_from(["op", "id", "table", "n", "credit", "keys", "prios", "descs", "d", "s",
                         "cols", "items",
                         "cap", "ep", "step", "b", "first", "rows", "ids", "seq", "timeout_ms",
                         "upd_keys", "upd_prios", "del_keys"])
_messages = st.one_of(
    st.binary(max_size=64),
    st.dictionaries(_keys, _values | st.sampled_from(["items", "itemrun", "chunk", "rows", "obj",
                                                      "drop", "step", "no_such_table", "<f4",
                                                      "|O"]), max_size=8)
    .map(lambda m: b"\x00" + wire.pack(m)))


@pytest.fixture(scope="module")
def fuzz_target():
  server = reverb_shm.Server([_uniform("dist")], name=f"fuzz_{os.getpid()}", arena_bytes=16 << 20,
                             bridge=BridgeConfig())
  local = server.localhost_client()
  local.insert(np.arange(4), {"dist": 1.0})
  channel = grpc.insecure_channel(server.bridge_address)
  yield server, local, channel
  channel.close()
  server.stop()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(["ServerInfo", "Mutate", "Reset", "Checkpoint", "Sample", "Write",
                               "Insert"]), messages=st.lists(_messages, min_size=1, max_size=3))
def test_fuzzed_messages_get_error_statuses_and_change_nothing(fuzz_target, method, messages):
  server, local, channel = fuzz_target
  before = local.server_info()["dist"]
  path = f"/{wire.SERVICE}/{method}"
  if method in ("Sample", "Write", "Insert"):
    call = channel.stream_stream(path)(iter(messages), timeout=5)
    try:
      replies = list(call)
      if method in ("Write", "Insert"):   # acks of "items" ops: a fuzzed item can only have failed
        for reply in replies:
          ack = wire.unpack(reply[1:])
          assert [e[0] for e in ack["errs"]][-1:] == [ack["upto"]]
    except grpc.RpcError as e:
      assert e.code() is not grpc.StatusCode.INTERNAL, e.details()
  else:
    payload = messages[0][1:] if messages[0][:1] == b"\x00" else messages[0]
    try:
      channel.unary_unary(path)(payload, timeout=5)
      # ServerInfo and Checkpoint take no arguments: an empty map is a valid request.
      if not (method in ("ServerInfo", "Checkpoint") and payload == b"\x80"):
        pytest.fail(f"{method} accepted a fuzzed message")
    except grpc.RpcError as e:
      assert e.code() is not grpc.StatusCode.INTERNAL, e.details()
  after = local.server_info()["dist"]
  assert (after.current_size, after.rate_limiter_info.insert_stats.completed) == (
      before.current_size, before.rate_limiter_info.insert_stats.completed)
  assert local.server_info()["dist"].current_size == 1   # the bridge still answers below too
  assert RemoteClient(server.bridge_address).server_info(timeout=5)["dist"].current_size == 1
