"""The fast paths against the slow paths they replace: rs_sample_gather (sample_batch),
rs_insert_slices (SharedTable.insert, Client.insert) and Client.sample's batched generator."""
import gc
import threading

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import chunks

pytestmark = pytest.mark.timeout(60)


def _table(name="t", sampler=None, max_size=10_000, **kwargs):
  return reverb_shm.Table(name, sampler or selectors.Uniform(), selectors.Fifo(), max_size,
                          rate_limiters.MinSize(1), **kwargs)


def _steps(start, n):
  v = np.arange(start, start + n)
  return {"obs": np.repeat(v[:, None], 3, axis=1).astype(np.float32),
          "act": v.astype(np.int64), "rew": (v * 0.5).astype(np.float32)}


def _slow_batch(st, n):
  """sample_batch without the fast path: sample_records, then one gather per column."""
  recs, pins = st.sample_records(n)
  try:
    desc = np.ascontiguousarray(recs["desc_off"])
    ncols = len(chunks.item_columns(st.segment, int(desc[0])))
    cols = [chunks.gather_column(st.segment, desc, c) for c in range(ncols)]
  finally:
    pins.release()
  return recs, cols


def test_sample_batch_matches_the_slow_path_item_for_item(server_factory):
  # Fifo sampling with max_times_sampled=1 makes both servers sample the same sequence.
  servers = [server_factory([_table(sampler=selectors.Fifo(), max_times_sampled=1)])
             for _ in range(2)]
  fast, slow = (s.shared_table("t") for s in servers)
  keys = np.arange(1, 701, dtype=np.uint64)
  for st in (fast, slow):
    st.insert(_steps(0, 700), np.linspace(0.5, 2.0, 700), keys=keys)
  fast.sample_batch(1)   # learns the layout (slow path)
  slow.sample_records(1)[1].release()
  batch = fast.sample_batch(600)   # three rounds of <= 256 in C
  recs, cols = _slow_batch(slow, 600)
  assert fast._gather_layout is not None
  for field in ("key", "probability", "table_size", "priority", "times_sampled"):
    np.testing.assert_array_equal(getattr(batch.info, field), recs[field], err_msg=field)
    assert getattr(batch.info, field).dtype == recs[field].dtype
  for got, want in zip(batch.data, cols):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
  assert fast.stats()["samples"] == slow.stats()["samples"] == 601
  fast.check()
  assert fast.segment.info()["arena_used"] == slow.segment.info()["arena_used"]


def test_uniform_sample_batch_data_belongs_to_the_sampled_keys(server_factory):
  st = server_factory([_table()]).shared_table("t")
  keys = st.insert(_steps(0, 1000), 1.0)
  index = {int(k): i for i, k in enumerate(keys)}
  out = [np.empty(300, np.int64), np.empty((300, 3), np.float32), np.empty(300, np.float32)]
  for call in range(4):
    batch = st.sample_batch(300, out=out if call % 2 else None)
    rows = np.array([index[k] for k in batch.info.key.tolist()])
    np.testing.assert_array_equal(batch.data[0], rows)                 # act
    np.testing.assert_array_equal(batch.data[1], np.repeat(rows[:, None], 3, 1))
    np.testing.assert_array_equal(batch.data[2], rows * 0.5)
    np.testing.assert_array_equal(batch.info.probability, 1 / 1000)
    np.testing.assert_array_equal(batch.info.table_size, 1000)
    if call % 2:
      assert np.shares_memory(batch.data[1], out[1])
  assert st.stats()["samples"] == 1200
  assert st.segment.info()["live_procs"] >= 1
  st.check()


@pytest.mark.parametrize("max_times_sampled", [0, 1])
def test_sample_batch_over_many_descriptor_blocks_pins_and_frees_exactly(server_factory,
                                                                          max_times_sampled):
  """Items from 120 insert calls (120 descriptor blocks: more than a gather round remembers, so
  blobs are met, forgotten and met again) gather their own rows; every pin a round takes is
  released (nothing stays allocated after reset), also when sampling removes the items."""
  server = server_factory([_table(max_times_sampled=max_times_sampled)])
  st = server.shared_table("t")
  index = {}
  for b in range(120):
    for i, k in enumerate(st.insert(_steps(7 * b, 7), 1.0).tolist()):
      index[k] = 7 * b + i
  seen = []
  while len(seen) < 840:
    batch = st.sample_batch(256, timeout_ms=0 if max_times_sampled else None)
    rows = np.array([index[k] for k in batch.info.key.tolist()])
    np.testing.assert_array_equal(batch.data[0], rows)
    np.testing.assert_array_equal(batch.data[1], np.repeat(rows[:, None], 3, 1))
    np.testing.assert_array_equal(batch.data[2], rows * 0.5)
    seen += rows.tolist()
    st.check()
  if max_times_sampled:   # every item sampled once, then removed
    assert sorted(seen) == list(range(840)) and st.size == 0
  st.reset()
  info = server.segment.info()
  # No descriptor block stays pinned; the 3 chunks left are the open-chunk set (one per column)
  # this SharedTable keeps for its next small insert.
  assert (info["num_descs"], info["num_chunks"]) == (0, 3)
  server.segment.check()


