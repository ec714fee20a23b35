"""Chunks, pins and item descriptors: publishing rows, pin lifetime across Server.stop() and
re-registration, descriptor encoding and batched decoding."""
import gc
import multiprocessing

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import chunks, shm
from reverb_shm._internal._lib import ffi
from reverb_shm.shared_table import SharedTable

pytestmark = pytest.mark.timeout(60)


def _table(name="t"):
  return reverb_shm.Table(name, selectors.Uniform(), selectors.Fifo(), 1000,
                          rate_limiters.MinSize(1))


@pytest.fixture
def server(server_factory):
  return server_factory([_table()])


# ---- writing

def _published_rows(seg, chunk_off: int) -> int:
  """rows published in the chunk header in shared memory (what readers see)."""
  return int(ffi.cast("rs_chunk_hdr *", seg.address + chunk_off).rows)


def test_publish_makes_written_rows_visible_in_order(server):
  seg = server.segment
  chunk = chunks.alloc_chunk(seg, np.int32, (2,), 4)
  chunk.data[0] = [1, 2]
  chunk.publish(1)
  assert chunk.rows == 1 and _published_rows(seg, chunk.off) == 1
  chunk.append([3, 4])
  chunk.write_rows(np.array([[5, 6], [7, 8]], np.int32))
  assert chunk.rows == 4
  np.testing.assert_array_equal(chunk.data, [[1, 2], [3, 4], [5, 6], [7, 8]])
  with pytest.raises(ValueError, match="already published"):
    chunk.publish(2)
  chunk.release()


def test_append_and_write_rows_reject_bad_rows_without_writing(server):
  chunk = chunks.alloc_chunk(server.segment, np.float32, (3,), 2)
  with pytest.raises(ValueError, match="shape"):
    chunk.append(np.zeros(4))
  with pytest.raises(ValueError, match="shape"):
    chunk.append(1.0)             # would broadcast; rows must have the element shape
  with pytest.raises(ValueError, match="dtype"):
    chunk.write_rows(np.zeros((1, 3), np.float64))
  with pytest.raises(ValueError, match="cannot write 3"):
    chunk.write_rows(np.zeros((3, 3), np.float32))
  assert chunk.rows == 0 and not chunk.data.any()
  chunk.append([1, 2, 3])         # cast to the chunk dtype
  chunk.append(np.ones(3))
  with pytest.raises(ValueError, match="cannot write 1"):
    chunk.append(np.ones(3))
  np.testing.assert_array_equal(chunk.data, [[1, 2, 3], [1, 1, 1]])
  chunk.release()
  with pytest.raises(ValueError, match="released"):
    chunk.append(np.ones(3))


# ---- pins across Server.stop() and re-registration

def test_pins_and_chunks_taken_before_stop_release_quietly(server):
  st = server.shared_table("t")
  st.insert({"x": np.arange(4.0)[:, None]}, 1.0)
  _, pins = st.sample_records(2)
  chunk = chunks.alloc_chunk(server.segment, np.float32, (2,), 4)
  chunk.append(np.ones(2, np.float32))
  server.stop()                   # unregisters this process: every pin above is gone
  pins.release()                  # used to raise "pin ... not held"
  chunk.shrink()
  with pytest.raises(errors.TableClosedError, match="registration ended"):
    chunk.publish(1)              # its rows may have been freed: never write them again
  chunk.release()
  assert pins.released and chunk.released
  with pytest.raises(errors.TableClosedError):
    st.sample_records(1)          # no silent re-registration on a closed segment


def test_stale_pins_never_release_pins_of_a_newer_registration(server):
  old = server.shared_table("t")
  keys = old.insert({"x": np.arange(4.0)[:, None]}, 1.0)
  _, old_pins = old.sample_records(1)
  old_slot = old.segment.slot
  old.segment.close()             # unregisters (drops old_pins) but keeps the server running
  new_seg = shm.Segment.attach(server.name)
  try:
    assert new_seg is not old.segment
    new = SharedTable(new_seg, 0)
    recs, new_pins = new.sample_records(1)
    assert new_seg.slot == old_slot    # the slot number was handed out again
    new.delete(keys)
    assert new_seg.info()["num_descs"] == 1  # only new_pins keeps the sampled item's descriptor
    old_pins.release()            # stale: must leave the new registration's pins alone
    assert new_seg.info()["num_descs"] == 1
    new_pins.release()
    assert new_seg.info()["num_descs"] == 0 and len(recs) == 1
    new_seg.check()
  finally:
    new_seg.close()


def _release_in_child(pins, chunk, conn):
  pins.release()                  # the parent's pins: a no-op in the child
  chunk.release()
  conn.send((pins.released, chunk.released))


def test_fork_child_never_releases_the_parents_pins(server):
  st = server.shared_table("t")
  st.insert({"x": np.arange(2.0)[:, None]}, 1.0)
  _, pins = st.sample_records(1)
  chunk = chunks.alloc_chunk(server.segment, np.float32, (), 1)
  chunk.append(1.0)
  ctx = multiprocessing.get_context("fork")
  parent_end, child_end = ctx.Pipe()
  child = ctx.Process(target=_release_in_child, args=(pins, chunk, child_end))
  child.start()
  assert parent_end.poll(30) and parent_end.recv() == (True, True)
  child.join(30)
  assert child.exitcode == 0
  st.reset()
  assert server.segment.info()["num_descs"] == 1   # still pinned by the parent
  pins.release()                  # raises if the child had dropped them
  chunk.release()
  assert server.segment.info()["num_descs"] == 0 and server.segment.info()["num_chunks"] == 0


