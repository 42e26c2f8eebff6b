"""The loaders: siblings over one batch core (`omicsio_jax.loaders.minibatch`).

`make_loader` (disk, block sampling), `GrainSource` / `make_grain_loader` (Grain's DataLoader),
`make_memory_loader` (an in-memory panel), `make_stream_loader` (a DuckDB query), device prefetch,
resume state and `tune`. The only layer that imports Grain.
"""
