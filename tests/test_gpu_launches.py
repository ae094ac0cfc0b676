"""The launch counter of tests/benchmarks/gpu_launches.py, on programs compiled for this
machine's CPU (the HLO text it reads has the same form on every backend)."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.append(str(pathlib.Path(__file__).resolve().parent / "benchmarks"))

import gpu_launches  # noqa: E402


def _launches(fn, *args) -> dict:
    return gpu_launches.count_launches(jax.jit(fn).lower(*args).compile().as_text())


def _loop(trips: int):
    def fn(x):
        return jax.lax.fori_loop(0, trips, lambda i, x: jnp.sin(x) * 2 + x[::-1] * i, x)
    return fn


def test_a_loop_body_counts_once_per_trip():
    x = jnp.ones(64)
    n = {trips: _launches(_loop(trips), x) for trips in (20, 30, 40)}
    per_ten = n[30]["launches"] - n[20]["launches"]
    assert per_ten > 0 and per_ten % 10 == 0, n
    assert n[40]["launches"] - n[30]["launches"] == per_ten, n
    assert all(c["unbounded_loops"] == 0 for c in n.values()), n


def test_a_loop_without_a_trip_count_is_reported():
    def fn(x):
        return jax.lax.while_loop(lambda x: x.sum() < 100.0, lambda x: jnp.sin(x) + x * 2, x)
    c = _launches(fn, jnp.ones(8))
    assert c["unbounded_loops"] == 1 and c["launches"] > 0, c


def test_a_conditional_counts_its_largest_branch():
    def cheap(y):
        return y.sum()

    def costly(y):
        for _ in range(6):
            y = jnp.sort(jnp.cos(y) * 3.0)
        return y.sum()

    x, p = jnp.linspace(0.0, 1.0, 64), jnp.asarray(True)
    both = _launches(lambda x, p: jax.lax.cond(p, costly, cheap, x), x, p)
    alone = _launches(costly, x)
    assert both["by_opcode"]["conditional"] == 1
    assert both["by_opcode"].get("sort", 0) == alone["by_opcode"].get("sort", 0) == 6, (both, alone)
    assert both["launches"] >= alone["launches"]


def test_tuple_typed_instructions_are_parsed():
    text = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %a = f32[4]{0} get-tuple-element(%p), index=1
  %f = f32[4]{0} fusion(%a), kind=kLoop, calls=%c
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %f)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]{0}) parameter(0)
  ROOT %lt = pred[] fusion(%p), kind=kLoop, calls=%d
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %s = (f32[4]{0}, s32[4]{0}) sort(%x, %x), dimensions={0}, to_apply=%cmp
  %w = (s32[], f32[4]{0}) while(%s), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[4]{0} get-tuple-element(%w), index=1
}
"""
    c = gpu_launches.count_launches(text)
    assert c == {"launches": 7, "by_opcode": {"fusion": 6, "sort": 1}, "unbounded_loops": 0}, c
