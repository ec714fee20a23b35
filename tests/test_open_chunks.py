"""Open chunks: C insert plans append small inserts to chunks they hold open
(csrc/hot/hot_insert.c "open chunks", rs_open_chunks / rs_insert_rows_at), so per-step items cost
about their payload in arena, share one descriptor block, and keep every guarantee of one-shot
chunks: visible when insert returns, correct data across chunk boundaries, threads, forks,
kill -9, checkpoints, eviction and the server stopping."""
import gc
import os
import signal
import time

import numpy as np
import pytest

import reverb_shm
from reverb_shm import checkpointers, errors, rate_limiters, selectors
from reverb_shm._internal import chunks, hot_plans
from reverb_shm._internal._lib import check, ffi, lib

from conftest import run_in_fork, run_threads

pytestmark = pytest.mark.timeout(180)

W1_PAYLOAD = 8 * 4 + 8 + 4   # obs float32[8], action int64, reward float32


def step(i, tag=0):
  """A W1 step whose every value encodes (tag, i)."""
  return {"obs": np.arange(8, dtype=np.float32) + i, "action": np.int64(i + 1_000_000 * tag),
          "reward": np.float32(tag)}


def _table(name="t", max_size=100_000, remover=None):
  return reverb_shm.Table(name, selectors.Uniform(), remover or selectors.Fifo(), max_size,
                          rate_limiters.MinSize(1))


def _pins(seg):
  return chunks.Pins(seg, seg.registration()[1], np.zeros(0, np.uint32))


def stored(seg, table):
  """(action, tag, obs row ok, reward) of every item of `table`, in insertion order."""
  items = table.items()
  out = []
  for action, obs, reward in chunks.read_items(seg, items["desc_off"], _pins(seg)):
    a = int(action[0])
    i = a % 1_000_000
    ok = obs.tolist() == [(np.arange(8, dtype=np.float32) + i).tolist()]
    out.append((a, int(reward[0]), ok))
  return out


