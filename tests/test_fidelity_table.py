"""SPEC §2-§5 behaviours not pinned elsewhere: TableInfo, replace, re-insert, reset, flexible
batch, sample unpacking, signatures and specs."""
import dataclasses
import threading
import time

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm import table as table_lib
from reverb_shm.specs import TensorSpec

pytestmark = pytest.mark.timeout(60)


def _table(name="t", sampler=None, remover=None, max_size=10, limiter=None, **kwargs):
  return reverb_shm.Table(name, sampler or selectors.Fifo(), remover or selectors.Fifo(),
                          max_size, limiter or rate_limiters.MinSize(1), **kwargs)


def test_table_info_has_reverbs_fields_in_order():
  assert [f.name for f in dataclasses.fields(reverb_shm.TableInfo)] == [
      "name", "sampler_options", "remover_options", "max_size", "max_times_sampled",
      "rate_limiter_info", "signature", "current_size", "num_episodes", "num_deleted_episodes",
      "num_unique_samples", "table_worker_time"]
  assert [f.name for f in dataclasses.fields(table_lib.TableWorkerTime)] == [
      "running_ms", "sampling_ms", "inserting_ms", "sleeping_ms", "waiting_for_sampling_ms",
      "waiting_for_inserts_ms"]
  assert [f.name for f in dataclasses.fields(table_lib.RateLimiterInfo)] == [
      "samples_per_insert", "min_diff", "max_diff", "min_size_to_sample", "insert_stats",
      "sample_stats"]


@pytest.mark.parametrize("selector, field, deterministic", [
    (selectors.Fifo(), "fifo", True), (selectors.Lifo(), "lifo", True),
    (selectors.Uniform(), "uniform", False), (selectors.Prioritized(0.7), "prioritized", False),
    (selectors.MinHeap(), "heap", True), (selectors.MaxHeap(), "heap", True)])
def test_selector_options_report_kind_and_determinism(server_factory, selector, field,
                                                      deterministic):
  table = _table(sampler=selector, remover=selector)
  server_factory([table])
  for options in (table.info.sampler_options, table.info.remover_options):
    assert options.HasField(field) and options.is_deterministic is deterministic
    assert sum(options.HasField(f) for f in ("fifo", "lifo", "uniform", "prioritized",
                                             "heap")) == 1
    assert options.WhichOneof("distribution") == field   # (the proto's accessor)
  if field == "prioritized":
    assert table.info.sampler_options.prioritized.priority_exponent == 0.7
  if field == "heap":
    assert table.info.sampler_options.heap.min_heap is isinstance(selector, selectors.MinHeap)


def test_table_info_counters_signature_and_worker_time(server_factory):
  sig = {"x": TensorSpec([], np.int64)}
  table = _table(max_size=2, max_times_sampled=1, signature=sig,
                 limiter=rate_limiters.SampleToInsertRatio(1.0, 1, 10.0))
  client = server_factory([table]).localhost_client()
  for i in range(3):                   # the third evicts the first (Fifo remover)
    client.insert({"x": np.int64(i)}, {"t": 1.0})
  next(client.sample("t", 1))          # sampled once -> removed
  info = client.server_info()["t"]
  assert (info.current_size, info.num_episodes, info.num_deleted_episodes,
          info.num_unique_samples) == (1, 1, 2, 1)
  rli = info.rate_limiter_info
  assert (rli.samples_per_insert, rli.min_size_to_sample, rli.min_diff, rli.max_diff) == (
      1.0, 1, -9.0, 11.0)
  assert (rli.insert_stats.completed, rli.sample_stats.completed) == (3, 1)
  # (tf.TensorSpecs once another test has imported TensorFlow, as dm-reverb returns them)
  assert reverb_shm.specs.validate_signature(info.signature) == sig
  assert info.max_times_sampled == 1 and info.max_size == 2
  wt = info.table_worker_time
  assert all(isinstance(getattr(wt, f.name), int) and getattr(wt, f.name) >= 0
             for f in dataclasses.fields(wt))


