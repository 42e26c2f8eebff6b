"""Running partitions on a Dask cluster: one task per partition, each calling `write_partition` on a
worker thread with that thread's `Scratch` for the run; a data error is returned (not raised, so
Dask does not retry it) and raised here as the local pool raises a worker's (`_run`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence

from omicsio_jax import DataValidationError, OmicsIOError
from omicsio_jax.format import is_remote, require

from ._partition import Job, PartResult, write_partition
from ._plan import Partition
from ._run import Done, Progress, RunReport, error_reply, raise_worker_error
from ._scratch import Scratch


@dataclasses.dataclass(frozen=True)
class TaskError:
    """A data error found by a Dask task: returned, not raised, so Dask does not retry it."""

    kind: str
    text: str


# A Dask worker thread's `Scratch` for one run, keyed by (run token, thread id): its partitions reuse
# the statistics table and the shard writer as a pool worker's do. `release_dask_scratch` (run on
# every worker when the run ends) closes them; a thread starting another run closes its old ones.
_DASK_SCRATCH: dict[tuple[str, int], Scratch] = {}
# Tasks of each run still running on this worker: a run that stops early waits for them, so that no
# task writes into its output after the run has removed what it wrote.
_DASK_RUNNING: dict[str, int] = {}
_DASK_STOPPED: set[str] = set()  # runs stopped early: a task of theirs that starts now writes nothing
_DASK_LOCK = threading.Lock()


def _close_dask_scratch(keep: Callable[[str, int], bool]) -> int:
    """Close the scratches whose (token, thread) ``keep`` refuses; return how many. The keys are
    copied first (`list` of a dict is atomic): other threads of the worker may be adding theirs."""
    closed = [key for key in list(_DASK_SCRATCH) if not keep(*key)]
    for key in closed:
        _DASK_SCRATCH.pop(key).close()
    return len(closed)


def dask_task(job: Job, part: Partition) -> PartResult | TaskError:
    with _DASK_LOCK:
        if job.token in _DASK_STOPPED:
            return TaskError("omicsio", "the run was stopped")
        _DASK_RUNNING[job.token] = _DASK_RUNNING.get(job.token, 0) + 1
    try:
        thread = threading.get_ident()
        # left by a run whose end this worker never heard of
        _close_dask_scratch(lambda token, owner: owner != thread or token == job.token)
        scratch = _DASK_SCRATCH.setdefault((job.token, thread), Scratch())  # this thread's alone
        return write_partition(job, part, scratch=scratch)
    except (DataValidationError, OmicsIOError) as e:
        return TaskError(*error_reply(e)[1:])
    finally:
        with _DASK_LOCK:
            _DASK_RUNNING[job.token] -= 1
            if not _DASK_RUNNING[job.token]:
                del _DASK_RUNNING[job.token]


def stop_dask_run(token: str) -> int:
    """Let no further task of run ``token`` start on this Dask worker; return how many still run (a
    cancelled task runs on)."""
    with _DASK_LOCK:
        _DASK_STOPPED.add(token)
        return _DASK_RUNNING.get(token, 0)


def _the_job(job: Job) -> Job:
    return job


def release_dask_scratch(token: str) -> int:
    """Close this Dask worker's scratches of run ``token``; return how many there were."""
    return _close_dask_scratch(lambda run, _: run != token)


def run_on_dask(
    job: Job,
    partitions: Sequence[Partition],
    progress: Progress,
    *,
    address: str | None = None,
    scheduler_file: str | None = None,
    retries: int = 3,
    on_done: Done | None = None,
) -> RunReport:
    """Write ``partitions`` as tasks on the Dask cluster at ``address`` (or ``scheduler_file``), with
    ``retries``; a worker lost mid-task has its task run again elsewhere by the scheduler."""
    distributed = require(
        "distributed", "distributed", "a Dask cluster (--dask-scheduler, workers=Dask(...))"
    )
    Client, as_completed = distributed.Client, distributed.as_completed
    if scheduler_file is not None:
        address = _address_in(scheduler_file)
    _probe_scheduler(address, scheduler_file)
    try:
        client = Client(address, timeout="30s")
    except (OSError, ValueError) as e:
        msg = f"cannot reach the Dask scheduler at {address}: {e}"
        raise OmicsIOError(msg) from e
    except Exception as e:  # noqa: BLE001 - another server there: a frame of its answer read as a size
        msg = (
            f"the server at {address} does not answer as a Dask scheduler ({type(e).__name__}: {e}); "
            "give the scheduler's address (port 8786 by default, not its dashboard's 8787)"
        )
        raise OmicsIOError(msg) from e
    futures: list = []
    try:
        _check_paths_on_workers(client, job)
        # keys of this run alone: a run's modalities share the job's token and partition numbers, and
        # a key the scheduler still held from the run before could be taken for that task's result
        run = secrets.token_hex(4)
        # the job as a task of its own (sent once, fetched by each worker from another): the scheduler
        # computes it again where every worker holding it died, where scattered data would be lost
        # with them and every partition's task cancelled
        shared = client.submit(_the_job, job, key=f"omicsio-job-{job.token}-{run}", pure=False)
        keys = [f"omicsio-materialize-{job.token}-{run}-p{p.index:05d}" for p in partitions]
        futures = client.map(
            dask_task, [shared] * len(partitions), partitions, key=keys, retries=retries, pure=False
        )
        by_key = {f.key: p for f, p in zip(futures, partitions, strict=True)}
        workers = len(client.scheduler_info().get("workers", {}))
        for future in as_completed(futures):
            try:
                result = future.result()
            except Exception as e:  # noqa: BLE001 - not ours (returned as a TaskError), after the retries
                text = " ".join(str(e).split())
                msg = (
                    f"writing {by_key[future.key].describe()} failed on the Dask cluster (tried {retries + 1} "
                    f"times): {type(e).__name__}: {text}"
                )
                raise OmicsIOError(msg) from e
            if isinstance(result, TaskError):
                client.cancel(futures)
                raise_worker_error(result.kind, result.text, by_key[future.key])
            progress(by_key[future.key].num_cells)
            if on_done is not None:
                on_done(by_key[future.key].index)
        return RunReport(max(workers, 1))
    except BaseException:
        _stop_tasks(client, futures, job.token)
        raise
    finally:
        try:
            client.run(release_dask_scratch, job.token)  # the workers' tables and writer processes
        except Exception:  # noqa: BLE001 - a worker gone or unreachable keeps nothing worth an error
            pass
        client.close()


