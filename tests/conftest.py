"""Shared fixtures: small synthetic corpora and datasets, made once per test session."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# Set before anything imports jax, which reads these once. The temporary folders this process makes
# are removed when it exits (`_MADE`).
_MADE = [tempfile.mkdtemp(prefix="omicsio-jax-cache-")]
atexit.register(lambda: [shutil.rmtree(path, ignore_errors=True) for path in _MADE])
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["OMICSIO_JAX_CACHE"] = _MADE[0]  # the gene-table cache
# One XLA compilation cache for the session, shared with every process the tests start (they inherit
# the environment): a train step, a model or a placement compiled once is read back after, not
# compiled again in each subprocess.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _MADE.append(tempfile.mkdtemp(prefix="omicsio-jax-xla-"))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _MADE[-1]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

from materialize import Layout, make_synthetic_corpus, materialize  # noqa: E402 (after the environment)

ROOT = Path(__file__).resolve().parents[1]


def repo_file(relpath: str) -> Path:
    """``relpath`` of the repository these tests are in (a benchmark script, a docs page), or a
    skip saying so where the tests run from a copy outside it (against an installed wheel)."""
    path = ROOT / relpath
    if not path.exists():
        pytest.skip(
            f"needs {relpath} of the repository, not beside these tests in {ROOT}: run them from a checkout"
        )
    return path


# Modules whose tests start real components (Orbax, moto's S3 server, Dask, O_DIRECT reads, several
# processes): with ``CI`` set, a skip there is a failure, so a missing extra or a version clash cannot
# make CI pass without them.
FLAGSHIP = {
    "test_checkpoint",
    "test_directio",
    "test_elastic",
    "test_multihost",
    "test_multimodal",
    "test_partitions",
    "test_preemption",
    "test_resources",
    "test_s3_dataset",
    "test_s3_materialize",
    "test_train",
}


# The longest modules (seconds of one pytest-xdist worker, suite on 2 cores), handed out first: with
# each module whole on one worker, a long one left to the end would keep that worker busy while the
# other has nothing left (xdist's own order, by number of tests, puts the one-test learning modules last)
LONGEST_FIRST = (
    "test_soak",
    "test_s3_materialize",
    "test_pretrain",
    "test_pretrain_learning",
    "test_pretrain_learning_scgpt",
    "test_preemption",
    "test_grain",
    "test_partitions",
    "test_multihost",
    "test_multimodal",
    "test_finetune",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # keep the order `pytest_collection_modifyitems` gives


def pytest_collection_modifyitems(items):
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    # a stable sort: the other modules, and the tests within each, keep their order
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).stem, len(rank)))


def _fails_in_ci(report) -> bool:
    module = Path(str(report.fspath)).stem
    return (
        bool(os.environ.get("CI"))
        and report.skipped
        and module in FLAGSHIP
        and not hasattr(report, "wasxfail")
    )


def _fail_in_ci(report) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped in CI, where it must run: {reason.removeprefix('Skipped: ')}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if _fails_in_ci(report):
        _fail_in_ci(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    if _fails_in_ci(report):  # a module-level skip (importorskip) takes every test of the module
        _fail_in_ci(report)


NOBODY = 65534  # the unprivileged user of most systems


@pytest.fixture
def shared_dir():
    """A folder other users read but cannot write, as a cluster's shared storage: pytest's own
    temporary folders (mode 0700) are closed to another user."""
    folder = Path(tempfile.mkdtemp(prefix="omicsio-shared-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def run_as_nobody(
    code: str, *, env: dict[str, str] | None = None, cwd: str = "/"
) -> subprocess.CompletedProcess:
    """``python -c code`` as user `NOBODY`, whose home does not exist (a batch job reading a dataset
    another user wrote), with ``env`` added. Only root can switch users (CI runs as root): skipped
    elsewhere, and where that user cannot start this Python or import the package from here."""
    if os.geteuid() != 0:
        pytest.skip("runs as another user: needs root")
    keep = ("PATH", "LD_LIBRARY_PATH", "XLA_FLAGS", "JAX_PLATFORMS")
    base = {name: os.environ[name] for name in keep if name in os.environ}
    base.update(PYTHONPATH=str(ROOT), HOME="/nonexistent")
    options = dict(
        user=NOBODY, group=NOBODY, env={**base, **(env or {})}, cwd=cwd, capture_output=True, text=True
    )
    try:
        probe = subprocess.run([sys.executable, "-c", "import omicsio_jax"], **options)
    except PermissionError:
        pytest.skip(f"user {NOBODY} cannot start {sys.executable}")
    if probe.returncode:
        pytest.skip(f"user {NOBODY} cannot import omicsio_jax from {ROOT}: {probe.stderr.strip()[-300:]}")
    return subprocess.run([sys.executable, "-c", code], **options)


def numpy_huge_pages() -> Callable[[], bool]:
    """NumPy's ``_get_madvise_hugepage``: in ``numpy._core.multiarray`` since NumPy 2, in
    ``numpy.core.multiarray`` before (the package allows NumPy 1.26, and NumPy 2 warns on the old name)."""
    two = np.lib.NumpyVersion(np.__version__) >= "2.0.0"
    return pytest.importorskip(
        "numpy._core.multiarray" if two else "numpy.core.multiarray"
    )._get_madvise_hugepage


def open_descriptors(match: Callable[[str], bool]) -> int:
    """This process's open descriptors whose target path ``match`` accepts (not every descriptor:
    another test's threads in the same worker process may open and close their own files meanwhile)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since it was listed
            count += match(os.readlink(f"/proc/self/fd/{fd}"))
    return count


