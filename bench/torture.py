"""Kill -9 torture campaign: worker processes are SIGKILLed at random moments, then invariants.

Workers (forked from this process, which owns the server) loop over every kind of operation:
  writer   TrajectoryWriter appends (chunk writes) and create_item/flush (inserts)
  inserter SharedTable.insert batches (chunk allocation + descriptor insert in one go)
  sampler  samples batches (zero-copy samples, or gathered by sample_batch), verifies every row's
           checksum, updates priorities, deletes some
  waiter   blocks in sample/insert on a rate-limited table (killed while asleep in the futex)
Every payload row is 64 bytes: 60 random bytes followed by their CRC32, so any torn, freed or
overwritten row is detected by whoever samples it.

The controller keeps `workers` processes alive, SIGKILLs a random one every 0..2*`kill_every`
seconds and starts a replacement, for `seconds`, or until `kills` workers were killed if that
comes first (tests ask for a number of kills: on a loaded machine the kill loop slows down, and
a wall-clock run may kill too few workers to mean anything). At the end the survivors are told to stop (they must exit by
themselves within a timeout: no hang), the dead are reaped, and the run checks:
  - rs_check passes (Segment.check),
  - every item the controller samples is intact,
  - no chunk or pin leaked: descriptors == items, and after reset() the arena is empty.

Usage: python bench/torture.py [--seconds 120] [--kills N] [--workers 6] [--kill-every 0.02]
                               [--json out]
"""
import argparse
import json
import os
import random
import signal
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import reverb_shm  # noqa: E402  pylint: disable=g-import-not-at-top
from reverb_shm import errors, rate_limiters, selectors  # noqa: E402  pylint: disable=g-import-not-at-top
from reverb_shm._internal import chunks

ROW = 64
ROLES = ("writer", "inserter", "sampler", "waiter")
_CORRUPT_EXIT = 3


def make_rows(rng: np.random.Generator, n: int) -> np.ndarray:
  """uint8[n, 64]: 60 random bytes then their CRC32 (little endian)."""
  rows = np.empty((n, ROW), np.uint8)
  rows[:, :60] = rng.integers(0, 256, (n, 60), dtype=np.uint8)
  for r in rows:
    r[60:] = np.frombuffer(zlib.crc32(r[:60].tobytes()).to_bytes(4, "little"), np.uint8)
  return rows


def rows_intact(rows) -> bool:
  """True if every 64-byte row of `rows` (any leading shape) carries its own CRC32."""
  flat = np.asarray(rows, np.uint8).reshape(-1, ROW)
  return all(zlib.crc32(r[:60].tobytes()) == int.from_bytes(r[60:].tobytes(), "little")
             for r in flat)


def make_tables():
  return [
      reverb_shm.Table("prio", selectors.Prioritized(0.8), selectors.Fifo(), 300,
                       rate_limiters.MinSize(1)),
      reverb_shm.Table("uniform", selectors.Uniform(), selectors.MinHeap(), 200,
                       rate_limiters.MinSize(1)),
      reverb_shm.Table("limited", selectors.Uniform(), selectors.Fifo(), 100,
                       rate_limiters.SampleToInsertRatio(2.0, 2, 4.0)),
  ]


# ---------------------------------------------------------------- workers (forked children)
def _verify(samples) -> None:
  for s in samples:
    if not rows_intact(s.data[0]):
      os._exit(_CORRUPT_EXIT)  # pylint: disable=protected-access


def _writer(server, rng):
  client = reverb_shm.Client(f"shm://{server.name}")
  writer = client.trajectory_writer(num_keep_alive_refs=4)
  while True:
    for row in make_rows(rng, int(rng.integers(1, 6))):
      writer.append({"x": row})
      n = min(len(writer.history["x"]), int(rng.integers(1, 4)))
      table = ("prio", "uniform")[int(rng.integers(0, 2))]
      writer.create_item(table, float(rng.random() * 10), writer.history["x"][-n:])
    writer.flush(timeout_ms=2000)
    if rng.random() < 0.2:
      writer.end_episode(timeout_ms=2000)


