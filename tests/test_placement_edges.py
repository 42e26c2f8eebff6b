"""Where batches land (meshes the processes share, a host's share of a batch over its devices,
batches donated to a step), and the arguments `oj.Placement`, `oj.place_batch`, the memory and stream
loaders and `oj.tune` refuse: each with a one-line error naming the value and the fix."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

import omicsio_jax as oj


@dataclasses.dataclass(frozen=True)
class _Device:
    """A device of another process, as a mesh of several processes holds it (only one runs here)."""

    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"


def _mesh(grid: list[list[tuple[int, int]]], names=("data", "model")) -> jax.sharding.Mesh:
    devices = np.empty((len(grid), len(grid[0])), dtype=object)
    for i, row in enumerate(grid):
        for j, (device, process) in enumerate(row):
            devices[i, j] = _Device(device, process)
    return jax.sharding.Mesh(devices, names)


def test_a_mesh_whose_processes_hold_the_same_data_slices_is_refused():
    # "model" across the two processes: each holds both slices of "data", so each process's own rows
    # would make a different global batch on the replicas of one slice (half the batch_size rows)
    across = _mesh([[(0, 0), (2, 1)], [(1, 0), (3, 1)]])
    with pytest.raises(oj.OmicsIOError, match=r"process 0 holds its slices \[0, 1\] and process 1 \[0, 1\]"):
        oj.Placement(across)
    # every process loading the same whole batches (same seed): the replicas agree
    assert oj.Placement(across, process_index=0, process_count=1).num_hosts == 1
    # the same devices with "data" across the processes: each holds one slice of its own
    within = _mesh([[(0, 0), (1, 0)], [(2, 1), (3, 1)]])
    assert oj.Placement(within, process_count=2).data_axis == "data"
    uneven = _mesh([[(0, 0)], [(1, 0)], [(2, 0)], [(3, 1)]], names=("data", "model"))
    with pytest.raises(
        oj.OmicsIOError, match=r"equal, disjoint shares.*process 0 holds its slices \[0, 1, 2\]"
    ):
        oj.Placement(uneven)


def test_a_mesh_over_some_of_the_processes_is_refused_unless_one_process_loads(monkeypatch):
    mesh = jax.make_mesh((jax.device_count(),), ("data",))  # every device is process 0's
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(oj.OmicsIOError, match=r"the mesh spans processes \[0\] of the 2 JAX processes"):
        oj.Placement(mesh)
    with pytest.raises(oj.OmicsIOError, match=r"the mesh spans processes \[0\]"):
        oj.Placement.of(mesh)
    assert oj.Placement(mesh, process_index=0, process_count=1).num_hosts == 1


@pytest.mark.parametrize("loader", ["disk", "memory"])
def test_a_hosts_share_of_the_batch_must_split_over_its_devices(dataset_dir, small_panel, loader):
    # one process playing host 1 of 2 holds all 8 devices: its 12 rows of a batch of 24 cannot split
    # over them (a raw ValueError at the first batch, from a decoding thread)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    placement = oj.Placement(mesh, process_index=1, process_count=2)
    match = r"batch_size 24 gives each of the 2 hosts 12 rows, which must split evenly over this process's 8 devices"
    with pytest.raises(oj.OmicsIOError, match=match):
        if loader == "disk":
            oj.make_loader(
                oj.open_dataset(dataset_dir), batch_size=24, sampling=oj.Block(4, 2), placement=placement
            )
        else:
            oj.make_memory_loader(small_panel, batch_size=24, placement=placement)
    batch = next(oj.make_memory_loader(small_panel, batch_size=32, placement=placement))
    assert batch.x.shape == (16, 3) and len(batch.x.addressable_shards) == 8  # this host's share


@pytest.mark.parametrize("mesh", ["data", np.arange(8)])
def test_a_placement_of_something_else_than_a_mesh_is_a_one_line_error(mesh):
    with pytest.raises(
        oj.OmicsIOError, match=r"Placement\(mesh=\.\.\.\) must be a jax.sharding.Mesh or None"
    ):
        oj.Placement(mesh)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_threads": []}, r"num_threads must list at least one thread count"),
        ({"entropy_batches": 0}, r"entropy_batches must be a positive integer .*; got 0"),
        ({"block_sizes": [2.5]}, r"block_sizes must be non-empty, of positive integers.*; got \[2.5\]"),
        ({"block_sizes": []}, r"block_sizes must be non-empty"),
        (
            {"fetch_factors": [0, 16]},
            r"fetch_factors must be non-empty, of positive integers.*; got \[0, 16\]",
        ),
        ({"batch_size": -5}, r"batch_size must be a positive integer, e.g. 1024; got -5"),
        ({"num_epochs": 1}, r"do not pass num_epochs="),
    ],
)
def test_tune_refuses_bad_arguments_with_one_line_errors(dataset_dir, kwargs, match):
    ds = oj.open_dataset(dataset_dir)
    batch_size = kwargs.pop("batch_size", 64)
    with pytest.raises(oj.OmicsIOError, match=match):
        oj.tune(ds, batch_size, label="drug", seconds=0.01, progress=False, **kwargs)


@pytest.fixture(scope="module")
def small_panel(dataset_dir):
    return oj.load_panel(oj.open_dataset(dataset_dir), [1, 2, 3], progress=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 64.0}, r"make_memory_loader\(batch_size=\.\.\.\) must be an integer ≥ 1, got 64.0"),
        ({"batch_size": True}, r"make_memory_loader\(batch_size=\.\.\.\) must be an integer ≥ 1, got True"),
        ({"seed": -1}, r"make_memory_loader\(seed=\.\.\.\) must be an integer ≥ 0, got -1"),
        ({"seed": None}, r"make_memory_loader\(seed=\.\.\.\) must be an integer ≥ 0, got None"),
        (
            {"num_epochs": -1},
            r"make_memory_loader\(num_epochs=\.\.\.\) must be an integer ≥ 0 \(or None\), got -1",
        ),
        (
            {"read": {"prefetch": 2}},
            r"read must be an oj.ReadOptions\(num_threads=\.\.\., prefetch=\.\.\.\) or None",
        ),
    ],
)
def test_the_memory_loader_refuses_bad_arguments_with_one_line_errors(small_panel, kwargs, match):
    with pytest.raises(oj.OmicsIOError, match=match):
        oj.make_memory_loader(small_panel, **{"batch_size": 64, **kwargs})


def test_the_memory_loader_takes_read_none_as_the_defaults(small_panel):
    batch = next(oj.make_memory_loader(small_panel, batch_size=64, read=None))
    assert batch.x.shape == (64, 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 64.0}, r"make_stream_loader\(batch_size=\.\.\.\) must be an integer ≥ 1, got 64.0"),
        ({"seed": -1}, r"make_stream_loader\(seed=\.\.\.\) must be an integer ≥ 0, got -1"),
        ({"read": 2}, r"read must be an oj.ReadOptions"),
    ],
)
def test_the_stream_loader_refuses_bad_arguments_with_one_line_errors(corpus, kwargs, match):
    table = oj.open_table(corpus.cells_parquet)
    with pytest.raises(oj.OmicsIOError, match=match):
        oj.make_stream_loader(table, **{"batch_size": 64, "sampling": oj.Stream(shuffle=True), **kwargs})


def test_numpy_integer_thread_counts_reach_grain_as_ints(dataset_dir):
    # e.g. oj.tune(..., num_threads=np.arange(3)): Grain asserted an int at the first batch
    read = oj.ReadOptions(num_threads=np.int64(2), prefetch=np.int32(1), decode_threads=np.int64(1))
    assert [type(v) for v in (read.num_threads, read.prefetch, read.decode_threads)] == [int, int, int]
    loader = oj.make_loader(oj.open_dataset(dataset_dir), batch_size=64, sampling=oj.Block(4, 2), read=read)
    try:
        assert next(loader).x.shape == (64, 2000)
    finally:
        loader.close()
    assert type(oj.Placement(process_index=np.int64(1), process_count=np.int64(2)).host) is int


def test_place_batch_refuses_a_placement_or_a_missing_axis_in_one_line():
    mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    host = {"x": np.ones((16, 3), np.float32)}
    with pytest.raises(
        oj.OmicsIOError, match=r"mesh must be a jax.sharding.Mesh or None.*call p.place\(host_batch\)"
    ):
        oj.place_batch(host, oj.Placement(mesh, data_axis="batch"))
    with pytest.raises(oj.OmicsIOError, match=r"data_axis='data' is not an axis of the mesh \('batch',\)"):
        oj.place_batch(host, mesh)
    placed = oj.place_batch(host, mesh, "batch")["x"]
    assert placed.sharding.spec == jax.sharding.PartitionSpec("batch") and placed.shape == (16, 3)
    uneven = f"a batch of 12 rows does not split over the {jax.device_count()} devices of mesh axis 'batch'"
    with pytest.raises(oj.OmicsIOError, match=uneven):  # the shape of a make_grain_loader batch of 12
        oj.place_batch({"x": np.ones((12, 3), np.float32), "index": np.arange(12)}, mesh, "batch")


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -1.0, "60"])
def test_tune_refuses_seconds_it_could_never_spend(dataset_dir, seconds):
    # nan: the timing loop waited for elapsed >= nan, for ever
    with pytest.raises(oj.OmicsIOError, match=r"seconds must be a finite number ≥ 0 .*, got"):
        oj.tune(
            oj.open_dataset(dataset_dir), 64, label="drug", seconds=seconds, progress=False, num_threads=[0]
        )


def test_a_step_that_donates_an_on_device_batch_leaves_the_next_batches_whole(small_panel):
    # every batch shared one mask array: donating a batch deleted the mask of every later one (the
    # next step on it crashed the process)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    loader = oj.make_memory_loader(small_panel, batch_size=64, seed=0, on_device=True, placement=mesh)
    first, second = next(loader), next(loader)
    step = jax.jit(lambda batch: jax.tree.map(lambda a: a.copy(), batch), donate_argnums=0)
    out = step(first)
    assert not any(a.is_deleted() for a in jax.tree.leaves(second))
    again = step(second)
    assert np.asarray(out.mask).all() and np.asarray(again.mask).all()
    assert again.mask.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")), 1
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 64.0}, r"make_loader\(batch_size=\.\.\.\) must be an integer ≥ 1, got 64.0"),
        ({"batch_size": True}, r"make_loader\(batch_size=\.\.\.\) must be an integer ≥ 1, got True"),
        ({"seed": -1}, r"make_loader\(seed=\.\.\.\) must be an integer ≥ 0, got -1"),
        ({"seed": None}, r"make_loader\(seed=\.\.\.\) must be an integer ≥ 0, got None"),
        ({"num_epochs": -1}, r"make_loader\(num_epochs=\.\.\.\) must be an integer ≥ 1 \(or None\), got -1"),
        (
            {"read": {"prefetch": 2}},
            r"read must be an oj.ReadOptions\(num_threads=\.\.\., prefetch=\.\.\.\) or None",
        ),
    ],
)
def test_make_loader_refuses_bad_arguments_with_one_line_errors(dataset_dir, kwargs, match):
    with pytest.raises(oj.OmicsIOError, match=match):
        oj.make_loader(oj.open_dataset(dataset_dir), **{"batch_size": 64, **kwargs})


def test_make_loader_takes_read_none_as_the_defaults(dataset_dir):
    loader = oj.make_loader(oj.open_dataset(dataset_dir), batch_size=64, read=None)
    assert next(iter(loader)).x.shape[0] == 64


def test_a_memory_loaders_numpy_seed_makes_a_json_state_that_restores(small_panel):
    loader = oj.make_memory_loader(small_panel, batch_size=64, seed=np.int64(3), num_epochs=np.int64(2))
    next(loader)
    state = json.loads(json.dumps(loader.get_state()))
    again = oj.make_memory_loader(small_panel, batch_size=64, seed=3, num_epochs=2)
    again.set_state(state)
    np.testing.assert_array_equal(np.asarray(next(again).index), np.asarray(next(loader).index))


@pytest.mark.parametrize("layout", ["one device", "data over 8", "data over 4, model over 2"])
def test_put_arrays_places_as_jax_does_without_its_overhead(layout):
    """`put_arrays` (the loaders' placement: jax's own last call, without the checks around it) gives
    what ``jax.device_put`` / ``jax.make_array_from_process_local_data`` give: the same sharding,
    shapes, dtypes (int64 → int32 unless x64 is on), values and committed arrays, adopting aligned
    buffers just as they do; anything but numpy arrays is left to them."""
    from omicsio_jax.core.buffers import aligned_empty
    from omicsio_jax.outputs.batch import data_sharding, put_arrays

    mesh = {
        "one device": None,
        "data over 8": jax.make_mesh((8,), ("data",)),
        "data over 4, model over 2": jax.make_mesh((4, 2), ("data", "model")),
    }[layout]
    sharding = data_sharding(mesh)
    rng = np.random.default_rng(0)
    x = aligned_empty((16, 40), np.float32)
    x[:] = rng.random((16, 40), np.float32)
    arrays = [
        x,
        rng.integers(-5, 5, 16).astype(np.int64),
        rng.integers(0, 60000, (16, 3)).astype(np.uint16),
        rng.integers(-3, 3, 16).astype(np.int16),
        rng.random(16) < 0.5,
    ]
    ours = put_arrays(arrays, sharding)
    theirs = [
        jax.device_put(a, sharding) if mesh is None else jax.make_array_from_process_local_data(sharding, a)
        for a in arrays
    ]
    for mine, ref in zip(ours, theirs, strict=True):
        assert mine.sharding == ref.sharding and mine.committed and ref.committed
        assert (mine.shape, mine.dtype, mine.aval.weak_type) == (ref.shape, ref.dtype, ref.aval.weak_type)
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(ref))
        assert [s.index for s in mine.addressable_shards] == [s.index for s in ref.addressable_shards]
    assert ours[1].dtype == np.int32  # x64 is off in the tests, as in jax's default
    first = min(ours[0].addressable_shards, key=lambda s: s.index[0].start or 0)
    assert first.data.unsafe_buffer_pointer() == x.ctypes.data  # adopted, not copied
    assert put_arrays([np.zeros(4), jax.numpy.zeros(4)], sharding) is None
    assert put_arrays([np.array(["a", "b"])], sharding) is None
