"""DuckLake catalogs as a materialize input, checked against DuckDB's own ducklake extension.

`_ducklake_lake.py` writes the lakes with the extension (DuckDB 1.4.4 in ``.venv-ducklake``, made by
scripts/setup-ducklake.sh) and records what the extension returns at every snapshot; each test
materializes with the project's reader, which never loads the extension, and compares cell for cell.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, assert_csr_equal, table_csr

import omicsio_jax as oj
from materialize import InputOptions, Layout, Multimodal, materialize
from materialize._cli import main
from materialize._ducklake import DuckLakeSource
from materialize._ducklake_read import LakeReader
from materialize._ducklake_table import Column, DataFile, LakeTable, empty_table

PYTHON = ROOT / ".venv-ducklake" / "bin" / "python"
WRITER = ROOT / "tests" / "_ducklake_lake.py"
CATALOGS = {"duckdb": "lake.ducklake", "sqlite": "sqlite:lake.sqlite"}
SHARD = 64  # several partitions per snapshot

if not PYTHON.exists():
    reason = f"{PYTHON} is missing; run scripts/setup-ducklake.sh"
    if os.environ.get("CI"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def _write(folder: Path, catalog: str, phase: str, record: str = "-") -> None:
    """Run a phase of the lake writer in ``folder`` (relative paths: a copied folder is a lake of its own)."""
    done = subprocess.run(
        [str(PYTHON), str(WRITER), catalog, "data/", record, phase],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def _built(tmp_path_factory, kind: str) -> Path:
    folder = tmp_path_factory.mktemp(f"lake-{kind}")
    _write(folder, CATALOGS[kind], "build", "truth")
    return folder


@pytest.fixture(scope="module")
def lakes(tmp_path_factory) -> dict[str, Path]:
    return {kind: _built(tmp_path_factory, kind) for kind in CATALOGS}


def _spec(folder: Path, kind: str = "duckdb") -> str:
    catalog = CATALOGS[kind]
    prefix, _, name = catalog.rpartition(":")
    return f"ducklake:{prefix + ':' if prefix else ''}{folder / name}"


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "lake"))


def _snapshots(folder: Path, record: str = "truth") -> dict:
    return json.loads((folder / record / "snapshots.json").read_text())


def _materialize(spec: str, out: Path, workers: int = 1, **read):
    return materialize(
        spec,
        out,
        read=InputOptions(table=read.pop("table", "rna_cells"), **read),
        layout=Layout(shard_cells=SHARD, group_size=16),
        workers=workers,
        progress=False,
    )


def _assert_matches(out: Path, truth: pa.Table, *, ordered: bool = True) -> None:
    """The dataset at ``out`` holds the rows of ``truth`` (the extension's, by rowid), in order (or,
    not ``ordered``, in any order)."""
    ds = oj.open_dataset(out)
    assert ds.num_cells == truth.num_rows
    if not ordered:
        where = {cell: i for i, cell in enumerate(truth.column("cell_id").to_pylist())}
        assert set(where) == set(ds.cell_ids.tolist())
        truth = truth.take([where[cell] for cell in ds.cell_ids.tolist()])
    assert ds.cell_ids.tolist() == truth.column("cell_id").to_pylist()
    if truth.num_rows:
        assert_csr_equal(ds.read_csr(np.arange(truth.num_rows)), table_csr(truth))
    scalar = [
        n for n in truth.column_names if n not in ("rowid", "cell_id", "gene_token_id", "gene_expression")
    ]
    assert set(scalar) <= set(ds.obs)
    for name in scalar:
        expected = truth.column(name).to_pylist()
        got = ds.obs[name]
        if isinstance(got, oj.Categorical):
            assert got.labels().tolist() == expected, name
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), err_msg=name)
    assert ds.features["gene_name"].tolist() == [f"G{i}" for i in range(60)]  # the lake's gene_metadata table


def _bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", list(CATALOGS))
def test_every_snapshot_equals_what_the_extension_reads(lakes, kind, tmp_path):
    """Inserts, deletes, a renamed and an added column, inlined rows, a partitioned insert: every
    snapshot of a DuckDB and of a SQLite catalog, cell for cell and in row-id order."""
    folder = lakes[kind]
    having = _snapshots(folder)["rna_cells"]
    assert len(having) == 10 and not _snapshots(folder)["unreadable"]
    for s in having:
        out = tmp_path / f"s{s}"
        result = _materialize(_spec(folder, kind), out, snapshot=s)
        _assert_matches(out, pq.read_table(folder / "truth" / f"rna_cells-{s}.parquet"))
        source = result.manifest.source
        assert (source["kind"], source["catalog_kind"], source["snapshot"]) == ("ducklake", kind, s)
        assert source["spec_version"] == "0.3" and len(source["lineage_sha256"]) == 64
    latest = _materialize(_spec(folder, kind), tmp_path / "latest").manifest.source
    assert latest["snapshot"] == having[-1]
    lake = DuckLakeSource(_spec(folder, kind), table="rna_cells")
    assert lake.lake.inlined.num_rows == 3  # c0000-c0003 less the deleted c0001, read from the catalog


def test_partitions_in_worker_processes_give_the_same_bytes(lakes, tmp_path):
    spec = _spec(lakes["duckdb"])
    one = _materialize(spec, tmp_path / "one", workers=1)
    two = _materialize(spec, tmp_path / "two", workers=2)
    assert two.partitions > 1 and two.workers == 2
    assert _bytes(tmp_path / "one") == _bytes(tmp_path / "two")
    assert one.manifest.fingerprint == two.manifest.fingerprint


def test_where_prunes_partition_files_before_opening_them(lakes, tmp_path):
    folder = _copy(lakes["duckdb"], tmp_path)
    s = _snapshots(folder)["rna_cells"][-1]
    where = "organ = 'lung'"
    _materialize(_spec(folder), tmp_path / "lung", where=where)
    _assert_matches(tmp_path / "lung", pq.read_table(folder / "truth" / f"lung-{s}.parquet"))
    pruned = DuckLakeSource(_spec(folder), table="rna_cells", where=where).files_pruned
    assert sorted(p.split("/")[-2] for p in pruned) == ["organ=brain", "organ=liver"]
    for other in ("liver", "brain"):
        for path in (folder / "data" / "main" / "rna_cells" / f"organ={other}").glob("*.parquet"):
            path.unlink()  # never opened: pruned by their partition value
    _materialize(_spec(folder), tmp_path / "again", where=where)
    assert _bytes(tmp_path / "again") == _bytes(tmp_path / "lung")
    with pytest.raises(oj.DataValidationError, match=r"data file .*organ=.* is missing"):
        _materialize(_spec(folder), tmp_path / "all")
    assert not (tmp_path / "all").exists()


def test_a_where_on_other_columns_reads_the_rows(lakes, tmp_path):
    folder = lakes["duckdb"]
    s = _snapshots(folder)["rna_cells"][-1]
    truth = pq.read_table(folder / "truth" / f"rna_cells-{s}.parquet")
    keep = [
        d == 7 and len(g) > 4
        for d, g in zip(truth["donor"].to_pylist(), truth["gene_token_id"].to_pylist(), strict=True)
    ]
    where = "donor = 7 AND len(gene_token_id) > 4"
    _materialize(_spec(folder), tmp_path / "out", where=where)
    _assert_matches(tmp_path / "out", truth.filter(pa.array(keep)))
    assert DuckLakeSource(_spec(folder), table="rna_cells", where=where).files_pruned == []


def test_a_snapshot_gives_the_same_bytes_after_later_commits_and_a_compaction(lakes, tmp_path):
    folder = _copy(lakes["duckdb"], tmp_path)
    recorded = _snapshots(folder)["rna_cells"]
    having = sorted({recorded[0], recorded[len(recorded) // 2], *recorded[-3:]})  # the last: partition files
    before = {}
    for s in having:
        _materialize(_spec(folder), tmp_path / f"before-{s}", snapshot=s)
        before[s] = _bytes(tmp_path / f"before-{s}")
    _write(folder, CATALOGS["duckdb"], "more", "more")
    newest = _materialize(_spec(folder), tmp_path / "newest").manifest.source["snapshot"]
    assert newest == having[-1] + 1
    latest = pq.read_table(folder / "truth" / f"rna_cells-{having[-1]}.parquet").drop_columns(["rowid"])
    inserted = pq.read_table(
        folder / "more" / "inserted.parquet"
    )  # in two partition files: order by their row ids
    _assert_matches(tmp_path / "newest", pa.concat_tables([latest, inserted]), ordered=False)
    assert (
        oj.open_dataset(tmp_path / "newest").cell_ids.tolist()[: latest.num_rows]
        == latest["cell_id"].to_pylist()
    )
    _write(folder, CATALOGS["duckdb"], "compact")
    con = duckdb.connect(str(folder / "lake.ducklake"), read_only=True)
    merged = con.execute(
        "SELECT count(*) FROM ducklake_data_file WHERE partial_file_info IS NOT NULL"
    ).fetchall()
    con.close()
    assert merged[0][0] >= 1  # a file now holds the rows of several commits, read by their row ids
    for s in having:
        _materialize(_spec(folder), tmp_path / f"after-{s}", snapshot=s)
        assert _bytes(tmp_path / f"after-{s}") == before[s], s
    _materialize(_spec(folder), tmp_path / "newest-after", snapshot=newest)
    assert _bytes(tmp_path / "newest-after") == _bytes(tmp_path / "newest")


def test_at_reads_the_last_snapshot_at_or_before_the_time(lakes, tmp_path):
    folder = lakes["sqlite"]
    times = _snapshots(folder)["times"]
    s = _snapshots(folder)["rna_cells"][4]
    for when in (times[str(s)], times[str(s)].replace("+00", "") + "1"):  # that instant; a moment after
        result = _materialize(_spec(folder, "sqlite"), tmp_path / "out", snapshot=when)
        assert result.manifest.source["snapshot"] == s
        shutil.rmtree(tmp_path / "out")


def _edit_catalog(folder: Path, sql: str) -> None:
    con = duckdb.connect(str(folder / "lake.ducklake"))
    con.execute(sql)
    con.close()


def test_an_unknown_specification_version_is_refused(lakes, tmp_path):
    folder = _copy(lakes["duckdb"], tmp_path)
    _edit_catalog(folder, "UPDATE ducklake_metadata SET value = '9.9' WHERE key = 'version'")
    with pytest.raises(
        oj.OmicsIOError, match=r"lake.ducklake has specification version '9.9'; this reader knows .*0.3"
    ):
        _materialize(_spec(folder), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_missing_snapshot_names_the_latest(lakes, tmp_path):
    latest = _snapshots(lakes["duckdb"])["rna_cells"][-1]
    with pytest.raises(
        oj.OmicsIOError, match=rf"has no snapshot 999; the latest is {latest} .*--snapshot {latest}"
    ):
        _materialize(_spec(lakes["duckdb"]), tmp_path / "out", snapshot=999)
    assert not (tmp_path / "out").exists()


def test_a_table_absent_at_the_snapshot_lists_the_tables(lakes, tmp_path):
    first = _snapshots(lakes["duckdb"])["rna_cells"][0]
    with pytest.raises(
        oj.OmicsIOError,
        match=rf"no table 'rna_cells' at snapshot {first - 1}; its tables then: gene_metadata ",
    ):
        _materialize(_spec(lakes["duckdb"]), tmp_path / "out", snapshot=first - 1)
    with pytest.raises(oj.OmicsIOError, match=r"name the table .* --table NAME .*: gene_metadata, rna_cells"):
        materialize(_spec(lakes["duckdb"]), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_at_before_the_first_snapshot_is_refused(lakes, tmp_path):
    with pytest.raises(
        oj.OmicsIOError, match=r"--at 2001-01-01T00:00:00\+00:00 is before the first snapshot .*snapshot 0 at"
    ):
        _materialize(_spec(lakes["sqlite"], "sqlite"), tmp_path / "out", snapshot="2001-01-01")
    assert not (tmp_path / "out").exists()


def _data_file(folder: Path) -> Path:
    return sorted((folder / "data" / "main" / "rna_cells").glob("ducklake-*[0-9a-f].parquet"))[0]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            "delete",
            r"data file .*ducklake-.*\.parquet of DuckLake table rna_cells of .*lake.ducklake at snapshot \d+ is missing",
        ),
        (
            "append",
            r"data file .* is [\d,]+ bytes but the catalog recorded [\d,]+: it changed since it was committed; restore",
        ),
        ("footer", r"data file .* has a parquet footer of \d+ bytes but the catalog recorded \d+"),
    ],
)
def test_a_missing_or_changed_data_file_is_named(lakes, tmp_path, damage, message):
    folder = _copy(lakes["duckdb"], tmp_path)
    path = _data_file(folder)
    data = path.read_bytes()
    if damage == "delete":
        path.unlink()
    elif damage == "append":
        path.write_bytes(data + b"\0")
    else:  # same size, another footer length
        footer = int.from_bytes(data[-8:-4], "little")
        path.write_bytes(data[:-8] + (footer + 1).to_bytes(4, "little") + data[-4:])
    with pytest.raises(oj.DataValidationError, match=message):
        _materialize(_spec(folder), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_command_line_reads_a_table_at_a_snapshot(lakes, tmp_path, capsys):
    folder = lakes["duckdb"]
    s = _snapshots(folder)["rna_cells"][5]
    argv = [_spec(folder), str(tmp_path / "cli"), "--table", "rna_cells", "--snapshot", str(s)]
    assert main([*argv, "--workers", "1", "--no-progress", "--shard-cells", str(SHARD)]) == 0
    _assert_matches(tmp_path / "cli", pq.read_table(folder / "truth" / f"rna_cells-{s}.parquet"))
    assert (
        main([_spec(folder) + "#rna_cells", str(tmp_path / "bad"), "--snapshot", "999", "--no-progress"]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no snapshot 999; the latest is" in err[0]
    assert not (tmp_path / "bad").exists()


def test_the_console_script_takes_at(lakes, tmp_path):
    folder = lakes["sqlite"]
    s = _snapshots(folder)["rna_cells"][3]
    when = _snapshots(folder)["times"][str(s)]
    script = Path(sys.executable).parent / "omicsio-materialize"
    done = subprocess.run(
        [
            str(script),
            _spec(folder, "sqlite") + "#rna_cells",
            str(tmp_path / "out"),
            "--at",
            when,
            "--no-progress",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    _assert_matches(tmp_path / "out", pq.read_table(folder / "truth" / f"rna_cells-{s}.parquet"))


def test_ducklake_options_are_refused_elsewhere(lakes, tmp_path):
    with pytest.raises(oj.OmicsIOError, match=r"InputOptions\(snapshot=...\) is a snapshot id ≥ 0"):
        InputOptions(snapshot=-1)
    with pytest.raises(oj.OmicsIOError, match=r"--table/--snapshot/--at apply to ducklake:CATALOG inputs"):
        materialize(
            tmp_path / "cells.parquet", tmp_path / "out", read=InputOptions(snapshot=3), progress=False
        )
    with pytest.raises(oj.OmicsIOError, match=r"names table 'rna_cells' and --table names 'other'"):
        materialize(_spec(lakes["duckdb"]) + "#rna_cells", tmp_path / "out", read=InputOptions(table="other"))
    with pytest.raises(
        oj.OmicsIOError, match=r"modality atac: a DuckLake table .* is read as the primary input only"
    ):
        materialize(
            _spec(lakes["duckdb"]) + "#rna_cells",
            tmp_path / "out",
            multimodal=Multimodal(modalities={"atac": _spec(lakes["duckdb"]) + "#atac_cells"}),
            progress=False,
        )
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def updated(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lake-updated")
    _write(folder, CATALOGS["duckdb"], "updates", "truth")
    return folder


def _file_rows(folder: Path, where: str) -> int:
    con = duckdb.connect(str(folder / "lake.ducklake"), read_only=True)
    count = con.execute(
        "SELECT count(*) FROM ducklake_data_file WHERE table_id = "
        f"(SELECT table_id FROM ducklake_table WHERE table_name = 'rna_cells') AND {where}"
    ).fetchall()[0][0]
    con.close()
    return count


def test_updated_rows_keep_their_place(updated, tmp_path):
    """UPDATE writes the new rows to files holding their row ids (with a row_id_start of their
    own): every snapshot reads in the extension's row-id order, also through --where."""
    having = _snapshots(updated)["rna_cells"]
    assert len(having) == 7 and not _snapshots(updated)["unreadable"]
    assert (
        _file_rows(updated, "row_id_start IS NOT NULL AND partial_file_info IS NULL AND begin_snapshot > 5")
        == 3
    )
    for s in having:
        _materialize(_spec(updated), tmp_path / f"s{s}", snapshot=s)
        _assert_matches(tmp_path / f"s{s}", pq.read_table(updated / "truth" / f"rna_cells-{s}.parquet"))
    truth = pq.read_table(updated / "truth" / f"rna_cells-{having[-1]}.parquet")
    where = "tissue IN ('kidney', 'heart') OR dataset = 'ds9'"
    keep = pa.compute.or_(
        pa.compute.is_in(truth["tissue"], pa.array(["kidney", "heart"])),
        pa.compute.equal(truth["dataset"], "ds9"),
    )
    _materialize(_spec(updated), tmp_path / "where", where=where, workers=2)
    _assert_matches(tmp_path / "where", truth.filter(keep))


