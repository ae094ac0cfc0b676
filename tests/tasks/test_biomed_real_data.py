"""The registered biomedical tasks on the real files of `KTX_DATA_DIR` (skipped without it).

Counts are recomputed here independently of the readers: NER = sentences (blank-line
separated blocks) of the file; ranking = candidate answers (<Answer> elements) of the
file(s). Scoring the targets as predictions (through the T5 vocabulary: decode of the
encoded targets) must give each metric's maximum.
"""

import re
import xml.etree.ElementTree as ET

import pytest
import seqio

from ktx.tasks import biomed
from ktx.tasks import config

NER = {"biomed_ncbi_disease": "ncbi_disease", "biomed_bc5cdr_disease": "bc5cdr_disease"}
RANKING = {"biomed_mediqa2019_qa": "mediqa2019_qa", "biomed_trecqa2017": "trecqa2017"}


@pytest.fixture(scope="module")
def data(data_dir):
    config.set_data_dir(data_dir)
    yield data_dir
    config.set_data_dir(None)


def _sentences(path):
    blocks = re.split(r"\n\s*\n", path.read_text(encoding="utf-8-sig"))
    return sum(1 for b in blocks if b.strip())


def _answers(paths):
    return sum(len(re.findall(r"<Answer\s", p.read_text(encoding="utf-8"))) for p in paths)


def _targets_as_predictions(task_name, split="validation"):
    task = seqio.get_mixture_or_task(task_name)
    vocab = task.output_features["targets"].vocabulary
    ds = task.get_dataset(sequence_length=None, split=split, shuffle=False)
    targets, predictions = [], []
    for ex in ds.as_numpy_iterator():
        text = ex["targets_pretokenized"].decode()
        targets.append(task.postprocess_fn(text, example=ex, is_target=True))
        predictions.append(task.postprocess_fn(vocab.decode(ex["targets"].tolist()), example=ex, is_target=False))
    (metric_fn,) = task.metric_fns
    return len(targets), metric_fn(targets, predictions)


@pytest.mark.parametrize("task_name", sorted(NER))
def test_ner_validation_counts_and_max_scores(data, task_name):
    path = data / biomed.BIOMED_FILES[NER[task_name]]["validation"][0]
    count, scores = _targets_as_predictions(task_name)
    assert count == _sentences(path)
    assert scores == {"entity_precision": 100.0, "entity_recall": 100.0, "entity_f1": 100.0}


@pytest.mark.parametrize("task_name", sorted(RANKING))
def test_ranking_validation_counts_and_max_scores(data, task_name):
    (path,) = [data / p for p in biomed.BIOMED_FILES[RANKING[task_name]]["validation"]]
    count, scores = _targets_as_predictions(task_name)
    assert count == _answers([path])
    questions = ET.parse(path).getroot().findall("Question")
    with_correct = sum(
        any(int(a.get("ReferenceScore")) >= 3 for a in q.iter("Answer")) for q in questions
    )
    assert scores == pytest.approx(
        {"accuracy": 100.0, "precision": 100.0, "mrr": 100.0 * with_correct / len(questions)}
    )


def test_train_and_test_split_sizes_follow_the_files(data):
    for task_name, key in RANKING.items():
        task = seqio.get_mixture_or_task(task_name)
        for split, paths in biomed.BIOMED_FILES[key].items():
            assert task.num_input_examples(split) == _answers([data / p for p in paths]), (task_name, split)
    assert seqio.get_mixture_or_task("biomed_trecqa2017").num_input_examples("test") == 839
    assert seqio.get_mixture_or_task("biomed_mediqa2019_qa").num_input_examples("train") == 1701
    for task_name, key in NER.items():
        for split in ("train", "test"):
            path = data / biomed.BIOMED_FILES[key][split][0]
            assert seqio.get_mixture_or_task(task_name).num_input_examples(split) == _sentences(path)


def test_biomed_all_is_examples_proportional(data):
    # Rates: rows left after removing other tasks' evaluation items (test_biomed_leakage).
    mixture = seqio.get_mixture_or_task("biomed_all")
    rates = {t.name: mixture.get_rate(t) for t in mixture.tasks}
    assert rates == {
        "biomed_all_ncbi_disease": 5424 - 8, "biomed_all_bc5cdr_disease": 4560 - 4,
        "biomed_all_mediqa2019_qa": 1701 - 839, "biomed_all_trecqa2017": 862 + 1107 - 1107,
    }


def test_liveqa_infusion_triples_match_the_annotations(data):
    from ktx.tasks import biomed_infusion

    expected = 0
    for rel in biomed_infusion.INFUSION_FILES["liveqa"]["train"]:
        for sub in ET.parse(data / rel).getroot().iter("SUB-QUESTION"):
            expected += len(sub.findall("ANNOTATIONS/FOCUS")) * len(sub.findall("ANSWERS/ANSWER"))
    task = seqio.get_mixture_or_task("biomed_disease_infusion")
    assert task.num_input_examples("train") == expected == 638
    ex = next(task.get_dataset(sequence_length=None, split="train", shuffle=False).as_numpy_iterator())
    vocab = task.output_features["targets"].vocabulary
    assert task.postprocess_fn(vocab.decode(ex["targets"].tolist())) == {
        "aspect": "information", "disease": "cardiac amyloidosis"
    }
    assert 32099 in ex["inputs"].tolist()  # <extra_id_0> is one sentinel id of the T5 vocab
