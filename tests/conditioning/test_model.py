"""The task-conditioned T5: exactness, per-task gathering, freezing, accounting, and a few
train steps of every method on a 2x4 mesh of fake CPU devices."""

import dataclasses
import pathlib
import re

import flax.linen as nn
import gin
import jax
import numpy as np
import optax
import pytest

from ktx import cli
from ktx.training import optimizers
from ktx.analysis import params as kparams
from ktx import partitioning
from ktx.conditioning.model import (
    ConditioningConfig,
    conditioned_model,
    frozen_patterns,
    trainable_mask,
)
from ktx.models import seq2seq, t5

REPO = pathlib.Path(__file__).resolve().parents[2]

# heads (4) and vocabulary (64) divide the 4-way model axis.
CFG = t5.T5Config(vocab_size=64, emb_dim=32, num_heads=4, num_encoder_layers=2,
                  num_decoder_layers=2, head_dim=8, mlp_dim=64, dropout_rate=0.0)
SMALL = dict(reduction_factor=8, task_embed_dim=4, task_hidden_dim=8, projected_dim=4,
             encoder_prompt_length=3, decoder_prompt_length=2, prompt_tuning_length=3)
NUM_TASKS = 3
# The mesh training tests' backbone: one encoder and one decoder layer (what they check,
# every method's parameters training sharded, does not depend on the depth); their
# compiles take about half the two-layer backbone's time.
CFG_ONE_LAYER = dataclasses.replace(CFG, num_encoder_layers=1, num_decoder_layers=1)


def _base(config=CFG):
    return seq2seq.EncoderDecoderModel(config, num_tasks=NUM_TASKS)


def _batch(rows=4, le=6, ld=4, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "encoder_input_tokens": rng.integers(2, 64, (rows, le)).astype(np.int32),
        "decoder_input_tokens": rng.integers(2, 64, (rows, ld)).astype(np.int32),
        "decoder_target_tokens": rng.integers(2, 64, (rows, ld)).astype(np.int32),
        "decoder_loss_weights": np.ones((rows, ld), np.float32),
        "task_id": (np.arange(rows) % NUM_TASKS).astype(np.int32),
    }


_INITS = {}


def _init(model, batch):
    """Initial parameters, computed once per module configuration (Flax modules compare by
    their fields) and batch shape for the file (`_file_caches`)."""
    key = (model.module, tuple((k, v.shape) for k, v in sorted(batch.items())))
    if key not in _INITS:
        _INITS[key] = nn.meta.unbox(model.init_variables(jax.random.key(0), batch))["params"]
    return _INITS[key]


@pytest.fixture(scope="module", autouse=True)
def _file_caches():
    yield
    _INITS.clear()


def _loss_grad(model, batch, params):
    """The gradient of `model.loss_fn`, one jitted program (eagerly, its many small ops
    would each compile alone)."""
    return jax.jit(jax.grad(lambda p: model.loss_fn(p, batch)[0]))(params)


def test_prompt_length_zero_equals_plain_t5_exactly():
    batch = _batch()
    plain = _base()
    plain_params = _init(plain, batch)
    zero = conditioned_model(plain, ConditioningConfig(
        method="hyperprompt", encoder_prompt_length=0, decoder_prompt_length=0))
    zero_params = _init(zero, batch)
    assert jax.tree.structure(zero_params) == jax.tree.structure(plain_params)
    want = plain.logits(plain_params, batch)
    got = zero.logits(plain_params, batch)  # identical backbone parameters
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # With prompts the backbone is unchanged and the output changes.
    hp = conditioned_model(plain, ConditioningConfig(method="hyperprompt", **SMALL))
    hp_params = _init(hp, batch)
    backbone = {k: v for k, v in hp_params.items() if k != "conditioning"}
    assert jax.tree.structure(backbone) == jax.tree.structure(plain_params)
    mixed = {**plain_params, "conditioning": hp_params["conditioning"]}
    assert not np.allclose(hp.logits(mixed, batch), want)


