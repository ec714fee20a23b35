"""reverb_shm: experience replay in POSIX shared memory with the Python API of Reverb.

`import reverb_shm as reverb` runs Reverb programs; tables live in shared memory on one host.
"""
from reverb_shm import (
    checkpointers,
    errors,
    item_selectors,
    platform,
    rate_limiters,
    selectors,
    structured_writer,
)
from reverb_shm import structured_writer as structured
from reverb_shm.client import Client
from reverb_shm.errors import DeadlineExceededError, ReverbError
from reverb_shm.replay_sample import ReplaySample, SampleInfo
from reverb_shm.server import Server
from reverb_shm.shared_table import SharedTable
from reverb_shm.specs import BoundedTensorSpec, TensorSpec
from reverb_shm.structured_writer import StructuredWriter
from reverb_shm.table import Table, TableInfo
from reverb_shm.trajectory_writer import TrajectoryColumn, TrajectoryWriter
from reverb_shm.writer import Writer

__version__ = "0.1.0"

# Reverb's TensorFlow names, imported from reverb_shm.tf (the `tf` extra) on first use.
_TF_NAMES = frozenset(["TFClient", "TimestepDataset", "TrajectoryDataset"])


def __getattr__(name):
  if name in _TF_NAMES:
    try:
      from reverb_shm import tf as tf_lib  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(f"reverb_shm.{name} needs TensorFlow: pip install reverb_shm[tf] "
                        f"({e})") from e
    return getattr(tf_lib, name)
  raise AttributeError(f"module 'reverb_shm' has no attribute {name!r}")

__all__ = [
    "BoundedTensorSpec", "Client", "DeadlineExceededError", "ReplaySample", "ReverbError",
    "SampleInfo", "Server", "SharedTable", "StructuredWriter", "Table", "TableInfo", "TensorSpec",
    "TrajectoryColumn", "TrajectoryWriter", "Writer", "checkpointers", "errors", "item_selectors",
    "platform", "rate_limiters", "selectors", "structured", "structured_writer",
]
