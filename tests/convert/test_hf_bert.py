"""Hugging Face BERT import (`ktx.convert.hf_bert`) against the transformers fixture
`hf_bert_tiny` (BertForMaskedLM, 2 layers x 64, exact-erf GELU; see
`<fixtures>/checkpoints/README.md`).

Measured (CPU, float32, non-padded positions): last_hidden_state max |diff| 1.9e-6 (max
|value| 3.19), mlm_logits 4.6e-6 (max |value| 6.51) -- the scale of float32 rounding
(the fixture README: float32 vs float64 transformers 1.4e-6 / 3.6e-6). Padded positions
agree too (keys-only masking, as transformers). Tolerance: 1e-4.
"""

from __future__ import annotations

import json
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx import convert
from ktx.training import checkpoints
from ktx.training import initial_params
from ktx.convert import hf_bert
from ktx.convert.safetensors_io import read_safetensors, write_safetensors
from ktx.models import bert, encoder
from tests.convert.conftest import checkpoint_fixture, load_expected, load_inputs

TOL = 1e-4


def _outputs(config, params, inputs, **kw):
    return bert.BertEncoder(config).apply(
        {"params": params}, jnp.asarray(inputs["input_ids"]), jnp.asarray(inputs["token_type_ids"]),
        jnp.asarray(inputs["attention_mask"]), mlm=True, pool=False, **kw)


def test_parity_with_transformers():
    folder = checkpoint_fixture("hf_bert_tiny")
    imported = convert.load_source(f"hf:{folder}")  # dispatched by model_type
    assert isinstance(imported, hf_bert.BertImported)
    assert imported.config == bert.BertConfig(
        vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
        max_position=128, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12,
        dropout_rate=0.0, attention_dropout_rate=0.0)
    assert "pooler" not in imported.params  # BertForMaskedLM has none
    assert sum(v.size for v in convert.flatten(imported.params).values()) == 112_960
    inputs, expected = load_inputs(folder), load_expected(folder)
    out = jax.jit(lambda p: _outputs(imported.config, p, inputs))(imported.params)
    real = inputs["attention_mask"] > 0
    for name, got in (("last_hidden_state", out.last_hidden_state), ("mlm_logits", out.mlm_logits)):
        err = np.abs(np.asarray(got) - expected[name])[real].max()
        assert err < TOL, (name, err)
    # Without attention_mask the mask comes from input_ids > 0: the same outputs here.
    derived = bert.BertEncoder(imported.config).apply(
        {"params": imported.params}, jnp.asarray(inputs["input_ids"]),
        jnp.asarray(inputs["token_type_ids"]), mlm=True, pool=False)
    np.testing.assert_allclose(derived.mlm_logits[real], expected["mlm_logits"][real], atol=TOL)


def _copy_with(tmp_path, folder, rename=lambda n: n, extra=None, drop=()):
    out = tmp_path / "ckpt"
    out.mkdir()
    shutil.copy(folder / "config.json", out / "config.json")
    tensors = {rename(k): np.asarray(v) for k, v in read_safetensors(folder / "model.safetensors").items()
               if k not in drop}
    tensors.update(extra or {})
    write_safetensors(out / "model.safetensors", tensors)
    return out


def test_unprefixed_names_and_sentence_transformers_extras(tmp_path):
    folder = checkpoint_fixture("hf_bert_tiny")
    rng = np.random.default_rng(0)
    pooler = {"pooler.dense.weight": rng.normal(size=(64, 64)).astype(np.float32),
              "pooler.dense.bias": rng.normal(size=(64,)).astype(np.float32)}
    out = _copy_with(tmp_path, folder, lambda n: n.removeprefix("bert."), pooler)
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (out / "modules.json").write_text("[]")
    imported = convert.read_hf_bert(out)
    reference = convert.read_hf_bert(folder)
    for k, v in convert.flatten(reference.params).items():
        np.testing.assert_array_equal(convert.flatten(imported.params)[k], v)
    np.testing.assert_array_equal(imported.params["pooler"]["kernel"], pooler["pooler.dense.weight"].T)
    inputs = load_inputs(folder)
    got = bert.BertEncoder(imported.config).apply(
        {"params": imported.params}, jnp.asarray(inputs["input_ids"]))
    hidden = np.asarray(got.last_hidden_state[:, 0])
    np.testing.assert_allclose(got.pooled_output, np.tanh(hidden @ pooler["pooler.dense.weight"].T
                                                          + pooler["pooler.dense.bias"]), atol=1e-5)


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
    folder = checkpoint_fixture("hf_bert_tiny")
    name = "bert.encoder.layer.1.intermediate.dense.weight"
    out = _copy_with(tmp_path, folder, extra={name: np.zeros((96, 64), np.float32)})
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.intermediate\.dense\.weight has "
                                         r"shape \[96, 64\], expected \[128, 64\]"):
        convert.read_hf_bert(out)


