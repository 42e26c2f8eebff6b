"""Geneformer and scGPT token batches against a plain-numpy implementation of TOKENS.md.

The reference below is written from TOKENS.md alone (numpy's own quantile / digitize / lexsort,
Python loops): the numba kernels must match it element for element. Its random draws come from
`uniforms`, the pure-Python twin of the kernels' counter-based generator.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import warnings

import numba
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import omicsio_jax as oj
from materialize import Layout, materialize
from omicsio_jax.outputs.base import OutputContext
from omicsio_jax.outputs.rank_sort import finish_by_insertion, radix_sort, rank_sort
from omicsio_jax.outputs.token_draws import (
    GAP_BLOCK,
    STREAM_MASK,
    STREAM_MASK_KIND,
    STREAM_RANDOM_TOKEN,
    STREAM_SUBSAMPLE,
    STREAM_TIES,
    gaps,
    uniforms,
)

NUM_GENES = 300


# ----------------------------------------------------------------------------- the reference
def _vocab_arrays(ds, vocab: dict | None):
    """tok, canon, specials of a vocabulary, computed independently of omicsio_jax.outputs.vocabulary."""
    n = ds.num_genes
    if vocab is None:
        return np.arange(3, n + 3), np.arange(n), (0, 1, 2, n + 3)
    ens = [e.split(".")[0].upper() for e in ds.features["ensembl_id"]]
    genes = {k.split(".")[0].upper(): v for k, v in vocab.items() if not k.startswith("<")}
    tok = np.array([genes.get(e, -1) for e in ens])
    first: dict[str, int] = {}
    canon = np.arange(n)
    for c, e in enumerate(ens):
        if tok[c] >= 0:
            canon[c] = first.setdefault(e, c)
    mask = vocab.get("<mask>", max(vocab.values()) + 1)
    return tok, canon, (vocab.get("<pad>", 0), vocab.get("<cls>", 1), vocab.get("<eos>", 2), mask)


def _cell(ds, row, canon):
    indptr, cols, vals = ds.read_csr([row])
    sums: dict[int, np.float32] = {}
    for c, v in zip(cols.tolist(), vals, strict=True):  # columns ascending: float32 sums in column order
        k = int(canon[c])
        sums[k] = np.float32(sums[k] + v) if k in sums else np.float32(v)
    order = sorted(sums)
    return np.array(order, np.int64), np.array([sums[c] for c in order], np.float32)


def bernoulli_positions(seed, epoch, row, p, first, end) -> list[int]:
    """Positions in [first, end) each selected with probability p, as gaps of Geometric(p) failures
    (``floor(log(u) / log1p(-p))``) drawn from the mask stream: TOKENS.md's Bernoulli masking."""
    if p <= 0:
        return []
    u = uniforms(seed, epoch, row, STREAM_MASK, max(end - first, 0) + 1)  # at most one draw per position, + 1
    out, pos = [], first - 1
    for draw in range(len(u)):
        pos += 1 + int(min(math.log(max(u[draw], 2.0**-53)) / math.log1p(-p), 4.0e18))
        if pos >= end:
            break
        out.append(pos)
    return out


def ref_geneformer(ds, rows, *, L, special, p, seed, epoch, vocab=None, medians=None):
    tok, canon, (pad, cls, eos, mask) = _vocab_arrays(ds, vocab)
    inv = np.zeros(ds.num_genes, np.float32)
    med = ds.gene_stats["median"].to_numpy() if medians is None else medians
    ok = np.isfinite(med) & (med > 0)
    inv[ok] = (1.0 / med[ok]).astype(np.float32)
    gene_tokens = np.unique(tok[tok >= 0])
    n = len(rows)
    ids = np.full((n, L), pad, np.int32)
    att = np.zeros((n, L), bool)
    labels = np.full((n, L), -100, np.int32)
    length = np.zeros(n, np.int32)
    for i, row in enumerate(rows):
        if row < 0:
            continue
        cols, vals = _cell(ds, row, canon)
        total = vals.astype(np.float64).sum()  # n_counts
        keep = (tok[cols] >= 0) & (inv[cols] > 0) & (vals > 0)
        cols, vals = cols[keep], vals[keep]
        if medians is None:  # the corpus medians: float32 keys, ties by column
            key = vals * inv[cols]
            assert key.dtype == np.float32
        else:  # Geneformer's tokenizer's values, in float64 (ties, which its sort leaves to chance, by column)
            key = vals.astype(np.float64) / total * 10_000 / med[cols]
        order = np.lexsort((cols, -key))
        s = 1 if special else 0
        k = min(len(cols), L - 2 * s)
        seq = ([cls] if special else []) + tok[cols[order[:k]]].tolist() + ([eos] if special else [])
        ids[i, : len(seq)] = seq
        att[i, : len(seq)] = True
        length[i] = k
        u_kind, u_tok = (uniforms(seed, epoch, row, s_, L) for s_ in (STREAM_MASK_KIND, STREAM_RANDOM_TOKEN))
        for pos in bernoulli_positions(seed, epoch, row, p, s, s + k):
            labels[i, pos] = ids[i, pos]
            if u_kind[pos] < 0.8:
                ids[i, pos] = mask
            elif u_kind[pos] < 0.9:
                ids[i, pos] = gene_tokens[min(int(u_tok[pos] * len(gene_tokens)), len(gene_tokens) - 1)]
    return {"input_ids": ids, "attention_mask": att, "labels": labels, "length": length}


