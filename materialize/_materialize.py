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
import hashlib
import json
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from omicsio_jax import DataValidationError, OmicsIOError
from omicsio_jax.format import (
    CODEC_VERSION,
    MANIFEST_NAME,
    PRESENCE_NAME,
    Manifest,
    ModalityEntry,
    as_input_path,
    is_remote,
    open_store,
    to_numpy,
)

from ._collection import CollectionSource, Sources, open_collection, opens_on_workers
from ._finalize import Finalizer
from ._modalities import H5Modality, ModalityInput, TableModality, h5mu_alignment, input_kind, modality_inputs
from ._options import Dask, InputOptions, Layout, Multimodal
from ._panel import Panel, read_panel
from ._partition import N_COUNTS, N_GENES, PART_CELLS, PARTS_DIR, Job, part_dir
from ._pool import Pool, default_workers, run_in_process, usable_cores
from ._shards import atomic_output_dir
from ._source import Source, require_file
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
    primary: str = "rna",
    table: str | None = None,
    snapshot=None,
    con=None,
) -> Source:
    """Open any supported input: ``.h5ad`` files (and modality ``primary`` of an ``.h5mu``) go to the
    AnnData reader, ``ducklake:`` catalogs to `DuckLakeSource` (``table`` at ``snapshot``), the rest
    to DuckDB (on ``con``, a connection to a database opened already, if given)."""
    from ._ducklake import is_ducklake

    if (table is not None or snapshot is not None) and not is_ducklake(source):
        msg = f"--table/--snapshot/--at apply to ducklake:CATALOG inputs, not to {source}"
        raise OmicsIOError(msg)
    kind = input_kind(source)
    if kind in ("h5ad", "h5mu"):
        if where or query:
            msg = f"--where/--query apply to list-column tables; for .{kind}, subset the data first"
            raise OmicsIOError(msg)
        from ._h5ad import DEFAULT_BATCH_CELLS, H5adSource
        from ._modalities import h5mu_modalities

        require_file(source)
        group = ""
        if kind == "h5mu":
            names = h5mu_modalities(as_input_path(str(source)))
            if primary not in names:
                msg = f"{source} has no modality {primary!r} (it has {', '.join(names)}); pick the primary with --primary"
                raise OmicsIOError(msg)
            group = f"mod/{primary}"
        src = H5adSource(
            as_input_path(str(source)),
            layer=layer,
            use_raw=use_raw,
            batch_cells=batch_cells or DEFAULT_BATCH_CELLS,
            group=group,
        )
        if (hint := src.raw_counts_hint()) is not None:
            print(f"materialize: {hint}", file=sys.stderr)
        return src
    if layer or use_raw:
        msg = "--layer/--raw apply to .h5ad inputs only"
        raise OmicsIOError(msg)
    if is_ducklake(source):
        if query:
            msg = "--query does not apply to a ducklake: input; select its cells with --where"
            raise OmicsIOError(msg)
        from ._ducklake import DuckLakeSource

        return DuckLakeSource(
            str(source),
            table=table,
            snapshot=snapshot,
            where=where,
            genes=None if genes is None else str(genes),
            cell_id_column=cell_id,
            batch_cells=batch_cells,
        )
    if source is None and query is None:
        msg = "give an input path/glob, or a DuckDB --query"
        raise OmicsIOError(msg)
    from ._tables import TableSource

    return TableSource(
        None if source is None else str(source),
        where=where,
        query=query,
        genes=None if genes is None else str(genes),
        cell_id_column=cell_id,
        batch_cells=batch_cells,
        con=con,
    )


CELL_STATS = (N_COUNTS, N_GENES)  # obs sidecars computed from the cells


