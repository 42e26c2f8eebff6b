#!/usr/bin/env bash
# Create .venv-annbatch (Python 3.12: every annbatch release requires >= 3.12, this project runs on
# 3.11) with annbatch (PyPI annbatch, scverse's loader; the benchmark peer of
# benchmarks/_annbatch_peer.py). Its dependencies (zarr 3, anndata >= 0.12.9, dask, xarray, ...)
# stay out of .venv. The `zarrs` extra (zarrs-python, a Rust codec pipeline) is what annbatch's
# installation page calls "strongly recommended" for local filesystems, and what its docs set
# before reading or writing a collection. No torch: annbatch imports torch, cupy and jax only when
# they are installed, and with `Loader(to=None, preload_to_gpu=False)` it yields scipy CSR / numpy
# batches; the import check below fails if anything brought torch, cupy or CUDA wheels in. No numba
# either: annbatch needs it only for in-memory sparse data, not for an on-disk collection. psutil
# for memory probes. Python: $PYTHON if set, else pyenv's 3.12.1, else python3.12 on the PATH.
# Idempotent; any cwd.
set -euo pipefail
cd "$(dirname "$0")/.."
ANNBATCH_VERSION=0.3.1
VENV=.venv-annbatch

is_py312() {  # true if "$1" runs and is a CPython >= 3.12
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY=""
  if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
  elif command -v pyenv >/dev/null 2>&1 && PY_PYENV="$(PYENV_VERSION=3.12.1 pyenv which python 2>/dev/null)"; then
    PY="$PY_PYENV"
  elif command -v python3.12 >/dev/null 2>&1; then
    PY=python3.12
  fi
  if [ -z "$PY" ] || ! is_py312 "$PY"; then
    echo "setup-annbatch: annbatch needs Python >= 3.12 and none was found" \
         "(tried \$PYTHON, 'PYENV_VERSION=3.12.1 pyenv which python', python3.12);" \
         "install one (e.g. 'pyenv install 3.12.1') or set PYTHON=/path/to/python3.12" >&2
    exit 1
  fi
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
fi
if ! is_py312 "$VENV/bin/python"; then
  echo "setup-annbatch: $VENV exists but its Python is older than 3.12; remove it and run again" >&2
  exit 1
fi
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "annbatch[zarrs]==${ANNBATCH_VERSION}" psutil
# Fail loudly if the pin did not hold or anything pulled a GPU stack in.
"$VENV/bin/python" - "$ANNBATCH_VERSION" <<'PY'
import sys
from importlib.metadata import distributions, version

got = version("annbatch")
if got != sys.argv[1]:
    sys.exit(f"setup-annbatch: annbatch {got} installed, expected {sys.argv[1]}")
gpu = sorted(n for d in distributions() if (n := d.metadata["Name"]).lower().startswith(("nvidia", "cupy", "torch", "jax")))
if gpu:
    sys.exit(f"setup-annbatch: unexpected GPU/framework wheels installed: {', '.join(gpu)}")
import zarr
import zarrs  # noqa: F401  (the codec pipeline the peer sets)
from annbatch import DatasetCollection, Loader  # noqa: F401  (fails here, not in a benchmark)

zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"})
print(f"setup-annbatch: python {sys.version.split()[0]}, annbatch {got}, zarr {version('zarr')}, "
      f"zarrs {version('zarrs')}, anndata {version('anndata')}, dask {version('dask')}, "
      f"scipy {version('scipy')}, numpy {version('numpy')}, psutil {version('psutil')}")
PY
