"""The task-conditioned parameters of a run saved alone (`ktx export RUN
conditioning:FILE`) and loaded back on the backbone reproduce the run's logits exactly."""

from __future__ import annotations

import flax.linen as nn
import gin
import jax
import numpy as np
import optax
import pytest

from ktx import cli
from ktx.training.checkpoints import CheckpointManager
from ktx.conditioning.model import ConditioningConfig, conditioned_model
from ktx.convert.conditioning import export_conditioning, load_conditioning
from ktx.models import seq2seq, t5
from ktx.training.trainer import Trainer


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config(clear_constants=True)
    yield
    gin.clear_config(clear_constants=True)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "encoder_input_tokens": rng.integers(2, 64, (8, 6)).astype(np.int32),
        "decoder_input_tokens": rng.integers(2, 64, (8, 4)).astype(np.int32),
        "decoder_target_tokens": rng.integers(2, 64, (8, 4)).astype(np.int32),
        "decoder_loss_weights": np.ones((8, 4), np.float32),
        "task_id": np.repeat(np.arange(2), 4).astype(np.int32),
    }


def test_export_then_load_on_the_backbone_gives_the_same_logits(tmp_path, capsys):
    base = seq2seq.EncoderDecoderModel(
        config=t5.T5Config(vocab_size=64, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
                           num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0),
        num_tasks=2)
    model = conditioned_model(base, ConditioningConfig(
        method="hyperprompt", encoder_prompt_length=3, decoder_prompt_length=2, reduction_factor=4,
        task_embed_dim=8, task_hidden_dim=8, projected_dim=8), train_backbone=False)
    batch = _batch()
    tr = Trainer(model, optax.adam(1e-2))
    state = tr.init_state(jax.random.key(0), batch)
    backbone = jax.device_get({k: v for k, v in state.params.items() if k != "conditioning"})
    for _ in range(3):
        state, _ = tr.train_step(state, batch, jax.random.key(1))
    manager = CheckpointManager(tmp_path / "run", save_period=1)
    manager.save(state, force=True)
    manager.close()
    trained = jax.device_get(state.params)

    # The CLI writes the file (relative paths work as for every ktx path).
    out = tmp_path / "prompts.safetensors"
    assert cli.main(["export", str(tmp_path / "run"), f"conditioning:{out}"]) == 0
    assert "task-conditioned parameters" in capsys.readouterr().out
    assert out.stat().st_size < 200_000

    # On the backbone with freshly initialised conditioning: the run's logits, exactly.
    fresh = nn.meta.unbox(model.init_variables(jax.random.key(5), batch))["params"]
    start = {**backbone, "conditioning": fresh["conditioning"]}
    restored = load_conditioning(start, out)
    np.testing.assert_array_equal(np.asarray(model.logits(restored, batch)),
                                  np.asarray(model.logits(trained, batch)))
    assert not np.array_equal(np.asarray(model.logits(start, batch)),
                              np.asarray(model.logits(trained, batch)))

    # A file for another configuration names the mismatching parameters; no overwrite.
    other = conditioned_model(base, ConditioningConfig(
        method="hyperprompt", encoder_prompt_length=4, decoder_prompt_length=2, reduction_factor=4,
        task_embed_dim=8, task_hidden_dim=8, projected_dim=8), train_backbone=False)
    other_params = nn.meta.unbox(other.init_variables(jax.random.key(0), batch))["params"]
    with pytest.raises(ValueError, match="conditioning/.*model"):
        load_conditioning(other_params, out)
    with pytest.raises(ValueError, match="exists"):
        export_conditioning(tmp_path / "run", out)
