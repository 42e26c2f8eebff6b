"""Collections: several sources with different gene sets as one dataset, genes unified by Ensembl id,
what each source measured kept and served beside the values."""

from __future__ import annotations

import datetime
import io
import os
import re
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.sparse as sp
from conftest import assert_a_pool_imports_no_pandas, assert_csr_equal, streaming, write_legacy_h5ad

import materialize._open as opening
import omicsio_jax as oj
from materialize import InputOptions, Layout, Sources, materialize
from materialize._cli import main
from omicsio_jax.core import kernels
from omicsio_jax.format import progress_bar
from omicsio_jax.outputs.measured import PresenceTable


def _ensg(i: int, version: str = "") -> str:
    return f"ENSG{i:011d}{version}"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three sources, each with its own genes: a current .h5ad (Ensembl ids with versions in gene_ids,
    symbols as index: genes 20..69), a pre-0.7 .h5ad (raw: genes 0..44) and a parquet table with a
    gene table (genes 60..99). Returns the folder and, per source, (cell ids, gene ids, csr matrix)."""
    import anndata as ad

    d = tmp_path_factory.mktemp("sources")
    rng = np.random.default_rng(7)
    x = sp.random(200, 50, density=0.2, format="csr", random_state=1, dtype=np.float32)
    x.data = np.ceil(x.data * 10)
    genes = range(20, 70)
    var = pd.DataFrame(
        {"gene_ids": [_ensg(i, ".3") for i in genes], "feature_name": [f"G{i}" for i in genes]},
        index=[f"G{i}" for i in genes],
    )
    obs = pd.DataFrame(
        {"donor_id": pd.Categorical(rng.choice(["d1", "d2"], 200))}, index=[f"c{i}" for i in range(200)]
    )
    ad.AnnData(X=x, obs=obs, var=var).write_h5ad(d / "current.h5ad")
    write_legacy_h5ad(d / "legacy.h5ad", np.random.default_rng(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anndata's OldFormatWarning
        legacy = ad.read_h5ad(d / "legacy.h5ad")
    rows = []
    for i in range(150):
        k = int(rng.integers(0, 12))
        tokens = np.sort(rng.choice(40, k, replace=False))
        rows.append((f"p{i}", tokens.tolist(), rng.integers(1, 9, k).astype(np.float32).tolist()))
    pq.write_table(
        pa.table(
            {
                "cell_id": [r[0] for r in rows],
                "gene_token_id": [r[1] for r in rows],
                "gene_expression": pa.array([r[2] for r in rows], pa.list_(pa.float32())),
                "plate": ["P1"] * 150,
            }
        ),
        d / "plate.parquet",
    )
    pq.write_table(
        pa.table({"gene_token_id": np.arange(40), "ensembl_id": [_ensg(i) for i in range(60, 100)]}),
        d / "gene_metadata.parquet",
    )
    indptr = np.concatenate([[0], np.cumsum([len(r[1]) for r in rows])])
    plate = sp.csr_matrix(
        (np.concatenate([r[2] for r in rows]), np.concatenate([r[1] for r in rows]).astype(int), indptr),
        shape=(150, 40),
    )
    return d, {
        "current": ([f"c{i}" for i in range(200)], [_ensg(i) for i in genes], x),
        "legacy": (list(legacy.obs_names), list(legacy.raw.var["gene_ids"]), legacy.raw.X.tocsr()),
        "plate": ([r[0] for r in rows], [_ensg(i) for i in range(60, 100)], plate),
    }


def _sources_file(d, name="sources.csv"):
    pd.DataFrame(
        {
            "path": ["current.h5ad", "legacy.h5ad", "plate.parquet"],
            "dataset_id": ["current", "legacy", "plate"],
            "raw": [None, True, None],
            "assay": ["10x 3' v3", "Smart-seq2", "10x 3' v3"],
            "donor_id": [None, "d7", None],
        }
    ).to_csv(d / name, index=False)
    return d / name


@pytest.fixture(scope="module")
def collection(sources, tmp_path_factory):
    d, _ = sources
    out = tmp_path_factory.mktemp("collection") / "ds"
    materialize(
        Sources.read(_sources_file(d)), out, layout=Layout(shard_cells=128), progress=False, workers=1
    )
    return out


def _dense(ds, rows):
    indptr, indices, values = ds.read_csr(np.asarray(rows))
    return sp.csr_matrix((values, indices, indptr), shape=(len(rows), ds.num_genes)).toarray()


def test_every_cell_reads_back_as_its_source_holds_it_in_the_unified_genes(collection, sources):
    _, expected = sources
    ds = oj.open_dataset(collection)
    assert ds.num_cells == 470
    ensembl = ds.features["ensembl_id"].tolist()
    # the union in an order each source keeps (here the three list their genes in one order)
    assert ensembl == [_ensg(i) for i in range(100)]
    labels = ds.obs["dataset_id"].labels()
    first = 0
    for name, (cell_ids, gene_ids, matrix) in expected.items():
        rows = np.arange(first, first + len(cell_ids))
        assert ds.cell_ids[rows].tolist() == cell_ids
        assert set(labels[rows]) == {name}
        columns = [ensembl.index(g) for g in gene_ids]
        want = np.zeros((len(rows), ds.num_genes), np.float32)
        want[:, columns] = matrix.toarray()
        np.testing.assert_array_equal(_dense(ds, rows), want)
        first += len(rows)
    assert ds.manifest.values == "counts"
    assert [s["dataset_id"] for s in ds.manifest.source["sources"]] == ["current", "legacy", "plate"]


def test_obs_of_the_sources_and_of_the_sources_file(collection):
    ds = oj.open_dataset(collection)
    assay = ds.obs["assay"].labels()
    assert set(assay[:200]) == {"10x 3' v3"} and set(assay[200:320]) == {"Smart-seq2"}
    donor = ds.obs["donor_id"].labels()
    assert set(donor[:200]) == {"d1", "d2"}  # the source's own column
    assert set(donor[200:320]) == {"d7"}  # the sources file's value, for a source without one
    assert (ds.obs["donor_id"].codes[320:] == -1).all()  # neither: missing
    assert set(ds.obs["plate"].labels()[320:]) == {"P1"}
    assert (ds.obs["plate"].codes[:320] == -1).all()
    cell_type = ds.obs["cell_type"].labels()  # the legacy file's categories from uns
    assert set(cell_type[200:320]) <= {"B", "NK", "T"}


def test_presence_says_which_genes_each_source_measured(collection, sources):
    _, expected = sources
    ds = oj.open_dataset(collection)
    ensembl = ds.features["ensembl_id"].tolist()
    assert ds.presence.dataset_ids == ("current", "legacy", "plate")
    for name, (_, gene_ids, _) in expected.items():
        measured = ds.measured_genes(name)
        assert sorted(np.flatnonzero(measured)) == sorted(ensembl.index(g) for g in gene_ids)
    with pytest.raises(
        oj.OmicsIOError, match="no source 'other' in this collection; it has current, legacy, plate"
    ):
        ds.measured_genes("other")
    assert oj.verify_dataset(collection) == []


def test_the_same_sources_give_the_same_bytes_whatever_the_workers(collection, sources, tmp_path):
    d, _ = sources
    out = tmp_path / "two"
    materialize(
        Sources.read(_sources_file(d)), out, layout=Layout(shard_cells=128), progress=False, workers=2
    )
    a, b = oj.open_dataset(collection).manifest, oj.open_dataset(out).manifest
    assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]
    assert a.fingerprint == b.fingerprint


def test_an_open_collection_keeps_one_gene_table_not_one_per_source(sources):
    """Once the genes are unified, the sources' own gene tables are let go (a 1,500-source atlas of
    60k genes each would keep ~1.5 GB of them through the run, and send them to every worker): the
    collection's members hold none, and its pickle (a worker's job) is smaller than the same
    collection's with its members' tables by at least their bytes."""
    import copy
    import pickle

    from materialize._collection import open_collection
    from materialize._materialize import open_source

    d, _ = sources
    paths = [str(d / "current.h5ad"), str(d / "legacy.h5ad"), str(d / "plate.parquet")]
    tables = []

    def opened(path, own, con):
        member = open_source(path, con=con)
        tables.append(member.genes)
        return member

    src = open_collection(Sources(tuple(paths)), opened)
    try:
        assert all(m.genes is None for m in src.members)
        pickled = len(pickle.dumps(src))
        own_tables = sum(t.nbytes for t in tables)
        with_tables = copy.copy(src)
        with_tables.members = [copy.copy(m) for m in src.members]
        for member, table in zip(with_tables.members, tables, strict=True):
            member.genes = table
        assert pickled + own_tables <= len(pickle.dumps(with_tables)), (pickled, own_tables)
    finally:
        src.close()


def test_a_collection_reads_its_sources_one_open_file_at_a_time(sources):
    """A source's file is closed once its cells are read (opened again if read again): a worker
    reading source after source kept every one it had read open until the run ended, ~1.4 MB of
    h5py's caches each, and a collection of ~1,000 small .h5ad files passed ``ulimit -n``."""
    from materialize._collection import open_collection
    from materialize._materialize import open_source

    d, _ = sources
    paths = [str(d / "current.h5ad"), str(d / "legacy.h5ad"), str(d / "plate.parquet")]

    def open_h5ad_files() -> list[str]:
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.endswith(".h5ad"):
                found.append(os.path.basename(target))
        return sorted(found)

    src = open_collection(Sources(tuple(paths)), lambda path, own, con: open_source(path, con=con))
    try:
        seen = []
        for batch in src.batches(["dataset_id"]):
            seen.append((batch.obs["dataset_id"][0].as_py(), open_h5ad_files()))
        assert [s for s, _ in seen] == ["current", "legacy", "plate"]  # (a batch each, here)
        assert [files for _, files in seen] == [["current.h5ad"], ["legacy.h5ad"], []]
        assert open_h5ad_files() == []
        again = next(src.batches(["dataset_id"]))  # a source read again opens its file again
        assert again.num_cells > 0
    finally:
        src.close()


