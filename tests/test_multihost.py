"""Multi-host loading with real JAX processes (jax.distributed on loopback, CPU collectives)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import omicsio_jax as oj
from omicsio_jax.sampling.plan import SamplingPlan

WORKER = Path(__file__).with_name("_multihost_worker.py")
ELASTIC = Path(__file__).with_name("_elastic_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_hosts(dataset_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(i),
                "2",
                str(port),
                str(dataset_dir),
                str(tmp / f"host{i}.json"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((tmp / f"host{i}.json").read_text()) for i in range(2)]


def test_two_processes_see_one_global_mesh(two_hosts):
    for i, host in enumerate(two_hosts):
        assert (host["process_index"], host["process_count"]) == (i, 2)
        assert (host["devices"], host["local_devices"]) == (4, 2)


def test_equal_steps_disjoint_shares_and_real_global_batches(two_hosts, dataset_dir):
    ds = oj.open_dataset(dataset_dir)
    a, b = two_hosts
    assert len(a["steps"]) == len(b["steps"]) == 2 * a["steps_per_epoch"] > 0
    for epoch in range(2):
        span = slice(epoch * a["steps_per_epoch"], (epoch + 1) * a["steps_per_epoch"])
        mine = np.concatenate([s["local"] for s in a["steps"][span]])
        theirs = np.concatenate([s["local"] for s in b["steps"][span]])
        assert len(np.intersect1d(mine, theirs)) == 0  # disjoint shares
        served = np.concatenate([mine, theirs])
        assert len(np.unique(served)) == len(served) and ds.num_cells - len(served) < 32 + 2
    for sa, sb in zip(a["steps"], b["steps"], strict=True):
        assert sa["global_shape"] == [32, ds.num_genes] and len(sa["local"]) == 16
        rows = np.array(sa["local"] + sb["local"])
        assert sa["index_sum"] == sb["index_sum"] == rows.sum()  # the reduction saw both hosts' cells
        values = ds.read_csr(rows)[2]
        assert sa["x_sum"] == pytest.approx(float(values.sum()), rel=1e-5)


def test_hosts_reshuffle_every_epoch_and_follow_the_plan(two_hosts, dataset_dir):
    ds = oj.open_dataset(dataset_dir)
    a = two_hosts[0]
    per = a["steps_per_epoch"]
    first = {r for s in a["steps"][:per] for r in s["local"]}
    second = {r for s in a["steps"][per:] for r in s["local"]}
    assert first != second  # a host does not keep the same cells across epochs
    plan = SamplingPlan(np.arange(ds.num_cells), 32, 16, 2, seed=5, num_hosts=2)
    fetch = plan.fetch(0, 0, 1)
    expected = fetch.rows[np.random.default_rng(list(fetch.shuffle_key)).permutation(len(fetch.rows))][:16]
    assert two_hosts[1]["steps"][0]["local"] == expected.tolist()


def test_dense_rows_built_on_the_devices_equal_the_host_built_rows_on_both_hosts(two_hosts, dataset_dir):
    """``Dense(on_device=True)`` across two processes: each host's slabs are placed into the global
    batch and densified where they live; every host's devices hold the rows the host-built loader
    gives them, and the global sums (a cross-process reduction) agree."""
    ds = oj.open_dataset(dataset_dir)
    a, b = (host["on_device"] for host in two_hosts)
    assert len(a) == len(b) == two_hosts[0]["steps_per_epoch"] > 0
    for sa, sb in zip(a, b, strict=True):
        for step in (sa, sb):
            assert step["global_shape"] == [32, ds.num_genes] and step["shards"] == 2
            assert step["rows_equal"]
            assert step["x_sum"] == step["reference_sum"]
        assert sa["x_sum"] == sb["x_sum"]


@pytest.mark.parametrize("placement", ["host", "device"])
def test_memory_loaders_span_both_processes(two_hosts, dataset_dir, placement):
    ds = oj.open_dataset(dataset_dir)
    panel = oj.load_panel(ds, list(range(50)), progress=False)
    a, b = (host["memory"][placement] for host in two_hosts)
    assert len(a) == len(b) == panel.num_cells // 32
    served = []
    for sa, sb in zip(a, b, strict=True):
        rows = np.array(sa["local"] + sb["local"])
        assert len(sa["local"]) == len(sb["local"]) == 16 and not set(sa["local"]) & set(sb["local"])
        assert sa["index_sum"] == sb["index_sum"] == rows.sum()  # the global batch holds both shares
        assert sa["x_sum"] == sb["x_sum"] == pytest.approx(float(panel.x[rows].sum()), rel=1e-5)
        served.extend(rows.tolist())
    assert len(set(served)) == len(served)  # each cell at most once in the epoch
    if placement == "host":  # the global batches are those of a single process, split in two
        single = oj.make_memory_loader(
            panel, batch_size=32, seed=3, placement=oj.Placement(process_index=0, process_count=1)
        )
        expected = [hb.index for hb in single._host_batches(0, 0)]
        assert [sa["local"] + sb["local"] for sa, sb in zip(a, b, strict=True)] == [
            e.tolist() for e in expected
        ]


def _run_processes(argvs: list[list[str]], timeout: float = 300) -> None:
    """Run one process per argument list, at once, and wait for them all to exit 0."""
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for argv in argvs]
    logs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]


def _run_elastic(count: int, dataset_dir, checkpoints, mode: str, tmp) -> list[dict]:
    port = _free_port()
    outs = [tmp / f"{mode.replace(':', '-')}-{count}-{i}.json" for i in range(count)]
    args = [str(count), str(port), str(dataset_dir), str(checkpoints), mode]
    _run_processes([[sys.executable, str(ELASTIC), str(i), *args, str(out)] for i, out in enumerate(outs)])
    return [json.loads(out.read_text()) for out in outs]


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_elastic_restore_with_real_processes_and_orbax(dataset_dir, tmp_path, before, after):
    """Orbax checkpoint by ``before`` processes, restored by ``after``: every cell of the epoch once."""
    pytest.importorskip(
        "orbax.checkpoint", reason="the orbax extra is not installed (scripts/test.sh installs it)"
    )
    checkpoints = tmp_path / "ckpt"
    saved = _run_elastic(before, dataset_dir, checkpoints, "save:7", tmp_path)
    assert sorted(p.name for p in (checkpoints / "7" / "data").glob("process_*")) == [
        f"process_{i}-of-{before}.json" for i in range(before)
    ]
    resumed = _run_elastic(after, dataset_dir, checkpoints, "resume:7", tmp_path)
    assert [r["audit"] for r in resumed] == ["passed"] * after  # every process's coverage audit
    rows = np.array([r for report in saved + resumed for r in report["served"]])
    rows = rows[rows >= 0]
    np.testing.assert_array_equal(np.sort(rows), np.arange(oj.open_dataset(dataset_dir).num_cells))
    for report in saved:  # Grain's DataLoader, in this process of a real multi-process run
        assert report["grain_w0_equal"] and report["grain_w2_equal"], report.keys()


_DISAGREEING = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
process, port, dataset, out, seed, batch = sys.argv[1:7]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=int(process),
                           initialization_timeout=120)
import omicsio_jax as oj
mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
try:
    oj.make_loader(dataset, batch_size=int(batch), seed=int(seed), num_epochs=1, placement=mesh)
    said = None
except oj.OmicsIOError as e:
    said = str(e)
open(out, "w").write(json.dumps({"said": said}))
"""


