"""TrajectoryDataset: a tf.data.Dataset of whole sampled items, as Reverb's."""
from reverb_shm.tf import _dataset

__all__ = ["TrajectoryDataset"]


class TrajectoryDataset(_dataset.ReverbDataset):
  """A tf.data.Dataset that samples items (trajectories) from a table.

  Elements are `ReplaySample(info, data)`: `info` a SampleInfo of scalars (key uint64,
  probability float64, table_size int64, priority float64, times_sampled int32) and `data` the
  item's columns nested as `dtypes` (lists become tuples), each of shape `shapes` (the whole
  column, time dim included where the item has one).

  Each iterator samples on its own with `num_workers_per_iterator` workers: each asks for up to
  `max_in_flight_samples_per_worker` items at a time, waiting for the rate limiter only for the
  first, and gathers them in one C call.

  Args:
    server_address: address of the server ('localhost:PORT', 'shm://NAME', a bridge address),
      a str or a string tensor.
    table: table to sample from (str or string tensor).
    dtypes: nest of tf.DTypes of the item's columns.
    shapes: nest (the structure of `dtypes`) of tf.TensorShapes; None dims match any size.
    max_in_flight_samples_per_worker: items sampled per request (>= 1). Larger is faster; too
      large samples many items from one snapshot of the table.
    num_workers_per_iterator: -1 (Reverb's "auto": one worker) or >= 1, as in Reverb capped
      at max(1, max_samples // max_in_flight_samples_per_worker). One worker samples in the
      iterator's own thread, in the order the table hands out items (a FIFO table keeps its
      order); more are threads whose batches reach the iterator in the order they arrive, so
      use one for a FIFO table (as Reverb says). Together they request `max_samples` items,
      and the first to time out on the rate limiter ends the sequence.
    max_samples_per_stream: -1 or >= 1, checked as Reverb does, otherwise without effect:
      Reverb opens a new gRPC stream after this many samples so that a worker's samples spread
      over the servers behind a load-balanced address; a worker here reads the table's shared
      memory directly, with no stream and one server.
    rate_limiter_timeout_ms: -1 waits forever; >= 0: once a sample waits longer than this for
      the rate limiter, the iterator ends (end of sequence), as in Reverb.
    max_samples: -1 or the number of items after which each iterator ends.

  Raises:
    ValueError: `dtypes` and `shapes` of different structures; an argument out of range.
    tf.errors.InvalidArgumentError (when iterating): a sampled item whose columns do not match
      `dtypes` and `shapes` ("Received incompatible tensor at flattened index ...").
  """

  @_dataset.NOT_CONVERTED
  def batch(self, batch_size, drop_remainder=False, num_parallel_calls=None,
            deterministic=None, name=None):
    """As tf.data.Dataset.batch; for a Python int `batch_size` the batches are gathered whole
    (no per-item tf.data work). The elements are those of `unbatch().batch(...)`."""
    if isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size >= 1:
      return _dataset.fixed_batches_dataset(
          self._plan, self._server_address, self._table, self._spec, batch_size,
          bool(drop_remainder))
    return super().batch(batch_size, drop_remainder=drop_remainder,
                         num_parallel_calls=num_parallel_calls, deterministic=deterministic,
                         name=name)
