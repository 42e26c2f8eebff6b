"""Namespaces whose names are imported on first use (PEP 562)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for module ``package`` that import ``exports[name]`` (a module)
    when ``name`` is first asked for, and keep the value as a module attribute from then on.

    >>> __getattr__, __dir__ = lazy_exports(__name__, {"Dataset": "omicsio_jax.dataset.dataset"})  # doctest: +SKIP
    """

    def __getattr__(name: str) -> object:
        where = exports.get(name)
        if where is None:
            msg = f"module {package!r} has no attribute {name!r}"
            raise AttributeError(msg)
        value = getattr(importlib.import_module(where), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
