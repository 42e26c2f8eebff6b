#!/usr/bin/env bash
# Install the benchmark extras (peer loaders: scDataset; plotting: matplotlib) into .venv.
# torch is installed first, pinned, so pip never picks one itself (any other build pulls GBs of
# CUDA wheels); the extra then finds it satisfied and leaves it alone. Idempotent; any cwd.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0
[ -x .venv/bin/python ] || scripts/setup.sh
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==${TORCH_VERSION}"
"${pip[@]}" -e '.[test,bench]'
# Fail loudly if anything above replaced the pinned torch.
.venv/bin/python - "$TORCH_VERSION" <<'PY'
import sys
from importlib.metadata import version

got = version("torch")
if got.split("+")[0] != sys.argv[1]:
    sys.exit(f"setup-bench: torch {got} installed, expected {sys.argv[1]}")
print(f"setup-bench: torch {got}, scdataset {version('scdataset')}, matplotlib {version('matplotlib')}")
PY
