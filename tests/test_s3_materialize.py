"""materialize with inputs and outputs on S3 (moto's server on 127.0.0.1): the same bytes as on local
disk, from parquet, vortex and h5ad, on a local pool and on Dask; nothing that looks complete until
the manifest is uploaded; one-line errors for unreachable endpoints, credentials and buckets."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import vortex
from conftest import assert_csr_equal, table_csr

import omicsio_jax as oj
from materialize import Dask, InputOptions, Layout, materialize
from materialize._cli import main
from omicsio_jax.storage.store import S3Store

SHARD = 512


def _digests(root: Path) -> dict[str, str]:
    """Every file's SHA-256; the manifest by its fingerprint (it also names the input, which differs)."""
    out = {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
    out["manifest.json"] = json.loads((root / "manifest.json").read_text())["fingerprint"]
    return out


def _object_digests(s3, prefix: str) -> dict[str, str]:
    store = S3Store(s3.url(prefix))
    out = {key: hashlib.sha256(store.read_bytes(key)).hexdigest() for key, _ in store.list()}
    out["manifest.json"] = json.loads(store.read_text("manifest.json"))["fingerprint"]
    return out


def _upload_inputs(s3, corpus, corpus_table, tmp_path) -> None:
    """The corpus as hive-partitioned parquet, vortex files, an h5ad and a gene table under s3://…/in/."""
    local = tmp_path / "in"
    for i, (a, b) in enumerate([(0, 1200), (1200, 3000)]):
        (local / "pq" / f"plate={i}").mkdir(parents=True)
        pq.write_table(
            corpus_table.slice(a, b - a), local / "pq" / f"plate={i}" / "cells.parquet", row_group_size=200
        )
        (local / "vx").mkdir(exist_ok=True)
        vortex.io.write(corpus_table.slice(a, b - a), str(local / "vx" / f"cells-{i}.vortex"))
    (local / "pq" / "gene_metadata.parquet").write_bytes(Path(corpus.genes_parquet).read_bytes())
    (local / "cells.h5ad").write_bytes(Path(corpus.h5ad).read_bytes())
    names = [p.relative_to(local).as_posix() for p in sorted(local.rglob("*")) if p.is_file()]
    S3Store(s3.url("in")).upload(local, names)


def test_s3_to_s3_is_byte_identical_to_local(s3, corpus, corpus_table, tmp_path):
    _upload_inputs(s3, corpus, corpus_table, tmp_path)
    kw = dict(progress=False, read=InputOptions(where="tissue <> 'brain'"), layout=Layout(shard_cells=SHARD))
    materialize(str(tmp_path / "in" / "pq"), tmp_path / "local", workers=1, **kw)
    result = materialize(s3.url("in/pq/"), s3.url("ds/"), workers=2, **kw)
    assert result.workers == 2 and result.partitions > 2
    assert _object_digests(s3, "ds") == _digests(tmp_path / "local")  # no _parts/ left, nothing else
    # open it from S3: exact cells, the same loader batches
    remote, local = (
        oj.open_dataset(s3.url("ds/"), cache_dir=tmp_path / "cache"),
        oj.open_dataset(tmp_path / "local"),
    )
    rows = np.random.default_rng(0).choice(local.num_cells, 300)
    assert_csr_equal(remote.read_csr(rows), local.read_csr(rows))
    kw = dict(batch_size=64, sampling=oj.Block(16, 4), seed=3, num_epochs=1)
    for a, b in zip(oj.make_loader(remote, **kw), oj.make_loader(local, **kw), strict=True):
        np.testing.assert_array_equal(np.asarray(a.index), np.asarray(b.index))
        np.testing.assert_array_equal(np.asarray(a.x), np.asarray(b.x))


def test_a_sources_file_and_a_panel_file_on_s3_read_as_local_ones(s3, corpus, corpus_table, tmp_path):
    """``--sources`` and ``--panel`` take ``s3://`` files too (a sources file's paths relative to its
    prefix), and give the bytes their local copies give."""
    _upload_inputs(s3, corpus, corpus_table, tmp_path)
    local = tmp_path / "in"
    (local / "sources.csv").write_text("path,dataset_id\npq/plate=0/cells.parquet,a\ncells.h5ad,b\n")
    genes = pq.read_table(corpus.genes_parquet)
    (local / "panel.txt").write_text("\n".join(genes.column("gene_name").to_pylist()[:40:3]) + "\n")
    S3Store(s3.url("in")).upload(local, ["sources.csv", "panel.txt"])
    for args, name in (
        (lambda root: ["--sources", f"{root}/sources.csv"], "collection"),
        (
            lambda root: [
                f"{root}/pq/",
                "--genes",
                f"{root}/pq/gene_metadata.parquet",
                "--panel",
                f"{root}/panel.txt",
            ],
            "panel",
        ),
    ):
        for root, out in (
            (str(local), tmp_path / f"{name}_local"),
            (s3.url("in"), tmp_path / f"{name}_remote"),
        ):
            assert main([*args(root), str(out), "--shard-cells", str(SHARD), "--no-progress"]) == 0
        assert _digests(tmp_path / f"{name}_remote") == _digests(tmp_path / f"{name}_local")
    assert oj.open_dataset(tmp_path / "collection_remote").obs["dataset_id"].categories == ("a", "b")
    assert oj.open_dataset(tmp_path / "panel_remote").layout == "dense"


@pytest.mark.parametrize("kind", ["vortex", "h5ad"])
def test_vortex_and_h5ad_on_s3(s3, corpus, corpus_table, tmp_path, kind):
    _upload_inputs(s3, corpus, corpus_table, tmp_path)
    local_input = str(tmp_path / "in" / ("vx" if kind == "vortex" else "cells.h5ad"))
    remote_input = s3.url("in/vx/") if kind == "vortex" else s3.url("in/cells.h5ad")
    genes = {"read": InputOptions(genes=s3.url("in/pq/gene_metadata.parquet"))} if kind == "vortex" else {}
    materialize(
        local_input,
        tmp_path / "local",
        progress=False,
        workers=1,
        **{"read": InputOptions(genes=corpus.genes_parquet)} if kind == "vortex" else {},
        layout=Layout(shard_cells=SHARD),
    )
    materialize(
        remote_input,
        tmp_path / "remote",
        progress=False,
        workers=2,
        **genes,
        layout=Layout(shard_cells=SHARD),
    )
    assert _digests(tmp_path / "remote") == _digests(tmp_path / "local")


def test_dask_writes_to_s3(s3, corpus, corpus_table, tmp_path, dask_cluster):
    _upload_inputs(s3, corpus, corpus_table, tmp_path)
    materialize(
        str(tmp_path / "in" / "pq" / "*" / "*.parquet"),
        tmp_path / "local",
        progress=False,
        workers=1,
        layout=Layout(shard_cells=SHARD),
    )
    materialize(
        s3.url("in/pq/*/*.parquet"),
        s3.url("dask"),
        progress=False,
        layout=Layout(shard_cells=SHARD),
        workers=Dask(scheduler=dask_cluster.scheduler_address),
    )
    assert _object_digests(s3, "dask") == _digests(tmp_path / "local")


def _bad_table(corpus_table):
    values = corpus_table.column("gene_expression").to_pylist()
    values[2900][0] = -1.0  # the last partition fails after the others were uploaded
    return corpus_table.set_column(
        corpus_table.column_names.index("gene_expression"),
        "gene_expression",
        __import__("pyarrow").array(values),
    )


def table_rows(table, rows):
    return table_csr(table.take(pa.array(np.asarray(rows, np.int64))))


def _generations(out: str) -> set[str]:
    return {key.split("/", 1)[0] for key, _ in S3Store(out).list() if key.startswith("gen-")}


def test_a_failed_overwrite_on_s3_leaves_the_old_dataset_whole(s3, corpus, corpus_table, tmp_path):
    pq.write_table(corpus_table, tmp_path / "good.parquet")
    pq.write_table(_bad_table(corpus_table), tmp_path / "bad.parquet")
    out = s3.url("ds")
    materialize(tmp_path / "good.parquet", out, progress=False, workers=2, layout=Layout(shard_cells=SHARD))
    before = _object_digests(s3, "ds")
    with pytest.raises(oj.OmicsIOError, match="already holds a dataset; pass --overwrite"):
        materialize(tmp_path / "good.parquet", out, progress=False, layout=Layout(shard_cells=SHARD))
    with pytest.raises(oj.DataValidationError, match="negative gene_expression -1.0 in row 2900"):
        materialize(
            tmp_path / "bad.parquet",
            out,
            progress=False,
            workers=2,
            overwrite=True,
            layout=Layout(shard_cells=SHARD),
        )
    assert _object_digests(s3, "ds") == before  # untouched; what the failed run wrote was removed
    assert oj.verify_dataset(out) == []
    s3.client().put_object(Bucket=s3.bucket, Key="ds2/notes.txt", Body=b"mine")
    with pytest.raises(oj.OmicsIOError, match="refusing to write into .* holds 1 object"):
        materialize(
            tmp_path / "good.parquet",
            s3.url("ds2"),
            progress=False,
            overwrite=True,
            layout=Layout(shard_cells=SHARD),
        )


def test_a_failed_run_whose_objects_cannot_be_removed_says_they_remain(
    s3, corpus_table, tmp_path, monkeypatch, capsys
):
    """The store that failed the run may fail its cleanup too (an endpoint gone or stalled): the
    line then says the unfinished run's objects remain and how they go, not that nothing was written."""
    pq.write_table(_bad_table(corpus_table), tmp_path / "bad.parquet")
    pq.write_table(corpus_table, tmp_path / "good.parquet")

    def unreachable(self, keys):
        raise oj.ObjectStoreError(f"cannot reach the S3 endpoint (for {self.url})")

    monkeypatch.setattr(S3Store, "delete", unreachable)
    args = [
        "--shard-cells",
        str(SHARD),
        "--workers",
        "1",
        "--no-progress",
        "--obs",
        "batch",
    ]  # (no n_genes note)
    assert main([str(tmp_path / "bad.parquet"), s3.url("failed"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "negative gene_expression -1.0 in row 2900" in err, err
    assert (
        f"; objects of the unfinished run remain under {s3.url('failed')} (removing them failed too: " in err
    )
    assert err.rstrip().endswith("the next run there with --overwrite removes them"), err
    assert S3Store(s3.url("failed")).list()  # they do remain

    from materialize import _finalize

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_finalize.Finalizer, "finish", stopped)  # Ctrl-C once every partition is written
    assert main([str(tmp_path / "good.parquet"), s3.url("stopped"), *args]) == 130
    err = capsys.readouterr().err
    assert err.startswith(
        f"omicsio-materialize: interrupted; objects of the unfinished run remain under {s3.url('stopped')}"
    )


def test_an_overwrite_on_s3_switches_generations_and_old_readers_never_see_new_bytes(
    s3, corpus, corpus_table, tmp_path
):
    pq.write_table(corpus_table, tmp_path / "good.parquet")
    half = corpus_table.slice(0, 1500)
    pq.write_table(half, tmp_path / "half.parquet")
    out = s3.url("ds")
    materialize(tmp_path / "good.parquet", out, progress=False, layout=Layout(shard_cells=SHARD))
    old = oj.open_dataset(out, cache_dir=tmp_path / "cache-old")
    expected_old = old.read_csr([0, 1, 2])
    materialize(
        tmp_path / "half.parquet", out, progress=False, overwrite=True, layout=Layout(shard_cells=SHARD)
    )
    (generation,) = _generations(out)
    assert all(key == "manifest.json" or key.startswith(f"{generation}/") for key, _ in S3Store(out).list())
    with oj.open_dataset(out, cache_dir=tmp_path / "cache-new") as new:
        assert new.num_cells == 1500 and str(new.path).endswith(generation)
        assert_csr_equal(new.read_csr([0, 1, 2]), table_rows(half, [0, 1, 2]))
        assert oj.open_dataset(new.path, **new.open_options).num_cells == 1500  # the generation itself
    assert oj.verify_dataset(out) == []
    assert_csr_equal(old.read_csr([0, 1, 2]), expected_old)  # what it had fetched: the old bytes
    try:  # cells it never fetched: the old generation is gone, which is an error, never the new bytes
        got = old.read_csr(np.arange(2000, 2900))
    except oj.OmicsIOError as e:
        assert "\n" not in str(e)
    else:
        assert_csr_equal(got, table_rows(corpus_table, np.arange(2000, 2900)))
    old.close()
    materialize(
        tmp_path / "good.parquet", out, progress=False, overwrite=True, layout=Layout(shard_cells=SHARD)
    )
    assert len(_generations(out)) == 1 and _generations(out) != {generation}  # the previous one deleted


@pytest.mark.parametrize("stage", ["write", "switch", "delete"])
def test_a_writer_killed_at_any_stage_of_an_overwrite_leaves_a_whole_dataset(
    s3, corpus, corpus_table, tmp_path, stage
):
    pq.write_table(corpus_table, tmp_path / "good.parquet")
    half = corpus_table.slice(0, 1500)
    pq.write_table(half, tmp_path / "half.parquet")
    out = s3.url("ds")
    materialize(tmp_path / "good.parquet", out, progress=False, layout=Layout(shard_cells=SHARD))
    run = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).parent / "_overwrite_worker.py"),
            str(tmp_path / "half.parquet"),
            out,
            stage,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        # (its scratch under tmp_path: a process killed mid-run cannot remove its temporary folders)
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "TMPDIR": str(tmp_path)},
    )
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert oj.verify_dataset(out) == []
    want, rows = (half, 1500) if stage == "delete" else (corpus_table, corpus_table.num_rows)
    with oj.open_dataset(out, cache_dir=tmp_path / "cache") as ds:
        assert ds.num_cells == rows
        assert_csr_equal(ds.read_csr(np.arange(0, rows, 7)), table_rows(want, np.arange(0, rows, 7)))
    # the next overwrite finishes the job: one generation, no leftovers
    materialize(
        tmp_path / "half.parquet", out, progress=False, overwrite=True, layout=Layout(shard_cells=SHARD)
    )
    (generation,) = _generations(out)
    assert all(key == "manifest.json" or key.startswith(f"{generation}/") for key, _ in S3Store(out).list())
    assert oj.verify_dataset(out) == []


