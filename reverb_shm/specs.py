"""Tensor specs without TensorFlow (docs/differences.md#signatures) and signature encoding.

A signature is a nest whose leaves are :class:`TensorSpec`. Objects exposing `.shape` and
`.dtype` (a `tf.TensorSpec`, a jax `ShapeDtypeStruct`) are converted by :func:`as_spec`.
Signatures are stored in shared memory as msgpack-able data (no pickle).
"""
import collections
import sys
from typing import Any, Optional, Sequence

import numpy as np

from reverb_shm._internal import structure

__all__ = ["TensorSpec", "BoundedTensorSpec", "as_spec", "as_dtype", "encode_signature",
           "decode_signature", "validate_signature", "user_signature", "to_tf"]


def as_dtype(dtype: Any) -> np.dtype:
  """numpy dtype of `dtype` (numpy dtype, type, string, or a TF DType with as_numpy_dtype)."""
  if isinstance(dtype, np.dtype):
    return dtype
  numpy_dtype = getattr(dtype, "as_numpy_dtype", None)
  if numpy_dtype is not None:
    return np.dtype(numpy_dtype)
  if dtype is str or dtype is bytes:
    return np.dtype(object)
  return np.dtype(dtype)


def _as_shape(shape: Any) -> Optional[tuple]:
  if shape is None:
    return None
  if hasattr(shape, "as_list"):  # tf.TensorShape
    try:
      shape = shape.as_list()
    except ValueError:  # unknown rank
      return None
  dims = []
  for d in shape:
    d = getattr(d, "value", d)  # TF1 Dimension
    if d is not None:
      d = int(d)
      if d == -1:
        d = None
      elif d < 0:
        raise ValueError(f"invalid dimension {d} in shape {shape!r}: dims are sizes >= 0, or "
                         "None / -1 for an unknown size")
    dims.append(d)
  return tuple(dims)


class TensorSpec:
  """Shape and numpy dtype of a tensor.

  Args:
    shape: sequence of dims; a dim of None (or -1) matches any size; shape None matches any
      rank.
    dtype: anything `np.dtype` accepts, or a TF DType. String tensors use `object`.
    name: optional name.

  Raises:
    ValueError: a dim below -1.

  Immutable and thread-safe.
  """

  __slots__ = ("_shape", "_dtype", "_name")

  def __init__(self, shape: Sequence[Optional[int]], dtype: Any = np.float32,
               name: Optional[str] = None):
    self._shape = _as_shape(shape)
    self._dtype = as_dtype(dtype)
    self._name = name

  shape = property(lambda self: self._shape)
  dtype = property(lambda self: self._dtype)
  name = property(lambda self: self._name)

  def is_compatible_with(self, other: Any) -> bool:
    """True if `other` (spec, numpy array, TF tensor or Python value) fits this spec."""
    if hasattr(other, "shape") and hasattr(other, "dtype"):
      shape, dtype = _as_shape(other.shape), as_dtype(other.dtype)
    else:
      arr = structure.to_array(other)
      shape, dtype = arr.shape, arr.dtype
    if dtype.kind in "USO":
      dtype = np.dtype(object)
    if dtype != self._dtype:
      return False
    return shapes_compatible(self._shape, shape)

  def _fields(self):
    return (type(self).__name__, self._shape, self._dtype, self._name)

  def __eq__(self, other):
    return isinstance(other, TensorSpec) and self._fields() == other._fields()

  def __hash__(self):
    return hash(self._fields())

  def __repr__(self):
    return f"TensorSpec(shape={self._shape}, dtype={self._dtype}, name={self._name!r})"

  def __reduce__(self):
    return TensorSpec, (self._shape, self._dtype, self._name)


class BoundedTensorSpec(TensorSpec):
  """A TensorSpec with inclusive `minimum` / `maximum` bounds (arrays broadcastable to shape)."""

  __slots__ = ("_minimum", "_maximum")

  def __init__(self, shape, dtype, minimum, maximum, name=None):
    super().__init__(shape, dtype, name)
    self._minimum = np.asarray(minimum, dtype=self._dtype)
    self._maximum = np.asarray(maximum, dtype=self._dtype)

  minimum = property(lambda self: self._minimum)
  maximum = property(lambda self: self._maximum)

  def _fields(self):
    return super()._fields() + (self._minimum.tobytes(), self._maximum.tobytes())

  def __repr__(self):
    return (f"BoundedTensorSpec(shape={self._shape}, dtype={self._dtype}, name={self._name!r}, "
            f"minimum={self._minimum!r}, maximum={self._maximum!r})")

  def __reduce__(self):
    return BoundedTensorSpec, (self._shape, self._dtype, self._minimum, self._maximum, self._name)


def shapes_compatible(a: Optional[tuple], b: Optional[tuple]) -> bool:
  """True if two shapes (None = unknown rank, None dims = unknown size) can be equal."""
  if a is None or b is None:
    return True
  if len(a) != len(b):
    return False
  return all(x is None or y is None or x == y for x, y in zip(a, b))


