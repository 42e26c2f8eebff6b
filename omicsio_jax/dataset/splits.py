"""Reproducible, shareable splits of a dataset by a group (donor, dataset, plate): `split` assigns
whole groups of cells to named splits and writes the assignment as a sidecar, ``splits/<by>.json``,
listed (with its SHA-256) in the manifest; `Dataset.split` turns it back into rows for any loader.

>>> done = oj.split(ds, by="donor_id", fractions=(0.98, 0.01, 0.01), seed=0)   # doctest: +SKIP
>>> done.groups["test"], done.cells["test"]              # the held-out donors, their cells  # doctest: +SKIP
>>> loader = oj.make_loader(ds, batch_size=1024, rows=ds.split("train"))      # doctest: +SKIP

The groups are shuffled by ``seed`` (from their labels in sorted order, so the result does not
depend on the order the categories were stored in) and cut where the cumulative cell counts cross
the fractions: every cell of a group lands in one split, and each split holds about its fraction of
the cells. The groups are a categorical obs's labels, or an integer obs's values (as text: ``"7"``);
another numeric obs is refused, saying how to make it text. Cells without a label (a missing one,
or the empty label ``""``) are in no split. The sidecar names the groups of each split, so a
held-out donor list can be read, reviewed and given to another team as it is; the dataset's
fingerprint is unchanged by it (splits are derived files).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from omicsio_jax.core.errors import DatasetFormatError, OmicsIOError
from omicsio_jax.format.manifest import (
    MANIFEST_NAME,
    SPLITS_DIR,
    Manifest,
    file_entry,
    fsync_path,
    manifest_lock,
    read_manifest,
)


class Dataset(Protocol):
    """What splitting uses of a `omicsio_jax.Dataset` (which calls `read_split`: no import back)."""

    path: Any
    manifest: Manifest
    is_remote: bool
    obs: Any

    def local_path(self, relpath: str) -> Path: ...


@dataclasses.dataclass(frozen=True)
class Split:
    """A dataset's cells split by the groups of obs ``by``: ``groups[name]`` are the labels of the
    groups in split ``name`` and ``cells[name]`` how many cells they hold."""

    by: str
    seed: int
    fractions: dict[str, float]
    groups: dict[str, tuple[str, ...]]
    cells: dict[str, int]
    unlabelled_cells: int

    @property
    def path(self) -> str:
        """The sidecar's path in the dataset."""
        return f"{SPLITS_DIR}{self.by}.json"

    def to_json(self) -> str:
        body = {
            "by": self.by,
            "seed": self.seed,
            "fractions": self.fractions,
            "cells": self.cells,
            "unlabelled_cells": self.unlabelled_cells,
            "groups": {name: list(labels) for name, labels in self.groups.items()},
        }
        return json.dumps(body, indent=1) + "\n"

    @staticmethod
    def from_json(text: str, where: str) -> Split:
        try:
            d = json.loads(text)
            return Split(
                by=str(d["by"]),
                seed=int(d["seed"]),
                fractions={str(k): float(v) for k, v in d["fractions"].items()},
                groups={str(k): tuple(map(str, v)) for k, v in d["groups"].items()},
                cells={str(k): int(v) for k, v in d["cells"].items()},
                unlabelled_cells=int(d["unlabelled_cells"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            msg = f"{where} is not a split sidecar ({type(e).__name__}: {e}); write it again with oj.split"
            raise DatasetFormatError(msg) from e

    def rows(self, dataset: Dataset, name: str) -> np.ndarray:
        """The rows (ascending) of split ``name`` of ``dataset``."""
        if name not in self.groups:
            msg = f"no split {name!r} in {self.path}: its splits are {', '.join(map(repr, self.groups))}"
            raise OmicsIOError(msg)
        codes, labels = _groups(dataset.obs[self.by], f"{dataset.path}: obs {self.by!r}")
        wanted = set(self.groups[name])
        chosen = np.array([i for i, c in enumerate(labels) if c in wanted], np.int64)
        return np.flatnonzero(np.isin(codes, chosen)).astype(np.int64)


def _groups(column, where: str) -> tuple[np.ndarray, tuple[str, ...]]:
    """The cells' groups in obs ``column``: each cell's code (-1: unlabelled) into the labels. A
    categorical's codes and categories, its empty label ``""`` unlabelled as a missing one is; an
    integer column's values, as text. Anything else is refused: ``where`` names the column."""
    if hasattr(column, "categories"):
        codes, labels = np.asarray(column.codes), tuple(column.categories)
        if "" in labels:  # no label, as a missing one
            codes = np.where(codes == labels.index(""), -1, codes)
        return codes, labels
    values = np.asarray(column)
    if values.dtype.kind in "iu":
        numbers, codes = np.unique(values, return_inverse=True)
        return codes.astype(np.int64), tuple(str(v) for v in numbers.tolist())
    kind = {"f": "numeric", "b": "numeric", "M": "of dates", "m": "of times"}.get(
        values.dtype.kind, "no labels"
    )
    msg = (
        f"{where} is {kind} ({values.dtype} values): split by a categorical obs (text such as donor, "
        "dataset or plate) or an integer one; to group by this one, make it text in the input (a table: "
        "--query 'SELECT * REPLACE (CAST(<column> AS VARCHAR) AS <column>) FROM cells'; an AnnData: "
        "adata.obs[<column>] = adata.obs[<column>].astype(str)) and materialize again"
    )
    raise OmicsIOError(msg)


def split(
    dataset: Dataset,
    *,
    by: str,
    fractions: Sequence[float] = (0.98, 0.01, 0.01),
    names: Sequence[str] = ("train", "val", "test"),
    seed: int = 0,
    overwrite: bool = False,
) -> Split:
    """Split ``dataset``'s cells by the groups of obs ``by`` (a categorical's labels, an integer
    column's values; cells without one, or with the empty label ``""``, in no split) into ``names`` holding
    about ``fractions`` of the cells; write ``splits/<by>.json`` beside the dataset and list it in
    the manifest. The same dataset, ``by``, fractions and ``seed`` give the same file, byte for byte.
    An existing split by ``by`` is kept (and returned) when it is the same, replaced with
    ``overwrite=True``, else refused."""
    where = f"oj.split({dataset.path}, by={by!r})"
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        msg = f"{where}: seed must be a non-negative integer, e.g. seed=0; got {seed!r}"
        raise TypeError(msg)
    if seed < 0:
        msg = f"{where}: seed must be a non-negative integer, e.g. seed=0; got {seed}"
        raise OmicsIOError(msg)
    try:
        names, fractions = [str(n) for n in names], [float(f) for f in fractions]
    except (TypeError, ValueError) as e:
        msg = f"{where}: fractions must be numbers, one per name, e.g. fractions=(0.98, 0.01, 0.01); got {fractions!r}"
        raise OmicsIOError(msg) from e
    if len(names) != len(fractions) or len(set(names)) != len(names) or not all(names):
        msg = f"{where}: names {names} and fractions {fractions} must pair up, names distinct and non-empty"
        raise OmicsIOError(msg)
    if any(not np.isfinite(f) or f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        msg = f"{where}: fractions {tuple(fractions)} must be non-negative and sum to 1 (they sum to {sum(fractions):g})"
        raise OmicsIOError(msg)
    if dataset.is_remote:
        msg = f"{where}: splits are written beside a local dataset; split a local copy and upload it with its manifest"
        raise OmicsIOError(msg)
    if by not in dataset.obs:
        msg = f"{where}: no obs {by!r}; obs: {', '.join(dataset.obs) or '(none)'}"
        raise OmicsIOError(msg)
    codes, labels = _groups(dataset.obs[by], f"{where}: obs {by!r}")
    counts = np.bincount(codes[codes >= 0], minlength=len(labels))
    present = sorted(c for c, n in zip(labels, counts, strict=True) if n)
    size = {c: int(n) for c, n in zip(labels, counts, strict=True)}
    order = [present[i] for i in np.random.default_rng(seed).permutation(len(present))]
    wanted = [f > 0 for f in fractions]
    if len(order) < sum(wanted):
        msg = (
            f"{where}: {len(order)} group(s) of {by!r} cannot give each of the {sum(wanted)} splits "
            f"{'/'.join(f'{f:g}' for f in fractions)} a group; use fewer splits or a finer grouping"
        )
        raise OmicsIOError(msg)
    sizes = np.array([size[g] for g in order], np.int64)
    ends = _ends(sizes, fractions)
    groups = {n: order[a:b] for n, a, b in zip(names, [0, *ends[:-1]], ends, strict=True)}
    result = Split(
        by=by,
        seed=int(seed),
        fractions=dict(zip(names, fractions, strict=True)),
        groups={n: tuple(sorted(gs)) for n, gs in groups.items()},
        cells={n: sum(size[g] for g in gs) for n, gs in groups.items()},
        unlabelled_cells=int((codes < 0).sum()),
    )
    _write(dataset, result, overwrite=overwrite, where=where)
    return result


def _ends(sizes: np.ndarray, fractions: Sequence[float]) -> list[int]:
    """Where each split's run of the shuffled groups (of ``sizes`` cells) ends: a group goes to the
    split its middle cell falls in, so each split holds about its fraction of the cells; then each
    split of a fraction above 0 is given at least one group, the cuts moved by as few groups as
    that needs (there are at least as many groups as such splits)."""
    total = int(sizes.sum())
    middles = np.cumsum(sizes) - sizes / 2
    # a bound that should fall on a group's middle may land a rounding error past it (0.1 + 0.2 is
    # 0.30000000000000004): compared with a margin far below one cell
    bounds = np.cumsum(fractions) * total - 1e-9 * max(total, 1)
    split_of = np.minimum(np.searchsorted(bounds, middles, side="right"), len(fractions) - 1)
    ends = [int(np.count_nonzero(split_of <= j)) for j in range(len(fractions))]
    wanted = [int(f > 0) for f in fractions]
    for j in range(len(ends)):  # each wanted split at least one group past the previous end
        ends[j] = max(ends[j], (ends[j - 1] if j else 0) + wanted[j])
    ends[-1] = len(sizes)
    for j in range(len(ends) - 2, -1, -1):  # and the later ones still room for theirs
        ends[j] = min(ends[j], ends[j + 1] - wanted[j + 1])
    return ends


def read_split(dataset: Dataset, by: str | None = None) -> Split:
    """The split sidecar of ``dataset`` by ``by`` (None: its only one), checked against the manifest."""
    entries = {
        f.path[len(SPLITS_DIR) : -len(".json")]: f
        for f in dataset.manifest.files
        if f.path.startswith(SPLITS_DIR)
    }
    if not entries:
        msg = f"{dataset.path} has no split; write one with oj.split(ds, by=...)"
        raise OmicsIOError(msg + _written_since(dataset, by))
    if by is None and len(entries) > 1:
        msg = f"{dataset.path} has splits by {', '.join(map(repr, sorted(entries)))}: name one with by="
        raise OmicsIOError(msg)
    key = next(iter(entries)) if by is None else by
    if key not in entries:
        msg = f"{dataset.path} has no split by {key!r}; its splits are by {', '.join(map(repr, sorted(entries)))}"
        raise OmicsIOError(msg + _written_since(dataset, key))
    entry = entries[key]
    try:
        data = dataset.local_path(entry.path).read_bytes()
    except DatasetFormatError:  # another size than this handle's manifest says
        _refuse_if_rewritten(dataset, entry)
        raise
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        _refuse_if_rewritten(dataset, entry)
        msg = f"{dataset.path}/{entry.path} does not match its checksum in the manifest; write it again with oj.split"
        raise DatasetFormatError(msg)
    return Split.from_json(data.decode(), f"{dataset.path}/{entry.path}")


def _written_since(dataset: Dataset, by: str | None) -> str:
    """What to add to "no split" when the manifest on disk lists a split by ``by`` (None: any) that
    this handle's does not: written since it opened, through another handle or process."""
    if dataset.is_remote:
        return ""
    try:
        listed = {f.path for f in read_manifest(Path(dataset.path)).files if f.path.startswith(SPLITS_DIR)}
    except (OSError, OmicsIOError):
        return ""
    known = {f.path for f in dataset.manifest.files}
    if any(p not in known and (by is None or p == f"{SPLITS_DIR}{by}.json") for p in listed):
        return " (one was written since this handle opened the dataset: open it again to read it)"
    return ""


def _refuse_if_rewritten(dataset: Dataset, entry) -> None:
    """Refuse, saying so, a split sidecar that `split` wrote again (``overwrite=True``, through
    another handle or process) since ``dataset`` was opened: the manifest on disk lists it as it is
    now. Not read as the new split: rows taken from the old one (training) and the new one
    (evaluation) could share groups. Returns if the sidecar is not such a one (damaged)."""
    if dataset.is_remote:
        return
    try:
        with manifest_lock(dataset.path):  # not between a rewrite's sidecar and its manifest
            now = {f.path: f for f in read_manifest(Path(dataset.path)).files}.get(entry.path)
            data = (Path(dataset.path) / entry.path).read_bytes()
    except (OSError, OmicsIOError):
        return
    if now is not None and now.sha256 != entry.sha256 and hashlib.sha256(data).hexdigest() == now.sha256:
        msg = (
            f"{dataset.path}/{entry.path} was written again by oj.split (overwrite=True) since this handle "
            "opened the dataset: open it again to read the new split (rows from the old and the new split "
            "may share groups)"
        )
        raise OmicsIOError(msg)


def _write(dataset: Dataset, result: Split, *, overwrite: bool, where: str) -> None:
    with manifest_lock(dataset.path):
        _write_locked(dataset, result, overwrite=overwrite, where=where)


def _write_locked(dataset: Dataset, result: Split, *, overwrite: bool, where: str) -> None:
    root = Path(dataset.path)
    text = result.to_json()
    m = read_manifest(root)  # as it is now: another handle may have listed a split since this one opened
    if m.fingerprint != dataset.manifest.fingerprint:
        msg = f"{where}: {root} was materialized again since it was opened; open it again and split that"
        raise OmicsIOError(msg)
    listed = any(f.path == result.path for f in m.files)
    target = root / result.path
    if listed and not overwrite:
        if target.exists() and target.read_text() == text:
            dataset.manifest = m
            return
        held = (
            "holds another split"
            if target.exists()
            else "is listed in the manifest but missing: it held a split"
        )
        msg = f"{where}: {result.path} {held} by {result.by!r}; pass overwrite=True to replace it"
        raise OmicsIOError(msg)
    try:
        target.parent.mkdir(exist_ok=True)
        staged = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        staged.write_text(text)
    except OSError as e:  # a dataset on shared storage, another user's or mounted read-only
        msg = (
            f"{where}: cannot write {result.path} into {root} ({e.strerror}); split a copy you can "
            "write, or ask the dataset's owner to run oj.split"
        )
        raise OmicsIOError(msg) from e
    fsync_path(staged)
    os.replace(staged, target)
    files = tuple(f for f in m.files if f.path != result.path) + (file_entry(root, result.path),)
    manifest = dataclasses.replace(m, files=files)  # splits are derived: the fingerprint stays
    staged = root / f".{MANIFEST_NAME}.{os.getpid()}.tmp"
    staged.write_text(manifest.to_json())
    fsync_path(staged)
    os.replace(staged, root / MANIFEST_NAME)
    fsync_path(root)
    dataset.manifest = manifest
