"""OpenMP's idle threads set to sleep rather than spin (`passive_waits`), before numba starts them.

numba runs its parallel kernels (record decoding, the encoder, the token kernels) on OpenMP here
(libgomp). After each parallel region libgomp's threads spin, burning a core each, waiting for the
next one, by default for a while longer than the gap between two of this package's kernels. The
loaders and materialize call many short kernels from several threads of their own, beside
reading, statistics and JAX's placement, and a spinning thread takes the core one of those needs.
"""

from __future__ import annotations

import os

WAIT_POLICY = "OMP_WAIT_POLICY"


def passive_waits() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` (libgomp's spin count 0, where unset it is 300,000) unless the
    environment sets a policy (or ``GOMP_SPINCOUNT``, which libgomp takes first): libgomp reads it once, when
    numba's first parallel kernel loads it (so only if none ran before, nor another library loaded
    libgomp). Child processes inherit it: materialize's workers, Grain's.

    Measured on a 2-core AMD EPYC (6 s windows, two rounds each, spinning → passive): dense
    batches of 64 at 81k / 73k → 91k / 76k cells/s, of 1,024 at 119k / 127k → 138k / 141k, csr
    slabs of 1,024 at 282k / 248k → 289k / 260k; a collection of 300,000 cells materialized in one
    process, 10.2 / 9.9 s → 8.7 / 8.7 s. A pool of one-thread workers spins no thread, and
    materialized as fast either way."""
    os.environ.setdefault(WAIT_POLICY, "PASSIVE")
