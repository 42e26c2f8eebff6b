"""The fault soak's short version (benchmarks/soak.py): reads from S3 through a proxy injecting 500s,
503s, resets, slow and truncated bodies and ETag changes, against the same loader over a local copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_short_soak_loses_no_cell_and_crashes_nowhere(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "0.5", "--cells", "3000"]
        + ["--rate", "0.06", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == [], run.stderr[-3000:]
    assert result["mismatches"] == 0
    assert result["epochs_audited"] >= 2  # each audited: every cell exactly once
    assert set(result["faults_injected"]) == {"500", "503", "reset", "slow", "truncated", "412"}
    assert result["surfaced_and_resumed"] > 0  # the dataset opened again, the loader restored from its state
    assert all(
        "changed while in use" in e for e in result["surfaced_examples"]
    )  # only the ETag changes surface
    assert (
        result["flipped"]["read_back_exact"] is True
    )  # a damaged cached chunk was noticed and fetched again
