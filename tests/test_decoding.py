"""Greedy and beam search: a hand-made Markov chain, and the T5 model with its KV cache."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx.models import decoding
from ktx.models import seq2seq, t5

# Tokens: 0 start, 1 EOS, 2 A, 3 B, 4 C. p(next | previous):
#   start -> A .6, B .4;  A -> C .4, B .3, EOS .3;  B -> EOS .9, C .1;  C -> EOS 1.
# Greedy: A C EOS (p .24); best sequence: B EOS (p .36).
_EPS = 1e-9
_TABLE = np.full((5, 5), _EPS)
_TABLE[0, [2, 3]] = [0.6, 0.4]
_TABLE[2, [4, 3, 1]] = [0.4, 0.3, 0.3]
_TABLE[3, [1, 4]] = [0.9, 0.1]
_TABLE[4, 1] = 1.0
_TABLE[1, 1] = 1.0
_TABLE /= _TABLE.sum(1, keepdims=True)


def _markov(ids, cache):
    """`ids` [N, 1] -> log-probs [N, 5]; the cache counts calls per row."""
    logits = jnp.log(jnp.asarray(_TABLE, jnp.float32))[ids[:, 0]]
    return logits, {"calls": cache["calls"] + 1, "index": cache["index"] + 1}


def _cache(batch):
    return {"calls": jnp.zeros((batch,), jnp.int32), "index": jnp.array(0, jnp.int32)}


def _p(seq):
    prev, p = 0, 1.0
    for tok in seq:
        p *= _TABLE[prev, tok]
        prev = tok
    return p


def test_brevity_penalty_formula():
    np.testing.assert_allclose(decoding.brevity_penalty(0.6, 10), (15 / 6) ** 0.6, rtol=1e-6)
    np.testing.assert_allclose(decoding.brevity_penalty(0.6, 10), 1.7328621, rtol=1e-6)
    np.testing.assert_allclose(decoding.brevity_penalty(0.0, 7), 1.0)
    np.testing.assert_allclose(decoding.brevity_penalty(1.0, 1), 1.0)


def test_greedy_on_markov_chain():
    tokens, log_probs = jax.jit(
        lambda c: decoding.greedy_decode(_markov, c, 2, 5)
    )(_cache(2))
    np.testing.assert_array_equal(tokens, [[2, 4, 1, 0, 0]] * 2)
    np.testing.assert_allclose(log_probs, [math.log(_p([2, 4, 1]))] * 2, rtol=1e-5)


def test_beam_search_finds_the_better_sequence():
    tokens, scores = jax.jit(
        lambda c: decoding.beam_search(_markov, c, 1, 5, num_beams=2, alpha=0.0)
    )(_cache(1))
    np.testing.assert_array_equal(tokens[0], [[3, 1, 0, 0, 0], [2, 4, 1, 0, 0]])
    np.testing.assert_allclose(scores[0], np.log([_p([3, 1]), _p([2, 4, 1])]), rtol=1e-5)


def test_length_penalty_prefers_longer_sequences_with_large_alpha():
    alpha = 5.0
    tokens, scores = jax.jit(
        lambda c: decoding.beam_search(_markov, c, 1, 5, num_beams=3, alpha=alpha)
    )(_cache(1))
    def score(seq):
        return math.log(_p(seq)) / ((5 + len(seq)) / 6) ** alpha

    want = sorted([[2, 4, 1], [2, 3, 1], [3, 1], [2, 1]], key=score, reverse=True)[:3]
    assert want[0] == [2, 4, 1]
    for row, seq in zip(np.asarray(tokens[0]), want):
        np.testing.assert_array_equal(row, seq + [0] * (5 - len(seq)))
    np.testing.assert_allclose(scores[0], [score(s) for s in want], rtol=1e-5)


def test_beam_search_with_one_beam_equals_greedy_on_markov_chain():
    greedy, _ = decoding.greedy_decode(_markov, _cache(1), 1, 5)
    beam, _ = decoding.beam_search(_markov, _cache(1), 1, 5, num_beams=1, alpha=0.6)
    np.testing.assert_array_equal(beam[:, 0], greedy)


def test_argument_validation():
    with pytest.raises(ValueError, match="num_beams=0"):
        decoding.beam_search(_markov, _cache(1), 1, 5, num_beams=0)
    with pytest.raises(ValueError, match="max_decode_length=0"):
        decoding.greedy_decode(_markov, _cache(1), 1, 0)


# ---------------------------------------------------------------- the T5 model

_CFG = t5.T5Config(
    vocab_size=24, emb_dim=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=2,
    head_dim=8, mlp_dim=32, dropout_rate=0.0,
)
_ENC = np.array([[5, 6, 7, 1], [8, 9, 1, 0]], np.int32)
_LEN = 6


@functools.lru_cache(maxsize=None)
def _model():
    model = seq2seq.EncoderDecoderModel(_CFG, num_tasks=2, eos_id=1)
    batch = {"encoder_input_tokens": _ENC, "decoder_input_tokens": np.zeros((2, _LEN), np.int32),
             "decoder_target_tokens": np.zeros((2, _LEN), np.int32),
             "task_id": np.array([0, 1], np.int32)}
    # Seed 3: an untrained model that never emits the padding id 0 before EOS here (the
    # teacher-forcing checks below treat target 0 as padding; `_rescore` asserts it).
    params = nn.unbox(model.init_variables(jax.random.key(3), batch))["params"]
    return model, params


_BATCH = {"encoder_input_tokens": _ENC, "task_id": np.array([0, 1], np.int32)}


def _rescore(model, params, tokens):
    """Teacher-forced log-likelihood of raw decoded `tokens` `[2, L]` up to and including
    their EOS, their lengths (EOS included) and the teacher-forcing batch."""
    with_eos = np.asarray(tokens)
    lengths = np.where((with_eos == 1).any(1), (with_eos == 1).argmax(1) + 1, _LEN)
    for row, n in enumerate(lengths):
        assert np.all(with_eos[row, :n] > 0), ("padding id decoded", with_eos)
    dec_in = np.concatenate([np.zeros((2, 1), np.int32), with_eos[:, :-1]], 1)
    batch = {**_BATCH, "decoder_input_tokens": dec_in, "decoder_target_tokens": with_eos,
             "decoder_loss_weights": (np.arange(_LEN)[None] < lengths[:, None]).astype(np.float32)}
    return np.asarray(model.score_batch(params, batch)), lengths, batch


def test_t5_greedy_equals_argmax_of_teacher_forced_logits():
    model, params = _model()
    sequences, scores = jax.jit(
        functools.partial(model.decode_batch, max_decode_length=_LEN)
    )(params, _BATCH)
    assert sequences.shape == (2, 1, _LEN) and scores.shape == (2, 1)
    tokens, scores = np.asarray(sequences[:, 0]), np.asarray(scores[:, 0])
    # predict_batch: the same tokens, EOS and after replaced by 0.
    predicted = jax.jit(functools.partial(model.predict_batch, max_decode_length=_LEN))(
        params, _BATCH
    )
    np.testing.assert_array_equal(predicted, np.where(np.cumsum(tokens == 1, 1) > 0, 0, tokens))
    log_likelihood, lengths, batch = _rescore(model, params, tokens)
    # Feed the decoded tokens back (teacher forcing): each is the argmax at its position.
    logits = np.asarray(model.logits(params, batch))
    for row in range(2):
        n = lengths[row]
        np.testing.assert_array_equal(
            logits[row, :n].argmax(-1), batch["decoder_target_tokens"][row, :n]
        )
    np.testing.assert_allclose(scores, log_likelihood, rtol=1e-4)


def test_t5_beam_search_one_beam_equals_greedy_and_scores_match_rescoring():
    model, params = _model()
    greedy, _ = jax.jit(functools.partial(model.decode_batch, max_decode_length=_LEN))(
        params, _BATCH
    )
    greedy = greedy[:, 0]
    one_beam, _ = jax.jit(functools.partial(
        model.decode_batch, decode_method="beam", num_beams=1, max_decode_length=_LEN
    ))(params, _BATCH)
    np.testing.assert_array_equal(one_beam[:, 0], greedy)
    # With 3 beams (cache rows gathered across beams), the best beam's score is its
    # length-penalised log-likelihood recomputed by teacher forcing, and at least the
    # greedy sequence's.
    beams, beam_scores = jax.jit(functools.partial(
        model.decode_batch, decode_method="beam", num_beams=3, alpha=0.6,
        max_decode_length=_LEN,
    ))(params, _BATCH)
    assert beams.shape == (2, 3, _LEN)
    assert np.all(np.diff(np.asarray(beam_scores), axis=1) <= 0)  # best first
    tokens, scores = beams[:, 0], beam_scores[:, 0]
    log_likelihood, lengths, _ = _rescore(model, params, tokens)
    np.testing.assert_allclose(
        scores, log_likelihood / np.asarray(decoding.brevity_penalty(0.6, lengths)), rtol=1e-4
    )
    g_ll, g_lengths, _ = _rescore(model, params, greedy)
    g_score = g_ll / np.asarray(decoding.brevity_penalty(0.6, g_lengths))
    assert np.all(np.asarray(scores) >= g_score - 1e-4)
