"""The C core's batched paths: priority updates applied a round of keys at a time with a
level-by-level sum-tree update, batched random draws for Uniform/Prioritized picks, and the gather
of single-slice rows. Each must leave exactly what the one-item path leaves."""
import numpy as np
import pytest

import reverb_shm
from reverb_shm import rate_limiters, selectors

pytestmark = pytest.mark.timeout(120)

MUTATE_ROUND = 256   # keys per round in csrc/table.c (update_round)


def _tables(server_factory, sampler, remover, max_size, names=("batched", "single")):
  tables = [reverb_shm.Table(name, sampler, remover, max_size, rate_limiters.MinSize(1))
            for name in names]
  server = server_factory(tables)
  return [server.shared_table(name) for name in names]


def _insert(st, keys, priorities):
  keys = np.asarray(keys, np.uint64)
  st.insert({"k": keys.astype(np.int64)}, np.asarray(priorities, np.float64), keys=keys,
            timeout_ms=0)


def _update_plan(n_items, n_updates, seed):
  """Keys with repeats (inside one round and across rounds) and unknown keys, and priorities."""
  rng = np.random.default_rng(seed)
  keys = rng.integers(0, n_items, n_updates).astype(np.uint64)
  keys[1::7] = keys[0:-1:7]                       # a key repeated right after itself
  keys[MUTATE_ROUND + 3] = keys[2]                # ... and in the next round
  keys[5::50] = n_items + 10 + np.arange(len(keys[5::50]))   # unknown keys
  priorities = rng.random(n_updates) * 10
  priorities[::31] = 0.0                          # weight 0 even with exponent 0.6
  return keys, priorities


@pytest.mark.parametrize("remover", [selectors.Fifo(), selectors.MinHeap(),
                                     selectors.Prioritized(1.5)],
                         ids=["fifo", "minheap", "prioritized"])
def test_batched_update_leaves_what_one_at_a_time_leaves(server_factory, remover):
  n_items = 3000                                  # 4096 sum-tree leaves: > one round of keys
  batched, single = _tables(server_factory, selectors.Prioritized(0.6), remover, n_items)
  rng = np.random.default_rng(1)
  initial = rng.random(n_items) + 0.1
  for st in (batched, single):
    _insert(st, np.arange(n_items), initial)
  keys, priorities = _update_plan(n_items, 2 * MUTATE_ROUND + 77, seed=2)

  found = batched.update_priorities(keys, priorities)
  found_single = sum(single.update_priorities(keys[i:i + 1], priorities[i:i + 1])
                     for i in range(len(keys)))

  assert found == found_single == int((keys < n_items).sum())
  a, b = batched.items(), single.items()
  np.testing.assert_array_equal(a["key"], b["key"])
  np.testing.assert_array_equal(a["priority"], b["priority"])   # the last of repeated keys wins
  np.testing.assert_array_equal(a["update_seq"], b["update_seq"])
  last = {int(k): p for k, p in zip(keys, priorities) if k < n_items}
  expected = initial.copy()
  expected[list(last)] = list(last.values())
  np.testing.assert_array_equal(a["priority"], expected)
  # Every sum-tree node equals the sum of its children and every leaf its record's weight:
  # with the same priorities, the two tables' trees are the same tree.
  batched.check()
  single.check()


def test_batched_update_sets_the_sampling_distribution(server_factory):
  (st,) = _tables(server_factory, selectors.Prioritized(0.6), selectors.Fifo(), 100,
                  names=("t",))
  _insert(st, np.arange(5), np.ones(5))
  # Repeated keys in one batch: the last priority of each key counts.
  keys = np.array([4, 0, 1, 2, 3, 4, 0, 3, 9], np.uint64)
  priorities = np.array([100.0, 7.0, 1.0, 2.0, 9.0, 8.0, 0.5, 4.0, 3.0])
  assert st.update_priorities(keys, priorities) == 8
  final = np.array([0.5, 1.0, 2.0, 4.0, 8.0])
  weights = final**0.6
  expected = weights / weights.sum()
  n = 20000
  batch = st.sample_batch(n, timeout_ms=0)
  k = batch.info.key.astype(np.int64)
  counts = np.bincount(k, minlength=5)
  np.testing.assert_array_less(np.abs(counts / n - expected),
                               5 * np.sqrt(expected * (1 - expected) / n))
  np.testing.assert_allclose(batch.info.probability, expected[k], rtol=1e-12)
  np.testing.assert_array_equal(batch.info.priority, final[k])
  st.check()


