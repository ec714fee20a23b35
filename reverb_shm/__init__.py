"""reverb_shm: experience replay in POSIX shared memory with the Python API of Reverb.

`import reverb_shm as reverb` runs Reverb programs; tables live in shared memory on one host.
"""
from reverb_shm import checkpointers
from reverb_shm import errors
from reverb_shm import item_selectors
from reverb_shm import platform
from reverb_shm import rate_limiters
from reverb_shm import selectors
from reverb_shm import structured_writer
from reverb_shm import structured_writer as structured
from reverb_shm.client import Client
from reverb_shm.errors import DeadlineExceededError
from reverb_shm.errors import ReverbError
from reverb_shm.replay_sample import ReplaySample
from reverb_shm.replay_sample import SampleInfo
from reverb_shm.server import Server
from reverb_shm.shared_table import SharedTable
from reverb_shm.specs import BoundedTensorSpec
from reverb_shm.specs import TensorSpec
from reverb_shm.structured_writer import StructuredWriter
from reverb_shm.table import Table
from reverb_shm.table import TableInfo
from reverb_shm.trajectory_writer import TrajectoryColumn
from reverb_shm.trajectory_writer import TrajectoryWriter
from reverb_shm.writer import Writer

__version__ = "0.1.0"

__all__ = [
    "BoundedTensorSpec", "Client", "DeadlineExceededError", "ReplaySample", "ReverbError",
    "SampleInfo", "Server", "SharedTable", "StructuredWriter", "Table", "TableInfo", "TensorSpec",
    "TrajectoryColumn", "TrajectoryWriter", "Writer", "checkpointers", "errors", "item_selectors",
    "platform", "rate_limiters", "selectors", "structured", "structured_writer",
]
