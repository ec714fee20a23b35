"""Timeout arguments (docs/differences.md#timeouts): None waits forever, 0 polls, negative is an error.

A timeout so large that its deadline does not fit CLOCK_MONOTONIC nanoseconds in int64 (about
292 years from boot), float('inf') included, also waits forever; NaN is an error.
"""
import time
from typing import Optional

# Blocking C calls return RS_EAGAIN after this slice so Python can handle signals (Ctrl-C).
SLICE_NS = 100_000_000
_MAX_DEADLINE_NS = 2**63 - 1


def deadline_from_ms(timeout_ms: Optional[float], name: str = "timeout_ms") -> int:
  """Converts a relative timeout to an absolute CLOCK_MONOTONIC deadline in ns.

  Args:
    timeout_ms: None (no deadline), 0 (do not wait) or a positive number of milliseconds.
    name: argument name used in the error message.

  Returns:
    -1 for no deadline (None, or a timeout too large for an int64 deadline, inf included),
    else the deadline in monotonic nanoseconds.

  Raises:
    ValueError: `timeout_ms` is negative or not a number.
  """
  if timeout_ms is None:
    return -1
  if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, (int, float)):
    try:
      timeout_ms = float(timeout_ms)
    except (TypeError, ValueError):
      raise ValueError(f"{name} must be None or a number of milliseconds >= 0, "
                       f"got {timeout_ms!r}") from None
  if not timeout_ms >= 0:
    raise ValueError(f"{name} must be None (wait forever) or >= 0 milliseconds, got {timeout_ms}")
  # time.monotonic_ns reads CLOCK_MONOTONIC, the clock of rs_now_ns().
  now = time.monotonic_ns()
  if timeout_ms >= (_MAX_DEADLINE_NS - now) / 1_000_000:
    return -1
  return now + int(timeout_ms * 1_000_000)


def remaining_ms(deadline_ns: int) -> Optional[float]:
  """The timeout_ms left until `deadline_ns` (from deadline_from_ms): None if -1, else >= 0."""
  if deadline_ns == -1:
    return None
  return max(0.0, (deadline_ns - time.monotonic_ns()) / 1_000_000)
