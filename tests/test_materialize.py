"""Every input kind materializes to exactly the same cells, obs, features and ids."""

from __future__ import annotations

import contextlib
import json
import warnings

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import vortex
from conftest import assert_csr_equal, table_csr, write_legacy_h5ad

import omicsio_jax as oj
from materialize import InputOptions, Layout, materialize
from train import parse_predicate


def _all_rows(ds):
    return ds.read_csr(np.arange(ds.num_cells))


def test_parquet_round_trip_is_exact(dataset_dir, corpus_table):
    ds = oj.open_dataset(dataset_dir)
    assert ds.num_cells == corpus_table.num_rows
    assert ds.num_genes == 2000
    assert_csr_equal(_all_rows(ds), table_csr(corpus_table))
    assert ds.cell_ids.tolist() == corpus_table.column("cell_id").to_pylist()
    assert ds.manifest.nnz == sum(len(x) for x in corpus_table.column("gene_token_id").to_pylist())


def test_one_row_group_is_decoded_once_however_many_partitions_start_inside_it(
    corpus, corpus_table, dataset_dir, tmp_path, monkeypatch
):
    """A file of one row group (pyarrow's default writer) cut into shards: each partition goes on
    from the stream the one before left open instead of decoding the group from its first row, and
    the dataset is the one of the same cells in many row groups, byte for byte."""
    import materialize._tables as tables

    folder = tmp_path / "one_group"
    folder.mkdir()
    pq.write_table(corpus_table, folder / "cells.parquet")  # one row group of 3,000 rows
    pq.write_table(
        pq.read_table(corpus.cells_parquet.parent / "gene_metadata.parquet"), folder / "gene_metadata.parquet"
    )
    assert pq.ParquetFile(folder / "cells.parquet").num_row_groups == 1
    reads, decoded = [], []
    iter_batches = pq.ParquetFile.iter_batches

    def counted(self, *args, **kwargs):
        reads.append(kwargs.get("row_groups"))
        for rb in iter_batches(self, *args, **kwargs):
            decoded.append(rb.num_rows)
            yield rb

    monkeypatch.setattr(tables.pq.ParquetFile, "iter_batches", counted)
    materialize(folder, tmp_path / "out", progress=False, workers=1, layout=Layout(shard_cells=1024))
    assert len(reads) == 1 and sum(decoded) == corpus_table.num_rows  # 3 partitions, one pass
    files = {f.path: f.sha256 for f in oj.open_dataset(tmp_path / "out").manifest.files}
    assert files == {f.path: f.sha256 for f in oj.open_dataset(dataset_dir).manifest.files}


def test_a_stream_read_across_partitions_keeps_no_row_group_it_has_passed(tmp_path):
    """A process that writes consecutive partitions reads them from one open stream of the file: the
    raw bytes of the row groups it has read are let go. pyarrow's pre-buffering, its default, keeps
    them until the file is closed: the Arrow memory held would grow by a row group (~20 MB here) per
    partition."""
    from materialize._materialize import open_source

    rng = np.random.default_rng(0)
    rows, nnz = 3 * 8192, 1000  # three row groups of ~20 MB, each a partition and a read batch
    offsets = pa.array(np.arange(0, rows * nnz + 1, nnz, dtype=np.int32))
    tokens = np.cumsum(rng.integers(1, 60, (rows, nnz), dtype=np.int32), axis=1, dtype=np.int32)
    values = rng.integers(1, 20, rows * nnz).astype(np.float32)
    pq.write_table(
        pa.table(
            {
                "cell_id": [f"c{i}" for i in range(rows)],
                "gene_token_id": pa.ListArray.from_arrays(offsets, pa.array(tokens.ravel())),
                "gene_expression": pa.ListArray.from_arrays(offsets, pa.array(values)),
            }
        ),
        tmp_path / "cells.parquet",
        row_group_size=8192,
    )
    del tokens, values
    size = (tmp_path / "cells.parquet").stat().st_size
    source = open_source(tmp_path / "cells.parquet")
    held = []
    for part in source.plan(8192):
        for batch in source.batches([], part, threads=1):
            del batch
        held.append(pa.total_allocated_bytes())
    source.close()
    assert len(held) == 3
    assert source.reader_for([], source.plan(8192)[0]) == "pyarrow"
    # the stream goes on into the second partition (the third ends the file, and the stream with it)
    assert held[1] - held[0] < size / 8, (size, held)


@pytest.mark.parametrize("row_group_size", [None, 128])
def test_workers_reading_one_large_row_group_are_told_to_write_smaller_ones(
    corpus, corpus_table, tmp_path, capsys, row_group_size
):
    """Partitions on two workers, cut from one row group of 3,000 rows (pyarrow's default writer):
    each worker decodes the group from its first row, and materialize says how to avoid it; from
    row groups of 128 rows it says nothing."""
    folder = tmp_path / "groups"
    folder.mkdir()
    pq.write_table(corpus_table, folder / "cells.parquet", row_group_size=row_group_size)
    pq.write_table(
        pq.read_table(corpus.cells_parquet.parent / "gene_metadata.parquet"), folder / "gene_metadata.parquet"
    )
    materialize(folder, tmp_path / "out", progress=False, workers=2, layout=Layout(shard_cells=1024))
    notes = [line for line in capsys.readouterr().err.splitlines() if "row group" in line]
    if row_group_size is None:
        # partitions start at rows 1,024 and 2,048 of the group: 3,072 rows decoded before them
        assert notes == [
            f"materialize: {folder} holds up to 3,000 rows in a row group, several partitions of 1,024 "
            "cells; a read that starts inside a row group decodes it from its first row, so the workers "
            "decode up to 2.0× its rows and more workers add little. For a parallel conversion, write the "
            "files with row groups of at most 1,024 rows (pyarrow.parquet.write_table(table, path, "
            "row_group_size=1024))"
        ]
    else:
        assert notes == []


def test_obs_sidecars_hold_codes_and_sorted_categories(dataset_dir, corpus_table):
    ds = oj.open_dataset(dataset_dir)
    assert {"cell_type", "drug", "batch", "dataset", "tissue", "organism", "n_genes", "total_counts"} <= set(
        ds.obs
    )
    drug = ds.obs["drug"]
    assert isinstance(drug, oj.Categorical)
    assert list(drug.categories) == sorted(set(corpus_table.column("drug").to_pylist()))
    assert drug.codes.dtype == np.int32
    assert drug.labels().tolist() == corpus_table.column("drug").to_pylist()
    np.testing.assert_array_equal(ds.obs["n_genes"], corpus_table.column("n_genes").to_numpy())
    np.testing.assert_array_equal(ds.obs["total_counts"], corpus_table.column("total_counts").to_numpy())


def test_a_categorical_column_is_indexed_as_its_labels_are(dataset_dir, corpus_table):
    """A cell gives its label; a slice, a mask or rows a `Categorical` of those cells; missing is None."""
    drug = oj.open_dataset(dataset_dir).obs["drug"]
    labels = np.array(corpus_table.column("drug").to_pylist(), dtype=object)
    assert drug[3] == labels[3] and drug[-1] == labels[-1]
    rows = np.array([5, 0, 17])
    for index in (slice(10, 20), rows, drug.codes == drug.codes[0]):
        part = drug[index]
        assert isinstance(part, oj.Categorical) and part.categories == drug.categories
        assert part.labels().tolist() == labels[index].tolist()
    assert oj.Categorical(np.array([-1, 0], np.int32), ("a",))[0] is None
    assert list(drug[:4]) == labels[:4].tolist()


def test_features_and_manifest(dataset_dir, corpus):
    ds = oj.open_dataset(dataset_dir)
    genes = pq.read_table(corpus.genes_parquet).to_pandas()
    assert ds.features["ensembl_id"].tolist() == genes["ensembl_id"].tolist()
    m = ds.manifest
    assert m.layout == "sparse" and m.shard_cells == 1024
    assert [s.first_cell for s in m.shards] == [0, 1024, 2048]
    assert [s.num_cells for s in m.shards] == [1024, 1024, 952]
    assert m.array_record["group_size"] == 16
    assert len(m.fingerprint) == 64
    raw = json.loads((dataset_dir / "manifest.json").read_text())
    assert raw["format_version"] == 1 and raw["source"]["kind"] == "table"


