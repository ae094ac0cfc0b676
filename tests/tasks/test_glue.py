"""GLUE tasks on inline rows in the official GLUE / MSRP layouts, including bad rows."""

import logging

import pytest
import seqio
from seqio import test_utils

import ktx.tasks  # noqa: F401  (registers everything)
from ktx.data import files
from ktx.tasks import config, glue
from tests.tasks._fixtures import formatted, root, write  # noqa: F401

STSB_HEADER = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
MNLI_HEADER = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
               "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\t"
               "label4\tlabel5\tgold_label\n")


def test_all_tasks_registered_without_data():
    names = set(seqio.TaskRegistry.names())
    for task in ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"):
        assert f"glue_{task}_v002" in names
    assert {"glue_mnli_matched_v002", "glue_mnli_mismatched_v002"} <= names
    assert set(glue.GLUE_TASKS) == {t.name for t in seqio.get_mixture_or_task(
        "glue_v002_proportional").tasks}


def test_cola_format(root):
    write(root, "glue/CoLA/dev.tsv", "gj04\t1\t\tThe boy ran.\ngj04\t0\t*\tRan boy the.")
    test_utils.assert_dataset(formatted("glue_cola_v002", "validation"), [
        {"inputs": "cola sentence: The boy ran.", "targets": "acceptable", "idx": 0},
        {"inputs": "cola sentence: Ran boy the.", "targets": "unacceptable", "idx": 1},
    ])


def test_mrpc_original_msrp_file_with_bom(root):
    write(root, "glue/MRPC/msr_paraphrase_train.txt",
          "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
          "1\t11\t12\tHe said \"yes\".\tHe agreed.\n0\t13\t14\tA cat.\tA dog.\n")
    test_utils.assert_dataset(formatted("glue_mrpc_v002", "train"), [
        {"inputs": 'mrpc sentence1: He said "yes". sentence2: He agreed.',
         "targets": "equivalent", "idx": 0},
        {"inputs": "mrpc sentence1: A cat. sentence2: A dog.", "targets": "not_equivalent",
         "idx": 1},
    ])


def test_stsb_rounds_to_point_two(root):
    rows = [(0, "A man sings.", "A man is singing.", "3.78"), (1, "x", "y", "2.500"),
            (2, "p", "q", "5.000")]
    write(root, "glue/STS-B/dev.tsv", STSB_HEADER + "".join(
        f"{i}\tg\tf\t2012\t{i:04d}\tnone\tnone\t{a}\t{b}\t{s}\n" for i, a, b, s in rows))
    out = list(formatted("glue_stsb_v002", "validation").as_numpy_iterator())
    assert out[0]["inputs"] == b"stsb sentence1: A man sings. sentence2: A man is singing."
    # 2.5 * 5 = 12.5 rounds half to even (tf.round, as T5) -> 12 / 5 = 2.4
    assert [o["targets"] for o in out] == [b"3.8", b"2.4", b"5.0"]
    task = seqio.get_mixture_or_task("glue_stsb_v002")
    assert task.postprocess_fn("3.8") == pytest.approx(3.8)
    assert task.postprocess_fn("high") == -1.0


def test_mnli_matched_and_mismatched(root):
    def row(i, premise, hypothesis, gold):
        return f"{i}\t1\t1e\tfiction\t(a)\t(b)\t(A)\t(B)\t{premise}\t{hypothesis}\t{gold}\t" \
               f"{gold}\t{gold}\t{gold}\t{gold}\t{gold}\n"
    write(root, "glue/MNLI/dev_matched.tsv", MNLI_HEADER + row(0, "P one.", "H one.", "neutral"))
    write(root, "glue/MNLI/dev_mismatched.tsv",
          MNLI_HEADER + row(0, "P two.", "H two.", "contradiction"))
    test_utils.assert_dataset(formatted("glue_mnli_v002", "validation_matched"), [
        {"inputs": "mnli hypothesis: H one. premise: P one.", "targets": "neutral", "idx": 0}])
    test_utils.assert_dataset(formatted("glue_mnli_mismatched_v002", "validation"), [
        {"inputs": "mnli hypothesis: H two. premise: P two.", "targets": "contradiction",
         "idx": 0}])


