"""reverb_shm side of the benchmark suite (run with the project's Python).

    python bench/shm_workloads.py --workloads W1 W2 W3 W4 W5 W6 scaling metadata

Prints one `RESULTS [json rows]` line. Variant "reverb_api" makes the same Reverb client calls
as bench/peer_reverb.py (what a drop-in user gets); "fastest" uses reverb_shm's fastest path
for the workload (batched writer calls, SharedTable batch sampling into caller buffers).
"""
import contextlib
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import reverb_shm as reverb  # noqa: E402
from _timing import (FRAME_BYTES, FRAME_SHAPE, pair_items_op, row, run_main,  # noqa: E402
                     timed)

TABLE = "bench"
STEP_BYTES = 8 * 4 + 8 + 4   # payload of one step


def step(i):
  return {"obs": np.full(8, i, np.float32), "action": np.int64(i), "reward": np.float32(i)}


def steps(n, start=0):
  """n steps with a leading batch/time dimension."""
  v = np.arange(start, start + n)
  return {"obs": np.repeat(v[:, None], 8, axis=1).astype(np.float32),
          "action": v.astype(np.int64), "reward": v.astype(np.float32)}


# REVERB_SHM_BENCH_ARENA=grown (run_all's G1): servers start with the default 8 MiB arena and
# grow while the workloads fill them, within the same max_bytes, instead of reserving it all.
GROWN = os.environ.get("REVERB_SHM_BENCH_ARENA") == "grown"


def server(sampler, max_size, item_bytes=STEP_BYTES, limiter=None):
  table = reverb.Table(TABLE, sampler=sampler, remover=reverb.selectors.Fifo(), max_size=max_size,
                       rate_limiter=limiter or reverb.rate_limiters.MinSize(1))
  presized = max(256 << 20, 2 * max_size * (item_bytes + 256))
  # room for the table's metadata (records, index, sum tree: ~120 bytes per item) besides the arena
  max_bytes = presized + (256 << 20) + 160 * max_size
  if GROWN:
    srv = reverb.Server([table], max_bytes=max_bytes)
    _grow(srv.segment, presized)
    return srv
  return reverb.Server([table], arena_bytes=presized, max_bytes=max_bytes)


def _grow(seg, nbytes):
  """Grows the arena of an 8 MiB-start server to `nbytes` by extents (chunks held, then freed)."""
  from reverb_shm._internal import chunks  # pylint: disable=import-outside-toplevel
  held = []
  while seg.info()["arena_size"] < nbytes:
    held.append(chunks.alloc_chunk(seg, np.uint8, (1 << 20,), 16))
  for chunk in held:
    chunk.release()


def _table_bytes(info) -> int:
  """Bytes of a segment beyond its arena and pin logs: header + the tables' metadata."""
  return info["reserved_bytes"] - info["arena_size"] - info["pins_reserved"]


def fill(table, n, block=100_000):
  for s in range(0, n, block):
    b = min(block, n - s)
    table.insert(steps(b, s), np.random.default_rng(s).random(b) + 0.1)


def w1(args):
  # (at ~400k inserts/s the table reaches max_size within a run: Client.insert items append to
  # open chunks, ~48 B of arena each, so the default sizing holds max_size of them)
  with server(reverb.selectors.Uniform(), 1_000_000) as srv:
    client = srv.localhost_client()
    table = srv.shared_table(TABLE)
    data = step(1)

    def api():
      for _ in range(100):
        client.insert(data, {TABLE: 1.0})
      return 100
    rows = [row("W1", "reverb_api", "Client.insert", timed(api, args.duration, args.warmup)[0])]
    inserter = table.step_inserter(capacity=256)

    def fastest():
      for _ in range(100):
        inserter.insert(data, 1.0)
      return 100
    rows.append(row("W1", "fastest", "SharedTable.step_inserter(256).insert (1 step per call, "
                    "visible at each flush of 256)", timed(fastest, args.duration, args.warmup)[0]))
    inserter.close()
    one = steps(1)

    def unbuffered():
      for _ in range(100):
        table.insert(one, 1.0)
      return 100
    rows.append(row("W1", "insert_1step", "SharedTable.insert (1 step per call, visible at once)",
                    timed(unbuffered, args.duration, args.warmup)[0]))
  return rows


