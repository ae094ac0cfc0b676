"""GLUE tasks in T5's text-to-text format: `glue_<task>_v002` (Raffel et al., 2020).

Inputs are "<task> <feature>: <text> ..." with the features in sorted order (e.g.
"rte sentence1: ... sentence2: ...", "mnli hypothesis: ... premise: ..."), targets are the
label names ("entailment", "not_entailment", ...), STS-B scores rounded to 0.2 and written
"%.1f" ("3.8"). Rows come from the official GLUE files under `<data_dir>/glue/` or from a
prepared TFDS copy (`ktx.tasks.config`). MNLI has `validation_matched` and
`validation_mismatched` splits, and eval-only tasks `glue_mnli_{matched,mismatched}_v002`
whose `validation` (and `test`) split is the one named. Every task has an unlabelled
`test` split (GLUE's `test.tsv`, MNLI `test_{matched,mismatched}`; targets "<unk>", `idx`
the file's index) for leaderboard files (`ktx.runs.leaderboard`), and `glue_ax_v002` is the
diagnostic (test only, MNLI's format and labels).

The text preprocessors here (`t5_glue_text`, `t5_stsb_text`) are reused by the SuperGLUE
and CS224N tasks.

Every task also has a variant without the task prefix, `glue_<task>_noprefix_v002`
("sentence1: ... sentence2: ..."; same source, targets, postprocessor and metrics), for
models that condition on the task embedding alone (HyperFormer's "no task prefix"
setting, Karimi Mahabadi et al., 2021): with no prefix the inputs carry no task identity,
only the per-row `task_id` does.

Encoder tasks `glue_<task>_bert_v001` (CoLA, SST-2, MRPC, STS-B, RTE; `GLUE_BERT_TASKS`,
mixture `glue_bert_v001`, examples-proportional) read the same files for BERT-family
encoders (`ktx.models.encoder.EncoderClassifierModel`, CA-MTL, PALs, TEA): the sentence
(pair) as WordPiece ids of the checkpoint's vocabulary (`ktx.data.wordpiece`, the gin
macro `ENCODER_VOCAB`, read at run time) and the label as a number (the class index in
`GLUE_LABELS` order, STS-B's score in [0, 5]); splits `train` and `validation`.
`ktx.data.pipeline.MultiTaskInput` turns them into `[CLS] a [SEP] b [SEP]` rows. Heads:
`NUM_LABELS = (2, 2, 2, 1, 2)` in the mixture's order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import seqio
import tensorflow as tf

from ktx.data import encoder_features, glue_sources, wordpiece
from ktx.metrics import glue as glue_metrics
from ktx.tasks import config

__all__ = [
    "GLUE_METRICS",
    "GLUE_TASKS",
    "GLUE_EVAL_ONLY_TASKS",
    "GLUE_NOPREFIX_TASKS",
    "GLUE_NOPREFIX_EVAL_ONLY_TASKS",
    "GLUE_DIAGNOSTIC_TASKS",
    "GLUE_BERT_TASKS",
    "BERT_MIXTURE",
    "bert_name",
    "register_encoder_task",
    "NOPREFIX",
    "noprefix_name",
    "t5_glue_text",
    "t5_stsb_text",
    "make_source",
    "register_text_task",
]


@seqio.map_over_dataset
def t5_glue_text(x, benchmark_name: str, label_names: Sequence[str],
                 feature_names: Sequence[str] | None = None, prefix: bool = True):
    """T5's GLUE formatting of one example.

    Args:
      x: TFDS-shaped features: text features, int `label` (-1: unlabelled), `idx`.
      benchmark_name: the input prefix, e.g. "rte".
      label_names: target string of each label id.
      feature_names: text features to join, in order; default all but label/idx, sorted.
      prefix: start the inputs with `benchmark_name` (T5); False: "<f1>: <text1> ...".

    Returns:
      {"inputs": "<benchmark> <f1>: <text1> <f2>: <text2>", "targets": label name or
      "<unk>", "idx"}; MultiRC drops <br>/<b> markup and keeps "idx/paragraph",
      "idx/question", "idx/answer" for grouping answers by question.
    """
    keys = list(feature_names or sorted(k for k in x if k not in ("label", "idx")))
    parts = [benchmark_name] if prefix else []
    for key in keys:
        parts += [f"{key}:", x[key]]
    joined = tf.strings.join(parts, separator=" ")
    label = tf.cast(x["label"], tf.int32)
    names = tf.constant(list(label_names))
    target = tf.cond(label < 0, lambda: tf.constant("<unk>"),
                     lambda: tf.gather(names, tf.maximum(label, 0)))
    ex = {}
    if benchmark_name == "multirc":
        joined = tf.strings.regex_replace(joined, "<br>", " ")
        joined = tf.strings.regex_replace(joined, "<(/)?b>", "")
        for key in ("paragraph", "question", "answer"):
            ex[f"idx/{key}"] = tf.cast(x["idx"][key], tf.int32)
    else:
        ex["idx"] = tf.cast(x["idx"], tf.int32)
    ex["inputs"] = joined
    ex["targets"] = target
    return ex


@seqio.map_over_dataset
def t5_stsb_text(x, benchmark_name: str = "stsb", prefix: bool = True):
    """STS-B as text: "stsb sentence1: ... sentence2: ..." -> round(score * 5) / 5 as "%.1f".

    `prefix=False` drops the leading `benchmark_name`.
    """
    parts = [benchmark_name] if prefix else []
    joined = tf.strings.join(
        parts + ["sentence1:", x["sentence1"], "sentence2:", x["sentence2"]], separator=" ")
    score = tf.cast(x["label"], tf.float32)
    target = tf.strings.as_string(tf.round(score * 5.0) / 5.0, precision=1)
    return {"inputs": joined, "targets": target, "idx": tf.cast(x["idx"], tf.int32)}


GLUE_METRICS = {
    "cola": [glue_metrics.matthews_corrcoef],
    "sst2": [glue_metrics.accuracy],
    "mrpc": [glue_metrics.f1_binary, glue_metrics.accuracy],
    "qqp": [glue_metrics.f1_binary, glue_metrics.accuracy],
    "stsb": [glue_metrics.pearson_corrcoef, glue_metrics.spearman_corrcoef],
    "mnli": [glue_metrics.accuracy],
    "qnli": [glue_metrics.accuracy],
    "rte": [glue_metrics.accuracy],
    "wnli": [glue_metrics.accuracy],
}

_TOKENIZE = [
    seqio.preprocessors.tokenize,
    seqio.CacheDatasetPlaceholder(),
    seqio.preprocessors.append_eos_after_trim,
]


def make_source(layout: glue_sources.Layout) -> glue_sources.OfficialFilesSource:
    """A source over `layout` that resolves its folders through `ktx.tasks.config`."""
    return glue_sources.OfficialFilesSource(
        layout, config.get_data_dir, config.get_tfds_data_dir, config.get_on_bad_row)


def register_text_task(name: str, layout: glue_sources.Layout, text_preprocessor,
                       metric_fns, postprocess_fn) -> seqio.Task:
    """Registers a T5-style text-to-text task over official files (tokenize, cache, EOS)."""
    return seqio.TaskRegistry.add(
        name,
        source=make_source(layout),
        preprocessors=[text_preprocessor, *_TOKENIZE],
        output_features=config.t5_output_features(),
        postprocess_fn=postprocess_fn,
        metric_fns=list(metric_fns),
    )


NOPREFIX = "noprefix"


def noprefix_name(name: str) -> str:
    """"glue_rte_v002" -> "glue_rte_noprefix_v002" (the name of the no-prefix variant)."""
    head, sep, version = name.rpartition("_v")
    if not sep or not head or not version.isdigit():
        raise ValueError(f"noprefix_name(name={name!r}); accepted: a '<benchmark>_<task>_v<N>' name")
    return f"{head}_{NOPREFIX}_v{version}"


def _register(prefix: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    train_tasks, eval_only = [], []
    for task, layout in glue_sources.GLUE_LAYOUTS.items():
        if task == "stsb":
            text = functools.partial(t5_stsb_text, benchmark_name="stsb", prefix=prefix)
            post = glue_metrics.string_to_float
        else:
            labels = glue_sources.GLUE_LABELS[task]
            text = functools.partial(t5_glue_text, benchmark_name=task, label_names=labels,
                                     prefix=prefix)
            post = glue_metrics.string_label_to_class_id(labels)
        name = f"glue_{task}_v002" if prefix else noprefix_name(f"glue_{task}_v002")
        register_text_task(name, layout, text, GLUE_METRICS[task], post)
        train_tasks.append(name)
        if task == "mnli":
            for which in ("matched", "mismatched"):
                split = f"validation_{which}"
                test = f"test_{which}"
                eval_layout = dataclasses.replace(
                    layout, splits={"validation": layout.splits[split],
                                    "test": layout.splits[test]},
                    tfds_splits={"validation": split, "test": test},
                    split_readers={"test": layout.reader_for(test)})
                eval_name = f"glue_mnli_{which}_v002"
                eval_name = eval_name if prefix else noprefix_name(eval_name)
                register_text_task(eval_name, eval_layout, text, GLUE_METRICS[task], post)
                eval_only.append(eval_name)
    return tuple(train_tasks), tuple(eval_only)


def _register_ax(prefix: bool) -> str:
    """GLUE's diagnostic `glue_ax_v002` (split "test" only): MNLI's format and labels,
    predicted by an MNLI model for the leaderboard's AX.tsv."""
    labels = glue_sources.GLUE_LABELS["mnli"]
    text = functools.partial(t5_glue_text, benchmark_name="mnli", label_names=labels,
                             prefix=prefix)
    name = "glue_ax_v002" if prefix else noprefix_name("glue_ax_v002")
    register_text_task(name, glue_sources.GLUE_AX_LAYOUT, text, GLUE_METRICS["mnli"],
                       glue_metrics.string_label_to_class_id(labels))
    return name