def ref_scgpt(ds, rows, *, L, n_bins, binning, p, mask_mode, seed, epoch, vocab=None, genes=None):
    tok, canon, (pad, cls, _, _) = _vocab_arrays(ds, vocab)
    if genes is not None:  # a gene is chosen by any of its columns (they are summed into canon's)
        chosen = np.zeros(ds.num_genes, bool)
        chosen[canon[genes]] = True
        tok = np.where(chosen[canon], tok, -1)
    n = len(rows)
    gene_ids = np.full((n, L), pad, np.int32)
    values = np.full((n, L), -2, np.float32)
    pad_mask = np.ones((n, L), bool)
    mask = np.zeros((n, L), bool)
    for i, row in enumerate(rows):
        if row < 0:
            continue
        gene_ids[i, 0], pad_mask[i, 0] = cls, False
        cols, vals = _cell(ds, row, canon)
        keep = (tok[cols] >= 0) & (vals != 0)
        cols, v = cols[keep], vals[keep]
        m = len(v)
        if m == 0:
            continue
        edges = np.quantile(v, np.linspace(0, 1, n_bins - 1))
        if binning == "tahoe":
            bins = np.searchsorted(edges, v, side="left") + 1
        else:
            left, right = np.digitize(v, edges), np.digitize(v, edges, right=True)
            bins = np.ceil(uniforms(seed, epoch, row, STREAM_TIES, m) * (right - left) + left)
        order = np.arange(m)
        if m > L - 1:
            u = uniforms(seed, epoch, row, STREAM_SUBSAMPLE, L - 1)
            for j in range(L - 1):
                r = j + min(int(u[j] * (m - j)), m - j - 1)
                order[j], order[r] = order[r], order[j]
            order, m = order[: L - 1], L - 1
        gene_ids[i, 1 : m + 1] = tok[cols[order]]
        values[i, 1 : m + 1] = bins[order]
        pad_mask[i, 1 : m + 1] = False
        if mask_mode == "exact":  # Tahoe-x1: positions 1..m-1 (`test_exact_masks_count_as_tahoe_x1`)
            n = max(m - 1, 0)
            c = int(np.floor(n * p))
            positions = np.arange(1, n + 1)
            u = uniforms(seed, epoch, row, STREAM_MASK, c)
            for j in range(c):
                r = j + min(int(u[j] * (n - j)), n - j - 1)
                positions[j], positions[r] = positions[r], positions[j]
            mask[i, positions[:c]] = True
        else:
            mask[i, bernoulli_positions(seed, epoch, row, p, 1, m + 1)] = True
    masked = np.where(mask, np.float32(-1), values)
    return {
        "gene_ids": gene_ids,
        "values": values,
        "masked_values": masked,
        "mask": mask,
        "pad_mask": pad_mask,
    }


def assert_tokens_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# ----------------------------------------------------------------------------- the data
@pytest.fixture(scope="module")
def token_ds(tmp_path_factory):
    """300 genes (two pairs sharing an Ensembl id, far enough apart that a cell's summed entry moves
    before columns in between), cells with 0, 1, few and many genes and tied counts."""
    root = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(11)
    ens = [f"ENSG{g:011d}.{1 + g % 3}" for g in range(NUM_GENES)]
    ens[25] = "ENSG00000000010.7"  # same gene as column 10 once the version is dropped
    ens[230] = "ENSG00000000200.9"
    pq.write_table(
        pa.table(
            {
                "gene_token_id": np.arange(NUM_GENES, dtype=np.int64) * 2 + 5,
                "ensembl_id": ens,
                "gene_name": [f"G{g}" for g in range(NUM_GENES)],
            }
        ),
        root / "gene_metadata.parquet",
    )
    sizes = np.concatenate([[0, 1, 2, 0], rng.integers(3, 280, size=396)])
    genes, values = [], []
    for n in sizes:
        cols = np.sort(rng.choice(NUM_GENES, size=n, replace=False))
        genes.append((cols * 2 + 5).tolist())
        values.append(rng.geometric(0.45, size=n).astype(np.float32).tolist())  # many ties
    table = pa.table(
        {
            "cell_id": [f"c{i}" for i in range(len(sizes))],
            "gene_token_id": pa.array(genes, pa.list_(pa.int64())),
            "gene_expression": pa.array(values, pa.list_(pa.float32())),
            "label": [f"t{i % 3}" for i in range(len(sizes))],
        }
    )
    pq.write_table(table, root / "cells.parquet")
    materialize(root / "cells.parquet", root / "ds", progress=False, layout=Layout(shard_cells=128))
    return oj.open_dataset(root / "ds")


@pytest.fixture(scope="module")
def vocab_file(token_ds, tmp_path_factory):
    """A user vocabulary (Geneformer's layout: <pad> 0, <mask> 1, <cls> 2, <eos> 3) missing 30 genes."""
    ens = [e.split(".")[0] for e in token_ds.features["ensembl_id"]]
    vocab = {"<pad>": 0, "<mask>": 1, "<cls>": 2, "<eos>": 3}
    for k, e in enumerate(dict.fromkeys(ens)):
        if k % 10 != 3:
            vocab[e] = 1000 + 7 * k
    path = tmp_path_factory.mktemp("vocab") / "token_dictionary.pkl"
    path.write_bytes(pickle.dumps(vocab))
    return path, vocab


ROWS = np.array([0, 1, 2, 3, -1, *range(4, 120), 399, 250, 4])


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("L", [8, 64, 400])
@pytest.mark.parametrize("special", [True, False])
def test_geneformer_matches_reference(token_ds, L, special):
    out = oj.GeneformerTokens(max_len=L, special_tokens=special, mask_prob=0.15)
    got = oj.tokenize(token_ds, ROWS, out, seed=3, epoch=2)
    assert_tokens_equal(got, ref_geneformer(token_ds, ROWS, L=L, special=special, p=0.15, seed=3, epoch=2))
    assert got["length"][ROWS.tolist().index(0)] == 0 and got["length"][ROWS.tolist().index(-1)] == 0
    assert got["attention_mask"][ROWS.tolist().index(0)].sum() == (
        2 if special else 0
    )  # empty: CLS, EOS only


