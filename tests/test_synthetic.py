"""Tests of the synthetic Tahoe-like corpus generator (materialize._synthetic)."""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from materialize._synthetic import SyntheticCorpus, main, make_synthetic_corpus

CELLS, GENES, PLATES = 3000, 2000, 5
LABELS = ["cell_type", "drug", "batch", "dataset", "tissue", "organism"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCorpus:
    """3,000 cells × 2,000 genes on 5 plates, parquet + h5ad."""
    return make_synthetic_corpus(
        tmp_path_factory.mktemp("synthetic"),
        num_cells=CELLS,
        num_genes=GENES,
        seed=11,
        num_plates=PLATES,
        mean_nnz=150.0,
    )


@pytest.fixture(scope="module")
def table(corpus: SyntheticCorpus) -> pa.Table:
    return pq.read_table(corpus.cells_parquet)


def list_csr(table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(indptr, indices, data)`` of the list columns, with numpy only."""
    genes = table.column("gene_token_id").combine_chunks()
    values = table.column("gene_expression").combine_chunks()
    np.testing.assert_array_equal(genes.offsets.to_numpy(), values.offsets.to_numpy())
    indptr = genes.offsets.to_numpy().astype(np.int64)
    return indptr - indptr[0], genes.flatten().to_numpy(), values.flatten().to_numpy()


def test_result_and_files(corpus: SyntheticCorpus, table: pa.Table) -> None:
    assert (corpus.num_cells, corpus.num_genes) == (CELLS, GENES)
    assert corpus.cells_parquet.name == "cells.parquet" and corpus.h5ad.name == "cells.h5ad"
    assert corpus.nnz == len(list_csr(table)[1])
    assert table.column_names == [
        "cell_id",
        "gene_token_id",
        "gene_expression",
        *LABELS,
        "n_genes",
        "total_counts",
    ]
    assert table.schema.field("gene_token_id").type == pa.list_(pa.int32())
    assert table.schema.field("gene_expression").type == pa.list_(pa.float32())
    assert pq.ParquetFile(corpus.cells_parquet).metadata.row_group(0).num_rows == min(CELLS, 8192)
    genes = pq.read_table(corpus.genes_parquet)
    assert genes.schema.field("gene_token_id").type == pa.int32()
    np.testing.assert_array_equal(genes.column("gene_token_id").to_numpy(), np.arange(GENES))
    assert genes.column("ensembl_id")[5].as_py() == "ENSG00000000005"
    assert genes.column("gene_name")[5].as_py() == "GENE5"
    assert set(genes.column("gene_type").to_pylist()) == {"protein_coding", "lncRNA"}
    assert all(c.startswith("chr") for c in genes.column("chromosome").to_pylist())


def test_parquet_and_h5ad_hold_the_same_cells(corpus: SyntheticCorpus, table: pa.Table) -> None:
    indptr, indices, data = list_csr(table)
    with h5py.File(corpus.h5ad, "r") as f:
        assert f["X"].attrs["encoding-type"] == "csr_matrix"
        np.testing.assert_array_equal(f["X"].attrs["shape"], [CELLS, GENES])
        np.testing.assert_array_equal(f["X/indptr"][:], indptr)
        np.testing.assert_array_equal(f["X/indices"][:], indices)
        np.testing.assert_array_equal(f["X/data"][:].view(np.uint32), data.view(np.uint32))
    obs = ad.read_h5ad(corpus.h5ad).obs
    assert obs.index.tolist() == table.column("cell_id").to_pylist()
    for key in LABELS:
        assert obs[key].astype(str).tolist() == table.column(key).to_pylist(), key
    np.testing.assert_array_equal(obs["n_genes"].to_numpy(), table.column("n_genes").to_numpy())
    np.testing.assert_array_equal(obs["total_counts"].to_numpy(), table.column("total_counts").to_numpy())


def test_lists_are_valid(table: pa.Table) -> None:
    indptr, indices, data = list_csr(table)
    lengths = np.diff(indptr)
    assert lengths.min() >= 1
    assert table.column("cell_id").to_pylist()[:2] == ["c000000000", "c000000001"]
    assert indices.dtype == np.int32 and data.dtype == np.float32
    assert indices.min() >= 0 and indices.max() < GENES
    steps = np.diff(indices.astype(np.int64))
    inside = np.ones(steps.size, bool)
    inside[indptr[1:-1] - 1] = False  # steps across a cell boundary
    assert (steps[inside] > 0).all()
    assert (data >= 1).all() and (data <= 65535).all() and (data == np.round(data)).all()
    assert (data <= 5).mean() > 0.5 and data.max() > 20  # mostly small counts with a tail
    np.testing.assert_array_equal(table.column("n_genes").to_numpy(), lengths)
    np.testing.assert_allclose(table.column("total_counts").to_numpy(), np.add.reduceat(data, indptr[:-1]))


def test_plates(table: pa.Table) -> None:
    batch = np.array(table.column("batch").to_pylist())
    starts = np.flatnonzero(np.r_[True, batch[1:] != batch[:-1]])
    assert batch[starts].tolist() == [f"plate_{p:02d}" for p in range(PLATES)]  # contiguous, in order
    sizes = np.diff(np.r_[starts, batch.size])
    assert len(set(sizes.tolist())) > 1  # unequal plates
    drugs = np.array(table.column("drug").to_pylist())
    types = np.array(table.column("cell_type").to_pylist())
    all_drugs, all_types = set(drugs), set(types)
    assert (len(all_drugs), len(all_types)) == (30, 20)
    last = batch == batch[-1]
    assert set(drugs[last]) == all_drugs and set(types[last]) == all_types
    for plate in batch[starts[:-1]]:
        here = batch == plate
        assert set(drugs[here]) < all_drugs or set(types[here]) < all_types, plate


def test_labels_are_learnable(table: pa.Table) -> None:
    """Nearest-centroid on standardised log counts beats chance by far for drug and cell type."""
    indptr, indices, data = list_csr(table)
    x = np.zeros((CELLS, GENES), np.float32)
    x[np.repeat(np.arange(CELLS), np.diff(indptr)), indices] = np.log1p(data)
    train = np.random.default_rng(0).random(CELLS) < 0.7
    x = (x - x[train].mean(axis=0)) / (x[train].std(axis=0) + 1e-3)
    for key in ("drug", "cell_type"):
        labels = np.array(table.column(key).to_pylist())
        classes = np.unique(labels[train])
        centroids = np.stack([x[train & (labels == c)].mean(axis=0) for c in classes])
        predicted = classes[np.argmax(x[~train] @ centroids.T, axis=1)]
        accuracy = (predicted == labels[~train]).mean()
        assert accuracy > 5.0 / len(classes), (key, accuracy)


def test_same_seed_same_data_other_seed_differs(
    tmp_path: Path, corpus: SyntheticCorpus, table: pa.Table
) -> None:
    kwargs = dict(num_cells=CELLS, num_genes=GENES, num_plates=PLATES, mean_nnz=150.0, write_h5ad=False)
    again = make_synthetic_corpus(tmp_path / "again", seed=11, **kwargs)
    assert again.h5ad is None
    assert pq.read_table(again.cells_parquet).equals(table)
    assert again.cells_parquet.read_bytes() == corpus.cells_parquet.read_bytes()
    assert again.genes_parquet.read_bytes() == corpus.genes_parquet.read_bytes()
    other = make_synthetic_corpus(tmp_path / "other", seed=12, **kwargs)
    other_table = pq.read_table(other.cells_parquet)
    assert not other_table.column("gene_token_id").equals(table.column("gene_token_id"))
    assert not other_table.column("drug").equals(table.column("drug"))


def test_realistic_mean_nnz(tmp_path: Path) -> None:
    corpus = make_synthetic_corpus(tmp_path, num_cells=2000, write_parquet=False, write_h5ad=False)
    assert corpus.cells_parquet is None and corpus.h5ad is None and corpus.num_genes == 62_710
    assert abs(corpus.nnz / 2000 / 1500.0 - 1.0) < 0.10


def test_multi_chunk_and_row_groups(tmp_path: Path) -> None:
    """More than one generation chunk; h5ad and parquet still agree."""
    corpus = make_synthetic_corpus(
        tmp_path, num_cells=9000, num_genes=500, mean_nnz=60.0, row_group_size=4000
    )
    table = pq.read_table(corpus.cells_parquet)
    assert pq.ParquetFile(corpus.cells_parquet).metadata.num_row_groups == 4  # 4000+4000+192 | 808
    indptr, indices, data = list_csr(table)
    backed = ad.read_h5ad(corpus.h5ad, backed="r")
    try:
        assert backed.shape == (9000, 500)
        x = backed.X[8000:8300]
        np.testing.assert_array_equal(x.indptr, indptr[8000:8301] - indptr[8000])
        np.testing.assert_array_equal(x.indices, indices[indptr[8000] : indptr[8300]])
        np.testing.assert_array_equal(x.data, data[indptr[8000] : indptr[8300]])
    finally:
        backed.file.close()


def test_anndata_reads_it(corpus: SyntheticCorpus) -> None:
    adata = ad.read_h5ad(corpus.h5ad)
    assert adata.shape == (CELLS, GENES)
    assert adata.X.format == "csr" and adata.X.dtype == np.float32
    assert adata.obs["drug"].dtype == "category" and adata.obs["n_genes"].dtype == np.int32
    assert adata.var.index[3] == "ENSG00000000003"
    assert adata.var.columns.tolist() == ["gene_token_id", "gene_name", "chromosome", "gene_type"]


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        make_synthetic_corpus(tmp_path, num_cells=3, num_plates=4)
    with pytest.raises(ValueError):
        make_synthetic_corpus(tmp_path, num_cells=0)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [str(tmp_path), "--cells", "300", "--genes", "400", "--plates", "3", "--no-h5ad", "--no-progress"]
        )
        == 0
    )
    line = capsys.readouterr().out.strip()
    assert line.startswith("cells=300 genes=400 nnz=") and "files=cells.parquet,gene_metadata.parquet" in line
    assert not (tmp_path / "cells.h5ad").exists()
    assert pq.read_table(tmp_path / "cells.parquet").num_rows == 300


# --------------------------------------------------------------------------- multimodal

MM_CELLS, MM_GENES, PEAKS, ATAC_NNZ, ATAC_FRACTION = 2500, 2000, 30_000, 600.0, 0.8
MM_ARGS = {
    "num_cells": MM_CELLS,
    "num_genes": MM_GENES,
    "seed": 5,
    "num_plates": 3,
    "mean_nnz": 150.0,
    "multimodal": True,
    "num_peaks": PEAKS,
    "atac_mean_nnz": ATAC_NNZ,
}
LAYER_NAMES = ("spliced", "unspliced", "ambiguous")


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> SyntheticCorpus:
    """2,500 cells with splice layers and ATAC (80% of the cells, shuffled), parquet + h5ad + h5mu."""
    return make_synthetic_corpus(
        tmp_path_factory.mktemp("multimodal"), atac_fraction=ATAC_FRACTION, write_h5mu=True, **MM_ARGS
    )


def to_csr(table: pa.Table, num_cols: int, ids: str = "gene_token_id", values: str = "gene_expression"):
    """The list columns of ``table`` as a scipy CSR matrix (rows in table order)."""
    import scipy.sparse as sp

    col_ids, col_values = table.column(ids).combine_chunks(), table.column(values).combine_chunks()
    np.testing.assert_array_equal(col_ids.offsets.to_numpy(), col_values.offsets.to_numpy())
    indptr = col_ids.offsets.to_numpy().astype(np.int64)
    return sp.csr_matrix(
        (col_values.flatten().to_numpy(), col_ids.flatten().to_numpy(), indptr - indptr[0]),
        shape=(table.num_rows, num_cols),
    )


def assert_sorted_rows(m) -> None:
    """Every row's column ids strictly ascending."""
    steps = np.diff(m.indices.astype(np.int64))
    inside = np.ones(steps.size, bool)
    inside[m.indptr[1:-1][(m.indptr[1:-1] > 0) & (m.indptr[1:-1] < m.nnz)] - 1] = False
    assert (steps[inside] > 0).all()


def read_mudata(path: Path):
    import mudata

    with mudata.set_options(pull_on_update=False):
        return mudata.read_h5mu(path)


def test_multimodal_files_and_schemas(multi: SyntheticCorpus) -> None:
    root = multi.genes_parquet.parent
    assert multi.layers == {name: root / f"rna_layers_{name}.parquet" for name in LAYER_NAMES}
    assert multi.atac_parquet == root / "atac_cells.parquet" and multi.peaks_parquet == root / "peaks.parquet"
    assert multi.h5mu == root / "cells.h5mu" and multi.num_peaks == PEAKS
    for path in multi.layers.values():
        schema = pq.read_schema(path)
        assert schema.names == ["cell_id", "gene_token_id", "gene_expression"]
        assert schema.field("gene_token_id").type == pa.list_(pa.int32())
        assert schema.field("gene_expression").type == pa.list_(pa.float32())
    atac = pq.read_schema(multi.atac_parquet)
    assert atac.names == ["cell_id", "peak_token_id", "peak_accessibility", "dataset"]
    assert [atac.field(n).type for n in atac.names] == [
        pa.string(),
        pa.list_(pa.int32()),
        pa.list_(pa.float32()),
        pa.string(),
    ]
    peaks = pq.read_table(multi.peaks_parquet)
    assert peaks.schema == pa.schema(
        [
            ("peak_token_id", pa.int32()),
            ("chrom", pa.string()),
            ("start", pa.int64()),
            ("end", pa.int64()),
            ("peak_name", pa.string()),
        ]
    )
    df = peaks.to_pandas()
    np.testing.assert_array_equal(df["peak_token_id"], np.arange(PEAKS))
    widths = df["end"] - df["start"]
    assert widths.min() >= 300 and widths.max() <= 1000 and df["start"].min() > 0
    chroms = list(dict.fromkeys(df["chrom"]))  # karyotype order, each chromosome one run
    assert chroms == [f"chr{i}" for i in range(1, 23)] + ["chrX", "chrY"]
    same = df["chrom"].to_numpy()[1:] == df["chrom"].to_numpy()[:-1]
    assert (df["start"].to_numpy()[1:][same] > df["end"].to_numpy()[:-1][same]).all()  # sorted, disjoint
    assert df["peak_name"].tolist()[:2] == [
        f"{c}:{s}-{e}" for c, s, e in df[["chrom", "start", "end"]].head(2).values
    ]
    assert df["peak_name"].is_unique


def test_layers_sum_to_counts(multi: SyntheticCorpus) -> None:
    cells = pq.read_table(multi.cells_parquet)
    total = to_csr(cells, MM_GENES)
    layers = {}
    for name, path in multi.layers.items():
        table = pq.read_table(path)
        assert table.column("cell_id").equals(cells.column("cell_id")), name
        m = layers[name] = to_csr(table, MM_GENES)
        assert (m.data > 0).all() and (m.data == np.round(m.data)).all(), name  # nonzeros only, integers
        assert_sorted_rows(m)
        assert (abs(total.sign()) - abs(m.sign())).min() >= 0, name  # a subset of the cell's genes
    summed = layers["spliced"] + layers["unspliced"] + layers["ambiguous"]
    assert (summed != total).nnz == 0
    shares = np.array([layers[n].sum() for n in LAYER_NAMES]) / total.sum()
    np.testing.assert_allclose(shares, [0.75, 0.20, 0.05], atol=0.01)


def test_atac_cells(multi: SyntheticCorpus) -> None:
    table = pq.read_table(multi.atac_parquet)
    ids = table.column("cell_id").to_pylist()
    assert len(set(ids)) == len(ids) and set(ids) <= {f"c{i:09d}" for i in range(MM_CELLS)}
    assert abs(len(ids) / MM_CELLS - ATAC_FRACTION) < 0.03
    assert ids != sorted(ids)  # shuffled: not the RNA order
    m = to_csr(table, PEAKS, "peak_token_id", "peak_accessibility")
    assert m.nnz == multi.atac_nnz
    assert m.indices.min() >= 0 and m.indices.max() < PEAKS
    assert_sorted_rows(m)  # ascending, unique
    lengths = np.diff(m.indptr)
    assert lengths.min() >= 200 and lengths.max() <= PEAKS // 10
    assert abs(lengths.mean() / ATAC_NNZ - 1.0) < 0.05
    assert set(np.unique(m.data).tolist()) == {1.0, 2.0, 3.0, 4.0}
    np.testing.assert_allclose([(m.data == v).mean() for v in (1, 2)], [0.80, 0.15], atol=0.01)
    popular = np.bincount(m.indices, minlength=PEAKS) / len(ids)  # skewed: a few peaks in most cells
    assert (popular > 0.5).sum() >= 20 and np.median(popular) < 0.01
    assert set(table.column("dataset").to_pylist()) == {"synthetic"}


def atac_by_cell(path: Path) -> dict[str, tuple[list[int], list[float]]]:
    table = pq.read_table(path)
    return dict(
        zip(
            table.column("cell_id").to_pylist(),
            zip(
                table.column("peak_token_id").to_pylist(),
                table.column("peak_accessibility").to_pylist(),
                strict=True,
            ),
            strict=True,
        )
    )


def test_atac_order_does_not_change_content(
    tmp_path: Path, multi: SyntheticCorpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    from materialize import _synthetic_multimodal

    shuffled = atac_by_cell(multi.atac_parquet)
    monkeypatch.setattr(_synthetic_multimodal, "ATAC_CHUNK", 300)  # other chunks than the fixture's
    args = {**MM_ARGS, "write_h5ad": False, "atac_shuffle": False}
    ordered = make_synthetic_corpus(tmp_path / "ordered", atac_fraction=ATAC_FRACTION, **args)
    in_order = atac_by_cell(ordered.atac_parquet)
    assert list(in_order) == sorted(in_order) and in_order == shuffled
    assert ordered.atac_nnz == multi.atac_nnz
    everyone = make_synthetic_corpus(tmp_path / "everyone", atac_fraction=1.0, **args)
    table = pq.read_table(everyone.atac_parquet)
    assert table.column("cell_id").equals(pq.read_table(everyone.cells_parquet).column("cell_id"))
    every = atac_by_cell(everyone.atac_parquet)
    assert all(every[cell] == value for cell, value in shuffled.items())
    assert pq.read_table(everyone.peaks_parquet).equals(pq.read_table(multi.peaks_parquet))


def test_multimodal_is_deterministic(tmp_path: Path) -> None:
    """Two RNA chunks (9,000 cells): equal arguments, equal tables; layers still sum to the counts."""
    args = {
        "num_cells": 9000,
        "num_genes": 500,
        "mean_nnz": 60.0,
        "multimodal": True,
        "num_peaks": 5000,
        "atac_mean_nnz": 300.0,
        "write_h5ad": False,
    }
    a, b = (make_synthetic_corpus(tmp_path / name, seed=2, **args) for name in ("a", "b"))
    for name in ("cells_parquet", "atac_parquet", "peaks_parquet"):
        assert pq.read_table(getattr(a, name)).equals(pq.read_table(getattr(b, name))), name
    for name in LAYER_NAMES:
        assert pq.read_table(a.layers[name]).equals(pq.read_table(b.layers[name])), name
    total = to_csr(pq.read_table(a.cells_parquet), 500)
    summed = sum(to_csr(pq.read_table(a.layers[name]), 500) for name in LAYER_NAMES)
    assert (summed != total).nnz == 0
    other = make_synthetic_corpus(tmp_path / "other", seed=3, **args)
    assert not pq.read_table(other.atac_parquet).equals(pq.read_table(a.atac_parquet))
    assert not pq.read_table(other.layers["spliced"]).equals(pq.read_table(a.layers["spliced"]))


def test_h5ad_layers(multi: SyntheticCorpus) -> None:
    adata = ad.read_h5ad(multi.h5ad)
    assert sorted(adata.layers) == sorted(LAYER_NAMES)
    assert (adata.X != to_csr(pq.read_table(multi.cells_parquet), MM_GENES)).nnz == 0
    for name, path in multi.layers.items():
        layer = adata.layers[name]
        assert layer.format == "csr" and layer.shape == (MM_CELLS, MM_GENES) and layer.dtype == np.float32
        expected = to_csr(pq.read_table(path), MM_GENES)
        np.testing.assert_array_equal(layer.indptr, expected.indptr)
        np.testing.assert_array_equal(layer.indices, expected.indices)
        np.testing.assert_array_equal(layer.data, expected.data)
    with h5py.File(multi.h5ad, "r") as f:
        assert f["layers/spliced"].attrs["encoding-type"] == "csr_matrix"
        assert f["layers/spliced"].attrs["encoding-version"] == "0.1.0"


def test_h5mu(multi: SyntheticCorpus) -> None:
    mdata = read_mudata(multi.h5mu)
    assert list(mdata.mod) == ["rna", "atac"]
    rna, atac = mdata.mod["rna"], mdata.mod["atac"]
    cells = pq.read_table(multi.cells_parquet)
    ids = np.array(cells.column("cell_id").to_pylist())
    assert mdata.obs.index.tolist() == ids.tolist()  # the union of cells, in RNA order
    assert rna.obs.index.tolist() == ids.tolist() and rna.shape == (MM_CELLS, MM_GENES)
    assert (rna.X != to_csr(cells, MM_GENES)).nnz == 0
    for name, path in multi.layers.items():
        assert (rna.layers[name] != to_csr(pq.read_table(path), MM_GENES)).nnz == 0, name
    assert rna.obs["drug"].astype(str).tolist() == cells.column("drug").to_pylist()
    assert rna.var.index[3] == "ENSG00000000003"

    table = pq.read_table(multi.atac_parquet)
    atac_ids = table.column("cell_id").to_pylist()
    assert atac.obs.index.tolist() == atac_ids and atac.shape == (len(atac_ids), PEAKS)  # the ATAC order
    assert (atac.X != to_csr(table, PEAKS, "peak_token_id", "peak_accessibility")).nnz == 0
    peaks = pq.read_table(multi.peaks_parquet).to_pandas()
    assert atac.var.index.tolist() == peaks["peak_name"].tolist()
    np.testing.assert_array_equal(atac.var["start"].to_numpy(), peaks["start"].to_numpy())

    rows = {"rna": {c: i for i, c in enumerate(ids)}, "atac": {c: i for i, c in enumerate(atac_ids)}}
    for name in ("rna", "atac"):
        obsmap = np.asarray(mdata.obsmap[name])
        assert obsmap.dtype == np.uint32
        expected = [rows[name].get(c, -1) + 1 for c in ids]  # 1-based, 0 where absent
        np.testing.assert_array_equal(obsmap, expected)
    assert 0 < (np.asarray(mdata.obsmap["atac"]) == 0).sum() < MM_CELLS
    with h5py.File(multi.h5mu, "r") as f:
        assert f.attrs["encoding-type"] == "MuData" and f.attrs["encoding-version"] == "0.1.0"
        assert f["mod/atac/X"].attrs["encoding-type"] == "csr_matrix"


def test_multimodal_edge_cases(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multimodal"):
        make_synthetic_corpus(tmp_path / "a", num_cells=100, num_genes=100, write_h5mu=True)
    for bad in ({"num_peaks": 0}, {"atac_fraction": 1.5}, {"atac_mean_nnz": 0.0}):
        with pytest.raises(ValueError):
            make_synthetic_corpus(tmp_path / "b", num_cells=100, num_genes=100, multimodal=True, **bad)
    none = make_synthetic_corpus(
        tmp_path / "c",
        num_cells=100,
        num_genes=100,
        mean_nnz=20.0,
        multimodal=True,
        num_peaks=1000,
        atac_fraction=0.0,
        write_h5ad=False,
    )
    assert none.atac_nnz == 0 and pq.read_table(none.atac_parquet).num_rows == 0
    assert pq.read_schema(none.atac_parquet).names == [
        "cell_id",
        "peak_token_id",
        "peak_accessibility",
        "dataset",
    ]
    plain = make_synthetic_corpus(tmp_path / "d", num_cells=100, num_genes=100, mean_nnz=20.0)
    assert (
        plain.layers,
        plain.atac_parquet,
        plain.peaks_parquet,
        plain.h5mu,
        plain.num_peaks,
        plain.atac_nnz,
    ) == (None, None, None, None, 0, 0)
    assert not (tmp_path / "d" / "atac_cells.parquet").exists()
    assert sorted(ad.read_h5ad(plain.h5ad).layers) == []


def test_cli_multimodal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                str(tmp_path),
                "--cells",
                "300",
                "--genes",
                "400",
                "--plates",
                "3",
                "--multimodal",
                "--peaks",
                "3000",
                "--h5mu",
                "--no-progress",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip()
    assert line.startswith("cells=300 genes=400 nnz=") and " peaks=3000 atac_nnz=" in line
    for name in (
        "rna_layers_spliced.parquet",
        "rna_layers_unspliced.parquet",
        "rna_layers_ambiguous.parquet",
        "atac_cells.parquet",
        "peaks.parquet",
        "cells.h5mu",
    ):
        assert name in line and (tmp_path / name).exists(), name
    assert pq.read_table(tmp_path / "peaks.parquet").num_rows == 3000
    assert read_mudata(tmp_path / "cells.h5mu").mod["atac"].shape[1] == 3000


def test_synth_and_index_refuse_bad_numbers_in_one_line_naming_the_flag(tmp_path, capsys):
    """A count out of range is refused by argparse in the flag's words (the model's ValueError came
    out as a traceback), before anything is written; so is a folder that is a file."""
    from materialize._cli import main as cli

    afile = tmp_path / "afile"
    afile.write_text("")
    cases = {
        ("synth", str(tmp_path / "s"), "--cells", "0"): "--cells must be at least 1, got 0",
        ("synth", str(tmp_path / "s"), "--plates", "0"): "--plates must lie in 1..--cells (20000), got 0",
        (
            "synth",
            str(tmp_path / "s"),
            "--program-fraction",
            "2",
        ): "--program-fraction must lie in [0, 1], got 2.0",
        ("synth", str(afile)): f"{afile} is a file: give a folder to write the corpus in",
        (
            "index",
            "in.parquet",
            str(tmp_path / "i"),
            "--memory-mib",
            "-5",
        ): "--memory-mib must be at least 1, got -5",
    }
    for argv, message in cases.items():
        with pytest.raises(SystemExit) as exit_:
            cli(list(argv))
        assert exit_.value.code == 2, argv
        assert capsys.readouterr().err.strip().endswith(f"error: {message}"), argv
    assert not (tmp_path / "s").exists() and not (tmp_path / "i").exists()
