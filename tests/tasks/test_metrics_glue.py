"""Hand-computed checks of the GLUE / SuperGLUE metrics and postprocessors."""

import math

import numpy as np
import pytest

from ktx.metrics import glue as m


def test_accuracy_counts_invalid_predictions_as_wrong():
    assert m.accuracy([1, 0, 1, 1], [1, 1, 1, -1]) == {"accuracy": 50.0}


def test_f1_binary_hand_computed():
    # invalid -1 on a positive target becomes a false negative: tp=1, fp=1, fn=2.
    out = m.f1_binary([1, 1, 0, 0, 1], [1, 0, 1, 0, -1])
    assert out["f1"] == pytest.approx(100 * 2 / 5)


def test_matthews_hand_computed_and_degenerate():
    # tp=1, fn=1, tn=2, fp=0 -> (1*2 - 0) / sqrt(1*2*2*3)
    out = m.matthews_corrcoef([1, 1, 0, 0], [1, 0, 0, 0])
    assert out["matthews_corrcoef"] == pytest.approx(100 * 2 / math.sqrt(12))
    assert m.matthews_corrcoef([1, 0], [1, 1])["matthews_corrcoef"] == 0.0
    assert m.matthews_corrcoef([1, 0, 1], [1, 0, 1])["matthews_corrcoef"] == pytest.approx(100)


def test_matthews_keeps_invalid_predictions_as_their_own_class():
    """T5: `string_label_to_class_id` gives -1 for unknown text and sklearn's
    matthews_corrcoef counts -1 as a third class (hand-computed, multiclass form)."""
    # s=4, correct c=2; true counts (class -1, 0, 1) = (0, 2, 2), predicted = (2, 1, 1).
    # cov = c s - t.p = 8 - (0 + 2 + 2) = 4; s^2 - p.p = 16 - 6 = 10; s^2 - t.t = 16 - 8 = 8.
    out = m.matthews_corrcoef([1, 1, 0, 0], [1, -1, 0, -1])
    assert out["matthews_corrcoef"] == pytest.approx(100 * 4 / math.sqrt(80))  # 44.72
    # Mapping -1 to the wrong real class instead (1 - target) would give preds [1, 0, 0, 1]:
    # tp = fp = fn = tn = 1 -> MCC 0, a 44.7-point difference.
    assert m.matthews_corrcoef([1, 1, 0, 0], [1, 0, 0, 1])["matthews_corrcoef"] == 0.0
    # Through the CoLA postprocessor: "acceptable", "maybe" (-> -1), "unacceptable" x 3.
    post = m.string_label_to_class_id(("unacceptable", "acceptable"))
    preds = [post(x) for x in ("acceptable", "maybe", "unacceptable", "unacceptable", "")]
    assert preds == [1, -1, 0, 0, -1]
    # targets (1, 1, 0, 0, 0): s=5, c=3; true (-1, 0, 1) = (0, 3, 2); pred = (2, 2, 1).
    # cov = 15 - (0 + 6 + 2) = 7; s^2 - p.p = 25 - 9 = 16; s^2 - t.t = 25 - 13 = 12.
    out = m.matthews_corrcoef([1, 1, 0, 0, 0], preds)
    assert out["matthews_corrcoef"] == pytest.approx(100 * 7 / math.sqrt(16 * 12))  # 50.52
    # All predictions invalid: predicted variance 0 -> 0, as sklearn.
    assert m.matthews_corrcoef([1, 0, 1], [-1, -1, -1])["matthews_corrcoef"] == 0.0


def test_correlations_hand_computed():
    # x deviations (-1, 0, 1), y deviations (-7/3, -1/3, 8/3): r = 5 / sqrt(2 * 114 / 9)
    r = m.pearson_corrcoef([1.0, 2.0, 3.0], [2.0, 4.0, 7.0])["pearson_corrcoef"]
    assert r == pytest.approx(100 * 5 / math.sqrt(2 * 114 / 9))
    assert m.spearman_corrcoef([1.0, 2.0, 3.0], [2.0, 4.0, 7.0])["spearman_corrcoef"] == pytest.approx(100)
    assert m.spearman_corrcoef([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])["spearman_corrcoef"] == pytest.approx(-100)
    assert m.pearson_corrcoef([1.0, 2.0], [3.0, 3.0]) == {"pearson_corrcoef": 0.0}


def test_cb_macro_f1_hand_computed():
    # class 0: F1 1; class 1: tp 0 -> 0; class 2: tp 1, fp 1, fn 1 -> 0.5; mean 0.5
    out = m.mean_multiclass_f1(3)([0, 1, 2, 2], [0, 2, 2, -1])
    assert out == {"mean_3class_f1": pytest.approx(50.0)}
    with pytest.raises(ValueError, match="num_classes"):
        m.mean_multiclass_f1(1)


def test_multirc_f1a_and_exact_match():
    example = lambda p, q: {"idx/paragraph": p, "idx/question": q}  # noqa: E731
    targets = [m.multirc_postprocess("True", example(0, 0), is_target=True),
               m.multirc_postprocess("False", example(0, 0), is_target=True),
               m.multirc_postprocess("True", example(0, 1), is_target=True)]
    predictions = [m.multirc_postprocess(t) for t in ("True", "False", "maybe")]
    assert predictions[2] == {"value": -1}
    assert m.multirc_exact_match(targets, predictions) == {"exact_match": 50.0}
    # t = [1, 0, 1], p = [1, 0, invalid]: tp 1, fn 1 -> F1 2/3
    assert m.multirc_f1a(targets, predictions)["f1"] == pytest.approx(200 / 3)
    with pytest.raises(ValueError, match="group"):
        m.multirc_exact_match([{"value": 1}], [1])


def test_squad_and_record_scores():
    out = m.squad_em_f1([["The Cat", "dog"], ["big red dog"]], ["cat", "red dog!"])
    # second: precision 1, recall 2/3 -> F1 0.8
    assert out == {"em": pytest.approx(50.0), "f1": pytest.approx(90.0)}
    ex = {"answers": np.array([b"Paris", b"France"]), "idx/passage": 3, "idx/query": 7}
    target = m.record_postprocess("Paris", ex, is_target=True)
    assert target == {"value": ["Paris", "France"], "group": (3, 7)}
    # one example per gold answer: the query counts once
    out = m.record_em_f1([target, target], [m.record_postprocess("france"),
                                            m.record_postprocess("nowhere")])
    assert out == {"em": 100.0, "f1": 100.0}


def test_postprocessors_never_crash_on_unknown_text():
    post = m.string_label_to_class_id(("entailment", "not_entailment"))
    assert post("not_entailment") == 1
    assert post(b"entailment ") == 0
    assert post("neutral") == -1
    assert post("") == -1
    assert m.string_to_float("3.8") == pytest.approx(3.8)
    assert m.string_to_float("three") == -1.0
    assert m.string_to_float("nan") == -1.0
    with pytest.raises(ValueError, match="label_classes"):
        m.string_label_to_class_id([])


def test_task_and_benchmark_scores():
    mrpc = {"f1": 90.0, "accuracy": 80.0}
    stsb = {"pearson_corrcoef": 70.0, "spearman_corrcoef": 60.0}
    assert m.task_score(mrpc) == 85.0
    assert m.benchmark_score({"mrpc": mrpc, "stsb": stsb, "rte": {"accuracy": 60.0}}) == 70.0
    with pytest.raises(ValueError):
        m.benchmark_score({})


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="2 targets but 1 predictions"):
        m.accuracy([0, 1], [0])
