"""Streaming from queries and the in-memory panel loaders: exact batches, coverage, shuffling,
sharding on 8 fake CPU devices, and bit-exact replay of the in-memory loaders."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import table_csr

import omicsio_jax as oj
from materialize import Layout, materialize
from omicsio_jax.loaders import memory_device, stream

PANEL = [0, 3, 17, 40, 41, 500, 1999, 1234]


@pytest.fixture(scope="module")
def table(corpus):
    return oj.open_table(corpus.cells_parquet)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",))


@pytest.fixture(scope="module")
def reference(corpus_table):
    """Every cell's full dense row (3,000 × 2,000), from pyarrow + numpy only."""
    indptr, indices, values = table_csr(corpus_table)
    dense = np.zeros((len(indptr) - 1, 2000), np.float32)
    rows = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    dense[rows, indices] = values
    return dense


def host(a) -> np.ndarray:
    return np.asarray(a)


def assert_data_sharded(arr, mesh) -> None:
    want = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    assert arr.sharding.is_equivalent_to(want, arr.ndim)


# ----- streaming from a query ------------------------------------------------------------------
def test_stream_loader_full_rows_in_table_order(table, reference, mesh, monkeypatch):
    monkeypatch.setattr(stream, "QUERY_BATCH_ROWS", 300)  # batches of 256 straddle the query's record batches
    loader = oj.make_stream_loader(
        table,
        batch_size=256,
        where="tissue = 'lung'",
        obs=("cell_type", "n_genes"),
        placement=mesh,
    )
    batches = list(loader)
    rows = table.select("tissue = 'lung'")
    assert len(batches) == -(-len(rows) // 256)
    for b in batches:
        assert b.x.shape == (256, 2000) and b.x.dtype == np.float32
        assert_data_sharded(b.x, mesh)
    index = np.concatenate([host(b.index)[host(b.mask)] for b in batches])
    np.testing.assert_array_equal(index, rows)  # table order, each cell once
    x = np.concatenate([host(b.x)[host(b.mask)] for b in batches])
    np.testing.assert_array_equal(x, reference[rows])
    last = batches[-1]
    assert not host(last.x)[~host(last.mask)].any() and (host(last.index)[~host(last.mask)] == -1).all()
    meta = table.metadata(["cell_type", "n_genes"], rowids=rows)
    cats = table.categories("cell_type")
    codes = np.concatenate([host(b.obs["cell_type"])[host(b.mask)] for b in batches])
    assert [cats[c] for c in codes] == meta.column("cell_type").to_pylist()
    n_genes = np.concatenate([host(b.obs["n_genes"])[host(b.mask)] for b in batches])
    np.testing.assert_array_equal(n_genes, meta.column("n_genes").to_numpy().astype(np.float32))


def test_stream_loader_shuffle_window_panel_and_normalize(table, reference, mesh):
    kw = dict(
        batch_size=128,
        output=oj.Panel(table.genes.names(PANEL), normalize="log1p"),
        sampling=oj.Stream(shuffle=True, fetch_factor=8),
        seed=3,
        placement=mesh,
    )
    loader = oj.make_stream_loader(table, **kw)
    epoch0 = [(host(b.index), host(b.x)) for b in loader.epoch(0)]
    assert len(epoch0) == 3000 // 128
    index = np.concatenate([i for i, _ in epoch0])
    assert len(np.unique(index)) == len(index) == 128 * (3000 // 128)
    assert not np.array_equal(index, np.sort(index))  # shuffled ...
    first_window = index[: 7 * 128]  # ... but only within a window of ~1,000 rows
    assert first_window.max() < 1000 + 128
    x = np.concatenate([x for _, x in epoch0])
    np.testing.assert_array_equal(x, np.log1p(reference[index][:, PANEL]))
    again = [host(b.index) for b in oj.make_stream_loader(table, **kw).epoch(0)]
    np.testing.assert_array_equal(np.concatenate(again), index)  # same seed, same order
    other = np.concatenate([host(b.index) for b in loader.epoch(1)])
    assert not np.array_equal(other, index)


@pytest.mark.parametrize("where", ["make", "place"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_stream_batch_that_fails_once_is_made_again_by_the_next_call(table, monkeypatch, where, error):
    """A batch that fails once, made (its error ended the query's thread: the next call ended the
    pass, whose audit failed as cells not served) or placed (its cells were tallied and the step
    moved past it: the batch lost), is made again by the next call, which runs the query again from
    that step; a state written in the handler stands before it."""
    kw = {"batch_size": 128, "sampling": oj.Stream(shuffle=True, fetch_factor=8), "seed": 3}
    expected = [host(b.index) for b in oj.make_stream_loader(table, **kw).epoch(0)]
    owner, name = (stream.StreamLoader, "_batch") if where == "make" else (stream, "place_batch")
    target, calls = getattr(owner, name), []

    def fails_once(*args):
        calls.append(1)
        if len(calls) == 6:
            raise error("transient")
        return target(*args)

    monkeypatch.setattr(owner, name, fails_once)
    with oj.make_stream_loader(table, **kw).epoch(0) as batches:
        served = [host(next(batches).index) for _ in range(5)]
        with pytest.raises(error, match="transient"):
            next(batches)
        state = batches.get_state()
        assert state["step"] == 5 and oj.Tally.from_json(state["served"]).count == 5 * 128
        served += [host(b.index) for b in batches]  # the pass's audit passes
    assert len(served) == len(expected)
    for got, want in zip(served, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    with oj.make_stream_loader(table, **kw).epoch(0) as batches:  # the handler's state: the failed step on
        batches.set_state(state)
        for got, want in zip([host(b.index) for b in batches], expected[5:], strict=True):
            np.testing.assert_array_equal(got, want)


def test_stream_loader_refuses_bad_arguments(table, mesh, dataset_dir):
    with pytest.raises(oj.OmicsIOError, match="divisible by the 8 devices"):
        oj.make_stream_loader(table, batch_size=100, placement=mesh)
    with pytest.raises(oj.UnknownGeneError):
        oj.make_stream_loader(table, batch_size=8, output=oj.Panel(["NOPE"]))
    with pytest.raises(
        oj.OmicsIOError, match=r"a cell table, oj.open_table\(path\), not Dataset: .* oj.make_loader"
    ):
        oj.make_stream_loader(oj.open_dataset(dataset_dir), batch_size=8)  # was an AttributeError


def test_passes_and_queries_run_at_once_and_a_with_block_closes_them_all(corpus, reference):
    import threading

    def running() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "omicsio-jax-prefetch"}

    before = running()
    with (
        oj.open_table(corpus.cells_parquet) as table,
        oj.make_stream_loader(table, batch_size=64, read=oj.ReadOptions(prefetch=2)) as loader,
    ):
        for _ in loader:  # left while its query still reads ahead
            break
        held, other = iter(loader), loader.epoch(1)
        for step in range(3):  # two passes at once, each on a connection of its own
            np.testing.assert_array_equal(host(next(held).x), reference[64 * step : 64 * (step + 1)])
            next(other)
        # queries while both stream (on the table's one connection they failed: "open result")
        assert len(table.select("true")) == len(reference)
        assert table.sql("SELECT count(*) AS n FROM cells").column("n")[0].as_py() == len(reference)
        # a stream's where may name the table's other views, made again on the stream's connection
        where = "list_contains(gene_token_id, (SELECT min(gene_token_id) FROM gene_metadata))"
        near = oj.make_stream_loader(
            table, batch_size=8, where=where, sampling=oj.Stream(drop_remainder=True)
        )
        rows = np.concatenate([np.asarray(b.index) for b in near])
        np.testing.assert_array_equal(rows, table.select(where)[: len(rows)])
        assert len(rows) == len(table.select(where)) // 8 * 8 > 0
        readers = running() - before
        assert len(readers) >= 2  # the held passes' query threads run while the block does
    for t in readers:
        t.join(timeout=10)
    assert not [t for t in readers if t.is_alive()]
    for closed in (held, other):
        with pytest.raises(ValueError, match="closed"):
            next(closed)
    with pytest.raises(oj.OmicsIOError, match="is closed"):
        table.select("true")


# ----- loading a panel into RAM ----------------------------------------------------------------
@pytest.fixture(scope="module")
def panel_dataset(corpus, tmp_path_factory):
    """The corpus materialized in the dense layout of PANEL."""
    root = tmp_path_factory.mktemp("panelds")
    (root / "panel.txt").write_text("\n".join(map(str, PANEL)) + "\n")
    materialize(
        corpus.cells_parquet,
        root / "out",
        progress=False,
        layout=Layout(panel=root / "panel.txt", shard_cells=1024),
    )
    return oj.open_dataset(root / "out")


def test_load_panel_from_table_dense_dataset_and_sparse_dataset_agree(
    table, panel_dataset, dataset_dir, reference
):
    names = table.genes.names(PANEL)
    from_table = oj.load_panel(table, names, obs=("cell_type",), progress=False)
    from_dense = oj.load_panel(panel_dataset, obs=("cell_type",), progress=False)
    from_sparse = oj.load_panel(oj.open_dataset(dataset_dir), names, obs=("cell_type",), progress=False)
    for p in (from_table, from_dense, from_sparse):
        np.testing.assert_array_equal(p.x, reference[:, PANEL])
        np.testing.assert_array_equal(p.rowids, np.arange(3000))
        assert p.x.ctypes.data % 64 == 0 and list(p.genes) == names
    cats = from_table.categories["cell_type"]
    assert [cats[c] for c in from_table.obs["cell_type"]] == [
        from_dense.categories["cell_type"][c] for c in from_dense.obs["cell_type"]
    ]
    lung = oj.load_panel(table, PANEL, where="tissue = 'lung'", normalize="log1p", progress=False)
    np.testing.assert_array_equal(lung.rowids, table.select("tissue = 'lung'"))
    np.testing.assert_array_equal(lung.x, np.log1p(reference[lung.rowids][:, PANEL]))
    assert len({from_table.fingerprint, from_dense.fingerprint, lung.fingerprint}) == 3
    with pytest.raises(oj.OmicsIOError, match="needs genes="):
        oj.load_panel(table)


# ----- in-memory loaders -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def panel(panel_dataset):
    return oj.load_panel(panel_dataset, obs=("cell_type",), progress=False)


def collect(loader, n):
    out = []
    for _ in range(n):
        b = next(loader)
        out.append((host(b.x), host(b.index), host(b.mask), host(b.obs["cell_type"])))
    return out


@pytest.mark.parametrize("placement", ["host", "device"])
def test_memory_loader_batches_are_the_panel_rows(panel, mesh, placement):
    loader = oj.make_memory_loader(
        panel, batch_size=256, seed=1, num_epochs=2, on_device=placement == "device", placement=mesh
    )
    per_epoch = loader.steps_per_epoch
    batches = list(loader)
    assert len(batches) == 2 * per_epoch
    for b in batches:
        assert_data_sharded(b.x, mesh)
        assert b.x.shape == (256, len(PANEL))
        rows = host(b.index)
        np.testing.assert_array_equal(host(b.x), panel.x[rows])
        np.testing.assert_array_equal(host(b.obs["cell_type"]), panel.obs["cell_type"][rows])
    for e in range(2):
        seen = np.concatenate([host(b.index) for b in batches[e * per_epoch : (e + 1) * per_epoch]])
        assert len(np.unique(seen)) == len(seen)  # each cell at most once per epoch
        assert len(seen) >= 3000 - 256 - 8
    first = [host(b.index) for b in batches[:per_epoch]]
    second = [host(b.index) for b in batches[per_epoch:]]
    assert not np.array_equal(np.concatenate(first), np.concatenate(second))  # a new order each epoch


def test_host_loader_covers_every_cell_with_padding(panel, mesh):
    loader = oj.make_memory_loader(panel, batch_size=512, seed=0, placement=mesh, drop_remainder=False)
    batches = list(loader)
    assert len(batches) == -(-3000 // 512)
    seen = np.concatenate([host(b.index)[host(b.mask)] for b in batches])
    np.testing.assert_array_equal(np.sort(seen), np.arange(3000))
    last = batches[-1]
    assert host(last.mask).sum() == 3000 % 512 and not host(last.x)[~host(last.mask)].any()


def test_host_loader_hosts_take_disjoint_slices_of_the_global_batch(panel):
    def stream(h):
        loader = oj.make_memory_loader(
            panel, batch_size=256, seed=4, placement=oj.Placement(process_index=h, process_count=2)
        )
        return [b.index for b in loader._host_batches(0, 0)]

    a, b = stream(0), stream(1)
    whole = oj.make_memory_loader(panel, batch_size=256, seed=4)  # held: its batches are made while it is
    single = [hb.index for hb in whole._host_batches(0, 0)]
    assert len(a) == len(b) == len(single)
    for x, y, z in zip(a, b, single, strict=True):
        np.testing.assert_array_equal(np.concatenate([x, y]), z)


@pytest.mark.parametrize(("placement", "prefetch"), [("host", 0), ("host", 2), ("device", 0)])
def test_memory_loader_replays_bit_exactly(panel, mesh, placement, prefetch):
    kw = dict(
        batch_size=256,
        seed=7,
        num_epochs=None,
        on_device=placement == "device",
        placement=mesh,
        read=oj.ReadOptions(prefetch=prefetch),
    )
    loader = oj.make_memory_loader(panel, **kw)
    steps = loader.steps_per_epoch
    states, batches = [], []
    for _ in range(3 * steps + 2):
        states.append(json.loads(json.dumps(loader.get_state())))
        batches.append(collect(loader, 1)[0])
    assert len(json.dumps(states[0])) < 1024
    for k in (0, 1, steps - 1, steps, 2 * steps + 1, 3 * steps):
        fresh = oj.make_memory_loader(panel, **kw)
        fresh.set_state(states[k])
        for got, want in zip(collect(fresh, 2), batches[k : k + 2], strict=True):
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
    loader.set_state(states[1])  # rewinding a running loader (prefetch thread live) works too
    np.testing.assert_array_equal(collect(loader, 1)[0][1], batches[1][1])
    loader.close()


def test_device_loader_on_a_2d_mesh_counts_each_cell_once(panel):
    """Batches sharded along "data" and replicated along "model": the coverage tally counts each data
    shard once, not once per replica, so the state's tally is the cells served and the audit passes."""
    mesh2 = jax.make_mesh((4, 2), ("data", "model"))
    placement = oj.Placement(mesh2, data_axis="data")
    loader = oj.make_memory_loader(panel, batch_size=256, seed=3, on_device=True, placement=placement)
    first = host(next(loader).index)
    assert loader.coverage().served == oj.Tally.of(first)
    assert loader.get_state()["served"] == oj.Tally.of(first).to_json()
    rest = [host(b.index) for b in loader]  # the epoch's audit passes at its last step
    seen = np.concatenate([first, *rest])
    assert len(seen) == loader.steps_per_epoch * 256 and len(np.unique(seen)) == len(seen)


def test_memory_loader_refuses_state_from_another_config(panel, mesh):
    state = oj.make_memory_loader(panel, batch_size=256, seed=7, placement=mesh).get_state()
    other = oj.make_memory_loader(panel, batch_size=256, seed=8, placement=mesh)
    with pytest.raises(oj.StateMismatchError, match=r"seed: in checkpoint 7, in loader 8"):
        other.set_state(state)


def test_device_draw_stays_on_each_device(panel, mesh):
    loader = oj.make_memory_loader(panel, batch_size=256, seed=0, on_device=True, placement=mesh)
    next(loader)
    placed = loader._device_panel
    hlo = (
        memory_device._draw.lower(placed.arrays, placed._perm, 0, placed._acc, rows=placed.rows_local)
        .compile()
        .as_text()
    )
    for collective in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
        assert collective not in hlo
    x = placed.arrays["x"]
    assert x.shape[0] == 8 and [s.data.shape for s in x.addressable_shards][0] == (1, x.shape[1], len(PANEL))


def test_memory_loader_argument_errors(panel, mesh):
    with pytest.raises(oj.OmicsIOError, match="multiple of the 1 host"):
        oj.make_memory_loader(panel, batch_size=100, placement=mesh)
    with pytest.raises(oj.OmicsIOError, match="always drops the remainder"):
        oj.make_memory_loader(panel, batch_size=256, on_device=True, drop_remainder=False)
    with pytest.raises(oj.OmicsIOError, match="placement must be"):
        oj.make_memory_loader(panel, batch_size=256, placement="gpu")


def test_a_numeric_obs_float32_batches_cannot_hold_is_a_one_line_error(corpus, corpus_table, tmp_path):
    """An integer obs past ±2²⁴ read from a table: refused naming the column, not Arrow's cast error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    big = pa.array(10**12 + np.arange(len(corpus_table), dtype=np.int64))
    pq.write_table(corpus_table.append_column("barcode", big), tmp_path / "cells.parquet")
    table = oj.open_table(tmp_path / "cells.parquet", genes=corpus.genes_parquet)
    with pytest.raises(oj.OmicsIOError, match=r"obs 'barcode' holds int64 values that float32") as caught:
        next(iter(oj.make_stream_loader(table, batch_size=64, obs="barcode")))
    assert "\n" not in str(caught.value)


def test_a_list_column_as_obs_is_refused_when_the_loader_is_built(table):
    for column in ("gene_token_id", "gene_expression"):
        with pytest.raises(
            oj.OmicsIOError, match=rf"obs '{column}' of .* holds list<.*not one value per cell"
        ):
            oj.make_stream_loader(table, batch_size=8, obs=column)


def test_a_memory_loaders_len_is_its_runs_batches(panel):
    loader = oj.make_memory_loader(panel, batch_size=512, seed=0, num_epochs=3, drop_remainder=False)
    assert len(loader) == 3 * loader.steps_per_epoch == sum(1 for _ in loader)
    empty = oj.make_memory_loader(panel, batch_size=512, seed=0, num_epochs=0)
    assert len(empty) == 0 and empty
