"""C core: segment layout, process slots, the chunk/descriptor arena and the invariant checker.

Drives reverb_shm._core directly through cffi on an anonymous shared mapping (MAP_SHARED, so a
forked child works on the same memory), independent of the Python layer above it.
"""
import mmap
import os
import re
import signal
import struct
import subprocess
import sys
import time
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reverb_shm._core import ffi, lib

pytestmark = pytest.mark.timeout(60)

ARENA = 1 << 20
PINS = 64


def err() -> str:
  return ffi.string(lib.rs_last_error()).decode()


def table_config(cfg, name=b"t0", max_size=100):
  cfg.name = name
  cfg.max_size = max_size
  cfg.max_times_sampled = 0
  cfg.sampler_kind = lib.RS_SEL_FIFO
  cfg.remover_kind = lib.RS_SEL_FIFO
  cfg.samples_per_insert = 1.0
  cfg.min_size_to_sample = 1
  cfg.min_diff = -1e300
  cfg.max_diff = 1e300
  cfg.blob = ffi.NULL
  cfg.blob_len = 0


class Segment:
  """One initialised segment in an anonymous shared mapping, with a registered slot."""

  def __init__(self, arena=ARENA, max_procs=8, pins=PINS, ntables=1):
    self.cfgs = ffi.new("rs_table_config[]", ntables)
    for i in range(ntables):
      table_config(self.cfgs[i], name=b"t%d" % i)
    self.size = lib.rs_segment_size(self.cfgs, ntables, max_procs, pins, arena)
    assert self.size, err()
    self.mem = mmap.mmap(-1, self.size)
    self.base = ffi.from_buffer(self.mem)
    rc = lib.rs_segment_init(self.base, self.size, self.cfgs, ntables, max_procs, pins, arena,
                             os.getpid(), lib.rs_proc_start_time(os.getpid()), 7)
    assert rc == lib.RS_OK, err()
    self.slot = self.register(os.getpid())

  def register(self, pid, start_time=None):
    out = ffi.new("uint32_t *")
    if start_time is None:
      start_time = lib.rs_proc_start_time(pid)
    rc = lib.rs_proc_register(self.base, pid, start_time, out)
    assert rc == lib.RS_OK, err()
    return out[0]

  def info(self):
    out = ffi.new("rs_segment_info *")
    assert lib.rs_segment_get_info(self.base, out) == lib.RS_OK
    return out

  def check(self):
    report = ffi.new("char[]", 8192)
    rc = lib.rs_check(self.base, report, 8192)
    assert rc == lib.RS_OK, ffi.string(report).decode()

  def chunk(self, nrows=1, row_shape=(3333,), dtype=b"|u1", itemsize=1, slot=None, episode=1,
            publish=None):
    """Allocates a chunk; returns (chunk_off, pin). Publishes `publish` rows (default: all)."""
    meta = chunk_meta(nrows, row_shape, dtype, itemsize, episode)
    off, pin = ffi.new("uint64_t *"), ffi.new("uint32_t *")
    rc = lib.rs_chunk_alloc(self.base, self.slot if slot is None else slot, meta, off, pin)
    if rc != lib.RS_OK:
      return rc, None
    rows = nrows if publish is None else publish
    if rows:
      assert lib.rs_chunk_publish_rows(self.base, off[0], rows) == lib.RS_OK, err()
    return off[0], pin[0]

  def hdr(self, chunk_off):
    return ffi.cast("rs_chunk_hdr *", self.base + chunk_off)

  def unpin(self, *pins, slot=None):
    arr = ffi.new("uint32_t[]", list(pins))
    return lib.rs_unpin(self.base, self.slot if slot is None else slot, len(pins), arr)

  def insert(self, key, blob, table=0):
    buf = ffi.new("uint64_t[]", (len(blob) + 7) // 8 or 1)
    ffi.memmove(buf, blob, len(blob))
    keys, prios = ffi.new("uint64_t[]", [key]), ffi.new("double[]", [1.0])
    offs, done = ffi.new("uint64_t[]", [0, len(blob)]), ffi.new("uint32_t *")
    rc = lib.rs_insert(self.base, self.slot, table, 1, keys, prios, ffi.cast("uint8_t *", buf),
                       offs, -1, -1, done)
    return rc

  def delete(self, *keys, table=0):
    k = ffi.new("uint64_t[]", list(keys))
    upd, dele = ffi.new("uint32_t *"), ffi.new("uint32_t *")
    assert lib.rs_mutate(self.base, table, 0, ffi.NULL, ffi.NULL, len(keys), k, upd, dele) == 0, err()
    return dele[0]

  def sample(self, n, table=0):
    out, got = ffi.new("rs_sample_rec[]", n), ffi.new("uint32_t *")
    rc = lib.rs_sample(self.base, self.slot, table, n, lib.rs_now_ns() + 10**9, 10**9, out, got)
    assert rc == lib.RS_OK, err()
    # Copies: an element of a cffi array does not keep the array (owned by `out`) alive.
    fields = [name for name, _ in ffi.typeof("rs_sample_rec").fields]
    return [types.SimpleNamespace(**{f: getattr(out[i], f) for f in fields})
            for i in range(got[0])]

  def validate(self, blob):
    """rs_desc_validate is internal: reach it through an insert, then undo a success."""
    rc = self.insert(2**63, blob)
    if rc == lib.RS_OK:
      assert self.delete(2**63) == 1
    return rc


def chunk_meta(nrows, row_shape, dtype, itemsize, episode=1):
  meta = ffi.new("rs_chunk_hdr *")
  meta.episode_id = episode
  meta.capacity = nrows
  meta.ndim = len(row_shape)
  for i, d in enumerate(row_shape):
    meta.shape[i] = d
  row = itemsize
  for d in row_shape:
    row *= d
  meta.row_bytes = 0 if dtype == b"O" else row
  meta.dtype = dtype
  return meta


def desc(columns):
  """Descriptor blob. columns: list of (flags, [(chunk_off, row_offset, nrows), ...])."""
  slices = [s for _, col in columns for s in col]
  out = struct.pack("<II", len(columns), len(slices))
  first = 0
  for flags, col in columns:
    out += struct.pack("<IIII", first, len(col), flags, 0)
    first += len(col)
  for off, row, n in slices:
    out += struct.pack("<QII", off, row, n)
  return out


@pytest.fixture
def seg():
  return Segment()


# ----------------------------------------------------------------------------------- layout


def test_segment_header_and_info_describe_the_configuration(seg):
  info = seg.info()
  assert info.total_size == seg.size
  assert info.arena_size == ARENA and info.arena_used == 0 and info.arena_free == ARENA
  assert (info.num_tables, info.max_procs, info.pins_per_proc, info.live_procs) == (1, 8, PINS, 1)
  assert info.owner_pid == os.getpid() and info.generation == 7 and info.layout_version == 6
  assert lib.rs_segment_validate(seg.base, seg.size) == lib.RS_OK
  seg.check()


def test_table_directory_finds_names_and_blobs():
  cfgs = ffi.new("rs_table_config[]", 2)
  blob = b"\x81\xa3sig\xc0" * 3
  keep = ffi.new("uint8_t[]", blob)
  for i, name in enumerate([b"alpha", b"beta"]):
    table_config(cfgs[i], name=name)
  cfgs[1].blob, cfgs[1].blob_len = keep, len(blob)
  size = lib.rs_segment_size(cfgs, 2, 4, 16, 8192)
  mem = mmap.mmap(-1, size)
  base = ffi.from_buffer(mem)
  assert lib.rs_segment_init(base, size, cfgs, 2, 4, 16, 8192, os.getpid(), 0, 1) == 0, err()
  t = ffi.new("uint32_t *")
  assert lib.rs_table_find(base, b"beta", t) == 0 and t[0] == 1
  assert lib.rs_table_find(base, b"gamma", t) == lib.RS_ENOTFOUND and "gamma" in err()
  name = ffi.new("char[64]")
  assert lib.rs_table_name(base, 0, name) == 0 and ffi.string(name) == b"alpha"
  assert lib.rs_table_name(base, 2, name) == lib.RS_ENOTFOUND
  off, n = ffi.new("uint64_t *"), ffi.new("uint32_t *")
  assert lib.rs_table_blob(base, 1, off, n) == 0
  assert n[0] == len(blob) and ffi.buffer(base + off[0], n[0])[:] == blob


@pytest.mark.parametrize("mutate, ntables, procs, pins, arena, message", [
    (lambda c: setattr(c[1], "name", b"t0"), 2, 8, 16, 8192, "unique"),
    (lambda c: setattr(c[0], "name", b""), 1, 8, 16, 8192, "name"),
    (lambda c: setattr(c[0], "max_size", 0), 1, 8, 16, 8192, "max_size"),
    (lambda c: setattr(c[0], "max_size", 1 << 40), 1, 8, 16, 8192, "max_size"),
    (lambda c: setattr(c[0], "sampler_kind", 9), 1, 8, 16, 8192, "sampler kind"),
    (lambda c: setattr(c[0], "remover_kind", -1), 1, 8, 16, 8192, "remover kind"),
    (lambda c: setattr(c[0], "samples_per_insert", 0.0), 1, 8, 16, 8192, "samples_per_insert"),
    (lambda c: setattr(c[0], "samples_per_insert", float("nan")), 1, 8, 16, 8192, "samples_per_insert"),
    (lambda c: setattr(c[0], "min_size_to_sample", 0), 1, 8, 16, 8192, "min_size_to_sample"),
    (lambda c: setattr(c[0], "blob_len", (1 << 20) + 1), 1, 8, 16, 8192, "blob"),
    (lambda c: None, 1, 0, 16, 8192, "max_procs"),
    (lambda c: None, 1, 4097, 16, 8192, "max_procs"),
    (lambda c: None, 1, 8, 15, 8192, "pins_per_proc"),
    (lambda c: None, 1, 8, 16, 100, "arena"),
    (lambda c: None, 0, 8, 16, 8192, "tables"),
])
def test_bad_configuration_gives_size_zero_and_names_the_problem(mutate, ntables, procs, pins,
                                                                 arena, message):
  cfgs = ffi.new("rs_table_config[]", 2)
  table_config(cfgs[0], b"t0")
  table_config(cfgs[1], b"t1")
  mutate(cfgs)
  assert lib.rs_segment_size(cfgs, ntables, procs, pins, arena) == 0
  assert message in err()


def test_validate_rejects_foreign_or_mismatched_segments(seg):
  assert lib.rs_segment_validate(seg.base, seg.size + 4096) == lib.RS_ECORRUPT
  assert "header says %d bytes, mapped %d" % (seg.size, seg.size + 4096) in err()
  blank = mmap.mmap(-1, seg.size)
  assert lib.rs_segment_validate(ffi.from_buffer(blank), seg.size) == lib.RS_ECORRUPT
  assert "magic" in err() and "expected 0x" in err() and "found 0x0000000000000000" in err()
  hdr = ffi.cast("uint64_t *", seg.base)
  hdr[1] = 99  # layout_version
  assert lib.rs_segment_validate(seg.base, seg.size) == lib.RS_ECORRUPT
  assert "expected 6, found 99" in err()


def test_close_marks_every_table_closed(seg):
  assert lib.rs_segment_close(seg.base) == lib.RS_OK
  assert seg.info().closed == 1
  stats = ffi.new("rs_table_stats *")
  assert lib.rs_table_get_stats(seg.base, 0, stats) == 0 and stats.closed


# ----------------------------------------------------------------------------------- slots


def test_proc_start_time_matches_proc_stat_and_survives_odd_comm():
  # A process whose name holds spaces and parentheses must not shift the fields.
  code = ("import time; open('/proc/self/comm', 'w').write(') x (y) 1 2'); print('ok', flush=True);"
          " time.sleep(30)")
  child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
  try:
    assert child.stdout.readline() == b"ok\n"
    assert open(f"/proc/{child.pid}/comm").read() == ") x (y) 1 2\n"
    stat = open(f"/proc/{child.pid}/stat").read()
    expected = int(stat[stat.rindex(")") + 2:].split()[19])
    assert lib.rs_proc_start_time(child.pid) == expected > 0
  finally:
    child.kill()
    child.wait(10)
  assert lib.rs_proc_start_time(child.pid) == 0
  assert lib.rs_proc_start_time(-1) == 0


def test_proc_start_time_of_an_exited_process_is_zero_until_its_threads_end():
  # Killed but not reaped (a zombie): gone. Its main thread exited while another thread runs
  # (the leader shows as a zombie then too): alive.
  child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
  code = ("import ctypes, threading, time; threading.Thread(target=time.sleep, args=(30,)).start();"
          " print('ok', flush=True); ctypes.CDLL(None).pthread_exit(None)")
  leader_gone = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
  try:
    assert leader_gone.stdout.readline() == b"ok\n"
    child.kill()
    deadline = time.monotonic() + 10
    for proc in (child, leader_gone):
      while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert lib.rs_proc_start_time(child.pid) == 0
    assert lib.rs_proc_start_time(leader_gone.pid) > 0
  finally:
    for proc in (child, leader_gone):
      proc.kill()
      proc.wait(10)


def test_register_until_full_then_unregister_frees_a_slot():
  s = Segment(max_procs=3)
  slots = [s.slot, s.register(os.getpid()), s.register(os.getpid())]
  assert sorted(slots) == [0, 1, 2] and s.info().live_procs == 3
  out = ffi.new("uint32_t *")
  assert lib.rs_proc_register(s.base, os.getpid(), 0, out) == lib.RS_EFULL
  assert "max_procs=3" in err() and "raise max_procs" in err()
  assert lib.rs_proc_unregister(s.base, 1) == 0
  assert s.register(os.getpid()) == 1
  assert lib.rs_proc_unregister(s.base, 9) == lib.RS_EINVAL


def test_unregister_releases_the_slots_pins(seg):
  other = seg.register(os.getpid())
  for _ in range(5):
    seg.chunk(slot=other)
  assert seg.info().num_chunks == 5
  assert lib.rs_proc_unregister(seg.base, other) == 0
  assert seg.info().num_chunks == 0 and seg.info().arena_used == 0
  seg.check()


# ----------------------------------------------------------------------------------- arena


def test_odd_sized_chunks_are_aligned_and_coalesce_back_to_one_block(seg):
  chunks = [seg.chunk(nrows=n) for n in (1, 3, 7, 2, 5)]
  for off, _ in chunks:
    h = seg.hdr(off)
    assert off % 64 == 0 and (off + h.data_offset) % 64 == 0
    assert h.nbytes == h.capacity * 3333 and h.row_bytes == 3333
  used = seg.info().arena_used
  assert used >= sum(64 + 3333 * n for n in (1, 3, 7, 2, 5))
  seg.check()
  # Free in an order that exercises forward, backward and two-sided merges.
  for i in (1, 3, 2, 0, 4):
    assert seg.unpin(chunks[i][1]) == lib.RS_OK
    seg.check()
  info = seg.info()
  assert info.arena_used == 0 and info.num_chunks == 0
  # The whole arena is one free block again: the largest possible chunk fits.
  big, pin = seg.chunk(nrows=1, row_shape=(ARENA - 64 - seg.hdr(chunks[0][0]).data_offset,))
  assert pin is not None, err()
  seg.unpin(pin)


def test_exhaustion_reports_need_largest_and_free(seg):
  off, pin = seg.chunk(nrows=200, row_shape=(4096,))  # ~800 KiB of 1 MiB
  assert pin is not None
  rc, _ = seg.chunk(nrows=100, row_shape=(4096,))
  assert rc == lib.RS_ENOSPC
  m = re.search(r"arena full: need (\d+) bytes, largest free block (\d+) bytes, free (\d+) of (\d+) bytes",
                err())
  assert m, err()
  need, largest, free, total = map(int, m.groups())
  assert need >= 409600 and largest < need and total == ARENA
  assert free == ARENA - seg.info().arena_used and largest <= free
  # Nothing changed: one chunk, invariants hold.
  assert seg.info().num_chunks == 1
  seg.check()


def test_chunk_metadata_is_validated(seg):
  cases = [
      (chunk_meta(1, (3,), b"<f4", 4), lambda m: setattr(m, "row_bytes", 11), "row_bytes"),
      (chunk_meta(1, (3,), b"<f4", 4), lambda m: setattr(m, "capacity", 0), "capacity"),
      (chunk_meta(1, (3,), b"<f4", 4), lambda m: setattr(m, "ndim", 9), "rank"),
      (chunk_meta(1, (3,), b"<f4", 4), lambda m: m.shape.__setitem__(0, -1), "shape"),
      (chunk_meta(1, (3,), b"<f4", 4), lambda m: setattr(m, "dtype", b""), "dtype"),
      (chunk_meta(1, (3,), b"<f4", 4), lambda m: setattr(m, "dtype", b"f"), "dtype"),
      (chunk_meta(1, (), b"O", 0), lambda m: setattr(m, "nbytes", 0), "nbytes"),
  ]
  off, pin = ffi.new("uint64_t *"), ffi.new("uint32_t *")
  for meta, mutate, word in cases:
    mutate(meta)
    assert lib.rs_chunk_alloc(seg.base, seg.slot, meta, off, pin) == lib.RS_EINVAL
    assert word in err()
  meta = chunk_meta(2, (), b"O", 0)
  meta.nbytes = 100
  assert lib.rs_chunk_alloc(seg.base, seg.slot, meta, off, pin) == lib.RS_OK
  assert seg.hdr(off[0]).nbytes == 100
  meta = chunk_meta(2, (5,), b"<U5", 20)
  assert lib.rs_chunk_alloc(seg.base, seg.slot, meta, off, pin) == lib.RS_OK, err()
  assert lib.rs_chunk_alloc(seg.base, 99, meta, off, pin) == lib.RS_EINVAL
  assert seg.info().num_chunks == 2
  seg.check()


def test_publish_rows_is_monotonic_and_bounded(seg):
  off, _ = seg.chunk(nrows=10, publish=0)
  h = seg.hdr(off)
  assert lib.rs_chunk_publish_rows(seg.base, off, 4) == 0 and h.rows == 4
  assert lib.rs_chunk_publish_rows(seg.base, off, 3) == lib.RS_EINVAL and "already published" in err()
  assert lib.rs_chunk_publish_rows(seg.base, off, 11) == lib.RS_EINVAL
  assert lib.rs_chunk_publish_rows(seg.base, off + 64, 1) == lib.RS_EINVAL
  assert h.rows == 4


def test_shrink_returns_the_tail_and_merges_it(seg):
  off, pin = seg.chunk(nrows=100, publish=10)
  before = seg.info().arena_used
  assert lib.rs_chunk_shrink(seg.base, off, 9) == lib.RS_EINVAL   # below published rows
  assert lib.rs_chunk_shrink(seg.base, off, 101) == lib.RS_EINVAL
  assert lib.rs_chunk_shrink(seg.base, off, 10) == lib.RS_OK
  h = seg.hdr(off)
  assert (h.capacity, h.nbytes, h.rows) == (10, 33330, 10)
  after = seg.info().arena_used
  assert before - after >= 90 * 3333 - 64
  seg.check()
  # The freed tail merged with the free space after it: one free block beyond the chunk.
  assert seg.unpin(pin) == 0 and seg.info().arena_used == 0
  seg.check()


def test_unpin_validates_all_pins_before_releasing_any(seg):
  _, p0 = seg.chunk()
  _, p1 = seg.chunk()
  assert seg.unpin(p0, p0) == lib.RS_EINVAL and "twice" in err()
  assert seg.unpin(p1, PINS + 3) == lib.RS_EINVAL and "out of range" in err()
  assert seg.unpin(p1, 40) == lib.RS_EINVAL and "not held" in err()
  assert seg.info().num_chunks == 2
  seg.check()
  assert seg.unpin(p0, p1) == 0 and seg.info().num_chunks == 0
  assert seg.unpin(p0) == lib.RS_EINVAL


def test_pin_log_full_is_reported_without_partial_effect():
  s = Segment(pins=16)
  pins = [s.chunk(nrows=1, row_shape=(8,))[1] for _ in range(16)]
  assert None not in pins
  rc, _ = s.chunk(nrows=1, row_shape=(8,))
  assert rc == lib.RS_EFULL and "pin log" in err() and "16 of 16" in err()
  assert s.info().num_chunks == 16
  s.unpin(*pins)
  s.check()


# ----------------------------------------------------------------------------------- descriptors


def test_descriptor_validation_names_column_and_slice(seg):
  a, _ = seg.chunk(nrows=4, row_shape=(3,), dtype=b"<f4", itemsize=4)
  b, _ = seg.chunk(nrows=4, row_shape=(3,), dtype=b"<f4", itemsize=4, publish=2)
  c, _ = seg.chunk(nrows=4, row_shape=(2,), dtype=b"<f4", itemsize=4)
  good = desc([(0, [(a, 0, 4), (b, 0, 2)]), (1, [(c, 3, 1)])])
  assert seg.validate(good) == lib.RS_OK, err()
  cases = [
      (good[:-4], "bytes"),
      (struct.pack("<II", 0, 0), "at least 1"),
      (desc([(0, [(a, 0, 4)]), (0, [(b, 1, 2)])]), "column 1 slice 0"),       # row 2 unpublished
      (desc([(0, [(a, 0, 4), (a + 64, 0, 1)])]), "column 0 slice 1"),         # not a chunk
      (desc([(0, [(a, 0, 4), (12345, 0, 1)])]), "not a live chunk"),
      (desc([(0, [(a, 0, 0)])]), "non-empty"),
      (desc([(1, [(a, 0, 2)])]), "squeezed"),
      (desc([(0, [(a, 0, 1), (c, 0, 1)])]), "same dtype and shape"),
      (desc([(4, [(a, 0, 1)])]), "flags"),
  ]
  for blob, word in cases:
    assert seg.validate(blob) == lib.RS_EINVAL, blob
    assert word in err(), (word, err())
  # A column whose slice range points past the descriptor's slices.
  bad = bytearray(good)
  struct.pack_into("<I", bad, 8 + 16, 3)  # column 1: first_slice 3 of 3
  assert seg.validate(bytes(bad)) == lib.RS_EINVAL and "out of range" in err()


def test_items_hold_chunks_and_samples_hold_items(seg):
  a, pa = seg.chunk(nrows=4)
  b, pb = seg.chunk(nrows=4)
  blob = desc([(0, [(a, 0, 2), (a, 2, 2)]), (0, [(b, 1, 3)])])   # chunk a named twice
  assert seg.insert(1, blob) == lib.RS_OK, err()
  assert seg.insert(2, desc([(0, [(a, 0, 1)])])) == lib.RS_OK, err()
  seg.check()   # verifies refcount(a) == 2 items + 1 pin, refcount(b) == 1 + 1
  assert seg.unpin(pa, pb) == 0
  assert seg.info().num_chunks == 2 and seg.info().num_descs == 2
  seg.check()
  recs = seg.sample(2)                     # Fifo sampler: key 1 twice, one pin each
  assert [r.key for r in recs] == [1, 1]
  assert seg.delete(1, 2) == 2
  assert seg.info().num_descs >= 1          # sampled descriptors survive deletion while pinned
  seg.check()
  assert seg.unpin(*[r.pin for r in recs]) == 0
  info = seg.info()
  assert (info.num_chunks, info.num_descs, info.arena_used) == (0, 0, 0)
  seg.check()


def test_insert_with_bad_descriptor_changes_nothing(seg):
  a, pa = seg.chunk(nrows=2)
  used = seg.info().arena_used
  assert seg.insert(1, desc([(0, [(a, 1, 2)])])) == lib.RS_EINVAL
  assert seg.info().arena_used == used and seg.info().num_descs == 0
  seg.check()


# ----------------------------------------------------------------------------------- dead processes


def _dead_pid():
  child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
  start = lib.rs_proc_start_time(child.pid)
  return child, start


def test_reap_frees_a_dead_writers_chunks_but_keeps_committed_items(seg):
  child, start = _dead_pid()
  try:
    dead = seg.register(child.pid, start)
    kept, _ = seg.chunk(nrows=2, slot=dead)
    lost, _ = seg.chunk(nrows=2, slot=dead, publish=1)   # half-written chunk, never used
    assert seg.insert(5, desc([(0, [(kept, 0, 2)])])) == lib.RS_OK, err()
    reaped = ffi.new("uint32_t *")
    assert lib.rs_reap(seg.base, reaped) == 0 and reaped[0] == 0   # still alive
  finally:
    child.kill()
    child.wait(10)
  assert lib.rs_reap(seg.base, reaped) == 0 and reaped[0] == 1
  info = seg.info()
  assert info.live_procs == 1 and info.num_chunks == 1 and info.num_descs == 1
  seg.check()
  assert seg.delete(5) == 1
  assert seg.info().arena_used == 0
  seg.check()


def test_reap_detects_a_reused_pid_by_start_time(seg):
  stale = seg.register(os.getpid(), lib.rs_proc_start_time(os.getpid()) + 1)
  seg.chunk(slot=stale)
  reaped = ffi.new("uint32_t *")
  assert lib.rs_reap(seg.base, reaped) == 0 and reaped[0] == 1
  assert seg.info().num_chunks == 0 and seg.info().live_procs == 1
  seg.check()


def test_check_reports_a_corrupted_refcount(seg):
  off, pin = seg.chunk()
  refcount = ffi.cast("uint64_t *", seg.base + off - 64)   # block header word 2
  refcount[2] += 1
  report = ffi.new("char[]", 4096)
  assert lib.rs_check(seg.base, report, 4096) == lib.RS_ECORRUPT
  assert "refcount 2, expected 1" in ffi.string(report).decode()
  refcount[2] -= 1
  seg.check()


def test_process_killed_mid_allocation_leaves_a_consistent_arena():
  """A forked child allocates and frees in a loop and is SIGKILLed at a random instant; the
  parent recovers the arena lock if needed, reaps the child and finds every invariant intact."""
  s = Segment(arena=1 << 18, pins=256)
  for round_ in range(6):
    pid = os.fork()
    if pid == 0:  # child: same mapping (MAP_SHARED), its own slot
      try:
        slot = s.register(os.getpid())
        held = []
        i = 0
        while True:
          i += 1
          r = s.chunk(nrows=1 + i % 7, row_shape=(97 + 13 * (i % 11),), slot=slot)
          if r[1] is not None:
            held.append(r[1])
          if len(held) > 20 or r[1] is None:
            s.unpin(*held[: len(held) // 2], slot=slot)
            held = held[len(held) // 2:]
      finally:
        os._exit(0)
    time.sleep(0.05 + 0.03 * round_)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    reaped = ffi.new("uint32_t *")
    assert lib.rs_reap(s.base, reaped) == 0, err()
    assert reaped[0] == 1
    s.check()
    assert s.info().arena_used == 0 and s.info().live_procs == 1


# ----------------------------------------------------------------------------------- random sequences


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 9), st.integers(1, 5000)),
        st.tuples(st.just("unpin"), st.integers(0, 10**6)),
        st.tuples(st.just("shrink"), st.integers(0, 10**6), st.integers(1, 9)),
        st.tuples(st.just("insert"), st.integers(0, 10**6), st.integers(1, 3)),
        st.tuples(st.just("delete"), st.integers(0, 10**6)),
        st.tuples(st.just("sample"), st.integers(1, 3)),
        st.tuples(st.just("release"), st.integers(0, 10**6)),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_operation_sequences_keep_every_invariant(sequence):
  s = Segment(arena=1 << 17, pins=64)
  chunks = []      # (off, pin, rows)
  keys = []
  sampled = []
  next_key = 1
  for op in sequence:
    kind = op[0]
    if kind == "alloc":
      off, pin = s.chunk(nrows=op[1], row_shape=(op[2],), publish=1)
      if pin is not None:
        chunks.append((off, pin, op[1]))
      else:
        assert off in (lib.RS_ENOSPC, lib.RS_EFULL)
    elif kind == "unpin" and chunks:
      off, pin, _ = chunks.pop(op[1] % len(chunks))
      assert s.unpin(pin) == 0
    elif kind == "shrink" and chunks:
      i = op[1] % len(chunks)
      off, pin, _ = chunks[i]
      hdr = s.hdr(off)
      capacity = hdr.capacity
      rc = lib.rs_chunk_shrink(s.base, off, op[2])
      assert rc == (0 if 1 <= op[2] <= capacity else lib.RS_EINVAL)
      assert hdr.capacity == (op[2] if rc == 0 else capacity)
    elif kind == "insert" and chunks:
      picks = [chunks[(op[1] + j) % len(chunks)] for j in range(op[2])]
      blob = desc([(0, [(off, 0, 1)]) for off, _, _ in picks])
      rc = s.insert(next_key, blob)
      if rc == 0:
        keys.append(next_key)
      else:
        assert rc == lib.RS_ENOSPC
      next_key += 1
    elif kind == "delete" and keys:
      assert s.delete(keys.pop(op[1] % len(keys))) == 1
    elif kind == "sample" and keys:
      sampled += [r.pin for r in s.sample(op[1])]
    elif kind == "release" and sampled:
      assert s.unpin(sampled.pop(op[1] % len(sampled))) == 0
    s.check()
  # Releasing everything returns the arena to a single free block.
  s.unpin(*[p for _, p, _ in chunks], *sampled)
  if keys:
    s.delete(*keys)
  s.check()
  assert s.info().arena_used == 0
