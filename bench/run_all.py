"""Runs every workload on reverb_shm and, in the same run, on the installed peers; prints the
table with ratios, writes JSON and a plot of the scaling curves to bench/results/.

    python bench/run_all.py                 # full run (~15 min; fills 1M-item tables)
    python bench/run_all.py --quick         # smoke run (small tables, short durations)
    python bench/run_all.py --repeat 3      # every runner 3 times; the table shows the medians

Peers run in their own venvs (bench/make_peer_venvs.sh or tests/peers/venv.sh NAME creates them):
--reverb-python (dm-reverb 0.14 + tensorflow), --cpprb-python (cpprb 11) and --torchrl-python
(torch 2.14.1 + torchrl 0.14.1); a peer whose interpreter is missing or cannot import it is
skipped with a note. Workloads: see README (W1-W6, scaling, metadata) and
bench/learner_workloads.py (L1, L2: the learner's iterator; needs torch in this Python).

    python bench/run_all.py --only L1 L2    # the learner workloads and their ratio rows
"""
import argparse
import datetime
import hashlib
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
SCALES = [1_000, 10_000, 100_000, 1_000_000, 10_000_000]

# (name, target) of every ratio the issue asks for: (label, numerator, denominator, target).
# A side is (runner, workload, variant).
RATIOS = [
    *[(f"{w} vs dm-reverb, {v}", ("shm", w, v), ("reverb", w, v), 30.0)
      for w in ("W1", "W2", "W3", "W4") for v in ("reverb_api", "fastest")],
    ("W1 vs cpprb ReplayBuffer", ("shm", "W1", "fastest"), ("cpprb", "W1", "ReplayBuffer"), 1.0),
    ("W3 vs cpprb ReplayBuffer", ("shm", "W3", "fastest"), ("cpprb", "W3", "ReplayBuffer"), 1.0),
    ("W4 vs cpprb PrioritizedReplayBuffer", ("shm", "W4", "fastest"),
     ("cpprb", "W4", "PrioritizedReplayBuffer"), 1.0),
    ("W5 insert vs cpprb ReplayBuffer", ("shm", "W5_insert", "fastest"),
     ("cpprb", "W5_insert", "ReplayBuffer"), 1.0),
    ("W5 sample vs cpprb ReplayBuffer", ("shm", "W5_sample", "fastest"),
     ("cpprb", "W5_sample", "ReplayBuffer"), 1.1),
    ("W4 vs cpprb MPPrioritizedReplayBuffer", ("shm", "W4", "fastest"),
     ("cpprb", "W4", "MPPrioritizedReplayBuffer"), 10.0),
    ("W5 sample vs numpy copy bandwidth", ("shm", "W5_sample", "fastest"),
     ("shm", "W5_copy", "numpy"), 1.0),
    # the same copy from a /dev/shm mapping: the frames' kind of memory (numpy's own arrays of
    # 64 MiB get transparent huge pages where shmem may get none: machine.thp in the JSON)
    ("W5 sample vs numpy copy from shared memory", ("shm", "W5_sample", "fastest"),
     ("shm", "W5_copy", "numpy_shm"), 1.0),
    ("W6 cross-process vs in-process", ("shm", "W6", "cross_process"),
     ("shm", "W6", "in_process"), 1.2),
    ("W6 4 writers cross-process vs in-process", ("shm", "W6", "cross_process_4w"),
     ("shm", "W6", "in_process"), None),
    ("W6 sampler on learner.BatchIterator vs in-process", ("shm", "W6", "cross_process_learner"),
     ("shm", "W6", "in_process"), None),
    # G1: the same workloads on servers that start at 8 MiB and grow (growth costs ~nothing),
    # both servers timed in alternating rounds in one process (bench/growth_g1.py)
    *[(f"G1 {w} {v}: grown arena vs pre-sized", ("g1_grown", w, v), ("g1_presized", w, v), 0.97)
      for w, v in (("W1", "fastest"), ("W1", "reverb_api"), ("W3", "fastest"),
                   ("W5_insert", "fastest"), ("W5_sample", "fastest"))],
    # the same numpy copy timed as both: how far two timings of identical work differ (noise)
    ("G1 noise floor: the same numpy copy timed as grown vs as pre-sized",
     ("g1_grown", "W5_copy", "numpy"), ("g1_presized", "W5_copy", "numpy"), None),
    # two identical pre-sized servers: what page placement alone does to W3 (bench/growth_g1.py)
    ("G1 W3 control: a second pre-sized server vs the first",
     ("g1_presized", "W3", "control"), ("g1_presized", "W3", "fastest"), None),
    # D1: disk tier, 84x84x4 frames worth 4x a memory cgroup's limit, batch-64 samples (MB/s)
    ("D1 disk tier vs TorchRL LazyMemmapStorage", ("disk", "D1", "shm"), ("disk", "D1", "torchrl"),
     1.0),
    ("D1 disk tier vs cpprb mmap_prefix", ("disk", "D1", "shm"), ("disk", "D1", "cpprb"), 1.0),
    ("D1 disk tier vs the disk's random reads (memmap gather)", ("disk", "D1", "shm"),
     ("disk", "D1", "memmap"), 0.7),
    ("R1 co-located writers vs TorchRL RayReplayBuffer", ("shm_ray", "R1_write", "reverb_shm"),
     ("torchrl_ray", "R1_write", "RayReplayBuffer"), 20.0),
    ("R1 learner sample(256) over 3 nodes vs RayReplayBuffer.sample",
     ("shm_ray", "R1_sample", "reverb_shm"), ("torchrl_ray", "R1_sample", "RayReplayBuffer"), 5.0),
    # the cost of a cross-node sample against a same-node one (time per call; no target)
    ("R1 cross-node sample cost / same-node (lower is better)",
     ("shm_ray", "R1_cross", "same_node"), ("shm_ray", "R1_cross", "cross_node"), None),
    *[(f"T1 TrajectoryDataset.batch(256) vs dm-reverb, {v}", ("shm", "T1", v),
       ("reverb", "T1", v), 10.0) for v in ("uniform", "prioritized")],
    # W8: Reverb client calls with default arguments, the same code on both (api_workloads.py)
    *[(f"W8 {v} vs dm-reverb", ("shm", "W8", v), ("reverb", "W8", v), 30.0)
      for v in ("sample_timesteps", "sample_flat", "sample_signature", "insert_one_table",
                "insert_two_tables", "mutate_dict", "writer_two_tables", "frames_sample")],
]
# Workloads of a Ray cluster: run by bench/ray_r1.py and the TorchRL peer, not by the others.
RAY_WORKLOADS = ("R1",)


