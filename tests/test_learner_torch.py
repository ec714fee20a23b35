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


class _FakeStream:
  def __init__(self, *args):
    self.waited = []

  def wait_event(self, event):
    self.waited.append(event)


class _FakeEvent:
  log = []

  def __init__(self):
    self.stream, self.synchronized = None, 0

  def record(self, stream):
    self.stream = stream
    _FakeEvent.log.append(self)

  def synchronize(self):
    self.synchronized += 1


def test_cuda_code_path_with_a_fake_device(server_factory, monkeypatch):
  """The CUDA control flow, checked on the CPU with stand-ins for streams and events: copies
  are made on the side stream, an event is recorded after them, next() makes the current stream
  wait on it and marks every tensor as used there, and a ring buffer is gathered into again only
  after its copy's event was synchronised."""
  import reverb_shm.torch as rtorch
  current = _FakeStream()
  copies, used = [], []
  monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
  monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
  monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
  monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
  monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
  monkeypatch.setattr(torch.cuda, "stream", lambda s: _Recorder(s, copies))
  monkeypatch.setattr(torch.cuda, "device", lambda d: _Recorder(None, None))
  monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: current)
  monkeypatch.setattr(rtorch, "_copy_to_device",
                      lambda t, d: copies.append((_Recorder.active, d)) or t.clone())
  monkeypatch.setattr(rtorch, "_used_on", lambda t, s: used.append((t, s)))
  _FakeEvent.log = []
  server, st, _ = _server(server_factory)
  with TorchIterator(st, batch_size=16, device="cuda", pin_memory=False, prefetch=1,
                     importance_beta=0.5, timeout_ms=5000) as it:
    assert it.device == torch.device("cuda", 0) and isinstance(it._stream, _FakeStream)
    batches = [next(it) for _ in range(6)]
    side = it._stream
  # 3 columns + weights per batch, each copied inside the side stream's context
  assert copies and all(stream is side and d == torch.device("cuda", 0) for stream, d in copies)
  assert len(copies) >= 6 * 4
  events = _FakeEvent.log
  assert len(events) >= 6 and all(e.stream is side for e in events)
  assert current.waited == events[:6]                      # one wait per batch taken, in order
  assert len(used) == 6 * 4 and all(s is current for _, s in used)
  # every buffer the thread gathered into again had its previous copy synchronised first
  assert sum(e.synchronized for e in events) >= len(events) - len(it._slots)
  for b in batches:
    torch.testing.assert_close(b.data["obs"][:, 0], (b.data["action"] * 10).float())


class _Recorder:
  """Context manager standing in for torch.cuda.stream / torch.cuda.device."""
  active = None

  def __init__(self, stream, log):
    self.stream = stream

  def __enter__(self):
    if self.stream is not None:
      _Recorder.active = self.stream
    return self

  def __exit__(self, *exc):
    if self.stream is not None:
      _Recorder.active = None


def test_every_cpu_batch_has_a_data_dict_of_its_own(server_factory):
  server, _, _ = _server(server_factory)
  with TorchIterator(server, "t", 8, prefetch=1, timeout_ms=5000) as it:
    first = next(it)
    first.data.pop("action")
    for _ in range(4):
      batch = next(it)
      assert sorted(batch.data) == ["action", "obs", "reward"] and batch.data is not first.data
      torch.testing.assert_close(batch.data["obs"][:, 0], (batch.data["action"] * 10).float())


def test_cpu_tensor_priorities_through_the_native_queue(server_factory):
  server, st, keys = _server(server_factory)
  with TorchIterator(st, batch_size=8, timeout_ms=5000) as it:
    next(it)
    next(it)
    assert it._native_sampling and it._updater is None
    it.update_priorities(keys[:4], torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))
    it.update_priorities(keys[4:6], torch.tensor([5.0, -1.0, 6.0, -1.0])[::2])   # strided
    with pytest.raises(ValueError, match=">= 0 for a Prioritized"):
      it.update_priorities(keys[6:8], torch.tensor([7.0, -1.0]))
    it.flush(timeout_ms=5000)
    assert it.stats["priority_updates"] == 2
  assert st.items()["priority"].tolist()[:8] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] + \
      np.linspace(0.5, 2.0, 100).tolist()[6:8]


@pytest.mark.parametrize("dtype", ["bool", "uint8", "uint16", "uint32", "uint64", "int8",
                                   "float16", "float64", "complex64"])
def test_pinned_buffers_take_every_dtype_the_cpu_path_delivers(dtype):
  import reverb_shm.torch as rtorch
  assert rtorch._torch_dtype(np.dtype(dtype)) == torch.from_numpy(np.zeros(2, dtype)).dtype
  with pytest.raises(ValueError, match="columns of dtype object have no torch dtype"):
    rtorch._torch_dtype(np.dtype(object))


def test_keys_as_a_list_of_python_ints_with_tensor_priorities(server_factory):
  _, st, _ = _server(server_factory)
  keys = np.array([7, 2**63 + 7], np.uint64)   # (numpy makes float64 of these Python ints)
  st.insert({"obs": np.zeros((2, 84), np.float32), "action": np.zeros(2, np.int64),
             "reward": np.zeros(2, np.float32)}, 1.0, keys=keys)
  with TorchIterator(st, batch_size=8, timeout_ms=5000) as it:
    next(it)
    it.update_priorities(keys.tolist(), torch.full((2,), 9.0))
    it.flush(timeout_ms=5000)
  got = dict(zip(st.items()["key"].tolist(), st.items()["priority"].tolist()))
  assert [got[k] for k in keys.tolist()] == [9.0, 9.0]
