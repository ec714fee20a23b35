"""Bad bytes in shared memory: a segment whose header, table headers, table arrays, item
descriptors or chunk headers were overwritten is refused at attach or reported by the invariant
checker with a clear error, and no reader crashes on a damaged descriptor or chunk offset.

Each test copies a populated server segment to /dev/shm/rvshm.<name> (tests/fuzz/fuzz_core.py's
CorruptTarget), damages it, and reads it in this process (named fields) or in a worker process
that must answer every damaged copy (random bytes).
"""
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from reverb_shm import errors
from reverb_shm._internal import shm
from reverb_shm._internal._lib import ffi, lib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz"))
from fuzz_core import CorruptTarget, read_segment  # noqa: E402  pylint: disable=wrong-import-position

pytestmark = pytest.mark.timeout(120)

# rs_seg_hdr (csrc/rs_internal.h): magic, layout_version, total_size, generation (u64 each),
# owner_pid, closed (i32), owner_start_time (u64), num_tables, max_procs, pins_per_proc, ready
# (u32), tables_off, slots_off, pins_off, pin_log_stride, arena_off, arena_size (u64).
HDR_FORMAT = "QQQQiiQIIIIQQQQQQ"
HDR_NAMES = ["magic", "layout_version", "total_size", "generation", "owner_pid", "closed",
             "owner_start_time", "num_tables", "max_procs", "pins_per_proc", "ready", "tables_off",
             "slots_off", "pins_off", "pin_log_stride", "arena_off", "arena_size"]
HDR_FIELD = {name: (struct.calcsize("<" + HDR_FORMAT[:i]), "<" + HDR_FORMAT[i])
             for i, name in enumerate(HDR_NAMES)}
# rs_table_hdr: name[64], max_size u64 @64, ..., sel[0] (kind i32 @80, exponent @88, heap_off
# @96, tree_off @104), ..., free_rec_head @264, order_head @268, ..., recs_off @400.
TABLE_FIELD = {"max_size": (64, "<Q", 1 << 20), "sampler_kind": (80, "<i", 17),
               "tree_off": (104, "<Q", 64), "order_head": (268, "<I", 1 << 20),
               "recs_off": (400, "<Q", 64)}


@pytest.fixture(scope="module")
def target():
  t = CorruptTarget(name=f"corrupt_{os.getpid()}")
  yield t
  t.close()
  assert not os.path.exists(t.path)


def _check_report(t):
  report = ffi.new("char[]", 16384)
  rc = lib.rs_check(t.base, report, 16384)
  return rc, ffi.string(report).decode()


def test_the_pristine_copy_attaches_checks_and_reads(target):
  target.apply([])
  answer = read_segment(target.base, target.size, "none")
  assert answer.startswith("validate=0 check=0 reads=0,"), answer
  seg = shm.Segment.attach(target.name)
  try:
    seg.check()
  finally:
    seg.close()


@pytest.mark.parametrize("field,value,message", [
    ("magic", 0x1234, "bad segment magic"),
    ("layout_version", 99, "layout version"),
    ("total_size", 12345, "segment size"),
    ("num_tables", 0, "counts out of range"),
    ("tables_off", 1 << 40, "outside the"),
    ("arena_off", 1 << 40, "outside the"),
])
def test_a_damaged_header_is_refused_at_attach(target, field, value, message):
  at, fmt = HDR_FIELD[field]
  target.apply([(at, struct.pack(fmt, value))])
  assert lib.rs_segment_validate(target.base, target.size) == lib.RS_ECORRUPT
  assert message in ffi.string(lib.rs_last_error()).decode()
  with pytest.raises(errors.CorruptError, match=message):
    shm.Segment.attach(target.name)


def test_table_field_offsets_match_the_layout(target):
  off, _ = target.regions["table"][0]
  assert struct.unpack_from("<Q", target.pristine, off + 400)[0] == target.regions["arrays"][0][0]
  assert struct.unpack_from("<Q", target.pristine, off + 64)[0] == 40       # "prio" max_size
  assert struct.unpack_from("<i", target.pristine, off + 80)[0] == lib.RS_SEL_PRIORITIZED
  assert struct.unpack_from("<Q", target.pristine, off + 104)[0] > off      # its sum tree


