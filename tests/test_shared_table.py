"""SharedTable: batched operations, zero-copy views and pins, chunk sharing, validation and
real multi-process use."""
import gc
import multiprocessing
import zlib

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import chunks

pytestmark = pytest.mark.timeout(60)


def _server(server_factory, *tables, **kwargs):
  if not tables:
    tables = (reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100_000,
                               rate_limiters.MinSize(1)),)
  return server_factory(list(tables), **kwargs)


def _arena_used(st):
  return st.segment.info()["arena_used"]


def test_batched_insert_sample_and_structure(server_factory):
  sig = {"obs": reverb_shm.TensorSpec((3,), np.float32), "act": reverb_shm.TensorSpec((), np.int64)}
  table = reverb_shm.Table("t", selectors.Fifo(), selectors.Fifo(), 100, rate_limiters.MinSize(1),
                           max_times_sampled=1, signature=sig)
  st = _server(server_factory, table).shared_table("t")
  obs = np.arange(12, dtype=np.float32).reshape(4, 3)
  keys = st.insert({"obs": obs, "act": np.arange(4)}, [1.0, 2.0, 3.0, 4.0])
  assert keys.dtype == np.uint64 and len(set(keys.tolist())) == 4
  assert st.items()["key"].tolist() == keys.tolist()
  samples = st.sample(2)
  assert [s.info.key for s in samples] == keys[:2].tolist()
  np.testing.assert_array_equal(samples[1].data["obs"], obs[1])
  assert samples[1].data["act"] == 1 and samples[1].data["act"].shape == ()
  batch = st.sample_batch(2)
  assert batch.info.key.tolist() == keys[2:].tolist()
  np.testing.assert_array_equal(batch.data["obs"], obs[2:])
  np.testing.assert_array_equal(batch.data["act"], [2, 3])
  assert batch.info.times_sampled.tolist() == [1, 1]
  assert st.size == 0


def test_sample_batch_into_out_buffers(server_factory):
  st = _server(server_factory).shared_table("t")
  st.insert([np.ones((5, 2, 2), np.float32), np.arange(5, dtype=np.int32)], 1.0)
  out = [np.zeros((8, 2, 2), np.float32), np.zeros(8, np.int32)]
  batch = st.sample_batch(8, out=out)
  assert batch.data[0].base is out[0] or np.shares_memory(batch.data[0], out[0])
  np.testing.assert_array_equal(out[0], 1.0)
  assert set(out[1].tolist()) <= set(range(5))
  used = st.stats()["samples"]
  with pytest.raises(ValueError, match="out"):
    st.sample_batch(8, out=[np.zeros((8, 2, 2), np.float64)[::1, :, :1], out[1]])
  assert st.stats()["samples"] == used  # rejected before sampling
  with pytest.raises(ValueError, match="dtype"):
    st.sample_batch(8, out=[np.zeros((8, 2, 2), np.float64), out[1]])


def test_update_and_delete(server_factory):
  st = _server(server_factory).shared_table("t")
  keys = st.insert({"x": np.zeros((3, 1))}, [1.0, 2.0, 3.0])
  assert st.update_priorities(keys[:2], [5.0, 6.0]) == 2
  assert st.update_priorities([12345], [1.0]) == 0  # unknown keys ignored
  assert st.delete(keys[1:]) == 2
  items = st.items()
  assert items["key"].tolist() == [keys[0]] and items["priority"].tolist() == [5.0]
  assert st.mutate({int(keys[0]): 9.0}, [int(keys[0])]) == (0, 1)  # deletes first


def test_zero_copy_views_stay_valid_and_pins_are_released(server_factory):
  table = reverb_shm.Table("t", selectors.Fifo(), selectors.Fifo(), 10, rate_limiters.MinSize(1))
  st = _server(server_factory, table).shared_table("t")
  baseline = _arena_used(st)
  payload = np.arange(1000, dtype=np.float64).reshape(10, 100)
  keys = st.insert({"x": payload}, 1.0)
  view = st.sample(1)[0].data[0]
  assert not view.flags.writeable and not view.flags.owndata
  assert isinstance(view.base, object) and view.base is not None
  st.delete(keys)  # the item is gone, the pinned chunk is not
  assert st.size == 0 and _arena_used(st) > baseline
  np.testing.assert_array_equal(view, payload[0])
  sub = view[10:20]
  del view
  gc.collect()
  assert _arena_used(st) > baseline
  np.testing.assert_array_equal(sub, payload[0, 10:20])
  del sub
  gc.collect()
  assert _arena_used(st) == baseline


