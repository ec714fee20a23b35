"""Soak benchmark: millions of insert/sample/evict operations; RSS, /dev/shm use and open fds
must plateau after warm-up.

One server with a small Prioritized table (so most inserts evict) and a Uniform table fed by a
TrajectoryWriter (chunks written step by step). A forked actor process writes trajectories
while this process inserts batches, samples, updates priorities and deletes. Every
`--every` operations it records: operations so far, RSS of both processes (KiB), /dev/shm bytes
in use, open fds of both processes and the arena's used bytes / chunk count.

Usage: python bench/soak.py [--ops 3000000] [--json bench/soak.json]
Prints the curve as a table and whether each series plateaued (growth over the last 3/4 of
the run below --tolerance, default 5%).
"""
import argparse
import json
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import reverb_shm  # noqa: E402  pylint: disable=g-import-not-at-top
from reverb_shm import rate_limiters, selectors  # noqa: E402  pylint: disable=g-import-not-at-top
from reverb_shm._internal import shm


def _rss_kib(pid: int) -> int:
  with open(f"/proc/{pid}/statm") as f:
    return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def _fds(pid: int) -> int:
  return len(os.listdir(f"/proc/{pid}/fd"))


def _shm_used(name: str) -> int:
  """Bytes of /dev/shm held by this server's objects (segment + port alias), by blocks."""
  total = 0
  for entry in os.listdir(shm.SHM_DIR):
    path = os.path.join(shm.SHM_DIR, entry)
    if entry == f"rvshm.{name}" or (entry.startswith("rvshm.port.")
                                     and shm._read_alias(path) and shm._read_alias(path)[0] == name):  # pylint: disable=protected-access
      total += os.stat(path).st_blocks * 512
  return total


def _actor(name: str) -> None:
  """Forked child: writes 3-step items into 'traj' forever (killed at the end)."""
  try:
    client = reverb_shm.Client(f"shm://{name}")
    rng = np.random.default_rng(1)
    with client.trajectory_writer(num_keep_alive_refs=3) as writer:
      step = 0
      while True:
        writer.append({"obs": rng.random(8, dtype=np.float32), "r": np.float32(step)})
        step += 1
        if step % 200 >= 3 or step % 200 == 0:
          writer.create_item("traj", 1.0, {"obs": writer.history["obs"][-3:],
                                           "r": writer.history["r"][-1]})
        if step % 200 == 0:
          writer.end_episode(timeout_ms=5000)
  except BaseException:  # pylint: disable=broad-except
    import traceback  # pylint: disable=g-import-not-at-top
    traceback.print_exc()
  finally:
    os._exit(1)  # pylint: disable=protected-access


def run(total_ops: int, every: int, tolerance: float, log=print) -> dict:
  name = f"soak_{os.getpid()}"
  tables = [
      reverb_shm.Table("prio", selectors.Prioritized(0.6), selectors.Fifo(), 10_000,
                       rate_limiters.MinSize(1)),
      reverb_shm.Table("traj", selectors.Uniform(), selectors.Fifo(), 5_000,
                       rate_limiters.MinSize(1)),
  ]
  server = reverb_shm.Server(tables, name=name, arena_bytes=64 << 20, max_procs=8)
  actor = os.fork()
  if actor == 0:
    _actor(name)
  rng = np.random.default_rng(0)
  prio, traj = server.shared_table("prio"), server.shared_table("traj")
  batch = 64
  payload = rng.random((batch, 32)).astype(np.float32)
  curve = []
  ops = 0
  next_mark = 0
  t0 = time.monotonic()
  try:
    while ops < total_ops:
      keys = prio.insert({"x": payload}, rng.random(batch))          # evicts once full
      samples = prio.sample_batch(batch)
      prio.mutate(updates=dict(zip(samples.info.key.tolist(), rng.random(batch).tolist())),
                  deletes=keys[:4].tolist())
      got = traj.sample(8, timeout_ms=5000)
      del samples, got
      ops += batch * 3 + 4 + 8
      if ops >= next_mark:
        info = server.segment.info()
        row = {"ops": ops, "seconds": round(time.monotonic() - t0, 2),
               "rss_kib": _rss_kib(os.getpid()), "actor_rss_kib": _rss_kib(actor),
               "fds": _fds(os.getpid()), "actor_fds": _fds(actor), "shm_bytes": _shm_used(name),
               "arena_used": info["arena_used"], "chunks": info["num_chunks"],
               "items": prio.size + traj.size}
        curve.append(row)
        log("  ".join(f"{k}={v}" for k, v in row.items()))
        next_mark += every
  finally:
    os.kill(actor, signal.SIGKILL)
    os.waitpid(actor, 0)
    server.stop()
  warm = curve[len(curve) // 4:]
  verdict = {}
  for key in ("rss_kib", "actor_rss_kib", "fds", "actor_fds", "shm_bytes", "arena_used"):
    first, peak = warm[0][key], max(r[key] for r in warm)
    growth = (peak - first) / max(first, 1)
    verdict[key] = {"after_warmup": first, "peak": peak, "growth": round(growth, 4),
                    "plateau": growth <= tolerance}
  elapsed = time.monotonic() - t0
  return {"ops": ops, "seconds": round(elapsed, 1), "ops_per_second": round(ops / elapsed),
          "curve": curve, "verdict": verdict,
          "plateau": all(v["plateau"] for v in verdict.values())}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ops", type=int, default=3_000_000)
  parser.add_argument("--every", type=int, default=100_000, help="ops between two samples")
  parser.add_argument("--tolerance", type=float, default=0.05)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  result = run(args.ops, args.every, args.tolerance)
  for key, v in result["verdict"].items():
    print(f"{key:14} after warm-up {v['after_warmup']:>12}  peak {v['peak']:>12}  "
          f"growth {100 * v['growth']:6.2f}%  {'flat' if v['plateau'] else 'GROWING'}")
  print(f"{result['ops']} ops in {result['seconds']} s ({result['ops_per_second']} ops/s); "
        f"plateau: {result['plateau']}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
  return 0 if result["plateau"] else 1


if __name__ == "__main__":
  sys.exit(main())
