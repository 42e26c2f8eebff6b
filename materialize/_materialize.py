"""`materialize`: any supported input → a validated, block-aligned ArrayRecord dataset."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from omicsio_jax import DataValidationError, OmicsIOError, _codec
from omicsio_jax._background import Background
from omicsio_jax._genestats import STATS_NAME, StatsAccumulator
from omicsio_jax._manifest import MANIFEST_NAME, Manifest, ObsEntry, file_entry

from ._panel import Panel, read_panel
from ._shards import atomic_output_dir, make_shard_writer, writer_options
from ._sidecars import CellIdWriter, make_obs_writer
from ._source import Source
from ._validate import GeneIndex, encode_batch

DEFAULT_SHARD_CELLS = 1 << 16
DEFAULT_GROUP_SIZE = 16
DEFAULT_COMPRESSION = "zstd:-1"  # see benchmarks/README.md: reads 13-18% faster than zstd:1, 21% more bytes


@dataclasses.dataclass(frozen=True)
class MaterializeResult:
    """What was written, with the figures of the summary line."""

    path: Path
    manifest: Manifest
    seconds: float
    writer_peak_rss_bytes: int | None = None  # the shard writer process's VmHWM (Linux)

    @property
    def cells_per_second(self) -> float:
        return self.manifest.num_cells / self.seconds if self.seconds > 0 else float("inf")

    def summary(self) -> str:
        m = self.manifest
        size = sum(s.num_bytes for s in m.shards) + sum(f.num_bytes for f in m.files)
        return (
            f"materialized {m.num_cells:,} cells × {m.num_genes:,} genes ({m.layout}), {m.nnz:,} nonzeros, "
            f"{size / 2**20:,.1f} MiB in {len(m.shards)} shard(s), {self.seconds:.1f} s "
            f"({self.cells_per_second:,.0f} cells/s) → {self.path}"
        )


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_layout(shard_cells: int, group_size: int) -> None:
    if not _is_power_of_two(shard_cells):
        msg = f"shard_cells must be a power of two (so blocks never straddle shards), got {shard_cells:,}"
        raise OmicsIOError(msg)
    if not _is_power_of_two(group_size) or group_size > shard_cells:
        msg = f"group_size must be a power of two ≤ shard_cells ({shard_cells:,}), got {group_size:,}"
        raise OmicsIOError(msg)


def _prefetch(batches: Iterator, depth: int = 2) -> Iterator:
    """Read the next batches in a background thread (DuckDB / h5py / Arrow release the GIL)."""
    reader = Background(lambda: batches, depth, name="materialize-reader")
    try:
        yield from reader
    finally:
        reader.close()


def open_source(
    source: str | Path | None,
    *,
    where: str | None = None,
    query: str | None = None,
    genes: str | Path | None = None,
    layer: str | None = None,
    use_raw: bool = False,
    cell_id: str = "cell_id",
    batch_cells: int | None = None,
) -> Source:
    """Open any supported input: ``.h5ad`` files go to the AnnData reader, the rest to DuckDB."""
    if source is not None and str(source).endswith(".h5ad"):
        if where or query:
            msg = "--where/--query apply to list-column tables; for .h5ad, subset the AnnData first"
            raise OmicsIOError(msg)
        from ._h5ad import DEFAULT_BATCH_CELLS, H5adSource

        return H5adSource(Path(source), layer=layer, use_raw=use_raw, batch_cells=batch_cells or DEFAULT_BATCH_CELLS)
    if layer or use_raw:
        msg = "--layer/--raw apply to .h5ad inputs only"
        raise OmicsIOError(msg)
    if source is None and query is None:
        msg = "give an input path/glob, or a DuckDB --query"
        raise OmicsIOError(msg)
    from ._tables import DEFAULT_BATCH_CELLS, TableSource

    return TableSource(None if source is None else str(source), where=where, query=query,
                       genes=None if genes is None else str(genes), cell_id_column=cell_id,
                       batch_cells=batch_cells or DEFAULT_BATCH_CELLS)


CELL_STATS = ("n_counts", "n_genes")  # obs sidecars computed from the cells


def _choose_obs(src: Source, obs: Sequence[str] | None) -> list[str]:
    if obs is None:
        return [name for name in src.obs_columns if name not in CELL_STATS]
    unknown = [name for name in obs if name not in src.obs_columns]
    if unknown:
        msg = (
            f"obs column(s) {', '.join(unknown)} not found (or not scalar) in {src.label}; "
            f"available: {', '.join(src.obs_columns) or '(none)'}"
        )
        raise DataValidationError(msg)
    shadowed = [name for name in obs if name in CELL_STATS]
    if shadowed:
        print(f"materialize: obs {', '.join(shadowed)} of {src.label} not copied: the dataset's own "
              f"{', '.join(CELL_STATS)} are computed from its cells", file=sys.stderr)
    return [name for name in obs if name not in CELL_STATS]


def materialize(
    source: str | Path | None,
    out: str | Path,
    *,
    where: str | None = None,
    query: str | None = None,
    genes: str | Path | None = None,
    obs: Sequence[str] | None = None,
    panel: str | Path | Sequence[str] | None = None,
    layer: str | None = None,
    use_raw: bool = False,
    cell_id: str = "cell_id",
    allow_negative: bool = False,
    overwrite: bool = False,
    shard_cells: int = DEFAULT_SHARD_CELLS,
    group_size: int = DEFAULT_GROUP_SIZE,
    compression: str = DEFAULT_COMPRESSION,
    batch_cells: int | None = None,
    progress: bool = True,
) -> MaterializeResult:
    """Convert list-column tables, a DuckDB query or an ``.h5ad`` into a dataset directory.

    >>> materialize("cells.parquet", "out/", obs=["cell_type", "drug"])      # doctest: +SKIP
    >>> materialize("atlas/**/*.parquet", "lung/", where="tissue = 'lung'")  # doctest: +SKIP
    >>> materialize("pbmc.h5ad", "pbmc/", layer="counts")                    # doctest: +SKIP

    Either the whole dataset appears at ``out`` or nothing does. Raises `DataValidationError`
    naming the file, row and cell_id of the first cell that breaks the schema.
    """
    start = time.perf_counter()
    _check_layout(shard_cells, group_size)
    out = Path(out)
    if out.exists() and not overwrite:
        msg = f"output {str(out)!r} already exists; pass --overwrite (overwrite=True) to replace it"
        raise OmicsIOError(msg)
    src = open_source(source, where=where, query=query, genes=genes, layer=layer, use_raw=use_raw,
                      cell_id=cell_id, batch_cells=batch_cells)
    gene_index = GeneIndex.from_tokens(src.genes.column("gene_token_id").to_numpy(),
                                       f"{src.description.get('genes') or 'token ids seen in the data'}: "
                                       f"{src.genes.num_rows:,} genes")
    chosen_panel = None if panel is None else read_panel(panel, src.genes)
    obs_names = _choose_obs(src, obs)
    options = writer_options(group_size, compression)
    with atomic_output_dir(out, overwrite=overwrite) as tmp, contextlib.ExitStack() as cleanup:
        (tmp / "obs").mkdir()
        shards = make_shard_writer(tmp, shard_cells=shard_cells, options=options)
        cleanup.callback(shards.abort)
        obs_writers = [make_obs_writer(tmp / "obs", name, src.obs_columns[name]) for name in obs_names]
        for writer in obs_writers:
            cleanup.callback(writer.close)
        cell_ids = CellIdWriter(tmp)
        cleanup.callback(cell_ids.close)
        num_columns = gene_index.num_genes if chosen_panel is None else chosen_panel.features.num_rows
        stats = StatsAccumulator(num_columns, shard_cells)
        stat_writers = [make_obs_writer(tmp / "obs", "n_counts", pa.float64()),
                        make_obs_writer(tmp / "obs", "n_genes", pa.int32())]
        for writer in stat_writers:
            cleanup.callback(writer.close)
        # statistics on their own thread (numba releases the GIL), in batch order, beside encoding
        statistics = cleanup.enter_context(ThreadPoolExecutor(1, thread_name_prefix="materialize-stats"))
        pending: collections.deque = collections.deque()
        nnz = 0
        with tqdm(total=src.num_cells, unit="cells", unit_scale=True, disable=not progress,
                  desc="materialize", file=sys.stderr, dynamic_ncols=True) as bar:
            for batch in _prefetch(src.batches(obs_names)):
                buf, starts, batch_nnz = encode_batch(batch.indptr, batch.tokens, batch.values, gene_index,
                                                      allow_negative=allow_negative, locate=batch.locate,
                                                      panel=chosen_panel)
                nnz += batch_nnz
                shards.write(buf, starts)
                pending.append(statistics.submit(_add_stats, stats, stat_writers, buf, starts))
                while pending and (pending[0].done() or len(pending) > 2):  # at most 2 batches behind
                    pending.popleft().result()  # raises what the statistics thread raised
                for writer in obs_writers:
                    writer.append(batch.obs[writer.name])
                cell_ids.append(batch.cell_ids)
                bar.update(batch.num_cells)
        for future in pending:
            future.result()
        shard_entries = shards.close()
        num_cells = sum(s.num_cells for s in shard_entries)
        cell_ids.finish()
        obs_entries = []
        stats.finish().write(tmp / STATS_NAME)
        for writer in [*obs_writers, *stat_writers]:
            dtype = writer.finish()
            obs_entries.append(ObsEntry(writer.name, writer.kind, dtype, writer.num_categories))
        features = src.genes if chosen_panel is None else chosen_panel.features
        pq.write_table(features, tmp / "features.parquet", compression="zstd")
        relpaths = ["features.parquet", CellIdWriter.path, STATS_NAME]
        relpaths += [p for writer in [*obs_writers, *stat_writers] for p in writer.files()]
        files = tuple(file_entry(tmp, p) for p in relpaths)
        manifest = Manifest(
            num_cells=num_cells,
            num_genes=features.num_rows,
            nnz=nnz,
            layout="sparse" if chosen_panel is None else "dense",
            codec=_codec_description(chosen_panel),
            array_record={"group_size": group_size, "compression": compression, "writer_options": options},
            shard_cells=shard_cells,
            shards=tuple(shard_entries),
            files=files,
            obs=tuple(obs_entries),
            source={**src.description, "cell_id": cell_id, "allow_negative": allow_negative},
            created_by=f"omicsio_jax {_version()}",
        ).with_fingerprint()
        (tmp / MANIFEST_NAME).write_text(manifest.to_json())
    return MaterializeResult(out, manifest, time.perf_counter() - start, shards.peak_rss_bytes)


def _add_stats(stats: StatsAccumulator, writers, buf, starts) -> None:
    for writer, column in zip(writers, stats.add(buf, starts), strict=True):
        writer.append(pa.array(column))


def _codec_description(panel: Panel | None) -> dict:
    return {
        "name": "omicsio-cell",
        "version": _codec.CODEC_VERSION,
        "records": "one per cell",
        "indices": "dense row" if panel is not None else "per record: u16 gaps if every gap ≤ 65535, else u32",
        "values": "per record: narrowest lossless of u8/u16/u32 (integer counts) or f32",
        "dense_width": None if panel is None else panel.features.num_rows,
    }


def _version() -> str:
    import omicsio_jax

    return omicsio_jax.__version__

