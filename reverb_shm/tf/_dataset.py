"""The tf.data machinery shared by TrajectoryDataset and TimestepDataset.

Each iterator of a dataset runs one Python generator (tf.data.Dataset.from_generator) that
yields whole batches gathered in C (see _batches.sample_batches); `unbatch` turns them into the
per-item (or per-timestep) elements Reverb's datasets produce. `dataset.batch(n)` on a
TrajectoryDataset skips the unbatch/batch round trip: its generator yields batches of exactly n
items (the last one smaller at the end of the sequence, or dropped with drop_remainder), which
is what `unbatch().batch(n)` would give, several times faster.
"""
import collections.abc
from typing import Any, Callable, Iterator, List, Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.util import nest as tf_nest  # flatten_up_to: not in tf.nest's API

from reverb_shm.replay_sample import ReplaySample, SampleInfo
from reverb_shm.tf import _batches

_INFO_TF_DTYPES = SampleInfo(tf.uint64, tf.float64, tf.int64, tf.float64, tf.int32)


def lists_to_tuples(structure: Any) -> Any:
  """`structure` with every list (at any depth) replaced by a tuple, as Reverb does: tf.data
  handles lists badly."""
  if isinstance(structure, list):
    return tuple(lists_to_tuples(x) for x in structure)
  if isinstance(structure, tuple) and hasattr(structure, "_fields"):
    return type(structure)(*[lists_to_tuples(x) for x in structure])
  if isinstance(structure, tuple):
    return tuple(lists_to_tuples(x) for x in structure)
  if isinstance(structure, collections.abc.Mapping):
    mapping_type: Any = type(structure)
    return mapping_type((k, lists_to_tuples(v)) for k, v in structure.items())
  return structure


def flat_specs(dtypes: Any, shapes: Any):
  """(dtypes nest with lists as tuples, flat tf.DTypes, flat tf.TensorShapes).

  Raises:
    ValueError: `dtypes` and `shapes` do not share the same structure (shapes may be given as
      lists or tuples of dims at the leaves).
  """
  dtypes = lists_to_tuples(dtypes)
  try:
    flat_shapes = tf_nest.flatten_up_to(dtypes, lists_to_tuples(shapes), check_types=False)
  except (TypeError, ValueError) as e:
    raise ValueError(f"dtypes and shapes must have the same structure: {e}") from None
  flat_dtypes = [tf.as_dtype(d) for d in tf.nest.flatten(dtypes)]
  return dtypes, flat_dtypes, [tf.TensorShape(s) for s in flat_shapes]


def element_spec(dtypes, flat_dtypes, flat_shapes, lead=()) -> ReplaySample:
  """ReplaySample of TensorSpecs: info scalars and data as `dtypes`, each with dims `lead`
  in front."""
  lead = tf.TensorShape(lead)
  info = SampleInfo(*[tf.TensorSpec(lead, d) for d in _INFO_TF_DTYPES])
  data = tf.nest.pack_sequence_as(
      dtypes, [tf.TensorSpec(lead.concatenate(s), d) for s, d in zip(flat_shapes, flat_dtypes)])
  return ReplaySample(info, data)


def _np_dtype(dtype: tf.DType) -> np.dtype:
  return np.dtype(object) if dtype == tf.string else np.dtype(dtype.as_numpy_dtype)


def _shape_tuple(shape: tf.TensorShape) -> Optional[tuple]:
  return None if shape.rank is None else tuple(shape.as_list())


