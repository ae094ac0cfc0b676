"""Speed of the MetaBalance recommendation workload on this machine (Tmall data).

Measures (1) one training epoch of the shared-bottom model (batch 256, one negative per
positive) with Vanilla-Multi and with MetaBalance on one device, on the study's training
path (`Trainer.train_steps` via `recsys_study.study_trainer`: 64 steps per compiled call, state from
`ktx.training.trainer.Trainer`, sparse per-task embedding gradients) and, projected from 500
steps, on the `ktx train` loop's path (one compiled step per call, prefetched batches);
(2) the full-ranking evaluation of the Tmall test users over all 11,953 items (each
user's training items excluded, as in the study), with the GFLOP/s it achieves next to
a float32 matmul peak (a 2048^3 GEMM) measured in the same run, before and after.
Targets: MetaBalance epoch <= 1.3x Vanilla-Multi's; full ranking < 120 s. The output
is one JSON line on stdout (progress goes to stderr).

    KTX_DATA_DIR=../shared/data python tests/benchmarks/recsys_speed.py \
        [--train_steps N] [--eval_users N]

`--train_steps` times N steps after compilation and scales to the epoch (0: the whole
epoch); `--eval_users` ranks only the first N test users and scales to all of them
(0: all). Scaled figures are marked `*_projected` in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np

from ktx import optim
from ktx.studies import recsys as recsys_study
from ktx.data import recsys as recsys_data
from ktx.metrics import ranking
from ktx.runs.train import Prefetcher
from ktx.training.trainer import Trainer
from ktx import partitioning


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(repeats):
        f(a).block_until_ready()
    return 2 * n**3 * repeats / (time.perf_counter() - t) / 1e9


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


def loop_epoch_seconds(data, balancer, steps: int = 500, seed: int = 0) -> float:
    """Seconds of one epoch through the `ktx train` loop's path (one compiled
    `Trainer.train_step` per step, batches from the background `Prefetcher`), projected
    from `steps` timed steps after the first."""
    model = recsys_study.build_model(data)
    inp = recsys_data.RecsysTrainInput(data, batch_size=256, num_negatives=1, seed=seed)
    mesh = partitioning.create_mesh(1, devices=jax.local_devices()[:1])
    trainer = Trainer(model, recsys_study.adam_l2(), mesh=mesh, balancer=balancer,
                      shared=model.shared_param_patterns if balancer is not None else None,
                      sparse_tables=recsys_study.SPARSE_TABLES)
    state = trainer.init_state(jax.random.key(seed), inp.get_batch(0))
    rng = jax.random.key(seed + 1)
    prefetcher = Prefetcher(inp, trainer, 0, steps + 1)
    try:
        batches = iter(prefetcher)
        _, batch, counts, _ = next(batches)
        state, m = trainer.train_step(state, batch, rng, counts)  # compile
        jax.block_until_ready(m["loss"])
        t = time.perf_counter()
        for _, batch, counts, _ in batches:
            state, m = trainer.train_step(state, batch, rng, counts)
        jax.block_until_ready(m["loss"])
        return (time.perf_counter() - t) / steps * inp.steps_per_epoch
    finally:
        prefetcher.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default=None)
    ap.add_argument("--train_steps", type=int, default=0)
    ap.add_argument("--eval_users", type=int, default=0)
    args = ap.parse_args()
    directory = None if args.data_dir is None else os.path.join(args.data_dir, "recsys", "tmall")
    data = recsys_data.load_tmall_pairs(directory)
    out: dict = {"benchmark": "recsys_speed", "devices": str(jax.devices()[0].platform),
                 "cpus": os.cpu_count()}
    out["matmul_peak_gflops"] = round(matmul_peak(), 1)
    suffix = "" if args.train_steps <= 0 else "_projected"
    vm, steps = epoch_seconds(data, optim.vanilla_multi(), args.train_steps)
    mb, _ = epoch_seconds(data, optim.metabalance(relax_factor=0.7, num_tasks=len(data.behaviours)), args.train_steps)
    out.update({"steps_per_epoch": steps, f"epoch_seconds_vanilla_multi{suffix}": round(vm, 2),
                f"epoch_seconds_metabalance{suffix}": round(mb, 2),
                "metabalance_over_vanilla": round(mb / vm, 3)})
    out["epoch_seconds_ktx_train_loop_vanilla_multi_projected"] = round(
        loop_epoch_seconds(data, optim.vanilla_multi()), 2)
    out["epoch_seconds_ktx_train_loop_metabalance_projected"] = round(
        loop_epoch_seconds(data, optim.metabalance(relax_factor=0.7, num_tasks=len(data.behaviours))), 2)
    print(f"training: {out}", file=sys.stderr, flush=True)

    model = recsys_study.build_model(data)
    dummy = {"user": np.zeros(1, np.int32), "item": np.zeros(1, np.int32)}
    params = flax.linen.unbox(model.init_variables(jax.random.key(0), dummy)["params"])
    test = data.test
    all_users = len(np.unique(test[:, 0]))
    if args.eval_users > 0:
        test = test[np.isin(test[:, 0], np.unique(test[:, 0])[:args.eval_users])]
    exclude = recsys_data.training_exclusions(data, "all")
    # Compile on a few users first so compile time is not counted.
    ranking.full_ranking(model, params, num_users=data.num_users, num_items=data.num_items,
                         heldout=test[:64], exclude=exclude)
    stats: dict = {}
    ranking.full_ranking(model, params, num_users=data.num_users, num_items=data.num_items,
                         heldout=test, exclude=exclude, stats=stats)
    gflops = stats["pairs"] * model.rank_flops_per_pair() / stats["seconds"] / 1e9
    suffix = "" if args.eval_users <= 0 else "_projected"
    out.update({
        "eval_users": stats["users"], "test_users": all_users, "items": data.num_items,
        f"full_ranking_seconds{suffix}": round(stats["seconds"] * all_users / stats["users"], 1),
        "full_ranking_gflops": round(gflops, 1),
        "flops_per_pair": model.rank_flops_per_pair(),
        "matmul_peak_gflops_after": round(matmul_peak(), 1),
        "ranking_share_of_matmul_peak": round(gflops / out["matmul_peak_gflops"], 3),
        "meets_epoch_ratio_target": out["metabalance_over_vanilla"] <= 1.3,
        "meets_ranking_target": stats["seconds"] * all_users / stats["users"] < 120.0,
    })
    print(json.dumps(out))


if __name__ == "__main__":
    main()
