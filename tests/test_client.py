"""Client (SPEC §5): insert, sample, mutate_priorities, reset, server_info, pickling."""
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm.specs import TensorSpec

from conftest import import_error_without, without_modules

pytestmark = pytest.mark.timeout(60)


def _uniform(name="dist", max_size=100, **kwargs):
  return reverb_shm.Table(name, selectors.Uniform(), selectors.Fifo(), max_size,
                          rate_limiters.MinSize(1), **kwargs)


@pytest.fixture
def client(server_factory):
  server = server_factory([_uniform("dist"), _uniform("dist2"), reverb_shm.Table.queue("queue", 10)])
  return server.localhost_client()


def test_insert_adds_leading_time_dim_of_one(client):
  client.insert([np.ones([3, 3]), np.float32(2.5)], {"dist": 1.0})
  sample = next(client.sample("dist", emit_timesteps=False))
  assert sample.data[0].shape == (1, 3, 3)
  np.testing.assert_array_equal(sample.data[0], np.ones([1, 3, 3]))
  assert sample.data[1].dtype == np.float32 and sample.data[1].tolist() == [2.5]
  assert sample.info.priority == 1.0 and sample.info.table_size == 1
  assert sample.info.times_sampled == 1 and sample.info.probability == 1.0


def test_insert_stores_data_once_for_several_tables(client):
  seg = client._segment()  # pylint: disable=protected-access
  before = seg.info()["num_chunks"]
  client.insert({"a": np.arange(4), "b": np.zeros(2)}, {"dist": 1.0, "dist2": 2.0})
  assert seg.info()["num_chunks"] == before + 2  # one chunk per column, shared by both items
  a = next(client.sample("dist", emit_timesteps=False))
  b = next(client.sample("dist2", emit_timesteps=False))
  assert a.info.key != b.info.key
  assert b.info.priority == 2.0
  for s in (a, b):
    np.testing.assert_array_equal(s.data[0], [np.arange(4)])


def test_insert_with_empty_priorities_raises_value_error(client):
  with pytest.raises(ValueError, match="priorities"):
    client.insert(np.ones(3), {})


def test_insert_into_unknown_table_names_available_tables_and_inserts_nothing(client):
  with pytest.raises(ValueError, match="dist2") as info:
    client.insert(np.ones(3), {"dist": 1.0, "nope": 1.0})
  assert "nope" in str(info.value)
  assert client.server_info()["dist"].current_size == 0


def test_insert_bad_priority_inserts_nothing(client):
  with pytest.raises(ValueError, match="nan"):
    client.insert(np.ones(3), {"dist": 1.0, "dist2": float("nan")})
  assert client.server_info()["dist"].current_size == 0


def test_insert_checks_signature(server_factory):
  sig = {"obs": TensorSpec([2], np.float32)}
  client = server_factory([_uniform("sig", signature=sig)]).localhost_client()
  with pytest.raises(ValueError, match="dtype"):
    client.insert({"obs": np.zeros(2, np.float64)}, {"sig": 1.0})
  with pytest.raises(ValueError, match="shape"):
    client.insert({"obs": np.zeros(3, np.float32)}, {"sig": 1.0})
  client.insert({"obs": np.zeros(2, np.float32)}, {"sig": 1.0})
  sample = next(client.sample("sig", emit_timesteps=False, unpack_as_table_signature=True))
  assert set(sample.data) == {"obs"} and sample.data["obs"].shape == (1, 2)


def test_sample_emit_timesteps_splits_items_into_steps(client):
  writer = client.trajectory_writer(3)
  for i in range(3):
    writer.append({"x": np.float32(i), "y": np.full(2, i, np.int16)})
  writer.create_item("dist", 1.0, {"x": writer.history["x"][:], "y": writer.history["y"][:]})
  writer.flush()
  steps = next(client.sample("dist", emit_timesteps=True))
  assert len(steps) == 3
  assert all(s.info == steps[0].info for s in steps)
  assert [s.data[0].item() for s in steps] == [0.0, 1.0, 2.0]
  assert [s.data[1].tolist() for s in steps] == [[0, 0], [1, 1], [2, 2]]
  whole = next(client.sample("dist", emit_timesteps=False))
  assert whole.data[0].tolist() == [0.0, 1.0, 2.0] and whole.data[1].shape == (3, 2)
  writer.close()


