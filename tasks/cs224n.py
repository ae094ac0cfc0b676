"""CS224N multitask data (SST-5 sentiment, Quora paraphrase, STS similarity) as T5 text tasks.

Files: `<data_dir>/cs224n/{ids-sst,quora,sts}-{train,dev}.csv` (the course project's
tab-separated, quoted layout). Formats follow the T5 GLUE style:

* `cs224n_sst5_v001`: "sst5 sentence: ..." -> "very negative" ... "very positive"; accuracy.
* `cs224n_quora_v001`: "quora question1: ... question2: ..." -> "duplicate" /
  "not_duplicate"; accuracy and F1.
* `cs224n_sts_v001`: "sts sentence1: ... sentence2: ..." -> similarity rounded to 0.2 ("3.8");
  Pearson correlation (the course's metric) and Spearman.
"""

from __future__ import annotations

import functools

from ktx.data import glue_sources
from ktx.metrics import glue as glue_metrics
from ktx.tasks import glue

__all__ = ["SST5_LABELS", "QUORA_LABELS", "CS224N_TASKS"]

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
