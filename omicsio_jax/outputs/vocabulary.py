"""Token vocabularies: which token id each gene column of a dataset becomes.

The default layout is Tahoe-100M's: ``PAD 0, CLS 1, EOC 2``, gene column ``g`` → ``g + 3``,
``MASK`` right after the genes, embedding rows rounded up to a multiple of 64. A user vocabulary
maps Ensembl ids to token ids (TSV, JSON, parquet, or Geneformer's pickles), or gene symbols to
them (scGPT's ``vocab.json``: matched to the dataset's ``gene_name``), so that tokens match an
existing checkpoint: dataset genes it lacks are skipped (and counted in the report), and dataset
columns sharing one key are summed into one token, as Geneformer's tokenizer does.

Pickles are read by a restricted unpickler that builds dicts, strings, ints and floats, and NumPy's
numeric scalars (Geneformer's published dictionaries hold ``numpy.int64`` / ``numpy.float64``
values), and refuses everything else (a pickle can otherwise run arbitrary code).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import pickle
import warnings
from pathlib import Path

import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.format.genes import fold_ensembl, is_ensembl_id
from omicsio_jax.outputs.token_kernels import CLS, EOC, PAD

SPECIAL_NAMES = {
    "pad": ("<pad>", "[PAD]"),
    "cls": ("<cls>", "[CLS]"),
    "eos": ("<eos>", "<eoc>", "[SEP]", "[EOS]"),
    "mask": ("<mask>", "[MASK]"),
}
_PICKLE_SUFFIXES = (".pkl", ".pickle")


# What a pickled NumPy scalar names: ``scalar(dtype, bytes)`` makes the value from its bytes, ``dtype``
# its type (``numpy.core`` before NumPy 2, ``numpy._core`` since); neither runs code of the file's
_NUMPY_SCALAR = {("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar")}


class _PlainUnpickler(pickle.Unpickler):
    """Builds only the built-in containers and scalars, and NumPy scalars (`_NUMPY_SCALAR`) of a
    numeric type; any other class or function is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in _NUMPY_SCALAR:
            return _numeric_scalar
        if (module, name) == ("numpy", "dtype"):
            return np.dtype
        msg = f"{module}.{name}"
        raise pickle.UnpicklingError(msg)


def _numeric_scalar(dtype: np.dtype, data: bytes) -> np.generic:
    """``numpy.core.multiarray.scalar`` for a bool, integer or float ``dtype`` alone (an object
    scalar would hold whatever the file builds)."""
    if not isinstance(dtype, np.dtype) or dtype.kind not in "biuf" or not isinstance(data, bytes):
        msg = f"numpy scalar of dtype {dtype}"
        raise pickle.UnpicklingError(msg)
    return np.frombuffer(data, dtype, count=1)[0]


def load_plain_pickle(path: str | Path) -> dict:
    """A pickled ``dict`` of str → int/float (NumPy's numeric scalars read as Python numbers), read
    without running code from the file."""
    path = Path(path)
    try:
        obj = _PlainUnpickler(io.BytesIO(path.read_bytes())).load()
    except pickle.UnpicklingError as e:
        msg = (
            f"{path}: refused to unpickle {e} (only dicts of str to int/float are read); "
            "convert the file to JSON or TSV, or use the published Geneformer dictionary"
        )
        raise OmicsIOError(msg) from None
    except Exception as e:  # noqa: BLE001 - any malformed pickle is the same one-line error
        msg = f"{path}: not a readable pickle ({type(e).__name__}: {e}); give a TSV, JSON or parquet file instead"
        raise OmicsIOError(msg) from None
    if isinstance(obj, dict):
        obj = {k: v.item() if isinstance(v, np.generic) else v for k, v in obj.items()}
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and type(v) in (int, float, bool) for k, v in obj.items()
    ):
        msg = f"{path}: holds {type(obj).__name__}, not a dict of str to int/float; give a TSV, JSON or parquet file"
        raise OmicsIOError(msg)
    return obj


def read_gene_mapping(path: str | Path, *, what: str) -> dict[str, float]:
    """``{key: value}`` from a TSV (two columns, optional header), JSON object, parquet (first two
    columns) or pickle; ``what`` names the values in messages (``"token id"``, ``"median"``)."""
    path = Path(path)
    if not path.exists():
        msg = f"{what} file {path} does not exist"
        raise OmicsIOError(msg)
    suffix = path.suffix.lower()
    if suffix in _PICKLE_SUFFIXES:
        return load_plain_pickle(path)
    if suffix == ".json":
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            msg = f"{path}: a JSON {what} file must be one object {{ensembl_id: {what}}}"
            raise OmicsIOError(msg)
        return raw
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if table.num_columns < 2:
            msg = f"{path}: a parquet {what} file needs two columns (Ensembl id, {what})"
            raise OmicsIOError(msg)
        return dict(zip(table.column(0).to_pylist(), table.column(1).to_pylist(), strict=True))
    out: dict[str, float] = {}
    for n, line in enumerate(path.read_text().splitlines()):
        parts = line.rstrip("\n").split("\t")
        if not line.strip():
            continue
        if len(parts) < 2:
            msg = f"{path}:{n + 1}: expected two tab-separated columns (Ensembl id, {what})"
            raise OmicsIOError(msg)
        try:
            out[parts[0]] = float(parts[1]) if what == "median" else int(parts[1])
        except ValueError:
            if n == 0:
                continue  # a header
            msg = f"{path}:{n + 1}: {parts[1]!r} is not a {what}"
            raise OmicsIOError(msg) from None
    return out