def test_sample_emit_timesteps_rejects_unequal_lengths(client):
  writer = client.trajectory_writer(3)
  for i in range(3):
    writer.append({"x": np.float32(i)})
  writer.create_item("dist", 1.0, [writer.history["x"][:], writer.history["x"][-1]])
  writer.flush()
  with pytest.raises(ValueError, match="timesteps"):
    next(client.sample("dist", emit_timesteps=True))
  writer.close()


def test_sample_generator_yields_num_samples(client):
  client.insert(np.ones(2), {"dist": 1.0})
  assert len(list(client.sample("dist", num_samples=5))) == 5
  assert client.server_info()["dist"].rate_limiter_info.sample_stats.completed == 5


def test_sample_rate_limiter_timeout_names_table_and_counters(client):
  gen = client.sample("dist", rate_limiter_timeout_ms=20)
  with pytest.raises(errors.DeadlineExceededError) as info:
    next(gen)
  message = str(info.value)
  assert "dist" in message and "inserts=0" in message and "samples=0" in message
  assert "min_size_to_sample=1" in message


def test_sample_unknown_table_raises_runtime_error_at_call(client):
  with pytest.raises(RuntimeError, match="dist2"):
    client.sample("nope")


def test_sample_arguments_are_validated(client):
  with pytest.raises(ValueError):
    client.sample("dist", num_samples=0)
  with pytest.raises(ValueError):
    client.sample("dist", rate_limiter_timeout_ms=-5)


def test_mutate_priorities_deletes_before_updates_and_returns_counts(server_factory):
  table = reverb_shm.Table("p", selectors.Prioritized(1.0), selectors.Fifo(), 10,
                           rate_limiters.MinSize(1))
  client = server_factory([table]).localhost_client()
  for _ in range(3):
    client.insert(np.zeros(1), {"p": 1.0})
  keys = [int(k) for k in client.shared_table("p").items()["key"]]
  updated, deleted = client.mutate_priorities("p", updates={keys[0]: 5.0, keys[1]: 2.0},
                                              deletes=[keys[1], 12345])
  assert (updated, deleted) == (1, 1)  # the deleted key is no longer there to update
  items = client.shared_table("p").items()
  assert sorted(items["key"].tolist()) == sorted([keys[0], keys[2]])
  assert dict(zip(items["key"].tolist(), items["priority"].tolist()))[keys[0]] == 5.0
  with pytest.raises(ValueError):
    client.mutate_priorities("p", updates={keys[0]: -1.0, keys[2]: 3.0})
  assert client.shared_table("p").items()["priority"].tolist() == [5.0, 1.0]
  with pytest.raises(RuntimeError, match="'p'"):
    client.mutate_priorities("nope", deletes=[1])


def test_reset_empties_table_and_counters(client):
  client.insert(np.ones(1), {"dist": 1.0})
  next(client.sample("dist"))
  client.reset("dist")
  info = client.server_info()["dist"]
  assert info.current_size == 0
  assert info.rate_limiter_info.insert_stats.completed == 0
  assert info.rate_limiter_info.sample_stats.completed == 0
  with pytest.raises(RuntimeError):
    client.reset("nope")


def test_server_info_reference_example(server_factory):
  table = reverb_shm.Table("ref", selectors.Uniform(), selectors.Fifo(), 10,
                           rate_limiters.RateLimiter(1, 1, -1, 5), max_times_sampled=1)
  client = server_factory([table]).localhost_client()
  client.insert(np.ones(1), {"ref": 1.0})
  client.insert(np.ones(1), {"ref": 1.0})
  next(client.sample("ref"))
  info = client.server_info()["ref"]
  assert info.name == "ref" and info.max_size == 10 and info.max_times_sampled == 1
  assert info.current_size == 1
  assert info.num_episodes == 1
  assert info.num_deleted_episodes == 1
  assert info.num_unique_samples == 1
  assert info.rate_limiter_info.insert_stats.completed == 2
  assert info.rate_limiter_info.sample_stats.completed == 1
  assert info.rate_limiter_info.samples_per_insert == 1
  assert info.rate_limiter_info.min_diff == -1 and info.rate_limiter_info.max_diff == 5


