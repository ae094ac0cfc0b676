"""Matmul FLOPs of a compiled step, every loop body counted by its trip count.

XLA's cost analysis (`compiled.cost_analysis()["flops"]`) counts a `while` loop's body
once. A scanned layer stack (`SCAN_LAYERS=True`) is such a loop, and so are the loops
XLA's partitioner makes of a matmul with a gathered operand on TPU (windowed einsums), so
for those steps its figure is a lower bound by up to the loop's trip count: T5.1.1-Small
on 8 CPU devices, 5.01e10 FLOPs scanned against 2.05e11 unrolled (docs/scale.md).

`matmul_flops` reads the optimized HLO module instead and sums `2 * output elements *
contracted elements` over its `dot` and `convolution` instructions, multiplying each
computation by how often it runs: a `while` body by its trip count (`_trip_count`: XLA's
`known_trip_count`, or the bound of the loop's condition), a fusion or call by its
caller's count, a conditional by its most expensive branch. Elementwise work is left out (a few percent of a
transformer step's FLOPs), so an unrolled step reads slightly under XLA's own figure; it
is the matmul count model-FLOPs utilisation is usually defined by.
"""

from __future__ import annotations

import functools
import re
from typing import Any

__all__ = ["matmul_flops", "module_text", "step_flops"]

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_DIMS = re.compile(r"^[a-z]\w*\[([\d,]*)\]")
_CALLS = re.compile(r"\b(calls|body|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_LABELS_ALL = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_COND = re.compile(r"\bcondition=%?([\w.\-]+)")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_GTE = re.compile(r"^get-tuple-element\([^)]*\),\s*index=(\d+)")
_PARAM = re.compile(r"^parameter\((\d+)\)")
_CONSTANT = re.compile(r"^constant\((-?\d+)\)")
_COMPARE = re.compile(r"direction=(LT|LE)\b")


def _split_shape(rest: str) -> tuple[str, str]:
    """`(shape, remainder)` of an instruction's text after `=`: a tuple shape runs to its
    matching parenthesis, an array shape to the first space."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].lstrip()
    shape, _, remainder = rest.partition(" ")
    return shape, remainder


def _dims(shape: str) -> list[int] | None:
    m = _DIMS.match(shape)
    if m is None:
        return None
    return [int(d) for d in m.group(1).split(",") if d]


def _operands(text: str) -> list[str]:
    """The operand names of `opcode(a, b), attrs` (shapes printed before them dropped)."""
    depth, current, out = 0, "", []
    for ch in text[text.index("(") + 1:]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            out.append(current)
            current = ""
        else:
            current += ch
    out.append(current)
    return [o.strip().split(" ")[-1].lstrip("%") for o in out if o.strip()]


def _prod(xs: Any) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _parse(text: str) -> tuple[dict, str | None]:
    """`{computation: [(name, shape, op_text)]}` and the entry computation's name."""
    comps: dict[str, list] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
            continue
        if current is None or line.strip() == "}":
            continue
        m = _INSTR.match(line)
        if m:
            shape, op_text = _split_shape(m.group(2))
            comps[current].append((m.group(1), shape, op_text))
    return comps, entry


def _own_flops(instrs: list) -> float:
    shapes = {name: shape for name, shape, _ in instrs}
    total = 0.0
    for _, shape, op_text in instrs:
        opcode = op_text.split("(", 1)[0]
        if opcode not in ("dot", "convolution"):
            continue
        out = _dims(shape)
        ops = _operands(op_text)
        if out is None or len(ops) < 2:
            continue
        if opcode == "dot":
            lhs = _dims(shapes.get(ops[0], ""))
            m = _CONTRACT.search(op_text)
            if lhs is None or m is None:
                continue
            contracted = _prod(lhs[int(d)] for d in m.group(1).split(",") if d)
            total += 2.0 * _prod(out) * contracted
        else:
            flops = _conv_flops(op_text, _dims(shapes.get(ops[0], "")),
                                _dims(shapes.get(ops[1], "")), out)
            total += flops or 0.0
    return total


def _window(op_text: str) -> dict[str, list[list[int]]]:
    m = _WINDOW.search(op_text)
    out: dict[str, list[list[int]]] = {}
    for item in (m.group(1).split() if m else []):
        key, _, value = item.partition("=")
        out[key] = [[int(v) for v in part.split("_")] for part in value.split("x")]
    return out


def _conv_flops(op_text: str, lhs: list[int] | None, rhs: list[int] | None,
                out: list[int]) -> float | None:
    """2 x the multiply-adds of a convolution that touch its input, not its padding: TPU
    compilers write batched matmuls as convolutions whose padded window runs over a batch
    dimension, where only one window position per output meets the input."""
    m = _LABELS_ALL.search(op_text)
    if lhs is None or rhs is None or m is None:
        return None
    lhs_l, rhs_l, out_l = m.groups()
    spatial = sorted(ch for ch in rhs_l if ch.isdigit())
    w = _window(op_text)
    macs = rhs[rhs_l.index("i")] * out[out_l.index("f")] * out[out_l.index("b")]
    for n, ch in enumerate(spatial):
        size = w.get("size", [[rhs[rhs_l.index(ch)]]] * len(spatial))[n][0]
        pad = w.get("pad", [[0, 0]] * len(spatial))[n]
        stride = w.get("stride", [[1]] * len(spatial))[n][0]
        rdil = w.get("rhs_dilate", [[1]] * len(spatial))[n][0]
        ldil = w.get("lhs_dilate", [[1]] * len(spatial))[n][0]
        in_size, out_size = lhs[lhs_l.index(ch)], out[out_l.index(ch)]
        dilated = (in_size - 1) * ldil + 1
        valid = 0
        for o in range(out_size):
            for k in range(size):
                i = o * stride + k * rdil - pad[0]
                valid += 0 <= i < dilated and i % ldil == 0
        macs *= valid
    return 2.0 * macs


