"""Review 4: DuckLake obs of dates, times and decimals; GENCODE ``_PAR_Y`` gene ids; ``s3://`` with no
bucket; the one check that a remote dataset was rewritten."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pyarrow as pa
import pytest
from conftest import ROOT

import omicsio_jax as oj

DUCKLAKE_PYTHON = ROOT / ".venv-ducklake" / "bin" / "python"

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
    if not DUCKLAKE_PYTHON.exists():
        reason = f"{DUCKLAKE_PYTHON} is missing; run scripts/setup-ducklake.sh"
        if os.environ.get("CI"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    from materialize import InputOptions, materialize

    lake = tmp_path / "lake"
    lake.mkdir()
    done = subprocess.run(
        [str(DUCKLAKE_PYTHON), "-c", _WRITE_LAKE], cwd=lake, capture_output=True, text=True, check=False
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


X_COPY, Y_COPY, OTHER = "ENSG00000182378.14", "ENSG00000182378.14_PAR_Y", "ENSG00000000003.15"


def test_a_par_y_gene_id_is_not_its_x_copy_in_materialize_or_the_runtime():
    """GENCODE's ``ENSG….14_PAR_Y`` (the Y copy of a pseudo-autosomal gene) loses its version only:
    it stays apart from the X copy ``ENSG….14``, alike in Python, in Arrow and at run time."""
    from materialize._genekeys import _stripped, ensembl_like, gene_keys, strip_version
    from omicsio_jax.format.genes import fold_ensembl, is_ensembl_id

    ids = [X_COPY, Y_COPY, "ENSG00000182378_PAR_Y", OTHER, "RP11-1.2", "ENSG00000182378.14_PAR_X"]
    unversioned = [
        "ENSG00000182378",
        "ENSG00000182378_PAR_Y",
        "ENSG00000182378_PAR_Y",
        "ENSG00000000003",
        "RP11-1.2",
        "ENSG00000182378.14_PAR_X",  # no Ensembl id: kept whole
    ]
    assert [strip_version(k) for k in ids] == unversioned
    assert _stripped(pa.array(ids)).to_pylist() == unversioned
    assert [fold_ensembl(k.lower()) for k in ids[:4]] == unversioned[:4]
    assert is_ensembl_id(Y_COPY.lower()) and ensembl_like(pa.array([Y_COPY]))
    keys = gene_keys(pa.table({"gene_ids": [X_COPY, Y_COPY, OTHER], "gene_name": ["A", "A", "B"]}), "s")
    assert (keys.by, keys.ids.to_pylist()) == ("ensembl", unversioned[:2] + unversioned[3:4])


def test_a_collection_keeps_the_par_y_copy_of_a_gene_apart(tmp_path):
    """A source whose var holds both copies of a pseudo-autosomal gene: two genes, not one summed; a
    gene list and the runtime's gene lookup take either copy by its versioned id."""
    import anndata as ad
    import pandas as pd
    import scipy.sparse as sp

    from materialize import InputOptions, materialize

    x = sp.csr_matrix(np.array([[1, 2, 0], [0, 5, 7]], np.float32))
    var = pd.DataFrame(index=[X_COPY, Y_COPY, OTHER])
    ad.AnnData(X=x, obs=pd.DataFrame(index=["a", "b"]), var=var).write_h5ad(tmp_path / "one.h5ad")
    y = sp.csr_matrix(np.array([[4, 1]], np.float32))
    var = pd.DataFrame(index=[OTHER, Y_COPY])
    ad.AnnData(X=y, obs=pd.DataFrame(index=["c"]), var=var).write_h5ad(tmp_path / "two.h5ad")
    paths = [tmp_path / "one.h5ad", tmp_path / "two.h5ad"]
    materialize(paths, tmp_path / "u", progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "u")
    assert ds.features["ensembl_id"].tolist() == [
        "ENSG00000182378",
        "ENSG00000182378_PAR_Y",
        "ENSG00000000003",
    ]
    indptr, indices, values = ds.read_csr(np.arange(3))
    dense = np.zeros((3, 3), np.float32)
    dense[np.repeat(np.arange(3), np.diff(indptr)), indices] = values
    np.testing.assert_array_equal(dense, [[1, 2, 0], [0, 5, 7], [0, 1, 4]])
    assert ds.gene_columns([Y_COPY, X_COPY, "ensg00000182378_par_y"]).tolist() == [1, 0, 1]

    (tmp_path / "genes.txt").write_text(f"{Y_COPY}\n{X_COPY}\n")
    materialize(
        paths, tmp_path / "g", read=InputOptions(genes=str(tmp_path / "genes.txt")), progress=False, workers=1
    )
    ds = oj.open_dataset(tmp_path / "g")
    assert ds.features["ensembl_id"].tolist() == ["ENSG00000182378_PAR_Y", "ENSG00000182378"]
    indptr, indices, values = ds.read_csr(np.arange(3))
    dense = np.zeros((3, 2), np.float32)
    dense[np.repeat(np.arange(3), np.diff(indptr)), indices] = values
    np.testing.assert_array_equal(dense, [[2, 1], [5, 0], [1, 0]])


