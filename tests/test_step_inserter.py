"""StepInserter (SharedTable.step_inserter) and the one-call insert path rs_insert_rows behind it,
Client.insert and SharedTable.insert: values round-trip, items appear at flush, bad input is
rejected at the call that provides it and changes nothing."""
import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import chunks
from reverb_shm._internal._lib import ffi, lib

pytestmark = pytest.mark.timeout(60)


def _fifo_table(name="t", max_size=10_000, signature=None, sampler=None,
                limiter=None):
  return reverb_shm.Table(name, sampler or selectors.Fifo(), selectors.Fifo(), max_size,
                          limiter or rate_limiters.MinSize(1), max_times_sampled=1,
                          signature=signature)


def _step(i):
  return {"obs": np.full(3, i, np.float32), "action": np.int64(i), "reward": float(i) / 2}


def _data(sample):
  """The item's columns by name (tables without a signature return them flat, keys sorted)."""
  data = sample.data
  return data if isinstance(data, dict) else dict(zip(("action", "obs", "reward"), data))


def _check_step_item(sample, i):
  sample = sample._replace(data=_data(sample))
  np.testing.assert_array_equal(sample.data["obs"], np.full(3, i, np.float32))
  assert sample.data["obs"].dtype == np.float32
  assert sample.data["action"].shape == () and sample.data["action"] == i
  assert sample.data["action"].dtype == np.int64
  assert sample.data["reward"].dtype == np.float64 and sample.data["reward"] == i / 2


def _drain(st):
  return st.sample(st.size, timeout_ms=0) if st.size else []


def _arena_used(st):
  return st.segment.info()["arena_used"]


def test_steps_round_trip_and_become_visible_at_each_flush(server_factory):
  sig = {"obs": reverb_shm.TensorSpec((3,), np.float32),
         "action": reverb_shm.TensorSpec((), np.int64),
         "reward": reverb_shm.TensorSpec((), np.float64)}
  st = server_factory([_fifo_table(signature=sig)]).shared_table("t")
  inserter = st.step_inserter(capacity=4)
  assert inserter.capacity == 4
  for i in range(3):
    inserter.insert(_step(i), priority=i + 1.0)
  assert inserter.pending == 3 and st.size == 0       # staged, not visible yet
  inserter.insert(_step(3), priority=4.0)             # fills the rows: one flush
  assert inserter.pending == 0 and st.size == 4
  inserter.insert(_step(4), 5.0)
  assert st.size == 4
  keys = inserter.flush()
  assert keys.dtype == np.uint64 and len(keys) == 1 and st.size == 5
  samples = _drain(st)
  for i, s in enumerate(samples):
    _check_step_item(s, i)
    assert s.info.priority == i + 1.0
  assert samples[-1].info.key == int(keys[0])
  assert inserter.flush().tolist() == []              # nothing staged: nothing inserted
  st.check()


def test_close_and_context_exit_flush(server_factory):
  st = server_factory([_fifo_table()]).shared_table("t")
  with st.step_inserter(capacity=100) as inserter:
    for i in range(7):
      inserter.insert(_step(i))
    assert st.size == 0
  assert st.size == 7 and inserter.closed
  with pytest.raises(RuntimeError, match="closed"):
    inserter.insert(_step(0))
  inserter.close()                                    # idempotent
  for i, s in enumerate(_drain(st)):
    _check_step_item(s, i)
  inserter = st.step_inserter(capacity=100)
  with pytest.raises(KeyError):
    with inserter:
      inserter.insert(_step(9))
      raise KeyError("boom")
  assert st.size == 1                                 # flushed on the way out too


@pytest.mark.parametrize("bad, match", [
    ({"obs": np.zeros(3, np.float64), "action": np.int64(1), "reward": 1.0}, "dtype"),
    ({"obs": np.zeros(4, np.float32), "action": np.int64(1), "reward": 1.0}, "shape"),
    ({"obs": np.zeros(3, np.float32), "action": 1.5, "reward": 1.0}, "dtype"),
    ({"obs": np.zeros(3, np.float32), "action": np.int64(1)}, "structure"),
    ({"obs": np.zeros(3, np.float32), "act": np.int64(1), "reward": 1.0}, "structure"),
    ({"obs": np.zeros(3, np.float32), "action": 2**70, "reward": 1.0}, "int"),
    ({"obs": np.zeros(3, np.float32), "action": {"x": np.int64(1)}, "reward": 1.0},
     "structure"),
    ([np.zeros(3, np.float32), np.int64(1), 1.0], "structure"),
])
def test_bad_step_is_rejected_and_changes_nothing(server_factory, bad, match):
  st = server_factory([_fifo_table()]).shared_table("t")
  inserter = st.step_inserter(capacity=4)
  inserter.insert(_step(0))
  inserter.insert(_step(1))
  used = _arena_used(st)
  with pytest.raises(ValueError, match=match):
    inserter.insert(bad)
  assert inserter.pending == 2 and st.size == 0 and _arena_used(st) == used
  inserter.insert(_step(2))
  inserter.insert(_step(3))                           # the 4th valid step flushes
  assert st.size == 4
  for i, s in enumerate(_drain(st)):
    _check_step_item(s, i)


