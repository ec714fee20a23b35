"""Numeric constructor arguments taken as dm-reverb's bindings take them.

Reverb's pybind11 bindings refuse a Python float (even 3.0), a string or None where the C++
side wants an int, and an int outside int32; they accept Python and numpy integers (and
bools, which are ints). A float argument takes anything with ``__float__`` but a string.
"""
import numbers
import operator

import numpy as np

from reverb_shm import errors

__all__ = ["int32_argument", "number_argument"]

_INT32_MIN, _INT32_MAX = -2**31, 2**31 - 1


def int32_argument(value, name: str, allow_bool: bool = True) -> int:
  """`value` as a Python int.

  Args:
    value: a Python int, a numpy integer scalar, or (allow_bool) a bool / numpy bool.
    name: the argument's name, for the message.
    allow_bool: whether True / False are taken as 1 / 0 (as Reverb's bindings do).

  Raises:
    ArgumentTypeError (a TypeError and a ValueError): a float (3.0 too; numpy floats too), a
      string, None or another non-integer; a bool when not allowed; a value outside int32.
  """
  if isinstance(value, (bool, np.bool_)):
    if not allow_bool:
      raise errors.ArgumentTypeError(f"{name} must be an int, got a bool ({value!r})")
    return int(value)
  if isinstance(value, (float, np.floating)) or not hasattr(value, "__index__"):
    raise errors.ArgumentTypeError(f"{name} must be an int (or a numpy integer), got {value!r} "
                                   f"of type {type(value).__name__}")
  result = operator.index(value)
  if not _INT32_MIN <= result <= _INT32_MAX:
    raise errors.ArgumentTypeError(f"{name} must fit a 32-bit int ({_INT32_MIN}..{_INT32_MAX}), "
                                   f"as in Reverb, got {result}")
  return result


def number_argument(value, name: str):
  """`value` unchanged when it is a real number (int, float, numpy number), else float(value).

  Raises:
    TypeError: a string or bytes, or a value float() does not take.
  """
  if isinstance(value, numbers.Real):
    return value
  if isinstance(value, (str, bytes)):
    raise TypeError(f"{name} must be a number, got {value!r}")
  try:
    return float(value)
  except (TypeError, ValueError):
    raise TypeError(f"{name} must be a number, got {value!r}") from None
