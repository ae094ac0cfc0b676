"""Matmul FLOPs of compiled programs with loops counted by their trip counts
(`ktx.training.hlo_cost`), against hand counts."""

from __future__ import annotations

import re

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np

from ktx.training.hlo_cost import matmul_flops, step_flops

B, D, L = 8, 16, 5
ONE = 2 * B * D * D  # one [B, D] @ [D, D] matmul


def _stack(x, ws):
    def body(c, w):
        return jnp.tanh(c @ w), None
    return jax.lax.scan(body, x, ws)[0].sum()


def _unrolled(x, ws):
    for i in range(L):
        x = jnp.tanh(x @ ws[i])
    return x.sum()


def _compile(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def test_a_scanned_stack_counts_every_layer():
    x, ws = jnp.ones((B, D)), jnp.ones((L, D, D))
    fwd = _compile(_stack, x, ws)
    assert matmul_flops(fwd.as_text()) == L * ONE
    # Forward, and the backward pass's two matmuls per layer (dx, dW).
    grad = _compile(jax.grad(_stack, argnums=(0, 1)), x, ws)
    assert matmul_flops(grad.as_text()) == 3 * L * ONE
    flops, xla, matmuls = step_flops(grad)
    assert xla < L * ONE < matmuls == flops  # XLA's own count: one layer's body
    unrolled = _compile(jax.grad(_unrolled, argnums=(0, 1)), x, ws)
    assert matmul_flops(unrolled.as_text()) == 3 * L * ONE
    flops, xla, matmuls = step_flops(unrolled)
    assert flops == xla >= matmuls  # unrolled: XLA's count adds the elementwise work


def test_nested_loops_multiply_and_a_conditional_counts_its_larger_branch():
    x, ws = jnp.ones((B, D)), jnp.ones((L, D, D))

    def nested(x, ws):
        def outer(c, _):
            return jax.lax.fori_loop(0, 3, lambda i, y: y @ ws[i], c), None
        return jax.lax.scan(outer, x, None, length=4)[0]

    assert matmul_flops(_compile(nested, x, ws).as_text()) == 4 * 3 * ONE

    def branch(p, x, ws):
        return jax.lax.cond(p, lambda y: y @ ws[0] @ ws[1], lambda y: y @ ws[0], x)

    assert matmul_flops(_compile(branch, True, x, ws).as_text()) == 2 * ONE


def test_a_loop_without_a_trip_count_is_read_from_its_condition_and_counter_step():
    """TPU's windowed einsums carry no `known_trip_count`; a bidirectional one steps its
    counter by 2. The same loop here, its annotation removed: `i < 8` by 2 runs 4 times."""
    x, w = jnp.ones((B, D)), jnp.ones((D, D))

    def stepped(x, w):
        return jax.lax.while_loop(lambda c: c[0] < 8, lambda c: (c[0] + 2, c[1] @ w),
                                  (0, x))[1]

    text = _compile(stepped, x, w).as_text()
    bare = re.sub(r'"known_trip_count":\{[^}]*\},?', "", text)
    assert "known_trip_count" not in bare
    assert matmul_flops(text) == matmul_flops(bare) == 4 * ONE


def test_convolutions_count_their_window():
    x, k = jnp.ones((2, 10, 3)), jnp.ones((4, 3, 6))  # NWC, WIO: width 4, 3 -> 6 features

    def conv(x, k):
        return jax.lax.conv_general_dilated(x, k, (1,), "VALID",
                                            dimension_numbers=("NWC", "WIO", "NWC"))

    # Output [2, 7, 6], each element 4 * 3 multiply-adds.
    assert matmul_flops(_compile(conv, x, k).as_text()) == 2 * (2 * 7 * 6) * (4 * 3)


def test_a_scanned_t5_counts_what_the_unrolled_one_does():
    """The same tiny T5.1.1's gradient, layers scanned and unrolled (no remat): the same
    matmuls, where XLA's own count of the scanned one holds one layer per stack."""
    from ktx.models import seq2seq, t5

    rng = np.random.default_rng(0)
    batch = {
        "encoder_input_tokens": rng.integers(2, 64, (4, 7)).astype(np.int32),
        "decoder_input_tokens": rng.integers(2, 64, (4, 5)).astype(np.int32),
        "decoder_target_tokens": rng.integers(2, 64, (4, 5)).astype(np.int32),
        "decoder_loss_weights": np.ones((4, 5), np.float32),
        "task_id": np.zeros(4, np.int32),
    }
    counts = {}
    for scan in (False, True):
        model = seq2seq.EncoderDecoderModel(
            config=t5.T5Config(vocab_size=64, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
                               num_encoder_layers=3, num_decoder_layers=3, scan_layers=scan),
            num_tasks=1)
        params = jax.eval_shape(lambda r: model.init_variables(r, batch)["params"],
                                jax.random.key(0))
        params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                              flax.linen.meta.unbox(params))
        grad = jax.jit(jax.grad(lambda p: model.loss_sums(p, batch, None, False)[0].sum()))
        counts[scan] = step_flops(grad.lower(params).compile())
    (_, xla_unrolled, unrolled), (flops, xla_scanned, scanned) = counts[False], counts[True]
    assert scanned == unrolled and flops == scanned
    assert xla_scanned < scanned <= xla_unrolled
