"""TrajectoryWriter (SPEC §6 and "Our decisions" 3, 8, 14)."""
import collections
import gc
import threading
import time

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm.specs import TensorSpec
from reverb_shm.trajectory_writer import TrajectoryColumn

pytestmark = pytest.mark.timeout(60)


def _uniform(name="dist", max_size=1000, **kwargs):
  return reverb_shm.Table(name, selectors.Uniform(), selectors.Fifo(), max_size,
                          rate_limiters.MinSize(1), **kwargs)


@pytest.fixture
def server(server_factory):
  return server_factory([_uniform("dist"), _uniform("dist2"),
                         reverb_shm.Table.queue("queue", 1),
                         _uniform("sig", signature={"x": TensorSpec([2], np.float32)})])


@pytest.fixture
def client(server):
  return server.localhost_client()


@pytest.fixture
def writer(client):
  w = client.trajectory_writer(5)
  yield w
  w.close()


def _sample_all(client, table):
  """Every item of `table` (Uniform sampler, so sample until each key was seen)."""
  st = client.shared_table(table)
  n = st.size
  seen = {}
  while len(seen) < n:
    s = st.sample(1)[0]
    seen[s.info.key] = s
  return seen


# ---- append, union structure, partial steps

def test_history_before_append_raises_runtime_error(writer):
  with pytest.raises(RuntimeError):
    writer.history  # pylint: disable=pointless-statement


def test_union_structure_grows_with_fields_appearing_later(writer):
  writer.append({"a": np.float32(1)})
  writer.append({"a": np.float32(2), "b": {"c": np.int64(7)}})
  history = writer.history
  assert isinstance(history, dict) and set(history) == {"a", "b"}
  assert set(history["b"]) == {"c"}
  assert len(history["a"]) == 2 and len(history["b"]["c"]) == 2
  with pytest.raises(ValueError, match="None"):
    history["b"]["c"][0]  # the column did not exist at step 0
  assert history["b"]["c"][1].numpy() == 7
  writer.append({"b": {"c": np.int64(8)}})  # 'a' omitted this step
  with pytest.raises(ValueError, match="None"):
    writer.history["a"][2]
  np.testing.assert_array_equal(writer.history["a"][0:2].numpy(), [1, 2])


def test_column_histories_are_leaves_not_sequences(writer):
  writer.append({"a": np.zeros(2)})
  h = writer.history["a"]
  assert not isinstance(h, collections.abc.Sequence)
  assert not isinstance(h, (list, tuple))


def test_partial_step_fills_one_step_and_rejects_a_field_set_twice(writer):
  writer.append({"x": np.int64(1)}, partial_step=True)
  assert writer.episode_steps == 0
  with pytest.raises(ValueError, match=r"Field \('x',\) has already been set in the active step"):
    writer.append({"x": np.int64(4)}, partial_step=True)
  writer.append({"x": None, "y": np.float64(2.0)})
  assert writer.episode_steps == 1
  assert len(writer.history["x"]) == 1 and len(writer.history["y"]) == 1
  assert writer.history["x"][0].numpy() == 1 and writer.history["y"][0].numpy() == 2.0


def test_episode_steps_counts_complete_appends_and_resets(writer):
  for _ in range(3):
    writer.append([np.float32(0)])
  assert writer.episode_steps == 3
  writer.end_episode(clear_buffers=False)
  assert writer.episode_steps == 0
  assert len(writer.history[0]) == 3  # buffers kept
  writer.append([np.float32(0)])
  writer.end_episode()
  assert writer.episode_steps == 0 and len(writer.history[0]) == 0


def test_dtype_and_shape_errors_name_the_column_path(writer):
  writer.append({"nest": {"sub": np.float64(1)}, "scalar": np.float32(0)})
  with pytest.raises(ValueError, match=r"column \('nest', 'sub'\)\. Got int64 but expected float64"):
    writer.append({"nest": {"sub": np.int64(1)}, "scalar": np.float32(0)})
  with pytest.raises(ValueError, match=r"column \('scalar',\)\. Got \[2\] which is incompatible"):
    writer.append({"nest": {"sub": np.float64(1)}, "scalar": np.zeros(2, np.float32)})
  assert writer.episode_steps == 1 and len(writer.history["scalar"]) == 1  # nothing changed


