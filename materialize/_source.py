"""What every input kind hands to the writer: a gene table and a stream of cell batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omicsio_jax import DataValidationError
from omicsio_jax.format import as_input_path, is_remote, to_numpy

from ._plan import Partition

if TYPE_CHECKING:
    from ._validate import GeneIndex

CATEGORICAL = "categorical"
NUMERIC = "numeric"


@dataclasses.dataclass
class Batch:
    """Consecutive cells as raw CSR (gene tokens, not yet validated) plus ids and obs; a further
    modality's batch also says which cells have it (``present``; an absent cell's row is empty).
    ``genes`` maps its tokens to the dataset's columns where the run's gene index does not (a
    collection's source whose genes keep their order in the unified ones, passed on unmoved)."""

    indptr: np.ndarray
    tokens: np.ndarray
    values: np.ndarray
    cell_ids: pa.Array
    obs: dict[str, pa.Array]
    locate: Callable[[int], str]
    present: np.ndarray | None = None
    genes: GeneIndex | None = None

    @property
    def num_cells(self) -> int:
        return len(self.indptr) - 1

    @classmethod
    def from_arrow(
        cls,
        gene_ptr: np.ndarray,
        genes: pa.Array,
        value_ptr: np.ndarray,
        values: pa.Array,
        cell_ids: pa.Array,
        obs: dict[str, pa.Array],
        locate: Callable[[int], str],
        names: tuple[str, str] = ("gene_token_id", "gene_expression"),
    ) -> Batch:
        """Check the parallel lists line up and hold no nulls, then expose them as numpy (``names``:
        the two list columns' names in the input, for messages)."""
        if not np.array_equal(gene_ptr, value_ptr):
            i = int(np.flatnonzero(np.diff(gene_ptr) != np.diff(value_ptr))[0])
            msg = (
                f"unequal list lengths in {locate(i)}: {names[0]} has {gene_ptr[i + 1] - gene_ptr[i]} "
                f"entries, {names[1]} has {value_ptr[i + 1] - value_ptr[i]}"
            )
            raise DataValidationError(msg)
        for name, flat in zip(names, (genes, values), strict=True):
            if flat.null_count:
                j = int(np.flatnonzero(pc.is_null(flat).to_numpy(zero_copy_only=False))[0])
                i = int(np.searchsorted(gene_ptr, j, side="right") - 1)
                msg = f"null element inside the {name} list in {locate(i)}"
                raise DataValidationError(msg)
        return cls(gene_ptr, to_numpy(genes), to_numpy(values), cell_ids, obs, locate)


class Source:
    """An input: ``genes`` (gene table), ``num_cells``, ``obs_columns`` (name → Arrow type) and
    ``obs_notes`` (name → what to say if that column is kept, `choose_obs`), its
    partitions (`plan`) and the cells of one of them (`batches`). A source pickles without its open
    files or connections, to be read by partition workers in other processes."""

    description: dict[str, Any]
    label: str
    genes: pa.Table
    num_cells: int
    obs_columns: dict[str, pa.DataType]
    obs_notes: dict[str, str] = {}  # noqa: RUF012 - read only: a note said only if its obs column is kept
    list_names: tuple[str, str] = (
        "gene_token_id",
        "gene_expression",
    )  # its token and value lists, for messages

    def plan(self, shard_cells: int) -> list[Partition]:
        raise NotImplementedError

    def plan_notes(self, partitions: Sequence[Partition]) -> list[str]:
        """What reading ``partitions`` in parallel costs that the user can avoid (reported, not
        fatal); none by default."""
        return []

    def rows_decoded_before(self, part: Partition) -> int:
        """The rows a read of ``part`` decodes and drops before its first one (none by default)."""
        return 0

    def largest_row_group(self) -> int:
        """The most rows its reads decode at once from a row group's start (0: no such unit)."""
        return 0

    def row_in_file(self, row: int) -> tuple[str, int]:
        """Where the dataset's ``row`` came from, for messages: the file (or the input) and the row
        counted there; by default the input and ``row``."""
        return self.label, row

    def part_of(self, first: int, num_cells: int) -> Partition:
        """Cells ``[first, first + num_cells)`` as a partition `batches` reads (a collection's member
        read from within a shard of the collection)."""
        msg = f"{self.label} cannot be read by cell range; it cannot be a member of a collection"
        raise DataValidationError(msg)

    def batches(
        self, obs: list[str], part: Partition | None = None, *, threads: int | None = None
    ) -> Iterator[Batch]:
        """Cells of ``part`` (all cells for None), in order, in batches; ``threads`` bounds the
        reader's own threads (DuckDB's)."""
        raise NotImplementedError

    def stage(self, folder: str | None, *, progress: bool = False, pool=None) -> list[str]:
        """Prepare, once, what its partitions' reads need in ``folder`` (local, and seen by every
        process that reads a partition; None where there is none), before any is read, on the
        ``pool``'s workers where it has some (`materialize._pool.Pool`); returns notes for the user.
        Nothing by default."""
        return []

    def close(self) -> None:
        """Release open files (a pickled copy in a worker opens its own)."""

    def rest(self) -> None:
        """Release what a read left open, between the reads of a run (a collection's source, once the
        cells a partition wants of it are read): `close` unless a source keeps something cheap for
        the next read to go on from."""
        self.close()


_DECODED_AGAIN_NOTE = 0.25  # rows decoded again, as a share of the input's, worth a note


def require_file(path) -> None:
    """A one-line error for an input file or zarr store (local or ``s3://``) that is not there, rather
    than what a reader makes of opening it (h5py's errno text and a guess that the file is damaged)."""
    if not is_remote(str(path)):
        if not Path(path).exists():
            raise DataValidationError(f"cannot read {path}: no such file or directory")
    elif not as_input_path(str(path)).exists():  # a missing bucket or no access: the storage layer's error
        raise DataValidationError(f"cannot read {path}: no such object")


def missing_columns(
    label: str, missing: Sequence[str], names: Sequence[str], cell_id_column: str, tahoe: str = ""
) -> DataValidationError:
    """The error of a table input (``label``, its columns ``names``) that lacks the required columns
    ``missing``; ``--cell-id`` is named only where the cell id column is among them (``tahoe``: what
    to add to that hint)."""
    hint = f" (use --cell-id to name another cell id column{tahoe})" if cell_id_column in missing else ""
    return DataValidationError(
        f"{label} is missing required column(s) {', '.join(missing)}; it has {', '.join(names)}{hint}"
    )


def decoded_again_note(label: str, partitions: Sequence[Partition], again: int, largest: int) -> str | None:
    """The note for partitions whose reads decode ``again`` rows before their first ones (row groups
    of up to ``largest`` rows, decoded from their first row), when row groups span partitions and
    that reaches a quarter of their cells: parallel workers decode the same rows again, and more of
    them add little. The partitions a process writes one after another go on from where the last one
    stopped, so the figure is an upper bound."""
    total, shard = sum(p.num_cells for p in partitions), partitions[0].num_cells
    if len(partitions) < 2 or largest <= shard or again < _DECODED_AGAIN_NOTE * total:
        return None  # row groups no larger than a partition: nothing the note's advice would change
    return (
        f"{label} holds up to {largest:,} rows in a row group, several partitions of {shard:,} cells; a "
        f"read that starts inside a row group decodes it from its first row, so the workers decode up "
        f"to {1 + again / total:.1f}× its rows and more workers add little. For a parallel conversion, "
        f"write the files with row groups of at most {shard:,} rows "
        f"(pyarrow.parquet.write_table(table, path, row_group_size={shard}))"
    )


def obs_kind(dtype: pa.DataType) -> str | None:
    """``"categorical"`` for strings/dictionaries/bools, ``"numeric"`` for numbers, None otherwise."""
    if pa.types.is_dictionary(dtype) or pa.types.is_boolean(dtype):
        return CATEGORICAL
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or pa.types.is_string_view(dtype):
        return CATEGORICAL
    if pa.types.is_integer(dtype) or pa.types.is_floating(dtype):
        return NUMERIC
    return None


def gene_table_from_arrow(table: pa.Table, label: str) -> pa.Table:
    """Check a gene table and sort it by gene_token_id (column order of the dataset)."""
    if "gene_token_id" not in table.column_names:
        msg = f"gene table {label} has no gene_token_id column (it has {', '.join(table.column_names)})"
        raise DataValidationError(msg)
    tokens = table.column("gene_token_id")
    if not pa.types.is_integer(tokens.type):
        msg = f"gene_token_id of gene table {label} must be integers, got {tokens.type}"
        raise DataValidationError(msg)
    if tokens.null_count:
        msg = f"gene table {label} has null gene_token_id values"
        raise DataValidationError(msg)
    order = to_numpy(tokens)
    if len(order) > 1 and not (order[1:] >= order[:-1]).all():  # a table in token order is kept as it is
        table = table.sort_by("gene_token_id")
    index = table.column_names.index("gene_token_id")
    return table.set_column(index, "gene_token_id", pc.cast(table.column("gene_token_id"), pa.int64()))