@pytest.mark.parametrize("priority", [float("nan"), float("inf"), "high", None, -1.0, 1e308])
def test_bad_priority_is_rejected_and_changes_nothing(server_factory, priority):
  table = _fifo_table(sampler=selectors.Prioritized(1.0))
  st = server_factory([table]).shared_table("t")
  inserter = st.step_inserter(capacity=2)
  inserter.insert(_step(0), 1.0)
  with pytest.raises(ValueError, match="priority"):
    inserter.insert(_step(1), priority)
  assert inserter.pending == 1 and st.size == 0
  inserter.insert(_step(1), 2)                        # an int priority is fine
  assert st.size == 2 and sorted(st.items()["priority"].tolist()) == [1.0, 2.0]


def test_first_step_is_checked_against_the_signature(server_factory):
  sig = {"obs": reverb_shm.TensorSpec((3,), np.float32)}
  st = server_factory([_fifo_table(signature=sig)]).shared_table("t")
  inserter = st.step_inserter()
  with pytest.raises(ValueError, match="signature"):
    inserter.insert({"obs": np.zeros(3, np.float64)})
  with pytest.raises(ValueError, match="numeric"):
    inserter.insert({"obs": "text"})
  assert inserter.pending == 0
  inserter.insert({"obs": np.ones(3, np.float32)})
  inserter.close()
  np.testing.assert_array_equal(_drain(st)[0].data["obs"], np.ones(3, np.float32))



def _mixed_step(i):
  return {"f32": np.full(4, i, np.float32), "u8": np.uint8(i % 256), "i32": np.int32(-i),
          "u64": np.uint64(2**64 - 1 - i), "flag": bool(i % 2), "b": np.bool_(i % 3 == 0),
          "count": i - 5, "score": i / 3, "f64s": np.arange(2, dtype=np.float64) + i}


def test_one_pass_staging_stores_every_leaf_exactly(server_factory):
  """The one-pass path (memoryview writes of scalars and 1-d arrays) stores each leaf as the
  checked path would, whatever the key order or strides of the step's arrays."""
  st = server_factory([_fifo_table()]).shared_table("t")
  inserter = st.step_inserter(capacity=8)
  inserter.insert(_mixed_step(0))
  assert inserter._stage is not None   # pylint: disable=protected-access  (the path tested)
  for i in range(1, 10):
    step = _mixed_step(i)
    if i % 2:
      step = dict(reversed(list(step.items())))               # other key order
    if i % 3 == 0:
      step["f32"] = np.full(8, i, np.float32)[::2]              # strided
    inserter.insert(step, float(i))
  inserter.close()
  got = _drain(st)
  assert len(got) == 10
  for i, s in enumerate(got):
    want = _mixed_step(i)
    data = dict(zip(sorted(want), s.data))
    for k, v in want.items():
      v = np.asarray(v)
      assert data[k].dtype == v.dtype and data[k].shape == v.shape, k
      np.testing.assert_array_equal(data[k], v)
    assert s.info.priority == (float(i) if i else 1.0)


@pytest.mark.parametrize("bad, match", [
    ({"f32": np.zeros(4, np.dtype(">f4"))}, "dtype"),            # byte-swapped
    ({"f32": np.zeros((2, 2), np.float32)}, "shape"),
    ({"f32": np.zeros(4, np.float32).reshape(4, 1)[:, 0][:3]}, "shape"),
    ({"u8": np.int64(3)}, "dtype"),
    ({"count": 2**63}, "int"),
    ({"count": 1.0}, "dtype"),
    ({"flag": 1}, "dtype"),
    ({"extra": np.int64(1)}, "structure"),
])
def test_one_pass_staging_rejects_what_the_checked_path_rejects(server_factory, bad, match):
  st = server_factory([_fifo_table()]).shared_table("t")
  inserter = st.step_inserter(capacity=4)
  inserter.insert(_mixed_step(0))
  step = _mixed_step(1)
  if "extra" in bad:
    del step["count"]
  step.update(bad)
  with pytest.raises(ValueError, match=match):
    inserter.insert(step)
  inserter.insert(_mixed_step(1))                     # the row is rewritten, not mixed
  assert inserter.pending == 2
  inserter.close()
  got = _drain(st)
  assert [s.data[sorted(_mixed_step(0)).index("count")].item() for s in got] == [-5, -4]
  assert got[1].data[sorted(_mixed_step(0)).index("f32")].tolist() == [1.0] * 4


