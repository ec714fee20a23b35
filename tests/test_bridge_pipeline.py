"""Remote writes are pipelined and sampling streams are batched and reconnect.

The bridge runs in this process on loopback; tables are inspected through shared memory.
"""
import gc
import threading
import time

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

import reverb_shm  # pylint: disable=g-bad-import-order
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import shm
from reverb_shm.specs import TensorSpec
from reverb_shm.bridge import Bridge, BridgeConfig, RemoteClient, service, wire, writes

pytestmark = pytest.mark.timeout(60)


def _uniform(name="dist", max_size=1000):
  return reverb_shm.Table(name, selectors.Uniform(), selectors.Fifo(), max_size,
                          rate_limiters.MinSize(1))


def _remote(server, **kwargs):
  kwargs.setdefault("reconnect_timeout_s", 2.0)
  return RemoteClient(server.bridge_address, **kwargs)


def test_writer_items_are_pipelined_in_order_and_confirmed_by_flush(server_factory):
  server = server_factory([reverb_shm.Table.queue("queue", 500)], bridge=BridgeConfig())
  writer = _remote(server).trajectory_writer(2)
  for i in range(300):
    writer.append({"x": np.full(2, i, np.float32)})
    writer.create_item("queue", 1.0, {"x": writer.history["x"][-1:]})
  writer.flush(timeout_ms=10_000)
  assert writer.num_pending_items == 0
  local = server.localhost_client()
  assert local.server_info()["queue"].current_size == 300
  got = [int(s.data[0][0, 0]) for s in local.sample("queue", 300, emit_timesteps=False)]
  assert got == list(range(300))          # FIFO order survives batching of ops and acks
  writer.close()


def test_flush_waits_for_confirmations_with_its_deadline(server_factory):
  server = server_factory([reverb_shm.Table.queue("queue", 1)], bridge=BridgeConfig())
  client = _remote(server)
  writer = client.trajectory_writer(1)
  writer.append({"x": np.int32(0)})
  for _ in range(3):
    writer.create_item("queue", 1.0, writer.history["x"][:])   # returns without a round trip
  writer.flush(2, timeout_ms=5_000)       # the first one fits
  assert writer.num_pending_items == 2
  start = time.monotonic()
  with pytest.raises(errors.DeadlineExceededError, match=r"inserts=1"):
    writer.flush(1, timeout_ms=50)
  assert 0.04 <= time.monotonic() - start < 5
  sampled = []
  t = threading.Thread(target=lambda: sampled.extend(client.sample("queue", 1)))
  t.start()
  writer.flush(1, timeout_ms=10_000)      # the sampler made room for one more
  t.join(timeout=10)
  assert len(sampled) == 1 and writer.num_pending_items == 1
  with pytest.warns(RuntimeWarning, match="1 items sent to bridge"):
    writer.close()                        # half-closes: the blocked item is dropped
  assert server.localhost_client().server_info()["queue"].current_size == 1


def test_end_episode_timeout_names_the_remote_items_and_ends_the_episode(server_factory):
  server = server_factory([reverb_shm.Table.queue("queue", 1)], bridge=BridgeConfig())
  writer = _remote(server).trajectory_writer(2)
  writer.append({"x": np.int32(0)})
  writer.create_item("queue", 1.0, writer.history["x"][-1:])
  writer.create_item("queue", 1.0, writer.history["x"][-1:])
  with pytest.raises(errors.DeadlineExceededError, match="in flight.*ended anyway"):
    writer.end_episode(timeout_ms=200)
  assert writer.episode_steps == 0 and writer.num_pending_items == 1
  next(server.localhost_client().sample("queue"))
  writer.end_episode(timeout_ms=10_000)
  assert writer.num_pending_items == 0
  writer.close()


