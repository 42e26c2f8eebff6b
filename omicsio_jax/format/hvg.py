"""Highly variable genes from stored moments: scanpy's ``flavor="seurat"`` without a pass over the cells."""

from __future__ import annotations

import numpy as np

from omicsio_jax.core.errors import OmicsIOError


def seurat_hvg(mean: np.ndarray, var: np.ndarray, n_top: int, n_bins: int = 20) -> np.ndarray:
    """Columns of the ``n_top`` most variable genes by scanpy's ``flavor="seurat"`` definition, from
    the mean and variance (ddof=1) of the normalized values (scanpy's ``expm1`` of the log data); a
    gene of NaN mean (measured in no cell) is never chosen.

    Dispersion ``log(var / mean)`` is z-scored within 20 equal-width bins of ``log1p(mean)``
    (a bin holding one gene scores it 1); genes at or above the ``n_top``-th highest score are kept,
    as scanpy keeps them (ties may add genes).
    """
    import pandas as pd

    if isinstance(n_top, bool) or not isinstance(n_top, int | np.integer):
        msg = f"n must be an integer number of genes, got {n_top!r}: e.g. highly_variable_genes({min(2000, len(mean))})"
        raise TypeError(msg)
    mean, var = np.array(mean, dtype=np.float64), np.asarray(var, dtype=np.float64)
    measured = np.flatnonzero(~np.isnan(mean))
    if len(measured) < len(mean):  # genes no cell measured (a collection's NaN means): never chosen
        if not 0 < n_top <= len(measured):
            msg = f"n must lie in 1..{len(measured):,} (the genes measured in some cell), got {n_top}"
            raise OmicsIOError(msg)
        return measured[seurat_hvg(mean[measured], var[measured], n_top, n_bins)]
    if not 0 < n_top <= len(mean):
        msg = f"n must lie in 1..{len(mean):,} (the number of genes), got {n_top}"
        raise OmicsIOError(msg)
    mean[mean == 0] = 1e-12
    with np.errstate(divide="ignore", invalid="ignore"):
        dispersion = var / mean
        dispersion[dispersion == 0] = np.nan
        dispersion = np.log(dispersion)
    df = pd.DataFrame({"means": np.log1p(mean), "dispersions": dispersion})
    df["mean_bin"] = pd.cut(df["means"], bins=n_bins)
    stats = df.groupby("mean_bin", observed=True)["dispersions"].agg(avg="mean", dev="std")
    single = stats["dev"].isnull()
    stats.loc[single, "dev"] = stats.loc[single, "avg"]
    stats.loc[single, "avg"] = 0
    per_gene = stats.loc[df["mean_bin"]].set_index(df.index)
    # a copy, written below: under copy-on-write (pandas 3's default) to_numpy is a read-only view
    norm = ((df["dispersions"] - per_gene["avg"]) / per_gene["dev"]).to_numpy(copy=True)
    # a bin whose dispersions are all equal (dev 0) scores 0 / 0, NaN, as in scanpy, even where its mean
    # came out an ulp off them: ±inf there became the cutoff, and no gene (or only those) passed
    norm[per_gene["dev"].to_numpy() == 0] = np.nan
    finite = norm[~np.isnan(norm)]
    if not len(finite):
        msg = f"none of the {len(mean):,} genes has a normalized dispersion (do any vary across the cells?): no highly variable genes to rank"
        raise OmicsIOError(msg)
    cutoff = np.sort(finite)[::-1][min(n_top, len(finite)) - 1]
    return np.flatnonzero(np.nan_to_num(norm, nan=-np.inf) >= cutoff)
