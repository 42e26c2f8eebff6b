"""Loader state: the config check every loader applies on restore, and the per-process state files.

A state is small JSON: ``{"version", "config", ...position...}``. ``config`` holds what decides
the batches (dataset fingerprint and every sampling/output knob); restoring a state whose config
differs is refused with one line per difference, "in checkpoint" beside "in loader".

Grain's checkpoint handler and Orbax write one ``process_<i>-of-<n>.json`` per process;
`read_loader_states` reads all of a checkpoint's files, which is what an elastic restore (another
number of processes) needs.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import numpy as np

from omicsio_jax.core.errors import OmicsIOError, StateMismatchError

_PROCESS_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def as_json(config: dict) -> dict:
    """``config`` as it comes back from JSON (numpy scalars as Python numbers, tuples as lists): a
    knob given as ``np.int64(3)`` neither breaks a checkpoint's ``json.dumps`` nor differs from the
    state it was saved into."""

    def plain(value):
        if isinstance(value, np.generic):
            return value.item()
        msg = f"loader config value {value!r} ({type(value).__name__}) is not JSON: pass an int, float or str"
        raise TypeError(msg)

    return json.loads(json.dumps(config, default=plain))


def process_states(state) -> list:
    """What a loader's ``set_state`` was given (one process's state, or every process's in a list,
    as `read_loader_states` returns them) as a list of states; a state that is no dict, or bytes or
    a string in place of one (a Grain DataLoader iterator's own state), is a one-line
    `StateMismatchError`."""
    states = [state] if isinstance(state, dict) else state
    if isinstance(states, list | tuple) and states and all(isinstance(s, dict) for s in states):
        if any("inner" in s and "epoch" not in s for s in states):
            msg = (
                "this is a prefetch_to_device iterator's state (the loader's is its 'inner'): give it to "
                "that iterator's set_state, or pass state['inner'] to the loader's"
            )
            raise StateMismatchError(msg)
        if any("last_seen_indices" in s and "epoch" not in s for s in states):
            msg = (
                "this is a Grain DataLoader iterator's state (make_grain_loader's): it restores into such an "
                "iterator; make_loader serves the same batches but keeps a state of its own"
            )
            raise StateMismatchError(msg)
        return list(states)
    if isinstance(state, bytes | bytearray | str):
        got = f"{type(state).__name__} (a Grain DataLoader iterator's state? it goes to that iterator's set_state)"
    elif isinstance(state, list | tuple):
        got = f"a list holding {_kinds(state)}" if state else "an empty list"
    else:
        got = type(state).__name__
    msg = f"a loader state is the dict its get_state returned (or a list of every process's), not {got}"
    raise StateMismatchError(msg)


def _kinds(items) -> str:
    return ", ".join(sorted({type(s).__name__ for s in items}))


# config keys a state may differ in: how many epochs a run goes decides no batch, so a run resumes
# with more (or endless) epochs; `check_within_run` refuses a state past the new end
RUN_LENGTH_KEYS = frozenset({"num_epochs"})


def check_state(state: dict, version: int, config: dict) -> None:
    """Refuse a loader state of another version, or one whose config differs (showing both sides),
    `RUN_LENGTH_KEYS` aside."""
    if not isinstance(state, dict):
        states = process_states(state)  # raises, naming what it is, unless a list of states
        msg = f"this loader restores from one state (the dict its get_state returned), not a list of {len(states)}"
        raise StateMismatchError(msg)
    if state.get("version") != version:
        got = state.get("version")
        msg = f"loader state version {got!r} is not {version}: it was written by another loader or release"
        raise StateMismatchError(msg)
    theirs = state["config"]
    diffs = [  # keys as JSON writes them: a control character in a damaged key breaks no line
        f"  {json.dumps(str(k))[1:-1]}: in checkpoint {theirs.get(k)!r}, in loader {config.get(k)!r}"
        for k in sorted(set(config) | set(theirs))
        if config.get(k) != theirs.get(k) and k not in RUN_LENGTH_KEYS
    ]
    if diffs:
        msg = "loader state does not match this loader:\n" + "\n".join(diffs)
        raise StateMismatchError(msg)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_within_run(state: dict, num_epochs: int | None) -> None:
    """Refuse a state that stands past the end of a run of ``num_epochs`` (None: endless): a run
    resumes with more epochs than it was saved with, not with fewer than it has served."""
    epoch, step = state["epoch"], state["step"]
    if num_epochs is not None and (epoch > num_epochs or (epoch == num_epochs and step > 0)):
        msg = (
            f"the loader state stands at epoch {epoch}, step {step}, past the end of this loader's "
            f"num_epochs={num_epochs}: pass num_epochs={epoch + 1} or more (None: endless) to go on from it"
        )
        raise StateMismatchError(msg)


def check_positions(states: list) -> None:
    """Refuse, in one line, a state whose position fields are not what `get_state` writes: ``epoch``
    and ``step`` non-negative integers, ``anchor`` and ``process`` pairs of integers (the anchor's
    hosts at least 1), ``served`` a count and a 64-bit checksum (values that would otherwise reach a
    message or an index as they are, or fail an epoch's audit later as cells not served)."""
    for s in states:
        if not isinstance(s, dict):
            msg = f"malformed loader state: a dict, not {type(s).__name__}"
            raise StateMismatchError(msg)
        for name in ("epoch", "step"):
            if not _is_int(s.get(name)) or s[name] < 0:
                msg = f"malformed loader state: {name} must be a non-negative integer, got {s.get(name)!r}"
                raise StateMismatchError(msg)
        for name in ("anchor", "process"):
            pair = s.get(name)
            if not isinstance(pair, list) or len(pair) != 2 or not all(_is_int(v) and v >= 0 for v in pair):
                msg = f"malformed loader state: {name} must be two non-negative integers, got {pair!r}"
                raise StateMismatchError(msg)
        if s["process"][0] >= s["process"][1]:
            msg = f"malformed loader state: process {s['process'][0]} of {s['process'][1]}"
            raise StateMismatchError(msg)
        if s["anchor"][1] < 1:
            msg = f"malformed loader state: anchor {s['anchor']} names no process that began its round"
            raise StateMismatchError(msg)
        served = s.get("served")
        if (
            not isinstance(served, list)
            or len(served) != 2
            or not all(_is_int(v) and 0 <= v < 1 << 64 for v in served)
        ):
            msg = (
                f"malformed loader state: served must be a count and a checksum, two integers in "
                f"[0, 2**64), got {served!r} (a JSON reader that made them floats loses the checksum's digits)"
            )
            raise StateMismatchError(msg)


def reads_state(set_state):
    """Make a loader's ``set_state`` refuse a malformed state (a missing key, a value of the wrong
    type, from a damaged or hand-edited checkpoint) with a one-line `StateMismatchError`."""

    @functools.wraps(set_state)
    def checked(self, state, *args, **kwargs):
        try:
            return set_state(self, state, *args, **kwargs)
        except OmicsIOError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
            msg = (
                f"malformed loader state ({type(e).__name__}: {e}): pass what the loader's get_state "
                "returned, or oj.read_loader_states(directory)"
            )
            raise StateMismatchError(msg.replace("\n", " ")) from e

    return checked


def read_loader_states(directory: str | os.PathLike[str]) -> list[dict]:
    """Every process's loader state in a checkpoint directory, ordered by process index.

    >>> states = oj.read_loader_states("ckpt/200/data")     # written with 2 processes  # doctest: +SKIP
    >>> loader.set_state(states)         # this run has 1 (or 4): the epoch continues exactly  # doctest: +SKIP

    ``directory`` holds the ``process_<i>-of-<n>.json`` files that ``grain.checkpoint.CheckpointSave``
    or Orbax's ``save_checkpointables`` wrote. Raises `StateMismatchError` if a process's file is
    missing or files of two different process counts are mixed.
    """
    root = Path(directory)
    found: dict[int, set[int]] = {}
    for entry in root.iterdir() if root.is_dir() else ():
        m = _PROCESS_FILE.fullmatch(entry.name)
        if m:
            found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    if len(found) != 1:
        what = "no process_<i>-of-<n>.json file" if not found else f"files of {sorted(found)} processes mixed"
        msg = f"{root}: {what}; pass the directory a loader state was saved into"
        raise StateMismatchError(msg)
    ((count, indices),) = found.items()
    missing = sorted(set(range(count)) - indices)
    if missing:
        msg = f"{root}: the states of process(es) {missing} of {count} are missing"
        raise StateMismatchError(msg)
    states = []
    for i in range(count):
        path = root / f"process_{i}-of-{count}.json"
        try:
            states.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            msg = f"cannot read the loader state {path}: {e}"
            raise StateMismatchError(msg.replace("\n", " ")) from e
    return states
