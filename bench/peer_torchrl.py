"""TorchRL 0.14 side of workloads L1 and L2 (run with the `torchrl` peer venv:
tests/peers/venv.sh torchrl).

    $(tests/peers/venv.sh torchrl) bench/peer_torchrl.py --workloads L1 L2 --items 1000000

L1: TensorDictReplayBuffer(LazyTensorStorage(items), PrioritizedSampler(alpha=0.6, beta=0.4),
batch_size=256) holding the same items as bench/learner_workloads.py; per iteration rb.sample()
(torch tensors) + rb.update_priority(index, priorities); variants prefetch=None ("no_prefetch")
and prefetch=4 ("prefetch4").
L2: ReplayBuffer over the same steps (episodes of 1000 steps) with SliceSampler(slice_len=80,
traj_key='episode'), batch_size=64 * 80: 64 windows of 80 steps per sample.

Prints one `RESULTS [json rows]` line.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.data import (LazyTensorStorage, PrioritizedSampler, ReplayBuffer,  # noqa: E402
                          TensorDictReplayBuffer)
from torchrl.data.replay_buffers.samplers import SliceSampler  # noqa: E402

from _timing import row, run_main, timed  # noqa: E402

BATCH = 256
L1_ITEM_BYTES = 84 * 4 + 8 + 4
WINDOW, WINDOWS_PER_BATCH, EPISODE = 80, 64, 1000
L2_STEP_BYTES = 8 * 4 + 8 + 4


def _steps(start: int, n: int, obs_dim: int) -> TensorDict:
  v = torch.arange(start, start + n)
  return TensorDict({"obs": v[:, None].float().expand(n, obs_dim).contiguous(),
                     "action": v.long(), "reward": v.float(),
                     "episode": v // EPISODE}, batch_size=[n])


def l1(args):
  n = args.items
  rows = []
  for variant, prefetch in (("no_prefetch", None), ("prefetch4", 4)):
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(n), batch_size=BATCH, prefetch=prefetch,
        sampler=PrioritizedSampler(max_capacity=n, alpha=0.6, beta=0.4))
    gen = torch.Generator().manual_seed(0)
    for s in range(0, n, 100_000):
      b = min(100_000, n - s)
      index = rb.extend(_steps(s, b, 84).exclude("episode"))
      rb.update_priority(index, torch.rand(b, generator=gen) + 0.1)
    new_priorities = torch.rand(BATCH, generator=gen) + 0.1

    def loop(rb=rb, new_priorities=new_priorities):
      sample = rb.sample()
      _ = sample["obs"], sample["action"], sample["reward"], sample["priority_weight"]
      rb.update_priority(sample["index"], new_priorities)
      return BATCH
    rows.append(row("L1", variant, f"TensorDictReplayBuffer(LazyTensorStorage, PrioritizedSampler,"
                    f" prefetch={prefetch}): sample + update_priority",
                    timed(loop, args.duration, args.warmup)[0], L1_ITEM_BYTES, table_items=n))
    del rb
  return rows


def l2(args):
  n = args.items
  rb = ReplayBuffer(storage=LazyTensorStorage(n), batch_size=WINDOWS_PER_BATCH * WINDOW,
                    sampler=SliceSampler(slice_len=WINDOW, traj_key="episode"))
  for s in range(0, n, 100_000):
    rb.extend(_steps(s, min(100_000, n - s), 8))
  first = rb.sample()
  assert first["obs"].shape == (WINDOWS_PER_BATCH * WINDOW, 8)

  def loop():
    sample = rb.sample()
    _ = sample["obs"].view(WINDOWS_PER_BATCH, WINDOW, 8), sample["action"], sample["reward"]
    return WINDOWS_PER_BATCH
  return [row("L2", "SliceSampler", f"ReplayBuffer(LazyTensorStorage, SliceSampler(slice_len="
              f"{WINDOW})).sample() of {WINDOWS_PER_BATCH} windows",
              timed(loop, args.duration, args.warmup)[0], WINDOW * L2_STEP_BYTES,
              table_steps=n)]


WORKLOADS = {"L1": l1, "L2": l2}

if __name__ == "__main__":
  torch.set_num_threads(1)
  run_main(__doc__, WORKLOADS)
