"""Where to log1p-normalize: fused into the loader's numba scatter, or in the jitted train step?

Times `train.fit` steps (MLP, batch 256, block 16 / fetch 64, 1 CPU device) on the 200k-cell
dataset both ways, same seed, same number of steps; reports the median step time and the share
of it spent waiting for data (from `FitResult`). Each run trains for a window of at least
``--seconds`` after its first (compiling) step: ``--steps`` defaults to what a short calibration
run says fills it. Both ways run ``--rounds`` times, alternated; figures are medians.

    .venv/bin/python benchmarks/bench_normalize.py
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _provenance import add_window_options, check_window, medians, provenance, require_input, write_result  # noqa: E402

from train import TrainConfig, fit  # noqa: E402

CALIBRATION_STEPS = 30


def _fit(args: argparse.Namespace, steps: int, on_device: bool) -> tuple:
    config = TrainConfig(
        args.dataset,
        "cell_type",
        model="mlp",
        batch_size=args.batch_size,
        block_size=16,
        fetch_factor=64,
        steps=steps,
        seed=0,
        num_devices=1,
        normalize_on_device=on_device,
        quiet=True,
    )
    stamps: list[float] = []
    result = fit(config, callback=lambda record: stamps.append(time.perf_counter()))
    return result, stamps[-1] - stamps[0]  # the window: every step after the first (compiling) one


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default=str(HERE / "data" / "ds_200k"))
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per run (default: enough for --seconds after the first step, from a calibration run)",
    )
    p.add_argument("--batch-size", type=int, default=256)
    add_window_options(p, rounds_flag="--repeats")
    p.add_argument("--out", default=str(HERE / "results" / "normalize.json"))
    args = p.parse_args()
    require_input(
        Path(args.dataset) / "manifest.json", "benchmarks/bench_loader.py (data/ds_200k)", "--dataset"
    )
    check_window(args, rounds_attr="repeats", rounds_flag="--repeats")
    steps = args.steps
    if steps is None:
        calibration, _ = _fit(args, CALIBRATION_STEPS, False)
        steps = 1 + math.ceil(1.25 * args.seconds / calibration.step_time_s)
        print(
            f"calibration: {1e3 * calibration.step_time_s:.1f} ms per step -> {steps} steps per run",
            flush=True,
        )
    runs = []
    for repeat in range(args.repeats):
        for on_device in (False, True):
            result, window_s = _fit(args, steps, on_device)
            row = {
                "normalize": "on device (jitted step)" if on_device else "fused in the loader (numba)",
                "repeat": repeat,
                "steps": steps,
                "window_s": window_s,
                "median_step_ms": 1e3 * result.step_time_s,
                "data_wait_fraction": result.data_wait_fraction,
                "final_loss": result.history[-1]["loss"],
            }
            runs.append(row)
            print(
                f"{row['normalize']:32s} median step {row['median_step_ms']:7.1f} ms, "
                f"data wait {100 * row['data_wait_fraction']:4.1f}%, final loss {row['final_loss']:.4f} "
                f"({window_s:.1f} s timed)",
                flush=True,
            )
    short = [r["window_s"] for r in runs if r["window_s"] < args.seconds]
    if short:
        print(f"note: {len(short)} run(s) timed under {args.seconds:g} s; pass a larger --steps", flush=True)
    rows = []
    for way in dict.fromkeys(r["normalize"] for r in runs):
        mine = [r for r in runs if r["normalize"] == way]
        rows.append(
            {
                "label": way,
                "normalize": way,
                **medians(mine, ("median_step_ms", "data_wait_fraction", "window_s", "final_loss")),
                "steps": steps,
            }
        )
    result = {
        "benchmark": "bench_normalize",
        **provenance(),
        "rounds": args.repeats,
        "window_s": args.seconds,
        "quick": args.quick,
        "steps": steps,
        "shortest_window_s": min(r["window_s"] for r in runs),
        "rows": rows,
        "runs": runs,
        "step_ms_ratio_on_device_over_fused": statistics.median(
            b["median_step_ms"] / a["median_step_ms"] for a, b in zip(runs[::2], runs[1::2], strict=True)
        ),
    }
    write_result(args.out, result, quick=args.quick)


if __name__ == "__main__":
    main()
