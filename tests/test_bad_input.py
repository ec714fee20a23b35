"""Bad input at every public entry point: a clear exception, and every table exactly as before.

Each case names the call, the exception type and a fragment of its message. Before and after
every case the whole server is snapshotted (per table: counters, every item's key, priority,
times sampled and payload bytes; arena usage) and the snapshots must be equal.
"""
import math
import os

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import chunks, shm
from reverb_shm._internal._lib import check, ffi, lib

from conftest import unique_server_name

pytestmark = pytest.mark.timeout(60)

_TIMING = {"inserting_ns", "sampling_ns", "waiting_for_sampling_ns", "waiting_for_inserts_ns"}
_SIG = {"obs": reverb_shm.TensorSpec((2,), np.float32), "act": reverb_shm.TensorSpec((), np.int64)}


class Ctx:
  """The server under test and handles on it."""

  def __init__(self):
    self.server = reverb_shm.Server([
        reverb_shm.Table("prio", selectors.Prioritized(0.6), selectors.Fifo(), 100,
                         rate_limiters.MinSize(1)),
        reverb_shm.Table("sig", selectors.Uniform(), selectors.Fifo(), 100,
                         rate_limiters.MinSize(1), signature=_SIG),
        reverb_shm.Table("empty", selectors.Uniform(), selectors.Fifo(), 10,
                         rate_limiters.MinSize(1)),
    ], name=unique_server_name("badinput"), arena_bytes=8 << 20, max_bytes=12 << 20,
        max_procs=16)
    self.client = reverb_shm.Client(f"localhost:{self.server.port}")
    self.prio = self.server.shared_table("prio")
    self.sig = self.server.shared_table("sig")
    self.empty = self.server.shared_table("empty")
    self.seg = self.server.segment
    self.keys = list(self.prio.insert({"x": np.arange(12.0).reshape(4, 3)}, [1.0, 2.0, 3.0, 4.0]))
    self.sig.insert({"obs": np.ones((2, 2), np.float32), "act": np.array([1, 2])}, 1.0)
    self.writer = self.client.trajectory_writer(num_keep_alive_refs=2)
    self.writer.append({"x": np.float32(1.0)})


def _payloads(seg, table) -> list:
  pins = chunks.Pins(seg, seg.generation, np.zeros(0, np.uint32))
  out = []
  for desc_off in table.items()["desc_off"]:
    out.append([np.array(col, copy=True).tobytes() for col in chunks.read_item(seg, desc_off,
                                                                             pins)])
  return out


def snapshot(ctx: Ctx) -> dict:
  snap = {}
  for st in (ctx.prio, ctx.sig, ctx.empty):
    stats = {k: v for k, v in st.stats().items() if k not in _TIMING}
    # A call that waited and timed out held the lock and was blocked: only those counters move.
    stats["counters"] = {k: v for k, v in stats["counters"].items()
                         if not k.startswith("lock_hold") and not k.endswith("blocked_seconds")}
    items = st.items()
    snap[st.name] = (stats, items[["key", "priority", "times_sampled", "insert_seq"]].tolist(),
                     _payloads(ctx.seg, st))
  info = ctx.seg.info()
  snap["arena"] = {k: info[k] for k in ("arena_used", "num_chunks", "num_descs", "closed")}
  return snap


@pytest.fixture(scope="module")
def ctx():
  c = Ctx()
  yield c
  c.writer.close()
  c.server.stop()


