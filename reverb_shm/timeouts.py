"""Timeout arguments (SPEC "Our decisions" 2): None waits forever, 0 polls, negative is an error."""
import time
from typing import Optional

# Blocking C calls return RS_EAGAIN after this slice so Python can handle signals (Ctrl-C).
SLICE_NS = 100_000_000


def deadline_from_ms(timeout_ms: Optional[float], name: str = "timeout_ms") -> int:
  """Converts a relative timeout to an absolute CLOCK_MONOTONIC deadline in ns.

  Args:
    timeout_ms: None (no deadline), 0 (do not wait) or a positive number of milliseconds.
    name: argument name used in the error message.

  Returns:
    -1 for no deadline, else the deadline in monotonic nanoseconds.

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
  return time.monotonic_ns() + int(timeout_ms * 1_000_000)
