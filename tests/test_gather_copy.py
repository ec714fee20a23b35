"""The copy loop of sample_batch's gather (rs_sample_gather): rows of >= 4 KiB copied page by page
with the pages ahead requested, and rounds of >= 256 KiB (or of 128-256 KiB that copy slowly)
shared with the process's gather helper thread. Every batch is checked byte for byte against the data inserted."""
import os
import threading

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal._lib import check, ffi, lib

from conftest import run_in_fork

pytestmark = pytest.mark.timeout(120)


def _payload(ident, nbytes):
  """The bytes of item `ident`'s big column (reproducible from the id alone)."""
  return np.random.default_rng(int(ident)).integers(0, 256, nbytes, dtype=np.uint8)


def _table(max_size=4_000):
  return reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), max_size,
                          rate_limiters.MinSize(1))


def _helper_threads():
  """Threads of this process named like the gather helper."""
  names = []
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/comm") as f:
        names.append(f.read().strip())
    except FileNotFoundError:   # (a thread that just ended)
      pass
  return names.count("rs-gather")


@pytest.fixture
def gather_threads():
  """Sets the gather thread count for a test; restores (and joins the helper) after it."""
  prev = ffi.new("uint32_t *")
  check(lib.rs_set_gather_threads(0, prev))

  def set_threads(n):
    check(lib.rs_set_gather_threads(n, ffi.NULL))
  yield set_threads
  check(lib.rs_set_gather_threads(1, ffi.NULL))
  check(lib.rs_set_gather_threads(prev[0], ffi.NULL))


@pytest.fixture
def share_slow_rounds():
  """Sets the expected copy time from which rounds of 128-256 KiB are shared (0: every one) for
  a test; restores it after."""
  prev = ffi.new("uint32_t *")
  check(lib.rs_set_gather_share_ns(0, prev))

  def set_ns(ns):
    check(lib.rs_set_gather_share_ns(ns, ffi.NULL))
  yield set_ns
  check(lib.rs_set_gather_share_ns(prev[0], ffi.NULL))


def _fill(st, nbytes, items, per_call):
  """Inserts `items` items {id: int64, small: float32[3], big: uint8[nbytes]}, `per_call` per
  insert (items of one call are rows of one chunk: row shifts, unaligned sources)."""
  for start in range(0, items, per_call):
    ids = np.arange(start, min(items, start + per_call), dtype=np.int64)
    st.insert({"id": ids, "small": np.repeat(ids[:, None], 3, axis=1).astype(np.float32),
               "big": np.stack([_payload(i, nbytes) for i in ids])}, 1.0)


def _columns(batch):
  """{name: array} of a batch (sample_batch returns the flattened leaves: sorted keys)."""
  data = batch.data
  return data if isinstance(data, dict) else dict(zip(("big", "id", "small"), data))


def _verify(batch, nbytes):
  data = _columns(batch)
  assert len(data["id"]) > 0
  for row, ident in enumerate(data["id"]):
    np.testing.assert_array_equal(data["big"][row], _payload(ident, nbytes))
    np.testing.assert_array_equal(data["small"][row], np.full(3, ident, np.float32))