def as_spec(obj: Any) -> TensorSpec:
  """Converts a TensorSpec-like object to a :class:`TensorSpec`.

  Raises:
    ValueError: `obj` has no `.shape` and `.dtype` ("Unsupported signature spec").
  """
  if isinstance(obj, TensorSpec):
    return obj
  if hasattr(obj, "shape") and hasattr(obj, "dtype") and not isinstance(obj, np.ndarray):
    name = getattr(obj, "name", None)
    try:
      if hasattr(obj, "minimum") and hasattr(obj, "maximum"):
        return BoundedTensorSpec(obj.shape, obj.dtype, obj.minimum, obj.maximum, name)
      return TensorSpec(obj.shape, obj.dtype, name)
    except TypeError as e:
      raise ValueError(f"Unsupported signature spec {obj!r}: {e}") from None
  raise ValueError(f"Unsupported signature spec {obj!r} of type {type(obj).__name__}: expected "
                   "a TensorSpec or an object with .shape and .dtype")


def validate_signature(signature: Any) -> Any:
  """Returns `signature` with every leaf converted by :func:`as_spec` (None stays None)."""
  if signature is None:
    return None
  leaves, treedef = structure.flatten(signature)
  if not leaves:
    raise ValueError("signature must contain at least one spec")
  return structure.unflatten(treedef, [as_spec(leaf) for leaf in leaves])


def _dtype_str(dtype: np.dtype) -> str:
  return "O" if dtype.kind == "O" else dtype.str


def _encode(node):
  if isinstance(node, TensorSpec):
    out = {"t": "spec", "shape": None if node.shape is None else list(node.shape),
           "dtype": _dtype_str(node.dtype), "name": node.name}
    if isinstance(node, BoundedTensorSpec):
      out["t"] = "bounded"
      out["min"] = node.minimum.tolist()
      out["max"] = node.maximum.tolist()
    return out
  if node is None:
    return {"t": "none"}
  if isinstance(node, dict):
    keys = sorted(node)
    return {"t": "dict", "k": keys, "v": [_encode(node[k]) for k in keys]}
  if isinstance(node, tuple) and hasattr(node, "_fields"):
    return {"t": "namedtuple", "name": type(node).__name__, "k": list(node._fields),
            "v": [_encode(x) for x in node]}
  if isinstance(node, (list, tuple)):
    return {"t": type(node).__name__, "v": [_encode(x) for x in node]}
  raise ValueError(f"Unsupported signature node {node!r} of type {type(node).__name__}")


_NAMEDTUPLES: dict = {}


def _decode(data):
  kind = data["t"]
  if kind in ("spec", "bounded"):
    shape = None if data["shape"] is None else tuple(data["shape"])
    dtype = np.dtype(object) if data["dtype"] == "O" else np.dtype(data["dtype"])
    if kind == "bounded":
      return BoundedTensorSpec(shape, dtype, data["min"], data["max"], data["name"])
    return TensorSpec(shape, dtype, data["name"])
  if kind == "none":
    return None
  if kind == "dict":
    return {k: _decode(v) for k, v in zip(data["k"], data["v"])}
  if kind == "namedtuple":
    key = (data["name"], tuple(data["k"]))
    cls = _NAMEDTUPLES.get(key)
    if cls is None:
      cls = _NAMEDTUPLES[key] = collections.namedtuple(data["name"], data["k"])
    return cls(*[_decode(v) for v in data["v"]])
  if kind == "list":
    return [_decode(v) for v in data["v"]]
  if kind == "tuple":
    return tuple(_decode(v) for v in data["v"])
  raise ValueError(f"corrupt signature encoding: unknown node type {kind!r}")


def encode_signature(signature: Any) -> Any:
  """msgpack-able encoding of a signature nest (None -> None)."""
  if signature is None:
    return None
  return _encode(validate_signature(signature))


def decode_signature(data: Any) -> Any:
  """Inverse of :func:`encode_signature`. Namedtuples come back as equivalent namedtuples."""
  return None if data is None else _decode(data)


def to_tf(signature: Any) -> Any:
  """`signature` with each leaf a `tf.TensorSpec` (a `BoundedTensorSpec` of TensorFlow for a
  bounded one; object dtype -> tf.string), as dm-reverb's TableInfo holds it. Needs TensorFlow
  to be imported already.

  Raises:
    RuntimeError: TensorFlow has not been imported.
  """
  tf = sys.modules.get("tensorflow")
  if tf is None or not hasattr(tf, "TensorSpec"):
    raise RuntimeError("to_tf needs TensorFlow to be imported first")
  from tensorflow.python.framework import tensor_spec  # pylint: disable=g-import-not-at-top

  def convert(leaf):
    if not isinstance(leaf, TensorSpec):
      return leaf
    dtype = tf.string if leaf.dtype.kind == "O" else tf.as_dtype(leaf.dtype)
    shape = tf.TensorShape(None if leaf.shape is None else list(leaf.shape))
    if isinstance(leaf, BoundedTensorSpec):
      return tensor_spec.BoundedTensorSpec(shape, dtype, leaf.minimum, leaf.maximum, leaf.name)
    return tf.TensorSpec(shape, dtype, leaf.name)

  leaves, treedef = structure.flatten(signature)
  return structure.unflatten(treedef, [convert(leaf) for leaf in leaves])


def user_signature(signature: Any) -> Any:
  """The signature as TableInfo shows it: `tf.TensorSpec`s (see :func:`to_tf`) once the process
  has imported TensorFlow, as dm-reverb's; else reverb_shm's TensorSpecs. Never imports
  TensorFlow itself."""
  if signature is None or "tensorflow" not in sys.modules:
    return signature
  try:
    return to_tf(signature)
  except RuntimeError:   # TensorFlow half-imported (an import cycle in progress)
    return signature
