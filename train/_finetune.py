"""`finetune`: a linear head on a pretrained encoder's pooled cell embedding, trained (head only with
``freeze``, else the whole network) on unmasked token batches, scored on held-out cells beside the
linear probe on the frozen embeddings, the MLP on log1p expression and the majority class.

The head is one linear layer. Fine-tuning the whole network puts the non-linearity where the
pretraining put it, in the encoder; with ``freeze`` the fine-tuned model is a linear read-out of the
frozen embedding like the probe, so their gap is what training the read-out on every training cell,
in batches, with the run's pooling adds, and the gap to the unfrozen run is what adapting the encoder
adds.

>>> result = finetune(FinetuneConfig("out/", "pt/", "cell_type", eval_where="batch = 'plate_09'"))  # doctest: +SKIP
>>> print(result.summary())                                                          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax

import omicsio_jax as oj

from ._config import TrainConfig
from ._embed import DEFAULT_POOL, embed, load_encoder, logistic_predict, special_ids
from ._finetune_config import FinetuneConfig
from ._loop import _split_rows, check_eval_batch, fit, label_column, make_data_mesh, require_classes
from ._metrics import EvalResult, accuracy, macro_f1
from ._step import evaluate, loss_fn, replicate

MODELS = {
    "finetuned": "fine-tuned encoder + linear head",
    "linear_probe": "linear probe on frozen embeddings",
    "mlp_log1p": "MLP on log1p expression",
    "majority": "majority class",
}


class CellClassifier(eqx.Module):
    """A pretrained encoder's pooled cell embedding (`GeneformerModel.embed` / `ScGPTModel.embed`) →
    linear head → logits. Applies to one cell's token arrays (a dict of ``(L,)`` arrays), as the
    classifier trainer's `loss_fn` and `evaluate` vmap it."""

    encoder: eqx.Module
    head: eqx.nn.Linear
    pool: str = eqx.field(static=True)
    special_ids: tuple[int, ...] = eqx.field(static=True)

    def __call__(self, x: dict, *, key: jax.Array | None = None) -> jax.Array:
        cell = jax.tree.map(lambda a: a[None], x)  # the encoders' embed takes a batch: one of one cell
        emb = self.encoder.embed(cell, pool=self.pool, special_ids=self.special_ids, key=key)[0]
        return self.head(emb)


@dataclasses.dataclass
class FinetuneResult:
    """The fine-tuned model, the step records, and held-out accuracy / macro-F1 of each model in
    `MODELS` (``scores[name]``); ``classes`` are the label's categories."""

    config: FinetuneConfig
    model: CellClassifier
    history: list[dict]
    scores: dict[str, EvalResult]
    classes: tuple[str, ...]
    train_cells: int
    probe_cells: int
    source: str

    def to_dict(self) -> dict:
        c = self.config
        return {
            "dataset": c.dataset,
            "init": c.init,
            "source": self.source,
            "label": c.label,
            "held_out": c.eval_where or c.eval_rows,
            "freeze": c.freeze,
            "pool": self.model.pool,
            "steps": len(self.history),
            "num_classes": len(self.classes),
            "train_cells": self.train_cells,
            "probe_fit_cells": self.probe_cells,
            "final_loss": self.history[-1]["loss"] if self.history else None,
            "models": {k: dataclasses.asdict(v) for k, v in self.scores.items()},
        }

    def summary(self) -> str:
        c, eval_cells = self.config, self.scores["finetuned"].num_cells
        what = "head only, encoder frozen" if c.freeze else "whole network"
        lines = [
            f"held-out {c.eval_where or c.eval_rows}: {eval_cells:,} cells, {len(self.classes)} classes "
            f"of {c.label!r}; fine-tuned {what}, {self.model.pool} pooling, {len(self.history)} steps",
            f"  {'model':<36}{'accuracy':>9}{'macro-F1':>10}",
        ]
        for name, title in MODELS.items():
            r = self.scores[name]
            title = "fine-tuned head on the frozen encoder" if name == "finetuned" and c.freeze else title
            lines.append(f"  {title:<36}{r.accuracy:>9.4f}{r.macro_f1:>10.4f}")
        return "\n".join(lines)


def trainable_spec(model: CellClassifier, *, freeze: bool) -> CellClassifier:
    """The filter of the arrays a run trains: the head's, and the encoder's unless ``freeze``."""
    spec = jax.tree.map(lambda leaf: eqx.is_array(leaf) and not freeze, model)
    return eqx.tree_at(lambda m: m.head, spec, replace=jax.tree.map(eqx.is_array, model.head))


