"""SMART (`ktx.models.smart`): the adversarial term against a float64 NumPy computation of
the paper's equations on a model whose gradients are known in closed form, the per-row
contract (task blocks = whole batch), and training with every ktx encoder classifier."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ktx import optim, partitioning
from ktx.models import bert, encoder, smart
from ktx.models.base import with_row_ids
from ktx.training import checkpoints, optimizers
from ktx.training import trainer as trainer_lib
from tests.models.test_encoder_options import CONFIG, KINDS, _batch, _model, _params

V, E, L = 6, 3, 2
# The train-step tests' encoder: one layer (the paths they compare differ by rows and
# tasks, not by depth); a SMART step's program compiles in a third to a half less time
# than with CONFIG's two. (`test_mu_zero_is_the_stateless_step_bit_for_bit` keeps CONFIG:
# its by-hand step's rounding is checked to 1e-6, which the one-layer step misses by one
# element's last digits.)
ONE_LAYER = dataclasses.replace(CONFIG, num_layers=1)


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
    base = _model("plain", config=ONE_LAYER, shared_layers=1, frozen_layers=1)
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
    """The Bregman term and the momentum teacher as functions."""
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


# -- the Bregman proximal point term in the train step -----------------------------------


def _proximal_by_hand(params, teacher, batch):
    """`[T]` float64 sums of ℓ_s(f(x; θ), f(x; θ̃)) on the closed-form model."""
    emb, emb_t = (np.asarray(t["embedding"], np.float64) for t in (params, teacher))
    want = np.zeros(2)
    for ids, t in zip(np.asarray(batch["input_ids"]), np.asarray(batch["task_id"])):
        z = emb[ids].mean(0) @ np.asarray(params[f"w_{t}"], np.float64)
        zt = emb_t[ids].mean(0) @ np.asarray(teacher[f"w_{t}"], np.float64)
        want[t] += _sym_kl(z, zt) if t == 0 else (z[0] - zt[0]) ** 2
    return want


def test_proximal_term_by_hand_and_no_gradient_to_the_teacher():
    """`loss_sums_with_state` = base + μ ℓ_s(f(x; θ), f(x; θ̃)) per task (float64 NumPy);
    ∂/∂θ̃ is 0; θ̃ = θ (the step-0 teacher) gives exactly 0."""
    model, batch = _LinearModel(), _linear_batch()
    params = nn.unbox(model.init_variables(jax.random.key(0), batch)["params"])
    sm = smart.SmartModel(model, weight=0.0, proximal_weight=2.5)
    state = {"teacher": jax.tree.map(lambda p: p + 0.1 * jnp.sign(p), params)}
    rng = jax.random.key(3)
    sums, aux = jax.jit(lambda p, s: sm.loss_sums_with_state(p, s, batch, rng, True))(params, state)
    want = _proximal_by_hand(params, state["teacher"], batch)
    assert np.all(want > 1e-4)
    np.testing.assert_allclose(aux["smart_proximal"], want, rtol=1e-5)
    np.testing.assert_allclose(sums, np.asarray(aux["loss"]) + 2.5 * want, rtol=1e-5)
    np.testing.assert_allclose(aux["loss"], model.loss_sums(params, batch, rng, True)[0], rtol=1e-6)
    g = jax.grad(lambda s: sm.loss_sums_with_state(params, s, batch, rng, True)[0].sum())(state)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(g))
    _, aux0 = sm.loss_sums_with_state(params, sm.init_model_state(params), batch, rng, True)
    np.testing.assert_array_equal(aux0["smart_proximal"], [0.0, 0.0])
    # Evaluation is the base model's; training without the teacher is an error.
    np.testing.assert_array_equal(sm.loss_sums_with_state(params, None, batch, None, False)[0],
                                  model.loss_sums(params, batch, None, False)[0])
    with pytest.raises(ValueError, match=r"proximal_weight=2.5.*model_state"):
        sm.loss_sums_with_state(params, None, batch, rng, True)


def _smart(base, **kwargs):
    return smart.SmartModel(base, weight=1.0, noise_std=1e-2, step_size=1e-2, epsilon=1e-2,
                            **kwargs)


def test_mu_zero_is_the_stateless_step_bit_for_bit():
    """μ = 0: no teacher (`model_state` None, no `model_state` in the checkpoint tree) and
    the Trainer's step is, bit for bit, the jitted step of the loss without any state:
    `jax.grad` of `Σ_t loss_sums_t / normalizer_t`, then the optimizer."""
    base = _model("plain")
    sm = _smart(base, proximal_weight=0.0)
    assert sm.init_model_state(_params(base)) is None
    tr = trainer_lib.Trainer(sm, optimizers.adamw(1e-2), mesh=partitioning.create_mesh(
        1, devices=jax.devices()[:1]))
    state = tr.init_state(jax.random.key(0), _batch())
    assert state.model_state is None
    assert set(checkpoints._state_to_tree(state)) == {"step", "params", "opt_state"}
    rng = jax.random.key(1)

    @jax.jit
    def by_hand(params, opt_state):
        batch = with_row_ids(_batch())
        step_rng = jax.random.fold_in(rng, 0)
        normalizer = sm.normalizer(batch)
        grads = jax.grad(lambda p: (sm.loss_sums(p, batch, step_rng, True)[0] / normalizer).sum())(params)
        _, updates, _ = tr.optimizer.update(grads, opt_state, params)
        return jax.tree.map(jnp.add, params, updates)

    want = jax.device_get(by_hand(state.params, state.opt_state))
    legacy = trainer_lib.Trainer(_Stateless(sm), optimizers.adamw(1e-2), mesh=tr.mesh)
    legacy.create_abstract_state(_batch())
    lowered = [t.lower_train_step(state, with_row_ids(_batch()), rng).as_text()
               for t in (tr, legacy)]
    assert lowered[0] == lowered[1]
    copy = jax.tree.map(jnp.copy, state)  # the step donates its state
    new, _ = tr.train_step(state, _batch(), rng)
    old, _ = legacy.train_step(copy, _batch(), rng)
    assert new.model_state is None
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(new.params),
                 jax.device_get(old.params))
    # (Fused differently, the step written out by hand differs in the last bit.)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9),
                 jax.device_get(new.params), want)


class _Stateless(trainer_lib.BaseModel):
    """A model written against the contract before model state existed: `loss_sums` only
    (every state hook is `BaseModel`'s default)."""

    def __init__(self, model):
        self.model, self.num_tasks = model, model.num_tasks
        self.loss_normalization = model.loss_normalization
        self.frozen_patterns = model.frozen_patterns

    def init_variables(self, rng, batch):
        return self.model.init_variables(rng, batch)

    def input_spec(self, batch_size, feature_lengths):
        return self.model.input_spec(batch_size, feature_lengths)

    def task_weights(self, batch):
        return self.model.task_weights(batch)

    def loss_sums(self, params, batch, rng, train):
        return self.model.loss_sums(params, batch, rng, train)


def _counts_input():
    return (4, 4)


def _steps(tr, n, batches=None, initial=None, model_states=None):
    """`n` steps of `tr` from a fresh state: (state, [n] losses, [n + 1] params, [n] aux).
    `initial`: a dict of fresh states (host arrays) of earlier trainers of the same model
    by their state's tree structure: one found there is placed on this trainer's
    shardings instead of compiling its init again; one initialized here is added.
    `model_states`: a list to which each step's model state (host arrays) is appended."""
    if initial is None:
        state = tr.init_state(jax.random.key(0), _batch())
    else:
        tr.create_abstract_state(_batch())
        key = jax.tree.structure(tr.abstract_state)
        if key in initial:
            state = jax.device_put(initial[key], tr.state_shardings)
        else:
            state = tr.init_state(jax.random.key(0), _batch())
            initial[key] = jax.device_get(state)
    params, losses, auxes = [jax.device_get(state.params)], [], []
    for step in range(n):
        batch = _batch() if batches is None else batches(step)
        state, m = tr.train_step(state, batch, jax.random.key(1), task_counts=_counts_input())
        params.append(jax.device_get(state.params))
        if model_states is not None:
            model_states.append(jax.device_get(state.model_state))
        losses.append(float(m["loss"]))
        auxes.append(jax.device_get(m["aux"]))
    return state, np.asarray(losses), params, auxes


def test_teacher_is_the_momentum_recursion_of_the_params():
    """After k steps θ̃ = the recursion θ̃_0 = θ_0, θ̃_{s+1} = (1 − β_s) θ_{s+1} + β_s θ̃_s
    computed by hand from the parameters of each step (β from a schedule); frozen
    parameters have no teacher copy and stay bit-identical; the first step's term is
    exactly 0 (θ̃ = θ, the same dropout masks) and the objective is base + λ_s adversarial
    + μ proximal."""
    base = _model("plain", frozen_layers=1)
    sm = _smart(base, proximal_weight=1.5,
                teacher_momentum=smart.momentum_schedule((0.5, 0.8), (2,)))
    tr = trainer_lib.Trainer(sm, optimizers.adamw(3e-2))
    state, _, params, auxes = _steps(tr, 3)
    betas = (0.5, 0.5, 0.8)
    teacher = jax.tree.map(lambda p: np.asarray(p, np.float64), params[0])
    for s, beta in enumerate(betas):
        teacher = jax.tree.map(lambda t, p, b=beta: (1 - b) * np.asarray(p, np.float64) + b * t,
                               teacher, params[s + 1])
    got = jax.device_get(state.model_state["teacher"])
    frozen = [name for name in _flat_names(params[0])
              if any(re.fullmatch(rx, name) for rx in sm.frozen_patterns)]
    assert frozen and all(n.startswith(("embeddings/", "layers_0/")) for n in frozen)
    flat_got, flat_want = _flat(got), _flat(teacher)
    assert set(flat_got) == set(flat_want) - set(frozen)
    for name, value in flat_got.items():
        np.testing.assert_allclose(value, flat_want[name], rtol=1e-6, atol=1e-7, err_msg=name)
    for name in frozen:
        np.testing.assert_array_equal(_flat(params[-1])[name], _flat(params[0])[name])
    assert not np.allclose(flat_got["task_heads/task_0/kernel"],
                           _flat(params[-1])["task_heads/task_0/kernel"])
    np.testing.assert_array_equal(auxes[0]["smart_proximal"], [0.0, 0.0])
    assert np.all(auxes[2]["smart_proximal"] > 0)


def _flat(tree):
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _flat_names(tree):
    return list(_flat(tree))


def _proximal_sgd_trainer(**kwargs):
    """SMART with the adversarial and the proximal term on the one-layer encoder (dropout
    on), SGD. (SGD: Adam would blow the rounding noise of gradients that are 0 in exact
    arithmetic (the attention key bias) up to full-size, path-dependent steps.)"""
    return trainer_lib.Trainer(_smart(_model("plain", config=ONE_LAYER), proximal_weight=1.0,
                                      teacher_momentum=0.5), optax.sgd(0.5), **kwargs)


@functools.cache
def _plain_proximal_run():
    """3 plain steps of `_proximal_sgd_trainer()` (the task-blocks test's reference, whose
    first 2 steps the multi-step scan test compares with): (initial states as `_steps`
    keeps them, [3] losses, [4] params, [3] model states, [3] aux), host arrays."""
    initial, model_states = {}, []
    _, losses, params, auxes = _steps(_proximal_sgd_trainer(), 3, initial=initial,
                                      model_states=model_states)
    return initial, losses, params, model_states, auxes


@pytest.fixture(scope="module", autouse=True)
def _file_caches():
    yield
    _plain_proximal_run.cache_clear()


def test_task_blocks_vjp_and_microbatches_equal_the_whole_batch_with_dropout():
    """With dropout on, the adversarial and the proximal term, 3 steps: per-task blocks,
    the one-hot VJP (summed by vanilla_multi) and 2 microbatches give the plain step's
    losses, parameters and teacher."""
    assert _model("plain", config=ONE_LAYER).config.dropout_rate > 0
    plain_initial, losses, params, model_states, auxes = _plain_proximal_run()
    # the paths' initial states: the plain run's where they are alike
    initial = dict(plain_initial)

    def run(**kwargs):
        state, losses, _, auxes = _steps(_proximal_sgd_trainer(**kwargs), 3, initial=initial)
        return losses, jax.device_get(state.params), jax.device_get(state.model_state), auxes

    plain = losses, params[-1], model_states[-1], auxes
    assert np.all(plain[3][-1]["smart_proximal"] > 0)
    per_task = {"balancer": optim.vanilla_multi(), "weights_from_losses": False}
    for kwargs in (dict(per_task, grad_method="blocks"), dict(per_task, grad_method="vjp"),
                   {"balancer": optim.vanilla_multi()},  # the loss-weighted shortcut
                   {"num_microbatches": 2}):
        got = run(**kwargs)
        np.testing.assert_allclose(got[0], plain[0], rtol=1e-5, err_msg=str(kwargs))
        np.testing.assert_allclose(got[3][-1]["smart_proximal"], plain[3][-1]["smart_proximal"],
                                   rtol=1e-4, atol=1e-9, err_msg=str(kwargs))
        for a, b in ((got[1], plain[1]), (got[2], plain[2])):
            jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6,
                                                                 err_msg=str(kwargs)), a, b)


