"""What the token ids of a pretraining checkpoint mean. With the default vocabulary (no ``--vocab``)
token ``g + 3`` is the dataset's gene *column* ``g``; the checkpoint records a digest of the
pretraining dataset's gene ids in column order, and a dataset whose genes differ in that order is
refused, not embedded with its genes matched by position."""

from __future__ import annotations

import hashlib
import sys

import omicsio_jax as oj

from ._errors import TrainError

_KEYS = ("ensembl_id", "gene_name")  # the first the dataset's gene table has names its genes


def gene_order(ds: oj.Dataset, key: str | None = None) -> dict:
    """The record of ``ds``'s genes in column order: ``key`` (default: ``ensembl_id``, else
    ``gene_name``, else None: columns only), ``num_genes`` and the ``sha256`` of the ids as the
    gene table holds them; ``sha256`` is None where the gene table lacks ``key``."""
    features = ds.features
    if key is None:
        key = next((k for k in _KEYS if k in features), None)
    digest = None
    if key is not None and key in features:
        ids = [str(x) for x in features[key].to_numpy(dtype=object)]
        digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()
    return {"key": key, "num_genes": int(ds.num_genes), "sha256": digest}


def check_gene_order(meta: dict, ds: oj.Dataset, checkpoint_dir) -> None:
    """A one-line `TrainError` where the checkpoint in ``checkpoint_dir`` (``meta``) was pretrained
    with the default vocabulary on a dataset whose genes, in column order, are not ``ds``'s; a note
    on stderr for a checkpoint written before the record existed."""
    config = meta.get("config", {})
    if config.get("vocab") is not None:  # tokens follow gene ids, not columns
        return
    pretrained = config.get("dataset", "?")
    saved = meta.get("gene_order")
    if saved is None:
        print(
            f"note: {checkpoint_dir} records no gene order (written by an older version): its tokens are "
            f"gene columns of {pretrained}, and {ds.path} cannot be checked to have the same genes in the "
            "same order",
            file=sys.stderr,
        )
        return
    if gene_order(ds, saved["key"]) == saved:
        return
    genes = f"{saved['key']}s" if saved["key"] else "gene columns"
    msg = (
        f"{checkpoint_dir} was pretrained with the default vocabulary (token = gene column + 3) on "
        f"{pretrained} ({saved['num_genes']:,} genes), but the {genes} of {ds.path} "
        f"({ds.num_genes:,} genes) differ from them in column order: use a dataset with {pretrained}'s "
        "genes in its column order, or pretrain with --vocab FILE keyed on Ensembl id so that tokens are genes"
    )
    raise TrainError(msg)
