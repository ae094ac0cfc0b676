"""Parameter names: a pytree path as a '/'-joined string, e.g.
`encoder/layers_0/attention/query/kernel` (dict keys, dataclass fields and sequence
indices alike, `jax.tree_util.keystr(simple=True)`). Every place that names a parameter
(freezing, balancing groups, checkpoint reports, sharding lookups, parameter counts)
uses these two functions, so a pattern written against one matches in all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

__all__ = ["name", "names"]


def name(path: tuple[Any, ...]) -> str:
    """A `jax.tree_util` key path as a '/'-joined string."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def names(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[str]:
    """The name of every leaf of `tree`, in `jax.tree.leaves` order."""
    return [name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]]
