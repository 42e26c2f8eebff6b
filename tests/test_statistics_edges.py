"""Corpus statistics at the edges of what users bring: negative values, the `stats` command's
manifests (also of a multimodal dataset), and the highly variable genes' arguments."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from conftest import run_as_nobody

import omicsio_jax as oj
from materialize import Layout, Multimodal, materialize
from materialize._cli import main as materialize_main
from omicsio_jax.format.codec import encode_csr
from omicsio_jax.format.hvg import seurat_hvg
from omicsio_jax.format.stats_accumulator import StatsAccumulator


def _accumulate(x: np.ndarray, shard_cells: int = 4):
    """The `GeneStats` of the dense rows ``x`` (their nonzeros encoded as records)."""
    rows, cols = np.nonzero(x)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=len(x)))]).astype(np.int64)
    buf, starts = encode_csr(indptr, cols.astype(np.int32), x[rows, cols].astype(np.float32))
    acc = StatsAccumulator(x.shape[1], shard_cells)
    n_counts, _ = acc.add(buf, starts)
    return acc.finish(), n_counts


def test_negative_values_count_in_the_normalized_moments():
    """A dataset with negative values (``allow_negative``) gets the moments of ``value / n_counts ·
    1e4`` and of its ``log1p`` over every value, as scanpy's normalize_total + log1p and the loader
    compute them (a row of negative total divides too; one of total 0 stays 0); the histogram holds
    the positive ones."""
    rng = np.random.default_rng(0)
    x = rng.poisson(20, (12, 6)).astype(np.float64)
    x[0, 0] = -(2.0**-10)  # a negative value in a row of positive total (log1p finite)
    x[1] = 0
    x[1, 2] = -4.0  # a row of negative total: its value normalizes to +1e4
    x[2] = 0
    x[2, [1, 3]] = 3.0, -3.0  # total 0: stays 0
    stats, n_counts = _accumulate(x)
    np.testing.assert_array_equal(n_counts, x.sum(1))
    total = x.sum(1, keepdims=True)
    norm = np.divide(x * 1e4, total, out=np.zeros_like(x), where=total != 0)
    for k, want in enumerate([x.sum(0), (x**2).sum(0), norm.sum(0), (norm**2).sum(0)]):
        np.testing.assert_allclose(stats.sums[k], want, rtol=1e-12, err_msg=str(k))
    np.testing.assert_allclose(stats.sums[4], np.log1p(norm).sum(0), rtol=1e-12)
    np.testing.assert_allclose(stats.sums[5], (np.log1p(norm) ** 2).sum(0), rtol=1e-12)
    np.testing.assert_array_equal(stats.n_cells, (x != 0).sum(0))
    hist = stats.dense_hist()
    np.testing.assert_array_equal(hist.sum(1), (norm > 0).sum(0))  # the positive values alone


def test_highly_variable_genes_refuse_a_number_of_genes_that_is_no_integer():
    mean, var = np.linspace(1, 2, 10), np.linspace(1, 3, 10)
    for n in (5.0, True, "5"):
        with pytest.raises(TypeError, match="n must be an integer number of genes"):
            seurat_hvg(mean, var, n)
    assert len(seurat_hvg(mean, var, np.int64(3))) >= 3


def _h5ad(path, rng):
    import anndata as ad
    import pandas as pd
    import scipy.sparse as sp

    x = sp.random(300, 40, density=0.2, format="csr", dtype=np.float32, random_state=rng)
    x.data = np.ceil(x.data * 9)
    obs = pd.DataFrame(
        {"cell_type": pd.Categorical(rng.choice(["B", "T"], 300))}, index=[f"c{i}" for i in range(300)]
    )
    var = pd.DataFrame(index=[f"ENSG{i:011d}" for i in range(40)])
    ad.AnnData(X=x, obs=obs, var=var).write_h5ad(path)


def _with_and_without_stats(source, root, **options) -> dict:
    """``source`` materialized with statistics (``out_True``) and without (``out_False``) in ``root``."""
    outs = {stats: root / f"out_{stats}" for stats in (True, False)}
    for stats, out in outs.items():
        layout = Layout(shard_cells=128, group_size=16)
        materialize(source, out, progress=False, layout=layout, workers=1, stats=stats, **options)
    return outs


def test_the_stats_command_writes_the_manifest_materialize_writes(tmp_path, capsys):
    """``--no-stats`` then ``omicsio-materialize stats`` gives every file a run with statistics
    writes, the manifest too (its files and obs listed in the same order)."""
    _h5ad(tmp_path / "cells.h5ad", np.random.default_rng(1))
    outs = _with_and_without_stats(tmp_path / "cells.h5ad", tmp_path)
    assert materialize_main(["stats", str(outs[False]), "--no-progress"]) == 0
    capsys.readouterr()
    files = sorted(p.relative_to(outs[True]) for p in outs[True].rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(outs[False]) for p in outs[False].rglob("*") if p.is_file())
    for path in files:
        assert (outs[True] / path).read_bytes() == (outs[False] / path).read_bytes(), path


def test_the_stats_command_on_a_dataset_the_user_cannot_write_is_a_one_line_error(dataset_dir, shared_dir):
    """Another user's dataset on shared storage: ``stats`` cannot add its files there, which it says
    in one line with what to do (it was a PermissionError traceback)."""
    path = shutil.copytree(dataset_dir, shared_dir / "ds")
    code = f"from materialize._cli import main; raise SystemExit(main(['stats', {str(path)!r}, '--force']))"
    out = run_as_nobody(code)
    assert out.returncode == 2, out.stderr
    assert out.stderr == (
        f"omicsio-materialize: error: stats cannot write into {path} (Permission denied): it adds its "
        "files to the dataset's folder; run it as the folder's owner, or on a copy you can write\n"
    )
    assert oj.verify_dataset(path) == []


def test_the_stats_command_refused_by_the_folder_stops_before_reading(
    dataset_dir, tmp_path, monkeypatch, capsys
):
    """The same refusal in this process (where another user cannot run): the dataset's folder
    refuses stats' staging folder; one line, exit status 2, the dataset as it was."""
    import materialize._stats as stats_command

    path = shutil.copytree(dataset_dir, tmp_path / "ds")

    class Refused:
        def __init__(self, *, dir, prefix):  # noqa: A002 - tempfile's keyword
            raise PermissionError(13, "Permission denied", str(dir))

    monkeypatch.setattr(stats_command.tempfile, "TemporaryDirectory", Refused)
    assert materialize_main(["stats", str(path), "--force"]) == 2
    assert capsys.readouterr().err == (
        f"omicsio-materialize: error: stats cannot write into {path} (Permission denied): it adds its "
        "files to the dataset's folder; run it as the folder's owner, or on a copy you can write\n"
    )
    assert oj.verify_dataset(path) == []


