"""`make_loader`: training batches from a materialized dataset, as sharded jax.Arrays."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numba
import numpy as np

from . import _codec, _scatter
from ._dataset import Categorical, Dataset, corruption_reported
from ._errors import OmicsIOError, StateMismatchError
from ._fetch import FetchReader
from ._pipeline import MiniBatch, build_pipeline
from ._sampling import SamplingPlan, class_weights

OUTPUTS = ("dense", "csr")
_ALIGN = 64
_WIDE_ROW_BYTES = 64 * 1024
STATE_VERSION = 1


class SparseBatch(NamedTuple):
    """Fixed-shape padded sparse rows, one slab per device: arrays of shape (num_shards, capacity).

    Entry ``j`` of slab ``s`` is ``values[s, j]`` (float32) at row ``row_ids[s, j]`` (within the
    shard's ``batch_size / num_shards`` rows; int16, int32 past 32,767 rows) and column ``indices[s, j]`` (uint16 for up
    to 65,536 genes, else int32); padding entries add 0 at (0, 0). `Loader.densify` turns it into
    the dense batch on the devices.
    """

    row_ids: Any
    indices: Any
    values: Any


@dataclasses.dataclass(frozen=True)
class Batch:
    """A global training batch: ``x`` (dense ``(batch, genes)`` or `SparseBatch`), obs labels,
    the global row of every cell (``index``, -1 for padding) and ``mask`` (False for padding)."""

    x: Any
    obs: dict[str, Any]
    index: Any
    mask: Any


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """This host's share of a batch as numpy arrays (what the Grain pipeline yields)."""

    x: np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray]
    obs: dict[str, np.ndarray]
    index: np.ndarray
    mask: np.ndarray


@functools.partial(jax.jit, static_argnames=("rows_per_shard", "num_genes", "normalize", "target_sum"))
def _densify_sharded(row_ids, indices, values, *, rows_per_shard, num_genes, normalize, target_sum):
    """Densify each shard's slab where it lives (vmap over the sharded leading axis), then flatten."""

    def one(r, i, v):
        return _scatter.densify_on_device(r, i, v, num_rows=rows_per_shard, num_genes=num_genes,
                                          normalize=normalize, target_sum=target_sum)

    return jax.vmap(one)(row_ids, indices, values).reshape(-1, num_genes)


def aligned_empty(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """An uninitialized C-contiguous array whose data is 64-byte aligned: XLA on CPU then adopts it
    as the device buffer instead of copying it (measured: 19 ms instead of 98 ms per 257 MB)."""
    dtype = np.dtype(dtype)
    return _aligned_view(np.empty(_nbytes(shape, dtype) + _ALIGN, dtype=np.uint8), shape, dtype)


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape)) * dtype.itemsize


