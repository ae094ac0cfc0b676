"""`ktx analyze attention`: hand-checked statistics and the JSON/PNG it writes."""

import json
import math

import flax.linen as nn
import jax
import numpy as np

from ktx.analysis.attention import analyze_attention, attention_statistics
from ktx.conditioning.model import ConditioningConfig, conditioned_model
from ktx.models import seq2seq, t5


def test_attention_statistics_hand_computed():
    # One example, one head, two queries; one prompt key then two token keys.
    probs = np.array([[[[0.5, 0.25, 0.25], [0.2, 0.8, 0.0]]]], np.float32)
    mass, entropy, nq = attention_statistics(
        probs, 1, np.array([[True, True]]), np.array([[True, True]])
    )
    np.testing.assert_allclose(mass, [0.7], rtol=1e-6)  # 0.5 + 0.2 summed over queries
    np.testing.assert_allclose(entropy, [math.log(2.0)], rtol=1e-6)  # ln 2 + 0
    np.testing.assert_array_equal(nq, [2.0])
    # An invalid query is left out of both sums.
    mass, entropy, nq = attention_statistics(
        probs, 1, np.array([[True, False]]), np.array([[True, True]])
    )
    np.testing.assert_allclose(mass, [0.5], rtol=1e-6)
    np.testing.assert_array_equal(nq, [1.0])


def test_analyze_attention_writes_json_and_png(tmp_path):
    cfg = t5.T5Config(vocab_size=32, emb_dim=16, num_heads=2, num_encoder_layers=2,
                      num_decoder_layers=1, head_dim=8, mlp_dim=32, dropout_rate=0.0)
    model = conditioned_model(
        seq2seq.EncoderDecoderModel(cfg, num_tasks=2),
        ConditioningConfig(method="hyperprompt", hyperprompt_variant="share",
                           encoder_prompt_length=3, decoder_prompt_length=2, reduction_factor=4),
    )
    rng = np.random.default_rng(0)
    batch = {
        "encoder_input_tokens": np.concatenate(
            [rng.integers(2, 32, (2, 4)), np.zeros((2, 1), int)], 1).astype(np.int32),
        "decoder_input_tokens": rng.integers(2, 32, (2, 3)).astype(np.int32),
        "decoder_target_tokens": rng.integers(2, 32, (2, 3)).astype(np.int32),
        "decoder_loss_weights": np.ones((2, 3), np.float32),
        "task_id": np.array([1, 1], np.int32),
    }
    params = nn.meta.unbox(model.init_variables(jax.random.key(0), batch))["params"]
    report = analyze_attention(model, params, [batch, batch], task="glue_rte_v2", out_dir=tmp_path)
    assert report["num_examples"] == 4
    assert [r["layer"] for r in report["encoder"]] == [0, 1] and len(report["decoder"]) == 1
    for side, lq in (("encoder", 4), ("decoder", 3)):
        for row in report[side]:
            assert 0.0 < row["prompt_mass"] < lq  # summed over the valid queries
            assert 0.0 <= row["token_entropy"] <= math.log(lq) + 1e-6
    saved = json.loads((tmp_path / "attention_glue_rte_v2.json").read_text())
    assert saved == report
    png = (tmp_path / "attention_glue_rte_v2.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
