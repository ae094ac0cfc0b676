"""GLUE / SuperGLUE / CS224N metrics and text postprocessors, as seqio metric functions.

Metric functions follow seqio's contract `fn(targets, predictions) -> {name: value}` on
postprocessed values and report percentages (0-100) under T5's metric names, so that
scores compare with the T5 (Raffel et al., 2020), HyperFormer (Karimi Mahabadi et al.,
2021) and HyperPrompt (He et al., 2022) tables:

* accuracy; binary F1 (MRPC, QQP); Matthews correlation (CoLA; Matthews, 1975; an
  invalid prediction is a class of its own, as T5 with sklearn);
  Pearson / Spearman correlation (STS-B); CB macro-F1 over its 3 classes;
* MultiRC F1a (F1 over all answer options) and exact match (all answers of a question
  right), as SuperGLUE defines them (Wang et al., 2019);
* ReCoRD / SQuAD token F1 and exact match, maximised over the gold answers, after SQuAD
  answer normalisation (Rajpurkar et al., 2016), one score per query.

A task's score is the mean of its metrics and a benchmark's score the mean of its task
scores (`task_score`, `benchmark_score`), the averaging the HyperPrompt paper reports.

Postprocessors map generated text to labels with seqio's signature
`fn(text, example=None, is_target=False)`; text that names no label becomes -1 (or the
`default` float), which every metric counts as wrong and never crashes on.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import scipy.stats
import sklearn.metrics

__all__ = [
    "INVALID",
    "string_label_to_class_id",
    "string_to_float",
    "multirc_postprocess",
    "record_postprocess",
    "accuracy",
    "f1_binary",
    "matthews_corrcoef",
    "pearson_corrcoef",
    "spearman_corrcoef",
    "mean_multiclass_f1",
    "multirc_f1a",
    "multirc_exact_match",
    "squad_em_f1",
    "record_em_f1",
    "task_score",
    "benchmark_score",
]

INVALID = -1
MetricFn = Callable[[Sequence[Any], Sequence[Any]], dict[str, float]]


# -------------------------------------------------------------------- postprocessors


def _text(value: Any) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        return value.decode("utf-8", errors="replace")
    return str(value)


def string_label_to_class_id(
    label_classes: Sequence[str], default: int = INVALID
) -> Callable[..., int]:
    """Postprocessor: the index of the generated label name in `label_classes`, else `default`.

    Example: `string_label_to_class_id(("entailment", "not_entailment"))("not_entailment")`
    is 1; "maybe" gives -1.
    """
    if not label_classes or not all(isinstance(c, str) for c in label_classes):
        raise ValueError(f"label_classes={label_classes!r}: expected a non-empty list of str")
    index = {c: i for i, c in enumerate(label_classes)}

    def postprocess(text, example=None, is_target=False) -> int:
        del example, is_target
        return index.get(_text(text).strip(), default)

    return postprocess


def string_to_float(text, example=None, is_target=False, default: float = float(INVALID)) -> float:
    """Postprocessor: the generated number (STS-B "3.8" -> 3.8), or `default` if not one."""
    del example, is_target
    try:
        value = float(_text(text).strip())
    except ValueError:
        return default
    return value if np.isfinite(value) else default


_MULTIRC_CLASS = string_label_to_class_id(("False", "True"))


def multirc_postprocess(text, example=None, is_target=False) -> dict[str, Any]:
    """{"value": 0/1/-1} plus, for targets, the question group (paragraph, question)."""
    result = {"value": _MULTIRC_CLASS(text)}
    if is_target:
        if example is None:
            raise ValueError("multirc_postprocess(is_target=True) needs the example for its "
                             "idx/paragraph and idx/question")
        result["group"] = (int(example["idx/paragraph"]), int(example["idx/question"]))
    return result


def record_postprocess(text, example=None, is_target=False) -> dict[str, Any]:
    """Predictions: {"value": answer}; targets: {"value": [gold answers], "group": query}."""
    if not is_target:
        return {"value": _text(text).strip()}
    if example is None:
        raise ValueError("record_postprocess(is_target=True) needs the example for its answers")
    answers = [_text(a) for a in np.atleast_1d(example["answers"])]
    return {"value": answers or [_text(text)],
            "group": (int(example["idx/passage"]), int(example["idx/query"]))}


# ----------------------------------------------------------------------------- metrics


def _check(targets, predictions) -> None:
    if len(targets) != len(predictions):
        raise ValueError(f"{len(targets)} targets but {len(predictions)} predictions")
    if not len(targets):
        raise ValueError("no targets: a metric needs at least one example")


def _value(x):
    return x["value"] if isinstance(x, Mapping) else x


def _labels(values) -> np.ndarray:
    return np.asarray([_value(x) for x in values], dtype=np.int64)


def accuracy(targets: Sequence[Any], predictions: Sequence[Any]) -> dict[str, float]:
    """{"accuracy": 100 * fraction of predictions equal to their target}."""
    _check(targets, predictions)
    hits = [_value(t) == _value(p) for t, p in zip(targets, predictions)]
    return {"accuracy": 100.0 * float(np.mean(hits))}


def f1_binary(targets: Sequence[int], predictions: Sequence[int]) -> dict[str, float]:
    """{"f1": 100 * F1 of class 1} (`sklearn.metrics.f1_score`, as the T5 library scores
    MRPC and QQP); an invalid prediction counts as the wrong class."""
    _check(targets, predictions)
    t, p = _labels(targets), _labels(predictions)
    if not np.isin(t, (0, 1)).all():
        raise ValueError(f"binary targets must be 0/1, found {sorted(set(t.tolist()))}")
    p = np.where(np.isin(p, (0, 1)), p, 1 - t)
    return {"f1": 100.0 * float(sklearn.metrics.f1_score(t, p, zero_division=0))}


def matthews_corrcoef(targets: Sequence[int], predictions: Sequence[int]) -> dict[str, float]:
    """{"matthews_corrcoef": 100 * MCC} (`sklearn.metrics.matthews_corrcoef`, Gorodkin's
    multiclass form; Matthews, 1975).

    As T5 scores CoLA: its postprocessor `string_label_to_class_id` maps an invalid
    generation to -1, which sklearn treats as a class of its own (never a target), so an
    invalid prediction is not mapped to a real class. With the K x K confusion matrix,
    c = correct, s = total, t_k / p_k = true / predicted counts of class k:

        MCC = (c s - sum_k t_k p_k) / sqrt((s^2 - sum_k p_k^2) (s^2 - sum_k t_k^2))

    0 when the denominator is 0.
    """
    _check(targets, predictions)
    mcc = sklearn.metrics.matthews_corrcoef(_labels(targets), _labels(predictions))
    return {"matthews_corrcoef": 100.0 * float(mcc)}


def _correlation(name, fn, targets, predictions) -> dict[str, float]:
    _check(targets, predictions)
    t = np.asarray(targets, dtype=np.float64)
    p = np.asarray(predictions, dtype=np.float64)
    if len(t) < 2 or np.ptp(t) == 0 or np.ptp(p) == 0:
        return {name: 0.0}  # undefined for constant inputs: no linear/rank association
    return {name: 100.0 * float(fn(t, p)[0])}


def pearson_corrcoef(targets: Sequence[float], predictions: Sequence[float]) -> dict[str, float]:
    """{"pearson_corrcoef": 100 * Pearson r}; 0 if either side is constant."""
    return _correlation("pearson_corrcoef", scipy.stats.pearsonr, targets, predictions)


def spearman_corrcoef(targets: Sequence[float], predictions: Sequence[float]) -> dict[str, float]:
    """{"spearman_corrcoef": 100 * Spearman rho}; 0 if either side is constant."""
    return _correlation("spearman_corrcoef", scipy.stats.spearmanr, targets, predictions)


def mean_multiclass_f1(num_classes: int) -> MetricFn:
    """Metric {"mean_<n>class_f1": 100 * unweighted mean over classes of per-class F1}.

    CB uses n=3 (SuperGLUE macro-F1). A class absent from both targets and predictions has
    F1 0 (`sklearn.metrics.f1_score(average="macro", labels=range(n))`); an invalid
    prediction is a false negative of its target's class.
    """
    if not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes={num_classes!r}: expected an int >= 2")
    name = f"mean_{num_classes}class_f1"

    def metric(targets, predictions):
        _check(targets, predictions)
        f1 = sklearn.metrics.f1_score(_labels(targets), _labels(predictions),
                                      labels=list(range(num_classes)), average="macro",
                                      zero_division=0)
        return {name: 100.0 * float(f1)}

    return metric


def multirc_f1a(targets: Sequence[Mapping], predictions: Sequence[Any]) -> dict[str, float]:
    """{"f1": 100 * F1a}, binary F1 over all answer options (Khashabi et al., 2018)."""
    return f1_binary(targets, predictions)


def multirc_exact_match(targets: Sequence[Mapping], predictions: Sequence[Any]) -> dict[str, float]:
    """{"exact_match": 100 * fraction of questions whose answer options are all right}.

    Targets are `multirc_postprocess(..., is_target=True)` dicts with a "group".
    """
    _check(targets, predictions)
    groups: dict[Any, list[bool]] = collections.defaultdict(list)
    for t, p in zip(targets, predictions):
        if not isinstance(t, Mapping) or "group" not in t:
            raise ValueError(f"MultiRC target {t!r} has no 'group'; use multirc_postprocess")
        groups[t["group"]].append(_value(t) == _value(p))
    return {"exact_match": 100.0 * float(np.mean([all(v) for v in groups.values()]))}


def _normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, squash spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _token_f1(gold: str, prediction: str) -> float:
    g, p = _normalize_answer(gold).split(), _normalize_answer(prediction).split()
    common = collections.Counter(g) & collections.Counter(p)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def squad_em_f1(targets: Sequence[Sequence[str]], predictions: Sequence[str]) -> dict[str, float]:
    """{"em", "f1"}: 100 * mean over examples of the max over gold answers (SQuAD)."""
    _check(targets, predictions)
    em, f1 = [], []
    for golds, prediction in zip(targets, predictions):
        golds = [golds] if isinstance(golds, str) else list(golds)
        if not golds:
            raise ValueError("an example has no gold answers")
        prediction = _text(prediction)
        em.append(max(float(_normalize_answer(g) == _normalize_answer(prediction)) for g in golds))
        f1.append(max(_token_f1(g, prediction) for g in golds))
    return {"em": 100.0 * float(np.mean(em)), "f1": 100.0 * float(np.mean(f1))}


def record_em_f1(targets: Sequence[Mapping], predictions: Sequence[Any]) -> dict[str, float]:
    """ReCoRD {"em", "f1"}: SQuAD scores counting each query once (first example kept).

    Targets are `record_postprocess(..., is_target=True)` dicts; training-style data with
    one example per gold answer is de-duplicated by query, as T5 evaluates it.
    """
    _check(targets, predictions)
    seen, golds, answers = set(), [], []
    for t, p in zip(targets, predictions):
        if not isinstance(t, Mapping) or "group" not in t:
            raise ValueError(f"ReCoRD target {t!r} has no 'group'; use record_postprocess")
        if t["group"] in seen:
            continue
        seen.add(t["group"])
        golds.append(t["value"])
        answers.append(_value(p))
    return squad_em_f1(golds, answers)


# ----------------------------------------------------------------------- aggregation


def task_score(metrics: Mapping[str, float]) -> float:
    """A task's score: the mean of its metric values (e.g. MRPC (F1 + accuracy) / 2)."""
    if not metrics:
        raise ValueError("task_score(metrics={}): a task needs at least one metric")
    return float(np.mean([float(v) for v in metrics.values()]))


def benchmark_score(task_metrics: Mapping[str, Mapping[str, float]]) -> float:
    """A benchmark's score: the mean over tasks of `task_score` (HyperPrompt's average)."""
    if not task_metrics:
        raise ValueError("benchmark_score(task_metrics={}): no tasks")
    return float(np.mean([task_score(m) for m in task_metrics.values()]))
