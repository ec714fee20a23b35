"""reverb_shm.torch.TorchIterator: tensors viewing the ring on the CPU, priorities from tensors,
bad devices and dtypes; the CUDA path (pinned ring, side stream, events) where CUDA is present."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import reverb_shm  # noqa: E402
from reverb_shm import errors, rate_limiters, selectors  # noqa: E402
from reverb_shm.torch import TorchIterator  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _server(server_factory, sampler=None):
  signature = {"obs": reverb_shm.TensorSpec([84], np.float32),
               "action": reverb_shm.TensorSpec([], np.int64),
               "reward": reverb_shm.TensorSpec([], np.float32)}
  table = reverb_shm.Table("t", sampler or selectors.Prioritized(0.6), selectors.Fifo(), 10_000,
                           rate_limiters.MinSize(1), signature=signature)
  server = server_factory([table])
  st = server.shared_table("t")
  v = np.arange(100)
  keys = st.insert({"obs": (v[:, None] * 10 + np.arange(84)).astype(np.float32),
                    "action": v.astype(np.int64), "reward": v.astype(np.float32)},
                   np.linspace(0.5, 2.0, 100))
  return server, st, keys


def test_cpu_batches_are_tensor_views_of_the_ring(server_factory):
  server, st, _ = _server(server_factory)
  with TorchIterator(server, "t", 32, importance_beta=0.4, prefetch=2, timeout_ms=5000) as it:
    pointers = set()
    for _ in range(9):
      batch = next(it)
      obs, action = batch.data["obs"], batch.data["action"]
      assert isinstance(obs, torch.Tensor) and obs.device.type == "cpu"
      assert obs.shape == (32, 84) and obs.dtype == torch.float32
      assert action.dtype == torch.int64
      torch.testing.assert_close(obs[:, 0], (action * 10).float())
      assert isinstance(batch.weights, torch.Tensor) and batch.weights.dtype == torch.float32
      assert float(batch.weights.max()) == pytest.approx(1.0)
      assert batch.info.key.dtype == np.uint64
      pointers.add(obs.data_ptr())
    assert 2 <= len(pointers) <= 3   # no copy: the tensors are the ring buffers in turn


def test_priorities_from_tensors_are_applied(server_factory):
  server, st, keys = _server(server_factory)
  with TorchIterator(st, batch_size=8, timeout_ms=5000) as it:
    batch = next(it)
    new = torch.arange(1, 9, dtype=torch.float32, requires_grad=True) * 1.5
    it.update_priorities(batch.info.key, new)
    it.update_priorities(torch.from_numpy(keys[:2].astype(np.int64)),
                         torch.tensor([7.0, 9.0], dtype=torch.bfloat16))
    it.flush(timeout_ms=5000)
  got = dict(zip(st.items()["key"].tolist(), st.items()["priority"].tolist()))
  expected = dict(zip(batch.info.key.tolist(), (np.arange(1, 9) * 1.5).tolist()))
  expected.update({int(keys[0]): 7.0, int(keys[1]): 9.0})
  assert {k: got[k] for k in expected} == expected


def test_bad_devices_and_priority_dtypes(server_factory):
  server, st, keys = _server(server_factory)
  if not torch.cuda.is_available():
    with pytest.raises(ValueError, match="CUDA is not available"):
      TorchIterator(st, batch_size=8, device="cuda")
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
      TorchIterator(st, batch_size=8, pin_memory=True)
  with pytest.raises(ValueError, match="only 'cpu' and 'cuda' devices"):
    TorchIterator(st, batch_size=8, device="meta")
  with pytest.raises(ValueError, match="device must be a torch.device or a string"):
    TorchIterator(st, batch_size=8, device="gpu0")
  assert st.stats()["samples"] == 0
  with TorchIterator(st, batch_size=8, timeout_ms=5000) as it:
    with pytest.raises(TypeError, match="floating-point tensor"):
      it.update_priorities(keys[:2], torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="keys must be integers"):
      it.update_priorities(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="finite"):
      it.update_priorities(keys[:2], torch.tensor([1.0, float("inf")]))
  assert st.items()["priority"].tolist() == np.linspace(0.5, 2.0, 100).tolist()


def test_seeded_torch_iterators_sample_the_same_keys(server_factory):
  server, st, _ = _server(server_factory)

  def keys(seed):
    with TorchIterator(st, batch_size=16, seed=seed, timeout_ms=5000) as it:
      return [next(it).info.key.tolist() for _ in range(3)]
  assert keys(5) == keys(5) != keys(6)


def test_server_stop_raises_table_closed(server_factory):
  server, st, _ = _server(server_factory)
  it = TorchIterator(st, batch_size=8, timeout_ms=5000)
  next(it)
  server.stop()
  with pytest.raises(errors.TableClosedError):
    for _ in range(10):
      next(it)
  it._thread.join(5)
  assert not it._thread.is_alive()


@cuda
def test_cuda_batches_are_on_the_device_and_match_the_table(server_factory):
  server, st, keys = _server(server_factory)
  with TorchIterator(st, batch_size=32, device="cuda", importance_beta=0.5,
                     timeout_ms=5000) as it:
    for _ in range(10):
      batch = next(it)
      obs, action = batch.data["obs"], batch.data["action"]
      assert obs.is_cuda and action.is_cuda and batch.weights.is_cuda
      torch.testing.assert_close(obs[:, 0], (action * 10).float())
      it.update_priorities(batch.info.key, (obs[:, 0] + 1).abs())   # a CUDA tensor
    it.flush(timeout_ms=5000)
    assert it.stats["keys_updated"] == 320
    assert all(s.owner[0].is_pinned() for s in it._slots)


@cuda
def test_cuda_priorities_with_bad_values_raise_on_the_next_call(server_factory):
  server, st, keys = _server(server_factory)
  with TorchIterator(st, batch_size=8, device="cuda", timeout_ms=5000) as it:
    batch = next(it)
    it.update_priorities(batch.info.key, torch.full((8,), float("nan"), device="cuda"))
    with pytest.raises(ValueError, match="finite"):
      it.flush(timeout_ms=5000)
