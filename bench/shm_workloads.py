"""reverb_shm side of the benchmark suite (run with the project's Python).

    python bench/shm_workloads.py --workloads W1 W2 W3 W4 W5 W6 scaling metadata

Prints one `RESULTS [json rows]` line. Variant "reverb_api" makes the same Reverb client calls
as bench/peer_reverb.py (what a drop-in user gets); "fastest" uses reverb_shm's fastest path
for the workload (batched writer calls, SharedTable batch sampling into caller buffers).
"""
import contextlib
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import reverb_shm as reverb  # noqa: E402
from _timing import (FRAME_BYTES, FRAME_SHAPE, pair_items_op, row, run_main,  # noqa: E402
                     shm_bytes, timed)

TABLE = "bench"
STEP_BYTES = 8 * 4 + 8 + 4   # payload of one step


def step(i):
  return {"obs": np.full(8, i, np.float32), "action": np.int64(i), "reward": np.float32(i)}


def steps(n, start=0):
  """n steps with a leading batch/time dimension."""
  v = np.arange(start, start + n)
  return {"obs": np.repeat(v[:, None], 8, axis=1).astype(np.float32),
          "action": v.astype(np.int64), "reward": v.astype(np.float32)}


# REVERB_SHM_BENCH_ARENA=grown (run_all's G1): servers start with the default 8 MiB arena and
# grow while the workloads fill them, within the same max_bytes, instead of reserving it all.
GROWN = os.environ.get("REVERB_SHM_BENCH_ARENA") == "grown"


def server(sampler, max_size, item_bytes=STEP_BYTES, limiter=None):
  table = reverb.Table(TABLE, sampler=sampler, remover=reverb.selectors.Fifo(), max_size=max_size,
                       rate_limiter=limiter or reverb.rate_limiters.MinSize(1))
  presized = max(256 << 20, 2 * max_size * (item_bytes + 256))
  # room for the table's metadata (records, index, sum tree: ~120 bytes per item) besides the arena
  max_bytes = presized + (256 << 20) + 160 * max_size
  if GROWN:
    srv = reverb.Server([table], max_bytes=max_bytes)
    _grow(srv.segment, presized)
    return srv
  return reverb.Server([table], arena_bytes=presized, max_bytes=max_bytes)


def _grow(seg, nbytes):
  """Grows the arena of an 8 MiB-start server to `nbytes` by extents (chunks held, then freed)."""
  from reverb_shm._internal import chunks  # pylint: disable=import-outside-toplevel
  held = []
  while seg.info()["arena_size"] < nbytes:
    held.append(chunks.alloc_chunk(seg, np.uint8, (1 << 20,), 16))
  for chunk in held:
    chunk.release()


def _table_bytes(info) -> int:
  """Bytes of a segment beyond its arena and pin logs: header + the tables' metadata."""
  return info["reserved_bytes"] - info["arena_size"] - info["pins_reserved"]


def fill(table, n, block=100_000):
  for s in range(0, n, block):
    b = min(block, n - s)
    table.insert(steps(b, s), np.random.default_rng(s).random(b) + 0.1)


def w1(args):
  # (at ~400k inserts/s the table reaches max_size within a run: Client.insert items append to
  # open chunks, ~48 B of arena each, so the default sizing holds max_size of them)
  with server(reverb.selectors.Uniform(), 1_000_000) as srv:
    client = srv.localhost_client()
    table = srv.shared_table(TABLE)
    data = step(1)

    def api():
      for _ in range(100):
        client.insert(data, {TABLE: 1.0})
      return 100
    rows = [row("W1", "reverb_api", "Client.insert", timed(api, args.duration, args.warmup)[0])]
    inserter = table.step_inserter(capacity=256)

    def fastest():
      for _ in range(100):
        inserter.insert(data, 1.0)
      return 100
    rows.append(row("W1", "fastest", "SharedTable.step_inserter(256).insert (1 step per call, "
                    "visible at each flush of 256)", timed(fastest, args.duration, args.warmup)[0]))
    inserter.close()
    one = steps(1)

    def unbuffered():
      for _ in range(100):
        table.insert(one, 1.0)
      return 100
    rows.append(row("W1", "insert_1step", "SharedTable.insert (1 step per call, visible at once)",
                    timed(unbuffered, args.duration, args.warmup)[0]))
  return rows


