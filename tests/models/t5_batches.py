"""The 4-row, 4-token T5 batch the model tests share (vocabulary of at least 18 ids), and
random task-grouped T5 batches of given rows per task."""

from __future__ import annotations

import numpy as np


def tiny_t5_batch(task_id=(0, 1, 0, 1), *, row_ids: bool = False) -> dict[str, np.ndarray]:
    """Encoder/decoder features of 4 rows with padding, `task_id` per row; `row_ids`: also
    the `row_id` feature (the trainer adds it to every batch)."""
    enc = np.array([[5, 6, 7, 1], [8, 9, 1, 0], [10, 1, 0, 0], [11, 12, 13, 1]], np.int32)
    tgt = np.array([[11, 12, 1, 0], [14, 1, 0, 0], [15, 16, 17, 1], [3, 1, 0, 0]], np.int32)
    dec_in = np.concatenate([np.zeros((4, 1), np.int32), tgt[:, :-1]], axis=1)
    batch = {
        "encoder_input_tokens": enc,
        "decoder_input_tokens": dec_in * (tgt > 0),
        "decoder_target_tokens": tgt,
        "decoder_loss_weights": (tgt > 0).astype(np.float32),
        "task_id": np.asarray(task_id, np.int32),
    }
    if row_ids:
        batch["row_id"] = np.arange(4, dtype=np.int32)
    return batch


def random_t5_batch(counts, seed: int = 0, lengths=(7, 5), vocab: int = 64) -> dict[str, np.ndarray]:
    """`sum(counts)` rows of random tokens in `[2, vocab)`, grouped by task (`counts[t]` rows
    of task t, in task order), every target position weighted 1."""
    rng = np.random.default_rng(seed)
    n, (le, ld) = sum(counts), lengths
    return {
        "encoder_input_tokens": rng.integers(2, vocab, (n, le)).astype(np.int32),
        "decoder_input_tokens": rng.integers(2, vocab, (n, ld)).astype(np.int32),
        "decoder_target_tokens": rng.integers(2, vocab, (n, ld)).astype(np.int32),
        "decoder_loss_weights": np.ones((n, ld), np.float32),
        "task_id": np.repeat(np.arange(len(counts)), counts).astype(np.int32),
    }