def _inserter(server, rng):
  tables = [server.shared_table(n) for n in ("prio", "uniform")]
  while True:
    n = int(rng.integers(1, 9))
    tables[int(rng.integers(0, 2))].insert({"x": make_rows(rng, n)}, rng.random(n) * 5,
                                           timeout_ms=2000)


def _sampler(server, rng):
  tables = [server.shared_table(n) for n in ("prio", "uniform")]
  while True:
    st = tables[int(rng.integers(0, 2))]
    if rng.random() < 0.5:   # one C call samples, gathers and releases (rs_sample_gather)
      try:
        batch = st.sample_batch(int(rng.integers(1, 17)), timeout_ms=2000)
      except ValueError:     # an item of another layout than the one learnt: learnt again
        continue
      if not rows_intact(batch.data[0]):
        os._exit(_CORRUPT_EXIT)  # pylint: disable=protected-access
      keys = batch.info.key.tolist()
      st.mutate(updates={k: float(rng.random() * 10) for k in keys[::2]})
      continue
    samples = st.sample(int(rng.integers(1, 17)), timeout_ms=2000)
    _verify(samples)
    keys = [s.info.key for s in samples]
    st.mutate(updates={k: float(rng.random() * 10) for k in keys[::2]},
              deletes=keys[1:2] if rng.random() < 0.3 else None)
    del samples


def _waiter(server, rng):
  st = server.shared_table("limited")
  while True:
    try:
      if rng.random() < 0.5:
        st.insert({"x": make_rows(rng, 1)}, 1.0, timeout_ms=int(rng.integers(1, 50)))
      else:
        _verify(st.sample(1, timeout_ms=int(rng.integers(1, 50))))
    except errors.DeadlineExceededError:
      pass


_WORKERS = {"writer": _writer, "inserter": _inserter, "sampler": _sampler, "waiter": _waiter}


def _spawn(server, role: str, stop_path: str) -> int:
  pid = os.fork()
  if pid:
    return pid
  code = 1
  try:  # child: run until killed, or until the stop file appears (checked between calls)
    rng = np.random.default_rng()
    fn = _WORKERS[role]
    signal.signal(signal.SIGALRM, lambda *_: (os.path.exists(stop_path) and os._exit(0)))  # pylint: disable=protected-access
    signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)
    fn(server, rng)
  except BaseException:  # pylint: disable=broad-except
    import traceback  # pylint: disable=g-import-not-at-top
    traceback.print_exc()
  finally:
    os._exit(code)  # pylint: disable=protected-access


# ---------------------------------------------------------------- controller
def _reap(server) -> int:
  from reverb_shm._internal._lib import check, ffi, lib  # pylint: disable=g-import-not-at-top
  n = ffi.new("uint32_t *")
  check(lib.rs_reap(server.segment.base, n), "reaping")
  return n[0]


