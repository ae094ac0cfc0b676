"""Biomedical tasks on inline rows in their official formats, written to tmp_path.

Test tasks are registered over the tmp files with the byte vocabulary (no data folder
needed); the registered `biomed_*` tasks are checked for laziness and naming here and on
the real files in test_biomed_real_data.py.
"""

import json
import logging

import numpy as np
import pytest
import seqio

from ktx.data import biomed_sources as bs
from ktx.data import files
from ktx.data import vocab as vocab_lib
from ktx.tasks import biomed
from ktx.tasks import config

BYTES = {
    "inputs": seqio.Feature(vocab_lib.byte_vocabulary(), add_eos=True, required=False),
    "targets": seqio.Feature(vocab_lib.byte_vocabulary(), add_eos=True),
}

NER_TRAIN = "Familial\tB-Disease\nbreast\tI-Disease\ncancer\tI-Disease\n.\tO\n\nNo\tO\ndisease\tO\n"
NER_DEV = (
    "\ufeffAPC\tB-Disease\nand\tO\nataxia\tB-Disease\n-\tI-Disease\ntelangiectasia\tI-Disease\n\r\n"
    "Normal\tO\ncells\tO\n\n"
    "Ataxia\tB-Disease\n"
)


@pytest.fixture
def registered():
    names = []

    def add(factory, name, *args, **kwargs):
        seqio.TaskRegistry.remove(name)
        names.append(name)
        return factory(name, *args, output_features=BYTES, **kwargs)

    yield add
    for name in names:
        seqio.TaskRegistry.remove(name)


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def _examples(task, split="validation"):
    ds = task.get_dataset(sequence_length=None, split=split, shuffle=False)
    return [
        {k: (v.decode() if isinstance(v, bytes) else v) for k, v in ex.items()}
        for ex in ds.as_numpy_iterator()
    ]


def _evaluate(task_name, predictions=None, split="validation"):
    """Runs seqio's Evaluator; predictions None = the encoded targets themselves."""
    task = seqio.get_mixture_or_task(task_name)
    vocab = task.output_features["targets"].vocabulary
    evaluator = seqio.Evaluator(
        task_name, feature_converter=seqio.EncDecFeatureConverter(pack=False), eval_split=split
    )

    def predict_fn(ds, model_feature_lengths=None):
        # ds yields (example index, model features); predictions follow the file order.
        if predictions is None:
            return [(int(i), ex["decoder_target_tokens"]) for i, ex in ds.as_numpy_iterator()]
        encoded = [list(vocab.encode(p)) + [vocab.eos_id] for p in predictions]
        width = max(map(len, encoded))
        padded = np.array([e + [0] * (width - len(e)) for e in encoded], np.int32)
        return [(int(i), padded[i]) for i, _ in ds.as_numpy_iterator()]

    metrics, _ = evaluator.evaluate(compute_metrics=True, predict_fn=predict_fn, score_fn=None)
    return metrics.result()[task_name]


# ----------------------------------------------------------------------------- IOB reader


def test_iob_reader_bom_crlf_and_last_sentence(tmp_path):
    path = _write(tmp_path / "dev.tsv", NER_DEV)
    sentences = list(bs.read_iob_sentences(path))
    assert [s.line for s in sentences] == [1, 7, 10]
    assert sentences[0].tokens[0] == "APC"  # BOM stripped
    assert sentences[0].mentions == ["APC", "ataxia - telangiectasia"]
    assert sentences[1].mentions == []
    assert sentences[2].mentions == ["Ataxia"]


@pytest.mark.parametrize(
    "line, message",
    [("bad\tO\textra", "expected 2 tab-separated fields"), ("bad\tB-Chemical", "unknown tag 'B-Chemical'"),
     ("\tO", "empty token")],
)
def test_iob_reader_bad_row_names_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "x.tsv", f"ok\tO\n\nfine\tO\n{line}\nmore\tO\n")
    with pytest.raises(files.DataFileError, match=rf"x\.tsv:4: {message}"):
        list(bs.read_iob_sentences(path))


def test_iob_reader_skip_counts_and_logs(tmp_path, caplog):
    path = _write(tmp_path / "x.tsv", "a\tO\nb\tX\n\nc\tB-Disease\n\nd\n\n")
    counter = files.BadRowCounter(path, "skip")
    with caplog.at_level(logging.WARNING):
        sentences = list(bs.read_iob_sentences(path, counter=counter))
    assert [s.tokens for s in sentences] == [("c",)]
    assert counter.skipped == 2
    assert "skipped 2 bad rows" in caplog.text


# ----------------------------------------------------------------------------- NER task