@pytest.mark.parametrize("field", sorted(TABLE_FIELD))
def test_a_damaged_table_header_is_refused_at_attach_and_by_the_checker(target, field):
  off, _ = target.regions["table"][0]
  at, fmt, value = TABLE_FIELD[field]
  target.apply([(off + at, struct.pack(fmt, value))])
  assert lib.rs_segment_validate(target.base, target.size) == lib.RS_ECORRUPT
  assert "table 0" in ffi.string(lib.rs_last_error()).decode()
  rc, report = _check_report(target)
  assert rc == lib.RS_ECORRUPT and "table 0" in report, report
  with pytest.raises(errors.CorruptError, match="table 0"):
    shm.Segment.attach(target.name)


def _first_desc_slice(t):
  off, _ = t.regions["desc"][0]
  ncols = struct.unpack_from("<I", t.pristine, off)[0]
  return off + 8 + 16 * ncols        # the first rs_desc_slice: chunk_off, row_offset, nrows


@pytest.mark.parametrize("bad_chunk_off", [8, 1 << 40, "table", "misaligned"])
def test_a_damaged_descriptor_is_reported_by_the_checker_and_sampling_raises(target, bad_chunk_off):
  slice_at = _first_desc_slice(target)
  if bad_chunk_off == "table":         # not an arena block: a table header's offset
    bad_chunk_off = target.regions["table"][0][0]
  elif bad_chunk_off == "misaligned":  # inside the arena, 7 bytes past the real chunk
    # (under UBSan, reading a chunk header there was a misaligned access: found by the fuzzer)
    bad_chunk_off = struct.unpack_from("<Q", target.pristine, slice_at)[0] + 7
  target.apply([(slice_at, struct.pack("<Q", bad_chunk_off))])
  rc, report = _check_report(target)
  assert rc == lib.RS_ECORRUPT
  assert "is not a live descriptor whose slices lie in live chunks" in report or \
      "not a chunk block" in report, report
  # Read paths in a process of their own: they answer with error codes, they do not crash.
  answer = target.read_in_worker("desc")
  assert answer.startswith("validate=0 check=-6 reads="), answer
  assert str(lib.RS_ECORRUPT) in answer.split("reads=")[1].split(","), answer


def test_a_damaged_chunk_header_is_reported_and_not_dereferenced(target):
  chunk_off, _ = target.regions["chunk"][0]
  # data_offset (after episode_id, start_step, row_bytes, nbytes) far beyond the segment
  target.apply([(chunk_off + 32, struct.pack("<Q", 1 << 44))])
  rc, report = _check_report(target)
  assert rc == lib.RS_ECORRUPT and "data_offset" in report, report
  answer = target.read_in_worker("chunk")
  assert str(lib.RS_ECORRUPT) in answer.split("reads=")[1].split(","), answer
  # The Python reader of sampled items refuses the chunk too (no view of foreign memory).
  code = ("import sys; from reverb_shm import shared_table, errors\n"
          "st = shared_table.SharedTable.attach(sys.argv[1] + '/prio')\n"
          "try:\n"
          "  for _ in range(40):\n"
          "    [s.data for s in st.sample(16)]\n"
          "  print('READ')\n"
          "except errors.CorruptError as e:\n"
          "  print('CORRUPT', e)\n")
  out = subprocess.run([sys.executable, "-c", code, target.name], capture_output=True, text=True,
                       timeout=60)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.startswith("CORRUPT") and "is damaged" in out.stdout, out.stdout


