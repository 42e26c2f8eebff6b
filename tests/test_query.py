"""DuckDB queries over list-column tables: each stage against pyarrow/numpy on the same files,
hive partitions, vortex, the inverted index against the scan, and gene resolution."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import vortex
from conftest import assert_csr_equal, table_csr

import omicsio_jax as oj
from materialize import _index as index_module
from materialize import build_gene_index
from materialize._cli import main as cli
from omicsio_jax.storage.store import default_cache_dir


@pytest.fixture(scope="module")
def table(corpus):
    return oj.open_table(corpus.cells_parquet)


@pytest.fixture(scope="module")
def hive_dir(corpus_table, corpus, tmp_path_factory):
    """The corpus split into dataset=/tissue= folders (two parquet files in one partition)."""
    root = tmp_path_factory.mktemp("hive") / "atlas"
    t = corpus_table.drop_columns(["dataset", "tissue"])
    dataset = pc.if_else(pc.less(pa.array(np.arange(len(t))), 1500), "ds_a", "ds_b")
    tissue = corpus_table.column("tissue")
    for d in ("ds_a", "ds_b"):
        for tis in sorted(set(tissue.to_pylist())):
            keep = pc.and_(pc.equal(dataset, d), pc.equal(tissue, tis))
            part = t.filter(keep)
            if part.num_rows == 0:
                continue
            folder = root / f"dataset={d}" / f"tissue={tis}"
            folder.mkdir(parents=True)
            half = part.num_rows // 2
            pq.write_table(part.slice(0, half), folder / "part-0.parquet")
            pq.write_table(part.slice(half), folder / "part-1.parquet")
    (root / "gene_metadata.parquet").write_bytes(corpus.genes_parquet.read_bytes())
    return root


def hive_reference(root) -> pa.Table:
    """The hive table in cell_rowid order, read with pyarrow (files sorted by path)."""
    parts = []
    for f in sorted(p for p in root.rglob("*.parquet") if p.name != "gene_metadata.parquet"):
        t = pq.read_table(f)
        keys = dict(kv.split("=") for kv in f.parent.relative_to(root).parts)
        t = t.append_column("dataset", pa.array([keys["dataset"]] * t.num_rows))
        parts.append(t.append_column("tissue", pa.array([keys["tissue"]] * t.num_rows)))
    return pa.concat_tables(parts)


def expressing(ref: pa.Table, tokens, mode="any") -> np.ndarray:
    lists = ref.column("gene_token_id").to_pylist()
    test = any if mode == "any" else all
    return np.array([i for i, genes in enumerate(lists) if test(t in set(genes) for t in tokens)], np.int64)


def panel_reference(ref: pa.Table, rows, tokens) -> np.ndarray:
    genes, values = ref.column("gene_token_id").to_pylist(), ref.column("gene_expression").to_pylist()
    out = np.zeros((len(rows), len(tokens)), np.float32)
    for i, r in enumerate(rows):
        lookup = dict(zip(genes[r], values[r], strict=True))
        out[i] = [lookup.get(int(t), 0.0) for t in tokens]
    return out


# ----- stage 1 ---------------------------------------------------------------------------------
def test_stage1_metadata_and_select_match_pyarrow(table, corpus_table):
    meta = table.metadata(["cell_id", "tissue", "n_genes"])
    assert meta.column_names == ["cell_rowid", "cell_id", "tissue", "n_genes"]
    np.testing.assert_array_equal(meta.column("cell_rowid").to_numpy(), np.arange(corpus_table.num_rows))
    assert meta.column("cell_id").to_pylist() == corpus_table.column("cell_id").to_pylist()
    rows = table.select("tissue = 'lung' AND n_genes > 150")
    tis = np.array(corpus_table.column("tissue").to_pylist())
    ng = corpus_table.column("n_genes").to_numpy()
    np.testing.assert_array_equal(rows, np.flatnonzero((tis == "lung") & (ng > 150)))
    sub = table.metadata(["cell_id"], rowids=rows[::-1][:7])  # any order in, row order out
    assert sub.column("cell_rowid").to_pylist() == sorted(rows[:][::-1][:7].tolist())
    assert table.categories("tissue") == sorted(set(tis.tolist()))


def test_stage1_hive_partitions_prune_and_keep_rowids(hive_dir):
    t = oj.open_table(hive_dir)
    ref = hive_reference(hive_dir)
    assert t.num_cells == ref.num_rows and {"dataset", "tissue"} <= set(t.scalar_columns)
    meta = t.metadata(["cell_id", "dataset", "tissue"])
    assert meta.column("cell_id").to_pylist() == ref.column("cell_id").to_pylist()
    rows = t.select("dataset = 'ds_b' AND tissue = 'lung'")
    expect = np.flatnonzero(
        (np.array(ref.column("dataset").to_pylist()) == "ds_b")
        & (np.array(ref.column("tissue").to_pylist()) == "lung")
    )
    np.testing.assert_array_equal(rows, expect)
    # pruning: the plan reads only the files of the matching partition
    plan = "\n".join(
        r[1]
        for r in t.con.execute(
            "EXPLAIN ANALYZE SELECT count(*) FROM cells WHERE dataset = 'ds_b' AND tissue = 'lung'"
        ).fetchall()
    )
    num_files = len(list(hive_dir.rglob("part-*.parquet")))
    assert f"Scanning Files: 2/{num_files}" in plan and "Total Files Read: 2" in plan


def test_rowids_prune_files_and_row_groups(hive_dir):
    t = oj.open_table(hive_dir)
    ref = hive_reference(hive_dir)
    first = sorted(p for p in hive_dir.rglob("part-*.parquet"))[3]
    lo = sum(pq.read_metadata(f).num_rows for f in sorted(hive_dir.rglob("part-*.parquet"))[:3])
    rows = np.array([lo + 1, lo + 2, lo + 5])
    plan = "\n".join(
        r[1] for r in t.con.execute("EXPLAIN ANALYZE SELECT count(*)" + t._from(None, rows)).fetchall()
    )
    assert "Total Files Read: 1" in plan and first.name in plan
    got = t.metadata(["cell_id"], rowids=rows)
    assert got.column("cell_id").to_pylist() == ref.column("cell_id").take(rows).to_pylist()


# ----- stage 2 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["any", "all"])
def test_stage2_cells_expressing_matches_numpy(table, corpus_table, mode):
    tokens = [3, 40, 41]
    names = table.genes.names(tokens)
    np.testing.assert_array_equal(
        table.cells_expressing(names, mode=mode), expressing(corpus_table, tokens, mode)
    )
    lung = table.select("tissue = 'lung'")
    got = table.cells_expressing(tokens, mode=mode, rowids=lung)
    np.testing.assert_array_equal(got, np.intersect1d(lung, expressing(corpus_table, tokens, mode)))
    np.testing.assert_array_equal(table.cells_expressing(tokens, mode=mode, where="tissue = 'lung'"), got)
    with pytest.raises(oj.OmicsIOError, match="cells_expressing needs at least one gene, got none"):
        table.cells_expressing([], mode=mode)  # "all" of none returned no cell (and would be every cell)


def test_stage2_reads_no_expression_values(table):
    plan = "\n".join(
        r[1]
        for r in table.con.execute(
            "EXPLAIN SELECT cell_rowid FROM cells WHERE list_contains(gene_token_id, 3)"
        ).fetchall()
    )
    assert "gene_token_id" in plan and "gene_expression" not in plan


@pytest.mark.parametrize("mode", ["any", "all"])
def test_stage2_many_genes_use_list_has(table, corpus_table, mode):
    tokens = list(range(0, 400, 10))  # 40 genes: past the list_contains chain
    np.testing.assert_array_equal(
        table.cells_expressing(tokens, mode=mode), expressing(corpus_table, tokens, mode)
    )


# ----- stage 3 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["sql", "scatter"])
def test_stage3_panel_matches_numpy(table, corpus_table, method):
    tokens = [0, 3, 17, 1999, 500]
    rows = np.array([5, 2999, 0, 1234, 17])
    res = table.panel(table.genes.names(tokens), rowids=rows, method=method)
    np.testing.assert_array_equal(res.rowids, np.sort(rows))
    np.testing.assert_array_equal(res.x, panel_reference(corpus_table, np.sort(rows), tokens))
    np.testing.assert_array_equal(res.token_ids, tokens)
    lung = table.panel(tokens, where="tissue = 'lung'", method=method)
    np.testing.assert_array_equal(lung.rowids, table.select("tissue = 'lung'"))
    np.testing.assert_array_equal(lung.x, panel_reference(corpus_table, lung.rowids, tokens))


def test_stage3_auto_switches_to_scatter_for_big_panels(table, corpus_table):
    tokens = list(range(0, 2000, 20))  # 100 genes > SQL_PANEL_MAX
    res = table.panel(tokens, where="cell_rowid < 50")
    np.testing.assert_array_equal(res.x, panel_reference(corpus_table, np.arange(50), tokens))


# ----- stage 4 ---------------------------------------------------------------------------------
def test_stage4_stream_csr_is_exact_and_bounded(table, corpus_table):
    parts = list(table.stream_csr(["cell_id"], batch_rows=700))
    assert all(p.num_rows <= 700 for p in parts) and len(parts) >= 5
    rows = np.concatenate([p.rowids for p in parts])
    np.testing.assert_array_equal(rows, np.arange(corpus_table.num_rows))
    lengths = np.concatenate([np.diff(p.indptr) for p in parts])
    got = (
        np.concatenate([[0], np.cumsum(lengths)]),
        np.concatenate([p.indices for p in parts]),
        np.concatenate([p.values for p in parts]),
    )
    assert_csr_equal(got, table_csr(corpus_table))
    ids = pa.concat_arrays([p.columns["cell_id"] for p in parts]).to_pylist()
    assert ids == corpus_table.column("cell_id").to_pylist()


def test_stage4_selected_rows(table, corpus_table):
    rows = np.array([2500, 3, 4, 5, 999])
    parts = list(table.stream_csr(rowids=rows, batch_rows=2))
    np.testing.assert_array_equal(np.concatenate([p.rowids for p in parts]), np.sort(rows))
    sub = corpus_table.take(np.sort(rows))
    lengths = np.concatenate([np.diff(p.indptr) for p in parts])
    got = (
        np.concatenate([[0], np.cumsum(lengths)]),
        np.concatenate([p.indices for p in parts]),
        np.concatenate([p.values for p in parts]),
    )
    assert_csr_equal(got, table_csr(sub))


def test_arrow_csr_handles_sliced_and_chunked_batches(corpus_table):
    sliced = corpus_table.slice(1000, 300)
    assert_csr_equal(oj.arrow_csr(sliced), table_csr(sliced))
    chunked = pa.concat_tables(
        [corpus_table.slice(0, 10), corpus_table.slice(10, 15), corpus_table.slice(25, 5)]
    )
    assert chunked.column("gene_token_id").num_chunks == 3
    assert_csr_equal(oj.arrow_csr(chunked), table_csr(corpus_table.slice(0, 30)))
    rb = corpus_table.slice(40, 20).to_batches()[0]
    indptr, indices, values = oj.arrow_csr(rb)
    assert indptr[0] == 0 and np.shares_memory(values, rb.column("gene_expression").values.to_numpy())


def test_rowid_is_the_materialized_dataset_row(table, dataset_dir):
    ds = oj.open_dataset(dataset_dir)
    rows = table.cells_expressing([17])[:40]
    part = next(table.stream_csr(rowids=rows, batch_rows=64))
    assert_csr_equal((part.indptr, part.indices, part.values), ds.read_csr(rows))


def test_vortex_table_gives_the_same_answers(corpus_table, corpus, tmp_path):
    for i, (start, n) in enumerate([(0, 1000), (1000, 2000)]):
        vortex.io.write(corpus_table.slice(start, n), str(tmp_path / f"cells-{i}.vortex"))
    t = oj.open_table(tmp_path, genes=corpus.genes_parquet)
    assert t.num_cells == corpus_table.num_rows
    np.testing.assert_array_equal(t.cells_expressing([3, 40]), expressing(corpus_table, [3, 40]))
    res = t.panel([0, 3, 17], rowids=[1, 1500, 2999])
    np.testing.assert_array_equal(res.x, panel_reference(corpus_table, [1, 1500, 2999], [0, 3, 17]))
    parts = list(t.stream_csr(batch_rows=1024))
    np.testing.assert_array_equal(np.concatenate([p.rowids for p in parts]), np.arange(corpus_table.num_rows))


# ----- inverted index --------------------------------------------------------------------------
def test_index_equals_scan_with_spilled_runs(hive_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(index_module, "ROW_GROUP_POSTINGS", 5000)  # many row groups
    t = oj.open_table(hive_dir)
    info = build_gene_index(t, tmp_path / "idx", memory_budget=200_000, progress=False)  # many runs
    assert info["datasets"] == ["ds_a", "ds_b"]
    idx = pq.read_table(tmp_path / "idx" / "gene_cell_index.parquet")
    assert idx.schema.equals(
        pa.schema(
            [("gene_token_id", pa.int32()), ("dataset", pa.string()), ("cell_rowids", pa.list_(pa.int64()))]
        )
    )
    assert pq.read_metadata(tmp_path / "idx" / "gene_cell_index.parquet").num_row_groups > 10
    genes = idx.column("gene_token_id").to_numpy()
    assert np.all(np.diff(genes) >= 0)
    for ids in idx.column("cell_rowids").to_pylist()[::97]:
        assert ids == sorted(ids) and len(ids) == len(set(ids))
    assert info["postings"] == sum(len(x) for x in idx.column("cell_rowids").to_pylist())
    t.attach_index(tmp_path / "idx")
    rng = np.random.default_rng(0)
    for _ in range(12):
        tokens = rng.choice(2000, size=rng.integers(1, 4), replace=False).tolist()
        for mode in ("any", "all"):
            np.testing.assert_array_equal(
                t.cells_expressing(tokens, mode=mode, use_index=True),
                t.cells_expressing(tokens, mode=mode, use_index=False),
            )
    np.testing.assert_array_equal(
        t.cells_expressing([5], where="tissue = 'lung'", use_index=True),
        t.cells_expressing([5], where="tissue = 'lung'", use_index=False),
    )
    by_dataset = t.sql(
        "SELECT dataset, len(cell_rowids) AS n FROM gene_cell_index WHERE gene_token_id = 5 ORDER BY 1"
    )
    scan = t.sql(
        "SELECT dataset, count(*) AS n FROM cells WHERE list_contains(gene_token_id, 5) GROUP BY 1 ORDER BY 1"
    )
    assert by_dataset.to_pylist() == scan.to_pylist()


def test_index_command_and_stale_index_refused(corpus, tmp_path, capsys):
    src = tmp_path / "cells.parquet"
    src.write_bytes(corpus.cells_parquet.read_bytes())
    assert (
        cli(["index", str(src), str(tmp_path / "idx"), "--genes", str(corpus.genes_parquet), "--no-progress"])
        == 0
    )
    assert "postings" in capsys.readouterr().out
    info = json.loads((tmp_path / "idx" / "index.json").read_text())
    assert info["num_cells"] == 3000 and info["datasets"] == ["synthetic"]
    assert cli(["index", str(src), str(tmp_path / "idx"), "--no-progress"]) == 2  # exists, no --overwrite
    t = oj.open_table(src, genes=corpus.genes_parquet, index=tmp_path / "idx")
    assert t.cells_expressing([7]).tolist() == t.cells_expressing([7], use_index=False).tolist()
    pq.write_table(pq.read_table(src).slice(0, 100), src)  # the table changed under the index
    with pytest.raises(oj.OmicsIOError, match="rebuild it with `omicsio-materialize index"):
        oj.open_table(src, genes=corpus.genes_parquet, index=tmp_path / "idx")
    with pytest.raises(oj.OmicsIOError, match="no index is attached"):
        oj.open_table(src, genes=corpus.genes_parquet).cells_expressing([1], use_index=True)


# ----- genes -----------------------------------------------------------------------------------
def test_gene_resolution_by_name_ensembl_and_token(table):
    g = table.genes
    row = g.table.slice(42, 1).to_pylist()[0]
    ens = row["ensembl_id"]
    assert g.resolve([row["gene_name"], ens, ens.lower() + ".7", 42]).tolist() == [42, 42, 42, 42]
    with pytest.raises(oj.UnknownGeneError, match=r"'GENE4Z'.*did you mean GENE4") as e:
        g.resolve(["GENE4Z", "GENE5"])
    assert "1 gene(s) not resolved" in str(e.value)
    with pytest.raises(oj.UnknownGeneError, match="token id 99999"):
        g.resolve([99999])
    with pytest.raises(oj.UnknownGeneError):
        table.cells_expressing(["NOT_A_GENE"])


def test_ambiguous_gene_names_must_be_disambiguated():
    genes = oj.GeneTable(
        pa.table(
            {
                "gene_token_id": [0, 1, 2],
                "ensembl_id": ["ENSG1", "ENSG2", "ENSG3"],
                "gene_name": ["A", "B", "B"],
            }
        )
    )
    assert genes.resolve(["A", "ENSG3"]).tolist() == [0, 2]
    with pytest.raises(oj.UnknownGeneError, match="'B' names 2 genes"):
        genes.resolve(["B"])


def test_gene_table_is_cached_locally_and_refreshed_when_it_changes(corpus, tmp_path):
    src = tmp_path / "genes.parquet"
    src.write_bytes(corpus.genes_parquet.read_bytes())
    cache = tmp_path / "cache"
    first = oj.GeneTable.load(src, cache_dir=cache)
    entries = list((cache / "genes").glob("*.parquet"))
    assert len(entries) == 1 and pq.read_table(entries[0]).num_rows == len(first)
    pq.write_table(pq.read_table(entries[0]).slice(0, 3), entries[0])  # mark the cached copy
    assert len(oj.GeneTable.load(src, cache_dir=cache)) == 3  # served from the cache
    assert len(oj.GeneTable.load(src, cache_dir=cache, refresh=True)) == len(first)
    pq.write_table(pq.read_table(corpus.genes_parquet).slice(0, 10), src)  # the source changed
    assert len(oj.GeneTable.load(src, cache_dir=cache)) == 10


def test_a_user_without_a_home_opens_a_table_and_is_told_where_a_cache_can_go(corpus, tmp_path, monkeypatch):
    """A batch job's user: no HOME and a user id with no home in the password database (a
    container's ``--user 1234``). A table opens, its gene table read without the cache; a remote
    dataset's cache, which it needs, is a one-line error naming OMICSIO_JAX_CACHE; and with the
    variable set the cache is there (both were "RuntimeError: Could not determine home directory")."""
    import pwd

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME")
    monkeypatch.delenv("OMICSIO_JAX_CACHE")
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    table = oj.open_table(corpus.cells_parquet, genes=corpus.genes_parquet)
    assert len(table.genes) == len(oj.GeneTable.load(corpus.genes_parquet, cache_dir=tmp_path))
    with pytest.raises(
        oj.OmicsIOError, match=r"^no home folder for omicsio_jax's cache .* set OMICSIO_JAX_CACHE"
    ):
        default_cache_dir()
    monkeypatch.setenv("OMICSIO_JAX_CACHE", str(tmp_path / "cache"))
    oj.open_table(corpus.cells_parquet, genes=corpus.genes_parquet)
    assert list((tmp_path / "cache" / "genes").glob("*.parquet"))


def test_huge_gene_id_without_a_gene_table_is_refused(tmp_path):
    path = tmp_path / "cells.parquet"
    ids = pa.array([[2**40], [1]], pa.list_(pa.int64()))
    pq.write_table(
        pa.table({"cell_id": ["a", "b"], "gene_token_id": ids, "gene_expression": [[1.0], [1.0]]}), path
    )
    with pytest.raises(
        oj.DataValidationError,
        match=r"gene_token_id 1099511627776 in .*cells.parquet is outside 0..2\^31-1.*genes=",
    ):
        oj.open_table(path)


def test_rowids_outside_the_table_or_not_integers_are_one_line_errors(corpus):
    table = oj.open_table(corpus.cells_parquet)
    for rowids, message in (
        (
            [0, table.num_cells],
            rf"cell_rowid {table.num_cells:,}, outside the table's {table.num_cells:,} cells",
        ),
        ([-1, 3], r"cell_rowid -1, outside the table's"),
        ([0.5], r"integer cell_rowids, got float64"),
    ):
        for stage in (
            lambda ids: table.metadata(["cell_id"], rowids=ids),
            lambda ids: table.panel([0, 1], rowids=ids),
        ):
            with pytest.raises(oj.OmicsIOError, match=message) as caught:
                stage(rowids)
            assert "\n" not in str(caught.value)
    assert table.metadata(["cell_id"], rowids=[]).num_rows == 0  # none asked: none given


def test_a_where_is_one_expression_that_cannot_reach_past_its_brackets(corpus, tmp_path):
    """``where`` is a predicate: one that closes the brackets around it (and would select past the
    ``rowids`` beside it) or adds a statement is refused in one line, before running; a trailing
    ``--`` comment ends at its line and leaves the ``rowids`` in force."""
    table = oj.open_table(corpus.cells_parquet)
    assert table.select("1=1 -- all", rowids=[1, 2]).tolist() == [1, 2]
    written = tmp_path / "written.csv"
    for where in (
        "1=1) OR (1=1",
        f"tissue = 'lung'); COPY (SELECT 42 AS v) TO '{written}'; SELECT cell_rowid FROM cells WHERE (1=1",
        "n_genes > 3 /* unterminated",
    ):
        with pytest.raises(oj.OmicsIOError, match=r"^where=.* is not one SQL expression \(Parser Error") as e:
            table.select(where, rowids=[1, 2])
        assert "\n" not in str(e.value)
    assert not written.exists()
    with pytest.raises(oj.OmicsIOError, match="is not one SQL expression"):
        oj.make_stream_loader(table, batch_size=8, where="1=1) OR (1=1")
    assert len(table.select("")) == table.num_cells  # an empty where is none, everywhere
    loader = oj.make_stream_loader(table, batch_size=8, where="")
    one = loader.epoch(0)
    next(one)
    state = one.get_state()
    with pytest.raises(oj.StateMismatchError, match=r"restores from one state .* not a list of 1"):
        loader.epoch(0).set_state([state])
    loader.close()


def test_queries_from_several_threads_take_the_connection_in_turn(corpus):
    """DuckDB refuses a second call on a busy connection; the table's own calls wait their turn, so
    threads may query one table, and stream passes end (their coverage check is such a query)
    while others run. The rowids a query registered are let go of after it."""
    import threading

    table = oj.open_table(corpus.cells_parquet)
    loader = oj.make_stream_loader(table, batch_size=64, sampling=oj.Stream(drop_remainder=False))
    want = {"select": table.select("n_genes > 5"), "panel": table.panel([0, 3, 7], rowids=np.arange(50)).x}
    errors, served = [], []

    def run(work) -> None:
        try:
            work()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def one_pass(epoch: int) -> None:
        served.append(sum(int(np.asarray(b.mask).sum()) for b in loader.epoch(epoch)))

    def queries() -> None:
        for _ in range(20):
            np.testing.assert_array_equal(table.select("n_genes > 5"), want["select"])
            np.testing.assert_array_equal(table.panel([0, 3, 7], rowids=np.arange(50)).x, want["panel"])

    threads = [
        threading.Thread(target=run, args=(w,))
        for w in (lambda: one_pass(0), lambda: one_pass(1), queries, queries)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert served == [table.num_cells] * 2
    names = table.sql("SHOW TABLES").column("name").to_pylist()
    assert not [n for n in names if n.startswith("_rowids_")], names  # none left behind
    loader.close()


def test_the_stream_loader_refuses_an_output_or_a_column_it_cannot_serve_when_made(corpus):
    table = oj.open_table(corpus.cells_parquet)
    with pytest.raises(oj.OmicsIOError, match=r"makes Dense or Panel batches from a query, not 'csr'"):
        oj.make_stream_loader(table, batch_size=8, output=oj.CSR())
    with pytest.raises(oj.OmicsIOError, match=r"query over .* failed: Binder Error: .*no_such_column"):
        oj.make_stream_loader(table, batch_size=8, where="no_such_column = 'x'")


def write_cells(folder, **columns):
    """A small list-column table in ``folder``/cells.parquet (no gene table: token ids name genes)."""
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), folder / "cells.parquet")
    return folder


def lists(rows, kind):
    return pa.array(rows, pa.list_(kind))


def test_a_column_named_as_a_views_position_is_refused_and_filename_is_kept(tmp_path):
    """A table's own ``cell_rowid`` would shadow the row id every query selects by (DuckDB renames
    the view's), so it is refused, as is ``file_row_number``; ``filename`` is an ordinary column."""
    genes = lists([[0], [1], [0, 1], [1]], pa.int32())
    values = lists([[1.0], [2.0], [3.0, 4.0], [5.0]], pa.float32())
    for column in ("cell_rowid", "file_row_number"):
        folder = write_cells(
            tmp_path / column, gene_token_id=genes, gene_expression=values, **{column: [100, 101, 102, 103]}
        )
        with pytest.raises(oj.DataValidationError, match=rf"has a column named '{column}'.*RENAME") as e:
            oj.open_table(folder)
        assert "\n" not in str(e.value)
    folder = write_cells(
        tmp_path / "f",
        cell_id=list("abcd"),
        gene_token_id=genes,
        gene_expression=values,
        filename=list("wxyz"),
    )
    table = oj.open_table(folder)
    assert table.select(rowids=[1, 2]).tolist() == [1, 2]
    assert table.metadata(["filename"]).column("filename").to_pylist() == list("wxyz")
    np.testing.assert_array_equal(table.panel([0], rowids=[0, 2]).x, [[1.0], [3.0]])
    out = tmp_path / "ds"
    assert cli([str(folder), str(out), "--no-progress", "--workers", "1"]) == 0
    ds = oj.open_dataset(out)
    assert [ds.obs["filename"].categories[c] for c in ds.obs["filename"].codes] == list("wxyz")