def _list_table(rng, num_cells: int, num_features: int, kind: str, **obs):
    """Cells as a list-column table: sorted ``<kind>_token_id`` and positive integer values."""
    import pyarrow as pa

    ids, values = [], []
    for _ in range(num_cells):
        cols = np.sort(rng.choice(num_features, rng.integers(0, 12), replace=False))
        ids.append(cols.astype(np.int32))
        values.append(rng.integers(1, 9, len(cols)).astype(np.float32))
    value_name = "gene_expression" if kind == "gene" else f"{kind}_accessibility"
    columns = {
        "cell_id": pa.array([f"c{i:04d}" for i in range(num_cells)]),
        f"{kind}_token_id": pa.array(ids, pa.list_(pa.int32())),
        value_name: pa.array(values, pa.list_(pa.float32())),
    }
    return pa.table({**columns, **{k: pa.array(v) for k, v in obs.items()}})


@pytest.fixture(scope="module")
def multiome(tmp_path_factory):
    """A small RNA + ATAC dataset materialized with and without statistics."""
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("multiome")
    rng = np.random.default_rng(2)
    pq.write_table(
        _list_table(rng, 300, 50, "gene", cell_type=rng.choice(["B", "T"], 300)), root / "cells.parquet"
    )
    pq.write_table(_list_table(rng, 300, 80, "peak"), root / "atac_cells.parquet")
    return _with_and_without_stats(
        root / "cells.parquet",
        root,
        multimodal=Multimodal(modalities={"atac": str(root / "atac_cells.parquet")}),
        obs=["cell_type"],
    )


