"""``--init hf:DIR | scgpt:DIR``: a published checkpoint, loaded by its family's reader (`_hf` for
Hugging Face's BertForMaskedLM, `_scgpt_checkpoint` for scGPT's own files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp

from ._errors import TrainError
from ._hf import PublishedCheckpoint, load_bert
from ._scgpt_checkpoint import load_scgpt

SCHEMES = ("hf", "scgpt")


def parse_init(spec: str) -> tuple[str, Path]:
    """``"hf:DIR"`` or ``"scgpt:DIR"`` → (scheme, directory)."""
    scheme, sep, rest = spec.partition(":")
    if not sep or scheme not in SCHEMES or not rest:
        msg = f"--init must be hf:DIR (Geneformer / BertForMaskedLM) or scgpt:DIR; got {spec!r}"
        raise TrainError(msg)
    directory = Path(rest)
    if not directory.is_dir():
        msg = f"--init {spec}: {directory} is not a directory"
        raise TrainError(msg)
    return scheme, directory


def load_checkpoint(
    spec: str,
    *,
    compute_dtype: Any = jnp.float32,
    max_predictions: int | None = None,
    max_len: int | None = None,
) -> PublishedCheckpoint:
    """The model of ``spec`` (``hf:DIR`` or ``scgpt:DIR``); ``max_predictions`` as in
    `GeneformerModel`, ``max_len`` the longest ``L`` of an scGPT model (default: its
    ``max_seq_len`` + 1)."""
    scheme, directory = parse_init(spec)
    if scheme == "scgpt":
        return load_scgpt(directory, compute_dtype=compute_dtype, max_len=max_len)
    return load_bert(directory, compute_dtype=compute_dtype, max_predictions=max_predictions)
