"""The focused-gene regime: a ~2k-gene panel of every cell held densely in RAM, or on the devices.

`load_panel` fills an ``(cells, genes)`` float32 array from a materialized dataset (a dense
panel dataset decodes straight into it) or from a query (`CellTable`, streamed through the
numba panel scatter). `make_memory_loader` then serves batches:

- ``placement="host"``: each epoch is a permutation ``default_rng([seed, epoch])`` of the
  cells; a batch is a parallel numba row gather into a 64-byte aligned buffer that
  ``make_array_from_process_local_data`` adopts without a copy. Multi-host: every host holds
  the panel and serves its slice of each global batch.
- ``placement="device"``: the panel is placed once on the devices, sharded along cells with
  ``NamedSharding(mesh, P(axis))`` (cells dealt to devices by the permutation
  ``default_rng([seed, PLACEMENT_STREAM])``); each epoch every device permutes its own cells
  (``default_rng([seed, epoch, device])``, uploaded as one small int32 array per epoch) and a
  jitted gather draws each step's rows where they live: no host-to-device copy per step and no
  cross-device traffic. Cells left over when a device's share is not a multiple of its batch
  slice sit out that epoch (a different few each epoch).

Both replay exactly: the state is ``(epoch, step)`` plus a fingerprint of data and config.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numba as nb
import numpy as np
from tqdm.auto import tqdm

from . import _codec, _scatter
from ._background import Background
from ._dataset import Categorical, Dataset, _runs, corruption_reported
from ._errors import OmicsIOError
from ._loader import Batch, HostBatch, RowBuffers, _gene_to_col, aligned_empty, check_state, data_sharding, place_batch
from ._query import CellTable

STATE_VERSION = 1
PLACEMENT_STREAM = 0x5EED  # the rng stream that deals cells to devices (placement="device")
PLACEMENTS = ("host", "device")
_READ_CELLS = 1 << 14


@dataclasses.dataclass(frozen=True)
class InMemoryPanel:
    """Dense ``x`` (cells × genes, float32, 64-byte aligned) with obs, provenance and a fingerprint.

    ``rowids[i]`` is cell ``i``'s row in its source (dataset row or table ``cell_rowid``);
    ``obs[name]`` holds int32 codes into ``categories[name]`` (-1 = missing) or float32 numbers
    (``categories[name]`` None).
    """

    x: np.ndarray
    obs: dict[str, np.ndarray]
    categories: dict[str, tuple | None]
    rowids: np.ndarray
    genes: tuple[str, ...]
    fingerprint: str

    @property
    def num_cells(self) -> int:
        return self.x.shape[0]

    @property
    def nbytes(self) -> int:
        return self.x.nbytes


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _check_memory(num_cells: int, width: int) -> None:
    need = num_cells * width * 4
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > 0.8 * total:
        msg = (f"a dense {num_cells:,} × {width:,} float32 panel needs {need / 2**30:.1f} GiB, more than 80% of "
               f"this machine's {total / 2**30:.1f} GiB: choose a smaller panel (genes=...) or fewer cells, "
               "or stream with make_loader / make_stream_loader")
        raise OmicsIOError(msg)


def load_panel(source: Dataset | CellTable, genes: Sequence[str | int] | None = None, *,
               rows: Sequence[int] | np.ndarray | None = None, where: str | None = None,
               obs: Sequence[str] = (), normalize: str | None = None, target_sum: float = 1e4,
               progress: bool = True) -> InMemoryPanel:
    """Load a gene panel of every selected cell densely into host RAM.

    ``source`` is a materialized `Dataset` (``rows`` selects dataset rows; ``genes=None`` keeps
    every column, the natural choice for a dense panel dataset) or a `CellTable` (``where``
    and/or ``rows`` as ``cell_rowid``s select cells; ``genes`` is required). ``normalize`` as
    in `make_loader` (the row total of a sparse source covers every gene, as in scanpy).
    """
    _scatter._mode_code(normalize, target_sum)
    if isinstance(source, CellTable):
        if genes is None:
            msg = "load_panel from a table needs genes=[...]: a full-transcriptome table does not fit in RAM densely"
            raise OmicsIOError(msg)
        return _from_table(source, genes, rows, where, obs, normalize, target_sum, progress)
    if where is not None:
        msg = "where= selects cells of a CellTable; for a Dataset pass rows=ds.rows_where(...)"
        raise OmicsIOError(msg)
    return _from_dataset(source, genes, rows, obs, normalize, target_sum, progress)


def _from_dataset(ds: Dataset, genes, rows, obs, normalize, target_sum, progress) -> InMemoryPanel:
    ids = np.arange(ds.num_cells, dtype=np.int64) if rows is None else np.unique(ds._check_rows(rows))
    gene_to_col = None if genes is None else _gene_to_col(ds, genes)
    width = ds.num_genes if gene_to_col is None else int(gene_to_col.max()) + 1
    _check_memory(len(ids), width)
    x = aligned_empty((len(ids), width))
    names = ds.features
    column = next((c for c in ("gene_name", "ensembl_id") if c in names), None)
    labels = [str(v) for v in (names[column] if column else range(ds.num_genes))]
    panel_genes = tuple(labels)
    if gene_to_col is not None:
        cols = np.flatnonzero(gene_to_col >= 0)
        panel_genes = tuple(labels[c] for c in cols[np.argsort(gene_to_col[cols])])
    pos = 0
    with tqdm(total=len(ids), unit="cells", desc="load panel", disable=not progress, unit_scale=True) as bar:
        for begin, end in _runs(ids):
            for lo in range(begin, end, _READ_CELLS):
                hi = min(lo + _READ_CELLS, end)
                buf, starts = _codec.join_records(ds.read_records(lo, hi))
                out = x[pos : pos + hi - lo]
                with corruption_reported(ds.path):
                    _scatter.decode_scatter(buf, starts, out, gene_to_col=gene_to_col, normalize=normalize,
                                            target_sum=target_sum)
                pos += hi - lo
                bar.update(hi - lo)
    obs_arrays, categories = {}, {}
    for name in obs:
        if name not in ds.obs:
            msg = f"obs column {name!r} not in {ds.path}; available: {', '.join(ds.obs)}"
            raise OmicsIOError(msg)
        col = ds.obs[name]
        if isinstance(col, Categorical):
            obs_arrays[name], categories[name] = col.codes[ids].astype(np.int32), tuple(col.categories)
        else:
            obs_arrays[name], categories[name] = np.asarray(col)[ids].astype(np.float32), None
    fp = _fingerprint("dataset", ds.fingerprint, hashlib.sha256(ids.tobytes()).hexdigest(),
                      None if gene_to_col is None else hashlib.sha256(gene_to_col.tobytes()).hexdigest(),
                      normalize, target_sum, list(obs))
    return InMemoryPanel(x, obs_arrays, categories, ids, panel_genes, fp)


def _from_table(table: CellTable, genes, rows, where, obs, normalize, target_sum, progress) -> InMemoryPanel:
    from ._stream import obs_specs

    tokens = table.genes.resolve(genes)
    gene_to_col = _scatter.make_gene_to_col(max(table.genes.num_tokens, int(tokens.max(initial=-1)) + 1), tokens)
    selected = table.select(where, rowids=rows)
    _check_memory(len(selected), len(tokens))
    x = aligned_empty((len(selected), len(tokens)))
    specs = obs_specs(table, obs)
    obs_arrays = {s.name: np.empty(len(selected), np.int32 if s.categories is not None else np.float32)
                  for s in specs}
    rowids = np.empty(len(selected), np.int64)
    pos = 0
    with tqdm(total=len(selected), unit="cells", desc="load panel", disable=not progress, unit_scale=True) as bar:
        for b in table.stream_csr([s.name for s in specs], where=where, rowids=rows):
            n = b.num_rows
            _scatter.scatter_panel(b.indptr, b.indices, b.values, gene_to_col, out=x[pos : pos + n],
                                   normalize=normalize, target_sum=target_sum)
            rowids[pos : pos + n] = b.rowids
            for s in specs:
                obs_arrays[s.name][pos : pos + n] = s.encode(b.columns[s.name])
            pos += n
            bar.update(n)
    if pos != len(selected):
        msg = f"{table.spec} changed while loading: expected {len(selected)} cells, read {pos}"
        raise OmicsIOError(msg)
    fp = _fingerprint("table", table.fingerprint(), where, hashlib.sha256(rowids.tobytes()).hexdigest(),
                      tokens.tolist(), normalize, target_sum, [s.name for s in specs])
    return InMemoryPanel(x, obs_arrays, {s.name: s.categories for s in specs}, rowids,
                         tuple(table.genes.names(tokens)), fp)


@nb.njit(parallel=True, nogil=True, cache=True)
def _gather_rows(x, rows, out):
    for i in nb.prange(rows.shape[0]):
        out[i, :] = x[rows[i], :]


@functools.partial(jax.jit, static_argnames=("rows",))
def _draw(arrays, perm, step, *, rows):
    """Each device gathers ``rows`` of its own cells: ``arrays`` leaves are (devices, L, ...) and
    ``perm`` is (devices, L), both sharded on axis 0; results are flattened to (devices × rows, ...)."""
    idx = jax.lax.dynamic_slice_in_dim(perm, step * rows, rows, axis=1)

    def take(a):
        picked = jax.vmap(lambda local, i: jnp.take(local, i, axis=0, mode="clip"))(a, idx)  # in bounds
        return picked.reshape(-1, *a.shape[2:])

    return jax.tree.map(take, arrays)


class MemoryLoader:
    """Batches from an `InMemoryPanel`; `get_state`/`set_state` resume exactly. Use `make_memory_loader`."""

    def __init__(self, panel: InMemoryPanel, *, batch_size: int, seed: int, num_epochs: int | None,
                 placement: str, mesh, data_axis: str, drop_remainder: bool, host: int, hosts: int,
                 prefetch: int):
        self.panel, self.batch_size, self.seed, self.num_epochs = panel, batch_size, seed, num_epochs
        self.placement, self.mesh, self.data_axis, self.drop_remainder = placement, mesh, data_axis, drop_remainder
        self.host, self.hosts, self.prefetch = host, hosts, prefetch
        self.local_batch = batch_size // hosts
        self._epoch, self._step = 0, 0
        self._stream = None
        self._perm_cache: tuple[int | None, np.ndarray | None] = (None, None)
        self._buffers = RowBuffers()
        if placement == "device":
            self._place_on_devices()
        n = panel.num_cells
        self.steps_per_epoch = self._device_steps if placement == "device" else (
            n // batch_size if drop_remainder else -(-n // batch_size))

    # ----- state -----------------------------------------------------------------------------
    def config(self) -> dict:
        return {"panel": self.panel.fingerprint[:16], "batch_size": self.batch_size, "seed": self.seed,
                "num_epochs": self.num_epochs, "placement": self.placement, "drop_remainder": self.drop_remainder,
                "hosts": self.hosts, "host": self.host,
                "devices": None if self.mesh is None else int(self.mesh.shape[self.data_axis])}

    def get_state(self) -> dict:
        """``{"version", "config", "epoch", "step"}``: the next batch to serve (< 1 KB of JSON)."""
        return {"version": STATE_VERSION, "config": self.config(), "epoch": self._epoch, "step": self._step}

    def set_state(self, state: dict) -> None:
        """Resume at ``state``; refuses state from another panel or config, showing both values."""
        check_state(state, STATE_VERSION, self.config())
        self.close()
        self._epoch, self._step = int(state["epoch"]), int(state["step"])

    # ----- iteration -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        if self.placement == "device":
            batch = self._device_batch(self._epoch, self._step)
        elif self.prefetch <= 0:  # gather in the caller's thread
            batch = place_batch(self._host_batch(self._rows(self._epoch, self._step)), self.mesh, self.data_axis,
                                self.hosts)
        else:
            if self._stream is None:
                start = (self._epoch, self._step)
                self._stream = Background(lambda: self._host_batches(*start), depth=self.prefetch)
            batch = place_batch(next(self._stream), self.mesh, self.data_axis, self.hosts)
        self._step += 1
        if self._step >= self.steps_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0
        return batch

    def close(self) -> None:
        """Stop the prefetch thread (restarted on the next batch)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    # ----- host placement --------------------------------------------------------------------
    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_cache[0] != epoch:
            self._perm_cache = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.panel.num_cells))
        return self._perm_cache[1]

    def _rows(self, epoch: int, step: int) -> np.ndarray:
        """This host's cells of batch ``step`` of ``epoch``."""
        lo = step * self.batch_size + self.host * self.local_batch
        return self._permutation(epoch)[lo : lo + self.local_batch]

    def _host_batches(self, epoch: int, step: int) -> Iterator[HostBatch]:
        while self.num_epochs is None or epoch < self.num_epochs:
            for s in range(step, self.steps_per_epoch):
                yield self._host_batch(self._rows(epoch, s))
            epoch, step = epoch + 1, 0

    def _host_batch(self, rows: np.ndarray) -> HostBatch:
        n, b = len(rows), self.local_batch
        x = self._buffers.empty((b, self.panel.x.shape[1]))
        _gather_rows(self.panel.x, rows, x[:n])
        if n < b:
            x[n:] = 0
        obs = {}
        for name, column in self.panel.obs.items():
            out = np.full(b, -1 if column.dtype.kind in "iu" else np.nan, column.dtype)
            out[:n] = column[rows]
            obs[name] = out
        index = np.full(b, -1, np.int32)
        index[:n] = self.panel.rowids[rows]
        return HostBatch(x, obs, index, np.arange(b) < n)

    # ----- device placement ------------------------------------------------------------------
    def _place_on_devices(self) -> None:
        n = self.panel.num_cells
        devices = 1 if self.mesh is None else int(self.mesh.shape[self.data_axis])
        deal = np.random.default_rng([self.seed, PLACEMENT_STREAM]).permutation(n)
        parts = np.array_split(deal, devices)
        self._valid = np.array([len(p) for p in parts])
        rows_local = self.batch_size // devices
        self._device_steps = int(self._valid.min()) // rows_local
        self._devices, self._rows_local, self._length = devices, rows_local, max(int(self._valid.max()), 1)
        sharding = data_sharding(self.mesh, self.data_axis)

        def put(column: np.ndarray, fill) -> jax.Array:
            def shard(index) -> np.ndarray:
                d = index[0].start or 0
                part = parts[d]
                out = np.full((1, self._length, *column.shape[1:]), fill, column.dtype)
                out[0, : len(part)] = column[part]
                return out

            return jax.make_array_from_callback((devices, self._length, *column.shape[1:]), sharding, shard)

        self._arrays = {"x": put(self.panel.x, 0),
                        "index": put(self.panel.rowids.astype(np.int32), -1),
                        "obs": {k: put(v, -1 if v.dtype.kind in "iu" else np.nan) for k, v in self.panel.obs.items()}}
        self._perm_epoch, self._perm = None, None
        ones = np.ones(self.batch_size, bool)
        self._mask = jax.make_array_from_callback(ones.shape, data_sharding(self.mesh, self.data_axis),
                                                  lambda index: ones[index])

    def _device_batch(self, epoch: int, step: int) -> Batch:
        if self._perm_epoch != epoch:
            perms = np.zeros((self._devices, self._length), np.int32)
            for d in range(self._devices):
                perms[d, : self._valid[d]] = np.random.default_rng([self.seed, epoch, d]).permutation(self._valid[d])
            self._perm = jax.make_array_from_callback(perms.shape, data_sharding(self.mesh, self.data_axis), lambda index: perms[index])
            self._perm_epoch = epoch
        out = _draw(self._arrays, self._perm, step, rows=self._rows_local)
        return Batch(out["x"], out["obs"], out["index"], self._mask)


