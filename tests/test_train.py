"""The training application: predicate parser, metrics, sharded vs single-device steps, checkpoint
refusal, bit-identical replay after a SIGKILL, and the command line (in-process and console script)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from conftest import kill_at

import omicsio_jax as oj
import train
from materialize import InputOptions, materialize
from train._cli import main, parse_config

ROOT = Path(__file__).resolve().parents[1]
EVAL = "batch = 'plate_00'"  # the test corpus has plates plate_00 (held out here) and plate_01


@pytest.fixture(scope="module")
def ds(dataset_dir):
    return oj.open_dataset(dataset_dir)


def _args(dataset_dir, *extra: str) -> list[str]:
    return [
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
        "--eval-where",
        EVAL,
        "--quiet",
        *extra,
    ]


def _config(dataset_dir, **kw) -> train.TrainConfig:
    base = {
        "label": "drug",
        "model": "mlp",
        "hidden": 32,
        "batch_size": 64,
        "block_size": 16,
        "fetch_factor": 4,
        "eval_where": EVAL,
        "quiet": True,
    }
    return train.TrainConfig(str(dataset_dir), **{**base, **kw})


def _leaves(model) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


# ----- predicate parser ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("batch = 'plate_13'", train.Predicate("batch", ("plate_13",))),
        ("batch=='plate_13'", train.Predicate("batch", ("plate_13",))),
        ("batch != 'plate_13'", train.Predicate("batch", ("plate_13",), invert=True)),
        ("batch <> 'plate_13'", train.Predicate("batch", ("plate_13",), invert=True)),
        ("batch IN ('plate_12','plate_13')", train.Predicate("batch", ("plate_12", "plate_13"))),
        ("  drug not in ( 'DMSO_TF' , 'a''b' ) ", train.Predicate("drug", ("DMSO_TF", "a'b"), invert=True)),
        ("\"cell type\" = 'T cell'", train.Predicate("cell type", ("T cell",))),
        ('"size ""um""" = 2', train.Predicate('size "um"', (2.0,))),
        ("n_genes IN (1, 2.5, -3e2)", train.Predicate("n_genes", (1.0, 2.5, -300.0))),
        ("is_primary_data = TRUE", train.Predicate("is_primary_data", (True,))),
        ("is_primary_data != false", train.Predicate("is_primary_data", (False,), invert=True)),
        ("flag IN (True, 'true', 1)", train.Predicate("flag", (True, "true", 1.0))),
    ],
)
def test_predicates_parse(text, expected):
    assert train.parse_predicate(text) == expected
    assert train.parse_predicate(str(expected)) == expected  # str() gives a parseable predicate


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "batch = plate_13",
            r"expected a quoted value, a number, TRUE or FALSE, got 'plate_13' at position 8",
        ),
        ("batch = 'plate_13", r"""unexpected "'plate_13" at position 8"""),
        ("batch IN 'a'", r"expected '\(', got \"'a'\" at position 9"),
        ("batch IN ('a' 'b')", r"expected ',' or '\)', got \"'b'\" at position 14"),
        ("batch IN ('a',)", r"expected a quoted value, a number, TRUE or FALSE, got '\)'"),
        ("batch = 'a' OR batch = 'b'", r"expected the end of the predicate, got 'OR' at position 12"),
        ("batch LIKE 'a%'", r"expected =, !=, IN or NOT IN, got 'LIKE'"),
        ("batch NOT 'a'", r"expected IN, got \"'a'\""),
        ("", r"expected a column name, got the end"),
        ("batch; rm -rf /", r"unexpected '; rm -rf /' at position 5"),
    ],
)
def test_bad_predicates_say_where_and_show_the_forms(text, match):
    with pytest.raises(train.PredicateError, match=match) as info:
        train.parse_predicate(text)
    assert "batch IN ('plate_08', 'plate_09')" in str(info.value)  # the fix, by example


def test_predicate_rows_are_rows_where(ds):
    np.testing.assert_array_equal(train.parse_predicate(EVAL).rows(ds), ds.rows_where("batch", ["plate_00"]))
    np.testing.assert_array_equal(
        train.parse_predicate("batch != 'plate_00'").rows(ds),
        ds.rows_where("batch", ["plate_00"], invert=True),
    )
    with pytest.raises(train.PredicateError, match=r"\['plate_99'\] not among the categories of 'batch'"):
        train.parse_predicate("batch = 'plate_99'").rows(ds)
    with pytest.raises(train.PredicateError, match=r"obs column 'plate' not in"):
        train.parse_predicate("plate = 'plate_00'").rows(ds)
    with pytest.raises(train.PredicateError, match=r"matches no cell"):
        train.parse_predicate("batch NOT IN ('plate_00', 'plate_01')").rows(ds)


