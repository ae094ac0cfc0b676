"""`BertConfig.scan_layers`: the scanned BERT stack equals the unrolled one on the tree
`scan_layout.convert_layout` gives (logits and gradients), composes with remat, keeps
the shared top layers apart; PALs and TEA-BERT scan with their per-layer tables stacked
(same logits and gradients); so does CA-MTL, whose per-layer conditioning differs from
layer to layer and stays per layer. A scanned stack freezes its bottom layers as rows of
the stacked leaves, and trains as the unrolled model does."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx import partitioning, treepath
from ktx.analysis.params import count_parameters, format_report
from ktx.models import bert, camtl, encoder, pals, scan_layout, smart, tea
from ktx.training import optimizers
from ktx.training import trainer as trainer_lib

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


def _assert_same_gradients(unrolled, params, scanned, stacked, batch):
    """Every gradient of the summed task losses of the scanned model, converted back to the
    unrolled layout, equals the unrolled model's (same tree, rtol 1e-4)."""

    def loss(model, p):
        sums, _ = model.loss_sums(p, batch, None, False)
        return sums.sum()

    g_unrolled = jax.grad(lambda p: loss(unrolled, p))(params)
    g_scanned = scan_layout.convert_layout(jax.grad(lambda p: loss(scanned, p))(stacked),
                                           scanned=False)
    assert jax.tree.structure(g_unrolled) == jax.tree.structure(g_scanned)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_unrolled)[0],
                            jax.tree.leaves(g_scanned)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(path))


