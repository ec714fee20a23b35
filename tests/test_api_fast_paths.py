"""One-call paths of Reverb calls made with their default arguments, each against the general
path it replaces: Client.insert into several tables, Client.mutate_priorities with a dict,
TrajectoryWriter items alternating between tables, Client.sample's per-step ReplaySamples."""
import types

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm import trajectory_writer as trajectory_writer_lib
from reverb_shm._internal import chunks, hot_plans, structure
from reverb_shm._internal._lib import hot
from reverb_shm.client import to_samples

pytestmark = pytest.mark.timeout(60)


def _table(name, sampler=None, max_size=1000, limiter=None, **kwargs):
  return reverb_shm.Table(name, sampler or selectors.Uniform(), selectors.Fifo(), max_size,
                          limiter or rate_limiters.MinSize(1), **kwargs)


def _step(i):
  return {"obs": np.full(3, i, np.float32), "act": np.int64(i)}


def _rows(server, name):
  """(chunk, row) slices of every item of table `name`, in insertion order."""
  return [chunks._decode_descriptor(server.segment, int(d))  # pylint: disable=protected-access
          for d in server.shared_table(name).items()["desc_off"]]


# ---------------------------------------------------------------- Client.insert, several tables

def test_insert_into_two_tables_in_one_c_call_writes_each_step_once(server_factory):
  server = server_factory([_table("a"), _table("b", sampler=selectors.Prioritized(1.0))])
  client = server.localhost_client()
  client.insert(_step(0), {"a": 1.0, "b": 100.0})   # the general path (caches the handles)
  client.insert(_step(1), {"a": 1.0, "b": 1.0})     # the Python path: makes both tables' plans
  for i in range(2, 40):   # then one C call each (True: inserted into every table)
    assert hot_plans.client_insert(client._hot_plans, _step(i), {"a": 1.0, "b": float(i)},
                                   None) is True
  client.insert(_step(40), {"a": 1, "b": 40})     # (int priorities too)
  a, b = (server.shared_table(n).items() for n in "ab")
  assert len(a) == len(b) == 41
  assert not set(a["key"].tolist()) & set(b["key"].tolist())   # a key per item
  assert b["priority"].tolist() == [100.0] + [float(i) for i in range(1, 41)]
  assert set(a["priority"].tolist()) == {1.0}
  rows = _rows(server, "a")
  assert rows == _rows(server, "b") and len({str(r) for r in rows}) == 41
  for s in client.sample("b", 300, emit_timesteps=False):   # each item's data is its step
    act = int(s.data[0][0])   # (columns in sorted key order: act, obs)
    assert s.data[1].tolist() == [[act] * 3] and s.info.priority == (act or 100.0)
  assert server.shared_table("a").stats()["inserts"] == 41
  server.segment.check()


@pytest.mark.parametrize("priorities, error", [
    ({"a": 1.0, "b": float("nan")}, ValueError),
    ({"a": 1.0, "b": -1.0}, ValueError),           # negative on a Prioritized table
    ({"a": 1.0, "b": 1.7e308}, ValueError),         # above b's sum-tree cap
    ({"a": float("inf"), "b": 1.0}, ValueError),
    ({"a": 1.0, "nope": 1.0}, errors.UnknownTableError),
])
def test_insert_into_two_tables_rejects_bad_priorities_inserting_nothing(server_factory,
                                                                         priorities, error):
  server = server_factory([_table("a"), _table("b", sampler=selectors.Prioritized(1.0))])
  client = server.localhost_client()
  for i in range(3):
    client.insert(_step(i), {"a": 1.0, "b": 1.0})
  used = server.segment.info()["arena_used"]
  for _ in range(2):
    with pytest.raises(error):
      client.insert(_step(9), priorities)
  assert [server.shared_table(n).size for n in "ab"] == [3, 3]
  assert server.segment.info()["arena_used"] == used
  server.segment.check()


