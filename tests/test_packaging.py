"""Packaging: the sdist builds, a wheel built from it works outside the source tree, and a source
build without a working C compiler says what it needs."""
import glob
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _tracked(*patterns) -> list:
  out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True,
                       check=True).stdout
  return sorted(line for line in out.splitlines() if line)


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
  """(path of an sdist built from the tracked files, names of its members without the prefix)."""
  if shutil.which("git") is None or not (ROOT / ".git").exists():
    pytest.skip("needs a git checkout (the sdist is built from the tracked files)")
  tree = tmp_path_factory.mktemp("tree")
  for rel in _tracked():
    dest = tree / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / rel, dest)
  out = tmp_path_factory.mktemp("sdist")
  result = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(out)], cwd=tree,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  (path,) = out.glob("reverb_shm-*.tar.gz")
  with tarfile.open(path) as tar:
    members = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
  return path, members


@pytest.mark.timeout(300)
def test_sdist_carries_every_build_input(sdist):
  _, members = sdist
  needed = set(_tracked("csrc", "reverb_shm")) | {"setup.py", "pyproject.toml", "README.md"}
  missing = sorted(needed - members)
  assert not missing, f"the sdist lacks {missing}"
  assert {"csrc/build_core.py", "csrc/rs_internal.h", "csrc/hot/hot.h", "reverb_shm/py.typed",
          "reverb_shm/_core.pyi"} <= members
  assert not [m for m in members if m.endswith((".so", ".o")) or m == "reverb_shm/_core.c"]


@pytest.mark.timeout(900)
def test_wheel_built_from_the_sdist_works_outside_the_source_tree(sdist, tmp_path):
  path, _ = sdist
  wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "cwd"
  elsewhere.mkdir()
  pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
  build = subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                                str(path)], capture_output=True, text=True, timeout=900)
  assert build.returncode == 0, build.stderr[-3000:]
  (wheel,) = wheels.glob("reverb_shm-*.whl")
  install = subprocess.run(pip + ["install", "--no-deps", "--target", str(target), str(wheel)],
                           capture_output=True, text=True, timeout=300)
  assert install.returncode == 0, install.stderr[-3000:]
  assert (target / "reverb_shm" / "py.typed").exists()
  assert list((target / "reverb_shm").glob("_core*.so"))
  env = dict(os.environ, PYTHONPATH=str(target))
  code = ("import reverb_shm as r, reverb_shm._core as core; print(core.__file__); "
          "s = r.Server([r.Table.queue('q', 4)], name='pkg_%d' % __import__('os').getpid(), "
          "arena_bytes=1 << 20); c = r.Client('shm://' + s.name); c.insert([7], {'q': 1.0}); "
          "print(next(iter(c.sample('q', 1)))[0].data[0]); s.stop()")
  run = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True,
                       text=True, timeout=120)
  assert run.returncode == 0, run.stderr[-3000:]
  core_file, value = run.stdout.split()
  assert core_file.startswith(str(target)) and value == "7"
  cli = subprocess.run([sys.executable, "-m", "reverb_shm", "--help"], cwd=elsewhere, env=env,
                       capture_output=True, text=True, timeout=120)
  assert cli.returncode == 0 and "reverb-shm list" in cli.stdout, cli.stderr[-2000:]


@pytest.mark.timeout(300)
def test_a_build_without_a_working_compiler_says_what_it_needs(sdist, tmp_path):
  path, _ = sdist
  with tarfile.open(path) as tar:
    tar.extractall(tmp_path, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
  (tree,) = tmp_path.glob("reverb_shm-*")
  env = dict(os.environ, CC="/bin/false")
  result = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-b",
                           str(tmp_path / "lib"), "-t", str(tmp_path / "tmp")],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  assert "needs a C11 compiler (gcc or clang)" in result.stderr, result.stderr[-3000:]
  assert "the compiler used was /bin/false" in result.stderr
  assert not list((tmp_path / "lib").rglob("*.so"))


def _python39_include() -> str:
  """The C headers of a Python 3.9 on this machine (the oldest version pyproject.toml admits)."""
  candidates = [shutil.which("python3.9"), "/usr/bin/python3.9",
                *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.9*/bin/python3.9")))]
  for python in filter(None, candidates):
    try:
      out = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                            "['include'])"], capture_output=True, text=True, timeout=60)
    except OSError:
      continue
    include = out.stdout.strip()
    if out.returncode == 0 and os.path.exists(os.path.join(include, "Python.h")):
      return include
  pytest.skip("no Python 3.9 with its C headers here")


@pytest.mark.timeout(300)
def test_the_fast_path_module_uses_only_what_python_3_9_has():
  """requires-python >= 3.9: csrc/hot must compile against 3.9's C API (a 3.10 function would be
  implicitly declared there, and the module would fail to import with an undefined symbol)."""
  include = _python39_include()
  compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
  if compiler is None:
    pytest.skip("no C compiler")
  numpy_include = subprocess.run([sys.executable, "-c", "import numpy; print(numpy.get_include())"],
                                 capture_output=True, text=True, check=True).stdout.strip()
  sources = sorted(str(p) for p in (ROOT / "csrc" / "hot").glob("*.c"))
  result = subprocess.run([compiler, "-fsyntax-only", "-std=gnu11", f"-I{include}",
                           f"-I{numpy_include}", "-DNPY_NO_DEPRECATED_API=NPY_1_7_API_VERSION",
                           "-Werror=implicit-function-declaration", *sources],
                          capture_output=True, text=True, timeout=240)
  assert result.returncode == 0, result.stderr[-3000:]
