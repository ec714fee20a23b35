"""Same-process A/B of the one-call C insert plans (reverb_shm/_internal/hot_plans.py) against the Python
paths they replace: Client.insert of one step and SharedTable.insert of a 1-step batch; and of
the plans' open chunks against one-shot chunks (each insert allocating its own).

  python bench/ab_hot_insert.py [--calls 1000] [--repeats 30] [--arena-items 200000]

Variants, each with objects made fresh (so plans are learnt under it), interleaved:
  python    the same build with the C plans switched off (PlanCache.get returns None): each call
            takes the Python path;
  one-shot  C plans whose inserts allocate chunks of their own (hot_plans._open_rows -> 0), the
            plans of before open chunks;
  open      C plans appending to open chunks (the default).
Per-call times are best-of-repeats of `calls` calls. The arena part inserts `arena_items` W1
steps through Client.insert per variant and reports arena bytes per item beyond the payload.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import reverb_shm as reverb  # noqa: E402
from reverb_shm._internal import hot_plans  # noqa: E402


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
  parser.add_argument("--arena-items", type=int, default=200_000)
  args = parser.parse_args()
  tables = [reverb.Table(name, sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
                        max_size=size, rate_limiter=reverb.rate_limiters.MinSize(1))
            for name, size in (("t", 100_000), ("f", 5_000))]
  step = {"obs": np.full(8, 1, np.float32), "action": np.int64(1), "reward": np.float32(1)}
  batch = {k: np.asarray(v)[None] for k, v in step.items()}
  frame = {"frame": np.zeros((84, 84, 4), np.uint8)}
  real_get, real_rows = hot_plans.PlanCache.get, hot_plans._open_rows  # pylint: disable=protected-access

  def use(variant):
    hot_plans.PlanCache.get = real_get if variant != "python" else lambda *a: None
    hot_plans._open_rows = real_rows if variant == "open" else lambda columns: 0  # pylint: disable=protected-access

  variants = ("open", "one-shot", "python")
  with reverb.Server(tables, arena_bytes=1 << 30) as srv:
    makers = [
        (f"Client.insert {name}",
         lambda d=data, t=t: (lambda n, c=srv.localhost_client(): [c.insert(d, {t: 1.0})
                                                                   for _ in range(n)]))
        for name, data, t in (("W1 step", step, "t"), ("W5 frame", frame, "f"))]
    makers.append(("SharedTable.insert 1-step batch",
                   lambda: (lambda n, st=srv.shared_table("t"): [st.insert(batch, 1.0)
                                                                 for _ in range(n)])))
    for label, make in makers:
      times = {v: [] for v in variants}
      for _ in range(3):
        for variant in variants:
          use(variant)
          fn = make()
          fn(2)   # (learn)
          times[variant].append(best_us(fn, args.calls, args.repeats // 3))
      use("open")
      best = {v: min(t) for v, t in times.items()}
      print(f"{label:34s} " + "  ".join(f"{v} {best[v]:6.2f} us" for v in variants)
            + f"  open vs one-shot {best['one-shot'] / best['open']:4.2f}x"
            + f"  vs python {best['python'] / best['open']:4.2f}x")
  payload = sum(np.asarray(v).nbytes for v in step.values())
  for variant in ("open", "one-shot"):
    use(variant)
    table = reverb.Table("a", sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
                         max_size=args.arena_items + 10,
                         rate_limiter=reverb.rate_limiters.MinSize(1))
    with reverb.Server([table], arena_bytes=1 << 30) as srv:
      client = srv.localhost_client()
      client.insert(step, {"a": 1.0})
      before = srv.segment.info()["arena_used"]
      t0 = time.perf_counter()
      for _ in range(args.arena_items):
        client.insert(step, {"a": 1.0})
      us = (time.perf_counter() - t0) / args.arena_items * 1e6
      per_item = (srv.segment.info()["arena_used"] - before) / args.arena_items
      print(f"arena, {args.arena_items} W1 items via Client.insert, {variant:8s}: "
            f"{per_item - payload:7.1f} B/item beyond the {payload} B payload ({us:.2f} us/call)")
  use("open")


if __name__ == "__main__":
  main()
