"""JAX learner iterator: fixed-shape prioritized batches as jax.Arrays, sharded when asked.

    import reverb_shm.jax as rjax

    with rjax.JaxIterator(client, "replay", batch_size=256, sharded=True,
                          importance_beta=0.4) as batches:
      for batch in batches:
        state, td = train_step(state, batch.data, batch.weights)   # jit: one shape, no recompiles
        batches.update_priorities(batch.info.key, td)               # jax.Array or numpy

Every batch is a reverb_shm.learner.Batch whose ``data`` leaves and ``weights`` / ``mask`` are
jax.Arrays on the device (what ``jax.device_put`` makes of the gathered arrays); ``info`` stays
numpy. With ``sharded=True`` the batch
dimension is split over ``jax.local_devices()`` (a NamedSharding over a 1-d mesh;
batch_size must be a multiple of the device count); else ``device`` (default: the first
local device). Prefetch, fixed shapes, mixing, seeds and errors as BatchIterator
(reverb_shm.learner).

dtypes: as ``jax.device_put`` makes them: 64-bit columns (int64, float64, uint64) become 32-bit
unless ``jax.config.update('jax_enable_x64', True)``; the info keys stay numpy uint64.

Sampling: after the first batch the native sampler thread of BatchIterator gathers (it never
takes the GIL), as for the torch iterator; ``next()`` takes a gathered batch and puts its arrays
on the device (on the CPU: aliases of the gathered buffers, no copy; on an accelerator: a
transfer that computations using the arrays wait for, not the learner's thread). The first
batch, and those of mixed tables or ``partial=True``, are gathered and put by a Python thread,
which waits there for the transfer to finish.

Buffers: jax.Arrays are immutable, and the CPU backend may alias a numpy buffer instead of
copying it, so every batch is gathered into buffers of its own (``copy=True`` of
BatchIterator): a ring buffer whose batch was taken is handed to that batch for good and gets
new arrays to gather into. A batch the learner holds therefore never changes, however many it
draws after it, and on the CPU the gather is the only copy.
"""
import threading
from typing import Any

try:
  import jax
except ImportError as e:   # pragma: no cover - exercised without the extra installed
  raise ImportError("reverb_shm.jax needs JAX: pip install 'reverb_shm[jax]'") from e

import numpy as np

from reverb_shm import learner
from reverb_shm._internal import structure
from reverb_shm.jax._put import Putter
from reverb_shm.learner import Batch, importance_weights

__all__ = ["Batch", "JaxIterator", "importance_weights"]


class JaxIterator(learner.BatchIterator):
  """BatchIterator delivering jax.Arrays (see the module docstring).

  Args:
    source: as BatchIterator.
    table: as BatchIterator.
    batch_size: as BatchIterator.
    device: a jax.Device (default: jax.local_devices()[0]); not with sharded=True.
    sharded: split the batch dimension over all local devices.
    **kwargs: prefetch, timeout_ms, partial, importance_beta, seed, mask_key, as BatchIterator.

  Raises:
    ValueError: device not a jax.Device; sharded with a device; batch_size not a multiple of the
      local device count; partial with sharded (a partial batch cannot be split evenly).
  """

  def __init__(self, source, table=None, batch_size: int = 256, *, device=None,
               sharded: bool = False, **kwargs):
    for name in ("allocate", "transform", "copy", "keep"):
      if name in kwargs:
        raise TypeError(f"JaxIterator does not take {name}= (every batch has buffers of its own)")
    if sharded:
      if device is not None:
        raise ValueError("pass either device= or sharded=True, not both")
      if kwargs.get("partial"):
        raise ValueError("partial batches cannot be sharded evenly: use sharded=False")
      devices = jax.local_devices()
      if isinstance(batch_size, (int, np.integer)) and batch_size % len(devices):
        raise ValueError(f"batch_size {batch_size} is not a multiple of the {len(devices)} local "
                         "devices it is sharded over")
      mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
      self._placement = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    else:
      if device is None:
        device = jax.local_devices()[0]
      if not isinstance(device, jax.Device):
        raise ValueError(f"device must be a jax.Device (e.g. jax.devices()[0]), got {device!r}")
      self._placement = device
    self.sharded = bool(sharded)
    self._putter = Putter(self._placement)
    self._treedef: Any = None   # (of a whole batch's data: its leaves are its slot's arrays)
    self._native_ok = True   # (the transform only puts arrays: next() may run it)
    super().__init__(source, table, batch_size, copy=True, transform=self._put, **kwargs)

  def _put(self, batch: Batch, slot) -> Batch:
    """The batch with jax.Arrays of its (handed-off) arrays; in the Python sampling thread it
    waits for the transfer, in the consumer's (batches of the native sampler) it does not."""
    weights, mask = batch.weights, batch.mask
    if self._treedef is not None and len(batch.info.key) == self.batch_size:
      leaves, treedef = list(slot.columns), self._treedef   # (a whole batch: the slot's arrays)
    else:
      leaves, treedef = structure.flatten(batch.data)
      if len(batch.info.key) == self.batch_size:
        self._treedef = treedef
    count = len(leaves)
    if weights is not None:
      leaves.append(weights)
    if mask is not None:
      leaves.append(mask)
    arrays = self._putter.put(leaves)
    if threading.current_thread() is self._thread:
      jax.block_until_ready(arrays)
    return Batch(structure.unflatten(treedef, arrays[:count]), batch.info,
                 None if weights is None else arrays[count],
                 None if mask is None else arrays[-1], batch.table)

  def update_priorities(self, keys, priorities, table=None) -> None:
    """As BatchIterator.update_priorities; keys and priorities may be jax.Arrays on any device.
    A jax.Array of priorities already computed on the CPU is queued as numpy priorities are;
    any other starts its copy to the host here and the background thread waits for it (the
    learner does not wait for the computation producing it).

    Raises:
      TypeError: keys not integers, or a jax.Array of 32-bit keys (truncated); priorities not
        floating point.
      ValueError: as BatchIterator.update_priorities (for a jax.Array, values not finite or
        negative are found by the background thread and raised by the next call).
    """
    if isinstance(keys, jax.Array):
      if keys.dtype.itemsize < 8:   # (keys are 64-bit: jax made a 32-bit copy of them)
        raise TypeError(f"keys must be 64-bit (Batch.info.key, numpy uint64), got a jax.Array of "
                        f"dtype {keys.dtype}, which holds them truncated (without "
                        "jax_enable_x64 jax has no 64-bit integers): pass batch.info.key itself")
      keys = np.asarray(jax.device_get(keys))
    if isinstance(priorities, jax.Array) and _ready_on_cpu(priorities):
      priorities = np.asarray(priorities)   # (a view of the host buffer: nothing to wait for)
    if not isinstance(priorities, jax.Array):
      return super().update_priorities(keys, priorities, table)
    if not jax.numpy.issubdtype(priorities.dtype, jax.numpy.floating):
      raise TypeError(f"priorities must be an array of a floating dtype, got dtype "
                      f"{priorities.dtype}")
    priorities.copy_to_host_async()
    self._queue_async_update(keys, priorities.size, table, lambda: np.asarray(priorities))


def _ready_on_cpu(array) -> bool:
  """Whether jax.Array `array` is computed and in host memory (np.asarray of it does not wait)."""
  is_ready = getattr(array, "is_ready", None)
  return is_ready is not None and all(d.platform == "cpu" for d in array.sharding.device_set) \
      and is_ready()