def test_a_workers_next_partition_goes_on_from_a_table_sources_open_read(tmp_path, monkeypatch):
    """A table source's parquet read left open where a partition stopped inside a row group is where
    the worker's next partition of the same source goes on from (closing the source after each
    partition decoded that row group again from its first row: ~5% of a 50-source collection's
    cells twice); the cells are those of reading each partition afresh."""
    from materialize import _parquet_stream
    from materialize._collection import open_collection
    from materialize._materialize import open_source

    rng = np.random.default_rng(3)
    paths = []
    for k in range(2):
        tokens = [np.sort(rng.choice(30, 4, replace=False)).tolist() for _ in range(100)]
        pq.write_table(
            pa.table(
                {
                    "cell_id": [f"s{k}c{i}" for i in range(100)],
                    "gene_token_id": tokens,
                    "gene_expression": pa.array([[1.0, 2.0, 3.0, 4.0]] * 100, pa.list_(pa.float32())),
                }
            ),
            tmp_path / f"s{k}.parquet",
            row_group_size=64,
        )
        pq.write_table(
            pa.table({"gene_token_id": np.arange(30), "ensembl_id": [_ensg(i + 10 * k) for i in range(30)]}),
            tmp_path / f"s{k}_genes.parquet",
        )
        paths.append(str(tmp_path / f"s{k}.parquet"))
    reads = []
    real = _parquet_stream.ParquetStream.__init__

    def counted(self, key, path, row, *args, **kwargs):
        reads.append((Path(path).name, row))
        real(self, key, path, row, *args, **kwargs)

    monkeypatch.setattr(_parquet_stream.ParquetStream, "__init__", counted)
    src = open_collection(
        Sources(tuple(paths)),
        lambda path, own, con: open_source(path, con=con, genes=path.replace(".parquet", "_genes.parquet")),
    )
    try:
        parts = src.plan(40)  # partitions of 40 cells: row groups of 64 split
        run = [b for p in parts for b in src.batches([], p)]  # one worker's run, in order
        assert reads == [("s0.parquet", 0), ("s1.parquet", 0)]  # each source read once, on and on
        reads.clear()
        fresh = []
        for p in parts:
            _parquet_stream.PARQUET_STREAMS.keep(None)  # as another worker would: nothing open
            fresh += list(src.batches([], p))
        assert len(reads) > 2  # ...which reads again from the row groups' starts
        for mine, theirs in zip(run, fresh, strict=True):
            assert mine.cell_ids.equals(theirs.cell_ids)
            assert np.array_equal(mine.tokens, theirs.tokens) and np.array_equal(mine.indptr, theirs.indptr)
    finally:
        src.close()


def test_a_folder_or_glob_of_anndata_files_is_a_collection_of_them(sources, tmp_path, capsys):
    """An atlas downloaded as one .h5ad per dataset: its folder, or a glob of its files, is the
    collection of those files in sorted order (as listing them does); a glob that matches nothing is
    a one-line error. A folder that holds table files stays a table input. The atlas folder's name
    holds a glob's brackets: files named in it are those files, and a glob searches it."""
    import shutil

    d, _ = sources
    atlas = tmp_path / "atlas[v2]"
    (atlas / "more").mkdir(parents=True)
    shutil.copy(d / "current.h5ad", atlas / "a.h5ad")
    shutil.copy(d / "legacy.h5ad", atlas / "more" / "b.h5ad")
    listed = tmp_path / "listed"
    materialize([str(atlas / "a.h5ad"), str(atlas / "more" / "b.h5ad")], listed, progress=False, workers=1)
    materialize(str(atlas / "**" / "*.h5ad"), tmp_path / "glob", progress=False, workers=1)
    shutil.move(atlas / "more" / "b.h5ad", atlas / "b.h5ad")
    assert main([str(atlas), str(tmp_path / "folder"), "--no-progress", "--workers", "1"]) == 0
    want = oj.open_dataset(listed)
    assert want.presence.dataset_ids == ("a", "b")
    for name in ("glob", "folder"):
        ds = oj.open_dataset(tmp_path / name)
        assert ds.presence.dataset_ids == ("a", "b") and ds.cell_ids.tolist() == want.cell_ids.tolist()
        assert_csr_equal(ds.read_csr(np.arange(ds.num_cells)), want.read_csr(np.arange(want.num_cells)))
    capsys.readouterr()
    assert main([str(tmp_path / "none" / "*.h5ad"), str(tmp_path / "x"), "--no-progress"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("no AnnData files match '" + str(tmp_path / "none" / "*.h5ad") + "'")
    )


def test_a_large_collections_workers_start_before_its_genes_are_unified(
    collection, sources, tmp_path, monkeypatch
):
    """By default a collection worth two workers or more starts them as its sources open, once the
    cells open so far are worth them all (else once all are open), so that their start overlaps the
    opening of the rest and the unifying of the genes (after the plan, they would start only once
    it is done); a small one starts none; the bytes are those of one process either way."""
    import materialize._collection as collection_module
    import materialize._materialize as materialize_module
    from materialize import _pool

    events = []
    real_pool, real_build = _pool.Pool, collection_module.GeneSpace.build

    class RecordingPool(real_pool):
        def __init__(self, workers):
            events.append(("pool", workers))
            super().__init__(workers)

    def recording_build(*args, **kwargs):
        events.append(("genes",))
        return real_build(*args, **kwargs)

    monkeypatch.setattr(materialize_module, "Pool", RecordingPool)
    monkeypatch.setattr(collection_module.GeneSpace, "build", recording_build)
    monkeypatch.setattr(materialize_module, "usable_cores", lambda: 2)
    d, _ = sources
    layout = Layout(shard_cells=128)
    materialize(Sources.read(_sources_file(d)), tmp_path / "small", layout=layout, progress=False)
    assert events == [("genes",)]  # 470 cells: one process
    events.clear()
    monkeypatch.setattr(_pool, "MIN_CELLS_PER_WORKER", 128)  # the same cells, now worth 2 workers
    result = materialize(Sources.read(_sources_file(d)), tmp_path / "large", layout=layout, progress=False)
    assert events == [("pool", 2), ("genes",)] and result.workers == 2
    counted = []  # the cells open so far, as the sources open in their order
    src = collection_module.open_collection(
        Sources.read(_sources_file(d)),
        lambda path, own, con: materialize_module.open_source(path, con=con, use_raw=bool(own.get("raw"))),
        opened=lambda cells, every: counted.append((cells, every)),
    )
    src.close()
    assert counted == [(200, False), (320, False), (470, True)]  # 2 workers' worth after the first two
    for out in ("small", "large"):
        a, b = oj.open_dataset(collection).manifest, oj.open_dataset(tmp_path / out).manifest
        assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]
        assert a.fingerprint == b.fingerprint


def test_many_h5ad_sources_open_on_the_pools_workers_with_the_same_bytes(
    collection, sources, tmp_path, monkeypatch
):
    """From `_POOL_OPEN_FROM` .h5ad sources, a collection starts its pool before opening them and
    opens them on its workers (h5py reads one file at a time in a process), each with its own
    reading options (legacy: ``raw``), even when the cells are then written in this process; the
    bytes are those of opening on threads. A file that is no .h5ad among them is still the one-line
    error naming it, and nothing is written."""
    import materialize._collection as collection_module
    import materialize._materialize as materialize_module
    from materialize import _pool

    opened_on_workers = []
    real_map = _pool.Pool.map

    def recording_map(self, fn, items, what):
        opened_on_workers.extend(Path(path).name for _, path, _ in items)
        return real_map(self, fn, items, what)

    monkeypatch.setattr(_pool.Pool, "map", recording_map)
    monkeypatch.setattr(materialize_module, "usable_cores", lambda: 2)
    monkeypatch.setattr(collection_module, "_POOL_OPEN_FROM", 2)
    d, _ = sources
    for workers, cells_per_worker in ((1, _pool.MIN_CELLS_PER_WORKER), (2, 128)):
        monkeypatch.setattr(_pool, "MIN_CELLS_PER_WORKER", cells_per_worker)  # 470 cells: 1, then 2 workers
        out = tmp_path / f"pooled_{workers}"
        layout = Layout(shard_cells=128)
        result = materialize(Sources.read(_sources_file(d)), out, layout=layout, progress=False)
        assert opened_on_workers == ["current.h5ad", "legacy.h5ad"] and result.workers == workers
        opened_on_workers.clear()
        a, b = oj.open_dataset(collection).manifest, oj.open_dataset(out).manifest
        assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]
        assert a.fingerprint == b.fingerprint

    (tmp_path / "broken.h5ad").write_bytes(b"not an HDF5 file")
    bad = tmp_path / "bad"
    with pytest.raises(oj.DataValidationError, match=r"cannot read .*broken\.h5ad: ") as e:
        materialize([d / "current.h5ad", tmp_path / "broken.h5ad", d / "plate.parquet"], bad, progress=False)
    assert "\n" not in str(e.value) and not bad.exists()
    assert opened_on_workers == ["current.h5ad", "broken.h5ad"]


@pytest.mark.parametrize("streamed", [False, True], ids=["written in place", "streamed"])
def test_dense_measured_masks_what_the_source_did_not_measure(collection, streamed):
    """Values and masks written in place, or streamed around the caches as a batch larger than a
    cache is (`omicsio_jax.core.kernels.streamed`)."""
    ds = oj.open_dataset(collection)
    with streaming(0 if streamed else kernels.STREAM_MIN_BYTES):
        loader = oj.make_loader(ds, batch_size=32, output=oj.Dense(measured=True), seed=3, num_epochs=1)
        batches = list(loader)
    assert len(batches) == 470 // 32
    for batch in batches:
        values, measured = np.asarray(batch.x["values"]), np.asarray(batch.x["measured"])
        assert measured.dtype == bool and measured.shape == values.shape
        rows = np.asarray(batch.index)
        np.testing.assert_array_equal(measured, ds.presence.measured[ds.presence.sources_of(rows)])
        assert not values[~measured].any()  # an unmeasured gene never holds a value
        assert batch.x["measured"].sharding == batch.x["values"].sharding


@pytest.mark.parametrize("kind", ["geneformer", "scgpt"])
def test_token_outputs_never_emit_a_gene_the_cells_source_did_not_measure(collection, kind):
    """Not a ranked gene, and not MLM's random replacement either: Geneformer's 10% of masked
    positions replaced by a random gene draw from the genes of the cell's own source (they drew from
    every gene, 40% of them unmeasured in a collection of three sources)."""
    ds = oj.open_dataset(collection)
    output = (
        oj.GeneformerTokens(max_len=64, mask_prob=0.5) if kind == "geneformer" else oj.ScGPTTokens(max_len=64)
    )
    loader = oj.make_loader(ds, batch_size=32, output=output, seed=5, num_epochs=3)
    first_gene, replaced = 3, 0  # the default vocabulary: column g is token g + 3
    for batch in loader:
        ids = np.asarray(batch.x["input_ids"] if kind == "geneformer" else batch.x["gene_ids"])
        rows = np.asarray(batch.index)
        measured = ds.presence.measured[ds.presence.sources_of(rows)]
        genes = (ids >= first_gene) & (ids < first_gene + ds.num_genes)
        r, c = np.nonzero(genes)
        assert measured[r, ids[r, c] - first_gene].all()
        if kind == "geneformer":
            labels = np.asarray(batch.x["labels"])
            replaced += int(np.count_nonzero(genes & (labels >= 0) & (ids != labels)))
    assert kind != "geneformer" or replaced > 100  # random replacements were drawn, and checked


def test_presence_table_rows_streamed_are_the_rows_copied():
    """`PresenceTable.host_rows` into a buffer: row copies, or the rows streamed around the caches;
    a negative source reads all False, a source past the table is an error."""
    rng = np.random.default_rng(0)
    measured = rng.random((5, 1000)) < 0.5
    table = PresenceTable.of(measured)
    sources = np.array([3, -1, 0, 4, 4, 1, -1, 2], np.int32)
    expected = np.concatenate([measured, np.zeros((1, 1000), bool)])[sources]
    raw = np.ones(len(sources) * 1000 + 7, bool)
    out = raw[7:].reshape(len(sources), 1000)  # not aligned to a cache line
    for min_bytes in (kernels.STREAM_MIN_BYTES, 0):
        out[:] = True
        with streaming(min_bytes):
            np.testing.assert_array_equal(table.host_rows(sources, out), expected)
    assert raw[:7].all()  # nothing written before the buffer
    with streaming(0), pytest.raises(IndexError, match="source 5 is not one of the table's 5"):
        table.host_rows(np.array([5]), out[:1])


