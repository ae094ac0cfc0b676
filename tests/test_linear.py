"""`ktx.linear.contract`: a dense layer's product with its gradient taken in another order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx import linear
from ktx.models.t5_stack import remat_policy


def _plain(x, kernel, n_in):
    dims = ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ()))
    return jax.lax.dot_general(x, kernel, dims)


@pytest.mark.parametrize("x_shape,k_shape,n_in", [
    ((4, 6, 8), (8, 5), 1),           # [B, L, E] x [E, F]
    ((4, 6, 8), (8, 3, 2), 1),        # [B, L, E] x [E, H, D]: a query projection
    ((4, 6, 3, 2), (3, 2, 8), 2),     # [B, L, H, D] x [H, D, E]: attention's output
    ((5, 8), (8, 7), 1),              # rows already flat
])
def test_contract_is_dot_general_with_its_gradient(x_shape, k_shape, n_in):
    kx, kk, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape)
    kernel = jax.random.normal(kk, k_shape)
    out = linear.contract(x, kernel, n_in)
    want = _plain(x, kernel, n_in)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    cot = jax.random.normal(kg, want.shape)
    got = jax.grad(lambda a, b: jnp.vdot(linear.contract(a, b, n_in), cot), (0, 1))(x, kernel)
    ref = jax.grad(lambda a, b: jnp.vdot(_plain(a, b, n_in), cot), (0, 1))(x, kernel)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_contract_in_bfloat16_and_under_vmap():
    x = jax.random.normal(jax.random.key(1), (3, 4, 6, 8)).astype(jnp.bfloat16)
    kernel = jax.random.normal(jax.random.key(2), (8, 5)).astype(jnp.bfloat16)

    def loss(fn, a, b):  # one loss per leading slice, as per-task gradients take them
        return jax.vmap(lambda r: jnp.sum(fn(r, b, 1).astype(jnp.float32) ** 2))(a).sum()

    got = jax.grad(lambda a, b: loss(linear.contract, a, b), (0, 1))(x, kernel)
    ref = jax.grad(lambda a, b: loss(_plain, a, b), (0, 1))(x, kernel)
    for g, r in zip(got, ref):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("policy,saved", [("minimal", True), ("dots", True), ("full", False)])
def test_remat_policies_save_the_product_by_name(policy, saved, capsys):
    """A dot inside a custom VJP is not seen by a dot-saving policy; the name is."""
    x, kernel = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
    f = jax.checkpoint(lambda a, b: jnp.tanh(linear.contract(a, b)).sum(),
                       policy=remat_policy(policy))
    jax.ad_checkpoint.print_saved_residuals(f, x, kernel)
    printed = capsys.readouterr().out
    assert (f"named '{linear.SAVE_NAME}'" in printed) == saved, printed
