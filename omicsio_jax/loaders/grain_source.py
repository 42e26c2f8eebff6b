"""`GrainSource` and `make_grain_loader`: a materialized dataset as a Grain data source.

Record ``g`` of a `GrainSource` is one host minibatch, a `HostBatch` of numpy arrays: host
``g % P``'s batch at global step ``g // P``, exactly what `make_loader` yields there. Grain calls
``source[i]`` once per record, so a fetch-sized batched read has to live behind the records:
each process reads a fetch once (`MinibatchReader`'s segment cache, reading the next ones ahead)
and cuts its minibatches out of it. With ``worker_count = W > 0`` every worker reads every
fetch it serves minibatches of (W× the reads), which pays where decoding, not reading, is the
bottleneck, or for slow user operations.
"""

from __future__ import annotations

import ast
import json
import multiprocessing
import os
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import grain
import jax
import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.dataset.dataset import Dataset, as_dataset, open_dataset
from omicsio_jax.loaders.minibatch import DiskSpec, MinibatchReader
from omicsio_jax.loaders.options import (
    Placement,
    ReadOptions,
    check_argument,
    default_batches_ahead,
    float32_batch_bytes,
)
from omicsio_jax.loaders.state import as_json
from omicsio_jax.outputs.base import Output
from omicsio_jax.outputs.batch import HostBatch
from omicsio_jax.sampling.coverage import Tally
from omicsio_jax.sampling.options import Block, Sampling
from omicsio_jax.sampling.schedule import Schedule
from omicsio_jax.storage.store import is_remote

_watching = threading.Event()


def _end_with_parent() -> None:
    """In a child process that a `GrainSource` was pickled to (a Grain worker), a daemon thread that
    ends the process once its parent is gone (waiting on the parent's sentinel, nothing polled).
    Grain's workers outlive a parent that was killed (SIGKILL, OOM, a preempted job): each blocks
    forever putting its next batch into a queue nobody reads, holds its memory and the parent's
    stdout, and is re-parented to init (as Grain's own sources' workers are; PyTorch's DataLoader
    workers watch their parent for the same reason)."""
    parent = multiprocessing.parent_process()
    if parent is None or _watching.is_set():
        return
    _watching.set()

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="omicsio-jax-parent-watch", daemon=True).start()


class GrainWorkersWarning(UserWarning):
    """``make_grain_loader(worker_count > 0)``: Grain's worker processes are slower than the loader's
    own threads for these batches (warned once per process; filter it to silence it)."""


# What the warning quotes, from benchmarks/results/grain.json (a test keeps the two equal):
# make_grain_loader with 2 worker processes ÷ make_loader, cells/s of batches of 1,024 cells
GRAIN_WORKERS_MEASURED = {"dense": 0.06, "csr": 0.29, "when": "2026-12-02, commit e2130f2, 2-core AMD EPYC"}
_workers_warned = threading.Event()


def _warn_workers(worker_count: int) -> None:
    if _workers_warned.is_set():
        return
    _workers_warned.set()
    m = GRAIN_WORKERS_MEASURED
    warnings.warn(
        f"make_grain_loader(worker_count={worker_count}): Grain's worker processes pass each batch "
        "through a new shared-memory segment, and each worker reads every fetch it cuts batches "
        f"from; with 2 workers they served {m['dense']:.2f}× (dense) and {m['csr']:.2f}× (csr) the "
        f"cells/s of make_loader at batch 1,024 ({m['when']}, benchmarks/results/grain.json). The "
        "loader decodes on threads outside the GIL: worker_count=0 with "
        "read=oj.ReadOptions(num_threads=N) is the fast path; workers pay only for slow Python "
        "operations. Silence: warnings.filterwarnings('ignore', category=oj.GrainWorkersWarning)",
        GrainWorkersWarning,
        stacklevel=3,
    )


