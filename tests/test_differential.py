"""Differential tests: the same scripted operations against dm-reverb and reverb_shm.

Each scenario below takes the `reverb`-like module and returns JSON-able outcomes (orders,
limiter truth tables, info counters, exception types). dm-reverb runs in a subprocess with the
reference virtualenv's interpreter, REVERB_REF_PYTHON (tests/run.sh builds that venv from
tests/peers/reverb.txt and sets it). This file is also the script that subprocess runs.

When REVERB_REF_PYTHON is set, the reference must run: an interpreter that is missing, cannot
import dm-reverb or fails makes every test here fail, never skip. Without it the module is
skipped, except under CI (CI=true), where its absence is a failure too.
"""
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

REF_PYTHON = os.environ.get("REVERB_REF_PYTHON")


# ---- scenarios (run against both implementations; no pytest in here)

def _server(rv, tables):
  return rv.Server(tables)


def _drain(client, table, n):
  """Data values (column 0, flattened) of n samples, in order."""
  return [np.asarray(s.data[0]).ravel().tolist()
          for s in client.sample(table, n, emit_timesteps=False)]


def scenario_selector_orders(rv):
  sel = rv.selectors
  out = {}
  prios = [3.0, 1.0, 2.0, 1.0, 3.0, 2.0]
  for name, sampler in [("fifo", sel.Fifo()), ("lifo", sel.Lifo()), ("minheap", sel.MinHeap()),
                        ("maxheap", sel.MaxHeap())]:
    table = rv.Table(name, sampler, sel.Fifo(), 100, rv.rate_limiters.MinSize(1),
                     max_times_sampled=1)
    server = _server(rv, [table])
    client = rv.Client(f"localhost:{server.port}")
    for i, p in enumerate(prios):
      client.insert(np.int64(i), {name: p})
    out[name] = _drain(client, name, len(prios))
    server.stop()
  return out


def scenario_selector_options(rv):
  """What server_info says about each selector, read as the KeyDistributionOptions proto."""
  sel = rv.selectors
  out = {}
  for name, selector in [("uniform", sel.Uniform()), ("prioritized", sel.Prioritized(0.6)),
                         ("fifo", sel.Fifo()), ("lifo", sel.Lifo()), ("minheap", sel.MinHeap()),
                         ("maxheap", sel.MaxHeap())]:
    options = rv.Table("t", selector, selector, 10, rv.rate_limiters.MinSize(1)).info.sampler_options
    kind = options.WhichOneof("distribution")
    out[name] = [kind, options.is_deterministic, options.HasField("heap"),
                 options.heap.min_heap if kind == "heap" else None,
                 options.prioritized.priority_exponent if kind == "prioritized" else None]
  return out


def scenario_heap_ties_after_update(rv):
  sel = rv.selectors
  out = {}
  for name, sampler in [("minheap", sel.MinHeap()), ("maxheap", sel.MaxHeap())]:
    table = rv.Table(name, sampler, sel.Fifo(), 100, rv.rate_limiters.MinSize(1))
    server = _server(rv, [table])
    client = rv.Client(f"localhost:{server.port}")
    for i in range(4):
      client.insert(np.int64(i), {name: 1.0})
    keys = {}
    for s in client.sample(name, 1, emit_timesteps=False):
      keys["first"] = int(np.asarray(s.data[0]).ravel()[0])
      first_key = s.info.key
    client.mutate_priorities(name, updates={first_key: 1.0})  # same priority: to the back
    for s in client.sample(name, 1, emit_timesteps=False):
      keys["after_update"] = int(np.asarray(s.data[0]).ravel()[0])
    out[name] = keys
    server.stop()
  return out


