"""Batches of sampled items for the TensorFlow datasets, gathered in C (no TensorFlow here).

A dataset iterator asks for up to `max_in_flight_samples_per_worker` items at a time. The first
waits for the rate limiter (up to `rate_limiter_timeout_ms`), the rest are taken only if the
limiter allows them at once, as Reverb's sample stream delivers them: one C call
(rs_sample_gather) samples the items and copies every column of the batch into one array. Items
whose layout is not known yet, or whose columns hold strings, come one at a time through
`Client.sample`, which also teaches the table handle their layout.
"""
import queue
import threading
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from reverb_shm import errors
from reverb_shm._internal import timeouts
from reverb_shm.replay_sample import SampleInfo

INFO_DTYPES = SampleInfo(np.dtype(np.uint64), np.dtype(np.float64), np.dtype(np.int64),
                         np.dtype(np.float64), np.dtype(np.int32))

Batch = Tuple[List[np.ndarray], List[np.ndarray]]   # (5 info arrays of length B, columns (B, ...))


class IncompatibleItemError(ValueError):
  """A sampled item does not match the dataset's dtypes and shapes."""


def check_args(max_in_flight_samples_per_worker, num_workers_per_iterator,
               max_samples_per_stream, rate_limiter_timeout_ms, max_samples) -> None:
  """Reverb's argument checks of TrajectoryDataset / TimestepDataset.

  Raises:
    ValueError: a count below 1 (or, where -1 means "auto"/"unlimited", other than -1), or
      rate_limiter_timeout_ms < -1.
  """
  if max_in_flight_samples_per_worker < 1:
    raise ValueError(f"max_in_flight_samples_per_worker ({max_in_flight_samples_per_worker}) "
                     "must be a positive integer")
  if num_workers_per_iterator < 1 and num_workers_per_iterator != -1:
    raise ValueError(f"num_workers_per_iterator ({num_workers_per_iterator}) must be a positive "
                     "integer or -1")
  if max_samples_per_stream < 1 and max_samples_per_stream != -1:
    raise ValueError(f"max_samples_per_stream ({max_samples_per_stream}) must be a positive "
                     "integer or -1")
  if rate_limiter_timeout_ms < -1:
    raise ValueError(f"rate_limiter_timeout_ms ({rate_limiter_timeout_ms}) must be an integer "
                     ">= -1")
  if max_samples < 1 and max_samples != -1:
    raise ValueError(f"max_samples ({max_samples}) must be a positive integer or -1")


def _as_str(value) -> str:
  return value.decode() if isinstance(value, bytes) else str(value)


# Longest single wait inside the generator: between waits it yields an empty batch, which
# hands control back to tf.data so that a deleted iterator is not kept waiting for a sample.
WAIT_SLICE_MS = 100


def sample_batches(server_address, table, max_in_flight: int, rate_limiter_timeout_ms: int,
                   max_samples: int) -> Iterator[Optional[Batch]]:
  """Yields batches of sampled items (B >= 1 each) until `max_samples` items (-1: no limit) or
  until the rate limiter keeps a sample waiting past `rate_limiter_timeout_ms` (-1: forever),
  which ends the sequence as in Reverb. While a sample waits, yields None every
  WAIT_SLICE_MS milliseconds.

  Raises:
    UnknownTableError: no such table. TableClosedError: the server stopped.
  """
  # (imported here: reverb_shm.client imports the whole client stack)
  from reverb_shm import client as client_lib  # pylint: disable=g-import-not-at-top
  client = client_lib.Client(_as_str(server_address))
  table = _as_str(table)
  left = -1 if max_samples < 0 else int(max_samples)
  local = type(client) is client_lib.Client
  st = client._table_handle(table).table if local else None   # pylint: disable=protected-access
  deadline = None   # of the sample being waited for (-1: none)
  while left != 0:
    n = max_in_flight if left < 0 else min(max_in_flight, left)
    if deadline is None:
      deadline = timeouts.deadline_from_ms(
          None if rate_limiter_timeout_ms < 0 else int(rate_limiter_timeout_ms))
    wait_ms: float = WAIT_SLICE_MS
    left_ms = timeouts.remaining_ms(deadline)   # None when deadline is -1 (no deadline)
    if left_ms is not None:
      wait_ms = min(wait_ms, left_ms)
    try:
      batch = None
      if local and st is not None and st._gather_layout is not None:   # pylint: disable=protected-access
        got = st._gather_fresh(n, 1, timeouts.deadline_from_ms(wait_ms), wait_ms)  # pylint: disable=protected-access
        if got is not None and len(got[0].key):
          batch = list(got[0]), got[1]
      if batch is None:   # layout unknown (first item, another layout, strings): one item
        sample: Any = next(iter(client.sample(table, 1, emit_timesteps=False,
                                          rate_limiter_timeout_ms=wait_ms)))
        batch = ([np.asarray([v], d) for v, d in zip(sample.info, INFO_DTYPES)],
                 [np.asarray(c)[None] for c in _flat(sample.data)])
    except errors.DeadlineExceededError:
      if timeouts.remaining_ms(deadline) == 0:   # (None: no deadline)
        return   # the rate limiter timed out: end of sequence
      yield None
      continue
    deadline = None
    if left > 0:
      left -= len(batch[0][0])
    yield batch


