"""Input pipeline throughput against the train step rate of T5.1.1 small.

Builds `ktx.data.MultiTaskInput` for the GLUE+SuperGLUE mixture with the T5 SentencePiece
vocabulary of `$KTX_DATA_DIR/vocab` at T5 lengths (512/32; `--tiny`: 128/16), measures
`get_batch` batches/s (task-partitioned and sampled layouts), then times a jitted train
step (loss, gradient, Adafactor update) of `t5_1_1_small` on the same kind of batch. The
target is input throughput >= 10x the train step's, so input never bounds training.

The train step is timed at `--train_batch_size` rows (a full batch of T5.1.1 small is
minutes per step on a CPU); both rates are compared per example (rows/s). Tasks of the
mixture whose training files are absent are listed under `tasks_missing` and left out.

Usage: KTX_DATA_DIR=../shared/data python tests/benchmarks/input_pipeline.py [--tiny]
Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time



def _available_tasks(names):
    import seqio

    present, missing = [], {}
    for name in names:
        task = seqio.get_mixture_or_task(name)
        if "train" not in task.splits:
            missing[name] = "no train split"
            continue
        try:
            next(iter(task.get_dataset(split="train", shuffle=False).take(1)))
            present.append(name)
        except Exception as e:  # a missing data file: reported, not hidden
            missing[name] = f"{type(e).__name__}: {str(e)[:120]}"
    return present, missing


def _time_batches(inp, steps):
    inp.get_batch(0)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        inp.get_batch(step)
    return steps / (time.perf_counter() - start)


def _train_step_rate(batch, num_tasks, steps):
    import jax
    import optax

    from ktx.models import t5
    from ktx.models.seq2seq import EncoderDecoderModel

    model = EncoderDecoderModel(t5.T5Config(dropout_rate=0.0), num_tasks=num_tasks)
    params = model.init_variables(jax.random.PRNGKey(0), batch)["params"]
    tx = optax.adafactor(1e-3)
    opt_state = tx.init(params)

    @jax.jit
    def step_fn(params, opt_state, batch):
        (loss, _), grads = jax.value_and_grad(model.loss_fn, has_aux=True)(params, batch, None, False)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state, loss = step_fn(params, opt_state, batch)  # compile
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for _ in range(steps):
        params, opt_state, loss = step_fn(params, opt_state, batch)
    jax.block_until_ready(loss)
    return steps / (time.perf_counter() - start), jax.devices()[0].platform


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixture", default="glue_super_glue_proportional")
    parser.add_argument("--tiny", action="store_true", help="128/16 instead of 512/32")
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200, help="get_batch calls timed")
    parser.add_argument("--train_batch_size", type=int, default=8)
    parser.add_argument("--train_steps", type=int, default=3)
    parser.add_argument("--pack", action="store_true")
    parser.add_argument("--cache_dir", default=None)
    args = parser.parse_args(argv)

    import seqio

    import ktx.tasks  # noqa: F401  (registers the tasks)
    from ktx.data import mixing
    from ktx.data.pipeline import MultiTaskInput, mixture_task_names

    lengths = {"inputs": 128, "targets": 16} if args.tiny else {"inputs": 512, "targets": 32}
    present, missing = _available_tasks(mixture_task_names(args.mixture))
    if not present:
        raise SystemExit(f"no task of {args.mixture!r} has its training files: {missing}")
    bench_name = f"{args.mixture}_available_for_benchmark"
    if bench_name in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove(bench_name)
    seqio.MixtureRegistry.add(bench_name, [(name, 1.0) for name in present])
    # T5's examples-proportional rates with cap K = 2**19, from the cached task sizes.
    rates = mixing.Mixing("proportional", cap=2**19)

    start = time.perf_counter()
    inp = MultiTaskInput(bench_name, lengths, args.batch_size, mixing=rates, pack=args.pack,
                         cache_dir=args.cache_dir)
    build_s = time.perf_counter() - start
    partitioned = _time_batches(inp, args.steps)
    sampled = _time_batches(inp.replace(layout="sampled"), args.steps)

    small = inp.replace(batch_size=args.train_batch_size, layout="sampled")
    train_rate, platform = _train_step_rate(small.get_batch(0), inp.num_tasks, args.train_steps)

    input_rows = partitioned * args.batch_size
    train_rows = train_rate * args.train_batch_size
    result = {
        "benchmark": "input_pipeline",
        "mixture": args.mixture,
        "tasks": len(present),
        "tasks_missing": missing,
        "feature_lengths": lengths,
        "batch_size": args.batch_size,
        "pack": args.pack,
        "rows_cached": int(sum(inp.task_sizes)),
        "cache_mb": round(inp.cache_nbytes / 2**20, 1),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "build_s": round(build_s, 1),
        "batches_per_s": round(partitioned, 1),
        "batches_per_s_sampled": round(sampled, 1),
        "train_platform": platform,
        "train_batch_size": args.train_batch_size,
        "t5_1_1_small_steps_per_s": round(train_rate, 3),
        "input_rows_per_s": round(input_rows, 1),
        "train_rows_per_s": round(train_rows, 2),
        "ratio": round(input_rows / train_rows, 1),
        "target_ratio": 10,
        "meets_target": bool(input_rows / train_rows >= 10),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["meets_target"] else 1)