def test_sample_batch_flexible_batch_and_deadline(server_factory):
  st = server_factory([_table(sampler=selectors.Fifo(), max_times_sampled=1)]).shared_table("t")
  st.insert(_steps(0, 6), 1.0)
  st.sample_batch(2)                       # slow path, learns the layout
  batch = st.sample_batch(8, timeout_ms=50)
  assert batch.info.key.shape == (4,) and batch.data[1].shape == (4, 3)
  np.testing.assert_array_equal(batch.data[0], [2, 3, 4, 5])
  with pytest.raises(errors.DeadlineExceededError):
    st.sample_batch(8, timeout_ms=20)


def test_sample_batch_rejects_items_of_another_layout_then_relearns(server_factory):
  st = server_factory([_table()]).shared_table("t")
  st.insert(_steps(0, 10), 1.0)
  st.sample_batch(4)
  st.reset()
  st.insert({"obs": np.zeros((10, 2), np.float64)}, 1.0)
  with pytest.raises(ValueError, match="columns|layout"):
    st.sample_batch(4)
  batch = st.sample_batch(4)               # relearnt from the new items
  assert batch.data[0].shape == (4, 2) and batch.data[0].dtype == np.float64
  batch = st.sample_batch(4)               # and the fast path uses the new layout
  assert batch.data[0].shape == (4, 2)


def test_sample_batch_validates_out_before_sampling(server_factory):
  st = server_factory([_table()]).shared_table("t")
  st.insert(_steps(0, 10), 1.0)
  st.sample_batch(4)
  used = st.stats()["samples"]
  bad = [np.empty(4, np.int32), np.empty((4, 3), np.float32), np.empty(4, np.float32)]
  with pytest.raises(ValueError, match="dtype"):
    st.sample_batch(4, out=bad)
  with pytest.raises(ValueError, match="3 columns"):
    st.sample_batch(4, out=bad[:2])
  short = [np.empty(2, np.int64), np.empty((4, 3), np.float32), np.empty(4, np.float32)]
  with pytest.raises(ValueError, match="shape"):
    st.sample_batch(4, out=short)
  assert st.stats()["samples"] == used


def test_insert_builds_the_same_items_as_encoded_descriptors(server_factory):
  server = server_factory([_table("a"), _table("b")])
  fast, slow = server.shared_table("a"), server.shared_table("b")
  data = _steps(0, 5)
  keys = fast.insert(data, [1, 2, 3, 4, 5])
  arrays = [data["act"], data["obs"], data["rew"]]
  written = [chunks.alloc_chunk(server.segment, a.dtype, a.shape[1:], 5) for a in arrays]
  for c, a in zip(written, arrays):
    c.write_rows(a)
  blob, offs = chunks.encode_row_descriptors([c.off for c in written], 5)
  slow.insert_descriptors(keys, [1, 2, 3, 4, 5], blob, offs)
  for c in written:
    c.release()
  items_fast, items_slow = fast.items(), slow.items()
  np.testing.assert_array_equal(items_fast["key"], items_slow["key"])
  np.testing.assert_array_equal(items_fast["priority"], items_slow["priority"])
  for df, ds in zip(items_fast["desc_off"].tolist(), items_slow["desc_off"].tolist()):
    cols_f = chunks.item_columns(server.segment, df)
    cols_s = chunks.item_columns(server.segment, ds)
    assert [(s["row_offset"].tolist(), s["nrows"].tolist(), q) for s, q in cols_f] == \
        [(s["row_offset"].tolist(), s["nrows"].tolist(), q) for s, q in cols_s]
  for a, b in zip(fast.sample_batch(5).data, slow.sample_batch(5).data):
    assert a.dtype == b.dtype and a.shape == b.shape
  server.segment.check()


