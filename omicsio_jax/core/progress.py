"""The project's progress bars: tqdm's, redrawn in place in a terminal or a notebook, and in a log
file (a batch job's stderr) written as a line now and then.

tqdm redraws a bar up to ten times a second with a carriage return. A terminal shows the last
redraw; a file keeps them all on one line: a two-hour conversion wrote tens of thousands of redraws
(600 a minute) between two newlines, and a note printed meanwhile ran on after the bar. Written to
a file or a pipe, a `progress_bar` writes its state as a line of its own when it starts, every
``$OMICSIO_JAX_PROGRESS_INTERVAL`` seconds (default `LOG_INTERVAL`) and when it ends.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm import autonotebook, std
from tqdm.auto import tqdm

from omicsio_jax.core.errors import OmicsIOError

LOG_INTERVAL = 30.0
INTERVAL_ENV = "OMICSIO_JAX_PROGRESS_INTERVAL"  # seconds between a bar's lines in a log file
_WIDGETS = autonotebook.tqdm is not std.tqdm  # tqdm.auto's choice in a Jupyter kernel: no stream to check


def progress_bar(
    iterable: Iterable | None = None, *, progress: bool = True, file: TextIO | None = None, **options: Any
) -> tqdm:
    """``tqdm.auto.tqdm(iterable, **options)`` on ``file`` (default: stderr), or no bar with
    ``progress=False``. On a file or pipe (not a terminal, nor a notebook's output) the bar is a line
    every `log_interval` seconds, its first and last state included.

    >>> with progress_bar(total=num_cells, unit="cells", desc="stats", progress=progress) as bar:  # doctest: +SKIP
    ...     bar.update(n)
    """
    stream = sys.stderr if file is None else file
    if progress and not _WIDGETS and _is_log(stream):
        interval = log_interval()  # tqdm's monitor thread redraws a bar still after twice that
        options |= {"mininterval": interval, "maxinterval": 2 * interval}
        stream = _LogLines(stream)
    return tqdm(iterable, disable=not progress, file=stream, **options)


def log_interval() -> float:
    """Seconds between a bar's lines in a log file: ``$OMICSIO_JAX_PROGRESS_INTERVAL``, else
    `LOG_INTERVAL` (``0``: a line at every update)."""
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return LOG_INTERVAL
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds < math.inf:
        msg = f"{INTERVAL_ENV}={text!r} is not a number of seconds >= 0: set it to, e.g., 60"
        raise OmicsIOError(msg)
    return seconds


def _is_log(stream: object) -> bool:
    """Whether ``stream`` is a file or a pipe: not a terminal, nor a Jupyter kernel's stream (no
    terminal either, but a notebook redraws a bar in place)."""
    if type(stream).__module__.partition(".")[0] == "ipykernel":
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return isatty is not None and not isatty()
    except ValueError:  # closed
        return False


class _LogLines:
    """``stream`` as tqdm's bar sees it, writing each redraw (``"\\r" + bar``) as a line: a file
    cannot take a line back, so tqdm's clearing (``"\\r"``, blanks) and the newline that closes its
    last redraw are left out."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        line = text.lstrip("\r").rstrip()
        if line:
            self._stream.write(line + "\n")

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # encoding (unicode bars), fileno (width), ...
        return getattr(self._stream, name)
