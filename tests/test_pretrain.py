"""`omicsio-train pretrain` / `embed`: token batches → Equinox transformer, exact resume, linear probe."""

from __future__ import annotations

import json

import equinox as eqx
import jax
import numpy as np
import pytest
from conftest import kill_at

import omicsio_jax as oj
from materialize import materialize
from train import TrainError, latest_checkpoint, list_checkpoints, logistic_probe, save_checkpoint
from train._cli import main, parse_pretrain_config
from train._pretrain import embed, load_pretrained, pretrain

TINY = [
    "--preset",
    "tiny",
    "--batch-size",
    "16",
    "--block-size",
    "4",
    "--fetch-factor",
    "4",
    "--warmup-steps",
    "3",
    "--quiet",
]


def _args(dataset_dir, tokens: str, *extra: str) -> list[str]:
    length = "24" if tokens == "geneformer" else "20"
    return ["pretrain", str(dataset_dir), "--tokens", tokens, "--max-len", length, *TINY, *extra]


def _leaves(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


@pytest.mark.parametrize(("tokens", "fmt"), [("geneformer", "equinox"), ("scgpt", "orbax")])
def test_pretraining_resumes_bit_identically_after_sigkill(dataset_dir, tmp_path, tokens, fmt):
    args = _args(
        dataset_dir,
        tokens,
        "--steps",
        "12",
        "--checkpoint-every",
        "5",
        "--seed",
        "3",
        "--checkpoint-format",
        fmt,
    )
    reference = pretrain(parse_pretrain_config([*args[1:], "--checkpoint-dir", str(tmp_path / "ref")]))
    ckpt = tmp_path / "killed"
    kill_at(args, ckpt, tmp_path / "stalled", 7, ckpt / ("step-000005" if fmt == "equinox" else "5"))
    resumed = pretrain(parse_pretrain_config([*args[1:], "--checkpoint-dir", str(ckpt), "--resume"]))
    assert resumed.start_step == 5
    for a, b in zip(_leaves(reference.model), _leaves(resumed.model), strict=True):
        np.testing.assert_array_equal(a, b)
    losses = [json.loads(line)["loss"] for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert losses == [r["loss"] for r in reference.history]
    record = reference.history[-1]
    assert {"tokens_per_s", "padded_slots_per_s", "step_time_s", "data_wait_s", "cells_per_s"} <= set(record)


def test_embed_writes_one_cls_embedding_per_cell(dataset_dir, tmp_path, capsys):
    ckpt = tmp_path / "pt"
    assert main([*_args(dataset_dir, "geneformer", "--steps", "4"), "--checkpoint-dir", str(ckpt)]) == 0
    out = tmp_path / "new" / "emb"  # a folder not there yet; np.save's suffix added, and said
    assert (
        main(
            [
                "embed",
                str(dataset_dir),
                "--checkpoint-dir",
                str(ckpt),
                "--out",
                str(out),
                "--batch-size",
                "256",
            ]
        )
        == 0
    )
    assert f"{out}.npy: 3,000 cells × 64" in capsys.readouterr().out
    emb = np.load(f"{out}.npy")
    assert emb.shape == (3000, 64) and emb.dtype == np.float32 and np.isfinite(emb).all()
    model, config, _ = load_pretrained(ckpt)
    ds = oj.open_dataset(dataset_dir)
    for rows in ([5, 17, 2999], [2999, 5, 17, 5]):  # in the order given, a row given twice twice
        np.testing.assert_allclose(embed(model, ds, config, np.array(rows)), emb[rows], rtol=1e-5, atol=1e-6)


def test_embedding_a_run_still_training_leaves_the_save_it_is_writing(dataset_dir, tmp_path):
    """``embed --checkpoint-dir`` (and ``finetune --init DIR``) read the latest published step while
    the run may still be training there: the hidden folder of the save it is writing is its own, not
    a killed run's partial, and deleting it made that save fail (FileNotFoundError, the run lost)."""
    ckpt = tmp_path / "pt"
    assert main([*_args(dataset_dir, "geneformer", "--steps", "2"), "--checkpoint-dir", str(ckpt)]) == 0
    writing = ckpt / ".step-000003.tmp-1"  # the pretraining run's save of step 3, in progress
    writing.mkdir()
    (writing / "state.eqx").write_bytes(b"partial")
    out = tmp_path / "emb.npy"
    assert main(["embed", str(dataset_dir), "--checkpoint-dir", str(ckpt), "--out", str(out)]) == 0
    assert load_pretrained(ckpt)[2]["step"] == 2
    assert (writing / "state.eqx").read_bytes() == b"partial"


def test_a_step_pruned_as_it_is_read_is_replaced_by_the_newer_one(dataset_dir, tmp_path, capsys, monkeypatch):
    """``embed --checkpoint-dir`` and ``finetune --init DIR`` read the latest step of a run that may
    still be training there, saving every step and pruning the older ones (``--keep``): the step
    chosen can be deleted before its state is read. The step that replaced it is read (the read
    stopped with FileNotFoundError); a run that prunes each step chosen before it is read, five
    times over, is a one-line error."""
    ckpt = tmp_path / "pt"
    assert main([*_args(dataset_dir, "geneformer", "--steps", "2"), "--checkpoint-dir", str(ckpt)]) == 0
    read = eqx.tree_deserialise_leaves
    saves = []

    def the_run_saves_a_step_first(path, like):  # the next step published, the one being read pruned
        latest = latest_checkpoint(ckpt)
        meta = {k: v for k, v in latest.meta.items() if k not in ("step", "format_version")}
        saves.append(save_checkpoint(ckpt, latest.step + 1, like, meta, keep=1))
        return read(path, like)

    monkeypatch.setattr(eqx, "tree_deserialise_leaves", the_run_saves_a_step_first)
    with pytest.raises(
        TrainError, match=r"the latest checkpoint was deleted before it could be read, 5 times"
    ):
        load_pretrained(ckpt)
    assert [p.name for p in saves] == [f"step-{s:06d}" for s in range(3, 8)]

    once = iter([the_run_saves_a_step_first])
    monkeypatch.setattr(eqx, "tree_deserialise_leaves", lambda p, like: next(once, read)(p, like))
    assert load_pretrained(ckpt)[2]["step"] == 8
    assert [s for s, _ in list_checkpoints(ckpt)] == [8]
    capsys.readouterr()
    monkeypatch.setattr(eqx, "tree_deserialise_leaves", the_run_saves_a_step_first)
    assert main(["embed", str(dataset_dir), "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "e")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"omicsio-train: error: {ckpt}: the latest checkpoint was deleted before it could be read, 5 "
        "times over (the run writing there prunes its steps as fast as they load): try again, or copy "
        "the folder and pass the copy"
    ]


def test_embed_refuses_a_dataset_whose_genes_are_in_another_column_order(
    dataset_dir, corpus, tmp_path, capsys
):
    """The default vocabulary's token g + 3 is gene column g: a checkpoint of it records its
    dataset's gene ids in column order and refuses, in one line, a dataset whose genes differ in that
    order (here reversed); the same genes in the same order, or an older checkpoint, still embed."""
    import anndata as ad

    ckpt = tmp_path / "pt"
    assert main([*_args(dataset_dir, "geneformer", "--steps", "2"), "--checkpoint-dir", str(ckpt)]) == 0
    cells = ad.read_h5ad(corpus.h5ad)[:40]
    for name, genes in (("same", slice(None)), ("reversed", slice(None, None, -1))):
        cells[:, genes].copy().write_h5ad(tmp_path / f"{name}.h5ad")
        materialize(tmp_path / f"{name}.h5ad", tmp_path / name, progress=False)

    def embed_cli(ds) -> int:
        return main(["embed", str(ds), "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "e.npy")])

    capsys.readouterr()
    assert embed_cli(tmp_path / "reversed") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"pretrained with the default vocabulary (token = gene column + 3) on {dataset_dir}" in err
    assert f"ensembl_ids of {tmp_path / 'reversed'} (2,000 genes) differ from them in column order" in err
    assert "pretrain with --vocab FILE keyed on Ensembl id" in err
    assert not (tmp_path / "e.npy").exists()
    assert embed_cli(dataset_dir) == 0
    assert embed_cli(tmp_path / "same") == 0
    assert np.load(tmp_path / "e.npy").shape == (40, 64)
    meta = next(ckpt.glob("step-*")) / "meta.json"  # a checkpoint written before the record: a note
    old = json.loads(meta.read_text())
    del old["gene_order"]
    meta.write_text(json.dumps(old))
    capsys.readouterr()
    assert embed_cli(tmp_path / "reversed") == 0
    assert "records no gene order" in capsys.readouterr().err


def test_the_probe_separates_what_embeddings_carry_and_nothing_else():
    y = np.arange(400) % 5
    assert logistic_probe(np.eye(5)[y[:200]], y[:200], np.eye(5)[y[200:]], y[200:]) == 1.0
    noise = np.random.default_rng(0).normal(size=(400, 16))
    assert logistic_probe(noise[:200], y[:200], noise[200:], y[200:]) < 0.4  # chance is 0.2


def test_pretrain_bad_options(dataset_dir, capsys, monkeypatch):
    assert main(["pretrain", str(dataset_dir), "--tokens", "geneformer", "--max-len", "2", "--quiet"]) == 2
    assert "max_len=2 leaves no room" in capsys.readouterr().err
    import train._pretrain as loop

    def refuse(*a, **k):
        raise AssertionError("the run started before its probe label was checked")

    monkeypatch.setattr(loop, "make_pretrain_step", refuse)  # refused before any step, not after the run
    assert (
        main(
            ["pretrain", str(dataset_dir), "--probe-label", "nope", "--steps", "1", *TINY, "--max-len", "16"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "--probe-label 'nope' must be a categorical obs column" in err and "(missing)" in err
    assert "categorical columns: " in err and "cell_type" in err.rsplit("categorical columns: ", 1)[1]


def test_dropout_overrides_the_presets_rate_and_a_resume_must_keep_it(dataset_dir, capsys):
    """``--dropout`` sets every dropout site of the model (the tiny preset drops at 0.1) and is part
    of what a checkpoint must match; a rate outside [0, 1) is a one-line error."""
    from train._pretrain_config import build_model

    def rates(config) -> set[float]:
        model = build_model(config, 128, jax.random.key(0))
        drops = jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, eqx.nn.Dropout))
        return {n.p for n in drops if isinstance(n, eqx.nn.Dropout)}

    for tokens in ("geneformer", "scgpt"):
        base = [str(dataset_dir), "--tokens", tokens, "--max-len", "20"]
        assert rates(parse_pretrain_config(base)) == {0.1}
        assert rates(parse_pretrain_config([*base, "--dropout", "0"])) == {0.0}
        assert rates(parse_pretrain_config([*base, "--dropout", "0.25"])) == {0.25}
    config = parse_pretrain_config([str(dataset_dir), "--dropout", "0.25"])
    assert (
        config.identity("f")["dropout"]
        == 0.25
        != parse_pretrain_config([str(dataset_dir)]).identity("f")["dropout"]
    )
    assert (
        main(["pretrain", str(dataset_dir), "--dropout", "1", *TINY, "--max-len", "16", "--steps", "1"]) == 2
    )
    assert "--dropout must be in [0, 1); got 1.0" in capsys.readouterr().err
    for rate in ("0", "1"):
        assert main(["pretrain", str(dataset_dir), "--mask-prob", rate, *TINY, "--steps", "1"]) == 2
        assert (
            f"--mask-prob must be in (0, 1): pretraining learns from the masked genes, so with none masked its loss is 0 and it learns nothing; got {float(rate)}"
            in capsys.readouterr().err
        )


def test_the_loop_fetches_metrics_once_per_window_not_per_step(dataset_dir, monkeypatch):
    """With --sync-every 4 the losses reach the host in 4 transfers over 9 steps (step 1, steps 2–4,
    5–8, the last), no step converts its loss on its own, and the logged losses are those of a run that
    fetches every step."""
    from jax._src.array import ArrayImpl

    import train._pretrain as loop

    windows, fetch = [], loop.fetch_metrics
    monkeypatch.setattr(loop, "fetch_metrics", lambda pending: windows.append(len(pending)) or fetch(pending))
    args = _args(dataset_dir, "scgpt", "--steps", "9", "--seed", "1")[1:]
    every = pretrain(parse_pretrain_config([*args, "--sync-every", "1"]))
    assert windows == [1] * 9
    windows.clear()

    def refuse(self, *a):
        raise AssertionError("a device array was converted on the host outside fetch_metrics")

    with monkeypatch.context() as m:
        m.setattr(ArrayImpl, "__float__", refuse)
        m.setattr(ArrayImpl, "item", refuse)
        lagged = pretrain(parse_pretrain_config([*args, "--sync-every", "4"]))
    assert windows == [1, 3, 4, 1]
    assert [r["step"] for r in lagged.history] == list(range(1, 10))
    assert [r["loss"] for r in lagged.history] == [r["loss"] for r in every.history]
    window = [r["step_time_s"] for r in lagged.history[4:8]]  # steps 5–8: one window, its mean step time
    assert len(set(window)) == 1 and window[0] > 0
    assert all(0 <= r["data_wait_s"] <= r["step_time_s"] * 4 for r in lagged.history)
    assert all(r["tokens_per_s"] > 0 and r["padded_slots_per_s"] >= 0 for r in lagged.history)


def _one_line_error(capsys) -> str:
    """The one error line a refused command printed, without its ``omicsio-train: error: `` prefix."""
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("omicsio-train: error: "), err
    return err.strip().removeprefix("omicsio-train: error: ")


def test_pretrain_refuses_bad_counts_and_the_other_token_familys_options(dataset_dir, tmp_path, capsys):
    """The counts the classifier refuses (its `check_counts`) are refused by pretrain too, named by
    their flag, before anything is written: ``--keep 0`` kept no checkpoint (Orbax) or one (Equinox),
    ``--checkpoint-every -1`` saved every step, ``--log-every 0`` divided by zero, ``--steps 0``
    trained an epoch and ``--steps -1`` blamed the warm-up. An option of one token family given
    with the other's tokens is refused, not ignored."""
    ckpt = tmp_path / "k0"
    orbax = ["--checkpoint-dir", str(ckpt), "--checkpoint-format", "orbax", "--checkpoint-every", "2"]
    scgpt = ["--tokens", "scgpt"]
    mistakes = {
        "--keep must be a positive integer, got 0": [*orbax, "--keep", "0"],
        "--checkpoint-every must be >= 0 (0: only at the end), got -1": ["--checkpoint-every", "-1"],
        "--log-every must be a positive integer, got 0": ["--log-every", "0"],
        "--sync-every must be a positive integer, got 0": ["--sync-every", "0"],
        "--steps must be a positive integer, got 0": ["--steps", "0"],
        "--steps must be a positive integer, got -1": ["--steps", "-1"],
        "--max-len must be a positive integer, got 0": ["--max-len", "0"],
        "--devices must be a positive integer, got 0": ["--devices", "0"],
        "--lr must be a non-negative number, got -1.0": ["--lr", "-1"],
        "--lr must be a non-negative number, got nan": ["--lr", "nan"],
        "--clip-norm must be a positive number, got 0.0": ["--clip-norm", "0"],
        "--weight-decay must be a non-negative number, got -5.0": ["--weight-decay", "-5"],
        "--warmup-steps must be >= 0, got -1": ["--warmup-steps", "-1"],
        "--peak-tflops must be a positive number (the device's peak, e.g. 989 for an H100), got -1.0": [
            "--peak-tflops",
            "-1",
        ],
        "--binning tahoe is an option of scgpt tokens, but the tokens are geneformer: drop --binning": [
            "--binning",
            "tahoe",
        ],
        "--mask-mode exact is an option of scgpt tokens, but the tokens are geneformer: drop --mask-mode": [
            "--mask-mode",
            "exact",
        ],
        "--n-bins 11 is an option of scgpt tokens, but the tokens are geneformer: drop --n-bins": [
            "--n-bins",
            "11",
        ],
        "--medians m.tsv is an option of geneformer tokens, but the tokens are scgpt: drop --medians": [
            *scgpt,
            "--medians",
            "m.tsv",
        ],
        "--no-special-tokens is an option of geneformer tokens, but the tokens are scgpt: drop "
        "--no-special-tokens": [*scgpt, "--no-special-tokens"],
    }
    for message, extra in mistakes.items():
        argv = ["pretrain", str(dataset_dir), *TINY, "--max-len", "16", "--steps", "4", *extra]
        assert main(argv) == 2, message
        assert _one_line_error(capsys) == message
    assert not ckpt.exists()
    config = parse_pretrain_config([str(dataset_dir), *scgpt, "--binning", "tahoe", "--mask-mode", "exact"])
    config.validate()  # scGPT's own options pass


def test_pretrain_metrics_carry_each_epochs_coverage_audit(tmp_path):
    """As the classifier's, pretrain's metrics line of each epoch's last step carries the loader's
    coverage audit of that epoch, also when one window of unsynced steps spans several epochs."""
    from materialize import make_synthetic_corpus

    corpus = make_synthetic_corpus(tmp_path / "c", num_cells=96, num_genes=300, seed=3, progress=False)
    materialize(corpus.cells_parquet, tmp_path / "ds", progress=False)
    ckpt = tmp_path / "pt"
    argv = [*_args(tmp_path / "ds", "geneformer", "--epochs", "3", "--sync-every", "20"), "--checkpoint-dir"]
    assert main([*argv, str(ckpt)]) == 0  # 6 steps an epoch, all 18 in one window after step 1
    records = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 19))
    audited = [(r["step"], r["coverage"]) for r in records if "coverage" in r]
    assert [(step, c["epoch"]) for step, c in audited] == [(6, 0), (12, 1), (18, 2)]
    assert all(c["complete"] and c["served_cells"] == c["planned_cells"] == 96 for _, c in audited)
    meta = json.loads(next(ckpt.glob("step-*/meta.json")).read_text())
    assert meta["coverage"] == audited[-1][1]  # the final checkpoint's audit: the last epoch's


def test_embed_and_finetune_refuse_options_a_pretraining_checkpoint_decides(dataset_dir, tmp_path, capsys):
    """A pretraining checkpoint tokenizes as its run did: the token options (for published checkpoints)
    are refused, naming the run's value, not ignored; an error names the flag that gave the
    checkpoint; a batch size of 0 is refused, not read as "the run's"."""
    ckpt, out = tmp_path / "pt", str(tmp_path / "e.npy")
    assert main([*_args(dataset_dir, "geneformer", "--steps", "1"), "--checkpoint-dir", str(ckpt)]) == 0
    embed_ = ["embed", str(dataset_dir), "--checkpoint-dir", str(ckpt), "--out", out]
    finetune = ["finetune", str(dataset_dir), "--init", str(ckpt), "--label", "drug"]
    finetune += ["--eval-where", "batch = 'plate_00'", "--steps", "1", "--quiet"]
    run = f"{ckpt} is an omicsio-train pretrain checkpoint, which tokenizes as its run did"
    options = "the token options are for a published checkpoint (--init hf:DIR or scgpt:DIR)"
    mistakes = {
        f"--tokens scgpt: {run} (tokens: geneformer); {options}: drop --tokens": [
            *embed_,
            "--tokens",
            "scgpt",
            "--max-len",
            "32",
        ],
        f"--max-len 32: {run} (max_len: 24); {options}: drop --max-len": [*embed_, "--max-len", "32"],
        f"--vocab v.tsv: {run} (vocab: the default); {options}: drop --vocab": [
            *finetune,
            "--vocab",
            "v.tsv",
        ],
        f"--no-special-tokens: {run} (special_tokens: True); {options}: drop --no-special-tokens": [
            *finetune,
            "--no-special-tokens",
        ],
        "--batch-size must be a positive integer, got 0": [*embed_, "--batch-size", "0"],
        "--checkpoint-dir nowhere: not a directory of omicsio-train pretrain checkpoints (a published "
        "checkpoint goes in --init hf:DIR or scgpt:DIR)": [
            "embed",
            str(dataset_dir),
            "--checkpoint-dir",
            "nowhere",
            "--out",
            out,
        ],
        "--no-special-tokens is an option of geneformer tokens, but the tokens are scgpt: drop "
        "--no-special-tokens": [
            "embed",
            str(dataset_dir),
            "--init",
            "scgpt:nowhere",
            "--no-special-tokens",
            "--out",
            out,
        ],
    }
    capsys.readouterr()
    for message, argv in mistakes.items():
        assert main(argv) == 2, message
        assert _one_line_error(capsys) == message
    assert not (tmp_path / "e.npy").exists()


def test_a_checkpoint_folder_of_the_other_format_is_refused_not_read_as_empty(dataset_dir, tmp_path, capsys):
    """A run asked for one checkpoint format over a folder of the other's steps: refused before
    anything is written, naming the format to pass (read as empty, it started over, wrote its steps
    beside the others' and replaced their metrics). ``load_pretrained`` of a folder that is not
    there says so and makes none."""
    runs = {"equinox": tmp_path / "eqx", "orbax": tmp_path / "obx"}
    for fmt, folder in runs.items():
        argv = [*_args(dataset_dir, "geneformer", "--steps", "2"), "--checkpoint-dir", str(folder)]
        assert main([*argv, "--checkpoint-format", fmt]) == 0
    for fmt, folder in runs.items():
        other = "orbax" if fmt == "equinox" else "equinox"
        before = sorted(p.name for p in folder.iterdir())
        metrics = (folder / "metrics.jsonl").read_text()
        for resume in ([], ["--resume"]):
            argv = [*_args(dataset_dir, "geneformer", "--steps", "2"), "--checkpoint-dir", str(folder)]
            assert main([*argv, "--checkpoint-format", other, *resume]) == 2
            assert _one_line_error(capsys) == (
                f"{folder} holds {fmt} checkpoints, and this run writes {other}: pass --checkpoint-format "
                f"{fmt} to resume them, or choose another --checkpoint-dir"
            )
        assert sorted(p.name for p in folder.iterdir()) == before
        assert (folder / "metrics.jsonl").read_text() == metrics
    with pytest.raises(TrainError, match="is no folder"):
        load_pretrained(tmp_path / "nope")
    assert not (tmp_path / "nope").exists()
