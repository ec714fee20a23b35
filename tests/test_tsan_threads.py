"""Several threads of one process on one table: the paths ThreadSanitizer watches (tests/sanitize.py
tsan). The C core releases the GIL in every call, so these threads really run the core at once:
inserts of batches and of trajectory-writer items, batched sampling with gather (the process's
sample hints, shared by its threads, feed the priority updates that follow), plain sampling,
blocked samplers woken by inserts of other threads, and the server's reaper thread. The outcome
is checked exactly: every insert is counted, every sample is an inserted item with its written
data, and the invariant checker passes."""
import threading

import numpy as np
import pytest

import reverb_shm
from reverb_shm import rate_limiters, selectors

pytestmark = pytest.mark.timeout(120)

ROUNDS = 60


def _run(threads):
  errors = []

  def wrap(fn):
    def body():
      try:
        fn()
      except BaseException as e:  # pylint: disable=broad-except
        errors.append(e)
    return body
  ts = [threading.Thread(target=wrap(fn)) for fn in threads]
  for t in ts:
    t.start()
  for t in ts:
    t.join(90)
  assert not any(t.is_alive() for t in ts), "a thread did not finish"
  if errors:
    raise errors[0]


def test_threads_insert_sample_update_and_wait_on_one_table(server_factory):
  server = server_factory([
      reverb_shm.Table("prio", selectors.Prioritized(0.7), selectors.Fifo(), 500,
                       rate_limiters.MinSize(1)),
      reverb_shm.Table.queue("queue", 50),
  ])
  st = server.shared_table("prio")
  queue = server.shared_table("queue")
  client = server.localhost_client()
  seen = []

  def batch_inserter():
    for i in range(ROUNDS):
      keys = np.arange(8, dtype=np.uint64) + 8 * i
      st.insert({"x": keys.astype(np.float64)}, np.full(8, 1.0), keys=keys, timeout_ms=10_000)

  def writer():
    with client.trajectory_writer(num_keep_alive_refs=2) as w:
      for i in range(ROUNDS):
        w.append({"x": np.float64(10_000 + i)})
        w.create_item("prio", 2.0, {"x": w.history["x"][-1]})
        if i % 10 == 9:
          w.end_episode()

  def gather_and_update():
    out = [np.empty(32, np.float64)]
    for _ in range(ROUNDS):
      batch = st.sample_batch(32, out=out, timeout_ms=10_000)
      data = batch.data[0]
      # an inserted value: a batch key (x == key) or a writer step (x >= 10000)
      keys = batch.info.key.astype(np.int64)
      assert ((data == keys) | (data >= 10_000)).all()
      st.update_priorities(batch.info.key, np.full(len(keys), 0.5))

  def sampler():
    for _ in range(ROUNDS):
      for s in st.sample(4, timeout_ms=10_000):
        assert float(s.data[0]) >= 0

  def queue_consumer():
    for _ in range(ROUNDS):
      seen.append(float(queue.sample(1, timeout_ms=20_000)[0].data[0]))   # blocks until filled

  def queue_producer():
    for i in range(ROUNDS):
      queue.insert({"x": np.array([float(i)])}, 1.0, timeout_ms=20_000)

  _run([batch_inserter, writer, gather_and_update, sampler, queue_consumer, queue_producer])
  assert seen == [float(i) for i in range(ROUNDS)]   # a queue: every item once, in order
  info = client.server_info()
  assert info["prio"].current_size == min(500, 8 * ROUNDS + ROUNDS)
  assert info["prio"].rate_limiter_info.insert_stats.completed == 8 * ROUNDS + ROUNDS
  server.segment.check()
