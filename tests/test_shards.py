"""The shard writer process: records land in order across shards and slots; its failures surface."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader

import omicsio_jax as oj
from materialize import Layout
from materialize._shards import ShardWriter, ShardWriterProcess
from omicsio_jax.format.manifest import ShardEntry, sha256_file

OPTIONS = Layout(group_size=4, compression="zstd:-1").writer_options


def _batch(rng, sizes):
    """Records of the given byte sizes, concatenated, with their offsets."""
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    buf = rng.integers(0, 256, size=int(starts[-1]), dtype=np.uint8)
    return buf, starts, [buf[a:b].tobytes() for a, b in zip(starts[:-1], starts[1:], strict=True)]


@pytest.mark.parametrize("writer_class", [ShardWriterProcess, ShardWriter])
def test_records_cross_shards_and_growing_slots(tmp_path, writer_class):
    rng = np.random.default_rng(7)
    writer = writer_class(tmp_path, shard_cells=8, options=OPTIONS)
    expected = []
    # Batches that outgrow the slots made for the first ones, and an empty batch.
    for sizes in ([10, 20, 30], [5000] * 7, [], [1] * 9, [70_000, 3, 0, 12], [200_000, 5]):
        buf, starts, records = _batch(rng, np.array(sizes, dtype=np.int64))
        writer.write(buf, starts)
        expected += records
    shards = writer.close()
    assert [s.num_cells for s in shards] == [8, 8, 8, 1]
    assert [s.first_cell for s in shards] == [0, 8, 16, 24]
    got = []
    for shard in shards:
        reader = ArrayRecordReader(str(tmp_path / shard.path))
        got += reader.read(0, reader.num_records())
        reader.close()
        assert shard.num_bytes == (tmp_path / shard.path).stat().st_size
    assert got == expected
    assert all(isinstance(s, ShardEntry) and s.sha256 == sha256_file(tmp_path / s.path) for s in shards)


def test_a_failure_in_the_writer_process_is_raised_here(tmp_path):
    rng = np.random.default_rng(0)
    buf, starts, _ = _batch(rng, np.array([100, 200], dtype=np.int64))
    writer = ShardWriterProcess(tmp_path / "missing" / "dir", shard_cells=8, options=OPTIONS)
    writer.write(buf, starts)
    with pytest.raises(oj.OmicsIOError, match="writing shards failed: .*missing/dir/shard-00000.arrayrecord"):
        writer.close()
    writer.abort()
    assert writer._proc.poll() is not None


def test_a_killed_writer_process_is_reported(tmp_path):
    rng = np.random.default_rng(1)
    buf, starts, _ = _batch(rng, np.array([100, 200], dtype=np.int64))
    writer = ShardWriterProcess(tmp_path, shard_cells=8, options=OPTIONS)
    writer.write(buf, starts)
    writer._proc.kill()
    writer._proc.wait()
    with pytest.raises(oj.OmicsIOError, match="shard writer process exited with code -9"):
        for _ in range(10):  # the socket may still accept a few messages
            writer.write(buf, starts)
        writer.close()
    writer.abort()


def test_a_batch_encoded_into_a_slot_is_not_overwritten_while_it_is_still_read(tmp_path):
    """`buffer` lends a slot to encode into; `write` hands it over without a copy, and the slot takes
    no other batch until the batch's ``readers`` (the statistics) are done with it."""
    rng = np.random.default_rng(3)
    writer = ShardWriterProcess(tmp_path, shard_cells=8, options=OPTIONS, depth=1)
    first, starts, records = _batch(rng, np.array([40, 24], dtype=np.int64))
    buf = writer.buffer(first.nbytes)
    buf[:] = first
    reading = Future()
    writer.write(buf, starts, readers=[reading])
    seen = []
    threading.Timer(0.3, lambda: (seen.append(buf.tobytes()), reading.set_result(None))).start()
    second = writer.buffer(64)  # the only slot: it waits for the reader
    assert reading.done() and seen == [first.tobytes()]
    assert second.ctypes.data == buf.ctypes.data
    second[:], more = rng.integers(0, 256, 64, dtype=np.uint8), np.array([0, 64])
    written = second.tobytes()
    writer.write(second, more)
    writer.write(first, starts)  # any other buffer is copied into a slot
    shards = writer.close()
    reader = ArrayRecordReader(str(tmp_path / shards[0].path))
    assert reader.read(0, 5) == [*records, written, *records]
    reader.close()
