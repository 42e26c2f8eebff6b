"""Edges of opening a dataset and of resuming a loader: damaged sidecars and manifests, hand-edited
states, and states handed to the wrong iterator, each refused with one line naming the value."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import omicsio_jax as oj

KW = {"batch_size": 96, "sampling": oj.Block(16, 4), "seed": 1, "num_epochs": 2}


@pytest.fixture(scope="module")
def ds(dataset_dir):
    with oj.open_dataset(dataset_dir) as dataset:
        yield dataset


def _copy(dataset_dir, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(dataset_dir, copy)
    return copy


def _huge_end(rows):
    rows[5, 1] = 1 << 40  # a flipped high bit: terabytes past the shard's end
    return rows


def _reversed_range(rows):
    rows[5] = rows[5, ::-1]
    return rows


@pytest.mark.parametrize(
    "damage",
    [_huge_end, _reversed_range, lambda rows: rows[:10], lambda rows: rows[:, :1]],
    ids=["huge-end", "reversed-range", "chunks-missing", "one-column"],
)
@pytest.mark.parametrize("chunk_reader", [True, False])
def test_a_damaged_chunk_index_is_one_line_naming_it(dataset_dir, tmp_path, damage, chunk_reader):
    """Damage that keeps the file's size is found in its rows; damage that changes it, by its size
    against the manifest's (`ListedFiles`) as the file is first opened."""
    copy = _copy(dataset_dir, tmp_path)
    index = copy / "chunks" / "shard-00001.npy"
    listed = index.stat().st_size
    np.save(index, damage(np.load(index).copy()))
    size = index.stat().st_size
    if size == listed:
        problem = r"the chunk index chunks/shard-00001\.npy of shard shard-00001\.arrayrecord is damaged: .*"
    else:
        problem = (
            rf"its file chunks/shard-00001\.npy is damaged: {size:,} bytes, the manifest says {listed:,}; "
        )
    with oj.open_dataset(copy, chunk_reader=chunk_reader) as ds:
        ds.read_csr([0, 5])  # other shards read fine
        with pytest.raises(oj.DatasetFormatError, match=problem + r"run `omicsio-materialize verify"):
            ds.read_csr(np.arange(1024, 1100))


def test_a_truncated_chunk_index_is_one_line_naming_it(dataset_dir, tmp_path):
    copy = _copy(dataset_dir, tmp_path)
    index = copy / "chunks" / "shard-00002.npy"
    index.write_bytes(index.read_bytes()[:100])
    with (
        oj.open_dataset(copy) as ds,
        pytest.raises(oj.DatasetFormatError, match=r"chunks/shard-00002\.npy .*damaged"),
    ):
        ds.read_csr([2500])


def _swap_shards(m):
    m["shards"][0], m["shards"][1] = m["shards"][1], m["shards"][0]


def _swap_shard_paths(m):
    first, second = m["shards"][0], m["shards"][1]
    first["path"], second["path"] = second["path"], first["path"]


