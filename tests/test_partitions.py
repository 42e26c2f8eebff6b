"""Partitioned materialize: byte-identical output from one process, a local pool and Dask; a worker
killed mid-partition costs that partition only; bad data and missing sidecars stop the run."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import vortex
from conftest import (
    assert_a_pool_imports_no_pandas,
    assert_csr_equal,
    numpy_huge_pages,
    table_csr,
    write_with_a_nan,
)

import omicsio_jax as oj
from materialize import Dask, InputOptions, Layout, materialize
from materialize._cli import main
from materialize._finalize import finalize
from materialize._materialize import open_source
from materialize._partition import Job, PartResult, write_partition
from materialize._validate import GeneIndex

SHARD = 256  # 3,000 cells: 12 partitions


def _digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _job(src, staging, obs=("drug",)) -> Job:
    """A materialize job over ``src`` writing under ``staging`` (token "run1"), as `materialize` makes one."""
    genes = GeneIndex.from_tokens(src.genes.column("gene_token_id").to_numpy(), "genes")
    options = Layout(group_size=16, compression="zstd:-1").writer_options
    return Job(src, tuple(obs), genes, None, False, SHARD, options, str(staging), "run1")


def _hive_files(corpus_table: pa.Table, root: Path) -> Path:
    """The corpus split unevenly over hive folders (files of 700, 1,100, 50 and 1,150 rows)."""
    bounds = [0, 700, 1800, 1850, 3000]
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        folder = root / f"part={i}"
        folder.mkdir(parents=True)
        pq.write_table(corpus_table.slice(a, b - a), folder / "cells.parquet", row_group_size=128)
    return root


@pytest.fixture(scope="module")
def hive_input(corpus_table, corpus, tmp_path_factory):
    root = _hive_files(corpus_table, tmp_path_factory.mktemp("hive"))
    (root / "gene_metadata.parquet").write_bytes(Path(corpus.genes_parquet).read_bytes())
    return root


@pytest.mark.parametrize("where", [None, "tissue IN ('lung', 'liver', 'skin') AND part <> 2"])
def test_a_pool_writes_the_same_bytes_as_one_process(hive_input, corpus_table, tmp_path, where):
    one = materialize(
        str(hive_input),
        tmp_path / "one",
        workers=1,
        progress=False,
        read=InputOptions(where=where),
        layout=Layout(shard_cells=SHARD),
    )
    pool = materialize(
        str(hive_input),
        tmp_path / "pool",
        workers=2,
        progress=False,
        read=InputOptions(where=where),
        layout=Layout(shard_cells=SHARD),
    )
    assert (one.workers, pool.workers) == (1, 2) and pool.partitions == len(pool.manifest.shards) > 2
    assert _digests(tmp_path / "one") == _digests(tmp_path / "pool")
    expected = corpus_table
    if where is not None:  # the same filter, by pyarrow: part 2 holds rows 1800..1849
        keep = pc.is_in(corpus_table.column("tissue"), pa.array(["lung", "liver", "skin"])).to_numpy(
            zero_copy_only=False
        )
        keep[1800:1850] = False
        expected = corpus_table.filter(pa.array(keep))
    ds = oj.open_dataset(tmp_path / "pool")
    assert ds.num_cells == expected.num_rows
    assert list(ds.cell_ids) == expected.column("cell_id").to_pylist()
    assert_csr_equal(ds.read_csr(np.arange(ds.num_cells)), table_csr(expected))
    assert list(ds.obs["tissue"].labels()) == expected.column("tissue").to_pylist()


def test_vortex_and_h5ad_inputs_partition_the_same_way(corpus, corpus_table, tmp_path):
    for i, (a, b) in enumerate([(0, 1000), (1000, 2200), (2200, 3000)]):
        vortex.io.write(corpus_table.slice(a, b - a), str(tmp_path / f"cells-{i}.vortex"))
    kw = dict(
        progress=False,
        obs=["drug", "batch"],
        read=InputOptions(genes=corpus.genes_parquet),
        layout=Layout(shard_cells=SHARD),
    )
    materialize(str(tmp_path / "cells-*.vortex"), tmp_path / "v1", workers=1, **kw)
    materialize(str(tmp_path / "cells-*.vortex"), tmp_path / "v2", workers=2, **kw)
    del kw["read"]
    materialize(corpus.h5ad, tmp_path / "h1", workers=1, **kw)
    materialize(corpus.h5ad, tmp_path / "h2", workers=2, **kw)
    assert _digests(tmp_path / "v1") == _digests(tmp_path / "v2")
    assert _digests(tmp_path / "h1") == _digests(tmp_path / "h2")
    shards = [oj.open_dataset(tmp_path / name).manifest.shards for name in ("v2", "h2")]
    assert [s.sha256 for s in shards[0]] == [s.sha256 for s in shards[1]]  # the same cells, the same shards


def test_a_query_is_one_partition_of_many_shards(corpus, tmp_path):
    query = f"SELECT * FROM '{corpus.cells_parquet}' WHERE n_genes > 100"
    result = materialize(
        None,
        tmp_path / "q",
        workers=2,
        progress=False,
        read=InputOptions(query=query),
        layout=Layout(shard_cells=SHARD),
    )
    assert result.partitions == 1 and result.workers == 1 and len(result.manifest.shards) > 1
    assert oj.verify_dataset(tmp_path / "q") == []


def _writing(partial_parent: Path, marker: bytes = b"materialize._pool") -> tuple[int, int] | None:
    """``(shard writer, worker)``: the process with a shard of a partial output open and its parent,
    the worker process (its command line holding ``marker``)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if (
                    target.startswith(str(partial_parent))
                    and ".partial-" in target
                    and target.endswith(".arrayrecord")
                ):
                    with open(f"/proc/{pid}/stat") as f:
                        parent = int(f.read().rsplit(")", 1)[1].split()[1])
                    with open(f"/proc/{parent}/cmdline", "rb") as f:
                        if marker in f.read():
                            return int(pid), parent
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    return None


