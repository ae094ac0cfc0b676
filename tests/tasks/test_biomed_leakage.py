"""No test-set leakage in a biomedical mixture: a task's training rows that are another
task's validation/test items (normalised question + answer, or sentence) are removed.

The inline test always runs; the real-data test checks `biomed_all` on KTX_DATA_DIR,
recomputing the overlap from the XML files independently of the readers.
"""

import logging
import unicodedata
import xml.etree.ElementTree as ET

import pytest
import seqio

from ktx.tasks import biomed
from ktx.tasks import config
from tests.tasks.test_biomed import BYTES, _answer, _mediqa, _write


def _questions(*answers_by_question):
    return _mediqa([(str(i), q, [_answer(f"{i}_A{j}", j + 1, 4 - j % 2, a) for j, a in enumerate(answers)])
                    for i, (q, answers) in enumerate(answers_by_question, start=1)])


@pytest.fixture
def two_tasks(tmp_path):
    """Ranking tasks A and B; A's train holds one of B's test answers (other case and
    spacing), B's train two of A's test answers and one of A's validation answers."""
    files = {
        "a_train": _questions(("What is gout?", ["Joint pain.", "A  DIET issue."]),
                              ("Is flu bad?", ["Sometimes."])),
        "a_val": _questions(("Is flu bad?", ["For the old."])),
        "a_test": _questions(("What causes acne?", ["Hormones.", "Bacteria."])),
        "b_train": _questions(("what causes ACNE?", ["hormones.", "Bacteria. "]),
                              ("Is flu bad?", ["For the old.", "Rarely."])),
        "b_test": _questions(("What is gout?", ["A diet issue."])),
    }
    paths = {k: _write(tmp_path / f"{k}.xml", v) for k, v in files.items()}
    names = ["ktx_test_leak_a", "ktx_test_leak_b"]
    for name in names + ["ktx_test_leakmix_ktx_test_leak_a", "ktx_test_leakmix_ktx_test_leak_b"]:
        seqio.TaskRegistry.remove(name)
    biomed.add_answer_ranking_task(names[0], "mediqa2019_qa", {
        "train": [paths["a_train"]], "validation": [paths["a_val"]], "test": [paths["a_test"]]},
        output_features=BYTES)
    biomed.add_answer_ranking_task(names[1], "trecqa2017", {
        "train": [paths["b_train"]], "test": [paths["b_test"]]}, output_features=BYTES)
    yield names
    seqio.MixtureRegistry.remove("ktx_test_leakmix")
    for name in names + ["ktx_test_leakmix_ktx_test_leak_a", "ktx_test_leakmix_ktx_test_leak_b"]:
        seqio.TaskRegistry.remove(name)


def test_mixture_removes_other_tasks_eval_items_from_training(two_tasks, caplog):
    mixture = biomed.add_decontaminated_mixture("ktx_test_leakmix", [
        "ktx_test_leak_a", "ktx_test_leak_b"])
    assert [t.name for t in mixture.tasks] == [  # <mixture>_<task without "biomed_">
        "ktx_test_leakmix_ktx_test_leak_a", "ktx_test_leakmix_ktx_test_leak_b"]
    with caplog.at_level(logging.WARNING):
        report = biomed.decontamination_report("ktx_test_leakmix")
    a, b = report["ktx_test_leakmix_ktx_test_leak_a"], report["ktx_test_leakmix_ktx_test_leak_b"]
    # A: "What is gout? / A  DIET issue." is B's test item -> 1 of 3 removed.
    assert (a.total, a.removed, a.kept) == (3, 1, 2)
    assert a.by_source == {"ktx_test_leak_b/test": 1}
    # B: the two acne answers are A's test items, "For the old." A's validation item.
    assert (b.total, b.removed, b.kept) == (4, 3, 1)
    assert b.by_source == {"ktx_test_leak_a/validation": 1, "ktx_test_leak_a/test": 2}
    assert "ktx_test_leakmix_ktx_test_leak_b/train: removed 3 of 4 rows" in caplog.text
    # The mixture's tasks read the kept rows; evaluation splits and the original tasks
    # (standalone fine-tuning) are unchanged.
    member = seqio.get_mixture_or_task("ktx_test_leakmix_ktx_test_leak_b")
    rows = member.source.rows("train")
    assert [(r["question"], r["answer"]) for r in rows] == [("Is flu bad?", "Rarely.")]
    assert member.num_input_examples("train") == 1
    assert mixture.get_rate(member) == 1.0
    assert seqio.get_mixture_or_task("ktx_test_leak_b").num_input_examples("train") == 4
    assert seqio.get_mixture_or_task("ktx_test_leakmix_ktx_test_leak_a").num_input_examples("test") == 2
    ds = member.get_dataset(sequence_length=None, split="train", shuffle=False)
    (example,) = list(ds.as_numpy_iterator())
    assert example["inputs_pretokenized"].decode() == "trecqa2017 question: Is flu bad? answer: Rarely."


