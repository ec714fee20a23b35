"""The package's layers: Reverb's public names resolve, and imports (Python and C) go only down.

Python: every `import` of a reverb_shm module (at module level or inside a function) is read with
`ast`; each module belongs to a tier (TIERS below); a module may import modules of its own tier
or lower ones, and the whole graph (including the implicit import of a submodule's parent
package) must be acyclic. C: every call from one csrc/*.c file to a function defined in another
must go to a strictly lower layer (C_LAYERS, documented in csrc/rs_internal.h).
"""
import ast
import importlib
import pathlib
import re

import pytest

import reverb_shm

ROOT = pathlib.Path(reverb_shm.__file__).resolve().parent.parent
PKG = ROOT / "reverb_shm"

# --------------------------------------------------------------------------------------------
# (a) Reverb 0.14's public names (dm-reverb's reverb/__init__.py and the public modules it
# exports; read from the `reverb` peer venv).

REVERB_TOP = [
    "Client", "DeadlineExceededError", "ReplaySample", "ReverbError", "SampleInfo", "Server",
    "Table", "TrajectoryColumn", "TrajectoryWriter", "Writer", "checkpointers", "client",
    "errors", "item_selectors", "platform", "rate_limiters", "replay_sample", "selectors",
    "server", "structured", "structured_writer", "trajectory_writer",
]
REVERB_MODULES = {
    "client": ["Client", "Writer"],
    "errors": ["DeadlineExceededError", "ReverbError"],
    "item_selectors": ["Fifo", "Lifo", "MaxHeap", "MinHeap", "Prioritized", "Uniform"],
    "rate_limiters": ["MinSize", "Queue", "RateLimiter", "SampleToInsertRatio", "Stack"],
    "replay_sample": ["ReplaySample", "SampleInfo"],
    "server": ["Server", "Table"],
    "structured_writer": ["Condition", "Config", "ReferenceStep", "StructuredWriter",
                          "constant_priority_fn", "create_config", "create_reference_step",
                          "infer_signature", "pattern_from_transform", "td_error",
                          "unpack_pattern"],
    "trajectory_writer": ["TrajectoryColumn", "TrajectoryWriter"],
    "platform.checkpointers_lib": ["CheckpointerBase", "DefaultCheckpointer",
                                   "TempDirCheckpointer"],
}
# Names Reverb exports that reverb_shm does not have (yet), and why.
_TF = "TensorFlow's PatternDataset (structured writer patterns as a dataset): not provided"
_TF_MODULE = ("a module of reverb_shm.tf (the optional extra `tf`); tests/peers/reverb_shim maps "
              "reverb.{0} to reverb_shm.tf.{0}")
NOT_YET = {
    "PatternDataset": _TF, "pattern_dataset": _TF,
    "tf_client": _TF_MODULE.format("tf_client"),
    "timestep_dataset": _TF_MODULE.format("timestep_dataset"),
    "trajectory_dataset": _TF_MODULE.format("trajectory_dataset"),
}
# Reverb's TensorFlow names (reverb_shm.<name> with the `tf` extra installed) are checked by
# tests/test_tf_datasets.py, which imports TensorFlow; this module does not.
NEVER = {  # Reverb names with no counterpart by design
    "server.TableExtensionBase": "C++ table extensions; reverb_shm tables take none",
    "structured_writer.ConditionProto": "Reverb's protobuf message; conditions are Python "
                                        "objects here",
}


@pytest.mark.parametrize("name", REVERB_TOP)
def test_reverb_top_level_name_resolves(name):
  assert getattr(reverb_shm, name) is not None


@pytest.mark.parametrize("name", sorted(NOT_YET))
def test_reverb_name_not_provided_yet(name):
  if hasattr(reverb_shm, name):
    pytest.xfail(f"reverb_shm.{name} exists now: move it to REVERB_TOP")
  pytest.skip(NOT_YET[name])