def test_client_insert_into_several_tables_shares_one_write(server_factory):
  server = server_factory([_table("a"), _table("b")])
  client = server.localhost_client()
  before = server.segment.info()["arena_used"]
  client.insert({"x": np.arange(4, dtype=np.int16), "y": 2.5}, {"a": 1.0, "b": 3.0})
  for name, prio in (("a", 1.0), ("b", 3.0)):
    [sample] = client.sample(name, 1, emit_timesteps=False)
    assert sample.info.priority == prio and sample.info.key != 0
    np.testing.assert_array_equal(sample.data[0], [[0, 1, 2, 3]])
    np.testing.assert_array_equal(sample.data[1], [2.5])
  info = server.segment.info()
  assert info["num_chunks"] == 2 and info["num_descs"] == 2 and info["arena_used"] > before
  with pytest.raises(ValueError, match="nan"):
    client.insert({"x": np.arange(4, dtype=np.int16), "y": 2.5}, {"a": float("nan")})
  assert server.segment.info()["num_chunks"] == 2   # nothing written for a rejected insert
  server.segment.check()


def test_client_insert_into_several_tables_after_the_first_call_checks_every_table(
    server_factory):
  """Later multi-table inserts take the cached-plan path: still one write shared by every
  table, and a step a table's signature rejects raises with nothing inserted anywhere."""
  sig = {"x": reverb_shm.TensorSpec([1, 2], np.float32)}
  server = server_factory([_table("a", signature=sig), _table("b", signature=sig),
                           _table("c", sampler=selectors.Prioritized(1.0))])
  client = server.localhost_client()
  for i in range(5):
    client.insert({"x": np.full(2, i, np.float32)}, {"a": 1.0, "b": 2})
  sizes = {n: server.shared_table(n).size for n in "ab"}
  assert sizes == {"a": 5, "b": 5}
  for name in "ab":
    got = sorted(float(s.data[0][0, 0]) for s in client.sample(name, 50, emit_timesteps=False))
    assert set(got) == {0.0, 1.0, 2.0, 3.0, 4.0}
  # Each step written once: the i-th items of a and b read the same rows, other steps others.
  rows = [[chunks._decode_descriptor(server.segment, int(d))
           for d in server.shared_table(n).items()["desc_off"]] for n in "ab"]
  assert rows[0] == rows[1]
  assert len({str(r) for r in rows[0]}) == 5
  with pytest.raises(ValueError):
    client.insert({"x": np.zeros(3, np.float32)}, {"a": 1.0, "b": 1.0})   # wrong shape
  with pytest.raises(ValueError):
    client.insert({"x": np.zeros(2, np.float32)}, {"a": 1.0, "c": -1.0})  # negative priority
  assert [server.shared_table(n).size for n in "abc"] == [5, 5, 0]
  server.segment.check()


def test_client_sample_yields_exactly_num_samples_and_counts_only_them(server_factory):
  server = server_factory([_table()])
  client = server.localhost_client()
  server.shared_table("t").insert(_steps(0, 50), 1.0)
  got = list(client.sample("t", 300, emit_timesteps=False))
  assert len(got) == 300
  assert server.shared_table("t").stats()["samples"] == 300
  for s in got:
    assert s.data[0] == int(s.data[2] * 2)       # act and rew of the same step
  gen = client.sample("t", 1000, emit_timesteps=False)
  next(gen)
  gen.close()      # items sampled ahead are released with the generator
  del gen, got, s
  gc.collect()
  server.shared_table("t").reset()
  # Nothing pins the items any more: resetting the table freed every chunk and descriptor.
  info = server.segment.info()
  assert (info["num_chunks"], info["num_descs"], info["arena_used"]) == (0, 0, 0)
  server.segment.check()


def test_client_sample_blocks_per_item_and_times_out(server_factory):
  server = server_factory([_table(sampler=selectors.Fifo(), max_times_sampled=1)])
  client = server.localhost_client()
  server.shared_table("t").insert(_steps(0, 3), 1.0)
  gen = client.sample("t", 5, emit_timesteps=False, rate_limiter_timeout_ms=50)
  acts = [int(next(gen).data[0]) for _ in range(3)]
  assert acts == [0, 1, 2]
  with pytest.raises(errors.DeadlineExceededError):
    next(gen)
  assert server.shared_table("t").stats()["samples"] == 3