def _aligned_view(raw: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The 64-byte-aligned ``(shape, dtype)`` array inside ``raw`` (uint8, ``_ALIGN`` bytes of slack)."""
    offset = -raw.ctypes.data % _ALIGN
    return raw[offset : offset + _nbytes(shape, dtype)].view(dtype).reshape(shape)


class RowBuffers:
    """Aligned output buffers, reused once nothing refers to them any more.

    A batch's buffer may be adopted by XLA (on CPU) and live on inside a jax.Array, so a buffer is
    only handed out again when its reference count says that no array, view or jax.Array holds it
    (every numpy view of a buffer refers to it directly; XLA holds the array it adopted). A fresh
    257 MB buffer costs ~80 ms of page faults here, more than decoding 1,024 cells into it (~10
    ms); a reused one costs nothing. At most ``keep`` buffers of each size are kept.
    """

    def __init__(self, keep: int = 6):
        self._pools: dict[int, list[np.ndarray]] = {}
        self._keep = keep
        self._lock = threading.Lock()
        # The reference count of a buffer that only the pool holds, measured the way `empty` and
        # `num_free` take it (in a generator over a list): the list, the loop variable, the arguments.
        self._baseline = max(self._refs(r) for r in [np.empty(1)])

    @staticmethod
    def _refs(raw: np.ndarray) -> int:
        return sys.getrefcount(raw)

    def empty(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """Like `aligned_empty`, reusing a buffer of this size that nothing refers to."""
        dtype = np.dtype(dtype)
        nbytes = _nbytes(shape, dtype)
        with self._lock:
            pool = self._pools.setdefault(nbytes, [])
            raw = next((r for r in pool if self._refs(r) <= self._baseline), None)
            if raw is None:
                raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
                if len(pool) < self._keep:
                    pool.append(raw)
        return _aligned_view(raw, shape, dtype)

    def num_free(self) -> int:
        with self._lock:
            return sum(self._refs(r) <= self._baseline for pool in self._pools.values() for r in pool)


def data_sharding(mesh, data_axis: str = "data") -> jax.sharding.Sharding:
    """``NamedSharding(mesh, P(data_axis))``, or the first local device when there is no mesh."""
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(data_axis))


def place_batch(hb: HostBatch, mesh, data_axis: str, num_hosts: int) -> Batch:
    """This host's `HostBatch` → the global `Batch` of jax.Arrays sharded along ``data_axis``.

    make_array_from_process_local_data is right single- and multi-host, and on CPU it adopts
    an aligned host buffer instead of copying it (jax.device_put copies: 90 ms per dense
    1,024-cell batch here). Without a mesh, the batch goes to the default device.
    """
    sharding = data_sharding(mesh, data_axis)

    def glob(a: np.ndarray):
        return jax.make_array_from_process_local_data(sharding, a, (a.shape[0] * num_hosts, *a.shape[1:]))

    x = SparseBatch(*map(glob, hb.x)) if isinstance(hb.x, tuple) else glob(hb.x)
    return Batch(x, {k: glob(v) for k, v in hb.obs.items()}, glob(hb.index), glob(hb.mask))


def check_state(state: dict, version: int, config: dict) -> None:
    """Refuse a loader state of another version, or one whose config differs (showing both sides)."""
    if state.get("version") != version:
        msg = f"loader state version {state.get('version')!r} is not {version}"
        raise StateMismatchError(msg)
    theirs = state["config"]
    diffs = [f"  {k}: in checkpoint {theirs.get(k)!r}, in loader {config.get(k)!r}"
             for k in sorted(set(config) | set(theirs)) if config.get(k) != theirs.get(k)]
    if diffs:
        msg = "loader state does not match this loader:\n" + "\n".join(diffs)
        raise StateMismatchError(msg)


def _gene_to_col(ds: Dataset, genes: Sequence[str | int]) -> np.ndarray:
    """Map a panel (names, Ensembl ids or column numbers) to ``gene_to_col`` for `scatter_panel`."""
    features = ds.features
    lookup: dict[str, int] = {}
    for key in ("ensembl_id", "gene_name"):
        if key in features:
            for col, value in enumerate(features[key].astype(str)):
                lookup.setdefault(value, col)
    cols, unknown = [], []
    for g in genes:
        if isinstance(g, (int, np.integer)):
            if not 0 <= int(g) < ds.num_genes:
                unknown.append(str(g))
            cols.append(int(g))
        elif str(g) in lookup:
            cols.append(lookup[str(g)])
        else:
            unknown.append(str(g))
    if unknown:
        msg = f"{len(unknown)} panel gene(s) not in {ds.path}/features.parquet: {', '.join(unknown[:5])}"
        raise OmicsIOError(msg)
    return _scatter.make_gene_to_col(ds.num_genes, cols)


class Loader:
    """Iterable of `Batch`; `get_state`/`set_state` resume bit-exactly. Build with `make_loader`."""

    def __init__(self, ds: Dataset, plan: SamplingPlan, *, host: int, num_epochs: int | None, obs: Sequence[str],
                 output: str, gene_to_col: np.ndarray | None, normalize: str | None, target_sum: float,
                 mesh, data_axis: str, num_threads: int, prefetch: int, nnz_capacity: int | None,
                 decode_threads: int | None = None):
        self.dataset, self.plan, self.host, self.num_epochs = ds, plan, host, num_epochs
        self.obs_names, self.output, self.normalize, self.target_sum = tuple(obs), output, normalize, target_sum
        self.gene_to_col, self.mesh, self.data_axis = gene_to_col, mesh, data_axis
        self.num_threads, self.prefetch = num_threads, prefetch
        self.num_features = ds.num_genes if gene_to_col is None else int(gene_to_col.max()) + 1
        self._obs = {name: self._codes(name) for name in self.obs_names}
        self._num_shards = 1 if mesh is None else mesh.shape[data_axis]
        self._local_shards = self._num_shards // plan.num_hosts
        self.nnz_capacity = nnz_capacity or self._default_capacity()
        # Read threads and prefetch already overlap batches, so a numba kernel per batch runs on one
        # thread unless it writes full-transcriptome rows (memory-bound: two threads help there).
        # Measured on 2 cores, batch 1,024: csr 144k vs 111k cells/s, dense-layout panel 296k vs
        # 259k with one thread; full dense rows 53k with two vs 45k with one.
        wide = output == "dense" and self.num_features * 4 >= _WIDE_ROW_BYTES
        self.decode_threads = decode_threads or (numba.config.NUMBA_NUM_THREADS if wide else 1)
        self._buffers = RowBuffers()
        self._iterator = None

    # ----- host side -------------------------------------------------------------------------
    def _codes(self, name: str) -> np.ndarray:
        if name not in self.dataset.obs:
            msg = f"obs column {name!r} not in {self.dataset.path}; available: {', '.join(self.dataset.obs)}"
            raise OmicsIOError(msg)
        column = self.dataset.obs[name]
        return column.codes if isinstance(column, Categorical) else column

    def _default_capacity(self) -> int:
        # The mean plus 6 standard deviations of a sum of `rows` cells whose nonzero counts have a
        # coefficient of variation ≤ 1 (single-cell data: ~0.5): a batch overflows practically never.
        m = self.dataset.manifest
        mean = max(m.nnz / max(m.num_cells, 1), 1.0)
        rows = self.plan.local_batch // max(self._local_shards, 1)
        return int(-(-(rows * mean + 6 * np.sqrt(rows) * mean) // 256) * 256)

    def _densify(self, mb: MiniBatch) -> HostBatch:
        if self.decode_threads >= numba.config.NUMBA_NUM_THREADS:  # all threads: nothing to set
            return self._densify_with(mb)
        previous = numba.get_num_threads()  # thread-local in numba: only this pipeline thread
        numba.set_num_threads(self.decode_threads)
        try:
            return self._densify_with(mb)
        finally:
            numba.set_num_threads(previous)

    def _densify_with(self, mb: MiniBatch) -> HostBatch:
        rows = np.where(mb.mask, mb.rows, 0)
        obs = {}
        for name, column in self._obs.items():  # categorical codes: -1 on padding; numerics: NaN
            if column.dtype.kind in "iu":
                obs[name] = np.where(mb.mask, column[rows], -1).astype(np.int32)
            else:
                obs[name] = np.where(mb.mask, column[rows], np.nan).astype(np.float32)
        buf, starts = mb.joined()
        if self.output == "csr":
            try:
                x = _codec.decode_slabs(buf, starts, num_rows=len(mb.mask), num_columns=self.dataset.num_genes,
                                        num_slabs=max(self._local_shards, 1), capacity=self.nnz_capacity,
                                        empty=self._buffers.empty)
            except ValueError as e:
                msg = f"{self.dataset.path}: {e}"
                raise OmicsIOError(msg) from e
            return HostBatch(x, obs, mb.rows.astype(np.int32), mb.mask)
        with corruption_reported(self.dataset.path):  # one pass: records → (panel) rows, padding zeroed
            x = _scatter.decode_scatter(buf, starts, self._new_rows(len(mb.mask)), gene_to_col=self.gene_to_col,
                                        normalize=self.normalize, target_sum=self.target_sum)
        return HostBatch(x, obs, mb.rows.astype(np.int32), mb.mask)

    def _new_rows(self, num_rows: int) -> np.ndarray:
        return self._buffers.empty((num_rows, self.num_features))

    def as_grain_dataset(self):
        """The host-side stream (numpy `HostBatch`es) as a Grain `IterDataset`, before device placement."""
        reader = FetchReader(self.dataset)
        return build_pipeline(self.plan, reader, host=self.host, num_epochs=self.num_epochs, densify=self._densify,
                              num_threads=self.num_threads, prefetch_fetches=self.prefetch)

    # ----- device side -----------------------------------------------------------------------
    def _place(self, hb: HostBatch) -> Batch:
        return place_batch(hb, self.mesh, self.data_axis, self.plan.num_hosts)

    def densify(self, x: SparseBatch):
        """Dense ``(batch_size, genes)`` float32 from a `SparseBatch`, computed on the devices (jitted)."""
        return _densify_sharded(x.row_ids, x.indices, x.values, rows_per_shard=self.plan.batch_size // self._num_shards,
                                num_genes=self.num_features, normalize=self.normalize, target_sum=self.target_sum)

    # ----- iteration and state ---------------------------------------------------------------
    def _make_iterator(self):
        from grain.experimental import ThreadPrefetchIterDataset

        stream = self.as_grain_dataset().map(self._place)
        iterator = iter(ThreadPrefetchIterDataset(stream, prefetch_buffer_size=2))
        # Stop the prefetch threads when the loader goes away or, at the latest, before the
        # interpreter shuts down: a thread still inside a numba or ArrayRecord call then aborts it.
        self._finalizer = weakref.finalize(self, iterator.close)
        return iterator

    def close(self) -> None:
        """Stop the background threads (also done automatically when the loader is collected)."""
        if self._iterator is not None:
            self._finalizer()
            self._iterator = None

    def __iter__(self) -> Iterator[Batch]:
        if self._iterator is None:
            self._iterator = self._make_iterator()
        return self

    def __next__(self) -> Batch:
        if self._iterator is None:
            self._iterator = self._make_iterator()
        return next(self._iterator)

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch

    def config(self) -> dict:
        """What decides the batches: dataset fingerprint and every sampling/output knob."""
        return {
            "dataset": self.dataset.fingerprint[:16], **self.plan.describe(), "host": self.host,
            "num_epochs": self.num_epochs, "obs": list(self.obs_names), "output": self.output,
            "panel": None if self.gene_to_col is None else hashlib.sha256(self.gene_to_col.tobytes()).hexdigest()[:16],
            "normalize": self.normalize, "target_sum": self.target_sum,
            "nnz_capacity": self.nnz_capacity if self.output == "csr" else None,
        }

    def get_state(self) -> dict:
        """Small JSON-able state: where the stream stands (Grain's iterator state) and the config."""
        if self._iterator is None:
            self._iterator = self._make_iterator()
        return {"version": STATE_VERSION, "config": self.config(), "grain": self._iterator.get_state()}

    def set_state(self, state: dict) -> None:
        """Resume from `get_state` output; refuses state from another dataset or config."""
        check_state(state, STATE_VERSION, self.config())
        if self._iterator is None:
            self._iterator = self._make_iterator()
        self._iterator.set_state(json.loads(json.dumps(state["grain"])))


def make_loader(
    ds: Dataset,
    *,
    batch_size: int,
    block_size: int = 16,
    fetch_factor: int = 64,
    seed: int = 0,
    num_epochs: int | None = 1,
    sampling: str = "block",
    weights: np.ndarray | None = None,
    balance_by: str | None = None,
    rows: np.ndarray | Sequence[int] | None = None,
    obs: Sequence[str] = (),
    output: str = "dense",
    genes: Sequence[str | int] | None = None,
    normalize: str | None = None,
    target_sum: float = 1e4,
    mesh=None,
    data_axis: str = "data",
    drop_remainder: bool = True,
    num_threads: int = 2,
    prefetch: int = 2,
    nnz_capacity: int | None = None,
    decode_threads: int | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
) -> Loader:
    """Batches of cells from ``ds`` by block sampling with batched fetching (scDataset's recipe).

    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))                      # doctest: +SKIP
    >>> loader = make_loader(ds, batch_size=1024, block_size=16, fetch_factor=64, seed=0,
    ...                      obs=("drug",), output="dense", mesh=mesh)             # doctest: +SKIP
    >>> for batch in loader: ...        # batch.x: (1024, num_genes) float32, sharded P("data")

    ``batch_size`` is the global batch; each of the ``process_count`` hosts serves
    ``batch_size / process_count`` rows. ``genes`` selects a panel (names, Ensembl ids or
    column numbers). ``normalize`` is None, ``"log1p"`` or ``"normalize_log1p"`` (scanpy's
    normalize_total + log1p, fused into the scatter). ``rows`` restricts sampling to a subset
    (e.g. ``ds.rows_where("batch", ["plate_13"], invert=True)``); ``sampling`` is one of
    ``block``, ``stream``, ``stream_buffer``, ``weighted`` (needs ``weights``, one per cell of
    ``rows``) or ``class_balanced`` (needs ``balance_by``, an obs column). ``num_threads``
    threads read fetches ahead; ``decode_threads`` numba threads decode each batch (default: 1,
    or all of them for full-transcriptome dense rows, where two threads write faster than one).
    """
    if output not in OUTPUTS:
        msg = f"output must be one of {', '.join(OUTPUTS)}; got {output!r}"
        raise OmicsIOError(msg)
    if output == "csr" and genes is not None:
        msg = "output='csr' carries every gene of the dataset; for a gene panel use output='dense' with genes=..."
        raise OmicsIOError(msg)
    if normalize not in (None, "log1p", "normalize_log1p"):
        msg = f"normalize must be None, 'log1p' or 'normalize_log1p'; got {normalize!r}"
        raise OmicsIOError(msg)
    host = jax.process_index() if process_index is None else process_index
    hosts = jax.process_count() if process_count is None else process_count
    rows_arr = np.arange(ds.num_cells, dtype=np.int64) if rows is None else np.unique(np.asarray(rows, np.int64))
    if len(rows_arr) and (rows_arr[0] < 0 or rows_arr[-1] >= ds.num_cells):
        msg = f"rows must lie in 0..{ds.num_cells - 1}"
        raise IndexError(msg)
    if sampling == "class_balanced":
        if balance_by is None:
            msg = "sampling='class_balanced' needs balance_by=<categorical obs column>"
            raise OmicsIOError(msg)
        column = ds.obs[balance_by]
        weights = class_weights(np.asarray(column.codes if isinstance(column, Categorical) else column)[rows_arr])
    elif weights is not None:
        weights = np.asarray(weights, dtype=np.float64)
    plan = SamplingPlan(rows_arr, batch_size, block_size, fetch_factor, seed, sampling, hosts, drop_remainder, weights)
    if plan.steps_per_epoch == 0:
        msg = (f"{len(rows_arr)} cells make no batch of {batch_size} (per host: {plan.local_batch}); "
               "lower batch_size or pass drop_remainder=False")
        raise OmicsIOError(msg)
    if mesh is not None:
        shards = mesh.shape[data_axis]
        if batch_size % shards:
            msg = f"batch_size {batch_size} must be divisible by the {shards} devices of mesh axis {data_axis!r}"
            raise OmicsIOError(msg)
    gene_to_col = None if genes is None else _gene_to_col(ds, genes)
    return Loader(ds, plan, host=host, num_epochs=num_epochs, obs=obs, output=output, gene_to_col=gene_to_col,
                  normalize=normalize, target_sum=target_sum, mesh=mesh, data_axis=data_axis,
                  num_threads=num_threads, prefetch=prefetch, nnz_capacity=nnz_capacity,
                  decode_threads=decode_threads)
