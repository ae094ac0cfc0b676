"""Encoder tasks (`*_bert_v001`) over inline rows in the official layouts, a tiny vocab.txt,
and a few `ktx train` steps of a tiny BERT on the real CS224N data."""

from __future__ import annotations

import json

import numpy as np
import pytest
import seqio

import ktx.tasks  # noqa: F401
from ktx import cli
from ktx.data import encoder_features as ef
from ktx.data import files, wordpiece
from ktx.data.pipeline import MultiTaskInput, encoder_num_labels
from ktx.tasks import cs224n, glue
from tests.data.test_wordpiece import ids, write_vocab
from tests.tasks._fixtures import root, vocab_dir, write  # noqa: F401


def _examples(task_name, split, vocab_dir):
    with wordpiece.encoder_vocabulary_scope(vocab_dir):
        ds = seqio.get_mixture_or_task(task_name).get_dataset(
            None, split=split, shuffle=False, trim_output_features=False)
        return [{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in ex.items()}
                for ex in ds.as_numpy_iterator()]


def test_registered_names_and_heads():
    assert cs224n.CS224N_BERT_TASKS == ("cs224n_sst5_bert_v001", "cs224n_quora_bert_v001",
                                        "cs224n_sts_bert_v001")
    assert glue.GLUE_BERT_TASKS == tuple(f"glue_{t}_bert_v001"
                                         for t in ("cola", "sst2", "mrpc", "stsb", "rte"))
    assert encoder_num_labels("cs224n_bert_v001") == (5, 2, 1)
    assert encoder_num_labels("glue_bert_v001") == (2, 2, 2, 1, 2)
    for name in cs224n.CS224N_BERT_TASKS + glue.GLUE_BERT_TASKS:
        assert ef.is_encoder_task(seqio.get_mixture_or_task(name))


def test_sst5_and_sts(root, vocab_dir):
    write(root, "cs224n/ids-sst-dev.csv",
          "\tid\tsentence\tsentiment\n0\tab12\t The cat sat .\t3\n1\tcd34\t Hello !\t0\n")
    assert _examples("cs224n_sst5_bert_v001", "validation", vocab_dir) == [
        {"text_a": ids("the", "cat", "sat", "."), "text_b": [], "label": 3.0, "idx": 0},
        {"text_a": ids("hello", "!"), "text_b": [], "label": 0.0, "idx": 1}]
    write(root, "cs224n/sts-train.csv", "\tid\tsentence1\tsentence2\tsimilarity\n"
          "1\ta\tThe cat.\tThe mat.\t1.1\n")
    out = _examples("cs224n_sts_bert_v001", "train", vocab_dir)
    assert out[0]["text_a"] == ids("the", "cat", ".") and out[0]["text_b"] == ids("the", "mat", ".")
    assert out[0]["label"] == pytest.approx(1.1)


def test_quora_is_split_from_the_dev_file(root, vocab_dir):
    lines = "".join(f"{i}\tq{i}\tthe cat\ton the mat\t{i % 2}.0\n" for i in range(25))
    write(root, "cs224n/quora-dev.csv", "\tid\tsentence1\tsentence2\tis_duplicate\n" + lines)
    train = _examples("cs224n_quora_bert_v001", "train", vocab_dir)
    validation = _examples("cs224n_quora_bert_v001", "validation", vocab_dir)
    assert [e["idx"] for e in validation] == [0, 10, 20]
    assert [e["idx"] for e in train] == [i for i in range(25) if i % 10]
    assert train[0]["text_a"] == ids("the", "cat") and train[0]["text_b"] == ids("on", "the", "mat")
    assert [e["label"] for e in validation] == [0.0, 0.0, 0.0] and train[0]["label"] == 1.0


