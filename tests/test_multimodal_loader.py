"""Loaders over a multimodal dataset: an output per modality gives every modality of the same cells,
sharded, resumable, through make_loader, GrainSource and tokenize; a loader reads only the modalities
it asks for."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from _multimodal_data import SHARD, N, Truth, write_tables

import omicsio_jax as oj
from materialize import Layout, Multimodal, materialize

OUTPUT = {
    "rna": oj.Panel([3, 17, 5, 40], normalize="log1p"),
    "spliced": "csr",
    "unspliced": "dense",
    "atac": "csr",
}
KNOBS = {"batch_size": 64, "sampling": oj.Block(8, 4), "seed": 5}


@pytest.fixture(scope="module")
def truth() -> Truth:
    return Truth(seed=2)


@pytest.fixture(scope="module")
def path(truth, tmp_path_factory):
    root = write_tables(truth, tmp_path_factory.mktemp("mm-loader-in"), shuffle_atac=True)
    layers = {name: str(root / f"rna_layers_{name}.parquet") for name in ("spliced", "unspliced")}
    return materialize(
        root / "rna_cells.parquet",
        tmp_path_factory.mktemp("mm-loader") / "ds",
        progress=False,
        workers=1,
        layout=Layout(shard_cells=SHARD),
        multimodal=Multimodal(layers=layers, modalities={"atac": str(root / "atac_cells.parquet")}),
    ).path


@pytest.fixture(scope="module")
def ds(path):
    return oj.open_dataset(path)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",))


def _expected(truth: Truth, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Each modality's rows as the loader's output makes them (the rna panel log1p'd, padding zero)."""
    safe = np.where(rows >= 0, rows, 0)
    keep = (rows >= 0)[:, None]
    return {
        "rna": np.log1p(truth.rna[safe].toarray()[:, [3, 17, 5, 40]]) * keep,
        "spliced": truth.spliced[safe].toarray() * keep,
        "unspliced": truth.unspliced[safe].toarray() * keep,
        "atac": truth.atac[safe].toarray() * keep,
    }


def _dense(loader, x: dict) -> dict[str, np.ndarray]:
    return {
        name: np.asarray(loader.densify(v, name) if name in ("spliced", "atac") else v)
        for name, v in x.items()
    }


def test_every_modality_of_every_batch_is_exactly_the_cells_of_its_index(ds, truth, mesh):
    loader = oj.make_loader(ds, **KNOBS, num_epochs=1, output=OUTPUT, placement=mesh, obs=("has_atac",))
    seen = []
    for batch in loader:
        rows = np.asarray(batch.index)
        got = _dense(loader, batch.x)
        assert sorted(got) == ["atac", "rna", "spliced", "unspliced"]
        for name, want in _expected(truth, rows).items():
            np.testing.assert_allclose(got[name], want, rtol=1e-6, err_msg=name)
        assert batch.x["rna"].sharding.spec == jax.sharding.PartitionSpec("data")
        assert batch.x["atac"].values.sharding.spec == jax.sharding.PartitionSpec("data")
        assert len(batch.x["atac"].values.sharding.device_set) == 8
        np.testing.assert_array_equal(np.asarray(batch.obs["has_atac"]), truth.has_atac[rows])
        seen.append(rows)
    served = np.concatenate(seen)
    assert len(set(served.tolist())) == len(served) == (N // 64) * 64  # an epoch: each cell at most once
    assert loader.config()["modalities"]["atac"]["output"] == "csr"


def test_an_output_per_modality_builds_dense_rows_on_the_devices(ds, mesh):
    """``oj.Dense(on_device=True)`` per modality: each modality's slabs densified where they land,
    the same rows as the host builds."""
    outputs = [{name: oj.Dense(on_device=flag) for name in ("rna", "atac")} for flag in (False, True)]
    host, device = (oj.make_loader(ds, **KNOBS, num_epochs=1, output=o, placement=mesh) for o in outputs)
    for _, h, d in zip(range(4), host, device, strict=False):
        np.testing.assert_array_equal(np.asarray(d.index), np.asarray(h.index))
        for name in ("rna", "atac"):
            assert d.x[name].shape == h.x[name].shape
            np.testing.assert_array_equal(np.asarray(d.x[name]), np.asarray(h.x[name]), err_msg=name)


def test_a_peak_panel_by_peak_names_gives_those_peaks(ds, truth):
    peaks = [66_000, 12, 40_001]
    names = [f"chr1:{p * 1000}-{p * 1000 + 500}" for p in peaks]
    loader = oj.make_loader(ds, **KNOBS, num_epochs=1, output={"atac": oj.Panel(names), "rna": "csr"})
    for batch in loader:
        rows = np.asarray(batch.index)
        np.testing.assert_array_equal(np.asarray(batch.x["atac"]), truth.atac[rows][:, peaks].toarray())


def test_a_restored_loader_serves_the_same_batches(ds, mesh):
    loader = oj.make_loader(ds, **KNOBS, num_epochs=2, output=OUTPUT, placement=mesh)
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = loader.get_state()
    after = [_dense(loader, next(it).x) for _ in range(5)]
    resumed = oj.make_loader(ds, **KNOBS, num_epochs=2, output=OUTPUT, placement=mesh)
    resumed.set_state(state)
    again = [_dense(resumed, b.x) for _, b in zip(range(5), resumed, strict=False)]
    for a, b in zip(after, again, strict=True):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
    other = oj.make_loader(ds, **KNOBS, num_epochs=2, output={"rna": "dense"}, placement=mesh)
    with pytest.raises(oj.StateMismatchError):
        other.set_state(state)


def test_grain_source_serves_the_loaders_batches(ds):
    kw = {**KNOBS, "num_epochs": 1, "output": {"rna": "csr", "atac": "csr"}}
    expected = [b for _, b in zip(range(6), oj.make_loader(ds, **kw), strict=False)]
    got = [b for _, b in zip(range(6), oj.make_grain_loader(ds, **kw), strict=False)]
    assert len(got) == len(expected) == 6
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a.index), np.asarray(b.index))
        for name in ("rna", "atac"):
            for field in ("row_ids", "indices", "values"):
                np.testing.assert_array_equal(
                    np.asarray(getattr(a.x[name], field)), np.asarray(getattr(b.x[name], field))
                )


