"""Bad input: one readable line naming file, row, cell_id and invariant; non-zero exit; no output."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import omicsio_jax as oj
from materialize._cli import main

GOOD = [[0, 3, 7], [1, 2], [4], [5, 6, 8, 9]]


def _cells(genes, values, *, gene_type=pa.int32(), value_type=pa.float32()):  # noqa: B008 - immutable types
    n = len(genes)
    return pa.table(
        {
            "cell_id": [f"cell{i:03d}" for i in range(n)],
            "gene_token_id": pa.array(genes, pa.list_(gene_type)),
            "gene_expression": pa.array(values, pa.list_(value_type)),
            "drug": ["a"] * n,
        }
    )


def _values_like(genes, fill=1.0):
    return [[fill] * len(g) for g in genes]


@pytest.fixture
def write(tmp_path):
    pq.write_table(
        pa.table(
            {"gene_token_id": pa.array(range(10), pa.int32()), "gene_name": [f"G{i}" for i in range(10)]}
        ),
        tmp_path / "genes.parquet",
    )

    def _write(table, name="cells.parquet"):
        path = tmp_path / name
        pq.write_table(table, path)
        return path

    return _write


def _run_bad(capsys, tmp_path, *args) -> str:
    out = tmp_path / "out"
    code = main([*map(str, args), str(out), "--genes", str(tmp_path / "genes.parquet"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial")]
    return err


@pytest.mark.parametrize(
    "row_genes,row_values,pattern",
    [
        (
            [4, 2],
            [1.0, 1.0],
            r"gene_token_id not sorted in row 2 \(cell_id cell002\) of .*cells.parquet: 2 after 4",
        ),
        (
            [4, 4],
            [1.0, 1.0],
            r"duplicate gene_token_id in row 2 \(cell_id cell002\) of .*cells.parquet: 4 appears twice",
        ),
        (
            [4, 12],
            [1.0, 1.0],
            r"gene_token_id 12 in row 2 \(cell_id cell002\) of .*cells.parquet is not in the gene table",
        ),
        (  # not taken for a repeat of the row's start, nor for a fall from the last row's genes
            [-1, 4],
            [1.0, 1.0],
            r"gene_token_id -1 in row 2 \(cell_id cell002\) of .*cells.parquet is not in the gene table",
        ),
        (
            [-3],
            [1.0],
            r"gene_token_id -3 in row 2 \(cell_id cell002\) of .*cells.parquet is not in the gene table",
        ),
        (
            [4],
            [1.0, 2.0],
            r"unequal list lengths in row 2 \(cell_id cell002\) of .*cells.parquet: gene_token_id has 1 entries, gene_expression has 2",
        ),
        (
            [4, 5],
            [1.0, float("nan")],
            r"gene_expression is nan \(not finite\) in row 2 \(cell_id cell002\) of .*cells.parquet at gene_token_id 5",
        ),
        ([4, 5], [float("inf"), 1.0], r"gene_expression is inf \(not finite\) in row 2 \(cell_id cell002\)"),
        (
            [4, 5],
            [-1.5, 1.0],
            r"negative gene_expression -1.5 in row 2 \(cell_id cell002\) .*--allow-negative",
        ),
    ],
)
def test_each_broken_invariant(write, capsys, tmp_path, row_genes, row_values, pattern):
    genes, values = list(GOOD), _values_like(GOOD)
    genes[2], values[2] = row_genes, row_values
    path = write(_cells(genes, values))
    err = _run_bad(capsys, tmp_path, path)
    assert re.search(pattern, err), err


def test_negative_values_allowed_with_flag(write, tmp_path, capsys):
    genes, values = list(GOOD), _values_like(GOOD)
    values[1] = [-0.5, 2.0]
    path = write(_cells(genes, values))
    code = main(
        [
            str(path),
            str(tmp_path / "out"),
            "--genes",
            str(tmp_path / "genes.parquet"),
            "--allow-negative",
            "--no-progress",
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert oj.open_dataset(tmp_path / "out").manifest.values == "real"  # recorded: not counts


def test_int64_out_of_int32_range_and_float64_overflow(write, capsys, tmp_path):
    genes, values = list(GOOD), _values_like(GOOD)
    genes[3] = [5, 2**40]
    values[3] = [1.0, 1.0]
    path = write(_cells(genes, values, gene_type=pa.int64()))
    assert "gene_token_id 1099511627776 in row 3 (cell_id cell003)" in _run_bad(capsys, tmp_path, path)
    genes, values = list(GOOD), _values_like(GOOD)
    values[1] = [1.0, 1e300]
    path = write(_cells(genes, values, value_type=pa.float64()), "wide.parquet")
    assert "1e+300 in row 1 (cell_id cell001) of" in _run_bad(capsys, tmp_path, path)


def test_error_names_the_row_within_its_file(write, capsys, tmp_path):
    (tmp_path / "many").mkdir()
    good = _cells(GOOD, _values_like(GOOD))
    pq.write_table(good, tmp_path / "many" / "a.parquet")
    genes = list(GOOD)
    genes[1] = [3, 1]
    pq.write_table(_cells(genes, _values_like(genes)), tmp_path / "many" / "b.parquet")
    err = _run_bad(capsys, tmp_path, tmp_path / "many")
    assert "in row 1 (cell_id cell001) of" in err and "b.parquet" in err


def test_null_element_inside_a_list(write, capsys, tmp_path):
    genes = pa.array([[0, 1], [2, None]], pa.list_(pa.int32()))
    table = pa.table(
        {
            "cell_id": ["x", "y"],
            "gene_token_id": genes,
            "gene_expression": pa.array([[1.0, 1.0], [1.0, 1.0]], pa.list_(pa.float32())),
        }
    )
    err = _run_bad(capsys, tmp_path, write(table))
    assert "null element inside the gene_token_id list in row 1 (cell_id y)" in err


def test_missing_required_columns(write, capsys, tmp_path):
    table = _cells(GOOD, _values_like(GOOD)).drop_columns(["gene_expression"])
    err = _run_bad(capsys, tmp_path, write(table))
    assert "is missing required column(s) gene_expression" in err
    table = _cells(GOOD, _values_like(GOOD)).rename_columns(
        ["id", "gene_token_id", "gene_expression", "drug"]
    )
    err = _run_bad(capsys, tmp_path, write(table, "noid.parquet"))
    assert "missing required column(s) cell_id" in err and "--cell-id" in err


def test_unknown_obs_column(write, capsys, tmp_path):
    path = write(_cells(GOOD, _values_like(GOOD)))
    err = _run_bad(capsys, tmp_path, path, "--obs", "drug,plate")
    assert "obs column(s) plate not found" in err and "available: drug" in err


def test_unreadable_and_truncated_files(write, capsys, tmp_path):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet at all" * 10)
    assert "cannot read" in _run_bad(capsys, tmp_path, garbage)
    path = write(_cells(GOOD * 50, _values_like(GOOD * 50)))
    data = path.read_bytes()
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(data[: len(data) // 2])
    assert "cannot read" in _run_bad(capsys, tmp_path, truncated)
    assert "no input files found" in _run_bad(capsys, tmp_path, tmp_path / "nope.parquet")


def test_truncated_h5ad(corpus, capsys, tmp_path):
    data = corpus.h5ad.read_bytes()
    truncated = tmp_path / "truncated.h5ad"
    truncated.write_bytes(data[: len(data) // 2])
    err = _run_bad(capsys, tmp_path, truncated)
    assert "truncated.h5ad" in err and "cannot read" in err


@pytest.mark.parametrize("fmt", ["csr", "csc"])
@pytest.mark.parametrize(
    "damage,expected",
    [
        (lambda p: p.__setitem__(10, p[9] - 1), r"/X/indptr falls at (row|column) 9: the file is damaged"),
        (lambda p: p.__setitem__(0, 2), "/X/indptr starts at 2, not 0: the file is damaged"),
        (lambda p: p.__setitem__(-1, p[-1] + 5), r"/X/indptr ends at \d+ where indices holds \d+ entries"),
    ],
)
def test_a_sparse_matrix_whose_indptr_does_not_frame_its_entries_is_refused(
    capsys, tmp_path, fmt, damage, expected
):
    # scipy refuses such a matrix; read as it is, it lost a cell's first entries or shifted values
    # between cells without a word
    import anndata as ad
    import h5py
    import scipy.sparse as sp

    x = sp.random(50, 30, density=0.3, format=fmt, random_state=0, dtype=np.float32)
    x.data = np.ceil(x.data * 9)
    path = tmp_path / "damaged.h5ad"
    ad.AnnData(x).write_h5ad(path)
    with h5py.File(path, "r+") as f:
        indptr = f["X/indptr"][:]
        damage(indptr)
        f["X/indptr"][:] = indptr
    out = tmp_path / "out"
    assert main([str(path), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(expected, err), err
    assert "damaged.h5ad" in err and not out.exists()


@pytest.mark.parametrize("batch", ["16", "2048"])  # regrouped by row, or read by column per batch
@pytest.mark.parametrize("bad", [50, -1])
def test_a_csc_matrix_with_a_row_outside_it_is_refused(capsys, tmp_path, bad, batch):
    # read a batch of rows at a time, such an entry belonged to none and was dropped without a word
    import anndata as ad
    import h5py
    import scipy.sparse as sp

    x = sp.random(50, 30, density=0.3, format="csc", random_state=0, dtype=np.float32)
    x.data = np.ceil(x.data * 9)
    path = tmp_path / "damaged.h5ad"
    ad.AnnData(x).write_h5ad(path)
    with h5py.File(path, "r+") as f:
        f["X/indices"][7] = bad
    out = tmp_path / "out"
    assert main([str(path), str(out), "--no-progress", "--batch-cells", batch]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert (
        f"damaged.h5ad: /X/indices holds row {bad}, outside the matrix's 50 rows: the file is damaged" in err
    )
    assert not out.exists()


@pytest.mark.parametrize("name", ["absent.h5ad", "absent.zarr", "absent.h5mu"])
def test_anndata_input_that_is_not_there(name, capsys, tmp_path):
    err = _run_bad(capsys, tmp_path, tmp_path / name)
    assert err.endswith(f"cannot read {tmp_path / name}: no such file or directory"), err


def test_bad_layout_parameters(write, capsys, tmp_path):
    path = write(_cells(GOOD, _values_like(GOOD)))
    assert "shard_cells must be a power of two" in _run_bad(capsys, tmp_path, path, "--shard-cells", "1000")
    assert "group_size must be a power of two" in _run_bad(capsys, tmp_path, path, "--group-size", "24")
    for bad, why in (("bogus", "Unknown option bogus"), ("zstd:99", "invalid value: 99")):
        err = _run_bad(capsys, tmp_path, path, "--compression", bad)
        assert err.startswith(
            f"omicsio-materialize: error: compression {bad!r} is not one ArrayRecord takes ("
        ), err
        assert why in err and err.endswith("(--compression)")


def test_a_gene_table_with_an_id_twice_names_it_and_its_rows(write, capsys, tmp_path):
    path = write(_cells(GOOD, _values_like(GOOD)))
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 4, 7]
    names = [f"G{i}" for i in range(len(ids))]
    pq.write_table(
        pa.table({"gene_token_id": pa.array(ids, pa.int32()), "gene_name": names}), tmp_path / "genes.parquet"
    )
    err = _run_bad(capsys, tmp_path, path)
    assert re.search(
        r"gene_token_id is not unique in .*genes.parquet.*: 4 is listed 2 times \(and 1 more ids\); give each gene one id$",
        err,
    ), err


def test_panel_with_unknown_genes(write, capsys, tmp_path):
    path = write(_cells(GOOD, _values_like(GOOD)))
    (tmp_path / "panel.txt").write_text("G1\nG2\nNOPE\n")
    err = _run_bad(capsys, tmp_path, path, "--panel", tmp_path / "panel.txt")
    assert "1 gene(s) of" in err and "'NOPE'" in err


def test_valid_file_passes_for_reference(write, tmp_path):
    path = write(_cells(GOOD, _values_like(GOOD)))
    assert (
        main([str(path), str(tmp_path / "out"), "--genes", str(tmp_path / "genes.parquet"), "--no-progress"])
        == 0
    )
    assert np.load(tmp_path / "out" / "obs" / "drug.codes.npy").tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
@pytest.mark.parametrize("command", [[], ["index"]])
def test_overwrite_onto_a_file_is_refused_and_the_file_kept(write, capsys, tmp_path, command, overwrite):
    """Refused as a file at once: the first message does not suggest an --overwrite that is refused too."""
    path = write(_cells(GOOD, _values_like(GOOD)))
    notes = tmp_path / "notes.txt"
    notes.write_text("not a dataset\n")
    code = main([*command, str(path), str(notes), *overwrite, "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert (
        err
        == f"omicsio-materialize: error: refusing to overwrite {str(notes)!r}: it is a file, not a dataset directory; give another output path"
    )
    assert notes.read_text() == "not a dataset\n"
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name]


def test_cell_id_column_beside_another_id_column_is_kept_renamed(write, capsys, tmp_path):
    table = _cells(GOOD, _values_like(GOOD))
    table = table.append_column("barcode", pa.array([f"AC{i}" for i in range(4)]))
    table = table.append_column("input_cell_id", pa.array([7, 8, 9, 10]))  # the first choice is taken
    path = write(table)
    out = tmp_path / "out"
    argv = [str(path), str(out), "--cell-id", "barcode", "--genes", str(tmp_path / "genes.parquet")]
    assert main([*argv, "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "obs column cell_id of" in err and "kept as input_cell_id_2" in err and "column barcode" in err
    ds = oj.open_dataset(out)
    assert ds.cell_ids.tolist() == ["AC0", "AC1", "AC2", "AC3"]
    assert ds.obs["input_cell_id_2"].labels().tolist() == [f"cell{i:03d}" for i in range(4)]
    assert np.asarray(ds.obs["input_cell_id"]).tolist() == [7, 8, 9, 10]
    assert "cell_id" not in ds.obs


@pytest.mark.parametrize("name", ["a/b", "../../escape", "x" * 250])
def test_obs_name_that_is_no_file_name_is_refused(write, capsys, tmp_path, name):
    table = _cells(GOOD, _values_like(GOOD)).append_column(name, pa.array(["x"] * 4))
    err = _run_bad(capsys, tmp_path, write(table))
    assert f"obs column {name!r} of" in err and "--obs" in err and "--query" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cells.parquet", "genes.parquet"]


def test_huge_gene_id_without_a_gene_table(write, capsys, tmp_path):
    genes, values = list(GOOD), _values_like(GOOD)
    genes[3] = [5, 2**40]
    path = write(_cells(genes, values, gene_type=pa.int64()))
    out = tmp_path / "out"
    code = main([str(path), str(out), "--no-progress"])  # no gene table: the genes would be 0..2^40
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"gene_token_id 1099511627776 in {path} is outside 0..2^31-1" in err and "--genes" in err
    assert not out.exists()


def test_quoted_column_name_on_the_duckdb_path(write, tmp_path):
    table = _cells(GOOD, _values_like(GOOD)).append_column('size "um"', pa.array([1.5, 2.5, 3.5, 4.5]))
    path = write(table)
    argv = [str(path), str(tmp_path / "out"), "--where", "cell_id <> 'cell001'", "--no-progress"]
    assert main(argv) == 0
    ds = oj.open_dataset(tmp_path / "out")
    assert np.asarray(ds.obs['size "um"']).tolist() == [1.5, 3.5, 4.5]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"cell_id": None}, r"InputOptions\(cell_id=...\) names the cell id column .* got None"),
        ({"cell_id": ""}, r"InputOptions\(cell_id=...\) names the cell id column .* got ''"),
        ({"batch_cells": 0}, r"InputOptions\(batch_cells=...\) must be a positive integer or None, got 0"),
        (
            {"batch_cells": True},
            r"InputOptions\(batch_cells=...\) must be a positive integer or None, got True",
        ),
    ],
)
def test_input_options_out_of_their_domain_are_one_line_errors(options, expected):
    from materialize import InputOptions

    with pytest.raises(oj.OmicsIOError, match=expected) as e:
        InputOptions(**options)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"layer": 3}, r"^InputOptions\(layer=...\) must be a string or None, got 3$"),
        ({"where": ["a > 1"]}, r"^InputOptions\(where=...\) must be a string or None, got \['a > 1'\]$"),
        ({"query": b"SELECT 1"}, r"^InputOptions\(query=...\) must be a string or None, got b'SELECT 1'$"),
        ({"table": 1}, r"^InputOptions\(table=...\) must be a string or None, got 1$"),
        ({"gene_id_column": 0}, r"^InputOptions\(gene_id_column=...\) must be a string or None, got 0$"),
        ({"genes": 5}, r"^InputOptions\(genes=...\) must be a string, a path or None, got 5$"),
        ({"use_raw": "yes"}, r"^InputOptions\(use_raw=...\) must be True or False, got 'yes'$"),
        ({"allow_negative": None}, r"^InputOptions\(allow_negative=...\) must be True or False, got None$"),
    ],
)
def test_input_options_of_the_wrong_type_are_one_line_type_errors(options, expected):
    """Refused when made, not deep in a reader (h5py's "A name should be string or bytes")."""
    from materialize import InputOptions

    with pytest.raises(TypeError, match=expected):
        InputOptions(**options)


def test_the_usage_line_shows_the_inputs_then_the_output(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    usage = " ".join(capsys.readouterr().out.split("\n\n", 1)[0].split())
    assert usage.startswith("usage: omicsio-materialize ") and usage.endswith(" [INPUT ...] OUT"), usage
    with pytest.raises(SystemExit) as e:
        main(["--no-progress"])
    assert e.value.code == 2
    assert "required: OUT" in capsys.readouterr().err


def test_a_gene_table_found_above_the_input_is_named_on_stderr(capsys, tmp_path):
    """The default gene table is the one beside the input, else the nearest in a folder above it:
    that one, perhaps another dataset's, is named in a note."""
    genes = pa.table(
        {"gene_token_id": pa.array(range(10), pa.int32()), "gene_name": [f"G{i}" for i in range(10)]}
    )
    pq.write_table(genes, tmp_path / "gene_metadata.parquet")
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    pq.write_table(_cells(GOOD, _values_like(GOOD)), deep / "cells.parquet")
    assert main([str(deep / "cells.parquet"), str(tmp_path / "out"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert (
        f"materialize: genes from {tmp_path / 'gene_metadata.parquet'}, the nearest gene table in a folder above"
        in err
    )
    assert oj.open_dataset(tmp_path / "out").num_genes == 10
    pq.write_table(_cells(GOOD, _values_like(GOOD)), tmp_path / "beside.parquet")
    assert main([str(tmp_path / "beside.parquet"), str(tmp_path / "out2"), "--no-progress"]) == 0
    assert "genes from" not in capsys.readouterr().err


def test_each_refusal_names_its_own_fix(write, capsys, tmp_path):
    """A missing value column does not point at --cell-id; a text value column is named as text (not
    numpy's 'object'); a token outside the gene table points at the table; a truncated file is
    suspected as such."""
    err = _run_bad(
        capsys, tmp_path, write(_cells(GOOD, _values_like(GOOD)).drop_columns(["gene_expression"]))
    )
    assert err.endswith("it has cell_id, gene_token_id, drug"), err
    text = _cells(GOOD, [[str(v) for v in row] for row in _values_like(GOOD)], value_type=pa.string())
    assert "gene_expression must be a list of numbers, got elements of type text in row 0" in _run_bad(
        capsys, tmp_path, write(text, "text.parquet")
    )
    genes = [list(g) for g in GOOD]
    genes[2] = [12]
    err = _run_bad(capsys, tmp_path, write(_cells(genes, _values_like(genes)), "beyond.parquet"))
    assert err.endswith("check that the table is the one its ids come from (--genes)"), err
    data = write(_cells(GOOD * 50, _values_like(GOOD * 50)), "whole.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    err = _run_bad(capsys, tmp_path, tmp_path / "cut.parquet")
    assert "cut.parquet" in err and "(a truncated or damaged file?)" in err, err


def test_pandas_unnamed_index_is_no_obs(capsys, tmp_path):
    import pandas as pd

    frame = pd.DataFrame(
        {
            "cell_id": [f"c{i}" for i in range(4)],
            "gene_token_id": [[0, 3], [1], [2, 5], [4]],
            "gene_expression": [[1.0, 2.0], [3.0], [1.0, 1.0], [7.0]],
            "donor": ["a", "b", "a", "b"],
        },
        index=[10, 11, 12, 13],  # not a RangeIndex: to_parquet writes it as __index_level_0__
    )
    frame.to_parquet(tmp_path / "cells.parquet")
    assert main([str(tmp_path / "cells.parquet"), str(tmp_path / "out"), "--no-progress"]) == 0
    assert "__index_level_0__ of" in capsys.readouterr().err
    assert sorted(oj.open_dataset(tmp_path / "out").obs) == ["donor", "n_counts", "n_genes"]


@pytest.mark.parametrize("where", ["obs", "var", "index"])
def test_anndata_text_that_is_not_utf8_is_a_one_line_error_naming_it(capsys, tmp_path, where):
    # it was a UnicodeDecodeError traceback naming neither the file nor the column
    import h5py

    latin = [f"Jos\xe9{i}".encode("latin-1") for i in range(4)]
    obs = np.zeros(4, [("index", "S10"), ("donor", "S10")])
    obs["index"] = latin if where == "index" else [f"c{i}".encode() for i in range(4)]
    obs["donor"] = latin if where == "obs" else [b"d"] * 4
    var = np.zeros(3, [("index", "S10"), ("note", "S10")])
    var["index"] = [f"G{i}".encode() for i in range(3)]
    var["note"] = latin[:3] if where == "var" else [b"n"] * 3
    path = tmp_path / "latin.h5ad"
    with h5py.File(path, "w") as f:
        f["obs"], f["var"], f["X"] = obs, var, np.ones((4, 3), np.float32)
    out = tmp_path / "out"
    assert main([str(path), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    what = {"obs": "obs column 'donor'", "var": "var column 'note'", "index": "obs names"}[where]
    assert f"latin.h5ad: {what} holds text that is not UTF-8" in err and not out.exists()


@pytest.mark.parametrize("bad", [3, -1])
def test_an_h5ad_with_gene_token_ids_and_a_column_outside_its_genes_is_refused(capsys, tmp_path, bad):
    # mapped through var's gene_token_id, such a column was an IndexError traceback (-1: the last
    # gene's token, then a misleading "not sorted")
    import anndata as ad
    import h5py
    import pandas as pd
    import scipy.sparse as sp

    x = sp.csr_matrix(np.array([[1, 0, 2], [0, 3, 0], [4, 5, 6]], np.float32))
    var = pd.DataFrame({"gene_token_id": [0, 2, 4]}, index=["G0", "G1", "G2"])
    path = tmp_path / "tokens.h5ad"
    ad.AnnData(X=x, var=var).write_h5ad(path)
    with h5py.File(path, "r+") as f:
        f["X/indices"][1] = bad
    out = tmp_path / "out"
    assert main([str(path), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"tokens.h5ad: /X holds column {bad} in rows 0..2, outside its 3 genes: the file is damaged" in err
    assert not out.exists()


def test_an_h5ad_without_x_names_its_layers(capsys, tmp_path):
    import anndata as ad
    import pandas as pd
    import scipy.sparse as sp

    adata = ad.AnnData(X=None, obs=pd.DataFrame(index=["c0", "c1"]), var=pd.DataFrame(index=["G0", "G1"]))
    adata.layers["counts"] = sp.csr_matrix(np.ones((2, 2), np.float32))
    adata.write_h5ad(tmp_path / "nox.h5ad")
    assert main([str(tmp_path / "nox.h5ad"), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("nox.h5ad has no X; pick a layer with --layer (InputOptions(layer=...)): counts"), err


@pytest.mark.parametrize(
    "key,what",
    [
        ("obs/donor", "obs column 'donor'"),
        ("obs/_index", "obs names"),
        ("var/_index", "var's index (the gene names)"),
        ("obs/plate/categories", "obs: the categories of column 'plate'"),
    ],
)
def test_text_that_is_not_utf8_in_today_s_anndata_layout_is_a_one_line_error(capsys, tmp_path, key, what):
    # h5py passed such bytes through: a traceback at the end of the run, or a dataset whose ids or
    # gene names could not be read back
    import anndata as ad
    import h5py
    import pandas as pd
    import scipy.sparse as sp

    obs = pd.DataFrame(
        {"donor": ["a", "b", "c"], "plate": pd.Categorical(["p", "q", "p"])}, index=["c0", "c1", "c2"]
    )
    path = tmp_path / "latin.h5ad"
    ad.AnnData(X=sp.csr_matrix(np.eye(3, dtype=np.float32)), obs=obs).write_h5ad(path)
    with h5py.File(path, "r+") as f:
        values, attrs = list(f[key][:]), dict(f[key].attrs)
        values[1] = "Jos\xe9".encode("latin-1")
        del f[key]
        f.create_dataset(key, data=np.array(values, dtype=object), dtype=h5py.string_dtype("utf-8"))
        f[key].attrs.update(attrs)
    out = tmp_path / "out"
    assert main([str(path), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"latin.h5ad: {what}" in err and "not UTF-8" in err and not out.exists(), err


def test_an_output_inside_an_input_folder_is_refused_before_anything_is_written(write, capsys, tmp_path):
    """A dataset written inside a folder it was read from would be read as cells by the next run over
    that folder (--overwrite included): refused at once in one line naming both, for a single input,
    a glob reaching into it, a collection and a sources file; so is an output that is an input or
    holds one. A glob that cannot reach into the output reads no dataset files, and is no such case."""
    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(_cells(GOOD, _values_like(GOOD)), folder / "cells.parquet")
    genes = ["--genes", str(tmp_path / "genes.parquet"), "--no-progress"]
    write(_cells(GOOD, _values_like(GOOD)), "other.parquet")
    (tmp_path / "sources.csv").write_text("path\nother.parquet\nin\n")
    out, cells = folder / "out", folder / "cells.parquet"
    inside = f"lies inside the input {folder}, where runs over it would read the dataset's files as cells"
    for args, expected in [
        ([folder, out], f"output {out} {inside}; give an output outside {folder}"),
        (
            [tmp_path / "other.parquet", folder, out],
            f"output {out} {inside}; give an output outside {folder}",
        ),
        (["--sources", tmp_path / "sources.csv", out], f"output {out} {inside}; give an output outside"),
        ([folder / "**" / "*.parquet", out], f"output {out} lies inside the input {folder}/**/*.parquet"),
        ([cells, cells], f"output {cells} is the input {cells}; give an output outside {cells}"),
        (
            [cells, folder],
            f"output {folder} holds the input {cells}, which replacing the output would delete",
        ),
    ]:
        assert main([*map(str, args), *genes]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"omicsio-materialize: error: {expected}"), err
        assert len(err.splitlines()) == 1, err
        assert sorted(p.name for p in folder.iterdir()) == ["cells.parquet"]
    for again in ([], ["--overwrite"]):
        assert main([str(folder / "*.parquet"), str(out), *genes, *again]) == 0
        assert oj.open_dataset(out).num_cells == len(GOOD)


def test_a_glob_input_beside_the_output_that_reads_no_dataset_file_is_no_such_case(tmp_path):
    """``data/*/cells.parquet`` (a folder per plate) beside an output ``data/ds``: the glob cannot
    match a file a dataset writes (it holds no ``cells.parquet``), so the output is not refused;
    ``data/*/*.parquet`` could read its ``features.parquet``, and is."""
    from materialize._output import check_apart

    data = tmp_path / "data"
    check_apart(data / "ds", [str(data / "*" / "cells.parquet"), str(data / "*" / "*.vortex")])
    with pytest.raises(oj.OmicsIOError, match="lies inside the input"):
        check_apart(data / "ds", [str(data / "*" / "*.parquet")])
