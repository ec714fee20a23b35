"""D1: the disk tier against the peers' disk-backed buffers, with data 4x a memory limit.

Every runner (reverb_shm's Server(storage=DIR), TorchRL's LazyMemmapStorage, cpprb's
ReplayBuffer(mmap_prefix=) and a plain numpy memmap) runs in its own process that joins a memory
cgroup limited to --limit-mib (v2 memory.max, else v1 memory.limit_in_bytes) after its imports,
fills its buffer on the same filesystem (--dir) with 84x84x4 uint8 frames worth 4x the limit,
then samples uniform batches of 64 frames into a reused buffer for --seconds. The numpy memmap
runner gathers 64 random frames of a raw file, requesting every frame's pages before copying
any (as the disk tier's gather does): the disk's random-read bandwidth for this access pattern
with the same requests in flight, measured in the same run. Prints one RESULTS line (JSON rows)
for bench/run_all.py.

    python bench/disk_tier.py --limit-mib 256 --dir /var/tmp [--runners shm torchrl cpprb memmap]
"""
import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FRAME = (84, 84, 4)
FRAME_BYTES = 84 * 84 * 4
BATCH = 64
BLOCK = 256


def _frames(np, start, n):
  out = np.empty((n,) + FRAME, np.uint8)
  out[:] = (np.arange(start, start + n) % 251).astype(np.uint8)[:, None, None, None]
  return out


def _join(procs_file):
  if procs_file:
    with open(procs_file, "w", encoding="utf-8") as f:
      f.write(str(os.getpid()))


def _measure(op, seconds, warmup=1.0):
  end = time.monotonic() + warmup
  while time.monotonic() < end:
    op()
  n, t0 = 0, time.monotonic()
  while time.monotonic() - t0 < seconds:
    op()
    n += 1
  return n * BATCH / (time.monotonic() - t0)


def run_shm(args):
  import numpy as np  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.dirname(HERE))
  import reverb_shm as reverb  # pylint: disable=import-outside-toplevel
  _join(args.procs)
  table = reverb.Table("d1", reverb.selectors.Uniform(), reverb.selectors.Fifo(), args.n,
                       reverb.rate_limiters.MinSize(1))
  server = reverb.Server([table], storage=args.dir, max_bytes=args.n * FRAME_BYTES * 2 + (256 << 20),
                         max_procs=4)
  try:
    st = server.shared_table("d1")
    for s in range(0, args.n, BLOCK):
      st.insert({"frame": _frames(np, s, min(BLOCK, args.n - s))}, 1.0)
    out = [np.empty((BATCH,) + FRAME, np.uint8)]
    rate = _measure(lambda: st.sample_batch(BATCH, out=out), args.seconds)
    assert (out[0][:, 0, 0, 0] == out[0][:, -1, -1, -1]).all()
  finally:
    server.stop()
  return rate, "Server(storage=DIR) SharedTable.sample_batch(64, out=), Uniform"


def run_torchrl(args):
  import numpy as np  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from torchrl.data import LazyMemmapStorage, ReplayBuffer  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(1)
  _join(args.procs)
  rb = ReplayBuffer(storage=LazyMemmapStorage(args.n, scratch_dir=args.dir), batch_size=BATCH)
  for s in range(0, args.n, BLOCK):
    rb.extend(torch.from_numpy(_frames(np, s, min(BLOCK, args.n - s))))
  rate = _measure(rb.sample, args.seconds)
  return rate, "ReplayBuffer(LazyMemmapStorage(scratch_dir=DIR)).sample() (batch 64, random)"


def run_cpprb(args):
  import numpy as np  # pylint: disable=import-outside-toplevel
  from cpprb import ReplayBuffer  # pylint: disable=import-outside-toplevel
  _join(args.procs)
  rb = ReplayBuffer(args.n, {"obs": {"shape": FRAME, "dtype": np.uint8}},
                    mmap_prefix=os.path.join(args.dir, "cpprb"))
  for s in range(0, args.n, BLOCK):
    rb.add(obs=_frames(np, s, min(BLOCK, args.n - s)))
  rate = _measure(lambda: rb.sample(BATCH), args.seconds)
  return rate, "ReplayBuffer(mmap_prefix=DIR/...).sample(64)"


def run_memmap(args):
  import numpy as np  # pylint: disable=import-outside-toplevel
  _join(args.procs)
  mm = np.memmap(os.path.join(args.dir, "raw.u8"), np.uint8, "w+", shape=(args.n,) + FRAME)
  for s in range(0, args.n, BLOCK):
    mm[s:s + BLOCK] = _frames(np, s, min(BLOCK, args.n - s))
  mm.flush()
  rng = np.random.default_rng(0)
  out = np.empty((BATCH,) + FRAME, np.uint8)
  page = mmap.PAGESIZE

  def gather():
    # All 64 reads are requested before the copy waits on the first (MADV_WILLNEED per frame),
    # as the disk tier's gather does: the disk serves them with a queue depth of up to 64, its
    # random-read bandwidth for this pattern, not that of one 4 KiB fault at a time.
    idx = rng.integers(0, args.n, BATCH)
    for i in idx.tolist():
      start = i * FRAME_BYTES
      first = start - start % page
      mm._mmap.madvise(mmap.MADV_WILLNEED, first, start + FRAME_BYTES - first)  # pylint: disable=protected-access
    np.take(mm, idx, axis=0, out=out)

  rate = _measure(gather, args.seconds)
  return rate, ("np.take of 64 random frames from a np.memmap, each frame's pages requested first "
                "(MADV_WILLNEED; disk random-read reference)")


