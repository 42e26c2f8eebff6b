"""Nothing half-written, ever; `verify` catches corruption; the console script works for real."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import omicsio_jax as oj
from materialize import InputOptions, Layout, _shards, materialize
from materialize._cli import main
from omicsio_jax.format import MANIFEST_NAME

OBS = ("--obs", "batch,drug")  # not the corpus's n_genes, whose note would come first on stderr


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _running(pid):
    """True while ``pid`` exists and is not a zombie (an exited child its new parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


def test_interrupted_run_leaves_nothing(corpus, tmp_path, monkeypatch):
    writers = []
    real_write = _shards.ShardWriterProcess.write

    def write_then_interrupt(self, buf, starts, **kw):
        real_write(self, buf, starts, **kw)
        writers.append(self)
        if len(writers) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(_shards.ShardWriterProcess, "write", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        materialize(
            corpus.cells_parquet, tmp_path / "out", progress=False, read=InputOptions(batch_cells=500)
        )
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path) == []
    assert writers[0]._proc.poll() is not None  # the writer process was stopped, not left behind


def test_an_interrupted_write_waits_for_its_statistics_before_closing_their_file(
    corpus, tmp_path, monkeypatch
):
    """A shard write that raises (Ctrl-C) while its batch's statistics are still being added on their
    thread: the partition's cells file is closed only once they are done (closed under a write in
    progress, pyarrow's writer crashed the process)."""
    from materialize import _partition

    real_write, real_add_stats = _shards.ShardWriterProcess.write, _partition._add_stats
    open_at_write = []

    def write_then_interrupt(self, buf, starts, **kw):
        real_write(self, buf, starts, **kw)
        raise KeyboardInterrupt

    def slow_add_stats(stats, cells, *args):
        time.sleep(0.5)  # still running when the write has raised and the cleanup begins
        open_at_write.append(cells.is_open)
        if cells.is_open:
            real_add_stats(stats, cells, *args)

    monkeypatch.setattr(_shards.ShardWriterProcess, "write", write_then_interrupt)
    monkeypatch.setattr(_partition, "_add_stats", slow_add_stats)
    with pytest.raises(KeyboardInterrupt):
        materialize(
            corpus.cells_parquet, tmp_path / "out", progress=False, read=InputOptions(batch_cells=500)
        )
    assert open_at_write == [True]
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path) == []


def test_in_process_writer_writes_the_same_bytes(corpus, tmp_path, monkeypatch):
    """Without memfd (not Linux) the shards are written in-process: byte-identical output."""
    child = materialize(
        corpus.cells_parquet,
        tmp_path / "child",
        progress=False,
        read=InputOptions(batch_cells=700),
        layout=Layout(shard_cells=1024),
    ).manifest
    monkeypatch.setattr(_shards.ShardWriterProcess, "available", staticmethod(lambda: False))
    inline = materialize(
        corpus.cells_parquet,
        tmp_path / "inline",
        progress=False,
        read=InputOptions(batch_cells=700),
        layout=Layout(shard_cells=1024),
    ).manifest
    assert len(child.shards) == 3
    assert child.shards == inline.shards and child.fingerprint == inline.fingerprint


