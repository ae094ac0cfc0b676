"""Per-test XLA compile counts and seconds, for finding where the suite's time goes.

Opt-in: `KTX_TEST_COMPILE_STATS=FILE pytest -p tests.compile_stats ...` appends one JSON
line per test to FILE (`nodeid`, `compiles`, `compile_s`, `call_s`), each xdist worker to
the same file. Summarise with `python -m tests.compile_stats FILE`.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

_EVENT = "/jax/core/compile/backend_compile_duration"
_state = {"n": 0, "s": 0.0}


def _listener(event: str, duration: float, **_: object) -> None:
    if event == _EVENT:
        _state["n"] += 1
        _state["s"] += duration


def pytest_configure(config):
    if not os.environ.get("KTX_TEST_COMPILE_STATS"):
        return
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listener)


def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("KTX_TEST_COMPILE_STATS")
    if not path:
        return None
    n0, s0, t0 = _state["n"], _state["s"], time.perf_counter()
    from _pytest.runner import runtestprotocol

    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    runtestprotocol(item, nextitem=nextitem)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    record = {"nodeid": item.nodeid, "compiles": _state["n"] - n0,
              "compile_s": round(_state["s"] - s0, 3),
              "call_s": round(time.perf_counter() - t0, 3)}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    return True


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    by_file = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
    for r in rows:
        f = by_file[r["nodeid"].split("::")[0]]
        f[0] += 1
        f[1] += r["compiles"]
        f[2] += r["compile_s"]
        f[3] += r["call_s"]
    total = [sum(v[i] for v in by_file.values()) for i in range(4)]
    print(f"{'file':60s} {'tests':>5s} {'compiles':>8s} {'compile_s':>9s} {'wall_s':>8s}")
    for name, (n, c, cs, ws) in sorted(by_file.items(), key=lambda kv: -kv[1][3])[:40]:
        print(f"{name:60s} {n:5d} {c:8d} {cs:9.1f} {ws:8.1f}")
    print(f"{'total':60s} {total[0]:5d} {total[1]:8d} {total[2]:9.1f} {total[3]:8.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