def test_h5ad_round_trip_gives_identical_shards(corpus, dataset_dir, tmp_path):
    out = tmp_path / "from_h5ad"
    materialize(corpus.h5ad, out, progress=False, layout=Layout(shard_cells=1024))
    from_h5ad, from_parquet = oj.open_dataset(out), oj.open_dataset(dataset_dir)
    assert_csr_equal(_all_rows(from_h5ad), _all_rows(from_parquet))
    # the same cells encode to the same bytes, whatever the input format
    assert [s.sha256 for s in from_h5ad.manifest.shards] == [s.sha256 for s in from_parquet.manifest.shards]
    assert from_h5ad.cell_ids.tolist() == from_parquet.cell_ids.tolist()
    assert from_h5ad.obs["drug"].labels().tolist() == from_parquet.obs["drug"].labels().tolist()
    assert from_h5ad.features["gene_token_id"].tolist() == list(range(2000))


@pytest.mark.parametrize("fmt", ["csc", "dense"])
def test_h5ad_csc_and_dense_matrices(corpus_table, tmp_path, fmt):
    import anndata as ad
    import scipy.sparse as sp

    small = corpus_table.slice(0, 300)
    indptr, indices, values = table_csr(small)
    matrix = sp.csr_matrix((values, indices, indptr), shape=(300, 2000))
    obs = small.select(["cell_id", "drug"]).to_pandas().set_index("cell_id")
    obs["drug"] = obs["drug"].astype("category")
    adata = ad.AnnData(X=matrix.tocsc() if fmt == "csc" else matrix.toarray(), obs=obs)
    adata.layers["counts"] = adata.X.copy()
    adata.write_h5ad(tmp_path / "x.h5ad")
    out = tmp_path / "out"
    materialize(
        tmp_path / "x.h5ad",
        out,
        obs=["drug"],
        progress=False,
        read=InputOptions(layer="counts", batch_cells=128),
    )
    ds = oj.open_dataset(out)
    assert_csr_equal(_all_rows(ds), (indptr, indices, values))
    assert ds.obs["drug"].labels().tolist() == small.column("drug").to_pylist()


@pytest.mark.parametrize("use_raw", [False, True])
def test_h5ad_written_before_anndata_0_7_reads_as_anndata_reads_it(tmp_path, use_raw, capsys):
    import warnings

    import anndata as ad

    legacy, modern = tmp_path / "legacy.h5ad", tmp_path / "modern.h5ad"
    codes = write_legacy_h5ad(legacy, np.random.default_rng(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anndata's OldFormatWarning
        adata = ad.read_h5ad(legacy)
    assert adata.obs["cell_type"].cat.codes.tolist() == codes.tolist()
    adata.write_h5ad(modern)  # the same cells in today's layout
    read = InputOptions(use_raw=use_raw)
    obs = ["cell_type", "total_counts"]
    materialize(legacy, tmp_path / "a", obs=obs, read=read, progress=False)
    materialize(modern, tmp_path / "b", obs=obs, read=read, progress=False)
    a, b = oj.open_dataset(tmp_path / "a"), oj.open_dataset(tmp_path / "b")
    assert a.num_genes == (45 if use_raw else 30)
    assert_csr_equal(_all_rows(a), _all_rows(b))
    assert a.cell_ids.tolist() == b.cell_ids.tolist() == [f"cell-{i}" for i in range(120)]
    assert a.obs["cell_type"].labels().tolist() == b.obs["cell_type"].labels().tolist()
    assert a.obs["cell_type"].labels().tolist() == [["B", "NK", "T"][c] for c in codes]
    np.testing.assert_array_equal(a.obs["total_counts"], b.obs["total_counts"])
    assert a.features.equals(b.features)
    assert a.features["ensembl_id"].iloc[0].startswith("ENSG")
    # what the values are: raw/X counts, X normalized (and materialize says where the counts are)
    assert a.manifest.values == b.manifest.values == ("counts" if use_raw else "nonnegative")
    noted = "looks normalized (non-integer values) while raw.X holds integer counts; pass --raw"
    assert (noted in capsys.readouterr().err) is not use_raw


def _write_store(adata, path, store: str):
    """``adata`` written as an ``.h5ad`` file or a zarr v3 store (``store``), and anndata's reading of it."""
    import anndata as ad

    if store == "zarr":
        return _write_zarr(adata, path, 3)
    adata.write_h5ad(path)
    return ad.read_h5ad(path)


def _write_zarr(adata, path, zarr_format: int):
    """``adata`` written as a zarr store of ``zarr_format`` (2 or 3), and anndata's reading of it."""
    import anndata as ad

    before = ad.settings.zarr_write_format
    ad.settings.zarr_write_format = zarr_format
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Writing zarr v2 data", UserWarning)  # v2: on purpose
            warnings.filterwarnings("ignore", "zarr v3 autosharding", UserWarning)  # the default, as is
            warnings.filterwarnings("ignore", "Consolidated metadata", UserWarning)  # anndata writes it
            adata.write_zarr(path)
            return ad.read_zarr(path)
    finally:
        ad.settings.zarr_write_format = before


@pytest.mark.parametrize("store", ["h5ad", "zarr"])
def test_anndata_text_beyond_ascii_reads_as_anndata_reads_it(tmp_path, store):
    """Cell ids, string and categorical obs columns (a nullable one with a missing value), the var
    index and a var column of text beyond ASCII: what anndata reads, whatever the store."""
    import anndata as ad
    import scipy.sparse as sp

    x = sp.csr_matrix(np.array([[1, 0, 2], [0, 3, 0], [4, 0, 0]], np.float32))
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(["β-Zelle", "T", "β-Zelle"]),
            "note": ["é", "細胞", ""],
            "site": pd.array(["Zürich", None, "Genève"], dtype="string"),
        },
        index=["zellé-1", "細胞-2", "c3"],
    )
    var = pd.DataFrame({"feature_name": ["Gène", "ÄB", "γ"]}, index=[f"ENSG0000000000{i}" for i in range(3)])
    path = tmp_path / f"text.{store}"
    back = _write_store(ad.AnnData(X=x, obs=obs, var=var), path, store)
    materialize(path, tmp_path / "out", obs=["cell_type", "note", "site"], progress=False)
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.cell_ids.tolist() == back.obs_names.tolist() == ["zellé-1", "細胞-2", "c3"]
    assert ds.obs["cell_type"].labels().tolist() == back.obs["cell_type"].tolist()
    assert ds.obs["note"].labels().tolist() == back.obs["note"].tolist() == ["é", "細胞", ""]
    assert ds.obs["site"].labels().tolist() == ["Zürich", None, "Genève"]  # the missing value: no label
    assert ds.features["feature_name"].tolist() == back.var["feature_name"].tolist()
    assert_csr_equal(_all_rows(ds), (x.indptr, x.indices, x.data))


@pytest.mark.parametrize("store", ["h5ad", "zarr"])
def test_indexes_of_pandas_string_dtype_read_as_anndata_reads_them(tmp_path, store):
    """Obs and var indexes of pandas' ``string`` dtype (pandas 3's default for text), which anndata
    writes as ``nullable-string-array`` groups, not arrays: the cell ids and genes anndata reads."""
    import anndata as ad
    import scipy.sparse as sp

    x = sp.csr_matrix(np.array([[1, 0, 2], [0, 3, 0]], np.float32))
    obs = pd.DataFrame(index=pd.Index(["zellé-1", "c2"], dtype="string"))
    var = pd.DataFrame(index=pd.Index([f"ENSG0000000000{i}" for i in range(3)], dtype="string"))
    path = tmp_path / f"strings.{store}"
    with ad.settings.override(allow_write_nullable_strings=True):
        back = _write_store(ad.AnnData(X=x, obs=obs, var=var), path, store)
    materialize(path, tmp_path / "out", progress=False)
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.cell_ids.tolist() == back.obs_names.tolist() == ["zellé-1", "c2"]
    assert ds.features["ensembl_id"].tolist() == back.var_names.tolist()
    assert_csr_equal(_all_rows(ds), (x.indptr, x.indices, x.data))


