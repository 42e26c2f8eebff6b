"""The ``omicsio-materialize`` command (also ``python -m materialize``).

omicsio-materialize cells.parquet out/ --genes gene_metadata.parquet --obs cell_type,drug,batch
omicsio-materialize 'atlas/dataset=*/**/*.parquet' out/ --where "tissue = 'lung'"
omicsio-materialize 'atlas/**/*.parquet' out/ --workers 16          (a local process pool)
omicsio-materialize 'atlas/**/*.parquet' /shared/out/ --dask-scheduler tcp://10.0.0.5:8786
omicsio-materialize s3://bucket/atlas/ s3://bucket/datasets/atlas/  (object storage, both sides)
omicsio-materialize cells.vortex out/
omicsio-materialize --query "SELECT * FROM 'cells.parquet' WHERE n_genes > 500" out/
omicsio-materialize pbmc.h5ad out/ --layer counts --obs bulk_labels
omicsio-materialize velo.h5ad out/ --layers spliced,unspliced,ambiguous      (one modality per layer)
omicsio-materialize rna_cells/ out/ --modality atac=atac_cells/ --layers spliced=rna_layers_spliced/
omicsio-materialize multiome.h5mu out/                (every modality of a MuData file; rna first)
omicsio-materialize ducklake:lake.ducklake out/ --table rna_cells --snapshot 3   (a DuckLake table)
omicsio-materialize a.h5ad b.h5ad 'plates/*.parquet' out/   (a collection: genes unified by Ensembl id)
omicsio-materialize --sources sources.csv out/ --raw  (a collection listed with dataset ids and obs)
omicsio-materialize out/ --panel panel.txt            (any input; dense gene-panel layout)
omicsio-materialize verify out/
omicsio-materialize stats out/                        (add corpus statistics to an older dataset)
omicsio-materialize index 'atlas/**/*.parquet' atlas_index/   (inverted gene -> cells index)
omicsio-materialize synth corpus/ --cells 200000      (a synthetic corpus to try it on)
"""

from __future__ import annotations

import argparse
import signal
import sys

from omicsio_jax import OmicsIOError
from omicsio_jax.format import DERIVED_FILES, read_manifest, verify_dataset

