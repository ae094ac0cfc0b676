"""Leaderboard files: unlabelled GLUE / SuperGLUE test files in the official layouts (written
here), read by the tasks' test splits, and turned into submission files that follow the
servers' rules (file names, header, row counts equal to the test files', labels in each
task's label set, indices preserved, MultiRC grouped per paragraph and question)."""

from __future__ import annotations

import csv
import json
import warnings

import pytest
import seqio

import ktx.tasks  # noqa: F401
from ktx.runs import infer, leaderboard as lb
from ktx.tasks import glue, super_glue
from tests.tasks._fixtures import formatted, root, write  # noqa: F401

# ------------------------------------------------------------- official test layouts

_GLUE_TEST_FILES = {  # relpath -> text, as GLUE's download distributes them (no labels)
    "glue/CoLA/test.tsv": "index\tsentence\n0\tThe cat sat.\n1\tSat cat the.\n2\tIt rains.\n",
    "glue/SST-2/test.tsv": "index\tsentence\n0\tgreat film\n1\tawful\n",
    "glue/MRPC/test.tsv": "index\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
                          "0\t11\t12\tA b.\tA c.\n1\t13\t14\tX.\tY.\n",
    "glue/QQP/test.tsv": "id\tquestion1\tquestion2\n0\tWhy?\tHow?\n1\tWho?\tWhom?\n2\tA?\tB?\n",
    "glue/STS-B/test.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\t"
                           "sentence1\tsentence2\n"
                           "0\tmain-news\theadlines\t2015\t0001\tnone\tnone\tA man.\tA guy.\n"
                           "1\tmain-news\theadlines\t2015\t0002\tnone\tnone\tCats.\tDogs.\n",
    "glue/QNLI/test.tsv": "index\tquestion\tsentence\n0\tWhat?\tThis.\n1\tWhere?\tThere.\n",
    "glue/RTE/test.tsv": "index\tsentence1\tsentence2\n0\tP one.\tH one.\n1\tP two.\tH two.\n",
    "glue/WNLI/test.tsv": "index\tsentence1\tsentence2\n0\tJohn left.\tHe left.\n",
    "glue/diagnostic/diagnostic.tsv": "index\tsentence1\tsentence2\n0\tA.\tB.\n1\tC.\tD.\n"
                                      "2\tE.\tF.\n",
}
_MNLI_HEADER = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
                "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\n")
for _which, _n in (("matched", 3), ("mismatched", 2)):
    _GLUE_TEST_FILES[f"glue/MNLI/test_{_which}.tsv"] = _MNLI_HEADER + "".join(
        f"{i}\t{i}\t{i}n\tfiction\t( a )\t( b )\t(ROOT a)\t(ROOT b)\tPremise {i}.\tHyp {i}.\n"
        for i in range(_n))


