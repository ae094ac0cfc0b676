"""A tiny embedding + MLP multi-task model implementing `BaseModel`, for optim tests."""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ktx.models.base import BaseModel, segment_sum_by_task


class _Net(nn.Module):
    vocab: int
    dim: int
    num_tasks: int

    @nn.compact
    def __call__(self, tokens):  # [B, L] -> [B, T]
        x = nn.Embed(self.vocab, self.dim, name="embed")(tokens).mean(axis=1)
        h = nn.tanh(nn.Dense(8, name="shared")(x))
        return nn.Dense(self.num_tasks, name="head")(h)


class TinyModel(BaseModel):
    """Squared error of each row's own task output; `loss_normalization` selectable."""

    def __init__(self, num_tasks: int = 3, vocab: int = 11, dim: int = 4,
                 loss_normalization: str = "global"):
        self.num_tasks = num_tasks
        self.loss_normalization = loss_normalization
        self.net = _Net(vocab, dim, num_tasks)

    def init_variables(self, rng, batch):
        return self.net.init(rng, batch["tokens"])

    def input_spec(self, batch_size: int, feature_lengths: Mapping[str, int]):
        return {
            "tokens": jax.ShapeDtypeStruct((batch_size, feature_lengths["tokens"]), jnp.int32),
            "target": jax.ShapeDtypeStruct((batch_size,), jnp.float32),
            "task_id": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        }

    def task_weights(self, batch):
        return segment_sum_by_task(
            jnp.ones(batch["task_id"].shape, jnp.float32), batch["task_id"], self.num_tasks
        )

    def loss_sums(self, params, batch, rng=None, train=True):
        out = self.net.apply({"params": params}, batch["tokens"])
        pred = jnp.take_along_axis(out, batch["task_id"][:, None], axis=1)[:, 0]
        err = (pred - batch["target"]) ** 2
        sums = segment_sum_by_task(err, batch["task_id"], self.num_tasks)
        return sums, {"loss": sums, "weight": self.task_weights(batch)}


def make_batch(counts, length: int = 3, vocab: int = 11, seed: int = 0):
    """A task-partitioned batch: `counts[t]` contiguous rows of task t."""
    rng = np.random.default_rng(seed)
    n = sum(counts)
    return {
        "tokens": jnp.asarray(rng.integers(0, vocab, (n, length)), jnp.int32),
        "target": jnp.asarray(rng.normal(size=n), jnp.float32),
        "task_id": jnp.asarray(np.repeat(np.arange(len(counts)), counts), jnp.int32),
    }