def test_batched_update_keeps_heap_order_for_removal(server_factory):
  (st,) = _tables(server_factory, selectors.Uniform(), selectors.MinHeap(), 600, names=("t",))
  _insert(st, np.arange(600), np.arange(600) + 1000.0)
  # Lower 300 keys (in a shuffled order, over two rounds) to priorities 0..299.
  keys = np.random.default_rng(3).permutation(300).astype(np.uint64)
  assert st.update_priorities(keys, keys.astype(np.float64)) == 300
  st.check()
  # Each insert past max_size now removes the current minimum: keys 0, 1, 2, ...
  _insert(st, np.arange(1000, 1010), np.full(10, 5000.0))
  remaining = set(st.items()["key"].tolist())
  assert not remaining & set(range(10))
  assert set(range(10, 600)) <= remaining
  st.check()


def test_one_key_update_on_a_large_tree(server_factory):
  (st,) = _tables(server_factory, selectors.Prioritized(1.0), selectors.Fifo(), 5000,
                  names=("t",))
  _insert(st, np.arange(5000), np.ones(5000))
  assert st.update_priorities([4321], [4999.0]) == 1   # half the total
  batch = st.sample_batch(2000, timeout_ms=0)
  hits = batch.info.key == 4321
  np.testing.assert_allclose(batch.info.probability[hits], 0.5, rtol=1e-12)
  assert abs(hits.mean() - 0.5) < 5 * np.sqrt(0.25 / 2000)
  st.check()


@pytest.mark.parametrize("exponent", [0.6, 1.0, 1.5])
def test_bad_priority_late_in_a_multi_round_batch_changes_nothing(server_factory, exponent):
  (st,) = _tables(server_factory, selectors.Prioritized(exponent), selectors.Fifo(), 1000,
                  names=("t",))
  _insert(st, np.arange(1000), np.ones(1000))
  before = st.items()
  keys = np.arange(3 * MUTATE_ROUND, dtype=np.uint64) % 1000
  # 1e308**exponent is above the weight cap (float64 max / 2048) for exponent >= 1 only
  for bad in (np.nan, -1.0, np.inf) + ((1e308,) if exponent >= 1 else ()):
    priorities = np.full(len(keys), 2.0)
    priorities[-3] = bad
    with pytest.raises(ValueError):
      st.update_priorities(keys, priorities)
    after = st.items()
    np.testing.assert_array_equal(after["priority"], before["priority"])
    np.testing.assert_array_equal(after["update_seq"], before["update_seq"])
  st.check()


@pytest.mark.parametrize("n_items", [7, 1000])
def test_uniform_batched_draws_are_uniform(server_factory, n_items):
  (st,) = _tables(server_factory, selectors.Uniform(), selectors.Fifo(), n_items, names=("t",))
  _insert(st, np.arange(n_items), np.ones(n_items))
  n = 70 * n_items if n_items < 100 else 100_000
  keys = np.concatenate([st.sample_batch(min(n, 5000), timeout_ms=0).info.key
                         for _ in range(0, n, 5000)])[:n].astype(np.int64)
  counts = np.bincount(keys, minlength=n_items)
  p = 1 / n_items
  # Chi-square against uniform: mean n_items - 1, sd sqrt(2 (n_items - 1)); 6 sd.
  chi2 = ((counts - n * p)**2 / (n * p)).sum()
  assert chi2 < (n_items - 1) + 6 * np.sqrt(2 * (n_items - 1))
  assert counts.min() > 0


