"""Checkpoints through Orbax's ``CheckpointManager``: model, optimizer, data and run metadata in one step.

    ckpt/200/state/    model + optimizer arrays (a pytree, written asynchronously)
    ckpt/200/data/     the loader's state, one ``process_<i>-of-<n>.json`` per process
                       (``grain.checkpoint.CheckpointSave``, as Grain's and MaxText's loops do)
    ckpt/200/meta/     step, PRNG key data, seed, config, dataset fingerprint, coverage (``JsonSave``)

Orbax publishes a step only once every item is written, so a run killed mid-save leaves the
previous step as the latest. Needs the ``omicsio_jax[orbax]`` extra.

In one process the arrays are written without Orbax's replica-parallel split (`_state_handler`):
that split has each replica of a replicated array write a slice of it, which spreads the writes of
several hosts, but within one process it only adds a device slice per leaf and replica (each a
compile on first use: ~5 s of a tiny model's first save on 8 CPU devices, ~2 s of every later one).
Several processes keep Orbax's default.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

import omicsio_jax as oj

from ._checkpoint import lock_writer


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
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        restored = self.store.manager.restore(
            self.step,
            args=ocp.args.Composite(state=ocp.args.PyTreeRestore(target, restore_args=restore_args)),
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
    """The checkpoints of one run, kept by an Orbax ``CheckpointManager`` (saves are asynchronous).
    The run that writes them (``writing``) holds the directory's writer lock (`lock_writer`, taken
    by the first process before the manager opens: Orbax saving a step deletes the step's unfinished
    temporary folder, a running writer's save in progress among them) until `close`; a reader takes
    none."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3, writing: bool = True):
        self.ocp = ocp = _ocp()
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True)
        handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()  # the other items: Orbax's own
        state = _state_handler(ocp)
        handlers.add("state", ocp.args.PyTreeSave, state)
        handlers.add("state", ocp.args.PyTreeRestore, state)
        self._lock = lock_writer(self.directory) if writing and jax.process_index() == 0 else None
        try:  # the lock goes with a manager that could not be opened
            self.manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=handlers)
        except BaseException:
            if self._lock is not None:
                os.close(self._lock)
            raise

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
                state=ocp.args.PyTreeSave(eqx.filter(tree, eqx.is_array)),
                data=grain.checkpoint.CheckpointSave(loader),
                meta=ocp.args.JsonSave({"step": step, **meta}),
            ),
        )
        return self.directory / str(step)

    def close(self) -> None:
        """Wait for the saves in flight, then release the manager and the writer lock."""
        try:
            self.manager.wait_until_finished()
            self.manager.close()
        finally:
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None


def _state_handler(ocp):
    """The ``state`` item's handler: Orbax's pytree handler, its arrays written without the
    replica-parallel split when this is the only process (see the module docstring)."""
    if jax.process_count() > 1:
        return ocp.PyTreeCheckpointHandler()
    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        (int, th.ScalarHandler()),
        (float, th.ScalarHandler()),
        (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler()),
        (jax.Array, th.ArrayHandler(use_replica_parallel=False)),
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
