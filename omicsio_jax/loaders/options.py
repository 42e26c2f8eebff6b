"""The loaders' shared option objects: where batches go (`Placement`) and how they are read (`ReadOptions`).

Every loader (`make_loader`, `GrainSource`, `make_memory_loader`, `make_stream_loader`) takes the
same two objects, next to a `Sampling` option and an `Output` kind::

    loader = oj.make_loader(ds, batch_size=1024, sampling=oj.Block(16, 64), output=oj.Dense(),
                            placement=oj.Placement(mesh), read=oj.ReadOptions(num_threads=0))
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numba as nb
import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.outputs.batch import Batch, HostBatch, local_shards, place_batch
from omicsio_jax.storage.memory import usable_cores


def is_count(value: object, minimum: int) -> bool:
    """Whether ``value`` is an integer (Python's or NumPy's, not a bool) of at least ``minimum``."""
    return not isinstance(value, bool) and isinstance(value, int | np.integer) and value >= minimum


def _check_count(option: object, name: str, *, minimum: int) -> None:
    value = getattr(option, name)
    if value is None:
        return
    if not is_count(value, minimum):
        msg = (
            f"{type(option).__name__}({name}=...) must be an integer ≥ {minimum} (or None: the loader's "
            f"default), got {value!r}"
        )
        raise OmicsIOError(msg)
    if isinstance(value, np.integer):  # a plain int for what takes no other (Grain's thread counts)
        object.__setattr__(option, name, int(value))


def check_argument(where: str, name: str, value: object, *, minimum: int, optional: bool = False) -> None:
    """Raise unless ``value`` (argument ``name`` of ``where``) is an integer ≥ ``minimum`` (or None if ``optional``)."""
    if value is None and optional:
        return
    if not is_count(value, minimum):
        also = " (or None)" if optional else ""
        msg = f"{where}({name}=...) must be an integer ≥ {minimum}{also}, got {value!r}"
        raise OmicsIOError(msg)


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How a loader reads and decodes: None leaves a knob at the loader's default.

    ``num_threads`` threads decode and place batches ahead of the consumer (`make_loader`: chosen
    per output kind, batch size and machine, `default_num_threads`; 0 decodes each batch on the
    consumer's thread when asked for; Grain's DataLoader: 2; `make_memory_loader` and
    `make_stream_loader` refuse it: one thread makes their batches);
    ``prefetch`` fetches (segments of ``fetch_factor × batch_size`` cells) are read ahead on as
    many threads (`make_loader`: 2, more on many cores, `default_prefetch`; `GrainSource`,
    `make_stream_loader`: 2; `make_memory_loader`: 0, batches gathered when asked for);
    ``decode_threads`` numba threads decode one batch (`make_loader`, `GrainSource`: 1, or on more
    than 2 cores every core for large dense batches decoded on the consumer's thread,
    `default_decode_threads`;
    `make_memory_loader`'s row copy and `make_stream_loader`'s scatter: all of numba's threads).
    """

    num_threads: int | None = None
    prefetch: int | None = None
    decode_threads: int | None = None

    def __post_init__(self) -> None:
        _check_count(self, "num_threads", minimum=0)
        _check_count(self, "prefetch", minimum=0)
        _check_count(self, "decode_threads", minimum=1)

    @staticmethod
    def of(read: ReadOptions | None) -> ReadOptions:
        """A loader's ``read=`` argument as `ReadOptions` (None: every knob at the loader's default)."""
        if read is None:
            return ReadOptions()
        if isinstance(read, ReadOptions):
            return read
        msg = f"read must be an oj.ReadOptions(num_threads=..., prefetch=...) or None; got {read!r}"
        raise OmicsIOError(msg)

    def with_defaults(self, **defaults: int | None) -> ReadOptions:
        """These options with each knob left at None set to ``defaults[knob]``."""
        return dataclasses.replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})


MAX_DEFAULT_THREADS = 8  # more decoding threads than this are asked for explicitly
SMALL_BATCH = 64  # on 1–2 cores, dense or panel batches up to this many rows decode on the consumer
# a dense batch decoded on the consumer's thread is split over every core (more than 2) from this size
SPLIT_BATCH_BYTES = 4 << 20


