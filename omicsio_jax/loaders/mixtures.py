"""A new mixture at resume: a `Mixture`'s weights may change between a checkpoint and the run that
restores it. The epoch the checkpoint stands in is finished as it began (its batches replay exactly,
each of its cells served once), and the new weights take effect with the next epoch; the loader's
state records every mixture and the epoch it took effect at (``"mixtures"``)."""

from __future__ import annotations

from omicsio_jax.loaders.state import RUN_LENGTH_KEYS
from omicsio_jax.sampling.options import Mixture, Sampling

# what a Mixture's weights decide in a loader's config: the weights, and the rows they keep
_MIXTURE_KEYS = {"mixture", "rows", "num_rows", "weights"}


def mixture_config(sampling: Sampling) -> dict:
    """The config entry of a `Mixture` (its group column and weights); empty for other samplings."""
    if not isinstance(sampling, Mixture):
        return {}
    return {"mixture": {"by": sampling.by, "weights": dict(sorted(sampling.weights.items()))}}


def changed_mixture(theirs: dict, ours: dict) -> dict[str, float] | None:
    """The checkpoint's weights when its config differs from this loader's in its mixture's weights
    alone (a new mixture at resume), else None."""
    a, b = theirs.get("mixture"), ours.get("mixture")
    if not a or not b or a.get("by") != b.get("by") or a.get("weights") == b.get("weights"):
        return None
    differ = {k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k)} - RUN_LENGTH_KEYS
    return dict(a["weights"]) if differ <= _MIXTURE_KEYS else None


def history(state: dict, until: int) -> list[dict]:
    """The mixtures a state records as taking effect before epoch ``until`` (a state of a run that
    never changed its mixture: its own, from epoch 0)."""
    recorded = state.get("mixtures") or [{"from_epoch": 0, "weights": state["config"]["mixture"]["weights"]}]
    return [dict(m) for m in recorded if m["from_epoch"] < until]
