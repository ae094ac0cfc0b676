"""Parameter accounting from shapes only (`ktx params`).

`count_parameters(model)` traces `model.init_variables` with `jax.eval_shape` on the
model's own `input_spec`, so nothing is allocated: T5.1.1 XXL with any conditioning is
counted on a laptop. Parameters under a `conditioning` scope (where every module of
`ktx.conditioning` lives) are task-conditioned; everything else is the backbone, which
is exactly the plain T5, so `ratio = total / backbone` is the size relative to plain T5.
A model's `frozen_patterns` (`ktx.treepath.select`: whole leaves and the frozen rows of a
scanned stack) give the `frozen` and `trainable` counts.

`hyperprompt_global_closed_form` is the closed form of He et al., 2022 (HyperPrompt) for
the HyperPrompt-Global parameters of one Transformer side.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from ktx import treepath

__all__ = [
    "CONDITIONING_SCOPE",
    "count_parameters",
    "count_tree",
    "format_report",
    "hyperprompt_global_closed_form",
    "is_conditioning_path",
]

CONDITIONING_SCOPE = "conditioning"


def is_conditioning_path(path: tuple[str, ...]) -> bool:
    """True for a parameter path inside a `conditioning` scope."""
    return CONDITIONING_SCOPE in path


def count_tree(tree: Any) -> dict[tuple[str, ...], int]:
    """`{path: number of elements}` for every array-like leaf (`nn.Partitioned` unboxed)."""
    tree = nn.meta.unbox(tree)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(treepath.name(p).split("/")): int(np.prod(leaf.shape, dtype=np.int64)) for p, leaf in leaves}


def hyperprompt_global_closed_form(
    *, d: int, l: int, T: int, b: int, t_prime: int, t: int, M: int, e: int
) -> int:
    """HyperPrompt-Global parameters of one side: `d l T + 4 b d t + T t' + M t' + (2 t' + t) e`.

    He et al., 2022: global prompts (`d l T`), the global hypernetworks `H_k`, `H_v`
    generating `D` (`d x b`) and `U` (`b x d`) from a t-dimensional embedding (`4 b d t`),
    task embeddings (`T t'`), layer embeddings (`M t'`), and the bias-free two-layer MLP
    `h_t: 2t' -> e -> t` (`(2 t' + t) e`).
    """
    for name, value in dict(d=d, l=l, T=T, b=b, t_prime=t_prime, t=t, M=M, e=e).items():
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"hyperprompt_global_closed_form: {name}={value!r}; accepted: int >= 0")
    return d * l * T + 4 * b * d * t + T * t_prime + M * t_prime + (2 * t_prime + t) * e


def count_parameters(
    model: Any,
    *,
    batch_size: int = 1,
    feature_lengths: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Counts `model`'s parameters from shapes only.

    Args:
      model: a `ktx.models.base.BaseModel` (`init_variables`, `input_spec`).
      batch_size, feature_lengths: the input shapes traced (parameter counts of ktx
        models do not depend on them; defaults: 1 row, `{"inputs": 8, "targets": 8}`).

    Returns:
      dict with `backbone`, `task_conditioned`, `total`, `frozen` and `trainable` (ints;
      `frozen` from the model's `frozen_patterns`), `ratio` (total / backbone),
      `num_tasks`, and `modules`: `{"conditioning/<module>": count}` for each
      task-conditioned module.
    """
    if not hasattr(model, "init_variables") or not hasattr(model, "input_spec"):
        raise TypeError(
            f"count_parameters: model={type(model).__name__} has no init_variables/input_spec; "
            "accepted: a ktx.models.base.BaseModel"
        )
    lengths = dict(feature_lengths or {"inputs": 8, "targets": 8})
    spec = model.input_spec(batch_size, lengths)
    abstract = jax.eval_shape(model.init_variables, jax.random.key(0), spec)
    params = nn.meta.unbox(abstract["params"] if "params" in abstract else abstract)
    counts = count_tree(params)
    frozen_selection = tuple(getattr(model, "frozen_patterns", ()) or ())
    frozen = 0
    if frozen_selection:
        selected = treepath.select(params, frozen_selection, what="frozen pattern")
        frozen = sum(treepath.selected_size(leaf, m) for leaf, m in zip(
            jax.tree.leaves(params), jax.tree.leaves(selected)))
    conditioned = {p: n for p, n in counts.items() if is_conditioning_path(p)}
    backbone = sum(n for p, n in counts.items() if p not in conditioned)
    modules: dict[str, int] = {}
    for p, n in conditioned.items():
        i = p.index(CONDITIONING_SCOPE)
        key = "/".join(p[: i + 2])
        modules[key] = modules.get(key, 0) + n
    task_conditioned = sum(conditioned.values())
    total = backbone + task_conditioned
    return {
        "num_tasks": int(getattr(model, "num_tasks", 0)),
        "backbone": backbone,
        "task_conditioned": task_conditioned,
        "total": total,
        "frozen": frozen,
        "trainable": total - frozen,
        "ratio": total / backbone if backbone else float("nan"),
        "modules": dict(sorted(modules.items())),
    }


def format_report(report: Mapping[str, Any], *, name: str | None = None) -> str:
    """Human-readable lines for a `count_parameters` report."""
    lines = []
    if name:
        lines.append(f"model: {name}")
    lines += [
        f"tasks:            {report['num_tasks']}",
        f"backbone:         {report['backbone']:,}",
        f"task-conditioned: {report['task_conditioned']:,}",
        f"total:            {report['total']:,}",
    ]
    if report.get("frozen"):
        lines += [f"frozen:           {report['frozen']:,}",
                  f"trainable:        {report['trainable']:,}"]
    lines += [
        f"ratio to plain:   {report['ratio']:.4f}x",
    ]
    for module, n in report.get("modules", {}).items():
        lines.append(f"  {module}: {n:,}")
    return "\n".join(lines)
