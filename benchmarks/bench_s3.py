"""A dataset on S3 (moto on loopback) against the same dataset on local disk, in one run.

Starts moto's S3 server in a child process on 127.0.0.1 (its own GIL; it still shares the cores),
uploads a materialized dataset (default: a synthetic 50k-cell corpus, materialized into
``benchmarks/data/`` with 16,384-cell shards if absent), then reports:

(a) read amplification, cold cache: bytes fetched ÷ bytes of the needed chunks over an epoch of
    block-sampled batches (block 16, fetch factor 64, batch 1,024) and of truly random ones
    (block 1, fetch factor 1: every batch draws 1,024 cells anywhere), opening ranges apart;
(b) cold-cache loader cells/s (that block-sampled epoch, the fetches included: the window is that
    one epoch, ``seconds`` says how long) and GETs per fetch, also at fetch factor 8;
(c) warm-cache loader cells/s against the local loader on the same dataset: medians of ``--rounds``
    windows of at least ``--seconds`` (epochs back to back), alternated between the two, with their
    ratio (target ≥ 0.9).

    .venv/bin/python benchmarks/bench_s3.py
    .venv/bin/python benchmarks/bench_s3.py --dataset PATH --rounds 5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
DATA = HERE / "data"
BUCKET = "omicsio-bench"
sys.path.insert(0, str(HERE))
from _local_s3 import point_aws_at  # noqa: E402
from _provenance import (  # noqa: E402
    add_window_options,
    check_window,
    medians,
    provenance,
    window,
    write_result,
)

_MOTO = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # until the parent closes it
server.stop()
"""


def start_moto() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in a child process; the AWS variables of this process point at it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    endpoint = f"http://127.0.0.1:{int(proc.stdout.readline())}"
    point_aws_at(endpoint)
    return proc, endpoint


def ensure_dataset(num_cells: int, shard_cells: int) -> Path:
    corpus, out = DATA / f"corpus_s3_{num_cells // 1000}k", DATA / f"ds_s3_{num_cells // 1000}k"
    if not (out / "manifest.json").exists():
        from materialize import Layout, make_synthetic_corpus, materialize

        if not (corpus / "cells.parquet").exists():
            make_synthetic_corpus(corpus, num_cells=num_cells, seed=1, write_h5ad=False, progress=True)
        materialize(corpus / "cells.parquet", out, layout=Layout(shard_cells=shard_cells), overwrite=True)
    return out


def upload(dataset: Path, endpoint: str) -> str:
    import boto3

    from omicsio_jax.storage.store import S3Store

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    url = f"s3://{BUCKET}/{dataset.name}/"
    manifest = json.loads((dataset / "manifest.json").read_text())
    names = [s["path"] for s in manifest["shards"]] + [f["path"] for f in manifest["files"]]
    start = time.perf_counter()
    S3Store(url).upload(dataset, [*names, "manifest.json"])
    print(f"uploaded {dataset} to {url} in {time.perf_counter() - start:.1f} s", flush=True)
    return url


def _loader(ds, *, block_size: int, fetch_factor: int, output: str, num_epochs: int | None):
    import omicsio_jax as oj

    return oj.make_loader(
        ds, batch_size=1024, sampling=oj.Block(block_size, fetch_factor), output=output, seed=0,
        num_epochs=num_epochs,
    )  # fmt: skip


