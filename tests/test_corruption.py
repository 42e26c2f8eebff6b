"""A damaged dataset never crashes, hangs or lies: mutated records fuzzed through every decoder,
corrupted or truncated shards read by the loaders, and the manifest's other files (gene table, cell
ids, statistics, chunk indexes, obs sidecars) cut short or replaced, each a clean `DatasetFormatError`."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import struct

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import omicsio_jax as oj
from materialize._shardfiles import chunk_ranges
from omicsio_jax.format import codec
from omicsio_jax.format.chunk_index import chunk_index_path
from omicsio_jax.outputs import scatter
from omicsio_jax.outputs.base import OutputContext, RowKeys

NUM_COLUMNS = 300


def reference_decode(record: bytes, num_columns: int) -> tuple[list[int], list[float]] | None:
    """The codec's format (see `codec`'s docstring) read byte by byte in plain Python: a record's
    (columns, values) with zeros dropped, or None when the bytes are not a record the writer makes."""
    if len(record) < 8 or len(record) % 4:
        return None
    version, ic, vc, reserved, n = struct.unpack_from("<BBBBI", record)
    if version != 1 or reserved or ic > 2 or vc > 3:
        return None
    iw, vw = (0, 2, 4)[ic], (4, 1, 2, 4)[vc]

    def pad(nbytes):
        return (nbytes + 3) & ~3

    if len(record) != 8 + pad(n * iw) + pad(n * vw):
        return None
    body, vbase = record[8:], pad(n * iw)
    if any(record[8 + n * iw : 8 + pad(n * iw)]) or any(body[vbase + n * vw : vbase + pad(n * vw)]):
        return None  # nonzero padding
    if ic == 0:
        if n != num_columns:
            return None
        cols = list(range(n))
    elif ic == 1:  # gaps as two byte planes
        gaps = [body[k] | body[n + k] << 8 for k in range(n)]
        cols = list(np.cumsum(gaps, dtype=np.int64)) if n else []
    else:
        cols = list(struct.unpack_from(f"<{n}I", body))
    if any(b <= a for a, b in itertools.pairwise(cols)) or (cols and cols[-1] >= num_columns):
        return None
    if vc == 0:
        vals = list(np.frombuffer(body, np.float32, n, vbase))
        if not np.all(np.isfinite(vals)):
            return None
    elif vc == 1:
        vals = list(body[vbase : vbase + n])
    elif vc == 2:
        vals = [body[vbase + k] | body[vbase + n + k] << 8 for k in range(n)]
    else:
        vals = list(struct.unpack_from(f"<{n}I", body, vbase))
    vals = np.asarray(vals, np.float32)
    keep = vals != 0 if ic == 0 else np.ones(n, bool)  # a dense record decodes to its nonzeros
    return [int(c) for c, k in zip(cols, keep, strict=True) if k], vals[keep].tolist()


@st.composite
def records(draw) -> list[bytes]:
    """A few valid records of every index and value code (dense ones too)."""
    out = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["u8", "u16", "u32", "float", "dense"]))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        if kind == "dense":
            row = rng.geometric(0.5, NUM_COLUMNS).astype(np.float32) * (rng.random(NUM_COLUMNS) < 0.1)
            buf, _ = codec.encode_dense_rows(row[None])
        else:
            cols = np.sort(rng.choice(NUM_COLUMNS, size=draw(st.integers(0, 30)), replace=False)).astype(
                np.int32
            )
            top = {"u8": 255, "u16": 65_535, "u32": 2**24}.get(kind, 0)
            vals = (rng.integers(1, top + 1, len(cols)) if top else rng.normal(size=len(cols))).astype(
                np.float32
            )
            buf, _ = codec.encode_csr(np.array([0, len(cols)], np.int64), cols, vals)
        out.append(buf.tobytes())
    return out


@st.composite
def mutated(draw) -> tuple[list[bytes], int]:
    """Valid records with one of them damaged: bytes flipped or set, cut short, extended, or its
    header's count, codes or version rewritten."""
    recs = draw(records())
    i = draw(st.integers(0, len(recs) - 1))
    rec = bytearray(recs[i])
    how = draw(st.sampled_from(["flip", "set", "truncate", "extend", "count", "codes", "version"]))
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            rec[draw(st.integers(0, len(rec) - 1))] ^= 1 << draw(st.integers(0, 7))
    elif how == "set":
        rec[draw(st.integers(0, len(rec) - 1))] = draw(st.integers(0, 255))
    elif how == "truncate":
        rec = rec[: draw(st.integers(0, len(rec) - 1))]
    elif how == "extend":
        rec += bytes(draw(st.lists(st.integers(0, 255), min_size=1, max_size=12)))
    elif how == "count":
        struct.pack_into("<I", rec, 4, draw(st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1))))
    elif how == "codes":
        rec[1], rec[2] = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    else:
        rec[0] = draw(st.integers(0, 255))
    recs[i] = bytes(rec)
    return recs, i


