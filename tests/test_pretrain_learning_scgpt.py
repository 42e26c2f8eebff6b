"""Pretraining learns, scGPT: after masked pretraining on its own objective (GEP + GEPC, 40% of the
values masked, as scGPT's pretraining script masks them), the tiny scGPT's CLS embedding separates the
cell types and its masked bins beat the corpus-wide mean. Its own module, so that an xdist worker runs
it beside the Geneformer learning test."""

from __future__ import annotations

import omicsio_jax as oj
from train import PretrainConfig, masked_prediction, probe_split
from train._pretrain import pretrain

# ~115 s on 2 cores; the CLS probe first dips below its random-initialization level (the decoders
# fit the genes' typical bins), then rises past it from ~1,000 steps
LEARNING = {
    "tokens": "scgpt",
    "max_len": 64,
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


def test_scgpt_pretraining_learns_cell_types_that_a_random_network_does_not_show(dataset_dir):
    """The held-out linear probe of ``cell_type`` on CLS embeddings beats the same network at its random
    initialization by 10 points (fixed seeds), and the masked bins' error is well below that of
    predicting every bin by the mean: it learns the cell types' programs."""
    config = PretrainConfig(str(dataset_dir), **LEARNING, probe_label="cell_type", probe_cells=1000)
    assert config.masking == 0.4  # scGPT's own default, not BERT's 0.15
    result = pretrain(config)
    probe = result.probe
    assert probe["fit_cells"] == probe["test_cells"] == 500
    gain = probe["accuracy"]["pretrained"] - probe["accuracy"]["random_init"]
    assert gain > MARGIN, probe["accuracy"]
    _, rows, _, test = probe_split(config, oj.open_dataset(dataset_dir))
    filled = masked_prediction(result.model, oj.open_dataset(dataset_dir), config, rows[test])
    assert filled["positions"] > 5000 and filled["mse"] < 0.8 * filled["baseline_mse"], filled