def test_a_bridge_side_error_surfaces_at_flush(server_factory):
  server = server_factory([_uniform()], bridge=BridgeConfig(), arena_bytes=4 << 20,
                          max_bytes=shm.start_bytes([_uniform()], 4 << 20) + (64 << 10))
  writer = _remote(server).trajectory_writer(1)
  writer.append({"x": np.zeros(5 << 18, np.float32)})     # 5 MiB: never fits the bridge's arena
  writer.create_item("dist", 1.0, writer.history["x"][-1:])  # returns: the error comes later
  with pytest.raises(errors.ResourceExhaustedError):
    writer.flush(timeout_ms=10_000)
  writer.append({"y": np.zeros(4, np.float32)})           # the stream is still usable
  writer.create_item("dist", 1.0, writer.history["y"][-1:])
  writer.flush(timeout_ms=10_000)
  assert server.localhost_client().server_info()["dist"].current_size == 1
  writer.close()


def test_client_insert_is_one_message_for_every_table(server_factory, monkeypatch):
  server = server_factory([_uniform("a"), _uniform("b")], bridge=BridgeConfig())
  client = _remote(server)
  calls = []
  original = service._WriteStream.handle_message  # pylint: disable=protected-access

  def spy(self, msg):
    calls.append([op["op"] for op in msg["ops"]])
    return original(self, msg)
  monkeypatch.setattr(service._WriteStream, "handle_message", spy)  # pylint: disable=protected-access
  client.insert({"x": np.arange(3), "y": np.float32(1)}, {"a": 1.0, "b": 2.0})
  client.insert({"x": np.arange(3), "y": "text"}, {"a": 3.0, "b": 4.0})
  # Numeric steps: one "step" op; object columns: chunks sent once, then one item per table.
  assert calls == [["step"], ["chunk", "obj", "items", "items"]]
  infos = server.localhost_client().server_info()
  assert (infos["a"].current_size, infos["b"].current_size) == (2, 2)
  samples = list(server.localhost_client().sample("b", 100, emit_timesteps=False))
  by_prio = {s.info.priority: s.data for s in samples}   # uniform: both items, surely
  assert by_prio[2.0][0].tolist() == [[0, 1, 2]] and by_prio[2.0][1].tolist() == [1.0]
  assert by_prio[4.0][1].tolist() == [b"text"]   # strings come back as bytes, as in Reverb


def _insert_stream_round_trip(server, msg: dict) -> dict:
  """Sends one raw message on an Insert stream; returns the reply (raises grpc.RpcError)."""
  with grpc.insecure_channel(server.bridge_address) as channel:
    call = channel.stream_stream(f"/{wire.SERVICE}/Insert")(iter(wire.frames(wire.pack(msg))),
                                                           timeout=10)
    return wire.unpack(next(call)[1:])


def test_step_ops_are_validated_by_the_bridge(server_factory):
  typed = reverb_shm.Table("typed", selectors.Uniform(), selectors.Fifo(), 10,
                           rate_limiters.MinSize(1), signature={"x": TensorSpec([3], np.int32)})
  server = server_factory([_uniform("a"), typed],
                          bridge=BridgeConfig())
  ok = {"op": "step", "cols": [["<f4", [3]]], "ep": 7, "timeout_ms": None,
        "b": np.arange(3, dtype=np.float32).tobytes(), "items": [[1, "a", 42, 1.5]]}
  assert _insert_stream_round_trip(server, {"ops": [ok]}) == {"upto": 1, "errs": []}
  for bad in ({"b": b"\0" * 11}, {"cols": [["|O", [3]]]}, {"cols": [["<f4", [-3]]]},
              {"cols": "x"}, {"items": [[1, "a", -1, 1.0]]}, {"items": [["1", "a", 1, 1.0]]}):
    with pytest.raises(grpc.RpcError) as e:
      _insert_stream_round_trip(server, {"ops": [dict(ok, **bad)]})
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
  # Errors of the tables: the signature (checked at the bridge too), the priority, the name.
  for items, error in (([[1, "typed", 1, 1.0]], "InvalidArgumentError"),
                       ([[1, "a", 2, float("nan")]], "InvalidArgumentError"),
                       ([[1, "nope", 3, 1.0]], "UnknownTableError")):
    ack = _insert_stream_round_trip(server, {"ops": [dict(ok, items=items,
                                                          cols=[["<f4", [1, 3]]])]})
    assert ack["upto"] == 1 and ack["errs"][0][:3] == [1, 0, error], ack
  local = server.localhost_client()
  assert local.server_info()["a"].current_size == 1
  assert local.server_info()["typed"].current_size == 0
  sample = next(local.sample("a", emit_timesteps=False))
  assert sample.info.key == 42 and sample.data[0].tolist() == [[0.0, 1.0, 2.0]]


