"""Minibatch label entropy under block sampling: plug-in estimates and the scDataset bounds.

Block sampling (scDataset, Section 3.4, Appendix C) draws blocks of ``b`` contiguous cells, reads
``f·M`` cells per fetch (``f`` = fetch factor), shuffles them and splits them into minibatches of
``M``. With the Paninski bias ``E[H_plugin] ≈ H - (K-1)/(2N ln 2)`` (bits; ``K`` labels with
``p_k > 0``), the expected plug-in entropy of a minibatch lies between (Corollary 3.3) the lower
bound ``H(p) - (K-1)·b/(2M ln 2)`` (Theorem 3.2, ``f = 1``, effective sample size ``M/b``; 0 when
``b ≥ M``) and the upper bound ``H(p) - (K-1)/(2M ln 2)`` (Theorem 3.1, ``f → ∞``, also true random
sampling), both clamped at 0. The expansion is first order: when ``M/b`` is not large against
``K`` the true bias is larger, and the mean can fall a little below ``lower``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np


@dataclasses.dataclass(frozen=True)
class EntropyBounds:
    """Population label entropy and the expected-minibatch-entropy bounds, all in bits."""

    population: float
    lower: float
    upper: float
    num_labels: int
    batch_size: int
    block_size: int
    fetch_factor: int


def _check_sampling(batch_size: int, block_size: int, fetch_factor: int) -> None:
    for name, v in (("batch_size", batch_size), ("block_size", block_size), ("fetch_factor", fetch_factor)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            msg = f"{name} must be a positive integer, got {v!r}"
            raise ValueError(msg)
    fetch = fetch_factor * batch_size
    if fetch < block_size:
        msg = (
            f"a fetch of fetch_factor·batch_size = {fetch_factor}·{batch_size} = {fetch} cells holds "
            f"{fetch / block_size:.3g} blocks of block_size={block_size}: a fetch must hold at least one "
            "whole block; lower block_size or raise fetch_factor"
        )
        raise ValueError(msg)


def _check_labels(labels: np.ndarray, what: str) -> np.ndarray:
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        msg = f"{what} must be integer label codes (-1 = missing), got {labels.dtype}; encode them first"
        raise ValueError(msg)
    labels = labels.astype(np.int64, copy=False)
    if labels.size and labels.min() < -1:
        msg = f"{what} holds the label code {labels.min()}: codes must be ≥ 0, or -1 for missing"
        raise ValueError(msg)
    return labels


def minibatch_entropy(labels_per_batch: Iterable[np.ndarray] | np.ndarray) -> np.ndarray:
    """Plug-in label entropy ``-Σ_k (n_k/m) log2(n_k/m)``, in bits, of each minibatch.

    ``labels_per_batch`` is one 1-D integer label array per minibatch, or a 2-D
    ``(num_batches, batch_size)`` array; code -1 marks a missing label and is ignored (``m`` counts
    the labelled cells). Returns a float64 array, 0 for a batch with no labelled cell.
    """
    two_d = isinstance(labels_per_batch, np.ndarray) and labels_per_batch.ndim == 2
    batches = list(labels_per_batch) if two_d else [np.asarray(b) for b in labels_per_batch]
    if any(b.ndim != 1 for b in batches):
        msg = f"each minibatch must be a 1-D label array, got shapes {sorted({b.shape for b in batches})}"
        raise ValueError(msg)
    flat = _check_labels(np.concatenate(batches) if batches else np.zeros(0, np.int64), "labels_per_batch")
    batch_ids = np.repeat(np.arange(len(batches)), [len(b) for b in batches])
    keep = flat >= 0
    _, codes = np.unique(flat[keep], return_inverse=True)  # compact codes: bincount stays small
    k = int(codes.max()) + 1 if codes.size else 1
    counts = np.bincount(batch_ids[keep] * k + codes, minlength=len(batches) * k).reshape(len(batches), k)
    p = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    terms = np.zeros_like(p)
    np.log2(p, out=terms, where=p > 0)
    return -(p * terms).sum(axis=1) + 0.0  # + 0.0 turns -0.0 into 0.0


def entropy_bounds(
    frequencies: np.ndarray, *, batch_size: int, block_size: int, fetch_factor: int
) -> EntropyBounds:
    """Bounds on the expected plug-in minibatch entropy (Theorems 3.1, 3.2; Corollary 3.3).

    ``frequencies`` are label counts or probabilities (normalized here; zero entries are not
    labels); ``batch_size``, ``block_size`` and ``fetch_factor`` are ``M``, ``b`` and ``f``, and a
    fetch of ``f·M`` cells must hold at least one block. ``lower`` (``f = 1``, effective sample size
    ``M/b``) does not depend on ``f``, nor ``upper`` (``f → ∞``) on ``b``.
    """
    _check_sampling(batch_size, block_size, fetch_factor)
    freq = np.asarray(frequencies, dtype=np.float64).ravel()
    if freq.size == 0 or not np.all(np.isfinite(freq)):
        msg = f"frequencies must be finite label counts or probabilities, got {freq}"
        raise ValueError(msg)
    if np.any(freq < 0):
        msg = f"frequencies must be ≥ 0, got {freq[freq < 0][:5]} at {np.flatnonzero(freq < 0)[:5]}"
        raise ValueError(msg)
    if freq.sum() <= 0:
        msg = f"frequencies are all zero ({freq.size} labels): pass the label counts of at least one cell"
        raise ValueError(msg)
    p = freq[freq > 0] / freq.sum()
    k = len(p)  # labels with p_k > 0
    population = max(float(-(p * np.log2(p)).sum()), 0.0)
    bias = (k - 1) / (2 * batch_size * math.log(2))
    upper = max(population - bias, 0.0)
    lower = 0.0 if block_size >= batch_size else max(population - bias * block_size, 0.0)
    return EntropyBounds(population, lower, upper, k, batch_size, block_size, fetch_factor)


def entropy_report(
    labels: np.ndarray,
    batches_rows: Iterable[np.ndarray],
    *,
    block_size: int,
    fetch_factor: int,
    batch_size: int,
) -> dict[str, float | int]:
    """Observed minibatch entropy of a loader next to the bounds for its settings.

    ``labels`` holds per-cell integer codes in dataset row order (-1 = missing); each item of
    ``batches_rows`` the rows of one minibatch. Batches with no labelled cell are skipped.
    Returns ``mean``, ``std``, ``num_batches``, ``lower``, ``upper``, ``population`` and
    ``true_random_expected`` (the expectation under uniform sampling, i.e. ``upper``).
    """
    labels = _check_labels(np.asarray(labels).ravel(), "labels")
    rows = [np.asarray(r, dtype=np.int64) for r in batches_rows]
    scored = [labels[r] for r in rows if np.any(labels[r] >= 0)]
    if not scored:
        msg = f"none of the {len(rows)} minibatches has a labelled cell: pass at least one batch of rows"
        raise ValueError(msg)
    h = minibatch_entropy(scored)
    bounds = entropy_bounds(
        np.bincount(labels[labels >= 0]),
        batch_size=batch_size,
        block_size=block_size,
        fetch_factor=fetch_factor,
    )
    return {
        "mean": float(h.mean()),
        "std": float(h.std()),
        "num_batches": len(h),
        "lower": bounds.lower,
        "upper": bounds.upper,
        "population": bounds.population,
        "true_random_expected": bounds.upper,
    }


def simulate_block_sampling(
    labels: np.ndarray, *, batch_size: int, block_size: int, fetch_factor: int, num_batches: int, seed: int
) -> list[np.ndarray]:
    """Rows of the first ``num_batches`` minibatches of block sampling over cells in file order.

    Each epoch permutes the blocks of ``block_size`` contiguous rows (the last may be shorter),
    cuts the result into fetches of ``fetch_factor·batch_size`` rows, shuffles each fetch and splits
    it into full minibatches (a fetch's leftover rows are dropped); epochs repeat as needed. All
    randomness comes from ``np.random.default_rng(seed)``.
    """
    _check_sampling(batch_size, block_size, fetch_factor)
    n = len(labels)
    if n < batch_size or num_batches < 0:
        msg = f"need ≥ batch_size={batch_size} cells and num_batches ≥ 0; got {n} cells, {num_batches=}"
        raise ValueError(msg)
    rng = np.random.default_rng(seed)
    starts = np.arange(0, n, block_size)
    sizes = np.minimum(block_size, n - starts)
    out: list[np.ndarray] = []
    while len(out) < num_batches:
        perm = rng.permutation(len(starts))
        new_starts = np.cumsum(sizes[perm]) - sizes[perm]
        order = np.repeat(starts[perm] - new_starts, sizes[perm]) + np.arange(n)
        for lo in range(0, n, fetch_factor * batch_size):
            fetch = rng.permutation(order[lo : lo + fetch_factor * batch_size])
            out.extend(fetch[: len(fetch) // batch_size * batch_size].reshape(-1, batch_size))
    return out[:num_batches]
