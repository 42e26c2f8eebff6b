"""One host of the fault soak's training loop (`soak.py` starts two and kills them as it goes).

    python benchmarks/_soak_host.py URL WORK HOST HOSTS SEED

A Grain ``DataLoader`` with one worker process over the dataset at ``URL`` (``s3://``, read through
the fault proxy that ``AWS_ENDPOINT_URL`` names, with a cache in ``WORK/cache``) as host ``HOST`` of
``HOSTS``; the iterator is checkpointed every few steps with Orbax (Grain's ``CheckpointSave``, in
``WORK/ckpt-HOST``), as MaxText's loops do. Each batch's step and digest go to ``WORK/host-HOST.log``
(one JSON object a line) for `soak.py` to check against the fault-free run. What a training job
does, this does:

- SIGTERM (a preemption): save the current step's checkpoint, log it, exit 0; started again, it
  restores the latest checkpoint and goes on.
- An error from the loader (a killed worker process, an object changed while in use): log it (its
  type, message and whether it is one line), restore the latest checkpoint into a new loader, go on.
- SIGUSR1: every thread's stack to stderr (``faulthandler``), the soak's view into a host that stalls.

It stops when ``WORK/stop`` exists.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

LOADER = {"batch_size": 256, "output": "csr", "num_epochs": None}
BLOCK = (16, 8)  # block size, fetch factor
CHECKPOINT_EVERY = 8  # steps
CACHE_BYTES = 2 << 20  # small: reads keep going to S3


def loader_options(seed: int, host: int, hosts: int) -> dict:
    """The loader's arguments, shared with `soak.py`'s fault-free run."""
    import omicsio_jax as oj

    return {
        **LOADER,
        "sampling": oj.Block(*BLOCK, drop_remainder=False),
        "seed": seed,
        "placement": oj.Placement(process_index=host, process_count=hosts),
    }


def digest(batch) -> str:
    """A digest of a batch's cells and values (a `HostBatch` or a `Batch`: the same arrays)."""
    import jax

    h = hashlib.blake2b(digest_size=16)
    for leaf in jax.tree.leaves((batch.index, batch.mask, batch.x)):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def children(pid: int | str = "self") -> list[int]:
    """The child processes of ``pid`` (of any of its threads)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _exit(code: int) -> None:
    """Leave now, taking this process's Grain workers along: ``os._exit`` skips Grain's shutdown, and
    a worker whose parent is gone keeps running (and its memory) until killed."""
    for child in children():
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(code)


def main() -> None:
    url, work, host, hosts, seed = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:6])
    terminated = []
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(time.time()))
    # SIGUSR1 (the soak, when this host has not served a batch for long after a kill): every
    # thread's stack to stderr (the host's .err file), for the soak to report where it stands
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

    import grain
    import orbax.checkpoint as ocp

    import omicsio_jax as oj

    log = (work / f"host-{host}.log").open("a", buffering=1)

    def say(**record) -> None:
        log.write(json.dumps(record) + "\n")

    manager = ocp.CheckpointManager(
        work / f"ckpt-{host}",
        options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False),
    )

    def fresh():
        ds = oj.open_dataset(url, cache_dir=work / "cache", cache_bytes=CACHE_BYTES)
        loader = oj.make_grain_loader(ds, worker_count=1, **loader_options(seed, host, hosts))
        it = iter(loader)
        step = manager.latest_step()
        if step is not None:
            manager.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(it)))
        return ds, it, step or 0

    def save(step: int, it) -> None:
        if manager.latest_step() != step:  # a step restored from is saved already
            manager.save(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)), force=True)

    ds, it, step = fresh()
    say(event="start", pid=os.getpid(), step=step)
    while not (work / "stop").exists():
        if terminated:
            save(step, it)
            manager.wait_until_finished()
            say(event="sigterm", step=step, seconds_to_exit=round(time.time() - terminated[0], 3))
            _exit(0)
        try:
            batch = next(it)
        except Exception as e:  # noqa: BLE001 - what a training job meets: logged, then resumed
            message = str(e)
            say(
                event="error",
                step=step,
                type=type(e).__name__,
                message=message[:400],
                one_line="\n" not in message,
            )
            del it
            ds.close()
            ds, it, step = fresh()
            say(event="restored", step=step)
            continue
        say(s=step, d=digest(batch))
        step += 1
        if step % CHECKPOINT_EVERY == 0:
            save(step, it)
    manager.close()
    _exit(0)


if __name__ == "__main__":
    main()