def _expected(recs: list[bytes]) -> list | None:
    decoded = [reference_decode(r, NUM_COLUMNS) for r in recs]
    return None if any(d is None for d in decoded) else decoded


def _as_dense(decoded: list, width: int = NUM_COLUMNS) -> np.ndarray:
    out = np.zeros((len(decoded), width), np.float32)
    for row, (cols, vals) in enumerate(decoded):
        out[row, cols] = vals
    return out


@given(mutated())
@settings(max_examples=400, deadline=None)
def test_every_decoder_refuses_a_damaged_record_or_returns_exactly_what_it_says(case):
    """Either `MalformedRecordError` naming the damaged record, from the check every record passes
    before a decoder reads it, or — when the damage still spells a record the writer makes —
    exactly what the reference reading of the bytes says, in every decoder."""
    recs, damaged = case
    buf, starts = codec.join_records(recs)
    expected = _expected(recs)
    if expected is None:
        with pytest.raises(codec.MalformedRecordError) as info:
            codec.Records.check(buf, starts, NUM_COLUMNS)
        assert info.value.index == damaged
        return
    records = codec.Records.check(buf, starts, NUM_COLUMNS)
    decoders = {
        "csr": lambda: codec.decode_csr(records),
        "rows": lambda: codec.decode_rows(records, np.full((len(recs), NUM_COLUMNS), 7, np.float32)),
        "slabs": lambda: codec.decode_slabs(
            records, num_rows=len(recs), num_slabs=1, capacity=4096, num_columns=NUM_COLUMNS
        ),
        "log1p": lambda: scatter.decode_scatter(
            records, np.empty((len(recs), NUM_COLUMNS), np.float32), normalize="log1p"
        ),
        "panel": lambda: scatter.decode_scatter(
            records,
            np.empty((len(recs), 3), np.float32),
            gene_to_col=scatter.make_gene_to_col(NUM_COLUMNS, [5, 0, 299]),
        ),
    }
    for name, decode in decoders.items():
        got = decode()
        dense = _as_dense(expected)
        if name == "csr":
            indptr, indices, values = got
            assert np.diff(indptr).tolist() == [len(c) for c, _ in expected]
            assert indices.tolist() == [c for cols, _ in expected for c in cols]
            np.testing.assert_array_equal(
                values, np.concatenate([v for _, v in expected] + [[]]).astype(np.float32)
            )
        elif name == "rows":
            np.testing.assert_array_equal(got, dense)
        elif name == "slabs":
            rebuilt = np.zeros_like(dense)
            np.add.at(rebuilt, (got[0][0].astype(np.int64), got[1][0].astype(np.int64)), got[2][0])
            np.testing.assert_array_equal(rebuilt, dense)
        elif name == "log1p":
            with np.errstate(invalid="ignore"):  # a negative value below -1 gives NaN in both
                np.testing.assert_allclose(got, np.log1p(dense), rtol=1e-6)
        else:
            np.testing.assert_array_equal(got, dense[:, [5, 0, 299]])


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory):
    """300 cells × 300 genes with statistics: the column space of the fuzzed records."""
    from materialize import make_synthetic_corpus, materialize

    corpus = make_synthetic_corpus(
        tmp_path_factory.mktemp("c300"),
        num_cells=300,
        num_genes=NUM_COLUMNS,
        seed=3,
        mean_nnz=20,
        progress=False,
    )
    out = tmp_path_factory.mktemp("ds300") / "ds"
    materialize(corpus.cells_parquet, out, progress=False)
    return oj.open_dataset(out)


