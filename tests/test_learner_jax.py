"""reverb_shm.jax.JaxIterator: jax.Arrays of fixed shape, batches of their own, sharding over
local devices, priorities from jax.Arrays."""
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import reverb_shm  # noqa: E402
from reverb_shm import rate_limiters, selectors  # noqa: E402
from reverb_shm.jax import JaxIterator  # noqa: E402
from reverb_shm.jax import _put as rjax_put  # noqa: E402
from reverb_shm.learner import BatchIterator  # noqa: E402


def _server(server_factory):
  signature = {"obs": reverb_shm.TensorSpec([6], np.float32),
               "action": reverb_shm.TensorSpec([], np.int32)}
  table = reverb_shm.Table("t", selectors.Prioritized(1.0), selectors.Fifo(), 10_000,
                           rate_limiters.MinSize(1), signature=signature)
  server = server_factory([table])
  st = server.shared_table("t")
  v = np.arange(64)
  keys = st.insert({"obs": (v[:, None] * 10 + np.arange(6)).astype(np.float32),
                    "action": v.astype(np.int32)}, np.ones(64))
  return server, st, keys


def test_batches_are_jax_arrays_that_never_change(server_factory):
  server, st, _ = _server(server_factory)
  with JaxIterator(server, "t", 16, importance_beta=1.0, timeout_ms=5000) as it:
    first = next(it)
    saved = np.asarray(first.data["obs"]).copy()
    for _ in range(10):
      batch = next(it)
      assert isinstance(batch.data["obs"], jax.Array) and batch.data["obs"].shape == (16, 6)
      np.testing.assert_array_equal(np.asarray(batch.data["obs"])[:, 0],
                                    np.asarray(batch.data["action"]) * 10)
      np.testing.assert_allclose(np.asarray(batch.weights), 1.0)   # equal priorities
    np.testing.assert_array_equal(np.asarray(first.data["obs"]), saved)


def test_held_batches_never_change_while_the_native_sampler_draws_many_more(server_factory):
  """jax on the CPU aliases the numpy buffers it is given: every batch keeps the ring buffer it
  was gathered into for good (the ring gathers into new arrays), however many batches follow."""
  server, st, _ = _server(server_factory)
  st.update_priorities(st.items()["key"], np.linspace(0.5, 4, 64))
  with JaxIterator(st, batch_size=16, prefetch=2, importance_beta=0.6, timeout_ms=5000) as it:
    held = [next(it) for _ in range(6)]
    assert it._native_sampling   # (batches 2.. came from the native sampler)
    saved = [(np.array(b.data["obs"]), np.array(b.data["action"]), np.array(b.weights))
             for b in held]
    for _ in range(300):   # (every ring slot gathered into many times)
      batch = next(it)
      np.testing.assert_array_equal(np.asarray(batch.data["obs"])[:, 0],
                                    np.asarray(batch.data["action"]) * 10)
    time.sleep(0.05)   # (time for the sampler to fill the ring again)
    for b, (obs, action, weights) in zip(held, saved):
      np.testing.assert_array_equal(np.asarray(b.data["obs"]), obs)
      np.testing.assert_array_equal(np.asarray(b.data["action"]), action)
      np.testing.assert_array_equal(np.asarray(b.weights), weights)
      np.testing.assert_array_equal(obs[:, 0], action * 10)


def test_arrays_given_to_jax_are_never_written_again(server_factory, monkeypatch):
  """Whatever jax does with a buffer it is given (alias it on the CPU, read it asynchronously
  for an accelerator's transfer), the iterator never writes it again: every array put is
  compared with a copy taken when it was put, after many more batches."""
  given = []
  real_put = rjax_put.Putter.put

  def recording_put(self, leaves):
    given.extend((a, a.copy()) for a in leaves)
    return real_put(self, leaves)
  monkeypatch.setattr(rjax_put.Putter, "put", recording_put)
  server, st, _ = _server(server_factory)
  with JaxIterator(st, batch_size=16, prefetch=3, importance_beta=1.0, mask_key=None,
                   timeout_ms=5000) as it:
    for _ in range(200):
      next(it)
    assert it._native_sampling
    time.sleep(0.05)
  assert len(given) >= 200 * 3
  for array, copy in given:
    np.testing.assert_array_equal(array, copy)