def _ner_task(tmp_path, registered, name="test_biomed_ner", **kwargs):
    train = _write(tmp_path / "train.tsv", NER_TRAIN)
    dev = _write(tmp_path / "devel.tsv", NER_DEV)
    return registered(
        biomed.add_ner_task, name, "ncbi_disease", {"train": [train], "validation": [dev]}, **kwargs
    )


def test_ner_task_text_to_text_format(tmp_path, registered):
    task = _ner_task(tmp_path, registered)
    examples = _examples(task)
    assert [e["inputs_pretokenized"] for e in examples] == [
        "ncbi_disease sentence: APC and ataxia - telangiectasia",
        "ncbi_disease sentence: Normal cells",
        "ncbi_disease sentence: Ataxia",
    ]
    assert [e["targets_pretokenized"] for e in examples] == [
        "APC | ataxia - telangiectasia", "none", "Ataxia"
    ]
    assert task.num_input_examples("validation") == 3
    assert task.num_input_examples("train") == 2
    assert examples[0]["targets"][-1] == 1  # EOS appended


def test_ner_task_metrics_through_seqio_evaluator(tmp_path, registered):
    task = _ner_task(tmp_path, registered)
    assert _evaluate(task.name) == pytest.approx(
        {"entity_precision": 100.0, "entity_recall": 100.0, "entity_f1": 100.0}
    )
    # 3 gold mentions; predicted: APC (right), "ataxia" (wrong span), "cells" (wrong), Ataxia.
    out = _evaluate(task.name, ["APC | ataxia", "cells", "Ataxia"])
    assert out == pytest.approx(
        {"entity_precision": 50.0, "entity_recall": 200 / 3, "entity_f1": 2 * 0.5 * (2 / 3) / (0.5 + 2 / 3) * 100}
    )


def test_ner_task_bad_row_raises_then_skip_policy(tmp_path, registered):
    bad = _write(tmp_path / "bad.tsv", "x\tO\n\ny\tI-Gene\n")
    task = registered(biomed.add_ner_task, "test_biomed_ner_bad", "ncbi_disease", {"validation": [bad]})
    with pytest.raises(files.DataFileError, match=r"bad\.tsv:3: unknown tag 'I-Gene'"):
        _examples(task)
    task = registered(
        biomed.add_ner_task, "test_biomed_ner_skip", "ncbi_disease", {"validation": [bad]}, on_bad_row="skip"
    )
    assert [e["inputs_pretokenized"] for e in _examples(task)] == ["ncbi_disease sentence: x"]


def test_missing_and_empty_files_name_path_and_how_to_obtain(tmp_path, registered):
    task = registered(biomed.add_ner_task, "test_biomed_ner_missing", "ncbi_disease", data_dir=tmp_path)
    with pytest.raises(files.DataFileError, match=r"missing data file .*biomed/ncbi_disease/devel\.tsv.*BioBERT"):
        task.num_input_examples("validation")
    empty = _write(tmp_path / "empty.tsv", "")
    task = registered(biomed.add_ner_task, "test_biomed_ner_empty", "ncbi_disease", {"validation": [empty]})
    with pytest.raises(files.DataFileError, match=r"empty\.tsv' is empty"):
        _examples(task)
    blank = _write(tmp_path / "blank.tsv", "\n\n")
    task = registered(biomed.add_ner_task, "test_biomed_ner_blank", "ncbi_disease", {"validation": [blank]})
    with pytest.raises(files.DataFileError, match="no readable examples"):
        _examples(task)


def test_unknown_split_is_a_value_error(tmp_path, registered):
    task = _ner_task(tmp_path, registered, name="test_biomed_ner_split")
    with pytest.raises(ValueError, match=r"split='test'; this source has splits \['train', 'validation'\]"):
        task.source.paths("test")


# ----------------------------------------------------------------------------- MEDIQA XML


def _answer(aid, rank, score, text="An answer."):
    attrs = f'AID="{aid}" SystemRank="1"'
    if rank is not None:
        attrs += f' ReferenceRank="{rank}"'
    if score is not None:
        attrs += f' ReferenceScore="{score}"'
    return f"<Answer {attrs}>\n<AnswerURL>u</AnswerURL>\n<AnswerText>{text}</AnswerText>\n</Answer>\n"


def _mediqa(questions, bom=False):
    body = "".join(
        f'<Question QID="{qid}">\n<QuestionText>{qtext}</QuestionText>\n<AnswerList>\n'
        + "".join(answers) + "</AnswerList>\n</Question>\n"
        for qid, qtext, answers in questions
    )
    return ("\ufeff" if bom else "") + f'<?xml version="1.0" encoding="UTF-8"?>\n<MEDIQA2019-Task3-QA-ValidationSet>\n{body}</MEDIQA2019-Task3-QA-ValidationSet>\n'


