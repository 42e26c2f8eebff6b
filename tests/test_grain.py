"""GrainSource and make_grain_loader: Grain's DataLoader serves exactly make_loader's batches."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import grain
import jax
import numpy as np
import pytest
from conftest import repo_file

import omicsio_jax as oj
from omicsio_jax.loaders import options


@pytest.fixture(scope="module")
def ds(dataset_dir):
    return oj.open_dataset(dataset_dir)


SAMPLINGS = {
    "block": {},
    "stream": {"sampling": oj.Stream(fetch_factor=4, drop_remainder=False)},
    "weighted": {"sampling": oj.Weighted(np.linspace(0.1, 2.0, 3000), block_size=16, fetch_factor=4)},
    "class_balanced": {"sampling": oj.ClassBalanced("drug", block_size=16, fetch_factor=4)},
}
BASE = {"batch_size": 64, "sampling": oj.Block(16, 4), "seed": 3, "obs": ("drug",)}


def _indices(batches, steps: int) -> list[np.ndarray]:
    out = []
    for _, b in zip(range(steps), batches, strict=False):
        out.append(np.asarray(b.index).copy())
    return out


def _assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("num_epochs", [2, None], ids=["finite", "endless"])
def test_grain_loader_serves_the_loaders_batches(ds, sampling, num_epochs):
    kw = {**BASE, **SAMPLINGS[sampling], "num_epochs": num_epochs}
    steps = 100 if num_epochs is None else 10**6  # endless: past two epochs
    expected = _indices(oj.make_loader(ds, **kw), steps)
    _assert_same(_indices(oj.make_grain_loader(ds, **kw), steps), expected)


def test_grain_loader_with_two_worker_processes_serves_the_same_batches(ds):
    for sampling, num_epochs in (("block", 1), ("weighted", None), ("class_balanced", 1), ("stream", None)):
        kw = {**BASE, **SAMPLINGS[sampling], "num_epochs": num_epochs}
        steps = 70 if num_epochs is None else 10**6
        expected = _indices(oj.make_loader(ds, **kw), steps)
        loader = oj.make_grain_loader(ds, **kw, worker_count=2)
        _assert_same(_indices(loader, steps), expected)


def test_records_are_host_batches_of_every_output_and_place_on_the_mesh(ds):
    mesh = jax.make_mesh((8,), ("data",))
    for output in ("dense", "csr", oj.Panel([5, 0, 77]), oj.Dense(on_device=True)):
        kw = {**BASE, "output": output}
        src = oj.GrainSource(ds, **kw, placement=mesh, num_epochs=1)
        record = src[0]
        assert isinstance(record, oj.HostBatch) and record.index.shape == (64,)
        batch = oj.place_batch(record, mesh)
        assert batch.index.sharding.spec == jax.sharding.PartitionSpec("data")
        reference = next(iter(oj.make_loader(ds, **kw, placement=mesh)))
        jax.tree.map(
            lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), batch, reference
        )
    assert len(src) == src.steps_per_epoch == 3000 // 64


def test_dense_built_on_the_devices_crosses_a_worker_process_as_slabs(ds):
    """A Grain worker process hands over ``Dense(on_device=True)``'s slabs (its pytree and the bound
    output that densifies them); placed, they are the loader's dense rows."""
    mesh = jax.make_mesh((8,), ("data",))
    kw = {**BASE, "output": oj.Dense(normalize="log1p", on_device=True), "num_epochs": 1}
    grain_batches = oj.make_grain_loader(ds, **kw, placement=mesh, worker_count=1)
    for _, got, want in zip(range(3), grain_batches, oj.make_loader(ds, **kw, placement=mesh), strict=False):
        batch = got if isinstance(got, oj.Batch) else oj.place_batch(got, mesh)
        np.testing.assert_array_equal(np.asarray(batch.index), np.asarray(want.index))
        np.testing.assert_array_equal(np.asarray(batch.x), np.asarray(want.x))


