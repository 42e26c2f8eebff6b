"""Reads announced to the kernel before they are made (local datasets), and segments dropped once used."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import open_descriptors

import omicsio_jax as oj
from omicsio_jax.dataset.batched_reads import SegmentCache
from omicsio_jax.format.chunk_index import ChunkIndex, chunk_index_path, merge_spans


def test_announced_spans_merge_touching_chunks_only():
    # head, footer, postscript, then 6 data chunks; chunk 3 is followed by a gap (another kind of chunk)
    rows = np.array(
        [
            [0, 64],
            [900, 950],
            [950, 1000],
            [64, 100],
            [100, 180],
            [180, 200],
            [200, 260],
            [300, 350],
            [350, 400],
        ],
        np.uint64,
    )
    index = ChunkIndex(rows, group_size=16)

    def spans(chunks):
        return [
            list(span)
            for span in merge_spans({0: index.chunk_bytes(np.array(chunks, np.int64))}, slack=0.0)[0]
        ]

    assert spans([0, 1, 2, 3, 4, 5]) == [[64, 260], [300, 400]]
    assert spans([0, 2, 3, 4]) == [[64, 100], [180, 260], [300, 350]]
    assert spans([]) == []


def _fadvise_calls(monkeypatch) -> list[tuple[str, int, int, int]]:
    calls, real = [], os.posix_fadvise

    def record(fd, offset, length, advice):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    return calls


def test_a_read_announces_exactly_the_chunks_of_its_records(dataset_dir, monkeypatch):
    calls = _fadvise_calls(monkeypatch)

    def open_on_shards() -> int:
        return open_descriptors(lambda target: target.endswith(".arrayrecord"))

    before = open_on_shards()
    with oj.open_dataset(dataset_dir) as ds:
        m = ds.manifest
        group = int(m.array_record["group_size"])
        rows = np.random.default_rng(3).choice(ds.num_cells, 300, replace=False)
        ds.read_csr(rows)
        assert open_on_shards() - before <= len(m.shards)  # the readers' own, none left by the announcing
    assert calls and {c[3] for c in calls} == {os.POSIX_FADV_WILLNEED}
    wanted: dict[str, set[int]] = {}
    for row in rows.tolist():
        shard = m.shards[row // m.shard_cells]
        wanted.setdefault(str((Path(dataset_dir) / shard.path).resolve()), set()).add(
            (row % m.shard_cells) // group
        )
    announced: dict[str, set[int]] = {}
    for path, offset, length, _ in calls:
        name = Path(path).name
        data = np.load(Path(dataset_dir) / chunk_index_path(name))[3:].astype(np.int64)
        first = np.flatnonzero(data[:, 0] == offset)  # a span starts and ends on chunk boundaries
        last = np.flatnonzero(data[:, 1] == offset + length)
        assert len(first) == 1 and len(last) == 1, (path, offset, length)
        announced.setdefault(path, set()).update(range(int(first[0]), int(last[0]) + 1))
    assert announced == wanted


def test_readahead_changes_no_value(dataset_dir, monkeypatch):
    calls = _fadvise_calls(monkeypatch)
    rows = np.random.default_rng(5).integers(0, 3000, 500)
    with oj.open_dataset(dataset_dir) as on, oj.open_dataset(dataset_dir, readahead=False) as off:
        for a, b in zip(on.read_csr(rows), off.read_csr(rows), strict=True):
            np.testing.assert_array_equal(a, b)
        n = len(calls)
        batches = [
            [np.asarray(b.x) for b in oj.make_loader(d, batch_size=100, sampling=oj.Block(8, 4), seed=1)]
            for d in (on, off)
        ]
    assert n > 0
    for a, b in zip(*batches, strict=True):
        np.testing.assert_array_equal(a, b)
    with oj.open_dataset(dataset_dir, readahead=False) as off:
        before = len(calls)
        off.read_csr(rows)
        assert len(calls) == before  # readahead=False announces nothing


def test_segment_cache_drops_a_key_once_all_its_uses_are_over():
    loads, lock = [], threading.Lock()

    def load(key):
        with lock:
            loads.append(key)
        return [key] * 3

    cache = SegmentCache(load, lambda k: None, ahead=0, threads=1, keep=8)
    try:
        value = cache.get(0)
        cache.used(0, 3)
        cache.used(0, 3)
        assert cache.get(0) is value and loads == [0]  # two of three uses: still held
        cache.used(0, 3)
        assert cache.get(0) == [0, 0, 0] and loads == [0, 0]  # all three over: dropped, read again
        cache.used(7, 2)  # a use before the key was ever asked for (the first batch, read on its own) ...
        cache.get(7)
        cache.used(7, 2)  # ... counts: this second use is the last
        assert cache.get(7) == [7, 7, 7] and loads == [0, 0, 7, 7]
    finally:
        cache.close()


@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_reader_in_step_order_holds_no_segment_it_has_left(dataset_dir, prefetch):
    from omicsio_jax.loaders.minibatch import DiskSpec, MinibatchReader
    from omicsio_jax.sampling.schedule import Schedule

    with oj.open_dataset(dataset_dir) as ds:
        spec = DiskSpec.of(
            batch_size=50,
            sampling=oj.Block(8, 2),
            output="csr",
            obs=(),
            rows=None,
            seed=0,
            num_epochs=1,
            placement=oj.Placement(process_count=1),
        )
        plan, output = spec.resolve(ds)
        reader = MinibatchReader(ds, Schedule(plan, 0), output, (), num_epochs=1, prefetch=prefetch)
        try:
            held = []
            for step in range(plan.steps_per_epoch):
                reader(0, step)
                held.append(len(reader._segments._entries))
        finally:
            reader.close()
    # between segments: the one left is gone; at most the read-ahead ones (prefetch) are held then
    assert max(held[1::2]) <= prefetch and max(held) <= prefetch + 1


def test_a_get_waiting_when_the_cache_closes_raises_instead_of_hanging():
    from omicsio_jax.dataset.batched_reads import CacheClosedError

    release = threading.Event()

    def load(key):
        release.wait(5)
        return key

    cache = SegmentCache(load, lambda k: None, ahead=0, threads=1)
    errors = []

    def ask():
        try:
            cache.get(1)
        except CacheClosedError as e:
            errors.append(e)

    waiting = threading.Thread(target=ask)
    waiting.start()
    deadline = time.monotonic() + 5
    while not cache._entries and time.monotonic() < deadline:
        time.sleep(0.01)
    closer = threading.Thread(target=cache.close)
    closer.start()
    waiting.join(timeout=5)
    release.set()
    closer.join(timeout=10)
    assert not waiting.is_alive() and len(errors) == 1
    with pytest.raises(CacheClosedError):
        cache.get(2)


def test_a_first_key_used_up_before_its_other_asker_wakes_is_no_error():
    """Regression: two threads asking for the very first key both wait for it; the first to wake used it
    up (one use) and it was dropped, and the other then raised KeyError moving it in the cache."""
    for _ in range(20):
        cache = SegmentCache(lambda key: (time.sleep(0.001), key)[1], lambda key: None, ahead=1, threads=1)
        errors: list[BaseException] = []

        def ask(cache=cache, errors=errors) -> None:
            try:
                assert cache.get(0) == 0
                cache.used(0, 1)
            except BaseException as e:  # noqa: BLE001 - collected for the assertion below
                errors.append(e)

        askers = [threading.Thread(target=ask) for _ in range(3)]
        for t in askers:
            t.start()
        for t in askers:
            t.join()
        cache.close()
        assert errors == []
