"""Checkpoints: round trips of every item field and payload byte, chunk sharing, corrupted and
torn checkpoints, kill -9 while checkpointing, config mismatch policies, retention, CLI."""
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import reverb_shm
from reverb_shm import checkpointers, cli, rate_limiters, selectors
from reverb_shm._checkpoint import io as checkpoint_io
from reverb_shm._internal import chunks

from conftest import run_in_private_shm

pytestmark = pytest.mark.timeout(120)

_FIELDS = ["key", "priority", "times_sampled", "insert_seq", "update_seq", "inserted_at_ns"]
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tables(prio_max_size=100, limiter=None):
  return [
      reverb_shm.Table("prio", selectors.Prioritized(0.8), selectors.Fifo(), prio_max_size,
                       limiter or rate_limiters.MinSize(1)),
      reverb_shm.Table.queue("queue", 50),
      reverb_shm.Table("thrice", selectors.Fifo(), selectors.Fifo(), 100,
                       rate_limiters.MinSize(1), max_times_sampled=3),
  ]


def _fill(server):
  """Items in all three tables; prio and thrice share the writer's chunks."""
  client = server.localhost_client()
  with client.trajectory_writer(num_keep_alive_refs=4) as writer:
    for step in range(12):
      writer.append({"obs": np.full((3, 2), step, np.float32), "act": np.int64(step * 7)})
      if step >= 1:
        traj = {"obs": writer.history["obs"][-2:], "act": writer.history["act"][-1]}
        writer.create_item("prio", 0.25 + step, traj)
        writer.create_item("thrice", 1.0, traj)
    writer.end_episode()
  server.shared_table("queue").insert([np.arange(10, dtype=np.int32).reshape(5, 2)], 1.0)
  # custom priorities, an update and partial sampling
  prio = server.shared_table("prio")
  keys = prio.items()["key"]
  prio.update_priorities(keys[:3], [9.0, 0.0, 4.5])
  server.shared_table("thrice").sample(7)
  server.shared_table("queue").sample(2)


def _payloads(seg, items):
  pins = chunks.Pins(seg, seg.registration()[1], np.zeros(0, np.uint32))
  return [[np.array(col) for col in chunks.read_item(seg, int(d), pins)] for d in items["desc_off"]]


def _state(server):
  seg = server.segment
  out = {}
  for name in ("prio", "queue", "thrice"):
    table = server.shared_table(name)
    items = table.items()
    stats = table.stats()
    out[name] = (items[_FIELDS].copy(), _payloads(seg, items),
                 {k: stats[k] for k in ("size", "inserts", "samples", "deletes", "num_episodes",
                                        "num_deleted_episodes", "num_unique_samples")})
  return out


def _assert_same_state(a, b):
  for name in a:
    items_a, payload_a, counters_a = a[name]
    items_b, payload_b, counters_b = b[name]
    np.testing.assert_array_equal(items_a, items_b, err_msg=name)
    assert counters_a == counters_b, name
    assert len(payload_a) == len(payload_b)
    for cols_a, cols_b in zip(payload_a, payload_b):
      assert len(cols_a) == len(cols_b)
      for x, y in zip(cols_a, cols_b):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def _saved_server(server_factory, root, **kwargs):
  server = server_factory(_tables(), checkpointer=checkpointers.DefaultCheckpointer(root, **kwargs))
  _fill(server)
  return server


