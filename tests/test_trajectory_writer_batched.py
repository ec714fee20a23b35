"""TrajectoryWriter's batched paths: the fast append, batched window items and
create_window_items, checked against the per-step path item by item."""
import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import history

pytestmark = pytest.mark.timeout(60)

STEPS = 40


def _table(name, max_size=10_000, sampler=None):
  return reverb_shm.Table(name, sampler or selectors.Uniform(), selectors.Fifo(), max_size,
                          rate_limiters.MinSize(1))


@pytest.fixture
def server(server_factory):
  return server_factory([_table("a"), _table("b"), _table("p", sampler=selectors.Prioritized(1.0)),
                         reverb_shm.Table.queue("queue", 2),
                         reverb_shm.Table("fifo", selectors.Fifo(), selectors.Fifo(), 1000,
                                          rate_limiters.MinSize(1), max_times_sampled=1)])


@pytest.fixture
def client(server):
  return server.localhost_client()


def _steps(n, start=0):
  v = np.arange(start, start + n)
  return {"obs": np.stack([v * 10 + j for j in range(3)], axis=1).astype(np.float32),
          "action": v.astype(np.int64), "reward": (v * 0.5).astype(np.float32)}


def _step(steps, t):
  return {k: v[t] for k, v in steps.items()}


def _items(client, table):
  """(priority, [column arrays]) of every item, in insertion order, plus the keys."""
  st = client.shared_table(table)
  recs = st.items()
  seen = {}
  while len(seen) < len(recs):
    for s in st.sample(64):
      seen[s.info.key] = s
  keys = [int(k) for k in recs["key"]]
  return keys, [(float(r["priority"]), [np.asarray(c) for c in seen[int(r["key"])].data])
                for r in recs]


def _assert_same_items(got, want):
  assert len(got) == len(want)
  for (p1, cols1), (p2, cols2) in zip(got, want):
    assert p1 == p2
    assert len(cols1) == len(cols2)
    for c1, c2 in zip(cols1, cols2):
      assert c1.dtype == c2.dtype and c1.shape == c2.shape
      np.testing.assert_array_equal(c1, c2)


@pytest.mark.parametrize("chunk", [None, 3, 1])
def test_window_items_equal_per_step_items(client, chunk):
  """extend + create_window_items == append + create_item(last 2), also when windows straddle
  chunks (multi-slice descriptors)."""
  data = _steps(STEPS)
  prios = np.arange(1, STEPS, dtype=np.float64)
  per_step = client.trajectory_writer(4)
  if chunk:
    for path in (("obs",), ("action",), ("reward",)):
      per_step.configure(path, num_keep_alive_refs=4, max_chunk_length=chunk)
  for t in range(STEPS):
    per_step.append(_step(data, t))
    if t >= 1:
      per_step.create_item("a", float(prios[t - 1]),
                           {k: v[-2:] for k, v in per_step.history.items()})
  per_step.end_episode()
  per_step.close()

  batched = client.trajectory_writer(STEPS)
  if chunk:
    for path in (("obs",), ("action",), ("reward",)):
      batched.configure(path, num_keep_alive_refs=STEPS, max_chunk_length=chunk)
  batched.extend(data)
  batched.create_window_items("b", prios, np.arange(-STEPS, -1), 2)
  assert client.shared_table("b").size == STEPS - 1     # in the table when the call returns
  batched.close()

  keys_a, items_a = _items(client, "a")
  keys_b, items_b = _items(client, "b")
  _assert_same_items(items_b, items_a)
  assert len(set(keys_a + keys_b)) == 2 * (STEPS - 1)
  for t, (_, (action, obs, reward)) in enumerate(items_b):   # flatten order: sorted keys
    np.testing.assert_array_equal(action, [t, t + 1])
    np.testing.assert_array_equal(obs, data["obs"][t:t + 2])
    np.testing.assert_array_equal(reward, data["reward"][t:t + 2])


