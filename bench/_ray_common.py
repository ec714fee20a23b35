"""What both sides of workload R1 share (stdlib + Ray only: the TorchRL peer venv imports it).

R1 runs on a local 3-node Ray cluster (reverb_shm/ray/local_cluster.py, loaded by file path so
that the peer venv needs no reverb_shm): the head node (where the driver, the learner, runs) and
worker nodes nodeA and nodeB, each with a private /dev/shm. Writers are Ray actors, one per
worker node.
"""
import importlib.util
import os
import pathlib
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
WRITER_NODES = ("nodeA", "nodeB")
SAMPLE_BATCH = 256
FILL_PER_NODE = 5_000


def local_cluster_module():
  spec = importlib.util.spec_from_file_location(
      "_rvray_local_cluster", REPO / "reverb_shm" / "ray" / "local_cluster.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def start_cluster():
  """(LocalRayCluster, address): head + WRITER_NODES, ray.init done."""
  import ray  # pylint: disable=g-import-not-at-top
  mod = local_cluster_module()
  cluster = mod.LocalRayCluster(num_cpus=1, object_store_mb=100, shm_mb=512)
  try:
    cluster.start()
    for label in WRITER_NODES:
      cluster.add_node(label)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
  except BaseException:
    ray.shutdown()
    cluster.shutdown()   # (no node process outlives a failed start)
    raise
  return cluster


def transition(i: int) -> dict:
  """A CartPole-sized transition as numpy arrays (obs 4 x float32, action, reward, done)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  return {"obs": np.full(4, i, np.float32), "action": np.int64(i % 2),
          "reward": np.float32(1.0), "next_obs": np.full(4, i + 1, np.float32),
          "done": np.bool_(False)}


def run_writers(writers, duration: float, warmup: float) -> float:
  """Starts every writer actor's run(start_at, warmup, duration) together; items/s in total."""
  import ray  # pylint: disable=g-import-not-at-top
  start_at = time.time() + 2.0
  counts = ray.get([w.run.remote(start_at, warmup, duration) for w in writers],
                   timeout=duration + warmup + 300)
  return sum(n / s for n, s in counts)


def writer_loop(insert_one, start_at: float, warmup: float, duration: float):
  """The body of a writer actor: (items, seconds) of the measured phase."""
  while time.time() < start_at:
    time.sleep(0.01)
  end = time.perf_counter() + warmup
  i = 0
  while time.perf_counter() < end:
    insert_one(i)
    i += 1
  n = 0
  start = now = time.perf_counter()
  end = start + duration
  while now < end:
    for _ in range(16):
      insert_one(i + n)
      n += 1
    now = time.perf_counter()
  return n, now - start


def on_node(label: str) -> dict:
  return {"resources": {label: 0.01}, "num_cpus": 0}


def env_check() -> None:
  os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