def test_rowids_are_checked_by_the_stream_loader_and_the_index_too(tmp_path):
    n = 50
    folder = write_cells(
        tmp_path / "t",
        cell_id=[f"c{i}" for i in range(n)],
        gene_token_id=lists([[i % 3] for i in range(n)], pa.int32()),
        gene_expression=lists([[float(i)] for i in range(n)], pa.float32()),
    )
    build_gene_index(folder, tmp_path / "idx")
    table = oj.open_table(folder, index=tmp_path / "idx")
    mask = np.zeros(n, bool)
    mask[[10, 20, 30]] = True
    for rowids, message in ((mask, "integer cell_rowids, got bool"), ([10.9, 20.2], "got float64")):
        with pytest.raises(oj.OmicsIOError, match=message):
            oj.make_stream_loader(table, batch_size=4, rowids=rowids)
        with pytest.raises(oj.OmicsIOError, match=message):
            table.cells_expressing([0], rowids=rowids, use_index=True)
    with pytest.raises(oj.OmicsIOError, match=r"cell_rowid 99, outside the table's 50 cells"):
        table.cells_expressing([0], rowids=[3, 99], use_index=True)
    assert table.cells_expressing([0], rowids=[3, 4, 6], use_index=True).tolist() == [3, 6]
    loader = oj.make_stream_loader(table, batch_size=4, rowids=[30, 10, 20, 10])
    served = np.concatenate([np.asarray(b.index)[np.asarray(b.mask)] for b in loader.epoch(0)])
    assert sorted(served.tolist()) == [10, 20, 30]


