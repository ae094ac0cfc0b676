"""SMART (`ktx.models.smart`): the adversarial term against a float64 NumPy computation of
the paper's equations on a model whose gradients are known in closed form, the per-row
contract (task blocks = whole batch), and training with every ktx encoder classifier."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx import optim
from ktx.models import bert, encoder, smart
from ktx.models.base import with_row_ids
from ktx.training import optimizers
from ktx.training import trainer as trainer_lib
from tests.models.test_encoder_options import KINDS, _batch, _model, _params

V, E, L = 6, 3, 2


class _MeanLinear(nn.Module):
    """logits_t = mean_l(emb[ids] + δ) @ W_t: a model whose input gradient is known."""

    num_labels: tuple[int, ...]

    @nn.compact
    def __call__(self, input_ids, token_type_ids=None, attention_mask=None, *,
                 deterministic=True, embedding_perturbation=None):
        x = self.param("embedding", nn.initializers.normal(1.0), (V, E))[input_ids]
        x = bert.add_perturbation(x, embedding_perturbation)
        h = x.mean(axis=1)
        return tuple(h @ self.param(f"w_{t}", nn.initializers.normal(1.0), (E, n))
                     for t, n in enumerate(self.num_labels))


class _LinearModel(encoder.EncoderClassifierModel):
    def __init__(self):
        super().__init__(bert.BertConfig(vocab_size=V, hidden_size=E, num_layers=1, num_heads=1,
                                         intermediate_size=4, max_position=L, dropout_rate=0.0,
                                         attention_dropout_rate=0.0),
                         num_labels=(3, 1))
        self.module = _MeanLinear(self.num_labels)

    def init_variables(self, rng, batch):
        return self.module.init(rng, batch["input_ids"])


def _linear_batch():
    return {"input_ids": jnp.asarray([[1, 2], [3, 4], [5, 1]], jnp.int32),
            "label": jnp.asarray([2.0, 0.0, 0.7]),
            "task_id": jnp.asarray([0, 0, 1], jnp.int32)}


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _sym_kl(z, zt):
    p, q = _softmax(z), _softmax(zt)
    return float(np.sum((p - q) * (np.log(p) - np.log(q))))


def _dsym_kl(z, zt):
    """∂/∂z̃ Σ_k (p_k − q_k)(log p_k − log q_k), q = softmax(z̃): −q⊙(a−b) + q (q·(a−b)) − (p−q)."""
    p, q = _softmax(z), _softmax(zt)
    a_b = np.log(p) - np.log(q)
    return -q * a_b + q * np.dot(q, a_b) - (p - q)


def _by_hand(params, batch, noise, *, eta, eps, weight, projection="paper", delta=None):
    """The adversarial loss sums in float64: ascent, projection, CE / squared error + λ ℓ_s.
    With `delta` given, the perturbation is taken as is (a function of θ only through
    the base loss and ℓ_s, as the stopped gradient makes it)."""
    emb = np.asarray(params["embedding"], np.float64)
    ws = [np.asarray(params[f"w_{t}"], np.float64) for t in (0, 1)]
    sums, terms, deltas = np.zeros(2), np.zeros(2), []
    for i, (ids, y, t) in enumerate(zip(np.asarray(batch["input_ids"]), np.asarray(batch["label"]),
                                        np.asarray(batch["task_id"]))):
        x, w = emb[ids], ws[t]
        z = x.mean(0) @ w
        if delta is None:
            nu = np.asarray(noise[i], np.float64)
            zt = (x + nu).mean(0) @ w
            dz = _dsym_kl(z, zt) if t == 0 else 2.0 * (zt - z)
            g = np.broadcast_to(w @ dz / L, (L, E))  # ∂z̃/∂δ[l, e] = W[e, :] / L
            if projection == "paper":
                d = np.clip(nu + eta * g / (np.abs(g).max() + 1e-12), -eps, eps)
            else:
                d = nu + eta * g
                d = d / (np.abs(d).max(axis=-1, keepdims=True) + eps)
        else:
            d = delta[i]
        deltas.append(d)
        zt = (x + d).mean(0) @ w
        if t == 0:
            base = -math.log(_softmax(z)[int(y)])
            term = _sym_kl(z, zt)
        else:
            base = float((z[0] - y) ** 2)
            term = float((z[0] - zt[0]) ** 2)
        sums[t] += base + weight * term
        terms[t] += term
    return sums, terms, np.stack(deltas)


def test_symmetric_kl_by_hand():
    # p = (1/4, 3/4), q = (1/2, 1/2): KL(p‖q) + KL(q‖p) = (1/4) ln 3.
    got = smart.symmetric_kl(jnp.asarray([0.0, math.log(3.0)]), jnp.asarray([0.0, 0.0]))
    np.testing.assert_allclose(got, 0.25 * math.log(3.0), rtol=1e-6)
    rows = smart.row_divergence((2, 1), (jnp.asarray([[0.0, math.log(3.0)], [1.0, 1.0]]),
                                         jnp.asarray([[0.5], [2.0]])),
                                (jnp.zeros((2, 2)), jnp.asarray([[0.0], [-1.0]])),
                                jnp.asarray([0, 1]))
    np.testing.assert_allclose(rows, [0.25 * math.log(3.0), 9.0], rtol=1e-6)


@pytest.mark.parametrize("projection,sigma,eta,eps", [
    ("paper", 0.1, 0.05, 0.08),  # the clip is active on some entries
    ("paper", 1e-5, 1e-3, 1e-5),  # the paper's σ, η and ε
    ("code", 0.1, 0.05, 1e-6),  # the authors' code: unit ∞-norm per token
])
def test_adversarial_term_by_hand(projection, sigma, eta, eps):
    model, batch = _LinearModel(), _linear_batch()
    params = nn.unbox(model.init_variables(jax.random.key(0), batch)["params"])
    sm = smart.SmartModel(model, weight=2.0, noise_std=sigma, step_size=eta, epsilon=eps,
                          projection=projection)
    rng = jax.random.key(7)
    noise = smart.initial_noise(rng, with_row_ids(batch), (L, E), sigma)
    expected, terms, _ = _by_hand(params, batch, np.asarray(noise), eta=eta, eps=eps,
                                  weight=2.0, projection=projection)
    sums, aux = jax.jit(lambda p: sm.loss_sums(p, batch, rng, True))(params)
    np.testing.assert_allclose(sums, expected, rtol=2e-5)
    # At ε = 1e-5 the term is ~1e-10 and float32's x + δ keeps ~2 digits of δ.
    np.testing.assert_allclose(aux["smart_adversarial"], terms, rtol=5e-2 if eps < 1e-4 else 2e-4)
    assert np.all(terms > 0)
    base_sums, _ = model.loss_sums(params, batch, rng, True)
    np.testing.assert_allclose(aux["loss"], base_sums, rtol=1e-6)
    delta = np.asarray(sm.adversarial_perturbation(params, with_row_ids(batch), rng,
                                                   model.logits(params, batch)))
    if projection == "paper":
        assert np.abs(delta).max() <= eps * (1 + 1e-6)
    else:
        np.testing.assert_allclose(np.abs(delta).max(axis=-1), 1.0, rtol=1e-4)


def test_gradient_flows_through_both_predictions_not_the_perturbation():
    """∂/∂θ of the sums = finite differences of the float64 loss with x̃ − x held at its
    value (the ascent is under stop_gradient; ℓ_s is differentiated through f(x) and f(x̃))."""
    model, batch = _LinearModel(), _linear_batch()
    params = nn.unbox(model.init_variables(jax.random.key(0), batch)["params"])
    sm = smart.SmartModel(model, weight=3.0, noise_std=0.1, step_size=0.05, epsilon=0.08)
    rng = jax.random.key(7)
    delta = np.asarray(sm.adversarial_perturbation(params, with_row_ids(batch), rng,
                                                   model.logits(params, batch)), np.float64)
    grads = jax.grad(lambda p: sm.loss_sums(p, batch, rng, True)[0].sum())(params)
    for name in ("w_0", "w_1"):
        w = np.asarray(params[name], np.float64)
        fd = np.zeros_like(w)
        for idx in np.ndindex(w.shape):
            def total(sign, idx=idx, w=w, name=name):
                shifted = w.copy()
                shifted[idx] += sign * 1e-6
                return _by_hand({**params, name: shifted}, batch, None, eta=0, eps=0,
                                weight=3.0, delta=delta)[0].sum()
            fd[idx] = (total(1) - total(-1)) / 2e-6
        np.testing.assert_allclose(grads[name], fd, rtol=2e-3, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_every_encoder_model(kind):
    """λ_s = 0 is the base loss exactly; λ_s > 0 adds a non-negative term; eval is the
    base's; with dropout on, each task's block (its rows, their row ids) gives the whole
    batch's sums, so the per-task gradient paths see the same term."""
    base = _model(kind)
    params, batch, rng = _params(base), with_row_ids(_batch()), jax.random.key(5)
    off = smart.SmartModel(base, weight=0.0)
    for a, b in zip(off.loss_sums(params, batch, rng, True), base.loss_sums(params, batch, rng, True)):
        np.testing.assert_array_equal(jax.tree.leaves(a), jax.tree.leaves(b))
    sm = smart.SmartModel(base, weight=1.0, noise_std=1e-2, step_size=1e-2, epsilon=1e-2)
    sums, aux = sm.loss_sums(params, batch, rng, True)
    term = np.asarray(aux["smart_adversarial"])
    assert np.all(term > 0) and np.all(np.isfinite(term))
    np.testing.assert_allclose(sums, np.asarray(aux["loss"]) + term, rtol=1e-6)
    np.testing.assert_array_equal(sm.loss_sums(params, batch, None, False)[0],
                                  base.loss_sums(params, batch, None, False)[0])
    blocks = [sm.loss_sums(params, {k: v[r] for k, v in batch.items()}, rng, True)[0]
              for r in (slice(0, 4), slice(4, 8))]
    np.testing.assert_allclose(blocks[0][0], sums[0], rtol=1e-5)
    np.testing.assert_allclose(blocks[1][1], sums[1], rtol=1e-5)


