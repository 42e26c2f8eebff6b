"""The chunk reader: ArrayRecord shards read from their chunks (pread, riegeli hashes, zstd) give
exactly what ArrayRecord's own reader gives, and damage is named by shard and cells."""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

import omicsio_jax as oj
from materialize import Layout, materialize
from materialize._shardfiles import chunk_ranges
from omicsio_jax.dataset.batched_reads import FetchReader
from omicsio_jax.format.chunk_index import ChunkIndex, chunk_index_path
from omicsio_jax.format.codec import join_records
from omicsio_jax.records import chunk_reader, riegeli_chunks, zstd
from omicsio_jax.records.highwayhash import RIEGELI_KEY, highway64

# HighwayHash-64 of bytes 0, 1, ..., n-1 under the key 0x0706050403020100, ..., 0x1F1E1D1C1B1A1918,
# for n = 0..64 (the published test vectors of github.com/google/highwayhash, c/highwayhash_test.c)
EXPECTED64 = [
    0x907A56DE22C26E53,
    0x7EAB43AAC7CDDD78,
    0xB8D0569AB0B53D62,
    0x5C6BEFAB8A463D80,
    0xF205A46893007EDA,
    0x2B8A1668E4A94541,
    0xBD4CCC325BEFCA6F,
    0x4D02AE1738F59482,
    0xE1205108E55F3171,
    0x32D2644EC77A1584,
    0xF6E10ACDB103A90B,
    0xC3BBF4615B415C15,
    0x243CC2040063FA9C,
    0xA89A58CE65E641FF,
    0x24B031A348455A23,
    0x40793F86A449F33B,
    0xCFAB3489F97EB832,
    0x19FE67D2C8C5C0E2,
    0x04DD90A69C565CC2,
    0x75D9518E2371C504,
    0x38AD9B1141D3DD16,
    0x0264432CCD8A70E0,
    0xA9DB5A6288683390,
    0xD7B05492003F028C,
    0x205F615AEA59E51E,
    0xEEE0C89621052884,
    0x1BFC1A93A7284F4F,
    0x512175B5B70DA91D,
    0xF71F8976A0A2C639,
    0xAE093FEF1F84E3E7,
    0x22CA92B01161860F,
    0x9FC7007CCF035A68,
    0xA0C964D9ECD580FC,
    0x2C90F73CA03181FC,
    0x185CF84E5691EB9E,
    0x4FC1F5EF2752AA9B,
    0xF5B7391A5E0A33EB,
    0xB9B84B83B4E96C9C,
    0x5E42FE712A5CD9B4,
    0xA150F2F90C3F97DC,
    0x7FA522D75E2D637D,
    0x181AD0CC0DFFD32B,
    0x3889ED981E854028,
    0xFB4297E8C586EE2D,
    0x6D064A45BB28059C,
    0x90563609B3EC860C,
    0x7AA4FCE94097C666,
    0x1326BAC06B911E08,
    0xB926168D2B154F34,
    0x9919848945B1948D,
    0xA2A98FC534825EBE,
    0xE9809095213EF0B6,
    0x582E5483707BC0E9,
    0x086E9414A88A6AF5,
    0xEE86B98D20F6743D,
    0xF89B7FF609B1C0A7,
    0x4C7D9CC19E22C3E8,
    0x9A97005024562A6F,
    0x5DD41CF423E6EBEF,
    0xDF13609C0468E227,
    0x6E0DA4F64188155A,
    0xB755BA4B50D7D4A1,
    0x887A3484647479BD,
    0xAB8EEBE9BF2139A0,
    0x75542C5D4CD2A6FF,
]


def test_highway_hash_matches_the_published_vectors():
    key = np.array(
        [0x0706050403020100, 0x0F0E0D0C0B0A0908, 0x1716151413121110, 0x1F1E1D1C1B1A1918], np.uint64
    )
    data = np.arange(80, dtype=np.uint8)
    assert [int(highway64(data, 0, n, key)) for n in range(65)] == EXPECTED64
    shifted = np.concatenate([np.zeros(3, np.uint8), data])  # any start, any alignment
    assert [int(highway64(shifted, 3, n, key)) for n in range(65)] == EXPECTED64
    other = np.zeros(40, np.uint8)
    other[:33] = 128 + np.arange(33)
    assert int(highway64(other, 0, 33, np.array([1, 2, 3, 4], np.uint64))) == 0x53C516CCE478CAD7


def test_every_chunk_of_a_shard_hashes_to_what_riegeli_stored(dataset_dir):
    path = dataset_dir / "shard-00000.arrayrecord"
    data = np.fromfile(path, np.uint8)
    ranges = np.load(dataset_dir / chunk_index_path(path.name))[3:].astype(np.int64)
    header = np.empty(40, np.uint8)
    for begin, end in ranges:
        assert riegeli_chunks._logical_copy(data, begin, begin, end, header, 40)
        assert highway64(header, 8, 32, RIEGELI_KEY) == header[:8].view(np.uint64)[0]


