"""Further modalities of the primary's cells — splice layers, ATAC peaks, proteins — aligned by cell.

A multimodal dataset is the primary modality's dataset plus one complete dataset per further
modality under ``modalities/<name>/``, whose row ``i`` is the primary's cell ``i`` (see
`omicsio_jax.format.manifest`): a loader that asks for one modality reads no byte of the others, and
each modality keeps the codec, chunk indexes, statistics and checks of a dataset of its own.
The primary is written first; each further modality is then a `Source` whose batches come in the
primary's row order, with ``present`` marking the cells that have it (an absent cell gets an
empty row; ``require_all`` makes absence an error). Its inputs:

- **list-column tables**, one per modality, joined on ``cell_id`` with the primary's cells (read
  back from the primary's written partitions, so any primary input works). A table whose rows
  are already the primary's cells in order (the usual case: tables written together) is read as
  it is, in partitions, in parallel. Any other is first spilled by partition in one streaming
  pass (`_reorder`: DuckDB joins only the cell ids; the lists go to a memory-mapped Arrow file
  per partition), and each partition's writer takes its rows in order from its file. Splice layers (``layers=``) use the primary's gene table; other modalities have
  their own feature table (given, or ``<name>_features.parquet`` / ``peaks.parquet`` /
  ``features.parquet`` beside the table), keyed by the table's token column (``peak_token_id``).
- **.h5ad layers** (``layers=["spliced", ...]``): ``layers/<name>`` of the file, aligned by construction.
- **.h5mu** (MuData): ``mod/<name>`` of the file, aligned with the primary modality through
  MuData's ``obsmap`` (or, in a file without one, by obs names).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import duckdb
import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omicsio_jax import DataValidationError, OmicsIOError
from omicsio_jax.format import (
    CELL_ID_COLUMN,
    FILE_ROW_COLUMN,
    FILENAME_COLUMN,
    GENE_COLUMN,
    VALUE_COLUMN,
    as_input_path,
    connect,
    create_cells_view,
    expand_files,
    is_list_type,
    is_remote,
    list_to_csr,
    sql_ident,
    sql_str,
    take_rows,
)

from ._h5ad import DEFAULT_BATCH_CELLS as DEFAULT_H5_BATCH_CELLS
from ._h5ad import H5adSource
from ._plan import Partition, whole_partitions
from ._reorder import Spill, spill_by_partition
from ._source import Batch, Source, gene_table_from_arrow, require_file
from ._tables import DEFAULT_BATCH_CELLS, TableSource

LAYER, OWN = "primary", "own"  # a modality's columns: the primary's genes, or its own features
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
_FEATURE_TABLES = ("{name}_features.parquet", "peaks.parquet", "features.parquet")
_GAP_ROWS = 64  # .h5mu rows closer than this are read in one range


@dataclasses.dataclass(frozen=True)
class ModalityInput:
    """One further modality: its ``name``, and its ``table`` (list-column table path/glob) or None
    for one in the primary's own file (an ``.h5ad``/``.h5mu`` layer, an ``.h5mu`` modality);
    ``features``: the table's feature table (None: found beside it); ``layer``: shares the
    primary's genes."""

    name: str
    table: str | None = None
    features: str | None = None
    layer: bool = False

    @property
    def features_kind(self) -> str:
        return LAYER if self.layer else OWN


