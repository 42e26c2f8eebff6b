"""A DuckLake column's type and its values kept in the catalog, as DuckDB SQL.

The catalog names a column's type in DuckLake's words (``int32``, ``timestamptz``, ``list`` with a
child column); `sql_type` gives the DuckDB type a resolved column has (`_ducklake_table.Column`).
The catalog keeps a column's initial default, a file's partition values and its min/max statistics
as text; `sql_literal` writes one as SQL, to be cast to the column's type.
"""

from __future__ import annotations

from omicsio_jax.format import sql_ident, sql_str

_TYPES = {
    "boolean": "BOOLEAN",
    "int8": "TINYINT",
    "int16": "SMALLINT",
    "int32": "INTEGER",
    "int64": "BIGINT",
    "int128": "HUGEINT",
    "uint8": "UTINYINT",
    "uint16": "USMALLINT",
    "uint32": "UINTEGER",
    "uint64": "UBIGINT",
    "uint128": "UHUGEINT",
    "float32": "FLOAT",
    "float64": "DOUBLE",
    "date": "DATE",
    "time": "TIME",
    "timetz": "TIMETZ",
    "timestamp": "TIMESTAMP",
    "timestamptz": "TIMESTAMPTZ",
    "timestamp_s": "TIMESTAMP_S",
    "timestamp_ms": "TIMESTAMP_MS",
    "timestamp_ns": "TIMESTAMP_NS",
    "interval": "INTERVAL",
    "varchar": "VARCHAR",
    "blob": "BLOB",
    "uuid": "UUID",
    "json": "JSON",
}
_NUMERIC = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64"}
NUMERIC_SQL_TYPES = frozenset(_TYPES[t] for t in _NUMERIC)  # the DuckDB types of numbers


def sql_type(catalog_type: str, children: list[tuple[str, str]]) -> str:
    """The DuckDB type of a DuckLake column type (``children``: name and type of a nested one's parts)."""
    kind = catalog_type.lower()
    if kind == "list":
        return f"{children[0][1]}[]"
    if kind == "struct":
        return "STRUCT(" + ", ".join(f"{sql_ident(n)} {t}" for n, t in children) + ")"
    if kind == "map":
        return f"MAP({children[0][1]}, {children[1][1]})"
    if kind.startswith("decimal"):
        return kind.upper()
    return _TYPES.get(kind, "VARCHAR")


def sql_literal(value: str | None) -> str:
    """A partition value or default as SQL: None (a NULL partition value) is NULL, not 'None'."""
    return "NULL" if value is None else sql_str(str(value))
