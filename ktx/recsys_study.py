"""Trains one configuration of the MetaBalance recommendation study (He et al., 2022).

`run_config` trains `RecsysModel` on `MultiBehaviorData` with a given balancer (a
`ktx.optim` transformation, or None for the plain summed loss) and seed, evaluates full
ranking on validation after every `eval_every` epochs, stops early when validation
NDCG@10 has not improved for `patience` evaluations, and reports the validation and
test metrics of the best epoch. The `ktx.trainer.Trainer` builds the sharded state
(the same layout as `ktx train`); training runs `steps_per_call` steps per compiled call
(`multi_step`, a `lax.scan` over a `[K, batch]` block of batches from a task-partitioned
`RecsysTrainInput`), so the host neither dispatches nor syncs per step. Balanced runs
keep the per-task gradients of the embedding tables sparse (looked-up rows only).

    data = ktx.data.recsys.load_tmall_pairs()
    result = run_config(data, balancer=ktx.optim.metabalance(relax_factor=0.7), seed=0)
    result["test"]["ndcg@10"]
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ktx import partitioning
from ktx.data.recsys import MultiBehaviorData, RecsysTrainInput
from ktx.models.base import BaseModel, with_row_ids
from ktx.models.recsys import RecsysModel
from ktx.ranking_eval import RankingEvaluator
from ktx.train import EarlyStopping
from ktx.trainer import TrainState

__all__ = [
    "SPARSE_TABLES", "adam_l2", "build_model", "train_step", "multi_step", "compile_multi_step",
    "run_config",
]


def adam_l2(learning_rate: float = 1e-3, weight_decay: float = 1e-7) -> optax.GradientTransformation:
    """Adam with L2 weight decay added to the gradient (PyTorch `Adam(weight_decay=...)`,
    which the MetaBalance paper's setup uses): `adam(g + wd * p)`."""
    if learning_rate <= 0 or weight_decay < 0:
        raise ValueError(
            f"adam_l2: learning_rate={learning_rate!r} must be > 0 and weight_decay="
            f"{weight_decay!r} >= 0"
        )
    return optax.chain(optax.add_decayed_weights(weight_decay), optax.adam(learning_rate))


SPARSE_TABLES = (r"^user_embedding/embedding$", r"^item_embedding/embedding$")


def train_step(
    state: TrainState,
    batch: Mapping[str, jax.Array],
    rng: jax.Array,
    *,
    model: BaseModel,
    optimizer: optax.GradientTransformation,
    balancer: Any = None,
    task_counts: tuple[int, ...] | None = None,
    shared: Sequence[str] | None = None,
    sparse_tables: Sequence[str] | None = SPARSE_TABLES,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step; the same update as `ktx.trainer.train_step`, lean metrics.

    The state layout is the `Trainer`'s (`opt_state` is `optimizer`'s state, or
    `(balancer_state, optimizer_state)` with a balancer) and the dropout key is
    `fold_in(rng, state.step)`, as there. With a balancer, the per-task gradients of
    the tables matched by `sparse_tables` are kept as looked-up rows
    (`ktx.optim.compute_task_gradients(..., sparse_tables=)`), so no `[T, rows, embed]`
    tensor is built; the balanced update is identical up to float rounding.

    Args:
      state: the train state.
      batch: one global batch (`user`, `item`, `label`, `task_id`, each `[B]`).
      rng: the base dropout key.
      model, optimizer, balancer: as for `ktx.trainer.Trainer`.
      task_counts: static rows per task of a task-partitioned batch (balanced path).
      shared: regexes of balanced parameters.
      sparse_tables: regexes of `nn.Embed` tables with sparse per-task gradients
        (None: dense).
    Returns:
      `(state, {"loss": scalar, "task_losses": [T]})`.
    """
    step_rng = jax.random.fold_in(rng, state.step)
    batch = with_row_ids(batch)  # dropout keyed per row, as in ktx.trainer.train_step
    normalizer = model.normalizer(batch)
    params = state.params
    if balancer is None:
        def loss(p):
            losses, _ = model.task_losses(p, batch, step_rng, True, normalizer=normalizer)
            return losses.sum(), losses

        grads, task_losses = jax.grad(loss, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
    else:
        from ktx import optim

        task_losses, _, task_grads = optim.compute_task_gradients(
            lambda p, b: model.loss_sums(p, b, step_rng, True), normalizer, params, batch,
            num_tasks=model.num_tasks, task_counts=task_counts, shared=shared,
            sparse_tables=sparse_tables or None,
        )
        balancer_state, optimizer_state = state.opt_state
        grads, balancer_state = balancer.update(
            task_grads, balancer_state, params, task_losses=task_losses,
            task_present=jnp.bincount(batch["task_id"], length=model.num_tasks) > 0,
        )
        updates, optimizer_state = optimizer.update(grads, optimizer_state, params)
        opt_state = (balancer_state, optimizer_state)
    new_state = state.replace(
        step=state.step + 1, params=optax.apply_updates(params, updates), opt_state=opt_state
    )
    return new_state, {"loss": task_losses.sum(), "task_losses": task_losses}


def multi_step(
    state: TrainState,
    batches: Mapping[str, jax.Array],
    rng: jax.Array,
    **step_kwargs: Any,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """`K` consecutive `train_step`s in one call (`lax.scan` over the leading axis).

    Args:
      batches: every feature stacked `[K, B]` (step `state.step + k` in row k).
      step_kwargs: `train_step`'s keyword arguments.
    Returns:
      the state after K steps and the metrics stacked `[K, ...]`; identical to K calls
      of `train_step`.
    """

    def body(s, batch):
        return train_step(s, batch, rng, **step_kwargs)

    return jax.lax.scan(body, state, dict(batches))


def compile_multi_step(
    trainer: Any, task_counts: Sequence[int], sparse_tables: Sequence[str] | None = SPARSE_TABLES
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
    """`multi_step` for a `ktx.trainer.Trainer` (its model, optimizer, balancer, shared
    patterns and state shardings), jitted on its mesh with the state donated.

    Returns `run(state, batches, rng) -> (state, metrics)` with `batches` stacked
    `[K, B]` (any K; each distinct K compiles once) and metrics `[K, ...]`.
    """
    if trainer.state_shardings is None:
        raise ValueError("compile_multi_step: call trainer.init_state first")
    fn = functools.partial(
        multi_step, model=trainer.model, optimizer=trainer.tx_parts[1] if trainer.tx_parts
        else trainer.tx, balancer=trainer.balancer,
        task_counts=tuple(task_counts) if trainer.balancer is not None else None,
        shared=trainer.shared, sparse_tables=tuple(sparse_tables) if sparse_tables else None,
    )
    mesh = trainer.mesh
    stacked = NamedSharding(mesh, PartitionSpec(None, partitioning.DATA))
    rep = partitioning.replicated_sharding(mesh)
    jitted = jax.jit(
        fn, in_shardings=(trainer.state_shardings, stacked, rep),
        out_shardings=(trainer.state_shardings, rep), donate_argnums=(0,),
    )

    def run(state, batches, rng):
        with jax.set_mesh(mesh), nn.logical_axis_rules(trainer.rules):
            return jitted(state, batches, rng)

    return run


def build_model(data: MultiBehaviorData, **model_kwargs: Any) -> RecsysModel:
    """`RecsysModel` sized for `data` (users, items, one task per behaviour)."""
    return RecsysModel(
        num_users=data.num_users,
        num_items=data.num_items,
        num_tasks=len(data.behaviours),
        **model_kwargs,
    )


def run_config(
    data: MultiBehaviorData,
    *,
    balancer: optax.GradientTransformation | None = None,
    seed: int = 0,
    max_epochs: int = 100,
    patience: int = 20,
    eval_every: int = 1,
    batch_size: int = 256,
    num_negatives: int = 1,
    learning_rate: float = 1e-3,
    weight_decay: float = 1e-7,
    optimizer: optax.GradientTransformation | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    shared: Sequence[str] | None = None,
    ks: Sequence[int] = (10, 20),
    steps_per_epoch: int | None = None,
    eval_max_users: int | None = None,
    test_max_users: int | None = None,
    exclude: str = "all",
    steps_per_call: int = 64,
    sparse_tables: Sequence[str] | None = SPARSE_TABLES,
    num_partitions: int = 1,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Trains one (balancer, seed) configuration with early stopping on validation NDCG@10.

    Args:
      data: preprocessed data (target first).
      balancer: a `ktx.optim` balancer, or None for the plain summed-loss step.
      seed: seeds initialization, dropout and the negatives.
      max_epochs, patience, eval_every: early stopping (patience counts evaluations).
      batch_size, num_negatives, learning_rate, weight_decay: the paper's 256, 1e-3, 1e-7.
      optimizer: the optimizer after the balancer (default `adam_l2(learning_rate,
        weight_decay)`; MTAdam, itself the optimizer, takes a bare learning-rate scale).
      model_kwargs: extra `RecsysModel` arguments (embed_dim, mlp_dims, ...).
      shared: balanced parameters (default: the model's `shared_param_patterns`).
      steps_per_epoch: cap an epoch at this many steps (quick runs); None = full epoch.
      eval_max_users, test_max_users: rank only this many validation / test users, a
        fixed random subset (the same for every run; quick runs); None: every user.
      exclude: which of a user's training items are left out of their ranking: "all"
        (every training interaction, auxiliary behaviours included: after leakage
        removal none of them can be a held-out target item) or "target" (the target
        behaviour's training pairs only).
      steps_per_call: training steps per compiled call (`multi_step`); the result does
        not depend on it.
      sparse_tables: tables with sparse per-task gradients on the balanced path.
      num_partitions: size of the mesh's `model` axis (embedding tables are split over
        it); the mesh uses `num_partitions` local devices.
    Returns:
      dict with `best_epoch`, `epochs`, `validation` and `test` metrics at the best epoch,
      `history` (per-evaluation validation NDCG@10), `train_seconds_per_epoch`,
      `eval_seconds`.
    """
    if not isinstance(max_epochs, int) or max_epochs < 1:
        raise ValueError(f"max_epochs={max_epochs!r}: expected a positive int")
    if not isinstance(patience, int) or patience < 1:
        raise ValueError(f"patience={patience!r}: expected a positive int")
    if not isinstance(eval_every, int) or eval_every < 1:
        raise ValueError(f"eval_every={eval_every!r}: expected a positive int")
    if not isinstance(steps_per_call, int) or steps_per_call < 1:
        raise ValueError(f"steps_per_call={steps_per_call!r}: expected a positive int")
    from ktx.trainer import Trainer

    model = build_model(data, **dict(model_kwargs or {}))
    train_input = RecsysTrainInput(
        data, batch_size=batch_size, num_negatives=num_negatives, seed=seed
    )
    n_steps = train_input.steps_per_epoch if steps_per_epoch is None else min(
        int(steps_per_epoch), train_input.steps_per_epoch
    )
    if not isinstance(num_partitions, int) or not 1 <= num_partitions <= jax.local_device_count():
        raise ValueError(
            f"num_partitions={num_partitions!r}: expected 1..{jax.local_device_count()} "
            "(local devices)"
        )
    mesh = partitioning.create_mesh(num_partitions, devices=jax.local_devices()[:num_partitions])
    trainer = Trainer(
        model,
        adam_l2(learning_rate, weight_decay) if optimizer is None else optimizer,
        mesh=mesh,
        balancer=balancer,
        shared=tuple(shared) if shared is not None else (
            model.shared_param_patterns if balancer is not None else None
        ),
    )
    rng = jax.random.key(seed)
    init_rng, step_rng = jax.random.split(rng)
    if balancer is not None:
        from ktx.optim import num_tasks_scope

        with num_tasks_scope(model.num_tasks):
            state = trainer.init_state(init_rng, train_input.get_batch(0))
    else:
        state = trainer.init_state(init_rng, train_input.get_batch(0))

    validation = RankingEvaluator(data, split="validation", ks=ks, max_users=eval_max_users,
                                  exclude=exclude)
    test_ranking = RankingEvaluator(data, split="test", ks=ks, max_users=test_max_users,
                                    exclude=exclude)
    stopper = EarlyStopping("ndcg@10", patience)
    best_params, best_val = None, None
    history, train_seconds, eval_seconds = [], [], 0.0
    epoch = 0
    run_steps = compile_multi_step(trainer, train_input.task_counts(0), sparse_tables)
    for epoch in range(max_epochs):
        t0 = time.perf_counter()
        base = epoch * train_input.steps_per_epoch
        for lo in range(0, n_steps, steps_per_call):
            steps = range(base + lo, base + min(lo + steps_per_call, n_steps))
            batches = [train_input.get_batch(s) for s in steps]
            stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
            state, metrics = run_steps(state, stacked, step_rng)
        step = base + n_steps - 1
        metrics = {"loss": metrics["loss"][-1]}
        jax.block_until_ready(state.params)
        train_seconds.append(time.perf_counter() - t0)
        if not np.isfinite(float(metrics["loss"])):
            raise FloatingPointError(f"non-finite loss {float(metrics['loss'])} at step {step}")
        if (epoch + 1) % eval_every and epoch + 1 < max_epochs:
            continue
        t1 = time.perf_counter()
        val = validation.rank(model, state.params)
        eval_seconds += time.perf_counter() - t1
        history.append(val["ndcg@10"])
        if log:
            log(f"epoch {epoch + 1}: loss {float(metrics['loss']):.4f} val ndcg@10 "
                f"{val['ndcg@10']:.4f} ({train_seconds[-1]:.1f}s train)")
        stop = stopper.update(epoch + 1, {data.target: val})
        if stopper.best_step == epoch + 1:
            best_params, best_val = jax.device_get(state.params), val
        if stop:
            break
    t1 = time.perf_counter()
    test = test_ranking.rank(model, best_params)
    eval_seconds += time.perf_counter() - t1
    return {
        "best_epoch": stopper.best_step,
        "epochs": epoch + 1,
        "validation": best_val,
        "test": test,
        "history": history,
        "train_seconds_per_epoch": float(np.mean(train_seconds)),
        "steps_per_epoch": n_steps,
        "eval_seconds": eval_seconds,
    }