def test_window_items_select_columns_and_count_from_the_end(client):
  writer = client.trajectory_writer(10)
  writer.extend(_steps(6))
  h = writer.history
  writer.create_window_items("a", [2.0, 3.0], [0, -3], 3, columns={"r": h["reward"]})
  _, items = _items(client, "a")
  assert [p for p, _ in items] == [2.0, 3.0]
  np.testing.assert_array_equal(items[0][1][0], np.float32([0, 0.5, 1]))
  np.testing.assert_array_equal(items[1][1][0], np.float32([1.5, 2, 2.5]))
  writer.close()


@pytest.mark.parametrize("call, error", [
    (lambda w: w.create_window_items("a", np.ones(2), [0, 9], 2), IndexError),
    (lambda w: w.create_window_items("a", np.ones(2), [0, -11], 2), IndexError),
    (lambda w: w.create_window_items("a", np.ones(2), [0, 1], 0), ValueError),
    (lambda w: w.create_window_items("a", np.ones(2), [0, 1], -1), ValueError),
    (lambda w: w.create_window_items("a", np.ones(3), [0, 1], 2), ValueError),
    (lambda w: w.create_window_items("a", [1.0, np.nan], [0, 1], 2), ValueError),
    (lambda w: w.create_window_items("p", [1.0, -1.0], [0, 1], 2), ValueError),
    (lambda w: w.create_window_items("a", np.ones(2), [0.0, 1.0], 2), ValueError),
    (lambda w: w.create_window_items("a", np.ones(2), [[0, 1]], 2), ValueError),
    (lambda w: w.create_window_items("a", np.ones(1), [0], 2, columns={"x": 1}), TypeError),
    (lambda w: w.create_window_items("nope", np.ones(1), [0], 2), ValueError),
])
def test_bad_windows_raise_and_change_nothing(client, call, error):
  writer = client.trajectory_writer(10)
  writer.extend(_steps(10))
  writer.create_window_items("a", [1.0], [0], 2)
  with pytest.raises(error):
    call(writer)
  assert client.shared_table("a").size == 1
  assert client.shared_table("p").size == 0
  assert writer.num_pending_items == 0
  writer.close()


def test_windows_over_expired_or_skipped_steps_raise_and_change_nothing(client):
  writer = client.trajectory_writer(3)
  writer.extend(_steps(6))
  with pytest.raises(ValueError, match="expired"):
    writer.create_window_items("a", [1.0], [2], 2)     # steps 2, 3: only 3..5 are kept
  writer.append({"obs": np.zeros(3, np.float32), "reward": np.float32(0)})   # skips action
  writer.append(_step(_steps(1), 0))
  with pytest.raises(ValueError, match="not a stored step"):
    writer.create_window_items("a", [1.0], [-3], 3)     # action's step 6 was skipped
  assert client.shared_table("a").size == 0
  writer.create_window_items("a", [1.0], [-3], 3, columns={"obs": writer.history["obs"]})
  assert client.shared_table("a").size == 1
  writer.close()


def test_create_item_batches_until_flush_and_counts_pending(client):
  writer = client.trajectory_writer(2)
  data = _steps(10)
  for t in range(10):
    writer.append(_step(data, t))
    if t:
      writer.create_item("a", 1.0, {k: v[-2:] for k, v in writer.history.items()})
  assert client.shared_table("a").size == 0         # batched (chunks are not complete)
  assert writer.num_pending_items == 0              # counting inserts the batch
  assert client.shared_table("a").size == 9
  writer.append(_step(data, 0))
  writer.create_item("a", 1.0, {"obs": writer.history["obs"][-1]})
  writer.flush()
  assert client.shared_table("a").size == 10
  writer.close()


