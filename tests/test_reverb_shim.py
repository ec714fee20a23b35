"""tests/peers/reverb_shim: `import reverb` in a peer venv resolves to reverb_shm, and every
`reverb.X` submodule to the very module object of reverb_shm that plays it."""
import os
import pathlib
import subprocess
import sys

SHIM = pathlib.Path(__file__).resolve().parent / "peers" / "reverb_shim"

CODE = r"""
import sys
import reverb
import reverb_shm
assert reverb is reverb_shm and sys.modules["reverb"] is reverb_shm
import reverb.trajectory_writer
from reverb import rate_limiters, item_selectors, replay_sample
from reverb.platform import checkpointers_lib
import reverb.server as server
assert reverb.trajectory_writer is reverb_shm.trajectory_writer
assert sys.modules["reverb.trajectory_writer"] is reverb_shm.trajectory_writer
assert rate_limiters is reverb_shm.rate_limiters and server.Table is reverb_shm.Table
assert checkpointers_lib is reverb_shm.platform.checkpointers_lib
assert reverb_shm.trajectory_writer.__spec__.name == "reverb_shm.trajectory_writer"
assert replay_sample.ReplaySample is reverb_shm.ReplaySample
try:
  import reverb.no_such_module
except ModuleNotFoundError:
  pass
else:
  raise AssertionError("reverb.no_such_module imported")
try:
  import tensorflow  # noqa: F401
except ImportError:
  print("ok (no TensorFlow)")
else:
  from reverb.trajectory_dataset import TrajectoryDataset
  from reverb import tf_client
  assert TrajectoryDataset is reverb.TrajectoryDataset and tf_client.TFClient is reverb.TFClient
  print("ok")
"""


def test_import_reverb_resolves_to_reverb_shm():
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(SHIM), str(SHIM.parent.parent.parent), os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120,
                       env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.startswith("ok")
