"""2-D parameter sharding (`parameter_partitioning_dims=2`): T5 tiny on a 2x4 (data, model)
mesh of 8 fake CPU devices gives the losses of one device for 3 Adafactor steps, with the
`embed` axis of parameters (and of their optimizer state) split over `data`; bad values
and a `layers` rule are clear errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest

from ktx import partitioning
from ktx.models import seq2seq, t5
from tests.test_partitioning import train_losses

VOCAB = 64


def _model():
    config = t5.T5Config(
        vocab_size=VOCAB, emb_dim=16, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
        head_dim=8, mlp_dim=32, dropout_rate=0.1,
    )
    return seq2seq.EncoderDecoderModel(config, num_tasks=2)


def _losses(mesh, dims, steps=3):
    rules = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=dims)
    return train_losses(mesh, steps, model=_model(), rules=rules)


def test_rules_split_embed_over_data():
    one = partitioning.standard_logical_axis_rules()
    two = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=2)
    assert tuple(nn.logical_to_mesh_axes(("embed", "mlp"), one)) == (None, "model")
    assert tuple(nn.logical_to_mesh_axes(("embed", "mlp"), two)) == ("data", "model")
    assert tuple(nn.logical_to_mesh_axes(("vocab", "embed"), two)) == ("model", "data")
    # Activations keep the batch on `data`; their embed axis stays whole.
    assert tuple(nn.logical_to_mesh_axes(("batch", "length", "embed"), two)) == ("data", None, None)
    assert tuple(nn.logical_to_mesh_axes(("layers", "embed", "mlp"), two)) == (None, "data", "model")


def test_2x4_mesh_2d_matches_single_device():
    assert jax.device_count() == 8, "conftest sets 8 fake CPU devices"
    single, _ = _losses(partitioning.create_mesh(1, devices=jax.devices()[:1]), dims=1)
    mesh = partitioning.create_mesh(4)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    sharded, state = _losses(mesh, dims=2)
    np.testing.assert_allclose(sharded, single, atol=1e-4, rtol=1e-4)
    assert not np.allclose(single[0], single[-1]), "the model must actually train"
    kernel = state.params["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]  # [embed, mlp]
    assert tuple(kernel.sharding.spec) == ("data", "model")
    shard = kernel.addressable_shards[0].data.shape
    assert shard == (16 // 2, 32 // 4)
    # Optimizer state follows: Adafactor's (unfactored, as the kernel is small) second
    # moment of this kernel is split like it.
    moments = [
        leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
        if "'encoder']['layers_0']['mlp']['wi_0']" in jax.tree_util.keystr(path)
        and getattr(leaf, "shape", None) == kernel.shape
    ]
    assert moments and all(tuple(m.sharding.spec) == ("data", "model") for m in moments)


@pytest.mark.parametrize("bad", [0, 3, "2", True, None])
def test_bad_dims_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"parameter_partitioning_dims=.*accepted: \(1, 2\)"):
        partitioning.standard_logical_axis_rules(parameter_partitioning_dims=bad)


def test_layers_rule_is_refused():
    with pytest.raises(ValueError, match="'layers'.*never sharded"):
        partitioning.standard_logical_axis_rules([("layers", "model")])
    assert ("layers", None) in partitioning.standard_logical_axis_rules([("layers", None)])
