"""The in-memory and stream loaders' repr and read options, `tune`'s loader_kwargs, and an elastic
restore through `prefetch_to_device` (hosts simulated with process_index/count)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import numba
import numpy as np
import pytest

import omicsio_jax as oj
from omicsio_jax.loaders import memory
from omicsio_jax.loaders.output_repr import describe_output
from omicsio_jax.outputs import scatter
from omicsio_jax.outputs.resolve import resolve_output

NUMBA_THREADS = numba.config.NUMBA_NUM_THREADS


@pytest.fixture(scope="module")
def ds(dataset_dir):
    return oj.open_dataset(dataset_dir)


@pytest.fixture(scope="module")
def panel(ds):
    return oj.load_panel(ds, [0, 3, 17], obs=("drug",), progress=False)


@pytest.fixture(scope="module")
def table(corpus):
    return oj.open_table(corpus.cells_parquet)


def _threads_of(monkeypatch, module, name: str) -> list[int]:
    """The numba threads in force at each call of ``module.name`` (numba's count is per thread)."""
    seen, kernel = [], getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(numba.get_num_threads())
        return kernel(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


# ----- repr: the settings in force ---------------------------------------------------------------
def test_memory_and_stream_loaders_repr_the_settings_in_force(panel, table):
    loader = oj.make_memory_loader(panel, batch_size=32, seed=3, read=oj.ReadOptions(prefetch=2))
    assert repr(loader) == (
        "MemoryLoader(panel=[3,000 cells × 3 genes], batch_size=32, on_device=False, seed=3, num_epochs=1, "
        f"drop_remainder=True, obs=['drug'], steps_per_epoch=93, "
        f"read=ReadOptions(prefetch=2, decode_threads={NUMBA_THREADS}), hosts=1)"
    )
    loader.close()
    assert "read=ReadOptions(prefetch=0, decode_threads=1)" in repr(
        oj.make_memory_loader(panel, batch_size=32, read=oj.ReadOptions(decode_threads=1))
    )
    on_device = oj.make_memory_loader(panel, batch_size=32, on_device=True)
    assert "on_device=True" in repr(on_device) and repr(on_device).endswith("devices=1, hosts=1)")
    sampling = oj.Stream(shuffle=True, fetch_factor=4)
    with oj.make_stream_loader(
        table, batch_size=32, where="tissue = 'lung'", obs=("cell_type",), sampling=sampling, seed=5
    ) as stream:
        assert repr(stream) == (
            f"StreamLoader({table.spec!r}, batch_size=32, where=\"tissue = 'lung'\", rowids=None, "
            f"sampling={sampling}, output='dense', obs=['cell_type'], seed=5, "
            f"read=ReadOptions(prefetch=2, decode_threads={NUMBA_THREADS}), hosts=1)"
        )
        one = stream.epoch(1)
        next(one)
        assert repr(one) == f"StreamIterator(epoch=1, step=1, loader={stream!r})"
    rows = oj.make_stream_loader(
        table, batch_size=32, rowids=[4, 2, 9], read=oj.ReadOptions(decode_threads=1)
    )
    assert "rowids=[3 rowids]" in repr(rows) and "decode_threads=1)" in repr(rows)


def test_the_disk_and_stream_loaders_repr_the_output_settings_that_differ_from_its_defaults(ds, table):
    with oj.make_loader(ds, batch_size=32, output=oj.Dense(normalize="log1p")) as loader:
        assert ", output=Dense(normalize='log1p'), obs=[]," in repr(loader)
    with oj.make_loader(ds, batch_size=32, output=oj.Panel([3, 1, 4], target_sum=1e6)) as loader:
        assert ", output=Panel(genes=[3 genes], target_sum=1000000.0), " in repr(loader)
    with oj.make_loader(ds, batch_size=32) as loader:
        assert ", output='dense', " in repr(loader)  # at its defaults: the shorthand, as before
    panel = oj.Panel(table.genes.names([5, 9]), normalize="normalize_log1p")
    with oj.make_stream_loader(table, batch_size=32, output=panel) as stream:
        assert ", output=Panel(genes=[2 genes], normalize='normalize_log1p'), " in repr(stream)


@pytest.mark.parametrize(
    ("output", "shown"),
    [
        ("csr", "'csr'"),
        (oj.CSR(nnz_capacity=4096, measured=True), "CSR(nnz_capacity=4096, measured=True)"),
        (oj.Dense(normalize="log1p", on_device=True), "Dense(normalize='log1p', on_device=True)"),
        (oj.Dense(), "'dense'"),
        (oj.GeneformerTokens(), "GeneformerTokens()"),  # as output= takes it: no 'geneformer' shorthand
        (oj.ScGPTTokens(), "ScGPTTokens()"),
        (
            oj.GeneformerTokens(max_len=512, vocab=Path("v.pkl")),
            "GeneformerTokens(max_len=512, vocab='v.pkl')",
        ),
        (oj.ScGPTTokens(n_bins=31, genes=["A", "B"]), "ScGPTTokens(n_bins=31, genes=[2 genes])"),
        (
            {"rna": oj.Panel([1, 2], normalize="log1p"), "atac": "csr"},
            "{'rna': Panel(genes=[2 genes], normalize='log1p'), 'atac': 'csr'}",
        ),
    ],
)
def test_every_output_kind_is_shown_with_its_settings_briefly(output, shown):
    assert describe_output(resolve_output(output)) == shown


def test_every_loader_takes_one_obs_name_as_that_column(ds, table):
    """``obs="drug"`` is the column drug, not the columns d, r, u, g."""
    with oj.make_loader(ds, batch_size=32, obs="drug") as loader:
        assert list(next(loader).obs) == ["drug"] and "obs=['drug']" in repr(loader)
    assert json.loads(repr(oj.GrainSource(ds, batch_size=32, obs="drug"))[len("GrainSource(") : -1])[
        "obs"
    ] == ["drug"]
    assert list(oj.load_panel(ds, [0, 3], obs="drug", progress=False).obs) == ["drug"]
    with oj.make_stream_loader(table, batch_size=32, obs="cell_type") as stream:
        assert list(next(iter(stream)).obs) == ["cell_type"]
    with pytest.raises(TypeError, match=r"^obs takes obs column names, e\.g\. obs='cell_type' .*; got 3 in"):
        oj.make_loader(ds, batch_size=32, obs=["drug", 3])


def test_make_loader_takes_a_dataset_or_its_path_and_says_so_for_anything_else(ds, dataset_dir):
    """A path opens the dataset, as GrainSource's does: the same batches as the opened dataset's."""
    for given in (str(dataset_dir), Path(dataset_dir)):
        with (
            oj.make_loader(given, batch_size=32, obs="drug") as a,
            oj.make_loader(ds, batch_size=32, obs="drug") as b,
        ):
            first, second = next(a), next(b)
            assert np.array_equal(first.index, second.index) and np.array_equal(first.x, second.x)
    for wrong, kind in ((42, "int"), (ds.obs, "ObsColumns")):
        with pytest.raises(
            oj.OmicsIOError,
            match=rf"^make_loader takes a dataset \(oj.open_dataset\(path\)\) or its path, got {kind}$",
        ):
            oj.make_loader(wrong, batch_size=32)


def test_a_name_that_is_not_there_is_a_key_error_naming_those_there_are(ds):
    """``ds.obs`` is a mapping: a missing column is a KeyError (so ``in`` and ``.get`` hold) that is
    also an OmicsIOError, its message unquoted and listing the columns; rows_where's too."""
    assert "nope" not in ds.obs and ds.obs.get("nope") is None
    for lookup in (lambda: ds.obs["nope"], lambda: ds.rows_where("nope", ["a"])):
        with pytest.raises(oj.UnknownNameError) as e:
            lookup()
        assert isinstance(e.value, KeyError) and isinstance(e.value, oj.OmicsIOError)
        assert str(e.value).startswith("obs column 'nope' not in ") and ", ".join(ds.obs) in str(e.value)
    with pytest.raises(KeyError, match=r"^\['no such drug'\] not among the categories of 'drug'"):
        ds.rows_where("drug", ["no such drug"])
    for lookup, said in (
        (lambda: oj.make_loader(ds, batch_size=32, obs=("nope",)), "obs column 'nope' not in "),
        (
            lambda: oj.make_loader(ds, batch_size=32, sampling=oj.ClassBalanced("nope")),
            "obs column 'nope' not in ",
        ),
        (lambda: oj.make_loader(ds, batch_size=32, output=oj.Panel(["NOPE"])), "1 panel gene(s) not in "),
        (lambda: ds.gene_columns(["NOPE"]), "1 panel gene(s) not in "),
    ):
        with pytest.raises(oj.UnknownNameError, match=f"^{re.escape(said)}"):
            lookup()


@pytest.mark.parametrize("capacity", [0, -8, 2.5, True, "64"])
def test_a_csr_capacity_that_is_no_positive_count_is_refused(capacity):
    with pytest.raises(
        oj.OmicsIOError, match=r"^nnz_capacity must be a positive number of nonzeros per device slab"
    ):
        oj.CSR(nnz_capacity=capacity)
    with pytest.raises(oj.OmicsIOError, match=r"^nnz_capacity must be a positive number"):
        oj.Dense(on_device=True, nnz_capacity=capacity)


def test_coverage_of_an_epoch_no_longer_kept_says_which_are(ds):
    with oj.make_loader(ds, batch_size=256, num_epochs=3) as loader:
        for _ in loader:
            pass
        assert loader.coverage().epoch == 2 and loader.coverage(2).complete
        with pytest.raises(
            oj.OmicsIOError, match=r"^coverage of epoch 0 is not kept: .* the last it has is epoch 2$"
        ):
            loader.coverage(0)


# ----- read options: honoured where they mean something, refused elsewhere -----------------------
@pytest.mark.parametrize("prefetch", [0, 2])
def test_memory_loader_copies_rows_on_decode_threads(panel, monkeypatch, prefetch):
    seen = _threads_of(monkeypatch, memory, "_gather_rows")
    read = oj.ReadOptions(prefetch=prefetch)
    default = [np.asarray(b.x) for b in oj.make_memory_loader(panel, batch_size=512, read=read)]
    assert seen and set(seen) == {NUMBA_THREADS}  # the default: all of numba's threads, as before
    seen.clear()
    one = oj.ReadOptions(prefetch=prefetch, decode_threads=1)
    got = [np.asarray(b.x) for b in oj.make_memory_loader(panel, batch_size=512, read=one)]
    assert set(seen) == {1}
    for a, b in zip(got, default, strict=True):
        np.testing.assert_array_equal(a, b)
    many = oj.make_memory_loader(panel, batch_size=512, read=oj.ReadOptions(decode_threads=10**4))
    assert many.decode_threads == NUMBA_THREADS  # numba has no more: all of them


def test_stream_loader_scatters_on_decode_threads(table, monkeypatch):
    seen = _threads_of(monkeypatch, scatter, "scatter_dense")
    kw = {"batch_size": 256, "where": "tissue = 'lung'"}
    default = [np.asarray(b.x) for b in oj.make_stream_loader(table, **kw)]
    assert seen and set(seen) == {NUMBA_THREADS}
    seen.clear()
    got = [np.asarray(b.x) for b in oj.make_stream_loader(table, **kw, read=oj.ReadOptions(decode_threads=1))]
    assert set(seen) == {1}
    for a, b in zip(got, default, strict=True):
        np.testing.assert_array_equal(a, b)


def test_memory_and_stream_loaders_refuse_thread_options_they_have_no_use_for(panel, table):
    with pytest.raises(oj.OmicsIOError, match=r"make_memory_loader takes no ReadOptions\(num_threads=4\)"):
        oj.make_memory_loader(panel, batch_size=32, read=oj.ReadOptions(num_threads=4))
    with pytest.raises(
        oj.OmicsIOError, match=r"on_device=True\) takes no ReadOptions\(decode_threads=2\): .* jitted gather"
    ):
        oj.make_memory_loader(panel, batch_size=32, on_device=True, read=oj.ReadOptions(decode_threads=2))
    with pytest.raises(
        oj.OmicsIOError, match=r"on_device=True\) takes no ReadOptions\(prefetch=2\): .* jitted gather"
    ):
        oj.make_memory_loader(panel, batch_size=32, on_device=True, read=oj.ReadOptions(prefetch=2))
    with pytest.raises(oj.OmicsIOError, match=r"make_stream_loader takes no ReadOptions\(num_threads=0\)"):
        oj.make_stream_loader(table, batch_size=32, read=oj.ReadOptions(num_threads=0))


# ----- tune: loader_kwargs runs what was timed ---------------------------------------------------
def test_tune_loader_kwargs_run_the_read_options_that_were_timed(ds):
    kw = {"label": "batch", "seconds": 0.1, "block_sizes": (1,), "fetch_factors": (8,), "progress": False}
    for read, want in (
        (oj.ReadOptions(prefetch=1, decode_threads=2), {"prefetch": 1, "decode_threads": 2}),
        (None, {}),  # make_loader's own default: read=None
    ):
        result = oj.tune(ds, 64, num_threads=(0, 2), read=read, **kw)
        loader = oj.make_loader(ds, batch_size=64, **result.loader_kwargs())
        assert {k: getattr(loader.read, k) for k in want} == want  # the knobs tune was given
        # exactly the timed loader's knobs, decode_threads derived from the chosen num_threads
        chosen = next(
            r for r in result.table if r.get("num_threads") == result.num_threads and "cells_per_s" in r
        )
        assert loader.read == oj.ReadOptions(
            num_threads=result.num_threads,
            prefetch=chosen["prefetch"],
            decode_threads=chosen["decode_threads"],
        )
        loader.close()
    # a read given to loader_kwargs wins where it sets a knob; num_threads is always the chosen one
    mine = result.loader_kwargs(oj.ReadOptions(num_threads=7, prefetch=3))["read"]
    assert mine == oj.ReadOptions(num_threads=result.num_threads, prefetch=3)


# ----- prefetch_to_device: elastic restore --------------------------------------------------------
KW = {"batch_size": 96, "sampling": oj.Block(16, 4), "seed": 1, "num_epochs": 1, "output": "csr"}


def _loader(ds, index: int, count: int):
    return oj.make_loader(ds, **KW, placement=oj.Placement(process_index=index, process_count=count))


def _rest(batches) -> list[np.ndarray]:
    return [np.asarray(b.index) for b in batches]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3)])
