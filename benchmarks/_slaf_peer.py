"""SLAF's tokenized dataloader (PyPI ``slafdb``) as a benchmark peer, in its own virtualenv.

Run with ``.venv-slaf/bin/python`` (made by ``scripts/setup-slaf.sh``); this script never imports
omicsio_jax::

    python benchmarks/_slaf_peer.py convert INPUT.h5ad OUT.slaf
    python benchmarks/_slaf_peer.py run OUT.slaf --tokenizer geneformer --batch-size 64 \\
        --max-len 2048 --seconds 10 --warmup 10 [--rounds 3] [--seed 0]

``convert`` is what ``slaf convert INPUT OUT`` does: ``SLAFConverter()`` with its defaults
(chunked, 5,000 cells per chunk, uint16 values when X holds integer counts).

``run`` iterates ``slaf.ml.dataloaders.SLAFDataLoader`` and prints one JSON line. Config: SLAF's
own defaults, i.e. its "foundation model training" config — Mixture of Scanners
(``use_mixture_of_scanners=True, by_fragment=True, n_scanners=16``, ``prefetch_batch_size``
4,194,304 COO rows per fragment read), whose chunks are shuffled cell by cell (``RandomShuffle``)
before tokenizing; that is SLAF's only random mode and what its docs recommend for training
(the sequential mode is its "maximum throughput, lowest entropy" option). ``verbose=False`` only
silences its prints. ``--max-len`` is the width of the token rows, as in omicsio_jax's outputs:
SLAF's ``max_genes`` is that width for Geneformer and width − 2 for scGPT (CLS + genes + SEP).

Seeds: ``SLAFDataLoader`` fixes its shuffle seed at 42 (it passes ``seed=42`` to its dataset; the
chunk shuffle reseeds Python's ``random`` with ``42 + chunk + 10000 * epoch``). The scanners are
drawn with numpy's global RNG, which ``--seed`` seeds before each round, so every round does the
same work.

Timing, per round: a fresh loader (its producer thread starts in the constructor and tokenizes
whole chunks, ``cells_per_chunk`` in the output, ahead of the consumer), ``--warmup`` batches
discarded, then batches are drained untimed until every tokenized cell has been delivered (a chunk
boundary), then batches are timed for at least ``--seconds`` (the parent's window, 10 s by
default, as omicsio_jax's loader is timed), the window extended to the next chunk boundary (as the
scDataset peer ends on whole fetches): otherwise the window would mostly time slicing of cells
tokenized before the clock started. Cells are the rows delivered (the last batch of each chunk is
short); ``batches`` is how many were timed. ``cells_per_s`` is the median over rounds;
``end_to_end_cells_per_s`` counts every delivered cell from the constructor call on. The loader
gets enough epochs for the warm-up and a window served at up to `RATE_BOUND` cells/s, plus three:
at the end of its last epoch SLAF's iterator waits ~70 s before it stops (a loader that runs out
is reported as stopping early, not timed); the producer is stopped after the window.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from importlib.metadata import version
from typing import Any

TOKENIZERS = ("geneformer", "scgpt")
RATE_BOUND = 200_000  # cells/s that SLAF's loader is taken never to exceed: sizes its number of epochs


def convert(input_path: str, output_path: str) -> None:
    """``slaf convert INPUT OUT``: SLAF's converter with the CLI's defaults."""
    from slaf.data.converter import SLAFConverter

    if not os.path.exists(input_path):
        raise SystemExit(f"_slaf_peer convert: input not found: {input_path}")
    if os.path.exists(output_path):
        raise SystemExit(f"_slaf_peer convert: {output_path} already exists; remove it or pick another path")
    SLAFConverter().convert(input_path, output_path)


def _max_genes(tokenizer: str, max_len: int) -> int:
    """SLAF's ``max_genes`` that gives rows of ``max_len`` tokens (scGPT adds CLS and SEP)."""
    max_genes = max_len - 2 if tokenizer == "scgpt" else max_len
    if max_genes < 1:
        raise SystemExit(f"_slaf_peer run: --max-len {max_len} leaves no gene for {tokenizer}; use e.g. 2048")
    return max_genes


def _round(slaf_array: Any, args: argparse.Namespace, num_epochs: int) -> dict[str, Any]:
    """One fresh loader: discard ``args.warmup`` batches, time batches for at least ``args.seconds``."""
    import numpy as np
    from slaf.ml.dataloaders import SLAFDataLoader

    np.random.seed(args.seed)  # the scanners' draws (np.random.choice in SLAF's producer thread)
    random.seed(args.seed)  # SLAF reseeds it per chunk; seeded here so nothing is left to chance
    start = time.perf_counter()
    loader = SLAFDataLoader(
        slaf_array,
        tokenizer_type=args.tokenizer,
        batch_size=args.batch_size,
        max_genes=_max_genes(args.tokenizer, args.max_len),
        n_epochs=num_epochs,
        verbose=False,
    )
    prefetcher = loader._dataset.prefetcher  # to read its counters and stop its thread
    batches = iter(loader)

    def take() -> tuple[int, int]:
        return _shape(next(batches, None), args)

    def behind() -> int:  # cells tokenized by the producer thread and not yet delivered
        return prefetcher.total_cells_added - delivered

    try:
        delivered = sum(take()[0] for _ in range(args.warmup))
        while behind() > 0:  # drain to a chunk boundary: the producer has nothing stored up
            delivered += take()[0]
        drained = delivered
        t0 = time.perf_counter()
        shapes: list[tuple[int, int]] = []
        # at least --seconds, and end on a chunk boundary too: whole chunks in the window
        while time.perf_counter() - t0 < args.seconds or behind() > 0:
            shapes.append(take())
            delivered += shapes[-1][0]
        t1 = time.perf_counter()
    finally:
        prefetcher.stop()  # sets should_stop; the thread ends after the chunk it is working on
        if prefetcher.worker_thread is not None:
            prefetcher.worker_thread.join()  # so no producer of this round runs into the next
    return {"cells": delivered - drained, "batches": len(shapes), "seconds": t1 - t0,
            "shape": [args.batch_size, shapes[0][1]], "end_to_end": delivered / (t1 - start),
            "cells_per_chunk": prefetcher.total_cells_added / max(prefetcher.tokenize_count, 1)}  # fmt: skip


