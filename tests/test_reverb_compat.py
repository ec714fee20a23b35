"""Behaviours that real Reverb client code (Acme's adders, TF-Agents' observers and variable
container) relies on, each seen failing against reverb_shm before it was fixed.

tests/test_differential.py runs the same scenarios against dm-reverb where it can.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import shm
from reverb_shm import structured_writer as sw

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


# ---- a SIGKILLed server: every client call fails fast with the same error

_SERVE = textwrap.dedent("""
    import sys, time, reverb_shm
    s = reverb_shm.Server([reverb_shm.Table.queue("t", 100)], name=sys.argv[1])
    print(s.port, flush=True)
    time.sleep(120)
""")


def _server_process(name):
  proc = subprocess.Popen([sys.executable, "-c", _SERVE, name], stdout=subprocess.PIPE,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
  return proc, int(proc.stdout.readline())


def _client_calls(client):
  return {
      "server_info": client.server_info,
      "server_info(1)": lambda: client.server_info(1),
      "insert": lambda: client.insert(np.float32(1), {"t": 1.0}),
      "sample": lambda: next(client.sample("t", 1)),
      "mutate_priorities": lambda: client.mutate_priorities("t", {1: 1.0}),
      "reset": lambda: client.reset("t"),
      "trajectory_writer": lambda: client.trajectory_writer(2),
      "writer": lambda: client.writer(2),
      "structured_writer": lambda: client.structured_writer([sw.create_config(
          [sw.create_reference_step({"x": None})["x"][-1]], "t")]),
  }


def _wait_dead(client, timeout=5.0):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    try:
      client.server_info()
    except errors.DeadOwnerError:
      return
    time.sleep(0.01)
  raise AssertionError("the client did not notice the server's death")


def test_every_client_call_fails_fast_after_the_server_is_killed(server_name):
  proc, port = _server_process(server_name)
  try:
    client = reverb_shm.Client(f"localhost:{port}")
    for _ in range(3):
      client.insert(np.float32(1), {"t": 1.0})   # the one-call insert path has its plan
    next(client.sample("t", 1))
    assert client.server_info()["t"].current_size == 2
    writer = client.trajectory_writer(2)   # made before the kill
    writer.append({"x": np.float32(1)})
    writer.create_item("t", 1.0, {"x": writer.history["x"][-1:]})
    writer.flush()
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
  try:
    t0 = time.monotonic()
    _wait_dead(client)
    assert time.monotonic() - t0 < 1.0
    writer_calls = {
        "writer.flush": writer.flush,
        "writer.end_episode": writer.end_episode,
        "writer.append(new field)": lambda: writer.append({"y": np.float32(2)}),
    }
    for label, call in list(_client_calls(client).items()) + list(writer_calls.items()):
      t0 = time.monotonic()
      with pytest.raises(errors.DeadOwnerError) as info:
        call()

      assert time.monotonic() - t0 < 0.5, label
      message = str(info.value)
      assert f"server {server_name!r} is dead (owner pid {proc.pid} is gone)" in message, label
      assert "reverb-shm gc" in message
  finally:
    shm.remove_stale(names=[server_name])


def test_a_client_finds_a_server_restarted_under_the_same_name(server_name):
  proc, _ = _server_process(server_name)
  client = reverb_shm.Client(f"shm://{server_name}")
  client.insert(np.float32(1), {"t": 1.0})
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=10)
  _wait_dead(client)
  proc, _ = _server_process(server_name)   # reclaims the stale name
  try:
    assert client.server_info()["t"].current_size == 0
    client.insert(np.float32(2), {"t": 1.0})
    assert client.server_info()["t"].current_size == 1
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    shm.remove_stale(names=[server_name])


def test_a_fork_child_notices_the_server_death_too(server_name):
  proc, port = _server_process(server_name)
  client = reverb_shm.Client(f"localhost:{port}")
  client.insert(np.float32(1), {"t": 1.0})   # the parent watches the server
  up_r, up_w = os.pipe()       # child -> parent
  down_r, down_w = os.pipe()   # parent -> child
  child = os.fork()
  if child == 0:   # the child attaches anew and has its own watcher
    try:
      signal.alarm(30)   # never outlive the test
      os.close(up_r)
      client.insert(np.float32(2), {"t": 1.0})
      os.write(up_w, b"inserted\n")
      os.read(down_r, 1)   # wait for the kill
      _wait_dead(client)
      os.write(up_w, b"noticed\n")
    except BaseException as e:  # pylint: disable=broad-except
      os.write(up_w, f"{type(e).__name__}: {e}\n".encode())
    finally:
      os._exit(0)  # pylint: disable=protected-access
  os.close(up_w)
  try:
    with os.fdopen(up_r) as up:
      assert up.readline() == "inserted\n"
      proc.send_signal(signal.SIGKILL)
      proc.wait(timeout=10)
      os.write(down_w, b"k")
      assert up.readline() == "noticed\n"
    os.waitpid(child, 0)
    _wait_dead(client)
  finally:
    os.close(down_w)
    proc.kill()
    shm.remove_stale(names=[server_name])


# ---- items of one dtype and byte size but other shapes (a client's cached gather layout)


def _write_items(client, table, steps, pattern):
  with client.trajectory_writer(4) as writer:
    for step in steps:
      writer.append({"r": step})
    writer.create_item(table, 1.0, {"r": pattern(writer.history["r"])})


@pytest.mark.parametrize("reset", [True, False])
def test_samples_keep_their_shapes_when_items_share_dtype_and_bytes(server_factory, reset):
  """2 rows of [] vs 1 row of [2], and a squeezed [3] vs 1 row of [3]: same dtype and bytes;
  each item samples back in its own shape, also after Client.reset (Acme's StructuredAdder
  tests share one client across tests that reset the table)."""
  server = server_factory([reverb_shm.Table.queue("q", 10)])
  client = _client(server)
  expected = []
  for steps, pattern, shape in [
      ([1.0, 2.0], lambda h: h[-2:], (2,)),
      ([np.array([1.0, 2.0])], lambda h: h[-1:], (1, 2)),
      ([np.arange(3.0)], lambda h: h[-1], (3,)),
      ([np.arange(3.0)], lambda h: h[-1:], (1, 3))]:
    _write_items(client, "q", steps, pattern)
    expected.append(shape)
    if reset:
      sample = next(client.sample("q", 1, emit_timesteps=False))
      assert sample.data[0].shape == shape
      client.reset("q")
  if not reset:
    shapes = [s.data[0].shape for s in client.sample("q", 4, emit_timesteps=False)]
    assert shapes == expected


# ---- partial steps count in every column's history as soon as they are opened


def test_an_open_partial_step_counts_in_every_column_history(server_factory):
  server = server_factory([reverb_shm.Table.queue("q", 100)])
  client = _client(server)
  with client.trajectory_writer(5) as writer:
    writer.append({"obs": np.float32(0)}, partial_step=True)
    assert len(writer.history["obs"]) == 1
    for i in range(1, 5):
      writer.append({"action": np.int64(i)})           # closes step i - 1
      writer.append({"obs": np.float32(i)}, partial_step=True)   # opens step i
      assert (len(writer.history["obs"]), len(writer.history["action"])) == (i + 1, i + 1)
      assert "len=%d" % (i + 1) in repr(writer.history["action"])
    # Slices ending before the open step (Acme's SequenceAdder) and ones including it.
    assert writer.history["action"][-4:-1].numpy().tolist() == [2, 3, 4]
    assert writer.history["action"][-2].numpy() == 4
    assert writer.history["obs"][-2:].numpy().tolist() == [3.0, 4.0]
    with pytest.raises(ValueError, match="None"):
      writer.history["action"][-1:].numpy()          # the open step has no action yet
    with pytest.raises(ValueError, match="None"):
      writer.history["action"][-1].numpy()
    writer.create_item("q", 1.0, {"action": writer.history["action"][-4:-1],
                                  "obs": writer.history["obs"][-4:-1]})
    writer.append({"action": np.int64(5)})           # closes the step: no change in length
    assert (len(writer.history["obs"]), len(writer.history["action"])) == (5, 5)
    assert writer.history["action"][-1].numpy() == 5
  item = next(client.sample("q", 1, emit_timesteps=False)).data
  assert [x.tolist() for x in item] == [[2, 3, 4], [1.0, 2.0, 3.0]]


# ---- history positions out of range: catchable as IndexError and as ValueError


def test_history_out_of_range_is_an_index_error_and_a_value_error(server_factory):
  server = server_factory([reverb_shm.Table.queue("q", 10)])
  with _client(server).trajectory_writer(3) as writer:
    for i in range(3):
      writer.append({"x": np.float32(i)})
    writer.end_episode(clear_buffers=True)
    writer.append({"x": np.float32(9)})
    for index in (slice(-2, None), -2, 1, slice(0, 5)):
      for cls in (IndexError, ValueError, errors.HistoryIndexError):
        with pytest.raises(cls, match="out of range"):
          writer.history["x"][index]   # pylint: disable=pointless-statement
    with pytest.raises(ValueError, match="out of range"):
      writer.create_window_items("q", [1.0], [-2], 2)
    assert writer.history["x"][-1:].numpy().tolist() == [9.0]


# ---- background delivery: items become visible without flush, held-back items go on


def _values(client, table, n, timeout_ms=2000):
  return [np.asarray(s.data[0]).ravel().tolist()
          for s in client.sample(table, n, emit_timesteps=False,
                                 rate_limiter_timeout_ms=timeout_ms)]


def _three_items(server_factory, capacity):
  """(client, writer) after the writer created items [0.], [1.], [2.] in a queue table of
  `capacity` items, without flush."""
  client = _client(server_factory([reverb_shm.Table.queue("q", capacity)]))
  writer = client.trajectory_writer(2)
  for i in range(3):
    writer.append({"x": np.float32(i)})
    writer.create_item("q", 1.0, {"x": writer.history["x"][-1:]})
  return client, writer


def test_created_items_become_visible_without_flush(server_factory):
  client, writer = _three_items(server_factory, 100)
  t0 = time.monotonic()
  assert _values(client, "q", 3) == [[0.0], [1.0], [2.0]]   # no flush, no further call
  assert time.monotonic() - t0 < 1.0
  writer.close()


def test_held_back_items_are_delivered_without_another_writer_call(server_factory):
  client, writer = _three_items(server_factory, 1)
  with pytest.raises(errors.DeadlineExceededError, match="inserted as soon as"):
    writer.end_episode(timeout_ms=100)   # the queue holds 1: 2 items stay held back
  # Each sample makes room; the next item follows with no call on the writer.
  assert _values(client, "q", 3) == [[0.0], [1.0], [2.0]]
  writer.append({"x": np.float32(3)})
  writer.create_item("q", 1.0, {"x": writer.history["x"][-1:]})
  writer.create_item("q", 2.0, {"x": writer.history["x"][-1:]})
  with pytest.raises(errors.DeadlineExceededError):
    writer.flush(timeout_ms=50)   # the same after flush times out
  assert [s.info.priority for s in client.sample("q", 2, emit_timesteps=False,
                                                rate_limiter_timeout_ms=2000)] == [1.0, 2.0]
  writer.close()


def _held_back_writer(client, kind):
  """A writer of `kind` that created items [0.], [1.], [2.] in queue "q" of capacity 1 (two are
  held back by its rate limiter)."""
  if kind == "structured":
    writer = client.structured_writer([sw.create_config(
        [sw.create_reference_step({"x": None})["x"][-1]], "q")])
    for i in range(3):
      writer.append({"x": np.float32(i)})
    return writer
  if kind == "legacy":
    writer = client.writer(1)
    for i in range(3):
      writer.append({"x": np.float32(i)})
      writer.create_item("q", 1, 1.0)
    return writer
  writer = client.trajectory_writer(2)
  for i in range(3):
    writer.append({"x": np.float32(i)})
    writer.create_item("q", 1.0, {"x": writer.history["x"][-1:]})
  return writer


_SAMPLER_SCRIPT = textwrap.dedent("""
    import sys, time, numpy as np, reverb_shm
    client = reverb_shm.Client(sys.argv[1])
    print("ready", flush=True)
    time.sleep(0.3)   # the writer's close() is waiting by now
    got = [float(np.ravel(s.data[0])[0]) for s in client.sample(
        "q", 3, emit_timesteps=False, rate_limiter_timeout_ms=10000)]
    print(got, flush=True)
