"""Transformer pretraining models on tiny presets: shapes, padding really masked, overfitting a fixed
batch, bfloat16 vs float32, a bit-identical step, the optimizer, presets and errors.

Every model call goes through a shared ``filter_jit`` (eager dispatch compiles each op on its own,
which is slow on a small CPU); the tests reuse the same few compiled programs.
"""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train import _layers
from train._errors import TrainError
from train._geneformer_model import GeneformerModel
from train._scgpt_model import ScGPTModel
from train._transformer import (
    PRESETS,
    _decay_mask,
    flops_per_cell,
    make_optimizer,
    make_pretrain_model,
    make_pretrain_step,
)

VOCAB, L, B = 128, 32, 4
PAD, CLS, EOS, MASK = 0, 1, 2, VOCAB - 1  # genes are 3 .. VOCAB - 2
WIDTH = PRESETS["tiny"].width


def geneformer_batch(seed: int) -> dict:
    """V2-style rows: CLS, genes, EOS, then PAD; ~15% of the genes replaced by MASK and labelled."""
    rng = np.random.default_rng(seed)
    length = rng.integers(L // 2, L - 2, size=B).astype(np.int32)
    pos = np.arange(L)[None, :]
    ids = rng.integers(3, MASK, size=(B, L)).astype(np.int32)
    ids[:, 0] = CLS
    ids[pos == length[:, None] - 1] = EOS
    ids[pos >= length[:, None]] = PAD
    selected = (pos > 0) & (pos < length[:, None] - 1) & (rng.random((B, L)) < 0.15)
    selected[:, 1] = True  # at least one prediction per cell
    return {
        "input_ids": np.where(selected, MASK, ids).astype(np.int32),
        "attention_mask": pos < length[:, None],
        "labels": np.where(selected, ids, -100).astype(np.int32),
        "length": length,
    }


def scgpt_batch(seed: int) -> dict:
    """CLS (value -2), genes with bins 1..50, PAD (value -2); ~40% of the genes masked (value -1)."""
    rng = np.random.default_rng(seed)
    m = rng.integers(L // 2, L - 1, size=B)  # genes per cell
    pos = np.arange(L)[None, :]
    is_gene = (pos >= 1) & (pos <= m[:, None])
    gene_ids = np.where(is_gene, rng.integers(3, MASK, size=(B, L)), PAD).astype(np.int32)
    gene_ids[:, 0] = CLS
    values = np.where(is_gene, rng.integers(1, 51, size=(B, L)), -2).astype(np.float32)
    mask = is_gene & (rng.random((B, L)) < 0.4)
    mask[:, 1] = True
    return {
        "gene_ids": gene_ids,
        "values": values,
        "masked_values": np.where(mask, -1.0, values).astype(np.float32),
        "mask": mask,
        "pad_mask": pos > m[:, None],
    }


BATCHES = {"geneformer": geneformer_batch, "scgpt": scgpt_batch}


def model_of(kind: str, seed: int = 0, **kwargs):
    return make_pretrain_model(kind, "tiny", VOCAB, L, key=jax.random.key(seed), **kwargs)


@eqx.filter_jit
def outputs_of(model, batch):
    """(loss without dropout, CLS embedding, mean embedding): one compiled program per model."""
    return model.loss(batch), model.embed(batch, pool="cls"), model.embed(batch, pool="mean")


def loss_of(model, batch):
    return outputs_of(model, batch)[0]


def embed_of(model, batch, pool):
    return outputs_of(model, batch)[1 if pool == "cls" else 2]


def arrays(tree) -> list:
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


@pytest.fixture(scope="module")
def models():
    return {kind: model_of(kind) for kind in BATCHES}


@pytest.fixture(scope="module")
def trained(models):
    """30 AdamW steps (with dropout) on one fixed batch per model: (losses, model, opt_state, step)."""
    out = {}
    for kind, model in models.items():
        batch = BATCHES[kind](1)
        opt = make_optimizer(3e-3, warmup_steps=3, total_steps=100)
        opt_state = opt.init(eqx.filter(model, eqx.is_array))
        step, key, losses = make_pretrain_step(opt), jax.random.key(5), []
        for s in range(30):
            model, opt_state, loss = step(model, opt_state, batch, key, np.int32(s))
            losses.append(float(loss))
        out[kind] = (losses, model, opt_state, step)
    return out


def test_geneformer_shapes_and_dtypes(models):
    model, batch = models["geneformer"], geneformer_batch(0)
    assert isinstance(model, GeneformerModel) and model.decoder is None  # tied to the token embedding
    logits = eqx.filter_eval_shape(jax.vmap(model), batch["input_ids"], batch["attention_mask"])
    assert logits.shape == (B, L, VOCAB) and logits.dtype == jnp.float32
    for pool in ("cls", "mean"):
        emb = embed_of(model, batch, pool)
        assert emb.shape == (B, WIDTH) and emb.dtype == jnp.float32 and np.isfinite(emb).all()
    loss = loss_of(model, batch)
    assert loss.shape == () and loss.dtype == jnp.float32
    assert abs(float(loss) - np.log(VOCAB)) < 1.0  # small init: near-uniform predictions


def test_scgpt_shapes_and_dtypes(models):
    model, batch = models["scgpt"], scgpt_batch(0)
    assert isinstance(model, ScGPTModel)
    args = batch["gene_ids"], batch["masked_values"], batch["pad_mask"]
    pred = eqx.filter_eval_shape(jax.vmap(model), *args)
    assert pred.shape == (B, L) and pred.dtype == jnp.float32
    emb = embed_of(model, batch, "cls")
    assert emb.shape == (B, WIDTH) and emb.dtype == jnp.float32 and np.isfinite(emb).all()
    loss = loss_of(model, batch)
    assert loss.shape == () and loss.dtype == jnp.float32 and np.isfinite(loss)


def with_noisy_padding(kind: str, batch: dict, seed: int) -> dict:
    """``batch`` with random tokens (and values) at its padded positions."""
    rng = np.random.default_rng(seed)
    genes, values = rng.integers(3, MASK, size=(B, L), dtype=np.int32), rng.integers(1, 51, size=(B, L))
    if kind == "geneformer":
        noisy = dict(batch, input_ids=np.where(batch["attention_mask"], batch["input_ids"], genes))
        assert (noisy["input_ids"] != batch["input_ids"]).any()
        return noisy
    pad = batch["pad_mask"]
    return dict(
        batch,
        gene_ids=np.where(pad, genes, batch["gene_ids"]),
        masked_values=np.where(pad, values, batch["masked_values"]).astype(np.float32),
        values=np.where(pad, values, batch["values"]).astype(np.float32),
    )


@pytest.mark.parametrize("kind", ["geneformer", "scgpt"])
def test_padding_is_masked(models, kind):
    model, batch = models[kind], BATCHES[kind](2)
    noisy = with_noisy_padding(kind, batch, 3)
    for got, want in zip(outputs_of(model, noisy), outputs_of(model, batch), strict=True):  # loss, cls, mean
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # ...while a change at a real position does change the CLS embedding
    ids = "input_ids" if kind == "geneformer" else "gene_ids"
    moved = dict(batch, **{ids: batch[ids].copy()})
    moved[ids][:, 2] = np.where(moved[ids][:, 2] == 5, 6, 5)
    assert not np.allclose(embed_of(model, moved, "cls"), embed_of(model, batch, "cls"), atol=1e-6)


@pytest.mark.parametrize("kind", ["geneformer", "scgpt"])
def test_padding_is_masked_in_the_training_step(trained, kind):
    """With dropout on: the same loss and the same updated parameters."""
    _, model, opt_state, step = trained[kind]
    batch, key = BATCHES[kind](1), jax.random.key(5)
    a, _, loss_a = step(model, opt_state, batch, key, np.int32(30))
    b, _, loss_b = step(model, opt_state, with_noisy_padding(kind, batch, 4), key, np.int32(30))
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6)
    for x, y in zip(arrays(a), arrays(b), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["geneformer", "scgpt"])
def test_overfits_a_fixed_batch(trained, kind):
    losses = trained[kind][0]
    assert all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < 0.5 * losses[0], losses


@pytest.mark.parametrize("kind", ["geneformer", "scgpt"])
def test_step_is_deterministic(trained, kind):
    _, model, opt_state, step = trained[kind]
    batch, key = BATCHES[kind](1), jax.random.key(5)
    a, _, loss_a = step(model, opt_state, batch, key, np.int32(30))
    b, _, loss_b = step(model, opt_state, batch, key, np.int32(30))
    assert all(np.array_equal(x, y) for x, y in zip(arrays(a), arrays(b), strict=True))
    assert np.asarray(loss_a).tobytes() == np.asarray(loss_b).tobytes()
    # the same parameters and batch at another step draw other dropout masks: another loss
    _, _, loss_c = step(model, opt_state, batch, key, np.int32(31))
    assert float(loss_c) != float(loss_a)


@pytest.mark.parametrize(("kind", "rtol"), [("geneformer", 0.02), ("scgpt", 0.05)])
def test_bfloat16_close_to_float32(models, kind, rtol):
    batch = BATCHES[kind](6)
    f32, bf16 = models[kind], model_of(kind, compute_dtype=jnp.bfloat16)
    # the same float32 parameters, only the compute dtype differs
    assert all(x.dtype == jnp.float32 for x in arrays(bf16))
    assert all(np.array_equal(x, y) for x, y in zip(arrays(f32), arrays(bf16), strict=True))
    loss32, loss16 = float(loss_of(f32, batch)), float(loss_of(bf16, batch))
    assert np.isfinite(loss16) and abs(loss16 - loss32) <= rtol * abs(loss32), (loss32, loss16)
    assert loss16 != loss32  # bfloat16 really was used


@pytest.mark.parametrize("kind", ["geneformer", "scgpt"])
def test_an_unrolled_encoder_gives_the_scanned_ones_loss_and_gradients(models, kind, monkeypatch):
    """The tiny preset's 2 layers run unrolled (`_layers.UNROLL_LAYERS`); scanned, as deeper stacks
    run, the loss and every gradient are the same, bit for bit, dropout included."""
    batch, key = BATCHES[kind](3), jax.random.key(2)

    def loss_and_grads():  # traced anew at each call: the unroll is read while tracing
        return eqx.filter_jit(lambda m: eqx.filter_value_and_grad(lambda mm: mm.loss(batch, key=key))(m))(
            models[kind]
        )

    def unroll() -> list[str]:  # the encoder's scan as traced: unroll=2 (both layers) or 1 (a loop)
        hidden = jnp.zeros((L, WIDTH), jnp.float32)
        return re.findall(
            r"unroll=\w+", str(jax.make_jaxpr(lambda h: models[kind].encoder(h, jnp.ones(L, bool)))(hidden))
        )

    assert unroll() == ["unroll=2"]
    unrolled = loss_and_grads()
    monkeypatch.setattr(_layers, "UNROLL_LAYERS", 0)
    assert unroll() == ["unroll=1"]
    scanned = loss_and_grads()
    assert float(unrolled[0]) == float(scanned[0])
    for a, b in zip(arrays(unrolled[1]), arrays(scanned[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_max_predictions_gathers_the_labelled_positions(models):
    batch = geneformer_batch(7)
    gathered = model_of("geneformer", max_predictions=L)  # same key: same parameters
    np.testing.assert_allclose(loss_of(gathered, batch), loss_of(models["geneformer"], batch), rtol=1e-5)


def test_untied_decoder():
    model = model_of("geneformer", tie_embeddings=False)
    assert model.decoder is not None and model.decoder.weight.shape == (VOCAB, WIDTH)
    loss = eqx.filter_eval_shape(lambda m: m.loss(geneformer_batch(0)), model)  # traced, not compiled
    assert loss.shape == () and loss.dtype == jnp.float32


def test_weight_decay_skips_biases_and_layer_norms(models):
    mask = _decay_mask(eqx.filter(models["scgpt"], eqx.is_array))
    assert mask.encoder.layers.qkv.weight is True and mask.encoder.layers.qkv.bias is False
    assert mask.encoder.layers.ln1.weight is False and mask.value_norm.bias is False
    assert mask.gene_embedding.weight is True

    # the update itself, on a small tree of the same module types (a quick compile)
    def small_tree():
        return {
            "ln": eqx.nn.LayerNorm(4),
            "lin": eqx.nn.Linear(3, 4, key=jax.random.key(0)),
            "emb": eqx.nn.Embedding(5, 4, key=jax.random.key(1)),
            "bias": jnp.zeros(4),
        }

    abstract = eqx.filter_eval_shape(small_tree)
    params = jax.tree.map(lambda x: jnp.full(x.shape, 2.0), abstract)
    opt = make_optimizer(1.0, warmup_steps=0, total_steps=10, weight_decay=0.1)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(opt.update)(zeros, opt.init(params), params)  # step 0, no warmup: lr = 1
    np.testing.assert_allclose(updates["lin"].weight, -0.2)
    np.testing.assert_allclose(updates["emb"].weight, -0.2)
    for no_decay in (updates["lin"].bias, updates["ln"].weight, updates["ln"].bias, updates["bias"]):
        assert not np.asarray(no_decay).any()


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_learning_rate_schedule(schedule):
    params = {"w": jnp.zeros((2, 2))}
    opt = make_optimizer(2.0, warmup_steps=4, total_steps=12, schedule=schedule, weight_decay=0.0)
    update = jax.jit(opt.update)
    # constant gradients: every Adam update moves a parameter by ~lr, so the updates trace the schedule
    state, grads, moves = opt.init(params), {"w": jnp.ones((2, 2))}, []
    for _ in range(12):
        updates, state = update(grads, state, params)
        moves.append(-float(updates["w"][0, 0]))
    assert moves[0] == 0.0 and abs(moves[2] - 1.0) < 1e-3 and abs(moves[4] - 2.0) < 1e-3
    assert moves[4] > moves[8] > moves[11] > 0.0


def test_presets_and_unknown_names():
    assert PRESETS["geneformer-v1"].num_layers == 6 and PRESETS["geneformer-v1"].activation == "relu"
    assert PRESETS["scgpt"].width == 512 and PRESETS["scgpt"].mlp_width == 512
    key = jax.random.key(0)
    with pytest.raises(TrainError, match=r"preset must be one of tiny, geneformer-v1, scgpt.*got 'huge'"):
        make_pretrain_model("scgpt", "huge", VOCAB, L, key=key)
    with pytest.raises(TrainError, match=r"kind must be one of geneformer, scgpt; got 'bert'"):
        make_pretrain_model("bert", "tiny", VOCAB, L, key=key)
    with pytest.raises(TrainError, match="compute_dtype must be jnp.float32 or jnp.bfloat16"):
        model_of("scgpt", compute_dtype=jnp.float16)
    with pytest.raises(TrainError, match=r"schedule must be 'cosine' or 'linear'; got 'step'"):
        make_optimizer(1e-3, warmup_steps=1, total_steps=10, schedule="step")
    with pytest.raises(TrainError, match="warmup_steps=10, total_steps=10"):
        make_optimizer(1e-3, warmup_steps=10, total_steps=10)


def test_bad_batches_raise(models):
    short = make_pretrain_model("geneformer", "tiny", VOCAB, 16, key=jax.random.key(0))
    with pytest.raises(TrainError, match=r"L=32 .* max_len=16"):
        eqx.filter_eval_shape(lambda m: m.loss(geneformer_batch(0)), short)
    with pytest.raises(TrainError, match="pool must be 'cls' or 'mean'; got 'max'"):
        models["geneformer"].embed(geneformer_batch(0), pool="max")


def test_flops_match_the_parameter_count(models):
    cfg, layers = PRESETS["tiny"], models["geneformer"].encoder.layers
    matrices = sum(lin.weight.size for lin in (layers.qkv, layers.out, layers.fc1, layers.fc2))
    assert matrices == cfg.num_layers * (4 * WIDTH**2 + 2 * WIDTH * cfg.mlp_width)
    expected = L * (6 * matrices + 12 * cfg.num_layers * L * WIDTH) + 6 * L * (WIDTH**2 + WIDTH * VOCAB)
    assert flops_per_cell("geneformer", "tiny", L, vocab_size=VOCAB) == expected
    assert flops_per_cell("geneformer", "tiny", L, vocab_size=VOCAB, max_predictions=4) < expected
    big = PRESETS["scgpt"]  # scGPT whole-human: ~18.9M non-embedding encoder parameters
    assert big.num_layers * (4 * big.width**2 + 2 * big.width * big.mlp_width) == 18_874_368
    with pytest.raises(TrainError, match="vocab_size"):
        flops_per_cell("geneformer", "tiny", L)
