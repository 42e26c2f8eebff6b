"""Pretraining learns: the tiny Geneformer's embeddings after masked pretraining separate the cell
types, and it fills in masked genes (the run: `_learning.RUN`, ~105 s on 2 cores beside the scGPT test; the probe rises by
~1,000 steps in benchmarks/results/pretrain_learning.json)."""

from __future__ import annotations

from _learning import MARGIN, pretrain_and_score


def test_pretraining_learns_cell_types_that_a_random_network_does_not_show(dataset_dir):
    """Masked pretraining of the tiny Geneformer (fixed seeds) gives cell embeddings whose held-out
    linear probe of ``cell_type`` beats the same network at its random initialization by a margin,
    and fills in masked genes far above the frequency baseline: it learns the cell types' programs."""
    _, probe, filled = pretrain_and_score(dataset_dir, tokens="geneformer", max_len=32)
    assert probe["fit_cells"] == probe["test_cells"] == 500 and probe["label"] == "cell_type"
    gain = probe["accuracy"]["pretrained"] - probe["accuracy"]["random_init"]
    assert gain > MARGIN, probe["accuracy"]
    assert filled["positions"] > 1000 and filled["accuracy"] > 3 * filled["baseline"], filled
