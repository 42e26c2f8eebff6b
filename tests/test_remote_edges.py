"""Edges of reading a dataset from S3 (moto on 127.0.0.1): a dataset rewritten or replaced under its
prefix while open says to open it again (its small files and its shards, by one check), a shard the
manifest lists but the bucket lacks says to run verify, and a bad endpoint or an ``s3://`` URL with no
bucket is a one-line error."""

from __future__ import annotations

import json

import pytest
from conftest import upload_dataset

import omicsio_jax as oj
from omicsio_jax.storage.store import ObjectChangedError, ObjectStoreError, S3Store

PREFIX = "atlas/v1/"
SHARD_1 = "shard-00001.arrayrecord"  # cells 1,024..2,047: first used after the overwrite


@pytest.fixture
def url(s3, dataset_dir):
    upload_dataset(dataset_dir, s3.url(PREFIX))
    return s3.url(PREFIX)


def _open(url, tmp_path, **kw):
    return oj.open_dataset(url, cache_dir=tmp_path / "cache", **kw)


def test_an_endpoint_without_a_scheme_is_a_one_line_error(url, tmp_path, monkeypatch):
    endpoint = S3Store(url).endpoint.removeprefix("http://")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(
        ObjectStoreError, match=rf"has no scheme: set AWS_ENDPOINT_URL to http://{endpoint}"
    ) as e:
        _open(url, tmp_path)
    assert "\n" not in str(e.value)


def test_a_shard_deleted_while_in_use_says_to_open_the_dataset_again(url, s3, tmp_path):
    with _open(url, tmp_path) as ds:
        ds.read_csr([0])
        s3.client().delete_object(Bucket=s3.bucket, Key=PREFIX + "shard-00000.arrayrecord")
        with pytest.raises(
            ObjectChangedError, match=r"shard-00000.arrayrecord was deleted while in use .* open it again"
        ):
            ds.read_csr([900])


def test_a_sidecar_of_a_rewritten_dataset_says_to_open_the_dataset_again(url, s3, dataset_dir, tmp_path):
    manifest = json.loads((dataset_dir / "manifest.json").read_text())
    with _open(url, tmp_path) as ds:
        ds.read_csr([0])
        # rewritten in place: the new features listed by the new manifest
        for f in manifest["files"]:
            if f["path"] == "features.parquet":
                f["sha256"] = "0" * 64
        client = s3.client()
        client.put_object(Bucket=s3.bucket, Key=PREFIX + "features.parquet", Body=b"new features")
        client.put_object(Bucket=s3.bucket, Key=PREFIX + "manifest.json", Body=json.dumps(manifest).encode())
        with pytest.raises(
            ObjectChangedError, match=r"features.parquet is no longer the one .* rewritten .* open it again"
        ):
            _ = ds.features
        # replaced by a new generation: the old objects deleted
        client.put_object(
            Bucket=s3.bucket, Key=PREFIX + "manifest.json", Body=json.dumps({"generation": "gen-0a"}).encode()
        )
        client.delete_object(Bucket=s3.bucket, Key=PREFIX + "cell_ids.parquet")
        with pytest.raises(
            ObjectChangedError, match=r"cell_ids.parquet is no longer the one .* open it again"
        ) as e:
            _ = ds.cell_ids
        assert "\n" not in str(e.value)


def test_a_corrupted_sidecar_the_manifest_still_lists_is_a_format_error(url, s3, tmp_path):
    s3.client().put_object(Bucket=s3.bucket, Key=PREFIX + "features.parquet", Body=b"not the features")
    with _open(url, tmp_path) as ds, pytest.raises(oj.DatasetFormatError, match="corrupted or was rewritten"):
        _ = ds.features


def test_an_input_endpoint_without_a_scheme_is_a_one_line_error(url, monkeypatch):
    from omicsio_jax.storage.input_files import as_input_path, s3_filesystem

    endpoint = S3Store(url).endpoint.removeprefix("http://")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    s3_filesystem.cache_clear()
    try:
        with pytest.raises(ObjectStoreError, match=r"has no scheme: set AWS_ENDPOINT_URL to http://"):
            as_input_path(url + "features.parquet").exists()
    finally:
        s3_filesystem.cache_clear()


def test_a_shard_a_new_generation_deleted_says_to_open_the_dataset_again(url, s3, tmp_path):
    with _open(url, tmp_path) as ds:
        ds.read_csr([0])
        client = s3.client()  # replaced by a new generation: the old objects deleted
        client.put_object(
            Bucket=s3.bucket, Key=PREFIX + "manifest.json", Body=json.dumps({"generation": "gen-0a"}).encode()
        )
        client.delete_object(Bucket=s3.bucket, Key=PREFIX + SHARD_1)
        with pytest.raises(
            ObjectChangedError, match=rf"{SHARD_1} is no longer the one .* rewritten .* open it again"
        ) as e:
            ds.read_csr([1500])
        assert "\n" not in str(e.value)


def test_a_shard_rewritten_in_place_says_to_open_the_dataset_again(url, s3, dataset_dir, tmp_path):
    manifest = json.loads((dataset_dir / "manifest.json").read_text())
    with _open(url, tmp_path) as ds:
        ds.read_csr([0])
        for shard in manifest["shards"]:  # the new shard listed by the new manifest
            if shard["path"] == SHARD_1:
                shard["num_bytes"], shard["sha256"] = 9, "0" * 64
        client = s3.client()
        client.put_object(Bucket=s3.bucket, Key=PREFIX + SHARD_1, Body=b"new shard")
        client.put_object(Bucket=s3.bucket, Key=PREFIX + "manifest.json", Body=json.dumps(manifest).encode())
        with pytest.raises(ObjectChangedError, match=rf"{SHARD_1} is no longer the one .* open it again"):
            ds.read_csr([1500])


def test_a_shard_missing_while_the_manifest_still_lists_it_says_to_run_verify(url, s3, tmp_path):
    s3.client().delete_object(Bucket=s3.bucket, Key=PREFIX + SHARD_1)
    with _open(url, tmp_path) as ds:
        ds.read_csr([0])
        with pytest.raises(
            oj.DatasetFormatError, match=rf"{SHARD_1} is listed in the manifest but missing; run"
        ):
            ds.read_csr([1500])


@pytest.mark.parametrize("url", ["s3://", "s3:///", "s3:///atlas/"])
def test_an_s3_url_without_a_bucket_names_the_expected_form(url):
    with pytest.raises(oj.OmicsIOError, match=r"names no bucket; use s3://BUCKET/PREFIX") as e:
        oj.open_dataset(url)
    assert "\n" not in str(e.value) and "not a directory" not in str(e.value)


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
    """The small files (`FileCache`) and the shards (`mirror_files`) share one check: an object the
    prefix's manifest lists as the opened manifest does is not rewritten; one listed otherwise, not
    listed, under a new generation, or with no or a broken manifest is, and says to open again."""
    from omicsio_jax.dataset import cache, mirror_files
    from omicsio_jax.storage.store import ObjectChangedError

    assert mirror_files.raise_if_rewritten is cache.raise_if_rewritten
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