def default_num_threads(kind: str, cores: int | None = None, batch_size: int | None = None) -> int:
    """`make_loader`'s decoding threads where ``ReadOptions(num_threads=None)``, for an output of
    ``kind`` on ``cores`` usable cores (default: this process's), ``batch_size`` rows per host batch.

    On more than 2 cores, outputs that build their rows on the host (dense rows, panels, tokens:
    writing the batch is the work) decode on every core, up to `MAX_DEFAULT_THREADS`; padded
    sparse slabs (``"csr"``: a copy of the records per batch, densified on the devices) on half of
    them, at least one. One thread (the loader's default before) measured slower for dense rows
    on 2 and on 16 cores and for tokens on 2 (benchmarks/README.md).

    On 1–2 cores a decoding thread has no core of its own (the fetches read ahead on two more),
    and each batch it hands over wakes the consumer: slabs, and dense or panel batches of up to
    `SMALL_BATCH` rows, decode on the consumer's thread (0). Measured on a 2-core AMD EPYC
    (``benchmarks/results/layout.json``): slabs faster and for less CPU at batch 64 and 256 (4%
    slower, for 5% fewer cells per CPU-second, at 1,024); a full-width dense batch of 64 rows, on
    one thread (`default_decode_threads`), 7% faster than on two threads ahead, for 22% more cells
    per CPU-second; a panel's batch of 64 rows 5% slower for 16% more cells per CPU-second. Larger
    dense batches, and token batches (whose kernel is most of the work; at batch 64 within 5% either
    way), still decode on every core. `oj.tune` measures the choice on a machine.

    >>> default_num_threads("dense", cores=16), default_num_threads("csr", cores=2)
    (8, 0)
    >>> default_num_threads("dense", cores=2, batch_size=64), default_num_threads("dense", cores=2, batch_size=1024)
    (0, 2)
    """
    cores = usable_cores() if cores is None else cores
    rows = kind == "dense" and batch_size is not None and batch_size <= SMALL_BATCH  # panels included
    if cores <= 2 and (kind == "csr" or rows):
        return 0
    return ahead_threads(kind, cores)


def default_decode_threads(kind: str, num_threads: int, batch_bytes: int, cores: int | None = None) -> int:
    """`make_loader`'s numba threads per batch where ``ReadOptions(decode_threads=None)``, for an
    output of ``kind`` whose host batch holds ``batch_bytes``, with ``num_threads`` decoding threads
    ahead, on ``cores`` usable cores (default: this process's).

    1 (``num_threads`` batches decode at once, one thread each), except dense rows decoded on the
    consumer's thread (``num_threads=0``: the one caller of the kernels) in batches of at least
    `SPLIT_BATCH_BYTES` on more than 2 cores: their rows are split over every core, up to
    `MAX_DEFAULT_THREADS`. Writing a full-width batch is the work, bound by memory once its rows
    are streamed past the caches (`omicsio_jax.core.kernels.streamed`). On 2 cores the second one
    serves the threads that read the fetches ahead: on a 2-core AMD EPYC (32 MiB of L3, batches of
    64 rows streamed) dense batches of 64 rows (16 MB) came at 63,026 cells/s on one thread against
    61,046 split over both, and 46,421 against 44,467 cells per CPU-second, ahead in 2 of 3 rounds
    (``benchmarks/results/layout.json``; the run before, 67,878 against 60,498:
    ``archive/layout_9008611.json``). On a 2-core Intel Xeon with 504 MiB of L3 the split came
    16% faster (59,677 against 51,564, ``archive/layout_43d6a3a.json``):
    ``ReadOptions(decode_threads=2)`` asks for it (`oj.tune` measures the threads decoding ahead,
    not this).

    >>> default_decode_threads("dense", 0, 16 << 20, cores=8), default_decode_threads("dense", 0, 16 << 20, cores=2)
    (8, 1)
    >>> default_decode_threads("dense", 0, 512 << 10, cores=2), default_decode_threads("csr", 0, 16 << 20, cores=2)
    (1, 1)
    """
    cores = usable_cores() if cores is None else cores
    if kind == "dense" and num_threads == 0 and batch_bytes >= SPLIT_BATCH_BYTES and cores > 2:
        return min(cores, MAX_DEFAULT_THREADS)
    return 1


def float32_batch_bytes(output, rows: int) -> int:
    """The bytes of ``rows`` of ``output``'s columns as float32: what `default_decode_threads` and
    `default_batches_ahead` size a dense batch by (0 for an output without ``num_columns``)."""
    return rows * (getattr(output, "num_columns", None) or 0) * 4


MAX_EXTRA_AHEAD = 6  # host batches in flight beyond one per decoding thread, at most


