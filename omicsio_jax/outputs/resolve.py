"""A loader's ``output=`` argument as an `Output`: an output kind, a shorthand, or one per modality."""

from __future__ import annotations

from collections.abc import Mapping

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.outputs.base import Output
from omicsio_jax.outputs.csr import CSR
from omicsio_jax.outputs.dense import Dense
from omicsio_jax.outputs.modalities import Modalities

SHORTHANDS = ("dense", "csr")  # the kinds ``output=`` takes by name, at their defaults


def resolve_output(output: str | Output | Mapping[str, str | Output]) -> Output:
    """The `Output` of ``output``: an output kind (``oj.Dense(normalize=...)``, ``oj.Panel(genes, ...)``,
    ``oj.CSR(nnz_capacity=...)``, ``oj.GeneformerTokens()``, ...), the shorthands ``"dense"``
    (``oj.Dense()``) and ``"csr"`` (``oj.CSR()``), or a dict ``{modality: output}`` (`Modalities`)."""
    if isinstance(output, Mapping):
        return Modalities(output)
    if isinstance(output, Output):
        return output
    if output == "dense":
        return Dense()
    if output == "csr":
        return CSR()
    msg = (
        f"output must be one of 'dense', 'csr' or an output kind such as oj.Dense(normalize='log1p'), "
        f"oj.Panel(genes), oj.CSR() or oj.GeneformerTokens(); got {output!r}"
    )
    raise OmicsIOError(msg)
