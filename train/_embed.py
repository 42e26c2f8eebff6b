"""Cell embeddings of a pretrained model (`embed`), the linear probe that scores them, and the model
of a pretraining checkpoint directory (`load_pretrained`)."""

from __future__ import annotations

import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import omicsio_jax as oj

from ._config import given_option, option_name
from ._errors import TrainError
from ._gene_order import check_gene_order
from ._loop import label_column, make_data_mesh
from ._pretrain_config import (
    PretrainConfig,
    build_model,
    check_vocabulary,
    open_init,
    pretrain_optimizer,
    with_init_vocab,
)
from ._resume_files import check_read_again
from ._step import replicate
from ._stores import open_checkpoints

DEFAULT_POOL = {"geneformer": "mean", "scgpt": "cls"}
READ_ATTEMPTS = 5  # `load_pretrained`'s tries at a latest step that a newer one keeps pruning


def embed(
    model: eqx.Module,
    ds: oj.Dataset,
    config: PretrainConfig,
    rows: np.ndarray | None = None,
    *,
    batch_size: int | None = None,
    pool: str | None = None,
    mesh=None,
) -> np.ndarray:
    """Cell embeddings ``(len(rows), width)`` float32 of ``rows`` (default: every cell, in row order),
    row ``i`` that of cell ``rows[i]`` (in the order given, a cell given twice twice), from unmasked token batches read in order: the last layer's hidden states averaged over the
    cell's gene tokens (``pool="mean"``: padding, CLS and EOS left out; Geneformer's cell embedding,
    its default) or at position 0 (``pool="cls"``: scGPT's cell embedding, its default)."""
    pool = pool or DEFAULT_POOL[config.tokens]
    rows = np.arange(ds.num_cells) if rows is None else np.asarray(rows, np.int64)
    loader = oj.make_loader(
        ds,
        batch_size=config.batch_size if batch_size is None else batch_size,
        sampling=oj.Stream(fetch_factor=config.fetch_factor, drop_remainder=False),
        output=config.output(masked=False),
        rows=rows,
        seed=config.seed,
        num_epochs=1,
        placement=mesh,
        read=oj.ReadOptions(num_threads=config.num_threads),
    )
    try:
        specials = special_ids(config, loader.output.vocabulary, pool)
    except TrainError:
        loader.close()
        raise
    model = eqx.nn.inference_mode(model)
    run = eqx.filter_jit(lambda m, x: m.embed(x, pool=pool, special_ids=specials))
    chunks, index = [], []
    try:
        for batch in loader:
            keep = np.asarray(batch.mask)
            chunks.append(np.asarray(run(model, batch.x), np.float32)[keep])
            index.append(np.asarray(batch.index)[keep])
    finally:
        loader.close()
    emb, index = np.concatenate(chunks), np.concatenate(index)
    order = np.argsort(index, kind="stable")  # the loader serves each row once, in dataset order
    return emb[order][np.searchsorted(index[order], rows)]  # back to the rows' order, repeats kept


def special_ids(config: PretrainConfig, vocabulary: oj.Vocabulary, pool: str) -> tuple[int, ...]:
    """The token ids that ``pool="mean"`` leaves out (CLS, and EOS in Geneformer rows that have one);
    a one-line error for ``pool="cls"`` on Geneformer rows without CLS."""
    if pool == "cls" and config.tokens == "geneformer" and not config.special_tokens:
        msg = "pool='cls' needs rows that start with CLS; these have none (--no-special-tokens): use pool='mean'"
        raise TrainError(msg)
    if config.tokens == "scgpt":
        return (vocabulary.cls,)
    return (vocabulary.cls, vocabulary.eos) if config.special_tokens else ()


