"""ReplayCluster / ClusterHandle: a reverb_shm server per Ray node, and how tasks reach them.

Each shard is a detached Ray actor pinned to its node (NodeAffinitySchedulingStrategy, not
soft) that owns a reverb_shm Server (segment /dev/shm/rvshm.NAME on that node) and the Server's
gRPC bridge bound to the node's IP with a per-cluster random token. The handle is a plain
picklable value (node ids, segment names, bridge addresses, the token): pass it to any Ray task
or actor.

Same node or not is decided by trying: `client()` attaches to its node's segment by name and
checks the segment's generation id against the one the shard reported; if the segment is not
there (another host, or a node whose processes see another /dev/shm) it uses a bridge.

Checkpoints: shard i writes to `checkpoint_root/shard-i`. On a real cluster `checkpoint_root`
must be storage every node sees (NFS, a mounted bucket), or a replacement node cannot restore.
"""
import dataclasses
import os
import secrets
import tempfile
import time
import warnings
import zlib
from typing import List, Optional, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from reverb_shm import client as client_lib
from reverb_shm import errors
from reverb_shm import table as table_lib
from reverb_shm.ray import _node

__all__ = ["ClusterHandle", "ReplayCluster", "ShardEntry"]

NAMESPACE = "reverb_shm"
# Servers of a cluster are small by default: a node's workers attach to it, few others.
DEFAULT_SERVER_KWARGS = {"max_procs": 64, "pins_per_proc": 1 << 14}
_NodeServerActor = None


def _actor_class():
  global _NodeServerActor
  if _NodeServerActor is None:
    _NodeServerActor = ray.remote(_node.NodeServer)
  return _NodeServerActor


@dataclasses.dataclass(frozen=True)
class ShardEntry:
  """Where one shard's server runs.

  Attributes:
    shard: index of the shard (fixed for the cluster's life; a replacement keeps it).
    node_id: Ray node id (hex) of the node running it.
    server_name: the segment's name (/dev/shm/rvshm.NAME on that node).
    port: the server's registered port on that node.
    bridge_address: 'IP:PORT' of its gRPC bridge.
    generation: the segment's random generation id (tells a restarted server apart).
    actor_name: the detached actor's name in namespace 'reverb_shm'.
    restored_from: checkpoint directory found when the server started, or None.
    pid: the server process's pid on its node.
  """
  shard: int
  node_id: str
  server_name: str
  port: int
  bridge_address: str
  generation: int
  actor_name: str
  restored_from: Optional[str] = None
  pid: int = 0


def _current_node_id() -> Optional[str]:
  try:
    return ray.get_runtime_context().get_node_id()
  except Exception:  # pylint: disable=broad-except  (Ray not initialised in this process)
    return None


def alive_node_ids() -> List[str]:
  """Ids of the Ray nodes that are alive, in a stable order (the head node's first)."""
  nodes = [n for n in ray.nodes() if n.get("Alive")]
  nodes.sort(key=lambda n: (not n.get("Resources", {}).get("node:__internal_head__", 0),
                            n["NodeID"]))
  return [n["NodeID"] for n in nodes]


