"""The options of a pretraining run (`PretrainConfig`), its token output, and the model it starts
from: freshly initialised from a preset, or a published checkpoint (``init="hf:DIR"`` /
``"scgpt:DIR"``) whose vocabulary is checked against the dataset's token space."""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import omicsio_jax as oj

from ._config import COUNTS, check_counts, given_option, option_name
from ._errors import TrainError
from ._hf import PublishedCheckpoint
from ._layers import with_dropout
from ._paths import check_paths
from ._published import load_checkpoint
from ._resume_files import file_sha256, with_file_digests
from ._transformer import KINDS, PRESETS, make_optimizer, make_pretrain_model

DEFAULT_MAX_LEN = {"geneformer": 2048, "scgpt": 1201}
# the share of positions masked, as each reference pretrains: Hugging Face's MLM collator (Geneformer)
# and scGPT's pretraining script (``--mask-ratio 0.4``)
DEFAULT_MASK_PROB = {"geneformer": 0.15, "scgpt": 0.4}
# the options of one token family only: given with the other family's tokens, they are refused
_FAMILY_OPTIONS = {
    "binning": "scgpt",
    "mask_mode": "scgpt",
    "n_bins": "scgpt",
    "medians": "geneformer",
    "special_tokens": "geneformer",
}
_NOT_IDENTITY = (
    "resume",
    "checkpoint_dir",
    "checkpoint_format",
    "log_every",
    "sync_every",
    "quiet",
    "num_devices",
    "num_threads",
    "prefetch",
    "checkpoint_every",
    "keep",
    "metrics",
    "probe_label",
    "probe_cells",
    "peak_tflops",
    "dataset",
)


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """A pretraining run (``omicsio-train pretrain``). ``tokens``: ``"geneformer"`` or ``"scgpt"``;
    ``preset``: a `train._transformer.PRESETS` name; ``max_len``: default 2048 (Geneformer V1) or
    1201 (scGPT); ``mask_prob``: default 0.15 (Geneformer) or 0.4 (scGPT); ``steps`` (if set)
    replaces ``epochs × steps_per_epoch``; ``compute_dtype``: ``"float32"`` or ``"bfloat16"``;
    ``probe_label``: after training, fit a linear probe of this categorical obs column on frozen cell
    embeddings (`train._embed.embed`'s default pooling) of ``probe_cells`` cells (half held out), for
    the trained model and the model it started from. ``init``: start from a published checkpoint,
    ``"hf:DIR"`` (Geneformer) or ``"scgpt:DIR"``, instead of ``preset``; ``dropout``: the model's
    dropout rate everywhere it drops (None: the preset's or the checkpoint's); ``special_tokens``:
    Geneformer rows with CLS and EOS (False: V1 rows); ``sync_every``: fetch the loss from the device
    every this many steps (not every step)."""

    dataset: str
    tokens: str = "geneformer"
    preset: str = "tiny"
    dropout: float | None = None
    max_len: int | None = None
    mask_prob: float | None = None
    vocab: str | None = None
    medians: str | None = None
    special_tokens: bool = True
    init: str | None = None
    binning: str = "scgpt"
    mask_mode: str = "bernoulli"
    n_bins: int = 51
    batch_size: int = 64
    block_size: int = 16
    fetch_factor: int = 64
    epochs: int = 1
    steps: int | None = None
    lr: float = 1e-3
    warmup_steps: int = 100
    schedule: str = "cosine"
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    compute_dtype: str = "float32"
    seed: int = 0
    num_devices: int | None = None
    num_threads: int = 1
    prefetch: int = 2
    checkpoint_dir: str | None = None
    checkpoint_format: str = "equinox"
    checkpoint_every: int = 0
    keep: int = 3
    resume: bool = False
    metrics: str | None = None
    log_every: int = 50
    sync_every: int = 10
    quiet: bool = False
    probe_label: str | None = None
    probe_cells: int = 2000
    peak_tflops: float | None = None

    def validate(self) -> None:
        if self.tokens not in KINDS:
            msg = f"--tokens must be one of {', '.join(KINDS)}; got {self.tokens!r}"
            raise TrainError(msg)
        if self.preset not in PRESETS:
            msg = f"--preset must be one of {', '.join(PRESETS)}; got {self.preset!r}"
            raise TrainError(msg)
        if self.dropout is not None and not 0 <= self.dropout < 1:
            msg = f"--dropout must be in [0, 1); got {self.dropout}"
            raise TrainError(msg)
        if self.mask_prob is not None and not 0 < self.mask_prob < 1:
            msg = (
                f"--mask-prob must be in (0, 1): pretraining learns from the masked genes, so with none "
                f"masked its loss is 0 and it learns nothing; got {self.mask_prob}"
            )
            raise TrainError(msg)
        if self.compute_dtype not in ("float32", "bfloat16"):
            msg = f"--compute-dtype must be float32 or bfloat16; got {self.compute_dtype!r}"
            raise TrainError(msg)
        # the optimizer's numbers: a negative or NaN rate trained (rc 0) into a model of NaNs
        for flag, value, positive in (
            ("--lr", self.lr, False),  # 0: the weights stay as they start (a published checkpoint's)
            ("--clip-norm", self.clip_norm, True),
            ("--weight-decay", self.weight_decay, False),
        ):
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                msg = f"{flag} must be a {'positive' if positive else 'non-negative'} number, got {value!r}"
                raise TrainError(msg)
        if self.warmup_steps < 0:
            msg = f"--warmup-steps must be >= 0, got {self.warmup_steps!r}"
            raise TrainError(msg)
        if self.peak_tflops is not None and not (math.isfinite(self.peak_tflops) and self.peak_tflops > 0):
            msg = f"--peak-tflops must be a positive number (the device's peak, e.g. 989 for an H100), got {self.peak_tflops!r}"
            raise TrainError(msg)
        check_counts(
            self, (*COUNTS, "sync_every", "probe_cells"), ("steps", "max_len", "num_devices"), flags=True
        )
        self.check_token_options()
        check_paths(self)

    def check_token_options(self) -> None:
        """Raise `TrainError` for an option of the other token family than ``tokens`` given (not at
        its default): ``binning``, ``mask_mode`` and ``n_bins`` are scGPT's, ``medians`` and
        ``special_tokens`` Geneformer's."""
        for name, family in _FAMILY_OPTIONS.items():
            value = getattr(self, name)
            if family == self.tokens or value == PretrainConfig.__dataclass_fields__[name].default:
                continue
            given, flag = given_option(name, value), option_name(name, flags=True)
            msg = f"{given} is an option of {family} tokens, but the tokens are {self.tokens}: drop {flag}"
            raise TrainError(msg)

    @property
    def length(self) -> int:
        return self.max_len or DEFAULT_MAX_LEN[self.tokens]

    @property
    def masking(self) -> float:
        """The share of positions masked: ``mask_prob``, else the reference's (`DEFAULT_MASK_PROB`)."""
        return DEFAULT_MASK_PROB[self.tokens] if self.mask_prob is None else self.mask_prob

    def output(self, *, masked: bool = True) -> oj.Output:
        """The token output of this run (``masked=False``: no MLM masking, for embeddings)."""
        p = self.masking if masked else 0.0
        if self.tokens == "geneformer":
            return oj.GeneformerTokens(
                max_len=self.length,
                special_tokens=self.special_tokens,
                mask_prob=p,
                vocab=self.vocab,
                medians=self.medians,
            )
        return oj.ScGPTTokens(
            max_len=self.length,
            n_bins=self.n_bins,
            binning=self.binning,
            mask_prob=p,
            mask_mode=self.mask_mode,
            vocab=self.vocab,
        )

    def identity(self, fingerprint: str) -> dict:
        """What a checkpoint must match to be resumed. ``vocab`` and ``medians`` are there as the
        sha256 of their files' bytes (read here), not as paths: the same file from another path
        resumes, a file changed in place does not (`train._resume_files`)."""
        saved = {k: v for k, v in dataclasses.asdict(self).items() if k not in _NOT_IDENTITY}
        files = {name: file_sha256(name, getattr(self, name)) for name in ("vocab", "medians")}
        return with_file_digests({**saved, "dataset_fingerprint": fingerprint}, files)