GLUE_TASKS, GLUE_EVAL_ONLY_TASKS = _register(prefix=True)
GLUE_NOPREFIX_TASKS, GLUE_NOPREFIX_EVAL_ONLY_TASKS = _register(prefix=False)
# Test-only diagnostic tasks (not in the GLUE mixtures).
GLUE_DIAGNOSTIC_TASKS = (_register_ax(prefix=True), _register_ax(prefix=False))


# ---------------------------------------------------------------------- encoder tasks


def bert_name(benchmark: str, task: str) -> str:
    """The encoder task's name: ("glue", "rte") -> "glue_rte_bert_v001"."""
    return f"{benchmark}_{task}_bert_v001"


def register_encoder_task(name: str, layout: glue_sources.Layout, first: str, second: str | None,
                          labels: encoder_features.LabelSpace, metric_fns) -> seqio.Task:
    """Registers an encoder task over official files: `text_a = row[first]`, `text_b =
    row[second]` (or empty), `label` the row's class index or score; text tokenized with
    the run's WordPiece vocabulary (`wordpiece.ENCODER_VOCABULARY`, resolved at run time).
    Only the `train` and `validation` splits (labelled)."""
    layout = dataclasses.replace(
        layout, splits={k: v for k, v in layout.splits.items() if k in ("train", "validation")},
        tfds_splits={k: v for k, v in layout.tfds_splits.items() if k in ("train", "validation")})
    return seqio.TaskRegistry.add(
        name,
        source=make_source(layout),
        preprocessors=[functools.partial(encoder_features.encoder_text, first=first, second=second),
                       encoder_features.tokenize_texts],
        output_features=encoder_features.encoder_output_features(wordpiece.ENCODER_VOCABULARY, labels),
        metric_fns=list(metric_fns),
    )


_BERT_FIELDS = {"cola": ("sentence", None), "sst2": ("sentence", None),
                "mrpc": ("sentence1", "sentence2"), "stsb": ("sentence1", "sentence2"),
                "rte": ("sentence1", "sentence2")}


def _register_bert() -> tuple[str, ...]:
    names = []
    for task, (first, second) in _BERT_FIELDS.items():
        labels = (encoder_features.LabelSpace.regression(0.0, 5.0) if task == "stsb"
                  else encoder_features.LabelSpace(glue_sources.GLUE_LABELS[task]))
        name = bert_name("glue", task)
        register_encoder_task(name, glue_sources.GLUE_LAYOUTS[task], first, second, labels,
                              GLUE_METRICS[task])
        names.append(name)
    return tuple(names)


GLUE_BERT_TASKS = _register_bert()
BERT_MIXTURE = "glue_bert_v001"
seqio.MixtureRegistry.add(BERT_MIXTURE, list(GLUE_BERT_TASKS),
                          default_rate=seqio.mixing_rate_num_examples)