def _jsonl(*rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


_MULTIRC_TEST = _jsonl(
    {"idx": 0, "version": 1.1, "passage": {"text": "Sent 1: A b. Sent 2: C d.", "questions": [
        {"idx": 0, "question": "What?", "answers": [{"idx": 0, "text": "A"}, {"idx": 1, "text": "C"}]},
        {"idx": 1, "question": "Who?", "answers": [{"idx": 2, "text": "B"}]}]}},
    {"idx": 1, "version": 1.1, "passage": {"text": "Sent 1: E.", "questions": [
        {"idx": 2, "question": "Why?", "answers": [{"idx": 3, "text": "E"}, {"idx": 4, "text": "F"}]}]}},
)
_RECORD_TEST = _jsonl(
    {"idx": 0, "source": "Daily mail", "passage": {
        "text": "Obama met Biden.\n@highlight\nThey talked",
        "entities": [{"start": 0, "end": 4}, {"start": 10, "end": 14}]},
     "qas": [{"idx": 0, "query": "@placeholder met Biden."},
             {"idx": 1, "query": "Obama met @placeholder."}]},
    {"idx": 1, "source": "Daily mail", "passage": {
        "text": "Paris is big.", "entities": [{"start": 0, "end": 4}]},
     "qas": [{"idx": 2, "query": "@placeholder is big."}]},
)
_SG_TEST_FILES = {  # SuperGLUE's test.jsonl: `idx`, no `label`
    "super_glue/BoolQ/test.jsonl": _jsonl({"question": "is it", "passage": "It is.", "idx": 0},
                                          {"question": "was it", "passage": "No.", "idx": 1}),
    "super_glue/CB/test.jsonl": _jsonl({"premise": "P.", "hypothesis": "H.", "idx": 0},
                                       {"premise": "Q.", "hypothesis": "I.", "idx": 1},
                                       {"premise": "R.", "hypothesis": "J.", "idx": 2}),
    "super_glue/COPA/test.jsonl": _jsonl(
        {"premise": "It rained.", "choice1": "Sun.", "choice2": "Wet.", "question": "effect",
         "idx": 0}),
    "super_glue/MultiRC/test.jsonl": _MULTIRC_TEST,
    "super_glue/ReCoRD/test.jsonl": _RECORD_TEST,
    "super_glue/RTE/test.jsonl": _jsonl({"premise": "P.", "hypothesis": "H.", "idx": 0},
                                        {"premise": "Q.", "hypothesis": "I.", "idx": 1}),
    "super_glue/WiC/test.jsonl": _jsonl(
        {"word": "bank", "sentence1": "A river bank.", "sentence2": "A bank loan.", "idx": 0,
         "start1": 8, "end1": 12, "start2": 2, "end2": 6}),
    "super_glue/WSC/test.jsonl": _jsonl(
        {"text": "Mark told Pete he was late.", "idx": 0, "target": {
            "span1_text": "Pete", "span1_index": 2, "span2_text": "he", "span2_index": 3}}),
    # The public diagnostics ship with labels; the reader keeps or ignores them alike.
    "super_glue/AX-b/AX-b.jsonl": _jsonl(
        {"sentence1": "A.", "sentence2": "B.", "idx": 0, "label": "entailment", "logic": ""},
        {"sentence1": "C.", "sentence2": "D.", "idx": 1, "label": "not_entailment"}),
    "super_glue/AX-g/AX-g.jsonl": _jsonl(
        {"premise": "P.", "hypothesis": "H.", "idx": 0, "pair_id": 1, "label": "entailment"}),
}

_GLUE_KEY_TASK = {  # submission key -> (task, split)
    "cola": ("glue_cola_v002", "test"), "sst2": ("glue_sst2_v002", "test"),
    "mrpc": ("glue_mrpc_v002", "test"), "qqp": ("glue_qqp_v002", "test"),
    "stsb": ("glue_stsb_v002", "test"),
    "mnli_matched": ("glue_mnli_v002", "test_matched"),
    "mnli_mismatched": ("glue_mnli_v002", "test_mismatched"),
    "qnli": ("glue_qnli_v002", "test"), "rte": ("glue_rte_v002", "test"),
    "wnli": ("glue_wnli_v002", "test"), "ax": ("glue_ax_v002", "test"),
}
_SG_KEY_TASK = {k: (f"super_glue_{k}_v102", "test") for k in lb.SUPER_GLUE_SUBMISSION}

# What each server accepts, written out independently of ktx.runs.leaderboard's tables.
_GLUE_FILES = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "qqp": "QQP",
               "mnli_matched": "MNLI-m", "mnli_mismatched": "MNLI-mm", "qnli": "QNLI",
               "rte": "RTE", "wnli": "WNLI", "ax": "AX"}
_GLUE_OFFICIAL = {"cola": {"0", "1"}, "sst2": {"0", "1"}, "mrpc": {"0", "1"}, "qqp": {"0", "1"},
                  "wnli": {"0", "1"}, "rte": {"entailment", "not_entailment"},
                  "qnli": {"entailment", "not_entailment"}}
for _k in ("mnli_matched", "mnli_mismatched", "ax"):
    _GLUE_OFFICIAL[_k] = {"entailment", "neutral", "contradiction"}
_SG_FILES = {"boolq": "BoolQ", "cb": "CB", "copa": "COPA", "multirc": "MultiRC",
             "record": "ReCoRD", "rte": "RTE", "wic": "WiC", "wsc": "WSC", "axb": "AX-b",
             "axg": "AX-g"}
_SG_OFFICIAL = {"boolq": {"true", "false"}, "wic": {"true", "false"}, "wsc": {"True", "False"},
                "copa": {0, 1}, "cb": {"entailment", "contradiction", "neutral"},
                "rte": {"entailment", "not_entailment"}, "axb": {"entailment", "not_entailment"},
                "axg": {"entailment", "not_entailment"}}

