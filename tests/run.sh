#!/usr/bin/env bash
# The whole test suite, as the README's second command and .ci/run run it: creates or reuses
# .venv (reverb_shm with its test extras), the peer venvs that the compatibility tests run
# (tests/peers/), then pytest. Arguments go to pytest (e.g. tests/run.sh -m slow). The docs and
# lint extras make tests/test_docs.py build the site and tests/test_lint.py run ruff and mypy.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# tf-cpu: the TensorFlow datasets' tests (reverb_shm/tf) run here, with current TensorFlow.
.venv/bin/python -m pip install -q -e '.[test,tf-cpu,docs,lint]'
# Peer venvs: reference implementations and real clients, each in its own venv.
REVERB_REF_PYTHON="$(tests/peers/venv.sh reverb)"
export REVERB_REF_PYTHON
TFAGENTS_PYTHON="$(tests/peers/venv.sh tfagents)"   # TF-Agents 0.19's Reverb tests
export TFAGENTS_PYTHON
ACME_PYTHON="$(tests/peers/venv.sh acme)"           # Acme 0.4's adder tests, make_reverb_dataset
export ACME_PYTHON
exec .venv/bin/python -m pytest -q "$@"
