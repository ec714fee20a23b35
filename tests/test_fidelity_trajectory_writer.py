"""SPEC §6 gaps not covered by test_trajectory_writer.py: back-pressure, end_episode without
clearing buffers, repeated steps, configure on a live column."""
import threading

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors
from reverb_shm import trajectory_writer as trajectory_writer_lib

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def queue_client(server_factory):
  return server_factory([reverb_shm.Table.queue("q", 1)]).localhost_client()


def test_create_item_blocks_when_the_pending_queue_is_full(queue_client, monkeypatch):
  """Back-pressure: a bounded number of items wait for the limiter; then create_item blocks."""
  monkeypatch.setattr(trajectory_writer_lib, "_MAX_PENDING", 3)
  writer = queue_client.trajectory_writer(1)
  writer.append({"x": np.int64(0)})
  for _ in range(4):                    # 1 admitted by Queue(1) + 3 pending
    writer.create_item("q", 1.0, writer.history["x"][-1:])
  assert writer.num_pending_items == 3
  done = threading.Event()
  thread = threading.Thread(
      target=lambda: (writer.create_item("q", 1.0, writer.history["x"][-1:]), done.set()),
      daemon=True)
  thread.start()
  assert not done.wait(0.3)             # blocked: memory does not grow without bound
  next(queue_client.sample("q", 1))     # room for one: the oldest pending item goes in
  assert done.wait(5)
  thread.join(5)
  assert writer.num_pending_items == 3
  with pytest.raises(errors.DeadlineExceededError, match="Timeout exceeded"):
    writer.flush(0, timeout_ms=20)
  writer.close()   # the held-back items go on in the background


def test_end_episode_without_clearing_keeps_refs_usable_across_episodes(server_factory):
  client = server_factory([reverb_shm.Table.queue("q", 10)]).localhost_client()
  writer = client.trajectory_writer(3)
  writer.append({"x": np.int32(1)})
  writer.end_episode(clear_buffers=False)
  assert writer.episode_steps == 0
  writer.append({"x": np.int32(2)})
  writer.create_item("q", 1.0, writer.history["x"][-2:])     # spans two episodes
  writer.end_episode(clear_buffers=True)
  assert len(writer.history["x"]) == 0   # cleared: the structure stays, the steps are gone
  with pytest.raises(IndexError):
    writer.history["x"][-1]  # pylint: disable=pointless-statement
  assert client.server_info()["q"].num_episodes == 2
  sample = next(client.sample("q", 1, emit_timesteps=False))
  assert sample.data[0].tolist() == [1, 2]
  writer.close()


def test_an_item_may_repeat_a_step_back_to_back(server_factory):
  client = server_factory([reverb_shm.Table.queue("q", 10)]).localhost_client()
  with client.trajectory_writer(2) as writer:
    writer.append({"x": np.int32(5)})
    writer.append({"x": np.int32(6)})
    writer.create_item("q", 1.0, writer.history["x"][[0, 0, 1]])
  assert next(client.sample("q", 1, emit_timesteps=False)).data[0].tolist() == [5, 5, 6]


def test_configure_on_a_live_column_widens_its_keep_alive_window(server_factory):
  client = server_factory([reverb_shm.Table.queue("q", 10)]).localhost_client()
  writer = client.trajectory_writer(1)
  writer.append({"x": np.int32(0)})
  writer.configure(("x",), num_keep_alive_refs=3, max_chunk_length=None)
  assert writer.max_num_keep_alive_refs == 3
  for i in range(1, 4):
    writer.append({"x": np.int32(i)})
  np.testing.assert_array_equal(writer.history["x"][-3:].numpy(), [1, 2, 3])
  writer.close()