def test_geneformer_user_vocab_and_medians(token_ds, vocab_file, tmp_path):
    path, vocab = vocab_file
    medians = token_ds.gene_stats["median"].to_numpy().copy()
    ens = [e.split(".")[0] for e in token_ds.features["ensembl_id"]]
    medians[::7] = np.nan  # genes without a published median are skipped
    given = {e: float(m) for e, m in zip(ens, medians, strict=True) if np.isfinite(m)}
    (tmp_path / "medians.json").write_text(json.dumps(given))
    per_column = np.array([given.get(e, np.nan) for e in ens])
    out = oj.GeneformerTokens(max_len=96, vocab=path, medians=tmp_path / "medians.json")
    unlisted = r"gene\(s\) of .* with a token have no median in .*medians.json: left out of the ranking"
    with pytest.warns(UserWarning, match=unlisted):  # said: Geneformer's own tokenizer stops at them
        got = oj.tokenize(token_ds, ROWS, out, seed=1)
    assert_tokens_equal(
        got,
        ref_geneformer(
            token_ds, ROWS, L=96, special=True, p=0.15, seed=1, epoch=0, vocab=vocab, medians=per_column
        ),
    )
    assert got["input_ids"][5, 0] == 2 and 1 in got["input_ids"]  # Geneformer's <cls> and <mask>
    with pytest.warns(UserWarning, match=unlisted):
        bound = out.bind(OutputContext.of_dataset(token_ds))
    assert bound.vocabulary.report.summed == 2 and bound.vocabulary.report.missing > 0


@pytest.mark.parametrize("L", [8, 400])
def test_geneformer_with_a_median_per_gene_matches_reference(token_ds, tmp_path, L):
    """A median of its own for every gene (as a published dictionary gives): the ranking keys seldom
    tie and the sort takes its passes on every bit (`rank_sort`); the corpus medians, histogram bin
    centres that genes share, keep the bucket pass. The tokens are the reference's either way."""
    medians = token_ds.gene_stats["median"].to_numpy().copy()
    ens = [e.split(".")[0] for e in token_ds.features["ensembl_id"]]
    medians *= 2.0 ** (np.random.default_rng(0).uniform(-1, 1, len(medians)) / 80)  # within the bin
    given = dict(zip(ens, medians.tolist(), strict=True))  # an Ensembl id twice: its last median
    (tmp_path / "medians.json").write_text(json.dumps(given))
    out = oj.GeneformerTokens(max_len=L, medians=tmp_path / "medians.json")
    ctx = OutputContext.of_dataset(token_ds)
    assert out.bind(ctx).distinct_scales and not oj.GeneformerTokens(max_len=L).bind(ctx).distinct_scales
    got = oj.tokenize(token_ds, ROWS, out, seed=4)
    per_column = np.array([given[e] for e in ens])
    want = ref_geneformer(token_ds, ROWS, L=L, special=True, p=0.15, seed=4, epoch=0, medians=per_column)
    assert_tokens_equal(got, want)


@pytest.mark.parametrize("binning", ["scgpt", "tahoe"])
@pytest.mark.parametrize("mask_mode", ["bernoulli", "exact"])
@pytest.mark.parametrize("L", [6, 101, 400])
def test_scgpt_matches_reference(token_ds, binning, mask_mode, L):
    p = 0.4 if mask_mode == "bernoulli" else 0.5
    out = oj.ScGPTTokens(max_len=L, n_bins=51, binning=binning, mask_prob=p, mask_mode=mask_mode)
    got = oj.tokenize(token_ds, ROWS, out, seed=5, epoch=1)
    assert_tokens_equal(
        got,
        ref_scgpt(token_ds, ROWS, L=L, n_bins=51, binning=binning, p=p, mask_mode=mask_mode, seed=5, epoch=1),
    )
    real = got["values"][~got["pad_mask"]]
    assert real[0] == -2 and set(np.unique(real[real > 0])) <= set(range(1, 51))


@pytest.mark.parametrize("p", [0.5, 0.15, 1.0])
def test_exact_masks_count_as_tahoe_x1(token_ds, p):
    """``mask_mode="exact"`` masks what Tahoe-x1's ``DataCollator._create_random_mask`` does: its
    valid tokens are the sequence less the positions holding its pad value (-2: the padding and CLS,
    whose value is the pad value in its data) and ``keep_first_n_tokens`` (1), and it masks
    ``int(valid · p)`` of positions ``1..valid``: the last gene is never masked."""
    for L in (6, 101, 400):
        got = oj.tokenize(token_ds, ROWS, oj.ScGPTTokens(max_len=L, mask_prob=p, mask_mode="exact"), seed=3)
        for values, mask in zip(got["values"], got["mask"], strict=True):
            valid = len(values) - int(np.sum(values == -2)) - 1
            assert mask.sum() == max(int(valid * p), 0)  # (a cell without genes: valid -1, no mask)
            assert not mask[0] and not mask[valid + 1 :].any()


@pytest.mark.parametrize("first", [0, 1], ids=["even-columns", "odd-columns"])
def test_scgpt_user_vocab_and_gene_subset(token_ds, vocab_file, first):
    """Odd columns name column 25 and not column 10, which shares its Ensembl id: the gene (their
    summed counts, under column 10's token) is kept, as it is when named by column 10."""
    path, vocab = vocab_file
    genes = list(range(first, NUM_GENES, 2))
    out = oj.ScGPTTokens(max_len=80, n_bins=11, vocab=path, genes=genes)
    got = oj.tokenize(token_ds, ROWS, out, seed=9)
    assert_tokens_equal(
        got,
        ref_scgpt(
            token_ds,
            ROWS,
            L=80,
            n_bins=11,
            binning="scgpt",
            p=0.15,
            mask_mode="bernoulli",
            seed=9,
            epoch=0,
            vocab=vocab,
            genes=genes,
        ),
    )


