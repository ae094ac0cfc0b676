"""Masked-language-model encoder tasks: disease knowledge infusion on BERT-family encoders
(He et al., EMNLP 2020, "Infusing Disease Knowledge into BERT for Health Question
Answering, Medical Inference and Disease Name Recognition"), and their feature conversion.

A masked-LM task is a `seqio.Task` whose output features are (`mlm_output_features`):

* `text_a`, `text_b` `[n]` int32: word pieces, already masked (no special tokens);
* `mlm_a`, `mlm_b` `[n]` int32: per piece, the vocabulary id to predict there, 0 where
  nothing is predicted (`[PAD]` = 0 is never a target).

`convert_mlm` turns them into `ktx.models.encoder_mlm.EncoderMlmModel` rows of length
`L` with the layout of every ktx encoder task (`[CLS] a [SEP] b [SEP]`, longest-first
truncation: `ktx.data.encoder_features.convert_encoder`): `mlm_targets` `[L]` (0 off
target) and `mlm_weights` `[L]` float32 (1 on a target). Masking is static: chosen once
per example when the task's split is read (from SeqIO's per-example seeds, so the same
`seed` gives the same masks), as BERT's original pre-training data was.

Disease knowledge infusion (`infusion_pieces`, the paper's section 3 and the authors'
`convert_example_to_feature`): from a (disease, aspect, passage) triple, `text_a` is the
auxiliary sentence "What is the <aspect> of <disease>?" and `text_b` the passage.

* Every piece of `text_a` that is one of the disease's or the aspect's pieces becomes
  `[MASK]` and is predicted (the authors match pieces, not spans: a template word that is
  also a disease piece is masked too).
* Every piece of the passage that is one of the disease's pieces becomes the blank token
  with probability `blank_rate` and stays itself otherwise; it is never predicted. The
  authors add a new token `[blank]` and restore each blank with probability 0.75 per
  batch; here the blank is a vocabulary token (`[unused0]` by default, an untrained row of
  BERT vocabularies) and `blank_rate = 0.25`, drawn once per example.

Ablations (the dissertation's Table 2.6), by `mask` and `auxiliary_sentence`:

| setting | masked and predicted |
|---|---|
| `mask="disease_and_aspect"` (default) | disease and aspect pieces of the auxiliary sentence |
| `mask="disease"` (no aspect) | the disease pieces only; the aspect stays visible |
| `mask="aspect"` (no disease) | the aspect pieces only; the disease stays visible |
| `mask="random"` (BERT's 15%) | round(15%) of all pieces (at least 1): 80% `[MASK]`, 10% a random id, 10% unchanged; no blanks |
| `auxiliary_sentence=False` | no auxiliary sentence: `text_a` is the passage, whose disease pieces are masked and predicted (`mask` "disease_and_aspect" or "disease"; "random" masks the passage) |
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import seqio
import tensorflow as tf

from ktx.data import encoder_features as ef

__all__ = [
    "MLM_TEXT_FEATURES",
    "INFUSION_MASKS",
    "RANDOM_MASK_RATE",
    "mlm_output_features",
    "is_mlm_task",
    "infusion_pieces",
    "infusion_preprocessor",
    "convert_mlm",
]

MLM_TEXT_FEATURES = ("text_a", "text_b", "mlm_a", "mlm_b")
INFUSION_MASKS = ("disease_and_aspect", "disease", "aspect", "random")
RANDOM_MASK_RATE = 0.15


def mlm_output_features(vocabulary: seqio.Vocabulary) -> dict[str, seqio.Feature]:
    """The output features of a masked-LM task (all four `[n]` int32, on `vocabulary`)."""
    feature = seqio.Feature(vocabulary=vocabulary, add_eos=False, dtype=tf.int32)
    return dict.fromkeys(MLM_TEXT_FEATURES, feature)


def is_mlm_task(task: seqio.Task) -> bool:
    """True when `task` has the masked-LM output features."""
    return all(k in task.output_features for k in MLM_TEXT_FEATURES)


def _random_mask(pieces: np.ndarray, rng: np.random.Generator, *, mask_id: int,
                 vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """BERT's masking of `pieces`: round(15%) positions (at least 1), 80% `[MASK]`, 10% a
    random id in [1, vocab_size), 10% unchanged; returns (inputs, targets)."""
    out, targets = pieces.copy(), np.zeros_like(pieces)
    if not pieces.size:
        return out, targets
    count = max(1, int(round(pieces.size * RANDOM_MASK_RATE)))
    for position in rng.permutation(pieces.size)[:count]:
        targets[position] = pieces[position]
        draw = rng.random()
        if draw < 0.8:
            out[position] = mask_id
        elif draw < 0.9:
            out[position] = rng.integers(1, vocab_size)
    return out, targets


def infusion_pieces(
    question: Sequence[int], passage: Sequence[int], disease: Sequence[int],
    aspect: Sequence[int], rng: np.random.Generator, *, mask: str = "disease_and_aspect",
    auxiliary_sentence: bool = True, blank_rate: float = 0.25, mask_id: int, blank_id: int,
    vocab_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(text_a, text_b, mlm_a, mlm_b)` int32 of one triple's pieces (module docstring)."""
    if mask not in INFUSION_MASKS:
        raise ValueError(f"mask={mask!r}; accepted: {INFUSION_MASKS}")
    if not 0.0 <= blank_rate <= 1.0:
        raise ValueError(f"blank_rate={blank_rate!r}; accepted: a probability in [0, 1]")
    q, p = np.asarray(question, np.int32), np.asarray(passage, np.int32)
    disease_ids = np.asarray(disease, np.int32)
    empty = np.zeros(0, np.int32)
    if not auxiliary_sentence:
        if mask == "aspect":
            raise ValueError("mask='aspect' needs the auxiliary sentence (the aspect is only "
                             "there): set auxiliary_sentence=True or mask='disease'")
        if mask == "random":
            a, ta = _random_mask(p, rng, mask_id=mask_id, vocab_size=vocab_size)
            return a, empty, ta, empty
        hit = np.isin(p, disease_ids)
        return np.where(hit, mask_id, p).astype(np.int32), empty, \
            np.where(hit, p, 0).astype(np.int32), empty
    if mask == "random":
        a, ta = _random_mask(q, rng, mask_id=mask_id, vocab_size=vocab_size)
        b, tb = _random_mask(p, rng, mask_id=mask_id, vocab_size=vocab_size)
        return a, b, ta, tb
    targets = {"disease_and_aspect": np.concatenate([disease_ids, np.asarray(aspect, np.int32)]),
               "disease": disease_ids, "aspect": np.asarray(aspect, np.int32)}[mask]
    hit = np.isin(q, targets)
    a = np.where(hit, mask_id, q).astype(np.int32)
    ta = np.where(hit, q, 0).astype(np.int32)
    blank = np.isin(p, disease_ids) & (rng.random(p.size) < blank_rate)
    b = np.where(blank, blank_id, p).astype(np.int32)
    return a, b, ta, np.zeros_like(b)


