"""TrajectoryWriter's per-step C fast paths (reverb_shm._hot, csrc/hot/hot_writer.c) against the
Python general path they bypass: `append` of a step like the last, `history[c][-k:]` /
`history[c][i]` and `create_item` of a window item of the last kind give the same items, data,
orders and errors, also in every case where they must decline and hand the call to Python."""
import collections
import re
import time

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors, trajectory_writer
from reverb_shm._internal import chunks, shm
from reverb_shm._internal.history import AUTO_MAX_ROWS as _AUTO_ROWS
from reverb_shm._internal.history import _ColumnHistory
from reverb_shm.trajectory_writer import TrajectoryColumn, TrajectoryWriter

from conftest import run_in_fork

pytestmark = pytest.mark.timeout(120)


class GeneralWriter(TrajectoryWriter):
  """The reference: every C fast path bypassed (history indexing through `_getitem`, see H)."""

  # (as the C methods do: the background delivery thread leaves the writer alone meanwhile)
  append = trajectory_writer._exclusive(TrajectoryWriter._append)
  create_item = trajectory_writer._exclusive(TrajectoryWriter._create_item)

  def _make_fast(self, columns, treedef, keys):
    return None


class CountingWriter(TrajectoryWriter):
  """The C fast paths, counting the calls they hand to the Python general path."""

  def __init__(self, *args, **kwargs):
    self.general = collections.Counter()
    super().__init__(*args, **kwargs)

  def _append(self, data, **kwargs):
    self.general["append"] += 1
    return super()._append(data, **kwargs)

  def _create_item(self, table, priority, trajectory):
    self.general["create_item"] += 1
    return super()._create_item(table, priority, trajectory)


@pytest.fixture
def getitem_calls(monkeypatch):
  """Counts _ColumnHistory._getitem calls (history indexing the C path declined) per writer
  class."""
  calls = collections.Counter()
  general = _ColumnHistory._getitem

  def counted(self, index):
    calls[type(self._column.writer).__name__] += 1
    return general(self, index)
  monkeypatch.setattr(_ColumnHistory, "_getitem", counted)
  return calls


def _tables():
  return [reverb_shm.Table("a", selectors.Uniform(), selectors.Fifo(), 100_000,
                           rate_limiters.MinSize(1)),
          reverb_shm.Table("b", selectors.Fifo(), selectors.Fifo(), 100_000,
                           rate_limiters.MinSize(1)),
          reverb_shm.Table("p", selectors.Prioritized(1.0), selectors.Fifo(), 100_000,
                           rate_limiters.MinSize(1)),
          reverb_shm.Table.queue("q", 3)]


@pytest.fixture
def pair(server_factory):
  """(fast writer, reference writer), each on its own server with the same tables."""
  servers = [server_factory(_tables()) for _ in range(2)]
  writers = []

  def make(keep_alive=2, **kwargs):
    fast = CountingWriter(servers[0].localhost_client(), keep_alive, **kwargs)
    general = GeneralWriter(servers[1].localhost_client(), keep_alive, **kwargs)
    writers.extend([fast, general])
    return fast, general
  make.servers = servers
  yield make
  for w in writers:
    w.close()


def H(writer):
  """history[path][index] as the writer's own path takes it (C first for the fast writer)."""
  general = isinstance(writer, GeneralWriter)

  def get(path, index):
    h = writer.history[path]
    return h._getitem(index) if general else h[index]
  return get


def _step(t, **extra):
  step = {"obs": np.arange(3, dtype=np.float32) + t, "action": np.int64(t),
          "reward": np.float32(t / 2)}
  step.update(extra)
  return step


def _last(writer, k=2, keys=("action", "obs", "reward")):
  get = H(writer)
  return {key: get(key, slice(-k, None)) for key in keys}


