"""What a GPU (or any accelerator) adds: host→device transfer, on-device densify, on-device panel draws.

On the same dataset as bench_grain.py, with the default JAX device: make_loader's dense batches
placed on the device; csr slabs placed and densified there (``loader.densify``, normalize_log1p);
an in-memory 2,000-gene panel drawn by ``make_memory_loader(placement="device")``; and the raw
host→device bandwidth of a pinned-size float32 array. Medians of 3 timed passes.

    .venv/bin/python benchmarks/bench_gpu.py --out benchmarks/results/gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent


def _rate(fn, *, warmup: int, steps: int, cells: int, passes: int = 3) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    rates = []
    for _ in range(passes):
        start = time.perf_counter()
        for _ in range(steps):
            out = fn()
        jax.block_until_ready(out)
        rates.append(steps * cells / (time.perf_counter() - start))
    return float(np.median(rates))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default=str(HERE / "data" / "ds_200k"))
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--out", default=str(HERE / "results" / "gpu.json"))
    args = p.parse_args()
    import jax

    import omicsio_jax as oj

    device = jax.devices()[0]
    ds = oj.open_dataset(args.dataset)
    kw = {
        "batch_size": 1024,
        "block_size": 16,
        "fetch_factor": 64,
        "seed": 0,
        "num_epochs": None,
        "num_threads": args.threads,
    }
    rows = {}
    dense = iter(oj.make_loader(ds, **kw, normalize="normalize_log1p"))
    rows["dense b1024 to device (host decode + normalize)"] = _rate(
        lambda: next(dense).x, warmup=20, steps=60, cells=1024
    )
    sparse_loader = oj.make_loader(ds, **kw, output="csr", normalize="normalize_log1p")
    sparse = iter(sparse_loader)
    rows["csr b1024 to device"] = _rate(lambda: next(sparse).x.values, warmup=20, steps=150, cells=1024)
    rows["csr b1024 to device + densify there"] = _rate(
        lambda: sparse_loader.densify(next(sparse).x), warmup=20, steps=150, cells=1024
    )
    x = sparse_loader.densify(next(sparse).x)
    slabs = next(sparse).x
    rows["densify alone (same slabs)"] = _rate(
        lambda: sparse_loader.densify(slabs), warmup=5, steps=200, cells=1024
    )
    panel = oj.load_panel(ds, list(range(2000)), progress=False)
    mem = oj.make_memory_loader(panel, batch_size=1024, seed=0, num_epochs=None, placement="device")
    rows["2,000-gene panel drawn on the device (memory loader)"] = _rate(
        lambda: next(mem).x, warmup=20, steps=500, cells=1024
    )
    host = np.ones((1024, ds.num_genes), np.float32)
    transfer = _rate(lambda: jax.device_put(host, device), warmup=3, steps=20, cells=1024)
    result = {
        "benchmark": "bench_gpu",
        "device": str(device),
        "device_kind": device.device_kind,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads": args.threads,
        "cells_per_s": rows,
        "dense_batch_bytes": int(x.nbytes),
        "host_to_device_GB_per_s": transfer * host.nbytes / 1024 / 1e9,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for k, v in rows.items():
        print(f"{k:<55} {v:>12,.0f} cells/s")
    print(f"host→device: {result['host_to_device_GB_per_s']:.1f} GB/s ({device.device_kind})")


if __name__ == "__main__":
    main()
