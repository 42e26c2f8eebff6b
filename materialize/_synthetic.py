"""Synthetic single-cell corpus shaped like Tahoe-100M.

Cells are generated in chunks of ``CHUNK_CELLS`` from
``np.random.default_rng([seed, chunk_index])`` and streamed to ``cells.parquet``
and ``cells.h5ad``; only O(cells) label codes stay in memory. Gene ids follow a
Zipf-like popularity law and are drawn by a numba kernel that only consumes
numpy random numbers, so the output is a pure function of the arguments.
With ``multimodal=True`` the corpus also gets splice layers of the RNA and an ATAC
modality (see `materialize._synthetic_multimodal`).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from omicsio_jax.format import progress_bar

from ._synthetic_model import (
    CHUNK_CELLS,
    MARKER_FRACTION,
    PROGRAM_FRACTION,
    Model,
    append_csr,
    cell_ids,
    create_csr,
)

_NESTED = ["gene_token_id.list.element", "gene_expression.list.element"]
_SCHEMA = pa.schema(
    [
        ("cell_id", pa.string()),
        ("gene_token_id", pa.list_(pa.int32())),
        ("gene_expression", pa.list_(pa.float32())),
        ("cell_type", pa.string()),
        ("drug", pa.string()),
        ("batch", pa.string()),
        ("dataset", pa.string()),
        ("tissue", pa.string()),
        ("organism", pa.string()),
        ("n_genes", pa.int32()),
        ("total_counts", pa.float32()),
    ]
)


@dataclass(frozen=True)
class SyntheticCorpus:
    """Paths and sizes of a generated corpus."""

    cells_parquet: Path | None
    genes_parquet: Path
    h5ad: Path | None
    num_cells: int
    num_genes: int
    nnz: int
    layers: dict[str, Path] | None = field(default=None, hash=False)  # splice layer name -> parquet
    atac_parquet: Path | None = None
    peaks_parquet: Path | None = None
    h5mu: Path | None = None
    num_peaks: int = 0
    atac_nnz: int = 0


def _write_chunk(
    writer: pq.ParquetWriter | None,
    h5: h5py.File | None,
    model: Model,
    start: int,
    offsets: np.ndarray,
    genes: np.ndarray,
    values: np.ndarray,
    totals: np.ndarray,
    row_group_size: int,
) -> None:
    """Append one chunk of cells (CSR rows from ``start``) to the parquet writer and/or h5ad ``X``."""
    n = offsets.size - 1
    if writer is not None:
        list_offsets = pa.array(offsets.astype(np.int32))
        columns = {
            "cell_id": cell_ids(start, n),
            "gene_token_id": pa.ListArray.from_arrays(list_offsets, pa.array(genes)),
            "gene_expression": pa.ListArray.from_arrays(list_offsets, pa.array(values)),
        }
        for key, (names, codes) in model.obs_codes(slice(start, start + n)).items():
            columns[key] = pa.array(names, pa.string()).take(pa.array(codes.astype(np.int32)))
        columns["n_genes"] = pa.array(np.diff(offsets).astype(np.int32))
        columns["total_counts"] = pa.array(totals)
        writer.write_table(pa.Table.from_pydict(columns, schema=_SCHEMA), row_group_size=row_group_size)
    if h5 is not None:
        append_csr(h5["X"], start, offsets, genes, values)


def _open_h5ad(path: Path, num_cells: int, num_genes: int) -> h5py.File:
    """Create an h5ad file with anndata's root attributes and an empty, growable CSR ``X``."""
    f = h5py.File(path, "w")
    f.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
    create_csr(f, "X", (num_cells, num_genes))
    return f


def _obs_frame(model: Model, n_genes: np.ndarray, totals: np.ndarray) -> pd.DataFrame:
    """The cells' obs (categorical labels, ``n_genes``, ``total_counts``), indexed by cell id."""
    obs = pd.DataFrame(
        {
            key: pd.Categorical.from_codes(codes, categories=names)
            for key, (names, codes) in model.obs_codes(slice(None)).items()
        },
        index=pd.Index([f"c{i:09d}" for i in range(model.num_cells)], name="cell_id"),
    )
    obs["n_genes"], obs["total_counts"] = n_genes, totals
    return obs


def _var_frame(model: Model) -> pd.DataFrame:
    """The genes' var, indexed by Ensembl id."""
    return model.genes.set_index("ensembl_id").astype({"chromosome": "category", "gene_type": "category"})