def test_round_trip_restores_every_field_payload_and_counter(server_factory, tmp_path):
  server = _saved_server(server_factory, tmp_path)
  before = _state(server)
  chunks_before = server.segment.info()["num_chunks"]
  path = server.localhost_client().checkpoint()
  assert os.path.dirname(path) == str(tmp_path) and os.path.isfile(os.path.join(path, "MANIFEST"))
  server.stop()

  restored = server_factory(_tables(), checkpointer=checkpointers.DefaultCheckpointer(tmp_path))
  _assert_same_state(before, _state(restored))
  restored.segment.check()
  # chunks shared by 'prio' and 'thrice' are restored once
  assert restored.segment.info()["num_chunks"] == chunks_before
  # Fifo order continues where it stopped; max_times_sampled counts on from the saved value
  queue_keys = before["queue"][0]["key"].tolist()
  assert [s.info.key for s in restored.shared_table("queue").sample(3)] == queue_keys
  thrice = restored.shared_table("thrice")
  first = before["thrice"][0][0]
  sample = thrice.sample(1)[0]
  assert (sample.info.key, sample.info.times_sampled) == (first["key"], first["times_sampled"] + 1)
  # prioritized probabilities come from the restored priorities
  prio_items = before["prio"][0]
  weights = np.where(prio_items["priority"] > 0, prio_items["priority"] ** 0.8, 0.0)
  for s in restored.shared_table("prio").sample(20):
    i = prio_items["key"].tolist().index(s.info.key)
    assert s.info.probability == pytest.approx(weights[i] / weights.sum(), rel=1e-9)
  restored.segment.check()


def test_checkpoint_holds_chunks_of_items_removed_while_it_streams(server_factory, tmp_path):
  server = _saved_server(server_factory, tmp_path)
  seg = server.segment
  descs = seg.info()["num_descs"]
  snap = reverb_shm._internal._lib.ffi.new("rs_snapshot **")
  lib = reverb_shm._internal._lib.lib
  assert lib.rs_snapshot_take(seg.base, seg.slot, snap) == 0
  for name in ("prio", "queue", "thrice"):
    server.shared_table(name).reset()
  assert seg.info()["num_chunks"] > 0   # still held by the snapshot
  seg.check()
  assert lib.rs_snapshot_release(seg.base, seg.slot, snap[0]) == 0
  assert seg.info()["num_chunks"] == 0 and seg.info()["num_descs"] == 0 < descs
  seg.check()


def _corrupt_newest_and_expect_older(server_factory, tmp_path, damage, reason):
  server = _saved_server(server_factory, tmp_path, keep_latest=2)
  client = server.localhost_client()
  good = _state(server)
  older = client.checkpoint()
  server.shared_table("queue").insert([np.zeros((1, 2), np.int32)], 1.0)
  newest = client.checkpoint()
  server.stop()
  damage(newest)
  with pytest.warns(RuntimeWarning, match=reason):
    manifest = checkpointers.DefaultCheckpointer(tmp_path).load_latest()
  assert manifest.path == older
  restored = server_factory(_tables(), checkpointer=checkpointers.DefaultCheckpointer(tmp_path))
  _assert_same_state(good, _state(restored))


def _flip_byte(path):
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    b = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([b[0] ^ 0x40]))


def test_flipped_byte_is_detected_and_the_previous_checkpoint_loads(server_factory, tmp_path):
  _corrupt_newest_and_expect_older(server_factory, tmp_path,
                                   lambda p: _flip_byte(os.path.join(p, "chunks.bin")),
                                   "chunks.bin checksum mismatch")


def test_missing_file_is_detected_and_the_previous_checkpoint_loads(server_factory, tmp_path):
  _corrupt_newest_and_expect_older(server_factory, tmp_path,
                                   lambda p: os.unlink(os.path.join(p, "table-1.items")),
                                   "table-1.items is missing")


def test_damaged_manifest_is_detected_and_the_previous_checkpoint_loads(server_factory, tmp_path):
  def damage(p):
    _flip_byte(os.path.join(p, "MANIFEST"))
  _corrupt_newest_and_expect_older(server_factory, tmp_path, damage, "MANIFEST")


def _rewrite_manifest_body(path, change):
  """Replaces the MANIFEST body with change(body), re-hashed: a well-formed checksum over a body
  that is not what a checkpoint writes."""
  import hashlib   # pylint: disable=import-outside-toplevel
  import msgpack   # pylint: disable=import-outside-toplevel
  with open(os.path.join(path, "MANIFEST"), "rb") as f:
    outer = msgpack.unpackb(f.read(), raw=False)
  body = msgpack.unpackb(outer["body"], raw=False, strict_map_key=False)
  packed = msgpack.packb(change(body), use_bin_type=True)
  with open(os.path.join(path, "MANIFEST"), "wb") as f:
    f.write(msgpack.packb({"body": packed, "sha256": hashlib.sha256(packed).hexdigest()},
                          use_bin_type=True))