def scenario_deterministic_selectors_random_ops(rv):
  """Seeded random inserts, samples, updates, deletes and resets on tables whose sampler and
  remover are Fifo, Lifo or a heap (no randomness in the tables): every sample's value and info,
  and the table's counters after each step. Ops the limiter would block are skipped."""
  import random  # pylint: disable=g-import-not-at-top
  sel, rl = rv.selectors, rv.rate_limiters
  kinds = {"fifo": sel.Fifo, "lifo": sel.Lifo, "min": sel.MinHeap, "max": sel.MaxHeap}
  out = {}
  for seed in range(24):
    r = random.Random(seed)
    config = [r.choice(sorted(kinds)), r.choice(sorted(kinds)), r.choice([0, 1, 2, 3]),
              r.choice([0.5, 1.0, 2.0]), r.choice([1, 2, 3]), r.choice([-1e9, -3.0, 0.0]),
              r.choice([3.0, 6.0, 1e9]), r.choice([2, 3, 5])]
    sampler, remover, mts, spi, min_size, min_diff, max_diff, max_size = config
    table = rv.Table("t", kinds[sampler](), kinds[remover](), max_size,
                     rl.RateLimiter(spi, min_size, min_diff, max_diff), max_times_sampled=mts)
    server = _server(rv, [table])
    client = rv.Client(f"localhost:{server.port}")
    log, keys = [config], {}
    for value in range(40):
      op = r.random()
      if op < 0.4 and table.can_insert(1):
        priority = r.choice([0.0, 1.0, 2.0, 3.0, -1.0])
        client.insert(np.int64(value), {"t": priority})
        row = ["insert", value, priority]
      elif 0.4 <= op < 0.75 and table.can_sample(1) and client.server_info()["t"].current_size:
        s = next(client.sample("t", 1, emit_timesteps=False))
        keys[int(np.asarray(s.data[0]).ravel()[0])] = s.info.key
        row = ["sample", int(np.asarray(s.data[0]).ravel()[0]), s.info.probability,
               s.info.table_size, s.info.priority, s.info.times_sampled]
      elif 0.75 <= op < 0.9 and keys:
        v = r.choice(sorted(keys))
        if r.random() < 0.7:
          row = ["update", v, r.choice([0.0, 1.0, 2.0, 5.0])]
          client.mutate_priorities("t", updates={keys[v]: row[2]})
        else:
          row = ["delete", v]
          client.mutate_priorities("t", deletes=[keys[v]])
      elif 0.9 <= op < 0.92:
        client.reset("t")
        row = ["reset"]
      else:
        row = ["skip"]
      log.append(row + _counters(client.server_info()["t"])[:6])
    out[seed] = log
    server.stop()
  return out


def scenario_prioritized_probabilities(rv):
  table = rv.Table("p", rv.selectors.Prioritized(1.0), rv.selectors.Fifo(), 100,
                   rv.rate_limiters.MinSize(1))
  server = _server(rv, [table])
  client = rv.Client(f"localhost:{server.port}")
  for i, p in enumerate([1.0, 3.0, 0.0]):
    client.insert(np.int64(i), {"p": p})
  seen = {}
  for s in client.sample("p", 60, emit_timesteps=False):
    seen[int(np.asarray(s.data[0]).ravel()[0])] = round(s.info.probability, 9)
  client.mutate_priorities("p", updates={k: 0.0 for k in _keys(client, "p")})
  zero = {round(s.info.probability, 9) for s in client.sample("p", 10, emit_timesteps=False)}
  server.stop()
  return {"nonzero": dict(sorted(seen.items())), "all_zero": sorted(zero)}


def _keys(client, table):
  keys = set()
  for s in client.sample(table, 40, emit_timesteps=False):
    keys.add(s.info.key)
  return keys


def scenario_limiter_truth_tables(rv):
  rl = rv.rate_limiters
  limiters = {"rl_1.5_2_0_5": lambda: rl.RateLimiter(1.5, 2, 0, 5),
              "rl_1_1_-1_1": lambda: rl.RateLimiter(1, 1, -1, 1),
              "queue3": lambda: rl.Queue(3),
              "s2i_2_2_3": lambda: rl.SampleToInsertRatio(2.0, 2, 3.0),
              "minsize2": lambda: rl.MinSize(2)}
  out = {}
  for name, make in limiters.items():
    table = rv.Table("t", rv.selectors.Fifo(), rv.selectors.Fifo(), 100, make())
    server = _server(rv, [table])
    client = rv.Client(f"localhost:{server.port}")
    rows = []
    for step in range(4):
      rows.append([table.can_insert(n) for n in range(1, 5)] +
                  [table.can_sample(n) for n in range(1, 5)])
      if table.can_insert(1):
        client.insert(np.int64(step), {"t": 1.0})
      if step >= 2 and table.can_sample(1):
        next(client.sample("t", 1))
    info = table.info.rate_limiter_info
    rows.append([info.insert_stats.completed, info.sample_stats.completed])
    out[name] = rows
    server.stop()
  return out


