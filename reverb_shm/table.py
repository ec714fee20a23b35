"""Table configuration and the TableInfo snapshot.

A :class:`Table` built by the user is configuration. Once a :class:`~reverb_shm.Server` owns
it, `info`, `can_sample` and `can_insert` read the live table in shared memory. Thread-safe.
"""
import warnings
from typing import Any, Sequence

import msgpack

from reverb_shm import errors, shared_table, specs
from reverb_shm import rate_limiters as rate_limiters_lib
from reverb_shm import selectors as selectors_lib
from reverb_shm._internal.arguments import int32_argument
from reverb_shm._internal.table_info import (
  RateLimiterCallStats,
  RateLimiterInfo,
  TableInfo,
  TableWorkerTime,
  table_info,
)

__all__ = ["Table", "TableInfo", "RateLimiterInfo", "RateLimiterCallStats", "TableWorkerTime",
           "table_info", "MAX_NAME_BYTES", "MAX_SIZE"]

MAX_NAME_BYTES = 63
# Largest max_size the C core lays out (its record capacity, max_size + 1, is at most 2**30 - 1).
MAX_SIZE = 2**30 - 2
_BLOB_VERSION = 1


def _check_name(name) -> str:
  if not isinstance(name, str):
    raise TypeError(f"table name must be a str, got {type(name).__name__}")
  if not name:
    raise ValueError("table name must not be empty")
  if "\0" in name or "/" in name:
    raise ValueError(f"table name {errors.quoted_name(name)} must not contain NUL or '/'")
  if len(name.encode("utf-8")) > MAX_NAME_BYTES:
    raise ValueError(f"table name {errors.quoted_name(name)} is longer than {MAX_NAME_BYTES} "
                     f"bytes (UTF-8)")
  return name


