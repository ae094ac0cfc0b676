"""Disease NER as token tagging (`biomed_*_disease_bert_v001`, `ktx.tasks.biomed_tagging`):
the registered tasks over inline IOB files and a tiny vocab.txt, bad tags named with file
and line, a mixture of a tagging and a sequence task, and `ktx train` + `ktx eval` of a
tiny BERT on the real files (skipped without KTX_DATA_DIR)."""

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
from ktx.tasks import biomed_tagging
from tests.data.test_wordpiece import ids, write_vocab
from tests.tasks._fixtures import root, vocab_dir, write  # noqa: F401

NCBI = "biomed_ncbi_disease_bert_v001"
IGN = ef.IGNORE_LABEL
SENTENCES = ("The\tO\nunaffable\tB-Disease\ncats\tI-Disease\nsat\tO\n\n"
             "Hello\tO\ncat\tB-Disease\n\n")


def test_registered_tasks_and_mixture():
    assert biomed_tagging.NER_BERT_TASKS == (NCBI, "biomed_bc5cdr_disease_bert_v001")
    assert encoder_num_labels("biomed_ner_bert_v001") == (3, 3)
    for name in biomed_tagging.NER_BERT_TASKS:
        task = seqio.get_mixture_or_task(name)
        assert ef.is_encoder_task(task) and ef.label_space(task).is_tagging
        assert tuple(task.splits) == ("train", "validation", "test")


def test_words_are_tokenized_one_by_one(root, vocab_dir):
    write(root, "biomed/ncbi_disease/devel.tsv", SENTENCES)
    with wordpiece.encoder_vocabulary_scope(vocab_dir):
        ds = seqio.get_mixture_or_task(NCBI).get_dataset(
            None, split="validation", shuffle=False, trim_output_features=False)
        rows = [{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in ex.items()}
                for ex in ds.as_numpy_iterator()]
    assert rows[0]["text_a"] == ids("the", "un", "##aff", "##able", "cat", "##s", "sat")
    assert rows[0]["word_lengths"] == [1, 3, 2, 1] and rows[0]["label"] == [0, 1, 2, 0]
    assert rows[0]["text_b"] == [] and rows[0]["line"] == 1
    assert rows[1]["text_a"] == ids("hello", "cat") and rows[1]["label"] == [0, 1]
    inp = MultiTaskInput(NCBI, {"inputs": 8}, batch_size=2, split="validation", shuffle=False,
                         encoder_vocabulary=vocab_dir, num_labels=3, head_kinds="tagging")
    batch = inp.get_batch(0)
    assert batch["input_ids"][0].tolist() == [2, *ids("the", "un", "##aff", "##able", "cat",
                                                      "##s"), 3]
    assert batch["token_labels"][0].tolist() == [IGN, 0, 1, IGN, IGN, 2, IGN, IGN]
    assert batch["words_cut"].tolist() == [1, 0]  # "sat" did not fit (logged)
    assert batch["token_labels"][1].tolist() == [IGN, 0, 1, IGN, IGN, IGN, IGN, IGN]


def test_a_word_without_pieces_becomes_unk(root, vocab_dir):
    write(root, "biomed/ncbi_disease/test.tsv", "cat\tB-Disease\n\u200b\tI-Disease\n\n")
    inp = MultiTaskInput(NCBI, {"inputs": 8}, batch_size=1, split="test",
                         encoder_vocabulary=vocab_dir, head_kinds="tagging")
    batch = inp.get_batch(0)
    assert batch["input_ids"][0].tolist()[:4] == [2, *ids("cat", "[UNK]"), 3]
    assert batch["token_labels"][0].tolist()[:4] == [IGN, 1, 2, IGN]


@pytest.mark.parametrize("tag,why", [
    ("X-Disease", "not a BIO tag"),
    ("I-Chemical", "entity type 'Chemical', not one of the label set's types ['Disease']"),
    ("B-disease", "entity type 'disease'"),
])
def test_tags_outside_the_bio_set_name_file_and_line(root, vocab_dir, tag, why):
    path = write(root, "biomed/ncbi_disease/train.tsv", f"The\tO\ncat\tB-Disease\nsat\t{tag}\n\n")
    with pytest.raises(files.DataFileError) as info:
        MultiTaskInput(NCBI, {"inputs": 8}, batch_size=1, encoder_vocabulary=vocab_dir)
    message = str(info.value)
    assert f"{path}:3: unknown tag '{tag}'" in message and why in message
    assert "accepted: ['B-Disease', 'I-Disease', 'O']" in message


