"""Tahoe-100M's parquet files exactly as published (``tahoebio/Tahoe-100M``) go straight into materialize.

The published tree: ``data/train-*.parquet`` with ``genes`` list<int64> (token = gene index + 3,
every row starting with the CLS pair (1, -2.0)), ``expressions`` list<float32> (raw counts) and
string obs columns; ``metadata/gene_metadata.parquet`` with ``gene_symbol``, ``ensembl_id`` and
``token_id`` (the values found in ``genes``).
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import omicsio_jax as oj
from materialize import InputOptions, Layout, materialize
from materialize._cli import main

NUM_GENES = 400  # gene index 0..399 ↔ token 3..402
NUM_FILES, CELLS_PER_FILE = 3, 110
OBS = ("drug", "sample", "cell_line_id", "moa-fine", "canonical_smiles", "pubchem_cid", "plate")

CELLS_SCHEMA = pa.schema(
    [
        ("genes", pa.list_(pa.int64())),
        ("expressions", pa.list_(pa.float32())),
        ("drug", pa.string()),
        ("sample", pa.string()),
        ("BARCODE_SUB_LIB_ID", pa.string()),
        ("cell_line_id", pa.string()),
        ("moa-fine", pa.string()),
        ("canonical_smiles", pa.string()),
        ("pubchem_cid", pa.string()),
        ("plate", pa.string()),
    ]
)
GENES_SCHEMA = pa.schema(
    [
        ("gene_symbol", pa.string()),
        ("ensembl_id", pa.string()),
        ("token_id", pa.int64()),
    ]
)


def _cells(rng: np.random.Generator, num_cells: int, first_cell: int) -> pa.Table:
    """Cells in the published layout; every 7th has no gene besides the CLS pair."""
    genes, expressions = [], []
    for i in range(num_cells):
        n = 0 if (first_cell + i) % 7 == 0 else int(rng.integers(1, 60))
        tokens = np.sort(rng.choice(NUM_GENES, size=n, replace=False)) + 3
        counts = rng.integers(1, 300, size=n).astype(np.float32)
        genes.append([1, *tokens.tolist()])
        expressions.append([-2.0, *counts.tolist()])
    drugs = ["8-Hydroxyquinoline", "DMSO_TF", "Afatinib"]
    pick = rng.integers(0, 3, size=num_cells)
    cell = np.arange(first_cell, first_cell + num_cells)
    return pa.table(
        {
            "genes": genes,
            "expressions": expressions,
            "drug": [drugs[k] for k in pick],
            "sample": [f"smp_{1783 + k}" for k in pick],
            "BARCODE_SUB_LIB_ID": [f"01_001_{c:03d}-lib_1105" for c in cell],
            "cell_line_id": [f"CVCL_0{480 + c % 5}" for c in cell],
            "moa-fine": [("unclear", "Vehicle", "EGFR inhibitor")[k] for k in pick],
            "canonical_smiles": [
                ("C1=CC2=C(C(=C1)O)N=CC=C2", "CS(C)=O", "CN(C)C/C=C/C(=O)N")[k] for k in pick
            ],
            "pubchem_cid": [("1923.0", "679.0", "10184653.0")[k] for k in pick],
            "plate": ["plate4"] * num_cells,
        },
        schema=CELLS_SCHEMA,
    )


def _gene_metadata(rng: np.random.Generator) -> pa.Table:
    """Published column names; rows shuffled so the reader must order them by token_id itself."""
    order = rng.permutation(NUM_GENES)
    return pa.table(
        {
            "gene_symbol": [f"GENE{g}" for g in order],
            "ensembl_id": [f"ENSG{g:011d}" for g in order],
            "token_id": (order + 3).astype(np.int64),
        },
        schema=GENES_SCHEMA,
    )


@pytest.fixture(scope="module")
def tahoe(tmp_path_factory):
    """``root/data/train-0000k-of-00003.parquet`` + ``root/metadata/gene_metadata.parquet``, and all cells."""
    root = tmp_path_factory.mktemp("tahoe")
    (root / "data").mkdir()
    (root / "metadata").mkdir()
    rng = np.random.default_rng(11)
    parts = []
    for k in range(NUM_FILES):
        part = _cells(rng, CELLS_PER_FILE, k * CELLS_PER_FILE)
        pq.write_table(part, root / "data" / f"train-{k:05d}-of-{NUM_FILES:05d}.parquet", row_group_size=40)
        parts.append(part)
    pq.write_table(_gene_metadata(rng), root / "metadata" / "gene_metadata.parquet")
    return root, pa.concat_tables(parts)


def _expected_csr(table: pa.Table, rows: np.ndarray, token_to_col: dict[int, int]):
    """Reference CSR with plain Python: CLS pair dropped, tokens → columns through the gene table."""
    genes, values = table.column("genes").to_pylist(), table.column("expressions").to_pylist()
    indptr, indices, data = [0], [], []
    for r in rows:
        assert genes[r][0] == 1 and values[r][0] == -2.0
        indices += [token_to_col[t] for t in genes[r][1:]]
        data += values[r][1:]
        indptr.append(len(indices))
    return np.array(indptr, np.int64), np.array(indices, np.int32), np.array(data, np.float32)


def _assert_csr_equal(actual, expected) -> None:
    for a, e, name in zip(actual, expected, ("indptr", "indices", "values"), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=name)


def _token_to_col(root) -> dict[int, int]:
    tokens = sorted(pq.read_table(root / "metadata" / "gene_metadata.parquet").column("token_id").to_pylist())
    return {t: col for col, t in enumerate(tokens)}


def test_published_layout_round_trips_through_materialize(tahoe, tmp_path):
    root, table = tahoe
    out = tmp_path / "out"
    result = materialize(
        str(root / "data" / "*.parquet"), out, progress=False, layout=Layout(shard_cells=128, group_size=8)
    )
    ds = oj.open_dataset(out)
    rows = np.arange(table.num_rows)
    assert ds.num_cells == table.num_rows == NUM_FILES * CELLS_PER_FILE
    assert ds.num_genes == NUM_GENES
    token_to_col = _token_to_col(root)
    assert token_to_col == {g + 3: g for g in range(NUM_GENES)}  # complete table: column g ↔ token g + 3
    _assert_csr_equal(ds.read_csr(rows), _expected_csr(table, rows, token_to_col))
    shuffled = np.random.default_rng(0).permutation(rows)[:50]
    _assert_csr_equal(ds.read_csr(shuffled), _expected_csr(table, shuffled, token_to_col))
    empty = [r for r, g in enumerate(table.column("genes").to_pylist()) if g == [1]]
    assert len(empty) >= NUM_FILES * CELLS_PER_FILE // 7
    assert np.all(np.diff(ds.read_csr(empty)[0]) == 0)
    assert result.manifest.nnz == sum(len(g) - 1 for g in table.column("genes").to_pylist())
    # cell ids are the barcodes; every other scalar column is an obs column, labels intact
    assert ds.cell_ids.tolist() == table.column("BARCODE_SUB_LIB_ID").to_pylist()
    assert set(OBS) <= set(ds.obs) and "BARCODE_SUB_LIB_ID" not in ds.obs
    for name in OBS:
        assert ds.obs[name].labels().tolist() == table.column(name).to_pylist(), name
    # the gene table under our names, in token order; genes resolve by symbol and Ensembl id
    features = ds.features
    assert features["gene_token_id"].tolist() == list(range(3, NUM_GENES + 3))
    assert features["gene_name"].tolist() == [f"GENE{g}" for g in range(NUM_GENES)]
    assert features["ensembl_id"].tolist() == [f"ENSG{g:011d}" for g in range(NUM_GENES)]
    assert ds.gene_columns(["GENE17", "ENSG00000000250", 5]).tolist() == [17, 250, 5]
    source = result.manifest.source
    assert source["layout"] == "tahoe-100m"
    assert source["cell_id_column"] == "BARCODE_SUB_LIB_ID"
    assert source["genes"] == str(root / "metadata" / "gene_metadata.parquet")


def test_cli_with_where_obs_and_genes(tahoe, tmp_path, capsys):
    root, table = tahoe
    out = tmp_path / "out"
    code = main(
        [
            str(root / "data" / "train-*.parquet"),
            str(out),
            "--where",
            "drug = 'DMSO_TF' AND len(genes) > 1",
            "--obs",
            "drug,moa-fine",
            "--genes",
            str(root / "metadata" / "gene_metadata.parquet"),
            "--no-progress",
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert "materialized" in capsys.readouterr().out
    drugs, genes = table.column("drug").to_pylist(), table.column("genes").to_pylist()
    keep = np.array([r for r in range(table.num_rows) if drugs[r] == "DMSO_TF" and len(genes[r]) > 1])
    ds = oj.open_dataset(out)
    assert ds.num_cells == len(keep) > 0
    _assert_csr_equal(ds.read_csr(np.arange(len(keep))), _expected_csr(table, keep, _token_to_col(root)))
    assert set(ds.obs) & {*OBS, "BARCODE_SUB_LIB_ID"} == {"drug", "moa-fine"}
    assert ds.obs["moa-fine"].labels().tolist() == [table.column("moa-fine")[int(r)].as_py() for r in keep]
    assert ds.cell_ids.tolist() == [table.column("BARCODE_SUB_LIB_ID")[int(r)].as_py() for r in keep]


def test_query_result_in_the_published_layout_is_detected(tahoe, tmp_path, capsys):
    root, table = tahoe
    first = root / "data" / "train-00000-of-00003.parquet"
    query = f"SELECT * FROM read_parquet('{first}') WHERE cell_line_id = 'CVCL_0481'"
    code = main(
        [
            "--query",
            query,
            str(tmp_path / "q"),
            "--genes",
            str(root / "metadata" / "gene_metadata.parquet"),
            "--no-progress",
        ]
    )
    assert code == 0, capsys.readouterr().err
    lines = table.column("cell_line_id").to_pylist()
    keep = np.array([r for r in range(CELLS_PER_FILE) if lines[r] == "CVCL_0481"])
    ds = oj.open_dataset(tmp_path / "q")
    _assert_csr_equal(ds.read_csr(np.arange(len(keep))), _expected_csr(table, keep, _token_to_col(root)))
    assert ds.cell_ids.tolist() == [table.column("BARCODE_SUB_LIB_ID")[int(r)].as_py() for r in keep]


def test_without_gene_table_columns_are_tokens_minus_three(tahoe, tmp_path):
    root, table = tahoe
    alone = tmp_path / "alone"
    alone.mkdir()
    part = table.slice(0, CELLS_PER_FILE)
    pq.write_table(part, alone / "cells.parquet")
    materialize(alone / "cells.parquet", tmp_path / "out", progress=False)
    ds = oj.open_dataset(tmp_path / "out")
    top = max(max(g) for g in part.column("genes").to_pylist())
    assert ds.features["gene_token_id"].tolist() == list(range(3, top + 1))
    rows = np.arange(part.num_rows)
    _assert_csr_equal(ds.read_csr(rows), _expected_csr(part, rows, {t: t - 3 for t in range(3, top + 1)}))


def test_a_cell_id_column_wins_over_the_barcode(tahoe, tmp_path):
    _, table = tahoe
    part = table.slice(0, 20)
    part = part.append_column("cell_id", pa.array([f"c{i}" for i in range(20)]))
    pq.write_table(part, tmp_path / "cells.parquet")
    materialize(tmp_path / "cells.parquet", tmp_path / "out", progress=False)
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.cell_ids.tolist() == [f"c{i}" for i in range(20)]
    assert ds.obs["BARCODE_SUB_LIB_ID"].labels().tolist() == part.column("BARCODE_SUB_LIB_ID").to_pylist()


@pytest.mark.parametrize(
    "genes,values,found",
    [
        ([5, 9], [2.0, 1.0], r"starts with \(gene 5, expression 2\.0\)"),  # CLS pair missing
        ([1, 9], [3.0, 1.0], r"starts with \(gene 1, expression 3\.0\)"),  # CLS gene, wrong value
        ([], [], r"has empty or null genes/expressions lists"),
    ],
)
def test_a_row_without_the_cls_pair_is_a_one_line_error(tahoe, tmp_path, capsys, genes, values, found):
    root, table = tahoe
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(table.slice(0, CELLS_PER_FILE), data / "train-00000-of-00002.parquet")
    bad = table.slice(CELLS_PER_FILE, CELLS_PER_FILE).to_pylist()
    bad[4]["genes"], bad[4]["expressions"] = genes, values
    pq.write_table(pa.Table.from_pylist(bad, schema=CELLS_SCHEMA), data / "train-00001-of-00002.parquet")
    barcode = bad[4]["BARCODE_SUB_LIB_ID"]
    pattern = (
        rf"row 4 \(cell_id {barcode}\) of \S*train-00001-of-00002\.parquet {found} instead of "
        r"Tahoe-100M's CLS pair \(gene 1, expression -2\.0\).*restore the pair.*"
        r"--cell-id BARCODE_SUB_LIB_ID --query"
    )
    out = tmp_path / "out"
    genes_table = root / "metadata" / "gene_metadata.parquet"
    code = main([str(data / "*.parquet"), str(out), "--genes", str(genes_table), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert re.search(pattern, err), err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    with pytest.raises(oj.DataValidationError, match=pattern):
        materialize(str(data / "*.parquet"), out, progress=False, read=InputOptions(genes=genes_table))
    assert not out.exists()


def test_a_cls_token_inside_a_row_is_not_a_gene(tahoe, tmp_path, capsys):
    """Only the leading pair is stripped: a second CLS (token 1) is not in the gene table."""
    root, table = tahoe
    rows = table.slice(0, 10).to_pylist()
    rows[3]["genes"], rows[3]["expressions"] = [1, 1, 7], [-2.0, -2.0, 4.0]
    pq.write_table(pa.Table.from_pylist(rows, schema=CELLS_SCHEMA), tmp_path / "cells.parquet")
    code = main(
        [
            str(tmp_path / "cells.parquet"),
            str(tmp_path / "out"),
            "--genes",
            str(root / "metadata" / "gene_metadata.parquet"),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"gene_token_id 1 in row 3 (cell_id {rows[3]['BARCODE_SUB_LIB_ID']})" in err, err


def test_the_suggested_fix_reads_lists_without_cls(tahoe, tmp_path, capsys):
    """The error's advice works: lists already stripped of CLS go in as the internal layout."""
    root, table = tahoe
    part = table.slice(0, 30)
    genes = pa.array([g[1:] for g in part.column("genes").to_pylist()], pa.list_(pa.int64()))
    values = pa.array([v[1:] for v in part.column("expressions").to_pylist()], pa.list_(pa.float32()))
    stripped = part.set_column(0, "genes", genes).set_column(1, "expressions", values)
    path = tmp_path / "stripped.parquet"
    pq.write_table(stripped, path)
    genes_table = str(root / "metadata" / "gene_metadata.parquet")
    assert main([str(path), str(tmp_path / "bad"), "--genes", genes_table, "--no-progress"]) == 2
    err = capsys.readouterr().err
    fix = re.search(r'(--cell-id \S+) --query "([^"]+)"', err)
    assert fix is not None, err
    code = main(
        [
            str(path),
            str(tmp_path / "out"),
            *fix.group(1).split(),
            "--query",
            fix.group(2),
            "--genes",
            genes_table,
            "--no-progress",
        ]
    )
    assert code == 0, capsys.readouterr().err
    ds = oj.open_dataset(tmp_path / "out")
    rows = np.arange(part.num_rows)
    _assert_csr_equal(ds.read_csr(rows), _expected_csr(part, rows, _token_to_col(root)))
    assert ds.cell_ids.tolist() == part.column("BARCODE_SUB_LIB_ID").to_pylist()


def test_without_any_cell_id_the_error_names_tahoes(tahoe, tmp_path, capsys):
    _, table = tahoe
    pq.write_table(table.slice(0, 5).drop_columns(["BARCODE_SUB_LIB_ID"]), tmp_path / "cells.parquet")
    assert main([str(tmp_path / "cells.parquet"), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "missing required column(s) cell_id; it has genes, expressions, drug" in err, err
    assert "Tahoe-100M's is BARCODE_SUB_LIB_ID" in err
    assert not (tmp_path / "out").exists()


def test_a_zero_based_gene_table_is_refused(tahoe, tmp_path, capsys):
    """token_id must be the ids in ``genes`` (index + 3); a 0-based table would shift every column by 3."""
    root, table = tahoe
    meta = pq.read_table(root / "metadata" / "gene_metadata.parquet")
    shifted = meta.set_column(2, "token_id", pc.subtract(meta.column("token_id"), 3))
    pq.write_table(shifted, tmp_path / "genes.parquet")
    code = main(
        [
            str(root / "data" / "*.parquet"),
            str(tmp_path / "out"),
            "--genes",
            str(tmp_path / "genes.parquet"),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "maps token 0 to a gene, but Tahoe-100M's genes lists reserve 0, 1, 2" in err, err