def test_unsupported_dtype_is_rejected(writer):
  with pytest.raises(ValueError, match="Unsupported dtype"):
    writer.append({"t": np.array(["2020-01-01"], dtype="datetime64[D]")})


# ---- history indexing

def test_history_int_slice_and_list_indexing(writer):
  for i in range(4):
    writer.append({"x": np.int32(i)})
  h = writer.history["x"]
  col = h[1]
  assert col.is_squeezed and col.shape == () and col.numpy() == 1
  assert h[-1].numpy() == 3
  np.testing.assert_array_equal(h[0:4].numpy(), [0, 1, 2, 3])  # decision 14: all n steps
  np.testing.assert_array_equal(h[::2].numpy(), [0, 2])
  np.testing.assert_array_equal(h[[1, 0, 2]].numpy(), [1, 0, 2])
  np.testing.assert_array_equal(h[[0, 0, 1]].numpy(), [0, 0, 1])
  assert h[1:3].shape == (2,)
  with pytest.raises(TypeError):
    h["a"]  # pylint: disable=pointless-statement
  with pytest.raises(TypeError):
    h[1.0]  # pylint: disable=pointless-statement


def test_history_out_of_range_is_index_error(writer):
  writer.append({"x": np.int32(0)})
  writer.append({"x": np.int32(1)})
  h = writer.history["x"]
  for bad in (2, -3):
    with pytest.raises(IndexError):
      h[bad]  # pylint: disable=pointless-statement
  with pytest.raises(IndexError):
    h[-3:]  # pylint: disable=pointless-statement
  with pytest.raises(IndexError):
    h[[0, 5]]  # pylint: disable=pointless-statement


def test_expired_positions_are_none_and_refs_expire(client):
  writer = client.trajectory_writer(2)
  for i in range(3):
    writer.append({"x": np.int32(i)})
  h = writer.history["x"]
  np.testing.assert_array_equal(h[-2:].numpy(), [1, 2])
  with pytest.raises(ValueError, match="None"):
    h[:]  # pylint: disable=pointless-statement
  old = h[-2]
  writer.append({"x": np.int32(3)})
  ref = list(old)[0]
  assert ref.expired
  with pytest.raises(RuntimeError):
    old.numpy()
  with pytest.raises(ValueError, match="Error in column 0: Column contains expired CellRef"):
    writer.create_item("dist", 1.0, old)
  writer.close()


def test_trajectory_column_squeeze_needs_one_ref(writer):
  writer.append({"x": np.int32(0)})
  writer.append({"x": np.int32(1)})
  refs = list(writer.history["x"][0:2])
  with pytest.raises(ValueError):
    TrajectoryColumn(refs, squeeze=True)
  assert TrajectoryColumn(refs[:1], squeeze=True).numpy() == 0


# ---- create_item validation

def test_create_item_validation_errors(writer):
  writer.append({"x": np.float32(1), "y": np.zeros(3, np.float32)})
  h = writer.history
  with pytest.raises(ValueError, match="must not be empty"):
    writer.create_item("dist", 1.0, {})
  with pytest.raises(ValueError, match="nan"):
    writer.create_item("dist", float("nan"), h["x"][-1:])
  with pytest.raises(TypeError):
    writer.create_item("dist", 1.0, {"x": h["x"][-1:], "bad": np.zeros(1)})
  with pytest.raises(ValueError, match="'nope'.*could not be found") as info:
    writer.create_item("nope", 1.0, h["x"][-1:])
  assert "dist2" in str(info.value)
  with pytest.raises(ValueError, match="columns"):
    writer.create_item("sig", 1.0, {"x": h["y"][-1], "y": h["y"][-1]})
  with pytest.raises(ValueError, match="dtype|shape"):
    writer.create_item("sig", 1.0, {"x": h["y"][-1:]})  # shape [1, 3] vs [2]
  mixed = TrajectoryColumn(list(h["x"][-1:]) + list(h["y"][-1:]))
  with pytest.raises(ValueError, match="Error in column 0: Column contains mixed dtypes|shapes"):
    writer.create_item("dist", 1.0, mixed)
  assert writer.num_pending_items == 0
  assert writer._client.server_info()["dist"].current_size == 0  # pylint: disable=protected-access


