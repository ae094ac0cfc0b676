"""Import -> export -> import is bit-identical; the exported directory follows
transformers' conventions; the parameter layout is the model's; ktx checkpoint
directories written by `import_checkpoint` load like runs."""

from __future__ import annotations

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from ktx import convert
from ktx.training.checkpoints import resolve_checkpoint, restore_params
from ktx.training.initial_params import load_initial_params
from ktx.models import t5
from tests.convert.conftest import checkpoint_fixture

# config.json fields that define the network (the rest is bookkeeping).
_NETWORK_FIELDS = ("d_ff", "d_kv", "d_model", "feed_forward_proj", "dense_act_fn", "is_gated_act",
                   "num_heads", "num_layers", "num_decoder_layers", "relative_attention_max_distance",
                   "relative_attention_num_buckets", "tie_word_embeddings", "scale_decoder_outputs",
                   "vocab_size", "layer_norm_epsilon", "model_type", "pad_token_id", "eos_token_id",
                   "decoder_start_token_id", "dropout_rate")


def _tensors(path):
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _assert_same_params(a, b):
    fa, fb = convert.flatten(a), convert.flatten(b)
    assert sorted(fa) == sorted(fb)
    for k in fa:
        assert fa[k].dtype == fb[k].dtype == np.float32, k
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


@pytest.mark.parametrize("name", ["hf_t5_v1_1_tiny", "hf_t5_v1_0_tiny"])
def test_hf_import_export_import_is_bit_identical(name, tmp_path):
    """Exported tensors equal the transformers-written ones bit for bit (read back with
    the safetensors library itself), config.json keeps every network field, and the
    re-import gives the same ktx parameters and config."""
    folder = checkpoint_fixture(name)
    first = convert.read_hf_t5(folder)
    out = convert.write_hf_t5(first.params, first.config, tmp_path / "exported")
    original, exported = _tensors(folder), _tensors(out)
    assert sorted(exported) == sorted(original)
    for k in original:
        assert exported[k].dtype == original[k].dtype
        np.testing.assert_array_equal(exported[k], original[k], err_msg=k)
    ref_cfg = json.loads((folder / "config.json").read_text())
    new_cfg = json.loads((out / "config.json").read_text())
    for field in _NETWORK_FIELDS:
        assert new_cfg[field] == ref_cfg[field], field
    second = convert.read_hf_t5(out)
    assert second.config == first.config
    _assert_same_params(first.params, second.params)


def test_transformers_reads_the_export(tmp_path):
    """If transformers (and torch) are importable, `from_pretrained` loads the export and
    computes the fixture's logits."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                       "(not a ktx dependency); the safetensors test covers the files")
    torch = pytest.importorskip("torch")
    folder = checkpoint_fixture("hf_t5_v1_1_tiny")
    imported = convert.read_hf_t5(folder)
    out = convert.write_hf_t5(imported.params, imported.config, tmp_path / "exported")
    model = transformers.T5ForConditionalGeneration.from_pretrained(str(out)).eval()
    inputs = json.loads((folder / "inputs.json").read_text())
    with torch.no_grad():
        logits = model(**{k: torch.tensor(v) for k, v in inputs.items()}).logits.numpy()
    expected = np.load(folder / "expected.npz")["logits"]
    # Another transformers / torch build than the fixture's: float32 rounding only (the
    # fixtures README: independent float32 implementations agree to about 1e-5).
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)


def test_t5x_import_exports_the_hf_weights(tmp_path):
    """t5x_t5_1_1_tiny/checkpoint_0 holds hf_t5_v1_1_tiny's weights: importing it and
    exporting to Hugging Face gives that directory's tensors bit for bit."""
    ktx_dir = convert.import_checkpoint(
        f"t5x:{checkpoint_fixture('t5x_t5_1_1_tiny') / 'checkpoint_0'}", tmp_path / "imported")
    out = convert.export_checkpoint(ktx_dir, f"hf:{tmp_path / 'hf'}")
    original = _tensors(checkpoint_fixture("hf_t5_v1_1_tiny"))
    exported = _tensors(out)
    assert sorted(exported) == sorted(original)
    for k in original:
        np.testing.assert_array_equal(exported[k], original[k], err_msg=k)


def test_ktx_checkpoint_directory_round_trip(tmp_path):
    """`import_checkpoint` writes model.gin + an orbax step that resolve_checkpoint,
    restore_params and export_checkpoint read back bit-identically."""
    folder = checkpoint_fixture("hf_t5_v1_0_tiny")
    imported = convert.read_hf_t5(folder)
    out = convert.import_checkpoint(f"hf:{folder}", tmp_path / "ktx")
    assert (out / "model.gin").is_file()
    assert "logits_via_embedding = True" in (out / "model.gin").read_text()
    assert resolve_checkpoint(out) == out / "checkpoints" / "0"
    flat, config, _ = convert.read_ktx_checkpoint(out)
    assert config == imported.config
    _assert_same_params(imported.params, convert.unflatten(flat))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), imported.params)
    restored, step = restore_params(out, abstract)
    assert step == 0
    _assert_same_params(imported.params, jax.tree.map(np.asarray, restored))
    exported = convert.export_checkpoint(out, f"hf:{tmp_path / 'hf'}")
    _assert_same_params(imported.params, convert.read_hf_t5(exported).params)


@pytest.mark.parametrize("source", ["hf", "ktx"])
def test_load_initial_params_from_a_source_and_from_the_import(source, tmp_path):
    """INITIAL_CHECKPOINT_PATH: `hf:DIR` converted on the fly and the imported ktx
    directory give the same, bit-identical parameters."""
    folder = checkpoint_fixture("hf_t5_v1_1_tiny")
    imported = convert.read_hf_t5(folder)
    path = f"hf:{folder}" if source == "hf" else convert.import_checkpoint(f"hf:{folder}", tmp_path / "k")
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), imported.params)
    init = jax.tree.map(jnp.zeros_like, imported.params)
    params, report = load_initial_params(path, abstract, init)
    assert not report.initialized and not report.unused
    _assert_same_params(imported.params, jax.tree.map(np.asarray, params))


@pytest.mark.parametrize("config", [
    t5.T5Config(vocab_size=40, emb_dim=8, num_heads=2, head_dim=4, mlp_dim=16,
                num_encoder_layers=2, num_decoder_layers=3),
    t5.T5Config(vocab_size=40, emb_dim=8, num_heads=2, head_dim=3, mlp_dim=16,
                num_encoder_layers=1, num_decoder_layers=1, mlp_activations=("relu",),
                logits_via_embedding=True, relative_attention_num_buckets=8,
                relative_attention_max_distance=20),
])
def test_expected_shapes_are_the_models(config):
    """`expected_shapes` lists exactly the parameters `t5.Transformer.init` creates, and
    `config_from_params` recovers the config from them."""
    tokens = jnp.ones((1, 4), jnp.int32)
    variables = jax.eval_shape(
        lambda: t5.Transformer(config).init(jax.random.key(0), tokens, tokens, enable_dropout=False))
    params = nn.unbox(variables["params"])
    shapes = {k: tuple(v.shape) for k, v in convert.flatten(params).items()}
    assert shapes == convert.expected_shapes(config)
    zeros = {k: np.zeros(v, np.float32) for k, v in shapes.items()}
    recovered = convert.config_from_params(
        zeros, mlp_activations=config.mlp_activations,
        relative_attention_max_distance=config.relative_attention_max_distance,
        dropout_rate=config.dropout_rate)
    assert recovered == dataclasses.replace(config)