def test_masking_rates(token_ds):
    rows = np.arange(token_ds.num_cells)
    gf = [oj.tokenize(token_ds, rows, oj.GeneformerTokens(max_len=300), epoch=e) for e in range(3)]
    sel = np.concatenate([(x["labels"] != -100)[x["attention_mask"]] for x in gf])
    real = np.concatenate([x["attention_mask"].sum(1) - 2 * (x["length"] >= 0) for x in gf]).sum()
    assert real >= 100_000
    assert abs(sel.sum() / real - 0.15) < 0.005
    masked = np.concatenate([x["input_ids"][x["labels"] != -100] for x in gf])
    assert abs(np.mean(masked == token_ds.num_genes + 3) - 0.8) < 0.02  # 80% of the selected → MASK
    sc = [oj.tokenize(token_ds, rows, oj.ScGPTTokens(max_len=300, mask_prob=0.15), epoch=e) for e in range(3)]
    positions = sum(int((~x["pad_mask"][:, 1:]).sum()) for x in sc)
    assert positions >= 100_000
    assert abs(sum(int(x["mask"].sum()) for x in sc) / positions - 0.15) < 0.005


def test_tokens_depend_on_seed_epoch_and_row_only(token_ds):
    out = oj.GeneformerTokens(max_len=64)
    a = oj.tokenize(token_ds, [7, 8, 9], out, seed=0, epoch=0)
    b = oj.tokenize(token_ds, [9, 100, 7], out, seed=0, epoch=0)
    np.testing.assert_array_equal(a["input_ids"][0], b["input_ids"][2])
    c = oj.tokenize(token_ds, [7], out, seed=0, epoch=1)
    assert not np.array_equal(a["labels"][0], c["labels"][0])


# ----------------------------------------------------------------------------- in the loaders
@pytest.mark.parametrize("output", [oj.GeneformerTokens(max_len=64), oj.ScGPTTokens(max_len=48)])
def test_loader_batches_equal_tokenize(token_ds, output):
    loader = oj.make_loader(
        token_ds,
        batch_size=32,
        output=output,
        sampling=oj.Block(4, 4, drop_remainder=False),
        seed=4,
        num_epochs=2,
    )
    seen = 0
    for step, batch in enumerate(loader):
        epoch = step // loader.plan.steps_per_epoch
        rows = np.asarray(batch.index)
        want = oj.tokenize(token_ds, rows, output, seed=4, epoch=epoch)
        assert_tokens_equal({k: np.asarray(v) for k, v in batch.x.items()}, want)
        seen += 1
    assert seen == 2 * loader.plan.steps_per_epoch
    source = oj.GrainSource(token_ds, batch_size=32, output=output, sampling=oj.Block(4, 4), seed=4)
    record = source[1]
    assert_tokens_equal(record.x, oj.tokenize(token_ds, record.index, output, seed=4, epoch=0))


def test_tokens_are_sharded_like_every_output(token_ds):
    import jax

    mesh = jax.make_mesh((4,), ("data",))
    loader = oj.make_loader(
        token_ds, batch_size=32, output=oj.ScGPTTokens(max_len=40), placement=mesh, sampling=oj.Block(4, 4)
    )
    batch = next(iter(loader))
    assert batch.x["gene_ids"].shape == (32, 40)
    assert batch.x["gene_ids"].sharding.spec == jax.sharding.PartitionSpec("data")
    assert len(batch.x["values"].addressable_shards) == 4


# ----------------------------------------------------------------------------- bad input
def test_bad_token_arguments(token_ds, tmp_path):
    with pytest.raises(oj.OmicsIOError, match="no room for a gene token beside CLS and EOS"):
        oj.GeneformerTokens(max_len=2)
    with pytest.raises(oj.OmicsIOError, match="beside CLS"):
        oj.ScGPTTokens(max_len=1)
    with pytest.raises(oj.OmicsIOError, match="binning"):
        oj.ScGPTTokens(binning="quantile")
    dup = tmp_path / "dup.tsv"
    dup.write_text("ensembl_id\ttoken_id\nENSG00000000001\t5\nENSG00000000002\t5\n")
    with pytest.raises(oj.OmicsIOError, match=r"dup.tsv: token id 5 is given to both"):
        oj.tokenize(token_ds, [4], oj.GeneformerTokens(vocab=dup))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"ENSMUSG00000000001": 4}))
    with pytest.raises(oj.OmicsIOError, match=r"other.json shares no gene"):
        oj.tokenize(token_ds, [4], oj.ScGPTTokens(vocab=other))
    with pytest.raises(oj.OmicsIOError, match=r"medians in .*other.json cover none"):
        oj.tokenize(token_ds, [4], oj.GeneformerTokens(medians=other))
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({"ENSG00000000001": 0.0, "ENSG00000000002": -1.0}))
    with pytest.raises(
        oj.OmicsIOError, match=r"zero.json of the 2 genes .* it lists are none of them positive"
    ):
        oj.tokenize(token_ds, [4], oj.GeneformerTokens(medians=zero))
    listed = {"ENSG00000000001": 0.0, "ENSG00000000002": 2.0, "ENSG00000000003": float("nan")}
    zero.write_text(json.dumps(listed))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        oj.tokenize(token_ds, [4], oj.GeneformerTokens(medians=zero))
    said = [str(w.message) for w in said]
    assert len(said) == 2, (
        said
    )  # a NaN median is not positive either; the genes the file lacks are counted apart
    assert re.search(
        r"2 gene\(s\) of .* have a median in .*zero.json that is not positive \(0, negative, infinite or NaN\)",
        said[0],
    )
    unlisted = sum(e.split(".")[0] not in listed for e in token_ds.features["ensembl_id"])
    assert re.search(rf"{unlisted:,} gene\(s\) of .* with a token have no median in .*zero.json", said[1]), (
        said
    )
    for rows, error in (([-2], IndexError), ([0.5], TypeError), ([[0, 1]], TypeError)):
        with pytest.raises(error):  # -1 alone is a padding row; other rows are the dataset's
            oj.tokenize(token_ds, rows, oj.ScGPTTokens())
    assert oj.tokenize(token_ds, [-1], oj.ScGPTTokens())["pad_mask"].all()
    tokens = tmp_path / "token_dictionary.pkl"  # Geneformer's two pickles swapped
    tokens.write_bytes(pickle.dumps({"<pad>": 0, "<mask>": 1, "ENSG00000000001": 2}))
    with pytest.raises(oj.OmicsIOError, match=r"holds <mask>, <pad>: a token dictionary, not gene medians"):
        oj.tokenize(token_ds, [4], oj.GeneformerTokens(medians=tokens))
    for seed in (2**64, -1, 1.5):
        with pytest.raises(oj.OmicsIOError, match=r"tokenize\(seed=...\) must be an integer in 0..2\*\*64-1"):
            oj.tokenize(token_ds, [4], oj.ScGPTTokens(), seed=seed)
    numpy_ints = (
        oj.ScGPTTokens(max_len=np.int64(64), n_bins=np.int32(51)),
        oj.GeneformerTokens(max_len=np.int64(64)),
    )
    assert [o.max_len for o in numpy_ints] == [64, 64] and type(numpy_ints[0].n_bins) is int


