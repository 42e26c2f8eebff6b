"""`pretrain`: masked pretraining of a Geneformer- or scGPT-style encoder on the loader's token batches,
with exact checkpoint/resume (both formats), JSONL metrics, `embed` and a linear probe.

Batches come from ``oj.make_loader(..., output=oj.GeneformerTokens | oj.ScGPTTokens)``, sharded
over the mesh's ``data`` axis; parameters are replicated, so XLA all-reduces the gradients. A
cell's tokens and masks are functions of (seed, epoch, row), the dropout key of step ``s`` is
``fold_in(key, s)``, so a run killed and resumed ends bit-identical to one that was not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import omicsio_jax as oj

from ._errors import TrainError
from ._loop import make_data_mesh, open_checkpoints, restorable
from ._metrics import MetricsLog
from ._preempt import Preemption
from ._step import replicate
from ._transformer import (
    KINDS,
    PRESETS,
    flops_per_cell,
    make_optimizer,
    make_pretrain_model,
    make_pretrain_step,
)

DEFAULT_MAX_LEN = {"geneformer": 2048, "scgpt": 1201}
_NOT_IDENTITY = (
    "resume",
    "checkpoint_dir",
    "checkpoint_format",
    "log_every",
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
    1201 (scGPT); ``steps`` (if set) replaces ``epochs × steps_per_epoch``; ``compute_dtype``:
    ``"float32"`` or ``"bfloat16"``; ``probe_label``: after training, fit a linear probe of this
    categorical obs column on frozen CLS embeddings of ``probe_cells`` cells (half held out), for the
    trained model and the same architecture at its random initialization."""

    dataset: str
    tokens: str = "geneformer"
    preset: str = "tiny"
    max_len: int | None = None
    mask_prob: float | None = None
    vocab: str | None = None
    medians: str | None = None
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
        if self.compute_dtype not in ("float32", "bfloat16"):
            msg = f"--compute-dtype must be float32 or bfloat16; got {self.compute_dtype!r}"
            raise TrainError(msg)
        for name in ("batch_size", "epochs", "probe_cells"):
            if getattr(self, name) < 1:
                msg = f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                raise TrainError(msg)

    @property
    def length(self) -> int:
        return self.max_len or DEFAULT_MAX_LEN[self.tokens]

    def output(self, *, masked: bool = True) -> oj.Output:
        """The token output of this run (``masked=False``: no MLM masking, for embeddings)."""
        p = (0.15 if self.mask_prob is None else self.mask_prob) if masked else 0.0
        if self.tokens == "geneformer":
            return oj.GeneformerTokens(
                max_len=self.length, mask_prob=p, vocab=self.vocab, medians=self.medians
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
        """What a checkpoint must match to be resumed."""
        saved = {k: v for k, v in dataclasses.asdict(self).items() if k not in _NOT_IDENTITY}
        return {**saved, "dataset_fingerprint": fingerprint}


@dataclasses.dataclass
class PretrainResult:
    """What `pretrain` did: the final model, its vocabulary size, the step records of this process,
    the probe (with ``probe_label``), the median step time and the share of it spent waiting for data;
    ``preempted``: a SIGTERM stopped the run after the last step of ``history`` (see `fit`)."""

    model: eqx.Module
    vocab_size: int
    num_steps: int
    start_step: int
    history: list[dict]
    checkpoint: Path | None
    probe: dict | None
    step_time_s: float
    data_wait_fraction: float
    preempted: bool = False


def _dtype(name: str):
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


def max_predictions(config: PretrainConfig) -> int | None:
    """Geneformer decodes at most this many labelled positions per cell: twice the expected number
    plus 8 (P(more) is negligible at L ≥ 64), so the vocabulary-wide decoder runs on ~2·p·L rows, not L."""
    if config.tokens != "geneformer":
        return None
    p = 0.15 if config.mask_prob is None else config.mask_prob
    return min(config.length, math.ceil(2 * p * config.length) + 8)


def build_model(config: PretrainConfig, vocab_size: int, key: jax.Array) -> eqx.Module:
    return make_pretrain_model(
        config.tokens,
        config.preset,
        vocab_size,
        config.length,
        key=key,
        compute_dtype=_dtype(config.compute_dtype),
        max_predictions=max_predictions(config),
    )


def pretrain(config: PretrainConfig, *, callback: Callable[[dict], None] | None = None) -> PretrainResult:
    """Pretrain on ``config.dataset``; resume from the latest checkpoint with ``config.resume``."""
    config.validate()
    say = (lambda *a: None) if config.quiet else (lambda *a: print(*a, flush=True))
    ds = oj.open_dataset(config.dataset)
    mesh = make_data_mesh(config.num_devices)
    identity = config.identity(ds.fingerprint)
    store = open_checkpoints(config)
    with contextlib.ExitStack() as cleanup:
        preemption = cleanup.enter_context(Preemption())  # SIGTERM: stop at a step boundary, saved
        if store is not None:
            cleanup.callback(store.close)
        restored = restorable(config, store, identity)
        loader = oj.make_loader(
            ds,
            batch_size=config.batch_size,
            sampling=oj.Block(config.block_size, config.fetch_factor),
            output=config.output(),
            seed=config.seed,
            num_epochs=None if config.steps else config.epochs,
            placement=mesh,
            read=oj.ReadOptions(num_threads=config.num_threads, prefetch=config.prefetch),
        )
        cleanup.callback(loader.close)
        vocab_size = loader.output.vocabulary.size
        per_epoch = loader.steps_per_epoch
        total = config.steps or config.epochs * per_epoch
        init_key, key = jax.random.split(jax.random.key(config.seed))
        model = build_model(config, vocab_size, init_key)
        optimizer = make_optimizer(
            config.lr,
            warmup_steps=min(config.warmup_steps, total - 1),
            total_steps=total,
            schedule=config.schedule,
            weight_decay=config.weight_decay,
            clip_norm=config.clip_norm,
        )
        opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
        start = 0
        if restored is not None:
            model, opt_state = restored.load((model, opt_state))
            key = jax.random.wrap_key_data(np.asarray(restored.meta["key_data"], np.uint32))
            start = restored.step
            restored.restore_loader(loader)
            say(f"resumed from {restored.path} at step {start}/{total}")
        model, opt_state = replicate((model, opt_state), mesh)
        metrics_path = Path(config.metrics) if config.metrics else None
        if metrics_path is None and config.checkpoint_dir is not None:
            metrics_path = Path(config.checkpoint_dir) / "metrics.jsonl"
        log = None
        if metrics_path is not None:
            log = MetricsLog(metrics_path, resume_after=start if restored else None)
            cleanup.callback(log.close)
        step_fn = make_pretrain_step(optimizer)
        flops = flops_per_cell(
            config.tokens,
            config.preset,
            config.length,
            vocab_size=vocab_size,
            max_predictions=max_predictions(config),
        )
        real_key = "attention_mask" if config.tokens == "geneformer" else "pad_mask"
        history, timings = [], []
        last_saved = restored.path if restored is not None else None

        def save(step: int) -> Path:
            if log is not None:
                log.sync()
            meta = {
                "epoch": (step - 1) // per_epoch,
                "seed": config.seed,
                "vocab_size": vocab_size,
                "total_steps": total,
                "key_data": jax.random.key_data(key).tolist(),
                "coverage": loader.coverage().to_dict(),
                "config": dataclasses.asdict(config),
                "identity": identity,
                "dataset_fingerprint": ds.fingerprint,
            }
            return store.save(step, (model, opt_state), meta, loader)

        say(
            f"pretraining {config.tokens} ({config.preset}, vocab {vocab_size:,}, L {config.length}) on "
            f"{ds.num_cells:,} cells; {total} steps ({per_epoch}/epoch) of {config.batch_size} on "
            f"{mesh.size} device(s)"
        )
        batches = iter(loader)
        slots = config.batch_size * config.length
        for step in range(start + 1, total + 1):
            t0 = time.perf_counter()
            batch = next(batches)
            t1 = time.perf_counter()
            model, opt_state, loss = step_fn(model, opt_state, batch.x, key, np.asarray(step, np.uint32))
            loss = float(loss)
            elapsed = time.perf_counter() - t0
            mask = np.asarray(batch.x[real_key])
            real = int(mask.sum()) if config.tokens == "geneformer" else int(mask.size - mask.sum())
            record = {
                "step": step,
                "epoch": (step - 1) // per_epoch,
                "loss": loss,
                "cells_per_s": round(config.batch_size / elapsed, 1),
                "tokens_per_s": round(real / elapsed, 1),
                "padded_slots_per_s": round((slots - real) / elapsed, 1),
                "step_time_s": round(elapsed, 6),
                "data_wait_s": round(t1 - t0, 6),
            }
            if config.peak_tflops:
                record["mfu"] = round(flops * config.batch_size / elapsed / (config.peak_tflops * 1e12), 5)
            history.append(record)
            timings.append((elapsed, t1 - t0))
            if log is not None:
                log.write(record)
            if step == start + 1 or step % config.log_every == 0 or step == total:
                say(
                    f"step {step:>6}/{total}  loss {loss:.4f}  {record['cells_per_s']:>8,.0f} cells/s  "
                    f"{record['tokens_per_s']:>10,.0f} tokens/s  data wait {100 * (t1 - t0) / elapsed:3.0f}%"
                )
            saved = config.checkpoint_dir is not None and (
                step == total or (config.checkpoint_every and step % config.checkpoint_every == 0)
            )
            if saved:
                last_saved = save(step)
            if callback is not None:
                callback(record)
            if preemption.requested:
                last_saved = preemption.stop(
                    step,
                    total,
                    save=save if config.checkpoint_dir is not None else None,
                    saved=saved,
                    last_saved=last_saved,
                    say=say,
                )
                break
    probe = None
    if config.probe_label is not None and not preemption.requested:
        init_model = build_model(config, vocab_size, jax.random.split(jax.random.key(config.seed))[0])
        probe = probe_pretraining(config, ds, {"pretrained": model, "random_init": init_model}, mesh)
        say(
            "linear probe of "
            + repr(config.probe_label)
            + ": "
            + ", ".join(f"{k} {v:.4f}" for k, v in probe["accuracy"].items())
            + f" on {probe['test_cells']:,} held-out cells"
        )
    timed = np.array(timings[1:] or timings or [(np.nan, np.nan)])
    step_s, wait = float(np.median(timed[:, 0])), float(timed[:, 1].sum() / timed[:, 0].sum())
    return PretrainResult(
        model, vocab_size, total, start, history, last_saved, probe, step_s, wait, preemption.requested
    )


def embed(
    model: eqx.Module,
    ds: oj.Dataset,
    config: PretrainConfig,
    rows: np.ndarray | None = None,
    *,
    batch_size: int | None = None,
    mesh=None,
) -> np.ndarray:
    """CLS embeddings ``(len(rows), width)`` float32 of ``rows`` (default: every cell, in row order),
    from unmasked token batches read in order."""
    rows = np.arange(ds.num_cells) if rows is None else np.asarray(rows, np.int64)
    loader = oj.make_loader(
        ds,
        batch_size=batch_size or config.batch_size,
        sampling=oj.Stream(fetch_factor=config.fetch_factor, drop_remainder=False),
        output=config.output(masked=False),
        rows=rows,
        seed=config.seed,
        num_epochs=1,
        placement=mesh,
        read=oj.ReadOptions(num_threads=config.num_threads),
    )
    model = eqx.nn.inference_mode(model)
    run = eqx.filter_jit(lambda m, x: m.embed(x))
    chunks, index = [], []
    try:
        for batch in loader:
            keep = np.asarray(batch.mask)
            chunks.append(np.asarray(run(model, batch.x), np.float32)[keep])
            index.append(np.asarray(batch.index)[keep])
    finally:
        loader.close()
    emb, index = np.concatenate(chunks), np.concatenate(index)
    return emb[np.argsort(index, kind="stable")]


def logistic_probe(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    steps: int = 500,
    l2: float = 1e-3,
) -> float:
    """Test accuracy of a multinomial logistic regression (standardized features, full-batch Adam,
    ``l2`` penalty) fit on the training embeddings."""
    mu, sd = x_train.mean(0), x_train.std(0) + 1e-6
    xtr, xte = jnp.asarray((x_train - mu) / sd), jnp.asarray((x_test - mu) / sd)
    ytr = jnp.asarray(y_train)
    k = int(max(y_train.max(), y_test.max())) + 1
    params = (jnp.zeros((xtr.shape[1], k)), jnp.zeros(k))
    opt = optax.adam(0.05)
    state = opt.init(params)

    def loss(p):
        logits = xtr @ p[0] + p[1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, ytr).mean() + l2 * jnp.sum(p[0] ** 2)

    @jax.jit
    def update(p, s):
        g = jax.grad(loss)(p)
        u, s = opt.update(g, s)
        return optax.apply_updates(p, u), s

    for _ in range(steps):
        params, state = update(params, state)
    pred = np.asarray(jnp.argmax(xte @ params[0] + params[1], axis=1))
    return float(np.mean(pred == y_test))


def probe_pretraining(
    config: PretrainConfig, ds: oj.Dataset, models: dict[str, eqx.Module], mesh=None
) -> dict:
    """Linear-probe accuracy of ``config.probe_label`` for each model: ``probe_cells`` labelled cells
    drawn with the run's seed, the first half to fit, the second half held out."""
    column = ds.obs.get(config.probe_label)
    if not isinstance(column, oj.Categorical):
        msg = f"--probe-label {config.probe_label!r} must be a categorical obs column of {ds.path}"
        raise TrainError(msg)
    codes = np.asarray(column.codes)
    labelled = np.flatnonzero(codes >= 0)
    rng = np.random.default_rng([config.seed, 0x9B0BE])
    rows = np.sort(rng.choice(labelled, size=min(config.probe_cells, len(labelled)), replace=False))
    split = rng.permutation(len(rows))
    fit_idx, test_idx = split[: len(rows) // 2], split[len(rows) // 2 :]
    accuracy = {}
    for name, model in models.items():
        emb = embed(model, ds, config, rows, mesh=mesh)
        accuracy[name] = logistic_probe(
            emb[fit_idx], codes[rows[fit_idx]], emb[test_idx], codes[rows[test_idx]]
        )
    return {
        "label": config.probe_label,
        "accuracy": accuracy,
        "fit_cells": len(fit_idx),
        "test_cells": len(test_idx),
    }


def load_pretrained(checkpoint_dir: str | Path) -> tuple[eqx.Module, PretrainConfig, dict]:
    """The model of the latest checkpoint in ``checkpoint_dir`` (either format), its config and meta."""
    root = Path(checkpoint_dir)
    fmt = "equinox" if any(root.glob("step-*")) else "orbax"
    store = open_checkpoints(PretrainConfig("", checkpoint_dir=str(root), checkpoint_format=fmt))
    try:
        latest = None if store is None else store.latest()
        if latest is None or "vocab_size" not in latest.meta:
            msg = f"{root} holds no pretraining checkpoint (written by omicsio-train pretrain)"
            raise TrainError(msg)
        saved = {k: v for k, v in latest.meta["config"].items() if k in PretrainConfig.__dataclass_fields__}
        config = PretrainConfig(**saved)
        model = build_model(config, latest.meta["vocab_size"], jax.random.key(0))
        total = latest.meta["total_steps"]
        optimizer = make_optimizer(
            config.lr,
            warmup_steps=min(config.warmup_steps, total - 1),
            total_steps=total,
            schedule=config.schedule,
            weight_decay=config.weight_decay,
            clip_norm=config.clip_norm,
        )
        model, _ = latest.load((model, optimizer.init(eqx.filter(model, eqx.is_array))))
        return model, config, latest.meta
    finally:
        if store is not None:
            store.close()
