"""Obs as users have them: dates, times and decimals carried (byte-identical whatever the workers), a
column no sidecar holds left out with a note; duplicate cell ids refused, leaving nothing; splits
by a column with empty labels, an integer column or a column that holds no groups."""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.sparse as sp

import omicsio_jax as oj
from materialize import InputOptions, Layout, _validate, materialize

LAYOUT = Layout(shard_cells=16, group_size=16)


def _cells(num_cells: int, **obs) -> pa.Table:
    return pa.table(
        {
            "cell_id": [f"c{i:03d}" for i in range(num_cells)],
            "gene_token_id": pa.array([[i % 10, 10 + i % 7] for i in range(num_cells)], pa.list_(pa.int32())),
            "gene_expression": pa.array([[1.0, 2.0]] * num_cells, pa.list_(pa.float32())),
            **obs,
        }
    )


def _digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_dates_times_and_decimals_are_carried_alike_whatever_the_workers(tmp_path, capsys):
    n = 50
    when = [dt.datetime(2024, 1, 1, 12) + dt.timedelta(hours=7 * i) for i in range(n)]
    when[3] = None
    paris = dt.timezone(dt.timedelta(hours=1))
    table = _cells(
        n,
        when=pa.array(when, pa.timestamp("us")),
        when_tz=pa.array([w and w.replace(tzinfo=paris) for w in when], pa.timestamp("ms", tz="+01:00")),
        day=pa.array([w and w.date() for w in when], pa.date32()),
        dose=pa.array([decimal.Decimal(f"{i}.25") for i in range(n)], pa.decimal128(10, 2)),
        clock=pa.array([dt.time(i % 24, 30) for i in range(n)], pa.time64("us")),
        blob=pa.array([b"\x00"] * n, pa.binary()),
    )
    pq.write_table(table, tmp_path / "cells.parquet", row_group_size=16)
    for workers in (1, 2):
        materialize(
            str(tmp_path / "cells.parquet"),
            tmp_path / f"out{workers}",
            workers=workers,
            progress=False,
            layout=LAYOUT,
        )
    assert _digests(tmp_path / "out1") == _digests(tmp_path / "out2")
    assert oj.verify_dataset(tmp_path / "out2") == []
    note = f"obs column 'blob' of {tmp_path / 'cells.parquet'} left out: no obs sidecar holds its type binary"
    assert note in capsys.readouterr().err

    ds = oj.open_dataset(tmp_path / "out2")
    kinds = {o.name: (o.kind, o.dtype) for o in ds.manifest.obs}
    assert kinds["when"] == ("datetime", "datetime64[us]") and kinds["day"] == ("datetime", "datetime64[D]")
    assert kinds["dose"] == ("numeric", "float64") and kinds["clock"] == ("timedelta", "timedelta64[us]")
    assert "blob" not in ds.obs
    expected = np.array(
        [np.datetime64("NaT") if w is None else np.datetime64(w) for w in when], "datetime64[us]"
    )
    np.testing.assert_array_equal(ds.obs["when"], expected)
    np.testing.assert_array_equal(ds.obs["when_tz"], expected - np.timedelta64(1, "h"))  # as UTC
    np.testing.assert_array_equal(ds.obs["day"], expected.astype("datetime64[D]"))
    np.testing.assert_array_equal(ds.obs["dose"], np.arange(n) + 0.25)
    np.testing.assert_array_equal(
        ds.obs["clock"], np.array([(i % 24) * 3600 + 1800 for i in range(n)]) * np.timedelta64(1, "s")
    )

    np.testing.assert_array_equal(ds.rows_where("day", ["2024-01-02"]), [2, 4, 5])
    np.testing.assert_array_equal(ds.rows_where("when", [np.datetime64("2024-01-01T19")]), [1])
    with pytest.raises(TypeError, match=r"\['tomorrow'\] are not datetime64\[D\] values of obs 'day'"):
        ds.rows_where("day", ["tomorrow"])
    with pytest.raises(oj.OmicsIOError, match=r"obs 'day' is of dates \(datetime64\[D\] values\): split by"):
        oj.split(ds, by="day")
    # batches carry categories and numbers: a loader asked for a date says how to look it up instead
    lookup = r"holds datetime64\[D\] values, which batches do not carry .*ds.obs\['day'\]\[np.asarray\(batch.index\)\]"
    with pytest.raises(oj.OmicsIOError, match=lookup):
        oj.make_loader(ds, batch_size=8, obs=["day"])
    with pytest.raises(oj.OmicsIOError, match=lookup):
        oj.load_panel(ds, obs=["day"], progress=False)