def test_special_tokens_a_vocabulary_lacks_must_not_take_a_gene_token(token_ds, tmp_path):
    """A vocabulary without <pad> / <cls> / <eos> gets their defaults (0, 1, 2) only where no token of
    its own has them: Geneformer V1's dictionary (<pad> 0, <mask> 1, genes from 2) tokenizes without
    CLS and EOS, and with them names the entry to add; genes numbered from 0 are refused outright."""
    ens = list(dict.fromkeys(e.split(".")[0] for e in token_ds.features["ensembl_id"]))
    v1 = tmp_path / "v1.json"
    v1.write_text(json.dumps({"<pad>": 0, "<mask>": 1, **{e: 2 + k for k, e in enumerate(ens)}}))
    got = oj.tokenize(
        token_ds, [5, 6], oj.GeneformerTokens(max_len=64, special_tokens=False, mask_prob=0.0, vocab=v1)
    )
    assert got["length"].min() > 0 and got["input_ids"][got["attention_mask"]].min() >= 2
    with pytest.raises(
        oj.OmicsIOError,
        match=r"v1.json names no <cls> token, and its default id 1 is the token of <mask>: add <cls> to the vocabulary, or pass special_tokens=False",
    ):
        oj.tokenize(token_ds, [5], oj.GeneformerTokens(max_len=64, vocab=v1))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({e: k for k, e in enumerate(ens)}))
    with pytest.raises(
        oj.OmicsIOError,
        match=rf"plain.json names no <pad> token, and its default id 0 is the token of '{ens[0]}'",
    ):
        oj.tokenize(token_ds, [5], oj.GeneformerTokens(max_len=64, special_tokens=False, vocab=plain))
    with pytest.raises(oj.OmicsIOError, match=r"plain.json names no <pad> token"):
        oj.tokenize(token_ds, [5], oj.ScGPTTokens(vocab=plain))
    named = tmp_path / "named.json"
    named.write_text(
        json.dumps({"<pad>": 0, "<cls>": 1, "<eos>": 2, **{e: 3 + k for k, e in enumerate(ens)}})
    )
    assert oj.tokenize(token_ds, [5], oj.GeneformerTokens(max_len=64, vocab=named))["length"][0] > 0


def test_a_token_id_past_int32_is_refused_naming_it(token_ds, tmp_path):
    """input_ids are int32: a token id of 2**31 or more would wrap around (or fail deep in numpy);
    the vocabulary is refused naming the gene and the limit."""
    ens = list(dict.fromkeys(e.split(".")[0] for e in token_ds.features["ensembl_id"]))
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"<pad>": 0, "<cls>": 1, "<eos>": 2, ens[0]: 2**31, ens[1]: 3}))
    with pytest.raises(
        oj.OmicsIOError, match=rf"big.json: token id of '{ens[0]}' is 2,147,483,648; .*2\*\*31"
    ):
        oj.tokenize(token_ds, [5], oj.GeneformerTokens(max_len=64, vocab=big))


@pytest.mark.parametrize("L", [10, 64, 2048])
def test_genes_whose_float32_keys_come_close_rank_as_geneformers_float64_values(tmp_path, L):
    """Geneformer's tokenizer ranks ``v / n * 10,000 / median`` in float64; the sort's float32 keys
    order genes within ~1e-7 of each other otherwise (here in some cells of log-normal medians, as a
    published dictionary has). Those are put in float64's order, in full and truncated rankings."""
    import anndata as ad
    import pandas as pd
    import scipy.sparse as sp

    rng = np.random.default_rng(7)
    cells, genes = 300, 1500
    ens = [f"ENSG{i:011d}" for i in range(genes)]
    nnz = rng.integers(40, 600, cells)
    x = np.zeros((cells, genes), np.float32)
    for i, k in enumerate(nnz):
        x[i, rng.choice(genes, k, replace=False)] = rng.integers(1, 30, k)
    medians = np.exp(rng.normal(0, 1.5, genes))
    # cell 0's two genes lie 2.4e-8 apart in float64, and their float32 keys the other way round
    medians[:2] = 6.22406058592401, 1.5560151093777799
    x[0] = 0
    x[0, :2] = 8, 2
    (tmp_path / "medians.pkl").write_bytes(pickle.dumps(dict(zip(ens, medians.tolist(), strict=True))))
    tokens = {"<pad>": 0, "<mask>": 1, "<cls>": 2, "<eos>": 3, **{e: 4 + i for i, e in enumerate(ens)}}
    (tmp_path / "tokens.pkl").write_bytes(pickle.dumps(tokens))
    var = pd.DataFrame({"ensembl_id": ens}, index=ens)
    obs = pd.DataFrame(index=[f"c{i}" for i in range(cells)])
    ad.AnnData(X=sp.csr_matrix(x), obs=obs, var=var).write_h5ad(tmp_path / "x.h5ad")
    materialize(tmp_path / "x.h5ad", tmp_path / "ds", progress=False)
    out = oj.GeneformerTokens(
        max_len=L, mask_prob=0.0, vocab=tmp_path / "tokens.pkl", medians=tmp_path / "medians.pkl"
    )
    got = oj.tokenize(oj.open_dataset(tmp_path / "ds"), np.arange(cells), out)
    by_float32 = 0
    for i in range(cells):
        cols = np.flatnonzero(x[i])
        v = x[i, cols]
        exact = v.astype(np.float64) / v.sum(dtype=np.float64) * 10_000 / medians[cols]
        want = [2, *(cols[np.argsort(-exact, kind="stable")][: L - 2] + 4).tolist(), 3]
        assert got["input_ids"][i][got["attention_mask"][i]].tolist() == want, i
        keys = v * (1 / medians[cols]).astype(np.float32)
        by_float32 += not np.array_equal(
            np.lexsort((cols, -keys))[: L - 2], np.argsort(-exact, kind="stable")[: L - 2]
        )
    assert by_float32 >= 1  # the float32 keys alone rank some cell otherwise