def w2(args):
  rows = []
  with server(reverb.selectors.Uniform(), 1_000_000) as srv:
    client = srv.localhost_client()
    writer = client.trajectory_writer(num_keep_alive_refs=2)
    api = pair_items_op(writer, TABLE, [step(i) for i in range(100)])
    rows.append(row("W2", "reverb_api", "TrajectoryWriter append + create_item(last 2)",
                    timed(api, args.duration, args.warmup)[0]))
    writer.end_episode()
    writer.close()

    writer = client.trajectory_writer(num_keep_alive_refs=128)
    block = steps(100)
    prios = np.ones(99)
    starts = np.arange(-100, -1)    # item t covers steps t and t + 1 of the block
    blocks = [0]

    def fastest():   # episodes of 1000 steps, as pair_items_op's
      writer.extend(block)
      writer.create_window_items(TABLE, prios, starts, 2)
      blocks[0] += 1
      if blocks[0] % 10 == 0:
        writer.end_episode()
      return 99
    rows.append(row("W2", "fastest", "TrajectoryWriter extend(100) + create_window_items(99 "
                    "windows of 2 steps)", timed(fastest, args.duration, args.warmup)[0]))
    writer.close()
  return rows


def sampling(args, workload, sampler, update):
  n = args.items
  rows = []
  with server(sampler, n) as srv:
    table = srv.shared_table(TABLE)
    client = srv.localhost_client()
    fill(table, n)
    rng = np.random.default_rng(0)

    def api():
      keys = [s.info.key for s in client.sample(TABLE, 256, emit_timesteps=False)]
      if update:
        client.mutate_priorities(TABLE, dict(zip(keys, (rng.random(len(keys)) + 0.1).tolist())))
      return len(keys)
    rows.append(row(workload, "reverb_api", "Client.sample(256)" +
                    (" + mutate_priorities" if update else ""),
                    timed(api, args.duration, args.warmup)[0], table_items=n))
    rows.append(row(workload, "fastest", FASTEST_API + (" + update_priorities" if update else ""),
                    timed(fastest_op(table, update), args.duration, args.warmup)[0],
                    table_items=n))
  return rows


FASTEST_API = "SharedTable.sample_batch(256, out=)"


def fastest_op(table, update):
  """W3/W4's fastest loop body: a batch of 256 into fixed buffers (+ new priorities for them)."""
  out = [np.empty(256, np.int64), np.empty((256, 8), np.float32), np.empty(256, np.float32)]  # sorted keys
  rng = np.random.default_rng(0)

  def op():
    keys = table.sample_batch(256, out=out).info.key
    if update:
      table.update_priorities(keys, rng.random(len(keys)) + 0.1)
    return len(keys)
  return op


def w5(args):
  rows = []
  frame = np.random.default_rng(0).integers(0, 256, FRAME_SHAPE, dtype=np.uint8)
  with server(reverb.selectors.Uniform(), args.frames, FRAME_BYTES) as srv:
    client, table = srv.localhost_client(), srv.shared_table(TABLE)

    def api():
      for _ in range(16):
        client.insert({"frame": frame}, {TABLE: 1.0})
      return 16
    rows.append(row("W5_insert", "reverb_api", "Client.insert (1 frame per call)",
                    timed(api, args.duration, args.warmup)[0], FRAME_BYTES))
    one = {"frame": frame[None]}

    def fastest():
      for _ in range(16):
        table.insert(one, 1.0)
      return 16
    rows.append(row("W5_insert", "fastest", "SharedTable.insert (1 frame per call)",
                    timed(fastest, args.duration, args.warmup)[0], FRAME_BYTES))
    while table.size < args.frames:
      fastest()
    out = [np.empty((64,) + FRAME_SHAPE, np.uint8)]
    rows.append(row("W5_sample", "fastest", "SharedTable.sample_batch(64, out=)",
                    timed(lambda: len(table.sample_batch(64, out=out).info.key), args.duration,
                          args.warmup)[0], FRAME_BYTES))
  dst = np.empty(64 << 20, np.uint8)
  # the same copy twice: from numpy's own memory (anonymous: numpy asks for transparent huge
  # pages on arrays this large, granted when THP is "madvise" or "always") and from a /dev/shm
  # mapping, memory of the kind the table's frames live in (shmem: huge pages only if
  # /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them)
  for variant, src, what in (("numpy", np.ones(64 << 20, np.uint8), "numpy's memory"),
                             ("numpy_shm", shm_bytes(64 << 20), "a /dev/shm mapping")):
    src[:] = 1

    def copy(src=src):
      np.copyto(dst, src)
      return src.nbytes / FRAME_BYTES
    rows.append(row("W5_copy", variant, f"np.copyto of 64 MiB from {what} (memory bandwidth "
                    "reference)", timed(copy, args.duration, args.warmup)[0], FRAME_BYTES,
                    huge_pages_kib=_huge_kib(src)))
  return rows