def test_client_sample_over_mixed_layouts_loses_no_item(server_factory):
  server = server_factory([_table()])
  client = server.localhost_client()
  for i in range(20):   # two layouts: 2- and 3-element observations
    client.insert({"obs": np.full(2 + i % 2, i, np.float32), "act": np.int64(i)}, {"t": 1.0})
  got = list(client.sample("t", 500, emit_timesteps=False))
  assert len(got) == 500
  assert server.shared_table("t").stats()["samples"] == 500   # every sampled item was yielded
  for s in got:
    act = int(s.data[0][0])
    assert s.data[1].shape == (1, 2 + act % 2) and (s.data[1] == act).all()
  st = server.shared_table("t")
  st.sample_batch(1)                      # learns one of the two layouts
  returned, errors_seen = 1, 0
  for _ in range(50):   # the other layout comes up: it ends the batch before it, unsampled
    before = st.stats()["samples"]
    try:
      batch = st.sample_batch(16)
    except ValueError as e:   # (only when it is the first item picked)
      assert "layout" in str(e) and "left unsampled" in str(e)
      errors_seen += 1
      assert st.stats()["samples"] == before
      continue
    assert 1 <= len(batch.info.key) <= 16
    obs, act = batch.data[1], batch.data[0]
    np.testing.assert_array_equal(obs.shape[1:], (1, 2 + int(act[0][0]) % 2))
    np.testing.assert_array_equal(obs[:, 0, 0], act[:, 0])
    returned += len(batch.info.key)
  assert st.stats()["samples"] == 500 + returned   # every sampled item was returned
  st.check()


def test_client_sample_emit_timesteps_on_the_gather_path(server_factory):
  server = server_factory([_table()])
  client = server.localhost_client()
  with client.trajectory_writer(3) as writer:
    for i in range(3):
      writer.append({"x": np.float32(i), "y": np.arange(2, dtype=np.int8) + i})
    writer.create_item("t", 1.0, {"x": writer.history["x"][:], "y": writer.history["y"][:]})
  for _ in range(3):   # the first call learns the layout, the next ones gather in C
    steps = next(client.sample("t", 1))
    assert [float(s.data[0]) for s in steps] == [0.0, 1.0, 2.0]
    # a scalar column's step is a 0-d array, as Reverb's (not a numpy scalar)
    assert all(type(s.data[0]) is np.ndarray and s.data[0].shape == () for s in steps)
    assert [s.data[1].tolist() for s in steps] == [[0, 1], [1, 2], [2, 3]]


@pytest.mark.parametrize("num_samples", [1, 2, 3, 256, 300])
def test_client_sample_gather_path_builds_the_documented_objects(server_factory, num_samples):
  """Every batch size of the gather path (one item, 2, a full sampling-ahead batch and one
  more) yields ReplaySample(SampleInfo of Python scalars, [row view, 0-d view, 0-d view])
  whose values belong to the sampled key, as the first (learning) call does."""
  server = server_factory([_table()])
  client = server.localhost_client()
  st = server.shared_table("t")
  keys = st.insert(_steps(0, 40), np.arange(40) + 1.0).tolist()
  first = next(client.sample("t", 1, emit_timesteps=False))   # learns the layout
  for sample in [first] + list(client.sample("t", num_samples, emit_timesteps=False)):
    assert type(sample) is reverb_shm.ReplaySample and type(sample.info) is reverb_shm.SampleInfo
    info = sample.info
    assert [type(v) for v in info] == [int, float, int, float, int]
    i = keys.index(info.key)
    assert info.priority == i + 1.0 and info.table_size == 40 and info.probability == 1 / 40
    assert type(sample.data) is list and len(sample.data) == 3
    act, obs, rew = sample.data
    for col, dtype, shape in ((act, np.int64, ()), (obs, np.float32, (3,)),
                              (rew, np.float32, ())):
      assert type(col) is np.ndarray and col.dtype == dtype and col.shape == shape
    assert act == i and obs.tolist() == [i] * 3 and rew == i * 0.5
  assert st.stats()["samples"] == 1 + num_samples


def test_sample_batch_after_the_server_stopped_raises_table_closed(server_factory):
  server = server_factory([_table()])
  st = server.shared_table("t")
  st.insert(_steps(0, 10), 1.0)
  out = [np.empty(4, np.int64), np.empty((4, 3), np.float32), np.empty(4, np.float32)]
  st.sample_batch(4, out=out)      # learns the layout: the next calls take the one-call path
  assert st.sample_batch(4, out=out).info.key.shape == (4,)
  server.stop()
  for kwargs in ({"out": out}, {}):
    with pytest.raises(errors.TableClosedError):
      st.sample_batch(4, **kwargs)


