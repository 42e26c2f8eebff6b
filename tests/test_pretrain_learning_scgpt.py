"""Pretraining learns, scGPT: after masked pretraining on its own objective (GEP + GEPC, 40% of the
values masked, as scGPT's pretraining script masks them), the tiny scGPT's CLS embedding separates the
cell types and its masked bins beat the corpus-wide mean (the run: `_learning.RUN`, ~125 s on 2 cores beside the Geneformer test;
the CLS probe first dips below its random-initialization level while the decoders fit the genes'
typical bins, then rises past it from ~1,000 steps)."""

from __future__ import annotations

from _learning import MARGIN, pretrain_and_score


def test_scgpt_pretraining_learns_cell_types_that_a_random_network_does_not_show(dataset_dir):
    """The held-out linear probe of ``cell_type`` on CLS embeddings beats the same network at its random
    initialization by 10 points (fixed seeds), and the masked bins' error is well below that of
    predicting every bin by the mean: it learns the cell types' programs."""
    config, probe, filled = pretrain_and_score(dataset_dir, tokens="scgpt", max_len=64)
    assert config.masking == 0.4  # scGPT's own default, not BERT's 0.15
    assert probe["fit_cells"] == probe["test_cells"] == 500
    gain = probe["accuracy"]["pretrained"] - probe["accuracy"]["random_init"]
    assert gain > MARGIN, probe["accuracy"]
    assert filled["positions"] > 5000 and filled["mse"] < 0.8 * filled["baseline_mse"], filled
