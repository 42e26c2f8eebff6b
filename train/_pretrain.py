"""`pretrain`: masked pretraining of a Geneformer- or scGPT-style encoder on the loader's token batches,
with exact checkpoint/resume (both formats), JSONL metrics, `embed` and a linear probe.

Batches come from ``oj.make_loader(..., output=oj.GeneformerTokens | oj.ScGPTTokens)``, sharded
over the mesh's ``data`` axis; parameters are replicated, so XLA all-reduces the gradients. A
cell's tokens and masks are functions of (seed, epoch, row), the dropout key of step ``s`` is
``fold_in(key, s)``, so a run killed and resumed ends bit-identical to one that was not.

The loop does not wait for the device each step: a step's loss and real-token count stay on the
device and are fetched in one transfer every ``sync_every`` steps (and before a print, a checkpoint
or a stop). A step's ``step_time_s`` is then the wall time of its window divided by the window's
steps (exact per step with ``sync_every=1``); ``data_wait_s`` is measured per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import omicsio_jax as oj

from ._embed import embed as embed
from ._embed import load_pretrained as load_pretrained
from ._embed import logistic_probe as logistic_probe
from ._embed import probe_pretraining
from ._gene_order import gene_order
from ._loop import epoch_coverage, label_column, make_data_mesh
from ._metrics import MetricsLog
from ._preempt import Preemption
from ._pretrain_config import DEFAULT_MAX_LEN as DEFAULT_MAX_LEN
from ._pretrain_config import PretrainConfig as PretrainConfig
from ._pretrain_config import build_model as build_model
from ._pretrain_config import check_vocabulary, open_init, with_init_vocab
from ._pretrain_config import max_predictions as max_predictions
from ._pretrain_config import pretrain_optimizer as pretrain_optimizer
from ._step import replicate
from ._stores import open_checkpoints, restorable
from ._transformer import PRESETS, flops_per_cell, make_pretrain_step


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


def fetch_metrics(pending: list[tuple]) -> tuple[np.ndarray, np.ndarray]:
    """The losses and real-token counts of the pending steps, in one device-to-host transfer (it
    waits for the last of those steps to finish)."""
    losses, reals = jax.device_get(([p[2] for p in pending], [p[3] for p in pending]))
    return np.asarray(losses, np.float32), np.asarray(reals, np.int64)


@jax.jit
def _count_real(mask: jax.Array, real_is_true: bool) -> jax.Array:
    total = mask.astype(jnp.int32).sum()
    return jnp.where(real_is_true, total, mask.size - total)


def pretrain(config: PretrainConfig, *, callback: Callable[[dict], None] | None = None) -> PretrainResult:
    """Pretrain on ``config.dataset`` (from ``config.init`` when set); resume from the latest
    checkpoint with ``config.resume``."""
    config.validate()
    say = (lambda *a: None) if config.quiet else (lambda *a: print(*a, flush=True))
    ds = oj.open_dataset(config.dataset)
    if config.probe_label is not None:  # a probe label the dataset lacks: refused now, not after the run
        label_column(ds, config.probe_label, "--probe-label")
    mesh = make_data_mesh(config.num_devices)
    init = open_init(config) if config.init is not None else None
    if init is not None:
        config = with_init_vocab(config, init)
    identity = config.identity(ds.fingerprint)
    # default vocabulary: token g + 3 is column g, so the checkpoint records which gene each column is
    genes = {"gene_order": gene_order(ds)} if config.vocab is None else {}
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
            num_epochs=config.epochs if config.steps is None else None,
            placement=mesh,
            read=oj.ReadOptions(num_threads=config.num_threads, prefetch=config.prefetch),
        )
        cleanup.callback(loader.close)
        per_epoch = loader.steps_per_epoch
        total = config.epochs * per_epoch if config.steps is None else config.steps
        init_key, key = jax.random.split(jax.random.key(config.seed))
        if init is not None:
            say(check_vocabulary(config, loader.output.vocabulary, init, ds))
            model, arch, vocab_size = init.model, init.config, init.vocab_size
        else:
            vocab_size = loader.output.vocabulary.size
            model, arch = build_model(config, vocab_size, init_key), PRESETS[config.preset]
        optimizer = pretrain_optimizer(config, total)
        opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
        start = 0
        model, opt_state = replicate((model, opt_state), mesh)
        if restored is not None:  # restored onto the replicated arrays (Orbax: on every process's devices)
            model, opt_state = replicate(restored.load((model, opt_state)), mesh)
            key = jax.random.wrap_key_data(np.asarray(restored.meta["key_data"], np.uint32))
            start = restored.step
            restored.restore_loader(loader)
            say(f"resumed from {restored.path} at step {start}/{total}")
        metrics_path = Path(config.metrics) if config.metrics else None
        if metrics_path is None and config.checkpoint_dir is not None:
            metrics_path = Path(config.checkpoint_dir) / "metrics.jsonl"
        log = None
        if metrics_path is not None:
            log = MetricsLog(metrics_path, resume_after=start if restored else None)
            cleanup.callback(log.close)
        step_fn = make_pretrain_step(optimizer)
        flops = flops_per_cell(
            config.tokens, arch, config.length, vocab_size=vocab_size, max_predictions=max_predictions(config)
        )
        real_key = "attention_mask" if config.tokens == "geneformer" else "pad_mask"
        history, pending = [], []
        last_saved = restored.path if restored is not None else None
        window_start = 0.0

        def flush() -> None:
            """Fetch the pending steps' metrics and write their records."""
            nonlocal window_start
            losses, reals = fetch_metrics(pending)
            elapsed = (time.perf_counter() - window_start) / len(pending)
            for (step, wait, _, _, coverage), loss, real in zip(pending, losses, reals, strict=True):
                record = {
                    "step": step,
                    "epoch": (step - 1) // per_epoch,
                    "loss": float(loss),
                    "cells_per_s": round(config.batch_size / elapsed, 1),
                    "tokens_per_s": round(int(real) / elapsed, 1),
                    "padded_slots_per_s": round((slots - int(real)) / elapsed, 1),
                    "step_time_s": round(elapsed, 6),
                    "data_wait_s": round(wait, 6),
                }
                if config.peak_tflops:
                    mfu = flops * config.batch_size / elapsed / (config.peak_tflops * 1e12)
                    record["mfu"] = round(mfu, 5)
                record.update(coverage)
                history.append(record)
                if log is not None:
                    log.write(record)
                if step == start + 1 or step % config.log_every == 0 or step == total:
                    say(
                        f"step {step:>6}/{total}  loss {loss:.4f}  {record['cells_per_s']:>8,.0f} cells/s  "
                        f"{record['tokens_per_s']:>10,.0f} tokens/s  data wait {100 * wait / elapsed:3.0f}%"
                    )
                if callback is not None:
                    callback(record)
            pending.clear()

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
                **genes,
            }
            return store.save(step, (model, opt_state), meta, loader)

        say(
            f"pretraining {config.tokens} ({config.init or config.preset}, vocab {vocab_size:,}, "
            f"L {config.length}) on {ds.num_cells:,} cells; {total} steps ({per_epoch}/epoch) of "
            f"{config.batch_size} on {mesh.size} device(s)"
        )
        batches = iter(loader)
        slots = config.batch_size * config.length
        real_is_true = config.tokens == "geneformer"
        window_start = time.perf_counter()
        for step in range(start + 1, total + 1):
            t0 = time.perf_counter()
            batch = next(batches)
            wait = time.perf_counter() - t0
            model, opt_state, loss = step_fn(model, opt_state, batch.x, key, np.asarray(step, np.uint32))
            # the epoch's coverage audit now: the loader keeps only the last ended epoch's, and a
            # window of pending steps may span several
            coverage = epoch_coverage(loader, step, per_epoch)
            pending.append((step, wait, loss, _count_real(batch.x[real_key], real_is_true), coverage))
            saved = config.checkpoint_dir is not None and (
                step == total or (config.checkpoint_every and step % config.checkpoint_every == 0)
            )
            due = step == start + 1 or step % config.sync_every == 0 or step % config.log_every == 0
            if due or saved or step == total or preemption.requested:
                flush()
                if saved:
                    last_saved = save(step)
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
                window_start = time.perf_counter()
    # no step left to take: the probe is what the signal stops (see `fit`)
    if preemption.requested and not preemption.stopped:
        preemption.stop(
            total,
            total,
            save=save if config.checkpoint_dir is not None else None,
            saved=True,
            last_saved=last_saved,
            say=say,
            before="the linear probe" if config.probe_label is not None else None,
        )
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
    timed = np.array(
        [(r["step_time_s"], r["data_wait_s"]) for r in history[1:] or history] or [(np.nan, np.nan)]
    )
    step_s, wait = float(np.median(timed[:, 0])), float(timed[:, 1].sum() / timed[:, 0].sum())
    return PretrainResult(
        model, vocab_size, total, start, history, last_saved, probe, step_s, wait, preemption.requested
    )
