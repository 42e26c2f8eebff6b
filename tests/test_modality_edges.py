"""Edges of several modalities, panels, presence and splits, as users' data reaches them: a primary
selected by a query with its further modalities in another order, layers over other genes than a raw
primary, a protein table beside ATAC peaks, an .h5mu modality that is not in the file, panels naming
genes by versioned ids, shared symbols or twice, a collection's presence over a dense panel, and
splits (arguments of the wrong kind, a bound on a group's first cell, two handles of one dataset)."""

from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.sparse as sp
from _multimodal_data import Truth, write_h5mu

import omicsio_jax as oj
from materialize import InputOptions, Layout, Multimodal, materialize


def _dense(csr, width: int) -> np.ndarray:
    indptr, indices, values = csr
    out = np.zeros((len(indptr) - 1, width), np.float32)
    for i in range(len(indptr) - 1):
        out[i, indices[indptr[i] : indptr[i + 1]]] = values[indptr[i] : indptr[i + 1]]
    return out


@pytest.fixture(scope="module")
def truth() -> Truth:
    return Truth(seed=5)


@pytest.fixture(scope="module")
def small_h5ad(tmp_path_factory):
    """40 cells over 12 genes with versioned Ensembl ids, two of them sharing the symbol G3."""
    path = tmp_path_factory.mktemp("edges") / "small.h5ad"
    x = sp.random(40, 12, density=0.4, random_state=2, format="csr", dtype=np.float32)
    x.data = np.ceil(x.data * 9)
    ids = [f"ENSG{j:011d}.{j % 3 + 1}" for j in range(12)]
    symbols = [f"G{j}" for j in range(12)]
    symbols[7] = "G3"
    var = pd.DataFrame({"gene_ids": ids, "gene_symbols": symbols}, index=ids)
    obs = pd.DataFrame(
        {"donor": [f"d{i % 4}" for i in range(40)], "batch": [f"b{i % 3}" for i in range(40)]},
        index=[f"c{i}" for i in range(40)],
    )
    ad.AnnData(X=x, obs=obs, var=var).write_h5ad(path)
    return path, x.toarray()


def _lists(m: sp.csr_matrix, ids, rows, tokens: str, values: str) -> pa.Table:
    return pa.table(
        {
            "cell_id": pa.array([ids[r] for r in rows], pa.string()),
            tokens: pa.array([m.indices[m.indptr[r] : m.indptr[r + 1]] for r in rows], pa.list_(pa.int32())),
            values: pa.array([m.data[m.indptr[r] : m.indptr[r + 1]] for r in rows], pa.list_(pa.float32())),
        }
    )


def test_a_query_primary_aligns_table_modalities_in_another_order(tmp_path):
    """A --query primary is one partition over several shards; the modalities that are not in its order
    are spilled by that partition, and every cell gets its own row of each."""
    n, rng = 90, np.random.default_rng(0)
    ids = [f"cell-{i:03d}" for i in range(n)]
    rna, spliced, atac = (
        sp.random(n, width, density=0.3, random_state=k, format="csr", dtype=np.float32)
        for k, width in ((1, 20), (2, 20), (3, 300))
    )
    has_atac = rng.random(n) < 0.8
    pq.write_table(_lists(rna, ids, range(n), "gene_token_id", "gene_expression"), tmp_path / "rna.parquet")
    pq.write_table(
        _lists(spliced, ids, range(n), "gene_token_id", "gene_expression"), tmp_path / "spliced.parquet"
    )
    shuffled = rng.permutation(np.flatnonzero(has_atac))
    pq.write_table(
        _lists(atac, ids, shuffled, "peak_token_id", "peak_accessibility"), tmp_path / "atac.parquet"
    )
    materialize(
        tmp_path / "rna.parquet",
        tmp_path / "out",
        read=InputOptions(query="SELECT * FROM cells ORDER BY cell_id DESC"),
        layout=Layout(shard_cells=32),
        progress=False,
        workers=1,
        multimodal=Multimodal(
            modalities={"atac": str(tmp_path / "atac.parquet")},
            layers={"spliced": str(tmp_path / "spliced.parquet")},
        ),
    )
    ds = oj.open_dataset(tmp_path / "out")
    assert len(ds.manifest.shards) == 3
    order = np.arange(n)[::-1]
    np.testing.assert_array_equal(ds.cell_ids, np.array(ids)[order])
    rows = np.arange(n)
    np.testing.assert_array_equal(_dense(ds.read_csr(rows, modality="spliced"), 20), spliced[order].toarray())
    np.testing.assert_array_equal(
        _dense(ds.read_csr(rows, modality="atac"), ds.modality("atac").num_genes),
        (sp.diags(has_atac.astype(np.float32)) @ atac)[order].toarray()[:, : ds.modality("atac").num_genes],
    )
    np.testing.assert_array_equal(np.asarray(ds.obs["has_atac"]), has_atac[order])


