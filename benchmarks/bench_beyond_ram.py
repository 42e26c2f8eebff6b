"""The loader on a dataset larger than the machine's RAM, beside the disk's own limits, in one run.

The dataset is ``ds_200k``'s three full 65,536-cell shards written out as real copies (not links:
the page cache cannot share them) under one manifest (`_replicate.py`), enough copies to exceed
RAM by 18%. Each configuration runs in a fresh process after the page cache of every shard and
chunk index was dropped, for ``--seconds`` (at least 10) after its first two batches, ``--rounds``
times round-robin (medians reported); the same configurations
run warm on ``ds_200k`` itself (read once first) in the same run. Recorded per run: cells/s, the
longest wait for one batch, the process's CPU time (cores busy), peak RSS and RSS at the start
and end of the timed window, and the bytes the process read from the disk (``read_bytes``).

The disk's limits, measured in the same run on the cold copies:

- sequential: front-to-back reads of 1 MiB over 4 GiB of shards, in cells/s at the dataset's
  bytes per cell;
- random: ``pread``s of one 16-cell chunk (what one block of the loader reads) at random
  chunks, with 1 and with ``--depth`` reads in flight (threads), in reads/s and cells/s (× 16);
  and the same with ``O_DIRECT`` (4 KiB-aligned, bypassing the page cache) at ``--depth`` and
  4 × ``--depth`` reads in flight. The ceiling is the best of them. Each limit is the median of
  ``--rounds`` measurements (random reads: windows of ``--disk-seconds``). The disk is shared and its
  rate drifts within a run, so the direct rate at 4 × ``--depth`` is measured again for
  ``--ceiling-seconds`` just before each cold run with direct reads, and that run's cells/s is
  also reported as a fraction of it (``of_ceiling``, at the cells one read serves: a block of 16,
  one cell for true random; medians over rounds).

The dataset is larger than RAM, so `open_dataset` reads it with ``O_DIRECT`` (`omicsio_jax.storage.direct_io`)
by default. Cold runs are repeated with ``direct_io=False`` (buffered reads, each announced to the
kernel first: `omicsio_jax.records.readahead`) and with ``chunk_reader=False`` as well (records read by
ArrayRecord's own reader instead of `omicsio_jax.records.chunk_reader`); warm runs with and without
the chunk reader. Results: ``results/beyond_ram.json`` and ``results/beyond_ram.png``.

    .venv/bin/python benchmarks/bench_beyond_ram.py            # needs free disk of --ram-factor × RAM
    .venv/bin/python benchmarks/bench_beyond_ram.py --configs "csr b1024 ReadOptions(num_threads=0)" \
        --out benchmarks/results/beyond_ram_threads0.json   # the fastest 2-core setting
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
DATA = HERE / "data"
SOURCE = DATA / "ds_200k"
BIG = DATA / "ds_beyond_ram"
sys.path.insert(0, str(HERE))
from _provenance import (  # noqa: E402
    MIN_WINDOW_S,
    add_window_options,
    check_window,
    medians,
    provenance,
    require_window,
    write_result,
)

CONFIGS = {  # label: (batch_size, block_size, fetch_factor, output, ReadOptions num_threads or None)
    "dense b64": (64, 16, 64, "dense", None),
    "dense b1024": (1024, 16, 64, "dense", None),
    "csr b1024": (1024, 16, 64, "csr", None),
    "true random csr b1024": (1024, 1, 64, "csr", None),
    # the fastest setting on 2 cores (bench_annbatch.py): batches decoded on the consumer's thread
    "csr b1024 ReadOptions(num_threads=0)": (1024, 16, 64, "csr", 0),
}
ALIASES = {"csr b1024 num_threads=0": "csr b1024 ReadOptions(num_threads=0)"}  # its name before ReadOptions


def loader_kwargs(config: str) -> dict:
    """`make_loader`'s arguments of a configuration."""
    import omicsio_jax as oj

    batch_size, block_size, fetch_factor, output, threads = CONFIGS[config]
    return {
        "batch_size": batch_size,
        "sampling": oj.Block(block_size, fetch_factor),
        "output": output,
        "read": oj.ReadOptions(num_threads=threads),
    }