def test_create_item_signature_match_is_accepted(client):
  writer = client.trajectory_writer(2)
  writer.append({"x": np.ones(2, np.float32)})
  writer.create_item("sig", 1.0, {"x": writer.history["x"][-1]})
  writer.flush(timeout_ms=1000)
  assert client.server_info()["sig"].current_size == 1
  writer.close()


def test_validate_items_false_skips_signature_check(client):
  writer = client.trajectory_writer(2, validate_items=False)
  writer.append({"x": np.ones(3, np.float64)})
  writer.create_item("sig", 1.0, {"x": writer.history["x"][-1]})
  writer.close()


def test_num_keep_alive_refs_must_be_positive(client):
  with pytest.raises(ValueError):
    client.trajectory_writer(0)


# ---- flush / end_episode / back-pressure

def test_flush_times_out_on_full_queue_table(client):
  writer = client.trajectory_writer(1)
  writer.append({"x": np.int32(0)})
  with pytest.raises(errors.DeadlineExceededError) as info:
    for _ in range(4):
      writer.create_item("queue", 1.0, writer.history["x"][:])
      writer.flush(timeout_ms=1)
  assert "queue" in str(info.value) and "inserts=1" in str(info.value)
  assert writer.num_pending_items >= 1
  with pytest.warns(RuntimeWarning, match="still held back"):
    writer.close(timeout_ms=0)   # the held-back items go on in the background


def test_flush_validates_arguments(writer):
  with pytest.raises(ValueError):
    writer.flush(-1)
  with pytest.raises(ValueError):
    writer.flush(timeout_ms=-1)


def test_flush_waits_for_a_sampler_to_make_room(client):
  writer = client.trajectory_writer(1)
  writer.append({"x": np.int32(0)})
  writer.create_item("queue", 1.0, writer.history["x"][:])
  writer.create_item("queue", 1.0, writer.history["x"][:])
  assert writer.num_pending_items == 1
  sampled = []
  t = threading.Thread(target=lambda: sampled.extend(client.sample("queue", 2)))
  t.start()
  writer.flush(timeout_ms=10_000)
  t.join(timeout=10)
  assert not t.is_alive() and len(sampled) == 2
  assert writer.num_pending_items == 0
  writer.close()


def test_flush_block_until_num_items_leaves_that_many_queued(client):
  writer = client.trajectory_writer(1)
  writer.append({"x": np.int32(0)})
  for _ in range(3):
    writer.create_item("queue", 1.0, writer.history["x"][:])
  assert writer.num_pending_items == 2
  writer.flush(2, timeout_ms=0)
  with pytest.raises(errors.DeadlineExceededError):
    writer.flush(1, timeout_ms=5)
  with pytest.warns(RuntimeWarning, match="2 items are still held back"):
    writer.close(timeout_ms=0)   # they go on in the background (test_reverb_compat.py)


def test_end_episode_timeout_still_ends_the_episode(client):
  writer = client.trajectory_writer(2)
  writer.append({"x": np.int32(0)})
  writer.create_item("queue", 1.0, writer.history["x"][-1:])
  writer.create_item("queue", 1.0, writer.history["x"][-1:])
  with pytest.raises(errors.DeadlineExceededError, match="ended anyway"):
    writer.end_episode(timeout_ms=5)
  assert writer.episode_steps == 0 and len(writer.history["x"]) == 0
  assert writer.num_pending_items == 1  # still queued
  next(client.sample("queue"))
  writer.append({"x": np.int32(1)})
  writer.end_episode(timeout_ms=1000)    # the queued item goes in now
  assert writer.num_pending_items == 0
  assert client.server_info()["queue"].current_size == 1
  writer.close()


def test_end_episode_uses_a_new_episode_id(client, writer):
  for episode in range(2):
    writer.append({"x": np.int32(episode)})
    writer.create_item("dist", 1.0, writer.history["x"][-1:])
    writer.end_episode()
  assert client.server_info()["dist"].num_episodes == 2


