"""Parameter names: a pytree path as a '/'-joined string, e.g.
`encoder/layers_0/attention/query/kernel` (dict keys, dataclass fields and sequence
indices alike, `jax.tree_util.keystr(simple=True)`). Every place that names a parameter
(freezing, balancing groups, checkpoint reports, sharding lookups, parameter counts)
uses these two functions, so a pattern written against one matches in all of them.
`flatten` / `unflatten` convert nested dicts of parameters to `{name: leaf}` and back.

`select(tree, selection)` is the one matcher of a parameter selection (frozen parameters):
regexes fully matching whole names, and `Rows(pattern, start, stop)` for a slice of the
leading axis of a scanned stack's parameters (`[layers, ...]`), e.g. the bottom layers of a
scanned BERT (`Rows("layers/.*", 0, 3)`), which no whole-leaf regex can name.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import jax
import numpy as np

__all__ = ["Rows", "Selection", "flatten", "name", "names", "rows_like", "select", "selected_size",
           "unflatten"]


@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows `start .. stop-1` of the leading axis of every leaf whose name fully matches
    `pattern`: a layer subset of a scanned stack, whose parameters are stacked `[L, ...]`."""

    pattern: str
    start: int
    stop: int

    def __post_init__(self):
        if not isinstance(self.pattern, str):
            raise TypeError(f"Rows.pattern={self.pattern!r}; accepted: a regex string")
        for field in ("start", "stop"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Rows.{field}={value!r}; accepted: an int >= 0")
        if self.start >= self.stop:
            raise ValueError(f"Rows(start={self.start}, stop={self.stop}) selects no row; "
                             "accepted: start < stop")


# A selection: regexes (whole leaves) and `Rows` (leading-axis slices).
Selection = Sequence[Union[str, Rows]]


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


def select(tree: Any, selection: Selection, *, what: str = "pattern", strict: bool = True) -> Any:
    """Which parts of each leaf of `tree` (arrays or `ShapeDtypeStruct`s) `selection` names.

    Returns a pytree like `tree` whose leaves are `True` (the whole leaf), `False` (none of
    it), or a numpy bool vector `[leaf.shape[0]]` marking the selected rows of a leaf that
    only `Rows` entries name in part. Raises TypeError for a string `selection`, and
    ValueError naming an entry (`what` in the message) that is not a valid regex, matches no
    leaf (a typo would otherwise silently select nothing; `strict=False` allows it), or
    whose rows do not fit a leaf.
    """
    if isinstance(selection, (str, Rows)):
        raise TypeError(f"{what}s={selection!r} must be a list of regexes or Rows, not one")
    entries = []
    for entry in selection:
        pattern = entry.pattern if isinstance(entry, Rows) else entry
        if not isinstance(pattern, str):
            raise TypeError(f"{what} {entry!r}; accepted: a regex string or a treepath.Rows")
        try:
            entries.append((entry, re.compile(pattern)))
        except re.error as e:
            raise ValueError(f"{what} {pattern!r} is not a valid regex: {e}") from e
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaf_names = [name(p) for p, _ in flat]
    for entry, rx in entries if strict else ():
        if not any(rx.fullmatch(n) for n in leaf_names):
            raise ValueError(f"{what} {entry!r} matches no parameter; parameter paths look "
                             f"like {leaf_names[:5]}")
    out = []
    for n, (_, leaf) in zip(leaf_names, flat):
        whole, rows = False, None
        for entry, rx in entries:
            if not rx.fullmatch(n):
                continue
            if not isinstance(entry, Rows):
                whole = True
                break
            size = np.shape(leaf)[0] if np.ndim(leaf) else 0
            if entry.stop > size:
                raise ValueError(f"{what} {entry!r}: {n} has {size} rows on its leading axis "
                                 f"(shape {tuple(np.shape(leaf))}); accepted: stop <= {size}")
            rows = np.zeros(size, bool) if rows is None else rows
            rows[entry.start:entry.stop] = True
        if not whole and rows is not None and rows.all():
            whole = True
        out.append(True if whole else (rows if rows is not None else False))
    return jax.tree_util.tree_unflatten(treedef, out)


def selected_size(leaf: Any, selected: Any) -> int:
    """Elements of `leaf` that a `select` entry (`True`, `False` or bool rows) covers."""
    size = int(np.prod(np.shape(leaf), dtype=np.int64))
    if isinstance(selected, np.ndarray):
        return size // max(np.shape(leaf)[0], 1) * int(selected.sum())
    return size if selected else 0


def rows_like(rows: np.ndarray, leaf: Any) -> np.ndarray:
    """A `select` row vector `[L]` as `[L, 1, ...]`, broadcasting against `leaf` `[L, ...]`."""
    return rows.reshape((-1,) + (1,) * (np.ndim(leaf) - 1))
