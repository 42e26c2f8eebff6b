"""Fault soak: a training loop's reads from a dataset on S3 (moto's server on 127.0.0.1) through a
proxy that injects faults (`_fault_proxy`: 500 and 503 responses, resets, slow and truncated
bodies), for ``--minutes``, against the same loader over the local copy of the same dataset.

Every batch must equal the local loader's (indices, csr values, bit for bit); every epoch's coverage
audit must pass (each cell exactly once); every fault must be absorbed by a retry, or surface as a
one-line `OmicsIOError` (an ETag change: "changed while in use ... open it again"), after which the
loop does what a training job does: opens the dataset again and restores the loader from its last
state, and the batches go on exactly; the process's RSS must not grow more than 5% once warm (from the first
epoch end past a fifth of the run). After
the first epoch one byte of a cached chunk is flipped: the reader must notice and fetch it again.
A small cache (a quarter of the dataset) keeps the reads going to S3 throughout.

    .venv/bin/python benchmarks/soak.py                      # 30 minutes: results/soak.json
    .venv/bin/python benchmarks/soak.py --minutes 1 --quick  # a smoke run (tests/test_soak.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _fault_proxy import FaultProxy  # noqa: E402
from _local_s3 import start_moto  # noqa: E402
from _provenance import provenance, write_result  # noqa: E402


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _flip_a_cached_byte(remote, local, cache: Path) -> dict | None:
    """Flip one byte inside a fetched chunk of a shard's sparse mirror in ``cache``, then read that
    chunk's cells: the reader must notice (the chunk's hash) and fetch it again."""
    for shard, entry in enumerate(remote.manifest.shards):
        path = next(cache.rglob(entry.path), None)
        if path is None or path.stat().st_blocks == 0:
            continue
        data = np.fromfile(path, np.uint8)
        ranges = remote.chunk_index(shard).chunk_bytes(np.arange(remote.chunk_index(shard).num_chunks))
        for chunk, (lo, hi) in enumerate(ranges.tolist()):
            if hi - lo > 64 and data[lo:hi].any():  # fetched (a mirror's missing bytes read as zeros)
                at = (lo + hi) // 2
                with open(path, "r+b") as f:
                    f.seek(at)
                    f.write(bytes([data[at] ^ 0x5A]))
                group = remote.chunk_reader.group_size if remote.chunk_reader else 16
                first = entry.first_cell + chunk * group
                rows = np.arange(first, min(first + group, entry.first_cell + entry.num_cells))
                try:
                    same = all(
                        np.array_equal(a, b)
                        for a, b in zip(remote.read_csr(rows), local.read_csr(rows), strict=True)
                    )
                    return {
                        "shard": entry.path,
                        "byte": at,
                        "cells": rows.tolist()[:1] + rows.tolist()[-1:],
                        "read_back_exact": same,
                    }
                except Exception as e:  # noqa: BLE001 - reported in the results
                    return {"shard": entry.path, "byte": at, "error": f"{type(e).__name__}: {e}"}
    return None


def soak(minutes: float, cells: int, rate: float, seed: int, work: Path) -> dict:
    server, endpoint = start_moto()
    import boto3

    import omicsio_jax as oj
    from materialize import Layout, make_synthetic_corpus, materialize

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="soak")
    corpus = make_synthetic_corpus(
        work / "corpus", num_cells=cells, seed=seed, write_h5ad=False, progress=False
    )
    layout = Layout(shard_cells=1024)
    materialize(corpus.cells_parquet, work / "local", progress=False, layout=layout)
    materialize(corpus.cells_parquet, "s3://soak/ds", progress=False, layout=layout)

    proxy = FaultProxy(endpoint, rate=rate, seed=seed)
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # the reader's store is made now, through the proxy
    local = oj.open_dataset(work / "local")
    size = sum(s.num_bytes for s in local.manifest.shards)
    cache_bytes = max(size // 4, 1 << 20)
    remote = oj.open_dataset("s3://soak/ds", cache_dir=work / "cache", cache_bytes=cache_bytes)
    kwargs = {
        "batch_size": 256,
        "sampling": oj.Block(16, 8),
        "output": "csr",
        "seed": seed,
        "num_epochs": None,
    }
    expected, loader = oj.make_loader(local, **kwargs), oj.make_loader(remote, **kwargs)

    out = {"cells": cells, "rate": rate, "seed": seed, "batches": 0, "epochs_audited": 0, "mismatches": 0}
    errors: list[dict] = []
    rss: list[tuple[float, int]] = []
    flipped = None
    epoch, start = 0, time.perf_counter()
    deadline = start + 60 * minutes
    surfaced: list[str] = []
    state = loader.get_state()
    try:
        while (
            time.perf_counter() < deadline  # and, on a slow machine, past it until each fault was met
            or out["epochs_audited"] < 2
            or (len(proxy.injected) < len(proxy.faults) and time.perf_counter() < start + 180 * minutes)
        ):
            try:
                got = next(loader)
            except oj.OmicsIOError as e:
                if "\n" in str(e) or len(surfaced) >= 1000:
                    raise
                surfaced.append(f"{type(e).__name__}: {e}")
                loader.close()
                remote.close()
                remote = oj.open_dataset("s3://soak/ds", cache_dir=work / "cache", cache_bytes=cache_bytes)
                loader = oj.make_loader(remote, **kwargs)
                loader.set_state(state)
                continue
            state = loader.get_state()
            want = next(expected)
            same = np.array_equal(np.asarray(got.index), np.asarray(want.index)) and all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(
                    (got.x.row_ids, got.x.indices, got.x.values),
                    (want.x.row_ids, want.x.indices, want.x.values),
                    strict=True,
                )
            )
            out["batches"] += 1
            out["mismatches"] += not same
            now = loader.get_state()["epoch"]
            if now != epoch:  # an epoch ended: its audit (the loader raises CoverageError if it fails)
                if not loader.coverage(epoch).complete:
                    errors.append({"type": "CoverageError", "message": f"epoch {epoch} incomplete"})
                out["epochs_audited"] += 1
                rss.append((time.perf_counter() - start, _rss_bytes()))
                if flipped is None:
                    flipped = _flip_a_cached_byte(remote, local, work / "cache")
                epoch = now
    except Exception as e:  # anything else is a crash: reported, not hidden
        errors.append({"type": type(e).__name__, "message": str(e), "one_line": "\n" not in str(e)})
    finally:
        loader.close()
        expected.close()
        proxy.stop()
        server.stop()
    elapsed = time.perf_counter() - start
    # warmed up: the first epoch end past a fifth of the run (JAX, numba and the caches have filled)
    after = [(t, r) for t, r in rss if t >= elapsed / 5] or rss[-1:]
    warm = after[0][1] if after else 0
    out.update(
        {
            "seconds": elapsed,
            "requests": proxy.requests,
            "faults_injected": dict(proxy.injected),
            "flipped": flipped,
            "errors": errors,
            "surfaced_and_resumed": len(surfaced),
            "surfaced_examples": sorted(set(surfaced))[:5],
            "rss_warm_bytes": warm,
            "rss_end_bytes": rss[-1][1] if rss else 0,
            "rss_growth": (max(r for _, r in after) / warm - 1) if warm else None,
            "rss_by_epoch": rss,
            "io": dataclasses.asdict(remote.io_stats()),
        }
    )
    out["passed"] = (
        not errors
        and flipped is not None
        and flipped.get("read_back_exact") is True
        and out["mismatches"] == 0
        and out["epochs_audited"] >= 2
        and out["rss_growth"] is not None
        and out["rss_growth"] < 0.05
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--cells", type=int, default=20_000)
    p.add_argument("--rate", type=float, default=0.05, help="share of the GETs given a fault")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: results in a temporary folder")
    p.add_argument("--out", default=str(HERE / "results" / "soak.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="omicsio-soak-") as tmp:
        result = {
            "benchmark": "soak",
            **provenance(),
            **soak(args.minutes, args.cells, args.rate, args.seed, Path(tmp)),
        }
    path = write_result(args.out, result, quick=args.quick)
    print(
        f"{'PASSED' if result['passed'] else 'FAILED'}: {result['batches']:,} batches, {result['epochs_audited']} "
        f"epochs audited, {result['mismatches']} mismatches, faults {result['faults_injected']} of "
        f"{result['requests']:,} requests, errors {result['errors']}, RSS growth {result['rss_growth']}; {path}"
    )
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
