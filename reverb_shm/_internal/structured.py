"""Patterns, conditions and configs of the StructuredWriter, without protobuf.

A *pattern* is a nest whose leaves are :class:`PatternNode` (which column of the appended step,
and which of its most recent steps). A :class:`Config` pairs a flattened pattern with a table,
a priority function and :class:`Condition` s that decide at which steps an item is created::

  ref = create_reference_step({'obs': None, 'reward': None})
  config = create_config({'obs': ref['obs'][-3:], 'r': ref['reward'][-1]}, table='replay',
                         conditions=[Condition.step_index() % 2 == 0])

Configs, patterns and conditions are plain immutable values (thread-safe).
"""
import dataclasses
from typing import Any, Callable, Optional, Sequence, Tuple, cast

import numpy as np

from reverb_shm import errors, specs
from reverb_shm._internal import structure

__all__ = ["PatternNode", "Condition", "ConstantPriorityFn", "TDError", "Config",
           "create_reference_step", "pattern_from_transform", "create_config", "unpack_pattern",
           "infer_signature", "constant_priority_fn", "td_error", "validate_config",
           "history_length", "Pattern", "ReferenceStep"]

# Type aliases (for annotations): a nest of PatternNode, and what create_reference_step returns.
Pattern = Any
ReferenceStep = Any


@dataclasses.dataclass(frozen=True)
class PatternNode:
  """Steps of one column of the appended step, counted back from the newest step.

  `start is None`: the single step `stop` (-1 = newest), squeezed (no time dim).
  Otherwise the steps `start:stop:step` of the most recent ones (start < 0, stop <= 0 where
  0 or None means "up to the newest", step > 0), with a time dim.
  """
  flat_source_index: int
  start: Optional[int] = None
  stop: Optional[int] = None
  step: Optional[int] = None

  def HasField(self, name: str) -> bool:  # noqa: N802  (proto-style accessor)
    return getattr(self, name) is not None

  @property
  def squeezed(self) -> bool:
    return self.start is None

  def length(self) -> int:
    """Number of steps the node selects."""
    if self.start is None:
      return 1
    return len(range(self.start, self.stop or 0, self.step or 1))


class _RefNode:
  """Leaf of a reference step: indexing it builds a PatternNode."""

  __slots__ = ("_index",)

  def __init__(self, index: int):
    self._index = index

  def __getitem__(self, key) -> PatternNode:
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
      return PatternNode(self._index, stop=int(key))
    if isinstance(key, slice):
      return PatternNode(self._index, start=key.start, stop=key.stop, step=key.step)
    raise ValueError(f"Key must be int or slice but got {key!r} (type {type(key).__name__}).")

  def __repr__(self):
    return f"RefNode(flat_source_index={self._index})"


def create_reference_step(step_structure: Any) -> Any:
  """`step_structure` with each leaf replaced by an object whose `[...]` builds a PatternNode.

  Args:
    step_structure: a nest shaped like the data passed to `StructuredWriter.append` (its leaf
      values do not matter; None leaves count).
  """
  leaves, treedef = structure.flatten(step_structure)
  return structure.unflatten(treedef, [_RefNode(i) for i in range(len(leaves))])


def pattern_from_transform(step_structure: Any, transform: Callable[[Any], Any]) -> Any:
  """`transform(create_reference_step(step_structure))`: a nest of PatternNodes."""
  return transform(create_reference_step(step_structure))


# ---- conditions

_LEFT_KINDS = ("step_index", "steps_since_applied", "buffer_length", "is_end_episode", "data")


@dataclasses.dataclass(frozen=True)
class Condition:
  """`left <cmp> value` over the writer's state after a step; `inverse` negates it.

  left: one of step_index, steps_since_applied, buffer_length, is_end_episode, data (the value
  of column `flat_source_index` in the newest step; a missing value makes the condition false).
  cmp: "eq" (left == value), "ge" (left >= value) or "mod_eq" (left % mod == value).

  Build conditions with the static methods and Python comparisons::

    Condition.step_index() % 3 == 0
    Condition.steps_since_applied() >= 4
    Condition.data(step_structure)['done'] == True
    Condition.is_end_episode()
  """
  left: str
  cmp: str = ""
  value: int = 0
  mod: int = 0
  inverse: bool = False
  flat_source_index: int = -1

  @staticmethod
  def step_index() -> "_ConditionBuilder":
    """Index (from 0) of the newest step within the episode."""
    return _ConditionBuilder(Condition("step_index"))

  @staticmethod
  def steps_since_applied() -> "_ConditionBuilder":
    """Steps appended since the config last created an item (1 at the first step)."""
    return _ConditionBuilder(Condition("steps_since_applied"))

  @staticmethod
  def is_end_episode() -> "Condition":
    """True only while `end_episode` evaluates the configs."""
    return Condition("is_end_episode", "eq", 1)

  @staticmethod
  def data(step_structure: Any) -> Any:
    """`step_structure` whose leaves build conditions on the newest step's scalar value."""
    leaves, treedef = structure.flatten(step_structure)
    return structure.unflatten(treedef, [_ConditionBuilder(Condition("data", flat_source_index=i))
                                         for i in range(len(leaves))])

  def evaluate(self, left_value: Optional[int]) -> bool:
    """The condition's truth for the given left-hand value (None: missing data -> False)."""
    if left_value is None:
      return False
    v = int(left_value)
    if self.cmp == "eq":
      result = v == self.value
    elif self.cmp == "ge":
      result = v >= self.value
    else:
      result = v % self.mod == self.value
    return result != self.inverse


