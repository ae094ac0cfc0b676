"""Tests of ktx.data.feature_converter: seqio-identical conversion, per-task packing."""

import numpy as np
import pytest
import seqio
import tensorflow as tf

from ktx.data import feature_converter as fc

EXAMPLES = [
    {"inputs": np.array([5, 6, 7, 1]), "targets": np.array([8, 1])},
    {"inputs": np.array([9, 1]), "targets": np.array([3, 4, 1])},
    {"inputs": np.array([2, 3, 4, 5, 1]), "targets": np.array([6, 1])},
]


def _seqio_features(examples, lengths, pack):
    ds = tf.data.Dataset.from_generator(
        lambda: iter(examples),
        output_signature={
            "inputs": tf.TensorSpec([None], tf.int32),
            "targets": tf.TensorSpec([None], tf.int32),
        },
    )
    converted = seqio.EncDecFeatureConverter(pack=pack)(ds, lengths)
    rows = list(converted.as_numpy_iterator())
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def test_unpacked_matches_seqio():
    lengths = {"inputs": 6, "targets": 4}
    ours = fc.convert_enc_dec(fc.tokens_from_dataset(EXAMPLES, lengths), 6, 4)
    theirs = _seqio_features(EXAMPLES, lengths, pack=False)
    assert set(ours) == set(theirs)
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_packed_hand_computed():
    lengths = {"inputs": 6, "targets": 5}
    out = fc.convert_enc_dec(fc.tokens_from_dataset(EXAMPLES, lengths), 6, 5, pack=True)
    # Example 0 (4 in, 2 tg) and 1 (2 in, 3 tg) share row 0; example 2 opens row 1.
    np.testing.assert_array_equal(out["encoder_input_tokens"], [[5, 6, 7, 1, 9, 1], [2, 3, 4, 5, 1, 0]])
    np.testing.assert_array_equal(out["encoder_segment_ids"], [[1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(out["encoder_positions"], [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 0]])
    np.testing.assert_array_equal(out["decoder_target_tokens"], [[8, 1, 3, 4, 1], [6, 1, 0, 0, 0]])
    np.testing.assert_array_equal(out["decoder_input_tokens"], [[0, 8, 0, 3, 4], [0, 6, 0, 0, 0]])
    np.testing.assert_array_equal(out["decoder_segment_ids"], [[1, 1, 2, 2, 2], [1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(out["decoder_positions"], [[0, 1, 0, 1, 2], [0, 1, 0, 0, 0]])
    np.testing.assert_array_equal(out["decoder_loss_weights"], [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])


def test_packed_segments_unpack_to_the_examples():
    rng = np.random.default_rng(0)
    examples = [
        {"inputs": rng.integers(2, 50, rng.integers(1, 8)), "targets": rng.integers(2, 50, rng.integers(1, 4))}
        for _ in range(40)
    ]
    lengths = {"inputs": 10, "targets": 6}
    out = fc.convert_enc_dec(fc.tokens_from_dataset(examples, lengths), 10, 6, pack=True)
    recovered = []
    for r in range(out["encoder_input_tokens"].shape[0]):
        for s in range(1, out["encoder_segment_ids"][r].max() + 1):
            enc = out["encoder_input_tokens"][r][out["encoder_segment_ids"][r] == s]
            dec = out["decoder_target_tokens"][r][out["decoder_segment_ids"][r] == s]
            recovered.append((enc.tolist(), dec.tolist()))
    assert recovered == [(e["inputs"].tolist(), e["targets"].tolist()) for e in examples]
    assert out["encoder_input_tokens"].shape[0] < len(examples)


def test_task_id_compact_widen_pad():
    feats = fc.add_task_id(fc.convert_enc_dec(fc.tokens_from_dataset(EXAMPLES, {"inputs": 6, "targets": 4}), 6, 4), 3)
    np.testing.assert_array_equal(feats["task_id"], [3, 3, 3])
    small = fc.compact(feats)
    assert small["encoder_input_tokens"].dtype == np.uint8
    wide = fc.widen(fc.pad_rows(small, 5))
    assert wide["decoder_loss_weights"].dtype == np.float32
    assert wide["encoder_input_tokens"].dtype == np.int32
    np.testing.assert_array_equal(wide["task_id"], [3, 3, 3, 3, 3])
    assert wide["decoder_loss_weights"][3:].sum() == 0


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="example 1 has no feature 'targets'"):
        fc.tokens_from_dataset([EXAMPLES[0], {"inputs": np.array([1])}], {"inputs": 6, "targets": 4})
    with pytest.raises(ValueError, match="5 tokens > length 4"):
        fc.tokens_from_dataset(EXAMPLES, {"inputs": 4, "targets": 4}, source="t/train")
    with pytest.raises(ValueError, match="input_length=4"):
        fc.convert_enc_dec(fc.tokens_from_dataset(EXAMPLES, {"inputs": 6, "targets": 4}), 4, 4)


def test_tokens_from_batches_equals_per_example():
    lengths = {"inputs": 6, "targets": 4}
    per_example = fc.tokens_from_dataset(EXAMPLES, lengths)
    batches = [
        {"inputs": per_example["inputs"][:2, :5], "targets": per_example["targets"][:2]},
        {"inputs": per_example["inputs"][2:], "targets": per_example["targets"][2:]},
    ]
    batched = fc.tokens_from_batches(batches, lengths)
    for key in lengths:
        np.testing.assert_array_equal(batched[key], per_example[key])
        np.testing.assert_array_equal(batched.lengths[key], per_example.lengths[key])