def test_client_sample_items_keep_their_batch_alive_and_are_private(server_factory):
  """The row views Client.sample yields own their batch arrays: they stay valid after the
  generator and every other item are gone, and writing to one item changes no other item nor
  the table."""
  server = server_factory([_table()])
  client = server.localhost_client()
  server.shared_table("t").insert(_steps(0, 8), 1.0)
  next(client.sample("t", 1, emit_timesteps=False))    # learns the layout
  items = list(client.sample("t", 64, emit_timesteps=False))
  keep = items[5]
  act = int(keep.data[0])
  del items
  gc.collect()
  np.testing.assert_array_equal(keep.data[1], np.full(3, act, np.float32))
  keep.data[1][:] = -1.0
  keep.data[0][...] = 99
  for s in client.sample("t", 64, emit_timesteps=False):
    assert int(s.data[0]) != 99 and (s.data[1] == int(s.data[0])).all()


def test_hot_sampling_helpers_reject_malformed_calls():
  from reverb_shm._internal._lib import hot  # pylint: disable=g-import-not-at-top
  info = reverb_shm.SampleInfo(*(np.zeros(2, t) for t in (np.uint64, np.float64, np.int64,
                                                           np.float64, np.int32)))
  cols = [np.zeros((2, 3), np.float32)]
  with pytest.raises(TypeError, match="info field 1"):
    hot.split_batch(reverb_shm.ReplaySample, reverb_shm.SampleInfo,
                    info._replace(probability=np.zeros(2, np.float32)), cols)
  with pytest.raises(TypeError, match="column 0 must be an array of 2 rows"):
    hot.split_batch(reverb_shm.ReplaySample, reverb_shm.SampleInfo, info, [np.zeros(3)])
  with pytest.raises(TypeError, match="split_batch"):
    hot.split_batch(tuple, reverb_shm.SampleInfo, info, cols)
  with pytest.raises(ValueError, match="n must be in"):
    hot.sample_gather(1, 0, 0, 0, 0, -1, 0, 1, 1, reverb_shm.SampleInfo)
  with pytest.raises(ValueError, match="NamedTuple of 5 fields"):
    hot.sample_gather(1, 0, 0, 4, 4, -1, 0, 1, 1, reverb_shm.ReplaySample)


def _priorities(st):
  items = st.items()
  return dict(zip(items["key"].tolist(), items["priority"].tolist()))


def test_updates_of_just_sampled_keys_change_exactly_those_items(server_factory):
  """update_priorities after sampling finds the sampled items through the process's hints; the
  result is the one of updates through the key index, also when a hint went stale: the item was
  deleted and its key inserted again (another record), or the same key lives in another table."""
  server = server_factory([_table("a", sampler=selectors.Prioritized(0.8)),
                           _table("b", sampler=selectors.Prioritized(0.8))])
  a, b = server.shared_table("a"), server.shared_table("b")
  keys = np.arange(1, 301, dtype=np.uint64)
  a.insert(_steps(0, 300), np.ones(300), keys=keys)
  b.insert(_steps(0, 300), np.ones(300), keys=keys)
  sampled = a.sample_batch(64).info.key
  assert a.update_priorities(sampled, np.arange(64) + 2.0) == 64
  want = {int(k): 1.0 for k in keys}
  want.update(zip(sampled.tolist(), (np.arange(64) + 2.0).tolist()))
  # (a key sampled twice ends with its last priority, as with updates through the index)
  assert _priorities(a) == want and set(_priorities(b).values()) == {1.0}
  # Same keys, other table: b's items change, a's stay.
  assert b.update_priorities(sampled, np.full(64, 7.0)) == 64
  assert _priorities(a) == want
  assert {k: p for k, p in _priorities(b).items() if p != 1.0} == dict.fromkeys(
      sampled.tolist(), 7.0)
  # Stale hints: every sampled item deleted, half of them inserted again under the same key
  # (new records), the other half gone; more inserts reuse the freed records for other keys.
  gone = np.unique(sampled)
  a.delete(gone)
  back = gone[::2]
  a.insert(_steps(1000, len(back)), np.ones(len(back)), keys=back)
  a.insert(_steps(2000, 40), np.ones(40), keys=np.arange(5001, 5041, dtype=np.uint64))
  assert a.update_priorities(gone, np.full(len(gone), 9.0)) == len(back)
  pr = _priorities(a)
  assert all(pr[int(k)] == 9.0 for k in back) and not any(int(k) in pr for k in gone[1::2])
  assert all(pr[k] == 1.0 for k in range(5001, 5041))
  a.check()
  b.check()