def _finish_h5ad(f: h5py.File, model: Model, n_genes: np.ndarray, totals: np.ndarray) -> None:
    """Write ``obs``, ``var`` and the empty elements anndata expects (``layers`` unless written)."""
    try:  # imported here: anndata takes ~1 s to import and only the h5ad needs it
        from anndata.io import write_elem
    except ImportError:  # pragma: no cover - older anndata
        from anndata.experimental import write_elem

    write_elem(f, "obs", _obs_frame(model, n_genes, totals))
    write_elem(f, "var", _var_frame(model))
    for key in ("obsm", "varm", "obsp", "varp", "layers", "uns"):
        if key not in f:
            write_elem(f, key, {})


def make_synthetic_corpus(
    out_dir: str | Path,
    *,
    num_cells: int,
    num_genes: int = 62_710,
    seed: int = 0,
    num_plates: int | None = None,
    mean_nnz: float = 1500.0,
    marker_fraction: tuple[float, float, float] = MARKER_FRACTION,
    program_fraction: float = PROGRAM_FRACTION,
    write_parquet: bool = True,
    write_h5ad: bool = True,
    row_group_size: int = 8192,
    progress: bool = False,
    multimodal: bool = False,
    num_peaks: int = 200_000,
    atac_mean_nnz: float = 3000.0,
    atac_fraction: float = 0.9,
    atac_shuffle: bool = True,
    write_h5mu: bool = False,
) -> SyntheticCorpus:
    """Write a synthetic Tahoe-like corpus to ``out_dir``.

    A detected gene's count is ``1 + Poisson(mean - 1)``; its mean falls with the gene's rank in
    the cell type's program, rises on marker genes and scales with the cell's size factor
    (log-normal, σ = 0.4). Capture given expression is Poisson, as in droplet data; cells of one
    type differ by their size factors and the genes they detect. (Earlier versions drew geometric
    counts, whose spread equals their mean: a cell's scGPT bins then told little of its type.)

    Parameters
    ----------
    out_dir
        Output folder, created if missing.
    num_cells, num_genes
        Corpus shape (``num_cells < 10**9``).
    seed
        Seed of every random stream; equal arguments give identical files.
    num_plates
        Number of contiguous plates, default ``max(2, min(14, num_cells // 2000))``.
        The last plate holds every drug and cell type.
    mean_nnz
        Mean number of expressed genes per cell (log-normal, clipped to
        ``[50, num_genes // 4]``).
    marker_fraction
        Share of a cell's gene draws taken from its drug's, its cell type's and its plate's
        marker sets (50, 50 and 25 genes, with 4×, 4× and 2× the mean count). The default,
        ``(0.03, 0.03, 0.015)``, hides cell identity in ~5 of ~150 genes; cell lines in real
        data differ in hundreds of genes — ``(0.03, 0.2, 0.015)`` is closer to that.
    program_fraction
        Each cell type's expression program: the share of the ~``mean_nnz`` most expressed
        genes (by popularity rank) that the type moves to the tail, taking as many tail genes
        up into their ranks (with the counts that go with the rank), and scales the mean
        count of the same share of all genes by a log-normal fold change (σ = 1 in log
        space). The default, 0.5, makes cell types differ in half of their highly expressed
        genes and in the levels of half of the rest, so that, as in real cells after
        Geneformer's median scaling, the top of a cell's rank order and its scGPT bins are
        specific to its type rather than a few marker genes among shared ones; 0 gives every
        type one program (as earlier versions did: a token order with no cell-type signal
        a short pretraining could learn).
    write_parquet, write_h5ad
        Whether to write ``cells.parquet`` / ``cells.h5ad``; ``gene_metadata.parquet``
        is always written. With ``multimodal``, ``write_parquet`` also covers the layer and
        ATAC tables and ``write_h5ad`` the layers of ``cells.h5ad``.
    row_group_size
        Parquet row-group size in cells (ATAC: at most 4,096, its generation chunk).
    progress
        Show a tqdm progress bar in cells.
    multimodal
        Also write the further modalities of the cells, one table per modality keyed by
        ``cell_id`` (see `materialize._synthetic_multimodal`):
        ``rna_layers_{spliced,unspliced,ambiguous}.parquet`` (the RNA counts split
        ~75/20/5%: non-negative integers summing exactly to ``cells.parquet``, same rows and
        order, nonzeros only) and ``layers/*`` of ``cells.h5ad``; ``peaks.parquet`` (the
        peak table) and ``atac_cells.parquet`` (``cell_id``, ``peak_token_id``,
        ``peak_accessibility``, ``dataset``).
    num_peaks
        Peaks of the ATAC modality (at most 1,000,000), spread over GRCh38, 300–1000 bp wide.
    atac_mean_nnz
        Mean accessible peaks per cell (log-normal, clipped to ``[200, num_peaks // 10]``);
        peak popularity is Zipf-like, a tenth of the draws come from the cell type's own
        peaks, and values are small counts (80% 1, 15% 2, then 3 and 4).
    atac_fraction
        Share of the cells with ATAC (a seeded draw per cell).
    atac_shuffle
        Write the ATAC rows in a seeded random order (else in the RNA order); a cell's ATAC
        does not depend on it.
    write_h5mu
        Also write ``cells.h5mu`` (MuData: ``rna`` with the layers, ``atac`` in the ATAC
        order); needs ``multimodal`` and the ``mudata`` package (imported only then), and
        holds every nonzero in memory, so it is for small corpora.

    Returns
    -------
    SyntheticCorpus
        Paths of the written files and the corpus size.
    """
    if write_h5mu and not multimodal:
        raise ValueError("write_h5mu needs multimodal=True")
    model = Model(num_cells, num_genes, seed, num_plates, mean_nnz, marker_fraction, program_fraction)
    mm = None
    if multimodal:
        from . import _synthetic_multimodal as mm
        from ._synthetic_atac import AtacModel

        atac = AtacModel(model, num_peaks, atac_mean_nnz, atac_fraction, atac_shuffle)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    genes_path = out / "gene_metadata.parquet"
    pq.write_table(pa.Table.from_pandas(model.genes, preserve_index=False), genes_path, compression="zstd")
    cells_path = out / "cells.parquet" if write_parquet else None
    h5ad_path = out / "cells.h5ad" if write_h5ad else None
    writer = h5 = further = None
    n_genes, totals = np.empty(num_cells, np.int32), np.empty(num_cells, np.float32)

    def write(index: int, start: int, offsets: np.ndarray, genes: np.ndarray, values: np.ndarray) -> None:
        _write_chunk(
            writer,
            h5,
            model,
            start,
            offsets,
            genes,
            values,
            totals[start : start + offsets.size - 1],
            row_group_size,
        )
        if further is not None:
            further.rna_chunk(index, start, offsets, genes, values)

    try:
        if cells_path:  # encodings chosen for write speed: sorted ids delta-encode well
            strings = [f.name for f in _SCHEMA if f.type == pa.string()]
            flat = [f.name for f in _SCHEMA if not pa.types.is_list(f.type)]
            writer = pq.ParquetWriter(
                cells_path,
                _SCHEMA,
                compression="zstd",
                use_dictionary=strings,
                write_statistics=flat,
                column_encoding={_NESTED[0]: "DELTA_BINARY_PACKED", _NESTED[1]: "BYTE_STREAM_SPLIT"},
            )
        h5 = _open_h5ad(h5ad_path, num_cells, num_genes) if h5ad_path else None
        if mm is not None:
            further = mm.MultimodalWriter(
                model,
                atac,
                out,
                write_parquet=write_parquet,
                h5ad=h5,
                write_h5mu=write_h5mu,
                row_group_size=row_group_size,
            )
        with (
            ThreadPoolExecutor(1) as pool,
            progress_bar(total=num_cells, unit="cell", progress=progress) as bar,
        ):
            pending: Future | None = None  # writing chunk i overlaps generating chunk i + 1
            for index, start in enumerate(range(0, num_cells, CHUNK_CELLS)):
                offsets, genes, values = model.chunk(index)
                n = offsets.size - 1
                n_genes[start : start + n] = np.diff(offsets)
                totals[start : start + n] = np.add.reduceat(values, offsets[:-1])
                if pending is not None:
                    pending.result()
                pending = pool.submit(write, index, start, offsets, genes, values)
                bar.update(n)
            if pending is not None:
                pending.result()
        if h5 is not None:
            _finish_h5ad(h5, model, n_genes, totals)
        if further is not None:
            further.write_atac(progress)
            further.finish(_obs_frame(model, n_genes, totals), _var_frame(model))
    finally:
        if writer is not None:
            writer.close()
        if h5 is not None:
            h5.close()
        if further is not None:
            further.close()
    nnz = int(n_genes.sum(dtype=np.int64))
    if further is None:
        return SyntheticCorpus(cells_path, genes_path, h5ad_path, num_cells, num_genes, nnz)
    return SyntheticCorpus(
        cells_path,
        genes_path,
        h5ad_path,
        num_cells,
        num_genes,
        nnz,
        layers=further.layer_paths,
        atac_parquet=further.atac_path,
        peaks_parquet=further.peaks_path,
        h5mu=further.h5mu_path,
        num_peaks=num_peaks,
        atac_nnz=further.atac_nnz,
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: generate a corpus and print one summary line."""
    parser = argparse.ArgumentParser(
        prog="omicsio-materialize synth", description="Write a synthetic Tahoe-like single-cell corpus."
    )
    parser.add_argument(
        "out_dir", type=Path, help="the folder to write (cells.parquet, gene table, cells.h5ad)"
    )
    for flag, default, what in (
        ("--cells", 20_000, "cells"),
        ("--genes", 62_710, "genes (Ensembl ids of a human-sized gene space)"),
        ("--seed", 0, "seed of every draw: the same seed writes the same bytes"),
        ("--plates", None, "contiguous plates (obs batch); default max(2, min(14, cells // 2000))"),
    ):
        shown = "" if default is None else " (default %(default)s)"
        parser.add_argument(flag, type=int, default=default, help=f"{what}{shown}")
    parser.add_argument("--peaks", type=int, default=200_000, help="ATAC peaks (with --multimodal)")
    parser.add_argument(
        "--program-fraction",
        type=float,
        default=PROGRAM_FRACTION,
        help="how far the cell types' expression programs differ (0: one program; default %(default)s)",
    )
    for flag, what in (
        ("--no-h5ad", "write no cells.h5ad"),
        ("--no-parquet", "write no cells.parquet"),
        ("--no-progress", "no progress bar"),
    ):
        parser.add_argument(flag, action="store_true", help=what)
    parser.add_argument(
        "--multimodal", action="store_true", help="also write splice layers and an ATAC modality"
    )
    parser.add_argument("--h5mu", action="store_true", help="also write cells.h5mu (needs --multimodal)")
    args = parser.parse_args(argv)
    if args.h5mu and not args.multimodal:
        parser.error("--h5mu needs --multimodal")
    # the model's own checks raise ValueError (a traceback here): said in the flags' words first
    for flag, value, low in (
        ("--cells", args.cells, 1),
        ("--genes", args.genes, 1),
        ("--peaks", args.peaks, 1),
    ):
        if value < low:
            parser.error(f"{flag} must be at least {low}, got {value}")
    if args.plates is not None and not 1 <= args.plates <= args.cells:
        parser.error(f"--plates must lie in 1..--cells ({args.cells}), got {args.plates}")
    if not 0 <= args.program_fraction <= 1:
        parser.error(f"--program-fraction must lie in [0, 1], got {args.program_fraction}")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"{args.out_dir} is a file: give a folder to write the corpus in")
    t0 = time.perf_counter()
    corpus = make_synthetic_corpus(
        args.out_dir,
        num_cells=args.cells,
        num_genes=args.genes,
        seed=args.seed,
        num_plates=args.plates,
        program_fraction=args.program_fraction,
        write_parquet=not args.no_parquet,
        write_h5ad=not args.no_h5ad,
        progress=not args.no_progress,
        multimodal=args.multimodal,
        num_peaks=args.peaks,
        write_h5mu=args.h5mu,
    )
    paths = [
        corpus.cells_parquet,
        corpus.genes_parquet,
        corpus.h5ad,
        *(corpus.layers or {}).values(),
        corpus.atac_parquet,
        corpus.peaks_parquet,
        corpus.h5mu,
    ]
    files = [p.name for p in paths if p is not None]
    atac = f" peaks={corpus.num_peaks} atac_nnz={corpus.atac_nnz}" if args.multimodal else ""
    print(
        f"cells={corpus.num_cells} genes={corpus.num_genes} nnz={corpus.nnz}{atac} "
        f"files={','.join(files)} seconds={time.perf_counter() - t0:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
