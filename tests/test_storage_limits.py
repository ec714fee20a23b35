"""Storage at its limits: a full arena (or a full /dev/shm, or a full disk-tier file) never locks
new processes out, failed growth gives its pages back, dead servers' files are found after a
reboot, forged sidecars and other pid namespaces are not fooled into unlinking anything, and bad
server settings are refused with clear errors.

Tests that fill /dev/shm run in a private one (its own tmpfs in a new mount namespace).
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import shm

from conftest import run_in_private_shm, unique_server_name

pytestmark = pytest.mark.timeout(240)

_PRELUDE = textwrap.dedent("""
    import json, os, subprocess, sys, tempfile
    import numpy as np
    import reverb_shm
    from reverb_shm import errors, rate_limiters, selectors
    from reverb_shm._internal import shm

    def table(max_size=100_000):
      return [reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), max_size,
                               rate_limiters.MinSize(1))]

    def fill(tab):
      try:
        while True:
          tab.insert({"x": np.full((256, 1000), 1, np.uint8)}, priorities=np.ones(256))
      except errors.ResourceExhaustedError as e:
        return str(e)

    FRESH = '''
    import sys, numpy as np, reverb_shm
    c = reverb_shm.Client("localhost:" + sys.argv[1])
    ops = {"insert": lambda: c.insert([np.zeros(4)], priorities={"t": 1.0}),
           "sample": lambda: list(c.sample("t", 1, emit_timesteps=False))}
    for what in sys.argv[2:]:
      f = ops[what]
      try:
        f(); print(what, "OK")
      except Exception as e:
        print(what, "FAILED", type(e).__name__, e)
    '''

    def fresh(port, *ops):
      r = subprocess.run([sys.executable, "-c", FRESH, str(port), *ops], capture_output=True,
                         text=True, timeout=120)
      return r.stdout.splitlines() + r.stderr.splitlines()[-3:]
""")


# ---------------------------------------------------------------- no lock-out at the limit
_ARENA_FULL = _PRELUDE + textwrap.dedent("""
    kw = {} if sys.argv[1] == "default" else {"max_bytes": 1 << 30}
    s = reverb_shm.Server(table(), name="full", **kw)
    tab = s.shared_table("t")
    err = fill(tab)
    full = fresh(s.port, "sample")
    s.localhost_client().reset("t")
    empty = fresh(s.port, "insert", "sample")
    print("RESULT " + json.dumps(dict(err=err, full=full, empty=empty, size=tab.size)))
    s.stop()
""")


@pytest.mark.parametrize("mode", ["default", "beyond_dev_shm"])
def test_new_process_samples_and_inserts_once_the_arena_took_everything(mode):
  import json
  out = run_in_private_shm(_ARENA_FULL, size_mib=64, args=[mode])
  r = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
  # The table is full of data: a new process still samples (its pin log was reserved at start).
  assert r["full"][0] == "sample OK", r
  # Once the items are gone, it inserts and samples.
  assert r["empty"][:2] == ["insert OK", "sample OK"], r


_DISK_FULL = _PRELUDE + textwrap.dedent("""
    st = tempfile.mkdtemp(prefix="rvshm_dtfull_")
    s = reverb_shm.Server(table(), name="dtfull", storage=st, max_bytes=24 << 20)
    tab = s.shared_table("t")
    err = fill(tab)
    info = s.segment.info()
    out = fresh(s.port, "sample")
    s.localhost_client().reset("t")
    empty = fresh(s.port, "insert", "sample")
    print("RESULT " + json.dumps(dict(err=err, fresh=out, empty=empty,
                                      arena_end=info["arena_off"] + info["arena_size"])))
    s.stop()
    os.rmdir(st)