def _mark_absl_flags_parsed() -> None:
    """The workaround for grain#1355 (fixed after grain 0.2.18): jax imports absl, and without
    ``absl.app`` nothing parses its flags, so Grain's worker processes fail reading theirs
    (``UnparsedFlagAccessError``). Every `GrainSource` applies it where flags are unparsed, so a
    ``grain.DataLoader`` built from one by hand gets it as `make_grain_loader`'s does."""
    try:
        from absl import flags
    except ImportError:
        return
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class GrainSource(grain.sources.RandomAccessDataSource):
    """A Grain ``RandomAccessDataSource`` of host minibatches, with the knobs of `make_loader`.

    >>> src = oj.GrainSource("out/", batch_size=1024, seed=0, num_epochs=None, obs=("drug",))  # doctest: +SKIP
    >>> loader = grain.DataLoader(data_source=src, sampler=src.sampler(), worker_count=2,
    ...                           read_options=src.read_options())                          # doctest: +SKIP
    >>> for host_batch in loader:
    ...     batch = oj.place_batch(host_batch, mesh)      # sharded jax.Arrays          # doctest: +SKIP

    ``len(src)`` is ``steps_per_epoch × num_epochs × process_count`` (an endless source rounds
    ``sys.maxsize`` down to whole steps). The source holds only the dataset path and the
    config, so it pickles into Grain's worker processes, which reopen the dataset; its
    ``repr`` is the config with the dataset fingerprint, so Grain's DataLoader refuses a
    checkpoint of another dataset or config. The arguments are `make_loader`'s; of ``placement``
    the source uses the process count and index (the sampler's default) and the mesh only for how
    many device slabs a ``csr`` batch has (this host's devices along the data axis); of ``read``,
    ``prefetch`` and ``decode_threads``, and ``num_threads`` as `read_options`' default.
    """

    def __init__(
        self,
        dataset: Dataset | str | os.PathLike[str],
        *,
        batch_size: int,
        sampling: Sampling | str = Block(),
        output: str | Output | Mapping[str, str | Output] = "dense",
        obs: Sequence[str] = (),
        rows: np.ndarray | Sequence[int] | None = None,
        seed: int = 0,
        num_epochs: int | None = 1,
        placement: Placement | jax.sharding.Mesh | None = None,
        read: ReadOptions = ReadOptions(),
    ):
        _mark_absl_flags_parsed()  # before any DataLoader starts workers from this source
        ds = as_dataset(dataset, "GrainSource")
        check_argument("GrainSource", "batch_size", batch_size, minimum=1)
        check_argument("GrainSource", "seed", seed, minimum=0)
        check_argument("GrainSource", "num_epochs", num_epochs, minimum=1, optional=True)
        placement = Placement.of(placement)
        self.spec = DiskSpec.of(
            batch_size=batch_size,
            sampling=sampling,
            output=output,
            obs=obs,
            rows=rows,
            seed=seed,
            num_epochs=num_epochs,
            placement=placement,
        )
        hosts = placement.num_hosts
        self.process_index = placement.process_index  # the sampler's default (None: JAX's)
        plan, bound = self.spec.resolve(ds)
        self.path, self.open_options = str(ds.path), ds.open_options  # how workers open it again
        self.num_hosts, self.steps_per_epoch = hosts, plan.steps_per_epoch
        self.read = read.with_defaults(num_threads=2, prefetch=2, decode_threads=1)
        self.prefetch, self.decode_threads = self.read.prefetch, self.read.decode_threads
        # what `read_options` sizes Grain's buffer by: the output kind, a batch's bytes as float32 rows
        self._kind = bound.decoding
        self._row_bytes = float32_batch_bytes(bound, plan.local_batch)
        # the layout of the records: device slabs only where the output builds them (a dense batch's
        # rows are the same on 4 devices as on 8, so its checkpoint restores onto either)
        layout = {
            "num_hosts": hosts,
            "num_slabs": _slabs(bound),
            "nnz_capacity": getattr(bound, "nnz_capacity", None),
        }
        self._config = as_json({**self.spec.config(ds, plan, bound), **layout})
        per_pass = self.steps_per_epoch * hosts
        self._length = (
            per_pass * num_epochs if num_epochs is not None else (sys.maxsize // per_pass) * per_pass
        )
        self._local: dict | None = None
        self._lock = threading.Lock()

    # ----- pickling: path and config only ------------------------------------------------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_local"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        _end_with_parent()

    @property
    def cache_dir(self):
        """A remote dataset's local cache, which workers reopen it on (None for a local dataset)."""
        return self.open_options["cache_dir"] if is_remote(self.path) else None

    @property
    def cache_bytes(self) -> int | None:
        return self.open_options["cache_bytes"] if is_remote(self.path) else None

    def __repr__(self) -> str:
        return f"GrainSource({json.dumps(self._config, sort_keys=True)})"

    # ----- the protocol ------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._length

    def __getitem__(self, record_key: int) -> HostBatch:
        key = int(record_key)
        if not 0 <= key < self._length:
            msg = f"record {record_key} out of range: the source has {self._length} records"
            raise IndexError(msg)
        step, host = divmod(key, self.num_hosts)
        return self._reader(host)(*divmod(step, self.steps_per_epoch))

    def _reader(self, host: int) -> MinibatchReader:
        with self._lock:
            if self._local is None:  # first use in this process: reopen the dataset
                ds = open_dataset(self.path, **self.open_options)
                plan, output = self.spec.resolve(ds)
                self._local = {"ds": ds, "plan": plan, "output": output, "readers": {}}
            local = self._local
            reader = local["readers"].get(host)
            if reader is None:
                reader = local["readers"][host] = MinibatchReader(
                    local["ds"],
                    Schedule(local["plan"], host),
                    local["output"],
                    self.spec.obs,
                    num_epochs=self.spec.num_epochs,
                    prefetch=self.prefetch,
                    decode_threads=self.decode_threads,
                    keep_buffers=8,
                )
            return reader

    # ----- helpers -----------------------------------------------------------------------------
    def sampler(
        self, process_index: int | None = None, process_count: int | None = None
    ) -> grain.samplers.Sampler:
        """Grain's ``SequentialSampler`` sharded like the source: process ``h`` of ``P`` gets records
        ``h, h + P, ...`` (default: the source's `Placement`, else ``jax.process_index()`` /
        ``jax.process_count()``)."""
        if process_index is None:
            process_index = self.process_index
        index = jax.process_index() if process_index is None else process_index
        count = self.num_hosts if process_count is None else process_count
        if count != self.num_hosts:
            msg = (
                f"process {index} of {count}: this source was made for {self.num_hosts} process(es); "
                f"pass placement=oj.Placement(process_count={count}) to GrainSource"
            )
            raise OmicsIOError(msg)
        if not 0 <= index < count:
            msg = f"process_index {index} is not one of this source's {count} process(es) (0..{count - 1})"
            raise OmicsIOError(msg)
        shards = grain.sharding.ShardOptions(shard_index=index, shard_count=count, drop_remainder=True)
        # seeded with the loader's seed: Grain gives a RandomMap an rng only when its sampler has a seed
        # (each record's its own, from the seed and the record), so random operations replay at resume
        return grain.samplers.SequentialSampler(
            num_records=self._length, shard_options=shards, seed=self.spec.seed
        )

    def read_options(
        self, num_threads: int | None = None, prefetch_buffer_size: int | None = None
    ) -> grain.ReadOptions:
        """Grain's read options sized for minibatch records: ``num_threads`` threads (default: the
        source's ``read.num_threads``, 2) decode, each a record or so ahead, up to four for records
        that are not full-width dense rows (`default_batches_ahead`, as `make_loader`'s threads; Grain's
        default buffer of 500 records would hold gigabytes of batches)."""
        if num_threads is None:
            num_threads = self.read.num_threads
        ahead = max(default_batches_ahead(self._kind, num_threads, self._row_bytes), max(num_threads, 1) + 1)
        return grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size or ahead)

    def planned(self, epoch: int, process_index: int | None = None) -> Tally:
        """What process ``process_index`` serves in ``epoch`` (compare a `Tally` of its batches'
        ``index``); by default this process, as `sampler` has it."""
        if process_index is None:
            process_index = jax.process_index() if self.process_index is None else self.process_index
        reader = self._reader(process_index)
        return reader.schedule.planned(epoch)