# Decoded T5 targets (the tasks' label names), cycled over the rows, plus one bad output.
_T5_TARGETS = {"cola": ["acceptable", "unacceptable"], "sst2": ["positive", "negative"],
               "mrpc": ["equivalent", "not_equivalent"], "qqp": ["duplicate", "not_duplicate"],
               "stsb": ["3.8", "0.2"], "qnli": ["not_entailment", "entailment"],
               "rte": ["not_entailment", "entailment"], "wnli": ["entailment", "not_entailment"],
               "boolq": ["True", "False"], "cb": ["neutral", "entailment", "contradiction"],
               "copa": ["choice2", "choice1"], "multirc": ["True", "False"],
               "record": ["Obama", "Biden"], "wic": ["True"], "wsc": ["True"],
               "axb": ["not_entailment", "entailment"], "axg": ["not_entailment"]}
for _k in ("mnli_matched", "mnli_mismatched", "ax"):
    _T5_TARGETS[_k] = ["contradiction", "neutral", "entailment"]


def _write_all(root, files_):
    for rel, text in files_.items():
        write(root, rel, text)


def _decoded(key_task, bad_every=0):
    """Predictions as `ktx infer` collects them: each test example's idx (read by the task
    through its text preprocessor) with a cycled T5 target; every `bad_every`-th is junk."""
    out, counts = {}, {}
    for key, (task, split) in key_task.items():
        rows = list(formatted(task, split).as_numpy_iterator())
        targets = _T5_TARGETS[key]
        preds = []
        for i, ex in enumerate(rows):
            assert ex["targets"] in (b"<unk>", b"-1.0") or key in ("axb", "axg")
            text = "maybe" if bad_every and i % bad_every == 0 else targets[i % len(targets)]
            preds.append(lb.Prediction(infer._example_idx(ex), text))
        out[key] = preds
        counts[key] = infer._num_test_rows(seqio.get_mixture_or_task(task), split,
                                           lb.BENCHMARKS["glue" if task.startswith("glue")
                                                         else "super_glue"][key])
    return out, counts


def _read_tsv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f, delimiter="\t"))


# --------------------------------------------------------------------------- readers


def test_glue_test_splits_keep_the_file_index(root):
    _write_all(root, _GLUE_TEST_FILES)
    rows = list(formatted("glue_qqp_v002", "test").as_numpy_iterator())
    assert [r["idx"] for r in rows] == [0, 1, 2]
    assert rows[0]["inputs"] == b"qqp question1: Why? question2: How?"
    assert rows[0]["targets"] == b"<unk>"
    mnli = list(formatted("glue_mnli_mismatched_v002", "test").as_numpy_iterator())
    assert [r["inputs"] for r in mnli][1] == b"mnli hypothesis: Hyp 1. premise: Premise 1."
    ax = list(formatted("glue_ax_v002", "test").as_numpy_iterator())
    assert [r["idx"] for r in ax] == [0, 1, 2] and ax[0]["inputs"].startswith(b"mnli ")
    mrpc = list(formatted("glue_mrpc_noprefix_v002", "test").as_numpy_iterator())
    assert mrpc[1]["inputs"] == b"sentence1: X. sentence2: Y."


def test_super_glue_test_splits_without_labels(root):
    _write_all(root, _SG_TEST_FILES)
    multirc = list(formatted("super_glue_multirc_v102", "test").as_numpy_iterator())
    assert [(r["idx/paragraph"], r["idx/question"], r["idx/answer"]) for r in multirc] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 2), (1, 2, 3), (1, 2, 4)]
    assert {r["targets"] for r in multirc} == {b"<unk>"}
    record = list(formatted("super_glue_record_v102", "test").as_numpy_iterator())
    assert [int(r["idx/query"]) for r in record] == [0, 1, 2]  # one example per query
    wsc = list(formatted("super_glue_wsc_v102", "test").as_numpy_iterator())
    assert wsc[0]["inputs"] == b"wsc text: Mark told * Pete * # he # was late."
    axb = list(formatted("super_glue_axb_v102", "test").as_numpy_iterator())
    assert axb[1]["inputs"] == b"rte hypothesis: D. premise: C."
    assert axb[1]["targets"] == b"not_entailment"  # the public file's label is kept


def test_unlabelled_glue_test_file_with_a_wrong_header_names_it(root):
    write(root, "glue/RTE/test.tsv", "index\tpremise\thypothesis\n0\tA\tB\n")
    with pytest.raises(ValueError, match="lacks columns"):
        list(formatted("glue_rte_v002", "test").as_numpy_iterator())


# ----------------------------------------------------------------------- submissions