@pytest.mark.parametrize("module,name", [(m, n) for m, ns in REVERB_MODULES.items() for n in ns])
def test_reverb_module_path_resolves(module, name):
  mod = importlib.import_module(f"reverb_shm.{module}")
  assert getattr(mod, name) is not None
  if module not in ("platform.checkpointers_lib",):   # the package exposes each module too
    head = module.split(".")[0]
    assert getattr(reverb_shm, head) is not None


def test_reverb_aliases_are_the_same_objects():
  assert reverb_shm.client.Client is reverb_shm.Client
  assert reverb_shm.server.Table is reverb_shm.Table
  assert reverb_shm.client.Writer is reverb_shm.Writer
  assert reverb_shm.structured is reverb_shm.structured_writer     # as Reverb's alias
  assert reverb_shm.selectors.Uniform is reverb_shm.item_selectors.Uniform
  assert reverb_shm.trajectory_writer.TrajectoryColumn is reverb_shm.TrajectoryColumn
  for name in NEVER:
    module, attr = name.split(".")
    assert not hasattr(importlib.import_module(f"reverb_shm.{module}"), attr), name


def test_public_fast_path_names_resolve():
  from reverb_shm import shared_table, step_inserter  # pylint: disable=g-import-not-at-top
  assert shared_table.SharedTable is reverb_shm.SharedTable
  assert step_inserter.StepInserter is not None
  assert reverb_shm.TableInfo is reverb_shm.table.TableInfo


# --------------------------------------------------------------------------------------------
# (b) Python import layers.

# Tiers from the bottom. A module imports only modules of its own tier or below.
TIERS = [
    ("vocabulary", ["errors", "selectors", "item_selectors", "rate_limiters", "replay_sample",
                    "specs", "_internal", "_internal.timeouts", "_internal.structure",
                    "_internal.keys", "_internal.columns", "_internal.table_info",
                    "_internal.arguments"]),
    ("core", ["_internal.*", "_checkpoint", "_checkpoint.*"]),
    ("tables", ["step_inserter", "shared_table", "table", "checkpointers", "platform",
                "platform.*"]),
    ("writers", ["trajectory_writer", "writer", "structured_writer"]),
    ("client", ["client", "learner"]),
    ("bridge", ["bridge", "bridge.*", "metrics", "metrics.*"]),   # endpoints a Server may host
    ("server", ["server"]),
    ("extensions", ["tf", "tf.*", "torch", "torch.*", "jax", "jax.*", "ray", "ray.*"]),
    ("cli", ["cli", "cli.*"]),
    ("package", ["", "__main__"]),
]
COMPILED = {"reverb_shm._core", "reverb_shm._hot"}   # C extensions: the bottom of everything


def _modules() -> dict:
  """{dotted module name: path} of every Python module of the package."""
  out = {}
  for path in sorted(PKG.rglob("*.py")):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
      parts.pop()
    out[".".join(parts)] = path
  return out


def _tier(module: str) -> int:
  short = module[len("reverb_shm."):] if module != "reverb_shm" else ""
  for exact_pass in (True, False):
    for i, (_, patterns) in enumerate(TIERS):
      for pat in patterns:
        if exact_pass and pat == short:
          return i
        if not exact_pass and pat.endswith(".*") and short.startswith(pat[:-1]):
          return i
  raise AssertionError(f"module {module} has no tier: add it to TIERS in {__file__}")


def _imports(module: str, path: pathlib.Path, modules: dict) -> set:
  """reverb_shm modules that `module` imports (anywhere in its body)."""
  found = set()
  tree = ast.parse(path.read_text(), str(path))
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] +
                        ([base] if base else []))
      names = []
      for alias in node.names:
        sub = f"{base}.{alias.name}"
        names.append(sub if sub in modules or sub in COMPILED else base)
    else:
      continue
    for name in names:
      if name == "reverb_shm" or name.startswith("reverb_shm."):
        if name in COMPILED:
          continue
        while name not in modules and "." in name:   # an attribute path: its module
          name = name.rpartition(".")[0]
        found.add(name)
        parent = name.rpartition(".")[0]            # importing a.b.c runs a.b's __init__
        while parent and parent != "reverb_shm":    # (unless the importer is inside a.b)
          if not module.startswith(parent + "."):
            found.add(parent)
          parent = parent.rpartition(".")[0]
  found.discard(module)
  return found


