"""dm-reverb 0.14 side of the benchmark suite (run with a venv that has dm-reverb + tensorflow).

    /tmp/refvenv/bin/python bench/peer_reverb.py --workloads W1 W2 W3 W4 W5

Prints one `RESULTS [json rows]` line. Each workload is measured twice where the two differ:
variant "reverb_api" uses the same Reverb client calls a drop-in user of reverb_shm makes
(Client.insert, Client.sample, Client.mutate_priorities) and variant "fastest" uses Reverb's
fastest path (TrajectoryWriter for writing, TrajectoryDataset for sampling).
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import reverb  # noqa: E402
import tensorflow as tf  # noqa: E402

from _timing import (FRAME_BYTES, FRAME_SHAPE, pair_items_op, row, run_main,  # noqa: E402
                     timed)

TABLE = "bench"
STEP_SIG = {"obs": tf.TensorSpec([8], tf.float32), "action": tf.TensorSpec([], tf.int64),
            "reward": tf.TensorSpec([], tf.float32)}


def step(i):
  return {"obs": np.full(8, i, np.float32), "action": np.int64(i), "reward": np.float32(i)}


def server(sampler, max_size, signature=STEP_SIG):
  table = reverb.Table(TABLE, sampler=sampler, remover=reverb.selectors.Fifo(), max_size=max_size,
                       rate_limiter=reverb.rate_limiters.MinSize(1), signature=signature)
  srv = reverb.Server([table])
  return srv, reverb.Client(f"localhost:{srv.port}")


def fill(client, n, make=step):
  """n single-step items through one writer (Reverb's fastest write path)."""
  with client.trajectory_writer(num_keep_alive_refs=1) as w:
    for i in range(n):
      w.append(make(i))
      w.create_item(TABLE, 1.0 + (i % 7), {k: v[-1] for k, v in w.history.items()})
      if i % 256 == 255:
        w.flush()


def w1(args):
  srv, client = server(reverb.selectors.Uniform(), 1_000_000)
  data = step(1)

  def api():
    for _ in range(20):
      client.insert(data, {TABLE: 1.0})
    return 20

  rows = [row("W1", "reverb_api", "Client.insert", timed(api, args.duration, args.warmup)[0])]
  with client.trajectory_writer(num_keep_alive_refs=1) as w:
    def fastest():
      for _ in range(100):
        w.append(data)
        w.create_item(TABLE, 1.0, {k: v[-1] for k, v in w.history.items()})
      w.flush()
      return 100
    rows.append(row("W1", "fastest", "TrajectoryWriter append+create_item, flush/100",
                    timed(fastest, args.duration, args.warmup)[0]))
  srv.stop()
  return rows


def w2(args):
  sig = {k: tf.TensorSpec([2] + s.shape.as_list(), s.dtype) for k, s in STEP_SIG.items()}
  srv, client = server(reverb.selectors.Uniform(), 1_000_000, sig)
  with client.trajectory_writer(num_keep_alive_refs=2) as w:
    op = pair_items_op(w, TABLE, [step(i) for i in range(100)])
    rate = timed(op, args.duration, args.warmup)[0]
  srv.stop()
  # The same Reverb calls are Reverb's fastest path here: one row serves both variants.
  return [row("W2", v, "TrajectoryWriter append + create_item(last 2)", rate)
          for v in ("reverb_api", "fastest")]


def sampling(args, workload, sampler, update):
  n = min(args.items, args.peer_items)
  srv, client = server(sampler, n)
  fill(client, n)
  rng = np.random.default_rng(0)

  def api():
    keys = [s.info.key for s in client.sample(TABLE, 256, emit_timesteps=False)]
    if update:
      client.mutate_priorities(TABLE, dict(zip(keys, (rng.random(len(keys)) + 0.1).tolist())))
    return len(keys)

  rows = [row(workload, "reverb_api", "Client.sample(256)" + (" + mutate_priorities" if update
                                                                 else ""),
              timed(api, args.duration, args.warmup)[0], table_items=n)]
  ds = reverb.TrajectoryDataset.from_table_signature(
      f"localhost:{srv.port}", TABLE, max_in_flight_samples_per_worker=512).batch(256)
  it = iter(ds)

  def fastest():
    keys = next(it).info.key.numpy()
    if update:
      client.mutate_priorities(TABLE, dict(zip(keys.tolist(),
                                               (rng.random(len(keys)) + 0.1).tolist())))
    return len(keys)

  rows.append(row(workload, "fastest", "TrajectoryDataset.batch(256)" +
                  (" + mutate_priorities" if update else ""),
                  timed(fastest, args.duration, args.warmup)[0], table_items=n))
  srv.stop()
  return rows


def w5(args):
  sig = {"frame": tf.TensorSpec(FRAME_SHAPE, tf.uint8)}
  srv, client = server(reverb.selectors.Uniform(), args.frames, sig)
  frame = np.random.default_rng(0).integers(0, 256, FRAME_SHAPE, dtype=np.uint8)
  with client.trajectory_writer(num_keep_alive_refs=1) as w:
    def ins():
      for _ in range(16):
        w.append({"frame": frame})
        w.create_item(TABLE, 1.0, {"frame": w.history["frame"][-1]})
      w.flush()
      return 16
    rows = [row("W5_insert", "fastest", "TrajectoryWriter, 1 frame per item",
                timed(ins, args.duration, args.warmup)[0], FRAME_BYTES)]
    while client.server_info()[TABLE].current_size < args.frames:
      ins()
  it = iter(reverb.TrajectoryDataset.from_table_signature(
      f"localhost:{srv.port}", TABLE, max_in_flight_samples_per_worker=128).batch(64))
  rows.append(row("W5_sample", "fastest", "TrajectoryDataset.batch(64)",
                  timed(lambda: len(next(it).info.key), args.duration, args.warmup)[0],
                  FRAME_BYTES))
  srv.stop()
  return rows


def t1(args):
  """TrajectoryDataset.from_table_signature(...).batch(256) items/s on a uniform and a
  prioritized table of min(args.items, args.t1_items) single-step items, filled together (one
  writer, each step an item of both tables)."""
  n = min(args.items, args.t1_items)
  tables = [reverb.Table(name, sampler=sampler, remover=reverb.selectors.Fifo(), max_size=n,
                         rate_limiter=reverb.rate_limiters.MinSize(1), signature=STEP_SIG)
            for name, sampler in (("uniform", reverb.selectors.Uniform()),
                                  ("prioritized", reverb.selectors.Prioritized(0.6)))]
  srv = reverb.Server(tables)
  client = reverb.Client(f"localhost:{srv.port}")
  with client.trajectory_writer(num_keep_alive_refs=1) as w:
    for i in range(n):
      w.append(step(i))
      item = {k: v[-1] for k, v in w.history.items()}
      w.create_item("uniform", 1.0, item)
      w.create_item("prioritized", 1.0 + (i % 7), item)
      if i % 256 == 255:
        w.flush()
  rows = []
  for name in ("uniform", "prioritized"):
    it = iter(reverb.TrajectoryDataset.from_table_signature(
        f"localhost:{srv.port}", name, max_in_flight_samples_per_worker=512).batch(256))

    def op():
      return len(next(it).info.key.numpy())
    rows.append(row("T1", name, "TrajectoryDataset.batch(256)",
                    timed(op, args.duration, args.warmup)[0], table_items=n))
    del it
  srv.stop()
  return rows


L1_SIG = {"obs": tf.TensorSpec([84], tf.float32), "action": tf.TensorSpec([], tf.int64),
          "reward": tf.TensorSpec([], tf.float32)}


def l1(args):
  """The learner loop of bench/learner_workloads.py: prioritized (0.6) batches of 256 through
  TrajectoryDataset + as_numpy_iterator, and a mutate_priorities of the batch per iteration."""
  n = min(args.items, args.peer_items)
  srv, client = server(reverb.selectors.Prioritized(0.6), n, L1_SIG)
  fill(client, n, lambda i: {"obs": np.full(84, i, np.float32), "action": np.int64(i),
                             "reward": np.float32(i)})
  rng = np.random.default_rng(0)
  it = reverb.TrajectoryDataset.from_table_signature(
      f"localhost:{srv.port}", TABLE, max_in_flight_samples_per_worker=512).batch(
          256).as_numpy_iterator()
  new_priorities = (rng.random(256) + 0.1).tolist()

  def loop():
    sample = next(it)
    client.mutate_priorities(TABLE, dict(zip(sample.info.key.tolist(), new_priorities)))
    return len(sample.info.key)

  rows = [row("L1", "dataset", "TrajectoryDataset.batch(256).as_numpy_iterator + "
              "mutate_priorities", timed(loop, args.duration, args.warmup)[0], 84 * 4 + 12,
              table_items=n)]
  srv.stop()
  return rows


def w8(args):
  """W8 (bench/api_workloads.py): Reverb client calls with default arguments."""
  import api_workloads as api  # pylint: disable=import-outside-toplevel
  srv = reverb.Server(api.tables(reverb, api.signature(tf), api.frame_signature(tf),
                                 api.W8_ITEMS, api.W8_FRAMES))
  try:
    return api.w8(args, reverb.Client(f"localhost:{srv.port}"))
  finally:
    srv.stop()


WORKLOADS = {
    "L1": l1,
    "W1": w1, "W2": w2,
    "W3": lambda a: sampling(a, "W3", reverb.selectors.Uniform(), False),
    "W4": lambda a: sampling(a, "W4", reverb.selectors.Prioritized(0.6), True),
    "W5": w5, "T1": t1, "W8": w8,
}


def _peer_args(p):
  p.add_argument("--peer-items", type=int, default=200_000,
                 help="cap on Reverb's sampled table size (filling runs at ~8k items/s)")
  p.add_argument("--t1-items", type=int, default=1_000_000,
                 help="cap on the table size of T1 (TrajectoryDataset; filled at ~8k steps/s)")


if __name__ == "__main__":
  run_main(__doc__, WORKLOADS, _peer_args)
