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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import seqio
import tensorflow as tf

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
]

TEXT_FEATURES = ("text_a", "text_b")
ENCODER_FEATURES = ("input_ids", "token_type_ids", "attention_mask", "label")


class LabelSpace(seqio.PassThroughVocabulary):
    """The labels of an encoder task: `names` of its classes (label = index), or
    `LabelSpace.regression(lo, hi)` for a score (one regression output).

    `num_labels` is the size of the task's head: `len(names)`, or 1 for a regression.
    """

    def __init__(self, names: Sequence[str] = (), *, score_range: tuple[float, float] | None = None):
        names = tuple(names)
        if bool(names) == (score_range is not None):
            raise ValueError(f"LabelSpace(names={names!r}, score_range={score_range!r}): give "
                             "class names (2 or more) or a score_range (regression), not both")
        if names and (len(names) < 2 or len(set(names)) != len(names)):
            raise ValueError(f"LabelSpace(names={names!r}): 2 or more distinct class names")
        self.names = names
        self.score_range = None if score_range is None else (float(score_range[0]), float(score_range[1]))
        super().__init__(size=len(names) if names else 1)

    @classmethod
    def regression(cls, lo: float, hi: float) -> "LabelSpace":
        return cls(score_range=(lo, hi))

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
        return f"{len(self.names)} classes {list(self.names)}"

    def __eq__(self, other) -> bool:
        return (isinstance(other, LabelSpace) and self.names == other.names
                and self.score_range == other.score_range)

    def __hash__(self) -> int:
        return hash((self.names, self.score_range))

    def __repr__(self) -> str:
        if self.is_regression:
            return f"LabelSpace.regression{self.score_range}"
        return f"LabelSpace({self.names!r})"


def encoder_output_features(vocabulary: seqio.Vocabulary, labels: LabelSpace) -> dict[str, seqio.Feature]:
    """The output features of an encoder task (`text_a`, `text_b`, `label`)."""
    text = seqio.Feature(vocabulary=vocabulary, add_eos=False, dtype=tf.int32)
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
) -> dict[str, np.ndarray]:
    """`EncoderClassifierModel` features `[N, length]` (+ `label` `[N]` float32).

    A pair with an empty `text_b` is a single sentence (`[CLS] a [SEP]`); the texts are
    cut longest-first to fit `length` (3 pieces are reserved for a pair, 2 for one).
    """
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
