"""Encoder-decoder feature conversion with task ids and per-task packing (numpy).

The conversion follows `seqio.EncDecFeatureConverter` exactly (same feature names and
values; checked against it in tests): `inputs` -> `encoder_input_tokens`, `targets` ->
`decoder_target_tokens`, `decoder_input_tokens` = the targets shifted right with 0 as the
start token (per segment when packed), `decoder_loss_weights` = 1 on non-padding target
positions. Packing adds `encoder_segment_ids`/`encoder_positions` and
`decoder_segment_ids`/`decoder_positions` (segments numbered from 1, padding 0).

Conversion runs once per task, so a packed row only ever holds examples of one task and
the row's `task_id` (added by `add_task_id`) is right for every segment in it. Packing is
greedy in example order (an example opens a new row when its inputs or targets no longer
fit the current one), which is deterministic. Arrays are kept in the smallest unsigned
dtype that holds their values (`compact`) and widened to the model dtypes on gather.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "ENC_DEC_FEATURES",
    "PACKED_FEATURES",
    "OUTPUT_DTYPES",
    "TokenExamples",
    "tokens_from_dataset",
    "tokens_from_batches",
    "pack_rows",
    "convert_enc_dec",
    "add_task_id",
    "compact",
    "widen",
    "pad_rows",
]

ENC_DEC_FEATURES = (
    "encoder_input_tokens",
    "decoder_input_tokens",
    "decoder_target_tokens",
    "decoder_loss_weights",
)
PACKED_FEATURES = (
    "encoder_segment_ids",
    "encoder_positions",
    "decoder_segment_ids",
    "decoder_positions",
)
OUTPUT_DTYPES = {name: np.int32 for name in ENC_DEC_FEATURES + PACKED_FEATURES + ("task_id",)}
OUTPUT_DTYPES["decoder_loss_weights"] = np.float32
OUTPUT_DTYPES["label"] = np.float32  # encoder features (`ktx.data.encoder_features`)
OUTPUT_DTYPES["mlm_weights"] = np.float32  # masked-LM features (`ktx.data.mlm_features`)


class TokenExamples(dict):
    """`{"inputs": [N, Le], "targets": [N, Ld]}` zero-padded token ids, plus lengths.

    `lengths[key]` is `[N]` int64: the number of tokens of each example (its padding
    starts there).
    """

    def __init__(self, tokens: Mapping[str, np.ndarray], lengths: Mapping[str, np.ndarray]):
        super().__init__(tokens)
        self.lengths = dict(lengths)

    @property
    def num_examples(self) -> int:
        return int(next(iter(self.values())).shape[0])


def tokens_from_dataset(
    examples: Iterable[Mapping[str, np.ndarray]],
    feature_lengths: Mapping[str, int],
    *,
    source: str = "dataset",
) -> TokenExamples:
    """Collects token features of `examples` into zero-padded `[N, L]` arrays.

    Args:
      examples: dicts holding at least the keys of `feature_lengths`, each a 1-D int
        array of token ids (as `seqio.Task.get_dataset(...).as_numpy_iterator()` yields).
      feature_lengths: e.g. `{"inputs": 512, "targets": 32}`; longer examples raise
        (trim them in the task, as `get_dataset(trim_output_features=True)` does).
      source: named in errors (e.g. the task name and split).
    """
    for key, length in feature_lengths.items():
        if not isinstance(length, (int, np.integer)) or length < 1:
            raise ValueError(f"feature length {key}={length!r}; accepted: an int >= 1")
    columns: dict[str, list[np.ndarray]] = {k: [] for k in feature_lengths}
    for number, example in enumerate(examples):
        for key, length in feature_lengths.items():
            if key not in example:
                raise ValueError(
                    f"{source}: example {number} has no feature {key!r} (it has {sorted(example)})"
                )
            value = np.asarray(example[key])
            if value.ndim != 1:
                raise ValueError(f"{source}: example {number} feature {key!r} has shape {value.shape}; expected 1-D tokens")
            if value.size > length:
                raise ValueError(
                    f"{source}: example {number} feature {key!r} has {value.size} tokens > length {length}"
                )
            columns[key].append(value)
    tokens, lengths = {}, {}
    for key, length in feature_lengths.items():
        values = columns[key]
        lens = np.array([v.size for v in values], dtype=np.int64)
        out = np.zeros((len(values), length), dtype=np.int64)
        if values:
            mask = np.arange(length)[None, :] < lens[:, None]
            out[mask] = np.concatenate(values).astype(np.int64)
        tokens[key], lengths[key] = out, lens
    return TokenExamples(tokens, lengths)


def tokens_from_batches(
    batches: Iterable[Mapping[str, np.ndarray]],
    feature_lengths: Mapping[str, int],
    *,
    source: str = "dataset",
) -> TokenExamples:
    """Like `tokens_from_dataset` for zero-padded batches `{key: [b, L_key]}`.

    This is the fast path (`dataset.padded_batch(...)`); an example's length is the
    position after its last non-zero token (token id 0 is padding in SeqIO vocabularies).
    """
    columns: dict[str, list[np.ndarray]] = {k: [] for k in feature_lengths}
    for batch in batches:
        for key, length in feature_lengths.items():
            if key not in batch:
                raise ValueError(f"{source}: batch has no feature {key!r} (it has {sorted(batch)})")
            value = np.asarray(batch[key])
            if value.ndim != 2 or value.shape[1] > length:
                raise ValueError(
                    f"{source}: feature {key!r} batch has shape {value.shape}; expected [b, <= {length}]"
                )
            padded = np.zeros((value.shape[0], length), np.int64)
            padded[:, : value.shape[1]] = value
            columns[key].append(padded)
    tokens, lengths = {}, {}
    for key, length in feature_lengths.items():
        out = np.concatenate(columns[key]) if columns[key] else np.zeros((0, length), np.int64)
        nonzero = out != 0
        lengths[key] = np.where(nonzero.any(axis=1), length - np.argmax(nonzero[:, ::-1], axis=1), 0)
        tokens[key] = out
    return TokenExamples(tokens, lengths)


def pack_rows(
    input_lengths: np.ndarray, target_lengths: np.ndarray, input_length: int, target_length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy in-order packing: `(row [N], input_offset [N], target_offset [N])`.

    Example `i` goes to the current row unless its inputs or targets overflow it, in
    which case it opens the next row.
    """
    n = len(input_lengths)
    rows = np.zeros(n, np.int64)
    in_off = np.zeros(n, np.int64)
    tg_off = np.zeros(n, np.int64)
    row, used_in, used_tg = 0, 0, 0
    for i, (li, lt) in enumerate(zip(input_lengths.tolist(), target_lengths.tolist())):
        if (used_in + li > input_length or used_tg + lt > target_length) and (used_in or used_tg):
            row, used_in, used_tg = row + 1, 0, 0
        rows[i], in_off[i], tg_off[i] = row, used_in, used_tg
        used_in += li
        used_tg += lt
    return rows, in_off, tg_off


