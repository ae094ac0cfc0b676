"""Sampled decoding (`ktx.models.decoding.temperature_sample`): on a toy model whose
next-token distribution is known the samples follow `softmax(logits / T)` within sampling
error; top-k and top-p never leave their sets; temperature 0 is greedy; EOS, padding and
seeds as documented; the T5 model and `ktx infer` with `decode_method="sample"`."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx import cli
from ktx.models import decoding
from tests.test_decoding import _BATCH, _LEN, _cache, _markov, _model, _p, _rescore
from tests.tiny_t5_gin import tiny_t5_gin

# A fixed next-token distribution over 6 tokens (0 start/pad, 1 EOS, never drawn here).
_LOGITS = np.array([-30.0, -30.0, 1.5, 0.7, 0.0, -0.8], np.float32)
_ROWS = 6000


def _fixed(ids, cache):
    return jnp.broadcast_to(jnp.asarray(_LOGITS), (ids.shape[0], _LOGITS.size)), cache


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def _first_tokens(seed, temperature=1.0, top_k=None, top_p=1.0):
    tokens, _ = decoding.temperature_sample(
        _fixed, {}, _ROWS, 1, rng=jax.random.key(seed), temperature=temperature, top_k=top_k,
        top_p=top_p)
    return tokens[:, 0]


def _frequencies(temperature=1.0, top_k=None, top_p=1.0, seeds=(0, 1)):
    """Empirical distribution of the drawn token over `len(seeds) * _ROWS` rows (each row
    of each seed its own key)."""
    drawn = np.concatenate([np.asarray(_first_tokens(s, temperature, top_k, top_p))
                            for s in seeds])
    return np.bincount(drawn, minlength=_LOGITS.size) / drawn.size, drawn


def _within_sampling_error(freq, probs, n):
    sigma = np.sqrt(probs * (1 - probs) / n) + 1e-12
    assert np.all(np.abs(freq - probs) <= 4.5 * sigma), (freq, probs)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_samples_follow_the_tempered_softmax(temperature):
    freq, drawn = _frequencies(temperature)
    probs = np.asarray(jax.nn.softmax(_LOGITS / temperature))
    _within_sampling_error(freq, probs, drawn.size)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_top_k_never_leaves_the_k_most_likely(top_k):
    freq, drawn = _frequencies(1.0, top_k=top_k)
    allowed = np.argsort(-_LOGITS)[:top_k]
    assert set(np.unique(drawn)) <= set(allowed.tolist())
    probs = np.zeros_like(_LOGITS)
    probs[allowed] = np.asarray(jax.nn.softmax(_LOGITS[allowed]))  # renormalised over the k
    _within_sampling_error(freq, probs, drawn.size)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.asarray(jax.nn.softmax(_LOGITS))  # tokens 2..5: .58 .26 .13 .03 (about)
    order = np.argsort(-probs)
    nucleus = order[:np.searchsorted(np.cumsum(probs[order]), 0.8) + 1]  # .58 + .26 >= .8
    assert sorted(nucleus.tolist()) == [2, 3]
    freq, drawn = _frequencies(1.0, top_p=0.8)
    assert set(np.unique(drawn)) <= set(nucleus.tolist())
    want = np.zeros_like(probs)
    want[nucleus] = probs[nucleus] / probs[nucleus].sum()
    _within_sampling_error(freq, want, drawn.size)
    _, drawn = _frequencies(1.0, top_p=0.1)  # below the top token's mass: it alone
    assert set(np.unique(drawn)) == {2}


def test_temperature_zero_is_greedy_and_eos_is_handled():
    greedy, greedy_lp = decoding.greedy_decode(_markov, _cache(3), 3, 5)
    tokens, lp = decoding.temperature_sample(_markov, _cache(3), 3, 5, rng=jax.random.key(0),
                                             temperature=0.0)
    np.testing.assert_array_equal(tokens, greedy)
    np.testing.assert_allclose(lp, greedy_lp)
    # Sampled Markov chains: every row ends at its EOS, 0 after it; the log-probability
    # is the chain's (untempered) one up to and including the EOS.
    tokens, lp = jax.jit(lambda c: decoding.temperature_sample(
        _markov, c, 64, 5, rng=jax.random.key(7), temperature=1.5))(_cache(64))
    tokens = np.asarray(tokens)
    for row, score in zip(tokens, np.asarray(lp)):
        n = int(np.argmax(row == 1)) + 1
        assert row[n - 1] == 1 and np.all(row[n:] == 0) and np.all(row[:n - 1] > 1), row
        assert score == pytest.approx(math.log(_p(row[:n].tolist())), rel=1e-4)
    assert len({tuple(r) for r in tokens}) > 1  # not one sequence for all rows


def test_seeded_reproducible_and_keyed_by_row():
    def sample(seed, rows):
        return np.asarray(decoding.temperature_sample(
            _markov, _cache(len(rows)), len(rows), 5, rng=jax.random.key(seed),
            row_ids=jnp.asarray(rows, jnp.int32))[0])

    a = sample(3, list(range(32)))
    np.testing.assert_array_equal(a, sample(3, list(range(32))))
    assert not np.array_equal(a, sample(4, list(range(32))))
    # Row 5 decoded in another batch, at another position, draws the same tokens.
    np.testing.assert_array_equal(sample(3, [40, 5, 41])[1], a[5])


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature=-0.5; accepted: a number >= 0 (0: greedy)"),
    (dict(top_k=0), "top_k=0; accepted: None (no top-k cut) or an integer >= 1"),
    (dict(top_p=0.0), "top_p=0.0; accepted: a number in (0, 1] (1: no nucleus cut)"),
    (dict(top_p=1.5), "top_p=1.5; accepted: a number in (0, 1]"),
])
def test_bad_settings_name_the_binding(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        decoding.temperature_sample(_markov, _cache(1), 1, 5, rng=jax.random.key(0), **kwargs)


def test_t5_sampling():
    model, params = _model()
    decode = functools.partial(model.decode_batch, max_decode_length=_LEN)
    greedy, _ = jax.jit(decode)(params, _BATCH)
    zero, _ = jax.jit(functools.partial(decode, decode_method="sample", temperature=0.0))(
        params, _BATCH)
    np.testing.assert_array_equal(zero, greedy)
    sampled = functools.partial(decode, decode_method="sample", temperature=1.0, top_k=5, seed=1)
    sequences, scores = jax.jit(sampled)(params, _BATCH)
    assert sequences.shape == (2, 1, _LEN)
    np.testing.assert_array_equal(sequences, jax.jit(sampled)(params, _BATCH)[0])
    log_likelihood, _, _ = _rescore(model, params, np.asarray(sequences[:, 0]))
    np.testing.assert_allclose(scores[:, 0], log_likelihood, rtol=1e-4)  # the model's log p
    predicted = jax.jit(functools.partial(model.predict_batch, max_decode_length=_LEN,
                                          decode_method="sample", top_k=5, seed=1))(params, _BATCH)
    tokens = np.asarray(sequences[:, 0])
    np.testing.assert_array_equal(predicted, np.where(np.cumsum(tokens == 1, 1) > 0, 0, tokens))


def test_ktx_infer_names_a_bad_setting(tmp_path, capsys):
    model = tmp_path / "model.gin"
    model.write_text(tiny_t5_gin())
    code = cli.main(["infer", "--gin_file=runs/infer.gin", f"--gin_file={model}",
                     "--gin.NUM_TASKS=4", f"--gin.CHECKPOINT_PATH='{tmp_path / 'none'}'",
                     "--gin.MIXTURE_OR_TASK_NAME='synthetic_quickstart'",
                     "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
                     f"--gin.INFER_OUTPUT_FILE='{tmp_path / 'out.jsonl'}'",
                     "--gin.infer_script.infer.decode_method='sample'",
                     "--gin.infer_script.infer.top_p=1.5"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("ktx infer: top_p=1.5; accepted: a number in (0, 1] (1: no nucleus "
                          "cut)"), err


def test_decode_evaluator_samples(tmp_path):
    import flax.linen as nn
    import optax

    import ktx.tasks  # noqa: F401 - registers synthetic_quickstart
    from ktx import partitioning
    from ktx.data.pipeline import mixture_task_names
    from ktx.models import seq2seq, t5
    from ktx.runs.eval import DecodeEvaluator, abstract_params_for
    from ktx.training.trainer import Trainer

    tasks = mixture_task_names("synthetic_quickstart")
    lengths = {"inputs": 32, "targets": 8}
    model = seq2seq.EncoderDecoderModel(t5.T5Config(
        vocab_size=384, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32, num_encoder_layers=1,
        num_decoder_layers=1, dropout_rate=0.0), num_tasks=len(tasks))
    trainer = Trainer(model, optax.identity(), mesh=partitioning.create_mesh(1))
    abstract_params_for(model, trainer, 8, lengths)  # the params' shardings
    params = nn.unbox(model.init_variables(jax.random.key(0), jax.tree.map(
        lambda s: np.zeros(s.shape, s.dtype), model.input_spec(8, lengths))))["params"]

    def results(batch_size=8, **kwargs):
        evaluator = DecodeEvaluator(tasks[:1], lengths, batch_size=batch_size, num_examples=16,
                                    **kwargs)
        return evaluator(trainer=trainer, params=params, step=0)

    greedy = results()
    # The evaluator's sampled decode (each example keyed by its index) at temperature 0
    # scores as greedy decoding; at temperature 1 (top-p 0.9) it decodes every task.
    assert results(decode_method="sample", temperature=0.0) == greedy
    sampled = results(decode_method="sample", temperature=1.0, top_p=0.9, seed=3)
    assert set(sampled) == set(greedy)
    with pytest.raises(ValueError, match=re.escape("top_k=0; accepted: None (no top-k cut)")):
        DecodeEvaluator(tasks[:1], lengths, decode_method="sample", top_k=0)
