"""Checkpoint benchmark: save and restore throughput, and the pause a concurrent sampler sees.

    python bench/bench_checkpoint.py             # 1 GiB table (16384 items of 64 KiB)
    python bench/bench_checkpoint.py --quick     # 64 MiB smoke run

Measures, on one table of float32 items:
  save MB/s       client.checkpoint() of the whole table (snapshot + files + fsync + rename)
  restore MB/s    Server construction restoring that checkpoint (verify + restore)
  pause           how long every table lock was held (from the manifest) and the longest single
                  sample call a sampler in another process saw during the checkpoint, next to its
                  longest call without a checkpoint running
and, when /tmp/refvenv holds dm-reverb, dm-reverb's checkpoint and restore of the same data in
the same run (run as a subprocess with that interpreter). Results go to bench/results/.
"""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np

import reverb_shm as reverb
from reverb_shm import checkpointers

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
REFVENV = "/tmp/refvenv/bin/python"
ITEM_FLOATS = 16384            # 64 KiB items
MB = 1e6

_SAMPLER = textwrap.dedent("""
    import json, sys, time, reverb_shm
    table = reverb_shm.SharedTable.attach(sys.argv[1])
    stop_at = time.monotonic() + float(sys.argv[2])
    worst, calls = 0.0, 0
    print("ready", flush=True)
    while time.monotonic() < stop_at:
      t0 = time.perf_counter()
      table.sample_records(1)[1].release()
      worst = max(worst, time.perf_counter() - t0)
      calls += 1
    print(json.dumps({"worst_s": worst, "calls": calls}), flush=True)
""")

_REVERB = textwrap.dedent("""
    import json, sys, time, numpy as np, reverb
    n, floats, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    def table():
      return reverb.Table("t", reverb.selectors.Uniform(), reverb.selectors.Fifo(), n,
                          reverb.rate_limiters.MinSize(1))
    server = reverb.Server([table()], checkpointer=reverb.checkpointers.DefaultCheckpointer(root))
    client = server.localhost_client()
    data = np.random.default_rng(0).random(floats, dtype=np.float32)
    with client.trajectory_writer(1) as w:
      for i in range(n):
        w.append([data])
        w.create_item("t", 1.0, [w.history[0][-1]])
        if i % 256 == 0:
          w.flush()
    t0 = time.perf_counter(); path = client.checkpoint(); save = time.perf_counter() - t0
    server.stop()
    t0 = time.perf_counter()
    server = reverb.Server([table()], checkpointer=reverb.checkpointers.DefaultCheckpointer(root))
    restore = time.perf_counter() - t0
    size = server.localhost_client().server_info()["t"].current_size
    print(json.dumps({"save_s": save, "restore_s": restore, "items": size}))
""")


def _table(n):
  return reverb.Table("t", reverb.selectors.Uniform(), reverb.selectors.Fifo(), n,
                      reverb.rate_limiters.MinSize(1))


def _sampler(name: str, seconds: float):
  proc = subprocess.Popen([sys.executable, "-c", _SAMPLER, name, str(seconds)],
                          stdout=subprocess.PIPE, text=True,
                          cwd=pathlib.Path(__file__).resolve().parent.parent)
  assert proc.stdout.readline().strip() == "ready"
  return proc


def _sampler_result(proc) -> dict:
  out, _ = proc.communicate(timeout=120)
  return json.loads(out.strip().splitlines()[-1])


def run(n_items: int, root: str) -> dict:
  nbytes = n_items * ITEM_FLOATS * 4
  arena = int(nbytes * 1.1) + (64 << 20)
  ckpt = checkpointers.DefaultCheckpointer(os.path.join(root, "shm"))
  server = reverb.Server([_table(n_items)], checkpointer=ckpt, arena_bytes=arena)
  table = server.shared_table("t")
  rng = np.random.default_rng(0)
  batch = 256
  for lo in range(0, n_items, batch):
    table.insert([rng.random((min(batch, n_items - lo), ITEM_FLOATS), dtype=np.float32)], 1.0)
  client = server.localhost_client()
  baseline = _sampler_result(_sampler(f"{server.name}/t", 2.0))
  proc = _sampler(f"{server.name}/t", 3.0)
  t0 = time.perf_counter()
  path = client.checkpoint()
  save_s = time.perf_counter() - t0
  during = _sampler_result(proc)
  pause_ns = checkpoint_pause(path)
  server.stop()
  t0 = time.perf_counter()
  server = reverb.Server([_table(n_items)], checkpointer=ckpt, arena_bytes=arena)
  restore_s = time.perf_counter() - t0
  assert server.shared_table("t").size == n_items
  server.stop()
  return {"items": n_items, "bytes": nbytes, "save_MBps": nbytes / MB / save_s,
          "restore_MBps": nbytes / MB / restore_s, "save_s": save_s, "restore_s": restore_s,
          "tables_locked_ms": pause_ns / 1e6,
          "sampler_worst_call_ms_during_checkpoint": during["worst_s"] * 1e3,
          "sampler_worst_call_ms_baseline": baseline["worst_s"] * 1e3}


def checkpoint_pause(path: str) -> int:
  from reverb_shm._checkpoint import io as checkpoint_io  # pylint: disable=g-import-not-at-top
  return checkpoint_io.read_manifest(path).body["pause_ns"]


def run_reverb(n_items: int, root: str):
  if not os.path.exists(REFVENV):
    return None
  out = subprocess.run([REFVENV, "-c", _REVERB, str(n_items), str(ITEM_FLOATS),
                        os.path.join(root, "reverb")], capture_output=True, text=True,
                       timeout=3600)
  if out.returncode:
    return {"error": out.stderr.strip().splitlines()[-1:]}
  r = json.loads(out.stdout.strip().splitlines()[-1])
  nbytes = n_items * ITEM_FLOATS * 4
  return {**r, "save_MBps": nbytes / MB / r["save_s"], "restore_MBps": nbytes / MB / r["restore_s"]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="64 MiB instead of 1 GiB")
  parser.add_argument("--no-reverb", action="store_true", help="skip the dm-reverb baseline")
  args = parser.parse_args()
  n_items = 1024 if args.quick else 16384
  root = tempfile.mkdtemp(prefix="bench_checkpoint-")
  try:
    ours = run(n_items, root)
    print(f"reverb_shm: {ours['bytes'] / 2**20:.0f} MiB, save {ours['save_MBps']:.0f} MB/s, "
          f"restore {ours['restore_MBps']:.0f} MB/s, tables locked {ours['tables_locked_ms']:.2f} ms, "
          f"sampler worst call {ours['sampler_worst_call_ms_during_checkpoint']:.2f} ms during "
          f"checkpoint vs {ours['sampler_worst_call_ms_baseline']:.2f} ms without")
    theirs = None if args.no_reverb else run_reverb(n_items, root)
    if theirs:
      print(f"dm-reverb:  save {theirs.get('save_MBps', 0):.0f} MB/s, restore "
            f"{theirs.get('restore_MBps', 0):.0f} MB/s {theirs.get('error', '')}")
  finally:
    shutil.rmtree(root, ignore_errors=True)
  RESULTS_DIR.mkdir(exist_ok=True)
  out = RESULTS_DIR / f"checkpoint{'_quick' if args.quick else ''}.json"
  out.write_text(json.dumps({"reverb_shm": ours, "dm_reverb": theirs,
                             "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))


if __name__ == "__main__":
  main()
