"""`tune`: measure a few loader settings on this machine and dataset, keep the fastest whose
minibatches are as label-diverse as true random sampling's.

Two steps. **Entropy, for every (block_size, fetch_factor) of the grid, without reading a cell**:
the sampling plan says which rows each minibatch of epoch 0 holds, so the mean plug-in entropy of
``label`` over the first ``entropy_batches`` minibatches is exact for this dataset's cell order and
seed; it is divided by the same mean over minibatches drawn uniformly at random (true random
sampling, the reference; its expected value is Theorem 3.1's ``upper`` in `entropy_bounds`). A
setting meets the target when that ratio is ≥ ``entropy_target``. **Throughput, for a few
settings**: for each fetch factor, the largest block size that meets the target (larger blocks
mean fewer, longer reads: faster, and the entropy falls as blocks grow, so the smaller ones are
slower for no gain), each with each candidate thread count; every one runs the real loader for its
share of ``seconds`` (its first batch, which pays for the first fetch, not timed) and is scored in
cells per second. The result is the fastest, and the table of everything computed.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from collections.abc import Sequence

import jax
import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.core.progress import progress_bar
from omicsio_jax.dataset.dataset import Dataset
from omicsio_jax.dataset.obs import Categorical
from omicsio_jax.loaders.disk import make_loader
from omicsio_jax.loaders.options import MAX_DEFAULT_THREADS, ReadOptions, is_count, usable_cores
from omicsio_jax.sampling.entropy import minibatch_entropy
from omicsio_jax.sampling.options import Block
from omicsio_jax.sampling.plan import SamplingPlan

BLOCK_SIZES = (1, 4, 16, 64, 256, 1024)
FETCH_FACTORS = (4, 16, 64, 256)
_RANDOM_STREAM = 0x7E57  # the true-random reference's own RNG stream, apart from the loader's


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """What `tune` chose (``block_size``, ``fetch_factor``, ``num_threads``; `loader_kwargs` passes
    them on, with the other ``read`` knobs tune ran with) and every row it computed: ``table`` has
    one dict per setting with its entropy ratio against true random and, for the settings it timed,
    ``cells_per_s``, ``cells_per_cpu_s`` and the ``prefetch`` and ``decode_threads`` in force."""

    block_size: int
    fetch_factor: int
    num_threads: int
    cells_per_s: float
    entropy_ratio: float
    entropy_target: float
    random_entropy: float
    table: tuple[dict, ...]
    read: ReadOptions = ReadOptions()  # tune's ``read=`` (its num_threads aside: each setting's own)

    def loader_kwargs(self, read: ReadOptions | None = None) -> dict:
        """The chosen ``sampling`` (`Block`) and ``read`` for `make_loader` / `GrainSource`: the chosen
        ``num_threads``, the knobs of ``read`` and, where it leaves them None, those tune ran with
        (knobs left None everywhere are derived by `make_loader` as they were for the timed loader,
        ``decode_threads`` from the chosen ``num_threads``: `default_decode_threads`)."""
        ran = self.read
        read = ReadOptions.of(read).with_defaults(prefetch=ran.prefetch, decode_threads=ran.decode_threads)
        return {
            "sampling": Block(self.block_size, self.fetch_factor),
            "read": dataclasses.replace(read, num_threads=self.num_threads),
        }

    def __str__(self) -> str:
        head = f"{'block':>6} {'fetch':>6} {'threads':>7} {'entropy/random':>14} {'cells/s':>10} {'cells/CPU-s':>11}"
        lines = [head]
        for r in self.table:
            chosen = (r["block_size"], r["fetch_factor"], r.get("num_threads")) == (
                self.block_size,
                self.fetch_factor,
                self.num_threads,
            )
            speed = f"{r['cells_per_s']:>10,.0f} {r['cells_per_cpu_s']:>11,.0f}" if "cells_per_s" in r else ""
            threads = r.get("num_threads")
            lines.append(
                f"{r['block_size']:>6} {r['fetch_factor']:>6} {'' if threads is None else threads:>7} "
                f"{r['entropy_ratio']:>14.4f} {speed}{'  <- chosen' if chosen else ''}"
            )
        return "\n".join(lines)


def _check_positive(name: str, values: Sequence[int], what: str) -> None:
    bad = [v for v in values if not is_count(v, 1)]
    if bad or len(values) == 0:
        shown = values[0] if name in ("batch_size", "entropy_batches") else list(values)
        msg = f"{name} must be {what}; got {shown!r}"
        raise OmicsIOError(msg)


def _labels(ds: Dataset, label: str) -> np.ndarray:
    column = ds.obs.get(label)
    if not isinstance(column, Categorical):
        kind = "missing" if column is None else "numeric"
        choices = ", ".join(k for k, v in ds.obs.items() if isinstance(v, Categorical))
        msg = (
            f"label {label!r} must be a categorical obs column of {ds.path} ({kind}); categorical: {choices}"
        )
        raise OmicsIOError(msg)
    return column.codes


def plan_entropy(labels: np.ndarray, plan: SamplingPlan, num_batches: int) -> float:
    """Mean plug-in entropy (bits) of ``labels`` over the first ``num_batches`` minibatches the
    loader serves in epoch 0 under ``plan`` (one host), computed from the plan alone."""
    order, batches = plan.epoch_order(0), []
    for index in range(plan.fetches_per_epoch):
        rows = plan.serving_rows(plan.fetch(0, index, 0, order)).reshape(-1, plan.local_batch)
        batches.extend(labels[r[r >= 0]] for r in rows)
        if len(batches) >= num_batches:
            break
    return float(minibatch_entropy(batches[:num_batches]).mean())


def random_entropy(
    labels: np.ndarray, rows: np.ndarray, batch_size: int, num_batches: int, seed: int
) -> float:
    """The same mean over ``num_batches`` minibatches of ``rows`` drawn uniformly at random."""
    rng = np.random.default_rng([seed, _RANDOM_STREAM])
    batches = [labels[rng.choice(rows, size=batch_size, replace=False)] for _ in range(num_batches)]
    return float(minibatch_entropy(batches).mean())


def _measure(ds: Dataset, seconds: float, *, batch_size: int, seed: int, **kwargs) -> dict:
    loader = make_loader(ds, batch_size=batch_size, seed=seed, num_epochs=None, **kwargs)
    read = loader.read  # the knobs in force, the defaults derived
    try:
        batches = iter(loader)
        jax.block_until_ready(next(batches).x)  # the first fetch: not steady state
        cells, wall, cpu = 0, time.perf_counter(), time.process_time()
        while True:
            jax.block_until_ready(next(batches).x)
            cells += batch_size
            elapsed = time.perf_counter() - wall
            if elapsed >= seconds and cells >= 4 * batch_size:
                break
        cpu = time.process_time() - cpu
    finally:
        loader.close()
    return {
        "cells_per_s": cells / elapsed,
        "cells_per_cpu_s": cells / max(cpu, 1e-9),
        "timed_cells": cells,
        "prefetch": read.prefetch,
        "decode_threads": read.decode_threads,
    }


def tune(
    ds: Dataset,
    batch_size: int,
    *,
    label: str,
    entropy_target: float = 0.98,
    seconds: float = 60.0,
    block_sizes: Sequence[int] = BLOCK_SIZES,
    fetch_factors: Sequence[int] = FETCH_FACTORS,
    num_threads: Sequence[int] | None = None,
    rows: np.ndarray | Sequence[int] | None = None,
    entropy_batches: int = 256,
    seed: int = 0,
    progress: bool = True,
    **loader_kwargs,
) -> TuneResult:
    """The fastest (block_size, fetch_factor, num_threads) of a small grid, measured on this machine
    and dataset, whose minibatches' ``label`` entropy is ≥ ``entropy_target`` × true random's.

    >>> result = oj.tune(ds, 1024, label="batch", seconds=60)             # doctest: +SKIP
    >>> print(result)                                                      # the table it measured
    >>> loader = oj.make_loader(ds, batch_size=1024, **result.loader_kwargs(), seed=0)   # doctest: +SKIP

    ``seconds`` is shared among the timed settings (each gets at least its first batch plus four);
    ``num_threads`` defaults to 0 (batches decoded on the consumer's thread), 1, 2 and (on bigger
    machines) the usable cores up to 8; ``rows``
    restricts sampling as in `make_loader`; other keyword arguments (``output``, ``obs``,
    ``placement``, ``read``: its ``num_threads`` is what is tuned) go to `make_loader` unchanged, so
    the measure is of the loader you will run. See the module docstring for how entropy and speed are measured.
    """
    if "sampling" in loader_kwargs:
        msg = "tune chooses the sampling (oj.Block(block_size, fetch_factor)): do not pass sampling="
        raise OmicsIOError(msg)
    if "num_epochs" in loader_kwargs:
        msg = "tune runs each setting's loader for its share of seconds (num_epochs=None): do not pass num_epochs="
        raise OmicsIOError(msg)
    _check_positive("batch_size", [batch_size], "a positive integer, e.g. 1024")
    _check_positive("entropy_batches", [entropy_batches], "a positive integer (default 256)")
    _check_positive("block_sizes", block_sizes, "non-empty, of positive integers, e.g. (4, 16, 64)")
    _check_positive("fetch_factors", fetch_factors, "non-empty, of positive integers, e.g. (16, 64)")
    if not (isinstance(seconds, numbers.Real) and 0 <= seconds < math.inf):
        msg = (
            f"seconds must be a finite number ≥ 0 (the time shared among the timed settings), got {seconds!r}"
        )
        raise OmicsIOError(msg)
    if num_threads is not None and len(num_threads) == 0:
        msg = (
            "num_threads must list at least one thread count to time, e.g. (0, 2), or be None (the defaults)"
        )
        raise OmicsIOError(msg)
    read = ReadOptions.of(loader_kwargs.pop("read", None))
    if not 0 < entropy_target <= 1:
        msg = (
            f"entropy_target must be in (0, 1] (a fraction of true random's entropy), got {entropy_target!r}"
        )
        raise OmicsIOError(msg)
    labels = _labels(ds, label)
    rows = np.arange(ds.num_cells, dtype=np.int64) if rows is None else np.unique(ds.check_rows(rows))
    if len(rows) < batch_size:
        msg = f"{len(rows):,} cells make no batch of {batch_size}"
        raise OmicsIOError(msg)
    if num_threads is None:
        num_threads = sorted({0, 1, 2, min(usable_cores(), MAX_DEFAULT_THREADS)})
    reference = random_entropy(labels, rows, batch_size, entropy_batches, seed)
    table: list[dict] = []
    for fetch in fetch_factors:
        if fetch * batch_size > len(rows):
            continue  # one fetch would hold every cell: the largest fetch that fits stands for it
        for block in block_sizes:
            if block > fetch * batch_size:
                continue
            plan = SamplingPlan(rows, batch_size, block, fetch, seed)
            ratio = plan_entropy(labels, plan, entropy_batches) / reference if reference > 0 else 1.0
            table.append(
                {
                    "block_size": block,
                    "fetch_factor": fetch,
                    "entropy_ratio": ratio,
                    "meets_target": ratio >= entropy_target,
                }
            )
    if not table:
        msg = (
            f"no setting of block_sizes {list(block_sizes)} × fetch_factors {list(fetch_factors)} fits: a fetch "
            f"(fetch_factor × batch_size {batch_size}) must hold a whole block and at most the {len(rows):,} cells"
        )
        raise OmicsIOError(msg)
    candidates = []
    for fetch in sorted({r["fetch_factor"] for r in table}):
        ok = [r for r in table if r["fetch_factor"] == fetch and r["meets_target"]]
        if ok:
            candidates.append(max(ok, key=lambda r: r["block_size"]))
    if not candidates:
        best = max(table, key=lambda r: r["entropy_ratio"])
        msg = (
            f"no setting reaches {entropy_target:.3f} × true random's {label!r} entropy (best: block_size "
            f"{best['block_size']}, fetch_factor {best['fetch_factor']}: {best['entropy_ratio']:.4f}); "
            "pass smaller block_sizes, larger fetch_factors or a lower entropy_target"
        )
        raise OmicsIOError(msg)
    timed = [dict(c, num_threads=t) for c in candidates for t in num_threads]
    share = seconds / len(timed)
    for row in progress_bar(timed, desc="tune", unit="setting", progress=progress):
        row.update(
            _measure(
                ds,
                share,
                batch_size=batch_size,
                seed=seed,
                rows=rows,
                sampling=Block(row["block_size"], row["fetch_factor"]),
                read=dataclasses.replace(read, num_threads=row["num_threads"]),
                **loader_kwargs,
            )
        )
    best = max(timed, key=lambda r: r["cells_per_s"])
    timed_keys = {(r["block_size"], r["fetch_factor"]) for r in timed}
    rest = [r for r in table if (r["block_size"], r["fetch_factor"]) not in timed_keys]
    return TuneResult(
        best["block_size"],
        best["fetch_factor"],
        best["num_threads"],
        best["cells_per_s"],
        best["entropy_ratio"],
        entropy_target,
        reference,
        tuple(timed + rest),
        read,
    )
