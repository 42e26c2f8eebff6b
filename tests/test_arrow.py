"""Arrow list columns → CSR: sliced arrays, chunked arrays, null lists, every list flavour."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from omicsio_jax.format.arrow import list_to_csr

ROWS = [[1, 2], None, [3], [], [4, 5, 6]]


def _reference(rows):
    lengths = [0 if r is None else len(r) for r in rows]
    return np.concatenate([[0], np.cumsum(lengths)]), [v for r in rows if r for v in r]


@pytest.mark.parametrize(
    "list_type",
    [
        pa.list_(pa.int32()),
        pa.large_list(pa.int32()),
        pa.list_view(pa.int32()),
        pa.large_list_view(pa.int32()),
    ],
)
def test_every_list_flavour(list_type):
    indptr, values = list_to_csr(pa.array(ROWS, list_type))
    ref_ptr, ref_values = _reference(ROWS)
    np.testing.assert_array_equal(indptr, ref_ptr)
    assert values.to_pylist() == ref_values


@pytest.mark.parametrize("start,stop", [(1, 5), (2, 4), (3, 3), (0, 1)])
def test_sliced_array_offsets_do_not_start_at_zero(start, stop):
    arr = pa.array(ROWS, pa.list_(pa.int32())).slice(start, stop - start)
    assert stop == start or arr.offsets[0].as_py() == sum(len(r or []) for r in ROWS[:start])
    indptr, values = list_to_csr(arr)
    ref_ptr, ref_values = _reference(ROWS[start:stop])
    np.testing.assert_array_equal(indptr, ref_ptr)
    assert values.to_pylist() == ref_values


def test_chunked_array_accumulates_per_chunk_offsets():
    chunks = [pa.array(ROWS[:2], pa.list_(pa.int32())), pa.array(ROWS[2:], pa.list_(pa.int32())).slice(1)]
    indptr, values = list_to_csr(pa.chunked_array(chunks))
    ref_ptr, ref_values = _reference(ROWS[:2] + ROWS[3:])
    np.testing.assert_array_equal(indptr, ref_ptr)
    assert values.to_pylist() == ref_values


def test_null_list_covering_a_non_empty_range_is_an_empty_row():
    # The Arrow spec allows a null slot to span child values; they must not leak into the row.
    offsets = pa.array([0, 2, 5, 6], pa.int32())
    arr = pa.ListArray.from_arrays(
        offsets, pa.array(range(6), pa.int32()), mask=pa.array([False, True, False])
    )
    indptr, values = list_to_csr(arr)
    np.testing.assert_array_equal(indptr, [0, 2, 2, 3])
    assert values.to_pylist() == [0, 1, 5]


def test_not_a_list_column():
    with pytest.raises(TypeError, match="expected a list column"):
        list_to_csr(pa.array([1, 2]))


@pytest.mark.parametrize(
    "dtype", [pa.int8(), pa.uint16(), pa.int32(), pa.uint64(), pa.float32(), pa.float64()]
)
def test_to_numpy_views_numbers_in_place_and_converts_the_rest(dtype):
    """Fixed-width numbers without nulls come out as a view of their buffer that honours a slice's
    offset and joins chunks; nulls and other types go through pyarrow's conversion."""
    from omicsio_jax.format.arrow import to_numpy

    values = np.arange(40).astype(dtype.to_pandas_dtype())
    array = pa.array(values, dtype)
    sliced = array.slice(7, 20)
    got = to_numpy(sliced)
    np.testing.assert_array_equal(got, values[7:27])
    assert got.dtype == values.dtype and not got.flags.writeable
    assert np.shares_memory(got, np.frombuffer(array.buffers()[1], values.dtype))  # no copy
    np.testing.assert_array_equal(
        to_numpy(pa.chunked_array([sliced, array.slice(0, 3)])), np.r_[values[7:27], values[:3]]
    )
    with_null = pa.array([1, None, 3], dtype)
    np.testing.assert_array_equal(to_numpy(with_null), with_null.to_numpy(zero_copy_only=False))
    np.testing.assert_array_equal(to_numpy(pa.array([True, False])), [True, False])


def test_to_numpy_filled_replaces_nulls_and_from_numpy_hands_memory_to_arrow():
    """``to_numpy_filled`` is ``fill_null(...).to_numpy()`` (sliced arrays included); ``from_numpy``
    gives Arrow the NumPy array's memory when the types agree, and converts otherwise."""
    from omicsio_jax.format.arrow import from_numpy, to_numpy_filled

    array = pa.array([5, None, 7, None, 9, 10, None], pa.int32())
    for part in (array, array.slice(1, 5), array.slice(4), pa.array([1, 2], pa.int64())):
        np.testing.assert_array_equal(to_numpy_filled(part, 3), pc.fill_null(part, 3).to_numpy())
        assert to_numpy_filled(part, 3).dtype == part.type.to_pandas_dtype()
    values = np.arange(6, dtype=np.float64)
    arrow = from_numpy(values, pa.float64())
    assert arrow.type == pa.float64() and arrow.to_pylist() == values.tolist()
    assert np.shares_memory(np.frombuffer(arrow.buffers()[1], np.float64), values)
    assert from_numpy(values[::2], pa.float64()).to_pylist() == [0.0, 2.0, 4.0]  # strided: a contiguous copy
    assert from_numpy(values, pa.float32()).type == pa.float32()


def test_text_array_is_pa_arrays_strings_and_bytes():
    """``text_array`` builds what ``pa.array`` does from Python strings (unicode, empty, none at all)
    and, with ``binary``, from bytes."""
    from omicsio_jax.format.arrow import text_array

    for values in (["ENSG00000141510", "", "Ångström", "細胞"], [], ["x"] * 5):
        got = text_array(values)
        assert got.equals(pa.array(values, pa.string())) and got.validate(full=True) is None
    packed = [b"\x00\x01", b"", b"\xff" * 9]
    assert text_array(packed, binary=True).equals(pa.array(packed, pa.binary()))


def test_repeated_text_is_pa_arrays_of_copies():
    """``repeated_text(v, n)`` builds what ``pa.array([v] * n)`` does (unicode, empty, no copies)."""
    from omicsio_jax.format.arrow import repeated_text

    for value, n in (("plate_01", 6000), ("Ångström", 3), ("", 4), ("x", 0)):
        got = repeated_text(value, n)
        assert got.equals(pa.array([value] * n, pa.string())) and got.validate(full=True) is None


def test_one_array_takes_a_lone_chunk_as_it_is_and_combines_the_rest():
    """`one_array`: an array as it is, a lone chunk without a copy, several chunks combined, none an
    empty array of the column's type."""
    from omicsio_jax.format.arrow import one_array

    ids = pa.array(["ENSG1", "ENSG2", None])
    assert one_array(ids) is ids
    lone = one_array(pa.chunked_array([ids]))
    assert lone.buffers()[2].address == ids.buffers()[2].address  # the chunk's own characters
    assert one_array(pa.chunked_array([ids, ids.slice(1)])).to_pylist() == [
        "ENSG1",
        "ENSG2",
        None,
        "ENSG2",
        None,
    ]
    empty = one_array(pa.chunked_array([], pa.int32()))
    assert isinstance(empty, pa.Array) and empty.type == pa.int32() and len(empty) == 0
