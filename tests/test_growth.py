"""An arena that grows: servers start small (the README quick start runs in a 64 MiB /dev/shm),
add extents as data arrives up to max_bytes, and running out is a clear ResourceExhaustedError
naming the settings, never a SIGBUS; growth is safe under concurrent writers and samplers in
several processes, and under kill -9 of the process that grows.
"""
import json
import os
import re
import signal
import textwrap
import time

import bench_modules
import numpy as np
import pytest
from conftest import run_in_private_shm, unique_server_name

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors

pytestmark = pytest.mark.timeout(240)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
torture = bench_modules.load("torture")


def _readme_quick_start() -> str:
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read()
  section = text[text.index("## Quick start"):]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_quick_start_runs_in_a_64_mib_dev_shm():
  code = _readme_quick_start()
  # Measure what the server holds right after it started (the quick start stops it at its end).
  probe = textwrap.dedent("""
      import os, reverb_shm
      _Server = reverb_shm.Server
      class Server(_Server):
        def __init__(self, *a, **k):
          super().__init__(*a, **k)
          st = os.statvfs("/dev/shm")
          print("SHM_USED", (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize)
      reverb_shm.Server = Server
  """)
  out = run_in_private_shm(probe + code, size_mib=64)
  used, total = map(int, next(l for l in out.splitlines() if l.startswith("SHM_USED")).split()[1:])
  assert total == 64 << 20
  assert used < 16 << 20, f"the quick start's server holds {used / 2**20:.1f} MiB of 64 MiB"
  assert "probability" not in out or "array(" in out        # it printed its samples
  assert len([l for l in out.splitlines() if "array(" in l]) >= 2, out


_FILL = textwrap.dedent("""
    import json, os, sys, zlib
    import numpy as np
    import reverb_shm
    from reverb_shm import errors, rate_limiters, selectors
    sys.path.insert(0, "bench")
    import torture

    def used():
      st = os.statvfs("/dev/shm")
      return (st.f_blocks - st.f_bfree) * st.f_frsize

    mode = sys.argv[1]
    table = reverb_shm.Table("t", selectors.Prioritized(0.6), selectors.Fifo(), 100_000,
                             rate_limiters.MinSize(1))
    kwargs = {} if mode == "default" else {"max_bytes": 200 << 20}   # more than /dev/shm holds
    server = reverb_shm.Server([table], **kwargs)
    st = server.shared_table("t")
    rng = np.random.default_rng(0)
    n, error = 0, None
    while True:
      try:
        st.insert({"x": torture.make_rows(rng, 4096)[None]}, 1.0)   # one 256 KiB item
      except errors.ResourceExhaustedError as e:
        error = str(e)
        break
      n += 1
    info = server.segment.info()
    # Still serving: samples come back intact, priorities update, and room comes back.
    samples = st.sample(32, timeout_ms=1000)
    intact = all(torture.rows_intact(s.data[0]) for s in samples)
    st.mutate(updates={s.info.key: 2.0 for s in samples})
    del samples
    st.delete(st.items()["key"][: n // 2].tolist())
    for _ in range(n // 4):
      st.insert({"x": torture.make_rows(rng, 4096)[None]}, 1.0)
    server.segment.check()
    print("RESULT " + json.dumps(dict(items=n, error=error, extents=info["extents"],
          arena=info["arena_size"],
          reserved=info["reserved_bytes"], max_bytes=info["max_bytes"], intact=intact,
          used=used(), size=st.size)))
    server.stop()
""")


