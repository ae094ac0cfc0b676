"""`ktx.runs.label_eval`: each benchmark's own metrics for sentence-level encoder tasks
(GLUE's CoLA Matthews correlation, STS-B Pearson / Spearman, ...), over inline rows in the
official layouts; the default evaluators of `ktx eval` for encoder runs; and a GLUE
encoder run (`experiments/glue_encoders/bert_tiny.gin`) through `ktx train` and
`ktx eval` on the real files."""

from __future__ import annotations

import json

import jax
import ktx.tasks  # noqa: F401
import numpy as np
import optax
import pytest
import seqio

from ktx.data import files
from ktx.data.pipeline import MultiTaskInput
from ktx.metrics import glue as glue_metrics
from ktx.models import bert, encoder
from ktx.runs import label_eval, tag_eval
from ktx.training.trainer import Trainer
from tests.data.test_wordpiece import TOKENS, write_vocab
from tests.tasks._fixtures import root, vocab_dir, write  # noqa: F401

COLA, STSB = "glue_cola_bert_v001", "glue_stsb_bert_v001"
COLA_DEV = "".join(f"gj04\t{i % 2}\t\t{s}\n" for i, s in enumerate(
    ["The cat sat.", "Hello!", "The mat.", "A cat sat on the mat.", "The cat.", "Sat the cat."]))
STSB_DEV = ("index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\t"
            "score\n" + "".join(f"{i}\tg\tf\ty\t1\tn\tn\t{a}\t{b}\t{s}\n" for i, (a, b, s) in
                                enumerate([("The cat.", "The mat.", 3.8), ("Hello!", "A cat.", 0.5),
                                           ("The cat sat.", "A cat sat.", 4.6),
                                           ("The mat.", "Hello.", 1.2), ("A cat.", "The cat.", 2.0)])))


MIXTURE = "test_label_eval_cola_stsb"


@pytest.fixture(scope="module", autouse=True)
def _mixture():
    if MIXTURE in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove(MIXTURE)
    seqio.MixtureRegistry.add(MIXTURE, [COLA, STSB], default_rate=1.0)
    yield
    seqio.MixtureRegistry.remove(MIXTURE)


def _setup(root, vocab_dir):
    write(root, "glue/CoLA/dev.tsv", COLA_DEV)
    write(root, "glue/STS-B/dev.tsv", STSB_DEV)
    inp = MultiTaskInput(MIXTURE, {"inputs": 12}, batch_size=8, split="validation",
                         shuffle=False, encoder_vocabulary=vocab_dir, num_labels=(2, 1))
    model = encoder.EncoderClassifierModel(
        bert.BertConfig(vocab_size=len(TOKENS), hidden_size=8, num_layers=1, num_heads=2,
                        intermediate_size=16, max_position=16), num_labels=(2, 1))
    trainer = Trainer(model, optax.sgd(0.0))
    state = trainer.init_state(jax.random.key(0), inp.get_batch(0))
    return inp, model, trainer, state


def test_each_task_is_scored_with_its_own_metrics(root, vocab_dir):
    """Every validation row (6 CoLA, 5 STS-B: one batch of 8 each, padded and cut) is predicted
    by its task's head and scored with the task's registered metrics, equal to those
    metrics on the model's own logits of the whole split."""
    inp, model, trainer, state = _setup(root, vocab_dir)
    evaluator = label_eval.LabelEvaluator(inp, batch_size=8)
    got = evaluator(trainer=trainer, params=state.params, step=0)
    assert list(got) == [COLA, STSB]
    # The jitted logits are built once per trainer and reused by the next evaluation;
    # another trainer (another mesh) gets its own.
    jitted = evaluator._on_mesh(trainer)
    assert evaluator(trainer=trainer, params=state.params, step=1) == got
    assert evaluator._on_mesh(trainer) is jitted
    other = Trainer(model, optax.sgd(0.0))
    other.init_state(jax.random.key(0), inp.get_batch(0))
    assert evaluator._on_mesh(other) is not jitted
    assert list(got[COLA]) == ["matthews_corrcoef", "examples"]
    assert list(got[STSB]) == ["pearson_corrcoef", "spearman_corrcoef", "examples"]
    assert got[COLA]["examples"] == 6 and got[STSB]["examples"] == 5

    cola = inp.eval_arrays(COLA)
    want = glue_metrics.matthews_corrcoef(
        cola["label"].astype(int).tolist(),
        np.argmax(model.logits(state.params, cola)[0], -1).tolist())
    assert got[COLA]["matthews_corrcoef"] == pytest.approx(want["matthews_corrcoef"], abs=1e-9)
    stsb = inp.eval_arrays(STSB)
    scores = np.asarray(model.logits(state.params, stsb)[1][:, 0], np.float64)
    assert stsb["label"].tolist() == pytest.approx([3.8, 0.5, 4.6, 1.2, 2.0])
    want = glue_metrics.pearson_corrcoef(stsb["label"].astype(np.float64).tolist(), scores.tolist())
    # an untrained head's scores differ by ~1e-3 only, so float32 rounding between the
    # sharded step and this unsharded call moves their correlation by ~1e-3 percent
    assert got[STSB]["pearson_corrcoef"] == pytest.approx(want["pearson_corrcoef"], abs=0.05)

    # The metrics themselves: a perfect scorer gets the best of each.
    assert label_eval.score_predictions(COLA, cola["label"], cola["label"], False) == {
        "matthews_corrcoef": 100.0, "examples": 6.0}
    perfect = label_eval.score_predictions(STSB, stsb["label"], stsb["label"], True)
    assert perfect["pearson_corrcoef"] == pytest.approx(100.0)


