"""materialize on a Dask cluster at its edges: a scheduler that is missing, not listening or not a
Dask scheduler is a one-line error at once; a run stopped by a data error leaves nothing on S3, not
even what its other tasks, still running, wrote after the error."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from conftest import write_with_a_nan

import omicsio_jax as oj
from materialize import Dask, InputOptions, Layout, materialize
from materialize._partition import Job
from omicsio_jax.storage.store import S3Store


def _in_thread(call, seconds: float = 20) -> BaseException | None:
    """What ``call`` raised, run on a thread; a call still running after ``seconds`` fails the test."""
    raised: list[BaseException | None] = [None]

    def target():
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            raised[0] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    return raised[0]


def test_a_missing_scheduler_file_is_a_one_line_error(corpus, tmp_path, monkeypatch):
    """A scheduler file that does not appear within the wait (shortened here) is a one-line error
    (Dask's Client waits for it forever); one written during the wait is read."""
    import threading

    from materialize import _dask

    monkeypatch.setattr(_dask, "SCHEDULER_FILE_WAIT_S", 1.0)
    late = tmp_path / "late.json"
    writer = threading.Timer(0.3, lambda: late.write_text('{"address": "tcp://10.0.0.7:8786"}'))
    writer.start()
    assert _dask._address_in(str(late)) == "tcp://10.0.0.7:8786"
    writer.join()
    missing = tmp_path / "sched.json"
    error = _in_thread(
        lambda: materialize(
            corpus.cells_parquet, tmp_path / "out", workers=Dask(scheduler_file=str(missing)), progress=False
        )
    )
    assert isinstance(error, oj.OmicsIOError)
    assert f"Dask scheduler file {missing} does not exist" in str(error) and "\n" not in str(error)
    assert not (tmp_path / "out").exists()


def test_a_scheduler_address_nobody_listens_on_is_refused_at_once(corpus, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(
        oj.OmicsIOError,
        match=rf"^cannot reach the Dask scheduler at tcp://127.0.0.1:{port}: Connection refused; check",
    ):
        materialize(
            corpus.cells_parquet, tmp_path / "out", workers=Dask(f"tcp://127.0.0.1:{port}"), progress=False
        )
    assert not (tmp_path / "out").exists()


def test_a_server_that_is_not_a_dask_scheduler_is_a_one_line_error(corpus, tmp_path):
    """The dashboard's port (an HTTP server) given for the scheduler's: its answer is no Dask frame."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer():
        server.settimeout(15)
        with server, contextlib.suppress(OSError):
            while True:  # every connection gets an HTTP answer
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(1)
                    with contextlib.suppress(OSError):
                        conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" * 4)
                    time.sleep(0.5)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    error = _in_thread(
        lambda: materialize(
            corpus.cells_parquet, tmp_path / "out", workers=Dask(f"tcp://127.0.0.1:{port}"), progress=False
        )
    )
    server.close()
    assert isinstance(error, oj.OmicsIOError), repr(error)
    assert f"tcp://127.0.0.1:{port}" in str(error) and "\n" not in str(error)
    assert "not its dashboard's 8787" in str(error)


def test_a_real_dashboard_given_for_the_scheduler_is_a_one_line_error(
    corpus, tmp_path, dask_cluster, monkeypatch
):
    """Dask's dashboard (an HTTP server that waits for a request) given for the scheduler: no
    handshake comes, and the run says so within the wait (shortened here) instead of Dask's Client
    waiting for minutes."""
    from materialize import _dask

    monkeypatch.setattr(_dask, "HANDSHAKE_WAIT_S", 1.0)
    dashboard = dask_cluster.dashboard_link.split("//")[1].split("/")[0]
    error = _in_thread(
        lambda: materialize(
            corpus.cells_parquet, tmp_path / "out", workers=Dask(f"tcp://{dashboard}"), progress=False
        )
    )
    assert isinstance(error, oj.OmicsIOError), repr(error)
    assert "no handshake in 1 s" in str(error) and "not its dashboard's 8787" in str(error)
    assert not (tmp_path / "out").exists()


def test_a_data_error_on_dask_leaves_nothing_on_s3(s3, corpus_table, tmp_path, dask_cluster):
    """The bad cell is in the first partition; the other worker is still writing its own when the
    error stops the run, and its task is not interrupted by being cancelled: the run waits for it
    before removing what was written, so nothing is left under the prefix."""
    write_with_a_nan(corpus_table, 100, tmp_path / "nan.parquet", row_group_size=128)
    with pytest.raises(oj.DataValidationError, match=r"gene_expression is nan \(not finite\) in row 100 "):
        materialize(
            tmp_path / "nan.parquet",
            s3.url("out/"),
            progress=False,
            read=InputOptions(batch_cells=16),
            layout=Layout(shard_cells=128),
            workers=Dask(scheduler=dask_cluster.scheduler_address),
        )
    time.sleep(1.5)  # what a task still running would write comes by now
    assert [key for key, _ in S3Store(s3.url("out/")).list()] == []


@contextlib.contextmanager
def _workers_in(cluster, folder):
    """The Dask workers' current directory is ``folder`` (as on another machine), then theirs again."""
    from distributed import Client

    with Client(cluster) as client:
        before = client.run(os.getcwd)
        client.run(os.chdir, str(folder))
        try:
            yield
        finally:
            for worker, cwd in before.items():
                client.run(os.chdir, cwd, workers=[worker])


def test_a_relative_input_is_the_one_given_whatever_the_workers_directory(
    corpus, corpus_table, tmp_path, dask_cluster, monkeypatch
):
    """A relative input path names a file in this process's current directory: the Dask workers,
    whose own directory holds a different file of that name (as on another machine), read the one
    given, not theirs."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    name = Path(corpus.cells_parquet).name
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    values = corpus_table.column("gene_expression").combine_chunks()
    doubled = pa.ListArray.from_arrays(
        values.offsets, pc.multiply(values.values, pa.scalar(2.0, pa.float32()))
    )
    column = corpus_table.column_names.index("gene_expression")
    pq.write_table(corpus_table.set_column(column, "gene_expression", doubled), theirs / name)
    (theirs / "gene_metadata.parquet").write_bytes(Path(corpus.genes_parquet).read_bytes())
    monkeypatch.chdir(Path(corpus.cells_parquet).parent)
    with _workers_in(dask_cluster, theirs):
        materialize(
            name,
            tmp_path / "out",
            progress=False,
            layout=Layout(shard_cells=512),
            workers=Dask(scheduler=dask_cluster.scheduler_address),
        )
    ds = oj.open_dataset(tmp_path / "out")
    _, _, got = ds.read_csr(np.arange(ds.num_cells))
    np.testing.assert_array_equal(got, values.values.to_numpy())


def test_an_input_the_dask_workers_do_not_see_is_a_one_line_error():
    """A local path a worker does not see (a file system this machine alone mounts) is refused before
    any task runs."""
    from materialize._dask import _check_paths_on_workers

    class Unseen:  # what Client.run answers where one worker lacks the path
        def run(self, function, paths):
            return {"tcp://10.0.0.8:4000": list(paths[:1])}

    class About:
        source = type("Source", (), {"description": {"files": ["/scratch/me/cells.parquet"]}})()
        staging = "s3://bucket/out/"

    with pytest.raises(
        oj.OmicsIOError,
        match=r"^input /scratch/me/cells.parquet is not seen by every Dask worker .*: give an absolute path",
    ):
        _check_paths_on_workers(Unseen(), About())


def test_an_output_the_dask_workers_do_not_see_leaves_nothing_anywhere(
    corpus, tmp_path, dask_cluster, monkeypatch
):
    """A relative output: the workers would write its partitions under their own directory."""
    (tmp_path / "client").mkdir()
    (tmp_path / "worker").mkdir()
    monkeypatch.chdir(tmp_path / "client")
    with (
        _workers_in(dask_cluster, tmp_path / "worker"),
        pytest.raises(
            oj.OmicsIOError,
            match=r"^the output \(its partial directory \.out\.partial-\S+\) is not seen by every Dask worker",
        ),
    ):
        materialize(
            corpus.cells_parquet,
            "out",
            progress=False,
            layout=Layout(shard_cells=512),
            workers=Dask(scheduler=dask_cluster.scheduler_address),
        )
    time.sleep(0.5)  # what a task still running would write comes by now
    assert os.listdir(tmp_path / "client") == [] and os.listdir(tmp_path / "worker") == []


def test_a_dask_run_interrupted_here_returns_once_no_task_writes(s3, corpus, dask_cluster):
    """Ctrl-C in the client during a Dask run: the run's tasks still running on the workers finish
    before it returns, so the output's removal that follows is the last word on S3."""
    from materialize._dask import run_on_dask
    from materialize._materialize import open_source
    from materialize._validate import GeneIndex

    src = open_source(str(corpus.cells_parquet), batch_cells=16)
    genes = GeneIndex.from_tokens(src.genes.column("gene_token_id").to_numpy(), "genes")
    options = Layout(group_size=16, compression="zstd:-1").writer_options
    job = Job(src, ("drug",), genes, None, False, 128, options, s3.url("out/"), "interrupted")

    def progress(cells):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_on_dask(job, src.plan(128), progress, address=dask_cluster.scheduler_address)
    store = S3Store(s3.url("out/"))
    written = sorted(key for key, _ in store.list())
    time.sleep(1.5)  # what a task still running would write comes by now
    assert sorted(key for key, _ in store.list()) == written


def _break_partition(index: int, how: str):
    """A function for `Client.run` that makes the worker's task of partition ``index`` raise (``how``:
    "raise") or kill its worker process ("exit"), and another that undoes it (a closure: Dask's
    workers receive it by value)."""

    def brake():
        from materialize import _dask

        real = _dask.__dict__.setdefault("_unbroken", _dask.write_partition)

        def broken(job, part, scratch=None):
            if part.index == index:
                if how == "exit":
                    os._exit(1)
                raise RuntimeError("disk on fire")
            return real(job, part, scratch=scratch)

        _dask.write_partition = broken

    def mend():
        from materialize import _dask

        _dask.write_partition = _dask.__dict__.pop("_unbroken", _dask.write_partition)

    return brake, mend


def test_an_unexpected_error_in_a_dask_task_is_a_one_line_error(corpus, tmp_path, dask_cluster):
    from distributed import Client

    brake, mend = _break_partition(2, "raise")
    with Client(dask_cluster) as client:
        client.run(brake)
        try:
            with pytest.raises(
                oj.OmicsIOError,
                match=r"^writing partition 2 \(cells 1,024\.\.1,535\) failed on the Dask cluster \(tried 4 times\): "
                r"RuntimeError: disk on fire$",
            ):
                materialize(
                    corpus.cells_parquet,
                    tmp_path / "out",
                    progress=False,
                    layout=Layout(shard_cells=512),
                    workers=Dask(scheduler=dask_cluster.scheduler_address),
                )
        finally:
            client.run(mend)
    assert os.listdir(tmp_path) == []


def test_the_only_dask_worker_killed_once_costs_a_rerun_of_its_task(corpus, tmp_path):
    """Every worker holding the run's job dies (here the only one): the job is computed again for the
    restarted worker, not lost with it (which cancelled every task)."""
    from distributed import Client, LocalCluster

    kw = dict(progress=False, layout=Layout(shard_cells=512))
    materialize(corpus.cells_parquet, tmp_path / "ref", workers=1, **kw)
    brake, _ = _break_partition(2, "exit")  # the restarted worker is not broken
    with LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0", host="127.0.0.1"
    ) as cluster:
        with Client(cluster) as client:
            client.run(brake)
        materialize(corpus.cells_parquet, tmp_path / "out", workers=Dask(cluster.scheduler_address), **kw)
    digests = [
        {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        for root in (tmp_path / "ref", tmp_path / "out")
    ]
    manifests = [json.loads(d.pop("manifest.json"))["fingerprint"] for d in digests]
    assert digests[0] == digests[1] and manifests[0] == manifests[1]


def test_local_paths_made_absolute_for_dask_keep_what_they_are(monkeypatch, tmp_path):
    from materialize._materialize import _absolute

    monkeypatch.chdir(tmp_path)
    assert _absolute("data/*.parquet") == f"{tmp_path}/data/*.parquet"
    assert _absolute("ducklake:sqlite:lake.sqlite#rna") == f"ducklake:sqlite:{tmp_path}/lake.sqlite#rna"
    assert _absolute("ducklake:duckdb:/abs/lake.duckdb") == "ducklake:duckdb:/abs/lake.duckdb"
    assert _absolute("ducklake:lake.ducklake") == f"ducklake:{tmp_path}/lake.ducklake"
    assert [_absolute(s) for s in ("s3://b/x/", "union", "intersection", None)] == [
        "s3://b/x/",
        "union",
        "intersection",
        None,
    ]
