"""Hand-computed checks of the biomedical metrics (entity P/R/F1, MEDIQA ranking)."""

import math

import numpy as np

import pytest

from ktx.metrics import biomed as m


def test_iob_to_spans_iob2_and_conlleval_conventions():
    tags = ["O", "B-Disease", "I-Disease", "O", "I-Disease", "B-Disease", "B-Disease", "I-Chem"]
    # I- after O starts an entity; B- after B- starts a new one; I-Chem after Disease starts one.
    assert m.iob_to_spans(tags) == [
        (1, 3, "Disease"), (4, 5, "Disease"), (5, 6, "Disease"), (6, 7, "Disease"), (7, 8, "Chem")
    ]
    assert m.iob_to_spans([]) == []
    assert m.iob_to_spans(["B-Disease", "I-Disease"]) == [(0, 2, "Disease")]


def test_iob_to_spans_rejects_unknown_tag_naming_position():
    with pytest.raises(ValueError, match=r"tags\[1\]='X-Disease'"):
        m.iob_to_spans(["O", "X-Disease"])


def test_iob_mentions_and_length_check():
    tokens = ["Familial", "breast", "cancer", "and", "APC", "."]
    tags = ["B-Disease", "I-Disease", "I-Disease", "O", "B-Disease", "O"]
    assert m.iob_mentions(tokens, tags) == ["Familial breast cancer", "APC"]
    with pytest.raises(ValueError, match="5 tokens but 6 tags"):
        m.iob_mentions(tokens[:5], tags)


def test_format_and_parse_mentions_round_trip():
    assert m.format_mentions([]) == "none"
    text = m.format_mentions(["breast  cancer", "APC"])
    assert text == "breast cancer | APC"
    assert m.parse_mentions(text) == ["breast cancer", "APC"]
    assert m.parse_mentions("None") == []
    assert m.parse_mentions("") == []
    assert m.parse_mentions("a|b |  | c ") == ["a", "b", "c"]
    with pytest.raises(ValueError, match="separator"):
        m.format_mentions(["a | b"])
    with pytest.raises(ValueError, match="cannot be written"):
        m.format_mentions(["none"])


def test_entity_prf_multiset_micro_hand_computed():
    gold = [["a", "b", "b"], [], ["c"]]
    pred = [["a", "b", "x"], ["y"], ["c"]]
    # tp: sentence 1 -> a, b (one b) = 2; sentence 3 -> c = 1. tp=3, pred=5, gold=4.
    scores = m.entity_prf(gold, pred)
    assert scores["precision"] == pytest.approx(60.0)
    assert scores["recall"] == pytest.approx(75.0)
    assert scores["f1"] == pytest.approx(2 * 0.6 * 0.75 / 1.35 * 100)
    assert m.entity_prf([[]], [[]]) == {"precision": 100.0, "recall": 100.0, "f1": 100.0}
    assert m.entity_prf([["a"]], [[]]) == {"precision": 0.0, "recall": 0.0, "f1": 0.0}
    with pytest.raises(ValueError, match="aligned"):
        m.entity_prf([["a"]], [])


def test_entity_prf_iob_counts_boundary_errors_as_both_fp_and_fn():
    gold = [["B-Disease", "I-Disease", "O", "B-Disease"]]
    pred = [["B-Disease", "O", "O", "B-Disease"]]  # first entity truncated
    scores = m.entity_prf_iob(gold, pred)
    assert scores == pytest.approx({"precision": 50.0, "recall": 50.0, "f1": 50.0})
    with pytest.raises(ValueError, match="sentence 0"):
        m.entity_prf_iob([["O"]], [["O", "O"]])


def test_ner_mention_metrics_normalizes_whitespace():
    out = m.ner_mention_metrics([["breast cancer"], []], [["breast  cancer "], ["x"]])
    assert out == pytest.approx(
        {"entity_precision": 50.0, "entity_recall": 100.0, "entity_f1": 200 / 3}
    )


def test_ranking_target_score_formula():
    assert m.ranking_target_score(4, 1, 5) == 4.0
    assert m.ranking_target_score(3, 3, 4) == pytest.approx(2.5)
    assert m.ranking_target_score(2, 1, 3) == 2.0  # not correct: <= threshold 2
    with pytest.raises(ValueError, match="reference_rank=6"):
        m.ranking_target_score(4, 6, 5)


def _t(q, correct):
    return {"question_id": q, "correct": correct}


