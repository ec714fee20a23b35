"""Reverb's `ReverbServerConfig` text format -> Tables.

The config is a text-format protobuf message::

  message ReverbServerConfig { repeated PriorityTableCheckpoint tables = 1; int32 port = 2; }

parsed with the protobuf library's `text_format` over a descriptor built here at runtime (field
names and numbers as Reverb's `reverb_config.proto`, `checkpoint.proto` and `schema.proto`), so
no generated code and no .proto compiler is needed. protobuf is the optional extra `server`
(`pip install reverb_shm[server]`). The deprecated item list and the TensorFlow signature of
the checkpoint message are not part of this descriptor (Reverb's CLI ignores them).
"""
from typing import List, Optional, Tuple

from reverb_shm import errors
from reverb_shm import rate_limiters as rate_limiters_lib
from reverb_shm import selectors as selectors_lib
from reverb_shm import table as table_lib

__all__ = ["ConfigError", "parse", "tables_from_config", "load"]

_PACKAGE = "deepmind.reverb"


class ConfigError(ValueError):
  """The config text is malformed or names a value reverb_shm cannot build a table from."""


def _message_classes():
  """(ReverbServerConfig class) built from a runtime descriptor; ImportError if no protobuf."""
  try:
    from google.protobuf import (  # pylint: disable=g-import-not-at-top
      descriptor_pb2,
      descriptor_pool,
      message_factory,  # pylint: disable=g-import-not-at-top
    )
  except ImportError:
    raise ImportError("reading a ReverbServerConfig needs the protobuf package: "
                      "pip install 'reverb_shm[server]' (or pip install protobuf)") from None
  fdp = descriptor_pb2.FieldDescriptorProto
  opt, rep = fdp.LABEL_OPTIONAL, fdp.LABEL_REPEATED
  scalar = {"double": fdp.TYPE_DOUBLE, "int64": fdp.TYPE_INT64, "int32": fdp.TYPE_INT32,
            "bool": fdp.TYPE_BOOL, "string": fdp.TYPE_STRING}

  def message(container, name, fields, oneof=None):
    msg = container.add(name=name)
    if oneof:
      msg.oneof_decl.add(name=oneof[0])
    for field_name, number, kind, label in fields:
      f = msg.field.add(name=field_name, number=number, label=label)
      if kind in scalar:
        f.type = scalar[kind]
      else:
        f.type, f.type_name = fdp.TYPE_MESSAGE, kind
      if oneof and field_name in oneof[1]:
        f.oneof_index = 0
    return msg

  proto = descriptor_pb2.FileDescriptorProto(name="reverb_shm_server_config.proto",
                                             package=_PACKAGE, syntax="proto3")
  kdo = message(proto.message_type, "KeyDistributionOptions", [
      ("fifo", 1, "bool", opt), ("uniform", 2, "bool", opt),
      ("prioritized", 3, f".{_PACKAGE}.KeyDistributionOptions.Prioritized", opt),
      ("heap", 4, f".{_PACKAGE}.KeyDistributionOptions.Heap", opt),
      ("lifo", 6, "bool", opt), ("is_deterministic", 7, "bool", opt)],
      oneof=("distribution", {"fifo", "uniform", "prioritized", "heap", "lifo"}))
  message(kdo.nested_type, "Prioritized", [("priority_exponent", 1, "double", opt)])
  message(kdo.nested_type, "Heap", [("min_heap", 1, "bool", opt)])
  message(proto.message_type, "RateLimiterCheckpoint", [
      ("samples_per_insert", 2, "double", opt), ("min_diff", 3, "double", opt),
      ("max_diff", 4, "double", opt), ("min_size_to_sample", 5, "int64", opt),
      ("sample_count", 6, "int64", opt), ("insert_count", 7, "int64", opt),
      ("delete_count", 8, "int64", opt)])
  message(proto.message_type, "PriorityTableCheckpoint", [
      ("table_name", 1, "string", opt), ("max_size", 6, "int64", opt),
      ("max_times_sampled", 7, "int32", opt),
      ("rate_limiter", 3, f".{_PACKAGE}.RateLimiterCheckpoint", opt),
      ("sampler", 4, f".{_PACKAGE}.KeyDistributionOptions", opt),
      ("remover", 5, f".{_PACKAGE}.KeyDistributionOptions", opt),
      ("num_deleted_episodes", 8, "int64", opt), ("num_unique_samples", 10, "int64", opt)])
  message(proto.message_type, "ReverbServerConfig", [
      ("tables", 1, f".{_PACKAGE}.PriorityTableCheckpoint", rep), ("port", 2, "int32", opt)])
  pool = descriptor_pool.DescriptorPool()
  pool.Add(proto)
  return message_factory.GetMessageClass(
      pool.FindMessageTypeByName(f"{_PACKAGE}.ReverbServerConfig"))


