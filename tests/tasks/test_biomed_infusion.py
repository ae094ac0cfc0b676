"""Disease knowledge infusion: formatting, LiveQA / jsonl readers, the task on tmp files."""

import json

import numpy as np
import pytest
import seqio

from ktx.data import biomed_sources as bs
from ktx.data import files
from ktx.data import vocab as vocab_lib
from ktx.tasks import biomed_infusion as inf

BYTES = {
    "inputs": seqio.Feature(vocab_lib.byte_vocabulary(), add_eos=True, required=False),
    "targets": seqio.Feature(vocab_lib.byte_vocabulary(), add_eos=True),
}

LIVEQA = """\ufeff<?xml version="1.0" encoding="UTF-8"?>
<NLM-QUESTIONS>
<NLM-QUESTION questionid="Q1">
  <SUBJECT>migraine</SUBJECT>
  <MESSAGE>How do I treat migraine?</MESSAGE>
  <SUB-QUESTIONS>
    <SUB-QUESTION subqid="Q1-S1">
      <ANNOTATIONS>
        <FOCUS>Migraine</FOCUS>
        <TYPE>Treatment</TYPE>
      </ANNOTATIONS>
      <ANSWERS>
        <ANSWER answerid="Q1-S1-A1">There is no cure for migraine.
          Migraine attacks respond to rest.</ANSWER>
        <ANSWER answerid="Q1-S1-A2">Triptans help.</ANSWER>
      </ANSWERS>
    </SUB-QUESTION>
  </SUB-QUESTIONS>
</NLM-QUESTION>
<NLM-QUESTION qid="2.0">
  <SUB-QUESTIONS>
    <SUB-QUESTION>
      <ANNOTATIONS><FOCUS>hepatitis c</FOCUS><FOCUS>vitamin E</FOCUS><TYPE>SIDE_EFFECT</TYPE></ANNOTATIONS>
      <ANSWERS><ANSWER>Vitamin E is safe in hepatitis C.</ANSWER></ANSWERS>
    </SUB-QUESTION>
  </SUB-QUESTIONS>
</NLM-QUESTION>
</NLM-QUESTIONS>
"""


def test_infusion_example_masks_question_and_disease_mentions():
    inputs, targets = inf.infusion_example(
        "Lyme disease", "Treatment", "LYME DISEASE is treated with antibiotics; lyme diseases differ."
    )
    # Whole-word, case-insensitive: "LYME DISEASE" is masked, "lyme diseases" is not.
    assert inputs == (
        "What is the <extra_id_0> of <extra_id_1>? <extra_id_1> is treated with antibiotics; "
        "lyme diseases differ."
    )
    assert targets == "<extra_id_0> treatment <extra_id_1> Lyme disease <extra_id_2>"
    assert inf.normalize_aspect(" SIDE_EFFECT ") == "side effect"
    with pytest.raises(ValueError, match="aspect is empty"):
        inf.infusion_example("flu", "  ", "text")
    with pytest.raises(ValueError, match="passage=.*T5 sentinel"):
        inf.infusion_example("flu", "cause", "see <extra_id_3>")


def test_parse_infusion_output_and_metrics():
    _, target = inf.infusion_example("Gout", "cause", "Gout is caused by uric acid.")
    gold = inf.parse_infusion_output(target)
    assert gold == {"aspect": "cause", "disease": "Gout"}
    assert inf.parse_infusion_output("<extra_id_0> cause <extra_id_1> gout") == {"aspect": "cause", "disease": "gout"}
    assert inf.parse_infusion_output("gout") == {"aspect": "", "disease": ""}
    targets = [gold, {"aspect": "symptom", "disease": "Flu"}]
    preds = [{"aspect": "cause", "disease": "gout"}, {"aspect": "treatment", "disease": "flu"}]
    assert inf.infusion_metrics(targets, preds) == pytest.approx(
        {"disease_accuracy": 100.0, "aspect_accuracy": 50.0, "exact_match": 50.0}
    )


def test_liveqa_reader_triples_per_focus_and_answer(tmp_path):
    path = tmp_path / "train.xml"
    path.write_text(LIVEQA, encoding="utf-8")
    triples = bs.read_liveqa_triples(path)
    assert [(t.disease, t.aspect, t.line) for t in triples] == [
        ("Migraine", "Treatment", 7), ("Migraine", "Treatment", 7),
        ("hepatitis c", "SIDE_EFFECT", 22), ("vitamin E", "SIDE_EFFECT", 22),
    ]
    assert triples[0].passage == "There is no cure for migraine. Migraine attacks respond to rest."