def run(seconds: float = 20.0, workers: int = 6, kill_every: float = 0.02, seed: int = 0,
        arena_bytes: int = 64 << 20, name: str = None, log=None, kills: int = None) -> dict:
  """Runs the campaign; returns figures. Raises AssertionError on any violation.

  Args:
    seconds: longest duration of the kill phase.
    kills: end the kill phase as soon as this many workers were SIGKILLed (None: run for
      `seconds`). The figures report the kills made and the seconds taken.
  """
  rnd = random.Random(seed)
  name = name or f"torture_{os.getpid()}"
  stop_path = f"/tmp/{name}.stop"
  if os.path.exists(stop_path):
    os.unlink(stop_path)
  server = reverb_shm.Server(make_tables(), name=name, arena_bytes=arena_bytes, max_procs=64,
                             port=None)
  live = {}          # pid -> role
  target, kills = kills, {role: 0 for role in ROLES}
  crashed = []       # (pid, role, exit code) of workers that died on their own
  try:
    for i in range(workers):
      role = ROLES[i % len(ROLES)]
      live[_spawn(server, role, stop_path)] = role
    start = time.monotonic()
    end = start + seconds
    while time.monotonic() < end and (target is None or sum(kills.values()) < target):
      time.sleep(rnd.uniform(0, 2 * kill_every))
      pid = rnd.choice(sorted(live))
      os.kill(pid, signal.SIGKILL)
      _, status = os.waitpid(pid, 0)
      role = live.pop(pid)
      if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        kills[role] += 1
      else:
        crashed.append((pid, role, os.waitstatus_to_exitcode(status)))
      live[_spawn(server, role, stop_path)] = role
      for other in list(live):   # collect any worker that died on its own
        done, status = os.waitpid(other, os.WNOHANG)
        if done:
          crashed.append((other, live.pop(other), os.waitstatus_to_exitcode(status)))
          live[_spawn(server, role, stop_path)] = role
    kill_seconds = time.monotonic() - start
    # Survivors must finish their current call and exit by themselves: no hang.
    with open(stop_path, "w"):
      pass
    hung = []
    deadline = time.monotonic() + 30
    for pid in list(live):
      while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
          if os.waitstatus_to_exitcode(status) != 0:
            crashed.append((pid, live[pid], os.waitstatus_to_exitcode(status)))
          break
        if time.monotonic() > deadline:
          hung.append((pid, live[pid]))
          os.kill(pid, signal.SIGKILL)
          os.waitpid(pid, 0)
          break
        time.sleep(0.01)
    live.clear()
    assert not hung, f"workers hung after the stop request: {hung}"
    assert not crashed, f"workers failed on their own (exit 3 = corrupt payload): {crashed}"
    _reap(server)
    seg = server.segment
    info = seg.info()
    assert info["live_procs"] <= 1, f"dead processes still registered: {info['live_procs']}"
    seg.check()
    # The survivors of the campaign (this process) continue, and every payload is intact.
    sizes = {}
    for table in ("prio", "uniform"):
      st = server.shared_table(table)
      sizes[table] = st.size
      st.insert({"x": make_rows(np.random.default_rng(seed), 1)}, 1.0, timeout_ms=1000)
      samples = st.sample(64, timeout_ms=1000)
      assert all(rows_intact(s.data[0]) for s in samples), f"corrupt payload in {table}"
      del samples
    import gc  # pylint: disable=g-import-not-at-top
    gc.collect()
    info = seg.info()
    # Items of one batch share a DESC block: exactly the blocks the items reference are left.
    refs = np.concatenate([server.shared_table(t).items()["desc_off"]
                           for t in ("prio", "uniform", "limited")])
    blocks = len(np.unique(chunks.desc_blocks(refs)))
    assert info["num_descs"] == blocks, (info, blocks)
    repairs = sum(seg.stats(i)["repairs"] for i in range(3))
    for table in ("prio", "uniform", "limited"):
      server.shared_table(table).reset()
    gc.collect()
    info = seg.info()
    assert info["num_chunks"] == 0 and info["num_descs"] == 0 and info["arena_used"] == 0, (
        f"leak after reset: {info}")
    seg.check()
    result = {"seconds": round(kill_seconds, 1), "workers": workers, "kills": sum(kills.values()),
              "kills_by_role": kills, "table_repairs": repairs, "items_at_end": sizes}
    if log:
      log(result)
    return result
  finally:
    for pid in list(live):
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
    if os.path.exists(stop_path):
      os.unlink(stop_path)
    server.stop()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seconds", type=float, default=120.0)
  parser.add_argument("--kills", type=int, default=None,
                      help="stop after this many kills (if before --seconds)")
  parser.add_argument("--workers", type=int, default=6)
  parser.add_argument("--kill-every", type=float, default=0.02,
                      help="mean seconds between two kills")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", help="write the figures to this file")
  args = parser.parse_args(argv)
  t0 = time.monotonic()
  result = run(args.seconds, args.workers, args.kill_every, args.seed, kills=args.kills)
  result["wall_seconds"] = round(time.monotonic() - t0, 1)
  print(json.dumps(result, indent=2))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