def scenario_info_counters(rv):
  sel, rl = rv.selectors, rv.rate_limiters
  table = rv.Table("t", sel.Uniform(), sel.Fifo(), 10, rl.RateLimiter(1, 1, -1, 5),
                   max_times_sampled=1)
  server = _server(rv, [table])
  client = rv.Client(f"localhost:{server.port}")
  client.insert(np.ones(2, np.float32), {"t": 1.0})
  client.insert(np.ones(2, np.float32), {"t": 1.0})
  next(client.sample("t", 1))
  out = {"reference": _counters(client.server_info()["t"])}
  small = rv.Table("s", sel.Fifo(), sel.Fifo(), 3, rl.MinSize(1), max_times_sampled=2)
  server2 = _server(rv, [small])
  client2 = rv.Client(f"localhost:{server2.port}")
  for i in range(5):
    client2.insert(np.int64(i), {"s": 1.0})
  out["overflow"] = _counters(client2.server_info()["s"])
  out["overflow_order"] = _drain(client2, "s", 4)
  out["after_samples"] = _counters(client2.server_info()["s"])
  client2.reset("s")
  out["after_reset"] = _counters(client2.server_info()["s"])
  server.stop()
  server2.stop()
  return out


def scenario_table_after_stop(rv):
  """A Table object keeps reporting its last state after its server stopped."""
  table = rv.Table("t", rv.selectors.Fifo(), rv.selectors.Fifo(), 10,
                   rv.rate_limiters.RateLimiter(1.0, 2, -1.0, 3.0), max_times_sampled=2)
  server = _server(rv, [table])
  client = rv.Client(f"localhost:{server.port}")
  for i in range(3):
    client.insert(np.int64(i), {"t": 1.0})
  _drain(client, "t", 2)
  server.stop()
  return {"info": _counters(table.info),
          "limiter": [table.can_sample(n) for n in (1, 2, 3)] + [table.can_insert(n)
                                                                 for n in (1, 2, 3)]}


def _counters(info):
  return [info.current_size, info.num_episodes, info.num_deleted_episodes,
          info.num_unique_samples, info.rate_limiter_info.insert_stats.completed,
          info.rate_limiter_info.sample_stats.completed, info.max_size, info.max_times_sampled,
          [info.sampler_options.is_deterministic, info.remover_options.is_deterministic]]


def scenario_sample_shapes(rv):
  table = rv.Table("t", rv.selectors.Fifo(), rv.selectors.Fifo(), 10, rv.rate_limiters.MinSize(1))
  server = _server(rv, [table])
  client = rv.Client(f"localhost:{server.port}")
  client.insert([np.ones((3, 3), np.float32), np.int32(7)], {"t": 1.0})
  flat = next(client.sample("t", 1, emit_timesteps=False))
  steps = next(client.sample("t", 1, emit_timesteps=True))
  with client.trajectory_writer(2) as w:
    w.append({"a": np.float32(1), "b": np.int8(2)})
    w.append({"a": np.float32(3), "b": np.int8(4)})
    w.create_item("t", 5.0, {"a": w.history["a"][-2:], "b": w.history["b"][-1]})
  client.mutate_priorities("t", deletes=[flat.info.key])
  item = next(client.sample("t", 1, emit_timesteps=False))
  server.stop()
  return {"flat": [list(np.shape(x)) for x in flat.data],
          "steps": [len(steps), [list(np.shape(x)) for x in steps[0].data]],
          "writer_item": [[list(np.shape(x)), np.asarray(x).tolist()] for x in item.data],
          "writer_priority": item.info.priority}