RUNNERS = {"shm": run_shm, "torchrl": run_torchrl, "cpprb": run_cpprb, "memmap": run_memmap}


def memory_cgroup(limit):
  """(path, kind) of a new memory cgroup limited to `limit` bytes: kind "v2" (memory.max, where
  the unified hierarchy has the memory controller) or "v1" (memory.limit_in_bytes, below this
  process's memory cgroup); (None, reason) when none can be created. Join it by writing a pid
  to path/cgroup.procs; remove it with os.rmdir once its processes are gone."""
  name = f"rvshm_mem_{os.getpid()}"
  try:
    with open("/sys/fs/cgroup/cgroup.controllers", encoding="utf-8") as f:
      if "memory" in f.read().split():
        path = os.path.join("/sys/fs/cgroup", name)
        os.mkdir(path)
        with open(os.path.join(path, "memory.max"), "w", encoding="utf-8") as f:
          f.write(str(limit))
        return path, "v2"
  except OSError:
    pass
  try:
    with open("/proc/self/cgroup", encoding="utf-8") as f:
      own = next(l.split(":", 2)[2].strip() for l in f if l.split(":", 2)[1] == "memory")
    path = os.path.join("/sys/fs/cgroup/memory", own.lstrip("/"), name)
    os.mkdir(path)
    with open(os.path.join(path, "memory.limit_in_bytes"), "w", encoding="utf-8") as f:
      f.write(str(limit))
    return path, "v1"
  except (OSError, StopIteration) as e:
    return None, (f"no memory cgroup can be created here (no v2 memory controller; v1: {e})")


def remove_cgroup(path):
  """Removes a cgroup of memory_cgroup once its processes have exited (a few seconds at most)."""
  for _ in range(50):
    try:
      os.rmdir(path)
      return
    except OSError:
      time.sleep(0.1)


def controller(args):
  limit = args.limit_mib << 20
  n = 4 * limit // FRAME_BYTES
  cgroup, kind = memory_cgroup(limit)
  note = None if cgroup else f"{kind}: D1 runs without a memory limit"
  pythons = {"shm": sys.executable, "memmap": sys.executable,
             "torchrl": args.torchrl_python, "cpprb": args.cpprb_python}
  rows, notes = [], [note] if note else []
  try:
    for runner in args.runners:
      python = pythons[runner]
      if not python or not os.path.exists(python):
        notes.append(f"D1 {runner} skipped: no interpreter ({python!r})")
        continue
      work = tempfile.mkdtemp(prefix=f"d1_{runner}_", dir=args.dir)
      cmd = [python, os.path.abspath(__file__), "--runner", runner, "--n", str(n), "--dir", work,
             "--seconds", str(args.seconds)]
      if cgroup:
        cmd += ["--procs", os.path.join(cgroup, "cgroup.procs")]
      try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
      finally:
        shutil.rmtree(work, ignore_errors=True)
      line = next((l for l in proc.stdout.splitlines() if l.startswith("ROW ")), None)
      if proc.returncode or line is None:
        notes.append(f"D1 {runner} failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
        continue
      row = json.loads(line[4:])
      row.update(table_items=n, limit_mib=args.limit_mib, data_mib=n * FRAME_BYTES >> 20)
      rows.append(row)
  finally:
    if cgroup:
      remove_cgroup(cgroup)
  return rows, notes


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--runner", choices=sorted(RUNNERS))
  p.add_argument("--runners", nargs="+", default=["memmap", "shm", "torchrl", "cpprb"])
  p.add_argument("--n", type=int)
  p.add_argument("--procs")
  p.add_argument("--dir", default="/var/tmp")
  p.add_argument("--limit-mib", type=int, default=256)
  p.add_argument("--seconds", type=float, default=5.0)
  p.add_argument("--torchrl-python", default=os.environ.get("TORCHRL_PYTHON"))
  p.add_argument("--cpprb-python", default=os.environ.get("CPPRB_PYTHON"))
  args = p.parse_args(argv)
  if args.runner:
    items_per_s, api = RUNNERS[args.runner](args)
    print("ROW " + json.dumps({"workload": "D1", "variant": args.runner, "api": api,
                               "items_per_s": items_per_s,
                               "mb_per_s": items_per_s * FRAME_BYTES / 1e6}), flush=True)
    return 0
  rows, notes = controller(args)
  for r in rows:
    print(f"D1 {r['variant']:<8} {r['mb_per_s']:9.0f} MB/s  {r['api']}")
  for n in notes:
    print("note:", n)
  print("RESULTS " + json.dumps({"rows": rows, "notes": notes}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
