"""Nests to columns, and the checks every writer, inserter and the bridge apply to them.

One place decides what a column may hold and whether an item fits its table:
  * `check_supported_dtype`: the numpy dtypes a column stores (float16/32/64, int8..64,
    uint8..64, bool, complex64/128, and str/bytes as object);
  * `flat_leaves` / `step_arrays`: a step's leaves in dm-tree order (flat dicts of str keys
    without optree, the hot paths' case), and as the arrays its column rows are written from;
  * `as_column_array` / `object_row`: a step's leaf as the array a column row is written from;
  * `flat_dict_keys`: the key order of a flat dict step (the C fast paths take leaves by key);
  * `check_priority` / `check_priorities`: priorities are finite numbers, never negative on a
    table with a Prioritized sampler or remover;
  * `check_signature`: an item's columns against a table's flattened signature (dtype, shape);
  * `window_starts`, `check_positive_int`: argument checks shared by the writers.

Every check raises ValueError (IndexError for out-of-range positions) saying what was wrong and
what was expected, before anything is written.
"""
import math
from typing import Any, List, Optional, Sequence

import numpy as np

from reverb_shm import errors
from reverb_shm._internal import structure

__all__ = ["LEAF_TYPES", "NUMERIC_VALUES", "flat_leaves", "step_arrays", "SUPPORTED_KINDS",
           "check_supported_dtype", "check_priority", "check_priorities",
           "check_signature", "shape_matches", "dtype_matches", "window_starts",
           "flat_dict_keys", "as_column_array", "object_row", "check_positive_int"]

# dtype.kind -> the item sizes a column stores ("O": str/bytes/objects as Python objects).
SUPPORTED_KINDS = {"f": (2, 4, 8), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "b": (1,),
                   "c": (8, 16), "O": (8,)}


# Types optree treats as leaves, whose dicts the hot paths flatten without optree.
LEAF_TYPES = frozenset([np.ndarray, float, int, bool, str, bytes, type(None)] +
                        [t for t in np.sctypeDict.values() if issubclass(t, np.generic)])
# Leaves used as they are (numeric numpy values expose their bytes); others go to to_array.
NUMERIC_VALUES = frozenset([np.ndarray] + [t for t in np.sctypeDict.values()
                                            if issubclass(t, np.generic) and
                                            np.dtype(t).kind in "biufc"])
_DICT_ORDERS: dict = {}   # tuple of a dict's str keys in insertion order -> the keys sorted
_MAX_ORDERS = 256


def flat_leaves(nest: Any) -> List[Any]:
  """The leaves of `nest` in structure.flatten's order (dm-tree's: dict keys sorted).

  A plain dict of str keys whose values are leaves (arrays, numpy or Python scalars) is
  flattened without optree, several times faster; anything else goes through
  structure.flatten.
  """
  if type(nest) is dict:
    keys = tuple(nest)
    order = _DICT_ORDERS.get(keys)
    if order is None and all(type(k) is str for k in keys):
      if len(_DICT_ORDERS) >= _MAX_ORDERS:
        _DICT_ORDERS.clear()
      order = _DICT_ORDERS[keys] = tuple(sorted(keys))
    if order is not None:
      leaves = [nest[k] for k in order]
      if LEAF_TYPES.issuperset(map(type, leaves)):
        return leaves
  return structure.flatten(nest)[0]


def step_arrays(nest: Any) -> list:
  """flat_leaves of `nest` as arrays: numeric numpy values as they are (a numpy scalar is used
  through its buffer), other leaves through structure.to_array (which may raise ValueError)."""
  return [x if type(x) in NUMERIC_VALUES else structure.to_array(x)
          for x in flat_leaves(nest)]


def check_supported_dtype(dtype: np.dtype, path) -> None:
  """Raises ValueError naming `path` unless `dtype` can be stored in a column."""
  if dtype.itemsize not in SUPPORTED_KINDS.get(dtype.kind, ()) or dtype.fields is not None:
    raise ValueError(
        f"Unsupported dtype {dtype} for column {path}: expected one of float16/32/64, "
        "int8/16/32/64, uint8/16/32/64, bool, complex64/128, or str/bytes (object)")


