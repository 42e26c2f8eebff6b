"""Output kinds (one module each) behind the interface in `base`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.outputs.base import Output, OutputContext, RowKeys
from omicsio_jax.outputs.csr import CSR
from omicsio_jax.outputs.dense import Dense
from omicsio_jax.outputs.geneformer import GeneformerTokens
from omicsio_jax.outputs.modalities import Modalities
from omicsio_jax.outputs.panel import Panel
from omicsio_jax.outputs.scgpt import ScGPTTokens

__all__ = [
    "CSR",
    "Dense",
    "GeneformerTokens",
    "Modalities",
    "Output",
    "OutputContext",
    "Panel",
    "RowKeys",
    "ScGPTTokens",
    "resolve_output",
]


def resolve_output(
    output: str | Output | Mapping[str, str | Output],
    *,
    genes: Sequence[str | int] | None = None,
    normalize: str | None = None,
    target_sum: float = 1e4,
    nnz_capacity: int | None = None,
) -> Output:
    """The `Output` of a loader's ``output=`` argument: an `Output`, the shorthands ``"dense"``
    (`Dense`, or `Panel` with ``genes``) and ``"csr"`` (`CSR`) configured by the other arguments, or
    a dict ``{modality: output}`` (`Modalities`; each modality's knobs go in its own output)."""
    if isinstance(output, Mapping):
        given = {
            k: v
            for k, v in {"genes": genes, "normalize": normalize, "nnz_capacity": nnz_capacity}.items()
            if v is not None
        }
        if given:
            msg = (
                f"with an output per modality, pass {', '.join(given)} to each modality's output, e.g. "
                "output={'rna': oj.Panel(genes, normalize='log1p'), 'atac': oj.CSR(nnz_capacity=...)}"
            )
            raise OmicsIOError(msg)
        return Modalities(output)
    if isinstance(output, Output):
        given = {
            k: v
            for k, v in {"genes": genes, "normalize": normalize, "nnz_capacity": nnz_capacity}.items()
            if v is not None
        }
        if given:
            msg = f"pass {', '.join(given)} to the output itself, e.g. {type(output).__name__}(..., {next(iter(given))}=...)"
            raise OmicsIOError(msg)
        return output
    if output == "dense":
        if genes is not None:
            return Panel(genes, normalize=normalize, target_sum=target_sum)
        return Dense(normalize=normalize, target_sum=target_sum)
    if output == "csr":
        if genes is not None:
            msg = "output='csr' carries every gene of the dataset; for a gene panel use output='dense' with genes=..."
            raise OmicsIOError(msg)
        return CSR(nnz_capacity=nnz_capacity, normalize=normalize, target_sum=target_sum)
    msg = (
        f"output must be one of 'dense', 'csr' or an oj.Output such as oj.Panel(genes) or "
        f"oj.GeneformerTokens(); got {output!r}"
    )
    raise OmicsIOError(msg)
