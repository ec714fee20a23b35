"""TimestepDataset: a tf.data.Dataset of the timesteps of sampled items, as Reverb's."""
from reverb_shm.tf import _dataset

__all__ = ["TimestepDataset"]


class TimestepDataset(_dataset.ReverbDataset):
  """A tf.data.Dataset that samples items and yields their timesteps one by one.

  Each sampled item of T timesteps gives T consecutive elements `ReplaySample(info, data)`:
  `info` (scalars, as TrajectoryDataset's) is the item's, repeated; `data` is one timestep of
  each column, nested as `dtypes`, of shape `shapes` (no time dim). No element marks where an
  item starts; `.batch(T)` of items of T steps rebuilds them.

  Arguments and errors are TrajectoryDataset's; in addition, iterating raises
  tf.errors.InvalidArgumentError for an item whose columns do not all have the same number of
  timesteps (a squeezed column has one, as in Reverb).
  """

  _TIMESTEPS = True