def test_replace_builds_a_new_empty_table_with_a_base_rate_limiter(server_factory):
  table = _table(sampler=selectors.Prioritized(0.5), remover=selectors.MinHeap(), max_size=7,
                 max_times_sampled=3, limiter=rate_limiters.SampleToInsertRatio(2.0, 3, 5.0),
                 signature={"x": TensorSpec([2], np.float32)})
  server_factory([table]).localhost_client().insert({"x": np.zeros(2, np.float32)}, {"t": 1.0})
  copy = table.replace(max_size=9)
  assert copy is not table and copy.info.current_size == 0
  assert (copy.name, copy.sampler, copy.remover, copy.max_size, copy.max_times_sampled) == (
      "t", selectors.Prioritized(0.5), selectors.MinHeap(), 9, 3)
  assert type(copy.rate_limiter) is rate_limiters.RateLimiter
  assert copy.rate_limiter == rate_limiters.RateLimiter(2.0, 3, 1.0, 11.0)
  assert copy.signature == table.signature
  assert table.replace(name="u", signature=None).name == "u"


def test_negative_max_times_sampled_is_unlimited_and_reported_as_given(server_factory, tmp_path):
  """dm-reverb keeps max_times_sampled < 1 as given (it means unlimited): server_info, a
  checkpoint and replace() report the same number."""
  table = _table(max_times_sampled=-3)
  assert table.info.max_times_sampled == -3
  checkpointer = reverb_shm.checkpointers.DefaultCheckpointer(str(tmp_path))
  server = server_factory([table], checkpointer=checkpointer)
  client = server.localhost_client()
  client.insert(np.int64(1), {"t": 1.0})
  assert [s[0].info.times_sampled for s in client.sample("t", 4)] == [1, 2, 3, 4]
  info = client.server_info()["t"]
  assert (info.max_times_sampled, info.current_size) == (-3, 1)
  client.checkpoint()
  server.stop()
  restored = _table(max_times_sampled=-3)
  client = server_factory([restored], checkpointer=checkpointer).localhost_client()
  assert (client.server_info()["t"].max_times_sampled, client.server_info()["t"].current_size) == (
      -3, 1)
  assert restored.replace().max_times_sampled == -3


def test_a_stopped_servers_table_reports_its_last_state_until_reused(server_factory):
  """As dm-reverb's Table object does after Server.stop(): info and the limiter predicates
  answer from the table's last state (here 3 inserts, 2 samples, 1 item removed after its
  second sample); a new server starts it empty."""
  table = _table(max_times_sampled=2, limiter=rate_limiters.RateLimiter(1.0, 2, -1.0, 3.0))
  server = server_factory([table])
  client = server.localhost_client()
  for i in range(3):
    client.insert(np.int64(i), {"t": 1.0})
  assert [s.info.times_sampled for s in client.sample("t", 2, emit_timesteps=False)] == [1, 2]
  server.stop()
  info = table.info
  assert (info.current_size, info.num_episodes, info.num_deleted_episodes,
          info.num_unique_samples) == (2, 2, 1, 1)
  assert (info.rate_limiter_info.insert_stats.completed,
          info.rate_limiter_info.sample_stats.completed) == (3, 2)
  assert [table.can_sample(n) for n in (1, 2, 3)] == [True, True, False]
  assert [table.can_insert(n) for n in (1, 2, 3)] == [True, True, False]
  server_factory([table])
  assert table.info.current_size == 0 and table.can_insert(1) and not table.can_sample(1)


def test_reinserting_an_existing_key_updates_its_priority_only(server_factory):
  table = _table(sampler=selectors.MaxHeap())
  st = server_factory([table]).shared_table("t")
  st.insert({"x": np.array([10, 20])}, [1.0, 2.0], keys=np.array([5, 6], np.uint64))
  st.insert({"x": np.array([99])}, [3.0], keys=np.array([5], np.uint64))
  info = table.info
  assert info.current_size == 2 and info.rate_limiter_info.insert_stats.completed == 2
  sample = st.sample(1)[0]
  assert (sample.info.key, sample.info.priority) == (5, 3.0)
  assert sample.data[0] == 10           # the item keeps its data


