"""Disease knowledge infusion for encoders (`ktx.data.mlm_features`, the
`biomed_disease_infusion_bert_*` tasks): the masking of each setting on hand-made piece
ids, the row layout, the registered tasks over inline triples with a character-level
WordPiece vocabulary, and `ktx train` on the real LiveQA triples followed by a fine-tuning
run started from the infusion checkpoint."""

from __future__ import annotations

import json
import logging
import string

import numpy as np
import pytest
import seqio

import ktx.tasks  # noqa: F401
from ktx import cli
from ktx.data import files, mlm_features, wordpiece
from ktx.data.pipeline import MultiTaskInput
from ktx.tasks import biomed_infusion
from ktx.training import initial_params
from tests.tasks._fixtures import root, write  # noqa: F401

MASK, BLANK, V = 4, 5, 50
# question "what is the <symptoms> of <flu>?" and a passage that names flu twice
Q = [10, 11, 12, 20, 13, 30, 14]  # what is the symptoms of flu ?
P = [12, 30, 15, 16, 30, 17]  # the flu gives fever flu .
DISEASE, ASPECT = [30], [20]


def _pieces(mask="disease_and_aspect", auxiliary_sentence=True, blank_rate=0.25, seed=0):
    return mlm_features.infusion_pieces(
        Q, P, DISEASE, ASPECT, np.random.default_rng(seed), mask=mask,
        auxiliary_sentence=auxiliary_sentence, blank_rate=blank_rate, mask_id=MASK,
        blank_id=BLANK, vocab_size=V)


def test_targeted_masks_by_hand():
    a, b, ta, tb = _pieces(blank_rate=0.0)
    assert a.tolist() == [10, 11, 12, MASK, 13, MASK, 14]
    assert ta.tolist() == [0, 0, 0, 20, 0, 30, 0]
    assert b.tolist() == P and tb.tolist() == [0] * 6  # blanks off; the passage predicts nothing
    a, b, _, tb = _pieces(blank_rate=1.0)
    assert b.tolist() == [12, BLANK, 15, 16, BLANK, 17] and tb.tolist() == [0] * 6
    a, _, ta, _ = _pieces("disease", blank_rate=0.0)  # ablation: the aspect stays visible
    assert a.tolist() == [10, 11, 12, 20, 13, MASK, 14] and ta.tolist() == [0] * 5 + [30, 0]
    a, _, ta, _ = _pieces("aspect", blank_rate=0.0)  # ablation: the disease stays visible
    assert a.tolist() == [10, 11, 12, MASK, 13, 30, 14] and ta.tolist() == [0, 0, 0, 20, 0, 0, 0]
    a, b, ta, tb = _pieces(auxiliary_sentence=False)  # ablation: the passage alone
    assert a.tolist() == [12, MASK, 15, 16, MASK, 17] and ta.tolist() == [0, 30, 0, 0, 30, 0]
    assert b.size == 0 and tb.size == 0
    # Pieces, not spans, as the authors' code: a template piece that is also a disease
    # piece ("the" in a disease named "the flu") is masked too.
    a, _, _, _ = mlm_features.infusion_pieces(
        Q, P, [12, 30], ASPECT, np.random.default_rng(0), mask_id=MASK, blank_id=BLANK, vocab_size=V)
    assert a.tolist() == [10, 11, MASK, MASK, 13, MASK, 14]