DEFAULT_CONFIGS = ("dense b64", "dense b1024", "csr b1024", "true random csr b1024")


def _files(dataset: Path) -> list[Path]:
    return sorted(dataset.glob("shard-*.arrayrecord")) + sorted(dataset.glob("chunks/*.npy"))


def _child(spec: dict) -> dict:
    import jax

    import omicsio_jax as oj

    sys.path.insert(0, str(HERE))
    from _peers import drop_page_cache, proc_io, proc_status

    dataset = Path(spec["dataset"])
    if spec["cold"] and not drop_page_cache(_files(dataset)):
        raise OSError("could not drop the page cache")
    ds = oj.open_dataset(
        dataset,
        readahead=spec["readahead"],
        chunk_reader=spec["chunk_reader"],
        direct_io=spec.get("direct_io"),
    )
    spec = {**spec, "direct_io": ds.chunk_reader is not None and ds.chunk_reader.direct}
    loader = oj.make_loader(ds, seed=0, num_epochs=None, **loader_kwargs(spec["config"]))
    it = iter(loader)
    for _ in range(2):
        jax.block_until_ready(next(it).x)
    read0, times0, rss0 = proc_io("read_bytes"), os.times(), proc_status("VmRSS")
    start = last = time.perf_counter()
    cells, waits = 0, []
    while last - start < spec["seconds"]:
        batch = next(it)
        jax.block_until_ready(batch.x)
        now = time.perf_counter()
        waits.append(now - last)
        cells, last = cells + CONFIGS[spec["config"]][0], now
    seconds = last - start
    times = os.times()
    user, system = times.user - times0.user, times.system - times0.system
    return {
        **spec,
        "cells_per_s": cells / seconds,
        "seconds": seconds,
        "batches": len(waits),
        "max_wait_s": max(waits),
        "cores_busy": (user + system) / seconds,
        "system_share": system / (user + system),
        "cells_per_cpu_s": cells / (user + system),
        "read_mb": (proc_io("read_bytes") - read0) / 1e6,
        "rss_start_mib": rss0 / 2**20,
        "rss_end_mib": proc_status("VmRSS") / 2**20,
        "peak_rss_mib": proc_status("VmHWM") / 2**20,
    }


def run(spec: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], check=False, capture_output=True, text=True
    )
    if proc.returncode != 0:
        return {
            **spec,
            "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode,
        }
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ensure_big(source: Path, out: Path, ram_factor: float) -> Path:
    """``out``: copies of ``source``'s full shards adding up to ``ram_factor`` × this machine's RAM."""
    from omicsio_jax.format.manifest import read_manifest

    m = read_manifest(source)
    full = sum(s.num_bytes for s in m.shards if s.num_cells == m.shard_cells)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    copies = int(np.ceil(ram * ram_factor / full))
    if (out / "manifest.json").exists() and read_manifest(out).source.get("copies") == copies:
        return out
    sys.path.insert(0, str(HERE))
    from _replicate import replicate

    print(
        f"writing {copies} copies of {source}'s full shards ({copies * full / 1e9:.1f} GB) to {out}",
        flush=True,
    )
    return replicate(source, out, copies)


