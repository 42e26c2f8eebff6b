"""The record codec: exact round trips for every index/value code, and corruption detection."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from conftest import assert_csr_equal, streaming
from hypothesis import given, settings
from hypothesis import strategies as st

from omicsio_jax.core import kernels
from omicsio_jax.format import codec


@st.composite
def csr_batches(draw):
    """Random CSR rows: empty rows, huge column gaps (u32 indices), counts of every width, floats."""
    num_genes = draw(st.sampled_from([1, 7, 300, 65_536, 70_000, 200_000]))
    num_rows = draw(st.integers(0, 12))
    rows_idx, rows_val = [], []
    for _ in range(num_rows):
        cols = draw(st.lists(st.integers(0, num_genes - 1), max_size=40, unique=True))
        kind = draw(st.sampled_from(["u8", "u16", "u32", "float", "mixed"]))
        n = len(cols)
        if kind == "u8":
            vals = draw(st.lists(st.integers(0, 255), min_size=n, max_size=n))
        elif kind == "u16":
            vals = draw(st.lists(st.integers(0, 65_535), min_size=n, max_size=n))
        elif kind == "u32":
            # float32 holds integers exactly up to 2**24; above that only some
            vals = draw(st.lists(st.integers(0, 2**24), min_size=n, max_size=n))
        else:
            floats = st.floats(width=32, allow_nan=False, allow_infinity=False)
            vals = draw(
                st.lists(
                    floats if kind == "float" else st.one_of(floats, st.integers(0, 300)),
                    min_size=n,
                    max_size=n,
                )
            )
        rows_idx.append(sorted(cols))
        rows_val.append(vals)
    indptr = np.zeros(num_rows + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(r) for r in rows_idx])
    indices = np.array([c for r in rows_idx for c in r], dtype=np.int32)
    values = np.array([v for r in rows_val for v in r], dtype=np.float32)
    return indptr, indices, values


@given(csr_batches())
@settings(max_examples=200, deadline=None)
def test_sparse_round_trip_is_exact(batch):
    buf, starts = codec.encode_csr(*batch)
    assert all(s % 4 == 0 for s in starts)
    records = [buf[starts[i] : starts[i + 1]].tobytes() for i in range(len(starts) - 1)]
    assert_csr_equal(codec.decode_csr(codec.Records.of(records, 200_000)), batch)


def _reference_record(cols: list[int], values: list[float]) -> bytes:
    """One record as the module docstring specifies it, in plain Python: the narrowest codes, gaps and
    16-bit values as two byte planes, every field zero-padded to 4 bytes."""
    f32 = np.array(values, np.float32)
    exact = all(v.view(np.uint32) >> 31 == 0 and float(v) == int(v) < 2**32 for v in f32 if np.isfinite(v))
    top = float(f32.max()) if len(f32) else 0.0
    vc = codec.VALUE_F32 if not exact else 1 if top <= 255 else 2 if top <= 65_535 else 3
    gaps = np.diff([0, *cols])
    ic = codec.INDEX_DELTA_U16 if len(gaps) == 0 or gaps.max() <= 65_535 else codec.INDEX_U32

    def planes(ints):  # little-endian u16s as a low-byte plane then a high-byte plane
        return bytes(x & 0xFF for x in ints) + bytes(x >> 8 for x in ints)

    def pad(b):
        return b + bytes(-len(b) % 4)

    n = len(cols)
    index = planes([int(g) for g in gaps]) if ic == codec.INDEX_DELTA_U16 else np.array(cols, "<u4").tobytes()
    if vc == 1:
        body = bytes(int(v) for v in f32)
    elif vc == 2:
        body = planes([int(v) for v in f32])
    elif vc == 3:
        body = np.array([int(v) for v in f32], "<u4").tobytes()
    else:
        body = f32.astype("<f4").tobytes()
    return bytes([codec.CODEC_VERSION, ic, vc, 0]) + n.to_bytes(4, "little") + pad(index) + pad(body)


@given(csr_batches(), st.sampled_from(["identity", "shifted", "looked up"]), st.booleans())
@settings(max_examples=200, deadline=None)
def test_records_are_the_specified_bytes(batch, mapping, wide_values):
    """The encoder's bytes are the format's, whether columns are the tokens, the tokens shifted (an
    offset gene table) or looked up, and whatever the width of the input values."""
    indptr, cols, values = batch
    num_genes = 200_000
    if mapping == "identity":
        tokens, token_to_col = cols, np.arange(num_genes, dtype=np.int32)
    elif mapping == "shifted":
        tokens, token_to_col = cols + 3, np.concatenate([[-1, -1, -1], np.arange(num_genes)]).astype(np.int32)
    else:  # every other token unknown: columns are looked up
        tokens = cols * 2
        token_to_col = np.full(2 * num_genes, -1, np.int32)
        token_to_col[::2] = np.arange(num_genes)
    buf, starts = codec.encode_csr(
        indptr, tokens, values.astype(np.float64) if wide_values else values, token_to_col=token_to_col
    )
    expected = [
        _reference_record(cols[a:b].tolist(), values[a:b].tolist())
        for a, b in zip(indptr[:-1], indptr[1:], strict=True)
    ]
    assert [buf[a:b].tobytes() for a, b in zip(starts[:-1], starts[1:], strict=True)] == expected


def test_records_are_encoded_into_the_buffer_given():
    indptr = np.array([0, 2, 3], dtype=np.int64)
    tokens, values = np.array([1, 4, 2], np.int32), np.array([3, 1, 0.5], np.float32)
    given = np.full(64, 0xAB, np.uint8)
    buf, starts = codec.encode_csr(indptr, tokens, values, out=lambda n: given[:n])
    assert buf.ctypes.data == given.ctypes.data and (given[starts[-1] :] == 0xAB).all()
    assert buf.tobytes() == codec.encode_csr(indptr, tokens, values)[0].tobytes()
    with pytest.raises(ValueError, match="must give a 4-aligned uint8 array"):
        codec.encode_csr(indptr, tokens, values, out=lambda n: given[1 : n + 1])


@given(
    st.integers(1, 9),
    st.integers(1, 70),
    st.sampled_from(["counts", "big", "float"]),
    st.integers(0, 2**32 - 1),
)
@settings(max_examples=100, deadline=None)
def test_dense_round_trip_is_exact(num_rows, width, kind, seed):
    rng = np.random.default_rng(seed)
    dense = rng.geometric(0.3, (num_rows, width)).astype(np.float32) * (rng.random((num_rows, width)) < 0.4)
    if kind == "big":
        dense *= 5000
    elif kind == "float":
        dense *= rng.normal(size=(num_rows, width)).astype(np.float32)
    buf, starts = codec.encode_dense_rows(dense)
    indptr, indices, values = codec.decode_csr(codec.Records.check(buf, starts, width))
    rows, cols = np.nonzero(dense)
    np.testing.assert_array_equal(indices, cols)
    np.testing.assert_array_equal(values, dense[rows, cols])
    np.testing.assert_array_equal(np.diff(indptr), np.count_nonzero(dense, axis=1))


def test_narrowest_lossless_codes_are_chosen():
    indptr = np.array([0, 2, 4, 6, 8, 10], dtype=np.int64)
    indices = np.array([0, 5, 1, 70_000, 3, 4, 0, 1, 2, 3], dtype=np.int32)
    values = np.array([1, 200, 1, 2, 300, 1, 70_000, 1, 0.5, 1], dtype=np.float32)
    identity = np.arange(70_001, dtype=np.int32)
    index_codes, value_codes, nbytes, problems, _ = codec.plan_sparse(
        indptr, indices, values, identity, False
    )
    assert problems.tolist() == [0] * 5
    assert index_codes.tolist() == [1, 2, 1, 1, 1]
    assert value_codes.tolist() == [1, 1, 2, 3, 0]
    assert (nbytes % 4 == 0).all()


def test_negative_zero_is_kept_bit_exact():
    indptr = np.array([0, 2], dtype=np.int64)
    values = np.array([-0.0, 3.0], dtype=np.float32)
    buf, starts = codec.encode_csr(indptr, np.array([1, 2], dtype=np.int32), values)
    _, _, decoded = codec.decode_csr(codec.Records.check(buf, starts, 3))
    assert decoded.view(np.uint32).tolist() == values.view(np.uint32).tolist()


def test_empty_batch_and_empty_rows():
    indptr = np.zeros(4, dtype=np.int64)
    buf, starts = codec.encode_csr(indptr, np.zeros(0, np.int32), np.zeros(0, np.float32))
    assert np.diff(starts).tolist() == [codec.HEADER_BYTES] * 3
    out = codec.decode_csr(codec.Records.check(buf, starts, 1))
    assert_csr_equal(out, (indptr, np.zeros(0, np.int32), np.zeros(0, np.float32)))


def test_corrupted_header_is_detected():
    indptr = np.array([0, 3], dtype=np.int64)
    buf, starts = codec.encode_csr(indptr, np.array([1, 2, 9], np.int32), np.array([1, 2, 3], np.float32))
    bad = buf.copy()
    bad[4] ^= 0x01  # the stored length no longer matches the record size
    with pytest.raises(codec.MalformedRecordError, match="record 0 of the batch is malformed"):
        codec.decode_csr(codec.Records.check(bad, starts, 10))
    bad = buf.copy()
    bad[0] = 99  # unknown codec version
    with pytest.raises(codec.MalformedRecordError, match="unknown codec version"):
        codec.decode_csr(codec.Records.check(bad, starts, 10))
    with pytest.raises(
        codec.MalformedRecordError, match="not strictly ascending within the dataset's columns"
    ):
        codec.decode_csr(codec.Records.check(buf, starts, 9))  # column 9 is past a 9-column dataset


@pytest.mark.parametrize(
    "tokens,values,problem",
    [
        ([3, 1], [1, 1], codec.ROW_UNSORTED),
        ([1, 1], [1, 1], codec.ROW_DUPLICATE),
        ([1, 9], [1, 1], codec.ROW_UNKNOWN_GENE),
        ([1, 2], [np.nan, 1], codec.ROW_NOT_FINITE),
        ([1, 2], [1, -np.inf], codec.ROW_NOT_FINITE),
        ([1, 2], [1, -2], codec.ROW_NEGATIVE),
        ([1, 2], [1, 1e39], codec.ROW_OVERFLOW),
    ],
)
def test_invalid_rows_are_refused_with_their_position(tokens, values, problem):
    indptr = np.array([0, 1, 1 + len(tokens)], dtype=np.int64)
    tokens = np.array([0, *tokens], dtype=np.int64)
    values = np.array([1, *values], dtype=np.float64)
    token_to_col = np.array([0, 1, 2, 3, -1, -1, -1, -1, -1, -1], dtype=np.int32)
    with pytest.raises(codec.InvalidRowError) as info:
        codec.encode_csr(indptr, tokens, values, token_to_col=token_to_col, allow_negative=False)
    assert (info.value.row, info.value.problem) == (1, problem)
    assert info.value.position in (1, 2)


def test_tokens_are_mapped_to_columns_and_float64_narrowed():
    indptr = np.array([0, 3], dtype=np.int64)
    tokens = np.array([10, 20, 30], dtype=np.int64)
    token_to_col = np.full(31, -1, dtype=np.int32)
    token_to_col[[10, 20, 30]] = [0, 1, 2]
    buf, starts = codec.encode_csr(indptr, tokens, np.array([1.5, 2.0, 3.0]), token_to_col=token_to_col)
    assert_csr_equal(
        codec.decode_csr(codec.Records.check(buf, starts, 3)),
        (indptr, [0, 1, 2], np.array([1.5, 2, 3], np.float32)),
    )


def test_encoding_is_deterministic_padding_included():
    # Odd nonzero counts leave padding after the u16 indices and u8 values: it must be zeroed,
    # or the same cells would give different shard bytes (and checksums) run to run.
    indptr = np.array([0, 1, 4], dtype=np.int64)
    tokens = np.array([5, 1, 2, 3], dtype=np.int32)
    values = np.array([7, 1, 2, 3], dtype=np.float32)
    first, _ = codec.encode_csr(indptr, tokens, values)
    np.empty(1 << 16, np.uint8).fill(0xAB)  # dirty the allocator's free memory
    second, _ = codec.encode_csr(indptr, tokens, values)
    assert first.tobytes() == second.tobytes()
    assert first[8 + 2 : 8 + 4].tolist() == [0, 0]  # index padding of row 0


def test_decode_rows_and_slabs_match_csr():
    rng = np.random.default_rng(0)
    dense = (rng.geometric(0.4, (10, 300)) * (rng.random((10, 300)) < 0.2)).astype(np.float32)
    dense[3] = 0  # an empty row
    indptr = np.concatenate([[0], np.cumsum((dense != 0).sum(1))]).astype(np.int64)
    rows, cols = np.nonzero(dense)
    buf, starts = codec.encode_csr(indptr, cols.astype(np.int32), dense[rows, cols])
    out = np.full((12, 300), 7.0, np.float32)  # dirty, and two padding rows
    codec.decode_rows(codec.Records.check(buf, starts, 300), out)
    np.testing.assert_array_equal(out[:10], dense)
    assert not out[10:].any()
    row_ids, idx, val = codec.decode_slabs(
        codec.Records.check(buf, starts, 300), num_rows=12, num_slabs=3, capacity=400, num_columns=300
    )
    rebuilt = np.zeros((12, 300), np.float32)
    for s in range(3):
        np.add.at(rebuilt, (s * 4 + row_ids[s], idx[s]), val[s])
    np.testing.assert_array_equal(rebuilt[:10], dense)
    assert (row_ids.dtype, idx.dtype) == (np.int16, np.uint16)  # the narrowest that hold them
    wide = codec.decode_slabs(
        codec.Records.check(buf, starts, 300), num_rows=12, num_slabs=3, capacity=400, num_columns=70_000
    )
    assert wide[1].dtype == np.int32
    np.testing.assert_array_equal(wide[1], idx)
    dense_buf, dense_starts = codec.encode_dense_rows(dense[:, :40])
    narrow = np.zeros((10, 40), np.float32)
    dense_records = codec.Records.check(dense_buf, dense_starts, 40)
    np.testing.assert_array_equal(codec.decode_rows(dense_records, narrow), dense[:, :40])
    with pytest.raises(codec.MalformedRecordError, match="a dense record of the wrong width"):
        codec.Records.check(dense_buf, dense_starts, 39)
    with pytest.raises(codec.MalformedRecordError, match="a dense record of the wrong width"):
        codec.decode_rows(dense_records, np.zeros((10, 39), np.float32))  # checked again: 39 columns
    with pytest.raises(ValueError, match="pass nnz_capacity >= "):
        codec.decode_slabs(
            codec.Records.check(buf, starts, 300), num_rows=12, num_slabs=3, capacity=5, num_columns=300
        )


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_streamed_around_the_caches_are_the_rows_written_in_place(threads):
    """Dense rows built in a cached scratch row and streamed out equal rows zeroed and written in
    place, for every index code, padding rows and an output not aligned to a cache line; the
    scratch rows are zeros again after (the next batch builds on them)."""
    rng = np.random.default_rng(3)
    width = 70_000  # u16 gaps and, for the row with a gap past 65,535, u32 columns
    lengths = [0, 1, 1500, 40, 2]
    cols = [np.sort(rng.choice(width, n, replace=False)) for n in lengths]
    cols[4] = np.array([3, 69_999])
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = rng.integers(1, 300, indptr[-1]).astype(np.float32)
    values[:10] += 0.5  # float values in some rows
    buf, starts = codec.encode_csr(indptr, np.concatenate(cols).astype(np.int32), values)
    dense = np.zeros((len(lengths), width), np.float32)
    dense[np.repeat(np.arange(len(lengths)), lengths), np.concatenate(cols)] = values
    panel = rng.integers(0, 500, (6, 33)).astype(np.float32)
    panel_buf, panel_starts = codec.encode_dense_rows(panel)
    previous = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        for records, expected in (((buf, starts), dense), ((panel_buf, panel_starts), panel)):
            rows, cols_out = expected.shape[0] + 3, expected.shape[1]  # 3 padding rows
            raw = np.full(rows * cols_out + 1, 7.0, np.float32)
            out = raw[1:].reshape(rows, cols_out)  # 4 bytes past an aligned start
            assert out.ctypes.data % 64 != 0
            with streaming(0):
                assert kernels.rows_scratch(out).shape[1] >= cols_out
                codec.decode_rows(codec.Records.check(*records, cols_out), out)
                scratch = kernels.rows_scratch(out)
            np.testing.assert_array_equal(out[: len(expected)], expected)
            assert not out[len(expected) :].any()
            assert raw[0] == 7.0  # nothing written before the output
            assert not scratch.any()
            in_place = codec.decode_rows(
                codec.Records.check(*records, cols_out), np.full((rows, cols_out), 7.0, np.float32)
            )
            np.testing.assert_array_equal(out, in_place)
    finally:
        numba.set_num_threads(previous)


def test_batches_larger_than_a_cache_are_streamed_and_others_written_in_place(monkeypatch):
    """A dense batch of 1,024 cells over 62,710 genes (257 MB) is streamed on x86-64; one of 64 cells
    (16 MB) where this process's share of the cache does not hold two of them (`cache_reach`, or a
    threshold fixed by ``$OMICSIO_JAX_STREAM_MIN_BYTES``), one of 1 MB never; every batch is written
    in place elsewhere."""
    big, small = np.empty((1024, 62_710), np.float32), np.empty((64, 62_710), np.float32)
    tiny = np.empty((4, 62_710), np.float32)
    wide = kernels.rows_scratch(big).shape[1]
    assert wide >= 62_710 if kernels.STREAMING else wide == 0
    threshold = kernels.stream_threshold(wait=True)
    assert kernels.STREAM_PROBE_MIN_BYTES <= threshold <= kernels.STREAM_MIN_BYTES
    assert kernels.streamed(small) == (kernels.STREAMING and small.nbytes >= threshold)
    assert kernels.rows_scratch(tiny).shape[1] == 0
    monkeypatch.setenv(kernels.STREAM_ENV, str(kernels.STREAM_MIN_BYTES))
    assert kernels.rows_scratch(small).shape[1] == 0
    monkeypatch.setenv(kernels.STREAM_ENV, "0")
    assert kernels.streamed(tiny) == kernels.STREAMING
    monkeypatch.delenv(kernels.STREAM_ENV)
    with streaming(0):  # every size, but only rows whose lines `stream_row` may write whole
        assert kernels.streamed(small) == kernels.STREAMING
        assert not kernels.streamed(small[:, ::2])
        assert not kernels.streamed(np.frombuffer(bytes(4 * 1001), np.uint8)[1:-3].view(np.float32))


def test_the_stream_threshold_follows_where_a_pair_of_buffers_leaves_the_cache():
    """Outputs larger than the last size whose pair of buffers filled at half the rate of the fastest
    smaller pair or more are streamed (never below `STREAM_PROBE_MIN_BYTES`); if every size filled
    that fast, only outputs of `STREAM_MIN_BYTES` and more."""
    mib = 1 << 20
    sizes = (1 * mib, 4 * mib, 8 * mib, 16 * mib)
    everywhere_fast = dict(zip(sizes, (70.0, 68.0, 60.0, 40.0), strict=True))
    assert kernels.threshold_from_rates(everywhere_fast) == kernels.STREAM_MIN_BYTES
    slow_from_16 = dict(zip(sizes, (70.0, 68.0, 60.0, 16.0), strict=True))
    assert kernels.threshold_from_rates(slow_from_16) == 8 * mib + 1
    slow_from_8 = dict(zip(sizes, (70.0, 68.0, 20.0, 16.0), strict=True))
    assert kernels.threshold_from_rates(slow_from_8) == 4 * mib + 1
    slow_from_4 = dict(zip(sizes, (70.0, 20.0, 60.0, 16.0), strict=True))
    assert kernels.threshold_from_rates(slow_from_4) == kernels.STREAM_PROBE_MIN_BYTES
    slow_reference = dict(zip(sizes, (20.0, 40.0, 15.0, 10.0), strict=True))  # 1 MiB: a call's cost
    assert kernels.threshold_from_rates(slow_reference) == 4 * mib + 1
    assert kernels.STREAM_PROBE_MIN_BYTES <= kernels.cache_reach() <= kernels.STREAM_MIN_BYTES
