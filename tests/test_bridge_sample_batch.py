"""The bridge's SampleBatch call (RemoteClient.sample_batch_with_stats): one round trip per
batch, columns gathered, the table's counters after the draw."""
import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

import reverb_shm  # pylint: disable=g-bad-import-order
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm.bridge import BridgeConfig, RemoteClient

pytestmark = pytest.mark.timeout(60)
EXPONENT = 0.7


@pytest.fixture
def served(server_factory):
  server = server_factory([
      reverb_shm.Table("prio", selectors.Prioritized(EXPONENT), selectors.Fifo(), 100,
                       rate_limiters.MinSize(1)),
      reverb_shm.Table("empty", selectors.Uniform(), selectors.Fifo(), 10,
                       rate_limiters.MinSize(1))], bridge=BridgeConfig())
  client = reverb_shm.Client(f"localhost:{server.port}")
  for i in range(20):
    client.insert({"obs": np.full(3, i, np.float32), "i": np.int64(i)}, {"prio": float(i)})
  remote = RemoteClient(server.bridge_address, reconnect_timeout_s=2.0)
  yield server, remote
  remote.close()


def test_a_batch_carries_exact_probabilities_and_the_mass(served):
  _, remote = served
  batch, stats = remote.sample_batch_with_stats("prio", 200, timeout_ms=1000, rpc_timeout=30)
  mass = sum(float(i) ** EXPONENT for i in range(20))
  assert stats["size"] == 20 and stats["sampler_total_weight"] == pytest.approx(mass, rel=1e-12)
  assert batch.info.key.dtype == np.uint64 and batch.info.times_sampled.dtype == np.int32
  idx, obs = batch.data   # flat columns in the order of the sorted keys
  assert obs.shape == (200, 1, 3) and obs.dtype == np.float32 and idx.shape == (200, 1)
  i = idx.reshape(-1)
  np.testing.assert_array_equal(obs[:, 0, 0], i.astype(np.float32))
  assert (i != 0).all()   # priority 0 is never drawn
  np.testing.assert_allclose(batch.info.probability, i.astype(float) ** EXPONENT / mass,
                             rtol=1e-12)
  np.testing.assert_array_equal(batch.info.priority, i.astype(float))
  assert (batch.info.table_size == 20).all()


def test_zero_items_returns_only_the_counters(served):
  _, remote = served
  batch, stats = remote.sample_batch_with_stats("prio", 0)
  assert batch is None and stats["size"] == 20 and stats["samples"] == 0


def test_errors(served):
  _, remote = served
  with pytest.raises(errors.DeadlineExceededError):
    remote.sample_batch_with_stats("empty", 4, timeout_ms=50, rpc_timeout=30)
  with pytest.raises(errors.UnknownTableError, match="available tables"):
    remote.sample_batch_with_stats("nope", 4, timeout_ms=50)
  for bad in (-1, 1 << 17, 2.0, True):
    with pytest.raises(ValueError, match="n must be an int"):
      remote.sample_batch_with_stats("prio", bad)


def test_requests_in_flight_are_answered_in_order_on_one_stream(served):
  _, remote = served
  calls = [remote.sample_batch_async("prio", n, timeout_ms=1000) for n in (5, 0, 7)]
  failing = remote.sample_batch_async("nope", 3, timeout_ms=50)
  dropped = remote.sample_batch_async("prio", 9, timeout_ms=1000)
  last = remote.sample_batch_async("prio", 11, timeout_ms=1000)
  dropped.cancel()
  # Read out of order: each call gets its own reply.
  batch, stats = calls[2]()
  assert len(batch.info.key) == 7 and stats["size"] == 20
  assert calls[1]()[0] is None
  assert len(calls[0]()[0].info.key) == 5
  with pytest.raises(errors.UnknownTableError):   # an error answers that request only
    failing()
  assert len(last()[0].info.key) == 11
  stream = remote._connection().batch_stream  # pylint: disable=protected-access
  assert stream.error is None and not stream._replies  # pylint: disable=protected-access
  assert stats["samples"] >= 1


def test_a_reply_that_does_not_come_in_time_ends_the_stream_and_the_next_call_reopens(served):
  _, remote = served
  import time  # pylint: disable=g-import-not-at-top
  t0 = time.monotonic()
  with pytest.raises(errors.DeadlineExceededError, match="did not answer"):
    remote.sample_batch_with_stats("empty", 1, rpc_timeout=0.3)   # waits for the limiter
  assert time.monotonic() - t0 < 5
  batch, _ = remote.sample_batch_with_stats("prio", 3, timeout_ms=1000, rpc_timeout=30)
  assert len(batch.info.key) == 3