def _arrayrecord_records(root, manifest, pieces):
    """``(buf, starts)`` of the records of ``pieces`` as ArrayRecord's own reader reads them."""
    records = []
    for shard, begin, end in pieces:
        reader = ArrayRecordReader(str(root / manifest.shards[shard].path))
        records += reader.read(begin, end)
        reader.close()
    return join_records(records)


@pytest.mark.parametrize(
    "pieces",
    [
        [(0, 0, 1024)],  # a whole shard, one read
        [(1, 0, 16), (1, 32, 48), (1, 1008, 1024)],  # whole chunks
        [(0, 3, 4), (0, 17, 40), (1, 1000, 1024), (2, 5, 6)],  # runs that start and end inside chunks
        [(2, 900, 952)],  # the last shard, a short one (3,000 cells: 952 in it)
    ],
)
def test_chunk_reader_reads_what_arrayrecord_reads(dataset_dir, pieces):
    with oj.open_dataset(dataset_dir) as ds:
        assert ds.chunk_reader is not None
        buf, starts = ds.chunk_reader.read(pieces)
        want_buf, want_starts = _arrayrecord_records(dataset_dir, ds.manifest, pieces)
    np.testing.assert_array_equal(starts, want_starts)
    np.testing.assert_array_equal(buf, want_buf)
    assert buf.ctypes.data % 4 == 0


def test_fetches_and_batches_are_the_same_with_either_reader(dataset_dir):
    rng = np.random.default_rng(5)
    rows = np.concatenate([rng.choice(3000, 700, replace=False), [-1, 12, 12, -1]])  # repeats and padding
    with oj.open_dataset(dataset_dir) as ds, oj.open_dataset(dataset_dir, chunk_reader=False) as ref:
        got, want = FetchReader(ds)(rows), FetchReader(ref)(rows)
        for lo, hi in [(0, 704), (100, 356), (699, 704)]:
            a, b = got.take(lo, hi), want.take(lo, hi)
            assert len(a) == len(b) == hi - lo
            for i in range(hi - lo):
                np.testing.assert_array_equal(a.buf[a.begins[i] : a.ends[i]], b.buf[b.begins[i] : b.ends[i]])
        for output in ("dense", "csr"):
            kw = dict(batch_size=256, sampling=oj.Block(4, 3), seed=1, num_epochs=1, output=output)
            for a, b in zip(oj.make_loader(ds, **kw), oj.make_loader(ref, **kw), strict=True):
                jax.tree.map(
                    np.testing.assert_array_equal, jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b)
                )