def _graph() -> dict:
  modules = _modules()
  return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_every_import_goes_down_the_tiers():
  upward = []
  for module, deps in _graph().items():
    for dep in deps:
      if _tier(dep) > _tier(module):
        upward.append(f"{module} ({TIERS[_tier(module)][0]}) imports {dep} "
                      f"({TIERS[_tier(dep)][0]})")
  assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def _cycles(graph: dict) -> list:
  """Strongly connected components with more than one node (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []
  counter = [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycle():
  graph = _graph()
  graph.pop("reverb_shm", None)   # the package imports everything; nothing imports it back
  for module, deps in graph.items():
    assert "reverb_shm" not in deps, f"{module} imports the reverb_shm package itself"
  assert _cycles(graph) == []


def test_the_checker_sees_cycles_and_upward_imports():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _tier("reverb_shm._internal.shm") < _tier("reverb_shm.client") < _tier(
      "reverb_shm.bridge.remote") < _tier("reverb_shm.server")
  with pytest.raises(AssertionError, match="no tier"):
    _tier("reverb_shm.brand_new_module")


def test_import_reverb_shm_imports_no_optional_extra():
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import sys, reverb_shm\n"
          "bad = [m for m in ('grpc', 'google.protobuf', 'tensorflow', 'torch', 'jax', 'ray',"
          " 'prometheus_client', 'rich', 'tqdm', 'zmq') if m in sys.modules]\n"
          "print(bad)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, check=True).stdout
  assert out.strip() == "[]"


# --------------------------------------------------------------------------------------------
# C layers (csrc/rs_internal.h documents them).

C_LAYERS = {
    "util.c": 0,
    "layout_cache.c": 1,
    "lock.c": 1, "sumtree.c": 1, "index.c": 1, "limiter.c": 1, "writer_items.c": 1, "extent.c": 1,
    "liveness.c": 1, "gather_thread.c": 1, "fd_spin.c": 1,
    "selectors.c": 2, "arena.c": 2, "counters.c": 2,
    "slots.c": 3, "bridge_layout.c": 3,
    "table.c": 4, "table_check.c": 4,
    "layout.c": 5, "fastpath.c": 5, "snapshot.c": 5, "table_wait.c": 5,
    "check.c": 6,
}
_C_DEF = re.compile(r"^(?!static)[a-zA-Z_][\w \*]*?\b(rs_\w+)\s*\([^;{]*\)\s*\{", re.M)
_C_CALL = re.compile(r"\b(rs_\w+)\s*\(")


def test_c_files_call_only_lower_layers():
  csrc = ROOT / "csrc"
  sources = {p.name: re.sub(r"/\*.*?\*/|//[^\n]*", "", p.read_text(), flags=re.S)
             for p in sorted(csrc.glob("*.c"))}
  assert set(sources) == set(C_LAYERS), "assign every csrc/*.c file a layer in C_LAYERS"
  defined = {}
  for name, src in sources.items():
    for m in _C_DEF.finditer(src):
      defined.setdefault(m.group(1), name)
  assert defined["rs_tlock"] == "lock.c" and defined["rs_table_repair"] == "table.c"
  bad = []
  for name, src in sources.items():
    for m in _C_CALL.finditer(src):
      where = defined.get(m.group(1))
      if where and where != name and C_LAYERS[where] >= C_LAYERS[name]:
        bad.append(f"{name} (layer {C_LAYERS[name]}) calls {m.group(1)} of {where} "
                   f"(layer {C_LAYERS[where]})")
  assert not bad, "\n".join(sorted(set(bad)))
