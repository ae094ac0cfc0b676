"""The contract between ktx models, the trainer and the multi-task gradient engine.

A model wraps a Flax module (as T5X's `BaseModel` does) and exposes its loss *per task*:

* `task_weights(batch) -> [T]`: the loss denominators each task contributes (target
  tokens for a seq2seq model, examples for a classifier), computed from the batch alone.
* `loss_sums(params, batch, rng, train) -> (sums [T], aux)`: the un-normalised loss of
  each task, and `aux`, a dict of `[T]` sums (metric numerators, always including
  `"weight"`, the denominator of every per-task metric). Row `i` of the batch belongs
  to task `batch["task_id"][i]`.
* `task_losses(...)`: `sums / normalizer(...)`. With `loss_normalization="global"` the
  normalizer is the total weight of the batch, so `task_losses.sum()` is exactly the
  plain (mixture) loss; with `"per_task"` each task is averaged over its own weight,
  so `task_losses.sum()` is the sum of task means (the MetaBalance paper's objective).

The gradient engine evaluates `loss_sums` on sub-batches (one block per task) and
divides by the normalizer of the *whole* batch, so per-task gradients add up to the
gradient of `loss_fn` exactly.

Dropout is keyed per example: the randomness of row `i` is a function of `(rng,
batch[ROW_ID][i])` only (`row_keys`; `ROW_ID` defaults to the row's position). The
trainer numbers the rows of the global batch before it is cut into task blocks or
microbatches, so every way of evaluating a batch (whole, blocks, one-hot VJP,
microbatches) draws the same masks and computes the same gradient for the same rng.
A module written with `flax.linen.Dropout` gets this without a change by running under
`dropout_keyed_by_row(row_ids(batch))`: the whole batch goes through the module at once
(no per-row `vmap`), and each `nn.Dropout` draws row `i`'s mask from
`fold_in(its own make_rng key, row id i)`.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx.models.t5_stack import recompute_elementwise

__all__ = [
    "Batch", "BaseModel", "LOSS_NORMALIZATIONS", "ROW_ID", "RowDropout", "dropout_keyed_by_row",
    "row_ids", "row_keys", "segment_sum_by_task", "with_row_ids",
]

Batch = Mapping[str, jax.Array]
LOSS_NORMALIZATIONS = ("global", "per_task")


ROW_ID = "row_id"


def with_row_ids(batch: Batch) -> dict[str, jax.Array]:
    """`batch` with `ROW_ID` = each row's position `[B]` (kept if already there)."""
    batch = dict(batch)
    if ROW_ID not in batch:
        n = next(iter(batch.values())).shape[0]
        batch[ROW_ID] = jnp.arange(n, dtype=jnp.int32)
    return batch


def row_ids(batch: Batch) -> jax.Array:
    """`[B]` row numbers: `batch[ROW_ID]`, else the positions `0..B-1`."""
    return with_row_ids(batch)[ROW_ID]