def test_chunks_shared_between_tables_freed_with_last_item(server_factory):
  tables = [reverb_shm.Table(n, selectors.Uniform(), selectors.Fifo(), 100,
                             rate_limiters.MinSize(1)) for n in ("a", "b")]
  server = _server(server_factory, *tables)
  a, b = server.shared_table("a"), server.shared_table("b")
  baseline = _arena_used(a)
  chunk = chunks.alloc_chunk(a.segment, np.float32, (4,), 2)
  chunk.write_rows(np.ones((2, 4), np.float32))
  blob, offs = chunks.join_descriptors([chunks.encode_descriptor([([(chunk.off, 0, 2)], False)])])
  a.insert_descriptors([1], [1.0], blob, offs)
  b.insert_descriptors([2], [1.0], blob, offs)
  chunk.release()
  assert a.segment.info()["num_chunks"] == 1
  np.testing.assert_array_equal(b.sample(1)[0].data[0], np.ones((2, 4)))
  a.delete([1])
  assert a.segment.info()["num_chunks"] == 1
  gc.collect()
  b.delete([2])
  gc.collect()
  assert a.segment.info()["num_chunks"] == 0
  assert _arena_used(a) == baseline
  a.check()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_priority_rejected_table_unchanged(server_factory, bad):
  st = _server(server_factory).shared_table("t")
  baseline = _arena_used(st)
  with pytest.raises(ValueError, match="finite"):
    st.insert({"x": np.zeros((3, 1))}, [1.0, bad, 1.0])
  assert st.size == 0 and _arena_used(st) == baseline


def test_signature_mismatch_rejected(server_factory):
  sig = {"x": reverb_shm.TensorSpec((2,), np.float32)}
  table = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10,
                           rate_limiters.MinSize(1), signature=sig)
  st = _server(server_factory, table).shared_table("t")
  with pytest.raises(ValueError, match="dtype"):
    st.insert({"x": np.zeros((1, 2), np.float64)}, 1.0)
  with pytest.raises(ValueError, match="shape"):
    st.insert({"x": np.zeros((1, 3), np.float32)}, 1.0)
  with pytest.raises(ValueError, match="columns"):
    st.insert({"x": np.zeros((1, 2), np.float32), "y": np.zeros((1, 2), np.float32)}, 1.0)
  with pytest.raises(ValueError, match=r"priorities must have shape \(2,\)"):
    st.insert({"x": np.zeros((2, 2), np.float32)}, [1.0])
  with pytest.raises(ValueError, match="same batch size"):
    st.insert([np.zeros((2, 2), np.float32), np.zeros(3)], 1.0)
  assert st.size == 0 and _arena_used(st) == 0


def test_unknown_table_error_lists_tables(server_factory):
  server = _server(server_factory)
  with pytest.raises(errors.UnknownTableError, match=r"available tables: \['t'\]") as e:
    reverb_shm.SharedTable.attach(f"{server.name}/nope")
  assert isinstance(e.value, (ValueError, RuntimeError, KeyError))
  assert "nope" in str(e.value)


def test_oversized_item_is_arena_full_error(server_factory):
  st = _server(server_factory, arena_bytes=1 << 20).shared_table("t")
  with pytest.raises(errors.ResourceExhaustedError) as e:
    st.insert({"x": np.zeros((1, 2 << 20), np.uint8)}, 1.0)
  assert isinstance(e.value, IndexError)
  assert st.size == 0 and _arena_used(st) == 0


def test_string_columns_roundtrip(server_factory):
  st = _server(server_factory).shared_table("t")
  st.insert({"s": np.array(["a", "bc"], dtype=object), "x": np.arange(2)}, 1.0)
  got = {s.data[1].item(): s.data[0].item() for s in st.sample(20)}
  assert got == {0: b"a", 1: b"bc"}


# ------------------------------------------------------------------ multi-process
def _writer(name, wid, n, seed_out):
  st = reverb_shm.SharedTable.attach(name)
  rng = np.random.default_rng(wid)
  for start in range(0, n, 50):
    payload = rng.integers(0, 255, size=(50, 64), dtype=np.uint8)
    checks = np.array([zlib.crc32(p.tobytes()) for p in payload], np.uint32)
    keys = (np.uint64(wid) << np.uint64(32)) + np.arange(start, start + 50, dtype=np.uint64)
    st.insert({"payload": payload, "crc": checks}, 1.0, keys=keys)


def _sampler(name, queue):
  st = reverb_shm.SharedTable.attach(name)
  verified = 0
  for _ in range(40):
    batch = st.sample_batch(64, timeout_ms=5000)
    for payload, crc in zip(batch.data[1], batch.data[0]):  # flat; keys sorted: crc, payload
      if zlib.crc32(payload.tobytes()) != crc:
        queue.put(("bad", verified))
        return
      verified += 1
  queue.put(("ok", verified))