def test_decimal_and_bool_obs_come_out_as_a_materialized_datasets_do(tmp_path):
    """DuckDB writes ``0.5`` as a DECIMAL: numbers, not category codes; a bool: codes into
    ("false", "true"), missing -1, as make_loader serves the materialized column."""
    import decimal

    folder = write_cells(
        tmp_path / "t",
        cell_id=list("abcd"),
        gene_token_id=lists([[0]] * 4, pa.int32()),
        gene_expression=lists([[1.0]] * 4, pa.float32()),
        frac=pa.array([decimal.Decimal(x) for x in ("0.5", "10.0", "2.5", "0.5")], pa.decimal128(4, 1)),
        flag=pa.array([True, None, False, True]),
    )
    table = oj.open_table(folder)
    batch = next(iter(oj.make_stream_loader(table, batch_size=4, obs=("frac", "flag")).epoch(0)))
    np.testing.assert_array_equal(np.asarray(batch.obs["frac"]), [0.5, 10.0, 2.5, 0.5])
    panel = oj.load_panel(table, [0], obs=("frac", "flag"), progress=False)
    np.testing.assert_array_equal(panel.obs["frac"], [0.5, 10.0, 2.5, 0.5])
    out = tmp_path / "ds"
    assert cli([str(folder), str(out), "--no-progress", "--workers", "1"]) == 0
    sampling = oj.Stream(drop_remainder=False)
    with oj.make_loader(
        oj.open_dataset(out), batch_size=4, obs=("frac", "flag"), sampling=sampling
    ) as loader:
        served = next(iter(loader))
    np.testing.assert_array_equal(np.asarray(served.obs["frac"]), np.asarray(batch.obs["frac"]))
    assert oj.open_dataset(out).rows_where("frac", [0.5]).tolist() == [0, 3]
    assert oj.open_dataset(out).rows_where("frac", [0.5, None]).tolist() == [0, 3]  # None matches nothing
    with pytest.raises(TypeError, match=r"\['0.5'\] are not numbers, and obs 'frac' holds float"):
        oj.open_dataset(out).rows_where("frac", ["0.5"])  # text is no match for a number: not []
    np.testing.assert_array_equal(np.asarray(served.obs["flag"]), [1, -1, 0, 1])
    np.testing.assert_array_equal(np.asarray(batch.obs["flag"]), [1, -1, 0, 1])
    np.testing.assert_array_equal(panel.obs["flag"], [1, -1, 0, 1])
    assert tuple(panel.categories["flag"]) == ("false", "true")