def epoch(ds, *, output: str = "csr", num_epochs: int = 1, block_size: int, fetch_factor: int) -> dict:
    """Time ``num_epochs`` epochs of the loader (batch 1,024), every batch placed and waited for."""
    import jax

    loader = _loader(
        ds, block_size=block_size, fetch_factor=fetch_factor, output=output, num_epochs=num_epochs
    )
    start, cells = time.perf_counter(), 0
    for batch in loader:
        jax.block_until_ready(batch.x)
        cells += 1024
    seconds = time.perf_counter() - start
    return {"cells": cells, "seconds": seconds, "cells_per_s": cells / seconds, "steps": cells // 1024}


def timed_window(ds, *, seconds: float, output: str, block_size: int, fetch_factor: int) -> dict:
    """cells/s of the loader (batch 1,024, epochs back to back) over a window of at least ``seconds``,
    after its first batch."""
    import jax

    loader = _loader(ds, block_size=block_size, fetch_factor=fetch_factor, output=output, num_epochs=None)
    jax.block_until_ready(next(loader).x)

    def step() -> int:
        jax.block_until_ready(next(loader).x)
        return 1024

    w = window(step, seconds=seconds)
    loader.close()
    return {"cells_per_s": w.cells_per_s, "seconds": w.seconds}


def cold(url: str, cache: Path, **knobs) -> dict:
    """One epoch on an empty cache: the loader's speed and what it fetched."""
    import omicsio_jax as oj

    with oj.open_dataset(url, cache_dir=cache) as ds:
        run = epoch(ds, **knobs)
        s = ds.io_stats()
        data_bytes = sum(sh.num_bytes for sh in ds.manifest.shards) - s.opening_bytes
    fetches = -(-run["steps"] // knobs["fetch_factor"])
    row = {
        **knobs,
        **run,
        "fetches": fetches,
        "num_gets": s.num_gets,
        "gets_per_fetch": s.num_gets / fetches,
        "bytes_fetched": s.bytes_fetched,
        "bytes_needed": s.bytes_needed,
        "fetched_over_needed": s.bytes_fetched / s.bytes_needed,
        "needed_over_dataset": s.bytes_needed / data_bytes,
        "opening_gets": s.opening_gets,
        "opening_bytes": s.opening_bytes,
        "files_downloaded": s.files_downloaded,
        "file_bytes": s.file_bytes,
        "chunk_hits": s.chunk_hits,
        "chunk_misses": s.chunk_misses,
    }
    print(
        f"cold  block {knobs['block_size']:>2} fetch {knobs['fetch_factor']:>2}: {run['cells_per_s']:>9,.0f} cells/s, "
        f"fetched/needed {row['fetched_over_needed']:.4f}, {s.num_gets} GETs in {fetches} fetch(es) "
        f"({row['gets_per_fetch']:.1f}/fetch), needed {row['needed_over_dataset']:.1%} of the data, "
        f"opening {s.opening_gets} GETs / {s.opening_bytes:,} B",
        flush=True,
    )
    return row


def cold_rounds(url: str, tmp: Path, name: str, rounds: int, **knobs) -> dict:
    """`cold` ``rounds`` times, each on a fresh empty cache: the median cells/s (every round's kept);
    what was fetched is the first round's (the same every round). The last round's cache is kept
    at ``tmp / name`` for the warm runs."""
    runs = [cold(url, tmp / (name if r == rounds - 1 else f"{name}-{r}"), **knobs) for r in range(rounds)]
    return {**runs[0], "label": f"cold {name}", **medians(runs, ("cells_per_s", "seconds"))}


def warm(url: str, local: Path, cache: Path, *, rounds: int, seconds: float, output: str) -> dict:
    """Alternate local and S3 (warm cache) windows; medians and their ratio."""
    import omicsio_jax as oj

    knobs = {"block_size": 16, "fetch_factor": 64, "output": output}
    speeds: dict[str, list[float]] = {"local": [], "s3": []}
    windows: dict[str, list[float]] = {"local": [], "s3": []}
    with oj.open_dataset(local) as lds, oj.open_dataset(url, cache_dir=cache) as rds:
        epoch(rds, **knobs, num_epochs=2)  # fill the cache (and the page cache) for both
        epoch(lds, **knobs, num_epochs=2)
        gets = rds.io_stats().num_gets
        for r in range(rounds):
            for name, ds in (("local", lds), ("s3", rds)):
                got = timed_window(ds, seconds=seconds, **knobs)
                speeds[name].append(got["cells_per_s"])
                windows[name].append(got["seconds"])
            print(
                f"[round {r + 1}/{rounds}] warm {output:5s} local {speeds['local'][-1]:>9,.0f}  "
                f"s3 {speeds['s3'][-1]:>9,.0f} cells/s",
                flush=True,
            )
        assert rds.io_stats().num_gets == gets, "a warm epoch made GETs"
    med = {k: float(np.median(v)) for k, v in speeds.items()}
    print(
        f"warm {output}: median local {med['local']:,.0f}, s3 {med['s3']:,.0f} cells/s, "
        f"ratio {med['s3'] / med['local']:.3f}",
        flush=True,
    )
    return {
        "label": f"warm {output}",
        "output": output,
        **knobs,
        "window_s_runs": windows,
        "local_cells_per_s": med["local"],
        "s3_cells_per_s": med["s3"],
        "ratio": med["s3"] / med["local"],
        "local_runs": speeds["local"],
        "s3_runs": speeds["s3"],
        "gets_during_rounds": 0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dataset", help="a materialized dataset directory (default: a synthetic one, made if absent)"
    )
    p.add_argument("--cells", type=int, default=50_000, help="cells of the synthetic corpus")
    p.add_argument("--shard-cells", type=int, default=16_384, help="shard size of the synthetic dataset")
    add_window_options(p)
    p.add_argument("--out", default=str(HERE / "results" / "s3.json"))
    args = p.parse_args()
    check_window(args)
    dataset = Path(args.dataset) if args.dataset else ensure_dataset(args.cells, args.shard_cells)
    moto, endpoint = start_moto()
    try:
        url = upload(dataset, endpoint)
        with tempfile.TemporaryDirectory(prefix="omicsio-bench-s3-") as tmp:
            block = cold_rounds(url, Path(tmp), "block", args.rounds, block_size=16, fetch_factor=64)
            block8 = cold_rounds(url, Path(tmp), "block8", args.rounds, block_size=16, fetch_factor=8)
            rand = cold_rounds(url, Path(tmp), "random", args.rounds, block_size=1, fetch_factor=1)
            warm_rows = [
                warm(url, dataset, Path(tmp) / "block", rounds=args.rounds, seconds=args.seconds, output=o)
                for o in ("csr", "dense")
            ]
    finally:
        moto.stdin.close()
        moto.wait(timeout=30)
    manifest = json.loads((dataset / "manifest.json").read_text())
    result = {
        "benchmark": "bench_s3",
        **provenance(),
        "rounds": args.rounds,
        "window_s": args.seconds,
        "cold_window": "one epoch on an empty cache (its seconds recorded)",
        "quick": args.quick,
        "server": "moto ThreadedMotoServer in a child process on 127.0.0.1",
        "dataset": {
            "path": str(dataset),
            "num_cells": manifest["num_cells"],
            "shards": len(manifest["shards"]),
            "shard_cells": manifest["shard_cells"],
            "group_size": manifest["array_record"]["group_size"],
            "shard_bytes": sum(s["num_bytes"] for s in manifest["shards"]),
        },
        "batch_size": 1024,
        "cold_block": block,
        "cold_block_fetch8": block8,
        "cold_random": rand,
        "warm": warm_rows,
    }
    write_result(args.out, result, quick=args.quick)


if __name__ == "__main__":
    main()