def _open_member(path: str, own: dict, con, **reading) -> Source:
    """One source of a collection (``reading``: `open_source`'s keywords). Its own ``layer`` / ``raw``
    (a sources file's columns) replace the run's, both of them (a source's layer clears the run's
    ``--raw``, its ``raw`` the run's ``--layer``); the run's apply to the AnnData sources (``.h5ad``,
    ``.zarr``, ``.h5mu``) only. A function of the module, so a pool's worker can be handed it
    (`open_collection`)."""
    layer, use_raw = reading.pop("layer"), reading.pop("use_raw")
    if own:
        layer, use_raw = own.get("layer"), bool(own.get("raw", False))
        if layer is not None and use_raw:
            msg = f"source {path} is given both a layer ({layer!r}) and raw in the sources file: leave one empty"
            raise OmicsIOError(msg)
    if input_kind(path) == "table":
        if own and (layer is not None or use_raw):
            msg = (
                f"source {path} is given {'a layer' if layer is not None else 'raw'} in the sources file, "
                "but layer / raw apply to AnnData sources (.h5ad, .zarr, .h5mu) only: leave it empty in its row"
            )
            raise OmicsIOError(msg)
        layer, use_raw = None, False
    return open_source(path, con=con, layer=layer, use_raw=use_raw, **reading)


def _open_collection(sources: Sources, open_member, *, opened, progress: bool, **options) -> CollectionSource:
    """`open_collection` with a bar of the sources opened (shown for a long opening only: a
    collection of many ``.h5ad`` files takes ~40 ms each) and its notes on stderr."""
    with tqdm(
        total=len(sources.paths),
        unit="sources",
        disable=not progress,
        desc="opening sources",
        file=sys.stderr,
        dynamic_ncols=True,
        delay=2.0,
    ) as bar:

        def on_open(num_cells: int, every: bool) -> None:
            bar.update(1)
            opened(num_cells, every)

        return open_collection(
            sources,
            open_member,
            report=lambda note: print(f"materialize: {note}", file=sys.stderr),
            opened=on_open,
            **options,
        )


def as_sources(source) -> Sources | None:
    """The collection ``source`` names (a `Sources`, or a list of inputs), or None for one input."""
    if isinstance(source, Sources):
        return source
    if isinstance(source, Sequence) and not isinstance(source, str):
        return Sources(tuple(str(s) for s in source))
    return None


def _one_anndata_as_collection(source, read: InputOptions, multimodal: Multimodal) -> Sources | None:
    """A single AnnData input (``.h5ad``, ``.zarr``) given ``genes`` or ``gene_id_column``: a collection
    of one, so that its genes are unified as a collection's (ids found, versions stripped, genes of one
    id summed; ``genes``: union, intersection or a gene table / vocabulary fixing genes and order).
    ``gene_id_column`` with a single table, and either with an ``.h5mu``, are one-line errors naming
    the collection of one that takes them; None otherwise."""
    if read.genes is None and read.gene_id_column is None:
        return None
    kind, options = input_kind(source), "--genes/--gene-id-column (genes=, gene_id_column=)"
    if kind == "h5ad":
        if read.where or read.query:
            return None  # refused by `open_source`
        if multimodal.layers or multimodal.modalities:
            msg = (
                f"{options} make the AnnData input {source} a collection of one, which takes no "
                "--layers/--modality; materialize its layers or modalities without them"
            )
            raise OmicsIOError(msg)
        return Sources((str(source),))
    if kind == "h5mu":
        require_file(source)  # a missing input first
        msg = (
            f"{options} do not apply to the .h5mu input {source} (its modalities' genes come from their "
            f"var); to unify its {multimodal.primary} genes, give it as a collection of one: "
            f"materialize([{str(source)!r}], ...) (--sources with one row)"
        )
        raise OmicsIOError(msg)
    if read.gene_id_column is not None:
        msg = (
            f"--gene-id-column (gene_id_column=) applies to a collection's sources and AnnData inputs, not "
            f"to the single input {source} (whose genes are its gene table's token ids); give it as a "
            f"collection of one: materialize([{str(source)!r}], ...) (--sources with one row)"
        )
        raise OmicsIOError(msg)
    return None


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
        print(
            f"materialize: obs {', '.join(shadowed)} of {src.label} not copied: the dataset's own "
            f"{', '.join(CELL_STATS)} are computed from its cells",
            file=sys.stderr,
        )
    return [name for name in obs if name not in CELL_STATS]


