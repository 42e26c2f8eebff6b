"""The learning tests' shared run: the tiny preset pretrained with fixed seeds on the suite's corpus
(without dropout: on 2 CPU cores it costs scGPT's tiny step ~40% of its time, and the run learns as
well or better without it; dropout is exercised by the resume and padding tests), then scored on
held-out cells (the linear probe of ``cell_type`` against the random initialization,
and the masked tokens). Each tokenizer's test is a module of its own, so that xdist runs the two
longest tests of the suite on different workers."""

from __future__ import annotations

import omicsio_jax as oj
from train import PretrainConfig, masked_prediction, probe_split
from train._pretrain import pretrain

RUN = {
    "batch_size": 32,
    "steps": 1500,
    "warmup_steps": 150,
    "lr": 2e-3,
    "block_size": 16,
    "fetch_factor": 16,
    "num_devices": 1,
    "dropout": 0.0,
    "quiet": True,
}
MARGIN = 0.10  # the probe's gain over the random initialization each test asserts


def pretrain_and_score(dataset_dir, **options) -> tuple[PretrainConfig, dict, dict]:
    """``(config, probe, masked)`` of `RUN` with ``options`` (``tokens``, ``max_len``): the run's
    config, its probe (1,000 labelled cells, half held out) and `train.masked_prediction` on the
    probe's held-out cells."""
    config = PretrainConfig(str(dataset_dir), **RUN, **options, probe_label="cell_type", probe_cells=1000)
    result = pretrain(config)
    ds = oj.open_dataset(dataset_dir)
    _, rows, _, test = probe_split(config, ds)
    return config, result.probe, masked_prediction(result.model, ds, config, rows[test])
