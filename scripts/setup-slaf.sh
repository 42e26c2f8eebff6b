#!/usr/bin/env bash
# Create .venv-slaf (Python 3.11) with SLAF (PyPI slafdb, the benchmark peer of
# benchmarks/_slaf_peer.py): its dependencies (lance, polars, scanpy, modal, boto3, ...) stay out
# of .venv. torch is installed first, pinned to the CPU build setup-bench.sh uses, so pip never
# picks one itself (any other build pulls GBs of CUDA wheels). psutil is not in slafdb's [ml]
# extra, but SLAFDataLoader's producer thread imports it and, without it, ends every epoch
# silently with no batch. Idempotent; any cwd.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0
SLAF_VERSION=0.5.2
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv-slaf/bin/python ]; then
  "$PYTHON" -m venv .venv-slaf
  .venv-slaf/bin/python -m pip install --quiet --upgrade pip
fi
pip=(.venv-slaf/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==${TORCH_VERSION}"
"${pip[@]}" "slafdb[ml]==${SLAF_VERSION}" psutil
# Fail loudly if anything above replaced the pinned torch or brought CUDA in.
.venv-slaf/bin/python - "$TORCH_VERSION" <<'PY'
import sys
from importlib.metadata import distributions, version

got = version("torch")
if got.split("+")[0] != sys.argv[1]:
    sys.exit(f"setup-slaf: torch {got} installed, expected {sys.argv[1]}")
cuda = sorted(d.metadata["Name"] for d in distributions() if d.metadata["Name"].lower().startswith("nvidia"))
if cuda:
    sys.exit(f"setup-slaf: CUDA wheels installed, expected a CPU-only torch: {', '.join(cuda)}")
from slaf.ml.dataloaders import SLAFDataLoader  # noqa: F401  (fails here, not in a benchmark)

print(f"setup-slaf: torch {got}, slafdb {version('slafdb')}, pylance {version('pylance')}, "
      f"polars {version('polars')}, anndata {version('anndata')}")
PY