def test_views_sampled_before_stop_stay_readable_and_die_quietly(server):
  st = server.shared_table("t")
  st.insert({"x": np.arange(6.0).reshape(3, 2)}, 1.0)
  views = [s.data[0] for s in st.sample(3)]
  server.stop()
  assert len(views) == 3 and all(v.tolist() in ([0, 1], [2, 3], [4, 5]) for v in views)
  del views
  gc.collect()                    # the Pins finaliser must not fail (nothing to assert on)


# ---- descriptors

def test_encoded_descriptor_round_trips_through_the_c_core(server):
  st = server.shared_table("t")
  a = chunks.alloc_chunk(server.segment, np.float32, (2,), 4)
  a.write_rows(np.arange(8, dtype=np.float32).reshape(4, 2))
  b = chunks.alloc_chunk(server.segment, np.float32, (2,), 3)
  b.write_rows(-np.arange(6, dtype=np.float32).reshape(3, 2))
  c = chunks.alloc_chunk(server.segment, np.int64, (), 4)
  c.write_rows(np.arange(4) * 10)
  item = [([(a.off, 1, 3), (b.off, 0, 2)], False), ([(c.off, 2, 1)], True)]
  blob = chunks.encode_descriptor(item)
  assert len(blob) == (chunks.DESC_HDR.itemsize + 2 * chunks.DESC_COL.itemsize
                       + 3 * chunks.DESC_SLICE.itemsize)
  st.insert_descriptors([7], [1.0], *chunks.join_descriptors([blob]))
  decoded = chunks.item_columns(server.segment, int(st.items()["desc_off"][0]))
  assert [([tuple(s) for s in slices.tolist()], squeeze) for slices, squeeze in decoded] == item
  (sample,) = st.sample(1)
  x, y = sample.data
  np.testing.assert_array_equal(x, [[2, 3], [4, 5], [6, 7], [0, -1], [-2, -3]])
  assert y.shape == () and y == 20
  for chunk in (a, b, c):
    chunk.release()


def test_join_descriptors_offsets():
  blob, offs = chunks.join_descriptors([b"ab", b"", b"cde"])
  assert blob == b"abcde" and offs.dtype == np.uint64 and offs.tolist() == [0, 2, 2, 5]
  blob, offs = chunks.join_descriptors([])
  assert blob == b"" and offs.tolist() == [0]


def test_read_items_decodes_mixed_batches_like_read_item(server_factory):
  table = reverb_shm.Table("f", selectors.Fifo(), selectors.Fifo(), 100, rate_limiters.MinSize(1),
                           max_times_sampled=1)
  st = server_factory([table]).shared_table("f")
  seg = st.segment
  a = chunks.alloc_chunk(seg, np.float32, (2,), 6)
  a.write_rows(np.arange(12, dtype=np.float32).reshape(6, 2))
  b = chunks.alloc_chunk(seg, np.int8, (), 6)
  b.write_rows(np.arange(6, dtype=np.int8))
  s = chunks.object_chunk(seg, ["x", "yz", "w"])
  items = [
      [([(a.off, 0, 2)], False), ([(b.off, 1, 1)], True)],     # single slices, 2 columns
      [([(a.off, 3, 1)], True), ([(b.off, 4, 2)], False)],
      [([(b.off, 5, 1)], True)],                                # 1 column
      [([(a.off, 1, 1), (a.off, 4, 2)], False), ([(b.off, 0, 1)], True)],  # multi-slice
      [([(s.off, 1, 1)], True), ([(a.off, 5, 1)], True)],       # object column
      [([(s.off, 0, 3)], False), ([(b.off, 2, 1)], False)],
  ]
  blob, offs = chunks.join_descriptors([chunks.encode_descriptor(item) for item in items])
  st.insert_descriptors(np.arange(len(items), dtype=np.uint64), 1.0, blob, offs)
  recs, pins = st.sample_records(len(items))
  assert recs["key"].tolist() == list(range(len(items)))
  batch = chunks.read_items(seg, recs["desc_off"], pins)
  single = [chunks.read_item(seg, int(d), pins) for d in recs["desc_off"]]
  assert [len(cols) for cols in batch] == [2, 2, 1, 2, 2, 2]
  for got, want in zip(batch, single):
    for x, y in zip(got, want):
      assert x.dtype == y.dtype and x.shape == y.shape
      np.testing.assert_array_equal(x, y)
  np.testing.assert_array_equal(batch[0][0], [[0, 1], [2, 3]])
  assert batch[0][1].shape == () and batch[0][1] == 1 and isinstance(batch[0][1], np.ndarray)
  np.testing.assert_array_equal(batch[1][1], [4, 5])
  np.testing.assert_array_equal(batch[3][0], [[2, 3], [8, 9], [10, 11]])
  assert batch[4][0] == "yz" and batch[5][0].tolist() == ["x", "yz", "w"]
  for cols in batch[:3]:  # single-slice numeric columns are read-only views of the chunks
    for x in cols:
      assert not x.flags.writeable and (np.shares_memory(x, a.data) or np.shares_memory(x, b.data))
  assert not np.shares_memory(batch[3][0], a.data)   # multi-slice: a copy
  for chunk in (a, b, s):
    chunk.release()
  del single, got, want, x, y, cols, pins
  gc.collect()
  assert st.size == 0 and seg.info()["num_chunks"] == 3   # the views pin the sampled items
  del batch
  gc.collect()
  assert seg.info()["num_chunks"] == 0