def test_hyper_prompts_are_attended_and_gathered_per_task():
    batch = _batch()
    model = conditioned_model(_base(), ConditioningConfig(method="hyperprompt",
                                                          hyperprompt_variant="sep", **SMALL))
    params = _init(model, batch)
    logits, state = model.logits(params, batch, mutable=["intermediates"])
    inter = state["intermediates"]
    enc = inter["encoder"]["layers_0"]["attention"]["attention_weights"][0]
    dec = inter["decoder"]["layers_1"]["self_attention"]["attention_weights"][0]
    assert enc.shape == (4, 4, 6, 3 + 6)  # [B, H, Lq, l + Lk]
    assert dec.shape == (4, 4, 4, 2 + 4)
    # Causal queries still see every prompt: the first decoder position has mass on them.
    assert np.all(np.asarray(dec[:, :, 0, :2]).sum(-1) > 0)
    np.testing.assert_allclose(np.asarray(dec).sum(-1), 1.0, rtol=1e-5)
    # Perturbing task 1's network changes only the rows of task 1.
    bumped = jax.tree.map(lambda x: x, params)
    enc_up = bumped["conditioning"]["encoder_hyper_prompt"]["key_up"]
    bumped["conditioning"]["encoder_hyper_prompt"]["key_up"] = enc_up.at[:, 1].add(1.0)
    other = model.logits(bumped, batch)
    rows1 = np.asarray(batch["task_id"]) == 1
    np.testing.assert_array_equal(np.asarray(other)[~rows1], np.asarray(logits)[~rows1])
    assert not np.allclose(np.asarray(other)[rows1], np.asarray(logits)[rows1])


def test_frozen_backbone_trains_only_conditioning():
    batch = _batch()
    model = conditioned_model(_base(), ConditioningConfig(method="prompt_tuning", **SMALL),
                              train_backbone=False)
    params = _init(model, batch)
    grads = _loss_grad(model, batch, params)
    mask = trainable_mask(params, False)
    for g, m in zip(jax.tree.leaves(grads), jax.tree.leaves(mask)):
        assert bool(np.any(np.asarray(g) != 0)) == m


