"""`TrainConfig`: every option of a training run, and which of them a checkpoint must match."""

from __future__ import annotations

import dataclasses

import omicsio_jax as oj

from ._errors import TrainError
from ._model import MODELS
from ._paths import check_paths
from ._resume_files import with_file_digests

SAMPLINGS = ("block", "stream", "stream_buffer", "class_balanced")
# Not saved in a checkpoint's config: how this invocation runs, not what it trains.
_NOT_SAVED = ("resume", "checkpoint_dir", "checkpoint_format", "log_every", "quiet", "auto_tune")
CHECKPOINT_FORMATS = ("equinox", "orbax")
# Saved but free to change on resume: they do not change the batches or the updates.
_FREE_ON_RESUME = (
    "dataset",
    "num_devices",
    "num_threads",
    "prefetch",
    "checkpoint_every",
    "keep",
    "metrics",
    "eval_batch_size",
)


# the counts every training command with checkpoints shares: positive integers, and
# ``checkpoint_every`` >= 0 (`check_counts`)
COUNTS = ("batch_size", "block_size", "fetch_factor", "epochs", "keep", "log_every")
# what 0 means for the counts that may be 0 (`check_counts`)
_ZERO_MEANS = {"checkpoint_every": "only at the end"}
# options whose command-line flag is not their name
_FLAGS = {"num_devices": "--devices", "special_tokens": "--no-special-tokens"}


def option_name(name: str, *, flags: bool) -> str:
    """How an error names the option ``name``: its command-line flag (``flags``), else the name."""
    return _FLAGS.get(name, f"--{name.replace('_', '-')}") if flags else name


def given_option(name: str, value: object) -> str:
    """The command-line words that give option ``name`` this ``value``: ``--binning tahoe``, or the
    flag alone for a switch (``--no-special-tokens``)."""
    flag = option_name(name, flags=True)
    return flag if isinstance(value, bool) else f"{flag} {value}"


def check_counts(
    options: object, positive: tuple[str, ...], optional: tuple[str, ...] = (), *, flags: bool = False
) -> None:
    """Raise `TrainError` for the first of ``positive`` that is not a positive integer, of ``optional``
    that is neither None nor one, or a ``checkpoint_every`` (where ``options`` has one) below 0;
    naming the option as `option_name` does."""
    for name in (*positive, *optional):
        value = getattr(options, name)
        if (value is not None or name in positive) and (not isinstance(value, int) or value < 1):
            msg = f"{option_name(name, flags=flags)} must be a positive integer, got {value!r}"
            raise TrainError(msg)
    for name, zero in _ZERO_MEANS.items():
        value = getattr(options, name, 0)
        if not isinstance(value, int) or value < 0:
            msg = f"{option_name(name, flags=flags)} must be >= 0 (0: {zero}), got {value!r}"
            raise TrainError(msg)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run. ``dataset`` is a directory written by ``omicsio-materialize``; ``label`` a
    categorical obs column. ``steps`` (if set) replaces ``epochs × steps_per_epoch``. The held-out
    set is ``eval_where`` (a predicate, e.g. ``"batch = 'plate_09'"``) or ``eval_rows`` (a ``.npy``
    of global rows); training uses the other cells. ``num_devices`` (default: all) sets the mesh."""

    dataset: str
    label: str
    model: str = "mlp"
    hidden: int = 256
    dropout: float = 0.0
    lr: float = 1e-3
    batch_size: int = 1024
    block_size: int = 16
    fetch_factor: int = 64
    sampling: str = "block"
    epochs: int = 1
    steps: int | None = None
    seed: int = 0
    normalize_on_device: bool = False
    eval_where: str | None = None
    eval_rows: str | None = None
    eval_batch_size: int | None = None
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
    quiet: bool = False
    auto_tune: float = 0.0  # seconds for oj.tune to choose block_size, fetch_factor, num_threads (0: off)

    def validate(self) -> None:
        """Raise `TrainError` naming the first bad option and its valid range."""
        if self.model not in MODELS:
            msg = f"model must be one of {', '.join(MODELS)}; got {self.model!r}"
            raise TrainError(msg)
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            msg = f"checkpoint_format must be one of {', '.join(CHECKPOINT_FORMATS)}; got {self.checkpoint_format!r}"
            raise TrainError(msg)
        if self.sampling not in SAMPLINGS:
            msg = f"sampling must be one of {', '.join(SAMPLINGS)}; got {self.sampling!r}"
            raise TrainError(msg)
        self.check_ranges()
        if self.eval_where is not None and self.eval_rows is not None:
            msg = "give either eval_where or eval_rows, not both"
            raise TrainError(msg)
        if self.model == "linear":  # options of the MLP's hidden layer, which a linear model has none of
            fields = TrainConfig.__dataclass_fields__
            given = [n for n in ("hidden", "dropout") if getattr(self, n) != fields[n].default]
            if given:
                msg = (
                    f"{', '.join(option_name(n, flags=False) for n in given)} set for the linear model, which has "
                    "no hidden layer: drop it, or train model='mlp' (--model mlp)"
                )
                raise TrainError(msg)
        check_paths(self)

    def check_ranges(self, *, flags: bool = False) -> None:
        """Raise `TrainError` for the first count, rate or tuning budget out of its range (or a budget
        without block sampling), named as `option_name` does (``flags``: by its command-line flag)."""
        check_counts(
            self,
            (*COUNTS, "hidden", "num_threads", "prefetch"),
            ("steps", "eval_batch_size", "num_devices"),
            flags=flags,
        )
        if self.auto_tune < 0:
            msg = f"{option_name('auto_tune', flags=flags)} must be >= 0 seconds (0: off), got {self.auto_tune!r}"
            raise TrainError(msg)
        if self.auto_tune and self.sampling != "block":
            msg = f"auto_tune chooses block sampling's settings: it needs sampling='block', not {self.sampling!r}"
            raise TrainError(msg)
        if not self.lr > 0:
            msg = f"{option_name('lr', flags=flags)} must be positive, got {self.lr!r}"
            raise TrainError(msg)

    def saved(self) -> dict:
        """The options recorded in a checkpoint (all but resume, checkpoint dir and progress)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in _NOT_SAVED}

    def identity(self, *, fingerprint: str, train_rows: str, held_out: str | None = None) -> dict:
        """What a resumed run must share with the checkpoint: the options that decide batches and
        updates, the dataset fingerprint and a digest of the training rows. ``eval_rows`` is there as
        ``held_out``, the `train._resume_files.rows_sha256` of the rows it holds out (None without
        it), not as its path: the same rows from another path resume, other rows in the same file do
        not."""
        same = {k: v for k, v in self.saved().items() if k not in _FREE_ON_RESUME}
        identity = {"dataset": fingerprint[:16], "train_rows": train_rows, **same}
        return with_file_digests(identity, {"eval_rows": held_out})

    def loader_sampling(self) -> oj.Sampling:
        """The training loader's sampling option (``sampling``, ``block_size``, ``fetch_factor``)."""
        if self.sampling == "block":
            return oj.Block(self.block_size, self.fetch_factor)
        if self.sampling == "class_balanced":
            return oj.ClassBalanced(self.label, self.block_size, self.fetch_factor)
        return oj.Stream(shuffle=self.sampling == "stream_buffer", fetch_factor=self.fetch_factor)

    def loader_read(self) -> oj.ReadOptions:
        """The loaders' read options (``num_threads``, ``prefetch``)."""
        return oj.ReadOptions(num_threads=self.num_threads, prefetch=self.prefetch)
