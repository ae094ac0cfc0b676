"""ktx.data.wordpiece: WordPiece vocabularies from a tiny vocab.txt / tokenizer.json made here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

from ktx.data import files, wordpiece

TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat",
          "un", "##aff", "##able", "hello", ",", "!", ".", "##s", "e", "##llo"]


def write_vocab(folder, tokens=TOKENS, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def ids(*tokens):
    return [TOKENS.index(t) for t in tokens]


def test_vocab_txt_encodes_word_pieces(tmp_path):
    vocab = wordpiece.WordPieceVocabulary(write_vocab(tmp_path))
    assert vocab.file == (tmp_path / "vocab.txt").resolve() and vocab.lowercase
    assert (vocab.vocab_size, vocab.cls_id, vocab.sep_id, vocab.unk_id, vocab.pad_id) == \
        (len(TOKENS), 2, 3, 1, 0)
    assert vocab.eos_id is None
    # Lowercased, accents kept out, punctuation split, WordPiece greedy longest match,
    # unknown words -> [UNK]; no [CLS]/[SEP].
    assert vocab.encode("The Cat sat, unaffable!") == ids("the", "cat", "sat", ",", "un", "##aff",
                                                          "##able", "!")
    assert vocab.encode("dog bats mats") == ids("[UNK]", "[UNK]", "mat", "##s")
    assert vocab.encode("cats") == ids("cat", "##s")
    assert vocab.decode(ids("the", "cat", "##s", ".")) == "the cats."
    assert vocab.encode_batch(["the mat", ""]) == [ids("the", "mat"), []]


def test_encode_tf_scalar_and_batch(tmp_path):
    vocab = wordpiece.WordPieceVocabulary(write_vocab(tmp_path))
    one = vocab.encode_tf(tf.constant("The cat"))
    assert one.dtype == tf.int32 and one.numpy().tolist() == ids("the", "cat")
    many = vocab.encode_tf(tf.constant(["the cat sat", "", "mat"]))
    assert many.to_list() == [ids("the", "cat", "sat"), [], ids("mat")]


def test_lowercasing_follows_the_checkpoint_config(tmp_path):
    cased = wordpiece.WordPieceVocabulary(write_vocab(tmp_path, config={"do_lower_case": False}))
    assert not cased.lowercase and cased.encode("The cat") == ids("[UNK]", "cat")
    assert wordpiece.WordPieceVocabulary(tmp_path, lowercase=True).encode("The") == ids("the")


def test_tokenizer_json_matches_vocab_txt(tmp_path):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(TOKENS)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.enable_truncation(4)
    tok.enable_padding(length=16)
    (tmp_path / "json").mkdir()
    tok.save(str(tmp_path / "json" / "tokenizer.json"))
    from_json = wordpiece.WordPieceVocabulary(tmp_path / "json")
    from_txt = wordpiece.WordPieceVocabulary(write_vocab(tmp_path / "txt"))
    text = "Hello, the cat sat on the mat! Unaffable cats."
    # The file's special tokens, truncation and padding are switched off.
    assert from_json.encode(text) == from_txt.encode(text)
    assert len(from_json.encode(text)) > 4
    assert from_json == wordpiece.WordPieceVocabulary(tmp_path / "json" / "tokenizer.json")
    assert from_json != from_txt


@pytest.mark.parametrize("content, match", [
    ("[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\nthe\n", r"vocab.txt:6: token 'the' repeats line 5"),
    ("[PAD]\n[UNK]\n\n[CLS]\n[SEP]\n", r"vocab.txt:3: empty token"),
    ("[PAD]\n[UNK]\n[SEP]\nthe\n", r"lacks the special tokens \['\[CLS\]'\]"),
    ("[UNK]\n[PAD]\n[CLS]\n[SEP]\n", r"has \[PAD\] at id 1; ktx pads with id 0"),
])
def test_malformed_vocab_txt(tmp_path, content, match):
    (tmp_path / "vocab.txt").write_text(content)
    with pytest.raises(files.DataFileError, match=match):
        wordpiece.WordPieceVocabulary(tmp_path)


def test_missing_or_unreadable_files(tmp_path):
    with pytest.raises(files.DataFileError, match="missing vocabulary file .*nothing.txt.*accepted"):
        wordpiece.WordPieceVocabulary(tmp_path / "nothing.txt")
    with pytest.raises(files.DataFileError, match="has neither tokenizer.json nor vocab.txt"):
        wordpiece.WordPieceVocabulary(tmp_path)
    (tmp_path / "vocab.txt").write_bytes(b"")
    with pytest.raises(files.DataFileError, match="vocab.txt' is empty"):
        wordpiece.WordPieceVocabulary(tmp_path)
    (tmp_path / "vocab.txt").write_bytes(b"[PAD]\n\xff\xfe\n")
    with pytest.raises(files.DataFileError, match="is not UTF-8 text"):
        wordpiece.WordPieceVocabulary(tmp_path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(files.DataFileError, match="tokenizer.json' cannot be read by tokenizers"):
        wordpiece.WordPieceVocabulary(tmp_path / "bad")
    write_vocab(tmp_path / "cfg", config=None)
    (tmp_path / "cfg" / "tokenizer_config.json").write_text('{"do_lower_case": "yes"}')
    with pytest.raises(files.DataFileError, match="do_lower_case='yes'; accepted: true or false"):
        wordpiece.WordPieceVocabulary(tmp_path / "cfg")


def test_non_wordpiece_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(files.DataFileError, match="holds a BPE model; accepted: a WordPiece"):
        wordpiece.WordPieceVocabulary(tmp_path)


def test_lazy_vocabulary_resolves_at_use(tmp_path, monkeypatch):
    monkeypatch.delenv(wordpiece.ENCODER_VOCAB_ENV, raising=False)
    lazy = wordpiece.LazyWordPieceVocabulary()
    with pytest.raises(files.DataFileError, match="set the gin macro ENCODER_VOCAB"):
        lazy.encode("the cat")
    write_vocab(tmp_path / "a")
    other = [t if t != "cat" else "dog" for t in TOKENS]
    write_vocab(tmp_path / "b", other)
    with wordpiece.encoder_vocabulary_scope(tmp_path / "a"):
        assert lazy.encode("the cat") == ids("the", "cat") and lazy.cls_id == 2
        with wordpiece.encoder_vocabulary_scope(tmp_path / "b"):
            assert lazy.encode("dog") == ids("cat")
    monkeypatch.setenv(wordpiece.ENCODER_VOCAB_ENV, str(tmp_path / "b"))
    assert lazy.encode("dog") == ids("cat")
    wordpiece.set_encoder_vocabulary(tmp_path / "a")
    try:
        assert lazy.encode("cat") == ids("cat")
        with wordpiece.encoder_vocabulary_scope(tmp_path / "missing"):
            with pytest.raises(files.DataFileError, match="encoder vocabulary .*ENCODER_VOCAB.*missing"):
                lazy.encode("cat")
    finally:
        wordpiece.set_encoder_vocabulary(None)
    assert lazy == wordpiece.ENCODER_VOCABULARY and np.isscalar(hash(lazy))
