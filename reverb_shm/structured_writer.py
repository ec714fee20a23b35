"""StructuredWriter: creates items from declarative configs at every step.

`from reverb_shm import structured_writer as sw` gives the writer and every helper of
:mod:`reverb_shm._internal.structured` (`sw.Config`, `sw.create_config`, `sw.Condition`, ...).

After each complete step (and in `end_episode`) every config whose conditions hold creates one
item: its pattern's nodes become TrajectoryColumns over the most recent steps of the referenced
columns. A config is applied at most once per step; it is skipped while the episode has fewer
steps than its pattern reaches back, or when a referenced step has no value for a column.
Columns that no config references are never written to shared memory.
"""
from typing import Any, List, Optional, Sequence

import numpy as np

from reverb_shm import trajectory_writer as trajectory_writer_lib
from reverb_shm._internal import structure
from reverb_shm._internal.structured import (  # noqa: F401  (re-exported: sw.Config, sw.Condition, ...)
  Condition,
  Config,
  ConstantPriorityFn,
  Pattern,
  PatternNode,
  ReferenceStep,
  TDError,
  constant_priority_fn,
  create_config,
  create_reference_step,
  history_length,
  infer_signature,
  pattern_from_transform,
  td_error,
  unpack_pattern,
  validate_config,
)

__all__ = ["StructuredWriter", "Config", "Condition", "Pattern", "PatternNode", "ReferenceStep",
           "create_reference_step",
           "pattern_from_transform", "create_config", "unpack_pattern", "infer_signature",
           "constant_priority_fn", "td_error"]


class _ConfigState:
  __slots__ = ("config", "history", "since_applied", "applied_at")

  def __init__(self, config: Config):
    self.config = config
    self.history = history_length(config)
    self.since_applied = 0
    self.applied_at = -1


