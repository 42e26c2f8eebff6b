#!/usr/bin/env bash
# Create .venv-reference (Python 3.11) with the reference implementations the Equinox pretraining
# models are tested against (tests/test_reference_models.py): Hugging Face transformers
# (BertForMaskedLM = Geneformer) on a pinned CPU torch, and safetensors. torch is installed first,
# pinned, so pip never picks one itself (any other build pulls GBs of CUDA wheels); the check below
# fails if a CUDA wheel came in anyway. scgpt (the published package) is installed without its
# dependencies: with them pip resolves (scanpy, scvi-tools, flax, ...) but `import scgpt` fails, as
# its __init__ imports torchtext, whose last release (0.18.0, built for torch 2.3) cannot load
# libtorchtext.so with this torch (undefined symbol), and no torch 2.3 CPU wheel is on PyPI. Its
# model module (scgpt/model/model.py: TransformerModel) needs only torch, numpy and tqdm, and
# tests/reference_models.py imports it without the package's __init__. Nothing here enters .venv.
# Idempotent; any cwd.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0
TRANSFORMERS_VERSION=5.24.0
SAFETENSORS_VERSION=0.8.0
SCGPT_VERSION=0.2.4
VENV=.venv-reference
PY="${PYTHON:-python3.11}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
fi
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==${TORCH_VERSION}"
"${pip[@]}" "torch==${TORCH_VERSION}" "transformers==${TRANSFORMERS_VERSION}" \
  "safetensors==${SAFETENSORS_VERSION}" numpy tqdm
"${pip[@]}" --no-deps "scgpt==${SCGPT_VERSION}"
# Fail loudly if a pin did not hold or anything pulled a GPU stack in.
"$VENV/bin/python" - "$TORCH_VERSION" "$TRANSFORMERS_VERSION" <<'PY'
import sys
from importlib.metadata import distributions, version

torch_version, transformers_version = sys.argv[1:]
if version("torch").split("+")[0] != torch_version or version("transformers") != transformers_version:
    sys.exit(f"setup-reference: torch {version('torch')}, transformers {version('transformers')} installed; "
             f"expected {torch_version}, {transformers_version}")
cuda = sorted(n for d in distributions() if (n := d.metadata["Name"]).lower().startswith(("nvidia", "triton")))
if cuda:
    sys.exit(f"setup-reference: unexpected CUDA wheels installed: {', '.join(cuda)}")
import torch
from transformers import BertForMaskedLM  # noqa: F401  (fails here, not in a test)

sys.path.insert(0, "tests")
from reference_models import scgpt_model_module

scgpt_model_module()

print(f"setup-reference: python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"transformers {transformers_version}, safetensors {version('safetensors')}, scgpt {version('scgpt')}")
PY