@given(mutated())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_token_outputs_refuse_a_damaged_record_or_tokenize_it(small_dataset, case):
    """The Geneformer and scGPT kernels index per-gene tables by column: a damaged record must be
    refused before they run (an unchecked column would read past the tables)."""
    recs, damaged = case
    buf, starts = codec.join_records(recs)
    ctx = OutputContext.of_dataset(small_dataset, rows=len(recs))
    keys = RowKeys(np.arange(len(recs), dtype=np.int64))
    try:  # checked against far more columns than the tables have: each output checks them again
        wide = codec.Records.check(buf, starts, 1 << 20)
    except codec.MalformedRecordError:  # damage any width refuses, or a dense record
        wide = None

    def records() -> codec.Records:  # a refusal here is the check's, before any kernel runs
        return wide if wide is not None else codec.Records.check(buf, starts, NUM_COLUMNS)

    for output in (oj.GeneformerTokens(max_len=16), oj.ScGPTTokens(max_len=16)):
        bound = output.bind(ctx)
        if _expected(recs) is None:
            with pytest.raises(codec.MalformedRecordError) as info:
                bound.from_records(records(), np.empty, keys)
            assert info.value.index == damaged
        else:
            out = bound.from_records(records(), np.empty, keys)
            assert all(v.shape[0] == len(recs) for v in out.values())


def _rewrite_shard(path, damage) -> None:
    """Rewrite a shard through ArrayRecord (the dataset's writer options, its chunk index made anew)
    with ``damage(records)`` applied: the chunks' hashes are right, so only the codec can tell (a
    writer bug, or bytes damaged before they were written)."""
    reader = ArrayRecordReader(str(path))
    recs = reader.read(0, reader.num_records())
    reader.close()
    damage(recs)
    writer = ArrayRecordWriter(
        str(path), json.loads((path.parent / "manifest.json").read_text())["array_record"]["writer_options"]
    )
    for r in recs:
        writer.write(r)
    writer.close()
    np.save(path.parent / chunk_index_path(path.name), chunk_ranges(path, len(recs)))


