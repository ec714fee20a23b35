"""Coverage-guided fuzzer of the C core (atheris + libFuzzer), in two modes.

``ops``: every input is a table configuration and a sequence of up to 48 operations on one table
of a fresh segment (an anonymous shared mapping): insert, sample, sample_gather, priority
update, delete, reset, snapshot (checkpoint listing) taken and released, a process slot that
dies in the middle of its work (half-written chunk, held sample pins, items inserted through it)
and is reaped, and a forked process SIGKILLed while it inserts and samples (possibly holding the
table lock). After every operation the invariant checker (rs_check) must pass and the table must
equal the pure-Python model of tests/test_core_table.py (items in insertion order, priorities,
times sampled, rate-limiter counters; deterministic selectors pick what the model picks; every
gathered row holds the bytes its key was written with). At the end everything is released and
the arena must be empty again (no leaked block).

``corrupt``: every input is a list of byte patches written over a copy of a populated server
segment in /dev/shm (header, table headers, records, index, sum trees, arena blocks, item
descriptors, chunk headers). A worker process then attaches (rs_segment_validate), runs the
checker, and samples, gathers and lists items; it must answer every input (no SIGSEGV, no
sanitizer report, no hang): a damaged segment is refused at attach or reported by the checker,
and a damaged descriptor or chunk header read by a sampler is reported, not dereferenced.

Run it through tests/sanitize.py, which builds the core with ASan + UBSan and edge coverage:

    python tests/sanitize.py fuzz ops -- -max_total_time=600
    python tests/sanitize.py fuzz corrupt -- -max_total_time=600

Arguments after ``--`` go to libFuzzer; the seed corpus is tests/fuzz/corpus/<mode>/ and new
inputs go to build/sanitize/asan/fuzz-corpus/<mode>/.
"""
import atexit
import collections
import ctypes
import mmap
import os
import pathlib
import signal
import struct
import subprocess
import sys
import time
import types

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))   # tests/: the reference model

from reverb_shm._core import ffi, lib  # noqa: E402
from test_core_table import Model, Segment as CoreSegment  # noqa: E402

UNIFORM, PRIORITIZED, FIFO, LIFO, MINHEAP, MAXHEAP = range(6)
FLT_MAX = float(np.finfo(np.float64).max)
NKEYS = 24            # keys 0..NKEYS-1 (small, so that updates, deletes and re-inserts meet)
NEPISODES = 5         # item k: column a = row (k // NEPISODES) % ROWS of episode k % NEPISODES
ROWS = 5
PRIORITIES = (0.0, 0.5, 1.0, 2.0, 3.0, 1e-300, 7.25)
TRACE = bool(os.environ.get("REVERB_SHM_FUZZ_TRACE"))   # print every operation
CHILD_KEY0 = 1000     # keys of the forked process (outside the model's, which are resynced)


class Violation(AssertionError):
  """The core disagreed with the model or broke an invariant."""


def err() -> str:
  return ffi.string(lib.rs_last_error()).decode(errors="replace")


def ok(rc, what):
  if rc != lib.RS_OK:
    raise Violation(f"{what}: rc {rc}: {err()}")


def expect(cond, what):
  if not cond:
    raise Violation(what)


# ------------------------------------------------------------------------------ ops mode


