"""What the two pretraining models share around their encoder: the length check on a cell's tokens
(a batch longer than the model's ``max_len`` is a one-line error naming the fix) and the pooling of
hidden states into cell embeddings (the CLS position, or the mean over real, non-special tokens),
with the check on the ``pool`` option. `GeneformerModel` and `ScGPTModel` both import them.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ._errors import TrainError


def _check_pool(pool: str) -> None:
    if pool not in ("cls", "mean"):
        msg = f"pool must be 'cls' or 'mean'; got {pool!r} (Geneformer V1 rows have no CLS: pool='mean')"
        raise TrainError(msg)


def _pool(
    hidden: jax.Array, real: jax.Array, pool: str, ids: jax.Array, special_ids: Sequence[int]
) -> jax.Array:
    """Position 0 (``pool="cls"``) or the mean over ``real`` positions whose id is not special."""
    if pool == "cls":
        return hidden[:, 0]
    for special in special_ids:
        real = real & (ids != special)
    w = real.astype(jnp.float32)
    return jnp.einsum("bld,bl->bd", hidden, w) / jnp.maximum(w.sum(1), 1.0)[:, None]


def _check_length(length: int, max_len: int) -> None:
    if length > max_len:
        msg = (
            f"batch has L={length} positions but the model was built with max_len={max_len}; "
            f"rebuild it with make_pretrain_model(..., max_len={length})"
        )
        raise TrainError(msg)
