"""numpy arrays as jax.Arrays on a device or sharding: what ``jax.device_put`` makes of them,
with a fraction of its per-call work.

``jax.device_put(leaves, placement)`` spends tens of microseconds per call in Python (it
flattens, infers shardings, canonicalises dtypes and checks every leaf), more than the native
sampler needs to gather a small batch. A Putter does that work once per column (shape, dtype):
the dtype jax gives the column (64-bit types become 32-bit without jax_enable_x64), the abstract
value, the devices and the rows of the batch each device holds, and then puts every leaf with
jaxlib's transfer (``jax._src.lib.xla_client.batched_device_put``, which ``jax.device_put``
ends in for numpy arrays). It checks once per column that the result equals
what ``jax.device_put`` makes of the same leaf (dtype, shape, sharding, values); a jax version
without that function, or one whose result differs, gets ``jax.device_put`` itself.

Aliasing: on the CPU both may alias the numpy buffer instead of copying it (jax keeps the array
alive). A caller must therefore never write an array it has put: the learner iterator puts only
buffers handed off to the batch (never gathered into again).
"""
from typing import Any, Dict, List, Optional, Tuple

import jax
import numpy as np

__all__ = ["Putter"]


def _private_put():
  """(ShapedArray, batched_device_put) of this jax version, or None where it has none."""
  try:
    from jax._src.core import ShapedArray  # pylint: disable=import-outside-toplevel
    from jax._src.lib import xla_client  # pylint: disable=import-outside-toplevel
    return ShapedArray, xla_client.batched_device_put
  except (ImportError, AttributeError):   # pragma: no cover - depends on the jax version
    return None


_PRIVATE = _private_put()


class Putter:
  """Puts lists of numpy arrays on `placement` (a jax.Device or a jax.sharding.Sharding).

  Args:
    placement: where every leaf goes, as ``jax.device_put``'s second argument.
  """

  def __init__(self, placement):
    self.placement = placement
    self._sharding = placement if isinstance(placement, jax.sharding.Sharding) else \
        jax.sharding.SingleDeviceSharding(placement)
    # (shape, dtype, x64) -> (abstract value, dtype to convert to or None, devices, the index
    # of each device's rows or None), or None: that column goes through jax.device_put
    self._plans: Dict[Tuple[Any, ...], Optional[tuple]] = {}

  def put(self, leaves: List[np.ndarray]) -> list:
    """jax.Arrays of `leaves` (numpy arrays, C-contiguous), equal to
    ``jax.device_put(leaves, placement)``; the leaves may be aliased (never write them again)."""
    out = []
    x64 = bool(getattr(jax.config, "jax_enable_x64", False))   # (the dtypes jax gives depend on it)
    plans, sharding = self._plans, self._sharding
    for x in leaves:
      plan = plans.get((x.shape, x.dtype, x64))
      if plan is None or _PRIVATE is None:
        out.append(self._put_unplanned(x, x64))
        continue
      aval, dtype, devices, indices = plan
      if dtype is not None:
        x = x.astype(dtype)
      out.append(_PRIVATE[1](aval, sharding, [x] if indices is None else [x[i] for i in indices],
                             devices, True))
    return out

  def _put_unplanned(self, x: np.ndarray, x64: bool):
    """x put by jax.device_put; plans x's column on first sight."""
    key = (x.shape, x.dtype, x64)
    if key in self._plans:   # (planned as None: jax.device_put's)
      return jax.device_put(x, self.placement)
    plan, first = self._plan(x)   # (checked against jax.device_put on this leaf)
    self._plans[key] = plan
    return first

  def _plan(self, x: np.ndarray):
    """(the plan of x's column, or None when jax.device_put must do it; x put)."""
    expected = jax.device_put(x, self.placement)
    if _PRIVATE is None:   # pragma: no cover - depends on the jax version
      return None, expected
    try:
      dtype = np.dtype(expected.dtype)
      sharding = self._sharding
      if sharding.is_fully_replicated:
        if len(sharding.device_set) != 1:   # (copies on several devices: jax.device_put)
          return None, expected
        devices, indices = list(sharding.device_set), None
      else:
        index_map = sharding.addressable_devices_indices_map(x.shape)
        devices = list(index_map)
        indices = [index_map[d] for d in devices]
      plan = (_PRIVATE[0](x.shape, dtype), None if x.dtype == dtype else dtype, devices, indices)
      y = x if x.dtype == dtype else x.astype(dtype)
      got = _PRIVATE[1](plan[0], sharding, [y] if indices is None else [y[i] for i in indices],
                        devices, True)
      same = (got.dtype == expected.dtype and got.shape == expected.shape and
              got.sharding == expected.sharding and
              np.array_equal(np.asarray(got), np.asarray(expected), equal_nan=dtype.kind in "fc"))
    except Exception:   # pylint: disable=broad-except  # (any change of the private function)
      return None, expected
    return (plan if same else None), expected
