"""`FinetuneConfig`: the options of ``omicsio-train finetune``, and its command-line parser."""

from __future__ import annotations

import argparse
import dataclasses

from ._config import check_counts
from ._errors import TrainError
from ._paths import check_paths
from ._transformer import KINDS

POOLS = ("mean", "cls")


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """A fine-tuning run. ``init``: ``"hf:DIR"``, ``"scgpt:DIR"`` or an ``omicsio-train pretrain``
    checkpoint directory; ``label``: the categorical obs column to predict; ``freeze``: train the
    linear head only (the encoder's weights stay as loaded), else the whole network, the head at
    ``lr`` and the encoder at ``encoder_lr``; ``pool``: the cell embedding the head reads (default:
    ``"mean"`` for Geneformer, ``"cls"`` for scGPT). The held-out cells are ``eval_where`` or
    ``eval_rows`` (as `TrainConfig`'s); training uses the others. ``tokens``, ``max_len``, ``vocab``,
    ``medians`` and ``special_tokens`` tokenize for a published checkpoint (a pretraining checkpoint
    keeps its run's). ``probe_cells``: training cells the linear probe is fit on; ``out_metrics``:
    a JSON file for the summary."""

    dataset: str
    init: str
    label: str
    freeze: bool = False
    pool: str | None = None
    tokens: str | None = None
    max_len: int | None = None
    vocab: str | None = None
    medians: str | None = None
    special_tokens: bool = True
    lr: float = 1e-3
    encoder_lr: float | None = None
    batch_size: int = 64
    block_size: int = 16
    fetch_factor: int = 64
    epochs: int = 1
    steps: int | None = None
    seed: int = 0
    eval_where: str | None = None
    eval_rows: str | None = None
    eval_batch_size: int | None = None
    probe_cells: int = 2000
    num_devices: int | None = None
    num_threads: int = 1
    out_metrics: str | None = None
    log_every: int = 50
    quiet: bool = False

    DEFAULT_ENCODER_LR = 1e-4

    def validate(self) -> None:
        """Raise `TrainError` naming the first bad option and its valid range."""
        if self.pool is not None and self.pool not in POOLS:
            msg = f"--pool must be one of {', '.join(POOLS)}; got {self.pool!r}"
            raise TrainError(msg)
        if self.tokens is not None and self.tokens not in KINDS:
            msg = f"--tokens must be one of {', '.join(KINDS)}; got {self.tokens!r}"
            raise TrainError(msg)
        check_counts(
            self,
            ("batch_size", "block_size", "fetch_factor", "epochs", "probe_cells", "log_every"),
            ("steps", "eval_batch_size", "num_devices", "num_threads", "max_len"),
            flags=True,
        )
        for name in ("lr", "encoder_lr"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                msg = f"--{name.replace('_', '-')} must be positive, got {value!r}"
                raise TrainError(msg)
        if self.freeze and self.encoder_lr is not None:
            msg = (
                f"--encoder-lr {self.encoder_lr:g} trains the encoder, but --freeze leaves nothing of it "
                "to train (only the head learns, at --lr): drop --encoder-lr or --freeze"
            )
            raise TrainError(msg)
        if self.eval_where is None and self.eval_rows is None:
            msg = (
                "fine-tuning reports held-out accuracy: give the held-out cells with --eval-where "
                "\"batch = 'plate_09'\" or --eval-rows rows.npy"
            )
            raise TrainError(msg)
        if self.eval_where is not None and self.eval_rows is not None:
            msg = "give either --eval-where or --eval-rows, not both"
            raise TrainError(msg)
        check_paths(self)

    @property
    def encoder_rate(self) -> float:
        return self.DEFAULT_ENCODER_LR if self.encoder_lr is None else self.encoder_lr


def add_batch_arguments(p: argparse.ArgumentParser, d) -> argparse._ArgumentGroup:
    """The "batches" options every training command shares (the classifier's, ``pretrain``,
    ``finetune``), defaults from ``d``; returns the group for a command's own batch options."""
    g = p.add_argument_group("batches")
    g.add_argument(
        "--batch-size", type=int, default=d.batch_size, help="global batch size (default: %(default)s)"
    )
    g.add_argument("--block-size", type=int, default=d.block_size, help="default: %(default)s")
    g.add_argument("--fetch-factor", type=int, default=d.fetch_factor, help="default: %(default)s")
    g.add_argument("--epochs", type=int, default=d.epochs, help="default: %(default)s")
    g.add_argument("--steps", type=int, default=None, help="train this many steps instead of --epochs epochs")
    g.add_argument("--seed", type=int, default=d.seed, help="default: %(default)s")
    g.add_argument(
        "--devices",
        dest="num_devices",
        type=int,
        default=None,
        help="devices of the data mesh (default: all)",
    )
    g.add_argument(
        "--num-threads", type=int, default=d.num_threads, help="loader read threads (default: %(default)s)"
    )
    return g


def finetune_parser(prog: str) -> argparse.ArgumentParser:
    d = FinetuneConfig("", "", "")
    p = argparse.ArgumentParser(
        prog=f"{prog} finetune",
        description="Fine-tune a pretrained Geneformer or scGPT encoder with a linear head on its cell "
        "embedding to predict a categorical obs column; report held-out accuracy and macro-F1 beside "
        "a linear probe on the frozen embeddings and the MLP on log1p expression.",
    )
    p.add_argument("dataset", help="dataset directory written by omicsio-materialize")
    p.add_argument(
        "--init",
        required=True,
        metavar="hf:DIR|scgpt:DIR|DIR",
        help="a published checkpoint (Geneformer, scGPT) or an omicsio-train pretrain checkpoint directory",
    )
    p.add_argument("--label", required=True, help="categorical obs column to predict")
    g = p.add_argument_group("model and optimizer")
    g.add_argument("--freeze", action="store_true", help="train the head only; the encoder stays as loaded")
    g.add_argument(
        "--pool",
        choices=POOLS,
        default=None,
        help="the embedding the head reads (default: mean for geneformer, cls for scgpt)",
    )
    g.add_argument(
        "--lr", type=float, default=d.lr, help="adam learning rate of the head (default: %(default)s)"
    )
    g.add_argument(
        "--encoder-lr",
        type=float,
        default=None,
        help=f"adam learning rate of the encoder (default: {FinetuneConfig.DEFAULT_ENCODER_LR:g}; not with --freeze)",
    )
    g = p.add_argument_group("tokens (with hf:DIR or scgpt:DIR)")
    g.add_argument("--tokens", choices=KINDS, default=None, help="default: the checkpoint's family")
    g.add_argument("--max-len", type=int, default=None, help="default: 2048 geneformer, 1201 scgpt")
    g.add_argument(
        "--vocab",
        help="the checkpoint's token dictionary keyed on Ensembl id or gene symbol (scgpt:DIR: its vocab.json)",
    )
    g.add_argument("--medians", help="Geneformer gene medians keyed on Ensembl id (default: the dataset's)")
    g.add_argument(
        "--no-special-tokens",
        dest="special_tokens",
        action="store_false",
        help="geneformer: rows without CLS and EOS (Geneformer V1 and its token dictionary)",
    )
    add_batch_arguments(p, d)
    g = p.add_argument_group("held-out evaluation and output")
    g.add_argument("--eval-batch-size", type=int, default=None, help="default: --batch-size")
    g.add_argument(
        "--probe-cells",
        type=int,
        default=d.probe_cells,
        help="training cells the linear probe is fit on (default: %(default)s)",
    )
    g.add_argument("--out-metrics", metavar="FILE.json", help="write the summary here as JSON")
    g.add_argument("--log-every", type=int, default=d.log_every, metavar="N", help="default: %(default)s")
    g.add_argument("--quiet", action="store_true", help="print nothing but errors")
    held_out = g.add_mutually_exclusive_group(required=True)
    held_out.add_argument(
        "--eval-where",
        metavar="PREDICATE",
        help="held-out cells: col = 'v', col != 'v', col IN ('a', 'b') or col NOT IN (...)",
    )
    held_out.add_argument("--eval-rows", metavar="FILE.npy", help="held-out global rows")
    return p


def parse_finetune_config(argv: list[str], prog: str = "omicsio-train") -> FinetuneConfig:
    """The `FinetuneConfig` of an ``omicsio-train finetune`` command line."""
    return FinetuneConfig(**vars(finetune_parser(prog).parse_args(argv)))
