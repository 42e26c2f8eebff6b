"""List-column table inputs as people have them: globs over files that differ, damaged files."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import omicsio_jax as oj
from materialize import InputOptions, Layout, materialize
from omicsio_jax import DataValidationError


def _cells(num_cells: int, prefix: str, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    tokens = [
        np.sort(rng.choice(30, int(rng.integers(1, 6)), replace=False)).tolist() for _ in range(num_cells)
    ]
    return pa.table(
        {
            "cell_id": [f"{prefix}{i:04d}" for i in range(num_cells)],
            "gene_token_id": pa.array(tokens, pa.list_(pa.int32())),
            "gene_expression": pa.array([[1.5] * len(t) for t in tokens], pa.list_(pa.float32())),
            "dose": pa.array(np.arange(num_cells, dtype=np.float64)),
        }
    )


def _folder(tmp_path, **tables: pa.Table):
    folder = tmp_path / "in"
    folder.mkdir()
    for name, table in tables.items():
        pq.write_table(table, folder / f"{name}.parquet")
    genes = pa.table({"gene_token_id": pa.array(np.arange(30), pa.int64())})
    pq.write_table(genes, folder / "gene_metadata.parquet")
    return folder


def _convert(folder, out, shard_cells: int, **read) -> oj.Dataset:
    layout = Layout(shard_cells=shard_cells, group_size=16)
    materialize(str(folder), str(out), read=InputOptions(**read), layout=layout, workers=1, progress=False)
    return oj.open_dataset(str(out))


@pytest.mark.parametrize("shard_cells", [16, 64])
def test_column_only_some_files_have_is_null_in_the_others_however_the_shards_fall(tmp_path, shard_cells):
    a, b = _cells(30, "a", 0), _cells(25, "b", 1)
    folder = _folder(tmp_path, a=a, b=b.append_column("plate", pa.array(np.arange(25, dtype=np.int64))))
    ds = _convert(folder, tmp_path / "out", shard_cells)
    assert list(ds.cell_ids) == a["cell_id"].to_pylist() + b["cell_id"].to_pylist()
    plate = np.asarray(ds.obs["plate"])
    assert np.isnan(plate[:30]).all()
    np.testing.assert_array_equal(plate[30:], np.arange(25))


def test_obs_column_typed_differently_among_files_reads_alike_in_every_shard(tmp_path):
    a, b = _cells(30, "a", 0), _cells(25, "b", 1)
    b = b.set_column(3, "dose", pa.array([f"x{i}" for i in range(25)]))  # DuckDB unites them as VARCHAR
    folder = _folder(tmp_path, a=a, b=b)
    one = _convert(folder, tmp_path / "one", 64).obs["dose"].labels()
    split = _convert(folder, tmp_path / "split", 16).obs["dose"].labels()
    assert list(one[:2]) == ["0.0", "1.0"]  # as DuckDB casts the doubles of a.parquet
    assert list(split) == list(one)


@pytest.mark.parametrize("shard_cells", [16, 64])
def test_file_without_list_columns_among_the_inputs_is_refused_naming_it(tmp_path, shard_cells):
    leftover = pa.table({"cell_id": ["x1", "x2"], "dose": [1.0, 2.0]})  # e.g. another table's cell ids
    folder = _folder(tmp_path, a=_cells(30, "a", 0), z=leftover)
    with pytest.raises(
        DataValidationError, match=r"z\.parquet of .* has no column\(s\) gene_token_id, gene_expression"
    ):
        _convert(folder, tmp_path / "out", shard_cells)
    assert not (tmp_path / "out").exists()


def test_read_error_while_rows_stream_is_a_one_line_validation_error(tmp_path):
    folder = _folder(tmp_path)
    path = folder / "cells.parquet"
    pq.write_table(_cells(3000, "c", 2), path, row_group_size=500, compression="none")
    raw = bytearray(path.read_bytes())
    at = pq.ParquetFile(path).metadata.row_group(4).column(1).data_page_offset + 40
    raw[at : at + 64] = b"\xff" * 64  # a damaged data page in the fifth row group
    path.write_bytes(bytes(raw))
    with pytest.raises(DataValidationError, match=r"^cannot read .*cells\.parquet: [^\n]*$"):
        _convert(path, tmp_path / "out", 4096, where="true")
    assert not (tmp_path / "out").exists()


def test_a_glob_leaves_out_the_gene_table_beside_the_cells(tmp_path):
    """``in/*.parquet`` matches ``gene_metadata.parquet`` too: it is the gene table, found beside the
    cells as a directory's is, not a file of cells."""
    a, b = _cells(30, "a", 0), _cells(25, "b", 1)
    folder = _folder(tmp_path, a=a, b=b)
    ds = _convert(str(folder / "*.parquet"), tmp_path / "out", 64)
    assert list(ds.cell_ids) == a["cell_id"].to_pylist() + b["cell_id"].to_pylist()
    assert ds.num_genes == 30


def test_paths_with_wildcard_characters_that_exist_are_taken_as_written(tmp_path):
    """A plate folder ``run[1]`` (brackets are a glob's character class): its file named as written
    is that file (it was "no input files found"), and a glob under it searches that folder (it
    searched ``run1``); a glob whose own part holds the wildcards is still a glob."""
    a, b = _cells(30, "a", 0), _cells(25, "b", 1)
    folder = _folder(tmp_path, a=a, b=b).rename(tmp_path / "run[1]")
    one = _convert(folder / "a.parquet", tmp_path / "one", 64)
    assert list(one.cell_ids) == a["cell_id"].to_pylist()
    both = _convert(f"{folder}/*.parquet", tmp_path / "both", 64)
    assert list(both.cell_ids) == a["cell_id"].to_pylist() + b["cell_id"].to_pylist()
    just_b = _convert(f"{folder}/[b].parquet", tmp_path / "just_b", 64)
    assert list(just_b.cell_ids) == b["cell_id"].to_pylist()