def test_updates_from_another_thread_than_the_sampling_one_change_exactly_those_items(
    server_factory):
  """The hints are the process's, not a thread's (a learner iterator samples in one thread and
  may update in another): an update in this thread of keys another thread sampled, some of
  whose items were since deleted or replaced under the same key, changes exactly the live ones."""
  server = server_factory([_table("a", sampler=selectors.Prioritized(0.8))])
  a = server.shared_table("a")
  keys = np.arange(1, 501, dtype=np.uint64)
  a.insert(_steps(0, 500), np.ones(500), keys=keys)
  sampled = []
  t = threading.Thread(target=lambda: sampled.extend(a.sample_batch(128).info.key.tolist()))
  t.start()
  t.join(30)
  assert not t.is_alive() and len(sampled) == 128
  gone = np.unique(np.array(sampled, np.uint64))
  a.delete(gone[1::3])                                              # gone
  a.delete(gone[2::3])
  a.insert(_steps(1000, len(gone[2::3])), np.ones(len(gone[2::3])), keys=gone[2::3])   # replaced
  assert a.update_priorities(gone, np.full(len(gone), 5.0)) == len(gone) - len(gone[1::3])
  pr = _priorities(a)
  assert all(pr[int(k)] == 5.0 for k in np.concatenate([gone[0::3], gone[2::3]]))
  assert not any(int(k) in pr for k in gone[1::3])
  assert sum(p == 5.0 for p in pr.values()) == len(gone) - len(gone[1::3])
  a.check()


def test_sample_batch_from_a_queue_of_mixed_layouts_returns_every_item_once(server_factory):
  """max_times_sampled=1 removes what it samples: an item of another layout must end a batch
  unsampled, not be taken and then lost with a ValueError."""
  server = server_factory([reverb_shm.Table.queue("q", 100)])
  client = server.localhost_client()
  for i in range(12):
    client.insert([np.full(3, i, np.float32 if i % 3 else np.float64)], {"q": 1.0})
  st = server.shared_table("q")
  returned = []
  for _ in range(40):
    if st.size == 0:
      break
    try:
      batch = st.sample_batch(4, timeout_ms=0)
    except ValueError:
      continue
    returned += [int(row.ravel()[0]) for row in batch.data[0]]
  assert returned == list(range(12))   # every item, once, in queue order
  st.check()


def test_sample_batch_first_call_with_a_wrong_out_takes_one_item_only(server_factory):
  server = server_factory([reverb_shm.Table.queue("q", 100)])
  st = server.shared_table("q")
  st.insert(_steps(0, 10), 1.0)
  out = [np.empty(8, np.int32), np.empty((8, 3), np.float32), np.empty(8, np.float32)]
  with pytest.raises(ValueError, match="out leaf 0 must have dtype int64"):
    st.sample_batch(8, out=out)
  assert st.size == 9                      # the one item sampled to learn the columns
  out[0] = np.empty(8, np.int64)
  batch = st.sample_batch(8, out=out)
  np.testing.assert_array_equal(batch.data[0], np.arange(1, 9))
  assert np.shares_memory(batch.data[0], out[0]) and st.size == 1


def test_sample_batch_validates_a_reused_out_again_after_its_flags_or_dtype_changed(
    server_factory):
  st = server_factory([_table()]).shared_table("t")
  st.insert(_steps(0, 10), 1.0)
  out = [np.zeros(8, np.int64), np.zeros((8, 3), np.float32), np.zeros(8, np.float32)]
  st.sample_batch(8, out=out)
  st.sample_batch(8, out=out)              # the cached plan
  out[1][:] = -1
  out[1].flags.writeable = False
  with pytest.raises(ValueError, match="out leaf 1 must be a writeable"):
    st.sample_batch(8, out=out)
  assert (out[1] == -1).all()              # not written
  out[1].flags.writeable = True
  out[2].dtype = np.int32                  # same buffer, another dtype
  with pytest.raises(ValueError, match="out leaf 2"):
    st.sample_batch(8, out=out)
  out[2].dtype = np.float32
  assert st.sample_batch(8, out=out).data[1].shape == (8, 3)