def table_csr(table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference CSR straight from a list-column table (pyarrow + numpy, no omicsio code)."""
    genes = table.column("gene_token_id").combine_chunks()
    values = table.column("gene_expression").combine_chunks()
    lengths = np.array([0 if v is None else len(v) for v in genes.to_pylist()], dtype=np.int64)
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    flat_genes = np.concatenate([np.asarray(v or [], dtype=np.int64) for v in genes.to_pylist()] or [[]])
    flat_values = np.concatenate([np.asarray(v or [], dtype=np.float32) for v in values.to_pylist()] or [[]])
    return indptr, flat_genes.astype(np.int32), flat_values.astype(np.float32)


def kill_at(args: list[str], ckpt: Path, marker: Path, stall_at: int, published: Path) -> None:
    """Run ``omicsio-train args`` in a worker that stalls after step ``stall_at``; SIGKILL it there
    once the checkpoint ``published`` exists."""
    # this checkout's packages first (a script's own folder, tests/, is what Python puts on the path)
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": path}
    command = [
        sys.executable,
        str(ROOT / "tests" / "_train_kill_worker.py"),
        str(marker),
        str(stall_at),
        *args,
        "--checkpoint-dir",
        str(ckpt),
    ]
    worker = subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (marker.exists() and published.exists()):
            assert worker.poll() is None, worker.stderr.read()
            assert time.monotonic() < deadline, f"the worker did not reach step {stall_at}"
            time.sleep(0.05)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        worker.stderr.close()
    assert worker.returncode == -signal.SIGKILL


def assert_a_pool_imports_no_pandas(script: str) -> None:
    """Run ``script`` (a conversion on a pool of two workers) with every process's imports reported,
    and check that the parent and both workers ran and that none of them imported pandas."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}  # every process's imports, on its stderr
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr.count("| materialize._pool") >= 3  # the parent and both workers reported
    assert [line for line in run.stderr.splitlines() if line.split("|")[-1].strip() == "pandas"] == []


def write_legacy_h5ad(path, rng):
    """An .h5ad as anndata before 0.7 wrote it: compound obs/var (a numeric field big-endian),
    categories in uns, h5sparse matrices, raw.X and raw.var at the top level."""
    import h5py
    import scipy.sparse as sp

    def sparse(group, matrix):
        group.attrs["h5sparse_format"], group.attrs["h5sparse_shape"] = "csr", matrix.shape
        for name in ("data", "indices", "indptr"):
            group.create_dataset(name, data=getattr(matrix, name))

    cells, genes, raw_genes = 120, 30, 45
    raw = sp.random(cells, raw_genes, density=0.3, format="csr", dtype=np.float32, random_state=rng)
    raw.data = np.ceil(raw.data * 20)
    keep = np.sort(rng.choice(raw_genes, genes, replace=False))
    ids = np.array([f"ENSG{i:011d}".encode() for i in range(raw_genes)])
    names = np.array([f"G{i}".encode() for i in range(raw_genes)])
    gene_dtype = [("index", "S12"), ("gene_ids", "S15")]
    codes = rng.integers(0, 3, cells).astype(np.int8)
    obs = np.array(
        [(f"cell-{i}".encode(), codes[i], float(raw[i].sum())) for i in range(cells)],
        dtype=[("index", "S10"), ("cell_type", "i1"), ("total_counts", ">f4")],
    )
    with h5py.File(path, "w") as f:
        f.create_dataset("obs", data=obs)
        f.create_dataset(
            "var", data=np.array(list(zip(names[keep], ids[keep], strict=True)), dtype=gene_dtype)
        )
        f.create_dataset("uns/cell_type_categories", data=np.array([b"B", b"NK", b"T"]))
        sparse(f.create_group("X"), sp.csr_matrix(np.log1p(raw[:, keep].toarray())))
        sparse(f.create_group("raw.X"), raw)
        f.create_dataset("raw.var", data=np.array(list(zip(names, ids, strict=True)), dtype=gene_dtype))
    return codes


@contextlib.contextmanager
def streaming(min_bytes: int):
    """Dense rows streamed around the caches for outputs of at least ``min_bytes`` (0: every one;
    `omicsio_jax.core.kernels.rows_scratch`)."""
    from omicsio_jax.core import kernels

    kept = kernels.STREAM_MIN_BYTES
    kernels.STREAM_MIN_BYTES = min_bytes
    try:
        yield
    finally:
        kernels.STREAM_MIN_BYTES = kept


def assert_csr_equal(actual, expected) -> None:
    for a, e, name in zip(actual, expected, ("indptr", "indices", "values"), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=name)
        if name == "values":  # bit-exact, not just numerically equal
            np.testing.assert_array_equal(
                np.asarray(a, np.float32).view(np.uint32), np.asarray(e, np.float32).view(np.uint32)
            )


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """3,000 cells × 2,000 genes, as parquet + gene table + h5ad (same cells)."""
    return make_synthetic_corpus(
        tmp_path_factory.mktemp("corpus"),
        num_cells=3000,
        num_genes=2000,
        seed=7,
        mean_nnz=150,
        progress=False,
    )


@pytest.fixture(scope="session")
def corpus_table(corpus) -> pa.Table:
    return pq.read_table(corpus.cells_parquet)


@pytest.fixture(scope="session")
def dataset_dir(corpus, tmp_path_factory):
    """The corpus materialized with small shards (1,024 cells) so several shards are exercised."""
    out = tmp_path_factory.mktemp("ds") / "out"
    materialize(corpus.cells_parquet, out, progress=False, layout=Layout(shard_cells=1024))
    return out


class S3Server:
    """moto's S3 API server on 127.0.0.1, with one empty bucket per test (`url` builds s3:// URLs in it)."""

    bucket = "omicsio-test"

    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def reset(self) -> None:
        import urllib.request

        urllib.request.urlopen(
            urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        ).close()
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=self.bucket)

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}"

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint)


