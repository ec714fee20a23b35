"""Nothing left by the dead: what servers killed without stop() leave in /dev/shm (segments,
port aliases, sidecars) is reclaimed when any server starts, never a live or starting one's.

Each test runs in a private /dev/shm (its own tmpfs in a new mount namespace), so the space
used can be compared exactly before and after.
"""
import textwrap

import pytest

from conftest import run_in_private_shm, unique_server_name

pytestmark = pytest.mark.timeout(180)

_RECLAIM = textwrap.dedent("""
    import json, logging, os, signal, subprocess, sys, time
    import reverb_shm
    from reverb_shm import rate_limiters, selectors
    from reverb_shm._internal import shm

    def used():
      st = os.statvfs("/dev/shm")
      return (st.f_blocks - st.f_bfree) * st.f_frsize

    SERVE = '''
    import sys, time, numpy as np, reverb_shm
    from reverb_shm import selectors, rate_limiters, checkpointers
    t = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 1000, rate_limiters.MinSize(1))
    s = reverb_shm.Server([t], name=sys.argv[1], arena_bytes=8 << 20, max_procs=8,
                          checkpointer=checkpointers.DefaultCheckpointer(sys.argv[2]))
    c = s.localhost_client()
    with c.trajectory_writer(1) as w:
      for i in range(50):
        w.append({"x": np.full(1000, float(i))})
        w.create_item("t", 1.0, {"x": w.history["x"][-1:]})
    print(s.port, flush=True)
    time.sleep(120)
    '''
    base = used()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(name)s %(message)s")
    # A server still being created: its creator holds the creation lock of its segment.
    import fcntl, posix_ipc
    starting = posix_ipc.SharedMemory("/rvshm.starting", posix_ipc.O_CREX, mode=0o600)
    fcntl.flock(starting.fd, fcntl.LOCK_EX)
    os.posix_fallocate(starting.fd, 0, 1 << 20)
    live = reverb_shm.Server([reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10,
                                               rate_limiters.MinSize(1))], name="live",
                            arena_bytes=1 << 20, max_procs=8)
    pre = used()
    pre_files = set(os.listdir("/dev/shm"))
    procs = []
    try:
      for i in range(3):
        p = subprocess.Popen([sys.executable, "-c", SERVE, f"victim{i}",
                              f"/tmp/ckpt_reclaim_{os.getpid()}_{i}"], stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip().isdigit(), "victim server did not start"
    except BaseException:
      for p in procs:
        p.kill()
      raise
    with_victims = used()
    files_before = sorted(os.listdir("/dev/shm"))
    for p in procs:
      p.send_signal(signal.SIGKILL)
      p.wait()
    after_kill = used()
    fresh = reverb_shm.Server([reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10,
                                                rate_limiters.MinSize(1))], name="fresh",
                             arena_bytes=1 << 20, max_procs=8)
    # The fresh server's own files: its segment, port alias and checkpointer sidecar.
    fresh_bytes = sum(shm.allocated_bytes(os.path.join("/dev/shm", f))
                      for f in set(os.listdir("/dev/shm")) - pre_files)
    after_start = used()
    files = sorted(os.listdir("/dev/shm"))
    fresh.stop()
    # The live server and the starting segment were left alone.
    live_info = shm.Segment.attach("live").info()
    print("RESULT " + json.dumps(dict(
        base=base, pre=pre, with_victims=with_victims, after_kill=after_kill, after_start=after_start,
        fresh_bytes=fresh_bytes, files_before=files_before, files=files,
        live_owner=live_info["owner_pid"], me=os.getpid(),
        starting_left=os.path.exists("/dev/shm/rvshm.starting"))))
    live.stop()
    fcntl.flock(starting.fd, fcntl.LOCK_UN)
    starting.close_fd()
    posix_ipc.unlink_shared_memory("/rvshm.starting")
""")


def test_new_server_reclaims_what_killed_servers_left():
  import json
  out = run_in_private_shm(_RECLAIM, size_mib=256)
  result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
  victims = [f for f in result["files_before"] if "victim" in f]
  # Each victim left a segment, a port alias (named by port) and a checkpointer sidecar.
  assert len([f for f in victims if f.startswith("rvshm.victim")]) == 3
  assert len([f for f in victims if f.startswith("rvshm-checkpointer.victim")]) == 3
  assert len([f for f in result["files_before"] if f.startswith("rvshm.port.")]) == 4
  assert result["after_kill"] == result["with_victims"]       # a kill frees nothing by itself
  assert result["with_victims"] - result["base"] > 3 * (8 << 20)
  # After the new server started: only the live, the starting and the new server's files.
  assert not [f for f in result["files"] if "victim" in f], result["files"]
  assert "rvshm.live" in result["files"] and "rvshm.starting" in result["files"]
  assert len([f for f in result["files"] if f.startswith("rvshm.port.")]) == 2
  assert result["starting_left"] and result["live_owner"] == result["me"]
  # /dev/shm holds what it held before the victims started, plus the fresh server itself.
  assert result["after_start"] == result["pre"] + result["fresh_bytes"], result
  logs = [line for line in out.splitlines() if line.startswith("LOG reverb_shm.shm reclaimed")]
  assert len(logs) == 1 and "9 file(s)" in logs[0], out
  freed_mib = float(logs[0].split()[3])
  assert abs(freed_mib * (1 << 20) - (result["after_kill"] - result["pre"])) < 0.1 * (1 << 20)


_OTHER_USER = textwrap.dedent("""
    import sys
    from reverb_shm._internal import shm
    removed, freed = shm.reclaim_dead()
    print("REMOVED", removed)
    print("STATE", [r["state"] for r in shm.list_segments() if r["name"] == sys.argv[1]])
""")


def test_another_users_servers_are_left_alone_and_do_not_break_reclaiming():
  """A process of another user reclaims what dead servers left: the files of a live server
  it may not open (0600, another owner) are neither removed nor an error."""
  import os  # pylint: disable=import-outside-toplevel
  import shutil  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import reverb_shm  # pylint: disable=import-outside-toplevel
  from reverb_shm import rate_limiters, selectors  # pylint: disable=import-outside-toplevel
  if os.geteuid() != 0 or not shutil.which("setpriv"):
    pytest.skip("needs root and setpriv to run a process as another user")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  name = unique_server_name("foreign")
  server = reverb_shm.Server([reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10,
                                               rate_limiters.MinSize(1))],
                             name=name, max_bytes=16 << 20, max_procs=4)
  try:
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           sys.executable, "-c", _OTHER_USER, name], capture_output=True, text=True,
                          timeout=60, cwd="/tmp", env={"PYTHONPATH": root, "HOME": "/tmp"})
    if proc.returncode != 0 and "Permission denied" in proc.stderr and "python" in proc.stderr:
      pytest.skip(f"the other user cannot run this interpreter: {proc.stderr[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REMOVED []" in proc.stdout and "STATE ['foreign']" in proc.stdout, proc.stdout
    assert os.path.exists(f"/dev/shm/rvshm.{name}")
    assert os.path.exists(f"/dev/shm/rvshm.port.{server.port}")
  finally:
    server.stop()