def w2(args):
  rows = []
  with server(reverb.selectors.Uniform(), 1_000_000) as srv:
    client = srv.localhost_client()
    writer = client.trajectory_writer(num_keep_alive_refs=2)
    api = pair_items_op(writer, TABLE, [step(i) for i in range(100)])
    rows.append(row("W2", "reverb_api", "TrajectoryWriter append + create_item(last 2)",
                    timed(api, args.duration, args.warmup)[0]))
    writer.end_episode()
    writer.close()

    writer = client.trajectory_writer(num_keep_alive_refs=128)
    block = steps(100)
    prios = np.ones(99)
    starts = np.arange(-100, -1)    # item t covers steps t and t + 1 of the block
    blocks = [0]

    def fastest():   # episodes of 1000 steps, as pair_items_op's
      writer.extend(block)
      writer.create_window_items(TABLE, prios, starts, 2)
      blocks[0] += 1
      if blocks[0] % 10 == 0:
        writer.end_episode()
      return 99
    rows.append(row("W2", "fastest", "TrajectoryWriter extend(100) + create_window_items(99 "
                    "windows of 2 steps)", timed(fastest, args.duration, args.warmup)[0]))
    writer.close()
  return rows


def sampling(args, workload, sampler, update):
  n = args.items
  rows = []
  with server(sampler, n) as srv:
    table = srv.shared_table(TABLE)
    client = srv.localhost_client()
    fill(table, n)
    rng = np.random.default_rng(0)

    def api():
      keys = [s.info.key for s in client.sample(TABLE, 256, emit_timesteps=False)]
      if update:
        client.mutate_priorities(TABLE, dict(zip(keys, (rng.random(len(keys)) + 0.1).tolist())))
      return len(keys)
    rows.append(row(workload, "reverb_api", "Client.sample(256)" +
                    (" + mutate_priorities" if update else ""),
                    timed(api, args.duration, args.warmup)[0], table_items=n))
    rows.append(row(workload, "fastest", FASTEST_API + (" + update_priorities" if update else ""),
                    timed(fastest_op(table, update), args.duration, args.warmup)[0],
                    table_items=n))
  return rows


FASTEST_API = "SharedTable.sample_batch(256, out=)"


def fastest_op(table, update):
  """W3/W4's fastest loop body: a batch of 256 into fixed buffers (+ new priorities for them)."""
  out = [np.empty(256, np.int64), np.empty((256, 8), np.float32), np.empty(256, np.float32)]  # sorted keys
  rng = np.random.default_rng(0)

  def op():
    keys = table.sample_batch(256, out=out).info.key
    if update:
      table.update_priorities(keys, rng.random(len(keys)) + 0.1)
    return len(keys)
  return op


def w5(args):
  rows = []
  frame = np.random.default_rng(0).integers(0, 256, FRAME_SHAPE, dtype=np.uint8)
  with server(reverb.selectors.Uniform(), args.frames, FRAME_BYTES) as srv:
    client, table = srv.localhost_client(), srv.shared_table(TABLE)

    def api():
      for _ in range(16):
        client.insert({"frame": frame}, {TABLE: 1.0})
      return 16
    rows.append(row("W5_insert", "reverb_api", "Client.insert (1 frame per call)",
                    timed(api, args.duration, args.warmup)[0], FRAME_BYTES))
    one = {"frame": frame[None]}

    def fastest():
      for _ in range(16):
        table.insert(one, 1.0)
      return 16
    rows.append(row("W5_insert", "fastest", "SharedTable.insert (1 frame per call)",
                    timed(fastest, args.duration, args.warmup)[0], FRAME_BYTES))
    while table.size < args.frames:
      fastest()
    out = [np.empty((64,) + FRAME_SHAPE, np.uint8)]
    rows.append(row("W5_sample", "fastest", "SharedTable.sample_batch(64, out=)",
                    timed(lambda: len(table.sample_batch(64, out=out).info.key), args.duration,
                          args.warmup)[0], FRAME_BYTES))
  src = np.ones(64 << 20, np.uint8)
  dst = np.empty_like(src)

  def copy():
    np.copyto(dst, src)
    return src.nbytes / FRAME_BYTES
  rows.append(row("W5_copy", "numpy", "np.copyto of 64 MiB (memory bandwidth reference)",
                  timed(copy, args.duration, args.warmup)[0], FRAME_BYTES))
  return rows


# ---- W6: 2 writer processes + 1 sampler process under SampleToInsertRatio
W6_BATCH = 64


