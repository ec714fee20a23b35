"""Disk tier: Server(storage=DIR) keeps the arena (chunk payloads, item descriptors) in a file
mapped into every process; records, key index, sum trees and pin logs stay in /dev/shm.
Sampling, priority updates, zero-copy views and sample_batch work unchanged, the file goes away
with the server (stop, or gc / the next server start after a kill), and a table whose data is
4x the memory limit of its cgroup works without OOM.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import bench_modules
import numpy as np
import pytest
from conftest import unique_server_name

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import shm

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
disk_tier = bench_modules.load("disk_tier")   # memory_cgroup: v2 memory.max, else v1
FRAME = (84, 84, 4)


def frame(i: int) -> np.ndarray:
  """uint8[84, 84, 4] identifying step i: filled with i % 251, i's 8 bytes first."""
  f = np.full(FRAME, i % 251, np.uint8)
  f.reshape(-1)[:8] = np.frombuffer(int(i).to_bytes(8, "little"), np.uint8)
  return f


def frames(start: int, n: int) -> np.ndarray:
  return np.stack([frame(i) for i in range(start, start + n)])


def _table(max_size=10_000):
  return reverb_shm.Table("t", selectors.Prioritized(0.8), selectors.Fifo(), max_size,
                          rate_limiters.MinSize(1))


def test_disk_tier_arena_limit_error_points_at_max_bytes_and_the_disk(tmp_path):
  server = reverb_shm.Server([_table()], name=unique_server_name("disklimit"),
                             storage=str(tmp_path), arena_bytes=1 << 20, max_bytes=24 << 20)
  try:
    st = server.shared_table("t")
    st.insert({"x": np.ones((1, 1 << 20), np.float32)}, 1.0)   # 4 MiB: fits
    with pytest.raises(errors.ResourceExhaustedError) as e:
      st.insert({"x": np.ones((1, 10 << 20), np.float32)}, 1.0)   # 40 MiB: never fits
    msg = str(e.value)
    assert "cannot grow by that much within max_bytes" in msg, msg
    assert "storage= directory" in msg and "/dev/shm" not in msg, msg
    assert st.size == 1   # nothing of the refused insert went in
  finally:
    server.stop()


