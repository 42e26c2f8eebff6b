"""The ``omicsio-train`` command (also ``python -m train``).

    omicsio-train out/ --label drug --model mlp --batch-size 1024 --block-size 16 --fetch-factor 256 \\
        --sampling block --epochs 1 --seed 0 --eval-where "batch = 'plate_09'" \\
        --checkpoint-dir ckpt/ --checkpoint-every 200
    omicsio-train out/ ... --checkpoint-dir ckpt/ --resume     # continues exactly where it stopped
    omicsio-train out/ ... --checkpoint-dir ckpt/ --checkpoint-format orbax   # Orbax CheckpointManager
    omicsio-train pretrain out/ --tokens geneformer --preset geneformer-v1 --checkpoint-dir pt/
    omicsio-train embed out/ --checkpoint-dir pt/ --out embeddings.npy
    omicsio-train pretrain out/ --init hf:gf-6L-30M-i2048 --vocab token_dictionary.pkl --no-special-tokens
    omicsio-train embed out/ --init hf:gf-6L-30M-i2048 --vocab token_dictionary.pkl --no-special-tokens \
        --out embeddings.npy
    omicsio-train finetune out/ --init pt/ --label cell_type --eval-where "batch = 'plate_09'" \
        --out-metrics finetune.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import omicsio_jax as oj

from ._config import CHECKPOINT_FORMATS, SAMPLINGS, TrainConfig, check_counts
from ._finetune_config import add_batch_arguments
from ._loop import fit
from ._model import MODELS
from ._paths import check_paths

PROG = "omicsio-train"
# the subcommands, as the top-level --help lists them (each has its own --help)
SUBCOMMANDS = {
    "pretrain": "pretrain a Geneformer- or scGPT-style transformer on token batches",
    "embed": "write one embedding per cell from a pretraining or published checkpoint",
    "finetune": "fine-tune a pretrained encoder with a linear head; report held-out accuracy",
}


def _parser() -> argparse.ArgumentParser:
    d = TrainConfig("", "")
    commands = "\n".join(f"  {name:<9} {what}" for name, what in SUBCOMMANDS.items())
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train a cell classifier (Equinox + optax) on a materialized dataset, with\n"
        "deterministic checkpoint/resume, JSONL metrics and held-out accuracy / macro-F1.\n\n"
        f"Subcommands ({PROG} COMMAND DATASET ..., each with its own --help):\n{commands}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Resuming refuses a checkpoint written with another dataset or other training options.",
    )
    p.add_argument("dataset", help="dataset directory written by omicsio-materialize")
    p.add_argument("--label", required=True, help="categorical obs column to predict")
    g = p.add_argument_group("model and optimizer")
    g.add_argument("--model", choices=MODELS, default=d.model, help="default: %(default)s")
    g.add_argument(
        "--hidden", type=int, default=d.hidden, help="hidden units of the mlp (default: %(default)s)"
    )
    g.add_argument(
        "--dropout",
        type=float,
        default=d.dropout,
        help="dropout after the hidden layer (default: %(default)s)",
    )
    g.add_argument("--lr", type=float, default=d.lr, help="adam learning rate (default: %(default)s)")
    g.add_argument(
        "--normalize-on-device",
        action="store_true",
        help="log1p(x / x.sum(1) * 1e4) in the jitted step, not fused in the loader",
    )
    g = add_batch_arguments(p, d)
    g.add_argument("--sampling", choices=SAMPLINGS, default=d.sampling, help="default: %(default)s")
    g.add_argument(
        "--prefetch", type=int, default=d.prefetch, help="fetches read ahead (default: %(default)s)"
    )
    g.add_argument(
        "--auto-tune",
        type=float,
        nargs="?",
        const=60.0,
        default=d.auto_tune,
        metavar="SECONDS",
        help="measure a few block sizes, fetch factors and thread counts for SECONDS (default 60) with "
        "oj.tune and train with the fastest whose batches keep 0.98 x true random's label entropy; "
        "overrides --block-size, --fetch-factor and --num-threads (a resume keeps the checkpoint's)",
    )
    g = p.add_argument_group("held-out evaluation")
    g.add_argument("--eval-batch-size", type=int, default=None, help="default: --batch-size")
    g = g.add_mutually_exclusive_group()
    g.add_argument(
        "--eval-where",
        metavar="PREDICATE",
        help="held-out cells: col = 'v', col != 'v', col IN ('a', 'b') or col NOT IN (...); values quoted, numbers or TRUE / FALSE",
    )
    g.add_argument("--eval-rows", metavar="FILE.npy", help="held-out global rows")
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="write checkpoints (and metrics.jsonl) here")
    g.add_argument(
        "--checkpoint-format",
        choices=CHECKPOINT_FORMATS,
        default=d.checkpoint_format,
        help="equinox: one directory per step, no extra dependency; orbax: an Orbax CheckpointManager "
        "(model + optimizer, Grain data state and metadata per step, saved asynchronously; "
        "needs omicsio_jax[orbax]) (default: %(default)s)",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        metavar="N",
        help="steps between checkpoints (default: only at the end)",
    )
    g.add_argument("--keep", type=int, default=d.keep, help="checkpoints kept (default: %(default)s)")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in DIR")
    g.add_argument(
        "--metrics", metavar="FILE.jsonl", help="one JSON line per step (default: DIR/metrics.jsonl)"
    )
    g.add_argument(
        "--log-every",
        type=int,
        default=d.log_every,
        metavar="N",
        help="print progress every N steps (default: %(default)s)",
    )
    g.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return p


def parse_config(argv: list[str]) -> TrainConfig:
    """The `TrainConfig` of a command line (argparse exits with status 2 on a malformed one)."""
    args = _parser().parse_args(argv)
    if args.resume and args.checkpoint_dir is None:
        _parser().error("--resume needs --checkpoint-dir")
    config = TrainConfig(**vars(args))
    config.check_ranges(flags=True)  # named by their flags, as the command line gave them
    return config


def _pretrain_parser() -> argparse.ArgumentParser:
    from ._pretrain import PretrainConfig
    from ._transformer import KINDS, PRESETS

    d = PretrainConfig("")
    p = argparse.ArgumentParser(
        prog=f"{PROG} pretrain",
        description="Pretrain a Geneformer- or scGPT-style transformer (Equinox + optax) "
        "on exact token batches of a materialized dataset, with deterministic checkpoint/resume.",
    )
    p.add_argument("dataset", help="dataset directory written by omicsio-materialize")
    g = p.add_argument_group("tokens")
    g.add_argument("--tokens", choices=KINDS, default=d.tokens, help="default: %(default)s")
    g.add_argument(
        "--max-len", type=int, default=None, help="tokens per cell (default: 2048 geneformer, 1201 scgpt)"
    )
    g.add_argument(
        "--mask-prob",
        type=float,
        default=None,
        help="share of positions masked (default: 0.15 for geneformer, as BERT; 0.4 for scgpt, as its pretraining script)",
    )
    g.add_argument(
        "--vocab",
        help="vocabulary keyed on Ensembl id or gene symbol (TSV, JSON, parquet or Geneformer pickle)",
    )
    g.add_argument("--medians", help="Geneformer gene medians keyed on Ensembl id (default: the dataset's)")
    _special_tokens_argument(g)
    g.add_argument(
        "--binning", choices=("scgpt", "tahoe"), default=d.binning, help="scgpt only (default: %(default)s)"
    )
    g.add_argument(
        "--mask-mode",
        choices=("bernoulli", "exact"),
        default=d.mask_mode,
        help="scgpt only (default: %(default)s)",
    )
    g.add_argument("--n-bins", type=int, default=d.n_bins, help="scgpt only (default: %(default)s)")
    g = p.add_argument_group("model and optimizer")
    g.add_argument("--preset", choices=tuple(PRESETS), default=d.preset, help="default: %(default)s")
    g.add_argument(
        "--dropout",
        type=float,
        default=None,
        help="the model's dropout rate, everywhere it drops (default: the preset's or the checkpoint's)",
    )
    g.add_argument(
        "--init",
        metavar="hf:DIR|scgpt:DIR",
        help="start from a published checkpoint instead of --preset: a Hugging Face BertForMaskedLM "
        "directory (Geneformer) or an scGPT directory (args.json, best_model.pt, vocab.json)",
    )
    g.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate (default: %(default)s)")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="default: %(default)s")
    g.add_argument(
        "--schedule", choices=("cosine", "linear"), default=d.schedule, help="default: %(default)s"
    )
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="default: %(default)s")
    g.add_argument("--clip-norm", type=float, default=d.clip_norm, help="default: %(default)s")
    g.add_argument(
        "--compute-dtype",
        choices=("float32", "bfloat16"),
        default=d.compute_dtype,
        help="matmul inputs (default: %(default)s)",
    )
    g.add_argument(
        "--peak-tflops", type=float, default=None, help="device peak, to report MFU (e.g. 989 for an H100)"
    )
    g = add_batch_arguments(p, d)
    g.add_argument("--prefetch", type=int, default=d.prefetch, help="default: %(default)s")
    g = p.add_argument_group("evaluation, checkpoints and logging")
    g.add_argument(
        "--probe-label",
        help="after training: linear probe of this categorical obs column on the cell "
        "embeddings (mean-pooled for Geneformer, CLS for scGPT), pretrained vs random initialization",
    )
    g.add_argument("--probe-cells", type=int, default=d.probe_cells, help="default: %(default)s")
    g.add_argument("--checkpoint-dir", metavar="DIR")
    g.add_argument(
        "--checkpoint-format",
        choices=CHECKPOINT_FORMATS,
        default=d.checkpoint_format,
        help="default: %(default)s",
    )
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="N")
    g.add_argument("--keep", type=int, default=d.keep)
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in DIR")
    g.add_argument("--metrics", metavar="FILE.jsonl", help="default: DIR/metrics.jsonl")
    g.add_argument("--log-every", type=int, default=d.log_every, metavar="N")
    g.add_argument(
        "--sync-every",
        type=int,
        default=d.sync_every,
        metavar="N",
        help="fetch the loss from the device every N steps (default: %(default)s)",
    )
    g.add_argument("--quiet", action="store_true")
    return p


def _special_tokens_argument(g) -> None:
    g.add_argument(
        "--no-special-tokens",
        dest="special_tokens",
        action="store_false",
        help="geneformer: rows without CLS and EOS (Geneformer V1 and its token dictionary)",
    )


def parse_pretrain_config(argv: list[str]):
    """The `PretrainConfig` of an ``omicsio-train pretrain`` command line."""
    from ._pretrain import PretrainConfig

    p = _pretrain_parser()
    args = p.parse_args(argv)
    if args.resume and args.checkpoint_dir is None:
        p.error("--resume needs --checkpoint-dir")
    return PretrainConfig(**vars(args))


def _pretrain(argv: list[str]) -> int:
    from ._pretrain import pretrain

    config = parse_pretrain_config(argv)
    try:
        result = pretrain(config)
    except KeyboardInterrupt:
        return _interrupted(config.checkpoint_dir)
    if result.preempted:
        return _preempted_exit(result.checkpoint)
    if not config.quiet and result.history:
        print(
            f"done: step {result.num_steps}; median step {1e3 * result.step_time_s:.1f} ms, "
            f"{100 * result.data_wait_fraction:.1f}% of it waiting for data"
        )
    return 0


def _embed(argv: list[str]) -> int:
    import numpy as np

    from ._embed import embed, load_encoder
    from ._transformer import KINDS

    p = argparse.ArgumentParser(
        prog=f"{PROG} embed",
        description="Write one cell embedding per cell (row order, aligned with the dataset's cell ids) "
        "from a pretraining checkpoint or a published one. Tokens are never masked.",
    )
    p.add_argument("dataset")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--checkpoint-dir", metavar="DIR", help="an omicsio-train pretrain directory")
    g.add_argument("--init", metavar="hf:DIR|scgpt:DIR", help="a published checkpoint (Geneformer or scGPT)")
    p.add_argument("--out", required=True, metavar="FILE.npy", help="float32 (cells, width)")
    p.add_argument(
        "--pool",
        choices=("mean", "cls"),
        default=None,
        help="mean: the last hidden states averaged over the cell's gene tokens (Geneformer's cell "
        "embedding); cls: position 0 (scGPT's) (default: mean for geneformer, cls for scgpt)",
    )
    p.add_argument("--batch-size", type=int, default=None, help="default: the run's (64 with --init)")
    g = p.add_argument_group("tokens (with --init only: a --checkpoint-dir run tokenizes as it did)")
    g.add_argument("--tokens", choices=KINDS, default=None, help="default: the checkpoint's family")
    g.add_argument("--max-len", type=int, default=None, help="default: 2048 geneformer, 1201 scgpt")
    g.add_argument(
        "--vocab",
        help="the checkpoint's token dictionary keyed on Ensembl id or gene symbol (scgpt:DIR: its vocab.json)",
    )
    g.add_argument("--medians", help="Geneformer gene medians keyed on Ensembl id (default: the dataset's)")
    _special_tokens_argument(g)
    args = p.parse_args(argv)
    check_counts(args, (), ("batch_size", "max_len"), flags=True)
    check_paths(args)
    ds = oj.open_dataset(args.dataset)
    model, config, source, coverage = load_encoder(
        args.checkpoint_dir or args.init,
        ds,
        flag="--init" if args.checkpoint_dir is None else "--checkpoint-dir",
        tokens=args.tokens,
        max_len=args.max_len,
        vocab=args.vocab,
        medians=args.medians,
        special_tokens=args.special_tokens,
    )
    if coverage is not None:
        print(coverage)
    emb = embed(model, ds, config, batch_size=args.batch_size, pool=args.pool)
    out = Path(args.out)
    out = out if out.suffix == ".npy" else out.with_name(out.name + ".npy")  # as np.save names it
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, emb)
    print(
        f"{out}: {emb.shape[0]:,} cells × {emb.shape[1]} ({source}), "
        f"rows aligned with {ds.path}/cell_ids.parquet"
    )
    return 0


def _finetune(argv: list[str]) -> int:
    from ._finetune import finetune
    from ._finetune_config import parse_finetune_config

    finetune(parse_finetune_config(argv, PROG))
    return 0


def _interrupted(checkpoint_dir: str | None) -> int:
    """Exit status 130 after Ctrl-C, saying what a training run can do next: ``--resume`` needs the
    ``--checkpoint-dir`` it saved to, and a run without one saved nothing to resume."""
    if checkpoint_dir is None:
        where = "no --checkpoint-dir, nothing was saved"
    else:
        where = f"continue from the latest checkpoint in {checkpoint_dir} with --resume"
    print(f"{PROG}: interrupted; {where}", file=sys.stderr)
    return 130


def _preempted_exit(checkpoint) -> int:
    """Exit status after a SIGTERM: 0 when the stopping step was checkpointed (the scheduler may
    requeue the same command with --resume), 143 (killed by SIGTERM) when nothing was saved."""
    if checkpoint is None:
        print(f"{PROG}: stopped by SIGTERM without --checkpoint-dir: nothing was saved", file=sys.stderr)
        return 128 + 15
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code. User mistakes print ``omicsio-train: error: ...``, status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"pretrain": _pretrain, "embed": _embed, "finetune": _finetune}
    if argv[:1] and argv[0] in commands:
        try:
            return commands[argv[0]](argv[1:])
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 2
        except oj.OmicsIOError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # embed and finetune save nothing to resume (pretrain says its own)
            print(f"{PROG}: interrupted", file=sys.stderr)
            return 130
    try:
        config = parse_config(argv)
    except SystemExit as e:  # argparse: usage error (2) or --help (0)
        return e.code if isinstance(e.code, int) else 2
    except oj.OmicsIOError as e:  # a count or rate out of range, named by its flag
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        result = fit(config)
    except oj.OmicsIOError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(config.checkpoint_dir)
    if result.preempted:
        return _preempted_exit(result.checkpoint)
    if not config.quiet and result.history:
        print(
            f"done: step {result.num_steps}; median step {1e3 * result.step_time_s:.1f} ms, "
            f"{100 * result.data_wait_fraction:.1f}% of it waiting for data"
        )
    return 0