MEDIQA_DEV = _mediqa([
    ("1", "What causes gout?", [_answer("1_Answer1", 3, 2), _answer("1_Answer2", 1, 4, "Uric acid &amp; diet."),
                                 _answer("1_Answer3", 2, 3)]),
    ("2", "Is flu dangerous?", [_answer("2_Answer1", 2, 1), _answer("2_Answer2", 1, 2)]),
], bom=True)


def test_mediqa_reader_targets_and_entities(tmp_path):
    questions = bs.read_mediqa_xml(_write(tmp_path / "dev.xml", MEDIQA_DEV))
    assert [q.question_id for q in questions] == ["1", "2"]
    assert questions[0].num_candidates == 3
    assert questions[0].answers[1].text == "Uric acid & diet."
    assert questions[0].answers[0].line == 6


@pytest.mark.parametrize(
    "answers, message",
    [([_answer("a", 1, 5)], r":6: answer a: ReferenceScore='5'; accepted: \[1, 2, 3, 4\]"),
     ([_answer("a", 2, 3)], r":6: answer a: ReferenceRank='2'; accepted: an integer in 1..1"),
     ([_answer("a", 1, 3, text="")], r":6: answer a: empty <AnswerText>"),
     ([_answer("a", 1, 3), _answer("b", 1, 2)], r":4: question 9: repeated ReferenceRank"),
     ([], r":4: question 9 has no <Answer> elements")],
)
def test_mediqa_reader_bad_rows(tmp_path, answers, message):
    text = _mediqa([("8", "ok", [_answer("ok", 1, 4)])]).replace(
        "</MEDIQA2019-Task3-QA-ValidationSet>", ""
    ) + "".join(['<Question QID="9">\n<QuestionText>q</QuestionText>\n<AnswerList>\n', *answers,
                 "</AnswerList>\n</Question>\n</MEDIQA2019-Task3-QA-ValidationSet>\n"])
    path = _write(tmp_path / "q.xml", text)
    question_line = text[: text.index('QID="9"')].count("\n") + 1
    message = message.replace(":4:", f":{question_line}:").replace(":6:", f":{question_line + 3}:")
    with pytest.raises(files.DataFileError, match=r"q\.xml" + message):
        bs.read_mediqa_xml(path)
    counter = files.BadRowCounter(path, "skip")
    assert [q.question_id for q in bs.read_mediqa_xml(path, counter=counter)] == ["8"]
    assert counter.skipped == 1


def test_mediqa_reader_unlabelled_and_malformed_files(tmp_path):
    unlabelled = _write(tmp_path / "TestSet.xml", _mediqa([("1", "q", [_answer("a", None, None)])]))
    with pytest.raises(files.DataFileError, match="no ReferenceScore.*TestSet-wLabels"):
        bs.read_mediqa_xml(unlabelled)
    broken = _write(tmp_path / "broken.xml", "<A>\n<Question QID='1'>\n</A>\n")
    with pytest.raises(files.DataFileError, match=r"broken\.xml:3: not well-formed XML \(mismatched tag\)"):
        bs.read_mediqa_xml(broken)
    other = _write(tmp_path / "other.xml", "<Root><Item/></Root>")
    with pytest.raises(files.DataFileError, match="no <Question> elements under <Root>"):
        bs.read_mediqa_xml(other)


def test_ranking_task_targets_and_metrics(tmp_path, registered):
    dev = _write(tmp_path / "dev.xml", MEDIQA_DEV)
    task = registered(biomed.add_answer_ranking_task, "test_biomed_rank", "mediqa2019_qa", {"validation": [dev]})
    examples = _examples(task)
    assert len(examples) == 5
    assert examples[1]["inputs_pretokenized"] == (
        "mediqa2019_qa question: What causes gout? answer: Uric acid & diet."
    )
    # score - (rank - 1) / m: 2 - 2/3, 4 - 0, 3 - 1/3, 1 - 1/2, 2 - 0.
    assert [e["targets_pretokenized"] for e in examples] == ["1.333", "4.000", "2.667", "0.500", "2.000"]
    assert examples[0]["question_id"] == "dev.xml:1"
    # Targets as predictions: all labels right, q1 first answer correct, q2 has none correct.
    assert _evaluate(task.name) == pytest.approx({"accuracy": 100.0, "precision": 100.0, "mrr": 50.0})
    # q1 ranked: a3 (3.0, +, correct), a1 (2.5, +, wrong), a2 (1.0, -, correct) -> rr 1;
    # q2: a2 2.1 (+, wrong) at rank 1, a1 "junk" -> -1 (-, agrees) -> rr 1: the official
    # evaluator's MRR takes the first answer labelled 1 whatever its gold label.
    # accuracy 2/5, precision 1/3 predicted positive, MRR (1 + 1) / 2.
    out = _evaluate(task.name, ["2.5", "1.0", "3.0", "junk", "2.1"])
    assert out == pytest.approx({"accuracy": 40.0, "precision": 100 / 3, "mrr": 100.0})


