"""`ktx.metrics.tagging`: entity-level scores of BIO word tags, derived by hand (stray
"I-" tags included), cut-off entities, agreement with seqeval, and BIO label checks."""

from __future__ import annotations

import numpy as np
import pytest

from ktx.metrics import tagging


def _scores(pairs, **kwargs):
    counts = tagging.EntityCounts()
    for gold, pred in pairs:
        counts.add(gold.split(), pred.split(), **kwargs)
    return counts, tagging.entity_scores(counts)


def test_hand_derived_f1_with_stray_i_tags():
    pairs = [
        # gold: (0,2) Disease, (3,4) Disease.  pred: (0,2) right; "O I-D" at 3 is a stray
        # I- that opens an entity (3,4): right (seqeval's default / conlleval).
        ("B-D I-D O B-D O", "B-D I-D O I-D O"),
        # gold: one entity (1,3). pred: "I-D I-D" at 0-1 is one entity (0,2) (a stray I-
        # starts it, the next I- continues it), then "B-D" at 2 is (2,3): 2 wrong.
        ("O B-D I-D O", "I-D I-D B-D O"),
        # gold: (0,1) and (1,3) (B- right after B- opens a new one). pred: "B-D I-D I-D" one
        # entity (0,3): wrong; nothing right.
        ("B-D B-D I-D", "B-D I-D I-D"),
        # gold: "I-D" after "O" and after an entity of another type: (1,2) D and (3,4) D,
        # (2,3) C. pred: (1,2) D right, (2,4) C wrong ("I-C I-C" continues C; the gold's
        # I-D after B-C opens a D entity).
        ("O I-D B-C I-D", "O B-D B-C I-C"),
    ]
    counts, scores = _scores(pairs)
    # true positives: 2 + 0 + 0 + 1 = 3; predicted: 2 + 2 + 1 + 2 = 7; gold: 2 + 1 + 2 + 3 = 8
    assert (counts.true_positive, counts.predicted, counts.gold) == (3, 7, 8)
    p, r = 3 / 7, 3 / 8
    assert scores["entity_precision"] == pytest.approx(100 * p)
    assert scores["entity_recall"] == pytest.approx(100 * r)
    assert scores["entity_f1"] == pytest.approx(100 * 2 * p * r / (p + r))  # 40.0
    assert scores["entity_f1"] == pytest.approx(40.0)


def test_cut_off_entities_are_missed():
    counts = tagging.EntityCounts()
    # kept words "O B-D I-D" of a sentence whose entity (1, 4) runs past the cut, and one
    # more entity wholly cut: 2 unmatchable gold entities; the prediction (1, 3) would match
    # the kept prefix but not the real entity.
    counts.add("O B-D I-D".split(), "O B-D I-D".split(), unmatchable_gold=2,
               drop_last_gold=True)
    assert (counts.true_positive, counts.predicted, counts.gold) == (0, 1, 2)
    counts.add("B-D O".split(), "B-D O".split())
    assert (counts.true_positive, counts.predicted, counts.gold) == (1, 2, 3)
    assert tagging.entity_scores(counts)["entity_recall"] == pytest.approx(100 / 3)
    with pytest.raises(ValueError, match="no gold entity ends at the last word"):
        counts.add("B-D O".split(), "O O".split(), unmatchable_gold=1, drop_last_gold=True)
    with pytest.raises(ValueError, match="must cover the same words"):
        counts.add(["O"], ["O", "O"])


def test_no_entities_at_all_scores_100_and_none_predicted_scores_0():
    assert _scores([("O O", "O O")])[1]["entity_f1"] == 100.0
    assert _scores([("B-D O", "O O")])[1] == {"entity_f1": 0.0, "entity_precision": 0.0,
                                               "entity_recall": 0.0}


def test_agrees_with_seqeval_default_mode():
    from seqeval import metrics as seqeval_metrics

    rng = np.random.default_rng(0)
    tags = np.array(["O", "B-D", "I-D", "B-C", "I-C"])
    gold = [list(tags[rng.integers(0, 5, rng.integers(1, 12))]) for _ in range(300)]
    pred = [list(np.where(rng.random(len(g)) < 0.3, tags[rng.integers(0, 5, len(g))], g))
            for g in gold]
    counts = tagging.EntityCounts()
    for g, p in zip(gold, pred):
        counts.add(g, p)
    ours = tagging.entity_scores(counts)
    for key, fn in (("entity_precision", seqeval_metrics.precision_score),
                    ("entity_recall", seqeval_metrics.recall_score),
                    ("entity_f1", seqeval_metrics.f1_score)):
        assert ours[key] == pytest.approx(100 * fn(gold, pred))


def test_bio_label_sets_and_tag_problems():
    labels = ("O", "B-Disease", "I-Disease")
    assert tagging.check_bio_labels(labels) == labels
    assert tagging.bio_types(("O", "B-A", "I-A", "B-B", "I-B")) == ("A", "B")
    for bad, why in ((("O", "B-Disease"), r"lacks \['I-Disease'\]"),
                     (("B-D", "I-D"), "no 'O' tag"),
                     (("O", "X-D", "B-D", "I-D"), r"tags \['X-D'\] are neither"),
                     (("O", "O", "B-D", "I-D"), "repeated tags")):
        with pytest.raises(ValueError, match=why):
            tagging.check_bio_labels(bad)
    assert tagging.bio_tag_problem("B-Disease", labels) is None
    assert "not a BIO tag" in tagging.bio_tag_problem("X-Disease", labels)
    assert "entity type 'Chemical', not one of the label set's types ['Disease']" in \
        tagging.bio_tag_problem("I-Chemical", labels)
    assert "accepted: ['B-Disease', 'I-Disease', 'O']" in tagging.bio_tag_problem("b-Disease",
                                                                                    labels)
