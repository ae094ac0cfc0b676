"""Encoder (BERT-family) tasks and their feature conversion (numpy).

An encoder task is a `seqio.Task` whose output features are (`encoder_output_features`):

* `text_a` `[n_a]` int32, `text_b` `[n_b]` int32: word pieces of the first and second
  text (a `ktx.data.wordpiece` vocabulary; no special tokens; `text_b` empty for a single
  sentence);
* `label` `[]` float32: the class index, or the score of a regression task. Its
  vocabulary is a `LabelSpace`, which says how many labels the task has (its head's
  `num_labels`: the classes, or 1 for a regression) and their names.

`convert_encoder` turns a task's examples into `EncoderClassifierModel` features of
length `L`, as transformers' BERT tokenizers do for a sentence (pair): `input_ids =
[CLS] a [SEP]` or `[CLS] a [SEP] b [SEP]` (longest-first truncation: the longer text
loses its last piece until the pair fits), `token_type_ids` 0 on `[CLS] a [SEP]`, 1 on
`b [SEP]`, `attention_mask` 1 on real tokens, everything 0-padded, and `label` float32.
`ktx.data.pipeline.MultiTaskInput` runs it once per task (no packing).

Token tagging tasks (`LabelSpace.tagging(names)`, a BIO tag set such as `("O",
"B-Disease", "I-Disease")`) have a sentence of words instead: `text_a` `[n]` the word
pieces of its words, each word tokenized on its own (transformers' `is_split_into_words`;
a word with no piece becomes one `[UNK]`, so no tagged word vanishes), `word_lengths`
`[W]` the pieces of each word, and `label` `[W]` int32 the tag index of each word
(`tokenize_words`). `convert_tagging` builds `[CLS] pieces [SEP]` rows with
`token_labels` `[L]`: the word's tag on its FIRST piece, `IGNORE_LABEL` (-100, as
transformers' token-classification recipe) on later pieces, `[CLS]`, `[SEP]` and padding,
which the loss and the metric skip. Truncation keeps the first `L - 2` pieces; words whose
first piece is cut are not trained on or predicted: each row counts them
(`words_cut`), its gold entities not wholly kept (`entities_cut`) and whether its last
kept gold entity runs on past the cut (`entity_crosses_cut`), so that evaluation scores
those entities as missed (`ktx.metrics.tagging.EntityCounts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import logging

import numpy as np
import seqio
import tensorflow as tf

from ktx.metrics import tagging
from ktx.metrics.biomed import iob_to_spans

_log = logging.getLogger(__name__)  # ktx.cli prints it as `ktx: ...`

__all__ = [
    "TEXT_FEATURES",
    "ENCODER_FEATURES",
    "LabelSpace",
    "encoder_output_features",
    "is_encoder_task",
    "label_space",
    "encoder_text",
    "tokenize_texts",
    "truncate_longest_first",
    "convert_encoder",
    "check_labels",
    "check_num_labels",
    "HEAD_KINDS",
    "SEQUENCE",
    "TAGGING",
    "COSINE",
    "IGNORE_LABEL",
    "TAGGING_FEATURES",
    "COSINE_FEATURES",
    "cosine_tasks",
    "with_cosine_features",
    "WORD_SEPARATOR",
    "check_head_kinds",
    "tokenize_words",
    "convert_tagging",
    "sequence_rows_for_tagging",
    "log_truncation",
]

TEXT_FEATURES = ("text_a", "text_b")
ENCODER_FEATURES = ("input_ids", "token_type_ids", "attention_mask", "label")
SEQUENCE, TAGGING, COSINE = "sequence", "tagging", "cosine"
# A head on the pooled output / on every token / the cosine of the two texts' pooled
# outputs, each text encoded alone (a regression task of pairs; SlapBERT's STS head).
HEAD_KINDS = (SEQUENCE, TAGGING, COSINE)
IGNORE_LABEL = -100  # token_labels of positions the loss and the metric skip
# Per-row features of a tagging row besides ENCODER_FEATURES (sequence rows of a mixture
# with tagging tasks get IGNORE_LABEL / 0 there).
TAGGING_FEATURES = ("token_labels", "words_cut", "entities_cut", "entity_crosses_cut")
# Per-row features of a mixture with a cosine head: the second text alone, `[CLS] b [SEP]`
# (rows of the other tasks: all padding).
COSINE_FEATURES = ("input_ids_b", "attention_mask_b")
WORD_SEPARATOR = "\n"  # joins a sentence's words in a tagging task's source rows


class LabelSpace(seqio.PassThroughVocabulary):
    """The labels of an encoder task: `names` of its classes (label = index),
    `LabelSpace.regression(lo, hi)` for a score (one regression output), or
    `LabelSpace.tagging(tags)` for a BIO tag per word (a token-tagging task).

    `num_labels` is the size of the task's head: `len(names)`, or 1 for a regression;
    `kind` the head it needs: "sequence" (on the pooled output) or "tagging" (every token).
    """

    def __init__(self, names: Sequence[str] = (), *, score_range: tuple[float, float] | None = None,
                 kind: str = SEQUENCE):
        names = tuple(names)
        if kind not in (SEQUENCE, TAGGING):
            raise ValueError(f"LabelSpace(kind={kind!r}); accepted: {(SEQUENCE, TAGGING)}")
        if bool(names) == (score_range is not None):
            raise ValueError(f"LabelSpace(names={names!r}, score_range={score_range!r}): give "
                             "class names (2 or more) or a score_range (regression), not both")
        if names and (len(names) < 2 or len(set(names)) != len(names)):
            raise ValueError(f"LabelSpace(names={names!r}): 2 or more distinct class names")
        if kind == TAGGING:
            if score_range is not None:
                raise ValueError("LabelSpace(kind='tagging') takes BIO tag names, not a score_range")
            tagging.check_bio_labels(names, owner="LabelSpace.tagging(names)")
        self.names = names
        self.kind = kind
        self.score_range = None if score_range is None else (float(score_range[0]), float(score_range[1]))
        super().__init__(size=len(names) if names else 1)

    @classmethod
    def regression(cls, lo: float, hi: float) -> "LabelSpace":
        return cls(score_range=(lo, hi))

    @classmethod
    def tagging(cls, names: Sequence[str]) -> "LabelSpace":
        """A BIO tag per word (`ktx.metrics.tagging.check_bio_labels`); label = tag index."""
        return cls(names, kind=TAGGING)

    @property
    def is_tagging(self) -> bool:
        return self.kind == TAGGING

    @property
    def is_regression(self) -> bool:
        return self.score_range is not None

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.names)

    def describe(self) -> str:
        if self.is_regression:
            lo, hi = self.score_range
            return f"a regression (1 label: a score in [{lo:g}, {hi:g}])"
        if self.is_tagging:
            return f"{len(self.names)} tags per word {list(self.names)}"
        return f"{len(self.names)} classes {list(self.names)}"

    def __eq__(self, other) -> bool:
        return (isinstance(other, LabelSpace) and self.names == other.names
                and self.score_range == other.score_range and self.kind == other.kind)

    def __hash__(self) -> int:
        return hash((self.names, self.score_range, self.kind))

    def __repr__(self) -> str:
        if self.is_regression:
            return f"LabelSpace.regression{self.score_range}"
        if self.is_tagging:
            return f"LabelSpace.tagging({self.names!r})"
        return f"LabelSpace({self.names!r})"


def encoder_output_features(vocabulary: seqio.Vocabulary, labels: LabelSpace) -> dict[str, seqio.Feature]:
    """The output features of an encoder task (`text_a`, `text_b`, `label`; a tagging
    task's `label` is `[W]` int32, and its examples also hold `word_lengths` `[W]`)."""
    text = seqio.Feature(vocabulary=vocabulary, add_eos=False, dtype=tf.int32)
    if labels.is_tagging:  # `word_lengths` rides along undeclared: SeqIO mixtures need
        # the same feature names in every task, so a tagging task mixes with sequence tasks
        return {"text_a": text, "text_b": text,
                "label": seqio.Feature(vocabulary=labels, add_eos=False, dtype=tf.int32)}
    return {"text_a": text, "text_b": text,
            "label": seqio.Feature(vocabulary=labels, add_eos=False, dtype=tf.float32, rank=0)}


def is_encoder_task(task: seqio.Task) -> bool:
    """True when `task` has the encoder output features (`text_a`, `text_b`, `label`)."""
    features = task.output_features
    return all(k in features for k in (*TEXT_FEATURES, "label")) and isinstance(
        features["label"].vocabulary, LabelSpace)


def label_space(task: seqio.Task) -> LabelSpace:
    """The `LabelSpace` of an encoder task."""
    if not is_encoder_task(task):
        raise ValueError(f"task {task.name!r} is not an encoder task (output features "
                         f"{sorted(task.output_features)}; needs text_a, text_b and a LabelSpace label)")
    return task.output_features["label"].vocabulary


@seqio.map_over_dataset
def encoder_text(x, first: str, second: str | None = None):
    """`{"text_a": x[first], "text_b": x[second] or "", "label": float32, "idx"}` of one
    row of a source shaped like the TFDS features (GLUE's `sentence1`/`sentence2`, ...)."""
    out = {"text_a": x[first],
           "text_b": x[second] if second is not None else tf.constant(""),
           "label": tf.cast(x["label"], tf.float32)}
    if "idx" in x:
        out["idx"] = tf.cast(x["idx"], tf.int32)
    return out


def tokenize_texts(dataset: tf.data.Dataset, output_features: Mapping[str, seqio.Feature],
                   batch_size: int = 512) -> tf.data.Dataset:
    """Tokenizes `text_a` / `text_b` with their features' vocabulary, `batch_size` rows
    per call (the vocabulary's `encode_tf` of a `[N]` string tensor); other keys pass."""

    def encode(batch):
        out = dict(batch)
        for key in TEXT_FEATURES:
            out[key] = output_features[key].vocabulary.encode_tf(batch[key])
        return out

    return dataset.batch(batch_size).map(encode, num_parallel_calls=1).unbatch()


def truncate_longest_first(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Kept lengths `(k_a, k_b)` of a pair cut to `budget` pieces, as Hugging Face
    `tokenizers`' `longest_first` truncation: the shorter text `s` is kept whole when the
    longer can take the rest (`budget - s`), else both are cut to `budget // 2` (the
    longer gets the odd piece)."""
    if len_a + len_b <= budget:
        return len_a, len_b
    budget = max(int(budget), 0)
    swap = len_a > len_b
    short, long = (len_b, len_a) if swap else (len_a, len_b)
    keep_s, keep_l = (short, short) if short > budget else (short, max(short, budget - short))
    if keep_s + keep_l > budget:
        keep_s = budget // 2
        keep_l = keep_s + budget % 2
    keep_s, keep_l = min(keep_s, short), min(keep_l, long)
    return (keep_l, keep_s) if swap else (keep_s, keep_l)


def convert_encoder(
    text_a: Sequence[Sequence[int]],
    text_b: Sequence[Sequence[int]],
    labels: Sequence[float],
    length: int,
    *,
    cls_id: int,
    sep_id: int,
    separate: bool = False,
) -> dict[str, np.ndarray]:
    """`EncoderClassifierModel` features `[N, length]` (+ `label` `[N]` float32).

    A pair with an empty `text_b` is a single sentence (`[CLS] a [SEP]`); the texts are
    cut longest-first to fit `length` (3 pieces are reserved for a pair, 2 for one).
    `separate` (a cosine head's task): each text alone, `input_ids` = `[CLS] a [SEP]` and
    `input_ids_b` = `[CLS] b [SEP]` (`COSINE_FEATURES`), each cut to `length`; every
    example needs a non-empty `text_b`.
    """
    if separate:
        first = convert_encoder(text_a, [()] * len(text_a), labels, length,
                                cls_id=cls_id, sep_id=sep_id)
        empty = [i for i, b in enumerate(text_b) if len(b) == 0]
        if empty:
            raise ValueError(f"convert_encoder(separate=True): example {empty[0]} has no "
                             "second text; a cosine head compares two texts (accepted: pairs)")
        second = convert_encoder(text_b, [()] * len(text_b), labels, length,
                                 cls_id=cls_id, sep_id=sep_id)
        return {**first, "input_ids_b": second["input_ids"],
                "attention_mask_b": second["attention_mask"]}
    n = len(text_a)
    if len(text_b) != n or len(labels) != n:
        raise ValueError(f"convert_encoder: {n} text_a, {len(text_b)} text_b and "
                         f"{len(labels)} labels; expected one of each per example")
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 4:
        raise ValueError(f"length={length!r}; accepted: an int >= 4 ([CLS] a [SEP] b [SEP])")
    ids = np.zeros((n, length), np.int64)
    types = np.zeros((n, length), np.int64)
    mask = np.zeros((n, length), np.int64)
    for i, (a, b) in enumerate(zip(text_a, text_b)):
        a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        pair = b.size > 0
        ka, kb = truncate_longest_first(a.size, b.size, length - (3 if pair else 2))
        row = [cls_id, *a[:ka], sep_id]
        first = len(row)
        if pair:
            row += [*b[:kb], sep_id]
        ids[i, :len(row)] = row
        mask[i, :len(row)] = 1
        types[i, first:len(row)] = 1
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask,
            "label": np.asarray(labels, np.float32).reshape(n)}


def check_labels(labels: np.ndarray, space: LabelSpace, *, source: str) -> None:
    """Raises ValueError naming `source` and the first row whose label is outside `space`."""
    labels = np.asarray(labels, np.float64)
    if space.is_regression:
        lo, hi = space.score_range
        bad = ~np.isfinite(labels) | (labels < lo) | (labels > hi)
    else:
        bad = (labels != np.round(labels)) | (labels < 0) | (labels >= space.num_labels)
    if bad.any():
        row = int(np.argmax(bad))
        accepted = space.describe() if space.is_regression else \
            f"{space.describe()}, a class index 0..{space.num_labels - 1}"
        raise ValueError(f"{source}: example {row} has label {float(labels[row])!r}; the task's "
                         f"labels are {accepted}")


def check_num_labels(task_names: Sequence[str], spaces: Sequence[LabelSpace],
                     num_labels: int | Sequence[int]) -> None:
    """Raises ValueError when a model head's size (`num_labels`, the gin NUM_LABELS: one
    int for every task or one per task in task-id order) differs from its task's labels."""
    wanted = tuple(s.num_labels for s in spaces)
    if isinstance(num_labels, (int, np.integer)) and not isinstance(num_labels, bool):
        heads = (int(num_labels),) * len(spaces)
    elif isinstance(num_labels, Sequence) and not isinstance(num_labels, (str, bytes)) \
            and all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in num_labels):
        heads = tuple(int(n) for n in num_labels)
    else:
        raise ValueError(f"pipeline.MultiTaskInput.num_labels={num_labels!r}; accepted: an int "
                         "(every task's head) or one int per task (1 = regression)")
    if len(heads) != len(spaces):
        raise ValueError(
            f"pipeline.MultiTaskInput.num_labels (NUM_LABELS) = {num_labels!r} has {len(heads)} "
            f"entries but the mixture has {len(spaces)} tasks {list(task_names)}; their labels "
            f"need NUM_LABELS = {wanted}")
    for t, (name, space, head) in enumerate(zip(task_names, spaces, heads)):
        if head != space.num_labels:
            raise ValueError(
                f"pipeline.MultiTaskInput.num_labels (NUM_LABELS) = {num_labels!r} gives task "
                f"{name!r} (task id {t}) a head of {head} label(s), but its labels are "
                f"{space.describe()}: its head needs num_labels={space.num_labels}. For these "
                f"tasks bind NUM_LABELS = {wanted}")


def check_head_kinds(task_names: Sequence[str], spaces: Sequence[LabelSpace],
                     head_kinds: str | Sequence[str]) -> None:
    """Raises ValueError when a model head's kind (`head_kinds`, the gin HEAD_KINDS: one
    of `HEAD_KINDS` for every task or one per task in task-id order) differs from what its
    task's labels need ("tagging" for a `LabelSpace.tagging` task, else "sequence"; a
    regression task may take a "cosine" head instead)."""
    wanted = tuple(s.kind for s in spaces)
    if isinstance(head_kinds, str):
        kinds = (head_kinds,) * len(spaces)
    elif isinstance(head_kinds, Sequence) and all(isinstance(k, str) for k in head_kinds):
        kinds = tuple(head_kinds)
    else:
        kinds = ()
    if not kinds or any(k not in HEAD_KINDS for k in kinds):
        raise ValueError(f"pipeline.MultiTaskInput.head_kinds (HEAD_KINDS) = {head_kinds!r}; "
                         f"accepted: one of {HEAD_KINDS} for every task, or one per task")
    if len(kinds) != len(spaces):
        raise ValueError(
            f"pipeline.MultiTaskInput.head_kinds (HEAD_KINDS) = {head_kinds!r} has {len(kinds)} "
            f"entries but the mixture has {len(spaces)} tasks {list(task_names)}; their labels "
            f"need HEAD_KINDS = {wanted}")
    for t, (name, space, kind) in enumerate(zip(task_names, spaces, kinds)):
        if kind == COSINE and not space.is_regression:
            raise ValueError(
                f"pipeline.MultiTaskInput.head_kinds (HEAD_KINDS) = {head_kinds!r} gives task "
                f"{name!r} (task id {t}) a 'cosine' head, but its labels are "
                f"{space.describe()}; accepted: a cosine head for a regression task of "
                f"pairs (a score range), else {space.kind!r}")
        if kind != space.kind and kind != COSINE:
            raise ValueError(
                f"pipeline.MultiTaskInput.head_kinds (HEAD_KINDS) = {head_kinds!r} gives task "
                f"{name!r} (task id {t}) a {kind!r} head, but its labels are "
                f"{space.describe()}: it needs a {space.kind!r} head. For these tasks bind "
                f"HEAD_KINDS = {wanted}")


def tokenize_words(dataset: tf.data.Dataset,
                   output_features: Mapping[str, seqio.Feature]) -> tf.data.Dataset:
    """A tagging task's rows `{"tokens": words joined by WORD_SEPARATOR, "tags": tag
    indices joined by spaces}` -> `text_a` `[n]` (each word's pieces, the word tokenized
    alone; a word with no piece -> `[UNK]`), `text_b` `[0]`, `word_lengths` `[W]` and
    `label` `[W]` int32; other keys pass."""
    vocabulary = output_features["text_a"].vocabulary

    def encode(words):
        pieces = vocabulary.encode_batch([w.decode("utf-8") for w in words]) if len(words) else []
        pieces = [p if p else [vocabulary.unk_id] for p in pieces]
        lengths = np.array([len(p) for p in pieces], np.int32)
        values = np.fromiter((i for p in pieces for i in p), np.int32, int(lengths.sum()))
        return values, lengths

    def one(x):
        words = tf.strings.split(x["tokens"], sep=WORD_SEPARATOR)
        values, lengths = tf.numpy_function(encode, [words], (tf.int32, tf.int32), stateful=False)
        values.set_shape([None])
        lengths.set_shape([None])
        out = {k: v for k, v in x.items() if k not in ("tokens", "tags")}
        out.update(text_a=values, text_b=tf.zeros([0], tf.int32), word_lengths=lengths,
                   label=tf.strings.to_number(tf.strings.split(x["tags"], " "), tf.int32))
        return out

    return dataset.map(one, num_parallel_calls=1)


def convert_tagging(
    pieces: Sequence[Sequence[int]],
    word_lengths: Sequence[Sequence[int]],
    tags: Sequence[Sequence[int]],
    length: int,
    *,
    cls_id: int,
    sep_id: int,
    tag_names: Sequence[str],
) -> dict[str, np.ndarray]:
    """Token-tagging features `[N, length]` of sentences (see the module docstring).

    Args:
      pieces: each sentence's word pieces, its words' pieces one after the other.
      word_lengths: each sentence's pieces per word (each >= 1; they sum to its pieces).
      tags: each sentence's tag index per word (into `tag_names`, a BIO tag set).
      length: the row length; `[CLS]` + the first `length - 2` pieces + `[SEP]`.

    Returns `input_ids`, `token_type_ids` (0), `attention_mask`, `label` (0, unused),
    `token_labels` (the word's tag on its first piece, else `IGNORE_LABEL`) and the
    per-row truncation counts `words_cut`, `entities_cut`, `entity_crosses_cut`.
    """
    n = len(pieces)
    if len(word_lengths) != n or len(tags) != n:
        raise ValueError(f"convert_tagging: {n} piece lists, {len(word_lengths)} word_lengths "
                         f"and {len(tags)} tag lists; expected one of each per sentence")
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 3:
        raise ValueError(f"length={length!r}; accepted: an int >= 3 ([CLS] a piece [SEP])")
    names = tagging.check_bio_labels(tag_names, owner="tag_names")
    budget = length - 2
    ids = np.zeros((n, length), np.int64)
    mask = np.zeros((n, length), np.int64)
    labels = np.full((n, length), IGNORE_LABEL, np.int64)
    words_cut = np.zeros(n, np.int64)
    entities_cut = np.zeros(n, np.int64)
    crosses = np.zeros(n, np.int64)
    for i, (p, wl, tg) in enumerate(zip(pieces, word_lengths, tags)):
        p, wl, tg = (np.asarray(a, np.int64).reshape(-1) for a in (p, wl, tg))
        if wl.size != tg.size or (wl < 1).any() or int(wl.sum()) != p.size:
            raise ValueError(
                f"convert_tagging: sentence {i} has {p.size} pieces, word_lengths {wl.tolist()} "
                f"and {tg.size} tags; accepted: one tag and >= 1 piece per word, the lengths "
                "summing to the pieces")
        if tg.size and (tg.min() < 0 or tg.max() >= len(names)):
            raise ValueError(f"convert_tagging: sentence {i} has tag index {int(tg.max())}; "
                             f"accepted: 0..{len(names) - 1} ({list(names)})")
        keep = min(p.size, budget)
        starts = np.concatenate([[0], np.cumsum(wl)[:-1]]).astype(np.int64)
        kept = int(np.sum(starts < keep))
        row = [cls_id, *p[:keep], sep_id]
        ids[i, :len(row)] = row
        mask[i, :len(row)] = 1
        labels[i, 1 + starts[:kept]] = tg[:kept]
        if kept < wl.size:
            words_cut[i] = wl.size - kept
            spans = iob_to_spans([names[t] for t in tg])
            cut = [s for s in spans if s[1] > kept]
            entities_cut[i] = len(cut)
            crosses[i] = int(any(s[0] < kept for s in cut))
    return {"input_ids": ids, "token_type_ids": np.zeros_like(ids), "attention_mask": mask,
            "label": np.zeros(n, np.float32), "token_labels": labels, "words_cut": words_cut,
            "entities_cut": entities_cut, "entity_crosses_cut": crosses}


def sequence_rows_for_tagging(features: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A sequence task's rows with the `TAGGING_FEATURES` of a tagging mixture added
    (`token_labels` all `IGNORE_LABEL`, counts 0), so the rows of every task stack."""
    n, length = features["input_ids"].shape
    return {**features, "token_labels": np.full((n, length), IGNORE_LABEL, np.int64),
            **{k: np.zeros(n, np.int64) for k in TAGGING_FEATURES[1:]}}


def cosine_tasks(head_kinds: str | Sequence[str] | None, num_tasks: int) -> tuple[int, ...]:
    """Task ids whose head is "cosine" (`head_kinds` as `check_head_kinds` takes it)."""
    if head_kinds is None:
        return ()
    kinds = (head_kinds,) * num_tasks if isinstance(head_kinds, str) else tuple(head_kinds)
    return tuple(t for t, k in enumerate(kinds) if k == COSINE)


def with_cosine_features(features: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rows of a mixture with a cosine head: a task without one gets all-padding
    `COSINE_FEATURES` (never read by its head), so the rows of every task stack."""
    if all(k in features for k in COSINE_FEATURES):
        return dict(features)
    n, length = features["input_ids"].shape
    return {**features, **{k: np.zeros((n, length), np.int64) for k in COSINE_FEATURES}}


def log_truncation(features: Mapping[str, np.ndarray], *, source: str, length: int) -> None:
    """Logs what truncation to `length` cut from a tagging task's rows (nothing if none)."""
    cut = features["words_cut"] > 0
    if not cut.any():
        return
    _log.warning(
        "%s: %d of %d sentences are longer than %d pieces; %d words (and their tags) were cut "
        "off and are neither trained on nor predicted; %d gold entities were not wholly kept "
        "(%d of them partly) and count as missed (false negatives) in the entity scores",
        source, int(cut.sum()), cut.size, length - 2, int(features["words_cut"].sum()),
        int(features["entities_cut"].sum()), int(features["entity_crosses_cut"].sum()))
