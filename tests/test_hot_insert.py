"""The one-call C insert plans (reverb_shm/_internal/hot_plans.py, csrc/hot/hot_insert.c) store exactly
what the Python paths store, decline to them (same exceptions, nothing inserted) for anything
else, and keep their guarantees across threads, forks and rate-limiter waits."""
import contextlib
import ctypes
import os
import sys
import threading
import time

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import hot_plans
from reverb_shm._internal._lib import lib
from reverb_shm.specs import TensorSpec

from conftest import run_in_fork, run_threads

pytestmark = pytest.mark.timeout(120)


def w1_step(i):
  return {"obs": np.full(8, i, np.float32), "action": np.int64(i), "reward": np.float32(i / 2)}


# Step layouts the plans take (numpy arrays and scalars, Python scalars, nests), each as a
# function of the step index so that every step differs.
LAYOUTS = {
    "w1": w1_step,
    "python_scalars": lambda i: {"f": i + 0.25, "i": -3 * i, "b": i % 2 == 0},
    "numpy_scalars": lambda i: {
        "b": np.bool_(i % 2), "i8": np.int8(-i), "u16": np.uint16(i), "i32": np.int32(i),
        "u64": np.uint64(2**64 - 1 - i), "f16": np.float16(i / 4), "f64": np.float64(i / 3),
        "c64": np.complex64(i + 1j)},
    "arrays": lambda i: {"img": np.full((3, 4, 2), i, np.uint8), "mask": np.arange(5) > i,
                         "zero_d": np.array(i * 1.5), "i16": np.arange(4, dtype=np.int16) * i},
    "nest": lambda i: {"a": [np.float32(i), (np.arange(3) + i, 2.0 * i)],
                       "b": {"c": np.ones((2, 2)) * i, "d": i}, "e": ()},
    "tuple_root": lambda i: (np.arange(2, dtype=np.int32) + i, float(i)),
    "list_root": lambda i: [np.float32(i)],
    "non_contiguous": lambda i: {"x": (np.arange(20, dtype=np.float32) + i)[::2],
                                 "y": np.arange(12.0).reshape(3, 4).T * i},
}


