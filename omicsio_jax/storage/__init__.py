"""Where bytes live: local files and direct (``O_DIRECT``) reads, S3-compatible object storage, input files on S3.

Imports only `omicsio_jax.core`.
"""
