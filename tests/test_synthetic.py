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
    return make_synthetic_corpus(tmp_path_factory.mktemp("synthetic"), num_cells=CELLS, num_genes=GENES,
                                 seed=11, num_plates=PLATES, mean_nnz=150.0)


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
    assert table.column_names == ["cell_id", "gene_token_id", "gene_expression", *LABELS,
                                  "n_genes", "total_counts"]
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
    assert (data <= 5).mean() > 0.7 and data.max() > 20  # mostly small counts with a tail
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


def test_same_seed_same_data_other_seed_differs(tmp_path: Path, corpus: SyntheticCorpus,
                                                table: pa.Table) -> None:
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
    corpus = make_synthetic_corpus(tmp_path, num_cells=9000, num_genes=500, mean_nnz=60.0,
                                   row_group_size=4000)
    table = pq.read_table(corpus.cells_parquet)
    assert pq.ParquetFile(corpus.cells_parquet).metadata.num_row_groups == 4  # 4000+4000+192 | 808
    indptr, indices, data = list_csr(table)
    backed = ad.read_h5ad(corpus.h5ad, backed="r")
    try:
        assert backed.shape == (9000, 500)
        x = backed.X[8000:8300]
        np.testing.assert_array_equal(x.indptr, indptr[8000:8301] - indptr[8000])
        np.testing.assert_array_equal(x.indices, indices[indptr[8000]:indptr[8300]])
        np.testing.assert_array_equal(x.data, data[indptr[8000]:indptr[8300]])
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
    assert main([str(tmp_path), "--cells", "300", "--genes", "400", "--plates", "3", "--no-h5ad",
                 "--no-progress"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("cells=300 genes=400 nnz=") and "files=cells.parquet,gene_metadata.parquet" in line
    assert not (tmp_path / "cells.h5ad").exists()
    assert pq.read_table(tmp_path / "cells.parquet").num_rows == 300
