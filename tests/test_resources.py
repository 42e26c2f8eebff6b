"""Resources a long run shares with its host: the memory a cgroup allows, AIO contexts, background
threads that must neither die silently nor outlive their owner, and the optional extras."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import numpy_huge_pages

import omicsio_jax as oj
from omicsio_jax.core.errors import require
from omicsio_jax.dataset import files as dataset_files
from omicsio_jax.records.readahead import ReadAhead
from omicsio_jax.storage import aio, direct_io, memory

TESTS = Path(__file__).parent


# -- memory: cgroup limits ---------------------------------------------------------------------


def test_a_cgroup_v2_limit_anywhere_above_the_process_counts(tmp_path):
    point = tmp_path / "cgroup2"
    (point / "job" / "step").mkdir(parents=True)
    (point / "job" / "step" / "memory.max").write_text("max\n")
    (point / "job" / "memory.max").write_text(f"{3 << 30}\n")
    mountinfo = f"41 31 0:38 / {point} rw,relatime - cgroup2 cgroup2 rw\n"
    assert memory.cgroup_limits("0::/job/step\n", mountinfo) == [3 << 30]


def test_a_cgroup_v1_limit_is_read_and_no_limit_is_ignored(tmp_path):
    point = tmp_path / "memory"
    (point / "docker" / "c1").mkdir(parents=True)
    (point / "docker" / "c1" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "none"
    (point / "docker" / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    mountinfo = (
        f"32 31 0:29 / {tmp_path / 'cpu'} rw - cgroup cgroup rw,cpu\n"
        f"35 31 0:32 / {point} rw,relatime - cgroup cgroup rw,memory\n"
    )
    proc = "4:memory:/docker/c1\n1:cpu:/docker/c1\n"
    assert memory.cgroup_limits(proc, mountinfo) == [2 << 30]
    # inside the container the hierarchy is mounted from the container's own cgroup down
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "memory.limit_in_bytes").write_text(f"{512 << 20}\n")
    mountinfo = f"35 31 0:32 /docker/c1 {inner} rw - cgroup cgroup rw,memory\n"
    assert memory.cgroup_limits(proc, mountinfo) == [512 << 20]


def test_a_cgroup_cpu_quota_limits_the_usable_cores(tmp_path, monkeypatch):
    """A container given 1.5 CPUs' time (v2 ``cpu.max`` above the process's cgroup, or v1's quota
    and period) on a machine of more cores: the loaders and materialize count 2 usable cores."""
    point = tmp_path / "cgroup2"
    (point / "job" / "step").mkdir(parents=True)
    (point / "job" / "step" / "cpu.max").write_text("max 100000\n")
    (point / "job" / "cpu.max").write_text("150000 100000\n")
    mountinfo = f"41 31 0:38 / {point} rw,relatime - cgroup2 cgroup2 rw\n"
    assert memory.cgroup_cpu_quotas("0::/job/step\n", mountinfo) == [1.5]
    v1 = tmp_path / "cpu"
    (v1 / "docker" / "c1").mkdir(parents=True)
    (v1 / "docker" / "c1" / "cpu.cfs_quota_us").write_text("-1\n")  # none here
    (v1 / "docker" / "c1" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "docker" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "docker" / "cpu.cfs_period_us").write_text("100000\n")
    mountinfo = f"32 31 0:29 / {v1} rw - cgroup cgroup rw,cpu,cpuacct\n"
    assert memory.cgroup_cpu_quotas("4:memory:/docker/c1\n2:cpu,cpuacct:/docker/c1\n", mountinfo) == [3.0]
    monkeypatch.setattr(memory, "cpu_quota", lambda: 2)
    monkeypatch.setattr(memory.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert memory.usable_cores() == 2
    monkeypatch.setattr(memory, "cpu_quota", lambda: None)
    assert memory.usable_cores() == 16


def test_the_memory_limit_is_at_most_the_ram():
    limit = memory.memory_limit()
    assert limit is not None and 0 < limit <= memory._ram()


def test_freed_heap_goes_back_to_the_system_when_a_dataset_closes(dataset_dir, monkeypatch):
    # a fragmented heap: 100 KB buffers (below glibc's mmap threshold) freed but for the topmost,
    # which keeps glibc from giving the rest back on its own; run in a child, away from the suite's heap
    code = (
        "import os; from omicsio_jax.storage.memory import release_freed_memory as r\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
        "bufs = [bytearray(100_000) for _ in range(3000)]; pin = bufs[-1]; del bufs[:-1]\n"
        "before = rss(); ok = r(); print(ok, before - rss())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    released, freed = out.stdout.split()
    assert released == "True" and int(freed) > 200e6  # of the ~300 MB freed, nearly all returned
    calls = []
    monkeypatch.setattr(dataset_files, "release_freed_memory", lambda: calls.append(1))
    oj.open_dataset(dataset_dir).close()
    assert calls == [1]


def test_a_loader_collected_as_the_interpreter_exits_closes_without_a_word(dataset_dir):
    # a loader kept in a module global, with grain and orbax imported, is closed by Grain's
    # iterator finalizer while the interpreter clears modules: `memory`'s own `sys` is None by then
    code = (
        "import grain, orbax.checkpoint\n"
        "import omicsio_jax as oj\n"
        f"loader = oj.make_loader({str(dataset_dir)!r}, batch_size=8, seed=0, num_epochs=None)\n"
        "batch = next(loader)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "Exception ignored" not in out.stderr, out.stderr


def test_closing_a_loader_lets_go_of_what_it_read_and_kept_at_once(dataset_dir, monkeypatch):
    """Without a garbage collection: the fetches read ahead and the batch and fetch buffers kept for
    reuse go when the loader closes (its reading threads, stopped mid-read, leave exceptions whose
    frames refer to the reader, and the read-ahead cache held the reader's bound methods: cycles that
    kept them all until a collection), and the freed heap is handed back."""
    from omicsio_jax.loaders import disk

    calls = []
    monkeypatch.setattr(disk.Loader, "_release_freed_memory", staticmethod(lambda: calls.append(1)))
    gc.disable()
    try:
        ds = oj.open_dataset(dataset_dir)
        loader = oj.make_loader(ds, batch_size=64, num_epochs=None, read=oj.ReadOptions(num_threads=2))
        batches = [next(loader) for _ in range(3)]
        reader = loader._reader
        segments, kept = reader._segments, reader._buffers
        assert segments._entries and kept.num_free() + len(kept._spans) + len(kept._pools) > 0
        loader.close()
        assert not segments._entries and segments._load is None and segments._following is None
        assert kept._pools == {} and kept._spans == []
        assert calls == [1]
        del batches
    finally:
        gc.enable()


def _started_since(before: set[threading.Thread]) -> set[threading.Thread]:
    return set(threading.enumerate()) - before


def _named(name: str) -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == name}


def test_a_loader_read_to_its_end_stops_its_threads_while_it_is_still_referenced(dataset_dir):
    ds = oj.open_dataset(dataset_dir)
    before = set(threading.enumerate())
    loader = oj.make_loader(ds, batch_size=256, num_epochs=2, read=oj.ReadOptions(num_threads=2))
    served = sum(int(np.asarray(batch.mask).sum()) for batch in loader)
    assert (
        served == 2 * 256 * loader.steps_per_epoch
        and loader.coverage().complete
        and loader.get_state()["epoch"] == 2
    )
    deadline = time.monotonic() + 10  # (the dataset's own read-ahead thread stays with the dataset)
    while (
        started := _started_since(before) - _named("omicsio-jax-readahead")
    ) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not started, sorted(t.name for t in started)
    with pytest.raises(StopIteration):
        next(loader)
    loader.close()


huge_pages = numpy_huge_pages()


def test_small_pages_turn_numpy_huge_pages_off_until_the_last_thread_leaves():
    before = huge_pages()
    entered, leave = threading.Event(), threading.Event()

    def other():
        with memory.small_pages():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    with memory.small_pages():
        assert huge_pages() is False
        with memory.small_pages():  # reentrant
            assert huge_pages() is False
        assert huge_pages() is False
        thread.start()
        assert entered.wait(10)
    assert huge_pages() is False  # the other thread is still inside
    leave.set()
    thread.join(10)
    assert huge_pages() is before


def test_an_unknown_memory_size_never_means_direct_reads(dataset_dir, monkeypatch):
    monkeypatch.setattr(dataset_files, "memory_limit", lambda: None)
    with oj.open_dataset(dataset_dir) as ds:
        assert not ds.chunk_reader.direct
    monkeypatch.setattr(dataset_files, "memory_limit", lambda: 1 << 20)  # a 1 MiB cgroup: beyond it
    if direct_io.supported(dataset_dir / "manifest.json"):
        with oj.open_dataset(dataset_dir) as ds:
            assert ds.chunk_reader.direct


# -- AIO contexts --------------------------------------------------------------------------------


def _groups(ds, n=6):
    paths = [ds.local_path(s.path) for s in ds.manifest.shards[:2]]
    groups = []
    for g in range(n):
        f = g % 2
        ranges = ds.chunk_index(f).chunk_bytes(np.arange(g, g + 8, 2))
        groups.append((np.full(len(ranges), f, np.int64), ranges))
    return paths, groups


def _check(paths, groups, out):
    raws = [p.read_bytes() for p in paths]
    got = list(out)
    assert len(got) == len(groups)
    for (files, ranges), (buf, base, ends) in zip(groups, got, strict=True):
        np.testing.assert_array_equal(ends, ranges[:, 1])
        for f, (lo, hi), at in zip(files.tolist(), ranges.tolist(), base.tolist(), strict=True):
            assert bytes(buf[at : at + hi - lo]) == raws[f][lo:hi]


@pytest.fixture
def direct_ds(dataset_dir):
    if not direct_io.supported(dataset_dir / "manifest.json"):
        pytest.skip(f"the file system of {dataset_dir} refuses O_DIRECT")
    with oj.open_dataset(dataset_dir, direct_io=False) as ds:
        yield ds


@pytest.fixture
def fresh_pool(monkeypatch):
    pool = aio.ContextPool()
    monkeypatch.setattr(aio, "_CONTEXTS", pool)
    return pool


def test_without_aio_headroom_reads_are_buffered_with_one_warning(direct_ds, fresh_pool, monkeypatch):
    monkeypatch.setattr(aio, "aio_headroom", lambda: 100)
    paths, groups = _groups(direct_ds)
    with pytest.warns(RuntimeWarning, match=r"buffered instead of with O_DIRECT: .*aio-max-nr headroom 100"):
        _check(paths, groups, direct_io.DirectReads().read_groups(paths, groups))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        _check(paths, groups, direct_io.DirectReads().read_groups(paths, groups))
    assert fresh_pool.made == 0


def test_a_refused_io_setup_falls_back_to_buffered_reads(direct_ds, fresh_pool, monkeypatch):
    monkeypatch.setattr(aio, "aio_headroom", lambda: None)
    monkeypatch.setattr(aio, "_EVENTS", 1 << 40)  # more than any host allows: the kernel says no
    paths, groups = _groups(direct_ds)
    with pytest.warns(RuntimeWarning, match="io_setup"):
        _check(paths, groups, direct_io.DirectReads().read_groups(paths, groups))


def test_contexts_are_leased_per_read_and_reused(direct_ds, fresh_pool, monkeypatch):
    monkeypatch.setattr(aio, "MAX_CONTEXTS", 1)
    paths, groups = _groups(direct_ds)
    reads = direct_io.DirectReads()
    for _ in range(3):  # one after another: one context, reused
        _check(paths, groups, reads.read_groups(paths, groups))
    assert fresh_pool.made == 1 and fresh_pool.idle == 1
    held = reads.read_groups(paths, groups)
    first = next(held)  # holds the only context
    with pytest.warns(RuntimeWarning, match="1 threads of this process already read"):
        _check(paths, groups, reads.read_groups(paths, groups))  # read buffered meanwhile
    _check(paths, groups, [first, *held])
    assert fresh_pool.made == 1 and fresh_pool.idle == 1


def test_a_context_smaller_than_a_group_reads_it_in_turns(direct_ds, fresh_pool, monkeypatch):
    monkeypatch.setattr(aio, "aio_headroom", lambda: 4 * 8)  # contexts of 8 reads
    monkeypatch.setattr(aio, "_MIN_EVENTS", 4)
    paths = [direct_ds.local_path(s.path) for s in direct_ds.manifest.shards[:2]]
    ranges = [direct_ds.chunk_index(f).chunk_bytes(np.arange(0, 64, 4)) for f in range(2)]
    groups = [(np.full(len(ranges[f]), f, np.int64), ranges[f]) for f in (0, 1, 0)]
    assert len(direct_io.spans_of(ranges[0])[0]) > 8  # more reads than the context holds
    _check(paths, groups, direct_io.DirectReads().read_groups(paths, groups))
    context = fresh_pool.lease()  # the one that read, given back
    assert fresh_pool.made == 1 and context.events == 8
    fresh_pool.give_back(context)


def test_64_reader_threads_in_8_processes_read_correctly(dataset_dir, tmp_path):
    """Every thread holds its reads open at once: 64 contexts of 2,048 would need twice the host's
    default fs.aio-max-nr (65,536); sized from the headroom, or read buffered past it, all read right."""
    if not direct_io.supported(dataset_dir / "manifest.json"):
        pytest.skip(f"the file system of {dataset_dir} refuses O_DIRECT")
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "ignore::RuntimeWarning", str(TESTS / "_aio_worker.py"), str(dataset_dir)]
            + [str(ready), str(i), "8"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(8)
    ]
    results = []
    try:
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, f"process {i} exited with {p.returncode}: {err[-2000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:  # a failure above reports itself, not the other processes' pipes left open
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert [r["failures"] for r in results] == [[]] * 8
    assert sum(r["contexts"] for r in results) >= 1  # direct reads were among them


# -- background threads --------------------------------------------------------------------------


def _wait_for(condition, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_readahead_thread_that_fails_hands_its_error_to_the_reader(dataset_dir, monkeypatch):
    with oj.open_dataset(dataset_dir, readahead=False, direct_io=False) as ds:
        ahead = ReadAhead(ds)

        def broken(pieces):
            raise ValueError("a bug in the announcer")

        monkeypatch.setattr(ahead, "advise", broken)
        ahead.start([(0, 0, 16)])
        assert _wait_for(lambda: ahead._error is not None)
        with pytest.raises(ValueError, match="a bug in the announcer"):
            ahead.start([(0, 16, 32)])
        monkeypatch.undo()
        ahead.start([(0, 16, 32)])  # read-ahead goes on: a new thread, not the one that died
        assert ahead._worker[0][0].is_alive()
        assert _wait_for(lambda: ahead.advised_bytes > 0)
        ahead.close()
        ahead.close()  # idempotent


def test_readahead_queue_is_bounded_and_close_races_start(dataset_dir, monkeypatch):
    started: list[threading.Thread] = []  # this test's read-ahead threads (other tests' datasets have theirs)

    class Recorded(threading.Thread):
        def start(self):
            if self.name == "omicsio-jax-readahead":
                started.append(self)
            super().start()

    monkeypatch.setattr(threading, "Thread", Recorded)
    with oj.open_dataset(dataset_dir, readahead=False, direct_io=False) as ds:
        ahead = ReadAhead(ds)
        release = threading.Event()
        monkeypatch.setattr(ahead, "advise", lambda pieces: release.wait(10))
        for _ in range(50):
            ahead.start([(0, 0, 16)])
        assert ahead._worker[0][1].qsize() <= ReadAhead.QUEUE
        assert ahead.dropped >= 50 - ReadAhead.QUEUE - 1
        release.set()
        ahead.close()

        def hammer(action):
            for _ in range(200):
                action()

        racers = [
            threading.Thread(target=hammer, args=(lambda: ahead.start([(0, 0, 16)]),)),
            threading.Thread(target=hammer, args=(ahead.close,)),
        ]
        for t in racers:
            t.start()
        for t in racers:
            t.join()
        ahead.close()
        assert ahead._worker == [None]
        assert len(started) > 1  # the race started and stopped several
        for t in started:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in started)


def test_a_dropped_readahead_stops_its_thread(dataset_dir):
    with oj.open_dataset(dataset_dir, readahead=False, direct_io=False) as ds:
        ahead = ReadAhead(ds)
        ahead.start([(0, 0, 16)])
        thread = ahead._worker[0][0]
        del ahead
        gc.collect()
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_a_device_prefetch_dropped_without_close_stops_its_threads(dataset_dir):
    with oj.open_dataset(dataset_dir) as ds:
        loader = oj.make_grain_loader(ds, batch_size=32, num_epochs=1, worker_count=0)
        batches = oj.prefetch_to_device(iter(loader), buffer_size=2, threads=2)
        next(batches)
        threads = [t for t in threading.enumerate() if t.name.startswith("omicsio-jax-place")]
        assert threads
        del batches
        gc.collect()
        for t in threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in threads)


def test_a_memory_loader_dropped_without_close_stops_its_prefetch_thread(dataset_dir):
    with oj.open_dataset(dataset_dir) as ds:
        panel = oj.load_panel(ds, list(range(8)))
    before = {t for t in threading.enumerate() if t.name == "omicsio-jax-prefetch"}
    loader = oj.make_memory_loader(panel, batch_size=16, num_epochs=None, read=oj.ReadOptions(prefetch=2))
    first = next(loader)
    threads = {t for t in threading.enumerate() if t.name == "omicsio-jax-prefetch"} - before
    assert threads  # gathering ahead, its queue full: it waits to hand over a batch
    del loader
    gc.collect()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)  # it held the loader (and its panel) forever
    assert first.x.shape == (16, 8)


def test_a_background_producer_failure_reaches_the_consumer_with_its_traceback():
    from omicsio_jax.core.producer import Background

    def make():
        yield 1
        raise KeyError("shard 7")

    items = Background(make)
    assert next(items) == 1
    with pytest.raises(KeyError, match="shard 7") as caught:
        next(items)
    assert any(frame.name == "make" for frame in caught.traceback)
    items.close()
    items.close()


def test_background_producers_on_a_kept_thread_run_there_one_after_another():
    """``executor``: the producer runs on that executor's thread (materialize keeps one per process
    for its reads); `close` stops one mid-way, and the next runs on the same thread."""
    from concurrent.futures import ThreadPoolExecutor

    from omicsio_jax.core.producer import Background

    ran = []

    def make():
        ran.append(threading.get_native_id())
        yield from range(100)

    with ThreadPoolExecutor(1) as kept:
        first = Background(make, executor=kept)
        assert next(first) == 0
        first.close()
        assert list(Background(make, executor=kept)) == list(range(100))
        failing = Background(lambda: iter([1, {}["shard 7"]]), executor=kept)
        with pytest.raises(KeyError, match="shard 7"):
            next(failing)
    assert len(ran) == 2 and ran[0] == ran[1] != threading.get_native_id()


# -- extras ------------------------------------------------------------------------------------


def test_a_missing_extra_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "obstore.store", None)
    with pytest.raises(
        oj.MissingExtraError, match=r"an s3:// dataset needs obstore.store .*\[s3\]'$"
    ) as caught:
        oj.open_dataset("s3://bucket/ds")
    assert isinstance(caught.value, ImportError) and "\n" not in str(caught.value)
    with pytest.raises(oj.MissingExtraError, match=r"\[distributed\]"):
        monkeypatch.setitem(sys.modules, "distributed", None)
        require("distributed", "distributed", "a Dask cluster")
    from train._orbax import _ocp

    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    with pytest.raises(
        oj.MissingExtraError, match=r"^--checkpoint-format orbax needs orbax.checkpoint .*\[orbax\]'$"
    ):
        _ocp()


def test_a_with_block_closes_the_loaders_and_their_threads_even_when_it_raises(dataset_dir):
    def running(name: str) -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == name}

    before = running("omicsio-jax-read")
    with oj.open_dataset(dataset_dir) as ds:
        with oj.make_loader(ds, batch_size=32, num_epochs=1) as loader:
            assert next(loader).x.shape[0] == 32
            readers = running("omicsio-jax-read") - before
        assert readers  # the loader's reading threads ran while the block did, and stop with it
        for t in readers:
            t.join(timeout=10)
        assert not [t for t in readers if t.is_alive()]
        with pytest.raises(ValueError, match="closed"):
            next(loader)

        panel = oj.load_panel(ds, list(range(8)))
        with pytest.raises(KeyError, match="inside"):  # the block's own error comes out, the loaders closed
            with (
                oj.make_memory_loader(panel, batch_size=16, num_epochs=1) as memory_loader,
                oj.prefetch_to_device(oj.make_loader(ds, batch_size=32, num_epochs=1)) as placed,
            ):
                next(memory_loader), next(placed)
                raise KeyError("inside")
        for closed in (memory_loader, placed):
            with pytest.raises(ValueError, match="closed"):
                next(closed)