def test_a_chain_of_close_keys_past_a_truncated_ranking_is_ranked_by_a_whole_sort(tmp_path):
    """80 genes whose keys lie 4 float32 steps apart reach past the ranks sorted beyond the ranking's
    end: a whole sort decides which genes are kept, then the float64 order their order (the whole
    sort's passes run in place here, over keys spanning ~2^21)."""
    import anndata as ad
    import pandas as pd
    import scipy.sparse as sp

    genes = 200
    ens = [f"ENSG{i:011d}" for i in range(genes)]
    values = np.empty(genes)
    values[:80] = 1 - (np.arange(80) + 1) * 4 * 2.0**-24  # descending by column, 4 steps apart
    values[80:] = 0.99 - 0.001 * np.arange(120)
    medians = 1 / values
    (tmp_path / "medians.pkl").write_bytes(pickle.dumps(dict(zip(ens, medians.tolist(), strict=True))))
    tokens = {"<pad>": 0, "<mask>": 1, "<cls>": 2, "<eos>": 3, **{e: 4 + i for i, e in enumerate(ens)}}
    (tmp_path / "tokens.pkl").write_bytes(pickle.dumps(tokens))
    var = pd.DataFrame({"ensembl_id": ens}, index=ens)
    x = sp.csr_matrix(np.ones((1, genes), np.float32))
    ad.AnnData(X=x, obs=pd.DataFrame(index=["c0"]), var=var).write_h5ad(tmp_path / "x.h5ad")
    materialize(tmp_path / "x.h5ad", tmp_path / "ds", progress=False)
    out = oj.GeneformerTokens(
        max_len=10, mask_prob=0.0, vocab=tmp_path / "tokens.pkl", medians=tmp_path / "medians.pkl"
    )
    got = oj.tokenize(oj.open_dataset(tmp_path / "ds"), [0], out)
    assert got["input_ids"][0][got["attention_mask"][0]].tolist() == [2, 4, 5, 6, 7, 8, 9, 10, 11, 3]


def test_columns_of_one_gene_rank_by_a_median_of_the_gene_whichever_comes_first(tmp_path):
    """Columns sharing an Ensembl id are summed into the first; ranked by the dataset's own medians,
    which are per column, the sum takes the first column's median, or where that column was never
    expressed (no median), the next one's: the tokens do not depend on which column comes first."""
    import anndata as ad
    import pandas as pd
    import scipy.sparse as sp

    x = np.array([[0, 5, 3, 1], [0, 2, 4, 0], [0, 1, 1, 1]], np.float32)
    ens = ["ENSG00000000001.1", "ENSG00000000002", "ENSG00000000001.2", "ENSG00000000004"]
    vocab = tmp_path / "vocab.json"
    vocab.write_text(
        json.dumps(
            {
                "<pad>": 0,
                "<mask>": 1,
                "<cls>": 2,
                "<eos>": 3,
                "ENSG00000000001": 10,
                "ENSG00000000002": 11,
                "ENSG00000000004": 12,
            }
        )
    )
    out = oj.GeneformerTokens(max_len=8, mask_prob=0.0, vocab=vocab)
    got = []
    for name, order in (("unexpressed-first", [0, 1, 2, 3]), ("expressed-first", [2, 1, 0, 3])):
        var = pd.DataFrame({"ensembl_id": [ens[j] for j in order]}, index=[f"G{j}" for j in order])
        obs = pd.DataFrame(index=[f"c{i}" for i in range(3)])
        ad.AnnData(X=sp.csr_matrix(x[:, order]), obs=obs, var=var).write_h5ad(tmp_path / f"{name}.h5ad")
        materialize(tmp_path / f"{name}.h5ad", tmp_path / name, progress=False)
        got.append(oj.tokenize(oj.open_dataset(tmp_path / name), [0, 1, 2], out)["input_ids"])
    assert (got[0] == 10).any(axis=1).all()  # the gene is ranked in every cell
    np.testing.assert_array_equal(got[0], got[1])