def test_a_panel_naming_one_gene_twice_is_a_one_line_error(small_h5ad, tmp_path):
    path, _ = small_h5ad
    materialize(path, tmp_path / "ds", progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "ds")
    with pytest.raises(oj.OmicsIOError, match=r"'ENSG00000000001' and 'G1' name the same gene \(column 1 of"):
        oj.make_loader(ds, batch_size=8, output=oj.Panel(["G2", "ENSG00000000001", "G1"]))


def test_a_materialized_panel_takes_ensembl_ids_without_their_version(small_h5ad, tmp_path):
    path, x = small_h5ad
    materialize(
        path, tmp_path / "ds", layout=Layout(panel=["ENSG00000000005", "G2"]), progress=False, workers=1
    )
    ds = oj.open_dataset(tmp_path / "ds")
    assert ds.layout == "dense" and list(ds.features["gene_name"]) == ["G5", "G2"]
    np.testing.assert_array_equal(_dense(ds.read_csr(np.arange(40)), 2), x[:, [5, 2]])


def test_a_materialized_panel_refuses_a_symbol_two_genes_share(small_h5ad, tmp_path):
    path, _ = small_h5ad
    with pytest.raises(
        oj.DataValidationError,
        match=r"names gene 'G3', which 2 genes share \(ENSG00000000003.1 gene_token_id 3, ENSG00000000007.2 "
        r"gene_token_id 7\): give its Ensembl id or its gene_token_id$",
    ):
        materialize(path, tmp_path / "ds", layout=Layout(panel=["G3", "G4"]), progress=False, workers=1)
    assert not (tmp_path / "ds").exists()


def test_a_name_two_genes_share_with_no_ids_of_their_own_is_told_the_fix_that_works(tmp_path):
    """A var index with a name twice and no gene id column: the Ensembl ids are the names, so the
    messages point to what does tell the genes apart (a gene_token_id, a column number), and it works."""
    import anndata as ad
    import pandas as pd
    import scipy.sparse as sp

    x = np.arange(1, 10, dtype=np.float32).reshape(3, 3)
    obs, var = pd.DataFrame(index=["a", "b", "c"]), pd.DataFrame(index=["G", "G", "H"])
    with pytest.warns(UserWarning, match="Variable names are not unique"):  # anndata's, as it should
        ad.AnnData(X=sp.csr_matrix(x), obs=obs, var=var).write_h5ad(tmp_path / "dup.h5ad")
    with pytest.raises(
        oj.DataValidationError, match=r"\(gene_token_id 0, gene_token_id 1\): give its gene_token_id$"
    ):
        materialize(
            tmp_path / "dup.h5ad", tmp_path / "p", layout=Layout(panel=["G"]), progress=False, workers=1
        )
    materialize(tmp_path / "dup.h5ad", tmp_path / "p", layout=Layout(panel=["1"]), progress=False, workers=1)
    np.testing.assert_array_equal(
        _dense(oj.open_dataset(tmp_path / "p").read_csr(np.arange(3)), 1), x[:, [1]]
    )
    materialize(tmp_path / "dup.h5ad", tmp_path / "ds", progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "ds")
    with pytest.raises(oj.OmicsIOError, match=r"\(column 0, column 1\): give its column number$"):
        ds.gene_columns(["G"])
    assert ds.gene_columns([1, "H"]).tolist() == [1, 2]


