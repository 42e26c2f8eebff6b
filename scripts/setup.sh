#!/usr/bin/env bash
# Create .venv (Python 3.11+) and install omicsio_jax with the given extras, e.g. `scripts/setup.sh test`,
# at the versions pinned in constraints.txt (scripts/refresh-constraints.sh moves them on).
# Idempotent: re-running only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
extras="${1:-}"
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e "$spec"
