#!/usr/bin/env bash
# Set up .venv with the test, lint and docs extras, then run every check CI runs: ruff (lint and
# format), the import layers (import-linter), the documentation site (strict) and the test suite
# (extra pytest arguments pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,lint,docs
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "$@"
