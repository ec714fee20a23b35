"""fork safety and Python's resource tracker.

A forked child re-registers its own process slot on first use, so SharedTable and Client work
there; a TrajectoryWriter created before the fork refuses with a clear "re-attach after fork"
style error (its chunks are the parent's). Nothing ever deadlocks on a lock held by another
thread of the parent at fork time.
"""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import reverb_shm
from reverb_shm import rate_limiters, selectors
from reverb_shm._internal import shm

from conftest import run_in_fork

pytestmark = pytest.mark.timeout(120)


def _table(max_size=100):
  return reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), max_size,
                          rate_limiters.MinSize(1))


@pytest.fixture
def server(server_factory):
  return server_factory([_table()])


def _reap(server):
  n = reverb_shm._internal._lib.ffi.new("uint32_t *")  # pylint: disable=protected-access
  reverb_shm._internal._lib.check(reverb_shm._internal._lib.lib.rs_reap(server.segment.base, n))  # pylint: disable=protected-access
  return n[0]


def test_shared_table_in_a_forked_child_registers_its_own_slot(server):
  st = server.shared_table("t")
  st.insert({"x": np.arange(3.0)}, 1.0)
  parent_slot = server.segment.slot

  def child():
    st.insert({"x": np.array([7.0])}, 1.0)
    got = sorted(float(s.data[0]) for s in st.sample(50))
    return f"{server.segment.slot} {got[-1]}"

  out = run_in_fork(child)
  assert out.startswith("OK"), out
  child_slot, biggest = out.split()[1:]
  assert int(child_slot) != parent_slot and float(biggest) == 7.0
  assert st.size == 4
  _reap(server)             # the child exited without unregistering
  assert server.segment.info()["live_procs"] == 1
  server.segment.check()


def test_client_in_a_forked_child_works(server):
  client = reverb_shm.Client(f"localhost:{server.port}")
  client.insert(np.float32(1.5), {"t": 1.0})

  def child():
    client.insert(np.float32(2.5), {"t": 1.0})
    return client.server_info()["t"].current_size

  assert run_in_fork(child) == "OK 2"
  assert server.shared_table("t").size == 2


def test_trajectory_writer_from_before_the_fork_refuses_clearly(server):
  client = reverb_shm.Client(f"localhost:{server.port}")
  writer = client.trajectory_writer(num_keep_alive_refs=2)
  writer.append({"x": np.float32(1.0)})

  def child():
    writer.append({"x": np.float32(2.0)})
    writer.create_item("t", 1.0, writer.history["x"][-2:])
    writer.flush()
    return "written"

  out = run_in_fork(child)
  assert out.startswith("ERR TableClosedError") and "re-attach after fork" in out, out
  # The parent's writer is unaffected.
  writer.append({"x": np.float32(2.0)})
  writer.create_item("t", 1.0, writer.history["x"][-2:])
  writer.flush()
  writer.close()
  item = server.shared_table("t").sample(1)[0]
  assert item.data[0].tolist() == [1.0, 2.0]


def test_fork_while_another_thread_holds_the_segment_cache_lock(server):
  held, release = threading.Event(), threading.Event()

  def hold():
    with shm.Segment._cache_lock:  # pylint: disable=protected-access
      held.set()
      release.wait(30)

  thread = threading.Thread(target=hold)
  thread.start()
  try:
    assert held.wait(10)
    out = run_in_fork(lambda: shm.Segment.attach(server.name).info()["num_tables"], timeout=20)
  finally:
    release.set()
    thread.join(10)
  assert out == "OK 1"


def test_fork_while_other_threads_hammer_the_table(server):
  """Threads of the parent insert in a loop (taking the table lock thousands of times a
  second) while the parent forks; the lock may be held by a live parent thread at fork time,
  and the child's sample must still complete (it waits only until that thread unlocks)."""
  st = server.shared_table("t")
  stop = threading.Event()

  def hammer():
    while not stop.is_set():
      st.insert({"x": np.arange(4.0)}, 1.0)

  threads = [threading.Thread(target=hammer) for _ in range(2)]
  for t in threads:
    t.start()
  try:
    for _ in range(10):
      out = run_in_fork(lambda: len(st.sample(8, timeout_ms=5000)), timeout=20)
      assert out == "OK 8", out
  finally:
    stop.set()
    for t in threads:
      t.join(10)
  assert not any(t.is_alive() for t in threads)
  _reap(server)
  server.segment.check()


def test_child_killed_while_the_parent_waits_does_not_disturb_the_parent(server):
  st = server.shared_table("t")
  pid = os.fork()
  if pid == 0:
    try:
      while True:
        st.insert({"x": np.arange(8.0)}, 1.0)
        st.sample(4)
    finally:
      os._exit(1)  # pylint: disable=protected-access
  time.sleep(0.3)
  os.kill(pid, signal.SIGKILL)
  os.waitpid(pid, 0)
  assert _reap(server) == 1
  server.segment.check()
  assert len(st.sample(4, timeout_ms=1000)) == 4


# ---- multiprocessing start methods and the resource tracker

_TRACKER_SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, os, sys, warnings
    import numpy as np
    import reverb_shm
    from reverb_shm import selectors, rate_limiters
    from reverb_shm._internal import shm
    warnings.simplefilter("always")

    def child(name):
      st = reverb_shm.SharedTable.attach(name + "/t")
      st.insert({"x": np.arange(2.0)}, 1.0)
      assert len(st.sample(2)) == 2
      client = reverb_shm.Client("shm://" + name)
      client.insert(np.float32(1.0), {"t": 1.0})

    if __name__ == "__main__":
      method, name = sys.argv[1], sys.argv[2]
      t = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100,
                           rate_limiters.MinSize(1))
      server = reverb_shm.Server([t], name=name, arena_bytes=1 << 20)
      ctx = mp.get_context(method)
      for _ in range(2):
        p = ctx.Process(target=child, args=(name,))
        p.start()
        p.join(60)
        assert p.exitcode == 0, p.exitcode
      assert os.path.exists(shm.segment_path(name))
      assert server.shared_table("t").size == 6
      print("SEGMENT_SURVIVED", flush=True)
      server.stop()
""")


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_resource_tracker_never_touches_our_segments(method, server_name, tmp_path):
  script = tmp_path / "tracker.py"
  script.write_text(_TRACKER_SCRIPT)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
  proc = subprocess.run([sys.executable, "-W", "always", str(script), method, server_name],
                        capture_output=True, text=True, timeout=100, env=env, cwd=root)
  assert proc.returncode == 0, proc.stderr
  assert "SEGMENT_SURVIVED" in proc.stdout
  assert "resource_tracker" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr
  assert "Warning" not in proc.stderr, proc.stderr
  assert not os.path.exists(shm.segment_path(server_name))
