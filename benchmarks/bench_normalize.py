"""Where to log1p-normalize: fused into the loader's numba scatter, or in the jitted train step?

Times `train.fit` steps (MLP, batch 256, block 16 / fetch 64, 1 CPU device) on the 200k-cell
dataset both ways, same seed, same number of steps; reports the median step time and the share
of it spent waiting for data (from `FitResult`).

    .venv/bin/python benchmarks/bench_normalize.py --steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from train import TrainConfig, fit

HERE = Path(__file__).parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default=str(HERE / "data" / "ds_200k"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(HERE / "results" / "normalize.json"))
    args = p.parse_args()
    rows = []
    for repeat in range(args.repeats):
        for on_device in (False, True):
            config = TrainConfig(
                args.dataset,
                "cell_type",
                model="mlp",
                batch_size=args.batch_size,
                block_size=16,
                fetch_factor=64,
                steps=args.steps,
                seed=0,
                num_devices=1,
                normalize_on_device=on_device,
                quiet=True,
            )
            result = fit(config)
            row = {
                "normalize": "on device (jitted step)" if on_device else "fused in the loader (numba)",
                "repeat": repeat,
                "median_step_ms": 1e3 * result.step_time_s,
                "data_wait_fraction": result.data_wait_fraction,
                "final_loss": result.history[-1]["loss"],
            }
            rows.append(row)
            print(
                f"{row['normalize']:32s} median step {row['median_step_ms']:7.1f} ms, "
                f"data wait {100 * row['data_wait_fraction']:4.1f}%, final loss {row['final_loss']:.4f}",
                flush=True,
            )
    result = {
        "benchmark": "bench_normalize",
        "command": f"python benchmarks/bench_normalize.py --steps {args.steps}",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
