"""Datasets on S3 (moto on 127.0.0.1): exact reads through the sparse cache, few bytes fetched,
a bounded cache, changed or corrupted objects reported, one-line errors for a bad setup."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import assert_csr_equal, upload_dataset

import omicsio_jax as oj
from omicsio_jax.dataset.mirrors import split_spans
from omicsio_jax.format.chunk_index import chunk_index_path, merge_spans
from omicsio_jax.storage.store import ObjectChangedError, ObjectStoreError, S3Store

PREFIX = "atlas/v1/"


@pytest.fixture
def local(dataset_dir):
    with oj.open_dataset(dataset_dir) as ds:
        yield ds


@pytest.fixture
def url(s3, dataset_dir):
    upload_dataset(dataset_dir, s3.url(PREFIX))
    return s3.url(PREFIX)


def _open(url, tmp_path, **kw):
    return oj.open_dataset(url, cache_dir=tmp_path / "cache", **kw)


def _batches(ds, **kw):
    loader = oj.make_loader(ds, batch_size=64, sampling=oj.Block(16, 8), seed=0, num_epochs=1, **kw)
    return [jax.tree.map(np.asarray, (b.x, b.index)) for b in loader]


def test_read_csr_of_random_rows_equals_the_local_dataset(url, local, tmp_path):
    rows = np.random.default_rng(0).integers(0, local.num_cells, 700)
    rows[:50] = rows[50:100]  # repeats, any order
    with _open(url, tmp_path) as ds:
        assert ds.is_remote and ds.path == url.rstrip("/") and ds.num_cells == local.num_cells
        assert_csr_equal(ds.read_csr(rows), local.read_csr(rows))
        assert ds.read_records(1000, 1100) == local.read_records(1000, 1100)  # across a shard boundary


@pytest.mark.parametrize("output", ["dense", "csr"])
def test_loader_batches_equal_the_local_loader(url, local, tmp_path, output):
    with _open(url, tmp_path) as ds:
        remote, expected = _batches(ds, output=output), _batches(local, output=output)
        assert len(remote) == len(expected) > 0
        for (x, index), (x0, index0) in zip(remote, expected, strict=True):
            np.testing.assert_array_equal(index, index0)
            jax.tree.map(np.testing.assert_array_equal, x, x0)


def test_sidecars_equal_the_local_ones(url, local, tmp_path):
    with _open(url, tmp_path) as ds:
        assert "drug" in ds.obs and "obs=['cell_type', 'drug'" in repr(ds)
        assert ds.io_stats().files_downloaded == 0  # nothing downloaded before it is used
        assert ds.features.equals(local.features)
        np.testing.assert_array_equal(ds.cell_ids, local.cell_ids)
        assert list(ds.obs) == list(local.obs)
        for name, column in local.obs.items():
            if isinstance(column, oj.Categorical):
                assert ds.obs[name].categories == column.categories
                np.testing.assert_array_equal(ds.obs[name].codes, column.codes)
            else:
                np.testing.assert_array_equal(ds.obs[name], column)
        assert ds.gene_stats.equals(local.gene_stats)
        np.testing.assert_array_equal(ds.highly_variable_genes(50), local.highly_variable_genes(50))
        assert ds.local_path("features.parquet").parent == tmp_path / "cache"


@pytest.mark.parametrize("chunk_reader", [True, False])
def test_an_epoch_fetches_little_more_than_its_chunks_and_a_second_pass_none(
    url, local, tmp_path, chunk_reader
):
    with _open(url, tmp_path, chunk_reader=chunk_reader) as ds:
        first = _batches(ds)
        stats = ds.io_stats()
        assert stats.bytes_needed > 0 and stats.bytes_fetched / stats.bytes_needed <= 1.1
        # ArrayRecord's reader reads each shard's head, footer and postscript when it opens it; the chunk reader not
        assert stats.opening_gets == (0 if chunk_reader else 3 * len(ds.manifest.shards))
        assert stats.head_requests == len(ds.manifest.shards)
        # the chunks of the gaps merged into a GET are kept too
        assert stats.bytes_needed <= stats.cached_bytes <= stats.bytes_fetched
        again = _batches(ds)
        after = ds.io_stats()
        assert after.num_gets == stats.num_gets and after.chunk_hits > stats.chunk_hits  # all from the cache
    with _open(
        url, tmp_path, chunk_reader=chunk_reader
    ) as reopened:  # a new process, same cache_dir: nothing fetched
        third = _batches(reopened)
        s = reopened.io_stats()
        assert s.num_gets == s.opening_gets == s.files_downloaded == 0 and s.chunk_hits > 0
    for (x1, i1), (_, i2), (x3, i3) in zip(first, again, third, strict=True):
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_array_equal(i1, i3)
        np.testing.assert_array_equal(x1, x3)


def test_needed_bytes_are_exactly_the_chunks_of_the_rows_read(url, tmp_path):
    with _open(url, tmp_path) as ds:
        ds.read_csr([0, 1, 40, 1500])  # chunks 0 and 2 of shard 0, chunk 29 of shard 1 (16 cells each)
        index = [np.load(ds.local_path(chunk_index_path(s.path))) for s in ds.manifest.shards]

        def chunk(shard, c):
            return int(index[shard][3 + c, 1] - index[shard][3 + c, 0])

        s = ds.io_stats()
        assert s.bytes_needed == chunk(0, 0) + chunk(0, 2) + chunk(1, 29) and s.chunk_misses == 3
        assert s.bytes_fetched <= 1.1 * s.bytes_needed and s.opening_gets == 0 and s.head_requests == 2


def test_concurrent_fetches_are_exact_and_never_fetch_a_chunk_twice(url, local, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from omicsio_jax.dataset.batched_reads import FetchReader

    rng = np.random.default_rng(2)
    row_sets = [np.sort(rng.choice(local.num_cells, 400, replace=False)) for _ in range(8)]
    with _open(url, tmp_path) as ds:
        reader = FetchReader(ds)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(reader.read_sorted, row_sets))
        for rows, (buf, starts) in zip(row_sets, got, strict=True):
            want_buf, want_starts = FetchReader(local).read_sorted(rows)
            assert np.array_equal(buf, want_buf) and np.array_equal(starts, want_starts)
        unique_chunks = len(
            np.unique(np.concatenate(row_sets) // 16)
        )  # shards hold whole chunks (1024 = 64 × 16)
        assert ds.io_stats().chunk_misses <= unique_chunks  # (fewer: chunks of merged gaps count as hits)


def test_a_small_cache_stays_within_its_budget_and_reads_exactly(url, local, tmp_path):
    budget = int(1.5 * np.mean([s.num_bytes for s in local.manifest.shards]))
    rng = np.random.default_rng(1)
    with _open(url, tmp_path, cache_bytes=budget) as ds:
        assert ds.cache_bytes == budget
        for _ in range(2):
            for chunk in np.array_split(rng.permutation(local.num_cells), 20):
                assert_csr_equal(ds.read_csr(chunk), local.read_csr(chunk))
                assert ds.io_stats().cached_bytes <= budget
        batches = _batches(ds)
        stats = ds.io_stats()
        assert stats.evictions > 0 and stats.cached_bytes <= budget
    for (x, index), (x0, index0) in zip(batches, _batches(local), strict=True):
        np.testing.assert_array_equal(index, index0)
        np.testing.assert_array_equal(x, x0)
    cached = sum(p.stat().st_blocks * 512 for p in (tmp_path / "cache").glob("shard-*.arrayrecord"))
    assert cached <= budget + 3 * 256 << 10  # the files hold no more (plus each shard's opening ranges)


def test_an_object_replaced_while_open_raises_object_changed(url, dataset_dir, s3, tmp_path):
    with _open(url, tmp_path) as ds:
        ds.read_csr([0])
        shard = ds.manifest.shards[0].path
        data = bytearray((dataset_dir / shard).read_bytes())
        data[-1] ^= 0xFF
        s3.client().put_object(Bucket=s3.bucket, Key=PREFIX + shard, Body=bytes(data))
        with pytest.raises(ObjectChangedError, match=rf"{shard} changed while in use"):
            ds.read_csr([500])


def _flip_in_chunk(dataset_dir: Path, s3, shard: int = 1, chunk: int = 5) -> str:
    """Upload shard ``shard`` with one byte of data chunk ``chunk`` flipped (same size)."""
    path = f"shard-{shard:05d}.arrayrecord"
    begin, end = np.load(dataset_dir / chunk_index_path(path))[3 + chunk]
    data = bytearray((dataset_dir / path).read_bytes())
    data[(int(begin) + int(end)) // 2] ^= 0x01
    s3.client().put_object(Bucket=s3.bucket, Key=PREFIX + path, Body=bytes(data))
    return path


def test_a_corrupted_chunk_on_s3_is_reported_and_verify_finds_it(url, dataset_dir, s3, tmp_path, capsys):
    path = _flip_in_chunk(dataset_dir, s3)
    with _open(url, tmp_path) as ds:
        ds.read_csr(np.arange(1024, 1024 + 80))  # chunks 0..4: sound
        # the chunk holding cell 1110 (record 86 of the shard) fails its data hash
        with pytest.raises(
            oj.DatasetFormatError,
            match=rf"shard {path}: cells 1104\.\.1119 \(records 80\.\.95\) cannot "
            r"be read: chunk data hash mismatch; run `omicsio-materialize verify s3://",
        ):
            ds.read_csr([1110])
        with pytest.raises(oj.DatasetFormatError, match="omicsio-materialize verify"):
            _batches(ds)
    problems = oj.verify_dataset(url)
    assert len(problems) == 1 and problems[0].startswith(f"{path}: sha256")
    from materialize._cli import main

    assert main(["verify", url]) == 1
    assert f"{url}: {path}: sha256" in capsys.readouterr().err


def test_verify_accepts_an_s3_url(url, capsys):
    from materialize._cli import main

    assert oj.verify_dataset(url) == []
    assert main(["verify", url]) == 0
    assert capsys.readouterr().out.startswith(f"{url}: OK (3,000 cells, 3 shard(s)")


def test_a_damaged_cache_file_is_fetched_again(url, local, tmp_path):
    with _open(url, tmp_path) as ds:
        ds.read_csr(np.arange(0, 64))
    mirror = tmp_path / "cache" / local.manifest.shards[0].path
    with open(mirror, "r+b") as f:  # the cache says chunk 1 is there, but its bytes are not
        begin = int(np.load(tmp_path / "cache" / chunk_index_path(mirror.name))[4, 0])
        f.seek(begin + 50)
        f.write(b"\0" * 100)
    with _open(url, tmp_path) as ds:
        assert_csr_equal(ds.read_csr(np.arange(0, 64)), local.read_csr(np.arange(0, 64)))
        assert ds.io_stats().num_gets > 0


def test_a_mirror_another_process_dropped_or_replaced_is_opened_again(url, local, tmp_path):
    # processes sharing a cache directory (Grain's workers, several jobs) each keep their own budget:
    # one may delete, or replace, the mirror files another has open
    shard = local.manifest.shards[0]
    mirror = tmp_path / "cache" / shard.path
    with _open(url, tmp_path) as ds:
        for step, rows in enumerate(np.array_split(np.arange(shard.num_cells), 6)):
            if step % 2 == 0:  # another process's eviction of a dormant shard: the files unlinked
                for path in mirror.parent.glob(shard.path + "*"):
                    path.unlink()
            else:  # another process's fresh mirror renamed over this one's
                fresh = mirror.with_name("fresh.tmp")
                fresh.write_bytes(b"\0" * shard.num_bytes)
                fresh.replace(mirror)
            assert_csr_equal(ds.read_csr(rows), local.read_csr(rows))


def test_a_process_never_drops_the_mirror_another_is_reading(url, local, tmp_path):
    first, second = local.manifest.shards[0], local.manifest.shards[1]
    rows = np.arange(first.num_cells)
    mirror = tmp_path / "cache" / first.path
    with _open(url, tmp_path) as reader:
        reader.read_csr(rows)
        with reader._remote.mirrors.prepared([(0, 0, first.num_cells)]):  # reading shard 0 (a shared lock)
            with _open(url, tmp_path, cache_bytes=1) as other:  # another process's tiny budget
                other.read_csr(np.arange(second.first_cell, second.first_cell + 64))
                present = np.fromfile(mirror.with_name(first.path + ".present"), np.uint8)
                assert mirror.exists() and present.all()  # shard 0 kept (only its own shard 1 dropped)
            assert_csr_equal(reader.read_csr(rows), local.read_csr(rows))
        with _open(url, tmp_path, cache_bytes=1) as other:  # no longer read: dropped
            other.read_csr(np.arange(second.first_cell, second.first_cell + 64))
            present = np.fromfile(mirror.with_name(first.path + ".present"), np.uint8)
            assert mirror.exists() and not present.any()  # dropped in place: the file stays
        assert_csr_equal(reader.read_csr(rows), local.read_csr(rows))  # the reader opens it again


def test_a_local_write_error_while_downloading_is_not_blamed_on_the_store(url, tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-dir") as caught:
        S3Store(url).download("manifest.json", tmp_path / "no-such-dir" / "manifest.json")
    assert not isinstance(caught.value, ObjectStoreError)


def test_a_cache_left_for_another_version_of_a_shard_is_not_used(url, local, tmp_path):
    rows = np.arange(0, 200)
    with _open(url, tmp_path) as ds:
        ds.read_csr(rows)
    stamp = tmp_path / "cache" / (local.manifest.shards[0].path + ".etag")
    stamp.write_text('"an-older-etag" 1\n')
    with _open(url, tmp_path) as ds:
        assert_csr_equal(ds.read_csr(rows), local.read_csr(rows))
        s = ds.io_stats()
        assert s.opening_gets == 0 and s.chunk_misses == 13 and s.cached_bytes == s.bytes_needed
    assert stamp.read_text() != '"an-older-etag" 1\n'


def test_a_damaged_opening_range_is_fetched_again(url, local, tmp_path):
    with _open(url, tmp_path) as ds:
        ds.read_csr([3])
    mirror = tmp_path / "cache" / local.manifest.shards[0].path
    footer = np.load(tmp_path / "cache" / chunk_index_path(mirror.name))[1]
    with open(mirror, "r+b") as f:  # ArrayRecord's reader cannot open it (the chunk reader never fetched it)
        f.seek(int(footer[0]))
        f.write(b"\0" * int(footer[1] - footer[0]))
    with _open(url, tmp_path) as ds:  # the chunk reader never reads the footer
        assert_csr_equal(ds.read_csr([3, 700]), local.read_csr([3, 700]))
        assert ds.io_stats().opening_gets == 0
    with _open(url, tmp_path, chunk_reader=False) as ds:
        assert_csr_equal(ds.read_csr([3, 700]), local.read_csr([3, 700]))
        assert ds.io_stats().opening_gets == 3


def test_grain_source_reopens_a_remote_dataset_on_its_cache(url, local, tmp_path):
    kw = {"batch_size": 64, "sampling": oj.Block(16, 4), "seed": 3, "num_epochs": 1}
    with _open(url, tmp_path, cache_bytes=1 << 30) as ds:
        source = oj.GrainSource(ds, **kw)
        assert (source.cache_dir, source.cache_bytes) == (tmp_path / "cache", 1 << 30)
        np.testing.assert_array_equal(source[5].index, oj.GrainSource(local, **kw)[5].index)
        np.testing.assert_array_equal(source[5].x, oj.GrainSource(local, **kw)[5].x)


def test_a_changed_sidecar_is_reported(url, s3, tmp_path):
    s3.client().put_object(Bucket=s3.bucket, Key=PREFIX + "features.parquet", Body=b"not the features")
    with (
        _open(url, tmp_path) as ds,
        pytest.raises(
            oj.DatasetFormatError,
            match=r"features.parquet: 16 bytes .* run `omicsio-materialize verify s3://",
        ),
    ):
        _ = ds.features


def test_missing_manifest_bucket_endpoint_or_credentials_are_one_line_errors(url, s3, tmp_path, monkeypatch):
    def one_line(excinfo):
        assert "\n" not in str(excinfo.value)

    with pytest.raises(oj.DatasetFormatError, match=r"has no manifest.json") as e:
        oj.open_dataset(s3.url("nothing/here/"), cache_dir=tmp_path)
    one_line(e)
    with pytest.raises(ObjectStoreError, match=r"bucket 'no-such-bucket' does not exist") as e:
        oj.open_dataset("s3://no-such-bucket/atlas/", cache_dir=tmp_path)
    one_line(e)
    with monkeypatch.context() as m:
        m.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        with pytest.raises(ObjectStoreError, match=r"cannot reach the S3 endpoint http://127.0.0.1:9") as e:
            oj.open_dataset(url, cache_dir=tmp_path)
        one_line(e)
    with monkeypatch.context() as m:
        m.delenv("AWS_ACCESS_KEY_ID")
        m.delenv("AWS_SECRET_ACCESS_KEY")
        with pytest.raises(ObjectStoreError, match=r"no AWS credentials .* set AWS_ACCESS_KEY_ID") as e:
            oj.open_dataset(url, cache_dir=tmp_path)
        one_line(e)
    with pytest.raises(oj.OmicsIOError, match="cache_bytes must be positive"):
        oj.open_dataset(url, cache_dir=tmp_path, cache_bytes=0)


def test_an_endpoint_that_stops_answering_fails_within_the_timeout_set(url, s3, tmp_path, monkeypatch):
    """An endpoint that takes the connection and never answers (a stalled server): each request fails
    after OMICSIO_S3_TIMEOUT seconds and is retried within a minute of its first try, so the open
    fails in seconds at 1 (at the default 120, after one try of two minutes)."""
    import socket
    import threading
    import time

    silent = socket.create_server(("127.0.0.1", 0))
    held = []

    def accept() -> None:  # takes every connection, reads nothing, answers nothing
        with contextlib.suppress(OSError):
            while True:
                held.append(silent.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.setenv("OMICSIO_S3_TIMEOUT", "1")
    start = time.monotonic()
    with pytest.raises(
        ObjectStoreError, match=r"the S3 endpoint http://127.0.0.1:\d+ did not answer in time"
    ) as e:
        oj.open_dataset(url, cache_dir=tmp_path)
    assert time.monotonic() - start < 40 and "\n" not in str(e.value)
    silent.close()
    for connection in held:
        connection.close()
    for bad in ("abc", "0", "-5", "inf"):
        monkeypatch.setenv("OMICSIO_S3_TIMEOUT", bad)
        with pytest.raises(
            ObjectStoreError, match=rf"OMICSIO_S3_TIMEOUT='{bad}' is not a number of seconds above 0"
        ):
            oj.open_dataset(url, cache_dir=tmp_path)


def test_a_missing_shard_is_reported_on_first_use(url, s3, tmp_path):
    s3.client().delete_object(Bucket=s3.bucket, Key=PREFIX + "shard-00002.arrayrecord")
    with _open(url, tmp_path) as ds:
        ds.read_csr([0])
        with pytest.raises(
            oj.DatasetFormatError,
            match=r"shard-00002.arrayrecord is listed in the manifest but "
            r"missing; run `omicsio-materialize verify",
        ):
            ds.read_csr([2100])
    assert oj.verify_dataset(url) == ["shard-00002.arrayrecord: missing"]


def test_an_unreadable_local_shard_names_the_file(dataset_dir, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(dataset_dir, copy)
    (copy / "shard-00001.arrayrecord").write_bytes(np.random.default_rng(0).bytes(5000))
    with oj.open_dataset(copy) as ds:
        ds.read_csr([0])
        with pytest.raises(
            oj.DatasetFormatError,
            match=r"shard shard-00001.arrayrecord: cannot be opened: .*"
            r"has 5,000 bytes, the manifest lists [0-9,]+; run `omicsio-materialize",
        ):
            ds.read_csr([1500])
        with pytest.raises(oj.DatasetFormatError, match=r"shard-00001.arrayrecord: cannot be opened"):
            _batches(ds)
    with oj.open_dataset(copy, chunk_reader=False) as ds:  # ArrayRecord's reader: the file does not open
        ds.read_csr([0])
        with pytest.raises(
            oj.DatasetFormatError,
            match=r"shard shard-00001.arrayrecord: cannot be opened: .*"
            r"not a readable ArrayRecord file; run `omicsio-materialize",
        ):
            ds.read_csr([1500])


def test_a_corrupted_local_chunk_names_the_shard_and_cells(dataset_dir, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(dataset_dir, copy)
    begin, end = np.load(copy / chunk_index_path("shard-00000.arrayrecord"))[3 + 2]
    with open(copy / "shard-00000.arrayrecord", "r+b") as f:
        f.seek((int(begin) + int(end)) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    with (
        oj.open_dataset(copy) as ds,
        pytest.raises(
            oj.DatasetFormatError,
            match=r"shard shard-00000.arrayrecord: cells 32\.\.47 \(records 32\.\.47\) "
            r"cannot be read: .*hash mismatch.*; run `omicsio-materialize verify",
        ),
    ):
        ds.read_records(32, 48)


def test_merge_spans_merges_adjacent_chunks_and_small_gaps_only():
    needed = {0: np.array([[0, 100], [100, 200], [205, 300], [1000, 1100]]), 3: np.array([[50, 60]])}
    plan = merge_spans(needed, slack=0.1)  # 310 bytes needed: the 5-byte gap is taken, the 700-byte one not
    assert plan == {0: [(0, 300), (1000, 1100)], 3: [(50, 60)]}
    assert split_spans([(0, 100)], max_bytes=30) == [(0, 30), (30, 60), (60, 90), (90, 100)]