# ---- the cases: (id, call(ctx), exception type(s), message fragment)
NAN, INF = float("nan"), float("inf")
CASES = [
    # Server / Table construction
    ("server-no-tables", lambda c: reverb_shm.Server([]), ValueError, "At least one table"),
    ("server-not-a-table", lambda c: reverb_shm.Server(["t"]), TypeError, "Table objects"),
    ("server-dup-tables", lambda c: reverb_shm.Server([_t("a"), _t("a")]), ValueError,
     "unique"),
    ("server-bad-port", lambda c: reverb_shm.Server([_t("a")], port=70000), ValueError, "port"),
    ("server-port-str", lambda c: reverb_shm.Server([_t("a")], port="80"), ValueError, "port"),
    ("server-name-slash", lambda c: reverb_shm.Server([_t("a")], name="a/b"), ValueError,
     "server name"),
    ("server-name-dotdot", lambda c: reverb_shm.Server([_t("a")], name=".."), ValueError,
     "server name"),
    ("server-name-long", lambda c: reverb_shm.Server([_t("a")], name="n" * 65), ValueError,
     "server name"),
    ("server-name-empty", lambda c: reverb_shm.Server([_t("a")], name=""), ValueError,
     "server name"),
    ("server-name-taken", lambda c: reverb_shm.Server([_t("a")], name=c.server.name,
                                                      arena_bytes=1 << 20),
     errors.SegmentInUseError, "already running"),
    ("server-arena-zero", lambda c: reverb_shm.Server([_t("a")], name=unique_server_name(),
                                                      arena_bytes=0), ValueError, "arena_bytes"),
    ("server-arena-negative", lambda c: reverb_shm.Server([_t("a")], name=unique_server_name(),
                                                          arena_bytes=-5), ValueError,
     "arena_bytes"),
    ("server-arena-float", lambda c: reverb_shm.Server([_t("a")], name=unique_server_name(),
                                                       arena_bytes=1.5e6), ValueError,
     "arena_bytes"),
    ("server-arena-huge", lambda c: reverb_shm.Server([_t("a")], name=unique_server_name(),
                                                      arena_bytes=1 << 45),
     errors.ResourceExhaustedError, "need"),
    ("server-max-procs-zero", lambda c: reverb_shm.Server([_t("a")], name=unique_server_name(),
                                                          max_procs=0), ValueError, "max_procs"),
    ("server-mode-world", lambda c: reverb_shm.Server([_t("a")], name=unique_server_name(),
                                                      mode=0o666), ValueError, "mode"),
    ("table-max-size-zero", lambda c: _t("a", max_size=0), ValueError, "max_size"),
    ("table-max-size-negative", lambda c: _t("a", max_size=-1), ValueError, "max_size"),
    ("table-max-size-huge", lambda c: reverb_shm.Server([_t("a", max_size=1 << 40)],
                                                        name=unique_server_name()),
     ValueError, "max_size"),
    ("table-name-slash", lambda c: _t("a/b"), ValueError, "name"),
    ("table-name-empty", lambda c: _t(""), ValueError, "name"),
    ("ratelimiter-min-size-zero", lambda c: rate_limiters.MinSize(0), ValueError, "min_size"),
    ("ratelimiter-min-size-float", lambda c: rate_limiters.MinSize(2.5), TypeError, "integer"),
    ("ratelimiter-min-size-integral-float", lambda c: rate_limiters.MinSize(3.0),
     errors.ArgumentTypeError, "min_size_to_sample must be an int"),
    ("ratelimiter-min-size-np-float", lambda c: rate_limiters.MinSize(np.float32(3.0)),
     errors.ArgumentTypeError, "min_size_to_sample must be an int"),
    ("ratelimiter-min-size-str", lambda c: rate_limiters.MinSize("3"), TypeError,
     "min_size_to_sample must be an int"),
    ("ratelimiter-min-size-beyond-int32", lambda c: rate_limiters.MinSize(2**31),
     errors.ArgumentTypeError, "32-bit"),
    ("s2i-min-size-integral-float",
     lambda c: rate_limiters.SampleToInsertRatio(1.0, 3.0, 10.0), errors.ArgumentTypeError,
     "min_size_to_sample must be an int"),
    ("ratelimiter-base-min-size-integral-float",
     lambda c: rate_limiters.RateLimiter(1.0, 3.0, -1.0, 1.0), errors.ArgumentTypeError,
     "min_size_to_sample must be an int"),
    ("queue-str-size", lambda c: rate_limiters.Queue("3"), TypeError, "size must be a number"),
    ("table-max-size-integral-float", lambda c: _t("a", max_size=10.0), errors.ArgumentTypeError,
     "max_size must be an int"),
    ("table-queue-integral-float", lambda c: reverb_shm.Table.queue("q", 10.0),
     errors.ArgumentTypeError, "max_size must be an int"),
    ("table-max-times-sampled-float", lambda c: reverb_shm.Table(
        "a", selectors.Uniform(), selectors.Fifo(), 10, rate_limiters.MinSize(1),
        max_times_sampled=1.0), errors.ArgumentTypeError, "max_times_sampled must be an int"),
    ("table-max-times-sampled-beyond-int32", lambda c: reverb_shm.Table(
        "a", selectors.Uniform(), selectors.Fifo(), 10, rate_limiters.MinSize(1),
        max_times_sampled=2**31), errors.ArgumentTypeError, "32-bit"),
    ("prioritized-str-exponent", lambda c: selectors.Prioritized("0.6"), TypeError,
     "priority_exponent must be a number"),
    ("ratelimiter-nan-ratio", lambda c: rate_limiters.SampleToInsertRatio(NAN, 1, 2.0),
     ValueError, ""),
    ("ratelimiter-negative-ratio", lambda c: rate_limiters.SampleToInsertRatio(-1.0, 1, 2.0),
     ValueError, ""),
    ("prioritized-nan-exponent", lambda c: selectors.Prioritized(NAN), ValueError, "exponent"),
    # Client addresses
    ("client-address-int", lambda c: reverb_shm.Client(1234), TypeError, "str"),
    ("client-address-garbage", lambda c: reverb_shm.Client("nonsense").server_info(0.1),
     ValueError, "address"),
    ("client-shm-dotdot", lambda c: reverb_shm.Client("shm://../etc").server_info(0.1),
     ValueError, "server name"),
    # Client.insert
    ("insert-unknown-table", lambda c: c.client.insert(np.float32(1), {"nope": 1.0}),
     errors.UnknownTableError, "available"),
    ("insert-nan-priority", lambda c: c.client.insert(np.float32(1), {"prio": NAN}), ValueError,
     "nan"),
    ("insert-inf-priority", lambda c: c.client.insert(np.float32(1), {"prio": INF}), ValueError,
     "finite"),
    ("insert-negative-priority", lambda c: c.client.insert(np.float32(1), {"prio": -1.0}),
     ValueError, "negative"),
    # Where Reverb's bindings raise TypeError (wrong type, int out of range), so does reverb_shm
    # (errors.ArgumentTypeError, a ValueError too).
    ("insert-str-priority", lambda c: c.client.insert(np.float32(1), {"prio": "high"}),
     TypeError, "priorit"),
    ("insert-numeric-str-priority", lambda c: c.client.insert(np.float32(1), {"prio": "2.5"}),
     TypeError, "must be a number, got '2.5'"),
    ("insert-bytes-priority", lambda c: c.client.insert(np.float32(1), {"prio": b"3"}),
     TypeError, "must be a number"),
    ("st-insert-str-priorities", lambda c: c.prio.insert({"x": np.zeros((2, 3))},
                                                         np.array(["1", "2"])),
     ValueError, "priorities must be numbers"),
    ("insert-empty-priorities", lambda c: c.client.insert(np.float32(1), {}), ValueError,
     "must not be empty"),
    ("insert-priorities-list", lambda c: c.client.insert(np.float32(1), [1.0]), TypeError,
     "dict"),
    ("insert-none-leaf", lambda c: c.client.insert({"a": None}, {"prio": 1.0}), ValueError, ""),
    ("insert-wrong-dtype-sig", lambda c: c.client.insert(
        {"obs": np.ones(2, np.float64), "act": np.int64(1)}, {"sig": 1.0}), ValueError,
     "signature"),
    ("insert-wrong-shape-sig", lambda c: c.client.insert(
        {"obs": np.ones(3, np.float32), "act": np.int64(1)}, {"sig": 1.0}), ValueError,
     "signature"),
    ("insert-unsupported-dtype", lambda c: c.client.insert(
        np.array(["2020-01-01"], dtype="datetime64[D]"), {"prio": 1.0}), ValueError,
     "dtype"),
    ("insert-one-bad-table-of-two", lambda c: c.client.insert(
        np.float32(1), {"prio": 1.0, "nope": 1.0}), errors.UnknownTableError, "nope"),
    # SharedTable.insert
    ("st-insert-nan-batch", lambda c: c.prio.insert({"x": np.zeros((2, 3))}, [1.0, NAN]),
     ValueError, "finite"),
    ("st-insert-priority-count", lambda c: c.prio.insert({"x": np.zeros((2, 3))}, [1.0]),
     ValueError, "shape"),
    ("st-insert-scalar-leaf", lambda c: c.prio.insert({"x": np.float32(1)}, 1.0), ValueError,
     "batch"),
    ("st-insert-ragged-batch", lambda c: c.prio.insert({"x": np.zeros((2, 3)),
                                                        "y": np.zeros(3)}, 1.0), ValueError,
     "batch size"),
    ("st-insert-zero-batch", lambda c: c.prio.insert({"x": np.zeros((0, 3))}, 1.0), ValueError,
     "at least one"),
    ("st-insert-empty-data", lambda c: c.prio.insert({}, 1.0), ValueError, "at least one"),
    ("st-insert-negative-key", lambda c: c.prio.insert({"x": np.zeros((1, 3))}, 1.0, keys=[-1]),
     ValueError, "keys"),
    ("st-insert-key-too-big", lambda c: c.prio.insert({"x": np.zeros((1, 3))}, 1.0,
                                                      keys=[2**64]), ValueError, "2**64"),
    ("st-insert-float-key", lambda c: c.prio.insert({"x": np.zeros((1, 3))}, 1.0, keys=[1.5]),
     ValueError, "keys"),
    ("st-insert-negative-timeout", lambda c: c.prio.insert({"x": np.zeros((1, 3))}, 1.0,
                                                           timeout_ms=-1), ValueError,
     "timeout_ms"),
    ("st-insert-str-timeout", lambda c: c.prio.insert({"x": np.zeros((1, 3))}, 1.0,
                                                      timeout_ms="soon"), ValueError,
     "timeout_ms"),
    ("st-insert-huge-rows", lambda c: c.prio.insert({"x": np.zeros((1, 1 << 21))}, 1.0),
     errors.ResourceExhaustedError, ""),
    ("st-insert-descriptors-bad-offs", lambda c: c.prio.insert_descriptors(
        [1], [1.0], b"\0" * 16, [0, 8]), ValueError, "offs"),
    ("st-insert-descriptors-garbage", lambda c: c.prio.insert_descriptors(
        [1], [1.0], b"\xff" * 16, [0, 16]), ValueError, ""),
    ("st-insert-descriptors-wild-chunk", lambda c: c.prio.insert_descriptors(
        [1], [1.0], chunks.encode_row_descriptors([12345], 1)[0],
        chunks.encode_row_descriptors([12345], 1)[1]), ValueError, ""),
    # sample
    ("sample-zero", lambda c: c.prio.sample(0), ValueError, ">= 1"),
    ("sample-negative", lambda c: c.prio.sample(-3), ValueError, ">= 1"),
    ("sample-float-n", lambda c: c.prio.sample(2.5), ValueError, "int"),
    ("sample-huge-n", lambda c: c.prio.sample(1 << 40), ValueError, ""),
    ("sample-negative-timeout", lambda c: c.prio.sample(1, timeout_ms=-5), ValueError,
     "timeout_ms"),
    ("sample-nan-timeout", lambda c: c.prio.sample(1, timeout_ms=NAN), ValueError,
     "timeout_ms"),
    ("sample-empty-poll", lambda c: c.empty.sample(1, timeout_ms=0),
     errors.DeadlineExceededError, "Rate limiter timeout"),
    ("client-sample-unknown-table", lambda c: next(c.client.sample("nope")),
     errors.UnknownTableError, "available"),
    ("client-sample-zero", lambda c: next(c.client.sample("prio", 0)), ValueError, ""),
    ("client-sample-float-n", lambda c: next(c.client.sample("prio", 2.0)), TypeError, "an int"),
    # mutate
    ("mutate-nan", lambda c: c.prio.mutate(updates={c.keys[0]: NAN}), ValueError, "finite"),
    ("mutate-negative-prio", lambda c: c.prio.mutate(updates={c.keys[0]: -2.0}), ValueError,
     ">= 0"),
    ("mutate-nan-with-valid-delete", lambda c: c.prio.mutate(updates={c.keys[0]: INF},
                                                             deletes=[c.keys[1]]),
     ValueError, "finite"),
    ("mutate-negative-key", lambda c: c.prio.mutate(deletes=[-1]), ValueError, "deletes"),
    ("mutate-str-key", lambda c: c.prio.mutate(deletes=["k"]), ValueError, "deletes"),
    ("mutate-updates-list", lambda c: c.prio.mutate(updates=[(1, 1.0)]), TypeError, "dict"),
    ("client-mutate-unknown-table", lambda c: c.client.mutate_priorities("nope", {1: 1.0}),
     errors.UnknownTableError, "available"),
    ("client-mutate-negative-key", lambda c: c.client.mutate_priorities("prio", {-1: 1.0}),
     TypeError, "[0, 2**64)"),
    ("client-delete-key-2-64", lambda c: c.client.mutate_priorities("prio", deletes=[2**64]),
     TypeError, "[0, 2**64)"),
    ("client-mutate-inf", lambda c: c.client.mutate_priorities("prio", {c.keys[2]: -INF}),
     ValueError, "finite"),
    ("can-sample-negative", lambda c: c.prio.can_sample(-2), ValueError, ">= 0"),
    ("can-insert-negative", lambda c: c.prio.can_insert(-1), ValueError, ">= 0"),
    # trajectory writer
    ("writer-zero-keep-alive", lambda c: c.client.trajectory_writer(0), ValueError, ""),
    ("writer-unknown-table", lambda c: c.writer.create_item("nope", 1.0,
                                                            c.writer.history["x"][-1:]),
     errors.UnknownTableError, "available"),
    ("writer-nan-priority", lambda c: c.writer.create_item("prio", NAN,
                                                           c.writer.history["x"][-1:]),
     ValueError, "nan"),
    ("writer-none-priority", lambda c: c.writer.create_item("prio", None,
                                                            c.writer.history["x"][-1:]),
     TypeError, "must be a number"),
    ("writer-item-not-a-trajectory", lambda c: c.writer.create_item("prio", 1.0, "abc"),
     (ValueError, TypeError), ""),
    ("writer-wrong-dtype", lambda c: c.writer.append({"x": np.float64(1.0)}), ValueError, ""),
    ("writer-negative-flush-timeout", lambda c: c.writer.flush(timeout_ms=-1), ValueError,
     "timeout"),
    # attach
    ("attach-unknown-server", lambda c: reverb_shm.SharedTable.attach("no_such_srv/t"),
     errors.ServerUnavailableError, "no reverb_shm server"),
    ("attach-unknown-table", lambda c: reverb_shm.SharedTable.attach(f"{c.server.name}/nope"),
     errors.UnknownTableError, "available tables"),
    ("attach-malformed", lambda c: reverb_shm.SharedTable.attach("a/b/c"), ValueError,
     "SERVER/TABLE"),
    ("attach-not-str", lambda c: reverb_shm.SharedTable.attach(None), ValueError,
     "SERVER/TABLE"),
]