def peer_python(name):
  """The python of peer venv NAME as tests/peers/venv.sh names it, when it has been built."""
  req = HERE.parent / "tests" / "peers" / f"{name}.txt"
  root = pathlib.Path(os.environ.get("REVERB_SHM_PEERS",
                                     pathlib.Path.home() / ".cache" / "reverb_shm" / "peers"))
  if not req.exists():
    return None
  venv = root / f"{name}-{hashlib.sha256(req.read_bytes()).hexdigest()[:12]}"
  return str(venv / "bin" / "python") if (venv / ".ready").exists() else None


def cpu_model():
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or None


def memory_bandwidth(seconds=1.0):
  """Copy bandwidth of this machine (GB/s of bytes read, best of repeated np.copyto of 64 MiB
  to 64 MiB, far beyond any last-level cache) and a STREAM-like triad a = b + 3 * c on float64
  arrays of 32 MiB each (GB/s of 3 arrays' bytes moved, best of repeats)."""
  import time  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  src, dst = np.ones(64 << 20, np.uint8), np.zeros(64 << 20, np.uint8)
  b, c = np.ones(4 << 20), np.ones(4 << 20)
  a = np.empty_like(b)
  best = {"copy": 0.0, "triad": 0.0}
  end = time.perf_counter() + seconds
  while time.perf_counter() < end:
    t0 = time.perf_counter()
    np.copyto(dst, src)
    t1 = time.perf_counter()
    np.multiply(c, 3.0, out=a)
    np.add(a, b, out=a)
    t2 = time.perf_counter()
    best["copy"] = max(best["copy"], src.nbytes / (t1 - t0) / 1e9)
    best["triad"] = max(best["triad"], 3 * a.nbytes / (t2 - t1) / 1e9)
  return {"numpy_copy_gb_s": round(best["copy"], 2), "triad_gb_s": round(best["triad"], 2)}