def test_more_distinct_episodes_than_the_episode_map_holds_is_reported_not_hung(target):
  """Found by the fuzzer: chunk headers damaged so that the items name more distinct episodes
  than a table's episode map has slots (the first chunk's episode id changed and its flags saying
  each row is an episode of its own). The checker's recount used to probe its full map forever;
  now the check answers with the overflow and every read path answers too."""
  first, second = target.regions["chunk"][0][0], target.regions["chunk"][1][0]
  # rs_chunk_hdr: episode_id @0, ..., rows @48, flags @52.
  target.apply([(first, bytes.fromhex("23ffffffff")), (first + 52, bytes.fromhex("ffff01")),
                (second + 48, bytes.fromhex("00fffbffffff"))])
  answer = target.read_in_worker("chunk")
  assert answer.startswith("validate=0 check=-6 reads="), answer
  rc, report = _check_report(target)
  assert rc == lib.RS_ECORRUPT
  assert "the items name more distinct episodes than the episode map holds" in report, report


@pytest.mark.parametrize("kind", ["header", "table", "arrays", "desc", "chunk", "arena"])
def test_random_bytes_never_crash_a_reader(target, kind):
  """200 copies, each with 1 to 6 random patches of 1 to 8 bytes in one kind of region: the
  worker attaches, checks and (where the check passes, or the damage is in descriptors and chunk
  headers) samples and gathers every copy, and answers each one."""
  rng = np.random.default_rng(list(target.regions).index(kind))
  spans = target.regions[kind]
  answers = set()
  for _ in range(200):
    patches = []
    for _ in range(rng.integers(1, 7)):
      off, length = spans[rng.integers(len(spans))]
      at = off + int(rng.integers(max(length, 1)))
      patches.append((at, rng.bytes(int(rng.integers(1, 9)))))
    target.apply(patches)
    answers.add(target.read_in_worker(kind).split(" reads=")[0])
  # Some damage is caught (the rest may be in bytes no invariant constrains, e.g. payload).
  assert any("=-6" in a for a in answers) or kind == "arena", answers


def test_a_gather_trusts_no_layout_it_cached_past_a_damaged_arena_end(target):
  """Gathers keep each item blob's checked layout for later rounds (csrc/layout_cache.h). An
  entry is used only while its rows lie inside the arena's current bounds: once the header's
  arena size is damaged after the entries were made (no attach or check in between), sampling
  reports the damage (the round's layout check, RS_ECORRUPT) instead of reading rows the arena
  no longer holds (or failing later, at pinning, with another error)."""
  target.apply([])
  base = target.base
  assert lib.rs_segment_validate(base, target.size) == lib.RS_OK
  slot = ffi.new("uint32_t *")
  pid = os.getpid()
  assert lib.rs_proc_register(base, pid, lib.rs_proc_start_time(pid), slot) == lib.RS_OK
  dst = ffi.new("uint8_t[]", 16 * 64)
  cols = ffi.new("rs_gather_col[2]")
  for c, (size, dtype, shape) in enumerate(((8, b"<i8", ()), (24, b"<f4", (3, 2)))):   # act, obs
    cols[c].out, cols[c].stride, cols[c].col_bytes, cols[c].dtype = dst + 32 * c, 64, size, dtype
    cols[c].ndim = len(shape)
    for k, s in enumerate(shape):
      cols[c].shape[k] = s
  info, got = ffi.new("uint64_t[]", 16 * 5), ffi.new("uint32_t *")

  def gather():
    got[0] = 0
    return lib.rs_sample_gather(base, slot[0], 0, 16, 0, lib.rs_now_ns(), 0, 2, cols, info, got)
  try:
    # Table 0 also holds items of another layout: a round stops before the first of those.
    codes = [gather() for _ in range(50)]
    assert lib.RS_OK in codes and set(codes) <= {lib.RS_OK, lib.RS_EINVAL}, codes
    at, fmt = HDR_FIELD["arena_size"]
    target.mm[at:at + 8] = struct.pack(fmt, 64)   # every item's blocks now lie past the arena
    codes = [gather() for _ in range(20)]
    assert codes == [lib.RS_ECORRUPT] * 20, codes
    assert "outside the shared-memory arena" in ffi.string(lib.rs_last_error()).decode()
  finally:
    target.apply([])
    lib.rs_proc_unregister(base, slot[0])