def _t(name, max_size=10):
  return reverb_shm.Table(name, selectors.Uniform(), selectors.Fifo(), max_size,
                          rate_limiters.MinSize(1))


def test_there_are_at_least_fifty_kinds_of_bad_input():
  assert len(CASES) >= 50
  assert len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize("name,call,exc,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_and_changes_nothing(ctx, name, call, exc, fragment):
  before, files = snapshot(ctx), _our_shm_files()
  with pytest.raises(exc) as info:
    call(ctx)
  assert fragment.lower() in str(info.value).lower(), f"{name}: {info.value}"
  assert snapshot(ctx) == before, f"{name} changed the server's state"
  assert _our_shm_files() == files, f"{name} left objects in {shm.SHM_DIR}"


def _our_shm_files() -> set:
  """Entries of /dev/shm created by this test process (unique_server_name embeds the pid)."""
  return {e for e in os.listdir(shm.SHM_DIR) if f"_{os.getpid()}_" in e}


# ---- corrupted segments

def _segment_file(ctx_name: str, mutate) -> str:
  """Copies a fresh server's segment under a new name, applying `mutate(bytearray)`."""
  # max_bytes bounds the file: a segment's file is as large as the segment may grow (sparse).
  with reverb_shm.Server([_t("a")], name=unique_server_name(), arena_bytes=1 << 20,
                         max_bytes=2 << 20, max_procs=4) as server:
    with open(shm.segment_path(server.name), "rb") as f:
      data = bytearray(f.read())
  mutate(data)
  path = shm.segment_path(ctx_name)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, "wb") as f:
    f.write(data)
  return path


