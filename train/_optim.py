"""The pretraining optimizer (AdamW with warmup and decay, weight decay on matrices only), the jitted
step, and the FLOPs count used for MFU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import optax

from ._errors import TrainError
from ._layers import TransformerConfig, resolve_preset

KINDS = ("geneformer", "scgpt")


def _decay_mask(params: Any) -> Any:
    """True for matrices (Linear and Embedding weights), False for biases and LayerNorm parameters
    (the Hugging Face Trainer's rule)."""

    def is_node(x):
        return isinstance(x, (eqx.nn.LayerNorm, eqx.nn.Linear)) or eqx.is_array(x)

    def mark(node):
        if isinstance(node, eqx.nn.LayerNorm):
            return jax.tree.map(lambda _: False, node)
        if isinstance(node, eqx.nn.Linear):
            return eqx.tree_at(lambda lin: lin.weight, jax.tree.map(lambda _: False, node), True)
        return node.ndim >= 2  # embedding matrices; 1-D arrays (the decoder bias) are not decayed

    return jax.tree.map(mark, params, is_leaf=is_node)


def make_optimizer(
    lr: float,
    *,
    warmup_steps: int,
    total_steps: int,
    schedule: str = "cosine",
    weight_decay: float = 0.01,
    clip_norm: float = 1.0,
) -> optax.GradientTransformation:
    """``clip_by_global_norm(clip_norm)`` then AdamW whose learning rate rises linearly from 0 to ``lr``
    over ``warmup_steps`` and decays to 0 at ``total_steps`` (``"cosine"`` or ``"linear"``). Weight decay
    applies to weight matrices only, not to biases or LayerNorm parameters."""
    if schedule not in ("cosine", "linear"):
        msg = f"schedule must be 'cosine' or 'linear'; got {schedule!r}"
        raise TrainError(msg)
    if not 0 <= warmup_steps < total_steps:
        msg = (
            f"need 0 <= warmup_steps < total_steps; got warmup_steps={warmup_steps}, "
            f"total_steps={total_steps}"
        )
        raise TrainError(msg)
    if schedule == "cosine":
        lr_at = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, total_steps, end_value=0.0)
    else:
        lr_at = optax.join_schedules(
            [
                optax.linear_schedule(0.0, lr, warmup_steps),
                optax.linear_schedule(lr, 0.0, total_steps - warmup_steps),
            ],
            [warmup_steps],
        )
    return optax.chain(
        optax.clip_by_global_norm(clip_norm), optax.adamw(lr_at, weight_decay=weight_decay, mask=_decay_mask)
    )


def make_pretrain_step(optimizer: optax.GradientTransformation) -> Callable:
    """``step(model, opt_state, batch, key, step) -> (model, opt_state, loss)``, jitted.

    ``batch`` is the token-batch dict of either model; the dropout key of step ``s`` is
    ``fold_in(key, s)``, so a resumed run draws the same masks. Pass ``step`` as a numpy scalar
    array (a Python int would recompile every step). Initialise ``opt_state`` with
    ``optimizer.init(eqx.filter(model, eqx.is_array))``.
    """

    @eqx.filter_jit
    def step(model, opt_state, batch, key, step):
        step_key = jax.random.fold_in(key, step)
        loss, grads = eqx.filter_value_and_grad(lambda m: m.loss(batch, key=step_key))(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


def flops_per_cell(
    kind: str,
    preset: str | TransformerConfig,
    seq_len: int,
    *,
    vocab_size: int = 0,
    max_predictions: int | None = None,
) -> float:
    """Training FLOPs (forward + backward) of one cell of ``seq_len`` positions, for MFU.

    The usual accounting (Kaplan et al. 2020; PaLM appendix B): a weight matrix of ``N`` entries costs
    ``6·N`` FLOPs per token it is applied to (2 forward, 4 backward), and self-attention adds
    ``12·n_layers·L·d`` per token (QKᵀ and AV). With ``n`` = num_layers, ``d`` = width,
    ``f`` = mlp_width:

        encoder   L · (6·n·(4d² + 2d·f) + 12·n·L·d)
        geneformer head   6·P·(d² + d·V),  P = max_predictions or L,  V = vocab_size
        scgpt value encoder + decoder + MVC decoder   6·L·(d + 3d² + d) + 6·L·(2d² + d)

    Embedding lookups, biases, LayerNorm, softmax and activations are not counted. Padded positions
    are counted: the model computes over all ``L`` slots.
    """
    if kind not in KINDS:
        msg = f"kind must be one of {', '.join(KINDS)}; got {kind!r}"
        raise TrainError(msg)
    cfg = resolve_preset(preset)
    n, d, f, length = cfg.num_layers, cfg.width, cfg.mlp_width, seq_len
    total = length * (6 * n * (4 * d * d + 2 * d * f) + 12 * n * length * d)
    if kind == "geneformer":
        if vocab_size < 1:
            msg = f"geneformer needs vocab_size >= 1 for its decoder FLOPs; got vocab_size={vocab_size}"
            raise TrainError(msg)
        positions = length if max_predictions is None else min(max_predictions, length)
        return float(total + 6 * positions * (d * d + d * vocab_size))
    return float(total + 6 * length * (5 * d * d + 3 * d))
