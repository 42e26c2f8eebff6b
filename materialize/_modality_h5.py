"""Further modalities in the primary's own file: ``.h5ad`` / ``.h5mu`` layers, and ``.h5mu``
modalities aligned with the primary through MuData's ``obsmap`` (or by obs names)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from omicsio_jax import DataValidationError
from omicsio_jax.format import take_rows

from ._anndata_elements import Frame, index_array
from ._h5ad import DEFAULT_BATCH_CELLS as DEFAULT_H5_BATCH_CELLS
from ._h5ad import H5adSource, open_h5
from ._plan import Partition, whole_partitions
from ._source import Batch, Source, require_file
from ._validate import UniqueStrings

_GAP_ROWS = 64  # .h5mu rows closer than this are read in one range
_NAME_ROWS = 1 << 18  # obs names read at once when checking they are unique


def h5mu_modalities(path) -> list[str]:
    """The modality names of an ``.h5mu`` file (``mod/<name>``), in the file's ``mod-order``."""
    require_file(path)
    try:
        with open_h5(path) as f:
            mod = f["mod"]
            order = [n.decode() if isinstance(n, bytes) else str(n) for n in mod.attrs.get("mod-order", [])]
            return [n for n in order if n in mod] + sorted(n for n in mod if n not in order)
    except (OSError, KeyError) as e:
        msg = f"cannot read {path}: {e} (is it a complete MuData .h5mu file?)"
        raise DataValidationError(msg) from e


def _strings(node) -> np.ndarray:
    return np.asarray(node.asstr()[:], dtype=object)


def _refuse_repeated_names(f, path, mod: str, primary: str) -> None:
    """Raise `DataValidationError` for an obs name (cell_id) that occurs twice in modality ``mod``,
    naming its first two rows (`UniqueStrings`: 8 bytes a cell in a scratch folder, none in memory)."""
    group = f["mod"][mod]
    obs = Frame(group["obs"], group.get("uns"))
    n = len(obs)

    def names() -> Iterator[pa.RecordBatch]:
        for lo in range(0, n, _NAME_ROWS):
            yield pa.record_batch([obs.index(lo, min(n, lo + _NAME_ROWS))], names=["cell_id"])

    with tempfile.TemporaryDirectory(prefix="omicsio-h5mu-names-") as scratch:
        unique = UniqueStrings(Path(scratch))
        try:
            for batch in names():
                unique.add(batch.column(0))
            twice = unique.first_repeat(names)
        finally:
            unique.close()
    if twice is not None:
        cell, a, b = twice
        where = f"rows {a} and {b} of {path}:mod/{mod}"
        said = (
            f"duplicate cell_id {cell} in the primary modality {mod} ({where})"
            if mod == primary
            else f"modality {mod}: duplicate cell_id {cell} in {where}"
        )
        msg = f"{said}: modalities are aligned by cell_id, which must be unique"
        raise DataValidationError(msg)


