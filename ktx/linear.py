"""The product of every dense layer: `x [..., *in]` times a kernel `[*in, *out]`.

T5's and BERT's `DenseGeneral` and `param_gather.project` (T5's untied logits) take it.

`contract(x, kernel, n_in)` is the `lax.dot_general` a dense layer takes over `x`'s
`n_in` trailing axes and the kernel's leading ones. Its gradient is autodiff's, taken in
another order: the kernel's as `dot_general(x, g)` over the rows' axes, `[*in, *out]` as
it is. JAX's transpose rule takes it as `dot_general(g, x)`, `[*out, *in]`, and
transposes that; XLA:CPU then lays the cotangent out transposed, writes it so in the
fusion that produces it (a gated MLP's activation gradient, recomputed there) and runs
the product outside XNNPACK. A T5.1.1-Small MLP block's backward pass (`[8, 128, 512]`
rows, two `[512, 1024]` input kernels) took 56 ms and accessed 0.141 GB that way, 35 ms
and 0.107 GB this way (docs/performance.md). Both products of the backward pass are taken
on the operands flattened to matrices.

The forward product is the same `dot_general`. A remat policy does not see a dot inside
a custom VJP, so the product is named `SAVE_NAME` (`jax.ad_checkpoint.checkpoint_name`)
and the dot-saving policies of `ktx.models.t5_stack.remat_policy` save that name too:
they keep what they kept when the product was a plain dot. Forward-mode differentiation
(`jax.jvp`) through it is not supported.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

__all__ = ["SAVE_NAME", "contract"]

# The name a remat policy saves the product by (`checkpoint_name`).
SAVE_NAME = "ktx.linear.contract"


def _dims(x_ndim: int, n_in: int) -> tuple:
    return ((tuple(range(x_ndim - n_in, x_ndim)), tuple(range(n_in))), ((), ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def contract(x: jax.Array, kernel: jax.Array, n_in: int = 1) -> jax.Array:
    """`x [..., *in]` times `kernel [*in, *out]` over the `n_in` axes `in`:
    `[..., *out]`, as `lax.dot_general` computes it (in the operands' dtype)."""
    return lax.dot_general(x, kernel, _dims(x.ndim, n_in))


def _contract_fwd(x, kernel, n_in):
    return checkpoint_name(contract(x, kernel, n_in), SAVE_NAME), (x, kernel)


def _contract_bwd(n_in, residuals, g):
    x, kernel = residuals
    size_in = math.prod(kernel.shape[:n_in])
    size_out = math.prod(kernel.shape[n_in:])
    # Both products as matrix products: the cotangent as `[rows, out]`, `x` as `[rows,
    # in]` and a multi-axis kernel (attention's `[E, H, D]`, `[H, D, E]`) as `[in, out]`
    # (T5.1.1-Small's step: 9.65 GB accessed, 10.06 with the axes kept).
    rows_g = g.reshape(-1, size_out)
    rows_x = x.reshape(-1, size_in)
    flat_kernel = kernel.reshape(size_in, size_out)
    dx = lax.dot_general(rows_g, flat_kernel, (((1,), (1,)), ((), ())))
    # The kernel's: x's rows with g's, `[in, out]`, x first (see the module docstring).
    dkernel = lax.dot_general(rows_x, rows_g, (((0,), (0,)), ((), ())))
    return (dx.reshape(x.shape).astype(x.dtype),
            dkernel.reshape(kernel.shape).astype(kernel.dtype))


contract.defvjp(_contract_fwd, _contract_bwd)