def test_a_vocabulary_keyed_on_gene_symbols_matches_the_dataset_gene_names(token_ds, tmp_path):
    """scGPT's vocab.json maps gene symbols to ids: matched to the dataset's gene_name (here G0, G1,
    ...), it gives the tokens of the same ids keyed on the columns' Ensembl ids; the report says so."""
    ens = [e.split(".")[0] for e in token_ds.features["ensembl_id"]]
    names = token_ds.features["gene_name"].tolist()
    unique = [c for c in range(NUM_GENES) if ens.count(ens[c]) == 1 and c % 4]  # a quarter not in either
    specials = {"<pad>": 0, "<cls>": 1, "<eoc>": 2}
    by_symbol, by_id = tmp_path / "vocab.json", tmp_path / "by_id.json"
    by_symbol.write_text(json.dumps({**specials, **{names[c]: 10 + c for c in unique}}))
    by_id.write_text(json.dumps({**specials, **{ens[c]: 10 + c for c in unique}}))
    got = oj.tokenize(token_ds, ROWS, oj.ScGPTTokens(max_len=80, vocab=by_symbol), seed=2)
    assert_tokens_equal(got, oj.tokenize(token_ds, ROWS, oj.ScGPTTokens(max_len=80, vocab=by_id), seed=2))
    bound = oj.ScGPTTokens(vocab=by_symbol).bind(OutputContext.of_dataset(token_ds)).vocabulary
    assert str(bound.report).startswith(f"{len(unique)} of 300 dataset genes have a token (by gene symbol)")
    lower = tmp_path / "lower.json"  # symbols compare as written
    lower.write_text(json.dumps({**specials, **{names[c].lower(): 10 + c for c in unique}}))
    with pytest.raises(
        oj.OmicsIOError, match=r"lower.json shares no gene with .* \(compared on gene symbols, as written\)"
    ):
        oj.tokenize(token_ds, [4], oj.ScGPTTokens(vocab=lower))


def test_pickles_are_never_executed(token_ds, tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps({"ENSG00000000001": Exploit()}))
    with pytest.raises(oj.OmicsIOError, match=r"evil.pkl: refused to unpickle posix.system"):
        oj.tokenize(token_ds, [4], oj.GeneformerTokens(vocab=evil))
    assert not marker.exists()
    listed = tmp_path / "list.pkl"
    listed.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(oj.OmicsIOError, match=r"list.pkl: holds list, not a dict"):
        oj.tokenize(token_ds, [4], oj.ScGPTTokens(vocab=listed))

    class ObjectScalar:  # a NumPy scalar of dtype object would hold whatever the file builds
        def __reduce__(self):  # numpy's scalar builder, by the name this NumPy pickles it under
            return (np.int64(0).__reduce__()[0], (np.dtype(object), "anything"))

    hidden = tmp_path / "hidden.pkl"
    hidden.write_bytes(pickle.dumps({"ENSG00000000001": ObjectScalar()}))
    with pytest.raises(
        oj.OmicsIOError, match=r"hidden.pkl: refused to unpickle numpy scalar of dtype object"
    ):
        oj.tokenize(token_ds, [4], oj.GeneformerTokens(vocab=hidden))
    array = tmp_path / "array.pkl"
    array.write_bytes(pickle.dumps({"ENSG00000000001": np.arange(3)}))
    with pytest.raises(oj.OmicsIOError, match=r"array.pkl: refused to unpickle numpy.*_reconstruct"):
        oj.tokenize(token_ds, [4], oj.GeneformerTokens(vocab=array))
    assert not marker.exists()


def test_geneformers_published_pickles_of_numpy_scalars_are_read(token_ds, vocab_file, tmp_path):
    """Geneformer's published token and median dictionaries hold numpy.int64 / numpy.float64 values
    (pickled as ``numpy.core.multiarray.scalar``): read as the same dictionaries of Python numbers."""
    path, vocab = vocab_file
    ens = [e.split(".")[0] for e in token_ds.features["ensembl_id"]]
    medians = {e: 0.5 + (k % 7) for k, e in enumerate(dict.fromkeys(ens))}
    plain, numpy_ = tmp_path / "plain.pkl", tmp_path / "numpy.pkl"
    plain.write_bytes(pickle.dumps(medians))
    numpy_.write_bytes(pickle.dumps({e: np.float64(m) for e, m in medians.items()}))
    numpy_vocab = tmp_path / "numpy_vocab.pkl"
    numpy_vocab.write_bytes(pickle.dumps({k: np.int64(v) for k, v in vocab.items()}))
    want = oj.tokenize(token_ds, ROWS, oj.GeneformerTokens(max_len=64, vocab=path, medians=plain))
    got = oj.tokenize(token_ds, ROWS, oj.GeneformerTokens(max_len=64, vocab=numpy_vocab, medians=numpy_))
    assert_tokens_equal(got, want)


def test_dataset_without_statistics_names_the_command(token_ds, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(token_ds.path, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["files"] = [f for f in manifest["files"] if f["path"] != "gene_stats.parquet"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(oj.OmicsIOError, match=r"omicsio-materialize stats .*old"):
        oj.tokenize(old, [4], oj.GeneformerTokens())
    oj.tokenize(old, [4], oj.ScGPTTokens())  # scGPT needs no corpus statistics


# ----------------------------------------------------------------------------- the sort
@numba.njit
def _sorted_by_radix(keys):
    n = keys.shape[0]
    k, order = keys.copy(), np.arange(n).astype(np.int32)
    radix_sort(k, order, n, np.empty(n, np.uint32), np.empty(n, np.int32), np.empty((3, 2048), np.int32))
    return k, order


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 32), st.integers(0, 2**32 - 1), st.lists(st.integers(0, 2**32 - 1), max_size=600))
def test_radix_sort_is_a_stable_sort_for_every_span(bits, base, draws):
    """Keys ``base + draw mod 2^bits`` (wrapping): 0 to 32 bits of span, so 0 to 3 passes of any
    digit width; many ties at small spans. Equal to numpy's stable argsort."""
    keys = (
        ((np.array(draws, np.uint64) % (1 << bits)) + base).astype(np.uint32)
        if draws
        else np.empty(0, np.uint32)
    )
    got_keys, order = _sorted_by_radix(keys)
    want = np.argsort(keys, kind="stable")
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(got_keys, keys[want])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=4),
    st.integers(0, 20),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**20 - 1)), max_size=600),
)
def test_radix_sort_orders_keys_crowded_below_its_radix_bits(centers, window_bits, draws):
    """Keys in narrow windows (``center + draw mod 2^window_bits``) above up to four random centers:
    when the span is wide, the radix passes leave each window's keys in their original order, and
    the insertion pass (or, past its budget, passes on every bit) must finish the order stably."""
    keys = np.array(
        [(centers[c % len(centers)] + (d % (1 << window_bits))) % 2**32 for c, d in draws], np.uint32
    )
    got_keys, order = _sorted_by_radix(keys)
    want = np.argsort(keys, kind="stable")
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(got_keys, keys[want])