@pytest.mark.parametrize(
    "edit,match",
    [
        (_swap_shards, r"shard 0 \(shard-00001\.arrayrecord\) holds cells 1,024\+1,024, not 0\+1,024"),
        (_swap_shard_paths, r"shard 0 is 'shard-00001\.arrayrecord', not shard-00000\.arrayrecord$"),
        (lambda m: m.update(num_cells=m["num_cells"] - 1), r"shard 2 .* not 2,048\+951"),
        (lambda m: m.update(shard_cells=0), r"shard_cells is 0"),
        (lambda m: m.update(shard_cells=512), r"3 shards for 3,000 cells of 512 per shard, not 6"),
        (lambda m: m.update(shards=[]), r"0 shards for 3,000 cells"),
        (lambda m: m["array_record"].pop("group_size"), r"array_record\.group_size is None"),
        (lambda m: m.update(num_genes=3_000_000_000), r"num_genes is 3,000,000,000"),
    ],
    ids=[
        "swapped",
        "paths-swapped",
        "num-cells",
        "shard-cells-0",
        "shard-cells",
        "no-shards",
        "no-group-size",
        "num-genes",
    ],
)
def test_a_manifest_whose_shards_do_not_tile_the_cells_is_refused(dataset_dir, tmp_path, edit, match):
    copy = _copy(dataset_dir, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(oj.DatasetFormatError, match=rf"manifest\.json is malformed: {match}"):
        oj.open_dataset(copy)


def test_a_state_at_the_last_step_of_an_epoch_resumes_and_one_past_it_is_refused(ds):
    loader = oj.make_loader(ds, **KW, output="csr")
    steps = loader.steps_per_epoch
    for _ in range(steps - 1):
        next(loader)
    state = json.loads(json.dumps(loader.get_state()))
    assert (state["epoch"], state["step"]) == (0, steps - 1)
    last = next(loader)
    again = oj.make_loader(ds, **KW, output="csr")
    again.set_state(state)
    np.testing.assert_array_equal(next(again).index, last.index)
    assert again.coverage(0).complete and again.get_state()["epoch"] == 1
    for position in ({"step": steps}, {"step": 10**6}, {"anchor": [steps - 1, 1], "step": 3}):
        edited = {**state, **position}
        with pytest.raises(
            oj.StateMismatchError, match=r"malformed loader state: step \d+ .*is not a step of epoch 0"
        ):
            oj.make_loader(ds, **KW, output="csr").set_state(edited)


def test_prefetch_to_device_refuses_a_state_that_is_not_its_own(ds):
    loader = oj.make_loader(ds, **KW, output="csr")
    next(loader)
    bare = loader.get_state()
    for state in (bare, [bare], None):  # a list of its own states ([{"inner": bare}]) restores: elastic
        batches = oj.prefetch_to_device(oj.make_loader(ds, **KW, output="csr"))
        with pytest.raises(oj.StateMismatchError, match=r"not a prefetch_to_device state"):
            batches.set_state(state)
        batches.close()
    batches = oj.prefetch_to_device(oj.make_loader(ds, **KW, output="csr"))
    batches.set_state({"inner": bare})  # its own kind of state restores
    np.testing.assert_array_equal(next(batches).index, next(loader).index)
    batches.close()


def test_a_state_that_is_not_a_loaders_names_what_it_is(ds):
    grain_iterator = iter(oj.make_grain_loader(ds, batch_size=16, seed=1))
    next(grain_iterator)
    grain_state = grain_iterator.get_state()  # a Grain DataLoader's own state: JSON bytes
    assert isinstance(grain_state, bytes)
    cases = (
        (grain_state, r"not bytes \(a Grain DataLoader iterator's state\?"),
        ([], "not an empty list"),
        ([1, 2], "not a list holding int"),
        (7, "not int"),
    )
    for make in (lambda: oj.make_loader(ds, **KW), lambda: oj.make_memory_loader(ds, batch_size=16)):
        loader = make()
        for state, match in cases:
            with pytest.raises(oj.StateMismatchError, match=match):
                loader.set_state(state)
        loader.close()


def test_numpy_scalar_knobs_make_a_json_state_that_restores(ds):
    kw = {"batch_size": np.int64(96), "sampling": oj.Block(np.int64(16), np.int64(4)), "seed": np.int64(1)}
    loader = oj.make_loader(ds, **kw, num_epochs=np.int64(2), output=oj.Dense(target_sum=np.float32(1e4)))
    first = next(loader)
    state = json.loads(json.dumps(loader.get_state()))  # what Grain's CheckpointSave writes
    assert state["config"] == oj.make_loader(ds, **KW).get_state()["config"]  # the same as with ints
    again = oj.make_loader(ds, **KW)
    again.set_state(state)
    np.testing.assert_array_equal(next(again).index, next(loader).index)
    assert not np.array_equal(first.index, next(again).index)
    src = oj.GrainSource(ds, **kw, num_epochs=np.int64(2))
    assert json.loads(repr(src)[len("GrainSource(") : -1])["seed"] == 1


def test_editing_a_returned_state_leaves_the_loader_as_it_was(ds):
    loader = oj.make_loader(ds, **KW)
    state = loader.get_state()
    state["config"]["seed"] = 2  # a migration script edits what it got
    loader.config()["seed"] = 3
    assert loader.get_state()["config"]["seed"] == 1
    other = oj.make_loader(ds, **{**KW, "seed": 2})
    with pytest.raises(oj.StateMismatchError, match=r"seed: in checkpoint 2, in loader 1"):
        loader.set_state(other.get_state())


def test_a_run_resumes_with_more_epochs_and_not_past_its_end(ds):
    """How many epochs a run goes decides no batch: a run of 2 resumes with 3 (or endless) and goes
    on exactly; a state past the end of the loader it is given to is refused, naming num_epochs."""
    loader = oj.make_loader(ds, **KW, output="csr")
    steps = loader.steps_per_epoch
    for _ in range(steps + 2):
        next(loader)
    state = json.loads(json.dumps(loader.get_state()))
    rest = [np.asarray(b.index) for b in loader]  # the second epoch's remainder
    for num_epochs in (3, None):
        longer = oj.make_loader(ds, **{**KW, "num_epochs": num_epochs}, output="csr")
        longer.set_state(state)
        for expected in rest:
            np.testing.assert_array_equal(next(longer).index, expected)
        assert longer.coverage(1).complete
        assert next(longer).index.shape == (KW["batch_size"],)  # a third epoch
    finished = loader.get_state()
    assert (finished["epoch"], finished["step"]) == (2, 0)
    oj.make_loader(ds, **KW, output="csr").set_state(finished)  # at the end: nothing left, no error
    for edited, epochs in (({**state}, 1), ({**finished, "epoch": 7}, 2), ({**finished, "step": 1}, 2)):
        with pytest.raises(oj.StateMismatchError, match=r"past the end of this loader's num_epochs=\d"):
            oj.make_loader(ds, **{**KW, "num_epochs": epochs}, output="csr").set_state(edited)


def test_hand_edited_anchors_served_tallies_and_repeated_states_are_refused_at_set_state(ds):
    """Values `get_state` never writes are refused when restored, naming the field, not an epoch
    later as a batch size or as cells skipped or repeated."""
    loader = oj.make_loader(ds, **KW, output="csr")
    for _ in range(5):
        next(loader)
    state = loader.get_state()
    count, checksum = state["served"]
    cases = (
        ({"anchor": [1, 5]}, r"malformed loader state: anchor \[1, 5\]: batch_size 96 .* divisible"),
        ({"anchor": [1, 0]}, r"malformed loader state: anchor \[1, 0\] names no process"),
        ({"served": [count, float(checksum)]}, r"served must be a count and a checksum"),
        ({"served": [-1, checksum]}, r"served must be"),
        ({"served": [count, 1 << 80]}, r"served must be"),
        ({"served": [count]}, r"served must be"),
    )
    for edit, match in cases:
        with pytest.raises(oj.StateMismatchError, match=match):
            oj.make_loader(ds, **KW, output="csr").set_state({**state, **edit})
    with pytest.raises(oj.StateMismatchError, match=r"repeat process 0's: pass each process's state once"):
        oj.make_loader(ds, **KW, output="csr").set_state([state, state])
    batches = oj.prefetch_to_device(oj.make_loader(ds, **KW, output="csr"))
    wrapped = batches.get_state()
    batches.close()
    for loader in (oj.make_loader(ds, **KW, output="csr"), oj.make_memory_loader(ds, batch_size=16)):
        with pytest.raises(
            oj.StateMismatchError, match=r"prefetch_to_device iterator's state .* state\['inner'\]"
        ):
            loader.set_state(wrapped)
        loader.close()


def _fail_once_at_step_5(monkeypatch, error) -> list:
    """Make `make_loader`'s batch of epoch 0, step 5 fail once with ``error("transient")``; returns the
    list that says whether it has."""
    from omicsio_jax.loaders import minibatch

    batch, failed = minibatch.MinibatchReader._batch, []

    def fails_once(self, epoch, step, **kwargs):
        if (epoch, step) == (0, 5) and not failed:
            failed.append(step)
            raise error("transient")
        return batch(self, epoch, step, **kwargs)

    monkeypatch.setattr(minibatch.MinibatchReader, "_batch", fails_once)
    return failed


@pytest.mark.parametrize("num_threads", [0, 2])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_batch_that_fails_once_is_made_again_by_the_next_call(ds, monkeypatch, num_threads, error):
    """An error making a batch, or a KeyboardInterrupt while the loop waits for it (Ctrl-C in a
    notebook, then the loop run again), leaves the loader where its last returned batch did: the
    next call serves that step's batch, not the one after it (Grain's threads had moved past it:
    a batch lost, the epoch's audit failing, the last call a bare IndexError)."""
    read = oj.ReadOptions(num_threads=num_threads)
    with oj.make_loader(ds, **KW, read=read) as loader:
        expected = [b.index for b in loader]
    failed = _fail_once_at_step_5(monkeypatch, error)
    served = []
    with oj.make_loader(ds, **KW, read=read) as loader:
        served += [next(loader).index for _ in range(5)]
        with pytest.raises(error, match="transient"):
            next(loader)
        assert loader.get_state()["step"] == 5
        served += [b.index for b in loader]  # the epochs' audits pass
    assert failed and len(served) == len(expected)
    for got, want in zip(served, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_dataset_opened_by_a_relative_path_reads_after_a_chdir(dataset_dir, monkeypatch):
    """Opened as ``out/`` from its parent, the dataset is the folder it named then: a later
    ``os.chdir`` (Hydra, a library) neither makes it read as replaced nor sends Grain's workers,
    which reopen it by its path, to another folder."""
    monkeypatch.chdir(dataset_dir.parent)
    ds = oj.open_dataset(dataset_dir.name)
    src = oj.GrainSource(dataset_dir.name, batch_size=96)
    expected = ds.read_csr([5, 0, 17])
    monkeypatch.chdir("/")
    for got, want in zip(ds.read_csr([5, 0, 17]), expected, strict=True):  # not "replaced or removed"
        np.testing.assert_array_equal(got, want)
    with oj.make_loader(ds, **KW) as loader:
        next(loader)
    assert ds.path == dataset_dir and src.path == str(dataset_dir)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("where", ["gather", "place"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_memory_batch_that_fails_once_is_made_again_by_the_next_call(
    ds, monkeypatch, prefetch, where, error
):
    """`make_memory_loader`: a batch that fails once, gathered (on the prefetch thread, whose error
    ended it: every later call was StopIteration, the run cut short without a word) or placed (a
    KeyboardInterrupt while it is copied to the devices: its cells were tallied as served, and the
    epoch's audit failed; with prefetch the thread had also moved past it), is made again by the
    next call, and a state written in the handler stands before it."""
    from omicsio_jax.loaders import memory

    panel = oj.load_panel(ds)
    kw = {"batch_size": 128, "seed": 1, "num_epochs": 2, "read": oj.ReadOptions(prefetch=prefetch)}
    with oj.make_memory_loader(panel, **kw) as loader:
        expected = [b.index for b in loader]
    calls, failed = [], []
    target = memory.MemoryLoader._host_batch if where == "gather" else type(loader.placement).place
    name = "_host_batch" if where == "gather" else "place"

    def fails_once(self, arg):
        calls.append(1)
        if len(calls) == 6 and not failed:
            failed.append(1)
            raise error("transient")
        return target(self, arg)

    monkeypatch.setattr(
        memory.MemoryLoader if where == "gather" else type(loader.placement), name, fails_once
    )
    served = []
    with oj.make_memory_loader(panel, **kw) as loader:
        served += [next(loader).index for _ in range(5)]
        with pytest.raises(error, match="transient"):
            next(loader)
        state = loader.get_state()
        assert state["step"] == 5 and oj.Tally.from_json(state["served"]).count == 5 * 128
        served += [b.index for b in loader]  # the epochs' audits pass
    assert failed and len(served) == len(expected)
    for got, want in zip(served, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    with oj.make_memory_loader(panel, **kw) as loader:  # the handler's state resumes with the failed step
        loader.set_state(state)
        for got, want in zip([b.index for b in loader], expected[5:], strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_prefetch_to_device_keeps_a_batch_when_reading_ahead_fails(ds, monkeypatch, error):
    """`prefetch_to_device` reads the next batch ahead before it returns one: the wrapped iterator
    failing there (an error making a batch, a KeyboardInterrupt while it reads) lost the batch
    already taken off the line, its state moved past it, so neither the loop nor a checkpoint
    written in the handler had it. The batch stays first in line and the next call returns it."""
    with oj.make_loader(ds, **KW) as loader:
        expected = [b.index for b in loader]
    failed = _fail_once_at_step_5(monkeypatch, error)
    served = []
    read = oj.ReadOptions(num_threads=0)
    with oj.prefetch_to_device(oj.make_loader(ds, **KW, read=read)) as batches:
        while not failed:
            try:
                served.append(next(batches).index)
            except error:
                state = batches.get_state()
        assert state["inner"]["step"] == len(served)
        served += [b.index for b in batches]
    assert len(served) == len(expected)
    for got, want in zip(served, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    with oj.prefetch_to_device(oj.make_loader(ds, **KW)) as batches:
        batches.set_state(state)
        rest = [b.index for b in batches]
    assert len(rest) == len(expected) - state["inner"]["step"]
    for got, want in zip(rest, expected[state["inner"]["step"] :], strict=True):
        np.testing.assert_array_equal(got, want)
