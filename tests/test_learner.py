"""reverb_shm.learner.BatchIterator: fixed shapes, prefetch ring, mixing, priorities back, seeds,
sequences, bad input, and a server that stops under it (numpy only; torch/JAX in their own
test modules)."""
import contextlib
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
from conftest import run_in_fork

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import shm
from reverb_shm.learner import Batch, BatchIterator, importance_weights

STEP_SIGNATURE = {"obs": reverb_shm.TensorSpec([4], np.float32),
                  "action": reverb_shm.TensorSpec([], np.int64),
                  "reward": reverb_shm.TensorSpec([], np.float32)}


def _table(name="t", sampler=None, max_size=10_000, limiter=None, signature=STEP_SIGNATURE):
  return reverb_shm.Table(name, sampler or selectors.Uniform(), selectors.Fifo(), max_size,
                          limiter or rate_limiters.MinSize(1), signature=signature)


def _steps(values, obs_dim=4):
  """Items whose every column is derived from `values` (so a row can be checked alone)."""
  v = np.asarray(values, np.int64)
  return {"obs": (v[:, None] * 10 + np.arange(obs_dim)).astype(np.float32),
          "action": v, "reward": (v * 0.5).astype(np.float32)}


def _threads_ended(it, timeout_s=5.0) -> bool:
  """Whether every background thread of `it` (Python and native) ended within timeout_s."""
  deadline = time.monotonic() + timeout_s
  for t in (it._thread, it._updater):
    if t is not None:
      t.join(max(0.0, deadline - time.monotonic()))
      if t.is_alive():
        return False
  while it._native is not None and any(it._native.stats()[5:]):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.01)
  return True


def _fill(st, values, priorities=1.0):
  return st.insert(_steps(values), priorities)


def _assert_rows_consistent(batch):
  action = batch.data["action"]
  np.testing.assert_array_equal(batch.data["obs"][:, 0], action * 10)
  np.testing.assert_array_equal(batch.data["reward"], (action * 0.5).astype(np.float32))


def test_batches_have_exactly_batch_size_rows_of_consistent_items(server_factory):
  server = server_factory([_table()])
  st = server.shared_table("t")
  keys = _fill(st, np.arange(10))
  key_of = dict(zip(range(10), keys.tolist()))
  with BatchIterator(server, "t", batch_size=64, timeout_ms=5000) as it:
    for _ in range(20):
      batch = next(it)
      assert isinstance(batch, Batch)
      assert batch.data["obs"].shape == (64, 4) and batch.data["action"].shape == (64,)
      assert len(batch.info.key) == 64
      _assert_rows_consistent(batch)
      # each row's key is the key of the item whose data it holds
      assert [key_of[a] for a in batch.data["action"].tolist()] == batch.info.key.tolist()
      np.testing.assert_allclose(batch.info.probability, 0.1)
      assert batch.weights is None and batch.mask is None and batch.table is None
    assert it.stats["batches"] >= 20


def test_fixed_shape_waits_then_raises_deadline_and_recovers(server_factory):
  server = server_factory([_table(limiter=rate_limiters.MinSize(50))])
  st = server.shared_table("t")
  _fill(st, np.arange(10))
  with BatchIterator(st, batch_size=32, timeout_ms=150) as it:
    start = time.monotonic()
    with pytest.raises(errors.DeadlineExceededError, match="no batch of 32 items within 150"):
      next(it)
    assert 0.14 < time.monotonic() - start < 5
    _fill(st, np.arange(10, 60))
    batch = next(it)
    assert len(batch.info.key) == 32
    _assert_rows_consistent(batch)


def test_fixed_shape_never_returns_fewer_items_from_a_queue(server_factory):
  server = server_factory([reverb_shm.Table.queue("q", 100, signature=STEP_SIGNATURE)])
  st = server.shared_table("q")
  _fill(st, np.arange(10))
  with BatchIterator(st, batch_size=16, timeout_ms=200) as it:
    with pytest.raises(errors.DeadlineExceededError):
      next(it)
    _fill(st, np.arange(10, 16))   # the 6 missing items complete the batch
    batch = next(it)
    assert sorted(batch.data["action"].tolist()) == list(range(16))


def test_partial_batches_only_when_asked(server_factory):
  server = server_factory([reverb_shm.Table.queue("q", 100, signature=STEP_SIGNATURE)])
  st = server.shared_table("q")
  _fill(st, np.arange(10))
  with BatchIterator(st, batch_size=16, timeout_ms=100, partial=True) as it:
    batch = next(it)
    assert batch.data["action"].tolist() == list(range(10))   # a queue: in order, all 10
    assert len(batch.info.key) == 10
    _fill(st, np.arange(10, 26))
    assert next(it).data["action"].tolist() == list(range(10, 26))


@pytest.mark.parametrize("weights", [{"a": 1, "b": 1}, {"b": 1, "a": 1}])
def test_partial_mixed_batches_hold_the_rows_of_tables_with_items(server_factory, weights):
  # (table 'a' is empty: whichever the order, 'b' gives its rows by the deadline)
  server = server_factory([_table("a"), _table("b")])
  _fill(server.shared_table("b"), np.arange(100, 108))
  with BatchIterator(server, weights, batch_size=8, timeout_ms=200, partial=True, seed=1) as it:
    b_index = [t.name for t in it.tables].index("b")
    for _ in range(4):
      batch = next(it)
      assert 0 < len(batch.info.key) < 8 and (batch.table == b_index).all()
      assert (batch.data["action"] >= 100).all()