def _cmp_value(value) -> int:
  if isinstance(value, (bool, np.bool_)):
    return int(value)
  if not isinstance(value, (int, np.integer)):
    raise TypeError(f"conditions compare with ints (or bools), got {value!r}")
  return int(value)


class _ConditionBuilder:
  """Left-hand side of a condition; comparing it with an int gives a Condition."""

  __slots__ = ("_partial",)

  def __init__(self, partial: Condition):
    self._partial = partial

  def __mod__(self, mod: int) -> "_ConditionBuilder":
    mod = _cmp_value(mod)
    if mod <= 0:
      raise ValueError(f"the modulus of a condition must be > 0, got {mod}")
    return _ConditionBuilder(dataclasses.replace(self._partial, mod=mod))

  def __eq__(self, value) -> Condition:  # type: ignore[override]
    p = self._partial
    return dataclasses.replace(p, cmp="mod_eq" if p.mod else "eq", value=_cmp_value(value))

  def __ne__(self, value) -> Condition:  # type: ignore[override]
    return dataclasses.replace(self == value, inverse=True)

  def __ge__(self, value) -> Condition:
    if self._partial.mod:
      raise ValueError("a condition with % only supports == and !=")
    return dataclasses.replace(self._partial, cmp="ge", value=_cmp_value(value))

  def __gt__(self, value) -> Condition:
    return self >= _cmp_value(value) + 1

  def __lt__(self, value) -> Condition:
    return dataclasses.replace(self >= _cmp_value(value), inverse=True)

  def __le__(self, value) -> Condition:
    return dataclasses.replace(self > value, inverse=True)

  __hash__ = None  # type: ignore[assignment]  # comparisons build conditions: not dict keys

  def __repr__(self):
    return f"ConditionBuilder({self._partial})"


# ---- priorities

@dataclasses.dataclass(frozen=True)
class ConstantPriorityFn:
  value: float


@dataclasses.dataclass(frozen=True)
class TDError:
  """priority = w * max|td| + (1 - w) * mean|td| over the steps of column flat_source_index."""
  max_priority_weight: float
  flat_source_index: int


def constant_priority_fn(value: float) -> ConstantPriorityFn:
  """A priority function that always returns `value`."""
  return ConstantPriorityFn(float(value))


def td_error(max_priority_weight: float, step_structure: Any,
             get_field_from_step_fn: Callable[[Any], Any]) -> TDError:
  """Priority from the per-step TD errors of one field of the step (which must be in the item).

  Args:
    max_priority_weight: w in [0, 1].
    step_structure: structure of the appended step.
    get_field_from_step_fn: picks the TD-error field from a step-shaped nest.
  """
  leaves, treedef = structure.flatten(step_structure)
  index = get_field_from_step_fn(structure.unflatten(treedef, list(range(len(leaves)))))
  if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
    raise ValueError(f"get_field_from_step_fn must select one leaf of the step, got {index!r}")
  return TDError(float(max_priority_weight), int(index))


# ---- configs

@dataclasses.dataclass(frozen=True)
class Config:
  """Which trajectory to create (flat pattern + its structure), where, with which priority and
  under which conditions."""
  flat: Tuple[PatternNode, ...]
  pattern_structure: Any      # optree treedef of the pattern
  table: str
  priority: Any = ConstantPriorityFn(1.0)
  conditions: Tuple[Condition, ...] = ()

  def HasField(self, name: str) -> bool:  # noqa: N802  (proto-style accessor)
    return getattr(self, name) is not None


def create_config(pattern: Any, table: str, conditions: Sequence[Condition] = (),
                  priority: Any = None) -> Config:
  """A Config creating `pattern` items in `table` (priority defaults to constant 1.0)."""
  flat, treedef = structure.flatten(pattern)
  return Config(flat=tuple(flat), pattern_structure=treedef, table=table,
                priority=constant_priority_fn(1.0) if priority is None else priority,
                conditions=tuple(conditions))


def unpack_pattern(config: Config) -> Any:
  """The config's pattern as a nest of PatternNodes."""
  if config.pattern_structure is None:
    return list(config.flat)
  return structure.unflatten(config.pattern_structure, list(config.flat))


def history_length(config: Config) -> int:
  """Most recent steps the config's pattern reaches back (the automatic buffer condition)."""
  # (a node without a start is a single step: its stop is set)
  return max(-cast(int, n.stop if n.start is None else n.start) for n in config.flat)