def test_source_pickles_as_path_and_config_and_its_repr_is_the_config(ds):
    src = oj.GrainSource(ds, **BASE, num_epochs=None)
    first = src[5]
    clone = pickle.loads(pickle.dumps(src))
    assert clone._local is None  # readers are reopened in the new process
    np.testing.assert_array_equal(clone[5].index, first.index)
    config = json.loads(repr(src)[len("GrainSource(") : -1])
    assert config["dataset"] == ds.fingerprint[:16] and config["seed"] == 3 and config["num_hosts"] == 1
    assert len(src) % src.steps_per_epoch == 0 and len(src) > 10**15  # endless
    with pytest.raises(IndexError, match="out of range"):
        oj.GrainSource(ds, **BASE)[10**6]


def test_dataloader_checkpoint_resumes_exactly_and_refuses_another_config(ds):
    loader = oj.make_grain_loader(ds, **BASE, num_epochs=2)
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = it.get_state()
    rest = _indices(it, 10**6)
    again = iter(oj.make_grain_loader(ds, **BASE, num_epochs=2))
    again.set_state(state)
    _assert_same(_indices(again, 10**6), rest)
    other = iter(oj.make_grain_loader(ds, **{**BASE, "seed": 4}, num_epochs=2))
    with pytest.raises(ValueError, match="DataSource in checkpoint does not match"):
        other.set_state(state)
    two_workers = iter(oj.make_grain_loader(ds, **BASE, num_epochs=2, worker_count=2))
    with pytest.raises(ValueError, match="Worker count in checkpoint does not match"):
        two_workers.set_state(state)


def test_user_map_operations_pass_through(ds):
    class Total(grain.transforms.Map):
        def map(self, batch):
            return {"index": batch.index, "total": batch.x.sum(axis=1)}

    for workers in (0, 2):
        out = next(iter(oj.make_grain_loader(ds, **BASE, operations=[Total()], worker_count=workers)))
        reference = next(iter(oj.make_loader(ds, **BASE)))
        np.testing.assert_array_equal(out["index"], np.asarray(reference.index))
        np.testing.assert_allclose(out["total"], np.asarray(reference.x).sum(axis=1), rtol=1e-6)


def test_planned_coverage_matches_what_the_dataloader_serves(ds):
    src = oj.GrainSource(ds, **BASE, num_epochs=1)
    served = oj.Tally()
    for batch in grain.DataLoader(data_source=src, sampler=src.sampler(), read_options=src.read_options()):
        served = served + oj.Tally.of(batch.index)
    assert served == src.planned(0)
    # on another process than 0, by default its own plan, as its sampler's default is its own records
    three = oj.Placement(process_index=2, process_count=3)
    src = oj.GrainSource(ds, **{**BASE, "batch_size": 96}, num_epochs=1, placement=three)
    loader = grain.DataLoader(data_source=src, sampler=src.sampler(), read_options=src.read_options())
    served = oj.Tally.of(np.concatenate([b.index for b in loader]))
    assert served == src.planned(0) == src.planned(0, 2) != src.planned(0, 0)
    with pytest.raises(oj.OmicsIOError, match=r"process_index 3 is not one of this source's 3 process\(es\)"):
        src.sampler(process_index=3)


class Noise(grain.transforms.RandomMap):
    """A random operation: Grain gives it an rng per record only where the sampler has a seed."""

    def random_map(self, batch, rng):
        noise = rng.random(batch.x.shape, dtype=np.float32)
        return oj.HostBatch(batch.x + noise, batch.obs, batch.index, batch.mask)


