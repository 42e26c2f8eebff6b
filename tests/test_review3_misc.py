"""A shard an overwrite deleted or rewrote says to open the dataset again, ``s3://`` with no bucket is a
one-line error, and one Ensembl-id pattern serves the runtime and materialize."""

from __future__ import annotations

import json

import pytest
from conftest import upload_dataset

import omicsio_jax as oj
from omicsio_jax.storage.store import ObjectChangedError

PREFIX = "atlas/v1/"
SHARD_1 = "shard-00001.arrayrecord"  # cells 1,024..2,047: first used after the overwrite


@pytest.fixture
def url(s3, dataset_dir):
    upload_dataset(dataset_dir, s3.url(PREFIX))
    return s3.url(PREFIX)


def _open(url, tmp_path):
    return oj.open_dataset(url, cache_dir=tmp_path / "cache")


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


# Real Ensembl gene ids (human, mouse, chicken; with a version suffix) and what must not pass for one:
# gene symbols (some starting with ENS), a transcript id, toy ids with too few digits, a trailing
# newline, non-ASCII digits (Python's \d takes them, Arrow's RE2 not).
ENSEMBL_IDS = [
    "ENSG00000141510",
    "ENSG00000141510.17",
    "ENSMUSG00000064370",
    "ENSMUSG00000064370.1",
    "ENSGALG00000000003",
]
NOT_ENSEMBL = [
    "TP53",
    "ENSA",
    "Ensa",
    "ENSAP1",
    "ENST00000269305",
    "ENSG1",
    "ENSG1.2",
    "ENSG00000141510\n",
    "ENSG١٢٣٤٥٦",
    "",
]


def test_the_runtime_takes_ensembl_ids_in_any_case_and_folds_their_version():
    from omicsio_jax.format.genes import fold_ensembl, is_ensembl_id

    for key in ENSEMBL_IDS:
        assert is_ensembl_id(key) and is_ensembl_id(key.lower()), key
        assert fold_ensembl(key.lower()) == key.split(".")[0]
    for key in NOT_ENSEMBL:
        assert not is_ensembl_id(key), key
        assert fold_ensembl(key) == key.upper()  # a symbol is upper-cased only, "ENSG1.2" kept whole


def test_materialize_takes_the_ensembl_ids_the_runtime_takes_as_written():
    import pyarrow as pa

    from materialize._genekeys import ensembl_like, gene_keys, strip_version
    from omicsio_jax.format import ENSEMBL_GENE_ID
    from omicsio_jax.format.genes import is_ensembl_id

    for key in ENSEMBL_IDS + NOT_ENSEMBL:
        # the Python and the Arrow (RE2) reading of the one pattern agree, and with the runtime's
        assert (
            ensembl_like(pa.array([key]))
            == (ENSEMBL_GENE_ID.fullmatch(key) is not None)
            == is_ensembl_id(key)
        )
        assert strip_version(key) == (key.split(".")[0] if key in ENSEMBL_IDS else key)
    assert not ensembl_like(pa.array(["ensg00000141510"]))  # stored ids are matched as written
    genes = pa.table({"gene_ids": ENSEMBL_IDS, "gene_name": ["TP53", "mt-Nd1", "a", "b", "c"]})
    keys = gene_keys(genes, "source 0")
    assert (keys.by, keys.column) == ("ensembl", "gene_ids")
    assert keys.ids.to_pylist() == [k.split(".")[0] for k in ENSEMBL_IDS]
    toys = gene_keys(pa.table({"gene_ids": ["ENSG1", "ENSG2"], "gene_name": ["A", "B"]}), "source 1")
    assert (toys.by, toys.column) == ("symbol", "gene_name")  # too few digits: not Ensembl ids


def test_a_gene_vocabulary_keeps_the_ensembl_ids_the_runtime_takes(tmp_path):
    from materialize._genekeys import read_gene_list

    vocab = tmp_path / "token_dictionary.json"
    vocab.write_text(json.dumps({key: i for i, key in enumerate(NOT_ENSEMBL + ENSEMBL_IDS)}))
    assert read_gene_list(vocab) == [key.split(".")[0] for key in ENSEMBL_IDS]
