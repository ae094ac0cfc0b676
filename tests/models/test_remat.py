"""Rematerialisation (`T5Config.remat_policy`): the same losses and gradients as 'none' on
every gradient path (plain, per-task blocks and VJP, microbatches), conditioned models
included; the policy really reaches the layers; a bad value is a clear error."""

import contextlib
import dataclasses
import functools
import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import print_saved_residuals

from ktx import optim
from ktx.conditioning.model import ConditioningConfig, conditioned_model
from ktx.models import seq2seq, t5
from ktx.training import trainer as trainer_lib
from ktx.training.optimizers import TaskOptimizer
from tests.models.t5_batches import tiny_t5_batch

CFG = t5.T5Config(
    vocab_size=24, emb_dim=16, num_heads=2, num_encoder_layers=2, num_decoder_layers=2,
    head_dim=8, mlp_dim=32, dropout_rate=0.1,
)
# The compiled gradient checks run one encoder and one decoder layer (a layer is the unit
# a policy rematerialises, its dropout redrawn in the recomputation); the traced-only
# checks of where the policy reaches and what each layer keeps run CFG's two of each.
ONE_LAYER = dataclasses.replace(CFG, num_encoder_layers=1, num_decoder_layers=1)


def _batch():
    return tiny_t5_batch((0, 0, 1, 1), row_ids=True)


# Models, their initial parameters and the policy 'none' reference of each configuration
# are built once for the file (`_file_caches`).
@functools.cache
def _model(policy, conditioning=None, config=ONE_LAYER):
    model = seq2seq.EncoderDecoderModel(dataclasses.replace(config, remat_policy=policy), num_tasks=2)
    if conditioning is not None:
        model = conditioned_model(model, conditioning)
    return model


@functools.cache
def _params(model):
    return nn.unbox(model.init_variables(jax.random.key(0), _batch()))["params"]


def _param_shapes(model):
    """The shapes (`ShapeDtypeStruct`s) of `_params(model)`, traced, not computed."""
    return jax.eval_shape(lambda: nn.unbox(model.init_variables(jax.random.key(0), _batch())))[
        "params"]


def _loss_and_grad(model, params, train=True):
    batch = _batch()

    def loss(p):
        sums, _ = model.loss_sums(p, batch, jax.random.key(3), train)
        return sums.sum() / model.normalizer(batch).sum()

    return jax.jit(jax.value_and_grad(loss))(params)


@functools.cache
def _none_reference(conditioning):
    """Policy 'none': its parameters, loss and gradients (dropout on)."""
    plain = _model("none", conditioning)
    params = _params(plain)
    return params, *_loss_and_grad(plain, params)


@pytest.fixture(scope="module", autouse=True)
def _file_caches():
    yield
    for f in (_model, _params, _none_reference, _bert_none_reference):
        f.cache_clear()


