"""First batch from process start: omicsio_jax against annbatch, in fresh processes, warm page cache.

What a training script waits for before its first step: the interpreter's start, the imports, opening
the data and the first batch. Same 200k-cell corpus as ``bench_annbatch.py`` (our dataset
``ds_200k``, annbatch's collection ``annbatch_200k``, made there on first use), the same two
configurations (dense batch 64, csr batch 1,024) and the same loaders:

- omicsio_jax: ``import jax; import omicsio_jax as oj`` (``imports_s``), ``oj.open_dataset``
  (``open_s``), then ``oj.make_loader(ds, batch_size=B, output=..., sampling=oj.Block(16, 64),
  obs=("batch",), seed=0)`` at its defaults otherwise, ``next(iter(loader))`` and
  ``jax.block_until_ready`` (``first_batch_s``: Grain, Orbax and numba, which ``import omicsio_jax``
  defers to first use, are loaded inside it).
- annbatch 0.3.1 in ``.venv-annbatch`` (``_annbatch_peer.py first``): its imports (annbatch,
  anndata, zarr with zarrs' codec pipeline, ``imports_s``), then ``DatasetCollection`` + ``Loader``
  as in ``bench_annbatch.py`` and its first batch (densified by scipy for dense,
  ``first_batch_s``); nothing is checked or read before.

``interpreter_s`` is from just before the parent starts the process to the child's first line;
``from_spawn_s`` from then to the first batch ready (``time.time()`` on both sides). Every
configuration runs ``--processes`` fresh processes per loader, alternating between the two (a slow
spell of the shared machine hits both), after one discarded process each that warms the page cache;
the report quotes medians. Python modules are byte-compiled first (``compileall`` over
``omicsio_jax``), as an installed wheel is: an editable install under ``PYTHONDONTWRITEBYTECODE``
would otherwise compile every module of ours from source in every process, while annbatch's
site-packages were compiled by pip.

    scripts/setup-annbatch.sh
    .venv/bin/python benchmarks/bench_startup.py                 # writes results/startup.json
"""

from __future__ import annotations

import argparse
import compileall
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _provenance import compare, provenance, write_result  # noqa: E402
from bench_annbatch import ANNBATCH_PYTHON, CONFIGS, DATA, LABEL, PEER, ensure_data  # noqa: E402

PHASES = ("interpreter_s", "imports_s", "open_s", "first_batch_s", "from_spawn_s")

OURS = """
import time
started_at = time.time()
import json, sys
spawned_at, path, output, batch_size, label = float(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
import jax
import omicsio_jax as oj
imported_at = time.time()
start = time.perf_counter()
ds = oj.open_dataset(path)
opened = time.perf_counter()
loader = oj.make_loader(ds, batch_size=batch_size, output=oj.CSR() if output == "csr" else oj.Dense(),
                        sampling=oj.Block(16, 64), obs=(label,), seed=0)
jax.block_until_ready(next(iter(loader)))
done = time.perf_counter()
done_at = time.time()
print(json.dumps({"interpreter_s": started_at - spawned_at, "imports_s": imported_at - started_at,
                  "open_s": opened - start, "first_batch_s": done - opened, "from_spawn_s": done_at - spawned_at,
                  "loader": repr(loader), "omicsio_jax_version": oj.__version__, "jax_version": jax.__version__}))
loader.close()
"""


def _spawn(command: list[str]) -> dict:
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(command[:3])} ... failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ours(dataset: Path, output: str, batch_size: int) -> dict:
    return _spawn(
        [sys.executable, "-c", OURS, repr(time.time()), str(dataset), output, str(batch_size), LABEL]
    )


def annbatch(collection: Path, output: str, batch_size: int) -> dict:
    args = ["first", str(collection), "--output", output, "--batch-size", str(batch_size), "--label", LABEL]
    return _spawn([str(ANNBATCH_PYTHON), str(PEER), *args, "--spawned-at", repr(time.time())])


def summarize(label: str, runs: list[dict]) -> dict:
    """Medians of each phase (``open_s`` is part of annbatch's ``first_batch_s``), every run's too."""
    row = {k: v for k, v in runs[0].items() if k not in PHASES}
    row["label"], row["processes"] = label, len(runs)
    for phase in PHASES:
        values = [r[phase] for r in runs if r.get(phase) is not None]
        if values:
            row[phase], row[f"{phase}_runs"] = statistics.median(values), values
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=5, help="fresh processes per loader and configuration")
    p.add_argument("--dataset", type=Path, default=DATA / "ds_200k")
    p.add_argument("--collection", type=Path, default=DATA / "annbatch_200k")
    p.add_argument("--corpus", type=Path, default=DATA / "corpus_200k")
    p.add_argument("--quick", action="store_true", help="one process each; results to a temporary folder")
    p.add_argument("--out", type=Path, default=HERE / "results" / "startup.json")
    args = p.parse_args()
    if args.processes < 1:
        p.error("--processes must be ≥ 1")
    if not ANNBATCH_PYTHON.exists():
        raise SystemExit(f"{ANNBATCH_PYTHON} is missing: run scripts/setup-annbatch.sh first")
    dataset, collection = args.dataset.resolve(), args.collection.resolve()
    ensure_data(args.corpus.resolve(), dataset, collection, 0)
    compileall.compile_dir(ROOT / "omicsio_jax", quiet=1)
    processes = 1 if args.quick else args.processes
    rows, comparisons = [], []
    for output, bs in CONFIGS:
        ours(dataset, output, bs), annbatch(collection, output, bs)  # page cache, numba's cache: warm
        mine: list[dict] = []
        theirs: list[dict] = []
        for i in range(processes):
            for side in ("ours", "annbatch") if i % 2 == 0 else ("annbatch", "ours"):
                if side == "ours":
                    mine.append(ours(dataset, output, bs))
                else:
                    theirs.append(annbatch(collection, output, bs))
            print(f"{output} b{bs} [{i + 1}/{processes}] omicsio {mine[-1]['from_spawn_s']:.2f} s, "
                  f"annbatch {theirs[-1]['from_spawn_s']:.2f} s from spawn", flush=True)  # fmt: skip
        a = summarize(f"omicsio {output} b{bs}", mine)
        b = summarize(f"annbatch {output} b{bs}", theirs)
        rows += [a, b]
        comparisons += [
            compare(f"{output} b{bs} first batch from spawn: omicsio ÷ annbatch (seconds; lower is better)",
                    a, b, "from_spawn_s"),
            compare(f"{output} b{bs} imports: omicsio ÷ annbatch (seconds)", a, b, "imports_s"),
        ]  # fmt: skip
    result = {
        "benchmark": "bench_startup", **provenance(), "processes": processes, "quick": args.quick,
        "dataset": str(dataset), "collection": str(collection), "label": LABEL, "page_cache": "warm",
        "bytecode": "compiled (compileall) before the runs", "rows": rows, "comparisons": comparisons,
    }  # fmt: skip
    write_result(args.out, result, quick=args.quick)
    for r in rows:
        phases = "  ".join(f"{k.removesuffix('_s')} {r[k]:.2f}" for k in PHASES if k in r)
        print(f"{r['label']:24s} {phases}")


if __name__ == "__main__":
    main()