def test_four_writer_processes_and_a_verifying_sampler(server_factory):
  server = _server(server_factory)
  name = server.shared_table_name("t")
  ctx = multiprocessing.get_context("fork")
  queue = ctx.Queue()
  procs = [ctx.Process(target=_writer, args=(name, w, 2500, None)) for w in range(4)]
  sampler = ctx.Process(target=_sampler, args=(name, queue))
  for p in procs:
    p.start()
  sampler.start()
  for p in procs + [sampler]:
    p.join(timeout=50)
    assert p.exitcode == 0, f"{p.name} exit code {p.exitcode}"
  assert queue.get(timeout=5) == ("ok", 40 * 64)
  st = server.shared_table("t")
  keys = st.items()["key"]
  assert st.size == 10_000 and len(set(keys.tolist())) == 10_000
  expected = {(w << 32) + i for w in range(4) for i in range(2500)}
  assert set(keys.tolist()) == expected
  batch = st.sample_batch(1000)
  crc = np.array([zlib.crc32(p.tobytes()) for p in batch.data[1]], np.uint32)
  np.testing.assert_array_equal(crc, batch.data[0])
  st.check()


def test_insert_descriptors_reports_partial_progress_at_the_deadline(server_factory):
  st = _server(server_factory, reverb_shm.Table.queue("q", 3)).shared_table("q")
  chunk = chunks.alloc_chunk(st.segment, np.int64, (), 5)
  chunk.write_rows(np.arange(5))
  blob, offs = chunks.join_descriptors(
      [chunks.encode_descriptor([([(chunk.off, i, 1)], True)]) for i in range(5)])
  with pytest.raises(errors.DeadlineExceededError, match="3 of 5 items inserted") as e:
    st.insert_descriptors(np.arange(10, 15, dtype=np.uint64), 1.0, blob, offs, timeout_ms=20)
  assert e.value.inserted == 3
  assert st.items()["key"].tolist() == [10, 11, 12]   # the first three, in order
  # A caller-held absolute deadline (0: do not wait) instead of timeout_ms.
  st.sample_records(1)[1].release()
  with pytest.raises(errors.DeadlineExceededError) as e:
    st.insert_descriptors([13, 14], [1.0, 1.0], blob[offs[3]:], offs[3:] - offs[3],
                          deadline_ns=0)
  assert e.value.inserted == 1 and st.items()["key"].tolist() == [11, 12, 13]
  chunk.release()


def test_zero_element_numeric_columns_sample_gather_and_checkpoint(server_factory, tmp_path):
  """Shape (0, 3) rows hold no bytes but are numeric: every read path returns them as empty
  arrays of the right dtype/shape (the core used to mistake row_bytes 0 for an object column),
  and a checkpoint restores them."""
  from reverb_shm import checkpointers  # pylint: disable=import-outside-toplevel
  def table():
    return reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10, rate_limiters.MinSize(1))
  server = server_factory([table()], checkpointer=checkpointers.DefaultCheckpointer(tmp_path))
  st = server.shared_table("t")
  st.insert({"a": np.zeros((2, 0, 3), np.float32), "b": np.array([7, 8])}, [1.0, 1.0])
  batch = st.sample_batch(2)
  assert batch.data[0].shape == (2, 0, 3) and batch.data[0].dtype == np.float32
  assert set(batch.data[1].tolist()) <= {7, 8}     # a table without signature: flat columns
  out = [np.empty((2, 0, 3), np.float32), np.empty(2, np.int64)]
  st.sample_batch(2, out=out)
  assert set(out[1].tolist()) <= {7, 8}
  client = server.localhost_client()
  sample = next(client.sample("t", 1, emit_timesteps=False))
  assert sample.data[0].shape == (0, 3) and int(sample.data[1]) in (7, 8)
  with client.trajectory_writer(2) as writer:
    for i in range(2):
      writer.append({"a": np.zeros((0,), np.int32), "b": np.int64(i)})
    writer.create_item("t", 1.0, {"a": writer.history["a"][-2:], "b": writer.history["b"][-2:]})
  path = client.checkpoint()
  restored = server_factory([table()], checkpointer=checkpointers.DefaultCheckpointer(tmp_path))
  assert path
  seen = {(s.data[0].shape, s.data[0].dtype.str, str(s.data[1].tolist()))
          for s in restored.shared_table("t").sample(60)}    # P(an item unseen) ~ 1e-10
  assert seen == {((0, 3), "<f4", "7"), ((0, 3), "<f4", "8"), ((2, 0), "<i4", "[0, 1]")}
