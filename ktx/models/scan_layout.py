"""T5 parameter trees between the unrolled and the scanned layer layouts.

Unrolled (`T5Config.scan_layers=False`, T5X's and Hugging Face's layout): one scope per
layer, `encoder/layers_3/attention/query/kernel` `[E, H, D]`. Scanned (`scan_layers=True`,
`ktx.models.t5_stack`): one scope for the stack, every parameter stacked on a leading
layer axis, `encoder/layers/attention/query/kernel` `[L, E, H, D]`. The same holds for the
decoder and for any other per-layer variable (the decode cache). Everything else (the
embedding, the final norms, the relative position biases, `conditioning/`) is the same in
both layouts. A BERT encoder (`BertConfig.scan_layers`) keeps its stack at the root:
`layers_3/attention/query/kernel` <-> `layers/attention/query/kernel`, and an encoder
method's per-layer tables with it (PALs, TEA-BERT: `conditioning/layers_3/...` <->
`conditioning/layers/...`, stacked the same way); `shared_layers/layers_<i>` (extra top
layers, never scanned) are not a stack, and neither are per-layer tables that differ from
layer to layer (CA-MTL's `conditioning/layers_<i>`: the layer-norm FiLMs of the upper
layers only, the adapter of the top one): they stay per layer in both layouts, and the
scanned CA-MTL stack reads them layer by layer.

`convert_layout(tree, scanned=...)` is the one conversion, both ways: checkpoint import
and export and restoring a checkpoint of one layout into a model of the other call it.
It takes a nested mapping (flax `params`) or a flat `{'a/b/c': array}` mapping (the
converters' form) and returns the same form; numpy leaves stay numpy.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from ktx.treepath import flatten, unflatten

__all__ = ["SIDES", "convert_layout", "is_scanned", "layout_mismatch", "num_layers"]

SIDES = ("encoder", "decoder")
# (prefix, side) is ("...", "encoder" | "decoder") for T5's stacks, ("", "") for BERT's,
# ("", "conditioning") for an encoder method's per-layer tables.
_UNROLLED = re.compile(r"^(?:((?:.*/)?)(encoder|decoder|conditioning)/)?layers_(\d+)/(.+)$")
_SCANNED = re.compile(r"^(?:((?:.*/)?)(encoder|decoder|conditioning)/)?layers/(.+)$")


def _where(m: re.Match) -> tuple[str, str]:
    return m.group(1) or "", m.group(2) or ""


def _path(prefix: str, side: str, tail: str) -> str:
    return f"{prefix}{side}/{tail}" if side else tail


def _is_flat(tree: Mapping[str, Any]) -> bool:
    return any("/" in str(k) for k in tree) or not any(isinstance(v, Mapping) for v in tree.values())


def _ragged(flat: Mapping[str, Any]) -> set[tuple[str, str]]:
    """The `(prefix, "conditioning")` groups of unrolled per-layer tables whose layers
    hold different parameter sets (CA-MTL's): not a stack in either layout."""
    names: dict[tuple[str, str], dict[int, set[str]]] = {}
    for path in flat:
        m = _UNROLLED.match(path)
        if m and _where(m)[1] == "conditioning":
            names.setdefault(_where(m), {}).setdefault(int(m.group(3)), set()).add(m.group(4))
    return {where for where, by_layer in names.items()
            if len({frozenset(v) for v in by_layer.values()}) > 1
            or sorted(by_layer) != list(range(len(by_layer)))}


def _stacked(m: re.Match | None, ragged: set[tuple[str, str]]) -> re.Match | None:
    """`m` unless it names a table of a ragged group (then: not a layer stack entry)."""
    return None if m is None or _where(m) in ragged else m


def _layouts(flat: Mapping[str, Any]) -> dict[tuple[str, str], set[str]]:
    """`{(prefix, side): {"unrolled", "scanned"}}` found in `flat`'s paths."""
    found: dict[tuple[str, str], set[str]] = {}
    ragged = _ragged(flat)
    for path in flat:
        m = _stacked(_UNROLLED.match(path), ragged)
        if m:
            found.setdefault(_where(m), set()).add("unrolled")
            continue
        m = _SCANNED.match(path)
        if m:
            found.setdefault(_where(m), set()).add("scanned")
    for (prefix, side), kinds in found.items():
        if len(kinds) > 1:
            raise ValueError(
                f"{_path(prefix, side, '') or 'the root'}: holds both unrolled (layers_<i>/...) "
                "and scanned (layers/...) parameters; a tree is in one layout")
    return found


def is_scanned(tree: Mapping[str, Any]) -> bool | None:
    """True (scanned), False (unrolled), or None (no layer parameters) for `tree`."""
    flat = tree if _is_flat(tree) else flatten(tree)
    kinds = {k for v in _layouts(flat).values() for k in v}
    if len(kinds) > 1:
        raise ValueError("the tree mixes unrolled and scanned layer stacks")
    return None if not kinds else kinds == {"scanned"}


def num_layers(tree: Mapping[str, Any], side: str) -> int:
    """The number of layers of `side` ("encoder"/"decoder"; "" for a BERT stack) in either
    layout (0: none)."""
    flat = tree if _is_flat(tree) else flatten(tree)
    count = 0
    ragged = _ragged(flat)
    for path, value in flat.items():
        m = _stacked(_UNROLLED.match(path), ragged)
        if m and _where(m)[1] == side:
            count = max(count, int(m.group(3)) + 1)
        m = _SCANNED.match(path)
        if m and _where(m)[1] == side:
            count = max(count, int(np.shape(value)[0]))
    return count


def _stack(values: list[Any]) -> Any:
    if all(isinstance(v, np.ndarray) for v in values):
        return np.stack(values)
    return jnp.stack([jnp.asarray(v) for v in values])


def _to_scanned(flat: Mapping[str, Any]) -> dict[str, Any]:
    groups: dict[tuple[str, str, str], dict[int, Any]] = {}
    out = {}
    ragged = _ragged(flat)
    for path, value in flat.items():
        m = _stacked(_UNROLLED.match(path), ragged)
        if not m:
            out[path] = value
            continue
        (prefix, side), index, rest = _where(m), int(m.group(3)), m.group(4)
        groups.setdefault((prefix, side, rest), {})[index] = value
    sizes: dict[tuple[str, str], set[int]] = {}
    for (prefix, side, rest), by_index in groups.items():
        n = max(by_index) + 1
        missing = sorted(set(range(n)) - set(by_index))
        if missing:
            raise ValueError(
                f"{_path(prefix, side, 'layers_<i>/' + rest)}: layers {missing} missing (have "
                f"{sorted(by_index)}); cannot stack an incomplete layer stack")
        sizes.setdefault((prefix, side), set()).add(n)
        out[_path(prefix, side, f"layers/{rest}")] = _stack([by_index[i] for i in range(n)])
    for (prefix, side), ns in sizes.items():
        if len(ns) > 1:
            raise ValueError(
                f"{_path(prefix, side, '') or 'the root'}: layers hold different parameter "
                f"sets (counts {sorted(ns)})")
    return out


def _to_unrolled(flat: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for path, value in flat.items():
        m = _SCANNED.match(path)
        if not m:
            out[path] = value
            continue
        (prefix, side), rest = _where(m), m.group(3)
        for i in range(np.shape(value)[0]):
            out[_path(prefix, side, f"layers_{i}/{rest}")] = value[i]
    return out


def convert_layout(tree: Mapping[str, Any], *, scanned: bool) -> Any:
    """`tree` (nested or flat parameters, or any per-layer collection) in the scanned
    (`scanned=True`) or unrolled layout; a tree already in that layout is returned with
    the same leaves. Non-layer entries are kept as they are."""
    if not isinstance(scanned, bool):
        raise TypeError(f"convert_layout: scanned={scanned!r}; accepted: True or False")
    if not isinstance(tree, Mapping):
        raise TypeError(f"convert_layout: a mapping of parameters, got {type(tree).__name__}")
    flat_in = _is_flat(tree)
    flat = dict(tree) if flat_in else flatten(tree)
    _layouts(flat)
    out = _to_scanned(flat) if scanned else _to_unrolled(flat)
    return out if flat_in else unflatten(out)



def layout_mismatch(saved: Any, expected: Any, where: str) -> str | None:
    """A one-line message when the parameter paths `saved` (a checkpoint's) and
    `expected` (the model's) hold their layer stacks in different layouts, else None.

    Restoring across layouts by name would silently miss every layer parameter (a new
    run would re-initialise them), so the restore paths call this first.
    """
    have, want = is_scanned(dict.fromkeys(saved, 0)), is_scanned(dict.fromkeys(expected, 0))
    if have is None or want is None or have == want:
        return None
    names = {True: "scanned ([encoder/]layers/..., stacked)",
             False: "unrolled ([encoder/]layers_<i>/...)"}
    return (
        f"checkpoint {where} holds the {names[have]} layer layout but the model is "
        f"{names[want]}: set T5Config.scan_layers / BertConfig.scan_layers={have} (gin macro "
        "SCAN_LAYERS) to match it, or convert the checkpoint with "
        "ktx.models.scan_layout.convert_layout"
    )
