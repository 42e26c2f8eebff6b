"""The fault soak's short version (benchmarks/soak.py): a 2-host Grain loop reading from S3 through a
proxy injecting 500s, 503s, resets, slow and truncated bodies and ETag changes, its workers
SIGKILLed and host 0 SIGTERMed and resumed from Orbax, against the same loader over a local copy."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import repo_file

import omicsio_jax as oj
from omicsio_jax.storage.store import S3Store


def test_a_short_soak_loses_no_cell_and_crashes_nowhere(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, str(repo_file("benchmarks/soak.py")), "--minutes", "0.5", "--cells", "3000"]
        + ["--rate", "0.06", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == [], run.stderr[-3000:]
    assert result["mismatches"] == 0  # every batch, replays after restores included, as without faults
    assert result["epochs_audited"] >= 2  # each audited: every cell exactly once over both hosts
    assert set(result["faults_injected"]) == {"500", "503", "reset", "slow", "truncated", "412"}
    assert all(k > 0 for k in result["workers_killed"])
    assert result["worker_kills_recovered"] == result["workers_killed"], result["stalls"]
    assert result["orbax_resumes"][0] == result["sigterms"] > 0  # preempted, resumed from its checkpoint
    assert result["replayed_after_restores"] > 0
    assert result["grain_workers_left_running"] == 0  # no worker outlives its host
    assert result["surfaced_and_resumed"] > 0  # restored from the last checkpoint
    assert any("changed while in use" in e for e in result["surfaced_examples"])  # the ETag changes surface
    assert all(e.startswith(("ObjectChangedError", "ObjectStoreError")) for e in result["surfaced_examples"])
    # a damaged cached chunk was noticed and fetched again
    assert result["flipped"].get("read_back_exact") is True, result["flipped"]


@pytest.fixture
def proxied(s3, monkeypatch):
    """An object on S3 and a store reading it through a `FaultProxy` (its script set by the test)."""
    sys.path.insert(0, str(repo_file("benchmarks/_fault_proxy.py").parent))
    from _fault_proxy import FaultProxy

    data = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    s3.client().put_object(Bucket=s3.bucket, Key="obj/blob", Body=data)
    proxy = FaultProxy(s3.endpoint, rate=0.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    store = S3Store(s3.url("obj"))
    yield proxy, store, data, store.head("blob").etag
    proxy.stop()


def test_a_body_cut_short_is_fetched_again(proxied):
    proxy, store, data, etag = proxied
    proxy.script = ["truncated", "reset", "503"]
    assert store.get_ranges("blob", [(1000, 250_000)], etag) == [data[1000:250_000]]
    assert store.read_bytes("blob") == data


def test_an_object_changed_while_its_body_streams_is_one_line(proxied):
    proxy, store, _, etag = proxied
    proxy.script = ["truncated", "412", "412", "412", "412"]  # the retry finds the object changed
    with pytest.raises(oj.ObjectChangedError, match="changed while in use .*open it again") as caught:
        store.get_ranges("blob", [(0, 250_000)], etag)
    assert "\n" not in str(caught.value)