def test_batch_is_inserted_at_chunk_boundaries_and_at_batch_size(client):
  writer = client.trajectory_writer(2)
  writer.configure(("x",), num_keep_alive_refs=2, max_chunk_length=2)
  for t in range(4):
    writer.append({"x": np.int64(t)})
    writer.create_item("a", 1.0, writer.history["x"][-1:])
  # step 2 started a new chunk: the items created before it are in the table
  assert client.shared_table("a").size == 2
  writer.close()
  small = reverb_shm.TrajectoryWriter(client, 2, item_batch_size=2)
  for t in range(3):
    small.append({"x": np.int64(t)})
    small.create_item("b", 1.0, small.history["x"][-1:])
  assert client.shared_table("b").size == 2
  small.end_episode()
  assert client.shared_table("b").size == 3
  small.close()
  with pytest.raises(ValueError):
    reverb_shm.TrajectoryWriter(client, 2, item_batch_size=0)


def test_batched_items_keep_fifo_order_behind_the_rate_limiter(client):
  writer = client.trajectory_writer(1)
  for t in range(4):
    writer.append({"x": np.int64(t)})
    writer.create_item("queue", 1.0, writer.history["x"][-1:])
  assert writer.num_pending_items == 2              # Queue(2) admits two
  table = client.shared_table("queue")
  assert [int(s.data[0][0]) for s in table.sample(2)] == [0, 1]
  writer.flush(timeout_ms=5000)
  assert [int(s.data[0][0]) for s in table.sample(2)] == [2, 3]
  writer.close()


def test_fast_append_validates_like_the_slow_path(client):
  writer = client.trajectory_writer(3)
  n = history.AUTO_MAX_ROWS + 44
  data = _steps(n)
  for t in range(n):        # crosses a chunk boundary (auto chunks' rows) on the fast path
    writer.append(_step(data, t))
  with pytest.raises(ValueError, match="wrong dtype"):
    writer.append({"obs": np.zeros(3, np.float64), "action": np.int64(0),
                   "reward": np.float32(0)})
  with pytest.raises(ValueError, match="incompatible shape"):
    writer.append({"obs": np.zeros(4, np.float32), "action": np.int64(0),
                   "reward": np.float32(0)})
  assert writer.episode_steps == n
  h = writer.history
  np.testing.assert_array_equal(h["obs"][-3:].numpy(), data["obs"][-3:])
  np.testing.assert_array_equal(h["action"][-2:].numpy(), [n - 2, n - 1])
  assert h["reward"][-1].numpy() == data["reward"][-1]
  old = h["action"][-1]
  writer.append({"obs": np.zeros(3, np.float32), "action": np.int64(7), "reward": np.float32(1)})
  writer.append({"obs": np.zeros(3, np.float32), "action": 8, "reward": np.float32(1)})  # int
  assert not next(iter(old)).expired
  writer.append({"obs": np.zeros(3, np.float32), "action": np.int64(9)})   # reward skipped
  assert next(iter(old)).expired      # keeps the last 3 steps
  writer.append(_step(data, 0))
  np.testing.assert_array_equal(h["action"][-3:].numpy(), [8, 9, 0])
  with pytest.raises(ValueError):
    h["reward"][-2:]     # the skipped step reads as None
  writer.close()


def test_chunks_are_released_once_their_steps_expire(server, client):
  seg = server._segment  # pylint: disable=protected-access
  writer = client.trajectory_writer(2)
  writer.configure(("x",), num_keep_alive_refs=2, max_chunk_length=2)
  writer.append({"x": np.zeros(1000)})
  used = seg.info()["arena_used"]
  for _ in range(50):
    writer.append({"x": np.zeros(1000)})
  assert seg.info()["arena_used"] <= used + 3 * 2 * 8000
  writer.close()