def test_random_operations_draw_from_the_seed_and_replay_at_resume(ds):
    kw = {**BASE, "num_epochs": 1, "operations": [Noise()]}
    first = [b.x.copy() for _, b in zip(range(6), oj.make_grain_loader(ds, **kw), strict=False)]
    again = [b.x.copy() for _, b in zip(range(6), oj.make_grain_loader(ds, **kw), strict=False)]
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    it = iter(oj.make_grain_loader(ds, **kw))
    for _ in range(3):
        next(it)
    resumed = iter(oj.make_grain_loader(ds, **kw))
    resumed.set_state(it.get_state())
    for want in first[3:]:
        np.testing.assert_array_equal(next(resumed).x, want)
    plain = np.asarray(next(iter(oj.make_loader(ds, **BASE))).x)
    assert 0 < (first[0] - plain).min() and (first[0] - plain).max() < 1  # the noise was drawn


def test_a_dense_checkpoint_restores_onto_another_device_count_and_slabs_name_the_mesh(ds):
    """A dense record does not depend on the devices; a csr record is one slab per device, so its
    source's repr holds the count (and a batch of one slab on 8 devices names the fix)."""
    m8 = jax.make_mesh((8,), ("data",))
    m4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    kw = {**BASE, "num_epochs": 1}
    it = iter(oj.make_grain_loader(ds, **kw, placement=m8))
    for _ in range(5):
        next(it)
    state = it.get_state()
    rest = _indices(it, 10**6)
    on_four = iter(oj.make_grain_loader(ds, **kw, placement=m4))
    on_four.set_state(state)
    _assert_same(_indices(on_four, 10**6), rest)
    csr = iter(oj.make_grain_loader(ds, **kw, output="csr", placement=m8))
    next(csr)
    with pytest.raises(ValueError, match="DataSource in checkpoint does not match"):
        iter(oj.make_grain_loader(ds, **kw, output="csr", placement=m4)).set_state(csr.get_state())
    unslabbed = next(iter(oj.make_grain_loader(ds, **kw, output="csr")))
    with pytest.raises(oj.OmicsIOError, match=r"built as 1 device slab\(s\).*placement=mesh"):
        oj.place_batch(unslabbed, m8)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_epochs": True}, r"GrainSource\(num_epochs=...\) must be an integer ≥ 1 \(or None\), got True"),
        ({"num_epochs": 0}, r"GrainSource\(num_epochs=...\) must be an integer ≥ 1"),
        ({"seed": None}, r"GrainSource\(seed=...\) must be an integer ≥ 0, got None"),
        ({"worker_count": -1}, r"make_grain_loader\(worker_count=...\) must be an integer ≥ 0"),
        ({"worker_count": 1.5}, r"make_grain_loader\(worker_count=...\) must be an integer ≥ 0"),
    ],
)
def test_grain_arguments_are_checked_as_make_loaders_are(ds, options, message):
    with pytest.raises(oj.OmicsIOError, match=message):
        oj.make_grain_loader(ds, **{**BASE, **options})


def test_a_grain_iterators_state_given_to_make_loader_is_named(ds):
    it = iter(oj.make_grain_loader(ds, **BASE, num_epochs=1))
    next(it)
    state = json.loads(it.get_state())
    with pytest.raises(oj.StateMismatchError, match="a Grain DataLoader iterator's state"):
        oj.make_loader(ds, **BASE, num_epochs=1).set_state(state)


def test_read_options_let_the_threads_run_ahead_unless_the_records_are_full_width_dense_rows(ds, monkeypatch):
    tokens = oj.GrainSource(ds, **{**BASE, "output": oj.GeneformerTokens(max_len=64)})
    assert tokens.read_options().prefetch_buffer_size == 8  # 2 threads, 4 batches each ahead
    assert tokens.read_options(num_threads=1).prefetch_buffer_size == 4
    assert tokens.read_options(prefetch_buffer_size=5).prefetch_buffer_size == 5
    monkeypatch.setattr(options, "SPLIT_BATCH_BYTES", 1)  # every dense batch "full width"
    dense = oj.GrainSource(ds, **{**BASE, "output": "dense"})
    assert dense.read_options().prefetch_buffer_size == 3  # a record or so ahead per thread