def _without(key):
  def change(body):
    body.pop(key)
    return body
  return change


def _table_field(key, value):
  def change(body):
    body["tables"][0][key] = value
    return body
  return change


@pytest.mark.parametrize("change,reason", [
    (_without("files"), r"malformed MANIFEST: 'files' is None, expected a dict"),
    (lambda body: list(body), r"MANIFEST body is a list, expected a map"),
    (_table_field("num_items", "11"), r"table 0: 'num_items' is '11', expected a int"),
    (_table_field("items", "../elsewhere"), r"table 0: items file '../elsewhere' is not among"),
    (lambda body: {**body, "files": {**body["files"], "../x": {"size": 1, "sha256": "0"}}},
     r"file entry '../x' is not a file name in the checkpoint directory"),
])
def test_malformed_manifest_with_a_valid_checksum_is_skipped(server_factory, tmp_path, change,
                                                             reason):
  _corrupt_newest_and_expect_older(server_factory, tmp_path,
                                   lambda p: _rewrite_manifest_body(p, change), reason)


def test_kill_9_while_checkpointing_leaves_the_last_good_checkpoint(server_factory, tmp_path):
  """A subprocess checkpoints in a loop and is killed at random points, several times."""
  server = server_factory(_tables(), checkpointer=checkpointers.DefaultCheckpointer(tmp_path),
                          arena_bytes=128 << 20)
  _fill(server)
  big = server.shared_table("queue")
  big.insert([np.random.default_rng(0).random((40, 65536))], 1.0)   # 20 MiB, slow enough to hit
  good = _state(server)
  server.localhost_client().checkpoint()
  descs, used = server.segment.info()["num_descs"], server.segment.info()["arena_used"]
  code = textwrap.dedent(f"""
      import sys, reverb_shm
      client = reverb_shm.Client("shm://{server.name}")
      print("ready", flush=True)
      while True:
        client.checkpoint()
  """)
  rng = random.Random(5)
  for _ in range(4):
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=_REPO)
    try:
      assert proc.stdout.readline().strip() == "ready"
      time.sleep(rng.uniform(0.05, 0.6))
    finally:
      proc.send_signal(signal.SIGKILL)
      proc.wait(timeout=10)
  reaped = reverb_shm._internal._lib.ffi.new("uint32_t *")
  assert reverb_shm._internal._lib.lib.rs_reap(server.segment.base, reaped) == 0
  server.segment.check()
  info = server.segment.info()
  assert (info["num_descs"], info["arena_used"]) == (descs, used)   # holds reclaimed
  server.stop()
  # only complete checkpoints carry checkpoint names; the newest one loads
  restored = server_factory(_tables(), checkpointer=checkpointers.DefaultCheckpointer(tmp_path),
                            arena_bytes=128 << 20)
  _assert_same_state(good, _state(restored))


def test_config_mismatch_error_names_every_differing_field(server_factory, tmp_path):
  server = _saved_server(server_factory, tmp_path)
  server.localhost_client().checkpoint()
  server.stop()
  changed = _tables(prio_max_size=200, limiter=rate_limiters.MinSize(5))
  with pytest.raises(ValueError, match=r"table 'prio': max_size: code 200 vs checkpoint 100; "
                                       r"rate_limiter: code \[1.0, 5"):
    server_factory(changed, checkpointer=checkpointers.DefaultCheckpointer(tmp_path))


@pytest.mark.parametrize("policy,max_size,min_size", [("prefer_code", 200, 5),
                                                      ("prefer_checkpoint", 100, 1)])