def _scatter(
    tokens: np.ndarray, lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray, num_rows: int, length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Places each example's tokens at (row, offset): `(tokens, segment_ids, positions)`."""
    width = tokens.shape[1]
    mask = np.arange(width)[None, :] < lengths[:, None]
    cols = offsets[:, None] + np.arange(width)[None, :]
    row_index = np.broadcast_to(rows[:, None], mask.shape)
    # Segment number of each example within its row (1-based).
    first = np.r_[True, rows[1:] != rows[:-1]] if rows.size else np.zeros(0, bool)
    group_start = np.maximum.accumulate(np.where(first, np.arange(rows.size), 0)) if rows.size else rows
    segment = np.arange(rows.size) - group_start + 1
    out_tokens = np.zeros((num_rows, length), np.int64)
    out_segments = np.zeros((num_rows, length), np.int64)
    out_positions = np.zeros((num_rows, length), np.int64)
    out_tokens[row_index[mask], cols[mask]] = tokens[mask]
    out_segments[row_index[mask], cols[mask]] = np.broadcast_to(segment[:, None], mask.shape)[mask]
    out_positions[row_index[mask], cols[mask]] = np.broadcast_to(np.arange(width)[None, :], mask.shape)[mask]
    return out_tokens, out_segments, out_positions


def convert_enc_dec(
    examples: TokenExamples, input_length: int, target_length: int, *, pack: bool = False
) -> dict[str, np.ndarray]:
    """seqio EncDec features of one task's examples: dict of `[R, L]` int64 arrays.

    `R = N` unpacked; packed, `R` is the number of packed rows. Inputs longer than
    `input_length` (targets than `target_length`) raise ValueError.
    """
    inputs, targets = examples["inputs"], examples["targets"]
    li, lt = examples.lengths["inputs"], examples.lengths["targets"]
    if li.size and li.max() > input_length:
        raise ValueError(f"an example has {li.max()} input tokens > input_length={input_length}")
    if lt.size and lt.max() > target_length:
        raise ValueError(f"an example has {lt.max()} target tokens > target_length={target_length}")
    n = li.size
    # Shift right per example (start token 0), then place like the targets.
    shifted = np.zeros_like(targets)
    shifted[:, 1:] = targets[:, :-1]
    # Unpacked, seqio shifts the whole padded row (the last EOS lands on a padding
    # position, whose loss weight is 0); packed, each segment is shifted on its own.
    shifted_lengths = lt if pack else np.minimum(lt + 1, targets.shape[1])
    if pack:
        rows, in_off, tg_off = pack_rows(li, lt, input_length, target_length)
        num_rows = int(rows[-1]) + 1 if n else 0
    else:
        rows, in_off, tg_off = np.arange(n), np.zeros(n, np.int64), np.zeros(n, np.int64)
        num_rows = n
    enc, enc_seg, enc_pos = _scatter(inputs, li, rows, in_off, num_rows, input_length)
    dec_t, dec_seg, dec_pos = _scatter(targets, lt, rows, tg_off, num_rows, target_length)
    dec_in, _, _ = _scatter(shifted, shifted_lengths, rows, tg_off, num_rows, target_length)
    out = {
        "encoder_input_tokens": enc,
        "decoder_input_tokens": dec_in,
        "decoder_target_tokens": dec_t,
        "decoder_loss_weights": (dec_t != 0).astype(np.int64),
    }
    if pack:
        out.update(
            encoder_segment_ids=enc_seg,
            encoder_positions=enc_pos,
            decoder_segment_ids=dec_seg,
            decoder_positions=dec_pos,
        )
    return out


def add_task_id(features: Mapping[str, np.ndarray], task_id: int,
                dtype: Any = np.int64) -> dict[str, np.ndarray]:
    """Adds `task_id` `[R]` (every row of one task's features gets `task_id`); the one
    place a task's rows are labelled (training cache, evaluation, inference)."""
    if task_id < 0:
        raise ValueError(f"task_id={task_id!r}; accepted: an int >= 0")
    num_rows = next(iter(features.values())).shape[0]
    return {**features, "task_id": np.full(num_rows, task_id, dtype)}


def compact(features: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stores each integer feature in the smallest dtype holding it: unsigned when it has
    no negative value, else signed (floating features, e.g. an encoder task's `label`,
    stay float32)."""
    out = {}
    for key, value in features.items():
        if np.issubdtype(value.dtype, np.floating):
            out[key] = value.astype(np.float32)
            continue
        top = int(value.max()) if value.size else 0
        low = int(value.min()) if value.size else 0
        # Negative values (a tagging task's ignored token labels, -100) need a signed dtype.
        dtypes = (np.int8, np.int16, np.int32, np.int64) if low < 0 else (
            np.uint8, np.uint16, np.uint32, np.uint64)
        for dtype in dtypes:
            if np.iinfo(dtype).min <= low and top <= np.iinfo(dtype).max:
                out[key] = value.astype(dtype)
                break
    return out


def widen(features: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Casts features to the model dtypes (`OUTPUT_DTYPES`; unknown keys -> int32)."""
    return {k: v.astype(OUTPUT_DTYPES.get(k, np.int32)) for k, v in features.items()}


def pad_rows(features: Mapping[str, np.ndarray], num_rows: int) -> dict[str, np.ndarray]:
    """Appends zero rows up to `num_rows`; `task_id` of padding copies row 0's task."""
    out = {}
    for key, value in features.items():
        have = value.shape[0]
        if have > num_rows:
            raise ValueError(f"feature {key!r} has {have} rows > num_rows={num_rows}")
        fill = np.zeros((num_rows - have,) + value.shape[1:], value.dtype)
        if key == "task_id" and have:
            fill[:] = value[0]
        out[key] = np.concatenate([value, fill])
    return out