def test_normalize_text():
    assert biomed.normalize_text("  What\u00a0causes\nACNE?  ") == "what causes acne?"
    assert biomed.normalize_text("ﬁne") == "fine"  # NFKC


def _norm(text):
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def _xml_items(root, relpaths):
    items = []
    for rel in relpaths:
        for q in ET.parse(root / rel).getroot().iter("Question"):
            question = q.findtext("QuestionText") or ""
            items += [(_norm(question), _norm(a.findtext("AnswerText") or "")) for a in q.iter("Answer")]
    return items


def test_biomed_all_trains_on_no_evaluation_item(data_dir):
    """On the public files the ranking tasks' train splits held 839/839 TREC test answers
    and 1,088/1,107 (distinct) MEDIQA test answers; none is left in the mixture."""
    config.set_data_dir(data_dir)
    try:
        files = {"biomed_mediqa2019_qa": biomed.BIOMED_FILES["mediqa2019_qa"],
                 "biomed_trecqa2017": biomed.BIOMED_FILES["trecqa2017"]}
        evaluation = {t: set(_xml_items(data_dir, f["validation"] + f["test"])) for t, f in files.items()}
        trec_test = set(_xml_items(data_dir, files["biomed_trecqa2017"]["test"]))
        assert len(trec_test & set(_xml_items(data_dir, files["biomed_mediqa2019_qa"]["train"]))) == 839
        for task in files:
            member = seqio.get_mixture_or_task(f"biomed_all_{task.removeprefix('biomed_')}")
            train = {(_norm(r["question"]), _norm(r["answer"])) for r in member.source.rows("train")}
            for other, items in evaluation.items():
                if other != task:
                    assert not train & items, (task, other)
        report = biomed.decontamination_report("biomed_all")
        mediqa, trec = report["biomed_all_mediqa2019_qa"], report["biomed_all_trecqa2017"]
        assert (mediqa.total, mediqa.removed, mediqa.kept) == (1701, 839, 862)
        assert mediqa.by_source["biomed_trecqa2017/test"] == 839
        assert (trec.total, trec.removed, trec.kept) == (1969, 1107, 862)
        assert trec.by_source["biomed_mediqa2019_qa/test"] == 1107
        # NER: a few section-number sentences ("1 .", "3 .") shared by the two corpora.
        assert report["biomed_all_ncbi_disease"].removed == 8
        assert report["biomed_all_bc5cdr_disease"].removed == 4
        mixture = seqio.get_mixture_or_task("biomed_all")
        assert {t.name: mixture.get_rate(t) for t in mixture.tasks} == {
            "biomed_all_ncbi_disease": 5416, "biomed_all_bc5cdr_disease": 4556,
            "biomed_all_mediqa2019_qa": 862, "biomed_all_trecqa2017": 862,
        }
    finally:
        config.set_data_dir(None)