@pytest.mark.parametrize("deleted", [100, 600])
def test_uniform_draws_over_a_table_with_free_records_are_uniform(server_factory, deleted):
  """100 of 1000 deleted: picks draw records directly and reject the free ones; 600 deleted:
  picks go through the dense array. Either way each live item has probability 1/size."""
  (st,) = _tables(server_factory, selectors.Uniform(), selectors.Fifo(), 1000, names=("t",))
  _insert(st, np.arange(1000), np.ones(1000))
  gone = np.random.default_rng(deleted).choice(1000, deleted, replace=False)
  assert st.delete(gone.astype(np.uint64)) == deleted
  live = np.setdiff1d(np.arange(1000), gone)
  n = 100_000
  infos = [st.sample_batch(5000, timeout_ms=0).info for _ in range(n // 5000)]
  keys = np.concatenate([i.key for i in infos]).astype(np.int64)
  np.testing.assert_array_equal(np.concatenate([i.probability for i in infos]), 1 / len(live))
  counts = np.bincount(keys, minlength=1000)
  assert counts[gone].sum() == 0
  counts = counts[live]
  expected = n / len(live)
  chi2 = ((counts - expected)**2 / expected).sum()
  assert chi2 < (len(live) - 1) + 6 * np.sqrt(2 * (len(live) - 1))
  st.check()


def test_gather_copies_rows_of_every_small_size(server_factory):
  """Single-slice rows of 1..64 bytes (the inlined copy sizes and others) and a multi-row column."""
  sizes = [1, 2, 3, 4, 8, 12, 16, 24, 32, 40, 64, 72]
  table = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100,
                           rate_limiters.MinSize(1))
  st = server_factory([table]).shared_table("t")
  n = 50
  data = {f"c{s}": (np.arange(n * s, dtype=np.uint8).reshape(n, s) * 7 + s) for s in sizes}
  data["key"] = np.arange(n, dtype=np.int64)
  st.insert(data, np.ones(n), keys=np.arange(n, dtype=np.uint64), timeout_ms=0)
  batch = st.sample_batch(200, timeout_ms=0)
  keys = batch.info.key.astype(np.int64)
  flat = dict(zip(sorted(data), batch.data)) if isinstance(batch.data, list) else batch.data
  for name, column in data.items():
    np.testing.assert_array_equal(np.asarray(flat[name]), column[keys])
  st.check()


@pytest.mark.parametrize("row_bytes", [16383, 16384, 16385, 28224, 40001])
@pytest.mark.parametrize("rows", [1, 3])
def test_large_chunks_streamed_into_the_arena_read_back_exactly(server_factory, row_bytes, rows):
  """Chunks of >= 16 KiB are written with non-temporal stores (aligned body, copied head and
  tail): every byte reads back, through the gather and the zero-copy sample."""
  table = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10,
                           rate_limiters.MinSize(1))
  st = server_factory([table]).shared_table("t")
  data = np.random.default_rng(row_bytes).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
  st.insert({"x": data}, 1.0, keys=np.arange(rows, dtype=np.uint64), timeout_ms=0)
  batch = st.sample_batch(20, timeout_ms=0)
  got = batch.data[0] if isinstance(batch.data, list) else batch.data["x"]
  np.testing.assert_array_equal(np.asarray(got), data[batch.info.key.astype(np.int64)])
  for sample in st.sample(5, timeout_ms=0):
    np.testing.assert_array_equal(np.asarray(sample.data[0]), data[sample.info.key])
  st.check()


@pytest.mark.parametrize("exponent", [0.6, 1.0])
def test_largest_accepted_priorities_keep_the_total_finite(server_factory, exponent):
  """Priorities the weight cap admits without computing pow (exponent <= 1) sample normally."""
  (st,) = _tables(server_factory, selectors.Prioritized(exponent), selectors.Fifo(), 1000,
                  names=("t",))
  _insert(st, np.arange(1000), np.ones(1000))
  cap = np.finfo(np.float64).max / (2 * 1008)     # 1008 sum-tree leaves (groups of 8) for 1001 records
  big = 1e308 if exponent < 1 else 0.49 * cap
  assert st.update_priorities(np.arange(1000, dtype=np.uint64), np.full(1000, big)) == 1000
  batch = st.sample_batch(100, timeout_ms=0)
  np.testing.assert_allclose(batch.info.probability, 1 / 1000, rtol=1e-9)
  st.check()
  with pytest.raises(ValueError):
    st.update_priorities([0], [1.01 * cap if exponent == 1.0 else np.inf])


