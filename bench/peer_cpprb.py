"""cpprb 11 side of the benchmark suite (run with a venv that has cpprb).

    /tmp/refvenv/bin/python bench/peer_cpprb.py --workloads W1 W3 W4 W5

Prints one `RESULTS [json rows]` line. Variants name the buffer class: ReplayBuffer,
PrioritizedReplayBuffer (single process) and MPPrioritizedReplayBuffer (multi-process, used
here from one process: the cost of its shared-memory locking is what is measured).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cpprb  # noqa: E402
import numpy as np  # noqa: E402

from _timing import FRAME_BYTES, FRAME_SHAPE, row, run_main, timed  # noqa: E402

ENV = {"obs": {"shape": 8, "dtype": np.float32}, "action": {"dtype": np.int64},
       "reward": {"dtype": np.float32}}


def batch(n):
  v = np.arange(n)
  return {"obs": np.repeat(v[:, None], 8, axis=1).astype(np.float32),
          "action": v.astype(np.int64), "reward": v.astype(np.float32)}


def w1(args):
  rb = cpprb.ReplayBuffer(1_000_000, ENV)
  obs, action, reward = np.ones(8, np.float32), np.int64(1), np.float32(1)

  def op():
    for _ in range(100):
      rb.add(obs=obs, action=action, reward=reward)
    return 100
  return [row("W1", "ReplayBuffer", "ReplayBuffer.add (1 step per call)",
              timed(op, args.duration, args.warmup)[0])]


def filled(cls, n, **kw):
  rb = cls(n, ENV, **kw)
  for s in range(0, n, 100_000):
    rb.add(**batch(min(100_000, n - s)))
  return rb


def w3(args):
  rb = filled(cpprb.ReplayBuffer, args.items)
  return [row("W3", "ReplayBuffer", "ReplayBuffer.sample(256)",
              timed(lambda: len(rb.sample(256)["action"]), args.duration, args.warmup)[0],
              table_items=args.items)]


def prioritized(args, cls, n):
  rb = filled(cls, n, alpha=0.6)
  rng = np.random.default_rng(0)

  def op():
    s = rb.sample(256, beta=0.4)
    rb.update_priorities(s["indexes"], rng.random(256) + 0.1)
    return 256
  return timed(op, args.duration, args.warmup)[0]


def w4(args):
  return [row("W4", name, f"{name}.sample(256) + update_priorities",
              prioritized(args, getattr(cpprb, name), args.items), table_items=args.items)
          for name in ("PrioritizedReplayBuffer", "MPPrioritizedReplayBuffer")]


def w5(args):
  env = {"frame": {"shape": FRAME_SHAPE, "dtype": np.uint8}}
  rb = cpprb.ReplayBuffer(args.frames, env)
  frame = np.random.default_rng(0).integers(0, 256, FRAME_SHAPE, dtype=np.uint8)

  def ins():
    for _ in range(16):
      rb.add(frame=frame)
    return 16
  rows = [row("W5_insert", "ReplayBuffer", "ReplayBuffer.add (1 frame per call)",
              timed(ins, args.duration, args.warmup)[0], FRAME_BYTES)]
  while rb.get_stored_size() < args.frames:
    ins()
  rows.append(row("W5_sample", "ReplayBuffer", "ReplayBuffer.sample(64)",
                  timed(lambda: len(rb.sample(64)["frame"]), args.duration, args.warmup)[0],
                  FRAME_BYTES))
  return rows


def scaling(args):
  return [row(f"scale_{n}", "PrioritizedReplayBuffer", "sample(256) + update_priorities",
              prioritized(args, cpprb.PrioritizedReplayBuffer, n), table_items=n)
          for n in args.scales]


WORKLOADS = {"W1": w1, "W3": w3, "W4": w4, "W5": w5, "scaling": scaling}




if __name__ == "__main__":
  run_main(__doc__, WORKLOADS)