def _random_reads(
    shards: list[Path],
    chunks: list[np.ndarray],
    group: int,
    *,
    threads: int,
    seconds: float,
    direct: bool = False,
) -> dict:
    """``pread``s of whole random data chunks on ``threads`` threads (as many reads in flight) for
    ``seconds``; ``direct``: with ``O_DIRECT``, each chunk widened to 4 KiB boundaries."""
    stop = time.perf_counter() + seconds
    done: list[tuple[int, int]] = []
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def reader(seed: int) -> None:
        rng, fds, n, nbytes = random.Random(seed), {}, 0, 0
        raw = np.empty(1 << 21, np.uint8)
        buf = raw[-raw.ctypes.data % 4096 :][: 1 << 20]
        while time.perf_counter() < stop:
            k = rng.randrange(len(shards))
            begin, end = (int(v) for v in chunks[k][rng.randrange(len(chunks[k]))])
            if direct:
                begin, end = begin // 4096 * 4096, -(-end // 4096) * 4096
            fd = fds.get(k) or fds.setdefault(k, os.open(shards[k], flags))
            nbytes += os.preadv(fd, [memoryview(buf[: end - begin])], begin)
            n += 1
        for fd in fds.values():
            os.close(fd)
        done.append((n, nbytes))  # list.append is atomic

    start = time.perf_counter()
    pool = [threading.Thread(target=reader, args=(1000 * threads + i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    reads, nbytes = (sum(v) for v in zip(*done, strict=True))
    return {
        "reads_per_s": reads / elapsed,
        "cells_per_s": reads * group / elapsed,
        "kib_per_read": nbytes / reads / 1024,
    }


def chunk_table(dataset: Path) -> tuple[list[Path], list[np.ndarray], int]:
    """The shard files, each shard's data chunks as (begin, end) bytes, and the cells per chunk."""
    from omicsio_jax.format.chunk_index import ChunkIndex, chunk_index_path
    from omicsio_jax.format.manifest import read_manifest

    m = read_manifest(dataset)
    group = int(m.array_record["group_size"])
    chunks = []
    for s in m.shards:
        index = ChunkIndex(np.load(dataset / chunk_index_path(s.path)), group)
        chunks.append(index.chunk_bytes(np.arange(index.num_chunks)))
    return [dataset / s.path for s in m.shards], chunks, group


def adjacent_ceiling(table: tuple[list[Path], list[np.ndarray], int], *, depth: int, seconds: float) -> dict:
    """The direct random-chunk read rate at 4 × ``depth`` in flight, measured just before a cold run:
    the disk is shared and its rate drifts by tens of percent within a run."""
    shards, chunks, group = table
    return _random_reads(shards, chunks, group, threads=4 * depth, seconds=seconds, direct=True)


def disk_limits(dataset: Path, *, depth: int, seconds: float, rounds: int) -> dict:
    """Sequential and random-chunk read rates of the cold shards (see the module docstring): each the
    median of ``rounds`` measurements, every one kept as ``<name>_runs``."""
    sys.path.insert(0, str(HERE))
    from _peers import drop_page_cache, sequential_read_limit

    from omicsio_jax.format.manifest import read_manifest

    m = read_manifest(dataset)
    shards, chunks, group = chunk_table(dataset)
    per_cell = sum(s.num_bytes for s in m.shards) / m.num_cells
    some = shards[: max(1, int(np.ceil(4e9 / m.shards[0].num_bytes)))]
    sequential = [sequential_read_limit(some) for _ in range(rounds)]
    out = {
        "bytes_per_cell": per_cell,
        "sequential_MBps": float(np.median(sequential)) / 1e6,
        "sequential_MBps_runs": [v / 1e6 for v in sequential],
        "sequential_cells_per_s": float(np.median(sequential)) / per_cell,
        "group_size": group,
        "random_window_s": seconds,
        "rounds": rounds,
    }

    def random_rate(threads: int, *, direct: bool = False, drop: bool = False) -> dict:
        runs = []
        for _ in range(rounds):
            if drop:
                drop_page_cache(shards)
            runs.append(_random_reads(shards, chunks, group, threads=threads, seconds=seconds, direct=direct))
        return medians(runs, ("reads_per_s", "cells_per_s", "kib_per_read"))

    for threads in (1, depth):
        out[f"random_qd{threads}"] = random_rate(threads, drop=True)
    for threads in (depth, 4 * depth):
        out[f"random_direct_qd{threads}"] = random_rate(threads, direct=True)
    out["random_ceiling_cells_per_s"] = max(
        v["cells_per_s"] for k, v in out.items() if k.startswith("random_") and isinstance(v, dict)
    )  # random_window_s is a number, not a rate
    return out


def warm_up(dataset: Path) -> None:
    for path in _files(dataset):
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 22):
                pass


def plot(result: dict, path: Path) -> None:
    """Cells/s per configuration, warm and cold (with and without read-ahead), beside the disk's limits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in result["rows"]))
    kinds = [
        ("warm (200k cells in RAM)", False, True, False, "tab:green"),
        ("cold, O_DIRECT (the default beyond RAM)", True, True, True, "tab:blue"),
        ("cold, buffered + read-ahead", True, True, False, "tab:gray"),
        ("cold, ArrayRecord's reader", True, False, False, "tab:purple"),
    ]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(kinds)
    for k, (label, cold, chunks, direct, color) in enumerate(kinds):
        values = [
            next(
                (
                    r.get("cells_per_s", 0)
                    for r in result["rows"]
                    if r["config"] == c
                    and r["cold"] == cold
                    and r.get("chunk_reader", True) == chunks
                    and r.get("direct_io", False) == direct
                ),
                0,
            )
            for c in configs
        ]
        ax.bar(np.arange(len(configs)) + (k - 1.5) * width, values, width, label=label, color=color)
    disk = result["disk"]
    ax.axhline(
        disk["random_ceiling_cells_per_s"],
        color="tab:red",
        ls="--",
        label="disk: random 16-cell chunks, best of the depths measured",
    )
    ax.axhline(
        disk["random_qd1"]["cells_per_s"],
        color="tab:orange",
        ls=":",
        label=f"disk: random 16-cell chunks, 1 in flight ({disk['random_qd1']['reads_per_s']:,.0f}/s)",
    )
    ax.set_xticks(np.arange(len(configs)), configs)
    ax.set_ylabel("cells / s")
    ax.set_title(
        f"{result['dataset_gb']:.1f} GB dataset ({result['cells']:,} cells) on a "
        f"{result['machine']['memory_gib']:.0f} GiB, {result['machine']['cores']}-core machine "
        f"(sequential read: {disk['sequential_cells_per_s']:,.0f} cells/s)",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    add_window_options(p, seconds=30.0)
    p.add_argument("--depth", type=int, default=16, help="reads in flight for the random-read ceiling")
    p.add_argument(
        "--ceiling-seconds",
        type=float,
        default=None,
        help=f"seconds of the direct random-read rate measured before each cold direct run (default "
        f"{MIN_WINDOW_S:g}; at least that unless --quick)",
    )
    p.add_argument(
        "--disk-seconds",
        type=float,
        default=None,
        help=f"seconds of each random-read limit, per round (default {MIN_WINDOW_S:g}; at least that "
        "unless --quick)",
    )
    p.add_argument("--ram-factor", type=float, default=1.18)
    p.add_argument("--configs", nargs="*", default=list(DEFAULT_CONFIGS), choices=[*CONFIGS, *ALIASES])
    p.add_argument("--only", choices=("cold", "warm", "both"), default="both")
    p.add_argument("--out", type=Path, default=HERE / "results" / "beyond_ram.json")
    a = p.parse_args()
    if a.child:
        print(json.dumps(_child(json.loads(a.child))))
        return
    check_window(a)
    a.configs = [ALIASES.get(c, c) for c in a.configs]
    for flag in ("ceiling_seconds", "disk_seconds"):
        if getattr(a, flag) is None:
            setattr(a, flag, a.seconds if a.quick else MIN_WINDOW_S)
        require_window(getattr(a, flag), "--" + flag.replace("_", "-"), quick=a.quick)
    big = ensure_big(SOURCE, BIG, a.ram_factor)
    size = sum(f.stat().st_size for f in big.glob("shard-*.arrayrecord"))
    limits = disk_limits(big, depth=a.depth, seconds=a.disk_seconds, rounds=a.rounds)
    print(json.dumps(limits), flush=True)
    table = chunk_table(big)
    plan = []
    for config in a.configs:
        if a.only in ("warm", "both"):
            plan += [
                {
                    "config": config,
                    "dataset": str(SOURCE),
                    "cold": False,
                    "readahead": True,
                    "chunk_reader": cr,
                }
                for cr in (True, False)
            ]
        if a.only in ("cold", "both"):
            plan += [
                {
                    "config": config,
                    "dataset": str(big),
                    "cold": True,
                    "readahead": True,
                    "chunk_reader": cr,
                    "direct_io": direct,
                }
                for cr, direct in ((True, None), (True, False), (False, False))
            ]
    runs: dict[int, list[dict]] = {i: [] for i in range(len(plan))}
    for r in range(a.rounds):
        for i, spec in enumerate(plan):
            if not spec["cold"]:
                warm_up(SOURCE)
            ceiling = None
            if spec["cold"] and spec.get("direct_io", False) is None:  # the default beyond RAM: direct reads
                ceiling = adjacent_ceiling(table, depth=a.depth, seconds=a.ceiling_seconds)
            res = run({**spec, "seconds": a.seconds})
            if ceiling is not None and "error" not in res:  # cells per chunk read: a block, at most a chunk
                per_read = min(CONFIGS[spec["config"]][1], table[2])
                res["ceiling_cells_per_s"] = ceiling["reads_per_s"] * per_read
                res["of_ceiling"] = res["cells_per_s"] / res["ceiling_cells_per_s"]
            runs[i].append(res)
            shown = (
                f"{res['cells_per_s']:>9,.0f} cells/s  {res['cores_busy']:.2f} cores  max wait {res['max_wait_s']:.2f} s  "
                f"read {res['read_mb']:,.0f} MB  RSS {res['rss_start_mib']:,.0f}->{res['rss_end_mib']:,.0f} MiB"
                if "error" not in res
                else f"ERROR {res['error']}"
            )
            print(
                f"[{r + 1}/{a.rounds}] {spec['config']:22s} {'cold' if spec['cold'] else 'warm'} "
                f"chunk_reader={spec['chunk_reader']!s:5s} direct_io={res.get('direct_io')!s:5s} {shown}"
                + (
                    f"  ({res['of_ceiling']:.2f} of the disk's {res['ceiling_cells_per_s']:,.0f} just before)"
                    if "of_ceiling" in res
                    else ""
                ),
                flush=True,
            )
    rows = []
    for i, spec in enumerate(plan):
        ok = [x for x in runs[i] if "error" not in x]
        if not ok:
            rows.append(runs[i][-1])
            continue
        row = {
            key: float(np.median([x[key] for x in ok]))
            for key in (
                "cells_per_s",
                "seconds",
                "cores_busy",
                "system_share",
                "cells_per_cpu_s",
                "read_mb",
                "max_wait_s",
                "rss_start_mib",
                "rss_end_mib",
            )
        }
        if all("of_ceiling" in x for x in ok):
            row |= {
                key: float(np.median([x[key] for x in ok])) for key in ("ceiling_cells_per_s", "of_ceiling")
            }
            row["of_ceiling_runs"] = [x["of_ceiling"] for x in ok]
        rows.append(
            {
                **spec,
                "direct_io": ok[0]["direct_io"],
                **row,
                "cells_per_s_runs": [x["cells_per_s"] for x in ok],
                "peak_rss_mib": max(x["peak_rss_mib"] for x in ok),
                "bytes_read_per_cell": float(
                    np.median([x["read_mb"] * 1e6 / (x["cells_per_s"] * x["seconds"]) for x in ok])
                ),
            }
        )
    result = {
        "benchmark": "bench_beyond_ram",
        **provenance(),
        "quick": a.quick,
        "window_s": a.seconds,
        "dataset_gb": size / 1e9,
        "cells": json.loads((big / "manifest.json").read_text())["num_cells"],
        "seconds_per_run": a.seconds,
        "rounds": a.rounds,
        "disk": limits,
        "rows": rows,
    }
    path = write_result(a.out, result, quick=a.quick)
    plot(result, path.with_suffix(".png"))
    print(json.dumps({"wrote": [str(path), str(path.with_suffix(".png"))]}))


if __name__ == "__main__":
    main()