def materialize(
    source: str | Path | Sequence[str | Path] | Sources | None,
    out: str | Path,
    *,
    read: InputOptions = InputOptions(),
    obs: Sequence[str] | None = None,
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
    ``layer``, ...), ``obs`` which obs columns to keep (default: every scalar column), ``layout``
    how the shards are laid out (`Layout`: ``shard_cells``, ``group_size``, ``compression``, a dense
    gene ``panel``). Several modalities of the same cells come with ``multimodal`` (`Multimodal`; see
    `omicsio_jax.Dataset.modality`):

    >>> materialize("rna_cells.parquet", "multiome/", multimodal=Multimodal(            # doctest: +SKIP
    ...     modalities={"atac": "atac_cells.parquet"}, layers={"spliced": "rna_layers_spliced.parquet"}))
    >>> materialize("multiome.h5mu", "multiome/")            # rna + atac          # doctest: +SKIP

    Partitions run on ``workers`` local processes (default: the usable cores, but at most one per
    32,768 cells, so a smaller input is written here; 1 runs them here), or on a Dask cluster
    (``workers=Dask("tcp://host:8786")``). Either the whole dataset appears at ``out`` or nothing
    does (an existing ``out`` is replaced only with ``overwrite``). ``stats`` computes the corpus
    statistics as the cells are written (``gene_stats.parquet``, obs ``n_counts`` / ``n_genes``: what
    normalization, Geneformer's gene medians and highly variable genes read); ``stats=False`` leaves
    them out, for ``omicsio-materialize stats OUT`` to add. Raises `DataValidationError` naming the
    file, row and cell_id of the first cell that breaks the schema.
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
    layers, modalities = multimodal.layers, multimodal.modalities
    primary, require_all_modalities = multimodal.primary, multimodal.require_all
    dask = workers if isinstance(workers, Dask) else None
    dask_scheduler, dask_scheduler_file = (
        (None, None) if dask is None else (dask.scheduler, dask.scheduler_file)
    )
    workers = None if dask is not None else workers
    start = time.perf_counter()
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        msg = f"workers must be >= 1, got {workers}"
        raise OmicsIOError(msg)
    store = open_store(out)
    sources = as_sources(source)
    if sources is None:
        sources = _one_anndata_as_collection(source, read, multimodal)
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
    _check_output(store, overwrite)
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
            _open_collection(
                sources,
                functools.partial(
                    _open_member,
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
        obs_names = _choose_obs(src, obs)
        clash = [f"has_{inp.name}" for inp in inputs if f"has_{inp.name}" in obs_names]
        if clash:
            msg = f"obs {', '.join(clash)} of {src.label} would clash with the presence flags of the modalities; rename it"
            raise OmicsIOError(msg)
        partitions = src.plan(shard_cells)
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
        with _staging(store, overwrite) as staging, contextlib.ExitStack() as stack:
            threads = None if dask else max(1, usable_cores() // num_workers)  # within this process's cores
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
                with tqdm(
                    total=src.num_cells,
                    unit="cells",
                    unit_scale=True,
                    disable=not progress,
                    desc=desc,
                    file=sys.stderr,
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
            with _scratch(staging) as scratch:
                for k, inp in enumerate(inputs):
                    further = _open_modality(
                        inp,
                        src,
                        job,
                        partitions,
                        primary=primary,
                        require_all=require_all_modalities,
                        check_primary=k == 0,
                        subset=bool(where or query),
                        scratch=scratch,
                    )
                    try:
                        entries.append(
                            _write_modality(inp, further, job, run, array_record, created_by, cell_id)
                        )
                    finally:
                        further.close()
            features = src.genes if chosen_panel is None else chosen_panel.features
            manifest = finalizer.finish(
                features=features,
                codec=_codec_description(chosen_panel),
                array_record=array_record,
                source={**src.description, "cell_id": cell_id, "allow_negative": allow_negative},
                created_by=created_by,
                modality=primary,
                modalities=tuple(entries),
                tables={PRESENCE_NAME: src.presence()} if isinstance(src, CollectionSource) else {},
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


def _open_modality(
    inp: ModalityInput,
    src: Source,
    job: Job,
    partitions,
    *,
    primary: str,
    require_all: bool,
    check_primary: bool,
    subset: bool,
    scratch: str,
) -> Source:
    """The further modality ``inp`` as a source in the primary's row order (the primary written);
    ``scratch``: a local folder for a table that must be put in that order."""
    if inp.table is None:  # a layer or a modality of the primary's own .h5ad / .h5mu
        from ._h5ad import H5adSource

        if inp.layer:
            reader = H5adSource(src.path, layer=inp.name, group=src.group)
            return H5Modality(inp.name, reader, src, None, layer=True)
        reader = H5adSource(src.path, group=f"mod/{inp.name}")
        rows = h5mu_alignment(src.path, primary, inp.name, require_all=require_all)
        return H5Modality(inp.name, reader, src, rows, layer=False)
    store = open_store(job.staging)
    cells = [f"{job.staging}/{part_dir(p.index)}/{PART_CELLS}" for p in partitions]
    spill = Path(scratch) / f"align-{inp.name}"
    further = TableModality(
        inp,
        primary=primary,
        primary_label=src.label,
        primary_cells=cells,
        primary_genes=src.genes,
        num_cells=src.num_cells,
        shard_cells=job.shard_cells,
        spill=spill,
        require_all=require_all,
        check_primary=check_primary,
        subset=subset,
    )
    if store.local_root is None:  # workers elsewhere read the spilled partitions from the output's store
        further.publish(f"{job.staging}/{PARTS_DIR}/align-{inp.name}")
    return further


def _write_modality(
    inp: ModalityInput, further: Source, job: Job, run, array_record: dict, created_by: str, cell_id: str
) -> ModalityEntry:
    """Write a further modality as the dataset ``modalities/<name>`` beside the primary's; its entry."""
    from ._validate import GeneIndex

    if inp.layer:
        index = job.gene_index
    else:
        tokens = further.genes.column("gene_token_id").to_numpy()
        index = GeneIndex.from_tokens(
            tokens, f"the features of modality {inp.name}: {len(tokens):,}", further.list_names
        )
    path = f"modalities/{inp.name}"
    staging = f"{job.staging}/{path}"
    mjob = dataclasses.replace(
        job, source=further, obs=(), gene_index=index, panel=None, staging=staging, presence=True
    )
    parts = further.plan(job.shard_cells)
    with Finalizer(mjob, open_store(staging), parts) as finalizer:
        run(mjob, parts, f"materialize {inp.name}", finalizer.add)
        manifest = finalizer.finish(
            features=further.features_table,
            codec=_codec_description(None),
            array_record=array_record,
            source={**further.description, "cell_id": cell_id},
            created_by=created_by,
            modality=inp.name,
        )
    sha = hashlib.sha256(manifest.to_json().encode()).hexdigest()
    return ModalityEntry(
        inp.name,
        path,
        manifest.num_genes,
        manifest.layout,
        manifest.nnz,
        inp.features_kind,
        manifest.fingerprint,
        sha,
    )


@contextlib.contextmanager
def _scratch(staging: str) -> Iterator[str]:
    """A local folder for intermediate files: in the staging directory (removed with the partitions'
    sidecars), or a temporary one when the output is on object storage."""
    store = open_store(staging)
    if store.local_root is not None:
        folder = store.local_root / PARTS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        yield str(folder)
        return
    with tempfile.TemporaryDirectory(prefix="omicsio-scratch-") as folder:
        yield folder


def _check_output(store, overwrite: bool) -> None:
    """Refuse to replace an existing dataset without ``overwrite``, and anything that is not a dataset."""
    if store.local_root is not None:
        out = store.local_root
        if out.exists() and not overwrite:
            msg = f"output {str(out)!r} already exists; pass --overwrite (overwrite=True) to replace it"
            raise OmicsIOError(msg)
        return
    objects = store.list()
    if not objects:
        return
    if not any(key == MANIFEST_NAME for key, _ in objects):
        msg = (
            f"refusing to write into {store.url}: it holds {len(objects)} object(s) and no {MANIFEST_NAME}; "
            "choose an empty prefix (or delete these objects)"
        )
        if not overwrite or any(not _ours(key) for key, _ in objects):
            raise OmicsIOError(msg)
    elif not overwrite:
        msg = f"output {store.url} already holds a dataset; pass --overwrite (overwrite=True) to replace it"
        raise OmicsIOError(msg)


# the top-level names a materialize run writes under its output (besides shards and generations)
_WRITTEN = (
    PARTS_DIR,
    "obs",
    "chunks",
    "modalities",
    MANIFEST_NAME,
    "features.parquet",
    "cell_ids.parquet",
    "gene_stats.parquet",
)


def _ours(key: str) -> bool:
    """Objects a materialize run writes (a dataset's, or an unfinished run's)."""
    top = key.split("/", 1)[0]
    return (
        top in _WRITTEN
        or top.startswith("gen-")
        or (top.startswith("shard-") and top.endswith(".arrayrecord"))
    )


@contextlib.contextmanager
def _staging(store, overwrite: bool) -> Iterator[str]:
    """Where the partitions and the finished files go: a hidden sibling directory renamed into place;
    on object storage the prefix itself when it holds no dataset, else a new generation under it
    (``gen-...``), made current by rewriting the prefix's manifest (one PUT) once it is complete,
    the old generation deleted only after (`omicsio_jax.format.dataset_root`). A run killed at
    any point leaves the old dataset whole and current."""
    if store.local_root is not None:
        with atomic_output_dir(store.local_root, overwrite=overwrite) as tmp:
            yield str(tmp)
            for parts in [tmp / PARTS_DIR, *(tmp / "modalities").glob(f"*/{PARTS_DIR}")]:
                shutil.rmtree(parts, ignore_errors=True)
        return
    if store.head(MANIFEST_NAME) is None:  # nothing to replace: written in place
        try:
            yield store.url
        except BaseException:
            with contextlib.suppress(OmicsIOError):  # best effort: nothing here looks complete anyway
                store.delete([k for k, _ in store.list() if _ours(k)])
            raise
        keep = _listed(store, Manifest.from_dict(json.loads(store.read_text(MANIFEST_NAME))))
        store.delete([k for k, _ in store.list() if _ours(k) and k not in keep])
        return
    generation = f"gen-{secrets.token_hex(8)}"
    staged = open_store(f"{store.url.rstrip('/')}/{generation}")
    try:
        yield staged.url
    except BaseException:
        with contextlib.suppress(OmicsIOError):  # best effort: the old generation is untouched either way
            staged.delete([k for k, _ in staged.list()])
        raise
    manifest = Manifest.from_dict(json.loads(staged.read_text(MANIFEST_NAME)))
    keep = {MANIFEST_NAME, *(f"{generation}/{k}" for k in _listed(staged, manifest))}
    store.write_bytes(MANIFEST_NAME, dataclasses.replace(manifest, generation=generation).to_json().encode())
    store.delete([k for k, _ in store.list() if _ours(k) and k not in keep])


def _listed(store, manifest: Manifest) -> set[str]:
    """The keys of a dataset's files (its manifest, shards, files, and its modalities' own)."""
    keep = {MANIFEST_NAME, *(s.path for s in manifest.shards), *(f.path for f in manifest.files)}
    for entry in manifest.modalities:
        sub = Manifest.from_dict(json.loads(store.read_text(f"{entry.path}/{MANIFEST_NAME}")))
        keep |= {
            f"{entry.path}/{name}"
            for name in (MANIFEST_NAME, *(s.path for s in sub.shards), *(f.path for f in sub.files))
        }
    return keep


def _codec_description(panel: Panel | None) -> dict:
    return {
        "name": "omicsio-cell",
        "version": CODEC_VERSION,
        "records": "one per cell",
        "indices": "dense row"
        if panel is not None
        else "per record: u16 gaps if every gap ≤ 65535, else u32",
        "values": "per record: narrowest lossless of u8/u16/u32 (integer counts) or f32",
        "dense_width": None if panel is None else panel.features.num_rows,
    }


def _version() -> str:
    import omicsio_jax

    return omicsio_jax.__version__
