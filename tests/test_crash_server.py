"""Server process death (kill -9) and resource exhaustion at creation.

Decision (README "Failure model", Server docstring): processes already attached keep working on
the mapped tables; a call that blocks fails with DeadOwnerError within one wait slice; a new
attach fails with DeadOwnerError; `reverb-shm gc` or a new server of the same name removes the
stale segment.
"""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import reverb_shm
from reverb_shm import cli, errors
from reverb_shm._internal import shm

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SERVE = textwrap.dedent("""
    import sys, time, reverb_shm
    from reverb_shm import selectors, rate_limiters
    t = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100, rate_limiters.MinSize(1))
    limited = reverb_shm.Table("limited", selectors.Uniform(), selectors.Fifo(), 100,
                               rate_limiters.SampleToInsertRatio(1.0, 1, 1.0))
    s = reverb_shm.Server([t, limited], name=sys.argv[1], arena_bytes=int(sys.argv[2]))
    print(s.port, flush=True)
    time.sleep(120)
""")


def _start_server(name, arena_bytes=4 << 20):
  proc = subprocess.Popen([sys.executable, "-c", _SERVE, name, str(arena_bytes)],
                          stdout=subprocess.PIPE, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
  port = int(proc.stdout.readline())
  return proc, port


def _kill(proc):
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=10)


@pytest.fixture
def dead_server(server_name):
  """(name, port, SharedTable attached before the kill) of a SIGKILLed server process."""
  proc, port = _start_server(server_name)
  try:
    st = reverb_shm.SharedTable.attach(f"{server_name}/t")
    st.insert({"x": np.arange(4.0)}, 1.0)
  finally:
    _kill(proc)
  yield server_name, port, st
  shm.remove_stale(names=[server_name])


def test_blocked_sampler_notices_the_server_died(server_name):
  proc, _ = _start_server(server_name)
  try:
    st = reverb_shm.SharedTable.attach(f"{server_name}/t")   # empty: sample blocks
    result = {}

    def sample():
      try:
        st.sample(1)                                   # no timeout: waits forever
      except Exception as e:  # pylint: disable=broad-except
        result["error"] = e

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()
  finally:
    _kill(proc)
  t0 = time.monotonic()
  thread.join(10)
  assert not thread.is_alive(), "a waiter hung on a dead server"
  assert time.monotonic() - t0 < 2
  assert isinstance(result["error"], errors.DeadOwnerError)
  assert f"pid {proc.pid}" in str(result["error"]) and "reverb-shm gc" in str(result["error"])
  shm.remove_stale(names=[server_name])


def test_blocked_inserter_notices_the_server_died(server_name):
  proc, _ = _start_server(server_name)
  try:
    st = reverb_shm.SharedTable.attach(f"{server_name}/limited")
    st.insert({"x": np.arange(2.0)}, 1.0)   # inserts now wait for samples (ratio 1, error 1)
    with pytest.raises(errors.DeadlineExceededError):
      st.insert({"x": np.arange(1.0)}, 1.0, timeout_ms=50)
  finally:
    _kill(proc)
  t0 = time.monotonic()
  with pytest.raises(errors.DeadOwnerError, match="is dead"):
    st.insert({"x": np.arange(1.0)}, 1.0)
  assert time.monotonic() - t0 < 2
  shm.remove_stale(names=[server_name])


def test_a_killed_server_not_yet_reaped_is_dead(server_name):
  """A SIGKILLed server whose parent has not waited for it (a zombie) is dead: a blocked
  sampler gets DeadOwnerError, and new clients take no process slots of it."""
  proc, port = _start_server(server_name)
  try:
    st = reverb_shm.SharedTable.attach(f"{server_name}/t")   # empty: sample blocks
    proc.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
      assert time.monotonic() < deadline
      time.sleep(0.01)
    t0 = time.monotonic()
    with pytest.raises(errors.DeadOwnerError, match=f"pid {proc.pid}"):
      st.sample(1, timeout_ms=5000)
    assert time.monotonic() - t0 < 2
    for _ in range(200):   # more than the server's process slots (128)
      with pytest.raises((errors.DeadOwnerError, errors.ServerUnavailableError)):
        next(reverb_shm.Client(f"localhost:{port}").sample("t", 1, rate_limiter_timeout_ms=0))
  finally:
    _kill(proc)
    shm.remove_stale(names=[server_name])


def test_attached_processes_keep_working_on_the_mapped_tables(dead_server):
  _, _, st = dead_server
  st.insert({"x": np.array([10.0])}, 1.0)
  assert st.size == 5
  values = {float(s.data[0]) for s in st.sample(200)}
  assert values == {0.0, 1.0, 2.0, 3.0, 10.0}
  assert st.mutate(deletes=[int(st.items()[0]["key"])]) == (0, 1)
  assert st.size == 4
  st.segment.check()