def test_config_mismatch_policies_choose_the_effective_config(server_factory, tmp_path, policy,
                                                              max_size, min_size):
  server = _saved_server(server_factory, tmp_path)
  before = _state(server)
  server.localhost_client().checkpoint()
  server.stop()
  restored = server_factory(_tables(prio_max_size=200, limiter=rate_limiters.MinSize(5)),
                            checkpointer=checkpointers.DefaultCheckpointer(tmp_path),
                            on_config_mismatch=policy)
  info = restored.localhost_client().server_info()["prio"]
  assert (info.max_size, info.rate_limiter_info.min_size_to_sample) == (max_size, min_size)
  _assert_same_state(before, _state(restored))


def test_prefer_code_with_a_table_too_small_for_the_items_fails(server_factory, tmp_path):
  server = _saved_server(server_factory, tmp_path)
  server.localhost_client().checkpoint()
  server.stop()
  with pytest.raises(ValueError, match="cannot restore 11 items, max_size is 5"):
    server_factory(_tables(prio_max_size=5),
                   checkpointer=checkpointers.DefaultCheckpointer(tmp_path),
                   on_config_mismatch="prefer_code")


def _signed(signature):
  return [reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100,
                           rate_limiters.MinSize(1), signature=signature)]


@pytest.mark.parametrize("items", [1, 0])
def test_prefer_code_refuses_a_signature_the_checkpointed_items_do_not_match(
    server_factory, tmp_path, items):
  saved = {"x": reverb_shm.TensorSpec([4], np.float32)}
  changed = {"x": reverb_shm.TensorSpec([7, 3], np.int64)}
  server = server_factory(_signed(saved), checkpointer=checkpointers.DefaultCheckpointer(tmp_path))
  for _ in range(items):
    server.localhost_client().insert({"x": np.arange(4, dtype=np.float32)}, {"t": 1.0})
  server.localhost_client().checkpoint()
  server.stop()
  make = lambda sig: server_factory(  # noqa: E731
      _signed(sig), checkpointer=checkpointers.DefaultCheckpointer(tmp_path),
      on_config_mismatch="prefer_code")
  if items:
    with pytest.raises(ValueError, match=r"table 't': checkpoint .* holds 1 items written under "
                                         r"signature .*prefer_code"):
      make(changed)
    restored = make(None)   # no signature in code: the items need not match one
    assert restored.shared_table("t").size == 1
    assert restored.localhost_client().server_info()["t"].signature is None
    restored.stop()
  else:   # an empty table takes the code's signature
    restored = make(changed)
    spec = restored.localhost_client().server_info()["t"].signature["x"]   # (a tf spec with TF)
    assert tuple(spec.shape) == (7, 3)
    assert np.dtype(getattr(spec.dtype, "as_numpy_dtype", spec.dtype)) == np.int64
    restored.stop()


def test_reset_rate_limiter_unblocks_a_restored_table_without_dropping_items(server_factory,
                                                                              tmp_path):
  ratio = rate_limiters.SampleToInsertRatio(2.0, 1, 100.0)
  server = server_factory(_tables(limiter=ratio),
                          checkpointer=checkpointers.DefaultCheckpointer(tmp_path))
  _fill(server)
  prio = server.shared_table("prio")
  stats = prio.stats()
  while prio.can_sample(1):
    prio.sample(1)
  server.localhost_client().checkpoint()
  server.stop()
  restored = server_factory(_tables(limiter=ratio),
                            checkpointer=checkpointers.DefaultCheckpointer(tmp_path))
  table = restored.shared_table("prio")
  assert not table.can_sample(1)   # the saved counters were restored
  restored.reset_rate_limiter("prio")
  s = table.stats()
  assert (s["size"], s["inserts"], s["deletes"]) == (stats["size"], stats["size"], 0)
  diff = s["inserts"] * 2.0 - s["samples"]
  assert s["min_diff"] <= diff <= s["max_diff"] and table.can_sample(1)
  restored.segment.check()