@pytest.mark.parametrize(
    "options",
    [
        {"compression": "uncompressed"},
        {"group_size": 4},
        {"compression": "zstd:3", "group_size": 64},
    ],
)
def test_other_writer_options_read_the_same(corpus, tmp_path, options):
    out = tmp_path / "ds"
    materialize(
        corpus.cells_parquet, out, progress=False, layout=Layout(shard_cells=512, **options)
    )  # the last: 440 cells
    rows = np.random.default_rng(0).choice(3000, 500, replace=False)
    with oj.open_dataset(out) as ds, oj.open_dataset(out, chunk_reader=False) as ref:
        assert ds.chunk_reader is not None
        for a, b in zip(ds.read_csr(rows), ref.read_csr(rows), strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_panel_dataset_reads_the_same(corpus, tmp_path):
    out = tmp_path / "panel"
    (tmp_path / "panel.txt").write_text("\n".join(str(g) for g in range(3, 2000, 7)) + "\n")  # gene token ids
    materialize(corpus.cells_parquet, out, progress=False, layout=Layout(panel=tmp_path / "panel.txt"))
    with oj.open_dataset(out) as ds, oj.open_dataset(out, chunk_reader=False) as ref:
        assert ds.layout == "dense" and ds.chunk_reader is not None
        np.testing.assert_array_equal(oj.load_panel(ds).x, oj.load_panel(ref).x)


@dataclasses.dataclass
class _Shards:
    """Just what `ChunkReader` asks of a dataset, over shard files written here."""

    root: object
    group_size: int
    shards: list

    @property
    def manifest(self):
        return self

    @property
    def array_record(self):
        return {"group_size": self.group_size}

    def chunk_index(self, shard):
        return ChunkIndex(
            chunk_ranges(self.root / self.shards[shard].path, self.shards[shard].num_cells), self.group_size
        )

    def local_path(self, relpath):
        return self.root / relpath


@dataclasses.dataclass
class _Shard:
    path: str
    num_cells: int
    num_bytes: int


def test_chunk_headers_split_by_block_headers_are_read(tmp_path):
    """Riegeli puts a 24-byte block header at every 64 KiB, anywhere, also inside a chunk header:
    record sizes are searched until some chunk header straddles a block boundary."""
    rng = np.random.default_rng(0)
    for attempt in range(200):
        path = tmp_path / f"s{attempt}.arrayrecord"
        records = [
            rng.integers(0, 256, int(rng.integers(1, 700)) * 4, dtype=np.uint8).tobytes() for _ in range(600)
        ]
        writer = ArrayRecordWriter(str(path), "group_size:7,zstd:1")
        for r in records:
            writer.write(r)
        writer.close()
        ranges = chunk_ranges(path, len(records))[3:].astype(np.int64)
        if any(b % 65536 > 65536 - 40 for b, _ in ranges):  # the header runs into the next block
            break
    else:
        pytest.fail("no chunk header straddles a block boundary")
    shards = _Shards(tmp_path, 7, [_Shard(path.name, len(records), path.stat().st_size)])
    reader = chunk_reader.ChunkReader(shards)
    buf, starts = reader.read([(0, 0, len(records))])
    assert [buf[a:b].tobytes() for a, b in zip(starts[:-1], starts[1:], strict=True)] == records
    buf, starts = reader.read([(0, 5, 9), (0, 400, 401)])
    assert [buf[a:b].tobytes() for a, b in zip(starts[:-1], starts[1:], strict=True)] == records[5:9] + [
        records[400]
    ]


def _flip(path, position):
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize(
    ("where", "reason"), [(8, "chunk header hash mismatch"), (60, "chunk data hash mismatch")]
)
def test_a_damaged_chunk_is_named_by_shard_and_cells(dataset_dir, tmp_path, where, reason):
    copy = tmp_path / "ds"
    shutil.copytree(dataset_dir, copy)
    begin = int(np.load(copy / chunk_index_path("shard-00001.arrayrecord"))[3 + 4, 0])
    _flip(copy / "shard-00001.arrayrecord", begin + where + (24 if (begin + where) % 65536 < 24 else 0))
    with oj.open_dataset(copy) as ds:
        ds.read_csr([1024 + 63, 1024 + 80])  # the chunks beside it read fine
        with pytest.raises(
            oj.DatasetFormatError,
            match=rf"shard shard-00001.arrayrecord: cells 1088\.\.1103 "
            rf"\(records 64\.\.79\) cannot be read: {reason}; run "
            rf"`omicsio-materialize verify {copy}`",
        ):
            ds.read_csr([1024 + 70])


def test_a_truncated_or_missing_shard_cannot_be_opened(dataset_dir, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(dataset_dir, copy)
    path = copy / "shard-00002.arrayrecord"
    path.write_bytes(path.read_bytes()[:-100])
    with oj.open_dataset(copy) as ds:
        with pytest.raises(
            oj.DatasetFormatError,
            match=r"shard-00002.arrayrecord: cannot be opened: .* has "
            r"[0-9,]+ bytes, the manifest lists [0-9,]+",
        ):
            ds.read_csr([2500])
        path.unlink()
        with pytest.raises(
            oj.DatasetFormatError, match=r"shard-00002.arrayrecord: cannot be opened: .*No such file"
        ):
            ds.read_csr([2500])


def test_a_short_read_is_reported_as_truncated(dataset_dir):
    with oj.open_dataset(dataset_dir) as ds:
        index = ds.chunk_index(0)
        ranges = index.chunk_bytes(np.arange(3))
        fd = ds.chunk_reader._open(0)
        try:
            raw, base, ends = chunk_reader._pread(fd, ranges)
        finally:
            os.close(fd)
        ends[1] = ranges[1, 0] + 30  # as if the file had ended inside chunk 1's header
        _, _, problem, k = riegeli_chunks.check_headers(raw, base, ranges[:, 0], ends, np.full(3, 16))
        assert k == 1
        assert riegeli_chunks.CHUNK_PROBLEMS[problem] == "the file ends inside the chunk (truncated)"


def test_without_a_zstd_library_arrayrecord_reads_them(dataset_dir, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(zstd, "available", lambda: False)
    with oj.open_dataset(dataset_dir) as ds:
        assert ds.chunk_reader is None  # zstd shards: ArrayRecord's reader
        indptr, _, _ = ds.read_csr([1, 2000])
        assert len(indptr) == 3
    out = tmp_path / "raw"
    materialize(corpus.cells_parquet, out, progress=False, layout=Layout(compression="uncompressed"))
    with oj.open_dataset(out) as ds:
        assert ds.chunk_reader is not None  # uncompressed shards need no zstd


def test_the_zstd_library_is_found():
    assert zstd.available()  # backports.zstd is a dependency below Python 3.14, compression.zstd from it