def _expected_masks(ds, rows):
    """Each row's source's mask; all False on padding (row -1)."""
    padded = np.concatenate([ds.presence.measured, np.zeros((1, ds.num_genes), bool)])
    return padded[ds.presence.sources_of(rows)]


@pytest.mark.parametrize("gather", ["host memory (cpu)", "devices"])
def test_dense_measured_on_a_mesh_is_sharded_like_the_values_padding_included(
    collection, gather, monkeypatch
):
    """On CPU devices the mask rows are written where XLA adopts them; elsewhere they are gathered
    on the devices from each row's source. Both serve the same masks, sharded like the values."""
    from omicsio_jax.outputs import measured

    if gather == "devices":
        monkeypatch.setattr(measured, "on_cpu", lambda sharding: False)
    ds = oj.open_dataset(collection)
    mesh = jax.make_mesh((8,), ("data",))
    sampling = oj.Stream(fetch_factor=4, drop_remainder=False)
    loader = oj.make_loader(
        ds, batch_size=64, output=oj.Dense(measured=True), sampling=sampling, placement=mesh, num_epochs=1
    )
    batches = list(loader)
    assert (~np.asarray(batches[-1].mask)).sum() == (-470) % 64  # the last batch is padded
    for batch in batches:
        values, mask = batch.x["values"], batch.x["measured"]
        assert mask.dtype == bool and mask.shape == values.shape
        assert mask.sharding == values.sharding
        assert len(mask.sharding.device_set) == 8
        expected = _expected_masks(ds, np.asarray(batch.index))
        np.testing.assert_array_equal(np.asarray(mask), expected)
        assert not np.asarray(values)[~expected].any()


def test_dense_measured_built_on_the_devices_equals_the_host_batches(collection):
    """``Dense(measured=True, on_device=True)``: slabs and sources cross; the values are densified
    and the masks gathered on the devices, equal to the batches built on the host."""
    ds = oj.open_dataset(collection)
    mesh = jax.make_mesh((8,), ("data",))
    sampling = oj.Stream(fetch_factor=4, drop_remainder=False)
    host, device = (
        oj.make_loader(ds, batch_size=64, output=output, sampling=sampling, placement=mesh, num_epochs=1)
        for output in (oj.Dense(measured=True), oj.Dense(measured=True, on_device=True))
    )
    pairs = list(zip(host, device, strict=True))
    assert (~np.asarray(pairs[-1][1].mask)).sum() == (-470) % 64  # padding rows too
    for h, d in pairs:
        np.testing.assert_array_equal(np.asarray(d.index), np.asarray(h.index))
        for key in ("values", "measured"):
            np.testing.assert_array_equal(np.asarray(d.x[key]), np.asarray(h.x[key]))
            assert d.x[key].sharding.is_equivalent_to(h.x[key].sharding, 2)


def test_dense_measured_host_batches_carry_sources_not_masks_and_resume_exactly(collection):
    ds = oj.open_dataset(collection)
    output = oj.Dense(measured=True)
    loader = oj.make_loader(ds, batch_size=32, output=output, seed=5)
    hb = next(iter(loader.as_grain_dataset()))
    assert [a.shape for a in jax.tree.leaves(hb.x)] == [(32, ds.num_genes), (32,)]  # values, sources
    assert hb.x.sources.dtype == np.int32
    np.testing.assert_array_equal(hb.x["measured"], _expected_masks(ds, hb.index))
    it = iter(loader)
    next(it)
    state = loader.get_state()
    want = next(it)
    again = oj.make_loader(ds, batch_size=32, output=output, seed=5)
    again.set_state(state)
    got = next(iter(again))
    np.testing.assert_array_equal(np.asarray(got.index), np.asarray(want.index))
    for key in ("values", "measured"):
        np.testing.assert_array_equal(np.asarray(got.x[key]), np.asarray(want.x[key]))
    loader.close()
    again.close()


def test_csr_measured_carries_each_rows_source_and_gathers_masks_on_device(collection):
    ds = oj.open_dataset(collection)
    loader = oj.make_loader(ds, batch_size=32, output=oj.CSR(measured=True), seed=3)
    batch = next(iter(loader))
    rows = np.asarray(batch.index)
    sources = np.asarray(batch.x.sources)
    np.testing.assert_array_equal(sources, np.searchsorted([0, 200, 320], rows, side="right") - 1)
    mask = loader.measured_mask(batch.x)
    np.testing.assert_array_equal(np.asarray(mask), ds.presence.measured[sources])
    dense = np.asarray(loader.densify(batch.x))
    assert not dense[~np.asarray(mask)].any()


def test_csr_measured_masks_of_padding_rows_are_all_false(collection):
    ds = oj.open_dataset(collection)
    sampling = oj.Stream(fetch_factor=4, drop_remainder=False)
    loader = oj.make_loader(ds, batch_size=64, output=oj.CSR(measured=True), sampling=sampling, num_epochs=1)
    last = list(loader)[-1]
    assert (np.asarray(last.x.sources)[~np.asarray(last.mask)] == -1).all()
    mask = loader.measured_mask(last.x)
    np.testing.assert_array_equal(np.asarray(mask), _expected_masks(ds, np.asarray(last.index)))


def test_a_mixture_over_the_sources(collection):
    ds = oj.open_dataset(collection)
    weights = {"current": 0.5, "legacy": 0.25, "plate": 0.25}
    mixture = oj.Mixture(by="dataset_id", weights=weights, block_size=1, fetch_factor=4)
    loader = oj.make_loader(ds, batch_size=32, sampling=mixture, obs=["dataset_id"], seed=0, num_epochs=8)
    codes = np.concatenate([np.asarray(b.obs["dataset_id"])[np.asarray(b.mask)] for b in loader])
    shares = np.bincount(codes, minlength=3) / len(codes)
    categories = ds.obs["dataset_id"].categories
    for name, weight in weights.items():  # 3,584 draws: a share's standard error is under 0.01
        assert shares[categories.index(name)] == pytest.approx(weight, abs=0.04)


def test_version_suffixes_are_stripped_wherever_they_are_and_only_there():
    """`_stripped` returns ids without a "." unchanged after a scan of their bytes, and strips the
    versions of those with one, in arrays that are slices of others (whose bytes outside the slice
    may hold a "." or not)."""
    from materialize._genekeys import _stripped

    ids = pa.array([_ensg(1, ".4"), _ensg(2), "MT-ND1", _ensg(3, ".12"), _ensg(4), "RP11-1.2"])
    assert _stripped(ids).to_pylist() == [_ensg(1), _ensg(2), "MT-ND1", _ensg(3), _ensg(4), "RP11-1.2"]
    plain = ids.slice(1, 2)  # its buffer holds the dots of its neighbours
    assert _stripped(plain).to_pylist() == [_ensg(2), "MT-ND1"]
    assert _stripped(ids.slice(3, 2)).to_pylist() == [_ensg(3), _ensg(4)]
    unversioned = pa.array([_ensg(5), _ensg(6), None])
    assert _stripped(unversioned) is unversioned  # nothing to strip: the same array back
    assert _stripped(pa.array([], pa.string())).to_pylist() == []


def test_the_sources_ids_are_coded_as_one_encode_of_them_all_would_code_them():
    """`first_seen_codes` (the sources' ids as chunks of one column) gives the dictionary, in order of
    first appearance, and the codes that one dictionary encode of the ids copied into one array gives:
    nulls, repeats within and across sources, empty and sliced sources."""
    import pyarrow.compute as pc

    from materialize._genespace import first_seen_codes

    rng = np.random.default_rng(0)
    for _ in range(200):
        arrays = []
        for _ in range(int(rng.integers(0, 7))):
            values = [
                None if rng.random() < 0.1 else f"g{rng.integers(40)}" for _ in range(rng.integers(0, 30))
            ]
            array = pa.array(values, pa.string())
            arrays.append(array.slice(1, len(array) - 2) if len(array) > 2 and rng.random() < 0.3 else array)
        whole = pc.dictionary_encode(pa.concat_arrays([pa.nulls(0, pa.string()), *arrays]))
        seen, codes = first_seen_codes(arrays)
        assert seen.equals(whole.dictionary)
        np.testing.assert_array_equal(codes, whole.indices.fill_null(-1).to_numpy().astype(np.int64))


def test_one_source_versions_and_duplicates(tmp_path, capsys):
    """Two columns of one Ensembl id (two versions) are summed and reported; intersection keeps the
    genes every source measured; a given gene list fixes genes and order."""
    import anndata as ad

    x = sp.csr_matrix(np.array([[1, 2, 0, 3], [0, 5, 7, 0]], np.float32))
    var = pd.DataFrame(index=[_ensg(1, ".1"), _ensg(1, ".2"), _ensg(2), _ensg(3)])
    ad.AnnData(X=x, obs=pd.DataFrame(index=["a", "b"]), var=var).write_h5ad(tmp_path / "dup.h5ad")
    y = sp.csr_matrix(np.array([[4, 0], [0, 6]], np.float32))
    var = pd.DataFrame(index=[_ensg(3), _ensg(9)])
    ad.AnnData(X=y, obs=pd.DataFrame(index=["c", "d"]), var=var).write_h5ad(tmp_path / "other.h5ad")
    paths = [tmp_path / "dup.h5ad", tmp_path / "other.h5ad"]
    materialize(paths, tmp_path / "u", progress=False, workers=1)
    assert "dup (" in capsys.readouterr().err  # the summed duplicates are reported, naming the source
    ds = oj.open_dataset(tmp_path / "u")
    assert ds.features["ensembl_id"].tolist() == [_ensg(1), _ensg(2), _ensg(3), _ensg(9)]
    np.testing.assert_array_equal(
        _dense(ds, [0, 1, 2, 3]), [[3, 0, 3, 0], [5, 7, 0, 0], [0, 0, 4, 0], [0, 0, 0, 6]]
    )
    materialize(paths, tmp_path / "i", read=InputOptions(genes="intersection"), progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "i")
    assert ds.features["ensembl_id"].tolist() == [_ensg(3)]
    np.testing.assert_array_equal(_dense(ds, [0, 1, 2, 3]), [[3], [0], [4], [0]])
    (tmp_path / "genes.txt").write_text(f"{_ensg(9)}\n{_ensg(1)}.5\n")
    materialize(
        paths, tmp_path / "g", read=InputOptions(genes=str(tmp_path / "genes.txt")), progress=False, workers=1
    )
    ds = oj.open_dataset(tmp_path / "g")
    assert ds.features["ensembl_id"].tolist() == [_ensg(9), _ensg(1)]
    np.testing.assert_array_equal(_dense(ds, [0, 1, 2, 3]), [[0, 3], [0, 5], [0, 0], [6, 0]])


