"""Per-test XLA compile counts and seconds, for finding where the suite's time goes.

Opt-in: `KTX_TEST_COMPILE_STATS=FILE pytest -p tests.compile_stats ...` appends one JSON
line per test to FILE (`nodeid`, `compiles`, `compile_s`: XLA's backend compiles;
`trace_s`, `lower_s`: tracing to jaxprs and lowering them to StableHLO, which the
persistent compilation cache does not save; `cache_hits`: programs read from that cache
instead of compiled; `large_compiles`: `[name, seconds]` of each compile of 0.5 s or more;
`call_s`; `worker`, the xdist worker, and `end`, the Unix time the test ended), each xdist
worker to the same file.
Summarise with `python -m tests.compile_stats FILE`.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

_EVENTS = {"/jax/core/compile/backend_compile_duration": "s",
           "/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower"}
_HIT = "/jax/compilation_cache/cache_hits"
_state = {"n": 0, "s": 0.0, "trace": 0.0, "lower": 0.0, "hits": 0}


_LARGE_S = 0.5  # compiles this long or longer are listed by name
_large: list = []


def _listener(event: str, duration: float, fun_name: str = "?", **_: object) -> None:
    key = _EVENTS.get(event)
    if key is not None:
        _state["n"] += key == "s"
        _state[key] += duration
        if key == "s" and duration >= _LARGE_S:
            _large.append([fun_name, round(duration, 2)])


def _event_listener(event: str, **_: object) -> None:
    if event == _HIT:
        _state["hits"] += 1


def pytest_configure(config):
    if not os.environ.get("KTX_TEST_COMPILE_STATS"):
        return
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listener)
    jax.monitoring.register_event_listener(_event_listener)


def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("KTX_TEST_COMPILE_STATS")
    if not path:
        return None
    before, t0 = dict(_state), time.perf_counter()
    _large.clear()
    from _pytest.runner import runtestprotocol

    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    runtestprotocol(item, nextitem=nextitem)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    record = {"nodeid": item.nodeid, "compiles": _state["n"] - before["n"],
              "compile_s": round(_state["s"] - before["s"], 3),
              "trace_s": round(_state["trace"] - before["trace"], 3),
              "lower_s": round(_state["lower"] - before["lower"], 3),
              "cache_hits": _state["hits"] - before["hits"],
              "large_compiles": list(_large),
              "call_s": round(time.perf_counter() - t0, 3),
              "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "end": round(time.time(), 1)}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    return True


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    keys = ("compiles", "compile_s", "trace_s", "lower_s", "cache_hits", "call_s")
    by_file = collections.defaultdict(lambda: [0] * (1 + len(keys)))
    for r in rows:
        f = by_file[r["nodeid"].split("::")[0]]
        f[0] += 1
        for i, k in enumerate(keys, 1):
            f[i] += r.get(k, 0)
    total = [sum(v[i] for v in by_file.values()) for i in range(1 + len(keys))]
    twice = [(r["nodeid"], name, n) for r in rows
             for name, n in collections.Counter(
                 f for f, _ in r.get("large_compiles", ())).items() if n > 1]
    print(f"{'file':56s} {'tests':>5s} {'compiles':>8s} {'compile_s':>9s} {'trace_s':>7s} "
          f"{'lower_s':>7s} {'hits':>5s} {'wall_s':>8s}")
    for name, v in [*sorted(by_file.items(), key=lambda kv: -kv[1][-1])[:40], ("total", total)]:
        print(f"{name:56s} {v[0]:5d} {v[1]:8d} {v[2]:9.1f} {v[3]:7.1f} {v[4]:7.1f} {v[5]:5d} "
              f"{v[6]:8.1f}")
    if twice:
        # One jitted function compiled again for inputs placed otherwise than its last
        # call's outputs shows here, and so do distinct functions of one name (two
        # trainers' `train_step`s, lambdas): read the test before changing it.
        print("\nnames compiled (0.5 s or more) more than once in one test:")
        for nodeid, name, n in twice:
            print(f"  {n} x {name}  {nodeid}")


if __name__ == "__main__":
    main(sys.argv[1])