def test_glue_submission_follows_the_server_rules(root, tmp_path):
    _write_all(root, _GLUE_TEST_FILES)
    predictions, counts = _decoded(_GLUE_KEY_TASK)
    out = tmp_path / "glue_submission"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every prediction is valid: no warning
        written = lb.write_glue_submission(predictions, out, counts)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.tsv" for n in _GLUE_FILES.values())
    for key, name in _GLUE_FILES.items():
        rows = _read_tsv(out / f"{name}.tsv")
        assert rows[0] == ["index", "prediction"]
        assert len(rows) - 1 == counts[key] == written[key].rows
        assert [int(r[0]) for r in rows[1:]] == [int(p.idx) for p in predictions[key]]
        for _, label in rows[1:]:
            if key == "stsb":
                assert 0.0 <= float(label) <= 5.0
            else:
                assert label in _GLUE_OFFICIAL[key], (key, label)
    assert [r[1] for r in _read_tsv(out / "CoLA.tsv")[1:]] == ["1", "0", "1"]
    assert [r[1] for r in _read_tsv(out / "MNLI-mm.tsv")[1:]] == ["contradiction", "neutral"]
    assert [float(r[1]) for r in _read_tsv(out / "STS-B.tsv")[1:]] == [3.8, 0.2]
    assert counts["qqp"] == 3 and counts["ax"] == 3 and counts["mnli_matched"] == 3


def test_super_glue_submission_follows_the_server_rules(root, tmp_path):
    _write_all(root, _SG_TEST_FILES)
    predictions, counts = _decoded(_SG_KEY_TASK)
    out = tmp_path / "sg"
    lb.write_super_glue_submission(predictions, out, counts)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.jsonl" for n in _SG_FILES.values())
    for key, name in _SG_FILES.items():
        lines = [json.loads(x) for x in (out / f"{name}.jsonl").read_text().splitlines()]
        test_lines = _SG_TEST_FILES[f"super_glue/{name}/"
                                    + ("test.jsonl" if key not in ("axb", "axg") else f"{name}.jsonl")]
        n_test = len(test_lines.splitlines())
        if key == "record":  # one line per query
            n_test = sum(len(json.loads(x)["qas"]) for x in test_lines.splitlines())
        assert len(lines) == n_test == counts[key], key
        if key == "multirc":
            continue
        assert all(set(x) == {"idx", "label"} for x in lines)
        if key == "record":
            assert [x["idx"] for x in lines] == [0, 1, 2]
            assert [x["label"] for x in lines] == ["Obama", "Biden", "Obama"]
        else:
            expected_idx = [json.loads(x)["idx"] for x in test_lines.splitlines()]
            assert [x["idx"] for x in lines] == expected_idx
            assert all(x["label"] in _SG_OFFICIAL[key] for x in lines), (key, lines)
    assert [json.loads(x)["label"] for x in (out / "BoolQ.jsonl").read_text().splitlines()] == [
        "true", "false"]
    assert json.loads((out / "COPA.jsonl").read_text())["label"] == 1


def test_multirc_grouped_per_paragraph_and_question(root, tmp_path):
    _write_all(root, _SG_TEST_FILES)
    predictions, counts = _decoded({"multirc": _SG_KEY_TASK["multirc"]})
    predictions["multirc"] = predictions["multirc"][::-1]  # order of decoding does not matter
    lb.write_super_glue_submission(predictions, tmp_path, counts)
    lines = [json.loads(x) for x in (tmp_path / "MultiRC.jsonl").read_text().splitlines()]
    # The official grouping: the test file's paragraph/question/answer idx, labels 0/1.
    assert lines == [
        {"idx": 0, "passage": {"questions": [
            {"idx": 0, "answers": [{"idx": 0, "label": 1}, {"idx": 1, "label": 0}]},
            {"idx": 1, "answers": [{"idx": 2, "label": 1}]}]}},
        {"idx": 1, "passage": {"questions": [
            {"idx": 2, "answers": [{"idx": 3, "label": 0}, {"idx": 4, "label": 1}]}]}},
    ]


def test_invalid_outputs_are_counted_and_written_as_the_default(root, tmp_path):
    _write_all(root, _GLUE_TEST_FILES)
    keys = {k: _GLUE_KEY_TASK[k] for k in ("cola", "stsb", "mnli_matched", "qqp")}
    predictions, counts = _decoded(keys, bad_every=2)
    with pytest.warns(UserWarning, match=r"CoLA.tsv: 2 of 3 predictions .*default label 1"):
        written = lb.write_glue_submission(predictions, tmp_path, counts)
    assert written["cola"].invalid == 2 and written["qqp"].invalid == 2
    assert [r[1] for r in _read_tsv(tmp_path / "CoLA.tsv")[1:]] == ["1", "0", "1"]
    assert [r[1] for r in _read_tsv(tmp_path / "QQP.tsv")[1:]] == ["0", "0", "0"]
    assert [float(r[1]) for r in _read_tsv(tmp_path / "STS-B.tsv")[1:]] == [2.5, 0.2]
    assert [r[1] for r in _read_tsv(tmp_path / "MNLI-m.tsv")[1:]] == [
        "entailment", "neutral", "entailment"]


