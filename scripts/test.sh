#!/usr/bin/env bash
# Set up .venv with the test extras and run the test suite (extra pytest arguments pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
exec .venv/bin/python -m pytest "$@"
