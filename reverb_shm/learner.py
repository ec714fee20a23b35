"""Learner-side batch iterator: fixed-shape, prefetched, prioritized batches, priorities fed back.

The framework-free core of ``reverb_shm.torch`` and ``reverb_shm.jax`` (numpy only), usable on
its own::

    with BatchIterator(client, "replay", batch_size=256, importance_beta=0.4) as batches:
      for batch in batches:
        priorities = learner_step(batch.data, batch.weights)
        batches.update_priorities(batch.info.key, priorities)

A background thread samples the next batches from the table(s) with the GIL released (one C
call gathers every column of up to n items straight into a reusable buffer), so the learner does
not wait for sampling when its step takes longer than the gather; a second one applies the
learner's priority updates (in the order given, all those queued meanwhile in one C call per
table), so the learner does not wait for them either.

Native threads. With one table (no mixing), whole batches (partial=False) and no allocate /
transform of the caller's (the torch iterator on the CPU and the JAX iterator qualify), the
background threads are native (reverb_shm._hot.Prefetcher, csrc/hot/hot_prefetch.c) and never
take the GIL: after the first batch (gathered by a Python thread, which learns the items'
columns) the native sampler gathers into the ring and ``next()`` takes a ready buffer with a few
stores under a mutex; an update of numpy keys and priorities (or a CPU tensor of them) is
checked and copied into the native queue by one C call, and the sampler applies the queue before
its next gather (in the thread and on the CPU that gathers: no second thread contends for the
table; while it waits for items, between waits of at most 2 ms). A native updater thread applies
the queue only while the sampler does not run, and the last updates at close. Both run as
SCHED_BATCH on Linux, so that waking them never preempts the learner's thread. A learner whose
step holds the GIL (or keeps the CPU busy) then never waits for a Python background thread to be
scheduled. An update whose priorities are still being copied from a device starts a Python
updater thread, which applies the native queue first (so the order stays that of the calls).

Buffers. The batches are gathered into a ring of ``prefetch + keep`` reusable buffers. The
arrays of a batch are views of its ring buffer: they stay valid until the consumer has taken
``keep`` more batches (``keep=1``, the default: until the next ``next()``), then the buffer is
gathered into again. Pass ``copy=True`` for batches of their own: a batch then keeps the ring
buffer it was gathered into, which gets fresh arrays for its next gather (no copy beyond the
gather), and nothing ever writes a delivered batch's arrays again.

Shapes. Every batch holds exactly ``batch_size`` items (fixed shape, what a compiled learner
needs); ``next()`` waits up to ``timeout_ms`` for one and raises DeadlineExceededError after
that (the items gathered so far stay for the next call). ``partial=True`` instead delivers what
was sampled when ``timeout_ms`` has passed since the gather began (at least one item); a
``next()`` whose own timeout_ms passes while a gather holds items waits for that batch. A column
of items that are windows of T steps comes out as (B, T, ...).

Mixing. Several tables with weights ({'a': 0.7, 'b': 0.3}) mix item by item: the rows of each
batch are split among the tables by a multinomial draw over the weights (as sampling each item's
table independently would), rows of table 0 first. A partial batch visits the tables in turn
(a table without items does not keep the others' rows out of it) and holds their rows in the
order they came. Every table must hold items of the same columns. ``Batch.table`` says which
table each row came from. A row's importance weight uses its own table's size and probability
(the mixing weights are not corrected for), normalised by the largest weight of the batch.

Reproducibility. With ``seed``, the background thread seeds its sampling random number generator
(the C core's generator of that thread) and the mixing draws, so the sequence of sampled keys is
the same for the same table content and the same order of inserts and priority changes, for one
iterator sampling alone (whatever its prefetch, keep, copy or partial, and in the torch and JAX
iterators alike). Not guaranteed: while other processes or threads insert, remove or
sample (limiter waits and removals interleave differently), while priority updates of this
iterator land between gathers at varying points (their timing is asynchronous), or across
versions of reverb_shm.

Thread-safety: one consumer thread calls ``next()``; ``update_priorities`` may be called from
any thread.

Lifetime: call ``close()`` (or use ``with``). The threads hold only a weak reference to the
iterator, so one dropped without close() is still collected (within one wait slice of its
threads) and its threads then end; priority updates still queued then are dropped.
"""
import collections
import math
import numbers
import os
import threading
import time
import weakref
from typing import Any, Callable, List, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from reverb_shm import errors
from reverb_shm import shared_table as shared_table_lib
from reverb_shm._internal import _lib, structure, timeouts
from reverb_shm._internal._lib import ffi, hot, lib
from reverb_shm.replay_sample import SampleInfo

__all__ = ["Batch", "BatchIterator", "importance_weights", "resolve_tables"]

_SLICE_MS = 50   # longest single wait of the background thread (it checks close() between)
_SLICE_NS = _SLICE_MS * 1_000_000
_NATIVE_SEED_MIX = 0x9E3779B97F4A7C15   # (the native sampler's seed: the seed's bits mixed)
_QUEUE_LIMIT_KEYS = 1 << 20   # queued update keys beyond which update_priorities waits (as native)
_SEED_MASK = 2**64 - 1
_NO_KEYS = np.zeros(0, np.uint64)


class Batch(NamedTuple):
  """One batch of B items (B = batch_size unless partial batches were asked for).

  Attributes:
    data: the items' columns, each an array (B, ...) (B, T, ...) for windows of T steps, nested as
      the table's signature (or a flat list without one).
    info: SampleInfo of arrays of length B: key uint64, probability float64, table_size int64,
      priority float64, times_sampled int32.
    weights: float32[B] prioritized-replay importance weights (see importance_weights) when the
      iterator has an importance_beta, else None.
    mask: bool[B, T] (or the mask column's shape) when the iterator has a mask_key naming a
      column of the items, else None.
    table: uint8[B] index (into BatchIterator.tables) of each row's table when mixing several
      tables, else None.
  """
  data: Any
  info: SampleInfo
  weights: Optional[Any] = None
  mask: Optional[Any] = None
  table: Optional[np.ndarray] = None


