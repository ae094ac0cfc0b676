"""CS224N multitask tasks on inline rows in the course's csv layout."""

import pytest
import seqio
from seqio import test_utils

import ktx.tasks  # noqa: F401
from ktx.data import files
from ktx.tasks import config
from tests.tasks._fixtures import formatted, root, write  # noqa: F401


def test_sst5_format(root):
    write(root, "cs224n/ids-sst-dev.csv",
          "\tid\tsentence\tsentiment\n0\tab12\t It 's a lovely film .\t3\n1\tcd34\t Dull .\t0\n")
    test_utils.assert_dataset(formatted("cs224n_sst5_v001", "validation"), [
        {"inputs": "sst5 sentence: It 's a lovely film .", "targets": "positive", "idx": 0},
        {"inputs": "sst5 sentence: Dull .", "targets": "very negative", "idx": 1}])


def test_quora_quoted_fields_and_empty_label(root):
    path = write(root, "cs224n/quora-dev.csv",
                 '\tid\tsentence1\tsentence2\tis_duplicate\n'
                 '7\tq7\tWhat is ""AI""?\t"Define AI, please"\t1.0\n'
                 '8\tq8\tA?\t"""B?"""\t\n')
    with pytest.raises(files.DataFileError, match=f"{path}:3: unknown label ''"):
        formatted("cs224n_quora_v001", "validation")
    config.set_on_bad_row("skip")
    test_utils.assert_dataset(formatted("cs224n_quora_v001", "validation"), [
        {"inputs": 'quora question1: What is ""AI""? question2: Define AI, please',
         "targets": "duplicate", "idx": 0}])


def test_sts_rounds_and_scores(root):
    write(root, "cs224n/sts-dev.csv", "\tid\tsentence1\tsentence2\tsimilarity\n"
          "1\ta\tA dog.\tA cat.\t1.1\n2\tb\tHi.\tHello.\t4.6\n3\tc\tX.\tY.\t0.0\n")
    out = list(formatted("cs224n_sts_v001", "validation").as_numpy_iterator())
    assert out[1]["inputs"] == b"sts sentence1: Hi. sentence2: Hello."
    assert [o["targets"] for o in out] == [b"1.2", b"4.6", b"0.0"]
    task = seqio.get_mixture_or_task("cs224n_sts_v001")
    targets = [task.postprocess_fn(o["targets"]) for o in out]
    scores = {}
    for fn in task.metric_fns:
        scores.update(fn(targets, targets))
    assert scores == {"pearson_corrcoef": pytest.approx(100.0),
                      "spearman_corrcoef": pytest.approx(100.0)}


def test_header_without_required_columns(root):
    path = write(root, "cs224n/sts-train.csv", "\tid\ttext\tscore\n1\ta\tb\t2\n")
    with pytest.raises(files.DataFileError, match=f"{path}:1: header .* lacks columns"):
        formatted("cs224n_sts_v001", "train")