def test_row_count_differing_from_the_test_file_is_refused(root, tmp_path):
    _write_all(root, _GLUE_TEST_FILES)
    predictions, counts = _decoded({k: _GLUE_KEY_TASK[k] for k in ("rte", "cola")})
    predictions["cola"] = predictions["cola"][:2]  # e.g. num_examples set
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"refusing to write CoLA.tsv: 2 rows .* has 3"):
        lb.write_glue_submission(predictions, out, counts)
    assert not out.exists()  # nothing written, RTE.tsv included
    with pytest.raises(ValueError, match="predicted twice"):
        lb.write_glue_submission({"rte": predictions["rte"] * 2}, out, {"rte": 4})
    with pytest.raises(ValueError, match="num_test_rows lacks 'rte'"):
        lb.write_glue_submission({"rte": predictions["rte"]}, out, {})
    with pytest.raises(ValueError, match="accepted"):
        lb.write_glue_submission({"boolq": []}, out, {"boolq": 0})


def test_test_file_counted_before_bad_rows_are_skipped(root, tmp_path):
    """A row the `skip` policy drops still counts: the submission would miss it."""
    from ktx.tasks import config
    write(root, "glue/RTE/test.tsv", "index\tsentence1\tsentence2\n0\tA.\tB.\n1\tbroken\n")
    config.set_on_bad_row("skip")
    predictions, counts = _decoded({"rte": _GLUE_KEY_TASK["rte"]})
    assert len(predictions["rte"]) == 1 and counts["rte"] == 2
    with pytest.raises(ValueError, match="refusing to write RTE.tsv"):
        lb.write_glue_submission(predictions, tmp_path / "x", counts)


def test_plan_decodes_adds_the_diagnostics_with_the_model_task():
    plan = lb.plan_decodes("glue", ["glue_mnli_noprefix_v002", "glue_rte_noprefix_v002",
                                    "super_glue_rte_v102", "synthetic_copy_v001"])
    assert [(d.key, d.task_name, d.split, d.model_task) for d in plan] == [
        ("mnli_matched", "glue_mnli_noprefix_v002", "test_matched", "glue_mnli_noprefix_v002"),
        ("mnli_mismatched", "glue_mnli_noprefix_v002", "test_mismatched", "glue_mnli_noprefix_v002"),
        ("ax", "glue_ax_noprefix_v002", "test", "glue_mnli_noprefix_v002"),
        ("rte", "glue_rte_noprefix_v002", "test", "glue_rte_noprefix_v002"),
    ]
    for d in lb.plan_decodes("glue", glue.GLUE_TASKS) + lb.plan_decodes(
            "super_glue", super_glue.SUPER_GLUE_TASKS):
        assert d.split in seqio.get_mixture_or_task(d.task_name).splits
    assert {d.key for d in lb.plan_decodes("super_glue", super_glue.SUPER_GLUE_TASKS)} == set(
        lb.SUPER_GLUE_SUBMISSION)
    assert {d.key for d in lb.plan_decodes("glue", glue.GLUE_TASKS)} == set(lb.GLUE_SUBMISSION)
    with pytest.raises(ValueError, match="accepted"):
        lb.plan_decodes("glue2", [])


def test_example_idx_survives_tokenization(root, data_dir):
    """The idx features reach `ktx infer` through the full pipeline (tokenize, EOS)."""
    (root / "vocab").symlink_to(data_dir / "vocab")
    _write_all(root, {**_GLUE_TEST_FILES, **_SG_TEST_FILES})
    lengths = {"inputs": 32, "targets": 8}
    ex = list(seqio.get_mixture_or_task("glue_qqp_v002").get_dataset(
        lengths, split="test", shuffle=False).as_numpy_iterator())
    assert [infer._example_idx(e) for e in ex] == [0, 1, 2]
    ex = list(seqio.get_mixture_or_task("super_glue_multirc_v102").get_dataset(
        lengths, split="test", shuffle=False).as_numpy_iterator())
    assert infer._example_idx(ex[2]) == {"paragraph": 0, "question": 1, "answer": 2}