def check_priority(priority, table_name: str, prioritized: bool) -> float:
  """Returns `priority` as a float; ValueError if NaN, infinite or negative on Prioritized."""
  try:
    if isinstance(priority, (str, bytes, bytearray)):   # (float() would parse them)
      raise TypeError
    value = float(priority)
  except (TypeError, ValueError):
    raise errors.ArgumentTypeError(f"`priority` must be a number, got {priority!r}") from None
  if math.isnan(value):
    raise ValueError("`priority` must not be nan.")
  if math.isinf(value):
    raise ValueError(f"`priority` must be finite, got {value}")
  if value < 0 and prioritized:
    raise ValueError(f"`priority` must not be negative for table "
                     f"{errors.quoted_name(table_name, plain=True)} (it uses a "
                     f"Prioritized selector), got {value}")
  return value


def shape_matches(spec_shape, shape) -> bool:
  if spec_shape is None:
    return True
  spec_shape = tuple(spec_shape)
  return len(spec_shape) == len(shape) and all(
      s is None or s == d for s, d in zip(spec_shape, shape))


def dtype_matches(spec_dtype, dtype: np.dtype) -> bool:
  spec_dtype = np.dtype(getattr(spec_dtype, "as_numpy_dtype", spec_dtype))
  if spec_dtype.kind in "OSU":
    return dtype.kind == "O"
  return spec_dtype == dtype


def check_signature(table_name: str, flat_signature: Optional[list], columns: Sequence[tuple],
                    *, allow_unbatched: bool = False) -> None:
  """Checks item columns against a table's flattened signature.

  Args:
    table_name: for messages.
    flat_signature: flattened signature specs (objects with .shape/.dtype) or None (no check).
    columns: (dtype, shape) of each item column as the sample will return it (time dim
      included unless squeezed).
    allow_unbatched: also accept a spec matching the shape without its leading dim (Client.insert,
      whose items are single steps described per step or per trajectory).

  Raises:
    ValueError: column count, dtype or shape incompatible with the signature.
  """
  if flat_signature is None:
    return
  if len(flat_signature) != len(columns):
    raise ValueError(
        f"Unable to create item in table {errors.quoted_name(table_name, plain=True)}: the table "
        f"signature has "
        f"{len(flat_signature)} columns but the item has {len(columns)}.")
  for i, (spec, (dtype, shape)) in enumerate(zip(flat_signature, columns)):
    if not dtype_matches(spec.dtype, dtype):
      raise ValueError(
          f"Unable to create item in table {errors.quoted_name(table_name, plain=True)}: column "
          f"{i} has dtype {dtype} but the "
          f"table signature expects {np.dtype(getattr(spec.dtype, 'as_numpy_dtype', spec.dtype))}"
          f" (spec {spec!r}).")
    ok = shape_matches(spec.shape, shape) or (
        allow_unbatched and len(shape) >= 1 and shape_matches(spec.shape, shape[1:]))
    if not ok:
      raise ValueError(
          f"Unable to create item in table {errors.quoted_name(table_name, plain=True)}: column "
          f"{i} has shape {list(shape)} "
          f"which is incompatible with the table signature shape "
          f"{None if spec.shape is None else list(spec.shape)} (spec {spec!r}).")


def window_starts(starts) -> np.ndarray:
  """int64 copy of create_window_items' `starts`; IndexError for values no int64 holds
  (an unsigned 2**64 - 1 must not wrap to -1, the last step)."""
  starts = np.asarray(starts)
  if starts.dtype.kind == "u" and starts.size and int(starts.max()) > np.iinfo(np.int64).max:
    raise errors.HistoryIndexError(f"window start {int(starts.max())} is out of range (starts are "
                                   "step positions in the history, negative counting from the "
                                   "end)")
  return np.ascontiguousarray(starts, np.int64)


def check_priorities(prios: np.ndarray, handle) -> None:
  """ValueError (check_priority's) for the first priority that is not finite, or negative on a
  Prioritized table."""
  bad = np.flatnonzero(~np.isfinite(prios) | ((prios < 0) & handle.prioritized))
  if len(bad):
    check_priority(prios[bad[0]], handle.name, handle.prioritized)


def flat_dict_keys(nest, num_leaves: int) -> Optional[tuple]:
  """`nest`'s str keys in flatten order when `nest` is a non-empty dict of `num_leaves` leaves
  with str keys (the C fast paths then take leaves by key); else None."""
  if type(nest) is not dict or len(nest) != num_leaves or not nest or not all(
      type(k) is str for k in nest):
    return None
  return tuple(sorted(nest))


def as_column_array(leaf) -> np.ndarray:
  if type(leaf) is np.ndarray and leaf.dtype.kind not in "USO":
    return leaf
  return structure.to_array(leaf)


def object_row(value, shape):
  if not shape:
    return value
  return np.asarray(value, dtype=object).reshape(shape)


def check_positive_int(value, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be an int >= 1, got {value!r}")
  return int(value)
