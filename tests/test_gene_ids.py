"""Gene ids as the runtime and materialize take them: one Ensembl-id pattern (Python and Arrow's RE2
alike, the runtime's in any case with its version folded), a vocabulary keeping those ids, and
GENCODE's ``_PAR_Y`` copies kept apart from their X copies."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

import omicsio_jax as oj

# Real Ensembl gene ids (human, mouse, chicken; with a version suffix) and what must not pass for one:
# gene symbols (some starting with ENS), a transcript id, toy ids with too few digits, a trailing
# newline, non-ASCII digits (Python's \d takes them, Arrow's RE2 not).
ENSEMBL_IDS = [
    "ENSG00000141510",
    "ENSG00000141510.17",
    "ENSMUSG00000064370",
    "ENSMUSG00000064370.1",
    "ENSGALG00000000003",
]
NOT_ENSEMBL = [
    "TP53",
    "ENSA",
    "Ensa",
    "ENSAP1",
    "ENST00000269305",
    "ENSG1",
    "ENSG1.2",
    "ENSG00000141510\n",
    "ENSG١٢٣٤٥٦",
    "",
]


def test_the_runtime_takes_ensembl_ids_in_any_case_and_folds_their_version():
    from omicsio_jax.format.genes import fold_ensembl, is_ensembl_id

    for key in ENSEMBL_IDS:
        assert is_ensembl_id(key) and is_ensembl_id(key.lower()), key
        assert fold_ensembl(key.lower()) == key.split(".")[0]
    for key in NOT_ENSEMBL:
        assert not is_ensembl_id(key), key
        assert fold_ensembl(key) == key.upper()  # a symbol is upper-cased only, "ENSG1.2" kept whole


def test_materialize_takes_the_ensembl_ids_the_runtime_takes_as_written():
    import pyarrow as pa

    from materialize._genekeys import ensembl_like, gene_keys, strip_version
    from omicsio_jax.format import ENSEMBL_GENE_ID
    from omicsio_jax.format.genes import is_ensembl_id

    for key in ENSEMBL_IDS + NOT_ENSEMBL:
        # the Python and the Arrow (RE2) reading of the one pattern agree, and with the runtime's
        assert (
            ensembl_like(pa.array([key]))
            == (ENSEMBL_GENE_ID.fullmatch(key) is not None)
            == is_ensembl_id(key)
        )
        assert strip_version(key) == (key.split(".")[0] if key in ENSEMBL_IDS else key)
    assert not ensembl_like(pa.array(["ensg00000141510"]))  # stored ids are matched as written
    genes = pa.table({"gene_ids": ENSEMBL_IDS, "gene_name": ["TP53", "mt-Nd1", "a", "b", "c"]})
    keys = gene_keys(genes, "source 0")
    assert (keys.by, keys.column) == ("ensembl", "gene_ids")
    assert keys.ids.to_pylist() == [k.split(".")[0] for k in ENSEMBL_IDS]
    toys = gene_keys(pa.table({"gene_ids": ["ENSG1", "ENSG2"], "gene_name": ["A", "B"]}), "source 1")
    assert (toys.by, toys.column) == ("symbol", "gene_name")  # too few digits: not Ensembl ids


def test_a_gene_vocabulary_keeps_the_ensembl_ids_the_runtime_takes(tmp_path):
    from materialize._genekeys import read_gene_list

    vocab = tmp_path / "token_dictionary.json"
    vocab.write_text(json.dumps({key: i for i, key in enumerate(NOT_ENSEMBL + ENSEMBL_IDS)}))
    assert read_gene_list(vocab) == [key.split(".")[0] for key in ENSEMBL_IDS]


X_COPY, Y_COPY, OTHER = "ENSG00000182378.14", "ENSG00000182378.14_PAR_Y", "ENSG00000000003.15"


def test_a_par_y_gene_id_is_not_its_x_copy_in_materialize_or_the_runtime():
    """GENCODE's ``ENSG….14_PAR_Y`` (the Y copy of a pseudo-autosomal gene) loses its version only:
    it stays apart from the X copy ``ENSG….14``, alike in Python, in Arrow and at run time."""
    from materialize._genekeys import _stripped, ensembl_like, gene_keys, strip_version
    from omicsio_jax.format.genes import fold_ensembl, is_ensembl_id

    ids = [X_COPY, Y_COPY, "ENSG00000182378_PAR_Y", OTHER, "RP11-1.2", "ENSG00000182378.14_PAR_X"]
    unversioned = [
        "ENSG00000182378",
        "ENSG00000182378_PAR_Y",
        "ENSG00000182378_PAR_Y",
        "ENSG00000000003",
        "RP11-1.2",
        "ENSG00000182378.14_PAR_X",  # no Ensembl id: kept whole
    ]
    assert [strip_version(k) for k in ids] == unversioned
    assert _stripped(pa.array(ids)).to_pylist() == unversioned
    assert [fold_ensembl(k.lower()) for k in ids[:4]] == unversioned[:4]
    assert is_ensembl_id(Y_COPY.lower()) and ensembl_like(pa.array([Y_COPY]))
    keys = gene_keys(pa.table({"gene_ids": [X_COPY, Y_COPY, OTHER], "gene_name": ["A", "A", "B"]}), "s")
    assert (keys.by, keys.ids.to_pylist()) == ("ensembl", unversioned[:2] + unversioned[3:4])


def test_a_collection_keeps_the_par_y_copy_of_a_gene_apart(tmp_path):
    """A source whose var holds both copies of a pseudo-autosomal gene: two genes, not one summed; a
    gene list and the runtime's gene lookup take either copy by its versioned id."""
    import anndata as ad
    import pandas as pd
    import scipy.sparse as sp

    from materialize import InputOptions, materialize

    x = sp.csr_matrix(np.array([[1, 2, 0], [0, 5, 7]], np.float32))
    var = pd.DataFrame(index=[X_COPY, Y_COPY, OTHER])
    ad.AnnData(X=x, obs=pd.DataFrame(index=["a", "b"]), var=var).write_h5ad(tmp_path / "one.h5ad")
    y = sp.csr_matrix(np.array([[4, 1]], np.float32))
    var = pd.DataFrame(index=[OTHER, Y_COPY])
    ad.AnnData(X=y, obs=pd.DataFrame(index=["c"]), var=var).write_h5ad(tmp_path / "two.h5ad")
    paths = [tmp_path / "one.h5ad", tmp_path / "two.h5ad"]
    materialize(paths, tmp_path / "u", progress=False, workers=1)
    ds = oj.open_dataset(tmp_path / "u")
    assert ds.features["ensembl_id"].tolist() == [
        "ENSG00000182378",
        "ENSG00000182378_PAR_Y",
        "ENSG00000000003",
    ]
    indptr, indices, values = ds.read_csr(np.arange(3))
    dense = np.zeros((3, 3), np.float32)
    dense[np.repeat(np.arange(3), np.diff(indptr)), indices] = values
    np.testing.assert_array_equal(dense, [[1, 2, 0], [0, 5, 7], [0, 1, 4]])
    assert ds.gene_columns([Y_COPY, X_COPY, "ensg00000182378_par_y"]).tolist() == [1, 0, 1]

    (tmp_path / "genes.txt").write_text(f"{Y_COPY}\n{X_COPY}\n")
    materialize(
        paths, tmp_path / "g", read=InputOptions(genes=str(tmp_path / "genes.txt")), progress=False, workers=1
    )
    ds = oj.open_dataset(tmp_path / "g")
    assert ds.features["ensembl_id"].tolist() == ["ENSG00000182378_PAR_Y", "ENSG00000182378"]
    indptr, indices, values = ds.read_csr(np.arange(3))
    dense = np.zeros((3, 2), np.float32)
    dense[np.repeat(np.arange(3), np.diff(indptr)), indices] = values
    np.testing.assert_array_equal(dense, [[2, 1], [5, 0], [1, 0]])