def _paths(tree):
    return {"/".join(str(k.key) for k in p): x
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_hyperformer_trains_t5_layer_norms_hypernetworks_and_task_embeddings():
    batch = _batch()
    model = conditioned_model(_base(), ConditioningConfig(method="hyperformer", **SMALL),
                              train_backbone=False, train_layer_norms=True)
    params = _init(model, batch)
    grads = _paths(_loss_grad(model, batch, params))
    norms = {p for p in grads if re.search(r"(_layer_norm|_norm)/scale$", p)
             and not p.startswith("conditioning/")}
    # Every pre-norm of every layer and the two final norms: 2 per encoder layer, 3 per
    # decoder layer (self, cross, mlp), + encoder_norm, decoder_norm.
    assert len(norms) == 2 * 2 + 3 * 2 + 2, sorted(norms)
    trained = {p for p, g in grads.items() if np.any(np.asarray(g) != 0)}
    conditioning = {p for p in grads if p.startswith("conditioning/")}
    assert "conditioning/task_embedding/embedding" in conditioning
    assert trained == conditioning | norms, sorted(trained ^ (conditioning | norms))
    mask = _paths(trainable_mask(params, False, True))
    assert {p for p, m in mask.items() if m} == trained
    # The same regexes give the optimizer's frozen set: no update at all, weight decay
    # included, while the trained parameters move.
    assert model.frozen_patterns == frozen_patterns(False, True)
    tx = optimizers.freeze(optax.adamw(1e-2, weight_decay=0.5), model.frozen_patterns)
    updates, _ = tx.update(jax.tree.map(np.ones_like, params), tx.init(params), params)
    moved = {p for p, u in _paths(updates).items() if np.any(np.asarray(u) != 0)}
    assert moved == trained
    # Without the layer norms only `conditioning/` trains; train_backbone trains all.
    only = _paths(trainable_mask(params, False, False))
    assert {p for p, m in only.items() if m} == conditioning
    assert frozen_patterns(True, False) == () and all(
        jax.tree.leaves(trainable_mask(params, True)))


@pytest.mark.parametrize("name", ["hyperformer", "hyperformer_pp", "adapters"])
def test_gin_defaults_follow_the_papers(name):
    gin_files = [str(REPO / "gin/models/t5_1_1_tiny.gin"),
                 str(REPO / f"gin/conditioning/{name}.gin")]
    try:
        cli.parse_gin(gin_files, [("NUM_TASKS", "3"), ("VOCAB_SIZE", "64")])
        model = gin.query_parameter("%MODEL").scoped_configurable_fn()
    finally:
        gin.clear_config(clear_constants=True)
    c = model.module.conditioning_config
    assert c.adapter_positions == ("attention", "mlp") and c.adapter_activation == "gelu_new"
    if name == "adapters":
        assert model.train_backbone and model.frozen_patterns == ()
    else:
        assert c.conditional_layer_norm
        assert (model.train_backbone, model.train_layer_norms) == (False, True)
        assert model.frozen_patterns == frozen_patterns(False, True)


@pytest.mark.parametrize("method", ["adapters", "hyperformer", "hyperformer++"])
def test_adapters_sit_after_self_attention_and_mlp_unless_asked(method):
    batch = _batch()
    model = conditioned_model(_base(), ConditioningConfig(method=method, **SMALL))
    params = _init(model, batch)
    cond = params["conditioning"]
    if method == "adapters":
        shapes = {s: cond[f"{s}_adapters"]["down"].shape[:3] for s in ("encoder", "decoder")}
        assert shapes == {"encoder": (2, 2, 3), "decoder": (2, 2, 3)}  # [M, A, T]
    elif method == "hyperformer":
        assert cond["decoder_hyperformer"]["down_generator"].shape[0] == 2  # per position
    else:
        assert cond["decoder_hyperformer"]["position_embedding"]["embedding"].shape[0] == 2
    # Perturbing the decoder's second adapter slot changes the output: it is the MLP one.
    # And a model with a cross-attention adapter has a third decoder slot, which acts.
    cross = conditioned_model(_base(), ConditioningConfig(
        method=method, adapter_positions=("attention", "cross_attention", "mlp"), **SMALL))
    cparams = _init(cross, batch)
    if method == "adapters":
        assert cparams["conditioning"]["decoder_adapters"]["down"].shape[1] == 3
        assert cparams["conditioning"]["encoder_adapters"]["down"].shape[1] == 2
        bumped = jax.tree.map(lambda x: x, cparams)
        up = bumped["conditioning"]["decoder_adapters"]["up_bias"]
        bumped["conditioning"]["decoder_adapters"]["up_bias"] = up.at[:, 1].add(1.0)
        assert not np.allclose(cross.logits(bumped, batch), cross.logits(cparams, batch))
    with pytest.raises(ValueError, match="adapter_positions"):
        ConditioningConfig(adapter_positions=("attention", "ffn"))
    with pytest.raises(ValueError, match="adapter_activation='swish'"):
        ConditioningConfig(adapter_activation="swish")


def test_prompt_tuning_refuses_packed_batches_naming_the_option():
    batch = _batch()
    model = conditioned_model(_base(), ConditioningConfig(method="prompt_tuning", **SMALL))
    params = _init(model, batch)
    packed = dict(batch)
    for side, length in (("encoder", 6), ("decoder", 4)):
        packed[f"{side}_segment_ids"] = np.array([[1] * (length // 2) + [2] * (length // 2)] * 4,
                                                 np.int32)
        packed[f"{side}_positions"] = np.array([list(range(length // 2)) * 2] * 4, np.int32)
    with pytest.raises(ValueError, match=r"prompt_tuning.*packed.*MultiTaskInput\.pack = False"):
        model.loss_fn(params, packed)
    assert np.isfinite(float(model.loss_fn(params, batch)[0]))  # unpacked is fine


def test_count_parameters_matches_closed_form_and_plain_backbone():
    conditioning = ConditioningConfig(method="hyperprompt", hyperprompt_variant="global", **SMALL)
    model = conditioned_model(_base(), conditioning)
    report = kparams.count_parameters(model)
    plain = kparams.count_parameters(_base())
    assert plain["task_conditioned"] == 0 and plain["ratio"] == 1.0
    assert report["backbone"] == plain["total"]
    b = CFG.emb_dim // SMALL["reduction_factor"]
    for side, length, layers in (("decoder", 2, CFG.num_decoder_layers),
                                 ("encoder", 3, CFG.num_encoder_layers)):
        want = kparams.hyperprompt_global_closed_form(
            d=CFG.emb_dim, l=length, T=NUM_TASKS, b=b, t_prime=4, t=4, M=layers, e=8)
        assert report["modules"][f"conditioning/{side}_hyper_prompt"] == want
    assert report["total"] == report["backbone"] + report["task_conditioned"]
    assert "task-conditioned" in kparams.format_report(report, name="tiny")


def test_hyper_prompts_for_the_batch_tasks_only_give_the_same_numbers():
    """`for_batch_tasks(n)` (a balanced step's per-device region) computes the hyper-prompts
    for the batch's tasks only: the same losses and gradients, unrolled and scanned, with a
    task missing from the rows and with an unused slot; the gradient of an absent task's
    prompts is zero as before."""
    # The scanned stack's layer inputs with generated weights; the unrolled layers' prefixes
    # with per-task local weights.
    for variant, scan in (("global", True), ("sep", False)):
        base = seq2seq.EncoderDecoderModel(dataclasses.replace(CFG, scan_layers=scan),
                                           num_tasks=NUM_TASKS)
        model = conditioned_model(base, ConditioningConfig(
            method="hyperprompt", hyperprompt_variant=variant, **SMALL))
        subset = model.for_batch_tasks(2)
        assert subset.module.batch_tasks == 2 and model.module.batch_tasks is None
        assert model.for_batch_tasks(NUM_TASKS) is model
        batch = _batch()
        params = _init(model, batch)

        def loss_and_grad(m):
            return jax.jit(jax.value_and_grad(lambda p, b: m.loss_fn(p, b)[0]))

        whole, part = loss_and_grad(model), loss_and_grad(subset)
        for tasks in ((0, 2, 2, 0), (1, 1, 1, 1)):
            rows = dict(batch, task_id=np.array(tasks, np.int32))
            (l0, g0), (l1, g1) = whole(params, rows), part(params, rows)
            np.testing.assert_allclose(l1, l0, rtol=1e-6)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                         g1, g0)
            side = g1["conditioning"]["encoder_hyper_prompt"]["prompts"]
            absent = sorted(set(range(NUM_TASKS)) - set(tasks))
            assert not np.any(np.asarray(side)[absent]), (variant, scan, tasks)


METHODS = [
    ("hyperprompt", "share"), ("hyperprompt", "sep"), ("hyperprompt", "global"),
    ("prompt_tuning", "global"), ("adapters", "global"), ("hyperformer", "global"),
    ("hyperformer++", "global"),
]


@pytest.mark.parametrize("method,variant", METHODS)
def test_trains_on_2x4_mesh(method, variant):
    model = conditioned_model(_base(CFG_ONE_LAYER), ConditioningConfig(
        method=method, hyperprompt_variant=variant, **SMALL))
    mesh = partitioning.create_mesh(num_partitions=4)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    rules = partitioning.standard_logical_axis_rules()
    batch = _batch(rows=6)
    tx = optax.adam(1e-2)

    def init(rng):
        params = nn.meta.unbox(model.init_variables(rng, batch)["params"])
        return params, tx.init(params)

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(
            lambda r: model.init_variables(r, batch)["params"], jax.random.key(0))
        param_shardings = partitioning.abstract_shardings(abstract, mesh, rules)
        opt_shardings = jax.tree.map(
            lambda _: partitioning.replicated_sharding(mesh),
            jax.eval_shape(lambda r: init(r)[1], jax.random.key(0)))
        params, opt_state = jax.jit(init, out_shardings=(param_shardings, opt_shardings))(
            jax.random.key(0))
        global_batch = partitioning.host_local_to_global(batch, mesh)

        @jax.jit
        def step(params, opt_state, batch):
            (loss, _), grads = jax.value_and_grad(model.loss_fn, has_aux=True)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, grads

        losses = []
        for i in range(3):
            # Each step starts from the initial state's shardings (XLA may place the step's
            # outputs otherwise): one compile of the step, not one per input layout.
            params, opt_state = jax.device_put((params, opt_state),
                                               (param_shardings, opt_shardings))
            params, opt_state, loss, grads = step(params, opt_state, global_batch)
            losses.append(float(loss))
            if i == 0:
                flat = jax.tree_util.tree_flatten_with_path(grads["conditioning"])[0]
                assert flat, "no conditioning parameters"
                dead = [jax.tree_util.keystr(p) for p, g in flat if not np.any(np.asarray(g) != 0)]
                assert not dead, f"no gradient reaches {dead}"
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    # The model axis holds shards of the backbone (and of head-shaped prompt networks).
    specs = [s.spec for s in jax.tree.leaves(param_shardings)]
    assert any("model" in tuple(s) for s in specs)
    assert params["token_embedder"]["embedding"].sharding.spec[0] == "model"


def test_cached_greedy_decoding_with_hyper_prompts_matches_teacher_forcing():
    batch = _batch()
    model = conditioned_model(_base(), ConditioningConfig(method="hyperprompt", **SMALL))
    params = _init(model, batch)
    tokens = np.asarray(model.predict_batch(params, batch, max_decode_length=4))
    assert tokens.shape == (4, 4)
    forced = dict(batch)
    forced["decoder_input_tokens"] = np.concatenate(
        [np.zeros((4, 1), np.int32), tokens[:, :-1]], axis=1)
    forced["decoder_target_tokens"] = np.where(tokens > 0, tokens, 1).astype(np.int32)
    argmax = np.asarray(model.logits(params, forced)).argmax(-1)
    for row in range(4):
        n = int(np.argmax(tokens[row] == 0)) if np.any(tokens[row] == 0) else 4
        np.testing.assert_array_equal(argmax[row, :n], tokens[row, :n])
