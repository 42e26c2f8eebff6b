"""Validate a batch of cells against the list-column schema while encoding it.

The codec's planning pass (numba, parallel) checks every invariant, converts INT64/FLOAT64
input (with range checks) and maps gene_token_id to the columns of the gene table. The first
broken row becomes a one-line `DataValidationError` naming the file, the row, the cell_id and
the invariant. `UniqueStrings` checks the cell ids are unique as they are written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path

import numba as nb
import numpy as np
import pyarrow as pa

from omicsio_jax import DataValidationError
from omicsio_jax.format import (
    ROW_DUPLICATE,
    ROW_NEGATIVE,
    ROW_NOT_FINITE,
    ROW_UNKNOWN_GENE,
    ROW_UNSORTED,
    InvalidRowError,
    encode_csr,
    encode_dense_rows,
    mix64,
    plan_sparse,
)

from ._panel import Panel


@dataclasses.dataclass(frozen=True)
class GeneIndex:
    """Maps gene_token_id → column; ``token_to_col[t] == -1`` for tokens not in the gene table."""

    token_to_col: np.ndarray
    num_genes: int
    description: str
    names: tuple[str, str] = ("gene_token_id", "gene_expression")  # the input's list columns, for messages

    @classmethod
    def from_tokens(
        cls,
        tokens: np.ndarray,
        description: str,
        names: tuple[str, str] = ("gene_token_id", "gene_expression"),
    ) -> GeneIndex:
        """Columns follow ascending token order, so sorted token lists stay sorted."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= 2**31):
            msg = f"gene_token_id values in {description} must lie in 0..2^31-1 (found {tokens.min()}..{tokens.max()})"
            raise DataValidationError(msg)
        unique, counts = np.unique(tokens, return_counts=True)
        if len(unique) != len(tokens):
            repeated = np.flatnonzero(counts > 1)
            first = repeated[0]
            more = f" (and {len(repeated) - 1:,} more ids)" if len(repeated) > 1 else ""
            msg = (
                f"gene_token_id is not unique in {description}: {int(unique[first])} is listed "
                f"{int(counts[first])} times{more}; give each gene one id"
            )
            raise DataValidationError(msg)
        token_to_col = np.full(int(tokens.max()) + 1 if len(tokens) else 0, -1, dtype=np.int32)
        token_to_col[np.sort(tokens)] = np.arange(len(tokens), dtype=np.int32)
        return cls(token_to_col, len(tokens), description, names)


