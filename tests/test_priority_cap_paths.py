"""Priorities above the sum-tree weight cap are refused at the call that provides them, on every
batched path (StepInserter, batched create_item, create_window_items), changing nothing; and the
other checks added with them (unsigned window starts, StepInserter across fork, remote
priority updates)."""
import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors

from conftest import run_in_fork

pytestmark = pytest.mark.timeout(60)
HUGE = 1e308   # weight 1e308 > float64 max / (2 * leaves) for any table


def _prioritized(name="t", max_size=1000):
  return reverb_shm.Table(name, selectors.Prioritized(1.0), selectors.Fifo(), max_size,
                          rate_limiters.MinSize(1))


def test_priority_bound_is_below_the_cap_and_infinite_without_prioritized(server_factory):
  server = server_factory([_prioritized("p"), reverb_shm.Table.queue("q", 10)])
  p, q = server.shared_table("p"), server.shared_table("q")
  cap = np.finfo(np.float64).max / (2 * 1008)      # 1001 records in groups of 8 leaves
  assert cap * 0.999 < p.priority_bound <= cap
  p.check_priority_cap([1.0, p.priority_bound])    # admitted: no exception
  with pytest.raises(errors.InvalidArgumentError, match=r"priority \[1\] = .* above the cap"):
    p.check_priority_cap([1.0, cap * 1.01])
  assert q.priority_bound == float("inf")


def test_step_inserter_refuses_an_over_cap_priority_and_keeps_working(server_factory):
  st = server_factory([_prioritized()]).shared_table("t")
  with st.step_inserter(capacity=4) as inserter:
    inserter.insert({"x": np.float32(0)}, 1.0)
    with pytest.raises(ValueError, match="above the cap"):
      inserter.insert({"x": np.float32(1)}, HUGE)
    assert inserter.pending == 1
    inserter.insert({"x": np.float32(2)}, 3.0)
  assert sorted(st.items()["priority"].tolist()) == [1.0, 3.0]


def test_writer_refuses_over_cap_priorities_at_the_call(server_factory):
  server = server_factory([_prioritized()])
  st = server.shared_table("t")
  writer = server.localhost_client().trajectory_writer(num_keep_alive_refs=10)
  writer.extend({"x": np.arange(10, dtype=np.float32)})
  writer.create_item("t", 1.0, {"x": writer.history["x"][-2:]})
  with pytest.raises(ValueError, match="above the cap"):
    writer.create_item("t", HUGE, {"x": writer.history["x"][-2:]})
  with pytest.raises(ValueError, match="above the cap"):   # nothing of the call is created
    writer.create_window_items("t", [1.0, 2.0, HUGE, 4.0], np.arange(-5, -1), 2)
  with pytest.raises(IndexError, match="out of range"):    # 2**64 - 1 must not wrap to -1
    writer.create_window_items("t", [1.0], np.array([2**64 - 1], np.uint64), 1)
  writer.flush()
  assert st.items()["priority"].tolist() == [1.0]
  writer.create_window_items("t", [5.0, 6.0], np.array([0, 1], np.uint64), 2)
  writer.flush()
  assert sorted(st.items()["priority"].tolist()) == [1.0, 5.0, 6.0]
  writer.close()


def test_step_inserter_refuses_to_flush_in_a_forked_child(server_factory):
  st = server_factory([_prioritized()]).shared_table("t")
  inserter = st.step_inserter(capacity=8)
  for i in range(3):
    inserter.insert({"x": np.float32(i)}, 1.0)
  out = run_in_fork(lambda: inserter.flush())
  assert out.startswith("ERR RuntimeError") and "fork" in out, out
  assert st.size == 0
  assert len(inserter.flush()) == 3 and st.size == 3   # the parent's steps, inserted once


def test_remote_priority_updates(server_factory):
  from reverb_shm.bridge import BridgeConfig, RemoteClient   # pylint: disable=import-outside-toplevel
  server = server_factory([_prioritized()], bridge=BridgeConfig())
  remote = RemoteClient(server.bridge_address, reconnect_timeout_s=2.0)
  remote.insert({"x": np.float32(1)}, {"t": 1.0})
  key = int(server.shared_table("t").items()["key"][0])
  remote.mutate_priorities("t", updates={key: 7.5, key + 1: 2.0})   # unknown keys are skipped
  assert server.shared_table("t").items()["priority"].tolist() == [7.5]


def test_a_failing_flush_on_exit_never_hides_the_blocks_error(server_factory):
  server = server_factory([_prioritized()])
  st = server.shared_table("t")
  with pytest.raises(KeyError, match="from the block"):
    with pytest.warns(RuntimeWarning, match="flushing on exit after KeyError failed"):
      with st.step_inserter(capacity=8) as inserter:
        inserter.insert({"x": np.float32(0)}, 1.0)
        server.stop()                       # the exit's flush fails: TableClosedError
        raise KeyError("from the block")
