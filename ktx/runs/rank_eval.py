"""Full-ranking evaluation of recommendation runs, in the training loop and offline.

`RankingEvaluator` is an in-run evaluator for `ktx.runs.train.train` (one of its
`evaluators`, like `ktx.runs.eval.DecodeEvaluator` for T5 runs): at every
evaluation step it ranks all items for the users of one held-out split
(`ktx.metrics.ranking.full_ranking`, the model's target tower), writes the metrics to
`metrics.jsonl`/TensorBoard under the split `<split>_ranking`, and returns them as
`{target_behaviour: {"ndcg@10": ..., ...}}`, which early stopping reads.

`evaluate` is `ktx eval` for such runs: it restores every selected checkpoint of
`MODEL_DIR`, ranks validation and test, writes `<MODEL_DIR>/eval/metrics.jsonl`, and
reports the test metrics at the checkpoint with the best validation NDCG@10 (the
paper's protocol, He et al., 2022).

    ktx eval --gin_file=experiments/recsys/metabalance.gin \\
      --gin_file=runs/recsys_eval.gin --gin.MODEL_DIR="'/tmp/mb'"
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from ktx import partitioning
from ktx.training.checkpoints import restore_params_skipping_corrupt
from ktx.data.recsys import MultiBehaviorData, subsample_users, training_exclusions
from ktx.runs.eval import EvalSummary, abstract_params_for, select_checkpoint_steps
from ktx.runs.eval_progress import EvalProgress
from ktx.metrics.ranking import full_ranking
from ktx.models.base import BaseModel
from ktx.runs.run_dir import RunDir
from ktx.training.summaries import MetricsWriter
from ktx.training.trainer import Trainer

__all__ = ["RankingEvaluator", "evaluate"]

SPLITS = ("validation", "test")


class RankingEvaluator:
    """Ranks every item for the users of `split` (a `ktx.runs.eval.Evaluator`:
    `__call__(trainer=, params=, step=, writer=) -> {target: {metric: value}}`).

    Args:
      data: the run's `MultiBehaviorData` (held-out pairs and training pairs).
      split: "validation" or "test".
      ks: cut-offs of NDCG/Recall/Precision.
      max_users: rank a fixed random subset of this many users (None: every user with
        held-out items).
      exclude: the user's training items left out of the ranking: "all" behaviours or
        the "target"'s only (see `ktx.data.recsys.training_exclusions`).
      user_chunk, item_block: the chunking of `full_ranking` (memory and speed only;
        None: sized from the platform and its free memory).

    Users are split over the trainer's mesh (`data` and `model` axes) when one is given.
    """

    def __init__(
        self,
        data: MultiBehaviorData,
        *,
        split: str = "validation",
        ks: Sequence[int] = (10, 20),
        max_users: int | None = None,
        exclude: str = "all",
        user_chunk: int | None = None,
        item_block: int | None = None,
    ):
        if split not in SPLITS:
            raise ValueError(f"RankingEvaluator.split={split!r}; accepted: {SPLITS}")
        self.data = data
        self.split = split
        self.ks = tuple(ks)
        self.heldout = subsample_users(getattr(data, split), max_users)
        self.exclude = training_exclusions(data, exclude)
        self.user_chunk, self.item_block = user_chunk, item_block
        self.title = "evaluation"

    def rank(self, model: Any, params: Any, mesh: Any = None, *,
             step: int | None = None) -> dict[str, float]:
        """Mean metrics of `model` (a `ktx.metrics.ranking.RankingScorer`) at `params`,
        the users split over `mesh` (a `jax.sharding.Mesh`; None: one device). A ranking
        that runs over 30 s prints progress lines (`ktx.runs.eval_progress`)."""
        for name in ("rank_user_part", "rank_item_part", "rank_scores"):
            if not hasattr(model, name):
                raise TypeError(
                    f"RankingEvaluator: {type(model).__name__} has no {name}; full ranking needs "
                    "a model with the scorer protocol of ktx.metrics.ranking"
                )
        if getattr(model, "num_users", self.data.num_users) != self.data.num_users or getattr(
            model, "num_items", self.data.num_items
        ) != self.data.num_items:
            raise ValueError(
                f"the model has {model.num_users} users x {model.num_items} items but the data "
                f"{self.data.num_users} x {self.data.num_items}; set NUM_USERS / NUM_ITEMS"
            )
        users = len(np.unique(np.asarray(self.heldout).reshape(-1, 2)[:, 0]))
        if mesh is not None and jax.process_count() > 1:  # this process's devices' share
            users = -(-users * len(jax.local_devices()) // max(mesh.devices.size, 1))
        progress = EvalProgress(f"ranking {self.split}" + (f" at step {step}" if step is not None
                                                           else ""), users, "users")
        return full_ranking(
            model, params, num_users=self.data.num_users, num_items=self.data.num_items,
            heldout=self.heldout, exclude=self.exclude, ks=self.ks,
            user_chunk=self.user_chunk, item_block=self.item_block, mesh=mesh,
            progress=progress.add,
        )

    def __call__(self, *, trainer: Trainer, params: Any, step: int,
                 writer: MetricsWriter | None = None) -> dict[str, dict[str, float]]:
        results = {self.data.target: self.rank(trainer.model, params, trainer.mesh, step=step)}
        if writer is not None:
            writer.write_tasks(step, f"{self.split}_ranking", results)
        return results


def evaluate(
    *,
    model: BaseModel,
    model_dir: str | os.PathLike,
    data: MultiBehaviorData,
    checkpoint_steps: str | int | Sequence[int] = "all",
    select_metric: str = "ndcg@10",
    ks: Sequence[int] = (10, 20),
    validation_max_users: int | None = None,
    test_max_users: int | None = None,
    exclude: str = "all",
    num_partitions: int = 1,
    output_dir: str | os.PathLike | None = None,
) -> EvalSummary:
    """Ranks validation and test at every selected checkpoint of `model_dir`.

    Args:
      checkpoint_steps: "all", "latest", "best" (the step the run's early stopping
        named best), a step, or a list of steps.
      select_metric: the validation metric that picks the best checkpoint.
      validation_max_users, test_max_users: fixed random user subsets (None: all).
      output_dir: where metrics.jsonl and events go (default `<model_dir>/eval`).
    Returns:
      `EvalSummary` with `scores[step][target]` = validation `select_metric` and
      `metrics[step][target]` = every `validation/<metric>` and `test/<metric>`.
    """
    if select_metric not in {f"{m}@{k}" for m in ("ndcg", "recall", "precision") for k in ks}:
        raise ValueError(f"select_metric={select_metric!r}; accepted: ndcg/recall/precision@K for K in {tuple(ks)}")
    steps = select_checkpoint_steps(model_dir, checkpoint_steps)
    evaluators = {
        "validation": RankingEvaluator(data, split="validation", ks=ks,
                                       max_users=validation_max_users, exclude=exclude),
        "test": RankingEvaluator(data, split="test", ks=ks, max_users=test_max_users,
                                 exclude=exclude),
    }
    mesh = partitioning.create_mesh(num_partitions)
    trainer = Trainer(model, optax.identity(), mesh=mesh)
    abstract = abstract_params_for(model, trainer, 2, None)
    writer = MetricsWriter(output_dir or RunDir(model_dir).eval)
    summary = EvalSummary(metrics={}, scores={})
    target = data.target
    try:
        for step, params in restore_params_skipping_corrupt(model_dir, steps, abstract):
            row: dict[str, float] = {}
            for split, evaluator in evaluators.items():
                results = evaluator(trainer=trainer, params=params, step=step, writer=writer)
                row.update({f"{split}/{k}": v for k, v in results[target].items()})
            ordered = {f"validation/{select_metric}": row.pop(f"validation/{select_metric}"), **row}
            summary.metrics[step] = {target: ordered}
            summary.scores[step] = {target: ordered[f"validation/{select_metric}"]}
            if jax.process_index() == 0:
                print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in ordered.items()),
                      flush=True)
    finally:
        writer.close()
    best_step, _ = summary.best_per_task()[target]
    if jax.process_index() == 0:
        test = {k[5:]: v for k, v in summary.metrics[best_step][target].items() if k.startswith("test/")}
        print(f"test at the best validation {select_metric} (step {best_step}): "
              + ", ".join(f"{k} {v:.4f}" for k, v in test.items()), flush=True)
    return summary