""")


@pytest.mark.parametrize("kind", ["trajectory", "legacy", "structured"])
def test_close_waits_for_held_back_items_that_a_sampler_makes_room_for(server_factory, kind):
  server = server_factory([reverb_shm.Table.queue("q", 1)])
  writer = _held_back_writer(_client(server), kind)
  sampler = subprocess.Popen([sys.executable, "-c", _SAMPLER_SCRIPT, f"shm://{server.name}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
  try:
    assert sampler.stdout.readline() == "ready\n"
    with warnings.catch_warnings():
      warnings.simplefilter("error")   # nothing is left over, so no warning
      t0 = time.monotonic()
      writer.close()
      waited = time.monotonic() - t0
    out, err = sampler.communicate(timeout=30)
  finally:
    sampler.kill()
  assert sampler.returncode == 0, err
  assert out.strip() == "[0.0, 1.0, 2.0]"
  assert 0.2 < waited < 4.5   # until the other process's samples made room: not the bound


@pytest.mark.parametrize("kind", ["trajectory", "legacy", "structured"])
def test_close_waits_a_bounded_time_then_delivers_in_the_background(server_factory, kind):
  client = _client(server_factory([reverb_shm.Table.queue("q", 1)]))
  writer = _held_back_writer(client, kind)
  with pytest.raises(ValueError, match="timeout_ms"):
    writer.close(timeout_ms=-1)   # rejected: nothing closed
  t0 = time.monotonic()
  with pytest.warns(RuntimeWarning, match="2 items are still held back"):
    writer.close(timeout_ms=300)
  assert 0.25 < time.monotonic() - t0 < 3
  assert _values(client, "q", 3) == [[0.0], [1.0], [2.0]]   # none was dropped
  with pytest.raises((RuntimeError, ValueError), match="closed|already"):
    writer.flush()


def test_held_back_items_wait_for_a_table_change_not_a_poll(server_factory, monkeypatch):
  """The delivery thread tries held-back items again only when their table changes (the
  watcher sleeps on the table's change counter in the C core); the watcher's safety slice is
  made longer than the test, so only a wake-up can deliver."""
  from reverb_shm import trajectory_writer as tw  # pylint: disable=import-outside-toplevel
  from reverb_shm._internal import delivery  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(delivery, "_WATCH_SLICE_S", 60.0)
  tries = []
  deliver_now = tw.TrajectoryWriter._deliver_now
  monkeypatch.setattr(tw.TrajectoryWriter, "_deliver_now",
                      lambda self, *a: (tries.append(time.monotonic()), deliver_now(self, *a)))
  client, writer = _three_items(server_factory, 1)   # [0.] in the queue, [1.], [2.] held back
  deadline = time.monotonic() + 5
  while not tries and time.monotonic() < deadline:
    time.sleep(0.01)
  time.sleep(0.3)   # the first rounds (the batch, the queued items) are over
  before = len(tries)
  time.sleep(0.6)
  assert len(tries) == before, tries   # asleep until the table changes: no polling
  for want in ([0.0], [1.0], [2.0]):   # each sample wakes the watcher; the next item follows
    assert _values(client, "q", 1, timeout_ms=5000) == [want]
  assert len(tries) <= before + 6, tries   # (about one round of two tries per sample)
  writer.close()


def test_items_stay_whole_while_the_background_thread_delivers(server_factory):
  """The owner appends and creates items in bursts with pauses (the delivery thread inserts the
  batches in the pauses); every item holds its own two steps."""
  server = server_factory([reverb_shm.Table.queue("q", 5000)])
  client = _client(server)
  writer = client.trajectory_writer(3)
  n = 0
  for burst in range(40):
    for _ in range(25):
      writer.append({"x": np.array([n, -n], np.int64), "y": np.float32(n)})
      if n:
        writer.create_item("q", 1.0, {"x": writer.history["x"][-2:],
                                      "y": writer.history["y"][-1]})
      n += 1
    time.sleep(0.03 if burst % 2 else 0.0)
  deadline = time.monotonic() + 5
  while client.server_info()["q"].current_size < n - 1 and time.monotonic() < deadline:
    time.sleep(0.01)
  items = [s.data for s in client.sample("q", n - 1, emit_timesteps=False)]
  assert [int(y) for _, y in items] == list(range(1, n))
  for x, y in items:
    assert x.tolist() == [[y - 1, 1 - y], [y, -y]]
  writer.close()


def test_background_delivery_in_a_fork_child(server_factory):
  server = server_factory([reverb_shm.Table.queue("q", 10), reverb_shm.Table.queue("c", 10)])
  client = _client(server)
  parent_writer = client.trajectory_writer(2)
  parent_writer.append({"x": np.float32(1)})
  parent_writer.create_item("q", 1.0, {"x": parent_writer.history["x"][-1:]})  # a batch
  up_r, up_w = os.pipe()
  child = os.fork()
  if child == 0:
    try:
      signal.alarm(30)
      os.close(up_r)
      writer = client.trajectory_writer(2)    # the child's own writer and delivery thread
      writer.append({"x": np.float32(7)})
      writer.create_item("c", 1.0, {"x": writer.history["x"][-1:]})
      os.write(up_w, b"created\n")
      time.sleep(2)    # alive while the parent samples; no flush
    finally:
      os._exit(0)  # pylint: disable=protected-access
  os.close(up_w)
  with os.fdopen(up_r) as up:
    assert up.readline() == "created\n"
    assert _values(client, "c", 1) == [[7.0]]
    assert _values(client, "q", 1) == [[1.0]]
  os.waitpid(child, 0)
  parent_writer.close()


_EXIT_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, reverb_shm
    client = reverb_shm.Client(sys.argv[1])
    writer = client.trajectory_writer(2)
    for i in range(3):
      writer.append({"x": np.float32(i)})
      writer.create_item("q", 1.0, {"x": writer.history["x"][-1:]})
    print("created", flush=True)
    # exits without flush or close: 2 items are held back by the queue
""")


@pytest.mark.parametrize("sampled", [True, False])
def test_interpreter_exit_waits_for_held_back_items(server_factory, sampled):
  server = server_factory([reverb_shm.Table.queue("q", 1)])
  client = _client(server)
  proc = subprocess.Popen([sys.executable, "-c", _EXIT_SCRIPT, f"shm://{server.name}"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
  assert proc.stdout.readline() == "created\n"
  t0 = time.monotonic()
  if sampled:    # while the writer's process waits at exit, the queue drains
    assert _values(client, "q", 3, timeout_ms=4000) == [[0.0], [1.0], [2.0]]
  _, err = proc.communicate(timeout=30)
  assert proc.returncode == 0, err
  if sampled:
    assert "dropped" not in err
  else:   # nobody samples: a bounded wait, then a warning naming the dropped items
    assert 4.5 < time.monotonic() - t0 < 15
    assert "2 items" in err and "dropped" in err
    assert _values(client, "q", 1) == [[0.0]]
