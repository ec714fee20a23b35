"""Random uint64 values for item keys and episode ids."""
import os

import numpy as np

__all__ = ["random_u64"]


class _RandomU64:
  """Random uint64 values (item keys, episode ids), re-seeded from the OS after a fork."""

  def __init__(self):
    self._pid = None
    self._rng = None
    self._pool = []

  def __call__(self, n: int) -> np.ndarray:
    """n random uint64 values."""
    pid = os.getpid()
    if pid != self._pid:
      self._rng = np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
      self._pool = []
      self._pid = pid
    return self._rng.bit_generator.random_raw(n)

  def one(self) -> int:
    """One random uint64 as a Python int (drawn from a pool refilled 1024 at a time)."""
    if self._pid != os.getpid() or not self._pool:
      self._pool = self(1024).tolist()
    return self._pool.pop()


random_u64 = _RandomU64()
