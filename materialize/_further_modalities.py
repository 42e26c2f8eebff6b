"""A run's further modalities (layers, an ``.h5mu``'s other modalities, tables of the same cells):
each opened in the primary's row order and written as a dataset under ``modalities/<name>``; and the
codec description every dataset of a run, the primary's and theirs, carries in its manifest.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from omicsio_jax.format import CODEC_VERSION, ModalityEntry, open_store

from ._finalize import Finalizer
from ._modalities import H5Modality, ModalityInput, TableModality, h5mu_alignment
from ._panel import Panel
from ._partition import PART_CELLS, PARTS_DIR, Job, part_dir
from ._source import Source


def open_modality(
    inp: ModalityInput,
    src: Source,
    job: Job,
    partitions,
    *,
    primary: str,
    require_all: bool,
    check_primary: bool,
    subset: bool,
    scratch: str,
) -> Source:
    """The further modality ``inp`` as a source in the primary's row order (the primary written);
    ``scratch``: a local folder for a table that must be put in that order."""
    if inp.table is None:  # a layer or a modality of the primary's own .h5ad / .h5mu
        from ._h5ad import H5adSource

        if inp.layer:
            reader = H5adSource(src.path, layer=inp.name, group=src.group)
            return H5Modality(inp.name, reader, src, None, layer=True)
        reader = H5adSource(src.path, group=f"mod/{inp.name}")
        rows = h5mu_alignment(
            src.path, primary, inp.name, require_all=require_all, check_primary=check_primary
        )
        return H5Modality(inp.name, reader, src, rows, layer=False)
    store = open_store(job.staging)
    cells = [f"{job.staging}/{part_dir(p.index)}/{PART_CELLS}" for p in partitions]
    spill = Path(scratch) / f"align-{inp.name}"
    further = TableModality(
        inp,
        primary=primary,
        primary_label=src.label,
        primary_cells=cells,
        primary_genes=src.genes,
        num_cells=src.num_cells,
        shard_cells=job.shard_cells,
        spill=spill,
        require_all=require_all,
        check_primary=check_primary,
        subset=subset,
    )
    if store.local_root is None:  # workers elsewhere read the spilled partitions from the output's store
        further.publish(f"{job.staging}/{PARTS_DIR}/align-{inp.name}")
    return further


def write_modality(
    inp: ModalityInput, further: Source, job: Job, run, array_record: dict, created_by: str, cell_id: str
) -> ModalityEntry:
    """Write a further modality as the dataset ``modalities/<name>`` beside the primary's; its entry."""
    from ._validate import GeneIndex

    if inp.layer:
        index = job.gene_index
    else:
        tokens = further.genes.column("gene_token_id").to_numpy()
        index = GeneIndex.from_tokens(
            tokens, f"the features of modality {inp.name}: {len(tokens):,}", further.list_names
        )
    path = f"modalities/{inp.name}"
    staging = f"{job.staging}/{path}"
    mjob = dataclasses.replace(
        job, source=further, obs=(), gene_index=index, panel=None, staging=staging, presence=True
    )
    parts = further.plan(job.shard_cells)
    with Finalizer(mjob, open_store(staging), parts) as finalizer:
        run(mjob, parts, f"materialize {inp.name}", finalizer.add)
        manifest = finalizer.finish(
            features=further.features_table,
            codec=codec_description(None),
            array_record=array_record,
            source={**further.description, "cell_id": cell_id},
            created_by=created_by,
            modality=inp.name,
        )
    sha = hashlib.sha256(manifest.to_json().encode()).hexdigest()
    return ModalityEntry(
        inp.name,
        path,
        manifest.num_genes,
        manifest.layout,
        manifest.nnz,
        inp.features_kind,
        manifest.fingerprint,
        sha,
    )


def codec_description(panel: Panel | None) -> dict:
    return {
        "name": "omicsio-cell",
        "version": CODEC_VERSION,
        "records": "one per cell",
        "indices": "dense row"
        if panel is not None
        else "per record: u16 gaps if every gap ≤ 65535, else u32",
        "values": "per record: narrowest lossless of u8/u16/u32 (integer counts) or f32",
        "dense_width": None if panel is None else panel.features.num_rows,
    }