# ----- metrics ------------------------------------------------------------------------------------
def test_macro_f1_and_accuracy_by_hand():
    # class 0: TP 1, FP 0, FN 1 -> 2/3; class 1: TP 1, FP 2, FN 0 -> 1/2; class 2: TP 0 -> 0
    y_true, y_pred = np.array([0, 0, 1, 2]), np.array([0, 1, 1, 1])
    assert train.macro_f1(y_true, y_pred) == pytest.approx((2 / 3 + 1 / 2 + 0) / 3)
    assert train.accuracy(y_true, y_pred) == 0.5
    # a class only predicted counts (F1 0); a class in neither does not
    assert train.macro_f1(np.array([5, 5]), np.array([5, 7])) == pytest.approx((2 / 3 + 0) / 2)
    assert train.macro_f1(np.array([3, 1, 2]), np.array([3, 1, 2])) == 1.0
    assert np.isnan(train.macro_f1(np.array([], int), np.array([], int)))
    with pytest.raises(ValueError, match="same length"):
        train.macro_f1(np.array([1, 2]), np.array([1]))


# ----- sharding -----------------------------------------------------------------------------------
def test_eight_devices_match_one_device_and_both_normalize_paths_agree(dataset_dir):
    assert jax.device_count() == 8, "tests run with 8 fake CPU devices (see conftest.py)"
    kw = {"steps": 12, "dropout": 0.2, "seed": 5}
    one = train.fit(_config(dataset_dir, num_devices=1, normalize_on_device=True, **kw))
    eight = train.fit(_config(dataset_dir, num_devices=8, normalize_on_device=True, **kw))
    fused = train.fit(_config(dataset_dir, num_devices=8, **kw))
    losses = [np.array([r["loss"] for r in run.history]) for run in (one, eight, fused)]
    assert len(losses[0]) == 12 and np.all(np.isfinite(losses[0]))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    np.testing.assert_allclose(losses[2], losses[0], rtol=1e-4)  # loader's fused normalize vs on device
    for a, b in zip(_leaves(eight.model), _leaves(one.model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    leaf = jax.tree.leaves(eqx.filter(eight.model, eqx.is_array))[0]
    assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 8
    held_out = oj.open_dataset(dataset_dir).rows_where("batch", ["plate_00"])
    assert one.eval.num_cells == eight.eval.num_cells == len(held_out)
    assert one.eval.accuracy == pytest.approx(eight.eval.accuracy, abs=2 / one.eval.num_cells)


def test_a_label_with_one_class_among_the_training_cells_is_refused(dataset_dir):
    """A held-out set that leaves one class to train on (here every cell line but one held out), or
    a label of one class: nothing to classify; refused before training, as finetune refuses it (fit
    trained to a loss of 0 and reported an accuracy of 0)."""
    ds = oj.open_dataset(dataset_dir)
    kept = ds.obs["cell_type"].categories[0]
    with pytest.raises(
        train.TrainError, match=rf"--label 'cell_type' has 1 class\(es\) .*\({kept}\): nothing"
    ):
        train.fit(_config(dataset_dir, steps=2, label="cell_type", eval_where=f"cell_type != '{kept}'"))
    with pytest.raises(train.TrainError, match=r"--label 'organism' has 1 class\(es\) among the .* training"):
        train.fit(_config(dataset_dir, steps=2, label="organism"))


# ----- checkpoints ----------------------------------------------------------------------------------
def test_mismatched_resumes_are_refused(dataset_dir, corpus, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    train.fit(_config(dataset_dir, steps=4, checkpoint_dir=str(ckpt)))
    (ckpt / ".step-000009.tmp-1").mkdir()  # a partial checkpoint left by a kill: never the latest
    assert train.latest_checkpoint(ckpt).step == 4
    with pytest.raises(train.CheckpointMismatchError, match=r"(?m)^  seed: in checkpoint 0, now 1$"):
        train.fit(_config(dataset_dir, steps=4, seed=1, checkpoint_dir=str(ckpt), resume=True))
    assert not (ckpt / ".step-000009.tmp-1").exists()
    with pytest.raises(train.CheckpointMismatchError, match=r"lr: in checkpoint 0.001, now 0.01"):
        train.fit(_config(dataset_dir, steps=4, lr=0.01, checkpoint_dir=str(ckpt), resume=True))
    with pytest.raises(train.TrainError, match=r"holds checkpoints \(latest: step-000004\); pass --resume"):
        train.fit(_config(dataset_dir, steps=4, checkpoint_dir=str(ckpt)))

    other = tmp_path / "other"
    materialize(
        corpus.cells_parquet, other, progress=False, read=InputOptions(where="cell_type != 'cell_line_00'")
    )
    with pytest.raises(
        train.CheckpointMismatchError,
        match=r"cannot resume from .*step-000004: it was written by another run[^\n]*\n"
        r"(.*\n)*  dataset: in checkpoint '[0-9a-f]{16}', now '[0-9a-f]{16}'",
    ):
        train.fit(_config(other, steps=4, checkpoint_dir=str(ckpt), resume=True))

    capsys.readouterr()
    argv = _args(dataset_dir, "--steps", "4", "--seed", "1", "--checkpoint-dir", str(ckpt), "--resume")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"omicsio-train: error: cannot resume from {ckpt / 'step-000004'}: it was written by another run "
        "(use the same dataset and options, or a fresh --checkpoint-dir):",
        "  seed: in checkpoint 0, now 1",
    ]
    # an identical resume of a finished run trains nothing and keeps the checkpoint
    done = train.fit(_config(dataset_dir, steps=4, checkpoint_dir=str(ckpt), resume=True))
    assert (done.start_step, done.history, done.checkpoint) == (4, [], ckpt / "step-000004")


def test_killed_run_resumes_bit_identically(dataset_dir, tmp_path):
    # 2 epochs of 31 steps; checkpoints every 5 steps; killed at step 23 (3 steps past step-000020)
    args = _args(dataset_dir, "--dropout", "0.2", "--epochs", "2", "--seed", "3", "--checkpoint-every", "5")
    reference = train.fit(parse_config([*args, "--checkpoint-dir", str(tmp_path / "ref")]))
    total = reference.num_steps
    assert total == 62 and [p.name for _, p in train.list_checkpoints(tmp_path / "ref")] == [
        "step-000055",
        "step-000060",
        "step-000062",
    ]  # keep=3, and one at the end

    ckpt = tmp_path / "killed"
    kill_at(args, ckpt, tmp_path / "stalled", 23, ckpt / "step-000020")
    assert train.latest_checkpoint(ckpt).step == 20
    assert [r["step"] for r in train.read_metrics(ckpt / "metrics.jsonl")][-1] == 23  # to be truncated

    # the resume: a real run of the console script
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    script = Path(sys.executable).with_name("omicsio-train")
    run = subprocess.run(
        [str(script), *args, "--checkpoint-dir", str(ckpt), "--resume"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""  # --quiet

    final = f"step-{total:06d}/state.eqx"
    assert (ckpt / final).read_bytes() == (tmp_path / "ref" / final).read_bytes()
    history = [(r["step"], r["loss"]) for r in train.read_metrics(ckpt / "metrics.jsonl")]
    assert history == [(r["step"], r["loss"]) for r in train.read_metrics(tmp_path / "ref" / "metrics.jsonl")]
    assert [s for s, _ in history] == list(range(1, total + 1))
    meta = json.loads((ckpt / f"step-{total:06d}" / "meta.json").read_text())
    assert meta["step"] == total and meta["dataset_fingerprint"] == oj.open_dataset(dataset_dir).fingerprint
    assert meta["config"]["seed"] == 3 and "resume" not in meta["config"]


def test_orbax_checkpoints_resume_bit_identically_after_sigkill(dataset_dir, tmp_path):
    pytest.importorskip(
        "orbax.checkpoint", reason="the orbax extra is not installed (scripts/test.sh installs it)"
    )
    args = _args(
        dataset_dir,
        "--dropout",
        "0.2",
        "--epochs",
        "1",
        "--seed",
        "5",
        "--checkpoint-every",
        "10",
        "--checkpoint-format",
        "orbax",
    )
    reference = train.fit(parse_config([*args, "--checkpoint-dir", str(tmp_path / "ref")]))
    ckpt = tmp_path / "killed"
    kill_at(args, ckpt, tmp_path / "stalled", 13, ckpt / "10")
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [10]
    assert sorted(p.name for p in (ckpt / "10").iterdir() if not p.name.startswith("_")) == [
        "commit_success.txt",
        "data",
        "meta",
        "state",
    ]
    data_state = json.loads((ckpt / "10" / "data" / "process_0-of-1.json").read_text())
    assert data_state["step"] == 10 and len(json.dumps(data_state)) < 1024
    resumed = train.fit(parse_config([*args, "--checkpoint-dir", str(ckpt), "--resume"]))
    assert resumed.start_step == 10 and resumed.num_steps == reference.num_steps == 31
    for a, b in zip(_leaves(resumed.model), _leaves(reference.model), strict=True):
        np.testing.assert_array_equal(a, b)  # bit-identical parameters
    history = [(r["step"], r["loss"]) for r in train.read_metrics(ckpt / "metrics.jsonl")]
    assert history == [(r["step"], r["loss"]) for r in train.read_metrics(tmp_path / "ref" / "metrics.jsonl")]
    last = train.read_metrics(ckpt / "metrics.jsonl")[-1]
    assert (
        last["coverage"]["complete"] and last["coverage"]["served_cells"] == last["coverage"]["planned_cells"]
    )
    meta = json.loads((ckpt / "31" / "meta" / "metadata").read_text())
    assert (
        meta["step"] == 31 and meta["coverage"]["epoch"] == 0 and meta["coverage"]["complete"]
    )  # the last epoch's audit


def test_an_orbax_save_in_one_process_writes_replicated_arrays_without_slicing_them(ds, tmp_path):
    """Orbax's replica-parallel split would have each of the 8 devices' replicas write a slice of
    every replicated leaf: a device op (and a compile) per leaf and replica. In one process the state
    is written whole, with no op on the devices, and reads back the same."""
    pytest.importorskip(
        "orbax.checkpoint", reason="the orbax extra is not installed (scripts/test.sh installs it)"
    )
    from train._orbax import OrbaxCheckpoints

    replicated = jax.sharding.NamedSharding(jax.make_mesh((8,), ("data",)), jax.sharding.PartitionSpec())
    # shapes no other test uses, so that a slice of them would be lowered anew here
    tree = {
        "w": jax.device_put(np.arange(104 * 3, dtype=np.float32).reshape(104, 3), replicated),
        "b": jax.device_put(np.arange(56, dtype=np.int32), replicated),
    }
    loader = oj.make_loader(ds, batch_size=16, sampling=oj.Block(4, 4))
    lowered: list[str] = []

    def listen(event: str, _seconds: float, **_kw) -> None:
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        store = OrbaxCheckpoints(tmp_path / "ckpt")
        store.save(1, tree, {"seed": 0}, loader)
        store.close()
    finally:  # public since jax 0.8.1; the package allows jax 0.6.1, which has it by another name
        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
        if unregister is None:
            from jax._src.monitoring import _unregister_event_duration_listener_by_callback as unregister
        unregister(listen)
    assert lowered == []
    store = OrbaxCheckpoints(tmp_path / "ckpt")
    back = store.latest().load(jax.tree.map(lambda a: a * 0, tree))
    store.close()
    for name, array in tree.items():
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(array))


# ----- command line ---------------------------------------------------------------------------------
def test_cli_trains_evaluates_and_reports_user_mistakes(dataset_dir, ds, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    argv = _args(
        dataset_dir, "--steps", "6", "--metrics", str(metrics), "--log-every", "2", "--model", "linear"
    )
    argv.remove("--quiet")
    del argv[argv.index("--hidden") : argv.index("--hidden") + 2]  # the mlp's, refused for the linear model
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "step      6/6" in out and "cells/s" in out and "data wait" in out
    assert "eval (batch = 'plate_00'): accuracy" in out and "macro-F1" in out
    records = train.read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert set(records[0]) == {"step", "epoch", "loss", "cells_per_s", "data_wait_s"}

    # --eval-rows gives the same split as the equivalent --eval-where
    rows = tmp_path / "held_out.npy"
    np.save(rows, ds.rows_where("batch", ["plate_00"]))
    by_where = train.fit(dataclasses.replace(parse_config(argv), metrics=None, quiet=True))
    by_rows = train.fit(
        dataclasses.replace(
            by_where_config := parse_config(argv),
            metrics=None,
            quiet=True,
            eval_where=None,
            eval_rows=str(rows),
        )
    )
    assert by_where_config.eval_where == EVAL
    assert [r["loss"] for r in by_rows.history] == [r["loss"] for r in by_where.history]
    assert by_rows.eval == by_where.eval

    capsys.readouterr()
    np.save(tmp_path / "rows_2d.npy", np.arange(10, dtype=np.int64).reshape(2, 5))
    mistakes = {
        "missing dataset": ([str(tmp_path / "nope"), "--label", "drug"], r"is not a directory"),
        "unknown label": (
            [str(dataset_dir), "--label", "disease"],
            r"--label 'disease' must be a categorical obs",
        ),
        "numeric label": ([str(dataset_dir), "--label", "n_genes"], r"\(numeric\); categorical columns: "),
        "bad predicate": (
            [str(dataset_dir), "--label", "drug", "--eval-where", "batch = plate_00"],
            r"expected a quoted value, a number, TRUE or FALSE",
        ),
        "bad rows file": (
            [str(dataset_dir), "--label", "drug", "--eval-rows", str(tmp_path / "x.npy")],
            r"cannot read --eval-rows",
        ),
        "rows not 1-D": (
            [str(dataset_dir), "--label", "drug", "--eval-rows", str(tmp_path / "rows_2d.npy")],
            r"must hold a non-empty 1-D integer array of rows in 0\.\.\d+; got dtype int64, shape \(2, 5\)",
        ),
        "a hidden layer's options for the linear model": (
            [str(dataset_dir), "--label", "drug", "--model", "linear", "--hidden", "7", "--dropout", "0.5"],
            r"hidden, dropout set for the linear model, which has no hidden layer: drop it, or train "
            r"model='mlp' \(--model mlp\)$",
        ),
        "bad batch": (
            [str(dataset_dir), "--label", "drug", "--batch-size", "60"],
            r"divisible by the 8 devices",
        ),
    }
    for name, (argv, match) in mistakes.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith("omicsio-train: error: "), (name, err)
        assert re.search(match, err), (name, err)
    assert main([str(dataset_dir), "--label", "drug", "--resume"]) == 2  # argparse: needs --checkpoint-dir
    assert "--resume needs --checkpoint-dir" in capsys.readouterr().err


def test_path_options_that_cannot_be_what_they_name_are_one_line_errors(dataset_dir, tmp_path, capsys):
    afile, adir = tmp_path / "afile", tmp_path / "adir"
    afile.write_text("")
    adir.mkdir()
    data, under = str(dataset_dir), f"{afile}/sub"
    not_a_dir = f"{afile} is a file, not a directory"
    finetune = ["finetune", data, "--init", str(tmp_path / "pt"), "--label", "drug", "--eval-where", EVAL]
    embed = ["embed", data, "--out", str(tmp_path / "e.npy")]
    mistakes = {
        "classifier --checkpoint-dir a file": (
            [data, "--label", "drug", "--checkpoint-dir", str(afile)],
            f"--checkpoint-dir {afile}: {not_a_dir}",
        ),
        "classifier --metrics under a file": (
            [data, "--label", "drug", "--metrics", under],
            f"--metrics {under}: {not_a_dir}",
        ),
        "classifier --metrics a directory": (
            [data, "--label", "drug", "--metrics", str(adir)],
            f"--metrics {adir} is a directory, not a file",
        ),
        "pretrain --checkpoint-dir under a file": (
            ["pretrain", data, "--checkpoint-dir", under],
            f"--checkpoint-dir {under}: {not_a_dir}",
        ),
        "pretrain --vocab a directory": (
            ["pretrain", data, "--vocab", str(adir)],
            f"--vocab {adir} is a directory",
        ),
        "embed --checkpoint-dir a file": (
            [*embed, "--checkpoint-dir", str(afile)],
            f"--checkpoint-dir {afile}: {not_a_dir}",
        ),
        "embed --out a directory": (
            ["embed", data, "--checkpoint-dir", str(tmp_path / "pt"), "--out", str(adir)],
            f"--out {adir} is a directory",
        ),
        "finetune --out-metrics under a file": (
            [*finetune, "--out-metrics", under],
            f"--out-metrics {under}: {not_a_dir}",
        ),
    }
    if Path("/proc/self").is_dir():  # a folder no file can be made in, whoever runs (root included)
        nowhere = "/proc/omicsio-nowhere"
        cannot = "cannot write in /proc ("
        mistakes |= {
            "classifier --metrics where no file can be made": (
                [data, "--label", "drug", "--metrics", f"{nowhere}/m.jsonl"],
                f"--metrics {nowhere}/m.jsonl: {cannot}",
            ),
            "pretrain --checkpoint-dir where no file can be made": (
                ["pretrain", data, "--checkpoint-dir", nowhere],
                f"--checkpoint-dir {nowhere}: {cannot}",
            ),
            "embed --out where no file can be made": (
                ["embed", data, "--checkpoint-dir", str(tmp_path / "pt"), "--out", f"{nowhere}/e.npy"],
                f"--out {nowhere}/e.npy: {cannot}",
            ),
        }
    for name, (argv, message) in mistakes.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith(f"omicsio-train: error: {message}"), (name, err)
    assert afile.read_text() == "" and not any(adir.iterdir())


def test_ctrl_c_says_how_to_continue_only_where_it_saved(dataset_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C exits 130 with one line: ``--resume`` where the run saved to a ``--checkpoint-dir``.
    Without one, or from ``embed`` (which has no ``--resume``), that advice only led to another error."""
    import train._embed
    import train._loop
    import train._pretrain

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train._loop, "evaluate", interrupt)  # Ctrl-C while the held-out cells are scored
    ckpt = tmp_path / "ckpt"
    capsys.readouterr()
    assert main(_args(dataset_dir, "--steps", "2", "--checkpoint-dir", str(ckpt))) == 130
    said = f"omicsio-train: interrupted; continue from the latest checkpoint in {ckpt} with --resume\n"
    assert capsys.readouterr().err == said
    assert main(_args(dataset_dir, "--steps", "2")) == 130
    assert capsys.readouterr().err == "omicsio-train: interrupted; no --checkpoint-dir, nothing was saved\n"

    monkeypatch.setattr(train._pretrain, "pretrain", interrupt)
    pt = tmp_path / "pt"
    assert main(["pretrain", str(dataset_dir), "--checkpoint-dir", str(pt)]) == 130
    assert f"continue from the latest checkpoint in {pt} with --resume" in capsys.readouterr().err
    assert main(["pretrain", str(dataset_dir)]) == 130
    assert "no --checkpoint-dir, nothing was saved" in capsys.readouterr().err
    monkeypatch.setattr(train._embed, "load_encoder", interrupt)
    embed = ["embed", str(dataset_dir), "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "e")]
    assert main(embed) == 130
    assert capsys.readouterr().err == "omicsio-train: interrupted\n"


def test_help_lists_the_subcommands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("pretrain", "embed", "finetune"):
        line = next(s for s in out.splitlines() if s.split()[:1] == [command])
        assert len(line.split()) > 3, line  # the command and what it does, on one line
    assert main(["pretrain", "--help"]) == 0 and "--preset" in capsys.readouterr().out


def test_an_eval_batch_size_the_devices_do_not_split_is_refused_before_training(
    dataset_dir, tmp_path, capsys
):
    """``--eval-batch-size`` is checked against the mesh when the run starts, as ``--batch-size`` is:
    the held-out cells are read after training, so the error came after every step, naming
    ``batch_size``. (The tests run on 8 CPU devices.)"""
    ckpt = tmp_path / "ck"
    argv = [*_args(dataset_dir, "--steps", "2", "--eval-batch-size", "30"), "--checkpoint-dir", str(ckpt)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "omicsio-train: error: --eval-batch-size 30 must be divisible by the 8 devices of the mesh: pass a "
        "multiple of 8, e.g. --eval-batch-size 24"
    )
    assert not ckpt.exists()  # nothing trained, nothing written


@pytest.mark.parametrize(
    "args,said",
    [
        (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
        (["--devices", "0"], "--devices must be a positive integer, got 0"),
        (["--lr", "-1"], "--lr must be positive, got -1.0"),
        (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0 (0: only at the end), got -1"),
    ],
)
def test_the_cli_names_an_option_out_of_range_by_its_flag(dataset_dir, capsys, args, said):
    # it named TrainConfig's field (batch_size, num_devices), which the command line has no word for
    assert main([str(dataset_dir), "--label", "drug", *args]) == 2
    assert capsys.readouterr().err.strip() == f"omicsio-train: error: {said}"
