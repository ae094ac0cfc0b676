"""Where a balanced training step's time goes, against the plain step, on any backend.

`per_task_grads.py` gives the ratio balanced / plain; this script says why. For one
model (T5.1.1 at `--t5_size` tiny or small, or the recommendation model) it builds the
compiled step `ktx train` runs (`ktx.training.trainer.Trainer.train_step`) for a set of
variants, each changing one thing against MetaBalance's default path:

* `plain`: no balancer; `metabalance`: task taps on one device (`ktx.task_taps`), task
  blocks on several, sparse embedding rows (the default);
* `metabalance_dense`: the same without sparse rows (dense per-task embedding gradients;
  T5's token table then has no tap, so the blocks);
* `metabalance_blocks`: the task blocks on one device too (the default before the taps);
* `metabalance_vjp`: per-task gradients through the VJP engine instead;
* `vanilla_multi`: a loss-weighting balancer, one backward pass of the weighted loss;
* `plain_nodrop`, `metabalance_nodrop`: both with dropout 0 (no per-row dropout keys).

It times them interleaved (`--repeats` rounds of `--steps` steps, order rotated), then,
for the variants named in `--profile`, records `--profile_steps` steps with
`jax.profiler.trace` and reads the trace back (`jax.profiler.ProfileData`): per step, the
device's kernels (count, busy time: the union of their intervals on the device's
streams), its HLO ops grouped by name (fusion kinds, sorts, copies, while loops), and the
host's time in `Trainer.train_step`. On a GPU a step at these sizes is launch-bound: the
kernel count and the gaps between kernels say where the extra time of the balanced step
goes. On the CPU the same summary reads XLA:CPU's thunk events.

    PYTHONPATH=. python tests/benchmarks/step_profile.py --model t5 --t5_size tiny \
        --profile plain,metabalance
    PYTHONPATH=. python tests/benchmarks/step_profile.py --model t5 --t5_size small \
        --dtype bfloat16 --scan_layers --le 512 --ld 128 --rows_per_task 16 \
        --variants plain,metabalance --profile_steps 3     # batch 64, on a GPU

Last line: one JSON object (`variants`: ms per step, median and min, ratio to the
variant's plain counterpart, and the step's outputs, its state and metrics leaves;
`profile`: the summaries, each device's kernels by count and by time).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import optax
from per_task_grads import (  # beside this script
    T5_TINY,
    T,
    _balancer,
    _recsys_setup,
    _t5_setup,
)

VARIANTS = {
    "plain": {},
    "metabalance": {"balancer": "metabalance"},
    "metabalance_dense": {"balancer": "metabalance", "sparse_tables": ()},
    "metabalance_vjp": {"balancer": "metabalance", "grad_method": "vjp"},
    # the task blocks, which "auto" took on one device before the taps (`ktx.task_taps`)
    "metabalance_blocks": {"balancer": "metabalance", "grad_method": "blocks"},
    "vanilla_multi": {"balancer": "vanilla_multi"},
    "plain_nodrop": {"dropout": 0.0},
    "metabalance_nodrop": {"balancer": "metabalance", "dropout": 0.0},
}

T5_SIZES = {"tiny": T5_TINY, "small": {}}  # small: T5.1.1-small, T5Config's defaults


@dataclasses.dataclass
class Run:
    """One variant's compiled step and what its timing loop carries."""

    trainer: Any
    state: Any
    batch: dict
    counts: tuple
    compile_s: float
    outputs: int  # the step's state and metrics leaves: each a buffer written per step


def build(args, name) -> Run:
    """One variant, compiled once (its first step)."""
    from ktx.training.trainer import Trainer

    spec = VARIANTS[name]
    if args.model == "t5":
        model, batch, _ = _t5_setup(args.rows_per_task, spec.get("dropout", 0.1),
                                    {**T5_SIZES[args.t5_size], "dtype": args.dtype,
                                     "scan_layers": args.scan_layers,
                                     "remat_policy": args.remat_policy},
                                    (args.le, args.ld))
    else:
        model, batch, _ = _recsys_setup(args.rows_per_task, spec.get("dropout", 0.5))
    balancer = spec.get("balancer")
    fields = {k: spec[k] for k in ("sparse_tables", "grad_method") if k in spec}
    tr = Trainer(model, optax.adam(1e-3),
                 balancer=None if balancer is None else _balancer(balancer),
                 shared=getattr(model, "shared_param_patterns", None),
                 diagnostics_period=100, **fields)
    counts = (args.rows_per_task,) * T
    state = tr.init_state(jax.random.key(0), batch)
    t0 = time.perf_counter()
    state, m = tr.train_step(state, batch, jax.random.key(1), task_counts=counts)
    jax.block_until_ready(m["loss"])
    return Run(tr, state, batch, counts, time.perf_counter() - t0,
               len(jax.tree.leaves((state, m))))


def _steps(run: Run, n):
    for _ in range(n):
        run.state, m = run.trainer.train_step(run.state, run.batch, jax.random.key(1),
                                              task_counts=run.counts)
    jax.block_until_ready(m["loss"])


def _group(name):
    """An HLO instruction's name without its numeric suffix (`loop_add_fusion.12` ->
    `loop_add_fusion`), or a kernel name cut short."""
    return re.sub(r"(\.\d+)+$", "", name)[:60]


