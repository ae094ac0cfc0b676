"""Greedy, sampled and beam-search decoding over a key/value cache, jit-able
(`lax.while_loop`).

The functions are model-agnostic: they drive `tokens_to_logits(ids, cache) -> (logits,
new_cache)`, where `ids` `[N, 1]` are the previous tokens of `N` sequences and `logits`
`[N, V]` score the next one. `cache` is any pytree whose leaves have the batch `N` as
leading axis (scalar leaves, e.g. cache indices, are shared by all sequences); with
`cache_batch_axis=a` (a scanned layer stack's cache: `[layers, N, ...]`, `a = 1`) the
batch is axis `a` and leaves of at most `a` dimensions are shared. Sequences
start from `decoder_start_id` (0 for T5) and stop at `eos_id`; tokens after a
sequence's EOS are 0.

Beam search keeps `num_beams` live and `num_beams` finished hypotheses per example and
ranks finished ones by `log p / length_penalty(length)`, with the GNMT length penalty
`((5 + length) / 6) ** alpha` (Wu et al., 2016, "Google's Neural Machine Translation
System"), as T5X's `decoding.beam_search` does. It stops early once no live beam can
beat the worst finished one.

Sampling (`temperature_sample`, T5X's `decoding.temperature_sample`) draws each next
token from `softmax(logits / temperature)`, restricted to the `top_k` most likely tokens
and then to the smallest set of them whose probability reaches `top_p` (nucleus
sampling, Holtzman et al., 2020). Row `i`'s draw at position `t` uses
`fold_in(fold_in(rng, row_ids[i]), t)`, so a sample depends on the seed and the row's
id only, not on the batch it is decoded in; temperature 0 is greedy decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["NEG_INF", "brevity_penalty", "check_sampling", "greedy_decode", "beam_search",
           "temperature_sample"]

NEG_INF = -1.0e7

TokensToLogits = Callable[[jax.Array, Any], tuple[jax.Array, Any]]


def brevity_penalty(alpha: float, length: jax.Array | int) -> jax.Array:
    """GNMT length penalty `((5 + length) / 6) ** alpha` (Wu et al., 2016)."""
    return jnp.power((5.0 + jnp.asarray(length, jnp.float32)) / 6.0, alpha)


def _check(batch_size: int, max_decode_length: int, **ints: int) -> None:
    for name, value in {"batch_size": batch_size, "max_decode_length": max_decode_length, **ints}.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")


class _GreedyState(NamedTuple):
    index: jax.Array  # scalar: position of the last written token
    sequences: jax.Array  # [B, L + 1], column 0 = decoder start
    log_probs: jax.Array  # [B]
    finished: jax.Array  # [B] bool
    cache: Any


def _start_state(initial_cache, batch_size: int, max_decode_length: int,
                 decoder_start_id: int) -> "_GreedyState":
    """Greedy and sampled decoding's loop state before the first token: every row holds
    `decoder_start_id`, nothing is finished."""
    sequences = jnp.zeros((batch_size, max_decode_length + 1), jnp.int32)
    sequences = sequences.at[:, 0].set(decoder_start_id)
    return _GreedyState(
        jnp.array(0, jnp.int32), sequences, jnp.zeros((batch_size,), jnp.float32),
        jnp.zeros((batch_size,), bool), initial_cache,
    )


def greedy_decode(
    tokens_to_logits: TokensToLogits,
    initial_cache: Any,
    batch_size: int,
    max_decode_length: int,
    *,
    eos_id: int = 1,
    decoder_start_id: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Most likely next token at every step.

    Returns `(tokens [B, L] int32, log_probs [B])`: tokens exclude the start token and
    keep the EOS (0 after it); `log_probs` sums the chosen tokens' log-probabilities up
    to and including the EOS.
    """
    _check(batch_size, max_decode_length)
    state = _start_state(initial_cache, batch_size, max_decode_length, decoder_start_id)

    def cond(s: _GreedyState):
        return (s.index < max_decode_length) & ~jnp.all(s.finished)

    def body(s: _GreedyState):
        ids = lax.dynamic_slice_in_dim(s.sequences, s.index, 1, axis=1)  # [B, 1]
        logits, cache = tokens_to_logits(ids, s.cache)
        log_probs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
        next_ids = jnp.argmax(log_probs, axis=-1).astype(jnp.int32)
        chosen = jnp.take_along_axis(log_probs, next_ids[:, None], axis=-1)[:, 0]
        next_ids = jnp.where(s.finished, 0, next_ids)
        total = s.log_probs + jnp.where(s.finished, 0.0, chosen)
        sequences = lax.dynamic_update_slice_in_dim(s.sequences, next_ids[:, None], s.index + 1, 1)
        finished = s.finished | (next_ids == eos_id)
        return _GreedyState(s.index + 1, sequences, total, finished, cache)

    final = lax.while_loop(cond, body, state)
    return final.sequences[:, 1:], final.log_probs


# ------------------------------------------------------------------------------------
# Sampling.
# ------------------------------------------------------------------------------------


