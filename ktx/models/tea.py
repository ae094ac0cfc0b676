"""TEA-BERT: task embeddings injected into BERT for multi-task learning (task-embedded
attention; Maziarz et al., IJCNN 2021, "Multitask Learning Using BERT with Task-Embedded
Attention", which calls the model EmBERT).

One switch, `injection`, picks where a row's task `t = task_id[b]` enters BERT:

| injection       | what is added                                                       |
|-----------------|---------------------------------------------------------------------|
| `input`         | `e_t` `[E]` to the word + position + token-type sum, before the embedding LayerNorm |
| `qkv`           | `(q_t^l, k_t^l, v_t^l)` `[3, H, D]` to the query, key and value projections of layer `l` |
| `projected`     | `P^l z_t`: a task embedding `z_t` `[d]` through a per-layer projection `P^l` `[d -> 3, H, D]` (no bias), added as `qkv` |
| `projected_act` | `act(P^l z_t)` (`activation`: tanh, relu or gelu), added as `qkv`   |

`task_layers` picks the task-specific layers, those that get the `qkv` / `projected*`
injections (default: all); the other layers are task-shared, plain BERT layers. With all
task embeddings zero (and `act(0) = 0`) the model is exactly plain BERT
(`encoder.EncoderClassifierModel`), whose parameters it keeps under the same names.

Note on `k`: a vector added to every key adds `q . k_t` to every score of a query, a
constant that the softmax removes, so `k_t^l` (or its projection) never changes the
output and gets a zero gradient; it is kept for parity with the method's description.
`q_t` shifts the scores by `q_t . k_j` and `v_t` adds `v_t` to every head's output.

Parameters (paths of `TeaClassifierModel.module`), replicated over the mesh as ktx's
other task-conditioning tables (axes `tasks`, `task_embed`), counted as task-conditioned
by `ktx params`:

    input:          conditioning/input_embedding/embedding   [T, E]      init N(0, 0.02^2)
    qkv:            conditioning/layers_l/embedding          [T, 3, H, D] init N(0, 0.02^2)
    projected(_act): conditioning/task_embedding/embedding   [T, d]      init N(0, 1)
                    conditioning/layers_l/kernel             [d, 3, H, D] init N(0, 0.02^2)

With `BertConfig.scan_layers` the per-layer tables are stacked on a leading `layers` axis,
`conditioning/layers/{embedding,kernel}` (`pals.ScannedConditionedLayer` applies
`TeaLayerHook` to each layer's slice; every layer must then be task-specific).

BERT-Base, 12 task-specific layers, per task: `input` 768, `qkv` 27,648 (0.025% of
BERT-Base, the paper's figure), `projected` `d` (+ 12 x 3 x 768 x `d` shared).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx.conditioning.task_embedding import TaskEmbedding, gather_by_task
from ktx.models import bert
from ktx.models.pals import (
    LayerHooks,
    TaskConditionedClassifierModel,
    check_every_layer_when_scanned,
    check_layers,
)
from ktx.partitioning import LAYERS, TASK_EMBED, TASKS

__all__ = ["INJECTIONS", "TEA_ACTIVATIONS", "TaskQkv", "QkvProjection", "TeaLayerHook",
           "TeaConditioning", "TeaClassifierModel"]

INJECTIONS = ("input", "qkv", "projected", "projected_act")
TEA_ACTIVATIONS = {
    "tanh": jnp.tanh,
    "relu": nn.relu,
    "gelu": lambda x: nn.gelu(x, approximate=False),
}
Array = jax.Array
_init = nn.initializers.normal(stddev=0.02)


class TaskQkv(nn.Module):
    """A `[T, 3, H, D]` table of per-task query / key / value vectors; `__call__()`
    returns it (`[N, T, 3, H, D]`, leading axis `layers`, with `num_layers`: a scanned
    stack's)."""

    num_tasks: int
    num_heads: int
    head_dim: int
    num_layers: int | None = None

    @nn.compact
    def __call__(self) -> Array:
        lead, axes = ((), ()) if self.num_layers is None else ((self.num_layers,), (LAYERS,))
        return self.param("embedding",
                          nn.with_logical_partitioning(_init, (*axes, TASKS, None, None, None)),
                          (*lead, self.num_tasks, 3, self.num_heads, self.head_dim), jnp.float32)


class QkvProjection(nn.Module):
    """The bias-free projection kernel `[d, 3, H, D]` of `projected*` (`__call__()`
    returns it; `[N, d, 3, H, D]`, leading axis `layers`, with `num_layers`)."""

    features: int
    num_heads: int
    head_dim: int
    num_layers: int | None = None

    @nn.compact
    def __call__(self) -> Array:
        lead, axes = ((), ()) if self.num_layers is None else ((self.num_layers,), (LAYERS,))
        return self.param(
            "kernel", nn.with_logical_partitioning(_init, (*axes, TASK_EMBED, None, None, None)),
            (*lead, self.features, 3, self.num_heads, self.head_dim), jnp.float32)


class TeaLayerHook(nn.Module):
    """One layer's task Q/K/V from its tables (no parameters, so a scanned stack's body
    can hold it): `per_layer` is the layer's `[T, 3, H, D]` table (`qkv`) or projection
    kernel `[d, 3, H, D]` applied to `shared`, the task embeddings `[T, d]`
    (`projected*`); -> `LayerHooks(qkv=[B, 3, H, D])`, each row its task's."""

    injection: str = "qkv"
    activation: str = "tanh"

    def __call__(self, x: Array, mask: Array, task_id: Array, shared: Any, per_layer: Array,
                 deterministic: bool) -> LayerHooks:
        if self.injection == "qkv":
            per_task = per_layer
        else:
            per_task = jnp.einsum("td,dkhe->tkhe", shared, per_layer)
            if self.injection == "projected_act":
                per_task = TEA_ACTIVATIONS[self.activation](per_task)
        return LayerHooks(qkv=gather_by_task(per_task, task_id))


class TeaConditioning(nn.Module):
    """TEA-BERT's task embeddings (scope `conditioning`): `input_offset(task_id)` `[B, E]`
    and `layer_hooks(l, ...)` `LayerHooks(qkv=[B, 3, H, D])` per the `injection`, each
    computed once per task and gathered per row. `scanned`: the per-layer tables are
    stacked (`conditioning/layers/...`) for a scanned stack (`scan_inputs`,
    `layer_hook_module`); `layers` must then be every layer (or none, `input`)."""

    num_tasks: int
    hidden_size: int
    num_heads: int
    head_dim: int
    injection: str = "qkv"
    layers: tuple[int, ...] = ()
    task_embedding_dim: int = 32
    activation: str = "tanh"
    scanned: bool = False

    def setup(self):
        t = self.num_tasks
        if self.injection == "input":
            self.input_embedding = TaskEmbedding(t, self.hidden_size, embedding_init=_init)
            return
        if self.injection != "qkv":
            self.task_embedding = TaskEmbedding(t, self.task_embedding_dim)

        def table(num_layers=None, name=None):
            if self.injection == "qkv":
                return TaskQkv(t, self.num_heads, self.head_dim, num_layers, name=name)
            return QkvProjection(self.task_embedding_dim, self.num_heads, self.head_dim,
                                 num_layers, name=name)

        if self.scanned:
            self.stack = table(len(self.layers), "layers")
        else:
            self.tables = [table(name=f"layers_{i}") for i in self.layers]
        self.hook = self.layer_hook_module()

    @nn.nowrap
    def layer_hook_module(self) -> TeaLayerHook | None:
        if self.injection == "input":
            return None
        return TeaLayerHook(self.injection, self.activation, parent=None)

    def input_offset(self, task_id: Array) -> Array | None:
        if self.injection != "input":
            return None
        return gather_by_task(self.input_embedding(), task_id)

    def _shared(self) -> Array | None:
        return None if self.injection == "qkv" else self.task_embedding()

    def scan_inputs(self, task_id: Array) -> tuple[Any, Any]:
        """`(shared, per_layer)` of a scanned stack (`(None, None)` for `input`)."""
        if self.injection == "input":
            return None, None
        return self._shared(), self.stack()

    def layer_hooks(self, index: int, x: Array, mask: Array, task_id: Array,
                    deterministic: bool) -> LayerHooks:
        if self.injection == "input" or index not in self.layers:
            return LayerHooks()
        per_layer = self.tables[self.layers.index(index)]()
        return self.hook(x, mask, task_id, self._shared(), per_layer, deterministic)


class TeaClassifierModel(TaskConditionedClassifierModel):
    """BERT with TEA-BERT task embeddings and one classification / regression head per task.

    Args (the rest as `encoder.EncoderClassifierModel`):
      injection: one of `INJECTIONS` (see the module docstring).
      task_layers: indices of the task-specific layers (`qkv`, `projected*`; default None:
        every layer); the others are task-shared. Must be None with `input`.
      task_embedding_dim: `d`, the size of `z_t` (`projected*` only).
      activation: `projected_act`'s nonlinearity, one of `TEA_ACTIVATIONS`.
      shared_layers, frozen_layers: as `encoder.EncoderClassifierModel` (frozen layers
        keep their task embeddings trainable).
    """

    def __init__(self, config: bert.BertConfig | None = None, *,
                 num_labels: int | Sequence[int] = (2,), num_tasks: int | None = None,
                 classifier_dropout: float | None = None, loss_normalization: str = "global",
                 injection: str = "qkv", task_layers: Sequence[int] | None = None,
                 task_embedding_dim: int = 32, activation: str = "tanh",
                 shared_layers: int = 0, frozen_layers: int | str = 0, pooling: str = "cls",
                 head_kinds: str | Sequence[str] | None = None, cosine_scale: float = 5.0):
        if injection not in INJECTIONS:
            raise ValueError(f"TeaClassifierModel.injection={injection!r}; accepted: {INJECTIONS}")
        if injection == "input" and task_layers is not None:
            raise ValueError(f"TeaClassifierModel.task_layers={task_layers!r} with injection='input' "
                             "(which touches the embeddings only); accepted: None")
        if isinstance(task_embedding_dim, bool) or not isinstance(task_embedding_dim, int) \
                or task_embedding_dim < 1:
            raise ValueError(f"TeaClassifierModel.task_embedding_dim={task_embedding_dim!r}: must "
                             "be an int >= 1")
        if activation not in TEA_ACTIVATIONS:
            raise ValueError(f"TeaClassifierModel.activation={activation!r}; accepted: "
                             f"{sorted(TEA_ACTIVATIONS)}")
        self.injection, self.task_embedding_dim, self.activation = (
            injection, task_embedding_dim, activation)
        self._task_layers = task_layers
        super().__init__(config, num_labels=num_labels, num_tasks=num_tasks,
                         classifier_dropout=classifier_dropout,
                         loss_normalization=loss_normalization, shared_layers=shared_layers,
                         frozen_layers=frozen_layers, pooling=pooling, head_kinds=head_kinds,
                         cosine_scale=cosine_scale)

    def _conditioning(self) -> nn.Module:
        c = self.config
        self.task_layers = () if self.injection == "input" else check_layers(
            "TeaClassifierModel", "task_layers", self._task_layers, c.num_layers)
        if self.injection != "input":
            check_every_layer_when_scanned("TeaClassifierModel", "task_layers", self.task_layers, c)
        return TeaConditioning(self.num_tasks, c.hidden_size, c.num_heads, c.head_dim,
                               self.injection, self.task_layers, self.task_embedding_dim,
                               self.activation, scanned=c.scan_layers)

    def __repr__(self) -> str:
        return (f"TeaClassifierModel(config={self.config}, num_labels={self.num_labels}, "
                f"classifier_dropout={self.classifier_dropout}, "
                f"loss_normalization={self.loss_normalization!r}, injection={self.injection!r}, "
                f"task_layers={self.task_layers}, task_embedding_dim={self.task_embedding_dim}, "
                f"activation={self.activation!r}, shared_layers={self.shared_layers}, "
                f"frozen_layers={self.frozen_layers!r}, "
                f"pooling={self.pooling!r}, head_kinds={self.head_kinds})")