def test_ring_buffers_are_reused_after_keep_batches_and_copies_are_not(server_factory):
  server = server_factory([_table()])
  st = server.shared_table("t")
  _fill(st, np.arange(100))
  with BatchIterator(st, batch_size=8, prefetch=2, keep=1, timeout_ms=5000) as it:
    addresses = [next(it).data["obs"].__array_interface__["data"][0] for _ in range(12)]
    assert 2 <= len(set(addresses)) <= 3   # at most prefetch + keep buffers, reused in turn
  with BatchIterator(st, batch_size=8, prefetch=2, keep=2, timeout_ms=5000) as it:
    previous = next(it)
    for _ in range(10):   # keep=2: the batch before the one just taken is still intact
      saved = previous.data["obs"].copy()
      current = next(it)
      time.sleep(0.01)   # (time for the thread to gather into any buffer it may use)
      np.testing.assert_array_equal(previous.data["obs"], saved)
      previous = current
  with BatchIterator(st, batch_size=8, copy=True, timeout_ms=5000) as it:
    first = next(it)
    saved = first.data["obs"].copy()
    others = [next(it) for _ in range(10)]
    np.testing.assert_array_equal(first.data["obs"], saved)
    addresses = {b.data["obs"].__array_interface__["data"][0] for b in [first] + others}
    assert len(addresses) == 11


def test_copied_batches_of_the_native_sampler_never_change_while_many_more_are_drawn(
    server_factory):
  """copy=True gathers with the native sampler too: each batch keeps the ring buffer it was
  gathered into (the slot gathers into new arrays), so batches held stay intact."""
  server = server_factory([_table(sampler=selectors.Prioritized(1.0))])
  st = server.shared_table("t")
  _fill(st, np.arange(200), np.linspace(0.1, 5, 200))
  with BatchIterator(st, batch_size=8, prefetch=2, copy=True, importance_beta=0.5,
                     timeout_ms=5000) as it:
    held = [next(it) for _ in range(5)]
    assert it._native_sampling   # (batches 2.. came from the native sampler)
    saved = [(b.data["obs"].copy(), b.data["action"].copy(), b.weights.copy()) for b in held]
    others = [next(it) for _ in range(300)]   # (every ring slot gathered into many times)
    time.sleep(0.05)   # (time for the sampler to fill the ring again)
    for b, (obs, action, weights) in zip(held, saved):
      np.testing.assert_array_equal(b.data["obs"], obs)
      np.testing.assert_array_equal(b.data["action"], action)
      np.testing.assert_array_equal(b.weights, weights)
      _assert_rows_consistent(b)
    for b in others[-20:]:
      _assert_rows_consistent(b)
    batches = held + others
    for name in ("obs", "action", "reward"):
      assert len({b.data[name].__array_interface__["data"][0] for b in batches}) == len(batches)
    assert len({b.weights.__array_interface__["data"][0] for b in batches}) == len(batches)


def test_the_native_ring_refuses_a_swap_of_a_slot_not_held_or_of_buffers_too_small(
    server_factory):
  server = server_factory([_table()])
  st = server.shared_table("t")
  _fill(st, np.arange(50))
  with BatchIterator(st, batch_size=8, prefetch=2, copy=True, timeout_ms=5000) as it:
    next(it)
    next(it)   # (of the native sampler: its slot is held until the next take)
    native = it._native
    fresh = tuple(np.empty_like(c) for c in it._slots[0].columns)
    rc, k, _ = native.take(5_000_000_000)   # (slot k is the consumer's until the next take)
    assert rc == 0
    others = [j for j in range(len(it._slots)) if j != k]
    with pytest.raises(ValueError, match="not held"):
      native.swap(others[0], fresh)
    small = (np.empty(3, np.float32),) + fresh[1:]
    with pytest.raises(ValueError, match="at least"):
      native.swap(k, small)
    with pytest.raises(ValueError, match="one buffer per column"):
      native.swap(k, fresh[:1])
    native.swap(k, fresh)   # (accepted: the slot gathers into these from now on)


def test_prioritized_frequencies_and_importance_weights(server_factory):
  server = server_factory([_table(sampler=selectors.Prioritized(0.6))])
  st = server.shared_table("t")
  priorities = np.array([1.0, 2.0, 4.0, 8.0])
  _fill(st, np.arange(4), priorities)
  expected = priorities ** 0.6 / (priorities ** 0.6).sum()
  counts = np.zeros(4)
  with BatchIterator(st, batch_size=256, importance_beta=0.5, timeout_ms=5000) as it:
    for _ in range(40):
      batch = next(it)
      counts += np.bincount(batch.data["action"], minlength=4)
      np.testing.assert_allclose(batch.info.probability, expected[batch.data["action"]])
      w = (4 * expected[batch.data["action"]]) ** -0.5
      np.testing.assert_allclose(batch.weights, w / w.max(), rtol=1e-6)
      assert batch.weights.dtype == np.float32
  freq = counts / counts.sum()
  # 10240 draws: 5 standard errors of the largest cell is < 0.025
  np.testing.assert_allclose(freq, expected, atol=0.025)


def test_importance_weights_formula():
  w = importance_weights(np.array([0.5, 0.25, 0.25]), np.array([3, 3, 3]), 1.0)
  np.testing.assert_allclose(w, [0.5, 1.0, 1.0])
  np.testing.assert_allclose(importance_weights(np.array([0.1, 0.3]), np.array([10, 10]), 0.0),
                             [1.0, 1.0])


def test_update_priorities_applies_in_order_and_counts_removed_keys(server_factory):
  server = server_factory([_table(sampler=selectors.Prioritized(1.0))])
  st = server.shared_table("t")
  keys = _fill(st, np.arange(8))
  with BatchIterator(st, batch_size=4, timeout_ms=5000) as it:
    batch = next(it)
    it.update_priorities(keys[:4], np.array([5.0, 6.0, 7.0, 8.0], np.float32))
    it.update_priorities(keys[:2], np.array([9.0, 10.0]))   # later wins
    st.delete(keys[6:])
    it.update_priorities(keys[4:], np.full(4, 3.0, np.float16))
    it.flush(timeout_ms=5000)
    items = {int(k): p for k, p in zip(st.items()["key"], st.items()["priority"])}
    assert [items[int(k)] for k in keys[:6]] == [9.0, 10.0, 7.0, 8.0, 3.0, 3.0]
    stats = it.stats
    assert stats["keys_skipped"] == 2 and stats["keys_updated"] == 8
    assert stats["priority_updates"] == 3 and stats["updates_pending"] == 0
    assert len(batch.info.key) == 4


