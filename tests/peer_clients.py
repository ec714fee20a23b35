"""Running a real Reverb client's own tests (TF-Agents, Acme) against reverb_shm in its peer venv.

The peer venv (tests/peers/NAME.txt, built by tests/peers/venv.sh) holds the client and its
dependencies but no dm-reverb. reverb_shm is built as a wheel from this checkout and installed
into a temporary directory (never into the shared peer venv); `import reverb` resolves to it
through tests/peers/reverb_shim. Not a test module: test_tfagents.py and test_acme.py use it.
"""
import os
import pathlib
import subprocess
import xml.etree.ElementTree as ET
from typing import Dict, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
PEERS = ROOT / "tests" / "peers"
SHIM = PEERS / "reverb_shim"


def run(cmd, timeout, **kw) -> subprocess.CompletedProcess:
  return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


_SITES: Dict[str, pathlib.Path] = {}   # interpreter tag -> site (one wheel build per session)


def install_reverb_shm(python: str, tmp: pathlib.Path) -> pathlib.Path:
  """A directory (under `tmp`, or the one an earlier call of this session made for the same
  interpreter version) holding reverb_shm installed from a wheel of this checkout built by
  `python`."""
  tag = run([python, "-c", "import sys; print(sys.implementation.cache_tag)"],
            timeout=120).stdout.strip()
  if tag in _SITES and _SITES[tag].exists():
    return _SITES[tag]
  build = run([python, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"),
               str(ROOT)], timeout=900)
  assert build.returncode == 0, build.stderr[-3000:]
  wheel, = (tmp / "dist").glob("reverb_shm-*.whl")
  site = tmp / "site"
  inst = run([python, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
              str(wheel)], timeout=300)
  assert inst.returncode == 0, inst.stderr[-3000:]
  _SITES[tag] = site
  return site


def site_packages(python: str, package: str) -> str:
  """The site-packages directory holding top-level `package` in the peer venv (its tests run
  from there); found without importing it."""
  proc = run([python, "-c", "import importlib.util, os; print(os.path.dirname(importlib.util."
              f"find_spec({package!r}).submodule_search_locations[0]))"], timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout.strip().splitlines()[-1]


def peer_env(*paths) -> dict:
  """The environment of a peer run: `paths` (the shim first) on PYTHONPATH, TF's logs quiet."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in paths),
             TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("PYTHONHOME", None)
  return env


def run_pytest(python: str, files: Sequence[str], cwd: str, env: dict, report: pathlib.Path,
               timeout: int) -> Dict[str, str]:
  """Runs the peer's pytest on `files` (paths relative to `cwd`); test id -> passed / failed /
  skipped, from its JUnit report."""
  proc = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
              "ignore::DeprecationWarning", "--timeout", "300", "--timeout-method", "thread",
              f"--junitxml={report}", *files], timeout=timeout, cwd=cwd, env=env)
  assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
  outcomes = {}
  for case in ET.parse(report).getroot().iter("testcase"):
    kind = "passed"
    for child in case:
      if child.tag in ("failure", "error"):
        kind = "failed"
      elif child.tag == "skipped":
        kind = "skipped"
    outcomes[f"{case.get('classname')}::{case.get('name')}"] = kind
  outcomes["__output__"] = proc.stdout[-6000:]
  return outcomes
