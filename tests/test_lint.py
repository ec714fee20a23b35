"""The package is clean under ruff (lint + import order) and mypy, with the configuration in
pyproject.toml. tests/run.sh installs both (the `lint` extra); elsewhere the tests skip when a
tool is missing."""
import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _tool(module: str):
  if importlib.util.find_spec(module) is None:
    pytest.skip(f"{module} is not installed (pip install -e '.[lint]'; tests/run.sh does)")


@pytest.mark.timeout(300)
def test_ruff_is_clean():
  _tool("ruff")
  proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "reverb_shm",
                         "tests/test_layers.py", "tests/test_docs.py", "tests/test_lint.py",
                         "tests/test_bench_report.py", "bench/report.py"],
                        cwd=ROOT, capture_output=True, text=True, timeout=280)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


@pytest.mark.timeout(600)
def test_mypy_is_clean():
  _tool("mypy")
  proc = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental",
                         "--cache-dir", "/dev/null"],
                        cwd=ROOT, capture_output=True, text=True, timeout=580)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