def _spy_step_at_once(monkeypatch) -> list:
  """Records what the bridge's one-call insert path returned per Insert message."""
  results = []
  original = service.Bridge._step_at_once  # pylint: disable=protected-access

  def spy(self, msg):
    results.append(original(self, msg))
    return results[-1]
  monkeypatch.setattr(service.Bridge, "_step_at_once", spy)
  return results


def test_one_call_insert_paths_send_and_store_what_the_general_paths_do(server_factory,
                                                                       monkeypatch):
  server = server_factory([_uniform("a")], bridge=BridgeConfig())
  client = _remote(server)
  taken = _spy_step_at_once(monkeypatch)
  sent = []
  original_send = writes.OneMessageInserter.send
  monkeypatch.setattr(writes.OneMessageInserter, "send",
                      lambda self, ops, *timeout: (sent.append(ops),
                                                   original_send(self, ops, *timeout))[1])
  general = lambda *args: False  # pylint: disable=unnecessary-lambda-assignment
  steps = [{"x": np.arange(6, dtype=np.int16)[::2], "y": np.float32(i), "z": i}
           for i in range(4)]   # (a strided leaf: sent as a contiguous copy)
  client.insert(steps[0], {"a": 1.0})                     # general at both ends (first use)
  with monkeypatch.context() as m:
    m.setattr(RemoteClient, "_insert_fast", general)
    client.insert(steps[1], {"a": 2})                     # general client, one-call bridge
  client.insert(steps[2], {"a": 3})                       # one call at both ends
  client.insert(steps[3], {"a": 4.0}, timeout_ms=1000)
  assert [s is not None for s in taken] == [False, True, True, True]
  ops = [op for (op,) in sent]
  for op in ops[1:]:   # the same op from both client paths, but for its random ids
    assert {k: v for k, v in op.items() if k not in ("ep", "b", "items", "timeout_ms")} == {
        k: v for k, v in ops[0].items() if k not in ("ep", "b", "items", "timeout_ms")}
  assert [op["items"][0][3] for op in ops] == [1.0, 2.0, 3.0, 4.0]
  assert [op["timeout_ms"] for op in ops] == [None, None, None, 1000]
  assert len({op["items"][0][2] for op in ops}) == 4   # distinct random keys
  samples = sorted(server.localhost_client().sample("a", 200, emit_timesteps=False),
                   key=lambda s: s.info.priority)
  got = {(s.info.priority, s.data[0].tolist()[0][1], float(s.data[1][0]), int(s.data[2][0]))
         for s in samples}
  assert got == {(i + 1.0, 2, float(i), i) for i in range(4)}
  assert {s.info.key for s in samples} == {op["items"][0][2] for op in ops}


