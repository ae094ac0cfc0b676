"""Multi-task Prompt-Tuning: per-task soft prompts prepended to the input embeddings.

Lester et al., 2021 ("The Power of Scale for Parameter-Efficient Prompt Tuning"): `l`
learned vectors per task are prepended to the embedded encoder input; they pass through
every encoder layer like ordinary tokens (unlike HyperPrompt's key/value prompts). Here
the prompts of all tasks are co-trained in one mixture, each example reading its own
task's prompts through `task_id`. Initialised uniform in [-0.5, 0.5], one of the
initialisations Lester et al., 2021 compare.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx import partitioning as P
from ktx.conditioning.task_embedding import check_positive, gather_by_task

__all__ = ["PromptTuning", "prepend_prompts"]


def _uniform_half(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, minval=-0.5, maxval=0.5)


class PromptTuning(nn.Module):
    """Per-task soft prompts `[T, l, d]`; `__call__(task_id [B]) -> [B, l, d]`."""

    num_tasks: int
    prompt_length: int
    emb_dim: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, task_id: jax.Array) -> jax.Array:
        check_positive(
            "PromptTuning",
            num_tasks=self.num_tasks,
            prompt_length=self.prompt_length,
            emb_dim=self.emb_dim,
        )
        prompts = self.param(
            "prompts",
            nn.with_logical_partitioning(_uniform_half, (P.TASKS, P.PROMPT_LENGTH, P.EMBED)),
            (self.num_tasks, self.prompt_length, self.emb_dim),
            self.param_dtype,
        )
        return gather_by_task(prompts.astype(self.dtype), task_id)


def prepend_prompts(
    embedded: jax.Array, prompts: jax.Array, *, mask: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """`[B, L, d]` embeddings and `[B, l, d]` prompts -> `[B, l + L, d]`.

    `mask` (`[B, L]`, 1 for real tokens) is extended with ones for the prompts.
    """
    if embedded.ndim != 3 or prompts.ndim != 3 or prompts.shape[0] != embedded.shape[0]:
        raise ValueError(
            f"prepend_prompts: embedded {embedded.shape} and prompts {prompts.shape} must be "
            "[batch, length, embed] with the same batch and embed sizes"
        )
    out = jnp.concatenate([prompts.astype(embedded.dtype), embedded], axis=1)
    if mask is None:
        return out, None
    ones = jnp.ones((mask.shape[0], prompts.shape[1]), mask.dtype)
    return out, jnp.concatenate([ones, mask], axis=1)