def test_configure_validation_and_chunk_length(client, writer):
  with pytest.raises(ValueError):
    writer.configure(("x",), num_keep_alive_refs=0, max_chunk_length=None)
  with pytest.raises(ValueError):
    writer.configure(("x",), num_keep_alive_refs=2, max_chunk_length=3)
  with pytest.raises(ValueError):
    writer.configure(("x",), num_keep_alive_refs=2, max_chunk_length=0)
  writer.configure(("x",), num_keep_alive_refs=8, max_chunk_length=2)
  assert writer.max_num_keep_alive_refs == 8
  seg = client._segment()  # pylint: disable=protected-access
  before = seg.info()["num_chunks"]
  for i in range(5):
    writer.append({"x": np.int32(i)})
  assert seg.info()["num_chunks"] - before == 3  # 5 rows in chunks of 2
  np.testing.assert_array_equal(writer.history["x"][:].numpy(), np.arange(5))  # 8 kept alive
  writer.create_item("dist", 1.0, writer.history["x"][:])
  writer.flush()
  (item,) = _sample_all(client, "dist").values()
  np.testing.assert_array_equal(item.data[0], np.arange(5))  # three slices, one column


def test_close_is_idempotent_and_later_calls_fail(client):
  writer = client.trajectory_writer(1)
  writer.append({"x": np.int32(0)})
  writer.close()
  writer.close()
  with pytest.raises(RuntimeError):
    writer.append({"x": np.int32(1)})


def test_close_releases_every_chunk(client):
  seg = client._segment()  # pylint: disable=protected-access
  writer = client.trajectory_writer(3)
  for i in range(10):
    writer.append({"x": np.full(100, i, np.float64), "s": f"step{i}"})
  writer.create_item("dist", 1.0, {"x": writer.history["x"][-2:]})
  writer.close()
  info = seg.info()
  assert info["num_chunks"] == 1 and info["num_descs"] == 1  # only what the item references
  client.reset("dist")
  assert seg.info()["num_chunks"] == 0


def test_context_manager_flushes(client):
  with client.trajectory_writer(1) as writer:
    writer.append({"x": np.int32(0)})
    writer.create_item("dist", 1.0, writer.history["x"][-1])
  assert writer.num_pending_items == 0
  writer.close()


def test_del_after_server_stop_returns_promptly(server_factory):
  gc.collect()   # (earlier tests' garbage is not this writer's to finalise within the bound)
  server = server_factory([reverb_shm.Table.queue("queue", 1)])
  client = server.localhost_client()
  writer = client.trajectory_writer(1)
  writer.append({"x": np.int32(0)})
  writer.create_item("queue", 1.0, writer.history["x"][:])
  writer.create_item("queue", 1.0, writer.history["x"][:])  # queued behind the limiter
  server.stop()
  start = time.monotonic()
  # (the cause is the stopped server, not the limiter that held the item back)
  with pytest.warns(RuntimeWarning,
                    match=r"2 items that could not be inserted \(TableClosedError: .*stopped"):
    del writer
    gc.collect()
  assert time.monotonic() - start < 2.0


def test_flush_after_server_stop_raises_promptly(server_factory):
  server = server_factory([reverb_shm.Table.queue("queue", 1)])
  writer = server.localhost_client().trajectory_writer(1)
  writer.append({"x": np.int32(0)})
  writer.create_item("queue", 1.0, writer.history["x"][:])
  writer.create_item("queue", 1.0, writer.history["x"][:])
  server.stop()
  with pytest.raises(errors.TableClosedError):
    writer.flush()
  with pytest.warns(RuntimeWarning, match=r"could not be inserted \(TableClosedError: .*closed"):
    writer.close()


# ---- data correctness

def test_n_step_transitions_sample_back_exact_values(client):
  writer = client.trajectory_writer(3)
  rng = np.random.default_rng(0)
  obs = rng.normal(size=(20, 4)).astype(np.float32)
  expected = {}
  for t in range(20):
    writer.append({"obs": obs[t], "reward": np.float64(t), "step": np.int64(t)})
    if t >= 2:
      h = writer.history
      writer.create_item("dist", 1.0, {"obs": h["obs"][-3:], "reward": h["reward"][-3:-1],
                                       "first": h["step"][-3]})
      expected[t - 2] = (obs[t - 2:t + 1], np.arange(t - 2, t, dtype=np.float64))
  writer.end_episode()
  writer.close()
  items = _sample_all(client, "dist")
  assert len(items) == 18
  for sample in items.values():
    first, o, r = sample.data  # flatten order: first, obs, reward
    assert first.shape == () and first.dtype == np.int64
    exp_obs, exp_r = expected[int(first)]
    np.testing.assert_array_equal(o, exp_obs)
    np.testing.assert_array_equal(r, exp_r)


