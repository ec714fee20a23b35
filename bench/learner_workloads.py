"""reverb_shm learner side of the benchmark suite: workloads L1 and L2 (run with the project's
Python, which needs torch: pip install 'reverb_shm[torch]').

    python bench/learner_workloads.py --workloads L1 L2 --items 1000000

L1, the learner loop: prioritized sampling (exponent 0.6) of 256 items from a table of --items
items {'obs': float32[84], 'action': int64, 'reward': float32}, delivered as torch tensors by
reverb_shm.torch.TorchIterator (prefetch 4), plus a priority update of the batch, per
iteration. Variants: "iterator" (no training step), "jax_iterator" (the same loop on
reverb_shm.jax.JaxIterator on the CPU device, priorities a jax.Array; measured where JAX is
installed), "iterator_step_1ms" (a simulated training step of 1 ms that releases the GIL, as a
torch step does; "step_only_1ms" is that step alone, the floor of the loop), and "hand_loop"
(sample_batch(256, out=) + torch.from_numpy + update_priorities in the learner's thread, the
loop the iterator replaces).

L2, sequences: 64 windows of 80 steps per batch, sampled uniformly from a table holding --items
steps (episodes of 1000 steps, one window item per start position; steps {'obs': float32[8],
'action': int64, 'reward': float32}) as (64, 80, ...) torch tensors; and the same at each
--scales table size (cost per window against table size). At each of those sizes, "numpy_copy"
copies the same windows (64 random ones per call, 3 columns) out of plain /dev/shm arrays with
numpy fancy indexing, one memcpy per window and column: how much of the cost's growth with size
is the memory system's (rows that leave the caches) rather than the iterator's.

Prints one `RESULTS [json rows]` line (rows with items_per_s; L1's step rows add us_per_iter).
"""
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import reverb_shm as reverb  # noqa: E402
from reverb_shm.torch import TorchIterator  # noqa: E402

try:   # (the JaxIterator row is measured where JAX is installed)
  import jax  # noqa: E402

  from reverb_shm.jax import JaxIterator  # noqa: E402
except ImportError:
  jax = JaxIterator = None
from _timing import row, run_main, shm_bytes, timed  # noqa: E402

TABLE = "learner"
BATCH = 256
L1_SIGNATURE = {"obs": reverb.TensorSpec([84], np.float32), "action": reverb.TensorSpec([], np.int64),
                "reward": reverb.TensorSpec([], np.float32)}
L1_ITEM_BYTES = 84 * 4 + 8 + 4
WINDOW, WINDOWS_PER_BATCH, EPISODE = 80, 64, 1000
L2_STEP_BYTES = 8 * 4 + 8 + 4