def test_blank_rate_and_random_masking():
    blanks = [int((_pieces(blank_rate=0.25, seed=s)[1] == BLANK).sum()) for s in range(400)]
    assert abs(np.mean(blanks) / 2 - 0.25) < 0.05  # 2 disease pieces per passage
    a, b, ta, tb = _pieces("random", seed=3)
    for pieces, got, targets in ((Q, a, ta), (P, b, tb)):
        chosen = targets > 0
        assert chosen.sum() == max(1, round(len(pieces) * 0.15))  # BERT's count
        np.testing.assert_array_equal(targets[chosen], np.asarray(pieces)[chosen])
        np.testing.assert_array_equal(got[~chosen], np.asarray(pieces)[~chosen])
    again = _pieces("random", seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(again, (a, b, ta, tb)))
    # 80 / 10 / 10 over many draws of a long text
    long = np.arange(6, 46)
    kinds = []
    for s in range(300):
        got, tgt = mlm_features._random_mask(long, np.random.default_rng(s), mask_id=MASK, vocab_size=V)
        chosen = tgt > 0
        kinds += ["mask" if g == MASK else "same" if g == t else "random"
                  for g, t in zip(got[chosen], tgt[chosen])]
    shares = {k: kinds.count(k) / len(kinds) for k in ("mask", "same", "random")}
    assert abs(shares["mask"] - 0.8) < 0.03 and abs(shares["same"] - 0.1) < 0.03, shares


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="mask='x'"):
        _pieces("x")
    with pytest.raises(ValueError, match="auxiliary sentence"):
        _pieces("aspect", auxiliary_sentence=False)
    with pytest.raises(ValueError, match="blank_rate"):
        biomed_infusion.add_disease_infusion_encoder_task("bad_blank", "jsonl", blank_rate=2.0)
    with pytest.raises(ValueError, match="auxiliary_sentence=True"):
        biomed_infusion.add_disease_infusion_encoder_task("bad_aspect", "jsonl", mask="aspect",
                                                          auxiliary_sentence=False)


def test_convert_mlm_moves_targets_with_their_pieces():
    out = mlm_features.convert_mlm([[7, MASK, 8], [MASK] * 6], [[9, 9], []], [[0, 21, 0], [22] * 6],
                                   [[0, 0], []], 8, cls_id=2, sep_id=3)
    assert out["input_ids"].tolist() == [[2, 7, MASK, 8, 3, 9, 9, 3], [2] + [MASK] * 6 + [3]]
    assert out["mlm_targets"].tolist() == [[0, 0, 21, 0, 0, 0, 0, 0], [0] + [22] * 6 + [0]]
    np.testing.assert_array_equal(out["mlm_weights"], out["mlm_targets"] > 0)
    assert out["token_type_ids"].tolist()[0] == [0] * 5 + [1] * 3
    cut = mlm_features.convert_mlm([[MASK] * 9], [[]], [[22] * 9], [[]], 6, cls_id=2, sep_id=3)
    assert cut["mlm_targets"].tolist() == [[0, 22, 22, 22, 22, 0]]  # truncation drops targets too
    with pytest.raises(ValueError, match="one target per piece"):
        mlm_features.convert_mlm([[1, 2]], [[]], [[0]], [[]], 6, cls_id=2, sep_id=3)


def char_vocab(folder):
    """A WordPiece vocabulary that spells any lower-case ASCII word by characters."""
    letters = list(string.ascii_lowercase + string.digits)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]", "what", "is", "the",
              "of", "?", ".", ",", "-", "(", ")", "'", *letters, *("##" + c for c in letters)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return folder, tokens


def test_registered_tasks_over_inline_triples(root, tmp_path):  # noqa: F811
    rows = [{"disease": "Flu", "aspect": "SYMPTOMS", "passage": "The flu gives a fever. Flu spreads."},
            {"disease": "gout", "aspect": "treatment", "passage": "Rest helps gout."}]
    write(root, "biomed/disease_infusion/train.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    vocab, tokens = char_vocab(tmp_path / "vocab")
    name = "test_infusion_bert_inline"
    if name not in seqio.TaskRegistry.names():
        biomed_infusion.add_disease_infusion_encoder_task(
            name, "jsonl", {"train": ("biomed/disease_infusion/train.jsonl",)}, blank_rate=1.0)
    with wordpiece.encoder_vocabulary_scope(vocab):
        task = seqio.get_mixture_or_task(name)
        examples = list(task.get_dataset(None, split="train", shuffle=False, seed=1,
                                          trim_output_features=False).as_numpy_iterator())
        vocabulary = wordpiece.WordPieceVocabulary(vocab)
        flu, symptoms = (vocabulary.encode(w) for w in ("flu", "symptoms"))
        first = examples[0]
        # "what is the [MASK]x8 of [MASK]x3 ?": every piece of the aspect and the disease
        assert first["text_a"].tolist() == [6, 7, 8, *[4] * len(symptoms), 9, *[4] * len(flu), 10]
        assert [t for t in first["mlm_a"].tolist() if t] == symptoms + flu
        assert tokens.index("[unused0]") in first["text_b"].tolist()  # the passage's flu blanked
        assert not first["mlm_b"].any()
        inp = MultiTaskInput(name, {"inputs": 32}, 2, seed=1, encoder_vocabulary=str(vocab))
        batch = inp.get_batch(0)
    assert inp.kind == "mlm"
    assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "mlm_targets",
                          "mlm_weights", "task_id"}
    assert batch["mlm_weights"].dtype == np.float32
    np.testing.assert_array_equal(batch["mlm_weights"] > 0, batch["mlm_targets"] > 0)
    np.testing.assert_array_equal(batch["input_ids"][batch["mlm_weights"] > 0], 4)
    with pytest.raises(ValueError, match="num_labels"):
        MultiTaskInput(name, {"inputs": 32}, 2, encoder_vocabulary=str(vocab), num_labels=2)