@pytest.mark.parametrize("remat", ["none", "minimal"])
def test_scanned_equals_unrolled(remat):
    batch = _batch()
    unrolled = _model(False, shared_layers=1)
    params = nn.unbox(unrolled.init_variables(jax.random.key(0), batch)["params"])
    scanned = _model(True, remat, shared_layers=1)
    # the scanned model's own init: its tree, shapes and axes only
    boxed = jax.eval_shape(scanned.init_variables, jax.random.key(0), batch)["params"]
    stacked = scan_layout.convert_layout(params, scanned=True)
    # same tree as the scanned model's own init; layers stacked [L, ...] on the `layers` axis
    assert jax.tree.structure(stacked) == jax.tree.structure(nn.unbox(boxed))
    assert stacked["layers"]["attention"]["query"]["kernel"].shape == (3, 16, 2, 8)
    assert "layers_0" in stacked["shared_layers"]  # the shared top layer stays unrolled
    axes = nn.get_partition_spec(boxed)["layers"]["attention"]["query"]["kernel"]
    assert axes[0] == partitioning.LAYERS
    for a, b in zip(unrolled.logits(params, batch), scanned.logits(stacked, batch)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    _assert_same_gradients(unrolled, params, scanned, stacked, batch)


def test_bert_layout_conversion_stacks_method_tables_and_leaves_shared_layers():
    flat = {"layers_0/output/kernel": np.zeros((2, 3)), "layers_1/output/kernel": np.ones((2, 3)),
            "conditioning/layers_0/w": np.zeros(2), "conditioning/layers_1/w": np.ones(2),
            "conditioning/down/kernel": np.ones(3),
            "shared_layers/layers_0/output/kernel": np.ones(1), "pooler/kernel": np.ones(1)}
    scanned = scan_layout.convert_layout(flat, scanned=True)
    assert sorted(scanned) == ["conditioning/down/kernel", "conditioning/layers/w",
                               "layers/output/kernel", "pooler/kernel",
                               "shared_layers/layers_0/output/kernel"]
    np.testing.assert_array_equal(scanned["layers/output/kernel"][1], np.ones((2, 3)))
    np.testing.assert_array_equal(scanned["conditioning/layers/w"], [[0, 0], [1, 1]])
    back = scan_layout.convert_layout(scanned, scanned=False)
    assert sorted(back) == sorted(flat)
    assert scan_layout.num_layers(scanned, "") == 2 == scan_layout.num_layers(flat, "")
    assert scan_layout.num_layers(scanned, "conditioning") == 2
    assert scan_layout.is_scanned(flat) is False and scan_layout.is_scanned(scanned) is True


def test_ragged_per_layer_tables_stay_per_layer():
    """Per-layer tables whose layers hold different parameter sets (CA-MTL's FiLMs on the
    upper layer only) are not a stack: left as they are in both directions, and the
    tree's layout is that of its BERT stack."""
    flat = {"layers_0/output/kernel": np.zeros((2, 3)), "layers_1/output/kernel": np.ones((2, 3)),
            "conditioning/layers_0/bias": np.zeros(2), "conditioning/layers_1/bias": np.ones(2),
            "conditioning/layers_1/film/kernel": np.ones((2, 4))}
    scanned = scan_layout.convert_layout(flat, scanned=True)
    assert sorted(scanned) == ["conditioning/layers_0/bias", "conditioning/layers_1/bias",
                               "conditioning/layers_1/film/kernel", "layers/output/kernel"]
    assert scan_layout.is_scanned(scanned) is True and scan_layout.is_scanned(flat) is False
    assert scan_layout.num_layers(scanned, "conditioning") == 0
    back = scan_layout.convert_layout(scanned, scanned=False)
    assert sorted(back) == sorted(flat)
    # a layer missing from an otherwise uniform set of tables is ragged too
    gap = {"layers_0/w": np.zeros(1), "conditioning/layers_1/w": np.ones(2)}
    assert "conditioning/layers_1/w" in scan_layout.convert_layout(gap, scanned=True)


METHODS = {
    "pals": lambda config, **kw: pals.PalsClassifierModel(config, num_labels=(3, 1), pals_size=4,
                                                         pals_heads=2, **kw),
    **{f"tea_{injection}": (lambda config, injection=injection, **kw: tea.TeaClassifierModel(
        config, num_labels=(3, 1), injection=injection, task_embedding_dim=4, **kw))
       for injection in tea.INJECTIONS},
}


def _perturbed(params, seed=1):
    """`params` with every leaf moved off its init (zero biases, zero-init tables), so a
    wrongly sliced or mis-stacked table shows."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                                     for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("method,remat", [("pals", "minimal"), ("tea_input", "none"),
                                          ("tea_qkv", "none"), ("tea_projected_act", "full")])
def test_scanned_methods_equal_unrolled(method, remat):
    """PALs and TEA-BERT with `scan_layers=True`: their per-layer tables stacked on the
    `layers` axis under `conditioning/layers`, the BERT layers under `layers`; logits and
    every gradient equal the unrolled model's on the converted tree, remat or not, with a
    shared top layer, rows of both tasks mixed."""
    batch = _batch()
    build = METHODS[method]
    unrolled = build(CONFIG, shared_layers=1)
    params = _perturbed(nn.unbox(unrolled.init_variables(jax.random.key(0), batch)["params"]))
    scanned = build(dataclasses.replace(CONFIG, scan_layers=True, remat_policy=remat),
                    shared_layers=1)
    # the scanned model's own init: its tree, shapes and axes only
    boxed = jax.eval_shape(scanned.init_variables, jax.random.key(0), batch)["params"]
    stacked = scan_layout.convert_layout(params, scanned=True)
    assert jax.tree.structure(stacked) == jax.tree.structure(nn.unbox(boxed))
    assert (jax.tree.map(jnp.shape, stacked) == jax.tree.map(jnp.shape, nn.unbox(boxed)))
    specs = nn.get_partition_spec(boxed)
    if "layers" in boxed.get("conditioning", {}):
        tables = jax.tree.leaves(specs["conditioning"]["layers"],
                                 is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        assert tables and all(spec[0] == partitioning.LAYERS for spec in tables)
    else:
        assert method == "tea_input"
    for a, b in zip(unrolled.logits(params, batch), scanned.logits(stacked, batch)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    hidden_unrolled, _ = unrolled.encode(params, batch)
    hidden_scanned, _ = scanned.encode(stacked, batch)
    assert len(hidden_scanned) == CONFIG.num_layers
    for a, b in zip(hidden_unrolled, hidden_scanned):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    _assert_same_gradients(unrolled, params, scanned, stacked, batch)


def test_scanned_methods_train_with_dropout():
    """A scanned PALs model's loss under dropout is finite and changes with the rng (the
    scan's split dropout keys reach the PALs' own attention dropout)."""
    config = dataclasses.replace(CONFIG, scan_layers=True, dropout_rate=0.0,
                                 attention_dropout_rate=0.5)
    model = METHODS["pals"](config)
    batch = _batch()
    params = nn.unbox(model.init_variables(jax.random.key(0), batch)["params"])
    losses = [float(model.loss_sums(params, batch, jax.random.key(k), True)[0].sum())
              for k in (1, 2)]
    assert np.isfinite(losses).all() and losses[0] != losses[1]


def test_scanned_stack_refusals():
    config = dataclasses.replace(CONFIG, scan_layers=True)
    with pytest.raises(ValueError, match=r"PalsClassifierModel.pal_layers=\(0, 2\) with "
                                         r"BertConfig.scan_layers=True"):
        pals.PalsClassifierModel(config, num_labels=(3, 1), pals_size=4, pals_heads=2,
                                 pal_layers=(0, 2))
    with pytest.raises(ValueError, match=r"TeaClassifierModel.task_layers=\(1,\) with"):
        tea.TeaClassifierModel(config, num_labels=(3, 1), task_layers=(1,))
    with pytest.raises(ValueError, match="BertConfig.scan_layers='yes'"):
        bert.BertConfig(scan_layers="yes")


FROZEN = {  # method -> (model from (config, frozen_layers), frozen_layers, num_layers)
    "pals": (lambda config, **kw: METHODS["pals"](config, **kw), "half", 4),
    "camtl": (lambda config, **kw: camtl.CaMtlClassifierModel(  # the paper's frozen half
        config, camtl=camtl.CaMtlConfig("base", 8), num_labels=(3, 1), **kw), "half", 4),
    # 3 layers (2 frozen rows, 1 training, and the shared top layer): SMART's unrolled
    # step, the costliest program here, compiles a layer less than with 4.
    "smart": (lambda config, **kw: smart.SmartModel(
        encoder.EncoderClassifierModel(config, num_labels=(3, 1), shared_layers=1, **kw),
        weight=1.0, noise_std=1e-2, step_size=1e-2, epsilon=1e-2, proximal_weight=1.0,
        teacher_momentum=0.5), 2, 3),
}


@pytest.mark.parametrize("method", sorted(FROZEN))
def test_scanned_frozen_layers_train_as_unrolled(method):
    """`frozen_layers = k` with a scanned stack freezes rows `0 .. k-1` of the stacked
    leaves (`treepath.Rows`): after AdamW steps with weight decay, from the same parameters,
    the scanned run's parameters (and SMART's teacher) converted back equal the unrolled
    run's, its frozen rows are bit-identical to the start, and its unfrozen rows moved."""
    build, frozen_layers, num_layers = FROZEN[method]
    config = dataclasses.replace(CONFIG, num_layers=num_layers)
    unrolled = build(config, frozen_layers=frozen_layers)
    scanned = build(dataclasses.replace(config, scan_layers=True), frozen_layers=frozen_layers)
    k = 2 if frozen_layers == "half" else frozen_layers
    assert scanned.frozen_patterns == ("embeddings/.*", treepath.Rows("layers/.*", 0, k))
    batch = {k: jnp.concatenate([v, v]) for k, v in _batch().items()}  # 8 rows: 8 devices
    params = _perturbed(nn.unbox(unrolled.init_variables(jax.random.key(0), batch)["params"]))
    stacked = scan_layout.convert_layout(params, scanned=True)
    runs = []
    for model, start in ((unrolled, params), (scanned, stacked)):
        # eps=1e-3: Adam would blow the rounding noise of the key bias's zero gradient
        # (softmax ignores it) up to full-size steps that differ between the layouts.
        tr = trainer_lib.Trainer(model, optimizers.adamw(1e-2, eps=1e-3, weight_decay=0.1))
        tr.create_abstract_state(batch)
        # On the state's shardings (a fresh copy: the step donates), as the steps return
        # it: the second step runs the first one's program instead of compiling another.
        state = tr.init_rest_of_state(jax.device_put(jax.device_get(start),
                                                     tr.state_shardings.params))
        for step in range(2):
            state, metrics = tr.train_step(state, batch, jax.random.key(step))
        assert np.isfinite(float(metrics["loss"]))
        runs.append(state)
    want, got = runs[0].params, scan_layout.convert_layout(runs[1].params, scanned=False)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=str(path))
    layers = runs[1].params["layers"]
    for start, end in zip(jax.tree.leaves(stacked["layers"]), jax.tree.leaves(layers)):
        np.testing.assert_array_equal(start[:k], end[:k])
        assert not np.array_equal(start[k:], end[k:])
    if method == "smart":  # the teacher: the partly frozen leaves whole, their frozen rows θ's
        teacher = runs[1].model_state["teacher"]
        assert teacher["embeddings"]["word_embeddings"]["embedding"] is None
        full = smart.full_teacher(teacher, runs[1].params, scanned.frozen_patterns)
        unrolled_full = smart.full_teacher(runs[0].model_state["teacher"], runs[0].params)
        for a, b in zip(jax.tree.leaves(unrolled_full),
                        jax.tree.leaves(scan_layout.convert_layout(full, scanned=False))):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_a_partly_frozen_stack_counts_and_refuses_bad_rows():
    """`ktx params`' counts (`count_parameters`): the frozen rows of the stacked leaves
    count as frozen, the same totals as unrolled; `treepath.Rows` outside a leaf's rows, or
    matching nothing, is a clear error."""
    config = dataclasses.replace(CONFIG, num_layers=4)
    reports = [count_parameters(encoder.EncoderClassifierModel(
        dataclasses.replace(config, scan_layers=scan), num_labels=(3, 1), frozen_layers=3))
        for scan in (False, True)]
    assert reports[0] == reports[1] and 0 < reports[0]["frozen"] < reports[0]["total"]
    assert "frozen:" in format_report(reports[1])
    params = {"layers": {"kernel": np.zeros((4, 2))}, "head": np.zeros(3)}
    with pytest.raises(ValueError, match=r"Rows\(pattern='layers/.\*', start=0, stop=5\).*4 rows"):
        optimizers.frozen_mask(params, [treepath.Rows("layers/.*", 0, 5)])
    with pytest.raises(ValueError, match="matches no parameter"):
        optimizers.frozen_mask(params, [treepath.Rows("stack/.*", 0, 2)])
    with pytest.raises(ValueError, match="selects no row"):
        treepath.Rows("layers/.*", 2, 2)
    mask = optimizers.frozen_mask(params, ["head", treepath.Rows("layers/.*", 1, 3)])
    assert mask["head"] is True and mask["layers"]["kernel"].tolist() == [False, True, True, False]


