"""Encoder features (`ktx.data.encoder_features`) and `MultiTaskInput` on encoder tasks
registered here over inline rows, with a tiny vocab.txt."""

from __future__ import annotations

import random

import numpy as np
import pytest
import seqio
import tensorflow as tf

from ktx.data import encoder_features as ef
from ktx.data import vocab as vocab_lib
from ktx.data import wordpiece
from ktx.data.pipeline import MultiTaskInput, encoder_num_labels
from tests.data.test_wordpiece import TOKENS, ids, write_vocab

L = 12
SST = [("the cat sat", None, 2.0), ("the mat", None, 0.0), ("hello!", None, 4.0),
       ("on the mat", None, 1.0), ("unaffable cat", None, 3.0)]
STS = [("the cat", "the mat", 2.5), ("cat sat on the mat", "the cat sat on the mat .", 4.8),
       ("hello", "", 0.0)]


def _register(name, rows, labels, splits=("train", "validation")):
    def dataset_fn(split, shuffle_files, seed=None):
        del shuffle_files, seed
        data = rows if split == "train" else rows[:2]
        return tf.data.Dataset.from_tensor_slices({
            "a": [r[0] for r in data], "b": [r[1] or "" for r in data],
            "label": np.asarray([r[2] for r in data], np.float32)})

    if name in seqio.TaskRegistry.names():
        seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(
        name, source=seqio.FunctionDataSource(dataset_fn, splits=splits),
        preprocessors=[lambda ds: ds.map(lambda x: {"text_a": x["a"], "text_b": x["b"],
                                                    "label": x["label"]}),
                       ef.tokenize_texts],
        output_features=ef.encoder_output_features(wordpiece.ENCODER_VOCABULARY, labels))


_register("ktx_test_enc_sst", SST, ef.LabelSpace(("a", "b", "c", "d", "e")))
_register("ktx_test_enc_sts", STS, ef.LabelSpace.regression(0, 5))
_register("ktx_test_enc_bad", [("the", None, 2.0)], ef.LabelSpace(("no", "yes")))
if "ktx_test_enc_mix" in seqio.MixtureRegistry.names():
    seqio.MixtureRegistry.remove("ktx_test_enc_mix")
seqio.MixtureRegistry.add("ktx_test_enc_mix", [("ktx_test_enc_sst", 1.0), ("ktx_test_enc_sts", 1.0)])


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    return write_vocab(tmp_path_factory.mktemp("vocab"))


@pytest.fixture(scope="module")
def enc(vocab_dir):
    return MultiTaskInput("ktx_test_enc_mix", {"inputs": L}, batch_size=4, seed=3,
                          encoder_vocabulary=vocab_dir, num_labels=(5, 1))


