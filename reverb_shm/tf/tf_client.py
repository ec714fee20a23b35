"""TFClient: Reverb's client operations as TensorFlow ops (eager and inside tf.function)."""
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from reverb_shm import errors
from reverb_shm._internal import structure
from reverb_shm.replay_sample import ReplaySample, SampleInfo

__all__ = ["TFClient"]

_INFO_DTYPES = (tf.uint64, tf.float64, tf.int64, tf.float64, tf.int32)


def _invalid_argument(fn):
  """`fn` raising tf.errors.InvalidArgumentError for bad input (as Reverb's ops), eagerly and
  inside graphs alike (in a graph, TensorFlow turns ValueError and TypeError into it; eagerly,
  numpy_function passes the Python exception through)."""
  if not tf.executing_eagerly():
    return fn

  def wrapped(*args):
    try:
      return fn(*args)
    except (ValueError, TypeError, KeyError) as e:
      raise tf.errors.InvalidArgumentError(None, None, f"{type(e).__name__}: {e}") from e
  return wrapped


class TFClient:
  """Samples, inserts and updates priorities from a TensorFlow graph.

  Args:
    server_address: address of the server (as for Client).
    shared_name: accepted for Reverb compatibility (every TFClient of an address shares the
      process's attachment to the server).
    name: name scope of the ops.

  The ops run Client calls through tf.numpy_function: they are stateful, run in order inside a
  tf.function, and raise tf.errors.InvalidArgumentError for bad input.
  """

  def __init__(self, server_address: str, shared_name: Optional[str] = None,
               name: str = "reverb"):
    del shared_name
    self._name = name
    self._server_address = server_address
    self._client = None

  @property
  def server_address(self) -> str:
    return self._server_address

  def _py_client(self):
    if self._client is None:
      from reverb_shm import client as client_lib  # pylint: disable=g-import-not-at-top
      self._client = client_lib.Client(self._server_address)
    return self._client

  def sample(self, table: str, data_dtypes, name: Optional[str] = None) -> ReplaySample:
    """Samples one item and returns its first timestep.

    Args:
      table: table name.
      data_dtypes: nest of tf.DTypes of the item's columns (in flattened order).
      name: name scope.

    Returns:
      ReplaySample: info scalars (key uint64, probability float64, table_size int64, priority
      float64, times_sampled int32) and data nested as `data_dtypes`, one timestep of each
      column (an item written by TFClient.insert or Client.insert holds one).

    Raises:
      tf.errors.InvalidArgumentError: the item's columns do not match `data_dtypes`.
    """
    flat_dtypes = [tf.as_dtype(d) for d in tf.nest.flatten(data_dtypes)]
    np_dtypes = [np.dtype(object) if d == tf.string else np.dtype(d.as_numpy_dtype)
                 for d in flat_dtypes]
    client = self._py_client()

    def sample_fn():
      steps = next(iter(client.sample(table, 1, emit_timesteps=True)))
      step = steps[0]
      columns = structure.flatten(step.data)[0] if not isinstance(step.data, list) \
          else step.data
      if len(columns) != len(np_dtypes):
        raise ValueError(f"Item of table {errors.quoted_name(table, plain=True)} has "
                         f"{len(columns)} tensors, "
                         f"{len(np_dtypes)} dtypes were requested")
      out = []
      for i, (col, dtype) in enumerate(zip(columns, np_dtypes)):
        col = np.asarray(col)
        if (col.dtype.kind in "SUO") != (dtype.kind == "O") or (
            dtype.kind != "O" and col.dtype != dtype):
          raise ValueError(f"Type mismatch at flattened index {i}: actual "
                           f"{col.dtype} vs. expect {dtype}")
        out.append(col)
      info = [np.asarray(v, d.as_numpy_dtype) for v, d in zip(step.info, _INFO_DTYPES)]
      return info + out

    with tf.name_scope(name or f"{self._name}_sample"):
      outs = tf.numpy_function(_invalid_argument(sample_fn), [], list(_INFO_DTYPES) + flat_dtypes,
                               stateful=True)
      for t in outs[:5]:
        t.set_shape([])
      return ReplaySample(info=SampleInfo(*outs[:5]),
                          data=tf.nest.pack_sequence_as(data_dtypes, outs[5:]))

  def insert(self, data: Sequence[tf.Tensor], tables: tf.Tensor, priorities: tf.Tensor,
             name: Optional[str] = None):
    """Inserts `data` (one timestep, a list of tensors) as an item of each of `tables`, the
    item of tables[i] with priority priorities[i].

    Returns:
      The op performing the insert (None when executing eagerly).

    Raises:
      ValueError: `tables` not a rank 1 string tensor, `priorities` not a rank 1 float64
        tensor, or of different shapes.
      tf.errors.InvalidArgumentError (when run): data that does not match a table's signature,
        an unknown table.
    """
    if tables.dtype != tf.string or tables.shape.rank != 1:
      raise ValueError("tables must be a string tensor of rank 1")
    if priorities.dtype != tf.float64 or priorities.shape.rank != 1:
      raise ValueError("priorities must be a float64 tensor of rank 1")
    if not tables.shape.is_compatible_with(priorities.shape):
      raise ValueError("priorities and tables must have the same shape")
    client = self._py_client()
    data = list(data)

    def insert_fn(table_names, prios, *columns):
      if len(table_names) != len(prios):
        raise ValueError(f"{len(table_names)} tables but {len(prios)} priorities")
      items = {}
      for t, p in zip(table_names.tolist(), prios.tolist()):
        items[t.decode()] = p
      client.insert(list(columns), priorities=items)
      return np.zeros((), np.bool_)

    with tf.name_scope(name or f"{self._name}_insert"):
      done = tf.numpy_function(_invalid_argument(insert_fn), [tables, priorities] + data, tf.bool,
                               stateful=True)
      if tf.executing_eagerly():
        return None
      return done.op

  def update_priorities(self, table: str, keys: tf.Tensor, priorities: tf.Tensor,
                        name: Optional[str] = None):
    """Sets the priorities of the items `keys` (uint64) to `priorities` (float64); keys not
    in the table are ignored.

    Returns:
      The op performing the update (None when executing eagerly).

    Raises:
      tf.errors.InvalidArgumentError (when run): keys and priorities of different lengths, an
        invalid priority.
    """
    client = self._py_client()

    def update_fn(keys_np, prios_np):
      keys_np, prios_np = np.ravel(keys_np), np.ravel(prios_np)
      if len(keys_np) != len(prios_np):
        raise ValueError(f"keys ({len(keys_np)}) and priorities ({len(prios_np)}) must have "
                         "the same length")
      client.mutate_priorities(table, updates=dict(zip(keys_np.tolist(), prios_np.tolist())))
      return np.zeros((), np.bool_)

    with tf.name_scope(name or f"{self._name}_update_priorities"):
      done = tf.numpy_function(
          _invalid_argument(update_fn), [tf.convert_to_tensor(keys, tf.uint64),
                      tf.convert_to_tensor(priorities, tf.float64)], tf.bool, stateful=True)
      if tf.executing_eagerly():
        return None
      return done.op
