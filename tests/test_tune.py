"""`oj.tune`: exact plan entropy, the fastest setting that meets the target, and `--auto-tune`."""

from __future__ import annotations

import numpy as np
import pytest

import omicsio_jax as oj
import train
from omicsio_jax.loaders.tune import plan_entropy, random_entropy
from omicsio_jax.sampling.plan import SamplingPlan
from train._cli import parse_config


@pytest.fixture(scope="module")
def ds(dataset_dir):
    return oj.open_dataset(dataset_dir)


def test_plan_entropy_is_the_entropy_of_the_batches_the_loader_serves(ds):
    labels = ds.obs["batch"].codes
    for block, fetch in ((1, 4), (64, 4), (256, 2)):
        loader = oj.make_loader(ds, batch_size=64, sampling=oj.Block(block, fetch), seed=5, obs=("batch",))
        served = [np.asarray(b.obs["batch"]) for b in loader]
        plan = SamplingPlan(np.arange(ds.num_cells), 64, block, fetch, 5)
        assert plan_entropy(labels, plan, len(served)) == pytest.approx(
            oj.minibatch_entropy(served).mean(), abs=1e-12
        )
    # the true random reference lies near Theorem 3.1's expectation
    bounds = oj.entropy_bounds(np.bincount(labels), batch_size=64, block_size=1, fetch_factor=1)
    assert random_entropy(labels, np.arange(ds.num_cells), 64, 400, seed=0) == pytest.approx(
        bounds.upper, abs=0.02
    )


def test_tune_times_the_largest_block_meeting_the_target_per_fetch_and_returns_the_fastest(ds):
    result = oj.tune(
        ds,
        64,
        label="batch",
        seconds=2,
        block_sizes=(1, 16, 256, 1024),
        fetch_factors=(2, 8),
        num_threads=(1, 2),
        progress=False,
    )
    timed = [r for r in result.table if "cells_per_s" in r]
    untimed = [r for r in result.table if "cells_per_s" not in r]
    assert len(timed) == 4 and {r["num_threads"] for r in timed} == {
        1,
        2,
    }  # 2 fetch factors × 2 thread counts
    for fetch in (2, 8):
        meeting = [r["block_size"] for r in result.table if r["fetch_factor"] == fetch and r["meets_target"]]
        assert {r["block_size"] for r in timed if r["fetch_factor"] == fetch} == {max(meeting)}
    assert all(r["meets_target"] for r in timed) and any(
        not r["meets_target"] for r in untimed
    )  # 1024-cell blocks
    best = max(timed, key=lambda r: r["cells_per_s"])
    assert result.loader_kwargs() == {
        "sampling": oj.Block(best["block_size"], best["fetch_factor"]),
        "read": oj.ReadOptions(num_threads=best["num_threads"]),
    }
    assert result.entropy_ratio >= 0.98 and result.cells_per_s == best["cells_per_s"]
    assert "<- chosen" in str(result)
    loader = oj.make_loader(ds, batch_size=64, **result.loader_kwargs())
    assert next(iter(loader)).x.shape == (64, ds.num_genes)


def test_tune_says_when_no_setting_meets_the_target(ds):
    with pytest.raises(oj.OmicsIOError, match=r"no setting reaches 0\.980 × true random's 'batch' entropy"):
        oj.tune(ds, 64, label="batch", seconds=1, block_sizes=(1024,), fetch_factors=(16,), progress=False)
    with pytest.raises(
        oj.OmicsIOError, match=r"a fetch \(fetch_factor × batch_size 64\) must hold a whole block"
    ):
        oj.tune(ds, 64, label="batch", seconds=1, block_sizes=(1024,), fetch_factors=(2, 100), progress=False)
    with pytest.raises(oj.OmicsIOError, match="must be a categorical obs column"):
        oj.tune(ds, 64, label="n_counts", seconds=1, progress=False)


def test_auto_tune_trains_with_the_chosen_settings_and_a_resume_keeps_them(
    ds, dataset_dir, tmp_path, monkeypatch
):
    args = [
        str(dataset_dir),
        "--label",
        "drug",
        "--model",
        "linear",
        "--batch-size",
        "64",
        "--steps",
        "9",
        "--checkpoint-every",
        "3",
        "--auto-tune",
        "2",
        "--quiet",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ]

    def stop(record):
        if record["step"] == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train.fit(parse_config(args), callback=stop)
    saved = train.latest_checkpoint(tmp_path / "ckpt").meta["config"]
    chosen = {k: saved[k] for k in ("block_size", "fetch_factor", "num_threads")}
    labels, rows = ds.obs["drug"].codes, np.arange(ds.num_cells)
    plan = SamplingPlan(rows, 64, chosen["block_size"], chosen["fetch_factor"], 0)
    assert plan_entropy(labels, plan, 256) >= 0.98 * random_entropy(labels, rows, 64, 256, 0)
    resumed = train.fit(parse_config([*args, "--resume"]))  # tuning again could choose otherwise: it does not
    assert resumed.start_step == 3 and resumed.num_steps == 9
    again = train.latest_checkpoint(tmp_path / "ckpt").meta["config"]
    assert {k: again[k] for k in chosen} == chosen

    def measure(*args, **kwargs):
        raise AssertionError("tuned before refusing the run")

    monkeypatch.setattr(oj, "tune", measure)  # without --resume: refused at once, not after the tuning
    with pytest.raises(
        train.TrainError, match=r"already holds checkpoints \(latest: step-000009\); pass --resume"
    ):
        train.fit(parse_config(args))
    monkeypatch.undo()
    # the refused run let go of the directory at once (its writer's lock too): the same process resumes
    assert train.fit(parse_config([*args, "--resume"])).start_step == 9
    with pytest.raises(SystemExit):
        parse_config([*args, "--auto-tune", "x"])
    with pytest.raises(train.TrainError, match="auto_tune chooses block sampling's settings"):
        train.fit(parse_config([*args, "--sampling", "stream"]))