def test_mixing_weights_split_rows_and_route_updates(server_factory):
  server = server_factory([_table("a", sampler=selectors.Prioritized(1.0)),
                           _table("b", sampler=selectors.Prioritized(1.0))])
  a, b = server.shared_table("a"), server.shared_table("b")
  _fill(a, np.arange(0, 50))
  _fill(b, np.arange(1000, 1050))
  rows_a = rows = 0
  with BatchIterator(server, {"a": 0.7, "b": 0.3}, batch_size=100, timeout_ms=5000,
                     seed=3) as it:
    assert [t.name for t in it.tables] == ["a", "b"]
    for _ in range(30):
      batch = next(it)
      _assert_rows_consistent(batch)
      from_b = batch.data["action"] >= 1000
      np.testing.assert_array_equal(batch.table, from_b.astype(np.uint8))
      rows_a += int((batch.table == 0).sum())
      rows += len(batch.table)
    assert abs(rows_a / rows - 0.7) < 0.04   # 3000 rows: 4.8 standard errors
    it.update_priorities(batch.info.key, np.where(from_b, 2.0, 3.0), table=batch.table)
    it.flush(timeout_ms=5000)
  prio_a = dict(zip(a.items()["key"].tolist(), a.items()["priority"].tolist()))
  prio_b = dict(zip(b.items()["key"].tolist(), b.items()["priority"].tolist()))
  for key, t in zip(batch.info.key.tolist(), batch.table.tolist()):
    assert (prio_b if t else prio_a)[key] == (2.0 if t else 3.0)


def test_mixing_weights_near_the_float_maximum_keep_their_proportions(server_factory):
  server = server_factory([_table("a"), _table("b")])
  _fill(server.shared_table("a"), np.arange(0, 50))
  _fill(server.shared_table("b"), np.arange(1000, 1050))
  with BatchIterator(server, {"a": 1e308, "b": 1e308}, batch_size=100, timeout_ms=5000,
                     seed=3) as it:
    rows_a = sum(int((next(it).table == 0).sum()) for _ in range(10))
  assert 400 < rows_a < 600   # 1000 rows: 6 standard errors


def test_mixing_weights_must_be_numbers_not_strings_or_bools(server_factory):
  server = server_factory([_table("a"), _table("b")])
  for weights in ({"a": "1", "b": 1}, {"a": True, "b": 1}, {"a": None, "b": 1}):
    with pytest.raises(ValueError, match="mixing weights must be numbers"):
      BatchIterator(server, weights, batch_size=4)


def test_mixed_tables_must_hold_the_same_columns(server_factory):
  server = server_factory([
      _table("a"), _table("b", signature={"x": reverb_shm.TensorSpec([3], np.float64)})])
  server.shared_table("a").insert(_steps(np.arange(5)), 1.0)
  server.shared_table("b").insert({"x": np.zeros((5, 3), np.float64)}, 1.0)
  with BatchIterator(server, ["a", "b"], batch_size=64, timeout_ms=5000) as it:
    with pytest.raises(ValueError, match="tables hold items of different columns"):
      next(it)
    assert not it._thread.is_alive()


def test_items_of_several_shapes_in_one_table_are_named_as_such(server_factory):
  server = server_factory([_table(signature=None)])
  st = server.shared_table("t")
  st.insert({"x": np.zeros((20, 3), np.float32)}, 1.0)
  st.insert({"x": np.zeros((20, 4), np.float32)}, 1.0)
  with BatchIterator(server, "t", batch_size=64, timeout_ms=5000) as it:
    with pytest.raises(ValueError, match=r"table 't' holds items whose columns differ \(the "
                       r"first sampled: float32\[[34]\]\)"):
      next(it)


def test_items_of_strings_cannot_be_batched(server_factory):
  server = server_factory([_table(signature=None)])
  server.localhost_client().insert([np.array("abc")], priorities={"t": 1.0})
  with BatchIterator(server, "t", batch_size=4, timeout_ms=5000) as it:
    with pytest.raises(ValueError, match="columns of Python objects"):
      next(it)


def _key_sequence(st, seed, batches=5, batch_size=32, **kwargs):
  with BatchIterator(st, batch_size=batch_size, seed=seed, timeout_ms=5000, **kwargs) as it:
    return [next(it).info.key.tolist() for _ in range(batches)]


@pytest.mark.parametrize("sampler", [selectors.Uniform(), selectors.Prioritized(0.7)])
def test_seed_makes_the_key_sequence_reproducible(server_factory, sampler):
  server = server_factory([_table(sampler=sampler)])
  st = server.shared_table("t")
  _fill(st, np.arange(500), np.linspace(0.1, 5, 500))
  first = _key_sequence(st, 42)
  assert _key_sequence(st, 42) == first
  assert _key_sequence(st, 43) != first
  assert _key_sequence(st, None) != first
  # The same keys whichever thread gathers them: the default batches (and copy=True's, as the
  # JAX iterator's) are gathered by the native sampler after the first; partial=True keeps them
  # on the Python thread.
  assert _key_sequence(st, 42, copy=True) == first
  assert _key_sequence(st, 42, partial=True) == first
  assert _key_sequence(st, 42, prefetch=5, keep=2) == first


def test_seeded_mixing_is_reproducible(server_factory):
  server = server_factory([_table("a"), _table("b")])
  _fill(server.shared_table("a"), np.arange(100))
  _fill(server.shared_table("b"), np.arange(100, 200))

  def run(seed):
    with BatchIterator(server, {"a": 0.5, "b": 0.5}, batch_size=16, seed=seed,
                       timeout_ms=5000) as it:
      return [next(it).info.key.tolist() for _ in range(4)]
  assert run(7) == run(7)


