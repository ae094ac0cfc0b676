"""SuperGLUE tasks in T5's text-to-text format: `super_glue_<task>_v102` (Raffel et al., 2020).

* BoolQ, CB, COPA, RTE, WiC: "<task> <feature>: <text> ..." (sorted features; WiC
  "wic sentence1: ... sentence2: ... word: ...") -> label name ("True", "entailment",
  "choice2", ...).
* MultiRC: one example per answer option, "multirc question: ... answer: ... paragraph:
  ..." -> "True"/"False", with `idx/paragraph`, `idx/question` kept to group the answers of
  a question for exact match.
* ReCoRD: "record query: ... entities: e1, e2 passage: ..." (the "@highlight" markers
  turned into sentence breaks), one example per gold answer, each carrying all `answers`
  and `idx/passage`, `idx/query`; the metric scores every query once.
* WSC: T5's fixed WSC format, "wsc text: ... * noun * ... # pronoun # ..." -> "True"/"False".

Splits: train, validation, FewGLUE's train_32shot (Schick & Schuetze, 2021), and the
unlabelled test (`test.jsonl`, targets "<unk>", `idx` kept) for leaderboard files
(`ktx.runs.leaderboard`); `super_glue_{axb,axg}_v102` are the diagnostics (test only, RTE's
format and labels).

Every task also has a variant without the task prefix, `super_glue_<task>_noprefix_v102`
("premise: ... hypothesis: ...", "text: ...", "query: ..."), for conditioning on the task
embedding alone (Karimi Mahabadi et al., 2021); see `ktx.tasks.glue`.
"""

from __future__ import annotations

import functools

import seqio
import tensorflow as tf

from ktx.data import glue_sources
from ktx.metrics import glue as glue_metrics
from ktx.tasks import glue

__all__ = [
    "SUPER_GLUE_METRICS",
    "SUPER_GLUE_TASKS",
    "SUPER_GLUE_NOPREFIX_TASKS",
    "SUPER_GLUE_DIAGNOSTIC_TASKS",
    "t5_wsc_text",
    "t5_record_text",
]


def _escape_regex(text: tf.Tensor) -> tf.Tensor:
    return tf.strings.regex_replace(text, r"([\\.^$|?*+()\[\]{}])", r"\\\1")


@seqio.map_over_dataset
def t5_wsc_text(x, prefix: bool = True):
    """Marks span1 (the noun) with * and span2 (the pronoun) with #, at their word indices
    (T5's `preprocessors.wsc` over TFDS `wsc.fixed`, whose span corrections the file
    reader applies: `ktx.data.glue_sources.fix_wsc_spans`).

    "The city councilmen refused ... because they ..." with span1 "The city councilmen" at
    word 0 and span2 "they" at word 6 -> "wsc text: * The city councilmen * refused ...
    because # they # ...". `prefix=False` starts with "text:" instead of "wsc text:".
    """

    def mark(text, span, index, marker):
        pattern = tf.strings.join(
            ["^((?:\\S+\\s){", tf.strings.as_string(index), "})(", _escape_regex(span), ")"])
        return tf.strings.regex_replace(text, pattern, r"\1{0} \2 {0}".format(marker))

    index1 = tf.cast(x["span1_index"], tf.int32)
    index2 = tf.cast(x["span2_index"], tf.int32)
    with_noun = mark(x["text"], x["span1_text"], index1, "*")
    # span1's two markers are two more words before span2 when span1 comes first.
    index2 += 2 * tf.cast(index1 < index2, tf.int32)
    text = mark(with_noun, x["span2_text"], index2, "#")

    # Where T5's regex leaves the pronoun unmarked, mark it at the next word, else the
    # previous one: a pronoun starting the noun span ("* their mothers *", span2_index ==
    # span1_index, WSC val idx 95) sits one word later; one pronoun index is a word early
    # ("... want to use it ...", val idx 42, a sentence T5's `_wsc_inputs` special-cases).
    def neighbour():
        after = mark(with_noun, x["span2_text"], index2 + 1, "#")
        return tf.cond(tf.equal(after, with_noun),
                       lambda: mark(with_noun, x["span2_text"], tf.maximum(index2 - 1, 0), "#"),
                       lambda: after)

    text = tf.cond(tf.equal(text, with_noun), neighbour, lambda: text)
    label = tf.cast(x["label"], tf.int32)
    target = tf.cond(label < 0, lambda: tf.constant("<unk>"),
                     lambda: tf.gather(tf.constant(["False", "True"]), tf.maximum(label, 0)))
    head = "wsc text:" if prefix else "text:"
    return {"inputs": tf.strings.join([head, text], separator=" "), "targets": target,
            "idx": tf.cast(x["idx"], tf.int32)}