@pytest.mark.parametrize("num_columns", [200, 5_000, 70_000])
@pytest.mark.parametrize("order", ["rising", "shuffled", "clustered"])
@pytest.mark.parametrize("kept", ["all", "some"])
def test_rows_move_into_the_unified_columns_sorted_with_duplicates_summed(num_columns, order, kept):
    """`MemberMap.remap` against numpy: rows whose columns rise are copied, the others sorted (rows of
    0 to 300 genes, over few columns or many, spread or crowded into the last tenth); two tokens of
    one id are summed, tokens outside the kept genes dropped; a token out of order or unknown is an
    error naming it."""
    from materialize._remap import member_map

    rng = np.random.default_rng(num_columns)
    tokens = np.arange(0, 3 * num_columns // 2, 3)  # the source's gene tokens: not 0..n-1
    cols = np.sort(rng.choice(num_columns, len(tokens), replace=True))  # some ids twice: summed
    if order == "shuffled":
        cols = rng.permutation(cols)
    elif order == "clustered":  # many genes in few columns: buckets of many columns each
        cols = rng.permutation(num_columns - 1 - cols % max(num_columns // 10, 1))
    if kept == "some":
        cols[rng.random(len(tokens)) < 0.05] = -1  # not kept (an intersection)
    source = member_map(tokens, cols, num_columns)
    rows = [
        np.sort(rng.choice(tokens, int(rng.integers(0, min(300, len(tokens)))), replace=False))
        for _ in range(60)
    ]
    indptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    row_tokens = np.concatenate(rows).astype(np.int32)
    values = rng.integers(1, 100, len(row_tokens)).astype(np.float32)  # integers: sums exact
    out_ptr, out_cols, out_values = source.remap(indptr, row_tokens, values, str)
    col_of = dict(zip(tokens.tolist(), cols.tolist(), strict=True))
    for r in range(len(rows)):
        want = np.zeros(num_columns, np.float32)
        for t, v in zip(
            row_tokens[indptr[r] : indptr[r + 1]], values[indptr[r] : indptr[r + 1]], strict=True
        ):
            if col_of[int(t)] >= 0:
                want[col_of[int(t)]] += v
        got_cols = out_cols[out_ptr[r] : out_ptr[r + 1]]
        assert np.all(np.diff(got_cols) > 0)
        np.testing.assert_array_equal(got_cols, np.flatnonzero(want))
        np.testing.assert_array_equal(out_values[out_ptr[r] : out_ptr[r + 1]], want[got_cols])
    row = next(r for r in range(len(rows)) if len(rows[r]) > 2)
    swapped = row_tokens.copy()
    at = indptr[row] + 1
    swapped[at], swapped[at + 1] = swapped[at + 1], swapped[at]
    with pytest.raises(
        oj.DataValidationError, match=rf"not sorted in {row}: {swapped[at + 1]} after {swapped[at]}"
    ):
        source.remap(indptr, swapped, values, str)
    unknown = row_tokens.copy()
    unknown[at] = unknown[at - 1] + 1  # between two of the source's tokens (every third)
    with pytest.raises(oj.DataValidationError, match=rf"gene_token_id {unknown[at]} in {row} is not in"):
        source.remap(indptr, unknown, values, str)


def test_a_remapped_batch_keeps_its_memory_while_held_and_gives_it_to_a_later_one_after():
    """`MemberMap.remap`'s outputs are never handed out again while an array refers to them (a batch
    queued behind the reader is intact after the next ones are made), and once nothing does, a later
    batch's outputs take their memory instead of fresh pages."""
    from materialize._remap import member_map

    rng = np.random.default_rng(11)
    source = member_map(np.arange(5_000), rng.permutation(5_000), 5_000)
    rows = [np.sort(rng.choice(5_000, 400, replace=False)) for _ in range(50)]
    indptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    tokens = np.concatenate(rows).astype(np.int32)

    def batch(seed):
        return source.remap(indptr, tokens, np.random.default_rng(seed).random(len(tokens)), str)

    held = [batch(k) for k in range(12)]  # more batches than the memory kept for reuse holds
    for k in range(12):
        for got, want in zip(held[k], batch(k), strict=True):
            np.testing.assert_array_equal(got, want)
            assert not np.shares_memory(got, want)
    first = {a.ctypes.data for b in held[:4] for a in b[1:]}  # the 8 buffers kept: the first ones
    del held
    again = batch(12)
    assert {again[1].ctypes.data, again[2].ctypes.data} <= first


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_of_a_shuffled_source_sum_the_genes_of_one_id_in_the_order_given(dtype):
    """Rows of up to 2,800 genes of a shuffled source over 70,000 columns (wider than 16 bits), beside
    rows of a few dozen at most (the long rows sorted by radix passes, the others by buckets): each
    row's columns rise, and genes of one id are summed in the order the row gives them, in the
    values' type (three genes to each of 10,000 ids: values that are not integers show another order
    of the sums in their last bits)."""
    from materialize._remap import member_map

    rng = np.random.default_rng(7)
    num_columns = 70_000
    tokens = np.arange(60_000)
    distinct = rng.choice(num_columns, 40_000, replace=False)  # random columns: the source is shuffled
    cols = np.concatenate([np.repeat(distinct[:10_000], 3), distinct[10_000:]])  # tokens 3g..3g+2: one id
    source = member_map(tokens, cols, num_columns)
    rows = []
    for r in range(30):
        n = int(rng.integers(200, 700)) if r % 3 else int(rng.integers(1, 20))
        triples = 3 * rng.choice(10_000, n, replace=False)
        singles = rng.choice(30_000, n) + 30_000  # some twice: np.unique keeps one (and sorts)
        rows.append(np.unique(np.concatenate([triples, triples + 1, triples + 2, singles])))
    indptr = np.concatenate([[0], np.cumsum([len(row) for row in rows])])
    row_tokens = np.concatenate(rows).astype(np.int32)
    values = rng.random(len(row_tokens)).astype(dtype)
    out_ptr, out_cols, out_values = source.remap(indptr, row_tokens, values, str)
    assert out_values.dtype == dtype
    for r in range(len(rows)):
        want: dict[int, np.floating] = {}
        for t, v in zip(
            row_tokens[indptr[r] : indptr[r + 1]], values[indptr[r] : indptr[r + 1]], strict=True
        ):
            c = int(cols[t])
            want[c] = want[c] + v if c in want else v  # in the row's order, in the values' type
        got = slice(out_ptr[r], out_ptr[r + 1])
        np.testing.assert_array_equal(out_cols[got], sorted(want))
        np.testing.assert_array_equal(out_values[got], np.array([want[c] for c in sorted(want)], dtype))


def test_the_union_keeps_every_order_that_agrees_and_sets_the_others_aside():
    """`union_order`: sources listing subsets of one reference order (unrelated to the ids) each keep
    their order in the union (their rows are copied, not sorted); a source listing genes the other
    way round from the first is set aside, its own genes last in its order; the first source always
    keeps its order; of a cycle through three sources, two keep theirs."""
    from materialize._union_order import union_order

    rng = np.random.default_rng(3)
    reference = rng.permutation(1_000)  # the order the agreeing sources share
    agree = [reference[np.sort(rng.choice(1_000, n, replace=False))] for n in (300, 600, 450, 800, 40)]
    other = rng.permutation(np.concatenate([rng.choice(1_000, 200, replace=False), np.arange(1_000, 1_050)]))
    with_gaps = np.concatenate([[-1], agree[2], [agree[2][0], -1]])  # no id, and a gene listed twice
    codes = [agree[0], other, agree[1], with_gaps, agree[3], agree[4]]
    union = union_order(codes)
    assert sorted(union.tolist()) == sorted(set(np.concatenate(codes).tolist()) - {-1})  # each gene once
    column = np.full(1_050, -1)
    column[union] = np.arange(len(union))
    for c in agree:
        assert np.all(np.diff(column[c]) > 0)  # each agreeing source's columns rise
    assert not np.all(np.diff(column[other]) > 0)
    listed = set(np.concatenate(agree).tolist())
    assert union[len(listed) :].tolist() == [int(g) for g in other if int(g) not in listed]
    assert union_order([other, agree[0]])[:250].tolist() == other.tolist()  # the first keeps its order
    # a cycle only through three sources (a < b, b < c, c < a): the last one is set aside
    assert union_order([np.array([0, 1]), np.array([1, 2]), np.array([2, 0])]).tolist() == [0, 1, 2]
    assert union_order([]).tolist() == []


def test_sources_listed_in_id_order_get_the_ordering_kernels_order_without_it():
    """Where every source kept lists its genes in key order, `union_order` takes key order without
    the topological kernel; that is the kernel's own answer (each source's genes follow each other
    in key order, so the smallest key free to come next is always the smallest left), ties in key
    included, and sources in other orders are still set aside."""
    from materialize._union_order import _first_listed, _topological, union_order

    rng = np.random.default_rng(5)
    for case in range(30):
        num_genes = int(rng.integers(1, 400))
        key = rng.integers(0, num_genes // 2 + 1, num_genes) if case % 3 == 0 else rng.permutation(num_genes)
        by_key = np.argsort(key, kind="stable")
        codes = [by_key[np.sort(rng.choice(num_genes, int(rng.integers(0, num_genes + 1)), replace=False))]]
        codes += [by_key[np.sort(rng.choice(num_genes, num_genes // 3, replace=False))] for _ in range(4)]
        flat, offsets = _first_listed(
            np.concatenate(codes), np.cumsum([0] + [len(c) for c in codes]), num_genes
        )
        every = np.ones(len(codes), bool)
        kernel = _topological(flat, offsets, every, key, by_key, num_genes)
        assert union_order(codes, key).tolist() == kernel.tolist()
    shuffled = rng.permutation(by_key)
    assert union_order([by_key, shuffled], key)[: len(by_key)].tolist() == by_key.tolist()


def test_list_column_sources_each_in_its_own_gene_order(tmp_path):
    """Three parquet sources (read on connections to one DuckDB database, each with its own view of
    its cells), their genes listed in different orders, read back cell for cell."""
    rng = np.random.default_rng(3)
    expected = []
    paths = []
    for k, genes in enumerate([np.arange(300, 0, -1), rng.permutation(400), np.arange(100, 500)]):
        folder = tmp_path / f"plate_{k}"
        folder.mkdir()
        pq.write_table(
            pa.table({"gene_token_id": np.arange(len(genes)), "ensembl_id": [_ensg(int(g)) for g in genes]}),
            folder / "gene_metadata.parquet",
        )
        cells = []
        for i in range(int(rng.integers(150, 400))):
            tokens = np.sort(rng.choice(len(genes), int(rng.integers(0, 80)), replace=False))
            cells.append((f"p{k}_{i}", tokens, rng.integers(1, 50, len(tokens)).astype(np.float32)))
        pq.write_table(
            pa.table(
                {
                    "cell_id": [c[0] for c in cells],
                    "gene_token_id": pa.array([c[1] for c in cells], pa.list_(pa.int64())),
                    "gene_expression": pa.array([c[2] for c in cells], pa.list_(pa.float32())),
                }
            ),
            folder / "cells.parquet",
            row_group_size=100,
        )
        paths.append(folder / "cells.parquet")
        expected += [{_ensg(int(genes[t])): v for t, v in zip(c[1], c[2], strict=True)} for c in cells]
    materialize(paths, tmp_path / "out", layout=Layout(shard_cells=128), progress=False, workers=2)
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.obs["dataset_id"].categories == ("plate_0", "plate_1", "plate_2")
    ensembl = ds.features["ensembl_id"].tolist()
    dense = _dense(ds, np.arange(ds.num_cells))
    for row, cell in enumerate(expected):
        want = np.zeros(ds.num_genes, np.float32)
        for gene, value in cell.items():
            want[ensembl.index(gene)] = value
        np.testing.assert_array_equal(dense[row], want)


def test_sources_in_the_unified_order_go_to_the_encoder_unmoved_with_the_same_bytes(tmp_path, monkeypatch):
    """A source whose genes keep their order among the unified ones (every gene kept, one column
    each) is not moved into the unified columns first: the encoder maps its tokens. Its shards are
    those of the row sort, and a token outside its gene table is the encoder's one-line error."""
    import dataclasses

    import materialize._genespace as genespace

    rng = np.random.default_rng(5)
    paths = []
    for k, genes in enumerate([np.arange(0, 300), rng.permutation(np.arange(100, 400)), np.arange(200, 500)]):
        folder = tmp_path / f"plate_{k}"
        folder.mkdir()
        pq.write_table(
            pa.table({"gene_token_id": np.arange(len(genes)), "ensembl_id": [_ensg(int(g)) for g in genes]}),
            folder / "gene_metadata.parquet",
        )
        tokens = [
            np.sort(rng.choice(len(genes), int(rng.integers(0, 60)), replace=False)) for _ in range(300)
        ]
        pq.write_table(
            pa.table(
                {
                    "cell_id": [f"p{k}_{i}" for i in range(len(tokens))],
                    "gene_token_id": pa.array(tokens, pa.list_(pa.int32())),
                    "gene_expression": pa.array(
                        [rng.integers(1, 50, len(t)).astype(np.float32) for t in tokens],
                        pa.list_(pa.float32()),
                    ),
                }
            ),
            folder / "cells.parquet",
            row_group_size=256,
        )
        paths.append(folder / "cells.parquet")
    space = genespace.GeneSpace.build(
        [pq.read_table(p.parent / "gene_metadata.parquet") for p in paths], ["0", "1", "2"]
    )
    assert [m.in_order for m in space.maps] == [True, False, True]
    fast = materialize(paths, tmp_path / "fast", layout=Layout(shard_cells=256), progress=False, workers=2)
    member_map = genespace.member_map
    monkeypatch.setattr(
        genespace, "member_map", lambda *a: dataclasses.replace(member_map(*a), in_order=False)
    )
    sorted_ = materialize(
        paths, tmp_path / "sorted", layout=Layout(shard_cells=256), progress=False, workers=2
    )
    assert [s.sha256 for s in fast.manifest.shards] == [s.sha256 for s in sorted_.manifest.shards]
    monkeypatch.undo()
    bad = pq.read_table(paths[2]).to_pylist()
    bad[7]["gene_token_id"] = [*bad[7]["gene_token_id"], 300]  # past its gene table's 300 genes
    bad[7]["gene_expression"] = [*bad[7]["gene_expression"], 1.0]
    pq.write_table(pa.Table.from_pylist(bad, pq.read_schema(paths[2])), paths[2])
    with pytest.raises(
        oj.DataValidationError,
        match=r"gene_token_id 300 in row 7 \(cell_id p2_7\) of .*is not in the gene table",
    ):
        materialize(paths, tmp_path / "bad", progress=False, workers=1)
    assert not (tmp_path / "bad").exists()


def test_per_source_obs_given_in_python_take_the_type_of_their_values(sources, tmp_path):
    """``Sources(paths, obs=...)`` without ``obs_types``: each column's type comes from its values
    (None: not given for that source); a column without one value per source is a one-line error."""
    d, _ = sources
    paths = (str(d / "plate.parquet"), str(d / "current.h5ad"))
    obs = {"assay": ("10x", "Smart-seq2"), "plate_no": (3, None), "depth": (1.5, 2), "sorted": (True, False)}
    materialize(Sources(paths, obs=obs), tmp_path / "out", progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.obs["assay"].labels().tolist() == ["10x"] * 150 + ["Smart-seq2"] * 200
    plate_no = np.asarray(ds.obs["plate_no"])
    assert (plate_no[:150] == 3).all() and np.isnan(plate_no[150:]).all()  # not given: missing
    np.testing.assert_array_equal(ds.obs["depth"], [1.5] * 150 + [2.0] * 200)
    assert ds.obs["sorted"].labels().tolist() == ["true"] * 150 + ["false"] * 200  # bools: categories
    with pytest.raises(oj.OmicsIOError, match=r"obs 'assay' gives 1 value\(s\) for 2 sources"):
        Sources(paths, obs={"assay": ("10x",)})


def test_a_pool_converts_a_collection_without_importing_pandas(tmp_path):
    """pyarrow imports pandas (~0.7 s) on its first ``pa.array``, ``pa.scalar``, ``group_by`` or
    ``to_numpy`` in a process: unifying the sources' genes (symbols beside the ids, one source's genes
    in an order of its own) and giving each cell its source's dataset id and obs values hand arrays
    between Python, NumPy and Arrow without them, so neither the parent nor a worker pays it."""
    rng = np.random.default_rng(11)
    paths = []
    for k, genes in enumerate([np.arange(60), rng.permutation(np.arange(30, 90))]):
        folder = tmp_path / f"plate_{k}"
        folder.mkdir()
        pq.write_table(
            pa.table(
                {
                    "gene_token_id": np.arange(len(genes)),
                    "ensembl_id": [_ensg(int(g), ".2") for g in genes],
                    "feature_name": [f"G{g}" for g in genes],
                }
            ),
            folder / "gene_metadata.parquet",
        )
        tokens = [np.sort(rng.choice(len(genes), 9, replace=False)) for _ in range(300)]
        pq.write_table(
            pa.table(
                {
                    "cell_id": [f"p{k}_{i}" for i in range(300)],
                    "gene_token_id": pa.array(tokens, pa.list_(pa.int64())),
                    "gene_expression": pa.array(
                        [np.arange(1, 10, dtype=np.float32)] * 300, pa.list_(pa.float32())
                    ),
                }
            ),
            folder / "cells.parquet",
            row_group_size=64,
        )
        paths.append(str(folder / "cells.parquet"))
    (tmp_path / "sources.csv").write_text(f"path,assay,plate_no\n{paths[0]},10x,1\n{paths[1]},smart-seq2,2\n")
    script = (
        "from materialize import Layout, Sources, materialize\n"
        f"sources = Sources.read({str(tmp_path / 'sources.csv')!r})\n"
        f"materialize(sources, {str(tmp_path / 'out')!r}, workers=2, layout=Layout(shard_cells=128), "
        "progress=False)\n"
    )
    assert_a_pool_imports_no_pandas(script)
    ds = oj.open_dataset(tmp_path / "out")
    names = ds.features["gene_name"].tolist()
    assert names[:60] == [f"G{g}" for g in range(60)] and sorted(names[60:]) == sorted(
        f"G{g}" for g in range(60, 90)
    )
    assert ds.features["ensembl_id"].tolist()[0] == _ensg(0)  # the version stripped
    assert ds.obs["dataset_id"].labels().tolist() == ["plate_0"] * 300 + ["plate_1"] * 300
    assert ds.obs["assay"].labels().tolist() == ["10x"] * 300 + ["smart-seq2"] * 300
    np.testing.assert_array_equal(ds.obs["plate_no"], [1] * 300 + [2] * 300)


def test_sources_of_one_large_row_group_each_get_the_note_on_row_groups(tmp_path, capsys):
    """Two parquet sources of 600 cells in one row group each, cut into partitions of 128 cells on
    two workers: a partition that starts inside a source decodes it from its first row, 2,760 rows
    before the 1,200 written, and materialize says how to avoid it."""
    rng = np.random.default_rng(5)
    paths = []
    for k in range(2):
        folder = tmp_path / f"plate_{k}"
        folder.mkdir()
        pq.write_table(
            pa.table({"gene_token_id": np.arange(50), "ensembl_id": [_ensg(i) for i in range(50)]}),
            folder / "gene_metadata.parquet",
        )
        tokens = [np.sort(rng.choice(50, 5, replace=False)) for _ in range(600)]
        pq.write_table(
            pa.table(
                {
                    "cell_id": [f"p{k}_{i}" for i in range(600)],
                    "gene_token_id": pa.array(tokens, pa.list_(pa.int64())),
                    "gene_expression": pa.array([np.ones(5, np.float32)] * 600, pa.list_(pa.float32())),
                }
            ),
            folder / "cells.parquet",
        )
        paths.append(folder / "cells.parquet")
    materialize(paths, tmp_path / "out", layout=Layout(shard_cells=128), progress=False, workers=2)
    notes = [line for line in capsys.readouterr().err.splitlines() if "row group" in line]
    assert notes == [
        "materialize: the collection of 2 sources holds up to 600 rows in a row group, several "
        "partitions of 128 cells; a read that starts inside a row group decodes it from its first row, "
        "so the workers decode up to 3.3× its rows and more workers add little. For a parallel "
        "conversion, write the files with row groups of at most 128 rows "
        "(pyarrow.parquet.write_table(table, path, row_group_size=128))"
    ]
    assert oj.open_dataset(tmp_path / "out").num_cells == 1200


def test_a_source_with_symbols_only_is_matched_by_symbol_and_flagged(tmp_path, capsys):
    import anndata as ad

    var = pd.DataFrame({"gene_ids": [_ensg(1), _ensg(2)]}, index=["TP53", "CD4"])
    ad.AnnData(
        X=sp.csr_matrix(np.eye(2, dtype=np.float32)), obs=pd.DataFrame(index=["a", "b"]), var=var
    ).write_h5ad(tmp_path / "ids.h5ad")
    var = pd.DataFrame({"gene_ids": [_ensg(1)], "feature_name": ["P53"]}, index=["P53"])
    ad.AnnData(
        X=sp.csr_matrix(np.ones((1, 1), np.float32)), obs=pd.DataFrame(index=["e"]), var=var
    ).write_h5ad(tmp_path / "renamed.h5ad")
    var = pd.DataFrame(index=["CD4", "NEW1"])
    ad.AnnData(
        X=sp.csr_matrix(np.eye(2, dtype=np.float32) * 2), obs=pd.DataFrame(index=["c", "d"]), var=var
    ).write_h5ad(tmp_path / "symbols.h5ad")
    sources = [tmp_path / "ids.h5ad", tmp_path / "symbols.h5ad", tmp_path / "renamed.h5ad"]
    materialize(sources, tmp_path / "out", progress=False, workers=1)
    err = capsys.readouterr().err
    # one Ensembl id, two symbols: reported, not fatal (matched by the id, the first symbol kept)
    assert (
        "1 Ensembl id(s) carry different symbols in different sources (matched by id, first symbol kept), "
        f"e.g. {_ensg(1)} is TP53 before, P53 in renamed" in err
    )
    assert (
        "has no Ensembl ids: its 2 genes were matched by symbol (gene_name), 1 to another source's Ensembl id"
        in err
    )
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.features["ensembl_id"].tolist() == [_ensg(1), _ensg(2), None]
    assert ds.features["gene_name"].tolist() == ["TP53", "CD4", "NEW1"]
    np.testing.assert_array_equal(_dense(ds, [2, 3, 4]), [[0, 2, 0], [0, 0, 2], [1, 0, 0]])
    assert ds.manifest.source["sources"][1]["matched_by"] == "symbol"


def test_a_collections_notes_follow_the_bar_of_its_opening(tmp_path, monkeypatch):
    """In a terminal, where the bar of the sources opened shows (here at once, not after 2 s)."""
    import anndata as ad

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    var = pd.DataFrame({"gene_ids": [_ensg(1), _ensg(2)]}, index=["TP53", "CD4"])
    ad.AnnData(
        X=sp.csr_matrix(np.eye(2, dtype=np.float32)), obs=pd.DataFrame(index=["a", "b"]), var=var
    ).write_h5ad(tmp_path / "ids.h5ad")
    ad.AnnData(
        X=sp.csr_matrix(np.eye(2, dtype=np.float32)),
        obs=pd.DataFrame(index=["c", "d"]),
        var=pd.DataFrame(index=["CD4", "NEW1"]),
    ).write_h5ad(tmp_path / "symbols.h5ad")
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(opening, "progress_bar", lambda **options: progress_bar(**options | {"delay": 0}))
    materialize([tmp_path / "ids.h5ad", tmp_path / "symbols.h5ad"], tmp_path / "out", workers=1)
    said = terminal.getvalue()
    # not run on after the bar's last redraw ("…| 1/2 [00:00<00:00, 7.1sources/s]materialize: symbols …")
    assert re.search(
        r"opening sources: 100%[^\r\n]*\]\nmaterialize: symbols \([^)]*\) has no Ensembl ids", said
    )


def test_bad_collections_say_what_and_write_nothing(sources, tmp_path):
    d, _ = sources
    pq.write_table(
        pa.table({"cell_id": ["x"], "gene_token_id": [[0]], "gene_expression": [[1.0]]}),
        tmp_path / "bare.parquet",
    )
    out = tmp_path / "out"
    with pytest.raises(oj.DataValidationError, match=r"bare \(.*\) has no gene table: .*gene_metadata"):
        materialize([d / "plate.parquet", tmp_path / "bare.parquet"], out, progress=False)
    with pytest.raises(oj.OmicsIOError, match="dataset id.* plate name more than one source"):
        materialize([d / "plate.parquet", d / "plate.parquet"], out, progress=False)
    with pytest.raises(oj.OmicsIOError, match="a collection takes no --where"):
        materialize(
            [d / "plate.parquet", d / "current.h5ad"], out, read=InputOptions(where="true"), progress=False
        )
    with pytest.raises(oj.DataValidationError, match="has no text column 'nope'"):
        materialize(
            [d / "plate.parquet", d / "current.h5ad"],
            out,
            read=InputOptions(gene_id_column="nope"),
            progress=False,
        )
    assert not out.exists()


def test_a_ducklake_catalog_among_the_sources_is_refused_saying_what_to_do_instead(sources, tmp_path, capsys):
    """A DuckLake catalog cannot be a collection's member: one line at once (before the catalog is
    opened, so none is needed here) naming it, the command that materializes it on its own (its table
    from ducklake:CATALOG#TABLE or --table) and the export to parquet; in a sources file its catalog,
    not its scheme, is read from the file's folder. --table/--snapshot/--at with a collection of other
    sources are refused, not ignored."""
    d, _ = sources
    out, h5ad = tmp_path / "out", str(d / "current.h5ad")
    (tmp_path / "dl").mkdir()
    (tmp_path / "dl" / "sources.csv").write_text(f"path\nducklake:lake.ducklake#rna_cells\n{h5ad}\n")
    lake = f"ducklake:{tmp_path / 'dl' / 'lake.ducklake'}#rna_cells"
    member = "a DuckLake catalog cannot be a member of a collection; materialize it as a dataset of its own"
    export = "or export its table to parquet (DuckDB with the ducklake extension: COPY lake.rna_cells TO"
    for args, source, alone in [
        (
            ["ducklake:lake.ducklake", h5ad, "--table", "rna_cells"],
            "ducklake:lake.ducklake",
            " --table rna_cells",
        ),
        (["ducklake:lake.ducklake#rna_cells", h5ad], "ducklake:lake.ducklake#rna_cells", ""),
        (["--sources", str(tmp_path / "dl" / "sources.csv")], lake, ""),
    ]:
        assert main([*args, str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(
            f"omicsio-materialize: error: source {source}: {member} (omicsio-materialize {source} OUT{alone}), {export}"
        ), err
        assert len(err.splitlines()) == 1, err
    assert main([h5ad, str(d / "plate.parquet"), str(out), "--snapshot", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--table/--snapshot/--at apply to a ducklake:CATALOG input materialized on its own, not to" in err
    assert not out.exists()


def test_the_command_line_takes_several_inputs_or_a_sources_file(sources, tmp_path, capsys):
    d, _ = sources
    out = tmp_path / "cli"
    args = [str(d / "current.h5ad"), str(d / "plate.parquet"), str(out), "--no-progress", "--workers", "1"]
    assert main(args) == 0
    ds = oj.open_dataset(out)
    assert ds.presence.dataset_ids == ("current", "plate") and ds.num_cells == 350
    assert main(["--sources", str(_sources_file(d, "s.csv")), str(tmp_path / "s"), "--no-progress"]) == 0
    assert oj.open_dataset(tmp_path / "s").num_cells == 470
    assert (
        main([str(d / "plate.parquet"), str(d / "plate.parquet"), str(tmp_path / "x"), "--no-progress"]) == 2
    )
    assert "name more than one source" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("path,dataset_id,path\nA.h5ad,A,x\n", "names column\\(s\\) path more than once: keep one of each"),
        (
            'path,dataset_id\n"a.h5ad,A\nb.parquet,B\n',
            "cannot read the sources file .*q.csv: CSV parse error",
        ),
        ("path,dataset_id\n", "lists no sources \\(a header and no rows\\)"),
    ],
    ids=["repeated-column", "parse-error", "no-rows"],
)
def test_a_sources_file_that_is_not_a_table_of_sources_is_a_one_line_error(tmp_path, capsys, text, said):
    """A sources file with a column named twice (a traceback), a quote left open (a parse error over
    two lines) or no rows (an error that did not name the file): one line naming the file."""
    import re

    (tmp_path / "q.csv").write_text(text)
    assert main(["--sources", str(tmp_path / "q.csv"), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(said, err) and "q.csv" in err, err
    assert not (tmp_path / "out").exists()


def _h5ad(path, x, var, obs_names=None, **parts):
    """An .h5ad of ``x`` (dense counts) with ``var``; ``parts``: ``raw`` / ``layers`` / ``obs``."""
    import anndata as ad

    obs = parts.pop("obs", pd.DataFrame(index=obs_names or [f"{path.stem}_{i}" for i in range(len(x))]))
    a = ad.AnnData(X=sp.csr_matrix(np.asarray(x, np.float32)), obs=obs, var=var)
    if "raw" in parts:
        a.raw = ad.AnnData(X=sp.csr_matrix(np.asarray(parts.pop("raw"), np.float32)), obs=a.obs, var=a.var)
    for name, layer in parts.pop("layers", {}).items():
        a.layers[name] = sp.csr_matrix(np.asarray(layer, np.float32))
    a.write_h5ad(path)
    return path


def test_sources_whose_gene_names_are_positions_are_refused_not_matched_by_them(tmp_path):
    """AnnData names genes "0", "1", … when their names were lost: matched as symbols, gene i of one
    source became gene i of every other. Numbers are no symbols: the source is refused as one
    without gene ids, and the error says why."""
    a = np.array([[1, 2, 3], [0, 5, 0]], np.float32)
    numbered = pd.DataFrame(index=[str(i) for i in range(3)])
    paths = [_h5ad(tmp_path / "a.h5ad", a, numbered), _h5ad(tmp_path / "b.h5ad", a[:, ::-1], numbered)]
    with pytest.raises(
        oj.DataValidationError,
        match=r"a.h5ad.* has no gene id column: .* holds positions \(0, 1, 2, …, as AnnData .* --gene-id-column",
    ):
        materialize(paths, tmp_path / "out", progress=False, workers=1)
    assert not (tmp_path / "out").exists()
    entrez = pd.DataFrame(index=["7157", "672", "1956"])  # numbers that name genes (Entrez ids): matched
    paths = [_h5ad(tmp_path / "c.h5ad", a, entrez), _h5ad(tmp_path / "d.h5ad", a[:, ::-1], entrez.iloc[::-1])]
    materialize(paths, tmp_path / "entrez", progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "entrez")
    assert ds.num_genes == 3
    np.testing.assert_array_equal(_dense(ds, range(2)), _dense(ds, range(2, 4)))  # the same genes, matched


@pytest.mark.parametrize("missing", [np.nan, ""], ids=["null", "empty"])
def test_genes_without_an_id_are_kept_under_their_symbol_each_its_own(tmp_path, capsys, missing):
    """Spike-ins and transgenes without an Ensembl id (null, or "") are genes of their own, keyed by
    their symbol like a symbol-only source's unmatched genes: not dropped, not summed into one gene
    of id "", and matched across sources by that symbol; reported."""
    a = np.array([[1, 2, 3, 4], [0, 5, 0, 6], [7, 0, 8, 0]], np.float32)
    var = pd.DataFrame(
        {"gene_ids": [_ensg(0), _ensg(1), missing, missing]}, index=["S0", "S1", "ERCC-2", "GFP"]
    )
    b = np.array([[9, 1], [0, 2]], np.float32)
    var_b = pd.DataFrame({"gene_ids": [_ensg(1), missing]}, index=["S1", "GFP"])
    paths = [_h5ad(tmp_path / "a.h5ad", a, var), _h5ad(tmp_path / "b.h5ad", b, var_b)]
    materialize(paths, tmp_path / "out", progress=False, workers=1)
    err = capsys.readouterr().err
    assert (
        "a (" in err and "2 gene(s) without an id in ensembl_id (ERCC-2, GFP) kept under their symbol" in err
    )
    assert "carry different symbols" not in err and "share an id" not in err
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.features["ensembl_id"].tolist() == [_ensg(0), _ensg(1), None, None]
    assert ds.features["gene_name"].tolist() == ["S0", "S1", "ERCC-2", "GFP"]
    np.testing.assert_array_equal(_dense(ds, range(5)), np.vstack([a, [[0, 9, 0, 1], [0, 0, 0, 2]]]))
    assert ds.measured_genes("a").tolist() == [True] * 4
    assert ds.measured_genes("b").tolist() == [False, True, False, True]


def test_genes_with_neither_an_id_nor_a_symbol_are_dropped_and_reported(tmp_path, capsys):
    for k, ids in enumerate([[_ensg(0), None, _ensg(2)], [_ensg(2), ""]]):
        folder = tmp_path / f"plate_{k}"
        folder.mkdir()
        pq.write_table(
            pa.table({"gene_token_id": np.arange(len(ids)), "ensembl_id": pa.array(ids, pa.string())}),
            folder / "gene_metadata.parquet",
        )
        tokens = [list(range(len(ids)))]
        pq.write_table(
            pa.table(
                {
                    "cell_id": [f"p{k}"],
                    "gene_token_id": pa.array(tokens, pa.list_(pa.int32())),
                    "gene_expression": pa.array([[1.0, 2.0, 3.0][: len(ids)]], pa.list_(pa.float32())),
                }
            ),
            folder / "cells.parquet",
        )
    paths = [tmp_path / "plate_0/cells.parquet", tmp_path / "plate_1/cells.parquet"]
    materialize(paths, tmp_path / "out", progress=False, workers=1)
    err = capsys.readouterr().err
    for k in range(2):
        assert f"plate_{k} (" in err
    assert err.count("1 gene(s) with neither an id in ensembl_id nor a symbol: dropped") == 2
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.features["ensembl_id"].tolist() == [_ensg(0), _ensg(2)]  # never one gene of id ""
    np.testing.assert_array_equal(_dense(ds, [0, 1]), [[1, 3], [0, 1]])


def test_a_sources_file_is_read_as_written(sources, tmp_path, capsys):
    """A CSV sources file's ids and text keep their characters (001, 1.10 beside 1.1, 007); an obs
    column is numbers only when every value reads back as written; dates stay, as text. A parquet
    sources file's dates are kept as text, and a column no obs can hold is reported, not lost."""
    d, expected = sources
    (d / "typed.csv").write_text(
        "path,dataset_id,donor_id,collection_date,depth,plate_no,lot,sorted\n"
        "plate.parquet,001,007,2021-05-01,1.5,3,1.50,True\n"
        "plate.parquet,1.10,012,2022-11-30,2,4,1.5,false\n"
        "current.h5ad,1.1,,2023-01-02,,5,,\n"
    )
    materialize(Sources.read(d / "typed.csv"), tmp_path / "csv", progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "csv")
    assert ds.presence.dataset_ids == ("001", "1.10", "1.1")
    n, m = 150, 200
    assert ds.obs["dataset_id"].labels().tolist() == ["001"] * n + ["1.10"] * n + ["1.1"] * m
    donor = ds.obs["donor_id"].labels()
    assert donor[: 2 * n].tolist() == ["007"] * n + ["012"] * n
    assert set(donor[2 * n :]) == {"d1", "d2"}  # the source's own
    dates = ["2021-05-01"] * n + ["2022-11-30"] * n + ["2023-01-02"] * m
    assert ds.obs["collection_date"].labels().tolist() == dates
    np.testing.assert_array_equal(ds.obs["depth"], [1.5] * n + [2.0] * n + [np.nan] * m)
    np.testing.assert_array_equal(ds.obs["plate_no"], [3] * n + [4] * n + [5] * m)
    assert ds.obs["lot"].labels().tolist() == ["1.50"] * n + ["1.5"] * n + [None] * m
    assert ds.obs["sorted"].labels().tolist() == ["true"] * n + ["false"] * n + [None] * m
    pq.write_table(
        pa.table(
            {
                "path": ["plate.parquet", "current.h5ad"],
                "day": pa.array([datetime.date(2021, 5, 1), None], pa.date32()),
                "tags": pa.array([["a", "b"], ["c"]]),
            }
        ),
        d / "typed.parquet",
    )
    materialize(Sources.read(d / "typed.parquet"), tmp_path / "pq", progress=False, workers=1)
    assert "per-source obs 'tags' is of type list<element: string>, which no obs" in capsys.readouterr().err
    ds = oj.open_dataset(tmp_path / "pq")
    assert ds.obs["day"].labels().tolist() == ["2021-05-01"] * n + [None] * m
    assert "tags" not in ds.obs


def _normalized_with_counts(path):
    """An .h5ad whose X is normalized (counts / 2), raw/X the counts and layer ``counts`` 3× them."""
    counts = np.array([[1, 0, 4], [2, 3, 0]], np.float32)
    var = pd.DataFrame(index=[_ensg(i) for i in range(3)])
    _h5ad(path, counts / 2, var, raw=counts, layers={"counts": counts * 3})
    return counts


def test_a_sources_files_raw_is_read_as_true_or_false_and_anything_else_refused(tmp_path):
    counts = _normalized_with_counts(tmp_path / "n.h5ad")
    (tmp_path / "s.csv").write_text(
        "path,dataset_id,raw\nn.h5ad,a,no\nn.h5ad,b,YES\nn.h5ad,c,False\nn.h5ad,d,1\nn.h5ad,e,\n"
    )
    sources = Sources.read(tmp_path / "s.csv")
    assert sources.reading["raw"] == (False, True, False, True, None)
    materialize(sources, tmp_path / "out", progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "out")
    x, raw = counts / 2, counts
    np.testing.assert_array_equal(_dense(ds, range(10)), np.vstack([x, raw, x, raw, x]))
    pq.write_table(pa.table({"path": ["n.h5ad"], "raw": ["false"]}), tmp_path / "s.parquet")
    assert Sources.read(tmp_path / "s.parquet").reading["raw"] == (False,)
    (tmp_path / "bad.csv").write_text("path,dataset_id,raw\nn.h5ad,a,\nn.h5ad,b,maybe\n")
    with pytest.raises(oj.OmicsIOError, match=r"raw of source b \(.*n.h5ad\) is 'maybe': give true or false"):
        Sources.read(tmp_path / "bad.csv")


def test_a_sources_own_layer_or_raw_replaces_the_runs_which_apply_to_anndata_only(sources, tmp_path):
    """A source's own layer clears the run's --raw (and its raw the run's --layer); the run's
    --raw / --layer leave a parquet source of the collection alone; a parquet source given a layer
    of its own, or a source given both, is a one-line error naming it."""
    d, expected = sources
    counts = _normalized_with_counts(tmp_path / "n.h5ad")
    (tmp_path / "s.csv").write_text(
        f"path,dataset_id,layer,raw\nn.h5ad,run,,\nn.h5ad,layer,counts,\nn.h5ad,x,,false\n{d / 'plate.parquet'},plate,,\n"
    )
    materialize(
        Sources.read(tmp_path / "s.csv"),
        tmp_path / "out",
        read=InputOptions(use_raw=True),
        progress=False,
        workers=1,
    )
    ds = oj.open_dataset(tmp_path / "out")
    _, plate_genes, plate = expected["plate"]
    columns = [ds.features["ensembl_id"].tolist().index(g) for g in plate_genes]
    np.testing.assert_array_equal(_dense(ds, range(6))[:, :3], np.vstack([counts, counts * 3, counts / 2]))
    np.testing.assert_array_equal(_dense(ds, range(6, 156))[:, columns], plate.toarray())
    materialize(
        [tmp_path / "n.h5ad", d / "plate.parquet"],
        tmp_path / "layer",
        read=InputOptions(layer="counts"),
        progress=False,
        workers=1,
    )
    np.testing.assert_array_equal(_dense(oj.open_dataset(tmp_path / "layer"), [0, 1])[:, :3], counts * 3)
    (tmp_path / "bad.csv").write_text(f"path,layer\nn.h5ad,\n{d / 'plate.parquet'},counts\n")
    with pytest.raises(oj.OmicsIOError, match=r"source .*plate.parquet is given a layer in the sources file"):
        materialize(Sources.read(tmp_path / "bad.csv"), tmp_path / "bad", progress=False, workers=1)
    (tmp_path / "both.csv").write_text("path,layer,raw\nn.h5ad,counts,true\n")
    with pytest.raises(oj.OmicsIOError, match=r"source .*n.h5ad is given both a layer \('counts'\) and raw"):
        materialize(Sources.read(tmp_path / "both.csv"), tmp_path / "bad", progress=False, workers=1)
    assert not (tmp_path / "bad").exists()


def test_one_anndata_input_given_genes_is_a_collection_of_one(sources, tmp_path):
    """``genes=`` (a gene list, intersection) or ``gene_id_column=`` with a single .h5ad apply to it as
    to a collection of one; a gene list that is not there is an error, not ignored; gene_id_column with
    a single table names the collection of one that takes it."""
    d, expected = sources
    cell_ids, gene_ids, x = expected["current"]
    (tmp_path / "genes.txt").write_text(f"{gene_ids[7]}\n{gene_ids[2]}.9\n")
    read = InputOptions(genes=str(tmp_path / "genes.txt"))
    materialize(d / "current.h5ad", tmp_path / "list", read=read, progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "list")
    assert ds.features["ensembl_id"].tolist() == [gene_ids[7], gene_ids[2]]
    assert ds.cell_ids.tolist() == cell_ids
    np.testing.assert_array_equal(_dense(ds, range(200)), x.toarray()[:, [7, 2]])
    assert ds.presence.dataset_ids == ("current",)
    read = InputOptions(genes="intersection", gene_id_column="ensembl_id")
    materialize(d / "current.h5ad", tmp_path / "all", read=read, progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "all")
    assert ds.features["ensembl_id"].tolist() == gene_ids
    np.testing.assert_array_equal(_dense(ds, range(200)), x.toarray())
    (tmp_path / "foreign.txt").write_text("ENSMUSG00000000001\n")
    with pytest.raises(
        oj.DataValidationError, match=r"foreign.txt: none of its 1 gene\(s\) is among the sources"
    ):
        materialize(
            d / "current.h5ad",
            tmp_path / "foreign",
            read=InputOptions(genes=str(tmp_path / "foreign.txt")),
            progress=False,
            workers=1,
        )
    assert not (tmp_path / "foreign").exists()
    with pytest.raises(oj.OmicsIOError, match="gene list .*nope.parquet not found: --genes"):
        materialize(
            d / "current.h5ad",
            tmp_path / "bad",
            read=InputOptions(genes=tmp_path / "nope.parquet"),
            progress=False,
        )
    with pytest.raises(
        oj.OmicsIOError, match=r"give it as a collection of one: materialize\(\[.*plate.parquet'\]"
    ):
        materialize(
            d / "plate.parquet",
            tmp_path / "bad",
            read=InputOptions(gene_id_column="ensembl_id"),
            progress=False,
        )
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    ("name", "contents", "said"),
    [
        ("g.json", b"{bad", "cannot read the gene list .*g.json: Expecting property name"),
        ("g.json", b"", "cannot read the gene list .*g.json: Expecting value"),
        ("g.json", b'{"ENSG00000000001": "x", "ENSG00000000002": 1}', "must map each gene id to an integer"),
        ("g.json", b'{"TP53": 0}', "holds no gene ids"),
        ("g.csv", b"", "cannot read the gene list .*g.csv: Empty CSV file"),
        ("g.txt", b"\xff\xfeENSG\n", "cannot read the gene list .*g.txt: 'utf-8' codec"),
        ("g.parquet", b"", "cannot read the gene list .*g.parquet: "),
    ],
    ids=["not-json", "empty-json", "mixed-tokens", "no-ids", "empty-csv", "not-utf8", "empty-parquet"],
)
def test_a_gene_list_that_cannot_be_read_is_a_one_line_error(sources, tmp_path, capsys, name, contents, said):
    """A ``--genes`` file that is not what it says (not JSON, empty, not UTF-8, a vocabulary whose
    tokens are not integers, or one without Ensembl ids): one line naming it and what --genes takes,
    nothing written (each raised from inside the reader, a traceback, before)."""
    import re

    d, _ = sources
    (tmp_path / name).write_bytes(contents)
    out = tmp_path / "out"
    assert (
        main([str(d / "current.h5ad"), str(d / "plate.parquet"), str(out), "--genes", str(tmp_path / name)])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(said, err), err
    assert not out.exists()


def test_a_sources_own_obs_dataset_id_is_kept_as_input_dataset_id_and_said(tmp_path, capsys):
    """CELLxGENE's files carry an obs ``dataset_id`` of their own: kept as ``input_dataset_id`` (with a
    note), not overwritten by the collection's ``dataset_id`` of each source (here from a sources
    file, its ids; a source without the column gets nulls there); left out by ``--obs``, without the note."""
    genes = pd.DataFrame(index=[_ensg(i) for i in range(3)])
    for name in ("x", "y"):
        obs = pd.DataFrame({"dataset_id": [f"cxg-{name}"] * 2}, index=[f"{name}0", f"{name}1"])
        _h5ad(tmp_path / f"{name}.h5ad", np.ones((2, 3)), genes, obs=obs)
    _h5ad(tmp_path / "z.h5ad", np.ones((1, 3)), genes)
    (tmp_path / "s.csv").write_text("path,dataset_id\nx.h5ad,X\ny.h5ad,Y\nz.h5ad,Z\n")
    assert main(["--sources", str(tmp_path / "s.csv"), str(tmp_path / "out"), "--no-progress"]) == 0
    assert (
        "materialize: obs column dataset_id of 2 source(s) (X, Y) kept as input_dataset_id: the dataset's "
        "dataset_id is the collection's id of each source (from its path, or the sources file's dataset_id)\n"
        in capsys.readouterr().err
    )
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.obs["dataset_id"].labels().tolist() == ["X", "X", "Y", "Y", "Z"]
    assert ds.obs["input_dataset_id"].labels().tolist() == ["cxg-x", "cxg-x", "cxg-y", "cxg-y", None]
    # with --obs leaving it out, nothing is kept and nothing is said of it
    assert main(["--sources", str(tmp_path / "s.csv"), str(tmp_path / "out2"), "--obs", "dataset_id"]) == 0
    assert "input_dataset_id" not in capsys.readouterr().err
    assert "input_dataset_id" not in oj.open_dataset(tmp_path / "out2").obs


def test_a_given_gene_list_reports_the_genes_it_drops_and_those_no_source_measured(tmp_path, capsys):
    """``--genes`` a gene list: the sources' genes not in it are dropped, those of it no source
    measured are columns of zeros; one note each (genes counted, not nonzeros)."""
    _h5ad(tmp_path / "a.h5ad", np.eye(4), pd.DataFrame(index=[_ensg(i) for i in range(4)]))
    _h5ad(tmp_path / "b.h5ad", np.eye(3), pd.DataFrame(index=[_ensg(i) for i in (3, 5, 6)]))
    (tmp_path / "genes.txt").write_text(f"{_ensg(1)}\n{_ensg(5)}\n{_ensg(9)}\n")
    genes = str(tmp_path / "genes.txt")
    args = [str(tmp_path / "a.h5ad"), str(tmp_path / "b.h5ad"), str(tmp_path / "out"), "--genes", genes]
    assert main([*args, "--no-progress"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "--genes" in line]
    assert notes == [
        f"materialize: --genes {genes}: 4 of the sources' 6 genes are not in it and were dropped, with their "
        f"values: a ({tmp_path / 'a.h5ad'}): 3 ({_ensg(0)}, {_ensg(2)}, {_ensg(3)}); "
        f"b ({tmp_path / 'b.h5ad'}): 2 ({_ensg(3)}, {_ensg(6)})",
        f"materialize: --genes {genes}: 1 of its 3 gene(s) measured by no source ({_ensg(9)}): their "
        "columns are all zeros, and presence marks them unmeasured",
    ]
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.features["ensembl_id"].tolist() == [_ensg(1), _ensg(5), _ensg(9)]
    assert ds.measured_genes("a").tolist() == [True, False, False]
    assert main([*args[:2], str(tmp_path / "both"), "--genes", "intersection", "--no-progress"]) == 0
    assert "dropped" not in capsys.readouterr().err  # dropping them is the point of an intersection


def test_a_table_source_without_a_gene_table_is_told_where_to_put_one(tmp_path, capsys):
    """A list-column source without a gene table has token ids only, which a collection cannot
    match across sources: the error says so and names the file to put beside it."""
    for name in ("small", "big"):
        (tmp_path / name).mkdir()
        pq.write_table(
            pa.table(
                {
                    "cell_id": [f"{name}0"],
                    "gene_token_id": pa.array([[0, 1]], pa.list_(pa.int32())),
                    "gene_expression": pa.array([[1.0, 2.0]], pa.list_(pa.float32())),
                }
            ),
            tmp_path / name / "cells.parquet",
        )
    paths = [str(tmp_path / n / "cells.parquet") for n in ("small", "big")]
    assert main([*paths, str(tmp_path / "ds"), "--no-progress"]) == 2
    assert (
        f"error: small ({paths[0]}) has no gene table: its genes are token ids only, which a collection "
        "cannot match across sources; put its gene table beside it as gene_metadata.parquet (columns "
        "gene_token_id, ensembl_id), in its folder or one above\n" in capsys.readouterr().err
    )
    assert not (tmp_path / "ds").exists()


def test_uint64_obs_keep_their_values_beyond_int64(tmp_path):
    import anndata as ad

    values = np.arange(3, dtype=np.uint64) + np.uint64(2**63)
    obs = pd.DataFrame({"hash": values}, index=["a", "b", "c"])
    path = _h5ad(tmp_path / "u.h5ad", np.eye(3), pd.DataFrame(index=[_ensg(i) for i in range(3)]), obs=obs)
    assert ad.read_h5ad(path).obs["hash"].dtype == np.uint64
    materialize(path, tmp_path / "one", progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "one")
    np.testing.assert_array_equal(ds.obs["hash"], values)
    assert ds.obs["hash"].dtype == np.uint64
    np.testing.assert_array_equal(ds.rows_where("hash", [int(values[1])]), [1])
    sources = Sources((str(path), str(path)), ("x", "y"))
    materialize(sources, tmp_path / "two", progress=False, workers=1)
    np.testing.assert_array_equal(oj.open_dataset(tmp_path / "two").obs["hash"], np.tile(values, 2))


def test_a_sources_files_empty_dataset_id_is_the_sources_default_id(tmp_path):
    """An empty ``dataset_id`` cell (CSV) or a null (parquet) names the source by its file, as a
    sources file without the column does; it is not the id "" or "None"."""
    _normalized_with_counts(tmp_path / "n.h5ad")
    _normalized_with_counts(tmp_path / "m.h5ad")
    (tmp_path / "s.csv").write_text("path,dataset_id\nn.h5ad,\nm.h5ad,plate_2\n")
    assert Sources.read(tmp_path / "s.csv").dataset_ids == ("n", "plate_2")
    pq.write_table(
        pa.table({"path": ["n.h5ad", "m.h5ad"], "dataset_id": [None, "b"]}), tmp_path / "s.parquet"
    )
    assert Sources.read(tmp_path / "s.parquet").dataset_ids == ("n", "b")


@pytest.mark.parametrize(
    ("paths", "ids"),
    [
        (("a.h5ad", "b.h5ad", "plates/*.parquet"), ("a", "b", "plates")),
        (("x/plate_1/cells.parquet", "x/plate_2/cells.parquet"), ("plate_1", "plate_2")),
        (("a.h5ad", "d2/a.h5ad"), ("a", "d2/a")),
        (("/data/a.h5ad", "/data/b/a.h5ad"), ("data", "b")),
        (("r1/s/a.h5ad", "r2/s/a.h5ad"), ("r1/s/a", "r2/s/a")),
        (("a/plates/*.parquet", "b/plates/*.parquet"), ("a", "b")),
    ],
)
def test_default_dataset_ids_are_the_shortest_names_that_tell_the_sources_apart(paths, ids):
    """File names; where they repeat, the folders' if each source has one of its own, else the
    shortest ends of the paths that differ (never a folder for one source and a file for another)."""
    assert Sources(paths).dataset_ids == ids


def test_a_source_given_twice_without_ids_is_refused():
    with pytest.raises(oj.OmicsIOError, match="dataset id.*a name more than one source"):
        Sources(("a.h5ad", "./a.h5ad"))


def test_gene_moments_are_over_the_cells_of_the_sources_that_measured_the_gene(collection, sources):
    """A gene a source did not measure is unknown in its cells, not zero: its means and variances
    (and so the highly variable genes) are over the cells of the sources that measured it."""
    _, expected = sources
    ds = oj.open_dataset(collection)
    ensembl = ds.features["ensembl_id"].tolist()
    norm = np.full((ds.num_cells, ds.num_genes), np.nan)  # NaN: not measured
    first = 0
    for cell_ids, gene_ids, matrix in expected.values():
        x = matrix.toarray().astype(np.float64)
        totals = x.sum(axis=1, keepdims=True)
        rows = slice(first, first + len(cell_ids))
        norm[rows, [ensembl.index(g) for g in gene_ids]] = np.divide(
            x * 1e4, totals, out=np.zeros_like(x), where=totals > 0
        )
        first += len(cell_ids)
    stats = ds.gene_stats
    np.testing.assert_array_equal(stats["n_measured"], (~np.isnan(norm)).sum(axis=0))
    np.testing.assert_allclose(stats["norm_mean"], np.nanmean(norm, axis=0), rtol=1e-10)
    np.testing.assert_allclose(stats["norm_var"], np.nanvar(norm, axis=0, ddof=1), rtol=1e-8)
    np.testing.assert_allclose(stats["log_mean"], np.nanmean(np.log1p(norm), axis=0), rtol=1e-10)
    # genes 20..44 were measured by two sources, 0..19 and 45..99 by one: the divisors differ
    assert len(set(stats["n_measured"])) > 1
    hvg = ds.highly_variable_genes(10)
    from omicsio_jax.format.hvg import seurat_hvg

    np.testing.assert_array_equal(
        hvg, seurat_hvg(np.nanmean(norm, axis=0), np.nanvar(norm, axis=0, ddof=1), 10)
    )


def test_a_gene_no_source_measured_has_no_moments_and_is_never_highly_variable():
    from omicsio_jax.format.hvg import seurat_hvg

    rng = np.random.default_rng(3)
    mean, var = rng.uniform(0.1, 5, 40), rng.uniform(0.1, 20, 40)
    with_gap = np.insert(mean, 7, np.nan), np.insert(var, 7, np.nan)
    chosen = seurat_hvg(*with_gap, 5)
    want = seurat_hvg(mean, var, 5)
    np.testing.assert_array_equal(chosen, want + (want >= 7))
    with pytest.raises(oj.OmicsIOError, match=r"1\.\.40 \(the genes measured in some cell\)"):
        seurat_hvg(*with_gap, 41)
