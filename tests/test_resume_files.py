"""``--resume`` compares the files a run reads (``--vocab``, ``--medians``, ``--eval-rows``) by what
they hold: the same content under another path resumes, a file changed in place is refused in one
line naming it, and a checkpoint that recorded only the path is compared by path, as it was written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np

import omicsio_jax as oj
from train._cli import main

TINY = ["--preset", "tiny", "--batch-size", "16", "--block-size", "4", "--fetch-factor", "4"]
TINY += ["--warmup-steps", "1", "--max-len", "24", "--steps", "2", "--quiet"]


def _classifier(dataset_dir, ckpt, rows: str, *extra: str) -> list[str]:
    return [
        str(dataset_dir),
        "--label",
        "drug",
        "--hidden",
        "16",
        "--batch-size",
        "64",
        "--fetch-factor",
        "4",
        "--steps",
        "2",
        "--eval-rows",
        rows,
        "--checkpoint-dir",
        str(ckpt),
        "--quiet",
        *extra,
    ]


def _to_legacy(ckpt, name: str) -> None:
    """Rewrite the checkpoint's identity as a run before content digests wrote it: the path of the
    ``name`` option (as its config recorded it) in place of ``<name>_sha256``."""
    meta_file = next(ckpt.glob("step-*/meta.json"))
    meta = json.loads(meta_file.read_text())
    del meta["identity"][f"{name}_sha256"]
    meta["identity"][name] = meta["config"][name]
    meta_file.write_text(json.dumps(meta))


def _rows_sha(rows: np.ndarray) -> str:
    return hashlib.sha256(np.unique(rows).astype(np.int64).tobytes()).hexdigest()[:16]


def _file_sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err.strip()


def test_held_out_rows_are_compared_by_content_on_resume(dataset_dir, tmp_path, monkeypatch, capsys):
    ds = oj.open_dataset(dataset_dir)
    rows = tmp_path / "held_out.npy"
    np.save(rows, ds.rows_where("batch", ["plate_00"]))
    ckpt = tmp_path / "ckpt"
    assert main(_classifier(dataset_dir, ckpt, str(rows))) == 0

    # the same rows by a relative path, a symlink and a copy elsewhere: resumed (nothing left to train)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link.npy").symlink_to(rows)
    shutil.copy(rows, tmp_path / "copy.npy")
    np.save(tmp_path / "int32.npy", np.load(rows).astype(np.int32)[::-1])  # the same rows, parsed
    for given in ("held_out.npy", "link.npy", "copy.npy", "int32.npy"):
        assert main(_classifier(dataset_dir, ckpt, given, "--resume")) == 0, capsys.readouterr().err

    # other rows in the same file: refused in one line naming it
    np.save(rows, np.load(rows)[1:])
    assert main(_classifier(dataset_dir, ckpt, str(rows), "--resume")) == 2
    assert _error(capsys) == (
        f"omicsio-train: error: cannot resume from {ckpt / 'step-000002'}: --eval-rows {rows} holds other "
        f"rows than its run held out ({rows}): sha256 of the rows "
        f"{_rows_sha(np.load(tmp_path / 'copy.npy'))} in checkpoint, {_rows_sha(np.load(rows))} now; "
        "give the same rows, or a fresh --checkpoint-dir"
    )

    # a checkpoint that recorded the path only: the same path resumes, another path is refused
    shutil.copy(tmp_path / "copy.npy", rows)
    _to_legacy(ckpt, "eval_rows")
    assert main(_classifier(dataset_dir, ckpt, str(rows), "--resume")) == 0
    assert main(_classifier(dataset_dir, ckpt, "copy.npy", "--resume")) == 2
    assert "eval_rows: in checkpoint" in capsys.readouterr().err


def test_pretraining_vocab_and_medians_are_compared_by_content_on_resume(
    dataset_dir, tmp_path, monkeypatch, capsys
):
    ds = oj.open_dataset(dataset_dir)
    ens = [e.split(".")[0] for e in ds.features["ensembl_id"]]
    vocab = {"<pad>": 0, "<mask>": 1, "<cls>": 2, "<eos>": 3}
    vocab.update({e: 4 + k for k, e in enumerate(dict.fromkeys(ens))})
    medians = dict(zip(ens, ds.gene_stats["median"].to_numpy().tolist(), strict=True))
    medians = {e: m if m > 0 else 1.0 for e, m in medians.items()}
    files = tmp_path / "files"
    files.mkdir()
    (files / "vocab.json").write_text(json.dumps(vocab))
    (files / "medians.json").write_text(json.dumps(medians))
    ckpt = tmp_path / "pt"

    def argv(vocab_path, medians_path, *extra):
        return [
            "pretrain",
            str(dataset_dir),
            *TINY,
            "--vocab",
            str(vocab_path),
            "--medians",
            str(medians_path),
            "--checkpoint-dir",
            str(ckpt),
            *extra,
        ]

    assert main(argv(files / "vocab.json", files / "medians.json")) == 0, capsys.readouterr().err

    # the run moved: relative paths from another folder, and symlinks, hold the same bytes
    monkeypatch.chdir(tmp_path)
    os.symlink(files / "vocab.json", tmp_path / "v.json")
    assert main(argv("files/vocab.json", "files/medians.json", "--resume")) == 0, capsys.readouterr().err
    assert main(argv("v.json", files / "medians.json", "--resume")) == 0, capsys.readouterr().err

    # changed in place: refused in one line naming the file
    was = _file_sha(files / "medians.json")
    (files / "medians.json").write_text(json.dumps({e: 2 * m for e, m in medians.items()}))
    assert main(argv(files / "vocab.json", "files/medians.json", "--resume")) == 2
    assert _error(capsys) == (
        f"omicsio-train: error: cannot resume from {ckpt / 'step-000002'}: --medians files/medians.json is "
        f"not the file its run read ({files / 'medians.json'}): sha256 {was} in checkpoint, "
        f"{_file_sha(files / 'medians.json')} now; give that file, or a fresh --checkpoint-dir"
    )
    (files / "medians.json").write_text(json.dumps(medians))
    was = _file_sha(files / "vocab.json")
    (files / "vocab.json").write_text(json.dumps({**vocab, ens[0]: len(vocab) + 10}))
    assert main(argv(files / "vocab.json", files / "medians.json", "--resume")) == 2
    assert f"--vocab {files / 'vocab.json'} is not the file its run read" in _error(capsys)
    (files / "vocab.json").write_text(json.dumps(vocab))
    assert _file_sha(files / "vocab.json") == was

    # embed reads the files again from where the run read them: a changed one is refused too
    out = str(tmp_path / "e.npy")
    (files / "medians.json").write_text(json.dumps({e: 3 * m for e, m in medians.items()}))
    assert main(["embed", str(dataset_dir), "--checkpoint-dir", str(ckpt), "--out", out]) == 2
    assert _error(capsys).startswith(
        f"omicsio-train: error: --checkpoint-dir {ckpt}: its run's --medians {files / 'medians.json'} has "
        "changed since it was read (sha256 "
    )
    (files / "medians.json").write_text(json.dumps(medians))
    assert main(["embed", str(dataset_dir), "--checkpoint-dir", str(ckpt), "--out", out]) == 0, _error(capsys)

    # a checkpoint that recorded the paths only: compared by path, as before
    _to_legacy(ckpt, "vocab")
    _to_legacy(ckpt, "medians")
    assert main(argv(files / "vocab.json", files / "medians.json", "--resume")) == 0, capsys.readouterr().err
    assert main(argv("v.json", files / "medians.json", "--resume")) == 2
    assert "vocab: in checkpoint" in capsys.readouterr().err
