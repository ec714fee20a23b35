"""reverb_shm side of workload R1: replay on a multi-node Ray cluster (run with the project's
Python; bench/peer_torchrl_ray.py is the TorchRL side).

    python bench/ray_r1.py --workloads R1

Rows (one RESULTS line):
  R1_write  reverb_shm   items/s of one writer actor per worker node, each inserting one
                         transition per Client.insert into its own node's server (shared memory)
  R1_sample reverb_shm   items/s of the learner (driver, head node) drawing 256 per call with
                         ClusterClient.sample_batch across the 3 nodes' servers (global uniform
                         split by the masses of earlier answers, max_mass_age_s=0.1; the
                         bridges' parts of the next 32 batches requested ahead, 16 batches
                         (4096 items) per request and bridge, prefetch=32: the documented
                         setting for a learner across nodes);
                         variants reverb_shm_prefetch4 (prefetch=4), reverb_shm_mass_cache (no
                         prefetch) and reverb_shm_sync (masses read before each draw, no
                         prefetch)
  R1_cross  same_node / cross_node   items/s of batches of 256 drawn from the driver on the
                         head node's server (shared memory) and on a worker node's (bridge)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _ray_common as common  # noqa: E402
from _timing import row, run_main, timed  # noqa: E402

TABLE = "r1"


def r1(args):
  import ray  # pylint: disable=g-import-not-at-top
  import reverb_shm as reverb  # pylint: disable=g-import-not-at-top
  from reverb_shm.ray import ReplayCluster  # pylint: disable=g-import-not-at-top

  common.env_check()
  cluster = common.start_cluster()
  handle = None
  try:
    table = reverb.Table(TABLE, reverb.selectors.Uniform(), reverb.selectors.Fifo(), 1_000_000,
                         reverb.rate_limiters.MinSize(1))
    nodes = [cluster.node_id(l) for l in ("head",) + common.WRITER_NODES]
    handle = ReplayCluster.start([table], nodes=nodes,
                                 server_kwargs={"arena_bytes": 192 << 20})

    @ray.remote
    class Writer:
      def __init__(self, handle):
        self.client = handle.client()
        self.kind = type(self.client).__name__
        self.data = common.transition(0)

      def run(self, start_at, warmup, duration):
        client, data = self.client, self.data
        return common.writer_loop(lambda i: client.insert(data, {TABLE: 1.0}), start_at, warmup,
                                  duration)

      def fill(self, n):
        for i in range(n):
          self.client.insert(common.transition(i), {TABLE: 1.0})
        return self.kind

    writers = [Writer.options(**common.on_node(l)).remote(handle) for l in common.WRITER_NODES]
    kinds = ray.get([w.fill.remote(common.FILL_PER_NODE) for w in writers], timeout=300)
    assert kinds == ["Client"] * len(writers), kinds   # each writer on its node's shared memory
    rows = [row("R1_write", "reverb_shm", f"{len(writers)} writer actors, Client.insert into "
                "their node's server", common.run_writers(writers, args.duration, args.warmup))]
    head_client = handle.client()
    for i in range(common.FILL_PER_NODE):
      head_client.insert(common.transition(i), {TABLE: 1.0})

    cc = handle.global_client(timeout_s=10)
    variants = (
        ("reverb_shm", {"max_mass_age_s": 0.1, "prefetch": 32},
         "ClusterClient.sample_batch(256) across 3 nodes, prefetch=32, max_mass_age_s=0.1"),
        ("reverb_shm_prefetch4", {"max_mass_age_s": 0.1, "prefetch": 4},
         "ClusterClient.sample_batch(256) across 3 nodes, prefetch=4, max_mass_age_s=0.1"),
        ("reverb_shm_mass_cache", {"max_mass_age_s": 0.1},
         "ClusterClient.sample_batch(256) across 3 nodes, max_mass_age_s=0.1, no prefetch"),
        ("reverb_shm_sync", {},
         "ClusterClient.sample_batch(256) across 3 nodes (masses read before each draw)"))
    for variant, kwargs, api in variants:
      sampler = handle.global_client(timeout_s=10, **kwargs)
      rate, _, _ = timed(lambda s=sampler: len(s.sample_batch(TABLE, common.SAMPLE_BATCH).info.key),
                         args.duration, args.warmup)
      rows.append(row("R1_sample", variant, api, rate))
      sampler.close()

    same = handle.client(shard=0).shared_table(TABLE)
    cross = handle.client(shard=1)
    assert type(cross).__name__ == "RemoteClient"
    for variant, draw, api in (
        ("same_node", lambda: len(same.sample_batch(common.SAMPLE_BATCH).info.key),
         "SharedTable.sample_batch(256) on the head node's server (shared memory)"),
        ("cross_node", lambda: len(cross.sample_batch_with_stats(
            TABLE, common.SAMPLE_BATCH)[0].info.key),
         "RemoteClient.sample_batch_with_stats(256) from the head node to a worker node's "
         "bridge")):
      rate, _, _ = timed(draw, args.duration, args.warmup)
      rows.append(row("R1_cross", variant, api, rate))
    cc.close()
    for w in writers:
      ray.kill(w)
    return rows
  finally:
    if handle is not None:
      handle.stop(timeout_s=30)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
  run_main(__doc__, {"R1": r1})
