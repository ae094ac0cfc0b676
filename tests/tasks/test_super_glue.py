"""SuperGLUE tasks on inline rows in the official jsonl layout, including bad rows."""

import json

import pytest
import seqio
from seqio import test_utils

import ktx.tasks  # noqa: F401
from ktx.data import files
from ktx.tasks import config, super_glue
from tests.tasks._fixtures import formatted, root, write  # noqa: F401


def jsonl(*rows):
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def test_all_tasks_registered():
    names = set(seqio.TaskRegistry.names())
    for task in ("boolq", "cb", "copa", "multirc", "record", "rte", "wic", "wsc"):
        assert f"super_glue_{task}_v102" in names
    mixture = seqio.get_mixture_or_task("glue_super_glue_proportional")
    assert set(super_glue.SUPER_GLUE_TASKS) < {t.name for t in mixture.tasks}


@pytest.mark.parametrize("task,folder,row,inputs,target", [
    ("boolq", "BoolQ", {"question": "is it", "passage": "It is.", "label": True, "idx": 5},
     "boolq passage: It is. question: is it", "True"),
    ("cb", "CB", {"premise": "P.", "hypothesis": "H", "label": "neutral", "idx": 0},
     "cb hypothesis: H premise: P.", "neutral"),
    ("copa", "COPA", {"premise": "It rained.", "choice1": "Sun.", "choice2": "Wet.",
                      "question": "effect", "label": 1, "idx": 0},
     "copa choice1: Sun. choice2: Wet. premise: It rained. question: effect", "choice2"),
    ("rte", "RTE", {"premise": "P.", "hypothesis": "H.", "label": "entailment", "idx": 0},
     "rte hypothesis: H. premise: P.", "entailment"),
    ("wic", "WiC", {"word": "bank", "sentence1": "A river bank.", "sentence2": "A bank loan.",
                    "idx": 0, "label": False, "start1": 8, "end1": 12, "start2": 2, "end2": 6},
     "wic sentence1: A river bank. sentence2: A bank loan. word: bank", "False"),
])
def test_classification_formats(root, task, folder, row, inputs, target):
    write(root, f"super_glue/{folder}/val.jsonl", jsonl(row))
    test_utils.assert_dataset(formatted(f"super_glue_{task}_v102", "validation"),
                              [{"inputs": inputs, "targets": target, "idx": row["idx"]}])


def test_fix_wsc_spans_as_tfds_wsc_fixed():
    from ktx.data.glue_sources import fix_wsc_spans

    row = {"text": "The large ball crashed right through the table because it was made of steel.",
           "span1_index": 6, "span1_text": "The table", "span2_index": 9, "span2_text": "it"}
    assert fix_wsc_spans(row)["span1_text"] == "the table"  # case of the word at the index
    assert row["span1_text"] == "The table"  # a new row
    row = {"text": "patting her back , The woman smiled .", "span1_index": 4,
           "span1_text": "the woman.", "span2_index": 1, "span2_text": "her"}
    assert fix_wsc_spans(row)["span1_text"] == "The woman"  # upper case, trailing "." gone
    row = {"text": "Sam met the old\nman there .", "span1_index": 2, "span1_text": "the old\nman",
           "span2_index": 0, "span2_text": "Sam"}
    assert fix_wsc_spans(row) == row  # a substring already: unchanged, as TFDS
    row = {"text": "A man saw the old man there .", "span1_index": 3, "span1_text": "the old\nman",
           "span2_index": 0, "span2_text": "A"}
    assert fix_wsc_spans(row)["span1_text"] == "the old man"
    row = {"text": "Kamenev met Zinoviev .", "span1_index": 0, "span1_text": "Kamenev and Zinoviev",
           "span2_index": 2, "span2_text": "Zinoviev"}
    assert fix_wsc_spans(row) == row  # cannot be fixed (words in between)


def test_wsc_reader_fixes_spans_so_both_markers_appear(root):
    """Two rows of SuperGLUE's WSC val.jsonl: span1 written "The table" for "the table"
    (fixed as TFDS wsc.fixed, then marked as T5); span2_index one word before "it"."""
    write(root, "super_glue/WSC/val.jsonl", jsonl(
        {"text": "The large ball crashed right through the table because it was made of "
                 "styrofoam.", "idx": 5, "label": True,
         "target": {"span1_index": 6, "span2_index": 9, "span1_text": "The table",
                    "span2_text": "it"}},
        {"text": "Mr. Farley put the pebble in an iron safe . Some day they might want to use "
                 "it , but not now.", "idx": 42, "label": True,
         "target": {"span1_index": 8, "span2_index": 16, "span1_text": "safe",
                    "span2_text": "it"}}))
    test_utils.assert_dataset(formatted("super_glue_wsc_v102", "validation"), [
        {"inputs": "wsc text: The large ball crashed right through * the table * because # it # "
                   "was made of styrofoam.", "targets": "True", "idx": 5},
        {"inputs": "wsc text: Mr. Farley put the pebble in an iron * safe * . Some day they "
                   "might want to use # it # , but not now.", "targets": "True", "idx": 42},
    ])


