"""Checkpoints through Orbax's ``CheckpointManager``: model, optimizer, data and run metadata in one step.

    ckpt/200/state/    model + optimizer arrays (``StandardSave``, written asynchronously)
    ckpt/200/data/     the loader's state, one ``process_<i>-of-<n>.json`` per process
                       (``grain.checkpoint.CheckpointSave``, as Grain's and MaxText's loops do)
    ckpt/200/meta/     step, PRNG key data, seed, config, dataset fingerprint, coverage (``JsonSave``)

Orbax publishes a step only once every item is written, so a run killed mid-save leaves the
previous step as the latest. Needs the ``omicsio_jax[orbax]`` extra.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax

import omicsio_jax as oj


def _ocp():
    return oj.MissingExtraError.require("orbax.checkpoint", "orbax", "--checkpoint-format orbax")


@dataclasses.dataclass(frozen=True)
class OrbaxCheckpoint:
    """One published step of an `OrbaxCheckpoints` directory."""

    store: OrbaxCheckpoints
    step: int
    meta: dict

    @property
    def path(self) -> Path:
        return self.store.directory / str(self.step)

    def load(self, like: Any) -> Any:
        """The saved pytree, shaped like ``like``: its arrays restored, the rest taken from ``like``."""
        ocp = self.store.ocp
        arrays = eqx.filter(like, eqx.is_array)
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, arrays)
        restored = self.store.manager.restore(
            self.step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
        )
        return eqx.combine(restored["state"], eqx.filter(like, eqx.is_array, inverse=True))

    def restore_loader(self, loader) -> None:
        """Restore ``loader`` with Grain's handler (the ``data`` item of this step)."""
        import grain

        ocp = self.store.ocp
        self.store.manager.restore(
            self.step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(loader))
        )


class OrbaxCheckpoints:
    """The checkpoints of one run, kept by an Orbax ``CheckpointManager`` (saves are asynchronous)."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3):
        self.ocp = ocp = _ocp()
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest(self) -> OrbaxCheckpoint | None:
        step = self.manager.latest_step()
        if step is None:
            return None
        meta = self.manager.restore(step, args=self.ocp.args.Composite(meta=self.ocp.args.JsonRestore()))[
            "meta"
        ]
        return OrbaxCheckpoint(self, step, meta)

    def save(self, step: int, tree: Any, meta: dict, loader) -> Path:
        """Start saving ``step``: arrays in the background, the loader state and ``meta`` now."""
        import grain

        ocp = self.ocp
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(eqx.filter(tree, eqx.is_array)),
                data=grain.checkpoint.CheckpointSave(loader),
                meta=ocp.args.JsonSave({"step": step, **meta}),
            ),
        )
        return self.directory / str(step)

    def close(self) -> None:
        """Wait for the saves in flight, then release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
