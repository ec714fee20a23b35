"""Metadata per item: shared descriptor blocks, compact table structures."""
import gc

import numpy as np
import pytest

import reverb_shm
from reverb_shm import checkpointers, rate_limiters, selectors
from reverb_shm._internal import chunks
from reverb_shm._internal._lib import ffi, lib

pytestmark = pytest.mark.timeout(120)


def _table(name="t", max_size=1000, sampler=None, remover=None):
  return reverb_shm.Table(name, sampler or selectors.Prioritized(0.6), remover or selectors.Fifo(),
                          max_size, rate_limiters.MinSize(1))


def _rows(n, start=0):
  v = np.arange(start, start + n)
  return {"obs": np.repeat(v[:, None], 4, axis=1).astype(np.float32), "act": v.astype(np.int64)}


def _payload_of(seg, pins, desc_off):
  act, obs = chunks.read_item(seg, int(desc_off), pins)   # columns in flattened (sorted) order
  return float(obs[0]), int(act)


def _pins(seg):
  return chunks.Pins(seg, seg.registration()[1], np.zeros(0, np.uint32))


def test_a_batch_shares_one_descriptor_block_and_every_item_reads_its_own_row(server_factory):
  server = server_factory([_table(max_size=5000)])
  table = server.shared_table("t")
  table.insert(_rows(3000), 1.0)
  info = server.segment.info()
  assert (info["num_descs"], info["num_chunks"]) == (1, 2)
  items = table.items()
  assert len(np.unique(chunks.desc_blocks(items["desc_off"]))) == 1
  pins = _pins(server.segment)
  assert [_payload_of(server.segment, pins, d) for d in items["desc_off"]] == [
      (float(i), i) for i in range(3000)]
  # the batched reader and the per-item reader agree on shifted items
  batch = chunks.read_items(server.segment, items["desc_off"][::7], pins)
  assert [int(cols[0]) for cols in batch] == list(range(0, 3000, 7))
  out = chunks.gather_column(server.segment, items["desc_off"][5:9], 1)
  np.testing.assert_array_equal(out[:, 0], [5, 6, 7, 8])
  for s in table.sample(50):
    act, obs = s.data
    assert obs[0] == act and table.items()["key"][int(act)] == s.info.key
  server.segment.check()


def test_single_item_inserts_share_the_open_chunks_and_their_block(server_factory):
  server = server_factory([_table()])
  table = server.shared_table("t")
  for i in range(5):
    table.insert(_rows(1, i), 1.0)
  # the first insert (Python path, which makes the C plan) has chunks and a block of its own;
  # the plan's inserts append to the chunks it holds open and share one block
  info = server.segment.info()
  assert (info["num_descs"], info["num_chunks"]) == (2, 4)
  pins = _pins(server.segment)
  assert [_payload_of(server.segment, pins, d) for d in table.items()["desc_off"]] == [
      (float(i), i) for i in range(5)]
  server.segment.check()


def test_shared_block_lives_until_its_last_item_and_pin_go(server_factory):
  server = server_factory([_table(max_size=100)])
  table = server.shared_table("t")
  keys = table.insert(_rows(10), 1.0)
  seg = server.segment
  sample = table.sample(1)[0]
  sampled = int(sample.info.key)
  row = int(sample.data[0])
  table.delete(keys)
  assert table.size == 0 and seg.info()["num_descs"] == 1   # the sample's pin holds the block
  seg.check()
  assert keys.tolist()[row] == sampled and int(sample.data[0]) == row and sample.data[1][0] == row
  del sample
  gc.collect()
  info = seg.info()
  assert (info["num_descs"], info["num_chunks"], info["arena_used"]) == (0, 0, 0)


def test_fifo_removal_of_a_shared_batch_keeps_the_rest_readable(server_factory):
  server = server_factory([_table(max_size=250)])
  table = server.shared_table("t")
  table.insert(_rows(200), 1.0)
  table.insert(_rows(200, 200), 1.0)        # evicts 150 items of the first batch
  items = table.items()
  assert table.size == 250 and server.segment.info()["num_descs"] == 2
  pins = _pins(server.segment)
  assert [_payload_of(server.segment, pins, d)[1] for d in items["desc_off"]] == list(range(150, 400))
  server.segment.check()


def test_trajectory_windows_in_one_chunk_share_a_block(server_factory):
  server = server_factory([_table(sampler=selectors.Uniform())])
  client = server.localhost_client()
  with client.trajectory_writer(num_keep_alive_refs=2) as writer:
    for step in range(40):
      writer.append({"obs": np.full(2, step, np.float32)})
      if step >= 1:
        writer.create_item("t", 1.0, {"obs": writer.history["obs"][-2:]})
    writer.end_episode()
  table = server.shared_table("t")
  items = table.items()
  blocks = len(np.unique(chunks.desc_blocks(items["desc_off"])))
  assert len(items) == 39 and blocks < len(items)
  assert server.segment.info()["num_descs"] == blocks
  pins = _pins(server.segment)
  for i, d in enumerate(items["desc_off"]):
    (obs,) = chunks.read_item(server.segment, int(d), pins)
    np.testing.assert_array_equal(obs[:, 0], [i, i + 1])
  server.segment.check()