def test_a_null_inside_the_lists_fails_a_panel_by_either_method(tmp_path):
    folder = write_cells(
        tmp_path / "t",
        cell_id=["a", "b"],
        gene_token_id=lists([[0, 2], [1]], pa.int32()),
        gene_expression=lists([[1.0, None], [2.0]], pa.float32()),
    )
    table = oj.open_table(folder)
    for method in ("sql", "scatter"):
        with pytest.raises(oj.OmicsIOError, match="null elements inside gene_token_id/gene_expression lists"):
            table.panel([0, 2], method=method)


def test_small_query_edges(tmp_path):
    """``stream()`` on a table without cell ids; an empty panel's loader says so; an exact gene name
    decides between names that differ in case, and a gene without a name is called by its id."""
    folder = write_cells(
        tmp_path / "t",
        tissue=["lung", "lung"],
        gene_token_id=lists([[0, 1], [2]], pa.int32()),
        gene_expression=lists([[1.0, 2.0], [3.0]], pa.float32()),
    )
    pq.write_table(
        pa.table(
            {
                "gene_token_id": pa.array([0, 1, 2], pa.int32()),
                "ensembl_id": ["ENSG00000167286", "ENSMUSG00000032093", "ENSG00000000003"],
                "gene_name": ["CD3E", "Cd3e", None],
            }
        ),
        folder / "gene_metadata.parquet",
    )
    table = oj.open_table(folder)
    assert next(iter(table.stream())).column_names == ["cell_rowid", "gene_token_id", "gene_expression"]
    assert table.genes.resolve(["CD3E", "Cd3e", "ENSG00000000003"]).tolist() == [0, 1, 2]
    with pytest.raises(oj.UnknownGeneError, match="'cd3e' names 2 genes"):
        table.genes.resolve(["cd3e"])
    assert table.genes.names([0, 2]) == ["CD3E", "ENSG00000000003"]
    empty = oj.load_panel(table, [0], where="tissue = 'liver'", progress=False)
    with pytest.raises(oj.OmicsIOError, match="the panel holds no cells"):
        oj.make_memory_loader(empty, batch_size=1, seed=0, num_epochs=1)