@pytest.mark.parametrize("settings", [((3, 32), (4, 32)), ((3, 32), (3, 64))], ids=["seed", "batch_size"])
def test_processes_that_made_different_loaders_are_refused_when_made(dataset_dir, tmp_path, settings):
    """Two processes that disagree on a setting that decides the batches would serve shares of
    different batches (cells twice, others never, each audit complete) or wait forever for a step
    the other never takes: both refuse, naming the setting, when the loader is made."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _DISAGREEING,
                str(i),
                str(port),
                str(dataset_dir),
                str(tmp_path / f"{i}.json"),
            ]
            + [str(v) for v in settings[i]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    name = "seed" if settings[0][0] != settings[1][0] else "batch_size"
    for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, log[-3000:]
        said = json.loads((tmp_path / f"{i}.json").read_text())["said"]
        assert said is not None and "the JAX processes made different loaders" in said, (said, log[-2000:])
        assert f": {name} differ between this process ({i}: " in said and f"process(es) {1 - i};" in said, (
            said
        )


_TRAIN = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
process, port, dataset, root, out = sys.argv[1:6]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=int(process),
                           initialization_timeout=120)
import shutil
import numpy as np
from jax.experimental import multihost_utils
from train import TrainConfig, TrainError, fit
kw = dict(model="linear", batch_size=32, block_size=16, fetch_factor=2, checkpoint_format="orbax",
          checkpoint_every=3, quiet=True, eval_where="batch = 'plate_01'", seed=3)
whole = fit(TrainConfig(dataset, "drug", steps=6, checkpoint_dir=f"{root}/run", **kw))
if process == "0":  # as if killed before step 6's checkpoint
    shutil.rmtree(f"{root}/run/6")
multihost_utils.sync_global_devices("step 6 removed")
resumed = fit(TrainConfig(dataset, "drug", steps=6, checkpoint_dir=f"{root}/run", resume=True, **kw))
try:
    fit(TrainConfig(dataset, "drug", steps=1, checkpoint_dir=f"{root}/eqx", **{**kw, "checkpoint_format": "equinox"}))
    refused = None
except TrainError as e:
    refused = str(e)
params = lambda r: [np.asarray(multihost_utils.process_allgather(a, tiled=True)).tolist()
                    for a in jax.tree.leaves(r.model) if hasattr(a, "shape")]
open(out, "w").write(json.dumps({
    "whole": [h["loss"] for h in whole.history], "resumed": [h["loss"] for h in resumed.history],
    "start": resumed.start_step, "eval": [whole.eval.accuracy, whole.eval.num_cells],
    "eval_resumed": [resumed.eval.accuracy, resumed.eval.num_cells],
    "same_params": params(whole) == params(resumed), "refused": refused}))
"""