def t5_record_text(dataset: tf.data.Dataset, prefix: bool = True) -> tf.data.Dataset:
    """ReCoRD as text, one example per gold answer ("<unk>" target when there is none).

    `prefix=False` starts the inputs with "query:" instead of "record query:".
    """
    head = "record query:" if prefix else "query:"

    def per_answer(x):
        passage = tf.strings.regex_replace(x["passage"], r"(\.|\?|\!|\"|\')\n@highlight\n", r"\1 ")
        passage = tf.strings.regex_replace(passage, r"\n@highlight\n", ". ")
        inputs = tf.strings.join(
            [head, x["query"], "entities:",
             tf.strings.reduce_join(x["entities"], separator=", "), "passage:", passage],
            separator=" ")
        answers = tf.reshape(x["answers"], [-1])
        targets = tf.cond(tf.size(answers) > 0, lambda: answers, lambda: tf.constant(["<unk>"]))
        n = tf.size(targets)
        return tf.data.Dataset.from_tensor_slices({
            "inputs": tf.fill([n], inputs),
            "targets": targets,
            "answers": tf.broadcast_to(answers[None], [n, tf.size(answers)]),
            "idx/passage": tf.fill([n], tf.cast(x["idx"]["passage"], tf.int32)),
            "idx/query": tf.fill([n], tf.cast(x["idx"]["query"], tf.int32)),
        })

    return dataset.flat_map(per_answer)


SUPER_GLUE_METRICS = {
    "boolq": [glue_metrics.accuracy],
    "cb": [glue_metrics.mean_multiclass_f1(num_classes=3), glue_metrics.accuracy],
    "copa": [glue_metrics.accuracy],
    "multirc": [glue_metrics.multirc_f1a, glue_metrics.multirc_exact_match],
    "record": [glue_metrics.record_em_f1],
    "rte": [glue_metrics.accuracy],
    "wic": [glue_metrics.accuracy],
    "wsc": [glue_metrics.accuracy],
}

_FEATURE_ORDER = {"multirc": ("question", "answer", "paragraph"),
                  "wic": ("sentence1", "sentence2", "word")}


def _register(prefix: bool) -> tuple[str, ...]:
    names = []
    for task, layout in glue_sources.SUPER_GLUE_LAYOUTS.items():
        if task == "wsc":
            text = functools.partial(t5_wsc_text, prefix=prefix)
            post = glue_metrics.string_label_to_class_id(("False", "True"))
        elif task == "record":
            text = functools.partial(t5_record_text, prefix=prefix)
            post = glue_metrics.record_postprocess
        else:
            labels = glue_sources.SUPER_GLUE_LABELS[task]
            text = functools.partial(glue.t5_glue_text, benchmark_name=task, label_names=labels,
                                     feature_names=_FEATURE_ORDER.get(task), prefix=prefix)
            post = (glue_metrics.multirc_postprocess if task == "multirc"
                    else glue_metrics.string_label_to_class_id(labels))
        name = f"super_glue_{task}_v102"
        name = name if prefix else glue.noprefix_name(name)
        glue.register_text_task(name, layout, text, SUPER_GLUE_METRICS[task], post)
        names.append(name)
    return tuple(names)


def _register_ax(prefix: bool) -> tuple[str, ...]:
    """The diagnostics `super_glue_axb_v102`, `super_glue_axg_v102` (split "test" only):
    RTE's format and labels, predicted by an RTE model for the leaderboard's AX-b/AX-g."""
    labels = glue_sources.SUPER_GLUE_LABELS["rte"]
    text = functools.partial(glue.t5_glue_text, benchmark_name="rte", label_names=labels,
                             prefix=prefix)
    names = []
    for task, layout in glue_sources.SUPER_GLUE_AX_LAYOUTS.items():
        name = f"super_glue_{task}_v102"
        name = name if prefix else glue.noprefix_name(name)
        glue.register_text_task(name, layout, text, SUPER_GLUE_METRICS["rte"],
                                glue_metrics.string_label_to_class_id(labels))
        names.append(name)
    return tuple(names)


SUPER_GLUE_TASKS = _register(prefix=True)
SUPER_GLUE_NOPREFIX_TASKS = _register(prefix=False)
# Test-only diagnostic tasks (not in the SuperGLUE mixtures).
SUPER_GLUE_DIAGNOSTIC_TASKS = _register_ax(prefix=True) + _register_ax(prefix=False)