def test_a_datasets_gene_columns_refuse_a_symbol_two_genes_share(small_h5ad, tmp_path):
    """``ds.gene_columns`` and ``oj.Panel`` over a dataset whose genes G3 and G7 both carry the symbol
    G3: the symbol is refused naming both Ensembl ids (it gave the first silently); either id works."""
    path, x = small_h5ad
    materialize(path, tmp_path / "ds", progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "ds")
    assert ds.features["gene_name"].tolist()[3] == ds.features["gene_name"].tolist()[7] == "G3"
    shared = (
        r"gene 'G3' is the name of 2 genes \(ENSG00000000003.1 in column 3, ENSG00000000007.2 in column 7\): "
        r"give its Ensembl id or its column number$"
    )
    with pytest.raises(oj.OmicsIOError, match=shared):
        ds.gene_columns(["G4", "G3"])
    with pytest.raises(oj.OmicsIOError, match=shared):
        oj.make_loader(ds, batch_size=8, output=oj.Panel(["G3"]))
    assert ds.gene_columns(["G4", "ENSG00000000007", "ENSG00000000003.1", 7]).tolist() == [4, 7, 3, 7]


def test_an_h5mu_modality_not_in_the_file_is_named_before_anything_is_written(truth, tmp_path):
    path = write_h5mu(truth, tmp_path / "multiome.h5mu")
    with pytest.raises(
        oj.OmicsIOError, match=r"multiome.h5mu has no modality 'protein' \(it has rna, atac\)"
    ):
        materialize(
            path, tmp_path / "out", progress=False, workers=1, multimodal=Multimodal(modalities=["protein"])
        )
    assert not (tmp_path / "out").exists()


def test_a_split_seed_or_fractions_of_the_wrong_kind_is_a_one_line_error(small_h5ad, tmp_path):
    path, _ = small_h5ad
    materialize(path, tmp_path / "ds", progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "ds")
    with pytest.raises(TypeError, match=r"seed must be a non-negative integer, e.g. seed=0; got None"):
        oj.split(ds, by="donor", seed=None)
    with pytest.raises(oj.OmicsIOError, match=r"seed must be a non-negative integer, e.g. seed=0; got -1"):
        oj.split(ds, by="donor", seed=-1)
    with pytest.raises(oj.OmicsIOError, match=r"fractions must be numbers, one per name"):
        oj.split(ds, by="donor", fractions={"train": 0.5, "test": 0.5}, names=("train", "test"))
    assert not (tmp_path / "ds" / "splits").exists()