def _precise_sleep_setup():
  """Timer slack of 1 ns for this thread (Linux prctl PR_SET_TIMERSLACK): sleeps of 1 ms end
  within a few µs instead of 50 µs late."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(29, 1, 0, 0, 0)
  except (OSError, AttributeError):
    pass


def training_step(seconds: float) -> None:
  """A simulated training step of `seconds` that releases the GIL (as torch's kernels do):
  sleeps until 100 µs before its end, then spins to it."""
  end = time.perf_counter() + seconds
  left = end - time.perf_counter() - 100e-6
  if left > 0:
    time.sleep(left)
  while time.perf_counter() < end:
    pass


def l1(args):
  n = args.items
  table = reverb.Table(TABLE, sampler=reverb.selectors.Prioritized(0.6),
                       remover=reverb.selectors.Fifo(), max_size=n,
                       rate_limiter=reverb.rate_limiters.MinSize(1), signature=L1_SIGNATURE)
  rows = []
  with reverb.Server([table], arena_bytes=max(256 << 20, 2 * n * (L1_ITEM_BYTES + 128))) as srv:
    st = srv.shared_table(TABLE)
    rng = np.random.default_rng(0)
    for s in range(0, n, 100_000):
      b = min(100_000, n - s)
      v = np.arange(s, s + b)
      st.insert({"obs": np.repeat(v[:, None], 84, axis=1).astype(np.float32),
                 "action": v.astype(np.int64), "reward": v.astype(np.float32)},
                rng.random(b) + 0.1)
    new_priorities = torch.rand(BATCH, dtype=torch.float32) + 0.1

    with TorchIterator(st, batch_size=BATCH, prefetch=4, timeout_ms=10_000) as it:
      def loop():
        batch = next(it)
        it.update_priorities(batch.info.key, new_priorities)
        return BATCH
      rows.append(row("L1", "iterator", "TorchIterator(prefetch=4): next + update_priorities",
                      timed(loop, args.duration, args.warmup)[0], L1_ITEM_BYTES, table_items=n))
      _precise_sleep_setup()

      def step_only():
        training_step(1e-3)
        return BATCH
      rate = timed(step_only, args.duration, args.warmup)[0]
      rows.append(row("L1", "step_only_1ms", "simulated 1 ms training step alone", rate,
                      us_per_iter=1e6 * BATCH / rate, table_items=n))

      def loop_step():
        batch = next(it)
        training_step(1e-3)
        it.update_priorities(batch.info.key, new_priorities)
        return BATCH
      rate = timed(loop_step, args.duration, args.warmup)[0]
      rows.append(row("L1", "iterator_step_1ms", "TorchIterator + 1 ms training step", rate,
                      us_per_iter=1e6 * BATCH / rate, table_items=n))
      stats = it.stats
      rows[0]["keys_skipped"] = stats["keys_skipped"]

    if jax is not None:
      jax_priorities = jax.numpy.asarray(new_priorities.numpy())
      with JaxIterator(st, batch_size=BATCH, prefetch=4, timeout_ms=10_000) as it:
        def jax_loop():
          batch = next(it)
          it.update_priorities(batch.info.key, jax_priorities)
          return BATCH
        rows.append(row("L1", "jax_iterator", "JaxIterator(prefetch=4) on the CPU: next + "
                        "update_priorities (a jax.Array)",
                        timed(jax_loop, args.duration, args.warmup)[0], L1_ITEM_BYTES,
                        table_items=n))

    out = [np.empty((BATCH, 84), np.float32), np.empty(BATCH, np.int64),
           np.empty(BATCH, np.float32)]
    out_nest = {"action": out[1], "obs": out[0], "reward": out[2]}
    prios = new_priorities.double().numpy()

    def hand():
      sample = st.sample_batch(BATCH, out=out_nest)
      _ = [torch.from_numpy(a) for a in out]
      st.update_priorities(sample.info.key, prios)
      return BATCH
    rows.append(row("L1", "hand_loop", "sample_batch(256, out=) + from_numpy + update_priorities",
                    timed(hand, args.duration, args.warmup)[0], L1_ITEM_BYTES, table_items=n))
  return rows


def fill_windows(client, steps: int) -> int:
  """`steps` steps in episodes of EPISODE steps, one item per window of WINDOW steps; returns
  the number of items."""
  items = 0
  starts = np.arange(EPISODE - WINDOW + 1)
  with client.trajectory_writer(num_keep_alive_refs=EPISODE) as w:
    for e in range(steps // EPISODE):
      v = np.arange(e * EPISODE, (e + 1) * EPISODE)
      w.extend({"obs": np.repeat(v[:, None], 8, axis=1).astype(np.float32),
                "action": v.astype(np.int64), "reward": v.astype(np.float32)})
      w.create_window_items(TABLE, np.ones(len(starts)), starts - EPISODE, WINDOW)
      w.end_episode()
      items += len(starts)
  return items


def l2_at(args, steps: int, duration: float):
  items = steps // EPISODE * (EPISODE - WINDOW + 1)
  table = reverb.Table(TABLE, sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
                       max_size=items, rate_limiter=reverb.rate_limiters.MinSize(1))
  arena = (128 << 20) + steps * L2_STEP_BYTES * 2 + items * 160
  with reverb.Server([table], arena_bytes=arena) as srv:
    fill_windows(srv.localhost_client(), steps)
    st = srv.shared_table(TABLE)
    with TorchIterator(st, batch_size=WINDOWS_PER_BATCH, prefetch=4, timeout_ms=10_000) as it:
      first = next(it)
      obs = first.data[1] if isinstance(first.data, list) else first.data["obs"]
      assert tuple(obs.shape) == (WINDOWS_PER_BATCH, WINDOW, 8), obs.shape
      assert bool((obs[:, 1:, 0] - obs[:, :-1, 0] == 1).all())   # consecutive steps

      def loop():
        next(it)
        return WINDOWS_PER_BATCH
      rate = timed(loop, duration, args.warmup)[0]
  return rate, items


def window_copy_us(steps: int, duration: float, warmup: float) -> float:
  """Microseconds per window of copying WINDOWS_PER_BATCH random windows of WINDOW steps out of
  `steps` steps of L2's columns held in /dev/shm (as a table's chunks are), one memcpy per window
  and column (a 1-D numpy array of windows, overlapping views of WINDOW rows, indexed by the
  random starts): the memory system's floor for L2's copy at that table size."""
  data = shm_bytes(steps * L2_STEP_BYTES)
  data[:] = 1
  count = steps - WINDOW + 1
  windows, at = [], 0
  for row_bytes in (8 * 4, 8, 4):   # obs, action, reward
    windows.append(np.ndarray((count,), np.dtype((np.void, WINDOW * row_bytes)), buffer=data,
                              offset=at, strides=(row_bytes,)))
    at += steps * row_bytes
  starts = np.random.default_rng(0).integers(0, count, (256, WINDOWS_PER_BATCH))
  calls = [0]

  def copy():
    s = starts[calls[0] % len(starts)]
    calls[0] += 1
    for w in windows:
      w[s]   # noqa: B018 (the gather is the work)
    return WINDOWS_PER_BATCH
  return 1e6 / timed(copy, duration, warmup)[0]


def l2(args):
  rate, items = l2_at(args, args.items, args.duration)
  rows = [row("L2", "iterator", f"TorchIterator(batch {WINDOWS_PER_BATCH} windows of {WINDOW} "
              "steps, prefetch=4)", rate, WINDOW * L2_STEP_BYTES, table_steps=args.items,
              table_items=items)]
  main_rate, main_items = rate, items
  for steps in [s for s in args.scales if s >= 100_000]:   # (smaller: not even 100 episodes)
    rate, items = (main_rate, main_items) if steps == args.items else \
        l2_at(args, steps, args.duration)
    rows.append(row(f"L2_scale_{steps}", "iterator", "TorchIterator windows at this table size",
                    rate, WINDOW * L2_STEP_BYTES, table_steps=steps, table_items=items,
                    us_per_window=1e6 / rate))
    us = window_copy_us(steps, args.duration, args.warmup)
    rows.append(row(f"L2_floor_{steps}", "numpy_copy", "numpy gather of the same windows from "
                    "/dev/shm arrays (memory-system reference)", 1e6 / us,
                    WINDOW * L2_STEP_BYTES, table_steps=steps, us_per_window=us))
  return rows


WORKLOADS = {"L1": l1, "L2": l2}

if __name__ == "__main__":
  torch.set_num_threads(1)
  run_main(__doc__, WORKLOADS)