def test_windows_of_steps_come_out_batch_by_time_with_a_mask(server_factory):
  t_len = 5
  server = server_factory([_table(signature={
      "obs": reverb_shm.TensorSpec([t_len, 3], np.float32),
      "mask": reverb_shm.TensorSpec([t_len], np.bool_)})])
  client = server.localhost_client()
  with client.trajectory_writer(num_keep_alive_refs=t_len) as w:
    for step in range(12):
      w.append({"obs": np.full(3, step, np.float32), "mask": step % 4 != 3})
      if step >= t_len - 1:
        w.create_item("t", 1.0, {"obs": w.history["obs"][-t_len:],
                                 "mask": w.history["mask"][-t_len:]})
  with BatchIterator(server, "t", batch_size=6, mask_key="mask", timeout_ms=5000) as it:
    batch = next(it)
  assert batch.data["obs"].shape == (6, t_len, 3)
  assert batch.mask.shape == (6, t_len) and batch.mask.dtype == np.bool_
  first = batch.data["obs"][:, :, 0]
  np.testing.assert_array_equal(first, first[:, :1] + np.arange(t_len))   # consecutive steps
  np.testing.assert_array_equal(batch.mask, first % 4 != 3)


def test_mask_key_naming_no_column_is_an_error(server_factory):
  server = server_factory([_table()])
  _fill(server.shared_table("t"), np.arange(4))
  with BatchIterator(server, "t", batch_size=4, mask_key="done", timeout_ms=5000) as it:
    with pytest.raises(ValueError, match="mask_key 'done' names no column"):
      next(it)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"batch_size": 0}, ValueError, "batch_size must be an int >= 1"),
    ({"prefetch": 0}, ValueError, "prefetch must be an int >= 1"),
    ({"timeout_ms": -1}, ValueError, "timeout_ms must be None"),
    ({"partial": True}, ValueError, "partial=True needs a timeout_ms"),
    ({"importance_beta": 1.5}, ValueError, r"importance_beta must be None or a number in \[0, 1\]"),
    ({"seed": "x"}, ValueError, "seed must be None or an int"),
    ({"table": {"t": 0.0}}, ValueError, "mixing weights must be finite numbers > 0"),
    ({"table": 3}, TypeError, "table must be a table name"),
    ({"table": "nope"}, errors.UnknownTableError, "nope"),
])
def test_bad_arguments_are_rejected(server_factory, kwargs, error, match):
  server = server_factory([_table()])
  kwargs = dict({"table": "t", "batch_size": 4}, **kwargs)
  with pytest.raises(error, match=match):
    BatchIterator(server, **kwargs)
  assert server.shared_table("t").stats()["samples"] == 0


@pytest.mark.parametrize("kwargs", [{}, {"copy": True}, {"partial": True}])
@pytest.mark.parametrize("timeout_ms", [float("inf"), 1e20, np.int64(10**6)])
def test_a_timeout_past_any_deadline_waits_forever(server_factory, kwargs, timeout_ms):
  server = server_factory([_table()])
  st = server.shared_table("t")
  fill = threading.Timer(0.2, _fill, (st, np.arange(8)))
  with BatchIterator(st, batch_size=4, timeout_ms=timeout_ms, **kwargs) as it:
    fill.start()
    try:
      for _ in range(3):
        batch = next(it)
        assert len(batch.info.key) == 4
    finally:
      fill.join()
    it.update_priorities(batch.info.key, np.full(4, 2.0))
    it.flush(timeout_ms=timeout_ms)
    assert it.stats["keys_updated"] == 4
    with pytest.raises(ValueError, match="timeout_ms must be None"):
      it.flush(timeout_ms=float("nan"))


def test_keys_as_a_list_of_python_ints_are_updated(server_factory):
  server = server_factory([_table(sampler=selectors.Prioritized(1.0))])
  st = server.shared_table("t")
  keys = np.array([5, 2**63 + 5, 2**64 - 1], np.uint64)   # (numpy: float64 of these ints)
  st.insert(_steps(np.arange(3)), 1.0, keys=keys)
  with BatchIterator(st, batch_size=2, timeout_ms=5000) as it:
    next(it)
    it.update_priorities(keys.tolist(), [2.0, 3.0, 4.0])
    it.update_priorities(tuple(keys.tolist()[:1]), [5.0])
    with pytest.raises(ValueError, match=r"keys must be in \[0, 2\*\*64\)"):
      it.update_priorities([-1], [1.0])
    it.flush(timeout_ms=5000)
    assert it.stats["keys_updated"] == 4
  got = dict(zip(st.items()["key"].tolist(), st.items()["priority"].tolist()))
  assert [got[k] for k in keys.tolist()] == [5.0, 3.0, 4.0]


