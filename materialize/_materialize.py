"""`materialize`: any supported input → a validated, block-aligned ArrayRecord dataset.

The input is planned into shard-aligned partitions (`_plan`); each is written by `write_partition`
— here, on a pool of local worker processes (``workers``, default: the usable cores, at most one
per 32,768 cells) or on a Dask cluster — and a `Finalizer` joins them as they complete, manifest
last. The output is byte-identical whatever runs the partitions. A local output appears whole or
not at all (written in a hidden sibling, renamed into place); an ``s3://`` output is complete only
once its ``manifest.json`` is uploaded, last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from omicsio_jax import OmicsIOError
from omicsio_jax.format import (
    PRESENCE_NAME,
    Manifest,
    is_remote,
    open_store,
    progress_bar,
    small_pages,
    to_numpy,
)

from ._collection import CollectionSource, Sources, opens_on_workers
from ._collection_sources import refuse_ducklake_sources
from ._finalize import Finalizer
from ._further_modalities import codec_description, open_modality, write_modality
from ._modalities import modality_inputs
from ._open import (
    as_sources,
    choose_obs,
    one_anndata_as_collection,
    open_collection_source,
    open_member_source,
    open_source,
)
from ._options import Dask, InputOptions, Layout, Multimodal, as_names
from ._output import check_apart, check_output, scratch_dir, staging_dir
from ._panel import read_panel
from ._partition import Job
from ._pool import Pool, default_workers, usable_cores
from ._run import run_in_process
from ._validate import GeneIndex


@dataclasses.dataclass(frozen=True)
class MaterializeResult:
    """What was written, with the figures of the summary line."""

    path: Path | str
    manifest: Manifest
    seconds: float
    partitions: int = 1
    workers: int = 1
    redone: tuple[int, ...] = ()  # partitions written again after their worker died

    @property
    def cells_per_second(self) -> float:
        return self.manifest.num_cells / self.seconds if self.seconds > 0 else float("inf")

    def summary(self) -> str:
        m = self.manifest
        size = sum(s.num_bytes for s in m.shards) + sum(f.num_bytes for f in m.files)
        further = "".join(
            f"; {e.name}: {e.num_features:,} features, {e.nnz:,} nonzeros" for e in m.modalities
        )
        return (
            f"materialized {m.num_cells:,} cells × {m.num_genes:,} genes ({m.layout}), {m.nnz:,} nonzeros, "
            f"{size / 2**20:,.1f} MiB in {len(m.shards)} shard(s){further}, {self.seconds:.1f} s "
            f"({self.cells_per_second:,.0f} cells/s, {self.workers} worker(s)) → {self.path}"
        )


def _absolute(spec):
    """A local path (a file, folder, glob, or a ``ducklake:`` catalog's) made absolute against this
    process's current directory; anything else (``s3://``, ``union``, a list of genes) as it is."""
    if not isinstance(spec, str | os.PathLike):
        return spec
    text = os.fspath(spec)
    if text.startswith("ducklake:"):  # ducklake:[sqlite:|duckdb:]CATALOG[#TABLE]
        catalog, sep, table = text[len("ducklake:") :].partition("#")
        kind = next((k for k in ("sqlite:", "duckdb:") if catalog.startswith(k)), "")
        return "ducklake:" + kind + str(_absolute(catalog[len(kind) :])) + sep + table
    if is_remote(text) or text in ("union", "intersection"):
        return spec
    return os.path.abspath(text)


def _absolute_paths(source, read: InputOptions, layout: Layout, multimodal: Multimodal) -> tuple:
    """The run's local paths made absolute (`_absolute`), for a Dask cluster, whose workers would open
    a relative one in their own current directories: a file of the same name there would be read
    in place of the one given. (A ``query``'s SQL is the caller's: its paths are not rewritten.)"""

    def each(value):
        if isinstance(value, dict):
            return {
                k: tuple(map(_absolute, v)) if isinstance(v, tuple) else _absolute(v)
                for k, v in value.items()
            }
        if isinstance(value, Sequence) and not isinstance(value, str):
            return [_absolute(v) for v in value]
        return _absolute(value)

    if isinstance(source, Sources):
        source = dataclasses.replace(source, paths=tuple(_absolute(p) for p in source.paths))
    else:
        source = each(source)
    read = dataclasses.replace(read, genes=_absolute(read.genes))
    layout = dataclasses.replace(layout, panel=_absolute(layout.panel))
    modalities = multimodal.modalities
    if isinstance(modalities, dict):  # tables by name; .h5mu modality names stay names
        modalities = each(modalities)
    layers = each(multimodal.layers) if isinstance(multimodal.layers, dict) else multimodal.layers
    return source, read, layout, dataclasses.replace(multimodal, modalities=modalities, layers=layers)


def materialize(
    source: str | Path | Sequence[str | Path] | Sources | None,
    out: str | Path,
    *,
    read: InputOptions = InputOptions(),
    obs: str | Sequence[str] | None = None,
    layout: Layout = Layout(),
    multimodal: Multimodal = Multimodal(),
    workers: int | Dask | None = None,
    overwrite: bool = False,
    stats: bool = True,
    progress: bool = True,
) -> MaterializeResult:
    """Convert list-column tables, a DuckDB query, an ``.h5ad`` or an ``.h5mu`` into a dataset directory
    (or ``s3://`` prefix).

    >>> materialize("cells.parquet", "out/", obs=["cell_type", "drug"])      # doctest: +SKIP
    >>> materialize("atlas/**/*.parquet", "lung/", read=InputOptions(where="tissue = 'lung'"))  # doctest: +SKIP
    >>> materialize("pbmc.h5ad", "pbmc/", read=InputOptions(layer="counts"))  # doctest: +SKIP
    >>> materialize("s3://atlas/cells/", "s3://datasets/atlas/", workers=16)  # doctest: +SKIP

    ``read`` says how the input is read (`InputOptions`: ``where``, ``query``, ``genes``, an AnnData
    ``layer``, ...), ``obs`` which obs columns to keep (a name or names; default: every scalar column),
    ``layout`` how the shards are laid out (`Layout`: ``shard_cells``, ``group_size``, ``compression``,
    a dense gene ``panel``). Several modalities of the same cells come with ``multimodal``
    (`Multimodal`; see `omicsio_jax.Dataset.modality`):

    >>> materialize("rna_cells.parquet", "multiome/", multimodal=Multimodal(            # doctest: +SKIP
    ...     modalities={"atac": "atac_cells.parquet"}, layers={"spliced": "rna_layers_spliced.parquet"}))
    >>> materialize("multiome.h5mu", "multiome/")            # rna + atac          # doctest: +SKIP

    Partitions run on ``workers`` local processes (default: the usable cores, but at most one per 32,768
    cells, so a smaller input is written here; 1 runs them here), or on a Dask cluster
    (``workers=Dask("tcp://host:8786")``). Either the whole dataset appears at ``out`` or nothing does
    (an existing dataset at ``out`` is replaced only with ``overwrite``; an empty folder needs none).
    ``stats`` computes the corpus statistics as the cells are written (``gene_stats.parquet``, obs
    ``n_counts`` / ``n_genes``: what normalization, Geneformer's gene medians and highly variable genes
    read); ``stats=False`` leaves them out, for ``omicsio-materialize stats OUT`` to add.
    ``progress`` shows progress bars on stderr (sources opened, cells written). Raises
    `DataValidationError` naming the file, row and cell_id of the first cell that breaks the schema.
    """
    where, query, genes, layer, use_raw, cell_id, batch_cells, allow_negative = (
        read.where,
        read.query,
        read.genes,
        read.layer,
        read.use_raw,
        read.cell_id,
        read.batch_cells,
        read.allow_negative,
    )
    shard_cells, group_size, compression, panel = (
        layout.shard_cells,
        layout.group_size,
        layout.compression,
        layout.panel,
    )
    obs, layers, modalities = map(as_names, (obs, multimodal.layers, multimodal.modalities))
    primary, require_all_modalities = multimodal.primary, multimodal.require_all
    dask = workers if isinstance(workers, Dask) else None
    dask_scheduler, dask_scheduler_file = (
        (None, None) if dask is None else (dask.scheduler, dask.scheduler_file)
    )
    workers = None if dask is not None else workers
    if dask is not None:  # a Dask worker opens a relative path in its own current directory
        source, read, layout, multimodal = _absolute_paths(source, read, layout, multimodal)
    start = time.perf_counter()
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        msg = f"workers must be >= 1, got {workers}"
        raise OmicsIOError(msg)
    store = open_store(out)
    sources = as_sources(source)
    if sources is not None:
        refuse_ducklake_sources(sources, read.table)
    if sources is not None and (read.table is not None or read.snapshot is not None):
        msg = (
            "--table/--snapshot/--at apply to a ducklake:CATALOG input materialized on its own, not to a "
            "collection; leave them out"
        )
        raise OmicsIOError(msg)
    if sources is None:
        sources = one_anndata_as_collection(source, read, multimodal)
    if sources is not None and (layers or modalities or where or query):
        msg = (
            "a collection takes no --where/--query/--layers/--modality; materialize its sources' cells "
            "and modalities as separate datasets, or filter each source first"
        )
        raise OmicsIOError(msg)
    inputs = (
        []
        if sources is not None
        else modality_inputs(source, layers=layers, modalities=modalities, primary=primary)
    )
    read_from = sources.paths if sources is not None else [source]
    check_apart(out, [*read_from, *(inp.table for inp in inputs if inp.table is not None)])
    check_output(store, overwrite)
    wanted = 1 if dask else workers or usable_cores()
    # asked for by number: started first, so the workers import while the input is opened and planned;
    # by default they start once the plan shows the input is large enough to pay for them
    pool = Pool(wanted) if workers is not None and wanted > 1 else None

    def start_pool(num_cells: int, every: bool) -> None:
        """By default, a collection's workers start as its sources open, once the cells open so far
        are worth them all (else once all are open), not after the plan: their start (each imports
        pyarrow, numba and the package) then overlaps the opening of the other sources and the
        unifying of their genes, on this process's serial path."""
        nonlocal pool
        count = min(wanted, default_workers(num_cells))
        if pool is None and not dask and count > 1 and (count == wanted or every):
            pool = Pool(count)

    if sources is not None and pool is None and not dask and wanted > 1 and opens_on_workers(sources):
        pool = Pool(wanted)  # the sources open on its workers (h5py reads one file at a time per process)

    src = None
    try:
        src = (
            open_collection_source(
                sources,
                functools.partial(
                    open_member_source,
                    layer=layer,
                    use_raw=use_raw,
                    cell_id=cell_id,
                    batch_cells=batch_cells,
                    primary=primary,
                ),
                genes=genes,
                id_column=read.gene_id_column,
                opened=start_pool,
                pool=pool,
                progress=progress,
            )
            if sources is not None
            else open_source(
                source,
                where=where,
                query=query,
                genes=genes,
                layer=layer,
                use_raw=use_raw,
                cell_id=cell_id,
                batch_cells=batch_cells,
                primary=primary,
                table=read.table,
                snapshot=read.snapshot,
            )
        )
        gene_index = GeneIndex.from_tokens(
            to_numpy(src.genes.column("gene_token_id")),
            f"{src.description.get('genes') or 'token ids seen in the data'}: {src.genes.num_rows:,} genes",
        )
        chosen_panel = None if panel is None else read_panel(panel, src.genes)
        obs_names = choose_obs(src, obs)
        clash = [f"has_{inp.name}" for inp in inputs if f"has_{inp.name}" in obs_names]
        if clash:
            msg = f"obs {', '.join(clash)} of {src.label} would clash with the presence flags of the modalities; rename it"
            raise OmicsIOError(msg)
        partitions = src.plan(shard_cells)
        if src.num_cells == 0:  # written all the same (a pipeline's subset may be empty); loaders refuse it
            chosen = f" --where {where!r} selects" if where else " --query returns" if query else ""
            print(
                f"materialize: {src.label}{chosen or ' holds'} no cells: the dataset will hold 0 cells",
                file=sys.stderr,
            )
        num_workers = min(wanted, max(len(partitions), 1))
        if workers is None and not dask:
            num_workers = min(num_workers, default_workers(sum(p.num_cells for p in partitions)))
        if pool is not None:
            pool.shrink(num_workers if num_workers > 1 else 0)  # none: the one partition is written here
        elif num_workers > 1 and not dask:
            pool = Pool(num_workers)
        if dask or num_workers > 1:  # one process goes on from where its last partition stopped
            for note in src.plan_notes(partitions):
                print(f"materialize: {note}", file=sys.stderr)
        options = layout.writer_options
        with staging_dir(store, overwrite) as (staging, lease), contextlib.ExitStack() as stack:
            stack.enter_context(small_pages())  # the partitions' merge, and those written here
            threads = None if dask else max(1, usable_cores() // num_workers)  # within this process's cores
            # what the partitions' reads need first (a CSC matrix regrouped by row), in a folder every
            # process that reads one sees: not a Dask run's local one when it writes to object storage
            seen = not dask or store.local_root is not None
            folder = f"{stack.enter_context(scratch_dir(staging))}/by-row" if seen else None
            stage_pool = pool if num_workers > 1 else None  # (the partitions' pool, where they run on one)
            for note in src.stage(folder, progress=progress, pool=stage_pool):
                print(f"materialize: {note}", file=sys.stderr)
            job = Job(
                src,
                tuple(obs_names),
                gene_index,
                chosen_panel,
                allow_negative,
                shard_cells,
                options,
                staging,
                secrets.token_hex(8),
                threads,
                stats=stats,
            )

            def run(job: Job, parts, desc: str, on_done=None):
                if lease is not None:  # a run that lost its lease on object storage stops handing out parts
                    on_done = _ensuring(lease, on_done)
                with progress_bar(
                    total=src.num_cells,
                    unit="cells",
                    unit_scale=True,
                    progress=progress,
                    desc=desc,
                    dynamic_ncols=True,
                ) as bar:
                    if dask:
                        from ._dask import run_on_dask  # the Dask runner, loaded by the runs that need it

                        return run_on_dask(
                            job,
                            parts,
                            bar.update,
                            address=dask_scheduler,
                            scheduler_file=dask_scheduler_file,
                            on_done=on_done,
                        )
                    if num_workers > 1:
                        return pool.run(job, parts, bar.update, on_done=on_done)
                    return run_in_process(job, parts, bar.update, on_done=on_done)

            finalizer = stack.enter_context(Finalizer(job, open_store(staging), partitions))
            report = run(job, partitions, "materialize", finalizer.add)
            array_record = {"group_size": group_size, "compression": compression, "writer_options": options}
            created_by = f"omicsio_jax {_version()}"
            entries = []
            # the primary's cell ids are checked for repeats once, by the first input aligned to them
            # (a layer of the primary's own file is its cells already)
            aligned = [k for k, inp in enumerate(inputs) if not (inp.table is None and inp.layer)]
            with scratch_dir(staging) as scratch:
                for k, inp in enumerate(inputs):
                    further = open_modality(
                        inp,
                        src,
                        job,
                        partitions,
                        primary=primary,
                        require_all=require_all_modalities,
                        check_primary=k in aligned[:1],
                        subset=bool(where or query),
                        scratch=scratch,
                    )
                    try:
                        staged = None if folder is None else f"{folder}-{inp.name}"
                        for note in further.stage(staged, progress=progress, pool=stage_pool):
                            print(f"materialize: {note}", file=sys.stderr)
                        entries.append(
                            write_modality(inp, further, job, run, array_record, created_by, cell_id)
                        )
                    finally:
                        further.close()
            features = src.genes if chosen_panel is None else chosen_panel.features
            manifest = finalizer.finish(
                features=features,
                codec=codec_description(chosen_panel),
                array_record=array_record,
                source={**src.description, "cell_id": cell_id, "allow_negative": allow_negative},
                created_by=created_by,
                modality=primary,
                modalities=tuple(entries),
                tables={PRESENCE_NAME: src.presence()} if isinstance(src, CollectionSource) else {},
                before_commit=None if lease is None else lease.check,
            )
        return MaterializeResult(
            out if is_remote(out) else Path(out),
            manifest,
            time.perf_counter() - start,
            len(partitions),
            report.workers,
            tuple(report.redone),
        )
    finally:
        if pool is not None:
            pool.close()
        if src is not None:
            src.close()  # an .h5ad/.h5mu stays open otherwise until collected


def _ensuring(lease, on_done):
    """``on_done`` (a partition finished) after `Lease.ensure`."""

    def done(index: int) -> None:
        lease.ensure()
        if on_done is not None:
            on_done(index)

    return done


def _version() -> str:
    import omicsio_jax

    return omicsio_jax.__version__