def test_h5ad_genes_named_by_their_symbols_and_found_by_id_with_or_without_version(tmp_path):
    """CELLxGENE's var: versioned Ensembl ids in the index, symbols in ``feature_name``; a 10x-style var:
    symbols in the index, ids in ``gene_ids``. Either way ``gene_name`` holds the symbols, and a panel
    names its genes by symbol or by Ensembl id with any version or none."""
    import anndata as ad
    import scipy.sparse as sp

    x = sp.csr_matrix(np.array([[1, 0, 2], [0, 3, 0]], np.float32))
    ids, symbols = [f"ENSG0000000000{i}.{i + 4}" for i in range(3)], ["CD3E", "MS4A1", "NKG7"]
    layouts = {
        "cellxgene": pd.DataFrame({"feature_name": pd.Categorical(symbols)}, index=ids),
        "10x": pd.DataFrame({"gene_ids": ids}, index=symbols),
    }
    for name, var in layouts.items():
        ad.AnnData(X=x, var=var).write_h5ad(tmp_path / f"{name}.h5ad")
        materialize(tmp_path / f"{name}.h5ad", tmp_path / name, progress=False)
        ds = oj.open_dataset(tmp_path / name)
        assert ds.features["gene_name"].tolist() == symbols, name
        assert ds.features["ensembl_id"].tolist() == ids, name
        wanted = ["NKG7", "ENSG00000000000", "ENSG00000000001.5", "ensg00000000002.9", 1]
        assert ds.gene_columns(wanted).tolist() == [2, 0, 1, 2, 1], name
        with pytest.raises(oj.OmicsIOError, match="1 panel gene.*: cd3e"):
            ds.gene_columns(["cd3e"])  # symbols match as written


def test_a_bool_obs_column_selects_its_rows_by_true_or_false(tmp_path):
    """CELLxGENE's ``is_primary_data``: stored as the categories "false" / "true" (a cell of a
    collection's source without the column has none), selected by ``True`` / ``False`` as the
    presence flags ``has_<modality>`` are."""
    import anndata as ad
    import scipy.sparse as sp

    primary = np.array([True, False, True, True, False])
    obs = pd.DataFrame({"is_primary_data": primary}, index=[f"c{i}" for i in range(5)])
    x = sp.csr_matrix(np.eye(5, 3, dtype=np.float32))
    ad.AnnData(X=x, obs=obs).write_h5ad(tmp_path / "p.h5ad")
    materialize(tmp_path / "p.h5ad", tmp_path / "p", progress=False)
    ds = oj.open_dataset(tmp_path / "p")
    assert ds.obs["is_primary_data"].categories == ("false", "true")
    np.testing.assert_array_equal(ds.rows_where("is_primary_data", [True]), np.flatnonzero(primary))
    np.testing.assert_array_equal(ds.rows_where("is_primary_data", [np.False_]), np.flatnonzero(~primary))
    np.testing.assert_array_equal(ds.rows_where("is_primary_data", ["true"]), np.flatnonzero(primary))
    with pytest.raises(KeyError, match="not among the categories"):
        ds.rows_where("is_primary_data", [1])
    # a held-out set by predicate (`omicsio-train --eval-where`) names the column's values as bools
    held_out = parse_predicate("is_primary_data = FALSE").rows(ds)
    np.testing.assert_array_equal(held_out, np.flatnonzero(~primary))


def test_anndata_strings_become_arrow_strings_as_decoding_each_would_make_them():
    """`_text_array`: h5py's variable-length (bytes objects) and fixed-length strings, zarr's str
    values and an empty array, as decoding each value would give them; bytes that are not UTF-8
    raise the decoder's error, as decoding them one by one did."""
    from materialize._anndata_elements import _text_array

    words = ["", "cell", "Zürich", "細胞", "β"]
    for values in (
        np.array([w.encode() for w in words], object),
        np.array([w.encode() for w in words]),  # fixed length: trailing NULs are padding
        np.array(words, object),
        np.array(words),
        np.array([], object),
    ):
        array = _text_array(values)
        assert array.type == pa.string() and array.to_pylist() == words[: len(values)]
    with pytest.raises(UnicodeDecodeError):
        _text_array(np.array([b"ok", b"\xff\xfe"], object))


def test_token_outputs_refuse_values_that_are_not_counts_unless_allowed(tmp_path):
    legacy = tmp_path / "legacy.h5ad"
    write_legacy_h5ad(legacy, np.random.default_rng(0))
    materialize(legacy, tmp_path / "x", progress=False)  # X: log1p values
    ds = oj.open_dataset(tmp_path / "x")
    for output in (oj.GeneformerTokens(max_len=16), oj.ScGPTTokens(max_len=16)):
        name = type(output).__name__
        with pytest.raises(
            oj.OmicsIOError, match=rf"holds nonnegative values, not counts .*{name}\(allow_non_counts=True\)"
        ) as caught:
            oj.make_loader(ds, batch_size=8, output=output)
        assert "\n" not in str(caught.value)
    allowed = oj.make_loader(ds, batch_size=8, output=oj.ScGPTTokens(max_len=16, allow_non_counts=True))
    assert np.asarray(next(iter(allowed)).x["gene_ids"]).shape == (8, 16)


def test_h5ad_unsorted_csr_indices_are_sorted(tmp_path):
    import anndata as ad
    import scipy.sparse as sp

    matrix = sp.csr_matrix(
        (np.array([5.0, 1.0, 2.0], np.float32), np.array([3, 0, 2]), np.array([0, 3])), shape=(1, 4)
    )
    assert not matrix.has_sorted_indices
    ad.AnnData(X=matrix).write_h5ad(tmp_path / "u.h5ad")
    materialize(tmp_path / "u.h5ad", tmp_path / "out", progress=False)
    assert_csr_equal(oj.open_dataset(tmp_path / "out").read_csr([0]), ([0, 3], [0, 2, 3], [1.0, 2.0, 5.0]))


def test_vortex_round_trip(corpus, corpus_table, tmp_path):
    path = tmp_path / "cells.vortex"
    vortex.io.write(corpus_table.slice(0, 500), str(path))
    out = tmp_path / "out"
    materialize(path, out, progress=False, read=InputOptions(genes=corpus.genes_parquet))
    ds = oj.open_dataset(out)
    assert_csr_equal(_all_rows(ds), table_csr(corpus_table.slice(0, 500)))
    assert (
        ds.num_genes == 2000
        and ds.obs["drug"].labels().tolist() == corpus_table.column("drug").to_pylist()[:500]
    )


def test_where_and_query_select_the_same_subset(corpus, corpus_table, tmp_path):
    keep = pc.equal(corpus_table.column("batch"), "plate_01")
    expected = corpus_table.filter(keep)
    materialize(
        corpus.cells_parquet, tmp_path / "w", progress=False, read=InputOptions(where="batch = 'plate_01'")
    )
    sql = f"SELECT * FROM read_parquet('{corpus.cells_parquet}') WHERE batch = 'plate_01'"
    materialize(
        None, tmp_path / "q", progress=False, read=InputOptions(query=sql, genes=corpus.genes_parquet)
    )
    for out in ("w", "q"):
        ds = oj.open_dataset(tmp_path / out)
        assert_csr_equal(_all_rows(ds), table_csr(expected))
        assert ds.cell_ids.tolist() == expected.column("cell_id").to_pylist()
        assert ds.num_genes == 2000


def test_query_over_the_cells_view(corpus, corpus_table, tmp_path):
    sql = "SELECT cell_id, gene_token_id, gene_expression, drug FROM cells WHERE n_genes > 150"
    materialize(corpus.cells_parquet, tmp_path / "q", progress=False, read=InputOptions(query=sql))
    ds = oj.open_dataset(tmp_path / "q")
    expected = corpus_table.filter(pc.greater(corpus_table.column("n_genes"), 150))
    assert_csr_equal(_all_rows(ds), table_csr(expected))
    assert set(ds.obs) == {"drug", "n_counts", "n_genes"}


