"""Tasks without T5's task prefixes (`*_noprefix_v*`): same rows, targets and metrics, no
task name in the inputs (conditioning on the task embedding alone)."""

import json

import pytest
import seqio
from seqio import test_utils

import ktx.tasks  # noqa: F401  (registers everything)
from ktx.tasks import glue, mixtures, super_glue
from tests.tasks._fixtures import formatted, root, write  # noqa: F401

STSB_HEADER = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"


def jsonl(*rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_noprefix_name():
    assert glue.noprefix_name("glue_rte_v002") == "glue_rte_noprefix_v002"
    assert glue.noprefix_name("super_glue_cb_v102") == "super_glue_cb_noprefix_v102"
    for bad in ("glue_rte", "glue_rte_vx", "_v1"):
        with pytest.raises(ValueError, match="noprefix_name"):
            glue.noprefix_name(bad)


def test_every_task_has_a_noprefix_twin():
    names = set(seqio.TaskRegistry.names())
    assert {glue.noprefix_name(t) for t in glue.GLUE_TASKS} == set(glue.GLUE_NOPREFIX_TASKS)
    assert {glue.noprefix_name(t) for t in super_glue.SUPER_GLUE_TASKS} == set(
        super_glue.SUPER_GLUE_NOPREFIX_TASKS)
    assert "glue_mnli_matched_noprefix_v002" in names
    for name in glue.GLUE_TASKS + super_glue.SUPER_GLUE_TASKS:
        plain, bare = seqio.get_mixture_or_task(name), seqio.get_mixture_or_task(glue.noprefix_name(name))
        assert [f.__name__ for f in bare.metric_fns] == [f.__name__ for f in plain.metric_fns]
        assert set(bare.splits) == set(plain.splits)
    # The prefixed mixtures are unchanged; the small mixtures pair up task by task.
    assert set(glue.GLUE_TASKS) == {t.name for t in seqio.get_mixture_or_task(
        "glue_v002_proportional").tasks}
    small = [t.name for t in seqio.get_mixture_or_task("glue_super_glue_small_v1").tasks]
    bare = [t.name for t in seqio.get_mixture_or_task("glue_super_glue_small_noprefix_v1").tasks]
    assert sorted(small) == sorted(mixtures.SMALL_TASKS)
    assert sorted(bare) == sorted(glue.noprefix_name(t) for t in mixtures.SMALL_TASKS)


def test_glue_formats_without_prefix(root):
    write(root, "glue/RTE/dev.tsv", "index\tsentence1\tsentence2\tlabel\n"
          "0\tA cat sat.\tAn animal sat.\tentailment\n")
    write(root, "glue/CoLA/dev.tsv", "gj04\t1\t\tThe boy ran.\n")
    write(root, "glue/STS-B/dev.tsv", STSB_HEADER + "0\tg\tf\t2012\t0000\tnone\tnone\tA.\tB.\t3.78\n")
    test_utils.assert_dataset(formatted("glue_rte_noprefix_v002", "validation"), [
        {"inputs": "sentence1: A cat sat. sentence2: An animal sat.", "targets": "entailment",
         "idx": 0}])
    test_utils.assert_dataset(formatted("glue_rte_v002", "validation"), [
        {"inputs": "rte sentence1: A cat sat. sentence2: An animal sat.",
         "targets": "entailment", "idx": 0}])
    test_utils.assert_dataset(formatted("glue_cola_noprefix_v002", "validation"), [
        {"inputs": "sentence: The boy ran.", "targets": "acceptable", "idx": 0}])
    test_utils.assert_dataset(formatted("glue_stsb_noprefix_v002", "validation"), [
        {"inputs": "sentence1: A. sentence2: B.", "targets": "3.8", "idx": 0}])
    task = seqio.get_mixture_or_task("glue_stsb_noprefix_v002")
    assert task.postprocess_fn("3.8") == pytest.approx(3.8)


def test_super_glue_formats_without_prefix(root):
    write(root, "super_glue/COPA/val.jsonl", jsonl(
        {"premise": "It rained.", "choice1": "Sun.", "choice2": "Wet.", "question": "effect",
         "label": 1, "idx": 0}))
    write(root, "super_glue/WSC/val.jsonl", jsonl(
        {"text": "Tom hit Sam because he was mad .", "idx": 0, "label": True,
         "target": {"span1_index": 0, "span2_index": 4, "span1_text": "Tom",
                    "span2_text": "he"}}))
    test_utils.assert_dataset(formatted("super_glue_copa_noprefix_v102", "validation"), [
        {"inputs": "choice1: Sun. choice2: Wet. premise: It rained. question: effect",
         "targets": "choice2", "idx": 0}])
    test_utils.assert_dataset(formatted("super_glue_wsc_noprefix_v102", "validation"), [
        {"inputs": "text: * Tom * hit Sam because # he # was mad .", "targets": "True",
         "idx": 0}])
    test_utils.assert_dataset(formatted("super_glue_wsc_v102", "validation"), [
        {"inputs": "wsc text: * Tom * hit Sam because # he # was mad .", "targets": "True",
         "idx": 0}])
    copa = seqio.get_mixture_or_task("super_glue_copa_noprefix_v102")
    assert copa.postprocess_fn("choice2") == 1
