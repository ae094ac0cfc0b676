"""Trains one configuration of the MetaBalance recommendation study (He et al., 2022).

`run_config` trains `RecsysModel` on `MultiBehaviorData` with a given balancer (a
`ktx.optim` transformation, or None for the plain summed loss) and seed, evaluates full
ranking on validation after every `eval_every` epochs, stops early when validation
NDCG@10 has not improved for `patience` evaluations, and reports the validation and
test metrics of the best epoch. Training runs through `ktx.trainer.Trainer` (the same
compiled step as `ktx train`), on a task-partitioned `RecsysTrainInput`.

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
from ktx.metrics.ranking import full_ranking
from ktx.models.recsys import RecsysModel

__all__ = ["adam_l2", "build_model", "run_config"]


def adam_l2(learning_rate: float = 1e-3, weight_decay: float = 1e-7) -> optax.GradientTransformation:
    """Adam with L2 weight decay added to the gradient (PyTorch `Adam(weight_decay=...)`,
    which the MetaBalance paper's setup uses): `adam(g + wd * p)`."""
    if learning_rate <= 0 or weight_decay < 0:
        raise ValueError(
            f"adam_l2: learning_rate={learning_rate!r} must be > 0 and weight_decay="
            f"{weight_decay!r} >= 0"
        )
    return optax.chain(optax.add_decayed_weights(weight_decay), optax.adam(learning_rate))


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
    model_kwargs: Mapping[str, Any] | None = None,
    shared: Sequence[str] | None = None,
    ks: Sequence[int] = (10, 20),
    steps_per_epoch: int | None = None,
    eval_max_users: int | None = None,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Trains one (balancer, seed) configuration with early stopping on validation NDCG@10.

    Args:
      data: preprocessed data (target first).
      balancer: a `ktx.optim` balancer, or None for the plain summed-loss step.
      seed: seeds initialization, dropout and the negatives.
      max_epochs, patience, eval_every: early stopping (patience counts evaluations).
      batch_size, num_negatives, learning_rate, weight_decay: the paper's 256, 1e-3, 1e-7.
      model_kwargs: extra `RecsysModel` arguments (embed_dim, mlp_dims, ...).
      shared: balanced parameters (default: the model's `shared_param_patterns`).
      steps_per_epoch: cap an epoch at this many steps (quick runs); None = full epoch.
      eval_max_users: rank only the first this-many users' held-out items (quick runs).
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
    from ktx.trainer import Trainer

    model = build_model(data, **dict(model_kwargs or {}))
    train_input = RecsysTrainInput(
        data, batch_size=batch_size, num_negatives=num_negatives, seed=seed
    )
    n_steps = train_input.steps_per_epoch if steps_per_epoch is None else min(
        int(steps_per_epoch), train_input.steps_per_epoch
    )
    mesh = partitioning.create_mesh(1, devices=jax.local_devices()[:1])
    trainer = Trainer(
        model,
        adam_l2(learning_rate, weight_decay),
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

    def heldout(pairs):
        if eval_max_users is None:
            return pairs
        users = np.unique(pairs[:, 0])[:eval_max_users]
        return pairs[np.isin(pairs[:, 0], users)]

    def evaluate(params, pairs):
        return full_ranking(
            model, params, num_users=data.num_users, num_items=data.num_items,
            heldout=heldout(pairs), exclude=[data.train[data.target]], ks=ks,
        )

    best = (-np.inf, -1, None)
    history, train_seconds, eval_seconds = [], [], 0.0
    since_best = 0
    epoch = 0
    for epoch in range(max_epochs):
        t0 = time.perf_counter()
        base = epoch * train_input.steps_per_epoch
        for s in range(n_steps):
            step = base + s
            state, metrics = trainer.train_step(
                state, train_input.get_batch(step), step_rng, train_input.task_counts(step)
            )
        jax.block_until_ready(state.params)
        train_seconds.append(time.perf_counter() - t0)
        if not np.isfinite(float(metrics["loss"])):
            raise FloatingPointError(f"non-finite loss {float(metrics['loss'])} at step {step}")
        if (epoch + 1) % eval_every and epoch + 1 < max_epochs:
            continue
        t1 = time.perf_counter()
        val = evaluate(state.params, data.validation)
        eval_seconds += time.perf_counter() - t1
        history.append(val["ndcg@10"])
        if log:
            log(f"epoch {epoch + 1}: loss {float(metrics['loss']):.4f} val ndcg@10 "
                f"{val['ndcg@10']:.4f} ({train_seconds[-1]:.1f}s train)")
        if val["ndcg@10"] > best[0]:
            best = (val["ndcg@10"], epoch + 1, (jax.device_get(state.params), val))
            since_best = 0
        else:
            since_best += 1
            if since_best >= patience:
                break
    best_params, best_val = best[2]
    t1 = time.perf_counter()
    test = evaluate(best_params, data.test)
    eval_seconds += time.perf_counter() - t1
    return {
        "best_epoch": best[1],
        "epochs": epoch + 1,
        "validation": best_val,
        "test": test,
        "history": history,
        "train_seconds_per_epoch": float(np.mean(train_seconds)),
        "steps_per_epoch": n_steps,
        "eval_seconds": eval_seconds,
    }
