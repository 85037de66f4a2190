#!/usr/bin/env bash
# Creates (or reuses) the Python reference environment for tests/interop.
# The venv lives outside the clone, keyed by the hash of requirements.txt, so
# CI and developers reuse it across runs. Prints the venv path on stdout.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
req="$here/tests/interop/requirements.txt"
cache="${MINDKIT_CACHE:-$HOME/.cache/mindkit}"
key="$(sha256sum "$req" | cut -c1-12)"
venv="$cache/venv-$key"
if [[ ! -f "$venv/.complete" ]]; then
  echo "setting up interop venv in $venv (first run downloads ~5 GB)" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -r "$req" >&2
  touch "$venv/.complete"
fi
# Extras added later install on top of the cached venv (keyed by their own hash) instead of
# rebuilding it.
extra="$here/tests/interop/requirements-train.txt"
extra_key="$(sha256sum "$extra" | cut -c1-12)"
if [[ ! -f "$venv/.complete-extra-$extra_key" ]]; then
  "$venv/bin/python" -m pip install -q -r "$extra" >&2
  touch "$venv/.complete-extra-$extra_key"
fi
echo "$venv"