def _huge_kib(arr) -> int:
  """KiB of arr's memory backed by transparent huge pages: AnonHugePages + ShmemPmdMapped of
  the mappings in /proc/self/smaps that overlap it (madvise splits a mapping in several); 0 if
  unknown."""
  lo, hi, kib, inside = arr.ctypes.data, arr.ctypes.data + arr.nbytes, 0, False
  try:
    with open("/proc/self/smaps") as f:
      for line in f:
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
          start, end = (int(x, 16) for x in head.split("-"))
          inside = start < hi and lo < end
        elif inside and head in ("AnonHugePages:", "ShmemPmdMapped:"):
          kib += int(line.split()[1])
  except OSError:
    return 0
  return kib


# ---- W6: 2 writer processes + 1 sampler process under SampleToInsertRatio
W6_BATCH = 64


def _w6_writer(name, batches, start, done_at, i, cpu_s):
  table = reverb.SharedTable.attach(name)
  data = steps(W6_BATCH)
  start.wait()
  cpu0 = time.process_time()
  for _ in range(batches):
    table.insert(data, 1.0)
  done_at[i] = time.perf_counter()
  cpu_s[i] = time.process_time() - cpu0


def _w6_sampler(name, samples, start, done_at, i, cpu_s, learner=False):
  table = reverb.SharedTable.attach(name)
  out = [np.empty(W6_BATCH, np.int64), np.empty((W6_BATCH, 8), np.float32),
         np.empty(W6_BATCH, np.float32)]
  start.wait()
  cpu0 = time.process_time()
  got = 0
  if learner:   # the learner's iterator (a background thread gathers batches ahead)
    from reverb_shm import learner as learner_lib  # pylint: disable=import-outside-toplevel
    it = learner_lib.BatchIterator(table, batch_size=W6_BATCH)
    while got < samples:
      got += len(next(it).info.key)
    it.close()
  else:
    while got < samples:
      got += len(table.sample_batch(min(W6_BATCH, samples - got), out=out).info.key)
  done_at[i] = time.perf_counter()
  cpu_s[i] = time.process_time() - cpu0


def _w6_cross(args, writers, learner=False):
  """(items/s, seconds the processes took to exit afterwards, the sampler's share of a CPU) of
  `writers` writer processes + 1 sampler process (W6's pipeline). The share is the sampler's CPU
  time over its time in the pipeline: near 1 when it had a CPU to itself, near 0.5 when it
  shared one with a writer (the pipeline then runs at about the one-process rate).

  The pipeline's time runs from the start barrier to the moment the last process finished its
  share (perf_counter is CLOCK_MONOTONIC, one clock for every process), as the in-process
  variant's does: the interpreters' exit after that (~15-40 ms each, 3-5 of them at once on this
  2-CPU machine, 10-25% of the run) is not the pipeline's work and is reported apart."""
  batches = max(50, int(args.duration * 4000 / writers))  # per writer
  total = writers * batches * W6_BATCH
  limiter = reverb.rate_limiters.SampleToInsertRatio(1.0, 1, 4096)
  with server(reverb.selectors.Uniform(), 100_000, limiter=limiter) as srv:
    name = srv.shared_table_name(TABLE)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(writers + 2)
    done_at = ctx.Array("d", writers + 1, lock=False)
    cpu_s = ctx.Array("d", writers + 1, lock=False)
    procs = [ctx.Process(target=_w6_writer, args=(name, batches, start, done_at, i, cpu_s))
             for i in range(writers)]
    procs.append(ctx.Process(target=_w6_sampler, args=(name, total - total % W6_BATCH, start,
                                                       done_at, writers, cpu_s, learner)))
    for p in procs:
      p.start()
    start.wait(timeout=120)
    t0 = time.perf_counter()
    for p in procs:
      p.join(timeout=600)
    joined = time.perf_counter()
    if any(p.exitcode != 0 for p in procs):
      raise RuntimeError(f"W6 process failed: exit codes {[p.exitcode for p in procs]}")
  seconds = max(done_at) - t0
  share = cpu_s[writers] / max(done_at[writers] - t0, 1e-9)
  return total / seconds, joined - max(done_at), round(share, 3)