def test_new_attach_to_a_dead_server_is_a_clear_error(dead_server):
  name, port, _ = dead_server
  # A process that never attached before (its own segment cache) gets DeadOwnerError.
  code = ("import sys\nfrom reverb_shm import errors\nfrom reverb_shm._internal import shm\n"
          "try:\n  shm.Segment.attach(sys.argv[1])\n"
          "except errors.DeadOwnerError as e:\n  print('DEAD', e)\n")
  out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}).stdout
  assert out.startswith("DEAD") and "reverb-shm gc" in out
  # The dead server's port alias no longer resolves (server_info waits for a server to come).
  with pytest.raises((errors.ServerUnavailableError, errors.DeadlineExceededError),
                     match=f"{port}"):
    reverb_shm.Client(f"localhost:{port}").server_info(timeout=0.3)


def test_gc_after_kill_removes_segment_and_alias_and_mapped_data_stays_readable(dead_server,
                                                                             capsys):
  name, port, st = dead_server
  views = [s.data[0] for s in st.sample(8)]
  assert cli.main(["gc", name]) == 0
  out = capsys.readouterr().out
  assert shm.segment_path(name) in out and f"rvshm.port.{port}" in out
  assert not os.path.exists(shm.segment_path(name))
  assert {float(v) for v in views} <= {0.0, 1.0, 2.0, 3.0}
  st.segment.close()            # forget the cached mapping: attaching again finds nothing
  with pytest.raises(errors.ServerUnavailableError, match="no reverb_shm server named"):
    shm.Segment.attach(name)


def test_new_server_over_a_stale_segment_reclaims_the_name(dead_server, server_factory):
  name, _, old = dead_server
  server = server_factory([reverb_shm.Table("t", reverb_shm.selectors.Uniform(),
                                            reverb_shm.selectors.Fifo(), 10,
                                            reverb_shm.rate_limiters.MinSize(1))], name=name)
  fresh = server.shared_table("t")
  assert fresh.size == 0 and old.size == 4     # the old mapping is a different object
  fresh.insert({"x": np.arange(2.0)}, 1.0)
  assert fresh.size == 2 and old.size == 4


# ---- /dev/shm exhaustion

def test_arena_larger_than_free_dev_shm_says_need_and_have(server_name):
  st = os.statvfs(shm.SHM_DIR)
  free = st.f_bavail * st.f_frsize
  with pytest.raises(errors.ResourceExhaustedError, match=r"need [0-9.]+ MiB, /dev/shm has [0-9.]+ MiB free"):
    reverb_shm.Server([reverb_shm.Table("t", reverb_shm.selectors.Uniform(),
                                        reverb_shm.selectors.Fifo(), 10,
                                        reverb_shm.rate_limiters.MinSize(1))],
                      name=server_name, arena_bytes=free + (64 << 20))
  assert not os.path.exists(shm.segment_path(server_name))


_SMALL_TMPFS = textwrap.dedent("""
    import os, reverb_shm
    from reverb_shm import errors, selectors, rate_limiters
    t = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10, rate_limiters.MinSize(1))
    kw = dict(max_procs=4)
    a = reverb_shm.Server([t], name="fits", arena_bytes=5 << 20, **kw)   # 16 MiB tmpfs: fits
    for arena in (12 << 20, 64 << 20):
      try:
        reverb_shm.Server([t.replace()], name=f"nofit{arena}", arena_bytes=arena, **kw)
      except errors.ResourceExhaustedError as e:
        print("REFUSED", e, flush=True)
      assert not os.path.exists(f"/dev/shm/rvshm.nofit{arena}")
    st = a.shared_table("t")
    st.insert({"x": __import__("numpy").zeros((4, 1000))}, 1.0)       # the fitting one works
    print("SIZE", st.size, flush=True)
    a.stop()
""")


def test_small_tmpfs_refuses_servers_that_do_not_fit():
  if os.geteuid() != 0 or shutil.which("unshare") is None:
    pytest.skip("needs root and unshare to mount a private small tmpfs on /dev/shm")
  cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {sys.executable} -c \"$0\"",
         _SMALL_TMPFS]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": ROOT})
  if proc.returncode != 0 and ("mount" in proc.stderr or "unshare" in proc.stderr):
    pytest.skip(f"cannot mount a private tmpfs here: {proc.stderr.strip()[:200]}")
  assert proc.returncode == 0, proc.stderr
  refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
  assert len(refused) == 2, proc.stdout
  for line in refused:
    assert "need" in line and "MiB free" in line
  assert "SIZE 4" in proc.stdout
