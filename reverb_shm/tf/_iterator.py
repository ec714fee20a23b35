"""The eager iterator of the TensorFlow datasets: tf.data's own, with less Python per element.

`iter(dataset)` on a Reverb dataset returns an `Iterator`, a `tf.data.Iterator` (a subclass of
tf.data's eager iterator, OwnedIterator) whose elements are exactly those of tf.data's
iterator: the same tensors, from the same IteratorGetNext op, in the same nest. What differs is
the Python around the op. tf.data's eager `next` runs each element in a new synchronous
executor (a context manager that builds one per call) and rebuilds the element spec by spec
(`set_shape` on every tensor, then `tf.nest.pack_sequence_as`); for an element of 8 tensors
that costs about three times the op itself. Here, with the default synchronous executor, the
op runs as it is (it checks dtypes and shapes against the element spec itself), and the nest
is rebuilt by a function made once per iterator from the element spec. Anything else (an
asynchronous executor, graph mode, nests other than dicts with str keys, tuples, namedtuples
and dense TensorSpecs) takes tf.data's own path.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

try:   # private modules of TensorFlow, the same from 2.9 to 2.21
  from tensorflow.python.data.ops import iterator_ops as _iterator_ops
  from tensorflow.python.eager import context as _context
  from tensorflow.python.framework import ops as _ops
  from tensorflow.python.ops import gen_dataset_ops as _gen_dataset_ops
  _OwnedIterator: Any = _iterator_ops.OwnedIterator
except (ImportError, AttributeError):   # pragma: no cover
  _OwnedIterator = None

Packer = Callable[[Sequence[Any]], Any]


def packer(spec: Any) -> Optional[Packer]:
  """A function that nests a flat list of values as `tf.nest.pack_sequence_as(spec, flat)`
  does, or None when `spec` holds anything but plain dicts with str keys, plain tuples,
  namedtuples and tf.TensorSpec leaves (tf.nest's rules: dict values in sorted key order,
  rebuilt in the dict's own key order)."""
  leaves: List[int] = [0]   # (next flat index)

  def build(s) -> Optional[Packer]:
    if type(s) is tf.TensorSpec:
      i = leaves[0]
      leaves[0] += 1
      return lambda flat: flat[i]
    if type(s) is dict:
      if not all(type(k) is str for k in s):
        return None
      by_key: Dict[str, Packer] = {}
      for k in sorted(s):
        p = build(s[k])
        if p is None:
          return None
        by_key[k] = p
      items: Tuple[Tuple[str, Packer], ...] = tuple((k, by_key[k]) for k in s)
      return lambda flat: {k: p(flat) for k, p in items}
    if isinstance(s, tuple) and (type(s) is tuple or hasattr(type(s), "_fields")):
      parts = []
      for x in s:
        p = build(x)
        if p is None:
          return None
        parts.append(p)
      if type(s) is tuple:
        return lambda flat: tuple([p(flat) for p in parts])
      cls = type(s)
      return lambda flat: cls(*[p(flat) for p in parts])
    return None

  pack = build(spec)
  if pack is None or leaves[0] != len(tf.nest.flatten(spec)):
    return None
  return pack


Iterator: Any = None   # (the class below, where this TensorFlow has what it builds on)

if _OwnedIterator is not None:
  class _Iterator(_OwnedIterator):  # pylint: disable=abstract-method
    """tf.data's eager iterator over a dataset, with a faster `next` (see the module doc)."""

    def _create_iterator(self, dataset):
      super()._create_iterator(dataset)
      self._reverb_pack = packer(self._element_spec)

    def _next_internal(self):
      pack = getattr(self, "_reverb_pack", None)
      if (pack is None or not _context.executing_eagerly()
          or _context.context().executor.is_async()):
        return super()._next_internal()
      return pack(_gen_dataset_ops.iterator_get_next(
          self._iterator_resource, output_types=self._flat_output_types,
          output_shapes=self._flat_output_shapes))

  Iterator = _Iterator


def make_iterator(dataset: tf.data.Dataset):
  """`iter(dataset)` as tf.data does it, returning an `Iterator` in eager mode (None where
  this TensorFlow lacks the classes it builds on, or outside eager mode: then use tf.data's
  own `__iter__`)."""
  if Iterator is None or not _context.executing_eagerly() or _ops.inside_function():
    return None
  with _ops.colocate_with(dataset._variant_tensor):  # pylint: disable=protected-access
    return Iterator(dataset)