def _when_writing(root: Path, act, seen: list[tuple[int, int]], marker: bytes = b"materialize._pool"):
    """A thread that calls ``act(writer, worker)`` on the first shard writer caught writing a shard
    under ``root`` (and its worker), and notes them in ``seen``."""

    def watch():
        deadline = time.monotonic() + 60
        while not seen and time.monotonic() < deadline:
            found = _writing(root, marker)
            if found is not None:
                act(*found)
                seen.append(found)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    return watcher


def _acting_at_work(monkeypatch, root: Path, act) -> list[tuple[int, int]]:
    """Once, where a pool's run next waits for its workers after a shard writer is caught writing a
    shard under ``root``: ``act(writer, worker)`` (in the run's own thread, as a Ctrl-C or a kill
    arriving then would). The ``(writer, worker)`` acted on are noted in the list returned."""
    import materialize._pool as pool

    seen: list[tuple[int, int]] = []
    wait = pool.wait

    def at_work(connections, *args, **kwargs):
        found = None if seen else _writing(root)
        if found is not None:
            seen.append(found)
            act(*found)
        return wait(connections, *args, **kwargs)

    monkeypatch.setattr(pool, "wait", at_work)
    return seen


def _materialize_on_two_workers(corpus, tmp_path):
    return materialize(
        corpus.cells_parquet,
        tmp_path / "out",
        workers=2,
        progress=False,
        read=InputOptions(batch_cells=16),
        layout=Layout(shard_cells=SHARD),
    )


@pytest.mark.parametrize("who", ["worker", "shard writer"])
def test_a_killed_worker_or_shard_writer_costs_only_its_partition(corpus, tmp_path, monkeypatch, who):
    """A worker killed mid-partition, or its shard writer process (the worker's child), is replaced
    and the partition written again; the dataset is the same, byte for byte."""
    materialize(
        corpus.cells_parquet, tmp_path / "ref", workers=1, progress=False, layout=Layout(shard_cells=SHARD)
    )
    kill = lambda writer, worker: os.kill(worker if who == "worker" else writer, signal.SIGKILL)  # noqa: E731
    seen = _acting_at_work(monkeypatch, tmp_path, kill)
    result = _materialize_on_two_workers(corpus, tmp_path)
    assert seen, "no shard writer was caught writing a shard"
    assert len(result.redone) == 1  # that partition, and nothing else, was written again
    assert _digests(tmp_path / "out") == _digests(tmp_path / "ref")


