"""A small parser for held-out-set predicates: ``col = 'v'``, ``col != 'v'``, ``col IN ('a', 'b')``,
``col NOT IN (...)``, the values quoted strings, numbers or ``TRUE`` / ``FALSE`` (a bool column such
as CELLxGENE's ``is_primary_data``). No ``eval``: a tokenizer and a three-rule grammar.

>>> parse_predicate("batch = 'plate_09'")
Predicate(column='batch', values=('plate_09',), invert=False)
>>> parse_predicate("drug NOT IN ('DMSO_TF', 'drug_01')")
Predicate(column='drug', values=('DMSO_TF', 'drug_01'), invert=True)
>>> parse_predicate("is_primary_data = true")
Predicate(column='is_primary_data', values=(True,), invert=False)
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

import omicsio_jax as oj

from ._errors import PredicateError

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>'(?:[^']|'')*')                 # 'single-quoted', '' escapes a quote
    | (?P<qid>"(?:[^"]|"")*")                 # "quoted identifier"
    | (?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)
    | (?P<op>!=|<>|==|=|\(|\)|,)
    | (?P<word>[A-Za-z_][A-Za-z0-9_.]*)
    )""",
    re.VERBOSE,
)
_EXAMPLE = "write e.g. batch = 'plate_09', batch != 'plate_09' or batch IN ('plate_08', 'plate_09')"


@dataclasses.dataclass(frozen=True)
class Predicate:
    """Cells whose obs ``column`` takes one of ``values`` (all other cells with ``invert``)."""

    column: str
    values: tuple[str | float | bool, ...]
    invert: bool = False

    def rows(self, ds: oj.Dataset) -> np.ndarray:
        """The matching global rows of ``ds`` (ascending); raises `PredicateError` if none match."""
        try:
            rows = ds.rows_where(self.column, list(self.values), invert=self.invert)
        except KeyError as e:
            raise PredicateError(e.args[0]) from e
        if len(rows) == 0:
            msg = f"{self} matches no cell of {ds.path}"
            raise PredicateError(msg)
        return rows

    def __str__(self) -> str:
        shown = ", ".join(_shown(v) for v in self.values)
        column = (
            self.column
            if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", self.column)
            else '"' + self.column.replace('"', '""') + '"'
        )
        if len(self.values) == 1:
            return f"{column} {'!=' if self.invert else '='} {shown}"
        return f"{column} {'NOT IN' if self.invert else 'IN'} ({shown})"


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            start = len(text) - len(text[pos:].lstrip())
            got = text[start : start + 10]
            msg = f"cannot parse predicate {text!r}: unexpected {got!r} at position {start}; {_EXAMPLE}"
            raise PredicateError(msg)
        kind = m.lastgroup or ""
        tokens.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    return tokens


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _shown(value: str | float | bool) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    return _quote(value) if isinstance(value, str) else f"{value:g}"


def _value(kind: str, raw: str) -> str | float | bool:
    if kind == "str":
        return raw[1:-1].replace("''", "'")
    if kind == "word":
        return raw.upper() == "TRUE"
    return float(raw)


def parse_predicate(text: str) -> Predicate:
    """Parse ``col = 'v'``, ``col != 'v'`` (or ``<>``), ``col IN ('a', 'b')``, ``col NOT IN (...)``.

    Values are single-quoted strings, numbers or ``TRUE`` / ``FALSE``; keywords are
    case-insensitive; a column name with unusual characters may be double-quoted.
    """
    tokens = _tokenize(text)
    pos = 0

    def fail(expected: str) -> PredicateError:
        got = f"{tokens[pos][1]!r} at position {tokens[pos][2]}" if pos < len(tokens) else "the end"
        return PredicateError(f"cannot parse predicate {text!r}: expected {expected}, got {got}; {_EXAMPLE}")

    def take(*kinds: str) -> tuple[str, str, int] | None:
        nonlocal pos
        if pos < len(tokens) and tokens[pos][0] in kinds:
            pos += 1
            return tokens[pos - 1]
        return None

    def literal() -> tuple[str, str, int] | None:
        at = take("str", "num")
        if at is None and pos < len(tokens) and tokens[pos][0] == "word":
            if tokens[pos][1].upper() in ("TRUE", "FALSE"):
                at = take("word")
        return at

    def keyword(word: str) -> bool:
        nonlocal pos
        if pos < len(tokens) and tokens[pos][0] == "word" and tokens[pos][1].upper() == word:
            pos += 1
            return True
        return False

    column = take("word", "qid")
    if column is None:
        raise fail("a column name")
    name = column[1] if column[0] == "word" else column[1][1:-1].replace('""', '"')
    if pos < len(tokens) and tokens[pos][0] == "op" and tokens[pos][1] in ("=", "==", "!=", "<>"):
        invert = tokens[pos][1] in ("!=", "<>")
        pos += 1
        value = literal()
        if value is None:
            raise fail("a quoted value, a number, TRUE or FALSE")
        values = [_value(value[0], value[1])]
    else:
        invert = keyword("NOT")
        if not keyword("IN"):
            raise fail("IN" if invert else "=, !=, IN or NOT IN")
        paren = take("op")
        if paren is None or paren[1] != "(":
            pos -= 0 if paren is None else 1
            raise fail("'('")
        values = []
        while True:
            value = literal()
            if value is None:
                raise fail("a quoted value, a number, TRUE or FALSE")
            values.append(_value(value[0], value[1]))
            sep = take("op")
            if sep is None or sep[1] not in (",", ")"):
                pos -= 0 if sep is None else 1
                raise fail("',' or ')'")
            if sep[1] == ")":
                break
    if pos != len(tokens):
        raise fail("the end of the predicate")
    return Predicate(name, tuple(values), invert)
