"""The loader: exact batches, sharding on 8 devices, every output mode, bit-identical replay."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import jax
import numpy as np
import pyarrow.parquet as pq
import pytest

import omicsio_jax as oj
from materialize import InputOptions, materialize


@pytest.fixture(scope="module")
def ds(dataset_dir):
    return oj.open_dataset(dataset_dir)


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "tests run with 8 fake CPU devices (see conftest.py)"
    return jax.make_mesh((8,), ("data",))


def _dense_rows(ds, rows):
    indptr, indices, values = ds.read_csr(np.asarray(rows))
    out = np.zeros((len(rows), ds.num_genes), np.float32)
    out[np.repeat(np.arange(len(rows)), np.diff(indptr)), indices] = values
    return out


def _loader(ds, **kw):
    args = {"batch_size": 64, "sampling": oj.Block(16, 4), "seed": 0, "obs": ("drug", "n_genes")}
    return oj.make_loader(ds, **{**args, **kw})


def test_dense_batches_hold_exactly_their_cells_sharded_on_8_devices(ds, mesh):
    loader = _loader(ds, placement=mesh)
    drug = ds.obs["drug"].codes
    for step, batch in zip(range(6), loader, strict=False):
        index = np.asarray(batch.index)
        assert batch.x.shape == (64, ds.num_genes) and batch.x.dtype == np.float32
        assert batch.x.sharding.spec == jax.sharding.PartitionSpec("data")
        assert [s.data.shape for s in batch.x.addressable_shards] == [(8, ds.num_genes)] * 8
        np.testing.assert_array_equal(np.asarray(batch.x), _dense_rows(ds, index), err_msg=f"step {step}")
        np.testing.assert_array_equal(np.asarray(batch.obs["drug"]), drug[index])
        np.testing.assert_array_equal(np.asarray(batch.obs["n_genes"]), ds.obs["n_genes"][index])
        assert np.asarray(batch.mask).all()


def test_recycled_buffers_never_change_a_batch_still_held(ds, mesh):
    """Dense buffers are reused, but only once no jax.Array, host batch or view refers to them."""
    loader = _loader(ds, placement=mesh, num_epochs=1)
    held = [(np.asarray(b.index), b.x) for b in loader]  # every batch kept alive as a jax.Array
    for index, x in held:
        np.testing.assert_array_equal(np.asarray(x), _dense_rows(ds, index))
    del held
    recycled = _loader(ds, num_epochs=1, seed=1)  # now keep only the latest batch: buffers are reused
    addresses = []
    for batch in recycled:
        x = np.asarray(batch.x)  # on CPU, a view of the adopted host buffer
        np.testing.assert_array_equal(x, _dense_rows(ds, np.asarray(batch.index)))
        addresses.append(x.ctypes.data)
        del x
    assert len(set(addresses)) < len(addresses) // 2


def test_placed_batches_adopt_aligned_host_buffers_on_cpu(mesh):
    """On CPU devices `place_batch` hands XLA the host buffers of a batch without copying them, with a
    mesh (each device its rows) or without (the first device); a buffer that is not 64-byte aligned
    is copied. The loader's recycling rests on this: an adopted buffer stays referenced while any
    jax.Array holds it (`test_row_buffers_come_back_only_when_unreferenced`)."""
    from omicsio_jax.core.buffers import aligned_empty

    x = aligned_empty((64, 48), np.float32)
    x[:] = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    index = aligned_empty((64,), np.int32)
    index[:] = np.arange(64)
    alone = oj.place_batch({"x": x, "index": index})
    assert alone["x"].unsafe_buffer_pointer() == x.ctypes.data
    assert alone["index"].unsafe_buffer_pointer() == index.ctypes.data
    sharded = oj.place_batch({"x": x, "index": index}, mesh)
    pointers = sorted(s.data.unsafe_buffer_pointer() for s in sharded["x"].addressable_shards)
    assert pointers == [x.ctypes.data + k * 8 * x.strides[0] for k in range(8)]
    np.testing.assert_array_equal(np.asarray(sharded["x"]), x)
    unaligned = np.empty(64 * 48 + 1, np.float32)[1:].reshape(64, 48)  # 4 bytes past an aligned start
    unaligned[:] = x
    assert unaligned.ctypes.data % 64 != 0
    copied = oj.place_batch({"x": unaligned})["x"]
    assert copied.unsafe_buffer_pointer() != unaligned.ctypes.data
    np.testing.assert_array_equal(np.asarray(copied), x)


def test_row_buffers_come_back_only_when_unreferenced():
    from omicsio_jax.core.buffers import RowBuffers

    pool = RowBuffers(keep=2)
    a = pool.empty((4, 16))
    a[:] = 1
    address = a.ctypes.data
    assert address % 64 == 0 and a.flags.writeable and a.flags.c_contiguous
    view = a[1:3]  # a view keeps the buffer out of the pool
    del a
    assert pool.num_free() == 0
    b = pool.empty((4, 16))
    assert b.ctypes.data != address
    del view
    assert pool.num_free() == 1
    c = pool.empty((4, 16))
    assert c.ctypes.data == address and pool.num_free() == 0
    c[:] = 7
    adopted = jax.make_array_from_process_local_data(jax.sharding.SingleDeviceSharding(jax.devices()[0]), c)
    del c  # XLA may keep using this memory (on CPU it adopts aligned buffers): not free yet
    assert pool.num_free() == 0
    d = pool.empty((4, 16))
    d[:] = -1
    np.testing.assert_array_equal(np.asarray(adopted), 7)
    extra = pool.empty((4, 16))  # a third buffer: beyond `keep`, not pooled
    del adopted, b, d, extra
    gc.collect()  # assert_array_equal left the jax.Array in a reference cycle
    assert pool.num_free() == 2


def test_a_buffer_comes_back_as_soon_as_the_jax_array_that_adopted_it_goes():
    """jaxlib gives back the arrays XLA adopted at the next garbage collection, not when their
    jax.Array goes: the pool collects when nothing is free, so the buffer comes back at once."""
    from omicsio_jax.core.buffers import RowBuffers

    pool = RowBuffers(keep=3)
    device = jax.devices()[0]
    a = pool.empty((64, 4096))
    a[:] = 1
    first = a.ctypes.data
    x = jax.device_put(a, device)
    assert x.unsafe_buffer_pointer() == first  # adopted, not copied
    del a
    b = pool.empty((64, 4096))  # the first is held by x: another one
    assert b.ctypes.data != first
    del x
    c = pool.empty((64, 4096))
    assert c.ctypes.data == first
    del b, c


def test_byte_buffers_of_any_size_come_back_smallest_first():
    from omicsio_jax.core.buffers import RowBuffers

    pool = RowBuffers(keep=2)
    large, small = pool.at_least(5000), pool.at_least(1000)
    assert len(small) == 1000 and small.ctypes.data % 64 == 0 and len(large) == 5000
    addresses = large.ctypes.data, small.ctypes.data
    del small, large
    again = pool.at_least(900)  # the smallest free one that fits
    assert again.ctypes.data == addresses[1]
    other = pool.at_least(4000)  # the other one, still free
    assert other.ctypes.data == addresses[0]
    del again
    bigger = pool.at_least(9000)  # none fits: a new one, kept in place of the free smaller one
    kept = bigger.ctypes.data
    assert kept not in addresses
    del other, bigger
    assert pool.at_least(8000).ctypes.data == kept  # it came back


def test_one_epoch_serves_every_cell_once(ds):
    loader = _loader(ds, num_epochs=1)
    served = np.concatenate([np.asarray(b.index) for b in loader])
    assert len(served) == loader.steps_per_epoch * 64
    assert len(np.unique(served)) == len(served)
    assert ds.num_cells - len(served) < 64


def test_sequential_pass_with_padding_covers_everything_in_order(ds):
    loader = _loader(ds, sampling=oj.Stream(fetch_factor=4, drop_remainder=False), batch_size=128)
    batches = list(loader)
    index = np.concatenate([np.asarray(b.index) for b in batches])
    mask = np.concatenate([np.asarray(b.mask) for b in batches])
    np.testing.assert_array_equal(index[mask], np.arange(ds.num_cells))
    assert (index[~mask] == -1).all() and (~mask).sum() == (-ds.num_cells) % 128
    assert (np.asarray(batches[-1].obs["drug"])[~np.asarray(batches[-1].mask)] == -1).all()


def test_panel_and_fused_normalization(ds):
    genes = ds.features["gene_name"].tolist()
    panel = [genes[5], genes[0], genes[1999], genes[77]]
    loader = _loader(ds, output=oj.Panel(panel, normalize="normalize_log1p", target_sum=1e4))
    batch = next(iter(loader))
    dense = _dense_rows(ds, np.asarray(batch.index))
    totals = dense.sum(axis=1, keepdims=True)
    expected = np.log1p(dense * np.float32(1e4) / totals)[:, [5, 0, 1999, 77]]
    np.testing.assert_allclose(np.asarray(batch.x), expected, rtol=1e-5)


def test_csr_output_is_small_and_densifies_to_the_dense_batch(ds, mesh):
    sparse = _loader(ds, placement=mesh, output="csr")
    dense = _loader(ds, placement=mesh)
    for _, s, d in zip(range(3), sparse, dense, strict=False):
        assert s.x.values.shape[0] == 8 and s.x.values.sharding.spec == jax.sharding.PartitionSpec("data")
        np.testing.assert_array_equal(np.asarray(s.index), np.asarray(d.index))
        on_device = sparse.densify(s.x)
        assert on_device.sharding.spec[0] == "data"
        np.testing.assert_array_equal(np.asarray(on_device), np.asarray(d.x))
        assert s.x.values.nbytes * 3 < d.x.nbytes


@pytest.mark.parametrize("normalize", [None, "normalize_log1p"])
def test_dense_on_device_ships_slabs_and_builds_the_same_rows_on_the_devices(ds, mesh, normalize):
    """``Dense(on_device=True)``: the host batch holds csr slabs, one per device, fewer bytes than
    the dense rows; placed, ``x`` is the dense batch, sharded the same way: bit for bit without
    normalization, to float rounding with it."""
    from omicsio_jax.outputs.dense import SlabRows

    host = _loader(ds, placement=mesh, output=oj.Dense(normalize=normalize))
    device = _loader(ds, placement=mesh, output=oj.Dense(normalize=normalize, on_device=True))
    assert "on_device" in repr(device) and device.num_threads == 0  # slabs' thread layout on 2 cores
    hb = next(iter(device.as_grain_dataset()))
    assert isinstance(hb.x, SlabRows) and hb.x.slabs.values.shape[0] == 8
    assert sum(a.nbytes for a in jax.tree.leaves(hb.x)) < 64 * ds.num_genes * 4  # less than the rows
    host_rows = next(iter(host.as_grain_dataset())).x  # the same first batch, built on the host
    if normalize is None:
        np.testing.assert_array_equal(hb.x.dense(), _dense_rows(ds, hb.index))
        np.testing.assert_array_equal(hb.x.dense(), host_rows)
    else:
        np.testing.assert_allclose(hb.x.dense(), host_rows, rtol=2e-6, atol=1e-7)
    for _, h, d in zip(range(3), host, device, strict=False):
        np.testing.assert_array_equal(np.asarray(d.index), np.asarray(h.index))
        assert d.x.shape == h.x.shape and d.x.dtype == np.float32
        assert d.x.sharding.is_equivalent_to(h.x.sharding, 2)
        if normalize is None:
            np.testing.assert_array_equal(np.asarray(d.x), np.asarray(h.x))
        else:
            np.testing.assert_allclose(np.asarray(d.x), np.asarray(h.x), rtol=2e-6, atol=1e-7)
    for loader in (host, device):
        loader.close()


def test_dense_on_device_options_are_checked(ds):
    with pytest.raises(oj.OmicsIOError, match="on_device=True too"):
        oj.Dense(nnz_capacity=4096)
    loader = _loader(ds, output=oj.Dense(on_device=True, nnz_capacity=256))
    with pytest.raises(oj.OmicsIOError, match="nnz_capacity"):  # a slab beyond it names the option
        next(iter(loader))
    loader.close()


def _run(loader, steps):
    out = []
    it = iter(loader)
    for _ in range(steps):
        batch = next(it)
        out.append((np.asarray(batch.index).copy(), np.asarray(batch.x).tobytes()))
    return out


def test_replay_is_bit_identical_from_many_restore_points(ds):
    kw = {"num_epochs": 2, "read": oj.ReadOptions(num_threads=3, prefetch=3)}
    reference, states = [], []
    loader = _loader(ds, **kw)
    total = 2 * loader.steps_per_epoch
    for batch in loader:
        reference.append((np.asarray(batch.index).copy(), np.asarray(batch.x).tobytes()))
        states.append(json.loads(json.dumps(loader.get_state())))  # survives a JSON round trip
    assert len(reference) == total
    per_epoch = loader.steps_per_epoch
    points = sorted({0, 1, 2, 3, 4, 5, per_epoch - 1, per_epoch, per_epoch + 1, per_epoch + 6, total - 2})
    for k in points:  # restore after step k: mid-fetch, fetch and epoch boundaries, near the end
        resumed = _loader(ds, **kw)
        resumed.set_state(states[k])
        rest = list(resumed)
        assert len(rest) == total - k - 1, k
        for (i0, x0), b in zip(reference[k + 1 :], rest, strict=True):
            np.testing.assert_array_equal(np.asarray(b.index), i0)
            assert np.asarray(b.x).tobytes() == x0


def test_state_is_small_and_mismatches_are_refused(ds, dataset_dir, corpus, tmp_path):
    loader = _loader(ds)
    next(iter(loader))
    state = loader.get_state()
    assert len(json.dumps(state)) < 1024
    other_seed = _loader(ds, seed=1)
    with pytest.raises(oj.StateMismatchError, match=r"seed: in checkpoint 0, in loader 1"):
        other_seed.set_state(state)
    with pytest.raises(oj.StateMismatchError, match=r"fetch_factor: in checkpoint 4, in loader 8"):
        _loader(ds, sampling=oj.Block(16, 8)).set_state(state)
    materialize(
        corpus.cells_parquet,
        tmp_path / "other",
        progress=False,
        read=InputOptions(where="batch = 'plate_00'"),
    )
    with pytest.raises(
        oj.StateMismatchError, match=r"dataset: in checkpoint '[0-9a-f]+', in loader '[0-9a-f]+'"
    ):
        _loader(oj.open_dataset(tmp_path / "other")).set_state(state)


def test_thread_count_does_not_change_the_order(ds):
    one = [np.asarray(b.index) for b in _loader(ds, read=oj.ReadOptions(num_threads=1, prefetch=1))]
    four = [np.asarray(b.index) for b in _loader(ds, read=oj.ReadOptions(num_threads=4, prefetch=4))]
    assert all(np.array_equal(a, b) for a, b in zip(one, four, strict=True))


@pytest.mark.parametrize("output", ["dense", "csr"])
def test_decode_threads_do_not_change_the_batches(ds, output):
    import numba

    before = numba.get_num_threads()
    runs = [
        [
            (np.asarray(b.index), jax.tree.map(np.asarray, b.x))
            for b in _loader(ds, output=output, read=oj.ReadOptions(decode_threads=k))
        ]
        for k in (1, 2, None)
    ]
    for other in runs[1:]:
        for (i0, x0), (i1, x1) in zip(runs[0], other, strict=True):
            np.testing.assert_array_equal(i0, i1)
            jax.tree.map(np.testing.assert_array_equal, x0, x1)
    assert numba.get_num_threads() == before  # set per decoding thread only
    assert _loader(ds, output="csr").decode_threads == _loader(ds, output="dense").decode_threads == 1


def test_other_seed_other_order_same_seed_same_order(ds):
    a = np.concatenate([np.asarray(b.index) for b in _loader(ds, seed=3)])
    b = np.concatenate([np.asarray(b.index) for b in _loader(ds, seed=3)])
    c = np.concatenate([np.asarray(b.index) for b in _loader(ds, seed=4)])
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_as_grain_dataset_composes_and_checkpoints_with_grain(ds):
    def pipeline():
        return _loader(ds, num_epochs=None).as_grain_dataset().map(lambda hb: int(hb.index.sum()))

    it = iter(pipeline())
    head = [next(it) for _ in range(7)]
    state = it.get_state()
    tail = [next(it) for _ in range(60)]  # crosses an epoch boundary of the infinite stream
    again = iter(pipeline())
    again.set_state(state)
    assert [next(again) for _ in range(60)] == tail
    assert len(set(head)) > 1


def test_subset_and_class_balanced(ds):
    plate0 = ds.rows_where("batch", ["plate_00"])
    loader = _loader(ds, rows=plate0, sampling=oj.Block(16, 4, drop_remainder=False))
    served = np.concatenate([np.asarray(b.index)[np.asarray(b.mask)] for b in loader])
    assert sorted(served) == plate0.tolist()
    balanced = _loader(ds, sampling=oj.ClassBalanced("drug", block_size=1, fetch_factor=4), num_epochs=3)
    codes = np.concatenate([np.asarray(b.obs["drug"]) for b in balanced])
    counts = np.bincount(codes)
    assert counts.min() > 0.5 * counts.mean()  # drugs are far from balanced in the data itself


def test_weighted_epochs_serve_only_whole_batches_of_real_cells_and_resume_exactly(ds):
    """A short last block drawn (more than once) does not shorten the epoch: with drop_remainder
    every batch is ``batch_size`` real cells, as many steps as the plan says, and a restore replays."""
    kw = {"obs": (), "read": oj.ReadOptions(num_threads=0)}
    tiny = _loader(ds, batch_size=4, rows=[10, 11, 12, 13, 14], sampling=oj.Weighted(np.ones(5), 64, 1), **kw)
    batches = [np.asarray(b.index) for b in tiny]
    assert len(batches) == tiny.steps_per_epoch == 16  # one block of 64 cells' worth
    assert all(np.isin(b, [10, 11, 12, 13, 14]).all() for b in batches)
    weights = np.full(1000, 1e-6)
    weights[-8:] = 1.0  # nearly all on the last block, 8 cells of 16
    make = lambda: _loader(  # noqa: E731
        ds, batch_size=100, rows=np.arange(1000), sampling=oj.Weighted(weights, 16, 1), num_epochs=2, **kw
    )
    loader = make()
    states, served = [], []
    for batch in loader:
        assert np.asarray(batch.mask).all() and (np.asarray(batch.index) >= 0).all()
        served.append(np.asarray(batch.index))
        states.append(loader.get_state())
    assert len(served) == 2 * loader.steps_per_epoch == 20
    assert np.mean(np.concatenate(served) >= 992) > 0.9  # the weights hold
    again = make()
    again.set_state(states[6])
    for a, b in zip(again, served[7:], strict=True):
        np.testing.assert_array_equal(np.asarray(a.index), b)


def test_weights_follow_their_rows_in_any_order(ds):
    """``Weighted(weights)`` weighs ``rows[i]`` by ``weights[i]``, whatever order ``rows`` lists them in:
    unsorted rows serve the batches of the same rows sorted with their weights; repeated rows are refused."""
    rows = np.arange(2000, 3000)[::-1].copy()  # 2999, ..., 2000
    weights = np.zeros(len(rows))
    weights[:160] = 1.0  # rows 2999 .. 2840
    only = _loader(ds, batch_size=32, rows=rows, sampling=oj.Weighted(weights, 1, 2), obs=())
    served = np.concatenate([np.asarray(b.index) for b in only])
    assert served.min() >= 2840 and len(served) == only.steps_per_epoch * 32
    unsorted = _loader(ds, batch_size=32, rows=rows, sampling=oj.Weighted(weights, 16, 2), obs=())
    ascending = _loader(
        ds, batch_size=32, rows=rows[::-1], sampling=oj.Weighted(weights[::-1], 16, 2), obs=()
    )
    assert unsorted.config() == ascending.config()
    for a, b in zip(unsorted, ascending, strict=True):
        np.testing.assert_array_equal(np.asarray(a.index), np.asarray(b.index))
    with pytest.raises(
        oj.OmicsIOError, match=r"rows lists row 5 2 times, and Weighted takes one weight per entry"
    ):
        _loader(ds, rows=np.r_[np.arange(100), 5], sampling=oj.Weighted(np.ones(101), 16, 2))
    with pytest.raises(oj.OmicsIOError, match="Weighted has 99 weights for 100 rows"):
        _loader(ds, rows=np.arange(100), sampling=oj.Weighted(np.ones(99), 16, 2))


def test_a_mixture_draws_its_groups_in_proportion_and_resumes_exactly(ds):
    mixture = oj.Mixture(by="tissue", weights={"brain": 3, "lung": 1}, block_size=1, fetch_factor=4)
    loader = _loader(ds, sampling=mixture, num_epochs=3, obs=("tissue",))
    batches = [np.asarray(b.obs["tissue"]) for b in loader]
    tissues = np.concatenate(batches)
    categories = ds.obs["tissue"].categories
    brain, lung = categories.index("brain"), categories.index("lung")
    assert set(np.unique(tissues)) == {brain, lung}  # groups not named are not drawn
    assert abs(np.mean(tissues == brain) - 0.75) < 0.06  # weights, not the groups' sizes
    blocks = _loader(
        ds,
        sampling=oj.Mixture(by="tissue", weights={"brain": 1}, block_size=8, fetch_factor=2),
        obs=("tissue",),
    )
    assert {int(t) for b in blocks for t in np.asarray(b.obs["tissue"])} == {brain}  # blocks of its cells
    it = iter(_loader(ds, sampling=mixture, num_epochs=3, obs=("tissue",)))
    for _ in range(5):
        next(it)
    state = it.get_state()
    again = _loader(ds, sampling=mixture, num_epochs=3, obs=("tissue",))
    again.set_state(state)
    assert [np.asarray(b.obs["tissue"]).tolist() for b in again] == [b.tolist() for b in batches[5:]]
    other = _loader(ds, sampling=oj.Mixture(by="drug", weights={"drug_01": 1}, block_size=1, fetch_factor=4))
    with pytest.raises(oj.StateMismatchError, match="mixture: in checkpoint"):  # a mixture of other groups
        other.set_state(state)


def test_a_new_mixture_at_resume_takes_effect_with_the_next_epoch(ds):
    def mixture(weights):
        return oj.Mixture(by="tissue", weights=weights, block_size=4, fetch_factor=4)

    first, second = {"brain": 3, "lung": 1}, {"brain": 1, "lung": 1, "kidney": 2}
    kw = dict(num_epochs=3, obs=("tissue",))
    reference = _loader(ds, sampling=mixture(first), **kw)
    it = iter(reference)
    for _ in range(5):
        next(it)
    state = it.get_state()
    rest_of_epoch = [b.index for b in (next(it) for _ in range(reference.steps_per_epoch - 5))]
    resumed = _loader(ds, sampling=mixture(second), **kw)
    resumed.set_state(state)
    replayed = [next(resumed) for _ in range(len(rest_of_epoch))]
    for a, b in zip(replayed, rest_of_epoch, strict=True):  # the epoch finishes exactly as it began
        np.testing.assert_array_equal(np.asarray(a.index), np.asarray(b))
    assert resumed.coverage(0).complete  # each of its cells served once
    recorded = resumed.get_state()["mixtures"]
    assert recorded == [
        {"from_epoch": 0, "weights": {"brain": 3.0, "lung": 1.0}},
        {"from_epoch": 1, "weights": {"brain": 1.0, "kidney": 2.0, "lung": 1.0}},
    ]
    fresh = _loader(ds, sampling=mixture(second), **kw)  # from epoch 1: the new mixture's batches
    steps = fresh.steps_per_epoch
    fresh = iter(fresh)
    for _ in range(steps):
        next(fresh)
    later = list(resumed)
    assert len(later) == 2 * steps
    for a, b in zip(later, fresh, strict=True):
        np.testing.assert_array_equal(np.asarray(a.index), np.asarray(b.index))
    # a checkpoint taken while the old epoch finishes resumes the same way
    again = _loader(ds, sampling=mixture(second), **kw)
    again.set_state(state)
    next(again)
    middle = again.get_state()
    assert middle["config"]["mixture"]["weights"] == {"brain": 3.0, "lung": 1.0}
    third = _loader(ds, sampling=mixture(second), **kw)
    third.set_state(middle)
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(b.index) for b in third]),
        np.concatenate([np.asarray(b.index) for b in replayed[1:] + later]),
    )
    assert third.get_state()["mixtures"] == recorded
    # that checkpoint restored with the old weights keeps them: its history does not switch either
    kept = _loader(ds, sampling=mixture(first), **kw)
    kept.set_state(middle)
    pure = _loader(ds, sampling=mixture(first), **kw)
    for a, b in zip(kept, list(pure)[6:], strict=True):
        np.testing.assert_array_equal(np.asarray(a.index), np.asarray(b.index))
        assert kept.get_state()["mixtures"] == [{"from_epoch": 0, "weights": {"brain": 3.0, "lung": 1.0}}]


@pytest.mark.parametrize("num_threads", [0, None])
def test_an_interrupt_as_a_new_mixtures_waiting_epoch_ends_loses_no_batch(ds, monkeypatch, num_threads):
    """Restored with new weights, the loader finishes the checkpoint's epoch on a loader of the old
    weights, whose threads stop once that epoch is out. A KeyboardInterrupt while they were joined
    (on the call that returned the epoch's last batch) lost that batch: the next call served the old
    mixture's next epoch's first batch in its place, and a state written in the handler stood past
    it. The threads now stop on the next call, before it takes a batch."""

    def make(weights):
        mixture = oj.Mixture(by="tissue", weights=weights, block_size=4, fetch_factor=4)
        read = oj.ReadOptions(num_threads=num_threads)
        return _loader(ds, sampling=mixture, num_epochs=3, obs=(), read=read)

    first, second = {"brain": 3, "lung": 1}, {"brain": 1, "lung": 1, "kidney": 2}
    with make(first) as loader:
        for _ in range(5):
            next(loader)
        state = loader.get_state()
    with make(second) as loader:
        loader.set_state(state)
        expected = [b.index for b in loader]
    served, interrupted = [], []
    with make(second) as loader:
        loader.set_state(state)
        finishing, halt = loader._before, loader._before._halt

        def interrupted_halt():
            halt()
            if not interrupted:
                interrupted.append(len(served))
                raise KeyboardInterrupt

        monkeypatch.setattr(finishing, "_halt", interrupted_halt)
        while len(served) < len(expected):
            try:
                served.append(next(loader).index)
            except KeyboardInterrupt:
                handler = loader.get_state()
        assert interrupted and next(loader, None) is None
    for got, want in zip(served, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    with make(second) as loader:  # the handler's state resumes where the interrupt left the loop
        loader.set_state(handler)
        rest = [b.index for b in loader]
    for got, want in zip(rest, expected[interrupted[0] :], strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_new_mixture_at_an_epoch_boundary_still_checks_the_state(ds):
    """At step 0 nothing of the checkpoint's epoch is left to finish, but its state is checked all the
    same against the config it was written with: other rows or another version are refused."""

    def make(weights, rows):
        mixture = oj.Mixture(by="tissue", weights=weights, block_size=4, fetch_factor=4)
        return _loader(ds, sampling=mixture, rows=rows, num_epochs=3, obs=())

    first, second = {"brain": 3, "lung": 1}, {"brain": 1, "lung": 1}
    loader = make(first, np.arange(2800))
    for _ in range(loader.steps_per_epoch):
        next(loader)
    state = json.loads(json.dumps(loader.get_state()))
    assert (state["epoch"], state["step"]) == (1, 0)
    make(second, np.arange(2800)).set_state(state)  # the same rows: the new mixture from epoch 1
    with pytest.raises(oj.StateMismatchError, match="rows: in checkpoint"):
        make(second, np.arange(200, 3000)).set_state(state)
    with pytest.raises(oj.StateMismatchError, match="version 99 is not"):
        make(second, np.arange(2800)).set_state({**state, "version": 99})


@pytest.mark.parametrize(
    ("mixture", "match"),
    [
        (
            lambda: oj.Mixture(by="tissue", weights={"brian": 1}),
            r"Mixture names 'brian', not a group of obs 'tissue'",
        ),
        (lambda: oj.Mixture(by="total_counts", weights={"a": 1}), r"obs 'total_counts' of .* is numeric"),
        (lambda: oj.Mixture(by="tissue", weights={"brain": -1}), r"non-negative weights, not all zero"),
        (lambda: oj.Mixture(by="tissue", weights={}), r"non-negative weights, not all zero"),
    ],
)
def test_a_bad_mixture_is_a_one_line_error(ds, mixture, match):
    with pytest.raises(oj.OmicsIOError, match=match) as caught:
        _loader(ds, sampling=mixture())
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (lambda: {"output": "coo"}, oj.OmicsIOError, "output must be one of"),
        (lambda: {"output": oj.Dense(normalize="zscore")}, oj.OmicsIOError, "normalize must be"),
        (lambda: {"obs": ("nope",)}, oj.OmicsIOError, "obs column 'nope' not in"),
        (lambda: {"batch_size": 4000}, oj.OmicsIOError, "make no batch of 4000"),
        (lambda: {"output": oj.Panel(["NOT_A_GENE"])}, oj.OmicsIOError, "panel gene"),
        (lambda: {"sampling": "shuffled"}, oj.OmicsIOError, "sampling must be an option"),
        (lambda: {"sampling": oj.ClassBalanced("")}, oj.OmicsIOError, "takes a categorical obs column"),
        (lambda: {"rows": [5, 3000]}, IndexError, "row 3000 is out of range for a dataset of 3,000 cells"),
        (
            lambda: {"rows": np.array([], np.int64)},
            oj.OmicsIOError,
            r"^cannot sample from an empty set of cells: rows= selects none of the 3,000 cells of .*out; pass",
        ),
        (
            lambda: {"rows": np.arange(3000) < 100},
            TypeError,
            r"not a boolean mask: pass rows=np.flatnonzero\(mask\)",
        ),
        (lambda: {"rows": [10.9, 20.5]}, TypeError, "rows must be integers, got dtype float64"),
        (
            lambda: {"rows": [[1, 2], [3, 4]]},
            TypeError,
            r"1-D sequence of ints, got an array of shape \(2, 2\)",
        ),
    ],
)
def test_bad_arguments(ds, kwargs, error, match):
    with pytest.raises(error, match=match):
        _loader(ds, **kwargs())


def test_a_dataset_of_no_cells_is_named_by_the_loader(corpus_table, tmp_path, capfd):
    pq.write_table(corpus_table.slice(0, 0), tmp_path / "cells.parquet")
    materialize(str(tmp_path / "cells.parquet"), tmp_path / "empty", workers=1, progress=False)
    assert "cells.parquet holds no cells: the dataset will hold 0 cells" in capfd.readouterr().err
    pq.write_table(corpus_table, tmp_path / "full.parquet")
    read = InputOptions(where="1 = 0")
    materialize(str(tmp_path / "full.parquet"), tmp_path / "none", read=read, workers=1, progress=False)
    assert "full.parquet --where '1 = 0' selects no cells" in capfd.readouterr().err
    with pytest.raises(
        oj.OmicsIOError,
        match=r"^cannot sample from an empty set of cells: .*empty holds 0 cells; materialize",
    ) as caught:
        oj.make_loader(oj.open_dataset(tmp_path / "empty"), batch_size=8)
    assert "\n" not in str(caught.value)


def test_batch_must_split_over_the_mesh(ds, mesh):
    with pytest.raises(oj.OmicsIOError, match="divisible by the 8 devices"):
        _loader(ds, placement=mesh, batch_size=60)


def test_segment_cache_reads_the_first_key_alone_then_reads_ahead():
    import threading
    import time

    from omicsio_jax.dataset.batched_reads import SegmentCache

    events, lock = [], threading.Lock()

    def load(key):
        with lock:
            events.append(("start", key))
        time.sleep(0.05)
        with lock:
            events.append(("end", key))
        return key * 10

    cache = SegmentCache(load, lambda k: k + 1 if k < 5 else None, ahead=2, threads=2)
    try:
        assert cache.get(0) == 0
        assert events[:2] == [("start", 0), ("end", 0)]  # nothing else was read while key 0 was
        assert cache.get(1) == 10  # read ahead once the first key was in
        deadline = time.monotonic() + 5
        while ("end", 3) not in events and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ("start", 2) in events and ("start", 3) in events  # two ahead of key 1
    finally:
        cache.close()


def _loaded_by_first_batches(dataset_dir, outputs: str, modules: tuple[str, ...]) -> list[str]:
    """Which of ``modules`` a fresh process has imported once it has read a first batch of each of
    ``outputs`` (Python source of a tuple of outputs) from ``dataset_dir``."""
    script = (
        "import json, sys\n"
        "import omicsio_jax as oj\n"
        f"ds = oj.open_dataset({str(dataset_dir)!r})\n"
        f"for output in {outputs}:\n"
        "    loader = oj.make_loader(ds, batch_size=64, output=output, obs=('drug',))\n"
        "    assert next(iter(loader)).index.shape == (64,)\n"
        "    loader.close()\n"
        f"print(json.dumps([m for m in {modules!r} if m in sys.modules]))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_reading_batches_loads_neither_pyarrow_nor_duckdb(dataset_dir):
    """The loader's import path stays light: its first batch waits for no table library's import."""
    assert _loaded_by_first_batches(dataset_dir, "('dense', 'csr')", ("pyarrow", "duckdb", "pandas")) == []


def test_geneformer_tokens_on_the_datasets_own_medians_load_no_pandas(dataset_dir):
    """Geneformer tokens ranked by the dataset's medians read its statistics file (pyarrow), not
    through pyarrow's datasets or its pandas bridge: pandas' import (~0.9 s) is not on the way to
    the first batch."""
    outputs = "(oj.GeneformerTokens(max_len=256),)"
    assert _loaded_by_first_batches(dataset_dir, outputs, ("pyarrow.dataset", "pandas")) == []


def test_len_is_the_runs_batches_and_an_endless_loader_has_none(ds):
    """``len(loader)``: every batch of the run (what ``tqdm(loader)`` shows as its total); an
    endless loader's ``len`` is a one-line TypeError, and either is true as a bool."""
    two = _loader(ds, num_epochs=2, batch_size=512)
    assert len(two) == 2 * two.steps_per_epoch == sum(1 for _ in two)
    endless = _loader(ds, num_epochs=None)
    with pytest.raises(
        TypeError, match=r"^an endless Loader \(num_epochs=None\) has no length; its epochs are"
    ):
        len(endless)
    assert endless and two
    endless.close()
