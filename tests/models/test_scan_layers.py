"""Scan over layers (`T5Config.scan_layers`): an unrolled parameter tree converted to the
scanned layout (`ktx.models.scan_layout.convert_layout`) gives the unrolled model's
logits, losses and gradients, with remat too; greedy and beam decoding with the KV cache
give the same sequences; every task-conditioning method gives the same numbers scanned;
scanned parameters carry the never-sharded `layers` axis."""

import dataclasses
import functools

import flax.linen as nn
import jax
import numpy as np
import pytest

from ktx import partitioning
from ktx.conditioning.model import ConditioningConfig, conditioned_model
from ktx.models import scan_layout, seq2seq, t5
from tests.models.t5_batches import tiny_t5_batch

CFG = t5.T5Config(
    vocab_size=24, emb_dim=16, num_heads=2, num_encoder_layers=3, num_decoder_layers=2,
    head_dim=8, mlp_dim=32, dropout_rate=0.1,
)


def _batch():
    return tiny_t5_batch((0, 1, 0, 1))


# Each model, its initial parameters and the unrolled reference outputs are built once per
# configuration for the file (a scanned stack's eager init or forward compiles its whole
# scan anew on every call): see `_file_caches`.
@functools.cache
def _model(scan, conditioning, remat, cfg_items):
    config = dataclasses.replace(CFG, scan_layers=scan, remat_policy=remat, **dict(cfg_items))
    model = seq2seq.EncoderDecoderModel(config, num_tasks=2)
    if conditioning is not None:
        model = conditioned_model(model, conditioning)
    return model


def _models(conditioning=None, remat="none", **cfg):
    """(unrolled, scanned); the unrolled model of a configuration is one object whatever
    the scanned model's `remat`."""
    items = tuple(sorted(cfg.items()))
    return [_model(False, conditioning, "none", items), _model(True, conditioning, remat, items)]


@functools.cache
def _boxed(model):
    return model.init_variables(jax.random.key(0), _batch())


@functools.cache
def _params(model):
    return nn.unbox(_boxed(model))["params"]


def _param_shapes(model):
    """The shapes (`ShapeDtypeStruct`s) of `_params(model)`, traced, not computed."""
    return jax.eval_shape(lambda: nn.unbox(model.init_variables(jax.random.key(0), _batch())))[
        "params"]


def _loss_fn(model, batch):
    def loss(p):
        sums, _ = model.loss_sums(p, batch, None, False)
        return sums.sum() / model.normalizer(batch).sum()

    return loss


def _loss_and_grad(model, params):
    return jax.jit(jax.value_and_grad(_loss_fn(model, _batch())))(params)


def _logits_loss_and_grad(model, params):
    """Teacher-forced logits, loss and gradient, one program."""
    batch = _batch()
    value_and_grad = jax.value_and_grad(_loss_fn(model, batch))
    return jax.jit(lambda p: (model.logits(p, batch), value_and_grad(p)))(params)


@functools.cache
def _unrolled_reference(unrolled):
    params = _params(unrolled)
    return params, *_logits_loss_and_grad(unrolled, params)


@pytest.fixture(scope="module", autouse=True)
def _file_caches():
    yield
    for f in (_model, _boxed, _params, _unrolled_reference, _task_gradients):
        f.cache_clear()


