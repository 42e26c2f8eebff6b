"""``Modalities``: one output per modality of a multimodal dataset, for the same cells."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omicsio_jax.core.errors import OmicsIOError, UnknownNameError
from omicsio_jax.outputs.base import Empty, Output, OutputContext, RowKeys
from omicsio_jax.outputs.csr import CSR
from omicsio_jax.outputs.dense import Dense
from omicsio_jax.records.runs import records_checked

if TYPE_CHECKING:
    from omicsio_jax.format.codec import Records

_SHORTHANDS = {"dense": Dense, "csr": CSR}


def _output_of(name: str, output: str | Output) -> Output:
    if isinstance(output, Output):
        if isinstance(output, Modalities):
            msg = f"modality {name!r}: an output per modality cannot itself be a dict of modalities"
            raise OmicsIOError(msg)
        return output
    if output in _SHORTHANDS:
        return _SHORTHANDS[output]()
    msg = (
        f"modality {name!r}: output must be 'dense', 'csr' or an oj.Output such as oj.Panel(genes, "
        f"normalize='log1p') or oj.CSR(nnz_capacity=...); got {output!r}"
    )
    raise OmicsIOError(msg)


@dataclasses.dataclass(frozen=True)
class Modalities(Output):
    """``x``: a dict ``{modality: that modality's x}``, every one for the same cells (the batch's
    ``index``), each made by its own output kind over its own features.

    >>> loader = oj.make_loader(ds, batch_size=256, output={                       # doctest: +SKIP
    ...     "rna": oj.Panel(hvg, normalize="normalize_log1p"), "spliced": "csr", "atac": "csr"})
    >>> batch = next(iter(loader))                                                  # doctest: +SKIP
    >>> batch.x["rna"].shape, loader.densify(batch.x["atac"], modality="atac").shape   # doctest: +SKIP
    ((256, 2000), (256, 200000))

    A dict given as a loader's ``output`` becomes this; ``"dense"`` / ``"csr"`` stand for
    ``oj.Dense()`` / ``oj.CSR()``. A loader reads the records of the modalities named here and of
    no other. Token outputs (`GeneformerTokens`, `ScGPTTokens`) need a gene-space modality: the
    primary or a layer sharing its genes.
    """

    outputs: Any = ()  # ((name, Output), ...): given as a mapping
    datasets: Any = dataclasses.field(default=None, compare=False, repr=False)  # set by bind

    kind = "modalities"

    def __post_init__(self) -> None:
        items = self.outputs.items() if isinstance(self.outputs, Mapping) else self.outputs
        outputs = tuple((str(name), _output_of(str(name), out)) for name, out in items)
        if not outputs:
            msg = "output={...} needs at least one modality, e.g. {'rna': 'dense', 'atac': 'csr'}"
            raise OmicsIOError(msg)
        names = [name for name, _ in outputs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # a batch's x holds one array per modality: the second would replace the first
            msg = f"oj.Modalities names modality {', '.join(map(repr, twice))} twice: give each modality one output"
            raise OmicsIOError(msg)
        object.__setattr__(self, "outputs", outputs)

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.outputs)

    def __getitem__(self, name: str) -> Output:
        """The (bound) output of modality ``name``."""
        for key, output in self.outputs:
            if key == name:
                return output
        msg = f"this output has no modality {name!r}; it has {', '.join(self.modalities)}"
        raise UnknownNameError(msg)

    def bind(self, ctx: OutputContext) -> Modalities:
        if ctx.dataset is None:
            msg = "an output per modality needs a materialized multimodal dataset (make_loader / GrainSource)"
            raise OmicsIOError(msg)
        datasets, bound = {}, []
        for name, output in self.outputs:
            if name not in ctx.dataset.modalities:
                msg = f"{ctx.source} has no modality {name!r}; it has {', '.join(ctx.dataset.modalities)}"
                raise UnknownNameError(msg)
            sub = datasets[name] = ctx.dataset.modality(name)
            if (
                output.needs_genes
                and name != ctx.dataset.modalities[0]
                and ctx.dataset.manifest.modality_entry(name).features != "primary"
            ):
                msg = (
                    f"{output.kind} tokens need a gene-space modality (the primary or a layer of its genes); "
                    f"{name!r} has features of its own"
                )
                raise OmicsIOError(msg)
            bound.append(
                (name, output.bind(OutputContext.of_dataset(sub, rows=ctx.rows, num_slabs=ctx.num_slabs)))
            )
        return dataclasses.replace(self, outputs=tuple(bound), datasets=datasets)

    def config(self) -> dict:
        return {"output": self.kind, "modalities": {name: output.config() for name, output in self.outputs}}

    def from_records(
        self, records: Mapping[str, Records], empty: Empty, keys: RowKeys | None = None
    ) -> dict[str, Any]:
        """``records``: each modality's records of the same rows."""
        out = {}
        for name, output in self.outputs:
            if keys is None:
                out[name] = output.from_records(records[name], empty, keys)
                continue
            with records_checked(
                self.datasets[name], keys.rows
            ):  # a damaged record names its modality's shard
                out[name] = output.from_records(records[name], empty, keys)
        return out

    def warm_up(self) -> None:
        for _, output in self.outputs:
            output.warm_up()

    def densify(self, x, modality: str):
        """Dense rows of modality ``modality``'s placed `SparseBatch` (a `CSR` output), on the devices."""
        output = self[modality]
        if not isinstance(output, CSR):
            msg = f"densify needs modality {modality!r} to have output 'csr'; it has {output.kind!r}"
            raise OmicsIOError(msg)
        return output.densify(x)
