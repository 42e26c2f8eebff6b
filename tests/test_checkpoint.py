"""Every loader's iterator in Grain's and Orbax's checkpoint machinery, unchanged."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import grain
import jax
import numpy as np
import pytest
from conftest import repo_file

import omicsio_jax as oj

ocp = pytest.importorskip(
    "orbax.checkpoint", reason="the orbax extra is not installed (scripts/test.sh installs it)"
)


@pytest.fixture(scope="module")
def ds(dataset_dir):
    return oj.open_dataset(dataset_dir)


@pytest.fixture(scope="module")
def table(corpus):
    return oj.open_table(corpus.cells_parquet)


def _make(kind: str, ds, table):
    """A fresh loader iterator of each kind, the same batches every time."""
    if kind == "disk":
        return oj.make_loader(
            ds, batch_size=64, sampling=oj.Block(16, 4), seed=2, num_epochs=2, obs=("drug",)
        )
    if kind == "memory":
        panel = oj.load_panel(ds, list(range(30)), progress=False)
        return oj.make_memory_loader(panel, batch_size=64, seed=2, num_epochs=2)
    if kind == "stream":
        return iter(
            oj.make_stream_loader(
                table,
                batch_size=64,
                output=oj.Panel([1, 2, 3]),
                sampling=oj.Stream(shuffle=True, fetch_factor=4, drop_remainder=False),
                seed=2,
            )
        )
    return iter(
        oj.make_grain_loader(ds, batch_size=64, sampling=oj.Block(fetch_factor=4), seed=2, num_epochs=2)
    )


def _index(batch) -> np.ndarray:
    return np.asarray(batch.index)


@pytest.mark.parametrize("kind", ["disk", "memory", "stream", "grain"])
def test_checkpoint_manager_round_trip_with_grains_handler(kind, ds, table, tmp_path):
    it = _make(kind, ds, table)
    assert isinstance(it, grain.DatasetIterator | grain.DataLoaderIterator)
    for _ in range(11):
        next(it)
    params = {"w": np.arange(6.0).reshape(2, 3)}
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(
            11,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(params), data=grain.checkpoint.CheckpointSave(it)
            ),
        )
        mngr.wait_until_finished()
        expected = [_index(b) for _, b in zip(range(40), it, strict=False)]
        again = _make(kind, ds, table)
        restored = mngr.restore(
            mngr.latest_step(),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(params), data=grain.checkpoint.CheckpointRestore(again)
            ),
        )
    np.testing.assert_array_equal(restored["state"]["w"], params["w"])
    got = [_index(b) for _, b in zip(range(40), again, strict=False)]
    assert len(got) == len(expected) > 0
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    state = json.loads((tmp_path / "ckpt" / "11" / "data" / "process_0-of-1.json").read_text())
    assert len(json.dumps(state)) < 1024


def test_orbax_v1_save_and_load_checkpointables(ds, tmp_path):
    ocp1 = pytest.importorskip("orbax.checkpoint.experimental.v1")
    loader = _make("disk", ds, None)
    for _ in range(9):
        next(loader)
    ocp1.save_checkpointables(tmp_path / "9", {"params": {"w": np.ones(3)}, "dataset": loader})
    expected = [_index(b) for b in loader]
    again = _make("disk", ds, None)
    ocp1.load_checkpointables(tmp_path / "9", {"dataset": again})
    got = [_index(b) for b in again]
    assert len(got) == len(expected) > 0 and all(
        np.array_equal(a, b) for a, b in zip(got, expected, strict=True)
    )


def test_restore_into_another_config_is_refused_line_by_line(ds, tmp_path):
    loader = _make("disk", ds, None)
    next(loader)
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(loader)))
        mngr.wait_until_finished()
        other = oj.make_loader(
            ds, batch_size=32, sampling=oj.Block(16, 4), seed=3, num_epochs=2, obs=("drug",)
        )
        with pytest.raises(oj.StateMismatchError) as e:
            mngr.restore(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(other)))
    lines = str(e.value).splitlines()
    assert lines[1:] == [
        "  batch_size: in checkpoint 64, in loader 32",
        "  seed: in checkpoint 2, in loader 3",
    ]


def test_stream_loader_resumes_by_skipping_windows(table):
    loader = oj.make_stream_loader(
        table, batch_size=50, sampling=oj.Stream(shuffle=True, fetch_factor=4), seed=1
    )
    it = loader.epoch(1)
    head = [_index(next(it)) for _ in range(9)]
    state = it.get_state()
    tail = [_index(b) for b in it]
    again = loader.epoch(0)  # another pass: the state says which
    again.set_state(state)
    assert [b.tolist() for b in map(_index, again)] == [b.tolist() for b in tail]
    served = np.concatenate(head + tail)
    assert len(np.unique(served)) == len(served) == (table.select().size // 50) * 50
    with pytest.raises(oj.StateMismatchError, match="seed: in checkpoint 1, in loader 2"):
        oj.make_stream_loader(
            table, batch_size=50, sampling=oj.Stream(shuffle=True, fetch_factor=4), seed=2
        ).epoch(1).set_state(state)


def _readme_loop() -> str:
    """The Orbax training loop of the Grain and Orbax guide (the code block that starts with ``# orbax_loop.py``)."""
    readme = repo_file("docs/grain.md").read_text()
    start = readme.index("```python\n# orbax_loop.py") + len("```python\n")
    return readme[start : readme.index("```", start)]


def test_readme_orbax_loop_resumes_bit_exactly_after_sigkill(dataset_dir, tmp_path):
    script = tmp_path / "orbax_loop.py"
    script.write_text(_readme_loop())
    assert len(_readme_loop().splitlines()) <= 40
    steps = "300"
    subprocess.run(  # a relative checkpoint directory, which Orbax refuses unless made absolute
        [sys.executable, str(script), str(dataset_dir), "ref", steps],
        check=True,
        timeout=300,
        capture_output=True,
        cwd=tmp_path,
    )
    killed = tmp_path / "killed"
    run = subprocess.Popen(
        [sys.executable, str(script), str(dataset_dir), str(killed), steps],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not (killed / "20").exists():  # a published step: kill it right after, mid-run
        assert run.poll() is None, run.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    run.send_signal(signal.SIGKILL)
    run.wait()
    run.stderr.close()
    interrupted_at = max(int(p.name) for p in killed.iterdir() if p.name.isdigit())
    assert interrupted_at < int(steps)
    subprocess.run(
        [sys.executable, str(script), str(dataset_dir), str(killed), steps],
        check=True,
        timeout=300,
        capture_output=True,
    )

    def final(directory):
        with ocp.CheckpointManager(directory) as mngr:
            r = mngr.restore(
                int(steps),
                args=ocp.args.Composite(state=ocp.args.StandardRestore(), losses=ocp.args.JsonRestore()),
            )
        return r["state"], r["losses"]

    (a, losses_a), (b, losses_b) = final(tmp_path / "ref"), final(killed)
    assert losses_a == losses_b and len(losses_a) == int(steps)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