@numba.njit
def _first_by_radix(keys, limit, distinct=False):
    """The first ``limit`` keys of `rank_sort` (without ``distinct``: `sort_into`) and their order."""
    n = keys.shape[0]
    k, order = keys.copy(), np.arange(n).astype(np.int32)
    out_k, out_order = np.empty(n, np.uint32), np.empty(n, np.int32)
    hist = np.empty((3, 2048), np.int32)
    if n and rank_sort(k, order, n, k.min(), k.max(), out_k, out_order, hist, limit, distinct):
        return out_k[:limit], out_order[:limit]
    return k[:limit], order[:limit]


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 32),
    st.lists(st.integers(0, 2**32 - 1), max_size=600),
    st.integers(1, 700),
    st.integers(0, 2**20),
)
def test_radix_sort_limited_to_its_first_keys_orders_them_as_a_full_sort(bits, draws, limit, window):
    """The partial selection (``limit`` below the key count: Geneformer's cells longer than its
    sequence): the first ``limit`` keys out are those of a full stable sort, at every span, with
    many ties, and with the keys crowded in one window (past the insertion budget)."""
    keys = np.array(draws, np.uint64) % (1 << bits)
    if window and len(keys) > 2:  # all but two keys inside one bucket's width
        keys[2:] = 2**31 + keys[2:] % window
        keys[:2] = (0, 2**32 - 1)
    keys = keys.astype(np.uint32)
    got_keys, order = _first_by_radix(keys, limit)
    want = np.argsort(keys, kind="stable")[:limit]
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(got_keys, keys[want])


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 32), st.lists(st.integers(0, 2**32 - 1), max_size=600), st.integers(1, 700), st.booleans()
)
def test_rank_sort_orders_its_first_keys_as_a_full_sort_either_way(bits, draws, limit, distinct):
    """Geneformer's ranking sort, told its keys seldom tie (passes on every bit) or not (the bucket
    pass): the first ``limit`` keys out are a full stable sort's, at every span and with ties."""
    keys = (np.array(draws, np.uint64) % (1 << bits)).astype(np.uint32)
    got_keys, order = _first_by_radix(keys, limit, distinct)
    want = np.argsort(keys, kind="stable")[:limit]
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(got_keys, keys[want])


def test_radix_sort_gives_up_insertion_past_its_budget_and_still_sorts():
    """A window of 500 descending keys inside a 32-bit span: the radix passes on the top bits see one
    bucket, insertion would move every key past all the others; the budget stops it and full passes
    finish, stably (ties included), for a full sort and for the first 300 keys alone."""
    keys = np.concatenate([[0, 2**32 - 1], np.repeat(np.arange(2**20 + 250, 2**20, -1), 2)]).astype(np.uint32)
    partial, vals = keys[2:].copy(), np.arange(len(keys) - 2).astype(np.int32)
    assert not finish_by_insertion(partial, vals, len(partial), 4 * len(partial))
    np.testing.assert_array_equal(np.sort(vals), np.arange(len(partial)))  # stopped between two keys
    np.testing.assert_array_equal(partial, keys[2:][vals])
    got_keys, order = _sorted_by_radix(keys)
    want = np.argsort(keys, kind="stable")
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(got_keys, keys[want])
    got_keys, order = _first_by_radix(keys, 300)  # the partial selection gives up alike
    np.testing.assert_array_equal(order, want[:300])
    np.testing.assert_array_equal(got_keys, keys[want[:300]])


@numba.njit
def _gaps_of(u, log_keep):
    """The integer gaps `selected_positions` walks for the draws ``u`` (a multiple of `GAP_BLOCK`)."""
    block, out = np.empty(3 * GAP_BLOCK), np.empty(len(u), np.int64)
    for start in range(0, len(u), GAP_BLOCK):
        block[:GAP_BLOCK] = u[start : start + GAP_BLOCK]
        gaps(block, log_keep)
        for b in range(GAP_BLOCK):
            out[start + b] = np.int64(min(block[GAP_BLOCK + b], 4.0e18))
    return out


@pytest.mark.parametrize("p", [0.15, 0.5, 0.01, 1e-6, 0.999, 1 - 2**-40])
def test_mask_gaps_are_those_of_libms_log(p):
    """The masking's gaps, from a vectorized series for the log, are ``int(log(u) / log1p(-p))`` with
    libm's log for every draw: 96,000 at random, the draws 0 and just below 1, and draws on the 2**-53
    grid whose quotient is a whole number or next to one (``u = (1 - p)**k`` rounded, and its
    neighbours), where the series' error could move the integer part and libm's log is taken."""
    lk = math.log1p(-p)
    rng = np.random.default_rng(0)
    grid = 2.0**53
    k = np.arange(1, 4000)
    k = k[lk * k > math.log(1 / grid)]  # (1 - p)**k above the smallest draw but 0
    whole = np.floor(np.exp(lk * k) * grid)
    crafted = np.unique(np.concatenate([whole + d for d in (-2, -1, 0, 1, 2)]).clip(0, grid - 1)) / grid
    u = np.concatenate([rng.integers(0, 2**53, 96_000) / grid, [0.0, 1 - 1 / grid], crafted])
    u = np.concatenate([u, np.zeros(-len(u) % GAP_BLOCK)])
    want = [int(min(math.log(max(x, 2.0**-53)) / lk, 4.0e18)) for x in u]
    np.testing.assert_array_equal(_gaps_of(u, lk), want)
    quotients = np.array([math.log(max(x, 2.0**-53)) / lk for x in crafted])
    assert np.any(np.abs(quotients - np.round(quotients)) <= 1e-12 * quotients)  # the fallback was taken
