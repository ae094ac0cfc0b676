"""Kernels a GPU launches per training step, counted on a machine without a GPU.

At the benchmark shapes a GPU step is launch-bound (docs/balancing.md, "On a GPU"): its
time follows the number of kernels the host launches, not their arithmetic, so the
balanced step's extra launches are what its ratio to the plain step pays for there. This
compiles the steps `per_task_grads.py` times (`Trainer.train_step` as `ktx train` runs it,
the step without diagnostics; T5.1.1-tiny and the recommendation model, T=4, the same
optimizers and sparse tables) ahead of time for an NVIDIA H200, deviceless (the CUDA
plugin's topology built from a target description, `H200_TARGET`), reads the optimized
HLO and counts the instructions that launch: each fusion (a Triton GEMM is one), copy,
custom call (cuBLAS, solvers), sort and scatter of the entry computation, those of a
`while` body and condition times the loop's known trip count (a loop without one is
counted once and reported in `unbounded_loops`), of a `conditional` its largest branch.

Checked against `jax.profiler` traces of the same steps on an H200 lent to a session
(2026-11-28, the code of commit f92e5e2, jax 0.11.2 there, 0.10.2 here): counted / traced
kernels per step, T5-tiny plain 611 / 612 and MetaBalance 1,312 / 1,295, recsys plain
137 / 144 and MetaBalance 256 / 263 (within 1.3% and 5%).

Needs the CUDA plugin at the installed jax's version (not a ktx dependency):

    pip install "jax-cuda12-plugin==$(python -c 'import jax; print(jax.__version__)')" \\
        "jax-cuda12-pjrt==$(python -c 'import jax; print(jax.__version__)')"
    JAX_PLATFORMS=cpu python tests/benchmarks/gpu_launches.py [--balancers metabalance,pcgrad]

Last line: one JSON object, `launches.<model>.<config>` and `ratio.<model>.<balancer>`
(balanced launches / plain launches).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the GPU is only a compile target here

import jax  # noqa: E402
import numpy as np  # noqa: E402
from per_task_grads import (  # noqa: E402  (beside this script)
    T,
    _recsys_setup,
    _t5_setup,
    trainer,
)

import ktx.optim as ko  # noqa: E402
from ktx import partitioning  # noqa: E402

# The H200 as XLA's GPU compiler sees it (`stream_executor::GpuTargetConfigProto`): the
# vendor's figures for the SXM part (132 SMs, 1.98 GHz boost, 4.8 TB/s, 50 MiB L2, 141 GB),
# Hopper's per-SM limits, CUDA 12.8 and cuDNN 9.7 as the compiler's assumed runtime.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150323855360
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability { major: 9 minor: 0 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200"
"""

# Instructions that name or regroup buffers and launch nothing.
NO_LAUNCH = frozenset({
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
    "opt-barrier", "partition-id", "replica-id", "add-dependency",
})

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")


def _opcode(line: str) -> tuple[str, str] | None:
    """`(opcode, rest)` of one HLO instruction line, or None for a non-instruction."""
    body = line.strip()
    if body.startswith("ROOT "):
        body = body[5:]
    if not body.startswith("%") or " = " not in body:
        return None
    rhs = body.split(" = ", 1)[1]
    if rhs.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                rhs = rhs[i + 1:].lstrip()
                break
    else:
        rhs = rhs.split(" ", 1)[1] if " " in rhs else ""
    m = re.match(r"([\w\-]+)\(", rhs)
    return (m.group(1), rhs) if m else None