def test_a_rewrite_keeps_every_snapshot_byte_for_byte(updated, tmp_path):
    """ducklake_rewrite_data_files writes files with no row_id_start, their rows' row ids in a
    column: each snapshot gives the same dataset before and after it, in the extension's order."""
    folder = _copy(updated, tmp_path)
    having = _snapshots(folder)["rna_cells"][-3:]
    before = {}
    for s in having:
        _materialize(_spec(folder), tmp_path / f"before-{s}", snapshot=s)
        before[s] = _bytes(tmp_path / f"before-{s}")
    _write(folder, CATALOGS["duckdb"], "rewrite", "rewritten")
    assert _file_rows(folder, "row_id_start IS NULL AND end_snapshot IS NULL") == 1
    rewritten = _snapshots(folder, "rewritten")["rna_cells"]
    assert rewritten[-1] == having[-1] + 1 and not _snapshots(folder, "rewritten")["unreadable"]
    for s in [*having, rewritten[-1]]:
        out = tmp_path / f"after-{s}"
        _materialize(_spec(folder), out, snapshot=s)
        _assert_matches(out, pq.read_table(folder / "rewritten" / f"rna_cells-{s}.parquet"))
        if s in before:
            assert _bytes(out) == before[s], s
    same = before[having[-1]]  # the rewrite's own snapshot: the same rows, its own snapshot id
    data = {k: v for k, v in _bytes(out).items() if k != "manifest.json"}
    assert data == {k: v for k, v in same.items() if k != "manifest.json"}


