"""Multimodal datasets: splice layers and ATAC peaks aligned by cell, from list-column tables (in the
primary's order or any other), .h5ad layers and .h5mu; exact round trips, presence flags, verify over
every modality, S3, and one-line errors (naming modality, file, row and cell) that leave no output."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.sparse as sp
from _multimodal_data import GENES, PEAKS, SHARD, N, Truth, write_h5ad, write_h5mu, write_tables

import omicsio_jax as oj
from materialize import Dask, InputOptions, Layout, Multimodal, materialize
from materialize._cli import main
from omicsio_jax.format.manifest import verify_dataset


@pytest.fixture(scope="module")
def truth() -> Truth:
    return Truth()


@pytest.fixture(scope="module")
def inputs(truth, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multimodal-inputs")
    return {
        "aligned": write_tables(truth, root / "aligned", shuffle_atac=False),
        "shuffled": write_tables(truth, root / "shuffled", shuffle_atac=True),
        "h5ad": write_h5ad(truth, root / "velo.h5ad"),
        "h5mu": write_h5mu(truth, root / "multiome.h5mu"),
    }


def _materialize(inputs, kind: str, out: Path, **kwargs):
    common = {"layout": Layout(shard_cells=SHARD), "progress": False, "workers": 1, **kwargs}
    if kind in ("aligned", "shuffled"):
        root = inputs[kind]
        return materialize(
            root / "rna_cells.parquet",
            out,
            **common,
            multimodal=Multimodal(
                modalities={"atac": str(root / "atac_cells.parquet")},
                layers={name: str(root / f"rna_layers_{name}.parquet") for name in ("spliced", "unspliced")},
            ),
        )
    return materialize(inputs[kind], out, **common, multimodal=Multimodal(layers=["spliced", "unspliced"]))


@pytest.fixture(scope="module")
def datasets(inputs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multimodal-datasets")
    return {
        kind: _materialize(inputs, kind, root / kind).path for kind in ("aligned", "shuffled", "h5ad", "h5mu")
    }


def _dense(csr, width: int) -> np.ndarray:
    indptr, indices, values = csr
    return sp.csr_matrix((values, indices, indptr), shape=(len(indptr) - 1, width)).toarray()


@pytest.mark.parametrize("kind", ["aligned", "shuffled", "h5ad", "h5mu"])
def test_every_modality_round_trips_exactly_over_random_rows(kind, datasets, truth):
    ds = oj.open_dataset(datasets[kind])
    has_atac = kind != "h5ad"
    assert ds.modalities == ("rna", "spliced", "unspliced", *(("atac",) if has_atac else ()))
    rows = np.random.default_rng(1).integers(0, N, 300)
    expected = {"rna": truth.rna, "spliced": truth.spliced, "unspliced": truth.unspliced, "atac": truth.atac}
    for name in ds.modalities:
        width = PEAKS if name == "atac" else GENES
        assert ds.modality(name).num_genes == width
        got = _dense(ds.read_csr(rows, modality=name), width)
        np.testing.assert_array_equal(got, expected[name][rows].toarray(), err_msg=name)
        assert ds.modality(name).num_cells == N
    assert list(ds.modality("spliced").cell_ids) == list(truth.ids)
    assert np.asarray(ds.obs["has_spliced"]).all()
    if kind == "aligned":  # every cell has a row in the table
        assert np.asarray(ds.obs["has_atac"]).all()
    elif has_atac:
        np.testing.assert_array_equal(np.asarray(ds.obs["has_atac"]), truth.has_atac)
        np.testing.assert_array_equal(ds.rows_where("has_atac", [True]), np.flatnonzero(truth.has_atac))
    assert verify_dataset(datasets[kind]) == []
    ds.close()


@pytest.mark.parametrize("kind", ["shuffled", "h5mu"])
def test_a_modality_some_cells_lack_has_statistics_over_the_cells_that_have_it(kind, datasets, truth):
    """ATAC in some cells only: its peaks' means and variances are over those cells (`n_measured`),
    not over every cell with the others' counted as zeros (a protein panel in 240 of 400 cells had
    its means at 0.6 of theirs); the primary's statistics are over every cell."""
    ds = oj.open_dataset(datasets[kind])
    has = truth.has_atac
    assert 0 < has.sum() < N
    stats = ds.modality("atac").gene_stats
    assert (stats["n_measured"] == has.sum()).all()
    x = truth.atac[np.flatnonzero(has)].toarray().astype(np.float64)
    np.testing.assert_allclose(stats["mean"], x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(stats["var"], x.var(0, ddof=1), rtol=1e-4, atol=1e-9)
    assert (ds.gene_stats["n_measured"] == N).all()
    ds.close()


def test_manifest_lists_modalities_and_tables_keep_their_feature_table(datasets):
    manifest = json.loads((datasets["shuffled"] / "manifest.json").read_text())
    assert manifest["modality"] == "rna"
    entries = {m["name"]: m for m in manifest["modalities"]}
    assert entries["spliced"]["features"] == "primary" and entries["atac"]["features"] == "own"
    assert entries["atac"]["num_features"] == PEAKS and entries["atac"]["path"] == "modalities/atac"
    atac = oj.open_dataset(datasets["shuffled"]).modality("atac")
    assert list(atac.features.columns) == ["peak_token_id", "chrom", "start", "end", "peak_name"]
    assert atac.manifest.source["aligned"] is False
    assert oj.open_dataset(datasets["aligned"]).modality("atac").manifest.source["aligned"] is True


def test_any_input_order_and_worker_count_give_the_same_dataset(inputs, datasets, tmp_path):
    """Rows in the primary's order or shuffled, one worker or two: the same bytes, the same fingerprint."""
    aligned, shuffled = (
        json.loads((datasets[k] / "manifest.json").read_text()) for k in ("aligned", "shuffled")
    )
    atac = {k: oj.open_dataset(datasets[k]).modality("atac") for k in ("aligned", "shuffled")}
    # the aligned tables have every cell, the shuffled ones skip cells without ATAC: same records anyway
    assert [s.sha256 for s in atac["aligned"].manifest.shards] == [
        s.sha256 for s in atac["shuffled"].manifest.shards
    ]
    assert [m["fingerprint"] for m in aligned["modalities"]] == [
        m["fingerprint"] for m in shuffled["modalities"]
    ]
    two = _materialize(inputs, "shuffled", tmp_path / "two", workers=2)
    assert two.manifest.fingerprint == shuffled["fingerprint"]


def test_a_single_modality_dataset_has_one_modality_and_its_old_fingerprint(dataset_dir):
    ds = oj.open_dataset(dataset_dir)
    assert ds.modalities == ("rna",) and ds.modality("rna") is ds and ds.modality() is ds
    with pytest.raises(KeyError, match="no modality 'atac'; this dataset has rna"):
        ds.modality("atac")
    raw = json.loads((Path(dataset_dir) / "manifest.json").read_text())
    raw.pop("modality"), raw.pop("modalities")  # a manifest written before modalities existed
    from omicsio_jax.format.manifest import Manifest, compute_fingerprint

    assert compute_fingerprint(Manifest.from_dict(raw)) == ds.fingerprint


def test_verify_finds_damage_in_any_modality(datasets, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(datasets["shuffled"], copy)
    shard = copy / "modalities" / "atac" / "shard-00001.arrayrecord"
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    shard.write_bytes(bytes(blob))
    assert [p.split(":")[0] for p in verify_dataset(copy)] == ["modalities/atac/shard-00001.arrayrecord"]
    sub = copy / "modalities" / "spliced" / "manifest.json"
    sub.write_text(sub.read_text().replace('"created_by"', '"created_by" ', 1))
    problems = verify_dataset(copy)
    assert any(p.startswith("modalities/spliced/manifest.json: sha256") for p in problems)
    with pytest.raises(oj.DatasetFormatError, match="run `omicsio-materialize verify"):
        oj.open_dataset(copy).modality("atac").read_csr(np.arange(SHARD, 2 * SHARD))


def test_the_cli_takes_layers_modalities_and_their_feature_tables(inputs, truth, tmp_path, capsys):
    root = inputs["shuffled"]
    shutil.copy(root / "peaks.parquet", tmp_path / "atac_peaks.parquet")
    out = tmp_path / "cli"
    code = main(
        [
            str(root / "rna_cells.parquet"),
            str(out),
            "--modality",
            f"atac={root / 'atac_cells.parquet'}",
            "--modality-features",
            f"atac={tmp_path / 'atac_peaks.parquet'}",
            "--layers",
            f"spliced={root / 'rna_layers_spliced.parquet'}",
            "--shard-cells",
            str(SHARD),
            "--workers",
            "1",
            "--no-progress",
        ]
    )
    assert code == 0
    assert "atac: 70,000 features" in capsys.readouterr().out
    ds = oj.open_dataset(out)
    assert ds.modalities == ("rna", "spliced", "atac")
    assert ds.modality("atac").manifest.source["features"] == str(tmp_path / "atac_peaks.parquet")
    assert main(["verify", str(out)]) == 0
    assert "modalities spliced, atac" in capsys.readouterr().out
    h5mu = tmp_path / "mu"
    assert (
        main(
            [
                str(inputs["h5mu"]),
                str(h5mu),
                "--modality",
                "atac",
                "--shard-cells",
                str(SHARD),
                "--workers",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    assert oj.open_dataset(h5mu).modalities == ("rna", "atac")


# -- bad input: one line naming modality, file, row and cell_id; nothing written -----------------------------


def _refused(out: Path, match: str, run) -> None:
    with pytest.raises(oj.DataValidationError, match=match) as info:
        run()
    assert "\n" not in str(info.value)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def _edit_table(path: Path, edit) -> None:
    table = pq.read_table(path)
    pq.write_table(edit(table), path)


def _appended(t: pa.Table, row: int, token: int) -> pa.Table:
    """``t`` with ``token`` (count 1) appended to the lists of ``row`` (columns 1 and 2: tokens, values)."""
    tokens, values = t.column(1).to_pylist(), t.column(2).to_pylist()
    tokens[row], values[row] = [*tokens[row], token], [*values[row], 1.0]
    t = t.set_column(1, t.column_names[1], pa.array(tokens, pa.list_(pa.int32())))
    return t.set_column(2, t.column_names[2], pa.array(values, pa.list_(pa.float32())))


def _bad_tables(inputs, tmp_path: Path) -> Path:
    root = tmp_path / "bad"
    shutil.copytree(inputs["shuffled"], root)
    return root


def _tables_run(root: Path, out: Path, *, require_all: bool = False):
    layers = {"spliced": str(root / "rna_layers_spliced.parquet")}
    modalities = {"atac": str(root / "atac_cells.parquet")}
    return lambda: materialize(
        root / "rna_cells.parquet",
        out,
        progress=False,
        workers=1,
        layout=Layout(shard_cells=SHARD),
        multimodal=Multimodal(modalities=modalities, layers=layers, require_all=require_all),
    )


def test_a_secondary_cell_absent_from_the_primary_is_refused(inputs, tmp_path):
    root = _bad_tables(inputs, tmp_path)
    _edit_table(
        root / "atac_cells.parquet",
        lambda t: t.set_column(
            0,
            "cell_id",
            pa.array(["stranger" if i == 5 else c for i, c in enumerate(t.column("cell_id").to_pylist())]),
        ),
    )
    out = tmp_path / "out"
    _refused(
        out,
        r"modality atac: cell_id stranger in row 5 of .*atac_cells.parquet is not a cell of the primary",
        _tables_run(root, out),
    )


def test_duplicate_cell_ids_are_refused_in_any_modality(inputs, tmp_path):
    root = _bad_tables(inputs, tmp_path)
    ids = pq.read_table(root / "atac_cells.parquet").column("cell_id").to_pylist()
    _edit_table(
        root / "atac_cells.parquet",
        lambda t: t.set_column(0, "cell_id", pa.array([ids[2] if i == 9 else c for i, c in enumerate(ids)])),
    )
    out = tmp_path / "out"
    _refused(
        out,
        rf"modality atac: duplicate cell_id {ids[2]} in row 9 of .*atac_cells.parquet \(also row 2 of",
        _tables_run(root, out),
    )
    root2 = _bad_tables(inputs, tmp_path / "p")
    _edit_table(
        root2 / "rna_cells.parquet",
        lambda t: t.set_column(
            0,
            "cell_id",
            pa.array(["cell-0003" if i == 11 else c for i, c in enumerate(t.column("cell_id").to_pylist())]),
        ),
    )
    _refused(
        out,
        r"duplicate cell_id cell-0003 in the primary modality rna \(rows 3 and 11 of .*rna_cells.parquet\)",
        _tables_run(root2, out),
    )


@pytest.mark.parametrize("order", ["aligned", "shuffled"])
def test_unsorted_or_unknown_feature_ids_name_the_modality_file_row_and_cell(order, inputs, tmp_path):
    root = tmp_path / "bad"
    shutil.copytree(inputs[order], root)

    table = pq.read_table(root / "atac_cells.parquet")
    row = next(i for i, peaks in enumerate(table.column("peak_token_id").to_pylist()) if len(peaks) > 1)
    cell = table.column("cell_id")[row].as_py()

    def unsort(t: pa.Table) -> pa.Table:
        peaks = t.column("peak_token_id").to_pylist()
        peaks[row] = list(reversed(peaks[row]))
        return t.set_column(1, "peak_token_id", pa.array(peaks, pa.list_(pa.int32())))

    _edit_table(root / "atac_cells.parquet", unsort)
    out = tmp_path / "out"
    _refused(
        out,
        rf"peak_token_id not sorted in modality atac: row {row} \(cell_id {cell}\) of .*atac_cells.parquet",
        _tables_run(root, out),
    )

    def shorten(t: pa.Table) -> pa.Table:  # one accessibility list a value short
        values = t.column("peak_accessibility").to_pylist()
        values[row] = values[row][:-1]
        return t.set_column(
            2, "peak_accessibility", pa.array(values, t.schema.field("peak_accessibility").type)
        )

    if order == "shuffled":  # a modality read by cell id (aligned ones are read as the primary table is)
        shutil.copy(inputs[order] / "atac_cells.parquet", root / "atac_cells.parquet")
        _edit_table(root / "atac_cells.parquet", shorten)
        _refused(  # the modality's own columns named (it said gene_token_id and gene_expression)
            out,
            rf"unequal list lengths in modality atac: row {row} \(cell_id {cell}\) of .*atac_cells.parquet: "
            r"peak_token_id has \d+ entries, peak_accessibility has \d+",
            _tables_run(root, out),
        )

    shutil.copy(inputs[order] / "atac_cells.parquet", root / "atac_cells.parquet")
    _edit_table(root / "atac_cells.parquet", lambda t: _appended(t, 6, PEAKS + 5))
    cell = pq.read_table(root / "atac_cells.parquet").column("cell_id")[6].as_py()
    _refused(
        out,
        rf"peak_token_id {PEAKS + 5} in modality atac: row 6 \(cell_id {cell}\) of .*atac_cells.parquet "
        r"is not in the gene table \(the features of modality atac",
        _tables_run(root, out),
    )


def test_a_layer_outside_the_primary_gene_space_is_refused(inputs, tmp_path):
    root = _bad_tables(inputs, tmp_path)

    _edit_table(root / "rna_layers_spliced.parquet", lambda t: _appended(t, 3, GENES + 1))
    out = tmp_path / "out"
    _refused(
        out,
        r"gene_token_id 61 in modality spliced: row 3 \(cell_id cell-0003\) of .*rna_layers_spliced.parquet "
        "is not in the gene table",
        _tables_run(root, out),
    )


def test_require_all_modalities_refuses_a_missing_cell(inputs, tmp_path, truth):
    out = tmp_path / "out"
    first_missing = int(np.flatnonzero(~truth.has_atac)[0])
    _refused(
        out,
        rf"modality atac: cell_id cell-{first_missing:04d} \(row {first_missing} of the primary .*\) has no "
        "row in",
        _tables_run(inputs["shuffled"], out, require_all=True),
    )


def test_an_h5mu_whose_modalities_cannot_be_aligned_is_refused(inputs, tmp_path):
    bad = tmp_path / "bad.h5mu"
    shutil.copy(inputs["h5mu"], bad)
    with h5py.File(bad, "r+") as f:
        obsmap = f["obsmap/atac"][:]
        taken = obsmap[obsmap > 0]
        obsmap[np.flatnonzero(obsmap > 0)[1]] = taken[0]  # two cells claim the same ATAC row
        f["obsmap/atac"][:] = obsmap
    out = tmp_path / "out"
    _refused(
        out,
        r"bad.h5mu: obsmap maps a row of rna or atac to several cells",
        lambda: materialize(bad, out, progress=False, workers=1, layout=Layout(shard_cells=SHARD)),
    )
    bad = tmp_path / "bad2.h5mu"
    shutil.copy(inputs["h5mu"], bad)
    with h5py.File(bad, "r+") as f:
        del f["obsmap"]
        index = f["mod/atac/obs"].attrs["_index"]
        names = f["mod/atac/obs"][index].asstr()[:]
        names[1] = names[0]
        del f["mod/atac/obs"][index]
        f["mod/atac/obs"].create_dataset(index, data=names.astype(object), dtype=h5py.string_dtype())
    _refused(
        out,
        r"^modality atac: duplicate cell_id cell-\d+ in rows 0 and 1 of .*bad2.h5mu:mod/atac: ",
        lambda: materialize(bad, out, progress=False, workers=1, layout=Layout(shard_cells=SHARD)),
    )


def _small_h5mu(
    path: Path, rna: list[str], atac: list[str], *, obsmap: bool, prot: list[str] | None = None
) -> Path:
    """An .h5mu of ``rna`` and ``atac`` cells (obs names) written by MuData, which gives an obs name
    repeated in one modality a cell of its own in ``obsmap`` (absent from the other modality); rna
    with a layer ``spliced``; with ``prot``, a third modality of those cells. Without ``obsmap``:
    the file's obsmap removed (aligned by obs names)."""
    import anndata as ad
    import mudata as md
    import pandas as pd

    md.set_options(pull_on_update=False)

    def modality(ids: list[str], feature: str, seed: int, layers: tuple[str, ...] = ()) -> ad.AnnData:
        x = sp.random(len(ids), 8, density=0.5, format="csr", dtype=np.float32, random_state=seed)
        x.data = np.ceil(x.data * 5)
        var = pd.DataFrame(index=[f"{feature}{j}" for j in range(8)])
        return ad.AnnData(X=x, obs=pd.DataFrame(index=ids), var=var, layers={n: x.copy() for n in layers})

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anndata / MuData warn of the repeated obs name
        mods = {"rna": modality(rna, "g", 1, ("spliced",)), "atac": modality(atac, "p", 2)}
        if prot is not None:
            mods["prot"] = modality(prot, "a", 3)
        mdata = md.MuData(mods)
        mdata.write(path)
    with h5py.File(path, "r+") as f:
        if obsmap:
            assert (f["obsmap/rna"][:] > 0).sum() == len(rna)  # the repeat has a cell of its own
        else:
            del f["obsmap"]
    return path


@pytest.mark.parametrize("obsmap", [True, False], ids=["obsmap", "no-obsmap"])
def test_h5mu_obs_names_of_pandas_string_dtype_align_its_modalities(obsmap, tmp_path):
    """Obs names of pandas' ``string`` dtype (pandas 3's default for text), which anndata writes as
    ``nullable-string-array`` groups, not arrays: the modalities are aligned by them, through the
    file's obsmap or by name."""
    import anndata as ad
    import mudata as md
    import pandas as pd

    md.set_options(pull_on_update=False)
    rna_ids, atac_ids = ["c0", "c1", "c2", "c3"], ["c2", "c0"]

    def modality(ids: list[str], feature: str, seed: int) -> ad.AnnData:
        x = sp.random(len(ids), 8, density=0.5, format="csr", dtype=np.float32, random_state=seed)
        x.data = np.ceil(x.data * 5)
        var = pd.DataFrame(index=pd.Index([f"{feature}{j}" for j in range(8)], dtype="string"))
        return ad.AnnData(X=x, obs=pd.DataFrame(index=pd.Index(ids, dtype="string")), var=var)

    path = tmp_path / "strings.h5mu"
    rna, atac = modality(rna_ids, "g", 1), modality(atac_ids, "p", 2)
    with ad.settings.override(allow_write_nullable_strings=True):
        md.MuData({"rna": rna, "atac": atac}).write(path)
    if not obsmap:
        with h5py.File(path, "r+") as f:
            del f["obsmap"]
    ds = oj.open_dataset(materialize(path, tmp_path / "out", progress=False, workers=1).path)
    assert ds.modalities == ("rna", "atac") and ds.cell_ids.tolist() == rna_ids
    want = np.zeros((4, 8), np.float32)
    want[[2, 0]] = atac.X.toarray()
    np.testing.assert_array_equal(_dense(ds.modality("atac").read_csr(np.arange(4)), 8), want)


_CELLS = [f"c{i}" for i in range(10)]


@pytest.mark.parametrize("obsmap", [True, False], ids=["obsmap", "no-obsmap"])
def test_a_duplicate_obs_name_in_an_h5mu_modality_names_that_modality(obsmap, tmp_path):
    """A repeated obs name is refused, naming the modality it is in, the file, both rows and the
    cell, before any further modality is written: not as a duplicate in another modality (rna's
    repeat was found in ATAC's cells, which are rna's), nor as a cell the primary lacks (MuData gives
    ATAC's repeat a cell of its own, without rna)."""
    out = tmp_path / "out"
    run = lambda path: lambda: materialize(path, out, progress=False, workers=1)  # noqa: E731
    rna_twice = _small_h5mu(tmp_path / "duprna.h5mu", [*_CELLS, "c5"], _CELLS[:5], obsmap=obsmap)
    _refused(
        out,
        r"^duplicate cell_id c5 in the primary modality rna \(rows 5 and 10 of .*duprna.h5mu:mod/rna\): "
        "modalities are aligned by cell_id, which must be unique$",
        run(rna_twice),
    )
    atac_twice = _small_h5mu(tmp_path / "dupatac.h5mu", _CELLS, [*_CELLS[:5], "c3"], obsmap=obsmap)
    _refused(
        out,
        r"^modality atac: duplicate cell_id c3 in rows 3 and 5 of .*dupatac.h5mu:mod/atac: "
        "modalities are aligned by cell_id, which must be unique$",
        run(atac_twice),
    )
    # no further modality: the primary's own check, named as for rna alone or an .h5ad (not the layer)
    _refused(
        out,
        r"^duplicate cell_id c5 in rows 5 and 10 of .*duprna.h5mu:mod/rna: a dataset's cell ids must be unique",
        lambda: materialize(
            rna_twice,
            out,
            progress=False,
            workers=1,
            multimodal=Multimodal(layers=["spliced"], modalities=[]),
        ),
    )
    materialize(_small_h5mu(tmp_path / "ok.h5mu", _CELLS, _CELLS[:5], obsmap=obsmap), out, progress=False)
    assert oj.open_dataset(out).modalities == ("rna", "atac")


@pytest.mark.parametrize("obsmap", [True, False], ids=["obsmap", "no-obsmap"])
def test_an_h5mu_modality_with_cells_the_primary_lacks_is_refused_with_the_ways_out(obsmap, tmp_path):
    """MuData's union layout: atac holds 5 cells rna lacks. A dataset holds the primary's cells, so
    the line counts them and names the fixes; leaving atac out, as it says, materializes rna."""
    out = tmp_path / "out"
    union = _small_h5mu(tmp_path / "union.h5mu", _CELLS, [f"c{i}" for i in range(5, 15)], obsmap=obsmap)
    _refused(
        out,
        r"^modality atac: 5 of its cells \(cell_id c10 first\) have no rna in .*union.h5mu, and a dataset holds "
        r"the cells of its primary modality \(rna\) only: leave atac out \(--modality NAME for each "
        r"modality to keep; --modality rna keeps rna alone\), take as primary a modality that holds every "
        r"cell \(--primary\), or subset",
        lambda: materialize(union, out, progress=False, workers=1),
    )
    materialize(
        union, out, progress=False, workers=1, multimodal=Multimodal(layers=["spliced"], modalities=[])
    )
    assert oj.open_dataset(out).modalities == ("rna", "spliced")


@pytest.mark.parametrize("layers", [["spliced"], []], ids=["layer-first", "no-layer"])
def test_an_h5mu_primary_is_scanned_for_repeated_obs_names_once(layers, tmp_path, monkeypatch):
    """The primary's obs names are scanned for repeats once in a run (a scan of a million names takes
    seconds), by its first further modality that is not one of its layers, and each further
    modality's once."""
    import materialize._modality_h5 as h5

    scanned, scan = [], h5._refuse_repeated_names

    def counted(f, path, mod, primary):
        scanned.append(mod)
        scan(f, path, mod, primary)

    monkeypatch.setattr(h5, "_refuse_repeated_names", counted)
    path = _small_h5mu(tmp_path / "three.h5mu", _CELLS, _CELLS[:5], obsmap=True, prot=_CELLS[3:])
    chosen = Multimodal(layers=layers, modalities=["atac", "prot"])
    materialize(path, tmp_path / "out", progress=False, workers=1, multimodal=chosen)
    assert oj.open_dataset(tmp_path / "out").modalities == ("rna", *layers, "atac", "prot")
    assert sorted(scanned) == ["atac", "prot", "rna"]


def test_modality_arguments_that_do_not_fit_the_input_are_one_line_errors(inputs, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(oj.OmicsIOError, match="an .h5ad holds one modality"):
        materialize(
            inputs["h5ad"], out, progress=False, multimodal=Multimodal(modalities={"atac": "x.parquet"})
        )
    with pytest.raises(oj.OmicsIOError, match="layers maps each layer's name to its table"):
        materialize(
            inputs["aligned"] / "rna_cells.parquet",
            out,
            progress=False,
            multimodal=Multimodal(layers=["spliced"]),
        )
    with pytest.raises(oj.OmicsIOError, match="modality 'rna' is given twice"):
        materialize(
            inputs["h5mu"],
            out,
            progress=False,
            multimodal=Multimodal(modalities=["rna", "rna"], layers=["rna"]),
        )
    with pytest.raises(oj.OmicsIOError, match="has no modality 'prot'"):
        materialize(inputs["h5mu"], out, progress=False, multimodal=Multimodal(primary="prot"))
    assert not out.exists()


def test_one_name_given_as_a_string_is_one_name(inputs, truth, tmp_path):
    """``obs="cell_type"``, ``layers="spliced"``, ``modalities="atac"`` mean what the lists of one
    name mean, not the names of their letters."""
    common = {"layout": Layout(shard_cells=SHARD), "progress": False, "workers": 1}
    ds = oj.open_dataset(
        materialize(
            inputs["h5ad"],
            tmp_path / "h5ad",
            obs="cell_type",
            multimodal=Multimodal(layers="spliced"),
            **common,
        ).path
    )
    assert set(ds.obs) == {"cell_type", "n_counts", "n_genes", "has_spliced"}
    assert ds.modalities == ("rna", "spliced")
    ds = oj.open_dataset(
        materialize(
            inputs["h5mu"], tmp_path / "h5mu", multimodal=Multimodal(modalities="atac"), **common
        ).path
    )
    assert ds.modalities == ("rna", "atac")


# -- object storage ----------------------------------------------------------------------------------------


def test_dask_workers_write_a_multimodal_dataset_to_s3(inputs, datasets, s3, dask_cluster):
    """Partitions of every modality (the shuffled ATAC from its spill, published under the output's
    prefix) on Dask workers: the same dataset as one local process writes."""
    local = json.loads((datasets["shuffled"] / "manifest.json").read_text())
    result = _materialize(
        inputs, "shuffled", s3.url("dask/"), workers=Dask(scheduler=dask_cluster.scheduler_address)
    )
    assert result.manifest.fingerprint == local["fingerprint"]
    assert verify_dataset(s3.url("dask/")) == []
    from omicsio_jax.storage.store import S3Store

    assert not [k for k, _ in S3Store(s3.url("dask/")).list() if k.startswith("_parts")]  # spill removed


def test_a_spilled_partition_is_read_from_the_output_store_where_its_folder_is_absent(truth, s3, tmp_path):
    """What a Dask worker on another machine does: no local spill folder, so it fetches the partition's
    file from where the run published it."""
    import duckdb

    from materialize._reorder import Spill, spill_by_partition
    from omicsio_jax.format import FILENAME_COLUMN

    root = write_tables(truth, tmp_path / "in", shuffle_atac=True)
    con = duckdb.connect()
    con.execute("SET preserve_insertion_order = true")
    con.execute(
        f"CREATE VIEW modality AS SELECT * FROM read_parquet('{root / 'atac_cells.parquet'}', "
        f"filename = '{FILENAME_COLUMN}', file_row_number = true)"
    )
    con.execute(
        f"CREATE VIEW primary_cells AS SELECT cell_id, row_number() OVER () - 1 AS __row "
        f"FROM read_parquet('{root / 'rna_cells.parquet'}')"
    )
    folder = tmp_path / "spill"
    folder.mkdir()
    written = spill_by_partition(
        con,
        ("peak_token_id", "peak_accessibility"),
        num_rows=int(truth.has_atac.sum()),
        shard_cells=SHARD,
        folder=folder,
        label="atac",
        firsts=np.arange(0, len(truth.ids), SHARD),
    )
    assert written == truth.has_atac.sum()
    spill = Spill(folder)
    spill.publish(s3.url("spill/"))
    here = [(t.to_pydict(), r.copy(), o.copy()) for t, r, o in spill.partition(1)][0]
    folder.rename(tmp_path / "elsewhere")
    there = [(t.to_pydict(), r.copy(), o.copy()) for t, r, o in spill.partition(1)][0]
    assert here[0] == there[0]
    np.testing.assert_array_equal(here[1], there[1])
    rows = here[1]
    assert ((rows >= SHARD) & (rows < 2 * SHARD)).all() and len(rows) == truth.has_atac[
        SHARD : 2 * SHARD
    ].sum()


def test_a_multimodal_dataset_on_s3_reads_each_modality_alone(inputs, datasets, truth, s3, tmp_path):
    url = s3.url("multiome/")
    result = _materialize(inputs, "shuffled", url)
    local = json.loads((datasets["shuffled"] / "manifest.json").read_text())
    assert result.manifest.fingerprint == local["fingerprint"]
    assert verify_dataset(url) == []
    ds = oj.open_dataset(url, cache_dir=tmp_path / "cache")
    rows = np.arange(100, 200)
    np.testing.assert_array_equal(
        _dense(ds.read_csr(rows, modality="atac"), PEAKS), truth.atac[rows].toarray()
    )
    assert ds.modality("atac").io_stats().bytes_fetched > 0 and ds.io_stats().bytes_fetched == 0
    rna_only = oj.open_dataset(url, cache_dir=tmp_path / "cache2")
    rna_only.read_csr(rows)
    assert rna_only.io_stats().bytes_fetched > 0
    assert rna_only.modality("atac").io_stats().bytes_fetched == 0  # reading rna fetched no byte of atac


def test_a_selected_primary_keeps_the_selected_cells_of_every_modality(inputs, truth, tmp_path):
    """With --where the primary is a selection: the other tables' cells outside it are left out, not refused."""
    root = inputs["shuffled"]
    out = materialize(
        root / "rna_cells.parquet",
        tmp_path / "t_cells",
        progress=False,
        workers=1,
        read=InputOptions(where="cell_type = 'T'"),
        layout=Layout(shard_cells=SHARD),
        multimodal=Multimodal(modalities={"atac": str(root / "atac_cells.parquet")}),
    ).path
    chosen = np.flatnonzero(truth.cell_type == "T")
    ds = oj.open_dataset(out)
    assert ds.num_cells == len(chosen) and list(ds.modality("atac").cell_ids) == list(truth.ids[chosen])
    rows = np.arange(len(chosen))
    np.testing.assert_array_equal(
        _dense(ds.read_csr(rows, modality="atac"), PEAKS), truth.atac[chosen].toarray()
    )
    np.testing.assert_array_equal(np.asarray(ds.obs["has_atac"]), truth.has_atac[chosen])


def test_open_table_exposes_each_modality_table_as_a_view(inputs, truth):
    root = inputs["shuffled"]
    table = oj.open_table(
        root / "rna_cells.parquet",
        modalities={"atac": root / "atac_cells.parquet", "spliced": root / "rna_layers_spliced.parquet"},
    )
    assert table.modalities == {
        "atac": str(root / "atac_cells.parquet"),
        "spliced": str(root / "rna_layers_spliced.parquet"),
    }
    joined = table.sql(
        "SELECT c.cell_rowid, len(a.peak_token_id) AS peaks FROM cells c JOIN atac a USING (cell_id) "
        "ORDER BY c.cell_rowid"
    )
    rows = np.flatnonzero(truth.has_atac)
    np.testing.assert_array_equal(joined.column("cell_rowid").to_numpy(), rows)
    np.testing.assert_array_equal(joined.column("peaks").to_numpy(), np.diff(truth.atac.indptr)[rows])
    with pytest.raises(oj.OmicsIOError, match="modality view name 'cells'"):
        oj.open_table(root / "rna_cells.parquet", modalities={"cells": root / "atac_cells.parquet"})


@pytest.mark.parametrize("workers", [1, 2])
def test_a_layer_stored_by_column_is_regrouped_by_row_too(tmp_path, monkeypatch, workers):
    """A further modality from the primary's file (here a layer) stored by column (CSC) is regrouped
    by row as the primary's matrix is: read by rows, each batch passed over all its entries."""
    import anndata as ad
    import pandas as pd

    import materialize._csc_rows as csc_rows

    rng = np.random.default_rng(3)
    n = 2_100  # more cells than a further modality's batch (2,048)
    x = sp.random(n, 6, density=0.5, format="csr", random_state=rng, dtype=np.float32)
    x.data = np.ceil(x.data * 9)
    spliced = sp.random(n, 6, density=0.4, format="csr", random_state=rng, dtype=np.float32)
    spliced.data = np.ceil(spliced.data * 5)
    ad.AnnData(
        X=x, obs=pd.DataFrame(index=[f"c{i}" for i in range(n)]), layers={"spliced": spliced.tocsc()}
    ).write_h5ad(tmp_path / "in.h5ad")
    regrouped = []
    regroup = csc_rows.regroup
    monkeypatch.setattr(
        "materialize._h5ad.regroup", lambda *a, **k: regrouped.append(a[3]) or regroup(*a, **k)
    )
    materialize(
        tmp_path / "in.h5ad",
        tmp_path / "out",
        multimodal=Multimodal(layers=["spliced"], modalities=[]),
        layout=Layout(shard_cells=1024),
        workers=workers,
        progress=False,
    )
    layer = oj.open_dataset(tmp_path / "out").modality("spliced")
    indptr, indices, values = layer.read_csr(np.arange(n))
    np.testing.assert_array_equal(indptr, spliced.indptr)
    np.testing.assert_array_equal(indices, spliced.indices)
    np.testing.assert_array_equal(values, spliced.data)
    assert [Path(f).name for f in regrouped] == ["by-row-spliced"]
