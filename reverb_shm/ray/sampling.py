"""ClusterClient: sampling across the shards of a ReplayCluster as if they were one table.

Global distribution. Let shard s hold items with weights w (priority**exponent for a
Prioritized sampler, 1 for Uniform) summing to W_s (its sum tree's root, or its size), and
W = sum_s W_s. A single table holding every item picks item i with probability w_i / W. A batch
of n is drawn by splitting n multinomially over the shards with probabilities W_s / W and
drawing the shard's count there with its own sampler: each draw then picks item i of shard s
with probability (W_s / W) * (w_i / W_s) = w_i / W, independently, which is the global
distribution exactly (Schaul et al. 2016 sample with replacement as well). The reported
SampleInfo.probability is the local one times W_s / W, and SampleInfo.table_size the global
number of items, of the masses the split used: read just before the draw, or (sample_batch with
max_mass_age_s > 0) those the shards reported with their previous draws. Either way the reported
probability is exactly that of the draw made; it equals the single-table one when no item was
inserted, removed or updated in between. Every weight 0 on every
shard: uniform over all items, as a single table does. Other samplers (Fifo, Lifo, heaps) are
split by item counts; their order is per shard.

Keys. Item keys are random 64-bit integers drawn independently by every writer, so they are
unique across shards with overwhelming probability (a collision among n items has probability
about n**2 / 2**65). The client remembers which shard returned each key it sampled (about the
last `key_memory` keys drawn; it files them only when an update or `shard_of` needs them) and
sends an update or delete of such a key to that shard only; keys it has not sampled go to every
live shard (unknown keys are ignored there).

Rate limiters are per shard: a shard's limiter counts the inserts and samples made on that shard
(the global counts are the sums in server_info()). A sample of k items on a shard waits for that
shard's limiter only.

Failure. A shard whose server does not answer within `timeout_s` (its node died, or is too slow)
is dropped: a warning is issued, `failures` counts it, and the batch is drawn from the remaining
shards. A dropped shard is probed again at most every `revive_after_s` seconds and rejoins
(with a warning) if its server answers again; `refresh()` adopts shards restarted elsewhere
(ClusterHandle.replace).
"""
import collections
import concurrent.futures
import dataclasses
import itertools
import threading
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from reverb_shm import errors, specs
from reverb_shm._internal import structure, timeouts
from reverb_shm.ray._group import GroupAnswers
from reverb_shm.replay_sample import ReplaySample, SampleInfo
from reverb_shm.selectors import PRIORITIZED

__all__ = ["ClusterClient", "split_batch"]


_NODE_ERRORS = (errors.ServerUnavailableError, errors.DeadOwnerError, errors.TableClosedError,
                errors.DeadlineExceededError, ConnectionError, OSError)


def _mass_of(stats: dict) -> Tuple[float, int, int]:
  """(mass, size, sampler_kind) of a table from its rs_table_stats."""
  size = int(stats["size"])
  kind = int(stats["sampler_kind"])
  mass = float(stats.get("sampler_total_weight", 0.0)) if kind == PRIORITIZED else float(size)
  return mass, size, kind


def split_batch(n: int, masses: Sequence[float], rng: np.random.Generator,
                size: Optional[int] = None) -> np.ndarray:
  """Multinomial split of `n` draws over shards with masses `masses` (>= 0, finite).

  Returns an int64 array of counts summing to n, of shape (len(masses),), or (size,
  len(masses)) for `size` independent splits. All masses 0 -> ValueError (the caller falls back
  to item counts).
  """
  m = np.asarray(masses, np.float64)
  if m.ndim != 1 or not np.all(np.isfinite(m)) or np.any(m < 0):
    raise ValueError(f"masses must be finite and >= 0, got {masses!r}")
  total = m.sum()
  if not total > 0:
    raise ValueError("every shard has mass 0")
  return rng.multinomial(n, m / total, size=size).astype(np.int64)


# Prefetched batches requested together hold at most this many items, and about this many
# bytes of columns, in all (one request and one answer per bridge for the whole group).
_GROUP_ITEMS = 4096
_GROUP_BYTES = 16 << 20
# Items per SampleBatch message: a bridge pins the items of one message at once, and a server
# whose max_bytes is taken by its arena cannot grow a process's pin log past its first 1024
# pins. A larger share is asked for in several messages, answered in order on one stream.
_MESSAGE_ITEMS = 1024


