"""Encoder options shared by every ktx encoder classifier (EncoderClassifierModel, CA-MTL,
PALs, TEA): extra task-shared top layers (SlapBERT's shared layer), frozen bottom layers,
and the embedding perturbation SMART runs on."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx.models import bert, camtl, encoder, pals, tea
from ktx.training import optimizers
from ktx.training import initial_params
from ktx.training import trainer as trainer_lib

B, L = 8, 8  # 8 rows: the 8 fake CPU devices' data axis
CONFIG = bert.BertConfig(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2,
                         intermediate_size=32, max_position=16, dropout_rate=0.1,
                         attention_dropout_rate=0.1)
KINDS = ("plain", "camtl", "pals", "tea")


def _model(kind: str, config: bert.BertConfig = CONFIG, **kwargs):
    common = {"num_labels": (3, 1), **kwargs}
    if kind == "plain":
        return encoder.EncoderClassifierModel(config, **common)
    if kind == "camtl":
        return camtl.CaMtlClassifierModel(config, camtl=camtl.CaMtlConfig(max_seq_length=L),
                                          **common)
    if kind == "pals":
        return pals.PalsClassifierModel(config, pals_size=4, pals_heads=2, **common)
    return tea.TeaClassifierModel(config, injection="qkv", **common)


def _batch():
    ids = (np.arange(B * L).reshape(B, L) * 7) % 39 + 1
    ids[1, 5:] = 0  # padding keys
    return {"input_ids": jnp.asarray(ids, jnp.int32),
            "token_type_ids": jnp.asarray(np.arange(B * L).reshape(B, L) % 2, jnp.int32),
            "label": jnp.asarray([0.0, 2.0, 1.0, 0.0, 0.5, 1.5, -0.5, 0.25]),
            "task_id": jnp.asarray([0, 0, 0, 0, 1, 1, 1, 1], jnp.int32)}


def _params(model):
    return nn.unbox(model.init_variables(jax.random.key(0), _batch())["params"])


def _flat(tree):
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _last_hidden(kind, model, params, batch):
    """The encoder output the pooler reads (deterministic), from each model's own API."""
    if kind == "plain":
        ids = batch["input_ids"]
        return model.module.apply({"params": params}, ids, batch["token_type_ids"],
                                  method=bert.BertEncoder.encode)[0]
    if kind == "camtl":
        return model.encode(params, batch).last_hidden_state
    return model.encode(params, batch)[0][-1]


def test_shared_layer_is_one_more_bert_layer():
    """BertEncoder(n layers + 1 shared) = BertEncoder(n + 1 layers), the shared layer's
    parameters as layer n: exactly."""
    ids = _batch()["input_ids"]
    shared = bert.BertEncoder(CONFIG, num_shared_layers=1)
    params = nn.unbox(shared.init(jax.random.key(0), ids)["params"])
    assert set(params) == {"embeddings", "layers_0", "layers_1", "shared_layers", "pooler"}
    deeper = bert.BertEncoder(bert.BertConfig(**{**CONFIG.__dict__, "num_layers": 3}))
    moved = {k: v for k, v in params.items() if k != "shared_layers"}
    moved["layers_2"] = params["shared_layers"]["layers_0"]
    a = shared.apply({"params": params}, ids)
    b = deeper.apply({"params": moved}, ids)
    np.testing.assert_array_equal(a.last_hidden_state, b.last_hidden_state)
    np.testing.assert_array_equal(a.pooled_output, b.pooled_output)


@pytest.mark.parametrize("kind", KINDS)
def test_shared_layer_sits_between_encoder_and_pooler(kind):
    """logits = heads(tanh(pooler(SharedLayer(encoder output)[:, 0]))), the encoder output
    taken from the same model without the shared layer; no shared layer = no new params."""
    batch = _batch()
    with_shared, without = _model(kind, shared_layers=1), _model(kind)
    params = _params(with_shared)
    base = {k: v for k, v in params.items() if k != "shared_layers"}
    assert jax.tree.structure(base) == jax.tree.structure(_params(without))
    hidden = _last_hidden(kind, without, base, batch)
    mask = batch["input_ids"] > 0
    c = CONFIG
    layer = bert.BertLayer(c.num_heads, c.head_dim, c.intermediate_size, c.hidden_act,
                           c.layer_norm_eps)
    h = layer.apply({"params": params["shared_layers"]["layers_0"]}, hidden, mask, True)
    pooled = np.tanh(np.asarray(h[:, 0]) @ params["pooler"]["kernel"] + params["pooler"]["bias"])
    heads = params["task_heads"]
    expected = [pooled @ heads[f"task_{t}"]["kernel"] + heads[f"task_{t}"]["bias"] for t in (0, 1)]
    got = with_shared.logits(params, batch)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    assert f"shared_layers={1}" in repr(with_shared)