@dataclasses.dataclass(frozen=True)
class VocabReport:
    """How a vocabulary met a dataset: columns with a token, columns skipped, columns summed into another."""

    num_columns: int
    matched: int
    missing: int
    summed: int
    key: str = "Ensembl id"  # what the vocabulary's genes are matched on ("gene symbol": scGPT's)

    def __str__(self) -> str:
        return (
            f"{self.matched:,} of {self.num_columns:,} dataset genes have a token (by {self.key}); "
            f"{self.missing:,} skipped (not in the vocabulary); {self.summed:,} summed into a column "
            f"with the same {self.key}"
        )


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """A vocabulary bound to a dataset's columns.

    ``tok[g]``: token of column ``g`` (-1: skipped); ``canon[g]``: the column whose counts ``g``'s are
    added to (``g`` itself unless it shares an Ensembl id with a smaller column); ``size``: embedding
    rows (a multiple of 64); ``gene_tokens``: the sorted gene token ids (MLM's random replacements);
    ``clashes``: the special tokens a user vocabulary does not name whose default id is another
    token's, and whose (`check_specials`: an output that emits one refuses the vocabulary).
    """

    tok: np.ndarray
    canon: np.ndarray
    pad: int
    cls: int
    eos: int
    mask: int
    size: int
    source: str
    report: VocabReport
    clashes: tuple[tuple[str, str], ...] = ()

    def check_specials(self, roles: tuple[str, ...], fix: str) -> None:
        """Raise if a special token among ``roles`` (``"pad"``, ``"cls"``, ``"eos"``) took a default id
        that is another token's: the output would emit a token it cannot be told from. ``fix``: what
        else the caller may do, besides naming the token in the file."""
        for role, other in self.clashes:
            if role in roles:
                name = SPECIAL_NAMES[role][0]
                msg = (
                    f"{self.source} names no {name} token, and its default id {getattr(self, role)} is "
                    f"the token of {other}: add {name} to the vocabulary{fix}"
                )
                raise OmicsIOError(msg)

    @functools.cached_property
    def has_duplicates(self) -> bool:
        return bool(np.any(self.canon != np.arange(len(self.canon))))

    @functools.cached_property
    def gene_tokens(self) -> np.ndarray:
        return np.unique(self.tok[self.tok >= 0]).astype(np.int32)

    def fingerprint(self) -> str:
        import hashlib

        h = hashlib.sha256(self.tok.tobytes() + self.canon.tobytes())
        h.update(json.dumps([self.pad, self.cls, self.eos, self.mask, self.size]).encode())
        return h.hexdigest()[:16]


