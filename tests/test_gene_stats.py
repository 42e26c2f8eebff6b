"""Corpus statistics: computed at materialize, exact against numpy, mergeable, added to older datasets."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil

import numpy as np
import pytest

import omicsio_jax as oj
from materialize import InputOptions, Layout, materialize
from materialize._cli import main as materialize_main
from omicsio_jax.format.gene_stats import MEDIAN_RELATIVE_ERROR, GeneStats


@pytest.fixture(scope="module")
def ds(dataset_dir):
    return oj.open_dataset(dataset_dir)


@pytest.fixture(scope="module")
def dense(ds):
    """The dataset's counts as a dense float64 matrix (3,000 × 2,000), read back through read_csr."""
    indptr, cols, vals = ds.read_csr(np.arange(ds.num_cells))
    x = np.zeros((ds.num_cells, ds.num_genes))
    x[np.repeat(np.arange(ds.num_cells), np.diff(indptr)), cols] = vals
    return x


def test_per_cell_and_per_gene_moments(ds, dense):
    n_counts = dense.sum(1)
    np.testing.assert_array_equal(ds.obs["n_counts"], n_counts)
    np.testing.assert_array_equal(ds.obs["n_genes"], (dense != 0).sum(1))
    stats = ds.gene_stats
    assert len(stats) == ds.num_genes
    np.testing.assert_array_equal(stats["n_cells"], (dense != 0).sum(0))
    norm = dense / n_counts[:, None] * 1e4
    for name, want in [
        ("sum", dense.sum(0)),
        ("sum_sq", (dense**2).sum(0)),
        ("norm_sum", norm.sum(0)),
        ("norm_sum_sq", (norm**2).sum(0)),
        ("log_sum", np.log1p(norm).sum(0)),
        ("log_sum_sq", (np.log1p(norm) ** 2).sum(0)),
    ]:
        np.testing.assert_allclose(stats[name], want, rtol=1e-12, err_msg=name)
    np.testing.assert_allclose(stats["norm_var"], norm.var(0, ddof=1), rtol=1e-9)


def test_histogram_medians_within_the_documented_bound(ds, dense):
    assert MEDIAN_RELATIVE_ERROR < 0.01
    norm = dense / dense.sum(1, keepdims=True) * 1e4
    medians = ds.gene_stats["median"].to_numpy()
    checked = 0
    for g in range(ds.num_genes):
        nz = norm[:, g][norm[:, g] > 0]
        if len(nz) == 0:
            assert np.isnan(medians[g])
            continue
        exact = np.median(nz)
        assert abs(medians[g] - exact) <= MEDIAN_RELATIVE_ERROR * exact, g
        checked += 1
    assert checked > 1500