def encode_batch(
    indptr: np.ndarray,
    tokens: np.ndarray,
    values: np.ndarray,
    genes: GeneIndex,
    *,
    allow_negative: bool,
    locate: Callable[[int], str],
    panel: Panel | None = None,
    out: Callable[[int], np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate a raw CSR batch and encode it; return ``(buffer, starts, nnz)``.

    ``locate(i)`` describes batch row ``i`` (file, row, cell_id) for the error message. With a
    ``panel`` the rows are scattered to the panel's columns and stored dense. ``out(nbytes)`` gives
    the buffer to encode into (`encode_csr`'s ``out``).
    """
    if not np.issubdtype(tokens.dtype, np.integer):
        msg = f"{genes.names[0]} must be a list of integers, got element type {tokens.dtype} in {locate(0)}"
        raise DataValidationError(msg)
    if np.issubdtype(values.dtype, np.integer) or values.dtype == np.float16:
        values = values.astype(np.float64)
    elif not np.issubdtype(values.dtype, np.floating):
        # strings by their kind, not numpy's name for them (object)
        kind = "text" if values.dtype.kind in "OUS" else str(values.dtype)
        msg = f"{genes.names[1]} must be a list of numbers, got elements of type {kind} in {locate(0)}"
        raise DataValidationError(msg)
    if panel is None:
        try:
            buf, starts = encode_csr(
                indptr,
                tokens,
                values,
                token_to_col=genes.token_to_col,
                allow_negative=allow_negative,
                out=out,
            )
        except InvalidRowError as e:
            raise DataValidationError(_describe(e, tokens, values, genes, locate)) from None
        return buf, starts, len(tokens)
    *_, problems, where = plan_sparse(indptr, tokens, values, genes.token_to_col, allow_negative)
    bad = np.flatnonzero(problems)
    if len(bad):
        e = InvalidRowError(int(bad[0]), int(where[bad[0]]), int(problems[bad[0]]))
        raise DataValidationError(_describe(e, tokens, values, genes, locate))
    dense = panel.scatter(indptr, tokens, values, genes.token_to_col)
    buf, starts = encode_dense_rows(dense, out=out)
    return buf, starts, int(np.count_nonzero(dense))


def _describe(e: InvalidRowError, tokens, values, genes: GeneIndex, locate) -> str:
    j, code = e.position, e.problem
    token_name, value_name = genes.names
    token, value = int(tokens[j]), float(values[j])
    where = locate(e.row)
    if code == ROW_UNSORTED:
        return f"{token_name} not sorted in {where}: {token} after {int(tokens[j - 1])}"
    if code == ROW_DUPLICATE:
        return f"duplicate {token_name} in {where}: {token} appears twice"
    if code == ROW_UNKNOWN_GENE:
        table = "--genes" if token_name == "gene_token_id" else "--modality-features"
        return (
            f"{token_name} {token} in {where} is not in the gene table ({genes.description}): check that "
            f"the table is the one its ids come from ({table})"
        )
    if code == ROW_NOT_FINITE:
        return f"{value_name} is {value} (not finite) in {where} at {token_name} {token}"
    if code == ROW_NEGATIVE:
        return (
            f"negative {value_name} {value} in {where} at {token_name} {token} "
            "(pass --allow-negative / allow_negative=True for data such as scaled values)"
        )
    return f"{value_name} {value} in {where} at {token_name} {token} overflows float32"


_FNV_OFFSET, _FNV_PRIME = np.uint64(0xCBF29CE484222325), np.uint64(0x100000001B3)


@nb.njit(nogil=True, cache=True)
def _hash_strings(offsets, data, out):
    """64-bit FNV-1a of each string ``data[offsets[i]:offsets[i + 1]]``, mixed by splitmix64's
    finalizer (so that the top bits, which pick a hash's bucket, are spread too)."""
    for i in range(out.shape[0]):
        h = _FNV_OFFSET
        for j in range(offsets[i], offsets[i + 1]):
            h = (h ^ np.uint64(data[j])) * _FNV_PRIME
        out[i] = mix64(h)


def hash_strings(strings: pa.Array) -> np.ndarray:
    """A uint64 hash of each string of ``strings`` (null: the empty string's)."""
    if not (pa.types.is_string(strings.type) or pa.types.is_large_string(strings.type)):
        strings = strings.cast(pa.large_string())
    _, offsets, data = strings.buffers()
    width = np.int64 if pa.types.is_large_string(strings.type) else np.int32
    offsets = np.frombuffer(offsets, width)[strings.offset : strings.offset + len(strings) + 1]
    data = np.zeros(0, np.uint8) if data is None else np.frombuffer(data, np.uint8)
    out = np.empty(len(strings), np.uint64)
    if len(strings):
        _hash_strings(offsets, data, out)
    return out


class UniqueStrings:
    """Whether strings added batch by batch (the cell ids, in row order) are all distinct, in memory
    bounded by a batch: their hashes go to 64 files in ``scratch`` by their top bits, each sorted on
    its own at the end (1/64 of 8 bytes a string); only equal hashes are checked again, by their
    strings (`first_repeat`)."""

    _BUCKET_BITS = 6

    def __init__(self, scratch: Path):
        self.scratch = scratch
        self._files: dict[int, object] = {}
        self._edges = (np.arange(1 << self._BUCKET_BITS, dtype=np.uint64) + np.uint64(1)) << np.uint64(
            64 - self._BUCKET_BITS
        )

    def add(self, strings: pa.Array) -> None:
        hashes = np.sort(hash_strings(strings))
        ends = np.searchsorted(hashes, self._edges[:-1], side="left").tolist() + [len(hashes)]
        start = 0
        for bucket, end in enumerate(ends):
            if end > start:
                self._file(bucket).write(hashes[start:end].tobytes())
            start = end

    def _file(self, bucket: int):
        f = self._files.get(bucket)
        if f is None:
            self.scratch.mkdir(parents=True, exist_ok=True)
            f = self._files[bucket] = open(self.scratch / f"{bucket:02d}.u64", "wb")  # noqa: SIM115 - closed in close()
        return f

    def close(self) -> None:
        """Release the files (idempotent)."""
        for f in self._files.values():
            f.close()

    def repeated_hashes(self) -> np.ndarray:
        """The hashes added more than once (sorted)."""
        self.close()
        repeated = []
        for bucket in sorted(self._files):
            hashes = np.sort(np.fromfile(self.scratch / f"{bucket:02d}.u64", np.uint64))
            repeated.append(np.unique(hashes[1:][hashes[1:] == hashes[:-1]]))
        return np.concatenate(repeated) if repeated else np.zeros(0, np.uint64)

    def first_repeat(self, read_again: Callable[[], Iterable[pa.RecordBatch]]) -> tuple[str, int, int] | None:
        """The string that occurs again first in row order, with its first row and that row; None if
        all are distinct. ``read_again()`` gives the strings again (the first column of its batches),
        read only where two hashes are equal (a repeat, or two strings of one hash)."""
        suspects = self.repeated_hashes()
        if not len(suspects):
            return None
        first_row: dict[str, int] = {}
        row = 0
        for batch in read_again():
            strings = batch.column(0)
            for i in np.flatnonzero(np.isin(hash_strings(strings), suspects)).tolist():
                value = strings[i].as_py()
                if value in first_row:
                    return value, first_row[value], row + i
                first_row[value] = row + i
            row += len(strings)
        return None
