#!/usr/bin/env bash
# Create .venv-ducklake: DuckDB 1.4.4 with its ducklake and sqlite extensions from PyPI
# (duckdb-ext-ducklake / duckdb-ext-sqlite, built for that DuckDB release only), used by
# tests/test_ducklake.py and benchmarks/bench_ducklake.py to write DuckLake catalogs (a DuckDB file or a
# SQLite file) and to record what the extension itself reads from them. The project reads DuckLake
# catalogs natively (materialize/_ducklake.py) and needs neither. Idempotent; any cwd.
set -euo pipefail
cd "$(dirname "$0")/.."
DUCKDB_VERSION=1.4.4
EXT_VERSION=1.4.4.20260205
VENV=.venv-ducklake
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "duckdb==${DUCKDB_VERSION}" \
  "duckdb-ext-ducklake==${EXT_VERSION}" "duckdb-ext-sqlite==${EXT_VERSION}" numpy
# Fail here, not in a test, if an extension file is missing or does not load.
"$VENV/bin/python" - <<'PY'
import pathlib
import site

import duckdb

found = {}
for root in site.getsitepackages():
    for path in pathlib.Path(root).rglob("*.duckdb_extension"):
        found[path.name.split(".")[0]] = path
missing = sorted({"ducklake", "sqlite_scanner"} - set(found))
if missing:
    raise SystemExit(f"setup-ducklake: no {', '.join(missing)}.duckdb_extension in site-packages ({sorted(found)})")
con = duckdb.connect(config={"allow_unsigned_extensions": "true"})
for name in ("ducklake", "sqlite_scanner"):
    con.execute(f"LOAD '{found[name]}'")
print(f"setup-ducklake: duckdb {duckdb.__version__}, extensions {', '.join(str(found[n]) for n in ('ducklake', 'sqlite_scanner'))}")
PY