def huge_page_modes():
  """The kernel's transparent huge page modes (the bracketed choice of each sysfs file) for
  anonymous memory and for shmem (/dev/shm, where tables live); None where unreadable."""
  modes = {}
  for key, name in (("thp_anon", "enabled"), ("thp_shmem", "shmem_enabled")):
    try:
      text = pathlib.Path("/sys/kernel/mm/transparent_hugepage", name).read_text()
      modes[key] = text.split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
      modes[key] = None
  return modes


def run_runner(python, script, args, workloads, timeout, extra_env=None, argv=None):
  """Runs one runner script (with `argv` instead of the workload options, if given); returns
  (rows, note)."""
  cmd = [python, str(HERE / script)] + (argv if argv is not None else [
      "--workloads", *workloads, "--duration", str(args.duration), "--warmup", str(args.warmup),
      "--items", str(args.items), "--frames", str(args.frames), "--scales", *map(str, args.scales)])
  env = dict(os.environ, PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""),
             **(extra_env or {}))
  # No idle BLAS worker threads spinning beside the measured loop (every runner alike): numpy's
  # OpenBLAS pool costs a few % of a 2-core machine and none of the workloads use BLAS.
  for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    env.setdefault(var, "1")
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
  except (OSError, subprocess.TimeoutExpired) as e:
    return [], f"{script}: {e}"
  for line in proc.stdout.splitlines():
    if line.startswith("RESULTS "):
      return json.loads(line[len("RESULTS "):]), None
  return [], f"{script} failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}"


RAY_SCRIPTS = ("ray_r1.py", "peer_torchrl_ray.py")


def torchrl_ray_python() -> str:
  """The python of the torchrl_ray peer venv (tests/peers/venv.sh builds it on first use)."""
  try:
    return subprocess.run(["bash", str(HERE.parent / "tests" / "peers" / "venv.sh"),
                           "torchrl_ray"], capture_output=True, text=True, timeout=3600,
                          check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError) as e:
    return f"(torchrl_ray venv unavailable: {e})"


def peer_available(python, module):
  try:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                          timeout=300).returncode == 0
  except (OSError, subprocess.TimeoutExpired):
    return False


def median_rows(runs):
  """Rows of several runs of one runner merged: numeric fields are medians."""
  merged = {}
  for rows in runs:
    for r in rows:
      merged.setdefault((r["workload"], r["variant"]), []).append(r)
  out = []
  for group in merged.values():
    r = dict(group[0])
    for k, v in r.items():
      if isinstance(v, float):
        r[k] = statistics.median(g[k] for g in group)
    r["runs"] = len(group)
    out.append(r)
  return out


def lookup(results, side):
  runner, workload, variant = side
  for r in results.get(runner, []):
    if r["workload"] == workload and r["variant"] == variant:
      return r.get("mb_per_s", r["items_per_s"]) if "mb_per_s" in r else r["items_per_s"]
  return None


