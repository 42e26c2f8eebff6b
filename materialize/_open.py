"""A run's input: one source opened by its kind (`open_source`), or a collection of them opened as
its members; and the obs columns the run keeps.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from omicsio_jax import DataValidationError, OmicsIOError
from omicsio_jax.format import as_input_path, is_glob, is_remote, local_glob, progress_bar

from ._collection import CollectionSource, Sources, open_collection
from ._modalities import input_kind
from ._options import InputOptions, Multimodal
from ._partition import N_COUNTS, N_GENES, dataset_obs_names
from ._source import Source, require_file


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

        group = ""
        if kind == "h5ad":
            require_file(source)
        else:  # (h5mu_modalities says first if the file is not there)
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
            cell_id=cell_id,
        )
        hint = src.raw_counts_hint()
        if hint is not None:
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


def open_member_source(path: str, own: dict, con, **reading) -> Source:
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


def open_collection_source(
    sources: Sources, open_member, *, opened, progress: bool, **options
) -> CollectionSource:
    """`open_collection` with a bar of the sources opened (shown for a long opening only: a
    collection of many ``.h5ad`` files takes ~40 ms each) and its notes on stderr."""
    notes: list[str] = []  # said once the bar is closed, not run on after it
    with progress_bar(
        total=len(sources.paths),
        unit="sources",
        progress=progress,
        desc="opening sources",
        dynamic_ncols=True,
        delay=2.0,
    ) as bar:

        def on_open(num_cells: int, every: bool) -> None:
            bar.update(1)
            opened(num_cells, every)

        collection = open_collection(sources, open_member, report=notes.append, opened=on_open, **options)
    for note in notes:
        print(f"materialize: {note}", file=sys.stderr)
    return collection


def as_sources(source) -> Sources | None:
    """The collection ``source`` names (a `Sources`, a list of inputs, or a folder or glob of AnnData
    files: `anndata_files`), or None for one input."""
    if isinstance(source, Sources):
        return source
    if isinstance(source, Sequence) and not isinstance(source, str | os.PathLike):
        return Sources(tuple(path for s in source for path in anndata_files(s) or [str(s)]))
    found = anndata_files(source)
    return None if found is None else Sources(tuple(found))


_ANNDATA = (".h5ad", ".h5mu")


def anndata_files(spec) -> list[str] | None:
    """The AnnData files a local input names as a collection's sources, or None for an input of
    another kind: a glob of them (``atlas/*.h5ad``, ``atlas/**/*.h5ad``: the files it matches, sorted,
    one source each; none is a one-line error) or a folder holding them and no table files (its
    ``.h5ad`` / ``.h5mu`` files, sorted): an atlas downloaded as one file per dataset (CELLxGENE)."""
    if spec is None or isinstance(spec, Sources):
        return None
    text = os.fspath(spec) if isinstance(spec, os.PathLike) else str(spec)
    if is_remote(text) or text.startswith("ducklake:"):
        return None
    if is_glob(text) and text.endswith(_ANNDATA):
        found = sorted(local_glob(text))
        if not found:
            msg = f"no AnnData files match {text!r}"
            raise OmicsIOError(msg)
        return found
    folder = Path(text)
    if not folder.is_dir() or text.rstrip("/").endswith(".zarr"):  # (a .zarr folder is one AnnData)
        return None
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    anndata = [n for n in names if n.endswith(_ANNDATA)]
    tables = [n for n in names if n.endswith((".parquet", ".vortex"))]
    if not anndata or tables:
        return None
    return [str(folder / n) for n in anndata]


def one_anndata_as_collection(source, read: InputOptions, multimodal: Multimodal) -> Sources | None:
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


def choose_obs(src: Source, obs: Sequence[str] | None) -> list[str]:
    """The obs columns to write: ``obs`` (checked against the source's), or every one of the
    source's but those named as the dataset's own ``n_counts`` / ``n_genes`` (kept under another
    name when ``obs`` names them: `dataset_obs_names`; either said on stderr); a note of the
    source's (`Source.obs_notes`) goes to stderr for each column kept."""
    chosen = _chosen_obs(src, obs)
    for name in chosen:
        if name in src.obs_notes:
            print(f"materialize: {src.obs_notes[name]}", file=sys.stderr)
    return chosen


# the columns pandas' `to_parquet` writes for an unnamed index (a RangeIndex it keeps in metadata)
_PANDAS_INDEX = re.compile(r"__index_level_\d+__")


def _chosen_obs(src: Source, obs: Sequence[str] | None) -> list[str]:
    if obs is None:
        index = [name for name in src.obs_columns if _PANDAS_INDEX.fullmatch(name)]
        if index:
            print(
                f"materialize: {', '.join(index)} of {src.label} not copied: pandas' unnamed index, no "
                "obs (name the index before to_parquet, or give it in --obs, to keep it)",
                file=sys.stderr,
            )
        own = [name for name in CELL_STATS if name in src.obs_columns]
        if own:
            print(
                f"materialize: obs {', '.join(own)} of {src.label} not copied: the dataset's own "
                f"{', '.join(CELL_STATS)} are computed from its cells (name them in --obs to keep the "
                f"input's, as {', '.join(dataset_obs_names(list(src.obs_columns))[n] for n in own)})",
                file=sys.stderr,
            )
        return [name for name in src.obs_columns if name not in index and name not in own]
    unknown = [name for name in obs if name not in src.obs_columns]
    if unknown:
        msg = (
            f"obs column(s) {', '.join(unknown)} not found (or not scalar) in {src.label}; "
            f"available: {', '.join(src.obs_columns) or '(none)'}"
        )
        raise DataValidationError(msg)
    names = dataset_obs_names(obs)
    renamed = [f"{name} as {names[name]}" for name in CELL_STATS if name in names]
    if renamed:
        print(
            f"materialize: obs {', '.join(renamed)} of {src.label} kept: the dataset's own "
            f"{', '.join(CELL_STATS)} are computed from its cells",
            file=sys.stderr,
        )
    return list(obs)
