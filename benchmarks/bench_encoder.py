"""The pretraining step of the tiny preset with its encoder unrolled (how it runs) against the same
encoder scanned (``lax.scan``, how stacks deeper than ``train._layers.UNROLL_LAYERS`` run), in the
same rounds.

Each round runs one fresh process per (model, encoder) pair, alternating which encoder goes first.
A process builds the tiny model (scGPT at ``max_len`` 64, Geneformer at 32, without dropout: as the
learning tests train them; ``--dropout`` for another rate) over a vocabulary of ``--vocab`` tokens, makes 16 random token batches of ``--batch``
cells (fixed seed), compiles `train.make_pretrain_step` with AdamW (timed apart: ``compile_s``), then
runs 4 more steps (the loss after these 5 is recorded: the same, bit for bit, in both encoders) and
then steps until at least ``--seconds`` have passed, waiting for each. Figures: milliseconds per
step and cells per second, medians of the rounds.

    python benchmarks/bench_encoder.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _provenance import (  # noqa: E402
    add_window_options,
    check_window,
    compare,
    medians,
    provenance,
    run_json,
    window,
    write_result,
)

KINDS = {"scgpt": 64, "geneformer": 32}  # max_len of each model, as the learning tests train them
ENCODERS = ("unrolled", "scanned")


def _batch(kind: str, rng, cells: int, length: int, vocab: int) -> dict:
    """A token batch of ``kind`` with the loader's shapes and masking rates (random tokens, no padding)."""
    import numpy as np

    tokens = rng.integers(3, vocab, (cells, length)).astype(np.int32)
    if kind == "geneformer":
        labelled = rng.random((cells, length)) < 0.15
        labelled[:, 0] = False
        return {
            "input_ids": tokens,
            "attention_mask": np.ones((cells, length), bool),
            "labels": np.where(labelled, tokens, -100).astype(np.int32),
        }
    values = rng.integers(1, 51, (cells, length)).astype(np.float32)
    mask = rng.random((cells, length)) < 0.4
    mask[:, 0] = False
    return {
        "gene_ids": tokens,
        "values": values,
        "masked_values": np.where(mask, -1.0, values).astype(np.float32),
        "mask": mask,
        "pad_mask": np.zeros((cells, length), bool),
    }


def child(kind: str, encoder: str, cells: int, vocab: int, dropout: float, seconds: float) -> dict:
    """One (model, encoder) pair in this process: compile time, then steps for ``seconds``."""
    import time

    import equinox as eqx
    import jax
    import numpy as np

    from train import _layers
    from train._transformer import make_optimizer, make_pretrain_model, make_pretrain_step

    if encoder == "scanned":
        _layers.UNROLL_LAYERS = 0  # read while tracing: this process's steps scan the layers
    length = KINDS[kind]
    rng = np.random.default_rng(0)
    batches = [_batch(kind, rng, cells, length, vocab) for _ in range(16)]
    model = _layers.with_dropout(
        make_pretrain_model(kind, "tiny", vocab, length, key=jax.random.key(0)), dropout
    )
    optimizer = make_optimizer(1e-3, warmup_steps=10, total_steps=100_000)
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    step, key = make_pretrain_step(optimizer), jax.random.key(1)
    start = time.perf_counter()
    model, state, loss = step(model, state, batches[0], key, np.asarray(0, np.uint32))
    jax.block_until_ready(loss)
    compile_s = time.perf_counter() - start
    for done in range(1, 5):  # the loss after 5 steps: the same, bit for bit, whichever the encoder
        model, state, loss = step(model, state, batches[done], key, np.asarray(done, np.uint32))
    loss_5 = float(loss)
    done = 5

    def one() -> int:
        nonlocal model, state, loss, done
        model, state, loss = step(model, state, batches[done % 16], key, np.asarray(done, np.uint32))
        jax.block_until_ready(loss)
        done += 1
        return cells

    timed = window(one, seconds=seconds)
    return {
        "compile_s": compile_s,
        "ms_per_step": 1000 * timed.seconds / timed.steps,
        "cells_per_s": timed.cells_per_s,
        "seconds": timed.seconds,
        "steps": timed.steps,
        "loss_after_5_steps": loss_5,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=32, help="cells per step (default 32)")
    p.add_argument("--vocab", type=int, default=2003, help="token vocabulary (default 2003)")
    p.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="dropout rate at every site (default 0, as the learning tests)",
    )
    p.add_argument("--out", default=str(HERE / "results" / "encoder.json"))
    add_window_options(p)
    args = p.parse_args()
    if args.child:
        kind, encoder, cells, vocab, dropout, seconds = args.child
        print(json.dumps(child(kind, encoder, int(cells), int(vocab), float(dropout), float(seconds))))
        return
    check_window(args)
    runs: dict = {(kind, encoder): [] for kind in KINDS for encoder in ENCODERS}
    for r in range(args.rounds):
        for kind in KINDS:
            for encoder in ENCODERS if r % 2 == 0 else ENCODERS[::-1]:
                child_args = [
                    __file__,
                    "--child",
                    kind,
                    encoder,
                    args.batch,
                    args.vocab,
                    args.dropout,
                    args.seconds,
                ]
                out = run_json([str(a) for a in child_args])
                runs[kind, encoder].append(out)
                print(f"round {r + 1}: {kind} {encoder} {out['ms_per_step']:.2f} ms per step", flush=True)
    rows, comparisons = {}, []
    for kind in KINDS:
        for encoder in ENCODERS:
            label = f"{kind} tiny, encoder {encoder}"
            rs = runs[kind, encoder]
            rows[label] = {
                "label": label,
                **medians(rs, ("cells_per_s", "ms_per_step", "compile_s", "seconds")),
                "loss_after_5_steps_runs": [r["loss_after_5_steps"] for r in rs],
            }
        ours, peer = rows[f"{kind} tiny, encoder unrolled"], rows[f"{kind} tiny, encoder scanned"]
        comparisons.append(compare(f"{kind} tiny training step: unrolled ÷ scanned", ours, peer))
    result = {
        "benchmark": "bench_encoder",
        **provenance(),
        "rounds": args.rounds,
        "window_s": args.seconds,
        "quick": args.quick,
        "batch_cells": args.batch,
        "vocab": args.vocab,
        "dropout": args.dropout,
        "max_len": KINDS,
        "rows": list(rows.values()),
        "comparisons": [c for c in comparisons if c],
    }
    write_result(args.out, result, quick=args.quick)


if __name__ == "__main__":
    main()