def test_one_call_insert_path_declines_what_it_cannot_finish(server_factory, monkeypatch):
  prioritized = reverb_shm.Table("p", selectors.Prioritized(1.0), selectors.Fifo(), 10,
                                 rate_limiters.MinSize(1))
  server = server_factory([reverb_shm.Table.queue("queue", 1), prioritized],
                          bridge=BridgeConfig())
  client = _remote(server)
  taken = _spy_step_at_once(monkeypatch)
  client.insert(np.int32(0), {"queue": 1.0})
  # The queue is full: the one-call path declines, the general one reports the limiter.
  for _ in range(2):
    with pytest.raises(errors.DeadlineExceededError, match="queue"):
      client.insert(np.int32(1), {"queue": 1.0}, timeout_ms=0)
  # A priority beyond the sum-tree cap, refused alike before and after the table was opened.
  raised = []
  for _ in range(2):
    with pytest.raises(errors.InvalidArgumentError) as e:
      client.insert(np.int32(2), {"p": 1e308})
    raised.append(str(e.value))
  client.insert(np.int32(3), {"p": 0.5})
  with pytest.raises(ValueError, match="negative"):
    client.insert(np.int32(4), {"p": -1.0})
  assert raised[0] == raised[1]
  assert [s is not None for s in taken] == [False, False, False, False, False, True]
  infos = server.localhost_client().server_info()
  assert (infos["queue"].current_size, infos["p"].current_size) == (1, 1)
  # Raw messages the one-call path must leave to the general one (which rejects them).
  seq, key = 1, 99
  base = {"op": "step", "cols": [["<i4", []]], "ep": 7, "timeout_ms": None,
          "b": np.int32(5).tobytes(), "items": [[seq, "p", key, 0.25]]}
  assert _insert_stream_round_trip(server, {"ops": [base]}) == {"upto": 1, "errs": []}
  for bad in ({"items": [[seq, "p", key, -0.5]]}, {"items": [[seq, "p", key, float("inf")]]},
              {"items": [[seq, "p", -1, 1.0]]}, {"ep": -1}, {"timeout_ms": -5},
              {"b": b"\0" * 5}):
    taken.clear()
    try:
      reply = _insert_stream_round_trip(server, {"ops": [dict(base, **bad)]})
      assert reply["errs"] and reply["errs"][0][2] == "InvalidArgumentError", (bad, reply)
    except grpc.RpcError as e:
      assert e.code() is grpc.StatusCode.INVALID_ARGUMENT, bad
    assert taken == [None], bad
  # A new layout is checked against the table by the general path first, then taken at once.
  taken.clear()
  for new_key in (100, 101):
    reply = _insert_stream_round_trip(server, {"ops": [dict(
        base, cols=[["<i4", [1]]], items=[[seq, "p", new_key, 0.25]])]})
    assert reply == {"upto": 1, "errs": []}
  assert taken == [None, 1]
  assert server.localhost_client().server_info()["p"].current_size == 4


def test_client_insert_waits_for_its_rate_limiter(server_factory):
  server = server_factory([reverb_shm.Table.queue("queue", 1)], bridge=BridgeConfig())
  client = _remote(server)
  client.insert(np.int32(0), {"queue": 1.0})
  done = threading.Event()
  t = threading.Thread(target=lambda: (client.insert(np.int32(1), {"queue": 1.0}), done.set()))
  t.start()
  assert not done.wait(0.3)          # blocked on the full queue, at the bridge
  local = server.localhost_client()
  assert int(next(local.sample("queue", emit_timesteps=False)).data[0][0]) == 0
  assert done.wait(10)
  t.join(timeout=10)
  assert int(next(local.sample("queue", emit_timesteps=False)).data[0][0]) == 1


def _reply_sizes(monkeypatch) -> list:
  """The list of the sample counts of every Sample reply the bridge sends from now on."""
  sizes = []
  original = service.Bridge._write_msg  # pylint: disable=protected-access

  async def spy(context, msg):
    sizes.append(msg["n"])
    await original(context, msg)
  monkeypatch.setattr(service.Bridge, "_write_msg", staticmethod(spy))  # pylint: disable=protected-access
  return sizes


def test_samples_arrive_in_batches_within_the_credit(server_factory, monkeypatch):
  server = server_factory([_uniform()], bridge=BridgeConfig())
  local = server.localhost_client()
  for i in range(50):
    local.insert(np.full(2, i), {"dist": 1.0})
  sizes = _reply_sizes(monkeypatch)
  client = _remote(server, max_in_flight_samples=8)
  samples = list(client.sample("dist", 40, emit_timesteps=False))
  assert len(samples) == 40 and sum(sizes) == 40
  assert max(sizes) <= 8 and len(sizes) < 20          # batched, never beyond the credit
  assert all(s.data[0].shape == (1, 2) and s.data[0][0, 0] == s.data[0][0, 1] for s in samples)
  keys = {s.info.key for s in samples}
  assert keys <= {int(k) for k in server.shared_table("dist").items()["key"]}