def h5mu_alignment(
    path, primary: str, name: str, *, require_all: bool, check_primary: bool = True
) -> np.ndarray | None:
    """For each cell of the primary modality, its row in modality ``name`` (-1: absent); None when
    the rows are the same cells in the same order. From MuData's ``obsmap`` (1-based rows, 0 for
    absent), else by obs names. Refuses an obs name that occurs twice in either modality first
    (the primary's only with ``check_primary``: a run checks it once, for its first further
    modality): MuData gives the second its own cell, which would otherwise read as a cell the
    primary lacks."""
    label = f"{path}"
    try:
        with open_h5(path) as f:
            for mod in (primary, name) if check_primary else (name,):
                _refuse_repeated_names(f, path, mod, primary)
            if "obsmap" in f and primary in f["obsmap"] and name in f["obsmap"]:
                p_map = f["obsmap"][primary][:].astype(np.int64) - 1
                m_map = f["obsmap"][name][:].astype(np.int64) - 1
                n_p = _num_obs(f, primary)
                n_m = _num_obs(f, name)
                if len(p_map) != len(m_map) or p_map.max(initial=-1) >= n_p or m_map.max(initial=-1) >= n_m:
                    msg = f"{label}: obsmap/{primary} and obsmap/{name} cannot be aligned (lengths or rows out of range)"
                    raise DataValidationError(msg)
                stray = np.flatnonzero((p_map < 0) & (m_map >= 0))
                ids = _strings(index_array(f["obs"])) if len(stray) else None
                rows = np.full(n_p, -1, np.int64)
                held = p_map >= 0
                if (
                    np.bincount(p_map[held], minlength=n_p).max(initial=0) > 1
                    or np.bincount(m_map[m_map >= 0], minlength=n_m).max(initial=0) > 1
                ):
                    msg = f"{label}: obsmap maps a row of {primary} or {name} to several cells: they cannot be aligned"
                    raise DataValidationError(msg)
                rows[p_map[held]] = m_map[held]
            else:
                p_ids = _strings(index_array(f["mod"][primary]["obs"]))
                m_ids = _strings(index_array(f["mod"][name]["obs"]))
                lookup = {cell: i for i, cell in enumerate(m_ids)}
                rows = np.array([lookup.get(cell, -1) for cell in p_ids], np.int64)
                seen = set(p_ids)
                stray = np.array([i for i, cell in enumerate(m_ids) if cell not in seen], np.int64)
                ids = m_ids
            if len(stray):
                cell, count = ids[stray[0]], len(stray)
                who = (
                    f"{count:,} of its cells (cell_id {cell} first) have"
                    if count > 1
                    else f"cell_id {cell} has"
                )
                msg = (
                    f"modality {name}: {who} no {primary} in {label}, and a dataset holds the cells of its "
                    f"primary modality ({primary}) only: leave {name} out (--modality NAME for each modality "
                    f"to keep; --modality {primary} keeps {primary} alone), take as primary a modality that "
                    f"holds every cell (--primary), or subset the file to the {primary} cells"
                )
                raise DataValidationError(msg)
    except (OSError, KeyError) as e:
        msg = f"cannot read {label}: {e} (is it a complete MuData .h5mu file?)"
        raise DataValidationError(msg) from e
    if require_all and (rows < 0).any():
        i = int(np.flatnonzero(rows < 0)[0])
        msg = (
            f"modality {name}: row {i} of the primary modality {primary} in {label} has no {name} "
            f"({int((rows < 0).sum()):,} cells lack it); without --require-all-modalities they get empty rows"
        )
        raise DataValidationError(msg)
    return None if np.array_equal(rows, np.arange(len(rows))) else rows


def _same_genes(a: pa.Table, b: pa.Table) -> bool:
    """Whether two gene tables name the same genes in the same order."""
    if a.num_rows != b.num_rows:
        return False
    keys = [k for k in ("ensembl_id", "gene_name") if k in a.column_names and k in b.column_names]
    return all(a.column(k).equals(b.column(k)) for k in keys)


def _num_obs(f, mod: str) -> int:
    return len(index_array(f["mod"][mod]["obs"]))