def scenario_error_types(rv):
  sel, rl = rv.selectors, rv.rate_limiters
  out = {}

  def record(name, fn):
    try:
      fn()
      out[name] = None
    except Exception as e:  # pylint: disable=broad-except
      out[name] = [c.__name__ for c in type(e).__mro__
                   if c.__name__ in ("ValueError", "RuntimeError", "TypeError", "IndexError",
                                     "KeyError", "DeadlineExceededError")]

  record("table_empty_name", lambda: rv.Table("", sel.Fifo(), sel.Fifo(), 1, rl.MinSize(1)))
  record("table_max_size_0", lambda: rv.Table("x", sel.Fifo(), sel.Fifo(), 0, rl.MinSize(1)))
  record("minsize_0", lambda: rl.MinSize(0))
  record("minsize_float", lambda: rl.MinSize(2.5))
  for args in [(5, 10, 4), (0.5, 10, 0.9), (5, 10, (8, 12)), (1, 10, (11, 15)), (0, 10, 100),
               (1, 0, (-100, 100))]:
    record(f"s2i_{args}", lambda a=args: rl.SampleToInsertRatio(*a))
  record("s2i_ok", lambda: rl.SampleToInsertRatio(1, 10, (7, 12)))
  # Integer arguments: a float (even 3.0, numpy's float64 too), a string or an int beyond int32
  # is Reverb bindings' TypeError; Python and numpy integers (and bools) are taken.
  def table(**kwargs):
    args = dict(name="i", sampler=sel.Uniform(), remover=sel.Fifo(), max_size=10,
                rate_limiter=rl.MinSize(1))
    args.update(kwargs)
    return rv.Table(**args)
  for label, value in [("float", 3.0), ("np_float64", np.float64(3.0)), ("str", "3"),
                       ("int32_overflow", 2**31), ("np_int64", np.int64(3)),
                       ("np_int32", np.int32(3)), ("np_uint8", np.uint8(3))]:
    record(f"int_arg_minsize_{label}", lambda v=value: rl.MinSize(v))
    record(f"int_arg_s2i_min_size_{label}", lambda v=value: rl.SampleToInsertRatio(1.0, v, 10.0))
    record(f"int_arg_ratelimiter_min_size_{label}",
           lambda v=value: rl.RateLimiter(1.0, v, -1.0, 1.0))
    record(f"int_arg_table_max_size_{label}", lambda v=value: table(max_size=v))
    record(f"int_arg_table_max_times_sampled_{label}",
           lambda v=value: table(max_times_sampled=v))
    if label != "str":   # (Reverb's Queue(size) takes any number: size is a float there)
      record(f"int_arg_table_queue_{label}", lambda v=value: rv.Table.queue("q", v))
      record(f"int_arg_table_stack_{label}", lambda v=value: rv.Table.stack("s", v))
  record("int_arg_minsize_bool", lambda: rl.MinSize(True))
  record("int_arg_table_max_size_bool", lambda: table(max_size=True))
  record("int_arg_minsize_np_float32", lambda: rl.MinSize(np.float32(3.0)))
  record("int_arg_table_max_size_np_float32", lambda: table(max_size=np.float32(3.0)))
  for label, value in [("float", 2.5), ("np_int64", np.int64(3)), ("str", "3")]:
    record(f"float_arg_queue_{label}", lambda v=value: rl.Queue(v))
    record(f"float_arg_stack_{label}", lambda v=value: rl.Stack(v))
  record("float_arg_prioritized_str", lambda: sel.Prioritized("0.6"))
  record("server_no_tables", lambda: rv.Server([]))
  record("server_duplicates", lambda: rv.Server(
      [rv.Table.queue("q", 1), rv.Table.queue("q", 2)]))
  table = rv.Table("t", sel.Prioritized(1.0), sel.Fifo(), 10, rl.MinSize(1))
  server = _server(rv, [table])
  client = rv.Client(f"localhost:{server.port}")
  record("insert_empty_priorities", lambda: client.insert(np.int64(1), {}))
  record("insert_unknown_table", lambda: client.insert(np.int64(1), {"nope": 1.0}))
  record("sample_unknown_table", lambda: next(client.sample("nope", 1)))
  record("mutate_unknown_table", lambda: client.mutate_priorities("nope", updates={1: 1.0}))
  record("reset_unknown_table", lambda: client.reset("nope"))
  client.insert(np.int64(1), {"t": 1.0})
  key = next(client.sample("t", 1))[0].info.key
  record("mutate_nan", lambda: client.mutate_priorities("t", updates={key: math.nan}))
  record("mutate_negative", lambda: client.mutate_priorities("t", updates={key: -1.0}))
  record("mutate_unknown_key", lambda: client.mutate_priorities("t", updates={12345: 1.0}))
  record("mutate_negative_key", lambda: client.mutate_priorities("t", updates={-1: 1.0}))
  record("mutate_key_2_64", lambda: client.mutate_priorities("t", deletes=[2**64]))
  record("insert_str_priority", lambda: client.insert(np.int64(1), {"t": "1"}))
  record("sample_float_count", lambda: next(client.sample("t", 2.0)))
  record("trajectory_writer_0", lambda: client.trajectory_writer(0))
  record("legacy_writer_0", lambda: client.writer(0))
  record("legacy_writer_chunk_gt_len", lambda: client.writer(2, chunk_length=3))
  record("legacy_writer_in_flight_0", lambda: client.writer(2, max_in_flight_items=0))
  w = client.trajectory_writer(2)
  record("history_before_append", lambda: w.history)
  w.append({"x": np.float32(1)})
  record("append_wrong_dtype", lambda: w.append({"x": np.float64(1)}))
  record("append_wrong_shape", lambda: w.append({"x": np.zeros(2, np.float32)}))
  record("create_item_not_column", lambda: w.create_item("t", 1.0, {"x": 1}))
  record("create_item_empty", lambda: w.create_item("t", 1.0, {}))
  record("create_item_nan", lambda: w.create_item("t", math.nan, w.history["x"][-1:]))
  record("create_item_none_priority", lambda: w.create_item("t", None, w.history["x"][-1:]))
  record("create_item_unknown_table", lambda: w.create_item("nope", 1.0, w.history["x"][-1:]))
  record("history_slice_too_long", lambda: w.history["x"][-3:])
  record("flush_negative", lambda: w.flush(-1))
  record("configure_bad", lambda: w.configure(("x",), num_keep_alive_refs=0,
                                              max_chunk_length=None))
  record("configure_chunk_gt_keep", lambda: w.configure(("x",), num_keep_alive_refs=2,
                                                        max_chunk_length=3))
  w.close()
  lw = client.writer(2)
  lw.append([np.int64(1)])
  record("legacy_create_item_too_long", lambda: lw.create_item("t", 3, 1.0))
  record("legacy_create_item_more_than_buffered", lambda: lw.create_item("t", 2, 1.0))
  record("legacy_create_item_zero", lambda: lw.create_item("t", 0, 1.0))
  record("legacy_append_other_leaf_count", lambda: lw.append([np.int64(1), np.int64(2)]))
  lw.close()
  record("legacy_close_twice", lambda: lw.close())
  record("legacy_append_after_close", lambda: lw.append([np.int64(1)]))
  record("legacy_create_item_after_close", lambda: lw.create_item("t", 1, 1.0))
  server.stop()
  return out