def test_head_kinds_are_checked(root, vocab_dir):
    with pytest.raises(ValueError, match=r"needs a 'tagging' head.*HEAD_KINDS = \('tagging', "
                                         r"'tagging'\)"):
        MultiTaskInput("biomed_ner_bert_v001", {"inputs": 8}, batch_size=2,
                       encoder_vocabulary=vocab_dir, head_kinds="sequence")


def test_a_mixture_of_a_tagging_and_a_sequence_task(root, vocab_dir):
    write(root, "biomed/ncbi_disease/train.tsv", SENTENCES)
    write(root, "cs224n/ids-sst-train.csv",
          "\tid\tsentence\tsentiment\n0\tab12\tThe cat sat .\t3\n1\tcd34\tHello !\t0\n")
    name = "test_ner_and_sst5_bert"
    if name in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove(name)
    seqio.MixtureRegistry.add(name, [NCBI, "cs224n_sst5_bert_v001"], default_rate=1.0)
    try:
        inp = MultiTaskInput(name, {"inputs": 10}, batch_size=4, encoder_vocabulary=vocab_dir,
                             num_labels=(3, 5), head_kinds=("tagging", "sequence"))
        batch = inp.get_batch(0)
    finally:
        seqio.MixtureRegistry.remove(name)
    tagging_rows = batch["task_id"] == 0
    assert tagging_rows.sum() == 2
    assert (batch["token_labels"][~tagging_rows] == IGN).all()
    assert ((batch["token_labels"][tagging_rows] >= 0).sum(axis=1) > 0).all()
    assert sorted(batch["label"][~tagging_rows].tolist()) == [0.0, 3.0]


def test_ktx_train_and_eval_ner_tiny_bert(data_dir, tmp_path, monkeypatch):
    """`ktx train` of experiments/biomed_encoders/ner_bert_tiny.gin on the real NCBI and
    BC5CDR files (3 steps), its entity-level evaluation, then `ktx eval` of the run."""
    if not (data_dir / "biomed" / "ncbi_disease" / "train.tsv").is_file():
        pytest.skip(f"{data_dir}/biomed/ncbi_disease/ has no NER files")
    monkeypatch.chdir(tmp_path)
    vocab = write_vocab(tmp_path / "vocab")
    common = ["--gin_file=experiments/biomed_encoders/ner_bert_tiny.gin",
              "--gin.MODEL_DIR='run'", f"--gin.ENCODER_VOCAB='{vocab}'",
              f"--gin.DATA_DIR='{data_dir}'", "--gin.MAX_SEQ_LENGTH=32",
              # `ktx eval` reads the validation rows `ktx train` converted (same files,
              # vocabulary and lengths)
              "--gin.pipeline.MultiTaskInput.cache_dir='rows'"]
    try:
        rc = cli.main(["train", *common, "--gin.TRAIN_STEPS=3", "--gin.BATCH_SIZE=8",
                       "--gin.train_script.train.log_period=1",
                       "--gin.tag_eval.TaggingEvaluator.batch_size=512",
                       "--gin.eval_lib.TeacherForcedEvaluator.batch_size=512"])
        assert rc == 0
        rc = cli.main(["eval", *common, "--gin_file=runs/encoder_eval.gin",
                       "--gin.EVAL_BATCH_SIZE=512"])
        assert rc == 0
    finally:  # the CLI sets the process's data folder and bad-row policy from gin
        files.set_data_dir(None)
        files.set_on_bad_row(None)
    records = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    assert sorted({r["step"] for r in train}) == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) and 0 <= r["token_correct"] <= r["tokens"]
               for r in train if r["task"] != "all")
    for run_records in (records, [json.loads(line) for line in
                                  (tmp_path / "run" / "eval" / "metrics.jsonl")
                                  .read_text().splitlines()]):
        entities = {r["task"]: r for r in run_records if r.get("split") == "validation_entities"}
        assert set(entities) == set(biomed_tagging.NER_BERT_TASKS)
        for r in entities.values():
            assert 0 <= r["entity_f1"] <= 100 and 0 <= r["token_accuracy"] <= 100
            assert r["entities"] > 700  # NCBI devel: 787 gold entities, BC5CDR: 4,246
