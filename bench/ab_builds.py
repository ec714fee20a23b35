"""Same-run A/B of two builds of reverb_shm on the W1-W5 loops (bench/shm_workloads.py).

  python bench/ab_builds.py A_ROOT B_ROOT [--rounds 15] [--duration 0.4] [--items 200000]

A_ROOT and B_ROOT are source trees with their extensions built in place (`python setup.py
build_ext --inplace`), e.g. a `git archive` of main and of a branch. One worker process per
build prepares every workload once (servers, filled tables, writers); the parent then asks the
two workers in turn (A B B A ...) to time each loop for `duration` seconds, so both builds see
the same machine load within a round. Reports per loop the median items/s of each build and
the median of the per-round ratios B/A (B slower: below 1).

  python bench/ab_builds.py A_ROOT B_ROOT --instructions 500 [--loops W1 ...]

counts instructions instead (valgrind's callgrind, deterministic, unaffected by machine load):
each loop body runs N and 2N times in a fresh worker per build; the difference divided by N is
the instructions per loop iteration executed in the compiled core (reverb_shm._core and _hot)
by the main thread.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
LOOPS = ("W1 Client.insert", "W1 step_inserter", "W1 SharedTable.insert 1 step",
         "W2 append+create_item", "W2 extend+create_window_items", "W3 Client.sample(256)",
         "W3 sample_batch(256)", "W4 Client.sample+mutate", "W4 sample_batch+update",
         "W5 sample_batch(64) frames", "W5 np.copyto 64 MiB (control)")


def selected(loops) -> list:
  """The LOOPS that the --loops substrings select (all without)."""
  return [loop for loop in LOOPS if not loops or any(part in loop for part in loops)]


def w5_ops(w, reverb, np, frames: int = 4_000):
  """W5's sampling loop (bench/shm_workloads.py: sample_batch(64, out=) of 84x84x4 uint8 frames
  from a table of `frames` frames) and its numpy copy reference (64 MiB, the same in both builds:
  a noise control). Returns (ops, server)."""
  from _timing import FRAME_SHAPE  # pylint: disable=import-outside-toplevel
  srv = w.server(reverb.selectors.Uniform(), frames, int(np.prod(FRAME_SHAPE)))
  table = srv.shared_table(w.TABLE)
  one = {"frame": np.random.default_rng(0).integers(0, 256, (1,) + FRAME_SHAPE, dtype=np.uint8)}
  while table.size < frames:
    table.insert(one, 1.0)
  out = [np.empty((64,) + FRAME_SHAPE, np.uint8)]
  src, dst = np.ones(64 << 20, np.uint8), np.empty(64 << 20, np.uint8)

  def copy():
    np.copyto(dst, src)
    return src.nbytes // out[0][0].nbytes
  return {"W5 sample_batch(64) frames": lambda: len(table.sample_batch(64, out=out).info.key),
          "W5 np.copyto 64 MiB (control)": copy}, srv


def worker(root: str, items: int, count_loop=None, iterations: int = 0, loops=None) -> None:
  """Serves timing requests on stdin/stdout for the build in `root`; with count_loop, runs
  that loop `iterations` times instead and exits. Prepares only what the selected loops need."""
  sys.path.insert(0, root)
  sys.path.insert(1, HERE)
  import numpy as np  # pylint: disable=import-outside-toplevel
  import reverb_shm as reverb  # pylint: disable=import-outside-toplevel
  import shm_workloads as w  # pylint: disable=import-outside-toplevel
  from _timing import timed  # pylint: disable=import-outside-toplevel
  assert os.path.dirname(os.path.dirname(reverb.__file__)) == root, reverb.__file__
  wanted = selected([count_loop] if count_loop else loops)
  ops, servers, closers = {}, [], []
  if any(not loop.startswith("W5") for loop in wanted):
    ops, servers, closers = base_ops(w, reverb, np, items)
  if any(loop.startswith("W5") for loop in wanted):
    more, srv = w5_ops(w, reverb, np)
    ops.update(more)
    servers.append(srv)
  if count_loop is not None:
    op = ops[count_loop]
    for _ in range(20 + iterations):
      op()
    os._exit(0)  # pylint: disable=protected-access
  sys.stdout.write("ready\n")
  sys.stdout.flush()
  for line in sys.stdin:
    loop, duration = line.rstrip("\n").rsplit(" ", 1)
    rate = timed(ops[loop], float(duration), 0.05)[0]
    sys.stdout.write(f"{rate}\n")
    sys.stdout.flush()
  for close in closers:
    close()
  for srv in servers:
    srv.stop()


def base_ops(w, reverb, np, items: int):
  """The W1-W4 loops. Returns (ops, servers, closers)."""
  from _timing import pair_items_op  # pylint: disable=import-outside-toplevel
  ins_srv = w.server(reverb.selectors.Uniform(), 1_000_000)
  client, table = ins_srv.localhost_client(), ins_srv.shared_table(w.TABLE)
  data, one = w.step(1), w.steps(1)
  inserter = table.step_inserter(capacity=256)
  writer = client.trajectory_writer(num_keep_alive_refs=2)
  pairs = pair_items_op(writer, w.TABLE, [w.step(i) for i in range(100)])
  windows = client.trajectory_writer(num_keep_alive_refs=128)
  block, prios, starts, blocks = w.steps(100), np.ones(99), np.arange(-100, -1), [0]

  def window_op():
    windows.extend(block)
    windows.create_window_items(w.TABLE, prios, starts, 2)
    blocks[0] += 1
    if blocks[0] % 10 == 0:
      windows.end_episode()
    return 99

  def many(fn, n=100):
    def op():
      for _ in range(n):
        fn()
      return n
    return op

  samplers = {}
  for name, sel in (("W3", reverb.selectors.Uniform()), ("W4", reverb.selectors.Prioritized(0.6))):
    srv = w.server(sel, items)
    w.fill(srv.shared_table(w.TABLE), items)
    samplers[name] = srv
  rng = np.random.default_rng(0)

  def api_sample(srv, update):
    c = srv.localhost_client()

    def op():
      keys = [s.info.key for s in c.sample(w.TABLE, 256, emit_timesteps=False)]
      if update:
        c.mutate_priorities(w.TABLE, dict(zip(keys, (rng.random(len(keys)) + 0.1).tolist())))
      return len(keys)
    return op

  ops = dict(zip(LOOPS, (
      many(lambda: client.insert(data, {w.TABLE: 1.0})),
      many(lambda: inserter.insert(data, 1.0)),
      many(lambda: table.insert(one, 1.0)),
      pairs, window_op,
      api_sample(samplers["W3"], False),
      w.fastest_op(samplers["W3"].shared_table(w.TABLE), False),
      api_sample(samplers["W4"], True),
      w.fastest_op(samplers["W4"].shared_table(w.TABLE), True))))
  return ops, [ins_srv, *samplers.values()], [inserter.close]


def _core_instructions(root: str, loop: str, n: int, items: int) -> int:
  """Instructions the main thread executed in the compiled modules for n iterations."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "cg")
    subprocess.run(["valgrind", "--tool=callgrind", "--separate-threads=yes",
                    f"--callgrind-out-file={out}", sys.executable, os.path.abspath(__file__),
                    root, root, "--items", str(items), "--worker", os.path.abspath(root),
                    "--count-loop", loop, "--instructions", str(n)],
                   check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    report = subprocess.run(["callgrind_annotate", "--auto=no", "--threshold=100", out + "-01"],
                            check=True, capture_output=True, text=True).stdout
  total = 0
  for line in report.splitlines():   # "1,234 ( 0.10%)  file:function [object]"
    m = re.match(r"\s*([\d,]+)\s+\(", line)
    if m and any(part in line for part in ("/csrc/", "reverb_shm/_core", "reverb_shm/_hot",
                                           "reverb_shm._core.c")):
      total += int(m.group(1).replace(",", ""))
  return total


def count_instructions(args) -> None:
  results = []
  for loop in selected(args.loops):
    row = {"loop": loop}
    for label, root in (("a", args.a_root), ("b", args.b_root)):
      once = _core_instructions(root, loop, args.instructions, args.items)
      twice = _core_instructions(root, loop, 2 * args.instructions, args.items)
      row[f"{label}_core_instructions"] = (twice - once) / args.instructions
    results.append(row)
    print(f"{loop:32s} core instructions per iteration: A {row['a_core_instructions']:.0f}  "
          f"B {row['b_core_instructions']:.0f}  B/A "
          f"{row['b_core_instructions'] / row['a_core_instructions']:.4f}", flush=True)
  print("RESULTS " + json.dumps(results))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("a_root", help="source tree of build A (extensions built in place)")
  p.add_argument("b_root", help="source tree of build B")
  p.add_argument("--rounds", type=int, default=15, help="A B B A rounds per loop")
  p.add_argument("--duration", type=float, default=0.4, help="seconds per timed run")
  p.add_argument("--items", type=int, default=200_000, help="items in the W3/W4 tables")
  p.add_argument("--loops", nargs="+", help="substrings selecting loops (default: all)")
  p.add_argument("--instructions", type=int, default=0, metavar="N",
                 help="count instructions per iteration under callgrind (N and 2N iterations)")
  p.add_argument("--worker", help=argparse.SUPPRESS)
  p.add_argument("--count-loop", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    worker(args.worker, args.items, args.count_loop, args.instructions, args.loops)
    return
  if args.instructions:
    count_instructions(args)
    return
  procs = {}
  for label, root in (("A", args.a_root), ("B", args.b_root)):
    procs[label] = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), args.a_root, args.b_root, "--items",
         str(args.items), "--worker", os.path.abspath(root)] + (["--loops", *args.loops] if args.loops else []),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  for proc in procs.values():
    assert proc.stdout.readline().strip() == "ready"

  def time_loop(label, loop):
    proc = procs[label]
    proc.stdin.write(f"{loop} {args.duration}\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())

  results = []
  for loop in selected(args.loops):
    rates = {"A": [], "B": []}
    ratios = []
    for r in range(args.rounds):
      order = ("A", "B") if r % 2 == 0 else ("B", "A")
      got = {label: time_loop(label, loop) for label in order}
      for label in "AB":
        rates[label].append(got[label])
      ratios.append(got["B"] / got["A"])
    row = {"loop": loop, "a_items_per_s": statistics.median(rates["A"]),
           "b_items_per_s": statistics.median(rates["B"]), "b_over_a": statistics.median(ratios)}
    results.append(row)
    print(f"{loop:32s} A {row['a_items_per_s'] / 1e3:9.1f}k/s  B {row['b_items_per_s'] / 1e3:9.1f}k/s"
          f"  B/A median of {args.rounds} ratios {row['b_over_a']:.3f}", flush=True)
  for proc in procs.values():
    proc.stdin.close()
    proc.wait(timeout=60)
  print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
  main()