def check_sampling(temperature: Any, top_k: Any, top_p: Any) -> None:
    """ValueError naming the first sampling setting out of range and what is accepted."""
    number = (int, float)
    if isinstance(temperature, bool) or not isinstance(temperature, number) or not temperature >= 0:
        raise ValueError(f"temperature={temperature!r}; accepted: a number >= 0 (0: greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r}; accepted: None (no top-k cut) or an integer >= 1")
    if isinstance(top_p, bool) or not isinstance(top_p, number) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}; accepted: a number in (0, 1] (1: no nucleus cut)")


def _sample_ids(key: jax.Array, logits: jax.Array, temperature: float, top_k: int | None,
                top_p: float) -> jax.Array:
    """One token id drawn from one row's `logits [V]` (see the module doc)."""
    vocab = logits.shape[-1]
    k = vocab if top_k is None else min(top_k, vocab)
    if k == vocab and top_p >= 1.0:
        return jax.random.categorical(key, logits / temperature).astype(jnp.int32)
    values, ids = lax.top_k(logits / temperature, k)  # sorted, most likely first
    if top_p < 1.0:
        probs = jax.nn.softmax(values)
        before = jnp.cumsum(probs) - probs  # mass of the more likely tokens
        values = jnp.where(before < top_p, values, -jnp.inf)  # the first always stays
    return ids[jax.random.categorical(key, values)].astype(jnp.int32)


