"""Parameter names: a pytree path as a '/'-joined string, e.g.
`encoder/layers_0/attention/query/kernel` (dict keys, dataclass fields and sequence
indices alike, `jax.tree_util.keystr(simple=True)`). Every place that names a parameter
(freezing, balancing groups, checkpoint reports, sharding lookups, parameter counts)
uses these two functions, so a pattern written against one matches in all of them.
`flatten` / `unflatten` convert nested dicts of parameters to `{name: leaf}` and back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

__all__ = ["flatten", "name", "names", "unflatten"]


def name(path: tuple[Any, ...]) -> str:
    """A `jax.tree_util` key path as a '/'-joined string."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def names(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[str]:
    """The name of every leaf of `tree`, in `jax.tree.leaves` order."""
    return [name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{'/'-joined path: leaf}` of nested dicts (mappings are nodes, anything else a leaf)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Nested dicts from `{'/'-joined path: leaf}` (the inverse of `flatten`)."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out