def test_reset_unblocks_a_blocked_insert(server_factory):
  table = reverb_shm.Table.queue("q", 1)
  client = server_factory([table]).localhost_client()
  client.insert(np.int64(0), {"q": 1.0})
  assert not table.can_insert(1)
  done = threading.Event()
  thread = threading.Thread(target=lambda: (client.insert(np.int64(1), {"q": 1.0}), done.set()),
                            daemon=True)
  thread.start()
  assert not done.wait(0.3)            # blocked: the queue is full
  client.reset("q")
  assert done.wait(5)
  assert table.info.current_size == 1 and table.info.rate_limiter_info.insert_stats.completed == 1


def test_flexible_batch_returns_a_partial_batch_at_the_deadline(server_factory):
  st = server_factory([_table(max_times_sampled=1)]).shared_table("t")
  st.insert({"x": np.arange(2.0)}, 1.0)
  start = time.monotonic()
  batch = st.sample_batch(5, timeout_ms=200)
  assert 0.15 < time.monotonic() - start < 5
  assert batch.info.key.shape == (2,) and sorted(batch.data[0].tolist()) == [0.0, 1.0]
  with pytest.raises(errors.DeadlineExceededError):
    st.sample_batch(5, timeout_ms=50)   # nothing at all: an error, not an empty batch


def test_sample_unpacks_to_the_signature_both_ways(server_factory):
  sig = {"obs": TensorSpec([None, 2], np.float32), "a": TensorSpec([None], np.int32)}
  client = server_factory([_table(signature=sig)]).localhost_client()
  with client.trajectory_writer(2) as writer:
    for t in range(2):
      writer.append({"obs": np.full(2, t, np.float32), "a": np.int32(t)})
    writer.create_item("t", 1.0, {"a": writer.history["a"][:], "obs": writer.history["obs"][:]})
  flat = next(client.sample("t", emit_timesteps=False))
  assert [x.shape for x in flat.data] == [(2,), (2, 2)]          # nest-flatten order: a, obs
  nested = next(client.sample("t", emit_timesteps=False, unpack_as_table_signature=True))
  assert nested.data["obs"].tolist() == [[0, 0], [1, 1]] and nested.data["a"].tolist() == [0, 1]
  steps = next(client.sample("t", emit_timesteps=True, unpack_as_table_signature=True))
  assert len(steps) == 2 and steps[1].data["obs"].tolist() == [1, 1] and steps[1].data["a"] == 1


def test_signature_rejects_non_matching_items_from_every_writer(server_factory):
  sig = {"obs": TensorSpec([None, 2], np.float32)}
  client = server_factory([_table(signature=sig)]).localhost_client()
  writer = client.trajectory_writer(2)
  writer.append({"obs": np.zeros(3, np.float32)})
  with pytest.raises(ValueError, match="shape"):
    writer.create_item("t", 1.0, {"obs": writer.history["obs"][-1:]})
  legacy = client.writer(1)
  legacy.append({"obs": np.zeros(2, np.float64)})
  with pytest.raises(ValueError, match="dtype"):
    legacy.create_item("t", 1, 1.0)
  writer.close()
  legacy.close()
  assert client.server_info()["t"].current_size == 0


def test_specs_answer_is_compatible_with_for_numpy_arrays():
  spec = TensorSpec([None, 3], np.float32)
  assert spec.is_compatible_with(np.zeros((5, 3), np.float32))
  assert not spec.is_compatible_with(np.zeros((5, 4), np.float32))
  assert not spec.is_compatible_with(np.zeros((5, 3), np.float64))
  assert TensorSpec([], np.bool_).is_compatible_with(np.array(True))


def test_specs_answer_is_compatible_with_for_tensorflow_tensors():
  tf = pytest.importorskip("tensorflow")
  spec = TensorSpec([None, 3], np.float32)
  assert spec.is_compatible_with(tf.zeros([2, 3], tf.float32))
  assert not spec.is_compatible_with(tf.zeros([2, 3], tf.int32))
  assert reverb_shm.specs.as_spec(tf.TensorSpec([2], tf.bool)) == TensorSpec([2], np.bool_)
