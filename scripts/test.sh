#!/usr/bin/env bash
# Set up .venv with the test, lint and docs extras, then run every check CI runs: ruff (lint and
# format), the import layers (import-linter), the documentation site (strict: a broken link or
# reference fails), the generated benchmark pages (up to date with benchmarks/results/), and the
# test suite (extra pytest arguments pass through; .venv-ducklake is set up first for its DuckLake tests).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,lint,docs
scripts/setup-reference.sh  # torch references for tests/test_reference_models.py, in .venv-reference
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
.venv/bin/python benchmarks/report.py --check
scripts/setup-ducklake.sh  # the DuckDB + ducklake extension tests/test_ducklake.py writes its lakes with
exec .venv/bin/python -m pytest "$@"
