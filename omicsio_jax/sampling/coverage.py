"""The coverage audit: an order-independent checksum of the cells a loader served in an epoch.

Each global row ``r`` is hashed twice with a 32-bit integer finalizer (Chris Wellons'
``lowbias32``, two seeds); an epoch's checksum is the pair of the sums of those hashes modulo
2^32, packed into one 64-bit integer, with the number of rows. Sums do not depend on order and
add across batches, hosts and restores, so a loader compares what it served with what its plan
says an epoch serves: a skipped, repeated or foreign cell changes the checksum (two different
multisets collide with probability ~2^-64). The same hash runs in numpy/numba on the host and in
jax.numpy on the devices (uint32 arithmetic wraps alike).
"""

from __future__ import annotations

import dataclasses

import numba as nb
import numpy as np

from omicsio_jax.core.errors import OmicsIOError

_SEEDS = (0x9E3779B9, 0x85EBCA6B)
_MASK32 = 0xFFFFFFFF


class CoverageError(OmicsIOError):
    """An epoch ended with served cells that differ from the epoch's plan."""


@nb.njit(inline="always")
def _lowbias32(x):
    # numba widens uint32 products to 64 bits: cast back after each step
    x = np.uint32(x ^ (x >> np.uint32(16)))
    x = np.uint32(x * np.uint32(0x7FEB352D))
    x = np.uint32(x ^ (x >> np.uint32(15)))
    x = np.uint32(x * np.uint32(0x846CA68B))
    return np.uint32(x ^ (x >> np.uint32(16)))


@nb.njit(nogil=True, cache=True)
def _sums(rows):
    count, a, b = 0, np.uint64(0), np.uint64(0)
    for i in range(rows.shape[0]):
        r = rows[i]
        if r >= 0:
            x = np.uint32(r & 0xFFFFFFFF)
            a += _lowbias32(np.uint32(x ^ np.uint32(_SEEDS[0])))
            b += _lowbias32(np.uint32(x ^ np.uint32(_SEEDS[1])))
            count += 1
    return count, a, b


@dataclasses.dataclass(frozen=True)
class Tally:
    """How many rows, and their checksum (``sum`` of the two 32-bit hash sums, packed high/low)."""

    count: int = 0
    checksum: int = 0

    @staticmethod
    def of(rows: np.ndarray) -> Tally:
        """The tally of ``rows`` (global rows; negative entries are padding and are skipped)."""
        count, a, b = _sums(np.ascontiguousarray(rows, dtype=np.int64).reshape(-1))  # numba widens sums: wrap
        return Tally(int(count), ((int(a) & _MASK32) << 32) | (int(b) & _MASK32))

    def __add__(self, other: Tally) -> Tally:
        hi = ((self.checksum >> 32) + (other.checksum >> 32)) & _MASK32
        lo = ((self.checksum & _MASK32) + (other.checksum & _MASK32)) & _MASK32
        return Tally(self.count + other.count, (hi << 32) | lo)

    def to_json(self) -> list[int]:
        return [self.count, self.checksum]

    @staticmethod
    def from_json(value) -> Tally:
        count, checksum = value
        return Tally(int(count), int(checksum))


def device_tally(index, mask):
    """(count, hash sum a, hash sum b) of a batch's real rows as uint32 jax scalars (jit-friendly)."""
    import jax.numpy as jnp

    x = jnp.asarray(index).astype(jnp.uint32)
    live = jnp.asarray(mask)
    out = [jnp.sum(live, dtype=jnp.uint32)]
    for seed in _SEEDS:  # `_lowbias32` in jax.numpy (uint32 products wrap here)
        h = x ^ jnp.uint32(seed)
        h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
        h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
        h = h ^ (h >> 16)
        out.append(jnp.sum(jnp.where(live, h, jnp.uint32(0)), dtype=jnp.uint32))
    return tuple(out)


def tally_from_device(count, a, b) -> Tally:
    return Tally(int(count), ((int(a) & _MASK32) << 32) | (int(b) & _MASK32))


@dataclasses.dataclass(frozen=True)
class Coverage:
    """What a loader served in ``epoch`` so far and what the epoch's plan serves (this process).

    ``complete`` is true once every planned cell was served exactly as often as planned; the
    loaders raise `CoverageError` when an epoch ends without it. Across hosts, the served and
    planned tallies add up to the whole epoch's (after an elastic restore, process 0 carries
    what every process served before it).
    """

    epoch: int
    served: Tally
    planned: Tally

    @property
    def complete(self) -> bool:
        return self.served == self.planned

    def to_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "served_cells": self.served.count,
            "served_checksum": self.served.checksum,
            "planned_cells": self.planned.count,
            "planned_checksum": self.planned.checksum,
            "complete": self.complete,
        }

    def check(self, where: str) -> None:
        """Raise `CoverageError` unless ``complete`` (called at the end of an epoch)."""
        if not self.complete:
            msg = (
                f"{where}: epoch {self.epoch} served {self.served.count:,} cells (checksum "
                f"{self.served.checksum:#018x}) but its plan serves {self.planned.count:,} (checksum "
                f"{self.planned.checksum:#018x}): cells were skipped or repeated"
            )
            raise CoverageError(msg)
