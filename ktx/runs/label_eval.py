"""Each benchmark's own metrics for the sentence-level encoder tasks (`LabelEvaluator`).

For every classification or regression task of the input (a `LabelSpace` with class names
or a score range: GLUE's `glue_<task>_bert_v001`, CS224N's, MedNLI's) the model predicts
every row of the split: the argmax of the task's own head (the class index, the label's
numbering) or the head's score. The task's SeqIO metric functions then score the
predictions against the labels, as seqio's `Evaluator` calls them (`fn(targets,
predictions) -> {name: value}`). With GLUE's (`tasks/glue.py` `GLUE_METRICS`) that is:

- Matthews correlation for CoLA;
- F1 and accuracy for MRPC;
- Pearson and Spearman correlation for STS-B;
- accuracy for SST-2 and RTE.

The values are percentages, under T5's names. A task registered without metric functions
(e.g. `biomed_mednli_bert_v001`) reports `accuracy` (classification) or `pearson_corrcoef`
(regression) from `ktx.metrics.glue`.

Reported per task, the first metric being the task's score for early stopping and
`ktx eval`: the metrics, then `examples` (rows scored). Tagging tasks are
`ktx.runs.tag_eval.TaggingEvaluator`'s; an input with no sentence-level task is an error
naming them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import seqio

from ktx.metrics import glue as glue_metrics
from ktx.runs.eval import SplitEvaluator, _batch_and_rows
from ktx.training.summaries import MetricsWriter
from ktx.training.trainer import Trainer

__all__ = ["LabelEvaluator", "default_encoder_evaluators", "metric_fns_of", "score_predictions"]


def metric_fns_of(task_name: str, regression: bool) -> list:
    """The prediction metrics `fn(targets, predictions)` registered with SeqIO task
    `task_name`; `[accuracy]` (`[pearson_corrcoef]` for a regression) if it has none."""
    task = seqio.get_mixture_or_task(task_name)
    fns = list(getattr(task, "predict_metric_fns", None) or task.metric_fns or ())
    if not fns:
        fns = [glue_metrics.pearson_corrcoef if regression else glue_metrics.accuracy]
    return fns


def score_predictions(task_name: str, targets: np.ndarray, predictions: np.ndarray,
                      regression: bool) -> dict[str, float]:
    """`{metric: value}` of `predictions` against `targets` with the task's metrics
    (`metric_fns_of`), then `examples`."""
    if regression:
        targets, predictions = targets.astype(np.float64), predictions.astype(np.float64)
    else:
        targets, predictions = targets.astype(np.int64), predictions.astype(np.int64)
    out: dict[str, float] = {}
    for fn in metric_fns_of(task_name, regression):
        for name, value in fn(targets.tolist(), predictions.tolist()).items():
            if name in out:
                raise ValueError(f"task {task_name!r}: two metric functions report {name!r}")
            out[name] = float(value)
    out["examples"] = float(len(targets))
    return out


class LabelEvaluator(SplitEvaluator):
    """Each task's own metrics on its `split` (module docstring).

    Args (`ktx.runs.eval.SplitEvaluator`'s):
      eval_input: an input with `eval_batches(task, split, batch_size)`, `task_names` and
        `label_spaces` (`ktx.data.pipeline.MultiTaskInput`); None: the run's training input
        (`use_train_input`, called by the train loop).
      split: the split to score (labelled: `validation` for GLUE).
      batch_size: global batch size (None: the training batch size).
    """

    kind = "metrics"

    def _device_fn(self, model: Any):
        def fn(params, batch):
            return tuple(model.logits(params, batch)), batch["label"]

        return fn

    def __call__(self, *, trainer: Trainer, params: Any, step: int,
                 writer: MetricsWriter | None = None) -> dict[str, dict[str, float]]:
        self._check_ready()
        spaces = tuple(self.eval_input.label_spaces)
        names = tuple(self.eval_input.task_names)
        tasks = [(t, n, s) for t, (n, s) in enumerate(zip(names, spaces)) if not s.is_tagging]
        if not tasks:
            raise ValueError(f"LabelEvaluator: the input's tasks {list(names)} are all tagging "
                             "tasks; use TaggingEvaluator")
        results = {name: self._score(trainer, params, t, name, space)
                   for t, name, space in tasks}
        if writer is not None:
            writer.write_tasks(step, f"{self.split}_metrics", results)
        return results

    def _score(self, trainer: Trainer, params: Any, t: int, name: str,
               space: Any) -> dict[str, float]:
        targets, predictions = [], []
        for item in self.eval_input.eval_batches(name, self.split, self.batch_size):
            batch, num_real = _batch_and_rows(item)
            global_batch = trainer.global_batch(batch)
            with trainer._context():
                logits, labels = jax.device_get(self._on_mesh(trainer)(params, global_batch))
            rows = labels.shape[0] if num_real is None else num_real
            head = np.asarray(logits[t])[:rows]
            if head.ndim != 2:
                raise ValueError(f"LabelEvaluator: task {name!r}'s head gives logits of shape "
                                 f"{head.shape}; accepted: [B, n] (a sentence-level head)")
            predictions.append(head[:, 0] if space.is_regression else head.argmax(-1))
            targets.append(np.asarray(labels)[:rows])
        if not targets:
            raise ValueError(f"LabelEvaluator: task {name!r} has no {self.split!r} rows")
        return score_predictions(name, np.concatenate(targets), np.concatenate(predictions),
                                 space.is_regression)


def default_encoder_evaluators(eval_input: Any, *, split: str = "validation",
                               batch_size: int | None = None) -> list:
    """The evaluators that `eval_input`'s tasks call for (`ktx eval`'s default for encoder
    runs, gin/runs/encoder_eval.gin): `LabelEvaluator` when it has a classification or
    regression task, `TaggingEvaluator` when it has a tagging task, both for a mixture of
    the two."""
    from ktx.runs.tag_eval import TaggingEvaluator

    spaces = tuple(eval_input.label_spaces)
    out: list = []
    if any(not s.is_tagging for s in spaces):
        out.append(LabelEvaluator(eval_input, split=split, batch_size=batch_size))
    if any(s.is_tagging for s in spaces):
        out.append(TaggingEvaluator(eval_input, split=split, batch_size=batch_size))
    return out
