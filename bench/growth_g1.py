"""G1: W1, W3 and W5 on a server whose arena grew by extents against one that reserved it at start.

    python bench/growth_g1.py --items 1000000 --frames 4000 --round 0.25 --rounds 12

Both servers (the same tables and max_bytes; one with arena_bytes of the full size, the other
starting at the default 8 MiB and grown to that size, as shm_workloads.py's
REVERB_SHM_BENCH_ARENA=grown does) live in this process at once, and each workload's loop is
timed in short alternating rounds (pre-sized, grown, grown, pre-sized, ...). A change of machine
load then falls on both alike instead of on one runner's whole run; each row is the median round.
The W5 numpy copy is timed the same way twice (two identical copies, A against A): its ratio is
the noise floor of the comparison.

Prints one `RESULTS [json rows]` line: rows tagged runner "shm" (pre-sized) or "shm_grown".
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import reverb_shm as reverb  # noqa: E402
import shm_workloads as sw  # noqa: E402
from _timing import FRAME_BYTES, FRAME_SHAPE, emit, row  # noqa: E402

RUNNERS = {"presized": "shm", "grown": "shm_grown"}


def _servers(sampler, max_size, item_bytes=sw.STEP_BYTES):
  """{"presized": Server, "grown": Server} of the same table (see the module docstring)."""
  out = {}
  for kind in RUNNERS:
    sw.GROWN = kind == "grown"
    out[kind] = sw.server(sampler, max_size, item_bytes)
  return out


def _rate(op, seconds: float) -> float:
  items, start = 0, time.perf_counter()
  now, end = start, start + seconds
  while now < end:
    items += op()
    now = time.perf_counter()
  return items / (now - start)


def alternate(ops: dict, rounds: int, round_s: float) -> dict:
  """Median items/s of each op of `ops` (kind -> op returning the items it handled), timed in
  `rounds` rounds of `round_s` seconds each, alternating the order (ABBA), after one warm-up
  round each."""
  kinds = list(ops)
  for kind in kinds:
    _rate(ops[kind], round_s)
  rates = {kind: [] for kind in kinds}
  for r in range(rounds):
    for kind in kinds if r % 2 == 0 else kinds[::-1]:
      rates[kind].append(_rate(ops[kind], round_s))
  return {kind: statistics.median(v) for kind, v in rates.items()}


def _rows(workload, variant, api, rates, item_bytes=0):
  return [dict(row(workload, variant, api, rate, item_bytes), runner=RUNNERS[kind])
          for kind, rate in rates.items()]


def w1(args):
  data = sw.step(1)
  srvs = _servers(reverb.selectors.Uniform(), 1_000_000)
  try:
    clients = {k: s.localhost_client() for k, s in srvs.items()}
    inserters = {k: s.shared_table(sw.TABLE).step_inserter(capacity=256) for k, s in srvs.items()}

    def api(client):
      def op():
        for _ in range(100):
          client.insert(data, {sw.TABLE: 1.0})
        return 100
      return op

    def fastest(inserter):
      def op():
        for _ in range(100):
          inserter.insert(data, 1.0)
        return 100
      return op
    rows = _rows("W1", "reverb_api", "Client.insert",
                 alternate({k: api(c) for k, c in clients.items()}, args.rounds, args.round))
    rows += _rows("W1", "fastest", "SharedTable.step_inserter(256).insert (1 step per call)",
                  alternate({k: fastest(i) for k, i in inserters.items()}, args.rounds, args.round))
    for inserter in inserters.values():
      inserter.close()
  finally:
    for s in srvs.values():
      s.stop()
  return rows


def w3(args):
  srvs = _servers(reverb.selectors.Uniform(), args.items)
  try:
    tables = {k: s.shared_table(sw.TABLE) for k, s in srvs.items()}
    for table in tables.values():
      sw.fill(table, args.items)
    rates = alternate({k: sw.fastest_op(t, False) for k, t in tables.items()}, args.rounds,
                      args.round)
    return _rows("W3", "fastest", sw.FASTEST_API + f"  [{args.items:,} items]", rates)
  finally:
    for s in srvs.values():
      s.stop()


def w5(args):
  frame = np.random.default_rng(0).integers(0, 256, FRAME_SHAPE, dtype=np.uint8)
  one = {"frame": frame[None]}
  srvs = _servers(reverb.selectors.Uniform(), args.frames, FRAME_BYTES)
  try:
    tables = {k: s.shared_table(sw.TABLE) for k, s in srvs.items()}

    def insert(table):
      def op():
        for _ in range(16):
          table.insert(one, 1.0)
        return 16
      return op
    rows = _rows("W5_insert", "fastest", "SharedTable.insert (1 frame per call)",
                 alternate({k: insert(t) for k, t in tables.items()}, args.rounds, args.round),
                 FRAME_BYTES)
    for table in tables.values():
      while table.size < args.frames:
        insert(table)()
    outs = {k: [np.empty((64,) + FRAME_SHAPE, np.uint8)] for k in tables}

    def sample(table, out):
      return lambda: len(table.sample_batch(64, out=out).info.key)
    rows += _rows("W5_sample", "fastest", "SharedTable.sample_batch(64, out=)",
                  alternate({k: sample(t, outs[k]) for k, t in tables.items()}, args.rounds,
                            args.round), FRAME_BYTES)
  finally:
    for s in srvs.values():
      s.stop()
  bufs = {k: (np.ones(64 << 20, np.uint8), np.empty(64 << 20, np.uint8)) for k in RUNNERS}

  def copy(src, dst):
    def op():
      np.copyto(dst, src)
      return src.nbytes / FRAME_BYTES
    return op
  rows += _rows("W5_copy", "numpy", "np.copyto of 64 MiB (the same work in both: noise floor)",
                alternate({k: copy(*b) for k, b in bufs.items()}, args.rounds, args.round),
                FRAME_BYTES)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--items", type=int, default=1_000_000, help="W3's table size")
  p.add_argument("--frames", type=int, default=4_000, help="W5's table size (frames)")
  p.add_argument("--round", type=float, default=0.25, help="seconds per timed round")
  p.add_argument("--rounds", type=int, default=12, help="timed rounds per server and loop")
  args = p.parse_args(argv)
  emit(w1(args) + w3(args) + w5(args))
  return 0


if __name__ == "__main__":
  sys.exit(main())