def round_up(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def default_vocabulary(num_columns: int) -> Vocabulary:
    """Tahoe-100M's layout: PAD 0, CLS 1, EOC 2, column g → g + 3, MASK = num_columns + 3."""
    tok = np.arange(3, num_columns + 3, dtype=np.int32)
    mask = num_columns + 3
    return Vocabulary(
        tok,
        np.arange(num_columns, dtype=np.int32),
        PAD,
        CLS,
        EOC,
        mask,
        round_up(mask + 1),
        "default (Tahoe-100M layout)",
        VocabReport(num_columns, num_columns, 0, 0),
    )


_LARGEST_TOKEN = np.iinfo(np.int32).max - 1  # (one below: the vocabulary's size, top + 1, fits in int32 too)


def user_vocabulary(
    path: str | Path, ensembl_ids: np.ndarray | None, *, dataset: str, symbols: np.ndarray | None = None
) -> Vocabulary:
    """The vocabulary in ``path`` (Ensembl id → token id, special tokens by name) bound to the
    dataset columns' ``ensembl_ids``; a file whose genes are mostly not Ensembl ids (scGPT's
    ``vocab.json``: symbols) is bound to the columns' ``symbols`` instead, compared as written.
    Either is None where the dataset has no such column."""
    raw = read_gene_mapping(path, what="token id")
    specials: dict[str, int] = {}
    keyed: dict[str, int] = {}
    for key, value in raw.items():
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 0:
            msg = f"{path}: token id of {key!r} is {value!r}; token ids must be non-negative integers"
            raise OmicsIOError(msg)
        if value > _LARGEST_TOKEN:
            msg = (
                f"{path}: token id of {key!r} is {value:,}; token ids must be below 2**31 - 1 (the outputs' "
                "input_ids are int32, and the model's embedding table one row per id)"
            )
            raise OmicsIOError(msg)
        role = next((r for r, names in SPECIAL_NAMES.items() if key in names), None)
        if role is not None:
            specials[role] = int(value)
        else:
            keyed[str(key)] = int(value)
    by_symbol = 2 * sum(map(is_ensembl_id, keyed)) < len(keyed)
    if by_symbol:
        what, names, fold = "gene symbol", symbols, str
    else:
        what, names, fold = "Ensembl id", ensembl_ids, fold_ensembl
    if names is None:
        column = "gene_name" if by_symbol else "ensembl_id"
        msg = f"{path} is keyed on {what}s but {dataset}/features.parquet has no {column} column"
        raise OmicsIOError(msg)
    genes = {fold(key): value for key, value in keyed.items()}
    ids = list(genes.values()) + list(specials.values())
    if len(set(ids)) != len(ids):
        seen: dict[int, str] = {}
        for key, value in [*genes.items(), *specials.items()]:
            if value in seen:
                msg = f"{path}: token id {value} is given to both {seen[value]!r} and {key!r}; token ids must be unique"
                raise OmicsIOError(msg)
            seen[value] = key
    top = max(ids, default=-1)
    pad = specials.get("pad", PAD)
    cls = specials.get("cls", CLS)
    eos = specials.get("eos", EOC)
    mask = specials.get("mask", top + 1)
    owner = {value: repr(key) for key, value in genes.items()}
    owner.update({value: SPECIAL_NAMES[role][0] for role, value in specials.items()})
    owner.setdefault(mask, SPECIAL_NAMES["mask"][0])
    defaults = {"pad": pad, "cls": cls, "eos": eos}
    clashes = tuple(
        (role, owner[value]) for role, value in defaults.items() if role not in specials and value in owner
    )
    tok = np.full(len(names), -1, dtype=np.int32)
    canon = np.arange(len(names), dtype=np.int32)
    first: dict[str, int] = {}
    summed = 0
    for col, name in enumerate(names):
        if name is None:
            continue
        key = fold(str(name))
        if key in genes:
            tok[col] = genes[key]
            if key in first:
                canon[col] = first[key]
                summed += 1
            else:
                first[key] = col
    matched = int(np.count_nonzero(tok >= 0))
    if matched == 0:
        how = "gene symbols, as written" if by_symbol else "Ensembl ids, versions ignored"
        msg = (
            f"the vocabulary {path} shares no gene with {dataset} (compared on {how}); "
            "check that it is keyed on Ensembl ids or on the dataset's gene names"
        )
        raise OmicsIOError(msg)
    report = VocabReport(len(names), matched, len(names) - matched, summed, what)
    return Vocabulary(
        tok, canon, pad, cls, eos, mask, round_up(max(top, mask) + 1), str(path), report, clashes
    )


def medians_by_column(path: str | Path, ensembl_ids: np.ndarray, *, dataset: str) -> np.ndarray:
    """Per-column medians (float64) from a file of Ensembl id → median: NaN where it has none, 0 where
    the one it has is not positive (0, negative, infinite or NaN; warned of here)."""
    raw = read_gene_mapping(path, what="median")
    specials = sorted(str(k) for k in raw if any(str(k) in names for names in SPECIAL_NAMES.values()))
    if specials:  # Geneformer's two pickles swapped: token ids would rank as medians
        msg = (
            f"{path} holds {', '.join(specials)}: a token dictionary, not gene medians; pass it as vocab= "
            "and the median dictionary (gene_median_dictionary.pkl) as medians="
        )
        raise OmicsIOError(msg)
    by_id = {fold_ensembl(str(k)): float(v) for k, v in raw.items()}
    keys = [fold_ensembl(str(e)) if e is not None else None for e in ensembl_ids]
    out = np.array([by_id.get(k, np.nan) for k in keys], dtype=np.float64)
    listed = np.array([k in by_id for k in keys], dtype=bool)  # a NaN median is listed, and not positive
    if not np.any(listed):
        msg = (
            f"the medians in {path} cover none of the genes of {dataset} (compared on Ensembl ids); "
            "check that the file is keyed on Ensembl ids, or omit medians= to use the dataset's own"
        )
        raise OmicsIOError(msg)
    bad = listed & ~(np.isfinite(out) & (out > 0))
    if np.all(bad[listed]):
        msg = (
            f"the medians in {path} of the {int(listed.sum()):,} genes of {dataset} it lists are none of them "
            "positive (a gene is ranked by count / median): check the file"
        )
        raise OmicsIOError(msg)
    if np.any(bad):  # those genes are left out of the ranking, as genes without a median
        out[bad] = 0.0
        warnings.warn(
            f"omicsio_jax: {int(bad.sum()):,} gene(s) of {dataset} have a median in {path} that is not positive "
            "(0, negative, infinite or NaN): left out of the ranking, as genes without a median",
            UserWarning,
            stacklevel=2,
        )
    return out