@pytest.mark.parametrize("url", ["s3://", "s3:///"])
def test_reading_the_manifest_of_an_s3_url_with_no_bucket_is_refused(url, tmp_path, monkeypatch):
    """``s3://`` names no bucket: refused in one line, never read as the local folder ``s3:``."""
    from omicsio_jax.format.manifest import read_manifest, verify_dataset
    from omicsio_jax.storage.store import ObjectStoreError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "s3:").mkdir()
    (tmp_path / "s3:" / "manifest.json").write_text("{}")
    with pytest.raises(ObjectStoreError, match=r"names no bucket; use s3://BUCKET/PREFIX"):
        read_manifest(url)
    with pytest.raises(ObjectStoreError, match=r"names no bucket"):
        verify_dataset(url)


class _Store:
    """What `raise_if_rewritten` asks of an `S3Store`: the prefix's manifest now, and names."""

    url = "s3://bucket/ds"

    def __init__(self, manifest):
        self._text = manifest if manifest is None or isinstance(manifest, str) else json.dumps(manifest)

    def read_text(self, name: str) -> str | None:
        assert name == "manifest.json"
        return self._text

    def describe(self, relpath: str) -> str:
        return f"{self.url}/{relpath}"


def test_one_check_says_whether_a_file_or_a_shard_was_rewritten():
    """The small files (`FileCache`) and the shards (`mirrors`) share one check: an object the
    prefix's manifest lists as the opened manifest does is not rewritten; one listed otherwise, not
    listed, under a new generation, or with no or a broken manifest is, and says to open again."""
    from omicsio_jax.dataset import cache, mirrors
    from omicsio_jax.storage.store import ObjectChangedError

    assert mirrors.raise_if_rewritten is cache.raise_if_rewritten
    check = cache.raise_if_rewritten
    files = {"files": [{"path": "obs/a.npy", "sha256": "aa", "num_bytes": 3}]}
    shards = {"shards": [{"path": "shards/0.arecord", "sha256": "ss", "num_bytes": 10}]}
    check(_Store(files), "files", "obs/a.npy", sha256="aa")
    check(_Store(shards), "shards", "shards/0.arecord", num_bytes=10, sha256="ss")
    rewritten = [
        (_Store(files), "files", "obs/a.npy", {"sha256": "bb"}),
        (_Store(files), "files", "obs/b.npy", {"sha256": "aa"}),
        (_Store({**files, "generation": "gen-1"}), "files", "obs/a.npy", {"sha256": "aa"}),
        (_Store(None), "files", "obs/a.npy", {"sha256": "aa"}),
        (_Store("{not json"), "files", "obs/a.npy", {"sha256": "aa"}),
        (_Store({"files": [{"sha256": "aa"}]}), "files", "obs/a.npy", {"sha256": "aa"}),
        (_Store(shards), "shards", "shards/0.arecord", {"num_bytes": 11, "sha256": "ss"}),
        (_Store(files), "shards", "obs/a.npy", {"num_bytes": 3, "sha256": "aa"}),
    ]
    for store, listing, relpath, expected in rewritten:
        with pytest.raises(ObjectChangedError, match=rf"{relpath} is no longer the one .* open it again"):
            check(store, listing, relpath, **expected)