def test_window_items_held_back_by_the_rate_limiter_wait_in_order(client):
  writer = client.trajectory_writer(10)
  writer.extend(_steps(5))
  writer.create_window_items("queue", [1.0, 2.0, 3.0, 4.0], np.arange(-5, -1), 2,
                             columns={"a": writer.history["action"]})
  assert writer.num_pending_items == 2
  table = client.shared_table("queue")
  assert [s.data[0].tolist() for s in table.sample(2)] == [[0, 1], [1, 2]]
  writer.end_episode(timeout_ms=5000)       # the queued items keep their chunks alive
  assert [s.data[0].tolist() for s in table.sample(2)] == [[2, 3], [3, 4]]
  writer.close()


def test_batched_item_outlives_its_steps_keep_alive_window(client):
  writer = client.trajectory_writer(2)
  data = _steps(4)
  writer.append(_step(data, 0))
  writer.append(_step(data, 1))
  writer.create_item("a", 1.0, {"o": writer.history["obs"][-2:]})
  writer.append(_step(data, 2))
  writer.append(_step(data, 3))     # steps 0 and 1 expired; the batched item still holds them
  writer.flush()
  _, items = _items(client, "a")
  np.testing.assert_array_equal(items[0][1][0], data["obs"][0:2])
  writer.close()


def test_window_priorities_are_checked_before_anything_is_inserted(client):
  writer = client.trajectory_writer(10)
  writer.extend(_steps(5))
  for prios in ([1.0, np.inf], [np.nan, 1.0]):
    with pytest.raises(ValueError, match="priority"):
      writer.create_window_items("a", prios, [0, 1], 2)
  with pytest.raises(ValueError, match="negative"):
    writer.create_window_items("p", [1.0, -0.5], [0, 1], 2)
  writer.create_window_items("a", [0.0, -0.5], [0, 1], 2)     # Uniform: negative is fine
  assert client.shared_table("a").size == 2 and client.shared_table("p").size == 0
  writer.close()


def test_items_created_in_turn_in_two_tables_keep_each_tables_order(client):
  """A batch alternating between tables is inserted one kind at a time when every limiter has
  room, and in creation order when one has not (what it holds back stays queued in order)."""
  writer = client.trajectory_writer(1)
  for t in range(6):
    writer.append({"x": np.int64(t)})
    writer.create_item("a", 1.0, writer.history["x"][-1:])
    writer.create_item("b", 2.0, writer.history["x"][-1:])
  writer.flush()
  for name, prio in (("a", 1.0), ("b", 2.0)):
    items = client.shared_table(name).items()
    assert len(items) == 6 and set(items["priority"].tolist()) == {prio}
    assert {int(s.data[0][0]) for s in client.shared_table(name).sample(100)} == set(range(6))
  writer.close()
  writer = client.trajectory_writer(1)
  for t in range(4):   # Queue(2) admits two: the rest stays queued in order behind it
    writer.append({"x": np.int64(10 + t)})
    writer.create_item("queue", 1.0, writer.history["x"][-1:])
    writer.create_item("a", 1.0, writer.history["x"][-1:])
  queue = client.shared_table("queue")
  assert writer.num_pending_items >= 2
  assert [int(s.data[0][0]) for s in queue.sample(2)] == [10, 11]
  writer.flush(timeout_ms=5000)
  assert [int(s.data[0][0]) for s in queue.sample(2)] == [12, 13]
  assert client.shared_table("a").size == 10
  writer.close()


def test_items_of_several_windows_in_one_table_keep_creation_order(client):
  """Items of one table whose windows differ (1, 2, 3 steps in turn) reach a FIFO queue in
  the order they were created, as in Reverb (grouping them by window reordered them)."""
  writer = client.trajectory_writer(3)
  created = []
  for t in range(12):
    writer.append({"x": np.int64(t)})
    n = min(t + 1, 1 + t % 3)
    writer.create_item("fifo", 1.0, writer.history["x"][-n:])
    created.append(list(range(t + 1 - n, t + 1)))
  writer.flush()
  got = [s.data[0].tolist() for s in client.sample("fifo", len(created), emit_timesteps=False)]
  assert got == created
  writer.close()
