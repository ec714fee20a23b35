"""The example scripts: every name they import from each other and from reverb_shm exists (the
examples need gymnasium and a few minutes each, so the suite runs only tf_learner.py, in
tests/test_tf_datasets.py; this check catches an example left behind by a refactoring)."""
import ast
import importlib
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _imports_from(path: pathlib.Path):
  """(module, name, line) of every `from module import name` in `path`, at any depth."""
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for alias in node.names:
        yield node.module, alias.name, node.lineno


def _defined_names(path: pathlib.Path) -> set:
  """Names a module defines at its top level (functions, classes, assignments, imports)."""
  names = set()
  for node in ast.parse(path.read_text(), str(path)).body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update((a.asname or a.name).split(".")[0] for a in node.names)
  return names


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_name_an_example_imports_exists(example):
  missing = []
  for module, name, line in _imports_from(EXAMPLES / example):
    sibling = EXAMPLES / f"{module}.py"
    if sibling.exists():
      if name not in _defined_names(sibling):
        missing.append(f"line {line}: {name} is not defined in examples/{module}.py")
    elif module == "reverb_shm" or module.startswith("reverb_shm."):
      try:
        mod = importlib.import_module(module)
      except ImportError:      # an optional extra this venv lacks
        continue
      if not hasattr(mod, name):
        try:
          importlib.import_module(f"{module}.{name}")
        except ImportError:
          missing.append(f"line {line}: {module} has no {name}")
  assert not missing, f"examples/{example}: " + "; ".join(missing)