class _EncoderInput:
    """A `ktx.runs.train.TrainInput` of encoder batches, a function of the step."""

    task_names = ("smart_a_v001", "smart_b_v001")
    num_tasks = 2

    def get_batch(self, step):
        batch = {k: np.asarray(v) for k, v in _batch().items()}
        ids = np.random.default_rng(step).integers(1, 40, batch["input_ids"].shape)
        batch["input_ids"] = np.where(batch["input_ids"] > 0, ids, 0).astype(np.int32)
        return batch

    def task_counts(self, step):
        return (4, 4)


def test_resumed_run_equals_the_uninterrupted_run(tmp_path):
    """`ktx.runs.train.train` to 4 steps = 2 steps, then resumed from the checkpoint to 4:
    the same losses, parameters and teacher (restored from the checkpoint, bit for bit);
    a checkpoint with a teacher does not resume a model without one (and the reverse),
    with a message naming the model state."""
    from ktx.runs.train import train
    from ktx.training.summaries import read_metrics

    def kwargs(model_dir, mu=1.0):
        return dict(model=_smart(_model("plain", config=ONE_LAYER), proximal_weight=mu,
                                 teacher_momentum=0.6),
                    train_input=_EncoderInput(), model_dir=model_dir,
                    optimizer=optimizers.adamw(3e-2), log_period=1, checkpoint_period=2)

    straight = train(train_steps=4, **kwargs(tmp_path / "straight"))
    train(train_steps=2, **kwargs(tmp_path / "resumed"))
    resumed = train(train_steps=4, **kwargs(tmp_path / "resumed"))
    for a, b in ((straight.params, resumed.params), (straight.model_state, resumed.model_state)):
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))

    def losses(run):
        return {r["step"]: r["loss"] for r in read_metrics(tmp_path / run)
                if r["split"] == "train" and r["task"] == "all"}

    assert sorted(losses("resumed")) == [1, 2, 3, 4]
    assert losses("resumed") == losses("straight")
    teacher = jax.device_get(straight.model_state["teacher"])
    assert not np.allclose(_flat(teacher)["task_heads/task_0/kernel"],
                           _flat(jax.device_get(straight.params))["task_heads/task_0/kernel"])
    for mu, match in ((0.0, "holds a model state of .* but the model carries none"),
                      (1.0, "holds no model state")):
        tr = trainer_lib.Trainer(_smart(_model("plain", config=ONE_LAYER), proximal_weight=mu),
                                 optimizers.adamw(3e-2))
        abstract, _ = tr.create_abstract_state(_batch())
        saved = tmp_path / ("straight" if mu == 0.0 else "plain")
        if mu == 1.0:  # the checkpoint a μ = 0 run writes (no model state): the straight
            # run's state without its teacher, instead of compiling a μ = 0 run's step
            manager = checkpoints.CheckpointManager(saved)
            manager.save(straight.replace(model_state=None), force=True)
            manager.close()
        with pytest.raises(checkpoints.CheckpointShapeError, match=match):
            checkpoints.CheckpointManager(saved).restore(abstract)


