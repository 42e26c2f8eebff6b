"""Progress bars: tqdm's in a terminal or a notebook; in a log file, a line now and then."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

import pytest
import tqdm.std
from conftest import ROOT

import omicsio_jax as oj
from materialize._cli import main as materialize_main
from omicsio_jax.core.progress import INTERVAL_ENV, LOG_INTERVAL, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class OutStream(io.StringIO):
    """A Jupyter kernel's stderr: no terminal, but the notebook redraws a bar in place."""

    __module__ = "ipykernel.iostream"


@pytest.fixture
def clock(monkeypatch):
    """tqdm's clock, moved on by hand: ``clock[0] += seconds``."""
    now = [0.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: now[0])
    return now


def run_for(seconds: int, clock, **options) -> None:
    """A bar updated once a second for ``seconds`` seconds of ``clock``."""
    with progress_bar(total=seconds, unit="cells", desc="materialize", **options) as bar:
        for _ in range(seconds):
            clock[0] += 1.0
            bar.update(1)


def test_a_bar_in_a_log_file_is_a_line_every_interval(tmp_path, clock):
    log = tmp_path / "slurm-1.out"
    with open(log, "w") as file:  # two hours of work: tqdm's defaults wrote 7,200 redraws on one line
        run_for(7200, clock, file=file)
    text = log.read_bytes().decode()  # as written, \r kept
    lines = text.splitlines()
    assert "\r" not in text and text.endswith("\n")
    assert 7200 / LOG_INTERVAL <= len(lines) <= 7200 / LOG_INTERVAL + 4  # start, each 30 s, end
    assert lines[0].startswith("materialize:   0%|") and " 0/7200 " in lines[0]
    assert lines[-1].startswith("materialize: 100%|") and "7200/7200 [2:00:00<" in lines[-1]


def test_the_interval_is_set_by_the_environment(tmp_path, clock, monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "600")
    log = io.StringIO()
    run_for(7200, clock, file=log)
    assert 12 <= len(log.getvalue().splitlines()) <= 16
    monkeypatch.setenv(INTERVAL_ENV, "0")  # a line at every update
    log = io.StringIO()
    run_for(100, clock, file=log)
    assert len(log.getvalue().splitlines()) == 102  # the start, 100 updates, the end
    monkeypatch.setenv(INTERVAL_ENV, "soon")
    with pytest.raises(oj.OmicsIOError, match=f"{INTERVAL_ENV}='soon' is not a number of seconds >= 0"):
        progress_bar(total=1, file=io.StringIO())


@pytest.mark.parametrize("stream", [Terminal, OutStream], ids=["terminal", "notebook"])
def test_a_terminal_and_a_notebook_keep_tqdms_redraws(stream, clock):
    out = stream()
    run_for(100, clock, file=out)
    assert out.getvalue().count("\r") > 100  # redrawn in place at each update (tqdm's 0.1 s apart)
    assert "\n" not in out.getvalue()[:-1]
    bar = progress_bar(total=1, file=out)
    default = tqdm.std.tqdm(total=1, file=out)
    assert (bar.mininterval, bar.maxinterval, bar.fp) == (
        default.mininterval,
        default.maxinterval,
        default.fp,
    )
    bar.close(), default.close()


def test_no_progress_writes_no_bar(clock):
    for stream in (io.StringIO(), Terminal()):
        run_for(100, clock, file=stream, progress=False)
        assert stream.getvalue() == ""


def test_a_command_writing_to_a_log_gives_lines_with_its_notes_and_summary(corpus, tmp_path, capsys):
    """capsys's stderr is no terminal, as a batch job's log file."""
    out = tmp_path / "out"
    assert materialize_main([str(corpus.cells_parquet), str(out)]) == 0
    said = capsys.readouterr()
    assert "\r" not in said.err
    note, *bar = said.err.splitlines()
    assert note.startswith("materialize: obs n_genes of") and note.endswith("as input_n_genes)")
    assert 2 <= len(bar) <= 3 and bar[0].startswith("materialize:   0%|") and "3.00k/3.00k" in bar[-1]
    assert said.out.startswith("materialized 3,000 cells")
    assert materialize_main([str(corpus.cells_parquet), str(out), "--overwrite", "--no-progress"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == f"{note}\n" and quiet.out.startswith("materialized 3,000 cells")


def test_a_batch_job_log_file_gets_the_bar_as_lines(dataset_dir, tmp_path):
    """``omicsio-materialize stats`` with stdout and stderr redirected to a file, as under sbatch."""
    copy = tmp_path / "ds"
    shutil.copytree(dataset_dir, copy)
    log = tmp_path / "slurm-2.out"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
    }
    with open(log, "w") as file:
        done = subprocess.run(
            [sys.executable, "-m", "materialize", "stats", str(copy), "--force"],
            stdout=file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
    text = log.read_bytes().decode()
    assert done.returncode == 0, text
    assert "\r" not in text
    *bar, summary = text.splitlines()
    assert bar[0].startswith("stats:   0%|") and bar[-1].startswith("stats: 100%|")
    assert (
        summary
        == f"{copy}: statistics of 3,000 cells × 2,000 genes added (gene_stats.parquet, obs n_counts, n_genes)"
    )