@pytest.mark.parametrize("what,mutate,fragment", [
    ("other-layout-version", lambda d: d.__setitem__(slice(8, 16), (99).to_bytes(8, "little")),
     "layout version"),
    ("bad-magic", lambda d: d.__setitem__(slice(0, 8), b"NOTMAGIC"), "magic"),
    ("truncated", lambda d: d.__delitem__(slice(len(d) // 2, None)), "size"),
    ("header-only", lambda d: d.__delitem__(slice(64, None)), "smaller than"),
])
def test_foreign_or_truncated_segment_is_a_clear_error(what, mutate, fragment):
  name = unique_server_name("corrupt")
  path = _segment_file(name, mutate)
  try:
    with pytest.raises(errors.CorruptError, match=fragment):
      shm.Segment.attach(name)
    assert os.path.exists(path)       # attaching never unlinks
  finally:
    os.unlink(path)


def test_empty_segment_file_is_a_clear_error():
  name = unique_server_name("corrupt")
  path = shm.segment_path(name)
  open(path, "wb").close()
  try:
    with pytest.raises((errors.CorruptError, errors.ServerUnavailableError), match="segment"):
      shm.Segment.attach(name)
  finally:
    os.unlink(path)


def test_c_core_rejects_out_of_range_arguments_without_changing_state(ctx):
  before = snapshot(ctx)
  base = ctx.seg.base
  slot = ctx.seg.slot
  done = ffi.new("uint32_t *")
  got = ffi.new("uint32_t *", 0)
  out = ffi.new("rs_sample_rec[]", 1)
  calls = [
      lambda: lib.rs_sample(base, slot, 99, 1, -1, 0, out, got),          # table out of range
      lambda: lib.rs_sample(base, 4096, 0, 1, -1, 0, out, got),           # slot out of range
      lambda: lib.rs_insert(base, slot, 0, 1, ffi.new("uint64_t[]", [1]),
                            ffi.new("double[]", [math.nan]), ffi.new("uint8_t[]", 16),
                            ffi.new("uint64_t[]", [0, 16]), -1, 0, done),
      lambda: lib.rs_unpin(base, slot, 1, ffi.new("uint32_t[]", [1 << 30])),
      lambda: lib.rs_chunk_publish_rows(base, 12345, 1),
  ]
  for call in calls:
    rc = call()
    assert rc < 0
    with pytest.raises(errors.ReverbError) as info:
      check(rc)
    assert str(info.value)
  assert snapshot(ctx) == before
