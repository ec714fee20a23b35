"""Rate limiters: configuration of how far samples may run ahead of inserts.

The formulas run in the C core. Objects are immutable configuration and thread-safe; one
object may configure several tables.
"""
import logging
import math
import numbers
import sys
from typing import Any, Tuple, Union

from reverb_shm._internal.arguments import int32_argument, number_argument

__all__ = ["RateLimiter", "MinSize", "SampleToInsertRatio", "Queue", "Stack"]

_FLOAT_MAX = sys.float_info.max
_log = logging.getLogger(__name__)


class RateLimiter:
  """Reverb's base rate limiter.

  can_sample(n): size >= min_size_to_sample and inserts*spi - samples - n >= min_diff.
  can_insert(n): inserts + n - deletes <= min_size_to_sample, or
                 (inserts + n)*spi - samples <= max_diff.

  Args:
    samples_per_insert: float > 0.
    min_size_to_sample: int >= 1 (a Python or numpy integer, as in Reverb).
    min_diff: float, lower bound of inserts*spi - samples.
    max_diff: float, upper bound of inserts*spi - samples.

  Raises:
    ArgumentTypeError (a TypeError and a ValueError): min_size_to_sample not an integer (a
      float, even 3.0, or a string) or outside int32.
    TypeError: a float argument that is a string or no number.
    ValueError: samples_per_insert <= 0 or not finite, min_size_to_sample <= 0,
      min_diff > max_diff or NaN.
  """

  def __init__(self, samples_per_insert: float, min_size_to_sample: int, min_diff: float,
               max_diff: float):
    spi = float(number_argument(samples_per_insert, "samples_per_insert"))
    min_size = int32_argument(min_size_to_sample, "min_size_to_sample")
    min_diff = float(number_argument(min_diff, "min_diff"))
    max_diff = float(number_argument(max_diff, "max_diff"))
    if not 0 < spi < float("inf"):
      raise ValueError(f"samples_per_insert must be finite and > 0, got {samples_per_insert}")
    if min_size <= 0:
      raise ValueError(f"min_size_to_sample must be >= 1, got {min_size_to_sample}")
    if min_diff != min_diff or max_diff != max_diff:
      raise ValueError(f"min_diff and max_diff must not be NaN, got {min_diff}, {max_diff}")
    if min_diff > max_diff:
      raise ValueError(f"min_diff ({min_diff}) must be <= max_diff ({max_diff})")
    self._samples_per_insert = spi
    self._min_size_to_sample = min_size
    self._min_diff = min_diff
    self._max_diff = max_diff

  samples_per_insert = property(lambda self: self._samples_per_insert)
  min_size_to_sample = property(lambda self: self._min_size_to_sample)
  min_diff = property(lambda self: self._min_diff)
  max_diff = property(lambda self: self._max_diff)

  def _params(self):
    return (self._samples_per_insert, self._min_size_to_sample, self._min_diff, self._max_diff)

  def __eq__(self, other):
    return isinstance(other, RateLimiter) and self._params() == other._params()

  def __hash__(self):
    return hash(self._params())

  def __repr__(self):
    return (f"{type(self).__name__}(samples_per_insert={self._samples_per_insert}, "
            f"min_size_to_sample={self._min_size_to_sample}, min_diff={self._min_diff}, "
            f"max_diff={self._max_diff})")

  def __reduce__(self):
    return RateLimiter, self._params()


class MinSize(RateLimiter):
  """Blocks sampling until the table holds `min_size_to_sample` items; never blocks inserts.

  Raises:
    ArgumentTypeError (a TypeError and a ValueError): min_size_to_sample not an integer (a
      float, even 3.0, or a string) or outside int32.
    ValueError: min_size_to_sample < 1.
  """

  def __init__(self, min_size_to_sample: int):
    if int32_argument(min_size_to_sample, "min_size_to_sample") < 1:
      raise ValueError(f"min_size_to_sample must be >= 1, got {min_size_to_sample}")
    super().__init__(1.0, min_size_to_sample, -_FLOAT_MAX, _FLOAT_MAX)


