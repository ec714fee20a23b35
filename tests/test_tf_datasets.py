"""Reverb's TensorFlow surface (reverb_shm.tf, the `tf` extra): TrajectoryDataset,
TimestepDataset, TFClient, and TableInfo signatures as tf.TensorSpecs.

Behaviour compared with dm-reverb 0.14's (its source and runs in the `reverb` peer venv): element
structure ReplaySample(info, data) with info dtypes uint64/float64/int64/float64/int32, argument
checks, end of sequence at the rate limiter timeout, errors for items that do not match.
"""
import collections
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import reverb_shm as reverb

tf = pytest.importorskip("tensorflow")

SIG = {"a": tf.TensorSpec([3, 2], tf.float32), "b": tf.TensorSpec([3], tf.int64)}


def _server(table_kwargs=None, signature=SIG, name="t"):
  kw = dict(sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(), max_size=1000,
            rate_limiter=reverb.rate_limiters.MinSize(1), signature=signature)
  kw.update(table_kwargs or {})
  return reverb.Server([reverb.Table(name, **kw)])


def _fill(client, n, table="t"):
  """Items of 3 steps: step i holds a = [i, i], b = i; item j = steps j..j+2."""
  with client.trajectory_writer(3) as w:
    for i in range(n + 2):
      w.append({"a": np.full(2, i, np.float32), "b": np.int64(i)})
      if i >= 2:
        w.create_item(table, 1.0 + i, {"a": w.history["a"][-3:], "b": w.history["b"][-3:]})


@pytest.fixture
def filled():
  server = _server()
  client = reverb.Client(f"localhost:{server.port}")
  _fill(client, 10)
  yield server, f"localhost:{server.port}", client
  server.stop()


@pytest.mark.parametrize("name", ["TFClient", "TimestepDataset", "TrajectoryDataset"])
def test_reverb_tensorflow_names_resolve(name):
  from reverb_shm import tf as tf_lib  # pylint: disable=g-import-not-at-top
  assert getattr(reverb, name) is getattr(tf_lib, name)