def default_batches_ahead(kind: str, num_threads: int, batch_bytes: int) -> int:
    """The host batches `make_loader`'s ``num_threads`` decoding threads may have made and not yet
    handed to the consumer (Grain's prefetch buffer), for an output of ``kind`` whose host batch
    holds ``batch_bytes`` as float32 rows.

    One per thread (1 without threads) for full-width dense rows (``kind`` ``"dense"``,
    `SPLIT_BATCH_BYTES` or more): writing them is bound by memory, and a deeper buffer measured no
    faster, only larger (dense batch 64 and 1,024 on 2 cores). Otherwise four per thread, at most `MAX_EXTRA_AHEAD` more than
    the threads: with one per thread, a thread that finished its batch before the one the consumer
    waits for had nothing to do until that one was taken: on 2 cores, token batches and csr slabs
    came faster with four each in short A/B windows that no results file keeps
    (`benchmarks/results/tokens.json` holds the loaders with it).

    >>> default_batches_ahead("geneformer", 2, 0), default_batches_ahead("dense", 2, 256 << 20)
    (8, 2)
    >>> default_batches_ahead("csr", 8, 256 << 20), default_batches_ahead("dense", 0, 16 << 20)
    (14, 1)
    """
    if num_threads == 0 or (kind == "dense" and batch_bytes >= SPLIT_BATCH_BYTES):
        return max(num_threads, 1)  # (none ahead: each batch is made on the consumer's thread)
    return num_threads + min(3 * num_threads, MAX_EXTRA_AHEAD)