def _check_node(i: int, node) -> None:
  if not isinstance(node, PatternNode):
    raise ValueError(f"pattern leaf {i} is {node!r}; build patterns by indexing "
                     "create_reference_step(...) leaves")
  if node.flat_source_index < 0:
    raise ValueError(f"pattern leaf {i} has a negative flat_source_index")
  if node.start is None:
    if node.stop is None or node.stop >= 0:
      raise ValueError(f"pattern leaf {i}: a single step must be a negative index (-1 = newest), "
                       f"got {node.stop}")
    if node.step is not None:
      raise ValueError(f"pattern leaf {i}: `step` needs a slice with a start")
    return
  if node.start >= 0:
    raise ValueError(f"pattern leaf {i}: slice start must be < 0, got {node.start}")
  if node.stop is not None and node.stop > 0:
    raise ValueError(f"pattern leaf {i}: slice stop must be <= 0, got {node.stop}")
  if node.step is not None and node.step <= 0:
    raise ValueError(f"pattern leaf {i}: slice step must be > 0, got {node.step}")
  if node.length() < 1:
    raise ValueError(f"pattern leaf {i}: slice {node.start}:{node.stop} selects no steps")


def validate_config(position: int, config) -> None:
  """ValueError "Invalid configuration at position i: ..." if `config` is unusable."""
  try:
    if not isinstance(config, Config):
      raise ValueError(f"expected a Config from create_config, got {type(config).__name__}")
    if not config.flat:
      raise ValueError("the pattern must reference at least one column")
    for i, node in enumerate(config.flat):
      _check_node(i, node)
    if not isinstance(config.table, str) or not config.table:
      raise ValueError(f"table must be a non-empty str, got {errors.quoted_name(config.table)}")
    for c in config.conditions:
      if not isinstance(c, Condition) or c.left not in _LEFT_KINDS or not c.cmp:
        raise ValueError(f"conditions must be complete Condition objects (e.g. "
                         f"Condition.step_index() >= 2), got {c!r}")
    p = config.priority
    if isinstance(p, TDError):
      if not any(n.flat_source_index == p.flat_source_index for n in config.flat):
        raise ValueError(f"td_error priority reads column {p.flat_source_index}, which the "
                         "pattern does not include")
    elif not isinstance(p, ConstantPriorityFn):
      raise ValueError(f"priority must come from constant_priority_fn or td_error, got {p!r}")
  except ValueError as e:
    raise ValueError(f"Invalid configuration at position {position}: {e}") from None


def infer_signature(configs: Sequence[Config], step_spec: Any) -> Any:
  """The table signature of the items `configs` create from steps shaped like `step_spec`.

  Args:
    configs: every config writing to the table (same table, same pattern structure).
    step_spec: nest of specs (anything with .shape and .dtype, e.g. TensorSpec, tf.TensorSpec,
      numpy arrays) shaped like an appended step.

  Returns:
    The pattern structure with a TensorSpec per leaf; slices get a leading time dim (None when
    the configs disagree on its length); names are the leaf paths joined by '/'.

  Raises:
    ValueError: no configs, configs for different tables or pattern structures, or leaves whose
      dtypes or trailing shapes differ between configs.
  """
  if not configs:
    raise ValueError("At least one config must be provided.")
  first = configs[0]
  if any(c.pattern_structure != first.pattern_structure for c in configs):
    raise ValueError("All configs must have exactly the same pattern_structure.")
  tables = sorted({c.table for c in configs})
  if len(tables) > 1:
    raise ValueError(f"All configs must target the same table but provided configs included "
                     f"{', '.join(tables)}.")
  step_leaves = [specs.TensorSpec(s.shape, s.dtype) for s in structure.flatten(step_spec)[0]]
  paths, _, treedef = structure.flatten_with_paths(unpack_pattern(first))
  out = []
  for j, path in enumerate(paths):
    nodes = [c.flat[j] for c in configs]
    dtypes = [step_leaves[n.flat_source_index].dtype for n in nodes]
    if any(d != dtypes[0] for d in dtypes):
      raise ValueError(f"Configs produce trajectories with multiple dtypes at {path}. "
                       f"Got {dtypes}.")
    shapes = []
    for n in nodes:
      shape = tuple(step_leaves[n.flat_source_index].shape or ())
      shapes.append(shape if n.squeezed else (n.length(),) + shape)
    if any(len(s) != len(shapes[0]) or s[1:] != shapes[0][1:] for s in shapes):
      raise ValueError(f"Configs produce trajectories with incompatible shapes at {path}. "
                       f"Got {shapes}.")
    shape = shapes[0] if all(s == shapes[0] for s in shapes) else (None,) + shapes[0][1:]
    out.append(specs.TensorSpec(shape, dtypes[0], name="/".join(str(p) for p in path)))
  return structure.unflatten(treedef, out)
