"""What a GPU (or any accelerator) adds: host→device transfer, on-device densify, on-device panel draws.

On the same dataset as bench_grain.py, with the default JAX device: make_loader's dense batches
placed on the device; csr slabs placed and densified there (``loader.densify``, normalize_log1p);
an in-memory 2,000-gene panel drawn by ``make_memory_loader(on_device=True)``; and the raw
host→device bandwidth of a pinned-size float32 array. Each figure is the median of ``--rounds``
windows of at least ``--seconds`` after a warm-up.

    .venv/bin/python benchmarks/bench_gpu.py --out benchmarks/results/gpu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _provenance import (  # noqa: E402
    add_window_options,
    check_window,
    medians,
    provenance,
    window,
    write_result,
)


def _rate(fn, *, warmup: int, cells: int, seconds: float, rounds: int) -> dict:
    """cells/s of ``fn`` (one call serves ``cells``) after ``warmup`` calls: each call is dispatched
    before the previous one's result is waited for (one call in flight, as in a training loop), the
    last waited for inside the window."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    pending = [None]

    def step() -> int:
        out = fn()
        jax.block_until_ready(pending[0])
        pending[0] = out
        return cells

    def finish() -> None:
        jax.block_until_ready(pending[0])
        pending[0] = None

    runs = [window(step, seconds=seconds, finish=finish).as_dict() for _ in range(rounds)]
    return medians(runs, ("cells_per_s", "seconds"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default=str(HERE / "data" / "ds_200k"))
    p.add_argument("--threads", type=int, default=4, help="make_loader's ReadOptions(num_threads=...)")
    add_window_options(p)
    p.add_argument("--out", default=str(HERE / "results" / "gpu.json"))
    args = p.parse_args()
    check_window(args)
    timing = {"seconds": args.seconds, "rounds": args.rounds}
    import jax

    import omicsio_jax as oj

    device = jax.devices()[0]
    ds = oj.open_dataset(args.dataset)
    kw = {
        "batch_size": 1024,
        "sampling": oj.Block(16, 64),
        "seed": 0,
        "num_epochs": None,
        "read": oj.ReadOptions(num_threads=args.threads),
    }
    rows = {}
    dense = iter(oj.make_loader(ds, **kw, output=oj.Dense(normalize="normalize_log1p")))
    rows["dense b1024 to device (host decode + normalize)"] = _rate(
        lambda: next(dense).x, warmup=20, cells=1024, **timing
    )
    sparse_loader = oj.make_loader(ds, **kw, output=oj.CSR(normalize="normalize_log1p"))
    sparse = iter(sparse_loader)
    rows["csr b1024 to device"] = _rate(lambda: next(sparse).x.values, warmup=20, cells=1024, **timing)
    rows["csr b1024 to device + densify there"] = _rate(
        lambda: sparse_loader.densify(next(sparse).x), warmup=20, cells=1024, **timing
    )
    x = sparse_loader.densify(next(sparse).x)
    slabs = next(sparse).x
    rows["densify alone (same slabs)"] = _rate(
        lambda: sparse_loader.densify(slabs), warmup=5, cells=1024, **timing
    )
    panel = oj.load_panel(ds, list(range(2000)), progress=False)
    mem = oj.make_memory_loader(panel, batch_size=1024, seed=0, num_epochs=None, on_device=True)
    rows["2,000-gene panel drawn on the device (memory loader)"] = _rate(
        lambda: next(mem).x, warmup=20, cells=1024, **timing
    )
    host = np.ones((1024, ds.num_genes), np.float32)
    transfer = _rate(lambda: jax.device_put(host, device), warmup=3, cells=1024, **timing)
    per_cell = host.nbytes / 1024 / 1e9
    result = {
        "benchmark": "bench_gpu",
        **provenance(),
        "rounds": args.rounds,
        "window_s": args.seconds,
        "quick": args.quick,
        "device": str(device),
        "device_kind": device.device_kind,
        "threads": args.threads,
        "rows": [{"label": k, **v} for k, v in rows.items()],
        "dense_batch_bytes": int(x.nbytes),
        "host_to_device_GB_per_s": transfer["cells_per_s"] * per_cell,
        "host_to_device_GB_per_s_runs": [v * per_cell for v in transfer["cells_per_s_runs"]],
    }
    write_result(args.out, result, quick=args.quick)
    for k, v in rows.items():
        print(f"{k:<55} {v['cells_per_s']:>12,.0f} cells/s")
    print(f"host→device: {result['host_to_device_GB_per_s']:.1f} GB/s ({device.device_kind})")


if __name__ == "__main__":
    main()