def test_insert_into_two_tables_rejects_steps_of_another_layout_inserting_nothing(
    server_factory):
  sig = {"obs": reverb_shm.TensorSpec([1, 3], np.float32), "act": reverb_shm.TensorSpec(
      [1], np.int64)}
  server = server_factory([_table("a", signature=sig), _table("b", signature=sig)])
  client = server.localhost_client()
  for i in range(3):
    client.insert(_step(i), {"a": 1.0, "b": 1.0})
  for bad in ({"obs": np.zeros(3, np.float64), "act": np.int64(1)},
              {"obs": np.zeros(4, np.float32), "act": np.int64(1)},
              {"obs": np.zeros(3, np.float32)}):
    with pytest.raises(ValueError):
      client.insert(bad, {"a": 1.0, "b": 1.0})
  assert [server.shared_table(n).size for n in "ab"] == [3, 3]
  server.segment.check()


def test_insert_into_two_tables_whose_plans_differ_takes_the_python_path(server_factory):
  server = server_factory([_table("a"), _table("b")])
  client = server.localhost_client()
  client.insert(_step(0), {"a": 1.0})
  client.insert({"other": np.zeros(2, np.int8)}, {"b": 1.0})   # b's last plan: another layout
  assert hot_plans.client_insert(client._hot_plans, _step(1), {"a": 1.0, "b": 1.0},
                                 None) is None   # declined: nothing done
  assert [server.shared_table(n).size for n in "ab"] == [1, 1]
  client.insert(_step(1), {"a": 1.0, "b": 1.0})   # Python path, then both plans of this layout
  assert hot_plans.client_insert(client._hot_plans, _step(2), {"a": 1.0, "b": 1.0},
                                 None) is True
  assert [server.shared_table(n).size for n in "ab"] == [3, 3]
  assert _rows(server, "a")[1:] == _rows(server, "b")[1:]
  server.segment.check()


def test_insert_into_two_tables_times_out_keeping_the_first_tables_item(server_factory):
  server = server_factory([_table("a"), reverb_shm.Table.queue("q", 2)])
  client = server.localhost_client()
  for i in range(2):
    client.insert(_step(i), {"a": 1.0, "q": 1.0})
  with pytest.raises(errors.DeadlineExceededError):   # q is full
    client.insert(_step(2), {"a": 1.0, "q": 1.0}, timeout_ms=30)
  assert [server.shared_table(n).size for n in ("a", "q")] == [3, 2]
  server.segment.check()


# ---------------------------------------------------------------- mutate_priorities(dict)

def _priorities(st):
  items = st.items()
  return dict(zip(items["key"].tolist(), items["priority"].tolist()))


@pytest.mark.parametrize("prioritized", [False, True])
def test_mutate_with_a_dict_in_one_c_call_matches_the_general_path(server_factory, prioritized):
  sampler = selectors.Prioritized(0.7) if prioritized else selectors.Uniform()
  server = server_factory([_table("c", sampler=sampler), _table("g", sampler=sampler)])
  client = server.localhost_client()
  keys = np.array([0, 1, 7, 2**40 + 3, 2**63, 2**64 - 1] + list(range(100, 198)), np.uint64)
  for name in "cg":
    server.shared_table(name).insert({"x": np.zeros((len(keys), 2), np.float32)}, 1.0,
                                     keys=keys)
  rng = np.random.default_rng(0)
  updates = {int(k): float(p) for k, p in zip(keys[::2], rng.random(52) + 0.1)}
  updates[np.uint64(1)] = 3       # a numpy key and an int priority
  updates[12345] = 5.0            # unknown: ignored, not counted
  assert hot.mutate_dict(server.segment.address, 0, dict(updates), prioritized) is not None
  got = client.mutate_priorities("c", updates)
  want = client.mutate_priorities("g", types.MappingProxyType(updates))   # the general path
  assert got == want == (53, 0)
  assert _priorities(server.shared_table("c")) == _priorities(server.shared_table("g"))
  assert _priorities(server.shared_table("c"))[1] == 3.0
  assert _priorities(server.shared_table("c"))[2**64 - 1] == 1.0   # (odd position: kept)
  other = {np.int64(100): 9.0}   # keys of other types: the general path
  assert hot.mutate_dict(server.segment.address, 0, other, prioritized) is None
  assert client.mutate_priorities("c", other) == client.mutate_priorities("g", other) == (1, 0)
  assert _priorities(server.shared_table("c")) == _priorities(server.shared_table("g"))
  server.segment.check()


