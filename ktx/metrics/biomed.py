"""Metrics of the biomedical tasks: entity-level NER scores and answer-ranking scores.

NER (NCBI-disease, BC5CDR-disease) is scored at the entity level: a predicted entity counts
only if it matches a gold entity exactly (same span, or same mention string for text-to-text
outputs). Counts are micro-averaged over the corpus, per sentence as multisets.

Answer ranking (MEDIQA-2019 task 3, TREC LiveQA-Med 2017 as TRECQA-2017) follows the
official MEDIQA-2019 evaluator (Ben Abacha et al., 2019) that the disease-knowledge paper
(He et al., 2020, "Infusing Disease Knowledge into BERT for Health Question Answering,
Medical Inference and Disease Name Recognition", EMNLP) reports: answers with
ReferenceScore 3 or 4 are correct; a system ranks each question's answers by its predicted
score and labels an answer correct when that score exceeds a threshold (see
`answer_ranking_metrics` for what the official script's MRR counts).

All values are percentages (0-100), as T5 reports its metrics.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "MENTION_SEPARATOR",
    "NLI_LABELS",
    "NO_MENTION",
    "CORRECT_MIN_REFERENCE_SCORE",
    "iob_to_spans",
    "iob_mentions",
    "format_mentions",
    "parse_mentions",
    "entity_prf",
    "entity_prf_iob",
    "ner_mention_metrics",
    "answer_ranking_metrics",
    "ranking_target_score",
    "postprocess_mentions",
    "postprocess_nli_label",
    "postprocess_ranking",
]

MENTION_SEPARATOR = " | "
NO_MENTION = "none"
# MEDIQA-2019 task 3 grades answers 1 (incorrect), 2 (related), 3 (incomplete), 4 (excellent);
# grades 3 and 4 are the "correct" answers of the official evaluator.
CORRECT_MIN_REFERENCE_SCORE = 3

_TAG = re.compile(r"^(?:O|([BI])-(.+))$")
_SPACES = re.compile(r"\s+")

# MedNLI's (and SNLI's) three gold labels; the data readers check rows against them.
NLI_LABELS = ("entailment", "neutral", "contradiction")


def iob_to_spans(tags: Sequence[str]) -> list[tuple[int, int, str]]:
    """Entities of an IOB/IOB2 tag sequence as `(start, end, type)`, end exclusive.

    Args:
      tags: [length] tags "O", "B-<type>" or "I-<type>". An "I-" tag that does not continue
        an entity of the same type starts a new one (the conlleval convention).

    Raises:
      ValueError: a tag is not of these forms (names its position and value).
    """
    spans: list[tuple[int, int, str]] = []
    start, kind = None, None
    for i, tag in enumerate(tags):
        match = _TAG.match(tag) if isinstance(tag, str) else None
        if match is None:
            raise ValueError(f"tags[{i}]={tag!r} is not an IOB tag; accepted: 'O', 'B-<type>', 'I-<type>'")
        prefix, tag_type = match.groups()
        continues = prefix == "I" and kind == tag_type
        if start is not None and not continues:
            spans.append((start, i, kind))
            start, kind = None, None
        if prefix is not None and not continues:
            start, kind = i, tag_type
    if start is not None:
        spans.append((start, len(tags), kind))
    return spans


def iob_mentions(tokens: Sequence[str], tags: Sequence[str]) -> list[str]:
    """The mention strings (tokens joined by single spaces) of the entities in `tags`."""
    if len(tokens) != len(tags):
        raise ValueError(f"{len(tokens)} tokens but {len(tags)} tags; they must be equal")
    return [" ".join(tokens[s:e]) for s, e, _ in iob_to_spans(tags)]


def _normalize(mention: str) -> str:
    return _SPACES.sub(" ", mention).strip()


def format_mentions(mentions: Sequence[str]) -> str:
    """The text-to-text target for a sentence's mentions: joined by " | ", or "none"."""
    for m in mentions:
        if MENTION_SEPARATOR.strip() in m or _normalize(m) in ("", NO_MENTION):
            raise ValueError(
                f"mention {m!r} cannot be written as a target: it is empty, {NO_MENTION!r}, or "
                f"contains the separator token {MENTION_SEPARATOR.strip()!r}"
            )
    return MENTION_SEPARATOR.join(_normalize(m) for m in mentions) if mentions else NO_MENTION


