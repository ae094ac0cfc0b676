"""`ktx.models.tea.TeaClassifierModel` (TEA-BERT's task-embedding injections): each
injection against a hand-written NumPy forward (float64), zero task embeddings give plain
BERT (`EncoderClassifierModel`) exactly, different tasks give different outputs, a key
offset alone changes nothing, and a Trainer run."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from ktx.analysis import params as params_lib
from ktx import partitioning
from ktx.training import trainer as trainer_lib
from ktx.models import bert, encoder, tea

TINY = bert.BertConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                       intermediate_size=64, max_position=16)
# (injection, task_layers): every injection, with all or some layers task-specific.
CASES = [("input", None), ("qkv", None), ("qkv", (1,)), ("projected", (0,)),
         ("projected_act", None)]
_erf = np.vectorize(math.erf)


def _batch(task_id=(0, 1, 0, 1, 1, 0, 1, 0)):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, (8, 8)).astype(np.int32)
    ids[::2, 6:] = 0
    return {
        "input_ids": ids,
        "token_type_ids": (np.arange(8) >= 4).astype(np.int32)[None].repeat(8, 0),
        "attention_mask": (ids > 0).astype(np.int32),
        "label": np.array([0, 0.5, 2, -1.0, 1, 1, 0, 0.2], np.float32),
        "task_id": np.asarray(task_id, np.int32),
    }


def _model(injection, task_layers=None, **kw):
    return tea.TeaClassifierModel(TINY, num_labels=(3, 1), injection=injection,
                                  task_layers=task_layers, task_embedding_dim=6, **kw)


def _params(model, scale=10.0):
    """Initial parameters with the task embeddings scaled up: their effect on the hidden
    states (> 1e-2) is far above float32 rounding."""
    params = nn.unbox(model.init_variables(jax.random.key(0), _batch())["params"])
    params = jax.tree.map(np.asarray, params)
    cond = params["conditioning"]
    for key in ("input_embedding", "task_embedding") + tuple(k for k in cond if k.startswith("layers_")):
        if key in cond and "embedding" in cond[key]:
            cond[key]["embedding"] = cond[key]["embedding"] * scale
    return params


# ------------------------------------------------------------------ NumPy forward

def _ln(x, p, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def _gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _np_forward(params, batch, injection, layers, activation="tanh"):
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    ids, types, tid = batch["input_ids"], batch["token_type_ids"], batch["task_id"]
    mask = batch["attention_mask"] > 0
    emb, cond = p["embeddings"], p["conditioning"]
    x = (emb["word_embeddings"]["embedding"][ids]
         + emb["position_embeddings"]["embedding"][None, : ids.shape[1]]
         + emb["token_type_embeddings"]["embedding"][types])
    if injection == "input":
        x = x + cond["input_embedding"]["embedding"][tid][:, None]
    x = _ln(x, emb["layer_norm"])
    h, d = TINY.num_heads, TINY.head_dim
    for i in range(TINY.num_layers):
        lp = p[f"layers_{i}"]
        att = lp["attention"]
        off = np.zeros((len(ids), 3, h, d))
        if injection != "input" and i in layers:
            if injection == "qkv":
                per_task = cond[f"layers_{i}"]["embedding"]
            else:
                per_task = np.einsum("td,dkhe->tkhe", cond["task_embedding"]["embedding"],
                                     cond[f"layers_{i}"]["kernel"])
                if injection == "projected_act":
                    per_task = {"tanh": np.tanh, "relu": lambda v: np.maximum(v, 0),
                                "gelu": _gelu}[activation](per_task)
            off = per_task[tid]
        q, k, v = (np.einsum("ble,ehd->blhd", x, att[n]["kernel"]) + att[n]["bias"]
                   + off[:, j][:, None] for j, n in enumerate(("query", "key", "value")))
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        s = np.where(mask[:, None, None, :], s, -1e30)
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        o = np.einsum("bqhd,hde->bqe", np.einsum("bhqk,bkhd->bqhd", s, v), att["out"]["kernel"])
        a = _ln(x + o + att["out"]["bias"], lp["attention_layer_norm"])
        f = _gelu(a @ lp["intermediate"]["kernel"] + lp["intermediate"]["bias"])
        x = _ln(a + f @ lp["output"]["kernel"] + lp["output"]["bias"], lp["output_layer_norm"])
    pooled = np.tanh(x[:, 0] @ p["pooler"]["kernel"] + p["pooler"]["bias"])
    return x, [pooled @ hp["kernel"] + hp["bias"] for _, hp in sorted(p["task_heads"].items())]


@pytest.mark.parametrize("injection,task_layers", CASES)
def test_matches_a_numpy_forward(injection, task_layers):
    model = _model(injection, task_layers)
    params, batch = _params(model), _batch()
    layers = range(TINY.num_layers) if task_layers is None else task_layers
    hidden, logits = _np_forward(params, batch, injection, layers)
    np.testing.assert_allclose(model.encode(params, batch)[0][-1], hidden, rtol=0, atol=1e-5)
    for got, want in zip(model.logits(params, batch), logits):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("injection,task_layers", CASES)
def test_zero_task_embeddings_are_plain_bert_and_tasks_differ(injection, task_layers):
    model = _model(injection, task_layers)
    params, batch = _params(model), _batch()
    plain = encoder.EncoderClassifierModel(TINY, num_labels=(3, 1))
    backbone = {k: v for k, v in params.items() if k != "conditioning"}
    want = plain.logits(backbone, batch)
    zero = jax.tree.map(np.zeros_like, params["conditioning"])
    if injection.startswith("projected"):  # z_t = 0, projections kept
        zero = dict(params["conditioning"], task_embedding=zero["task_embedding"])
    got = model.logits(dict(params, conditioning=zero), batch)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    as_0, _ = model.encode(params, dict(batch, task_id=np.zeros(8, np.int32)))
    as_1, _ = model.encode(params, dict(batch, task_id=np.ones(8, np.int32)))
    assert np.abs(np.asarray(as_0[-1]) - np.asarray(as_1[-1])).max() > 1e-2


def test_a_key_offset_alone_changes_nothing():
    model = _model("qkv")
    params, batch = _params(model), _batch()
    only_k = jax.tree.map(np.zeros_like, params["conditioning"])
    for name, table in params["conditioning"].items():
        only_k[name]["embedding"][:, 1] = table["embedding"][:, 1]
    got = model.logits(dict(params, conditioning=only_k), batch)
    want = encoder.EncoderClassifierModel(TINY, num_labels=(3, 1)).logits(
        {k: v for k, v in params.items() if k != "conditioning"}, batch)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)


def test_trains_through_the_trainer():
    model = _model("projected_act", (1,))
    tr = trainer_lib.Trainer(model, optax.adam(1e-3), mesh=partitioning.create_mesh(1))
    state = tr.init_state(jax.random.key(0), _batch())
    before = np.asarray(state.params["conditioning"]["task_embedding"]["embedding"])
    losses = []
    for _ in range(4):
        state, metrics = tr.train_step(state, _batch(), jax.random.key(1))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses
    after = np.asarray(state.params["conditioning"]["task_embedding"]["embedding"])
    assert np.abs(after - before).max() > 0


def test_parameter_counts():
    """BERT-Base, 12 task-specific layers: the paper's +0.025% per task for `qkv`."""
    base = 109_482_240 + 2 * (768 * 2 + 2)
    for injection, per_task, shared in (("input", 768, 0), ("qkv", 12 * 3 * 768, 0),
                                        ("projected", 32, 12 * 32 * 3 * 768)):
        report = params_lib.count_parameters(tea.TeaClassifierModel(
            bert.BertConfig(), num_labels=2, num_tasks=2, injection=injection))
        assert report["backbone"] == base
        assert report["task_conditioned"] == 2 * per_task + shared, injection
    assert round(12 * 3 * 768 / 109_482_240 * 100, 3) == 0.025


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="injection='prefix'"):
        _model("prefix")
    with pytest.raises(ValueError, match=r"task_layers=\(0,\) with injection='input'"):
        _model("input", (0,))
    with pytest.raises(ValueError, match=r"task_layers=\(2,\)"):
        _model("qkv", (2,))
    with pytest.raises(ValueError, match="activation='sigmoid'"):
        _model("projected_act", activation="sigmoid")