def _dtype(name: str):
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


def max_predictions(config: PretrainConfig) -> int | None:
    """Geneformer decodes at most this many labelled positions per cell: twice the expected number
    plus 8 (P(more) is negligible at L ≥ 64), so the vocabulary-wide decoder runs on ~2·p·L rows, not L."""
    if config.tokens != "geneformer":
        return None
    p = config.masking
    return min(config.length, math.ceil(2 * p * config.length) + 8)


def build_model(config: PretrainConfig, vocab_size: int, key: jax.Array) -> eqx.Module:
    """The model ``config`` starts from: the checkpoint ``config.init`` (`open_init`; ``vocab_size``
    and ``key`` unused), else a fresh ``config.preset`` model with ``vocab_size`` embedding rows drawn
    from ``key``; at ``config.dropout`` when it is set."""
    if config.init is not None:
        return open_init(config).model
    model = make_pretrain_model(
        config.tokens,
        config.preset,
        vocab_size,
        config.length,
        key=key,
        compute_dtype=_dtype(config.compute_dtype),
        max_predictions=max_predictions(config),
    )
    return _at_dropout(model, config)


def _at_dropout(model: eqx.Module, config: PretrainConfig) -> eqx.Module:
    return model if config.dropout is None else with_dropout(model, config.dropout)