def test_failed_overwrite_keeps_the_old_dataset(corpus, tmp_path, monkeypatch):
    out = tmp_path / "out"
    materialize(corpus.cells_parquet, out, progress=False)
    before = oj.open_dataset(out).fingerprint

    def boom(self, buf, starts, **kw):
        raise RuntimeError("disk full")

    monkeypatch.setattr(_shards.ShardWriterProcess, "write", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        materialize(corpus.cells_parquet, out, overwrite=True, progress=False)
    assert oj.open_dataset(out).fingerprint == before
    assert _leftovers(tmp_path) == []


def test_a_dataset_replaced_while_open_is_refused_not_read_as_the_new_one(corpus, corpus_table, tmp_path):
    """--overwrite renames a new folder into the dataset's place. A handle or loader opened before
    opens its files by path, so it would read the new dataset's files by the old manifest (the same
    number of cells: silently other values): it stops with `DatasetReplacedError` instead, after
    serving the old cells it had already read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "out"
    materialize(corpus.cells_parquet, out, progress=False, layout=Layout(shard_cells=512))
    old = oj.open_dataset(out)
    indptr, cols, values = old.read_csr(np.arange(old.num_cells))
    dense = np.zeros((old.num_cells, old.num_genes), np.float32)
    dense[np.repeat(np.arange(old.num_cells), np.diff(indptr)), cols] = values
    loader = oj.make_loader(old, batch_size=32, sampling=oj.Block(16, 2), seed=0, num_epochs=1)
    served = [next(loader)]
    other = corpus_table.take(pa.array(np.arange(corpus_table.num_rows)[::-1]))  # the same cells, reversed
    ids = other.column_names.index("cell_id")
    other = other.set_column(ids, "cell_id", pa.array([f"other{i}" for i in range(other.num_rows)]))
    pq.write_table(other, tmp_path / "other.parquet")
    shutil.copy(corpus.genes_parquet, tmp_path / "gene_metadata.parquet")
    materialize(
        tmp_path / "other.parquet", out, progress=False, overwrite=True, layout=Layout(shard_cells=512)
    )
    with pytest.raises(
        oj.DatasetReplacedError, match=r"out was replaced or removed since it was opened .*open it again"
    ):
        old.read_csr([0, 5])
    with pytest.raises(oj.DatasetReplacedError):
        for batch in loader:  # what it had read ahead, then the error
            served.append(batch)
    for batch in served:  # only ever the old dataset's cells
        keep = np.asarray(batch.mask)
        np.testing.assert_array_equal(np.asarray(batch.x)[keep], dense[np.asarray(batch.index)[keep]])
    loader.close()
    again = oj.open_dataset(out)  # opened again: the new dataset
    assert again.cell_ids[0] == "other0"


def test_a_second_run_into_an_output_being_written_is_refused(corpus, tmp_path, capsys):
    """Two runs into one output at once both wrote, and the one that renamed last won, each saying
    it had materialized its dataset there: the second is refused while the first holds the output's
    lock, and the lock file goes with the run that held it."""
    out = tmp_path / "out"
    args = [str(corpus.cells_parquet), str(out), "--no-progress"]
    with _shards._output_lock(out):  # a run writing out, as far as another can tell
        for extra in ([], ["--overwrite"]):
            assert main([*args, *extra]) == 2
            err = capsys.readouterr().err
            assert f"another materialize run is writing '{out}' (it holds .out.lock); wait" in err, err
    assert not out.exists() and _leftovers(tmp_path) == []
    assert main(args) == 0 and oj.verify_dataset(out) == []
    assert not (tmp_path / ".out.lock").exists()


def test_existing_output_is_refused_without_overwrite(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    materialize(corpus.cells_parquet, out, progress=False, read=InputOptions(where="batch = 'plate_00'"))
    before = oj.open_dataset(out).fingerprint
    assert main([str(corpus.cells_parquet), str(out), "--no-progress"]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert oj.open_dataset(out).fingerprint == before


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_folder_that_is_no_dataset_is_refused_at_once_without_suggesting_overwrite(
    corpus, tmp_path, capsys, overwrite
):
    """Not replaceable even with --overwrite: the first message says so, not "pass --overwrite"."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert main([str(corpus.cells_parquet), str(out), "--no-progress", *overwrite]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"omicsio-materialize: error: refusing to write into {str(out)!r}: it is not empty and has no "
        "manifest.json (it is not a dataset); give another output path, or an empty directory"
    )
    assert (out / "precious.txt").read_text() == "keep me"
    assert _leftovers(tmp_path) == []