@dataclasses.dataclass
class ClusterHandle:
  """A started cluster of per-node servers (picklable; see the module docstring).

  Attributes:
    cluster_id: random id naming the actors and segments.
    entries: one ShardEntry per shard, in shard order.
    token: the bridges' auth token.
    checkpoint_root: where shard i checkpoints (checkpoint_root/shard-i).
    tables: the tables every shard's server holds (unbound Table objects).
    server_kwargs: further Server arguments of every shard.
  """
  cluster_id: str
  entries: List[ShardEntry]
  token: str
  checkpoint_root: str
  tables: List[table_lib.Table]
  server_kwargs: dict

  @property
  def num_shards(self) -> int:
    return len(self.entries)

  def table_names(self) -> List[str]:
    return [t.name for t in self.tables]

  # ---- clients
  def local_shard(self) -> Optional[int]:
    """The shard on the calling process's Ray node, or None."""
    node = _current_node_id()
    for e in self.entries:
      if e.node_id == node:
        return e.shard
    return None

  def attach_local(self, shard: int) -> Optional[client_lib.Client]:
    """A shared-memory Client of `shard` if its segment is reachable from this process, is the
    one the shard reported (same generation id) and its server lives; else None."""
    return self._attach(shard, raise_dead=False)

  def _attach(self, shard: int, raise_dead: bool) -> Optional[client_lib.Client]:
    """attach_local; with `raise_dead`, the DeadOwnerError of a segment of this shard's server
    name whose server died (it is on this node: its bridge is gone with it)."""
    e = self.entries[shard]
    c = client_lib.Client(f"shm://{e.server_name}")
    try:
      seg = c._segment()  # pylint: disable=protected-access
      if int(seg.info()["generation"]) != e.generation:
        return None
      if seg.owner_dead:
        raise seg.dead_owner_error()
      return c
    except errors.DeadOwnerError:
      if raise_dead:
        raise
    except (errors.ReverbError, OSError, ValueError):
      pass
    return None

  def remote_client(self, shard: int, reconnect_timeout_s: float = 10.0):
    """A bridge client of `shard` (RemoteClient) with the cluster's token."""
    from reverb_shm.bridge import ClientCredentials, RemoteClient  # pylint: disable=g-import-not-at-top
    return RemoteClient(self.entries[shard].bridge_address,
                        ClientCredentials(token=self.token),
                        reconnect_timeout_s=reconnect_timeout_s)

  def client(self, shard: Optional[int] = None, reconnect_timeout_s: float = 10.0):
    """A Client for this task/actor: of `shard`, or by default of the shard on this process's
    node, else of a shard picked from this node's id (a stable spread of writers).

    The client works on shared memory when the shard's segment is reachable from here and is
    that shard's (tried, not assumed); otherwise it is a RemoteClient over the shard's bridge.

    Raises:
      ValueError: `shard` outside [0, num_shards).
      DeadOwnerError: the shard's server is on this node and has died (at once, rather than a
        RemoteClient to its bridge, gone with it, failing after reconnect_timeout_s).
    """
    if shard is None:
      shard = self.local_shard()
    if shard is None:
      node = _current_node_id() or str(os.getpid())
      shard = zlib.crc32(node.encode()) % self.num_shards
    if not 0 <= shard < self.num_shards:
      raise ValueError(f"shard must be in [0, {self.num_shards}), got {shard!r}")
    local = self._attach(shard, raise_dead=True)
    return local if local is not None else self.remote_client(shard, reconnect_timeout_s)

  def global_client(self, **kwargs):
    """A ClusterClient sampling across every shard (see reverb_shm.ray.sampling)."""
    from reverb_shm.ray.sampling import ClusterClient  # pylint: disable=g-import-not-at-top
    return ClusterClient(self, **kwargs)

  # ---- lifecycle
  def _actor(self, shard: int):
    return ray.get_actor(self.entries[shard].actor_name, namespace=NAMESPACE)

  def checkpoint(self, timeout_s: float = 120.0) -> List[Optional[str]]:
    """Checkpoints every shard in parallel; the checkpoint directories in shard order.

    A shard that does not answer within `timeout_s` (its node died) gets None and a warning.
    """
    refs = {}
    for e in self.entries:
      try:
        refs[e.shard] = self._actor(e.shard).checkpoint.remote()
      except ValueError:   # no such actor any more
        pass
    paths = []
    for e in self.entries:
      path = None
      if e.shard in refs:
        try:
          path = ray.get(refs[e.shard], timeout=timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
          warnings.warn(f"shard {e.shard} (node {e.node_id}) did not checkpoint: {exc!r}",
                        stacklevel=2)
      else:
        warnings.warn(f"shard {e.shard} (node {e.node_id}) did not checkpoint: its server actor "
                      "is gone", stacklevel=2)
      paths.append(path)
    return paths

  def alive(self, timeout_s: float = 10.0) -> List[bool]:
    """Whether each shard's actor answers within `timeout_s` (all asked in parallel)."""
    refs = []
    for e in self.entries:
      try:
        refs.append(self._actor(e.shard).info.remote())
      except ValueError:
        refs.append(None)
    out = []
    for ref in refs:
      try:
        out.append(ref is not None and bool(ray.get(ref, timeout=timeout_s)))
      except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
        out.append(False)
    return out

  def replace(self, shard: int, node_id: str, timeout_s: float = 120.0) -> ShardEntry:
    """Starts `shard`'s server again on node `node_id`, restored from the shard's newest
    checkpoint; updates this handle (pass the new handle to tasks that need the shard) and
    returns the new entry.

    The old actor counts as alive when it answers within min(10, timeout_s) seconds; one that
    does not (its node died or stalls) is killed first. A new actor that Ray fails before it
    runs while `node_id` lives is started again, within `timeout_s`.

    Raises:
      ValueError: the shard's old actor is still alive (stop it first) or a bad shard index;
        nothing is changed then.
      GetTimeoutError: the new server did not start within `timeout_s`.
    """
    if not 0 <= shard < self.num_shards:
      raise ValueError(f"shard must be in [0, {self.num_shards}), got {shard!r}")
    old = self.entries[shard]
    try:
      actor = ray.get_actor(old.actor_name, namespace=NAMESPACE)
    except ValueError:   # no such actor any more
      actor = None
    if actor is not None:
      try:
        alive = bool(ray.get(actor.info.remote(), timeout=min(10.0, timeout_s)))
      except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
        alive = False
      if alive:
        raise ValueError(f"shard {shard}'s server (actor {old.actor_name!r} on node "
                         f"{old.node_id}) is still alive: stop it before replacing it")
      ray.kill(actor, no_restart=True)   # a dead node's actor may still be registered
    entry = _start_shard_retrying(self, shard, node_id, timeout_s)
    self.entries[shard] = entry
    return entry

  def stop(self, timeout_s: float = 30.0) -> None:
    """Stops every shard's server and kills its actor (dead shards are skipped)."""
    refs = []
    for e in self.entries:
      try:
        actor = self._actor(e.shard)
      except ValueError:
        continue
      refs.append((actor, actor.stop.remote()))
    for actor, ref in refs:
      try:
        ray.get(ref, timeout=timeout_s)
      except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
        pass
      ray.kill(actor, no_restart=True)


def _actor_name(handle: ClusterHandle, shard: int) -> str:
  return f"{handle.cluster_id}.shard{shard}"


def _start_shard(handle: ClusterHandle, shard: int, node_id: str, timeout_s: float,
                 ref_only: bool = False):
  server_name = f"rvray_{handle.cluster_id}_{shard}_{secrets.token_hex(3)}"
  actor_name = _actor_name(handle, shard)
  actor = _actor_class().options(
      name=actor_name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_restarts=0,
      max_concurrency=4,
      scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
          handle.tables, server_name,
          os.path.join(handle.checkpoint_root, f"shard-{shard}"), handle.token,
          handle.server_kwargs)
  ref = actor.info.remote()
  if ref_only:
    return actor_name, ref
  return _entry(shard, actor_name, ray.get(ref, timeout=timeout_s))


def _start_shard_retrying(handle: ClusterHandle, shard: int, node_id: str,
                          timeout_s: float) -> ShardEntry:
  """_start_shard, started again while the new actor dies before it runs but `node_id` lives.

  Right after a node died, Ray may still count it alive (until its health checks have failed
  enough times), and Ray versions that send an actor's lease to a node picked among those
  (rather than straight to its affinity node) then fail the new actor when that node is
  declared dead, with that node's death as the cause.
  """
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      return _start_shard(handle, shard, node_id, max(1.0, deadline - time.monotonic()))
    except ray.exceptions.RayActorError:
      if time.monotonic() >= deadline or node_id not in alive_node_ids():
        raise
      try:
        ray.kill(ray.get_actor(_actor_name(handle, shard), namespace=NAMESPACE),
                 no_restart=True)
      except ValueError:   # (gone already)
        pass
      time.sleep(0.5)


def _entry(shard: int, actor_name: str, info: dict) -> ShardEntry:
  return ShardEntry(shard=shard, node_id=info["node_id"], server_name=info["server_name"],
                    port=info["port"], bridge_address=info["bridge_address"],
                    generation=info["generation"], actor_name=actor_name,
                    restored_from=info["restored_from"], pid=info["pid"])


class ReplayCluster:
  """Starts reverb_shm servers on Ray nodes (see `start`)."""

  @staticmethod
  def start(tables: Sequence[table_lib.Table], nodes=None, *,
            checkpoint_root: Optional[str] = None, server_kwargs: Optional[dict] = None,
            timeout_s: float = 120.0) -> ClusterHandle:
    """Starts one server (with a bridge) per node, every server holding `tables`.

    Args:
      tables: reverb_shm.Table objects (unbound; each server gets its own copy).
      nodes: Ray node ids (hex), an int n (the first n alive nodes, head first), or None
        (every alive node).
      checkpoint_root: directory of the shards' checkpoints; must be shared by the nodes on a
        real cluster. Default: a new directory under the system temp dir.
      server_kwargs: further reverb_shm.Server arguments (arena_bytes, max_procs,
        pins_per_proc); default max_procs=64, pins_per_proc=16384.
      timeout_s: how long to wait for the servers to start.

    Raises:
      RuntimeError: Ray is not initialised.
      ValueError: no tables, unknown or dead node ids, duplicate nodes.
      GetTimeoutError: a server did not start in time (the ones started are stopped).
    """
    if not ray.is_initialized():
      raise RuntimeError("ReplayCluster.start needs ray.init() first")
    tables = list(tables)
    if not tables or not all(isinstance(t, table_lib.Table) for t in tables):
      raise ValueError(f"tables must be a non-empty list of reverb_shm.Table, got {tables!r}")
    alive = alive_node_ids()
    if nodes is None:
      nodes = alive
    elif isinstance(nodes, int) and not isinstance(nodes, bool):
      if not 1 <= nodes <= len(alive):
        raise ValueError(f"nodes={nodes} but the Ray cluster has {len(alive)} alive nodes")
      nodes = alive[:nodes]
    nodes = list(nodes)
    unknown = [n for n in nodes if n not in alive]
    if unknown or not nodes or len(set(nodes)) != len(nodes):
      raise ValueError(f"nodes must be distinct ids of alive Ray nodes {alive}; got {nodes}")
    cluster_id = secrets.token_hex(4)
    if checkpoint_root is None:
      checkpoint_root = os.path.join(tempfile.gettempdir(), "reverb_shm_ray", cluster_id)
    handle = ClusterHandle(cluster_id=cluster_id, entries=[], token=secrets.token_hex(16),
                           checkpoint_root=os.path.abspath(checkpoint_root),
                           tables=tables,
                           server_kwargs=dict(DEFAULT_SERVER_KWARGS, **(server_kwargs or {})))
    started = [_start_shard(handle, i, n, timeout_s, ref_only=True) for i, n in enumerate(nodes)]
    try:
      infos = ray.get([ref for _, ref in started], timeout=timeout_s)
    except BaseException:
      for name, _ in started:
        try:
          ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
          pass
      raise
    handle.entries = [_entry(i, name, info) for i, ((name, _), info) in
                      enumerate(zip(started, infos))]
    return handle