def parse_computations(text: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
    """The module's computations (`name -> [(opcode, rest of line)]`) and the entry's name."""
    comps: dict[str, list[tuple[str, str]]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            op = _opcode(line)
            if op is not None:
                comps[current].append(op)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def count_launches(text: str) -> dict:
    """Launching instructions of one compiled module's HLO text (see the module docstring):
    `{"launches": n, "by_opcode": {...}, "unbounded_loops": k}`."""
    comps, entry = parse_computations(text)
    unbounded = 0

    def walk(name: str) -> Counter:
        nonlocal unbounded
        counts: Counter = Counter()
        for op, rest in comps[name]:
            if op in NO_LAUNCH:
                continue
            if op == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                if trip is None:
                    unbounded += 1
                n = int(trip.group(1)) if trip else 1
                for key in ("condition", "body"):
                    inner = walk(re.search(rf"{key}=%?([\w.\-]+)", rest).group(1))
                    counts.update({k: v * n for k, v in inner.items()})
            elif op == "call":
                counts.update(walk(re.search(r"to_apply=%?([\w.\-]+)", rest).group(1)))
            elif op == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
                names = ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches
                         else re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", rest))
                counts["conditional"] += 1
                counts.update(max((walk(b) for b in names), key=lambda c: sum(c.values())))
            else:
                counts[op] += 1
        return counts

    by_op = walk(entry)
    return {"launches": sum(by_op.values()), "by_opcode": dict(by_op.most_common()),
            "unbounded_loops": unbounded}


def gpu_devices(target: str = H200_TARGET) -> list:
    """One deviceless CUDA device (the plugin's topology from `target`), or SystemExit
    with the install line when the plugin is missing."""
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(platform="cuda", topology_name="",
                                            target_config=target, topology="1x1x1")
    except Exception as e:  # noqa: BLE001 - no plugin, or one at another jax version
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SystemExit(
            f"gpu_launches: cannot build a CUDA topology ({first}); install the plugin at "
            f"jax {jax.__version__}: pip install jax-cuda12-plugin=={jax.__version__} "
            f"jax-cuda12-pjrt=={jax.__version__}") from e
    return list(desc.devices)


def compiled_text(model, batch, counts, balancer, sparse, devices) -> str:
    """The optimized HLO of the step `per_task_grads.trainer_path` times (no diagnostics)."""
    mesh = partitioning.create_mesh(1, devices=devices)
    tr = trainer(model, balancer, sparse, mesh)
    data = partitioning.data_sharding(mesh)
    spec = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=data)
            for k, v in batch.items()}
    state, _ = tr.create_abstract_state(spec)
    rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype,
                               sharding=partitioning.replicated_sharding(mesh))
    lowered = tr.lower_train_step(state, spec, rng,
                                  task_counts=None if balancer is None else counts,
                                  log_diagnostics=False)
    return lowered.compile().as_text()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--balancers", default="", help="comma-separated subset of ktx.optim.BALANCERS")
    p.add_argument("--models", default="t5_tiny,recsys")
    p.add_argument("--recsys_rows_per_task", type=int, default=64)
    p.add_argument("--t5_rows_per_task", type=int, default=4)
    p.add_argument("--dump_dir", default=None, help="also write each step's HLO text here")
    args = p.parse_args(argv)
    names = [b for b in args.balancers.split(",") if b] or list(ko.BALANCERS)
    unknown = sorted(set(names) - set(ko.BALANCERS))
    if unknown:
        raise SystemExit(f"--balancers: unknown {unknown}; accepted: {sorted(ko.BALANCERS)}")
    setups = {"t5_tiny": (_t5_setup, args.t5_rows_per_task),
              "recsys": (_recsys_setup, args.recsys_rows_per_task)}
    models = [m for m in args.models.split(",") if m]
    if not models or set(models) - set(setups):
        raise SystemExit(f"--models={args.models!r}; accepted: a comma-separated subset of {sorted(setups)}")
    devices = gpu_devices()
    launches, ratio, detail = {}, {}, {}
    for key in models:
        setup, per_task = setups[key]
        model, batch, sparse = setup(per_task)
        counts = (per_task,) * T
        launches[key], detail[key] = {}, {}
        for name in ["plain", *names]:
            text = compiled_text(model, batch, counts, None if name == "plain" else name, sparse,
                                 devices)
            if args.dump_dir:
                os.makedirs(args.dump_dir, exist_ok=True)
                with open(os.path.join(args.dump_dir, f"{key}_{name}.hlo.txt"), "w") as f:
                    f.write(text)
            c = count_launches(text)
            launches[key][name], detail[key][name] = c["launches"], c
            print(json.dumps({key: {name: c}}), file=sys.stderr, flush=True)
        ratio[key] = {n: round(launches[key][n] / launches[key]["plain"], 3) for n in names}
    print(json.dumps({"benchmark": "gpu_launches", "target": "NVIDIA H200 (deviceless)",
                      "jax": jax.__version__, "num_tasks": T, "launches": launches,
                      "ratio": ratio,
                      "unbounded_loops": {k: {n: d["unbounded_loops"] for n, d in v.items()
                                              if d["unbounded_loops"]} for k, v in detail.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
