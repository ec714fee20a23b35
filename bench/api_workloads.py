"""W8: Reverb client calls with their default arguments (what a drop-in user meets first), run
unchanged on reverb_shm (bench/shm_workloads.py) and on dm-reverb (bench/peer_reverb.py): the
same function bodies, given each library's module and a server factory.

Variants (items/s of the call named):
  sample_timesteps   Client.sample(table, num_samples=256): emit_timesteps=True (Reverb's default)
  sample_flat        Client.sample(table, 256, emit_timesteps=False)
  sample_signature   Client.sample(table, 256, unpack_as_table_signature=True)
  insert_one_table   Client.insert(step, priorities={table: 1.0})
  insert_two_tables  Client.insert(step, priorities={table: 1.0, table2: 1.0})
  mutate_dict        Client.mutate_priorities(table, updates={key: priority} of 256 sampled keys)
  writer_two_tables  TrajectoryWriter.append + create_item of the last step in two tables
  frames_sample      Client.sample(frames, 64) of 84x84x4 uint8 frames (emit_timesteps default)
Tables hold 1-step items with a time dimension (what Client.insert makes), filled by a
TrajectoryWriter on both libraries.
"""
import numpy as np
from _timing import FRAME_BYTES, FRAME_SHAPE, row, timed

W8_ITEMS = 20_000        # items of the sampled tables (both libraries fill them alike)
W8_FRAMES = 2_000


def _step(i):
  return {"obs": np.full(8, i, np.float32), "action": np.int64(i), "reward": np.float32(i)}


def signature(tf):
  """The tables' signature (1-step items with a time dimension) in TensorSpecs of `tf`."""
  return {"obs": tf.TensorSpec([1, 8], tf.float32), "action": tf.TensorSpec([1], tf.int64),
          "reward": tf.TensorSpec([1], tf.float32)}


def frame_signature(tf):
  return {"frame": tf.TensorSpec((1,) + FRAME_SHAPE, tf.uint8)}


def tables(reverb, sig, frame_sig, items, frames):
  """The tables W8 uses: 'a' and 'b' (uniform, items), 'frames' (uniform, frames)."""
  def table(name, size, s):
    return reverb.Table(name, sampler=reverb.selectors.Uniform(),
                        remover=reverb.selectors.Fifo(), max_size=size,
                        rate_limiter=reverb.rate_limiters.MinSize(1), signature=s)
  return [table("a", items, sig), table("b", items, sig), table("frames", frames, frame_sig)]


def _fill(client, table, n, make):
  with client.trajectory_writer(num_keep_alive_refs=1) as w:
    for i in range(n):
      w.append(make(i))
      w.create_item(table, 1.0, {k: v[-1:] for k, v in w.history.items()})
      if i % 256 == 255:
        w.flush()


def w8(args, client, items=W8_ITEMS, frames=W8_FRAMES):
  """The rows of every variant, on a client of a server holding tables(...)."""
  dur, warm = args.duration, args.warmup
  _fill(client, "a", items, _step)
  frame = np.random.default_rng(0).integers(0, 256, FRAME_SHAPE, dtype=np.uint8)
  _fill(client, "frames", frames, lambda i: {"frame": frame})
  rows = []

  def sampler(**kw):
    def op():
      return sum(1 for _ in client.sample("a", num_samples=256, **kw))
    return op
  rows.append(row("W8", "sample_timesteps", "Client.sample(table, num_samples=256)",
                  timed(sampler(), dur, warm)[0], table_items=items))
  rows.append(row("W8", "sample_flat", "Client.sample(table, 256, emit_timesteps=False)",
                  timed(sampler(emit_timesteps=False), dur, warm)[0], table_items=items))
  rows.append(row("W8", "sample_signature", "Client.sample(table, 256, "
                  "unpack_as_table_signature=True)",
                  timed(sampler(unpack_as_table_signature=True), dur, warm)[0],
                  table_items=items))
  data = _step(1)

  def insert(priorities):
    def op():
      for _ in range(20):
        client.insert(data, priorities)
      return 20
    return op
  rows.append(row("W8", "insert_one_table", "Client.insert(step, {table: 1.0})",
                  timed(insert({"b": 1.0}), dur, warm)[0]))
  rows.append(row("W8", "insert_two_tables", "Client.insert(step, {table: 1.0, table2: 1.0})",
                  timed(insert({"a": 1.0, "b": 1.0}), dur, warm)[0]))
  keys = [s.info.key for s in client.sample("a", 256, emit_timesteps=False)]
  rng = np.random.default_rng(0)
  updates = [dict(zip(keys, (rng.random(256) + 0.1).tolist())) for _ in range(4)]
  turn = [0]

  def mutate():
    turn[0] += 1
    client.mutate_priorities("a", updates[turn[0] % 4])
    return 256
  rows.append(row("W8", "mutate_dict", "Client.mutate_priorities(table, {key: priority} x 256)",
                  timed(mutate, dur, warm)[0]))
  with client.trajectory_writer(num_keep_alive_refs=1) as w:
    steps = [_step(i) for i in range(100)]

    def writer():
      for s in steps:
        w.append(s)
        item = {k: v[-1:] for k, v in w.history.items()}
        w.create_item("a", 1.0, item)
        w.create_item("b", 1.0, item)
      w.flush()
      return 100
    rows.append(row("W8", "writer_two_tables", "TrajectoryWriter append + create_item in two "
                    "tables (1 step each), flush per 100", timed(writer, dur, warm)[0]))

  def frames_op():
    return sum(1 for _ in client.sample("frames", num_samples=64))
  rows.append(row("W8", "frames_sample", "Client.sample(frames, 64) of 84x84x4 uint8",
                  timed(frames_op, dur, warm)[0], FRAME_BYTES, table_items=frames))
  return rows


VARIANTS = ("sample_timesteps", "sample_flat", "sample_signature", "insert_one_table",
            "insert_two_tables", "mutate_dict", "writer_two_tables", "frames_sample")