@pytest.mark.parametrize("where", [None, "cell_id <> 'none'"])  # read by pyarrow, or through DuckDB
def test_durations_and_timestamps_keep_the_unit_and_kind_a_parquet_file_stores(tmp_path, where):
    # DuckDB reads a duration as its integer count and a timestamp in ms as µs: the dataset held
    # durations as plain numbers and timestamps in another unit than the input's
    n = 5
    table = _cells(
        n,
        dur_s=pa.array([1, 2, None, 4, 5], pa.duration("s")),
        dur_ms=pa.array([5000, 6000, 7, None, 1], pa.duration("ms")),
        dur_us=pa.array([1, 2, 3, 4, 5], pa.duration("us")),
        ts_ms=pa.array([0, 1000, None, 3, 4], pa.timestamp("ms")),
    )
    pq.write_table(table, tmp_path / "cells.parquet")
    materialize(
        str(tmp_path / "cells.parquet"), tmp_path / "out", progress=False, read=InputOptions(where=where)
    )
    ds = oj.open_dataset(tmp_path / "out")
    kinds = {o.name: (o.kind, o.dtype) for o in ds.manifest.obs}
    for name, column in zip(table.column_names[3:], table.columns[3:], strict=True):
        expected = column.to_numpy()  # numpy's timedelta64 / datetime64 in the file's unit, NaT where null
        assert kinds[name] == ("timedelta" if name.startswith("dur") else "datetime", str(expected.dtype))
        np.testing.assert_array_equal(ds.obs[name], expected)


def test_files_of_one_glob_that_store_other_units_keep_what_holds_them_all(tmp_path, capsys):
    """Timestamps in ms in one file and µs in another are kept in DuckDB's µs (the first file's unit
    failed the cast); durations in s and ms, which DuckDB reads as counts of each, are left out with
    a note (they were labelled with the first file's unit)."""
    first = _cells(2, ts=pa.array([1500, 2500], pa.timestamp("ms")), dur=pa.array([1, 2], pa.duration("s")))
    second = _cells(
        2,
        ts=pa.array([1_000_001, 2_000_002], pa.timestamp("us")),
        dur=pa.array([1500, 2500], pa.duration("ms")),
    )
    pq.write_table(first, tmp_path / "a.parquet")
    pq.write_table(second.set_column(0, "cell_id", pa.array(["d0", "d1"])), tmp_path / "b.parquet")
    materialize(str(tmp_path / "[ab].parquet"), tmp_path / "out", progress=False, layout=LAYOUT)
    ds = oj.open_dataset(tmp_path / "out")
    np.testing.assert_array_equal(
        ds.obs["ts"], np.array([1_500_000, 2_500_000, 1_000_001, 2_000_002], "datetime64[us]")
    )
    assert "dur" not in ds.obs
    assert "obs column 'dur' left out: it holds durations in s in " in capsys.readouterr().err