def _slabs(output: Output) -> int:
    """How many device slabs a host batch of the bound ``output`` is built as (1: rows alone)."""
    parts = getattr(output, "outputs", None)  # an output per modality
    if parts is not None:
        return max((_slabs(part) for _, part in parts), default=1)
    return getattr(output, "num_slabs", 1)


def _under_main_guard(path: str, line: int) -> bool:
    """Whether ``line`` of the script ``path`` lies inside ``if __name__ == "__main__":``."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return True  # cannot tell: do not stand in the way
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)
        ):
            sides = {ast.unparse(node.test.left), ast.unparse(node.test.comparators[0])}
            if sides == {"__name__", "'__main__'"} and node.lineno <= line <= (node.end_lineno or line):
                return True
    return False


def check_operations(operations: Sequence) -> None:
    """Only one-to-one Grain operations: one record is one step's batch on every host."""
    for op in operations:
        if not isinstance(op, grain.transforms.Map | grain.transforms.RandomMap):
            msg = (
                f"operation {op!r} is not a grain.transforms.Map or RandomMap: one record is one step's batch, "
                "so only one-to-one operations keep every host's steps aligned and resume exact"
            )
            raise OmicsIOError(msg)


def check_worker_setup(operations: Sequence) -> None:
    """The usual failures of Grain worker processes, turned into one-line errors that say the fix:
    a script without ``if __name__ == "__main__":`` (spawned workers re-run it), an operation that
    cannot be pickled."""
    main = sys.modules.get("__main__")
    frame = sys._getframe(1)
    while frame is not None and not (
        main is not None and frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"
    ):
        frame = frame.f_back
    path = getattr(main, "__file__", None)
    if frame is not None and path and not _under_main_guard(path, frame.f_lineno):
        msg = (
            f"{path}, line {frame.f_lineno}: worker processes re-run this script from the top; build and "
            f'iterate the loader under `if __name__ == "__main__":` (or pass worker_count=0)'
        )
        raise OmicsIOError(msg)
    import cloudpickle

    for op in operations:
        try:
            cloudpickle.dumps(op)
        except Exception as e:  # noqa: BLE001 -- any pickling failure, reported as one line
            msg = (
                f"operation {op!r} cannot be sent to worker processes ({type(e).__name__}: {e}); define it at "
                "module level, holding no lock, open file or loader (or pass worker_count=0)"
            )
            raise OmicsIOError(msg) from e