def test_retention_keeps_the_newest_and_never_deletes_foreign_files(server_factory, tmp_path):
  (tmp_path / "notes.txt").write_text("mine")
  (tmp_path / "2020-01-01").mkdir()
  server = _saved_server(server_factory, tmp_path, keep_latest=2)
  client = server.localhost_client()
  paths = [client.checkpoint() for _ in range(3)]
  assert sorted(os.listdir(tmp_path)) == sorted(
      ["notes.txt", "2020-01-01"] + [os.path.basename(p) for p in paths[1:]])


def test_fallback_checkpoint_loads_when_the_root_is_empty(server_factory, tmp_path):
  server = _saved_server(server_factory, tmp_path / "a")
  before = _state(server)
  path = server.localhost_client().checkpoint()
  server.stop()
  restored = server_factory(_tables(), checkpointer=checkpointers.DefaultCheckpointer(
      tmp_path / "b", fallback_checkpoint_path=path))
  _assert_same_state(before, _state(restored))


def test_empty_root_starts_empty_and_group_is_rejected(server_factory, tmp_path):
  server = server_factory(_tables(), checkpointer=checkpointers.DefaultCheckpointer(
      tmp_path, group="g"))
  assert server.shared_table("prio").size == 0
  with pytest.raises(ValueError, match="non-empty group is not supported"):
    server.localhost_client().checkpoint()
  with pytest.raises(ValueError, match="keep_latest"):
    checkpointers.DefaultCheckpointer(tmp_path, keep_latest=0)


def test_default_checkpointer_is_a_temp_dir_and_platform_alias(server_factory):
  server = server_factory(_tables())
  assert isinstance(server.checkpointer, checkpointers.TempDirCheckpointer)
  path = server.localhost_client().checkpoint()
  try:
    assert path.startswith(server.checkpointer.path)
  finally:
    shutil.rmtree(server.checkpointer.path)
  assert (reverb_shm.platform.checkpointers_lib.DefaultCheckpointer
          is reverb_shm.checkpointers.DefaultCheckpointer)


def test_cli_checkpoint_writes_a_loadable_checkpoint(server_factory, tmp_path, capsys):
  server = _saved_server(server_factory, tmp_path)
  assert cli.main(["checkpoint", server.name]) == 0
  path = capsys.readouterr().out.strip().splitlines()[-1]
  manifest = checkpoint_io.read_manifest(path)
  checkpoint_io.verify(manifest)
  assert [t["name"] for t in manifest.tables] == ["prio", "queue", "thrice"]
  assert manifest.table("prio")["num_items"] == 11


_CHECKPOINT_DISK_FULL = textwrap.dedent("""
    import os, numpy as np, reverb_shm
    from reverb_shm import checkpointers, rate_limiters, selectors
    root = "/dev/shm/ck"   # the private tmpfs holds both the segment and the checkpoints
    table = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100,
                             rate_limiters.MinSize(1))
    server = reverb_shm.Server([table], checkpointer=checkpointers.DefaultCheckpointer(root),
                               arena_bytes=40 << 20)
    client = server.localhost_client()
    client.insert({"x": np.ones(2 << 20, np.float64)}, {"t": 1.0})   # 16 MiB
    first = client.checkpoint()
    client.insert({"x": np.full(2 << 20, 2.0)}, {"t": 1.0})
    try:
      client.checkpoint()
      print("second checkpoint written")
    except OSError as e:
      print("OSError", e.errno, e)
    print("left", sorted(os.listdir(root)) == [os.path.basename(first)])
    client.insert({"x": np.zeros(4)}, {"t": 1.0})
    print("size", server.shared_table("t").size)
    server.stop()
""")


def test_checkpoint_onto_a_full_disk_says_where_and_keeps_the_last_one():
  out = run_in_private_shm(_CHECKPOINT_DISK_FULL, size_mib=64)
  assert "OSError 28 [Errno 28] writing a checkpoint of server" in out, out
  assert "under /dev/shm/ck: No space left on device (free space there, or keep fewer " \
         "checkpoints: keep_latest); nothing was kept" in out, out
  assert "left True" in out and "size 3" in out, out
