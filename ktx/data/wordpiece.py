"""WordPiece vocabularies (BERT's tokenization) through Hugging Face `tokenizers`.

`WordPieceVocabulary(path)` is a `seqio.Vocabulary` over a checkpoint's own tokenizer:
`path` is a folder holding `tokenizer.json` (preferred) or `vocab.txt`, or one of those
files. Nothing is downloaded. Lowercasing follows the checkpoint: the `lowercase`
argument, else `do_lower_case` of the `tokenizer_config.json` beside the file, else the
`tokenizer.json`'s own normalizer (a `vocab.txt` alone: lowercased, as transformers'
`BertTokenizer`). Text is split with BERT's normalizer and pre-tokenizer and WordPiece,
as transformers' fast BERT tokenizer does.

`encode` / `encode_tf` give the word pieces only: no `[CLS]` / `[SEP]` and no truncation
or padding (those of a `tokenizer.json` are switched off); the encoder feature
converter (`ktx.data.encoder_features`) builds `[CLS] a [SEP] b [SEP]`. `[PAD]` must be
id 0 (SeqIO's padding id, true of BERT vocabularies); `eos_id` is None (BERT has none).

Registered tasks cannot know the checkpoint, so the encoder tasks (`ktx.tasks`,
`*_bert_v001`) use `ENCODER_VOCABULARY`, a `LazyWordPieceVocabulary` that finds its path
when first used: `encoder_vocabulary_scope(path)` (what
`ktx.data.pipeline.MultiTaskInput(encoder_vocabulary=...)`, the gin macro
`ENCODER_VOCAB`, uses), else `set_encoder_vocabulary(path)`, else `$KTX_ENCODER_VOCAB`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
from collections.abc import Iterator, Sequence

import numpy as np
import seqio
import tensorflow as tf

from ktx.data import files

__all__ = [
    "VOCAB_FILES",
    "ENCODER_VOCAB_ENV",
    "WordPieceVocabulary",
    "LazyWordPieceVocabulary",
    "ENCODER_VOCABULARY",
    "set_encoder_vocabulary",
    "encoder_vocabulary_path",
    "encoder_vocabulary_scope",
]

VOCAB_FILES = ("tokenizer.json", "vocab.txt")
ENCODER_VOCAB_ENV = "KTX_ENCODER_VOCAB"
_SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")
_ACCEPTED = ("a folder holding tokenizer.json or vocab.txt (a BERT-family checkpoint), "
             "or one of those files")


def _vocab_file(path: str | os.PathLike) -> pathlib.Path:
    """The tokenizer file of `path` (a folder or a file); raises naming what was looked for."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"WordPieceVocabulary(path={path!r}): expected {_ACCEPTED}")
    p = pathlib.Path(path).expanduser()
    if p.is_dir():
        found = [p / name for name in VOCAB_FILES if (p / name).is_file()]
        if not found:
            raise files.DataFileError(
                f"vocabulary folder {str(p)!r} has neither {' nor '.join(VOCAB_FILES)}; "
                f"accepted: {_ACCEPTED}")
        p = found[0]
    if not p.is_file():
        raise files.DataFileError(f"missing vocabulary file {str(p)!r}; accepted: {_ACCEPTED}")
    if p.stat().st_size == 0:
        raise files.DataFileError(f"vocabulary file {str(p)!r} is empty; accepted: {_ACCEPTED}")
    return p.resolve()


def _config_lowercase(vocab_file: pathlib.Path) -> bool | None:
    """`do_lower_case` of the `tokenizer_config.json` beside `vocab_file`, or None."""
    config = vocab_file.parent / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("do_lower_case")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise files.DataFileError(
            f"tokenizer config {str(config)!r} is not a JSON object ({e}); accepted: "
            "transformers' tokenizer_config.json, or delete it") from e
    if value is not None and not isinstance(value, bool):
        raise files.DataFileError(
            f"{str(config)!r}: do_lower_case={value!r}; accepted: true or false")
    return value


