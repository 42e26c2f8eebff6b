"""Queries over list-column cell tables through DuckDB, without materializing: `CellTable`, the gene table."""