def test_sampling_stream_reconnects_after_a_bridge_restart(server_factory):
  server = server_factory([_uniform()])
  local = server.localhost_client()
  for i in range(10):
    local.insert(np.full(1, i), {"dist": 1.0})
  bridge = Bridge(server.name)
  port = bridge.port
  client = RemoteClient(bridge.address, reconnect_timeout_s=10.0, max_in_flight_samples=2)
  gen = client.sample("dist", 20, emit_timesteps=False)
  first = [next(gen) for _ in range(3)]
  bridge.stop()
  restarted = []

  def restart():
    time.sleep(0.3)
    restarted.append(Bridge(server.name, BridgeConfig(port=port)))
  t = threading.Thread(target=restart)
  t.start()
  try:
    rest = list(gen)
    t.join(timeout=10)
    assert len(first) + len(rest) == 20
    assert all(0 <= s.data[0][0, 0] < 10 for s in rest)
  finally:
    t.join(timeout=10)
    for b in restarted:
      b.stop()


def test_sampling_from_a_dead_bridge_raises_a_clear_error(server_factory):
  server = server_factory([_uniform()])
  server.localhost_client().insert(np.ones(1), {"dist": 1.0})
  bridge = Bridge(server.name)
  client = RemoteClient(bridge.address, reconnect_timeout_s=0.5, max_in_flight_samples=1)
  gen = client.sample("dist", 100, emit_timesteps=False)
  next(gen)
  bridge.stop()
  start = time.monotonic()
  with pytest.raises(errors.ServerUnavailableError, match="reconnect_timeout_s=0.5"):
    for _ in gen:
      pass
  assert time.monotonic() - start < 10


def test_staging_exhaustion_names_its_setting(server_factory):
  server = server_factory([_uniform()], bridge=BridgeConfig())
  writer = _remote(server, staging_bytes=2 << 20).trajectory_writer(1)
  with pytest.raises(errors.ResourceExhaustedError, match="REVERB_SHM_STAGING_MB.*staging_bytes"):
    writer.append({"x": np.zeros(1 << 20, np.float32)})   # 4 MiB > the 2 MiB staging arena
  writer.close()


def test_sample_replies_are_capped_in_bytes(server_factory, monkeypatch):
  server = server_factory([_uniform()], bridge=BridgeConfig(), arena_bytes=64 << 20)
  local = server.localhost_client()
  for i in range(4):
    local.insert(np.full(1 << 18, i, np.float32), {"dist": 1.0})   # 1 MiB items
  sizes = _reply_sizes(monkeypatch)
  samples = list(_remote(server).sample("dist", 40, emit_timesteps=False))
  assert len(samples) == 40 and sum(sizes) == 40
  assert max(sizes[1:]) <= 4          # ~4 MiB per reply once the item size is known
  assert all(s.data[0][0, 0] == s.data[0][0, -1] for s in samples)


def test_samples_of_mixed_layouts_are_gathered_in_runs(server_factory):
  server = server_factory([_uniform()], bridge=BridgeConfig())
  local = server.localhost_client()
  for i in range(20):
    local.insert(np.full(3, i, np.float32), {"dist": 1.0})
    local.insert(np.full(2, -i, np.int64), {"dist": 1.0})
  local.insert("text", {"dist": 1.0})
  seen = set()
  for s in _remote(server).sample("dist", 400, emit_timesteps=False):
    col = s.data[0]
    if col.dtype == np.float32:
      assert col.shape == (1, 3) and col.min() == col.max()
    elif col.dtype == np.int64:
      assert col.shape == (1, 2) and col.min() == col.max() <= 0
    else:
      assert col.tolist() == [b"text"]
    seen.add(col.dtype.kind)
  assert seen == {"f", "i", "O"}
  items = server.shared_table("dist").items()
  assert len(items) == 41 and int(items["times_sampled"].sum()) == 400


def test_fifo_order_is_kept_across_layouts_in_one_reply(server_factory):
  server = server_factory([reverb_shm.Table.queue("queue", 100)], bridge=BridgeConfig())
  local = server.localhost_client()
  for i in range(30):
    value = [np.float32(i), np.full(2, i), str(i)][i % 3]
    local.insert(value, {"queue": 1.0})
  got = [s.data[0][0] for s in _remote(server).sample("queue", 30, emit_timesteps=False)]
  assert [int(np.asarray(v).reshape(-1)[0]) for v in got] == list(range(30))


