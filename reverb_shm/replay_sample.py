"""SampleInfo and ReplaySample: what Client.sample and SharedTable.sample return."""
from typing import Any, NamedTuple

import numpy as np

__all__ = ["SampleInfo", "ReplaySample"]


class SampleInfo(NamedTuple):
  """Metadata of a sampled item (scalars, or arrays of length B from sample_batch).

  Attributes:
    key: item key (uint64).
    probability: probability with which it was picked (float64).
    table_size: items in the table when sampled, before a max_times_sampled removal (int64).
    priority: priority of the item (float64).
    times_sampled: times sampled including this sample (int32).
  """
  key: Any
  probability: Any
  table_size: Any
  priority: Any
  times_sampled: Any

  @classmethod
  def tf_dtypes(cls):
    """dtypes of the fields (tf.DTypes when TensorFlow is importable, else numpy dtypes)."""
    names = ("uint64", "float64", "int64", "float64", "int32")
    try:
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
      return cls(*[getattr(tf, n) for n in names])
    except ImportError:
      return cls(*[np.dtype(n) for n in names])

  @classmethod
  def tf_shapes(cls):
    return cls(*[() for _ in cls._fields])

  @classmethod
  def zeros(cls):
    return cls(*[np.zeros((), np.dtype(n)) for n in
                 ("uint64", "float64", "int64", "float64", "int32")])


class ReplaySample(NamedTuple):
  """A sampled item: `info` (SampleInfo) and `data` (columns, flat list or signature nest)."""
  info: SampleInfo
  data: Any
