"""Direct reads (O_DIRECT through Linux AIO): the same records as buffered reads, chosen for datasets
larger than RAM, failures reported by shard and cell."""

from __future__ import annotations

import errno
import os
import platform
import shutil
import time
from pathlib import Path

import numba as nb
import numpy as np
import pytest
from conftest import open_descriptors
from hypothesis import given, settings
from hypothesis import strategies as st

import omicsio_jax as oj
from omicsio_jax.dataset import files as dataset_files
from omicsio_jax.storage import aio, direct_io


@pytest.fixture(scope="module", autouse=True)
def _direct_reads_work_where_the_dataset_is(dataset_dir):
    """Probed where the tests write their dataset, not where this file lives."""
    if not direct_io.supported(dataset_dir / "manifest.json"):
        pytest.skip(f"the file system of {dataset_dir} or this OS has no O_DIRECT / native AIO")


@pytest.fixture(scope="module")
def pair(dataset_dir):
    with oj.open_dataset(dataset_dir) as buffered, oj.open_dataset(dataset_dir, direct_io=True) as direct:
        assert not buffered.chunk_reader.direct
        assert direct.chunk_reader.direct
        yield buffered, direct


def test_direct_reads_give_the_records_buffered_reads_give(pair):
    buffered, direct = pair
    rng = np.random.default_rng(0)
    for n in (1, 2, 17, 500, buffered.num_cells):
        rows = np.sort(rng.choice(buffered.num_cells, n, replace=False))
        for a, b in zip(buffered.read_csr(rows), direct.read_csr(rows), strict=True):
            np.testing.assert_array_equal(a, b)
    last = buffered.num_cells - 1  # the end of the last shard: the aligned read runs past the file's end
    for a, b in zip(
        buffered.read_buffer(last - 3, last + 1), direct.read_buffer(last - 3, last + 1), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_a_loader_over_direct_reads_serves_the_same_batches(pair):
    buffered, direct = pair
    kwargs = {"batch_size": 64, "sampling": oj.Block(4, 4), "seed": 3, "output": "csr"}
    for a, b in zip(oj.make_loader(buffered, **kwargs), oj.make_loader(direct, **kwargs), strict=True):
        np.testing.assert_array_equal(np.asarray(a.x.indices), np.asarray(b.x.indices))
        np.testing.assert_array_equal(np.asarray(a.x.values), np.asarray(b.x.values))


def test_direct_reads_are_the_default_beyond_ram(dataset_dir, monkeypatch):
    with oj.open_dataset(dataset_dir) as ds:
        assert not ds.chunk_reader.direct  # a few MB on a machine with GBs: the page cache serves it
        assert ds.open_options["direct_io"] is None
    monkeypatch.setattr(dataset_files, "memory_limit", lambda: 1 << 20)
    with oj.open_dataset(dataset_dir) as ds:
        assert ds.chunk_reader.direct
        assert ds._files.readahead is None  # nothing to announce to a page cache it bypasses
    with oj.open_dataset(dataset_dir, direct_io=False) as ds:
        assert not ds.chunk_reader.direct


def test_without_native_aio_reads_are_buffered(dataset_dir, monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "sparc64")
    with oj.open_dataset(dataset_dir, direct_io=True) as ds:
        assert not ds.chunk_reader.direct
        assert len(ds.read_csr([0, 5])[0]) == 3


def test_a_damaged_chunk_read_directly_is_named_by_its_cells(dataset_dir, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(dataset_dir, copy)
    with oj.open_dataset(copy, direct_io=True) as ds:
        begin, _ = ds.chunk_index(1).chunk_bytes(np.array([3]))[0]
        first = ds.manifest.shards[1].first_cell
        with open(copy / ds.manifest.shards[1].path, "r+b") as f:
            f.seek(int(begin) + 100)
            byte = f.read(1)
            f.seek(int(begin) + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        group = ds.chunk_reader.group_size
        with pytest.raises(
            oj.DatasetFormatError,
            match=rf"cells {first + 3 * group}\.\.{first + 4 * group - 1} .*"
            r"hash mismatch; run `omicsio-materialize verify",
        ):
            ds.read_csr(np.arange(first, first + 6 * group))


def test_a_context_copied_by_a_fork_is_replaced(pair, monkeypatch):
    _, direct = pair
    expected = direct.read_csr([5, 2000])
    parent = aio.contexts().lease()  # the one that read leased, given back
    aio.contexts().give_back(parent)
    real_pid = os.getpid()
    # a forked child (not forked here: numba's OpenMP refuses it) inherits the pool, but the kernel's
    # contexts belong to the parent's address space
    monkeypatch.setattr(os, "getpid", lambda: real_pid + 1)
    child = aio.contexts().lease()
    assert child is not parent and child.id != parent.id
    aio.contexts().give_back(child)
    for a, b in zip(direct.read_csr([5, 2000]), expected, strict=True):
        np.testing.assert_array_equal(a, b)
    monkeypatch.undo()
    assert aio.contexts().lease() is not child  # back in the parent: its own pool again


@nb.njit
def _completions_waiting(fn, number, ctx, events):
    """How many completed reads sit in the context's ring, taken without waiting (min_nr 0)."""
    return aio.syscall(
        fn,
        number,
        np.uint64(ctx),
        np.uint64(0),
        np.uint64(events.shape[0]),
        np.uint64(events.ctypes.data),
        np.uint64(0),
    )


def test_reads_submitted_before_a_refusal_are_waited_for(pair, monkeypatch):
    _, direct = pair
    path = direct.local_path(direct.manifest.shards[0].path)
    ranges = direct.chunk_index(0).chunk_bytes(np.arange(0, 64, 4))  # 16 separate spans
    real = aio.submit

    def refused_part_way(fn, errno_fn, number, ctx, iocbs, pointers, first, stop, *rest):
        done, _ = real(fn, errno_fn, number, ctx, iocbs, pointers, first, first + (stop - first) // 2, *rest)
        return done, errno.EBADF

    monkeypatch.setattr(aio, "submit", refused_part_way)
    with pytest.raises(direct_io.ReadError, match="refused .*Bad file descriptor") as caught:
        next(direct_io.DirectReads().read_groups([path], [(np.zeros(len(ranges), np.int64), ranges)]))
    assert caught.value.errno == errno.EBADF and caught.value.filename == str(path)
    time.sleep(0.2)  # long enough for any read left in flight to complete into the ring
    _, _, getevents, _ = aio.SYSCALLS[platform.machine()]
    context = aio.contexts().lease()  # the one that read: given back idle
    try:
        waiting = _completions_waiting(
            np.uint64(aio.syscall_address()), getevents, context.id, np.zeros((64, 4), np.int64)
        )
    finally:
        aio.contexts().give_back(context)
    assert waiting == 0  # each was waited for: none is left to land in the context's next read


def test_an_error_the_kernel_reports_is_not_tried_again():
    _, _, _, submit = aio.SYSCALLS[platform.machine()]
    spans = np.array([[0, 4096]], np.int64)
    args = (np.zeros((1, 8), np.uint64), np.zeros(1, np.uint64), 0, 1, np.zeros(1, np.int64), spans)
    started = time.perf_counter()
    done, err = aio.submit(
        np.uint64(aio.syscall_address()),
        np.uint64(aio.errno_address()),
        submit,
        0,  # no such context
        *args,
        np.zeros(1, np.uint64),
    )
    assert (done, err) == (0, errno.EINVAL)
    assert time.perf_counter() - started < 1.0


def test_a_read_the_os_fails_is_an_oserror_naming_the_file():
    spans = np.array([[0, 4096], [8192, 12288]])
    with pytest.raises(direct_io.ReadError, match="Input/output error") as caught:
        direct_io.DirectReads._placed(
            [__file__, __file__], spans, spans, np.arange(2), np.array([4096, -5]), np.zeros(8192, np.uint8)
        )
    assert caught.value.errno == 5 and caught.value.filename == __file__


def test_a_short_read_inside_the_file_is_completed(tmp_path):
    path = tmp_path / "f"
    data = np.random.default_rng(1).integers(0, 256, 5 * 4096 + 100, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    ranges = np.array([[10, 5000], [12300, 5 * 4096 + 100]])
    spans, which, _ = direct_io.spans_of(ranges)
    np.testing.assert_array_equal(spans, [[0, 8192], [12288, 6 * 4096]])
    buf = np.zeros(5 * 4096, np.uint8)
    buf[:4096] = data[:4096]  # as if the kernel had stopped after 4 KiB of the first span
    buf[8192 : 8192 + len(data) - 12288] = data[12288:]  # the second ends with the file
    got = np.array([4096, len(data) - 12288])
    base, ends = direct_io.DirectReads._placed([path, path], ranges, spans, which, got, buf)
    for (lo, hi), at, end in zip(ranges.tolist(), base.tolist(), ends.tolist(), strict=True):
        assert end == hi
        np.testing.assert_array_equal(buf[at : at + hi - lo], data[lo:hi])


def test_read_groups_reads_every_group_leaves_no_descriptor_open_and_recycles_buffers(pair):
    _, direct = pair
    paths = [direct.local_path(s.path) for s in direct.manifest.shards[:2]]
    raws = [p.read_bytes() for p in paths]
    ranges = [direct.chunk_index(i).chunk_bytes(np.arange(32)) for i in range(2)]
    # 16 groups of 4 chunks, AHEAD in flight; the middle ones span both files
    files = np.repeat([0, 1], 32)
    both = np.concatenate(ranges)
    groups = [(files[i : i + 4], both[i : i + 4]) for i in range(0, 64, 4)]
    reads = direct_io.DirectReads()
    wanted = {str(Path(p).resolve()) for p in paths}
    assert open_descriptors(wanted.__contains__) == 0
    out = reads.read_groups(paths, groups)
    buf, base, ends = next(
        out
    )  # stop early: the reads in flight are waited for, their buffers kept for reuse
    assert bytes(buf[base[0] : base[0] + ends[0] - both[0, 0]]) == raws[0][both[0, 0] : both[0, 1]]
    out.close()
    assert open_descriptors(wanted.__contains__) == 0
    seen = set()
    for (f, want), (buf, base, ends) in zip(groups, reads.read_groups(paths, groups), strict=True):
        np.testing.assert_array_equal(ends, want[:, 1])
        for file, (lo, hi), at in zip(f.tolist(), want.tolist(), base.tolist(), strict=True):
            assert bytes(buf[at : at + hi - lo]) == raws[file][lo:hi]
        seen.add(buf.ctypes.data)
        reads.release(buf)
    assert len(seen) <= direct_io.AHEAD + 2  # 16 groups through the buffers of those in flight
    assert open_descriptors(wanted.__contains__) == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 40_000), st.integers(1, 20_000)), min_size=1, max_size=30
    )
)
def test_spans_cover_every_range_aligned_and_disjoint(pieces):
    files = np.cumsum([f for f, _, _ in pieces]) // 2  # sorted file numbers, some repeated
    ranges = np.zeros((len(pieces), 2), np.int64)
    for i, (_, gap, n) in enumerate(pieces):
        start = gap if i == 0 or files[i] != files[i - 1] else ranges[i - 1, 1] + gap
        ranges[i] = start, start + n
    spans, which, span_files = direct_io.spans_of(ranges, files)
    assert (spans % direct_io.ALIGN == 0).all()
    same = span_files[1:] == span_files[:-1]
    assert (spans[1:, 0][same] > spans[:-1, 1][same]).all()  # within a file: sorted, not touching
    assert (span_files[which] == files).all()
    assert (spans[which, 0] <= ranges[:, 0]).all() and (ranges[:, 1] <= spans[which, 1]).all()
