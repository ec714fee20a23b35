"""DeepMind Acme's own Reverb adder tests, unmodified, and Acme's make_reverb_dataset, run
against reverb_shm.

The acme peer venv (tests/peers/acme.txt) holds dm-acme 0.4.0, the newest on PyPI, installed
with --no-deps (tests/peers/acme.nodeps.txt): its declared requirements pin dm-launchpad and
dm-reverb, which have no wheels for this Python. Acme's package __init__ imports launchpad
without using it on these paths; tests/peers/launchpad_stub stands in for that import (any
call raises). `import reverb` resolves to reverb_shm (tests/peers/reverb_shim).

- The three adder test files that the dm-acme sdist ships (episode, sequence and transition
  adders: 45 tests; they write with reverb.Client.trajectory_writer and read back with
  Client.sample) must all pass.
- tests/peers/acme_dataset_check.py (run in the same peer process) fills a table through
  Acme's NStepTransitionAdder and reads it with an unmodified call of
  `acme.datasets.make_reverb_dataset` (an interleave of
  TrajectoryDataset.from_table_signature(...).batch(n, drop_remainder=True)), checking every
  transition exactly.

ACME_PYTHON (set by tests/run.sh) names the peer venv's interpreter; without it the tests are
skipped.
"""
import os
import shutil
import sys

import peer_clients
import pytest

PEER_PYTHON = os.environ.get("ACME_PYTHON")
ADDER_TESTS = [
    "acme/adders/reverb/episode_test.py",
    "acme/adders/reverb/sequence_test.py",
    "acme/adders/reverb/transition_test.py",
]
STUBS = peer_clients.PEERS / "launchpad_stub"

pytestmark = pytest.mark.skipif(
    not PEER_PYTHON, reason="ACME_PYTHON not set (tests/run.sh builds the acme peer venv)")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  return peer_clients.install_reverb_shm(PEER_PYTHON, tmp_path_factory.mktemp("acme"))


@pytest.mark.timeout(1200)
def test_acme_adder_tests_and_make_reverb_dataset_pass(site, tmp_path):
  # (copied next to nothing else, so that no conftest of this repository is collected with it)
  check = tmp_path / "acme_dataset_check_test.py"
  shutil.copy(peer_clients.PEERS / "acme_dataset_check.py", check)
  env = peer_clients.peer_env(peer_clients.SHIM, site, STUBS)
  cwd = peer_clients.site_packages(PEER_PYTHON, "acme")
  outcomes = peer_clients.run_pytest(PEER_PYTHON, ADDER_TESTS + [str(check)], cwd, env,
                                     tmp_path / "junit.xml", timeout=1100)
  output = outcomes.pop("__output__")
  passed = sorted(n for n, k in outcomes.items() if k == "passed")
  failed = sorted(n for n, k in outcomes.items() if k == "failed")
  skipped = sorted(n for n, k in outcomes.items() if k == "skipped")
  sys.stderr.write(f"Acme adder tests + make_reverb_dataset on reverb_shm: {len(passed)} "
                   f"passed, {len(failed)} failed, {len(skipped)} skipped\n")
  assert not failed and not skipped, (failed, skipped, output)
  assert any(n.endswith("::test_make_reverb_dataset_reads_what_its_adder_wrote")
             for n in passed), (passed, output)
  assert len(passed) >= 46, (len(passed), output)   # dm-acme 0.4.0's 45 adder tests + ours
