"""Minibatch label entropy: plug-in estimates, the scDataset bounds, and a block-sampling simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omicsio_jax.sampling.entropy import (
    EntropyBounds,
    entropy_bounds,
    entropy_report,
    minibatch_entropy,
    simulate_block_sampling,
)

# 14 contiguous plates of unequal sizes (4.7%–10.4% of the cells), like Tahoe-100M.
PLATE_PERCENT = np.array([4.7, 5.0, 5.5, 6.0, 6.3, 6.6, 6.9, 7.0, 7.3, 7.6, 8.0, 8.6, 10.1, 10.4])
PLATE_LABELS = np.repeat(np.arange(14), np.round(PLATE_PERCENT * 500).astype(np.int64))  # 50,000 cells
M = 64


def simulated(block_size: int, fetch_factor: int, seed: int = 0, num_batches: int = 400) -> dict:
    rows = simulate_block_sampling(
        PLATE_LABELS,
        batch_size=M,
        block_size=block_size,
        fetch_factor=fetch_factor,
        num_batches=num_batches,
        seed=seed,
    )
    return entropy_report(PLATE_LABELS, rows, block_size=block_size, fetch_factor=fetch_factor, batch_size=M)


# --- minibatch_entropy ---------------------------------------------------------------------------------


def test_known_batches():
    batches = [np.zeros(8, np.int64), np.array([0, 1] * 4), np.arange(4), np.array([3, 3, 7, 7, -1, -1])]
    h = minibatch_entropy(batches)
    np.testing.assert_allclose(h, [0.0, 1.0, 2.0, 1.0])
    assert h.dtype == np.float64 and h[0] == 0.0 and not np.signbit(h[0])


def test_two_d_input_equals_list_input_and_missing_only_batches_score_zero():
    batches = np.array([[0, 1, 2, 3], [5, 5, 5, -1], [-1, -1, -1, -1]], dtype=np.int32)
    np.testing.assert_array_equal(minibatch_entropy(batches), minibatch_entropy(list(batches)))
    np.testing.assert_allclose(minibatch_entropy(batches), [2.0, 0.0, 0.0])
    assert minibatch_entropy([]).shape == (0,)
    assert minibatch_entropy([np.array([], np.int64), np.array([1, 2])]).tolist() == [0.0, 1.0]


def test_huge_label_codes_do_not_blow_up_memory():
    np.testing.assert_allclose(minibatch_entropy([np.array([0, 2**40]), np.array([2**40] * 2)]), [1.0, 0.0])


@pytest.mark.parametrize(
    ("batches", "match"),
    [
        ([np.array([0.5, 1.0])], r"integer label codes .*float64"),
        ([np.array([0, -2])], r"label code -2: codes must be ≥ 0, or -1"),
        ([np.zeros((2, 2), np.int64)], r"1-D label array, got shapes \[\(2, 2\)\]"),
    ],
)
def test_minibatch_entropy_rejects_bad_labels(batches, match):
    with pytest.raises(ValueError, match=match):
        minibatch_entropy(batches)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-1, 9), min_size=1, max_size=80), st.permutations(list(range(10))), st.randoms())
def test_entropy_range_and_invariances(batch, relabel, random):
    labels = np.array(batch, dtype=np.int64)
    h = minibatch_entropy([labels])[0]
    distinct = len(set(batch) - {-1})
    assert 0.0 <= h <= math.log2(max(distinct, 1)) + 1e-12
    renamed = np.where(labels >= 0, np.array(relabel)[labels.clip(0)], -1)
    shuffled = labels.copy()
    random.shuffle(shuffled)
    padded = np.concatenate([labels, [-1, -1]])
    np.testing.assert_allclose(minibatch_entropy([renamed, shuffled, padded]), [h, h, h], atol=1e-12)


# --- entropy_bounds ------------------------------------------------------------------------------------


def test_uniform_labels_and_block_of_one():
    b = entropy_bounds(np.ones(8), batch_size=64, block_size=1, fetch_factor=1)
    assert isinstance(b, EntropyBounds) and b.num_labels == 8
    assert b.population == pytest.approx(3.0)
    assert b.lower == b.upper == pytest.approx(3.0 - 7 / (2 * 64 * math.log(2)))
    assert (b.batch_size, b.block_size, b.fetch_factor) == (64, 1, 1)


def test_counts_and_probabilities_agree_and_zero_entries_are_not_labels():
    counts = entropy_bounds([30, 0, 10, 60], batch_size=32, block_size=4, fetch_factor=8)
    probs = entropy_bounds(np.array([0.3, 0.0, 0.1, 0.6]), batch_size=32, block_size=4, fetch_factor=8)
    assert counts == probs and counts.num_labels == 3


def test_lower_bound_falls_with_block_size_and_is_zero_from_one_block_per_batch():
    lowers = [
        entropy_bounds(PLATE_PERCENT, batch_size=M, block_size=b, fetch_factor=2).lower
        for b in (1, 2, 4, 8, 16, 32)
    ]
    assert all(a > b for a, b in zip(lowers, lowers[1:], strict=False))
    for b, f in ((64, 1), (128, 2)):
        bounds = entropy_bounds(PLATE_PERCENT, batch_size=M, block_size=b, fetch_factor=f)
        assert bounds.lower == 0.0 and bounds.upper > 3.5


def test_bounds_are_clamped_and_one_label_has_no_entropy():
    many = entropy_bounds(np.ones(1000), batch_size=8, block_size=2, fetch_factor=1)
    assert many.lower == many.upper == 0.0 and many.population == pytest.approx(math.log2(1000))
    one = entropy_bounds([0, 5, 0], batch_size=8, block_size=2, fetch_factor=1)
    assert (one.population, one.lower, one.upper, one.num_labels) == (0.0, 0.0, 0.0, 1)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 1000), min_size=1, max_size=30).filter(any),
    st.integers(1, 256),
    st.integers(1, 64),
    st.integers(1, 16),
)
def test_bounds_are_ordered(counts, batch_size, block_size, fetch_factor):
    block_size = min(block_size, batch_size * fetch_factor)
    b = entropy_bounds(counts, batch_size=batch_size, block_size=block_size, fetch_factor=fetch_factor)
    assert 0.0 <= b.lower <= b.upper <= b.population <= math.log2(b.num_labels) + 1e-9


@pytest.mark.parametrize(
    ("frequencies", "kwargs", "match"),
    [
        ([1, -2, 3], {}, r"must be ≥ 0, got \[-2\.\] at \[1\]"),
        ([1, np.nan], {}, r"finite label counts or probabilities, got \[ 1\. nan\]"),
        ([0, 0, 0], {}, r"all zero \(3 labels\)"),
        ([], {}, r"finite label counts"),
        (
            [1, 1],
            {"block_size": 128},
            r"fetch_factor·batch_size = 1·64 = 64 cells holds 0\.5 blocks of "
            r"block_size=128.*lower block_size or raise fetch_factor",
        ),
        ([1, 1], {"batch_size": 0}, r"batch_size must be a positive integer, got 0"),
        ([1, 1], {"fetch_factor": True}, r"fetch_factor must be a positive integer, got True"),
        ([1, 1], {"block_size": 2.0}, r"block_size must be a positive integer, got 2\.0"),
    ],
)
def test_entropy_bounds_rejects_bad_input(frequencies, kwargs, match):
    with pytest.raises(ValueError, match=match):
        entropy_bounds(frequencies, **{"batch_size": 64, "block_size": 4, "fetch_factor": 1, **kwargs})


# --- simulate_block_sampling and entropy_report ---------------------------------------------------------


def test_simulation_is_seeded_and_reads_whole_blocks():
    labels = np.zeros(1024, np.int64)
    a = simulate_block_sampling(labels, batch_size=32, block_size=8, fetch_factor=1, num_batches=40, seed=3)
    b = simulate_block_sampling(labels, batch_size=32, block_size=8, fetch_factor=1, num_batches=40, seed=3)
    c = simulate_block_sampling(labels, batch_size=32, block_size=8, fetch_factor=1, num_batches=40, seed=4)
    assert len(a) == 40 and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    first_epoch = np.concatenate(a[:32])  # 1024 / 32 batches: every row exactly once
    np.testing.assert_array_equal(np.sort(first_epoch), np.arange(1024))
    for rows in a:  # f = 1: each batch is 4 whole blocks of 8 rows
        assert rows.shape == (32,) and sorted(np.bincount(rows // 8)[np.unique(rows // 8)]) == [8] * 4


def test_simulation_rejects_too_few_cells():
    with pytest.raises(ValueError, match=r"≥ batch_size=64 cells .*got 10 cells, num_batches=400"):
        simulate_block_sampling(
            np.zeros(10, np.int64), batch_size=64, block_size=1, fetch_factor=1, num_batches=400, seed=0
        )


def test_report_skips_unlabelled_batches_and_matches_minibatch_entropy():
    labels = np.array([0, 0, 1, 1, -1, -1, 2, 2])
    rows = [np.array([0, 2]), np.array([4, 5]), np.array([0, 1, 6, 7, 4])]
    r = entropy_report(labels, rows, block_size=1, fetch_factor=1, batch_size=2)
    assert r["num_batches"] == 2 and r["mean"] == pytest.approx(1.0) and r["std"] == 0.0
    assert r["population"] == pytest.approx(math.log2(3)) and r["true_random_expected"] == r["upper"]
    with pytest.raises(ValueError, match="none of the 1 minibatches has a labelled cell"):
        entropy_report(labels, [np.array([4, 5])], block_size=1, fetch_factor=1, batch_size=2)


def iid_expected_entropy(num_draws: int, seed: int = 1, reps: int = 20_000) -> float:
    """Monte Carlo E[H_hat] of ``num_draws`` i.i.d. plate draws (the effective-sample-size model)."""
    rng = np.random.default_rng(seed)
    draws = rng.choice(14, size=(reps, num_draws), p=PLATE_PERCENT / PLATE_PERCENT.sum())
    return float(minibatch_entropy(draws).mean())


def test_no_fetching_sits_at_the_effective_sample_size_model_above_the_lower_bound():
    r = simulated(block_size=16, fetch_factor=1)
    # M/b = 4 blocks per batch. The first-order bias (K-1)·b/(2M ln 2) = 2.34 bits overstates the
    # loss at 4 draws, so the mean sits ~0.38 bits above `lower`, at the 4-draw model (1.78 bits).
    assert r["lower"] <= r["mean"] <= r["lower"] + 0.45
    assert r["mean"] == pytest.approx(iid_expected_entropy(M // 16), abs=0.06)


def test_large_fetch_and_true_random_reach_the_upper_bound():
    upper = entropy_bounds(np.bincount(PLATE_LABELS), batch_size=M, block_size=1, fetch_factor=1).upper
    large_fetch = simulated(block_size=16, fetch_factor=64)
    true_random = simulated(block_size=1, fetch_factor=1)
    assert large_fetch["upper"] == true_random["upper"] == true_random["true_random_expected"] == upper
    assert large_fetch["mean"] == pytest.approx(upper, abs=0.1)  # observed 0.05 below
    assert true_random["mean"] == pytest.approx(upper, abs=0.1)  # observed 0.006 below


@pytest.mark.parametrize(("block_size", "fetch_factor"), [(4, 1), (4, 4), (8, 2), (16, 4), (16, 16), (32, 8)])
def test_simulated_mean_lies_between_the_bounds(block_size, fetch_factor):
    r = simulated(block_size, fetch_factor)
    # 0.15 below `lower`: at (b, f) = (4, 1) the effective 16 draws of 14 labels lose more than
    # the first-order bias (observed 0.09 below).
    assert r["lower"] - 0.15 <= r["mean"] <= r["upper"] + 0.05


def test_diversity_grows_with_fetch_factor():
    means = [simulated(16, f)["mean"] for f in (1, 4, 16, 64)]
    assert all(a < b for a, b in zip(means, means[1:], strict=False))