class SampleToInsertRatio(RateLimiter):
  """Keeps samples/inserts near `samples_per_insert`, within `error_buffer`.

  Args:
    samples_per_insert: average number of times each item is sampled, > 0.
    min_size_to_sample: items required before sampling starts, >= 1.
    error_buffer: a number b (diff kept in [spi*min_size - b, spi*min_size + b]) or an explicit
      (min_diff, max_diff) pair.

  Raises:
    ArgumentTypeError (a TypeError and a ValueError): min_size_to_sample not an integer (a
      float, even 3.0, or a string) or outside int32.
    ValueError: spi <= 0 or infinite; a NaN or infinite error_buffer;
      max_diff - min_diff < 2*max(1, spi); min_diff > spi*min_size;
      min_size_to_sample < 1. (max_diff < spi*min_size only logs a warning: it can deadlock
      unless inserts and samples run concurrently.)
  """

  def __init__(self, samples_per_insert: float, min_size_to_sample: int,
               error_buffer: Union[float, Tuple[float, float]]):
    spi = float(number_argument(samples_per_insert, "samples_per_insert"))
    if not 0 < spi < float("inf"):
      raise ValueError(f"samples_per_insert ({samples_per_insert}) must be finite and > 0")
    min_size = int32_argument(min_size_to_sample, "min_size_to_sample")
    offset = spi * min_size
    if isinstance(error_buffer, numbers.Real) and not isinstance(error_buffer, bool):
      # (numpy scalars too: np.float32(2.5) is a number, not a pair)
      min_diff, max_diff = offset - float(error_buffer), offset + float(error_buffer)
    else:
      try:
        pair: Any = error_buffer   # (a number was handled above)
        min_diff, max_diff = (float(x) for x in pair)
      except (TypeError, ValueError):
        raise ValueError("error_buffer must be a number or a (min_diff, max_diff) pair, got "
                         f"{error_buffer!r}") from None
    if not (math.isfinite(min_diff) and math.isfinite(max_diff)):
      raise ValueError(f"error_buffer must be finite, got {error_buffer!r} (min_diff={min_diff}, "
                       f"max_diff={max_diff})")
    if max_diff - min_diff < 2 * max(1.0, spi):
      raise ValueError(
          f"The size of the error buffer ({max_diff - min_diff}, from min_diff={min_diff} to "
          f"max_diff={max_diff}) must be at least 2 * max(1.0, samples_per_insert) = "
          f"{2 * max(1.0, spi)}")
    if max_diff < offset:
      _log.warning("max_diff (%s) < samples_per_insert * min_size_to_sample (%s): inserts may "
                   "block until samples run, which deadlocks if they cannot run concurrently.",
                   max_diff, offset)
    if min_diff > offset:
      raise ValueError(f"min_diff ({min_diff}) must be <= samples_per_insert * "
                       f"min_size_to_sample ({offset}), or sampling could never start")
    if min_size < 1:
      raise ValueError(f"min_size_to_sample must be >= 1, got {min_size_to_sample}")
    super().__init__(spi, min_size_to_sample, min_diff, max_diff)


class Queue(RateLimiter):
  """At most `size` unsampled items outstanding (use with Fifo and max_times_sampled=1).

  Raises:
    TypeError: size not a number (a string). ValueError: size < 1.
  """

  def __init__(self, size: int):
    if number_argument(size, "size") < 1:
      raise ValueError(f"size must be >= 1, got {size}")
    super().__init__(1.0, 1, 0.0, float(size))


class Stack(RateLimiter):
  """Same numbers as :class:`Queue` (meant for Lifo selectors).

  Raises:
    TypeError: size not a number (a string). ValueError: size < 1.
  """

  def __init__(self, size: int):
    if number_argument(size, "size") < 1:
      raise ValueError(f"size must be >= 1, got {size}")
    super().__init__(1.0, 1, 0.0, float(size))