def test_liveqa_reader_bad_sub_question_and_test_layout(tmp_path):
    path = tmp_path / "bad.xml"
    path.write_text(LIVEQA.replace("<TYPE>Treatment</TYPE>", ""), encoding="utf-8")
    with pytest.raises(files.DataFileError, match=r"bad\.xml:7: sub-question needs exactly one non-empty <TYPE>"):
        bs.read_liveqa_triples(path)
    counter = files.BadRowCounter(path, "skip")
    assert len(bs.read_liveqa_triples(path, counter=counter)) == 2
    assert counter.skipped == 1
    test_layout = tmp_path / "Test.xml"
    test_layout.write_text(
        '<LiveQA2017-Medical-Test-Set-Full>\n<NLM-QUESTION qid="TQ1">\n<ANNOTATIONS/>\n'
        "</NLM-QUESTION>\n</LiveQA2017-Medical-Test-Set-Full>\n", encoding="utf-8")
    with pytest.raises(files.DataFileError, match=r"Test\.xml:2: .*only the LiveQA 2017 train files"):
        bs.read_liveqa_triples(test_layout)


def test_disease_triples_jsonl_bad_rows(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"disease": "Gout", "aspect": "cause", "passage": "Uric acid."}) + "\n"
        + json.dumps({"disease": "", "aspect": "cause", "passage": "x"}) + "\n", encoding="utf-8")
    with pytest.raises(files.DataFileError, match=r"t\.jsonl:2: 'disease' must be a non-empty string"):
        bs.read_disease_triples_jsonl(path)


@pytest.fixture
def task_name():
    name = "test_biomed_disease_infusion"
    seqio.TaskRegistry.remove(name)
    yield name
    seqio.TaskRegistry.remove(name)


def test_liveqa_infusion_task_and_evaluation(tmp_path, task_name):
    path = tmp_path / "train.xml"
    path.write_text(LIVEQA, encoding="utf-8")
    task = inf.add_disease_infusion_task(
        task_name, "liveqa", {"validation": [path]}, output_features=BYTES
    )
    ds = task.get_dataset(sequence_length=None, split="validation", shuffle=False)
    examples = list(ds.as_numpy_iterator())
    assert len(examples) == task.num_input_examples("validation") == 4
    assert examples[0]["inputs_pretokenized"].decode() == (
        "What is the <extra_id_0> of <extra_id_1>? There is no cure for <extra_id_1>. "
        "<extra_id_1> attacks respond to rest."
    )
    assert examples[2]["targets_pretokenized"].decode() == (
        "<extra_id_0> side effect <extra_id_1> hepatitis c <extra_id_2>"
    )

    vocab = task.output_features["targets"].vocabulary
    predictions = ["<extra_id_0> treatment <extra_id_1> migraine", "nothing", "<extra_id_0> side effect "
                   "<extra_id_1> hepatitis c", "<extra_id_0> cause <extra_id_1> vitamin E"]
    encoded = [list(vocab.encode(p)) + [vocab.eos_id] for p in predictions]
    width = max(map(len, encoded))
    padded = np.array([e + [0] * (width - len(e)) for e in encoded], np.int32)
    evaluator = seqio.Evaluator(task_name, seqio.EncDecFeatureConverter(pack=False), eval_split="validation")
    metrics, _ = evaluator.evaluate(
        compute_metrics=True, predict_fn=lambda ds, *a: [(int(i), padded[i]) for i, _ in ds.as_numpy_iterator()]
    )
    assert metrics.result()[task_name] == pytest.approx(
        {"disease_accuracy": 75.0, "aspect_accuracy": 50.0, "exact_match": 50.0}
    )


def test_registered_infusion_tasks():
    assert {"biomed_disease_infusion", "biomed_disease_infusion_jsonl"} <= set(seqio.TaskRegistry.names())
    assert seqio.get_mixture_or_task("biomed_disease_infusion").source.splits == ("train",)
    with pytest.raises(ValueError, match="reader='csv'; accepted"):
        inf.add_disease_infusion_task("test_never_registered", "csv")
