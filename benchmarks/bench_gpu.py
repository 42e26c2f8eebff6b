"""What a GPU (or any accelerator) adds: host→device transfer, on-device densify, on-device panel draws.

With the default JAX device, at batch 1,024 and `make_loader`'s defaults (sampling and read
options), and again with each ``--read`` setting given (``--read num_threads=8,prefetch=4``: the
`ReadOptions` of the rows beside the defaults'; ``--threads N`` is ``--read num_threads=N``):

- make_loader's dense batches placed on the device (decoded and normalized on the host), and the
  same rows built on the device (``oj.Dense(on_device=True)``: csr slabs cross, densified there);
- csr slabs decoded on the host alone (``loader.as_grain_dataset()``, nothing placed): the host's
  share of the two rows after it;
- csr slabs placed on the device, and placed and densified there (``loader.densify``,
  normalize_log1p);
- the densify alone on one placed batch, and the same batch through the formulation before it
  (every entry scattered where it stands, the padding at (0, 0)), in the same run;
- an in-memory 2,000-gene panel drawn by ``make_memory_loader(on_device=True)``;
- the host→device bandwidth of one stream of ``jax.device_put`` of a dense batch's bytes (pageable
  memory, one transfer in flight), which the dense rows are set against: a loader with several
  threads overlaps its transfers and can pass it.

Each figure is the median of ``--rounds`` windows of at least ``--seconds`` after a warm-up.

The dataset (``--dataset``) is materialized from the synthetic corpus of ``--cells`` cells (seed 0,
``benchmarks/data/corpus_<N>k``) when missing, with materialize's defaults.

    .venv/bin/python benchmarks/bench_gpu.py --out benchmarks/results/gpu.json
    python benchmarks/bench_gpu.py --cells 131072 --dataset benchmarks/data/ds_131k  # a fresh GPU host
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


def _read_options(setting: str) -> dict[str, int]:
    """``"num_threads=8,prefetch=4"`` as `ReadOptions` keywords."""
    out = {}
    for item in setting.split(","):
        key, _, value = item.partition("=")
        if key.strip() not in ("num_threads", "prefetch", "decode_threads") or not value.strip().isdigit():
            msg = (
                f"--read {setting!r}: expected KEY=N[,KEY=N] with KEY num_threads, prefetch or decode_threads"
            )
            raise SystemExit(msg)
        out[key.strip()] = int(value)
    return out


def _densify_before(output):
    """The on-device densify as it was before padding was dropped: every slab entry scattered where it
    stands, a slab's padding all at (0, 0) (one shard, the single device's)."""
    import jax
    import jax.numpy as jnp

    from omicsio_jax import Normalization

    norm, rows, genes = (
        Normalization(output.normalize, output.target_sum),
        output.rows_per_slab,
        output.num_columns,
    )

    @jax.jit
    def densify(row_ids, indices, values):
        r, i, v = row_ids[0], indices[0], jnp.asarray(values[0], jnp.float32)
        return jnp.zeros((rows, genes), jnp.float32).at[r, i].add(norm.apply_entries(v, r, rows))

    return densify


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default=str(HERE / "data" / "ds_200k"))
    p.add_argument(
        "--cells", type=int, default=200_000, help="the corpus --dataset is made from when missing"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="ReadOptions(num_threads=...) of rows beside the defaults'"
    )
    p.add_argument(
        "--read",
        action="append",
        default=[],
        metavar="KEY=N[,KEY=N]",
        help="ReadOptions of rows beside the defaults' (repeatable), e.g. num_threads=8,prefetch=4",
    )
    add_window_options(p)
    p.add_argument("--out", default=str(HERE / "results" / "gpu.json"))
    args = p.parse_args()
    check_window(args)
    settings = ([f"num_threads={args.threads}"] if args.threads is not None else []) + args.read
    reads = {s: _read_options(s) for s in settings}  # a bad setting stops the run before anything is timed
    timing = {"seconds": args.seconds, "rounds": args.rounds}
    import jax

    import omicsio_jax as oj

    device = jax.devices()[0]
    if not (Path(args.dataset) / "manifest.json").exists():
        from bench_materialize import corpus_dir

        from materialize import materialize

        corpus = corpus_dir(args.cells, h5ad=False)
        print(f"materializing {args.dataset} ...", flush=True)
        materialize(corpus / "cells.parquet", args.dataset, progress=False)
    ds = oj.open_dataset(args.dataset)
    rows = {}
    layouts = {"defaults": oj.ReadOptions()}
    layouts.update({s: oj.ReadOptions(**kw) for s, kw in reads.items()})
    for name, read in layouts.items():
        kw = {"batch_size": 1024, "seed": 0, "num_epochs": None, "read": read}
        dense = oj.make_loader(ds, **kw, output=oj.Dense(normalize="normalize_log1p"))
        rows[f"dense b1024 to device, {name} (host decode + normalize)"] = _rate(
            lambda dense=dense: next(dense).x, warmup=20, cells=1024, **timing
        )
        dense.close()  # its read-ahead threads stop before the next row is timed
        built = oj.make_loader(ds, **kw, output=oj.Dense(normalize="normalize_log1p", on_device=True))
        rows[f"dense b1024 built on the device, {name} (Dense(on_device=True): csr slabs cross)"] = _rate(
            lambda built=built: next(built).x, warmup=20, cells=1024, **timing
        )
        built.close()
        sparse = oj.make_loader(ds, **kw, output=oj.CSR(normalize="normalize_log1p"))
        host = iter(sparse.as_grain_dataset())
        rows[f"csr b1024 on the host alone, {name} (nothing placed)"] = _rate(
            lambda host=host: next(host), warmup=20, cells=1024, **timing
        )
        del host  # its threads stop with it
        rows[f"csr b1024 to device, {name}"] = _rate(
            lambda sparse=sparse: next(sparse).x, warmup=20, cells=1024, **timing
        )
        rows[f"csr b1024 to device + densify there, {name}"] = _rate(
            lambda sparse=sparse: sparse.densify(next(sparse).x), warmup=20, cells=1024, **timing
        )
        slabs = next(sparse).x  # the last layout's: the densify-alone rows' input
        sparse.close()
    rows["densify alone (one placed batch, normalize_log1p)"] = _rate(
        lambda: sparse.densify(slabs), warmup=5, cells=1024, **timing
    )
    before = _densify_before(sparse.output)
    rows["densify alone, the formulation before (padding scattered at (0, 0))"] = _rate(
        lambda: before(slabs.row_ids, slabs.indices, slabs.values), warmup=5, cells=1024, **timing
    )
    np.testing.assert_array_equal(
        np.asarray(before(slabs.row_ids, slabs.indices, slabs.values)), np.asarray(sparse.densify(slabs))
    )
    padding = float(np.mean(np.asarray(slabs.values) == 0))
    panel = oj.load_panel(ds, list(range(2000)), progress=False)
    mem = oj.make_memory_loader(panel, batch_size=1024, seed=0, num_epochs=None, on_device=True)
    rows["2,000-gene panel drawn on the device (memory loader)"] = _rate(
        lambda: next(mem).x, warmup=20, cells=1024, **timing
    )
    host = np.ones((1024, ds.num_genes), np.float32)
    transfer = _rate(lambda: jax.device_put(host, device), warmup=3, cells=1024, **timing)
    per_cell = host.nbytes / 1024 / 1e9
    h2d = transfer["cells_per_s"] * per_cell
    result = {
        "benchmark": "bench_gpu",
        **provenance(),
        "rounds": args.rounds,
        "window_s": args.seconds,
        "quick": args.quick,
        "device": str(device),
        "device_kind": device.device_kind,
        "jax": jax.__version__,
        "dataset": {"path": str(args.dataset), "num_cells": ds.num_cells, "num_genes": ds.num_genes},
        "threads": args.threads,
        "read_settings": settings,
        "slab_capacity": int(slabs.values.shape[-1]),
        "slab_padding_fraction": padding,
        "rows": [{"label": k, **v} for k, v in rows.items()],
        "dense_batch_bytes": host.nbytes,
        "host_to_device_GB_per_s": h2d,
        "host_to_device_GB_per_s_runs": [v * per_cell for v in transfer["cells_per_s_runs"]],
        "summary": {
            f"{k.split(' (')[0]}: bytes/s ÷ one device_put stream's": v["cells_per_s"] * per_cell / h2d
            for k, v in rows.items()
            if k.startswith("dense")
        },
    }
    write_result(args.out, result, quick=args.quick)
    for k, v in rows.items():
        print(f"{k:<70} {v['cells_per_s']:>12,.0f} cells/s")
    print(f"host→device: {result['host_to_device_GB_per_s']:.1f} GB/s ({device.device_kind})")


if __name__ == "__main__":
    main()
