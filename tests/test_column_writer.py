"""chunks.ColumnWriter (the insert hot path): rows land in fresh chunks with the right header,
pins hold the chunks until released, and a full arena rolls back every chunk of the call."""
import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import chunks
from reverb_shm._internal._lib import ffi

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def seg(server_factory):
  table = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100,
                           rate_limiters.MinSize(1))
  return server_factory([table], arena_bytes=1 << 20).segment


def test_writes_rows_and_headers_of_every_column(seg):
  writer = chunks.ColumnWriter([(np.dtype(np.float32), (2,)), (np.dtype(np.int64), ())])
  obs = np.arange(6, dtype=np.float32).reshape(3, 2)
  act = np.array([7, 8, 9], np.int64)
  offs, pins = writer.write(seg, [obs, act], 3, episode_id=42)
  for off, expected in zip(offs, (obs, act)):
    h = ffi.cast("rs_chunk_hdr *", seg.address + off)
    assert (h.rows, h.capacity, h.episode_id) == (3, 3, 42)
    meta = chunks._ChunkMeta(seg, off)
    view = np.frombuffer(seg.buf, meta.dtype, expected.size, meta.data_address - seg.address)
    np.testing.assert_array_equal(view.reshape(expected.shape), expected)
  used = seg.info()["arena_used"]
  pins.release()
  assert seg.info()["arena_used"] < used   # unreferenced chunks are freed with their pins


def test_full_arena_releases_the_chunks_already_written(seg):
  writer = chunks.ColumnWriter([(np.dtype(np.uint8), (1000,)), (np.dtype(np.uint8), (1000,))])
  used = seg.info()["arena_used"]
  rows = np.zeros((900, 1000), np.uint8)   # the first column fits in 1 MiB, the second not
  with pytest.raises(errors.ResourceExhaustedError):
    writer.write(seg, [rows, rows], 900)
  assert seg.info()["arena_used"] == used
  seg.check()


def test_rejects_object_columns():
  with pytest.raises(ValueError, match="numeric"):
    chunks.ColumnWriter([(np.dtype(object), ())])