def test_missing_and_unknown_tensors_are_named(tmp_path):
    folder = checkpoint_fixture("hf_bert_tiny")
    out = _copy_with(tmp_path, folder, drop=("bert.encoder.layer.0.output.LayerNorm.bias",),
                     extra={"classifier.weight": np.zeros((3, 64), np.float32)})
    with pytest.raises(ValueError) as e:
        convert.read_hf_bert(out)
    assert "encoder.layer.0.output.LayerNorm.bias is missing (expected shape [64])" in str(e.value)
    assert "classifier.weight [3, 64] is not part of this model" in str(e.value)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="hidden_act='swish'"):
        hf_bert.bert_config_from_hf({"model_type": "bert", "hidden_act": "swish"})
    with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
        hf_bert.bert_config_from_hf({"model_type": "bert", "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="field 'hidden_size' is missing"):
        hf_bert.bert_config_from_hf({"model_type": "bert", "vocab_size": 8})


def test_import_and_initial_params_into_classifier(tmp_path):
    """`ktx import hf:DIR` writes a BERT checkpoint with a model.gin; `hf:DIR` as
    INITIAL_CHECKPOINT_PATH fills the backbone, leaves heads (and the absent pooler) at init."""
    folder = checkpoint_fixture("hf_bert_tiny")
    path = convert.import_checkpoint(f"hf:{folder}", tmp_path / "imported")
    text = (path / "model.gin").read_text()
    assert "encoder.EncoderClassifierModel" in text and "hidden_size = 64" in text
    model = encoder.EncoderClassifierModel(
        hf_bert.read_hf_bert(folder).config, num_labels=(3, 1))
    spec = model.input_spec(2, {"inputs": 10})
    init = jax.tree.map(np.asarray, nn.unbox(model.init_variables(jax.random.key(0), spec)["params"]))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), init)
    params, report = initial_params.load_initial_params(f"hf:{folder}", abstract, init)
    assert set(report.initialized) == {"pooler/kernel", "pooler/bias", "task_heads/task_0/kernel",
                                       "task_heads/task_0/bias", "task_heads/task_1/kernel",
                                       "task_heads/task_1/bias"}
    word = convert.read_hf_bert(folder).params["embeddings"]["word_embeddings"]["embedding"]
    np.testing.assert_array_equal(params["embeddings"]["word_embeddings"]["embedding"], word)


def test_checkpoint_config_that_disagrees_with_the_gin_model_is_named():
    """INITIAL_CHECKPOINT_PATH='hf:DIR' of a BERT whose config differs from the gin model
    (here: the gin model is 2 x 32 wide, the checkpoint 2 x 64): CheckpointShapeError
    naming each parameter with both shapes, before anything is placed."""
    folder = checkpoint_fixture("hf_bert_tiny")
    cfg = json.loads((folder / "config.json").read_text())
    model = encoder.EncoderClassifierModel(
        bert.BertConfig(vocab_size=cfg["vocab_size"], hidden_size=32, num_layers=2, num_heads=4,
                        intermediate_size=cfg["intermediate_size"],
                        max_position=cfg["max_position_embeddings"]), num_labels=(2,))
    batch = {"input_ids": jnp.ones((2, 8), jnp.int32)}
    abstract = jax.eval_shape(lambda: nn.unbox(model.init_variables(jax.random.key(0), batch)["params"]))
    with pytest.raises(checkpoints.CheckpointShapeError) as e:
        initial_params.load_initial_params(f"hf:{folder}", abstract,
                                        lambda names: jax.tree.map(lambda a: np.zeros(a.shape, a.dtype),
                                                                   abstract))
    assert "embeddings/word_embeddings/embedding: checkpoint (" in str(e.value)
    assert f", {cfg['hidden_size']}), model (" in str(e.value)
