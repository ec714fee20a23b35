"""First benchmark harness of reverb_shm: throughput of the core workloads in one process.

    python bench/bench_core.py            # ~2.5 s per workload, tables of 1M items
    python bench/bench_core.py --quick    # smoke run: short durations, small tables

Workloads (steps are {'obs': float32[8], 'action': int64, 'reward': float32}):
  insert         Client.insert of one step per call (1-step items)
  writer         TrajectoryWriter: append a step, create an item over the last 2 steps
  uniform        SharedTable.sample_batch(256) from a Uniform table
  prioritized    SharedTable.sample_batch(256) from a Prioritized(0.6) table + update of the
                 sampled keys' priorities (SharedTable.update_priorities)
  frames         84x84x4 uint8 frames: Client.insert per frame (MB/s), and
                 SharedTable.sample_batch(64) into a caller-supplied buffer (MB/s), next to
                 numpy's own copy bandwidth measured in the same run (a gather of 64 random
                 frames by fancy indexing, and a plain 64 MiB copy) as the reference.

Each workload runs for a fixed duration after a warm-up, uses only the public API, prints one
row of the table and is written, with the machine description, to bench/results/*.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time
from typing import Callable

import numpy as np

import reverb_shm as reverb

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
FRAME_SHAPE = (84, 84, 4)
FRAME_BYTES = int(np.prod(FRAME_SHAPE))
MB = 1e6
TABLE = "bench"


def step(i: int) -> dict:
    return {"obs": np.full(8, i, np.float32), "action": np.int64(i), "reward": np.float32(i)}


def batch_of_steps(n: int, start: int = 0) -> dict:
    """n steps with a leading batch dimension (for SharedTable.insert)."""
    values = np.arange(start, start + n)
    return {"obs": np.repeat(values[:, None], 8, axis=1).astype(np.float32),
            "action": values.astype(np.int64), "reward": values.astype(np.float32)}


def timed(op: Callable[[], int], duration: float, warmup: float) -> tuple[float, int, float]:
    """Runs op (which returns the number of items it handled) for warmup, then duration.

    Returns:
        (items per second, items, seconds) of the measured phase.
    """
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        op()
    items = 0
    start = time.perf_counter()
    end = start + duration
    now = start
    while now < end:
        items += op()
        now = time.perf_counter()
    seconds = now - start
    return items / seconds, items, seconds


def make_server(sampler, num_items: int, item_bytes: int) -> reverb.Server:
    """A server with one table of ``num_items`` items, with room for them in the arena."""
    table = reverb.Table(TABLE, sampler=sampler, remover=reverb.selectors.Fifo(),
                         max_size=num_items, rate_limiter=reverb.rate_limiters.MinSize(1))
    arena = max(256 << 20, 2 * num_items * (item_bytes + 256))
    return reverb.Server([table], arena_bytes=arena)


def fill(table: reverb.SharedTable, num_items: int, block: int = 10_000) -> None:
    for start in range(0, num_items, block):
        n = min(block, num_items - start)
        table.insert(batch_of_steps(n, start), np.random.default_rng(start).random(n) + 0.1)


# ---------------------------------------------------------------------------------------
# Workloads: each returns a result row (dict).


def bench_insert(args) -> dict:
    with make_server(reverb.selectors.Uniform(), args.table_items, 64) as server:
        client = server.localhost_client()
        data, priorities = step(1), {TABLE: 1.0}

        def op():
            for _ in range(100):
                client.insert(data, priorities)
            return 100

        rate, items, seconds = timed(op, args.duration, args.warmup)
    return {"workload": "insert", "api": "Client.insert (1 step per call)",
            "items_per_s": rate, "items": items, "seconds": seconds}


def bench_writer(args) -> dict:
    with make_server(reverb.selectors.Uniform(), args.table_items, 64) as server:
        client = server.localhost_client()
        writer = client.trajectory_writer(num_keep_alive_refs=2)
        steps = [step(i) for i in range(100)]
        episode_steps = 0

        def op():
            nonlocal episode_steps
            for data in steps:
                writer.append(data)
                episode_steps += 1
                if episode_steps >= 2:
                    history = writer.history
                    writer.create_item(TABLE, 1.0, {
                        "obs": history["obs"][-2:], "action": history["action"][-2:],
                        "reward": history["reward"][-2:]})
            if episode_steps >= 1000:
                writer.end_episode()
                episode_steps = 0
            return len(steps)

        rate, items, seconds = timed(op, args.duration, args.warmup)
        writer.close()
    return {"workload": "writer", "api": "TrajectoryWriter append + create_item (2 steps)",
            "items_per_s": rate, "items": items, "seconds": seconds}


def bench_uniform(args) -> dict:
    with make_server(reverb.selectors.Uniform(), args.table_items, 64) as server:
        table = server.shared_table(TABLE)
        fill(table, args.table_items)

        def op():
            return len(table.sample_batch(256).info.key)

        rate, items, seconds = timed(op, args.duration, args.warmup)
    return {"workload": "uniform", "api": "SharedTable.sample_batch(256)",
            "table_items": args.table_items, "items_per_s": rate, "items": items,
            "seconds": seconds}


def bench_prioritized(args) -> dict:
    with make_server(reverb.selectors.Prioritized(0.6), args.table_items, 64) as server:
        table = server.shared_table(TABLE)
        fill(table, args.table_items)
        rng = np.random.default_rng(0)

        def op():
            keys = table.sample_batch(256).info.key
            table.update_priorities(keys, rng.random(len(keys)) + 0.1)
            return len(keys)

        rate, items, seconds = timed(op, args.duration, args.warmup)
    return {"workload": "prioritized",
            "api": "SharedTable.sample_batch(256) + update_priorities",
            "table_items": args.table_items, "items_per_s": rate, "items": items,
            "seconds": seconds}


def bench_frames(args) -> list[dict]:
    rows = []
    frames = args.frame_items
    with make_server(reverb.selectors.Uniform(), frames, FRAME_BYTES) as server:
        client = server.localhost_client()
        table = server.shared_table(TABLE)
        frame = np.random.default_rng(0).integers(0, 256, FRAME_SHAPE, dtype=np.uint8)

        def insert_op():
            for _ in range(16):
                client.insert({"frame": frame}, {TABLE: 1.0})
            return 16

        rate, items, seconds = timed(insert_op, args.duration, args.warmup)
        rows.append({"workload": "frames_insert", "api": "Client.insert (1 frame per call)",
                     "items_per_s": rate, "mb_per_s": rate * FRAME_BYTES / MB,
                     "items": items, "seconds": seconds})

        while table.size < frames:  # make sure the table holds `frames` frames
            client.insert({"frame": frame}, {TABLE: 1.0})
        out = np.empty((64, 1) + FRAME_SHAPE, np.uint8)  # Client.insert adds a time dim of 1

        def sample_op():
            return len(table.sample_batch(64, out=[out]).info.key)

        rate, items, seconds = timed(sample_op, args.duration, args.warmup)
        rows.append({"workload": "frames_sample", "api": "SharedTable.sample_batch(64, out=)",
                     "table_items": frames, "items_per_s": rate,
                     "mb_per_s": rate * FRAME_BYTES / MB, "items": items, "seconds": seconds})

    source = np.random.default_rng(1).integers(0, 256, (frames,) + FRAME_SHAPE, dtype=np.uint8)
    rng = np.random.default_rng(2)

    def gather_op():
        return len(source[rng.integers(0, frames, 64)])  # numpy's fastest gather

    rate, items, seconds = timed(gather_op, args.duration, args.warmup)
    rows.append({"workload": "numpy_gather", "api": "numpy fancy indexing of 64 random frames (reference)",
                 "table_items": frames, "items_per_s": rate,
                 "mb_per_s": rate * FRAME_BYTES / MB, "items": items, "seconds": seconds})

    big_src = np.ones(64 << 20, np.uint8)
    big_dst = np.empty_like(big_src)

    def copy_op():
        np.copyto(big_dst, big_src)
        return big_src.nbytes // FRAME_BYTES

    rate, items, seconds = timed(copy_op, args.duration, args.warmup)
    rows.append({"workload": "numpy_copy", "api": "np.copyto of 64 MiB (reference)",
                 "items_per_s": rate, "mb_per_s": rate * FRAME_BYTES / MB,
                 "items": items, "seconds": seconds})
    gather_mb = rows[2]["mb_per_s"]
    rows[1]["vs_numpy_gather"] = rows[1]["mb_per_s"] / gather_mb
    rows[1]["vs_numpy_copy"] = rows[1]["mb_per_s"] / rows[3]["mb_per_s"]
    return rows


WORKLOADS = {"insert": bench_insert, "writer": bench_writer, "uniform": bench_uniform,
             "prioritized": bench_prioritized, "frames": bench_frames}


def print_table(rows: list[dict]) -> None:
    print(f"\n{'workload':<15} {'items/s':>12} {'MB/s':>9}  api")
    for row in rows:
        mb = f"{row['mb_per_s']:9.0f}" if "mb_per_s" in row else " " * 9
        extra = ""
        if "vs_numpy_gather" in row:
            extra = (f"  ({row['vs_numpy_gather']:.0%} of numpy gather, "
                     f"{row['vs_numpy_copy']:.0%} of numpy copy)")
        print(f"{row['workload']:<15} {row['items_per_s']:12,.0f} {mb}  {row['api']}{extra}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="reverb_shm core throughput")
    p.add_argument("--quick", action="store_true", help="short smoke run with small tables")
    p.add_argument("--only", nargs="+", choices=sorted(WORKLOADS), help="workloads to run")
    p.add_argument("--duration", type=float, help="measured seconds per workload")
    p.add_argument("--table-items", type=int, help="items in the sampled tables")
    args = p.parse_args(argv)
    args.duration = args.duration or (0.3 if args.quick else 2.5)
    args.warmup = 0.05 if args.quick else 0.5
    args.table_items = args.table_items or (10_000 if args.quick else 1_000_000)
    args.frame_items = 500 if args.quick else 4_000

    rows: list[dict] = []
    for name in args.only or WORKLOADS:
        print(f"running {name} ...", flush=True)
        result = WORKLOADS[name](args)
        rows.extend(result if isinstance(result, list) else [result])
    print_table(rows)

    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = RESULTS_DIR / f"bench_core-{stamp}{'-quick' if args.quick else ''}.json"
    path.write_text(json.dumps({
        "time": stamp, "quick": args.quick, "duration_s": args.duration,
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                    "cpus": os.cpu_count(), "numpy": np.__version__},
        "reverb_shm": reverb.__version__, "results": rows}, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
