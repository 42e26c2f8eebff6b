"""Multimodal test data: the same cells as RNA (with spliced / unspliced layers) and ATAC over 70,000
peaks, written as list-column tables (ATAC in the RNA's order or shuffled), an .h5ad with layers
and an .h5mu; `Truth` holds every modality as scipy CSR over the RNA's rows."""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import scipy.sparse as sp

N, GENES, PEAKS, SHARD = 700, 60, 70_000, 256  # peak ids beyond 65,535: records use u32 gaps where needed


class Truth:
    """Every modality of the same cells as scipy CSR over the primary's rows, plus who has ATAC."""

    def __init__(self, seed: int = 0, atac_fraction: float = 0.85):
        rng = np.random.default_rng(seed)
        self.ids = np.array([f"cell-{i:04d}" for i in range(N)], dtype=object)
        total = sp.random(N, GENES, density=0.2, random_state=rng, format="csr", dtype=np.float32)
        total.data = np.ceil(total.data * 20)
        spliced = total.copy()
        spliced.data = rng.binomial(total.data.astype(np.int64), 0.7).astype(np.float32)
        self.rna, self.spliced = total, _pruned(spliced)
        self.unspliced = _pruned(total - spliced)
        atac = sp.random(N, PEAKS, density=0.004, random_state=rng, format="csr", dtype=np.float32)
        atac.data = np.ceil(atac.data * 3)
        self.has_atac = rng.random(N) < atac_fraction
        self.atac = _pruned(sp.diags(self.has_atac.astype(np.float32)) @ atac)
        self.cell_type = rng.choice(["T", "B", "NK"], N)


def _pruned(m) -> sp.csr_matrix:
    m = sp.csr_matrix(m)
    m.eliminate_zeros()
    m.sort_indices()
    return m


def _lists(
    m: sp.csr_matrix, rows: np.ndarray, ids, tokens="gene_token_id", values="gene_expression"
) -> pa.Table:
    m = m[rows]
    toks = [m.indices[m.indptr[i] : m.indptr[i + 1]].astype(np.int32) for i in range(len(rows))]
    vals = [m.data[m.indptr[i] : m.indptr[i + 1]].astype(np.float32) for i in range(len(rows))]
    return pa.table(
        {
            "cell_id": pa.array(list(ids[rows]), pa.string()),
            tokens: pa.array(toks, pa.list_(pa.int32())),
            values: pa.array(vals, pa.list_(pa.float32())),
        }
    )


def write_tables(truth: Truth, root: Path, *, shuffle_atac: bool) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    everyone = np.arange(N)
    rna = _lists(truth.rna, everyone, truth.ids).append_column("cell_type", pa.array(truth.cell_type))
    pq.write_table(rna, root / "rna_cells.parquet", row_group_size=200)
    for name in ("spliced", "unspliced"):
        pq.write_table(_lists(getattr(truth, name), everyone, truth.ids), root / f"rna_layers_{name}.parquet")
    # in the primary's order: every cell, those without ATAC as empty lists; shuffled: only those with it
    atac_rows = (
        np.random.default_rng(7).permutation(np.flatnonzero(truth.has_atac)) if shuffle_atac else everyone
    )
    atac = _lists(truth.atac, atac_rows, truth.ids, "peak_token_id", "peak_accessibility")
    pq.write_table(
        atac.append_column("dataset", pa.array(["multiome"] * len(atac_rows))),
        root / "atac_cells.parquet",
        row_group_size=100,
    )
    peaks = pa.table(
        {
            "peak_token_id": pa.array(np.arange(PEAKS, dtype=np.int32)),
            "chrom": pa.array(["chr1"] * PEAKS),
            "start": pa.array(np.arange(PEAKS) * 1000),
            "end": pa.array(np.arange(PEAKS) * 1000 + 500),
            "peak_name": pa.array([f"chr1:{i * 1000}-{i * 1000 + 500}" for i in range(PEAKS)]),
        }
    )
    pq.write_table(peaks, root / "peaks.parquet")
    return root


def write_h5ad(truth: Truth, path: Path) -> Path:
    obs = pd.DataFrame({"cell_type": pd.Categorical(truth.cell_type)}, index=list(truth.ids))
    var = pd.DataFrame(index=[f"g{j}" for j in range(GENES)])
    ad.AnnData(
        X=truth.rna, obs=obs, var=var, layers={"spliced": truth.spliced, "unspliced": truth.unspliced}
    ).write_h5ad(path)
    return path


def write_h5mu(truth: Truth, path: Path) -> Path:
    import mudata as md

    md.set_options(pull_on_update=False)
    var = pd.DataFrame(index=[f"g{j}" for j in range(GENES)])
    rna = ad.AnnData(
        X=truth.rna,
        obs=pd.DataFrame(index=list(truth.ids)),
        var=var,
        layers={"spliced": truth.spliced, "unspliced": truth.unspliced},
    )
    order = np.random.default_rng(3).permutation(np.flatnonzero(truth.has_atac))  # another order than rna's
    atac = ad.AnnData(
        X=truth.atac[order],
        obs=pd.DataFrame(index=list(truth.ids[order])),
        var=pd.DataFrame(index=[f"peak{j}" for j in range(PEAKS)]),
    )
    md.MuData({"rna": rna, "atac": atac}).write(path)
    return path