def test_int64_float64_large_list_inputs_are_converted(corpus_table, corpus, tmp_path):
    small = corpus_table.slice(0, 200)
    wide = small.set_column(1, "gene_token_id", small.column("gene_token_id").cast(pa.large_list(pa.int64())))
    wide = wide.set_column(
        2, "gene_expression", wide.column("gene_expression").cast(pa.large_list(pa.float64()))
    )
    pq.write_table(wide, tmp_path / "wide.parquet")
    materialize(
        tmp_path / "wide.parquet",
        tmp_path / "out",
        progress=False,
        read=InputOptions(genes=corpus.genes_parquet),
    )
    assert_csr_equal(_all_rows(oj.open_dataset(tmp_path / "out")), table_csr(small))


def test_hive_partitions_glob_and_directory(corpus, corpus_table, tmp_path):
    root = tmp_path / "atlas"
    con = duckdb.connect()
    con.register("t", corpus_table)
    con.execute(
        f"COPY (SELECT * EXCLUDE (tissue, dataset), 'lung' AS tissue, 'ds' || (batch = 'plate_00')::INT "
        f"AS dataset FROM t) TO '{root}' (FORMAT parquet, PARTITION_BY (dataset, tissue))"
    )
    pq.write_table(pq.read_table(corpus.genes_parquet), root / "gene_metadata.parquet")
    materialize(str(root / "dataset=*" / "**" / "*.parquet"), tmp_path / "glob", progress=False)
    materialize(root, tmp_path / "dir", progress=False, read=InputOptions(where="dataset = 'ds1'"))
    by_glob, by_dir = oj.open_dataset(tmp_path / "glob"), oj.open_dataset(tmp_path / "dir")
    assert (
        by_glob.num_cells == corpus_table.num_rows and by_glob.num_genes == 2000
    )  # found gene_metadata.parquet
    assert set(by_glob.obs["dataset"].categories) == {"ds0", "ds1"}
    assert set(by_dir.obs["dataset"].categories) == {"ds1"}
    # every cell keeps its exact row, whatever the file order
    order = np.argsort(by_glob.cell_ids)
    ref_order = np.argsort(corpus_table.column("cell_id").to_numpy(zero_copy_only=False))
    got = by_glob.read_csr(order)
    assert_csr_equal(got, table_csr(corpus_table.take(pa.array(ref_order))))


