"""Trains one configuration of the MetaBalance recommendation study (He et al., 2022).

`run_config` trains `RecsysModel` on `MultiBehaviorData` with a given balancer (a
`ktx.optim` transformation, or None for the plain summed loss) and seed, evaluates full
ranking on validation after every `eval_every` epochs, stops early when validation
NDCG@10 has not improved for `patience` evaluations, and reports the validation and
test metrics of the best epoch. It trains with `ktx train`'s step: a `ktx.training.trainer.Trainer`
builds the sharded state and runs `steps_per_call` steps per compiled call
(`Trainer.train_steps`, a `lax.scan` over a `[K, batch]` block of batches from a
task-partitioned `RecsysTrainInput`), so the host neither dispatches nor syncs per step.
Balanced runs keep the per-task gradients of the embedding tables sparse (looked-up rows
only, `StepOptions.sparse_tables`).

    data = ktx.data.recsys.load_tmall_pairs()
    result = run_config(data, balancer=ktx.optim.metabalance(relax_factor=0.7), seed=0)
    result["test"]["ndcg@10"]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from ktx import partitioning
from ktx.data.recsys import MultiBehaviorData, RecsysTrainInput
from ktx.models.recsys import RecsysModel
from ktx.runs.rank_eval import RankingEvaluator
from ktx.runs.hooks import EarlyStopping
from ktx.training.trainer import Trainer

__all__ = [
    "SPARSE_TABLES", "adam_l2", "build_model", "study_trainer", "run_config",
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


def study_trainer(
    model: RecsysModel,
    optimizer: optax.GradientTransformation,
    balancer: Any = None,
    *,
    shared: Sequence[str] | None = None,
    sparse_tables: Sequence[str] | None = SPARSE_TABLES,
    num_partitions: int = 1,
) -> Trainer:
    """The study's `Trainer`: `num_partitions` local devices on the `model` axis, the
    balanced parameters `shared` (default: the model's `shared_param_patterns`), sparse
    per-task table gradients on the balanced path, and lean metrics (no norms, no
    diagnostics) for its many small steps."""
    if not isinstance(num_partitions, int) or not 1 <= num_partitions <= jax.local_device_count():
        raise ValueError(
            f"num_partitions={num_partitions!r}: expected 1..{jax.local_device_count()} "
            "(local devices)"
        )
    balanced = balancer is not None
    return Trainer(
        model, optimizer, balancer=balancer,
        mesh=partitioning.create_mesh(num_partitions, devices=jax.local_devices()[:num_partitions]),
        shared=(tuple(shared) if shared is not None else model.shared_param_patterns)
        if balanced else None,
        sparse_tables=tuple(sparse_tables) if balanced and sparse_tables else None,
        diagnostics_period=0, norm_metrics=False,
    )


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
      `history` (per-evaluation validation NDCG@10), `train_loss` (each epoch's last
      step), `train_seconds_per_epoch`, `eval_seconds`.
    """
    if not isinstance(max_epochs, int) or max_epochs < 1:
        raise ValueError(f"max_epochs={max_epochs!r}: expected a positive int")
    if not isinstance(patience, int) or patience < 1:
        raise ValueError(f"patience={patience!r}: expected a positive int")
    if not isinstance(eval_every, int) or eval_every < 1:
        raise ValueError(f"eval_every={eval_every!r}: expected a positive int")
    if not isinstance(steps_per_call, int) or steps_per_call < 1:
        raise ValueError(f"steps_per_call={steps_per_call!r}: expected a positive int")
    model = build_model(data, **dict(model_kwargs or {}))
    train_input = RecsysTrainInput(
        data, batch_size=batch_size, num_negatives=num_negatives, seed=seed
    )
    n_steps = train_input.steps_per_epoch if steps_per_epoch is None else min(
        int(steps_per_epoch), train_input.steps_per_epoch
    )
    trainer = study_trainer(
        model, adam_l2(learning_rate, weight_decay) if optimizer is None else optimizer,
        balancer, shared=shared, sparse_tables=sparse_tables, num_partitions=num_partitions)
    rng = jax.random.key(seed)
    init_rng, step_rng = jax.random.split(rng)
    state = trainer.init_state(init_rng, train_input.get_batch(0))

    validation = RankingEvaluator(data, split="validation", ks=ks, max_users=eval_max_users,
                                  exclude=exclude)
    test_ranking = RankingEvaluator(data, split="test", ks=ks, max_users=test_max_users,
                                    exclude=exclude)
    stopper = EarlyStopping("ndcg@10", patience)
    best_params, best_val = None, None
    history, train_loss, train_seconds, eval_seconds = [], [], [], 0.0
    epoch = 0
    counts = train_input.task_counts(0)  # the same for every step of the study's input
    for epoch in range(max_epochs):
        t0 = time.perf_counter()
        base = epoch * train_input.steps_per_epoch
        for lo in range(0, n_steps, steps_per_call):
            steps = range(base + lo, base + min(lo + steps_per_call, n_steps))
            batches = [train_input.get_batch(s) for s in steps]
            stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
            state, metrics = trainer.train_steps(state, stacked, step_rng, counts)
        step = base + n_steps - 1
        metrics = {"loss": metrics["loss"][-1]}
        jax.block_until_ready(state.params)
        train_seconds.append(time.perf_counter() - t0)
        if not np.isfinite(float(metrics["loss"])):
            raise FloatingPointError(f"non-finite loss {float(metrics['loss'])} at step {step}")
        train_loss.append(float(metrics["loss"]))
        if (epoch + 1) % eval_every and epoch + 1 < max_epochs:
            continue
        t1 = time.perf_counter()
        val = validation.rank(model, state.params, trainer.mesh)
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
    test = test_ranking.rank(model, best_params, trainer.mesh)
    eval_seconds += time.perf_counter() - t1
    return {
        "best_epoch": stopper.best_step,
        "epochs": epoch + 1,
        "validation": best_val,
        "test": test,
        "history": history,
        "train_loss": train_loss,
        "train_seconds_per_epoch": float(np.mean(train_seconds)),
        "steps_per_epoch": n_steps,
        "eval_seconds": eval_seconds,
    }
