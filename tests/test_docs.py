"""Documentation that cannot rot: the site builds with warnings as errors, and every Python code
block of README.md and docs/**/*.md runs.

Code blocks are fenced with ```python. The blocks of one page run in order in one fresh
interpreter (a page reads like a notebook: later blocks use names earlier ones defined), in a
temporary working directory. A block that cannot run standalone (it needs a GPU framework,
another host, a long-running process) is fenced ```python no-run and is only compiled; such
blocks are few and each says why in the text around it.
"""
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
_FENCE = re.compile(r"^```(python[^\n]*)\n(.*?)^```\s*$", re.M | re.S)

# Runs the blocks of one page; argv[1] is a JSON list of [first line, source, run?].
_RUNNER = r"""
import json, sys
blocks = json.loads(sys.argv[1])
page = sys.argv[2]
ns = {"__name__": "__main__"}
for line, source, run in blocks:
  code = compile("\n" * (line - 1) + source, page, "exec")
  if run:
    exec(code, ns)
"""


def blocks(page: pathlib.Path):
  """[(first line of the code, source, run?)] of the page's ```python blocks."""
  text = page.read_text()
  out = []
  for m in _FENCE.finditer(text):
    info = m.group(1).split()
    if info[0] != "python":
      continue
    line = text.count("\n", 0, m.start(2)) + 1
    out.append((line, m.group(2), "no-run" not in info[1:]))
  return out


def test_the_collector_finds_blocks_and_no_run_marks(tmp_path):
  page = tmp_path / "p.md"
  page.write_text("# t\n\n```python\nx = 1\n```\n\ntext\n```python no-run\nimport gpu\n```\n"
                  "```sh\nls\n```\n")
  assert blocks(page) == [(4, "x = 1\n", True), (9, "import gpu\n", False)]


def test_every_page_has_been_looked_at():
  # The README and the guides carry runnable examples; a page that lost all of them is a
  # regression of the docs, not of the code.
  for name in ("README.md", "docs/getting-started.md", "docs/guides/migrating.md",
               "docs/guides/learners.md", "docs/guides/ray.md", "docs/guides/monitoring.md",
               "docs/guides/operating.md"):
    assert any(run for _, _, run in blocks(ROOT / name)), name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(page, tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  rel = str(page.relative_to(ROOT))
  env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
  proc = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(blocks(page)), rel],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
  assert proc.returncode == 0, f"{rel}: a code block failed\n{proc.stderr[-4000:]}"


@pytest.mark.timeout(600)
def test_mkdocs_build_strict(tmp_path):
  if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec(
      "mkdocstrings_handlers") is None:
    pytest.skip("the docs extra is not installed (pip install -e '.[docs]'); tests/run.sh "
                "installs it")
  proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                         str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                        timeout=580, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
  assert proc.returncode == 0, proc.stderr[-6000:]
  assert (tmp_path / "site" / "api" / "client" / "index.html").read_text().count(
      "TrajectoryWriter") > 0
