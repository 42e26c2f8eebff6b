"""`fit`: the training loop — loader, jitted steps, JSONL metrics, checkpoints, resume, evaluation."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax

import omicsio_jax as oj

from ._config import TrainConfig
from ._errors import TrainError
from ._metrics import EvalResult, MetricsLog
from ._model import make_model
from ._predicate import parse_predicate
from ._preempt import Preemption
from ._resume_files import rows_sha256
from ._step import evaluate, make_train_step, replicate
from ._stores import check_resumed, open_checkpoints, restorable


@dataclasses.dataclass
class FitResult:
    """What `fit` did: final model, the step records of this process, evaluation and timings.

    ``step_time_s`` is the median wall time of a step (data wait included, the first step with its
    compilation left out); ``data_wait_fraction`` the share of that time spent waiting for batches.
    ``preempted``: a SIGTERM stopped the run after the last step of ``history`` (checkpointed there
    when the run has a checkpoint directory; no evaluation), or, where it came with no step left to
    take (a resumed run already at its last step), before the evaluation.
    """

    model: eqx.Module
    num_steps: int
    start_step: int
    history: list[dict]
    eval: EvalResult | None
    checkpoint: Path | None
    metrics_path: Path | None
    step_time_s: float
    data_wait_fraction: float
    preempted: bool = False


def make_data_mesh(num_devices: int | None = None) -> jax.sharding.Mesh:
    """A 1-D mesh with axis ``data`` over the first ``num_devices`` devices (default: all)."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not 1 <= n <= len(devices):
        msg = f"num_devices must be in 1..{len(devices)} (the devices JAX sees), got {n}"
        raise TrainError(msg)
    return jax.sharding.Mesh(np.array(devices[:n]), ("data",))


def check_eval_batch(mesh: jax.sharding.Mesh, eval_batch_size: int | None) -> None:
    """Refuse, before any training, an ``eval_batch_size`` that the mesh's devices do not split (the
    held-out set is read only after training)."""
    devices = mesh.shape["data"]
    if eval_batch_size is not None and eval_batch_size % devices:
        msg = (
            f"--eval-batch-size {eval_batch_size} must be divisible by the {devices} devices of the mesh: "
            f"pass a multiple of {devices}, e.g. --eval-batch-size {max(1, eval_batch_size // devices) * devices}"
        )
        raise TrainError(msg)


