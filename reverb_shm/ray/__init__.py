"""reverb_shm on Ray: one shared-memory server per node, local-first clients, global sampling.

Optional extra `ray` (`pip install reverb_shm[ray]`); Ray is imported only inside this package.

  ReplayCluster.start(tables, nodes=...)  starts a Server + bridge on each chosen Ray node
                                          and returns a picklable ClusterHandle
  ClusterHandle.client()                  a Client for the calling task/actor: shared memory
                                          when its node's segment is reachable, else a bridge
  ClusterHandle.global_client()           a ClusterClient: batches sampled across every node
                                          with the probabilities of one global table
  ClusterHandle.checkpoint() / replace()  checkpoint every node; restart a lost node's server
                                          elsewhere from its last checkpoint
"""
try:
  import ray as _ray  # noqa: F401  pylint: disable=unused-import
except ImportError as e:   # pragma: no cover - exercised by a subprocess test
  raise ImportError(
      "reverb_shm.ray needs Ray: install the extra with `pip install reverb_shm[ray]`") from e

from reverb_shm.ray.cluster import ClusterHandle, ReplayCluster, ShardEntry
from reverb_shm.ray.sampling import ClusterClient, split_batch

__all__ = ["ClusterClient", "ClusterHandle", "ReplayCluster", "ShardEntry", "split_batch"]
