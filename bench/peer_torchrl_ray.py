"""TorchRL side of workload R1 (run with the torchrl_ray peer venv: tests/peers/torchrl_ray.txt):
TorchRL's RayReplayBuffer (one Ray actor holding a ReplayBuffer over a LazyTensorStorage, on the
head node) on the same 3-node local Ray cluster as bench/ray_r1.py.

    $(tests/peers/venv.sh torchrl_ray) bench/peer_torchrl_ray.py --workloads R1

Rows: R1_write RayReplayBuffer (one writer actor per worker node, rb.client().add(transition)
per step) and R1_sample RayReplayBuffer (the driver's rb.sample(256)).
"""
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _ray_common as common  # noqa: E402
from _timing import row, run_main, timed  # noqa: E402


def r1(args):
  import ray  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  from tensordict import TensorDict  # pylint: disable=g-import-not-at-top
  from torchrl.data import LazyTensorStorage, RayReplayBuffer  # pylint: disable=g-import-not-at-top

  common.env_check()
  torch.set_num_threads(1)
  cluster = common.start_cluster()
  rb = None
  try:
    rb = RayReplayBuffer(storage=functools.partial(LazyTensorStorage, 1_000_000),
                         batch_size=common.SAMPLE_BATCH,
                         ray_init_config={"address": cluster.address},
                         remote_config={"num_cpus": 0, "resources": {"head": 0.01}})

    def td(i):
      t = common.transition(i)
      return TensorDict({k: torch.as_tensor(v) for k, v in t.items()}, batch_size=[])

    @ray.remote
    class Writer:
      def __init__(self, client):
        import torch as t  # pylint: disable=g-import-not-at-top,redefined-outer-name,reimported
        t.set_num_threads(1)
        self.client = client
        self.data = td(0)

      def run(self, start_at, warmup, duration):
        client, data = self.client, self.data
        return common.writer_loop(lambda i: client.add(data), start_at, warmup, duration)

      def fill(self, n):
        for i in range(n):
          self.client.add(td(i))
        return n

    writers = [Writer.options(**common.on_node(l)).remote(rb.client())
               for l in common.WRITER_NODES]
    ray.get([w.fill.remote(100) for w in writers], timeout=300)
    rows = [row("R1_write", "RayReplayBuffer", f"{len(writers)} writer actors, "
                "RayReplayBuffer client add() per transition",
                common.run_writers(writers, args.duration, args.warmup))]
    batch = TensorDict({k: torch.as_tensor(v).expand(common.FILL_PER_NODE, *torch.as_tensor(
        v).shape).clone() for k, v in common.transition(0).items()},
                       batch_size=[common.FILL_PER_NODE])
    for _ in range(3):
      rb.extend(batch)
    rate, _, _ = timed(lambda: rb.sample(common.SAMPLE_BATCH).batch_size[0], args.duration,
                       args.warmup)
    rows.append(row("R1_sample", "RayReplayBuffer", "RayReplayBuffer.sample(256) from the "
                    "driver", rate))
    for w in writers:
      ray.kill(w)
    return rows
  finally:
    if rb is not None:
      rb.close()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
  run_main(__doc__, {"R1": r1})