W6_TURNS = 5   # every variant measured this many times, in turns (the median is reported)


def _w6_in_process(batches: int) -> float:
  """items/s of W6's inserts and samples done in turn by one process (the denominator)."""
  limiter = reverb.rate_limiters.SampleToInsertRatio(1.0, 1, 4096)
  with server(reverb.selectors.Uniform(), 100_000, limiter=limiter) as srv:
    table = srv.shared_table(TABLE)
    data = steps(W6_BATCH)
    out = [np.empty(W6_BATCH, np.int64), np.empty((W6_BATCH, 8), np.float32),
           np.empty(W6_BATCH, np.float32)]
    t0 = time.perf_counter()
    for _ in range(2 * batches):
      table.insert(data, 1.0)
      got = 0
      while got < W6_BATCH:
        got += len(table.sample_batch(W6_BATCH - got, out=out).info.key)
    return 2 * batches * W6_BATCH / (time.perf_counter() - t0)


def _cpu_times() -> dict:
  """The machine's CPU seconds so far by kind, from /proc/stat's `cpu` line (all CPUs): `steal`
  is time the hypervisor ran something else while a virtual CPU wanted to run (a pipeline of
  processes loses the CPU it counted on). Zeros where /proc/stat is unreadable."""
  fields = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
  try:
    with open("/proc/stat") as f:
      values = f.readline().split()[1:1 + len(fields)]
    hz = os.sysconf("SC_CLK_TCK")
    return {k: int(v) / hz for k, v in zip(fields, values)} | {k: 0.0 for k in fields[len(values):]}
  except (OSError, ValueError):
    return dict.fromkeys(fields, 0.0)


def w6(args):
  """W6: the pipeline of writer processes and a sampler process against the same work in one
  process. Each run is short (~0.15 s at the default duration), and this machine kind's speed
  drifts over seconds to minutes, so the four variants are measured W6_TURNS times in turns, as
  the scaling workload's sizes are: a drift weighs on every variant alike, and each row reports
  the median (its runs in `turns`, and the CPU time the hypervisor stole during each in
  `steal_s`: a pipeline that loses one of two CPUs runs at the one-process rate)."""
  batches = max(50, int(args.duration * 2000))  # per writer of the 2-writer pipeline
  variants = {
      "cross_process": ("2 writer + 1 sampler processes, insert(64) / sample_batch(64), "
                        "SampleToInsertRatio(1)", lambda: _w6_cross(args, 2)),
      "cross_process_4w": ("4 writer + 1 sampler processes (as cross_process)",
                           lambda: _w6_cross(args, 4)),
      "cross_process_learner": ("2 writer processes + 1 sampler process using "
                                "learner.BatchIterator(batch_size=64)",
                                lambda: _w6_cross(args, 2, learner=True)),
      "in_process": ("the same inserts and samples in one process",
                     lambda: (_w6_in_process(batches), None, None)),
  }
  runs = {name: [] for name in variants}
  steal = {name: [] for name in variants}
  for _ in range(W6_TURNS):
    for name, (_, measure) in variants.items():
      before = _cpu_times()
      runs[name].append(measure())
      after = _cpu_times()
      steal[name].append(round(after["steal"] - before["steal"], 3))
  rows = []
  for name, (api, _) in variants.items():
    rates = [rate for rate, _, _ in runs[name]]
    extra = {"turns": rates, "steal_s": steal[name]}
    if runs[name][0][1] is not None:
      extra["exit_s"] = float(np.median([exit_s for _, exit_s, _ in runs[name]]))
      extra["sampler_cpu_share"] = [share for _, _, share in runs[name]]
    rows.append(row("W6", name, api, float(np.median(rates)), **extra))
  return rows


# ---- W7: wake-up latency of a sampler blocked on a table, against a futex ping-pong floor
W7_WAKES = 10_000
W7_SETTLE_S = 200e-6   # the waiter has slept this long (past any spin) before each wake-up