def scenario_structured_writer(rv):
  sw = rv.structured_writer
  step = {"a": None, "b": {"c": None, "d": None}}
  ref = sw.create_reference_step(step)
  configs = [
      sw.create_config({"x": ref["a"][-3:], "y": ref["b"]["c"][-1]}, "t1",
                       conditions=[sw.Condition.steps_since_applied() >= 2]),
      sw.create_config([ref["a"][-1]], "t2", conditions=[sw.Condition.step_index() % 3 == 0]),
      sw.create_config([ref["b"]["d"][-2:]], "t3", conditions=[sw.Condition.is_end_episode()]),
      sw.create_config([ref["a"][-1]], "t4",
                       conditions=[sw.Condition.data(step)["b"]["c"] >= 5]),
      sw.create_config([ref["b"]["c"][-2:]], "t5", conditions=[sw.Condition.step_index() != 2],
                       priority=sw.td_error(0.5, step, lambda s: s["b"]["c"])),
  ]
  names = ["t1", "t2", "t3", "t4", "t5"]
  server = _server(rv, [rv.Table.queue(n, 100) for n in names])
  client = rv.Client(f"localhost:{server.port}")
  writer = client.structured_writer(configs)
  for i in range(7):
    writer.append({"a": np.float32(i),
                   "b": {"c": np.int64(i), "d": None if i == 5 else np.int32(10 * i)}})
  writer.end_episode()
  for i in range(2):
    writer.append({"a": np.float32(100 + i), "b": {"c": np.int64(i), "d": np.int32(i)}})
  writer.end_episode()
  out = {}
  info = client.server_info()
  for n in names:
    k = info[n].current_size
    out[n] = [[np.asarray(x).tolist() for x in s.data] + [s.info.priority]
              for s in client.sample(n, k, emit_timesteps=False)] if k else []
  errs = {}
  for label, data in [("dtype", {"a": 1.0, "b": {"c": np.int64(1), "d": np.int32(2)}}),
                      ("length", {"a": np.float32(1), "b": {"c": 1, "d": 2, "e": 3}})]:
    try:
      writer.append(data)
    except ValueError as e:
      errs[label] = "ValueError"
  out["errors"] = errs
  spec = sw.infer_signature(configs[:1], {"a": np.zeros((), np.float32),
                                          "b": {"c": np.zeros((), np.int64),
                                                "d": np.zeros((), np.int32)}})
  out["signature"] = {k: [list(v.shape), np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype)).name,
                          v.name] for k, v in spec.items()}
  server.stop()
  return out


