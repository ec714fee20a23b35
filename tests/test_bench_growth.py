"""bench/growth_g1.py's experimental design: every build creates the servers in another order
(the first server built tends to get the scattered physical pages), rounds of all builds are
pooled, servers are stopped whatever happens, and the physical-frame count is sound."""
import argparse
import os

import bench_modules
import numpy as np
import pytest

import reverb_shm as reverb

g1 = bench_modules.load("growth_g1")


class FakeServer:
  def __init__(self, kind, log):
    self.kind, self.log, self.segment = kind, log, None

  def stop(self):
    self.log.append(("stop", self.kind))


def _args(builds, rounds):
  return argparse.Namespace(builds=builds, rounds=rounds, round=0.001)


def _count_rounds(monkeypatch):
  """Replaces the timing of one round by a count of rounds per op (rate: 1.0)."""
  rounds = {}

  def rate(op, seconds):
    rounds[op] = rounds.get(op, 0) + 1
    return 1.0
  monkeypatch.setattr(g1, "_rate", rate)
  monkeypatch.setattr(g1, "frames_2mib", lambda seg: None)
  return rounds


def test_one_build_keeps_the_rounds_and_the_order(monkeypatch):
  rounds, seen = _count_rounds(monkeypatch), []

  def loops(srvs):
    seen.append(list(srvs))
    yield "loop", {k: k for k in srvs}
  rates, _ = g1.builds(_args(6, 5), ["a", "b"], lambda k: FakeServer(k, []), loops)
  assert seen == [["a", "b"]]
  assert rounds == {"a": 6, "b": 6}   # a warm-up and the 5 rounds asked for
  assert rates == {"loop": {"a": 1.0, "b": 1.0}}


def test_builds_rotate_creation_order_and_pool_rounds(monkeypatch):
  rounds, log, seen = _count_rounds(monkeypatch), [], []

  def make(kind):
    log.append(("make", kind))
    return FakeServer(kind, log)

  def loops(srvs):
    seen.append(list(srvs))
    yield "loop", {k: k for k in srvs}
  rates, frames = g1.builds(_args(3, 7), ["a", "b", "c"], make, loops, 3)
  assert seen == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
  assert [e for e in log if e[0] == "stop"] == [("stop", k) for o in seen for k in o]
  # 7 rounds over 3 builds: 4 a build (rounded up to an even number), + 1 warm-up each
  assert rounds == {"a": 15, "b": 15, "c": 15}
  assert rates == {"loop": {"a": 1.0, "b": 1.0, "c": 1.0}}
  assert frames == {"a": [None] * 3, "b": [None] * 3, "c": [None] * 3}


def test_builds_stop_every_server_when_a_loop_fails(monkeypatch):
  monkeypatch.setattr(g1, "frames_2mib", lambda seg: None)
  log = []

  def loops(srvs):
    raise RuntimeError("loop failed")
    yield  # pylint: disable=unreachable

  with pytest.raises(RuntimeError, match="loop failed"):
    g1.builds(_args(2, 4), ["a", "b"], lambda k: FakeServer(k, log), loops, 2)
  assert sorted(log) == [("stop", "a"), ("stop", "b")]


def test_frames_2mib_counts_the_segments_frames():
  table = reverb.Table("t", reverb.selectors.Uniform(), reverb.selectors.Fifo(), 1000,
                       reverb.rate_limiters.MinSize(1))
  with reverb.Server([table], arena_bytes=8 << 20) as srv:
    srv.shared_table("t").insert({"x": np.zeros((1000, 256), np.float32)},
                                 [1.0] * 1000)
    info = srv.segment.info()
    frames = g1.frames_2mib(srv.segment)
    pages = (info["arena_off"] + info["arena_used"]) // 4096 + 1
    if os.geteuid() == 0:   # frame numbers are visible to root only
      assert isinstance(frames, int) and 1 <= frames <= pages
    else:
      assert frames is None
