"""Per-task gradients of shared parameters in one backward pass over the whole batch.

The loss is a sum over rows and each row belongs to one task, so task `t`'s gradient of a
parameter `p` is what the rows of task `t` contribute to `p`'s gradient. A *tap* makes
that contribution a gradient of its own: beside `p` the engine
(`ktx.optim.compute_task_gradients`, `method="taps"`) puts a zero input `p@task` of shape
`[T, *p.shape]` (`[L, T, *p.shape[1:]]` for a scanned stack's parameter, whose layer axis
the scan slices), and a module that reads `p` through one of this module's operations
computes row `n` with `p + tap[task(n)]`. The value is `p`'s; the gradient with respect to
the tap is every task's gradient, `[T, *p.shape]`, from one backward pass over the whole
batch, in which the activations' cotangents are those of the plain step: only the
parameters' gradients carry the task axis.

* `contract(x, kernel, n_in, tap)` (`ktx.linear.contract` with a tap): the kernel's
  gradient is taken per task, one matrix product of each task's rows of `x` with its rows
  of the cotangent (the same FLOPs as the plain product's); `x`'s cotangent is the plain
  one. The kernel is never expanded per row. `param_contract(module, name, ...)` reads the tap
  and takes `linear.contract` without one.
* `rows(value, tap)`: a small parameter used the same way by every row (a norm's scale, a
  bias) as a `[N, *shape]` array, row `n` holding `value + tap[task(n)]`, for an
  elementwise use; its gradient sums each task's rows. `param_rows(module, name, value, like)`
  reads the tap and shapes the rows to broadcast against `like`.
* `per_task(value, tap)`: the `T` values `value + tap`, `[T, *shape]`, for a parameter a
  module transforms before its rows use it (T5's relative position table, looked up into
  biases), expanded to rows by `expand`, or held as `PerTask` values and added to a
  `[N, ...]` array by `add` without building the `[N, ...]` expansion (T5's biases:
  `[T, H, Lq, Lk]`, not one more array of the attention logits' size).

The rows of a batch are grouped by task (`ktx.runs.train.TrainInput`): task `t` holds the
`sizes[t]` consecutive examples after those of the tasks before it (`by_task`, static
sizes). A module finds its tap with `read(module, name)`: None outside `by_task`, or
where the engine put none (a parameter it does not balance), and the module then computes
as it always does. Under `recording()` (a shape-only trace) `read` notes every parameter
read through a tap, so the engine can tell whether every balanced parameter has one;
a parameter read through a tap must not be read any other way, unless the module says so
with `read_directly` (the engine then gives it no tap).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from ktx import linear

__all__ = ["SUFFIX", "PerTask", "add", "by_task", "contract", "expand", "param_contract",
           "param_rows", "per_task", "read", "read_directly", "recording", "rows", "sizes"]

# The tap of parameter `name` is the sibling variable `name + SUFFIX`.
SUFFIX = "@task"


class _Rows:
    def __init__(self, sizes: tuple[int, ...], record: list | None):
        self.sizes, self.record = sizes, record


_STACK: list[_Rows] = []


def _check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    out = tuple(int(s) for s in sizes)
    if not out or any(s < 0 for s in out) or not sum(out):
        raise ValueError(f"task_taps: sizes={tuple(sizes)!r}; expected non-negative examples "
                         "per task, at least one")
    return out


@contextlib.contextmanager
def by_task(sizes: Sequence[int]) -> Iterator[None]:
    """Inside: a batch whose examples are grouped by task, `sizes[t]` of task `t`."""
    _STACK.append(_Rows(_check_sizes(sizes), None))
    try:
        yield
    finally:
        _STACK.pop()


@contextlib.contextmanager
def recording(sizes: Sequence[int]) -> Iterator[list]:
    """Trace a model under this (no taps given) to learn which parameters it reads
    through a tap: a list of `(path, shape)`, the parameter's path (module scope path and
    name) and its shape as the module sees it (one layer's, inside a scan)."""
    found: list = []
    _STACK.append(_Rows(_check_sizes(sizes), found))
    try:
        yield found
    finally:
        _STACK.pop()


def sizes() -> tuple[int, ...] | None:
    """The examples per task of the batch being traced (None outside `by_task`)."""
    return _STACK[-1].sizes if _STACK else None


def read(module: nn.Module, name: str) -> jax.Array | None:
    """The tap of `module`'s parameter `name` (`[T, *shape]`), or None: outside `by_task`,
    or where the engine gave none."""
    if not _STACK:
        return None
    region = _STACK[-1]
    if region.record is not None:
        if module.has_variable("params", name):
            value = module.get_variable("params", name)
            region.record.append((tuple(module.scope.path) + (name,), tuple(np.shape(value))))
        return None
    key = name + SUFFIX
    return module.get_variable("params", key) if module.has_variable("params", key) else None


def read_directly(module: nn.Module, name: str) -> None:
    """Say that `module` also reads its parameter `name` as it is, not through a tap (a
    tied table's `attend`): a shape-only trace under `recording` notes it, and the engine
    then gives the parameter no tap (its per-task gradients come another way)."""
    if not _STACK:
        return
    region = _STACK[-1]
    if region.record is not None:
        if module.has_variable("params", name):
            region.record.append((tuple(module.scope.path) + (name,), None))
    elif module.has_variable("params", name + SUFFIX):
        raise ValueError(f"task_taps: {'/'.join(module.scope.path + (name,))} has a tap but "
                         "is also read without it; the engine gives no tap to a parameter "
                         "`read_directly` names")


def _equal(sizes: tuple[int, ...]) -> bool:
    return len(set(sizes)) == 1


def expand(per_task_values: jax.Array, n: int | None = None,
           task_sizes: tuple[int, ...] | None = None) -> jax.Array:
    """`[T, *shape]` -> `[N, *shape]`: each example gets its task's value (N the batch's
    examples, `task_sizes` or `by_task`'s; `n`, if given, is checked against it)."""
    s = sizes() if task_sizes is None else task_sizes
    if s is None:
        raise ValueError("task_taps.expand: only inside task_taps.by_task")
    t = len(s)
    if per_task_values.shape[0] != t:
        raise ValueError(f"task_taps.expand: {per_task_values.shape[0]} values for {t} tasks")
    if n is not None and n != sum(s):
        raise ValueError(f"task_taps: the batch has {n} examples, the task sizes {s} "
                         f"sum to {sum(s)}")
    rest = per_task_values.shape[1:]
    if _equal(s):
        out = jnp.broadcast_to(per_task_values[:, None], (t, s[0]) + rest)
        return out.reshape((t * s[0],) + rest)
    return jnp.concatenate([jnp.broadcast_to(per_task_values[i][None], (k,) + rest)
                            for i, k in enumerate(s) if k], axis=0)


@jax.tree_util.register_pytree_node_class
class PerTask:
    """Each task's value, `values [T, *shape]`, standing for the `[N, *shape]` array whose
    example n holds its task's (`expand`); `sizes`: the examples per task (static)."""

    def __init__(self, values: jax.Array, sizes: tuple[int, ...]):
        self.values, self.sizes = values, tuple(sizes)

    def tree_flatten(self):
        return (self.values,), self.sizes

    @classmethod
    def tree_unflatten(cls, sizes, children):
        return cls(children[0], sizes)

    @property
    def dtype(self):
        return self.values.dtype

    def astype(self, dtype: Any) -> "PerTask":
        return PerTask(self.values.astype(dtype), self.sizes)

    def dense(self) -> jax.Array:
        """The `[N, *shape]` array itself."""
        return expand(self.values, task_sizes=self.sizes)


def add(x: jax.Array, y: Any) -> jax.Array:
    """`x + y`, for `y` an array (broadcast as usual) or `PerTask` values of `x`'s trailing
    shape, added to each example's rows of `x [N, ...]` by task (equal tasks: `x` seen as
    `[T, N / T, ...]`, nothing expanded)."""
    if not isinstance(y, PerTask):
        return x + y
    s, t = y.sizes, len(y.sizes)
    if x.shape[0] != sum(s) or tuple(x.shape[1:]) != tuple(y.values.shape[1:]):
        raise ValueError(f"task_taps.add: values {y.values.shape} for tasks of {s} examples "
                         f"do not fit an array {x.shape}")
    if not _equal(s):
        return x + y.dense()
    return (x.reshape((t, s[0]) + x.shape[1:]) + y.values[:, None]).reshape(x.shape)


def per_task(value: jax.Array, tap: jax.Array) -> jax.Array:
    """`value + tap`: the `T` copies of a parameter whose gradients are the tasks'."""
    return jnp.asarray(value)[None] + tap.astype(jnp.result_type(value))


def rows(value: jax.Array, tap: jax.Array, n: int | None = None) -> jax.Array:
    """`[N, *shape]`, row `n` holding `value + tap[task(n)]` (see the module docstring)."""
    return expand(per_task(value, tap), n)


def _task_products(rows_x: jax.Array, rows_g: jax.Array, s: tuple[int, ...],
                   dtype: Any) -> jax.Array:
    """`[T, in, out]`: each task's rows of `rows_x [R, in]` against its rows of `rows_g
    [R, out]`, accumulated in float32 and cast to `dtype`."""
    t, r = len(s), rows_x.shape[0]
    per = r // sum(s)
    if _equal(s):
        out = jnp.einsum("tri,tro->tio", rows_x.reshape(t, r // t, -1),
                         rows_g.reshape(t, r // t, -1), preferred_element_type=jnp.float32)
        return out.astype(dtype)
    out, start = [], 0
    for k in s:
        a, b = rows_x[start:start + k * per], rows_g[start:start + k * per]
        out.append(lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32).astype(dtype))
        start += k * per
    return jnp.stack(out)


def contract(x: jax.Array, kernel: jax.Array, n_in: int, tap: jax.Array) -> jax.Array:
    """`ktx.linear.contract(x, kernel, n_in)` whose kernel gradient is also taken per task,
    as the gradient of `tap` (`[T, *kernel.shape]`); `x [N, ..., *in]` with its examples
    on the leading axis, grouped as `by_task` says."""
    s = sizes()
    if s is None:
        raise ValueError("task_taps.contract: only inside task_taps.by_task")
    if x.shape[0] != sum(s):
        raise ValueError(f"task_taps: the batch has {x.shape[0]} examples, the task sizes "
                         f"{s} sum to {sum(s)}")
    if tap.shape != (len(s),) + kernel.shape:
        raise ValueError(f"task_taps.contract: tap of shape {tap.shape} for a kernel "
                         f"{kernel.shape} and {len(s)} tasks")
    return _tapped(x, kernel, tap, n_in, s)


def param_rows(module: nn.Module, name: str, value: jax.Array, like: jax.Array) -> jax.Array:
    """`module`'s parameter `name` (`value`, used alike by every element of `like [N, ...,
    *value.shape]`, e.g. a bias or a norm's scale) as it is, or under a tap each example's
    task's value (`rows`), shaped to broadcast against `like`."""
    tap = read(module, name)
    if tap is None:
        return value
    out = rows(value, tap, like.shape[0])
    return out.reshape(out.shape[:1] + (1,) * (like.ndim - 1 - value.ndim) + value.shape)


def param_contract(module: nn.Module, name: str, x: jax.Array, kernel: jax.Array,
                   n_in: int = 1) -> jax.Array:
    """`ktx.linear.contract(x, kernel, n_in)` of `module`'s kernel parameter `name`; under a
    tap, `contract`, whose backward pass also gives the kernel's gradient per task."""
    tap = read(module, name)
    return linear.contract(x, kernel, n_in) if tap is None else contract(x, kernel, n_in, tap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tapped(x, kernel, tap, n_in, s):
    del tap, s
    return linear.contract(x, kernel, n_in)


def _tapped_fwd(x, kernel, tap, n_in, s):
    # Named as `linear.contract` names its product, for the remat policies that save it.
    out = checkpoint_name(linear.contract(x, kernel, n_in), linear.SAVE_NAME)
    # The tap's dtype (that of the per-task gradients), kept as a scalar.
    return out, (x, kernel, jnp.zeros((), tap.dtype))


def _tapped_bwd(n_in, s, residuals, g):
    x, kernel, tap_dtype = residuals[0], residuals[1], residuals[2].dtype
    size_in = math.prod(kernel.shape[:n_in])
    size_out = math.prod(kernel.shape[n_in:])
    rows_g = g.reshape(-1, size_out)
    rows_x = x.reshape(-1, size_in)
    dx = lax.dot_general(rows_g, kernel.reshape(size_in, size_out).astype(g.dtype),
                         (((1,), (1,)), ((), ())))
    dtap = _task_products(rows_x, rows_g, s, tap_dtype)
    return (dx.reshape(x.shape).astype(x.dtype), dtap.sum(0).reshape(kernel.shape).astype(
        kernel.dtype), dtap.reshape((len(s),) + kernel.shape))


_tapped.defvjp(_tapped_fwd, _tapped_bwd)
