"""DuckDB over parquet on S3: three ways to let DuckDB read ``s3://``, on the same objects, one run.

Starts moto's S3 server on 127.0.0.1, uploads a corpus's ``cells.parquet`` and times three queries
(medians of ``--repeats``) through:

- ``obstore-fsspec`` (what omicsio_jax does): obstore as an fsspec filesystem registered in DuckDB
  2.x (`omicsio_jax.storage.input_files.register_s3`), with `PositionalFile` reads;
- ``pyarrow-dataset``: a ``pyarrow.dataset`` on pyarrow's own ``S3FileSystem``, registered in DuckDB
  as a view (the other version-independent route);
- ``httpfs``: DuckDB's own extension, loaded from its PyPI package file — it exists only for
  DuckDB 1.5.5, so it runs in ``.venv-httpfs`` (``scripts/setup-httpfs.sh``), a separate process;
- ``local``: the same file on local disk, for reference.

Queries: ``scalar`` (count of lung cells: two small columns), ``list`` (cells expressing one gene:
the gene-id lists), ``stream`` (every cell's id, gene ids and values as Arrow batches: what
materialize reads). Latencies of whole queries: each is the median of ``--repeats`` runs.

    scripts/setup-httpfs.sh
    .venv/bin/python benchmarks/bench_s3_query.py --cells 200000 --repeats 3
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
HTTPFS_PYTHON = ROOT / ".venv-httpfs" / "bin" / "python"
sys.path.insert(0, str(HERE))
from _local_s3 import start_moto  # noqa: E402
from _provenance import add_window_options, check_window, provenance, write_result  # noqa: E402

QUERIES = {
    "scalar": "SELECT count(*) FROM {src} WHERE tissue = 'lung'",
    "list": "SELECT count(*) FROM {src} WHERE list_contains(gene_token_id, 1234)",
    "stream": "SELECT cell_id, gene_token_id, gene_expression FROM {src}",
}


def _time(con, name: str, sql: str, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        rel = con.sql(sql)
        if name == "stream":
            for _ in rel.to_arrow_reader(8192):
                pass
        else:
            rel.fetchall()
        times.append(time.perf_counter() - start)
    return times


_HTTPFS = (
    """
import glob, json, os, statistics, sys, time
import duckdb
ext = glob.glob(os.path.join(os.path.dirname(__import__("duckdb_extension_httpfs").__file__), "extensions", "**",
                             "*.duckdb_extension"), recursive=True)[0]
con = duckdb.connect(config={"allow_unsigned_extensions": True})
con.execute(f"LOAD '{ext}'")
con.execute("SET enable_progress_bar = false")  # stdout is the JSON line alone
endpoint = os.environ["AWS_ENDPOINT_URL"].removeprefix("http://")
con.execute(f"CREATE SECRET (TYPE s3, KEY_ID 'testing', SECRET 'testing', REGION 'us-east-1', ENDPOINT '{endpoint}', "
            "URL_STYLE 'path', USE_SSL false)")
queries, url, repeats = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
"""
    + inspect.getsource(_time)
    + """
out = {name: _time(con, name, sql.format(src=f"read_parquet('{url}')"), repeats) for name, sql in queries.items()}
print(json.dumps({"duckdb": duckdb.__version__, "times": out}))
"""
)


def main() -> None:
    from bench_materialize import corpus_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", type=int, default=200_000)
    add_window_options(p, seconds=None, rounds_flag="--repeats")
    p.add_argument("--out", default=str(HERE / "results" / "s3_query.json"))
    args = p.parse_args()
    check_window(args, rounds_attr="repeats", rounds_flag="--repeats")
    parquet = corpus_dir(args.cells) / "cells.parquet"

    server, _ = start_moto()
    import boto3
    import duckdb
    import pyarrow.dataset as pads
    import pyarrow.fs as pafs

    from omicsio_jax.storage.input_files import register_s3
    from omicsio_jax.storage.store import S3Store

    boto3.client("s3").create_bucket(Bucket="bench")
    S3Store("s3://bench").upload(parquet.parent, [parquet.name])
    url = f"s3://bench/{parquet.name}"
    results: dict[str, dict[str, list[float]]] = {}

    con = duckdb.connect()
    results["local"] = {
        n: _time(con, n, q.format(src=f"read_parquet('{parquet}')"), args.repeats) for n, q in QUERIES.items()
    }
    con = duckdb.connect()
    register_s3(con)
    results["obstore-fsspec"] = {
        n: _time(con, n, q.format(src=f"read_parquet('{url}')"), args.repeats) for n, q in QUERIES.items()
    }
    s3fs = pafs.S3FileSystem(
        endpoint_override=os.environ["AWS_ENDPOINT_URL"],
        scheme="http",
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
    )
    con = duckdb.connect()
    con.register("cells_ds", pads.dataset(f"bench/{parquet.name}", filesystem=s3fs, format="parquet"))
    results["pyarrow-dataset"] = {
        n: _time(con, n, q.format(src="cells_ds"), args.repeats) for n, q in QUERIES.items()
    }
    httpfs_version = None
    if HTTPFS_PYTHON.exists():
        proc = subprocess.run(
            [HTTPFS_PYTHON, "-c", _HTTPFS, json.dumps(QUERIES), url, str(args.repeats)],
            capture_output=True,
            text=True,
            env=os.environ,
        )
        if proc.returncode:
            raise RuntimeError(f"the httpfs peer failed:\n{proc.stderr[-3000:]}")
        peer = json.loads(proc.stdout.strip().splitlines()[-1])
        results["httpfs"], httpfs_version = peer["times"], peer["duckdb"]
    else:
        print(f"no httpfs row: {HTTPFS_PYTHON} is missing (scripts/setup-httpfs.sh makes it)", flush=True)
    server.stop()

    rows = {
        route: {name: statistics.median(ts) for name, ts in by_query.items()}
        for route, by_query in results.items()
    }
    for route, by_query in rows.items():
        print(f"{route:16s} " + "  ".join(f"{n} {s:7.2f} s" for n, s in by_query.items()), flush=True)
    out = {
        "benchmark": "bench_s3_query",
        **provenance(),
        "rounds": args.repeats,
        "quick": args.quick,
        "server": "moto S3 server on 127.0.0.1",
        "input": str(parquet.relative_to(HERE)),
        "input_bytes": parquet.stat().st_size,
        "duckdb": duckdb.__version__,
        "httpfs_duckdb": httpfs_version,
        "queries": QUERIES,
        "median_seconds": rows,
        "runs": results,
    }
    write_result(args.out, out, quick=args.quick)


if __name__ == "__main__":
    main()