@pytest.mark.parametrize("max_size", [1, 3, 7, 62, 63, 64, 200, 4000])
def test_sum_tree_of_every_shape_samples_by_weight(server_factory, max_size):
  """Trees of 2 .. 4096 leaves (one level of 8-children groups or several; lines aligned from 64
  leaves on): invariants after inserts, batched updates and deletes; only weight > 0 sampled,
  at the right frequencies."""
  (st,) = _tables(server_factory, selectors.Prioritized(1.0), selectors.Fifo(), max_size,
                  names=("t",))
  rng = np.random.default_rng(max_size)
  priorities = rng.integers(0, 4, max_size).astype(np.float64)   # a quarter are 0
  priorities[-1] = 3.0
  _insert(st, np.arange(max_size), priorities)
  st.check()
  keys = rng.integers(0, max_size, 3 * max_size + 5).astype(np.uint64)
  new = rng.integers(0, 4, len(keys)).astype(np.float64)
  st.update_priorities(keys, new)
  for k, p in zip(keys, new):
    priorities[k] = p
  priorities[0] = 5.0
  st.update_priorities([0], [5.0])
  if max_size > 2:
    gone = np.arange(1, max_size, 3)
    st.delete(gone.astype(np.uint64))
    priorities[gone] = 0.0
  st.check()
  n = 20000
  batch = st.sample_batch(n, timeout_ms=0)
  k = batch.info.key.astype(np.int64)
  assert (priorities[k] > 0).all()
  expected = priorities / priorities.sum()
  counts = np.bincount(k, minlength=max_size)
  # Per key within 6 sd plus 6 counts (Poisson-safe for the ~7 expected counts per key of the
  # 4000-leaf tree: a false alarm about 1e-9 per key); the whole histogram by chi-square, about
  # 7 sd of its distribution above its mean of df.
  mean = n * expected
  np.testing.assert_array_less(np.abs(counts - mean), 6 * np.sqrt(mean) + 6)
  live = mean > 0
  df = live.sum() - 1
  if df >= 30:
    chi2 = ((counts[live] - mean[live]) ** 2 / mean[live]).sum()
    assert chi2 < df + 7 * np.sqrt(2 * df), (chi2, df)
  np.testing.assert_allclose(batch.info.probability, expected[k], rtol=1e-12)


def test_only_weight_left_in_a_large_tree_is_always_sampled(server_factory):
  (st,) = _tables(server_factory, selectors.Prioritized(0.6), selectors.Fifo(), 3000,
                  names=("t",))
  _insert(st, np.arange(3000), np.zeros(3000))
  assert st.update_priorities([2999, 37], [1e-300, 0.0]) == 2
  batch = st.sample_batch(500, timeout_ms=0)
  assert (batch.info.key == 2999).all()
  np.testing.assert_array_equal(batch.info.probability, 1.0)
  st.check()


def test_gathered_batches_release_their_pins_and_removed_items_free_their_data(server_factory):
  """rs_sample_gather drops the pins it took (without rs_unpin's validation pass): a pin log
  of 300 entries serves many batches of 256, and items removed meanwhile are freed."""
  table = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 500,
                           rate_limiters.MinSize(1))
  server = server_factory([table], pins_per_proc=300)
  st = server.shared_table("t")
  used = server._segment.info()["arena_used"]
  for i in range(40):
    keys = np.arange(50 * i, 50 * i + 50, dtype=np.uint64)
    st.insert({"x": np.repeat(keys[:, None], 4, axis=1).astype(np.float32)}, np.ones(50),
              keys=keys, timeout_ms=0)
    batch = st.sample_batch(256, timeout_ms=0)
    assert len(batch.info.key) == 256
    np.testing.assert_array_equal(np.asarray(batch.data[0]),
                                  np.repeat(batch.info.key[:, None], 4, axis=1).astype(np.float32))
  st.check()
  st.reset()
  st.check()
  assert server._segment.info()["arena_used"] == used
