"""The batches of one group of prefetched requests, assembled once (ClusterClient._issue).

A group is `G` batches whose split over the shards is fixed ahead (`counts`, (G, S)): each
shard answers the whole group at once, its rows for batch 0 first, then batch 1's, and so on.
Rather than cutting every batch from every answer and concatenating the pieces per batch, the
answers are put in batch order by one take per field when the group's first batch is wanted;
each batch is then a view of rows [j * n, (j + 1) * n).
"""
from typing import Any, List, Optional, Sequence

import numpy as np

from reverb_shm.replay_sample import ReplaySample, SampleInfo

__all__ = ["GroupAnswers"]


def batch_order(counts: np.ndarray) -> np.ndarray:
  """Row indices (int64, (counts.sum(),)) into the shards' answers concatenated in shard order
  (shard i answering counts[:, i].sum() rows, batch by batch) that put the rows in batch order:
  batch 0's rows of shard 0, of shard 1, ..., then batch 1's, ..."""
  counts = np.asarray(counts, np.int64)
  within = np.cumsum(counts, axis=0) - counts              # a batch's first row in its answer
  totals = counts.sum(axis=0)
  base = np.cumsum(totals) - totals                        # an answer's first row in the whole
  starts = (within + base).ravel()                         # runs, batch-major
  lengths = counts.ravel()
  first = np.cumsum(lengths) - lengths                     # a run's first position in the output
  return np.repeat(starts - first, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


class GroupAnswers:
  """The shards' answers to one group, in batch order.

  Args:
    calls: per shard of `shards`, an object whose get() returns that shard's (batch, stats)
      answer for the whole group (batch: a ReplaySample with global info and flat columns, or
      None for no rows) or raises; None for a shard without a call (it drew nothing).
    counts: (G, len(shards)) int array, items of batch j drawn on shard i.
  """

  def __init__(self, calls: Sequence[Any], counts: np.ndarray):
    self._calls = list(calls)
    self._counts = np.asarray(counts, np.int64)
    self._rows = np.concatenate([[0], np.cumsum(self._counts.sum(axis=1))])
    self._done = False
    self._info: Optional[List[np.ndarray]] = None
    self._cols: List[np.ndarray] = []

  def batch(self, j: int) -> Optional[ReplaySample]:
    """Batch j of the group (info arrays and (n, ...) columns: views of the assembled rows),
    or None when the answers cannot be assembled: a shard's call failed, a shard answered
    fewer items than asked (its rate limiter admitted fewer), or the layouts differ. The
    caller then cuts the batch from each answer itself, which raises or draws again as it
    must."""
    if not self._done:
      self._done = True
      self._assemble()
    if self._info is None:
      return None
    a, b = int(self._rows[j]), int(self._rows[j + 1])
    return ReplaySample(SampleInfo(*[f[a:b] for f in self._info]), [c[a:b] for c in self._cols])

  def _assemble(self) -> None:
    batches, kept = [], []
    for i, call in enumerate(self._calls):
      want = int(self._counts[:, i].sum())
      if call is None:
        if want:
          return
        continue
      try:
        batch, _ = call.get()
      except Exception:  # pylint: disable=broad-except  (the caller's own cut raises it)
        return
      got = 0 if batch is None else len(batch.info.key)
      if got != want:
        return
      if got:
        batches.append(batch)
        kept.append(i)
    if not batches:
      return
    order = batch_order(self._counts[:, kept])
    try:
      info = [np.concatenate([b.info[f] for b in batches])[order] for f in range(5)]
      cols = [np.concatenate(c)[order] for c in zip(*[b.data for b in batches])]
    except ValueError:   # (different layouts: the per-batch path reports it)
      return
    self._info, self._cols = info, cols
