"""Further modalities of the synthetic corpus: splice layers, ATAC peaks and a MuData file.

Written by `make_synthetic_corpus(multimodal=True)` beside ``cells.parquet``, one table per
modality keyed by ``cell_id``, by `MultimodalWriter`:

- ``rna_layers_{spliced,unspliced,ambiguous}.parquet``: the RNA counts split per cell and gene
  (`materialize._synthetic_layers`), so the three layers sum exactly to ``cells.parquet``; rows are
  the RNA's, in its order, each listing only its nonzero entries.
- ``peaks.parquet`` (the peak feature table) and ``atac_cells.parquet``: accessible peaks of a
  seeded fraction of the cells (`materialize._synthetic_atac`), by default in a seeded random order
  (not the RNA's), so a reader has to join on ``cell_id``; a cell's peaks and values are a pure
  function of ``(seed, cell index)`` whatever the order or chunking (``ATAC_CHUNK`` cells at a time).
- ``cells.h5mu``: both modalities in MuData's on-disk format, built with the ``mudata`` package
  (imported lazily: a test/demo extra), so it holds every nonzero in memory — for small corpora.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from omicsio_jax.format import progress_bar

from ._synthetic_atac import ATAC_SCHEMA, PEAK_SCHEMA, AtacModel
from ._synthetic_layers import LAYER_SCHEMA, LAYERS, split_layers
from ._synthetic_model import Model, append_csr, cell_ids_at, create_csr

ATAC_CHUNK = 4096  # ATAC cells per generation chunk and at most per row group


def _list_writer(path: Path, schema: pa.Schema) -> pq.ParquetWriter:
    """A parquet writer with the encodings of ``cells.parquet``: delta-coded ids, split-byte values."""
    ids, values = (f.name for f in schema if pa.types.is_list(f.type))
    flat = [f.name for f in schema if not pa.types.is_list(f.type)]
    return pq.ParquetWriter(
        path,
        schema,
        compression="zstd",
        use_dictionary=[f.name for f in schema if f.name == "dataset"],
        write_statistics=flat,
        column_encoding={
            f"{ids}.list.element": "DELTA_BINARY_PACKED",
            f"{values}.list.element": "BYTE_STREAM_SPLIT",
        },
    )


def _lists(offsets: np.ndarray, ids: np.ndarray, values: np.ndarray) -> tuple[pa.ListArray, pa.ListArray]:
    """CSR rows as two list arrays sharing ``offsets``."""
    list_offsets = pa.array(offsets.astype(np.int32))
    return (
        pa.ListArray.from_arrays(list_offsets, pa.array(ids)),
        pa.ListArray.from_arrays(list_offsets, pa.array(values)),
    )


def _stack_csr(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], num_cols: int):
    """One scipy CSR matrix of consecutive CSR row blocks."""
    import scipy.sparse as sp

    indptr, base = [np.zeros(1, np.int64)], 0
    for offsets, _, _ in parts:
        indptr.append(offsets[1:].astype(np.int64) + base)
        base += int(offsets[-1])
    data = np.concatenate([p[2] for p in parts]) if parts else np.empty(0, np.float32)
    indices = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, np.int32)
    indptr = np.concatenate(indptr)
    return sp.csr_matrix((data, indices, indptr), shape=(indptr.size - 1, num_cols))


class MultimodalWriter:
    """Writes the further modalities of a corpus beside its RNA (see the module docstring).

    `rna_chunk` is called for each RNA chunk in order (from the writer thread), `write_atac` once
    after the RNA, then `finish` (the ``.h5mu``) and, always, `close`.
    """

    def __init__(
        self,
        model: Model,
        atac: AtacModel,
        out: Path,
        *,
        write_parquet: bool,
        h5ad: h5py.File | None,
        write_h5mu: bool,
        row_group_size: int,
    ) -> None:
        self.model, self.atac, self.row_group_size = model, atac, row_group_size
        self.peaks_path = out / "peaks.parquet"
        pq.write_table(
            pa.Table.from_pandas(self.atac.peaks, schema=PEAK_SCHEMA, preserve_index=False),
            self.peaks_path,
            compression="zstd",
        )
        self.layer_paths = (
            {name: out / f"rna_layers_{name}.parquet" for name in LAYERS} if write_parquet else None
        )
        self.atac_path = out / "atac_cells.parquet" if write_parquet else None
        self.h5mu_path = out / "cells.h5mu" if write_h5mu else None
        self.writers: dict[str, pq.ParquetWriter] = {}
        self.h5ad = h5ad
        self.parts: dict[str, list] | None = {k: [] for k in ("X", *LAYERS)} if write_h5mu else None
        self.atac_parts: list = []
        self.atac_nnz = 0
        for name, path in (self.layer_paths or {}).items():
            self.writers[name] = _list_writer(path, LAYER_SCHEMA)
        if h5ad is not None:
            group = h5ad.create_group("layers")
            group.attrs.update({"encoding-type": "dict", "encoding-version": "0.1.0"})
            for name in LAYERS:
                create_csr(group, name, (model.num_cells, model.num_genes))

    def rna_chunk(
        self, index: int, start: int, offsets: np.ndarray, genes: np.ndarray, values: np.ndarray
    ) -> None:
        """Split RNA chunk ``index`` (cells from ``start``) into layers and write them."""
        layers = split_layers(self.model.seed, index, offsets, genes, values)
        ids = cell_ids_at(np.arange(start, start + offsets.size - 1)) if self.writers else None
        for name, (lo, lg, lv) in zip(LAYERS, layers, strict=True):
            if name in self.writers:
                gene_lists, value_lists = _lists(lo, lg, lv)
                table = pa.Table.from_arrays([ids, gene_lists, value_lists], schema=LAYER_SCHEMA)
                self.writers[name].write_table(table, row_group_size=self.row_group_size)
            if self.h5ad is not None:
                append_csr(self.h5ad["layers"][name], start, lo, lg, lv)
        if self.parts is not None:
            self.parts["X"].append((offsets, genes, values))
            for name, layer in zip(LAYERS, layers, strict=True):
                self.parts[name].append(layer)

    def _write_atac_chunk(
        self,
        writer: pq.ParquetWriter | None,
        cells: np.ndarray,
        offsets: np.ndarray,
        peaks: np.ndarray,
        values: np.ndarray,
    ) -> None:
        if writer is not None:
            peak_lists, value_lists = _lists(offsets, peaks, values)
            dataset = pa.array(["synthetic"] * cells.size, pa.string())
            table = pa.Table.from_arrays(
                [cell_ids_at(cells), peak_lists, value_lists, dataset], schema=ATAC_SCHEMA
            )
            writer.write_table(table, row_group_size=self.row_group_size)
        if self.parts is not None:
            self.atac_parts.append((offsets, peaks, values))

    def write_atac(self, progress: bool = False) -> None:
        """Generate and write the ATAC cells, ``ATAC_CHUNK`` at a time in the ATAC order."""
        order = self.atac.order
        writer = _list_writer(self.atac_path, ATAC_SCHEMA) if self.atac_path else None
        if writer is not None:
            self.writers["atac"] = writer
        with (
            ThreadPoolExecutor(1) as pool,
            progress_bar(total=order.size, unit="cell", desc="atac", progress=progress) as bar,
        ):
            pending: Future | None = None  # writing chunk i overlaps generating chunk i + 1
            for first in range(0, order.size, ATAC_CHUNK):
                cells = order[first : first + ATAC_CHUNK]
                offsets, peaks, values = self.atac.cells(cells)
                self.atac_nnz += int(offsets[-1])
                if pending is not None:
                    pending.result()
                pending = pool.submit(self._write_atac_chunk, writer, cells, offsets, peaks, values)
                bar.update(cells.size)
            if pending is not None:
                pending.result()

    def finish(self, obs: pd.DataFrame, var: pd.DataFrame) -> None:
        """Write ``cells.h5mu`` (if asked) from the collected chunks; ``obs`` / ``var`` are the RNA's."""
        if self.h5mu_path is None:
            return
        import anndata as ad
        import mudata as md  # imported here: only the .h5mu needs it (a test/demo extra)

        num_genes = self.model.num_genes
        rna = ad.AnnData(
            X=_stack_csr(self.parts["X"], num_genes),
            obs=obs,
            var=var,
            layers={name: _stack_csr(self.parts[name], num_genes) for name in LAYERS},
        )
        self.parts = None
        order = self.atac.order
        atac_obs = pd.DataFrame(
            {"dataset": pd.Categorical.from_codes(np.zeros(order.size, np.int8), categories=["synthetic"])},
            index=pd.Index(cell_ids_at(order).to_pylist(), name="cell_id"),
        )
        peaks = self.atac.peaks.set_index("peak_name").astype({"chrom": "category"})
        atac = ad.AnnData(X=_stack_csr(self.atac_parts, self.atac.num_peaks), obs=atac_obs, var=peaks)
        self.atac_parts = []
        with md.set_options(pull_on_update=False):
            md.MuData({"rna": rna, "atac": atac}).write(self.h5mu_path)

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        self.writers = {}