def learner_ratios(results):
  """Ratio rows of L1 (learner loop) and L2 (sequences)."""
  def get(runner, workload, variant, field="items_per_s"):
    for r in results.get(runner, []):
      if r["workload"] == workload and r["variant"] == variant:
        return r.get(field)
    return None
  out = []

  def add(label, value, target, higher_is_better=True):
    met = None if value is None else (value >= target if higher_is_better else value <= target)
    out.append({"ratio": label, "value": value, "target": target, "met": met})

  ours = get("learner", "L1", "iterator")
  trl = [v for v in (get("torchrl", "L1", "no_prefetch"), get("torchrl", "L1", "prefetch4")) if v]
  if ours is not None or trl:
    add("L1 vs TorchRL PrioritizedSampler (better of prefetch None/4)",
        ours / max(trl) if ours and trl else None, 5.0)
    rev = get("reverb", "L1", "dataset")
    add("L1 vs dm-reverb TrajectoryDataset + mutate_priorities",
        ours / rev if ours and rev else None, 30.0)
    jax_it = get("learner", "L1", "jax_iterator")
    add("L1 JaxIterator vs TorchIterator, both on the CPU (within 1.3x)",
        jax_it / ours if jax_it and ours else None, round(1 / 1.3, 2))
    hand = get("learner", "L1", "hand_loop")
    add("L1 iterator vs hand-written sample_batch loop", ours / hand if ours and hand else None,
        1.0)
    it_us = get("learner", "L1", "iterator_step_1ms", "us_per_iter")
    step_us = get("learner", "L1", "step_only_1ms", "us_per_iter")
    add("L1 with 1 ms step: iteration time / 1 ms (lower is better)",
        it_us / 1000 if it_us else None, 1.10, higher_is_better=False)
    add("L1 with 1 ms step: iteration time / step alone (lower is better)",
        it_us / step_us if it_us and step_us else None, 1.10, higher_is_better=False)
  ours2 = get("learner", "L2", "iterator")
  if ours2 is not None or get("torchrl", "L2", "SliceSampler"):
    trl2 = get("torchrl", "L2", "SliceSampler")
    add("L2 windows/s vs TorchRL SliceSampler", ours2 / trl2 if ours2 and trl2 else None, 5.0)

  def costs(prefix):   # {table steps: µs per window}
    return {r["table_steps"]: r["us_per_window"] for r in results.get("learner", [])
            if r["workload"].startswith(prefix)}

  def growth(label, cost, base, target=None):
    """The row `label`: cost at the largest size / cost at `base` steps, if both were run."""
    if base in cost and max(cost) > base:
      value = cost[max(cost)] / cost[base]
      if target is None:
        out.append({"ratio": label.format(top=max(cost)), "value": value, "target": None,
                    "met": None})
      else:
        add(label.format(top=max(cost)), value, target, higher_is_better=False)

  sc, floor = costs("L2_scale_"), costs("L2_floor_")
  growth("L2 cost at {top:.0e} steps / cost at 1e5 (lower is better)", sc, 100_000, 1.5)
  growth("L2 numpy copy of the windows: cost at {top:.0e} steps / cost at 1e5 (the memory "
         "system's growth; lower is better)", floor, 100_000)
  # From 1e6 steps (44 MB) on, the steps outgrow this machine kind's 32 MB last-level cache:
  # the growth with size alone, beyond the cache's.
  growth("L2 cost at {top:.0e} steps / cost at 1e6 (steps beyond the last-level cache at both; "
         "lower is better)", sc, 1_000_000)
  growth("L2 numpy copy of the windows: cost at {top:.0e} steps / cost at 1e6 (lower is "
         "better)", floor, 1_000_000)
  return out


def ratios(results):
  out = learner_ratios(results)
  for label, num, den, target in RATIOS:
    a, b = lookup(results, num), lookup(results, den)
    ratio = a / b if a and b else None
    out.append({"ratio": label, "value": ratio, "target": target,
                "met": None if ratio is None or target is None else ratio >= target})
  sc = {r["table_items"]: r["us_per_item"] for r in results.get("shm", [])
        if r["workload"].startswith("scale_")}
  if 10_000 in sc and max(sc) > 10_000:
    v = sc[max(sc)] / sc[10_000]
    out.append({"ratio": f"W4 cost at {max(sc):.0e} items / cost at 1e4 (lower is better)",
                "value": v, "target": 3.0, "met": v <= 3.0})
  wake = {r["variant"]: r for r in results.get("shm", []) if r["workload"] == "W7"}
  if "table_wake" in wake and "futex_floor" in wake:
    for p in ("p50", "p99"):
      v = wake["table_wake"][f"{p}_us"] / wake["futex_floor"][f"{p}_us"]
      target = 1.5 if p == "p50" else None
      out.append({"ratio": f"W7 wake latency {p} / futex ping-pong floor (lower is better)",
                  "value": v, "target": target, "met": None if target is None else v <= target})
  for r in results.get("shm", []):
    if r["workload"] == "metadata":
      out.append({"ratio": f"metadata bytes per item beyond payload, {r['api']} (lower is better)",
                  "value": r["bytes_per_item"], "target": 128, "met": r["bytes_per_item"] <= 128})
      if "attach_rss_bytes" in r:   # RSS grows only with the pages a process touches
        v = r["attach_rss_bytes"] / r["segment_bytes"]
        out.append({"ratio": f"attach RSS growth / segment (+{r['sample_rss_bytes'] / 2**20:.0f} "
                             "MiB after 2560 samples)",
                    "value": v, "target": 0.01, "met": v <= 0.01})
  return out


