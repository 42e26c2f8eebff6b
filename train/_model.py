"""Classifiers over a cell's expression vector (Equinox modules, applied to one cell; vmap for batches)."""

from __future__ import annotations

import equinox as eqx
import jax

from ._errors import TrainError

MODELS = ("linear", "mlp")


class LinearClassifier(eqx.Module):
    """Logits = W·x + b (multinomial logistic regression)."""

    linear: eqx.nn.Linear

    def __init__(self, num_features: int, num_classes: int, *, key: jax.Array):
        self.linear = eqx.nn.Linear(num_features, num_classes, key=key)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """Logits ``(num_classes,)`` of one cell ``x`` ``(num_features,)``; ``key`` is unused."""
        del key
        return self.linear(x)


class MLPClassifier(eqx.Module):
    """One hidden ReLU layer, optional dropout after it, then a linear read-out."""

    hidden: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    readout: eqx.nn.Linear

    def __init__(
        self, num_features: int, num_classes: int, *, hidden: int = 256, dropout: float = 0.0, key: jax.Array
    ):
        k1, k2 = jax.random.split(key)
        self.hidden = eqx.nn.Linear(num_features, hidden, key=k1)
        self.dropout = eqx.nn.Dropout(dropout)
        self.readout = eqx.nn.Linear(hidden, num_classes, key=k2)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """Logits of one cell; ``key`` drives dropout (needed in training when dropout > 0)."""
        h = jax.nn.relu(self.hidden(x))
        return self.readout(self.dropout(h, key=key))


def make_model(
    name: str, *, num_features: int, num_classes: int, hidden: int = 256, dropout: float = 0.0, key: jax.Array
) -> eqx.Module:
    """``"linear"`` (`LinearClassifier`) or ``"mlp"`` (`MLPClassifier`)."""
    if name == "linear":
        return LinearClassifier(num_features, num_classes, key=key)
    if name == "mlp":
        if hidden < 1 or not 0.0 <= dropout < 1.0:
            msg = f"mlp needs hidden >= 1 and 0 <= dropout < 1; got hidden={hidden}, dropout={dropout}"
            raise TrainError(msg)
        return MLPClassifier(num_features, num_classes, hidden=hidden, dropout=dropout, key=key)
    msg = f"model must be one of {', '.join(MODELS)}; got {name!r}"
    raise TrainError(msg)
