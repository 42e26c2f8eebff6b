#!/usr/bin/env bash
# Rewrite constraints.txt: the newest releases of everything the test, lint and docs extras install,
# resolved in a fresh virtualenv (Python 3.11). CI and scripts/setup.sh install with `-c constraints.txt`,
# so a new release of a dependency reaches CI only when this script is run and its tests pass.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install --quiet --upgrade pip
"$tmp/venv/bin/python" -m pip install --quiet --disable-pip-version-check ".[test,lint,docs]"
{
  echo "# The versions CI installs (scripts/setup.sh installs with -c constraints.txt)."
  echo "# Made by scripts/refresh-constraints.sh with $("$tmp/venv/bin/python" -V) on $(date -u +%F); rerun it to move on."
  "$tmp/venv/bin/python" -m pip freeze --exclude omicsio_jax --exclude pip --exclude setuptools --exclude wheel
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) pins"
