"""ShardedClient: one Client API over several independent servers (shards), as in Reverb.

Semantics: every shard is an independent server with its own tables of the same names. Each
`insert` goes to one shard (round robin), each trajectory writer writes to one shard (round
robin over writers, so episodes stay whole), and `sample` takes its items from the shards in
turn. Priorities, rate limiters, max_size and removal are per shard: a table of max_size N
over k shards holds up to k*N items, and a rate limiter blocks on its own shard only.
`mutate_priorities` and `reset` go to every shard (unknown keys are ignored there), and
`server_info` sums the sizes and counters of every shard's table.
"""
import dataclasses
import itertools
import threading
from typing import Dict, List, Optional

from reverb_shm import table as table_lib

__all__ = ["ShardedClient"]


class ShardedClient:
  """Client over several servers; each address may be local (shared memory) or a bridge.

  Args:
    server_addresses: at least one address (as Client takes).

  Raises:
    ValueError: no address.
  """

  def __init__(self, server_addresses: List[str]):
    from reverb_shm.client import Client  # pylint: disable=g-import-not-at-top
    if not server_addresses:
      raise ValueError("ShardedClient needs at least one server address")
    self._addresses = list(server_addresses)
    self.shards = [Client(a) for a in self._addresses]
    self._next = itertools.count()
    self._lock = threading.Lock()

  def __reduce__(self):
    return ShardedClient, (self._addresses,)

  @property
  def server_address(self) -> List[str]:
    return list(self._addresses)

  def __repr__(self):
    return f"ShardedClient({self._addresses!r})"

  def _pick(self):
    with self._lock:
      return self.shards[next(self._next) % len(self.shards)]

  def insert(self, data, priorities: Dict[str, float]) -> None:
    """Inserts into one shard (round robin); see Client.insert."""
    self._pick().insert(data, priorities)

  def trajectory_writer(self, num_keep_alive_refs: int, **kwargs):
    """A writer on one shard (round robin over writers); see Client.trajectory_writer."""
    return self._pick().trajectory_writer(num_keep_alive_refs, **kwargs)

  def sample(self, table: str, num_samples: int = 1, **kwargs):
    """Samples `num_samples` items, taking each from the next shard in turn.

    Raises:
      ReverbError: as Client.sample; a shard's error is raised as is.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
      raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    counts = [num_samples // len(self.shards)] * len(self.shards)
    for i in range(num_samples % len(self.shards)):
      counts[i] += 1
    gens = [s.sample(table, c, **kwargs) for s, c in zip(self.shards, counts) if c]
    return _round_robin(gens)

  def mutate_priorities(self, table: str, updates=None, deletes=None):
    """Applies the mutation on every shard; returns the summed (updated, deleted)."""
    totals = [s.mutate_priorities(table, updates, deletes) for s in self.shards]
    return sum(t[0] for t in totals), sum(t[1] for t in totals)

  def reset(self, table: str) -> None:
    for s in self.shards:
      s.reset(table)

  def checkpoint(self) -> List[str]:
    """Checkpoints every shard; returns their paths in shard order."""
    return [s.checkpoint() for s in self.shards]

  def shard_infos(self, timeout: Optional[float] = None) -> List[Dict[str, table_lib.TableInfo]]:
    return [s.server_info(timeout) for s in self.shards]

  def server_info(self, timeout: Optional[float] = None) -> Dict[str, table_lib.TableInfo]:
    """TableInfo per table name with sizes and counters summed over the shards."""
    merged: dict = {}
    for infos in self.shard_infos(timeout):
      for name, info in infos.items():
        prev = merged.get(name)
        merged[name] = info if prev is None else _add(prev, info)
    return merged


def _add(a: table_lib.TableInfo, b: table_lib.TableInfo) -> table_lib.TableInfo:
  rl = a.rate_limiter_info
  rl = dataclasses.replace(
      rl, insert_stats=table_lib.RateLimiterCallStats(
          rl.insert_stats.completed + b.rate_limiter_info.insert_stats.completed),
      sample_stats=table_lib.RateLimiterCallStats(
          rl.sample_stats.completed + b.rate_limiter_info.sample_stats.completed))
  return dataclasses.replace(
      a, max_size=a.max_size + b.max_size, current_size=a.current_size + b.current_size,
      num_episodes=a.num_episodes + b.num_episodes,
      num_deleted_episodes=a.num_deleted_episodes + b.num_deleted_episodes,
      num_unique_samples=a.num_unique_samples + b.num_unique_samples, rate_limiter_info=rl)


def _round_robin(gens):
  gens = list(gens)
  try:
    while gens:
      for g in list(gens):
        try:
          yield next(g)
        except StopIteration:
          gens.remove(g)
  finally:
    for g in gens:
      g.close()