@pytest.mark.parametrize("sampler", [selectors.MinHeap(), selectors.Prioritized(0.8)])
def test_checkpoint_round_trip_of_shared_blocks_restores_them_shared(server_factory, tmp_path,
                                                                      sampler):
  tables = lambda: [_table(max_size=500, sampler=sampler)]  # noqa: E731
  server = server_factory(tables(), checkpointer=checkpointers.DefaultCheckpointer(tmp_path))
  table = server.shared_table("t")
  keys = table.insert(_rows(300), np.linspace(0.5, 3.0, 300))
  table.update_priorities(keys[:2], [9.0, 0.25])
  before = table.items()
  pins = _pins(server.segment)
  payload = [_payload_of(server.segment, pins, d) for d in before["desc_off"]]
  del pins
  server.localhost_client().checkpoint()
  server.stop()
  restored = server_factory(tables(), checkpointer=checkpointers.DefaultCheckpointer(tmp_path))
  after = restored.shared_table("t").items()
  fields = ["key", "priority", "times_sampled", "insert_seq", "update_seq", "inserted_at_ns"]
  np.testing.assert_array_equal(before[fields], after[fields])
  pins = _pins(restored.segment)
  assert [_payload_of(restored.segment, pins, d) for d in after["desc_off"]] == payload
  assert restored.segment.info()["num_descs"] == 1
  restored.segment.check()


def _region_bytes(max_size, sampler, remover):
  cfg = ffi.new("rs_table_config *")
  cfg.name = b"t"
  cfg.max_size = max_size
  cfg.sampler_kind, cfg.remover_kind = sampler, remover
  cfg.sampler_exponent = cfg.remover_exponent = 0.6
  cfg.samples_per_insert = 1.0
  cfg.min_size_to_sample = 1
  cfg.min_diff, cfg.max_diff = -1e300, 1e300
  return lib.rs_segment_size(cfg, 1, 4, 16, 1 << 20)


@pytest.mark.parametrize("max_size", [140_000, 200_000, 1_000_000])
def test_prioritized_fifo_table_structures_stay_within_128_bytes_per_item(max_size):
  per_item = (_region_bytes(max_size, lib.RS_SEL_PRIORITIZED, lib.RS_SEL_FIFO)
              - _region_bytes(1000, lib.RS_SEL_PRIORITIZED, lib.RS_SEL_FIFO)) / (max_size - 1000)
  # record 64 + key index 20 + episode map 16 + dense 4 + sum tree 16 (one leaf per record)
  assert per_item == pytest.approx(120, abs=0.2)
  # the heap side array (tie-break counter + positions) exists only with a heap selector
  heap = (_region_bytes(max_size, lib.RS_SEL_MINHEAP, lib.RS_SEL_FIFO)
          - _region_bytes(1000, lib.RS_SEL_MINHEAP, lib.RS_SEL_FIFO)) / (max_size - 1000)
  uniform = (_region_bytes(max_size, lib.RS_SEL_UNIFORM, lib.RS_SEL_FIFO)
             - _region_bytes(1000, lib.RS_SEL_UNIFORM, lib.RS_SEL_FIFO)) / (max_size - 1000)
  assert heap - uniform == pytest.approx(16 + 4, abs=0.1)   # rs_heap_aux + the heap array


def _attach_and_measure(name, conn):
  def rss():
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * 4096
  before = rss()
  table = reverb_shm.SharedTable.attach(name)
  size = table.size
  attached = rss()
  table.sample_batch(64)
  conn.send((size, attached - before, rss() - attached))


def test_an_attaching_process_pays_only_for_the_pages_it_touches(server_factory):
  """A process attaching to a 256 MiB segment holding 100k items maps all of it, but its RSS
  grows by what it reads (header, its slot, the table's stats), not by the segment size."""
  import multiprocessing  # pylint: disable=import-outside-toplevel
  server = server_factory([_table(max_size=100_000)], arena_bytes=256 << 20)
  st = server.shared_table("t")
  for s in range(0, 100_000, 20_000):
    st.insert(_rows(20_000, s), np.ones(20_000))
  total = server._segment.info()["total_size"]   # pylint: disable=protected-access
  ctx = multiprocessing.get_context("spawn")
  parent, child = ctx.Pipe()
  proc = ctx.Process(target=_attach_and_measure, args=(server.shared_table_name("t"), child))
  proc.start()
  try:
    assert parent.poll(90), "the attaching process did not answer in 90 s"
    size, attach, sample = parent.recv()
  finally:
    proc.join(30)
    if proc.is_alive():
      proc.kill()
  assert size == 100_000 and total > 256 << 20
  assert attach < 4 << 20, f"attaching grew RSS by {attach} bytes of a {total}-byte segment"
  # 64 random items: a record, tree and data pages each, far below the segment's size
  assert sample < 16 << 20, f"sampling 64 items grew RSS by {sample} bytes"
