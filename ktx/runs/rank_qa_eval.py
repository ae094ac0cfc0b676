"""Answer-ranking evaluation of encoder runs (`AnswerRankingEvaluator`).

For every answer-ranking task of the input (`ktx.tasks.biomed_pairs`: a regression head
per task whose source rows carry `question_id` and `reference_score`, e.g.
`biomed_mediqa2019_qa_bert_v001`), the model scores each (question, answer) pair with its
task's head; the answers are grouped by question, ranked by that score and labelled
correct above `threshold`, and scored as the official MEDIQA-2019 evaluator scores task 3
(`ktx.metrics.biomed.answer_ranking_metrics`: accuracy, MRR, precision, percent; gold
correct = ReferenceScore >= 3). Also reported: `spearman` (percent), the rank correlation
of the predicted scores with the regression targets over all answers, and `answers` /
`questions`.

The question of each prediction comes from the task's source rows (`source.rows(split)`),
read in the order the input gives the examples (its evaluation split is read in order,
unshuffled); a count that differs is an error, never a silent misalignment.

Reported per task (first = the task's score for early stopping and `ktx eval`):
`accuracy`, `mrr`, `precision`, `spearman`, `answers`, `questions`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats
import seqio

from ktx.metrics import biomed as biomed_metrics
from ktx.runs.eval import SplitEvaluator, _batch_and_rows
from ktx.training.summaries import MetricsWriter
from ktx.training.trainer import Trainer

__all__ = ["AnswerRankingEvaluator", "predict_scores", "answer_rows"]

_ROW_FIELDS = ("question_id", "reference_score", "score")


def predict_scores(model: Any, params: Any, batch: Any) -> jax.Array:
    """`[B]` float32: each row's score from its own task's regression head (0 on rows of
    tasks with another head)."""
    logits = model.logits(params, batch)
    task_id = jnp.asarray(batch["task_id"], jnp.int32)
    out = jnp.zeros(task_id.shape, jnp.float32)
    for t, lg in enumerate(logits):
        if lg.ndim == 2 and lg.shape[-1] == 1:
            out = jnp.where(task_id == t, lg[:, 0].astype(jnp.float32), out)
    return out


def answer_rows(task_name: str, split: str) -> tuple[dict[str, Any], ...] | None:
    """The source rows of an answer-ranking task's split (None: not a ranking task)."""
    source = seqio.get_mixture_or_task(task_name).source
    rows_fn = getattr(source, "rows", None)
    if rows_fn is None or split not in source.splits:
        return None
    rows = rows_fn(split)
    if not rows or not all(k in rows[0] for k in _ROW_FIELDS):
        return None
    return rows


class AnswerRankingEvaluator(SplitEvaluator):
    """MEDIQA-2019 accuracy / MRR / precision of every answer-ranking task's `split`
    (module docstring).

    Args (`ktx.runs.eval.SplitEvaluator`'s, and):
      threshold: an answer is predicted correct when its score is above it (default 2,
        which separates the correct answers' regression targets from the others').
    """

    kind = "answer ranking"

    def __init__(self, eval_input: Any = None, *, split: str = "validation",
                 batch_size: int | None = None,
                 threshold: float = float(biomed_metrics.CORRECT_MIN_REFERENCE_SCORE - 1)):
        super().__init__(eval_input, split=split, batch_size=batch_size)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise ValueError(f"AnswerRankingEvaluator.threshold={threshold!r}; accepted: a number")
        self.threshold = float(threshold)

    def _device_fn(self, model: Any):
        def fn(params, batch):
            return predict_scores(model, params, batch), batch["label"]

        return fn

    def __call__(self, *, trainer: Trainer, params: Any, step: int,
                 writer: MetricsWriter | None = None) -> dict[str, dict[str, float]]:
        self._check_ready()
        names = tuple(self.eval_input.task_names)
        tasks = [(n, rows) for n in names
                 if (rows := answer_rows(n, self.split)) is not None]
        if not tasks:
            raise ValueError(f"AnswerRankingEvaluator: the input's tasks {list(names)} have no "
                             f"answer-ranking task with a {self.split!r} split (source rows with "
                             f"{list(_ROW_FIELDS)}, e.g. biomed_mediqa2019_qa_bert_v001)")
        results = {name: self._score(trainer, params, name, rows) for name, rows in tasks}
        if writer is not None:
            writer.write_tasks(step, f"{self.split}_ranking", results)
        return results

    def _score(self, trainer: Trainer, params: Any, name: str, rows) -> dict[str, float]:
        scores, labels = [], []
        for item in self.eval_input.eval_batches(name, self.split, self.batch_size):
            batch, num_real = _batch_and_rows(item)
            global_batch = trainer.global_batch(batch)
            with trainer._context():
                pred, label = jax.device_get(self._on_mesh(trainer)(params, global_batch))
            n = pred.shape[0] if num_real is None else num_real
            scores.append(np.asarray(pred[:n], np.float64))
            labels.append(np.asarray(label[:n], np.float64))
        pred, label = np.concatenate(scores), np.concatenate(labels)
        if len(pred) != len(rows):
            raise ValueError(f"AnswerRankingEvaluator: task {name!r} split {self.split!r} gave "
                             f"{len(pred)} examples but its source has {len(rows)} answers; "
                             "the input must keep every answer, in the source's order")
        targets = np.asarray([r["score"] for r in rows], np.float64)
        if not np.allclose(label, targets, atol=1e-4):
            row = int(np.argmax(~np.isclose(label, targets, atol=1e-4)))
            raise ValueError(f"AnswerRankingEvaluator: task {name!r} split {self.split!r}: "
                             f"example {row}'s label {label[row]} is not its source row's "
                             f"score {targets[row]}; the input's order differs from the source's")
        gold = [{"question_id": r["question_id"],
                 "correct": r["reference_score"] >= biomed_metrics.CORRECT_MIN_REFERENCE_SCORE}
                for r in rows]
        out = biomed_metrics.answer_ranking_metrics(gold, pred.tolist(), threshold=self.threshold)
        rho = scipy.stats.spearmanr(pred, targets)[0] if len(pred) > 1 else float("nan")
        out["spearman"] = 100.0 * float(rho)
        out["answers"] = float(len(rows))
        out["questions"] = float(len({r["question_id"] for r in rows}))
        return out