class H5Modality(Source):
    """A further modality from the primary's own file: an ``.h5ad``/``.h5mu`` layer, or another
    ``.h5mu`` modality (``reader``) whose row ``rows[i]`` is the primary's cell ``i`` (None: row ``i``)."""

    def __init__(
        self, name: str, reader: H5adSource, primary: H5adSource, rows: np.ndarray | None, *, layer: bool
    ):
        self.name, self.layer, self._reader, self._primary, self._rows = name, layer, reader, primary, rows
        self.label = f"modality {name} ({reader.label})"
        self.num_cells = primary.num_cells
        if rows is None and reader.num_cells != primary.num_cells:
            msg = f"{reader.label} has {reader.num_cells:,} rows, the primary {primary.label} {primary.num_cells:,}"
            raise DataValidationError(msg)
        if layer and not _same_genes(reader.genes, primary.genes):
            msg = (
                f"layer {name} of {reader.label} is over {reader.genes.num_rows:,} genes other than the "
                f"{primary.genes.num_rows:,} the primary reads (raw/X holds other genes than X and its layers); "
                "a layer shares the primary's genes: drop --raw (the layers are over X's genes), or materialize "
                "the layers as a dataset of their own"
            )
            raise DataValidationError(msg)
        self.genes = reader.genes
        self.features_table = reader.genes
        self.obs_columns = {}
        self.present = self.num_cells if rows is None else int((rows >= 0).sum())
        self.aligned = rows is None
        self.description = {
            **reader.description,
            "modality": name,
            "aligned": self.aligned,
            "present": self.present,
        }

    def plan(self, shard_cells: int) -> list[Partition]:
        return whole_partitions(self.num_cells, shard_cells)

    def row_in_file(self, row: int) -> tuple[str, int]:
        """The primary's: a further modality's cells (and cell ids) are the primary's rows."""
        return self._primary.row_in_file(row)

    def stage(self, folder: str | None, *, progress: bool = False, pool=None) -> list[str]:
        """The reader's (`H5adSource.stage`: a matrix stored by column regrouped by row)."""
        return self._reader.stage(folder, progress=progress, pool=pool)

    def close(self) -> None:
        self._reader.close()

    def batches(
        self, obs: list[str], part: Partition | None = None, *, threads: int | None = None
    ) -> Iterator[Batch]:
        first, end = (0, self.num_cells) if part is None else (part.first_cell, part.end_cell)
        step = DEFAULT_H5_BATCH_CELLS
        for lo in range(first, end, step):
            hi = min(end, lo + step)
            cell_ids = self._primary.read_cell_ids(lo, hi)
            if self._rows is None:
                indptr, tokens, values = self._reader.read_rows(lo, hi)
                rows, present = np.arange(lo, hi), None
            else:
                rows = self._rows[lo:hi]
                present = rows >= 0
                indptr, tokens, values = self._gather(rows)
            yield Batch(
                indptr,
                tokens,
                values,
                cell_ids,
                {},
                _RowLocator(self.name, self._reader.label, rows, cell_ids),
                present,
            )

    def _gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The modality's ``rows`` (-1: an empty row) as one CSR, read in ranges of nearby rows."""
        wanted = np.unique(rows[rows >= 0])
        pieces, starts = [], []
        if len(wanted):
            cuts = np.flatnonzero(np.diff(wanted) > _GAP_ROWS) + 1
            for run in np.split(wanted, cuts):
                lo, hi = int(run[0]), int(run[-1]) + 1
                pieces.append(self._reader.read_rows(lo, hi))
                starts.append(lo)
        offsets = np.cumsum([0] + [len(p[0]) - 1 for p in pieces])  # each range's first row in the joined CSR
        indptr_parts, base = [np.zeros(1, np.int64)], 0
        for ptr, _, _ in pieces:
            indptr_parts.append(ptr[1:].astype(np.int64) + base)
            base += int(ptr[-1])
        indptr = np.concatenate(indptr_parts)
        tokens = np.concatenate([p[1] for p in pieces]) if pieces else np.zeros(0, np.int64)
        values = np.concatenate([p[2] for p in pieces]) if pieces else np.zeros(0, np.float32)
        # one extra empty row at the end stands for every absent cell
        indptr = np.append(indptr, indptr[-1])
        empty = len(indptr) - 2
        position = np.full(len(rows), empty, np.int64)
        held = rows >= 0
        if len(starts):
            run = np.searchsorted(np.asarray(starts), rows[held], side="right") - 1
            position[held] = offsets[run] + rows[held] - np.asarray(starts)[run]
        return take_rows(indptr, tokens, values, position)


class _RowLocator:
    def __init__(self, name: str, label: str, rows: np.ndarray, cell_ids: pa.Array):
        self.name, self.label, self.rows, self.cell_ids = name, label, rows, cell_ids

    def __call__(self, i: int) -> str:
        return f"modality {self.name}: row {int(self.rows[i])} (cell_id {self.cell_ids[i].as_py()}) of {self.label}"
