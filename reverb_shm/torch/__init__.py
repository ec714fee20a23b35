"""PyTorch learner iterator: fixed-shape prioritized batches as tensors, on the learner's device.

    import reverb_shm.torch as rtorch

    with rtorch.TorchIterator(client, "replay", batch_size=256, device="cuda",
                              importance_beta=0.4) as batches:
      for batch in batches:
        td = learner_step(batch.data, batch.weights)      # tensors on the device
        batches.update_priorities(batch.info.key, td.abs())   # any device, asynchronous

Every batch is a reverb_shm.learner.Batch whose ``data`` leaves and ``weights`` / ``mask`` are
torch tensors on ``device``; ``info`` stays numpy (keys are uint64, which torch does not
compute with). Prefetch, fixed shapes, mixing, seeds and errors as BatchIterator
(reverb_shm.learner).

CPU (the default device): the tensors are ``torch.from_numpy`` views of the ring buffer the
background thread gathered into: no copy beyond the gather. They stay valid until the consumer
has taken ``keep`` more batches (default 1: until the next ``next()``); keep a batch longer with
``copy=True`` or ``tensor.clone()``.

CUDA: the ring buffers are pinned host memory; the background thread copies each gathered batch
to the device with ``non_blocking=True`` on a side CUDA stream and records an event; ``next()``
makes the current stream wait for that event (no host synchronisation) and marks the tensors as
used on it, so the caching allocator does not reuse them early. A ring buffer is gathered into
again only after its copy finished. Device tensors are the batch's own: they never change.

Priorities: ``update_priorities(keys, priorities)`` takes numpy arrays or tensors on any device
(CUDA tensors are copied to pinned host memory with non_blocking=True; the background thread
waits for that copy before applying them, so the learner never synchronises for it).
"""
try:
  import torch
except ImportError as e:   # pragma: no cover - exercised without the extra installed
  raise ImportError("reverb_shm.torch needs PyTorch: pip install 'reverb_shm[torch]'") from e

from typing import Optional

import numpy as np

from reverb_shm import learner
from reverb_shm._internal import structure
from reverb_shm.learner import Batch, importance_weights

__all__ = ["Batch", "TorchIterator", "importance_weights"]


def _device(device) -> "torch.device":
  """torch.device of `device`, checked to be usable here."""
  if device is None:
    return torch.device("cpu")
  try:
    dev = torch.device(device)
  except (RuntimeError, TypeError) as e:
    raise ValueError(f"device must be a torch.device or a string such as 'cpu' or 'cuda:0', got "
                     f"{device!r} ({e})") from None
  if dev.type == "cpu":
    return dev
  if dev.type == "cuda":
    if not torch.cuda.is_available():
      raise ValueError(f"device {device!r}: CUDA is not available in this process "
                       "(torch.cuda.is_available() is False); use device='cpu'")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
      raise ValueError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA devices")
    return torch.device("cuda", index)
  raise ValueError(f"device {device!r}: only 'cpu' and 'cuda' devices are supported")


def _host_array(value) -> np.ndarray:
  """A numpy array of `value` (numpy, list or tensor on the CPU; bfloat16 becomes float32)."""
  if isinstance(value, torch.Tensor):
    value = value.detach()
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy()
  return np.asarray(value)


def _host_keys(keys):
  """uint64 keys from numpy or a tensor; an int64 tensor holds the keys' bits (torch has no
  arithmetic on uint64: ``torch.from_numpy(info.key.view(np.int64))``) and is read back so."""
  if isinstance(keys, torch.Tensor):
    if keys.is_floating_point():
      raise TypeError(f"keys must be integers (Batch.info.key), got a tensor of dtype {keys.dtype}")
    keys = keys.detach().cpu().numpy()
    return keys.view(np.uint64) if keys.dtype == np.int64 else keys
  return keys   # (numpy, or Python ints: converted as BatchIterator.update_priorities does)