def test_trains_with_a_balancer_and_frozen_layers():
    """SMART through the one Trainer: PCGrad's per-task gradients (task blocks) and the
    base's frozen layers (bit-identical after the step)."""
    base = _model("plain", shared_layers=1, frozen_layers=1)
    sm = smart.SmartModel(base, weight=1.0, noise_std=1e-2, step_size=1e-2, epsilon=1e-2)
    assert sm.frozen_patterns == base.frozen_patterns
    tr = trainer_lib.Trainer(sm, optimizers.adamw(1e-2), balancer=optim.pcgrad(seed=0))
    state = tr.init_state(jax.random.key(0), _batch())
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = tr.train_step(state, _batch(), jax.random.key(1), task_counts=(4, 4))
    assert np.isfinite(float(metrics["loss"]))
    assert float(metrics["aux"]["smart_adversarial"].sum()) > 0
    np.testing.assert_array_equal(before["layers_0"]["output"]["kernel"],
                                  state.params["layers_0"]["output"]["kernel"])
    assert not np.array_equal(before["shared_layers"]["layers_0"]["output"]["kernel"],
                              state.params["shared_layers"]["layers_0"]["output"]["kernel"])


def test_proximal_pieces_by_hand():
    """The Bregman term and the momentum teacher (not wired into the train step)."""
    model, batch = _LinearModel(), _linear_batch()
    params = nn.unbox(model.init_variables(jax.random.key(0), batch)["params"])
    teacher = jax.tree.map(lambda p: p + 0.1, params)
    got = smart.proximal_sums(model, params, teacher, batch)
    emb = np.asarray(params["embedding"], np.float64)
    want = np.zeros(2)
    for ids, t in zip(np.asarray(batch["input_ids"]), np.asarray(batch["task_id"])):
        w, wt = np.asarray(params[f"w_{t}"], np.float64), np.asarray(teacher[f"w_{t}"], np.float64)
        z, zt = emb[ids].mean(0) @ w, (emb[ids] + 0.1).mean(0) @ wt
        want[t] += _sym_kl(z, zt) if t == 0 else (z[0] - zt[0]) ** 2
    np.testing.assert_allclose(got, want, rtol=1e-5)
    new = smart.teacher_update(teacher, params, beta=0.99)
    np.testing.assert_allclose(new["w_0"], 0.01 * params["w_0"] + 0.99 * teacher["w_0"], rtol=1e-6)


def test_validation():
    base = _model("plain")
    with pytest.raises(ValueError, match=r"SmartModel.epsilon=0"):
        smart.SmartModel(base, epsilon=0)
    with pytest.raises(ValueError, match=r"SmartModel.projection='l2'"):
        smart.SmartModel(base, projection="l2")
    with pytest.raises(TypeError, match=r"SmartModel.base=str"):
        smart.SmartModel("bert")
