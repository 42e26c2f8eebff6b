"""Edges of reading a dataset from S3 (moto on 127.0.0.1): a dataset rewritten or replaced under its
prefix while open says to open it again, and a bad endpoint is a one-line error."""

from __future__ import annotations

import json

import pytest
from conftest import upload_dataset

import omicsio_jax as oj
from omicsio_jax.storage.store import ObjectChangedError, ObjectStoreError, S3Store

PREFIX = "atlas/v1/"


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