def row_keys(rng: jax.Array, batch: Batch) -> jax.Array:
    """`[B]` dropout keys `fold_in(rng, row_id)`: a row's randomness depends on the rng
    and its row number only, never on which rows share its (sub-)batch."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, row_ids(batch))


class RowDropout(nn.Module):
    """Inverted dropout whose mask for row `i` of `[B, ...]` is drawn from
    `fold_in(make_rng("dropout"), ids[i])`: the same mask whatever other rows the batch
    holds (see the module docstring)."""

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, ids: jax.Array, deterministic: bool) -> jax.Array:
        if deterministic or self.rate == 0.0:
            return x
        return _row_masked(x, self.rate, self.make_rng("dropout"), ids)


def _row_masked(x: jax.Array, rate: float, key: jax.Array, ids: jax.Array,
                broadcast_dims: tuple[int, ...] = ()) -> jax.Array:
    """Inverted dropout of `x [B, ...]`, row `i`'s mask from `fold_in(key, ids[i])`
    (shared along `broadcast_dims`, axes of `x`)."""
    if x.shape[0] != ids.shape[0]:
        raise ValueError(
            f"row-keyed dropout: an input of shape {x.shape} does not lead with the batch's "
            f"{ids.shape[0]} rows")
    shape = list(x.shape)
    for d in broadcast_dims:
        if d % x.ndim == 0:
            raise ValueError("row-keyed dropout cannot share a mask across rows "
                             f"(broadcast_dims={tuple(broadcast_dims)} includes the batch axis)")
        shape[d] = 1
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, ids)
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, tuple(shape[1:])))(keys)

    def apply(x, keep):  # the backward pass keeps only the (unbroadcast) bool mask
        return jax.lax.select(jnp.broadcast_to(keep, x.shape), x / (1.0 - rate),
                              jnp.zeros_like(x))

    return recompute_elementwise(apply)(x, keep)


@contextlib.contextmanager
def dropout_keyed_by_row(ids: jax.Array) -> Iterator[None]:
    """Makes every `flax.linen.Dropout` called inside draw per-row masks: for an input
    `[B, ...]`, row `i`'s mask comes from `fold_in(key, ids[i])`, `key` being the one
    the layer would have used (its `make_rng`, or its `rng=` argument). `ids` `[B]`: the
    batch's row numbers (`row_ids`). A mask then depends on the rng and the row's number
    only, never on the other rows of the (sub-)batch. `broadcast_dims` keep their meaning
    within a row; an input that does not lead with the `B` rows is an error."""
    ids = jnp.asarray(ids)

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if not isinstance(module, nn.Dropout) or context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        names = ("inputs", "deterministic", "rng")
        bound = dict(zip(names, args), **kwargs)
        x = bound["inputs"]
        deterministic = nn.merge_param(
            "deterministic", module.deterministic, bound.get("deterministic"))
        if module.rate == 0.0 or deterministic:
            return x
        if module.rate == 1.0:
            return jnp.zeros_like(x)
        key = bound.get("rng")
        if key is None:
            key = module.make_rng(module.rng_collection)
        return _row_masked(x, module.rate, key, ids, tuple(module.broadcast_dims))

    with nn.intercept_methods(intercept):
        yield


def segment_sum_by_task(values: jax.Array, task_id: jax.Array, num_tasks: int) -> jax.Array:
    """Sums `values` (`[batch, ...]`) over every axis but the batch, per task -> `[T]`."""
    per_example = values.reshape(values.shape[0], -1).sum(axis=-1)
    return jax.ops.segment_sum(per_example, task_id, num_segments=num_tasks)


class BaseModel(abc.ABC):
    """A module plus its per-task loss; see the module docstring for the contract."""

    num_tasks: int
    loss_normalization: str = "global"
    # Regexes (full match on '/'-joined parameter paths) of parameters that never train:
    # the Trainer gives them no update and no optimizer state (`ktx.training.optimizers.freeze`),
    # so weight decay and every other gradient-free optimizer term leave them untouched.
    frozen_patterns: tuple[str, ...] = ()

    @abc.abstractmethod
    def init_variables(self, rng: jax.Array, batch: Batch) -> Any:
        """Returns the module's variables (a dict with `"params"`) for `batch`'s shapes."""

    @abc.abstractmethod
    def input_spec(
        self, batch_size: int, feature_lengths: Mapping[str, int]
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """The features (names, shapes, dtypes) a batch must have; includes `task_id`."""

    @abc.abstractmethod
    def task_weights(self, batch: Batch) -> jax.Array:
        """`[T]` loss denominators of each task in `batch` (no parameters needed)."""

    @abc.abstractmethod
    def loss_sums(
        self, params: Any, batch: Batch, rng: jax.Array | None, train: bool
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`([T] loss sums, aux)`: aux maps metric names to `[T]` sums, with `"weight"`."""

    def for_batch_tasks(self, n: int) -> "BaseModel":
        """This model for batches whose rows hold at most `n` distinct tasks (a device's
        rows in a balanced step's per-device region): a model that computes a per-task
        quantity for all T tasks once per batch may compute it for those `n` only, with the
        same results. The default: the model itself."""
        del n
        return self

    def init_model_state(self, params: Any) -> Any:
        """The state this model carries from step to step, built from the step-0
        parameters (a pytree of arrays; leaves with a parameter's path suffix and shape
        are sharded as that parameter), or None (the default): no state, and a
        `TrainState`, a compiled step and a checkpoint exactly as without this hook."""
        del params
        return None

    def update_model_state(self, model_state: Any, params: Any, step: jax.Array) -> Any:
        """The state after optimizer step `step` (0-based, traced int32), given the
        parameters that step produced; default: unchanged."""
        del params, step
        return model_state

    def loss_sums_with_state(
        self, params: Any, model_state: Any, batch: Batch, rng: jax.Array | None, train: bool
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`loss_sums` given the carried `model_state` (the train step calls this; no
        gradient reaches `model_state`); default: `loss_sums`, the state unused."""
        del model_state
        return self.loss_sums(params, batch, rng, train)

    def normalizer(self, batch: Batch) -> jax.Array:
        """`[T]` divisors turning `loss_sums` into `task_losses`."""
        weights = self.task_weights(batch)
        if self.loss_normalization == "global":
            return jnp.broadcast_to(jnp.maximum(weights.sum(), 1.0), weights.shape)
        if self.loss_normalization == "per_task":
            return jnp.maximum(weights, 1.0)
        raise ValueError(
            f"loss_normalization={self.loss_normalization!r}; accepted: {LOSS_NORMALIZATIONS}"
        )

    def task_losses(
        self,
        params: Any,
        batch: Batch,
        rng: jax.Array | None = None,
        train: bool = True,
        normalizer: jax.Array | None = None,
        model_state: Any = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`[T]` normalised per-task losses and aux sums.

        `normalizer` overrides `self.normalizer(batch)`: the gradient engine passes the
        whole batch's normalizer when `batch` is one task's block. `model_state` (the
        train state's, see `init_model_state`) goes to `loss_sums_with_state`.
        """
        sums, aux = self.loss_sums_with_state(params, model_state, batch, rng, train)
        if normalizer is None:
            normalizer = self.normalizer(batch)
        return sums / normalizer, aux

    def loss_fn(
        self, params: Any, batch: Batch, rng: jax.Array | None = None, train: bool = True
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Scalar training loss (sum of `task_losses`) and aux sums."""
        losses, aux = self.task_losses(params, batch, rng, train)
        return losses.sum(), aux