@dataclasses.dataclass
class _Request:
  """A global draw whose split is fixed and whose bridges' calls are (being) sent."""
  args: tuple                     # (table, n, rate_limiter_timeout_ms)
  scale: Dict[int, float]         # shard -> W_s / W of the split
  k_of: Dict[int, int]            # shard -> items drawn there
  total_size: int                 # global table_size reported
  pending: Dict[int, Any] = dataclasses.field(default_factory=dict)   # remote calls
  failed: Dict[int, BaseException] = dataclasses.field(default_factory=dict)
  group: Optional[Tuple[GroupAnswers, int]] = None   # its group's answers and its index there


class _Shared:
  """A bridge's SampleBatch call whose answer prefetched requests share, a slice each.

  `adopt`, if given, is applied once to the call's (batch, stats) answer and its result is what
  the slices cut (ClusterClient: global probabilities and table_size, the shard's mass)."""

  def __init__(self, call, adopt=None):
    self._call = call
    self._adopt = adopt
    self._lock = threading.Lock()
    self._result: Any = None
    self._error: Optional[BaseException] = None

  def get(self):
    with self._lock:
      if self._result is None and self._error is None:
        try:
          result = self._call()
          self._result = result if self._adopt is None else self._adopt(result)
        except Exception as e:  # pylint: disable=broad-except  (each sharer re-raises it)
          self._error = e
      if self._error is not None:
        raise self._error
      return self._result

  def cancel(self) -> None:
    self._call.cancel()


def _concat_samples(samples) -> ReplaySample:
  """One ReplaySample of flat columns holding `samples`' rows in order (each info field and
  each column concatenated along axis 0)."""
  info = SampleInfo(*[np.concatenate([b.info[f] for b in samples]) for f in range(5)])
  return ReplaySample(info, [np.concatenate(c) for c in zip(*[b.data for b in samples])])


class _Joined:
  """SampleBatch calls in flight of one shard, answered as one (batch, stats): their batches
  concatenated (None when all are empty), the stats of the last answer."""

  def __init__(self, calls):
    self._calls = calls

  def __call__(self):
    answers = [call() for call in self._calls]
    batches = [b for b, _ in answers if b is not None]
    stats = answers[-1][1]
    if len(batches) <= 1:
      return (batches[0] if batches else None), stats
    return _concat_samples(batches), stats

  def cancel(self) -> None:
    for call in self._calls:
      call.cancel()


class _Slice:
  """Items [start, start + k) of a _Shared answer, as a SampleBatch call's (batch, stats);
  (None, stats) when the bridge's rate limiter admitted fewer (sample_batch draws the rest
  again)."""

  def __init__(self, shared: _Shared, start: int, k: int):
    self._shared, self._start, self._k = shared, start, k

  def __call__(self):
    batch, stats = self._shared.get()
    n = 0 if batch is None else len(batch.info.key)
    a, b = min(self._start, n), min(self._start + self._k, n)
    if a == b:
      return None, stats
    return ReplaySample(SampleInfo(*[f[a:b] for f in batch.info]),
                        [c[a:b] for c in batch.data]), stats

  def cancel(self) -> None:
    self._shared.cancel()