def print_table(results, ratio_rows, notes):
  print(f"\n{'runner':<9} {'workload':<12} {'variant':<26} {'items/s':>13} {'MB/s':>8}  api")
  for runner, rows in results.items():
    for r in rows:
      mb = f"{r['mb_per_s']:8.0f}" if "mb_per_s" in r else " " * 8
      extra = f"  [{r['table_items']:,} items]" if "table_items" in r else ""
      if "us_per_iter" in r:
        extra += f" [{r['us_per_iter']:.0f} us per iteration]"
      if "p50_us" in r:
        extra += f" [p50 {r['p50_us']:.1f} us, p99 {r['p99_us']:.1f} us]"
      print(f"{runner:<9} {r['workload']:<12} {r['variant']:<26} {r['items_per_s']:13,.0f} {mb}"
            f"  {r['api']}{extra}")
  print(f"\n{'ratio':<62} {'value':>9} {'target':>8}  met")
  for r in ratio_rows:
    v = "n/a" if r["value"] is None else f"{r['value']:9.2f}"
    met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
    target = "-" if r["target"] is None else r["target"]
    print(f"{r['ratio']:<62} {v:>9} {target:>8}  {met}")
  for n in notes:
    print("note:", n)


def plot(results, path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return "matplotlib not installed (pip install 'reverb_shm[bench]'): no plot"
  fig, ax = plt.subplots(figsize=(6, 4))
  for runner, rows in results.items():
    pts = sorted((r["table_items"], 1e6 / r["items_per_s"]) for r in rows
                 if r["workload"].startswith("scale_"))
    if pts:
      ax.plot(*zip(*pts), marker="o", label={"shm": "reverb_shm SharedTable",
                                             "cpprb": "cpprb PrioritizedReplayBuffer"}[runner])
  ax.set(xscale="log", yscale="log", xlabel="items in table",
         ylabel="µs per item (sample 256 + priority update)", title="W4 scaling")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path)
  return None


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--repeat", type=int, default=1)
  p.add_argument("--only", nargs="+",
                 help="workloads (W1..W8, T1, scaling, metadata, G1, D1, L1, L2, R1)")
  p.add_argument("--torchrl-python", default=os.environ.get("TORCHRL_PYTHON",
                                                            peer_python("torchrl")))
  p.add_argument("--d1-dir", default=os.environ.get("REVERB_SHM_D1_DIR", "/var/tmp"),
                 help="directory on the disk D1 measures (every runner's files go there)")
  p.add_argument("--d1-limit-mib", type=int, default=None,
                 help="D1's memory cgroup limit (default 256 MiB, 64 with --quick)")
  # (dm-reverb and cpprb: the reverb peer venv holds both; /tmp/refvenv is
  # bench/make_peer_venvs.sh's default)
  ref = peer_python("reverb") or "/tmp/refvenv/bin/python"
  p.add_argument("--reverb-python", default=os.environ.get("REVERB_PYTHON", ref))
  p.add_argument("--cpprb-python", default=os.environ.get("CPPRB_PYTHON", ref))
  p.add_argument("--torchrl-ray-python", default=os.environ.get("TORCHRL_RAY_PYTHON"),
                 help="python of the torchrl_ray peer venv (default: tests/peers/venv.sh "
                      "torchrl_ray, built on first use)")
  args = p.parse_args(argv)
  load_start = os.getloadavg()
  args.duration = 0.5 if args.quick else 2.0
  args.warmup = 0.1 if args.quick else 0.3
  args.items = 20_000 if args.quick else 1_000_000
  args.frames = 500 if args.quick else 4_000
  args.scales = SCALES[:3] if args.quick else SCALES
  workloads = args.only or ["W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "T1", "scaling",
                            "metadata", "G1", "D1", "L1", "L2", "R1"]
  grown, disk = "G1" in workloads, "D1" in workloads
  ray_workloads = [w for w in workloads if w in RAY_WORKLOADS]
  workloads = [w for w in workloads if w not in ("G1", "D1") and w not in RAY_WORKLOADS]
  if not os.path.exists(args.reverb_python) and peer_python("reverb"):
    args.reverb_python = peer_python("reverb")
  shm = {"W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "T1", "scaling", "metadata"}
  learner = {"L1", "L2"}
  runners = [("shm", sys.executable, "shm_workloads.py", None, shm),
             ("learner", sys.executable, "learner_workloads.py", "torch", learner),
             ("reverb", args.reverb_python, "peer_reverb.py", "reverb", shm | {"L1"}),
             ("cpprb", args.cpprb_python, "peer_cpprb.py", "cpprb", shm),
             ("torchrl", args.torchrl_python or "", "peer_torchrl.py", "torchrl", learner)]
  runners = [(name, python, script, module) for name, python, script, module, known in runners
             if known & set(workloads)]
  if ray_workloads:
    runners += [("shm_ray", sys.executable, "ray_r1.py", "ray"),
                ("torchrl_ray", args.torchrl_ray_python or torchrl_ray_python(),
                 "peer_torchrl_ray.py", "torchrl.data.replay_buffers.ray_buffer, ray")]
  notes = []
  available = []
  for name, python, script, module in runners:
    if module and not peer_available(python, module):
      notes.append(f"{name} skipped: {python} cannot import {module} "
                   "(create it with bench/make_peer_venvs.sh or tests/peers/venv.sh)")
    else:
      available.append((name, python, script))
  # Repeats go round the runners (shm, peers, shm, peers, ...) so that a noisy spell on a shared
  # machine hits every runner's median alike instead of one runner's three runs.
  if grown:
    available.append(("g1", sys.executable, "growth_g1.py"))
  runs = {name: [] for name, _, _ in available}
  for i in range(args.repeat):
    for name, python, script in available:
      print(f"running {name} ({i + 1}/{args.repeat}) ...", flush=True)
      if name == "g1":   # both servers in one process, alternating (bench/growth_g1.py)
        rows, note = run_runner(python, script, args, [], timeout=3600, argv=[
            "--items", str(args.items), "--frames", str(args.frames),
            "--round", "0.1" if args.quick else "0.25", "--rounds", "6" if args.quick else "12",
            "--builds", "2" if args.quick else "6"])
      else:
        rows, note = run_runner(python, script, args,
                                ray_workloads if script in RAY_SCRIPTS else workloads,
                                timeout=3600)
      if note:
        notes.append(note)
      runs[name].append(rows)
  if disk:
    limit = args.d1_limit_mib or (64 if args.quick else 256)
    print(f"running D1 (disk tier, {limit} MiB cgroup, {args.d1_dir}) ...", flush=True)
    cmd = [sys.executable, str(HERE / "disk_tier.py"), "--limit-mib", str(limit), "--dir",
           args.d1_dir, "--seconds", "3" if args.quick else "8", "--cpprb-python",
           args.cpprb_python, "--torchrl-python", args.torchrl_python or ""]
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
      line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULTS "))
      out = json.loads(line[len("RESULTS "):])
      runs["disk"] = [out["rows"]]
      notes.extend(out["notes"])
    except (OSError, subprocess.TimeoutExpired, StopIteration) as e:
      notes.append(f"D1 failed: {e}")
  if grown:   # growth_g1.py tags each row with the server it timed
    g1 = runs.pop("g1")
    for kind in ("presized", "grown"):
      runs[f"g1_{kind}"] = [[r for r in rows if r.get("runner") == ("shm_grown" if kind == "grown"
                                                                      else "shm")] for rows in g1]
  results = {name: median_rows(r) for name, r in runs.items()}
  bandwidth = memory_bandwidth()
  print(f"cpu: {cpu_model()}; memory: numpy copy {bandwidth['numpy_copy_gb_s']} GB/s, triad "
        f"{bandwidth['triad_gb_s']} GB/s")
  # (rows of workloads not run are left out)
  ran = set(workloads) | set(ray_workloads) | ({"G1"} if grown else set()) | (
      {"D1"} if disk else set())
  ratio_rows = [r for r in ratios(results) if r["value"] is not None or
                r["ratio"].split()[0] in ran]
  print_table(results, ratio_rows, notes)
  RESULTS.mkdir(exist_ok=True)
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else "")
  note = plot(results, RESULTS / f"scaling-{stamp}.png")
  if note:
    notes.append(note)
    print("note:", note)
  path = RESULTS / f"run_all-{stamp}.json"
  path.write_text(json.dumps({
      "time": stamp, "quick": args.quick, "repeat": args.repeat, "duration_s": args.duration,
      "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "load_start": load_start,
      "machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                  "cpu_model": cpu_model(), "cpus": os.cpu_count(), "load": os.getloadavg(),
                  **bandwidth, **huge_page_modes()},
      "results": results, "ratios": ratio_rows, "notes": notes}, indent=2))
  print(f"\nwrote {path}; publish it in the docs with: python bench/report.py {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
