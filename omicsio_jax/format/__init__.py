"""The on-disk format of a materialized dataset, and the writer's API: what ``materialize`` writes with.

A dataset directory holds ArrayRecord shards of encoded cells (`omicsio_jax.format.codec`), their
chunk indexes (`omicsio_jax.format.chunk_index`), the manifest that lists every file with its
checksum (`omicsio_jax.format.manifest`), corpus statistics (`omicsio_jax.format.gene_stats`) and
sidecars; the inputs are list-column cell tables read through DuckDB (`omicsio_jax.format.tables`,
`omicsio_jax.format.arrow`) and the inverted gene index (`omicsio_jax.format.gene_index`).

The names below are this layer's public face, with the few storage helpers a writer needs beside
them; they are imported on first use, so a shard-writer process that needs only the manifest does
not load numba or DuckDB::

    from omicsio_jax.format import MANIFEST_NAME, ShardEntry, encode_csr, fsync_path
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omicsio_jax.core.lazy import lazy_exports

if TYPE_CHECKING:
    from omicsio_jax.core.buffers import RowBuffers as RowBuffers
    from omicsio_jax.core.errors import require as require
    from omicsio_jax.core.kernels import mix64 as mix64
    from omicsio_jax.core.producer import Background as Background
    from omicsio_jax.core.progress import progress_bar as progress_bar
    from omicsio_jax.format.arrow import from_numpy as from_numpy
    from omicsio_jax.format.arrow import is_list_type as is_list_type
    from omicsio_jax.format.arrow import list_to_csr as list_to_csr
    from omicsio_jax.format.arrow import one_array as one_array
    from omicsio_jax.format.arrow import repeated_text as repeated_text
    from omicsio_jax.format.arrow import text_array as text_array
    from omicsio_jax.format.arrow import to_numpy as to_numpy
    from omicsio_jax.format.arrow import to_numpy_filled as to_numpy_filled
    from omicsio_jax.format.chunk_index import CHUNK_INDEX_DIR as CHUNK_INDEX_DIR
    from omicsio_jax.format.chunk_index import chunk_index_path as chunk_index_path
    from omicsio_jax.format.codec import CODEC_VERSION as CODEC_VERSION
    from omicsio_jax.format.codec import ROW_DUPLICATE as ROW_DUPLICATE
    from omicsio_jax.format.codec import ROW_NEGATIVE as ROW_NEGATIVE
    from omicsio_jax.format.codec import ROW_NOT_FINITE as ROW_NOT_FINITE
    from omicsio_jax.format.codec import ROW_UNKNOWN_GENE as ROW_UNKNOWN_GENE
    from omicsio_jax.format.codec import ROW_UNSORTED as ROW_UNSORTED
    from omicsio_jax.format.codec import VALUE_F32 as VALUE_F32
    from omicsio_jax.format.codec import InvalidRowError as InvalidRowError
    from omicsio_jax.format.codec import encode_csr as encode_csr
    from omicsio_jax.format.codec import encode_dense_rows as encode_dense_rows
    from omicsio_jax.format.codec import plan_sparse as plan_sparse
    from omicsio_jax.format.csr import take_rows as take_rows
    from omicsio_jax.format.gene_index import INDEX_FILE as INDEX_FILE
    from omicsio_jax.format.gene_index import INDEX_FORMAT as INDEX_FORMAT
    from omicsio_jax.format.gene_index import INDEX_MANIFEST as INDEX_MANIFEST
    from omicsio_jax.format.gene_stats import NUM_BINS as NUM_BINS
    from omicsio_jax.format.gene_stats import STATS_NAME as STATS_NAME
    from omicsio_jax.format.gene_stats import GeneStats as GeneStats
    from omicsio_jax.format.gene_stats import empty_span as empty_span
    from omicsio_jax.format.genes import ENSEMBL_GENE_ID as ENSEMBL_GENE_ID
    from omicsio_jax.format.genes import VERSION_SUFFIX as VERSION_SUFFIX
    from omicsio_jax.format.genes import name_lookup as name_lookup
    from omicsio_jax.format.genes import strip_version as strip_version
    from omicsio_jax.format.manifest import BOOL_CATEGORIES as BOOL_CATEGORIES
    from omicsio_jax.format.manifest import DERIVED_FILES as DERIVED_FILES
    from omicsio_jax.format.manifest import MANIFEST_NAME as MANIFEST_NAME
    from omicsio_jax.format.manifest import PRESENCE_NAME as PRESENCE_NAME
    from omicsio_jax.format.manifest import SPLITS_DIR as SPLITS_DIR
    from omicsio_jax.format.manifest import FileEntry as FileEntry
    from omicsio_jax.format.manifest import Manifest as Manifest
    from omicsio_jax.format.manifest import ModalityEntry as ModalityEntry
    from omicsio_jax.format.manifest import ObsEntry as ObsEntry
    from omicsio_jax.format.manifest import ShardEntry as ShardEntry
    from omicsio_jax.format.manifest import file_entry as file_entry
    from omicsio_jax.format.manifest import fsync_path as fsync_path
    from omicsio_jax.format.manifest import manifest_lock as manifest_lock
    from omicsio_jax.format.manifest import read_manifest as read_manifest
    from omicsio_jax.format.manifest import sha256_file as sha256_file
    from omicsio_jax.format.manifest import verify_dataset as verify_dataset
    from omicsio_jax.format.stats_accumulator import StatsAccumulator as StatsAccumulator
    from omicsio_jax.format.tables import CELL_ID_COLUMN as CELL_ID_COLUMN
    from omicsio_jax.format.tables import FILE_ROW_COLUMN as FILE_ROW_COLUMN
    from omicsio_jax.format.tables import FILENAME_COLUMN as FILENAME_COLUMN
    from omicsio_jax.format.tables import GENE_COLUMN as GENE_COLUMN
    from omicsio_jax.format.tables import GENE_TABLE_NAME as GENE_TABLE_NAME
    from omicsio_jax.format.tables import ROWID_COLUMN as ROWID_COLUMN
    from omicsio_jax.format.tables import VALUE_COLUMN as VALUE_COLUMN
    from omicsio_jax.format.tables import check_derived_gene_space as check_derived_gene_space
    from omicsio_jax.format.tables import common_folder as common_folder
    from omicsio_jax.format.tables import connect as connect
    from omicsio_jax.format.tables import create_cells_view as create_cells_view
    from omicsio_jax.format.tables import damaged_hint as damaged_hint
    from omicsio_jax.format.tables import expand_files as expand_files
    from omicsio_jax.format.tables import find_gene_table as find_gene_table
    from omicsio_jax.format.tables import row_counts as row_counts
    from omicsio_jax.format.tables import sql_ident as sql_ident
    from omicsio_jax.format.tables import sql_str as sql_str
    from omicsio_jax.storage.input_files import as_input_path as as_input_path
    from omicsio_jax.storage.input_files import glob_root as glob_root
    from omicsio_jax.storage.input_files import has_wildcard as has_wildcard
    from omicsio_jax.storage.input_files import is_glob as is_glob
    from omicsio_jax.storage.input_files import local_glob as local_glob
    from omicsio_jax.storage.input_files import register_s3 as register_s3
    from omicsio_jax.storage.input_files import s3_filesystem as s3_filesystem
    from omicsio_jax.storage.memory import release_freed_memory as release_freed_memory
    from omicsio_jax.storage.memory import small_pages as small_pages
    from omicsio_jax.storage.memory import usable_cores as usable_cores
    from omicsio_jax.storage.store import is_remote as is_remote
    from omicsio_jax.storage.store import open_store as open_store
    from omicsio_jax.storage.swap import exchange_paths as exchange_paths

_WRITER_API = {
    "omicsio_jax.core.buffers": ("RowBuffers",),
    "omicsio_jax.core.errors": ("require",),
    "omicsio_jax.core.kernels": ("mix64",),
    "omicsio_jax.core.producer": ("Background",),
    "omicsio_jax.core.progress": ("progress_bar",),
    "omicsio_jax.format.chunk_index": ("CHUNK_INDEX_DIR", "chunk_index_path"),
    "omicsio_jax.format.codec": (
        "CODEC_VERSION",
        "ROW_DUPLICATE",
        "ROW_NEGATIVE",
        "ROW_NOT_FINITE",
        "ROW_UNKNOWN_GENE",
        "ROW_UNSORTED",
        "VALUE_F32",
        "InvalidRowError",
        "encode_csr",
        "encode_dense_rows",
        "plan_sparse",
    ),
    "omicsio_jax.format.arrow": (
        "from_numpy",
        "is_list_type",
        "list_to_csr",
        "one_array",
        "repeated_text",
        "text_array",
        "to_numpy",
        "to_numpy_filled",
    ),
    "omicsio_jax.format.csr": ("take_rows",),
    "omicsio_jax.format.gene_index": ("INDEX_FILE", "INDEX_FORMAT", "INDEX_MANIFEST"),
    "omicsio_jax.format.genes": ("ENSEMBL_GENE_ID", "VERSION_SUFFIX", "name_lookup", "strip_version"),
    "omicsio_jax.format.gene_stats": (
        "NUM_BINS",
        "STATS_NAME",
        "GeneStats",
        "empty_span",
    ),
    "omicsio_jax.format.stats_accumulator": ("StatsAccumulator",),
    "omicsio_jax.format.manifest": (
        "BOOL_CATEGORIES",
        "DERIVED_FILES",
        "MANIFEST_NAME",
        "PRESENCE_NAME",
        "SPLITS_DIR",
        "FileEntry",
        "Manifest",
        "ModalityEntry",
        "ObsEntry",
        "ShardEntry",
        "file_entry",
        "fsync_path",
        "manifest_lock",
        "read_manifest",
        "sha256_file",
        "verify_dataset",
    ),
    "omicsio_jax.format.tables": (
        "CELL_ID_COLUMN",
        "FILE_ROW_COLUMN",
        "FILENAME_COLUMN",
        "GENE_COLUMN",
        "GENE_TABLE_NAME",
        "ROWID_COLUMN",
        "VALUE_COLUMN",
        "check_derived_gene_space",
        "common_folder",
        "connect",
        "create_cells_view",
        "damaged_hint",
        "expand_files",
        "find_gene_table",
        "row_counts",
        "sql_ident",
        "sql_str",
    ),
    "omicsio_jax.storage.input_files": (
        "as_input_path",
        "glob_root",
        "has_wildcard",
        "is_glob",
        "local_glob",
        "register_s3",
        "s3_filesystem",
    ),
    "omicsio_jax.storage.memory": ("release_freed_memory", "small_pages", "usable_cores"),
    "omicsio_jax.storage.store": ("is_remote", "open_store"),
    "omicsio_jax.storage.swap": ("exchange_paths",),
}
_EXPORTS = {name: module for module, names in _WRITER_API.items() for name in names}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
