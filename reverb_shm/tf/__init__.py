"""Reverb's TensorFlow surface (the `tf` extra): TrajectoryDataset, TimestepDataset, TFClient.

Only this subpackage imports TensorFlow; `import reverb_shm` never does. The names are also
reachable as `reverb_shm.TrajectoryDataset` etc., which import this subpackage on first use.

Raises:
  ImportError: TensorFlow is not installed (`pip install reverb_shm[tf]`).
"""
try:
  import tensorflow as _tf  # noqa: F401  # pylint: disable=unused-import
except ImportError as e:
  raise ImportError("reverb_shm's TensorFlow datasets and TFClient need TensorFlow: "
                    "pip install reverb_shm[tf]") from e

from reverb_shm.tf.tf_client import TFClient
from reverb_shm.tf.timestep_dataset import TimestepDataset
from reverb_shm.tf.trajectory_dataset import TrajectoryDataset

__all__ = ["TFClient", "TimestepDataset", "TrajectoryDataset"]