class GatherPlan:
  """What a generator needs to turn gathered batches into elements (picklable, no TF state)."""

  def __init__(self, table_name: str, dtypes, flat_dtypes, flat_shapes, timesteps: bool,
               max_in_flight: int, rate_limiter_timeout_ms: int, max_samples: int):
    self.dtypes = dtypes
    self.np_dtypes = [_np_dtype(d) for d in flat_dtypes]
    self.shapes = [_shape_tuple(s) for s in flat_shapes]
    self.timesteps = timesteps
    self.max_in_flight = max_in_flight
    self.rate_limiter_timeout_ms = rate_limiter_timeout_ms
    self.max_samples = max_samples
    self.table_name = table_name

  def empty(self):
    """(info, columns) of no element (unknown dims as 0)."""
    info = [np.zeros(0, d) for d in _batches.INFO_DTYPES]
    return info, [np.zeros((0,) + tuple(d or 0 for d in (s or ())), dt)
                  for s, dt in zip(self.shapes, self.np_dtypes)]

  def batches(self, server_address, table, max_in_flight=None):
    """Yields (info list, columns list) of B checked elements (items, or timesteps); B is 0
    while a sample waits for the rate limiter (every _batches.WAIT_SLICE_MS)."""
    table_name = _batches._as_str(table)   # pylint: disable=protected-access
    for batch in _batches.sample_batches(
        server_address, table, max_in_flight or self.max_in_flight,
        self.rate_limiter_timeout_ms, self.max_samples):
      if batch is None:
        yield self.empty()
        continue
      info, columns = batch
      if self.timesteps:
        info, columns = _split_timesteps(table_name, info, columns)
      _batches.check_batch(table_name, columns, self.np_dtypes, self.shapes)
      yield info, columns

  def pack(self, info, columns) -> ReplaySample:
    return ReplaySample(SampleInfo(*info), tf.nest.pack_sequence_as(self.dtypes, columns))


def _split_timesteps(table, info, columns):
  """Items (B, T, ...) -> timesteps (B * T, ...), each item's info repeated for its T steps.

  Raises:
    IncompatibleItemError: a column without a time dim, or columns of different lengths.
  """
  lengths = {c.shape[1] if c.ndim > 1 else None for c in columns}
  if len(lengths) != 1 or None in lengths:
    raise _batches.IncompatibleItemError(
        f"items of table '{table}' cannot be split into timesteps: their columns have lengths "
        f"{[c.shape[1] if c.ndim > 1 else None for c in columns]} (every column needs the same "
        "number of timesteps)")
  t = lengths.pop()
  b = len(info[0])
  return ([np.repeat(x, t) for x in info],
          [c.reshape((b * t,) + c.shape[2:]) for c in columns])


def _generator_dataset(server_address, table, make_generator: Callable,
                       signature) -> tf.data.Dataset:
  return tf.data.Dataset.from_generator(
      make_generator, output_signature=signature,
      args=(tf.convert_to_tensor(server_address, tf.string),
            tf.convert_to_tensor(table, tf.string)))


def batches_dataset(plan: GatherPlan, server_address, table, spec) -> tf.data.Dataset:
  """A dataset of the gathered batches (element spec: `spec` with a leading None dim)."""
  def generator(address, table_name) -> Iterator[tuple]:
    for info, columns in plan.batches(address, table_name):
      yield plan.pack(info, columns)
  signature = tf.nest.map_structure(
      lambda s: tf.TensorSpec(tf.TensorShape([None]).concatenate(s.shape), s.dtype), spec)
  return _generator_dataset(server_address, table, generator, signature)


def fixed_batches_dataset(plan: GatherPlan, server_address, table, spec, batch_size: int,
                          drop_remainder: bool) -> tf.data.Dataset:
  """What `unbatch().batch(batch_size, drop_remainder)` of batches_dataset gives."""
  def generator(address, table_name) -> Iterator[tuple]:
    pending: List[tuple] = []   # (info, columns) pieces, in order
    have = 0
    for info, columns in plan.batches(address, table_name, max(plan.max_in_flight, 1)):
      pending.append((info, columns))
      have += len(info[0])
      while have >= batch_size:
        head_info, head_cols = pending[0]
        if len(head_info[0]) >= batch_size:   # (the common case: no copy here)
          out = ([x[:batch_size] for x in head_info], [c[:batch_size] for c in head_cols])
          rest = ([x[batch_size:] for x in head_info], [c[batch_size:] for c in head_cols])
          pending[0] = rest
          if not len(rest[0][0]):
            pending.pop(0)
        else:
          out, pending = _take(pending, batch_size)
        have -= batch_size
        yield plan.pack(*out)
    if have and not drop_remainder:
      yield plan.pack(*_take(pending, have)[0])
  signature = tf.nest.map_structure(
      lambda s: tf.TensorSpec(tf.TensorShape([None]).concatenate(s.shape), s.dtype), spec)
  dataset = _generator_dataset(server_address, table, generator, signature).filter(
      lambda sample: tf.size(sample.info.key) > 0)
  if drop_remainder:   # a static batch dim, as batch(drop_remainder=True) gives
    dataset = dataset.map(lambda sample: tf.nest.map_structure(
        lambda t: tf.ensure_shape(t, tf.TensorShape([batch_size]).concatenate(t.shape[1:])),
        sample))
  return dataset