def _w6_writer(name, batches, start):
  table = reverb.SharedTable.attach(name)
  data = steps(W6_BATCH)
  start.wait()
  for _ in range(batches):
    table.insert(data, 1.0)


def _w6_sampler(name, samples, start):
  table = reverb.SharedTable.attach(name)
  out = [np.empty(W6_BATCH, np.int64), np.empty((W6_BATCH, 8), np.float32),
         np.empty(W6_BATCH, np.float32)]
  start.wait()
  got = 0
  while got < samples:
    got += len(table.sample_batch(min(W6_BATCH, samples - got), out=out).info.key)


def w6(args):
  batches = max(50, int(args.duration * 2000))  # per writer
  total = 2 * batches * W6_BATCH
  limiter = reverb.rate_limiters.SampleToInsertRatio(1.0, 1, 4096)
  rows = []
  with server(reverb.selectors.Uniform(), 100_000, limiter=limiter) as srv:
    name = srv.shared_table_name(TABLE)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(4)
    procs = [ctx.Process(target=_w6_writer, args=(name, batches, start)) for _ in range(2)]
    procs.append(ctx.Process(target=_w6_sampler, args=(name, total, start)))
    for p in procs:
      p.start()
    start.wait(timeout=120)
    t0 = time.perf_counter()
    for p in procs:
      p.join(timeout=600)
    seconds = time.perf_counter() - t0
    if any(p.exitcode != 0 for p in procs):
      raise RuntimeError(f"W6 process failed: exit codes {[p.exitcode for p in procs]}")
    rows.append(row("W6", "cross_process", "2 writer + 1 sampler processes, insert(64) / "
                    "sample_batch(64), SampleToInsertRatio(1)", total / seconds))
  with server(reverb.selectors.Uniform(), 100_000, limiter=limiter) as srv:
    table = srv.shared_table(TABLE)
    data = steps(W6_BATCH)
    out = [np.empty(W6_BATCH, np.int64), np.empty((W6_BATCH, 8), np.float32),
           np.empty(W6_BATCH, np.float32)]
    t0 = time.perf_counter()
    for _ in range(2 * batches):
      table.insert(data, 1.0)
      got = 0
      while got < W6_BATCH:
        got += len(table.sample_batch(W6_BATCH - got, out=out).info.key)
    rows.append(row("W6", "in_process", "the same inserts and samples in one process",
                    total / (time.perf_counter() - t0)))
  return rows


SCALING_TURNS = 10


def scaling(args):
  """W4 (fastest) at every size of args.scales, all tables alive at once and measured in turns
  (SCALING_TURNS slices of the duration each, median), so that a change of machine load during
  the run weighs on every size alike instead of on whichever size ran at that moment."""
  with contextlib.ExitStack() as stack:
    ops = {}
    for n in args.scales:
      table = stack.enter_context(server(reverb.selectors.Prioritized(0.6), n)).shared_table(TABLE)
      fill(table, n)
      ops[n] = fastest_op(table, True)
      timed(ops[n], args.warmup, 0)   # warm-up (result unused)
    rates = {n: [] for n in ops}
    for _ in range(SCALING_TURNS):
      for n, op in ops.items():
        rates[n].append(timed(op, args.duration / SCALING_TURNS, 0)[0])
  rows = []
  for n, r in rates.items():
    rate = float(np.median(r))
    rows.append(row(f"scale_{n}", "fastest", FASTEST_API + " + update_priorities", rate,
                    table_items=n, us_per_item=1e6 / rate))
  return rows