def test_a_c_gather_that_meets_another_layout_ends_and_the_rest_follows_in_order(
    server_factory, monkeypatch):
  """Once a one-layout reply taught the bridge the table's layout, replies are gathered in C;
  an item of another layout ends that gather and the rest of the reply is encoded layout by
  layout after it, in the sampler's order."""
  server = server_factory([reverb_shm.Table.queue("queue", 100)], bridge=BridgeConfig())
  local = server.localhost_client()
  joined = []
  original = service._joined_replies  # pylint: disable=protected-access
  monkeypatch.setattr(service, "_joined_replies",
                      lambda a, b: joined.append((a["n"], b["n"])) or original(a, b))
  for i in range(4):
    local.insert(np.full(2, i, np.float32), {"queue": 1.0})
  remote = _remote(server)
  first = [int(s.data[0][0, 0]) for s in remote.sample("queue", 2, emit_timesteps=False)]
  values = [np.full(2, 4, np.float32), np.full(2, 5, np.float32), np.full(3, 6),
            np.float32(7), np.full(2, 8, np.float32), "9"]
  for v in values:
    local.insert(v, {"queue": 1.0})
  got = [s.data[0][0] for s in remote.sample("queue", 8, emit_timesteps=False)]
  assert first == [0, 1]
  assert [int(np.asarray(v).reshape(-1)[0]) for v in got] == list(range(2, 10))
  assert joined and server.localhost_client().server_info()["queue"].current_size == 0


def test_writer_items_are_confirmed_without_flush(server_factory, monkeypatch):
  server = server_factory([_uniform()], bridge=BridgeConfig())
  acks = []
  original = writes.WriteSession._on_ack  # pylint: disable=protected-access
  monkeypatch.setattr(writes.WriteSession, "_on_ack",  # pylint: disable=protected-access
                      lambda self, stream, msg: (acks.append(msg), original(self, stream, msg)))
  writer = _remote(server).trajectory_writer(1)
  for i in range(1100):
    writer.append({"x": np.full(2, i, np.float32)})
    writer.create_item("dist", 1.0, {"x": writer.history["x"][-1:]})
  deadline = time.monotonic() + 5
  while writer.num_pending_items and time.monotonic() < deadline:
    time.sleep(0.01)    # the bridge confirms every 512 items or within 20 ms, unasked
  assert writer.num_pending_items == 0
  assert len(acks) < 100                                  # in batches, not per message
  assert server.localhost_client().server_info()["dist"].current_size == 1000   # max_size
  writer.close()


def _wait_for_size(server, table: str, size: int) -> int:
  deadline = time.monotonic() + 5
  while True:
    now = server.localhost_client().server_info()[table].current_size
    if now == size or time.monotonic() > deadline:
      return now
    time.sleep(0.01)


def test_remote_writer_batches_items_as_a_local_writer_does(server_factory, monkeypatch):
  server = server_factory([_uniform()], bridge=BridgeConfig())
  items_ops = []
  original = service._WriteStream.handle_message  # pylint: disable=protected-access

  def spy(self, msg):   # (items per message)
    ops = [msg] if "op" in msg else msg["ops"]
    items_ops.append(sum(len(op["descs"]) for op in ops if op["op"] in ("items", "itemrun")))
    return original(self, msg)
  monkeypatch.setattr(service._WriteStream, "handle_message", spy)  # pylint: disable=protected-access
  default = _remote(server).trajectory_writer(2)   # a remote writer sends batches of 64
  assert default._item_batch_size == 64  # pylint: disable=protected-access
  default.close()
  # item_batch_size 256, as a local writer's
  writer = reverb_shm.TrajectoryWriter(_remote(server), 2, item_batch_size=256)
  for i in range(300):
    writer.append({"x": np.full(2, i, np.float32)})
    if i:
      writer.create_item("dist", float(i), {"x": writer.history["x"][-2:]})
  # Batches of up to 256 items, each as one message, sent at a chunk boundary (here after 255
  # items: the 257th step opens the second 256-row chunk) or at 256 items; the last items wait
  # for flush.
  deadline = time.monotonic() + 5
  while sum(items_ops) < 255 and time.monotonic() < deadline:
    time.sleep(0.01)
  time.sleep(0.1)
  sent = sum(items_ops)
  assert sent in (255, 256) and len(items_ops) <= 3, items_ops
  assert _wait_for_size(server, "dist", sent) == sent
  writer.flush()
  assert sum(items_ops) == 299 and len(items_ops) <= 4, items_ops
  assert server.localhost_client().server_info()["dist"].current_size == 299
  got = {(s.info.priority, tuple(s.data[0][:, 0].tolist())) for s in
         server.localhost_client().sample("dist", 300, emit_timesteps=False)}
  assert got <= {(float(i), (i - 1.0, i)) for i in range(1, 300)} and len(got) > 100
  writer.close()
  # item_batch_size=1: every item leaves at once, without flush.
  one = reverb_shm.TrajectoryWriter(_remote(server), 1, item_batch_size=1)
  items_ops.clear()
  for i in range(3):
    one.append({"x": np.full(2, i, np.float32)})
    one.create_item("dist", 0.5, {"x": one.history["x"][-1:]})
    deadline = time.monotonic() + 5
    while sum(items_ops) < i + 1 and time.monotonic() < deadline:
      time.sleep(0.01)
  assert sum(items_ops) == 3
  one.close()