def _futex_syscall():
  """(syscall, FUTEX_WAIT, FUTEX_WAKE, SYS_futex) through ctypes: the floor uses the system
  call directly, as the core does, with nothing else on either side."""
  import ctypes  # pylint: disable=import-outside-toplevel
  libc = ctypes.CDLL(None, use_errno=True)
  libc.syscall.restype = ctypes.c_long
  return libc.syscall, 0, 1, 202   # x86-64 SYS_futex


def _w7_sampler(name, stamps, ready, n):
  table = reverb.SharedTable.attach(name)
  out = [np.empty(1, np.int64)]
  stamps = np.frombuffer(stamps, np.int64).reshape(2, n)
  ready = np.frombuffer(ready, np.int64)
  table.sample_batch(1, out=out)   # learns the layout (item 0 is inserted before the start)
  for i in range(n):
    ready[0] = i + 1               # the writer inserts item i once this sampler sleeps
    table.sample_batch(1, out=out)
    stamps[1, i] = time.perf_counter_ns()


def _w7_futex_waiter(word, stamps, n):
  import ctypes  # pylint: disable=import-outside-toplevel
  syscall, wait, _, nr = _futex_syscall()
  words = np.frombuffer(word, np.int64)
  addr = ctypes.c_void_p(words.ctypes.data)
  stamps = np.frombuffer(stamps, np.int64).reshape(2, n)
  for i in range(n):
    words[1] = i + 1                          # announce: about to wait for round i
    while words[0] == 2 * i:                  # the word is 2i until the waker makes it 2i + 1
      syscall(nr, addr, wait, ctypes.c_int(2 * i), None, None, 0)
    stamps[1, i] = time.perf_counter_ns()
    words[0] = 2 * i + 2


def _settled(flag, i):
  while flag[0] != i + 1:
    pass
  end = time.perf_counter() + W7_SETTLE_S
  while time.perf_counter() < end:
    pass


def _latencies(us):
  return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
          "mean_us": float(us.mean()), "wakes": len(us)}


def _w7_table_turn(ctx, n: int) -> np.ndarray:
  """Wake-up latencies (us) of n inserts into a queue table, each waking a sampler process
  blocked in sample_batch(1)."""
  table = reverb.Table.queue(TABLE, 1000)
  with reverb.Server([table], arena_bytes=64 << 20) as srv:
    shared = srv.shared_table(TABLE)
    stamps, ready = ctx.RawArray("q", 2 * n), ctx.RawArray("q", 1)
    st, flag = np.frombuffer(stamps, np.int64).reshape(2, n), np.frombuffer(ready, np.int64)
    item = {"x": np.zeros(1, np.int64)}
    shared.insert(item, 1.0)
    proc = ctx.Process(target=_w7_sampler, args=(srv.shared_table_name(TABLE), stamps, ready, n))
    proc.start()
    try:
      for i in range(n):
        _settled(flag, i)
        st[0, i] = time.perf_counter_ns()
        shared.insert(item, 1.0)
      proc.join(timeout=120)
    finally:
      if proc.is_alive():
        proc.kill()
    if proc.exitcode != 0:
      raise RuntimeError(f"W7 sampler failed: exit code {proc.exitcode}")
    return (st[1] - st[0]) / 1e3


def _w7_floor_turn(ctx, n: int) -> np.ndarray:
  """Wake-up latencies (us) of n futex ping-pongs between this process and another."""
  import ctypes  # pylint: disable=import-outside-toplevel
  word, stamps = ctx.RawArray("q", 2), ctx.RawArray("q", 2 * n)
  words, st = np.frombuffer(word, np.int64), np.frombuffer(stamps, np.int64).reshape(2, n)
  syscall, _, wake, nr = _futex_syscall()
  addr = ctypes.c_void_p(words.ctypes.data)
  proc = ctx.Process(target=_w7_futex_waiter, args=(word, stamps, n))
  proc.start()
  try:
    for i in range(n):
      _settled(words[1:], i)
      st[0, i] = time.perf_counter_ns()
      words[0] = 2 * i + 1
      syscall(nr, addr, wake, 1, None, None, 0)
      while words[0] != 2 * i + 2:
        pass
    proc.join(timeout=120)
  finally:
    if proc.is_alive():
      proc.kill()
  return (st[1] - st[0]) / 1e3


W7_TURNS = 5   # the wake-ups of each side come in this many turns, alternating with the other's


