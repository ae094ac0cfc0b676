"""Entity-level evaluation of token-tagging tasks (`TaggingEvaluator`).

For every tagging task of the input (`LabelSpace.tagging`, e.g. the
`biomed_*_disease_bert_v001` NER tasks) the model tags each word: the argmax of its task's
tagging head at the word's first piece (the positions whose `token_labels` are not
`IGNORE_LABEL`). The words' gold and predicted BIO tags are decoded into entities as
seqeval's default mode does (`ktx.metrics.tagging`: a stray "I-" opens an entity) and
matched exactly (span and type) per sentence; precision, recall and F1 are micro-averaged
over the split (percent). Gold entities that truncation cut off, wholly or partly
(`entities_cut`, `entity_crosses_cut` of `ktx.data.encoder_features.convert_tagging`), count
as missed, so the scores are those of the full sentences.

Reported per task (first = the task's score for early stopping and `ktx eval`):
`entity_f1`, `entity_precision`, `entity_recall`, `token_accuracy` (labelled words
tagged right), `entities` (gold entities), `entities_cut` (of them, not wholly kept).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ktx.metrics import tagging as tagging_metrics
from ktx.runs.eval import SplitEvaluator, _batch_and_rows
from ktx.training.summaries import MetricsWriter
from ktx.training.trainer import Trainer

__all__ = ["TaggingEvaluator", "predict_tags"]

_HOST_FEATURES = ("token_labels", "attention_mask", "entities_cut", "entity_crosses_cut")


def _head_kinds(model: Any) -> tuple[str, ...]:
    kinds = getattr(model, "head_kinds", None)
    if kinds is None and hasattr(model, "base"):  # a wrapper (SmartModel)
        kinds = getattr(model.base, "head_kinds", None)
    if kinds is None:
        raise TypeError(f"TaggingEvaluator: {type(model).__name__} has no head_kinds; it "
                        "evaluates ktx encoder models (ktx.models.encoder) with tagging heads")
    return tuple(kinds)


def predict_tags(model: Any, params: Any, batch: Any) -> jax.Array:
    """`[B, L]` int32: each row's tag at every position, the argmax of its own task's
    tagging head (0 on rows of sequence tasks)."""
    kinds = _head_kinds(model)
    logits = model.logits(params, batch)
    task_id = jnp.asarray(batch["task_id"], jnp.int32)
    out = jnp.zeros(batch["input_ids"].shape, jnp.int32)
    for t, (kind, lg) in enumerate(zip(kinds, logits)):
        if kind == "tagging":
            out = jnp.where((task_id == t)[:, None], jnp.argmax(lg, axis=-1).astype(jnp.int32),
                            out)
    return out


class TaggingEvaluator(SplitEvaluator):
    """Entity precision / recall / F1 of every tagging task's `split` (module docstring).

    Args (`ktx.runs.eval.SplitEvaluator`'s):
      eval_input: an input with `eval_batches(task, split, batch_size)`, `task_names` and
        `label_spaces` (`ktx.data.pipeline.MultiTaskInput`); None: the run's training input
        (`use_train_input`, called by the train loop).
      split: the split to score.
      batch_size: global batch size (None: the training batch size).
    """

    kind = "entities"

    def _device_fn(self, model: Any):
        _head_kinds(model)

        def fn(params, batch):
            return predict_tags(model, params, batch), {k: batch[k] for k in _HOST_FEATURES}

        return fn

    def __call__(self, *, trainer: Trainer, params: Any, step: int,
                 writer: MetricsWriter | None = None) -> dict[str, dict[str, float]]:
        self._check_ready()
        spaces = tuple(self.eval_input.label_spaces)
        names = tuple(self.eval_input.task_names)
        tasks = [(n, s) for n, s in zip(names, spaces) if s.is_tagging]
        if not tasks:
            raise ValueError(f"TaggingEvaluator: the input's tasks {list(names)} have no "
                             "tagging task (LabelSpace.tagging); use LabelEvaluator (each task's own "
                             "metrics) or TeacherForcedEvaluator")
        results = {name: self._score(trainer, params, name, space) for name, space in tasks}
        if writer is not None:
            writer.write_tasks(step, f"{self.split}_entities", results)
        return results

    def _score(self, trainer: Trainer, params: Any, name: str, space: Any) -> dict[str, float]:
        counts = tagging_metrics.EntityCounts()
        correct = labelled = cut = 0
        tags = np.asarray(space.names, object)
        for item in self.eval_input.eval_batches(name, self.split, self.batch_size):
            batch, num_real = _batch_and_rows(item)
            if "token_labels" not in batch:
                raise ValueError(f"TaggingEvaluator: task {name!r}'s batches have no "
                                 "token_labels (not converted as a tagging task)")
            global_batch = trainer.global_batch(batch)
            with trainer._context():
                pred, host = jax.device_get(self._on_mesh(trainer)(params, global_batch))
            rows = pred.shape[0] if num_real is None else num_real
            for b in range(rows):
                m = (host["token_labels"][b] >= 0) & (host["attention_mask"][b] > 0)
                gold, guess = host["token_labels"][b][m], pred[b][m]
                correct += int((gold == guess).sum())
                labelled += int(m.sum())
                cut += int(host["entities_cut"][b])
                counts.add(tags[gold].tolist(), tags[np.clip(guess, 0, len(tags) - 1)].tolist(),
                           unmatchable_gold=int(host["entities_cut"][b]),
                           drop_last_gold=bool(host["entity_crosses_cut"][b]))
        out = tagging_metrics.entity_scores(counts)
        out["token_accuracy"] = 100.0 * correct / labelled if labelled else 0.0
        out["entities"] = float(counts.gold)
        out["entities_cut"] = float(cut)
        return out