def _trip_count(op_text: str, comps: dict) -> int:
    """A `while`'s trip count: XLA's `known_trip_count` where it gives one, else from the
    loop's condition `i < N` (`i <= N`: N + 1) on a counter from 0 and the body's step
    `i + s` (TPU's windowed einsums carry no annotation, and a bidirectional one steps its
    counter by 2); 1 when neither is found."""
    trip = _TRIP.search(op_text)
    if trip:
        return int(trip.group(1))
    cond, body = _COND.search(op_text), _BODY.search(op_text)
    instrs = comps.get(cond.group(1), []) if cond else []
    if not instrs:
        return 1
    constants = _constants(instrs)
    opcode, operands = _root_op(instrs, comps)
    m = _COMPARE.search(opcode)
    if not m or len(operands) < 2 or operands[1] not in constants:
        return 1
    bound = constants[operands[1]] + (m.group(1) == "LE")
    index = next((int(g.group(1)) for name, _, text in instrs
                  if name == operands[0] and (g := _GTE.match(text))), None)
    step = _counter_step(comps.get(body.group(1), []) if body else [], index, comps)
    return max(-(-bound // step), 1)


def _root_op(instrs: list, comps: dict, name: str | None = None) -> tuple[str, list[str]]:
    """The opcode (with its attributes) and operand names of a computation's root (printed
    last) or of its instruction `name`, looking through a fusion of one compare or add
    (CPU wraps a loop's counter arithmetic so) to the fusion's own operands."""
    text = dict((n, t) for n, _, t in instrs).get(name, "") if name else instrs[-1][2]
    operands = _operands(text) if "(" in text else []
    called = _CALLS.search(text)
    if text.startswith("fusion(") and called and comps.get(called.group(2)):
        inner = comps[called.group(2)]
        params = {n: int(m.group(1)) for n, _, t in inner if (m := _PARAM.match(t))}
        root = inner[-1][2]
        if root.startswith(("compare(", "add(")):
            mapped = [operands[params[o]] for o in _operands(root) if o in params]
            return root, mapped
    return text, operands


def _constants(instrs: list) -> dict[str, int]:
    return {name: int(m.group(1)) for name, _, text in instrs if (m := _CONSTANT.match(text))}


def _counter_step(body: list, index: int | None, comps: dict) -> int:
    """What a loop body adds to its counter: the constant `c` of `add(i, c)` that its root
    tuple (printed last) carries at the counter's `index`; 1 when not of that form."""
    if index is None or not body or not body[-1][2].startswith("tuple("):
        return 1
    outputs = _operands(body[-1][2])
    if index >= len(outputs):
        return 1
    opcode, operands = _root_op(body, comps, outputs[index])
    if not opcode.startswith("add("):
        return 1
    constants = _constants(body)
    return next((c for c in (constants.get(o) for o in operands) if c and c > 0), 1)


def matmul_flops(text: str) -> float | None:
    """Per-device matmul FLOPs of an optimized HLO module's text (`module_text`), loop
    bodies counted by their trip counts; None when the text has no entry computation."""
    comps, entry = _parse(text)
    if entry is None:
        return None

    @functools.lru_cache(maxsize=None)
    def flops(name: str) -> float:
        instrs = comps.get(name, [])
        total = _own_flops(instrs)
        for _, _, op_text in instrs:
            branches = _BRANCHES.search(op_text)
            if branches:
                names = [b.strip().lstrip("%") for b in branches.group(1).split(",") if b.strip()]
                total += max((flops(b) for b in names), default=0.0)
                continue
            called = _CALLS.findall(op_text)
            if any(kind in ("true_computation", "false_computation") for kind, _ in called):
                total += max(flops(c) for _, c in called)
                continue
            for kind, callee in called:
                if kind == "to_apply":
                    continue  # reductions' scalar computations
                times = 1
                if kind == "body":
                    times = _trip_count(op_text, comps)
                total += times * flops(callee)
        return total

    return flops(entry)


def module_text(compiled: Any) -> str | None:
    """The optimized HLO text of a `jax.stages.Compiled` (None where it has none)."""
    try:
        text = compiled.as_text()
    except Exception:  # noqa: BLE001 - some backends keep no text
        return None
    return text or None


def step_flops(compiled: Any) -> tuple[float | None, float | None, float | None]:
    """`(flops, xla, matmuls)` per device of a `jax.stages.Compiled`: XLA's cost analysis
    (loop bodies once), `matmul_flops` (loops by their trip counts, no elementwise work),
    and `flops`, the larger of the two: both are lower bounds of what the step computes.
    None where a figure is not available."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation, entry first
        cost = cost[0] if cost else None
    xla = (cost or {}).get("flops")
    xla = float(xla) if xla is not None and xla >= 0 else None
    text = module_text(compiled)
    matmuls = matmul_flops(text) if text else None
    known = [f for f in (xla, matmuls) if f]
    return (max(known) if known else None), xla, matmuls


def flops_per_step(jitted: Any, state: Any, batch: Any, rng: Any,
                   steps: int | None = None) -> float | None:
    """The FLOPs one device runs per step of the executable `jitted` just ran for these
    arguments (JAX caches it: no compile here): the larger of XLA's cost analysis (loop
    bodies once: one step of a `steps`-step scan) and the matmuls with loops counted by
    their trip counts (`step_flops`; divided by `steps`). None when neither is
    available."""
    _, xla, matmuls = step_flops(jitted.lower(state, batch, rng).compile())
    if matmuls is not None and steps:
        matmuls /= steps
    known = [f for f in (xla, matmuls) if f]
    return max(known) if known else None