@pytest.mark.parametrize("mode", ["default", "beyond_dev_shm"])
def test_a_growing_table_reaches_the_limit_with_a_clear_error_and_keeps_serving(mode):
  out = run_in_private_shm(_FILL, size_mib=64, args=[mode])
  r = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
  assert r["intact"] and r["extents"] >= 2, r
  if mode == "default":
    # max_bytes defaults to half of /dev/shm free at start: the arena grew up to it.
    assert 31 << 20 <= r["max_bytes"] <= 32 << 20, r
    assert r["max_bytes"] - (2 << 20) <= r["reserved"] <= r["max_bytes"], r
    # The arena (what the 100k-item table's metadata leaves of it) filled up with items.
    assert r["items"] * 262400 >= r["arena"] - 2 * 262400 and r["arena"] > 16 << 20, r
    assert "arena cannot grow by that much within max_bytes" in r["error"] and "max_bytes" in r["error"], r["error"]
    assert "--shm-size" in r["error"], r["error"]
  else:
    # /dev/shm itself runs out first: the reservation of the next extent fails cleanly.
    assert r["reserved"] > 48 << 20 and r["items"] * 262400 > 32 << 20, r
    assert "cannot grow the arena" in r["error"] and "/dev/shm is full" in r["error"], r["error"]
    assert "--shm-size" in r["error"] and "arena_bytes" in r["error"], r["error"]


def test_too_small_dev_shm_names_the_settings_to_change():
  code = textwrap.dedent("""
      import reverb_shm
      from reverb_shm import errors, rate_limiters, selectors
      try:
        reverb_shm.Server([reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100,
                                            rate_limiters.MinSize(1))], arena_bytes=100 << 20)
      except errors.ResourceExhaustedError as e:
        print("ERROR", e)
  """)
  out = run_in_private_shm(code, size_mib=64)
  line = next(l for l in out.splitlines() if l.startswith("ERROR"))
  # 100 MiB of arena + 1.5 MiB for the first pins of every process's pin log + the table's
  # metadata, counters and header (well under 0.1 MiB)
  assert re.search(r"need 101\.[56] MiB, /dev/shm has 64\.0 MiB free", line), line
  for setting in ("arena_bytes", "max_size", "--shm-size"):
    assert setting in line, line


# ---------------------------------------------------------------- concurrency and kill -9
def _child(fn, *args):
  pid = os.fork()
  if pid == 0:
    code = 1
    try:
      fn(*args)
      code = 0
    except BaseException:  # pylint: disable=broad-except
      import traceback  # pylint: disable=import-outside-toplevel
      traceback.print_exc()
    finally:
      os._exit(code)  # pylint: disable=protected-access
  return pid


def _writer(name, seed, rounds):
  st = reverb_shm.SharedTable.attach(f"{name}/t")
  rng = np.random.default_rng(seed)
  for _ in range(rounds):                      # 32 KiB items: the arena grows under them
    st.insert({"x": torture.make_rows(rng, 1024).reshape(2, 512, 64)}, rng.random(2) + 0.1,
              timeout_ms=10_000)


def _sampler(name, stop_path):
  st = reverb_shm.SharedTable.attach(f"{name}/t")
  checked = 0
  while not os.path.exists(stop_path):
    for s in st.sample(8, timeout_ms=10_000):
      if not torture.rows_intact(s.data[0]):
        os._exit(3)  # pylint: disable=protected-access
      checked += 1
    batch = st.sample_batch(4, timeout_ms=10_000) if checked % 3 == 0 else None
    if batch is not None and not torture.rows_intact(batch.data[0]):
      os._exit(3)  # pylint: disable=protected-access
  if checked == 0:
    os._exit(4)  # pylint: disable=protected-access


def _wait_all(pids, timeout=180):
  deadline = time.monotonic() + timeout
  codes = {}
  for pid in pids:
    while True:
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        codes[pid] = os.waitstatus_to_exitcode(status)
        break
      if time.monotonic() > deadline:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        codes[pid] = "hung"
        break
      time.sleep(0.01)
  return codes