def _shape(batch: dict[str, Any] | None, args: argparse.Namespace) -> tuple[int, int]:
    """``(rows, width)`` of one batch's ``input_ids``, checked (SLAF can end early without an error)."""
    if batch is None:
        raise SystemExit("_slaf_peer run: SLAF's loader stopped early (see its log above); no timing")
    ids = batch["input_ids"]
    rows, width = ids.shape
    if not 1 <= rows <= args.batch_size or width != args.max_len:
        want = f"(≤ {args.batch_size}, {args.max_len})"
        msg = f"_slaf_peer run: got a batch of shape {tuple(ids.shape)}, want {want}"
        raise SystemExit(msg)
    return rows, width


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Median cells/s of ``args.rounds`` rounds over SLAF's tokenized loader."""
    from loguru import logger
    from slaf import SLAFArray

    # SLAF logs banners and progress at INFO through loguru; keep warnings, and the INFO line its
    # producer thread logs when it dies (e.g. "No module named 'psutil'") before the loader ends.
    logger.remove()
    logger.add(sys.stderr, filter=lambda r: r["level"].no >= 30 or r["message"].startswith("Error loading"))
    if not os.path.isdir(args.dataset):
        raise SystemExit(f"_slaf_peer run: no SLAF dataset at {args.dataset}; make one with `convert`")
    slaf_array = SLAFArray(args.dataset)
    slaf_array.wait_for_metadata()
    num_cells = int(slaf_array.shape[0])
    # Enough epochs for the warm-up and a window at up to RATE_BOUND cells/s; spare epochs for the drain
    # and the round-up to chunk boundaries (a chunk is at most an epoch).
    num_epochs = math.ceil((args.warmup * args.batch_size + args.seconds * RATE_BOUND) / num_cells) + 3
    runs = [_round(slaf_array, args, num_epochs) for _ in range(args.rounds)]
    rates = [r["cells"] / r["seconds"] for r in runs]
    return {
        "peer": "slaf", "tokenizer": args.tokenizer, "batch_size": args.batch_size,
        "cells_per_s": statistics.median(rates), "cells_per_s_runs": rates,
        "batches": statistics.median_low(r["batches"] for r in runs),
        "batches_runs": [r["batches"] for r in runs],
        "cells_runs": [r["cells"] for r in runs], "shape": runs[-1]["shape"],
        "window_s": args.seconds, "seconds_runs": [r["seconds"] for r in runs],
        "warmup": args.warmup, "rounds": args.rounds,
        "max_len": args.max_len, "max_genes": _max_genes(args.tokenizer, args.max_len),
        "end_to_end_cells_per_s": statistics.median(r["end_to_end"] for r in runs),
        "cells_per_chunk": statistics.median(r["cells_per_chunk"] for r in runs),
        "num_cells": num_cells, "n_epochs": num_epochs, "seed": args.seed, "shuffle_seed": 42,
        "config": "SLAFDataLoader defaults: mixture of scanners (n_scanners=16, "
                  "prefetch_batch_size=4194304), RandomShuffle per chunk",
        "slaf_version": version("slafdb"), "torch_version": version("torch"),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="SLAF's tokenized dataloader as a benchmark peer.")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="h5ad -> SLAF with SLAF's own converter")
    conv.add_argument("input")
    conv.add_argument("output")
    bench = sub.add_parser("run", help="time SLAFDataLoader; prints one JSON line")
    bench.add_argument("dataset")
    bench.add_argument("--tokenizer", choices=TOKENIZERS, default="geneformer")
    bench.add_argument("--batch-size", type=int, default=64)
    bench.add_argument("--max-len", type=int, default=2048)
    bench.add_argument("--seconds", type=float, default=10.0, help="the timed window of a round (at least)")
    bench.add_argument("--warmup", type=int, default=5)
    bench.add_argument("--rounds", type=int, default=3)
    bench.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "convert":
        convert(args.input, args.output)
        return 0
    for name in ("batch_size", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if not args.seconds > 0:
        parser.error(f"--seconds must be positive, got {args.seconds}")
    if args.warmup < 0:
        parser.error(f"--warmup must be ≥ 0, got {args.warmup}")
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