def make_grain_loader(
    dataset: Dataset | str | os.PathLike[str],
    *,
    batch_size: int,
    worker_count: int = 0,
    worker_buffer_size: int = 1,
    operations: Sequence = (),
    **source_options,
) -> grain.DataLoader:
    """A ``grain.DataLoader`` over a `GrainSource`: the batches of `make_loader`, as numpy `HostBatch`es.

    >>> loader = oj.make_grain_loader(ds, batch_size=1024, seed=0, num_epochs=None, obs=("drug",),
    ...                               worker_count=2)                             # doctest: +SKIP
    >>> it = iter(loader)
    >>> batch = oj.place_batch(next(it), mesh)                                     # doctest: +SKIP

    ``source_options`` are `GrainSource`'s, the arguments of `make_loader` (``sampling``,
    ``output``, ``obs``, ``rows``, ``seed``, ``num_epochs``, ``placement``, ``read``: its
    ``num_threads`` threads, 2 by default, decode records in each process). ``worker_count``
    Grain worker processes make the batches, each ``worker_buffer_size`` batches ahead (0, the
    default and the fast path: this process makes them, decoding on its threads; the first loader
    of a process with workers warns, `GrainWorkersWarning`, with their measured cost).
    ``operations`` are Grain ``Map`` / ``RandomMap`` transforms applied to each `HostBatch` (in the
    workers, when there are any). Checkpoint the iterator with ``grain.checkpoint.CheckpointSave``
    (Orbax) or its ``get_state``.
    """
    check_operations(operations)
    check_argument("make_grain_loader", "worker_count", worker_count, minimum=0)
    check_argument("make_grain_loader", "worker_buffer_size", worker_buffer_size, minimum=1)
    if worker_count:
        check_worker_setup(operations)
        _warn_workers(worker_count)
    src = GrainSource(dataset, batch_size=batch_size, **source_options)
    return grain.DataLoader(
        data_source=src,
        sampler=src.sampler(),
        operations=list(operations),
        worker_count=worker_count,
        worker_buffer_size=worker_buffer_size,
        read_options=src.read_options(),
    )