def test_initial_checkpoint_sets_the_teacher_to_its_params(tmp_path):
    """A new run from INITIAL_CHECKPOINT_PATH starts its teacher at the loaded θ_0."""
    from ktx.runs.train import _restore_or_init
    from ktx.runs.run_dir import RunDir

    sm = _smart(_model("plain", config=ONE_LAYER), proximal_weight=1.0)
    tr = trainer_lib.Trainer(sm, optimizers.adamw(3e-2))
    state = tr.init_state(jax.random.key(7), _batch())
    manager = checkpoints.CheckpointManager(tmp_path / "source")
    manager.save(state.replace(step=jnp.int32(5)), force=True)
    manager.close()
    tr2 = trainer_lib.Trainer(sm, optimizers.adamw(3e-2))
    new_manager = checkpoints.CheckpointManager(tmp_path / "new")
    new, start = _restore_or_init(tr2, RunDir(tmp_path / "new").makedirs(), _batch(), 0,
                                  str(tmp_path / "source"), new_manager)
    new_manager.close()
    assert start == 0 and int(new.step) == 0
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(new.model_state["teacher"]),
                 jax.device_get(state.params))
    jax.tree.map(lambda a, b: a.sharding == b.sharding or pytest.fail("sharding"),
                 new.model_state["teacher"], new.params)