def parse_mentions(text: str) -> list[str]:
    """Inverse of `format_mentions`: generated text -> mention strings (whitespace-normalized).

    Splits on "|" whatever the spacing around it; "none" (any case) or empty text gives no
    mentions; empty pieces are ignored.
    """
    text = _normalize(text)
    if not text or text.lower() == NO_MENTION:
        return []
    pieces = [_normalize(p) for p in text.split(MENTION_SEPARATOR.strip())]
    return [p for p in pieces if p]


def _prf(true_positive: int, num_pred: int, num_gold: int) -> dict[str, float]:
    precision = true_positive / num_pred if num_pred else 0.0
    recall = true_positive / num_gold if num_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": 100 * precision, "recall": 100 * recall, "f1": 100 * f1}


def entity_prf(
    gold: Sequence[Sequence[Hashable]], pred: Sequence[Sequence[Hashable]]
) -> dict[str, float]:
    """Micro entity-level precision/recall/F1 (percent) over per-example entity multisets.

    Args:
      gold: [num_examples] each a sequence of gold entities (spans or mention strings).
      pred: [num_examples] predicted entities, aligned with `gold`.

    A predicted entity is a true positive when an unmatched equal gold entity of the same
    example exists (multiset intersection). With no gold and no predicted entities at all,
    precision, recall and F1 are 100 (nothing to find, nothing wrongly found).
    """
    if len(gold) != len(pred):
        raise ValueError(f"len(gold)={len(gold)} != len(pred)={len(pred)}; they must be aligned")
    tp = num_gold = num_pred = 0
    for g, p in zip(gold, pred):
        g_count, p_count = collections.Counter(g), collections.Counter(p)
        tp += sum((g_count & p_count).values())
        num_gold += sum(g_count.values())
        num_pred += sum(p_count.values())
    if num_gold == 0 and num_pred == 0:
        return {"precision": 100.0, "recall": 100.0, "f1": 100.0}
    return _prf(tp, num_pred, num_gold)


def entity_prf_iob(
    gold_tags: Sequence[Sequence[str]], pred_tags: Sequence[Sequence[str]]
) -> dict[str, float]:
    """Entity-level micro P/R/F1 (percent) of predicted IOB tag sequences: `seqeval`'s
    conlleval-compatible scores (an "I-" that does not continue an entity of its type
    starts one). With no gold and no predicted entity at all the scores are 100."""
    if len(gold_tags) != len(pred_tags):
        raise ValueError(f"{len(gold_tags)} gold sentences but {len(pred_tags)} predicted")
    for i, (g, p) in enumerate(zip(gold_tags, pred_tags)):
        if len(g) != len(p):
            raise ValueError(f"sentence {i}: {len(g)} gold tags but {len(p)} predicted tags")
        for tags in (g, p):
            iob_to_spans(tags)  # names a tag that is not O / B-<type> / I-<type>
    gold, pred = [list(g) for g in gold_tags], [list(p) for p in pred_tags]
    if not any(iob_to_spans(g) for g in gold) and not any(iob_to_spans(p) for p in pred):
        return {"precision": 100.0, "recall": 100.0, "f1": 100.0}
    from seqeval import metrics as seqeval_metrics

    return {name: 100.0 * float(fn(gold, pred, zero_division=0)) for name, fn in (
        ("precision", seqeval_metrics.precision_score), ("recall", seqeval_metrics.recall_score),
        ("f1", seqeval_metrics.f1_score))}


def ner_mention_metrics(
    targets: Sequence[Sequence[str]], predictions: Sequence[Sequence[str]]
) -> dict[str, float]:
    """SeqIO metric: entity precision/recall/F1 of postprocessed mention lists.

    Args:
      targets: [num_sentences] gold mention lists (see `parse_mentions`).
      predictions: [num_sentences] predicted mention lists.
    Mentions compare after whitespace normalization, case-sensitively.
    """
    norm = lambda seqs: [[_normalize(m) for m in ms] for ms in seqs]  # noqa: E731
    scores = entity_prf(norm(targets), norm(predictions))
    return {f"entity_{k}": v for k, v in scores.items()}


def ranking_target_score(reference_score: int, reference_rank: int, num_answers: int) -> float:
    """The regression target of an answer: ReferenceScore - (ReferenceRank - 1) / m.

    m is the number of candidate answers of the question (He et al., 2020). Correct answers
    (score 3, 4) map into (2, 4], the others into (0, 2], and within a question the order of
    the targets is the reference order.
    """
    if num_answers < 1 or not 1 <= reference_rank <= num_answers:
        raise ValueError(
            f"reference_rank={reference_rank} must lie in [1, num_answers={num_answers}]"
        )
    return reference_score - (reference_rank - 1) / num_answers


