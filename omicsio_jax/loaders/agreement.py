"""That every JAX process made the same loader (`check_processes_agree`).

Each process of a multi-host job makes its own loader and serves its share of each global batch.
Processes that disagree on what decides the batches (another seed, batch size, sampling, dataset or
output) serve shares of different batches: cells twice and others never, with every process's own
audit complete, or a process waiting forever in a collective for a step the others never take. So a
loader placed on a mesh over several JAX processes compares its config with the others' once, when
it is made (one small all-gather of fixed size), and refuses in one line, naming the settings that
differ.
"""

from __future__ import annotations

import hashlib
import json

import jax
import numpy as np

from omicsio_jax.core.errors import OmicsIOError

# the settings compared one by one (named in the message); the rest of the config is compared as one
_NAMED = (
    "dataset",
    "batch_size",
    "sampling",
    "block_size",
    "fetch_factor",
    "seed",
    "drop_remainder",
    "num_epochs",
    "num_rows",
    "rows",
    "obs",
    "output",
)


def _digests(config: dict) -> np.ndarray:
    """A uint32 digest of each of `_NAMED` and one of every other key together: the same length
    whatever the config holds, so that processes whose configs differ in their keys still gather."""

    def digest(value) -> int:
        text = json.dumps(value, sort_keys=True, default=str).encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:4], "little")

    rest = {k: v for k, v in config.items() if k not in _NAMED}
    return np.array([*(digest(config.get(k)) for k in _NAMED), digest(rest)], np.uint32)


def processes_share(placement) -> bool:
    """Whether a loader's batches are global arrays over several JAX processes (a mesh, JAX's
    processes): every process must then make it, and they are compared. A loader without a mesh is
    not compared: its host batches are this process's share of each batch (``batch_size /
    process_count`` rows, for `place_batch` or Grain to assemble), and a collective would wait
    forever where only some processes make one; one process loading every cell alone (an
    evaluation on process 0) passes ``Placement(process_index=0, process_count=1)``."""
    return placement.mesh is not None and placement.process_count is None and jax.process_count() > 1


def check_processes_agree(config: dict, what: str) -> None:
    """Refuse, on every process, a loader whose ``config`` (what decides its batches) differs from
    another JAX process's; ``what`` names the loader in the message. Only with several JAX
    processes (`jax.process_count` above 1); every process must call it, as every one makes its
    loader."""
    if jax.process_count() < 2:
        return
    from jax.experimental import multihost_utils

    mine = _digests(config)
    every = np.asarray(multihost_utils.process_allgather(mine))  # (processes, keys)
    differ = np.any(every != every[:1], axis=0)
    if not differ.any():
        return
    names = [*_NAMED, "other settings"]
    which = [names[k] for k in np.flatnonzero(differ)]
    others = [p for p in range(len(every)) if np.any(every[p] != mine)]
    shown = {k: config.get(k) for k in which if k in config}
    msg = (
        f"{what}: the JAX processes made different loaders: {', '.join(which)} differ between this "
        f"process ({jax.process_index()}: {json.dumps(shown, default=str)}) and process(es) "
        f"{', '.join(map(str, others))}; every process must make the same loader (its share of each "
        "global batch is cut from the same plan)"
    )
    raise OmicsIOError(msg)