def test_vocabulary_without_the_blank_token_is_named(root, tmp_path):  # noqa: F811
    write(root, "biomed/disease_infusion/train.jsonl",
          json.dumps({"disease": "flu", "aspect": "cause", "passage": "the flu."}) + "\n")
    vocab = tmp_path / "vocab"
    vocab.mkdir()
    (vocab / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\n", encoding="utf-8")
    name = "test_infusion_bert_no_blank"
    if name not in seqio.TaskRegistry.names():
        biomed_infusion.add_disease_infusion_encoder_task(
            name, "jsonl", {"train": ("biomed/disease_infusion/train.jsonl",)})
    with pytest.raises(files.DataFileError, match=r"no token '\[unused0\]'"):
        MultiTaskInput(name, {"inputs": 16}, 1, encoder_vocabulary=str(vocab))


def _train(args):
    try:
        assert cli.main(["train", *args]) == 0
    finally:  # the CLI sets the process's data folder and bad-row policy from gin
        files.set_data_dir(None)
        files.set_on_bad_row(None)


def test_ktx_train_infusion_then_fine_tune(data_dir, tmp_path, monkeypatch, caplog):
    """The real LiveQA triples: 3 infusion steps of a tiny BERT, then a fine-tuning run on
    CS224N started from that checkpoint (encoder and pooler restored, MLM head unused)."""
    if not (data_dir / "biomed" / "liveqa2017" / "TREC-2017-LiveQA-Medical-Train-1.xml").is_file():
        pytest.skip(f"{data_dir}/biomed/liveqa2017/ has no LiveQA train files")
    if not (data_dir / "cs224n" / "quora-dev.csv").is_file():
        pytest.skip(f"{data_dir}/cs224n/ has no CS224N files")
    monkeypatch.chdir(tmp_path)
    vocab, tokens = char_vocab(tmp_path / "vocab")
    common = [f"--gin.ENCODER_VOCAB='{vocab}'", f"--gin.DATA_DIR='{data_dir}'",
              f"--gin.VOCAB_SIZE={len(tokens)}", "--gin.BATCH_SIZE=8", "--gin.MAX_SEQ_LENGTH=48",
              "--gin.train_script.train.log_period=1"]
    _train(["--gin_file=experiments/biomed_encoders/infusion_bert_tiny.gin",
            "--gin.MODEL_DIR='infusion'", "--gin.TRAIN_STEPS=3", *common])
    records = [json.loads(x) for x in (tmp_path / "infusion" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("task") == "biomed_disease_infusion_bert_v001"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["weight"] > 0 and np.isfinite(r["loss"]) and "infusion" in r for r in train)
    caplog.set_level(logging.INFO, logger=initial_params._log.name)
    _train(["--gin_file=experiments/cs224n_encoders/bert_tiny.gin", "--gin.MODEL_DIR='tuned'",
            "--gin.INITIAL_CHECKPOINT_PATH='infusion'", "--gin.TRAIN_STEPS=1",
            "--gin.train_script.train.eval_period=0", *common])
    report = [r.getMessage() for r in caplog.records if "INITIAL_CHECKPOINT_PATH" in r.getMessage()]
    assert len(report) == 1, report
    lines = report[0].splitlines()
    initialized = sorted(x.split(": ")[1] for x in lines if x.startswith("  initialized: "))
    unused = sorted(x.split(": ")[1] for x in lines if x.startswith("  unused in checkpoint: "))
    # only the three task heads start fresh; the MLM head is what the classifier leaves out
    assert initialized == [f"task_heads/task_{t}/{p}" for t in range(3) for p in ("bias", "kernel")]
    assert unused == ["mlm/bias", "mlm/layer_norm/bias", "mlm/layer_norm/scale",
                      "mlm/transform/bias", "mlm/transform/kernel"]