def test_import_never_loads_tensorflow_and_names_need_the_extra():
  code = ("import sys; import reverb_shm\n"
          "assert 'tensorflow' not in sys.modules\n"
          "sys.modules['tensorflow'] = None   # as if not installed\n"
          "try:\n  reverb_shm.TrajectoryDataset\nexcept ImportError as e:\n  print(e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  assert "pip install reverb_shm[tf]" in out.stdout


def test_signature_is_tf_tensor_spec_once_tensorflow_is_imported(filled):
  _, address, client = filled
  sig = client.server_info()["t"].signature
  assert sig == SIG and all(type(s) is tf.TensorSpec for s in sig.values())
  code = ("import sys, reverb_shm\n"
          f"s = reverb_shm.Client({address!r}).server_info()['t'].signature\n"
          "assert 'tensorflow' not in sys.modules\n"
          "assert s['a'] == reverb_shm.TensorSpec([3, 2], 'float32'), s\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr


def test_bounded_and_string_signatures_convert():
  from tensorflow.python.framework import tensor_spec  # pylint: disable=g-import-not-at-top
  sig = {"x": tensor_spec.BoundedTensorSpec([2], tf.int32, 0, 5), "s": tf.TensorSpec([], tf.string)}
  server = _server(signature=sig)
  try:
    got = reverb.Client(f"localhost:{server.port}").server_info()["t"].signature
    assert got == sig and type(got["x"]) is tensor_spec.BoundedTensorSpec
  finally:
    server.stop()


def test_trajectory_dataset_elements(filled):
  _, address, _ = filled
  ds = reverb.TrajectoryDataset.from_table_signature(address, "t", 10, max_samples=20)
  assert isinstance(ds, tf.data.Dataset)
  spec = ds.element_spec
  assert isinstance(spec, reverb.ReplaySample) and isinstance(spec.info, reverb.SampleInfo)
  assert [s.dtype for s in spec.info] == [tf.uint64, tf.float64, tf.int64, tf.float64, tf.int32]
  assert all(s.shape == [] for s in spec.info)
  assert spec.data == SIG
  elements = list(ds)
  assert len(elements) == 20
  for e in elements:
    b = e.data["b"].numpy()
    first = int(b[0])
    np.testing.assert_array_equal(b, [first, first + 1, first + 2])
    np.testing.assert_array_equal(e.data["a"].numpy(), np.repeat(b[:, None], 2, 1))
    assert e.info.table_size.numpy() == 10
    assert e.info.probability.numpy() == pytest.approx(0.1)
    assert e.info.priority.numpy() == 1.0 + first + 2
    assert e.info.times_sampled.numpy() >= 1


def test_batch_gives_what_unbatched_elements_batched_give(filled):
  _, address, _ = filled
  ds = reverb.TrajectoryDataset.from_table_signature(address, "t", 3, max_samples=10)
  assert [len(x.info.key) for x in ds.batch(4)] == [4, 4, 2]
  dropped = ds.batch(4, drop_remainder=True)
  assert dropped.element_spec.data["a"].shape == [4, 3, 2]
  assert dropped.element_spec.info.key.shape == [4]
  assert [len(x.info.key) for x in dropped] == [4, 4]
  plain = tf.data.Dataset.batch(ds, 4)   # tf.data's own batch of the same elements
  assert plain.element_spec == ds.batch(4).element_spec


def test_batch_hands_out_whole_gathers_in_order():
  """Gathers of 8 items and batches of 4 (two batches per gather, the path T1 takes), and
  gathers of 6 (batches across gathers): the queue's order, each item once, the rest last."""
  for in_flight in (8, 6):
    server, address = _queue_of(22)
    try:
      ds = reverb.TrajectoryDataset(address, "q", (tf.int64,), (tf.TensorShape([1]),), in_flight,
                                    rate_limiter_timeout_ms=100)
      batches = [x.data[0].numpy()[:, 0].tolist() for x in ds.batch(4)]
      assert [len(b) for b in batches] == [4, 4, 4, 4, 4, 2]
      assert sum(batches, []) == list(range(22))
    finally:
      server.stop()


NT = collections.namedtuple("NT", "y x")
NEST_DTYPES = {"z": tf.int64, "a": (tf.float32, NT(tf.int32, tf.int64))}
NEST_SHAPES = {"z": tf.TensorShape([1]), "a": (tf.TensorShape([1, 2]), NT(tf.TensorShape([1]),
                                                                        tf.TensorShape([1, 3])))}


def _nested_queues(n):
  server = reverb.Server([reverb.Table.queue("q1", 100), reverb.Table.queue("q2", 100)])
  client = reverb.Client(f"localhost:{server.port}")
  for i in range(n):
    data = {"z": np.int64(i), "a": (np.full(2, i, np.float32),
                                    NT(np.int32(-i), np.arange(i, i + 3, dtype=np.int64)))}
    client.insert(data, {"q1": 1.0, "q2": 1.0})
  return server, f"localhost:{server.port}"   # (an insert adds a time dim of 1)


def _same_elements(ours, theirs):
  """Same nests (types, dict key order), dtypes, shapes and values; keys come from two tables,
  so only their dtype and shape are compared."""
  tf.nest.assert_same_structure(ours, theirs, check_types=True)
  assert repr(tf.nest.map_structure(lambda _: 0, ours)) == repr(
      tf.nest.map_structure(lambda _: 0, theirs))   # (dict key order too)
  for path, (a, b) in enumerate(zip(tf.nest.flatten(ours), tf.nest.flatten(theirs))):
    assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape, path
    if path:   # (0: the key)
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_iterators_give_tf_datas_own_elements():
  """iter() of a dataset and of its .batch(n) returns a tf.data.Iterator (a faster one) whose
  elements are those of tf.data's own iterator over the same items, nests and all; also
  through as_numpy_iterator and inside a tf.function (tf.data's own path)."""
  from reverb_shm.tf import _iterator  # pylint: disable=g-import-not-at-top
  server, address = _nested_queues(12)
  try:
    def dataset(table):
      return reverb.TrajectoryDataset(address, table, NEST_DTYPES, NEST_SHAPES, 4,
                                      rate_limiter_timeout_ms=100)
    for make in (lambda t: dataset(t), lambda t: dataset(t).batch(3),
                 lambda t: dataset(t).batch(5, drop_remainder=True)):
      ours, theirs = iter(make("q1")), tf.data.Dataset.__iter__(make("q2"))
      assert type(ours) is _iterator.Iterator and isinstance(ours, tf.data.Iterator)
      assert type(theirs) is not _iterator.Iterator
      pairs = list(zip(ours, theirs))
      assert len(pairs) in (12, 4, 2)
      for a, b in pairs:
        _same_elements(a, b)
      assert int(np.ravel(pairs[-1][0].data["z"].numpy())[-1]) == (11 if len(pairs) != 2 else 9)
      server.stop()
      server, address = _nested_queues(12)
    got = list(dataset("q1").batch(6).as_numpy_iterator())
    assert [b.data["z"].ravel().tolist() for b in got] == [list(range(6)), list(range(6, 12))]
    assert got[0].data["a"][1].x.shape == (6, 1, 3) and isinstance(got[0].data["a"][1], NT)

    @tf.function
    def first_batch_sum():
      it = iter(dataset("q2").batch(4))
      return tf.reduce_sum(next(it).data["z"])
    assert int(first_batch_sum()) == 0 + 1 + 2 + 3
  finally:
    server.stop()


def test_packer_nests_as_tf_nest():
  from tensorflow.python.data.util import structure  # pylint: disable=g-import-not-at-top
  from reverb_shm.tf import _iterator  # pylint: disable=g-import-not-at-top
  spec = tf.nest.map_structure(tf.TensorSpec, NEST_SHAPES, NEST_DTYPES)
  spec = reverb.ReplaySample(reverb.SampleInfo(*[tf.TensorSpec([], tf.int64)] * 5), spec)
  for s in (spec, tf.TensorSpec([2], tf.float32), (tf.TensorSpec([], tf.int8),)):
    flat = [tf.fill(x.shape, tf.cast(i, x.dtype)) for i, x in enumerate(tf.nest.flatten(s))]
    ours, theirs = _iterator.packer(s)(flat), structure.from_compatible_tensor_list(s, flat)
    tf.nest.assert_same_structure(ours, theirs, check_types=True)
    assert repr(tf.nest.map_structure(lambda x: x.numpy().tolist(), ours)) == repr(
        tf.nest.map_structure(lambda x: x.numpy().tolist(), theirs))
  assert _iterator.packer({1: tf.TensorSpec([], tf.int8)}) is None   # (not a str key)
  assert _iterator.packer(tf.RaggedTensorSpec([None, None], tf.int8)) is None
  assert _iterator.packer([tf.TensorSpec([], tf.int8)]) is None   # (lists: tf.nest's path)


def test_argument_checks_as_reverb(filled):
  _, address, _ = filled
  args = dict(server_address=address, table="t", dtypes=tf.int64, shapes=tf.TensorShape([]))
  for kw, msg in [({"max_in_flight_samples_per_worker": 0}, "max_in_flight"),
                  ({"num_workers_per_iterator": 0}, "num_workers_per_iterator"),
                  ({"max_samples_per_stream": 0}, "max_samples_per_stream"),
                  ({"rate_limiter_timeout_ms": -2}, "rate_limiter_timeout_ms"),
                  ({"max_samples": 0}, "max_samples")]:
    full = dict(args, max_in_flight_samples_per_worker=1)
    full.update(kw)
    with pytest.raises(ValueError, match=msg):
      reverb.TrajectoryDataset(**full)
  with pytest.raises(ValueError):
    reverb.TrajectoryDataset(address, "t", {"a": tf.int64, "b": tf.int64}, tf.TensorShape([]),
                             1)
  with pytest.raises(ValueError, match="does not contain any table named nope"):
    reverb.TrajectoryDataset.from_table_signature(address, "nope", 1)


def test_from_table_signature_needs_a_signature():
  server = _server(signature=None)
  try:
    with pytest.raises(ValueError, match="does not have a signature"):
      reverb.TrajectoryDataset.from_table_signature(f"localhost:{server.port}", "t", 1)
  finally:
    server.stop()


def test_rate_limiter_timeout_ends_the_sequence():
  server = _server()
  try:
    address = f"localhost:{server.port}"
    ds = reverb.TrajectoryDataset.from_table_signature(address, "t", 4,
                                                       rate_limiter_timeout_ms=150)
    start = time.monotonic()
    assert list(ds) == []   # empty table: the first sample times out
    assert 0.1 < time.monotonic() - start < 10
    _fill(reverb.Client(address), 2)
    ds = reverb.TrajectoryDataset.from_table_signature(address, "t", 4,
                                                       rate_limiter_timeout_ms=150)
    it = iter(ds)
    assert len([next(it) for _ in range(5)]) == 5   # MinSize(1): items keep coming
  finally:
    server.stop()


def test_items_that_do_not_match_raise_invalid_argument(filled):
  _, address, _ = filled
  ds = reverb.TrajectoryDataset(address, "t", {"a": tf.float32, "b": tf.int64},
                                {"a": tf.TensorShape([3, 2]), "b": tf.TensorShape([4])}, 2)
  with pytest.raises(tf.errors.InvalidArgumentError, match="incompatible tensor at flattened "
                     "index 1"):
    next(iter(ds))
  ds = reverb.TrajectoryDataset(address, "t", {"a": tf.float64, "b": tf.int64},
                                {"a": tf.TensorShape([3, 2]), "b": tf.TensorShape([3])}, 2)
  with pytest.raises(tf.errors.InvalidArgumentError, match="flattened index 0"):
    next(iter(ds))


def test_fifo_queue_order_with_one_worker():
  server = reverb.Server([reverb.Table.queue("q", 100)])
  try:
    address = f"localhost:{server.port}"
    client = reverb.Client(address)
    for i in range(20):
      client.insert(np.int64(i), {"q": 1.0})
    ds = reverb.TrajectoryDataset(address, "q", (tf.int64,), (tf.TensorShape([1]),),
                                  max_in_flight_samples_per_worker=7,
                                  num_workers_per_iterator=1, rate_limiter_timeout_ms=100)
    got = [int(x.data[0].numpy()[0]) for x in ds]
    assert got == list(range(20))
  finally:
    server.stop()


def _queue_of(n):
  server = reverb.Server([reverb.Table.queue("q", 1000)])
  client = reverb.Client(f"localhost:{server.port}")
  for i in range(n):
    client.insert(np.int64(i), {"q": 1.0})
  return server, f"localhost:{server.port}"


def _worker_threads():
  return sum(t.name == "reverb_shm-dataset-worker" for t in threading.enumerate())


def test_several_workers_feed_one_iterator_each_item_once():
  """num_workers_per_iterator=3: three sampling threads per iterator (none with -1, Reverb's
  one worker), whose batches together deliver each queued item exactly once."""
  server, address = _queue_of(300)
  try:
    ds = reverb.TrajectoryDataset(address, "q", (tf.int64,), (tf.TensorShape([1]),),
                                  max_in_flight_samples_per_worker=7,
                                  num_workers_per_iterator=3, rate_limiter_timeout_ms=300)
    it = iter(ds)
    got = [int(next(it).data[0].numpy()[0])]
    assert _worker_threads() == 3
    got += [int(x.data[0].numpy()[0]) for x in it]
    assert sorted(got) == list(range(300))   # each exactly once, in any interleaving
    del it
    deadline = time.monotonic() + 10
    while _worker_threads() and time.monotonic() < deadline:
      time.sleep(0.05)
    assert _worker_threads() == 0   # the iterator's end stops its workers
    client = reverb.Client(address)
    for i in range(5):
      client.insert(np.int64(i), {"q": 1.0})
    one = reverb.TrajectoryDataset(address, "q", (tf.int64,), (tf.TensorShape([1]),), 7,
                                   num_workers_per_iterator=-1, rate_limiter_timeout_ms=100)
    it = iter(one)
    assert [int(next(it).data[0].numpy()[0]) for _ in range(5)] == [0, 1, 2, 3, 4]
    assert _worker_threads() == 0   # "auto" is one worker: the iterator's own thread
  finally:
    server.stop()


def test_workers_share_max_samples_and_reverb_caps_their_number():
  from reverb_shm.tf import _batches  # pylint: disable=g-import-not-at-top
  assert _batches.num_workers(-1, 10, -1) == 1
  assert _batches.num_workers(4, 10, -1) == 4
  assert _batches.num_workers(4, 10, 25) == 2    # max(1, 25 // 10)
  assert _batches.num_workers(4, 10, 5) == 1
  server, address = _queue_of(100)
  try:
    ds = reverb.TrajectoryDataset(address, "q", (tf.int64,), (tf.TensorShape([1]),), 4,
                                  num_workers_per_iterator=3, max_samples=30)
    got = [int(x.data[0].numpy()[0]) for x in ds]
    assert len(got) == 30 and len(set(got)) == 30   # exactly max_samples, then the end
    assert reverb.Client(address).server_info()["q"].current_size == 70   # none sampled more
  finally:
    server.stop()


def test_one_worker_timing_out_ends_the_sequence_of_several():
  server, address = _queue_of(10)
  try:
    ds = reverb.TrajectoryDataset(address, "q", (tf.int64,), (tf.TensorShape([1]),), 3,
                                  num_workers_per_iterator=2, rate_limiter_timeout_ms=200)
    start = time.monotonic()
    got = [int(v) for x in ds.batch(4) for v in x.data[0].numpy()[:, 0]]   # (batch path too)
    assert sorted(got) == list(range(10))   # whatever was queued, then the end
    assert time.monotonic() - start < 20
  finally:
    server.stop()


def test_timestep_dataset_yields_each_step_of_each_item(filled):
  _, address, _ = filled
  ds = reverb.TimestepDataset(address, "t", {"a": tf.float32, "b": tf.int64},
                              {"a": tf.TensorShape([2]), "b": tf.TensorShape([])}, 4,
                              max_samples=5)
  steps = list(ds)
  assert len(steps) == 15
  for k in range(5):
    item = steps[3 * k:3 * k + 3]
    b = [int(s.data["b"].numpy()) for s in item]
    assert b == [b[0], b[0] + 1, b[0] + 2]
    assert len({int(s.info.key.numpy()) for s in item}) == 1
  assert [len(x.info.key) for x in ds.batch(3)] == [3] * 5


def test_timestep_dataset_takes_a_squeezed_column_as_one_timestep():
  """As Reverb: an item whose columns are squeezed (history[c][-1]) is one timestep; a squeezed
  column beside columns of one step is one step too; beside longer ones it is an error."""
  server = _server({"max_times_sampled": 1}, signature=None)
  try:
    address = f"localhost:{server.port}"
    client = reverb.Client(address)
    dtypes = {"a": tf.float32, "b": tf.int64}
    shapes = {"a": tf.TensorShape([2]), "b": tf.TensorShape([])}
    with client.trajectory_writer(3) as w:
      for i in range(3):
        w.append({"a": np.full(2, i, np.float32), "b": np.int64(i)})
      w.create_item("t", 1.0, {"a": w.history["a"][-1], "b": w.history["b"][-1]})
      w.flush()
      steps = list(reverb.TimestepDataset(address, "t", dtypes, shapes, 2,
                                          rate_limiter_timeout_ms=100))
      assert [(s.data["a"].numpy().tolist(), int(s.data["b"])) for s in steps] == \
          [([2.0, 2.0], 2)]
      w.create_item("t", 1.0, {"a": w.history["a"][-1], "b": w.history["b"][-1:]})
      w.flush()
      steps = list(reverb.TimestepDataset(address, "t", dtypes, {"a": tf.TensorShape([2]),
                                                                 "b": tf.TensorShape(None)}, 2,
                                          rate_limiter_timeout_ms=100))
      assert [(s.data["a"].numpy().tolist(), int(s.data["b"])) for s in steps] == \
          [([2.0, 2.0], 2)]
      w.create_item("t", 1.0, {"a": w.history["a"][-1], "b": w.history["b"][-2:]})
      w.flush()
    with pytest.raises(tf.errors.InvalidArgumentError, match="cannot be split into timesteps"):
      list(reverb.TimestepDataset(address, "t", dtypes, shapes, 2, rate_limiter_timeout_ms=100))
  finally:
    server.stop()


def test_tf_client_insert_sample_update_priorities():
  sig = {"w": tf.TensorSpec([2], tf.float32), "n": tf.TensorSpec([], tf.int64)}
  server = reverb.Server([reverb.Table("v", reverb.selectors.Prioritized(1.0),
                                       reverb.selectors.Fifo(), 10,
                                       reverb.rate_limiters.MinSize(1), signature=sig)])
  try:
    address = f"localhost:{server.port}"
    client = reverb.TFClient(address)
    assert client.server_address == address
    data = [tf.constant(7, tf.int64), tf.constant([1.0, 2.0])]   # flattened: n, w
    client.insert(data, tf.constant(["v"]), tf.constant([2.0], tf.float64))
    sample = client.sample("v", [tf.int64, tf.float32])
    assert [t.dtype for t in sample.info] == [tf.uint64, tf.float64, tf.int64, tf.float64,
                                               tf.int32]
    assert sample.info.priority.numpy() == 2.0 and sample.info.table_size.numpy() == 1
    assert int(sample.data[0].numpy()) == 7
    np.testing.assert_array_equal(sample.data[1].numpy(), [1.0, 2.0])
    client.update_priorities("v", tf.reshape(sample.info.key, [1]),
                             tf.constant([5.0], tf.float64))
    assert next(reverb.Client(address).sample("v")) [0].info.priority == 5.0

    @tf.function
    def roundtrip(x):
      client.insert([tf.constant(8, tf.int64), x], tf.constant(["v"]),
                    tf.constant([1.0], tf.float64))
      return client.sample("v", {"n": tf.int64, "w": tf.float32}).data
    out = roundtrip(tf.constant([3.0, 4.0]))
    assert int(out["n"].numpy()) in (7, 8)
    with pytest.raises(tf.errors.InvalidArgumentError):   # w of shape [3]: not the signature
      client.insert([tf.constant(1, tf.int64), tf.constant([1.0, 2.0, 3.0])],
                    tf.constant(["v"]), tf.constant([1.0], tf.float64))
    with pytest.raises(tf.errors.InvalidArgumentError):   # dtypes that do not match
      client.sample("v", [tf.int32, tf.float32])
    with pytest.raises(ValueError, match="tables must be a string tensor"):
      client.insert(data, tf.constant([1]), tf.constant([1.0], tf.float64))
    with pytest.raises(ValueError, match="priorities must be a float64"):
      client.insert(data, tf.constant(["v"]), tf.constant([1.0], tf.float32))
    with pytest.raises(ValueError, match="same shape"):
      client.insert(data, tf.constant(["v"]), tf.constant([1.0, 2.0], tf.float64))
  finally:
    server.stop()


def test_acme_make_reverb_dataset_pipeline(filled):
  """acme.datasets.make_reverb_dataset's pipeline: from_table_signature inside an interleave's
  map_func (traced in graph mode), batch(drop_remainder=True), prefetch."""
  _, address, _ = filled

  def make(unused_idx):
    return reverb.TrajectoryDataset.from_table_signature(
        server_address=address, table="t", max_in_flight_samples_per_worker=8).batch(
            4, drop_remainder=True)
  ds = tf.data.Dataset.range(2).interleave(make, cycle_length=2, num_parallel_calls=2,
                                           deterministic=False).prefetch(2)
  assert ds.element_spec.data["a"].shape == [4, 3, 2]
  it = iter(ds)
  for _ in range(5):
    batch = next(it)
    b = batch.data["b"].numpy()
    np.testing.assert_array_equal(b[:, 1] - b[:, 0], [1, 1, 1, 1])


def test_deleting_an_iterator_that_waits_for_a_sample_returns():
  server = _server({"max_times_sampled": 1})
  try:
    address = f"localhost:{server.port}"
    _fill(reverb.Client(address), 1)
    done = threading.Event()

    def consume():
      it = iter(reverb.TrajectoryDataset.from_table_signature(address, "t", 2).prefetch(2))
      next(it)   # the only item; the prefetch then waits for a sample that never comes
      del it
      done.set()
    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    assert done.wait(30), "deleting the iterator hung while its generator waited"
  finally:
    server.stop()


@pytest.mark.timeout(600)
def test_example_tf_learner_runs():
  """examples/tf_learner.py: spawned actors fill a table, a Keras learner reads a
  TrajectoryDataset and learns the reward weights."""
  import pathlib  # pylint: disable=g-import-not-at-top
  example = pathlib.Path(__file__).resolve().parent.parent / "examples" / "tf_learner.py"
  out = subprocess.run([sys.executable, str(example), "--steps", "60", "--actors", "2"],
                       capture_output=True, text=True, timeout=540)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  assert "60 steps in" in out.stdout