@pytest.mark.parametrize("kwargs", [{}, {"prefetch": 5}, {"sharded": True}])
def test_seed_gives_the_keys_of_the_numpy_iterator(server_factory, kwargs):
  server, st, _ = _server(server_factory)
  st.update_priorities(st.items()["key"], np.linspace(0.5, 4, 64))

  def keys(cls, **kw):
    with cls(st, batch_size=8, seed=11, timeout_ms=5000, **kw) as it:
      return [next(it).info.key.tolist() for _ in range(6)]
  expected = keys(BatchIterator)
  assert keys(JaxIterator, **kwargs) == expected
  assert keys(JaxIterator, partial=True) == expected   # (the Python thread gathers these)


def test_putter_gives_what_jax_device_put_gives(monkeypatch):
  """Columns of every dtype a table holds (64-bit ones become 32-bit without jax_enable_x64),
  through jaxlib's transfer and, where that is missing, through jax.device_put."""
  device = jax.devices()[0]
  rng = np.random.default_rng(0)
  leaves = [rng.random((16, 3)).astype(np.float32), rng.random(16),
            rng.integers(-2**40, 2**40, 16), rng.integers(0, 2**63, 16, dtype=np.uint64),
            rng.integers(0, 2, (16, 2)).astype(bool), rng.random(16).astype(np.float16),
            np.arange(16, dtype=np.uint8), np.zeros((16, 0), np.float32)]

  def check(putter):
    for _ in range(2):   # (the first call plans each column; the second uses the plan)
      got = putter.put(leaves)
      for g, x in zip(got, leaves):
        want = jax.device_put(x, device)
        assert isinstance(g, jax.Array) and g.dtype == want.dtype and g.shape == want.shape
        assert g.sharding == want.sharding and g.committed
        np.testing.assert_array_equal(np.asarray(g), np.asarray(want))
  putter = rjax_put.Putter(device)
  check(putter)
  assert all(plan is not None for plan in putter._plans.values())   # (the fast path here)

  def changed(*args):
    raise TypeError("batched_device_put() got an unexpected signature")
  monkeypatch.setattr(rjax_put, "_PRIVATE", (rjax_put._PRIVATE[0], changed))
  fallback = rjax_put.Putter(device)
  check(fallback)
  assert all(plan is None for plan in fallback._plans.values())


def test_ready_cpu_priorities_take_the_native_update_path(server_factory):
  server, st, _ = _server(server_factory)
  with JaxIterator(st, batch_size=8, timeout_ms=5000) as it:
    for _ in range(3):
      batch = next(it)
    priorities = jax.numpy.arange(8, dtype=jax.numpy.float32) + 3
    priorities.block_until_ready()
    it.update_priorities(batch.info.key, priorities)
    it.flush(timeout_ms=5000)
    assert it._updater is None   # (no Python thread waited for a device copy)
    with pytest.raises(ValueError, match="finite"):
      it.update_priorities(batch.info.key, jax.numpy.full(8, jax.numpy.nan))
  got = dict(zip(st.items()["key"].tolist(), st.items()["priority"].tolist()))
  expected = dict(zip(batch.info.key.tolist(), (np.arange(8) + 3.0).tolist()))
  assert {k: got[k] for k in expected} == expected


def test_native_batches_wait_for_items_then_raise_deadline_and_recover(server_factory):
  table = reverb_shm.Table("q", selectors.Fifo(), selectors.Fifo(), 100, rate_limiters.MinSize(1),
                           max_times_sampled=1,
                           signature={"x": reverb_shm.TensorSpec([], np.int64)})
  server = server_factory([table])
  st = server.shared_table("q")
  st.insert({"x": np.arange(12)}, np.ones(12))
  with JaxIterator(st, batch_size=4, prefetch=2, timeout_ms=300) as it:
    got = [np.asarray(next(it).data["x"]).tolist() for _ in range(3)]
    assert it._native_sampling
    assert sorted(sum(got, [])) == list(range(12))   # (each item sampled once, 64-bit -> 32)
    t0 = time.monotonic()
    with pytest.raises(reverb_shm.errors.DeadlineExceededError, match="no batch of 4 items"):
      next(it)
    assert 0.25 < time.monotonic() - t0 < 5
    st.insert({"x": np.arange(100, 104)}, np.ones(4))
    batch = next(it)
    assert sorted(np.asarray(batch.data["x"]).tolist()) == [100, 101, 102, 103]
    assert batch.data["x"].dtype == np.int32 and batch.data["x"].shape == (4,)


