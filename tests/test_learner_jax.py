"""reverb_shm.jax.JaxIterator: jax.Arrays of fixed shape, batches of their own, sharding over
local devices, priorities from jax.Arrays."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import reverb_shm  # noqa: E402
from reverb_shm import rate_limiters, selectors  # noqa: E402
from reverb_shm.jax import JaxIterator  # noqa: E402


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
    print("OK")
""")


def test_sharded_batches_split_over_local_devices(server_name):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", f"NAME = {server_name!r}\n" + _SHARDED], env=env,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-2000:]
