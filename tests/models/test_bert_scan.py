"""`BertConfig.scan_layers`: the scanned BERT stack equals the unrolled one on the tree
`scan_layout.convert_layout` gives (logits and gradients), composes with remat, keeps
the shared top layers and method scopes apart, and methods with their own layers refuse it."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx import partitioning
from ktx.models import bert, camtl, encoder, pals, scan_layout, tea

CONFIG = bert.BertConfig(vocab_size=40, hidden_size=16, num_layers=3, num_heads=2,
                         intermediate_size=32, max_position=16, dropout_rate=0.0,
                         attention_dropout_rate=0.0)


def _batch():
    ids = (np.arange(4 * 8).reshape(4, 8) * 7) % 39 + 1
    ids[1, 5:] = 0
    return {"input_ids": jnp.asarray(ids, jnp.int32),
            "token_type_ids": jnp.asarray(np.arange(32).reshape(4, 8) % 2, jnp.int32),
            "label": jnp.asarray([0.0, 2.0, 0.5, 1.5]),
            "task_id": jnp.asarray([0, 0, 1, 1], jnp.int32)}


def _model(scan: bool, remat: str = "none", **kwargs):
    config = dataclasses.replace(CONFIG, scan_layers=scan, remat_policy=remat)
    return encoder.EncoderClassifierModel(config, num_labels=(3, 1), **kwargs)


@pytest.mark.parametrize("remat", ["none", "minimal"])
def test_scanned_equals_unrolled(remat):
    batch = _batch()
    unrolled = _model(False, shared_layers=1)
    params = nn.unbox(unrolled.init_variables(jax.random.key(0), batch)["params"])
    scanned = _model(True, remat, shared_layers=1)
    boxed = scanned.init_variables(jax.random.key(0), batch)["params"]
    stacked = scan_layout.convert_layout(params, scanned=True)
    # same tree as the scanned model's own init; layers stacked [L, ...] on the `layers` axis
    assert jax.tree.structure(stacked) == jax.tree.structure(nn.unbox(boxed))
    assert stacked["layers"]["attention"]["query"]["kernel"].shape == (3, 16, 2, 8)
    assert "layers_0" in stacked["shared_layers"]  # the shared top layer stays unrolled
    axes = nn.get_partition_spec(boxed)["layers"]["attention"]["query"]["kernel"]
    assert axes[0] == partitioning.LAYERS
    for a, b in zip(unrolled.logits(params, batch), scanned.logits(stacked, batch)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def loss(model, p):
        sums, _ = model.loss_sums(p, batch, None, False)
        return sums.sum()

    g_unrolled = jax.grad(lambda p: loss(unrolled, p))(params)
    g_scanned = scan_layout.convert_layout(jax.grad(lambda p: loss(scanned, p))(stacked),
                                           scanned=False)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_unrolled)[0],
                            jax.tree.leaves(g_scanned)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(path))


def test_bert_layout_conversion_leaves_other_layer_scopes():
    flat = {"layers_0/output/kernel": np.zeros((2, 3)), "layers_1/output/kernel": np.ones((2, 3)),
            "conditioning/layers_0/w": np.zeros(2), "shared_layers/layers_0/output/kernel": np.ones(1),
            "pooler/kernel": np.ones(1)}
    scanned = scan_layout.convert_layout(flat, scanned=True)
    assert sorted(scanned) == ["conditioning/layers_0/w", "layers/output/kernel", "pooler/kernel",
                               "shared_layers/layers_0/output/kernel"]
    np.testing.assert_array_equal(scanned["layers/output/kernel"][1], np.ones((2, 3)))
    back = scan_layout.convert_layout(scanned, scanned=False)
    assert sorted(back) == sorted(flat)
    assert scan_layout.num_layers(scanned, "") == 2 == scan_layout.num_layers(flat, "")
    assert scan_layout.is_scanned(flat) is False and scan_layout.is_scanned(scanned) is True


def test_methods_with_their_own_layers_refuse_scan():
    config = dataclasses.replace(CONFIG, scan_layers=True)
    for build in (lambda: camtl.CaMtlClassifierModel(config, camtl=camtl.CaMtlConfig(max_seq_length=8),
                                                     num_labels=(3, 1)),
                  lambda: pals.PalsClassifierModel(config, num_labels=(3, 1), pals_size=4,
                                                   pals_heads=2),
                  lambda: tea.TeaClassifierModel(config, num_labels=(3, 1))):
        with pytest.raises(ValueError, match="scans plain BERT layers only"):
            build()
    with pytest.raises(ValueError, match="BertConfig.scan_layers='yes'"):
        bert.BertConfig(scan_layers="yes")
