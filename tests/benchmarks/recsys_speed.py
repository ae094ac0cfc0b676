"""Speed of the MetaBalance recommendation workload on this machine (Tmall data).

Measures (1) one training epoch of the shared-bottom model (batch 256, one negative per
positive) with Vanilla-Multi and with MetaBalance on one device, on the study's training
path (`Trainer.train_steps` via `recsys_study.study_trainer`: 64 steps per compiled call, state from
`ktx.training.trainer.Trainer`, sparse per-task embedding gradients) and through `ktx train`'s
own loop (`ktx.runs.train.train` with `steps_per_call=64`, `norm_metrics=False` as
`runs/recsys_train.gin`: prefetcher, hooks, metrics), projected from the second of two
`--period`-step log periods, interleaved with the scanned path (`2 * --period` steps) over
`--rounds` rounds (goal: median at most 1.05x the scanned path's);
(2) the full-ranking evaluation of all Tmall test users over all 11,953 items (each
user's training items excluded, as in the study; `ktx.metrics.ranking.full_ranking` with
its default chunk sizes), `--ranking_repeats` times, and the GFLOP/s it achieves next to
a float32 matmul peak (a 2048^3 GEMM) measured in the same run: `--segments` rankings of
the first `--segment_users` test users (a few seconds each), each between two peak
measurements, give the share of the peak (the ranking's GFLOP/s over the mean of the two
peaks around it; min / median / max over segments). On a shared machine the peak moves
with the load from second to second, which is why the share is taken over short
segments rather than the one-minute full ranking.
On a CPU host the ranking runs on one XLA CPU device per core (`--ranking_devices`,
default `os.cpu_count()`; a child process started with
`--xla_force_host_platform_device_count`), the users split over the mesh's `data` axis
as `ktx eval` splits them given such a mesh; the matmul peak is then the higher of one GEMM
on the first device (which XLA runs on every core) and one GEMM per device at once.
`--ranking_devices 1` ranks on one device.
Targets: MetaBalance epoch <= 1.3x Vanilla-Multi's; ranking at >= 60% of the matmul
peak (median over segments). The output is one JSON line on stdout, last (progress goes
to stderr). On a CPU, glibc keeps the host memory XLA frees for the next step, as `ktx
train | eval` sets it (`ktx.training.host_malloc`; `host_malloc` in the JSON;
`KTX_HOST_MALLOC=system` for glibc's defaults).

    KTX_DATA_DIR=../shared/data python tests/benchmarks/recsys_speed.py \
        [--train_steps N] [--eval_users N] [--ranking_only] [--ranking_repeats N] \
        [--segments N] [--segment_users N] [--ranking_devices N]

`--train_steps` times N steps after compilation and scales to the epoch (0: the whole
epoch); `--eval_users` ranks only the first N test users and scales to all of them
(0: all); `--ranking_only` skips the training timings, `--training_only` the ranking. Scaled figures are marked
`*_projected` in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np

from ktx import optim, partitioning
from ktx.studies import recsys as recsys_study
from ktx.data import recsys as recsys_data
from ktx.metrics import ranking
from ktx.training import host_malloc


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of a float32 n^3 GEMM on the first device; with several devices, the
    higher of that and one GEMM per device at once (the peak the ranking is held to)."""
    def gflops(a, count):
        f = jax.jit(lambda a: a @ a)
        f(a).block_until_ready()
        t = time.perf_counter()
        for _ in range(repeats):
            f(a).block_until_ready()
        return count * 2 * n**3 * repeats / (time.perf_counter() - t) / 1e9

    best = gflops(jnp.ones((n, n), jnp.float32), 1)
    d = len(jax.devices())
    if d > 1:
        mesh = partitioning.create_mesh(1)
        a = jax.device_put(jnp.ones((d, n, n), jnp.float32),
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
        best = max(best, gflops(a, d))
    return best


def epoch_seconds(data, balancer, steps: int, seed: int = 0, steps_per_call: int = 64) -> tuple[float, int]:
    """Seconds of one epoch through `Trainer.train_steps` (the study's training
    path: `steps_per_call` steps per compiled call, sparse per-task table gradients),
    batches built on the host inside the timed region."""
    model = recsys_study.build_model(data)
    inp = recsys_data.RecsysTrainInput(data, batch_size=256, num_negatives=1, seed=seed)
    trainer = recsys_study.study_trainer(model, recsys_study.adam_l2(), balancer)
    state = trainer.init_state(jax.random.key(seed), inp.get_batch(0))
    counts = inp.task_counts(0)

    def run(state, batches, rng):
        return trainer.train_steps(state, batches, rng, counts)

    rng = jax.random.key(seed + 1)

    def block(lo, k):
        bs = [inp.get_batch(s) for s in range(lo, lo + k)]
        return {name: np.stack([b[name] for b in bs]) for name in bs[0]}

    state, m = run(state, block(0, steps_per_call), rng)  # compile and warm up
    jax.block_until_ready(m["loss"])
    n = inp.steps_per_epoch if steps <= 0 else min(steps, inp.steps_per_epoch)
    n = max(steps_per_call, n - n % steps_per_call)
    t = time.perf_counter()
    for lo in range(steps_per_call, steps_per_call + n, steps_per_call):
        state, m = run(state, block(lo, steps_per_call), rng)
    jax.block_until_ready(m["loss"])
    per_step = (time.perf_counter() - t) / n
    return per_step * inp.steps_per_epoch, inp.steps_per_epoch


def loop_epoch_seconds(data, balancer, steps_per_call: int = 64, period: int = 1024,
                       seed: int = 0) -> float:
    """Seconds of one epoch through `ktx train`'s own loop (`ktx.runs.train.train`: the
    prefetcher, the hooks, metrics.jsonl), `steps_per_call` steps per compiled call:
    two log periods of `period` steps, the epoch projected from the second period's
    `steps_per_s` (the first holds the compilation)."""
    import tempfile

    from ktx.runs.train import train

    model = recsys_study.build_model(data)
    inp = recsys_data.RecsysTrainInput(data, batch_size=256, num_negatives=1, seed=seed)
    with tempfile.TemporaryDirectory() as model_dir:
        train(model=model, train_input=inp, model_dir=model_dir,
              optimizer=recsys_study.adam_l2(), balancer=balancer,
              shared=model.shared_param_patterns if balancer is not None else None,
              sparse_tables=recsys_study.SPARSE_TABLES, train_steps=2 * period,
              log_period=period, checkpoint_period=10 * period, seed=seed,
              steps_per_call=steps_per_call, norm_metrics=False)  # as runs/recsys_train.gin
        with open(os.path.join(model_dir, "metrics.jsonl")) as f:
            rows = [json.loads(x) for x in f]
    rate = [r for r in rows if r.get("task") == "all" and r["step"] == 2 * period][0]["steps_per_s"]
    return inp.steps_per_epoch / rate


def ranking_speed(data, eval_users: int = 0, repeats: int = 3, segment_users: int = 2048,
                  segments: int = 8) -> dict:
    """Full ranking of the test users (`eval_users` > 0: the first N, scaled to all),
    `repeats` times, and its share of the matmul peak from `segments` rankings of
    `segment_users` users, each between two peak measurements (a few seconds apart, so
    that both see the same load on a shared machine). The users are split over a mesh of
    every device of this process when there are several."""
    mesh = partitioning.create_mesh(1) if len(jax.devices()) > 1 else None
    model = recsys_study.build_model(data)
    dummy = {"user": np.zeros(1, np.int32), "item": np.zeros(1, np.int32)}
    params = flax.linen.unbox(model.init_variables(jax.random.key(0), dummy)["params"])
    test = data.test
    users = np.unique(test[:, 0])
    all_users = len(users)
    if eval_users > 0:
        test = test[np.isin(test[:, 0], users[:eval_users])]
    exclude = recsys_data.training_exclusions(data, "all")
    kw = dict(num_users=data.num_users, num_items=data.num_items, exclude=exclude, mesh=mesh)
    segment = test[np.isin(test[:, 0], users[:segment_users])]
    # Compile first (same shapes as the timed calls) so compile time is not counted.
    ranking.full_ranking(model, params, heldout=test, **kw)
    ranking.full_ranking(model, params, heldout=segment, **kw)
    flops = model.rank_flops_per_pair()
    full = []
    for r in range(repeats):
        stats: dict = {}
        ranking.full_ranking(model, params, heldout=test, stats=stats, **kw)
        full.append({"seconds": stats["seconds"] * all_users / stats["users"],
                     "gflops": stats["pairs"] * flops / stats["seconds"] / 1e9})
        print(f"full ranking {r}: {full[-1]}", file=sys.stderr, flush=True)
    runs = []
    for r in range(segments):
        before = matmul_peak()
        stats = {}
        ranking.full_ranking(model, params, heldout=segment, stats=stats, **kw)
        after = matmul_peak()
        gflops = stats["pairs"] * flops / stats["seconds"] / 1e9
        runs.append({"gflops": gflops, "peak": (before + after) / 2,
                     "share": gflops / ((before + after) / 2)})
        print(f"segment {r} ({stats['users']} users, {stats['seconds']:.2f} s): {runs[-1]}",
              file=sys.stderr, flush=True)
    suffix = "" if eval_users <= 0 else "_projected"

    def stat(rows, key, digits=1):
        v = np.array([x[key] for x in rows])
        return {"min": round(float(v.min()), digits), "median": round(float(np.median(v)), digits),
                "max": round(float(v.max()), digits)}

    share = float(np.median([x["share"] for x in runs]))
    return {
        "ranking_devices": len(jax.devices()),
        "eval_users": len(np.unique(test[:, 0])), "test_users": all_users, "items": data.num_items,
        "user_chunk": stats["user_chunk"], "item_block": stats["item_block"],
        f"full_ranking_seconds{suffix}": stat(full, "seconds"),
        "full_ranking_gflops": stat(full, "gflops"),
        "segment_users": stats["users"],
        "segment_gflops": stat(runs, "gflops"),
        "segment_matmul_peak_gflops": stat(runs, "peak"),
        "ranking_share_of_matmul_peak": stat(runs, "share", 3),
        "best_segment_over_best_peak": round(max(x["gflops"] for x in runs) / max(x["peak"] for x in runs), 3),
        "flops_per_pair": flops,
        "meets_ranking_target": share >= 0.6,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default=None)
    ap.add_argument("--train_steps", type=int, default=0)
    ap.add_argument("--eval_users", type=int, default=0)
    ap.add_argument("--ranking_only", action="store_true")
    ap.add_argument("--training_only", action="store_true", help="skip the ranking timings")
    ap.add_argument("--ranking_repeats", type=int, default=3)
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--segment_users", type=int, default=2048)
    ap.add_argument("--ranking_devices", type=int, default=0,
                    help="XLA CPU devices the ranking runs on (0: one per core on a CPU host)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds of the scanned path and ktx train's loop")
    ap.add_argument("--period", type=int, default=1024,
                    help="ktx train's log period (two are run; the second is timed)")
    args = ap.parse_args()
    # As `ktx train | eval` on a CPU: freed host memory is kept for the next step
    # ($KTX_HOST_MALLOC, ktx.training.host_malloc; a ranking child inherits the variable).
    malloc = host_malloc.configure_on_cpu()
    want = args.ranking_devices or (os.cpu_count() or 1)
    # The ranking runs in a child process when it needs another CPU device count.
    rank_in_child = (not args.training_only and jax.devices()[0].platform == "cpu"
                     and want != len(jax.devices()))
    if not (args.ranking_only and rank_in_child):  # else only the child reads the data
        directory = None if args.data_dir is None else os.path.join(args.data_dir, "recsys", "tmall")
        data = recsys_data.load_tmall_pairs(directory)
    out: dict = {"benchmark": "recsys_speed", "devices": str(jax.devices()[0].platform),
                 "cpus": os.cpu_count(), "host_malloc": malloc}
    if not args.ranking_only:
        out["matmul_peak_gflops"] = round(matmul_peak(), 1)
        suffix = "" if args.train_steps <= 0 else "_projected"
        vm, steps = epoch_seconds(data, optim.vanilla_multi(), args.train_steps)
        mb, _ = epoch_seconds(data, optim.metabalance(relax_factor=0.7, num_tasks=len(data.behaviours)), args.train_steps)
        out.update({"steps_per_epoch": steps, f"epoch_seconds_vanilla_multi{suffix}": round(vm, 2),
                    f"epoch_seconds_metabalance{suffix}": round(mb, 2),
                    "metabalance_over_vanilla": round(mb / vm, 3),
                    "meets_epoch_ratio_target": mb / vm <= 1.3})
        # `ktx train` (steps_per_call=64, as runs/recsys_train.gin) against the scanned path,
        # interleaved over `--rounds` (the load of a shared machine moves between runs).
        balancers = {"vanilla_multi": optim.vanilla_multi, "metabalance": lambda: optim.metabalance(
            relax_factor=0.7, num_tasks=len(data.behaviours))}
        times = {(path, name): [] for path in ("scanned", "ktx_train") for name in balancers}
        for _ in range(args.rounds):
            for name, make in balancers.items():
                times["scanned", name].append(epoch_seconds(data, make(), args.period * 2)[0])
                times["ktx_train", name].append(loop_epoch_seconds(data, make(), period=args.period))
        for name in balancers:
            scanned, loop = times["scanned", name], times["ktx_train", name]
            out[f"epoch_seconds_ktx_train_{name}_projected"] = {
                "min": round(min(loop), 2), "median": round(float(np.median(loop)), 2)}
            out[f"epoch_seconds_scanned_{name}_projected"] = {
                "min": round(min(scanned), 2), "median": round(float(np.median(scanned)), 2)}
            out[f"ktx_train_over_scanned_{name}"] = round(
                float(np.median(loop) / np.median(scanned)), 3)
        out["meets_ktx_train_target"] = all(
            out[f"ktx_train_over_scanned_{name}"] <= 1.05 for name in balancers)
        print(f"training: {out}", file=sys.stderr, flush=True)
    if not args.training_only:
        if rank_in_child:
            out.update(_ranking_in_child(args, want))
        else:
            out.update(ranking_speed(data, args.eval_users, args.ranking_repeats,
                                     args.segment_users, args.segments))
    print(json.dumps(out))


def _ranking_in_child(args, devices: int) -> dict:
    """The ranking timings of a child process with `devices` XLA CPU devices (the
    device count is fixed when JAX starts, and the training timings run on one)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip())
    cmd = [sys.executable, os.path.abspath(__file__), "--ranking_only",
           "--ranking_devices", str(devices), "--eval_users", str(args.eval_users),
           "--ranking_repeats", str(args.ranking_repeats), "--segments", str(args.segments),
           "--segment_users", str(args.segment_users)]
    if args.data_dir is not None:
        cmd += ["--data_dir", args.data_dir]
    print(f"ranking on {devices} CPU devices: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, check=True, text=True)
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: v for k, v in child.items() if k not in ("benchmark", "devices", "cpus")}


if __name__ == "__main__":
    main()