def test_priorities_from_jax_arrays(server_factory):
  server, st, _ = _server(server_factory)
  with JaxIterator(st, batch_size=8, timeout_ms=5000) as it:
    batch = next(it)
    it.update_priorities(batch.info.key, jax.numpy.arange(8, dtype=jax.numpy.float32) + 2)
    it.flush(timeout_ms=5000)
    with pytest.raises(TypeError, match="floating dtype"):
      it.update_priorities(batch.info.key, jax.numpy.arange(8))
  got = dict(zip(st.items()["key"].tolist(), st.items()["priority"].tolist()))
  # a key sampled twice gets the later value
  expected = dict(zip(batch.info.key.tolist(), (np.arange(8) + 2.0).tolist()))
  assert {k: got[k] for k in expected} == expected


def test_keys_truncated_to_32_bits_by_jax_are_refused(server_factory):
  server, st, _ = _server(server_factory)
  before = st.items()["priority"].tolist()
  with JaxIterator(st, batch_size=8, timeout_ms=5000) as it:
    batch = next(it)
    keys = jax.numpy.asarray(batch.info.key)   # (uint32 without jax_enable_x64, silently)
    assert keys.dtype == np.uint32
    with pytest.raises(TypeError, match="keys must be 64-bit"):
      it.update_priorities(keys, jax.numpy.full(8, 5.0))
    it.flush(timeout_ms=5000)
  assert st.items()["priority"].tolist() == before


def test_bad_device_and_sharding_arguments(server_factory):
  server, st, _ = _server(server_factory)
  with pytest.raises(ValueError, match="device must be a jax.Device"):
    JaxIterator(st, batch_size=8, device="gpu")
  with pytest.raises(ValueError, match="either device= or sharded=True"):
    JaxIterator(st, batch_size=8, device=jax.devices()[0], sharded=True)
  with pytest.raises(TypeError, match="does not take keep="):
    JaxIterator(st, batch_size=8, keep=2)


_SHARDED = textwrap.dedent("""
    import numpy as np, jax, reverb_shm
    from reverb_shm import rate_limiters, selectors
    from reverb_shm.jax import JaxIterator
    assert len(jax.local_devices()) == 2
    table = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100,
                             rate_limiters.MinSize(1),
                             signature={"x": reverb_shm.TensorSpec([1], np.float32)})
    with reverb_shm.Server([table], name=NAME, arena_bytes=16 << 20) as server:
      server.shared_table("t").insert({"x": np.arange(10, dtype=np.float32)[:, None]}, 1.0)
      try:
        JaxIterator(server, "t", 7, sharded=True)
        raise SystemExit("batch 7 over 2 devices was accepted")
      except ValueError as e:
        assert "not a multiple of the 2 local devices" in str(e)
      try:
        JaxIterator(server, "t", np.int64(7), sharded=True)
        raise SystemExit("batch np.int64(7) over 2 devices was accepted")
      except ValueError as e:
        assert "not a multiple of the 2 local devices" in str(e)
      with JaxIterator(server, "t", 8, sharded=True, timeout_ms=5000) as it:
        x = next(it).data["x"]
        assert x.shape == (8, 1)
        assert len(x.sharding.device_set) == 2
        assert sorted(s.data.shape for s in x.addressable_shards) == [(4, 1), (4, 1)]
        held = [next(it).data["x"] for _ in range(3)]
        saved = [np.asarray(h).copy() for h in held]
        for _ in range(100):
          y = next(it).data["x"]
          assert len(y.sharding.device_set) == 2 and set(np.asarray(y).ravel()) <= set(range(10))
        for h, v in zip(held, saved):
          assert (np.asarray(h) == v).all() and set(v.ravel()) <= set(range(10))
        assert it._native_sampling and it._putter._plans
        assert all(p is not None for p in it._putter._plans.values())   # (jaxlib's transfer)
    print("OK")
""")


def test_sharded_batches_split_over_local_devices(server_name):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", f"NAME = {server_name!r}\n" + _SHARDED], env=env,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-2000:]