class TorchIterator(learner.BatchIterator):
  """BatchIterator delivering torch tensors on `device` (see the module docstring).

  Args:
    source: as BatchIterator (e.g. a Client).
    table: as BatchIterator (e.g. ``'replay'`` or ``{'a': 0.7, 'b': 0.3}``).
    batch_size: as BatchIterator.
    device: 'cpu' (default), 'cuda', 'cuda:N' or a torch.device.
    pin_memory: gather into pinned host memory (default: when device is CUDA).
    **kwargs: prefetch, keep, timeout_ms, partial, importance_beta, seed, mask_key, copy, as
      BatchIterator.

  Raises:
    ValueError: a device that is not usable here (e.g. 'cuda' without CUDA), or bad arguments
      as BatchIterator.
  """

  def __init__(self, source, table=None, batch_size: int = 256, *, device=None,
               pin_memory: Optional[bool] = None, **kwargs):
    self.device = _device(device)
    cuda = self.device.type == "cuda"
    if pin_memory is None:
      pin_memory = cuda
    if pin_memory and not torch.cuda.is_available():
      raise ValueError("pin_memory=True needs CUDA (torch.cuda.is_available() is False)")
    self._pin = bool(pin_memory)
    self._stream = torch.cuda.Stream(self.device) if cuda else None
    # (on the CPU the transform only wraps the ring's arrays, made once per buffer: it runs in
    # the consumer's thread, and the native sampler gathers)
    self._native_ok = not cuda and not self._pin
    for name in ("allocate", "transform"):
      if name in kwargs:
        raise TypeError(f"TorchIterator does not take {name}=")
    super().__init__(source, table, batch_size, allocate=self._alloc if self._pin else None,
                     transform=self._to_cuda if cuda else self._to_cpu, **kwargs)

  # ---- background thread side
  def _alloc(self, shape, dtype):
    t = torch.empty(shape, dtype=_torch_dtype(dtype), pin_memory=True)
    return t.numpy(), t

  def _wrap_leaf(self, array: np.ndarray) -> "torch.Tensor":
    return torch.from_numpy(array)   # (batches of the native sampler, on the CPU)

  def _to_cpu(self, batch: Batch, slot) -> Batch:
    weights, mask = batch.weights, batch.mask
    if len(batch.info.key) == self.batch_size:   # views of the whole buffer: made once
      views = slot.cache.get("views")
      if views is None:
        leaves, treedef = structure.flatten(batch.data)
        views = slot.cache["views"] = ([torch.from_numpy(a) for a in leaves], treedef,
                                       torch.from_numpy(slot.weights))
      leaves, treedef, slot_weights = views
      data = structure.unflatten(treedef, list(leaves))   # (a nest of its own per batch)
      weights = None if weights is None else slot_weights
    else:
      data = _map(batch.data, torch.from_numpy)
      weights = None if weights is None else torch.from_numpy(weights)
    return batch._replace(
        data=data, weights=weights,
        mask=None if mask is None else torch.from_numpy(np.ascontiguousarray(mask)))

  def _to_cuda(self, batch: Batch, slot) -> tuple:
    dev, stream = self.device, self._stream
    with torch.cuda.device(dev), torch.cuda.stream(stream):
      def put(a):
        return _copy_to_device(torch.from_numpy(a), dev)
      out = batch._replace(
          data=_map(batch.data, put),
          weights=None if batch.weights is None else put(batch.weights),
          mask=None if batch.mask is None else put(np.ascontiguousarray(batch.mask)))
      event = torch.cuda.Event()
      event.record(stream)
    slot.fence = event.synchronize   # the pinned buffer is gathered into again after the copy
    return out, event

  # ---- consumer side
  def __next__(self) -> Batch:
    out = super().__next__()
    if self._stream is None:
      return out
    batch, event = out
    current = torch.cuda.current_stream(self.device)
    current.wait_event(event)
    for t in _tensors(batch):
      _used_on(t, current)
    return batch

  def update_priorities(self, keys, priorities, table=None) -> None:
    """As BatchIterator.update_priorities; keys and priorities may be tensors on any device
    (a CUDA tensor of priorities is copied to the host asynchronously: no synchronisation
    here). An int64 tensor of keys is read as the bits of uint64 keys.

    Raises:
      TypeError: keys not integers, priorities not floating point (e.g. an int64 tensor).
      ValueError: shapes differ, a bad table; values not finite or negative (for CUDA
        tensors these are found by the background thread and raised by the next call).
    """
    if table is None and type(priorities) is torch.Tensor and type(keys) is np.ndarray and \
        self._native is not None:
      # (the common case, a CPU tensor of float32/64 without grad: one C call validates and
      # queues; anything else, e.g. a CUDA tensor, whose numpy() raises, takes the general path)
      try:
        host = priorities.numpy()
      except (TypeError, RuntimeError):
        host = None
      if host is not None and self._native_push(keys, host):
        return
    keys = _host_keys(keys)
    if isinstance(priorities, torch.Tensor):
      if not priorities.is_floating_point():
        raise TypeError(f"priorities must be a floating-point tensor, got dtype "
                        f"{priorities.dtype}")
      if priorities.device.type != "cpu":
        return self._queue_device_update(keys, priorities, table)
    super().update_priorities(keys, _host_array(priorities), table)

  def _queue_device_update(self, keys, priorities, table) -> None:
    flat = priorities.detach().reshape(-1)
    host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(flat.device))

    def fetch():
      event.synchronize()
      return host.numpy()
    self._queue_async_update(keys, flat.numel(), table, fetch)


def _copy_to_device(t: "torch.Tensor", device) -> "torch.Tensor":
  """An asynchronous copy of host tensor t (pinned) to `device`, on the current stream."""
  return t.to(device, non_blocking=True)


def _used_on(t: "torch.Tensor", stream) -> None:
  """Tells the caching allocator that t (made on the copy stream) is used on `stream`."""
  t.record_stream(stream)


def _torch_dtype(dtype) -> "torch.dtype":
  """The torch dtype torch.from_numpy gives arrays of `dtype` (as on the CPU path)."""
  try:
    return torch.from_numpy(np.empty(0, dtype)).dtype
  except TypeError:
    raise ValueError(f"columns of dtype {np.dtype(dtype)} have no torch dtype") from None


def _map(data, fn):
  leaves, treedef = structure.flatten(data)
  return structure.unflatten(treedef, [fn(a) for a in leaves])


def _tensors(batch: Batch):
  return structure.flatten(batch.data)[0] + [t for t in (batch.weights, batch.mask)
                                             if t is not None]