def test_a_malformed_record_in_a_shard_names_the_shard_and_cell_in_every_reader(dataset_dir, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(dataset_dir, copy)

    def damage(recs):
        rec = bytearray(recs[37])
        rec[1] = 7  # an unknown index code
        recs[37] = bytes(rec)

    _rewrite_shard(copy / "shard-00001.arrayrecord", damage)
    cell = 1024 + 37
    expected = (
        rf"{copy}: shard shard-00001.arrayrecord: cell {cell} \(record 37\) cannot be read: "
        r"unknown index or value code; run `omicsio-materialize verify"
    )
    with oj.open_dataset(copy) as ds:
        ds.read_csr([0, 5])  # other cells read fine
        with pytest.raises(oj.DatasetFormatError, match=expected):
            ds.read_csr([3, cell])
        with pytest.raises(oj.DatasetFormatError, match=expected):
            oj.tokenize(ds, [cell, 2], oj.GeneformerTokens(max_len=32))
        for output in ("dense", "csr"):
            loader = oj.make_loader(ds, batch_size=ds.num_cells // 2, output=output, seed=0)
            with pytest.raises(oj.DatasetFormatError, match=expected):
                for _ in loader:
                    pass
        with pytest.raises(oj.DatasetFormatError, match=expected):
            oj.load_panel(ds, progress=False)


def test_a_truncated_shard_read_by_the_loader_names_the_shard(dataset_dir, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(dataset_dir, copy)
    shard = copy / "shard-00002.arrayrecord"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with oj.open_dataset(copy) as ds:
        loader = oj.make_loader(ds, batch_size=256, output="dense", seed=0)
        with pytest.raises(
            oj.DatasetFormatError,
            match=rf"{copy}: shard shard-00002.arrayrecord: .*"
            r"run `omicsio-materialize verify",
        ):
            for _ in loader:
                pass


def test_a_manifest_naming_a_file_outside_the_dataset_is_refused(dataset_dir, tmp_path):
    """An obs column's name is part of its file's path: a manifest whose obs name climbs out of the
    dataset (damaged, or not written by materialize) is refused, never read from outside it."""
    (tmp_path / "escape.npy").write_bytes(b"")  # what a read outside the dataset would find
    copy = tmp_path / "data" / "ds"
    shutil.copytree(dataset_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    entry = next(o for o in manifest["obs"] if o["kind"] == "numeric")
    entry["name"] = "../../escape"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with oj.open_dataset(copy) as ds:
        with pytest.raises(
            oj.DatasetFormatError, match=r"names the file 'obs/\.\./\.\./escape\.npy', outside the dataset"
        ):
            ds.obs["../../escape"]


def _numeric_and_categorical(ds) -> tuple[str, str]:
    kinds = {e.name: e.kind for e in ds.manifest.obs}
    return (
        next(n for n, k in kinds.items() if k == "numeric"),
        next(n for n, k in kinds.items() if k == "categorical"),
    )


def _read_listed_file(ds, relpath: str) -> tuple[int, int]:
    """Read the dataset's file ``relpath`` the way its users do: (rows read, rows it should hold)."""
    if relpath == "features.parquet":
        return len(ds.features), ds.num_genes
    if relpath == "cell_ids.parquet":
        return len(ds.cell_ids), ds.num_cells
    if relpath == "gene_stats.parquet":
        return len(ds.gene_stats), ds.num_genes
    if relpath.startswith("chunks/"):
        batch = next(iter(oj.make_loader(ds, batch_size=256, output="csr", seed=0)))
        return len(batch.index), 256
    return len(ds.obs[relpath.removeprefix("obs/").split(".")[0]]), ds.num_cells


def test_a_truncated_listed_file_is_refused_on_first_use_naming_it(dataset_dir, tmp_path):
    """Every file the manifest lists is checked against its size as it is first opened: one cut
    short (or grown) is a `DatasetFormatError` naming it and `verify`, never Arrow's or NumPy's own
    error nor values read short; whole again, it reads as before."""
    copy = tmp_path / "ds"
    shutil.copytree(dataset_dir, copy)
    with oj.open_dataset(copy) as ds:
        numeric, categorical = _numeric_and_categorical(ds)
        listed = {f.path for f in ds.manifest.files}
    relpaths = [
        "features.parquet",
        "cell_ids.parquet",
        "gene_stats.parquet",
        chunk_index_path("shard-00000.arrayrecord"),
        f"obs/{numeric}.npy",
        f"obs/{categorical}.codes.npy",
        f"obs/{categorical}.categories.json",
    ]
    assert set(relpaths) <= listed
    for relpath in relpaths:
        path = copy / relpath
        whole = path.read_bytes()
        for damaged in (whole[:-8], whole + b"\0" * 8):
            path.write_bytes(damaged)
            with oj.open_dataset(copy) as ds:
                with pytest.raises(
                    oj.DatasetFormatError,
                    match=rf"{copy}: its file {relpath} is damaged: {len(damaged):,} bytes, the manifest says "
                    rf"{len(whole):,}; run `omicsio-materialize verify {copy}`",
                ):
                    _read_listed_file(ds, relpath)
        path.write_bytes(whole)
    with oj.open_dataset(copy) as ds:  # whole again: read as before
        for relpath in relpaths:
            rows, expected = _read_listed_file(ds, relpath)
            assert rows == expected, relpath


def test_an_obs_sidecar_of_another_length_or_categories_is_refused(dataset_dir, tmp_path):
    """A sidecar replaced by one with other rows or other categories (a manifest listing no size for
    it, as one edited by hand would) is refused by its row count and its categories' count."""
    copy = tmp_path / "ds"
    shutil.copytree(dataset_dir, copy)
    with oj.open_dataset(copy) as ds:
        numeric, categorical = _numeric_and_categorical(ds)
        num_cells = ds.num_cells
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"] = [f for f in manifest["files"] if not f["path"].startswith("obs/")]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    np.save(copy / f"obs/{numeric}.npy", np.zeros(num_cells - 1))
    categories = copy / f"obs/{categorical}.categories.json"
    categories.write_text(json.dumps([*json.loads(categories.read_text()), "one more"]))
    with oj.open_dataset(copy) as ds:
        with pytest.raises(
            oj.DatasetFormatError,
            match=rf"obs/{numeric}\.npy is damaged: {num_cells - 1:,} rows, the dataset has {num_cells:,} cells",
        ):
            ds.obs[numeric]
        with pytest.raises(
            oj.DatasetFormatError, match=rf"obs/{categorical}\.categories\.json is damaged: \d+ categories, "
        ):
            ds.obs[categorical]


def test_a_missing_file_an_unreadable_table_or_sidecar_and_a_shard_named_out_of_place_are_refused(
    dataset_dir, tmp_path
):
    """Each a one-line `DatasetFormatError` naming the file and `verify` (or, for the manifest, what
    is wrong in it), not Python's, NumPy's or Arrow's own error: a listed file deleted; a gene table
    of another dataset (its row count); a sidecar whose header or JSON is not one; a manifest whose
    shards name each other's files (which served one shard's cells as another's)."""
    copy = tmp_path / "ds"
    shutil.copytree(dataset_dir, copy)
    with oj.open_dataset(copy) as ds:
        numeric, categorical = _numeric_and_categorical(ds)
    verify = rf"; run `omicsio-materialize verify {copy}`$"
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"] = [f for f in manifest["files"] if f["path"] != "features.parquet"]  # no size to check
    (copy / "manifest.json").write_text(json.dumps(manifest))
    cases = {
        "cell_ids.parquet": (None, r"its file cell_ids\.parquet, listed in the manifest, is missing"),
        "features.parquet": (b"not parquet", r"its file features\.parquet cannot be read \("),
        f"obs/{numeric}.npy": (
            lambda whole: re.sub(rb"'descr': '<.", b"'descr': '|O", whole, count=1),  # pickled objects
            rf"the obs sidecar obs/{numeric}\.npy is damaged: ",
        ),
        f"obs/{categorical}.categories.json": (
            lambda whole: whole[:-1] + b"x",
            rf"the obs sidecar obs/{categorical}\.categories\.json is damaged: not a JSON list of categories",
        ),
    }
    for relpath, (damage, said) in cases.items():
        path = copy / relpath
        whole = path.read_bytes()
        if damage is None:
            path.unlink()
        else:
            path.write_bytes(damage(whole) if callable(damage) else damage)
        with oj.open_dataset(copy) as ds, pytest.raises(oj.DatasetFormatError, match=f"{said}.*{verify}"):
            _read_listed_file(ds, relpath)
        path.write_bytes(whole)
    import pyarrow.parquet as pq

    genes = pq.read_table(copy / "features.parquet")  # another dataset's gene table: one gene fewer
    pq.write_table(genes.slice(1), copy / "features.parquet")
    with (
        oj.open_dataset(copy) as ds,
        pytest.raises(
            oj.DatasetFormatError,
            match=rf"its file features\.parquet has {genes.num_rows - 1:,} rows, the dataset {genes.num_rows:,} genes{verify}",
        ),
    ):
        _read_listed_file(ds, "features.parquet")
    pq.write_table(genes, copy / "features.parquet")
    shards = manifest["shards"]
    shards[0]["path"], shards[1]["path"] = shards[1]["path"], shards[0]["path"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        oj.DatasetFormatError,
        match=r"is malformed: shard 0 is 'shard-00001\.arrayrecord', not shard-00000\.arrayrecord$",
    ):
        oj.open_dataset(copy)


def test_categorical_codes_past_the_categories_are_refused_as_the_column_loads(dataset_dir, tmp_path):
    """Codes edited in place (the file's size kept) past the categories would reach a model as labels
    it has no class for; they are refused as the column loads, naming the sidecar."""
    copy = tmp_path / "ds"
    shutil.copytree(dataset_dir, copy)
    with oj.open_dataset(copy) as ds:
        _, categorical = _numeric_and_categorical(ds)
        count = len(ds.obs[categorical].categories)
    path = copy / f"obs/{categorical}.codes.npy"
    codes = np.load(path)
    for bad in (count, -2):
        damaged = codes.copy()
        damaged[7] = bad
        np.save(path, damaged)
        with (
            oj.open_dataset(copy) as ds,
            pytest.raises(
                oj.DatasetFormatError,
                match=rf"the obs sidecar obs/{categorical}\.codes\.npy is damaged: codes -?\d+\.\.\d+, where "
                rf"-1\.\.{count - 1} are a cell's categories; run `omicsio-materialize verify",
            ),
        ):
            oj.make_loader(ds, batch_size=64, obs=(categorical,))
    np.save(path, codes)
    with oj.open_dataset(copy) as ds:
        assert len(ds.obs[categorical].codes) == ds.num_cells