def test_server_info_lists_every_table(client):
  assert sorted(client.server_info(1)) == ["dist", "dist2", "queue"]


def test_server_info_times_out_when_no_server():
  client = reverb_shm.Client("shm://no_such_server_p2")
  with pytest.raises(errors.DeadlineExceededError, match="Deadline Exceeded"):
    client.server_info(timeout=0.1)


def test_client_pickles_as_its_address(client):
  clone = pickle.loads(pickle.dumps(client))
  assert clone.server_address == client.server_address
  client.insert(np.ones(1), {"dist": 1.0})
  assert clone.server_info()["dist"].current_size == 1


def _insert_from_child(client, value):
  client.insert(np.full(3, value, np.int32), {"dist": 1.0})


def test_client_usable_from_spawned_process(client):
  ctx = multiprocessing.get_context("spawn")
  proc = ctx.Process(target=_insert_from_child, args=(client, 7))
  proc.start()
  proc.join(timeout=30)
  assert proc.exitcode == 0
  sample = next(client.sample("dist", emit_timesteps=False))
  assert sample.data[0].tolist() == [[7, 7, 7]]


_NUMERIC_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
                   np.uint8, np.uint16, np.uint32, np.uint64, np.bool_, np.complex64,
                   np.complex128]


@pytest.mark.parametrize("dtype", _NUMERIC_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_numeric_dtype_round_trips(client, dtype):
  value = (np.arange(6).reshape(2, 3) % 2).astype(dtype) if dtype is np.bool_ else (
      np.arange(6).reshape(2, 3).astype(dtype) * (1 + 1j if np.dtype(dtype).kind == "c" else 1))
  client.insert(value, {"dist": 1.0})
  sample = next(client.sample("dist", emit_timesteps=False))
  assert sample.data[0].dtype == np.dtype(dtype)
  np.testing.assert_array_equal(sample.data[0], value[None])


def test_bytes_and_str_columns_round_trip(client):
  client.insert({"b": b"\x00bytes", "s": "h\u00e9llo", "arr": np.array(["x", "yz"])},
                {"dist": 1.0})
  sample = next(client.sample("dist", emit_timesteps=False))
  arr, b, s = sample.data  # sorted keys: arr, b, s
  assert arr.dtype == object and arr.tolist() == [[b"x", b"yz"]]
  assert b.tolist() == [b"\x00bytes"]
  assert s.tolist() == ["h\u00e9llo".encode()]


def test_checkpoint_returns_the_new_checkpoint_directory(client):
  path = client.checkpoint()   # the default TempDirCheckpointer (tests/test_checkpoint.py: more)
  assert os.path.isfile(os.path.join(path, "MANIFEST"))
  shutil.rmtree(os.path.dirname(path))


@pytest.mark.timeout(60)
def test_local_client_works_without_the_optional_grpcio(server_factory):
  """The bridge extra is optional: Client(...) of a local server must not import grpc."""
  server = server_factory([reverb_shm.Table("t", reverb_shm.selectors.Uniform(),
                                            reverb_shm.selectors.Fifo(), 10,
                                            reverb_shm.rate_limiters.MinSize(1))])
  code = (
      without_modules("grpc") +
      "import reverb_shm\n"
      f"c = reverb_shm.Client('localhost:{server.port}')\n"
      "c.insert([1.0], {'t': 1.0})\n"
      "print(type(c).__name__, c.server_info()['t'].current_size, 'grpc' in sys.modules)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["Client", "1", "False"]


@pytest.mark.timeout(60)
def test_a_remote_address_without_grpcio_names_the_extra_to_install():
  message = import_error_without("__import__('reverb_shm').Client('203.0.113.7:4321')", "grpc")
  assert "pip install 'reverb_shm[bridge]'" in message
  cli = subprocess.run([sys.executable, "-c", without_modules("grpc") +
                        "from reverb_shm.cli import main\n"
                        "sys.exit(main(['bridge', 'nosuch', '--port', '1']))"],
                       capture_output=True, text=True, timeout=30)
  assert cli.returncode == 2
  assert "pip install 'reverb_shm[bridge]'" in cli.stderr, cli.stderr
