"""Write benchmarks/README.md from benchmarks/results/*.json, and the headline block of README.md.

A results file is quoted only when it carries complete provenance (`_provenance.provenance`: the
command, date, commit and machine, with the machine's CPU and cores) and is not a ``--quick``
smoke run; every other file is listed by name only. Every figure on the page is printed from a
results file; the prose here (`DESCRIPTIONS`) holds no numbers.

    python benchmarks/report.py                         # write benchmarks/README.md and README.md's block
    python benchmarks/report.py --check                 # exit 1 if either differs from what would be written
    python benchmarks/report.py --readme /tmp/README.md # fill another README's block

README.md's block lies between the lines ``<!-- benchmarks:begin -->`` and ``<!-- benchmarks:end -->``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
ARCHIVE_NAME = "archive"
BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"
NO_HEADLINES = "Measured figures: [benchmarks/README.md](benchmarks/README.md)."

# What each benchmark measures, keyed by its results' "benchmark" field: (title, description). No
# numbers here: every figure on the page comes from a results file.
DESCRIPTIONS: dict[str, tuple[str, str]] = {
    "bench_loader": (
        "Loader throughput against scDataset and Grain",
        "omicsio_jax's disk loader (dense, csr, gene panels, true random sampling, two compressions) "
        "against scDataset on the h5ad of the same synthetic cells and Grain's stock ArrayRecord path on "
        "the same shards, each configuration in a fresh process, with a warm and a cold page cache; the "
        "cold rows sit next to the files' sequential-read limit.",
    ),
    "bench_annbatch": (
        "Loader throughput against annbatch",
        "omicsio_jax's disk loader against annbatch (scverse's on-disk loader, its own preshuffled zarr "
        "collection of the same cells, run in its own virtualenv), dense and csr batches, each in a fresh "
        "process: cells per second and per CPU-second, time to the first batch, peak memory and the label "
        "entropy of the minibatches, with each format's one-off conversion cost and size on disk.",
    ),
    "bench_startup": (
        "First batch from process start against annbatch",
        "Fresh processes of omicsio_jax's disk loader and of annbatch on the same cells, warm page "
        "cache: seconds from the process's spawn to its first batch, split into the interpreter's start, "
        "the imports, opening the data and the first batch.",
    ),
    "bench_grain": (
        "Grain's DataLoader over GrainSource against make_loader",
        "The same batches through omicsio_jax's own loader and through Grain's DataLoader over "
        "GrainSource with and without worker processes, all placed on the default device; then the "
        "loader's checkpoint size and Orbax save and restore times.",
    ),
    "soak": (
        "Fault soak",
        "Two host processes of a Grain training loop reading a dataset on S3 (moto on loopback) through "
        "a proxy that injects server-error responses, connection resets, slow and truncated bodies and "
        "ETag changes, their Grain workers killed and one host preempted and resumed from its Orbax "
        "checkpoint, compared batch by batch with the fault-free run over a local copy; each epoch's "
        "coverage audit over both hosts, a flipped byte in a cached chunk read back, one host's memory "
        "once warm.",
    ),
    "bench_collection": (
        "A collection of sources with different gene sets",
        "Parquet sources, each measuring a random subset of the genes of a human-sized universe (half "
        "listing them in an order of their own), materialized as one collection (genes unified by Ensembl id, presence "
        "bitmaps) against the same cells as one source over all the genes, each round whole "
        "conversions in a fresh process until they took the window (its `window` says which); then the loader over the collection with a mixture of its "
        "sources and measured-gene masks against the loader over the single dataset at its defaults, and "
        "against the same loader (mixture, masks) over the single source materialized as a collection of one.",
    ),
    "bench_open": (
        "A collection of many small .h5ad files: opening its sources",
        "CELLxGENE-style .h5ad sources, each measuring a random subset of a human-sized gene universe "
        "(half listing them in an order of their own), materialized as one collection at the defaults, "
        "their sources opened on threads (h5py reads one file at a time in a process) against on the "
        "pool's worker processes; each round whole conversions in a fresh process until they took the window.",
    ),
    "bench_ducklake": (
        "DuckLake catalog against its parquet files",
        "The synthetic corpus written into a DuckLake table by DuckDB's ducklake extension, then "
        "materialized from the catalog (read from its tables, no extension) and from the lake's own "
        "parquet data files given directly, alternating, each round one whole conversion in a fresh "
        "process; both must write the same shards.",
    ),
    "bench_tokens": (
        "Tokenized batches",
        "Geneformer and scGPT token batches from omicsio_jax's loader beside its csr batches (and SLAF's "
        "tokenized loader, where its virtualenv is set up) on the same cells; the tokenizers' kernel cost "
        "per cell on one thread, beside a baseline checkout's where one is given; materialize's "
        "throughput with the corpus statistics it records.",
    ),
    "bench_materialize": (
        "Materialize throughput",
        "Conversion of the synthetic corpus, from parquet, from h5ad and from the h5ad's cells stored by "
        "column (CSC), into a dataset with "
        "materialize's defaults (a worker per usable core), each round one whole conversion in a fresh "
        "process: cells per second, peak memory of the main process and of its largest child, and bytes "
        "per cell next to the inputs'.",
    ),
    "bench_scale": (
        "Materialize on every core",
        "Partitioned materialize pinned to one, two and more cores, against the parquet input-decode "
        "limit (pyarrow and DuckDB delivering the list columns on one core, nothing encoded); on one "
        "core also without the corpus statistics, and in the newer files without them with the shards "
        "uncompressed, which prices the default compression. The newest also time two parts of a "
        "conversion alone on one core (the decode with each batch encoded into records; a shard's "
        "records written out and hashed), so that the summary says where a conversion's CPU goes "
        "and the most of the decode limit a conversion could reach if it spent nothing else.",
    ),
    "bench_stats": (
        "Corpus statistics on their own",
        "The corpus statistics of materialize without the rest of a conversion, on one core: a "
        "partition's (`StatsAccumulator.add` and `save`) and the finalizer's merge of a partition "
        "(`GeneStats.load` and `add_to_dense`), in nanoseconds per nonzero of the partitions handled; "
        "and the dataset's statistics file of the merged partitions, written and read back "
        "(`GeneStats.write` and `read`), in milliseconds per file.",
    ),
    "bench_multimodal": (
        "Multimodal datasets",
        "Materialize of RNA alone and of RNA with splice layers and ATAC at two corpus sizes (speed and "
        "peak memory), and what a loader pays per modality: RNA alone, RNA read from the multimodal "
        "dataset, and every modality at once.",
    ),
    "bench_beyond_ram": (
        "A dataset larger than RAM",
        "The loader on copies of the synthetic dataset adding up to more than the machine's memory, cold "
        "(page cache dropped) with direct reads, buffered reads and ArrayRecord's own reader, and warm on "
        "the original, beside the disk's sequential and random-read limits.",
    ),
    "bench_first_batch": (
        "First batch on many shards",
        "Time to the first batch and the bytes read to get there on a dataset of many hard-linked shards, "
        "cold and warm, with the chunk reader and with ArrayRecord's own reader.",
    ),
    "bench_format": (
        "ArrayRecord group size and compression",
        "Write speed, bytes per cell and warm read-and-decode speed of the record format for blocks of "
        "consecutive cells and for single random cells, per group size and compression.",
    ),
    "bench_grid": (
        "Block size and fetch factor: throughput and label entropy",
        "For each block size and fetch factor of block sampling, the loader's throughput and the "
        "plate-label entropy of its minibatches, next to the scDataset paper's bounds.",
    ),
    "bench_layout": (
        "make_loader's decoding threads",
        "For each output kind and batch size, the loader with the consumer decoding every batch itself "
        "against threads decoding ahead, and, where the consumer decodes, one numba thread per batch "
        "against every core; each setting in a fresh process in turn: cells per second and per "
        "CPU-second, and which setting make_loader's default resolves to on the machine.",
    ),
    "bench_tune": (
        "oj.tune checked",
        "The settings oj.tune timed, each measured again in a fresh process: the chosen setting's "
        "throughput as a fraction of the best one's, and its label entropy against true random sampling.",
    ),
    "bench_gpu": (
        "What an accelerator adds",
        "Dense batches placed on the device, csr slabs densified there, a gene panel drawn from device "
        "memory by the in-memory loader, and the raw host-to-device bandwidth.",
    ),
    "bench_query": (
        "Queries and in-memory loaders",
        "Latency of each query stage over the synthetic parquet (scalar columns, gene-list filters, gene "
        "panels, full rows), gene lookup by scan against the inverted index, and the stream and in-memory "
        "panel loaders' throughput.",
    ),
    "bench_s3": (
        "A dataset on S3",
        "The loader on a dataset served by a local S3 server (moto) against the same dataset on local "
        "disk: read amplification and GETs with an empty cache, and warm-cache throughput and its ratio "
        "to local.",
    ),
    "bench_s3_query": (
        "DuckDB over parquet on S3",
        "The same queries through omicsio_jax's obstore route, a pyarrow dataset and DuckDB's httpfs "
        "extension, against the local file: seconds per query.",
    ),
    "bench_normalize": (
        "Where to normalize",
        "Training steps with log-normalization fused into the loader's decoding against the same in the "
        "jitted step: median step time and the share of it spent waiting for data.",
    ),
    "bench_plan_memory": (
        "Memory of a sampling plan",
        "Peak memory of a sampling plan over every cell of a very large dataset with its rows held "
        "implicitly against an explicit array of every row.",
    ),
    "bench_pretrain": (
        "Pretraining learning curves",
        "The tiny transformer preset pretrained on the synthetic corpus (cell types with expression "
        "programs), one run per tokenizer, checkpoints scored on held-out cells: masked-token prediction "
        "against the frequency baseline and a linear probe of cell type against the same network at its "
        "random initialization (the first point); then the final checkpoint fine-tuned on cell type and scored on "
        "the held-out plate beside the probe, the MLP on log1p expression and the majority class. The "
        "plot is the results file's PNG.",
    ),
    "bench_encoder": (
        "The tiny preset's training step, encoder unrolled or scanned",
        "The pretraining step of the tiny Geneformer and scGPT (AdamW, random token batches at the "
        "learning tests' shapes) with the encoder's layers unrolled, as shallow stacks run, against the "
        "same layers under `lax.scan`, as deep stacks run: milliseconds per step, compile time, and the "
        "loss after the first steps, the same in both.",
    ),
    "bench_train": (
        "Sampling strategy and what a classifier learns",
        "One epoch of the same classifier per sampling strategy on all plates but one, evaluated on the "
        "held-out plate; then a small real dataset against scikit-learn on the same split and features.",
    ),
}
ORDER = list(DESCRIPTIONS)
assert not any(re.search(r"\b\d", text) for pair in DESCRIPTIONS.values() for text in pair), (
    "DESCRIPTIONS must hold no numbers"  # names such as h5ad or S3 are fine
)

# ----- formatting ---------------------------------------------------------------------------------


def fmt(value: Any, spec: str = "") -> str:
    """A figure as text: ``spec`` is a format spec, ``x`` a ratio, ``%`` a fraction as percent,
    ``mib`` bytes as MiB, ``fig`` a figure of any size (cells/s whole, seconds to 3 digits); lists (a figure's rounds) are joined; None is a dash."""
    if value is None:
        return "–"
    if isinstance(value, list | tuple):
        return ", ".join(fmt(v, spec) for v in value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        if spec == "x":
            return f"{value:.2f}×"
        if spec == "%":
            return f"{100 * value:.1f}%"
        if spec == "mib":
            return f"{value / 2**20:,.0f}"
        if spec == "fig":
            return format(value, ",.0f" if abs(value) >= 100 else "#.3g")
        return format(value, spec or (",.0f" if abs(value) >= 100 else ".3g"))
    return str(value).replace("|", "\\|")


Column = tuple[str, str | Callable[[dict], Any], str]  # header, key (or getter), format


def table(rows: Iterable[dict], columns: list[Column]) -> list[str]:
    """A Markdown table: one line per row, one cell per column (numbers right-aligned)."""
    rows = list(rows)
    if not rows:
        return []
    values = [[key(row) if callable(key) else row.get(key) for _, key, _ in columns] for row in rows]
    numeric = [
        all(v is None or (isinstance(v, int | float | list) and not isinstance(v, bool)) for v in column)
        for column in zip(*values, strict=True)
    ]
    lines = [
        "| " + " | ".join(h for h, _, _ in columns) + " |",
        "| " + " | ".join("---:" if n else "---" for n in numeric) + " |",
    ]
    for row in values:
        lines.append(
            "| " + " | ".join(fmt(v, spec) for v, (_, _, spec) in zip(row, columns, strict=True)) + " |"
        )
    return [*lines, ""]


def pairs(items: Iterable[tuple[str, Any, str]]) -> list[str]:
    """A two-column table of named figures (None ones left out)."""
    rows = [{"name": n, "value": v, "spec": s} for n, v, s in items if v is not None]
    if not rows:
        return []
    lines = ["| figure | value |", "| --- | ---: |"]
    lines += [f"| {fmt(r['name'])} | {fmt(r['value'], r['spec'])} |" for r in rows]
    return [*lines, ""]


def sub(title: str, lines: list[str]) -> list[str]:
    return [f"**{title}**", "", *lines] if lines else []


def comparisons(d: dict) -> list[str]:
    """The file's ``comparisons``: our median, the peer's, and their ratio."""
    rows = d.get("comparisons") or []
    return sub(
        "Against the peer (medians)",
        table(
            rows,
            [
                ("comparison", "what", ""),
                ("omicsio_jax", "ours_value", "fig"),
                ("peer", "peer_value", "fig"),
                ("ratio", "ratio", "x"),
            ],
        ),
    )


def _get(d: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def _runs(key: str) -> Callable[[dict], Any]:
    return lambda r: r.get(f"{key}_runs")


# ----- one renderer per benchmark: the tables of its figures ---------------------------------------


def render_loader(d: dict) -> list[str]:
    cols = [
        ("configuration", "label", ""),
        ("cells/s", "cells_per_s", ",.0f"),
        ("rounds (cells/s)", _runs("cells_per_s"), ",.0f"),
        ("cells/CPU-s", "cells_per_cpu_s", ",.0f"),
        ("window (s)", "seconds", ".1f"),
        ("peak RSS (MiB)", "peak_rss_mib", ",.0f"),
    ]
    rows = [r for r in d.get("rows", []) if "error" not in r]
    cold = d.get("cold") or {}
    return [
        *sub("Warm page cache", table([r for r in rows if not r.get("cold")], cols)),
        *sub("Cold page cache", table([r for r in rows if r.get("cold")], cols)),
        *([f"*{cold['window']}*", ""] if cold.get("window") and any(r.get("cold") for r in rows) else []),
        *comparisons(d),
        *sub(
            "Files' sequential-read limit (cold)",
            pairs(
                [
                    ("shards (MB/s)", _mb(cold.get("shards_sequential_bytes_per_s")), ",.0f"),
                    ("shards (cells/s)", cold.get("shards_sequential_cells_per_s"), ",.0f"),
                    ("h5ad (MB/s)", _mb(cold.get("h5ad_sequential_bytes_per_s")), ",.0f"),
                    ("dataset bytes per cell", cold.get("dataset_bytes_per_cell"), ",.0f"),
                ]
            ),
        ),
    ]


def _mb(v: float | None) -> float | None:
    return None if v is None else v / 1e6


def render_annbatch(d: dict) -> list[str]:
    rows = [r for r in d.get("rows", []) if "cells_per_s" in r]
    out = sub(
        "Per configuration (medians)",
        table(
            rows,
            [
                ("configuration", "label", ""),
                ("cells/s", "cells_per_s", ",.0f"),
                ("rounds (cells/s)", _runs("cells_per_s"), ",.0f"),
                ("cells/CPU-s", "cells_per_cpu_s", ",.0f"),
                ("cores busy", "cpu_per_wall", ".2f"),
                ("first batch (s)", "first_batch_s", ".2f"),
                ("first batch from process start (s)", "first_batch_from_spawn_s", ".2f"),
                ("peak RSS (MiB)", "peak_rss_bytes", "mib"),
                ("label entropy (bits)", "label_entropy_bits", ".3f"),
                ("window (s)", "seconds", ".1f"),
            ],
        ),
    )
    out += comparisons(d)
    ratio_rows = [{"tag": k, **v} for k, v in (d.get("ratios") or {}).items()]
    out += sub(
        "omicsio_jax ÷ annbatch",
        table(
            ratio_rows,
            [
                ("configuration", "tag", ""),
                ("cells/s", "cells_per_s", "x"),
                ("cells/CPU-s", "cells_per_cpu_s", "x"),
            ],
        ),
    )
    conv, mat, disk, cells = (
        d.get("annbatch_conversion") or {},
        d.get("omicsio_materialize") or {},
        d.get("disk_bytes") or {},
        d.get("num_cells"),
    )
    out += sub(
        "One-off conversion and size on disk",
        pairs(
            [
                ("annbatch conversion (s)", conv.get("seconds"), ",.1f"),
                ("annbatch conversion (cells/s)", conv.get("cells_per_s"), ",.0f"),
                ("annbatch conversion peak RSS (MiB)", conv.get("peak_rss_bytes"), "mib"),
                (
                    f"omicsio materialize (cells/s; {mat.get('source')}, {mat.get('commit')})" if mat else "",
                    mat.get("cells_per_s"),
                    ",.0f",
                ),  # fmt: skip
                ("omicsio dataset (bytes per cell)", _per(disk.get("omicsio_dataset"), cells), ",.0f"),
                (
                    "annbatch collection (bytes per cell)",
                    _per(disk.get("annbatch_collection"), cells),
                    ",.0f",
                ),
            ]
        ),
    )
    return out


def _per(total: float | None, n: float | None) -> float | None:
    return None if total is None or not n else total / n


def render_grain(d: dict) -> list[str]:
    return [
        *sub(
            "Per configuration (medians)",
            table(
                d.get("rows", []),
                [
                    ("configuration", "config", ""),
                    ("cells/s", "cells_per_s", ",.0f"),
                    ("rounds (cells/s)", _runs("cells_per_s"), ",.0f"),
                    ("× make_loader", "ratio_to_make_loader", "x"),
                    ("main-process cores", "main_process_cores", ".2f"),
                    ("window (s)", "seconds", ".1f"),
                ],
            ),
        ),
        *sub(
            "Checkpoints (medians)",
            pairs((k.replace("_", " "), v, ",.3g") for k, v in (d.get("checkpoint") or {}).items()),
        ),
    ]


def render_tokens(d: dict) -> list[str]:
    kernels = d.get("kernel_us_per_cell") or {}
    baseline = d.get("kernel_us_per_cell_baseline") or {}
    mat = d.get("materialize") or {}
    return [
        *sub(
            "Loaders (medians)",
            table(
                d.get("rows", []),
                [
                    ("configuration", "label", ""),
                    ("cells/s", "cells_per_s", ",.0f"),
                    ("rounds (cells/s)", _runs("cells_per_s"), ",.0f"),
                    ("window (s)", "seconds", ".1f"),
                ],
            ),
        ),
        *comparisons(d),
        *sub(
            "Kernel cost, one thread (µs per cell, medians)",
            table(
                [
                    {"kind": k, "us": v, "baseline": baseline.get(k)}
                    for k, v in kernels.items()
                    if not k.endswith("_runs")
                ],
                [("output", "kind", ""), ("this commit", "us", ".2f")]
                + ([("baseline checkout", "baseline", ".2f")] if baseline else []),
            ),
        ),
        *sub(
            "Materialize (cells/s, medians of whole conversions)",
            pairs((k.replace("_", " "), v.get("cells_per_s"), ",.0f") for k, v in mat.items()),
        ),
        *sub("Ratios", pairs((k, v, ".2f") for k, v in (d.get("ratios") or {}).items())),
    ]


def render_materialize(d: dict) -> list[str]:
    return sub(
        "Per corpus and input (medians)",
        table(
            d.get("rows", []),
            [
                ("cells", "num_cells", ",.0f"),
                ("input", "input", ""),
                ("cells/s", "cells_per_s", ",.0f"),
                ("rounds (cells/s)", _runs("cells_per_s"), ",.0f"),
                ("window (s)", "window_s", ".1f"),
                ("peak RSS (MiB)", "peak_rss_mib_max", ",.0f"),
                ("largest child (MiB)", "child_peak_rss_mib_max", ",.0f"),
                ("workers", "workers", ".0f"),
                ("dataset B/cell", "dataset_bytes_per_cell", ",.0f"),
                ("h5ad B/cell", "h5ad_bytes_per_cell", ",.0f"),
                ("parquet B/cell", "parquet_bytes_per_cell", ",.0f"),
            ],
        ),
    ) + comparisons(d)


def render_collection(d: dict) -> list[str]:
    runs = [{"what": k, **v} for k, v in d.get("materialize", {}).items()]
    loads = [{"what": k, **v} for k, v in d.get("load", {}).items()]
    return [
        *sub(
            "Materialize (medians)",
            table(
                runs,
                [
                    ("input", "what", ""),
                    ("cells", "num_cells", ",.0f"),
                    ("cells/s", "cells_per_s", ",.0f"),
                    ("rounds (cells/s)", _runs("cells_per_s"), ",.0f"),
                    ("window (s)", "seconds", ".1f"),
                    ("open (s a conversion)", "open_s", ".2f"),
                    ("the rest (s a conversion)", "rest_s", ".2f"),
                    ("peak RSS (MiB)", "peak_rss_mib_max", ",.0f"),
                    ("largest child (MiB)", "child_peak_rss_mib_max", ",.0f"),
                    ("workers", "workers", ".0f"),
                ],
            ),
        ),
        *sub(
            "Materialize: seconds a conversion (medians, and the differences of the medians)",
            pairs((name, value, ".2f") for name, value in d.get("materialize_split", {}).items()),
        ),
        *sub(
            "Loader (medians)",
            table(
                loads,
                [
                    ("loader", "what", ""),
                    ("cells/s", "cells_per_s", ",.0f"),
                    ("rounds (cells/s)", _runs("cells_per_s"), ",.0f"),
                    ("cells per CPU-s", "cells_per_cpu_s", ",.0f"),
                    ("window (s)", "seconds", ".1f"),
                ],
            ),
        ),
        *comparisons(d),
    ]


def render_ducklake(d: dict) -> list[str]:
    return [
        *table(
            d.get("rows", []),
            [
                ("input", "label", ""),
                ("cells", "num_cells", ",.0f"),
                ("cells/s", "cells_per_s", ",.0f"),
                ("rounds (cells/s)", _runs("cells_per_s"), ",.0f"),
                ("window (s)", "window_s", ".1f"),
                ("workers", "workers", ".0f"),
            ],
        ),
        f"DuckLake ÷ direct parquet: {fmt(d.get('ratio_ducklake_over_parquet'), '.3f')}; "
        f"the same shards from both: {d.get('same_shards')}.",
        "",
    ]


def render_scale(d: dict) -> list[str]:
    rows = [{"label": k, **v} for k, v in (d.get("rows") or {}).items()]
    return [
        *sub(
            "Per configuration (medians)",
            table(
                rows,
                [
                    ("configuration", "label", ""),
                    ("cells/s", "cells_per_s", ",.0f"),
                    ("rounds (cells/s)", _runs("cells_per_s"), ",.0f"),
                    ("window (s)", "window_s", ".1f"),
                    ("CPU-s per 10⁵ cells", "cpu_s_per_1e5_cells", ".2f"),
                    ("workers", "workers", ""),
                    ("partitions", "partitions", ""),
                ],
            ),
        ),
        *sub("Summary", pairs((k, v, ".3g") for k, v in (d.get("summary") or {}).items())),
        *sub("Machine probe", pairs((k, v, "") for k, v in (d.get("machine_probe") or {}).items())),
        *(
            [f"Rounds: {d['rounds']} of {d['rounds_asked']} asked. {d.get('derived_from', '')}".strip(), ""]
            if "rounds_asked" in d
            else []
        ),
    ]


def render_multimodal(d: dict) -> list[str]:
    loaders = [{"label": k, **v} for k, v in (d.get("summary") or {}).items()]
    return [
        *sub(
            "Materialize (medians)",
            table(
                d.get("materialize_summary", []),
                [
                    ("corpus", "label", ""),
                    ("cells/s", "cells_per_s", ",.0f"),
                    ("rounds (cells/s)", _runs("cells_per_s"), ",.0f"),
                    ("seconds", "seconds", ".1f"),
                    ("main peak RSS (MiB)", "main_peak_rss_mib", ",.0f"),
                    ("worker peak RSS (MiB)", "worker_peak_rss_mib", ",.0f"),
                ],
            ),
        ),
        *sub(
            "Loaders (medians)",
            table(
                loaders,
                [
                    ("loader", "label", ""),
                    ("cells/s", "cells_per_s", ",.0f"),
                    ("rounds (cells/s)", _runs("cells_per_s"), ",.0f"),
                    ("cells/CPU-s", "cells_per_cpu_s", ",.0f"),
                    ("kB read per cell", "read_per_cell_kb", ".2f"),
                    ("window (s)", "seconds", ".1f"),
                ],
            ),
        ),
        *pairs([("rna of multimodal ÷ rna alone", d.get("rna_of_multimodal_over_rna_alone"), "x")]),
        *sub(
            "Shards on disk (kB per cell)",
            pairs((k, v, ".2f") for k, v in (d.get("shard_kb_per_cell") or {}).items()),
        ),
    ]


def render_beyond_ram(d: dict) -> list[str]:
    disk = d.get("disk") or {}
    limits = [("sequential (cells/s)", disk.get("sequential_cells_per_s"), ",.0f")]
    limits += [
        (f"{k.replace('_', ' ')} (cells/s)", v.get("cells_per_s"), ",.0f")
        for k, v in disk.items()
        if k.startswith("random_") and isinstance(v, dict)
    ]
    limits.append(("random-read ceiling (cells/s)", disk.get("random_ceiling_cells_per_s"), ",.0f"))
    return [
        *pairs([("dataset (GB)", d.get("dataset_gb"), ".1f"), ("cells", d.get("cells"), ",.0f")]),
        *sub(
            "Per configuration (medians)",
            table(
                [r for r in d.get("rows", []) if "error" not in r],
                [
                    ("configuration", "config", ""),
                    ("cache", lambda r: "cold" if r.get("cold") else "warm", ""),
                    ("chunk reader", "chunk_reader", ""),
                    ("direct I/O", "direct_io", ""),
                    ("cells/s", "cells_per_s", ",.0f"),
                    ("rounds (cells/s)", _runs("cells_per_s"), ",.0f"),
                    ("of the disk's ceiling", "of_ceiling", ".2f"),
                    ("cores busy", "cores_busy", ".2f"),
                    ("longest wait (s)", "max_wait_s", ".2f"),
                    ("bytes read per cell", "bytes_read_per_cell", ",.0f"),
                    ("peak RSS (MiB)", "peak_rss_mib", ",.0f"),
                ],
            ),
        ),
        *sub("The disk's limits (medians)", pairs(limits)),
    ]


def render_first_batch(d: dict) -> list[str]:
    return sub(
        "Per reader, output and cache (medians)",
        table(
            d.get("summary", []),
            [
                ("configuration", "label", ""),
                ("first batch (s)", "first_batch_s", ".2f"),
                ("rounds (s)", _runs("first_batch_s"), ".2f"),
                ("lazy imports (s)", "lazy_imports_s", ".2f"),
                ("MB read", "read_mb", ",.1f"),
                ("shards touched", "shards_touched", ",.0f"),
                ("shards", "shards", ",.0f"),
            ],
        ),
    )


def render_startup(d: dict) -> list[str]:
    return [
        *sub(
            "Per loader and configuration (medians of fresh processes)",
            table(
                d.get("rows", []),
                [
                    ("configuration", "label", ""),
                    ("interpreter (s)", "interpreter_s", ".2f"),
                    ("imports (s)", "imports_s", ".2f"),
                    ("open (s)", "open_s", ".2f"),
                    ("first batch (s)", "first_batch_s", ".2f"),
                    ("from spawn (s)", "from_spawn_s", ".2f"),
                    ("processes (s from spawn)", _runs("from_spawn_s"), ".2f"),
                ],
            ),
        ),
        *comparisons(d),
    ]


def render_format(d: dict) -> list[str]:
    return sub(
        "Per group size and compression (medians)",
        table(
            d.get("rows", []),
            [
                ("group size", "group_size", ".0f"),
                ("compression", "compression", ""),
                ("bytes per cell", "bytes_per_cell", ",.0f"),
                ("write (cells/s)", "write_cells_per_s", ",.0f"),
                ("read blocks of 16 (cells/s)", "read_block16_cells_per_s", ",.0f"),
                ("read single cells (cells/s)", "read_single_cells_per_s", ",.0f"),
            ],
        ),
    )


def render_grid(d: dict) -> list[str]:
    return [
        *sub(
            "Per setting",
            table(
                d.get("rows", []),
                [
                    ("sampling", "label", ""),
                    ("cells/s", "cells_per_s", ",.0f"),
                    ("rounds (cells/s)", _runs("cells_per_s"), ",.0f"),
                    ("entropy (bits)", "entropy_mean", ".3f"),
                    ("± std", "entropy_std", ".3f"),
                    ("lower bound", "lower", ".3f"),
                    ("upper bound", "upper", ".3f"),
                ],
            ),
        ),
        *sub("Summary", pairs((k.replace("_", " "), v, ".3g") for k, v in (d.get("summary") or {}).items())),
    ]


def render_tune(d: dict) -> list[str]:
    timed = [r for r in d.get("table", []) if "verify_cells_per_s" in r]
    return [
        *pairs(
            [
                ("chosen", d.get("chosen_label"), ""),
                ("best measured", d.get("best_label"), ""),
                ("chosen ÷ best", d.get("chosen_over_best"), "x"),
                ("chosen entropy ÷ true random's", d.get("chosen_entropy_ratio"), ".4f"),
            ]
        ),
        *sub(
            "Settings timed again (medians)",
            table(
                timed,
                [
                    ("setting", "label", ""),
                    ("entropy ÷ true random's", "entropy_ratio", ".4f"),
                    ("tune's cells/s", "cells_per_s", ",.0f"),
                    ("cells/s", "verify_cells_per_s", ",.0f"),
                    ("rounds (cells/s)", "verify_cells_per_s_runs", ",.0f"),
                    ("cells/CPU-s", "verify_cells_per_cpu_s", ",.0f"),
                ],
            ),
        ),
    ]


def render_layout(d: dict) -> list[str]:
    return [
        *pairs([("usable cores", d.get("cores"), "")]),
        *sub(
            "Settings (medians)",
            table(
                d.get("rows", []),
                [
                    ("setting", "label", ""),
                    ("make_loader's default", lambda r: "yes" if r.get("is_default") else "", ""),
                    ("decode threads", "decode_threads", ""),
                    ("cells/s", "cells_per_s", ",.0f"),
                    ("rounds (cells/s)", "cells_per_s_runs", ",.0f"),
                    ("cells/CPU-s", "cells_per_cpu_s", ",.0f"),
                    ("window (s)", "seconds", ".1f"),
                ],
            ),
        ),
    ]


def render_gpu(d: dict) -> list[str]:
    return [
        *pairs(
            [
                ("device", d.get("device_kind"), ""),
                ("host→device, one device_put stream (GB/s)", d.get("host_to_device_GB_per_s"), ".1f"),
                *((k, v, ".2f") for k, v in (d.get("summary") or {}).items()),
                ("csr slab capacity (entries)", d.get("slab_capacity"), ",d"),
                (
                    "padding in the densified slab (fraction of its entries)",
                    d.get("slab_padding_fraction"),
                    ".3f",
                ),
                *((f"machine probe: {k}", v, "") for k, v in (d.get("machine_probe") or {}).items()),
                ("note", d.get("commit_note"), ""),
            ]
        ),
        *sub(
            "Per path (medians)",
            table(
                d.get("rows", []),
                [
                    ("path", "label", ""),
                    ("cells/s", "cells_per_s", ",.0f"),
                    ("rounds (cells/s)", _runs("cells_per_s"), ",.0f"),
                ],
            ),
        ),
    ]


def render_query(d: dict) -> list[str]:
    stages = [{"name": k.replace("_", " "), **v} for k, v in (d.get("stages") or {}).items()]
    lookups = [{"name": k.replace("_", " "), **v} for k, v in (_get(d, "index", "lookups") or {}).items()]
    loaders = {k: v for k, v in (d.get("loaders_cells_per_s") or {}).items() if not k.endswith("_runs")}
    return [
        *sub(
            "Query stages (median seconds)",
            table(stages, [("stage", "name", ""), ("seconds", "seconds", ".3f"), ("cells", "cells", ",.0f")]),
        ),
        *sub(
            "Gene lookup: scan against index (median seconds)",
            table(
                lookups,
                [
                    ("gene", "name", ""),
                    ("cells", "cells", ",.0f"),
                    ("scan (s)", "scan_s", ".3f"),
                    ("index (s)", "index_s", ".3f"),
                    ("speed-up", "speedup", "x"),
                ],
            ),
        ),
        *sub("Loaders (medians)", pairs((k.replace("_", " "), v, ",.3g") for k, v in loaders.items())),
    ]


def render_s3(d: dict) -> list[str]:
    cold = [d[k] for k in ("cold_block", "cold_block_fetch8", "cold_random") if isinstance(d.get(k), dict)]
    return [
        *sub(
            "Empty cache: one epoch",
            table(
                cold,
                [
                    ("run", "label", ""),
                    ("block", "block_size", ".0f"),
                    ("fetch factor", "fetch_factor", ".0f"),
                    ("cells/s", "cells_per_s", ",.0f"),
                    ("seconds", "seconds", ".1f"),
                    ("fetched ÷ needed", "fetched_over_needed", ".4f"),
                    ("GETs per fetch", "gets_per_fetch", ".1f"),
                ],
            ),
        ),
        *sub(
            "Warm cache against local disk (medians)",
            table(
                d.get("warm", []),
                [
                    ("output", "output", ""),
                    ("local (cells/s)", "local_cells_per_s", ",.0f"),
                    ("S3 (cells/s)", "s3_cells_per_s", ",.0f"),
                    ("S3 ÷ local", "ratio", "x"),
                ],
            ),
        ),
    ]


def render_s3_query(d: dict) -> list[str]:
    med = d.get("median_seconds") or {}
    queries = list(dict.fromkeys(q for v in med.values() for q in v))
    rows = [{"route": route, **v} for route, v in med.items()]
    return sub(
        "Median seconds per query",
        table(rows, [("route", "route", ""), *[(q, q, ".3f") for q in queries]]),
    )


def render_normalize(d: dict) -> list[str]:
    return [
        *sub(
            "Per placement of the normalization (medians)",
            table(
                d.get("rows", []),
                [
                    ("normalization", "label", ""),
                    ("median step (ms)", "median_step_ms", ".1f"),
                    ("rounds (ms)", _runs("median_step_ms"), ".1f"),
                    ("data wait", "data_wait_fraction", "%"),
                    ("window (s)", "window_s", ".1f"),
                ],
            ),
        ),
        *pairs([("step time, on device ÷ fused", d.get("step_ms_ratio_on_device_over_fused"), "x")]),
    ]


def render_plan_memory(d: dict) -> list[str]:
    return table(
        d.get("results", []),
        [
            ("rows held as", "variant", ""),
            ("peak RSS (MiB)", "peak_rss_mib", ",.0f"),
            ("seconds", "seconds", ".2f"),
        ],
    )


def render_pretrain(d: dict) -> list[str]:
    if "runs" not in d:  # the single-probe files of earlier versions
        items = [
            ("tokens", d.get("tokens"), ""),
            ("steps", d.get("steps"), ",.0f"),
            ("first loss", d.get("first_loss"), ".3f"),
            ("last loss", d.get("last_loss"), ".3f"),
            ("median step (s)", d.get("median_step_s"), ".3f"),
            ("data wait", d.get("data_wait_fraction"), "%"),
            ("chance", d.get("chance"), ".3f"),
        ]
        for probe in ("probe_cls", "probe_mean_pool"):
            for model, acc in (d.get(probe) or {}).items():
                items.append((f"{probe.replace('_', ' ')} accuracy, {model.replace('_', ' ')}", acc, ".3f"))
        items.append(("probe on log1p expression", _get(d, "probe_log1p_expression"), ".3f"))
        return pairs(items)
    out = pairs(
        [
            ("steps", d.get("steps"), ",.0f"),
            ("batch size", d.get("batch_size"), ",.0f"),
            ("max_len", d.get("max_len"), ",.0f"),
            ("probe on log1p expression", d.get("probe_log1p_expression"), ".3f"),
        ]
    )
    for run in d["runs"]:
        name = run["tokens"]
        out += sub(
            f"{name}: {run['train_seconds']:.0f} s of training, median step {run['median_step_s']:.3f} s, "
            f"probe gain {run['probe_gain_points']:+.1f} points",
            table(
                run["points"],
                [
                    ("step", "step", ",.0f"),
                    ("linear probe", "probe", ".3f"),
                    ("mean-pooled probe", "probe_mean_pool", ".3f"),
                    ("masked accuracy", lambda p: p["masked"]["accuracy"], ".4f"),
                    ("frequency baseline", lambda p: p["masked"]["baseline"], ".4f"),
                    ("masked MSE", lambda p: p["masked"].get("mse"), ".1f"),
                    ("baseline MSE", lambda p: p["masked"].get("baseline_mse"), ".1f"),
                ],
            ),
        )
        models = _get(run, "finetune", "models") or {}
        out += sub(
            f"{name}: fine-tuned on the held-out plate",
            table(
                [{"model": k, **v} for k, v in models.items()],
                [("model", "model", ""), ("accuracy", "accuracy", ".4f"), ("macro-F1", "macro_f1", ".4f")],
            ),
        )
    return out


def render_train(d: dict) -> list[str]:
    out: list[str] = []
    for part in d.get("synthetic") or []:
        out += sub(
            f"Synthetic corpus, {_get(part, 'setup', 'corpus')}: held-out plate",
            table(
                part.get("runs", []),
                [
                    ("label", "label", ""),
                    ("strategy", "strategy", ""),
                    ("macro-F1", "macro_f1", ".4f"),
                    ("accuracy", "accuracy", ".4f"),
                    ("cells/s", "cells_per_s", ",.0f"),
                    ("data wait", "data_wait_fraction", "%"),
                    ("batch entropy (bits)", lambda r: _get(r, "batch_entropy", "mean_bits"), ".2f"),
                ],
            ),
        )
    out += sub(
        "Real data against scikit-learn",
        table(
            _get(d, "pbmc", "rows") or [],
            [
                ("method", "method", ""),
                ("epochs", "epochs", ""),
                ("accuracy", "accuracy", ".4f"),
                ("macro-F1", "macro_f1", ".4f"),
            ],
        ),
    )
    return out


def render_soak(d: dict) -> list[str]:
    flipped = d.get("flipped") or {}
    killed, recovered = d.get("workers_killed") or [], d.get("worker_kills_recovered") or []
    return pairs(
        [
            ("passed", d.get("passed"), ""),
            ("minutes", (d.get("seconds") or 0) / 60, ".1f"),
            ("hosts", d.get("hosts"), ""),
            ("batches, each equal to the fault-free run's", d.get("batches"), ","),
            ("of them served again after a restore", d.get("replayed_after_restores"), ","),
            ("mismatching batches", d.get("mismatches"), ","),
            ("epochs audited (each cell exactly once)", d.get("epochs_audited"), ","),
            ("Grain workers SIGKILLed", sum(killed) if killed else None, ","),
            ("of them recovered from the Orbax checkpoint", sum(recovered) if recovered else None, ","),
            ("SIGTERMs", d.get("sigterms"), ","),
            ("resumes from the Orbax checkpoint after SIGTERM", (d.get("orbax_resumes") or [None])[0], ","),
            ("Grain workers left running after their host exited", d.get("grain_workers_left_running"), ","),
            ("requests through the proxy", d.get("requests"), ","),
            *[(f"faults injected: {k}", v, ",") for k, v in sorted((d.get("faults_injected") or {}).items())],
            ("one-line errors surfaced, then restored and resumed", d.get("surfaced_and_resumed"), ","),
            ("crashes", len(d.get("errors") or []), ","),
            ("flipped cached byte read back exactly", flipped.get("read_back_exact"), ""),
            ("RSS once warm (MiB)", (d.get("rss_warm_bytes") or 0) / 2**20, ",.0f"),
            ("RSS growth once warm (median of the last fifth over the second's)", d.get("rss_growth"), "%"),
            ("RSS peak over the warm median", d.get("rss_peak_over_warm"), "%"),
        ]
    )


def render_generic(d: dict) -> list[str]:
    """A file of an unknown benchmark: its rows' median figures (keys with ``_runs`` beside them)."""
    rows = [r for r in d.get("rows", []) if isinstance(r, dict)] if isinstance(d.get("rows"), list) else []
    keys = list(dict.fromkeys(k for r in rows for k in r if f"{k}_runs" in r))
    return [
        *table(rows, [("row", "label", ""), *[(k.replace("_", " "), k, "") for k in keys]]),
        *comparisons(d),
    ]


RENDERERS: dict[str, Callable[[dict], list[str]]] = {
    "bench_loader": render_loader,
    "bench_annbatch": render_annbatch,
    "bench_grain": render_grain,
    "soak": render_soak,
    "bench_tokens": render_tokens,
    "bench_collection": render_collection,
    "bench_ducklake": render_ducklake,
    "bench_materialize": render_materialize,
    "bench_scale": render_scale,
    "bench_multimodal": render_multimodal,
    "bench_beyond_ram": render_beyond_ram,
    "bench_first_batch": render_first_batch,
    "bench_startup": render_startup,
    "bench_format": render_format,
    "bench_grid": render_grid,
    "bench_tune": render_tune,
    "bench_layout": render_layout,
    "bench_gpu": render_gpu,
    "bench_query": render_query,
    "bench_s3": render_s3,
    "bench_s3_query": render_s3_query,
    "bench_normalize": render_normalize,
    "bench_plan_memory": render_plan_memory,
    "bench_pretrain": render_pretrain,
    "bench_train": render_train,
}

# ----- which files are quoted ---------------------------------------------------------------------


def has_provenance(d: Any) -> bool:
    """Command, date, commit and machine (with its CPU and cores) all present."""
    if not isinstance(d, dict):
        return False
    m = d.get("machine")
    return (
        all(isinstance(d.get(k), str) and d[k] for k in ("command", "date", "commit"))
        and isinstance(m, dict)
        and bool(m.get("cpu"))
        and bool(m.get("cores"))
    )


def load(results: Path) -> tuple[list[tuple[str, dict]], list[str]]:
    """``(quoted, not_quoted)``: the results files with complete provenance (name, contents) in
    report order, and the names of every other file of results (the archive's included)."""
    quoted, not_quoted = [], []
    for path in sorted(results.glob("*.json")):
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            d = None
        if has_provenance(d) and not d.get("quick"):
            quoted.append((path.name, d))
        else:
            not_quoted.append(path.name)
    archive = results / ARCHIVE_NAME
    if archive.is_dir():
        not_quoted += [f"{ARCHIVE_NAME}/{p.name}" for p in sorted(archive.iterdir()) if p.is_file()]

    def rank(item: tuple[str, dict]) -> tuple[int, str, str]:
        bench = str(item[1].get("benchmark") or Path(item[0]).stem)
        return (ORDER.index(bench) if bench in ORDER else len(ORDER), bench, item[0])

    return sorted(quoted, key=rank), not_quoted


def machine_line(m: dict) -> str:
    parts = [str(m["cpu"])]
    cores = f"{m['cores']} cores"
    if m.get("usable_cores") and m.get("usable_cores") != m["cores"]:
        cores += f" ({m['usable_cores']} usable)"
    parts.append(cores)
    if m.get("memory_gib"):
        parts.append(f"{m['memory_gib']:g} GiB RAM")
    parts.append(m.get("gpu") or "no GPU")
    if m.get("l3_cache_mib"):
        parts.append(f"{m['l3_cache_mib']:g} MiB L3")
    line = ", ".join(parts)
    if m.get("copy_gb_s"):  # `_provenance.memory_probe`
        rates = ", ".join(f"{size} {rate:g}" for size, rate in m["copy_gb_s"].items())
        line += f"; one core's copy rate, GB/s: {rates}"
    return line


def timing_line(d: dict) -> str | None:
    rounds, window = d.get("rounds"), d.get("window_s")
    if rounds is None and window is None:
        return None
    bits = []
    if rounds is not None:
        bits.append("one run" if rounds == 1 else f"medians of {rounds} rounds")
    if window is not None:
        bits.append(f"timed windows of at least {window:g} s")
    if d.get("window"):
        bits.append(str(d["window"]))
    return "; ".join(bits)


def section(name: str, d: dict) -> list[str]:
    bench = str(d.get("benchmark") or Path(name).stem)
    title, description = DESCRIPTIONS.get(bench, (bench, ""))
    lines = [f"## {title} (`{name}`)", ""]
    if description:
        lines += [description, ""]
    lines += [
        f"- Command: `{d['command']}`",
        f"- Date: {d['date']}; commit `{d['commit']}`",
        f"- Machine: {machine_line(d['machine'])}",
    ]
    if timing := timing_line(d):
        lines.append(f"- Timing: {timing}")
    lines.append("")
    lines += RENDERERS.get(bench, render_generic)(d)
    return lines


def benchmarks_readme(quoted: list[tuple[str, dict]], not_quoted: list[str]) -> str:
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python benchmarks/report.py` from benchmarks/results/*.json: do not edit. -->",
        "",
        "Every figure below is printed from a results file in `benchmarks/results/` that records the "
        "command, date, commit and machine it came from. Throughput figures are medians of rounds, each "
        "round timing a window of at least the minimum set in `benchmarks/_provenance.py` after a warm-up; "
        "the rounds' own values sit beside the medians.",
        "",
        "Regenerate with `python benchmarks/report.py` after a run; `python benchmarks/report.py --check` "
        "fails when this page or README.md's block is out of date.",
        "",
    ]
    if not quoted:
        lines += ["No results file with complete provenance yet.", ""]
    for name, d in quoted:
        lines += section(name, d)
    lines += ["## Results not quoted here", ""]
    if not_quoted:
        lines += [
            "No figure of these files is printed on this page: those in `results/` lack the command, date, "
            "commit or machine of their run (or are smoke runs), and those in `results/archive/` are earlier "
            "runs, some with that provenance and some without; where the guides quote one, they name it.",
            "",
            *[f"- `results/{n}`" for n in not_quoted],
            "",
        ]
    else:
        lines += ["None.", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


# ----- README.md's headline block -----------------------------------------------------------------


def short_commit(commit: str) -> str:
    """A commit's short hash, with ``+dirty`` kept where the tree held uncommitted changes."""
    return str(commit)[:7] + ("+dirty" if str(commit).endswith("+dirty") else "")


def headlines(quoted: list[tuple[str, dict]]) -> list[dict]:
    """Loader cells/s against annbatch and scDataset, materialize cells/s and token batches, from the
    quoted files that have them."""
    by = {d.get("benchmark"): (name, d) for name, d in quoted}
    rows = []

    def machine(d: dict) -> str:
        m = d["machine"]
        return f"{m['cpu']}, {m['cores']} cores" + (f", {m['gpu']}" if m.get("gpu") else "")

    def against_peer(c: dict) -> bool:  # not a comparison of this code with an earlier commit's
        return " @ " not in c.get("ours", "") and "this commit" not in c["what"]

    def add_comparisons(bench: str, keep: Callable[[dict], bool]) -> None:
        for name, d in quoted:
            if d.get("benchmark") != bench:
                continue
            for c in d.get("comparisons") or []:
                if keep(c) and against_peer(c):
                    rows.append({"what": c["what"], "ours": c["ours_value"], "peer": c["peer_value"],
                                 "ratio": c["ratio"], "machine": machine(d), "source": name,
                                 "when": f"{d['date']}, {short_commit(d['commit'])}"})  # fmt: skip

    add_comparisons(
        "bench_annbatch", lambda c: "ReadOptions" not in c["what"] and "sampling=" not in c["what"]
    )
    add_comparisons("bench_loader", lambda c: "scDataset" in c["what"])
    add_comparisons("bench_materialize", lambda c: True)
    if "bench_materialize" in by:
        name, d = by["bench_materialize"]
        sizes = [r.get("num_cells") or 0 for r in d.get("rows", [])]
        for r in d.get("rows", []):
            if sizes and r.get("num_cells") == max(sizes):
                rows.append({"what": f"materialize {r['num_cells']:,} cells from {r['input']} (cells/s)",
                             "ours": r.get("cells_per_s"), "peer": None, "ratio": None, "machine": machine(d),
                             "source": name, "when": f"{d['date']}, {short_commit(d['commit'])}"})  # fmt: skip
    if "bench_tokens" in by:
        name, d = by["bench_tokens"]
        if d.get("comparisons"):
            add_comparisons("bench_tokens", lambda c: True)
        else:
            csr = {
                (r["batch_size"], r.get("num_threads")): r
                for r in d.get("rows", [])
                if r.get("kind") == "csr"
            }
            for r in d.get("rows", []):
                peer = csr.get((r["batch_size"], r.get("num_threads")))
                if r.get("kind") in ("geneformer", "scgpt") and peer:
                    setting = "" if r.get("num_threads") is None else f", num_threads={r['num_threads']}"
                    rows.append({"what": f"{r['kind']} tokens b{r['batch_size']}{setting}: tokens ÷ csr batches (cells/s)",
                                 "ours": r.get("cells_per_s"), "peer": peer.get("cells_per_s"),
                                 "ratio": r["cells_per_s"] / peer["cells_per_s"], "machine": machine(d),
                                 "source": name, "when": f"{d['date']}, {short_commit(d['commit'])}"})  # fmt: skip
    return rows


def readme_block(quoted: list[tuple[str, dict]]) -> str:
    rows = headlines(quoted)
    if not rows:
        return NO_HEADLINES
    lines = table(
        rows,
        [
            ("measured", "what", ""),
            ("omicsio_jax (cells/s)", "ours", ",.0f"),
            ("peer (cells/s)", "peer", ",.0f"),
            ("ratio", "ratio", "x"),
            ("machine", "machine", ""),
            ("date, commit", "when", ""),
            ("results file", lambda r: f"`benchmarks/results/{r['source']}`", ""),
        ],
    )
    return "\n".join([*lines, "Medians; commands, dates, commits and every other figure: "
                      "[benchmarks/README.md](benchmarks/README.md)."])  # fmt: skip


def fill_block(text: str, block: str, path: Path) -> str:
    lines = text.splitlines(keepends=True)
    begins = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise SystemExit(f"report.py: {path} needs one line {BEGIN} and, after it, one line {END}")
    return "".join([*lines[: begins[0] + 1], block + "\n", *lines[ends[0] :]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--check", action="store_true", help="exit 1 if a generated file is out of date; write nothing"
    )
    p.add_argument(
        "--results", type=Path, default=RESULTS, help="the results folder (default benchmarks/results)"
    )
    p.add_argument(
        "--out", type=Path, default=HERE / "README.md", help="the page to write (benchmarks/README.md)"
    )
    p.add_argument("--readme", type=Path, default=ROOT / "README.md", help="the README whose block to fill")
    args = p.parse_args(argv)
    quoted, not_quoted = load(args.results)
    page = benchmarks_readme(quoted, not_quoted)
    if not args.readme.exists():
        raise SystemExit(f"report.py: {args.readme} does not exist")
    readme_now = args.readme.read_text()
    readme = fill_block(readme_now, readme_block(quoted), args.readme)
    page_now = args.out.read_text() if args.out.exists() else None
    stale = [str(path) for path, new, now in ((args.out, page, page_now), (args.readme, readme, readme_now))
             if new != now]  # fmt: skip
    if args.check:
        if stale:
            print(
                f"report.py --check: out of date: {', '.join(stale)}; run python benchmarks/report.py",
                file=sys.stderr,
            )
            return 1
        return 0
    if page != page_now:
        args.out.write_text(page)
    if readme != readme_now:
        args.readme.write_text(readme)
    print(
        f"{len(quoted)} results file(s) quoted, {len(not_quoted)} not; wrote {', '.join(stale) or 'nothing (up to date)'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
