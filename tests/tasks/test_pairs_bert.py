"""Biomedical pair tasks for encoders (`ktx.tasks.biomed_pairs`): MEDIQA / TRECQA answer
ranking as a regression of pairs scored by `AnswerRankingEvaluator` with the official
MEDIQA-2019 metrics, and MedNLI as a 3-class pair task, over inline files."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
import seqio

import ktx.tasks  # noqa: F401
from ktx.data import encoder_features as ef
from ktx.data.pipeline import MultiTaskInput, encoder_num_labels
from ktx.metrics import biomed as biomed_metrics
from ktx.models import bert, encoder
from ktx.runs import rank_qa_eval
from ktx.tasks import biomed_pairs
from ktx.training.trainer import Trainer
from tests.data.test_wordpiece import TOKENS, ids, write_vocab
from tests.tasks._fixtures import root, vocab_dir, write  # noqa: F401
from tests.tasks.test_biomed import MEDIQA_DEV

MEDIQA = "biomed_mediqa2019_qa_bert_v001"
DEV_XML = "biomed/mediqa2019_qa/MEDIQA2019-Task3-QA-ValidationSet.xml"


def test_registered_tasks_and_mixture():
    assert biomed_pairs.RANKING_BERT_TASKS == (MEDIQA, "biomed_trecqa2017_bert_v001")
    assert encoder_num_labels(biomed_pairs.RANKING_BERT_MIXTURE) == (1, 1)
    for name in biomed_pairs.RANKING_BERT_TASKS:
        task = seqio.get_mixture_or_task(name)
        assert ef.is_encoder_task(task) and ef.label_space(task) == ef.LabelSpace.regression(0, 4)
        assert tuple(task.splits) == ("train", "validation", "test")
    nli = seqio.get_mixture_or_task(biomed_pairs.MEDNLI_BERT_TASK)
    assert ef.label_space(nli).names == ("entailment", "neutral", "contradiction")


def test_answers_become_question_answer_pairs_with_the_target_score(root, vocab_dir):
    write(root, DEV_XML, MEDIQA_DEV)
    inp = MultiTaskInput(MEDIQA, {"inputs": 12}, batch_size=5, split="validation",
                         shuffle=False, encoder_vocabulary=vocab_dir, num_labels=1)
    arrays = inp.eval_arrays(MEDIQA)
    # ReferenceScore - (ReferenceRank - 1) / m, in the file's answer order.
    np.testing.assert_allclose(arrays["label"], [2 - 2 / 3, 4, 3 - 1 / 3, 1 - 1 / 2, 2],
                               rtol=1e-6)
    first = arrays["input_ids"][0].tolist()
    assert first[0] == ids("[CLS]")[0] and first.count(ids("[SEP]")[0]) == 2
    assert arrays["token_type_ids"][0].max() == 1  # the answer is the second segment


def _trained_params(model, batch):
    return nn.unbox(model.init_variables(jax.random.key(3), batch)["params"])


def test_evaluator_scores_each_question_s_answers_by_the_head(root, vocab_dir):
    write(root, DEV_XML, MEDIQA_DEV)
    inp = MultiTaskInput(MEDIQA, {"inputs": 12}, batch_size=8, split="validation",
                         shuffle=False, encoder_vocabulary=vocab_dir, num_labels=1)
    config_ = bert.BertConfig(vocab_size=len(TOKENS), hidden_size=8, num_layers=1, num_heads=2,
                              intermediate_size=16, max_position=16)
    model = encoder.EncoderClassifierModel(config_, num_labels=(1,))
    trainer = Trainer(model, optax.sgd(0.0))
    state = trainer.init_state(jax.random.key(0), inp.get_batch(0))
    evaluator = rank_qa_eval.AnswerRankingEvaluator(inp, batch_size=8)
    got = evaluator(trainer=trainer, params=state.params, step=0)[MEDIQA]

    arrays = inp.eval_arrays(MEDIQA)
    want_scores = np.asarray(model.logits(state.params, arrays)[0][:, 0], np.float64)
    rows = seqio.get_mixture_or_task(MEDIQA).source.rows("validation")
    gold = [{"question_id": r["question_id"], "correct": r["reference_score"] >= 3} for r in rows]
    want = biomed_metrics.answer_ranking_metrics(gold, want_scores.tolist())
    for key in ("accuracy", "mrr", "precision"):
        assert got[key] == pytest.approx(want[key], abs=1e-6), key
    assert got["answers"] == 5 and got["questions"] == 2
    assert -100 <= got["spearman"] <= 100

    # A perfect scorer (the targets themselves) gets every metric's best.
    perfect = biomed_metrics.answer_ranking_metrics(gold, arrays["label"].tolist())
    assert perfect == {"accuracy": 100.0, "mrr": 50.0, "precision": 100.0}  # question 2: none correct


def test_evaluator_refuses_a_misaligned_source(root, vocab_dir, monkeypatch):
    write(root, DEV_XML, MEDIQA_DEV)
    inp = MultiTaskInput(MEDIQA, {"inputs": 12}, batch_size=8, split="validation",
                         shuffle=False, encoder_vocabulary=vocab_dir, num_labels=1)
    model = encoder.EncoderClassifierModel(
        bert.BertConfig(vocab_size=len(TOKENS), hidden_size=8, num_layers=1, num_heads=2,
                        intermediate_size=16, max_position=16), num_labels=(1,))
    trainer = Trainer(model, optax.sgd(0.0))
    state = trainer.init_state(jax.random.key(0), inp.get_batch(0))
    real = rank_qa_eval.answer_rows
    monkeypatch.setattr(rank_qa_eval, "answer_rows", lambda n, s: tuple(reversed(real(n, s))))
    with pytest.raises(ValueError, match="example 0's label .* is not its source row's score"):
        rank_qa_eval.AnswerRankingEvaluator(inp, batch_size=8)(
            trainer=trainer, params=state.params, step=0)
    monkeypatch.setattr(rank_qa_eval, "answer_rows", lambda n, s: real(n, s)[:3])
    with pytest.raises(ValueError, match="gave 5 examples but its source has 3 answers"):
        rank_qa_eval.AnswerRankingEvaluator(inp, batch_size=8)(
            trainer=trainer, params=state.params, step=0)
    monkeypatch.setattr(rank_qa_eval, "answer_rows", lambda n, s: None)
    with pytest.raises(ValueError, match="no answer-ranking task"):
        rank_qa_eval.AnswerRankingEvaluator(inp, batch_size=8)(
            trainer=trainer, params=state.params, step=0)


def test_mednli_pairs_take_the_label_index(root, vocab_dir):
    write(root, "biomed/mednli/mli_dev_v1.jsonl",
          '{"sentence1": "The cat sat.", "sentence2": "A cat.", "gold_label": "contradiction"}\n'
          '{"sentence1": "Hello!", "sentence2": "The mat.", "gold_label": "entailment"}\n'
          '{"sentence1": "The mat.", "sentence2": "Hello.", "gold_label": "neutral"}\n')
    inp = MultiTaskInput(biomed_pairs.MEDNLI_BERT_TASK, {"inputs": 10}, batch_size=3,
                         split="validation", shuffle=False, encoder_vocabulary=vocab_dir,
                         num_labels=3)
    arrays = inp.eval_arrays(biomed_pairs.MEDNLI_BERT_TASK, "validation")
    assert arrays["label"].tolist() == [2.0, 0.0, 1.0]
    assert arrays["input_ids"][1].tolist()[:4] == [ids("[CLS]")[0], *ids("hello", "!"),
                                                   ids("[SEP]")[0]]


def test_ktx_train_and_eval_ranking_tiny_bert(data_dir, tmp_path, monkeypatch):
    """`ktx train` of experiments/biomed_encoders/ranking_bert_tiny.gin on the real MEDIQA
    files (3 steps, from another folder, relative paths), then `ktx eval` of the run with
    the answer-ranking evaluator."""
    if not (data_dir / DEV_XML).is_file():
        pytest.skip(f"{data_dir}/biomed/mediqa2019_qa/ has no MEDIQA-2019 files")
    import json

    from ktx import cli
    from ktx.data import files

    monkeypatch.chdir(tmp_path)
    write_vocab(tmp_path / "vocab")
    common = ["--gin_file=experiments/biomed_encoders/ranking_bert_tiny.gin",
              "--gin.MODEL_DIR='run'", "--gin.ENCODER_VOCAB='vocab'",
              f"--gin.DATA_DIR='{data_dir}'", "--gin.MAX_SEQ_LENGTH=32"]
    try:
        assert cli.main(["train", *common, "--gin.TRAIN_STEPS=3", "--gin.BATCH_SIZE=8",
                         "--gin.rank_qa_eval.AnswerRankingEvaluator.batch_size=512",
                         "--gin.eval_lib.TeacherForcedEvaluator.batch_size=512"]) == 0
        assert cli.main(["eval", *common, "--gin_file=runs/encoder_eval.gin",
                         "--gin.EVAL_BATCH_SIZE=512",
                         "--gin.ENCODER_EVALUATORS=[@rank_qa_eval.AnswerRankingEvaluator()]"]) == 0
    finally:  # the CLI sets the process's data folder and bad-row policy from gin
        files.set_data_dir(None)
        files.set_on_bad_row(None)
    for path in (tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "eval" / "metrics.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        ranking = {r["task"]: r for r in records if r.get("split") == "validation_ranking"}
        assert set(ranking) == set(biomed_pairs.RANKING_BERT_TASKS), path
        for r in ranking.values():
            assert 0 <= r["accuracy"] <= 100 and 0 <= r["mrr"] <= 100
            assert r["answers"] == 234 and r["questions"] == 25  # MEDIQA-2019 validation set