def test_a_collection_with_a_dense_panel_knows_which_panel_genes_each_source_measured(tmp_path):
    """The bitmaps cover the collection's genes: a panel's column is the gene its gene_token_id names."""
    ids = [f"ENSG{j:011d}" for j in range(12)]
    measured = {"a": list(range(8)), "b": list(range(4, 12))}
    paths = []
    for name, genes in measured.items():
        x = sp.random(10, len(genes), density=0.5, random_state=len(genes), format="csr", dtype=np.float32)
        obs = pd.DataFrame(index=[f"{name}{i}" for i in range(10)])
        ad.AnnData(X=x, obs=obs, var=pd.DataFrame(index=[ids[g] for g in genes])).write_h5ad(
            tmp_path / f"{name}.h5ad"
        )
        paths.append(tmp_path / f"{name}.h5ad")
    panel = [ids[10], ids[1], ids[5]]
    materialize(paths, tmp_path / "out", layout=Layout(panel=panel), progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.layout == "dense" and list(ds.features["ensembl_id"]) == panel
    np.testing.assert_array_equal(ds.measured_genes("a"), [False, True, True])
    np.testing.assert_array_equal(ds.measured_genes("b"), [True, False, True])
    np.testing.assert_array_equal(ds.gene_stats["n_measured"], [10, 10, 20])  # the moments' divisors
    loader = oj.make_loader(
        ds, batch_size=20, output=oj.Dense(measured=True), sampling=oj.Stream(drop_remainder=False)
    )
    batch = next(iter(loader))
    sources = ds.presence.sources_of(np.asarray(batch.index))
    np.testing.assert_array_equal(np.asarray(batch.x["measured"]), ds.presence.measured[sources])


def test_layers_over_other_genes_than_the_raw_primary_are_refused(tmp_path):
    """After gene selection X and its layers hold some genes and raw/X all of them: the layers' columns
    are not the raw primary's, so --raw with --layers is refused rather than misaligned."""
    counts = sp.random(30, 20, density=0.5, random_state=1, format="csr", dtype=np.float32)
    full = ad.AnnData(X=counts, obs=pd.DataFrame(index=[f"c{i}" for i in range(30)]))
    full.var_names = [f"G{j}" for j in range(20)]
    full.raw = full
    selected = full[:, [3, 7, 11, 15, 19]].copy()
    selected.layers["spliced"] = selected.X.copy()
    selected.write_h5ad(tmp_path / "hvg.h5ad")
    with pytest.raises(
        oj.DataValidationError, match=r"layer spliced of .*hvg.h5ad is over 5 genes other than the 20"
    ):
        materialize(
            tmp_path / "hvg.h5ad",
            tmp_path / "out",
            read=InputOptions(use_raw=True),
            multimodal=Multimodal(layers=["spliced"]),
            progress=False,
            workers=1,
        )
    assert not (tmp_path / "out").exists()
    materialize(
        tmp_path / "hvg.h5ad",
        tmp_path / "out",
        multimodal=Multimodal(layers=["spliced"]),
        progress=False,
        workers=1,
    )
    ds = oj.open_dataset(tmp_path / "out")
    np.testing.assert_array_equal(
        _dense(ds.read_csr(np.arange(30), modality="spliced"), 5), selected.layers["spliced"].toarray()
    )


def test_a_split_through_a_second_handle_keeps_the_first_split_listed(small_h5ad, tmp_path):
    """Two handles of one dataset (two notebooks): each split is added to the manifest as it is on disk."""
    path, _ = small_h5ad
    materialize(path, tmp_path / "ds", progress=False, workers=1)
    first, second = oj.open_dataset(tmp_path / "ds"), oj.open_dataset(tmp_path / "ds")
    donors = oj.split(first, by="donor", fractions=(0.5, 0.5), names=("train", "test"))
    oj.split(second, by="batch", fractions=(0.5, 0.5), names=("train", "test"))
    again = oj.open_dataset(tmp_path / "ds")
    assert len(again.split("train", by="donor")) == donors.cells["train"]
    assert {f.path for f in again.manifest.files if f.path.startswith("splits/")} == {
        "splits/donor.json",
        "splits/batch.json",
    }
    assert oj.verify_dataset(tmp_path / "ds") == []


def test_a_protein_table_beside_atac_peaks_keeps_its_own_features(tmp_path):
    """TEA-seq in one folder: peaks.parquet is ATAC's (keyed by peak_token_id), not the protein table's."""
    n, rng = 20, np.random.default_rng(0)
    ids = [f"c{i}" for i in range(n)]

    def lists(width: int, tokens: str, values: str) -> pa.Table:
        picked = [np.sort(rng.choice(width, 3, replace=False)).astype(np.int32) for _ in range(n)]
        return pa.table({"cell_id": ids, tokens: picked, values: [np.ones(3, np.float32)] * n})

    pq.write_table(lists(30, "gene_token_id", "gene_expression"), tmp_path / "rna_cells.parquet")
    pq.write_table(lists(100, "peak_token_id", "peak_accessibility"), tmp_path / "atac_cells.parquet")
    pq.write_table(lists(10, "gene_token_id", "gene_expression"), tmp_path / "adt_cells.parquet")
    peaks = {"peak_token_id": np.arange(100, dtype=np.int32), "peak_name": [f"chr1:{i}" for i in range(100)]}
    pq.write_table(pa.table(peaks), tmp_path / "peaks.parquet")
    materialize(
        tmp_path / "rna_cells.parquet",
        tmp_path / "out",
        progress=False,
        workers=1,
        multimodal=Multimodal(
            modalities={
                "atac": str(tmp_path / "atac_cells.parquet"),
                "adt": str(tmp_path / "adt_cells.parquet"),
            }
        ),
    )
    ds = oj.open_dataset(tmp_path / "out")
    assert ds.modality("atac").num_genes == 100 and list(ds.modality("atac").features["peak_name"])[:2] == [
        "chr1:0",
        "chr1:1",
    ]
    assert ds.modality("adt").num_genes == 10 and "peak_name" not in ds.modality("adt").features


def test_a_group_starting_exactly_on_a_fraction_bound_goes_to_the_next_split(tmp_path):
    """Donors of 10, 20 and 70 cells in that order (seed 1) split 0.1/0.2/0.7 exactly, although 0.1 + 0.2
    is 0.30000000000000004 in floating point."""
    donors = ["a"] * 10 + ["b"] * 20 + ["c"] * 70
    x = sp.random(100, 5, density=0.5, random_state=1, format="csr", dtype=np.float32)
    obs = pd.DataFrame({"donor": donors}, index=[f"c{i}" for i in range(100)])
    ad.AnnData(X=x, obs=obs).write_h5ad(tmp_path / "donors.h5ad")
    materialize(tmp_path / "donors.h5ad", tmp_path / "ds", progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "ds")
    assert [["a", "b", "c"][i] for i in np.random.default_rng(1).permutation(3)] == ["a", "b", "c"]
    result = oj.split(ds, by="donor", fractions=(0.1, 0.2, 0.7), seed=1)
    assert result.groups == {"train": ("a",), "val": ("b",), "test": ("c",)}
    assert result.cells == {"train": 10, "val": 20, "test": 70}


def test_an_h5mu_files_own_obs_go_with_the_primarys_cells_by_name(tmp_path):
    """MuData's obs of the whole file (``mdata.obs["donor"]``, over the modalities' cells in the
    file's order, here ATAC's first) is carried with the primary's cells, matched by obs name, beside
    the modality's own obs; the file's copies of a modality's columns (``rna:cell_type``) are not."""
    import mudata as md

    md.set_options(pull_on_update=False)
    rng = np.random.default_rng(0)
    ids = [f"c{i}" for i in range(50)]
    x = sp.random(50, 20, density=0.3, format="csr", dtype=np.float32, random_state=1)
    x.data = np.ceil(x.data * 5)
    cell_type = pd.DataFrame({"cell_type": pd.Categorical(rng.choice(["B", "T"], 50))}, index=ids)
    rna = ad.AnnData(X=x, obs=cell_type, var=pd.DataFrame(index=[f"g{j}" for j in range(20)]))
    peaks = sp.random(30, 10, density=0.3, format="csr", dtype=np.float32, random_state=2)
    peaks.data = np.ceil(peaks.data * 5)
    atac_ids = list(rng.permutation(ids)[:30])
    atac = ad.AnnData(
        X=peaks, obs=pd.DataFrame(index=atac_ids), var=pd.DataFrame(index=[f"p{j}" for j in range(10)])
    )
    mdata = md.MuData({"atac": atac, "rna": rna})
    mdata.obs["donor"] = pd.Categorical(rng.choice(["d1", "d2", "d3"], mdata.n_obs))
    mdata.obs["age"] = rng.integers(20, 80, mdata.n_obs)
    mdata.obs["rna:cell_type"] = "a copy"
    assert list(mdata.obs_names[:30]) == atac_ids  # the file's order is not the primary's
    mdata.write(tmp_path / "x.h5mu")
    materialize(tmp_path / "x.h5mu", tmp_path / "out", progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "out")
    assert list(ds.cell_ids) == ids
    assert {"cell_type", "donor", "age"} <= {o.name for o in ds.manifest.obs}
    assert "rna:cell_type" not in {o.name for o in ds.manifest.obs}
    donor = ds.obs["donor"]
    assert [donor.categories[c] for c in donor.codes] == mdata.obs.loc[ids, "donor"].astype(str).tolist()
    np.testing.assert_array_equal(np.asarray(ds.obs["age"]), mdata.obs.loc[ids, "age"].to_numpy())
