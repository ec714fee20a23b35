"""The tf.data machinery shared by TrajectoryDataset and TimestepDataset.

Each iterator of a dataset runs one Python generator (on tf.data's generator source, called
through tf.numpy_function: see _generator_dataset) that yields whole batches gathered in C (see
_batches.sample_batches); `unbatch` turns them into the per-item (or per-timestep) elements
Reverb's datasets produce. `dataset.batch(n)` on a
TrajectoryDataset skips the unbatch/batch round trip: its generator yields the whole batches of
n items that each gather completes (the last one smaller at the end of the sequence, or dropped
with drop_remainder), which is what `unbatch().batch(n)` would give, several times faster.
`iter()` of either in eager mode is tf.data's iterator with less Python per element
(_iterator.Iterator).
"""
import collections.abc
import functools
import itertools
from typing import Any, Callable, Dict, Generator, Iterator, List, Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.util import nest as tf_nest  # flatten_up_to: not in tf.nest's API

try:   # the source under Dataset.from_generator, in every TensorFlow from 2.9 to 2.21
  from tensorflow.python.data.ops import from_generator_op as _from_generator_op
  _TFGeneratorDataset = _from_generator_op._GeneratorDataset  # pylint: disable=protected-access
except ImportError:   # pragma: no cover
  _TFGeneratorDataset = None

from reverb_shm import errors
from reverb_shm.replay_sample import ReplaySample, SampleInfo
from reverb_shm.tf import _batches, _iterator

# Datasets are often built inside functions that tf.data traces with AutoGraph (Acme's
# make_reverb_dataset builds them in an interleave): their Python code runs as it is, without
# AutoGraph's conversion attempts (and warnings about generators).
NOT_CONVERTED = tf.autograph.experimental.do_not_convert

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
               max_in_flight: int, rate_limiter_timeout_ms: int, max_samples: int,
               num_workers: int = 1):
    self.dtypes = dtypes
    self.np_dtypes = [_np_dtype(d) for d in flat_dtypes]
    self.shapes = [_shape_tuple(s) for s in flat_shapes]
    self.timesteps = timesteps
    self.max_in_flight = max_in_flight
    self.rate_limiter_timeout_ms = rate_limiter_timeout_ms
    self.max_samples = max_samples
    self.num_workers = num_workers
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
    max_in_flight = max_in_flight or self.max_in_flight
    for batch in _batches.worker_batches(
        server_address, table, max_in_flight, self.rate_limiter_timeout_ms, self.max_samples,
        _batches.num_workers(self.num_workers, max_in_flight, self.max_samples)):
      if batch is None:
        yield self.empty()
        continue
      info, columns = batch
      if self.timesteps:
        info, columns = _split_timesteps(table_name, info, columns, self.shapes)
      _batches.check_batch(table_name, columns, self.np_dtypes, self.shapes)
      yield info, columns



def _split_timesteps(table, info, columns, shapes):
  """Items (B, T, ...) -> timesteps (B * T, ...), each item's info repeated for its T steps.

  A column without a time dim (the item squeezed it: its items have the rank of the dataset's
  per-step shape, or are scalars) is one timestep, as in Reverb. Gathered columns do not say
  whether an item squeezed them (a squeezed [3] has the bytes and shape of 3 steps of []), so
  the declared rank decides; with an unknown rank, only a scalar column counts as squeezed.

  Raises:
    IncompatibleItemError: columns of different numbers of timesteps.
  """
  columns = [c[:, None] if c.ndim == 1 or (s is not None and c.ndim - 1 == len(s)) else c
             for c, s in zip(columns, shapes)]
  lengths = [c.shape[1] for c in columns]
  if len(set(lengths)) > 1:
    raise _batches.IncompatibleItemError(
        f"items of table {errors.quoted_name(table, plain=True)} cannot be split into timesteps: "
        f"their columns have lengths "
        f"{lengths} (every column needs the same number of timesteps; a squeezed column has "
        "one)")
  t = lengths[0] if lengths else 1
  b = len(info[0])
  return ([np.repeat(x, t) for x in info],
          [c.reshape((b * t,) + c.shape[2:]) for c in columns])


# One Python generator per iterator of a dataset, by the id that the iterator's init function got.
_GENERATORS: Dict[int, Generator[list, None, None]] = {}
_GENERATOR_IDS = itertools.count(1)


def _start_generator(make_generator: Callable, address, table) -> np.int64:
  key = next(_GENERATOR_IDS)
  _GENERATORS[key] = make_generator(address, table)
  return np.int64(key)


def _next_flat(key) -> list:
  """The next flat element of iterator `key`; StopIteration (the end of the sequence) reaches
  tf.data as OutOfRangeError, which ends the iterator."""
  return next(_GENERATORS[int(key)])


def _stop_generator(key) -> np.int64:
  generator = _GENERATORS.pop(int(key), None)
  if generator is not None:
    generator.close()
  return np.int64(0)