def test_ctrl_c_stops_the_workers_and_their_shard_writers_before_the_output_is_removed(
    corpus, tmp_path, monkeypatch
):
    """The workers' shard writers run in sessions of their own (Ctrl-C reaches only the workers): they
    are killed with their workers and waited for, so none goes on writing a shard into the partial
    output as it is removed (which left an empty ``chunks/`` behind)."""

    def ctrl_c(writer, worker):
        raise KeyboardInterrupt

    seen = _acting_at_work(monkeypatch, tmp_path, ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        _materialize_on_two_workers(corpus, tmp_path)
    assert seen, "no shard writer was caught writing a shard"
    ((writer, worker),) = seen
    assert not _alive(writer) and not _alive(worker)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (not gone, nor a zombie left for its parent to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_by_default_a_small_input_is_written_here_and_a_large_one_on_every_core(
    hive_input, tmp_path, monkeypatch
):
    """The default ``workers`` starts no process for an input of fewer cells than two workers' worth
    (each worker must be given `MIN_CELLS_PER_WORKER` cells to pay for its start), however many
    partitions it has (``workers=N`` runs a pool whatever the size: the tests above)."""
    import materialize._materialize as materialize_module
    from materialize import _pool

    started = []
    real_pool = _pool.Pool

    class CountingPool(real_pool):
        def __init__(self, workers):
            started.append(workers)
            super().__init__(workers)

    monkeypatch.setattr(materialize_module, "Pool", CountingPool)
    monkeypatch.setattr(_pool, "usable_cores", lambda: 16)
    assert [_pool.default_workers(n) for n in (0, 65_535, 65_536, 3 * 32_768, 1 << 20, 1 << 30)] == [
        1,
        1,
        2,
        3,
        16,
        16,
    ]
    layout = Layout(shard_cells=SHARD)
    small = materialize(str(hive_input), tmp_path / "small", progress=False, layout=layout)
    assert small.partitions > 2 and small.workers == 1 and started == []
    monkeypatch.setattr(_pool, "MIN_CELLS_PER_WORKER", 512)  # the same input, now worth 2 workers or more
    monkeypatch.setattr(materialize_module, "usable_cores", lambda: 2)
    large = materialize(str(hive_input), tmp_path / "large", progress=False, layout=layout)
    assert large.workers == 2 and started == [2]  # started once the plan had shown the cells
    assert _digests(tmp_path / "small") == _digests(tmp_path / "large")


def test_pool_map_answers_in_order_and_names_the_item_of_a_dead_worker():
    """`Pool.map` on 2 workers: results in the items' order, a call's error returned in its place (ours
    with its message, any other with what the call did and the traceback), and the pool ready for
    more once every result is in; a worker that dies stops the pool with an error naming its item."""
    from materialize._pool import Pool

    what = lambda item: f"reading {item!r}"  # noqa: E731
    with Pool(2) as pool:
        results = list(pool.map(int, ["1", "x", "3", "4"], what))
        assert results[0] == 1 and results[2:] == [3, 4]
        assert isinstance(results[1], oj.OmicsIOError)
        assert str(results[1]).startswith("reading 'x' failed in a worker process:\n")
        assert "ValueError: invalid literal for int()" in str(results[1])
        assert list(pool.map(abs, [-2, 5], what)) == [2, 5] and len(pool.workers) == 2
        with pytest.raises(oj.OmicsIOError, match=r"^reading 7: its worker process died \(exit code 7\)$"):
            list(pool.map(os._exit, [7], what))
        assert pool.workers == []


def test_a_workers_temporary_files_go_with_it_even_when_it_is_killed():
    """A worker writes an object-storage run's partitions to its temporary folder before uploading
    them; killed mid-partition (Ctrl-C, an error elsewhere), it cannot remove them, so each worker's
    temporary files live in a folder of its own that stopping it removes."""
    import tempfile

    from materialize._pool import Pool

    with Pool(2) as pool:
        made = list(pool.map(tempfile.mkdtemp, ["-a", "-b"], lambda item: f"making {item}"))
        folders = {w.tmp for w in pool.workers}
        assert all(os.path.isdir(m) and os.path.dirname(m) in folders for m in made)
        pool.shrink(1)  # one stopped while the pool goes on
        kept = pool.workers[0].tmp
        assert all(os.path.isdir(m) == (os.path.dirname(m) == kept) for m in made)
        assert all(os.path.isdir(f) == (f == kept) for f in folders)
    assert not any(os.path.exists(p) for p in [*made, *folders])  # the other gone with the pool
    # a pool whose parent is killed cannot remove its workers' folders: each worker removes its own
    # as it sees the parent gone
    orphan = Pool(1)
    worker = orphan.workers[0]
    made = next(iter(orphan.map(tempfile.mkdtemp, ["-c"], lambda item: f"making {item}")))
    worker.conn.close()  # the parent's end gone, as when it is killed
    worker.proc.wait(timeout=60)
    assert not os.path.exists(made) and not os.path.exists(worker.tmp)


def test_a_workers_kernels_are_cached_where_the_next_run_finds_them(tmp_path, monkeypatch):
    """Where numba has no folder to cache kernels in but the private one in the temporary directory
    (a read-only install, no home: a cluster's shared environment in a batch job), a worker made it
    in its own temporary folder, removed when it stops: every worker compiled every kernel again,
    every run. It caches them in the pool's process's private folder instead."""
    import operator
    import tempfile

    from materialize._pool import Pool
    from omicsio_jax.core.kernel_locators import _private_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("OMICSIO_JAX_KERNEL_TMPDIR", raising=False)
    with Pool(1) as pool:
        (folder,) = pool.map(operator.call, [_private_folder], lambda item: "finding the private folder")
        assert pool.workers[0].tmp.startswith(str(tmp_path / "omicsio-worker-"))
    assert folder == _private_folder() == str(tmp_path / f"omicsio-numba-{os.getuid()}")


def _worker_left_after_its_parent_is_killed(python: str) -> int | None:
    """Start a pool of one worker (its interpreter ``python``) on a call that would take a minute,
    SIGKILL the pool's process 1 s later, and return the worker's pid if it still runs 10 s after
    (then killed here), else None."""
    code = (
        "import sys, time\n"
        "from materialize._pool import Pool\n"
        f"sys.executable = {python!r}\n"
        "pool = Pool(1)\n"
        "print(pool.workers[0].proc.pid, flush=True)\n"
        "list(pool.map(time.sleep, [60], lambda item: 'sleeping'))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    worker = int(parent.stdout.readline())
    time.sleep(1.0)  # the call under way
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    parent.stdout.close()

    def running(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        return state != "Z"  # (a zombie has stopped: only its parent's wait is missing)

    deadline = time.monotonic() + 10
    while running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not running(worker):
        return None
    os.kill(worker, signal.SIGKILL)
    return worker


def test_a_worker_stops_when_its_parent_is_killed_mid_call():
    """A worker busy with a partition (here a call that would take a minute) stops within a fraction
    of a second of its parent's SIGKILL: it used to finish, and on object storage upload into a
    prefix whose lease a rerun had taken over. It runs in a session of its own, so a kill of the
    parent's process group misses it."""
    assert _worker_left_after_its_parent_is_killed(sys.executable) is None


def test_a_worker_stops_when_its_parent_is_killed_before_it_has_started(tmp_path):
    """A worker still starting (importing the package: seconds on a loaded machine) when its parent is
    killed stops too, as it starts: it took the process that had adopted it for its parent, and ran
    the call its parent had sent."""
    slow = tmp_path / "slow-python"  # the worker's interpreter, 2 s late (the parent is killed at 1 s)
    slow.write_text(f'#!/bin/sh\nsleep 2\nexec "{sys.executable}" "$@"\n')
    slow.chmod(0o755)
    assert _worker_left_after_its_parent_is_killed(str(slow)) is None


def test_a_pool_of_one_worker_per_core_pins_each_worker_to_its_core():
    """The default pool (a worker per usable core) pins worker k to core k, so a worker's threads share
    one core's caches; a pool of any other size leaves the workers to the scheduler."""
    from materialize._pool import Pool

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("pinning needs two usable cores")

    def affinities(pool, want):
        deadline = time.monotonic() + 30
        while True:  # a worker pins itself first thing after it starts
            got = [os.sched_getaffinity(w.proc.pid) for w in pool.workers]
            if got == want or time.monotonic() > deadline:
                return got
            time.sleep(0.01)

    with Pool(len(cores)) as pool:
        assert affinities(pool, [{c} for c in cores]) == [{c} for c in cores]
    with Pool(len(cores) + 1) as pool:
        time.sleep(1.0)  # started, and not pinned
        assert affinities(pool, [set(cores)] * (len(cores) + 1)) == [set(cores)] * (len(cores) + 1)


def test_once_no_partition_is_left_the_busy_workers_may_use_every_core(corpus, tmp_path, monkeypatch):
    """A pinned worker's threads share one core; once the last partition is handed out, a worker
    left without one no longer needs its core, so each worker still writing is let onto every core
    (every thread of it and of its shards' compressor process), and a later run pins the workers
    again. The output is the same."""
    from materialize import _pool

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("pinning needs two usable cores")

    def threads_of(worker) -> list[set[int]]:  # the affinities of its threads and its children's
        found = []
        for tid in _pool._threads_of(worker.proc.pid):
            try:
                found.append(os.sched_getaffinity(tid))
            except OSError:  # ended meanwhile
                continue
        return found

    widened = []
    allow = _pool._Worker.allow

    def recording(worker, allowed):
        allow(worker, allowed)
        if sorted(allowed) == cores:
            widened.append((worker.part is not None, threads_of(worker)))

    monkeypatch.setattr(_pool._Worker, "allow", recording)
    layout = Layout(shard_cells=1024)  # 3 partitions over 2 workers: one is left alone at the end
    materialize(corpus.cells_parquet, tmp_path / "ref", workers=1, progress=False, layout=layout)
    materialize(corpus.cells_parquet, tmp_path / "out", workers=len(cores), progress=False, layout=layout)
    assert widened and all(busy for busy, _ in widened)
    assert all(found and all(a == set(cores) for a in found) for _, found in widened)
    assert _digests(tmp_path / "out") == _digests(tmp_path / "ref")

    with _pool.Pool(len(cores)) as pool:  # pinned again: what the next run's start does
        worker = pool.workers[0]
        deadline = time.monotonic() + 30
        while threads_of(worker) != [{worker.core}] and time.monotonic() < deadline:
            time.sleep(0.01)  # it pins itself first thing after it starts
        allow(worker, cores)
        assert all(a == set(cores) for a in threads_of(worker))
        allow(worker, [worker.core])
        assert all(a == {worker.core} for a in threads_of(worker))


def test_a_killed_dask_worker_costs_only_a_rerun_of_its_task(corpus, tmp_path, dask_cluster):
    materialize(
        corpus.cells_parquet, tmp_path / "ref", workers=1, progress=False, layout=Layout(shard_cells=SHARD)
    )
    killed: list[tuple[int, int]] = []
    kill = lambda writer, worker: os.kill(worker, signal.SIGKILL)  # noqa: E731
    killer = _when_writing(tmp_path, kill, killed, b"multiprocessing")  # a Nanny's worker process
    try:
        materialize(
            corpus.cells_parquet,
            tmp_path / "out",
            progress=False,
            read=InputOptions(batch_cells=16),
            layout=Layout(shard_cells=SHARD),
            workers=Dask(scheduler=dask_cluster.scheduler_address),
        )
    finally:
        killer.join()
    assert killed, "no Dask worker was caught writing a shard"
    assert _digests(tmp_path / "out") == _digests(tmp_path / "ref")
    dask_cluster.wait_for_workers(2, timeout=60)  # the Nanny restarted it


def test_bad_data_in_a_worker_stops_the_run_and_leaves_nothing(corpus_table, tmp_path):
    genes = corpus_table.column("gene_token_id").to_pylist()
    genes[2041] = list(reversed(genes[2041]))  # in partition 7 of 12
    table = corpus_table.set_column(
        corpus_table.column_names.index("gene_token_id"),
        "gene_token_id",
        pa.array(genes, pa.list_(pa.int32())),
    )
    pq.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(
        oj.DataValidationError, match=r"gene_token_id not sorted in row 2041 \(cell_id c0*2041\) of"
    ):
        materialize(
            tmp_path / "bad.parquet",
            tmp_path / "out",
            workers=2,
            progress=False,
            layout=Layout(shard_cells=SHARD),
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.parquet"]


def test_partitions_and_their_merge_make_arrays_without_numpy_huge_pages(corpus, tmp_path, monkeypatch):
    # `small_pages`: a partition's batches (on a pool's or Dask's worker, or here) and the merge of
    # the partitions' statistics in the main process
    huge_pages = numpy_huge_pages()
    from materialize import _finalize, _partition

    seen = {"write": [], "merge": []}
    add, merge = _partition.StatsAccumulator.add, _finalize.Finalizer._merge

    def spy_add(self, *a, **k):
        seen["write"].append(huge_pages())
        return add(self, *a, **k)

    def spy_merge(self, *a, **k):
        seen["merge"].append(huge_pages())
        return merge(self, *a, **k)

    monkeypatch.setattr(_partition.StatsAccumulator, "add", spy_add)
    monkeypatch.setattr(_finalize.Finalizer, "_merge", spy_merge)
    before = huge_pages()
    src = open_source(str(corpus.cells_parquet))
    write_partition(_job(src, tmp_path / "staging"), src.plan(SHARD)[0])
    assert seen["write"] and not any(seen["write"]) and huge_pages() is before
    seen["write"].clear()
    materialize(corpus.cells_parquet, tmp_path / "ds", workers=1, progress=False)
    assert seen["merge"] and not any(seen["merge"]) and not any(seen["write"])
    assert huge_pages() is before


def test_finalize_refuses_a_missing_partition_sidecar(corpus, tmp_path):
    src = open_source(str(corpus.cells_parquet))
    parts = src.plan(SHARD)
    job = _job(src, tmp_path)
    for part in parts[:3] + parts[4:]:
        write_partition(job, part)
    kw = dict(features=src.genes, codec={}, array_record={}, source={}, created_by="test")
    with pytest.raises(oj.OmicsIOError, match=r"partition 3 \(cells 768..1,023\) has no sidecar at finalize"):
        finalize(job, _store(tmp_path), parts, **kw)
    write_partition(job, parts[3])
    other = dataclasses.replace(job, token="run2")
    with pytest.raises(oj.OmicsIOError, match="belongs to another materialize run"):
        finalize(other, _store(tmp_path), parts, **kw)


def test_partitions_merged_as_they_complete_in_any_order_give_the_same_bytes(corpus, tmp_path):
    """The runners hand each completed partition to the `Finalizer` at once (Dask and a pool complete
    them out of order); the dataset is the one `finalize` makes from all of them at the end. A merge
    that fails in the background is raised by ``finish``."""
    import shutil

    from materialize._finalize import Finalizer

    src = open_source(str(corpus.cells_parquet))
    parts = src.plan(SHARD)
    a, b, c = (tmp_path / name for name in "abc")
    job = _job(src, a, obs=("drug", "cell_type"))
    for part in parts:
        write_partition(job, part)
    shutil.copytree(a, b)
    shutil.copytree(a, c)
    kw = dict(features=src.genes, codec={}, array_record={}, source={}, created_by="test")
    with Finalizer(job, _store(a), parts) as finalizer:
        for part in reversed(parts[2:]):
            finalizer.add(part.index)  # held back: partition 0 is not merged yet
        finalizer.add(parts[0].index)  # merged; 1 was never handed over, so finish merges 1, 2, ...
        incremental = finalizer.finish(**kw)
    at_end = finalize(dataclasses.replace(job, staging=str(b)), _store(b), parts, **kw)
    assert incremental.fingerprint == at_end.fingerprint
    assert _digests(a) == _digests(b)
    (c / "_parts" / "p-00003" / "part.json").unlink()
    with Finalizer(dataclasses.replace(job, staging=str(c)), _store(c), parts) as finalizer:
        for part in parts:
            finalizer.add(part.index)
        with pytest.raises(
            oj.OmicsIOError, match=r"partition 3 \(cells 768..1,023\) has no sidecar at finalize"
        ):
            finalizer.finish(**kw)


def _store(root):
    from omicsio_jax.storage.store import open_store

    return open_store(root)


def test_dask_local_cluster_writes_the_same_bytes(hive_input, corpus, corpus_table, tmp_path, dask_cluster):
    materialize(
        str(hive_input), tmp_path / "one", workers=1, progress=False, layout=Layout(shard_cells=SHARD)
    )
    result = materialize(
        str(hive_input),
        tmp_path / "dask",
        progress=False,
        layout=Layout(shard_cells=SHARD),
        workers=Dask(scheduler=dask_cluster.scheduler_address),
    )
    assert result.workers == 2
    assert _digests(tmp_path / "one") == _digests(tmp_path / "dask")
    materialize(corpus.h5ad, tmp_path / "h1", workers=1, progress=False, layout=Layout(shard_cells=SHARD))
    materialize(
        corpus.h5ad,
        tmp_path / "h2",
        progress=False,
        layout=Layout(shard_cells=SHARD),
        workers=Dask(scheduler=dask_cluster.scheduler_address),
    )
    assert _digests(tmp_path / "h1") == _digests(tmp_path / "h2")
    # a CSC matrix is regrouped by row in the staging folder, which the workers write their parts in
    import anndata as ad

    adata = ad.read_h5ad(corpus.h5ad)
    adata.X = adata.X.tocsc()
    adata.write_h5ad(tmp_path / "csc.h5ad")
    materialize(
        tmp_path / "csc.h5ad",
        tmp_path / "h3",
        progress=False,
        layout=Layout(shard_cells=SHARD),
        read=InputOptions(batch_cells=256),
        workers=Dask(scheduler=dask_cluster.scheduler_address),
    )
    h1, h3 = (_digests(tmp_path / h) for h in ("h1", "h3"))
    assert h1.pop("manifest.json") != h3.pop("manifest.json")  # (the input's name)
    assert h1 == h3
    for i, (a, b) in enumerate([(0, 1000), (1000, 3000)]):
        vortex.io.write(corpus_table.slice(a, b - a), str(tmp_path / f"cells-{i}.vortex"))
    kw = dict(progress=False, read=InputOptions(genes=corpus.genes_parquet), layout=Layout(shard_cells=SHARD))
    materialize(str(tmp_path / "cells-*.vortex"), tmp_path / "v1", workers=1, **kw)
    materialize(
        str(tmp_path / "cells-*.vortex"),
        tmp_path / "v2",
        **kw,
        workers=Dask(scheduler=dask_cluster.scheduler_address),
    )
    assert _digests(tmp_path / "v1") == _digests(tmp_path / "v2")
    from distributed import Client

    from materialize import _dask

    with Client(dask_cluster) as client:  # every run released its workers' scratches at its end
        assert set(client.run(lambda: len(_dask._DASK_SCRATCH)).values()) == {0}


def test_dask_tasks_of_a_thread_share_one_scratch_per_run(corpus, tmp_path):
    """A Dask worker thread keeps one `Scratch` per run (its partitions reuse the statistics table and
    the shard writer, as a pool worker's do); the run's end releases it, and a thread that starts
    another run closes what an unreleased one left."""
    from materialize._dask import _DASK_SCRATCH, dask_task, release_dask_scratch

    src = open_source(str(corpus.cells_parquet))
    parts = src.plan(SHARD)
    job = _job(src, tmp_path / "a")
    for part in parts[:3]:
        assert isinstance(dask_task(job, part), PartResult)
    assert list(_DASK_SCRATCH) == [("run1", threading.get_ident())]
    first = _DASK_SCRATCH[("run1", threading.get_ident())]
    (tmp_path / "probe").mkdir()
    writer = first.take_shard_writer(tmp_path / "probe", shard_cells=SHARD, options=job.options)
    writer.finish()
    first.give_back_shard_writer(writer)
    other = dataclasses.replace(job, token="run2", staging=str(tmp_path / "b"))
    dask_task(other, parts[0])  # run1 never released here: closed now
    assert list(_DASK_SCRATCH) == [("run2", threading.get_ident())]
    with pytest.raises(ProcessLookupError):
        os.kill(writer.pid, 0)  # run1's writer process was stopped
    assert release_dask_scratch("run2") == 1 and not _DASK_SCRATCH


def test_dask_data_errors_are_not_retried(tmp_path, corpus_table, dask_cluster):
    write_with_a_nan(corpus_table, 300, tmp_path / "nan.parquet")
    with pytest.raises(oj.DataValidationError, match=r"gene_expression is nan \(not finite\) in row 300"):
        materialize(
            tmp_path / "nan.parquet",
            tmp_path / "out",
            progress=False,
            layout=Layout(shard_cells=SHARD),
            workers=Dask(scheduler=dask_cluster.scheduler_address),
        )
    assert not (tmp_path / "out").exists()


def test_dask_scheduler_and_worker_commands(corpus, tmp_path):
    """The multi-machine deployment on loopback: `dask scheduler` and `dask worker` as separate processes."""
    dask = Path(sys.executable).with_name("dask")
    scheduler_file = tmp_path / "scheduler.json"
    common = ["--no-dashboard"]
    procs = [
        subprocess.Popen(
            [
                dask,
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--scheduler-file",
                scheduler_file,
                *common,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists():
            assert time.monotonic() < deadline, "the Dask scheduler did not start"
            time.sleep(0.1)
        procs.append(
            subprocess.Popen(
                [
                    dask,
                    "worker",
                    "--scheduler-file",
                    scheduler_file,
                    "--nthreads",
                    "1",
                    "--host",
                    "127.0.0.1",
                    *common,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        code = main(
            [
                str(corpus.cells_parquet),
                str(tmp_path / "dask"),
                "--shard-cells",
                str(SHARD),
                "--dask-scheduler-file",
                str(scheduler_file),
                "--no-progress",
            ]
        )
        assert code == 0
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=30)
    materialize(
        corpus.cells_parquet, tmp_path / "one", workers=1, progress=False, layout=Layout(shard_cells=SHARD)
    )
    assert _digests(tmp_path / "one") == _digests(tmp_path / "dask")


def test_a_worker_takes_runs_of_consecutive_partitions_and_the_last_ones_are_shared():
    """Runs of consecutive partitions per worker (each goes on from the parquet stream its last one
    left open), handed out in the plan's order; at the end a worker takes the last partition another
    has still to write; a dead worker's partition and the rest of its run go back to the front."""
    from materialize._plan import Partition
    from materialize._pool import Schedule, run_length

    parts = [Partition(i, i * 10, 10) for i in range(8)]
    order = Schedule(parts, run=2)
    taken = [(w, order.next(w)) for w in ("a", "b", "a", "a", "b", "b", "a", "b", "a", "b")]
    assert [(w, None if p is None else p.index) for w, p in taken] == [
        ("a", 0),
        ("b", 2),
        ("a", 1),
        ("a", 4),
        ("b", 3),
        ("b", 6),
        ("a", 5),
        ("b", 7),
        ("a", None),
        ("b", None),
    ]
    order = Schedule(parts[:6], run=3)
    assert [order.next(w).index for w in ("a", "b", "b", "b", "b", "a")] == [0, 3, 4, 5, 2, 1]
    assert order.next("a") is None and order.next("b") is None
    order = Schedule(parts[:6], run=3)
    assert [order.next(w).index for w in ("a", "b")] == [0, 3]
    order.give_back("a", parts[0])  # "a" died writing partition 0: 0, 1 and 2 go to whoever is next
    assert [order.next(w).index for w in ("c", "c", "c", "b", "b")] == [0, 1, 2, 4, 5]
    assert order.next("c") is None
    # one at a time until every worker gets two runs; at most 4 in a run
    assert [run_length(p, w) for p, w in [(5, 2), (8, 2), (13, 2), (3, 4), (1526, 16)]] == [1, 2, 3, 1, 4]


def test_plain_parquet_read_by_pyarrow_gives_the_bytes_duckdb_gives(corpus, corpus_table, tmp_path):
    """Local parquet files with no filter are read by pyarrow (faster, and without DuckDB's page faults
    for every Arrow batch); the output is that of DuckDB's reading, byte for byte. Files of uneven
    lengths and row groups that do not align with the partitions; one file stores an obs column
    dictionary-encoded (what pandas categoricals become), which DuckDB reads as its values."""
    folder = tmp_path / "in"
    folder.mkdir()
    for i, (a, b) in enumerate([(0, 1100), (1100, 1150), (1150, 3000)]):
        part = corpus_table.slice(a, b - a)
        if i == 2:
            k = part.column_names.index("tissue")
            part = part.set_column(k, "tissue", pc.dictionary_encode(part.column("tissue")))
        pq.write_table(part, folder / f"cells-{i}.parquet", row_group_size=300)
    kw = dict(progress=False, read=InputOptions(genes=corpus.genes_parquet), layout=Layout(shard_cells=SHARD))
    src = open_source(str(folder / "*.parquet"), genes=corpus.genes_parquet)
    obs = list(src.obs_columns)
    parts = src.plan(SHARD)
    assert {src.reader_for(obs, p) for p in parts} == {"pyarrow"}
    assert open_source(str(folder / "*.parquet"), where="TRUE").reader_for(obs, parts[0]) == "duckdb"
    by_pyarrow = materialize(str(folder / "*.parquet"), tmp_path / "pyarrow", workers=2, **kw)
    kw["read"] = InputOptions(genes=corpus.genes_parquet, where="TRUE")
    by_duckdb = materialize(str(folder / "*.parquet"), tmp_path / "duckdb", workers=1, **kw)
    mine, theirs = _digests(tmp_path / "pyarrow"), _digests(tmp_path / "duckdb")
    assert mine.pop("manifest.json") != theirs.pop("manifest.json")  # it records the `where`
    assert mine == theirs
    assert by_pyarrow.manifest.shards == by_duckdb.manifest.shards


def test_pyarrow_reading_names_the_file_and_its_row(corpus_table, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    ids = corpus_table.column("cell_id").to_pylist()
    ids[1300] = None  # row 200 of the second file, in a partition that starts at its row 180
    table = corpus_table.set_column(
        corpus_table.column_names.index("cell_id"), "cell_id", pa.array(ids, pa.string())
    )
    for i, (a, b) in enumerate([(0, 1100), (1100, 3000)]):
        pq.write_table(table.slice(a, b - a), folder / f"cells-{i}.parquet", row_group_size=100)
    assert open_source(str(folder / "*.parquet")).reader_for([]) == "pyarrow"
    with pytest.raises(
        oj.DataValidationError, match=r"cell id column cell_id is null in row 200 of .*cells-1\.parquet"
    ):
        materialize(
            str(folder / "*.parquet"),
            tmp_path / "out",
            workers=1,
            progress=False,
            layout=Layout(shard_cells=SHARD),
        )
    assert not (tmp_path / "out").exists()


def test_a_process_reuses_its_statistics_table_and_shard_writer_across_partitions(
    corpus, tmp_path, monkeypatch
):
    """`Scratch` hands the next partition the statistics accumulator the last one emptied (its 281 MB
    table at 62,710 genes stays mapped), the shard writer's child process and the reading thread:
    every partition's files are those of a fresh accumulator and writer, the table is all zeros
    between partitions, one writer process serves them all and one thread reads their input. A
    partition that fails keeps neither accumulator nor writer."""
    from materialize._scratch import Scratch
    from materialize._shards import ShardWriterProcess

    src = open_source(str(corpus.cells_parquet))
    parts = src.plan(SHARD)
    readers = []  # the thread that reads each partition's input, in the order they were written
    read = type(src).batches

    def batches(self, *args, **kwargs):
        readers.append(threading.get_native_id())  # a kernel id: a new thread never has an old one's
        return read(self, *args, **kwargs)

    monkeypatch.setattr(type(src), "batches", batches)
    job = _job(src, tmp_path / "a")
    fresh = dataclasses.replace(job, staging=str(tmp_path / "b"))
    scratch = Scratch()
    (tmp_path / "probe").mkdir()
    pids = set()
    for part in parts[:4]:
        write_partition(job, part, scratch=scratch)
        write_partition(fresh, part)
        stats = scratch.take_stats(job.num_columns, SHARD)
        assert stats.rows == 0 and not stats.hist.any() and not stats.total.any()
        scratch.give_back_stats(stats)
        writer = scratch.take_shard_writer(tmp_path / "probe", shard_cells=SHARD, options=job.options)
        assert isinstance(writer, ShardWriterProcess) and writer.finish() == []
        pids.add(writer.pid)
        scratch.give_back_shard_writer(writer)
    assert len(pids) == 1
    assert len(readers) == 8 and len(set(readers[0::2])) == 1  # the scratch's partitions: one thread
    assert threading.get_native_id() not in readers
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")
    used = scratch.take_stats(job.num_columns, SHARD)
    scratch.give_back_stats(used)

    def interrupted(cells):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_partition(job, parts[4], interrupted, scratch=scratch)
    assert scratch.take_stats(job.num_columns, SHARD) is not used
    with pytest.raises(ProcessLookupError):
        os.kill(pids.pop(), 0)  # the interrupted partition's writer was stopped, not kept
    writer = scratch.take_shard_writer(tmp_path / "probe", shard_cells=SHARD, options=job.options)
    writer.finish()
    scratch.give_back_shard_writer(writer)
    os.kill(writer.pid, signal.SIGKILL)  # the kept child dies between partitions: the next gets a new one
    os.waitpid(writer.pid, 0)
    replacement = scratch.take_shard_writer(tmp_path / "probe", shard_cells=SHARD, options=job.options)
    assert replacement.pid != writer.pid and replacement.finish() == []
    scratch.give_back_shard_writer(replacement)
    scratch.close()
    with pytest.raises(ProcessLookupError):
        os.kill(replacement.pid, 0)


def test_a_scratch_closed_while_its_partition_writes_closes_once_the_partition_ends(
    corpus, tmp_path, monkeypatch
):
    """A Dask run's end closes its workers' scratches, and may reach a task the scheduler gave up on
    while that task still writes. The close waits for the partition: the statistics queued behind a
    busy thread still run, the partition completes with the bytes of a fresh one (no hang on work the
    close would have cancelled), and only then do the kept threads and the writer process stop."""
    import materialize._partition as partition
    from materialize._scratch import Scratch

    src = open_source(str(corpus.cells_parquet))
    part = src.plan(SHARD)[0]
    job = _job(src, tmp_path / "a")
    busy, closed = threading.Event(), threading.Event()
    add_stats = partition._add_stats

    def slow_stats(*args):
        busy.wait(30)  # the statistics thread held until the scratch is closed: the next task queued
        return add_stats(*args)

    monkeypatch.setattr(partition, "_add_stats", slow_stats)
    scratch = Scratch()
    before = set(threading.enumerate())

    kept = []  # the scratch's threads, seen while the partition writes

    def progress(cells):
        if not closed.is_set():
            kept.extend(t for t in set(threading.enumerate()) - before if t.name.startswith("materialize-"))
            scratch.close()
            closed.set()
            busy.set()

    outcome = []
    writing = threading.Thread(
        target=lambda: outcome.append(write_partition(job, part, progress, scratch=scratch)), daemon=True
    )
    writing.start()
    writing.join(60)
    assert not writing.is_alive(), "the partition hung on statistics its scratch's close cancelled"
    assert closed.is_set() and len(outcome) == 1 and outcome[0].num_cells == part.num_cells
    monkeypatch.undo()
    write_partition(dataclasses.replace(job, staging=str(tmp_path / "b")), part)
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")
    assert {t.name.rsplit("_", 1)[0] for t in kept} >= {"materialize-stats", "materialize-reader"}
    for t in kept:
        t.join(10)
    assert not [t.name for t in kept if t.is_alive()]


def test_a_pool_converts_parquet_without_importing_pandas(corpus, tmp_path):
    """pyarrow imports pandas (~0.7 s) on its first ``pa.array``, ``pa.scalar`` or ``to_numpy`` in
    a process: the parent, every pool worker and the shard writers of a parquet conversion (with
    statistics and obs) hand arrays between NumPy and Arrow without those, so no process pays it."""
    script = (
        "from materialize import Layout, materialize\n"
        f"materialize({str(corpus.cells_parquet)!r}, {str(tmp_path / 'out')!r}, workers=2, "
        "layout=Layout(shard_cells=1024), progress=False)\n"
    )
    assert_a_pool_imports_no_pandas(script)
    assert len(oj.open_dataset(tmp_path / "out").obs) > 0
