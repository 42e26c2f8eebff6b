#!/usr/bin/env bash
# Set up .venv with the test, lint and docs extras, compile numba's kernels into their caches (in the
# background, beside the checks), then run every check CI runs: ruff (lint and
# format), the import layers (import-linter), the documentation site (strict: a broken link or
# reference fails), the generated benchmark pages (up to date with benchmarks/results/), and the
# test suite on two workers (extra pytest arguments pass through; .venv-ducklake is set up first for its
# DuckLake tests).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,lint,docs
# numba's kernels compiled once into their caches while the checks below run; without it the two
# workers and the processes they start each compile the same kernels at once (scripts/warm_kernels.py)
.venv/bin/python scripts/warm_kernels.py &
warm=$!
scripts/setup-reference.sh  # torch references for tests/test_reference_models.py, in .venv-reference
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
.venv/bin/python benchmarks/report.py --check
scripts/setup-ducklake.sh  # the DuckDB + ducklake extension tests/test_ducklake.py writes its lakes with
# byte-compiled once here: where PYTHONDONTWRITEBYTECODE is set, every process the tests start would
# otherwise compile the project's modules from source again (pip does this for an installed wheel)
.venv/bin/python -m compileall -q omicsio_jax materialize train benchmarks >/dev/null
wait "$warm"
# glibc set to keep freed memory for reuse rather than give it back and fault it in again: XLA on CPU
# frees and allocates its buffers at every training step, and under the defaults the kernel spends a
# good share of the suite clearing pages
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-4294967296}" MALLOC_TOP_PAD_="${MALLOC_TOP_PAD_:-268435456}"
# two pytest workers (pytest-xdist), each test module on one of them (its module fixtures made once):
# many tests wait on processes they start, so two keep both cores busy (pass -n 0 for one process)
exec .venv/bin/python -m pytest -n 2 --dist loadfile --durations=15 "$@"