def test_wsc_marks_spans(root):
    write(root, "super_glue/WSC/val.jsonl", jsonl(
        {"text": "The city councilmen refused the demonstrators a permit because they "
                 "feared violence .", "idx": 0, "label": True,
         "target": {"span1_index": 0, "span2_index": 9, "span1_text": "The city councilmen",
                    "span2_text": "they"}},
        {"text": "Mr. Moncrieff visited Chester 's flat because he was bored .", "idx": 1,
         "label": False, "target": {"span1_index": 0, "span2_index": 7,
                                    "span1_text": "Mr. Moncrieff", "span2_text": "he"}}))
    test_utils.assert_dataset(formatted("super_glue_wsc_v102", "validation"), [
        {"inputs": "wsc text: * The city councilmen * refused the demonstrators a permit "
                   "because # they # feared violence .", "targets": "True", "idx": 0},
        {"inputs": "wsc text: * Mr. Moncrieff * visited Chester 's flat because # he # was "
                   "bored .", "targets": "False", "idx": 1},
    ])


def test_multirc_one_example_per_answer_and_grouped_exact_match(root):
    write(root, "super_glue/MultiRC/val.jsonl", jsonl({"idx": 3, "passage": {
        "text": "<b>Sent 1: </b>Tom ran.<br>", "questions": [
            {"idx": 0, "question": "Who ran?", "answers": [
                {"idx": 0, "text": "Tom", "label": 1}, {"idx": 1, "text": "Ann", "label": 0}]},
            {"idx": 1, "question": "Did Tom walk?", "answers": [
                {"idx": 2, "text": "No", "label": 1}]}]}}))
    ds = formatted("super_glue_multirc_v102", "validation")
    out = list(ds.as_numpy_iterator())
    assert out[0]["inputs"] == b"multirc question: Who ran? answer: Tom paragraph: Sent 1: Tom ran. "
    assert [o["targets"] for o in out] == [b"True", b"False", b"True"]
    assert [int(o["idx/question"]) for o in out] == [0, 0, 1]
    task = seqio.get_mixture_or_task("super_glue_multirc_v102")
    targets = [task.postprocess_fn(o["targets"], example=o, is_target=True) for o in out]
    predictions = [task.postprocess_fn(p) for p in ("True", "True", "True")]
    scores = {}
    for fn in task.metric_fns:
        scores.update(fn(targets, predictions))
    # question 0 has a wrong answer, question 1 is right; F1a: tp 2, fp 1 -> 0.8
    assert scores == {"f1": pytest.approx(80.0), "exact_match": 50.0}


def test_record_entities_highlights_and_answers(root):
    text = "Paris is big.\n@highlight\nFrance wins\n@highlight\nMore news"
    ents = [{"start": text.index(e), "end": text.index(e) + len(e) - 1} for e in ("Paris", "France")]
    write(root, "super_glue/ReCoRD/val.jsonl", jsonl({
        "idx": 4, "passage": {"text": text, "entities": ents},
        "qas": [{"idx": 9, "query": "@placeholder won",
                 "answers": [{"start": 14, "end": 19, "text": "France"},
                             {"start": 0, "end": 4, "text": "Paris"}]}]}))
    out = list(formatted("super_glue_record_v102", "validation").as_numpy_iterator())
    assert [o["inputs"] for o in out] == [
        b"record query: @placeholder won entities: France, Paris passage: Paris is big. "
        b"France wins. More news"] * 2
    assert [o["targets"] for o in out] == [b"France", b"Paris"]
    task = seqio.get_mixture_or_task("super_glue_record_v102")
    targets = [task.postprocess_fn(o["targets"], example=o, is_target=True) for o in out]
    assert targets[0] == {"value": ["France", "Paris"], "group": (4, 9)}
    assert task.metric_fns[0](targets, [task.postprocess_fn("paris")] * 2) == {
        "em": 100.0, "f1": 100.0}


def test_bad_rows(root):
    path = write(root, "super_glue/CB/val.jsonl", jsonl(
        {"premise": "P", "hypothesis": "H", "label": "entailment", "idx": 0},
        "{not json",
        {"premise": "P", "hypothesis": "H", "label": "maybe", "idx": 2},
        {"premise": "P", "label": "neutral", "idx": 3}))
    with pytest.raises(files.DataFileError, match=f"{path}:2: not valid JSON"):
        formatted("super_glue_cb_v102", "validation")
    config.set_on_bad_row("skip")
    assert seqio.get_mixture_or_task("super_glue_cb_v102").num_input_examples("validation") == 1
    config.set_on_bad_row("raise")
    path = write(root, "super_glue/CB/train.jsonl", jsonl(
        {"premise": "P", "hypothesis": "H", "label": "maybe", "idx": 2}))
    with pytest.raises(files.DataFileError, match=f"{path}:1: unknown label 'maybe'"):
        formatted("super_glue_cb_v102", "train")
    path = write(root, "super_glue/MultiRC/val.jsonl", jsonl({"idx": 0, "passage": {
        "text": "t", "questions": [{"idx": 0, "question": "q", "answers": [{"idx": 0, "text": "a"}]}]}}))
    with pytest.raises(files.DataFileError, match=f"{path}:1: malformed MultiRC.*label None"):
        formatted("super_glue_multirc_v102", "validation")


def test_missing_file_names_path_and_source(root):
    with pytest.raises(files.DataFileError,
                       match=r"super_glue/BoolQ/train\.jsonl.*super\.gluebenchmark\.com"):
        formatted("super_glue_boolq_v102", "train")
    with pytest.raises(ValueError, match="split='dev'"):
        formatted("super_glue_boolq_v102", "dev")
    # The unlabelled test split is known (leaderboard files); its file is missing here.
    with pytest.raises(files.DataFileError, match=r"super_glue/BoolQ/test\.jsonl"):
        formatted("super_glue_boolq_v102", "test")
