"""Same-process A/B of the one-call C insert plans (reverb_shm/hot_plans.py) against the Python
paths they replace: Client.insert of one step and SharedTable.insert of a 1-step batch.

  python bench/ab_hot_insert.py [--calls 1000] [--repeats 30]

"old" is the same build with the C plans switched off (PlanCache.get returns None), so each call
takes the Python path of before; per-call times are best-of-repeats of `calls` calls, A and B
interleaved.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import reverb_shm as reverb  # noqa: E402
from reverb_shm import hot_plans  # noqa: E402


def best_us(fn, calls, repeats):
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn(calls)
    best = min(best, time.perf_counter() - t0)
  return best / calls * 1e6


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--calls", type=int, default=1000)
  parser.add_argument("--repeats", type=int, default=30)
  args = parser.parse_args()
  tables = [reverb.Table(name, sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
                        max_size=size, rate_limiter=reverb.rate_limiters.MinSize(1))
            for name, size in (("t", 100_000), ("f", 5_000))]
  step = {"obs": np.full(8, 1, np.float32), "action": np.int64(1), "reward": np.float32(1)}
  batch = {k: np.asarray(v)[None] for k, v in step.items()}
  frame = {"frame": np.zeros((84, 84, 4), np.uint8)}
  real_get = hot_plans.PlanCache.get
  with reverb.Server(tables, arena_bytes=1 << 30) as srv:
    cases = []
    for name, data, t in (("W1 step", step, "t"), ("W5 frame", frame, "f")):
      client = srv.localhost_client()
      cases.append((f"Client.insert {name}",
                    lambda n, c=client, d=data, t=t: [c.insert(d, {t: 1.0}) for _ in range(n)],
                    client))
    st = srv.shared_table("t")
    cases.append(("SharedTable.insert 1-step batch",
                  lambda n: [st.insert(batch, 1.0) for _ in range(n)], st))
    for label, fn, owner in cases:
      times = {"old": [], "new": []}
      for _ in range(3):
        for variant in ("new", "old"):
          hot_plans.PlanCache.get = real_get if variant == "new" else lambda *a: None
          if variant == "old":   # forget the learnt plans
            if isinstance(owner, reverb.SharedTable):
              owner._hot_plan = None  # pylint: disable=protected-access
            else:
              owner._hot_plans.clear()  # pylint: disable=protected-access
          fn(2)   # (learn)
          times[variant].append(best_us(fn, args.calls, args.repeats // 3))
      hot_plans.PlanCache.get = real_get
      new, old = min(times["new"]), min(times["old"])
      print(f"{label:36s} old {old:6.2f} us  new {new:6.2f} us  speed-up {old / new:5.2f}x")


if __name__ == "__main__":
  main()