def modality_inputs(
    source,
    *,
    layers: Sequence[str] | Mapping[str, str] | None,
    modalities: Sequence[str] | Mapping[str, str | tuple[str, str]] | None,
    primary: str,
) -> list[ModalityInput]:
    """The further modalities asked for, checked against the input's kind.

    ``.h5ad``: ``layers`` names layers of the file. ``.h5mu``: ``layers`` names layers of the
    primary modality, ``modalities`` names the file's other modalities (default: all of them).
    Tables: ``layers`` and ``modalities`` map names to tables (a modality's value may be a
    ``(table, feature table)`` pair).
    """
    kind = input_kind(source)
    out: list[ModalityInput] = []
    if layers:
        if kind == "table":
            if not isinstance(layers, Mapping):
                msg = "for list-column tables, layers maps each layer's name to its table, e.g. spliced=rna_layers_spliced/"
                raise OmicsIOError(msg)
            out += [ModalityInput(name, str(table), layer=True) for name, table in layers.items()]
        else:
            if isinstance(layers, Mapping):
                msg = f"layers of a {kind} input are named, not given as tables: layers=['spliced', ...]"
                raise OmicsIOError(msg)
            out += [ModalityInput(name, layer=True) for name in layers]
    if kind == "h5mu":
        if isinstance(modalities, Mapping):
            msg = "the modalities of an .h5mu input are named, not given as tables: modalities=['atac', ...]"
            raise OmicsIOError(msg)
        held = h5mu_modalities(source)
        names = held if modalities is None else [str(n) for n in modalities]
        missing = [n for n in names if n not in held]
        if missing:
            msg = f"{source} has no modality {missing[0]!r} (it has {', '.join(held)}); name one of these"
            raise OmicsIOError(msg)
        out += [ModalityInput(name) for name in names if name != primary]
    elif modalities:
        if kind == "h5ad":
            msg = "an .h5ad holds one modality (and its layers); give further modalities as tables or use an .h5mu"
            raise OmicsIOError(msg)
        if not isinstance(modalities, Mapping):
            msg = "for list-column tables, modalities maps each name to its table, e.g. atac=atac_cells/"
            raise OmicsIOError(msg)
        for name, value in modalities.items():
            table, features = (value, None) if isinstance(value, str | Path) else value
            out.append(ModalityInput(name, str(table), None if features is None else str(features)))
    seen = {primary}
    for inp in out:
        if inp.table is not None and inp.table.startswith("ducklake:"):
            name = inp.table.partition("#")[2] or "TABLE"
            msg = (
                f"modality {inp.name}: a DuckLake table ({inp.table}) is read as the primary input only; "
                f"export it to parquet (DuckDB with the ducklake extension: COPY lake.{name} TO "
                f"'{name}.parquet') and give that file"
            )
            raise OmicsIOError(msg)
        if not _NAME.match(inp.name):
            msg = f"modality name {inp.name!r}: use letters, digits, '_', '.' or '-', starting with a letter"
            raise OmicsIOError(msg)
        if inp.name in seen:
            msg = f"modality {inp.name!r} is given twice (or is the primary's name, {primary!r})"
            raise OmicsIOError(msg)
        seen.add(inp.name)
    return out


def input_kind(source) -> str:
    text = "" if source is None else str(source)
    if text.endswith(".h5ad") or text.rstrip("/").endswith(".zarr"):  # AnnData, in HDF5 or in zarr
        return "h5ad"
    return "h5mu" if text.endswith(".h5mu") else "table"


# -- list-column tables -------------------------------------------------------------------------------


def _list_columns(schema: pa.Schema, label: str) -> tuple[str, str]:
    """The token and value list columns of a modality table: ``gene_token_id`` / ``gene_expression``,
    else the one ``*_token_id`` list column and the one other list column (``peak_accessibility``)."""
    if GENE_COLUMN in schema.names:
        return GENE_COLUMN, VALUE_COLUMN
    lists = [f.name for f in schema if is_list_type(f.type)]
    tokens = [n for n in lists if n.endswith("_token_id")]
    values = [n for n in lists if n not in tokens]
    if len(tokens) != 1 or len(values) != 1:
        msg = (
            f"{label}: a modality table needs one <feature>_token_id list column and one value list column "
            f"(gene_token_id / gene_expression, peak_token_id / peak_accessibility); it has list columns "
            f"{', '.join(lists) or '(none)'}"
        )
        raise DataValidationError(msg)
    return tokens[0], values[0]


def _find_features(inp: ModalityInput, files: list[Path], token_column: str) -> str | None:
    """The feature table given, else one named like `_FEATURE_TABLES` beside the table's files or
    in their parent folder (not one of the input files). A ``peaks.parquet`` / ``features.parquet``
    without the table's ``token_column`` is another modality's (ATAC's peaks beside a protein table)."""
    if inp.features is not None:
        return inp.features
    folders = dict.fromkeys(folder for f in files for folder in (f.parent, f.parent.parent))
    for folder in folders:
        for pattern in _FEATURE_TABLES:
            candidate = folder / pattern.format(name=inp.name)
            if candidate in files or not candidate.exists():
                continue
            if pattern == _FEATURE_TABLES[0] or token_column in _column_names(candidate):
                return str(candidate)
    return None