def make_optimizer(config: FinetuneConfig) -> optax.GradientTransformation:
    """Adam on the trainable arrays, the head at ``lr`` and the encoder at ``encoder_rate``, after
    clipping the global gradient norm at 1."""
    if config.freeze:
        return optax.adam(config.lr)

    def labels(params: CellClassifier) -> CellClassifier:
        encoder = jax.tree.map(lambda _: "encoder", params.encoder)
        head = jax.tree.map(lambda _: "head", params.head)
        return eqx.tree_at(lambda m: (m.encoder, m.head), params, replace=(encoder, head))

    rates = {"head": optax.adam(config.lr), "encoder": optax.adam(config.encoder_rate)}
    return optax.chain(optax.clip_by_global_norm(1.0), optax.multi_transform(rates, labels))


def make_finetune_step(optimizer: optax.GradientTransformation, spec: CellClassifier, *, dropout: bool):
    """``step(model, opt_state, x, labels, mask, key, step) -> (model, opt_state, loss)``, jitted:
    gradients of the classifier trainer's `loss_fn` with respect to the arrays ``spec`` selects only;
    the others come back as they went in. Dropout (``dropout``) draws from ``fold_in(key, step)``."""

    @eqx.filter_jit
    def step(model, opt_state, x, labels, mask, key, step):
        trained, fixed = eqx.partition(model, spec)
        step_key = jax.random.fold_in(key, step) if dropout else None
        loss, grads = eqx.filter_value_and_grad(
            lambda t: loss_fn(eqx.combine(t, fixed), x, labels, mask, step_key)
        )(trained)
        updates, opt_state = optimizer.update(grads, opt_state, trained)
        return eqx.combine(eqx.apply_updates(trained, updates), fixed), opt_state, loss

    return step


def _width(encoder: eqx.Module) -> int:
    table = encoder.token_embedding if hasattr(encoder, "token_embedding") else encoder.gene_embedding
    return int(table.weight.shape[1])


def _scores(y_true: np.ndarray, y_pred: np.ndarray) -> EvalResult:
    return EvalResult(accuracy(y_true, y_pred), macro_f1(y_true, y_pred), len(y_true))


def _probe(encoder, ds, tok, codes, train_rows, eval_rows, config, pool, mesh) -> tuple[EvalResult, int]:
    """The linear probe (`logistic_predict`, as ``pretrain --probe-label``) fit on the frozen embeddings
    of up to ``probe_cells`` labelled training cells drawn with the seed, scored on the held-out cells."""
    labelled = train_rows[codes[train_rows] >= 0]
    rng = np.random.default_rng([config.seed, 0x9B0BE])
    fit_rows = np.sort(rng.choice(labelled, size=min(config.probe_cells, len(labelled)), replace=False))
    test_rows = eval_rows[codes[eval_rows] >= 0]
    batch_size = config.eval_batch_size or config.batch_size
    x_fit = embed(encoder, ds, tok, fit_rows, batch_size=batch_size, pool=pool, mesh=mesh)
    x_test = embed(encoder, ds, tok, test_rows, batch_size=batch_size, pool=pool, mesh=mesh)
    pred = logistic_predict(x_fit, codes[fit_rows], x_test, num_classes=int(codes.max()) + 1)
    return _scores(codes[test_rows], pred), len(fit_rows)


def _mlp_baseline(config: FinetuneConfig) -> EvalResult:
    """The classifier trainer's MLP on log1p expression (`fit`), on the same split, batch size, steps
    and seed."""
    result = fit(
        TrainConfig(
            config.dataset,
            config.label,
            model="mlp",
            batch_size=config.batch_size,
            block_size=config.block_size,
            fetch_factor=config.fetch_factor,
            epochs=config.epochs,
            steps=config.steps,
            seed=config.seed,
            eval_where=config.eval_where,
            eval_rows=config.eval_rows,
            eval_batch_size=config.eval_batch_size,
            num_devices=config.num_devices,
            num_threads=config.num_threads,
            quiet=True,
        )
    )
    return result.eval


