"""Pretraining learns: the tiny Geneformer's embeddings after masked pretraining separate the cell
types, and it fills in masked genes. Its own module: the longest test of the suite runs on an xdist
worker of its own, beside the other pretraining tests."""

from __future__ import annotations

import omicsio_jax as oj
from train import PretrainConfig, masked_prediction, probe_split
from train._pretrain import pretrain

# the learning test's run (~60 s on 2 cores): enough steps for the tiny Geneformer to learn the cell types'
# programs (benchmarks/results/pretrain_learning.json: the probe rises by ~1,000 steps)
LEARNING = {
    "tokens": "geneformer",
    "max_len": 32,
    "batch_size": 32,
    "steps": 1500,
    "warmup_steps": 150,
    "lr": 2e-3,
    "block_size": 16,
    "fetch_factor": 16,
    "num_devices": 1,
    "quiet": True,
}
MARGIN = 0.10


def test_pretraining_learns_cell_types_that_a_random_network_does_not_show(dataset_dir):
    """Masked pretraining of the tiny Geneformer (fixed seeds) gives cell embeddings whose held-out
    linear probe of ``cell_type`` beats the same network at its random initialization by a margin,
    and fills in masked genes far above the frequency baseline: it learns the cell types' programs."""
    config = PretrainConfig(str(dataset_dir), **LEARNING, probe_label="cell_type", probe_cells=1000)
    result = pretrain(config)
    probe = result.probe
    assert probe["fit_cells"] == probe["test_cells"] == 500 and probe["label"] == "cell_type"
    gain = probe["accuracy"]["pretrained"] - probe["accuracy"]["random_init"]
    assert gain > MARGIN, probe["accuracy"]
    _, rows, _, test = probe_split(config, oj.open_dataset(dataset_dir))
    filled = masked_prediction(result.model, oj.open_dataset(dataset_dir), config, rows[test])
    assert filled["positions"] > 1000 and filled["accuracy"] > 3 * filled["baseline"], filled
