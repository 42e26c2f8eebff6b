"""A Griffe extension for the API reference: render the project's free-form docstrings as Markdown.

The docstrings use doctest lines (``>>> ...``) for examples and reStructuredText's ``::`` before an
indented literal block. Markdown would read ``>>>`` as three nested block quotes, so each run of
doctest lines becomes a fenced ``pycon`` block (``# doctest:`` directives dropped), and a trailing
``::`` becomes ``:``. Only the rendered text changes; the source is left as it is.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_PROMPT = re.compile(r"^(\s*)>>>( |$)")
_DIRECTIVE = re.compile(r"\s*#\s*doctest:.*$")


def fence_doctests(text: str) -> str:
    """``text`` with every run of doctest lines in a fenced ``pycon`` block."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _PROMPT.match(lines[i])
        if not match:
            line = lines[i]
            if line.rstrip().endswith("::") and not line.strip().startswith(("-", "*")):
                stripped = line.rstrip()[:-2].rstrip()
                line = stripped + ":" if stripped else ""
            out.append(line)
            i += 1
            continue
        indent = match.group(1)
        block: list[str] = []
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            block.append(_DIRECTIVE.sub("", lines[i][len(indent) :]).rstrip())
            i += 1
        if out and out[-1].strip():
            out.append("")
        out += [f"{indent}```pycon", *(f"{indent}{b}" for b in block), f"{indent}```", ""]
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fence doctest examples in every docstring Griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
