"""Elastic restore and the coverage audit, with hosts simulated in one process (process_index/count).

A checkpoint taken with P hosts restores onto P' hosts: the rest of the epoch serves every cell
that was not served yet exactly once, the global batches stay those of the P-host run until the
round ends, and every host's coverage audit passes at the end of the epoch. The same with real
processes and Orbax is in test_multihost.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import omicsio_jax as oj


@pytest.fixture(scope="module")
def ds(dataset_dir):
    return oj.open_dataset(dataset_dir)


KW = {"batch_size": 96, "sampling": oj.Block(16, 4), "seed": 1, "num_epochs": 1, "obs": ("drug",)}
ROUND_STEPS = 4  # fetch_factor: a round is 4 steps


def _hosts(ds, count, **kw):
    return [oj.make_loader(ds, **{**KW, **kw}, placement=_host(h, count)) for h in range(count)]


def _host(index: int, count: int) -> oj.Placement:
    return oj.Placement(process_index=index, process_count=count)


def _global(batches) -> np.ndarray:
    """The global batch of one step: the hosts' index arrays in host order."""
    return np.concatenate([np.asarray(b.index) for b in batches])


@pytest.mark.parametrize("drop_remainder", [True, False])
@pytest.mark.parametrize(
    "before,steps,after",
    [
        (2, 5, 1),  # mid-round, 2 → 1
        (1, 5, 2),  # mid-round, 1 → 2
        (2, 3, 3),  # the last step of a round, 2 → 3
        (3, 6, 2),  # 3 → 2
        (2, 8, 1),  # on a round boundary: nothing left of the old round
        (2, 30, 3),  # inside the epoch's tail, 2 → 3
    ],
)
def test_restore_onto_another_number_of_hosts_serves_every_cell_once(
    ds, before, steps, after, drop_remainder
):
    kw = {"sampling": oj.Block(16, 4, drop_remainder=drop_remainder)}
    reference = [_global(bs) for bs in zip(*_hosts(ds, before, **kw), strict=True)]
    old = _hosts(ds, before, **kw)
    iters = [iter(loader) for loader in old]
    served = [_global([next(it) for it in iters]) for _ in range(steps)]
    states = [json.loads(json.dumps(loader.get_state())) for loader in old]
    assert all(len(json.dumps(s)) < 1024 for s in states)
    new = _hosts(ds, after, **kw)
    for loader in new:
        loader.set_state(states)
    rest = [_global(bs) for bs in zip(*new, strict=True)]  # each host's audit passes at the epoch's end
    # bit-identical global batches until the old round ends (or the epoch's tail ends)
    until = min(len(rest), (-steps) % ROUND_STEPS if steps < 28 else len(reference) - steps)
    for a, b in zip(rest[:until], reference[steps : steps + until], strict=True):
        np.testing.assert_array_equal(a, b)
    rows = np.concatenate(served + rest)
    rows = rows[rows >= 0]
    assert len(np.unique(rows)) == len(rows)  # nothing served twice
    if not drop_remainder:
        np.testing.assert_array_equal(np.sort(rows), np.arange(ds.num_cells))  # and nothing skipped
    else:
        assert ds.num_cells - len(rows) < KW["batch_size"] + max(before, after)


def test_coverage_reports_served_and_planned_and_checks_the_epoch(ds):
    loader = oj.make_loader(ds, **{**KW, "num_epochs": 2})
    first = loader.coverage()
    assert first.epoch == 0 and first.served == oj.Tally() and not first.complete
    batches = [np.asarray(next(loader).index) for _ in range(loader.steps_per_epoch - 1)]
    partial = loader.coverage()
    assert partial.served == oj.Tally.of(np.concatenate(batches)) and not partial.complete
    last = np.asarray(next(loader).index)
    assert loader.coverage().epoch == 1  # the epoch ended, and its audit passed
    assert oj.Tally.of(np.concatenate([*batches, last])) == first.planned
    assert loader.coverage(0).complete  # the epoch that just ended is kept
    list(loader)  # the last epoch: served, the loader exhausted
    assert loader.coverage().epoch == 1 and loader.coverage().complete  # the last one, not an epoch 2
    assert set(first.to_dict()) == {
        "epoch",
        "served_cells",
        "served_checksum",
        "planned_cells",
        "planned_checksum",
        "complete",
    }


def test_a_state_that_does_not_add_up_fails_the_audit_at_the_epoch_end(ds):
    loader = oj.make_loader(ds, **KW)
    for _ in range(3):
        next(loader)
    state = loader.get_state()
    state["served"][0] += 1  # a checkpoint whose served tally disagrees with its position
    resumed = oj.make_loader(ds, **KW)
    resumed.set_state(state)
    with pytest.raises(oj.CoverageError, match=r"epoch 0 served 2,.*cells were skipped or repeated"):
        list(resumed)