def importance_weights(probability, table_size, beta: float, out=None) -> np.ndarray:
  """Prioritized-replay importance-sampling weights, normalised by their maximum.

  w_i = (N * P(i)) ** -beta / max_j w_j (Schaul et al. 2016, "Prioritized Experience Replay",
  section 3.4), with N the table's size and P(i) the probability item i was sampled with.

  Args:
    probability: float64[B] sampling probabilities (SampleInfo.probability), in (0, 1].
    table_size: int64[B] table sizes at sampling time (SampleInfo.table_size).
    beta: exponent in [0, 1]; 1 fully corrects the bias of prioritized sampling.
    out: optional float32[>= B] array receiving the weights.

  Returns:
    float32[B] weights in (0, 1] (all 1 for uniform sampling).
  """
  w = np.multiply(table_size, probability, dtype=np.float64)
  np.power(w, -float(beta), out=w)
  w *= 1.0 / w.max()
  if out is None:
    return w.astype(np.float32)
  out = out[:len(w)]
  out[...] = w
  return out


def _check_beta(beta) -> Optional[float]:
  if beta is None:
    return None
  if isinstance(beta, bool) or not isinstance(beta, (int, float, np.floating)) or \
      not 0.0 <= float(beta) <= 1.0:
    raise ValueError(f"importance_beta must be None or a number in [0, 1], got {beta!r}")
  return float(beta)


def resolve_tables(source, table=None):
  """(SharedTables, mixing weights or None) from the ways an iterator may be given its tables.

  Args:
    source: a SharedTable, or anything with ``shared_table(name)`` (Client, Server).
    table: with a Client or Server: a table name, a sequence of names (equal weights) or a
      mapping name -> weight; with a SharedTable: None. A mapping of SharedTable -> weight may
      also be passed as `source`.

  Raises:
    TypeError: `source` is none of these. ValueError: weights not finite and > 0, no table.
    UnknownTableError: no such table.
  """
  if isinstance(source, Mapping) and table is None:
    tables, weights = list(source.keys()), list(source.values())
  elif isinstance(source, shared_table_lib.SharedTable):
    if table is not None:
      raise ValueError("pass either a SharedTable or a client/server and a table name, not both")
    tables, weights = [source], None
  elif hasattr(source, "shared_table"):
    if isinstance(table, str):
      names, weights = [table], None
    elif isinstance(table, Mapping):
      names, weights = list(table.keys()), list(table.values())
    elif isinstance(table, Sequence) and table and all(isinstance(t, str) for t in table):
      names, weights = list(table), None
    else:
      raise TypeError("table must be a table name, a sequence of names or a mapping name -> "
                      f"mixing weight, got {errors.quoted_name(table)}")
    tables = [source.shared_table(name) for name in names]
  else:
    raise TypeError("source must be a SharedTable, a Client or Server (with a table name) or a "
                    f"mapping SharedTable -> weight, got {type(source).__name__}")
  for t in tables:
    if not isinstance(t, shared_table_lib.SharedTable):
      raise TypeError(f"tables must be SharedTables, got {type(t).__name__}")
  if not tables:
    raise ValueError("no table to sample from")
  if len(tables) > 255:
    raise ValueError(f"at most 255 tables can be mixed, got {len(tables)}")
  if weights is not None:
    if any(isinstance(v, bool) or not isinstance(v, numbers.Real) for v in weights):
      raise ValueError(f"mixing weights must be numbers, got {weights!r}")
    w = np.asarray(weights, np.float64)
    if w.shape != (len(tables),) or not np.isfinite(w).all() or (w <= 0).any():
      raise ValueError(f"mixing weights must be finite numbers > 0, got {weights!r}")
    w = w / w.max()   # (first: a sum of weights near the float64 maximum would overflow)
    weights = w / w.sum()
  if len(tables) > 1 and weights is None:
    weights = np.full(len(tables), 1.0 / len(tables))
  return tables, (weights if len(tables) > 1 else None)


class _Slot:
  """One ring buffer: the column arrays (n, ...) the background thread gathers into."""
  __slots__ = ("columns", "weights", "cols", "fence", "owner", "cache")

  def __init__(self, columns, weights, owner=None):
    self.columns = columns      # list of arrays (n, ...), one per column
    self.weights = weights      # float32[n]
    self.cols = {}              # table index -> (rs_gather_col[], its address) at row 0
    self.fence = None           # callable waiting until the buffer may be overwritten, or None
    self.owner = owner          # what keeps the memory alive (e.g. pinned tensors)
    self.cache = {}             # for the transform: e.g. tensor views of the columns


class _Update(NamedTuple):
  keys: Any
  priorities: Any
  table: Any
  ready: Optional[Callable[[], Any]]   # waits for an asynchronous device copy, returns arrays


