"""Reading encoded records from a dataset's shards: the chunk reader (``pread``, riegeli's HighwayHash,
zstd in one numba pass), ArrayRecord's reader as the fallback, and the kernel read-ahead.

Typed against `omicsio_jax.records.shard_files.ShardFiles`, what a reader needs of a dataset, never
against `Dataset` itself; imports `format`, `storage` and `core`.
"""
