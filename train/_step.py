"""Loss, the jitted training step and the evaluation pass.

Batches arrive sharded over the mesh's ``data`` axis (the loader places them); parameters and
optimizer state are replicated, so XLA inserts the gradient all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import omicsio_jax as oj

from ._metrics import EvalResult, accuracy, macro_f1

TARGET_SUM = 1e4


def normalize_log1p(x: jax.Array, target_sum: float = TARGET_SUM) -> jax.Array:
    """``log1p(x / x.sum(1) * target_sum)`` per row (empty rows stay 0) on the devices: the loader's
    ``normalize="normalize_log1p"``, by the same definition (`omicsio_jax.Normalization`)."""
    return oj.Normalization("normalize_log1p", target_sum).apply(x)


def loss_fn(
    model: eqx.Module, x: jax.Array, labels: jax.Array, mask: jax.Array, key: jax.Array | None
) -> jax.Array:
    """Mean softmax cross-entropy over the real, labelled cells (``mask`` and ``labels >= 0``)."""
    if key is None:
        logits = jax.vmap(model)(x)
    else:
        logits = jax.vmap(lambda xi, ki: model(xi, key=ki))(x, jax.random.split(key, labels.shape[0]))
    valid = mask & (labels >= 0)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
    return jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def make_train_step(
    optimizer: optax.GradientTransformation, *, normalize_on_device: bool = False
) -> Callable:
    """``step(model, opt_state, x, labels, mask, key, step) -> (model, opt_state, loss)``, jitted.

    The dropout key of step ``s`` is ``fold_in(key, s)``: a pure function of the run's key and
    the step, so a resumed run draws the same masks. Pass ``step`` as a numpy scalar array.
    """

    @eqx.filter_jit
    def step(model, opt_state, x, labels, mask, key, step):
        if normalize_on_device:
            x = normalize_log1p(x)
        step_key = jax.random.fold_in(key, step)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, labels, mask, step_key)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


@eqx.filter_jit
def predict(model: eqx.Module, x: jax.Array, normalize_on_device: bool = False) -> jax.Array:
    """Predicted class (int32) of every row of ``x``, in inference mode (no dropout)."""
    if normalize_on_device:
        x = normalize_log1p(x)
    model = eqx.nn.inference_mode(model)
    return jnp.argmax(jax.vmap(model)(x), axis=-1).astype(jnp.int32)


def replicate(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Place every array leaf of ``tree`` on all devices of ``mesh`` (fully replicated)."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    arrays, static = eqx.partition(tree, eqx.is_array)
    return eqx.combine(jax.device_put(arrays, sharding), static)


def _on_host(x: jax.Array) -> np.ndarray:
    """The whole of ``x`` as numpy on this process: a batch placed over several processes' devices
    gathered from all of them (every process then scores every cell, alike)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def evaluate(
    model: eqx.Module, loader: oj.Loader, label: str, *, normalize_on_device: bool = False
) -> EvalResult:
    """Accuracy and macro-F1 over one pass of ``loader`` (padding and unlabelled cells skipped).

    Build the loader as a sequential pass: ``sampling="stream", drop_remainder=False, num_epochs=1``.
    """
    y_true, y_pred = [], []
    for batch in loader:
        pred = _on_host(predict(model, batch.x, normalize_on_device))
        labels, mask = _on_host(batch.obs[label]), _on_host(batch.mask)
        keep = mask & (labels >= 0)
        y_true.append(labels[keep])
        y_pred.append(pred[keep])
    t = np.concatenate(y_true) if y_true else np.zeros(0, np.int32)
    p = np.concatenate(y_pred) if y_pred else np.zeros(0, np.int32)
    return EvalResult(accuracy(t, p), macro_f1(t, p), len(t))