class StructuredWriter:
  """Appends steps and creates the items its configs describe.

  Obtain one with `Client.structured_writer(configs)`. Not thread-safe.

  Args:
    client: the Client whose tables receive the items.
    configs: non-empty sequence of Config (from `create_config`).

  Raises:
    ValueError: no configs, or an invalid one ("Invalid configuration at position i: ...").
  """

  def __init__(self, client, configs: Sequence[Config]):
    self._writer: Any = None   # (None only when __init__ raised: close() checks)
    configs = list(configs or ())
    if not configs:
      raise ValueError("At least one config must be provided.")
    for i, config in enumerate(configs):
      validate_config(i, config)
    self._states = [_ConfigState(c) for c in configs]
    self._used = sorted({n.flat_source_index for c in configs for n in c.flat})
    keep_alive = max(s.history for s in self._states)
    # Items reach their tables as their step closes (item_batch_size=1), as before.
    self._writer = trajectory_writer_lib.TrajectoryWriter(client, keep_alive, item_batch_size=1)
    self._num_leaves: Optional[int] = None
    self._paths: Any = None
    self._columns: dict = {}          # flat index -> (dtype, shape) fixed by the first value
    self._newest: dict = {}           # flat index -> newest step's value (for data conditions)
    self._step_open = False
    self._episode_step = 0      # complete steps in this episode
    self._buffered = 0          # complete steps since the buffers were last cleared

  @property
  def step_is_open(self) -> bool:
    """True while a partial step awaits its closing append."""
    return self._step_open

  def append(self, data: Any, *, partial_step: bool = False) -> None:
    """Appends one step (or part of one) and, when the step closes, applies the configs.

    Args:
      data: a nest with the same number of leaves at every step; leaves may be None.
      partial_step: leave the step open for later appends.

    Raises:
      ValueError: a different leaf count; a dtype or shape change (message names the flat
        index and path); a leaf set twice in an open step; a config's item rejected by its
        table (bad priority, signature mismatch, unknown table).
    """
    paths, leaves, _ = structure.flatten_with_paths(data)
    if self._num_leaves is None:
      self._num_leaves, self._paths = len(leaves), paths
      bad = [i for i in self._used if i >= len(leaves)]
      if bad:
        raise ValueError(f"configs reference flat indices {bad} but the step has only "
                         f"{len(leaves)} leaves")
    elif len(leaves) != self._num_leaves:
      raise ValueError(f"Flattened data has an unexpected length, got {len(leaves)} but wanted "
                       f"{self._num_leaves}.")
    step = {}
    for i in self._used:
      if leaves[i] is not None:
        step[i] = self._checked(i, leaves[i])
    if not self._step_open:
      self._newest = {}
    for i, leaf in enumerate(leaves):
      if leaf is not None:
        self._newest[i] = leaf
    self._writer.append(step, partial_step=partial_step)
    self._step_open = bool(partial_step)
    if not partial_step:
      self._episode_step += 1
      self._buffered += 1
      for s in self._states:
        s.since_applied += 1
      self._apply(end_of_episode=False)

  def _checked(self, i: int, leaf) -> np.ndarray:
    arr = structure.to_array(leaf)
    expected = self._columns.get(i)
    if expected is None:
      trajectory_writer_lib.check_supported_dtype(arr.dtype, self._paths[i])
      self._columns[i] = (arr.dtype, arr.shape)
      return arr
    dtype, shape = expected
    if arr.dtype != dtype:
      raise ValueError(f"Tensor of wrong dtype provided for column {i} (path={self._paths[i]})."
                       f" Got {arr.dtype} but expected {dtype}.")
    if arr.shape != shape:
      raise ValueError(f"Tensor of incompatible shape provided for column {i} "
                       f"(path={self._paths[i]}). Got {list(arr.shape)} which is incompatible "
                       f"with {list(shape)}.")
    return arr

  def _left_value(self, state: _ConfigState, condition: Condition, end_of_episode: bool):
    left = condition.left
    if left == "step_index":
      return self._episode_step - 1
    if left == "steps_since_applied":
      return state.since_applied
    if left == "buffer_length":
      return self._buffered
    if left == "is_end_episode":
      return int(end_of_episode)
    value = self._newest.get(condition.flat_source_index)
    if value is None:
      return None
    arr = np.asarray(value)
    if arr.shape != () or arr.dtype.kind not in "biu":
      return None
    return int(arr)

  def _apply(self, end_of_episode: bool) -> None:
    history = self._writer.history if self._buffered else None
    for state in self._states:
      config = state.config
      if state.applied_at == self._episode_step or self._buffered < state.history:
        continue
      if not all(c.evaluate(self._left_value(state, c, end_of_episode))
                 for c in config.conditions):
        continue
      columns = self._columns_of(config, history)
      if columns is None:
        continue
      self._writer.create_item(config.table, self._priority(config, columns), columns)
      state.applied_at = self._episode_step
      state.since_applied = 0

  @staticmethod
  def _columns_of(config: Config, history) -> Optional[List[Any]]:
    """TrajectoryColumns of the pattern over the newest steps; None if a value is missing."""
    columns = []
    for node in config.flat:
      column = history.get(node.flat_source_index)
      if column is None:
        return None
      try:
        if node.squeezed:
          columns.append(column[node.stop])
        else:
          columns.append(column[node.start:(node.stop or None):node.step])
      except ValueError:    # a step without a value for this column
        return None
    return columns

  @staticmethod
  def _priority(config: Config, columns) -> float:
    p = config.priority
    if isinstance(p, ConstantPriorityFn):
      return p.value
    j = next(j for j, n in enumerate(config.flat) if n.flat_source_index == p.flat_source_index)
    td = np.abs(np.asarray(columns[j].numpy(), dtype=np.float64))
    w = p.max_priority_weight
    return float(w * td.max() + (1.0 - w) * td.mean())

  def flush(self, block_until_num_items: int = 0, timeout_ms: Optional[int] = None) -> None:
    """Waits until at most `block_until_num_items` items are not yet in their tables.

    Raises:
      ValueError: negative arguments. DeadlineExceededError: timeout (items stay queued).
    """
    self._writer.flush(block_until_num_items, timeout_ms)

  def end_episode(self, clear_buffers: bool = True, timeout_ms: Optional[int] = None) -> None:
    """Applies the end-of-episode configs, flushes, and starts a new episode.

    Args:
      clear_buffers: forget the episode's steps (else later patterns may reach into them).
      timeout_ms: None waits forever, 0 does not wait, > 0 milliseconds.

    Raises:
      DeadlineExceededError: items still queued at the deadline (the episode was ended).
    """
    if self._step_open:
      raise ValueError("end_episode() called while a partial step is open; close it with "
                       "append(..., partial_step=False) first")
    self._apply(end_of_episode=True)
    try:
      self._writer.end_episode(clear_buffers, timeout_ms)
    finally:
      self._episode_step = 0
      if clear_buffers:
        self._buffered = 0
      for s in self._states:
        s.since_applied = 0
        s.applied_at = -1
      self._newest = {}

  def close(self, timeout_ms: Optional[int] = trajectory_writer_lib.CLOSE_TIMEOUT_MS) -> None:
    """Inserts the created items, waiting up to `timeout_ms` for those that their rate limiter
    holds back (the rest go on in the background), and closes the writer: see
    TrajectoryWriter.close. Idempotent.

    Raises:
      ValueError: `timeout_ms` is negative or not a number.
    """
    if self._writer is not None:
      self._writer.close(timeout_ms)

  def __enter__(self) -> "StructuredWriter":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    self._writer.__exit__(exc_type, exc, tb)

  def __repr__(self):
    return (f"StructuredWriter(configs={len(self._states)}, episode_step={self._episode_step}, "
            f"step_is_open={self._step_open})")