def assert_items_are(seg, table, expected):
  """The table holds exactly the steps `expected` ((i, tag) pairs) in order, intact."""
  got = stored(seg, table)
  assert all(ok for _, _, ok in got)
  assert [(a % 1_000_000, tag) for a, tag, _ in got] == list(expected)
  assert [a // 1_000_000 for a, _, _ in got] == [tag for _, tag in expected]


def _reap(seg):
  n = ffi.new("uint32_t *")
  check(lib.rs_reap(seg.base, n), "reaping")
  return n[0]


def test_arena_per_item_is_about_the_payload(server_factory):
  n = 50_000
  server = server_factory([_table(max_size=n + 10)])
  client = server.localhost_client()
  seg = server.segment
  client.insert(step(0), {"t": 1.0})   # the Python path makes the plan
  before = seg.info()
  for i in range(n):
    client.insert(step(i), {"t": 1.0})
  after = seg.info()
  per_item = (after["arena_used"] - before["arena_used"]) / n
  assert per_item - W1_PAYLOAD <= 16, per_item   # was ~1150 B with one-shot chunks (bound: 128)
  # 256-row chunks (3 columns) and one descriptor block per chunk set, plus the first sets
  assert after["num_descs"] - before["num_descs"] <= n // 256 + 6
  assert after["num_chunks"] - before["num_chunks"] <= 3 * (n // 256 + 6)
  # every item is its own episode, as with Reverb's Client.insert
  assert client.server_info()["t"].num_episodes == n + 1
  seg.check()


def test_writers_inserting_in_turn_each_keep_sharing_their_block(server_factory):
  """Several clients (actors) inserting into one table in turn: each item still shares its
  writer's block (the table remembers recent blocks as templates, not only the last one)."""
  k, n = 4, 8000
  server = server_factory([_table(max_size=n + 10)])
  clients = [server.localhost_client() for _ in range(k)]
  for tag, c in enumerate(clients):
    c.insert(step(0, tag), {"t": 1.0})
  seg = server.segment
  before = seg.info()
  for i in range(n):
    clients[i % k].insert(step(i // k + 1, i % k), {"t": 1.0})
  after = seg.info()
  assert (after["arena_used"] - before["arena_used"]) / n - W1_PAYLOAD <= 16
  assert after["num_descs"] - before["num_descs"] <= k * (n // k // 256 + 6)
  expected = [(0, tag) for tag in range(k)] + [(i // k + 1, i % k) for i in range(n)]
  assert_items_are(seg, server.shared_table("t"), expected)
  seg.check()


def test_data_is_correct_across_chunk_boundaries_and_sampled(server_factory):
  n = 1000   # crosses the 16, 32, 64, 128 and 256-row sets several times
  server = server_factory([_table()])
  client = server.localhost_client()
  for i in range(n):
    client.insert(step(i), {"t": float(i)})
    if i in (0, 1, 15, 16, 17, 300):   # visible and correct when insert returns
      assert_items_are(server.segment, server.shared_table("t"), [(j, 0) for j in range(i + 1)])
  st = server.shared_table("t")
  assert_items_are(server.segment, st, [(i, 0) for i in range(n)])
  items = st.items()
  assert items["priority"].tolist() == [float(i) for i in range(n)]
  for sample in client.sample("t", 200, emit_timesteps=False):
    action, obs, reward = sample.data   # (Client.insert columns have a time dim of 1)
    assert obs.tolist() == [(np.arange(8, dtype=np.float32) + int(action[0])).tolist()]
    assert reward.tolist() == [0] and sample.info.priority == float(action[0])
  server.segment.check()


def test_bad_priority_writes_nothing_and_the_next_item_is_correct(server_factory):
  table = reverb_shm.Table("p", selectors.Prioritized(1.0), selectors.Fifo(), 100,
                           rate_limiters.MinSize(1))
  server = server_factory([table])
  client = server.localhost_client()
  for i in range(3):
    client.insert(step(i), {"p": 1.0})
  used = server.segment.info()["arena_used"]
  with pytest.raises(ValueError):
    client.insert(step(9), {"p": -1.0})
  assert server.segment.info()["arena_used"] == used
  client.insert(step(3), {"p": 1.0})
  assert_items_are(server.segment, server.shared_table("p"), [(i, 0) for i in range(4)])


def test_threads_share_a_client_and_its_open_chunks(server_factory):
  threads_n, per_thread = 4, 2000
  server = server_factory([_table()])
  client = server.localhost_client()
  client.insert(step(0, 9), {"t": 1.0})

  def work(tag):
    for i in range(per_thread):
      client.insert(step(i, tag), {"t": 1.0})
  run_threads(work, threads_n)
  got = stored(server.segment, server.shared_table("t"))
  assert all(ok for _, _, ok in got)
  assert sorted((a, tag) for a, tag, _ in got[1:]) == sorted(
      (i + 1_000_000 * t, t) for t in range(threads_n) for i in range(per_thread))
  for t in range(threads_n):   # each thread's items are in its order
    assert [a for a, tag, _ in got if tag == t] == [i + 1_000_000 * t for i in range(per_thread)]
  assert server.segment.info()["num_chunks"] <= 3 * (threads_n * per_thread // 16)
  server.segment.check()


def test_forked_child_never_appends_to_the_parents_open_chunks(server_factory):
  server = server_factory([_table()])
  client = server.localhost_client()
  for i in range(5):   # the plan's first open set (16 rows) is partly filled
    client.insert(step(i), {"t": 1.0})
  plan = client._hot_plans["t"]  # pylint: disable=protected-access

  def child():
    declined = plan.insert(step(99, 1), 1.0, None)
    for i in range(40):
      client.insert(step(i, 1), {"t": 2.0})
    return declined
  assert run_in_fork(child) == "OK None"
  for i in range(5, 30):   # the parent goes on filling its set, then new ones
    client.insert(step(i), {"t": 1.0})
  st = server.shared_table("t")
  expected = [(i, 0) for i in range(5)] + [(i, 1) for i in range(40)] + [
      (i, 0) for i in range(5, 30)]
  assert_items_are(server.segment, st, expected)   # (shared rows would have been overwritten)
  server.segment.check()


def _insert_forever(address, tag):
  client = reverb_shm.Client(address)
  i = 0
  while True:
    client.insert(step(i % 100_000, tag), {"t": 1.0})
    i += 1


def test_kill_9_of_an_inserting_process_leaves_invariants_and_arena_reclaimed(server_factory):
  server = server_factory([_table(max_size=1_000_000)])
  seg = server.segment
  address = f"shm://{server.name}"
  for round_ in range(6):
    pid = os.fork()
    if pid == 0:
      try:
        _insert_forever(address, 1)
      finally:
        os._exit(1)  # pylint: disable=protected-access
    st = server.shared_table("t")
    deadline = time.monotonic() + 10
    while st.size < 300 * (round_ + 1) and time.monotonic() < deadline:
      time.sleep(0.001)
    time.sleep(0.003 * round_)   # kill at different points of a set
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    _reap(seg)   # (unless the server's own reaper was first)
    assert seg.info()["live_procs"] <= 1   # (this process, if registered)
    seg.check()
    got = stored(seg, st)
    assert all(ok for _, _, ok in got) and len(got) == st.size > 0
  # only items hold chunks now: reset frees everything the dead processes left
  st.reset()
  gc.collect()
  info = seg.info()
  assert (info["num_chunks"], info["num_descs"], info["arena_used"]) == (0, 0, 0)
  seg.check()


def test_checkpoint_round_trip_of_partly_filled_chunks(server_factory, tmp_path):
  def make():
    return server_factory([_table()], checkpointer=checkpointers.DefaultCheckpointer(tmp_path))
  server = make()
  client = server.localhost_client()
  for i in range(100):   # sets of 16, 32, 64 rows: the last is partly filled
    client.insert(step(i), {"t": float(i)})
  before = server.shared_table("t").items()
  info = client.server_info()["t"]
  client.checkpoint()
  for i in range(100, 110):   # appending goes on after the checkpoint
    client.insert(step(i), {"t": float(i)})
  assert_items_are(server.segment, server.shared_table("t"), [(i, 0) for i in range(110)])
  server.stop()
  restored = make()
  st = restored.shared_table("t")
  after = st.items()
  for field in ("key", "priority", "times_sampled", "insert_seq"):
    assert after[field].tolist() == before[field].tolist()
  assert_items_are(restored.segment, st, [(i, 0) for i in range(100)])
  got = restored.localhost_client().server_info()["t"]
  assert (got.num_episodes, got.current_size) == (info.num_episodes, info.current_size) == (
      100, 100)
  restored.segment.check()


def test_fifo_eviction_frees_a_chunk_after_its_items_and_the_open_pin(server_factory):
  server = server_factory([_table(max_size=40)])
  client = server.localhost_client()
  seg = server.segment
  st = server.shared_table("t")
  for i in range(3000):
    client.insert(step(i), {"t": 1.0})
    if i % 97 == 0:
      seg.check()
      assert_items_are(seg, st, [(j, 0) for j in range(max(0, i - 39), i + 1)])
  info = seg.info()
  # chunks of the 40 live items (at most two sets) and the plan's open set; blocks likewise
  assert info["num_chunks"] <= 3 * 3 and info["num_descs"] <= 3
  client.insert(step(3000), {"t": 1.0})
  st.reset()
  assert seg.info()["num_chunks"] == 3   # the open set, held by the plan only
  del client
  gc.collect()   # the plan is gone: its open chunks are released
  info = seg.info()
  assert (info["num_chunks"], info["num_descs"], info["arena_used"]) == (0, 0, 0)
  seg.check()


def test_released_plan_shrinks_its_partly_filled_chunks(server_factory):
  server = server_factory([_table()])
  client = server.localhost_client()
  seg = server.segment
  for i in range(20):   # (Python path, then) sets of 16 and 32 rows: the second has 3 rows
    client.insert(step(i), {"t": 1.0})
  used = seg.info()["arena_used"]
  del client
  gc.collect()
  assert seg.info()["arena_used"] <= used - 20 * W1_PAYLOAD   # the 29 unused rows returned
  assert_items_are(seg, server.shared_table("t"), [(i, 0) for i in range(20)])
  seg.check()


def test_timed_out_insert_leaves_only_an_unreferenced_row(server_factory):
  server = server_factory([reverb_shm.Table.queue("q", 3)])
  client = server.localhost_client()
  for i in range(3):
    client.insert(step(i), {"q": 1.0})
  with pytest.raises(errors.DeadlineExceededError):
    client.insert(step(50), {"q": 1.0}, timeout_ms=20)
  st = server.shared_table("q")
  assert_items_are(server.segment, st, [(0, 0), (1, 0), (2, 0)])
  st.sample(3, timeout_ms=1000)
  for i in range(3, 6):
    client.insert(step(i), {"q": 1.0})
  assert_items_are(server.segment, st, [(3, 0), (4, 0), (5, 0)])
  server.segment.check()


class _Interrupted(Exception):
  pass


def _raise_interrupted(signum, frame):
  raise _Interrupted()


def test_signal_between_wait_slices_interrupts_and_inserts_nothing(server_factory):
  """A plan waiting past rate-limiter slices runs signal handlers between them (as the Python
  path's loop does): the handler's exception propagates, the row written stays unreferenced."""
  server = server_factory([reverb_shm.Table.queue("q", 2)])
  client = server.localhost_client()
  for i in range(2):
    client.insert(step(i), {"q": 1.0})
  previous = signal.signal(signal.SIGALRM, _raise_interrupted)
  try:
    signal.setitimer(signal.ITIMER_REAL, 0.25)
    t0 = time.monotonic()
    with pytest.raises(_Interrupted):
      client.insert(step(7), {"q": 1.0})   # waits forever (in 100 ms slices)
    assert 0.2 < time.monotonic() - t0 < 5
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)
  st = server.shared_table("q")
  assert_items_are(server.segment, st, [(0, 0), (1, 0)])
  st.sample(2, timeout_ms=1000)
  client.insert(step(2), {"q": 1.0})
  assert_items_are(server.segment, st, [(2, 0)])
  server.segment.check()


def test_server_stop_with_open_chunks(server_factory):
  server = server_factory([_table()])
  client = server.localhost_client()
  for i in range(10):
    client.insert(step(i), {"t": 1.0})
  server.stop()   # unregisters: the open chunks' pins are gone with the slot
  with pytest.raises(errors.ReverbError):
    client.insert(step(10), {"t": 1.0})
  del client
  gc.collect()   # the plan's release finds its registration over: nothing touched


def test_shared_table_single_row_batches_use_open_chunks(server_factory):
  server = server_factory([_table()])
  st = server.shared_table("t")
  seg = server.segment
  st.insert({"x": np.zeros((1, 16), np.float32)}, 1.0)
  used = seg.info()["arena_used"]
  for i in range(1000):
    st.insert({"x": np.full((1, 16), i, np.float32)}, 1.0)
  assert (seg.info()["arena_used"] - used) / 1000 - 64 <= 16
  items = st.items()
  got = chunks.read_items(seg, items["desc_off"][1:], _pins(seg))
  assert [float(cols[0][0]) for cols in got] == [float(i) for i in range(1000)]
  seg.check()


def test_large_rows_keep_chunks_of_their_own(server_factory):
  columns = ((np.dtype(np.uint8), (hot_plans._OPEN_ROW_BYTES + 1,)),)  # pylint: disable=protected-access
  assert hot_plans._open_rows(columns) == 0  # pylint: disable=protected-access
  frame = ((np.dtype(np.uint8), (84, 84, 4)),)
  assert hot_plans._open_rows(frame) == 16  # pylint: disable=protected-access
  assert hot_plans._open_rows(((np.dtype(np.float32), (1024,)),)) == 16  # pylint: disable=protected-access
  assert hot_plans._open_rows(((np.dtype(np.float32), (8,)),)) == 256  # pylint: disable=protected-access
