"""Which parameters are balanced (shared) and how they are grouped.

A parameter is named by the '/'-joined keys of its path in the params tree
(`"bottom/layer_0/kernel"`). `shared` is a list of regular expressions matched with
`re.search` against those names: a parameter is *shared* (its per-task gradients are
stacked on a task axis and balanced) when any pattern matches. Parameters that only one
task touches (task towers, heads, prompts) are *unshared*: the engine sums their task
gradients, which is what every balancing method of the MetaBalance paper does for
task-specific parameters (He et al., 2022, Section 3).

The default (`shared=None`) balances every parameter except those under a path
component that names per-task parameters: `towers`, `heads`, `tower_<k>`, `head_<k>`,
`task_<k>` (see `DEFAULT_UNSHARED_PATTERNS`). Models may publish their own list as
`model.shared_param_patterns`; the trainer passes it on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax

from ktx import treepath

__all__ = [
    "DEFAULT_UNSHARED_PATTERNS",
    "param_names",
    "shared_mask",
    "group_names",
]

DEFAULT_UNSHARED_PATTERNS = (
    r"(^|/)(towers|heads|tower|head)(/|$)",
    r"(^|/)(tower|head|task)s?_\d+(/|$)",
)


def param_names(params: Any) -> list[str]:
    """The '/'-joined path of every leaf of `params`, in `jax.tree.leaves` order.

    Flax metadata boxes (`nn.Partitioned`) are named by their parameter's path, without
    the box's `value` field.
    """
    return treepath.names(params, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def _compile(patterns: Sequence[str], argument: str) -> list[re.Pattern]:
    if isinstance(patterns, str):
        raise TypeError(
            f"{argument}={patterns!r}: expected a list of regular expressions, not one string"
        )
    compiled = []
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"{argument}: pattern {p!r} is not a string")
        try:
            compiled.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"{argument}: pattern {p!r} is not a valid regex: {e}") from e
    return compiled


def shared_mask(params: Any, shared: Sequence[str] | str | None = None) -> Any:
    """A params-shaped tree of Python bools: True where the parameter is shared.

    Args:
      params: the parameter tree (arrays or `ShapeDtypeStruct`s).
      shared: None (the default rule above), `"all"`, or a list of regexes; a list
        that matches no parameter is an error (it would silently balance nothing).
    """
    names = param_names(params)
    treedef = jax.tree.structure(params)
    if shared is None:
        unshared = _compile(DEFAULT_UNSHARED_PATTERNS, "DEFAULT_UNSHARED_PATTERNS")
        flags = [not any(p.search(n) for p in unshared) for n in names]
    elif shared == "all":
        flags = [True] * len(names)
    else:
        compiled = _compile(shared, "shared")
        flags = [any(p.search(n) for p in compiled) for n in names]
        if names and not any(flags):
            raise ValueError(
                f"shared={list(shared)!r} matches no parameter; parameter names are: "
                f"{names[:20]}{' ...' if len(names) > 20 else ''}"
            )
    return jax.tree.unflatten(treedef, flags)


def group_names(params: Any, groups: Sequence[str] | None = None) -> list[str]:
    """The balancing group of every leaf (in `jax.tree.leaves` order).

    With `groups=None` every tensor is its own group (named by its path); otherwise a
    leaf joins the first regex in `groups` that it matches (the group is named by the
    regex) and unmatched leaves stay alone.
    """
    names = param_names(params)
    if groups is None:
        return names
    compiled = _compile(groups, "groups")
    out = []
    for n in names:
        match = next((p.pattern for p in compiled if p.search(n)), None)
        out.append(match if match is not None else n)
    return out