def test_an_anndata_datetime64_obs_column_is_carried(tmp_path):
    n = 6
    obs = pd.DataFrame({"x": np.arange(n)}, index=[f"c{i}" for i in range(n)])
    ad.AnnData(sp.csr_matrix(np.ones((n, 3), np.float32)), obs=obs).write_h5ad(tmp_path / "a.h5ad")
    when = np.array(
        ["2024-01-01T12", "NaT", "2024-01-02", "2024-01-03", "2024-01-04", "2024-01-05"], "M8[ns]"
    )
    with h5py.File(tmp_path / "a.h5ad", "r+") as f:  # as h5py stores NumPy datetimes (anndata writes none)
        column = f["obs"].create_dataset("when", data=when.astype(h5py.opaque_dtype(when.dtype)))
        column.attrs["encoding-type"], column.attrs["encoding-version"] = "array", "0.2.0"
        f["obs"].attrs["column-order"] = [*f["obs"].attrs["column-order"], "when"]
    materialize(tmp_path / "a.h5ad", tmp_path / "out", progress=False, workers=1)
    np.testing.assert_array_equal(oj.open_dataset(tmp_path / "out").obs["when"], when)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_duplicate_cell_id_is_refused_naming_it_and_leaves_nothing(tmp_path, workers):
    table = _cells(40)
    ids = table.column("cell_id").to_pylist()
    ids[29] = "c007"  # in another partition than row 7
    table = table.set_column(0, "cell_id", pa.array(ids))
    pq.write_table(table, tmp_path / "cells.parquet", row_group_size=16)
    with pytest.raises(
        oj.DataValidationError,
        match=r"^duplicate cell_id c007 in rows 7 and 29 of .*cells\.parquet: .*--cell-id",
    ):
        materialize(
            str(tmp_path / "cells.parquet"), tmp_path / "out", workers=workers, progress=False, layout=LAYOUT
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cells.parquet"]


def test_a_duplicate_cell_id_across_the_files_of_a_glob_names_each_file_and_its_own_row(tmp_path):
    """Rows are counted within each file of a glob (the dataset's rows, counted across the files,
    named neither file); with ``--where``, rows among the cells that pass it, and the message says so."""
    folder = tmp_path / "in"
    folder.mkdir()
    first, second = _cells(20), _cells(30)
    ids = [f"d{i:03d}" for i in range(30)]
    ids[12] = "c005"  # row 5 of a.parquet
    pq.write_table(first, folder / "a.parquet", row_group_size=16)
    pq.write_table(second.set_column(0, "cell_id", pa.array(ids)), folder / "b.parquet", row_group_size=16)
    with pytest.raises(
        oj.DataValidationError,
        match=r"^duplicate cell_id c005 in row 5 of .*a\.parquet and row 12 of .*b\.parquet: ",
    ):
        materialize(str(folder / "*.parquet"), tmp_path / "out", workers=2, progress=False, layout=LAYOUT)
    assert not (tmp_path / "out").exists()
    with pytest.raises(
        oj.DataValidationError,
        match=r"^duplicate cell_id c005 in rows 4 and 31 of the cells of .*\*\.parquet that pass --where: ",
    ):
        materialize(
            str(folder / "*.parquet"),
            tmp_path / "out",
            read=InputOptions(where="cell_id <> 'c000'"),
            workers=1,
            progress=False,
            layout=LAYOUT,
        )
    assert not (tmp_path / "out").exists()


def test_distinct_ids_of_one_hash_are_no_duplicates(tmp_path, monkeypatch):
    from materialize._validate import UniqueStrings

    monkeypatch.setattr(_validate, "hash_strings", lambda strings: np.zeros(len(strings), np.uint64))
    unique = UniqueStrings(tmp_path / "hashes")
    batches = [
        pa.record_batch([pa.array(["a", "b"])], ["id"]),
        pa.record_batch([pa.array(["c", "b"])], ["id"]),
    ]
    for batch in batches:
        unique.add(batch.column(0))
    assert unique.first_repeat(lambda: batches) == ("b", 1, 3)
    assert unique.first_repeat(lambda: batches[:1]) is None  # hashes equal, strings not


@pytest.fixture
def grouped(tmp_path) -> oj.Dataset:
    n = 60
    table = _cells(
        n,
        donor=pa.array([["", "d1", "d2", "d3", None][i % 5] for i in range(n)]),
        plate=pa.array([i % 4 for i in range(n)], pa.int64()),
        dose=pa.array([i / 7 for i in range(n)]),
    )
    pq.write_table(table, tmp_path / "cells.parquet")
    materialize(str(tmp_path / "cells.parquet"), tmp_path / "out", workers=1, progress=False)
    return oj.open_dataset(tmp_path / "out")


def test_an_empty_label_is_no_group_of_a_split(grouped):
    result = oj.split(grouped, by="donor", fractions=(0.5, 0.5), names=("a", "b"), seed=0)
    assert sorted(result.groups["a"] + result.groups["b"]) == ["d1", "d2", "d3"]
    assert result.unlabelled_cells == 24 and sum(result.cells.values()) == 36  # "" and missing alike
    rows = np.concatenate([grouped.split("a"), grouped.split("b")])
    assert sorted(rows.tolist()) == [i for i in range(60) if i % 5 not in (0, 4)]


def test_a_split_by_an_integer_obs_groups_its_values_and_a_float_one_says_how(grouped):
    result = oj.split(grouped, by="plate", fractions=(0.5, 0.5), names=("a", "b"), seed=0)
    assert sorted(result.groups["a"] + result.groups["b"]) == ["0", "1", "2", "3"]
    plates = np.asarray(grouped.obs["plate"])
    for name in ("a", "b"):
        assert {str(p) for p in plates[grouped.split(name, by="plate")]} == set(result.groups[name])
    with pytest.raises(
        oj.OmicsIOError,
        match=r"obs 'dose' is numeric \(float64 values\): split by a categorical obs .* or an integer one; .*CAST",
    ):
        oj.split(grouped, by="dose")


@pytest.fixture
def numbered(tmp_path) -> oj.Dataset:
    """Integer obs as users have them: ids past int32, counts past float32's exact integers, a level in
    which -1 is a value like any other, and a float dose."""
    n = 64
    table = _cells(
        n,
        barcode=pa.array([10**12 + i for i in range(n)], pa.int64()),
        reads=pa.array([2**24 + 1 + i for i in range(n)], pa.int64()),
        level=pa.array([[-1, 10**12, 7, 7, 7, 7, 7, 7][i % 8] for i in range(n)], pa.int64()),
        dose=pa.array([i / 7 for i in range(n)]),
    )
    pq.write_table(table, tmp_path / "cells.parquet")
    materialize(str(tmp_path / "cells.parquet"), tmp_path / "out", workers=1, progress=False)
    return oj.open_dataset(tmp_path / "out")


def test_an_integer_obs_the_batch_cannot_hold_is_refused_naming_it_and_how_to_read_it(numbered):
    """int64 ids past int32 would wrap in a batch's int32 (10¹² to -727379968), counts past 2²⁴ would
    round in a panel's float32: refused as the loader is built, saying how to read them instead."""
    beyond = (
        r"^obs 'barcode' of .*out holds int64 values from 1000000000000 to 1000000000063, which do not fit "
        r"the int32 batch \(-2147483648 to 2147483647\): .*ds\.obs\['barcode'\]\[np\.asarray\(batch\.index\)\]"
        r", or store it as a categorical \(text\) column$"
    )
    with pytest.raises(oj.OmicsIOError, match=beyond):
        oj.make_loader(numbered, batch_size=8, obs=["barcode"])
    with pytest.raises(oj.OmicsIOError, match=beyond):
        oj.GrainSource(numbered, batch_size=8, obs=["barcode"])
    with pytest.raises(
        oj.OmicsIOError, match=r"^obs 'reads' of .* do not fit the float32 batch \(-16777216 to "
    ):
        oj.load_panel(numbered, obs=["reads"], progress=False)
    # within int32 the batches carry every value exactly, -1 on padding; a float as float32, NaN on padding
    loader = oj.make_loader(
        numbered, batch_size=48, sampling=oj.Stream(drop_remainder=False), obs=["reads", "dose"]
    )
    padded = 0
    for batch in loader:
        index, mask, reads, dose = (
            np.asarray(a) for a in (batch.index, batch.mask, batch.obs["reads"], batch.obs["dose"])
        )
        np.testing.assert_array_equal(reads[mask], numbered.obs["reads"][index[mask]])
        assert reads.dtype == np.int32 and (reads[~mask] == -1).all()
        np.testing.assert_array_equal(dose[mask], numbered.obs["dose"][index[mask]].astype(np.float32))
        assert dose.dtype == np.float32 and np.isnan(dose[~mask]).all()
        padded += int((~mask).sum())
    assert padded == 32  # 64 cells in batches of 48: the second one 16 cells and 32 padding rows


def test_class_balanced_by_an_integer_obs_balances_its_values_and_a_float_one_says_how(numbered):
    """As `split` groups them: each value of an integer column is a class (-1 and 10¹² too, no 7 TiB
    count of 0 … 10¹²); a float column is refused in one line."""
    loader = oj.make_loader(
        numbered, batch_size=8, sampling=oj.ClassBalanced("level", block_size=1, fetch_factor=1)
    )
    np.testing.assert_array_equal(loader.plan.rows, np.arange(64))  # the cells of level -1 are drawn too
    cells = {-1: 8, 10**12: 8, 7: 48}
    expected = [1 / cells[v] for v in numbered.obs["level"].tolist()]
    np.testing.assert_allclose(loader.plan.weights, expected)
    with pytest.raises(
        oj.OmicsIOError,
        match=r"^ClassBalanced\(by='dose'\): obs 'dose' of .*out is numeric \(float64 values\), not classes: "
        r"balance by a categorical obs or an integer one .*oj\.Weighted\(weights\)$",
    ):
        oj.make_loader(numbered, batch_size=8, sampling=oj.ClassBalanced("dose"))