@pytest.mark.parametrize("variant,form,remat", [("base", "code", "none"),
                                                ("base", "paper", "minimal"),
                                                ("large", "code", "full")])
def test_scanned_camtl_equals_unrolled(variant, form, remat):
    """CA-MTL with `scan_layers=True`: the BERT layers stacked under `layers`, its
    conditioning (task bias, layer-norm FiLMs of the upper layers only, Base's top-layer
    adapter, Large's chain) per layer under `conditioning/layers_<i>` in both layouts;
    every hidden state, the logits and every gradient equal the unrolled model's, with a
    shared top layer and rows of both tasks mixed."""
    batch = _batch()
    options = camtl.CaMtlConfig(variant, 8, form)
    unrolled = camtl.CaMtlClassifierModel(dataclasses.replace(CONFIG, num_layers=4),
                                          camtl=options, num_labels=(3, 1), shared_layers=1)
    params = _perturbed(nn.unbox(unrolled.init_variables(jax.random.key(0), batch)["params"]))
    scanned = camtl.CaMtlClassifierModel(
        dataclasses.replace(CONFIG, num_layers=4, scan_layers=True, remat_policy=remat),
        camtl=options, num_labels=(3, 1), shared_layers=1)
    # the scanned model's own init: its tree, shapes and axes only
    boxed = jax.eval_shape(scanned.init_variables, jax.random.key(0), batch)["params"]
    stacked = scan_layout.convert_layout(params, scanned=True)
    assert jax.tree.structure(stacked) == jax.tree.structure(nn.unbox(boxed))
    assert jax.tree.map(jnp.shape, stacked) == jax.tree.map(jnp.shape, nn.unbox(boxed))
    assert stacked["layers"]["attention"]["query"]["kernel"].shape == (4, 16, 2, 8)
    assert stacked["conditioning"] == params["conditioning"]  # per layer in both layouts
    assert "attention_layer_norm" not in stacked["conditioning"]["layers_0"]
    assert "attention_layer_norm" in stacked["conditioning"]["layers_3"]
    assert scan_layout.is_scanned(stacked) and scan_layout.is_scanned(params) is False
    back = scan_layout.convert_layout(stacked, scanned=False)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(unrolled.logits(params, batch), scanned.logits(stacked, batch)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    want, got = unrolled.encode(params, batch), scanned.encode(stacked, batch)
    assert len(got.hidden_states) == 5
    for a, b in zip(want.hidden_states + (want.last_hidden_state, want.pooled_output),
                    got.hidden_states + (got.last_hidden_state, got.pooled_output)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    _assert_same_gradients(unrolled, params, scanned, stacked, batch)
