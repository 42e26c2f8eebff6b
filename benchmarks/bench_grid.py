"""block_size × fetch_factor: throughput and plate-label entropy of minibatches, with a PNG plot.

For each ``oj.Block(block_size, fetch_factor)`` the loader serves batches of 64 cells (dense
output) from the 200k-cell dataset; we time ``--rounds`` windows of at least ``--seconds`` (median
reported) and compute the plug-in entropy of the plate label (`batch` obs) in every timed
minibatch, next to the scDataset paper's bounds (Theorems 3.1-3.2) for the dataset's plate
frequencies. True random sampling is ``Block(1, 1)``.

    .venv/bin/python benchmarks/bench_grid.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np

import omicsio_jax as oj

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _provenance import (  # noqa: E402
    add_window_options,
    check_window,
    medians,
    provenance,
    require_input,
    window,
    write_result,
)

BLOCKS = (1, 4, 16, 64, 256)
FETCHES = (1, 4, 16, 64)


def measure(ds, *, block_size: int, fetch_factor: int, batch_size: int, seconds: float, rounds: int) -> dict:
    loader = oj.make_loader(
        ds,
        batch_size=batch_size,
        sampling=oj.Block(block_size, fetch_factor),
        obs=("batch",),
        seed=0,
        num_epochs=None,
    )
    it = iter(loader)
    jax.block_until_ready(next(it).x)
    labels = []

    def step() -> int:
        batch = next(it)
        jax.block_until_ready(batch.x)
        labels.append(np.asarray(batch.obs["batch"]))
        return batch_size

    runs = [window(step, seconds=seconds).as_dict() for _ in range(rounds)]
    loader.close()
    entropy = oj.minibatch_entropy(np.stack(labels))
    return {
        "label": f"Block({block_size}, {fetch_factor})",
        "block_size": block_size,
        "fetch_factor": fetch_factor,
        **medians(runs, ("cells_per_s", "seconds", "batches")),
        "entropy_mean": float(entropy.mean()),
        "entropy_std": float(entropy.std()),
    }


def plot(rows: list[dict], bounds_random: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for f in FETCHES:
        sel = [r for r in rows if r["fetch_factor"] == f]
        left.plot(
            [r["block_size"] for r in sel], [r["entropy_mean"] for r in sel], "o-", label=f"fetch_factor {f}"
        )
        right.plot(
            [r["block_size"] for r in sel], [r["cells_per_s"] for r in sel], "o-", label=f"fetch_factor {f}"
        )
    random = next(r for r in rows if r["block_size"] == 1 and r["fetch_factor"] == 1)
    left.axhline(random["entropy_mean"], color="k", ls="--", lw=1, label="true random (measured)")
    left.axhline(bounds_random, color="grey", ls=":", lw=1, label="Thm 3.1 bound")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block_size (cells)")
    left.set_ylabel("plate-label entropy per minibatch (bits)")
    right.set_ylabel("cells/s (dense, batch 64)")
    right.set_yscale("log")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.suptitle("omicsio_jax block sampling: diversity vs throughput (200k cells × 62,710 genes)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default=str(HERE / "data" / "ds_200k"), help="made by bench_loader.py")
    p.add_argument("--batch-size", type=int, default=64)
    add_window_options(p)
    p.add_argument("--out", default=str(HERE / "results" / "grid.json"))
    args = p.parse_args()
    require_input(
        Path(args.dataset) / "manifest.json", "benchmarks/bench_loader.py (data/ds_200k)", "--dataset"
    )
    check_window(args)
    ds = oj.open_dataset(args.dataset)
    plates = ds.obs["batch"]
    frequencies = np.bincount(plates.codes, minlength=len(plates.categories))
    rows = []
    for b in BLOCKS:
        for f in FETCHES:
            row = measure(
                ds,
                block_size=b,
                fetch_factor=f,
                batch_size=args.batch_size,
                seconds=args.seconds,
                rounds=args.rounds,
            )
            if f * args.batch_size >= b:
                bounds = oj.entropy_bounds(
                    frequencies, batch_size=args.batch_size, block_size=b, fetch_factor=f
                )
                row.update(lower=bounds.lower, upper=bounds.upper)
                shown = f"bounds {bounds.lower:.3f}..{bounds.upper:.3f}"
            else:  # a fetch is part of one block: the bounds do not apply (entropy ~0)
                row.update(lower=None, upper=None)
                shown = "fetch smaller than a block"
            rows.append(row)
            print(
                f"block {b:4d} fetch {f:3d}: {row['cells_per_s']:10,.0f} cells/s  entropy "
                f"{row['entropy_mean']:.3f} ± {row['entropy_std']:.3f} bits ({shown})",
                flush=True,
            )
    random = next(r for r in rows if r["block_size"] == 1 and r["fetch_factor"] == 1)
    target = next(r for r in rows if r["block_size"] == 16 and r["fetch_factor"] == 64)
    population = oj.entropy_bounds(
        frequencies, batch_size=args.batch_size, block_size=1, fetch_factor=1
    ).population
    summary = {
        "entropy_b16_f64_over_random": target["entropy_mean"] / random["entropy_mean"],
        "population_entropy_bits": population,
        "plates": len(frequencies),
    }
    print(
        f"entropy at block 16 / fetch 64 = {100 * summary['entropy_b16_f64_over_random']:.1f}% of true random"
    )
    result = {
        "benchmark": "bench_grid",
        **provenance(),
        "rounds": args.rounds,
        "window_s": args.seconds,
        "quick": args.quick,
        "batch_size": args.batch_size,
        "rows": rows,
        "summary": summary,
    }
    path = write_result(args.out, result, quick=args.quick)
    plot(
        rows,
        oj.entropy_bounds(frequencies, batch_size=args.batch_size, block_size=1, fetch_factor=1).upper,
        path.with_suffix(".png"),
    )


if __name__ == "__main__":
    main()
