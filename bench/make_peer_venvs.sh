#!/usr/bin/env bash
# Creates the peer venvs bench/run_all.py compares against (never a dependency of reverb_shm):
#   $1 (default /tmp/refvenv): dm-reverb 0.14 + tensorflow 2.15 + cpprb 11, Python 3.11.
# Usage: bench/make_peer_venvs.sh [VENV_DIR]; then python bench/run_all.py --reverb-python
# VENV_DIR/bin/python --cpprb-python VENV_DIR/bin/python (the defaults for /tmp/refvenv).
set -euo pipefail
venv="${1:-/tmp/refvenv}"
python="${PYTHON:-python3.11}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --upgrade pip
"$venv/bin/python" -m pip install "dm-reverb==0.14.*" "tensorflow==2.15.*" "cpprb==11.*" numpy
"$venv/bin/python" -c "import reverb, cpprb; print('peer venv ready:', '$venv')"