class BatchIterator:
  """Iterator of fixed-shape prioritized batches, gathered ahead by a background thread.

  Args:
    source: a Client, Server or SharedTable (see resolve_tables).
    table: the table(s) of `source` to sample, e.g. ``'replay'`` or ``{'a': 0.7, 'b': 0.3}``
      (see resolve_tables).
    batch_size: items per batch, >= 1.
    prefetch: batches gathered ahead of the consumer, >= 1.
    keep: batches the consumer may still hold when it takes the next one (their buffers are not
      reused until then), >= 1. Ignored with copy=True.
    timeout_ms: how long ``next()`` waits for a batch (None, or inf: forever), then
      DeadlineExceededError; with partial=True also how long a gather waits before delivering
      fewer items (at least one).
    partial: deliver batches of fewer items at the deadline instead of waiting for batch_size.
    importance_beta: None, or the exponent beta in [0, 1] of the importance weights offered in
      Batch.weights (settable later: the attribute of the same name; batches gathered after the
      change use the new value).
    seed: None, or an int making the sampled keys reproducible (see the module docstring).
    mask_key: name of a column (top-level key of the signature dict) holding a step mask, offered
      as Batch.mask (bool).
    copy: give every batch its own buffers instead of ring views.
    allocate: ``allocate(shape, dtype) -> (np.ndarray, owner)`` making a buffer of the ring (the
      torch iterator passes pinned memory); default numpy.empty.
    transform: ``transform(batch, slot) -> object`` run by the background thread on every
      gathered Batch before it is handed over (the framework iterators turn arrays into tensors
      there); what it returns is what ``next()`` returns. ``slot`` is the batch's buffer: its
      ``cache`` dict persists with it (e.g. tensor views of its columns, made once), and setting
      its ``fence`` to a callable makes the thread call it before gathering into that buffer
      again (e.g. to wait for an asynchronous device copy out of it).

  Raises:
    ValueError / TypeError: bad arguments (nothing sampled).

  ``next()`` raises DeadlineExceededError (no full batch within timeout_ms), TableClosedError
  (the server stopped; the background threads have ended), ValueError (items whose columns cannot
  be batched, or that differ between the mixed tables), DeadOwnerError (the server process died),
  RuntimeError (closed; or used in a forked child: re-create it there) and whatever error an
  asynchronous priority update met, once, at the next call.
  """

  def __init__(self, source, table=None, batch_size: int = 256, *, prefetch: int = 2,
               keep: int = 1, timeout_ms: Optional[float] = None, partial: bool = False,
               importance_beta: Optional[float] = None, seed: Optional[int] = None,
               mask_key: Optional[str] = None, copy: bool = False,
               allocate: Optional[Callable] = None, transform: Optional[Callable] = None):
    self._tables, self._weights = resolve_tables(source, table)
    for name, v in (("batch_size", batch_size), ("prefetch", prefetch), ("keep", keep)):
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v < 2**31:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if timeout_ms is not None:
      if isinstance(timeout_ms, (bool, np.bool_)) or not isinstance(
          timeout_ms, (int, float, np.integer, np.floating)) or not timeout_ms >= 0:
        raise ValueError(f"timeout_ms must be None (wait forever) or >= 0, got {timeout_ms!r}")
    if partial and timeout_ms is None:
      raise ValueError("partial=True needs a timeout_ms: the deadline at which a batch may hold "
                       "fewer items")
    if timeout_ms is not None:
      timeout_ms = timeout_ms.item() if isinstance(timeout_ms, np.generic) else timeout_ms
      if timeouts.deadline_from_ms(timeout_ms) == -1:   # (inf, or past any deadline: forever)
        timeout_ms, partial = None, False
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
      raise ValueError(f"seed must be None or an int, got {seed!r}")
    if mask_key is not None and not isinstance(mask_key, str):
      raise ValueError(f"mask_key must be None or a column name (str), got {mask_key!r}")
    self.batch_size = int(batch_size)
    self.importance_beta = importance_beta   # (validated by the setter)
    self._prefetch, self._keep = int(prefetch), int(keep)
    self._timeout_ms, self._partial, self._copy = timeout_ms, bool(partial), bool(copy)
    self._seed = None if seed is None else int(seed) & _SEED_MASK
    self._mix_rng = np.random.default_rng(self._seed)
    self._mask_key = mask_key
    # whether a table has a Prioritized selector (read once)
    self._any_prioritized: Optional[bool] = None
    self._allocate = allocate
    self._transform = transform
    self._layout: Any = None       # ((dtype, item shape, bytes) per column), from the first items
    self._slots: List[_Slot] = []
    self._cv = threading.Condition()
    # slots the background thread may gather into
    self._free: collections.deque = collections.deque()
    self._credits = self._prefetch + (0 if self._copy else self._keep)   # batches it may hold
    self._ready: collections.deque = collections.deque()     # (slot, batch) gathered, not yet taken
    self._held: collections.deque = collections.deque()      # slots of batches the consumer took
    self._ucv = threading.Condition()     # guards the priority updates and the counters
    self._updates: List[_Update] = []
    self._applying = 0                    # updates taken by the updater, not yet applied
    self._queued_keys = 0                 # keys of self._updates
    self._stop_updates = False
    self._error: Optional[BaseException] = None       # ends the thread: raised by next()
    self._update_error: Optional[BaseException] = None   # raised once by the next call
    self._stop = False
    self._filling = 0                     # items the thread has gathered into the next batch
    self._counts = {"batches": 0, "items": 0, "priority_updates": 0, "keys_updated": 0,
                    "keys_skipped": 0, "updates_applied_waiting": 0}
    self._pid = os.getpid()   # (the threads exist only in this process, not in a fork child)
    # Native threads (see the module docstring): the updater from the start with one table, the
    # sampler after the first batch where the batches allow it.
    self._native_ok = getattr(self, "_native_ok", transform is None and allocate is None) and \
        self._weights is None and not self._partial
    self._native: Any = None if len(self._tables) > 1 else _new_prefetcher(self._tables[0],
                                                                      self.batch_size)
    self._native_sampling = False
    # The threads hold only a weak reference to the iterator (dropped while they wait), so an
    # iterator dropped without close() is collected; the finalizer then wakes them to end.
    self._ref = ref = weakref.ref(self)
    self._thread = threading.Thread(target=_prefetch_thread, args=(ref, self._cv),
                                    name="reverb_shm-batch-prefetch", daemon=True)
    self._updater: Optional[threading.Thread] = None
    weakref.finalize(self, _wake, self._cv, self._ucv).atexit = False   # (daemon threads)
    self._thread.start()
    if self._native is None:
      self._start_python_updater()

  # ---- public
  @property
  def importance_beta(self) -> Optional[float]:
    """None, or the exponent beta in [0, 1] of the importance weights (Batch.weights); batches
    gathered after an assignment use the new value (e.g. annealed towards 1).

    Raises (on assignment):
      ValueError: not None and not a number in [0, 1] (the old value stays).
    """
    return self._importance_beta

  @importance_beta.setter
  def importance_beta(self, beta) -> None:
    self._importance_beta = _check_beta(beta)

  @property
  def tables(self) -> list:
    """The SharedTables sampled (Batch.table indexes this list)."""
    return list(self._tables)

  @property
  def stats(self) -> dict:
    """Counters: batches and items delivered by the thread, priority_updates applied (calls),
    keys_updated, keys_skipped (keys no longer in their table), updates_pending, and
    updates_applied_waiting (of priority_updates, those ``next()`` applied while it waited for a
    batch)."""
    with self._ucv:
      out = dict(self._counts)
      out["updates_pending"] = len(self._updates) + self._applying
    if self._native is not None and os.getpid() == self._pid:
      batches, calls, updated, skipped, pending, _, _, waiting = self._native.stats()
      out["batches"] += batches
      out["items"] += batches * self.batch_size
      out["priority_updates"] += calls
      out["keys_updated"] += updated
      out["keys_skipped"] += skipped
      out["updates_pending"] += pending
      out["updates_applied_waiting"] += waiting
    return out

  def __iter__(self):
    return self

  def __next__(self):
    self._check_process()
    self._check_owners()
    deadline = None if self._timeout_ms is None else time.monotonic() + self._timeout_ms / 1000.0
    if self._native_sampling and not self._ready:   # (no batch of the Python thread left)
      self._raise_update_error()
      if self._stop:
        raise RuntimeError("the iterator is closed")
      return self._next_native(deadline)
    with self._cv:
      self._raise_update_error()
      if self._stop:
        raise RuntimeError("the iterator is closed")
      while not self._ready and not self._native_sampling:
        if self._error is not None:
          raise self._error
        if self._stop:
          raise RuntimeError("the iterator is closed")
        if deadline is None:
          self._cv.wait()
        else:
          left = deadline - time.monotonic()
          if left <= 0 and self._partial and self._filling:
            # The gather holds items and delivers them at its own deadline (which began up to
            # timeout_ms before or after this call): wait for that partial batch.
            self._cv.wait(_SLICE_MS / 1000.0)
            continue
          if left <= 0:
            raise errors.DeadlineExceededError(
                f"no batch of {self.batch_size} items within {self._timeout_ms} ms (tables "
                f"{[t.name for t in self._tables]}: {self._limiter_text()})")
          self._cv.wait(left)
      if self._ready:
        slot, batch = self._ready.popleft()
        if self._copy:
          self._release(None)
        else:
          # A batch was taken: the consumer is done with the one taken `keep` batches ago, whose
          # buffer may now be reused (not before: a next() that raises takes no batch). (The
          # native sampler holds the first batch's buffer until its first batch is taken.)
          while len(self._held) >= self._keep:
            self._release(self._held.popleft())
          self._held.append(slot)
        return batch
    return self._next_native(deadline)

  def _next_native(self, deadline: Optional[float]):
    """next() once the native sampler gathers: its oldest batch, waiting in slices (checking
    close(), the server's death and the deadline between)."""
    native = self._native
    while True:
      wait = _SLICE_NS if deadline is None else \
          min(_SLICE_NS, max(0, int((deadline - time.monotonic()) * 1e9)))
      rc, k, info = native.take(wait)
      if rc == lib.RS_OK:
        break
      if self._stop:
        raise RuntimeError("the iterator is closed")
      if rc != lib.RS_ETIMEDOUT:
        failure = native.failure()
        self._native_fail(rc, None if failure is None else failure[1])
        raise self._error   # type: ignore[misc]
      self._check_owners()
      if deadline is not None and time.monotonic() >= deadline:
        raise errors.DeadlineExceededError(
            f"no batch of {self.batch_size} items within {self._timeout_ms} ms (tables "
            f"{[t.name for t in self._tables]}: {self._limiter_text()})")
    slot = self._slots[k]
    if self._copy:
      return self._hand_off(k, slot, info)
    if self._mask_key is not None:
      batch = self._make_batch(slot, self.batch_size, [info], [(0, self.batch_size)], count=False)
      return batch if self._transform is None else self._transform(batch, slot)
    # (the nest of the slot's whole columns, wrapped once per slot; a nest of its own per batch)
    views = slot.cache.get("native")
    if views is None:
      wrap = self._wrap_leaf
      leaves, treedef = structure.flatten(self._structure_table._structure(  # pylint: disable=protected-access
          list(slot.columns)))
      views = slot.cache["native"] = (treedef, [wrap(a) for a in leaves], wrap(slot.weights))
    treedef, leaves, weights = views
    beta = self.importance_beta
    if beta is None:
      weights = None
    else:
      importance_weights(info.probability, info.table_size, beta, out=slot.weights)
    return Batch(structure.unflatten(treedef, leaves), info, weights)

  def _hand_off(self, k: int, slot: _Slot, info: SampleInfo):
    """(copy=True) The batch the native sampler gathered into ring slot k, which keeps the
    slot's arrays for good: the slot gathers into new ones from now on."""
    batch = self._make_batch(slot, self.batch_size, [info], [(0, self.batch_size)], count=False)
    weighted = batch.weights is not None   # (else the slot's weights are not the batch's)
    if self._transform is not None:
      batch = self._transform(batch, slot)
    if self._allocate is None:   # (np.empty_like: C-contiguous, as the ring's arrays)
      slot.columns = [np.empty_like(c) for c in slot.columns]
      if weighted:
        slot.weights = np.empty_like(slot.weights)
    else:
      slot.columns, slot.weights, slot.owner = self._fresh_buffers()
    slot.cols.clear()
    slot.cache.clear()
    self._native.swap(k, tuple(slot.columns))
    return batch

  def _native_fail(self, rc: int, message: Optional[str]) -> None:
    """Ends the iterator on the native threads' error status `rc` (see _fail)."""
    table = self._tables[0]
    try:
      if rc == lib.RS_EINVAL:
        _ = table.size   # raises TableClosedError when the server stopped meanwhile
        raise ValueError(f"table {errors.quoted_name(table.name)} holds items whose columns "
                         f"differ from the first "
                         f"items' ({_layout_text(self._layout)}): a fixed-shape batch needs "
                         f"items of one column layout ({message})")
      _lib.raise_for(rc, f"sampling from table "
                         f"{errors.quoted_name(table.name)}", message=message or "")
    except Exception as e:   # pylint: disable=broad-except
      self._fail(e)

  def update_priorities(self, keys, priorities, table=None) -> None:
    """Queues new priorities of sampled items, applied soon after in the order queued (all
    updates queued meanwhile in one C call per table) by a background thread, or by next()
    while it waits for a batch. The keys were sampled before this call, so an update always
    lands after the samples it refers to.

    Keys no longer in their table (removed since they were sampled) are skipped and counted in
    stats['keys_skipped'], as Reverb's mutate_priorities ignores them.

    Args:
      keys: uint64[n] (or non-negative int64[n]) keys, e.g. Batch.info.key.
      priorities: float[n] (any float dtype), finite, >= 0 on a Prioritized table.
      table: which table the keys belong to: None with one table; an int index or table name for
        all keys; or uint8[n] per key (Batch.table) when mixing tables.

    Raises:
      TypeError: keys or priorities not of an integer / floating dtype.
      ValueError: shapes differ, a priority not finite or negative, a bad table.
      RuntimeError: the iterator is closed or was made in the parent of this forked process; or
        the error an earlier update met.
      DeadOwnerError: the server of one of the tables died (and the iterator ended).
    """
    self._check_owners()
    if table is None and self._native_push(keys, priorities):
      return
    keys, priorities = self._check_update(keys, priorities)
    self._check_negative(priorities)
    self._queue_update(_Update(keys, priorities, self._check_table(table, len(keys)), None))

  def _native_push(self, keys, priorities) -> bool:
    """The common update in one C call with no copy in Python: numpy keys (uint64, or int64
    >= 0) and priorities (float32 / float64, finite, >= 0 on a Prioritized table), 1-D and
    contiguous, of one table with the native updater, no error pending. True when queued; False
    (nothing queued) for anything else: the caller's general path then validates and raises."""
    native = self._native
    if native is None or self._updater is not None or self._update_error is not None or \
        self._error is not None or os.getpid() != self._pid:
      return False
    if self._any_prioritized is None:
      self._any_prioritized = any(t._prioritized() for t in self._tables)  # pylint: disable=protected-access
    return native.push(keys, priorities, self._any_prioritized) == lib.RS_OK

  def _queue_async_update(self, keys, count: int, table, fetch: Callable[[], Any]) -> None:
    """Queues an update whose `count` priorities are still being copied to the host: the
    background thread calls fetch() (waiting for the copy; it returns the priorities as an
    array) and validates them there; a bad value is raised by the consumer's next call.

    Raises:
      TypeError / ValueError: as update_priorities, for the keys, count and table.
    """
    keys, _ = self._check_update(keys, np.zeros(np.size(keys)))
    if count != len(keys):
      raise ValueError(f"priorities must have one value per key: {len(keys)} keys, {count} "
                       "priorities")

    def ready():
      p = np.asarray(fetch(), np.float64).reshape(-1)
      if not np.isfinite(p).all():
        raise ValueError(f"priorities must be finite, got {p[~np.isfinite(p)][0]}")
      self._check_negative(p)
      return keys, p
    self._queue_update(_Update(keys, None, self._check_table(table, len(keys)), ready))

  def flush(self, timeout_ms: Optional[float] = None) -> None:
    """Waits until every queued priority update has been applied.

    Args:
      timeout_ms: None (or a timeout past any deadline, inf included) waits forever.

    Raises:
      DeadlineExceededError: not all applied within timeout_ms.
      ValueError: timeout_ms negative or not a number.
      ReverbError: the error an update met (e.g. TableClosedError), or the background
        thread's error.
    """
    self._check_process()
    if timeouts.deadline_from_ms(timeout_ms) == -1:   # (validates it)
      timeout_ms = None
    deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000.0
    native = self._native
    while native is not None and not native.flush(
        _SLICE_NS if deadline is None else
        min(_SLICE_NS, max(0, int((deadline - time.monotonic()) * 1e9)))):
      if self._error is not None:
        raise self._error
      self._raise_update_error()
      if deadline is not None and time.monotonic() >= deadline:
        raise errors.DeadlineExceededError(f"priority updates not applied within {timeout_ms} ms")
    with self._ucv:
      while self._updates or self._applying:
        if self._error is not None:
          raise self._error
        self._raise_update_error()
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          raise errors.DeadlineExceededError(f"priority updates not applied within {timeout_ms} ms")
        self._ucv.wait(left)
      self._raise_update_error()

  def close(self, timeout_s: float = 10.0) -> None:
    """Applies the queued priority updates (unless the server stopped), stops and joins the
    background threads. Idempotent. Batches already taken stay valid (their buffers are no
    longer reused). In a forked child it only marks the iterator closed (its threads are the
    parent's)."""
    if os.getpid() != self._pid:
      self._stop = True
      return
    with self._cv:
      self._stop = True
      self._cv.notify_all()
    self._stop_updater()
    if threading.current_thread() not in (self._thread, self._updater):
      deadline = time.monotonic() + timeout_s
      self._thread.join(timeout_s)
      if self._updater is not None:
        self._updater.join(max(0.0, deadline - time.monotonic()))

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  @property
  def closed(self) -> bool:
    """True once close() was called or the sampling thread ended on an error."""
    if self._native_sampling:
      return self._stop or self._error is not None or self._native.failure() is not None
    return self._stop or not self._thread.is_alive()

  def _stop_updater(self) -> None:
    """The updaters apply what is queued, then end (the native threads are joined)."""
    with self._ucv:
      self._stop_updates = True
      self._ucv.notify_all()
    if self._native is not None and os.getpid() == self._pid:
      self._native.close()

  # ---- update validation (caller's thread)
  @staticmethod
  def _check_update(keys, priorities):
    """(uint64[n] keys, float64[n] priorities), copies of numpy-convertible inputs."""
    if isinstance(keys, (list, tuple)) and all(
        isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in keys):
      # (Python ints, e.g. info.key.tolist(): numpy makes float64 of keys on both sides of 2**63)
      keys = shared_table_lib.SharedTable._keys(keys)  # pylint: disable=protected-access
    keys = np.asarray(keys)
    if keys.dtype != np.uint64:
      if keys.dtype.kind not in "ui":
        raise TypeError(f"keys must be an array of unsigned 64-bit integers (Batch.info.key), "
                        f"got dtype {keys.dtype}")
      if keys.size and keys.min() < 0:
        raise ValueError(f"keys must be >= 0, got {keys.min()}")
    keys = keys.astype(np.uint64).reshape(-1)   # (a copy: the caller may reuse its array)
    priorities = np.asarray(priorities)
    if priorities.dtype.kind != "f":
      raise TypeError(f"priorities must be an array of a floating dtype (float16/32/64), got "
                      f"dtype {priorities.dtype}")
    priorities = priorities.astype(np.float64).reshape(-1)
    if priorities.shape != keys.shape:
      raise ValueError(f"priorities must have one value per key: {len(keys)} keys, "
                       f"{priorities.size} priorities")
    if priorities.size:
      low, high = priorities.min(), priorities.max()   # (NaN if any is NaN)
      if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"priorities must be finite, got "
                         f"{priorities[~np.isfinite(priorities)][0]}")
    return keys, priorities

  def _check_negative(self, priorities: np.ndarray) -> None:
    if self._any_prioritized is None:
      self._any_prioritized = any(t._prioritized() for t in self._tables)  # pylint: disable=protected-access
    if self._any_prioritized and priorities.size and priorities.min() < 0:
      raise ValueError(f"priorities must be >= 0 for a Prioritized table, got "
                       f"{priorities[priorities < 0][0]}")

  def _check_table(self, table, n: int):
    count = len(self._tables)
    if table is None:
      if count > 1:
        raise ValueError(f"this iterator mixes {count} tables: pass table= (Batch.table, an index "
                         "or a table name)")
      return 0
    if isinstance(table, str):
      names = [t.name for t in self._tables]
      if table not in names:
        raise ValueError(f"table {errors.quoted_name(table)} is not one of this iterator's tables "
                         f"{names}")
      return names.index(table)
    if isinstance(table, (int, np.integer)) and not isinstance(table, bool):
      if not 0 <= table < count:
        raise ValueError(f"table index must be in [0, {count}), got {table}")
      return int(table)
    t = np.asarray(table)
    if t.dtype.kind not in "ui" or t.shape != (n,) or (t.size and not
                                                       (0 <= t.min() and t.max() < count)):
      raise ValueError(f"table must be None, a name, an index or an int array of {n} indices in "
                       f"[0, {count}) (Batch.table), got {errors.quoted_name(table)}")
    return np.array(t, np.uint8)

  def _check_owners(self) -> None:
    """Raises DeadOwnerError, ending the iterator, once the server of one of its tables died
    (noticed within milliseconds by the process's owner watcher): batches gathered from its
    segment may still be ready, and sampling it may go on, but nothing it holds is current."""
    for table in self._tables:
      segment = table.segment
      if segment.owner_dead:
        self._fail(segment.dead_owner_error())
        raise self._error   # type: ignore[misc]

  def _check_process(self) -> None:
    if os.getpid() != self._pid:
      raise RuntimeError(f"this iterator was made in process {self._pid}; its background threads "
                         f"do not exist in this forked child (pid {os.getpid()}): re-create the "
                         "iterator after fork")

  def _queue_update(self, update: _Update) -> None:
    self._check_process()
    self._raise_update_error()
    with self._ucv:
      if self._stop_updates or self._error is not None:
        raise RuntimeError("the iterator is closed: priority updates can no longer be applied"
                           + (f" ({self._error})" if self._error is not None else ""))
      if self._updater is None:
        if update.ready is None:   # the native updater: copied into its queue
          if self._native.push(update.keys, update.priorities, False) != lib.RS_OK:
            raise RuntimeError("the iterator is closed: priority updates can no longer be "
                               "applied")
          return
        # (a device copy to wait for: a Python updater, after the native queue, from now on)
        self._start_python_updater()
      self._updates.append(update)
      self._queued_keys += len(update.keys)
      if len(self._updates) == 1:
        self._ucv.notify()
      # Backpressure: past _QUEUE_LIMIT_KEYS queued keys, wait until the updater takes them.
      while self._queued_keys > _QUEUE_LIMIT_KEYS and not self._stop_updates and \
          self._error is None and self._updater is not None and self._updater.is_alive():
        self._ucv.wait(_SLICE_MS / 1000.0)

  def _start_python_updater(self) -> None:
    self._updater = threading.Thread(target=_updater_thread, args=(self._ref, self._ucv),
                                     name="reverb_shm-priorities", daemon=True)
    self._updater.start()

  def _raise_update_error(self) -> None:
    err, self._update_error = self._update_error, None
    if err is None and self._native is not None:
      failed = self._native.update_error()
      if failed is not None:
        try:
          _lib.raise_for(failed[0], f"updating priorities in table "
                                    f"{errors.quoted_name(self._tables[0].name)}",
                         message=failed[1])
        except Exception as e:   # pylint: disable=broad-except
          err = e
    if err is not None:
      raise err

  # ---- ring
  def _release(self, slot) -> None:
    """(Under the lock) the thread may gather one more batch, into `slot` when given."""
    if slot is not None:
      self._free.append(slot)
    self._credits += 1
    self._cv.notify_all()

  def _new_slot(self) -> _Slot:
    n = self.batch_size
    allocate = self._allocate
    columns, owners = [], []
    for dtype, shape, _ in self._layout:
      if allocate is None:
        columns.append(np.empty((n,) + shape, dtype))
      else:
        array, owner = allocate((n,) + shape, dtype)
        columns.append(array)
        owners.append(owner)
    if allocate is None:
      weights = np.empty(n, np.float32)
    else:
      weights, owner = allocate((n,), np.dtype(np.float32))
      owners.append(owner)
    return _Slot(columns, weights, owners)

  def _take_slot(self) -> Optional[_Slot]:
    """(Under the lock) a buffer to gather into, or None when the thread may not gather now."""
    if self._credits <= 0:
      return None
    self._credits -= 1
    if self._free:
      return self._free.popleft()
    if self._layout is None:   # first batch: the layout is learnt from its first item
      return _Slot(None, None)
    slot = self._new_slot()
    if not self._copy:
      self._slots.append(slot)
    return slot

  # ---- background threads (_prefetch_thread, _updater_thread)
  def _fail(self, e: BaseException) -> None:
    """Ends the iterator on error `e` (raised by the consumer's next call)."""
    if isinstance(e, errors.TableClosedError):
      e = errors.TableClosedError(f"{e}; the iterator's background threads have ended")
    with self._cv:
      if self._error is None:
        self._error = e
      self._cv.notify_all()
    self._stop_updater()

  def _apply_updates(self, updates: List[_Update], final: bool) -> None:
    per_table: collections.defaultdict   # table -> (keys, priorities) lists
    try:
      if self._native is not None:   # (queued before these: applied first)
        while not self._native.flush(_SLICE_NS) and not self._stop_updates:
          pass
      per_table = collections.defaultdict(lambda: ([], []))
      rejected = 0
      for u in updates:
        if u.ready is None:
          keys, priorities = u.keys, u.priorities
        else:
          try:   # each update on its own: a bad one is skipped, the others still applied
            keys, priorities = u.ready()
          except errors.TableClosedError:
            raise
          except Exception as e:   # pylint: disable=broad-except
            # (a bad value found after an asynchronous copy: raised by the caller's next call)
            if self._update_error is None:
              self._update_error = e
            rejected += 1
            continue
        if isinstance(u.table, np.ndarray):
          for t in np.unique(u.table):
            rows = u.table == t
            per_table[int(t)][0].append(keys[rows])
            per_table[int(t)][1].append(priorities[rows])
        else:
          per_table[u.table][0].append(keys)
          per_table[u.table][1].append(priorities)
      updated = skipped = 0
      for t, (keys, priorities) in per_table.items():
        keys = keys[0] if len(keys) == 1 else np.concatenate(keys)
        priorities = priorities[0] if len(priorities) == 1 else np.concatenate(priorities)
        # (validated when queued: keys uint64, priorities finite float64, >= 0 if prioritized)
        found = self._tables[t]._mutate(keys, priorities, _NO_KEYS)  # pylint: disable=protected-access
        found = found[0]
        updated += found
        skipped += len(keys) - found
      with self._ucv:
        self._counts["priority_updates"] += len(updates) - rejected
        self._counts["keys_updated"] += updated
        self._counts["keys_skipped"] += skipped
    except errors.TableClosedError as e:
      if not final:
        self._fail(e)
    except Exception as e:   # pylint: disable=broad-except
      # (a bad value found after an asynchronous copy: raised by the caller's next call)
      self._update_error = e
    finally:
      with self._ucv:
        self._applying = 0
        self._ucv.notify_all()

  @staticmethod
  def _fill(ref, slot: _Slot) -> Optional[Batch]:
    """Gathers one batch into `slot`; None when closed or collected meanwhile. `ref` is a weak
    reference to the iterator, held only during each wait slice."""
    it = ref()
    if it is None:
      return None
    n = it.batch_size
    if it._weights is None:
      plan = [(0, n)]
    else:
      counts = it._mix_rng.multinomial(n, it._weights)
      plan = [(t, int(c)) for t, c in enumerate(counts) if c]
    deadline = None if not it._partial else time.monotonic() + it._timeout_ms / 1000.0
    it = None
    infos, rows_of = [], []
    row = 0
    # A partial batch of several tables visits them in turn with short waits (until each gave its
    # rows, or the deadline passed with at least one item), so that one without items does not
    # keep the others' rows out of it.
    spread = deadline is not None and len(plan) > 1
    slice_max = _SLICE_MS / len(plan) if spread else _SLICE_MS
    remaining = dict(plan)   # table -> rows still to gather
    while True:
      for t, count in list(remaining.items()):
        got = 0
        while got < count:
          it = ref()
          if it is None or it._stop:
            return None
          slice_ms = slice_max
          if deadline is not None:
            left = (deadline - time.monotonic()) * 1000.0
            if left <= 0 and row + got > 0:
              break
            if left > 0:
              slice_ms = min(slice_ms, left)
          info = it._gather(t, slot, row + got, count - got, slice_ms)
          if info is None:
            # (the slices are shorter than the C core's dead-owner check: ask the owner watch)
            segment = it._tables[t].segment
            if segment.owner_dead:
              raise segment.dead_owner_error()
            it = None
            if spread:
              break
            continue
          infos.append(info)
          rows_of.append((t, len(info.key)))
          got += len(info.key)
          it._filling = row + got
          it = None
        row += got
        remaining[t] -= got
        if deadline is not None and time.monotonic() >= deadline and row > 0:
          break
      if row == n or (deadline is not None and time.monotonic() >= deadline and row > 0):
        break
    it = ref()
    if it is None:
      return None
    return it._make_batch(slot, row, infos, rows_of)

  def _gather(self, t: int, slot: _Slot, row: int, count: int, slice_ms: float):
    """Gathers up to `count` items of table t into rows [row, row + count) of slot, waiting at
    most slice_ms; returns their SampleInfo, or None when none came in time."""
    table = self._tables[t]
    layout = table._gather_layout   # pylint: disable=protected-access
    if slot.columns is None:   # the first batch: learn the columns from its first item
      try:
        sample = table.sample_batch(count, timeout_ms=slice_ms)
      except errors.DeadlineExceededError:
        return None
      self._adopt_layout(table, sample)
      slot.columns, slot.weights, slot.owner = self._fresh_buffers()
      if not self._copy:
        self._slots.append(slot)
      b = len(sample.info.key)
      leaves = _leaves(sample.data)
      for dst, src in zip(slot.columns, leaves):
        dst[row:row + b] = src
      return sample.info
    if layout is None or layout != self._layout:
      try:
        sample = table.sample_batch(count, timeout_ms=slice_ms,
                                    out=[c[row:row + count] for c in slot.columns])
      except errors.DeadlineExceededError:
        return None
      except ValueError as e:   # the columns differ from those of the first items
        raise ValueError(f"the tables hold items of different columns: the first items had "
                         f"{_layout_text(self._layout)}; table {errors.quoted_name(table.name)}: "
                         f"{e}") from None
      self._adopt_layout(table, sample)
      return sample.info
    cached = slot.cols.get(t)
    if cached is None or row:
      cols = shared_table_lib._gather_cols(   # pylint: disable=protected-access
          layout, [c[row:] for c in slot.columns] if row else slot.columns)
      cached = (cols, shared_table_lib._address(cols))   # pylint: disable=protected-access
      if not row:
        slot.cols[t] = cached
    deadline_ns = time.monotonic_ns() + int(slice_ms * 1e6)
    try:
      info = table._gather(count, count, deadline_ns, slice_ms,   # pylint: disable=protected-access
                           layout, cached[1], stop_at_other_layout=True)
    except errors.DeadlineExceededError:
      return None
    if table._gather_layout is None:   # pylint: disable=protected-access
      _ = table.size   # raises TableClosedError when the server stopped meanwhile
      raise ValueError(f"table {errors.quoted_name(table.name)} holds items whose columns differ "
                       f"from the first "
                       f"items' ({_layout_text(self._layout)}): a fixed-shape batch needs items "
                       "of one column layout")
    return info

  def _adopt_layout(self, table, sample) -> None:
    """Takes the column layout the table learnt from `sample` (its first items)."""
    layout = table._gather_layout   # pylint: disable=protected-access
    if layout is None:   # (objects, or the sample stopped before an item of another layout)
      leaves = _leaves(sample.data)
      if any(a.dtype.kind == "O" for a in leaves):
        raise ValueError(f"the items of table {errors.quoted_name(table.name)} have columns of "
                         f"Python objects "
                         "(strings): they cannot be gathered into batches of arrays")
      first = tuple((a.dtype, a.shape[1:], None) for a in leaves)
      raise ValueError(f"table {errors.quoted_name(table.name)} holds items whose columns differ "
                       f"(the first "
                       f"sampled: {_layout_text(first)}): a fixed-shape batch needs items of "
                       "one column layout")
    if self._layout is None:
      self._layout = layout
      self._structure_table = table
    elif layout != self._layout:
      raise ValueError(f"the tables hold items of different columns: "
                       f"{errors.quoted_name(self._tables[0].name)}: {_layout_text(self._layout)}; "
                       f"{errors.quoted_name(table.name)}: {_layout_text(layout)}")

  def _start_native(self, first: _Slot) -> bool:
    """(The Python sampling thread, after the first batch, gathered into `first`) starts the
    native sampler on a ring of prefetch + keep buffers, `first` one of them (the consumer's
    until it takes the native sampler's first batch). False when closed meanwhile."""
    keep = 1 if self._copy else self._keep   # (copy: a held slot's buffers are handed off)
    if self._copy:   # (its buffers are the first batch's own)
      first.columns, first.weights, first.owner = self._fresh_buffers()
    slots = [first] + [self._new_slot() for _ in range(self._prefetch + keep - 1)]
    cols = [shared_table_lib._gather_cols(self._layout, s.columns)   # pylint: disable=protected-access
            for s in slots]
    addresses = tuple(shared_table_lib._address(c) for c in cols)   # pylint: disable=protected-access
    seed = None if self._seed is None else self._seed ^ _NATIVE_SEED_MIX
    with self._cv:
      if self._stop or self._error is not None:
        return False
      self._slots = slots
      self._native.start_sampling(addresses, len(self._layout), keep, -1 if self._copy else 0,
                                  seed, (cols, slots))
      self._native_sampling = True
      self._cv.notify_all()
    return True

  def _wrap_leaf(self, array: np.ndarray) -> Any:
    """How batches of the native sampler wrap an array of a ring buffer (once per buffer; a
    subclass whose transform only wraps arrays, e.g. in torch.from_numpy, overrides it)."""
    return array

  def _fresh_buffers(self):
    slot = self._new_slot()
    return slot.columns, slot.weights, slot.owner

  def _make_batch(self, slot: _Slot, b: int, infos, rows_of, count: bool = True) -> Batch:
    info = infos[0] if len(infos) == 1 else SampleInfo(
        *[np.concatenate(field) for field in zip(*infos)])
    n = self.batch_size
    # (a nest of its own per batch, of views of the ring buffer: the consumer may edit it)
    data = self._structure_table._structure(  # pylint: disable=protected-access
        list(slot.columns) if b == n else [c[:b] for c in slot.columns])
    weights = None
    beta = self.importance_beta
    if beta is not None:
      weights = importance_weights(info.probability, info.table_size, beta, out=slot.weights)
    mask = None
    if self._mask_key is not None:
      if not isinstance(data, Mapping) or self._mask_key not in data:
        raise ValueError(f"mask_key {self._mask_key!r} names no column of the items (columns: "
                         f"{list(data) if isinstance(data, Mapping) else 'a flat list'})")
      mask = data[self._mask_key]
      mask = mask if mask.dtype == np.bool_ else mask != 0
    table = None
    if self._weights is not None:
      table = np.repeat(np.array([t for t, _ in rows_of], np.uint8),
                        [c for _, c in rows_of])
    if count:   # (the native sampler counts its batches itself)
      with self._ucv:
        self._counts["batches"] += 1
        self._counts["items"] += b
    return Batch(data, info, weights, mask, table)

  def _limiter_text(self) -> str:
    try:
      return "; ".join(t.limiter_message("sample", self._timeout_ms) for t in self._tables)
    except errors.ReverbError as e:
      return str(e)