def _take(pending, n):
  """(first n rows of the pieces concatenated, the pieces left)."""
  out, left, got = [], [], 0
  for info, cols in pending:
    k = min(n - got, len(info[0]))
    if k:
      out.append(([x[:k] for x in info], [c[:k] for c in cols]))
      got += k
    if k < len(info[0]):
      left.append(([x[k:] for x in info], [c[k:] for c in cols]))
  info = [np.concatenate(parts) for parts in zip(*[o[0] for o in out])]
  try:
    cols = [np.concatenate(parts) for parts in zip(*[o[1] for o in out])]
  except ValueError as e:   # items of different shapes (None dims) cannot share a batch
    raise _batches.IncompatibleItemError(f"Cannot batch tensors with different shapes: {e}") \
        from None
  return (info, cols), left


class ReverbDataset(tf.data.Dataset):
  """Base of TrajectoryDataset and TimestepDataset: a tf.data.Dataset over a generator."""

  _TIMESTEPS = False

  def __init__(self, server_address, table, dtypes, shapes,
               max_in_flight_samples_per_worker: int, num_workers_per_iterator: int = -1,
               max_samples_per_stream: int = -1, rate_limiter_timeout_ms: int = -1,
               max_samples: int = -1):
    dtypes, flat_dtypes, flat_shapes = flat_specs(dtypes, shapes)
    _batches.check_args(max_in_flight_samples_per_worker, num_workers_per_iterator,
                        max_samples_per_stream, rate_limiter_timeout_ms, max_samples)
    self._server_address = server_address
    self._table = table
    self._dtypes = dtypes
    self._shapes = tf.nest.pack_sequence_as(dtypes, flat_shapes)
    self._max_in_flight_samples_per_worker = max_in_flight_samples_per_worker
    self._num_workers_per_iterator = num_workers_per_iterator
    self._max_samples_per_stream = max_samples_per_stream
    self._rate_limiter_timeout_ms = rate_limiter_timeout_ms
    self._max_samples = max_samples
    self._spec = element_spec(dtypes, flat_dtypes, flat_shapes)
    self._plan = GatherPlan(
        table if isinstance(table, str) else "", dtypes, flat_dtypes, flat_shapes,
        self._TIMESTEPS, int(max_in_flight_samples_per_worker), int(rate_limiter_timeout_ms),
        int(max_samples))
    self._inner = batches_dataset(self._plan, server_address, table, self._spec).unbatch()
    super().__init__(self._inner._variant_tensor)   # pylint: disable=protected-access

  def _inputs(self):
    return [self._inner]

  @property
  def element_spec(self):
    return self._spec

  @classmethod
  def from_table_signature(cls, server_address: str, table: str,
                           max_in_flight_samples_per_worker: int,
                           num_workers_per_iterator: int = -1, max_samples_per_stream: int = -1,
                           rate_limiter_timeout_ms: int = -1,
                           get_signature_timeout_secs: Optional[int] = None,
                           max_samples: int = -1):
    """The dataset with the dtypes and shapes of the table's signature (see the class doc).

    Raises:
      ValueError: no table `table` on the server, or the table has no signature; the checks of
        the constructor.
      DeadlineExceededError: no server answered within `get_signature_timeout_secs`.
    """
    from reverb_shm import client as client_lib  # pylint: disable=g-import-not-at-top
    info = client_lib.Client(server_address).server_info(get_signature_timeout_secs)
    if table not in info:
      raise ValueError(f"Server at {server_address} does not contain any table named {table}. "
                       f"Found: {', '.join(sorted(info))}.")
    signature = info[table].signature
    if not signature:
      raise ValueError(f"Table {table} at {server_address} does not have a signature.")
    return cls(server_address=server_address, table=table,
               shapes=tf.nest.map_structure(lambda s: tf.TensorShape(s.shape), signature),
               dtypes=tf.nest.map_structure(lambda s: tf.as_dtype(s.dtype), signature),
               max_in_flight_samples_per_worker=max_in_flight_samples_per_worker,
               num_workers_per_iterator=num_workers_per_iterator,
               max_samples_per_stream=max_samples_per_stream,
               rate_limiter_timeout_ms=rate_limiter_timeout_ms, max_samples=max_samples)
