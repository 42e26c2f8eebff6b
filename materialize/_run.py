"""What every runner of a job's partitions shares, and the simplest runner: the callbacks it reports
to (`Progress`, cells written; `Done`, a partition complete), the `RunReport` it returns, and a
worker's error sent back as a reply (`error_reply`) and raised here with its message
(`raise_worker_error`); `run_in_process` writes the partitions in this process. The runners on
workers are the local process pool (`_pool`) and a Dask cluster (`_dask`).
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable, Sequence

from omicsio_jax import DataValidationError, OmicsIOError

from ._partition import Job, write_partition
from ._plan import Partition
from ._scratch import Scratch

Progress = Callable[[int], None]
Done = Callable[[int], None]  # a partition (its index) is complete


@dataclasses.dataclass
class RunReport:
    """How the partitions were run: by how many workers, and which were written again."""

    workers: int
    redone: list[int] = dataclasses.field(default_factory=list)


def run_in_process(
    job: Job, partitions: Sequence[Partition], progress: Progress, *, on_done: Done | None = None
) -> RunReport:
    with Scratch() as scratch:
        for part in partitions:
            write_partition(job, part, progress, scratch=scratch)
            if on_done is not None:
                on_done(part.index)
    return RunReport(1)


def error_reply(e: BaseException) -> tuple:
    kind = (
        "data"
        if isinstance(e, DataValidationError)
        else "omicsio"
        if isinstance(e, OmicsIOError)
        else "crash"
    )
    text = str(e) if kind != "crash" else "".join(traceback.format_exception(e)).strip()
    return ("error", kind, text)


def raise_worker_error(kind: str, text: str, part: Partition | None):
    where = part.describe() if part is not None else "a partition"
    raise worker_error(kind, text, f"writing {where}")


def worker_error(kind: str, text: str, what: str) -> Exception:
    """A worker's ``("error", kind, text)`` as the exception to raise here: ours with their message,
    any other with its traceback (``what``: what the worker was doing)."""
    if kind == "data":
        return DataValidationError(text)
    if kind == "omicsio":
        return OmicsIOError(text)
    return OmicsIOError(f"{what} failed in a worker process:\n{text}")