def test_null_lists_mean_no_expressed_genes(tmp_path):
    table = pa.table(
        {
            "cell_id": ["a", "b", "c"],
            "gene_token_id": pa.array([[0, 2], None, [1]], pa.list_(pa.int32())),
            "gene_expression": pa.array([[1.0, 2.0], None, [3.0]], pa.list_(pa.float32())),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    materialize(tmp_path / "t.parquet", tmp_path / "out", progress=False)
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.num_genes == 3  # no gene table: the token ids seen in the data
    assert_csr_equal(_all_rows(ds), ([0, 2, 2, 3], [0, 2, 1], [1.0, 2.0, 3.0]))


def test_opening_a_plain_parquet_input_asks_duckdb_for_its_columns_once(tmp_path):
    """Opening a source of a collection is on materialize's serial path, once per source: its cells
    are counted from the files' footers and its columns asked of DuckDB once, unless a filter needs
    a query of its own (then checked, and its cells counted, by DuckDB)."""
    from materialize._materialize import open_source
    from omicsio_jax.format import connect

    class Recording:  # a DuckDB connection that keeps the SQL it is given
        def __init__(self, con):
            self.con, self.queries = con, []

        def sql(self, query, *args, **kwargs):
            self.queries.append(query)
            return self.con.sql(query, *args, **kwargs)

        def execute(self, query, *args, **kwargs):
            self.queries.append(query)
            return self.con.execute(query, *args, **kwargs)

        def close(self):
            self.con.close()

    lists = {
        "gene_token_id": pa.array([[0, 2], [1], [0, 1, 2]] * 2, pa.list_(pa.int32())),
        "gene_expression": pa.array([[1.0, 2.0], [3.0], [4.0, 5.0, 6.0]] * 2, pa.list_(pa.float32())),
    }
    for k in range(2):
        pq.write_table(
            pa.table({"cell_id": [f"{k}_{i}" for i in range(6)], **lists}), tmp_path / f"{k}.parquet"
        )
    plain = Recording(connect())
    source = open_source(str(tmp_path / "*.parquet"), con=plain)
    assert source.num_cells == 12
    assert sum("LIMIT 0" in q for q in plain.queries) == 1
    assert not any("count(" in q.lower() for q in plain.queries)
    filtered = Recording(connect())
    source = open_source(str(tmp_path / "*.parquet"), where="cell_id LIKE '1_%'", con=filtered)
    assert source.num_cells == 6
    assert sum("LIMIT 0" in q for q in filtered.queries) == 2
    with pytest.raises(oj.DataValidationError, match="no_such_column"):
        open_source(str(tmp_path / "*.parquet"), where="no_such_column > 1", con=connect())


def test_parquet_files_are_read_in_batches_by_their_row_width(tmp_path):
    """A plain parquet file is decoded about 4M values at a time by default (cells in powers of two,
    256 to 8,192, from its footer's count of values): wide rows in small batches, narrow ones in
    large; an explicit ``batch_cells`` wins, and the dataset's bytes do not depend on the batches."""
    from materialize._materialize import open_source
    from materialize._parquet_stream import cells_per_batch

    rng = np.random.default_rng(0)

    def write(path, rows, width):
        flat = pa.array(np.tile(np.arange(width, dtype=np.int32), rows))
        offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
        table = pa.table(
            {
                "cell_id": [f"c{i}" for i in range(rows)],
                "gene_token_id": pa.ListArray.from_arrays(offsets, flat),
                "gene_expression": pa.ListArray.from_arrays(
                    offsets, pa.array(rng.integers(1, 9, rows * width).astype(np.float32))
                ),
            }
        )
        pq.write_table(table, path, row_group_size=rows // 2)
        return path

    wide, narrow = write(tmp_path / "wide.parquet", 1200, 5000), write(tmp_path / "narrow.parquet", 600, 3)
    assert cells_per_batch(pq.read_metadata(wide), "gene_token_id") == 512  # 2 * 512 * 5,000 > 4M
    assert cells_per_batch(pq.read_metadata(narrow), "gene_token_id") == 8192
    assert cells_per_batch(pq.read_metadata(wide), "no_such_list") == 8192
    sizes = [b.num_cells for b in open_source(str(wide)).batches([])]
    assert sizes == [512, 512, 176]
    assert [b.num_cells for b in open_source(str(wide), batch_cells=100).batches([])] == [100] * 12
    by_width = materialize(wide, tmp_path / "by_width", progress=False, workers=1)
    fixed = materialize(
        wide, tmp_path / "fixed", progress=False, workers=1, read=InputOptions(batch_cells=8192)
    )
    assert [s.sha256 for s in by_width.manifest.shards] == [s.sha256 for s in fixed.manifest.shards]


def test_non_contiguous_gene_tokens_map_to_columns(tmp_path):
    genes = pa.table({"gene_token_id": pa.array([30, 10, 20], pa.int32()), "gene_name": ["C", "A", "B"]})
    cells = pa.table(
        {
            "cell_id": ["x"],
            "gene_token_id": pa.array([[10, 30]], pa.list_(pa.int32())),
            "gene_expression": pa.array([[1.0, 2.0]], pa.list_(pa.float32())),
        }
    )
    pq.write_table(genes, tmp_path / "g.parquet")
    pq.write_table(cells, tmp_path / "c.parquet")
    materialize(
        tmp_path / "c.parquet",
        tmp_path / "out",
        progress=False,
        read=InputOptions(genes=tmp_path / "g.parquet"),
    )
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.features["gene_name"].tolist() == ["A", "B", "C"]
    assert_csr_equal(ds.read_csr([0]), ([0, 2], [0, 2], [1.0, 2.0]))


def test_dense_panel_layout(corpus, corpus_table, tmp_path):
    genes = pq.read_table(corpus.genes_parquet)
    panel = [genes.column("ensembl_id")[7].as_py(), genes.column("gene_name")[3].as_py(), "1500", "0"]
    (tmp_path / "panel.txt").write_text("# my panel\n" + "\n".join(panel) + "\n")
    materialize(
        corpus.cells_parquet, tmp_path / "out", progress=False, layout=Layout(panel=tmp_path / "panel.txt")
    )
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.layout == "dense" and ds.num_genes == 4
    assert ds.features["gene_token_id"].tolist() == [7, 3, 1500, 0]
    indptr, indices, values = table_csr(corpus_table)
    dense = np.zeros((corpus_table.num_rows, 2000), np.float32)
    dense[np.repeat(np.arange(corpus_table.num_rows), np.diff(indptr)), indices] = values
    expected = dense[:, [7, 3, 1500, 0]]
    got_ptr, got_idx, got_val = _all_rows(ds)
    rebuilt = np.zeros_like(expected)
    rebuilt[np.repeat(np.arange(len(got_ptr) - 1), np.diff(got_ptr)), got_idx] = got_val
    np.testing.assert_array_equal(rebuilt, expected)


def test_constant_memory_batches_shard_boundaries_are_powers_of_two(corpus, tmp_path):
    result = materialize(
        corpus.cells_parquet,
        tmp_path / "out",
        progress=False,
        read=InputOptions(batch_cells=300),
        layout=Layout(shard_cells=512, group_size=32),
    )
    shards = result.manifest.shards
    assert all(s.first_cell % 512 == 0 for s in shards)
    assert all(s.num_cells == 512 for s in shards[:-1])
    assert result.manifest.array_record["writer_options"] == "group_size:32,zstd:-1"
    assert "cells/s" in result.summary()


def test_h5ad_raw_matrix_and_var(corpus_table, tmp_path):
    import anndata as ad
    import pandas as pd
    import scipy.sparse as sp

    small = corpus_table.slice(0, 50)
    indptr, indices, values = table_csr(small)
    counts = sp.csr_matrix((values, indices, indptr), shape=(50, 2000))
    var = pd.DataFrame(index=[f"ENSG{i:011d}" for i in range(2000)])
    var["gene_symbols"] = [f"SYM{i}" for i in range(2000)]
    adata = ad.AnnData(X=counts, var=var)
    adata.raw = adata
    panel_var = var.iloc[:10].copy()
    adata = ad.AnnData(
        X=np.log1p(counts[:, :10].toarray()), var=panel_var, raw=adata.raw
    )  # X is a processed subset
    adata.write_h5ad(tmp_path / "r.h5ad")
    materialize(tmp_path / "r.h5ad", tmp_path / "out", progress=False, read=InputOptions(use_raw=True))
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.num_genes == 2000
    assert ds.features["ensembl_id"].tolist()[:2] == ["ENSG00000000000", "ENSG00000000001"]
    assert ds.features["gene_symbols"].tolist()[1] == "SYM1"
    assert_csr_equal(_all_rows(ds), (indptr, indices, values))


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_anndata_zarr_stores_read_as_anndata_reads_them(corpus_table, tmp_path, zarr_format):
    import anndata as ad
    import scipy.sparse as sp

    small = corpus_table.slice(0, 300)
    indptr, indices, values = table_csr(small)
    obs = small.select(["cell_id", "drug", "total_counts"]).to_pandas().set_index("cell_id")
    obs["drug"] = obs["drug"].astype("category")
    var = pd.DataFrame(
        {"gene_ids": [f"ENSG{i:011d}" for i in range(2000)]}, index=[f"G{i}" for i in range(2000)]
    )
    adata = ad.AnnData(X=sp.csr_matrix((values, indices, indptr), shape=(300, 2000)), obs=obs, var=var)
    back = _write_zarr(adata, tmp_path / "x.zarr", zarr_format)
    adata.write_h5ad(tmp_path / "x.h5ad")
    materialize(tmp_path / "x.zarr", tmp_path / "z", progress=False, read=InputOptions(batch_cells=128))
    materialize(tmp_path / "x.h5ad", tmp_path / "h", progress=False, read=InputOptions(batch_cells=128))
    z, h = oj.open_dataset(tmp_path / "z"), oj.open_dataset(tmp_path / "h")
    assert_csr_equal(_all_rows(z), (back.X.indptr, back.X.indices, back.X.data))
    assert [s.sha256 for s in z.manifest.shards] == [s.sha256 for s in h.manifest.shards]
    assert z.cell_ids.tolist() == list(back.obs_names)
    assert z.obs["drug"].labels().tolist() == back.obs["drug"].tolist()
    np.testing.assert_array_equal(z.obs["total_counts"], back.obs["total_counts"].to_numpy())
    assert z.features["ensembl_id"].tolist() == list(back.var["gene_ids"])
    assert z.manifest.source["kind"] == "h5ad" and z.manifest.source["input"].endswith("x.zarr")


def test_a_matrix_in_an_encoding_not_read_is_a_one_line_error(tmp_path):
    import anndata as ad
    import h5py

    adata = ad.AnnData(X=np.ones((3, 2), np.float32), obs=pd.DataFrame(index=["a", "b", "c"]))
    adata.write_h5ad(tmp_path / "x.h5ad")
    with h5py.File(tmp_path / "x.h5ad", "r+") as f:
        del f["X"]
        group = f.create_group("X")
        group.attrs["encoding-type"], group.attrs["shape"] = "coo_matrix", (3, 2)
    with pytest.raises(
        oj.DataValidationError, match=r"x.h5ad: matrix /X has encoding 'coo_matrix', .*rewrite it"
    ) as e:
        materialize(tmp_path / "x.h5ad", tmp_path / "out", progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
    with h5py.File(tmp_path / "x.h5ad", "r+") as f:  # a group no writer marked (was "encoding 'dict'")
        del f["X"].attrs["encoding-type"]
    with pytest.raises(oj.DataValidationError, match=r"matrix /X is a group without an encoding-type"):
        materialize(tmp_path / "x.h5ad", tmp_path / "out", progress=False)


def _write_anndata_0_7(path, x, obs: pd.DataFrame, var: pd.DataFrame) -> None:
    """An AnnData as anndata 0.7 wrote it (dataframe ``encoding-version`` 0.1.0, `.h5ad` or zarr v2):
    a categorical column is its integer codes (-1: missing) whose attribute ``categories`` points at
    ``__categories/<column>`` (an HDF5 object reference, in zarr its path); strings are arrays with
    no encoding."""
    import h5py
    import zarr

    def put(group, name, values):
        values = np.asarray(values)
        if isinstance(group, h5py.Group):
            text = h5py.special_dtype(vlen=str) if values.dtype.kind in "OU" else None
            return group.create_dataset(name, data=values.astype(object) if text else values, dtype=text)
        return group.create_array(name, data=values.astype(str) if values.dtype.kind == "O" else values)

    def frame(group, df):
        group.attrs.update({"encoding-type": "dataframe", "encoding-version": "0.1.0", "_index": "_index"})
        group.attrs["column-order"] = list(df.columns)
        put(group, "_index", df.index.to_numpy(str))
        for name, column in df.items():
            if isinstance(column.dtype, pd.CategoricalDtype):
                categories = put(group, f"__categories/{name}", column.cat.categories.to_numpy())
                codes = put(group, name, column.cat.codes.to_numpy())
                h5 = isinstance(group, h5py.Group)
                codes.attrs["categories"] = categories.ref if h5 else f"__categories/{name}"
            else:
                put(group, name, column.to_numpy())

    with h5py.File(path, "w") if str(path).endswith(".h5ad") else contextlib.nullcontext() as root:
        root = zarr.open_group(str(path), mode="w", zarr_format=2) if root is None else root
        root.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
        matrix = root.create_group("X")
        matrix.attrs.update({"encoding-type": "csr_matrix", "encoding-version": "0.1.0"})
        matrix.attrs["shape"] = list(x.shape)
        for name in ("data", "indices", "indptr"):
            put(matrix, name, getattr(x, name))
        frame(root.create_group("obs"), obs)
        frame(root.create_group("var"), var)
        for name in ("uns", "obsm", "varm", "layers"):
            root.create_group(name)


@pytest.mark.parametrize("store", ["h5ad", "zarr"])
def test_anndata_0_7_categoricals_read_as_anndata_reads_them(tmp_path, store):
    """anndata 0.7's categoricals (codes and a reference to their categories): obs labels with -1
    as missing, bool categories as a bool column's, and var's symbols naming the genes, as anndata
    reads them."""
    import anndata as ad
    import scipy.sparse as sp

    x = sp.csr_matrix(np.array([[1, 0, 2], [0, 3, 0], [4, 0, 0], [0, 0, 5]], np.float32))
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(["T", None, "B", "T"]),
            "is_primary": pd.Categorical([True, False, False, True]),
            "note": ["a", "b", "c", "é"],  # all different: 0.7 kept them as strings
            "score": [0.5, 1.5, 2.0, 3.0],
        },
        index=[f"c{i}" for i in range(4)],
    )
    var = pd.DataFrame(
        {"feature_name": pd.Categorical(["NKG7", "MS4A1", "CD3E"])},  # codes 2, 1, 0
        index=[f"ENSG{i:011d}" for i in range(3)],
    )
    path = tmp_path / f"old.{store}"
    _write_anndata_0_7(path, x, obs, var)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ad.OldFormatWarning)  # the old layout, on purpose
        back = ad.read_h5ad(path) if store == "h5ad" else ad.read_zarr(path)
    assert back.obs["cell_type"].tolist()[:2] == ["T", np.nan]
    materialize(path, tmp_path / "out", progress=False)
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.cell_ids.tolist() == back.obs_names.tolist()
    assert (
        ds.obs["cell_type"].labels().tolist()
        == back.obs["cell_type"].astype(object).where(back.obs["cell_type"].notna(), None).tolist()
    )
    assert ds.obs["is_primary"].categories == ("false", "true")
    np.testing.assert_array_equal(
        ds.rows_where("is_primary", [True]), np.flatnonzero(back.obs["is_primary"].astype(bool))
    )
    assert ds.obs["note"].labels().tolist() == back.obs["note"].tolist()
    np.testing.assert_array_equal(ds.obs["score"], back.obs["score"].to_numpy())
    assert ds.features["gene_name"].tolist() == back.var["feature_name"].tolist()
    assert ds.features["ensembl_id"].tolist() == back.var_names.tolist()
    assert_csr_equal(_all_rows(ds), (back.X.indptr, back.X.indices, back.X.data))


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_csc_matrix_in_a_zarr_store_reads_as_anndata_reads_it(tmp_path, zarr_format):
    import anndata as ad
    import scipy.sparse as sp

    x = sp.random(20, 5, density=0.5, format="csc", random_state=0, dtype=np.float32)
    x.data = np.ceil(x.data * 9)
    back = _write_zarr(ad.AnnData(X=x), tmp_path / "x.zarr", zarr_format)
    assert sp.issparse(back.X) and back.X.format == "csc"
    materialize(tmp_path / "x.zarr", tmp_path / "out", progress=False, read=InputOptions(batch_cells=8))
    expected = back.X.tocsr()
    assert_csr_equal(
        _all_rows(oj.open_dataset(tmp_path / "out")), (expected.indptr, expected.indices, expected.data)
    )


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_raw_asked_of_a_zarr_store_without_one_says_it_has_none(tmp_path, zarr_format):
    """anndata writes an empty raw group into a zarr store of an AnnData without .raw."""
    import anndata as ad
    import scipy.sparse as sp

    x = sp.random(20, 5, density=0.5, format="csr", random_state=0, dtype=np.float32)
    _write_zarr(ad.AnnData(X=x), tmp_path / "x.zarr", zarr_format)
    with pytest.raises(oj.DataValidationError, match=r"x.zarr has no .raw: leave out --raw"):
        materialize(tmp_path / "x.zarr", tmp_path / "out", progress=False, read=InputOptions(use_raw=True))
    assert not (tmp_path / "out").exists()


def test_a_file_of_no_genes_gives_its_cells_whatever_the_matrix_format(tmp_path):
    import anndata as ad
    import scipy.sparse as sp

    obs = pd.DataFrame(index=[f"c{i}" for i in range(20)])
    matrices = {
        "csr": sp.csr_matrix((20, 0), dtype=np.float32),
        "csc": sp.csc_matrix((20, 0), dtype=np.float32),
        "dense": np.zeros((20, 0), np.float32),
    }
    shards = {}
    for fmt, x in matrices.items():
        ad.AnnData(X=x, obs=obs).write_h5ad(tmp_path / f"{fmt}.h5ad")
        back = ad.read_h5ad(tmp_path / f"{fmt}.h5ad")
        materialize(tmp_path / f"{fmt}.h5ad", tmp_path / fmt, progress=False)
        ds = oj.open_dataset(tmp_path / fmt)
        assert (ds.num_cells, ds.num_genes) == back.shape == (20, 0), fmt
        assert ds.cell_ids.tolist() == back.obs_names.tolist(), fmt
        assert_csr_equal(_all_rows(ds), (np.zeros(21), [], []))
        shards[fmt] = [s.sha256 for s in ds.manifest.shards]
    assert shards["csc"] == shards["csr"] == shards["dense"]


def _csc_and_csr_files(tmp_path, rows=50, genes=9):
    """The same matrix written as a CSR and a CSC ``.h5ad`` (a column longer than a few chunks)."""
    import anndata as ad
    import scipy.sparse as sp

    rng = np.random.default_rng(5)
    x = (rng.random((rows, genes)) < 0.4) * rng.integers(1, 9, (rows, genes)).astype(np.float32)
    x[:, 4] = rng.integers(1, 9, rows)
    obs = pd.DataFrame({"plate": [f"p{i % 3}" for i in range(rows)]}, index=[f"c{i}" for i in range(rows)])
    var = pd.DataFrame(index=[f"G{g}" for g in range(genes)])  # symbols (numbers would name no gene)
    for fmt, matrix in {"csr": sp.csr_matrix(x), "csc": sp.csc_matrix(x)}.items():
        ad.AnnData(X=matrix, obs=obs, var=var).write_h5ad(tmp_path / f"{fmt}.h5ad")
    return sp.csr_matrix(x)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_csc_matrix_is_regrouped_by_row_once_in_bounded_memory(tmp_path, monkeypatch, capsys, workers):
    """A CSC X of more cells than a batch is regrouped by row in two passes over its entries, read
    a bounded number at a time (chunks of 7 cut columns anywhere), not once per batch of rows (a
    conversion's time grew with the square of the cells); the records are those of the same matrix
    stored by row, on worker processes too (partitions of 16 cells, batches of 16, blocks of 16:
    the last one short)."""
    import materialize._csc_rows as csc_rows
    from materialize._h5ad import H5adSource

    expected = _csc_and_csr_files(tmp_path)
    monkeypatch.setattr(csc_rows, "CHUNK_ENTRIES", 7)
    monkeypatch.setattr(H5adSource, "_read_csc_rows", None)  # a batch read of the matrix by column fails
    reads = []
    regroup = csc_rows.regroup
    monkeypatch.setattr("materialize._h5ad.regroup", lambda *a, **k: reads.append(a[2]) or regroup(*a, **k))
    shards = {}
    for fmt in ("csr", "csc"):
        materialize(
            tmp_path / f"{fmt}.h5ad",
            tmp_path / fmt,
            read=InputOptions(batch_cells=16),
            layout=Layout(shard_cells=16),
            obs=["plate"],
            progress=False,
            workers=workers,
        )
        ds = oj.open_dataset(tmp_path / fmt)
        assert_csr_equal(_all_rows(ds), (expected.indptr, expected.indices, expected.data))
        shards[fmt] = [s.sha256 for s in ds.manifest.shards]
    assert shards["csc"] == shards["csr"] and len(shards["csc"]) == 4
    assert reads == [50]  # once, for the CSC file
    assert not (tmp_path / "csc" / "_parts").exists()  # the regrouped entries went with the staging
    assert "CSC" not in capsys.readouterr().err


def test_a_csc_member_of_a_collection_is_regrouped_by_row(tmp_path):
    expected = _csc_and_csr_files(tmp_path, rows=40)
    materialize(
        [tmp_path / "csr.h5ad", tmp_path / "csc.h5ad"],
        tmp_path / "both",
        read=InputOptions(batch_cells=8),
        progress=False,
        workers=1,
    )
    ds = oj.open_dataset(tmp_path / "both")
    assert ds.features["gene_name"].tolist() == [f"G{g}" for g in range(9)]  # both list them in one order
    for first in (0, 40):  # the CSR source's cells, then the CSC source's
        assert_csr_equal(ds.read_csr(np.arange(first, first + 40)), _rows_of(expected, 0, 40))


def test_a_csc_matrix_read_where_no_folder_is_shared_says_it_passes_over_it_per_batch(tmp_path):
    """A Dask run writing to object storage has no folder its workers share: the matrix is read by
    column per batch, as before, and the run says what that costs and how to avoid it."""
    import materialize._csc_rows as csc_rows
    from materialize._h5ad import H5adSource

    expected = _csc_and_csr_files(tmp_path)
    src = H5adSource(tmp_path / "csc.h5ad", batch_cells=16)
    (note,) = src.stage(None)
    assert "is stored by column (CSC)" in note and "(4 passes over it)" in note and "tocsr()" in note
    rows = [src.read_rows(lo, min(lo + 16, 50)) for lo in range(0, 50, 16)]
    assert np.concatenate([r[1] for r in rows]).tolist() == expected.indices.tolist()
    assert src.stage(str(tmp_path / "by-row")) == []  # a folder: regrouped, the same rows
    assert isinstance(src._by_row, csc_rows.RowBlocks)
    again = [src.read_rows(lo, min(lo + 16, 50)) for lo in range(0, 50, 16)]
    for a, b in zip(rows, again, strict=True):
        assert_csr_equal(a, b)
    assert_csr_equal(src.read_rows(3, 37), _rows_of(expected, 3, 37))  # across blocks, not aligned to them
    assert_csr_equal(src.read_rows(20, 20), _rows_of(expected, 20, 20))
    src.close()


def _rows_of(matrix, lo, hi):
    part = matrix[lo:hi]
    return part.indptr, part.indices, part.data


def test_zeros_a_sparse_matrix_stores_are_not_written_as_entries(tmp_path):
    """A sparse X may store explicit zeros (an operation on it left them): the dataset holds the
    nonzeros alone, the same records as the dense matrix gives, whichever sparse format."""
    import anndata as ad
    import scipy.sparse as sp

    rng = np.random.default_rng(3)
    pattern = (rng.random((30, 12)) < 0.3) * rng.integers(1, 9, (30, 12)).astype(np.float32)
    stored = np.where(rng.random(pattern.shape) < 0.2, np.float32(0), pattern)
    rows, cols = np.nonzero(pattern)  # the sparse matrices store every entry of the pattern ...
    vals = stored[rows, cols]  # ... a fifth of them zeros
    matrices = {
        "dense": stored,
        "csr": sp.csr_matrix((vals, (rows, cols)), shape=stored.shape),
        "csc": sp.csc_matrix((vals, (rows, cols)), shape=stored.shape),
    }
    assert matrices["csr"].nnz > np.count_nonzero(stored)  # explicit zeros are stored
    obs = pd.DataFrame(index=[f"c{i}" for i in range(30)])
    shards = {}
    for fmt, x in matrices.items():
        ad.AnnData(X=x, obs=obs).write_h5ad(tmp_path / f"{fmt}.h5ad")
        materialize(tmp_path / f"{fmt}.h5ad", tmp_path / fmt, progress=False)
        ds = oj.open_dataset(tmp_path / fmt)
        assert ds.manifest.nnz == np.count_nonzero(stored), fmt
        shards[fmt] = [s.sha256 for s in ds.manifest.shards]
    assert shards["csr"] == shards["csc"] == shards["dense"]


def test_float64_values_that_are_zero_as_float32_are_not_written_as_entries(tmp_path):
    """A float64 X holds values the records' float32 rounds to 0 (1e-300): they are no entries, as
    stored zeros are not, in a sparse or a dense X; their counts and statistics agree with the
    records. The smallest float32 (2^-149) stays, as does NaN, which is refused."""
    import anndata as ad
    import scipy.sparse as sp

    x = np.array([[1e-300, 3, 0], [2, 2.0**-150, 2.0**-149], [0, 0, 0]])
    kept = x.astype(np.float32)
    obs = pd.DataFrame(index=[f"c{i}" for i in range(3)])
    for fmt, matrix in {"dense": x, "csr": sp.csr_matrix(x), "csc": sp.csc_matrix(x)}.items():
        ad.AnnData(X=matrix, obs=obs).write_h5ad(tmp_path / f"{fmt}.h5ad")
        materialize(tmp_path / f"{fmt}.h5ad", tmp_path / fmt, progress=False)
        ds = oj.open_dataset(tmp_path / fmt)
        assert ds.manifest.nnz == np.count_nonzero(kept) == 3, fmt
        expected = sp.csr_matrix(kept)
        assert_csr_equal(_all_rows(ds), (expected.indptr, expected.indices, expected.data))
        np.testing.assert_array_equal(ds.obs["n_genes"], np.count_nonzero(kept, axis=1))
    x[2, 0] = np.nan
    ad.AnnData(X=sp.csr_matrix(x), obs=obs).write_h5ad(tmp_path / "nan.h5ad")
    with pytest.raises(oj.DataValidationError, match="not finite|NaN"):
        materialize(tmp_path / "nan.h5ad", tmp_path / "nan", progress=False)


def test_a_bool_obs_column_has_both_categories_whatever_its_cells_hold(tmp_path):
    """A column of only True (CELLxGENE's ``is_primary_data`` in most files) or only False: codes 0
    False, 1 True in the dataset and in the batches, as in a column that holds both. With only the
    values seen, an all-True column's cells were code 0, False's code elsewhere."""
    import anndata as ad
    import scipy.sparse as sp

    obs = pd.DataFrame(
        {
            "yes": [True] * 3,
            "no": [False] * 3,
            "some": pd.array([True, None, False], dtype="boolean"),
            "categorical": pd.Categorical([True] * 3),  # pandas' categorical of bools: text labels
        },
        index=[f"c{i}" for i in range(3)],
    )
    ad.AnnData(X=sp.csr_matrix(np.eye(3, 4, dtype=np.float32)), obs=obs).write_h5ad(tmp_path / "b.h5ad")
    materialize(tmp_path / "b.h5ad", tmp_path / "b", progress=False)
    ds = oj.open_dataset(tmp_path / "b")
    expected = {"yes": [1, 1, 1], "no": [0, 0, 0], "some": [1, -1, 0], "categorical": [1, 1, 1]}
    for name, codes in expected.items():
        assert ds.obs[name].categories == ("false", "true"), name
        np.testing.assert_array_equal(ds.obs[name].codes, codes, err_msg=name)
    np.testing.assert_array_equal(ds.rows_where("no", [True]), [])
    loader = oj.make_loader(ds, batch_size=4, sampling=oj.Stream(drop_remainder=False), obs=list(expected))
    batch = next(iter(loader))
    for name, codes in expected.items():  # the fourth row pads the batch
        np.testing.assert_array_equal(np.asarray(batch.obs[name]), [*codes, -1], err_msg=name)


def test_a_categorical_of_bools_or_numbers_is_labelled_as_a_bool_or_number_column(tmp_path):
    """A categorical of bools takes the categories "false" / "true" of a bool column, and one of
    floats the labels of a float column cast to text: a collection mixing either with the plain
    column has each value once, and rows are selected by ``True``."""
    import anndata as ad
    import scipy.sparse as sp

    primary, dose = [True, False, True], [1.0, 2.5, 1.0]
    columns = {
        "a": {"is_primary": primary, "dose": dose},  # a bool and a float column
        "b": {"is_primary": pd.Categorical(primary), "dose": pd.Categorical(dose)},
    }
    x = sp.csr_matrix(np.eye(3, 2, dtype=np.float32))
    var = pd.DataFrame(index=["ENSG00000000001", "ENSG00000000002"])
    for name, obs in columns.items():
        obs = pd.DataFrame(obs, index=[f"{name}{i}" for i in range(3)])
        ad.AnnData(X=x, obs=obs, var=var).write_h5ad(tmp_path / f"{name}.h5ad")
    back = pd.concat([ad.read_h5ad(tmp_path / f"{n}.h5ad").obs.astype(object) for n in columns])

    materialize(tmp_path / "b.h5ad", tmp_path / "one", progress=False)
    one = oj.open_dataset(tmp_path / "one")
    assert one.obs["is_primary"].categories == ("false", "true")
    np.testing.assert_array_equal(one.rows_where("is_primary", [True]), np.flatnonzero(primary))
    assert one.obs["dose"].labels().tolist() == ["1", "2.5", "1"]

    materialize([tmp_path / "a.h5ad", tmp_path / "b.h5ad"], tmp_path / "both", progress=False)
    both = oj.open_dataset(tmp_path / "both")
    assert both.obs["is_primary"].categories == ("false", "true")
    selected = both.rows_where("is_primary", [True])
    np.testing.assert_array_equal(selected, np.flatnonzero(back["is_primary"].to_numpy(bool)))
    assert both.obs["dose"].categories == ("1", "2.5")
    assert [float(v) for v in both.obs["dose"].labels()] == back["dose"].tolist()


@pytest.mark.parametrize("fmt", ["csr", "csc", "dense"])
def test_a_matrix_stored_big_endian_reads_as_in_native_byte_order(tmp_path, fmt):
    """h5py keeps a file's byte order (``>f8``, ``>i4``): the values, indices and an obs column read
    as the same file in native order does, which anndata reads."""
    import shutil

    import anndata as ad
    import h5py
    import scipy.sparse as sp

    x = sp.random(30, 6, density=0.5, format="csr", random_state=0, dtype=np.float32)
    x.data = np.ceil(x.data * 9)
    matrix = {"csr": x, "csc": x.tocsc(), "dense": x.toarray().astype(np.float64)}[fmt]
    obs = pd.DataFrame({"score": np.linspace(0, 1, 30)}, index=[f"c{i}" for i in range(30)])
    ad.AnnData(X=matrix, obs=obs).write_h5ad(tmp_path / "native.h5ad")
    shutil.copy(tmp_path / "native.h5ad", tmp_path / "swapped.h5ad")
    with h5py.File(tmp_path / "swapped.h5ad", "r+") as f:
        names = ["X"] if fmt == "dense" else ["X/data", "X/indices", "X/indptr"]
        for name in [*names, "obs/score"]:
            values, attrs = f[name][...], dict(f[name].attrs)
            del f[name]
            swapped = values.dtype.newbyteorder(">")
            f.create_dataset(name, data=values.astype(swapped), dtype=swapped).attrs.update(attrs)
        assert not f[names[0]].dtype.isnative
    back = ad.read_h5ad(tmp_path / "native.h5ad")
    for name in ("native", "swapped"):
        materialize(tmp_path / f"{name}.h5ad", tmp_path / name, progress=False)
    native, ds = oj.open_dataset(tmp_path / "native"), oj.open_dataset(tmp_path / "swapped")
    expected = sp.csr_matrix(back.X)
    assert_csr_equal(_all_rows(ds), (expected.indptr, expected.indices, expected.data))
    assert [s.sha256 for s in ds.manifest.shards] == [s.sha256 for s in native.manifest.shards]
    np.testing.assert_array_equal(ds.obs["score"], back.obs["score"].to_numpy())


@pytest.mark.parametrize("column", ["gene_ids", "gene_id", "feature_id"])
def test_an_h5ad_takes_its_ensembl_ids_from_any_id_column_of_var(tmp_path, column):
    # an id column other than gene_ids was ignored: ensembl_id held the index's symbols, and
    # ds.gene_columns / a panel could not name the genes by id
    import anndata as ad
    import scipy.sparse as sp

    ids = ["ENSG00000141510", "ENSG00000012048", "ENSG00000146648", "ENSG00000105329"]
    x = sp.csr_matrix(np.arange(1, 9, dtype=np.float32).reshape(2, 4))
    var = pd.DataFrame({column: ids, "other": ["a", "b", "c", "d"]}, index=["TP53", "BRCA1", "EGFR", "TGFB1"])
    ad.AnnData(X=x, obs=pd.DataFrame(index=["c0", "c1"]), var=var).write_h5ad(tmp_path / "in.h5ad")
    materialize(tmp_path / "in.h5ad", tmp_path / "out", progress=False)
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.features["ensembl_id"].tolist() == ids
    assert ds.features["gene_name"].tolist() == ["TP53", "BRCA1", "EGFR", "TGFB1"]
    assert ds.gene_columns(["ENSG00000146648", "TGFB1"]).tolist() == [2, 3]
    assert column not in ds.features.columns and "other" in ds.features.columns


@pytest.mark.parametrize("stats", [True, False])
def test_an_input_s_own_n_counts_and_n_genes_are_kept_under_other_names_when_asked_for(
    tmp_path, capsys, stats
):
    # they were dropped without a word (scanpy's filter_cells writes them into many .h5ad files), and
    # with --no-stats lost even when named in --obs
    import anndata as ad
    import scipy.sparse as sp

    x = sp.csr_matrix(np.array([[1, 0, 2], [0, 3, 0]], np.float32))
    obs = pd.DataFrame(
        {"n_genes": [1000, 1001], "n_counts": [5.5, 6.5], "plate": ["a", "b"]}, index=["c0", "c1"]
    )
    ad.AnnData(X=x, obs=obs).write_h5ad(tmp_path / "in.h5ad")
    materialize(tmp_path / "in.h5ad", tmp_path / "all", stats=stats, progress=False)
    ds = oj.open_dataset(tmp_path / "all")
    assert "input_n_genes" not in ds.obs and ds.obs["plate"].labels().tolist() == ["a", "b"]
    assert ("n_genes" in ds.obs) is stats and (not stats or ds.obs["n_genes"].tolist() == [2, 1])
    err = capsys.readouterr().err  # not copied, and how to keep them: said
    assert "obs n_counts, n_genes of " in err and "as input_n_counts, input_n_genes)" in err
    materialize(
        tmp_path / "in.h5ad", tmp_path / "named", obs=["n_genes", "n_counts"], stats=stats, progress=False
    )
    ds = oj.open_dataset(tmp_path / "named")
    assert ds.obs["input_n_genes"].tolist() == [1000, 1001]
    assert ds.obs["input_n_counts"].tolist() == [5.5, 6.5]
    assert (not stats) or ds.obs["n_counts"].tolist() == [3.0, 3.0]
    assert "obs n_counts as input_n_counts, n_genes as input_n_genes of " in capsys.readouterr().err


def test_an_anndata_input_takes_its_cell_ids_from_the_obs_column_cell_id_names(tmp_path):
    # --cell-id was ignored for AnnData inputs, though the duplicate-id error advised it
    import anndata as ad
    import scipy.sparse as sp

    x = sp.csr_matrix(np.eye(4, 3, dtype=np.float32) + 1)
    obs = pd.DataFrame(
        {"barcode": [f"uniq{i}" for i in range(4)], "plate": list("abab")}, index=["c0", "c1", "c0", "c1"]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anndata's: obs names not unique
        ad.AnnData(X=x, obs=obs).write_h5ad(tmp_path / "in.h5ad")
    with pytest.raises(oj.DataValidationError, match="duplicate cell_id c0 in rows 0 and 2"):
        materialize(tmp_path / "in.h5ad", tmp_path / "dup", progress=False)
    materialize(tmp_path / "in.h5ad", tmp_path / "out", read=InputOptions(cell_id="barcode"), progress=False)
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.cell_ids.tolist() == ["uniq0", "uniq1", "uniq2", "uniq3"]
    assert "barcode" not in ds.obs and "plate" in ds.obs  # the ids are no obs column besides
    with pytest.raises(oj.DataValidationError, match="names obs column 'nope', which .* does not have"):
        materialize(tmp_path / "in.h5ad", tmp_path / "no", read=InputOptions(cell_id="nope"), progress=False)
    obs["barcode"] = pd.array(["u0", None, "u2", "u3"], dtype="string")
    ad.AnnData(X=x, obs=obs.set_axis([f"c{i}" for i in range(4)])).write_h5ad(tmp_path / "null.h5ad")
    with pytest.raises(
        oj.DataValidationError, match="cell id column barcode is null in row 1 of .*null.h5ad"
    ):
        materialize(
            tmp_path / "null.h5ad", tmp_path / "nul", read=InputOptions(cell_id="barcode"), progress=False
        )