from ._collection_sources import Sources
from ._options import (
    DEFAULT_COMPRESSION,
    DEFAULT_GROUP_SIZE,
    DEFAULT_SHARD_CELLS,
    Dask,
    InputOptions,
    Layout,
    Multimodal,
)
from ._shards import InterruptedAfterWriting


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omicsio-materialize",
        description="Convert list-column single-cell tables (parquet, vortex, a DuckDB query, a DuckLake "
        "catalog), AnnData (.h5ad, .zarr) or MuData (.h5mu) into a validated ArrayRecord dataset. Subcommands: `verify OUT`, `stats OUT`, `index INPUT OUT`, `synth DIR`.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="A null gene list means 'no expressed genes' and becomes an empty row.",
    )
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="input (file, directory, glob, .vortex, .h5ad, .zarr, .h5mu, ducklake:CATALOG; local or "
        "s3://); several inputs make "
        "one collection (cells one source after the other, obs dataset_id, genes unified by Ensembl id); "
        "with --query the input is optional (if given it is the view `cells`); none with --sources",
    )
    p.add_argument(
        "out",
        metavar="OUT",
        help="output directory (absent or empty; an existing dataset with --overwrite) or s3:// prefix",
    )
    p.add_argument("--where", help="SQL predicate: materialize only the matching cells")
    p.add_argument("--query", help="a DuckDB SELECT producing the rna_cells columns")
    p.add_argument("--table", help="ducklake:CATALOG input: the table to read (or ducklake:CATALOG#TABLE)")
    lake = p.add_mutually_exclusive_group()
    lake.add_argument(
        "--snapshot", type=int, help="ducklake:CATALOG input: read this snapshot id (default: the latest)"
    )
    lake.add_argument(
        "--at",
        metavar="TIME",
        help="ducklake:CATALOG input: the last snapshot at or before this ISO time (UTC)",
    )
    p.add_argument(
        "--genes",
        help="gene table (parquet) with gene_token_id; default: gene_metadata.parquet "
        "beside the input or in the nearest folder above it, else the token ids seen in the data. "
        "A collection: union (default, every gene a source measured), intersection, or a gene table / "
        "vocabulary (.parquet, .csv, .json, .txt)",
    )
    p.add_argument(
        "--sources",
        metavar="FILE",
        help="a collection's sources file (CSV, TSV or parquet): columns path, dataset_id, per-source "
        "obs (assay, donor_id, ...), and optionally layer / raw per AnnData source",
    )
    p.add_argument(
        "--gene-id-column",
        help="a collection: the gene table column holding Ensembl ids (default: found among "
        "ensembl_id, gene_ids, gene_id, feature_id)",
    )
    p.add_argument("--obs", help="comma-separated obs columns to keep (default: every scalar column)")
    p.add_argument(
        "--panel",
        help="text file with one gene per line (Ensembl id, name or token id): "
        "dense layout, rows pre-scattered to the panel's columns",
    )
    p.add_argument("--layer", help="h5ad: read this layer instead of X")
    p.add_argument("--raw", action="store_true", help="h5ad: read raw/X and raw/var")
    p.add_argument(
        "--layers",
        help="further modalities over the primary's genes (splice layers): layer names of an "
        ".h5ad/.h5mu (spliced,unspliced), or NAME=TABLE pairs for list-column tables",
    )
    p.add_argument(
        "--modality",
        action="append",
        default=[],
        metavar="NAME=TABLE",
        help="a further modality with features of its own, aligned by cell_id (repeatable): NAME=TABLE "
        "for list-column tables (feature table: --modality-features, else <name>_features.parquet, "
        "peaks.parquet or features.parquet beside the table); NAME of an .h5mu modality (default: all)",
    )
    p.add_argument(
        "--modality-features",
        action="append",
        default=[],
        metavar="NAME=TABLE",
        help="the feature table of a --modality (parquet keyed by its *_token_id column)",
    )
    p.add_argument(
        "--primary",
        default="rna",
        help="name of the primary modality (an .h5mu's modality read as the "
        "dataset's own rows; default: rna)",
    )
    p.add_argument(
        "--require-all-modalities",
        action="store_true",
        help="a cell missing from a further modality is an error (default: an empty row, has_<name> False)",
    )
    p.add_argument("--cell-id", default="cell_id", help="cell id column of table inputs (default: cell_id)")
    p.add_argument("--allow-negative", action="store_true", help="accept negative expression values")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output dataset")
    p.add_argument(
        "--shard-cells", type=int, default=DEFAULT_SHARD_CELLS, help="cells per shard (power of two)"
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=DEFAULT_GROUP_SIZE,
        help="ArrayRecord group size in cells (power of two; see benchmarks/README.md)",
    )
    p.add_argument(
        "--compression",
        default=DEFAULT_COMPRESSION,
        help="ArrayRecord compression (default zstd:-1; zstd:1 is 17%% smaller and decompresses slower, "
        "uncompressed is 2x larger and faster)",
    )
    p.add_argument(
        "--batch-cells",
        type=int,
        default=None,
        help="cells read per batch (default: 2,048 from .h5ad; from parquet files, by their row width: ~4M "
        "values, 256 to 8,192 cells; 8,192 through DuckDB)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="local worker processes, one shard-aligned partition at a time each (default: the usable "
        "cores, at most one per 32,768 cells; 1 runs in this process)",
    )
    p.add_argument(
        "--dask-scheduler",
        metavar="ADDR",
        help="run the partitions on this Dask scheduler "
        "(tcp://host:port; needs omicsio_jax[distributed] and the output on storage every worker reaches)",
    )
    p.add_argument(
        "--dask-scheduler-file", metavar="FILE", help="the same, from a `dask scheduler --scheduler-file`"
    )
    p.add_argument(
        "--no-stats",
        action="store_true",
        help="skip the corpus statistics (gene_stats.parquet, obs n_counts / n_genes); "
        "`omicsio-materialize stats OUT` adds them later",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _verify(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="omicsio-materialize verify", description="Recheck sizes and checksums.")
    p.add_argument("dataset")
    args = p.parse_args(argv)
    manifest = read_manifest(args.dataset)
    problems = verify_dataset(args.dataset)
    if problems:
        for problem in problems:
            print(f"omicsio-materialize verify: {args.dataset}: {problem}", file=sys.stderr)
        derived = all(any(name in p for name in DERIVED_FILES) for p in problems)
        fix = (
            f"omicsio-materialize stats {args.dataset} --force writes the statistics again"
            if derived
            else "materialize it again from its input (--overwrite)"
        )
        print(f"omicsio-materialize verify: {args.dataset} is damaged: {fix}", file=sys.stderr)
        return 1
    further = f", modalities {', '.join(m.name for m in manifest.modalities)}" if manifest.modalities else ""
    print(
        f"{args.dataset}: OK ({manifest.num_cells:,} cells, {len(manifest.shards)} shard(s){further}, "
        f"fingerprint {manifest.fingerprint[:16]})"
    )
    return 0


def _index(argv: list[str]) -> int:
    from ._index import build_gene_index

    p = argparse.ArgumentParser(
        prog="omicsio-materialize index",
        description="Build the inverted index gene_cell_index (gene_token_id, dataset, cell_rowids) of a "
        "list-column table, for gene-centric queries (omicsio_jax.open_table(INPUT, index=OUT)).",
    )
    p.add_argument("input", help="parquet file, directory, glob or hive folder, or vortex files")
    p.add_argument("out", help="output directory")
    p.add_argument("--genes", help="gene table (default: gene_metadata.parquet beside the input)")
    p.add_argument("--memory-mib", type=int, default=512, help="postings held in RAM before spilling (MiB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing index")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.memory_mib < 1:
        p.error(f"--memory-mib must be at least 1, got {args.memory_mib}")
    from omicsio_jax import CellTable

    info = build_gene_index(
        CellTable(args.input, genes=args.genes),
        args.out,
        overwrite=args.overwrite,
        memory_budget=args.memory_mib << 20,
        progress=not args.no_progress,
    )
    print(
        f"{args.out}: {info['rows']:,} (gene, dataset) rows, {info['postings']:,} postings over "
        f"{info['num_cells']:,} cells in {info['seconds']} s"
    )
    return 0


def _stats(argv: list[str]) -> int:
    from ._stats import add_stats

    p = argparse.ArgumentParser(
        prog="omicsio-materialize stats",
        description="Compute the corpus statistics (gene_stats.parquet, obs n_counts / n_genes) of a dataset "
        "materialized before they existed, from its shards; the fingerprint stays the same.",
    )
    p.add_argument("dataset")
    p.add_argument("--force", action="store_true", help="recompute statistics the dataset already has")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    print(add_stats(args.dataset, force=args.force, progress=not args.no_progress))
    return 0


def _materialize(argv: list[str]) -> int:
    from ._materialize import materialize  # here: its kernels' import can fail with a one-line error

    p = _parser()
    args = p.parse_intermixed_args(argv)
    inputs, out = args.inputs, args.out
    if args.sources is not None:
        if inputs:
            p.error("with --sources, give OUT alone (the sources file lists the inputs)")
        source = Sources.read(args.sources)
    elif args.query is not None and not inputs:
        source = None
    elif len(inputs) == 1:
        source = inputs[0]
    elif len(inputs) > 1:  # a collection
        source = inputs
    else:
        p.error("give INPUT and OUT (several inputs: a collection; OUT alone with --query or --sources)")
    layers, modalities = _modality_args(p, args)
    dask = args.dask_scheduler is not None or args.dask_scheduler_file is not None
    result = materialize(
        source,
        out,
        read=InputOptions(
            where=args.where,
            query=args.query,
            genes=args.genes,
            layer=args.layer,
            use_raw=args.raw,
            cell_id=args.cell_id,
            batch_cells=args.batch_cells,
            allow_negative=args.allow_negative,
            gene_id_column=args.gene_id_column,
            table=args.table,
            snapshot=args.at if args.at is not None else args.snapshot,
        ),
        obs=None if args.obs is None else [c.strip() for c in args.obs.split(",") if c.strip()],
        layout=Layout(
            shard_cells=args.shard_cells,
            group_size=args.group_size,
            compression=args.compression,
            panel=args.panel,
        ),
        multimodal=Multimodal(
            layers=layers,
            modalities=modalities,
            primary=args.primary,
            require_all=args.require_all_modalities,
        ),
        workers=Dask(args.dask_scheduler, args.dask_scheduler_file) if dask else args.workers,
        overwrite=args.overwrite,
        stats=not args.no_stats,
        progress=not args.no_progress,
    )
    print(result.summary())
    return 0


def _pairs(p: argparse.ArgumentParser, items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            p.error(f"{flag} takes NAME=VALUE, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def _modality_args(p: argparse.ArgumentParser, args) -> tuple:
    """``--layers`` / ``--modality`` as `materialize`'s ``layers`` / ``modalities``: names, or name → table."""
    layers = modalities = None
    if args.layers:
        items = [x.strip() for x in args.layers.split(",") if x.strip()]
        layers = _pairs(p, items, "--layers") if any("=" in x for x in items) else items
    if args.modality:
        if any("=" in x for x in args.modality):
            tables = _pairs(p, args.modality, "--modality")
            features = _pairs(p, args.modality_features, "--modality-features")
            unknown = sorted(set(features) - set(tables))
            if unknown:
                p.error(f"--modality-features for {', '.join(unknown)}, which no --modality names")
            modalities = {
                name: (table, features[name]) if name in features else table for name, table in tables.items()
            }
        else:
            modalities = list(args.modality)
    elif args.modality_features:
        p.error("--modality-features needs --modality NAME=TABLE")
    return layers, modalities


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code: 2 for a user mistake (one line, not a traceback), 128 + the
    signal's number for a run stopped by SIGINT (Ctrl-C, 130) or SIGTERM (143)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    received = []

    def terminate(signum, frame):  # a SIGTERM unwinds the run as Ctrl-C does, cleaning up
        received.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate) if _is_main_thread() else None
    try:
        if argv[:1] == ["verify"]:
            return _verify(argv[1:])
        if argv[:1] == ["index"]:
            return _index(argv[1:])
        if argv[:1] == ["stats"]:
            return _stats(argv[1:])
        if argv[:1] == ["synth"]:
            from ._synthetic import main as synth_main

            return synth_main(argv[1:])
        return _materialize(argv)
    except OmicsIOError as e:
        print(f"omicsio-materialize: error: {'; '.join([str(e), *_notes(e)])}", file=sys.stderr)
        return 2
    except BaseException as e:
        if not _interrupted(e):
            raise
        after = e if isinstance(e, InterruptedAfterWriting) else None
        said = str(after) if after else "; ".join(_notes(e)) or "nothing was written"
        print(f"omicsio-materialize: interrupted; {said}", file=sys.stderr)
        return 128 + (received[0] if received else signal.SIGINT)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _notes(error: BaseException) -> list[str]:
    """What the run added to its error on the way out (`_output`: objects it could not remove)."""
    return list(getattr(error, "__notes__", ()))


def _interrupted(error: BaseException | None) -> bool:
    """True for Ctrl-C / SIGTERM, also when it surfaced inside a numba call as a SystemError."""
    while error is not None:
        if isinstance(error, KeyboardInterrupt):
            return True
        error = error.__cause__ or error.__context__
    return False


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