@pytest.mark.parametrize("kind", KINDS)
def test_mean_pooling_heads_read_the_masked_mean(kind):
    """pooling='mean': logits = heads(mean of the attended positions' last hidden states),
    no pooler parameters; the rest of the tree is the 'cls' model's."""
    batch = _batch()
    mean, cls = _model(kind, pooling="mean"), _model(kind)
    params = _params(mean)
    assert "pooler" not in params and "pooler" in _params(cls)
    assert jax.tree.structure(params) == jax.tree.structure(
        {k: v for k, v in _params(cls).items() if k != "pooler"})
    hidden = np.asarray(_last_hidden(kind, mean, params, batch), np.float64)
    mask = np.asarray(batch["input_ids"] > 0, np.float64)[..., None]
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    heads = params["task_heads"]
    got = mean.logits(params, batch)
    for t in (0, 1):
        expected = pooled @ heads[f"task_{t}"]["kernel"] + heads[f"task_{t}"]["bias"]
        np.testing.assert_allclose(got[t], expected, rtol=1e-5, atol=1e-6)
    assert "pooling='mean'" in repr(mean)
    if kind == "plain":
        assert camtl.ca_mtl_model(mean, camtl.CaMtlConfig(max_seq_length=L)).pooling == "mean"


def test_pooling_validation():
    with pytest.raises(ValueError, match=r"pooling='max'; accepted: \('cls', 'mean'\)"):
        encoder.EncoderClassifierModel(CONFIG, num_labels=(3, 1), pooling="max")


def test_camtl_factory_keeps_the_shared_layers():
    base = encoder.EncoderClassifierModel(CONFIG, num_labels=(3, 1), shared_layers=2)
    model = camtl.ca_mtl_model(base, camtl.CaMtlConfig(max_seq_length=L))
    assert model.shared_layers == 2
    assert set(_params(model)["shared_layers"]) == {"layers_0", "layers_1"}


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_layers_stay_bit_identical_after_a_step(kind):
    """frozen_layers=1: embeddings/* and layers_0/* are bit-identical after AdamW steps with
    weight decay; every other parameter group (layer 1, shared layer, pooler, heads, the
    method's conditioning, also of layer 0) trains."""
    model = _model(kind, shared_layers=1, frozen_layers=1)
    assert model.frozen_patterns == ("embeddings/.*", "layers_(?:0)/.*")
    tr = trainer_lib.Trainer(model, optimizers.adamw(1e-2, weight_decay=0.1))
    state = tr.init_state(jax.random.key(0), _batch())
    before = _flat(state.params)
    for _ in range(2):  # dropout on: the per-row path
        state, metrics = tr.train_step(state, _batch(), jax.random.key(1))
    assert np.isfinite(float(metrics["loss"]))
    after = _flat(state.params)
    frozen = {p for p in before if p.startswith(("embeddings/", "layers_0/"))}
    assert frozen and all(np.array_equal(before[p], after[p]) for p in frozen)
    moved = {p for p in before if not np.array_equal(before[p], after[p])}
    groups = {p.split("/")[0] for p in moved}
    assert {"layers_1", "shared_layers", "pooler", "task_heads"} <= groups
    if kind != "plain":
        assert any(p.startswith("conditioning/") for p in moved)
    if kind == "camtl":
        assert "conditioning/layers_0/attention_bias/film/kernel" in moved