@pytest.mark.parametrize("where", ["dataset", "modality"])
def test_the_stats_command_adds_every_modality_of_a_multimodal_dataset(multiome, tmp_path, where, capsys):
    """On a multimodal dataset (or one of its modalities' folders, as the missing-statistics error
    names it), the `stats` command adds the statistics of every modality: the dataset then has every
    file, byte for byte, that a run with statistics writes, and verifies."""
    lean = tmp_path / "lean"
    shutil.copytree(multiome[False], lean)
    with pytest.raises(oj.OmicsIOError, match="omicsio-materialize stats"):
        _ = oj.open_dataset(lean).modality("atac").gene_stats
    target = lean if where == "dataset" else lean / "modalities" / "atac"
    assert materialize_main(["stats", str(target), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert oj.verify_dataset(lean) == []
    full = multiome[True]
    files = sorted(p.relative_to(full) for p in full.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(lean) for p in lean.rglob("*") if p.is_file())
    for path in files:
        assert (full / path).read_bytes() == (lean / path).read_bytes(), path
    assert (
        len(oj.open_dataset(lean).modality("atac").gene_stats)
        == oj.open_dataset(lean).modality("atac").num_genes
    )
    assert "and of modalities atac" in out


def test_a_target_sum_that_float32_rounds_to_zero_is_refused():
    """``target_sum=1e-50`` is positive but float32 holds it as 0, which would make every normalized
    value 0: refused like any target sum float32 cannot hold."""
    from omicsio_jax.outputs.scatter import scatter_dense

    indptr, cols, values = np.array([0, 2]), np.array([0, 1], np.int32), np.array([1.0, 3.0], np.float32)
    for target_sum in (1e-50, -1.0, float("inf")):
        with pytest.raises(oj.OmicsIOError, match="must be a positive float32-representable number"):
            scatter_dense(indptr, cols, values, 2, normalize="normalize_log1p", target_sum=target_sum)
        with pytest.raises(oj.OmicsIOError, match="must be a positive float32-representable number"):
            oj.Dense(normalize="normalize_log1p", target_sum=target_sum)
    out = scatter_dense(indptr, cols, values, 2, normalize="normalize_log1p", target_sum=1.0)
    np.testing.assert_allclose(out, np.log1p(values / 4.0)[None], rtol=1e-6)


def test_highly_variable_genes_of_cells_where_no_gene_varies_is_a_one_line_error():
    """Genes never expressed (or constant) have no dispersion; when no gene has one, the error says
    so instead of an IndexError."""
    with pytest.raises(oj.OmicsIOError, match="none of the 4 genes has a normalized dispersion"):
        seurat_hvg(np.zeros(4), np.zeros(4), 2)


def test_highly_variable_genes_leave_out_a_bin_whose_genes_share_one_dispersion():
    """Three copies of a gene (one gene under three ids) alone in their mean bin: their z-scores are
    0 / 0, NaN, as in scanpy, and they are never chosen. The bin's mean came out an ulp below their
    dispersion, so they scored +inf: the n-th highest score, and no gene passed it."""
    d = 5.447788772179534  # the copies' dispersion, whose mean over three is not itself in float64
    rng = np.random.default_rng(0)
    others = np.geomspace(0.05, 400.0, 40)
    others = others[np.abs(np.log1p(others) - np.log1p(2.0)) > 0.4]  # none in the copies' bin
    mean = np.concatenate([[2.0, 2.0, 2.0], others])
    var = np.concatenate([np.full(3, 2.0 * np.exp(d)), others * np.exp(rng.normal(1.0, 1.0, len(others)))])
    assert np.log(var[:3] / mean[:3]).mean() != d  # the ulp the bin's mean is off by
    for n in (1, 2, 5):
        chosen = seurat_hvg(mean, var, n)
        assert len(chosen) >= n and not np.isin([0, 1, 2], chosen).any(), n


def test_the_variance_of_a_constant_gene_is_0_not_a_rounding_below_it():
    """A gene at 0.3 in every cell: its one-pass variance rounded to -1.65e-15 (a NaN standard
    deviation for whoever takes the root); it is 0, and every variance is at least 0."""
    x = np.ones((3000, 4))
    x[:, 0] = 0.3
    x[:, 1:] = np.random.default_rng(1).poisson(5, (3000, 3)) + 1.0
    stats, _ = _accumulate(x, shard_cells=1000)
    frame = stats.frame()
    raw = stats.sums[1][0] / 3000 - (stats.sums[0][0] / 3000) ** 2
    assert raw < 0  # the rounding this guards against
    assert frame["var"][0] == 0.0 and (frame[["var", "norm_var", "log_var"]] >= 0).all().all()
    np.testing.assert_allclose(frame["var"][1:], x[:, 1:].var(0, ddof=1), rtol=1e-9)