@pytest.mark.parametrize("bad", [
    {5: float("nan")}, {5: float("inf")}, {-1: 1.0}, {2**64: 1.0}, {True: 1.0}, {1.5: 1.0},
    {5: None}, {"5": 1.0}, {5: -1.0}])
def test_mutate_with_a_bad_dict_entry_changes_nothing(server_factory, bad):
  server = server_factory([_table("t", sampler=selectors.Prioritized(1.0))])
  client = server.localhost_client()
  st = server.shared_table("t")
  # (keys from 2: True and 1.0 are not equal to any of them)
  st.insert({"x": np.zeros((10, 2), np.float32)}, 1.0, keys=np.arange(2, 12, dtype=np.uint64))
  updates = {k: 2.0 for k in range(2, 12)}
  updates.update(bad)   # (last in the dict: the C loop has read the good entries before it)
  assert hot.mutate_dict(server.segment.address, 0, updates, True) is None
  with pytest.raises((ValueError, TypeError)):
    client.mutate_priorities("t", updates)
  assert set(_priorities(st).values()) == {1.0}
  assert client.mutate_priorities("t", {k: 2.0 for k in range(2, 12)}) == (10, 0)
  assert set(_priorities(st).values()) == {2.0}


def test_mutate_with_a_dict_after_the_server_stopped_raises(server_factory):
  server = server_factory([_table("t")])
  client = server.localhost_client()
  st = server.shared_table("t")
  keys = st.insert({"x": np.zeros((4, 2), np.float32)}, 1.0).tolist()
  assert client.mutate_priorities("t", dict.fromkeys(keys, 2.0)) == (4, 0)
  server.stop()
  with pytest.raises((errors.TableClosedError, errors.ServerUnavailableError,
                      errors.DeadOwnerError)):
    client.mutate_priorities("t", dict.fromkeys(keys, 3.0))


# ---------------------------------------------------------------- writer: alternating tables

def _write_alternating(client, steps, fast):
  with client.trajectory_writer(num_keep_alive_refs=2) as w:
    def create(table, priority, item):
      if not fast:   # the C path then tries only the last kind
        w._table_kinds.clear()   # pylint: disable=protected-access
      w.create_item(table, priority, item)
    for i in range(steps):
      w.append(_step(i))
      item = {k: v[-1:] for k, v in w.history.items()}
      create("a", 1.0, item)
      create("b", float(i + 1), item)
      if i >= 1:
        create("a", 0.5, {k: v[-2:] for k, v in w.history.items()})


def test_writer_items_alternating_between_tables_take_the_c_path_and_match(server_factory,
                                                                          monkeypatch):
  general = []
  original = trajectory_writer_lib.TrajectoryWriter._create_item

  def counted(self, *args):
    general.append(args[0])
    return original(self, *args)
  monkeypatch.setattr(trajectory_writer_lib.TrajectoryWriter, "_create_item", counted)
  results = []
  for fast in (True, False):
    general.clear()
    server = server_factory([_table(n, sampler=selectors.Fifo(), max_times_sampled=1)
                             for n in "ab"])
    client = server.localhost_client()
    _write_alternating(client, 60, fast)
    # The C path: only the first item of each kind went through Python; else every one after
    # an item of another table did.
    assert len(general) == (3 if fast else 60 * 3 - 1), len(general)
    items = {n: server.shared_table(n).items() for n in "ab"}
    data = [[(s.info.priority, s.data[0].tolist(), s.data[1].tolist())   # insertion order
             for s in client.sample(n, len(items[n]), emit_timesteps=False)] for n in "ab"]
    assert [len(d) for d in data] == [119, 60]
    results.append(data)
    assert items["b"]["priority"].tolist() == [float(i + 1) for i in range(60)]
    server.segment.check()
  assert results[0] == results[1]