def make_memory_loader(
    panel: InMemoryPanel,
    *,
    batch_size: int,
    seed: int = 0,
    num_epochs: int | None = 1,
    placement: str = "host",
    mesh=None,
    data_axis: str = "data",
    drop_remainder: bool = True,
    prefetch: int = 0,
    process_index: int | None = None,
    process_count: int | None = None,
) -> MemoryLoader:
    """Batches from a panel in memory: shuffled per epoch, placed as jax.Arrays sharded on ``data_axis``.

    >>> panel = oj.load_panel(oj.open_dataset("out_panel/"), obs=("drug",))      # doctest: +SKIP
    >>> loader = oj.make_memory_loader(panel, batch_size=1024, seed=0, num_epochs=None,
    ...                                placement="device", mesh=mesh)               # doctest: +SKIP
    >>> batch = next(loader); state = loader.get_state()     # loader.set_state(state) replays

    ``placement="host"`` keeps the panel in host RAM and copies each batch to the devices;
    ``"device"`` keeps the whole panel on the devices (see the module docstring). With
    ``drop_remainder=False`` (host placement only) the last batch of an epoch is padded and
    masked. ``prefetch`` > 0 gathers that many host batches ahead in a thread; the default 0
    gathers in the caller's thread (a 1,024 × 2,000 batch is a ~0.5 ms copy, and JAX's async
    dispatch already overlaps it with the previous step; on 2 CPU cores the thread costs ~20%).
    """
    if placement not in PLACEMENTS:
        msg = f"placement must be one of {', '.join(PLACEMENTS)}; got {placement!r}"
        raise OmicsIOError(msg)
    host = jax.process_index() if process_index is None else process_index
    hosts = jax.process_count() if process_count is None else process_count
    devices = 1 if mesh is None else int(mesh.shape[data_axis])
    if batch_size <= 0 or batch_size % hosts or batch_size % devices:
        msg = f"batch_size {batch_size} must be a positive multiple of the {hosts} host(s) and {devices} device(s)"
        raise OmicsIOError(msg)
    if placement == "device" and not drop_remainder:
        msg = "placement='device' always drops the remainder (each device draws only full batches)"
        raise OmicsIOError(msg)
    loader = MemoryLoader(panel, batch_size=batch_size, seed=seed, num_epochs=num_epochs, placement=placement,
                          mesh=mesh, data_axis=data_axis, drop_remainder=drop_remainder, host=host, hosts=hosts,
                          prefetch=prefetch)
    if loader.steps_per_epoch == 0:
        msg = f"{panel.num_cells} cells make no batch of {batch_size}; lower batch_size"
        raise OmicsIOError(msg)
    return loader
