"""How ``repr(loader)`` shows the output it was given: its kind and the settings that differ from
the kind's defaults, briefly (``Dense(normalize='log1p')``, ``Panel(genes=[2,000 genes])``)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from omicsio_jax.outputs.base import Output
from omicsio_jax.outputs.modalities import Modalities
from omicsio_jax.outputs.resolve import SHORTHANDS


def describe_output(output: Output) -> str:
    """``output`` (as given, not bound) as ``repr(loader)`` shows it, as ``output=`` takes it: at
    its defaults the shorthand of its kind where there is one (``'dense'``, ``'csr'``), else its
    class with each setting that differs from the default (``GeneformerTokens()``); one per
    modality as the dict it was given as."""
    if isinstance(output, Modalities):
        return "{" + ", ".join(f"{name!r}: {describe_output(one)}" for name, one in output.outputs) + "}"
    settings = [
        f"{f.name}={_brief(f.name, getattr(output, f.name))}"
        for f in dataclasses.fields(output)
        if f.init and f.repr and _differs(getattr(output, f.name), f.default)
    ]
    if not settings and output.kind in SHORTHANDS:
        return repr(output.kind)
    return f"{type(output).__name__}({', '.join(settings)})"


def _differs(value: object, default: object) -> bool:
    if default is dataclasses.MISSING or isinstance(value, np.ndarray):
        return True
    return bool(value != default)


def _brief(name: str, value: object) -> str:
    """A setting's value, a list of many (a panel's genes) as its length."""
    if isinstance(value, list | tuple | np.ndarray):
        return f"[{len(value):,} {name}]"
    if isinstance(value, os.PathLike):
        return repr(os.fspath(value))
    return repr(value)