# ---------------------------------------------------------------- Client.sample per step

def _batch(b, columns):
  info = reverb_shm.SampleInfo(np.arange(b, dtype=np.uint64) + 5, np.full(b, 0.25),
                               np.full(b, 9, np.int64), np.arange(b) + 0.5,
                               np.arange(b, dtype=np.int32))
  return info, columns


@pytest.mark.parametrize("steps", [1, 3, 0])
def test_split_batch_per_step_matches_to_samples(steps):
  b = 4
  info, cols = _batch(b, [np.arange(b * steps * 2, dtype=np.float32).reshape(b, steps, 2),
                          np.arange(b * steps, dtype=np.int64).reshape(b, steps),
                          np.zeros((b, steps, 2, 2), np.uint8)])
  fast = hot.split_batch(reverb_shm.ReplaySample, reverb_shm.SampleInfo, info, cols, True)
  infos = [reverb_shm.SampleInfo(*[f[i].item() for f in info]) for i in range(b)]
  slow = [to_samples(infos[i], [c[i] for c in cols], True, None) for i in range(b)]
  assert type(fast) is list and len(fast) == b
  for got, want in zip(fast, slow):
    assert type(got) is list and len(got) == len(want) == steps
    for g, w in zip(got, want):
      assert type(g) is reverb_shm.ReplaySample and type(g.info) is reverb_shm.SampleInfo
      assert g.info == w.info and [type(v) for v in g.info] == [int, float, int, float, int]
      assert g.info is got[0].info   # one info per item, as to_samples'
      assert type(g.data) is list and len(g.data) == 3
      for x, y, col in zip(g.data, w.data, cols):
        assert type(x) is np.ndarray and x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)
        assert np.shares_memory(x, col)   # a view of the batch, no copy


@pytest.mark.parametrize("timesteps", [True, False])
def test_split_batch_unflattens_each_data_list_as_the_python_path(timesteps):
  b, steps = 3, 2
  info, cols = _batch(b, [np.arange(b * steps, dtype=np.int64).reshape(b, steps),
                          np.arange(b * steps * 2, dtype=np.float32).reshape(b, steps, 2)])
  treedef = structure.flatten({"act": 0, "obs": {"x": 0}})[1]
  fast = hot.split_batch(reverb_shm.ReplaySample, reverb_shm.SampleInfo, info, cols, timesteps,
                         treedef.unflatten)
  infos = [reverb_shm.SampleInfo(*[f[i].item() for f in info]) for i in range(b)]
  slow = [to_samples(infos[i], [c[i] for c in cols], timesteps, treedef) for i in range(b)]
  for got, want in zip(fast, slow):
    for g, w in zip(got if timesteps else [got], want if timesteps else [want]):
      assert g.info == w.info and type(g.data) is dict and g.data.keys() == {"act", "obs"}
      assert g.data["obs"].keys() == {"x"}
      for x, y in ((g.data["act"], w.data["act"]), (g.data["obs"]["x"], w.data["obs"]["x"])):
        assert type(x) is np.ndarray and x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)
  with pytest.raises(TypeError, match="unflatten must be None or callable"):
    hot.split_batch(reverb_shm.ReplaySample, reverb_shm.SampleInfo, info, cols, True, 3)


