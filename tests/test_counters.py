"""Operation counters (csrc/counters.c): values against known workloads, per-process rows merged
on read, blocked gauges, lock-hold histogram, and the stats() dicts built on them."""
import multiprocessing
import os
import threading
import time

import numpy as np
import pytest

import reverb_shm as reverb
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import counters


def _table(name="t", max_size=10, limiter=None, **kwargs):
  return reverb.Table(name, selectors.Uniform(), selectors.Fifo(), max_size,
                      limiter or rate_limiters.MinSize(1), **kwargs)


def test_counters_match_a_known_workload(server_factory):
  srv = server_factory([_table("t", 10), _table("m", 100, max_times_sampled=2)])
  client = srv.localhost_client()
  for i in range(25):   # 25 inserts into a table of 10: 15 evictions
    client.insert(np.float32([i, i]), {"t": 1.0, "m": 1.0})
  assert len(list(client.sample("t", num_samples=7))) == 7
  m = client.shared_table("m")
  keys = m.items()["key"][:5]
  m.update_priorities(keys[:3], [2.0, 2.0, 2.0])
  m.delete(keys[3:5])
  for _ in range(2):      # 20 samples of at most 23 items, each item at most twice
    m.sample_batch(10)
  stats = client.stats()
  t, mt = stats["tables"]["t"], stats["tables"]["m"]
  assert (t["inserts"], t["samples"], t["evictions"], t["updates"], t["deletes"]) == (25, 7, 15, 0, 0)
  assert t["items"] == 10 and t["full"] and t["max_size"] == 10
  assert t["insert_bytes"] == 25 * 8    # two float32 per item
  assert (mt["inserts"], mt["updates"], mt["deletes"], mt["samples"]) == (25, 3, 2, 20)
  assert mt["items"] == 23 - mt["expirations"]
  assert mt["limiter_inserts"] == 25 and mt["limiter_samples"] == 20
  assert mt["limiter_deletes"] == 2 + mt["expirations"]
  # every insert call, sample call and mutate call took the lock at least once
  assert t["lock_holds"] >= 25 + 1 and sum(t["lock_hold_histogram"]) == t["lock_holds"]
  assert 0 < t["lock_hold_p50_seconds"] <= t["lock_hold_p99_seconds"] < 1
  assert stats["chunks"] > 0 and stats["arena_used_bytes"] > 0
  assert stats["arena_used_bytes"] + stats["arena_free_bytes"] == stats["arena_bytes"]
  assert any(p["pid"] == os.getpid() and p["alive"] for p in stats["processes"])


def test_reset_keeps_totals_and_zeroes_the_limiter(server_factory):
  srv = server_factory([_table("t", 10)])
  client = srv.localhost_client()
  for i in range(4):
    client.insert(np.float32(i), {"t": 1.0})
  client.reset("t")
  t = client.stats()["tables"]["t"]
  assert t["inserts"] == 4 and t["items"] == 0 and t["limiter_inserts"] == 0


def _insert_n(name, n):
  client = reverb.Client(f"shm://{name}")
  for i in range(n):
    client.insert(np.float32(i), {"t": 1.0})
  list(client.sample("t", num_samples=3))


def test_rows_of_several_processes_are_summed_and_outlive_them(server_factory):
  srv = server_factory([_table("t", 1000)])
  ctx = multiprocessing.get_context("spawn")
  procs = [ctx.Process(target=_insert_n, args=(srv.name, 50 + 10 * i)) for i in range(3)]
  for p in procs:
    p.start()
  for p in procs:
    p.join(60)
    assert p.exitcode == 0
  t = srv.localhost_client().stats()["tables"]["t"]
  assert t["inserts"] == 50 + 60 + 70 and t["samples"] == 9 and t["items"] == 180


def test_blocked_gauges_show_waiting_threads(server_factory):
  srv = server_factory([_table("q", 100, rate_limiters.SampleToInsertRatio(1.0, 1, 2.0))])
  st = srv.shared_table("q")
  seen = []

  def sample():
    with pytest.raises(errors.DeadlineExceededError):
      st.sample(1, timeout_ms=2000)

  threads = [threading.Thread(target=sample) for _ in range(2)]
  for th in threads:
    th.start()
  deadline = time.monotonic() + 1.5
  while time.monotonic() < deadline:
    q = counters.read_table(srv.segment, 0)
    seen.append(q["blocked_samplers"])
    if q["blocked_samplers"] == 2:
      break
    time.sleep(0.01)
  assert max(seen) == 2 and not q["can_sample"] and q["blocked_inserters"] == 0
  for th in threads:
    th.join(10)
  q = counters.read_table(srv.segment, 0)
  assert q["blocked_samplers"] == 0 and q["sample_blocked_seconds"] >= 2 * 1.5


def test_shared_table_stats_keeps_its_keys_and_adds_counters(server_factory):
  srv = server_factory([_table("t", 10)])
  st = srv.shared_table("t")
  st.insert({"x": np.zeros((3, 2), np.float32)}, np.ones(3))
  s = st.stats()
  assert s["size"] == 3 and s["inserts"] == 3 and s["counters"]["inserts"] == 3
  assert s["counters"]["insert_bytes"] == 3 * 8


def test_quantile_reads_the_bucket_bounds():
  hist = [0] * 24
  hist[3] = 98   # [2**9, 2**10) ns
  hist[10] = 2   # [2**16, 2**17) ns
  assert counters._quantile(hist, 0.5) == pytest.approx(2**10 * 1e-9)
  assert counters._quantile(hist, 0.99) == pytest.approx(2**17 * 1e-9)
  assert counters._quantile([0] * 24, 0.5) == 0.0
  last = [0] * 23 + [5]
  assert counters._quantile(last, 0.5) == pytest.approx(2**29 * 1e-9)