# ----------------------------------------------------------------------------- MedNLI


def test_mednli_reader_official_and_short_keys_and_bad_rows(tmp_path):
    rows = [
        {"sentence1": "Pt has fever.", "sentence2": "Pt is febrile.", "gold_label": "entailment", "pairID": "1"},
        {"premise": "No pain.", "hypothesis": "Severe pain.", "label": "contradiction"},
    ]
    text = "\ufeff" + "\n".join(json.dumps(r) for r in rows) + "\n"
    pairs = bs.read_mednli_jsonl(_write(tmp_path / "ok.jsonl", text))
    assert [(p.label, p.line) for p in pairs] == [("entailment", 1), ("contradiction", 2)]
    bad = text + json.dumps({"premise": "a", "hypothesis": "b", "label": "maybe"}) + "\n{oops\n"
    path = _write(tmp_path / "bad.jsonl", bad)
    with pytest.raises(files.DataFileError, match=r"bad\.jsonl:3: unknown label 'maybe'"):
        bs.read_mednli_jsonl(path)
    counter = files.BadRowCounter(path, "skip")
    assert len(bs.read_mednli_jsonl(path, counter=counter)) == 2
    assert counter.skipped == 2
    missing = _write(tmp_path / "keys.jsonl", json.dumps({"text": "x"}) + "\n")
    with pytest.raises(files.DataFileError, match=r"keys\.jsonl:1: keys \['text'\]; expected sentence1"):
        bs.read_mednli_jsonl(missing)


def test_mednli_task_format_and_accuracy(tmp_path, registered):
    rows = [
        {"sentence1": "Pt has fever.", "sentence2": "Pt is febrile.", "gold_label": "entailment"},
        {"sentence1": "No pain.", "sentence2": "Severe pain.", "gold_label": "contradiction"},
    ]
    dev = _write(tmp_path / "mli_dev_v1.jsonl", "\n".join(json.dumps(r) for r in rows))
    task = registered(biomed.add_mednli_task, "test_biomed_mednli", {"validation": [dev]})
    examples = _examples(task)
    assert examples[0]["inputs_pretokenized"] == "mednli hypothesis: Pt is febrile. premise: Pt has fever."
    assert [e["targets_pretokenized"] for e in examples] == ["entailment", "contradiction"]
    assert _evaluate(task.name) == {"accuracy": 100.0}
    assert _evaluate(task.name, ["entailment", "not a label"]) == {"accuracy": 50.0}


# ----------------------------------------------------------------------------- registry


def test_registered_tasks_and_mixture_read_no_file_at_registration(tmp_path):
    names = ["biomed_ncbi_disease", "biomed_bc5cdr_disease", "biomed_mednli", "biomed_mediqa2019_qa",
             "biomed_trecqa2017"]
    for name in names:
        assert name in seqio.TaskRegistry.names()
    mixture = seqio.get_mixture_or_task("biomed_all")
    assert sorted(t.name for t in mixture.tasks) == sorted(
        "biomed_all_" + t.removeprefix("biomed_") for t in biomed.BIOMED_MIXTURE_TASKS)
    config.set_data_dir(tmp_path)  # an empty folder: files are looked up only now
    try:
        with pytest.raises(files.DataFileError, match=r"biomed/mednli/mli_dev_v1\.jsonl.*physionet"):
            seqio.get_mixture_or_task("biomed_mednli").num_input_examples("validation")
        with pytest.raises(files.DataFileError, match=r"TrainingSet1-LiveQAMed\.xml.*MEDIQA2019"):
            seqio.get_mixture_or_task("biomed_trecqa2017").source.paths("test")
    finally:
        config.set_data_dir(None)


def test_split_layout_follows_the_paper():
    mediqa, trecqa = biomed.BIOMED_FILES["mediqa2019_qa"], biomed.BIOMED_FILES["trecqa2017"]
    assert [p.split("QA-")[-1] for p in mediqa["train"]] == ["TrainingSet1-LiveQAMed.xml", "TrainingSet2-Alexa.xml"]
    assert trecqa["test"] == (mediqa["train"][0],)
    assert not set(trecqa["train"]) & set(trecqa["test"])
