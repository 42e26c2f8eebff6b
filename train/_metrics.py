"""Classification metrics (numpy) and the JSONL metrics log of a run."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Accuracy and macro-F1 of a model on ``num_cells`` labelled held-out cells."""

    accuracy: float
    macro_f1: float
    num_cells: int

    def summary(self) -> str:
        return (
            f"accuracy {self.accuracy:.4f}  macro-F1 {self.macro_f1:.4f}  "
            f"on {self.num_cells:,} held-out cells"
        )


def accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Share of equal entries (NaN for no entries)."""
    y_true, y_pred = _pair(y_true, y_pred)
    return float(np.mean(y_true == y_pred)) if len(y_true) else float("nan")


def macro_f1(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Mean F1 over the classes present in ``y_true`` ∪ ``y_pred`` (NaN for no entries).

    Per class, F1 = 2·TP / (2·TP + FP + FN), as scikit-learn's ``f1_score(average="macro")``.

    >>> round(macro_f1(np.array([0, 0, 1, 2]), np.array([0, 1, 1, 1])), 4)   # F1s 2/3, 1/2, 0
    0.3889
    """
    y_true, y_pred = _pair(y_true, y_pred)
    if len(y_true) == 0:
        return float("nan")
    classes, inverse = np.unique(np.concatenate([y_true, y_pred]), return_inverse=True)
    t, p = inverse[: len(y_true)], inverse[len(y_true) :]
    k = len(classes)
    tp = np.bincount(t[t == p], minlength=k)
    support_true, support_pred = np.bincount(t, minlength=k), np.bincount(p, minlength=k)
    return float(np.mean(2 * tp / (support_true + support_pred)))  # 2TP+FP+FN = |true| + |pred|


def _pair(y_true: np.ndarray, y_pred: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y_true, y_pred = np.asarray(y_true).ravel(), np.asarray(y_pred).ravel()
    if y_true.shape != y_pred.shape:
        msg = f"y_true and y_pred must have the same length, got {len(y_true)} and {len(y_pred)}"
        raise ValueError(msg)
    return y_true, y_pred


class MetricsLog:
    """Append-only JSONL file, one record per training step: ``{step, epoch, loss, cells_per_s,
    data_wait_s}``. ``resume_after=k`` keeps the step records ``1..k`` already there (what a run
    resumed from step ``k`` must not repeat) and drops the rest; ``None`` starts the file afresh."""

    def __init__(self, path: str | os.PathLike[str], *, resume_after: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = (
            []
            if resume_after is None
            else [r for r in read_metrics(self.path) if "step" in r and r["step"] <= resume_after]
        )
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def sync(self) -> None:
        """Flush to disk (called before a checkpoint is published)."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | os.PathLike[str]) -> list[dict]:
    """The records of a JSONL metrics file (a torn last line, as a kill can leave, is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