def test_object_storage_errors_are_one_line(s3, corpus, tmp_path, monkeypatch, capsys):
    args = [str(corpus.cells_parquet), "--shard-cells", str(SHARD), "--no-progress"]
    assert main([*args[:1], "s3://no-such-bucket/ds", *args[1:]]) == 2
    assert "bucket 'no-such-bucket' does not exist" in capsys.readouterr().err
    assert main([s3.url("missing/*.parquet"), str(tmp_path / "out")]) == 2
    assert "no input files found for 's3://omicsio-test/missing/*.parquet'" in capsys.readouterr().err
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert main([*args[:1], s3.url("ds"), *args[1:]]) == 2
    assert "cannot reach the S3 endpoint http://127.0.0.1:9" in capsys.readouterr().err
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    assert main([*args[:1], s3.url("ds"), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "no AWS credentials for s3://omicsio-test/ds: set AWS_ACCESS_KEY_ID" in err
    )


def _no_bucket(s3, url: str) -> str:
    return (
        f"bucket 'nosuchbucket' does not exist at {s3.endpoint} (for {url}): create it, or check the "
        "URL and AWS_ENDPOINT_URL"
    )


def _tiny_cells(tmp_path) -> str:
    path = tmp_path / "cells.parquet"
    table = {
        "cell_id": ["a", "b"],
        "gene_token_id": pa.array([[0, 2], [1]], pa.list_(pa.int32())),
        "gene_expression": pa.array([[1.0, 2.0], [3.0]], pa.list_(pa.float32())),
    }
    pq.write_table(pa.table(table), path)
    return str(path)


@pytest.mark.parametrize(
    "args",
    [
        ["s3://nosuchbucket/data/*.parquet"],
        ["s3://nosuchbucket/data/cells.parquet"],
        ["s3://nosuchbucket/cells.h5ad"],
        ["CELLS", "--genes", "s3://nosuchbucket/g.parquet"],
    ],
    ids=["glob", "parquet", "h5ad", "genes"],
)
def test_an_input_in_a_missing_bucket_is_a_one_line_error(s3, tmp_path, monkeypatch, capsys, args):
    import gc

    unraisable = []  # e.g. fsspec's "Exception ignored in: AbstractBufferedFile.__del__"
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    args = [_tiny_cells(tmp_path) if a == "CELLS" else a for a in args]
    out = tmp_path / "out"
    assert main([args[0], str(out), *args[1:], "--no-progress"]) == 2
    gc.collect()
    url = next(a for a in args if a.startswith("s3://"))
    assert capsys.readouterr().err == f"omicsio-materialize: error: {_no_bucket(s3, url)}\n"
    assert not out.exists() and unraisable == []


def test_open_table_on_a_missing_bucket_is_a_one_line_error(s3):
    with pytest.raises(oj.ObjectStoreError) as e:
        oj.open_table("s3://nosuchbucket/data/")
    assert str(e.value) == _no_bucket(s3, "s3://nosuchbucket/data/")


def test_an_unreachable_input_endpoint_is_a_one_line_error(s3, tmp_path, monkeypatch, capsys):
    from omicsio_jax.storage.input_files import s3_filesystem

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    s3_filesystem.cache_clear()  # made for the server's endpoint by an earlier test
    out = tmp_path / "out"
    try:
        for args in ([s3.url("data/cells.parquet")], [_tiny_cells(tmp_path), "--genes", s3.url("g.parquet")]):
            assert main([args[0], str(out), *args[1:], "--no-progress"]) == 2
            assert capsys.readouterr().err == (
                f"omicsio-materialize: error: cannot reach the S3 endpoint http://127.0.0.1:9 (for "
                f"{args[-1]}): check AWS_ENDPOINT_URL and the network\n"
            )
            assert not out.exists()
    finally:
        s3_filesystem.cache_clear()


def test_open_table_over_s3_gives_the_local_answers(s3, corpus, corpus_table, tmp_path):
    _upload_inputs(s3, corpus, corpus_table, tmp_path)
    local, remote = oj.open_table(str(tmp_path / "in" / "pq")), oj.open_table(s3.url("in/pq/"))
    assert remote.num_cells == local.num_cells == corpus_table.num_rows
    assert remote.genes.table.equals(local.genes.table)
    np.testing.assert_array_equal(
        remote.select("tissue = 'lung' AND plate = 1"), local.select("tissue = 'lung' AND plate = 1")
    )
    np.testing.assert_array_equal(
        remote.cells_expressing([3, 40], mode="any"), local.cells_expressing([3, 40], mode="any")
    )
    rows = [5, 1300, 2999]
    np.testing.assert_array_equal(
        remote.panel([0, 3, 17], rowids=rows).x, local.panel([0, 3, 17], rowids=rows).x
    )


def test_an_anndata_zarr_store_on_s3(s3, corpus, tmp_path):
    import warnings

    import anndata as ad

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anndata's notes on zarr formats to come
        ad.read_h5ad(corpus.h5ad).write_zarr(tmp_path / "in" / "cells.zarr")
    local = tmp_path / "in"
    names = [p.relative_to(local).as_posix() for p in sorted(local.rglob("*")) if p.is_file()]
    S3Store(s3.url("in")).upload(local, names)
    kw = dict(progress=False, layout=Layout(shard_cells=SHARD))
    materialize(corpus.h5ad, tmp_path / "local", workers=1, **kw)
    materialize(s3.url("in/cells.zarr"), tmp_path / "remote", workers=2, **kw)
    local_ds, remote_ds = oj.open_dataset(tmp_path / "local"), oj.open_dataset(tmp_path / "remote")
    assert [s.sha256 for s in remote_ds.manifest.shards] == [s.sha256 for s in local_ds.manifest.shards]
    assert remote_ds.cell_ids.tolist() == local_ds.cell_ids.tolist()


def test_an_h5mu_on_s3_materializes_as_the_local_file_does(s3, tmp_path):
    """An ``s3://`` ``.h5mu``: its modalities listed, aligned and read through fsspec's ranges, as an
    ``.h5ad`` is; the same bytes as from the local file."""
    from _multimodal_data import Truth, write_h5mu

    local = write_h5mu(Truth(seed=3), tmp_path / "multiome.h5mu")
    s3.client().put_object(Bucket=s3.bucket, Key="in/multiome.h5mu", Body=local.read_bytes())
    materialize(str(local), tmp_path / "local", progress=False, workers=1, layout=Layout(shard_cells=SHARD))
    remote = s3.url("in/multiome.h5mu")
    materialize(remote, tmp_path / "remote", progress=False, workers=1, layout=Layout(shard_cells=SHARD))
    assert oj.open_dataset(tmp_path / "remote").modalities == ("rna", "atac")
    digests = {}
    for where in ("local", "remote"):  # a manifest by its fingerprint (it also names the input)
        digests[where] = _digests(tmp_path / where)
        for key in [k for k in digests[where] if k.endswith("/manifest.json")]:
            digests[where][key] = json.loads((tmp_path / where / key).read_text())["fingerprint"]
    assert digests["remote"] == digests["local"]


@pytest.mark.parametrize("name", ["cells.h5ad", "multiome.h5mu"])
def test_a_missing_anndata_object_in_a_bucket_is_named_as_missing(s3, tmp_path, capsys, name):
    out = tmp_path / "out"
    assert main([s3.url(f"in/{name}"), str(out), "--no-progress"]) == 2
    assert (
        capsys.readouterr().err
        == f"omicsio-materialize: error: cannot read {s3.url(f'in/{name}')}: no such object\n"
    )
    assert not out.exists()


def test_a_prefix_left_by_a_killed_run_asks_for_overwrite(s3, corpus, tmp_path):
    """Only a run's own objects (its parts) and no manifest: refused without --overwrite, which it
    names; with it, they are removed and the dataset written."""
    s3.client().put_object(Bucket=s3.bucket, Key="ds/_parts/p-000.shard", Body=b"partial")
    cells = _tiny_cells(tmp_path)
    with pytest.raises(
        oj.OmicsIOError, match=r"1 object\(s\) of an unfinished materialize run .* pass --overwrite"
    ):
        materialize(cells, s3.url("ds"), progress=False)
    materialize(cells, s3.url("ds"), progress=False, overwrite=True)
    assert oj.verify_dataset(s3.url("ds")) == []
    assert not [key for key, _ in S3Store(s3.url("ds")).list() if key.startswith("_parts/")]
    # written into a generation of its own, not in place over the killed run's keys: what that run's
    # workers may still upload (they outlive a SIGKILL by a moment) lands beside it, not on it
    assert json.loads(S3Store(s3.url("ds")).read_text("manifest.json"))["generation"].startswith("gen-")
    for key in ("shard-00000.arrayrecord", "_parts/p-00000/part.json", "cell_ids.parquet"):
        s3.client().put_object(Bucket=s3.bucket, Key=f"ds/{key}", Body=b"a stray upload")
    assert oj.verify_dataset(s3.url("ds")) == []
    with oj.open_dataset(s3.url("ds")) as ds:
        assert ds.cell_ids.tolist() == ["a", "b"]


def _lease_of(s3, prefix: str) -> dict | None:
    from materialize._lease import LEASE_NAME

    data = S3Store(s3.url(prefix)).read_bytes(LEASE_NAME)
    return None if data is None else json.loads(data)


def _put_lease(s3, prefix: str, *, expires_in: float, pid: int = 4242, space: str = "elsewhere") -> dict:
    """A lease object as another run's (in process space ``space``: host, boot, pid namespace),
    expiring ``expires_in`` seconds from now."""
    import time

    from materialize._lease import LEASE_NAME

    body = {"run": "0" * 16, "host": "elsewhere", "pid": pid, "space": space, "started": time.time() - 600}
    body["expires"] = time.time() + expires_in
    s3.client().put_object(Bucket=s3.bucket, Key=f"{prefix}/{LEASE_NAME}", Body=json.dumps(body).encode())
    return body


def test_a_second_run_into_a_prefix_being_written_is_refused(s3, tmp_path, monkeypatch, capsys):
    """While a run writes a prefix (it holds the lease), another run into it is refused in one line
    naming the holder, by `check_output` and by the lease itself; the first run completes, and its
    lease goes with it."""
    from materialize import _finalize
    from materialize._lease import Lease

    cells, out = _tiny_cells(tmp_path), s3.url("ds")
    finish, seen = _finalize.Finalizer.finish, []

    def meanwhile(self, **kwargs):
        holder = _lease_of(s3, "ds")
        with pytest.raises(oj.OmicsIOError, match=r"another materialize run is writing .*ds \(host ") as e:
            materialize(cells, out, progress=False, overwrite=True)
        seen.append(str(e.value))
        with pytest.raises(oj.OmicsIOError, match=r"another materialize run is writing"):
            Lease(S3Store(out)).__enter__()
        assert _lease_of(s3, "ds")["run"] == holder["run"]  # the refused runs left it as it was
        return finish(self, **kwargs)

    monkeypatch.setattr(_finalize.Finalizer, "finish", meanwhile)
    assert main([cells, out, "--no-progress"]) == 0
    assert len(seen) == 1 and "\n" not in seen[0] and f"pid {os.getpid()}" in seen[0]
    assert oj.verify_dataset(out) == []
    assert _lease_of(s3, "ds") is None


def test_a_lease_left_by_a_killed_run_is_taken_over_once_it_expires(s3, tmp_path, capsys):
    """A run killed outright leaves its lease: refused while it would still hold (naming its host
    and pid, and the fix), taken over with a note once it has expired."""
    cells, out = _tiny_cells(tmp_path), s3.url("ds")
    _put_lease(s3, "ds", expires_in=60)
    assert main([cells, out, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "host elsewhere, pid 4242" in err and "wait for it to end" in err, err
    assert [k for k, _ in S3Store(out).list()] == [".materialize-lease.json"]  # nothing written
    _put_lease(s3, "ds", expires_in=-1)
    assert main([cells, out, "--no-progress"]) == 0
    assert "took over the lease on" in capsys.readouterr().err
    assert oj.verify_dataset(out) == []
    assert _lease_of(s3, "ds") is None


def test_a_lease_whose_process_is_gone_from_this_host_is_taken_over_at_once(s3, tmp_path, capsys):
    """A lease of a process of this host (the same boot and pid namespace) that no longer runs holds
    no more, expired or not: the run killed on this machine does not make the next wait. One of a
    process that runs holds."""
    from materialize._lease import _process_space

    cells, out = _tiny_cells(tmp_path), s3.url("ds")
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    _put_lease(s3, "ds", expires_in=100, pid=os.getppid(), space=_process_space())
    assert main([cells, out, "--no-progress", "--overwrite"]) == 2
    assert "another materialize run is writing" in capsys.readouterr().err
    _put_lease(s3, "ds", expires_in=100, pid=int(gone.stdout), space=_process_space())
    assert main([cells, out, "--no-progress", "--overwrite"]) == 0
    assert "took over the lease on" in capsys.readouterr().err
    assert oj.verify_dataset(out) == [] and _lease_of(s3, "ds") is None
    # a prefix that held nothing but the lease is written in a generation all the same: the run that
    # held the lease may still upload under the in-place names
    assert json.loads(S3Store(out).read_text("manifest.json"))["generation"].startswith("gen-")


def test_a_renewal_the_client_retried_after_it_landed_keeps_the_lease(s3, monkeypatch):
    """A conditional PUT retried after its first try landed (a lost answer) fails its condition
    against its own new ETag: the lease read back is this run's, and it holds on."""
    from materialize._lease import Lease

    real, landed = S3Store.put_if, []

    def answer_lost(self, key, data, etag=None):
        got = real(self, key, data, etag)
        if etag is not None and not landed:  # the first renewal lands, its answer "lost", and the retry fails
            landed.append(got)
            return real(self, key, data, etag)
        return got

    monkeypatch.setattr(S3Store, "put_if", answer_lost)
    with Lease(S3Store(s3.url("ds"))) as lease:
        lease.check()  # renewed; its retry found its own lease
        assert landed and lease.holds()
        lease.check()
    assert _lease_of(s3, "ds") is None


@pytest.mark.parametrize("replacing", [False, True], ids=["new", "overwrite"])
def test_a_run_that_lost_its_lease_stops_before_its_manifest(s3, tmp_path, monkeypatch, replacing):
    """A run whose lease another run took over meanwhile (it stalled past the lease's expiry) puts no
    manifest in place and deletes nothing: a new dataset is not made current, an old one stays."""
    from materialize import _finalize

    cells, out = _tiny_cells(tmp_path), s3.url("ds")
    before = None
    if replacing:
        materialize(cells, out, progress=False)
        before = _object_digests(s3, "ds")
    finish, other = _finalize.Finalizer.finish, {}

    def taken_over(self, **kwargs):
        other.update(_put_lease(s3, "ds", expires_in=120, pid=99))
        return finish(self, **kwargs)

    monkeypatch.setattr(_finalize.Finalizer, "finish", taken_over)
    with pytest.raises(
        oj.OmicsIOError, match=r"this run no longer holds its lease on .*ds .* leaves the prefix to that run"
    ):
        materialize(cells, out, progress=False, overwrite=replacing)
    assert _lease_of(s3, "ds") == other  # the other run's, untouched
    if replacing:  # the old dataset current and whole (the new run's generation is left to the other)
        after = _object_digests(s3, "ds")
        assert {k: after.get(k) for k in before} == before
        assert oj.verify_dataset(out) == []
    else:
        assert "manifest.json" not in [k for k, _ in S3Store(out).list()]


def test_a_run_whose_lease_a_renewal_found_taken_stops_handing_out_partitions(
    s3, corpus, tmp_path, monkeypatch
):
    """The lease renewed every moment here: once a renewal finds it taken over (the run stalled, or
    it was removed), the next partition to finish stops the run, rather than the run writing every
    partition only to be refused at its manifest."""
    import time

    from materialize import _finalize, _lease

    monkeypatch.setattr(_lease, "RENEW_SECONDS", 0.05)
    add, seen, other = _finalize.Finalizer.add, [], {}

    def taken_over_after_the_first(self, index):
        seen.append(index)
        if len(seen) == 1:
            other.update(_put_lease(s3, "ds", expires_in=120, pid=99))
            time.sleep(0.5)  # a renewal or more meanwhile
        return add(self, index)

    monkeypatch.setattr(_finalize.Finalizer, "add", taken_over_after_the_first)
    with pytest.raises(
        oj.OmicsIOError, match=r"this run no longer holds its lease on .*ds \(another run took"
    ):
        materialize(
            corpus.cells_parquet, s3.url("ds"), progress=False, workers=1, layout=Layout(shard_cells=SHARD)
        )
    assert len(seen) == 1  # the next partition to finish stopped it
    assert _lease_of(s3, "ds") == other


@pytest.mark.parametrize("command", ["index", "stats"])
def test_index_and_stats_on_object_storage_are_one_line_errors(s3, tmp_path, monkeypatch, capsys, command):
    """``index`` and ``stats`` write local folders: an ``s3://`` one is refused before any work, in one
    line (index built everything, then failed with a traceback and left a folder named ``s3:``)."""
    monkeypatch.chdir(tmp_path)
    cells = _tiny_cells(tmp_path)
    args = [cells, s3.url("idx")] if command == "index" else [s3.url("ds")]
    assert main([command, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is on object storage" in err, err
    assert not (tmp_path / "s3:").exists()