def _split_rows(config: TrainConfig, ds: oj.Dataset) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(training rows, held-out rows), or (None, None) without a held-out set."""
    if config.eval_where is not None:
        held_out = parse_predicate(config.eval_where).rows(ds)
    elif config.eval_rows is not None:
        try:
            given = np.load(config.eval_rows, allow_pickle=False)
        except (OSError, ValueError) as e:
            msg = f"cannot read --eval-rows {config.eval_rows}: {e}"
            raise TrainError(msg) from e
        held_out = np.unique(given) if given.ndim == 1 else given  # (unique flattens)
        if (
            held_out.dtype.kind not in "iu"
            or held_out.ndim != 1
            or held_out.size == 0
            or held_out[0] < 0
            or held_out[-1] >= ds.num_cells
        ):
            msg = (
                f"--eval-rows {config.eval_rows} must hold a non-empty 1-D integer array of rows in "
                f"0..{ds.num_cells - 1}; got dtype {held_out.dtype}, shape {held_out.shape}"
            )
            raise TrainError(msg)
    else:
        return None, None
    train = np.setdiff1d(np.arange(ds.num_cells), held_out)
    if train.size == 0:
        msg = "the held-out set holds every cell: nothing is left to train on"
        raise TrainError(msg)
    return train, held_out


def require_classes(codes: np.ndarray, train_rows: np.ndarray | None, classes, label: str) -> None:
    """A one-line error where the training cells (``train_rows``; None: every cell) hold fewer than
    two classes of ``label`` (``codes``: each cell's, -1 for none): nothing to classify."""
    present = np.unique(codes if train_rows is None else codes[train_rows])
    present = present[present >= 0]
    if len(present) < 2:
        names = ", ".join(classes[i] for i in present) or "none"
        cells = len(codes) if train_rows is None else len(train_rows)
        msg = (
            f"--label {label!r} has {len(present)} class(es) among the {cells:,} training cells "
            f"({names}): nothing to classify; choose a label with at least 2 classes outside the held-out set"
        )
        raise TrainError(msg)


def label_column(ds: oj.Dataset, label: str, flag: str = "--label") -> oj.Categorical:
    """The categorical obs column ``label`` of ``ds``; a missing or numeric one is a one-line error
    naming ``flag`` and the columns it may name."""
    column = ds.obs.get(label)
    if not isinstance(column, oj.Categorical):
        kind = "missing" if column is None else "numeric"
        choices = ", ".join(k for k, v in ds.obs.items() if isinstance(v, oj.Categorical))
        msg = (
            f"{flag} {label!r} must be a categorical obs column of {ds.path} ({kind}); "
            f"categorical columns: {choices}"
        )
        raise TrainError(msg)
    return column


def _digest(rows: np.ndarray | None) -> str | None:
    return None if rows is None else hashlib.sha256(np.asarray(rows, np.int64).tobytes()).hexdigest()[:16]


def _output(config: TrainConfig) -> oj.Dense:
    """Dense rows, normalized in the loader unless the step normalizes them on the devices."""
    return oj.Dense(normalize=None if config.normalize_on_device else "normalize_log1p")


def epoch_coverage(loader, step: int, per_epoch: int) -> dict:
    """``{"coverage": ...}``, the loader's audit of the epoch that ``step`` ends, for the metrics record
    of each epoch's last step (taken right after that step's batch); ``{}`` for the other steps."""
    if step % per_epoch:
        return {}
    return {"coverage": loader.coverage((step - 1) // per_epoch).to_dict()}


def auto_tuned(config: TrainConfig, ds: oj.Dataset, train_rows: np.ndarray | None, store, say) -> TrainConfig:
    """``config`` with the block size, fetch factor and threads `oj.tune` measures fastest at 0.98 × true
    random's label entropy; a resumed run keeps its checkpoint's (they decide the batches). A run that
    would be refused for not resuming its directory's checkpoints is refused before the measurement."""
    latest = None if store is None else store.latest()
    check_resumed(config, latest)
    if latest is not None:
        saved = latest.meta["config"]
        chosen = {k: saved[k] for k in ("block_size", "fetch_factor", "num_threads")}
        say(f"auto-tune: the checkpoint's settings {chosen}")
    else:
        result = oj.tune(
            ds,
            config.batch_size,
            label=config.label,
            seconds=config.auto_tune,
            rows=train_rows,
            seed=config.seed,
            output=_output(config),
            read=config.loader_read(),
            progress=not config.quiet,
        )
        say(f"auto-tune ({config.auto_tune:g} s, entropy ≥ 0.98 × true random):\n{result}")
        chosen = {"block_size": result.block_size, "fetch_factor": result.fetch_factor}
        chosen["num_threads"] = result.num_threads
    return dataclasses.replace(config, **chosen, auto_tune=0.0)


def fit(config: TrainConfig, *, callback: Callable[[dict], None] | None = None) -> FitResult:
    """Train ``config.model`` on ``config.dataset`` to predict ``config.label``; resume from the latest
    checkpoint with ``config.resume``. ``callback(record)`` runs after every step (and its checkpoint).

    A run resumed after a kill ends with bit-identical parameters and the same loss history as an
    uninterrupted one (on the same devices): batches come from the loader's saved state, dropout keys
    are ``fold_in(key, step)``, and model and optimizer state are restored exactly.
    """
    config.validate()
    say = (lambda *a: None) if config.quiet else (lambda *a: print(*a, flush=True))
    ds = oj.open_dataset(config.dataset)
    column = label_column(ds, config.label)
    classes = column.categories
    train_rows, eval_rows = _split_rows(config, ds)
    require_classes(np.asarray(column.codes), train_rows, classes, config.label)
    mesh = make_data_mesh(config.num_devices)
    check_eval_batch(mesh, config.eval_batch_size)
    store = open_checkpoints(config)
    try:  # a run refused here lets go of the store (its writer's lock) at once, not when collected
        if config.auto_tune:
            config = auto_tuned(config, ds, train_rows, store, say)
        held_out = rows_sha256(eval_rows) if config.eval_rows is not None else None
        identity = config.identity(
            fingerprint=ds.fingerprint, train_rows=_digest(train_rows), held_out=held_out
        )
    except BaseException:
        if store is not None:
            store.close()
        raise
    with contextlib.ExitStack() as cleanup:  # closes the metrics log, the loader, then the store
        preemption = cleanup.enter_context(Preemption())  # SIGTERM: stop at a step boundary, saved
        if store is not None:
            cleanup.callback(store.close)
        restored = restorable(config, store, identity)
        directory = config.checkpoint_dir
        init_key, key = jax.random.split(jax.random.key(config.seed))
        model = make_model(
            config.model,
            num_features=ds.num_genes,
            num_classes=len(classes),
            hidden=config.hidden,
            dropout=config.dropout,
            key=init_key,
        )
        optimizer = optax.adam(config.lr)
        opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
        start = 0
        model, opt_state = replicate((model, opt_state), mesh)
        if restored is not None:  # restored onto the replicated arrays (Orbax: on every process's devices)
            model, opt_state = replicate(restored.load((model, opt_state)), mesh)
            key = jax.random.wrap_key_data(np.asarray(restored.meta["key_data"], np.uint32))
            start = restored.step
        loader = oj.make_loader(
            ds,
            batch_size=config.batch_size,
            sampling=config.loader_sampling(),
            output=_output(config),
            obs=(config.label,),
            rows=train_rows,
            seed=config.seed,
            num_epochs=None if config.steps else config.epochs,
            placement=mesh,
            read=config.loader_read(),
        )
        cleanup.callback(loader.close)
        per_epoch = loader.steps_per_epoch
        total = config.steps or config.epochs * per_epoch
        if restored is not None:
            restored.restore_loader(loader)
            say(f"resumed from {restored.path} at step {start}/{total}")
        elif config.resume:
            say(f"no checkpoint in {directory}: starting at step 0")

        metrics_path = Path(config.metrics) if config.metrics else None
        if metrics_path is None and directory is not None:
            metrics_path = Path(directory) / "metrics.jsonl"
        log: MetricsLog | None = None
        if metrics_path is not None:
            log = MetricsLog(metrics_path, resume_after=start if restored else None)
            cleanup.callback(log.close)
        train_step = make_train_step(optimizer, normalize_on_device=config.normalize_on_device)
        history: list[dict] = []
        timings: list[tuple[float, float]] = []  # (step wall time, data wait) of each step run here
        last_saved = restored.path if restored is not None else None

        def save(step: int) -> Path:
            if log is not None:
                log.sync()
            meta = {
                "epoch": (step - 1) // per_epoch,
                "seed": config.seed,
                "key_data": jax.random.key_data(key).tolist(),
                "coverage": loader.coverage().to_dict(),
                "config": config.saved(),
                "identity": identity,
                "dataset_fingerprint": ds.fingerprint,
                "label": config.label,
                "classes": list(classes),
            }
            return store.save(step, (model, opt_state), meta, loader)

        say(
            f"training {config.model} on {ds.num_cells if train_rows is None else len(train_rows):,} cells × "
            f"{ds.num_genes:,} genes, {len(classes)} classes of {config.label!r}; {total} steps "
            f"({per_epoch}/epoch) of {config.batch_size} on {mesh.size} device(s)"
        )
        batches = iter(loader)
        for step in range(start + 1, total + 1):
            t0 = time.perf_counter()
            batch = next(batches)
            t1 = time.perf_counter()
            model, opt_state, loss = train_step(
                model,
                opt_state,
                batch.x,
                batch.obs[config.label],
                batch.mask,
                key,
                np.asarray(step, np.uint32),
            )
            loss = float(loss)
            elapsed = time.perf_counter() - t0
            record = {
                "step": step,
                "epoch": (step - 1) // per_epoch,
                "loss": loss,
                "cells_per_s": round(config.batch_size / elapsed, 1),
                "data_wait_s": round(t1 - t0, 6),
            }
            record.update(epoch_coverage(loader, step, per_epoch))
            history.append(record)
            timings.append((elapsed, t1 - t0))
            if log is not None:
                log.write(record)
            if step == start + 1 or step % config.log_every == 0 or step == total:
                say(
                    f"step {step:>6}/{total}  epoch {record['epoch']}  loss {loss:.4f}  "
                    f"{record['cells_per_s']:>10,.0f} cells/s  data wait {1e3 * (t1 - t0):7.2f} ms "
                    f"({100 * (t1 - t0) / elapsed:3.0f}%)"
                )
            saved = directory is not None and (
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
                    save=save if directory is not None else None,
                    saved=saved,
                    last_saved=last_saved,
                    say=say,
                )
                break
        if directory is not None and restored is not None and start >= total:
            say(f"{restored.path} is already at the last step ({total})")
    if preemption.requested and not preemption.stopped:
        # the signal came with no step left to take (in the start-up of a resumed run already at its
        # last step, or as the store closed): it stops the evaluation, and says so as any stop does
        preemption.stop(
            total,
            total,
            save=save if directory is not None else None,
            saved=True,
            last_saved=last_saved,
            say=say,
            before="the evaluation" if eval_rows is not None else None,
        )

    result = None
    if eval_rows is not None and not preemption.requested:
        eval_loader = oj.make_loader(
            ds,
            batch_size=config.eval_batch_size or config.batch_size,
            sampling=oj.Stream(fetch_factor=config.fetch_factor, drop_remainder=False),
            output=_output(config),
            obs=(config.label,),
            rows=eval_rows,
            num_epochs=1,
            placement=mesh,
            read=config.loader_read(),
        )
        try:
            result = evaluate(
                model, eval_loader, config.label, normalize_on_device=config.normalize_on_device
            )
        finally:
            eval_loader.close()
        where = config.eval_where or config.eval_rows
        say(f"eval ({where}): {result.summary()}")
    timed = np.array(timings[1:] or timings or [(np.nan, np.nan)])
    step_s, wait = float(np.median(timed[:, 0])), float(timed[:, 1].sum() / timed[:, 0].sum())
    return FitResult(
        model, total, start, history, result, last_saved, metrics_path, step_s, wait, preemption.requested
    )