def test_writers_in_several_processes_grow_the_arena_while_samplers_read(tmp_path):
  name = unique_server_name("growth")
  table = reverb_shm.Table("t", selectors.Prioritized(0.7), selectors.Fifo(), 2000,
                           rate_limiters.MinSize(1))
  server = reverb_shm.Server([table], name=name, arena_bytes=64 << 10, max_bytes=256 << 20,
                             max_procs=16)
  stop_path = str(tmp_path / "stop")
  try:
    server.shared_table("t").insert(
        {"x": torture.make_rows(np.random.default_rng(9), 512)[None]}, 1.0)
    samplers = [_child(_sampler, name, stop_path) for _ in range(2)]
    writers = [_child(_writer, name, seed, 150) for seed in range(3)]
    writer_codes = _wait_all(writers)
    open(stop_path, "w").close()
    sampler_codes = _wait_all(samplers)
    assert set(writer_codes.values()) == {0}, writer_codes
    assert set(sampler_codes.values()) == {0}, f"{sampler_codes} (3: a torn payload)"
    info = server.segment.info()
    assert info["extents"] >= 3 and info["arena_size"] > 8 << 20, info
    assert info["pins_reserved"] >= 3 * 1024 * 12, info    # each process's pin log grew
    server.segment.check()
    st = server.shared_table("t")
    assert st.size == 1 + 3 * 150 * 2
    for s in st.sample(256, timeout_ms=1000):
      assert torture.rows_intact(s.data[0])
  finally:
    server.stop()


def _big_rows(rng, nbytes):
  """uint8[1, nbytes // 64, 64]: checksummed rows (4096 distinct ones, repeated)."""
  block = torture.make_rows(rng, 4096)
  return np.resize(block, (nbytes // 64, 64))[None]


def _intact(rows) -> bool:
  """rows_intact on the first and last 1024 rows and 1024 random ones (big items)."""
  flat = np.asarray(rows).reshape(-1, 64)
  pick = np.random.default_rng().integers(0, len(flat), 1024)
  return all(torture.rows_intact(part) for part in (flat[:1024], flat[-1024:], flat[pick]))


def _grow_then_report(name, ready_w, nbytes, pins):
  st = reverb_shm.SharedTable.attach(f"{name}/t")
  rows = _big_rows(np.random.default_rng(nbytes), nbytes)
  held = st.sample(pins, timeout_ms=1000) if pins else None   # grows this process's pin log
  os.write(ready_w, b"r")
  st.insert({"x": rows}, 1.0)                                   # needs a new extent
  del held
  time.sleep(60)                                                # the parent kills us


def test_kill_9_during_growth_leaves_a_consistent_server():
  """Processes killed at random moments around a growth step (reserving pages, committing the
  extent, merging it, growing a pin log, copying into the new extent): the dead are reaped,
  the invariant checker passes, every committed payload is intact, and growth goes on."""
  name = unique_server_name("growkill")
  table = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 1000,
                           rate_limiters.MinSize(1))
  server = reverb_shm.Server([table], name=name, arena_bytes=64 << 10, max_bytes=512 << 20,
                             max_procs=64)
  rng = np.random.default_rng(5)
  from reverb_shm._internal._lib import ffi, lib  # pylint: disable=import-outside-toplevel
  try:
    st = server.shared_table("t")
    st.insert({"x": torture.make_rows(rng, 64)[None]}, 1.0)
    outcomes = {"killed_before_commit": 0, "committed": 0}
    for i in range(40):
      before = st.size
      ready_r, ready_w = os.pipe()
      pid = _child(_grow_then_report, name, ready_w, int(rng.integers(2, 9)) << 20,
                   int(rng.integers(0, 3000)) if i % 3 == 0 else 0)
      os.close(ready_w)
      assert os.read(ready_r, 1) == b"r"
      os.close(ready_r)
      time.sleep(float(rng.uniform(0, 0.006)))
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
      reaped = ffi.new("uint32_t *")
      assert lib.rs_reap(server.segment.base, reaped) == 0
      server.segment.check()
      outcomes["committed" if st.size > before else "killed_before_commit"] += 1
      for s in st.sample(16, timeout_ms=1000):
        assert _intact(s.data[0])
    info = server.segment.info()
    assert info["extents"] >= 3 and outcomes["killed_before_commit"] >= 1, (info, outcomes)
    # The arena keeps growing after all that.
    big = _big_rows(rng, info["arena_size"] - info["arena_used"] + (1 << 20))
    st.insert({"x": big}, 1.0)
    assert server.segment.info()["extents"] > info["extents"]
    server.segment.check()
    assert all(_intact(s.data[0]) for s in st.sample(64, timeout_ms=1000))
  finally:
    server.stop()