@contextlib.contextmanager
def python_paths():
  """Every insert made in the block takes the Python path of before (no C plan is made or
  used; objects must be made in the block)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(hot_plans.PlanCache, "get", lambda *args: None)
    mp.setattr(hot_plans, "client_insert", lambda *args: None)
    yield


@pytest.fixture
def spy(monkeypatch):
  """Results of every hot_plans.client_insert call (True: inserted in C, None: declined)."""
  results = []
  real = hot_plans.client_insert

  def client_insert(*args):
    results.append(real(*args))
    return results[-1]
  monkeypatch.setattr(hot_plans, "client_insert", client_insert)
  return results


def outcome(fn):
  """('ok', result) or (exception type, message) of fn()."""
  try:
    return "ok", fn()
  except Exception as e:  # pylint: disable=broad-except
    return type(e), str(e)


def drain(table, n):
  """The n items of a queue table, in insertion order: (priority, columns as arrays)."""
  samples = table.sample(n, timeout_ms=5000)
  assert len(samples) == n
  return [(s.info.priority, [np.asarray(c) for c in s.data]) for s in samples]


def assert_same_items(got, want):
  assert len(got) == len(want)
  for (p1, cols1), (p2, cols2) in zip(got, want):
    assert p1 == p2
    assert len(cols1) == len(cols2)
    for a, b in zip(cols1, cols2):
      assert a.dtype == b.dtype and a.shape == b.shape
      assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_client_insert_stores_what_the_python_path_stores(server_factory, spy, layout):
  make = LAYOUTS[layout]
  server = server_factory([reverb_shm.Table.queue("hot", 100),
                           reverb_shm.Table.queue("py", 100)])
  client = server.localhost_client()
  for i in range(20):
    client.insert(make(i), {"hot": float(i)})
  assert spy[2:] == [True] * 18, spy   # (the first two calls learn the layout)
  with python_paths():
    py_client = server.localhost_client()
    for i in range(20):
      py_client.insert(make(i), {"py": float(i)})
  hot, py = server.shared_table("hot"), server.shared_table("py")
  keys = np.concatenate([hot.items()["key"], py.items()["key"]])
  assert len(np.unique(keys)) == 40
  assert_same_items(drain(hot, 20), drain(py, 20))


@pytest.mark.parametrize("layout", ["w1", "arrays", "nest", "non_contiguous"])
def test_shared_table_insert_stores_what_the_python_path_stores(server_factory, layout):
  make = LAYOUTS[layout]

  def batch(i):   # i % 3 + 1 rows, each a step of the layout
    import optree  # pylint: disable=import-outside-toplevel
    rows = [make(i * 3 + r) for r in range(i % 3 + 1)]
    return optree.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *rows)
  prios = [1.5, np.arange(2, dtype=np.float64) + 0.5, 7, np.array([1.0, 2.0, 3.0])]
  server = server_factory([reverb_shm.Table.queue("hot", 200),
                           reverb_shm.Table.queue("py", 200)])
  hot = server.shared_table("hot")
  hot_keys = [hot.insert(batch(i), prios[i % 3 if i % 3 != 1 else 1]) for i in range(12)]
  assert hot._hot_plan is not None   # pylint: disable=protected-access
  with python_paths():
    py = server.shared_table("py")
    py_keys = [py.insert(batch(i), prios[i % 3 if i % 3 != 1 else 1]) for i in range(12)]
  for k1, k2 in zip(hot_keys, py_keys):
    assert k1.dtype == k2.dtype == np.uint64 and k1.shape == k2.shape
  keys = np.concatenate(hot_keys + py_keys)
  assert len(np.unique(keys)) == len(keys)
  assert hot.items()["key"].tolist() == np.concatenate(hot_keys).tolist()
  assert_same_items(drain(hot, hot.size), drain(py, py.size))


def test_client_plan_is_used_and_relearnt_when_the_layout_changes(server_factory, spy):
  server = server_factory([reverb_shm.Table.queue("q", 100)])
  client = server.localhost_client()
  a, b = w1_step(1), {"obs": np.zeros(8, np.float64)}
  for data in (a, a, a, b, b, b, a, b):
    client.insert(data, {"q": 1.0})
  # a: learnt at its second call; b: declined once, then learnt; a and b again: cached plans.
  assert spy == [None, None, True, None, True, True, None, None], spy
  assert server.shared_table("q").size == 8


SIGNATURE = {"obs": TensorSpec([8], np.float32), "action": TensorSpec([], np.int64),
             "reward": TensorSpec([], np.float32)}


def _bad_calls():
  good = w1_step(3)
  return {
      "float64 obs": (dict(good, obs=np.zeros(8)), {"s": 1.0}, None),
      "shape (9,)": (dict(good, obs=np.zeros(9, np.float32)), {"s": 1.0}, None),
      "new key": (dict(good, extra=np.float32(1)), {"s": 1.0}, None),
      "object leaf": (dict(good, action="left"), {"s": 1.0}, None),
      "python int action beyond int64": (dict(good, action=2**63), {"s": 1.0}, None),
      "negative priority": (good, {"s": -1.0}, None),
      "over-cap priority": (good, {"s": 1e308}, None),
      "nan priority": (good, {"s": float("nan")}, None),
      "inf priority": (good, {"s": float("inf")}, None),
      "str priority": (good, {"s": "one"}, None),
      "None priority": (good, {"s": None}, None),
      "list priority": (good, {"s": [1.0]}, None),
      "negative numpy priority": (good, {"s": np.float64(-2.0)}, None),
      "unknown table": (good, {"nope": 1.0}, None),
      "a good and an unknown table": (good, {"s": 1.0, "nope": 1.0}, None),
      "negative timeout": (good, {"s": 1.0}, -1),
      "nan timeout": (good, {"s": 1.0}, float("nan")),
      "priorities not a dict": (good, [("s", 1.0)], None),
      "no priorities": (good, {}, None),
      "empty data": ({}, {"s": 1.0}, None),
  }


@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_bad_client_inserts_raise_as_before_and_insert_nothing(server_factory, case):
  data, priorities, timeout_ms = _bad_calls()[case]
  server = server_factory([reverb_shm.Table("s", selectors.Prioritized(1.0), selectors.Fifo(),
                                            100, rate_limiters.MinSize(1),
                                            signature=SIGNATURE)])
  st = server.shared_table("s")
  client = server.localhost_client()
  for _ in range(3):   # learn the good layout
    client.insert(w1_step(0), {"s": 1.0})
  assert client._hot_plans  # pylint: disable=protected-access
  with python_paths():
    py_client = server.localhost_client()
    py_client.insert(w1_step(0), {"s": 1.0})
  size = st.size
  got = outcome(lambda: client.insert(data, priorities, timeout_ms))
  assert got[0] is not "ok" and st.size == size, got   # pylint: disable=literal-comparison
  assert got == outcome(lambda: py_client.insert(data, priorities, timeout_ms))
  assert st.size == size
  client.insert(w1_step(5), {"s": 2.0})   # still works
  assert st.size == size + 1


@pytest.mark.parametrize("priority", [np.float64(2.0), 3, True, np.float32(0.5), 2**53 + 1])
def test_other_priority_types_insert_as_before(server_factory, priority):
  server = server_factory([reverb_shm.Table.queue("q", 100)])
  client = server.localhost_client()
  for _ in range(3):
    client.insert(w1_step(0), {"q": 1.0})
  client.insert(w1_step(1), {"q": priority})
  with python_paths():
    server.localhost_client().insert(w1_step(1), {"q": priority})
  assert server.shared_table("q").items()["priority"].tolist()[-2:] == [float(priority)] * 2


@pytest.mark.parametrize("priority", ["1.5", b"2"])
def test_text_priorities_are_refused_on_both_paths(server_factory, priority):
  server = server_factory([reverb_shm.Table.queue("q", 100)])
  client = server.localhost_client()
  client.insert(w1_step(0), {"q": 1.0})
  with pytest.raises(ValueError, match="`priority` must be a number") as fast:
    client.insert(w1_step(1), {"q": priority})
  with python_paths(), pytest.raises(ValueError) as slow:
    server.localhost_client().insert(w1_step(1), {"q": priority})
  assert str(fast.value) == str(slow.value)
  assert server.shared_table("q").size == 1


def test_several_tables_take_the_python_path(server_factory, spy):
  server = server_factory([reverb_shm.Table.queue("a", 10), reverb_shm.Table.queue("b", 10)])
  client = server.localhost_client()
  for _ in range(3):
    client.insert(w1_step(0), {"a": 1.0})
  client.insert(w1_step(7), {"a": 2.0, "b": 3.0})
  assert spy[-1] is None
  (pa, ca), = drain(server.shared_table("a"), 4)[3:]
  (pb, cb), = drain(server.shared_table("b"), 1)
  assert (pa, pb) == (2.0, 3.0) and ca[1].tolist() == cb[1].tolist() == [[7.0] * 8]


@pytest.mark.parametrize("case", ["keys given", "rows differ", "negative priorities",
                                  "priorities of another length", "scalar leaf"])
def test_bad_shared_table_batches_raise_as_before(server_factory, case):
  server = server_factory([reverb_shm.Table("p", selectors.Prioritized(1.0), selectors.Fifo(),
                                            100, rate_limiters.MinSize(1))])
  st = server.shared_table("p")
  good = {"x": np.zeros((2, 3), np.float32)}
  for _ in range(2):
    st.insert(good, 1.0)
  assert st._hot_plan is not None  # pylint: disable=protected-access
  data, prios, kwargs = {
      "keys given": (good, 1.0, {"keys": [5, 5]}),
      "rows differ": ({"x": np.zeros((2, 3), np.float32), "y": np.zeros(3)}, 1.0, {}),
      "negative priorities": (good, np.array([1.0, -1.0]), {}),
      "priorities of another length": (good, np.ones(3), {}),
      "scalar leaf": ({"x": np.float32(1)}, 1.0, {}),
  }[case]
  with python_paths():
    py = server.shared_table("p")
    py.insert(good, 1.0)
  size = st.size
  got = outcome(lambda: st.insert(data, prios, **kwargs))
  with python_paths():
    want = outcome(lambda: py.insert(data, prios, **kwargs))
  if case == "keys given":   # valid: inserted by the Python path (one item, key 5, updated)
    assert got[0] == "ok" and want[0] == "ok"
    assert got[1].tolist() == want[1].tolist() == [5, 5]
    return
  assert got == want and got[0] is not "ok", got   # pylint: disable=literal-comparison
  assert st.size == size


def test_threads_share_a_client(server_factory):
  threads_n, per_thread = 4, 300
  server = server_factory([reverb_shm.Table.queue("q", threads_n * per_thread + 2)])
  client = server.localhost_client()
  client.insert(w1_step(0), {"q": 1.0})
  client.insert(w1_step(0), {"q": 1.0})

  def work(t):
    for i in range(per_thread):
      client.insert({"obs": np.full(8, t, np.float32), "action": np.int64(i),
                     "reward": np.float32(t)}, {"q": float(t)})
  run_threads(work, threads_n, timeout=60)
  st = server.shared_table("q")
  assert st.size == threads_n * per_thread + 2
  assert len(np.unique(st.items()["key"])) == st.size
  seen = set()
  for prio, (action, obs, reward) in drain(st, st.size)[2:]:
    t = int(prio)
    assert obs.tolist() == [[float(t)] * 8] and reward.tolist() == [float(t)]
    seen.add((t, int(action[0])))
  assert seen == {(t, i) for t in range(threads_n) for i in range(per_thread)}


def test_forked_child_makes_its_own_plan(server_factory, spy):
  server = server_factory([reverb_shm.Table.queue("q", 100)])
  client = server.localhost_client()
  for i in range(3):
    client.insert(w1_step(i), {"q": 1.0})
  parent_plan = client._hot_plans["q"]  # pylint: disable=protected-access

  def child():
    declined = parent_plan.insert(w1_step(9), 1.0, None)
    for i in range(3):
      client.insert(w1_step(10 + i), {"q": 2.0})
    own = client._hot_plans["q"]  # pylint: disable=protected-access
    return declined, own is not parent_plan, spy[-1]
  assert run_in_fork(child) == "OK (None, True, True)"
  client.insert(w1_step(4), {"q": 3.0})
  assert spy[-1] is True
  assert client._hot_plans["q"] is parent_plan  # pylint: disable=protected-access
  items = drain(server.shared_table("q"), 7)
  assert [p for p, _ in items] == [1.0] * 3 + [2.0] * 3 + [3.0]
  assert [int(cols[0][0]) for _, cols in items] == [0, 1, 2, 10, 11, 12, 4]


def test_plan_declines_after_a_fork_without_python_hooks(server_factory):
  """A fork() that runs no Python at-fork hook (a C library's) leaves the segment's
  registration looking current in the child: the plan's fork counter still declines."""
  server = server_factory([reverb_shm.Table.queue("q", 100)])
  client = server.localhost_client()
  for i in range(3):
    client.insert(w1_step(i), {"q": 1.0})
  plan = client._hot_plans["q"]  # pylint: disable=protected-access
  libc_fork = ctypes.PyDLL(None).fork   # (PyDLL: the GIL stays held across the call)
  assert run_in_fork(lambda: plan.insert(w1_step(9), 1.0, None), fork=libc_fork) == "OK None"
  assert server.shared_table("q").size == 3
  assert plan.insert(w1_step(9), 1.0, None) is True   # the parent's plan still works here


def test_closed_segment_declines_and_raises_as_before(server_factory):
  server = server_factory([reverb_shm.Table.queue("q", 100)])
  client = server.localhost_client()
  with python_paths():
    py_client = server.localhost_client()
    py_client.insert(w1_step(0), {"q": 1.0})
    py_client.insert(w1_step(0), {"q": 1.0})
  for _ in range(3):
    client.insert(w1_step(0), {"q": 1.0})
  plan = client._hot_plans["q"]  # pylint: disable=protected-access
  server.stop()
  assert plan.insert(w1_step(1), 1.0, None) is None
  got = outcome(lambda: client.insert(w1_step(1), {"q": 1.0}))
  assert got[0] is not "ok"   # pylint: disable=literal-comparison
  with python_paths():
    assert got == outcome(lambda: py_client.insert(w1_step(1), {"q": 1.0}))


# ---- rate limiter waits (a queue of 2 is full after 2 inserts)
def _full_queue(server_factory):
  server = server_factory([reverb_shm.Table.queue("q", 2)])
  client = server.localhost_client()
  client.insert(w1_step(0), {"q": 1.0})
  client.insert(w1_step(1), {"q": 1.0})
  assert client._hot_plans  # pylint: disable=protected-access
  return server, client


@pytest.fixture(params=["open_chunks", "one_shot"])
def open_chunks(request, monkeypatch):
  """Plans append to open chunks (the default), or (one_shot) give every insert its own chunks,
  the path plans take for rows above hot_plans._OPEN_CHUNK_BYTES: a wait past a slice is then
  finished by Python from the chunks the call still holds."""
  if request.param == "one_shot":
    monkeypatch.setattr(hot_plans, "_open_rows", lambda columns: 0)
  return request.param == "open_chunks"


@pytest.mark.parametrize("timeout_ms", [0, 50, 250])
def test_client_insert_times_out_as_before(server_factory, spy, timeout_ms, open_chunks):
  server, client = _full_queue(server_factory)
  t0 = time.monotonic()
  with pytest.raises(errors.DeadlineExceededError) as hot_error:
    client.insert(w1_step(2), {"q": 1.0}, timeout_ms=timeout_ms)
  assert time.monotonic() - t0 >= timeout_ms / 1000 * 0.95
  assert type(spy[-1]) is tuple   # the C call timed out (or waited past a slice), Python raised
  # (open chunks: the plan itself waits past slices; one-shot: Python finishes after a slice)
  assert spy[-1][1] == (lib.RS_EAGAIN if timeout_ms > 100 and not open_chunks
                        else lib.RS_ETIMEDOUT)
  with python_paths():
    py_client = server.localhost_client()
    with pytest.raises(errors.DeadlineExceededError) as py_error:
      py_client.insert(w1_step(2), {"q": 1.0}, timeout_ms=timeout_ms)
  assert hot_error.value.inserted == py_error.value.inserted == 0
  assert str(hot_error.value) == str(py_error.value)
  assert server.shared_table("q").size == 2


def _sample_later(table, delay_s, n=1):
  def run():
    time.sleep(delay_s)
    table.sample(n, timeout_ms=5000)
  thread = threading.Thread(target=run)
  thread.start()
  return thread


def test_client_insert_waits_past_slices_until_admitted(server_factory, spy, open_chunks):
  server, client = _full_queue(server_factory)
  st = server.shared_table("q")
  sampler = _sample_later(st, 0.35)
  t0 = time.monotonic()
  client.insert(w1_step(7), {"q": 4.0}, timeout_ms=10_000)
  assert time.monotonic() - t0 >= 0.3
  sampler.join(timeout=10)
  if open_chunks:   # the plan waited past the slices itself
    assert spy[-1] is True
  else:   # finished by Python
    assert type(spy[-1]) is tuple and spy[-1][1] == lib.RS_EAGAIN
  assert st.size == 2
  (p1, c1), (p2, c2) = drain(st, 2)
  assert (p1, p2) == (1.0, 4.0) and c2[0].tolist() == [7] and c2[1].tolist() == [[7.0] * 8]


def test_shared_table_partial_progress_matches_python_path(server_factory, open_chunks):
  for variant in ("hot", "py"):
    ctx = python_paths() if variant == "py" else contextlib.nullcontext()
    with ctx:
      server = server_factory([reverb_shm.Table.queue("q", 4)])
      st = server.shared_table("q")
      st.insert({"x": np.arange(2, dtype=np.int32)}, 1.0)
      st.insert({"x": np.arange(1, dtype=np.int32) + 2}, 1.0)   # 3 of 4 pending
      with pytest.raises(errors.DeadlineExceededError) as e:
        st.insert({"x": np.arange(3, dtype=np.int32) + 10}, 2.0, timeout_ms=250)
      assert e.value.inserted == 1 and st.size == 4
      sampler = _sample_later(st, 0.3, n=2)
      keys = st.insert({"x": np.arange(2, dtype=np.int32) + 20}, np.array([5.0, 6.0]),
                       timeout_ms=10_000)
      sampler.join(timeout=10)
      assert len(keys) == 2 and st.size == 4
      items = drain(st, 4)
      assert [p for p, _ in items] == [1.0, 2.0, 5.0, 6.0]
      assert [int(c[0]) for _, c in items] == [2, 10, 20, 21]


def test_references_are_balanced(server_factory):
  """Inserted, declined and failed calls leave every object's reference count as it was."""
  server, client = _full_queue(server_factory)
  st = server.shared_table("q")
  st.sample(2, timeout_ms=1000)
  obs, action, prio = np.zeros(8, np.float32), np.int64(3), 2.5
  data = {"obs": obs, "action": action, "reward": np.float32(1)}
  non_contiguous = {"obs": np.zeros(16, np.float32)[::2], "action": action,
                    "reward": np.float32(1)}
  plan = client._hot_plans["q"]  # pylint: disable=protected-access
  tracked = [obs, action, prio, data, plan, non_contiguous["obs"]]
  before = [sys.getrefcount(x) for x in tracked]
  for _ in range(200):
    assert plan.insert(data, prio, None) is True                  # inserted
    assert plan.insert(non_contiguous, prio, None) is True        # (a copy held for the call)
    assert plan.insert(dict(data, obs=np.zeros(3)), prio, None) is None   # declined
    assert plan.insert(data, prio, -1) is None                    # invalid timeout: declined
    assert type(plan.insert(data, prio, 0)) is tuple              # limiter full: RS_ETIMEDOUT
    st.sample(2, timeout_ms=1000)
  assert [sys.getrefcount(x) for x in tracked] == before


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_step_inserter_staging_stores_what_the_python_path_stores(server_factory, layout):
  make = LAYOUTS[layout]
  server = server_factory([reverb_shm.Table.queue("hot", 100),
                           reverb_shm.Table.queue("py", 100)])
  with server.shared_table("hot").step_inserter(capacity=8) as inserter:
    for i in range(20):
      inserter.insert(make(i), float(i))
    assert inserter._stage is not None  # pylint: disable=protected-access
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(hot_plans, "stager", lambda *args: None)
    with server.shared_table("py").step_inserter(capacity=8) as inserter:
      for i in range(20):
        inserter.insert(make(i), float(i))
      assert inserter._stage is None  # pylint: disable=protected-access
  assert_same_items(drain(server.shared_table("hot"), 20), drain(server.shared_table("py"), 20))


def test_step_inserter_staging_declines_without_writing(server_factory):
  st = server_factory([reverb_shm.Table.queue("q", 100)]).shared_table("q")
  inserter = st.step_inserter(capacity=4)
  inserter.insert(w1_step(0), 1.0)
  stage = inserter._stage  # pylint: disable=protected-access
  rows_before = [r.copy() for r in inserter._rows]  # pylint: disable=protected-access
  for bad in (dict(w1_step(1), obs=np.zeros(8)), dict(w1_step(1), action=1.5), [w1_step(1)],
              dict(w1_step(1), extra=1)):
    assert stage(bad, 2.0, 1) is False
  for priority in (float("nan"), float("inf"), "1", None):
    assert stage(w1_step(1), priority, 1) is False
  assert stage(w1_step(1), 1.0, 4) is False   # beyond capacity
  for r, before in zip(inserter._rows, rows_before):  # pylint: disable=protected-access
    assert r.tobytes() == before.tobytes()
  assert inserter._priorities[1] == 0.0  # pylint: disable=protected-access
  inserter.close()
  assert st.size == 1
