"""Preemption: SIGTERM (what spot instances, Kubernetes and Slurm send before they kill a job) asks
the training loop to stop at the next step boundary, with a checkpoint, instead of dying mid-step.

    with Preemption() as preempted:
        for step in ...:
            ...one step, its metrics and scheduled checkpoint...
            if preempted.requested:
                save(step)   # unless this step was just saved
                break

The handler only sets a flag (a signal handler must not touch JAX or files); the loop finishes the
step it is in, writes the checkpoint and returns normally, so the command exits 0 and a later
``--resume`` continues bit-exactly from that step. A second SIGTERM while saving is ignored: the
checkpoint being written is the point. The previous handlers are restored on exit. Off the main
thread (a notebook's worker thread) no handler can be installed and ``requested`` stays False.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Self


class Preemption:
    """Context manager: ``requested`` turns True when one of ``signals`` arrives (default SIGTERM);
    ``stopped``, once the loop has stopped for it (`stop`)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)):
        self.signals = signals
        self.requested = False
        self.stopped = False
        self.signal_name: str | None = None
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def stop(
        self,
        step: int,
        total: int,
        *,
        save: Callable[[int], Path] | None,
        saved: bool,
        last_saved: Path | None,
        say: Callable[[str], None],
        before: str | None = None,
    ) -> Path | None:
        """At a step boundary after a signal: checkpoint ``step`` with ``save`` (None: no checkpoint
        directory) unless it was just ``saved``, say so, and return the run's last checkpoint.
        ``before``: the work after the last step that the stop skips (the evaluation), named in the
        message, for a signal that came once no step was left to take: a run that exits 0 having
        skipped it must say so, as ``--resume`` is what does it."""
        if save is not None and not saved:
            last_saved = save(step)
        where = (
            f"checkpoint {last_saved}, continue with --resume"
            if save is not None
            else "no --checkpoint-dir, nothing saved"
        )
        skipped = f", before {before}" if before else ""
        say(f"{self.signal_name}: stopped after step {step}/{total}{skipped}; {where}")
        self.stopped = True
        return last_saved

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