def default_prefetch(cores: int | None = None) -> int:
    """`make_loader`'s fetches read ahead where ``ReadOptions(prefetch=None)``, on ``cores`` usable
    cores (default: this process's): 2, or one per four cores beyond 8, up to `MAX_DEFAULT_THREADS`.

    Each fetch is read on one thread, so on many cores two read-ahead threads bound how fast the
    decoding threads can be fed (csr slabs first: their decode is the lightest). Each fetch in
    flight holds ``fetch_factor × batch_size`` cells' records in memory.

    >>> default_prefetch(cores=2), default_prefetch(cores=8), default_prefetch(cores=16), default_prefetch(cores=96)
    (2, 2, 4, 8)
    """
    cores = usable_cores() if cores is None else cores
    return min(max(2, cores // 4), MAX_DEFAULT_THREADS)


def ahead_threads(kind: str, cores: int) -> int:
    """The threads that decode batches of ``kind`` ahead of the consumer where `default_num_threads`
    gives any: every core up to `MAX_DEFAULT_THREADS` for rows built on the host, half of them (at
    least one) for csr slabs."""
    share = cores // 2 if kind == "csr" else cores
    return max(1, min(share, MAX_DEFAULT_THREADS))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a loader's batches go: sharded along ``data_axis`` of ``mesh`` (None: the first local
    device), this process being host ``process_index`` of ``process_count`` (None: JAX's).

    A loader takes ``placement=mesh`` as ``Placement(mesh)``. ``process_index`` /
    ``process_count`` stand in for JAX's where one process plays several hosts (tests, elastic
    restores); every host must serve the same number of equal batches. With JAX's processes, each
    one must hold its own, equal share of the data axis's slices (``process_count=1`` on every
    process instead loads the same whole batches everywhere, for a data axis the processes share).
    """

    mesh: jax.sharding.Mesh | None = None
    data_axis: str = "data"
    process_index: int | None = None
    process_count: int | None = None

    def __post_init__(self) -> None:
        if self.mesh is not None and not isinstance(self.mesh, jax.sharding.Mesh):
            msg = (
                f"Placement(mesh=...) must be a jax.sharding.Mesh or None, got {self.mesh!r}: e.g. "
                "oj.Placement(jax.make_mesh((jax.device_count(),), ('data',)))"
            )
            raise OmicsIOError(msg)
        if self.mesh is not None and self.data_axis not in self.mesh.axis_names:
            msg = f"Placement(data_axis={self.data_axis!r}) is not an axis of the mesh {tuple(self.mesh.axis_names)}"
            raise OmicsIOError(msg)
        _check_count(self, "process_count", minimum=1)
        _check_count(self, "process_index", minimum=0)
        if self.process_index is not None and self.process_index >= self.num_hosts:
            msg = (
                f"Placement(process_index={self.process_index}) must be below process_count {self.num_hosts}"
            )
            raise OmicsIOError(msg)
        if self.mesh is not None and self.process_count is None:
            self._check_processes()

    def _check_processes(self) -> None:
        """Raise unless the mesh's processes (JAX's) each hold their own, equal share of the data axis:
        every process serves ``batch_size / process_count`` rows of its own, which only its devices hold."""
        axis = list(self.mesh.axis_names).index(self.data_axis)
        slices: dict[int, set[int]] = {}
        for idx, device in np.ndenumerate(self.mesh.devices):
            slices.setdefault(device.process_index, set()).add(idx[axis])
        if len(slices) > 1:
            for p, q in itertools.combinations(sorted(slices), 2):
                if slices[p] & slices[q] or len(slices[p]) != len(slices[q]):
                    msg = (
                        f"mesh axis {self.data_axis!r} must split into equal, disjoint shares of the processes, "
                        f"but process {p} holds its slices {sorted(slices[p])} and process {q} {sorted(slices[q])}: "
                        f"order the mesh's devices so that the processes split {self.data_axis!r} (e.g. "
                        "jax.make_mesh((jax.device_count() // m, m), ('data', 'model')) keeps 'model' within a process), "
                        "or load the same whole batches on every process: oj.Placement(mesh, process_index=0, process_count=1)"
                    )
                    raise OmicsIOError(msg)
        if len(slices) != jax.process_count():
            msg = (
                f"the mesh spans processes {sorted(slices)} of the {jax.process_count()} JAX processes, and each "
                "serves its share of each batch: use a mesh over every process's devices, or pass "
                "oj.Placement(mesh, process_index=0, process_count=1) where only this process loads"
            )
            raise OmicsIOError(msg)

    @staticmethod
    def of(placement: Placement | jax.sharding.Mesh | None) -> Placement:
        """A `Placement` from a loader's ``placement=`` argument (a `Placement`, a mesh or None)."""
        if placement is None:
            return Placement()
        if isinstance(placement, Placement):
            return placement
        if isinstance(placement, jax.sharding.Mesh):
            return Placement(placement)
        msg = f"placement must be an oj.Placement(mesh, ...), a jax.sharding.Mesh or None; got {placement!r}"
        raise OmicsIOError(msg)

    @property
    def host(self) -> int:
        """This process's host index."""
        return jax.process_index() if self.process_index is None else self.process_index

    @property
    def num_hosts(self) -> int:
        return jax.process_count() if self.process_count is None else self.process_count

    @property
    def num_slabs(self) -> int:
        """How many slices of a host's batch its devices hold (1 without a mesh)."""
        return local_shards(self.mesh, self.data_axis)

    def check_batch_size(self, batch_size: int) -> None:
        """Raise unless ``batch_size`` (global) splits evenly over the mesh's data axis, and each host's
        share over its own devices of it (a process playing one of several hosts holds every device)."""
        if self.mesh is None:
            return
        if batch_size % self.mesh.shape[self.data_axis]:
            msg = (
                f"batch_size {batch_size} must be divisible by the {self.mesh.shape[self.data_axis]} devices of "
                f"mesh axis {self.data_axis!r}"
            )
            raise OmicsIOError(msg)
        hosts, slabs = self.num_hosts, self.num_slabs
        if batch_size % hosts == 0 and (batch_size // hosts) % slabs:
            msg = (
                f"batch_size {batch_size} gives each of the {hosts} hosts {batch_size // hosts} rows, which must split "
                f"evenly over this process's {slabs} devices of mesh axis {self.data_axis!r}: pass a multiple of "
                f"{hosts * slabs}, e.g. batch_size={max(1, batch_size // (hosts * slabs)) * hosts * slabs}"
            )
            raise OmicsIOError(msg)

    def place(self, host_batch: HostBatch) -> Batch:
        """This host's batch as global jax.Arrays sharded along the data axis (`place_batch`)."""
        return place_batch(host_batch, self.mesh, self.data_axis)


def numba_threads_in_force(decode_threads: int | None) -> int:
    """The numba threads a batch is made on for ``ReadOptions(decode_threads=decode_threads)``: all of
    numba's (None, the default, or more than it has), else ``decode_threads``."""
    available = nb.config.NUMBA_NUM_THREADS
    return available if decode_threads is None else min(decode_threads, available)


class numba_threads:  # lower case, as a contextlib one; a class: cheaper, entered once a batch
    """Run numba's parallel kernels of this thread on ``threads`` threads inside the block (numba's
    count is per thread: the loader's other threads keep theirs); all of numba's, or as many as the
    thread has already: nothing is set."""

    __slots__ = ("threads", "previous")

    def __init__(self, threads: int):
        self.threads, self.previous = threads, None

    def __enter__(self) -> None:
        if self.threads < nb.config.NUMBA_NUM_THREADS:
            previous = nb.get_num_threads()
            if previous != self.threads:
                nb.set_num_threads(self.threads)
                self.previous = previous

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            nb.set_num_threads(self.previous)
            self.previous = None