def test_tokenize_takes_an_output_per_gene_space_modality(ds, truth):
    rows = np.array([4, 0, -1, 9])
    tokens = oj.tokenize(ds, rows, {"spliced": oj.ScGPTTokens(max_len=32), "rna": oj.ScGPTTokens(max_len=32)})
    assert sorted(tokens) == ["rna", "spliced"]
    for name, matrix in (("rna", truth.rna), ("spliced", truth.spliced)):
        alone = oj.tokenize(ds.modality(name), rows, oj.ScGPTTokens(max_len=32))
        for key, value in alone.items():
            np.testing.assert_array_equal(tokens[name][key], value)
        assert (tokens[name]["pad_mask"][0]).sum() >= min(matrix[4].nnz, 31)


def test_a_loader_reads_only_the_modalities_it_asks_for(path, truth, tmp_path):
    """Every other modality's shards made garbage of the same size: a loader that does not ask for them
    runs a whole epoch exactly; one that does is stopped by the damage, named."""
    copy = tmp_path / "ds"
    shutil.copytree(path, copy)
    rng = np.random.default_rng(0)
    for name in ("spliced", "unspliced", "atac"):
        for shard in (copy / "modalities" / name).glob("shard-*.arrayrecord"):
            shard.write_bytes(rng.integers(0, 256, shard.stat().st_size, dtype=np.uint8).tobytes())
    ds = oj.open_dataset(copy)
    loader = oj.make_loader(ds, **KNOBS, num_epochs=1, output="csr")
    rows = []
    for batch in loader:
        got = np.asarray(loader.densify(batch.x))
        index = np.asarray(batch.index)
        np.testing.assert_array_equal(got, truth.rna[index].toarray())
        rows.append(index)
    assert len(np.concatenate(rows)) == N - N % 64
    rna_only = oj.make_loader(ds, **KNOBS, num_epochs=1, output={"rna": "dense"})
    assert sum(1 for _ in rna_only) == N // 64
    both = oj.make_loader(ds, **KNOBS, num_epochs=1, output={"rna": "dense", "atac": "csr"})
    with pytest.raises(oj.DatasetFormatError, match=r"modalities/atac: shard shard-0000\d.arrayrecord"):
        next(iter(both))
    both.close()  # its read-ahead would go on reading the damaged shards into the next test


def test_mistakes_in_an_output_per_modality_are_one_line_errors(ds):
    with pytest.raises(oj.OmicsIOError, match="has no modality 'prot'; it has rna, spliced, unspliced, atac"):
        oj.make_loader(ds, batch_size=64, output={"rna": "dense", "prot": "csr"})
    with pytest.raises(oj.OmicsIOError, match="normalize must be None, 'log1p' or 'normalize_log1p'"):
        oj.make_loader(ds, batch_size=64, output={"rna": oj.Dense(normalize="log2")})
    with pytest.raises(
        oj.OmicsIOError, match="scgpt tokens need a gene-space modality .* 'atac' has features of its own"
    ):
        oj.make_loader(ds, batch_size=64, output={"atac": oj.ScGPTTokens()})
    with pytest.raises(
        oj.OmicsIOError, match="modality 'atac': output must be 'dense', 'csr' or an oj.Output"
    ):
        oj.make_loader(ds, batch_size=64, output={"atac": "sparse"})
    loader = oj.make_loader(ds, batch_size=64, output={"rna": "dense", "atac": "csr"})
    with pytest.raises(oj.OmicsIOError, match="name the one to densify"):
        loader.densify(None)
    with pytest.raises(oj.OmicsIOError, match="densify needs modality 'rna' to have output 'csr'"):
        loader.densify(None, "rna")
    with pytest.raises(oj.OmicsIOError, match="names modality 'rna' twice: give each modality one output"):
        oj.Modalities([("rna", "dense"), ("rna", "csr")])  # the first was dropped without a word
    single = oj.make_loader(ds, batch_size=64, output="csr")
    x = next(iter(single)).x
    np.testing.assert_array_equal(np.asarray(single.densify(x, "rna")), np.asarray(single.densify(x)))
    for other in ("atac", "nope"):  # the rna rows came back, named as atac's
        with pytest.raises(oj.OmicsIOError, match=rf"output is of modality 'rna', not '{other}'"):
            single.densify(x, other)
    single.close()