def test_one_pass_staging_falls_back_for_other_layouts(server_factory):
  """Leaves the former Python one-pass path did not take (0-d, 2-d and empty arrays, float16)
  round-trip through the one-call C staging (hot_plans.stager) too."""
  st = server_factory([_fifo_table()]).shared_table("t")
  layouts = [lambda i: {"a": np.array(i, np.int32), "m": np.full((2, 2), i, np.float32),
                        "h": np.float16(i)},
             lambda i: {"e": np.zeros(0, np.float32), "a": np.int64(i)}]
  for make in layouts:
    steps = [make(i) for i in range(3)]
    inserter = st.step_inserter(capacity=8)
    for step in steps:
      inserter.insert(step, 1.0)
    assert inserter._stage is not None   # pylint: disable=protected-access
    inserter.close()
    for step, s in zip(steps, _drain(st)):
      for key, col in zip(sorted(step), s.data):
        want = step[key]
        assert col.dtype == want.dtype and col.shape == np.shape(want)
        np.testing.assert_array_equal(col, want)


@pytest.mark.parametrize("capacity", [0, 65537, 2.0, True])
def test_bad_capacity(server_factory, capacity):
  st = server_factory([_fifo_table()]).shared_table("t")
  with pytest.raises(ValueError, match="capacity"):
    st.step_inserter(capacity=capacity)
  with pytest.raises(ValueError, match="timeout"):
    st.step_inserter(timeout_ms=-1)


def test_rate_limiter_timeout_keeps_unadmitted_steps_staged(server_factory):
  limiter = rate_limiters.SampleToInsertRatio(1.0, 1, 2.0)   # at most ~3 inserts ahead
  st = server_factory([_fifo_table(limiter=limiter)]).shared_table("t")
  inserter = st.step_inserter(capacity=8, timeout_ms=0)
  for i in range(7):
    inserter.insert(_step(i))
  with pytest.raises(errors.DeadlineExceededError) as e:
    inserter.flush()
  admitted = e.value.inserted
  assert 0 < admitted < 7 and st.size == admitted and inserter.pending == 7 - admitted
  assert e.value.keys.dtype == np.uint64 and len(e.value.keys) == admitted
  assert sorted(e.value.keys.tolist()) == sorted(st.items()["key"].tolist())   # the admitted ones
  got = _drain(st)
  for _ in range(10):   # sampling makes room again; each flush inserts what is admitted
    if not inserter.pending:
      break
    try:
      inserter.flush()
    except errors.DeadlineExceededError as retry:
      assert retry.inserted > 0
    got += _drain(st)
  assert inserter.pending == 0
  assert [int(_data(s)["action"]) for s in got] == list(range(7))


def test_flush_of_a_stopped_server_raises_and_keeps_steps(server_factory):
  server = server_factory([_fifo_table()])
  st = server.shared_table("t")
  inserter = st.step_inserter(capacity=8)
  inserter.insert(_step(0))
  server.stop()
  with pytest.raises(errors.TableClosedError):
    inserter.flush()
  assert inserter.pending == 1


def test_insert_rows_fills_random_keys_and_rejects_bad_input(server_factory):
  """The C entry point directly: random keys drawn, items are rows of one chunk per column,
  and invalid input (a negative priority on a Prioritized table) writes nothing."""
  table = _fifo_table(sampler=selectors.Prioritized(1.0))
  st = server_factory([table]).shared_table("t")
  seg = st.segment
  slot, _ = seg.registration()
  writer = chunks.ColumnWriter([(np.dtype(np.int32), (2,))])
  rows = np.arange(6, dtype=np.int32).reshape(3, 2)
  keys = np.zeros(3, np.uint64)
  out = ffi.new("uint64_t[2]")
  pins, done = ffi.new("uint32_t[1]"), ffi.new("uint32_t *")
  used = _arena_used(st)
  prios = np.array([1.0, -1.0, 1.0])
  rc = lib.rs_insert_rows(seg.base, slot, st.index, 3, ffi.from_buffer("uint64_t[]", keys),
                          ffi.from_buffer("double[]", prios), 1, writer.metas,
                          chunks.row_buffers([rows]), writer.squeeze_flags[1], 0,
                          lib.RS_ROWS_RANDOM_KEYS, -1, 10**8, out, pins, done)
  assert rc == lib.RS_EINVAL and done[0] == 0 and st.size == 0 and _arena_used(st) == used
  prios[1] = 2.0
  rc = lib.rs_insert_rows(seg.base, slot, st.index, 3, ffi.from_buffer("uint64_t[]", keys),
                          ffi.from_buffer("double[]", prios), 1, writer.metas,
                          chunks.row_buffers([rows]), writer.squeeze_flags[1], 0,
                          lib.RS_ROWS_RANDOM_KEYS, -1, 10**8, out, pins, done)
  assert rc == lib.RS_OK and done[0] == 3 and len(set(keys.tolist())) == 3
  assert sorted(st.items()["key"].tolist()) == sorted(keys.tolist())
  batch = st.sample_batch(3)
  by_key = dict(zip(batch.info.key.tolist(), batch.data[0].tolist()))
  assert by_key == {int(k): rows[i].tolist() for i, k in enumerate(keys.tolist())}
  st.check()   # the writer pins were released: refcounts add up


