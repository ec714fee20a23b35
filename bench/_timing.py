"""Timing helpers shared by every benchmark runner (stdlib only: peers import it too)."""
import argparse
import json
import sys
import time
from typing import Callable, Tuple

MB = 1e6
FRAME_SHAPE = (84, 84, 4)
FRAME_BYTES = 84 * 84 * 4


def timed(op: Callable[[], int], duration: float, warmup: float) -> Tuple[float, int, float]:
  """Runs op (returning the number of items it handled) for `warmup`, then `duration` seconds.

  Returns:
    (items per second, items, seconds) of the measured phase.
  """
  end = time.perf_counter() + warmup
  while time.perf_counter() < end:
    op()
  items = 0
  start = now = time.perf_counter()
  end = start + duration
  while now < end:
    items += op()
    now = time.perf_counter()
  seconds = now - start
  return items / seconds, items, seconds


def shm_bytes(nbytes: int):
  """A numpy uint8 array of nbytes in a fresh /dev/shm file, the kind of memory tables live in
  (unlinked at once; the mapping goes with the last reference to the array)."""
  import mmap  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryFile(dir="/dev/shm") as f:
    f.truncate(nbytes)
    return np.frombuffer(mmap.mmap(f.fileno(), nbytes), np.uint8)


def row(workload: str, variant: str, api: str, rate: float, item_bytes: int = 0, **extra) -> dict:
  """One result row: items/s (and MB/s when item_bytes is given)."""
  r = {"workload": workload, "variant": variant, "api": api, "items_per_s": rate}
  if item_bytes:
    r["mb_per_s"] = rate * item_bytes / MB
  r.update(extra)
  return r


def emit(rows) -> None:
  """Writes the rows as one JSON line on stdout (what run_all.py reads)."""
  sys.stdout.write("RESULTS " + json.dumps(rows) + "\n")
  sys.stdout.flush()


def common_args(parser) -> None:
  parser.add_argument("--workloads", nargs="+", required=True)
  parser.add_argument("--duration", type=float, default=2.0)
  parser.add_argument("--warmup", type=float, default=0.3)
  parser.add_argument("--items", type=int, default=1_000_000, help="items in sampled tables")
  parser.add_argument("--frames", type=int, default=4_000, help="frames in the W5 table")
  parser.add_argument("--scales", type=int, nargs="*", default=[])


def pair_items_op(writer, table: str, steps: list, episode_steps: int = 1000):
  """W2's loop body (identical Reverb calls on every library): append each step and create an
  item over the last 2 steps; end the episode every `episode_steps` steps."""
  count = [0]

  def op():
    for data in steps:
      writer.append(data)
      count[0] += 1
      if count[0] >= 2:
        writer.create_item(table, 1.0, {k: v[-2:] for k, v in writer.history.items()})
    if count[0] >= episode_steps:
      writer.end_episode()
      count[0] = 0
    return len(steps)
  return op


def run_main(doc: str, workloads: dict, add_args=None) -> None:
  """Command line of a runner: runs the named workloads and emits their rows."""
  p = argparse.ArgumentParser(description=doc.splitlines()[0])
  common_args(p)
  if add_args:
    add_args(p)
  args = p.parse_args()
  rows = []
  for w in args.workloads:
    if w in workloads:
      rows += workloads[w](args)
  emit(rows)