""")


def test_disk_tier_pin_logs_are_not_charged_to_the_file_budget():
  import json
  out = run_in_private_shm(_DISK_FULL, size_mib=64)
  r = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
  assert "arena cannot grow by that much within max_bytes" in r["err"], r
  # The file took all of max_bytes (pins are in /dev/shm, not charged to it).
  assert r["arena_end"] > (24 << 20) - (1 << 20), r
  assert r["fresh"][0] == "sample OK", r
  assert r["empty"][:2] == ["insert OK", "sample OK"], r


def test_sampling_error_says_why_the_pin_log_could_not_grow():
  """A process that holds all the pins its log could grow to is told the true reason."""
  code = _PRELUDE + textwrap.dedent("""
      s = reverb_shm.Server(table(), name="pinsfull", pins_per_proc=2048, max_bytes=(48 << 20))
      tab = s.shared_table("t")
      tab.insert({"x": np.zeros((3000, 4), np.float32)}, priorities=np.ones(3000))
      held = [tab.sample_records(256) for _ in range(8)]
      try:
        tab.sample_records(256)
        print("RESULT no error")
      except Exception as e:
        print("RESULT", type(e).__name__, e)
      del held
      s.stop()
  """)
  out = run_in_private_shm(code, size_mib=128)
  line = next(l for l in out.splitlines() if l.startswith("RESULT "))
  assert "2048" in line and "pins" in line, line


def test_first_insert_works_when_dev_shm_only_fits_the_start():
  code = _PRELUDE + textwrap.dedent("""
      s = reverb_shm.Server(table(1000))
      info = s.segment.info()
      s.localhost_client().insert([1, 2], priorities={"t": 1.0})
      print("RESULT", info["max_bytes"] >> 20, s.shared_table("t").size)
      s.stop()
  """)
  out = run_in_private_shm(code, size_mib=14)
  line = next(l for l in out.splitlines() if l.startswith("RESULT "))
  assert line.split()[2] == "1", line


def test_failed_growth_gives_back_its_pages_and_says_dev_shm_is_full():
  code = _PRELUDE + textwrap.dedent("""
      s = reverb_shm.Server(table(), name="strand", max_bytes=1 << 30)
      err = fill(s.shared_table("t"))
      info = s.segment.info()
      print("RESULT " + json.dumps(dict(err=err, reserved=info["reserved_bytes"],
                                        held=shm.allocated_bytes("/dev/shm/rvshm.strand"))))
      s.stop()
  """)
  import json
  out = run_in_private_shm(code, size_mib=64)
  r = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
  assert "/dev/shm is full" in r["err"] and "Bad address" not in r["err"], r
  # What the file holds is what the server reserved (no stranded pages of a failed extent).
  assert r["held"] <= r["reserved"] + (64 << 10), r


# ---------------------------------------------------------------- reclaiming, safely
def test_forged_storage_sidecar_of_another_user_unlinks_nothing():
  code = _PRELUDE + textwrap.dedent("""
      st = tempfile.mkdtemp(prefix="rvshm_victim_")
      victim = reverb_shm.Server(table(10), name="victim", storage=st)
      arena = victim.segment.arena_path
      other_file = os.path.join(st, "precious")
      open(other_file, "w").write("x")
      subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                      sys.executable, "-c",
                      f"open('/dev/shm/rvshm-storage.evil', 'w').write({arena!r})"], check=True)
      # A sidecar of ours naming a file that is not an arena file is not followed either.
      open("/dev/shm/rvshm-storage.evil2", "w").write(other_file)
      other = reverb_shm.Server(table(10), name="another")
      removed = shm.remove_stale()
      print("RESULT " + json.dumps(dict(arena=os.path.exists(arena),
                                        other=os.path.exists(other_file), removed=removed)))
      other.stop(); victim.stop()
      os.unlink(other_file); os.rmdir(st)
  """)
  import json
  out = run_in_private_shm(code, size_mib=64)
  r = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
  assert r["arena"] and r["other"], r


def test_live_server_in_another_pid_namespace_is_not_reclaimed():
  if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode:
    pytest.skip("needs `unshare --pid` (root)")
  code = _PRELUDE + textwrap.dedent("""
      import time
      SRV = '''
      import time, reverb_shm
      from reverb_shm import rate_limiters, selectors
      s = reverb_shm.Server([reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10,
                                              rate_limiters.MinSize(1))], name="pidns")
      print("up", flush=True)
      time.sleep(60)
      '''
      p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable,
                            "-c", SRV],
                           stdout=subprocess.PIPE, text=True)
      assert p.stdout.readline().strip() == "up"
      rows = shm.list_segments(["pidns"])
      removed = shm.remove_stale()
      left = os.path.exists("/dev/shm/rvshm.pidns")
      p.kill(); p.wait()
      for _ in range(100):        # the server (pid 1 of its namespace) dies with unshare
        removed_after = shm.remove_stale()
        if removed_after:
          break
        time.sleep(0.1)
      print("RESULT " + json.dumps(dict(rows=rows, removed=removed, left=left,
                                        after=removed_after)))
  """)
  import json
  out = run_in_private_shm(code, size_mib=64)
  r = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
  assert r["left"] and r["removed"] == [] and r["rows"][0]["state"] == "live", r
  # Once it is dead (killed: the lock goes with it), it is reclaimed.
  assert "/dev/shm/rvshm.pidns" in r["after"], r


def test_disk_arena_files_are_reclaimed_after_dev_shm_was_cleared(tmp_path):
  code = _PRELUDE + textwrap.dedent("""
      st = sys.argv[1]
      KILL = '''
      import os, sys, numpy as np, reverb_shm
      from reverb_shm import rate_limiters, selectors
      s = reverb_shm.Server([reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10,
                                              rate_limiters.MinSize(1))], name="orph",
                            storage=sys.argv[1], max_bytes=64 << 20)
      os.kill(os.getpid(), 9)
      '''
      subprocess.run([sys.executable, "-c", KILL, st], timeout=60)
      before = sorted(os.listdir(st))
      for f in os.listdir("/dev/shm"):      # a reboot: /dev/shm is empty again
        os.unlink(os.path.join("/dev/shm", f))
      open(os.path.join(st, "rvshm.someone.txt"), "w").write("not an arena file")
      gc_dry = subprocess.run([sys.executable, "-m", "reverb_shm.cli", "gc", "--dry-run",
                               "--storage", st], capture_output=True, text=True).stdout
      s = reverb_shm.Server(table(10), name="orph2", storage=st)
      after = sorted(os.listdir(st))
      s.stop()
      print("RESULT " + json.dumps(dict(before=before, after=after, gc_dry=gc_dry)))
  """)
  import json
  out = run_in_private_shm(code, size_mib=64, args=[str(tmp_path)])
  r = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
  assert len(r["before"]) == 1 and r["before"][0].startswith("rvshm.orph."), r
  assert r["before"][0] in r["gc_dry"], r
  left = [f for f in r["after"] if f.endswith(".arena") and not f.startswith("rvshm.orph2.")]
  assert left == [] and "rvshm.someone.txt" in r["after"], r


# ---------------------------------------------------------------- clear errors, no change
def test_sample_batch_rejects_bad_n_before_sampling():
  name = unique_server_name("sb0")
  t = reverb_shm.Table("t", selectors.Fifo(), selectors.Fifo(), 10, rate_limiters.MinSize(1))
  s = reverb_shm.Server([t], name=name)
  try:
    s.localhost_client().insert([np.arange(4.0)], priorities={"t": 1.0})
    tab = s.shared_table("t")           # a fresh handle: no column layout learnt yet
    for n in (0, -1):
      with pytest.raises(ValueError, match=">= 1"):
        tab.sample_batch(n)
    sample = tab.sample_batch(1, timeout_ms=1000)
    assert int(sample.info.times_sampled[0]) == 1, sample.info    # never sampled before
  finally:
    s.stop()


def test_attach_under_an_address_space_limit_names_max_bytes():
  name = unique_server_name("ulim")
  t = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10, rate_limiters.MinSize(1))
  s = reverb_shm.Server([t], name=name, max_bytes=8 << 30)
  try:
    code = (f"import resource, reverb_shm; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30));"
            f"c = reverb_shm.Client('localhost:{s.port}'); c.insert([1], {{'t': 1.0}})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "ResourceExhaustedError" in last and "max_bytes" in last, r.stderr[-2000:]
  finally:
    s.stop()


@pytest.mark.parametrize("kw, expected", [
    (dict(max_bytes=2 ** 70), (ValueError, "max_bytes")),
    (dict(pins_per_proc=2 ** 40), (ValueError, "pins_per_proc")),
    (dict(storage=b"/tmp"), (ValueError, "storage")),
    (dict(storage=""), (ValueError, "storage")),
    (dict(on_config_mismatch="nope"), (ValueError, "on_config_mismatch")),
    (dict(storage="/proc"), ((ValueError, errors.ResourceExhaustedError), "/proc")),
])
def test_bad_server_settings_are_refused_clearly(kw, expected):
  t = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10, rate_limiters.MinSize(1))
  name = unique_server_name("badarg")
  with pytest.raises(expected[0], match=expected[1]):
    reverb_shm.Server([t], name=name, **kw).stop()
  assert not os.path.exists(shm.segment_path(name))


def test_failed_growth_on_a_full_disk_gives_back_what_posix_fallocate_reserved(tmp_path):
  """On a 16 MiB ext4 file system (a loop mount in a private mount namespace) the disk tier's
  arena file fills the disk; the growth step that failed (posix_fallocate got part of its
  blocks, then ENOSPC) gives those blocks back, and the server keeps serving."""
  import shutil
  if not shutil.which("mkfs.ext4"):
    pytest.skip("needs mkfs.ext4 to make a small file system")
  image = tmp_path / "fs.img"
  with open(image, "wb") as f:
    f.truncate(16 << 20)
  subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
  code = _PRELUDE + textwrap.dedent("""
      image, mnt = sys.argv[1], sys.argv[2]
      os.makedirs(mnt)
      m = subprocess.run(["mount", "-o", "loop", image, mnt], capture_output=True, text=True)
      if m.returncode:
        print("SKIP " + m.stderr.strip()); sys.exit(0)
      try:
        s = reverb_shm.Server(table(), name="tinydisk", storage=mnt, arena_bytes=1 << 20,
                              max_bytes=64 << 20)
        tab = s.shared_table("t")
        error = fill(tab)
        info = s.segment.info()
        path = s.segment.arena_path
        allocated = os.stat(path).st_blocks * 512
        df = os.statvfs(mnt)
        free_after = df.f_bavail * df.f_frsize
        ok = tab.sample(4, timeout_ms=1000)
        intact = all(int(x.data[0].min()) == 1 == int(x.data[0].max()) for x in ok)
        tab.delete(tab.items()["key"][:1024].tolist())   # 4 whole chunks
        tab.insert({"x": np.full((256, 1000), 1, np.uint8)}, priorities=np.ones(256))
        s.segment.check()
        print("RESULT " + json.dumps(dict(error=error, arena=info["arena_size"], allocated=allocated,
                                          free_after=free_after, intact=intact)))
        s.stop()
      finally:
        subprocess.run(["umount", mnt])
  """)
  import json
  out = run_in_private_shm(code, size_mib=64, args=(image, tmp_path / "mnt"))
  if out.startswith("SKIP "):
    pytest.skip("cannot loop-mount a file system here: " + out[5:])
  r = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
  assert "storage=" in r["error"] and ("No space left" in r["error"]
                                       or "kept free for the file system" in r["error"]), r
  # The file holds the published arena and no more (a few KiB of extent tree at most).
  assert r["allocated"] <= r["arena"] + (64 << 10), r
  assert r["intact"], r