def _read_vocab_txt(path: pathlib.Path) -> dict[str, int]:
    """`vocab.txt` (one token a line, id = line number - 1) -> {token: id}."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise files.DataFileError(
            f"vocabulary file {str(path)!r} is not UTF-8 text ({e}); accepted: a BERT "
            "vocab.txt (one word piece a line) or a tokenizer.json") from e
    if lines and lines[-1] == "":
        lines.pop()  # the final newline
    vocab: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        token = line.rstrip("\r")
        if not token.strip():
            raise files.DataFileError(
                f"{path}:{number}: empty token; a BERT vocab.txt has one word piece a line")
        if token in vocab:
            raise files.DataFileError(
                f"{path}:{number}: token {token!r} repeats line {vocab[token] + 1}")
        vocab[token] = number - 1
    return vocab


def _build_tokenizer(vocab_file: pathlib.Path, lowercase: bool | None):
    """(tokenizers.Tokenizer without special tokens/truncation/padding, effective lowercase)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    if vocab_file.name.endswith(".json"):
        try:
            tok = Tokenizer.from_file(str(vocab_file))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise files.DataFileError(
                f"tokenizer file {str(vocab_file)!r} cannot be read by tokenizers ({e}); "
                f"accepted: {_ACCEPTED}") from e
        if not isinstance(tok.model, models.WordPiece):
            raise files.DataFileError(
                f"tokenizer file {str(vocab_file)!r} holds a {type(tok.model).__name__} model; "
                "accepted: a WordPiece tokenizer.json (the BERT family)")
        if lowercase is not None:
            tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        normalizer = tok.normalizer
        effective = bool(getattr(normalizer, "lowercase", False)) if lowercase is None else lowercase
    else:
        vocab = _read_vocab_txt(vocab_file)
        effective = True if lowercase is None else lowercase
        tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
        tok.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=effective)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
    tok.no_truncation()
    tok.no_padding()
    tok.post_processor = None
    return tok, effective


class WordPieceVocabulary(seqio.Vocabulary):
    """A BERT WordPiece vocabulary read from a checkpoint's `tokenizer.json` / `vocab.txt`.

    Args:
      path: a folder holding `tokenizer.json` or `vocab.txt`, or one of those files.
      lowercase: lowercase (and strip accents) before splitting; None: the checkpoint's
        (`tokenizer_config.json`'s `do_lower_case`, else the tokenizer.json's, else True).

    Raises:
      DataFileError (a ValueError): a missing, empty or malformed file, or one without
        `[PAD]` (id 0), `[UNK]`, `[CLS]`, `[SEP]`; each names the file.
    """

    def __init__(self, path: str | os.PathLike, lowercase: bool | None = None):
        if lowercase is not None and not isinstance(lowercase, bool):
            raise TypeError(f"WordPieceVocabulary(lowercase={lowercase!r}): expected True, "
                            "False or None (the checkpoint's setting)")
        self._file = _vocab_file(path)
        if lowercase is None:
            lowercase = _config_lowercase(self._file)
        self._tokenizer, self._lowercase = _build_tokenizer(self._file, lowercase)
        ids = {t: self._tokenizer.token_to_id(t) for t in _SPECIAL}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise files.DataFileError(
                f"vocabulary {str(self._file)!r} lacks the special tokens {missing}; a BERT "
                f"vocabulary has {list(_SPECIAL)}")
        if ids["[PAD]"] != 0:
            raise files.DataFileError(
                f"vocabulary {str(self._file)!r} has [PAD] at id {ids['[PAD]']}; ktx pads with "
                "id 0 (SeqIO's padding id), as BERT vocabularies do")
        self._ids = ids
        super().__init__(extra_ids=0)

    # ------------------------------------------------------------------- description
    @property
    def file(self) -> pathlib.Path:
        """The tokenizer file read (absolute)."""
        return self._file

    @property
    def lowercase(self) -> bool:
        return self._lowercase

    @property
    def cache_key(self) -> str:
        """Identifies the token ids this vocabulary gives (file, size, lowercasing)."""
        stat = self._file.stat()
        return f"{self._file}:{stat.st_size}:{stat.st_mtime_ns}:lower={self._lowercase}"

    @property
    def cls_id(self) -> int:
        return self._ids["[CLS]"]

    @property
    def sep_id(self) -> int:
        return self._ids["[SEP]"]

    @property
    def eos_id(self) -> int | None:
        return None

    @property
    def unk_id(self) -> int:
        return self._ids["[UNK]"]

    def token_id(self, token: str) -> int:
        """The id of `token` (e.g. "[MASK]", "[unused0]"); DataFileError naming the file
        when the vocabulary lacks it."""
        value = self._tokenizer.token_to_id(token)
        if value is None:
            raise files.DataFileError(
                f"vocabulary {str(self._file)!r} has no token {token!r}; a BERT vocabulary has "
                f"{list(_SPECIAL)}, [MASK] and [unused0] ... [unused98] or more")
        return int(value)

    @property
    def _base_vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    # ---------------------------------------------------------------------- encoding
    def _encode(self, s: str) -> list[int]:
        return self._tokenizer.encode(s, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Word-piece ids of each text (no special tokens), encoded in one call."""
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def _decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def _encode_tf(self, s: tf.Tensor) -> tf.Tensor | tf.RaggedTensor:
        """A scalar string -> `[n]` int32; a `[N]` string tensor -> ragged `[N, None]`."""
        s = tf.convert_to_tensor(s, tf.string)

        def encode(flat):
            pieces = self.encode_batch([t.decode("utf-8") for t in flat])
            lengths = np.array([len(p) for p in pieces], np.int64)
            values = np.fromiter((i for p in pieces for i in p), np.int32, int(lengths.sum()))
            return values, lengths

        values, lengths = tf.numpy_function(
            encode, [tf.reshape(s, [-1])], (tf.int32, tf.int64), stateful=False)
        values.set_shape([None])
        if s.shape.rank == 0:
            return values
        return tf.RaggedTensor.from_row_lengths(values, lengths)

    def _decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
        ids = tf.convert_to_tensor(ids)

        def decode(rows):
            rows = np.asarray(rows)
            flat = rows.reshape(-1, rows.shape[-1]) if rows.ndim else rows.reshape(1, 1)
            return np.array([self._decode(r[r != 0]).encode("utf-8") for r in flat],
                            object).reshape(rows.shape[:-1])

        out = tf.numpy_function(decode, [ids], tf.string, stateful=False)
        out.set_shape(ids.shape[:-1])
        return out

    def __eq__(self, other) -> bool:
        return (isinstance(other, WordPieceVocabulary) and not isinstance(other, LazyWordPieceVocabulary)
                and self._file == other._file and self._lowercase == other._lowercase)

    def __hash__(self) -> int:
        return hash((self._file, self._lowercase))

    def __repr__(self) -> str:
        return (f"WordPieceVocabulary({str(self._file)!r}, lowercase={self._lowercase}, "
                f"size={self.vocab_size})")


# --------------------------------------------------------------- the tasks' vocabulary

_state: dict[str, str | None] = {"default": None, "scoped": None}


def set_encoder_vocabulary(path: str | os.PathLike | None) -> None:
    """Sets the process's encoder vocabulary path (None: back to `$KTX_ENCODER_VOCAB`)."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"set_encoder_vocabulary(path={path!r}): expected a str path or None")
    _state["default"] = None if path in (None, "") else os.path.abspath(os.path.expanduser(path))


@contextlib.contextmanager
def encoder_vocabulary_scope(path: str | os.PathLike | None) -> Iterator[None]:
    """Within the block the encoder tasks tokenize with `path` (None: unchanged)."""
    if path is None or path == "":
        yield
        return
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"encoder_vocabulary={path!r}: expected {_ACCEPTED}, or None")
    previous = _state["scoped"]
    _state["scoped"] = os.path.abspath(os.path.expanduser(path))
    try:
        yield
    finally:
        _state["scoped"] = previous


