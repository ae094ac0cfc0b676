"""Hand-checked shapes and values of the standalone conditioning modules."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx.analysis import params as kparams
from ktx.conditioning.adapters import AdapterWeights, TaskAdapters, apply_adapter
from ktx.conditioning.hyper_prompt import HyperPrompt, gather_prompts
from ktx.conditioning.hyperformer import HyperFormer
from ktx.conditioning.prompt_tuning import PromptTuning, prepend_prompts
from ktx.conditioning.task_embedding import TaskProjector, gather_by_task

relu = lambda x: np.maximum(x, 0.0)  # noqa: E731


def _init(module, *args):
    return nn.meta.unbox(module.init(jax.random.key(0), *args)["params"])


def _num(tree):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _all_grads_nonzero(module, params, fn):
    grads = jax.grad(lambda p: fn(module.apply({"params": p})))(params)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    zero = [jax.tree_util.keystr(path) for path, g in flat if not np.any(np.asarray(g) != 0)]
    assert not zero, f"no gradient reaches {zero}"


def test_task_projector_no_bias_values_and_count():
    proj = TaskProjector(hidden=3, features=2, use_bias=False)
    x = jnp.array([[1.0, -2.0, 0.5, 4.0]])
    params = _init(proj, x)
    assert _num(params) == (4 + 2) * 3
    w1 = np.asarray(params["hidden"]["kernel"])
    w2 = np.asarray(params["output"]["kernel"])
    np.testing.assert_allclose(
        proj.apply({"params": params}, x), relu(np.asarray(x) @ w1) @ w2, rtol=1e-6
    )


def test_gather_by_task_picks_rows():
    table = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(gather_by_task(table, jnp.array([2, 0, 2])), np.asarray(table)[[2, 0, 2]])
    with pytest.raises(ValueError, match="task_id"):
        gather_by_task(table, jnp.zeros((2, 2), jnp.int32))


def _hp(variant, **kw):
    cfg = dict(variant=variant, num_tasks=3, num_layers=2, prompt_length=4, emb_dim=8,
               num_heads=2, head_dim=4, bottleneck_dim=2, task_embed_dim=5,
               task_hidden_dim=6, layer_task_dim=3)
    cfg.update(kw)
    return HyperPrompt(**cfg)


def test_hyper_prompt_share_hand_computed():
    hp = _hp("share")
    params = _init(hp)
    k, v = hp.apply({"params": params})
    assert k.shape == v.shape == (2, 3, 4, 2, 4)
    P = np.asarray(params["prompts"])
    for m in range(2):
        for t in range(3):
            for out, which in ((k, "key"), (v, "value")):
                want = relu(P[t] @ np.asarray(params[f"{which}_down"][m])) @ np.asarray(
                    params[f"{which}_up"][m]).reshape(2, 8)
                np.testing.assert_allclose(out[m, t].reshape(4, 8), want, rtol=1e-5, atol=1e-6)
    # Shared: 4 local matrices per layer + the global prompts.
    assert _num(params) == 3 * 4 * 8 + 2 * 4 * 8 * 2


def test_hyper_prompt_sep_uses_each_tasks_own_network():
    hp = _hp("sep")
    params = _init(hp)
    k, _ = hp.apply({"params": params})
    P = np.asarray(params["prompts"])
    for m in range(2):
        for t in range(3):
            want = relu(P[t] @ np.asarray(params["key_down"][m, t])) @ np.asarray(
                params["key_up"][m, t]).reshape(2, 8)
            np.testing.assert_allclose(k[m, t].reshape(4, 8), want, rtol=1e-5, atol=1e-6)
    assert _num(params) == 3 * 4 * 8 + 2 * 3 * 4 * 8 * 2


def test_hyper_prompt_global_hand_computed_and_closed_form():
    hp = _hp("global")
    params = _init(hp)
    k, v = hp.apply({"params": params})
    assert k.shape == (2, 3, 4, 2, 4)
    kt = np.asarray(params["task_embedding"]["embedding"])
    zl = np.asarray(params["layer_embedding"]["embedding"])
    w1 = np.asarray(params["task_projector"]["hidden"]["kernel"])
    w2 = np.asarray(params["task_projector"]["output"]["kernel"])
    P = np.asarray(params["prompts"])
    for m in range(2):
        for t in range(3):
            I = relu(np.concatenate([kt[t], zl[m]]) @ w1) @ w2  # [t]
            for out, which in ((k, "key"), (v, "value")):
                D = np.einsum("x,xdb->db", I, np.asarray(params[f"{which}_down_generator"])) * 8 ** -0.5
                U = np.einsum("x,xbhk->bhk", I, np.asarray(params[f"{which}_up_generator"])) * 2 ** -0.5
                want = relu(P[t] @ D) @ U.reshape(2, 8)
                np.testing.assert_allclose(out[m, t].reshape(4, 8), want, rtol=1e-4, atol=1e-5)
    want = kparams.hyperprompt_global_closed_form(d=8, l=4, T=3, b=2, t_prime=5, t=3, M=2, e=6)
    assert _num(params) == want
    _all_grads_nonzero(hp, params, lambda kv: jnp.sum(jnp.sin(kv[0])) + jnp.sum(jnp.cos(kv[1])))


@pytest.mark.parametrize("variant", ["share", "sep", "global"])
def test_hyper_prompt_gradients_reach_every_parameter(variant):
    hp = _hp(variant)
    params = _init(hp)
    _all_grads_nonzero(hp, params, lambda kv: jnp.sum(jnp.sin(kv[0])) + jnp.sum(jnp.cos(kv[1])))


def test_hyper_prompt_rejects_bad_fields():
    with pytest.raises(ValueError, match="variant='both'"):
        _init(_hp("both"))
    with pytest.raises(ValueError, match="prompt_length=0"):
        _init(_hp("share", prompt_length=0))


def test_gather_prompts_per_example_equals_per_task():
    per_task = jnp.arange(2 * 3 * 1 * 1 * 2, dtype=jnp.float32).reshape(2, 3, 1, 1, 2)
    out = gather_prompts(per_task, jnp.array([1, 1, 0, 2]))
    assert out.shape == (2, 4, 1, 1, 2)
    np.testing.assert_array_equal(out[:, 2], per_task[:, 0])
    np.testing.assert_array_equal(out[:, 3], per_task[:, 2])


def test_closed_form_hand_value():
    # 4*2*3 + 4*2*4*6 + 3*5 + 7*5 + (2*5 + 6)*8 = 24 + 192 + 15 + 35 + 128
    assert kparams.hyperprompt_global_closed_form(d=4, l=2, T=3, b=2, t_prime=5, t=6, M=7, e=8) == 394


def test_prompt_tuning_gathers_and_prepends():
    pt = PromptTuning(num_tasks=3, prompt_length=2, emb_dim=4)
    task_id = jnp.array([2, 0])
    params = _init(pt, task_id)
    table = np.asarray(params["prompts"])
    assert table.shape == (3, 2, 4) and np.all(np.abs(table) <= 0.5)
    out = pt.apply({"params": params}, task_id)
    np.testing.assert_array_equal(out, table[[2, 0]])
    x = jnp.ones((2, 3, 4))
    joined, mask = prepend_prompts(x, out, mask=jnp.array([[1, 1, 0], [1, 0, 0]]))
    assert joined.shape == (2, 5, 4)
    np.testing.assert_array_equal(joined[:, :2], out)
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])


def test_apply_adapter_hand_computed():
    x = jnp.array([[[1.0, 2.0]]])  # [1, 1, 2]
    w = AdapterWeights(
        down=jnp.array([[[1.0], [-1.0]]]),  # d=2 -> b=1: 1 - 2 = -1, + bias 3 = 2
        down_bias=jnp.array([[3.0]]),
        up=jnp.array([[[0.5, 2.0]]]),  # act(2) * [0.5, 2]
        up_bias=jnp.array([[0.25, 0.0]]),
    )
    # relu(2) = 2 -> [1, 4] + [0.25, 0] -> x + [1.25, 4]
    np.testing.assert_allclose(apply_adapter(x, w, activation="relu"), [[[2.25, 6.0]]])
    # gelu_new(2) = 0.5 * 2 * (1 + tanh(sqrt(2/pi) * (2 + 0.044715 * 8))) = 1.9545977
    g = 1.9545977
    np.testing.assert_allclose(apply_adapter(x, w), [[[1.0 + 0.5 * g + 0.25, 2.0 + 2 * g]]],
                               rtol=1e-6)
    # With a layer norm: h = [0.5 g + 0.25, 2 g] normalised (eps 1e-5), * gamma + beta.
    normed = w._replace(norm_scale=jnp.array([[2.0, 3.0]]), norm_bias=jnp.array([[0.5, -1.0]]))
    h = np.array([0.5 * g + 0.25, 2 * g])
    hn = (h - h.mean()) / np.sqrt(h.var() + 1e-5)
    np.testing.assert_allclose(apply_adapter(x, normed), [[[1.0 + 2 * hn[0] + 0.5,
                                                             2.0 + 3 * hn[1] - 1.0]]], rtol=1e-5)
    with pytest.raises(ValueError, match="activation='swish'"):
        apply_adapter(x, w, activation="swish")


def test_task_adapters_shapes_and_gather():
    ad = TaskAdapters(num_tasks=3, num_layers=2, num_positions=3, emb_dim=4, bottleneck_dim=2)
    params = _init(ad)
    w = ad.apply({"params": params})
    assert w.down.shape == (2, 3, 3, 4, 2) and w.up_bias.shape == (2, 3, 3, 4)
    g = w.gather(jnp.array([1, 2]))
    assert g.down.shape == (2, 3, 2, 4, 2)
    np.testing.assert_array_equal(g.at(1, 2).up[0], w.up[1, 2, 1])
    assert _num(params) == 2 * 3 * 3 * (4 * 2 + 2 + 2 * 4 + 4)
    _all_grads_nonzero(ad, params, lambda w: jnp.sum(jnp.sin(apply_adapter(
        jnp.ones((3, 2, 4)), w.gather(jnp.array([0, 1, 2]), axis=2).at(0, 0)))))


@pytest.mark.parametrize("shared", [False, True])
def test_hyperformer_shapes_values_and_gradients(shared):
    hf = HyperFormer(shared=shared, num_tasks=3, num_layers=2, num_positions=2, emb_dim=4,
                     bottleneck_dim=2, task_embed_dim=3, task_hidden_dim=5, projected_dim=6)
    z = jax.random.normal(jax.random.key(1), (3, 3))
    params = _init(hf, z)
    w = hf.apply({"params": params}, z)
    assert w.down.shape == (2, 2, 3, 4, 2) and w.up.shape == (2, 2, 3, 2, 4)
    assert w.norm_scale.shape == w.norm_bias.shape == (2, 2, 3, 4)
    assert "task_embedding" not in params  # the task embeddings are an input
    lead = () if shared else (2,)  # generators per position (HyperFormer), or one (++)
    assert params["down_generator"].shape == lead + (6, 4, 2)
    assert params["norm_scale_generator_bias"].shape == lead + (4,)
    proj = params["task_projector"]
    mlp = lambda x: relu(x @ np.asarray(proj["hidden"]["kernel"]) + np.asarray(  # noqa: E731
        proj["hidden"]["bias"])) @ np.asarray(proj["output"]["kernel"]) + np.asarray(
        proj["output"]["bias"])

    def ln(v):  # the projector's LayerNorm, eps 1e-6
        v = (v - v.mean()) / np.sqrt(v.var() + 1e-6)
        return v * np.asarray(params["projector_norm_scale"]) + np.asarray(
            params["projector_norm_bias"])

    z = np.asarray(z)
    layer = np.asarray(params["layer_embedding"]["embedding"])
    m, a, t = 1, 0, 2
    if shared:
        pos = np.asarray(params["position_embedding"]["embedding"])
        e = ln(mlp(np.concatenate([z[t], layer[m], pos[a]])))
        gen, bias = (np.asarray(params[k]) for k in ("down_generator", "down_generator_bias"))
    else:
        e = ln(mlp(np.concatenate([z[t], layer[m]])))
        gen, bias = (np.asarray(params[k])[a] for k in ("down_generator", "down_generator_bias"))
    want = np.einsum("x,xdb->db", e, gen) + bias
    np.testing.assert_allclose(w.down[m, a, t], want, rtol=1e-4, atol=1e-6)
    one = hf.apply({"params": params}, z, m, a)
    np.testing.assert_allclose(one.norm_scale, w.norm_scale[m, a], rtol=1e-6)
    # Started as an ordinary layer norm: gamma = 1 + O(1e-2), beta = O(1e-2).
    np.testing.assert_allclose(w.norm_scale, 1.0, atol=0.1)

    def loss(w):
        x = jnp.ones((3, 2, 4)) * jnp.arange(4.0)
        total = 0.0
        for mm in range(2):
            for aa in range(2):
                g = w.gather(jnp.array([0, 1, 2])).at(mm, aa)
                total += jnp.sum(jnp.sin(apply_adapter(x, g)))
        return total

    grads = jax.grad(lambda p: loss(hf.apply({"params": p}, z)))(params)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    zero = [jax.tree_util.keystr(path) for path, g in flat if not np.any(np.asarray(g) != 0)]
    assert not zero, f"no gradient reaches {zero}"
    without = HyperFormer(shared=shared, num_tasks=3, num_layers=2, num_positions=2, emb_dim=4,
                          bottleneck_dim=2, task_embed_dim=3, task_hidden_dim=5,
                          projected_dim=6, conditional_layer_norm=False)
    assert without.apply({"params": _init(without, z)}, z).norm_scale is None
