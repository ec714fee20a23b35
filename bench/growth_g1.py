"""G1: W1, W3 and W5 on a server whose arena grew by extents against one that reserved it at start.

    python bench/growth_g1.py --items 1000000 --frames 4000 --round 0.25 --rounds 12 --builds 6

Both servers (the same tables and max_bytes; one with arena_bytes of the full size, the other
starting at the default 8 MiB and grown to that size, as shm_workloads.py's
REVERB_SHM_BENCH_ARENA=grown does) live in this process at once, and each workload's loop is
timed in short alternating rounds (pre-sized, grown, grown, pre-sized, ...). A change of machine
load then falls on both alike instead of on one runner's whole run.

Builds. W3 samples uniformly from 1M items: each item is a few dependent random reads over
~110 MB (its record, its rows in three chunks), and on a virtual machine such reads cost more
when the pages behind them are scattered over physical memory (more distinct frames for the
nested page walks after each TLB miss). Where a server's pages land depends on the kernel's free
lists at the moment they are allocated, not on how the arena was sized, and the first of several
servers built one after another tends to get the scattered pages that others freed. Built once,
in a fixed order, one side of the comparison is thereby favoured throughout. So W3 builds its
servers --builds times, each build creating them in a different order (rotating), and its rows
are the median of the rounds of all builds. W3 also times a second pre-sized server (variant
"control"): its ratio to the first is what page placement alone does to W3 in this run. W1 and
W5 build one pair (pre-sized first), as their rounds follow a table from empty to full and on,
as the W1 and W5 workloads do; fresh tables in every build would time mostly tables not yet full.
Where /proc/self/pagemap shows frame numbers (root), W3 rows carry "frames_2mib", the median
number of distinct 2 MiB physical frames holding the server's tables and used arena.

The W5 numpy copy is timed the same way twice (two identical copies, A against A): its ratio is
the noise floor of the timing.

Prints one `RESULTS [json rows]` line: rows tagged runner "shm" (pre-sized, and W3's control)
or "shm_grown".
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
CONTROL = "control"     # W3's second pre-sized server: reported as runner "shm", variant "control"
PAGE = 4096


def _server(kind, max_size, item_bytes):
  """A pre-sized or grown server (kind) of one uniform table of max_size items."""
  sw.GROWN = kind == "grown"
  return sw.server(reverb.selectors.Uniform(), max_size, item_bytes)


def _rate(op, seconds: float) -> float:
  items, start = 0, time.perf_counter()
  now, end = start, start + seconds
  while now < end:
    items += op()
    now = time.perf_counter()
  return items / (now - start)


def alternate(ops: dict, rounds: int, round_s: float) -> dict:
  """Items/s of each round of each op of `ops` (kind -> op returning the items it handled), timed
  in `rounds` rounds of `round_s` seconds each, alternating the order (ABBA), after one warm-up
  round each. Returns kind -> list of round rates."""
  kinds = list(ops)
  for kind in kinds:
    _rate(ops[kind], round_s)
  rates = {kind: [] for kind in kinds}
  for r in range(rounds):
    for kind in kinds if r % 2 == 0 else kinds[::-1]:
      rates[kind].append(_rate(ops[kind], round_s))
  return rates


def frames_2mib(seg):
  """Distinct 2 MiB physical frames holding `seg`'s header, tables and used arena pages, or None
  where /proc/self/pagemap hides frame numbers (they read as 0 without CAP_SYS_ADMIN)."""
  from reverb_shm._internal._lib import ffi  # pylint: disable=import-outside-toplevel
  info = seg.info()
  start = int(ffi.cast("uintptr_t", seg.base)) // PAGE
  pages = (info["arena_off"] + info["arena_used"] + PAGE - 1) // PAGE
  try:
    with open("/proc/self/pagemap", "rb") as f:
      f.seek(start * 8)
      entries = np.frombuffer(f.read(pages * 8), np.uint64)
  except OSError:
    return None
  frames = entries[(entries >> np.uint64(63)) == 1] & np.uint64((1 << 55) - 1)
  if not frames.size or not frames.any():
    return None
  return int(np.unique(frames >> np.uint64(9)).size)


def builds(args, kinds, make, loops, count=1):
  """Times the loops of `loops(servers)` on `count` sets of fresh servers (see the module
  docstring), args.rounds rounds in all (at least 2 per build). `make(kind)` creates one
  server; build b creates kinds[b % k:] + kinds[:b % k] in that order (k = len(kinds)).
  `loops` is a generator function given {kind: server} in creation order and yielding
  (name, {kind: op}) one loop at a time (it prepares each before yielding it). Returns
  {name: {kind: median round rate}} and {kind: [frames_2mib of each build]} (None: unknown)."""
  per_build = args.rounds
  if count > 1:   # an even number of rounds each, for the ABBA order
    per_build = max(2, -(-args.rounds // count))
    per_build += per_build % 2
  rates, frames = {}, {k: [] for k in kinds}
  for b in range(count):
    order = kinds[b % len(kinds):] + kinds[:b % len(kinds)]
    srvs = {}
    try:
      for kind in order:
        srvs[kind] = make(kind)
      for name, ops in loops(srvs):
        for kind, v in alternate(ops, per_build, args.round).items():
          rates.setdefault(name, {}).setdefault(kind, []).extend(v)
      for kind in kinds:
        frames[kind].append(frames_2mib(srvs[kind].segment))
    finally:
      for s in srvs.values():
        s.stop()
  return {name: {k: statistics.median(v) for k, v in by_kind.items()}
          for name, by_kind in rates.items()}, frames


def _rows(workload, variant, api, rates, item_bytes=0, frames=None):
  out = []
  for kind, rate in rates.items():
    extra = {}
    known = [f for f in (frames or {}).get(kind, []) if f is not None]
    if known:
      extra["frames_2mib"] = float(statistics.median(known))
    out.append(dict(row(workload, CONTROL if kind == CONTROL else variant, api, rate, item_bytes,
                        **extra), runner=RUNNERS.get(kind, "shm")))
  return out


def w1(args):
  data = sw.step(1)

  def loops(srvs):
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
    yield "api", {k: api(c) for k, c in clients.items()}
    yield "fastest", {k: fastest(i) for k, i in inserters.items()}
    for inserter in inserters.values():
      inserter.close()
  rates, _ = builds(args, list(RUNNERS),
                    lambda kind: _server(kind, 1_000_000, sw.STEP_BYTES),
                    loops)
  return (_rows("W1", "reverb_api", "Client.insert", rates["api"]) +
          _rows("W1", "fastest", "SharedTable.step_inserter(256).insert (1 step per call)",
                rates["fastest"]))


def w3(args):
  def loops(srvs):
    tables = {k: s.shared_table(sw.TABLE) for k, s in srvs.items()}
    for table in tables.values():
      sw.fill(table, args.items)
    yield "sample", {k: sw.fastest_op(t, False) for k, t in tables.items()}

  def make(kind):
    return _server("presized" if kind == CONTROL else kind, args.items, sw.STEP_BYTES)
  rates, frames = builds(args, ["presized", "grown", CONTROL], make, loops, args.builds)
  return _rows("W3", "fastest", sw.FASTEST_API + f"  [{args.items:,} items]", rates["sample"],
               frames=frames)


def w5(args):
  frame = np.random.default_rng(0).integers(0, 256, FRAME_SHAPE, dtype=np.uint8)
  one = {"frame": frame[None]}

  def insert(table):
    def op():
      for _ in range(16):
        table.insert(one, 1.0)
      return 16
    return op

  def loops(srvs):
    tables = {k: s.shared_table(sw.TABLE) for k, s in srvs.items()}
    yield "insert", {k: insert(t) for k, t in tables.items()}
    for table in tables.values():
      while table.size < args.frames:
        insert(table)()
    outs = {k: [np.empty((64,) + FRAME_SHAPE, np.uint8)] for k in tables}

    def sample(table, out):
      return lambda: len(table.sample_batch(64, out=out).info.key)
    yield "sample", {k: sample(t, outs[k]) for k, t in tables.items()}
  rates, _ = builds(args, list(RUNNERS),
                    lambda kind: _server(kind, args.frames, FRAME_BYTES),
                    loops)
  rows = _rows("W5_insert", "fastest", "SharedTable.insert (1 frame per call)", rates["insert"],
               FRAME_BYTES)
  rows += _rows("W5_sample", "fastest", "SharedTable.sample_batch(64, out=)", rates["sample"],
                FRAME_BYTES)
  bufs = {k: (np.ones(64 << 20, np.uint8), np.empty(64 << 20, np.uint8)) for k in RUNNERS}

  def copy(src, dst):
    def op():
      np.copyto(dst, src)
      return src.nbytes / FRAME_BYTES
    return op
  copies = alternate({k: copy(*b) for k, b in bufs.items()}, args.rounds, args.round)
  rows += _rows("W5_copy", "numpy", "np.copyto of 64 MiB (the same work in both: noise floor)",
                {k: statistics.median(v) for k, v in copies.items()}, FRAME_BYTES)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--items", type=int, default=1_000_000, help="W3's table size")
  p.add_argument("--frames", type=int, default=4_000, help="W5's table size (frames)")
  p.add_argument("--round", type=float, default=0.25, help="seconds per timed round")
  p.add_argument("--rounds", type=int, default=12,
                 help="timed rounds per server and loop (W3: over all builds, at least 2 each)")
  p.add_argument("--builds", type=int, default=6,
                 help="fresh sets of W3's servers, created in rotating order")
  args = p.parse_args(argv)
  if args.builds < 1 or args.rounds < 1:
    p.error("--builds and --rounds must be at least 1")
  emit(w1(args) + w3(args) + w5(args))
  return 0


if __name__ == "__main__":
  sys.exit(main())