def test_a_null_partition_value_is_null_to_where():
    """A file whose partition value is NULL (DuckDB 1.4.4's extension cannot write one) is kept by
    ``IS NULL`` and pruned by a comparison, like a file of any other value."""
    columns = [Column(1, "cell_id", "VARCHAR", None), Column(2, "organ", "VARCHAR", None)]

    def data_file(i: int, organ: str | None) -> DataFile:
        return DataFile(
            i, f"f{i}.parquet", 3, None, None, 3 * i, None, None, {2: organ}, {"organ": organ}, None
        )

    lake = LakeTable("lake.ducklake", "rna_cells", "u", 1, "t", "0.3", columns, [], empty_table(columns))
    lake.files = [data_file(0, None), data_file(1, "lung"), data_file(2, "None")]
    expected = {"organ IS NULL": {1, 2}, "organ = 'lung'": {0, 2}, "organ IS NOT NULL": {0}}
    for where, pruned in expected.items():
        reader = LakeReader(lake, where=where)
        reader.prune()
        assert reader.pruned == pruned, where
    null = LakeReader(lake)._constant(lake.files[0], columns[1])
    assert null.to_pylist() == [None]


# Run by .venv-ducklake's python (DuckDB's own ducklake extension) in the lake's folder: 20 cells written
# as a data file, then 2 small enough to be inlined in the catalog (one of them all nulls).
_WRITE_LAKE = f"""
import sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import duckdb
from _ducklake_lake import extension

con = duckdb.connect(config={{"allow_unsigned_extensions": "true"}})
con.execute("SET TimeZone = 'UTC'")
con.execute(f"LOAD '{{extension('ducklake')}}'")
con.execute("ATTACH 'ducklake:lake.ducklake' AS lake (DATA_PATH 'data/', DATA_INLINING_ROW_LIMIT 10)")
con.execute("USE lake")
con.execute("CREATE TABLE gene_metadata (gene_token_id INTEGER, gene_name VARCHAR)")
con.execute("INSERT INTO gene_metadata SELECT i, 'G' || i FROM range(5) r(i)")
con.execute(
    "CREATE TABLE rna_cells (cell_id VARCHAR, gene_token_id INTEGER[], gene_expression FLOAT[], "
    "seen TIMESTAMP, seen_at TIMESTAMPTZ, born DATE, dose DECIMAL(9, 3), raw BLOB, tissue VARCHAR)"
)
con.execute(
    "INSERT INTO rna_cells SELECT 'c' || lpad(i::VARCHAR, 2, '0'), [i % 5], [1.0 + i], "
    "TIMESTAMP '2024-01-02 03:04:05' + INTERVAL (i) HOUR, TIMESTAMPTZ '2024-05-06 07:08:09+00' + INTERVAL (i) MINUTE, "
    "DATE '2020-02-29' + i::INTEGER, (i * 1.25)::DECIMAL(9, 3), 'x'::BLOB, 'lung' FROM range(20) r(i)"
)
con.execute(
    "INSERT INTO rna_cells VALUES ('i0', [1], [2.0], TIMESTAMP '1999-12-31 23:59:59', "
    "TIMESTAMPTZ '2000-01-01 00:00:00+00', DATE '1999-12-31', 0.125, 'y'::BLOB, 'liver'), "
    "('i1', [2], [3.0], NULL, NULL, NULL, NULL, NULL, NULL)"
)
"""


