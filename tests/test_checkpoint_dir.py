"""The checkpoint directory of a training run, shared with other runs over time: one run writes it at
a time, readers never block it, and what a killed run left is recovered or cleaned by the next."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train
from train._checkpoint import EquinoxCheckpoints
from train._cli import main, parse_config

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--label", "drug", "--model", "linear", "--batch-size", "64", "--block-size", "16", "--quiet"]


def _fit(dataset_dir, ckpt: Path, *extra: str) -> int:
    return main([str(dataset_dir), *ARGS, "--checkpoint-dir", str(ckpt), *extra])


def test_a_second_run_writing_the_directory_is_refused_naming_the_first(dataset_dir, tmp_path, capsys):
    """A job requeued while the old one still runs, both writing one ``--checkpoint-dir``: the second
    deleted the first's save in progress (taken for a killed run's partial), then both wrote steps.
    It is refused at its start, in one line naming the first run's pid and host; a reader of the
    directory (``embed``, ``finetune --init``) is not, and neither is a run after the first ended."""
    ckpt = tmp_path / "ckpt"
    assert _fit(dataset_dir, ckpt, "--steps", "2") == 0
    first = EquinoxCheckpoints(ckpt, keep=3)  # the first run, still training
    saving = ckpt / f".step-000003.tmp-{os.getpid()}"  # its save of step 3, in progress
    saving.mkdir()
    capsys.readouterr()
    assert _fit(dataset_dir, ckpt, "--steps", "2", "--resume") == 2
    assert capsys.readouterr().err.splitlines() == [
        f"omicsio-train: error: {ckpt} is the checkpoint directory of a run still writing there (pid "
        f"{os.getpid()} on host {socket.gethostname()}): stop that run first, or pass another --checkpoint-dir"
    ]
    assert saving.is_dir() and train.latest_checkpoint(ckpt).step == 2
    EquinoxCheckpoints(ckpt, writing=False).close()  # a reader takes no lock
    first.close()
    assert _fit(dataset_dir, ckpt, "--steps", "2", "--resume") == 0  # a finished run: trains nothing
    assert train.latest_checkpoint(ckpt).step == 2 and not saving.exists()


def test_an_orbax_directory_is_locked_by_its_writer_too(tmp_path):
    """``--checkpoint-format orbax``: the writer holds the same lock (taken before Orbax's manager,
    whose save of a step deletes that step's unfinished temporary folder); a reader takes none."""
    from train._orbax import OrbaxCheckpoints

    ckpt = tmp_path / "ckpt"
    first = OrbaxCheckpoints(ckpt)
    with pytest.raises(
        train.TrainError, match=re.escape(f"(pid {os.getpid()} on host {socket.gethostname()})")
    ):
        OrbaxCheckpoints(ckpt)
    OrbaxCheckpoints(ckpt, writing=False).close()
    first.close()
    OrbaxCheckpoints(ckpt).close()


def test_a_killed_runs_lock_never_blocks_the_next_run(tmp_path):
    """The lock is the kernel's ``flock``: a SIGKILLed run's is released with its process, so the
    requeued run that resumes its directory starts at once."""
    ckpt = tmp_path / "ckpt"
    script = (
        "import time\nfrom train._checkpoint import EquinoxCheckpoints\n"
        f"EquinoxCheckpoints({str(ckpt)!r})\nprint('writing', flush=True)\ntime.sleep(600)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert run.stdout.readline() == "writing\n"
        with pytest.raises(
            train.TrainError, match=re.escape(f"(pid {run.pid} on host {socket.gethostname()})")
        ):
            EquinoxCheckpoints(ckpt)
    finally:
        run.kill()
        run.wait()
        run.stdout.close()
    EquinoxCheckpoints(ckpt).close()


def test_a_run_killed_while_saving_a_step_again_leaves_that_step_to_the_next_run(
    dataset_dir, tmp_path, monkeypatch
):
    """A step saved a second time moves its first copy aside (``.step-N.old-<pid>``), then the new
    one into place. A run killed between the two left the first copy hidden, and the next run
    deleted it with the partials: with ``--keep 1`` the only checkpoint, so ``--resume`` started
    over at step 0. The next run puts that copy back as the step, then deletes the partials."""
    ckpt = tmp_path / "ckpt"
    args = [str(dataset_dir), *ARGS, "--steps", "2", "--keep", "1", "--checkpoint-dir", str(ckpt)]
    assert main(args) == 0
    first = (ckpt / "step-000002" / "state.eqx").read_bytes()
    replace = os.replace

    def killed_between_the_renames(src, dst):
        replace(src, dst)
        if ".old-" in Path(dst).name:
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed_between_the_renames)
    with pytest.raises(KeyboardInterrupt):
        train.save_checkpoint(ckpt, 2, {"w": np.zeros(3)}, {}, keep=1)
    monkeypatch.undo()
    assert train.latest_checkpoint(ckpt) is None
    assert sorted(p.name for p in ckpt.glob(".step-*")) == [
        f".step-000002.old-{os.getpid()}",
        f".step-000002.tmp-{os.getpid()}",
    ]

    resumed = train.fit(parse_config([*args, "--resume"]))
    assert (resumed.start_step, resumed.checkpoint) == (2, ckpt / "step-000002")
    assert (ckpt / "step-000002" / "state.eqx").read_bytes() == first
    assert list(ckpt.glob(".step-*")) == []


def test_a_writer_stopped_while_it_opens_the_directory_lets_go_of_its_lock(tmp_path, monkeypatch):
    """Ctrl-C while the writer deletes a killed run's partial saves (large ones take a while) stopped
    it holding the lock on a descriptor no one could close: the next run in the same process (a
    notebook) was refused as "a run still writing there" with its own pid."""
    import train._checkpoint

    ckpt = tmp_path / "ckpt"

    def interrupted(directory):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(train._checkpoint, "remove_partials", interrupted)
        with pytest.raises(KeyboardInterrupt):
            EquinoxCheckpoints(ckpt)
    EquinoxCheckpoints(ckpt).close()