class ClusterClient:
  """Learner-side client over every shard of a ClusterHandle.

  Args:
    handle: the ClusterHandle.
    timeout_s: deadline of each call to a shard (reading its masses, probing it); a shard that
      misses it is dropped.
    revive_after_s: how often a dropped shard is probed again (in the background: a sampling
      call starts the probes that are due and takes in the answers of those that finished,
      never waiting for one).
    max_mass_age_s: sample_batch splits by the masses the shards reported with their last
      draws when they are at most this old (0: reads them before every draw; see
      sample_batch).
    key_memory: how many sampled keys to remember for routing priority updates.
    prefetch: how many further batches sample_batch requests from the bridges ahead of the
      one it returns, several per request (0: none; see sample_batch).
    seed: seed of the multinomial split (None: fresh entropy).

  Thread-safe for one sampling thread plus other threads updating priorities.
  """

  def __init__(self, handle, timeout_s: float = 10.0, key_memory: int = 1 << 20,
               seed: Optional[int] = None, revive_after_s: float = 10.0,
               max_mass_age_s: float = 0.0, prefetch: int = 0):
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 0 <= prefetch <= 64:
      raise ValueError(f"prefetch must be an int in [0, 64], got {prefetch!r}")
    self._handle = handle
    self._prefetch = prefetch
    self._pending: collections.deque[_Request] = collections.deque()
    self._timeout_s = float(timeout_s)
    self._key_memory = int(key_memory)
    self._rng = np.random.default_rng(seed)
    self._lock = threading.Lock()
    self._keys: Dict[int, int] = {}   # key -> shard, in the order first filed
    # Sampled (keys array, shard) not filed in _keys yet, oldest first, and their key count.
    self._key_log: collections.deque = collections.deque()
    self._key_log_n = 0
    self._local: set = set()           # shards reached through shared memory
    self._item_bytes: Dict[str, float] = {}   # table -> column bytes per item (last answer)
    self._pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=max(2, handle.num_shards), thread_name_prefix="reverb_shm-ray-sample")
    self.failures = 0                  # shards dropped since this client was made
    self.dead: Dict[int, str] = {}     # shard -> why it was dropped
    self.revived = 0                   # dropped shards that answered again
    self.dead_shard_keys = 0           # keys of updates / deletes dropped: their shard was dead
    self._revive_after_s = float(revive_after_s)
    self._dropped_at: Dict[int, float] = {}
    self._probes: Dict[int, concurrent.futures.Future] = {}   # shard -> its revival probe
    self._probe_pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=max(1, handle.num_shards), thread_name_prefix="reverb_shm-ray-probe")
    self._max_mass_age_s = float(max_mass_age_s)
    self._mass_cache: Dict[str, Dict[int, tuple]] = {}   # table -> shard -> (masses, when)
    self._local_tables: dict = {}
    self._treedefs: dict = {}
    self._clients: dict = {}
    self._generations: dict = {}
    for e in handle.entries:
      self._connect(e.shard)

  def _connect(self, shard: int) -> None:
    local = self._handle.attach_local(shard)
    self._clients[shard] = (local if local is not None else
                            self._handle.remote_client(shard, reconnect_timeout_s=self._timeout_s))
    if local is None:
      self._local.discard(shard)
    else:
      self._local.add(shard)
    self._generations[shard] = self._handle.entries[shard].generation

  @property
  def live_shards(self) -> List[int]:
    return [s for s in sorted(self._clients) if s not in self.dead]

  def is_local(self, shard: int) -> bool:
    """Whether `shard` is reached through shared memory from this process."""
    return shard in self._local

  def _drop(self, shard: int, exc: BaseException) -> None:
    with self._lock:
      if shard in self.dead:
        return
      self.dead[shard] = repr(exc)
      self._dropped_at[shard] = time.monotonic()
      self.failures += 1
    warnings.warn(f"reverb_shm.ray: shard {shard} (node {self._handle.entries[shard].node_id}) "
                  f"dropped, sampling goes on from shards {self.live_shards}: {exc!r}",
                  RuntimeWarning, stacklevel=3)

  def refresh(self, handle=None) -> List[int]:
    """Adopts `handle`'s entries (default: the handle given at construction): shards whose
    generation changed (replaced) are reconnected and revived. Returns the live shards."""
    if handle is not None:
      self._handle = handle
    for e in self._handle.entries:
      if self._generations.get(e.shard) != e.generation:
        self._connect(e.shard)
        self._local_tables = {k: v for k, v in self._local_tables.items() if k[0] != e.shard}
        for cache in self._mass_cache.values():
          cache.pop(e.shard, None)
        with self._lock:
          self.dead.pop(e.shard, None)
    return self.live_shards

  def _revive(self) -> None:
    """Takes in the revival probes that finished (the shards that answered rejoin) and starts
    one for each dropped shard not probed for revive_after_s. Never waits for a probe: a dead
    node's probe takes up to timeout_s, which the learner's sampling must not."""
    for s, probe in list(self._probes.items()):
      if not probe.done():
        continue
      del self._probes[s]
      if probe.result():
        with self._lock:
          self.dead.pop(s, None)
          self.revived += 1
        warnings.warn(f"reverb_shm.ray: shard {s} answers again and rejoins sampling",
                      RuntimeWarning, stacklevel=3)
    now = time.monotonic()
    for s in list(self.dead):
      if s not in self._probes and now - self._dropped_at.get(s, 0) >= self._revive_after_s:
        self._dropped_at[s] = now
        self._probes[s] = self._probe_pool.submit(self._alive, s)

  # ---- masses
  def _live_segment(self, shard: int):
    """The segment of this node's `shard`. Raises DeadOwnerError once its server died (its
    tables stay readable in this process, which must not sample them on), TableClosedError once
    it stopped."""
    seg = self._clients[shard]._segment()  # pylint: disable=protected-access
    if seg.owner_dead:
      raise seg.dead_owner_error()
    if seg.is_closed():
      raise errors.TableClosedError(f"shard {shard}'s server {errors.quoted_name(seg.name)} "
                                    f"stopped")
    return seg

  def _stats(self, shard: int, table: str) -> dict:
    c = self._clients[shard]
    if self.is_local(shard):
      seg = self._live_segment(shard)
      return seg.stats(seg.table_index(table))
    for entry in c._fetch_tables(timeout=self._timeout_s):  # pylint: disable=protected-access
      if entry["name"] == table:
        return entry["stats"]
    raise errors.UnknownTableError(f"shard {shard} has no table {errors.quoted_name(table)}")

  def _call_all(self, shards, fn) -> Dict[int, Any]:
    """fn(shard) on every shard in parallel; shards whose call fails with a node error are
    probed and dropped if dead. Returns {shard: result} of the others."""
    futures = {s: self._pool.submit(fn, s) for s in shards}
    out = {}
    for s, f in futures.items():
      try:
        out[s] = f.result(timeout=self._timeout_s * 4 + 30)
      except _NODE_ERRORS + (concurrent.futures.TimeoutError,) as e:
        if self._alive(s):
          raise
        self._drop(s, e)
    return out

  def _alive(self, shard: int) -> bool:
    try:
      self._stats_any(shard)
      return True
    except Exception:  # pylint: disable=broad-except
      return False

  def _stats_any(self, shard: int) -> None:
    c = self._clients[shard]
    if self.is_local(shard):
      self._live_segment(shard)
    else:
      c._fetch_tables(timeout=min(self._timeout_s, 2.0))  # pylint: disable=protected-access

  def masses(self, table: str) -> Dict[int, Tuple[float, int, int]]:
    """{shard: (mass, size, sampler_kind)} of the live shards (read in parallel)."""
    if self.dead:
      self._revive()
    stats = self._call_all(self.live_shards, lambda s: self._stats(s, table))
    return {s: _mass_of(st) for s, st in stats.items()}

  # ---- sampling
  def sample(self, table: str, num_samples: int,
             rate_limiter_timeout_ms: Optional[int] = None,
             unpack_as_table_signature: bool = False) -> List[ReplaySample]:
    """`num_samples` items drawn with the global distribution (module docstring).

    Returns a list of ReplaySample whose data is the flat list of columns (as Client.sample
    with emit_timesteps=False; nested as the table's signature with unpack_as_table_signature)
    and whose info holds the global probability and table_size. Items come grouped by shard.

    Raises:
      ValueError: num_samples < 1, or a negative rate_limiter_timeout_ms.
      ServerUnavailableError: no live shard left.
      DeadlineExceededError: a live shard's rate limiter did not allow the draw in time.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
      raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    timeouts.deadline_from_ms(rate_limiter_timeout_ms, "rate_limiter_timeout_ms")   # (validates)
    out: List[ReplaySample] = []
    while len(out) < num_samples:
      masses = self.masses(table)
      if not masses:
        raise errors.ServerUnavailableError(
            f"no live shard left to sample {errors.quoted_name(table)} from (dropped: {self.dead})")
      shards = sorted(masses)
      weights = [masses[s][0] for s in shards]
      if not sum(weights) > 0:   # all weights 0 (or only non-prioritized counts of 0)
        weights = [float(masses[s][1]) for s in shards]
      total_size = sum(masses[s][1] for s in shards)
      if not sum(weights) > 0:
        raise errors.DeadlineExceededError(f"table {errors.quoted_name(table)} is empty on every "
                                           f"live shard")
      counts = split_batch(num_samples - len(out), weights, self._rng)
      total_w = float(sum(weights))
      scale = {s: w / total_w for s, w in zip(shards, weights)}

      def draw(s, k):
        return list(self._clients[s].sample(
            table, int(k), emit_timesteps=False, rate_limiter_timeout_ms=rate_limiter_timeout_ms,
            unpack_as_table_signature=unpack_as_table_signature))
      got = self._call_all([s for s, k in zip(shards, counts) if k],
                           lambda s, counts=counts, shards=shards: draw(s, counts[shards.index(s)]))
      new_keys = []
      for s in sorted(got):
        for smp in got[s]:
          i = smp.info
          out.append(ReplaySample(SampleInfo(i.key, i.probability * scale[s], total_size,
                                             i.priority, i.times_sampled), smp.data))
          new_keys.append((int(i.key), s))
      self._remember(new_keys)
    return out

  def sample_batch(self, table: str, num_samples: int,
                   rate_limiter_timeout_ms: Optional[int] = None) -> ReplaySample:
    """`num_samples` items drawn with the global distribution, gathered into one ReplaySample:
    info fields are arrays of length B (key uint64, probability float64, table_size int64,
    priority float64, times_sampled int32) and data is the table's signature nest (or the flat
    list of columns) of (B, ...) arrays, grouped by shard.

    One call per shard and batch, in parallel: a C gather on this node's shard, one SampleBatch
    round trip to each other node's bridge. The batch is split by the shards' masses: this
    node's shard's read at the split, the bridges' from their last answers (each answer carries
    its shard's mass after the draw) when at most `max_mass_age_s` old and no priority update
    went through this client since (else read first, one empty SampleBatch per bridge). The
    reported probability is exactly that of the draw made: (W_s / W) of the masses split by,
    times the shard's own w_i / W_s at the draw, which is w_i / W whenever the masses did not
    change in between (always, for a table nobody writes to meanwhile).

    With `prefetch` > 0, whenever fewer than `prefetch` further batches (same table, size and
    timeout) are in flight, the next ones are requested before this one is gathered, split by
    the masses known then, in groups: one request per bridge for up to `prefetch` batches of
    at most 4096 items (and about 16 MiB) in all, sent as messages of at most 1024 items, each
    batch taking its slice of the answer. Their items are drawn on the remote shards before
    this call returns (as Reverb's in-flight samples), so a priority update sent meanwhile
    reaches them only from the batches after. This node's shard's parts of a group are drawn
    together when the group's first batch is returned (what its rate limiter admits then; a
    batch whose part it did not admit draws its missing items again, as does one whose bridge
    admitted fewer). A call with other arguments, or close(), drops the requests in flight
    (their items count as sampled on their shards). Prefetching is what makes a learner fast
    across nodes: a round trip per bridge for many batches instead of one per batch
    (bench/ray_r1.py measures prefetch 0, 4 and 32).

    Raises:
      ValueError: num_samples < 1, a negative rate_limiter_timeout_ms, or items of different
        column layouts.
      ServerUnavailableError: no live shard left.
      DeadlineExceededError: a live shard's rate limiter did not allow the draw in time.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
      raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    timeouts.deadline_from_ms(rate_limiter_timeout_ms, "rate_limiter_timeout_ms")   # (validates)
    args = (table, num_samples, rate_limiter_timeout_ms)
    if self._pending and self._pending[0].args != args:
      self._drop_pending()
    parts: List[ReplaySample] = []
    got = 0
    while got < num_samples:
      if got == 0 and self._pending:
        request = self._pending.popleft()
      else:
        request = self._issue(table, num_samples - got, rate_limiter_timeout_ms)[0]
      if got == 0 and len(self._pending) < self._prefetch:
        group = self._group_size(table, num_samples)
        while len(self._pending) < self._prefetch:
          self._pending.extend(self._issue(table, num_samples, rate_limiter_timeout_ms, group))
      for part in self._collect(request):
        parts.append(part)
        got += len(part.info.key)
    joined = parts[0] if len(parts) == 1 else _concat_samples(parts)
    info, cols = joined.info, list(joined.data)
    treedef = self._treedef(table)
    return ReplaySample(info, cols if treedef is None else structure.unflatten(treedef, cols))

  def _group_size(self, table: str, num_samples: int) -> int:
    """How many prefetched batches of `num_samples` one request per bridge carries: at most
    `prefetch`, _GROUP_ITEMS items and (once an answer told the item size) _GROUP_BYTES."""
    items = _GROUP_ITEMS
    item_bytes = self._item_bytes.get(table)
    if item_bytes:
      items = min(items, int(_GROUP_BYTES // item_bytes))
    return max(1, min(self._prefetch, items // num_samples))

  def _issue(self, table: str, n: int, timeout_ms: Optional[int],
             group: int = 1) -> List["_Request"]:
    """Splits n draws, `group` times, by the current (or cached) masses and sends the bridges'
    requests: one per bridge for the whole group, each draw taking its slice."""
    masses = self._cached_masses(table)
    if not masses:
      raise errors.ServerUnavailableError(
          f"no live shard left to sample {errors.quoted_name(table)} from (dropped: {self.dead})")
    shards, weights, total_size = self._weights(table, masses)
    w = np.asarray(weights, np.float64)
    scale = dict(zip(shards, (w / w.sum()).tolist()))
    splits = split_batch(n, weights, self._rng, size=group)   # (group, shards)
    requests = [_Request((table, n, timeout_ms), scale, dict(zip(shards, row)), total_size)
                for row in splits.tolist()]
    k_of = dict(zip(shards, splits.sum(axis=0).tolist()))
    pending, failed = self._send_remote(shards, table, k_of, timeout_ms)
    if group > 1:   # this node's share of the whole group: one C gather at its first use
      for s in shards:
        if s in self._local and k_of[s]:
          pending[s] = self._local_call(s, table, k_of[s])
    shared = {s: _Shared(call, self._adopter(table, s, scale[s], total_size))
              for s, call in pending.items()}
    for s, answer in shared.items():
      start = 0
      for r in requests:
        r.pending[s] = _Slice(answer, start, r.k_of[s])
        start += r.k_of[s]
    answers = GroupAnswers([shared.get(s) for s in shards], splits) if group > 1 else None
    for j, r in enumerate(requests):
      r.failed = dict(failed)
      if answers is not None and not failed:
        r.group = (answers, j)
    return requests

  def _adopter(self, table: str, shard: int, scale: float, total_size: int):
    """What a shard's answer to a group becomes once (see _Shared): its shard's mass goes to
    the cache (a bridge's answer), its items get the global probability (times `scale` =
    W_s / W) and table_size."""
    def adopt(answer):
      batch, stats = answer
      if stats is not None:
        self._mass_cache.setdefault(table, {})[shard] = (_mass_of(stats), time.monotonic())
      if batch is not None:
        i = batch.info
        n = len(i.key)
        self._item_bytes[table] = sum(c.nbytes for c in batch.data) / max(n, 1)
        keys = i.key.astype(np.uint64, copy=False)
        batch = ReplaySample(SampleInfo(
            keys, i.probability * scale, np.full(n, total_size, np.int64),
            i.priority.astype(np.float64, copy=False),
            i.times_sampled.astype(np.int32, copy=False)), batch.data)
        self._log_keys(keys, shard)   # (the whole answer at once: its items are drawn)
      return batch, stats
    return adopt

  def _local_call(self, shard: int, table: str, k: int):
    """A call drawing up to k items of this node's `shard` that its rate limiter admits at once
    (None when it admits none now: the batches concerned draw their missing items again)."""
    def call():
      try:
        return self._draw_local(shard, table, k, 0, with_stats=False)
      except errors.DeadlineExceededError:
        return None, None
    call.cancel = lambda: None   # type: ignore[attr-defined]
    return call

  def _collect(self, request: "_Request") -> List[ReplaySample]:
    """The parts of an issued request (a local shard's drawn now unless its group drew it),
    with global probabilities."""
    if request.group is not None:   # (None: the batch is cut from each answer below)
      whole = request.group[0].batch(request.group[1])
      if whole is not None:
        return [whole]
    table, _, timeout_ms = request.args
    shards = sorted(request.k_of)
    answers = self._finish_draws(shards, table, request.k_of, timeout_ms, request.pending,
                                 request.failed, local_stats=False)
    parts = []
    for s, (batch, _) in sorted(answers.items()):
      if batch is None:
        continue
      if s in self._local and s not in request.pending:   # (global dtypes already)
        i = batch.info
        batch = ReplaySample(SampleInfo(
            i.key, i.probability * request.scale[s],
            np.full(len(i.key), request.total_size, np.int64), i.priority, i.times_sampled),
            batch.data)
        self._log_keys(i.key, s)
      parts.append(batch)
    return parts

  def _drop_pending(self) -> None:
    """Forgets the prefetched requests (their bridge calls are cancelled)."""
    while self._pending:
      for cancel in self._pending.popleft().pending.values():
        cancel.cancel()

  def _cached_masses(self, table: str) -> Dict[int, Tuple[float, int, int]]:
    """{shard: (mass, size, kind)} of the live shards: this node's read now (a few
    microseconds); the bridges' from their last answers when fresh enough, else read now (one
    SampleBatch of 0 items per bridge, in parallel)."""
    if self.dead:
      self._revive()
    cache = self._mass_cache.setdefault(table, {})
    now = time.monotonic()
    live = self.live_shards
    stale = [s for s in live if s in self._local or s not in cache
             or now - cache[s][1] > self._max_mass_age_s]
    if stale:
      answers = self._draw_all(stale, table, dict.fromkeys(stale, 0), None)
      now = time.monotonic()
      for s, (_, stats) in answers.items():
        cache[s] = (_mass_of(stats), now)
      live = self.live_shards
    return {s: cache[s][0] for s in live}

  @staticmethod
  def _weights(table: str, masses):
    shards = sorted(masses)
    weights = [masses[s][0] for s in shards]
    if not sum(weights) > 0:   # all weights 0 (or only non-prioritized counts of 0)
      weights = [float(masses[s][1]) for s in shards]
    if not sum(weights) > 0:
      raise errors.DeadlineExceededError(f"table {errors.quoted_name(table)} is empty on every "
                                         f"live shard")
    return shards, weights, sum(masses[s][1] for s in shards)

  def _draw_all(self, shards, table: str, k_of: Dict[int, int], timeout_ms: Optional[int]):
    """{shard: (batch of k_of[shard] items with flat columns, or None for 0; the table's stats
    after the draw)}: the bridges' requests go out first, then this node's shard draws in C
    while they run. Shards failing with a node error are probed and dropped if dead."""
    pending, failed = self._send_remote(shards, table, k_of, timeout_ms)
    return self._finish_draws(shards, table, k_of, timeout_ms, pending, failed)

  def _send_remote(self, shards, table: str, k_of: Dict[int, int], timeout_ms: Optional[int]):
    """({shard: SampleBatch call in flight}, {shard: error}) of the remote shards."""
    if timeout_ms is None:
      rpc_timeout = None if any(k_of[s] for s in shards) else self._timeout_s
    else:
      rpc_timeout = timeout_ms / 1000 + self._timeout_s
    pending, failed = {}, {}
    for s in shards:
      if s not in self._local:
        k = int(k_of[s])
        messages = max(1, -(-k // _MESSAGE_ITEMS))
        calls = []
        try:
          for m in range(messages):   # (sizes as equal as can be)
            calls.append(self._clients[s].sample_batch_async(
                table, (k * (m + 1)) // messages - (k * m) // messages, timeout_ms,
                rpc_timeout))
        except _NODE_ERRORS as e:
          for call in calls:
            call.cancel()
          failed[s] = e
        else:
          pending[s] = calls[0] if len(calls) == 1 else _Joined(calls)
    return pending, failed

  def _finish_draws(self, shards, table: str, k_of: Dict[int, int], timeout_ms: Optional[int],
                    pending, failed, local_stats: bool = True):
    """Draws on the local shards that have no call in `pending` (with their stats after the
    draw, or None without `local_stats`), then waits for the calls `pending`; shards failing
    with a node error are probed and dropped if dead (else the error is raised)."""
    out = {}
    failed = dict(failed)
    for s in shards:
      if s in self._local and s in self._clients and s not in pending:
        try:
          out[s] = self._draw_local(s, table, int(k_of[s]), timeout_ms, local_stats)
        except _NODE_ERRORS as e:
          failed[s] = e
    for s, result in pending.items():
      try:
        out[s] = result()
      except _NODE_ERRORS as e:
        failed[s] = e
    for s, err in sorted(failed.items()):
      if self._alive(s):
        raise err
      self._drop(s, err)
    return out

  def _draw_local(self, shard: int, table: str, k: int, timeout_ms: Optional[int],
                  with_stats: bool = True):
    self._live_segment(shard)
    st = self._local_tables.get((shard, table))
    if st is None:
      st = self._local_tables[(shard, table)] = self._clients[shard].shared_table(table)
    batch = None
    if k:
      b = st.sample_batch(k, timeout_ms=timeout_ms)
      batch = ReplaySample(b.info, structure.flatten(b.data)[0])
    return batch, (st._open_stats() if with_stats else None)  # pylint: disable=protected-access

  def _treedef(self, table: str):
    """The treedef of `table`'s signature (from any live shard), None without one."""
    if table not in self._treedefs:
      s = self.live_shards[0]
      c = self._clients[s]
      if self.is_local(s):
        signature = c.shared_table(table).signature
      else:
        signature = specs.decode_signature(c._table_entry(table)[1]["signature"])  # pylint: disable=protected-access
      self._treedefs[table] = None if signature is None else structure.flatten(signature)[1]
    return self._treedefs[table]

  def _log_keys(self, keys: np.ndarray, shard: int) -> None:
    """Notes that `shard` returned `keys` (a (B,) array); they are filed in _keys only when a
    lookup needs them, so a learner that never updates priorities does not pay for it."""
    with self._lock:
      log = self._key_log
      log.append((keys, shard))
      self._key_log_n += len(keys)
      # The newest key_memory logged keys are kept; older ones, and every key filed before
      # them, are forgotten.
      while self._key_log_n - len(log[0][0]) >= self._key_memory:
        self._key_log_n -= len(log.popleft()[0])
        self._keys.clear()

  def _filed_keys(self) -> Dict[int, int]:
    """_keys (key -> shard) with the logged keys filed; call under _lock. Beyond key_memory
    keys the oldest filed are forgotten (a key sampled again keeps its first place: routing
    only needs the shard, which never changes)."""
    keys = self._keys
    while self._key_log:
      arr, shard = self._key_log.popleft()
      keys.update(zip(arr.tolist(), itertools.repeat(shard)))
    self._key_log_n = 0
    excess = len(keys) - self._key_memory
    if excess > 0:
      for k in list(itertools.islice(iter(keys), excess)):
        del keys[k]
    return keys

  def _remember(self, pairs) -> None:
    """Files (key, shard) pairs at once (see _filed_keys)."""
    with self._lock:
      self._filed_keys().update(pairs)
      self._filed_keys()

  def shard_of(self, key: int) -> Optional[int]:
    """The shard that returned `key` in a sample (if still remembered), else None."""
    with self._lock:
      return self._filed_keys().get(int(key))

  # ---- priorities
  def mutate_priorities(self, table: str, updates: Optional[Dict[int, float]] = None,
                        deletes: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """Sends each update/delete to the shard that holds its key (remembered from samples;
    unknown keys go to every live shard). Keys sampled from a shard that has been dropped
    (dead) are dropped at once, sent nowhere, and counted in ``dead_shard_keys``. Returns the
    summed (updated, deleted)."""
    live = self.live_shards
    per: Dict[int, Tuple[dict, list]] = {s: ({}, []) for s in live}
    dropped = 0
    with self._lock:
      filed = self._filed_keys()
      for k, p in (updates or {}).items():
        s = filed.get(int(k))
        if s is not None and s not in per:   # (its shard is dead: no live shard holds it)
          dropped += 1
          continue
        for t in ([s] if s is not None else live):
          per[t][0][k] = p
      for k in (deletes or ()):
        s = filed.get(int(k))
        if s is not None and s not in per:
          dropped += 1
          continue
        for t in ([s] if s is not None else live):
          per[t][1].append(k)
      self.dead_shard_keys += dropped
    busy = [s for s in live if per[s][0] or per[s][1]]
    for s in busy:
      self._mass_cache.get(table, {}).pop(s, None)
    res = self._call_all(busy, lambda s: self._clients[s].mutate_priorities(
        table, per[s][0] or None, per[s][1] or None))
    return sum(r[0] for r in res.values()), sum(r[1] for r in res.values())

  # ---- info
  def shard_infos(self) -> Dict[int, dict]:
    """{shard: {table: TableInfo}} of the live shards."""
    return self._call_all(self.live_shards,
                          lambda s: self._clients[s].server_info(self._timeout_s))

  def server_info(self) -> dict:
    """{table: TableInfo} with sizes and rate-limiter counts summed over the live shards."""
    from reverb_shm.bridge.sharded import _add  # pylint: disable=g-import-not-at-top
    merged: dict = {}
    for _, infos in sorted(self.shard_infos().items()):
      for name, info in infos.items():
        merged[name] = info if name not in merged else _add(merged[name], info)
    return merged

  def close(self) -> None:
    self._drop_pending()
    self._pool.shutdown(wait=False)
    self._probe_pool.shutdown(wait=False, cancel_futures=True)
    for c in self._clients.values():
      close = getattr(c, "close", None)
      if close is not None:
        close()
