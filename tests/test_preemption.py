"""SIGTERM, as a spot instance or a scheduler sends it, to a real ``omicsio-train`` process: it
finishes its step, checkpoints, exits 0, and ``--resume`` ends bit-identical to an unstopped run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

import train
from train._cli import parse_config, parse_pretrain_config
from train._pretrain import pretrain

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def _leaves(model) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


def _terminate_after(command: list[str], step: int) -> tuple[int, int, str]:
    """Run ``command``; SIGTERM it once it has printed step ``step``; return (exit status, the step it
    said it stopped after, its stdout)."""
    proc = subprocess.Popen(
        command, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            m = re.match(r"step\s+(\d+)/", line)
            if m and int(m.group(1)) >= step:
                proc.send_signal(signal.SIGTERM)
                break
        out.append(proc.stdout.read())
        status = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        stderr = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    text = "".join(out)
    stopped = re.search(r"SIGTERM: stopped after step (\d+)/", text)
    assert stopped, f"no preemption message; stdout:\n{text}\nstderr:\n{stderr}"
    return status, int(stopped.group(1)), text


def test_sigterm_checkpoints_the_current_step_exits_0_and_resume_is_bit_exact(dataset_dir, tmp_path):
    args = [
        str(dataset_dir),
        "--label",
        "drug",
        "--model",
        "mlp",
        "--hidden",
        "32",
        "--batch-size",
        "64",
        "--block-size",
        "16",
        "--fetch-factor",
        "4",
        "--dropout",
        "0.2",
        "--seed",
        "3",
        "--steps",
        "400",
        "--checkpoint-every",
        "1000",
        "--log-every",
        "1",
    ]
    reference = train.fit(parse_config([*args, "--quiet", "--checkpoint-dir", str(tmp_path / "ref")]))
    ckpt = tmp_path / "preempted"
    script = Path(sys.executable).with_name("omicsio-train")
    status, stopped, out = _terminate_after([str(script), *args, "--checkpoint-dir", str(ckpt)], step=5)
    assert status == 0, out
    assert 5 <= stopped < 400, "the run ended before the signal: make it longer"
    # the step it stopped after is checkpointed, though no checkpoint was due until step 1000
    assert train.latest_checkpoint(ckpt).step == stopped
    assert f"checkpoint {ckpt / f'step-{stopped:06d}'}, continue with --resume" in out
    assert [r["step"] for r in train.read_metrics(ckpt / "metrics.jsonl")][-1] == stopped

    run = subprocess.run(
        [str(script), *args, "--quiet", "--checkpoint-dir", str(ckpt), "--resume"],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    final = "step-000400/state.eqx"
    assert (ckpt / final).read_bytes() == (tmp_path / "ref" / final).read_bytes()
    history = [(r["step"], r["loss"]) for r in train.read_metrics(ckpt / "metrics.jsonl")]
    assert history == [(r["step"], r["loss"]) for r in reference.history]


def test_sigterm_without_a_checkpoint_dir_says_nothing_was_saved(dataset_dir):
    args = [
        str(dataset_dir),
        "--label",
        "drug",
        "--model",
        "mlp",
        "--hidden",
        "32",
        "--batch-size",
        "64",
        "--steps",
        "400",
        "--log-every",
        "1",
    ]
    status, stopped, out = _terminate_after([sys.executable, "-m", "train", *args], step=3)
    assert status == 128 + signal.SIGTERM and stopped < 400
    assert "no --checkpoint-dir, nothing saved" in out


def test_pretraining_stops_on_sigterm_with_an_orbax_checkpoint_and_resumes_bit_exactly(dataset_dir, tmp_path):
    """Orbax saves asynchronously: the process must wait for the save before it exits 0."""
    pytest.importorskip(
        "orbax.checkpoint", reason="the orbax extra is not installed (scripts/test.sh installs it)"
    )
    fmt = "orbax"
    args = [
        str(dataset_dir),
        "--tokens",
        "geneformer",
        "--preset",
        "tiny",
        "--max-len",
        "24",
        "--batch-size",
        "16",
        "--block-size",
        "4",
        "--fetch-factor",
        "4",
        "--steps",
        "16",
        "--seed",
        "2",
        "--checkpoint-format",
        fmt,
        "--log-every",
        "1",
    ]
    reference = pretrain(parse_pretrain_config([*args, "--quiet", "--checkpoint-dir", str(tmp_path / "ref")]))
    ckpt = tmp_path / "preempted"
    status, stopped, out = _terminate_after(
        [sys.executable, "-m", "train", "pretrain", *args, "--checkpoint-dir", str(ckpt)], step=3
    )
    assert status == 0 and 3 <= stopped < 16, out
    resumed = pretrain(parse_pretrain_config([*args, "--quiet", "--checkpoint-dir", str(ckpt), "--resume"]))
    assert resumed.start_step == stopped
    for a, b in zip(_leaves(reference.model), _leaves(resumed.model), strict=True):
        np.testing.assert_array_equal(a, b)
    losses = [json.loads(line)["loss"] for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert losses == [r["loss"] for r in reference.history]


def _terminated_in_start_up(monkeypatch, module) -> None:
    """SIGTERM this process while ``module``'s run opens its checkpoint (in its start-up, before any step)."""
    restorable = module.restorable

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return restorable(*args, **kwargs)

    monkeypatch.setattr(module, "restorable", terminated)


def test_sigterm_in_the_start_up_of_a_finished_run_says_what_it_skipped(
    dataset_dir, tmp_path, capsys, monkeypatch
):
    """A resumed run already at its last step has only its evaluation (probe) left: a SIGTERM in its
    start-up stops it before that, says so as any stop on SIGTERM does, and exits 0 with the
    checkpoint to resume; it exited 0 without a word."""
    import train._loop
    import train._pretrain
    from train._cli import main

    ckpt = tmp_path / "ckpt"
    argv = [
        str(dataset_dir),
        "--label",
        "drug",
        "--hidden",
        "16",
        "--batch-size",
        "64",
        "--fetch-factor",
        "4",
    ]
    argv += ["--steps", "2", "--eval-where", "batch = 'plate_00'", "--checkpoint-dir", str(ckpt)]
    assert main(argv) == 0
    capsys.readouterr()
    with monkeypatch.context() as m:
        _terminated_in_start_up(m, train._loop)
        assert main([*argv, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "eval (" not in out
    assert out.splitlines()[-1] == (
        f"SIGTERM: stopped after step 2/2, before the evaluation; checkpoint {ckpt / 'step-000002'}, "
        "continue with --resume"
    )
    assert main([*argv, "--resume"]) == 0  # as the scheduler requeues it: it evaluates
    assert "eval (batch = 'plate_00'): accuracy" in capsys.readouterr().out

    pt = tmp_path / "pt"
    argv = ["pretrain", str(dataset_dir), "--preset", "tiny", "--max-len", "16", "--batch-size", "16"]
    argv += ["--fetch-factor", "4", "--steps", "2", "--probe-label", "drug", "--probe-cells", "64"]
    argv += ["--checkpoint-dir", str(pt)]
    assert main(argv) == 0
    capsys.readouterr()
    with monkeypatch.context() as m:
        _terminated_in_start_up(m, train._pretrain)
        assert main([*argv, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "linear probe of" not in out
    assert out.splitlines()[-1] == (
        f"SIGTERM: stopped after step 2/2, before the linear probe; checkpoint {pt / 'step-000002'}, "
        "continue with --resume"
    )