def encoder_vocabulary_path() -> str:
    """The encoder vocabulary path in force; raises naming the ways to set it."""
    value = _state["scoped"] or _state["default"] or os.environ.get(ENCODER_VOCAB_ENV)
    if not value:
        raise files.DataFileError(
            "the encoder tasks (*_bert_v001) need a WordPiece vocabulary: set the gin macro "
            "ENCODER_VOCAB (runs/encoder_train.gin; pipeline.MultiTaskInput.encoder_vocabulary), "
            f"the environment variable {ENCODER_VOCAB_ENV}, or call "
            f"ktx.data.wordpiece.set_encoder_vocabulary(path); accepted: {_ACCEPTED}")
    return value


@functools.lru_cache(maxsize=8)
def _cached(path: str, mtime_ns: int) -> WordPieceVocabulary:
    del mtime_ns  # part of the key: an edited file is read again
    return WordPieceVocabulary(path)


class LazyWordPieceVocabulary(WordPieceVocabulary):
    """A `WordPieceVocabulary` whose path is `encoder_vocabulary_path()` at each use, so
    that registering a task reads no file; every method delegates to the vocabulary of
    the path then in force."""

    def __init__(self):  # noqa: D107 -- nothing is read here
        seqio.Vocabulary.__init__(self, extra_ids=0)

    def resolve(self) -> WordPieceVocabulary:
        """The vocabulary of the path now in force."""
        path = encoder_vocabulary_path()
        try:
            file = _vocab_file(path)
            return _cached(str(file), file.stat().st_mtime_ns)
        except files.DataFileError as e:
            raise files.DataFileError(
                f"encoder vocabulary (gin ENCODER_VOCAB, or ${ENCODER_VOCAB_ENV}) {path!r}: {e}") from e

    def __getattribute__(self, name):
        if name in ("_file", "_tokenizer", "_lowercase", "_ids"):
            return getattr(object.__getattribute__(self, "resolve")(), name)
        return object.__getattribute__(self, name)

    def __eq__(self, other) -> bool:
        return isinstance(other, LazyWordPieceVocabulary)

    def __hash__(self) -> int:
        return hash(LazyWordPieceVocabulary)

    def __repr__(self) -> str:
        return "LazyWordPieceVocabulary(<encoder_vocabulary_path()>)"


ENCODER_VOCABULARY = LazyWordPieceVocabulary()