def test_glue_rte_and_cola(root, vocab_dir):
    write(root, "glue/RTE/dev.tsv", "index\tsentence1\tsentence2\tlabel\n"
          "0\tThe cat sat.\tA cat sat.\tnot_entailment\n")
    assert _examples("glue_rte_bert_v001", "validation", vocab_dir) == [
        {"text_a": ids("the", "cat", "sat", "."), "text_b": ids("[UNK]", "cat", "sat", "."),
         "label": 1.0, "idx": 0}]
    write(root, "glue/CoLA/train.tsv", "gj04\t1\t\tThe cat sat on the mat.\n")
    assert _examples("glue_cola_bert_v001", "train", vocab_dir)[0]["label"] == 1.0
    assert tuple(seqio.get_mixture_or_task("glue_cola_bert_v001").splits) == ("train", "validation")


def test_input_over_registered_tasks(root, vocab_dir):
    write(root, "glue/STS-B/train.tsv",
          "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
          "0\tg\tf\ty\t1\tn\tn\tThe cat.\tThe mat.\t3.800\n")
    inp = MultiTaskInput("glue_stsb_bert_v001", {"inputs": 8}, batch_size=2,
                         encoder_vocabulary=vocab_dir, num_labels=1)
    batch = inp.get_batch(0)
    # longest-first on a tie: the first text gives up the piece (as `tokenizers`)
    assert batch["input_ids"][0].tolist() == [2, *ids("the", "cat"), 3, *ids("the", "mat", "."), 3]
    assert batch["label"].tolist() == pytest.approx([3.8, 3.8])


@pytest.fixture(scope="module")
def rows_flag(tmp_path_factory):
    """The file's folder of converted CS224N rows (`MultiTaskInput.cache_dir`): its runs
    read the same real files through the same vocabulary (`write_vocab`'s) at the same
    lengths, so the first run's conversion serves the others (the cache's key names the
    task, lengths, packing and seed, not the vocabulary: a folder for this file only)."""
    return f"--gin.pipeline.MultiTaskInput.cache_dir='{tmp_path_factory.mktemp('cs224n_rows')}'"


def test_ktx_train_cs224n_tiny_bert(data_dir, tmp_path, monkeypatch, rows_flag):
    """`ktx train` with models/bert_tiny.gin on the real CS224N mixture, a tiny vocab."""
    if not (data_dir / "cs224n" / "quora-dev.csv").is_file():
        pytest.skip(f"{data_dir}/cs224n/ has no CS224N files")
    monkeypatch.chdir(tmp_path)
    vocab = write_vocab(tmp_path / "vocab")
    model_dir = tmp_path / "run"
    try:
        rc = cli.main([
            "train", "--gin_file=experiments/cs224n_encoders/bert_tiny.gin",
            f"--gin.MODEL_DIR='{model_dir}'", f"--gin.ENCODER_VOCAB='{vocab}'",
            f"--gin.DATA_DIR='{data_dir}'", "--gin.TRAIN_STEPS=3", "--gin.BATCH_SIZE=8",
            "--gin.MAX_SEQ_LENGTH=24", "--gin.train_script.train.log_period=1",
            "--gin.train_script.train.eval_period=0", rows_flag])
    finally:  # the CLI sets the process's data folder and bad-row policy from gin
        files.set_data_dir(None)
        files.set_on_bad_row(None)
    assert rc == 0
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    assert sorted({r["step"] for r in train}) == [1, 2, 3]
    assert {r["task"] for r in train} == {"cs224n_sst5_bert_v001", "cs224n_quora_bert_v001",
                                          "cs224n_sts_bert_v001", "all"}
    assert all(np.isfinite(r["loss"]) for r in train)
    # the regression task reports a squared error, the classification tasks accuracy
    sts = [r for r in train if r["task"] == "cs224n_sts_bert_v001"]
    assert all(r["squared_error"] == pytest.approx(r["loss"]) for r in sts)


