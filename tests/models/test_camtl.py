"""CA-MTL (`ktx.models.camtl`, `ktx.convert.camtl`) against the authors' code, captured by
the fixture `<fixtures>/camtl/{base,large}` (see its README.md: tiny random weights, 3
tasks, 6 padded rows), plus training, freezing, import and bad inputs.

Measured (CPU, float32): Base: hidden states max |diff| 4.3e-6, pooled 9.5e-7, head
logits 5.7e-7, normalised entropy 6e-8; Large: hidden states 5.7e-6, last hidden state
(f_{n-1}) 1.3e-6, pooled 5.7e-7, logits 3.0e-7, entropy 6e-8. Tolerance: 2e-5 (absolute).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ktx import cli, convert
from ktx import partitioning
from ktx.training import initial_params
from ktx.training import trainer as trainer_lib
from ktx.convert import camtl as camtl_convert
from ktx.convert.safetensors_io import read_safetensors, write_safetensors
from ktx.models import bert, camtl, encoder, scan_layout

REPO = pathlib.Path(__file__).resolve().parents[2]
TOL = 2e-5
TINY = bert.BertConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4,
                       intermediate_size=64, max_position=16)


def _fixture(variant: str) -> pathlib.Path:
    root = os.environ.get("KTX_FIXTURES_DIR")
    path = (pathlib.Path(root) if root else REPO.parent / "shared" / "fixtures") / "camtl" / variant
    if not (path / "weights.safetensors").is_file():
        pytest.skip(f"CA-MTL reference fixture not found at {path} (set KTX_FIXTURES_DIR to the "
                    "shared fixtures folder holding camtl/{base,large})")
    return path


def _reference(folder: pathlib.Path):
    ref = json.loads((folder / "reference.json").read_text())
    batch = {k: np.asarray(v, np.int32) for k, v in ref["inputs"].items()}
    return ref, batch, np.load(folder / "expected.npz")


def _init_params(model, batch, seed=0):
    """`model`'s unboxed initial params for `batch`'s shapes, initialized by one jitted
    program (rather than op by op)."""
    return jax.jit(lambda r: nn.unbox(model.init_variables(r, batch)["params"]))(
        jax.random.key(seed))


def _check_heads(model, params, ref, batch, logits_fn=None):
    logits = (logits_fn or model.logits)(params, batch)
    entropy = jax.jit(camtl.row_normalised_entropy)(logits, batch["task_id"])
    for t, name in enumerate(ref["config"]["tasks"]):
        rows = batch["task_id"] == t
        np.testing.assert_allclose(np.asarray(logits[t])[rows], ref["head_logits"][name], atol=TOL)
        np.testing.assert_allclose(np.asarray(entropy)[rows], ref["normalised_entropy"][name],
                                   atol=TOL)


@pytest.mark.parametrize("variant", ["base", "large"])
def test_reproduces_the_authors_code(variant):
    folder = _fixture(variant)
    ref, batch, expected = _reference(folder)
    imported = camtl_convert.read_camtl(folder)
    assert imported.config.camtl == camtl.CaMtlConfig(variant, 16, "code")
    assert imported.config.num_labels == (2, 1, 3)
    model = imported.config.model()
    out = jax.jit(model.encode)(imported.params, batch)
    assert len(out.hidden_states) == 5
    np.testing.assert_allclose(np.stack(out.hidden_states), expected["hidden_states"], atol=TOL)
    np.testing.assert_allclose(out.last_hidden_state, expected["last_hidden_state"], atol=TOL)
    np.testing.assert_allclose(out.pooled_output, expected["pooled_output"], atol=TOL)
    if variant == "large":  # the encoder's output is the bottleneck chain, not the last layer
        assert np.abs(expected["last_hidden_state"] - expected["hidden_states"][-1]).max() > 0.1
    _check_heads(model, imported.params, ref, batch)


@pytest.mark.parametrize("variant", ["base", "large"])
def test_a_scanned_stack_reproduces_the_authors_code(variant):
    """The authors' weights in the scanned layout (`scan_layout.convert_layout`) run by a
    `scan_layers=True` CA-MTL give the same hidden states, pooled output and head logits."""
    folder = _fixture(variant)
    ref, batch, expected = _reference(folder)
    imported = camtl_convert.read_camtl(folder)
    config = imported.config._replace(bert=dataclasses.replace(imported.config.bert,
                                                               scan_layers=True))
    model = config.model()
    params = scan_layout.convert_layout(imported.params, scanned=True)
    assert params["layers"]["attention"]["query"]["kernel"].shape[0] == 4
    out = jax.jit(model.encode)(params, batch)
    np.testing.assert_allclose(np.stack(out.hidden_states), expected["hidden_states"], atol=TOL)
    np.testing.assert_allclose(out.last_hidden_state, expected["last_hidden_state"], atol=TOL)
    np.testing.assert_allclose(out.pooled_output, expected["pooled_output"], atol=TOL)
    _check_heads(model, params, ref, batch)


def test_paper_layer_norm_with_zero_bias_generators_is_the_code_form():
    folder = _fixture("base")
    ref, batch, _ = _reference(folder)
    imported = camtl_convert.read_camtl(folder)
    c = imported.config
    paper = camtl.CaMtlClassifierModel(
        c.bert, camtl=camtl.CaMtlConfig("base", 16, "paper"), num_labels=c.num_labels)
    shapes = jax.eval_shape(paper.init_variables, jax.random.key(0),
                            paper.input_spec(1, {"inputs": 16}))  # names and shapes only
    flat = convert.flatten(nn.unbox(shapes["params"]))
    extra = sorted(set(flat) - set(convert.flatten(imported.params)))
    assert extra and all("/bias_film/" in p for p in extra), extra
    assert "conditioning/layers_3/adapter/layer_norm_film/bias_film/kernel" in extra
    params = convert.flatten(imported.params)
    params.update({p: np.zeros(flat[p].shape, np.float32) for p in extra})
    params = convert.unflatten(params)
    paper_logits = jax.jit(paper.logits)  # one program for the three forwards below
    _check_heads(paper, params, ref, batch, paper_logits)  # (1 + 0) * b + 0 = b
    # A non-zero bias generator changes the output: the bias is conditioned on z.
    one = convert.flatten(params)
    one["conditioning/layers_2/output_layer_norm/bias_film/bias"] = np.full_like(
        one["conditioning/layers_2/output_layer_norm/bias_film/bias"], 0.5)
    moved = paper_logits(convert.unflatten(one), batch)
    assert np.abs(np.asarray(moved[0]) - np.asarray(paper_logits(params, batch)[0])).max() > 1e-3


def test_normalised_entropy_hand_computed():
    logits = jnp.array([[0.0, 0.0, 0.0], [10.0, -10.0, -10.0], [np.log(2.0), 0.0, -np.inf]])
    got = jax.jit(camtl.normalised_entropy)(logits)
    p = np.array([2 / 3, 1 / 3])
    third = -(p * np.log(p)).sum() / (np.log(3) + 1e-5)
    np.testing.assert_allclose(got, [np.log(3) / (np.log(3) + 1e-5), 0.0, third], atol=1e-6)
    np.testing.assert_array_equal(camtl.normalised_entropy(jnp.ones((4, 1))), np.zeros(4))


def _batch(length=8, rows=8):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, (rows, length)).astype(np.int32)
    ids[::2, length - 3:] = 0
    return {
        "input_ids": ids,
        "token_type_ids": np.zeros_like(ids),
        "attention_mask": (ids > 0).astype(np.int32),
        "label": np.array([0, 0.5, 2, -1.0, 1, 1.5, 0, 0.2][:rows], np.float32),
        "task_id": np.array([0, 1] * (rows // 2), np.int32),
    }


def _model(variant="base", **kwargs):
    return camtl.CaMtlClassifierModel(
        TINY, camtl=camtl.CaMtlConfig(variant, max_seq_length=8), num_labels=(3, 1), **kwargs)


def _flat(tree):
    return {k: np.asarray(v) for k, v in convert.flatten(nn.unbox(tree)).items()}


@pytest.mark.parametrize("variant", ["base", "large"])
def test_trainer_steps_train_and_frozen_half_stays(variant):
    model = _model(variant, frozen_layers="half")
    assert model.frozen_patterns == ("embeddings/.*", "layers_(?:0|1)/.*")
    tr = trainer_lib.Trainer(model, optax.adam(1e-2))
    state = tr.init_state(jax.random.key(0), _batch())
    initial = jax.device_get(state) if variant == "large" else None  # the step donates
    before = _flat(state.params)
    losses = []
    for _ in range(3):  # dropout 0.1 on: the per-row vmap path
        state, metrics = tr.train_step(state, _batch(), jax.random.key(1))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses
    after = _flat(state.params)
    frozen = {p for p in before if p.startswith(("embeddings/", "layers_0/", "layers_1/"))}
    assert frozen and all(np.array_equal(before[p], after[p]) for p in frozen)
    moved = {p for p in before if not np.array_equal(before[p], after[p])}
    assert moved == set(before) - frozen  # every other parameter trains, conditioning too
    assert "conditioning/layers_0/attention_bias/film/kernel" in moved
    if variant == "large":  # the same steps on a 2 (data) x 4 (model) mesh
        tr8 = trainer_lib.Trainer(model, optax.adam(1e-2), mesh=partitioning.create_mesh(4))
        state8 = tr8.init_state(jax.random.key(0), _batch())  # initialised on the mesh
        for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(jax.device_get(state8))):
            np.testing.assert_array_equal(a, b)  # the same initial state as unsharded
        eight = []
        for _ in range(3):
            state8, metrics = tr8.train_step(state8, _batch(), jax.random.key(1))
            eight.append(float(metrics["loss"]))
        np.testing.assert_allclose(eight, losses, rtol=1e-4)
        spec = state8.params["layers_0"]["attention"]["query"]["kernel"].sharding.spec
        assert spec == jax.sharding.PartitionSpec(None, "model", None)  # heads sharded as BERT


def test_rows_are_conditioned_on_their_task_and_independent_of_the_batch():
    model = _model("large", frozen_layers=0)
    batch = _batch()
    params = nn.unbox(model.init_variables(jax.random.key(0), batch)["params"])
    logits = model.logits(params, batch)
    swapped = dict(batch, task_id=1 - batch["task_id"])
    hidden, other = (model.encode(params, b).hidden_states[-1] for b in (batch, swapped))
    assert np.abs(np.asarray(hidden) - np.asarray(other)).max() > 1e-3  # LN'd: O(1) values
    alone = model.logits(params, {k: v[2:3] for k, v in batch.items()})
    np.testing.assert_allclose(alone[0][0], logits[0][2], atol=1e-6)
    # Dropout masks are per row: a row's training logits do not depend on its batch.
    key = jax.random.key(3)
    full = model.logits(params, batch, key, train=True)
    part = model.logits(params, {**{k: v[2:4] for k, v in batch.items()},
                                 "row_id": np.array([2, 3], np.int32)}, key, train=True)
    np.testing.assert_allclose(part[0], np.asarray(full[0])[2:4], atol=1e-6)


def test_block_diagonal_bias_with_a_ragged_last_block():
    """L = 12, E = 24: N = 2 blocks, c = 6; L = 8, E = 24: N = 3, c = 3 (last block 2x2)."""
    for length, hidden in ((12, 24), (8, 24)):
        n = hidden // length
        c = -(-length // n)
        module = camtl.BlockDiagonalBias(length, c)

        @jax.jit
        def init_and_apply(z):  # one program per shape rather than op by op
            variables = module.init(jax.random.key(1), z)
            variables = jax.tree.map(lambda a: jax.random.normal(jax.random.key(2), a.shape),
                                     nn.unbox(variables))
            return variables, module.apply(variables, z)

        z = jax.random.normal(jax.random.key(0), (2, hidden))
        variables, got = init_and_apply(z)
        got = np.asarray(got)
        gb = z @ variables["params"]["film"]["kernel"] + variables["params"]["film"]["bias"]
        gamma, beta = np.split(np.asarray(gb), 2, axis=-1)
        a = (1 + gamma[:, None]) * np.asarray(variables["params"]["block_matrix"]) + beta[:, None]
        want = np.zeros((2, length, length), np.float32)
        for j in range(0, length, c):  # torch.block_diag(*A.chunk(n)), cut to L columns
            rows = min(c, length - j)
            want[:, j:j + rows, j:j + c] = a[:, j:j + rows, :min(c, length - j)]
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_import_writes_a_loadable_checkpoint(tmp_path):
    folder = _fixture("large")
    ref, batch, _ = _reference(folder)
    out = tmp_path / "imported"
    assert cli.main(["import", f"camtl:{folder}", str(out)]) == 0
    flat, _, _ = convert.read_ktx_checkpoint(out)
    imported = camtl_convert.read_camtl(folder)
    want = convert.flatten(imported.params)
    assert set(flat) == set(want)
    assert all(np.array_equal(flat[p], want[p]) for p in want)
    try:
        cli.parse_gin([str(out / "model.gin")])
        model = gin.query_parameter("%MODEL").scoped_configurable_fn()
    finally:
        gin.clear_config(clear_constants=True)
    assert isinstance(model, camtl.CaMtlClassifierModel) and model.camtl.variant == "large"
    init = jax.tree.map(np.asarray, _init_params(model, batch))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), init)
    params, report = initial_params.load_initial_params(str(out), abstract, init)
    assert report.initialized == ()
    _check_heads(model, params, ref, batch)
    # `camtl:DIR` works as an initial checkpoint too (converted on the fly).
    params, report = initial_params.load_initial_params(f"camtl:{folder}", abstract, init)
    assert report.initialized == ()
    _check_heads(model, params, ref, batch)


def _copy_with(folder, tmp_path, change):
    out = tmp_path / "ckpt"
    out.mkdir()
    shutil.copy(folder / "reference.json", out / "config_source.json")
    (out / "config.json").write_text(json.dumps(json.loads((folder / "reference.json").read_text())["config"]))
    tensors = dict(read_safetensors(folder / "weights.safetensors"))
    change(tensors)
    write_safetensors(out / "model.safetensors", tensors)
    return out


def test_bad_tensors_are_named_with_both_shapes(tmp_path):
    folder = _fixture("base")
    name = "bert.encoder.layer.1.attention.self.random_weight_matrix"

    def change(t):
        t[name] = np.zeros((16, 5), np.float32)
        del t["bert.encoder.layer.3.adapter.condlayernorm.bias"]
        t["bert.encoder.layer.9.extra"] = np.zeros(3, np.float32)

    bad = _copy_with(folder, tmp_path, change)
    with pytest.raises(ValueError) as e:
        camtl_convert.read_camtl(bad)
    text = str(e.value)
    assert f"{name} has shape [16, 5], expected [16, 4]" in text
    assert "bert.encoder.layer.3.adapter.condlayernorm.bias is missing (expected shape [64])" in text
    assert "bert.encoder.layer.9.extra [3] is not part of this model" in text


def test_bad_configs_and_inputs_are_named(tmp_path):
    folder = _fixture("base")
    values = json.loads((folder / "reference.json").read_text())["config"]
    with pytest.raises(ValueError, match="hidden_size=64 is not a multiple of.*max_seq_length=24"):
        camtl_convert.config_from_dict({**values, "max_seq_length": 24})
    with pytest.raises(ValueError, match=r"fields \['tasks'\] are missing"):
        camtl_convert.config_from_dict({k: v for k, v in values.items() if k != "tasks"})
    with pytest.raises(ValueError, match="no entry for tasks \\['mnli'\\]"):
        camtl_convert.config_from_dict({**values, "num_labels": {"cola": 2, "sts-b": 1}})
    with pytest.raises(FileNotFoundError, match="no weights.safetensors or model.safetensors"):
        camtl_convert.read_camtl(tmp_path)
    with pytest.raises(ValueError, match="hidden_size=32 is not a multiple of CaMtlConfig.max_seq_length=12"):
        camtl.CaMtlClassifierModel(TINY, camtl=camtl.CaMtlConfig(max_seq_length=12))
    with pytest.raises(ValueError, match="variant='huge'"):
        camtl.CaMtlConfig(variant="huge")
    with pytest.raises(ValueError, match="layer_norm_form='both'"):
        camtl.CaMtlConfig(layer_norm_form="both")
    with pytest.raises(ValueError, match="frozen_layers=7"):
        _model(frozen_layers=7)
    model = _model()
    batch = _batch(length=8)
    params = nn.unbox(model.init_variables(jax.random.key(0), batch)["params"])
    with pytest.raises(ValueError, match="input length 6 != CaMtlConfig.max_seq_length=8"):
        model.logits(params, {k: v[:, :6] if v.ndim == 2 else v for k, v in batch.items()})
    with pytest.raises(ValueError, match=r"batch is missing features \['task_id'\]"):
        model.logits(params, {k: v for k, v in batch.items() if k != "task_id"})


def test_gin_file_builds_the_paper_setting():
    files = [str(REPO / "gin/models/bert_tiny.gin"), str(REPO / "gin/conditioning/ca_mtl.gin")]
    try:
        cli.parse_gin(files, [("NUM_TASKS", "2"), ("NUM_LABELS", "(3, 1)"),
                              ("MAX_SEQ_LENGTH", "16"), ("CAMTL_VARIANT", "'large'")])
        model = gin.query_parameter("%MODEL").scoped_configurable_fn()
    finally:
        gin.clear_config(clear_constants=True)
    assert isinstance(model, camtl.CaMtlClassifierModel)
    assert model.camtl == camtl.CaMtlConfig("large", 16, "code")
    assert model.num_labels == (3, 1) and model.config.hidden_size == 64
    assert model.frozen_patterns == ("embeddings/.*", "layers_(?:0)/.*")  # half of 2 layers
    counts = camtl.trainable_parameters(model)
    assert 0 < counts["frozen"] < counts["total"]
    assert isinstance(model, encoder.EncoderClassifierModel)


def test_a_bert_checkpoint_fills_the_backbone():
    """`hf:DIR` (a plain BERT) as the initial checkpoint: every BERT parameter is restored;
    `conditioning/`, the pooler the checkpoint lacks and the heads start from init."""
    from tests.convert.conftest import checkpoint_fixture

    folder = checkpoint_fixture("hf_bert_tiny")
    model = camtl.CaMtlClassifierModel(
        convert.read_hf_bert(folder).config, camtl=camtl.CaMtlConfig(max_seq_length=16),
        num_labels=(3, 1))
    spec = model.input_spec(2, {"inputs": 16})
    init = jax.tree.map(np.asarray, _init_params(model, spec))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), init)
    params, report = initial_params.load_initial_params(f"hf:{folder}", abstract, init)
    assert {p.split("/")[0] for p in report.initialized} == {"conditioning", "pooler", "task_heads"}
    assert all(p.startswith(("embeddings/", "layers_")) for p in report.restored)
