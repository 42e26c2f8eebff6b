#!/usr/bin/env bash
# Create .venv-httpfs: DuckDB 1.5.5 with its httpfs extension from PyPI (duckdb-extension-httpfs, built for
# that DuckDB release only), the peer route of benchmarks/bench_s3_query.py. The project itself reads s3://
# through obstore and needs neither. Idempotent; any cwd.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv-httpfs/bin/python ]; then
  "$PYTHON" -m venv .venv-httpfs
  .venv-httpfs/bin/python -m pip install --quiet --upgrade pip
fi
.venv-httpfs/bin/python -m pip install --quiet --disable-pip-version-check duckdb==1.5.5 duckdb-extension-httpfs==1.5.5 pyarrow
.venv-httpfs/bin/python -c "import duckdb; print('setup-httpfs: duckdb', duckdb.__version__)"