def _close(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


@pytest.mark.parametrize("policy", ["minimal", "dots", "full"])
@pytest.mark.parametrize("conditioning", [None, "hyperprompt", "adapters"])
def test_same_loss_and_gradients_as_none(policy, conditioning):
    cond = None if conditioning is None else ConditioningConfig(
        method=conditioning, encoder_prompt_length=2, decoder_prompt_length=2,
        reduction_factor=4, task_embed_dim=4, task_hidden_dim=8, projected_dim=4)
    params, loss0, grad0 = _none_reference(cond)  # dropout on: per-row keys
    remat = _model(policy, cond)
    # Same parameter tree: a checkpoint of one loads into the other.
    assert jax.tree.structure(_param_shapes(remat)) == jax.tree.structure(params)
    loss1, grad1 = _loss_and_grad(remat, params)
    assert np.isfinite(loss0) and loss0 > 0
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    _close(grad1, grad0)


@pytest.mark.parametrize("policy", ["minimal", "full"])
def test_policy_reaches_the_layers(policy):
    """The backward pass of a rematerialised model holds `checkpoint` (remat) equations,
    one per layer; 'none' holds none. (The elementwise work's own checkpoints,
    `t5_stack.recompute_elementwise`, run with `prevent_cse=False` and are not counted.)"""
    batch = _batch()

    def count(model, params):
        def loss(p):
            return model.loss_sums(p, batch, jax.random.key(3), True)[0].sum()

        text = str(jax.make_jaxpr(jax.grad(loss))(params))
        return text.count("prevent_cse=True")

    params = _param_shapes(_model("none", config=CFG))  # traced only
    assert count(_model("none", config=CFG), params) == 0
    assert count(_model(policy, config=CFG), params) >= CFG.num_encoder_layers + CFG.num_decoder_layers


@pytest.mark.parametrize("scan", [False, True])
def test_attention_keeps_only_its_scores_for_the_backward_pass(scan):
    """Without remat, each attention keeps one `[B, H, Lq, Lk]` array for the backward pass,
    its raw scores: the softmax and the dropout are recomputed from them
    (`MultiHeadAttention.recompute_probabilities`), not saved twice (the probabilities and
    the dropped ones), and a scanned stack carries one such `[L, ...]` stack per attention."""
    batch = _batch()
    model = seq2seq.EncoderDecoderModel(dataclasses.replace(CFG, scan_layers=scan), num_tasks=2)
    params = _param_shapes(model)  # traced only: the residuals depend on shapes alone

    def loss(p):
        return model.loss_sums(p, batch, jax.random.key(3), True)[0].sum()

    b, l, h = 4, 4, CFG.num_heads  # every length of the tiny batch is 4
    assert CFG.num_encoder_layers == CFG.num_decoder_layers  # one stacked shape for both
    score = ((CFG.num_encoder_layers,) if scan else ()) + (b, h, l, l)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(loss, params)  # one "f32[2,4,...] <where>" line per residual
    kept = [line for line in printed.getvalue().splitlines()
            if line.startswith(f"f32[{','.join(map(str, score))}] ")]
    # encoder self-attention, decoder self- and cross-attention
    expected = 3 if scan else CFG.num_encoder_layers + 2 * CFG.num_decoder_layers
    assert len(kept) == expected, kept


@pytest.mark.parametrize("method", ["blocks", "vjp"])
def test_per_task_gradients_match(method):
    batch = _batch()
    params = _params(_model("none"))
    out = {}
    for policy in ("none", "full"):
        model = _model(policy)

        def fn(p, model=model):
            def sums(pp, b):
                return model.loss_sums(pp, b, jax.random.key(3), True)

            return optim.compute_task_gradients(
                sums, model.normalizer(batch), p, batch, num_tasks=2, task_counts=(2, 2),
                method=method, shared=(".*",), check_layout=False)

        out[policy] = jax.jit(fn)(params)
    losses0, _, grads0 = out["none"]
    losses1, _, grads1 = out["full"]
    np.testing.assert_allclose(losses1, losses0, rtol=1e-6)
    assert grads0.stacked is not None
    _close(grads1.stacked, grads0.stacked)


def test_microbatched_step_matches():
    batch = {k: jnp.asarray(v) for k, v in _batch().items() if k != "row_id"}
    params = _params(_model("none"))
    opt = TaskOptimizer(optax.sgd(1.0))
    results = {}
    for policy in ("none", "minimal"):
        model = _model(policy)
        state = trainer_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                       opt_state=opt.init(params))
        step = jax.jit(lambda s, b, model=model: trainer_lib.train_step(
            s, b, jax.random.key(5), model=model, optimizer=opt,
            options=trainer_lib.StepOptions(num_microbatches=2)))
        results[policy] = step(state, batch)
    (s0, m0), (s1, m1) = results["none"], results["minimal"]
    np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=1e-6)
    _close(s1.params, s0.params)


@pytest.mark.parametrize("bad", ["some", "None", None, 1])
def test_bad_policy_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"T5Config\.remat_policy=.*accepted: \('none', 'minimal', 'dots', 'full'\)"):
        t5.T5Config(remat_policy=bad)


def _bert_model(policy):
    from ktx.models import bert, encoder

    config = bert.BertConfig(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2,
                             intermediate_size=32, max_position=16, remat_policy=policy)
    return encoder.EncoderClassifierModel(config, num_labels=(3, 1), shared_layers=1)


def _bert_batch():
    ids = (np.arange(32).reshape(4, 8) * 7) % 39 + 1
    return {"input_ids": jnp.asarray(ids, jnp.int32),
            "token_type_ids": jnp.zeros((4, 8), jnp.int32),
            "label": jnp.asarray([0.0, 2.0, 0.5, -0.5]),
            "task_id": jnp.asarray([0, 0, 1, 1], jnp.int32),
            "row_id": jnp.arange(4, dtype=jnp.int32)}


def _bert_loss_grad(m, params, batch):
    return jax.jit(jax.value_and_grad(
        lambda p: m.loss_sums(p, batch, jax.random.key(2), True)[0].sum()))(params)


@functools.cache
def _bert_none_reference():
    """The BERT encoder with policy 'none': its parameters, loss and gradients."""
    batch = _bert_batch()
    plain = _bert_model("none")
    params = nn.unbox(plain.init_variables(jax.random.key(0), batch)["params"])
    return params, *_bert_loss_grad(plain, params, batch)


@pytest.mark.parametrize("policy", ["minimal", "full"])
def test_bert_encoder_same_loss_and_gradients(policy):
    from ktx.models import bert

    batch = _bert_batch()
    params, l0, g0 = _bert_none_reference()
    remat = _bert_model(policy)
    assert jax.tree.structure(jax.eval_shape(lambda: nn.unbox(
        remat.init_variables(jax.random.key(0), batch)["params"]))) == jax.tree.structure(params)
    l1, g1 = _bert_loss_grad(remat, params, batch)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    _close(g1, g0)
    text = str(jax.make_jaxpr(jax.grad(
        lambda p: remat.loss_sums(p, batch, jax.random.key(2), True)[0].sum()))(params))
    assert text.count("checkpoint[") + text.count("remat2[") + text.count("remat[") >= 3
    with pytest.raises(ValueError, match=r"BertConfig\.remat_policy='x'.*accepted"):
        bert.BertConfig(remat_policy="x")
