"""The normalization modes, defined once: checked here, computed by the numba kernels and on the devices.

``mode`` is ``None`` (raw values), ``"log1p"`` (``log1p(v)``) or ``"normalize_log1p"``: scanpy's
``normalize_total(target_sum=...)`` followed by ``log1p``. Per row, ``total`` is the sum of the
row's values (over every gene, also for a gene panel, as scanpy normalizes before subsetting) and
each value becomes ``log1p((v / total) * float32(target_sum))``, every step in float32; a row whose
total is 0 stays 0. The numba kernels (`row_total`, `transform`, inlined into the scatter and
token kernels), the on-device densify of csr slabs (`Normalization.apply_entries`) and training's
normalization on the devices (`Normalization.apply`) all follow this one definition.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numba as nb
import numpy as np

from omicsio_jax.core.errors import OmicsIOError

MODES = (None, "log1p", "normalize_log1p")
RAW, LOG1P, NORMALIZE_LOG1P = 0, 1, 2
_F32_MAX = float(np.finfo(np.float32).max)


class NormalizationError(OmicsIOError, ValueError):
    """A normalization mode or target sum that does not exist (an `OmicsIOError` and a `ValueError`)."""


@dataclasses.dataclass(frozen=True)
class Normalization:
    """A normalization mode and its ``target_sum``, validated once (`NormalizationError`).

    >>> oj.Normalization("normalize_log1p").apply(x)        # dense rows on the devices   # doctest: +SKIP
    """

    mode: str | None = None
    target_sum: float = 1e4

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            msg = f"normalize must be None, 'log1p' or 'normalize_log1p'; got normalize={self.mode!r}"
            raise NormalizationError(msg)
        ts = self.target_sum
        if (
            isinstance(ts, bool)
            or not isinstance(ts, int | float | np.number)
            or not 0 < float(ts) <= _F32_MAX
            or np.float32(ts) == 0  # below float32's smallest: every value would become 0
        ):
            msg = f"target_sum={ts!r} must be a positive float32-representable number, e.g. target_sum=1e4"
            raise NormalizationError(msg)

    @property
    def code(self) -> int:
        """The mode as the kernels take it (`RAW`, `LOG1P`, `NORMALIZE_LOG1P`)."""
        return MODES.index(self.mode)

    def apply(self, x: jax.Array) -> jax.Array:
        """Dense rows ``x`` (cells × genes, raw values) normalized, on the devices (jit-friendly)."""
        x = jnp.asarray(x, jnp.float32)
        if self.mode == "normalize_log1p":
            total = x.sum(axis=1, keepdims=True)
            x = x / jnp.where(total == 0, jnp.inf, total) * jnp.float32(self.target_sum)
        return x if self.mode is None else jnp.log1p(x)

    def apply_entries(self, values: jax.Array, row_ids: jax.Array, num_rows: int) -> jax.Array:
        """The nonzero entries ``values`` of rows ``row_ids`` (of ``num_rows``) normalized, on the devices;
        padding entries (value 0) add nothing to a row's total, nor do entries of rows past
        ``num_rows`` (dropped)."""
        values = jnp.asarray(values, jnp.float32)
        if self.mode == "normalize_log1p":
            totals = jax.ops.segment_sum(values, row_ids, num_segments=num_rows, mode="drop")
            totals = jnp.where(totals == 0, jnp.inf, totals).at[row_ids].get(mode="clip")  # 0 keeps a row 0
            values = values / totals * jnp.float32(self.target_sum)
        return values if self.mode is None else jnp.log1p(values)


@nb.njit(inline="always")
def row_total(values, lo, hi, mode):
    """A row's total for ``mode`` ``NORMALIZE_LOG1P`` (1 otherwise), summed in float64; +inf for a
    zero total, so that ``v / total`` is 0."""
    if mode != NORMALIZE_LOG1P:
        return np.float32(1.0)
    total = 0.0
    for j in range(lo, hi):
        total += values[j]
    return np.float32(np.inf) if total == 0 else np.float32(total)


@nb.njit(inline="always")
def transform(v, mode, total, target_sum):
    """One value of a row normalized (``total`` from `row_total`, ``target_sum`` float32)."""
    if mode == RAW:
        return v
    if mode == NORMALIZE_LOG1P:
        v = np.float32(np.float32(v / total) * target_sum)
    return np.float32(np.log1p(v))