def masked_prediction(
    model: eqx.Module, ds: oj.Dataset, config: PretrainConfig, rows: np.ndarray, *, mesh=None
) -> dict:
    """How well ``model`` fills in masked tokens of ``rows`` (masked as the run masks them, with its
    seed), beside the frequency baseline.

    Geneformer: ``accuracy`` is the top-1 accuracy of the masked genes (the positions the loss scores:
    the first ``max_predictions`` of a cell) and ``baseline`` that of always answering the most frequent
    masked gene. scGPT: ``accuracy`` is the share of masked values whose
    prediction rounds to the true bin and ``baseline`` that of always answering the most frequent bin;
    ``mse`` is the expression decoder's squared error on the masked values (the GEP term of the
    training loss, to which it adds the GEPC term) and ``baseline_mse`` (always the
    mean) that of a decoder that ignores the cell. ``positions``: masked positions scored. ``mesh``: where the batches
    go, default the run's (``config.num_devices``); the model is replicated onto it."""
    mesh = make_data_mesh(config.num_devices) if mesh is None else mesh
    loader = oj.make_loader(
        ds,
        batch_size=config.batch_size,
        sampling=oj.Stream(fetch_factor=config.fetch_factor, drop_remainder=False),
        output=config.output(),
        rows=np.asarray(rows, np.int64),
        seed=config.seed,
        num_epochs=1,
        placement=mesh,
        read=oj.ReadOptions(num_threads=config.num_threads),
    )
    model = replicate(eqx.nn.inference_mode(model), mesh)
    if config.tokens == "geneformer":

        @eqx.filter_jit
        def predict(m, x):  # only the positions the loss decodes: never a (B, L, vocab) array
            guess, labels, valid = jax.vmap(m.predict_masked)(
                x["input_ids"], x["attention_mask"].astype(bool), x["labels"]
            )
            return guess, valid, labels

    else:

        @eqx.filter_jit
        def predict(m, x):
            pred = jax.vmap(m)(x["gene_ids"], x["masked_values"], x["pad_mask"].astype(bool))
            return pred, x["mask"].astype(bool), x["values"]

    guesses, targets = [], []
    try:
        for batch in loader:
            guess, where, target = (np.asarray(a) for a in predict(model, batch.x))
            where = where & np.asarray(batch.mask)[:, None]
            guesses.append(guess[where])
            targets.append(target[where])
    finally:
        loader.close()
    guess, target = np.concatenate(guesses), np.concatenate(targets)
    _, counts = np.unique(target, return_counts=True)
    out = {"baseline": float(counts.max() / max(target.size, 1)), "positions": int(target.size)}
    if config.tokens == "geneformer":
        return {"accuracy": float(np.mean(guess == target)), **out}
    return {
        "accuracy": float(np.mean(np.rint(guess) == target)),
        **out,
        "mse": float(np.mean(np.square(guess - target))),
        "baseline_mse": float(np.var(target)),
    }


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
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    pred = logistic_predict(x_train, y_train, x_test, num_classes=num_classes, steps=steps, l2=l2)
    return float(np.mean(pred == y_test))


def logistic_predict(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    *,
    num_classes: int,
    steps: int = 500,
    l2: float = 1e-3,
) -> np.ndarray:
    """Predicted classes of ``x_test`` by the logistic regression of `logistic_probe`."""
    mu, sd = x_train.mean(0), x_train.std(0) + 1e-6
    xtr, xte = jnp.asarray((x_train - mu) / sd), jnp.asarray((x_test - mu) / sd)
    ytr = jnp.asarray(y_train)
    k = num_classes
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
    return np.asarray(jnp.argmax(xte @ params[0] + params[1], axis=1))


def probe_pretraining(
    config: PretrainConfig, ds: oj.Dataset, models: dict[str, eqx.Module], mesh=None
) -> dict:
    """Linear-probe accuracy of ``config.probe_label`` for each model: ``probe_cells`` labelled cells
    drawn with the run's seed, the first half to fit, the second half held out."""
    codes, rows, fit_idx, test_idx = probe_split(config, ds)
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