def infusion_preprocessor(dataset: tf.data.Dataset, output_features: Mapping[str, seqio.Feature],
                          *, mask: str = "disease_and_aspect", auxiliary_sentence: bool = True,
                          blank_rate: float = 0.25, blank_token: str = "[unused0]"
                          ) -> tf.data.Dataset:
    """Rows `{"question", "passage", "disease", "aspect"}` (strings) -> the masked-LM
    features of `infusion_pieces`, tokenized with `text_a`'s vocabulary (a
    `ktx.data.wordpiece` vocabulary: its `[MASK]` and `blank_token` ids); other keys pass.
    One seed per example from SeqIO's seed manager (`seqio.map_over_dataset(num_seeds=1)`)."""
    vocabulary = output_features["text_a"].vocabulary
    mask_id = vocabulary.token_id("[MASK]")
    blank_id = vocabulary.token_id(blank_token) if mask != "random" else mask_id
    vocab_size = int(vocabulary.vocab_size)
    keys = ("question", "passage", "disease", "aspect")

    def build(question, passage, disease, aspect, seed):
        texts = [t.decode("utf-8") for t in (question, passage, disease, aspect)]
        pieces = vocabulary.encode_batch(texts)
        rng = np.random.default_rng([int(s) & 0xFFFFFFFF for s in seed])
        return infusion_pieces(*pieces, rng, mask=mask, auxiliary_sentence=auxiliary_sentence,
                               blank_rate=blank_rate, mask_id=mask_id, blank_id=blank_id,
                               vocab_size=vocab_size)

    @seqio.map_over_dataset(num_seeds=1)
    def one(x, seed):
        values = tf.numpy_function(build, [*(x[k] for k in keys), seed], (tf.int32,) * 4,
                                   stateful=False)
        out = {k: v for k, v in x.items() if k not in keys}
        for key, value in zip(MLM_TEXT_FEATURES, values):
            value.set_shape([None])
            out[key] = value
        return out

    return one(dataset)


def convert_mlm(text_a: Sequence[Sequence[int]], text_b: Sequence[Sequence[int]],
                mlm_a: Sequence[Sequence[int]], mlm_b: Sequence[Sequence[int]], length: int, *,
                cls_id: int, sep_id: int) -> dict[str, np.ndarray]:
    """`EncoderMlmModel` features `[N, length]`: the encoder layout of
    `ef.convert_encoder` plus `mlm_targets` (the targets moved with their pieces, 0 on the
    special tokens, padding and what truncation cut) and `mlm_weights` (`mlm_targets > 0`)."""
    n = len(text_a)
    if not len(text_b) == len(mlm_a) == len(mlm_b) == n:
        raise ValueError(f"convert_mlm: {n} text_a, {len(text_b)} text_b, {len(mlm_a)} mlm_a and "
                         f"{len(mlm_b)} mlm_b; expected one of each per example")
    out = ef.convert_encoder(text_a, text_b, np.zeros(n, np.float32), length, cls_id=cls_id,
                             sep_id=sep_id)
    del out["label"]
    targets = np.zeros((n, length), np.int64)
    for i, (a, b, ta, tb) in enumerate(zip(text_a, text_b, mlm_a, mlm_b)):
        if len(ta) != len(a) or len(tb) != len(b):
            raise ValueError(f"convert_mlm: example {i} has {len(a)}/{len(b)} pieces but "
                             f"{len(ta)}/{len(tb)} targets; expected one target per piece")
        pair = len(b) > 0
        ka, kb = ef.truncate_longest_first(len(a), len(b), length - (3 if pair else 2))
        row = [0, *ta[:ka], 0, *(list(tb[:kb]) + [0] if pair else [])]
        targets[i, :len(row)] = row
    out["mlm_targets"] = targets
    out["mlm_weights"] = (targets > 0).astype(np.float32)
    return out