def test_peaks_are_named_by_their_coordinates_where_the_peak_table_gives_them(tmp_path):
    """A peak table of ``chrom``, ``start``, ``end`` (no names): ``gene_columns`` and a panel take a
    peak as ``chr1:10010-10460`` (10x) or ``chr1-10010-10460`` (Signac, ArchR); others are unknown."""
    import pyarrow.parquet as pq
    import pytest

    from materialize import Multimodal, materialize

    ids = [f"c{i}" for i in range(4)]
    tokens, values = pa.list_(pa.int32()), pa.list_(pa.float32())
    rna = {"cell_id": ids, "gene_token_id": pa.array([[0, 1]] * 4, tokens)}
    pq.write_table(
        pa.table({**rna, "gene_expression": pa.array([[1, 2]] * 4, values)}), tmp_path / "rna.parquet"
    )
    pq.write_table(
        pa.table(
            {
                "gene_token_id": pa.array([0, 1], pa.int32()),
                "ensembl_id": ["ENSG00000141510", "ENSG00000141511"],
            }
        ),
        tmp_path / "gene_metadata.parquet",
    )
    atac = {"cell_id": ids, "peak_token_id": pa.array([[0, 2], [1], [2], []], tokens)}
    accessibility = pa.array([[1, 3], [2], [4], []], values)
    pq.write_table(pa.table({**atac, "peak_accessibility": accessibility}), tmp_path / "atac.parquet")
    peaks = {"peak_token_id": pa.array([0, 1, 2], pa.int32()), "chrom": ["chr1", "chr1", "chr2"]}
    peaks |= {"start": [10010.0, 20000.0, 10010.0], "end": [10460.0, 20500.0, 10460.0]}
    pq.write_table(pa.table(peaks), tmp_path / "peaks.parquet")
    atac_input = (str(tmp_path / "atac.parquet"), str(tmp_path / "peaks.parquet"))
    multimodal = Multimodal(modalities={"atac": atac_input})
    materialize(str(tmp_path / "rna.parquet"), tmp_path / "ds", progress=False, multimodal=multimodal)
    ds = oj.open_dataset(tmp_path / "ds")
    atac_ds = ds.modality("atac")
    assert atac_ds.gene_columns(["chr2:10010-10460", "chr1-20000-20500", "chr1:10010-10460"]).tolist() == [
        2,
        1,
        0,
    ]
    with pytest.raises(oj.OmicsIOError, match="chr3:1-2"):
        atac_ds.gene_columns(["chr3:1-2"])
    loader = oj.make_loader(
        ds, batch_size=4, output={"atac": oj.Panel(["chr2:10010-10460", "chr1:10010-10460"])}
    )
    batch = next(iter(loader))
    expected = np.array([[3, 1], [0, 0], [4, 0], [0, 0]])[np.asarray(batch.index)]
    np.testing.assert_array_equal(np.asarray(batch.x["atac"]), expected)