SCHEDULER_FILE_WAIT_S = 30.0  # how long a scheduler file that is not there yet is waited for


def _address_in(scheduler_file: str) -> str:
    """The scheduler's address in ``scheduler_file``, waiting up to `SCHEDULER_FILE_WAIT_S` for the
    file to appear (a job script may start the scheduler just before; Dask's own `Client` waits for
    a missing file forever)."""
    deadline = time.monotonic() + SCHEDULER_FILE_WAIT_S
    while not os.path.exists(scheduler_file) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        with open(scheduler_file) as f:
            return str(json.load(f)["address"])
    except FileNotFoundError:
        msg = (
            f"Dask scheduler file {scheduler_file} does not exist ({SCHEDULER_FILE_WAIT_S:g} s waited); start "
            f"the scheduler with `dask scheduler --scheduler-file {scheduler_file}` or give its address "
            "(--dask-scheduler)"
        )
        raise OmicsIOError(msg) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        msg = f"cannot read the Dask scheduler's address from {scheduler_file}: {e!r}; give its address (--dask-scheduler)"
        raise OmicsIOError(msg) from e


HANDSHAKE_WAIT_S = 15.0  # for a Dask scheduler's first bytes on a new connection


def _probe_scheduler(address: str, scheduler_file: str | None) -> None:
    """Fail at once where nothing listens at a TCP ``address`` (Dask's `Client` retries for 30 s), and
    within `HANDSHAKE_WAIT_S` where a server listens that is not a Dask scheduler."""
    try:
        host, port = require("distributed.comm", "distributed", "a Dask cluster").get_address_host_port(
            address
        )
    except (ValueError, TypeError):  # not a TCP address (inproc://, ucx://): left to Dask
        return
    try:
        conn = socket.create_connection((host, port), timeout=10)
    except OSError as e:
        via = f" (from {scheduler_file})" if scheduler_file else ""
        msg = (
            f"cannot reach the Dask scheduler at {address}{via}: {e.strerror or e}; check that it "
            "runs and that this machine reaches it"
        )
        raise OmicsIOError(msg) from e
    with conn:
        if "://" in address and not address.startswith("tcp://"):
            return  # tls:// and others: the client speaks first
        # a Dask scheduler sends its handshake as a connection opens; an HTTP server (its dashboard,
        # 8787) waits for a request, and Dask's Client waits on it for minutes
        conn.settimeout(HANDSHAKE_WAIT_S)
        try:
            first = conn.recv(8)
        except OSError:
            first = b""
    if not first or first.startswith(b"HTTP"):
        msg = (
            f"the server at {address} does not answer as a Dask scheduler (no handshake in "
            f"{HANDSHAKE_WAIT_S:g} s); give the scheduler's address (port 8786 by default, not its dashboard's 8787)"
        )
        raise OmicsIOError(msg)


def _stop_tasks(client, futures: Sequence, token: str) -> None:
    """Cancel a stopped run's tasks and wait until none runs on any worker: a running task is not
    interrupted by its cancelling, and would write into the output after the run removed it."""
    try:
        client.cancel(futures)
        while sum(client.run(stop_dask_run, token).values()):
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - a worker gone or unreachable writes nothing more
        pass


_PATHS_CHECKED = 64  # of the input's files, on every worker before the run


def missing_paths(paths: Sequence[str]) -> list[str]:
    """Those of ``paths`` this Dask worker does not see."""
    return [p for p in paths if not os.path.exists(p)]


def _check_paths_on_workers(client, job: Job) -> None:
    """Refuse a run whose local input files or output directory some Dask worker does not see (a
    path on this machine only, or relative to this process's directory), before any task fails on
    it or writes where the finalizer does not look."""
    about = job.source.description
    inputs = about.get("files") or ([about["input"]] if about.get("kind") == "h5ad" else [])
    local = [str(p) for p in inputs if not is_remote(str(p))][:_PATHS_CHECKED]
    staging = [] if is_remote(job.staging) else [job.staging]
    missing = {path for paths in client.run(missing_paths, [*local, *staging]).values() for path in paths}
    for path in [*local, *staging]:
        if path in missing:
            what = f"the output (its partial directory {path})" if path in staging else f"input {path}"
            msg = (
                f"{what} is not seen by every Dask worker (a path on this machine only, or relative "
                "to its current directory): give an absolute path on a file system every worker mounts, or s3://"
            )
            raise OmicsIOError(msg)