def _tensor_spec(rv):
  """The TensorSpec class each implementation takes in a signature (dm-reverb: TensorFlow's)."""
  spec = getattr(rv, "TensorSpec", None)
  if spec is None:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top  (reference venv only)
    spec = tf.TensorSpec
  return spec


def _outcome(fn):
  """fn()'s value, or the names of the built-in classes of the exception it raised."""
  try:
    return ["ok", fn()]
  except Exception as e:  # pylint: disable=broad-except
    return sorted(c.__name__ for c in type(e).__mro__
                  if c.__name__ in ("ValueError", "RuntimeError", "TypeError", "IndexError",
                                    "KeyError"))


def scenario_ragged_object_insert(rv):
  """A ragged object array is rejected with TypeError and the table stays empty."""
  server = _server(rv, [rv.Table.queue("q", 10)])
  client = rv.Client(f"localhost:{server.port}")
  out = {"ragged": _outcome(lambda: client.insert(np.array([[1, 2], [3]], dtype=object),
                                                  {"q": 1.0})),
         "size_after": client.server_info()["q"].current_size}
  server.stop()
  return out


def scenario_legacy_writer_signature_per_step(rv):
  """The legacy writer checks its steps against a signature that describes one step."""
  spec = _tensor_spec(rv)
  table = rv.Table("s", rv.selectors.Fifo(), rv.selectors.Fifo(), 10, rv.rate_limiters.MinSize(1),
                   signature={"x": spec([2], np.float32)})
  server = _server(rv, [table])
  client = rv.Client(f"localhost:{server.port}")
  out = {}
  w = client.writer(3)
  for i in range(3):
    w.append({"x": np.full(2, i, np.float32)})
  out["three_steps"] = _outcome(lambda: w.create_item("s", 3, 1.0))
  out["one_step"] = _outcome(lambda: w.create_item("s", 1, 1.0))
  w.close()
  for label, value in [("wrong_shape", np.ones(3, np.float32)),
                       ("wrong_dtype", np.ones(2, np.float64))]:
    bad = client.writer(2)
    bad.append({"x": value})
    out[label] = _outcome(lambda b=bad: b.create_item("s", 1, 1.0))
    try:
      bad.close()
    except Exception:  # pylint: disable=broad-except  (dm-reverb may raise the error again)
      pass
  out["items"] = [np.asarray(s.data[0]).tolist()
                  for s in client.sample("s", client.server_info()["s"].current_size,
                                         emit_timesteps=False)]
  server.stop()
  return out


def scenario_same_bytes_other_shapes(rv):
  """Items whose column has one dtype and byte size but other shapes sample back in their own
  shapes, with a reset between them and without."""
  out = {}
  for reset in (True, False):
    server = _server(rv, [rv.Table.queue("q", 10)])
    client = rv.Client(f"localhost:{server.port}")
    shapes = []
    for steps, pattern in [([1.0, 2.0], lambda h: h[-2:]),
                           ([np.array([1.0, 2.0])], lambda h: h[-1:]),
                           ([np.arange(3.0)], lambda h: h[-1]),
                           ([np.arange(3.0)], lambda h: h[-1:])]:
      with client.trajectory_writer(4) as writer:
        for step in steps:
          writer.append({"r": step})
        writer.create_item("q", 1.0, {"r": pattern(writer.history["r"])})
      if reset:
        shapes.append(list(next(client.sample("q", 1, emit_timesteps=False)).data[0].shape))
        client.reset("q")
    if not reset:
      shapes = [list(s.data[0].shape) for s in client.sample("q", 4, emit_timesteps=False)]
    out[f"reset_{reset}"] = shapes
    server.stop()
  return out


