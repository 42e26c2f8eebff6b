"""OpenMP's idle threads sleep rather than spin (`omicsio_jax.core.openmp`): the spin count libgomp
itself reports once a kernel of the package has started it (0: a thread with nothing to do
sleeps at once; unset, libgomp spins 300,000 rounds first), and a policy the user set is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_RUN_A_KERNEL = """
import numpy as np
import omicsio_jax as oj
from omicsio_jax.format.record_encode import encode_csr  # a parallel kernel: OpenMP starts here
encode_csr(np.array([0, 2]), np.array([1, 3], np.int32), np.array([1.0, 2.0], np.float32))
"""


def _spin_count_libgomp_reports(env_policy: str | None) -> str:
    # the runner's own settings left out: libgomp takes GOMP_SPINCOUNT before any policy
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # libgomp prints its settings when it loads
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_A_KERNEL], env=env, capture_output=True, text=True, check=True
    )
    lines = [line for line in proc.stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    assert lines, f"libgomp printed no settings: {proc.stderr[-2000:]}"
    return lines[0].split("=", 1)[1].strip().strip("'")


@pytest.mark.parametrize(("given", "spins"), [(None, False), ("ACTIVE", True)])
def test_openmp_threads_wait_passively_unless_the_user_said_otherwise(given, spins):
    assert (int(_spin_count_libgomp_reports(given)) > 0) == spins