def test_a_burst_of_items_is_inserted_in_order_past_a_full_limiter(server_factory):
  server = server_factory([reverb_shm.Table.queue("queue", 5)], bridge=BridgeConfig())
  writer = _remote(server).trajectory_writer(1)
  for i in range(12):          # one burst: the bridge inserts 5 with one call, then waits
    writer.append({"x": np.full(2, i, np.float32)})
    writer.create_item("queue", 1.0, {"x": writer.history["x"][-1:]})
  got = []
  local = server.localhost_client()
  t = threading.Thread(target=lambda: got.extend(
      int(s.data[0][0, 0]) for s in local.sample("queue", 12, emit_timesteps=False,
                                                 rate_limiter_timeout_ms=10_000)))
  t.start()
  writer.flush(timeout_ms=10_000)
  t.join(timeout=20)
  assert got == list(range(12)) and writer.num_pending_items == 0
  writer.close()


def _remote_writer_with_batched_items(server, n_items: int):
  writer = _remote(server).trajectory_writer(2)
  for i in range(n_items + 1):
    writer.append({"x": np.full(2, i, np.float32)})
    if i:
      writer.create_item("dist", 1.0, {"x": writer.history["x"][-2:]})
  return writer


def _collect_in_thread(seconds: float) -> bool:
  collector = threading.Thread(target=gc.collect, daemon=True)
  collector.start()
  collector.join(seconds)
  return not collector.is_alive()


def test_unclosed_remote_writer_is_closed_by_its_finaliser_and_its_items_arrive(server_factory):
  """Its Write stream was opened with the writer, so the finaliser (maybe run by the cyclic
  collector) only sends on it: it never opens a stream, whose threads must not start there."""
  server = server_factory([_uniform()], bridge=BridgeConfig())
  writer = _remote_writer_with_batched_items(server, 4)
  assert server.localhost_client().server_info()["dist"].current_size == 0   # still batched
  del writer
  assert _collect_in_thread(10), "gc.collect() hung on an unclosed remote writer"
  assert _wait_for_size(server, "dist", 4) == 4     # its finaliser closed (flushed) it


def test_unclosed_remote_writer_collected_after_the_bridge_stopped_does_not_hang(server_factory):
  server = server_factory([_uniform()], bridge=BridgeConfig())
  writer = _remote_writer_with_batched_items(server, 2)
  server.stop()
  del writer
  assert _collect_in_thread(10), "gc.collect() hung on a remote writer of a stopped bridge"


def test_remote_writer_and_insert_carry_zero_element_columns(server_factory):
  """Rows of shape (0, 3) hold no bytes: the rows ops say how many rows they add ("n")."""
  server = server_factory([_uniform()], bridge=BridgeConfig())
  remote = _remote(server)
  remote.insert({"a": np.zeros((0, 3), np.float32), "b": np.int64(7)}, {"dist": 1.0})
  with remote.trajectory_writer(2) as writer:
    for i in range(3):
      writer.append({"a": np.zeros((0, 3), np.float32), "b": np.int64(i)})
      if i:
        writer.create_item("dist", 1.0, {"a": writer.history["a"][-2:],
                                         "b": writer.history["b"][-2:]})
  seen = {(s.data[0].shape, str(s.data[1].tolist())) for s in
          server.shared_table("dist").sample(60)}     # P(an item unseen) < 1e-7
  assert seen == {((1, 0, 3), "[7]"), ((2, 0, 3), "[0, 1]"), ((2, 0, 3), "[1, 2]")}