def test_disk_backed_table_samples_updates_and_gathers_like_one_in_memory(tmp_path):
  name = unique_server_name("disk")
  server = reverb_shm.Server([_table()], name=name, storage=str(tmp_path), arena_bytes=1 << 20,
                             max_bytes=256 << 20, max_procs=8)
  try:
    info = server.segment.info()
    files = list(tmp_path.iterdir())
    assert info["arena_file"] == 1 and len(files) == 1 and files[0].name.endswith(".arena")
    assert files[0].stat().st_mode & 0o777 == 0o600
    st = server.shared_table("t")
    for s in range(0, 2000, 100):
      st.insert({"frame": frames(s, 100), "i": np.arange(s, s + 100)}, np.ones(100))
    info = server.segment.info()
    assert info["extents"] >= 3, info      # the arena file grew by extents (56 MiB of frames)
    # /dev/shm holds the tables and pin logs only; the file holds the frames.
    assert shm.allocated_bytes(shm.segment_path(name)) < 4 << 20
    assert files[0].stat().st_blocks * 512 >= 2000 * frame(0).nbytes
    # Zero-copy samples, in this process and in another one (which maps the file itself).
    for s in st.sample(64, timeout_ms=1000):
      f, i = s.data
      assert not f.flags.writeable and np.array_equal(f, frame(int(i)))
    batch = st.sample_batch(64, timeout_ms=1000)
    for f, i in zip(*batch.data):
      assert np.array_equal(f, frame(int(i)))
    keys = batch.info.key
    st.update_priorities(keys, np.full(len(keys), 50.0))
    hot = np.sort(keys)
    counts = {}
    for _ in range(20):
      for k in st.sample_batch(64, timeout_ms=1000).info.key.tolist():
        counts[k] = counts.get(k, 0) + 1
    hits = sum(c for k, c in counts.items() if k in set(hot.tolist()))
    p = 64 * 50 ** 0.8 / (64 * 50 ** 0.8 + 2000 - 64)         # Prioritized(0.8) after the update
    assert abs(hits - 1280 * p) < 6 * (1280 * p * (1 - p)) ** 0.5, (hits, 1280 * p)
    code = textwrap.dedent(f"""
        import numpy as np, reverb_shm, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_disk_tier import frame
        st = reverb_shm.SharedTable.attach("{name}/t")
        ok = all(np.array_equal(f, frame(int(i))) for f, i in zip(*st.sample_batch(128).data))
        st.insert({{"frame": frame(99_999)[None], "i": np.array([99_999])}}, 1.0)
        print("OK" if ok else "BAD")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.stdout.strip() == "OK", out.stderr[-2000:]
    assert st.size == 2001
    server.segment.check()
  finally:
    server.stop()
  assert list(tmp_path.iterdir()) == []          # stop removes the arena file
  assert not os.path.exists(shm.sidecar_path(name, "storage"))


def test_killed_disk_server_leaves_nothing_after_the_next_start(tmp_path):
  name = unique_server_name("diskdead")
  code = textwrap.dedent(f"""
      import numpy as np, reverb_shm, time
      from reverb_shm import rate_limiters, selectors
      t = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100, rate_limiters.MinSize(1))
      s = reverb_shm.Server([t], name="{name}", storage={str(tmp_path)!r}, max_bytes=64 << 20,
                            max_procs=4)
      s.shared_table("t").insert({{"x": np.zeros((10, 100_000), np.uint8)}}, 1.0)
      print("up", flush=True)
      time.sleep(120)
  """)
  proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
  try:
    assert proc.stdout.readline().strip() == "up"
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
  assert len(list(tmp_path.iterdir())) == 1
  assert os.path.exists(shm.sidecar_path(name, "storage"))
  other = reverb_shm.Server([_table(10)], name=unique_server_name("next"), max_bytes=32 << 20,
                            max_procs=4)
  other.stop()
  assert list(tmp_path.iterdir()) == []
  assert not os.path.exists(shm.sidecar_path(name, "storage"))
  assert not os.path.exists(shm.segment_path(name))


def test_bad_storage_is_rejected(tmp_path):
  with pytest.raises(ValueError, match="not a directory"):
    reverb_shm.Server([_table(10)], name=unique_server_name(), storage=str(tmp_path / "nope"))
  with pytest.raises(ValueError, match="inside /dev/shm"):
    reverb_shm.Server([_table(10)], name=unique_server_name(), storage="/dev/shm")


# ---------------------------------------------------------------- bigger than memory
_BIG = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    sys.path.insert(0, "tests")
    import reverb_shm
    from reverb_shm import rate_limiters, selectors
    from test_disk_tier import frame, frames
    with open(sys.argv[1], "w") as f:          # join the memory cgroup (after the imports)
      f.write(str(os.getpid()))
    n = int(sys.argv[3])
    t = reverb_shm.Table("t", selectors.Prioritized(0.8), selectors.Fifo(), n,
                         rate_limiters.MinSize(1))
    server = reverb_shm.Server([t], name=sys.argv[4], storage=sys.argv[2], max_bytes=4 << 30,
                               max_procs=4)
    st = server.shared_table("t")
    block = 256
    for s in range(0, n, block):
      st.insert({"frame": frames(s, block), "i": np.arange(s, s + block)}, np.ones(block))
    rng = np.random.default_rng(0)
    checked = bad = 0
    out = [np.empty((64,) + frame(0).shape, np.uint8), np.empty(64, np.int64)]
    t0 = time.monotonic()
    for r in range(int(sys.argv[5])):
      batch = st.sample_batch(64, out=out, timeout_ms=10_000)
      for f, i in zip(*batch.data):
        checked += 1
        bad += not np.array_equal(f, frame(int(i)))
      st.update_priorities(batch.info.key, rng.random(len(batch.info.key)) + 0.1)
    for s in st.sample(32, timeout_ms=1000):                 # zero-copy views too
      checked += 1
      bad += not np.array_equal(s.data[0], frame(int(s.data[1])))
    seconds = time.monotonic() - t0
    server.segment.check()
    info = server.segment.info()
    print("RESULT " + json.dumps(dict(checked=checked, bad=bad, size=st.size,
                                      arena=info["arena_size"], seconds=seconds)))
    server.stop()
""")


@pytest.mark.parametrize("limit_mib", [
    32, pytest.param(256, marks=[pytest.mark.slow, pytest.mark.timeout(1200)])])
def test_table_with_data_four_times_the_cgroup_memory_limit(tmp_path, limit_mib):
  limit = limit_mib << 20
  path, kind = disk_tier.memory_cgroup(limit)
  if path is None:
    pytest.skip(kind)
  n = (4 * limit) // frame(0).nbytes + 1024      # > 4x the limit in frames
  rounds = 50 if limit_mib < 100 else 300
  try:
    proc = subprocess.run(
        [sys.executable, "-c", _BIG, os.path.join(path, "cgroup.procs"), str(tmp_path), str(n),
         unique_server_name("bigdisk"), str(rounds)],
        capture_output=True, text=True, timeout=1100, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT})
    stat_name = "memory.events" if kind == "v2" else "memory.failcnt"
    with open(os.path.join(path, stat_name), encoding="utf-8") as f:
      pressure = f.read()
  finally:
    disk_tier.remove_cgroup(path)
  assert proc.returncode == 0, f"exit {proc.returncode} (-9: OOM-killed)\n{proc.stderr[-3000:]}"
  import json  # pylint: disable=import-outside-toplevel
  r = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
  assert r["bad"] == 0 and r["checked"] == rounds * 64 + 32, r
  assert r["size"] == n and r["arena"] >= 4 * limit, r
  # The limit was hit and reclaimed from (the page cache held the data, not the process).
  if kind == "v1":
    assert int(pressure) > 0, pressure
  assert list(tmp_path.iterdir()) == []