def _close(a, b, rtol=2e-5, atol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


def _check_same(unrolled, scanned):
    params, logits0, (loss0, grad0) = _unrolled_reference(unrolled)
    converted = scan_layout.convert_layout(params, scanned=True)
    # The converted tree is exactly what the scanned model initialises (names, shapes).
    init = _param_shapes(scanned)
    assert jax.tree.structure(converted) == jax.tree.structure(init)
    jax.tree.map(lambda a, b: np.testing.assert_equal(a.shape, b.shape), converted, init)
    logits1, (loss1, grad1) = _logits_loss_and_grad(scanned, converted)
    np.testing.assert_allclose(logits1, logits0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    _close(scan_layout.convert_layout(grad1, scanned=False), grad0)
    return params, converted


def test_scanned_equals_unrolled():
    unrolled, scanned = _models()
    params, converted = _check_same(unrolled, scanned)
    kernel = converted["encoder"]["layers"]["attention"]["query"]["kernel"]
    assert kernel.shape == (3, 16, 2, 8)
    np.testing.assert_array_equal(
        kernel[2], params["encoder"]["layers_2"]["attention"]["query"]["kernel"])
    assert "layers_0" not in converted["decoder"]


@pytest.mark.parametrize("remat", ["minimal", "dots", "full"])
def test_scanned_with_remat_equals_unrolled(remat):
    _check_same(*_models(remat=remat))


def test_scanned_bfloat16_runs():
    unrolled, scanned = _models(dtype="bfloat16")
    params = scan_layout.convert_layout(_params(unrolled), scanned=True)
    loss, _ = _loss_and_grad(scanned, params)
    assert np.isfinite(loss)


def test_scanned_dropout_is_per_row():
    """Dropout in a scanned stack is keyed per row and differs per layer: the same rows
    alone and inside a larger batch get the same loss."""
    _, scanned = _models()
    params = _params(scanned)
    batch = {**_batch(), "row_id": np.arange(4, dtype=np.int32)}
    rng = jax.random.key(7)
    full = scanned.loss_sums(params, batch, rng, True)[0]
    part = scanned.loss_sums(params, {k: v[:2] for k, v in batch.items()}, rng, True)[0]
    rest = scanned.loss_sums(params, {k: v[2:] for k, v in batch.items()}, rng, True)[0]
    np.testing.assert_allclose(part + rest, full, rtol=1e-5)
    no_dropout = scanned.loss_sums(params, batch, None, False)[0]
    assert not np.allclose(full, no_dropout)


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_decoding_with_cache_scanned(method):
    unrolled, scanned = _models()
    params = _params(unrolled)
    converted = scan_layout.convert_layout(params, scanned=True)
    batch = _batch()
    kw = dict(decode_method=method, num_beams=3, max_decode_length=5, return_scores=True)
    tokens0, scores0 = unrolled.predict_batch(params, batch, **kw)
    tokens1, scores1 = scanned.predict_batch(converted, batch, **kw)
    np.testing.assert_array_equal(tokens1, tokens0)
    np.testing.assert_allclose(scores1, scores0, rtol=1e-5, atol=1e-5)


def test_scanned_parameters_carry_the_layers_axis():
    _, scanned = _models()
    boxed = _boxed(scanned)["params"]
    specs = nn.get_partition_spec(boxed)
    assert tuple(specs["encoder"]["layers"]["mlp"]["wi_0"]["kernel"]) == ("layers", "embed", "mlp")
    assert tuple(specs["decoder"]["layers"]["encoder_decoder_attention"]["out"]["kernel"]) == (
        "layers", "heads", "kv", "embed")
    rules = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=2)
    mesh_axes = nn.logical_to_mesh_axes(("layers", "embed", "mlp"), rules)
    assert tuple(mesh_axes) == (None, "data", "model")


def test_convert_layout_forms_and_errors():
    unrolled, _ = _models()
    params = jax.tree.map(np.asarray, _params(unrolled))
    flat = {"/".join(k): v for k, v in _flat(params)}
    flat_scanned = scan_layout.convert_layout(flat, scanned=True)
    assert flat_scanned["decoder/layers/mlp/wo/kernel"].shape == (2, 32, 16)
    assert isinstance(flat_scanned["decoder/layers/mlp/wo/kernel"], np.ndarray)
    assert scan_layout.is_scanned(flat_scanned) is True
    assert scan_layout.is_scanned(params) is False
    assert scan_layout.num_layers(flat_scanned, "encoder") == 3
    assert scan_layout.num_layers(params, "decoder") == 2
    back = scan_layout.convert_layout(flat_scanned, scanned=False)
    assert back.keys() == flat.keys()
    for k in flat:
        np.testing.assert_array_equal(back[k], flat[k])
    # Already in the asked layout: unchanged.
    again = scan_layout.convert_layout(flat_scanned, scanned=True)
    assert again.keys() == flat_scanned.keys()
    mixed = {**flat, "encoder/layers/mlp/wo/kernel": np.zeros((3, 32, 16))}
    with pytest.raises(ValueError, match="both unrolled .* and scanned"):
        scan_layout.convert_layout(mixed, scanned=True)
    gap = {k: v for k, v in flat.items() if not k.startswith("encoder/layers_1/")}
    with pytest.raises(ValueError, match=r"layers \[1\] missing"):
        scan_layout.convert_layout(gap, scanned=True)


def _flat(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def test_bad_scan_layers_is_a_clear_error():
    with pytest.raises(ValueError, match=r"T5Config\.scan_layers='yes'.*accepted: True or False"):
        t5.T5Config(scan_layers="yes")


_SMALL = dict(encoder_prompt_length=2, decoder_prompt_length=3, prompt_tuning_length=2,
              reduction_factor=4, task_embed_dim=4, task_hidden_dim=8, projected_dim=4)


@pytest.mark.parametrize("method,extra", [
    ("hyperprompt", {"hyperprompt_variant": "global"}),
    ("hyperprompt", {"hyperprompt_variant": "share"}),
    ("hyperprompt", {"hyperprompt_variant": "sep"}),
    ("prompt_tuning", {}),
    ("adapters", {"adapter_positions": ("attention", "cross_attention", "mlp")}),
    ("hyperformer", {}),
    ("hyperformer++", {}),
])
def test_conditioning_scanned_equals_unrolled(method, extra):
    cond = ConditioningConfig(method=method, **_SMALL, **extra)
    unrolled, scanned = _models(cond)
    params, converted = _check_same(unrolled, scanned)
    # The conditioning parameters are the same in both layouts.
    assert "conditioning" in converted
    jax.tree.map(np.testing.assert_array_equal, converted["conditioning"], params["conditioning"])
    if method == "hyperprompt":  # decoding with prompts and the cache, scanned
        kw = dict(decode_method="greedy", max_decode_length=4)
        np.testing.assert_array_equal(
            scanned.predict_batch(converted, _batch(), **kw),
            unrolled.predict_batch(params, _batch(), **kw))


def test_frozen_layer_norm_pattern_matches_both_layouts():
    """HyperFormer's configuration (backbone frozen but T5's layer norms) trains the same
    parameters scanned as unrolled."""
    import re

    from ktx.conditioning.model import trainable_mask
    from ktx.treepath import name

    cond = ConditioningConfig(method="hyperformer++", **_SMALL)
    unrolled, scanned = _models(cond)

    def trained(model):
        mask = trainable_mask(_param_shapes(model), train_backbone=False,
                              train_layer_norms=True)
        return {re.sub(r"layers_\d+", "layers", name(p))
                for p, m in jax.tree_util.tree_leaves_with_path(mask) if m}

    names = trained(unrolled)
    assert "encoder/layers/pre_mlp_layer_norm/scale" in names
    assert trained(scanned) == names


@pytest.mark.parametrize("saved_scanned", [True, False])
def test_initial_checkpoint_of_the_other_layout(tmp_path, saved_scanned):
    """INITIAL_CHECKPOINT_PATH of the other layer layout is converted on the way in; with
    conversion off it is one clear error (not a silent re-initialisation of the layers)."""
    from ktx.training import checkpoints
    from ktx.training import initial_params
    from ktx.training.trainer import TrainState

    unrolled, scanned = _models()
    source = _params(unrolled)
    saved = scan_layout.convert_layout(source, scanned=saved_scanned)
    manager = checkpoints.CheckpointManager(tmp_path, save_period=1)
    manager.save(TrainState(step=np.int32(1), params=saved, opt_state=()), force=True)
    manager.wait()
    target = scanned if not saved_scanned else unrolled
    init = jax.tree.map(np.zeros_like, _params(target))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init)
    params, report = initial_params.load_initial_params(tmp_path, abstract, init)
    assert not report.initialized and not report.unused
    expected = scan_layout.convert_layout(source, scanned=not saved_scanned)
    jax.tree.map(np.testing.assert_array_equal, params, expected)
    want = r"holds the scanned .* model is unrolled .*scan_layers=True" if saved_scanned else (
        r"holds the unrolled .* model is scanned .*scan_layers=False")
    with pytest.raises(checkpoints.CheckpointShapeError, match=want):
        initial_params.load_initial_params(tmp_path, abstract, init, convert_layout=False)


def test_attention_analysis_scanned_equals_unrolled():
    from ktx.analysis.attention import analyze_attention

    cond = ConditioningConfig(method="hyperprompt", **_SMALL)
    unrolled, scanned = _models(cond)
    params = _params(unrolled)
    converted = scan_layout.convert_layout(params, scanned=True)
    batch = _batch()
    r0 = analyze_attention(unrolled, params, [batch], task="t")
    r1 = analyze_attention(scanned, converted, [batch], task="t")
    assert len(r1["encoder"]) == 3 and len(r1["decoder"]) == 2
    for side in ("encoder", "decoder"):
        for a, b in zip(r0[side], r1[side]):
            assert a["layer"] == b["layer"]
            np.testing.assert_allclose(b["prompt_mass"], a["prompt_mass"], rtol=1e-5)
            np.testing.assert_allclose(b["token_entropy"], a["token_entropy"], rtol=1e-5)


def _task_batch():
    return {**_batch(), "task_id": np.array([0, 0, 1, 1], np.int32),
            "row_id": np.arange(4, dtype=np.int32)}


@functools.cache
def _task_gradients(scan, train, how):
    """Per-task losses and gradients of `_models(remat="full")` (the scanned one on the
    unrolled parameters converted), computed once per (layout, dropout, method) for the
    file: both methods' tests compare the two methods on the scanned model."""
    from ktx import optim

    model = _models(remat="full")[int(scan)]
    params = _params(_models(remat="full")[0])
    if scan:
        params = scan_layout.convert_layout(params, scanned=True)
    batch = _task_batch()

    def sums(pp, b):
        return model.loss_sums(pp, b, jax.random.key(3), train)

    return jax.jit(lambda q: optim.compute_task_gradients(
        sums, model.normalizer(batch), q, batch, num_tasks=2, task_counts=(2, 2),
        method=how, shared=(".*",), check_layout=False))(params)


@pytest.mark.parametrize("method", ["blocks", "vjp"])
def test_per_task_gradients_scanned_equal_unrolled(method):
    """The per-task gradient engine (task blocks; vmapped VJP) through the scanned stack,
    dropout on (keyed per row, so each layout is compared with itself on two paths) and
    off (compared across layouts)."""
    l0, _, g0 = _task_gradients(False, False, method)
    l1, _, g1 = _task_gradients(True, False, method)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    # The task axis leads: convert each task's gradient separately.
    for t in range(2):
        _close(scan_layout.convert_layout(jax.tree.map(lambda x: x[t], g1.stacked), scanned=False),
               jax.tree.map(lambda x: x[t], g0.stacked))
    # Dropout on: the blocks and VJP paths agree with each other on the scanned model.
    other = "vjp" if method == "blocks" else "blocks"
    a = _task_gradients(True, True, method)
    b = _task_gradients(True, True, other)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5)
    _close(a[2].stacked, b[2].stacked, rtol=1e-4, atol=1e-6)