def test_teacher_is_sharded_like_the_params_on_a_2x4_mesh():
    """On 8 fake devices as (data 2, model 4): every teacher leaf has its parameter's
    sharding (some split over `model`), after init and after a step; `ktx precompile`
    counts the teacher in the step's arguments."""
    from ktx.training.precompile import precompile

    mesh = partitioning.create_mesh(4)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    # 4 heads: the heads axis splits over the 4-way model axis.
    config = bert.BertConfig(vocab_size=40, hidden_size=16, num_layers=1, num_heads=4,
                             intermediate_size=32, max_position=16)
    sm = _smart(_model("plain", config=config), proximal_weight=1.0)
    tr = trainer_lib.Trainer(sm, optimizers.adamw(3e-2), mesh=mesh)
    state = tr.init_state(jax.random.key(0), _batch())

    def check(state):
        specs = []
        for name, (p, t) in _pairs(state.params, state.model_state["teacher"]).items():
            assert t.sharding == p.sharding, name
            specs.append(tuple(p.sharding.spec))
        assert any("model" in spec for spec in specs)

    check(state)
    assert tr.abstract_state.model_state["teacher"]["task_heads"]["task_0"]["kernel"].sharding \
        == tr.state_shardings.params["task_heads"]["task_0"]["kernel"]
    state, m = tr.train_step(state, _batch(), jax.random.key(1))
    assert np.isfinite(float(m["loss"]))
    check(state)
    lengths = {"inputs": 8}
    with_teacher = precompile(sm, optimizers.adamw(3e-2), topology="cpu", batch_size=8,
                              task_feature_lengths=lengths, num_partitions=4)
    without = precompile(_smart(_model("plain", config=config)), optimizers.adamw(3e-2),
                         topology="cpu",
                         batch_size=8, task_feature_lengths=lengths, num_partitions=4)
    teacher_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    assert with_teacher.argument_bytes - without.argument_bytes >= teacher_bytes / 8