def _column_names(path: Path) -> list[str]:
    """The columns of a parquet file; all of them unknown (``[]``) for one that cannot be read."""
    try:
        return pq.read_schema(path).names
    except (OSError, pa.ArrowException):
        return []


def _read_features(path: str, token_column: str) -> pa.Table:
    """A feature table keyed by ``token_column`` (``peak_token_id``), as a gene table (``gene_token_id``)."""
    try:
        table = connect(remote=is_remote(path)).sql(f"SELECT * FROM {sql_str(path)}").to_arrow_table()
    except duckdb.Error as e:
        msg = f"cannot read feature table {path}: {str(e).splitlines()[0]}"
        raise DataValidationError(msg) from e
    if token_column != GENE_COLUMN and token_column in table.column_names:
        table = table.rename_columns([GENE_COLUMN if n == token_column else n for n in table.column_names])
    elif token_column != GENE_COLUMN:
        msg = f"feature table {path} has no {token_column} column (it has {', '.join(table.column_names)})"
        raise DataValidationError(msg)
    return gene_table_from_arrow(table, path)


class TableModality(Source):
    """A further modality from a list-column table, in the primary's row order (see the module doc)."""

    def __init__(
        self,
        inp: ModalityInput,
        *,
        primary: str,
        primary_label: str,
        primary_cells: list[str],
        primary_genes: pa.Table,
        num_cells: int,
        shard_cells: int,
        spill: Path,
        require_all: bool,
        check_primary: bool = True,
        batch_cells: int = DEFAULT_BATCH_CELLS,
        subset: bool = False,
    ):
        """``primary_cells``: the primary's written partition sidecars, in order (their ``cell_id``);
        ``spill``: a local folder for the table's rows by partition, when they are not in the
        primary's order (see `_reorder`); ``subset``: the primary is a selection
        (``--where``/``--query``), so cells of the table outside it are left out, not refused."""
        self.name, self.layer = inp.name, inp.layer
        self.label = f"modality {inp.name} ({inp.table})"
        self._primary, self._primary_label = primary, primary_label
        self.num_cells = num_cells
        self.obs_columns = {}
        files = expand_files(inp.table)
        remote = any(not isinstance(f, Path) for f in files) or any(
            p.startswith("s3://") for p in primary_cells
        )
        con = connect(remote=remote)
        create_cells_view(con, files, label=inp.table, filename=True, file_rows=True, name="modality")
        schema = con.sql("SELECT * FROM modality LIMIT 0").to_arrow_table().schema
        if CELL_ID_COLUMN not in schema.names:
            msg = f"{self.label} has no {CELL_ID_COLUMN} column to align its cells by; it has {', '.join(schema.names)}"
            raise DataValidationError(msg)
        self.list_names = _list_columns(schema, self.label)
        features = _find_features(inp, files, self.list_names[0])
        if inp.layer:
            genes: pa.Table | None = primary_genes
            if inp.features is not None:
                _check_same_genes(
                    inp, _read_features(inp.features, self.list_names[0]), primary_genes, primary
                )
        else:
            genes = None if features is None else _read_features(features, self.list_names[0])
        self._require_all, self._subset = require_all, subset
        names = ", ".join(sql_str(p) for p in primary_cells)
        con.execute(
            f"CREATE VIEW primary_cells AS SELECT {CELL_ID_COLUMN}, row_number() OVER () - 1 AS __row "
            f"FROM read_parquet([{names}])"
        )
        self.present, self.aligned = self._align(con, inp, check_primary)
        self._reader = TableSource(
            inp.table, genes=genes, find_genes=False, batch_cells=batch_cells, lists=self.list_names
        )
        self._batch_cells, self._shard_cells = batch_cells, shard_cells
        self._spill: Spill | None = None
        self._parts: list[Partition] = []
        self._primary_cells: dict[int, str] = {}
        if not self.aligned:
            # the primary's partitions: one per shard, or one over every shard (a --query primary)
            first = 0
            for path in primary_cells:
                n = _num_rows(path)
                self._parts.append(Partition(first // shard_cells, first, n))
                self._primary_cells[first // shard_cells] = path
                first += n
            spill.mkdir(parents=True, exist_ok=True)
            spill_by_partition(
                con,
                self.list_names,
                num_rows=self._reader.num_cells,
                shard_cells=shard_cells,
                folder=spill,
                label=self.label,
                firsts=np.array([p.first_cell for p in self._parts], np.int64),
            )
            self._spill = Spill(spill)
        self.genes = self._reader.genes
        self.features_table = self._features_table(features)
        self.description = {
            "kind": "table",
            "modality": inp.name,
            "input": inp.table,
            "features": features,
            "files": [str(f) for f in files],
            "aligned": self.aligned,
            "present": int(self.present),
        }

    def _align(
        self, con: duckdb.DuckDBPyConnection, inp: ModalityInput, check_primary: bool
    ) -> tuple[int, bool]:
        """Check the cells can be aligned; return how many cells have the modality and whether the
        table's rows are already the primary's cells in order."""
        cid, where = sql_ident(CELL_ID_COLUMN), f"{FILENAME_COLUMN}, {FILE_ROW_COLUMN}"
        try:
            if check_primary:
                dup = con.sql(
                    f"SELECT {cid}, min(__row), max(__row) FROM primary_cells GROUP BY {cid} "
                    "HAVING count(*) > 1 ORDER BY 2 LIMIT 1"
                ).fetchall()
                if dup:
                    cell, a, b = dup[0]
                    msg = (
                        f"duplicate cell_id {cell} in the primary modality {self._primary} (rows {a} and {b} of "
                        f"{self._primary_label}): modalities are aligned by cell_id, which must be unique"
                    )
                    raise DataValidationError(msg)
            dup = con.sql(f"SELECT {cid} FROM modality GROUP BY {cid} HAVING count(*) > 1 LIMIT 1").fetchall()
            if dup:
                rows = con.execute(
                    f"SELECT {where} FROM modality WHERE {cid} = ? ORDER BY {where} LIMIT 2", [dup[0][0]]
                ).fetchall()
                msg = (
                    f"modality {inp.name}: duplicate cell_id {dup[0][0]} in row {rows[1][1]} of {rows[1][0]} "
                    f"(also row {rows[0][1]} of {rows[0][0]})"
                )
                raise DataValidationError(msg)
            null = con.sql(
                f"SELECT {where} FROM modality WHERE {cid} IS NULL ORDER BY {where} LIMIT 1"
            ).fetchall()
            if null:
                msg = f"modality {inp.name}: null cell_id in row {null[0][1]} of {null[0][0]}"
                raise DataValidationError(msg)
            stray = (
                []
                if self._subset
                else con.sql(
                    f"SELECT {cid}, {where} FROM modality ANTI JOIN primary_cells USING ({cid}) "
                    f"ORDER BY {where} LIMIT 1"
                ).fetchall()
            )
            if stray:
                cell, file, row = stray[0]
                msg = (
                    f"modality {inp.name}: cell_id {cell} in row {row} of {file} is not a cell of the primary "
                    f"modality {self._primary} ({self._primary_label}); a further modality's cells must be the "
                    "primary's"
                )
                raise DataValidationError(msg)
            present = con.sql(
                f"SELECT count(*) FROM modality SEMI JOIN primary_cells USING ({cid})"
            ).fetchall()[0][0]
            total = con.sql("SELECT count(*) FROM modality").fetchall()[0][0]
            if present < self.num_cells and self._require_all:
                cell, row = con.sql(
                    f"SELECT {cid}, __row FROM primary_cells ANTI JOIN modality USING ({cid}) "
                    "ORDER BY __row LIMIT 1"
                ).fetchall()[0]
                msg = (
                    f"modality {inp.name}: cell_id {cell} (row {row} of the primary {self._primary_label}) has no "
                    f"row in {inp.table} ({self.num_cells - present:,} cells lack it); without "
                    "--require-all-modalities they get empty rows and has_" + inp.name + " = False"
                )
                raise DataValidationError(msg)
            if present < self.num_cells or total > present:
                return present, False
            differ = con.sql(
                f"SELECT 1 FROM (SELECT {cid} AS a FROM primary_cells) POSITIONAL JOIN "
                f"(SELECT {cid} AS b FROM modality) WHERE a IS DISTINCT FROM b LIMIT 1"
            ).fetchall()
        except duckdb.Error as e:
            msg = f"cannot read {self.label}: {str(e).strip().splitlines()[0]}"
            raise DataValidationError(msg) from e
        return present, not differ

    def _features_table(self, features: str | None) -> pa.Table:
        """The feature table written with the modality: the primary's genes, the one given (its own
        column names), or the tokens seen."""
        if self.layer or features is None:
            return self.genes
        return self._reader.genes.rename_columns(
            [self.list_names[0] if n == GENE_COLUMN else n for n in self._reader.genes.column_names]
        )

    def publish(self, url: str) -> None:
        """Make the spilled partitions readable by workers on other machines (under ``url``)."""
        if self._spill is not None:
            self._spill.publish(url)

    def plan(self, shard_cells: int) -> list[Partition]:
        return self._reader.plan(shard_cells) if self.aligned else list(self._parts)

    def batches(
        self, obs: list[str], part: Partition | None = None, *, threads: int | None = None
    ) -> Iterator[Batch]:
        if self.aligned:
            for batch in self._reader.batches([], part, threads=threads):
                yield dataclasses.replace(batch, locate=_prefixed(self.name, batch.locate))
            return
        for p in [part] if part is not None else self.plan(self._shard_cells):
            yield from self._spilled_batches(p)

    def _spilled_batches(self, part: Partition) -> Iterator[Batch]:
        """Partition ``part`` from its spill file: its cells in the primary's order, absent ones empty."""
        ids = _read_cell_ids(self._primary_cells[part.index])
        tokens_column, values_column = self.list_names
        for table, rows, order in self._spill.partition(part.index):
            for lo in range(part.first_cell, part.end_cell, self._batch_cells):
                hi = min(part.end_cell, lo + self._batch_cells)
                i, j = np.searchsorted(rows, [lo, hi])
                positions = rows[i:j] - lo
                present = np.zeros(hi - lo, bool)
                present[positions] = True
                cell_ids = ids.slice(lo - part.first_cell, hi - lo)
                if j == i:
                    empty = np.zeros(hi - lo + 1, np.int64)
                    yield Batch(
                        empty,
                        np.zeros(0, np.int32),
                        np.zeros(0, np.float32),
                        cell_ids,
                        {},
                        lambda k, ids=cell_ids: f"modality {self.name}: cell_id {ids[k].as_py()}",
                        present,
                    )
                    continue
                sub = table.take(pa.array(order[i:j]))
                token_ptr, tokens = list_to_csr(sub.column(tokens_column).combine_chunks())
                value_ptr, values = list_to_csr(sub.column(values_column).combine_chunks())
                locate = _SourceLocator(
                    self.name, cell_ids, positions, sub.column(FILENAME_COLUMN), sub.column(FILE_ROW_COLUMN)
                )
                batch = Batch.from_arrow(
                    _spread(token_ptr, positions, hi - lo),
                    tokens,
                    _spread(value_ptr, positions, hi - lo),
                    values,
                    cell_ids,
                    {},
                    locate,
                )
                yield dataclasses.replace(batch, present=present)


def _spread(indptr: np.ndarray, positions: np.ndarray, num_rows: int) -> np.ndarray:
    """The CSR pointers of ``num_rows`` rows whose rows ``positions`` (ascending) are those of
    ``indptr``, the others empty."""
    counts = np.zeros(num_rows, np.int64)
    counts[positions] = np.diff(indptr)
    out = np.zeros(num_rows + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _num_rows(path: str) -> int:
    source = as_input_path(path).open("rb") if is_remote(path) else path
    return pq.read_metadata(source).num_rows


def _read_cell_ids(path: str) -> pa.Array:
    source = as_input_path(path).open("rb") if is_remote(path) else path
    return pq.read_table(source, columns=[CELL_ID_COLUMN]).column(0).combine_chunks()


def _check_same_genes(inp: ModalityInput, features: pa.Table, primary_genes: pa.Table, primary: str) -> None:
    tokens = features.column(GENE_COLUMN).to_numpy()
    ours = primary_genes.column(GENE_COLUMN).to_numpy()
    if not np.array_equal(np.sort(tokens), np.sort(ours)):
        extra = np.setdiff1d(tokens, ours)
        detail = (
            f"gene_token_id {int(extra[0])} is not among the primary's genes"
            if len(extra)
            else f"it has {len(tokens):,} genes, the primary {len(ours):,}"
        )
        msg = (
            f"layer {inp.name}: its gene table {inp.features} differs from the gene space of the primary modality "
            f"{primary} ({detail}); a layer shares the primary's genes"
        )
        raise DataValidationError(msg)


def _prefixed(name: str, locate):
    return lambda i: f"modality {name}: {locate(i)}"


class _SourceLocator:
    """Names a batch row (at ``positions[k]``: the k-th spilled row) by the file and row it came from."""

    def __init__(self, name: str, cell_ids: pa.Array, positions: np.ndarray, files, rows):
        self.name, self.cell_ids, self.positions, self.files, self.rows = (
            name,
            cell_ids,
            positions,
            files,
            rows,
        )

    def __call__(self, i: int) -> str:
        k = int(np.searchsorted(self.positions, i))
        return (
            f"modality {self.name}: row {self.rows[k].as_py()} (cell_id {self.cell_ids[i].as_py()}) "
            f"of {self.files[k].as_py()}"
        )


# -- .h5ad layers and .h5mu modalities -------------------------------------------------------------------


def h5mu_modalities(path) -> list[str]:
    """The modality names of an ``.h5mu`` file (``mod/<name>``), in the file's ``mod-order``."""
    require_file(path)
    try:
        with h5py.File(str(path), "r") as f:
            mod = f["mod"]
            order = [n.decode() if isinstance(n, bytes) else str(n) for n in mod.attrs.get("mod-order", [])]
            return [n for n in order if n in mod] + sorted(n for n in mod if n not in order)
    except (OSError, KeyError) as e:
        msg = f"cannot read {path}: {e} (is it a complete MuData .h5mu file?)"
        raise DataValidationError(msg) from e


def _strings(node) -> np.ndarray:
    return np.asarray(node.asstr()[:], dtype=object)


def h5mu_alignment(path, primary: str, name: str, *, require_all: bool) -> np.ndarray | None:
    """For each cell of the primary modality, its row in modality ``name`` (-1: absent); None when
    the rows are the same cells in the same order. From MuData's ``obsmap`` (1-based rows, 0 for
    absent), else by obs names."""
    label = f"{path}"
    try:
        with h5py.File(str(path), "r") as f:
            if "obsmap" in f and primary in f["obsmap"] and name in f["obsmap"]:
                p_map = f["obsmap"][primary][:].astype(np.int64) - 1
                m_map = f["obsmap"][name][:].astype(np.int64) - 1
                n_p = _num_obs(f, primary)
                n_m = _num_obs(f, name)
                if len(p_map) != len(m_map) or p_map.max(initial=-1) >= n_p or m_map.max(initial=-1) >= n_m:
                    msg = f"{label}: obsmap/{primary} and obsmap/{name} cannot be aligned (lengths or rows out of range)"
                    raise DataValidationError(msg)
                stray = np.flatnonzero((p_map < 0) & (m_map >= 0))
                ids = _strings(f["obs"][_index_name(f["obs"])]) if len(stray) else None
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
                p_ids = _strings(f["mod"][primary]["obs"][_index_name(f["mod"][primary]["obs"])])
                m_ids = _strings(f["mod"][name]["obs"][_index_name(f["mod"][name]["obs"])])
                for mod, ids_ in ((primary, p_ids), (name, m_ids)):
                    uniq, counts = np.unique(ids_, return_counts=True)
                    if (counts > 1).any():
                        dup = uniq[counts > 1][0]
                        msg = (
                            f"{label}: modality {mod} has duplicate obs name {dup} (rows "
                            f"{', '.join(map(str, np.flatnonzero(ids_ == dup)[:2]))}) and the file has no obsmap: "
                            "its modalities cannot be aligned"
                        )
                        raise DataValidationError(msg)
                lookup = {cell: i for i, cell in enumerate(m_ids)}
                rows = np.array([lookup.get(cell, -1) for cell in p_ids], np.int64)
                seen = set(p_ids)
                stray_ids = [i for i, cell in enumerate(m_ids) if cell not in seen]
                stray = np.array(stray_ids[:1], np.int64)
                ids = m_ids
            if len(stray):
                cell = ids[stray[0]]
                msg = (
                    f"modality {name}: cell_id {cell} of {label} has no {primary} (the primary modality); a further "
                    "modality's cells must be the primary's"
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


def _index_name(obs) -> str:
    name = obs.attrs["_index"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _num_obs(f, mod: str) -> int:
    obs = f["mod"][mod]["obs"]
    return len(obs[_index_name(obs)])


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