def test_tasks_without_metric_functions_and_the_default_evaluators(root, vocab_dir):
    """MedNLI's encoder task registers no metric functions: accuracy. The default
    evaluators of `ktx eval` follow the input's tasks."""
    assert label_eval.metric_fns_of("biomed_mednli_bert_v001", False) == [glue_metrics.accuracy]
    assert label_eval.metric_fns_of("biomed_mednli_bert_v001", True) == [
        glue_metrics.pearson_corrcoef]
    inp, *_ = _setup(root, vocab_dir)
    (only,) = label_eval.default_encoder_evaluators(inp, split="validation", batch_size=8)
    assert isinstance(only, label_eval.LabelEvaluator) and only.batch_size == 8


def test_a_tagging_only_input_is_refused(root, vocab_dir):
    write(root, "biomed/ncbi_disease/devel.tsv", "The\tO\ncat\tB-Disease\n\n")
    name = "biomed_ncbi_disease_bert_v001"
    inp = MultiTaskInput(name, {"inputs": 12}, batch_size=2, split="validation", shuffle=False,
                         encoder_vocabulary=vocab_dir, num_labels=3, head_kinds="tagging")
    (only,) = label_eval.default_encoder_evaluators(inp)
    assert isinstance(only, tag_eval.TaggingEvaluator)
    with pytest.raises(ValueError, match="LabelEvaluator: the input's tasks .* are all tagging"):
        label_eval.LabelEvaluator(inp, batch_size=2)(trainer=None, params=None, step=0)


def test_ktx_train_and_eval_glue_tiny_bert(data_dir, tmp_path, monkeypatch):
    """`ktx train` of experiments/glue_encoders/bert_tiny.gin on the real GLUE files (3
    steps, from another folder, relative paths): GLUE's metrics of every task at the end;
    then `ktx eval` of the run with the default evaluators (the same metrics)."""
    if not (data_dir / "glue" / "CoLA" / "dev.tsv").is_file():
        pytest.skip(f"{data_dir}/glue/ has no GLUE files")
    from ktx import cli

    monkeypatch.chdir(tmp_path)
    vocab = write_vocab(tmp_path / "vocab")
    common = ["--gin_file=experiments/glue_encoders/bert_tiny.gin", "--gin.MODEL_DIR='run'",
              f"--gin.ENCODER_VOCAB='{vocab}'", f"--gin.DATA_DIR='{data_dir}'",
              "--gin.MAX_SEQ_LENGTH=16", f"--gin.VOCAB_SIZE={len(TOKENS)}",
              # `ktx eval` reads the validation rows `ktx train` converted (same files,
              # vocabulary and lengths)
              "--gin.pipeline.MultiTaskInput.cache_dir='rows'"]
    try:
        assert cli.main(["train", *common, "--gin.TRAIN_STEPS=3", "--gin.BATCH_SIZE=8",
                         "--gin.label_eval.LabelEvaluator.batch_size=512",
                         "--gin.eval_lib.TeacherForcedEvaluator.batch_size=512"]) == 0
        assert cli.main(["eval", *common, "--gin_file=runs/encoder_eval.gin",
                         "--gin.EVAL_BATCH_SIZE=512", "--gin.CHECKPOINT_STEPS='latest'"]) == 0
    finally:  # the CLI sets the process's data folder and bad-row policy from gin
        files.set_data_dir(None)
        files.set_on_bad_row(None)
    # MRPC's dev here is the MSRP test set (1,725 pairs; the data README says why)
    sizes = {"glue_cola_bert_v001": 1043, "glue_sst2_bert_v001": 872, "glue_mrpc_bert_v001": 1725,
             "glue_stsb_bert_v001": 1500, "glue_rte_bert_v001": 277}
    first = {"glue_cola_bert_v001": "matthews_corrcoef", "glue_sst2_bert_v001": "accuracy",
             "glue_mrpc_bert_v001": "f1", "glue_stsb_bert_v001": "pearson_corrcoef",
             "glue_rte_bert_v001": "accuracy"}
    for path in ("run/metrics.jsonl", "run/eval/metrics.jsonl"):
        records = [json.loads(line) for line in (tmp_path / path).read_text().splitlines()]
        metrics = {r["task"]: r for r in records if r.get("split") == "validation_metrics"}
        assert set(metrics) == set(sizes), path
        for task, r in metrics.items():
            assert r["examples"] == sizes[task] and -100 <= r[first[task]] <= 100, (path, task)