def _new_prefetcher(table, batch_size: int):
  """The native threads (reverb_shm._hot.Prefetcher) for `table`: its updater runs now."""
  segment = table.segment
  functions = tuple(int(ffi.cast("uintptr_t", ffi.addressof(lib, name)))
                    for name in ("rs_mutate", "rs_rand_seed_thread", "rs_last_error"))
  return hot.Prefetcher(segment.address, segment.slot, table._index, batch_size,  # pylint: disable=protected-access
                        _SLICE_NS, functions, SampleInfo, (table, segment))


def _wake(cv: threading.Condition, ucv: threading.Condition) -> None:
  """The finalizer of a BatchIterator: wakes its threads, which find it gone and end."""
  for c in (cv, ucv):
    with c:
      c.notify_all()


def _prefetch_thread(ref, cv: threading.Condition) -> None:
  """The sampling thread: gathers batches ahead into free ring buffers until the iterator is
  closed, fails or is collected. `ref` is a weak reference to it, held only while working."""
  it = None
  try:
    it = ref()
    if it is None:
      return
    if it._seed is not None:
      lib.rs_rand_seed_thread(it._seed)
    first = True
    while True:
      with cv:
        while True:
          it = ref()
          if it is None or it._stop:
            return
          if it._credits > 0:
            break
          it = None
          cv.wait()
        slot = it._take_slot()
      if slot.fence is not None:
        fence, slot.fence = slot.fence, None
        fence()
      it = None
      batch = BatchIterator._fill(ref, slot)   # pylint: disable=protected-access
      if batch is None:   # closed or collected while gathering
        return
      it = ref()
      if it is None:
        return
      if it._transform is not None:
        batch = it._transform(batch, slot)
      with cv:
        it._ready.append((slot, batch))
        it._filling = 0
        cv.notify()
      if first and it._seed is not None:
        # (the batches after the first draw from the generator the native sampler would be
        # seeded with: the keys are the same whichever thread gathers them)
        lib.rs_rand_seed_thread(it._seed ^ _NATIVE_SEED_MIX)
      first = False
      if it._native_ok and it._native is not None and \
          it._tables[0]._gather_layout == it._layout and it._start_native(slot):   # pylint: disable=protected-access
        return   # (the native sampler gathers from now on)
      it = batch = None
  except BaseException as e:   # handed to the consumer; the thread ends
    it = ref()
    if it is not None:
      it._fail(e)


def _updater_thread(ref, ucv: threading.Condition) -> None:
  """The updater thread: applies queued priority updates, all of a round in one C call per
  table, until stopped (then the last ones) or the iterator is collected."""
  while True:
    with ucv:
      while True:
        it = ref()
        if it is None:
          return
        if it._updates or it._stop_updates:
          break
        it = None
        ucv.wait()
      final = it._stop_updates
      updates, it._updates = it._updates, []
      it._queued_keys = 0
      it._applying = len(updates)
      ucv.notify_all()   # (callers waiting for room in the queue)
    if updates:
      it._apply_updates(updates, final)
    if final:
      return
    it = updates = None


def _leaves(data) -> list:
  return structure.flatten(data)[0]


def _layout_text(layout) -> str:
  return ", ".join(f"{np.dtype(d).name}{list(s)}" for d, s, _ in layout)