class Table:
  """One table in a fresh anonymous shared segment, its chunks (two columns) and its slot."""

  def __init__(self, cfg_values, max_procs=4, pins=256, arena=1 << 18):
    cfg = ffi.new("rs_table_config[1]")
    c = cfg[0]
    (c.max_size, c.max_times_sampled, c.sampler_kind, c.remover_kind, c.samples_per_insert,
     c.min_size_to_sample, c.min_diff, c.max_diff, exponent) = cfg_values
    c.name = b"fuzz"
    c.sampler_exponent = c.remover_exponent = exponent
    self.size = lib.rs_segment_size(cfg, 1, max_procs, pins, arena)
    expect(self.size > 0, f"rs_segment_size: {err()}")
    self.mm = mmap.mmap(-1, self.size)
    self.buf = ffi.from_buffer(self.mm)
    self.base = ffi.cast("void *", self.buf)
    self.pid = os.getpid()
    self.start = lib.rs_proc_start_time(self.pid)
    ok(lib.rs_segment_init(self.base, self.size, cfg, 1, max_procs, pins, arena, self.pid,
                           self.start, 1), "rs_segment_init")
    self.slot = self.register(self.start)
    self.writer_pins = []
    self.chunk_a, self.chunk_b, self.chunk_b2 = {}, {}, {}
    for ep in range(NEPISODES):
      self.chunk_a[ep] = self.chunk(ep, 8, 1, (2,), b"<f4", ep * 100 + np.arange(ROWS * 2, dtype=np.float32))
      self.chunk_b[ep] = self.chunk(ep, 8, 0, (), b"<i8", ep * 1000 + np.arange(ROWS, dtype=np.int64))
      self.chunk_b2[ep] = self.chunk(ep, 8, 0, (), b"<i8", ep * 1000 + 500 + np.arange(ROWS, dtype=np.int64))

  def register(self, start):
    out = ffi.new("uint32_t *")
    ok(lib.rs_proc_register(self.base, self.pid, start, out), "rs_proc_register")
    return out[0]

  def chunk(self, episode, row_bytes, ndim, shape, dtype, values, slot=None, publish=ROWS):
    meta = ffi.new("rs_chunk_hdr *")
    meta.episode_id, meta.row_bytes, meta.capacity, meta.ndim = episode, row_bytes, ROWS, ndim
    for i, d in enumerate(shape):
      meta.shape[i] = d
    meta.dtype = dtype
    off, pin = ffi.new("uint64_t *"), ffi.new("uint32_t *")
    ok(lib.rs_chunk_alloc(self.base, self.slot if slot is None else slot, meta, off, pin),
       "rs_chunk_alloc")
    hdr = ffi.cast("rs_chunk_hdr *", self.buf + off[0])
    raw = values.tobytes()
    self.mm[off[0] + hdr.data_offset:off[0] + hdr.data_offset + len(raw)] = raw
    if publish:
      ok(lib.rs_chunk_publish_rows(self.base, off[0], publish), "rs_chunk_publish_rows")
    if slot is None:
      self.writer_pins.append(pin[0])
    return off[0]

  @staticmethod
  def expected_row(key):
    """(column a as float32[2], column b as int64[2]) written for item `key`."""
    ep, row = key % NEPISODES, (key // NEPISODES) % ROWS
    a = ep * 100 + np.arange(row * 2, row * 2 + 2, dtype=np.float32)
    b = np.array([ep * 1000 + row, ep * 1000 + 500 + (row + 1) % ROWS], np.int64)
    return a, b

  def blob(self, key):
    """Descriptor of item `key`: column a one squeezed row, column b two slices of one row in two
    chunks, all three chunks of one episode (the episode map holds one entry per item)."""
    ep, row = key % NEPISODES, (key // NEPISODES) % ROWS
    out = struct.pack("<II", 2, 3) + struct.pack("<IIII", 0, 1, 1, 0) + \
        struct.pack("<IIII", 1, 2, 0, 0)
    out += struct.pack("<QII", self.chunk_a[ep], row, 1)
    out += struct.pack("<QII", self.chunk_b[ep], row, 1)
    out += struct.pack("<QII", self.chunk_b2[ep], (row + 1) % ROWS, 1)
    return out

  def insert(self, keys, prios, slot=None):
    blobs = [self.blob(k % NKEYS if k < CHILD_KEY0 else k) for k in keys]
    raw = np.frombuffer(b"".join(blobs), np.uint8).copy()
    offs = np.cumsum([0] + [len(b) for b in blobs]).astype(np.uint64)
    k = np.asarray(keys, np.uint64)
    p = np.asarray(prios, np.float64)
    done = ffi.new("uint32_t *")
    rc = lib.rs_insert(self.base, self.slot if slot is None else slot, 0, len(keys),
                       ffi.from_buffer("uint64_t[]", k), ffi.from_buffer("double[]", p),
                       ffi.from_buffer("uint8_t[]", raw), ffi.from_buffer("uint64_t[]", offs),
                       lib.rs_now_ns(), 0, done)
    return rc, done[0]

  def sample(self, n, slot=None):
    out, got = ffi.new("rs_sample_rec[]", n), ffi.new("uint32_t *")
    rc = lib.rs_sample(self.base, self.slot if slot is None else slot, 0, n, lib.rs_now_ns(), 0,
                       out, got)
    return rc, [out[i] for i in range(got[0])], out

  def sample_gather(self, n, wait_n):
    a = np.full((n, 2), -1, np.float32)   # column a: one squeezed row of float32[2]
    b = np.full((n, 2), -1, np.int64)     # column b: two rows of int64
    cols = ffi.new("rs_gather_col[2]")
    for c, arr, dt in ((0, a, b"<f4"), (1, b, b"<i8")):
      cols[c].out = ffi.cast("uint8_t *", ffi.from_buffer(arr))
      cols[c].stride = cols[c].col_bytes = arr.strides[0]
      cols[c].dtype = dt
      cols[c].ndim, cols[c].shape[0] = 1, 2   # a: the squeezed row's shape (2,); b: 2 rows of ()
    info = np.zeros(36 * n // 8 + 1, np.uint64)
    got = ffi.new("uint32_t *")
    rc = lib.rs_sample_gather(self.base, self.slot, 0, n, wait_n, lib.rs_now_ns(), 0, 2, cols,
                              ffi.from_buffer(info), got)
    g = got[0]
    raw = info.view(np.uint8)
    keys = raw[:8 * n].view(np.uint64)[:g]
    probs = raw[8 * n:16 * n].view(np.float64)[:g]
    sizes = raw[16 * n:24 * n].view(np.int64)[:g]
    prios = raw[24 * n:32 * n].view(np.float64)[:g]
    times = raw[32 * n:36 * n].view(np.int32)[:g]
    recs = [dict(key=int(keys[i]), probability=float(probs[i]), table_size=int(sizes[i]),
                 priority=float(prios[i]), times_sampled=int(times[i])) for i in range(g)]
    return rc, recs, a[:g], b[:g]

  def unpin(self, pins, slot=None):
    if pins:
      arr = ffi.new("uint32_t[]", list(pins))
      ok(lib.rs_unpin(self.base, self.slot if slot is None else slot, len(pins), arr), "rs_unpin")

  mutate = CoreSegment.mutate   # (rc, updated, deleted) of rs_mutate on table 0

  def items(self):
    cap = 64
    out = ffi.new("rs_item_rec[]", cap)
    n, size = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    ok(lib.rs_table_items(self.base, 0, out, cap, n, size), "rs_table_items")
    expect(n[0] == size[0], f"rs_table_items listed {n[0]} of {size[0]} items")
    return [(out[i].key, out[i].priority, out[i].times_sampled, out[i].update_seq)
            for i in range(n[0])]

  def stats(self):
    s = ffi.new("rs_table_stats *")
    ok(lib.rs_table_get_stats(self.base, 0, s), "rs_table_get_stats")
    return s

  def info(self):
    out = ffi.new("rs_segment_info *")
    ok(lib.rs_segment_get_info(self.base, out), "rs_segment_get_info")
    return out

  def check(self, what):
    report = ffi.new("char[]", 8192)
    rc = lib.rs_check(self.base, report, 8192)
    expect(rc == lib.RS_OK, f"invariant check after {what}: {ffi.string(report).decode()}")


def _verify_sample(model, sampler, mts, rec, label):
  key = rec["key"]
  expect(model.can_sample(1) and model.items, f"{label}: sampled {key} while the model blocks")
  want = model.pick(sampler)
  expect(want is None or key == want, f"{label}: sampled {key}, the selector must pick {want}")
  expect(key in model.items, f"{label}: sampled unknown key {key}")
  expect(rec["table_size"] == len(model.items), f"{label}: table_size {rec['table_size']}")
  expect(rec["priority"] == model.items[key][0], f"{label}: priority {rec['priority']}")
  if sampler == UNIFORM:
    want_p = 1 / len(model.items)
  elif sampler == PRIORITIZED:
    w = {k: v[0] ** model.exponent if v[0] > 0 else 0.0 for k, v in model.items.items()}
    total = sum(w.values())
    want_p = 1 / len(model.items) if total == 0 else w[key] / total
  else:
    want_p = 1.0
  expect(abs(rec["probability"] - want_p) <= 1e-9 * max(want_p, 1e-300),
         f"{label}: probability {rec['probability']!r}, expected {want_p!r}")
  model.sample_one(key)
  want_t = model.items[key][1] if key in model.items else mts
  expect(rec["times_sampled"] == want_t, f"{label}: times_sampled {rec['times_sampled']} != {want_t}")


def _compare(table, model, what):
  got = table.items()
  expect([k for k, _, _, _ in got] == list(model.items),
         f"after {what}: keys {[k for k, *_ in got]} != model {list(model.items)}")
  expect([(p, t) for _, p, t, _ in got] == [(v[0], v[1]) for v in model.items.values()],
         f"after {what}: priorities/times differ from the model")
  s = table.stats()
  expect((s.inserts, s.samples, s.deletes) == (model.inserts, model.samples, model.deletes),
         f"after {what}: counters {(s.inserts, s.samples, s.deletes)} != model "
         f"{(model.inserts, model.samples, model.deletes)}")
  table.check(what)


def _resync(table, model):
  """After a foreign process changed the table: the model adopts the table's state."""
  model.items = collections.OrderedDict(
      (k, [p, t, u]) for k, p, t, u in table.items())
  s = table.stats()
  model.inserts, model.samples, model.deletes = s.inserts, s.samples, s.deletes
  model.useq = max([u for _, _, _, u in table.items()] + [model.useq]) + 1


def _fork_and_kill(table, run_us):
  """A forked process registers, then inserts, samples and deletes keys >= CHILD_KEY0 until it
  is SIGKILLed after run_us microseconds (at any instruction, possibly holding a lock)."""
  pid = os.fork()
  if pid == 0:
    try:
      slot = ffi.new("uint32_t *")
      lib.rs_proc_register(table.base, os.getpid(), lib.rs_proc_start_time(os.getpid()), slot)
      i = 0
      while True:
        i += 1
        keys = [CHILD_KEY0 + (i * 7 + j) % 40 for j in range(1 + i % 3)]
        blobs = [table.blob(k) for k in keys]
        raw = np.frombuffer(b"".join(blobs), np.uint8).copy()
        offs = np.cumsum([0] + [len(b) for b in blobs]).astype(np.uint64)
        done = ffi.new("uint32_t *")
        lib.rs_insert(table.base, slot[0], 0, len(keys), ffi.new("uint64_t[]", keys),
                      ffi.new("double[]", [1.0 + j for j in range(len(keys))]),
                      ffi.from_buffer("uint8_t[]", raw), ffi.from_buffer("uint64_t[]", offs),
                      lib.rs_now_ns(), 0, done)
        out, got = ffi.new("rs_sample_rec[]", 4), ffi.new("uint32_t *")
        lib.rs_sample(table.base, slot[0], 0, 4, lib.rs_now_ns(), 0, out, got)
        if i % 3:
          lib.rs_unpin(table.base, slot[0], got[0], ffi.new("uint32_t[]", [out[j].pin for j in range(got[0])]))
        nu, nd = ffi.new("uint32_t *"), ffi.new("uint32_t *")
        lib.rs_mutate(table.base, 0, 0, ffi.NULL, ffi.NULL, 1, ffi.new("uint64_t[]", [keys[0]]), nu, nd)
    finally:
      os._exit(0)
  time.sleep(run_us / 1e6)
  os.kill(pid, signal.SIGKILL)
  os.waitpid(pid, 0)


def run_ops(data: bytes) -> None:
  """One ops-mode input (see the module docstring). Raises Violation on any disagreement."""
  import atheris  # pylint: disable=import-outside-toplevel
  fdp = atheris.FuzzedDataProvider(data)
  sampler = fdp.ConsumeIntInRange(0, 5)
  remover = (FIFO, LIFO, MINHEAP, MAXHEAP)[fdp.ConsumeIntInRange(0, 3)]
  max_size = fdp.ConsumeIntInRange(1, 10)
  mts = fdp.ConsumeIntInRange(0, 3)
  spi = (0.5, 1.0, 2.0)[fdp.ConsumeIntInRange(0, 2)]
  min_size = fdp.ConsumeIntInRange(1, 3)
  lo = (-FLT_MAX, -3.0, 0.0)[fdp.ConsumeIntInRange(0, 2)]
  hi = (FLT_MAX, 4.0, 8.0)[fdp.ConsumeIntInRange(0, 2)]
  exponent = (1.0, 0.5, 2.0)[fdp.ConsumeIntInRange(0, 2)]
  trace = print if TRACE else (lambda *a: None)
  trace(f"table sampler={sampler} remover={remover} max_size={max_size} mts={mts} spi={spi} "
        f"min_size={min_size} lo={lo} hi={hi} exponent={exponent}")
  table = Table((max_size, mts, sampler, remover, spi, min_size, lo, hi, exponent))
  model = Model(sampler, remover, max_size, mts, spi, min_size, lo, hi)
  model.exponent = exponent
  held_pins, snapshots = [], []
  forked = False
  for step in range(48):
    if fdp.remaining_bytes() == 0:
      break
    op = fdp.ConsumeIntInRange(0, 9)
    what = f"step {step} op {op}"
    if op in (0, 1):     # insert (0: priorities from a fixed set; 1: any float64)
      n = fdp.ConsumeIntInRange(1, 5)
      keys = [fdp.ConsumeIntInRange(0, NKEYS - 1) for _ in range(n)]
      if op == 0:
        prios = [PRIORITIES[fdp.ConsumeIntInRange(0, len(PRIORITIES) - 1)] for _ in range(n)]
      else:
        prios = [fdp.ConsumeRegularFloat() for _ in range(n)]
      admitted = lib.rs_check_priorities(table.base, 0, n, ffi.new("double[]", prios))
      prioritized = PRIORITIZED in (sampler, remover)
      if not all(np.isfinite(prios)) or (prioritized and min(prios) < 0):
        expect(admitted == lib.RS_EINVAL, f"{what}: rs_check_priorities admits {prios}")
      if admitted != lib.RS_OK:   # refused whole, nothing changed (compared below)
        trace(what, "insert refused", keys, prios)
        rc, done = table.insert(keys, prios)
        expect(rc == lib.RS_EINVAL and done == 0, f"{what}: invalid priorities {prios}: rc {rc}")
      else:
        expected = 0
        for k, p in zip(keys, prios):
          if not model.can_insert(1):
            break
          model.insert(k, p)
          expected += 1
        trace(what, "insert", keys, prios)
        rc, done = table.insert(keys, prios)
        expect(done == expected and rc == (0 if expected == n else lib.RS_ETIMEDOUT),
               f"{what}: insert {list(zip(keys, prios))}: rc {rc} done {done}, model {expected}")
    elif op == 2:        # sample (pins kept or released)
      n = fdp.ConsumeIntInRange(1, 6)
      rc, recs, _ = table.sample(n)
      trace(what, "sample", n, [r.key for r in recs])
      for r in recs:
        _verify_sample(model, sampler, mts, dict(key=r.key, probability=r.probability,
                                                 table_size=r.table_size, priority=r.priority,
                                                 times_sampled=r.times_sampled), what)
      expect(len(recs) == n or not model.can_sample(1) or not model.items,
             f"{what}: sampled {len(recs)} of {n} while the model allows more")
      expect(rc == (0 if len(recs) == n else lib.RS_ETIMEDOUT), f"{what}: sample rc {rc}")
      if fdp.ConsumeBool():
        held_pins += [r.pin for r in recs]
      else:
        table.unpin([r.pin for r in recs])
    elif op == 3:        # sample_gather: data must be what the items were written with
      n = fdp.ConsumeIntInRange(1, 6)
      wait_n = fdp.ConsumeIntInRange(0, n)
      rc, recs, a, b = table.sample_gather(n, wait_n)
      trace(what, "sample_gather", n, wait_n, rc, [r["key"] for r in recs])
      for i, r in enumerate(recs):
        _verify_sample(model, sampler, mts, r, what)
        want_a, want_b = Table.expected_row(r["key"] % NKEYS if r["key"] < CHILD_KEY0 else r["key"])
        expect((a[i] == want_a).all() and (b[i] == want_b).all(),
               f"{what}: gathered {a[i]}, {b[i]} for key {r['key']}, expected {want_a}, {want_b}")
      expect(rc in (lib.RS_OK, lib.RS_ETIMEDOUT), f"{what}: sample_gather rc {rc}: {err()}")
      expect(len(recs) == n or not model.can_sample(1) or not model.items,
             f"{what}: gathered {len(recs)} of {n} while the model allows more (rc {rc}: {err()})")
    elif op == 4:        # delete
      keys = [fdp.ConsumeIntInRange(0, NKEYS - 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
      trace(what, "delete", keys)
      present = len({k for k in keys if k in model.items})
      for k in keys:
        if k in model.items:
          model.remove(k)
      expect(table.mutate(deletes=keys) == (0, 0, present), f"{what}: delete {keys}")
    elif op == 5:        # update
      ups = [(fdp.ConsumeIntInRange(0, NKEYS - 1), PRIORITIES[fdp.ConsumeIntInRange(0, 6)])
             for _ in range(fdp.ConsumeIntInRange(0, 4))]
      trace(what, "update", ups)
      n = sum(1 for k, _ in ups if k in model.items)
      for k, p in ups:
        model.update(k, p)
      expect(table.mutate(updates=ups) == (0, n, 0), f"{what}: update {ups}")
    elif op == 6:        # reset
      trace(what, "reset")
      ok(lib.rs_reset(table.base, 0), "rs_reset")
      model.items.clear()
      model.inserts = model.samples = model.deletes = 0
    elif op == 7:        # snapshot: take (listing must equal the model), release now or later
      snap = ffi.new("rs_snapshot **")
      ok(lib.rs_snapshot_take(table.base, table.slot, snap), "rs_snapshot_take")
      t = snap[0].tables[0]
      keys = [t.items[i].key for i in range(t.n_items)]
      expect(keys == list(model.items), f"{what}: snapshot lists {keys}, model {list(model.items)}")
      expect(t.counters.size == len(model.items) and t.counters.inserts == model.inserts,
             f"{what}: snapshot counters")
      for i in range(t.n_items):
        d = ffi.cast("rs_desc_hdr *", t.descs + t.items[i].desc_off)
        sl = ffi.cast("rs_desc_slice *", ffi.cast("char *", d) + 8 + 16 * d.ncols)
        for j in range(d.nslices):
          expect(sl[j].chunk_off < snap[0].n_chunks, f"{what}: snapshot chunk id out of range")
      if fdp.ConsumeBool():
        ok(lib.rs_snapshot_release(table.base, table.slot, snap[0]), "rs_snapshot_release")
      else:
        snapshots.append(snap[0])
    elif op == 8:        # a process slot dies in the middle of its work and is reaped
      before = table.info()
      dead = table.register(table.start + 1)   # a start time that is not this process's
      table.chunk(0, 8, 1, (2,), b"<f4", np.zeros(ROWS * 2, np.float32), slot=dead,
                  publish=fdp.ConsumeIntInRange(0, ROWS - 1))   # half-written, never used
      rc, recs, _ = table.sample(fdp.ConsumeIntInRange(1, 3), slot=dead)   # pins never released
      for r in recs:
        _verify_sample(model, sampler, mts, dict(key=r.key, probability=r.probability,
                                                 table_size=r.table_size, priority=r.priority,
                                                 times_sampled=r.times_sampled), what)
      key = fdp.ConsumeIntInRange(0, NKEYS - 1)
      if model.can_insert(1):
        model.insert(key, 1.0)
        expect(table.insert([key], [1.0], slot=dead) == (0, 1), f"{what}: insert by dying slot")
      reaped = ffi.new("uint32_t *")
      ok(lib.rs_reap(table.base, reaped), "rs_reap")
      expect(reaped[0] == 1, f"{what}: reaped {reaped[0]} slots, expected 1")
      after = table.info()
      expect(after.live_procs == before.live_procs, f"{what}: live slots {after.live_procs}")
    elif op == 9:        # a forked process killed at a random instant (once per input)
      run_us = fdp.ConsumeIntInRange(0, 3000)
      if forked:
        continue
      forked = True
      _fork_and_kill(table, run_us)
      reaped = ffi.new("uint32_t *")
      ok(lib.rs_reap(table.base, reaped), "rs_reap after SIGKILL")
      _resync(table, model)
    _compare(table, model, what)
  # Release everything: the arena must hold nothing afterwards.
  table.unpin(held_pins)
  for snap in snapshots:
    ok(lib.rs_snapshot_release(table.base, table.slot, snap), "rs_snapshot_release")
  ok(lib.rs_reset(table.base, 0), "final rs_reset")
  table.unpin(table.writer_pins)
  table.check("final release")
  info = table.info()
  expect(info.arena_used == 0 and info.num_chunks == 0 and info.num_descs == 0,
         f"arena not empty after releasing everything: {info.arena_used} bytes, "
         f"{info.num_chunks} chunks, {info.num_descs} descriptors")


# ------------------------------------------------------------------------------ corrupt mode


def read_segment(base, size, kind):
  """What a process attaching to a (possibly corrupted) segment does: validation, the checker,
  then listing, sampling and gathering. Returns a one-line summary of the status codes."""
  out = []
  rc = lib.rs_segment_validate(base, size)
  out.append(f"validate={rc}")
  if rc == lib.RS_OK:
    report = ffi.new("char[]", 16384)
    rc = lib.rs_check(base, report, 16384)
    out.append(f"check={rc}")
    # Reads run after a failed check only where the damage is in what a sampler reads from the
    # arena (descriptors, chunk headers): those paths must report it, not dereference it.
    if rc == lib.RS_OK or kind in ("desc", "chunk"):
      pid = os.getpid()
      out.append("reads=" + ",".join(str(r) for r in _reads(base, pid,
                                                             lib.rs_proc_start_time(pid))))
  return " ".join(out)


def corrupt_worker(path: str) -> None:
  """The reader of a corrupted segment file in a process of its own: per line of stdin (the
  kind of region damaged), read_segment, and one line of answer on stdout."""
  fd = os.open(path, os.O_RDWR)
  size = os.fstat(fd).st_size
  mm = mmap.mmap(fd, size)
  base = ffi.cast("void *", ffi.from_buffer(mm))
  for line in sys.stdin:
    sys.stdout.write(read_segment(base, size, line.strip()) + "\n")
    sys.stdout.flush()


def _reads(base, pid, start):
  codes = []
  slot = ffi.new("uint32_t *")
  rc = lib.rs_proc_register(base, pid, start, slot)
  codes.append(rc)
  if rc != lib.RS_OK:
    return codes
  info = ffi.new("rs_segment_info *")
  lib.rs_segment_get_info(base, info)
  for t in range(min(info.num_tables, 4)):
    items = ffi.new("rs_item_rec[]", 64)
    n, size = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    codes.append(lib.rs_table_items(base, t, items, 64, n, size))
    out, got = ffi.new("rs_sample_rec[]", 16), ffi.new("uint32_t *")
    rc = lib.rs_sample(base, slot[0], t, 16, lib.rs_now_ns(), 0, out, got)
    codes.append(rc)
    offs = ffi.new("uint64_t[]", [out[i].desc_off for i in range(got[0])] or [0])
    groups, ng = ffi.new("uint32_t[]", 16), ffi.new("uint32_t *")
    codes.append(lib.rs_group_layouts(base, got[0], offs, 64, groups, ng))
    dst = ffi.new("uint8_t[]", 16 * 64)
    for col_bytes in (4, 8, 24):   # the column sizes of the segment's items (one matches)
      codes.append(lib.rs_gather(base, got[0], offs, 0, dst, 64, col_bytes))
    lib.rs_unpin(base, slot[0], got[0], ffi.new("uint32_t[]", [out[i].pin for i in range(got[0])] or [0]))
    cols = ffi.new("rs_gather_col[2]")
    infob = ffi.new("uint64_t[]", 16 * 5)
    for ncols, sizes, dtypes in ((1, (4,), (b"<f4",)), (2, (24, 8), (b"<f4", b"<i8"))):
      for c in range(ncols):
        cols[c].out, cols[c].stride, cols[c].col_bytes, cols[c].dtype = dst + 32 * c, 64, sizes[c], dtypes[c]
      got[0] = 0
      codes.append(lib.rs_sample_gather(base, slot[0], t, 16, 0, lib.rs_now_ns(), 0, ncols, cols,
                                        infob, got))
  lib.rs_proc_unregister(base, slot[0])
  return codes


class CorruptTarget:
  """A populated server segment copied to /dev/shm/rvshm.fuzzcorrupt_<pid>, its pristine bytes,
  the regions a patch may hit, and the worker process that reads it."""

  def __init__(self, name=None):
    import reverb_shm  # pylint: disable=import-outside-toplevel
    from reverb_shm import rate_limiters, selectors  # pylint: disable=import-outside-toplevel
    tables = [
        reverb_shm.Table("prio", selectors.Prioritized(0.8), selectors.Fifo(), 40,
                         rate_limiters.MinSize(1)),
        reverb_shm.Table("heap", selectors.Uniform(), selectors.MinHeap(), 40,
                         rate_limiters.MinSize(1)),
    ]
    # The server only fills the segment: its bytes are copied and it is stopped, so that no
    # thread of this process (the server's reaper) ever reads the corrupted copy.
    # max_bytes: the segment file is as large as the server may grow; keep the copy small.
    server = reverb_shm.Server(tables, name=f"fuzzsrc_{os.getpid()}", max_procs=8,
                               pins_per_proc=256, arena_bytes=1 << 20, max_bytes=4 << 20)
    try:
      client = server.localhost_client()
      with client.trajectory_writer(num_keep_alive_refs=3) as writer:
        for step in range(30):
          writer.append({"obs": np.full(2, step, np.float32), "act": np.int64(step)})
          if step >= 2:
            traj = {"obs": writer.history["obs"][-3:], "act": writer.history["act"][-1]}
            writer.create_item("prio", 1.0 + step % 4, traj)
            writer.create_item("heap", 1.0 + step % 5, traj)
        writer.flush()
      for i in range(10):
        client.insert(np.float32(i), priorities={"prio": 0.5, "heap": float(i)})
      with open(f"/dev/shm/rvshm.{server.name}", "rb") as f:
        self.pristine = f.read()
    finally:
      server.stop()
    self.size = len(self.pristine)
    self.name = name or f"fuzzcorrupt_{os.getpid()}"
    self.path = f"/dev/shm/rvshm.{self.name}"
    self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(self.fd, self.size)
    self.mm = mmap.mmap(self.fd, self.size)
    self.mm[:] = self.pristine
    self.base = ffi.cast("void *", ffi.from_buffer(self.mm))
    self.regions = self._regions()
    self.worker = None

  def _regions(self):
    buf = ffi.from_buffer(self.mm)
    base = ffi.cast("void *", buf)
    hdr = struct.unpack_from("<QQQQiiQIIIIQQQQQQ", self.pristine, 0)
    ntables, tables_off, arena_off, arena_size = hdr[7], hdr[11], hdr[15], hdr[16]
    toffs = struct.unpack_from(f"<{ntables}Q", self.pristine, tables_off)
    # Lock words are left alone: a lock word that claims a live owner blocks every locker (the
    # mutex is where the segment's trust starts; a robust mutex only recovers from real deaths).
    avoid = _lock_words(self.pristine, 0, 4096)
    regions = {"header": [(0, tables_off + 8 * ntables)], "table": [], "arrays": [],
               "desc": [], "chunk": [], "arena": [(arena_off, arena_size)]}
    for t, off in enumerate(toffs):
      # The table's first array (its records) follows the header: the smallest 64-aligned
      # offset past the header that the header's first 1024 bytes name.
      named = [v for v in struct.unpack_from("<128Q", self.pristine, off)
               if off < v < off + 4096 and v % 64 == 0]
      th = types.SimpleNamespace(recs_off=min(named))
      regions["table"].append((off, th.recs_off - off))
      avoid += _lock_words(self.pristine, off, th.recs_off - off)
      end = toffs[t + 1] if t + 1 < len(toffs) else arena_off
      regions["arrays"].append((th.recs_off, end - th.recs_off))
      items = ffi.new("rs_item_rec[]", 64)
      n, size = ffi.new("uint64_t *"), ffi.new("uint64_t *")
      ok(lib.rs_table_items(base, t, items, 64, n, size), "rs_table_items")
      for i in range(n[0]):
        doff = items[i].desc_off & ((1 << 48) - 1)
        d = ffi.cast("rs_desc_hdr *", buf + doff)
        regions["desc"].append((doff, 8 + 16 * d.ncols + 16 * d.nslices))
        sl = ffi.cast("rs_desc_slice *", buf + doff + 8 + 16 * d.ncols)
        for j in range(d.nslices):
          regions["chunk"].append((sl[j].chunk_off, ffi.sizeof("rs_chunk_hdr")))
    self.avoid = avoid
    return {kind: sorted(set(spans)) for kind, spans in regions.items()}

  def _start_worker(self):
    self.worker = subprocess.Popen([sys.executable, __file__, "--corrupt-worker", self.path],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

  def corrupt(self, data: bytes) -> str:
    """Restores the pristine bytes, then writes the input's patches (up to 6 of 1..8 bytes) into
    one kind of region; returns that kind."""
    import atheris  # pylint: disable=import-outside-toplevel
    fdp = atheris.FuzzedDataProvider(data)
    kinds = sorted(self.regions)
    kind = kinds[fdp.ConsumeIntInRange(0, len(kinds) - 1)]
    patches = []
    for _ in range(fdp.ConsumeIntInRange(1, 6)):
      spans = self.regions[kind]
      off, length = spans[fdp.ConsumeIntInRange(0, len(spans) - 1)]
      at = off + fdp.ConsumeIntInRange(0, max(length - 1, 0))
      patches.append((at, fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 8))))
    self.apply(patches)
    return kind

  def apply(self, patches) -> None:
    """Restores the pristine bytes, then writes each (offset, bytes) patch, clipped to the
    segment and skipping lock words."""
    self.mm[:] = self.pristine
    for at, patch in patches:
      patch = patch[:self.size - at]
      if not patch or any(a < at + len(patch) and at < a + n for a, n in self.avoid):
        continue
      self.mm[at:at + len(patch)] = patch

  def run(self, data: bytes) -> str:
    """One corrupt-mode input, read in this process (coverage-guided; a crash is a finding)."""
    kind = self.corrupt(data)
    return read_segment(self.base, self.size, kind)

  def read_in_worker(self, kind: str) -> str:
    """The segment as it is now, read by the worker process, which must answer (not crash, not
    hang) within 20 s. Raises Violation otherwise."""
    if self.worker is None:
      self._start_worker()
    self.worker.stdin.write(kind + "\n")
    self.worker.stdin.flush()
    answer = _readline_within(self.worker, 20.0)
    if answer is None:
      rc = self.worker.poll()
      self.worker.kill()
      self.worker.wait()
      self.worker = None
      raise Violation(f"reader of a segment with corrupted {kind} bytes "
                      f"{'hung' if rc is None else f'died with status {rc}'}")
    return answer.strip()

  def close(self):
    if self.worker:
      self.worker.stdin.close()
      self.worker.kill()
      self.worker.wait()
      self.worker = None
    self.mm.close()
    os.close(self.fd)
    os.unlink(self.path)


def _lock_words(raw, start, length):
  """(offset, 40) of every pthread mutex in raw[start:start + length]: glibc's x86-64 layout has
  the kind at byte 16, PTHREAD_MUTEX_ROBUST_NORMAL_NP | PTHREAD_MUTEX_PSHARED_BIT (144) here."""
  found = []
  for o in range(start, start + length - 40, 8):
    if struct.unpack_from("<i", raw, o + 16)[0] == 144:
      found.append((o, 40))
  return found


def _readline_within(proc, timeout):
  import select  # pylint: disable=import-outside-toplevel
  ready, _, _ = select.select([proc.stdout], [], [], timeout)
  if not ready:
    return None
  line = proc.stdout.readline()
  return line or None


# ------------------------------------------------------------------------------ driver


def _loaded(fragment):
  with open("/proc/self/maps") as maps:
    return {line.split()[-1] for line in maps if fragment in line}


def register_native_coverage():
  """Hands the coverage shim's counters (libcovshim.so, preloaded by tests/sanitize.py) to
  atheris's libFuzzer, which atheris loads when fuzzing starts (so this runs at the first
  input). Returns the shim, or None when the core was built without edge coverage."""
  shims, cores = _loaded("libcovshim.so"), _loaded("core_with_libfuzzer")
  if not shims:
    return None
  if len(shims) != 1 or len(cores) != 1:
    raise RuntimeError(f"expected one coverage shim and one libFuzzer, found {shims}, {cores}")
  shim = ctypes.CDLL(shims.pop())     # already loaded: the same handles
  fuzzer = ctypes.CDLL(cores.pop())
  counters_init = ctypes.cast(fuzzer.__sanitizer_cov_8bit_counters_init, ctypes.c_void_p).value
  pcs_init = ctypes.cast(fuzzer.__sanitizer_cov_pcs_init, ctypes.c_void_p).value
  shim.rs_cov_register.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
  shim.rs_cov_register(counters_init, pcs_init)
  shim.rs_cov_edges.restype = ctypes.c_uint32
  return shim


def main(argv):
  if len(argv) >= 2 and argv[1] == "--corrupt-worker":
    corrupt_worker(argv[2])
    return
  import atheris  # pylint: disable=import-outside-toplevel
  mode = argv[1]
  fuzz_args = [argv[0]] + argv[2:]
  stats = {"runs": 0, "shim": None}
  if mode == "ops":
    body = run_ops
  elif mode == "corrupt":
    target = CorruptTarget()
    atexit.register(target.close)
    body = target.run
  else:
    raise SystemExit(f"mode must be ops or corrupt, got {mode!r}")

  def one(data):
    if stats["runs"] == 0:
      stats["shim"] = register_native_coverage()
    stats["runs"] += 1
    body(data)

  atheris.Setup(fuzz_args, one)
  atheris.Fuzz()


if __name__ == "__main__":
  main(sys.argv)
