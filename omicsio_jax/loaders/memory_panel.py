"""`load_panel`: a gene panel of every selected cell, dense in host RAM (the focused-gene regime).

The panel is filled from a materialized dataset (records decoded straight into its rows; a dense
panel dataset keeps every column) or from a query (`CellTable` rows streamed through the panel
scatter), through the same `Panel` / `Dense` output kinds the loaders use. `make_memory_loader`
serves batches from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

import numpy as np

from omicsio_jax.core.buffers import aligned_empty
from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.core.progress import progress_bar
from omicsio_jax.dataset.dataset import Dataset
from omicsio_jax.dataset.obs import Categorical
from omicsio_jax.format.codec import Records
from omicsio_jax.loaders.batch_obs import carried_column, obs_names
from omicsio_jax.outputs.base import OutputContext
from omicsio_jax.outputs.dense import Dense
from omicsio_jax.outputs.panel import Panel
from omicsio_jax.query.cell_table import CellTable
from omicsio_jax.records.runs import consecutive_runs, records_checked
from omicsio_jax.storage.memory import memory_limit

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
    need, total = num_cells * width * 4, memory_limit()
    if total and need > 0.8 * total:
        msg = (
            f"a dense {num_cells:,} × {width:,} float32 panel needs {need / 2**30:.1f} GiB, more than 80% of "
            f"the {total / 2**30:.1f} GiB this process may use: choose a smaller panel (genes=...) or fewer cells, "
            "or stream with make_loader / make_stream_loader"
        )
        raise OmicsIOError(msg)


def load_panel(
    source: Dataset | CellTable,
    genes: Sequence[str | int] | None = None,
    *,
    rows: Sequence[int] | np.ndarray | None = None,
    where: str | None = None,
    obs: str | Sequence[str] = (),
    normalize: str | None = None,
    target_sum: float = 1e4,
    progress: bool = True,
) -> InMemoryPanel:
    """Load a gene panel of every selected cell densely into host RAM.

    ``source`` is a materialized `Dataset` (``rows`` selects dataset rows; ``genes=None`` keeps
    every column, the natural choice for a dense panel dataset) or a `CellTable` (``where``
    and/or ``rows`` as ``cell_rowid``s select cells; ``genes`` is required). ``normalize`` as
    in `make_loader` (the row total of a sparse source covers every gene, as in scanpy).
    """
    obs = obs_names(obs)
    if isinstance(source, CellTable):
        if genes is None:
            msg = "load_panel from a table needs genes=[...]: a full-transcriptome table does not fit in RAM densely"
            raise OmicsIOError(msg)
        return _from_table(source, genes, rows, where, obs, normalize, target_sum, progress)
    if where is not None:
        msg = "where= selects cells of a CellTable; for a Dataset pass rows=ds.rows_where(...)"
        raise OmicsIOError(msg)
    return _from_dataset(source, genes, rows, obs, normalize, target_sum, progress)


def _dense(genes, normalize: str | None, target_sum: float) -> Dense | Panel:
    """Every gene's column (``genes`` None) or the panel of ``genes``, normalized as asked."""
    if genes is None:
        return Dense(normalize=normalize, target_sum=target_sum)
    return Panel(genes, normalize=normalize, target_sum=target_sum)


def _from_dataset(ds: Dataset, genes, rows, obs, normalize, target_sum, progress) -> InMemoryPanel:
    ids = np.arange(ds.num_cells, dtype=np.int64) if rows is None else np.unique(ds.check_rows(rows))
    columns = {name: carried_column(ds, name, np.float32) for name in obs}  # refused before the read
    output = _dense(genes, normalize, target_sum)
    output = output.bind(OutputContext.of_dataset(ds))
    _check_memory(len(ids), output.num_columns)
    x = aligned_empty((len(ids), output.num_columns))
    names = ds.features
    column = next((c for c in ("gene_name", "ensembl_id") if c in names), None)
    labels = [str(v) for v in (names[column] if column else range(ds.num_genes))]
    panel_genes = tuple(labels) if genes is None else tuple(labels[c] for c in ds.gene_columns(genes))
    pos = 0
    with progress_bar(
        total=len(ids), unit="cells", desc="load panel", progress=progress, unit_scale=True
    ) as bar:
        for begin, end in consecutive_runs(ids):
            for lo in range(begin, end, _READ_CELLS):
                hi = min(lo + _READ_CELLS, end)
                with records_checked(ds, np.arange(lo, hi)):
                    records = Records.check(*ds.read_buffer(lo, hi), ds.num_genes)
                    output.from_records(records, lambda shape, dtype, at=pos: x[at : at + shape[0]])
                pos += hi - lo
                bar.update(hi - lo)
    obs_arrays, categories = {}, {}
    for name, col in columns.items():
        if isinstance(col, Categorical):
            obs_arrays[name], categories[name] = col.codes[ids].astype(np.int32), tuple(col.categories)
        else:
            obs_arrays[name], categories[name] = np.asarray(col)[ids].astype(np.float32), None
    fp = _fingerprint(
        "dataset", ds.fingerprint, hashlib.sha256(ids.tobytes()).hexdigest(), output.config(), list(obs)
    )
    return InMemoryPanel(x, obs_arrays, categories, ids, panel_genes, fp)


def _from_table(table: CellTable, genes, rows, where, obs, normalize, target_sum, progress) -> InMemoryPanel:
    tokens = table.genes.resolve(genes)
    output = _dense(tokens.tolist(), normalize, target_sum)
    output = output.bind(OutputContext.of_table(table))
    selected = table.select(where, rowids=rows)
    _check_memory(len(selected), len(tokens))
    x = aligned_empty((len(selected), len(tokens)))
    specs = table.obs_specs(obs)
    obs_arrays = {
        s.name: np.empty(len(selected), np.int32 if s.categories is not None else np.float32) for s in specs
    }
    rowids = np.empty(len(selected), np.int64)
    pos = 0
    with progress_bar(
        total=len(selected), unit="cells", desc="load panel", progress=progress, unit_scale=True
    ) as bar:
        for b in table.stream_csr([s.name for s in specs], where=where, rowids=rows):
            n = b.num_rows
            output.from_csr(b.indptr, b.indices, b.values, lambda shape, dtype, at=pos: x[at : at + shape[0]])
            rowids[pos : pos + n] = b.rowids
            for s in specs:
                obs_arrays[s.name][pos : pos + n] = s.encode(b.columns[s.name])
            pos += n
            bar.update(n)
    if pos != len(selected):
        msg = f"{table.spec} changed while loading: expected {len(selected)} cells, read {pos}"
        raise OmicsIOError(msg)
    fp = _fingerprint(
        "table",
        table.fingerprint(),
        where,
        hashlib.sha256(rowids.tobytes()).hexdigest(),
        tokens.tolist(),
        normalize,
        target_sum,
        [s.name for s in specs],
    )
    return InMemoryPanel(
        x, obs_arrays, {s.name: s.categories for s in specs}, rowids, tuple(table.genes.names(tokens)), fp
    )