def answer_ranking_metrics(
    targets: Sequence[Mapping[str, Any]],
    predictions: Sequence[float],
    *,
    threshold: float = float(CORRECT_MIN_REFERENCE_SCORE - 1),
) -> dict[str, float]:
    """SeqIO metric: MEDIQA-2019 task-3 accuracy, MRR and precision (percent).

    Args:
      targets: [num_answers] dicts with "question_id" (groups answers) and "correct"
        (bool: ReferenceScore >= 3); other keys are ignored.
      predictions: [num_answers] predicted scores; NaN counts as the lowest score.
      threshold: an answer is predicted correct when its score is > threshold. The default 2
        separates the targets of `ranking_target_score` exactly (correct ones lie above 2).

    The system's submission, as the official evaluator reads it: per question, the answers
    ranked by predicted score, descending (ties keep input order), each labelled 1 when its
    score is above `threshold`.

    accuracy: share of answers whose predicted label equals the gold label.
    precision: gold-correct among predicted-correct answers (0 when none is predicted correct).
    MRR, exactly as the official script (`Eval_Scripts/mediqa2019_evaluator_allTasks_final.py`
    of github.com/abachaa/MEDIQA2019, `_evaluate_task_3`) computes it: walking each
    question's submitted answers in the system's ranking order, it adds 1/rank for the
    first answer the SYSTEM labels 1, without looking at the gold label of that answer;
    a question with no answer labelled 1 adds 0; the sum is divided by the number of
    questions of the gold file. Since one score both ranks and labels here, the first
    predicted-correct answer is the top-ranked one, so MRR is the share of questions with
    at least one answer predicted correct.
    """
    if len(targets) != len(predictions):
        raise ValueError(f"{len(targets)} targets but {len(predictions)} predictions")
    if not targets:
        raise ValueError("answer_ranking_metrics needs at least one answer")
    by_question: dict[Any, list[tuple[float, bool]]] = collections.defaultdict(list)
    for i, (t, p) in enumerate(zip(targets, predictions)):
        if "question_id" not in t or "correct" not in t:
            raise ValueError(f"targets[{i}]={t!r} lacks 'question_id' or 'correct'")
        score = float(p)
        by_question[t["question_id"]].append((-math.inf if math.isnan(score) else score, bool(t["correct"])))
    agree = predicted_positive = true_positive = 0
    reciprocal_ranks = []
    for answers in by_question.values():
        ranked = sorted(answers, key=lambda a: -a[0])  # stable: ties keep input order
        rr = 0.0
        for rank, (score, correct) in enumerate(ranked, start=1):
            positive = score > threshold
            agree += positive == correct
            predicted_positive += positive
            true_positive += positive and correct
            if positive and not rr:  # the official script: the gold label is not consulted
                rr = 1.0 / rank
        reciprocal_ranks.append(rr)
    return {
        "accuracy": 100 * agree / len(targets),
        "mrr": 100 * sum(reciprocal_ranks) / len(reciprocal_ranks),
        "precision": 100 * true_positive / predicted_positive if predicted_positive else 0.0,
    }


# ----------------------------------------------------------------------------- postprocessors (SeqIO)


def postprocess_mentions(output: str, example=None, is_target: bool = False) -> list[str]:
    """Generated (or target) text -> mention strings (see `parse_mentions`)."""
    del example, is_target
    return parse_mentions(output)


def postprocess_nli_label(output: str, example=None, is_target: bool = False) -> str:
    """The label name, or "invalid" for text that is no label (scored as wrong)."""
    del example, is_target
    label = output.strip()
    return label if label in NLI_LABELS else "invalid"


def _as_str(value: Any) -> str:
    if isinstance(value, np.ndarray):
        value = value.item()
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def postprocess_ranking(output: str, example=None, is_target: bool = False):
    """Targets -> {"question_id", "answer_id", "correct", "score"} from the example;
    predictions -> the float score, or -1.0 (below every target) for unparseable text."""
    if is_target:
        if example is None:
            raise ValueError("postprocess_ranking(is_target=True) needs the example (question id)")
        return {
            "question_id": _as_str(example["question_id"]),
            "answer_id": _as_str(example["answer_id"]),
            "correct": int(example["reference_score"]) >= CORRECT_MIN_REFERENCE_SCORE,
            "score": float(output),
        }
    try:
        return float(output.strip())
    except ValueError:
        return -1.0