def test_convert_encoder_by_hand():
    out = ef.convert_encoder([[7, 8], [5, 6, 7, 8, 9]], [[], [10, 11, 12]], [1, 2.5], 8,
                             cls_id=2, sep_id=3)
    np.testing.assert_array_equal(out["input_ids"], [[2, 7, 8, 3, 0, 0, 0, 0],
                                                     [2, 5, 6, 7, 3, 10, 11, 3]])
    np.testing.assert_array_equal(out["token_type_ids"], [[0] * 8, [0, 0, 0, 0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(out["attention_mask"], [[1, 1, 1, 1, 0, 0, 0, 0], [1] * 8])
    assert out["label"].dtype == np.float32 and out["label"].tolist() == [1.0, 2.5]


def test_truncation_and_layout_match_hugging_face_tokenizers(vocab_dir):
    """[CLS] a [SEP] b [SEP], token types and longest-first cuts as the `tokenizers`
    library's own BERT post-processor and truncation give them."""
    from tokenizers import processors

    vocab = wordpiece.WordPieceVocabulary(vocab_dir)
    reference = wordpiece.WordPieceVocabulary(vocab_dir)._tokenizer  # its own copy
    reference.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    words = ["the", "cat", "sat", "on", "mat", "hello", "unaffable", "cats"]
    rng = random.Random(0)
    for length in (5, 8, 13):
        reference.enable_truncation(length, strategy="longest_first")
        reference.enable_padding(length=length)
        for _ in range(60):
            a = " ".join(rng.choices(words, k=rng.randint(1, 9)))
            b = " ".join(rng.choices(words, k=rng.randint(0, 9)))
            want = reference.encode(a, b) if b else reference.encode(a)
            got = ef.convert_encoder([vocab.encode(a)], [vocab.encode(b)], [0], length,
                                     cls_id=2, sep_id=3)
            assert got["input_ids"][0].tolist() == want.ids, (a, b, length)
            assert got["token_type_ids"][0].tolist() == want.type_ids, (a, b, length)
            assert got["attention_mask"][0].tolist() == want.attention_mask, (a, b, length)


def test_input_rows_and_layout(enc):
    assert enc.kind == "encoder" and enc.task_sizes == (5, 3)
    assert encoder_num_labels("ktx_test_enc_mix") == (5, 1)
    batch = enc.get_batch(0)
    assert {k: v.dtype for k, v in batch.items()} == {
        "input_ids": np.int32, "token_type_ids": np.int32, "attention_mask": np.int32,
        "label": np.float32, "task_id": np.int32}
    counts = enc.task_counts(0)
    np.testing.assert_array_equal(batch["task_id"], np.repeat([0, 1], counts))
    # every row is one of its task's examples, [CLS] first
    rows = {0: {r[0]: r[2] for r in SST}, 1: {r[0]: r[2] for r in STS}}
    vocab = wordpiece.WordPieceVocabulary(enc.encoder_vocabulary)
    for ids_, types, mask, t, label in zip(batch["input_ids"], batch["token_type_ids"],
                                           batch["attention_mask"], batch["task_id"], batch["label"]):
        assert ids_[0] == 2
        first = vocab.decode(ids_[(types == 0) & (mask == 1)][1:-1])
        # (pairs longer than L are cut: the decoded text is a prefix)
        matches = [v for k, v in rows[int(t)].items() if k.replace(" !", "!").startswith(first)]
        assert matches and matches[0] == pytest.approx(label), first
    # a pure function of the step: a new input (a resumed run) gives the same batches
    again = enc.replace()
    for step in (0, 1, 7):
        for k, v in enc.get_batch(step).items():
            np.testing.assert_array_equal(v, again.get_batch(step)[k])


def test_sts_pair_tokens(enc):
    arrays = enc.eval_arrays("ktx_test_enc_sts", "train")
    want = [2, *ids("the", "cat"), 3, *ids("the", "mat"), 3]
    assert arrays["input_ids"][0][:len(want)].tolist() == want
    assert arrays["token_type_ids"][0][:len(want)].tolist() == [0, 0, 0, 0, 1, 1, 1]
    # "hello" with an empty second text: a single sentence
    assert arrays["input_ids"][2][:3].tolist() == [2, *ids("hello"), 3]
    assert arrays["token_type_ids"][2].sum() == 0


def test_eval_batches_pad_with_unattended_rows(enc):
    batches = list(enc.eval_batches("ktx_test_enc_sts", "validation", batch_size=4))
    assert len(batches) == 1
    batch, num_real = batches[0]
    assert num_real == 2 and batch["attention_mask"][2:].sum() == 0
    assert batch["task_id"].tolist() == [1, 1, 1, 1]


def test_cache_dir_round_trip(vocab_dir, tmp_path):
    kw = dict(batch_size=4, encoder_vocabulary=vocab_dir, cache_dir=tmp_path)
    first = MultiTaskInput("ktx_test_enc_mix", {"inputs": L}, **kw)
    assert len(list(tmp_path.rglob("*.npz"))) == 2
    second = MultiTaskInput("ktx_test_enc_mix", {"inputs": L}, **kw)
    for k, v in first.get_batch(2).items():
        np.testing.assert_array_equal(v, second.get_batch(2)[k])


def test_head_sizes_must_match_the_labels(vocab_dir):
    with pytest.raises(ValueError, match=r"num_labels \(NUM_LABELS\) = \(5, 2\) gives task "
                       r"'ktx_test_enc_sts' \(task id 1\) a head of 2 label\(s\), but its labels "
                       r"are a regression .*num_labels=1. For these tasks bind NUM_LABELS = \(5, 1\)"):
        MultiTaskInput("ktx_test_enc_mix", {"inputs": L}, batch_size=4,
                       encoder_vocabulary=vocab_dir, num_labels=(5, 2))
    with pytest.raises(ValueError, match=r"has 1 entries but the mixture has 2 tasks"):
        MultiTaskInput("ktx_test_enc_mix", {"inputs": L}, batch_size=4,
                       encoder_vocabulary=vocab_dir, num_labels=(5,))
    with pytest.raises(ValueError, match=r"gives task 'ktx_test_enc_sst' \(task id 0\) a head of "
                       r"2 label\(s\), but its labels are 5 classes"):
        MultiTaskInput("ktx_test_enc_mix", {"inputs": L}, batch_size=4,
                       encoder_vocabulary=vocab_dir, num_labels=2)


def test_labels_outside_the_label_space(vocab_dir):
    with pytest.raises(ValueError, match=r"task 'ktx_test_enc_bad' split 'train': example 0 has "
                       r"label 2.0; the task's labels are 2 classes \['no', 'yes'\], a class index 0..1"):
        MultiTaskInput("ktx_test_enc_bad", {"inputs": L}, batch_size=2, encoder_vocabulary=vocab_dir)


def test_bad_options(vocab_dir, monkeypatch):
    with pytest.raises(ValueError, match=r"accepted for the encoder tasks .*\{'inputs': L\}"):
        MultiTaskInput("ktx_test_enc_mix", {"inputs": L, "targets": 4}, batch_size=4,
                       encoder_vocabulary=vocab_dir)
    with pytest.raises(ValueError, match="pack=True: encoder tasks"):
        MultiTaskInput("ktx_test_enc_mix", {"inputs": L}, batch_size=4, pack=True,
                       encoder_vocabulary=vocab_dir)
    monkeypatch.delenv(wordpiece.ENCODER_VOCAB_ENV, raising=False)
    with pytest.raises(ValueError, match="need a WordPiece vocabulary: set the gin macro ENCODER_VOCAB"):
        MultiTaskInput("ktx_test_enc_mix", {"inputs": L}, batch_size=4)
    with pytest.raises(ValueError, match="accepted: an int >= 4"):
        ef.convert_encoder([[1]], [[]], [0], 3, cls_id=2, sep_id=3)


def test_num_labels_is_for_encoder_tasks():
    features = {k: seqio.Feature(vocab_lib.byte_vocabulary()) for k in ("inputs", "targets")}
    if "ktx_test_enc_t5" in seqio.TaskRegistry.names():
        seqio.TaskRegistry.remove("ktx_test_enc_t5")
    seqio.TaskRegistry.add("ktx_test_enc_t5", source=seqio.FunctionDataSource(
        lambda split, shuffle_files, seed=None: tf.data.Dataset.from_tensors(
            {"inputs": "a", "targets": "b"}), splits=("train",)),
        preprocessors=[seqio.preprocessors.tokenize], output_features=features)
    with pytest.raises(ValueError, match="num_labels=2 applies to encoder tasks"):
        MultiTaskInput("ktx_test_enc_t5", {"inputs": 4, "targets": 4}, batch_size=1, num_labels=2)


def test_label_space():
    assert ef.LabelSpace(("x", "y", "z")).num_labels == 3
    assert ef.LabelSpace.regression(0, 5).num_labels == 1
    with pytest.raises(ValueError, match="not both"):
        ef.LabelSpace(("x", "y"), score_range=(0, 1))
    with pytest.raises(ValueError, match="2 or more distinct"):
        ef.LabelSpace(("x", "x"))
    ef.check_labels(np.array([0.0, 5.0]), ef.LabelSpace.regression(0, 5), source="s")
    with pytest.raises(ValueError, match=r"s: example 1 has label nan; .*score in \[0, 5\]"):
        ef.check_labels(np.array([0.0, np.nan]), ef.LabelSpace.regression(0, 5), source="s")
    with pytest.raises(ValueError, match=r"example 0 has label 0.5"):
        ef.check_labels(np.array([0.5]), ef.LabelSpace(("x", "y")), source="s")
