"""Selectors through SharedTable: orders, distributions and reported probabilities (SPEC §3, §8)."""
import numpy as np
import pytest

import reverb_shm
from reverb_shm import rate_limiters, selectors

pytestmark = pytest.mark.timeout(60)


def _table(server_factory, sampler, remover=None, max_size=1000, max_times_sampled=0):
  table = reverb_shm.Table("t", sampler, remover or selectors.Fifo(), max_size,
                           rate_limiters.MinSize(1), max_times_sampled=max_times_sampled)
  return server_factory([table]).shared_table("t")


def _insert(st, keys, priorities):
  keys = np.asarray(keys, np.uint64)
  st.insert({"k": keys.astype(np.int64)}, np.asarray(priorities, np.float64), keys=keys,
            timeout_ms=0)


def _sample_keys(st, n):
  return [int(k) for k in st.sample_batch(n, timeout_ms=0).info.key]


@pytest.mark.parametrize("exponent", [1.0, 0.5, 2.0])
def test_prioritized_frequencies_match_priorities(server_factory, exponent):
  st = _table(server_factory, selectors.Prioritized(exponent))
  priorities = np.array([0.5, 1.0, 2.0, 4.0, 8.0])
  _insert(st, np.arange(5), priorities)
  weights = priorities**exponent
  expected = weights / weights.sum()
  n = 20000
  batch = st.sample_batch(n, timeout_ms=0)
  counts = np.bincount(batch.info.key.astype(np.int64), minlength=5)
  # 5 sigma of a binomial proportion.
  tolerance = 5 * np.sqrt(expected * (1 - expected) / n)
  np.testing.assert_array_less(np.abs(counts / n - expected), tolerance)
  np.testing.assert_allclose(batch.info.probability, expected[batch.info.key.astype(np.int64)],
                             rtol=1e-9)
  np.testing.assert_array_equal(batch.info.priority, priorities[batch.info.key.astype(np.int64)])
  assert (batch.info.table_size == 5).all()


def test_prioritized_zero_priority_never_sampled_even_with_exponent_zero(server_factory):
  st = _table(server_factory, selectors.Prioritized(0.0))
  _insert(st, [0, 1, 2], [0.0, 3.0, 7.0])
  batch = st.sample_batch(3000, timeout_ms=0)
  assert set(batch.info.key.tolist()) == {1, 2}
  np.testing.assert_allclose(batch.info.probability, 0.5)


def test_prioritized_all_zero_priorities_sample_uniformly(server_factory):
  st = _table(server_factory, selectors.Prioritized(1.0))
  _insert(st, [0, 1, 2, 3], [0.0] * 4)
  batch = st.sample_batch(4000, timeout_ms=0)
  counts = np.bincount(batch.info.key.astype(np.int64), minlength=4)
  assert (np.abs(counts / 4000 - 0.25) < 5 * np.sqrt(0.25 * 0.75 / 4000)).all()
  np.testing.assert_allclose(batch.info.probability, 0.25)


def test_prioritized_update_changes_distribution(server_factory):
  st = _table(server_factory, selectors.Prioritized(1.0))
  _insert(st, [0, 1], [1.0, 1.0])
  assert st.update_priorities([0], [0.0]) == 1
  assert set(_sample_keys(st, 500)) == {1}
  np.testing.assert_allclose(st.sample_batch(10, timeout_ms=0).info.probability, 1.0)


def test_uniform_probability_is_one_over_n(server_factory):
  st = _table(server_factory, selectors.Uniform())
  _insert(st, np.arange(8), np.arange(1, 9))
  batch = st.sample_batch(8000, timeout_ms=0)
  np.testing.assert_allclose(batch.info.probability, 1 / 8)
  counts = np.bincount(batch.info.key.astype(np.int64), minlength=8)
  assert (np.abs(counts / 8000 - 1 / 8) < 5 * np.sqrt((1 / 8) * (7 / 8) / 8000)).all()


def test_fifo_and_lifo_order(server_factory):
  fifo = _table(server_factory, selectors.Fifo(), max_times_sampled=1)
  lifo = _table(server_factory, selectors.Lifo(), selectors.Lifo(), max_times_sampled=1)
  for st in (fifo, lifo):
    _insert(st, [10, 11, 12, 13], [5.0, 1.0, 9.0, 2.0])
  fifo_batch = fifo.sample_batch(4, timeout_ms=0)
  assert fifo_batch.info.key.tolist() == [10, 11, 12, 13]
  assert fifo_batch.info.probability.tolist() == [1.0] * 4
  assert lifo.sample_batch(4, timeout_ms=0).info.key.tolist() == [13, 12, 11, 10]


def test_heap_order_and_tie_breaking(server_factory):
  mn = _table(server_factory, selectors.MinHeap())
  mx = _table(server_factory, selectors.MaxHeap())
  for st in (mn, mx):
    _insert(st, [1, 2, 3, 4], [3.0, 1.0, 3.0, 1.0])
  # Ties go to the least recently inserted or updated key.
  assert _sample_keys(mn, 3) == [2, 2, 2]
  assert _sample_keys(mx, 3) == [1, 1, 1]
  mn.update_priorities([2], [1.0])  # same priority: key 2 moves behind key 4
  mx.update_priorities([1], [3.0])
  assert _sample_keys(mn, 1) == [4]
  assert _sample_keys(mx, 1) == [3]
  mn.update_priorities([4], [-5.0])  # heaps accept negative priorities
  assert _sample_keys(mn, 1) == [4]
  assert mn.sample_batch(1, timeout_ms=0).info.probability.tolist() == [1.0]


def test_max_size_removes_remover_choice(server_factory):
  st = _table(server_factory, selectors.Uniform(), selectors.Fifo(), max_size=10)
  for k in range(15):
    _insert(st, [k], [1.0])
  assert sorted(st.items()["key"].tolist()) == list(range(5, 15))
  assert st.stats()["deletes"] == 5 and st.stats()["inserts"] == 15


def test_max_size_with_lifo_remover_can_evict_the_new_item(server_factory):
  st = _table(server_factory, selectors.Uniform(), selectors.Lifo(), max_size=3)
  _insert(st, [0, 1, 2, 3], [1.0] * 4)
  assert sorted(st.items()["key"].tolist()) == [0, 1, 2]


def test_max_times_sampled_removes_after_last_sample(server_factory):
  st = _table(server_factory, selectors.Fifo(), max_times_sampled=2)
  _insert(st, [7, 8], [1.0, 1.0])
  batch = st.sample_batch(3, timeout_ms=0)
  assert batch.info.key.tolist() == [7, 7, 8]
  assert batch.info.times_sampled.tolist() == [1, 2, 1]
  assert batch.info.table_size.tolist() == [2, 2, 1]  # size before the removal
  assert st.items()["key"].tolist() == [8]
  assert st.info.num_unique_samples == 2


def test_negative_priority_rejected_for_prioritized_only(server_factory):
  st = _table(server_factory, selectors.Prioritized(1.0))
  with pytest.raises(ValueError, match=">= 0"):
    _insert(st, [0], [-1.0])
  assert st.size == 0
  _insert(st, [0], [1.0])
  with pytest.raises(ValueError):
    st.mutate({0: 2.0, 1: -1.0})
  assert st.items()["priority"].tolist() == [1.0]
  st2 = _table(server_factory, selectors.Uniform())
  _insert(st2, [0], [-1.0])
  assert st2.size == 1
