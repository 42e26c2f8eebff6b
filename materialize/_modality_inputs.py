"""The further modalities asked for (`ModalityInput`): named layers and modalities of an ``.h5ad`` /
``.h5mu``, or tables, checked against the input's kind (the overview: `materialize._modalities`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from omicsio_jax import OmicsIOError

from ._modality_h5 import h5mu_modalities

LAYER, OWN = "primary", "own"  # a modality's columns: the primary's genes, or its own features
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")


@dataclasses.dataclass(frozen=True)
class ModalityInput:
    """One further modality: its ``name``, and its ``table`` (list-column table path/glob) or None
    for one in the primary's own file (an ``.h5ad``/``.h5mu`` layer, an ``.h5mu`` modality);
    ``features``: the table's feature table (None: found beside it); ``layer``: shares the
    primary's genes."""

    name: str
    table: str | None = None
    features: str | None = None
    layer: bool = False

    @property
    def features_kind(self) -> str:
        return LAYER if self.layer else OWN


def modality_inputs(
    source,
    *,
    layers: Sequence[str] | Mapping[str, str] | None,
    modalities: Sequence[str] | Mapping[str, str | tuple[str, str]] | None,
    primary: str,
) -> list[ModalityInput]:
    """The further modalities asked for, checked against the input's kind.

    ``.h5ad``: ``layers`` names layers of the file. ``.h5mu``: ``layers`` names layers of the
    primary modality, ``modalities`` names the file's other modalities (default: all of them).
    Tables: ``layers`` and ``modalities`` map names to tables (a modality's value may be a
    ``(table, feature table)`` pair).
    """
    kind = input_kind(source)
    out: list[ModalityInput] = []
    if layers:
        if kind == "table":
            if not isinstance(layers, Mapping):
                msg = "for list-column tables, layers maps each layer's name to its table, e.g. spliced=rna_layers_spliced/"
                raise OmicsIOError(msg)
            out += [ModalityInput(name, str(table), layer=True) for name, table in layers.items()]
        else:
            if isinstance(layers, Mapping):
                msg = f"layers of a {kind} input are named, not given as tables: layers=['spliced', ...]"
                raise OmicsIOError(msg)
            out += [ModalityInput(name, layer=True) for name in layers]
    if kind == "h5mu":
        if isinstance(modalities, Mapping):
            msg = "the modalities of an .h5mu input are named, not given as tables: modalities=['atac', ...]"
            raise OmicsIOError(msg)
        held = h5mu_modalities(source)
        names = held if modalities is None else [str(n) for n in modalities]
        missing = [n for n in names if n not in held]
        if missing:
            msg = f"{source} has no modality {missing[0]!r} (it has {', '.join(held)}); name one of these"
            raise OmicsIOError(msg)
        out += [ModalityInput(name) for name in names if name != primary]
    elif modalities:
        if kind == "h5ad":
            msg = "an .h5ad holds one modality (and its layers); give further modalities as tables or use an .h5mu"
            raise OmicsIOError(msg)
        if not isinstance(modalities, Mapping):
            msg = "for list-column tables, modalities maps each name to its table, e.g. atac=atac_cells/"
            raise OmicsIOError(msg)
        for name, value in modalities.items():
            table, features = (value, None) if isinstance(value, str | Path) else value
            out.append(ModalityInput(name, str(table), None if features is None else str(features)))
    seen = {primary}
    for inp in out:
        if inp.table is not None and inp.table.startswith("ducklake:"):
            name = inp.table.partition("#")[2] or "TABLE"
            msg = (
                f"modality {inp.name}: a DuckLake table ({inp.table}) is read as the primary input only; "
                f"export it to parquet (DuckDB with the ducklake extension: COPY lake.{name} TO "
                f"'{name}.parquet') and give that file"
            )
            raise OmicsIOError(msg)
        if not _NAME.match(inp.name):
            msg = f"modality name {inp.name!r}: use letters, digits, '_', '.' or '-', starting with a letter"
            raise OmicsIOError(msg)
        if inp.name in seen:
            msg = f"modality {inp.name!r} is given twice (or is the primary's name, {primary!r})"
            raise OmicsIOError(msg)
        seen.add(inp.name)
    return out


def input_kind(source) -> str:
    text = "" if source is None else str(source)
    if text.endswith(".h5ad") or text.rstrip("/").endswith(".zarr"):  # AnnData, in HDF5 or in zarr
        return "h5ad"
    return "h5mu" if text.endswith(".h5mu") else "table"
