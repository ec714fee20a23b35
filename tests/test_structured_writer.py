"""SPEC §6b: StructuredWriter, patterns, conditions and helpers.

Expected outcomes of the scripted episode were obtained by running dm-reverb 0.14 (the same
script is compared live in tests/test_differential.py when dm-reverb is installed).
"""
import numpy as np
import pytest

import reverb_shm
from reverb_shm import structured_writer as sw
from reverb_shm.specs import TensorSpec

pytestmark = pytest.mark.timeout(60)

STEP = {"a": None, "b": {"c": None, "d": None}}


def _step(i, d=True):
  return {"a": np.float32(i), "b": {"c": np.int64(i), "d": np.int32(10 * i) if d else None}}


@pytest.fixture
def client(server_factory):
  tables = [reverb_shm.Table.queue(n, 100) for n in ("t1", "t2", "t3", "t4", "t5")]
  return server_factory(tables).localhost_client()


def _drain(client, table):
  n = client.server_info()[table].current_size
  return [[np.asarray(c).tolist() for c in s.data] + [s.info.priority]
          for s in client.sample(table, n, emit_timesteps=False)] if n else []


def test_public_names_used_by_reverb_clients():
  for name in ("Config", "Pattern", "create_reference_step", "pattern_from_transform",
               "create_config", "Condition", "infer_signature", "StructuredWriter"):
    assert hasattr(sw, name), name
  assert reverb_shm.structured_writer is sw


def test_scripted_episode_matches_dm_reverb(client):
  ref = sw.create_reference_step(STEP)
  configs = [
      sw.create_config({"x": ref["a"][-3:], "y": ref["b"]["c"][-1]}, "t1",
                       conditions=[sw.Condition.steps_since_applied() >= 2]),
      sw.create_config([ref["a"][-1]], "t2", conditions=[sw.Condition.step_index() % 3 == 0]),
      sw.create_config([ref["b"]["d"][-2:]], "t3", conditions=[sw.Condition.is_end_episode()]),
      sw.create_config([ref["a"][-1]], "t4", conditions=[sw.Condition.data(STEP)["b"]["c"] >= 5]),
      sw.create_config([ref["b"]["c"][-2:]], "t5", conditions=[sw.Condition.step_index() != 2],
                       priority=sw.td_error(0.5, STEP, lambda s: s["b"]["c"])),
  ]
  writer = client.structured_writer(configs)
  for i in range(7):
    writer.append(_step(i, d=i != 5))
  writer.end_episode()
  for i in range(2):
    writer.append({"a": np.float32(100 + i), "b": {"c": np.int64(i), "d": np.int32(i)}})
  writer.end_episode()
  # steps_since_applied >= 2 (counting from 1) with a 3-step history: steps 2, 4, 6.
  assert _drain(client, "t1") == [[[0, 1, 2], 2, 1.0], [[2, 3, 4], 4, 1.0], [[4, 5, 6], 6, 1.0]]
  assert _drain(client, "t2") == [[0.0, 1.0], [3.0, 1.0], [6.0, 1.0], [100.0, 1.0]]
  # End of episode only; the first episode's d is missing at step 5, so only episode 2 counts.
  assert _drain(client, "t3") == [[[0, 1], 1.0]]
  assert _drain(client, "t4") == [[5.0, 1.0], [6.0, 1.0]]
  # td_error(0.5): 0.5 * max|c| + 0.5 * mean|c| over the item's two steps.
  assert [p for *_, p in _drain(client, "t5")] == [0.75, 2.75, 3.75, 4.75, 5.75, 0.75]


def test_append_errors_name_index_and_path(client):
  ref = sw.create_reference_step(STEP)
  writer = client.structured_writer([sw.create_config([ref["a"][-1], ref["b"]["c"][-1]], "t1")])
  writer.append(_step(0))
  with pytest.raises(ValueError, match=r"column 0 \(path=\('a',\)\)\. Got float64 but expected "
                                       r"float32"):
    writer.append({"a": 1.0, "b": {"c": np.int64(1), "d": None}})
  with pytest.raises(ValueError, match=r"shape provided for column 1 \(path=\('b', 'c'\)\)"):
    writer.append({"a": np.float32(1), "b": {"c": np.zeros(2, np.int64), "d": None}})
  with pytest.raises(ValueError, match="got 4 but wanted 3"):
    writer.append({"a": 1, "b": {"c": 1, "d": 2, "e": 3}})


def test_partial_steps_create_items_only_when_the_step_closes(client):
  ref = sw.create_reference_step(STEP)
  writer = client.structured_writer([sw.create_config([ref["a"][-1], ref["b"]["c"][-1]], "t1")])
  writer.append({"a": np.float32(1), "b": {"c": None, "d": None}}, partial_step=True)
  assert writer.step_is_open and client.server_info()["t1"].current_size == 0
  writer.append({"a": None, "b": {"c": np.int64(2), "d": None}})
  assert not writer.step_is_open
  assert _drain(client, "t1") == [[1.0, 2, 1.0]]


