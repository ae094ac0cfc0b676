"""HyperPrompt: hyper-prompts prepended to the keys and values of self-attention.

He et al., 2022 ("HyperPrompt: Prompt-based Task-Conditioning of Transformers").
One `HyperPrompt` module serves one side of the Transformer (encoder or decoder, each
with its own prompt length `l`), for all `M` layers and `T` tasks of that side:

* global prompts `P_t` (`[T, l, d]`, one per task);
* at layer `m`, local hypernetworks turn them into key and value prompts,
  `P_k = U_k relu(D_k P_t)`, `P_v = U_v relu(D_v P_t)`, with down-projections
  `D` (`d -> b`) and up-projections `U` (`b -> heads * head_dim`), bottleneck `b`;
* the prompts are split per head and prepended to that layer's keys and values,
  `K' = concat(P_k, K)`, `V' = concat(P_v, V)`; every query (causal ones too) attends
  to all `l` prompts; prompts never pass through the feed-forward blocks.

Variants (`variant`):

* `"share"`: one `(D_k, U_k, D_v, U_v)` per layer, shared by all tasks;
* `"sep"`: one per layer per task;
* `"global"`: the local hypernetworks' weights are generated, per layer and task, by two
  global hypernetworks `H_k`, `H_v` (no biases) from a layer-aware task embedding
  `I_t^m = h_t(concat(k_t, z_m))`, `h_t` a two-layer ReLU MLP `2t' -> e -> t` without
  biases, `k_t` task embeddings (`[T, t']`), `z_m` layer embeddings (`[M, t']`).

For `"global"` the parameters of one side are exactly
`d l T + 4 b d t + T t' + M t' + (2 t' + t) e` when `heads * head_dim == d` (the closed
form of He et al., 2022; `ktx.analysis.params.hyperprompt_global_closed_form`).

`__call__()` returns the key and value prompts of every layer and task,
`[M, T, l, heads, head_dim]` each: computed once per task per step, then gathered per
example by `task_id` (`gather_prompts`). `__call__(tasks=ids)` computes them for the
tasks `ids` `[S]` only, `[M, S, ...]` (a batch known to hold at most S tasks: a device's
rows in a balanced step's per-device region, `ktx.models.base.BaseModel.for_batch_tasks`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx import param_gather
from ktx import partitioning as P
from ktx.conditioning.task_embedding import (
    LayerEmbedding,
    TaskEmbedding,
    TaskProjector,
    check_positive,
    gather_by_task,
)

__all__ = ["HYPER_PROMPT_VARIANTS", "HyperPrompt", "gather_prompts"]

HYPER_PROMPT_VARIANTS = ("share", "sep", "global")


def _init(in_axis, out_axis):
    return nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
    )


def gather_prompts(prompts: jax.Array, task_id: jax.Array) -> jax.Array:
    """`[M, T, l, H, Dh]` per-task prompts -> `[M, B, l, H, Dh]` per-example prompts."""
    return gather_by_task(prompts, task_id, axis=1)


class HyperPrompt(nn.Module):
    """Key/value hyper-prompts of one Transformer side; see the module docstring.

    Attributes:
      variant: one of `HYPER_PROMPT_VARIANTS`.
      num_tasks: T. num_layers: M (self-attention layers of this side).
      prompt_length: l (> 0; a side with no prompts has no `HyperPrompt`).
      emb_dim: d. num_heads, head_dim: the attention's heads and per-head size.
      bottleneck_dim: b (He et al., 2022 use b = d / r).
      task_embed_dim: t' (global only). task_hidden_dim: e (global only).
      layer_task_dim: t, the size of the layer-aware task embedding (global only).
    """

    variant: str
    num_tasks: int
    num_layers: int
    prompt_length: int
    emb_dim: int
    num_heads: int
    head_dim: int
    bottleneck_dim: int
    task_embed_dim: int = 32
    task_hidden_dim: int = 64
    layer_task_dim: int = 32
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def _check(self) -> None:
        if self.variant not in HYPER_PROMPT_VARIANTS:
            raise ValueError(
                f"HyperPrompt.variant={self.variant!r}; accepted: {HYPER_PROMPT_VARIANTS}"
            )
        check_positive(
            "HyperPrompt",
            num_tasks=self.num_tasks,
            num_layers=self.num_layers,
            prompt_length=self.prompt_length,
            emb_dim=self.emb_dim,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            bottleneck_dim=self.bottleneck_dim,
        )
        if self.variant == "global":
            check_positive(
                "HyperPrompt",
                task_embed_dim=self.task_embed_dim,
                task_hidden_dim=self.task_hidden_dim,
                layer_task_dim=self.layer_task_dim,
            )

    def _param(self, name, init, shape, axes):
        return self.param(
            name, nn.with_logical_partitioning(init, axes), shape, self.param_dtype
        )

    def _contracted(self, name, init, shape, axes, x):
        """`x [n, t]` times the parameter `name` (`[t, ...]`) over `t`, read through
        `ktx.param_gather.contract`: inside a balanced step's device-by-device region
        with parameters split over `data` it stays split (a `SplitParam`, which the
        parameter's shape check would refuse, so it is read as it is)."""
        w = param_gather.module_param(self, name, lambda: self._param(name, init, shape, axes))
        return param_gather.contract(x, w, self.scope.path + (name,))

    def _local_weights(
        self, which: str, layers: slice, tasks: jax.Array | None
    ) -> tuple[jax.Array, jax.Array]:
        """Down `[M', T|1, d, b]` and up `[M', T|1, b, H, Dh]` of the layers `layers`
        (`[M', S, ...]` for the tasks `tasks` `[S]` of "sep")."""
        M, T, d, b = self.num_layers, self.num_tasks, self.emb_dim, self.bottleneck_dim
        H, Dh = self.num_heads, self.head_dim
        if self.variant == "share":
            down = self._param(
                f"{which}_down", _init(1, 2), (M, d, b), (P.LAYERS, P.EMBED, P.HYPER_BOTTLENECK)
            )
            up = self._param(
                f"{which}_up",
                _init(1, (2, 3)),
                (M, b, H, Dh),
                (P.LAYERS, P.HYPER_BOTTLENECK, P.HEADS, P.KV),
            )
            return down[layers, None], up[layers, None]
        if self.variant == "sep":
            down = self._param(
                f"{which}_down",
                _init(2, 3),
                (M, T, d, b),
                (P.LAYERS, P.TASKS, P.EMBED, P.HYPER_BOTTLENECK),
            )
            up = self._param(
                f"{which}_up",
                _init(2, (3, 4)),
                (M, T, b, H, Dh),
                (P.LAYERS, P.TASKS, P.HYPER_BOTTLENECK, P.HEADS, P.KV),
            )
            if tasks is None:
                return down[layers], up[layers]
            return down[layers][:, tasks], up[layers][:, tasks]
        raise AssertionError(self.variant)

    def _global_weights(self, layers: slice, tasks: jax.Array | None) -> dict[str, jax.Array]:
        """Local hypernetwork weights generated per (layer, task) by `H_k`, `H_v` (the
        tasks `tasks` `[S]` only, when given)."""
        M, T, d, b = self.num_layers, self.num_tasks, self.emb_dim, self.bottleneck_dim
        H, Dh, t = self.num_heads, self.head_dim, self.layer_task_dim
        k_task = TaskEmbedding(T, self.task_embed_dim, param_dtype=self.param_dtype,
                               name="task_embedding")()  # [T, t']
        if tasks is not None:
            k_task = k_task[tasks]  # [S, t']
            T = k_task.shape[0]
        z_layer = LayerEmbedding(M, self.task_embed_dim, param_dtype=self.param_dtype,
                                 name="layer_embedding")()[layers]  # [M', t']
        M = z_layer.shape[0]
        pairs = jnp.concatenate(
            [
                jnp.broadcast_to(k_task[None], (M, T, self.task_embed_dim)),
                jnp.broadcast_to(z_layer[:, None], (M, T, self.task_embed_dim)),
            ],
            axis=-1,
        ).astype(self.dtype)  # [M, T, 2t']
        layer_task = TaskProjector(
            self.task_hidden_dim, t, use_bias=False, dtype=self.dtype,
            param_dtype=self.param_dtype, name="task_projector",
        )(pairs)  # [M, T, t]: I_t^m
        out = {}
        flat = layer_task.reshape(M * T, t)
        for which in ("key", "value"):
            # H_k / H_v: the generators of D (t -> d*b) and U (t -> b*H*Dh): one matmul
            # each over [M*T, t] (no batch dimensions: XLA:CPU runs batched einsums far
            # slower), keeping the generators' own dimensions, so that a generator split
            # over `model` (heads) gives weights split the same way, not a flattened
            # b*H*Dh axis that must be gathered whole before it is reshaped.
            # (`_contracted`: a generator split over `data` in a device-by-device region
            # is never gathered whole; see `ktx.param_gather.contract`.)
            down = self._contracted(
                f"{which}_down_generator", _init(0, (1, 2)), (t, d, b),
                (P.TASK_EMBED, P.EMBED, P.HYPER_BOTTLENECK), flat,
            )  # [n, d, b]
            up = self._contracted(
                f"{which}_up_generator", _init(0, (1, 2, 3)), (t, b, H, Dh),
                (P.TASK_EMBED, P.HYPER_BOTTLENECK, P.HEADS, P.KV), flat,
            )  # [n, b, H, Dh]
            # Generated weights get the fan-in scale of a local hypernetwork.
            out[f"{which}_down"] = down.reshape(M, T, d, b) * (d ** -0.5)
            out[f"{which}_up"] = up.reshape(M, T, b, H, Dh) * (b ** -0.5)
        return out

    @nn.compact
    def __call__(
        self, layer: int | None = None, tasks: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Returns `(key_prompts, value_prompts)`, each `[M, T, l, heads, head_dim]`.

        With `layer` (a Python int), only that layer's prompts, `[T, l, heads, head_dim]`
        each (what one self-attention layer needs; every task computed once). With `tasks`
        (`[S]` task ids), the prompts of those tasks only, `S` in place of `T`: equal to
        the rows `tasks` of the whole result, at the cost of S tasks.
        """
        self._check()
        if layer is not None and not (isinstance(layer, int) and 0 <= layer < self.num_layers):
            raise ValueError(
                f"HyperPrompt: layer={layer!r}; accepted: an int in [0, {self.num_layers})"
            )
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        prompts = self._param(
            "prompts",
            nn.initializers.normal(stddev=1.0),
            (self.num_tasks, self.prompt_length, self.emb_dim),
            (P.TASKS, P.PROMPT_LENGTH, P.EMBED),
        ).astype(self.dtype)  # [T, l, d]
        if tasks is not None:
            prompts = prompts[tasks]  # [S, l, d]
        if self.variant == "global":
            weights = self._global_weights(layers, tasks)
        else:
            weights = {}
            for which in ("key", "value"):
                down, up = self._local_weights(which, layers, tasks)
                weights[f"{which}_down"] = down
                weights[f"{which}_up"] = up
        results = []
        for which in ("key", "value"):
            down = weights[f"{which}_down"].astype(self.dtype)  # [M, T|1, d, b]
            up = weights[f"{which}_up"].astype(self.dtype)  # [M, T|1, b, H, Dh]
            if down.shape[1] == 1:  # one local hypernetwork per layer for all tasks
                hidden = nn.relu(jnp.einsum("tld,mdb->mtlb", prompts, down[:, 0]))
                kv = jnp.einsum("mtlb,mbhk->mtlhk", hidden, up[:, 0])
            else:  # per-task weights: batched matmuls over (layer, task)
                m, t, b, h, dh = up.shape
                hidden = nn.relu(jnp.matmul(prompts[None], down))  # [M, T, l, b]
                kv = jnp.matmul(hidden, up.reshape(m, t, b, h * dh))
                kv = kv.reshape(kv.shape[:3] + (h, dh))
            results.append(kv)  # [M, T, l, H, Dh]
        if layer is not None:
            return results[0][0], results[1][0]
        return results[0], results[1]