def scenario_partial_step_history_lengths(rv):
  """An open partial step counts in every known column's history (Acme's SequenceAdder slices
  history[c][-4:-1] while the step is open)."""
  server = _server(rv, [rv.Table.queue("q", 100)])
  client = rv.Client(f"localhost:{server.port}")
  out = {"lengths": []}
  with client.trajectory_writer(5) as w:
    w.append({"obs": np.float32(0)}, partial_step=True)
    out["lengths"].append([len(w.history["obs"])])
    for i in range(1, 5):
      w.append({"action": np.int64(i)})
      w.append({"obs": np.float32(i)}, partial_step=True)
      out["lengths"].append([len(w.history["obs"]), len(w.history["action"])])
    w.create_item("q", 1.0, {"action": w.history["action"][-4:-1],
                             "obs": w.history["obs"][-4:-1]})
    out["open_cell"] = _outcome(lambda: w.create_item("q", 1.0, {"a": w.history["action"][-1]}))
    w.append({"action": np.int64(5)})
    out["after_close"] = [len(w.history["obs"]), len(w.history["action"])]
  out["item"] = [np.asarray(x).tolist() for x in next(client.sample("q", 1,
                                                                    emit_timesteps=False)).data]
  server.stop()
  return out


def scenario_history_out_of_range_after_clear(rv):
  """After end_episode(clear_buffers=True) and one append, history[c][-2:] raises an error that
  client code catches as ValueError (Reverb's type)."""
  server = _server(rv, [rv.Table.queue("q", 10)])
  client = rv.Client(f"localhost:{server.port}")
  out = {}
  with client.trajectory_writer(3) as w:
    for i in range(3):
      w.append({"x": np.float32(i)})
    w.end_episode(clear_buffers=True)
    w.append({"x": np.float32(9)})
    out["len"] = len(w.history["x"])
    for label, index in [("slice", slice(-2, None)), ("position", -2)]:
      try:
        w.history["x"][index]
        out[label] = None
      except ValueError:
        out[label] = "ValueError"
    w.end_episode()
  server.stop()
  return out


def scenario_background_delivery(rv):
  """Created items reach samplers without flush; items held back by the rate limiter after
  end_episode timed out are inserted as it admits them, with no further writer call."""
  server = _server(rv, [rv.Table.queue("q", 1), rv.Table.queue("v", 10)])
  client = rv.Client(f"localhost:{server.port}")

  def values(table, n):
    """n items sampled one at a time, each once the table holds one (3 s at most; dm-reverb's
    Client.sample has no timeout): "missing" for an item that never came."""
    out = []
    for _ in range(n):
      deadline = time.monotonic() + 3
      while client.server_info()[table].current_size < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
      if client.server_info()[table].current_size < 1:
        out.append("missing")
        continue
      out.append(np.asarray(next(client.sample(table, 1, emit_timesteps=False)).data[0])
                 .ravel().tolist())
    return out

  out = {}
  visible = client.trajectory_writer(2)
  for i in range(2):
    visible.append({"x": np.float32(i)})
    visible.create_item("v", 1.0, {"x": visible.history["x"][-1:]})
  out["visible"] = values("v", 2)
  writer = client.trajectory_writer(2)
  for i in range(3):
    writer.append({"x": np.float32(i)})
    writer.create_item("q", 1.0, {"x": writer.history["x"][-1:]})
  try:
    writer.end_episode(timeout_ms=100)
    out["end_episode"] = None
  except rv.DeadlineExceededError:
    out["end_episode"] = "DeadlineExceededError"
  out["held_back"] = values("q", 3)
  writer.close()
  visible.close()
  server.stop()
  return out


SCENARIOS = {name: fn for name, fn in globals().items() if name.startswith("scenario_")}


def run_all(rv) -> dict:
  return {name: fn(rv) for name, fn in SCENARIOS.items()}


if __name__ == "__main__" and sys.argv[1:] == ["--reference"]:
  import reverb  # pylint: disable=g-import-not-at-top  (dm-reverb, reference venv only)
  print("JSON:" + json.dumps(run_all(reverb)))
  sys.exit(0)


# ---- pytest part
import pytest  # noqa: E402  (the reference run above must not need pytest)