def test_a_classifier_trains_evaluates_and_resumes_on_two_processes(dataset_dir, tmp_path):
    """`train.fit` on two JAX processes: an Orbax checkpoint restored onto the replicated arrays
    (it was restored onto one device, which the mesh could not take from another process), the
    held-out cells scored from the global batches (they could not be read on one process), and the
    Equinox format, whose one folder every process would write, refused in one line."""
    pytest.importorskip(
        "orbax.checkpoint", reason="the orbax extra is not installed (scripts/test.sh installs it)"
    )
    port = _free_port()
    outs = [tmp_path / f"{i}.json" for i in range(2)]
    args = [str(port), str(dataset_dir), str(tmp_path)]
    _run_processes(
        [[sys.executable, "-c", _TRAIN, str(i), *args, str(out)] for i, out in enumerate(outs)], 600
    )
    reports = [json.loads(out.read_text()) for out in outs]
    held_out = len(oj.open_dataset(dataset_dir).rows_where("batch", ["plate_01"]))
    for r in reports:
        assert r["start"] == 3 and r["resumed"] == r["whole"][3:] and r["same_params"]
        assert r["eval"] == r["eval_resumed"] and r["eval"][1] == held_out  # every held-out cell, once
        assert "checkpoint_format 'equinox' writes one folder from every process" in r["refused"]
    assert reports[0]["eval"] == reports[1]["eval"] and reports[0]["whole"] == reports[1]["whole"]