def test_answer_ranking_metrics_hand_computed():
    targets = [_t("q1", False), _t("q1", True), _t("q1", True), _t("q2", False), _t("q2", True),
               _t("q3", True), _t("q3", False)]
    preds = [3.5, 2.5, 1.0, 2.1, float("nan"), 1.5, 0.5]
    # q1 ranking: a1 (3.5, pred+, wrong), a2 (2.5, pred+, right), a3 (1.0, pred-, right)
    #   -> the official MRR takes the first answer the system labels 1, a1 at rank 1,
    #   although it is gold-wrong: rr = 1 (a gold-checked MRR would give 1/2).
    # q2 ranking: a4 (2.1, pred+, wrong), a5 (nan -> -inf, pred-, right) -> rr = 1.
    # q3: nothing predicted positive -> rr = 0.
    # accuracy: a2, a7 agree = 2/7; precision = 1 right of 3 predicted positive;
    # MRR = (1 + 1 + 0) / 3.
    out = m.answer_ranking_metrics(targets, preds)
    assert out == pytest.approx({"accuracy": 100 * 2 / 7, "precision": 100 / 3, "mrr": 200 / 3})


def test_answer_ranking_metrics_official_mrr_with_invalid_outputs():
    """Generated texts through the task's postprocessor: unparseable text scores -1.0."""
    from ktx.tasks import biomed

    targets = [_t("q1", True), _t("q1", False), _t("q2", False), _t("q2", True), _t("q3", True)]
    texts = ["junk", "2.9", "3.1", "", "n/a"]
    preds = [biomed.postprocess_ranking(t) for t in texts]
    assert preds == [-1.0, 2.9, 3.1, -1.0, -1.0]
    # q1: 2.9 (pred+, wrong) at rank 1, junk (-1, pred-, right) -> rr 1 (official: gold not
    # consulted); q2: 3.1 (pred+, wrong) rank 1 -> rr 1; q3: only junk -> rr 0.
    # accuracy: no label agrees -> 0; precision 0 of 2; MRR (1 + 1 + 0) / 3.
    out = m.answer_ranking_metrics(targets, preds)
    assert out == pytest.approx({"accuracy": 0.0, "precision": 0.0, "mrr": 200 / 3})


def test_answer_ranking_metrics_perfect_and_threshold():
    targets = [_t(1, True), _t(1, False), _t(2, False)]
    gold = [3.9, 1.5, 2.0]
    out = m.answer_ranking_metrics(targets, gold)
    # q2 has no correct answer and none predicted: MRR 1/2 (the official evaluator's definition).
    assert out == pytest.approx({"accuracy": 100.0, "precision": 100.0, "mrr": 50.0})
    out = m.answer_ranking_metrics(targets, gold, threshold=1.0)
    assert out["precision"] == pytest.approx(100 / 3)
    assert out["mrr"] == pytest.approx(100.0)  # q2's 2.0 is now labelled 1, at rank 1
    assert m.answer_ranking_metrics(targets, [0.0, 0.0, 0.0])["precision"] == 0.0


def test_answer_ranking_metrics_ties_keep_input_order():
    targets = [_t("q", False), _t("q", True), _t("q", True)]
    out = m.answer_ranking_metrics(targets, [1.0, 3.0, 3.0])
    assert out["mrr"] == pytest.approx(100.0)  # rank 1: the first of the two 3.0 answers
    assert out["accuracy"] == pytest.approx(100.0)
    assert not math.isnan(out["accuracy"])


def test_answer_ranking_metrics_validates_inputs():
    with pytest.raises(ValueError, match="2 targets but 1 predictions"):
        m.answer_ranking_metrics([_t(1, True), _t(1, True)], [1.0])
    with pytest.raises(ValueError, match="lacks 'question_id'"):
        m.answer_ranking_metrics([{"correct": True}], [1.0])
    with pytest.raises(ValueError, match="at least one"):
        m.answer_ranking_metrics([], [])


def test_entity_prf_iob_equals_span_counting_on_random_tags():
    """seqeval's scores equal counting the `iob_to_spans` entities (conlleval rules: an
    I- tag that does not continue an entity of its type starts one)."""
    rng = np.random.default_rng(0)
    tags = ["O", "B-Disease", "I-Disease", "B-Chemical", "I-Chemical"]
    for _ in range(20):
        n = int(rng.integers(1, 6))
        gold = [[tags[i] for i in rng.integers(0, 5, size=int(k))] for k in rng.integers(1, 12, n)]
        pred = [[tags[i] if rng.random() < 0.5 else t for i, t in zip(rng.integers(0, 5, len(g)), g)]
                for g in gold]
        want = m.entity_prf([m.iob_to_spans(g) for g in gold], [m.iob_to_spans(p) for p in pred])
        assert m.entity_prf_iob(gold, pred) == pytest.approx(want)
    with pytest.raises(ValueError, match="not an IOB tag"):
        m.entity_prf_iob([["X-Disease"]], [["O"]])