@pytest.mark.parametrize("nbytes", [4095, 4096, 4097, 12_289, 28_224 + 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_large_rows_of_odd_sizes_equal_the_inserted_bytes(server_factory, gather_threads, nbytes,
                                                          threads):
  gather_threads(threads)
  st = server_factory([_table()]).shared_table("t")
  _fill(st, nbytes, 300, per_call=7)   # 7 rows per chunk: sources at odd offsets
  out = {"id": np.empty(100, np.int64), "small": np.empty((100, 3), np.float32),
         "big": np.empty((100, nbytes), np.uint8)}
  st.sample_batch(1)   # learns the layout
  for n in (1, 2, 3, 64, 100):   # single items up to rounds far past the sharing threshold
    _verify(st.sample_batch(n, out=out), nbytes)
    _verify(st.sample_batch(n), nbytes)
  assert _helper_threads() == (1 if threads == 2 and 100 * nbytes >= 256 << 10 else 0)


@pytest.mark.parametrize("nbytes", [1_000, 3_000, 4_095])
@pytest.mark.parametrize("threads", [1, 2])
def test_rounds_shared_for_copying_slowly_equal_the_inserted_bytes(server_factory, gather_threads,
                                                                   share_slow_rounds, nbytes,
                                                                   threads):
  """Rounds of 128-256 KiB of rows under 4 KiB, shared as rounds that copy slowly are (each
  thread requests the rows of the items it copies), also when the helper is off."""
  gather_threads(threads)
  share_slow_rounds(0)
  st = server_factory([_table()]).shared_table("t")
  _fill(st, nbytes, 600, per_call=7)
  n = (192 << 10) // (nbytes + 20)
  out = {"id": np.empty(n, np.int64), "small": np.empty((n, 3), np.float32),
         "big": np.empty((n, nbytes), np.uint8)}
  st.sample_batch(1)
  for _ in range(5):
    _verify(st.sample_batch(n, out=out), nbytes)
    _verify(st.sample_batch(n), nbytes)
  assert _helper_threads() == (1 if threads == 2 else 0)
  share_slow_rounds(2**32 - 1)   # never: the same rounds copied by the calling thread alone
  _verify(st.sample_batch(n, out=out), nbytes)


def test_unaligned_destination(server_factory, gather_threads):
  gather_threads(2)
  nbytes = 28_224
  st = server_factory([_table()]).shared_table("t")
  _fill(st, nbytes, 200, per_call=3)
  buf = np.empty(64 * nbytes + 1, np.uint8)
  big = np.frombuffer(buf.data, np.uint8, 64 * nbytes, offset=1).reshape(64, nbytes)
  assert big.ctypes.data % 2 == 1
  out = {"id": np.empty(64, np.int64), "small": np.empty((64, 3), np.float32), "big": big}
  st.sample_batch(1)
  for _ in range(5):
    _verify(st.sample_batch(64, out=out), nbytes)


@pytest.mark.parametrize("nbytes", [6_001, 1_500])
def test_items_of_several_chunks_per_column(server_factory, gather_threads, share_slow_rounds,
                                            nbytes):
  """Items of 2 steps whose steps lie in different chunks: columns of 2 slices (the copy that
  reads the descriptor), in rounds the helper shares (of small rows: as rounds that copy
  slowly)."""
  gather_threads(2)
  share_slow_rounds(0)
  server = server_factory([_table()])
  client = server.localhost_client()
  with client.trajectory_writer(num_keep_alive_refs=2) as writer:
    for i in range(150):
      writer.append({"id": np.int64(i), "big": _payload(i, nbytes)})
      if i >= 1:
        writer.create_item("t", 1.0, {"id": writer.history["id"][-2:],
                                      "big": writer.history["big"][-2:]})
      writer.flush()   # one chunk per step
  st = server.shared_table("t")
  st.sample_batch(1)
  for _ in range(5):
    big, ids = st.sample_batch(64).data   # (sorted keys: big, id)
    assert big.shape == (64, 2, nbytes)
    for row in range(64):
      first, second = ids[row]
      assert second == first + 1
      np.testing.assert_array_equal(big[row, 0], _payload(first, nbytes))
      np.testing.assert_array_equal(big[row, 1], _payload(second, nbytes))


def test_helper_is_joined_when_turned_off_and_restarted_on_demand(server_factory, gather_threads):
  gather_threads(2)
  st = server_factory([_table()]).shared_table("t")
  _fill(st, 28_224, 100, per_call=1)
  st.sample_batch(1)
  before = _helper_threads()
  _verify(st.sample_batch(64), 28_224)
  assert lib.rs_gather_helper_running() == 1 and _helper_threads() == 1
  gather_threads(1)   # joins it: the thread is gone when the call returns
  assert lib.rs_gather_helper_running() == 0 and _helper_threads() == 0
  _verify(st.sample_batch(64), 28_224)   # one thread now
  assert _helper_threads() == 0
  gather_threads(2)
  _verify(st.sample_batch(64), 28_224)
  assert _helper_threads() == 1 and before in (0, 1)


def test_small_rounds_never_start_the_helper(server_factory, gather_threads):
  gather_threads(1)
  gather_threads(2)
  st = server_factory([_table()]).shared_table("t")
  _fill(st, 1_000, 300, per_call=50)
  st.sample_batch(1)
  _verify(st.sample_batch(120), 1_000)   # 120 x ~1 KiB < 128 KiB: never shared
  assert lib.rs_gather_helper_running() == 0


def test_threads_gathering_at_once_share_one_helper(server_factory, gather_threads):
  gather_threads(2)
  nbytes = 16_384
  server = server_factory([_table()])
  _fill(server.shared_table("t"), nbytes, 400, per_call=5)
  failures = []

  def sampler():
    try:
      st = server.shared_table("t")
      st.sample_batch(1)
      for _ in range(20):
        _verify(st.sample_batch(48), nbytes)
    except Exception as e:  # pylint: disable=broad-except
      failures.append(e)
  workers = [threading.Thread(target=sampler) for _ in range(4)]
  for w in workers:
    w.start()
  for w in workers:
    w.join(timeout=60)
  assert not any(w.is_alive() for w in workers)
  assert not failures, failures
  assert _helper_threads() == 1


def test_forked_child_starts_its_own_helper(server_factory, gather_threads):
  gather_threads(2)
  nbytes = 28_224
  server = server_factory([_table()])
  st = server.shared_table("t")
  _fill(st, nbytes, 100, per_call=1)
  st.sample_batch(1)
  _verify(st.sample_batch(64), nbytes)
  assert lib.rs_gather_helper_running() == 1

  def child():
    inherited = lib.rs_gather_helper_running()
    for _ in range(5):
      _verify(st.sample_batch(64), nbytes)
    return f"{inherited} {lib.rs_gather_helper_running()} {_helper_threads()}"

  out = run_in_fork(child)
  assert out == "OK 0 1 1", out   # none inherited; its own started; exactly one
  _verify(st.sample_batch(64), nbytes)   # the parent's helper still works
  assert _helper_threads() == 1


def test_bad_thread_count_is_rejected_and_changes_nothing(gather_threads):
  gather_threads(1)
  with pytest.raises(errors.InvalidArgumentError, match="expected 0 .query., 1 or 2 threads, got 3"):
    check(lib.rs_set_gather_threads(3, ffi.NULL))
  prev = ffi.new("uint32_t *")
  check(lib.rs_set_gather_threads(0, prev))
  assert prev[0] == 1