def test_bad_priority_updates_are_rejected_and_change_nothing(server_factory):
  server = server_factory([_table(sampler=selectors.Prioritized(1.0))])
  st = server.shared_table("t")
  keys = _fill(st, np.arange(4))
  with BatchIterator(st, batch_size=4, timeout_ms=5000) as it:
    with pytest.raises(TypeError, match="floating dtype"):
      it.update_priorities(keys, np.array([1, 2, 3, 4]))
    with pytest.raises(TypeError, match="unsigned 64-bit integers"):
      it.update_priorities(keys.astype(np.float64), np.ones(4))
    with pytest.raises(ValueError, match="one value per key"):
      it.update_priorities(keys, np.ones(3))
    with pytest.raises(ValueError, match="finite"):
      it.update_priorities(keys, np.array([1.0, np.nan, 1.0, 1.0]))
    with pytest.raises(ValueError, match=">= 0 for a Prioritized table"):
      it.update_priorities(keys, np.array([1.0, -1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="not one of this iterator's tables"):
      it.update_priorities(keys, np.ones(4), table="other")
    it.flush(timeout_ms=1000)
    assert it.stats["priority_updates"] == 0
  assert st.items()["priority"].tolist() == [1.0] * 4
  with pytest.raises(RuntimeError, match="closed"):
    it.update_priorities(keys, np.ones(4))


def _serve(name, ready, stop):
  server = reverb_shm.Server([_table()], name=name, arena_bytes=64 << 20)
  st = server.shared_table("t")
  _fill(st, np.arange(100))
  ready.set()
  stop.wait(30)
  server.stop()


def test_server_stopping_in_another_process_ends_the_iterator(server_name):
  ctx = multiprocessing.get_context("spawn")
  ready, stop = ctx.Event(), ctx.Event()
  proc = ctx.Process(target=_serve, args=(server_name, ready, stop))
  proc.start()
  try:
    assert ready.wait(30)
    st = reverb_shm.SharedTable.attach(f"{server_name}/t")
    it = BatchIterator(st, batch_size=16, prefetch=2, timeout_ms=10_000)
    assert len(next(it).info.key) == 16
    stop.set()
    proc.join(30)
    assert proc.exitcode == 0
    start = time.monotonic()
    with pytest.raises(errors.TableClosedError, match="background threads have ended"):
      for _ in range(10):   # the batches gathered before the stop come first
        next(it)
    assert time.monotonic() - start < 5
    assert _threads_ended(it)
    with pytest.raises(RuntimeError, match="closed"):
      it.update_priorities(np.zeros(1, np.uint64), np.ones(1))
    it.close()
  finally:
    stop.set()
    proc.join(30)
    if proc.is_alive():
      proc.kill()


def test_server_stopping_while_the_thread_waits_on_the_limiter(server_factory):
  server = server_factory([_table(limiter=rate_limiters.MinSize(10))])
  st = server.shared_table("t")
  it = BatchIterator(st, batch_size=4, timeout_ms=10_000)
  result = {}

  def consume():
    try:
      next(it)
    except BaseException as e:   # pylint: disable=broad-except
      result["error"] = e
  t = threading.Thread(target=consume)
  t.start()
  time.sleep(0.2)
  server.stop()
  t.join(10)
  assert not t.is_alive()
  assert isinstance(result.get("error"), errors.TableClosedError)
  it._thread.join(5)
  assert not it._thread.is_alive()


def _actor(name, worker, steps, done):
  st = reverb_shm.SharedTable.attach(f"{name}/t")
  for s in range(0, steps, 50):
    values = worker * 1_000_000 + np.arange(s, s + 50)
    st.insert(_steps(values), np.ones(50), timeout_ms=10_000)
  done.put(worker)


def test_learner_samples_and_updates_while_actor_processes_insert(server_factory):
  server = server_factory([_table(sampler=selectors.Prioritized(0.6), max_size=3000)])
  st = server.shared_table("t")
  _fill(st, np.arange(100))
  name = server.name
  ctx = multiprocessing.get_context("fork")
  done = ctx.Queue()
  actors = [ctx.Process(target=_actor, args=(name, w + 1, 4000, done)) for w in range(2)]
  for p in actors:
    p.start()
  sent = 0
  try:
    with BatchIterator(st, batch_size=64, importance_beta=0.4, timeout_ms=10_000) as it:
      while any(p.is_alive() for p in actors) or sent < 20:
        batch = next(it)
        _assert_rows_consistent(batch)
        assert batch.weights.max() == pytest.approx(1.0)
        it.update_priorities(batch.info.key, np.abs(batch.data["reward"]) + 0.1)
        sent += 64
        if sent > 400_000:
          break
      it.flush(timeout_ms=10_000)
      stats = it.stats
  finally:
    for p in actors:
      p.join(30)
  assert [p.exitcode for p in actors] == [0, 0]
  assert sorted(done.get(timeout=5) for _ in actors) == [1, 2]
  assert stats["keys_updated"] + stats["keys_skipped"] == sent
  assert st.stats()["deletes"] > 0   # the actors pushed items out while the learner sampled
  st.check()


def test_close_applies_queued_updates_and_ends_the_thread(server_factory):
  server = server_factory([_table(sampler=selectors.Prioritized(1.0))])
  st = server.shared_table("t")
  keys = _fill(st, np.arange(4))
  it = BatchIterator(st, batch_size=4, timeout_ms=5000)
  next(it)
  it.update_priorities(keys, np.full(4, 2.5))
  it.close()
  assert _threads_ended(it) and it.closed
  assert st.items()["priority"].tolist() == [2.5] * 4
  with pytest.raises(RuntimeError, match="closed"):
    next(it)


def test_a_next_that_raises_leaves_the_held_batch_intact(server_factory):
  server = server_factory([reverb_shm.Table.queue("q", 100, signature=STEP_SIGNATURE)])
  st = server.shared_table("q")
  _fill(st, np.arange(8))   # batch A = items 0..3, batch B = items 4..7
  with BatchIterator(st, batch_size=4, prefetch=1, keep=1, timeout_ms=300) as it:
    next(it)
    b = next(it)
    saved = b.data["action"].copy()
    assert saved.tolist() == [4, 5, 6, 7]
    with pytest.raises(errors.DeadlineExceededError):
      next(it)   # took no batch: B stays the consumer's
    _fill(st, np.arange(100, 106))   # enough for one batch (into the free buffer) and more
    time.sleep(0.5)
    np.testing.assert_array_equal(b.data["action"], saved)
    assert next(it).data["action"].tolist() == [100, 101, 102, 103]


def test_a_bad_asynchronous_update_does_not_drop_the_others_of_its_round(server_factory):
  server = server_factory([_table(sampler=selectors.Prioritized(1.0))])
  st = server.shared_table("t")
  keys = _fill(st, np.arange(3))
  gate = threading.Event()

  def slow():   # round 1: the updater waits on this "device copy" while the others queue
    assert gate.wait(10)
    return np.array([5.0])
  with BatchIterator(st, batch_size=3, timeout_ms=5000) as it:
    it._queue_async_update(keys[:1], 1, None, slow)
    time.sleep(0.1)
    it._queue_async_update(keys[1:2], 1, None, lambda: np.array([np.nan]))   # round 2: bad
    it.update_priorities(keys[2:], np.array([9.0]))                          # round 2: valid
    gate.set()
    with pytest.raises(ValueError, match="finite"):
      it.flush(timeout_ms=5000)
    it.flush(timeout_ms=5000)   # raised once
    assert it.stats["updates_pending"] == 0 and it.stats["priority_updates"] == 2
  assert st.items()["priority"].tolist() == [5.0, 1.0, 9.0]


_SERVE_EMPTY = """
import sys, time, reverb_shm
from reverb_shm import rate_limiters, selectors
t = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100, rate_limiters.MinSize(1))
s = reverb_shm.Server([t], name=sys.argv[1], arena_bytes=4 << 20)
print(s.port, flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("items", [0, 20])
def test_iterator_notices_a_killed_server(server_name, items):
  """Empty table: the thread waits for items when the server dies. 20 items: batches are ready
  (and sampling the dead server's segment would go on): next() and update_priorities raise all
  the same, within a second."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.Popen([sys.executable, "-c", _SERVE_EMPTY, server_name],
                          stdout=subprocess.PIPE, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": root})
  try:
    assert proc.stdout.readline()
    st = reverb_shm.SharedTable.attach(f"{server_name}/t")
    if items:
      _fill(st, np.arange(items))
    with BatchIterator(st, batch_size=4, timeout_ms=10_000) as it:
      for _ in range(10 if items else 0):
        batch = next(it)
        it.update_priorities(batch.info.key, np.full(4, 2.0))
      time.sleep(0.3)
      proc.send_signal(signal.SIGKILL)
      proc.wait(10)
      start = time.monotonic()
      with pytest.raises(errors.DeadOwnerError, match="is dead"):
        while time.monotonic() - start < 5:
          next(it)
      assert time.monotonic() - start < 1.0
      with pytest.raises(errors.DeadOwnerError, match="is dead"):
        next(it)
      with pytest.raises(errors.DeadOwnerError, match="is dead"):
        it.update_priorities(np.zeros(1, np.uint64), np.ones(1))
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(10)
    shm.remove_stale(names=[server_name])


def test_an_iterator_used_in_a_forked_child_says_to_re_create_it(server_factory):
  server = server_factory([_table()])
  st = server.shared_table("t")
  keys = _fill(st, np.arange(20))
  with BatchIterator(st, batch_size=4, prefetch=2, timeout_ms=5000) as it:
    next(it)
    time.sleep(0.2)   # (batches prefetched: the child must not hand them out either)

    def child():
      out = []
      for call in (lambda: next(it), lambda: it.update_priorities(keys[:1], np.ones(1)),
                   lambda: it.flush(1000)):
        try:
          call()
          out.append("ok")
        except RuntimeError as e:
          out.append("re-create the iterator after fork" in str(e))
      it.close()
      return out
    assert run_in_fork(child, timeout=20) == "OK [True, True, True]"
    assert len(next(it).info.key) == 4   # the parent's iterator is untouched


def test_partial_next_returns_the_items_gathered_by_its_deadline(server_factory):
  server = server_factory([reverb_shm.Table.queue("q", 100, signature=STEP_SIGNATURE)])
  st = server.shared_table("q")
  for trial in range(3):
    _fill(st, np.arange(3))   # 3 items, batches of 8: the two deadlines race

    def slow(batch, slot):   # delivered a while after the gather's deadline
      time.sleep(0.2)
      return batch
    with BatchIterator(st, batch_size=8, timeout_ms=300, partial=True, transform=slow) as it:
      start = time.monotonic()
      assert next(it).data["action"].tolist() == [0, 1, 2], trial
      assert time.monotonic() - start < 5


def test_every_batch_has_a_data_dict_of_its_own(server_factory):
  server = server_factory([_table()])
  st = server.shared_table("t")
  _fill(st, np.arange(20))
  with BatchIterator(st, batch_size=4, prefetch=1, mask_key="action", timeout_ms=5000) as it:
    first = next(it)
    first.data.pop("action")   # the consumer edits its batch's dict
    later = []
    for _ in range(4):   # (gathered into the first batch's buffer again)
      later.append(next(it))
      # (checked before the next batch: keep=1 hands this one's buffer back to the sampler then)
      _assert_rows_consistent(later[-1])
    for batch in later:
      assert sorted(batch.data) == ["action", "obs", "reward"]
      assert batch.data is not first.data
    pointers = {b.data["obs"].__array_interface__["data"][0] for b in later}
    assert len(pointers) <= 2   # still views of the ring buffers


def test_assigning_importance_beta_is_validated(server_factory):
  server = server_factory([_table(sampler=selectors.Prioritized(1.0))])
  st = server.shared_table("t")
  _fill(st, np.arange(10), priorities=np.arange(1.0, 11.0))
  with BatchIterator(st, batch_size=8, prefetch=1, importance_beta=0.4, timeout_ms=5000) as it:
    for bad in (-1.0, 2.0, float("nan"), "half", True, [0.5]):
      with pytest.raises(ValueError, match=r"importance_beta must be None or a number in \[0, 1\]"):
        it.importance_beta = bad
      assert it.importance_beta == 0.4   # unchanged
    it.importance_beta = 1
    assert it.importance_beta == 1.0 and isinstance(it.importance_beta, float)
    for _ in range(3):   # (the batches gathered before the change may use 0.4)
      batch = next(it)
    np.testing.assert_allclose(batch.weights, importance_weights(
        batch.info.probability, batch.info.table_size, 1.0), rtol=1e-6)
    assert not it.closed
    it.importance_beta = None


@pytest.mark.parametrize("items", [20, 0])   # threads waiting on full ring / on an empty table
def test_an_iterator_dropped_without_close_is_collected_and_its_threads_end(server_factory,
                                                                             items):
  server = server_factory([_table()])
  st = server.shared_table("t")
  if items:
    _fill(st, np.arange(items))
  it = BatchIterator(st, batch_size=4, prefetch=2, timeout_ms=5000)
  if items:
    next(it)
    it.update_priorities(np.zeros(1, np.uint64), np.ones(1))
  time.sleep(0.2)
  ref, threads = weakref.ref(it), [t for t in (it._thread, it._updater) if t is not None]
  del it
  deadline = time.monotonic() + 5
  while ref() is not None and time.monotonic() < deadline:   # (a thread holds it for one slice)
    gc.collect()
    time.sleep(0.01)
  assert ref() is None
  for thread in threads:
    thread.join(5)
    assert not thread.is_alive()


def _prioritized(server_factory, count: int, limiter=None):
  """(SharedTable, keys) of a Prioritized(1.0) table "t" holding `count` items of priority 1."""
  server = server_factory([_table(sampler=selectors.Prioritized(1.0), limiter=limiter)])
  st = server.shared_table("t")
  return st, _fill(st, np.arange(count))


def _spin_holding_the_gil(seconds: float) -> None:
  """Keeps this thread busy in Python for `seconds` with a switch interval longer than that, so
  no other Python thread runs meanwhile (only code that needs no GIL progresses)."""
  old = sys.getswitchinterval()
  sys.setswitchinterval(30.0)
  try:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
      pass
  finally:
    sys.setswitchinterval(old)


def test_sampling_and_updates_progress_while_the_learner_holds_the_gil(server_factory):
  st, keys = _prioritized(server_factory, 64)
  with BatchIterator(st, batch_size=8, prefetch=4, timeout_ms=5000) as it:
    next(it)
    next(it)   # (the native sampler gathers from the second batch on)
    assert it._native_sampling and it._updater is None
    time.sleep(0.3)   # the ring fills: 4 batches ready
    before = it._native.stats()[0]   # batches the native sampler gathered
    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
      for _ in range(4):   # frees 4 buffers (all ready: no wait, the GIL is never released)
        next(it)
      it.update_priorities(keys, np.full(64, 3.0))
      _spin_holding_the_gil(0.5)
      gathered = it._native.stats()[0]
      stats = it.stats
    finally:
      sys.setswitchinterval(old)
    # Gathered and applied by threads that never took the GIL while this one held it.
    assert gathered - before == 4, (before, gathered)   # every freed buffer, no more
    assert stats["keys_updated"] == 64 and stats["updates_pending"] == 0
  assert set(st.items()["priority"].tolist()) == {3.0}


def test_updates_stay_in_call_order_when_a_device_copy_update_starts_the_python_updater(
    server_factory):
  st, keys = _prioritized(server_factory, 4)
  gate = threading.Event()
  with BatchIterator(st, batch_size=4, timeout_ms=5000) as it:
    next(it)
    it.update_priorities(keys, np.full(4, 2.0))               # native queue
    it._queue_async_update(keys[:2], 2, None, lambda: gate.wait(5) and np.array([5.0, 6.0]))
    it.update_priorities(keys[1:2], np.array([7.0]))          # after the device copy's
    assert it._updater is not None and it._updater.is_alive()
    gate.set()
    it.flush(timeout_ms=5000)
    assert it.stats["priority_updates"] == 3 and it.stats["keys_updated"] == 7
  assert st.items()["priority"].tolist() == [5.0, 7.0, 2.0, 2.0]


def test_fast_update_path_rejects_what_the_general_path_rejects_and_changes_nothing(
    server_factory):
  st, keys = _prioritized(server_factory, 8)
  with BatchIterator(st, batch_size=4, timeout_ms=5000) as it:
    next(it)
    next(it)
    assert it._native_sampling and it._updater is None   # (the one-C-call path applies)
    bad = [(np.full(8, -1, np.int64), np.ones(8), ValueError, ">= 0"),
           (keys, np.full(8, np.nan), ValueError, "finite"),
           (keys, np.full(8, np.inf, np.float32), ValueError, "finite"),
           (keys, np.full(8, -1.0), ValueError, ">= 0 for a Prioritized"),
           (keys, np.ones(7), ValueError, "one value per key"),
           (keys.astype(np.float64), np.ones(8), TypeError, "unsigned 64-bit"),
           (keys, np.ones(8, np.int64), TypeError, "floating dtype")]
    for k, p, error, match in bad:
      with pytest.raises(error, match=match):
        it.update_priorities(k, p)
    it.flush(timeout_ms=5000)
    assert st.items()["priority"].tolist() == [1.0] * 8
    assert it.stats["priority_updates"] == 0
    # float32 priorities as they are; float16 and strided arrays converted
    it.update_priorities(keys, np.full(8, 2.0, np.float32))
    it.update_priorities(keys[:2], np.array([3.0, -9.0, 4.0, -9.0])[::2])
    it.update_priorities(keys[2:3], np.array([5.0], np.float16))
    it.flush(timeout_ms=5000)
    assert it.stats["priority_updates"] == 3 and it.stats["keys_updated"] == 11
  assert st.items()["priority"].tolist() == [3.0, 4.0, 5.0] + [2.0] * 5


def test_the_native_sampler_applies_updates_in_call_order(server_factory):
  st, keys = _prioritized(server_factory, 4)
  with BatchIterator(st, batch_size=4, prefetch=2, timeout_ms=5000) as it:
    next(it)
    for v in range(1, 201):   # (updates of one key, interleaved with gathers)
      it.update_priorities(keys[:2], np.array([float(v), 1000.0 - v]))
      if v % 10 == 0:
        next(it)
    it.flush(timeout_ms=5000)
    assert it._native_sampling and it._updater is None
    assert it.stats["priority_updates"] == 200 and it.stats["keys_updated"] == 400
  assert st.items()["priority"].tolist()[:2] == [200.0, 800.0]


@contextlib.contextmanager
def _blocked_native_sampler(server_factory, timeout_ms=5000):
  """(SharedTable, keys, iterator): 8 items of a table allowing one sample per insert, two
  batches of 4 taken, so the native sampler runs and waits on the rate limiter."""
  limiter = rate_limiters.SampleToInsertRatio(1.0, 1, (0.0, 100.0))   # a sample per insert
  st, keys = _prioritized(server_factory, 8, limiter)   # 8 samples allowed: two batches of 4
  with BatchIterator(st, batch_size=4, prefetch=2, timeout_ms=timeout_ms) as it:
    next(it)
    next(it)
    time.sleep(0.1)
    assert it._native_sampling and it.stats["batches"] == 2
    yield st, keys, it


def test_updates_land_while_the_native_sampler_waits_for_the_rate_limiter(server_factory):
  with _blocked_native_sampler(server_factory) as (st, keys, it):
    start = time.monotonic()
    it.update_priorities(keys, np.full(8, 6.0))
    it.flush(timeout_ms=3000)   # applied by the sampler between its waits for items
    assert time.monotonic() - start < 1.0
    assert st.items()["priority"].tolist() == [6.0] * 8
    with pytest.raises(errors.DeadlineExceededError):
      next(it)   # still blocked: no insert came
    start = time.monotonic()
  assert time.monotonic() - start < 2.0   # close() ends the waiting sampler


def test_next_applies_queued_updates_while_it_waits_for_a_batch(server_factory):
  """A learner that outpaces sampling: next() finds no batch ready and applies the queued
  updates itself (in call order) before it waits, rather than leaving them to the sampler,
  which is blocked here and applies them only between its waits of 2 ms."""
  with _blocked_native_sampler(server_factory, timeout_ms=60) as (st, keys, it):
    assert it.stats["updates_applied_waiting"] == 0
    for v in range(1, 11):
      it.update_priorities(keys, np.arange(8) + 10.0 * v)
      with pytest.raises(errors.DeadlineExceededError):
        next(it)   # blocked: no insert came
      assert it.stats["updates_pending"] == 0
    stats = it.stats
    assert stats["priority_updates"] == 10 and stats["keys_updated"] == 80
    assert stats["updates_applied_waiting"] >= 5   # (the sampler may take a few at random)
  assert st.items()["priority"].tolist() == (np.arange(8) + 100.0).tolist()


@pytest.mark.timeout(60)
def test_the_native_update_queue_is_bounded(server_factory):
  """More than 2**20 keys queued (the sampler, blocked on the rate limiter, applies only between
  its waits): update_priorities applies the backlog itself before it returns, in order."""
  absent = np.arange(10**9, 10**9 + 1_100_000, dtype=np.uint64)     # keys not in the table
  with _blocked_native_sampler(server_factory) as (st, keys, it):
    for v in (2.0, 3.0):
      it.update_priorities(np.concatenate([keys, absent]), np.full(len(absent) + 8, v))
      assert it.stats["updates_pending"] <= 1 << 20
    it.flush(timeout_ms=10_000)
    assert it.stats["keys_skipped"] == 2 * len(absent) and it.stats["keys_updated"] == 16
  assert st.items()["priority"].tolist() == [3.0] * 8


@pytest.mark.timeout(60)
def test_the_python_update_queue_is_bounded(server_factory):
  """The Python updater (here: started by an update that waits for a device copy) busy: past
  2**20 queued keys, update_priorities waits until the updater takes them; then every key
  lands, in order."""
  st, keys = _prioritized(server_factory, 8)
  absent = np.arange(10**9, 10**9 + 600_000, dtype=np.uint64)   # keys not in the table
  gate = threading.Event()

  def slow():   # round 1: the updater waits on this "device copy"
    assert gate.wait(20)
    return np.full(8, 1.5)
  pushed = []

  def push():
    for v in (2.0, 3.0):
      it.update_priorities(np.concatenate([keys, absent]), np.full(len(absent) + 8, v))
      pushed.append(v)
  with BatchIterator(st, batch_size=4, timeout_ms=5000) as it:
    it._queue_async_update(keys, 8, None, slow)
    time.sleep(0.1)
    pusher = threading.Thread(target=push)
    pusher.start()
    time.sleep(0.5)
    assert pushed == [2.0] and it._queued_keys == len(absent) * 2 + 16   # the 2nd call waits
    gate.set()
    pusher.join(20)
    assert not pusher.is_alive() and pushed == [2.0, 3.0]
    it.flush(timeout_ms=20_000)
    assert it.stats["keys_skipped"] == 2 * len(absent) and it.stats["keys_updated"] == 24
  assert st.items()["priority"].tolist() == [3.0] * 8


def _batch_scheduled_threads() -> int:
  """Threads of this process under the SCHED_BATCH policy."""
  count = 0
  for tid in os.listdir("/proc/self/task"):
    try:
      count += os.sched_getscheduler(int(tid)) == os.SCHED_BATCH
    except OSError:   # (ended meanwhile)
      pass
  return count


def _settled_batch_threads(timeout_s=5.0) -> int:
  """_batch_scheduled_threads once two reads 50 ms apart agree (or at timeout_s)."""
  deadline, last = time.monotonic() + timeout_s, -1
  while True:
    now = _batch_scheduled_threads()
    if now == last or time.monotonic() > deadline:
      return now
    last = now
    time.sleep(0.05)


def _batch_threads_reach(count, timeout_s=5.0) -> bool:
  """Whether _batch_scheduled_threads equals count within timeout_s (a thread that ended its
  work leaves /proc/self/task a little later)."""
  deadline = time.monotonic() + timeout_s
  while _batch_scheduled_threads() != count:
    if time.monotonic() > deadline:
      return False
    time.sleep(0.01)
  return True


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_native_threads_run_as_sched_batch_and_end_at_close(server_factory):
  server = server_factory([_table()])
  st = server.shared_table("t")
  _fill(st, np.arange(16))
  before = _settled_batch_threads()   # (threads of earlier tests' iterators may be ending)
  with BatchIterator(st, batch_size=4, prefetch=2, timeout_ms=5000) as it:
    next(it)
    next(it)
    assert it._native_sampling
    assert _batch_threads_reach(before + 2)   # the sampler and the updater
  assert _threads_ended(it)
  assert _batch_threads_reach(before), (_batch_scheduled_threads(), before)