def test_packed_inputs_scanned_equal_unrolled():
    unrolled, scanned = _models()
    params = _params(unrolled)
    converted = scan_layout.convert_layout(params, scanned=True)
    batch = _batch()
    seg = (np.arange(4)[None, :] >= 2).astype(np.int32) + 1
    pos = np.tile(np.array([0, 1, 0, 1], np.int32), (4, 1))
    packed = {**batch, "encoder_segment_ids": np.tile(seg, (4, 1)), "encoder_positions": pos,
              "decoder_segment_ids": np.tile(seg, (4, 1)), "decoder_positions": pos}
    np.testing.assert_allclose(scanned.logits(converted, packed), unrolled.logits(params, packed),
                               rtol=1e-5, atol=1e-5)


def _assert_two_steps_agree(optimizer, **step_options):
    """Two real train steps (`train_step`) of `optimizer` give the same loss and
    parameters unrolled and scanned."""
    from ktx.training import trainer as trainer_lib
    from ktx.training.optimizers import TaskOptimizer

    unrolled, scanned = _models(dropout_rate=0.0)
    params = _params(unrolled)
    opt = TaskOptimizer(optimizer)
    batch = _batch()
    out = {}
    for model, p in ((unrolled, params), (scanned, scan_layout.convert_layout(params, scanned=True))):
        state = trainer_lib.TrainState(step=np.int32(0), params=p, opt_state=opt.init(p))
        step = jax.jit(lambda s, model=model: trainer_lib.train_step(
            s, batch, jax.random.key(1), model=model, optimizer=opt,
            options=trainer_lib.StepOptions(**step_options)))
        for _ in range(2):
            state, metrics = step(state)
        out[model.config.scan_layers] = (metrics["loss"], state.params)
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-5)
    _close(scan_layout.convert_layout(out[True][1], scanned=False), out[False][1], rtol=1e-4, atol=1e-6)


def test_train_steps_scanned_equal_unrolled_with_adam():
    """An elementwise optimizer, microbatched steps."""
    import optax

    _assert_two_steps_agree(optax.adam(1e-2), num_microbatches=2)


@pytest.mark.parametrize("min_dim", [2, 128])  # factored; full second moments
def test_train_steps_scanned_equal_unrolled_with_adafactor(min_dim):
    """Adafactor treats the stacked `layers` axis as T5X does (a batch of parameters:
    `ktx.training.factoring.as_matrices`), so a scanned run takes the unrolled run's
    steps: factoring, parameter scale and update clipping per layer."""
    from ktx.training.optimizers import adafactor

    _assert_two_steps_agree(adafactor(1e-1, min_dim_size_to_factor=min_dim))
