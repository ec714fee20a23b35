"""Rate limiters: SPEC §4 validation matrix and Reverb's worked examples on live tables."""
import sys

import numpy as np
import pytest

import reverb_shm
from reverb_shm import rate_limiters, selectors

pytestmark = pytest.mark.timeout(30)
FLOAT_MAX = sys.float_info.max


@pytest.mark.parametrize("spi,min_size,buffer", [
    (5, 10, 4), (0.5, 10, 0.9), (5, 10, (8, 12)), (0.1, 10, (9.5, 10.5)), (1, 10, (11, 15)),
    (1, 0, (-100, 100)), (0, 10, 100), (-1, 10, 100),
])
def test_sample_to_insert_ratio_rejects_invalid_ranges(spi, min_size, buffer):
  with pytest.raises(ValueError):
    rate_limiters.SampleToInsertRatio(spi, min_size, buffer)


@pytest.mark.parametrize("spi,min_size,buffer,expected", [
    (0.5, 10, 1.1, (5 - 1.1, 5 + 1.1)), (1, 10, (5, 9), (5, 9)), (1, 10, (7, 12), (7, 12)),
    (1, 10, 100, (-90, 110)), (1, 10, np.float32(2.5), (7.5, 12.5)),
    (1, 10, np.int64(3), (7, 13)),   # numpy scalars are numbers, not (min_diff, max_diff) pairs
])
def test_sample_to_insert_ratio_accepts_valid_ranges(spi, min_size, buffer, expected):
  rl = rate_limiters.SampleToInsertRatio(spi, min_size, buffer)
  assert (rl.samples_per_insert, rl.min_size_to_sample) == (spi, min_size)
  assert rl.min_diff == pytest.approx(expected[0]) and rl.max_diff == pytest.approx(expected[1])


def test_max_diff_below_offset_only_warns(caplog):
  rl = rate_limiters.SampleToInsertRatio(1, 10, (5, 9))
  assert rl.max_diff == 9
  assert any("max_diff" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("spi,min_size", [(0, 1), (-1, 1), (1, 0), (1, -5)])
def test_base_rate_limiter_rejects_nonpositive_spi_or_min_size(spi, min_size):
  with pytest.raises(ValueError):
    rate_limiters.RateLimiter(spi, min_size, -1, 1)


def test_min_size_queue_stack_numbers():
  assert rate_limiters.MinSize(3) == rate_limiters.RateLimiter(1.0, 3, -FLOAT_MAX, FLOAT_MAX)
  with pytest.raises(ValueError):
    rate_limiters.MinSize(0)
  q, s = rate_limiters.Queue(7), rate_limiters.Stack(7)
  assert (q.samples_per_insert, q.min_size_to_sample, q.min_diff, q.max_diff) == (1.0, 1, 0.0, 7)
  assert s == q


def _live(server_factory, rl, max_size=100, max_times_sampled=0):
  table = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), max_size, rl,
                           max_times_sampled=max_times_sampled)
  server = server_factory([table])
  return table, server.shared_table("t")


def _insert(st, n):
  st.insert({"x": np.zeros((n, 1), np.float32)}, np.ones(n), timeout_ms=0)


def test_worked_example_can_insert(server_factory):
  table, st = _live(server_factory, rate_limiters.RateLimiter(1.5, 2, 0, 5))
  assert [table.can_insert(n) for n in (1, 2, 3, 4)] == [True, True, True, False]
  _insert(st, 3)
  assert not table.can_insert(1)
  st.sample_records(2, timeout_ms=0)
  assert table.can_insert(1) and not table.can_insert(2)


def test_worked_example_can_sample(server_factory):
  table, st = _live(server_factory, rate_limiters.RateLimiter(1, 1, -1, 1))
  assert not table.can_sample(1)
  _insert(st, 1)
  assert [table.can_sample(n) for n in (1, 2, 3)] == [True, True, False]


def test_can_sample_ignores_max_times_sampled(server_factory):
  table, st = _live(server_factory, rate_limiters.MinSize(1), max_times_sampled=1)
  _insert(st, 2)
  assert table.can_sample(3)


def test_deletes_reblock_sampling_and_unblock_inserts(server_factory):
  table, st = _live(server_factory, rate_limiters.RateLimiter(1.0, 2, 0, 2))
  keys = st.insert({"x": np.zeros((2, 1), np.float32)}, np.ones(2), timeout_ms=0)
  assert table.can_sample(1) and not table.can_insert(1)
  assert st.delete(keys[:1]) == 1
  assert not table.can_sample(1)   # size 1 < min_size_to_sample 2
  assert table.can_insert(1)       # free-insert zone again
  info = table.info.rate_limiter_info
  assert (info.insert_stats.completed, info.sample_stats.completed) == (2, 0)


def test_insert_times_out_with_limiter_counters(server_factory):
  _, st = _live(server_factory, rate_limiters.Queue(2))
  _insert(st, 2)
  with pytest.raises(reverb_shm.DeadlineExceededError) as e:
    _insert(st, 1)
  msg = str(e.value)
  for part in ("'t'", "insert", "size=2", "inserts=2", "samples=0", "deletes=0", "max_diff=2"):
    assert part in msg
  recs, _ = st.sample_records(3, timeout_ms=0)  # flexible batch: the 2 the limiter allows
  assert len(recs) == 2
  with pytest.raises(reverb_shm.DeadlineExceededError, match="sample blocked"):
    st.sample_records(1, timeout_ms=0)


def test_reset_zeroes_counters(server_factory):
  table, st = _live(server_factory, rate_limiters.MinSize(1))
  _insert(st, 3)
  st.sample_records(2)
  st.reset()
  info = table.info
  assert info.current_size == 0
  assert info.rate_limiter_info.insert_stats.completed == 0
  assert info.rate_limiter_info.sample_stats.completed == 0


def test_negative_timeout_is_value_error(server_factory):
  _, st = _live(server_factory, rate_limiters.MinSize(1))
  with pytest.raises(ValueError, match="timeout_ms"):
    st.sample_records(1, timeout_ms=-1)
  assert st.size == 0