def test_client_insert_fast_path_round_trips_and_validates(server_factory):
  server = server_factory([_fifo_table("a"), _fifo_table("b", sampler=selectors.Prioritized(1.0))])
  client = server.localhost_client()
  for i in range(3):
    client.insert(_step(i), {"a": 1.0})
  client.insert(_step(3), {"a": 2})
  st = server.shared_table("a")
  samples = _drain(st)
  for i, s in enumerate(samples):   # Client.insert keeps a time dim of 1
    s = s._replace(data=_data(s))
    np.testing.assert_array_equal(s.data["obs"], np.full((1, 3), i, np.float32))
    assert s.data["action"].tolist() == [i] and s.data["reward"].tolist() == [i / 2]
  assert [s.info.priority for s in samples] == [1.0, 1.0, 1.0, 2.0]
  used = _arena_used(st)
  for bad, prio in [(_step(0), float("nan")), ({"obs": None}, 1.0), (_step(0), True)]:
    with pytest.raises(ValueError):
      client.insert(bad, {"a": prio} if prio is not True else {"nope": 1.0})
  with pytest.raises(ValueError, match="negative"):
    client.insert(_step(0), {"b": -1.0})
  assert _arena_used(st) == used and st.size == 0
  assert server.shared_table("b").size == 0


def test_shared_table_insert_layout_cache_still_validates(server_factory):
  sig = {"obs": reverb_shm.TensorSpec((3,), np.float32)}
  st = server_factory([_fifo_table(signature=sig)]).shared_table("t")
  good = {"obs": np.zeros((1, 3), np.float32)}
  st.insert(good, 1.0)
  st.insert(good, 1.0)   # the cached layout
  used = _arena_used(st)
  for bad in [{"obs": np.zeros((1, 3), np.float64)}, {"obs": np.zeros((1, 4), np.float32)},
              {"obs": np.zeros(3, np.float32)}]:
    with pytest.raises(ValueError):
      st.insert(bad, 1.0)
  with pytest.raises(ValueError):
    st.insert(good, float("nan"))
  with pytest.raises(ValueError):
    st.insert(good, 1.0, timeout_ms=-1)
  assert st.size == 2 and _arena_used(st) == used
  f_order = {"obs": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::1])}
  f_order["obs"] = np.arange(12, dtype=np.float32).reshape(2, 6)[:, ::2]   # not contiguous
  st.insert(f_order, 1.0)
  got = [s.data["obs"].tolist() for s in _drain(st)][2:]
  assert got == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]


def test_mutate_priorities_fast_path_and_its_checks(server_factory):
  server = server_factory([_fifo_table(sampler=selectors.Prioritized(1.0))])
  client, st = server.localhost_client(), server.shared_table("t")
  keys = st.insert({"x": np.arange(4, dtype=np.int32)}, 1.0).tolist()
  assert client.mutate_priorities("t", {keys[0]: 3.0, np.uint64(keys[1]): 4, 12345: 1.0}) == (2, 0)
  prios = dict(zip(st.items()["key"].tolist(), st.items()["priority"].tolist()))
  assert prios[keys[0]] == 3.0 and prios[keys[1]] == 4.0
  for bad in [{keys[2]: -1.0}, {keys[2]: float("nan")}, {-1: 1.0}, {2**64: 1.0},
              {keys[2]: 1.0, True: 1.0}]:
    with pytest.raises(ValueError):
      client.mutate_priorities("t", bad)
  assert dict(zip(st.items()["key"].tolist(), st.items()["priority"].tolist())) == prios