def _cli_train(data_dir, vocab, model_dir, steps, rows_flag, *extra):
    try:
        rc = cli.main([
            "train", "--gin_file=experiments/cs224n_encoders/bert_tiny.gin",
            "--gin_file=runs/mt_uncertainty.gin",
            f"--gin.MODEL_DIR='{model_dir}'", f"--gin.ENCODER_VOCAB='{vocab}'",
            f"--gin.DATA_DIR='{data_dir}'", f"--gin.TRAIN_STEPS={steps}", "--gin.BATCH_SIZE=24",
            "--gin.MT_UNCERTAINTY_ROWS=8", "--gin.DROPOUT_RATE=0.1",
            "--gin.MT_UNCERTAINTY_PROXIES={'cs224n_sts_bert_v001': 'cs224n_quora_bert_v001'}",
            "--gin.MAX_SEQ_LENGTH=24", "--gin.train_script.train.log_period=1",
            "--gin.train_script.train.checkpoint_period=2",
            "--gin.train_script.train.eval_period=0", rows_flag, *extra])
    finally:
        files.set_data_dir(None)
        files.set_on_bad_row(None)
    assert rc == 0
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("split") == "train"]


def test_ktx_train_mt_uncertainty_resumes_exactly(data_dir, tmp_path, monkeypatch, rows_flag):
    """runs/mt_uncertainty.gin: 24 candidates (8 per task), 8 trained; each step's rows per
    task follow the model's uncertainty; 2 steps + resume to 4 = 4 steps straight."""
    if not (data_dir / "cs224n" / "quora-dev.csv").is_file():
        pytest.skip(f"{data_dir}/cs224n/ has no CS224N files")
    monkeypatch.chdir(tmp_path)
    vocab = write_vocab(tmp_path / "vocab")
    straight = _cli_train(data_dir, vocab, tmp_path / "a", 4, rows_flag)
    _cli_train(data_dir, vocab, tmp_path / "b", 2, rows_flag)
    resumed = _cli_train(data_dir, vocab, tmp_path / "b", 4, rows_flag)

    def by_step(records, task="all"):
        return {r["step"]: r for r in records if r["task"] == task}

    assert sorted(by_step(straight)) == [1, 2, 3, 4] == sorted(by_step(resumed))
    for step in (1, 2, 3, 4):
        assert by_step(resumed)[step]["loss"] == by_step(straight)[step]["loss"]
    tasks = ("cs224n_sst5_bert_v001", "cs224n_quora_bert_v001", "cs224n_sts_bert_v001")
    for step in (1, 2, 3, 4):  # 8 rows trained per step, spread by uncertainty
        assert by_step(straight)[step]["examples"] == 8
        assert sum(by_step(straight, t).get(step, {}).get("examples", 0) for t in tasks) == 8


def test_ktx_train_mt_uncertainty_needs_a_proxy_for_regression(data_dir, tmp_path, monkeypatch,
                                                                capsys, rows_flag):
    if not (data_dir / "cs224n" / "quora-dev.csv").is_file():
        pytest.skip(f"{data_dir}/cs224n/ has no CS224N files")
    monkeypatch.chdir(tmp_path)
    vocab = write_vocab(tmp_path / "vocab")
    try:
        rc = cli.main(["train", "--gin_file=experiments/cs224n_encoders/bert_tiny.gin",
                       "--gin_file=runs/mt_uncertainty.gin", f"--gin.MODEL_DIR='{tmp_path / 'c'}'",
                       f"--gin.ENCODER_VOCAB='{vocab}'", f"--gin.DATA_DIR='{data_dir}'",
                       "--gin.TRAIN_STEPS=1", "--gin.BATCH_SIZE=24", "--gin.MT_UNCERTAINTY_ROWS=8",
                       "--gin.MAX_SEQ_LENGTH=24", rows_flag])
    finally:
        files.set_data_dir(None)
        files.set_on_bad_row(None)
    assert rc != 0
    err = capsys.readouterr().err
    assert err.startswith("ktx train: ") and "2 (cs224n_sts_bert_v001) have no entropy" in err