def test_a_ducklake_table_carries_its_timestamp_date_and_decimal_obs(tmp_path, capsys):
    """DuckLake inputs choose their obs as the other inputs do (`carried_obs`): dates and timestamps
    become datetime64 sidecars (NaT where null), decimals float64, from data files and inlined rows
    alike; a column no sidecar holds (BLOB) is left out with a note naming it."""
    lake = tmp_path / "lake"
    lake.mkdir()
    done = subprocess.run(
        [str(PYTHON), "-c", _WRITE_LAKE], cwd=lake, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    materialize(
        f"ducklake:{lake / 'lake.ducklake'}",
        tmp_path / "ds",
        read=InputOptions(table="rna_cells"),
        progress=False,
        workers=1,
    )
    err = capsys.readouterr().err
    assert "obs column 'raw' of DuckLake table rna_cells" in err and "left out" in err
    ds = oj.open_dataset(tmp_path / "ds")
    assert ds.cell_ids.tolist() == [f"c{i:02d}" for i in range(20)] + ["i0", "i1"]
    assert {"seen", "seen_at", "born", "dose", "tissue"} <= set(ds.obs) and "raw" not in ds.obs
    hours = np.datetime64("2024-01-02T03:04:05", "us") + np.arange(20) * np.timedelta64(1, "h")
    expected = np.concatenate(
        [hours, [np.datetime64("1999-12-31T23:59:59", "us"), np.datetime64("NaT", "us")]]
    )
    np.testing.assert_array_equal(np.asarray(ds.obs["seen"]), expected)
    assert np.asarray(ds.obs["seen"]).dtype == np.dtype("datetime64[us]")
    minutes = np.datetime64("2024-05-06T07:08:09", "us") + np.arange(20) * np.timedelta64(1, "m")
    expected = np.concatenate(
        [minutes, [np.datetime64("2000-01-01T00:00:00", "us"), np.datetime64("NaT", "us")]]
    )
    np.testing.assert_array_equal(np.asarray(ds.obs["seen_at"]), expected)  # the UTC instant
    days = np.datetime64("2020-02-29") + np.arange(20)
    expected = np.concatenate([days, [np.datetime64("1999-12-31"), np.datetime64("NaT", "D")]])
    np.testing.assert_array_equal(np.asarray(ds.obs["born"]), expected)
    assert np.asarray(ds.obs["born"]).dtype == np.dtype("datetime64[D]")
    dose = np.asarray(ds.obs["dose"])
    assert dose.dtype == np.float64
    np.testing.assert_array_equal(dose, [*(np.arange(20) * 1.25), 0.125, np.nan])
