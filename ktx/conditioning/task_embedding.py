"""Task embeddings and the small MLPs that project them.

Every task-conditioned method in `ktx.conditioning` starts from a learned table of one
vector per task (row `t` belongs to the task with mixture index `task_id == t`):

* `TaskEmbedding`: a `[num_tasks, features]` table (logical axes `tasks`, `task_embed`).
* `LayerEmbedding`: a `[num_layers, features]` table (`layers`, `task_embed`), the layer
  embeddings `z_m` of HyperPrompt-Global (He et al., 2022) and the layer-id embeddings of
  HyperFormer++ (Karimi Mahabadi et al., 2021).
* `TaskProjector`: a two-layer ReLU MLP `W2 relu(W1 x)` (`h_t` of He et al., 2022, without
  biases; the task projector `h_I` of Karimi Mahabadi et al., 2021, with biases).

Conditioning is computed once per task (on the `[T, ...]` table) and gathered per example
by `task_id` afterwards (`gather_by_task`), never once per example.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx import partitioning as P

__all__ = ["TaskEmbedding", "LayerEmbedding", "TaskProjector", "gather_by_task", "check_positive"]

Initializer = nn.initializers.Initializer


def check_positive(owner: str, **values: int) -> None:
    """Raises ValueError naming `owner.field` when a size is not a positive int."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}.{name}={value!r}; accepted: a positive integer")


def gather_by_task(per_task: jax.Array, task_id: jax.Array, axis: int = 0) -> jax.Array:
    """Rows of `per_task` (task axis `axis`, size T) picked by `task_id` `[B]`.

    The task axis is replaced by the batch axis: `[..., T, ...] -> [..., B, ...]`.
    """
    task_id = jnp.asarray(task_id)
    if task_id.ndim != 1:
        raise ValueError(f"task_id must have shape [batch]; got shape {task_id.shape}")
    return jnp.take(per_task, task_id.astype(jnp.int32), axis=axis, mode="clip")


class TaskEmbedding(nn.Module):
    """A learned `[num_tasks, features]` table; `__call__()` returns the whole table."""

    num_tasks: int
    features: int
    embedding_init: Initializer = nn.initializers.normal(stddev=1.0)
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> jax.Array:
        check_positive("TaskEmbedding", num_tasks=self.num_tasks, features=self.features)
        return self.param(
            "embedding",
            nn.with_logical_partitioning(self.embedding_init, (P.TASKS, P.TASK_EMBED)),
            (self.num_tasks, self.features),
            self.param_dtype,
        )


class LayerEmbedding(nn.Module):
    """A learned `[num_layers, features]` table; `__call__()` returns the whole table."""

    num_layers: int
    features: int
    embedding_init: Initializer = nn.initializers.normal(stddev=1.0)
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> jax.Array:
        check_positive("LayerEmbedding", num_layers=self.num_layers, features=self.features)
        return self.param(
            "embedding",
            nn.with_logical_partitioning(self.embedding_init, (P.LAYERS, P.TASK_EMBED)),
            (self.num_layers, self.features),
            self.param_dtype,
        )


class TaskProjector(nn.Module):
    """Two-layer ReLU MLP `[..., in] -> [..., features]`: `W2 relu(W1 x + b1) + b2`.

    `use_bias=False` gives HyperPrompt's `h_t` (He et al., 2022), whose parameter count
    is exactly `(in + features) * hidden`.
    """

    hidden: int
    features: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        check_positive("TaskProjector", hidden=self.hidden, features=self.features)
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
        dense = lambda n, name, axes: nn.Dense(  # noqa: E731
            n,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=nn.with_logical_partitioning(init, axes),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (axes[1],)),
            name=name,
        )
        h = nn.relu(dense(self.hidden, "hidden", (P.TASK_EMBED, P.HYPER_BOTTLENECK))(x))
        return dense(self.features, "output", (P.HYPER_BOTTLENECK, P.TASK_EMBED))(h)