def _write_stream(server, ops_per_message: list) -> tuple:
  """Sends raw Write messages, then half-closes; returns (acks, status code)."""
  frames = [f for ops in ops_per_message for f in wire.frames(wire.pack({"ops": ops}))]
  acks = []
  with grpc.insecure_channel(server.bridge_address) as channel:
    call = channel.stream_stream(f"/{wire.SERVICE}/Write")(iter(frames), timeout=10)
    try:
      for reply in call:
        acks.append(wire.unpack(reply[1:]))
      return acks, grpc.StatusCode.OK
    except grpc.RpcError as e:
      return acks, e.code()


def test_an_itemrun_op_confirms_and_fails_its_items_one_by_one(server_factory):
  server = server_factory([reverb_shm.Table.queue("queue", 3)], bridge=BridgeConfig())
  chunk = {"op": "chunk", "id": 1, "d": "<i4", "s": [], "cap": 8, "ep": 1, "step": 0,
           "b": np.arange(8, dtype=np.int32).tobytes()}

  def run(seq, rows, table="queue"):
    return {"op": "itemrun", "seq": seq, "table": table,
            "keys": np.arange(100 + seq, 100 + seq + len(rows), dtype="<u8").tobytes(),
            "prios": np.ones(len(rows), "<f8").tobytes(),
            "descs": [[[[[1, row, 1]], True]] for row in rows]}
  # Two items in, an unknown table (each of its items fails), then two more of which the full
  # queue admits one: the other fails once the client closed its side.
  acks, code = _write_stream(server, [[chunk, run(1, [0, 1]), run(3, [2, 3], "nope"),
                                       run(5, [4, 5]), {"op": "sync"}]])
  assert code is grpc.StatusCode.OK
  errs = [e for ack in acks for e in ack["errs"]]
  assert acks[-1]["upto"] == 6
  assert [(e[0], e[2]) for e in errs] == [(3, "UnknownTableError"), (4, "UnknownTableError"),
                                          (6, "DeadlineExceededError")]
  local = server.localhost_client()
  assert [int(s.data[0]) for s in local.sample("queue", 3, emit_timesteps=False)] == [0, 1, 4]
  # An item over rows that were never sent ends the stream: nothing of that message goes in.
  acks, code = _write_stream(server, [[chunk, run(1, [0]), run(2, [9])]])
  assert code is grpc.StatusCode.INVALID_ARGUMENT
  assert local.server_info()["queue"].current_size == 0


def test_a_partly_confirmed_batch_is_resent_whole_after_a_bridge_restart(server_factory):
  """Six items leave as one batch; the full queue admits three (confirmed from the batch's
  front); the bridge restarts; the other three are re-sent (with their keys) and inserted."""
  server = server_factory([reverb_shm.Table.queue("queue", 3)])
  bridge = Bridge(server.name)
  port = bridge.port
  writer = RemoteClient(bridge.address, reconnect_timeout_s=10.0).trajectory_writer(1)
  try:
    for i in range(6):
      writer.append({"x": np.int32(i)})
      writer.create_item("queue", 1.0, {"x": writer.history["x"][-1]})
    with pytest.raises(errors.DeadlineExceededError):
      writer.flush(timeout_ms=300)
    assert writer.num_pending_items == 3
    bridge.stop()
    bridge = Bridge(server.name, BridgeConfig(port=port))
    local = server.localhost_client()
    first = [int(s.data[0]) for s in local.sample("queue", 3, emit_timesteps=False)]
    writer.flush(timeout_ms=10_000)
    rest = [int(s.data[0]) for s in local.sample("queue", 3, emit_timesteps=False)]
    assert first + rest == list(range(6))
  finally:
    writer.close()
    bridge.stop()
