"""CS224N multitask data (SST-5 sentiment, Quora paraphrase, STS similarity) as T5 text tasks.

Files: `<data_dir>/cs224n/{ids-sst,quora,sts}-{train,dev}.csv` (the course project's
tab-separated, quoted layout). Formats follow the T5 GLUE style:

* `cs224n_sst5_v001`: "sst5 sentence: ..." -> "very negative" ... "very positive"; accuracy.
* `cs224n_quora_v001`: "quora question1: ... question2: ..." -> "duplicate" /
  "not_duplicate"; accuracy and F1.
* `cs224n_sts_v001`: "sts sentence1: ... sentence2: ..." -> similarity rounded to 0.2 ("3.8");
  Pearson correlation (the course's metric) and Spearman.

Encoder tasks for BERT-family models (`ktx.tasks.glue.register_encoder_task`: WordPiece
ids of the run's vocabulary, gin macro `ENCODER_VOCAB`; label a number), mixture
`cs224n_bert_v001` (examples-proportional; heads `NUM_LABELS = (5, 2, 1)`):

* `cs224n_sst5_bert_v001`: the sentence; label the class 0..4 (very negative .. very
  positive).
* `cs224n_quora_bert_v001`: question 1 and 2; label 1 = duplicate. The course's Quora
  train file is not public (the shared data has only `quora-dev.csv`), so this task
  splits `quora-dev.csv` itself, fixed: rows whose index in the file (0-based, header
  excluded) is a multiple of `QUORA_HOLDOUT_EVERY` (10) are `validation` (2,022 of
  20,214), all others `train` (18,192). Its validation scores are not comparable with
  results on the full course dev set.
* `cs224n_sts_bert_v001`: sentence 1 and 2; label the similarity in [0, 5] (regression).
"""

from __future__ import annotations

import dataclasses
import functools

import seqio

from ktx.data import encoder_features, glue_sources
from ktx.metrics import glue as glue_metrics
from ktx.tasks import glue

__all__ = ["SST5_LABELS", "QUORA_LABELS", "CS224N_TASKS", "CS224N_BERT_TASKS",
           "BERT_MIXTURE", "QUORA_HOLDOUT_EVERY", "quora_holdout_layout"]

SST5_LABELS = ("very negative", "negative", "neutral", "positive", "very positive")
QUORA_LABELS = ("not_duplicate", "duplicate")


def _register() -> tuple[str, ...]:
    layouts = glue_sources.CS224N_LAYOUTS
    glue.register_text_task(
        "cs224n_sst5_v001", layouts["sst"],
        functools.partial(glue.t5_glue_text, benchmark_name="sst5", label_names=SST5_LABELS),
        [glue_metrics.accuracy], glue_metrics.string_label_to_class_id(SST5_LABELS))
    glue.register_text_task(
        "cs224n_quora_v001", layouts["quora"],
        functools.partial(glue.t5_glue_text, benchmark_name="quora", label_names=QUORA_LABELS),
        [glue_metrics.accuracy, glue_metrics.f1_binary],
        glue_metrics.string_label_to_class_id(QUORA_LABELS))
    glue.register_text_task(
        "cs224n_sts_v001", layouts["sts"],
        functools.partial(glue.t5_stsb_text, benchmark_name="sts"),
        [glue_metrics.pearson_corrcoef, glue_metrics.spearman_corrcoef],
        glue_metrics.string_to_float)
    return ("cs224n_sst5_v001", "cs224n_quora_v001", "cs224n_sts_v001")


CS224N_TASKS = _register()


# ---------------------------------------------------------------------- encoder tasks

QUORA_HOLDOUT_EVERY = 10


class _RowsWhere:
    """A reader keeping the held-out rows of `reader` (`validation`) or the others."""

    def __init__(self, reader, validation: bool):
        self.reader, self.validation = reader, validation

    def __call__(self, path, counter):
        return [r for r in self.reader(path, counter)
                if (r["idx"] % QUORA_HOLDOUT_EVERY == 0) == self.validation]


def quora_holdout_layout() -> glue_sources.Layout:
    """`quora-dev.csv` split in two, fixed: every `QUORA_HOLDOUT_EVERY`-th row (0, 10,
    ...) is `validation`, the rest `train` (the public data has no Quora train file)."""
    quora = glue_sources.CS224N_LAYOUTS["quora"]
    dev = quora.splits["validation"]
    return dataclasses.replace(
        quora, splits={"train": dev, "validation": dev},
        split_readers={"train": _RowsWhere(quora.reader, validation=False),
                       "validation": _RowsWhere(quora.reader, validation=True)})


def _register_bert() -> tuple[str, ...]:
    layouts = glue_sources.CS224N_LAYOUTS
    LabelSpace = encoder_features.LabelSpace
    names = (glue.bert_name("cs224n", "sst5"), glue.bert_name("cs224n", "quora"),
             glue.bert_name("cs224n", "sts"))
    glue.register_encoder_task(names[0], layouts["sst"], "sentence", None,
                               LabelSpace(SST5_LABELS), [glue_metrics.accuracy])
    glue.register_encoder_task(names[1], quora_holdout_layout(), "question1", "question2",
                               LabelSpace(QUORA_LABELS),
                               [glue_metrics.accuracy, glue_metrics.f1_binary])
    glue.register_encoder_task(names[2], layouts["sts"], "sentence1", "sentence2",
                               LabelSpace.regression(0.0, 5.0),
                               [glue_metrics.pearson_corrcoef, glue_metrics.spearman_corrcoef])
    return names


CS224N_BERT_TASKS = _register_bert()
BERT_MIXTURE = "cs224n_bert_v001"
seqio.MixtureRegistry.add(BERT_MIXTURE, list(CS224N_BERT_TASKS),
                          default_rate=seqio.mixing_rate_num_examples)
