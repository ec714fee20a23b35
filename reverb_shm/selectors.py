"""Item selectors: how a table picks the item to sample (sampler) or to evict (remover).

Each selector is plain configuration; the C core implements them (csrc/selectors.c). Thread-safe
(immutable).
"""
import dataclasses
from typing import Optional

from reverb_shm._internal.arguments import number_argument

__all__ = ["ItemSelector", "Uniform", "Prioritized", "Fifo", "Lifo", "MinHeap", "MaxHeap",
           "KeyDistributionOptions", "PrioritizedOptions", "HeapOptions", "from_kind"]

# Values of RS_SEL_* in csrc/rs_api.h.
UNIFORM, PRIORITIZED, FIFO, LIFO, MINHEAP, MAXHEAP = range(6)


@dataclasses.dataclass(frozen=True)
class PrioritizedOptions:
  priority_exponent: float


@dataclasses.dataclass(frozen=True)
class HeapOptions:
  min_heap: bool


@dataclasses.dataclass(frozen=True)
class KeyDistributionOptions:
  """Mirror of Reverb's KeyDistributionOptions proto (exactly one kind is set)."""
  fifo: bool = False
  uniform: bool = False
  prioritized: Optional[PrioritizedOptions] = None
  heap: Optional[HeapOptions] = None
  lifo: bool = False
  is_deterministic: bool = False

  def HasField(self, name: str) -> bool:  # noqa: N802  (proto-style accessor)
    value = getattr(self, name)
    return value is not None and value is not False

  def WhichOneof(self, group: str) -> Optional[str]:  # noqa: N802  (proto-style accessor)
    """The name of the kind that is set ('fifo', 'uniform', 'prioritized', 'heap' or 'lifo');
    `group` is the proto's oneof name, 'distribution'."""
    if group != "distribution":
      raise ValueError(f"KeyDistributionOptions has no oneof {group!r}; it has 'distribution'")
    return next((name for name in ("fifo", "uniform", "prioritized", "heap", "lifo")
                 if self.HasField(name)), None)


class ItemSelector:
  """Base class. `kind` is the C core's RS_SEL_* value; `exponent` is 0 except Prioritized."""

  kind: int = -1
  exponent: float = 0.0

  def options(self) -> KeyDistributionOptions:
    raise NotImplementedError

  def __eq__(self, other):
    return type(self) is type(other) and self.exponent == other.exponent

  def __hash__(self):
    return hash((self.kind, self.exponent))

  def __repr__(self):
    return f"{type(self).__name__}()"

  def __reduce__(self):
    return type(self), ()


class Uniform(ItemSelector):
  """Samples items uniformly at random; probability 1/N."""
  kind = UNIFORM

  def options(self):
    return KeyDistributionOptions(uniform=True)


class Prioritized(ItemSelector):
  """Samples an item with probability priority**priority_exponent / sum (0 priority -> never,
  unless every priority is 0, then uniform).

  Args:
    priority_exponent: float >= 0.

  Raises:
    TypeError: a bool, a string or no number. ValueError: negative, infinite or NaN.
  """
  kind = PRIORITIZED

  def __init__(self, priority_exponent: float):
    if isinstance(priority_exponent, bool):
      raise TypeError("priority_exponent must be a float, got a bool")
    self.exponent = float(number_argument(priority_exponent, "priority_exponent"))
    if not 0 <= self.exponent < float("inf"):   # also rejects NaN
      raise ValueError(f"priority_exponent must be finite and >= 0, got {priority_exponent!r}")

  @property
  def priority_exponent(self) -> float:
    return self.exponent

  def options(self):
    return KeyDistributionOptions(prioritized=PrioritizedOptions(self.exponent))

  def __repr__(self):
    return f"Prioritized(priority_exponent={self.exponent})"

  def __reduce__(self):
    return Prioritized, (self.exponent,)


class Fifo(ItemSelector):
  """Picks the oldest inserted item; probability 1."""
  kind = FIFO

  def options(self):
    return KeyDistributionOptions(fifo=True, is_deterministic=True)


class Lifo(ItemSelector):
  """Picks the newest inserted item; probability 1."""
  kind = LIFO

  def options(self):
    return KeyDistributionOptions(lifo=True, is_deterministic=True)


class MinHeap(ItemSelector):
  """Picks the lowest priority (ties: least recently inserted or updated); probability 1."""
  kind = MINHEAP

  def options(self):
    return KeyDistributionOptions(heap=HeapOptions(min_heap=True), is_deterministic=True)


class MaxHeap(ItemSelector):
  """Picks the highest priority (ties: least recently inserted or updated); probability 1."""
  kind = MAXHEAP

  def options(self):
    return KeyDistributionOptions(heap=HeapOptions(min_heap=False), is_deterministic=True)


_BY_KIND = {cls.kind: cls for cls in (Uniform, Fifo, Lifo, MinHeap, MaxHeap)}


def from_kind(kind: int, exponent: float = 0.0) -> ItemSelector:
  """Selector object for a C core RS_SEL_* value."""
  if kind == PRIORITIZED:
    return Prioritized(exponent)
  try:
    return _BY_KIND[kind]()
  except KeyError:
    raise ValueError(f"unknown selector kind {kind}; expected 0..5") from None