def metadata(args):
  """Bytes per item beyond payload: table structures (per max_size) + arena blocks per item."""
  n = 200_000
  small = reverb.Server([reverb.Table(TABLE, reverb.selectors.Prioritized(0.6),
                                      reverb.selectors.Fifo(), 1000,
                                      reverb.rate_limiters.MinSize(1))], arena_bytes=256 << 20)
  base = _table_bytes(small._segment.info())
  small.stop()
  with server(reverb.selectors.Prioritized(0.6), n) as srv:
    seg = srv._segment
    table_bytes = (_table_bytes(seg.info()) - base) / (n - 1000)
    used0 = seg.info()["arena_used"]
    fill(srv.shared_table(TABLE), n, block=10_000)
    arena_bytes = (seg.info()["arena_used"] - used0) / n - STEP_BYTES
    rss = attach_rss(srv.shared_table_name(TABLE))
    segment_bytes = seg.info()["reserved_bytes"]
  with server(reverb.selectors.Prioritized(0.6), n) as srv:   # the drop-in user's per-step path
    seg, client, data = srv._segment, srv.localhost_client(), step(1)
    client.insert(data, {TABLE: 1.0})
    used0 = seg.info()["arena_used"]
    for _ in range(n):
      client.insert(data, {TABLE: 1.0})
    api_arena_bytes = (seg.info()["arena_used"] - used0) / n - STEP_BYTES
  return [row("metadata", "fastest", "SharedTable.insert(10k) of 1-step items", 0,
              table_bytes_per_item=table_bytes, arena_bytes_per_item=arena_bytes,
              bytes_per_item=table_bytes + arena_bytes, segment_bytes=segment_bytes, **rss),
          row("metadata", "reverb_api", "Client.insert of 1-step items (one call per step)", 0,
              table_bytes_per_item=table_bytes, arena_bytes_per_item=api_arena_bytes,
              bytes_per_item=table_bytes + api_arena_bytes)]


def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _attach_rss_child(name, conn):
  before = _rss_bytes()
  table = reverb.SharedTable.attach(name)
  table.size  # pylint: disable=pointless-statement
  attached = _rss_bytes()
  out = [np.empty(256, np.int64), np.empty((256, 8), np.float32), np.empty(256, np.float32)]
  for _ in range(10):
    table.sample_batch(256, out=out)
  conn.send((attached - before, _rss_bytes() - attached))


def attach_rss(name) -> dict:
  """RSS growth (bytes) of a fresh process that attaches to the table, and of its next 10
  sample_batch(256) calls: it maps the whole segment but should pay only for pages it touches."""
  ctx = multiprocessing.get_context("spawn")
  parent, child = ctx.Pipe()
  proc = ctx.Process(target=_attach_rss_child, args=(name, child))
  proc.start()
  if not parent.poll(120):
    proc.kill()
    raise RuntimeError("attach_rss: the attaching process did not answer in 120 s")
  attach, sampling = parent.recv()
  proc.join(60)
  return {"attach_rss_bytes": attach, "sample_rss_bytes": sampling}


T1_BATCH = 256
T1_IN_FLIGHT = 512


def t1(args):
  """TrajectoryDataset.from_table_signature(...).batch(256) items/s, uniform and prioritized
  tables of args.items single-step items (as bench/peer_reverb.py's t1)."""
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  except ImportError:
    return []   # (the ratio rows then say n/a)
  sig = {"obs": tf.TensorSpec([8], tf.float32), "action": tf.TensorSpec([], tf.int64),
         "reward": tf.TensorSpec([], tf.float32)}
  n = args.items
  tables = [reverb.Table(name, sampler=sampler, remover=reverb.selectors.Fifo(), max_size=n,
                         rate_limiter=reverb.rate_limiters.MinSize(1), signature=sig)
            for name, sampler in (("uniform", reverb.selectors.Uniform()),
                                  ("prioritized", reverb.selectors.Prioritized(0.6)))]
  rows = []
  with reverb.Server(tables, arena_bytes=max(256 << 20, 4 * n * (STEP_BYTES + 256))) as srv:
    for name in ("uniform", "prioritized"):
      table = srv.shared_table(name)
      for s in range(0, n, 100_000):
        b = min(100_000, n - s)
        table.insert(steps(b, s), np.random.default_rng(s).random(b) + 0.1)
      it = iter(reverb.TrajectoryDataset.from_table_signature(
          f"localhost:{srv.port}", name, max_in_flight_samples_per_worker=T1_IN_FLIGHT
      ).batch(T1_BATCH))

      def op():
        return len(next(it).info.key.numpy())
      rows.append(row("T1", name, f"TrajectoryDataset.batch({T1_BATCH})",
                      timed(op, args.duration, args.warmup)[0], table_items=n))
      del it
  return rows


WORKLOADS = {
    "W1": w1, "W2": w2,
    "W3": lambda a: sampling(a, "W3", reverb.selectors.Uniform(), False),
    "W4": lambda a: sampling(a, "W4", reverb.selectors.Prioritized(0.6), True),
    "W5": w5, "W6": w6, "scaling": scaling, "metadata": metadata, "T1": t1,
}




if __name__ == "__main__":
  run_main(__doc__, WORKLOADS)
