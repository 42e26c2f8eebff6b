"""The gene table (``gene_token_id, ensembl_id, gene_name, ...``): resolve genes, cached locally.

The gene table is small (~60k rows) and shared by every partition, so the first access copies
it into a local cache (``$OMICSIO_JAX_CACHE`` or ``~/.cache/omicsio_jax``) keyed by its path,
size and modification time; later opens read the local copy, even when the table lives on a
remote store DuckDB reads (``s3://``, ``hf://``).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omicsio_jax.core.errors import OmicsIOError, UnknownNameError
from omicsio_jax.format.genes import fold_ensembl
from omicsio_jax.format.tables import GENE_COLUMN, connect, sql_str
from omicsio_jax.storage.store import default_cache_dir, is_remote, open_store


class UnknownGeneError(UnknownNameError):
    """A gene name, Ensembl id or token id that the gene table does not hold (or holds twice)."""


def _stamp(spec: str) -> dict:
    """What identifies the gene table's version: path, and size + mtime for a local file (size +
    ETag for an ``s3://`` object)."""
    if is_remote(spec):
        parent, _, key = spec.rpartition("/")
        info = open_store(parent).head(key)
        return {"path": spec} if info is None else {"path": spec, "size": info.size, "etag": info.etag}
    path = Path(spec)
    if path.exists():
        st = path.stat()
        return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return {"path": spec}


class GeneTable:
    """Genes by token id, with lookup by gene name or Ensembl id (versions like ``.12`` ignored).

    >>> genes = GeneTable.load("atlas/gene_metadata.parquet")               # doctest: +SKIP
    >>> genes.resolve(["CD3E", "ENSG00000111640", 17])                      # doctest: +SKIP
    array([ 1245, 20873,    17], dtype=int32)
    """

    def __init__(self, table: pa.Table, source: str = "gene table"):
        if GENE_COLUMN not in table.column_names:
            msg = f"{source} has no {GENE_COLUMN} column (it has {', '.join(table.column_names)})"
            raise OmicsIOError(msg)
        self.table = table.sort_by(GENE_COLUMN)
        self.source = source
        self.token_ids = self.table.column(GENE_COLUMN).to_numpy().astype(np.int32)
        self._by_token = {int(t): i for i, t in enumerate(self.token_ids)}
        self._by_name: dict[str, list[int]] = {}  # names in any case, Ensembl versions dropped
        self._by_exact: dict[str, list[int]] = {}  # names as stored: CD3E and Cd3e, two genes
        for column in ("ensembl_id", "gene_name"):
            if column in self.table.column_names:
                for token, key in zip(
                    self.token_ids.tolist(), self.table.column(column).to_pylist(), strict=True
                ):
                    if key is not None:
                        for by, name in ((self._by_name, fold_ensembl(key)), (self._by_exact, key)):
                            if token not in by.setdefault(name, []):
                                by[name].append(token)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """One more than the largest token id: the width of a full-transcriptome row."""
        return int(self.token_ids.max()) + 1 if len(self.token_ids) else 0

    def names(self, token_ids: Sequence[int] | np.ndarray) -> list[str]:
        """Gene names (or, where a gene has none, Ensembl ids, or the token id) of the given token ids."""
        columns = [
            self.table.column(c).to_pylist()
            for c in ("gene_name", "ensembl_id")
            if c in self.table.column_names
        ]
        out = []
        for t in np.asarray(token_ids).tolist():
            i = self._by_token.get(int(t))
            named = [] if i is None else [values[i] for values in columns if values[i] is not None]
            out.append(named[0] if named else str(t))
        return out

    def resolve(self, genes: Sequence[str | int] | str | int) -> np.ndarray:
        """Token ids (int32) of gene names, Ensembl ids (case-insensitive, the case stored deciding
        between names that differ only in case) or token ids, in order.

        Raises `UnknownGeneError` naming every unknown gene (with close matches) or every name
        shared by several genes (with their token ids to choose from).
        """
        if isinstance(genes, str | int | np.integer):
            genes = [genes]
        out, problems = [], []
        for g in genes:
            if isinstance(g, int | np.integer):
                if int(g) in self._by_token:
                    out.append(int(g))
                else:
                    problems.append(f"token id {int(g)} (not in {self.source})")
                continue
            hits = self._by_name.get(fold_ensembl(str(g)), [])
            if len(hits) > 1 and len(self._by_exact.get(str(g), [])) == 1:  # the one written so
                hits = self._by_exact[str(g)]
            if len(hits) == 1:
                out.append(hits[0])
            elif hits:
                problems.append(
                    f"{g!r} names {len(hits)} genes (token ids {', '.join(map(str, hits[:5]))}): "
                    "pass a token id or Ensembl id"
                )
            else:
                close = difflib.get_close_matches(
                    fold_ensembl(str(g)), self._candidates(str(g)), n=3, cutoff=0.75
                )
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                problems.append(f"{g!r}{hint}")
        if problems:
            msg = f"{len(problems)} gene(s) not resolved in {self.source}: " + "; ".join(problems[:10])
            raise UnknownGeneError(msg)
        return np.asarray(out, dtype=np.int32)

    def _candidates(self, gene: str) -> list[str]:
        prefix = fold_ensembl(gene)[:2]
        return [k for k in self._by_name if k.startswith(prefix)]

    @classmethod
    def load(
        cls,
        spec: str | os.PathLike[str],
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        refresh: bool = False,
    ) -> GeneTable:
        """Read a gene table (any file DuckDB reads), through the local cache.

        The cache entry is reused while the source's path (and, for a local file, its size and
        modification time) is unchanged; ``refresh=True`` re-reads it.
        """
        spec = str(spec)
        stamp = _stamp(spec)
        try:
            cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        except OmicsIOError:  # a user without a home: no cache, the table read on each open
            cache = None
        key = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:24]
        cached = cache / "genes" / f"{key}.parquet" if cache is not None else None
        if cached is not None and cached.exists() and not refresh:
            return cls(pq.read_table(cached), spec)
        try:
            table = connect(remote=is_remote(spec)).sql(f"SELECT * FROM {sql_str(spec)}").to_arrow_table()
        except duckdb.Error as e:
            msg = f"cannot read gene table {spec}: {str(e).strip().splitlines()[0]}"
            raise OmicsIOError(msg) from e
        genes = cls(table, spec)
        if cached is None:
            return genes
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".tmp-{os.getpid()}")
            pq.write_table(genes.table, tmp)
            os.replace(tmp, cached)  # atomic: a concurrent reader sees the old entry or the new one
        except OSError:
            pass  # a read-only or full cache only costs the next open a re-read
        return genes

    @classmethod
    def from_token_ids(cls, num_tokens: int) -> GeneTable:
        """A gene table of bare token ids 0..num_tokens-1 (for tables shipped without one)."""
        return cls(pa.table({GENE_COLUMN: pa.array(np.arange(num_tokens, dtype=np.int32))}), "token ids")