def _pairs(params, teacher):
    flat_t = {jax.tree_util.keystr(p, simple=True, separator="/"): v
              for p, v in jax.tree_util.tree_flatten_with_path(teacher)[0]}
    return {name: (v, flat_t[name]) for name, v in
            ((jax.tree_util.keystr(p, simple=True, separator="/"), v)
             for p, v in jax.tree_util.tree_flatten_with_path(params)[0])}


def test_proximal_validation():
    base = _model("plain")
    with pytest.raises(ValueError, match=r"SmartModel.proximal_weight=-1"):
        smart.SmartModel(base, proximal_weight=-1)
    with pytest.raises(ValueError, match=r"SmartModel.teacher_momentum=1.5.*\[0, 1\]"):
        smart.SmartModel(base, teacher_momentum=1.5)
    with pytest.raises(ValueError, match=r"one more value than boundaries"):
        smart.momentum_schedule((0.99, 0.999), ())
    beta = smart.momentum_schedule((0.99, 0.999), (10,))
    np.testing.assert_allclose([beta(jnp.int32(s)) for s in (0, 9, 10, 11)],
                               [0.99, 0.99, 0.999, 0.999], rtol=1e-7)


def test_gin_binds_mu_and_the_papers_momentum_schedule(tmp_path):
    """conditioning/smart.gin builds the SmartModel with μ and β (here the schedule its
    header shows, in an experiment file), and μ = 0 through gin carries no teacher."""
    import gin

    from ktx import cli

    experiment = tmp_path / "smart_schedule.gin"
    experiment.write_text(
        "from __gin__ import dynamic_registration\n"
        "import ktx.models.smart as smart\n"
        "include 'models/bert_tiny.gin'\n"
        "include 'conditioning/smart.gin'\n"
        "SMART_TEACHER_MOMENTUM = @smart.momentum_schedule()\n"
        "smart.momentum_schedule.values = (0.99, 0.999)\n"
        "smart.momentum_schedule.boundaries = (3,)\n")

    def build(files, bindings=()):
        cli.parse_gin(files, bindings)
        try:
            return gin.query_parameter("train_script.train.model").scoped_configurable_fn()
        finally:
            gin.clear_config(clear_constants=True)

    sm = build([str(experiment)])
    assert isinstance(sm, smart.SmartModel) and sm.proximal_weight == 1.0
    np.testing.assert_allclose([sm.momentum(jnp.int32(s)) for s in (2, 3)], [0.99, 0.999],
                               rtol=1e-7)
    off = build(["models/bert_tiny.gin", "conditioning/smart.gin"],
                [("SMART_PROXIMAL_WEIGHT", "0.0")])
    assert off.proximal_weight == 0.0 and off.init_model_state({"w": jnp.ones(2)}) is None


def test_multi_step_scan_carries_the_teacher():
    """`Trainer.train_steps` (K steps in one `lax.scan`) carries the teacher as K
    `train_step` calls do."""
    # K = 2 steps against the first 2 of the task-blocks test's plain run (the same
    # trainer, batches and rng), read from its cache rather than run again.
    initial, all_losses, all_params, model_states, _ = _plain_proximal_run()
    losses, params, model_state = all_losses[:2], all_params[2], model_states[1]
    tr = _proximal_sgd_trainer()
    tr.create_abstract_state(_batch())
    # the same initial state, its init not compiled again
    state = initial[jax.tree.structure(tr.abstract_state)]
    state = jax.device_put(state, tr.state_shardings)
    stacked = {k: np.stack([np.asarray(v)] * 2) for k, v in _batch().items()}
    state, metrics = tr.train_steps(state, stacked, jax.random.key(1), task_counts=(4, 4))
    np.testing.assert_allclose(np.asarray(metrics["loss"]), losses, rtol=1e-5)
    assert float(metrics["aux"]["smart_proximal"][1].sum()) > 0
    for a, b in ((state.params, params), (state.model_state, model_state)):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6),
                     jax.device_get(a), jax.device_get(b))