def test_elastic_states_are_checked(ds):
    old = _hosts(ds, 2)
    for loader in old:
        next(loader)
    next(old[0])  # process 0 one step ahead: not one checkpoint
    states = [loader.get_state() for loader in old]
    one = oj.make_loader(ds, **KW)
    with pytest.raises(oj.StateMismatchError, match="different positions"):
        one.set_state(states)
    with pytest.raises(oj.StateMismatchError, match="written by 2 processes and this run has 1: pass all 2"):
        one.set_state(states[1])
    twin = _hosts(ds, 2)[0]
    with pytest.raises(oj.StateMismatchError, match="state of process 1, and this loader is process 0"):
        twin.set_state(states[1])
    with pytest.raises(oj.StateMismatchError, match=r"seed: in checkpoint 1, in loader 2"):
        oj.make_loader(ds, **{**KW, "seed": 2}).set_state(states)


def test_read_loader_states_reads_every_process_file(ds, tmp_path):
    old = _hosts(ds, 2)
    for loader in old:
        next(loader)
    for h, loader in enumerate(old):
        (tmp_path / f"process_{h}-of-2.json").write_text(json.dumps(loader.get_state()))
    assert [s["process"] for s in oj.read_loader_states(tmp_path)] == [[0, 2], [1, 2]]
    (tmp_path / "process_1-of-2.json").unlink()
    with pytest.raises(oj.StateMismatchError, match=r"process\(es\) \[1\] of 2 are missing"):
        oj.read_loader_states(tmp_path)
    with pytest.raises(oj.StateMismatchError, match="no process_<i>-of-<n>.json"):
        oj.read_loader_states(tmp_path / "nowhere")


def test_memory_loader_restores_onto_another_number_of_hosts(ds):
    panel = oj.load_panel(ds, list(range(40)), obs=("drug",), progress=False)
    kw = {"batch_size": 64, "seed": 4, "num_epochs": 1, "drop_remainder": False}
    old = [oj.make_memory_loader(panel, **kw, placement=_host(h, 2)) for h in range(2)]
    served = [np.concatenate([np.asarray(next(loader).index) for loader in old]) for _ in range(7)]
    states = [loader.get_state() for loader in old]
    new = [oj.make_memory_loader(panel, **kw, placement=_host(h, 4)) for h in range(4)]
    for loader in new:
        loader.set_state(states)
    rest = [np.concatenate([np.asarray(b.index) for b in bs]) for bs in zip(*new, strict=True)]
    rows = np.concatenate(served + rest)
    np.testing.assert_array_equal(np.sort(rows[rows >= 0]), np.sort(panel.rowids))


def test_weighted_restore_onto_another_number_of_hosts_serves_only_real_cells(ds):
    """Weighted sampling whose short last block is drawn again and again still fills every global
    batch with real cells, before and after a restore from 2 hosts onto 3, and each host's audit passes."""
    weights = np.full(1000, 1e-6)
    weights[-8:] = 1.0  # nearly all on the last block: 8 cells of 16
    kw = {"rows": np.arange(1000), "sampling": oj.Weighted(weights, 16, 2)}
    reference = [_global(bs) for bs in zip(*_hosts(ds, 2, **kw), strict=True)]
    old = _hosts(ds, 2, **kw)
    served = [_global([next(loader) for loader in old]) for _ in range(5)]  # mid-round
    states = [loader.get_state() for loader in old]
    new = _hosts(ds, 3, **kw)
    for loader in new:
        loader.set_state(states)
    rest = [_global(bs) for bs in zip(*new, strict=True)]
    batches = served + rest
    assert len(batches) == len(reference) == new[0].steps_per_epoch
    assert all(len(b) == KW["batch_size"] and (b >= 0).all() for b in batches)
    np.testing.assert_array_equal(rest[0], reference[5])  # the old round ends as it began


@pytest.mark.parametrize("output", ["csr", oj.CSR(nnz_capacity=16384)])
def test_a_csr_loader_restores_onto_another_number_of_hosts(ds, output):
    """A csr batch's slab capacity derived from each host's batch is no part of the state's config, so
    a 2-host state restores onto 1 host; a capacity asked for is, and is the same on any host count."""
    old = _hosts(ds, 2, output=output)
    iters = [iter(loader) for loader in old]
    for _ in range(5):
        for it in iters:
            next(it)
    states = [json.loads(json.dumps(loader.get_state())) for loader in old]
    (new,) = _hosts(ds, 1, output=output)
    new.set_state(states)
    assert np.asarray(next(iter(new)).index).shape == (KW["batch_size"],)
    assert states[0]["config"]["nnz_capacity"] == (None if output == "csr" else 16384)