def test_client_sample_unpacked_as_the_signature_on_the_gather_path(server_factory):
  sig = {"act": reverb_shm.TensorSpec([2], np.int64),
         "obs": {"x": reverb_shm.TensorSpec([2, 3], np.float32)}}
  server = server_factory([_table("t", signature=sig)])
  client = server.localhost_client()
  with client.trajectory_writer(2) as w:
    for i in range(30):
      w.append({"act": np.int64(i), "obs": {"x": np.full(3, i, np.float32)}})
      if i:
        w.create_item("t", 1.0, {"act": w.history["act"][-2:],
                                 "obs": {"x": w.history["obs"]["x"][-2:]}})
  for call in range(3):   # the first call learns the layout, the next ones gather in C
    for steps in client.sample("t", 40, unpack_as_table_signature=True):
      first = int(steps[0].data["act"])
      assert [int(s.data["act"]) for s in steps] == [first, first + 1]
      assert [s.data["obs"]["x"].tolist() for s in steps] == [[first] * 3, [first + 1] * 3]
    for s in client.sample("t", 40, emit_timesteps=False, unpack_as_table_signature=True):
      first = int(s.data["act"][0])
      assert s.data["act"].tolist() == [first, first + 1]
      assert s.data["obs"]["x"].shape == (2, 3) and s.data["obs"]["x"][1, 0] == first + 1


def test_split_batch_per_step_declines_columns_without_a_shared_time_dim():
  info, _ = _batch(2, [])
  for cols in ([np.zeros((2, 3)), np.zeros((2, 2))],   # time dims differ
               [np.zeros((2, 3)), np.zeros(2)],        # a squeezed column
               []):
    assert hot.split_batch(reverb_shm.ReplaySample, reverb_shm.SampleInfo, info, cols,
                           True) is None
  with pytest.raises(TypeError, match="column 0 must be an array of 2 rows"):
    hot.split_batch(reverb_shm.ReplaySample, reverb_shm.SampleInfo, info, [np.zeros((3, 1))],
                    True)


def test_client_sample_of_items_without_a_time_dim_raises_on_the_gather_path(server_factory):
  server = server_factory([_table("t")])
  client = server.localhost_client()
  with client.trajectory_writer(1) as w:
    for i in range(3):
      w.append({"x": np.float32(i), "y": np.arange(2, dtype=np.int8)})
      w.create_item("t", 1.0, {"x": w.history["x"][-1], "y": w.history["y"][-1:]})
  next(client.sample("t", 1, emit_timesteps=False))   # learns the layout: gathers from now on
  assert client._table_handle("t").table._gather_layout is not None
  with pytest.raises(ValueError, match="Can't split non timestep trajectory"):
    next(client.sample("t", 5))
  steps = [s.data for s in client.sample("t", 5, emit_timesteps=False)]
  assert all(x.shape == () and y.shape == (1, 2) for x, y in steps)


def test_client_sample_frames_per_step_is_one_private_copy(server_factory):
  server = server_factory([_table("f")])
  client = server.localhost_client()
  frame = np.random.default_rng(0).integers(0, 256, (84, 84, 4), dtype=np.uint8)
  for i in range(20):
    client.insert({"frame": frame + np.uint8(i)}, {"f": 1.0})
  next(client.sample("f", 1))   # learns the layout
  got = list(client.sample("f", 64))
  assert len(got) == 64
  for steps in got:
    [s] = steps
    f = s.data[0]
    assert f.shape == (84, 84, 4) and f.dtype == np.uint8 and f.flags.writeable
    np.testing.assert_array_equal(f, frame + np.uint8(f[0, 0, 0] - frame[0, 0, 0]))
  base = got[0][0].data[0].base
  assert all(s[0].data[0].base is base for s in got)   # views of one gathered batch
  got[0][0].data[0][:] = 0   # private: the table's data is unchanged
  again = [s[0].data[0] for s in client.sample("f", 64)]
  assert all(f.any() for f in again)