@pytest.mark.parametrize("task,folder,header,row,inputs,target", [
    ("rte", "RTE", "index\tsentence1\tsentence2\tlabel", "0\tA b.\tA.\tnot_entailment",
     "rte sentence1: A b. sentence2: A.", "not_entailment"),
    ("qnli", "QNLI", "index\tquestion\tsentence\tlabel", "0\tWho?\tHim.\tentailment",
     "qnli question: Who? sentence: Him.", "entailment"),
    ("wnli", "WNLI", "index\tsentence1\tsentence2\tlabel", "0\tS1.\tS2.\t1",
     "wnli sentence1: S1. sentence2: S2.", "entailment"),
    ("qqp", "QQP", "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate", "0\t1\t2\tQ1?\tQ2?\t0",
     "qqp question1: Q1? question2: Q2?", "not_duplicate"),
    ("sst2", "SST-2", "sentence\tlabel", "a fine film \t1", "sst2 sentence: a fine film ",
     "positive"),
])
def test_pair_task_formats(root, task, folder, header, row, inputs, target):
    write(root, f"glue/{folder}/dev.tsv", f"{header}\n{row}\n")
    test_utils.assert_dataset(formatted(f"glue_{task}_v002", "validation"),
                              [{"inputs": inputs, "targets": target, "idx": 0}])


def test_bad_rows_raise_with_file_and_line(root):
    path = write(root, "glue/CoLA/dev.tsv", "gj04\t1\t\tGood.\ngj04\t1\tOnly three fields\n")
    with pytest.raises(files.DataFileError, match=f"{path}:2: expected 4 fields, found 3"):
        formatted("glue_cola_v002", "validation")
    path = write(root, "glue/RTE/dev.tsv", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n")
    with pytest.raises(files.DataFileError, match=f"{path}:2: unknown label 'maybe'"):
        seqio.get_mixture_or_task("glue_rte_v002").num_input_examples("validation")


def test_bad_rows_skipped_and_counted_when_opted_in(root, caplog):
    write(root, "glue/CoLA/train.tsv",
          "gj04\t1\t\tGood.\ngj04\t7\t\tBad label.\nbroken row\ngj04\t0\t*\tAlso good.\n")
    config.set_on_bad_row("skip")
    with caplog.at_level(logging.WARNING):
        assert seqio.get_mixture_or_task("glue_cola_v002").num_input_examples("train") == 2
    assert "skipped 2 bad rows" in caplog.text
    out = list(formatted("glue_cola_v002", "train").as_numpy_iterator())
    assert [o["targets"] for o in out] == [b"acceptable", b"unacceptable"]
    with pytest.raises(ValueError, match="on_bad_row"):
        config.set_on_bad_row("ignore")


def test_missing_empty_and_unset_data(root, monkeypatch):
    with pytest.raises(files.DataFileError, match=r"QQP/dev\.tsv.*gluebenchmark\.com"):
        formatted("glue_qqp_v002", "validation")
    with pytest.raises(files.DataFileError, match=r"msr_paraphrase_test\.txt"):
        formatted("glue_mrpc_v002", "validation")
    write(root, "glue/RTE/train.tsv", "")
    with pytest.raises(files.DataFileError, match="is empty"):
        formatted("glue_rte_v002", "train")
    write(root, "glue/RTE/dev.tsv", "index\tsentence1\tsentence2\tlabel\n")
    with pytest.raises(files.DataFileError, match="no readable examples"):
        formatted("glue_rte_v002", "validation")
    config.set_data_dir(None)
    monkeypatch.delenv("KTX_DATA_DIR", raising=False)
    with pytest.raises(files.DataFileError, match="DATA_DIR.*KTX_DATA_DIR"):
        formatted("glue_rte_v002", "validation")


def test_unprepared_tfds_folder_falls_back_to_files(root, tmp_path_factory):
    write(root, "glue/RTE/dev.tsv", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n")
    config.set_tfds_data_dir(tmp_path_factory.mktemp("tfds"))
    task = seqio.get_mixture_or_task("glue_rte_v002")
    assert task.source.list_shards("validation") == [str(root / "glue/RTE/dev.tsv")]
    assert task.num_input_examples("validation") == 1


def test_targets_as_predictions_score_maximum(root):
    write(root, "glue/MRPC/dev.tsv", "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
          "1\t1\t2\ta\tb\n0\t3\t4\tc\td\n1\t5\t6\te\tf\n")
    task = seqio.get_mixture_or_task("glue_mrpc_v002")
    targets = [task.postprocess_fn(o["targets"], example=o, is_target=True)
               for o in formatted("glue_mrpc_v002", "validation").as_numpy_iterator()]
    scores = {}
    for fn in task.metric_fns:
        scores.update(fn(targets, targets))
    assert scores == {"f1": 100.0, "accuracy": 100.0}
    wrong = [task.postprocess_fn("unsure")] * 3
    assert task.metric_fns[1](targets, wrong) == {"accuracy": 0.0}