def test_worker_mistakes_become_one_line_errors(ds, dataset_dir, tmp_path):
    class Filter(grain.transforms.Filter):
        def filter(self, batch):
            return True

    with pytest.raises(oj.OmicsIOError, match="not a grain.transforms.Map or RandomMap"):
        oj.make_grain_loader(ds, **BASE, operations=[Filter()])

    lock = threading.Lock()

    class Locked(grain.transforms.Map):
        def map(self, batch):
            with lock:
                return batch

    with pytest.raises(
        oj.OmicsIOError, match=r"cannot be sent to worker processes \(TypeError: cannot pickle"
    ):
        oj.make_grain_loader(ds, **BASE, operations=[Locked()], worker_count=2)
    with pytest.raises(oj.OmicsIOError, match="made for 1 process"):
        oj.GrainSource(ds, **BASE).sampler(process_index=0, process_count=2)

    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(f"""
        import omicsio_jax as oj
        loader = oj.make_grain_loader({str(dataset_dir)!r}, batch_size=64, worker_count=2)
        print(next(iter(loader)).index[:3])
    """)
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("omicsio_jax.core.errors.OmicsIOError: ")
        and "line 3: worker processes re-run this script" in last
    )
    assert 'if __name__ == "__main__":' in last

    guarded = tmp_path / "guarded.py"
    guarded.write_text(
        textwrap.dedent(f"""
        import omicsio_jax as oj

        if __name__ == "__main__":
            loader = oj.make_grain_loader({str(dataset_dir)!r}, batch_size=64, worker_count=2, seed=3)
            print(next(iter(loader)).index[:3].tolist())
    """)
    )
    run = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]  # the absl-flags workaround applied (grain#1355)
    first = next(iter(oj.make_loader(ds, batch_size=64, seed=3)))
    assert run.stdout.strip() == str(np.asarray(first.index)[:3].tolist())


def _by_hand(script: Path, dataset_dir, batch_size: int, worker_count: int, then: str) -> Path:
    """A script of its own, as a user writes one: a ``grain.DataLoader`` built by hand over a
    `GrainSource` (seed 3, endless) with ``worker_count`` workers, then the lines ``then`` (which see
    ``loader``)."""
    script.write_text(
        textwrap.dedent(f"""
        import grain
        import omicsio_jax as oj

        if __name__ == "__main__":
            src = oj.GrainSource({str(dataset_dir)!r}, batch_size={batch_size}, seed=3, num_epochs=None)
            loader = grain.DataLoader(
                data_source=src,
                sampler=src.sampler(),
                read_options=src.read_options(),
                operations=[],
                worker_count={worker_count},
            )
        """)
        + textwrap.indent(textwrap.dedent(then).strip(), "    ")
        + "\n"
    )
    return script