import reverb_shm  # noqa: E402

_IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def reference_unavailable(ref_python, in_ci: bool):
  """Why the dm-reverb reference cannot be used without failing: a skip reason, or None.

  Raises:
    AssertionError: REVERB_REF_PYTHON unset under CI, or set to a path that is no executable.
  """
  if not ref_python:
    if in_ci:
      raise AssertionError("REVERB_REF_PYTHON is not set under CI: run the suite with "
                           "tests/run.sh, which builds the dm-reverb reference venv")
    return "REVERB_REF_PYTHON not set (tests/run.sh sets it to the dm-reverb reference venv)"
  if not (os.path.isfile(ref_python) and os.access(ref_python, os.X_OK)):
    raise AssertionError(f"REVERB_REF_PYTHON={ref_python!r} is not an executable interpreter")
  return None


def run_reference(ref_python) -> dict:
  """Outcomes of every scenario under dm-reverb, run by `ref_python` in a subprocess.

  Raises:
    AssertionError: the subprocess failed (dm-reverb missing, a scenario raised) or printed
      no outcomes; the message carries its stderr.
  """
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
  proc = subprocess.run([ref_python, os.path.abspath(__file__), "--reference"],
                        capture_output=True, text=True, timeout=300, env=env, cwd="/")
  lines = [l for l in proc.stdout.splitlines() if l.startswith("JSON:")]
  if proc.returncode != 0 or not lines:
    raise AssertionError(f"the dm-reverb reference run with {ref_python} failed "
                         f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}")
  return json.loads(lines[-1][5:])


@pytest.fixture(scope="module")
def reference():
  skip = reference_unavailable(REF_PYTHON, _IN_CI)
  if skip:
    pytest.skip(skip)
  return run_reference(REF_PYTHON)


# Where reverb_shm deliberately raises something else (docs/differences.md): history positions
# outside the buffered range raise an error that is an IndexError and a ValueError (not listed:
# catchable as Reverb's); a table's max_size of True (Reverb: 1) and a numpy float32 where an int
# is wanted (Reverb's bindings truncate it: np.float32(2.5) is 2) are an ArgumentTypeError.
_ARGUMENT_TYPE_ERROR = ["TypeError", "ValueError"]
DELIBERATE_ERRORS = {"int_arg_table_max_size_bool": _ARGUMENT_TYPE_ERROR,
                     "int_arg_minsize_np_float32": _ARGUMENT_TYPE_ERROR,
                     "int_arg_table_max_size_np_float32": _ARGUMENT_TYPE_ERROR}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(set(SCENARIOS) - {"scenario_error_types"}))
def test_matches_dm_reverb(reference, name):
  ours = json.loads(json.dumps(SCENARIOS[name](reverb_shm)))
  assert ours == reference[name]


@pytest.mark.timeout(300)
def test_error_types_catchable_as_dm_reverb_ones(reference):
  """Every call that fails in dm-reverb fails here with an exception catchable as Reverb's (ours
  may add classes, e.g. UnknownTableError is a ValueError and a RuntimeError, decision 12)."""
  ours = scenario_error_types(reverb_shm)
  assert set(ours) == set(reference["scenario_error_types"])
  for case, ref_classes in reference["scenario_error_types"].items():
    if case in DELIBERATE_ERRORS:
      assert ours[case] == DELIBERATE_ERRORS[case], case
    elif ref_classes is None:
      assert ours[case] is None, case
    else:
      assert ours[case] is not None and set(ref_classes) <= set(ours[case]), (case, ours[case])


# ---- the reference is never silently skipped

def test_unusable_reference_fails_not_skips(tmp_path):
  """A set REVERB_REF_PYTHON that is missing or lacks dm-reverb fails; CI without it fails."""
  with pytest.raises(AssertionError, match="not an executable"):
    reference_unavailable(str(tmp_path / "nope" / "python"), in_ci=False)
  with pytest.raises(AssertionError, match="not set under CI"):
    reference_unavailable(None, in_ci=True)
  assert "not set" in reference_unavailable(None, in_ci=False)
  assert reference_unavailable(sys.executable, in_ci=True) is None
  # An interpreter without dm-reverb (this one) is usable as a path but its run fails.
  with pytest.raises(AssertionError, match="No module named 'reverb'"):
    run_reference(sys.executable)