def test_vortex_files_with_columns_of_their_own_open_as_one_table(tmp_path):
    """A column only a later vortex file has comes after the row id the view adds: not a table's own
    ``cell_rowid``."""
    first = pa.table(
        {
            "cell_id": ["a"],
            "gene_token_id": lists([[0]], pa.int32()),
            "gene_expression": lists([[1.0]], pa.float32()),
        }
    )
    second = first.append_column("batch", pa.array(["p"]))
    vortex.io.write(first, str(tmp_path / "0.vortex"))
    vortex.io.write(second, str(tmp_path / "1.vortex"))
    table = oj.open_table(str(tmp_path / "*.vortex"))
    assert table.select().tolist() == [0, 1]
    assert table.metadata(["batch"]).column("batch").to_pylist() == [None, "p"]
    own = second.append_column("cell_rowid", pa.array([7]))
    vortex.io.write(own, str(tmp_path / "1.vortex"))
    with pytest.raises(oj.DataValidationError, match=r"1.vortex has a column named 'cell_rowid'"):
        oj.open_table(str(tmp_path / "*.vortex"))


def test_a_date_obs_is_refused_by_the_table_loaders_as_by_make_loader(corpus_table, tmp_path):
    # it went into the batches as the codes of its dates taken as categories, without a word
    import datetime as dt

    days = pa.array([dt.date(2024, 1, 1 + i % 20) for i in range(corpus_table.num_rows)], pa.date32())
    pq.write_table(corpus_table.append_column("day", days), tmp_path / "cells.parquet")
    table = oj.open_table(tmp_path / "cells.parquet")
    said = r"obs 'day' of .* holds date32\[day\] values, which batches do not carry: .*metadata\(\['day'\]"
    with pytest.raises(oj.OmicsIOError, match=said):
        oj.make_stream_loader(table, batch_size=8, obs=["day"])
    with pytest.raises(oj.OmicsIOError, match=said):
        oj.load_panel(table, [3], obs=["day"], progress=False)
    assert table.metadata(["day"], rowids=[0, 1]).column("day").to_pylist() == [
        dt.date(2024, 1, 1),
        dt.date(2024, 1, 2),
    ]