def test_columns_no_config_references_are_not_written(client):
  ref = sw.create_reference_step(STEP)
  writer = client.structured_writer([sw.create_config([ref["a"][-1]], "t1")])
  writer.append({"a": np.float32(1), "b": {"c": np.zeros(1000), "d": np.zeros(1000)}})
  assert list(writer._writer.history) == [0]  # pylint: disable=protected-access
  assert _drain(client, "t1") == [[1.0, 1.0]]


@pytest.mark.parametrize("make, match", [
    (lambda r: sw.create_config([r["a"][-1:0:0]], "t1"), "step must be > 0"),
    (lambda r: sw.create_config([r["a"][1:]], "t1"), "start must be < 0"),
    (lambda r: sw.create_config([r["a"][-2:1]], "t1"), "stop must be <= 0"),
    (lambda r: sw.create_config([r["a"][0]], "t1"), "negative index"),
    (lambda r: sw.create_config([r["a"][-1]], ""), "table"),
    (lambda r: sw.create_config([], "t1"), "at least one column"),
    (lambda r: sw.create_config([r["a"][-1]], "t1", priority=sw.td_error(1.0, STEP, lambda s: s["a"])),
     None),
    (lambda r: sw.create_config([r["a"][-1]], "t1",
                                priority=sw.td_error(1.0, STEP, lambda s: s["b"]["c"])),
     "td_error priority reads column 1"),
])
def test_invalid_configs_are_rejected_with_their_position(client, make, match):
  ref = sw.create_reference_step(STEP)
  good = sw.create_config([ref["a"][-1]], "t1")
  if match is None:
    client.structured_writer([good, make(ref)])
    return
  with pytest.raises(ValueError, match=rf"Invalid configuration at position 1: .*{match}"):
    client.structured_writer([good, make(ref)])


def test_no_configs_is_a_value_error(client):
  with pytest.raises(ValueError, match="At least one config"):
    client.structured_writer([])


def test_reference_step_nodes_and_pattern_from_transform():
  ref = sw.create_reference_step(STEP)
  assert ref["b"]["c"][-2] == sw.PatternNode(1, stop=-2)
  assert ref["a"][-3::2] == sw.PatternNode(0, start=-3, stop=None, step=2)
  with pytest.raises(ValueError, match="int or slice"):
    ref["a"]["x"]   # pylint: disable=pointless-statement
  pattern = sw.pattern_from_transform(STEP, lambda s: {"last": s["b"]["d"][-1]})
  assert pattern == {"last": sw.PatternNode(2, stop=-1)}
  config = sw.create_config(pattern, "t1")
  assert sw.unpack_pattern(config) == pattern and config.priority == sw.constant_priority_fn(1.0)


def test_condition_algebra():
  c = sw.Condition
  assert (c.step_index() == 3).evaluate(3) and not (c.step_index() != 3).evaluate(3)
  assert (c.step_index() > 3).evaluate(4) and not (c.step_index() > 3).evaluate(3)
  assert (c.step_index() < 3).evaluate(2) and not (c.step_index() < 3).evaluate(3)
  assert (c.step_index() <= 3).evaluate(3) and not (c.step_index() <= 3).evaluate(4)
  assert (c.steps_since_applied() % 4 == 1).evaluate(5)
  assert not (c.data(STEP)["a"] == 1).evaluate(None)    # missing data -> false


def test_infer_signature():
  ref = sw.create_reference_step(STEP)
  step_spec = {"a": TensorSpec([2], np.float32), "b": {"c": np.zeros((), np.int64),
                                                       "d": TensorSpec([], np.int32)}}
  c3 = sw.create_config({"x": ref["a"][-3:], "y": ref["b"]["c"][-1]}, "t")
  c2 = sw.create_config({"x": ref["a"][-2:], "y": ref["b"]["c"][-2]}, "t")
  assert sw.infer_signature([c3], step_spec) == {"x": TensorSpec([3, 2], np.float32, "x"),
                                                 "y": TensorSpec([], np.int64, "y")}
  assert sw.infer_signature([c3, c2], step_spec)["x"] == TensorSpec([None, 2], np.float32, "x")
  with pytest.raises(ValueError, match="At least one config"):
    sw.infer_signature([], step_spec)
  with pytest.raises(ValueError, match="same table"):
    sw.infer_signature([c3, sw.create_config({"x": ref["a"][-3:], "y": ref["b"]["c"][-1]}, "u")],
                       step_spec)
  with pytest.raises(ValueError, match="pattern_structure"):
    sw.infer_signature([c3, sw.create_config([ref["a"][-1]], "t")], step_spec)
  with pytest.raises(ValueError, match="multiple dtypes"):
    sw.infer_signature([c3, sw.create_config({"x": ref["b"]["d"][-3:], "y": ref["b"]["c"][-1]},
                                             "t")], step_spec)
