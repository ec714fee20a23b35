"""Loads a script of bench/ as a module (bench/ is not a package), for the tests of its logic."""
import importlib.util
import pathlib
import types

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


def load(name: str) -> types.ModuleType:
  """The module of bench/`name`.py, executed afresh under the name `bench_<name>`."""
  spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
