"""The option objects the entry points take: each validates itself with a one-line error that names
the fix, and means exactly what the plan, the loader or materialize does with it."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import omicsio_jax as oj
from materialize import Dask, InputOptions, Layout, materialize
from omicsio_jax.loaders import options
from omicsio_jax.loaders.options import (
    MAX_DEFAULT_THREADS,
    SMALL_BATCH,
    SPLIT_BATCH_BYTES,
    default_batches_ahead,
    default_decode_threads,
    default_num_threads,
    default_prefetch,
    usable_cores,
)
from omicsio_jax.outputs import scatter
from omicsio_jax.sampling.plan import AllRows, SamplingPlan


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: oj.Block(0), r"Block\(block_size=\.\.\.\) must be a positive integer, got 0"),
        (lambda: oj.Block(16, 2.5), r"Block\(fetch_factor=\.\.\.\) must be a positive integer, got 2.5"),
        (lambda: oj.Block(True), r"Block\(block_size=\.\.\.\) must be a positive integer, got True"),
        (lambda: oj.Random(fetch_factor=-1), r"Random\(fetch_factor=\.\.\.\)"),
        (lambda: oj.Stream(drop_remainder=1), r"Stream\(drop_remainder=\.\.\.\) must be True or False"),
        (lambda: oj.ClassBalanced(""), r"ClassBalanced\(by=\.\.\.\) takes a categorical obs column"),
        (lambda: oj.ReadOptions(num_threads=-1), r"ReadOptions\(num_threads=\.\.\.\) must be an integer ≥ 0"),
        (
            lambda: oj.ReadOptions(decode_threads=0),
            r"ReadOptions\(decode_threads=\.\.\.\) must be an integer ≥ 1",
        ),
        (lambda: oj.Placement(process_count=0), r"Placement\(process_count=\.\.\.\) must be an integer ≥ 1"),
        (
            lambda: oj.Placement(process_index=2, process_count=2),
            r"process_index=2\) must be below process_count 2",
        ),
        (lambda: oj.Normalization("zscore"), r"normalize must be None, 'log1p' or 'normalize_log1p'"),
        (lambda: oj.Normalization("log1p", target_sum=0), r"target_sum=0 must be a positive"),
        (lambda: Layout(shard_cells=1000), r"shard_cells must be a power of two"),
        (
            lambda: Layout(shard_cells=1024, group_size=2048),
            r"group_size must be a power of two ≤ shard_cells",
        ),
        (
            lambda: InputOptions(batch_cells=0),
            r"InputOptions\(batch_cells=\.\.\.\) must be a positive integer",
        ),
        (lambda: Dask(), r"Dask\(\.\.\.\) takes one of scheduler="),
        (lambda: Dask("tcp://a:1", "s.json"), r"Dask\(\.\.\.\) takes one of scheduler="),
    ],
)
def test_options_refuse_bad_values_with_one_line_errors(make, match):
    with pytest.raises(oj.OmicsIOError, match=match) as info:
        make()
    assert "\n" not in str(info.value)


def test_a_normalization_error_is_also_a_value_error():
    with pytest.raises(ValueError, match="normalize='log2'"):
        oj.Normalization("log2")


def test_placement_takes_a_mesh_and_refuses_an_axis_it_lacks():
    mesh = jax.make_mesh((8,), ("data",))
    assert oj.Placement.of(mesh) == oj.Placement(mesh)
    assert oj.Placement.of(None) == oj.Placement()
    assert oj.Placement(mesh).num_slabs == 8
    with pytest.raises(oj.OmicsIOError, match=r"data_axis='batch'\) is not an axis of the mesh \('data',\)"):
        oj.Placement(mesh, data_axis="batch")
    with pytest.raises(oj.OmicsIOError, match="placement must be an oj.Placement"):
        oj.Placement.of("gpu")


def test_read_options_fill_only_what_is_left_to_the_loader():
    chosen = oj.ReadOptions(num_threads=0).with_defaults(num_threads=1, prefetch=2, decode_threads=1)
    assert chosen == oj.ReadOptions(num_threads=0, prefetch=2, decode_threads=1)


@pytest.mark.parametrize(
    ("kind", "cores", "batch_size", "threads"),
    [
        ("dense", 1, 1024, 1),
        ("dense", 2, 1024, 2),
        ("geneformer", 2, 256, 2),
        ("dense", 16, 64, MAX_DEFAULT_THREADS),
        ("csr", 6, 64, 3),
        ("csr", 64, 1024, MAX_DEFAULT_THREADS),
        # 1–2 cores: slabs, and dense or panel batches of up to SMALL_BATCH rows, on the consumer's thread
        ("csr", 1, 1024, 0),
        ("csr", 2, 1024, 0),
        ("dense", 2, SMALL_BATCH, 0),
        ("dense", 2, SMALL_BATCH + 1, 2),
        ("geneformer", 2, 64, 2),
        ("dense", 2, None, 2),
    ],
)
def test_default_threads_follow_the_output_the_batch_size_and_the_cores(kind, cores, batch_size, threads):
    assert default_num_threads(kind, cores, batch_size) == threads


def test_the_loader_takes_its_default_threads_from_the_output_and_keeps_an_explicit_setting(dataset_dir):
    with oj.open_dataset(dataset_dir) as ds:
        for output, kind in ((oj.Dense(), "dense"), (oj.CSR(), "csr")):
            loader = oj.make_loader(ds, batch_size=64, output=output)
            assert loader.num_threads == default_num_threads(kind, usable_cores(), batch_size=64)
            loader.close()
        loader = oj.make_loader(ds, batch_size=64, read=oj.ReadOptions(num_threads=0))
        assert loader.num_threads == 0
        loader.close()


@pytest.mark.parametrize(
    ("kind", "num_threads", "batch_bytes", "cores", "decode"),
    [
        ("dense", 0, SPLIT_BATCH_BYTES, 4, 4),  # the consumer decodes a large dense batch: every core
        ("dense", 0, SPLIT_BATCH_BYTES, 2, 1),  # ... but on 2 cores the other reads ahead
        ("dense", 0, SPLIT_BATCH_BYTES, 1, 1),
        ("dense", 0, SPLIT_BATCH_BYTES, 64, MAX_DEFAULT_THREADS),
        ("dense", 0, SPLIT_BATCH_BYTES - 1, 4, 1),  # a small one (a panel's): one thread
        ("dense", 2, SPLIT_BATCH_BYTES, 4, 1),  # batches decode ahead, one thread each
        ("csr", 0, SPLIT_BATCH_BYTES, 4, 1),  # slabs: a copy, not rows to write
        ("geneformer", 0, SPLIT_BATCH_BYTES, 4, 1),
    ],
)
def test_default_decode_threads_split_only_a_large_dense_batch_the_consumer_decodes(
    kind, num_threads, batch_bytes, cores, decode
):
    assert default_decode_threads(kind, num_threads, batch_bytes, cores) == decode


@pytest.mark.parametrize(("cores", "split"), [(4, 4), (2, 1)])
def test_the_loader_splits_a_large_dense_batch_over_the_cores_unless_told(
    dataset_dir, monkeypatch, cores, split
):
    with oj.open_dataset(dataset_dir) as ds:
        batch_bytes = 64 * ds.num_genes * 4
        # the test dataset's dense batch is "large", on a machine of `cores` cores
        monkeypatch.setattr(options, "SPLIT_BATCH_BYTES", batch_bytes)
        monkeypatch.setattr(options, "usable_cores", lambda: cores)
        dense = oj.make_loader(ds, batch_size=64, output=oj.Dense(), read=oj.ReadOptions(num_threads=0))
        told = oj.make_loader(ds, batch_size=64, read=oj.ReadOptions(num_threads=0, decode_threads=1))
        ahead = oj.make_loader(ds, batch_size=64, read=oj.ReadOptions(num_threads=2))
        smaller = oj.make_loader(ds, batch_size=32, read=oj.ReadOptions(num_threads=0))
        try:
            assert dense.decode_threads == split
            assert f"decode_threads={split})" in repr(dense)
            assert told.decode_threads == ahead.decode_threads == smaller.decode_threads == 1
        finally:
            for loader in (dense, told, ahead, smaller):
                loader.close()


@pytest.mark.parametrize(
    ("kind", "num_threads", "batch_bytes", "ahead"),
    [
        ("geneformer", 2, 0, 8),  # small batches: up to four per thread ahead of the consumer
        ("scgpt", 1, 0, 4),
        ("csr", 2, SPLIT_BATCH_BYTES, 8),  # (a csr batch is no float32 rows: its size says nothing)
        ("dense", 2, SPLIT_BATCH_BYTES - 1, 8),  # a panel's rows
        ("geneformer", 8, 0, 14),  # at most MAX_EXTRA_AHEAD beyond the threads
        ("dense", 2, SPLIT_BATCH_BYTES, 2),  # full-width dense rows: memory-bound, one per thread
        ("dense", 0, SPLIT_BATCH_BYTES, 1),  # made on the consumer's thread: none ahead
        ("geneformer", 0, 0, 1),
    ],
)
def test_default_batches_ahead_runs_deeper_for_batches_that_are_compute_not_memory(
    kind, num_threads, batch_bytes, ahead
):
    assert default_batches_ahead(kind, num_threads, batch_bytes) == ahead


def test_the_loader_makes_batches_ahead_as_its_default_says_and_serves_the_same_ones(dataset_dir):
    with oj.open_dataset(dataset_dir) as ds:
        kw = {"batch_size": 16, "seed": 1, "num_epochs": 1, "output": oj.GeneformerTokens(max_len=64)}
        deep = oj.make_loader(ds, **kw, read=oj.ReadOptions(num_threads=2))
        alone = oj.make_loader(ds, **kw, read=oj.ReadOptions(num_threads=0))
        assert deep.batches_ahead == 8 and "batches_ahead=8" in repr(deep)
        assert alone.batches_ahead == 1
        for a, b in zip(deep, alone, strict=True):  # how far ahead batches are made changes no batch
            np.testing.assert_array_equal(np.asarray(a.x["input_ids"]), np.asarray(b.x["input_ids"]))
            np.testing.assert_array_equal(np.asarray(a.index), np.asarray(b.index))


@pytest.mark.parametrize(("cores", "prefetch"), [(1, 2), (2, 2), (8, 2), (12, 3), (16, 4), (32, 8), (128, 8)])
def test_default_read_ahead_grows_with_the_cores_beyond_eight(cores, prefetch):
    assert default_prefetch(cores) == prefetch


def test_the_loader_reads_ahead_by_the_cores_it_has_and_serves_the_same_batches(dataset_dir, monkeypatch):
    with oj.open_dataset(dataset_dir) as ds:
        kw = {"batch_size": 32, "seed": 3, "num_epochs": 1, "output": oj.CSR()}
        here = oj.make_loader(ds, **kw)
        assert here.prefetch == default_prefetch(usable_cores())
        monkeypatch.setattr(options, "usable_cores", lambda: 16)  # a 16-core host
        wide = oj.make_loader(ds, **kw)
        assert wide.prefetch == 4 and "prefetch=4" in repr(wide)
        for a, b in zip(here, wide, strict=True):  # read-ahead changes when records are read, not the batches
            np.testing.assert_array_equal(np.asarray(a.x.indices), np.asarray(b.x.indices))
            np.testing.assert_array_equal(np.asarray(a.x.values), np.asarray(b.x.values))
        kept = oj.make_loader(ds, **kw, read=oj.ReadOptions(prefetch=1))
        assert kept.prefetch == 1
        for loader in (here, wide, kept):
            loader.close()


@pytest.mark.parametrize(
    ("option", "kind", "block_size"),
    [
        (oj.Block(8, 4), "block", 8),
        (oj.Random(4), "block", 1),
        (oj.Stream(fetch_factor=4), "stream", 1),
        (oj.Stream(shuffle=True, fetch_factor=4), "stream_buffer", 1),
    ],
)
def test_each_sampling_option_is_the_plan_it_names(option, kind, block_size):
    rows = AllRows(1000)
    plan = option.to_plan(rows, batch_size=16, seed=3, num_hosts=1, obs=None)
    assert plan == SamplingPlan(rows, 16, block_size, 4, 3, kind, 1, True, None)
    assert [plan.epoch_order(e).tolist() for e in (0, 1)] == [
        SamplingPlan(np.arange(1000), 16, block_size, 4, 3, kind).epoch_order(e).tolist() for e in (0, 1)
    ]


def test_class_balanced_weights_the_sampled_cells_by_their_class():
    labels = np.array([0, 0, 0, 1, -1, 1])
    option = oj.ClassBalanced("drug", block_size=1, fetch_factor=1)
    weights = option.cell_weights(np.array([0, 3, 4, 5]), lambda name: {"drug": labels}[name])
    np.testing.assert_allclose(weights, [1.0, 0.5, 0.0, 0.5])  # class 0 has one sampled cell, class 1 two
    weighted = oj.Weighted(np.array([1.0, 2.0]))
    np.testing.assert_array_equal(weighted.cell_weights(None, None), [1.0, 2.0])


def test_class_balanced_balances_interleaved_classes_at_any_block_size():
    """Cell types interleave within a sample: 70/20/8/2% of the cells in random order. Every class
    comes at a quarter of the cells drawn, at block size 16 as at 1, each block holding one class
    (fixed blocks across classes brought the common class's cells with a rare one's: at 16 the
    shares came at 67/21/9/3%)."""
    rng = np.random.default_rng(0)
    labels = rng.choice(4, size=20_000, p=[0.7, 0.2, 0.08, 0.02])
    for block_size in (1, 16):
        option = oj.ClassBalanced("cell_type", block_size=block_size, fetch_factor=4)
        plan = option.to_plan(AllRows(len(labels)), batch_size=64, seed=1, num_hosts=1, obs=lambda _: labels)
        drawn = np.concatenate([plan.epoch_order(e) for e in range(10)])
        shares = np.bincount(labels[drawn], minlength=4) / len(drawn)
        # the binomial standard error of a quarter over 200,000 cells drawn in runs is ~0.002
        np.testing.assert_allclose(shares, 0.25, atol=0.01, err_msg=f"block_size {block_size}")
        starts = plan._run_blocks
        for lo, hi in zip(starts[:-1], starts[1:], strict=True):
            assert hi - lo <= block_size and len(set(labels[lo:hi])) == 1
        # a state saved with fixed blocks (no such key) stands in another order: it is refused
        assert plan.describe()["blocks"] == "one class each"


@pytest.mark.parametrize("mode", [None, "log1p", "normalize_log1p"])
def test_one_normalization_on_the_devices_and_in_the_kernels(mode):
    rng = np.random.default_rng(0)
    x = np.where(rng.random((6, 40)) < 0.3, rng.integers(1, 50, (6, 40)), 0).astype(np.float32)
    x[2] = 0  # an empty row stays zero
    rows, cols = np.nonzero(x)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=6))]).astype(np.int64)
    kernel = scatter.scatter_dense(indptr, cols.astype(np.int32), x[rows, cols], 40, normalize=mode)
    device = np.asarray(oj.Normalization(mode).apply(x))
    entries = oj.Normalization(mode).apply_entries(x[rows, cols], rows, 6)
    sparse = np.zeros_like(x)
    sparse[rows, cols] = np.asarray(entries)
    np.testing.assert_allclose(device, kernel, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sparse, kernel, rtol=1e-6, atol=1e-6)
    assert not device[2].any()


def test_the_loader_shows_the_settings_it_runs_with(dataset_dir):
    with oj.open_dataset(dataset_dir) as ds:
        loader = oj.make_loader(ds, batch_size=64, sampling=oj.Block(8, 2), output=oj.CSR(), obs=("drug",))
        shown = repr(loader)
        loader.close()
    assert "sampling=Block(block_size=8, fetch_factor=2, drop_remainder=True)" in shown
    assert "output='csr'" in shown and "obs=['drug']" in shown
    threads = default_num_threads("csr", usable_cores(), batch_size=64)
    assert (
        f"read=ReadOptions(num_threads={threads}, prefetch={default_prefetch()}, decode_threads=1)" in shown
    )
    with oj.open_dataset(dataset_dir) as ds:
        panel = oj.make_loader(ds, batch_size=64, output=oj.Panel([3, 1, 4]))
        shown = repr(panel)
        panel.close()
    assert "output=Panel(genes=[3 genes])," in shown  # not a full-width dense output


def test_materialize_options_reach_the_dataset(corpus, tmp_path):
    out = tmp_path / "ds"
    materialize(
        corpus.cells_parquet,
        out,
        read=InputOptions(where="batch = 'plate_00'"),
        layout=Layout(shard_cells=512, group_size=8, compression="uncompressed"),
        workers=1,
        progress=False,
    )
    ds = oj.open_dataset(out)
    assert set(ds.obs["batch"].labels()) == {"plate_00"}
    assert ds.manifest.shard_cells == 512
    assert ds.manifest.array_record["group_size"] == 8
    assert ds.manifest.array_record["compression"] == "uncompressed"


def test_weighted_never_draws_a_cell_of_weight_0():
    """A group given weight 0 is never drawn, not even its cells that share a block with weighted
    ones (rows 9,000-9,007 of a zero-weight group beside a weighted one came in 224 of 235,520
    cells drawn): the plan holds the weighted cells alone, in blocks among themselves."""
    weights = np.ones(12_000)
    weights[9_000:11_000] = 0.0  # a group that starts and ends inside blocks of 16
    plan = oj.Weighted(weights, 16, 4).to_plan(AllRows(12_000), batch_size=64, seed=0, num_hosts=1, obs=None)
    drawn = np.concatenate([plan.epoch_order(e) for e in range(5)])
    assert not np.isin(drawn, np.arange(9_000, 11_000)).any()
    assert np.isin(np.arange(8_990, 9_000), drawn).all() and np.isin(np.arange(11_000, 11_010), drawn).all()
    assert plan.epoch_cells == 10_000  # the weighted cells' blocks
    for bad in (np.zeros(5), np.array([1.0, -1.0, 1.0, 1.0, 1.0])):  # refused, not planned without them
        with pytest.raises(oj.OmicsIOError, match="finite, non-negative and not all zero"):
            oj.Weighted(bad, 4, 1).to_plan(AllRows(5), batch_size=4, seed=0, num_hosts=1, obs=None)