def num_workers(num_workers_per_iterator: int, max_in_flight: int, max_samples: int) -> int:
  """Reverb's number of sampling workers of one iterator: 1 for -1 ("auto": more than one
  would reorder a FIFO table's items), and never more than can take a first request each out
  of `max_samples` (max(1, max_samples // max_in_flight))."""
  n = 1 if num_workers_per_iterator == -1 else int(num_workers_per_iterator)
  if max_samples >= 0:
    n = min(n, max(1, max_samples // max_in_flight))
  return n


class _Budget:
  """The items the workers of one iterator may still request (-1: no limit)."""

  def __init__(self, max_samples: int):
    self.left = max_samples
    self.lock = threading.Lock()

  def claim(self, n: int) -> int:
    with self.lock:
      if self.left < 0:
        return n
      n = min(n, self.left)
      self.left -= n
      return n


def worker_batches(server_address, table, max_in_flight: int, rate_limiter_timeout_ms: int,
                   max_samples: int, workers: int) -> Iterator[Optional[Batch]]:
  """sample_batches with `workers` sampling threads (Reverb's workers of one iterator): each
  requests up to `max_in_flight` items at a time and hands its batches to one queue of
  `workers` batches, read in the order they arrive; together they request `max_samples`
  items (-1: no limit). The first worker to time out on the rate limiter ends the sequence
  (as Reverb's sampler does), and the first error is raised here. Yields None every
  WAIT_SLICE_MS while no batch is ready. With one worker, sample_batches itself (no thread).

  Raises:
    the workers' errors (UnknownTableError, TableClosedError, ...).
  """
  if workers <= 1:
    yield from sample_batches(server_address, table, max_in_flight, rate_limiter_timeout_ms,
                              max_samples)
    return
  out: queue.Queue[tuple] = queue.Queue(maxsize=workers)
  stop = threading.Event()
  budget = _Budget(max_samples)

  def put(message) -> bool:
    while not stop.is_set():
      try:
        out.put(message, timeout=WAIT_SLICE_MS / 1000)
        return True
      except queue.Full:
        continue
    return False

  def work():
    try:
      timed_out = False
      while not stop.is_set():
        n = budget.claim(max_in_flight)
        if n == 0:
          break
        got = 0
        for batch in sample_batches(server_address, table, n, rate_limiter_timeout_ms,
                                    -1 if max_samples < 0 else n):
          if stop.is_set():
            return
          if batch is not None:
            got += len(batch[0][0])
            if not put(("batch", batch)):
              return
        if max_samples < 0 or got < n:   # sample_batches ended early: a rate limiter timeout
          timed_out = True
          break
      put(("end", timed_out))
    except BaseException as e:  # pylint: disable=broad-except  (handed to the reader)
      put(("error", e))

  threads = [threading.Thread(target=work, name="reverb_shm-dataset-worker", daemon=True)
             for _ in range(workers)]
  for t in threads:
    t.start()
  try:
    running = workers
    while running:
      try:
        kind, value = out.get(timeout=WAIT_SLICE_MS / 1000)
      except queue.Empty:
        yield None
        continue
      if kind == "batch":
        yield value
      elif kind == "error":
        raise value
      elif value:   # a worker timed out on the rate limiter: the end of the sequence
        return
      else:         # a worker requested its share of max_samples, all of it delivered
        running -= 1
  finally:
    stop.set()


def _flat(data) -> list:
  if isinstance(data, list):
    return data
  from reverb_shm._internal import structure  # pylint: disable=g-import-not-at-top
  return structure.flatten(data)[0]


def check_batch(table: str, columns: Sequence[np.ndarray], dtypes: Sequence[np.dtype],
                shapes: Sequence[Optional[tuple]], lead: int = 1) -> None:
  """Checks the columns of a batch against the dataset's flat dtypes and item shapes (None: any
  rank; None dims: any size), ignoring the first `lead` dims of each column.

  Raises:
    IncompatibleItemError: a column count, dtype or shape that does not match, with Reverb's
      wording ("Received incompatible tensor at flattened index ...").
  """
  if len(columns) != len(dtypes):
    raise IncompatibleItemError(
        f"Inconsistent number of tensors requested from table "
        f"{errors.quoted_name(table, plain=True)}. Requested "
        f"{len(dtypes)} tensors, but table signature shows {len(columns)} tensors.")
  for i, (col, dtype, shape) in enumerate(zip(columns, dtypes, shapes)):
    got = col.shape[lead:]
    col_dtype = col.dtype if col.dtype.kind not in "SUO" else np.dtype(object)
    ok = col_dtype == dtype and (shape is None or (
        len(shape) == len(got) and all(s is None or s == g for s, g in zip(shape, got))))
    if not ok:
      want = "?" if shape is None else "[" + ",".join("?" if s is None else str(s)
                                                     for s in shape) + "]"
      raise IncompatibleItemError(
          f"Received incompatible tensor at flattened index {i} from table "
          f"{errors.quoted_name(table, plain=True)}. "
          f"Specification has (dtype, shape): ({_dtype_name(dtype)}, {want}). Tensor has "
          f"(dtype, shape): ({_dtype_name(col_dtype)}, [{','.join(map(str, got))}]).")


def _dtype_name(dtype: np.dtype) -> str:
  return "string" if dtype.kind == "O" else dtype.name