_config_class = None


def parse(text: str):
  """Parses a text-format ReverbServerConfig.

  Returns:
    The protobuf message (fields `tables`, `port`).

  Raises:
    ConfigError: malformed text or an unknown field (the protobuf message names line, column
      and field).
    ImportError: protobuf is not installed.
  """
  global _config_class
  if _config_class is None:
    _config_class = _message_classes()
  from google.protobuf import text_format  # pylint: disable=g-import-not-at-top
  try:
    return text_format.Parse(text, _config_class())
  except text_format.ParseError as e:
    raise ConfigError(f"invalid ReverbServerConfig: {e}") from None


def _selector(options, where: str) -> selectors_lib.ItemSelector:
  kind = options.WhichOneof("distribution")
  if kind == "prioritized":
    return selectors_lib.Prioritized(options.prioritized.priority_exponent)
  if kind == "heap":
    return selectors_lib.MinHeap() if options.heap.min_heap else selectors_lib.MaxHeap()
  if kind is None:
    raise NotImplementedError(f"{where}: no selector set; expected one of fifo: true, "
                              "lifo: true, uniform: true, heap {min_heap: ...}, "
                              "prioritized {priority_exponent: ...}")
  if not getattr(options, kind):
    raise ConfigError(f"{where}.{kind} is false; a boolean selector must be set to true")
  return {"fifo": selectors_lib.Fifo, "lifo": selectors_lib.Lifo,
          "uniform": selectors_lib.Uniform}[kind]()


def tables_from_config(config) -> List[table_lib.Table]:
  """Tables of a parsed ReverbServerConfig (counters, signature etc. are ignored, as Reverb's CLI
  does).

  Raises:
    ConfigError: a value no table can be built from; the message names the field
      (e.g. "tables[0].rate_limiter.samples_per_insert: ...").
    NotImplementedError: a table without sampler or remover (as Reverb).
  """
  tables = []
  for i, t in enumerate(config.tables):
    where = f"tables[{i}]"
    sampler = _selector(t.sampler, f"{where}.sampler")
    remover = _selector(t.remover, f"{where}.remover")
    rl = t.rate_limiter
    try:
      limiter = rate_limiters_lib.RateLimiter(rl.samples_per_insert, rl.min_size_to_sample,
                                              rl.min_diff, rl.max_diff)
    except ValueError as e:
      raise ConfigError(f"{where}.rate_limiter: {e}") from None
    try:
      tables.append(table_lib.Table(t.table_name, sampler, remover, t.max_size, limiter,
                                    max_times_sampled=t.max_times_sampled))
    except (TypeError, ValueError) as e:
      raise ConfigError(f"{where} (table_name {errors.quoted_name(t.table_name)}): {e}") from None
  return tables


def load(text: str) -> Tuple[List[table_lib.Table], Optional[int]]:
  """(tables, port or None) of a text-format ReverbServerConfig.

  Raises:
    ConfigError: malformed config or a bad value (message names the field).
    NotImplementedError: a table without sampler or remover.
    ImportError: protobuf is not installed.
  """
  config = parse(text)
  return tables_from_config(config), (config.port or None)
