"""Scatter kernels against plain numpy references: every normalize mode, panels, padding, devices."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import streaming
from hypothesis import given, settings
from hypothesis import strategies as st

import omicsio_jax as oj
from omicsio_jax.core import kernels
from omicsio_jax.format import codec
from omicsio_jax.outputs import scatter

MODES = [None, "log1p", "normalize_log1p"]


@st.composite
def csr_batches(draw, widths=(1, 7, 300, 70_000), max_rows=10, duplicates=False, min_float=0.0):
    """Random CSR rows: empty rows, single entries, explicit zeros, counts and floats; 0 rows too."""
    num_genes = draw(st.sampled_from(widths))
    num_rows = draw(st.integers(0, max_rows))
    counts = st.integers(0, 5000).map(float)
    floats = st.floats(min_float, 1e4, width=32, allow_subnormal=False)
    cols, vals, lengths = [], [], []
    for _ in range(num_rows):
        size = draw(st.sampled_from([0, 1, 1, 2, 30]))
        row = draw(
            st.lists(
                st.integers(0, num_genes - 1), min_size=min(size, 1), max_size=size, unique=not duplicates
            )
        )
        cols += row if duplicates else sorted(row)
        vals += draw(st.lists(st.one_of(counts, floats), min_size=len(row), max_size=len(row)))
        lengths.append(len(row))
    indptr = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    return indptr, np.array(cols, np.int32), np.array(vals, np.float32), num_genes


def ref_values(indptr, values, normalize, target_sum=1e4):
    """Each entry transformed as documented, in float32 (totals summed in float64, rounded once)."""
    out = values.copy()
    for i in range(len(indptr) - 1):
        v = values[indptr[i] : indptr[i + 1]]
        if normalize == "log1p":
            out[indptr[i] : indptr[i + 1]] = np.log1p(v)
        elif normalize == "normalize_log1p":
            total = np.float32(v.astype(np.float64).sum())
            total = np.float32(np.inf) if total == 0 else total
            out[indptr[i] : indptr[i + 1]] = np.log1p(v / total * np.float32(target_sum))
    return out


def ref_dense(indptr, indices, values, num_genes, normalize=None, target_sum=1e4):
    dense = np.zeros((len(indptr) - 1, num_genes), np.float32)
    rows = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    np.add.at(dense, (rows, indices), ref_values(indptr, values, normalize, target_sum))
    return dense


def dirty(shape):
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 1e6


@given(csr_batches(), st.sampled_from(MODES), st.sampled_from([1e4, 1.0, 1e6]), st.booleans(), st.booleans())
@settings(max_examples=50, deadline=None)
def test_scatter_dense_matches_numpy(batch, normalize, target_sum, reuse, streamed):
    """Rows written in place or built in a scratch row and streamed out (`kernels.rows_scratch`)."""
    indptr, indices, values, num_genes = batch
    out = dirty((len(indptr) - 1, num_genes)) if reuse else None
    with streaming(0 if streamed else kernels.STREAM_MIN_BYTES):
        got = scatter.scatter_dense(
            indptr, indices, values, num_genes, out=out, normalize=normalize, target_sum=target_sum
        )
        assert not kernels.rows_scratch(got).any()
    assert got.shape == (len(indptr) - 1, num_genes) and got.dtype == np.float32
    if reuse:
        assert got is out
    np.testing.assert_allclose(
        got, ref_dense(indptr, indices, values, num_genes, normalize, target_sum), rtol=1e-6, atol=0
    )


@given(csr_batches(widths=(1, 7, 300), duplicates=True), st.booleans())
@settings(max_examples=50, deadline=None)
def test_scatter_dense_adds_repeated_columns(batch, streamed):
    indptr, indices, values, num_genes = batch
    with streaming(0 if streamed else kernels.STREAM_MIN_BYTES):
        got = scatter.scatter_dense(
            indptr, indices, values, num_genes, out=dirty((len(indptr) - 1, num_genes))
        )
        assert not kernels.rows_scratch(got).any()
    np.testing.assert_allclose(got, ref_dense(indptr, indices, values, num_genes), rtol=1e-6, atol=0)


@given(csr_batches(widths=(7, 300)))
@settings(max_examples=50, deadline=None)
def test_normalize_log1p_is_scanpy_normalize_total_then_log1p(batch):
    """The fused float32 transform agrees with normalize_total + log1p done in float64."""
    indptr, indices, values, num_genes = batch
    x = ref_dense(indptr, indices, values, num_genes).astype(np.float64)
    totals = x.sum(axis=1, keepdims=True)
    expected = np.log1p(np.divide(x, totals / 1e4, out=np.zeros_like(x), where=totals > 0))
    got = scatter.scatter_dense(indptr, indices, values, num_genes, normalize="normalize_log1p")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@given(
    csr_batches(),
    st.sampled_from(["none", "some", "all"]),
    st.sampled_from(MODES),
    st.booleans(),
    st.booleans(),
    st.data(),
)
@settings(max_examples=50, deadline=None)
def test_scatter_panel_matches_dense_then_subset(batch, which, normalize, reuse, streamed, data):
    indptr, indices, values, num_genes = batch
    if which == "all":
        big = num_genes > 1000
        panel = np.arange(num_genes)[::-1] if big else data.draw(st.permutations(range(num_genes)))
    else:
        size = 0 if which == "none" else data.draw(st.integers(1, min(num_genes, 50)))
        panel = data.draw(st.lists(st.integers(0, num_genes - 1), min_size=size, max_size=size, unique=True))
    gene_to_col = scatter.make_gene_to_col(num_genes, panel)
    out = dirty((len(indptr) - 1, len(panel))) if reuse else None
    with streaming(0 if streamed else kernels.STREAM_MIN_BYTES):
        got = scatter.scatter_panel(indptr, indices, values, gene_to_col, out=out, normalize=normalize)
        assert not kernels.rows_scratch(got).any()
    expected = ref_dense(indptr, indices, values, num_genes, normalize)[:, np.asarray(panel, np.int64)]
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)


@given(
    csr_batches(widths=(1, 7, 300, 70_000)),
    st.sampled_from(MODES),
    st.sampled_from(["full", "panel"]),
    st.booleans(),
    st.integers(0, 3),
    st.booleans(),
    st.data(),
)
@settings(max_examples=60, deadline=None)
def test_decode_scatter_is_decode_csr_then_scatter(
    batch, normalize, columns, dense_layout, padding, streamed, data
):
    """The loader's one-pass records → rows equals decoding to CSR and scattering, bit for bit,
    with the rows written in place or built in a scratch row and streamed out (`kernels.rows_scratch`)."""
    indptr, indices, values, num_genes = batch
    if dense_layout:  # records of a dense-layout (gene panel) dataset
        if num_genes > 1000:
            return
        buf, starts = codec.encode_dense_rows(ref_dense(indptr, indices, values, num_genes))
    else:
        buf, starts = codec.encode_csr(indptr, indices, values)
    gene_to_col = None
    if columns == "panel":
        size = data.draw(st.integers(0, min(num_genes, 40)))
        panel = data.draw(st.lists(st.integers(0, num_genes - 1), min_size=size, max_size=size, unique=True))
        gene_to_col = scatter.make_gene_to_col(num_genes, panel)
    width = num_genes if gene_to_col is None else len(panel)
    rows = len(indptr) - 1 + padding
    with streaming(0 if streamed else kernels.STREAM_MIN_BYTES):
        got = scatter.decode_scatter(
            codec.Records.check(buf, starts, num_genes),
            dirty((rows, width)),
            gene_to_col=gene_to_col,
            normalize=normalize,
        )
        assert not kernels.rows_scratch(got).any()  # left zero for the next batch
    ptr, idx, val = codec.decode_csr(codec.Records.check(buf, starts, num_genes))
    ptr = np.concatenate([ptr, np.full(padding, ptr[-1])])
    if gene_to_col is None:
        expected = scatter.scatter_dense(ptr, idx, val, num_genes, normalize=normalize)
    else:
        expected = scatter.scatter_panel(
            ptr, idx, val, gene_to_col, out=np.empty((rows, width), np.float32), normalize=normalize
        )
    np.testing.assert_array_equal(got, expected)
    assert not got[len(indptr) - 1 :].any()


def test_decode_scatter_refuses_a_malformed_record():
    buf, starts = codec.encode_csr(
        np.array([0, 2], np.int64), np.array([1, 3], np.int32), np.array([1.0, 2.0], np.float32)
    )
    good, buf[1] = buf[1], 9  # an unknown index code
    with pytest.raises(ValueError, match="record 0 of the batch is malformed"):
        codec.Records.check(buf, starts, 5)
    buf[1] = good  # columns 1 and 3: fine for 5 columns, and checked again for an output of 3
    records = codec.Records.check(buf, starts, 5)
    with pytest.raises(ValueError, match="record 0 of the batch is malformed"):
        scatter.decode_scatter(records, np.empty((1, 3), np.float32), normalize="log1p")


def test_make_gene_to_col():
    np.testing.assert_array_equal(scatter.make_gene_to_col(5, [3, 0]), [1, -1, -1, 0, -1])
    assert scatter.make_gene_to_col(4, []).tolist() == [-1] * 4
    with pytest.raises(ValueError, match=r"repeats genes \[2\]"):
        scatter.make_gene_to_col(5, [2, 1, 2])
    with pytest.raises(ValueError, match=r"\[0, 5\).*0 \.\. 5"):
        scatter.make_gene_to_col(5, [0, 5])


@given(csr_batches(duplicates=True), st.integers(0, 40), st.booleans())
@settings(max_examples=50, deadline=None)
def test_pad_csr_round_trip(batch, slack, reuse):
    indptr, indices, values, num_genes = batch
    nnz = int(indptr[-1])
    capacity = nnz + slack
    out = None
    if reuse:
        out = tuple(np.full(capacity, 7, dtype) for dtype in (np.int32, np.int32, np.float32))
    row_ids, cols, vals, got_nnz = scatter.pad_csr(indptr, indices, values, capacity=capacity, out=out)
    assert got_nnz == nnz
    assert (row_ids.dtype, cols.dtype, vals.dtype) == (np.int32, np.int32, np.float32)
    assert row_ids.shape == cols.shape == vals.shape == (capacity,)
    np.testing.assert_array_equal(row_ids[:nnz], np.repeat(np.arange(len(indptr) - 1), np.diff(indptr)))
    np.testing.assert_array_equal(cols[:nnz], indices)
    np.testing.assert_array_equal(vals[:nnz], values)
    assert not row_ids[nnz:].any() and not cols[nnz:].any() and not vals[nnz:].any()


def test_pad_csr_overflow_and_slices():
    indptr = np.array([0, 3, 5], np.int64)
    indices, values = np.arange(5, dtype=np.int32), np.arange(1, 6, dtype=np.float32)
    with pytest.raises(ValueError, match=r"nnz=5 .* capacity is 4: raise nnz_capacity to 5\+"):
        scatter.pad_csr(indptr, indices, values, capacity=4)
    row_ids, cols, vals, nnz = scatter.pad_csr(indptr[1:], indices, values, capacity=3)  # a slice of a CSR
    assert nnz == 2 and row_ids.tolist() == [0, 0, 0]
    assert cols.tolist() == [3, 4, 0] and vals.tolist() == [4, 5, 0]


@given(csr_batches(widths=(1, 7, 300, 70_000), max_rows=8), st.sampled_from(MODES))
@settings(max_examples=50, deadline=None)
def test_densify_on_device_matches_numpy(batch, normalize):
    indptr, indices, values, num_genes = batch
    row_ids, cols, vals, _ = scatter.pad_csr(indptr, indices, values, capacity=256)
    got = np.asarray(
        scatter.densify_on_device(row_ids, cols, vals, num_rows=8, num_genes=num_genes, normalize=normalize)
    )
    expected = np.zeros((8, num_genes), np.float32)
    expected[: len(indptr) - 1] = ref_dense(indptr, indices, values, num_genes, normalize)
    # float32 totals on device; XLA on CPU flushes subnormal results to zero
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-30)


def test_densify_on_device_drops_padding_and_stored_zeros_bit_for_bit():
    """Entries of value 0 (a slab's padding, a stored 0) are routed past the last row and dropped: the
    dense rows are those of adding every entry where it stands, bit for bit, also at (0, 0)."""
    rng = np.random.default_rng(7)
    rows = np.sort(rng.integers(0, 6, 40)).astype(np.int32)
    cols = rng.integers(0, 50, 40).astype(np.int32)
    vals = rng.gamma(1.0, 3.0, 40).astype(np.float32)
    rows[0], cols[0] = 0, 0  # a real value where the padding pointed
    vals[[3, 17]] = 0.0  # stored zeros
    pad = np.zeros(24, np.int32)
    row_ids, indices = np.concatenate([rows, pad]), np.concatenate([cols, pad])
    values = np.concatenate([vals, np.zeros(24, np.float32)])
    for normalize in MODES:
        norm = oj.Normalization(normalize)
        everywhere = (
            jnp.zeros((6, 50), jnp.float32).at[row_ids, indices].add(norm.apply_entries(values, row_ids, 6))
        )
        got = scatter.densify_on_device(
            row_ids, indices, values, num_rows=6, num_genes=50, normalize=normalize
        )
        np.testing.assert_array_equal(np.asarray(got), np.asarray(everywhere))
        assert np.asarray(got)[0, 0] > 0


def test_densify_on_device_edges():
    empty = np.zeros(4, np.int32), np.zeros(4, np.int32), np.zeros(4, np.float32)
    for normalize in MODES:
        got = scatter.densify_on_device(*empty, num_rows=0, num_genes=5, normalize=normalize)
        assert got.shape == (0, 5)
        got = scatter.densify_on_device(*empty, num_rows=3, num_genes=5, normalize=normalize)
        assert got.dtype == np.float32 and not np.asarray(got).any()
    with pytest.raises(ValueError, match="normalize='log2'"):
        scatter.densify_on_device(*empty, num_rows=3, num_genes=5, normalize="log2")


def test_zero_rows_and_zero_nnz():
    indptr0, no_idx, no_val = np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32)
    for normalize in MODES:
        got = scatter.scatter_dense(indptr0, no_idx, no_val, 70_000, normalize=normalize)
        assert got.shape == (0, 70_000)
        empty_rows = np.zeros(4, np.int64)
        got = scatter.scatter_dense(empty_rows, no_idx, no_val, 6, out=dirty((3, 6)), normalize=normalize)
        assert not got.any()
        no_panel = np.full(6, -1, np.int32)
        got = scatter.scatter_panel(empty_rows, no_idx, no_val, no_panel, normalize=normalize)
        assert got.shape == (3, 0)
    assert scatter.pad_csr(indptr0, no_idx, no_val, capacity=0)[3] == 0


def test_bad_input_is_reported():
    indptr, indices = np.array([0, 1, 2], np.int64), np.array([1, 9], np.int32)
    values = np.ones(2, np.float32)
    with pytest.raises(ValueError, match=r"indices\[1\] = 9 \(row 1\) is outside \[0, 5\)"):
        scatter.scatter_dense(indptr, indices, values, 5)
    with pytest.raises(ValueError, match=r"indices\[1\] = 9 \(row 1\) is outside \[0, 5\)"):
        scatter.scatter_panel(indptr, indices, values, scatter.make_gene_to_col(5, [1]))
    with pytest.raises(TypeError, match=r"indices must be a 1-D int32 array, got int64 array"):
        scatter.scatter_dense(indptr, indices.astype(np.int64), values, 10)
    with pytest.raises(ValueError, match="non-decreasing"):
        scatter.scatter_dense(np.array([0, 2, 1], np.int64), indices, values, 10)
    with pytest.raises(ValueError, match=r"shape \(2, 10\)"):
        scatter.scatter_dense(indptr, indices, values, 10, out=np.zeros((2, 9), np.float32))
    with pytest.raises(ValueError, match="normalize='log2'"):
        scatter.scatter_dense(indptr, indices, values, 10, normalize="log2")
    with pytest.raises(ValueError, match=r"target_sum=0 must be a positive"):
        scatter.scatter_panel(indptr, indices, values, np.zeros(10, np.int32), target_sum=0)
    with pytest.raises(ValueError, match=r"gene_to_col must hold -1 or columns in \[0, 1\)"):
        scatter.scatter_panel(
            indptr, indices, values, np.array([0, 1] * 5, np.int32), out=np.zeros((2, 1), np.float32)
        )