def probe_split(
    config: PretrainConfig, ds: oj.Dataset
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The probe's cells: ``(codes, rows, fit, test)`` — the label codes of every cell, ``probe_cells``
    labelled rows drawn with the run's seed (sorted), and the indices into ``rows`` of the half that
    fits the probe and of the held-out half."""
    codes = np.asarray(label_column(ds, config.probe_label, "--probe-label").codes)
    labelled = np.flatnonzero(codes >= 0)
    rng = np.random.default_rng([config.seed, 0x9B0BE])
    rows = np.sort(rng.choice(labelled, size=min(config.probe_cells, len(labelled)), replace=False))
    split = rng.permutation(len(rows))
    return codes, rows, split[: len(rows) // 2], split[len(rows) // 2 :]


def load_pretrained(checkpoint_dir: str | Path) -> tuple[eqx.Module, PretrainConfig, dict]:
    """The model of the latest checkpoint in ``checkpoint_dir`` (either format), its config and meta.

    The run that wrote the folder may still be training there, pruning its old steps (``--keep``): a
    step chosen as the latest can be deleted before its files are read. Then the step that replaced
    it is read instead (up to `READ_ATTEMPTS` tries), not the FileNotFoundError of the deleted file."""
    root = Path(checkpoint_dir)
    if root.name.startswith("step-") and any(root.parent.glob("step-*/state.eqx")):
        msg = f"{root} is one step of a pretraining run: give the run's directory, {root.parent} (its latest step is used)"
        raise TrainError(msg)
    if not root.is_dir():  # before Orbax's store, which would make the folder
        msg = f"{root} is no folder: give a pretraining run's --checkpoint-dir"
        raise TrainError(msg)
    fmt = "equinox" if any(root.glob("step-*")) else "orbax"
    for attempt in range(READ_ATTEMPTS):
        time.sleep(0.05 * attempt)  # a step rewritten in place is missing for a moment (`save_checkpoint`)
        try:
            return _load_latest(root, fmt)
        except FileNotFoundError as e:  # the step was pruned by a newer one as it was read
            gone = e
    msg = (
        f"{root}: the latest checkpoint was deleted before it could be read, {READ_ATTEMPTS} times over "
        "(the run writing there prunes its steps as fast as they load): try again, or copy the folder "
        "and pass the copy"
    )
    raise TrainError(msg) from gone


def _load_latest(root: Path, fmt: str) -> tuple[eqx.Module, PretrainConfig, dict]:
    """One try of `load_pretrained`: FileNotFoundError if the step it chose is deleted meanwhile."""
    store = open_checkpoints(
        PretrainConfig("", checkpoint_dir=str(root), checkpoint_format=fmt), writing=False
    )
    try:
        latest = None if store is None else store.latest()
        if latest is None or "vocab_size" not in latest.meta:
            msg = f"{root} holds no pretraining checkpoint (written by omicsio-train pretrain)"
            raise TrainError(msg)
        saved = {k: v for k, v in latest.meta["config"].items() if k in PretrainConfig.__dataclass_fields__}
        config = PretrainConfig(**saved)
        model = build_model(config, latest.meta["vocab_size"], jax.random.key(0))
        total = latest.meta["total_steps"]
        optimizer = pretrain_optimizer(config, total)
        model, _ = latest.load((model, optimizer.init(eqx.filter(model, eqx.is_array))))
        return model, config, latest.meta
    finally:
        if store is not None:
            store.close()


def load_encoder(
    spec: str,
    ds: oj.Dataset,
    *,
    tokens: str | None = None,
    max_len: int | None = None,
    vocab: str | None = None,
    medians: str | None = None,
    special_tokens: bool = True,
    flag: str = "--init",
) -> tuple[eqx.Module, PretrainConfig, str, str | None]:
    """The pretrained model of ``spec`` — ``"hf:DIR"``, ``"scgpt:DIR"`` or an ``omicsio-train pretrain``
    checkpoint directory — with the `PretrainConfig` whose ``output(masked=False)`` tokenizes
    ``ds`` for it, a description of where it came from, and (published checkpoints) the line saying
    how many of the dataset's genes the vocabulary covers. ``flag``: the option that gave ``spec``
    (errors name it); ``"--checkpoint-dir"`` takes a pretraining checkpoint directory only. The token
    options apply to published checkpoints: a pretraining checkpoint tokenizes as its run did, and
    refuses them (`_refuse_token_options`)."""
    if flag == "--checkpoint-dir" or not spec.startswith(("hf:", "scgpt:")):
        if not Path(spec).is_dir():
            what = (
                "not a directory of omicsio-train pretrain checkpoints (a published checkpoint goes in "
                "--init hf:DIR or scgpt:DIR)"
                if flag == "--checkpoint-dir"
                else "not hf:DIR (Geneformer), scgpt:DIR or a directory of omicsio-train pretrain checkpoints"
            )
            msg = f"{flag} {spec}: {what}"
            raise TrainError(msg)
        model, config, meta = load_pretrained(spec)
        given = {"tokens": tokens, "max_len": max_len, "vocab": vocab, "medians": medians}
        _refuse_token_options(config, spec, {**given, "special_tokens": None if special_tokens else False})
        check_read_again(meta, config, f"{flag} {spec}")
        check_gene_order(meta, ds, spec)
        return model, config, f"{config.tokens} {config.init or config.preset}, step {meta['step']}", None
    config = PretrainConfig(
        str(ds.path),
        tokens=tokens or ("scgpt" if spec.startswith("scgpt:") else "geneformer"),
        max_len=max_len,
        mask_prob=0.0,
        vocab=vocab,
        medians=medians,
        special_tokens=special_tokens,
        init=spec,
    )
    config.check_token_options()
    ckpt = open_init(config)
    config = with_init_vocab(config, ckpt)
    probe = oj.make_loader(ds, batch_size=1, output=config.output(masked=False))
    try:
        line = check_vocabulary(config, probe.output.vocabulary, ckpt, ds)
    finally:
        probe.close()
    return ckpt.model, config, f"{config.tokens} from {ckpt.path}", line


def _refuse_token_options(config: PretrainConfig, spec: str, given: dict) -> None:
    """A one-line error naming the first token option of ``given`` (None: not given) and the value the
    pretraining checkpoint ``spec``'s run tokenized with (``config``): such a checkpoint decides them."""
    for name, value in given.items():
        if value is None:
            continue
        saved = config.length if name == "max_len" else getattr(config, name)
        msg = (
            f"{given_option(name, value)}: {spec} is an omicsio-train pretrain checkpoint, which tokenizes "
            f"as its run did ({name}: {'the default' if saved is None else saved}); the token options are "
            f"for a published checkpoint (--init hf:DIR or scgpt:DIR): drop {option_name(name, flags=True)}"
        )
        raise TrainError(msg)
