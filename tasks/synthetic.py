"""The quickstart suite: small SeqIO tasks that ktx generates itself (no files, no download).

Four tasks of different kinds and sizes, over the byte vocabulary (one token per
character), short enough for a tiny T5 to learn on a laptop CPU (inputs <= 26 tokens,
targets <= 8 tokens with EOS; `{"inputs": 32, "targets": 8}` holds every example):

| task | kind | train | validation | example |
|---|---|---|---|---|
| `synthetic_reverse_v001` | transduction | 20,000 | 500 | `reverse: cadf` -> `fdac` |
| `synthetic_count_v001` | counting (integer, scored by accuracy and error) | 8,000 | 300 | `count a: abcab` -> `2` |
| `synthetic_keyword_v001` | detection (yes/no) | 4,000 | 300 | `find ox: cat ox sun` -> `yes` |
| `synthetic_majority_v001` | classification (label words) | 1,000 | 300 | `major: abbab` -> `beta` |

Examples are drawn with a fixed seed per task; validation examples never occur in the
training split. The mixture `synthetic_quickstart` lists the tasks in that order with
examples-proportional rates.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import seqio
import tensorflow as tf

from ktx.data import vocab

__all__ = [
    "TASKS",
    "MIXTURE_NAME",
    "SPLIT_SIZES",
    "FEATURE_LENGTHS",
    "generate",
    "accuracy",
    "mean_abs_error",
    "yes_f1",
    "to_int",
    "label_index",
]

MIXTURE_NAME = "synthetic_quickstart"
FEATURE_LENGTHS = {"inputs": 32, "targets": 8}
_LETTERS = "abcdef"
_WORDS = ("cat", "dog", "sun", "ox", "map", "pen", "cup", "box")
MAJORITY_LABELS = ("alpha", "beta")
YES_NO = ("no", "yes")


def _reverse(rng: np.random.Generator) -> tuple[str, str]:
    word = "".join(rng.choice(list(_LETTERS), size=int(rng.integers(3, 7))))
    return f"reverse: {word}", word[::-1]


def _count(rng: np.random.Generator) -> tuple[str, str]:
    letters = "".join(rng.choice(list("abc"), size=int(rng.integers(3, 11))))
    return f"count a: {letters}", str(letters.count("a"))


def _keyword(rng: np.random.Generator) -> tuple[str, str]:
    key = str(rng.choice(_WORDS))
    others = [w for w in _WORDS if w != key]
    words = [str(w) for w in rng.choice(others, size=int(rng.integers(2, 4)), replace=False)]
    present = bool(rng.integers(0, 2))
    if present:
        words.insert(int(rng.integers(0, len(words) + 1)), key)
    return f"find {key}: {' '.join(words)}", YES_NO[present]


def _majority(rng: np.random.Generator) -> tuple[str, str]:
    letters = "".join(rng.choice(["a", "b"], size=int(rng.choice([5, 7, 9]))))
    label = MAJORITY_LABELS[0] if letters.count("a") > letters.count("b") else MAJORITY_LABELS[1]
    return f"major: {letters}", label


# name -> (generator, train size, validation size, seed)
_SPECS: dict[str, tuple[Callable[[np.random.Generator], tuple[str, str]], int, int, int]] = {
    "synthetic_reverse_v001": (_reverse, 20_000, 500, 1),
    "synthetic_count_v001": (_count, 8_000, 300, 2),
    "synthetic_keyword_v001": (_keyword, 4_000, 300, 3),
    "synthetic_majority_v001": (_majority, 1_000, 300, 4),
}
TASKS = tuple(_SPECS)
SPLIT_SIZES = {name: {"train": s[1], "validation": s[2]} for name, s in _SPECS.items()}


@functools.lru_cache(maxsize=None)
def generate(task_name: str, split: str) -> tuple[tuple[str, str], ...]:
    """The `(input, target)` string pairs of a task's split (deterministic).

    Validation is the first `validation` distinct inputs drawn; training draws further
    examples (repeats allowed) and rejects any input seen in validation.
    """
    if task_name not in _SPECS:
        raise ValueError(f"task_name={task_name!r}; accepted: {TASKS}")
    if split not in ("train", "validation"):
        raise ValueError(f"split={split!r}; accepted: ('train', 'validation')")
    fn, num_train, num_validation, seed = _SPECS[task_name]
    rng = np.random.default_rng(seed)
    validation: dict[str, str] = {}
    while len(validation) < num_validation:
        source, target = fn(rng)
        validation.setdefault(source, target)
    if split == "validation":
        return tuple(validation.items())
    train = []
    while len(train) < num_train:
        source, target = fn(rng)
        if source not in validation:
            train.append((source, target))
    return tuple(train)


def _dataset_fn(task_name: str) -> Callable[..., tf.data.Dataset]:
    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
        del shuffle_files, seed  # one in-memory shard, generated deterministically
        pairs = generate(task_name, split)
        return tf.data.Dataset.from_tensor_slices(
            {"inputs": [p[0] for p in pairs], "targets": [p[1] for p in pairs]}
        )

    dataset_fn.__name__ = f"{task_name}_dataset_fn"
    return dataset_fn


# ---------------------------------------------------------------- postprocessors, metrics
def to_int(output: str, example=None, is_target: bool = False) -> int | None:
    """The decoded integer, or None when the output is not one."""
    del example, is_target
    text = output.decode() if isinstance(output, bytes) else str(output)
    try:
        return int(text.strip())
    except ValueError:
        return None


def label_index(labels: Sequence[str]) -> Callable[..., int]:
    """Postprocessor: the index of the decoded label word in `labels`, -1 if unknown."""

    def postprocess(output: str, example=None, is_target: bool = False) -> int:
        del example, is_target
        text = output.decode() if isinstance(output, bytes) else str(output)
        text = text.strip()
        return labels.index(text) if text in labels else -1

    return postprocess


def accuracy(targets: Sequence, predictions: Sequence) -> dict[str, float]:
    """`{"accuracy": percent of predictions equal to their target}`."""
    if len(targets) != len(predictions):
        raise ValueError(f"{len(targets)} targets but {len(predictions)} predictions")
    return {"accuracy": 100.0 * float(np.mean([t == p for t, p in zip(targets, predictions)]))}


def mean_abs_error(targets: Sequence[int], predictions: Sequence[int | None]) -> dict[str, float]:
    """`{"mean_abs_error"}` over predictions that are integers, and `{"parsed"}` percent."""
    errors = [abs(t - p) for t, p in zip(targets, predictions) if p is not None]
    return {
        "mean_abs_error": float(np.mean(errors)) if errors else float("nan"),
        "parsed": 100.0 * len(errors) / max(len(targets), 1),
    }


def yes_f1(targets: Sequence[int], predictions: Sequence[int]) -> dict[str, float]:
    """`{"f1"}` percent F1 of the positive class `yes` (index 1)."""
    t = np.asarray(targets) == 1
    p = np.asarray(predictions) == 1
    tp = float((t & p).sum())
    denom = float(t.sum() + p.sum())
    return {"f1": 100.0 * 2 * tp / denom if denom else 100.0}


_POSTPROCESS = {
    "synthetic_reverse_v001": (None, [accuracy]),
    "synthetic_count_v001": (to_int, [accuracy, mean_abs_error]),
    "synthetic_keyword_v001": (label_index(YES_NO), [accuracy, yes_f1]),
    "synthetic_majority_v001": (label_index(MAJORITY_LABELS), [accuracy]),
}


def _register() -> None:
    byte_vocab = vocab.byte_vocabulary()
    features = {
        "inputs": seqio.Feature(byte_vocab, add_eos=True),
        "targets": seqio.Feature(byte_vocab, add_eos=True),
    }
    for name in TASKS:
        postprocess_fn, metric_fns = _POSTPROCESS[name]
        if name in seqio.TaskRegistry.names():
            seqio.TaskRegistry.remove(name)
        seqio.TaskRegistry.add(
            name,
            source=seqio.FunctionDataSource(
                _dataset_fn(name), splits=("train", "validation"), num_input_examples=SPLIT_SIZES[name]
            ),
            preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
            output_features=features,
            postprocess_fn=postprocess_fn,
            metric_fns=metric_fns,
        )
    if MIXTURE_NAME in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove(MIXTURE_NAME)
    seqio.MixtureRegistry.add(
        MIXTURE_NAME, [(name, float(SPLIT_SIZES[name]["train"])) for name in TASKS]
    )


_register()