def write_with_a_nan(table: pa.Table, row: int, path: Path, **options) -> Path:
    """``table`` written to ``path`` with its first expression value of ``row`` made NaN (a data error)."""
    values = table.column("gene_expression").to_pylist()
    values[row][0] = float("nan")
    index = table.column_names.index("gene_expression")
    pq.write_table(
        table.set_column(index, "gene_expression", pa.array(values, pa.list_(pa.float32()))), path, **options
    )
    return path


def upload_dataset(dataset_dir: Path, url: str) -> None:
    """A materialized dataset's files under ``url`` (``s3://``), the manifest last, as materialize does."""
    import json

    from omicsio_jax.storage.store import S3Store

    manifest = json.loads((dataset_dir / "manifest.json").read_text())
    names = [s["path"] for s in manifest["shards"]] + [f["path"] for f in manifest["files"]]
    S3Store(url).upload(dataset_dir, [*names, "manifest.json"])


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API server (moto) for the whole session; the AWS variables point every client at it
    (the benchmarks' `start_moto`), and are restored after."""
    sys.path.insert(0, str(repo_file("benchmarks/_local_s3.py").parent))
    from _local_s3 import AWS_VARIABLES, start_moto

    saved = {k: os.environ.get(k) for k in AWS_VARIABLES}
    server, endpoint = start_moto()
    try:
        yield S3Server(endpoint)
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3(s3_server):
    """The S3 server with a fresh, empty bucket ``omicsio-test``."""
    s3_server.reset()
    return s3_server


@pytest.fixture(scope="session")
def dask_cluster(s3_server):
    """A Dask LocalCluster on loopback: two worker processes of one thread each (started after the S3
    server, so its workers inherit the AWS variables). Its HTTP server takes a free port, not 8787:
    another pytest worker may run a cluster at the same time."""
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0", host="127.0.0.1"
    ) as cluster:
        yield cluster