def _generator_dataset(server_address, table, make_generator: Callable,
                       signature) -> tf.data.Dataset:
  """A dataset of the flat lists of arrays that `make_generator(address, table)` yields (one
  generator per iterator, closed when the iterator is destroyed), as `signature`.

  tf.data's own generator source (the one under Dataset.from_generator), driven by
  tf.numpy_function: from_generator's per-element work (an eager py_func, converting and
  checking every value against the signature in Python) costs several times what a gathered
  batch does; here the arrays go to TensorFlow as they are (GatherPlan.batches checked them).
  Falls back to from_generator where TensorFlow lacks that source.
  """
  flat_signature = tf.nest.flatten(signature)
  out_dtypes = [s.dtype for s in flat_signature]
  args = (tf.convert_to_tensor(server_address, tf.string), tf.convert_to_tensor(table, tf.string))
  if _TFGeneratorDataset is None:   # pragma: no cover  (every TensorFlow 2.15-2.21 has it)
    return tf.data.Dataset.from_generator(
        lambda a, t: (tf.nest.pack_sequence_as(signature, flat) for flat in make_generator(a, t)),
        output_signature=signature, args=args)

  def init_fn(address, table_name):
    return tf.numpy_function(functools.partial(_start_generator, make_generator),
                             [address, table_name], tf.int64, stateful=True)

  def next_fn(key):
    flat = tf.numpy_function(_next_flat, [key], out_dtypes, stateful=True)
    for tensor, spec in zip(flat, flat_signature):
      tensor.set_shape(spec.shape)
    return tf.nest.pack_sequence_as(signature, flat)

  def finalize_fn(key):
    return tf.numpy_function(_stop_generator, [key], tf.int64, stateful=True)

  return _TFGeneratorDataset(args, init_fn, next_fn, finalize_fn, signature)


def _batch_signature(spec, batch_size=None):
  return tf.nest.map_structure(
      lambda s: tf.TensorSpec(tf.TensorShape([batch_size]).concatenate(s.shape), s.dtype), spec)


def batches_dataset(plan: GatherPlan, server_address, table, spec) -> tf.data.Dataset:
  """A dataset of the gathered batches (element spec: `spec` with a leading None dim; empty
  batches while a sample waits for the rate limiter)."""
  def generator(address, table_name) -> Iterator[tuple]:
    for info, columns in plan.batches(address, table_name):
      yield info + columns
  return _generator_dataset(server_address, table, generator, _batch_signature(spec))


def fixed_batches_dataset(plan: GatherPlan, server_address, table, spec, batch_size: int,
                          drop_remainder: bool) -> tf.data.Dataset:
  """What `unbatch().batch(batch_size, drop_remainder)` of batches_dataset gives.

  Each call of the generator hands tf.data every whole batch that one gather completed, as
  one element of shape (k, batch_size, ...), which `unbatch` turns into k batches (none
  while a sample waits for the rate limiter: k = 0). tf.data slices them in C++; the
  per-call hand-off (a Python call through tf.numpy_function on one of tf.data's threads)
  costs several times the slicing, so a gather of max_in_flight_samples_per_worker items
  pays it once, not once per batch. The items left over from a gather wait for the next
  one. With drop_remainder every batch holds exactly batch_size items, so the batch dim is
  static in the signature; otherwise the end of the sequence hands out the items left as
  one smaller batch.
  """
  def as_batches(info, columns, k, size):   # (flat list of (k, size, ...) views)
    return [x.reshape((k, size) + x.shape[1:]) for x in itertools.chain(info, columns)]

  def generator(address, table_name) -> Iterator[list]:
    pending: List[tuple] = []   # (info, columns) pieces, in order
    have = 0
    for info, columns in plan.batches(address, table_name, max(plan.max_in_flight, 1)):
      b = len(info[0])
      if not b:   # waiting for the rate limiter: no batch, control to tf.data
        info, columns = plan.empty()
        yield as_batches(info, columns, 0, batch_size)
        continue
      if not have and b % batch_size == 0:   # (the common case: whole batches as gathered)
        yield as_batches(info, columns, b // batch_size, batch_size)
        continue
      pending.append((info, columns))
      have += b
      if have >= batch_size:
        k = have // batch_size
        (info, columns), pending = _take(pending, k * batch_size)
        have -= k * batch_size
        yield as_batches(info, columns, k, batch_size)
    if have and not drop_remainder:
      info, columns = _take(pending, have)[0]
      yield as_batches(info, columns, 1, have)
  signature = _batch_signature(_batch_signature(spec, batch_size if drop_remainder else None))
  return BatchedDataset(_generator_dataset(server_address, table, generator, signature).unbatch())


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


class _FastIteration:
  """`iter()` gives a _iterator.Iterator in eager mode (the same elements as tf.data's own
  iterator, with less Python per element)."""

  def __iter__(self):
    it = _iterator.make_iterator(self)   # type: ignore[arg-type]
    return super().__iter__() if it is None else it   # type: ignore[misc]


class BatchedDataset(_FastIteration, tf.data.Dataset):
  """The dataset `inner` (same variant, same elements), iterated by _FastIteration."""

  def __init__(self, inner: tf.data.Dataset):
    self._inner = inner
    super().__init__(inner._variant_tensor)   # pylint: disable=protected-access

  def _inputs(self):
    return [self._inner]

  @property
  def element_spec(self):
    return self._inner.element_spec


class ReverbDataset(_FastIteration, tf.data.Dataset):
  """Base of TrajectoryDataset and TimestepDataset: a tf.data.Dataset over a generator."""

  _TIMESTEPS = False

  @NOT_CONVERTED
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
        int(max_samples), int(num_workers_per_iterator))
    self._inner = batches_dataset(self._plan, server_address, table, self._spec).unbatch()
    super().__init__(self._inner._variant_tensor)   # pylint: disable=protected-access

  def _inputs(self):
    return [self._inner]

  @property
  def element_spec(self):
    return self._spec

  @classmethod
  @NOT_CONVERTED
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