def _summary(value):
  """A comparable form of an op's result."""
  if isinstance(value, TrajectoryColumn):
    try:
      data = value.numpy()
    except RuntimeError as e:
      data = f"RuntimeError: {e}"
    return ("column", value.is_squeezed, len(value), value.shape, str(value.dtype), value.path,
            _summary(data))
  if isinstance(value, np.ndarray):
    return ("array", value.dtype.str, value.shape, value.tolist())
  if isinstance(value, dict):
    return {k: _summary(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return type(value)(_summary(v) for v in value)
  return value


def _outcome(fn):
  try:
    return ("ok", _summary(fn()))
  except Exception as e:  # pylint: disable=broad-except
    # Server names differ between the two servers, method owners between the two classes.
    message = re.sub(r"test_\d+_\d+", "<server>", str(e))
    return (type(e).__name__, re.sub(r"\w+Writer\.", "Writer.", message))


def _same(fast, general, op):
  """Runs op(writer) on both writers; asserts the same result or the same exception."""
  got, want = _outcome(lambda: op(fast)), _outcome(lambda: op(general))
  assert got == want
  return got


def _stored_items(server, table):
  """(priority, [(squeeze, dtype, shape, values) per column]) of every item of `table`, in
  insertion order, read from the descriptors (no sampling)."""
  st = server.shared_table(table)
  seg = st.segment
  out = []
  for rec in st.items():
    desc = int(rec["desc_off"])
    cols = chunks.item_columns(seg, desc)
    values = [chunks.gather_column(seg, np.array([desc], np.uint64), c)[0]
              for c in range(len(cols))]
    out.append((float(rec["priority"]),
                [(squeeze, v.dtype.str, v.shape, v.tolist()) for (_, squeeze), v in
                 zip(cols, values)]))
  return out


def _assert_same_tables(pair, tables=("a", "b", "p")):
  fast_server, general_server = pair.servers
  for table in tables:
    assert _stored_items(fast_server, table) == _stored_items(general_server, table), table


# ---- the common loop


@pytest.mark.parametrize("chunk", [None, 3])
def test_per_step_loop_equals_the_general_path_and_stays_in_c(pair, getitem_calls, chunk):
  """append + create_item(last 2) over episodes and chunk boundaries, items to two tables:
  same items in the same order; the C paths hand over only at chunk / keep-alive boundaries,
  new item kinds and episode starts."""
  fast, general = pair(keep_alive=3)
  if chunk:
    for w in (fast, general):
      for key in ("obs", "action", "reward"):
        w.configure((key,), num_keep_alive_refs=3, max_chunk_length=chunk)
  steps = switches = 0
  for episode, length in enumerate((300, 41, 600)):
    for t in range(length):
      for w in (fast, general):
        w.append(_step(t + 1000 * episode))
      steps += 1
      if t >= 1:
        table = "b" if t % 50 == 0 else "a"
        switches += 2 if table == "b" or t % 10 == 1 else 0    # to another kind and back
        for w in (fast, general):
          w.create_item(table, float(t % 7), _last(w))
      if t >= 2 and t % 10 == 0:     # a squeezed last step and a 3-step window
        for w in (fast, general):
          get = H(w)
          w.create_item("p", 0.5, {"o": get("obs", slice(-3, None)), "a": get("action", -1)})
    assert fast.episode_steps == general.episode_steps == length
    for w in (fast, general):
      w.end_episode()
  _assert_same_tables(pair)
  assert pair.servers[0].shared_table("a").size > 800
  # Handed over: chunk boundaries and keep-alive releases (every auto chunk, or every 3 with
  # chunks of 3), switches of the item kind (the C path matches the last one), episode
  # starts; everything else stayed in C.
  boundaries = steps // (chunk or _AUTO_ROWS) * 2 + 20
  assert 0 < fast.general["append"] <= boundaries
  assert 0 < fast.general["create_item"] <= switches + 10 < steps // 3
  assert getitem_calls["CountingWriter"] <= 3 * boundaries


def test_items_and_history_reads_match_after_every_step(pair):
  fast, general = pair(keep_alive=4)
  for t in range(40):
    for w in (fast, general):
      w.append(_step(t))
    for k in (1, 2, 4):
      if t + 1 >= k:
        _same(fast, general, lambda w, k=k: H(w)("obs", slice(-k, None)))
    for i in (-1, -4, 0, t, t + 1, -(t + 2)):
      _same(fast, general, lambda w, i=i: H(w)("reward", i))
    assert fast._hist_step == general._hist_step == t + 1
    assert [c.n for c in fast._columns] == [c.n for c in general._columns]


# ---- append: where the fast append must decline


def test_append_declines_and_matches_on_changed_steps(pair):
  fast, general = pair(keep_alive=3)
  for t in range(5):
    for w in (fast, general):
      w.append(_step(t))
  assert fast._fast is not None
  bad = [
      _step(5, obs=np.zeros(3, np.float64)),                 # dtype change
      _step(5, obs=np.zeros(4, np.float32)),                 # shape change
      _step(5, action=np.int32(5)),                          # scalar of another type
      _step(5, obs=np.zeros((3, 1), np.float32)),            # rank change
      _step(5, obs=np.zeros(3, ">f4")),                      # byte order change
      {"obs": np.zeros(3, np.float32), "action": np.int64(0)},    # a field left out
      [np.zeros(3, np.float32)],                 # another structure (a new column)
  ]
  for step in bad:
    _same(fast, general, lambda w, step=step: w.append(step))
  ok = [
      _step(5, action=5),                                    # a Python int: the slow path
      _step(6, obs=np.arange(6, dtype=np.float32)[::2]),     # not contiguous: the slow path
      _step(7, action=np.array(7)),                          # 0-d array
      _step(8, extra=np.float32(1)),                         # a new field
      _step(9),                                              # the new field skipped
      _step(10, extra=np.float32(3)),
  ]
  for step in ok:
    _same(fast, general, lambda w, step=step: w.append(step))
    _same(fast, general, lambda w: {k: H(w)(k, slice(None)) for k in ("obs", "action")})
  _same(fast, general, lambda w: H(w)("extra", slice(-3, None)))    # a skipped step: None
  _same(fast, general, lambda w: H(w)("extra", -1))
  assert fast.episode_steps == general.episode_steps == 12


def test_partial_steps_take_the_general_path(pair):
  fast, general = pair()
  for t in range(3):
    for w in (fast, general):
      w.append(_step(t))
  before = fast.general["append"]
  for w in (fast, general):
    w.append({"obs": np.ones(3, np.float32)}, partial_step=True)
  _same(fast, general, lambda w: w.append(_step(3)))      # obs already set in the open step
  for w in (fast, general):
    w.append({"action": np.int64(3), "reward": np.float32(3)})
  assert fast.general["append"] == before + 3
  _same(fast, general, lambda w: _last(w))
  _same(fast, general, lambda w: w.create_item("a", 1.0, _last(w)))
  for w in (fast, general):
    w.flush()
  _assert_same_tables(pair)


def test_non_native_and_object_columns(pair):
  fast, general = pair()
  for t in range(6):
    for w in (fast, general):
      w.append({"big": np.full(2, t, ">i4"), "s": np.int64(t), "txt": f"step{t}"})
      if t:
        w.create_item("a", 1.0, {"big": H(w)("big", slice(-2, None)),
                                 "s": H(w)("s", slice(-2, None))})
  _same(fast, general, lambda w: H(w)("txt", slice(-2, None)))
  for w in (fast, general):
    w.flush()
  _assert_same_tables(pair, ("a",))


# ---- history indexing: where the C path must decline


def test_history_indexing_errors_match(pair):
  fast, general = pair(keep_alive=2)
  for t in range(5):
    for w in (fast, general):
      w.append(_step(t))
  for index in (slice(-3, None), slice(-6, None), slice(-2, None, 1), slice(-2, -1), 5, -6, -3,
                True, np.int64(-1), 1.0, "x", [3, 4], [4, 4, 3], slice(3, 5), slice(-(2 ** 70), None),
                2 ** 70, slice(None, None, -1)):
    _same(fast, general, lambda w, index=index: H(w)("obs", index))


def test_keep_alive_shrunk_by_configure(pair):
  fast, general = pair(keep_alive=4)
  for t in range(6):
    for w in (fast, general):
      w.append(_step(t))
  held = {w: _last(w, 3) for w in (fast, general)}
  for w in (fast, general):
    w.configure(("obs",), num_keep_alive_refs=1, max_chunk_length=None)
  _same(fast, general, lambda w: H(w)("obs", slice(-2, None)))     # expired now
  _same(fast, general, lambda w: H(w)("obs", -1))
  _same(fast, general, lambda w: w.create_item("a", 1.0, held[w]))   # expired refs
  _same(fast, general, lambda w: w.create_item("a", 1.0, _last(w, 2, ("action", "reward"))))
  for w in (fast, general):
    w.append(_step(6))
  _same(fast, general, lambda w: w.create_item("a", 2.0, {"o": H(w)("obs", slice(-1, None))}))
  for w in (fast, general):
    w.flush()
  _assert_same_tables(pair, ("a",))


def test_end_episode_expires_windows(pair):
  fast, general = pair(keep_alive=3)
  for t in range(4):
    for w in (fast, general):
      w.append(_step(t))
  held = {w: _last(w) for w in (fast, general)}
  for w in (fast, general):
    w.create_item("a", 1.0, held[w])       # the kind the C path then matches
  for clear in (False, True):
    for w in (fast, general):
      w.end_episode(clear_buffers=clear)
    _same(fast, general, lambda w: w.create_item("a", 1.0, held[w]))
    _same(fast, general, lambda w: H(w)("obs", slice(-1, None)))
    _same(fast, general, lambda w: len(w.history["obs"]))
  for w in (fast, general):
    w.append(_step(10))
    w.append(_step(11))
  _same(fast, general, lambda w: w.create_item("a", 1.0, _last(w)))
  for w in (fast, general):
    w.flush()
  _assert_same_tables(pair, ("a",))


# ---- create_item: where the C path must decline


def test_create_item_declines_and_matches(pair):
  fast, general = pair(keep_alive=3)
  for t in range(4):
    for w in (fast, general):
      w.append(_step(t))
  for w in (fast, general):
    w.create_item("p", 1.0, _last(w))      # the last kind: prioritized table "p"
  HUGE = np.finfo(np.float64).max / 4
  calls = [
      lambda w: w.create_item("p", float("nan"), _last(w)),
      lambda w: w.create_item("p", float("inf"), _last(w)),
      lambda w: w.create_item("p", -1.0, _last(w)),                 # negative on Prioritized
      lambda w: w.create_item("a", -1.0, _last(w)),                 # fine on Uniform
      lambda w: w.create_item("p", HUGE, _last(w)),                 # above the sum-tree cap
      lambda w: w.create_item("p", 2, _last(w)),                    # an int
      lambda w: w.create_item("p", np.float64(3.0), _last(w)),      # a numpy float
      lambda w: w.create_item("p", "1.0", _last(w)),
      lambda w: w.create_item("nope", 1.0, _last(w)),               # unknown table
      lambda w: w.create_item(b"p", 1.0, _last(w)),
      lambda w: w.create_item("b", 4.0, _last(w)),                  # another table
      lambda w: w.create_item("p", 5.0, _last(w, 3)),               # another window length
      lambda w: w.create_item("p", 6.0, {**_last(w), "action": H(w)("action", -1)}),
      lambda w: w.create_item("p", 7.0, {"obs": H(w)("obs", slice(-2, None))}),   # fewer keys
      lambda w: w.create_item("p", 8.0, {"action": H(w)("action", slice(-2, None)),
                                         "obs": H(w)("obs", slice(-2, None)),
                                         "rew": H(w)("reward", slice(-2, None))}),  # other keys
      lambda w: w.create_item("p", 9.0, [H(w)("obs", slice(-2, None))]),
      lambda w: w.create_item("p", 10.0, {"obs": np.zeros(3)}),
      lambda w: w.create_item("p", 11.0, {}),
      lambda w: w.create_item("p", 12.0, {"action": H(w)("action", [2, 3]),
                                          "obs": H(w)("obs", slice(-2, None)),
                                          "reward": H(w)("reward", slice(-2, None))}),
      lambda w: w.create_item("p", 13.0, {"action": H(w)("obs", slice(-2, None)),
                                          "obs": H(w)("action", slice(-2, None)),
                                          "reward": H(w)("reward", slice(-2, None))}),
      lambda w: w.create_item("p", 14.0, {"action": TrajectoryColumn(
          list(H(w)("action", slice(-2, None)))), "obs": H(w)("obs", slice(-2, None)),
                                          "reward": H(w)("reward", slice(-2, None))}),
      lambda w: w.create_item(table="p", priority=15.0, trajectory=_last(w)),
      lambda w: w.create_item("p", 16.0),
      lambda w: w.create_item("p", 17.0, _last(w)),                 # back to the last kind
  ]
  for call in calls:
    _same(fast, general, call)
  for w in (fast, general):
    w.flush()
  _assert_same_tables(pair)


def test_windows_of_another_writer_are_refused(pair):
  fast, general = pair()
  other = pair()[0]
  for t in range(3):
    for w in (fast, general, other):
      w.append(_step(t))
  fast.create_item("a", 1.0, _last(fast))
  with pytest.raises(ValueError, match="another TrajectoryWriter"):
    fast.create_item("a", 1.0, _last(other))
  fast.flush()
  assert pair.servers[0].shared_table("a").size == 1


def test_batch_size_one_and_rate_limited_items_insert_in_order(pair):
  fast, general = pair(keep_alive=2, item_batch_size=1)
  for t in range(8):
    for w in (fast, general):
      w.append(_step(t))
      if t:
        w.create_item("a", float(t), _last(w))
        w.create_item("q", float(t), {"a": H(w)("action", slice(-2, None))})
    # item_batch_size 1: in the table at once until the queue holds 3; later items (of
    # either table) wait in creation order
    sizes = [s.shared_table("a").size for s in pair.servers]
    assert sizes[0] == sizes[1] == min(t, 4)
    assert fast.num_pending_items == general.num_pending_items == max(0, 2 * t - 7)
  _assert_same_tables(pair, ("a",))
  for server in pair.servers:       # the queue takes the rest as it is sampled
    server.shared_table("q").sample(3)
  for w in (fast, general):
    w.flush(block_until_num_items=5, timeout_ms=5000)
  time.sleep(0.3)   # the background delivery inserts what the queue now admits, for both
  _assert_same_tables(pair, ("a",))
  assert fast.num_pending_items == general.num_pending_items > 0
  for w in (fast, general):
    with pytest.warns(RuntimeWarning, match="still held back"):
      w.close(timeout_ms=0)   # the held-back items go on in the background


@pytest.mark.parametrize("delivered", [(False, False), (True, False), (False, True),
                                       (True, True)])
def test_closed_writer_and_stopped_server(pair, delivered):
  """The same errors whether or not each writer's batch of items was inserted before the stop
  (the delivery thread inserts a batch 20 ms old: here flush() does it, the thread is off)."""
  fast, general = pair()
  for w in (fast, general):
    w._background = False
  for t in range(3):
    for w in (fast, general):
      w.append(_step(t))
      if t:
        w.create_item("a", 1.0, _last(w))
  held = {w: _last(w) for w in (fast, general)}
  for w, flush in zip((fast, general), delivered):
    if flush:
      w.flush()
  for server in pair.servers:
    server.stop()
  _same(fast, general, lambda w: w.append(_step(3)))           # TableClosedError
  _same(fast, general, lambda w: w.create_item("a", 1.0, held[w]))
  _same(fast, general, lambda w: w.flush())
  with pytest.warns(RuntimeWarning):
    for w in (fast, general):
      w.close()
  for op in (lambda w: w.append(_step(3)), lambda w: w.create_item("a", 1.0, held[w]),
             lambda w: w.history["obs"][-1:], lambda w: w.flush()):
    _same(fast, general, op)


def test_writer_from_before_a_fork_declines_in_the_child(pair):
  fast, general = pair()
  for t in range(3):
    for w in (fast, general):
      w.append(_step(t))
  assert fast._fast is not None
  outs = []
  for w in (fast, general):
    outs.append(run_in_fork(lambda w=w: w.append(_step(3)), timeout=30))
  assert outs[0].startswith("ERR TableClosedError") and "re-attach after fork" in outs[0]
  assert re.sub(r"\d+", "N", outs[0]) == re.sub(r"\d+", "N", outs[1])
  for w in (fast, general):    # the parent's writers are unaffected
    w.append(_step(3))
    w.create_item("a", 1.0, _last(w))
    w.flush()
  _assert_same_tables(pair, ("a",))


def test_history_before_the_first_append(pair):
  fast, general = pair()
  _same(fast, general, lambda w: w.history)
  for w in (fast, general):
    w.append(_step(0))
  assert set(fast.history) == {"obs", "action", "reward"}
  assert isinstance(fast.history["obs"], _ColumnHistory)


def test_c_base_fields_are_the_python_attributes(pair):
  fast, _ = pair()
  fast.append(_step(0))
  fast.append(_step(1))
  col = fast._by_path[("obs",)]
  assert (col.n, col.gen, col.floor, col.keep_alive) == (2, 0, 0, 2)
  assert fast._hist_step == 2 and fast.episode_steps == 2
  window = fast.history["obs"][-2:]
  assert window._win == (col, 0, 0, 2, slice(-2, None)) and window._cells is None
  assert window.window() == window._win and len(window) == 2 and window.shape == (2, 3)
  window._win = None
  assert window._win is None
  with pytest.raises(TypeError):
    window._win = (1, 2)
  with pytest.raises(TypeError):
    fast._hist_step = "x"
  with pytest.raises(TypeError):
    reverb_shm._internal._lib.hot.FastAppend(None, None, ((col, np.zeros(3), 1),), 0, 1, None, 0)
  with pytest.raises(ValueError):   # a view shorter than the limit
    reverb_shm._internal._lib.hot.FastAppend(None, None, ((col, np.zeros((1, 3), np.float32),
                                                 np.dtype(np.float32)),), 0, 5, None, 0)


def test_expired_chunks_are_released_at_once_or_after_the_batch_that_may_use_them(pair):
  """The fast append stops where a run leaves its keep-alive window: with no window item
  batched, its chunk is released at that step; otherwise at the batch's insert."""
  fast, _ = pair(keep_alive=2)
  seg = pair.servers[0].shared_table("a").segment
  col = None
  c = _AUTO_ROWS              # rows of a chunk: steps 0..c-1 leave the window at step c + 2
  for t in range(c + 3):
    fast.append({"x": np.float32(t)})
    col = col or fast._by_path[("x",)]
    assert len(col.runs) == (2 if c <= t <= c + 1 else 1), t
  assert seg.info()["num_chunks"] == 1
  fast.end_episode()
  table = pair.servers[0].shared_table("a")
  for t in range(c + 3):
    fast.append({"x": np.float32(t)})
    if t == c:       # the chunk boundary inserted the batched items
      assert not fast._batch and table.size == c - 1
    if t:
      fast.create_item("a", 1.0, {"x": fast.history["x"][-2:]})
  assert len(col.runs) == 2                # expired, kept for the batched items
  assert fast.num_pending_items == 0       # inserts the batch: the expired run goes
  assert len(col.runs) == 1
  assert seg.info()["num_chunks"] == 2     # the items hold the first chunk
  for t in range(c + 3, c + 44):
    fast.append({"x": np.float32(t)})
  assert fast.general["append"] == 2       # episode starts only: chunk boundaries in C


def test_a_full_arena_at_a_chunk_boundary_raises_as_the_general_path(server_factory):
  fixed = shm.start_bytes(_tables(), 2 << 20) + (64 << 10)   # arenas that cannot grow
  servers = [server_factory(_tables(), arena_bytes=2 << 20, max_bytes=fixed) for _ in range(2)]
  fast = CountingWriter(servers[0].localhost_client(), 2)
  general = GeneralWriter(servers[1].localhost_client(), 2)
  outcomes = []
  for t in range(400):     # rows of 8 KB: chunks of 8 rows, kept alive by the items
    outcome = _same(fast, general, lambda w, t=t: w.append({"x": np.full(1024, t, np.float64)}))
    if t:
      _same(fast, general, lambda w: w.create_item("a", 1.0, {"x": H(w)("x", slice(-2, None))}))
    outcomes.append(outcome[0])
    if outcome[0] != "ok":
      break
  assert outcomes[-1] == "ResourceExhaustedError" and len(outcomes) > 16
  assert fast.episode_steps == general.episode_steps == len(outcomes) - 1
  assert fast.general["append"] <= 2      # the first step and the failing one
  for w in (fast, general):
    w.flush()
  fast_items, general_items = (_stored_items(s, "a") for s in servers)
  assert fast_items == general_items and len(fast_items) == len(outcomes) - 1
  for w in (fast, general):
    w.close()
