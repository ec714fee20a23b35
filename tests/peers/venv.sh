#!/usr/bin/env bash
# Usage: tests/peers/venv.sh NAME  -> prints the python of peer venv NAME, creating it first if needed.
# A peer venv holds a reference implementation or a real client (dm-reverb, TF-Agents, TorchRL, ...)
# that the tests compare against or run; never a dependency of reverb_shm. Its requirements are
# tests/peers/NAME.txt; the venv lives in $REVERB_SHM_PEERS (default ~/.cache/reverb_shm/peers),
# named after a hash of that file, so it is reused until the requirements change. Packages listed in
# tests/peers/NAME.nodeps.txt, when it exists, are installed after them with --no-deps (a client
# whose declared requirements cannot be installed but whose code under test does not need them);
# that file then enters the hash too.
set -euo pipefail
name="$1"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
req="$here/$name.txt"
[ -f "$req" ] || { echo "no peer requirements file $req" >&2; exit 2; }
root="${REVERB_SHM_PEERS:-$HOME/.cache/reverb_shm/peers}"
nodeps="$here/$name.nodeps.txt"
if [ -f "$nodeps" ]; then
  hash="$(cat "$req" "$nodeps" | sha256sum | cut -c1-12)"
else
  hash="$(sha256sum "$req" | cut -c1-12)"
fi
venv="$root/$name-$hash"
if [ ! -f "$venv/.ready" ]; then
  mkdir -p "$root"
  exec 9>"$root/.$name.lock"; flock 9          # two runs building the same venv take turns
  if [ ! -f "$venv/.ready" ]; then
    echo "building peer venv $name in $venv (once; minutes)" >&2
    rm -rf "$venv"
    "${PEER_PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q -r "$req" >&2
    if [ -f "$nodeps" ]; then
      "$venv/bin/python" -m pip install -q --no-deps -r "$nodeps" >&2
    fi
    touch "$venv/.ready"
  fi
fi
echo "$venv/bin/python"