def temperature_sample(
    tokens_to_logits: TokensToLogits,
    initial_cache: Any,
    batch_size: int,
    max_decode_length: int,
    *,
    rng: jax.Array,
    row_ids: jax.Array | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    eos_id: int = 1,
    decoder_start_id: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Samples each next token (temperature, top-k, top-p; the module doc).

    `rng` is a key; `row_ids` `[B]` int (default `0 .. B - 1`) name the rows whose draws
    are independent. Returns `(tokens [B, L] int32, log_probs [B])` as `greedy_decode`:
    the EOS kept, 0 after it; `log_probs` sums the model's (untempered) log-probabilities
    of the drawn tokens up to and including the EOS. `temperature=0` is `greedy_decode`.
    """
    _check(batch_size, max_decode_length)
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return greedy_decode(tokens_to_logits, initial_cache, batch_size, max_decode_length,
                             eos_id=eos_id, decoder_start_id=decoder_start_id)
    if row_ids is None:
        row_ids = jnp.arange(batch_size, dtype=jnp.int32)
    row_keys = jax.vmap(lambda r: jax.random.fold_in(rng, r))(jnp.asarray(row_ids, jnp.int32))
    state = _start_state(initial_cache, batch_size, max_decode_length, decoder_start_id)

    def cond(s: _GreedyState):
        return (s.index < max_decode_length) & ~jnp.all(s.finished)

    def body(s: _GreedyState):
        ids = lax.dynamic_slice_in_dim(s.sequences, s.index, 1, axis=1)  # [B, 1]
        logits, cache = tokens_to_logits(ids, s.cache)
        logits = jnp.asarray(logits, jnp.float32)
        keys = jax.vmap(lambda key: jax.random.fold_in(key, s.index))(row_keys)
        next_ids = jax.vmap(lambda key, row: _sample_ids(key, row, temperature, top_k, top_p))(
            keys, logits)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        chosen = jnp.take_along_axis(log_probs, next_ids[:, None], axis=-1)[:, 0]
        next_ids = jnp.where(s.finished, 0, next_ids)
        total = s.log_probs + jnp.where(s.finished, 0.0, chosen)
        sequences = lax.dynamic_update_slice_in_dim(s.sequences, next_ids[:, None], s.index + 1, 1)
        finished = s.finished | (next_ids == eos_id)
        return _GreedyState(s.index + 1, sequences, total, finished, cache)

    final = lax.while_loop(cond, body, state)
    return final.sequences[:, 1:], final.log_probs


# ------------------------------------------------------------------------------------
# Beam search.
# ------------------------------------------------------------------------------------


def _flatten(x: jax.Array) -> jax.Array:
    """[B, K, ...] -> [B * K, ...]."""
    return x.reshape((-1,) + x.shape[2:])


def _unflatten(x: jax.Array, batch_size: int) -> jax.Array:
    return x.reshape((batch_size, -1) + x.shape[1:])


def _map_batched(fn: Callable[[jax.Array], jax.Array], tree: Any, axis: int = 0) -> Any:
    """Applies `fn` to leaves with a batch axis `axis`; leaves of at most `axis`
    dimensions (scalars; a scanned stack's per-layer indices) are shared, kept as is."""
    return jax.tree.map(lambda x: fn(x) if jnp.ndim(x) > axis else x, tree)


def _gather_beams(
    tree: Any, beam_indices: jax.Array, batch_size: int, beams_in: int, axis: int = 0
) -> Any:
    """Selects beams: leaves `[B * beams_in, ...]` -> `[B * beams_out, ...]` (batch axis
    `axis`). `beam_indices` `[B, beams_out]` index into each example's `beams_in` beams.
    """
    flat = (jnp.arange(batch_size)[:, None] * beams_in + beam_indices).reshape(-1)
    return _map_batched(lambda x: jnp.take(x, flat, axis=axis), tree, axis)


def _gather(x: jax.Array, indices: jax.Array) -> jax.Array:
    """`x` `[B, K, ...]`, `indices` `[B, K']` -> `[B, K', ...]`."""
    return jax.vmap(lambda a, i: a[i])(x, indices)


class _BeamState(NamedTuple):
    index: jax.Array
    live_log_probs: jax.Array  # [B, K]
    live_sequences: jax.Array  # [B, K, L + 1]
    finished_scores: jax.Array  # [B, K]
    finished_sequences: jax.Array  # [B, K, L + 1]
    finished_flags: jax.Array  # [B, K]
    cache: Any  # leaves [B * K, ...]


def beam_search(
    tokens_to_logits: TokensToLogits,
    initial_cache: Any,
    batch_size: int,
    max_decode_length: int,
    *,
    num_beams: int = 4,
    alpha: float = 0.6,
    eos_id: int = 1,
    decoder_start_id: int = 0,
    cache_batch_axis: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Beam search with the GNMT length penalty.

    `initial_cache` leaves are per example (`[B, ...]`); they are repeated per beam and
    `tokens_to_logits` is called on `N = B * num_beams` sequences (example-major: rows
    `b * K .. b * K + K - 1` are example `b`'s beams), so any per-example input closed
    over by `tokens_to_logits` must be repeated the same way (`jnp.repeat(x, K, 0)`).

    Returns `(tokens [B, K, L] int32, scores [B, K])` sorted best first; a finished
    hypothesis of `n` tokens (EOS included) scores `log p / ((5 + n) / 6) ** alpha`.
    Examples with no finished hypothesis return their live beams scored the same way
    with `n = L`.
    """
    _check(batch_size, max_decode_length, num_beams=num_beams)
    k = num_beams
    axis = cache_batch_axis
    cache = _map_batched(lambda x: jnp.repeat(x, k, axis=axis), initial_cache, axis)
    length = max_decode_length
    live_log_probs = jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (batch_size, 1))
    sequences = jnp.zeros((batch_size, k, length + 1), jnp.int32).at[:, :, 0].set(decoder_start_id)
    state = _BeamState(
        jnp.array(0, jnp.int32), live_log_probs, sequences,
        jnp.full((batch_size, k), NEG_INF, jnp.float32), sequences,
        jnp.zeros((batch_size, k), bool), cache,
    )
    max_penalty = brevity_penalty(alpha, length)

    def cond(s: _BeamState):
        not_at_end = s.index < length
        best_live = s.live_log_probs[:, 0] / max_penalty
        worst_finished = jnp.where(
            jnp.all(s.finished_flags, axis=1), jnp.min(s.finished_scores, axis=1), NEG_INF
        )
        return not_at_end & ~jnp.all(best_live < worst_finished)

    def body(s: _BeamState):
        ids = lax.dynamic_slice_in_dim(s.live_sequences, s.index, 1, axis=2)  # [B, K, 1]
        logits, cache = tokens_to_logits(_flatten(ids), s.cache)
        log_probs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
        vocab = log_probs.shape[-1]
        candidates = s.live_log_probs[:, :, None] + _unflatten(log_probs, batch_size)
        flat = candidates.reshape(batch_size, k * vocab)
        # 2K candidates guarantee K that do not end here.
        top_log_probs, top_indices = lax.top_k(flat, 2 * k)
        top_beams = top_indices // vocab
        top_ids = (top_indices % vocab).astype(jnp.int32)
        top_sequences = _gather(s.live_sequences, top_beams)
        top_sequences = lax.dynamic_update_slice_in_dim(
            top_sequences, top_ids[:, :, None], s.index + 1, axis=2
        )
        ended = top_ids == eos_id

        # Live: the best K candidates that did not end.
        live_candidates = top_log_probs + ended * NEG_INF
        new_live_log_probs, live_pick = lax.top_k(live_candidates, k)
        new_live_sequences = _gather(top_sequences, live_pick)
        cache = _gather_beams(cache, _gather(top_beams, live_pick), batch_size, k, axis)

        # Finished: merge the ended candidates with the previous finished set.
        new_scores = top_log_probs / brevity_penalty(alpha, s.index + 1) + (~ended) * NEG_INF
        all_scores = jnp.concatenate([s.finished_scores, new_scores], axis=1)
        all_sequences = jnp.concatenate([s.finished_sequences, top_sequences], axis=1)
        all_flags = jnp.concatenate([s.finished_flags, ended], axis=1)
        finished_scores, pick = lax.top_k(all_scores, k)
        return _BeamState(
            s.index + 1, new_live_log_probs, new_live_sequences, finished_scores,
            _gather(all_sequences, pick), _gather(all_flags, pick), cache,
        )

    final = lax.while_loop(cond, body, state)
    none_finished = ~jnp.any(final.finished_flags, axis=1)
    sequences = jnp.where(
        none_finished[:, None, None], final.live_sequences, final.finished_sequences
    )
    scores = jnp.where(
        none_finished[:, None], final.live_log_probs / max_penalty, final.finished_scores
    )
    return sequences[:, :, 1:], scores