def test_frozen_layers_validation_and_half():
    assert encoder.frozen_layer_patterns(4, "half") == ("embeddings/.*", "layers_(?:0|1)/.*")
    assert encoder.frozen_layer_patterns(4, 0) == ()
    with pytest.raises(ValueError, match=r"EncoderClassifierModel.frozen_layers=3"):
        encoder.EncoderClassifierModel(CONFIG, num_labels=(2,), frozen_layers=3)
    with pytest.raises(ValueError, match=r"PalsClassifierModel.shared_layers=-1"):
        pals.PalsClassifierModel(CONFIG, num_labels=(2,), pals_size=4, pals_heads=2,
                                 shared_layers=-1)


def test_frozen_gradients_are_zero():
    model = _model("plain", frozen_layers=1)
    params = _params(model)
    grads = jax.grad(lambda p: model.loss_fn(p, _batch(), jax.random.key(1))[0])(params)
    flat = _flat(grads)
    assert all(not v.any() for p, v in flat.items() if p.startswith(("embeddings/", "layers_0/")))
    assert flat["layers_1/output/kernel"].any()


@pytest.mark.parametrize("kind", KINDS)
def test_embedding_perturbation(kind):
    """A zero perturbation is no perturbation (exactly, dropout on); `δ` reaches the first
    layer's input: the same as adding it to the embedding output by hand (plain BERT)."""
    model, batch = _model(kind), _batch()
    params = _params(model)
    rng = jax.random.key(3)
    zero = jnp.zeros((B, L, CONFIG.hidden_size))
    for a, b in zip(model.logits(params, batch, rng, True),
                    model.logits(params, batch, rng, True, embedding_perturbation=zero)):
        np.testing.assert_array_equal(a, b)
    delta = 0.05 * jax.random.normal(jax.random.key(4), zero.shape)
    moved = model.logits(params, batch, rng, True, embedding_perturbation=delta)
    assert float(jnp.abs(moved[0] - model.logits(params, batch, rng, True)[0]).max()) > 1e-4
    if kind == "plain":
        enc = model.module
        ids, types = batch["input_ids"], batch["token_type_ids"]

        def by_hand(module):
            x = module.embeddings(ids, types, True) + delta
            for layer in module.layers:
                x = layer(x, ids > 0, True)
            return x

        expected = nn.apply(by_hand, enc)({"params": params})
        got = enc.apply({"params": params}, ids, types, embedding_perturbation=delta,
                        method=bert.BertEncoder.encode)[0]
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="embedding_perturbation has shape"):
        model.logits(params, batch, embedding_perturbation=zero[:, :3])


def test_a_bert_checkpoint_leaves_the_shared_layer_at_init():
    """`hf:DIR` fills the backbone; `shared_layers/` (no BERT checkpoint has it) starts
    from init, as the heads do."""
    from ktx import convert
    from tests.convert.conftest import checkpoint_fixture

    folder = checkpoint_fixture("hf_bert_tiny")
    model = encoder.EncoderClassifierModel(convert.read_hf_bert(folder).config,
                                           num_labels=(3, 1), shared_layers=1)
    spec = model.input_spec(2, {"inputs": 16})
    init = jax.tree.map(np.asarray, nn.unbox(model.init_variables(jax.random.key(0), spec)["params"]))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), init)
    _, report = initial_params.load_initial_params(f"hf:{folder}", abstract, init)
    assert {p.split("/")[0] for p in report.initialized} >= {"shared_layers", "task_heads"}
    assert not any(p.startswith("shared_layers/") for p in report.restored)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", ["minimal", "full"])
def test_remat_gives_the_same_gradients(kind, policy):
    """Every encoder method's layers rematerialise under `remat_policy` (the policy is in
    the compiled step) with the loss and gradients of 'none', dropout on."""
    import dataclasses

    batch = _batch()
    plain = _model(kind)
    remat = _model(kind, dataclasses.replace(CONFIG, remat_policy=policy))
    params = _params(plain)

    def grads(model):
        def loss(p):
            sums, _ = model.loss_sums(p, batch, jax.random.key(1), True)
            return sums.sum()
        return jax.value_and_grad(loss)(params)

    (l0, g0), (l1, g1) = grads(plain), grads(remat)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    text = str(jax.make_jaxpr(jax.grad(
        lambda p: remat.loss_sums(p, batch, jax.random.key(1), True)[0].sum()))(params))
    assert text.count("checkpoint[") + text.count("remat2[") + text.count("remat[") >= 2
