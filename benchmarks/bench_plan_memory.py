"""The memory of a sampling plan over every cell of a 10^8-cell dataset: the rows as ``AllRows``
(what `make_loader` uses) against an ``np.arange`` of every row.

Each variant runs in a fresh process: build the plan (batch 1,024, block 16, fetch 64), cut its
first fetch and serving order, and digest its config (what a checkpoint compares); peak RSS is the
process's ``ru_maxrss``.

    .venv/bin/python benchmarks/bench_plan_memory.py      # a few seconds; writes results/plan_memory.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _provenance import provenance, write_result  # noqa: E402

NUM_CELLS = 10**8


def _child(variant: str) -> dict:
    import numpy as np

    from omicsio_jax.sampling.plan import AllRows, SamplingPlan

    start = time.perf_counter()
    rows = AllRows(NUM_CELLS) if variant == "AllRows" else np.arange(NUM_CELLS, dtype=np.int64)
    plan = SamplingPlan(rows, 1024, 16, 64, 0)
    plan.serving_rows(plan.fetch(0, 0, 0))
    digest = plan.describe()["rows"]
    return {
        "variant": variant,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds": time.perf_counter() - start,
        "rows_digest": digest,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(HERE / "results" / "plan_memory.json"))
    p.add_argument("--quick", action="store_true", help="a smoke run: results in a temporary folder")
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.child)))
        return
    results = []
    for variant in ("np.arange", "AllRows"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", variant], check=True, capture_output=True, text=True
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(
            f"{variant:>9}: peak RSS {results[-1]['peak_rss_mib']:,.0f} MiB, {results[-1]['seconds']:.2f} s"
        )
    assert results[0]["rows_digest"] == results[1]["rows_digest"], "the config digest must not change"
    result = {
        "benchmark": "bench_plan_memory",
        **provenance(),
        "quick": args.quick,
        "num_cells": NUM_CELLS,
        "results": results,
    }
    write_result(args.out, result, quick=args.quick)


if __name__ == "__main__":
    main()
