"""The one place where nests are flattened and rebuilt.

Nests are dicts, lists, tuples and namedtuples (anything optree knows). `None` is a leaf and
dict keys are visited in sorted order, which is dm-tree's order, so flat column lists match
what Reverb programs expect.
"""
from typing import Any, List, Tuple

import numpy as np
import optree

__all__ = ["flatten", "unflatten", "flatten_with_paths", "to_array", "structure_of"]


def flatten(nest: Any) -> Tuple[List[Any], optree.PyTreeSpec]:
  """Returns (leaves, treedef) of `nest` in dm-tree order (None is a leaf)."""
  return optree.tree_flatten(nest, none_is_leaf=True)


def unflatten(treedef: optree.PyTreeSpec, leaves) -> Any:
  """Rebuilds the nest described by `treedef` from `leaves` (inverse of flatten)."""
  return optree.tree_unflatten(treedef, list(leaves))


def flatten_with_paths(nest: Any) -> Tuple[List[tuple], List[Any], optree.PyTreeSpec]:
  """Returns (paths, leaves, treedef); a path is the tuple of keys/indices to a leaf."""
  paths, leaves, treedef = optree.tree_flatten_with_path(nest, none_is_leaf=True)
  return [tuple(p) for p in paths], leaves, treedef


def structure_of(nest: Any) -> optree.PyTreeSpec:
  """The treedef of `nest`."""
  return optree.tree_structure(nest, none_is_leaf=True)


def _encode_str(x):
  if isinstance(x, str):
    return x.encode("utf-8")
  if isinstance(x, int) and not isinstance(x, bool) and not -2**63 <= x < 2**64:
    # numpy keeps such ints as Python objects, which no column type can store.
    raise ValueError(f"integer {x} does not fit int64 or uint64; pass a float or a numpy "
                     "array of an explicit dtype")
  return x


def to_array(leaf: Any) -> np.ndarray:
  """Converts a leaf with numpy semantics (int -> int64, float -> float64, bool -> bool).

  Strings, bytes and object arrays become numpy object arrays of `bytes` (str is UTF-8
  encoded), which is how Reverb returns string tensors. TensorFlow/JAX arrays are converted
  through `np.asarray`.

  Raises:
    ValueError: a Python int outside [-2**63, 2**64).
  """
  if isinstance(leaf, np.ndarray) and leaf.dtype.kind not in "USO":
    return leaf
  if hasattr(leaf, "numpy") and not isinstance(leaf, np.generic):
    leaf = leaf.numpy()
  arr = np.asarray(leaf)
  if arr.dtype.kind in "USO":
    out = np.empty(arr.shape, dtype=object)
    flat_in, flat_out = arr.reshape(-1), out.reshape(-1)
    for i, x in enumerate(flat_in):
      flat_out[i] = _encode_str(x.item() if isinstance(x, np.generic) else x)
    return out
  return arr