@pytest.mark.parametrize("counts", [np.uint16, np.uint32, np.int64])
def test_medians_are_the_centres_of_the_middle_ranks_bins(counts):
    """Each gene's median is the mean of the centres of the bins holding its lower and upper middle
    values (NaN for a gene without entries), whatever the counts' type: checked against the sorted
    values the histograms stand for."""
    from omicsio_jax.format.gene_stats import BINS_PER_OCTAVE, LOW_EXPONENT, NUM_BINS

    rng = np.random.default_rng(3)
    genes = 300
    lengths = rng.integers(0, 9, genes) * (rng.random(genes) < 0.8)  # a fifth never expressed
    ptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    bins = np.concatenate([np.sort(rng.choice(NUM_BINS, n, replace=False)) for n in lengths]).astype(
        np.uint16
    )
    hist_counts = rng.integers(1, 50, int(ptr[-1])).astype(counts)
    stats = GeneStats(
        int(hist_counts.sum()), np.zeros(genes, np.int64), np.zeros((6, genes)), ptr, bins, hist_counts
    )
    centres = 2.0 ** ((np.arange(NUM_BINS) + 0.5) / BINS_PER_OCTAVE + LOW_EXPONENT)
    medians = stats.medians()
    for g in range(genes):
        lo, hi = ptr[g], ptr[g + 1]
        if lo == hi:
            assert np.isnan(medians[g])
            continue
        values = np.repeat(centres[bins[lo:hi]], hist_counts[lo:hi].astype(np.int64))  # ascending
        n = len(values)
        assert medians[g] == 0.5 * (values[(n - 1) // 2] + values[n // 2]), g
    assert np.isnan(medians).sum() == np.count_nonzero(lengths == 0) > 0


def test_the_stored_medians_are_the_histograms_and_older_files_give_the_same(ds, tmp_path):
    """``gene_stats.parquet`` holds each gene's median beside its histogram: `read_gene_medians`
    reads that column alone, and a file written before it existed (no median column) gives the same
    medians read off the histograms, as do the Geneformer tokens ranked by them."""
    import pyarrow.parquet as pq

    from omicsio_jax.format.gene_stats import MEDIAN, read_gene_medians, read_gene_stats
    from omicsio_jax.outputs.base import OutputContext

    want = read_gene_stats(ds).medians()
    assert np.isfinite(want).sum() > 1500
    np.testing.assert_array_equal(read_gene_medians(ds), want)
    older = tmp_path / "older"
    shutil.copytree(ds.path, older)
    table = pq.read_table(older / "gene_stats.parquet")
    assert MEDIAN in table.column_names
    pq.write_table(table.drop_columns([MEDIAN]), older / "gene_stats.parquet")
    data = (older / "gene_stats.parquet").read_bytes()
    manifest = json.loads((older / "manifest.json").read_text())
    (entry,) = (f for f in manifest["files"] if f["path"] == "gene_stats.parquet")
    entry.update(num_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())  # as its writer listed it
    (older / "manifest.json").write_text(json.dumps(manifest))
    old_ds = oj.open_dataset(older)
    np.testing.assert_array_equal(read_gene_medians(old_ds), want)
    scales = [oj.GeneformerTokens().bind(OutputContext.of_dataset(d)).scale for d in (ds, old_ds)]
    np.testing.assert_array_equal(*scales)


def test_statistics_merge_across_parts(corpus, ds, tmp_path):
    """Two halves of the cells, materialized apart and merged, give the whole's statistics."""
    import duckdb

    con = duckdb.connect()
    for name, where in (("a", "< 1500"), ("b", ">= 1500")):
        con.execute(
            f"COPY (SELECT * FROM '{corpus.cells_parquet}' WHERE cast(substr(cell_id, 6) AS INT) {where}) "
            f"TO '{tmp_path / name}.parquet'"
        )
        materialize(
            tmp_path / f"{name}.parquet",
            tmp_path / name,
            progress=False,
            read=InputOptions(genes=corpus.genes_parquet),
            layout=Layout(shard_cells=512),
        )
    parts = [GeneStats.read(tmp_path / name / "gene_stats.parquet") for name in "ab"]
    whole = GeneStats.read(ds.path / "gene_stats.parquet")
    merged = parts[0].merge(parts[1])
    assert merged.num_cells == whole.num_cells == 3000
    np.testing.assert_array_equal(merged.n_cells, whole.n_cells)
    np.testing.assert_array_equal(merged.dense_hist(), whole.dense_hist())
    np.testing.assert_allclose(merged.sums, whole.sums, rtol=1e-12)
    np.testing.assert_array_equal(merged.medians(), whole.medians())


def _three_genes(counts: np.ndarray) -> GeneStats:
    """Statistics of 5 cells over 3 genes: gene 0 in bins 3 and 900, gene 2 in bin 7 (``counts``)."""
    return GeneStats(
        num_cells=5,
        n_cells=np.array([2, 0, 1]),
        sums=np.arange(18, dtype=np.float64).reshape(6, 3),
        hist_ptr=np.array([0, 2, 2, 3]),
        hist_bins=np.array([3, 900, 7], np.uint16),
        hist_counts=counts,
    )


@pytest.mark.parametrize(("top", "stored"), [(65_535, np.uint16), (65_536, np.uint32), (1 << 32, np.int64)])
def test_partition_statistics_file_keeps_every_count(tmp_path, top, stored):
    """A partition's statistics file stores histogram counts in the narrowest type that holds them,
    and reads them back exactly."""
    stats = _three_genes(np.array([1, top, 2], np.int64))
    stats.save(tmp_path / "s.bin")
    with open(tmp_path / "s.bin", "rb") as f:  # the arrays one after another, counts last
        stored_counts = [np.load(f) for _ in range(6)][-1]
    assert stored_counts.dtype == stored
    back = GeneStats.load(tmp_path / "s.bin")
    assert back.num_cells == 5
    assert back.hist_counts.dtype == stored
    assert GeneStats.from_dense(5, stats.n_cells, stats.sums, stats.dense_hist()).hist_counts.dtype == stored
    np.testing.assert_array_equal(back.dense_hist(), stats.dense_hist())
    np.testing.assert_array_equal(back.sums, stats.sums)


@pytest.mark.parametrize("counts", [np.uint16, np.int64])
def test_dataset_statistics_file_reads_back_counts_of_any_width(tmp_path, counts):
    """The dataset's ``gene_stats.parquet`` stores histogram counts in the type they come in (the
    narrowest, from a merge); files of older versions hold int64 counts. Both read back exactly."""
    stats = _three_genes(np.array([1, 60_000, 2], counts))
    stats.write(tmp_path / "gene_stats.parquet")
    back = GeneStats.read(tmp_path / "gene_stats.parquet")
    assert back.hist_counts.dtype == counts
    np.testing.assert_array_equal(back.dense_hist(), stats.dense_hist())
    np.testing.assert_array_equal(back.medians(), stats.medians())


def test_dataset_statistics_file_of_earlier_versions_reads_back(tmp_path):
    """A ``gene_stats.parquet`` written before the histograms were one binary value per gene (two
    list columns, int64 counts, no counts type in the metadata) reads back the same statistics."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stats = _three_genes(np.array([1, 60_000, 2], np.int64))
    stats.write(tmp_path / "new.parquet")
    table = pq.read_table(tmp_path / "new.parquet")
    assert pa.types.is_large_binary(table.schema.field("hist_bins").type)
    meta = json.loads(table.schema.metadata[b"omicsio_jax.gene_stats"])
    del meta["hist_counts_dtype"]
    offsets = pa.array(stats.hist_ptr, pa.int64())
    old = table.drop_columns(["hist_bins", "hist_counts"])
    old = old.append_column("hist_bins", pa.LargeListArray.from_arrays(offsets, pa.array(stats.hist_bins)))
    old = old.append_column(
        "hist_counts", pa.LargeListArray.from_arrays(offsets, pa.array(stats.hist_counts))
    )
    pq.write_table(
        old.replace_schema_metadata({"omicsio_jax.gene_stats": json.dumps(meta)}), tmp_path / "old.parquet"
    )
    for name in ("new.parquet", "old.parquet"):
        back = GeneStats.read(tmp_path / name)
        assert back.num_cells == stats.num_cells
        for field in ("n_cells", "sums", "hist_ptr", "hist_bins", "hist_counts"):
            np.testing.assert_array_equal(getattr(back, field), getattr(stats, field))
        np.testing.assert_array_equal(back.medians(), stats.medians())


def test_adding_histograms_by_gene_blocks_on_threads_gives_the_whole_table(ds):
    """The finalizer adds a partition's histograms on several threads, each a block of genes
    (`GeneStats.gene_blocks`): the blocks cover every gene once, in order, and the table and spans
    they build are those of one whole add."""
    from concurrent.futures import ThreadPoolExecutor

    from omicsio_jax.format.gene_stats import NUM_BINS, empty_span

    stats = GeneStats.read(ds.path / "gene_stats.parquet")
    whole, whole_span = np.zeros((stats.num_genes, NUM_BINS), np.uint32), empty_span(stats.num_genes)
    stats.add_to_dense(whole, whole_span)
    for n in (1, 3, 4):
        blocks = stats.gene_blocks(n)
        assert blocks[0][0] == 0 and blocks[-1][1] == stats.num_genes
        assert all(a[1] == b[0] for a, b in zip(blocks[:-1], blocks[1:], strict=True))
        assert len(blocks) == n  # 2,000 genes with entries: no block is empty
        hist, span = np.zeros_like(whole), empty_span(stats.num_genes)
        with ThreadPoolExecutor(n) as pool:
            for _ in range(2):  # twice: the counts add
                list(pool.map(lambda b, h=hist, s=span: stats.add_to_dense(h, s, b), blocks))
        np.testing.assert_array_equal(hist, 2 * whole)
        np.testing.assert_array_equal(span, whole_span)


def test_stats_command_adds_statistics_to_an_older_dataset(ds, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(ds.path, old)
    manifest = json.loads((old / "manifest.json").read_text())
    derived = {"gene_stats.parquet", "obs/n_counts.npy", "obs/n_genes.npy"}
    manifest["files"] = [f for f in manifest["files"] if f["path"] not in derived]
    manifest["obs"] = [o for o in manifest["obs"] if o["name"] not in ("n_counts", "n_genes")]
    (old / "manifest.json").write_text(json.dumps(manifest))
    for path in derived:
        (old / path).unlink()
    with pytest.raises(oj.OmicsIOError, match="omicsio-materialize stats"):
        _ = oj.open_dataset(old).gene_stats
    assert materialize_main(["stats", str(old), "--no-progress"]) == 0
    assert "statistics of 3,000 cells" in capsys.readouterr().out
    for path in derived:  # byte-identical to what materialize wrote
        assert (old / path).read_bytes() == (ds.path / path).read_bytes(), path
    again = oj.open_dataset(old)
    assert again.fingerprint == ds.fingerprint
    assert oj.verify_dataset(old) == []
    assert materialize_main(["stats", str(old), "--no-progress"]) == 0
    assert "already has statistics" in capsys.readouterr().out


def test_no_stats_then_the_stats_command_gives_the_same_dataset(corpus, ds, tmp_path, capsys):
    """``--no-stats`` writes the same shards and obs without the statistics; the `stats` command
    then adds exactly what a run with statistics writes."""
    out = tmp_path / "lean"
    args = [str(corpus.cells_parquet), str(out), "--shard-cells", "1024", "--workers", "2"]
    assert materialize_main([*args, "--no-stats", "--no-progress"]) == 0
    lean = oj.open_dataset(out)
    derived = {"gene_stats.parquet", "obs/n_counts.npy", "obs/n_genes.npy"}
    assert not any((out / path).exists() for path in derived)
    assert derived.isdisjoint(f.path for f in lean.manifest.files)
    assert "n_counts" not in lean.obs and "n_genes" not in lean.obs
    assert oj.verify_dataset(out) == []
    for shard in ds.manifest.shards:
        assert (out / shard.path).read_bytes() == (ds.path / shard.path).read_bytes(), shard.path
    with pytest.raises(oj.OmicsIOError, match="omicsio-materialize stats"):
        _ = lean.gene_stats
    assert materialize_main(["stats", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    for path in derived:
        assert (out / path).read_bytes() == (ds.path / path).read_bytes(), path
    assert oj.open_dataset(out).fingerprint == ds.fingerprint


def test_highly_variable_genes_match_scanpy(ds, dense):
    import anndata as ad
    import scanpy as sc

    adata = ad.AnnData(dense.copy())
    sc.pp.normalize_total(adata, target_sum=1e4)
    sc.pp.log1p(adata)
    sc.pp.highly_variable_genes(adata, n_top_genes=300, flavor="seurat")
    want = np.flatnonzero(adata.var["highly_variable"].to_numpy())
    got = ds.highly_variable_genes(300)
    assert len(np.intersect1d(got, want)) >= 0.99 * len(want), (len(got), len(want))
    with pytest.raises(oj.OmicsIOError, match="n must lie in 1..2,000"):
        ds.highly_variable_genes(0)


def test_highly_variable_genes_under_pandas_copy_on_write(ds):
    """pandas 3 copies on write by default (2.x with ``mode.copy_on_write``): a Series' ``to_numpy``
    is then a read-only view, and the ranking wrote into one ("assignment destination is
    read-only")."""
    import pandas as pd

    want = ds.highly_variable_genes(300)
    pandas_2 = int(pd.__version__.split(".")[0]) < 3  # (pandas 3 always does, and warns of the option)
    with pd.option_context("mode.copy_on_write", True) if pandas_2 else contextlib.nullcontext():
        got = ds.highly_variable_genes(300)
    np.testing.assert_array_equal(got, want)


def test_accumulator_histograms_are_exact_and_a_reused_one_starts_clean(ds, dense):
    """The histogram counts each positive normalized value in its bin, as numpy bins it; an
    accumulator used again after `finish` (a worker's, from one partition to the next) gives the
    next rows' statistics bit for bit as a fresh one does."""
    from omicsio_jax.format import StatsAccumulator
    from omicsio_jax.format.codec import join_records
    from omicsio_jax.format.gene_stats import BINS_PER_OCTAVE, LOW_EXPONENT, NUM_BINS

    half = ds.num_cells // 2
    parts = [join_records(ds.read_records(lo, hi)) for lo, hi in ((0, half), (half, ds.num_cells))]
    reused = StatsAccumulator(ds.num_genes, shard_cells=256)
    got = []
    for buf, starts in parts:
        reused.add(buf, starts)
        got.append(reused.finish())
    fresh = StatsAccumulator(ds.num_genes, shard_cells=256)
    fresh.add(*parts[1])
    again = fresh.finish()
    for name in ("n_cells", "sums", "hist_ptr", "hist_bins", "hist_counts"):
        np.testing.assert_array_equal(getattr(got[1], name), getattr(again, name), err_msg=name)

    rows = dense[:half]
    norm = rows * (1e4 / rows.sum(1))[:, None]
    cells, genes = np.nonzero(norm > 0)
    bins = np.clip(np.floor((np.log2(norm[cells, genes]) - LOW_EXPONENT) * BINS_PER_OCTAVE), 0, NUM_BINS - 1)
    want = np.zeros((ds.num_genes, NUM_BINS), np.int64)
    np.add.at(want, (genes, bins.astype(np.int64)), 1)
    np.testing.assert_array_equal(got[0].dense_hist(), want)
    assert got[0].num_cells == half and got[0].hist_counts.sum() == len(cells)


def test_partition_files_saved_from_one_accumulator_hold_each_partition(ds, tmp_path):
    """`StatsAccumulator.save` (a worker's: the CSR built in arrays kept from one partition to the
    next) writes each partition's statistics as `finish` returns them; a loaded file (mapped, not
    read) keeps its contents when a retried partition writes the file again."""
    from omicsio_jax.format import StatsAccumulator
    from omicsio_jax.format.codec import join_records

    half = ds.num_cells // 2
    parts = [join_records(ds.read_records(lo, hi)) for lo, hi in ((0, half), (half, ds.num_cells))]
    kept, fresh = StatsAccumulator(ds.num_genes, shard_cells=256), StatsAccumulator(ds.num_genes, 256)
    for k, (buf, starts) in enumerate(parts):
        kept.add(buf, starts)
        kept.save(tmp_path / f"{k}.bin")
    loaded = [GeneStats.load(tmp_path / f"{k}.bin") for k in range(2)]
    for k, (buf, starts) in enumerate(parts):
        fresh.add(buf, starts)
        want = fresh.finish()
        assert loaded[k].num_cells == want.num_cells
        for name in ("n_cells", "sums", "hist_ptr", "hist_bins", "hist_counts"):
            np.testing.assert_array_equal(getattr(loaded[k], name), getattr(want, name), err_msg=name)
    before = loaded[0].dense_hist()
    loaded[1].save(tmp_path / "0.bin")  # the file loaded[0] maps, written again
    np.testing.assert_array_equal(loaded[0].dense_hist(), before)
    np.testing.assert_array_equal(GeneStats.load(tmp_path / "0.bin").dense_hist(), loaded[1].dense_hist())


@pytest.mark.parametrize("count_dtype", [np.uint8, np.uint16])
def test_a_narrow_histogram_table_keeps_counts_past_its_largest_exact(ds, count_dtype):
    """Counts past the table type's largest (255 for uint8 here, on the records read 10 times; 65,535
    for the default uint16, one bin of one gene in 70,000 cells) come out as a uint32 table's, bit
    for bit."""
    from omicsio_jax.format import StatsAccumulator
    from omicsio_jax.format.codec import encode_csr, join_records

    if count_dtype == np.uint8:
        records, genes = [join_records(ds.read_records(0, ds.num_cells))] * 10, ds.num_genes
    else:
        n = 70_000  # every cell: gene 3 alone, so its one bin counts every cell
        indptr = np.arange(n + 1, dtype=np.int64)
        records, genes = [encode_csr(indptr, np.full(n, 3, np.int32), np.full(n, 2.0))], 8
    got, want = StatsAccumulator(genes, 256, count_dtype), StatsAccumulator(genes, 256, np.uint32)
    for acc in (got, want):
        for buf, starts in records:
            acc.add(buf, starts)
    got, want = got.finish(), want.finish()
    assert want.hist_counts.max() > np.iinfo(count_dtype).max  # the case is met
    for name in ("n_cells", "sums", "hist_ptr", "hist_bins", "hist_counts"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert got.hist_counts.dtype == want.hist_counts.dtype