def test_a_dataloader_built_by_hand_runs_workers_in_a_plain_script(ds, dataset_dir, tmp_path):
    """docs/grain.md's "build the DataLoader yourself": the source applies the absl-flags workaround
    (grain#1355) itself. In a script of its own, as a user runs it: pytest may have parsed the flags."""
    script = _by_hand(
        tmp_path / "by_hand.py", dataset_dir, 64, 1, "print(next(iter(loader)).index[:3].tolist())"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    first = next(iter(oj.make_loader(ds, batch_size=64, seed=3)))
    assert run.stdout.strip() == str(np.asarray(first.index)[:3].tolist())


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, which an init that does not reap leaves, has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_workers_end_when_the_process_that_started_them_is_killed(dataset_dir, tmp_path):
    """A training process killed outright (SIGKILL, OOM, a preempted job) leaves no Grain worker
    behind: Grain's own workers block forever on their full queue, re-parented to init."""
    then = f"""
        import multiprocessing, os, signal
        it = iter(loader)
        for _ in range(3):
            next(it)
        with open({str(tmp_path / "workers.txt")!r}, "w") as f:
            print(*[p.pid for p in multiprocessing.active_children()], file=f)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    script = _by_hand(tmp_path / "killed.py", dataset_dir, 16, 2, then)
    with open(tmp_path / "stderr.txt", "w") as stderr:  # a file: a worker left alive holds no pipe open
        run = subprocess.run([sys.executable, str(script)], stdout=stderr, stderr=stderr, timeout=180)
    assert run.returncode == -signal.SIGKILL, (tmp_path / "stderr.txt").read_text()[-2000:]
    workers = [int(pid) for pid in (tmp_path / "workers.txt").read_text().split()]
    assert len(workers) >= 2  # the two workers (and Grain's resource tracker, if it started one)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(map(_running, workers)):
        time.sleep(0.2)
    alive = [pid for pid in workers if _running(pid)]
    for pid in alive:  # not to leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert alive == []


def test_prefetch_to_device_places_ahead_and_checkpoints_exactly(ds):
    mesh = jax.make_mesh((8,), ("data",))
    expected = _indices(oj.make_loader(ds, **BASE, num_epochs=1), 10**6)
    for workers in (0, 2):
        batches = oj.prefetch_to_device(
            iter(oj.make_grain_loader(ds, **BASE, num_epochs=1, worker_count=workers)), mesh, buffer_size=3
        )
        assert isinstance(batches, grain.DatasetIterator)
        head = _indices(batches, 12)
        state = json.loads(json.dumps(batches.get_state()))  # the state after the 12th batch, not the 15th
        first = next(batches)
        assert first.x.sharding.spec == jax.sharding.PartitionSpec("data")
        again = oj.prefetch_to_device(
            iter(oj.make_grain_loader(ds, **BASE, num_epochs=1, worker_count=workers)), mesh
        )
        again.set_state(state)
        _assert_same(head + [np.asarray(first.index)] + _indices(batches, 10**6), expected)
        _assert_same(_indices(again, 10**6), expected[12:])
        batches.close()
        again.close()


def test_prefetch_to_device_interrupted_while_placing_keeps_the_batch_it_was_waiting_for(ds, monkeypatch):
    """Ctrl-C while the loop waits for a batch being placed: the state is still the one after the
    last batch handed out (a checkpoint written in the handler resumes with the batch waited for),
    and the next call hands that batch out."""
    from omicsio_jax.loaders import prefetch

    expected = _indices(oj.make_loader(ds, **BASE, num_epochs=1), 10**6)
    place, placed = prefetch.place_batch, []

    def interrupted_once(host_batch, *args):
        placed.append(1)
        if len(placed) == 4:
            raise KeyboardInterrupt  # as if delivered to the loop waiting on this batch's placement
        return place(host_batch, *args)

    monkeypatch.setattr(prefetch, "place_batch", interrupted_once)
    batches = oj.prefetch_to_device(oj.make_loader(ds, **BASE, num_epochs=1))
    head = _indices(batches, 3)
    with pytest.raises(KeyboardInterrupt):
        next(batches)
    state = json.loads(json.dumps(batches.get_state()))
    assert state["inner"]["step"] == 3
    batches.close()
    monkeypatch.setattr(prefetch, "place_batch", place)
    again = oj.prefetch_to_device(oj.make_loader(ds, **BASE, num_epochs=1))
    again.set_state(state)
    _assert_same(head + _indices(again, 10**6), expected)
    again.close()


def test_prefetch_to_device_places_a_batch_whose_placement_failed_again_on_the_next_call(ds, monkeypatch):
    """A placement that fails (a device out of memory for a moment) is tried again by the next call:
    the future kept its error, and every later call raised it again, the batch never placed."""
    from omicsio_jax.loaders import prefetch

    expected = _indices(oj.make_loader(ds, **BASE, num_epochs=1), 10**6)
    place, placed = prefetch.place_batch, []

    def fails_once(host_batch, *args):
        placed.append(1)
        if len(placed) == 4:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory for a moment")
        return place(host_batch, *args)

    monkeypatch.setattr(prefetch, "place_batch", fails_once)
    with oj.prefetch_to_device(oj.make_loader(ds, **BASE, num_epochs=1)) as batches:
        head = _indices(batches, 3)
        with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
            next(batches)
        assert batches.get_state()["inner"]["step"] == 3
        _assert_same(head + _indices(batches, 10**6), expected)


def test_prefetch_to_device_interrupted_while_the_loader_makes_the_next_batch_keeps_the_placed_one(
    ds, monkeypatch
):
    """Ctrl-C while the wrapped loader makes the batch after the one just placed (the loop waits
    there when reading is the bottleneck): that placed batch was taken off its line and the state
    moved past it, but the call raised instead of returning it, so it was lost, and a checkpoint
    written in the handler resumed without it. It stays first in line, the state before it."""
    from omicsio_jax.loaders import minibatch

    expected = _indices(oj.make_loader(ds, **BASE, num_epochs=1, read=oj.ReadOptions(num_threads=0)), 10**6)
    batch, failed = minibatch.MinibatchReader._batch, []

    def interrupted_once(self, epoch, step, **kwargs):
        if (epoch, step) == (0, 5) and not failed:
            failed.append(step)
            raise KeyboardInterrupt
        return batch(self, epoch, step, **kwargs)

    monkeypatch.setattr(minibatch.MinibatchReader, "_batch", interrupted_once)
    loader = oj.make_loader(ds, **BASE, num_epochs=1, read=oj.ReadOptions(num_threads=0))
    with oj.prefetch_to_device(loader, buffer_size=2) as batches:
        head = _indices(batches, 3)  # steps 0-2 handed out, 3 and 4 made ahead
        with pytest.raises(KeyboardInterrupt):
            next(batches)  # step 3 placed; making step 5 is interrupted
        state = json.loads(json.dumps(batches.get_state()))
        assert failed and state["inner"]["step"] == 3
        _assert_same(head + _indices(batches, 10**6), expected)
    with oj.prefetch_to_device(oj.make_loader(ds, **BASE, num_epochs=1)) as again:
        again.set_state(state)
        _assert_same(head + _indices(again, 10**6), expected)


def test_worker_processes_warn_once_with_their_measured_cost(ds, monkeypatch):
    from omicsio_jax.loaders import grain_source

    monkeypatch.setattr(grain_source, "_workers_warned", threading.Event())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        oj.make_grain_loader(ds, **BASE, worker_count=0)
        oj.make_grain_loader(ds, **BASE, worker_count=2)
        oj.make_grain_loader(ds, **BASE, worker_count=2)
    ours = [w for w in caught if issubclass(w.category, oj.GrainWorkersWarning)]
    assert len(ours) == 1 and ours[0].filename == __file__  # once, pointing at the caller
    text = str(ours[0].message)
    assert "worker_count=0 with read=oj.ReadOptions(num_threads=N)" in text
    assert "benchmarks/results/grain.json" in text and "\n" not in text


def test_the_warning_quotes_the_results_file():
    from omicsio_jax.loaders.grain_source import GRAIN_WORKERS_MEASURED

    result = json.loads(repo_file("benchmarks/results/grain.json").read_text())
    ratio = {
        row["output"]: round(row["ratio_to_make_loader"], 2)
        for row in result["rows"]
        if row["kind"] == "grain" and row["workers"] == 2 and row["batch_size"] == 1024
    }
    machine, commit = result["machine"], result["commit"]
    short = commit.split("+")[0][:7] + ("+dirty" if commit.endswith("+dirty") else "")
    assert GRAIN_WORKERS_MEASURED == {
        "dense": ratio["dense"],
        "csr": ratio["csr"],
        "when": f"{result['date']}, commit {short}, {machine['cores']}-core {machine['cpu']}",
    }