def test_prefetch_to_device_restores_onto_another_number_of_processes(ds, tmp_path, before, after):
    old = [oj.prefetch_to_device(_loader(ds, h, before)) for h in range(before)]
    for _ in range(5):
        for batches in old:
            next(batches)
    states = [json.loads(json.dumps(batches.get_state())) for batches in old]
    for batches in old:
        batches.close()
    for h in range(after):
        bare = _loader(ds, h, after)  # the wrapped loader's own elastic restore is the reference
        bare.set_state([s["inner"] for s in states])
        want = _rest(bare)
        placed = oj.prefetch_to_device(_loader(ds, h, after), buffer_size=3)
        placed.set_state(states)
        assert placed.get_state() == {"inner": _loader_state(ds, h, after, states)}
        got = _rest(placed)
        assert len(got) == len(want) > 0
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
        # Orbax v1 (load_checkpointables): every process's file is read, as make_loader's own load does
        directory = tmp_path / f"{before}-{after}"
        directory.mkdir(exist_ok=True)
        for i, s in enumerate(states):
            (directory / f"process_{i}-of-{before}.json").write_text(json.dumps(s))
        loaded = oj.prefetch_to_device(_loader(ds, h, after))
        asyncio.run(asyncio.run(loaded.load(directory)))
        for a, b in zip(_rest(loaded), want, strict=True):
            np.testing.assert_array_equal(a, b)


def _loader_state(ds, index: int, count: int, states: list[dict]) -> dict:
    loader = _loader(ds, index, count)
    loader.set_state([s["inner"] for s in states])
    return loader.get_state()