def _union_ns(intervals):
    total, end = 0, -1
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize(xplane, steps, top):
    """Per-step figures of one trace: device kernels and ops, host time in train_step."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xplane)
    out = {"lines": {}}
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            kernels, names, name_ns = [], collections.Counter(), collections.Counter()
            ops, op_ns = collections.Counter(), collections.Counter()
            for line in plane.lines:
                events = list(line.events)
                # HLO ops, where the backend records them; kernels on the streams
                counted = (ops, op_ns) if line.name == "XLA Ops" else \
                    (names, name_ns) if line.name.startswith("Stream") else None
                for e in events if counted else ():
                    counted[0][_group(e.name)] += 1
                    counted[1][_group(e.name)] += e.duration_ns
                if counted and line.name.startswith("Stream"):
                    kernels.extend((e.start_ns, e.end_ns) for e in events)
                out["lines"][f"{plane.name}|{line.name}"] = len(events) / steps
            if kernels:
                span = max(e for _, e in kernels) - min(s for s, _ in kernels)
                out["device"] = {
                    "kernels_per_step": round(len(kernels) / steps, 1),
                    "busy_ms_per_step": round(_union_ns(kernels) / steps / 1e6, 3),
                    "span_ms_per_step": round(span / steps / 1e6, 3),
                }
                out["top_kernels"] = [
                    [k, round(names[k] / steps, 1), round(name_ns[k] / steps / 1e3, 1)]
                    for k, _ in names.most_common(top)]
                out["top_kernels_by_time"] = [
                    [k, round(names[k] / steps, 1), round(v / steps / 1e3, 1)]
                    for k, v in name_ns.most_common(top)]
            if ops:
                out["ops_per_step"] = round(sum(ops.values()) / steps, 1)
                out["top_ops"] = [
                    [k, round(ops[k] / steps, 1), round(op_ns[k] / steps / 1e3, 1)]
                    for k, _ in op_ns.most_common(top)]
        elif plane.name == "/host:CPU":
            host, count = collections.Counter(), collections.Counter()
            for line in plane.lines:
                for e in line.events:
                    # Python frames are named "$file.py:line function"; keep the step's
                    # dispatch only (the trace's own start and stop are not the step's)
                    if e.name.startswith("$"):
                        if e.name.endswith(" train_step") and "trainer.py" in e.name:
                            host["train_step"] += e.duration_ns
                            count["train_step"] += 1
                        continue
                    host[_group(e.name)] += e.duration_ns
                    count[_group(e.name)] += 1
            out["host_top"] = [[k, round(count[k] / steps, 1), round(v / steps / 1e3, 1)]
                               for k, v in host.most_common(top)]
            # the Python call that dispatches the step (its compiled call is asynchronous)
            out["host_train_step_ms"] = round(host["train_step"] / steps / 1e6, 3)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("t5", "recsys"), default="t5")
    p.add_argument("--t5_size", choices=tuple(T5_SIZES), default="tiny")
    p.add_argument("--le", type=int, default=32, help="T5 encoder length")
    p.add_argument("--ld", type=int, default=8, help="T5 decoder length")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="T5 activation dtype (T5Config.dtype)")
    p.add_argument("--scan_layers", action="store_true", help="T5 layers under lax.scan")
    p.add_argument("--remat_policy", choices=("none", "minimal", "dots", "full"),
                   default="none", help="T5 rematerialization (T5Config.remat_policy)")
    p.add_argument("--rows_per_task", type=int, default=None,
                   help="default: 4 (T5), 64 (recsys), as per_task_grads.py")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", default="plain,metabalance",
                   help="variants to trace ('' for none)")
    p.add_argument("--profile_steps", type=int, default=10)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--trace_dir", default=None, help="keep the traces here")
    args = p.parse_args(argv)
    if args.rows_per_task is None:
        args.rows_per_task = 4 if args.model == "t5" else 64
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; accepted: {sorted(VARIANTS)}")
    runs = {}
    for name in names:
        runs[name] = build(args, name)
        print(f"compiled {name}: {runs[name].compile_s:.1f} s", flush=True)
    times = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            _steps(runs[name], args.steps)
            times[name].append((time.perf_counter() - t0) / args.steps)
    variants = {}
    for name in names:
        med = statistics.median(times[name])
        base = "plain_nodrop" if name.endswith("_nodrop") else "plain"
        row = {"median_ms": round(med * 1e3, 3), "min_ms": round(min(times[name]) * 1e3, 3),
               "outputs": runs[name].outputs}
        if base in times and name != base:
            row["ratio"] = round(med / statistics.median(times[base]), 3)
        variants[name] = row
        print(json.dumps({name: row}), flush=True)
    profile = {}
    scratch = tempfile.TemporaryDirectory(prefix="ktx_step_profile_")  # without --trace_dir
    trace_root = args.trace_dir or scratch.name
    for name in [v for v in args.profile.split(",") if v in runs]:
        _steps(runs[name], 2)
        directory = os.path.join(trace_root, name)
        with jax.profiler.trace(directory):
            _steps(runs[name], args.profile_steps)
        files = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
        profile[name] = summarize(max(files, key=os.path.getmtime), args.profile_steps,
                                  args.top)
        print(json.dumps({"profile": {name: profile[name]}}), flush=True)
    scratch.cleanup()
    print(json.dumps({
        "benchmark": "step_profile", "model": args.model,
        "t5_size": args.t5_size if args.model == "t5" else None,
        "t5_config": ({"dtype": args.dtype, "scan_layers": args.scan_layers,
                       "remat_policy": args.remat_policy, "lengths": [args.le, args.ld]}
                      if args.model == "t5" else None),
        "rows_per_task": args.rows_per_task, "device": str(jax.devices()[0]),
        "jax": jax.__version__, "variants": variants, "profile": profile}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