class Table:
  """A replay table.

  Args:
    name: unique within its server; 1..63 UTF-8 bytes, no '/'.
    sampler: selector choosing sampled items (see :mod:`reverb_shm.selectors`).
    remover: selector choosing the item evicted when the table exceeds `max_size`.
    max_size: maximum number of items, 1..MAX_SIZE (2**30 - 2); a Python or numpy integer.
    rate_limiter: a :class:`~reverb_shm.rate_limiters.RateLimiter`.
    max_times_sampled: items are removed after this many samples; < 1 means unlimited; a
      Python or numpy integer (int32).
    extensions: accepted for compatibility and stored (not run).
    signature: optional nest of TensorSpec-like objects; items inserted into the table are
      checked against it and sampled data is unflattened to it.

  A rate limiter whose min_size_to_sample exceeds max_size is accepted, as Reverb does, with a
  UserWarning: the table can never hold that many items, so sampling would wait forever.

  Raises:
    ArgumentTypeError (a TypeError and a ValueError): max_size or max_times_sampled not an
      integer (a float, even 3.0, a bool or a string) or outside int32.
    ValueError: empty name, max_size outside 1..MAX_SIZE, unsupported signature leaf.
    TypeError: sampler/remover/rate_limiter of the wrong type.
  """

  def __init__(self, name: str, sampler: selectors_lib.ItemSelector,
               remover: selectors_lib.ItemSelector, max_size: int,
               rate_limiter: rate_limiters_lib.RateLimiter, max_times_sampled: int = 0,
               extensions: Sequence[Any] = (), signature: Any = None):
    self._name = _check_name(name)
    for arg, value in (("sampler", sampler), ("remover", remover)):
      if not isinstance(value, selectors_lib.ItemSelector):
        raise TypeError(f"{arg} must be a reverb_shm.selectors selector (Uniform(), "
                        f"Prioritized(e), Fifo(), ...), got {value!r}")
    if not isinstance(rate_limiter, rate_limiters_lib.RateLimiter):
      raise TypeError(f"rate_limiter must be a reverb_shm.rate_limiters.RateLimiter, "
                      f"got {rate_limiter!r}")
    max_size = int32_argument(max_size, "max_size", allow_bool=False)
    if max_size <= 0:
      raise ValueError(f"max_size must be > 0, got {max_size}")
    if max_size > MAX_SIZE:
      raise ValueError(f"max_size must be <= {MAX_SIZE} (2**30 - 2, the largest table the "
                       f"shared-memory layout holds), got {max_size}")
    if rate_limiter.min_size_to_sample > max_size:
      warnings.warn(f"table {errors.quoted_name(name)}: min_size_to_sample "
                    f"({rate_limiter.min_size_to_sample}) > "
                    f"max_size ({max_size}): the table never holds that many items, so sampling "
                    "from it will wait forever", UserWarning, stacklevel=2)
    max_times_sampled = int32_argument(max_times_sampled, "max_times_sampled", allow_bool=False)
    self._sampler = sampler
    self._remover = remover
    self._max_size = max_size
    self._rate_limiter = rate_limiter
    self._max_times_sampled = max_times_sampled
    self._extensions = tuple(extensions)
    self._signature = specs.validate_signature(signature)
    self._live: Any = None  # (Segment, table index) while a server owns this table.
    self._final: Any = None  # (TableInfo, rs stats) left by the last server that stopped

  # ---- configuration
  name = property(lambda self: self._name)
  sampler = property(lambda self: self._sampler)
  remover = property(lambda self: self._remover)
  max_size = property(lambda self: self._max_size)
  max_times_sampled = property(lambda self: self._max_times_sampled)
  rate_limiter = property(lambda self: self._rate_limiter)
  extensions = property(lambda self: self._extensions)
  signature = property(lambda self: self._signature)

  @classmethod
  def queue(cls, name: str, max_size: int, extensions=(), signature=None) -> "Table":
    """Fifo table whose items are sampled once; inserts block when `max_size` are pending."""
    return cls(name, selectors_lib.Fifo(), selectors_lib.Fifo(), max_size,
               rate_limiters_lib.Queue(max_size), max_times_sampled=1, extensions=extensions,
               signature=signature)

  @classmethod
  def stack(cls, name: str, max_size: int, extensions=(), signature=None) -> "Table":
    """Lifo table whose items are sampled once; same limiter numbers as :meth:`queue`."""
    return cls(name, selectors_lib.Lifo(), selectors_lib.Lifo(), max_size,
               rate_limiters_lib.Stack(max_size), max_times_sampled=1, extensions=extensions,
               signature=signature)

  def config_blob(self) -> bytes:
    """msgpack blob stored with the table in shared memory (signature etc.)."""
    return msgpack.packb({"version": _BLOB_VERSION,
                          "signature": specs.encode_signature(self._signature)},
                         use_bin_type=True)

  # ---- live binding (used by Server)
  def _check_unbound(self) -> None:
    """ValueError if a running server owns this table (a Table serves one server at a time)."""
    if self._live is not None:
      raise ValueError(
          f"table {errors.quoted_name(self._name)} already belongs to running server "
          f"{errors.quoted_name(self._live[0].name)}: a "
          "Table object serves one server at a time; stop that server first, or pass "
          "table.replace() (a new table with the same configuration)")

  def _bind(self, segment, index: int) -> None:
    self._check_unbound()
    self._live = (segment, index)
    self._final = None

  def _unbind(self) -> None:
    """Detaches from the stopping server, keeping the table's last state (as Reverb's table
    object keeps its items): info and the limiter predicates report it until the next bind."""
    live = self._live_table()
    if live is not None:
      stats = live.stats()
      self._final = (table_info(self._name, stats, live.signature), stats)
    self._live = None

  def _live_table(self):
    if self._live is None:
      return None
    return shared_table.SharedTable(*self._live)

  # ---- state
  @property
  def info(self) -> TableInfo:
    """Live TableInfo when a server owns the table; after it stopped, the table's last state;
    before any server, the configuration with zero counters."""
    live = self._live_table()
    if live is not None:
      return live.info
    if self._final is not None:
      return self._final[0]
    rl = self._rate_limiter
    return TableInfo(
        name=self._name, sampler_options=self._sampler.options(),
        remover_options=self._remover.options(), max_size=self._max_size,
        max_times_sampled=self._max_times_sampled,
        rate_limiter_info=RateLimiterInfo(rl.samples_per_insert, rl.min_diff, rl.max_diff,
                                          rl.min_size_to_sample),
        signature=specs.user_signature(self._signature), current_size=0, num_episodes=0,
        num_deleted_episodes=0,
        num_unique_samples=0, table_worker_time=TableWorkerTime())

  def can_sample(self, num_samples: int) -> bool:
    """Rate-limiter-only predicate (ignores max_size and max_times_sampled)."""
    live = self._live_table()
    if live is not None:
      return live.can_sample(num_samples)
    spi, min_size, min_diff, _, inserts, samples, deletes = self._limiter_state()
    return inserts - deletes >= min_size and inserts * spi - samples - num_samples >= min_diff

  def can_insert(self, num_inserts: int) -> bool:
    """Rate-limiter-only predicate (ignores max_size)."""
    live = self._live_table()
    if live is not None:
      return live.can_insert(num_inserts)
    spi, min_size, _, max_diff, inserts, samples, deletes = self._limiter_state()
    return (inserts + num_inserts - deletes <= min_size
            or (inserts + num_inserts) * spi - samples <= max_diff)

  def _limiter_state(self) -> tuple:
    """(samples_per_insert, min_size_to_sample, min_diff, max_diff, inserts, samples, deletes)
    when no server owns the table: as the last server left them, else the configuration's
    with zero counters."""
    if self._final is None:
      rl = self._rate_limiter
      return (rl.samples_per_insert, rl.min_size_to_sample, rl.min_diff, rl.max_diff, 0, 0, 0)
    stats = self._final[1]
    return tuple(stats[k] for k in ("samples_per_insert", "min_size_to_sample", "min_diff",
                                    "max_diff", "inserts", "samples", "deletes"))

  def replace(self, name=None, sampler=None, remover=None, max_size=None, rate_limiter=None,
              max_times_sampled=None, extensions=None, signature=None) -> "Table":
    """A new, empty table copying this one's configuration except the given overrides."""
    info = self.info
    rli = info.rate_limiter_info
    if rate_limiter is None:
      rate_limiter = rate_limiters_lib.RateLimiter(rli.samples_per_insert,
                                                   rli.min_size_to_sample, rli.min_diff,
                                                   rli.max_diff)
    return Table(
        name=self._name if name is None else name,
        sampler=self._sampler if sampler is None else sampler,
        remover=self._remover if remover is None else remover,
        max_size=info.max_size if max_size is None else max_size,
        rate_limiter=rate_limiter,
        max_times_sampled=(info.max_times_sampled if max_times_sampled is None
                           else max_times_sampled),
        extensions=self._extensions if extensions is None else extensions,
        signature=self._signature if signature is None else signature)

  def __repr__(self):
    return (f"Table(name={self._name!r}, sampler={self._sampler!r}, remover={self._remover!r}, "
            f"max_size={self._max_size}, rate_limiter={self._rate_limiter!r}, "
            f"max_times_sampled={self._max_times_sampled}, signature={self._signature!r})")