def test_an_existing_empty_directory_is_an_output_without_overwrite(corpus, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = materialize(corpus.cells_parquet, out, progress=False)
    assert oj.open_dataset(out).fingerprint == result.manifest.fingerprint
    assert _leftovers(tmp_path) == []


def test_an_empty_directory_written_into_during_the_run_is_kept_and_the_run_fails(
    corpus, tmp_path, monkeypatch
):
    """The finished dataset replaces an empty directory by one rename, which refuses a directory
    that is no longer empty: what appeared there is kept, no half-written dataset is left."""
    out = tmp_path / "out"
    out.mkdir()
    real_write = _shards.ShardWriterProcess.write

    def write_and_meddle(self, buf, starts, **kw):
        real_write(self, buf, starts, **kw)
        (out / "notes.txt").write_text("mine")

    monkeypatch.setattr(_shards.ShardWriterProcess, "write", write_and_meddle)
    with pytest.raises(
        oj.OmicsIOError, match=r"refusing to write into .*: it is not empty and has no manifest"
    ):
        materialize(corpus.cells_parquet, out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert _leftovers(tmp_path) == []


def test_a_stale_partial_directory_of_a_dead_run_is_removed_and_said(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid now names no running process (reused only after the pid space wraps)
    stale = tmp_path / f".out.partial-{dead.pid}-0123abcd"
    live = tmp_path / f".out.partial-{os.getpid()}-89abcdef"  # a run in progress: this process
    other = tmp_path / f".out2.partial-{dead.pid}-0123abcd"  # another output's
    odd = tmp_path / f".out.partial-{dead.pid}-notours"  # not the name a run makes
    for folder in (stale, live, other, odd):
        folder.mkdir()
        (folder / "shard-00000.arrayrecord").write_bytes(b"half")
    materialize(corpus.cells_parquet, out, progress=False)
    assert not stale.exists() and live.exists() and other.exists() and odd.exists()
    err = capsys.readouterr().err
    assert (
        f"materialize: removed {str(stale)!r}, left by an earlier run into {str(out)!r} "
        f"(process {dead.pid}, no longer running)"
    ) in err
    assert err.count("materialize: removed") == 1
    assert oj.open_dataset(out).num_cells == 3000


def test_overwrite_replaces_a_dataset(corpus, tmp_path):
    out = tmp_path / "out"
    materialize(corpus.cells_parquet, out, progress=False, read=InputOptions(where="batch = 'plate_00'"))
    small = oj.open_dataset(out).num_cells
    materialize(corpus.cells_parquet, out, overwrite=True, progress=False)
    assert oj.open_dataset(out).num_cells > small
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("swap", ["exchange", "renames"])
def test_ctrl_c_while_the_replaced_dataset_is_removed_says_the_new_one_is_written(
    corpus, tmp_path, monkeypatch, capsys, swap
):
    """The new dataset is in place before the old one is removed: a Ctrl-C then is no failure of the
    run, and says so (not "nothing was written"); the next run into the output removes the rest.
    (``renames``: a file system with no swap in one step, the old dataset renamed aside first.)"""
    out = tmp_path / "out"
    where = ["--where", "batch = 'plate_00'"]
    assert main([str(corpus.cells_parquet), str(out), "--no-progress", *where, *OBS]) == 0
    small = oj.open_dataset(out).num_cells
    remove = shutil.rmtree

    def interrupted(path, *args, **kwargs):  # a hidden sibling of the output: the old dataset, swapped out
        if Path(path).parent == tmp_path and Path(path).name.startswith((".out.old-", ".out.partial-")):
            raise KeyboardInterrupt
        remove(path, *args, **kwargs)

    monkeypatch.setattr(_shards.shutil, "rmtree", interrupted)
    if swap == "renames":
        monkeypatch.setattr(_shards, "exchange_paths", lambda a, b: False)
    assert (
        main([str(corpus.cells_parquet), str(out), "--no-progress", "--overwrite", *OBS])
        == 128 + signal.SIGINT
    )
    monkeypatch.undo()
    (left,) = _leftovers(tmp_path)
    assert left.startswith(f".out.{'partial' if swap == 'exchange' else 'old'}-{os.getpid()}-")
    assert oj.open_dataset(tmp_path / left).num_cells == small  # what is left is the old dataset
    assert capsys.readouterr().err == (
        f"omicsio-materialize: interrupted; {out} is written; what is left of the dataset it replaced, in "
        f"{tmp_path / left}, is removed by the next run into {out}\n"
    )
    assert oj.open_dataset(out).num_cells > small  # the new dataset, complete
    # ... removed by the next run into it, once this process (which left it) is no longer running
    monkeypatch.setattr(_shards, "process_running", lambda pid: False)
    materialize(corpus.cells_parquet, out, overwrite=True, progress=False)
    assert _leftovers(tmp_path) == []
    assert (
        f"materialize: removed {str(tmp_path / left)!r}, left by an earlier run into {str(out)!r}"
        in capsys.readouterr().err
    )


def test_a_swap_stopped_between_its_two_renames_puts_the_old_dataset_back(
    corpus, tmp_path, monkeypatch, capsys
):
    """Ctrl-C after the old dataset was moved aside but before the new one took its place (a file
    system with no swap in one step): the old one goes back, and the run wrote nothing. Remains of a
    replaced dataset are removed by a later run only where the output holds the dataset that
    replaced them (else they are its only copy)."""
    out = tmp_path / "out"
    where = InputOptions(where="batch = 'plate_00'")
    materialize(corpus.cells_parquet, out, progress=False, obs=OBS[1].split(","), read=where)
    small = oj.open_dataset(out).num_cells
    rename = type(out).rename
    monkeypatch.setattr(_shards, "exchange_paths", lambda a, b: False)

    def stopped(self, target):
        if ".partial-" in self.name and type(out)(target) == out:
            raise KeyboardInterrupt
        return rename(self, target)

    monkeypatch.setattr(type(out), "rename", stopped)
    assert (
        main([str(corpus.cells_parquet), str(out), "--no-progress", "--overwrite", *OBS])
        == 128 + signal.SIGINT
    )
    monkeypatch.undo()
    assert capsys.readouterr().err == "omicsio-materialize: interrupted; nothing was written\n"
    assert oj.open_dataset(out).num_cells == small and _leftovers(tmp_path) == []
    # an old copy whose swap was cut short by a kill, with no dataset in the output, is kept
    aside = tmp_path / f".out.old-{os.getpid()}-0123abcd"
    out.rename(aside)
    monkeypatch.setattr(_shards, "process_running", lambda pid: False)
    materialize(corpus.cells_parquet, out, progress=False)
    assert aside.is_dir() and oj.open_dataset(aside).num_cells == small


def test_a_dataset_overwritten_is_never_missing_from_its_path(corpus, tmp_path, monkeypatch):
    """A reader opening the output while a run overwrites it finds the old dataset or the new one:
    the two swap places in one step (``renameat2``'s exchange, where the file system has it). Moved
    aside first, the old one left the path empty until the new one was renamed in (a reader then
    failed "not a directory", and a kill then left no dataset there)."""
    out = tmp_path / "out"
    where = InputOptions(where="batch = 'plate_00'")
    materialize(corpus.cells_parquet, out, progress=False, read=where)
    small = oj.open_dataset(out).num_cells
    seen = []  # after each step of the swap: whether the output held a dataset

    def watched(step):
        def run(*args, **kwargs):
            done = step(*args, **kwargs)
            seen.append((out / MANIFEST_NAME).is_file())
            return done

        return run

    monkeypatch.setattr(_shards, "exchange_paths", watched(_shards.exchange_paths))
    monkeypatch.setattr(type(out), "rename", watched(type(out).rename))
    materialize(corpus.cells_parquet, out, progress=False, overwrite=True)
    monkeypatch.undo()
    assert seen and all(seen)
    assert oj.open_dataset(out).num_cells > small and _leftovers(tmp_path) == []


def test_exchange_paths_swaps_two_folders_or_says_it_cannot(tmp_path, monkeypatch):
    from omicsio_jax.format import exchange_paths
    from omicsio_jax.storage import swap

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("from a")
    assert exchange_paths(a, b)
    assert (b / "x").read_text() == "from a" and list(a.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        exchange_paths(a, tmp_path / "missing")
    monkeypatch.setattr(swap, "_renameat2", lambda: None)  # no renameat2 in this system's C library
    assert not exchange_paths(a, b) and (b / "x").is_file()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_killed_process_leaves_no_complete_looking_dataset(corpus, tmp_path, sig):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "materialize",
        str(corpus.h5ad),
        str(out),
        "--batch-cells",
        "64",
        "--no-progress",
        "--shard-cells",
        "256",
    ]
    # Ctrl-C's default action in the child, whatever this process inherited: a test run started in the
    # background of a non-interactive shell ignores SIGINT, and so would the child (it then ran to the end)
    with (
        warnings.catch_warnings()
    ):  # preexec_fn forks; JAX, once started, warns of any fork (the child execs)
        warnings.simplefilter("ignore", RuntimeWarning)
        proc = subprocess.Popen(
            cmd,
            stderr=subprocess.PIPE,
            stdout=subprocess.PIPE,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler),
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # a SIGABRT prints every thread's stack
        )
    deadline = time.time() + 60
    while time.time() < deadline and not any(
        p.name.startswith(".out.partial") and any((p).glob("shard-*")) for p in tmp_path.iterdir()
    ):
        time.sleep(0.01)
    children = _children(proc.pid)  # the shard writer process
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # where it waits, for the failure to show
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        pytest.fail(
            f"materialize still ran 60 s after signal {sig!r}; its threads then:\n{err.decode()[-8000:]}"
        )
    assert proc.returncode != 0
    assert not out.exists()
    assert children, "materialize should run its shard writer in a child process"
    deadline = time.time() + 30  # the writer sees its parent's socket close and exits, even after SIGKILL
    while time.time() < deadline and any(map(_running, children)):
        time.sleep(0.05)
    assert not any(map(_running, children)), "the shard writer outlived its parent"
    with pytest.raises(oj.DatasetFormatError, match="no manifest.json"):
        for partial in tmp_path.iterdir():
            if partial.name == ".out.lock":  # (empty; a SIGKILL leaves it, unlocked, to the next run)
                continue
            if ".partial-" in partial.name:  # said to be a stopped run's output, not to need --overwrite
                with pytest.raises(
                    oj.DatasetFormatError,
                    match=r"it is the unfinished output of a materialize run that was stopped; open the output",
                ):
                    oj.open_dataset(partial)
            oj.open_dataset(partial)
        raise oj.DatasetFormatError(f"{tmp_path}: no manifest.json in any leftover")
    if sig != signal.SIGKILL:  # a catchable signal cleans up completely
        assert _leftovers(tmp_path) == [], err.decode()
        assert b"interrupted; nothing was written" in err
        assert proc.returncode == 128 + sig  # 130 for SIGINT, 143 for SIGTERM: the shell's convention


@pytest.mark.parametrize(
    ("stop", "status"),
    [
        (lambda: os.kill(os.getpid(), signal.SIGTERM), 128 + signal.SIGTERM),
        (lambda: signal.raise_signal(signal.SIGINT), 128 + signal.SIGINT),
    ],
    ids=["SIGTERM", "SIGINT"],
)
def test_the_exit_status_follows_the_signal_received(corpus, tmp_path, monkeypatch, capsys, stop, status):
    from materialize import _materialize

    def stopped(*args, **kwargs):
        stop()
        time.sleep(30)  # the signal's handler raises here
        pytest.fail("the signal did not stop the run")

    monkeypatch.setattr(_materialize, "materialize", stopped)  # the command imports it as it runs
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main([str(corpus.cells_parquet), str(tmp_path / "out"), "--no-progress"]) == status
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "interrupted; nothing was written" in capsys.readouterr().err


def test_verify_catches_a_flipped_byte(dataset_dir, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(dataset_dir, copy)
    assert main(["verify", str(copy)]) == 0
    assert "OK (3,000 cells, 3 shard(s)" in capsys.readouterr().out
    shard = copy / "shard-00001.arrayrecord"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    assert main(["verify", str(copy)]) == 1
    err = capsys.readouterr().err
    assert "shard-00001.arrayrecord: sha256" in err and "manifest says" in err
    assert err.strip().endswith("is damaged: materialize it again from its input (--overwrite)")


def test_verify_and_stats_name_the_fix_for_missing_statistics(dataset_dir, tmp_path, capsys):
    """Statistics files gone: verify says `stats --force` writes them again, and `stats` says they are
    missing (it said the dataset already had them) until --force writes them."""
    copy = tmp_path / "copy"
    shutil.copytree(dataset_dir, copy)
    (copy / "gene_stats.parquet").unlink()
    assert main(["verify", str(copy)]) == 1
    assert capsys.readouterr().err.strip().endswith(f"stats {copy} --force writes the statistics again")
    assert main(["stats", str(copy), "--no-progress"]) == 2
    assert "lists gene_stats.parquet, which is missing: pass --force" in capsys.readouterr().err
    assert main(["stats", str(copy), "--force", "--no-progress"]) == 0
    assert main(["verify", str(copy)]) == 0


def test_verify_catches_sidecar_damage_and_missing_files(dataset_dir, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(dataset_dir, copy)
    codes = copy / "obs" / "drug.codes.npy"
    codes.write_bytes(codes.read_bytes()[:-4])
    (copy / "cell_ids.parquet").unlink()
    assert main(["verify", str(copy)]) == 1
    err = capsys.readouterr().err
    assert "obs/drug.codes.npy:" in err and "bytes, manifest says" in err
    assert "cell_ids.parquet: missing" in err


def test_open_dataset_refuses_non_datasets(tmp_path):
    with pytest.raises(oj.DatasetFormatError, match="is not a directory"):
        oj.open_dataset(tmp_path / "nope")
    with pytest.raises(oj.DatasetFormatError, match="has no manifest.json"):
        oj.open_dataset(tmp_path)


def test_opening_a_folder_of_inputs_says_to_materialize_it_first(corpus, tmp_path):
    tables = tmp_path / "corpus"
    (tables / "plate=1").mkdir(parents=True)
    shutil.copy(corpus.cells_parquet, tables / "plate=1" / "cells.parquet")
    with pytest.raises(oj.DatasetFormatError) as e:
        oj.open_dataset(tables)
    assert str(e.value) == (
        f"{str(tables)!r} has no manifest.json: it holds input files (.parquet), not a materialized "
        f"dataset; materialize it first: `omicsio-materialize {tables}/ OUT/`, then open OUT/"
    )
    anndata = tmp_path / "atlas"
    anndata.mkdir()
    shutil.copy(corpus.h5ad, anndata / "a.h5ad")
    with pytest.raises(oj.DatasetFormatError, match=rf"`omicsio-materialize {anndata}/\*\.h5ad OUT/`"):
        oj.open_dataset(anndata)
    dataset = tmp_path / "dataset"  # a dataset that lost its manifest holds parquet files too
    materialize(corpus.cells_parquet, dataset, progress=False)
    (dataset / "manifest.json").unlink()
    with pytest.raises(oj.DatasetFormatError, match="its materialization did not finish"):
        oj.open_dataset(dataset)


def test_console_script_end_to_end(corpus, tmp_path):
    script = shutil.which("omicsio-materialize", path=os.path.dirname(sys.executable))
    assert script is not None, "the console script is not installed (pip install -e .)"
    out = tmp_path / "out"
    run = subprocess.run(
        [script, str(corpus.cells_parquet), str(out), "--obs", "cell_type,drug,batch"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "materialized 3,000 cells × 2,000 genes (sparse)" in run.stdout
    assert "cells/s" in run.stdout
    assert "materialize" in run.stderr  # the progress bar
    ds = oj.open_dataset(out)
    assert set(ds.obs) == {"cell_type", "drug", "batch", "n_counts", "n_genes"}  # + the computed cell stats
    verify = subprocess.run([script, "verify", str(out)], capture_output=True, text=True)
    assert verify.returncode == 0 and "OK" in verify.stdout
    bad = subprocess.run(
        [script, str(tmp_path / "missing.parquet"), str(tmp_path / "o2")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_read_csr_order_duplicates_and_errors(dataset_dir, corpus_table):
    ds = oj.open_dataset(dataset_dir)
    rows = [2999, 5, 5, 1023, 1024, 0]
    indptr, indices, values = ds.read_csr(rows)
    genes = corpus_table.column("gene_token_id").to_pylist()
    expr = corpus_table.column("gene_expression").to_pylist()
    for i, row in enumerate(rows):
        np.testing.assert_array_equal(indices[indptr[i] : indptr[i + 1]], genes[row])
        np.testing.assert_array_equal(values[indptr[i] : indptr[i + 1]], np.float32(expr[row]))
    assert ds.read_csr([])[0].tolist() == [0]
    with pytest.raises(IndexError, match="row 3000 is out of range for a dataset of 3,000 cells"):
        ds.read_csr([1, 3000])
    with pytest.raises(IndexError, match="row -1"):
        ds.read_csr([-1])
    with pytest.raises(TypeError, match="rows must be integers"):
        ds.read_csr([0.5])
    assert "num_cells=3,000" in repr(ds)


def test_scratch_folders_of_runs_killed_outright_are_removed_by_the_next(tmp_path, monkeypatch):
    """An ``s3://`` run's finalize folder (and the kernels' warm-up folder) live in the temporary
    directory; a run killed outright leaves its own, and the next run removes those whose process
    no longer runs, never a running one's."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from materialize._shards import scratch_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = tmp_path / f"omicsio-finalize-{int(gone.stdout)}-abc123"
    (dead / "_parts").mkdir(parents=True)
    (dead / "_parts" / "gene_stats.bin").write_bytes(b"x" * 1000)
    live = tmp_path / f"omicsio-finalize-{os.getppid()}-def456"
    live.mkdir()
    other = tmp_path / f"omicsio-kernels-{int(gone.stdout)}-0"
    other.mkdir()
    with scratch_folder("finalize") as folder:
        assert Path(folder).name.startswith(f"omicsio-finalize-{os.getpid()}-")
        assert not dead.exists() and live.exists() and other.exists()  # its own kind only
    assert not Path(folder).exists()
