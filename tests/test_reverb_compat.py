"""Behaviours that real Reverb client code (Acme's adders, TF-Agents' observers and variable
container) relies on, each seen failing against reverb_shm before it was fixed.

tests/test_differential.py runs the same scenarios against dm-reverb where it can.
"""
import numpy as np
import pytest

import reverb_shm
from reverb_shm import rate_limiters, selectors

pytestmark = pytest.mark.timeout(60)


def _client(server):
  return reverb_shm.Client(f"localhost:{server.port}")


# ---- ragged object arrays


@pytest.mark.parametrize("value", [
    np.array([[1, 2], [3]], dtype=object),
    np.array([np.zeros(2), np.zeros(3)], dtype=object),
    np.array([{"a": 1}, (1, 2)], dtype=object),
])
def test_insert_rejects_ragged_object_arrays_with_type_error(server_factory, value):
  server = server_factory([reverb_shm.Table.queue("q", 10)])
  client = _client(server)
  with pytest.raises(TypeError, match="ragged or nested"):
    client.insert(value, {"q": 1.0})
  with pytest.raises(TypeError, match="ragged or nested"):
    client.insert({"a": np.float32(1), "b": value}, {"q": 1.0})
  assert client.server_info()["q"].current_size == 0
  # str / bytes object arrays (string columns) still go in.
  client.insert(np.array(["ab", b"c"], dtype=object), {"q": 1.0})
  assert next(client.sample("q", 1, emit_timesteps=False)).data[0].tolist() == [[b"ab", b"c"]]


def test_writer_append_rejects_ragged_object_arrays(server_factory):
  server = server_factory([reverb_shm.Table.queue("q", 10)])
  with _client(server).trajectory_writer(2) as writer:
    with pytest.raises(TypeError, match="ragged or nested"):
      writer.append({"x": np.array([[1, 2], [3]], dtype=object)})
    with pytest.raises(RuntimeError, match="before the first append"):
      writer.history   # pylint: disable=pointless-statement  (nothing was appended)


# ---- legacy writer: the signature describes one step


def _signed_table(shape=(2,), dtype=np.float32):
  return reverb_shm.Table("s", selectors.Fifo(), selectors.Fifo(), 10, rate_limiters.MinSize(1),
                          max_times_sampled=1, signature={"x": reverb_shm.TensorSpec(shape, dtype)})


def test_legacy_writer_checks_the_signature_per_step(server_factory):
  server = server_factory([_signed_table()])
  client = _client(server)
  with client.writer(3) as writer:
    for i in range(3):
      writer.append({"x": np.full(2, i, np.float32)})
    writer.create_item("s", 3, 1.0)
    writer.create_item("s", 1, 2.0)
  items = [s.data[0].tolist() for s in client.sample("s", 2, emit_timesteps=False)]
  assert items == [[[0, 0], [1, 1], [2, 2]], [[2, 2]]]


@pytest.mark.parametrize("value,what", [(np.ones(3, np.float32), "shape"),
                                        (np.ones(2, np.float64), "dtype"),
                                        (np.ones((1, 2), np.float32), "shape")])
def test_legacy_writer_rejects_steps_not_matching_the_signature(server_factory, value, what):
  server = server_factory([_signed_table()])
  client = _client(server)
  writer = client.writer(2)
  writer.append({"x": value})
  writer.append({"x": value})
  with pytest.raises(ValueError, match=f"{what}.*describes one step"):
    writer.create_item("s", 2, 1.0)
  writer.close()
  assert client.server_info()["s"].current_size == 0