def test_items_spanning_two_chunks_read_back_contiguously(client):
  writer = client.trajectory_writer(10)
  writer.configure(("x",), num_keep_alive_refs=10, max_chunk_length=3)
  for i in range(7):
    writer.append({"x": np.full(2, i, np.int16)})
  writer.create_item("dist", 1.0, writer.history["x"][1:6])   # rows from chunks 0, 1 and 2
  writer.flush()
  (item,) = _sample_all(client, "dist").values()
  np.testing.assert_array_equal(item.data[0], np.repeat(np.arange(1, 6), 2).reshape(5, 2))
  writer.close()


def test_string_columns_round_trip(client, writer):
  writer.append({"s": "a", "b": b"\x01"})
  writer.append({"s": "bc", "b": b"\x02"})
  assert writer.history["s"][0].numpy() == b"a"
  writer.create_item("dist", 1.0, {"s": writer.history["s"][:], "b": writer.history["b"][-1]})
  writer.flush()
  (item,) = _sample_all(client, "dist").values()
  b, s = item.data
  assert b == b"\x02" and s.tolist() == [b"a", b"bc"]


def test_extend_and_create_items_batched_fast_path(client, writer):
  steps = {"obs": np.arange(12, dtype=np.float32).reshape(6, 2), "a": np.arange(6)}
  writer.extend(steps)
  assert writer.episode_steps == 6
  h = writer.history
  writer.create_items("dist", [1.0, 2.0], [{"obs": h["obs"][2:4], "a": h["a"][3]},
                                           {"obs": h["obs"][4:6], "a": h["a"][5]}])
  items = _sample_all(client, "dist")
  by_a = {int(s.data[0]): s for s in items.values()}
  np.testing.assert_array_equal(by_a[3].data[1], [[4, 5], [6, 7]])
  np.testing.assert_array_equal(by_a[5].data[1], [[8, 9], [10, 11]])
  assert by_a[5].info.priority == 2.0
  with pytest.raises(ValueError, match="leading dim"):
    writer.extend({"obs": np.zeros((2, 2), np.float32), "a": np.arange(3)})
  with pytest.raises(ValueError):
    writer.create_items("dist", [1.0], [])
  writer.append({"obs": np.zeros(2, np.float32), "a": np.int64(0)}, partial_step=True)
  with pytest.raises(ValueError, match="partial"):
    writer.extend(steps)


def test_create_item_with_unknown_field_types_in_namedtuple_structure(writer):
  Step = collections.namedtuple("Step", ["obs", "act"])
  writer.append(Step(np.zeros(2), np.int64(1)))
  history = writer.history
  assert isinstance(history, Step)
  writer.create_item("dist", 1.0, Step(history.obs[-1:], history.act[-1]))
  writer.flush()


def test_unclosed_writer_collected_in_a_reference_cycle_inserts_its_batched_items(
    server_factory):
  """A writer dropped without close() is closed by its finaliser, like Reverb's. Writers sit in
  reference cycles (columns point back at them), so the cyclic collector finalises them together
  with the chunks they hold: those chunks' pins must outlive the writer's own finaliser, or its
  batched items are lost (they were, before: size 0)."""
  server = server_factory([_uniform()])

  def write_and_drop():
    writer = server.localhost_client().trajectory_writer(2)
    for i in range(5):
      writer.append({"x": np.full(2, i, np.float32)})
      if i:
        writer.create_item("dist", float(i), {"x": writer.history["x"][-2:]})
    assert server.localhost_client().server_info()["dist"].current_size == 0   # batched
  write_and_drop()
  gc.collect()
  items = server.shared_table("dist").items()
  assert sorted(items["priority"].tolist()) == [1.0, 2.0, 3.0, 4.0]
  server.shared_table("dist").reset()
  gc.collect()
  assert server.shared_table("dist").segment.info()["arena_used"] == 0   # no pin left behind
