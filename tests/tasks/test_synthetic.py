"""Tests of the quickstart suite (ktx.tasks.synthetic)."""

import numpy as np
import pytest
import seqio

import ktx.tasks  # noqa: F401  (registers the tasks)
from ktx.data.pipeline import mixture_task_names
from ktx.tasks import synthetic


def test_registered_in_order_with_sizes():
    assert mixture_task_names(synthetic.MIXTURE_NAME) == synthetic.TASKS
    mixture = seqio.get_mixture_or_task(synthetic.MIXTURE_NAME)
    sizes = [synthetic.SPLIT_SIZES[t]["train"] for t in synthetic.TASKS]
    assert sizes == [20_000, 8_000, 4_000, 1_000]
    assert [mixture.get_rate(seqio.get_mixture_or_task(t)) for t in synthetic.TASKS] == sizes


@pytest.mark.parametrize("name", synthetic.TASKS)
def test_splits_deterministic_disjoint_and_short(name):
    train, validation = synthetic.generate(name, "train"), synthetic.generate(name, "validation")
    assert len(train) == synthetic.SPLIT_SIZES[name]["train"]
    assert len(validation) == synthetic.SPLIT_SIZES[name]["validation"]
    assert not {s for s, _ in train} & {s for s, _ in validation}
    synthetic.generate.cache_clear()
    assert synthetic.generate(name, "validation") == validation
    # Byte vocabulary: one token per character, plus EOS.
    assert max(len(s) for s, _ in train + validation) + 1 <= synthetic.FEATURE_LENGTHS["inputs"]
    assert max(len(t) for _, t in train + validation) + 1 <= synthetic.FEATURE_LENGTHS["targets"]


def test_targets_are_right():
    for source, target in synthetic.generate("synthetic_count_v001", "validation")[:50]:
        assert int(target) == source.removeprefix("count a: ").count("a")
    for source, target in synthetic.generate("synthetic_reverse_v001", "validation")[:50]:
        assert target == source.removeprefix("reverse: ")[::-1]
    for source, target in synthetic.generate("synthetic_keyword_v001", "validation")[:50]:
        key, words = source.removeprefix("find ").split(": ")
        assert target == ("yes" if key in words.split() else "no")
    labels = [t for _, t in synthetic.generate("synthetic_majority_v001", "train")]
    assert 0.3 < labels.count("alpha") / len(labels) < 0.7


@pytest.mark.parametrize("name", synthetic.TASKS)
def test_scoring_targets_as_predictions_is_perfect(name):
    task = seqio.get_mixture_or_task(name)
    targets = [task.postprocess_fn(t, is_target=True) if task.postprocess_fn else t
               for _, t in synthetic.generate(name, "validation")]
    scores = {}
    for fn in task.metric_fns:
        scores.update(fn(targets, targets))
    assert scores["accuracy"] == 100.0
    if "mean_abs_error" in scores:
        assert scores["mean_abs_error"] == 0.0 and scores["parsed"] == 100.0
    if "f1" in scores:
        assert scores["f1"] == 100.0


def test_metrics_hand_computed():
    assert synthetic.accuracy([1, 2, 3, 4], [1, 2, 0, 0]) == {"accuracy": 50.0}
    assert synthetic.mean_abs_error([10, 20, 30], [12, None, 27]) == {"mean_abs_error": 2.5, "parsed": pytest.approx(200 / 3)}
    # tp=1, |t|=2, |p|=2 -> F1 = 2*1/4 = 50%.
    assert synthetic.yes_f1([1, 1, 0, 0], [1, 0, 1, 0]) == {"f1": 50.0}
    assert synthetic.to_int(b"42") == 42 and synthetic.to_int("4x") is None
    assert synthetic.label_index(synthetic.YES_NO)(b"yes") == 1
    assert synthetic.label_index(synthetic.YES_NO)("maybe") == -1
    with pytest.raises(ValueError, match="task_name="):
        synthetic.generate("synthetic_nope", "train")


def test_tokenized_dataset_through_seqio():
    task = seqio.get_mixture_or_task("synthetic_majority_v001")
    ds = task.get_dataset(synthetic.FEATURE_LENGTHS, split="validation", shuffle=False)
    first = next(ds.as_numpy_iterator())
    source, target = synthetic.generate("synthetic_majority_v001", "validation")[0]
    assert first["inputs_pretokenized"].decode() == source
    np.testing.assert_array_equal(first["targets"], [ord(c) + 3 for c in target] + [1])
