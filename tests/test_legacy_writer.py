"""SPEC §5: the legacy `client.writer(max_sequence_length)`."""
import math
import threading

import numpy as np
import pytest

import reverb_shm
from reverb_shm import rate_limiters, selectors

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def client(server_factory):
  tables = [reverb_shm.Table.queue("q", 100), reverb_shm.Table.queue("q2", 100)]
  return server_factory(tables).localhost_client()


def _drain(client, table):
  n = client.server_info()[table].current_size
  return [[np.asarray(c).tolist() for c in s.data]
          for s in client.sample(table, n, emit_timesteps=False)] if n else []


def test_items_span_the_last_num_timesteps_of_every_leaf(client):
  with client.writer(3) as writer:
    for t in range(5):
      writer.append({"a": np.float32(t), "b": np.arange(2) + t})
      writer.create_item("q", min(t + 1, 3), 1.0)
  items = _drain(client, "q")
  assert items[0] == [[0.0], [[0, 1]]]
  assert items[2] == [[0.0, 1.0, 2.0], [[0, 1], [1, 2], [2, 3]]]
  assert items[4] == [[2.0, 3.0, 4.0], [[2, 3], [3, 4], [4, 5]]]


def test_append_sequence_equals_one_append_per_row(client):
  with client.writer(4, chunk_length=2) as writer:
    writer.append_sequence([np.arange(3, dtype=np.int32), np.ones((3, 2))])
    writer.append([np.int32(3), np.ones(2)])
    writer.create_item("q", 4, 2.0)
    with pytest.raises(ValueError, match="scalar"):
      writer.append_sequence([np.int32(1), np.ones((1, 2))])
    with pytest.raises(ValueError, match="leading dim"):
      writer.append_sequence([np.arange(2, dtype=np.int32), np.ones((3, 2))])
  (item,) = _drain(client, "q")
  assert item[0] == [0, 1, 2, 3] and np.array(item[1]).shape == (4, 2)


def test_one_step_serves_several_tables(client):
  with client.writer(1) as writer:
    writer.append(np.int64(7))
    writer.create_item("q", 1, 1.0)
    writer.create_item("q2", 1, 2.0)
  assert _drain(client, "q") == [[[7]]] and _drain(client, "q2") == [[[7]]]


@pytest.mark.parametrize("kwargs, match", [
    ({"max_sequence_length": 0}, "max_sequence_length"),
    ({"max_sequence_length": 2, "chunk_length": 3}, "chunk_length"),
    ({"max_sequence_length": 2, "chunk_length": 0}, "chunk_length"),
    ({"max_sequence_length": 2, "max_in_flight_items": 0}, "max_in_flight_items"),
])
def test_constructor_arguments_are_validated(client, kwargs, match):
  with pytest.raises(ValueError, match=match):
    client.writer(**kwargs)


def test_create_item_validation(client):
  writer = client.writer(2)
  writer.append([np.int64(1)])
  for args, match in [(("q", 0, 1.0), "num_timesteps"), (("q", 3, 1.0), "max_sequence_length"),
                      (("q", 2, 1.0), "appended so far"), (("q", 1, math.nan), "nan"),
                      (("nope", 1, 1.0), "nope")]:
    with pytest.raises(ValueError, match=match):
      writer.create_item(*args)
  with pytest.raises(ValueError, match="unexpected length"):
    writer.append([np.int64(1), np.int64(2)])
  with pytest.raises(ValueError, match="dtype"):
    writer.append([np.float32(1)])
  writer.close()
  assert client.server_info()["q"].current_size == 0


def test_close_twice_is_a_value_error_and_use_after_close_a_runtime_error(client):
  """As in dm-reverb: append, append_sequence, create_item and flush after close raise
  RuntimeError (ours is a ValueError too), a second close or `with` a ValueError."""
  writer = client.writer(1)
  writer.close()
  with pytest.raises(ValueError, match="close\\(\\) has already been called"):
    writer.close()
  for call in (lambda: writer.append([np.int64(1)]),
               lambda: writer.append_sequence([np.array([1, 2])]),
               lambda: writer.create_item("q", 1, 1.0), writer.flush):
    with pytest.raises(RuntimeError, match="closed") as info:
      call()
    assert isinstance(info.value, ValueError)
  with pytest.raises(ValueError, match="closed"):
    with writer:
      pass


def test_max_in_flight_items_blocks_create_item_until_the_limiter_admits(server_factory):
  client = server_factory([reverb_shm.Table.queue("q", 1)]).localhost_client()
  writer = client.writer(1, max_in_flight_items=2)
  writer.append(np.int64(0))
  for _ in range(3):                    # 1 in the table + 2 waiting
    writer.create_item("q", 1, 1.0)
  finished = threading.Event()

  def one_more():
    writer.create_item("q", 1, 1.0)
    finished.set()

  thread = threading.Thread(target=one_more, daemon=True)
  thread.start()
  assert not finished.wait(0.3)         # a fourth would exceed max_in_flight_items
  next(client.sample("q", 1))
  assert finished.wait(5)
  thread.join(5)
  # Queued items enter the table when the writer drains its queue (flush, create_item).
  flusher = threading.Thread(target=writer.flush, daemon=True)
  flusher.start()
  for _ in range(3):
    next(client.sample("q", 1, rate_limiter_timeout_ms=5000))
  flusher.join(5)
  assert not flusher.is_alive()
  writer.close()
  assert client.server_info()["q"].rate_limiter_info.insert_stats.completed == 4


def test_items_land_in_a_uniform_table_without_flush(server_factory):
  table = reverb_shm.Table("u", selectors.Uniform(), selectors.Fifo(), 10,
                           rate_limiters.MinSize(1))
  client = server_factory([table]).localhost_client()
  writer = client.writer(2)
  writer.append(np.float64(1.5))
  writer.create_item("u", 1, 1.0)
  assert table.info.current_size == 1
  writer.close()
