"""Gathers that reuse the item layouts checked in earlier rounds (csrc/layout_cache.h: a
per-thread cache, valid while nothing was freed in the arena): after the items' blocks were freed
and their offsets reused by items of other rows and values, and while one thread alternates
between tables of different columns, every gathered row is still the sampled item's own."""
import numpy as np
import pytest

import reverb_shm
from reverb_shm import rate_limiters, selectors

pytestmark = pytest.mark.timeout(60)


def _table(name, max_size):
  return reverb_shm.Table(name, selectors.Uniform(), selectors.Fifo(), max_size,
                          rate_limiters.MinSize(1))


def _steps(start, n, width=3):
  v = np.arange(start, start + n)
  return {"obs": np.repeat(v[:, None], width, axis=1).astype(np.float32),
          "act": v.astype(np.int64), "rew": (v * 0.5).astype(np.float32)}


def _insert(st, index, start, n, calls, width=3):
  for b in range(calls):
    first = start + n * b
    for i, k in enumerate(st.insert(_steps(first, n, width), 1.0).tolist()):
      index[k] = first + i


def _gather_and_check(st, index, rounds, width=3):
  """`rounds` batches of 256; every row must be its key's values. Returns the blob offsets met."""
  for _ in range(rounds):
    batch = st.sample_batch(256)
    rows = np.array([index[k] for k in batch.info.key.tolist()])
    np.testing.assert_array_equal(batch.data[0], rows)                          # act
    np.testing.assert_array_equal(batch.data[1], np.repeat(rows[:, None], width, 1))
    np.testing.assert_array_equal(batch.data[2], rows * 0.5)
  recs, pins = st.sample_records(256)
  pins.release()
  return set((recs["desc_off"] & ((1 << 40) - 1)).tolist())


def test_gathers_after_the_items_blocks_were_freed_and_reused_read_the_new_items(server_factory):
  st = server_factory([_table("t", 600)]).shared_table("t")
  old = {}
  _insert(st, old, 0, 10, 60)                 # 600 items, 60 insert calls of 10 rows
  blobs_before = _gather_and_check(st, old, 20)   # (this thread's cache now holds their blobs)
  new = {}
  _insert(st, new, 1_000_000, 70, 9)          # 630 items of 70-row inserts: every old one evicted
  assert st.size == 600
  assert set(old).isdisjoint(int(k) for k in st.sample_batch(256).info.key)
  blobs_after = _gather_and_check(st, new, 20)
  # The old items' freed offsets hold new blobs (of other rows): a layout cached for the old
  # blob at an offset would gather the old item's rows, or rows at the old row shift.
  assert blobs_before & blobs_after
  st.check()


def test_one_thread_alternating_between_tables_of_other_columns(server_factory):
  server = server_factory([_table("narrow", 1000), _table("wide", 1000)])
  narrow, wide = server.shared_table("narrow"), server.shared_table("wide")
  index_n, index_w = {}, {}
  _insert(narrow, index_n, 0, 25, 20)
  _insert(wide, index_w, 50_000, 25, 20, width=5)
  for _ in range(10):
    _gather_and_check(narrow, index_n, 2)
    _gather_and_check(wide, index_w, 2, width=5)
  narrow.check()


def test_gathers_between_evicting_inserts_read_each_items_own_rows(server_factory):
  # A full table that evicts as it is written: every insert frees the oldest items' blocks, so the
  # arena's free count changes between any two gathers (the cache then goes by each blob's
  # allocation serial), and freed offsets hold other blobs (of other rows: inserts of 7 and 13
  # rows in turn). Every row gathered must be its item's own, and offsets must have been reused.
  st = server_factory([_table("t", 300)]).shared_table("t")
  index = {}
  _insert(st, index, 0, 10, 30)
  calls_at = {}   # blob offset -> the insert calls whose items were met there
  for step in range(80):
    _insert(st, index, 10_000 * (step + 1), 7 if step % 2 else 13, 1)
    _gather_and_check(st, index, 1)
    recs, pins = st.sample_records(256)
    for off, key in zip((recs["desc_off"] & ((1 << 40) - 1)).tolist(), recs["key"].tolist()):
      calls_at.setdefault(off, set()).add(index[key] // 10_000)
    pins.release()
  assert any(len(calls) > 1 for calls in calls_at.values())   # offsets were reused
  st.check()