def finetune(config: FinetuneConfig) -> FinetuneResult:
    """Fine-tune ``config.init`` to predict ``config.label`` and score it, the linear probe, the MLP on
    log1p expression and the majority class on the held-out cells."""
    config.validate()
    say = (lambda *a: None) if config.quiet else (lambda *a: print(*a, flush=True))
    ds = oj.open_dataset(config.dataset)
    column = label_column(ds, config.label)
    classes, codes = column.categories, np.asarray(column.codes)
    train_rows, eval_rows = _split_rows(config, ds)
    require_classes(codes, train_rows, classes, config.label)
    mesh = make_data_mesh(config.num_devices)
    check_eval_batch(mesh, config.eval_batch_size)
    encoder, tok, source, coverage = load_encoder(
        config.init,
        ds,
        tokens=config.tokens,
        max_len=config.max_len,
        vocab=config.vocab,
        medians=config.medians,
        special_tokens=config.special_tokens,
    )
    if coverage is not None:
        say(coverage)
    pool = config.pool or DEFAULT_POOL[tok.tokens]
    head_key, key = jax.random.split(jax.random.key(config.seed))
    history: list[dict] = []
    with contextlib.ExitStack() as cleanup:
        loader = oj.make_loader(
            ds,
            batch_size=config.batch_size,
            sampling=oj.Block(config.block_size, config.fetch_factor),
            output=tok.output(masked=False),
            obs=(config.label,),
            rows=train_rows,
            seed=config.seed,
            num_epochs=None if config.steps else config.epochs,
            placement=mesh,
            read=oj.ReadOptions(num_threads=config.num_threads),
        )
        cleanup.callback(loader.close)
        specials = special_ids(tok, loader.output.vocabulary, pool)
        head = eqx.nn.Linear(_width(encoder), len(classes), key=head_key)
        model = CellClassifier(encoder, head, pool, tuple(int(i) for i in specials))
        spec = trainable_spec(model, freeze=config.freeze)
        optimizer = make_optimizer(config)
        opt_state = optimizer.init(eqx.filter(model, spec))
        model, opt_state = replicate((model, opt_state), mesh)
        step_fn = make_finetune_step(optimizer, spec, dropout=not config.freeze)
        total = config.steps or config.epochs * loader.steps_per_epoch
        what = "the head (encoder frozen)" if config.freeze else "encoder and head"
        say(
            f"fine-tuning {what} of {source} ({pool} pooling) on {len(train_rows):,} cells, "
            f"{len(classes)} classes of {config.label!r}; {total} steps of {config.batch_size} "
            f"on {mesh.size} device(s)"
        )
        batches = iter(loader)
        for step in range(1, total + 1):
            t0 = time.perf_counter()
            batch = next(batches)
            model, opt_state, loss = step_fn(
                model,
                opt_state,
                batch.x,
                batch.obs[config.label],
                batch.mask,
                key,
                np.asarray(step, np.uint32),
            )
            record = {"step": step, "loss": float(loss)}
            record["cells_per_s"] = round(config.batch_size / (time.perf_counter() - t0), 1)
            history.append(record)
            if step == 1 or step % config.log_every == 0 or step == total:
                say(
                    f"step {step:>6}/{total}  loss {record['loss']:.4f}  {record['cells_per_s']:>8,.0f} cells/s"
                )

    eval_loader = oj.make_loader(  # tokens of the held-out cells as the probe's `embed` makes them
        ds,
        batch_size=config.eval_batch_size or config.batch_size,
        sampling=oj.Stream(fetch_factor=config.fetch_factor, drop_remainder=False),
        output=tok.output(masked=False),
        obs=(config.label,),
        rows=eval_rows,
        seed=tok.seed,
        num_epochs=1,
        placement=mesh,
        read=oj.ReadOptions(num_threads=config.num_threads),
    )
    try:
        scores = {"finetuned": evaluate(model, eval_loader, config.label)}
    finally:
        eval_loader.close()
    say("scoring the linear probe on the frozen embeddings ...")
    scores["linear_probe"], probe_cells = _probe(
        encoder, ds, tok, codes, train_rows, eval_rows, config, pool, mesh
    )
    say("training the MLP on log1p expression on the same cells ...")
    scores["mlp_log1p"] = _mlp_baseline(config)
    train_codes, test_codes = codes[train_rows], codes[eval_rows]
    majority = np.bincount(train_codes[train_codes >= 0]).argmax()
    test_codes = test_codes[test_codes >= 0]
    scores["majority"] = _scores(test_codes, np.full_like(test_codes, majority))
    result = FinetuneResult(config, model, history, scores, classes, len(train_rows), probe_cells, source)
    if config.out_metrics is not None:
        path = Path(config.out_metrics)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    say(result.summary())
    return result
