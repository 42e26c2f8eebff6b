"""`open_dataset` and `Dataset`: a materialized dataset, local or on object storage (a local cache
and sparse mirrors of its shards), and the batched reads of its cells.
"""
