"""`reverb-shm gc` racing a server that is still creating its segment (real processes).

The creating process is slowed down at a chosen point of Segment.create (a patched
posix_fallocate or flock that sleeps) while this process runs gc against that name only, so
the suite never touches other people's segments in the shared /dev/shm.
"""
import contextlib
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import reverb_shm
from reverb_shm import cli, errors
from reverb_shm._internal import shm

pytestmark = pytest.mark.timeout(90)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# argv: server name, stage to slow down ("fallocate": creation lock held; "flock": before the
# creator takes its lock; "die": creator exits in the middle of creation).
_CREATE = textwrap.dedent("""
    import fcntl, os, sys, time
    import reverb_shm
    from reverb_shm import selectors, rate_limiters
    name, stage = sys.argv[1], sys.argv[2]

    def announce_then(real, pause):
      def slowed(*args):
        print("creating", flush=True)
        time.sleep(pause)
        if stage == "die":
          os._exit(3)
        return real(*args)
      return slowed

    if stage == "flock":   # only the creator's first blocking lock
      real_flock, first = fcntl.flock, [True]
      def flock(fd, op):
        if op == fcntl.LOCK_EX and first:
          first.clear()
          return announce_then(real_flock, 1.5)(fd, op)
        return real_flock(fd, op)
      fcntl.flock = flock
    else:
      os.posix_fallocate = announce_then(os.posix_fallocate, 1.5)
    table = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10,
                             rate_limiters.MinSize(1))
    server = reverb_shm.Server([table], name=name, arena_bytes=1 << 20)
    print("ready", server.port, flush=True)
    sys.stdin.readline()
    server.stop()
""")


def _start(name, stage):
  proc = subprocess.Popen([sys.executable, "-c", _CREATE, name, stage], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
  assert proc.stdout.readline() == "creating\n"
  return proc


@contextlib.contextmanager
def _creating(name, stage):
  """The creating process, paused at `stage`; killed on exit if still running."""
  proc = _start(name, stage)
  try:
    yield proc
  finally:
    proc.kill()
    proc.wait(timeout=10)


def _gc_during(name, seconds, capsys):
  """Runs `reverb-shm gc NAME` repeatedly for `seconds`; returns the paths it removed. Exit
  code 1 (and no output) only while nothing of NAME exists (e.g. after a gc removed it)."""
  removed = []
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    code = cli.main(["gc", name])
    out = capsys.readouterr()
    assert code == 0 or (code == 1 and out.out == "" and
                         out.err == f"reverb-shm gc: no server named {name!r} on this host (no "
                         "segment, port alias or sidecar file in /dev/shm)\n"), (code, out)
    removed += [line.split(" ", 1)[1] for line in out.out.splitlines()
                if line.startswith("removed /")]
    time.sleep(0.02)
  return removed


def _assert_serves(proc, name):
  line = proc.stdout.readline().split()
  assert line[0] == "ready", line
  assert os.path.exists(shm.segment_path(name))
  client = reverb_shm.Client(f"localhost:{line[1]}")
  client.insert(np.arange(3), {"t": 1.0})
  assert reverb_shm.SharedTable.attach(f"{name}/t").size == 1
  reverb_shm.SharedTable.attach(f"{name}/t").segment.close()
  proc.communicate("stop\n", timeout=30)
  assert proc.returncode == 0
  assert not os.path.exists(shm.segment_path(name))


def test_gc_leaves_a_segment_whose_creator_holds_the_creation_lock(server_name, capsys):
  with _creating(server_name, "fallocate") as proc:
    assert os.path.exists(shm.segment_path(server_name))
    assert [row["state"] for row in shm.list_segments([server_name])] == ["starting"]
    assert _gc_during(server_name, 1.0, capsys) == []
    # A second creator of the same name is refused instead of reclaiming the name.
    with pytest.raises(errors.SegmentInUseError, match="another process is creating"):
      reverb_shm.Server([reverb_shm.Table.queue("q", 1)], name=server_name, arena_bytes=1 << 20)
    _assert_serves(proc, server_name)


def test_creator_recovers_when_gc_wins_the_instant_before_its_lock(server_name, capsys):
  with _creating(server_name, "flock") as proc:
    # Created but not yet locked nor initialised: gc may judge it stale and unlink it ...
    assert _gc_during(server_name, 0.5, capsys) == [shm.segment_path(server_name)]
    # ... and the creator notices the name no longer refers to its file and creates it again.
    _assert_serves(proc, server_name)


def test_segment_of_a_creator_that_died_mid_creation_is_stale(server_name, capsys):
  proc = _start(server_name, "die")
  assert proc.wait(timeout=30) == 3
  assert [row["state"] for row in shm.list_segments([server_name])] == ["stale"]
  assert cli.main(["gc", server_name]) == 0
  assert f"removed {shm.segment_path(server_name)}" in capsys.readouterr().out
  assert not os.path.exists(shm.segment_path(server_name))