def w7(args):
  """Wake-up latency (p50/p99 over W7_WAKES): a writer's insert call -> a sampler process
  blocked in sample_batch(1) on that (queue) table returning with the item; and the floor, a
  futex ping-pong between two processes (the word's store and FUTEX_WAKE -> the waiter's
  FUTEX_WAIT returning to Python), measured the same way in the same run, in W7_TURNS turns
  alternating with the table's (a drift of the machine's speed weighs on both alike). Both
  clocks start before the call that wakes: the waker's call returns after the woken side has
  often already run (the wake-up is done inside it), so its return is no start line. The waiter
  has slept W7_SETTLE_S (past the core's spin) before every wake-up; items_per_s is
  1e6 / p50_us."""
  n = W7_WAKES if args.duration >= 1 else 2_000
  ctx = multiprocessing.get_context("spawn")
  table_us, floor_us = [], []
  for _ in range(W7_TURNS):
    table_us.append(_w7_table_turn(ctx, n // W7_TURNS))
    floor_us.append(_w7_floor_turn(ctx, n // W7_TURNS))
  rows = []
  lat = _latencies(np.concatenate(table_us))
  rows.append(row("W7", "table_wake", "insert(1) called -> blocked sample_batch(1) returns "
                  "(other process)", 1e6 / lat["p50_us"], **lat))
  lat = _latencies(np.concatenate(floor_us))
  rows.append(row("W7", "futex_floor", "store + FUTEX_WAKE called -> FUTEX_WAIT returns (two "
                  "processes, ctypes syscall)", 1e6 / lat["p50_us"], **lat))
  return rows


def w8(args):
  """W8 (bench/api_workloads.py): Reverb client calls with default arguments."""
  import types  # pylint: disable=import-outside-toplevel
  import api_workloads as api  # pylint: disable=import-outside-toplevel
  tf = types.SimpleNamespace(TensorSpec=reverb.TensorSpec, float32=np.float32, int64=np.int64,
                             uint8=np.uint8)
  tables = api.tables(reverb, api.signature(tf), api.frame_signature(tf), api.W8_ITEMS,
                      api.W8_FRAMES)
  arena = 2 * api.W8_FRAMES * FRAME_BYTES + (512 << 20)
  with reverb.Server(tables, arena_bytes=arena, max_bytes=arena + (256 << 20)) as srv:
    return api.w8(args, reverb.Client(f"localhost:{srv.port}"))


SCALING_TURNS = 10


def scaling(args):
  """W4 (fastest) at every size of args.scales, all tables alive at once and measured in turns
  (SCALING_TURNS slices of the duration each, median), so that a change of machine load during
  the run weighs on every size alike instead of on whichever size ran at that moment."""
  with contextlib.ExitStack() as stack:
    ops = {}
    for n in args.scales:
      table = stack.enter_context(server(reverb.selectors.Prioritized(0.6), n)).shared_table(TABLE)
      fill(table, n)
      ops[n] = fastest_op(table, True)
      timed(ops[n], args.warmup, 0)   # warm-up (result unused)
    rates = {n: [] for n in ops}
    for _ in range(SCALING_TURNS):
      for n, op in ops.items():
        rates[n].append(timed(op, args.duration / SCALING_TURNS, 0)[0])
  rows = []
  for n, r in rates.items():
    rate = float(np.median(r))
    rows.append(row(f"scale_{n}", "fastest", FASTEST_API + " + update_priorities", rate,
                    table_items=n, us_per_item=1e6 / rate))
  return rows


def metadata(args):
  """Bytes per item beyond payload: table structures (per max_size) + arena blocks per item."""
  n = 200_000
  small = reverb.Server([reverb.Table(TABLE, reverb.selectors.Prioritized(0.6),
                                      reverb.selectors.Fifo(), 1000,
                                      reverb.rate_limiters.MinSize(1))], arena_bytes=256 << 20)
  base = _table_bytes(small._segment.info())
  small.stop()
  with server(reverb.selectors.Prioritized(0.6), n) as srv:
    seg = srv._segment
    table_bytes = (_table_bytes(seg.info()) - base) / (n - 1000)
    used0 = seg.info()["arena_used"]
    fill(srv.shared_table(TABLE), n, block=10_000)
    arena_bytes = (seg.info()["arena_used"] - used0) / n - STEP_BYTES
    rss = attach_rss(srv.shared_table_name(TABLE))
    segment_bytes = seg.info()["reserved_bytes"]
  with server(reverb.selectors.Prioritized(0.6), n) as srv:   # the drop-in user's per-step path
    seg, client, data = srv._segment, srv.localhost_client(), step(1)
    client.insert(data, {TABLE: 1.0})
    used0 = seg.info()["arena_used"]
    for _ in range(n):
      client.insert(data, {TABLE: 1.0})
    api_arena_bytes = (seg.info()["arena_used"] - used0) / n - STEP_BYTES
  return [row("metadata", "fastest", "SharedTable.insert(10k) of 1-step items", 0,
              table_bytes_per_item=table_bytes, arena_bytes_per_item=arena_bytes,
              bytes_per_item=table_bytes + arena_bytes, segment_bytes=segment_bytes, **rss),
          row("metadata", "reverb_api", "Client.insert of 1-step items (one call per step)", 0,
              table_bytes_per_item=table_bytes, arena_bytes_per_item=api_arena_bytes,
              bytes_per_item=table_bytes + api_arena_bytes)]


def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _attach_rss_child(name, conn):
  before = _rss_bytes()
  table = reverb.SharedTable.attach(name)
  table.size  # pylint: disable=pointless-statement
  attached = _rss_bytes()
  out = [np.empty(256, np.int64), np.empty((256, 8), np.float32), np.empty(256, np.float32)]
  for _ in range(10):
    table.sample_batch(256, out=out)
  conn.send((attached - before, _rss_bytes() - attached))


def attach_rss(name) -> dict:
  """RSS growth (bytes) of a fresh process that attaches to the table, and of its next 10
  sample_batch(256) calls: it maps the whole segment but should pay only for pages it touches."""
  ctx = multiprocessing.get_context("spawn")
  parent, child = ctx.Pipe()
  proc = ctx.Process(target=_attach_rss_child, args=(name, child))
  proc.start()
  if not parent.poll(120):
    proc.kill()
    raise RuntimeError("attach_rss: the attaching process did not answer in 120 s")
  attach, sampling = parent.recv()
  proc.join(60)
  return {"attach_rss_bytes": attach, "sample_rss_bytes": sampling}


T1_BATCH = 256
T1_IN_FLIGHT = 512


def t1(args):
  """TrajectoryDataset.from_table_signature(...).batch(256) items/s, uniform and prioritized
  tables of args.items single-step items (as bench/peer_reverb.py's t1)."""
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  except ImportError:
    return []   # (the ratio rows then say n/a)
  sig = {"obs": tf.TensorSpec([8], tf.float32), "action": tf.TensorSpec([], tf.int64),
         "reward": tf.TensorSpec([], tf.float32)}
  n = args.items
  tables = [reverb.Table(name, sampler=sampler, remover=reverb.selectors.Fifo(), max_size=n,
                         rate_limiter=reverb.rate_limiters.MinSize(1), signature=sig)
            for name, sampler in (("uniform", reverb.selectors.Uniform()),
                                  ("prioritized", reverb.selectors.Prioritized(0.6)))]
  rows = []
  with reverb.Server(tables, arena_bytes=max(256 << 20, 4 * n * (STEP_BYTES + 256))) as srv:
    for name in ("uniform", "prioritized"):
      table = srv.shared_table(name)
      for s in range(0, n, 100_000):
        b = min(100_000, n - s)
        table.insert(steps(b, s), np.random.default_rng(s).random(b) + 0.1)
      it = iter(reverb.TrajectoryDataset.from_table_signature(
          f"localhost:{srv.port}", name, max_in_flight_samples_per_worker=T1_IN_FLIGHT
      ).batch(T1_BATCH))

      def op():
        return len(next(it).info.key.numpy())
      rows.append(row("T1", name, f"TrajectoryDataset.batch({T1_BATCH})",
                      timed(op, args.duration, args.warmup)[0], table_items=n))
      del it
  return rows


WORKLOADS = {
    "W1": w1, "W2": w2,
    "W3": lambda a: sampling(a, "W3", reverb.selectors.Uniform(), False),
    "W4": lambda a: sampling(a, "W4", reverb.selectors.Prioritized(0.6), True),
    "W5": w5, "W6": w6, "W7": w7, "W8": w8, "scaling": scaling, "metadata": metadata, "T1": t1,
}




if __name__ == "__main__":
  run_main(__doc__, WORKLOADS)
