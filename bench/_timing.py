"""Timing helpers shared by every benchmark runner (stdlib only: peers import it too)."""
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
