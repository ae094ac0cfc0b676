"""Trains one configuration of the MetaBalance recommendation study (He et al., 2022).

`run_config` is `ktx train` followed by the test ranking of `ktx eval`: it trains
`RecsysModel` on a `RecsysTrainInput` (task-partitioned or shared rows) with a given
balancer (a `ktx.optim` transformation, or None for the plain summed loss) and seed through
`ktx.runs.train.train` (the same loop, compiled step, checkpoints and metrics.jsonl; up
to `steps_per_call` scanned steps per call, sparse per-task table gradients on the
balanced path), ranks the validation users every `eval_every` epochs with a
`RankingEvaluator`, stops early when validation NDCG@10 has not improved for `patience`
evaluations, then ranks the test users with the best evaluation's checkpoint. The
result is read back from the run's metrics.jsonl.

    data = ktx.data.recsys.load_tmall_pairs()
    result = run_config(data, balancer=ktx.optim.metabalance(relax_factor=0.7), seed=0)
    result["test"]["ndcg@10"]

`study_trainer` builds a `Trainer` with the same step options (for benchmarks and tests
that drive `Trainer.train_steps` themselves).
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import optax

from ktx import partitioning
from ktx.data.recsys import MultiBehaviorData, RecsysTrainInput
from ktx.models.recsys import SPARSE_TABLE_PATTERNS, RecsysModel
from ktx.runs.eval import checkpoint_steps_of
from ktx.runs.rank_eval import RankingEvaluator
from ktx.runs.run_dir import RunDir
from ktx.runs.train import train
from ktx.training.checkpoints import restore_params
from ktx.training.summaries import read_metrics
from ktx.training.trainer import Trainer

__all__ = [
    "SPARSE_TABLES",
    "adam_l2",
    "build_model",
    "run_config",
    "study_trainer",
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


# Every embedding table of the model (the NeuMF layout's GMF tables included).
SPARSE_TABLES = SPARSE_TABLE_PATTERNS


def study_trainer(
    model: RecsysModel,
    optimizer: optax.GradientTransformation,
    balancer: Any = None,
    *,
    shared: Sequence[str] | None = None,
    sparse_tables: Sequence[str] | None = SPARSE_TABLES,
    num_partitions: int = 1,
) -> Trainer:
    """A `Trainer` with `run_config`'s step options, without the loop: `num_partitions`
    local devices on the `model` axis, the balanced parameters `shared` (default: the
    model's `shared_param_patterns`), sparse per-task table gradients on the balanced
    path, and lean metrics (no norms, no diagnostics) for its many small steps."""
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
    rows: str = "per_task",
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
    model_dir: str | os.PathLike | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Trains one (balancer, seed) configuration with `ktx train`'s loop
    (`ktx.runs.train.train`: early stopping on validation NDCG@10, a checkpoint per
    evaluation) and ranks the test users at the best validation epoch's checkpoint.

    Args:
      data: preprocessed data (target first).
      balancer: a `ktx.optim` balancer, or None for the plain summed-loss step.
      seed: seeds initialization, dropout and the negatives.
      max_epochs, patience, eval_every: early stopping (patience counts evaluations).
      batch_size, num_negatives, learning_rate, weight_decay: the paper's 256, 1e-3, 1e-7.
      rows: "per_task" (task-partitioned batches) or "shared" (every task's loss on the
        same pairs, as the authors' script; `RecsysTrainInput.rows`).
      optimizer: the optimizer after the balancer (default `adam_l2(learning_rate,
        weight_decay)`; MTAdam, itself the optimizer, takes a bare learning-rate scale).
      model_kwargs: extra `RecsysModel` arguments (embed_dim, mlp_dims, ...).
      shared: balanced parameters (default: the model's `shared_param_patterns`).
      steps_per_epoch: cap an epoch at its first this many steps (quick runs;
        `RecsysTrainInput.max_steps_per_epoch`); None = full epochs.
      eval_max_users, test_max_users: rank only this many validation / test users, a
        fixed random subset (the same for every run; quick runs); None: every user.
      exclude: which of a user's training items are left out of their ranking: "all"
        (every training interaction, auxiliary behaviours included: after leakage
        removal none of them can be a held-out target item) or "target" (the target
        behaviour's training pairs only).
      steps_per_call: training steps per compiled call (`train`'s `steps_per_call`);
        the result does not depend on it.
      sparse_tables: tables with sparse per-task gradients on the balanced path.
      num_partitions: size of the mesh's `model` axis (embedding tables are split over
        it); the rest of the devices form the `data` axis, as in `ktx train`.
      model_dir: the run directory (checkpoints, metrics.jsonl, TensorBoard; `ktx eval`
        with runs/recsys_eval.gin reads it); None: a temporary one, removed at the end.
      verbose: print the training loop's progress and evaluation lines.
    Returns:
      dict with `best_epoch`, `epochs`, `validation` and `test` metrics at the best epoch,
      `history` (per-evaluation validation NDCG@10), `train_loss` (each epoch's mean
      training objective), `train_seconds_per_epoch` (wall time of the training loop
      less the evaluations, per epoch this call trained: compilation and checkpoints
      included), `resumed_from_epoch` (0, or the epoch of the checkpoint a run
      directory given as `model_dir` resumed from),
      `steps_per_epoch`, `eval_seconds`.
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
    train_input = RecsysTrainInput(data, batch_size=batch_size, num_negatives=num_negatives,
                                   seed=seed, max_steps_per_epoch=steps_per_epoch, rows=rows)
    n_steps = train_input.steps_per_epoch
    validation = _Timed(RankingEvaluator(data, split="validation", ks=ks,
                                         max_users=eval_max_users, exclude=exclude))
    balanced = balancer is not None
    with contextlib.ExitStack() as stack:
        if model_dir is None:
            model_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="ktx-recsys-"))
        if not verbose:
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        # A run directory with checkpoints resumes from the latest (an interrupted study
        # run given the same directory): the time below is this call's epochs only.
        resumed_step = max(checkpoint_steps_of(model_dir), default=0) \
            if RunDir(model_dir).checkpoints.is_dir() else 0
        t0 = time.perf_counter()
        state = train(
            model=model, train_input=train_input, model_dir=model_dir,
            optimizer=adam_l2(learning_rate, weight_decay) if optimizer is None else optimizer,
            # The default Adam's rate is constant and known, so it is logged; a given
            # optimizer's rate is its own and is not.
            schedule=optax.constant_schedule(learning_rate) if optimizer is None else None,
            balancer=balancer, train_epochs=max_epochs, num_partitions=num_partitions,
            shared=(tuple(shared) if shared is not None else model.shared_param_patterns)
            if balanced else None,
            sparse_tables=tuple(sparse_tables) if balanced and sparse_tables else None,
            log_diagnostics=False, norm_metrics=False, seed=seed,
            log_period=n_steps, checkpoint_period=eval_every * n_steps,
            # The best evaluation is at most `patience` evaluations behind the last one.
            keep_checkpoints=patience + 1, evaluators=[validation],
            eval_period=eval_every * n_steps, early_stopping_metric="ndcg@10",
            early_stopping_patience=patience, steps_per_call=steps_per_call)
        train_seconds = time.perf_counter() - t0 - validation.seconds
        records = read_metrics(RunDir(model_dir).metrics)
        history = {r["step"]: r for r in records
                   if r["split"] == "validation_ranking" and r["task"] == data.target}
        # The loop's own early-stopping bookkeeping names the best evaluation.
        best_step = [r for r in records if r["split"] == "early_stopping"][-1]["best_step"]
        epochs = max(r["step"] for r in records if r["split"] == "train") // n_steps
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.params)
        best_params, _ = restore_params(model_dir, abstract, step=best_step)
        t1 = time.perf_counter()
        test = RankingEvaluator(data, split="test", ks=ks, max_users=test_max_users,
                                exclude=exclude).rank(
            model, best_params, partitioning.create_mesh(num_partitions))
        test_seconds = time.perf_counter() - t1
    meta = ("step", "split", "task")
    return {
        "best_epoch": best_step // n_steps,
        "epochs": epochs,
        "validation": {k: v for k, v in history[best_step].items() if k not in meta},
        "test": test,
        "history": [history[s]["ndcg@10"] for s in sorted(history)],
        "train_loss": [r["objective"] for r in records
                       if r["split"] == "train" and r["task"] == "all"],
        "train_seconds_per_epoch": train_seconds / max(epochs - resumed_step // n_steps, 1),
        "resumed_from_epoch": resumed_step // n_steps,
        "steps_per_epoch": n_steps,
        "eval_seconds": validation.seconds + test_seconds,
    }


class _Timed:
    """An evaluator that adds up the wall time of its calls (`seconds`)."""

    def __init__(self, evaluator: Any):
        self.evaluator, self.seconds = evaluator, 0.0
        self.title = getattr(evaluator, "title", "evaluation")

    def __call__(self, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.evaluator(**kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
