"""HyperFormer(++) reproduces the authors' code: their tiny weights, mapped by name onto
`ktx.conditioning.HyperFormer`, give the generated adapter weights, layer norms and adapter
outputs they computed (fixtures: `<fixtures>/hyperformer/README.md`)."""

from __future__ import annotations

import json
import os
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from ktx.conditioning.adapters import apply_adapter
from ktx.conditioning.hyperformer import HyperFormer

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = pathlib.Path(os.environ.get("KTX_FIXTURES_DIR", REPO.parent / "shared" / "fixtures"))
HERE = FIXTURES / "hyperformer"
# ktx adapter positions (0 = after self-attention, 1 = after the feed-forward block) and
# the reference's names; HyperFormer++'s block type ids: 0 = feed-forward, 1 = self-attention.
POSITIONS = ("self_attention", "feed_forward")
BLOCK_TYPE = {"self_attention": 1, "feed_forward": 0}
TOL = dict(rtol=1e-5, atol=1e-5)


def _fixture(variant: str):
    directory = HERE / variant
    if not (directory / "weights.safetensors").exists():
        pytest.skip(
            f"HyperFormer reference fixtures not found at {directory} (set KTX_FIXTURES_DIR "
            "to the folder holding hyperformer/)"
        )
    config = json.loads((directory / "reference.json").read_text())
    weights = load_file(str(directory / "weights.safetensors"))
    expected = dict(np.load(directory / "expected.npz"))
    return config, weights, expected


def _linear(w, prefix):
    """A PyTorch `nn.Linear` (`[out, in]`) as `(kernel [in, out], bias [out])`."""
    return w[f"{prefix}.weight"].T, w[f"{prefix}.bias"]


def _ktx_params(config, w, shared: bool) -> dict:
    """The reference's weights under ktx's parameter names and layouts."""
    d, b = config["d_model"], config["d_model"] // config["reduction_factor"]
    t = config["projected_task_embedding_dim"]
    net = "adapter_layers_hyper_net"
    hidden_k, hidden_b = _linear(w, f"{net}.task_hypernet.task_embeding_generator.0")
    out_k, out_b = _linear(w, f"{net}.task_hypernet.task_embeding_generator.2")
    params = {
        "layer_embedding": {"embedding": w[f"{net}.layer_id_embeddings.weight"]},
        "task_projector": {
            "hidden": {"kernel": hidden_k, "bias": hidden_b},
            "output": {"kernel": out_k, "bias": out_b},
        },
        "projector_norm_scale": w[f"{net}.LayerNorm.weight"],
        "projector_norm_bias": w[f"{net}.LayerNorm.bias"],
    }
    if shared:
        block = w[f"{net}.adapters_block_type.weight"]
        params["position_embedding"] = {
            "embedding": np.stack([block[BLOCK_TYPE[p]] for p in POSITIONS])
        }

    def generators(prefix: str) -> dict:
        """One position's (or, shared, all positions') generators in ktx layout."""
        up_w = w[f"{prefix}up_sampler_hyper_net.weight_generator.0.weight"]  # [d*b, t]
        down_w = w[f"{prefix}down_sampler_hyper_net.weight_generator.0.weight"]  # [b*d, t]
        # The generated vectors are viewed as PyTorch [out, in] weights: up [d, b],
        # down [b, d]; ktx stores them [in, out] (up [b, d], down [d, b]).
        up_bias_k, up_bias_b = _linear(w, f"{prefix}up_sampler_hyper_net.bias_generator.0")
        down_bias_k, down_bias_b = _linear(w, f"{prefix}down_sampler_hyper_net.bias_generator.0")
        scale_k, scale_b = _linear(w, f"{prefix}post_layernorm_hypernet.weight_generator")
        nbias_k, nbias_b = _linear(w, f"{prefix}post_layernorm_hypernet.bias_generator")
        return {
            "up_generator": up_w.reshape(d, b, t).transpose(2, 1, 0),
            "up_generator_bias": w[f"{prefix}up_sampler_hyper_net.weight_generator.0.bias"]
            .reshape(d, b).T,
            "down_generator": down_w.reshape(b, d, t).transpose(2, 1, 0),
            "down_generator_bias": w[f"{prefix}down_sampler_hyper_net.weight_generator.0.bias"]
            .reshape(b, d).T,
            "up_bias_generator": up_bias_k, "up_bias_generator_bias": up_bias_b,
            "down_bias_generator": down_bias_k, "down_bias_generator_bias": down_bias_b,
            "norm_scale_generator": scale_k, "norm_scale_generator_bias": scale_b,
            "norm_bias_generator": nbias_k, "norm_bias_generator_bias": nbias_b,
        }

    if shared:
        params.update(generators(f"{net}."))
    else:
        per_position = [generators(f"{net}.{p}_") for p in POSITIONS]
        params.update({k: np.stack([g[k] for g in per_position]) for k in per_position[0]})
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)


@pytest.mark.parametrize("variant,shared", [("hyperformer", False), ("hyperformer_pp", True)])
def test_reproduces_the_authors_outputs(variant, shared):
    config, w, expected = _fixture(variant)
    tasks = config["tasks"]
    d, M = config["d_model"], config["num_layers"]
    module = HyperFormer(
        shared=shared, num_tasks=len(tasks), num_layers=M, num_positions=len(POSITIONS),
        emb_dim=d, bottleneck_dim=d // config["reduction_factor"],
        task_embed_dim=config["task_embedding_dim"], task_hidden_dim=config["task_hidden_dim"],
        projected_dim=config["projected_task_embedding_dim"],
    )
    z = jnp.asarray(np.stack([w[f"task_embedding_controller.task_to_embeddings.{t}"]
                              for t in tasks]))
    params = _ktx_params(config, w, shared)
    # The mapped parameters have exactly the module's structure and shapes.
    init = nn.meta.unbox(module.init(jax.random.key(0), z)["params"])
    assert jax.tree.map(jnp.shape, init) == jax.tree.map(jnp.shape, params)
    weights = jax.jit(lambda p, z: module.apply({"params": p}, z))(params, z)
    hidden = jnp.asarray(expected["hidden"])
    batch = hidden.shape[0]
    checked = 0
    for ti in range(len(tasks)):
        for m in range(M):
            for a, pos in enumerate(POSITIONS):
                key = f"task{ti}_layer{m}_{pos}"
                slot = weights.at(m, a, ti)
                got = {
                    "down_weight": slot.down.T, "down_bias": slot.down_bias,
                    "up_weight": slot.up.T, "up_bias": slot.up_bias,
                    "post_norm_weight": slot.norm_scale, "post_norm_bias": slot.norm_bias,
                }
                for name, value in got.items():
                    np.testing.assert_allclose(value, expected[f"{key}_{name}"], **TOL,
                                               err_msg=f"{variant} {key}_{name}")
                per_example = weights.gather(jnp.full((batch,), ti), axis=2).at(m, a)
                out = apply_adapter(hidden, per_example)  # defaults: gelu_new, eps 1e-5
                np.testing.assert_allclose(out, expected[f"{key}_output"], **TOL,
                                           err_msg=f"{variant} {key}_output")
                checked += 7
    assert checked == len(expected) - 1  # every array but `hidden`
    # relu is available, and is not what the reference computes.
    relu_out = apply_adapter(hidden, weights.gather(jnp.zeros((batch,), jnp.int32)).at(0, 0),
                             activation="relu")
    assert not np.allclose(relu_out, expected["task0_layer0_self_attention_output"], atol=1e-4)
