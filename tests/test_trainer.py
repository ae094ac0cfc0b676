"""Trainer: sharded state, pure steps, microbatching, freezing, NaN stop, run outputs.

A tiny two-task MLP classifier (`ToyModel`) and a step-deterministic input (`ToyInput`)
exercise the trainer without the T5 model; the T5 equivalence test is in
`test_partitioning.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ktx import treepath
from ktx import partitioning
from ktx.training import optimizers, trainer as trainer_lib
from ktx.models.base import BaseModel, segment_sum_by_task
from ktx.training.summaries import read_metrics
from ktx.runs.eval import TeacherForcedEvaluator
from ktx.runs.train import NonFiniteLossError, train


class _Mlp(nn.Module):
    hidden: int = 8
    classes: int = 4
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.Dense(
            self.hidden,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), (partitioning.EMBED, partitioning.MLP)
            ),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (partitioning.MLP,)),
        )(x)
        h = nn.relu(h)
        h = nn.Dropout(self.dropout, deterministic=not train)(h)
        return nn.Dense(
            self.classes,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), (partitioning.MLP, partitioning.VOCAB)
            ),
            use_bias=False,
        )(h)


class ToyModel(BaseModel):
    """Features: `x` float32 [B, D], `label` int32 [B], `task_id` int32 [B]."""

    def __init__(self, num_tasks: int = 2, dim: int = 6, hidden: int = 8, dropout: float = 0.0,
                 loss_normalization: str = "global", nan_after: float | None = None):
        self.num_tasks = num_tasks
        self.dim = dim
        self.loss_normalization = loss_normalization
        self.module = _Mlp(hidden=hidden, dropout=dropout)
        self.nan_after = nan_after

    def init_variables(self, rng, batch):
        return self.module.init(rng, batch["x"], False)

    def input_spec(self, batch_size, feature_lengths):
        return {
            "x": jax.ShapeDtypeStruct((batch_size, self.dim), jnp.float32),
            "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
            "task_id": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        }

    def task_weights(self, batch):
        return segment_sum_by_task(jnp.ones(batch["label"].shape), batch["task_id"], self.num_tasks)

    def loss_sums(self, params, batch, rng, train):
        rngs = {"dropout": rng} if rng is not None else {}
        logits = self.module.apply({"params": params}, batch["x"], train, rngs=rngs)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        if self.nan_after is not None:
            # Blows up once the input scale passes `nan_after` (ToyInput grows it).
            losses = jnp.where(jnp.abs(batch["x"]).max() > self.nan_after, jnp.nan, losses)
        correct = (logits.argmax(-1) == batch["label"]).astype(jnp.float32)
        t = batch["task_id"]
        aux = {
            "loss": segment_sum_by_task(losses, t, self.num_tasks),
            "accuracy": segment_sum_by_task(correct, t, self.num_tasks),
            "weight": segment_sum_by_task(jnp.ones_like(losses), t, self.num_tasks),
        }
        return aux["loss"], aux


class ToyInput:
    """A `ktx.runs.train.TrainInput`: task-partitioned batches, a pure function of (seed, step)."""

    task_names = ("toy_a_v001", "toy_b_v001")
    num_tasks = 2

    def __init__(self, batch_size=8, dim=6, seed=0, counts=(5, 3), grow_after=None):
        self.batch_size, self.dim, self.seed, self.counts = batch_size, dim, seed, counts
        self.grow_after = grow_after
        w = np.random.default_rng(123).normal(size=(2, dim, 4))
        self._w = w

    def get_batch(self, step):
        rng = np.random.default_rng((self.seed, step))
        x = rng.normal(size=(self.batch_size, self.dim)).astype(np.float32)
        if self.grow_after is not None and step >= self.grow_after:
            x *= 1000.0
        task = np.repeat(np.arange(2), self.counts).astype(np.int32)
        label = np.einsum("bd,bdk->bk", x, self._w[task]).argmax(-1).astype(np.int32)
        return {"x": x, "label": label, "task_id": task}

    def task_counts(self, step):
        return self.counts

    def eval_batches(self, task_name, split, batch_size):
        t = self.task_names.index(task_name)
        for i in range(2):
            b = self.get_batch(10_000 + i)
            b["task_id"] = np.full_like(b["task_id"], t)
            yield b, batch_size


def _run_steps(trainer, n, inp, seed=0):
    state = trainer.init_state(jax.random.key(seed), inp.get_batch(0))
    losses = []
    for step in range(n):
        state, m = trainer.train_step(state, inp.get_batch(step), jax.random.key(1))
        losses.append(float(m["loss"]))
    return state, losses


def test_state_is_sharded_by_logical_axes():
    mesh = partitioning.create_mesh(4)  # 2 x 4
    tr = trainer_lib.Trainer(ToyModel(), optax.adam(1e-2), mesh=mesh)
    state = tr.init_state(jax.random.key(0), ToyInput().get_batch(0))
    kernel = state.params["Dense_0"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    # Adam moments follow their parameter; the step counter is replicated.
    mu = state.opt_state[0].mu["Dense_0"]["kernel"]
    assert mu.sharding.spec == kernel.sharding.spec
    assert state.opt_state[0].count.sharding.spec == jax.sharding.PartitionSpec()
    assert int(state.step) == 0


def test_train_step_matches_manual_sgd_and_folds_rng_with_step():
    inp = ToyInput()
    tr = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1))
    state = tr.init_state(jax.random.key(0), inp.get_batch(0))
    params0 = jax.device_get(state.params)
    batch = inp.get_batch(0)
    model = ToyModel()
    expected_loss, _ = model.loss_fn(params0, batch)
    grads = jax.grad(lambda p: model.loss_fn(p, batch)[0])(params0)
    state, m = tr.train_step(state, batch, jax.random.key(1))
    np.testing.assert_allclose(float(m["loss"]), float(expected_loss), rtol=1e-5)
    manual = jax.tree.map(lambda p, g: p - 0.1 * g, params0, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), state.params, manual)
    assert int(state.step) == 1
    # Per-task metrics: rows per task and losses summing to the total.
    np.testing.assert_array_equal(np.asarray(m["examples"]), [5, 3])
    np.testing.assert_allclose(float(m["task_losses"].sum()), float(m["loss"]), rtol=1e-6)


def test_dropout_key_depends_on_step_only():
    inp = ToyInput()
    model = ToyModel(dropout=0.5)
    tr = trainer_lib.Trainer(model, optax.sgd(0.0))
    state = tr.init_state(jax.random.key(0), inp.get_batch(0))
    batch = inp.get_batch(0)
    s1, m1 = tr.train_step(state.replace(step=jnp.int32(3)), batch, jax.random.key(1))
    state = tr.init_state(jax.random.key(0), inp.get_batch(0))
    s2, m2 = tr.train_step(state.replace(step=jnp.int32(3)), batch, jax.random.key(1))
    state = tr.init_state(jax.random.key(0), inp.get_batch(0))
    s3, m3 = tr.train_step(state.replace(step=jnp.int32(4)), batch, jax.random.key(1))
    assert float(m1["loss"]) == float(m2["loss"])
    assert float(m1["loss"]) != float(m3["loss"])


@pytest.mark.parametrize("normalization", ["global", "per_task"])
def test_microbatches_equal_full_batch(normalization):
    inp = ToyInput(batch_size=8, counts=(5, 3))
    full = trainer_lib.Trainer(ToyModel(loss_normalization=normalization), optax.sgd(0.5))
    micro = trainer_lib.Trainer(
        ToyModel(loss_normalization=normalization), optax.sgd(0.5), num_microbatches=4
    )
    s_full, l_full = _run_steps(full, 3, inp)
    s_micro, l_micro = _run_steps(micro, 3, inp)
    np.testing.assert_allclose(l_full, l_micro, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), s_full.params, s_micro.params)


def test_microbatches_must_divide_batch():
    tr = trainer_lib.Trainer(ToyModel(), optax.sgd(0.5), num_microbatches=3)
    inp = ToyInput()
    state = tr.init_state(jax.random.key(0), inp.get_batch(0))
    with pytest.raises(ValueError, match="num_microbatches=3 must divide"):
        tr.train_step(state, inp.get_batch(0), jax.random.key(1))


def test_frozen_params_do_not_move():
    tx = optimizers.freeze(optax.adam(1e-1), frozen=[r"Dense_0/.*"])
    tr = trainer_lib.Trainer(ToyModel(), tx)
    inp = ToyInput()
    state0 = jax.device_get(tr.init_state(jax.random.key(0), inp.get_batch(0)).params)
    state, _ = _run_steps(tr, 2, inp)
    np.testing.assert_array_equal(state.params["Dense_0"]["kernel"], state0["Dense_0"]["kernel"])
    assert not np.allclose(state.params["Dense_1"]["kernel"], state0["Dense_1"]["kernel"])


def test_eval_step_sums_per_task():
    inp = ToyInput()
    tr = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1))
    state = tr.init_state(jax.random.key(0), inp.get_batch(0))
    out = tr.eval_step(state.params, inp.get_batch(0))
    np.testing.assert_array_equal(np.asarray(out["weight"]), [5, 3])
    np.testing.assert_allclose(np.asarray(out["loss_sum"]), np.asarray(out["loss"]))


def test_batch_not_divisible_by_data_axis():
    tr = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1), mesh=partitioning.create_mesh(1))
    inp = ToyInput(batch_size=6, counts=(3, 3))
    state = tr.init_state(jax.random.key(0), inp.get_batch(0))
    with pytest.raises(ValueError, match="divisible by the data-parallel size 8"):
        tr.train_step(state, inp.get_batch(0), jax.random.key(1))


def test_train_writes_outputs_and_resumes(tmp_path):
    kwargs = dict(
        model=ToyModel(), train_input=ToyInput(), model_dir=tmp_path, optimizer=optax.adam(1e-2),
        schedule=optimizers.constant_schedule(1e-2), log_period=2, checkpoint_period=2,
        eval_period=4, evaluators=[TeacherForcedEvaluator(batch_size=8)], norm_metrics=True,
    )
    state4 = train(train_steps=4, **kwargs)
    records = read_metrics(tmp_path)
    train_rows = [r for r in records if r["split"] == "train"]
    assert {(r["step"], r["task"]) for r in train_rows} == {
        (s, t) for s in (2, 4) for t in ("toy_a_v001", "toy_b_v001", "all")
    }
    last_all = [r for r in train_rows if r["task"] == "all" and r["step"] == 4][0]
    for key in ("loss", "accuracy", "learning_rate", "grad_norm", "steps_per_s",
                "examples_per_s", "input_wait_fraction"):
        assert key in last_all and math.isfinite(last_all[key]), key
    assert last_all["learning_rate"] == pytest.approx(1e-2)
    val = [r for r in records if r["split"] == "validation"]
    assert {r["task"] for r in val} >= {"toy_a_v001", "toy_b_v001"}
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())
    # Continue to 6 steps: resumes at 4, equals a straight 6-step run.
    state6 = train(train_steps=6, **kwargs)
    straight = train(train_steps=6, **{**kwargs, "model_dir": tmp_path / "straight"})
    assert int(state6.step) == 6
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7), state6.params, straight.params)
    assert not np.allclose(state4.params["Dense_1"]["kernel"], state6.params["Dense_1"]["kernel"])


def test_no_schedule_logs_no_learning_rate(tmp_path):
    """A bare optax optimizer hides its rate: nothing is logged rather than a made-up 0."""
    train(model=ToyModel(), train_input=ToyInput(), model_dir=tmp_path, optimizer=optax.adam(1e-2),
          train_steps=2, log_period=2, checkpoint_period=2)
    train_rows = [r for r in read_metrics(tmp_path) if r["split"] == "train"]
    assert train_rows and all("learning_rate" not in r for r in train_rows)
    assert all(math.isfinite(r["loss"]) for r in train_rows)
    with pytest.raises(ValueError, match="no schedule"):
        optimizers.TaskOptimizer(optax.adam(1e-2)).learning_rate(0)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    with pytest.raises(NonFiniteLossError, match="at step 5 .*Last good checkpoint: step 4"):
        train(
            model=ToyModel(nan_after=100.0), train_input=ToyInput(grow_after=5), model_dir=tmp_path,
            optimizer=optax.sgd(0.1), train_steps=10, log_period=3, checkpoint_period=2,
        )
    from ktx.training.checkpoints import CheckpointManager

    assert CheckpointManager(tmp_path).all_steps() == [2, 4]


@pytest.mark.parametrize("shortcut", [True, False])
def test_balanced_path_with_vanilla_multi_equals_plain_path(shortcut):
    """Per-task gradients summed, and the loss-weighted shortcut (weights 1)."""
    optim = pytest.importorskip("ktx.optim")
    inp = ToyInput()
    plain = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1))
    balanced = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1), balancer=optim.vanilla_multi(),
                                   weights_from_losses=shortcut)
    s_plain, l_plain = _run_steps(plain, 2, inp)
    state = balanced.init_state(jax.random.key(0), inp.get_batch(0))
    l_bal = []
    for step in range(2):
        state, m = balanced.train_step(state, inp.get_batch(step), jax.random.key(1),
                                       task_counts=inp.task_counts(step))
        l_bal.append(float(m["loss"]))
    np.testing.assert_allclose(l_bal, l_plain, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), state.params, s_plain.params)


def test_balanced_path_metabalance_with_microbatches():
    optim = pytest.importorskip("ktx.optim")
    inp = ToyInput()
    tr = trainer_lib.Trainer(ToyModel(), optax.adam(1e-2), balancer=optim.metabalance(num_tasks=2),
                             num_microbatches=2, norm_metrics=True)
    state = tr.init_state(jax.random.key(0), inp.get_batch(0))
    shapes = jax.tree.map(lambda x: x.shape, state.opt_state)
    for step in range(2):
        state, m = tr.train_step(state, inp.get_batch(step), jax.random.key(1),
                                 task_counts=inp.task_counts(step))
        assert math.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0
    assert jax.tree.map(lambda x: x.shape, state.opt_state) == shapes


def test_schedules_hand_computed():
    rsqrt = optimizers.rsqrt_schedule(base_learning_rate=1.0, warmup_steps=100)
    np.testing.assert_allclose([float(rsqrt(s)) for s in (0, 50, 100, 400)], [0.1, 0.1, 0.1, 0.05])
    lin = optimizers.linear_decay_schedule(1.0, decay_steps=10, warmup_steps=10)
    np.testing.assert_allclose([float(lin(s)) for s in (0, 5, 10, 15, 20, 30)],
                               [0.0, 0.5, 1.0, 0.5, 0.0, 0.0], atol=1e-7)
    assert float(optimizers.constant_schedule(0.3)(1000)) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="warmup_steps=0"):
        optimizers.rsqrt_schedule(warmup_steps=0)


def test_adafactor_t5x_defaults_factor_large_matrices():
    tx = optimizers.adafactor(learning_rate=1e-2)
    params = {"big": jnp.ones((256, 128)), "small": jnp.ones((4, 8))}
    state = tx.init(params)
    leaves = {tuple(x.shape) for x in jax.tree.leaves(state)}
    assert (256,) in leaves and (128,) in leaves  # factored row/column moments
    updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    assert updates["big"].shape == (256, 128)


def test_task_module_warmup_delays_the_backbone_with_fresh_state():
    """The first 2 steps move only the task modules; the backbone's first update (step 3)
    is a fresh Adam's first update on that step's gradient; the task modules run Adam
    throughout, as if alone."""
    params = {"task_heads": {"w": jnp.ones(3)}, "body": {"w": jnp.ones(4)}}
    grads = [{"task_heads": {"w": jnp.full(3, g)}, "body": {"w": jnp.arange(4.0) * g}}
             for g in (1.0, -2.0, 0.5, 3.0)]
    tx = optimizers.task_module_warmup(optax.adam(0.1), 2)
    state = tx.init(params)
    heads, body = optax.adam(0.1), optax.adam(0.1)
    head_state, body_state = heads.init(params["task_heads"]), body.init(params["body"])
    for step, g in enumerate(grads):
        updates, state = jax.jit(tx.update)(g, state, params)
        want_head, head_state = heads.update(g["task_heads"], head_state)
        np.testing.assert_allclose(updates["task_heads"]["w"], want_head["w"], rtol=1e-6)
        if step < 2:
            np.testing.assert_array_equal(updates["body"]["w"], np.zeros(4))
        else:
            want_body, body_state = body.update(g["body"], body_state)
            np.testing.assert_allclose(updates["body"]["w"], want_body["w"], rtol=1e-6)
    with pytest.raises(ValueError, match=r"task_modules=\('nope/.\*',\) match no parameter"):
        optimizers.task_module_warmup(optax.adam(0.1), 2, ["nope/.*"]).init(params)
    with pytest.raises(ValueError, match="steps=-1; accepted: an int >= 0"):
        optimizers.delay(optax.adam(0.1), -1)


def test_frozen_pattern_typo_is_an_error():
    with pytest.raises(ValueError, match="matches no parameter"):
        optimizers.frozen_mask({"Dense_0": {"kernel": jnp.ones(2)}}, [r"Dens_0/.*"])


class _FrozenToy(ToyModel):
    frozen_patterns = (r"Dense_0/.*",)


def test_model_frozen_params_are_bit_identical_under_weight_decay_and_have_no_state():
    """A model's `frozen_patterns` reach the optimizer: AdamW's decoupled weight decay
    (a gradient-free term) leaves frozen leaves bit-identical, and no moments exist for
    them, on the plain and the balanced path."""
    from ktx import optim

    inp = ToyInput()
    for balancer in (None, optim.vanilla_multi()):
        tr = trainer_lib.Trainer(_FrozenToy(), optax.adamw(1e-2, weight_decay=0.5), balancer=balancer)
        state0 = jax.device_get(tr.init_state(jax.random.key(0), inp.get_batch(0)))
        state, _ = _run_steps(tr, 3, inp)
        for leaf in ("kernel", "bias"):
            np.testing.assert_array_equal(state.params["Dense_0"][leaf], state0.params["Dense_0"][leaf])
        assert not np.allclose(state.params["Dense_1"]["kernel"], state0.params["Dense_1"]["kernel"])
        shapes = {np.shape(x) for x in jax.tree.leaves(state.opt_state)}
        assert (6, 8) not in shapes and (8,) not in shapes and (8, 4) in shapes


def test_frozen_t5_backbone_is_bit_identical_after_adamw_steps():
    from ktx.conditioning.model import ConditioningConfig, conditioned_model
    from ktx.models import seq2seq, t5

    base = seq2seq.EncoderDecoderModel(
        config=t5.T5Config(vocab_size=64, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
                           num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0),
        num_tasks=2)
    model = conditioned_model(base, ConditioningConfig(method="adapters", reduction_factor=4),
                              train_backbone=False)
    rng = np.random.default_rng(0)
    batch = {
        "encoder_input_tokens": rng.integers(2, 64, (8, 6)).astype(np.int32),
        "decoder_input_tokens": rng.integers(2, 64, (8, 4)).astype(np.int32),
        "decoder_target_tokens": rng.integers(2, 64, (8, 4)).astype(np.int32),
        "decoder_loss_weights": np.ones((8, 4), np.float32),
        "task_id": np.repeat(np.arange(2), 4).astype(np.int32),
    }
    tr = trainer_lib.Trainer(model, optax.adamw(1e-2, weight_decay=0.1))
    state = tr.init_state(jax.random.key(0), batch)
    before = jax.device_get(state.params)
    for _ in range(3):
        state, _ = tr.train_step(state, batch, jax.random.key(1))
    after = jax.device_get(state.params)
    moved = {k: not np.array_equal(a, b) for k, a, b in zip(
        treepath.names(before), jax.tree.leaves(before), jax.tree.leaves(after))}
    assert all(moved[k] for k in moved if k.startswith("conditioning/"))
    frozen = [k for k in moved if not k.startswith("conditioning/")]
    assert frozen and not any(moved[k] for k in frozen), [k for k in frozen if moved[k]]


class _VaryingInput(ToyInput):
    """Counts that change every step (as carried mixing quotas do)."""

    SCHEDULE = ((5, 3), (4, 4), (6, 2), (5, 3), (3, 5), (4, 4))

    def get_batch(self, step):
        self.counts = self.SCHEDULE[step % len(self.SCHEDULE)]
        return super().get_batch(step)

    def task_counts(self, step):
        return self.SCHEDULE[step % len(self.SCHEDULE)]


def test_balanced_step_compiles_per_block_size_not_per_count_tuple():
    from ktx import optim

    inp = _VaryingInput()
    plain = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1))
    # One device: blocks are not rounded up to the data axis (below).
    one = partitioning.create_mesh(1, devices=jax.devices()[:1])
    balanced = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1), balancer=optim.vanilla_multi(),
                                   mesh=one, weights_from_losses=False)  # task blocks
    sp = plain.init_state(jax.random.key(0), inp.get_batch(0))
    sb = balanced.init_state(jax.random.key(0), inp.get_batch(0))
    for step in range(12):
        batch = inp.get_batch(step)
        sp, mp = plain.train_step(sp, batch, jax.random.key(1))
        sb, mb = balanced.train_step(sb, batch, jax.random.key(1), task_counts=inp.task_counts(step))
        np.testing.assert_allclose(float(mb["loss"]), float(mp["loss"]), rtol=1e-5)
    # Block sizes = the most rows seen per task: (5, 3) -> (5, 4) -> (6, 4) -> (6, 5) in
    # the first 5 steps, then no compile in the 7 steps after (which revisit every tuple).
    assert sorted(c for c, *_ in balanced._compiled) == [(5, 3), (5, 4), (6, 4), (6, 5)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 jax.device_get(sb.params), jax.device_get(sp.params))


def test_task_blocks_are_rounded_up_to_the_data_axis():
    from ktx import optim

    def capacity(data, counts_seq):
        mesh = partitioning.create_mesh(8 // data)  # data x (8 / data) over the 8 devices
        tr = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1), balancer=optim.vanilla_multi(),
                                 mesh=mesh, weights_from_losses=False, grad_method="blocks")
        for counts in counts_seq:
            got = tr._capacity_for(counts)
        return got

    assert capacity(4, [(6, 5, 5, 0), (5, 4, 5, 2)]) == (8, 8, 8, 4)
    assert capacity(2, [(6, 5, 5, 0)]) == (6, 6, 6, 0)
    assert capacity(8, [(14, 2)]) == (16, 8)  # at most the batch
    assert capacity(8, [(15, 1)]) == (16, 8)


def test_a_data_axis_takes_task_gradients_device_by_device():
    """grad_method "auto" on a mesh with several `data` devices: the compile key is the
    most tasks any device has held rows of (`ktx.optim.device_slots`), not block sizes."""
    from ktx import optim

    def key(data, counts_seq, **kw):
        tr = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1), balancer=optim.vanilla_multi(),
                                 mesh=partitioning.create_mesh(8 // data),
                                 weights_from_losses=False, **kw)
        for counts in counts_seq:
            got = tr._capacity_for(counts)
        return got

    assert key(4, [(4, 4, 4, 4)]) == ("devices", 1)  # rows 0-3 | 4-7 | 8-11 | 12-15
    assert key(8, [(14, 2)]) == ("devices", 1)
    # Two tasks on some device: one forward and two backward passes (5/3 of a step)
    # against blocks padded to the axis: blocks of 8, 8, 8 (24 of 16 rows) are cheaper...
    assert key(4, [(6, 5, 5, 0)]) == (8, 8, 8, 0)
    assert key(4, [(6, 5, 5, 0)], grad_method="devices") == ("devices", 2)
    # ... blocks of 8, 8, 8, 16 (40 of 16 rows) are not.
    assert key(8, [(1, 1, 1, 13)]) == ("devices", 2)
    # The most seen of both: slots 2 (5/3) against blocks (8, 8, 8, 4) (28 of 16 rows).
    assert key(4, [(4, 4, 4, 4), (6, 5, 5, 0), (4, 4, 4, 4)]) == ("devices", 2)
    assert key(1, [(6, 5, 5, 0)]) == (6, 5, 5, 0)  # one data device: exact task blocks
    # Parameters split over `data` (2-D partitioning): "auto" keeps the blocks.
    two_d = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=2)
    tr = trainer_lib.Trainer(ToyModel(dim=8), optax.sgd(0.1), balancer=optim.vanilla_multi(),
                             mesh=partitioning.create_mesh(2), rules=two_d,
                             weights_from_losses=False)
    tr.create_abstract_state(ToyInput(dim=8, batch_size=16, counts=(6, 10)).get_batch(0))
    assert tr._capacity_for((6, 10)) == (8, 12)
    assert key(4, [(6, 5, 5, 0)], num_microbatches=2) is None  # the VJP engine: no blocks


def test_diagnostics_only_on_log_steps_against_the_target_task():
    from ktx import optim

    inp = ToyInput()
    tr = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1),
                             balancer=optim.metabalance(target_task=1, num_tasks=2),
                             diagnostics_period=3, target_task=1)
    state = tr.init_state(jax.random.key(0), inp.get_batch(0))
    logged = []
    for step in range(6):
        state, m = tr.train_step(state, inp.get_batch(step), jax.random.key(1), task_counts=inp.counts)
        logged.append(bool(m["diagnostics_logged"]))
        cos = {k: float(v) for k, v in m["diagnostics"].items() if k.startswith("cosine_to_target/")}
        if logged[-1]:
            assert cos
            assert all(v == pytest.approx(1.0) for k, v in cos.items() if k.endswith("task1"))
            assert any(v != pytest.approx(1.0) for k, v in cos.items() if k.endswith("task0"))
        else:  # the step compiled not to log returns no diagnostics at all
            assert m["diagnostics"] == {}
    assert logged == [False, False, True, False, False, True]
    with pytest.raises(ValueError, match="target_task=2"):
        trainer_lib.Trainer(ToyModel(), optax.sgd(0.1), target_task=2)


def test_host_picks_a_step_with_or_without_diagnostics_as_the_cond_would():
    """The Trainer compiles the balanced step with and without diagnostics and picks on
    the host from its mirror of the step (a logged step, alone or in a block, runs the
    step with the `lax.cond`, the one `ktx precompile` measures): the same states and
    metrics as the pure step deciding by itself."""
    from ktx import optim

    inp = ToyInput()
    for balancer in (optim.metabalance(target_task=1, num_tasks=2), optim.uncertainty(num_tasks=2)):
        tr = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1), balancer=balancer,
                                 diagnostics_period=3, target_task=1)
        state = tr.init_state(jax.random.key(0), inp.get_batch(0))
        ref = jax.jit(functools.partial(
            trainer_lib.train_step, model=tr.model, optimizer=tr.optimizer,
            options=dataclasses.replace(tr.options, task_capacity=inp.counts)))
        expected = state
        for step in range(4):
            batch = inp.get_batch(step)
            expected, m_ref = ref(expected, batch, jax.random.key(1))
            state, m = tr.train_step(state, batch, jax.random.key(1), task_counts=inp.counts)
            assert bool(m["diagnostics_logged"]) == (step == 2)
            if step != 2:  # the cond's zeros; the step compiled not to log returns none
                assert m["diagnostics"] == {} and m_ref["diagnostics"]
                assert not any(np.any(x) for x in jax.tree.leaves(m_ref["diagnostics"]))
                m_ref = {**m_ref, "diagnostics": {}}
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                         jax.device_get((state, m)), jax.device_get((expected, m_ref)))
        assert {log for _, stacked, log in tr._compiled if not stacked} == {False, None}
        assert tr._step_mirror[0] is state.step and tr._step_mirror[1] == 4
        # Blocks of 2 steps: (4, 5) holds logged step 5 (a cond), (6, 7) none.
        batches = {k: np.stack([inp.get_batch(s)[k] for s in (4, 5)]) for k in batch}
        state, m = tr.train_steps(state, batches, jax.random.key(1), task_counts=inp.counts)
        assert [bool(x) for x in m["diagnostics_logged"]] == [False, True]
        state, m = tr.train_steps(state, batches, jax.random.key(1), task_counts=inp.counts)
        assert [bool(x) for x in m["diagnostics_logged"]] == [False, False]
        assert {log for _, stacked, log in tr._compiled if stacked} == {False, None}
        # A state this Trainer did not return (a restored one) is read once from the device.
        other = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1), balancer=balancer,
                                    diagnostics_period=3, target_task=1)
        other.init_state(jax.random.key(0), inp.get_batch(0))
        _, m = other.train_step(state, inp.get_batch(8), jax.random.key(1), task_counts=inp.counts)
        assert bool(m["diagnostics_logged"])  # step 8: (8 + 1) % 3 == 0


def test_balanced_batch_not_grouped_as_its_counts_fails_before_the_step():
    from ktx import optim

    inp = ToyInput()
    tr = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1), balancer=optim.vanilla_multi())
    state = tr.init_state(jax.random.key(0), inp.get_batch(0))
    batch = inp.get_batch(0)
    batch["task_id"] = batch["task_id"][::-1].copy()  # task 1 first: not what (5, 3) says
    with pytest.raises(ValueError, match="row 0 has task_id 1"):
        tr.train_step(state, batch, jax.random.key(1), task_counts=inp.counts)
    with pytest.raises(ValueError, match="row 0 has task_id 1"):
        tr.global_batch(batch, inp.counts)


def test_param_norm_equals_the_tree_norm_in_both_lowerings(monkeypatch):
    # `param_norm` is reduced apart from the update on GPUs (behind an optimization
    # barrier, the small leaves in one chunked reduction); here, and as a GPU lowers it
    # (`platform_dependent`'s cuda branch), it is the norm of the whole tree.
    rng = np.random.default_rng(0)
    params = {"big": jnp.asarray(rng.normal(size=(300, 300)), jnp.float32),
              "small": [jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(3,), (7, 5), ()]]}
    want = float(optax.tree.norm(params))
    np.testing.assert_allclose(jax.jit(trainer_lib._param_norm)(params), want, rtol=1e-6)

    def cuda_branch(*args, cuda=None, default=None, **_):
        return cuda(*args)

    monkeypatch.setattr(jax.lax, "platform_dependent", cuda_branch)
    np.testing.assert_allclose(jax.jit(trainer_lib._param_norm)(params), want, rtol=1e-6)