def pretrain_optimizer(config: PretrainConfig, total_steps: int) -> optax.GradientTransformation:
    """The run's optimizer: AdamW with warm-up and ``config.schedule`` over ``total_steps`` (a resume
    or an embedding rebuilds the one its checkpoint was saved with)."""
    return make_optimizer(
        config.lr,
        warmup_steps=min(config.warmup_steps, total_steps - 1),
        total_steps=total_steps,
        schedule=config.schedule,
        weight_decay=config.weight_decay,
        clip_norm=config.clip_norm,
    )


def open_init(config: PretrainConfig) -> PublishedCheckpoint:
    """The published checkpoint ``config.init``, built for the run (compute dtype, max predictions,
    ``config.dropout`` when it is set), checked against ``config.tokens`` and ``config.length``."""
    ckpt = load_checkpoint(
        config.init,
        compute_dtype=_dtype(config.compute_dtype),
        max_predictions=max_predictions(config),
        max_len=config.length if config.tokens == "scgpt" else None,
    )
    if ckpt.kind != config.tokens:
        msg = f"--init {config.init} is a {ckpt.kind} checkpoint but --tokens is {config.tokens}; pass --tokens {ckpt.kind}"
        raise TrainError(msg)
    if config.length > ckpt.max_len:
        msg = (
            f"--max-len {config.length} exceeds the {ckpt.max_len} positions of {ckpt.path}; "
            f"pass --max-len {ckpt.max_len} or less"
        )
        raise TrainError(msg)
    return dataclasses.replace(ckpt, model=_at_dropout(ckpt.model, config))


def with_init_vocab(config: PretrainConfig, ckpt: PublishedCheckpoint) -> PretrainConfig:
    """``config`` with ``vocab`` set to the checkpoint's token dictionary where none was given."""
    if config.vocab is not None:
        return config
    if ckpt.vocab is None:
        msg = (
            f"--init {config.init} needs --vocab FILE: the checkpoint's token dictionary keyed on Ensembl "
            "ids (Geneformer: token_dictionary_gc*.pkl; a TSV, JSON or parquet of Ensembl id -> token id)"
        )
        raise TrainError(msg)
    return dataclasses.replace(config, vocab=str(ckpt.vocab))


def check_vocabulary(config: PretrainConfig, vocabulary: oj.Vocabulary, ckpt: PublishedCheckpoint, ds) -> str:
    """One-line errors where the dataset's token space does not fit the checkpoint (token ids past its
    embedding rows); else a line saying how many of the dataset's genes the vocabulary covers and
    naming the first missing ones."""
    specials = {"pad": vocabulary.pad}
    if config.tokens == "scgpt":  # scGPT masks values, not tokens, and ends no row with EOS
        specials.update(cls=vocabulary.cls)
    else:
        specials.update(mask=vocabulary.mask)
        if config.special_tokens:
            specials.update(cls=vocabulary.cls, eos=vocabulary.eos)
    # (CLS / EOS asked of a vocabulary without them, Geneformer V1's: the token output refuses it)
    top_gene = int(vocabulary.tok.max())
    name, top = max(
        [("a gene", top_gene), *((f"<{k}>", v) for k, v in specials.items())], key=lambda kv: kv[1]
    )
    if top >= ckpt.vocab_size:
        msg = (
            f"the vocabulary {vocabulary.source} gives {name} token id {top}, past the {ckpt.vocab_size} "
            f"embedding rows of {ckpt.path}: use the token dictionary the checkpoint was trained with"
        )
        raise TrainError(msg)
    missing = np.flatnonzero(vocabulary.tok < 0)
    line = f"vocabulary {vocabulary.source}: {vocabulary.report}"
    if len(missing) and "ensembl_id" in ds.features:
        ids = ds.features["ensembl_id"].to_numpy(dtype=object)[missing[:5]]
        line += f"; missing e.g. {', '.join(map(str, ids))}"
    return line
