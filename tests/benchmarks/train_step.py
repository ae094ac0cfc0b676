"""Train-step throughput of T5.1.1 tiny and small on this machine, and the share of step
time spent waiting for input.

    python tests/benchmarks/train_step.py [--steps 5] [--batch_size 8] [--models tiny,small]

Input is the real `ktx.data.pipeline.MultiTaskInput` over the synthetic quickstart
mixture (byte vocabulary, no files), task-partitioned. The loop is `ktx.runs.train`'s: a
`Prefetcher` thread builds the global batches ahead while the compiled step runs; the
input share (`input_wait_share`) is the time the loop blocked waiting for a batch /
wall time of the timed steps (after one compile step); `input_overhead_share` compares
with the same steps on batches built beforehand (1 - t_without_input / t_with_input).
Prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import numpy as np

from ktx import partitioning
from ktx.training import optimizers
from ktx.runs.train import Prefetcher
from ktx.training.trainer import Trainer

# Published T5.1.1 shapes (Raffel et al., 2020; T5X gin files); tiny is ktx's test size.
SHAPES = {
    "t5_1_1_tiny": dict(emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                        num_encoder_layers=2, num_decoder_layers=2),
    "t5_1_1_small": dict(emb_dim=512, num_heads=6, head_dim=64, mlp_dim=1024,
                         num_encoder_layers=8, num_decoder_layers=8),
}


def bench(name: str, steps: int, batch_size: int, lengths: dict, vocab_size: int) -> dict:
    import ktx.tasks  # noqa: F401  (registers the synthetic suite)
    from ktx.data.pipeline import MultiTaskInput
    from ktx.models import seq2seq, t5

    inp = MultiTaskInput("synthetic_quickstart", lengths, batch_size, seed=0)
    config = t5.T5Config(vocab_size=vocab_size, dropout_rate=0.0, **SHAPES[name])
    model = seq2seq.EncoderDecoderModel(config, num_tasks=inp.num_tasks)
    tr = Trainer(model, optimizers.adafactor(learning_rate=1e-3),
                 mesh=partitioning.create_mesh(1))
    rng = jax.random.key(0)
    state = tr.init_state(rng, inp.get_batch(0))
    # As in `ktx.runs.train`, the prefetcher starts before the first (compiling) step.
    prefetcher = Prefetcher(inp, tr, 1, steps + 1)
    state, m = tr.train_step(state, inp.get_batch(0), rng)  # compile
    jax.block_until_ready(m["loss"])
    input_s = 0.0
    start = time.perf_counter()
    for _, batch, counts, wait in prefetcher:
        input_s += wait
        state, m = tr.train_step(state, batch, rng, counts)
    jax.block_until_ready(m["loss"])
    wall = time.perf_counter() - start
    # The same steps on batches built beforehand: the step time without any input work.
    ready = [(tr.global_batch(inp.get_batch(s)), inp.task_counts(s)) for s in range(1, steps + 1)]
    jax.block_until_ready(ready)
    start = time.perf_counter()
    for batch, counts in ready:
        state, m = tr.train_step(state, batch, rng, counts)
    jax.block_until_ready(m["loss"])
    wall_no_input = time.perf_counter() - start
    return {
        "steps_per_s": round(steps / wall, 4),
        "examples_per_s": round(steps * batch_size / wall, 2),
        "input_wait_share": round(input_s / wall, 5),
        "input_overhead_share": round(max(0.0, 1.0 - wall_no_input / wall), 5),
        "step_ms": round(1000 * wall / steps, 2),
        "step_ms_no_input": round(1000 * wall_no_input / steps, 2),
        "final_loss": float(np.asarray(m["loss"])),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--models", default="t5_1_1_tiny,t5_1_1_small")
    parser.add_argument("--inputs_length", type=int, default=32)
    parser.add_argument("--targets_length", type=int, default=8)
    args = parser.parse_args()
    lengths = {"inputs": args.inputs_length, "targets": args.targets_length}
    results = {}
    for name in args.models.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--models: {name!r} unknown; accepted: {sorted(SHAPES)}")
        # The T5 vocabulary size (32128) for small; the byte vocabulary fits in 384.
        vocab = 32128 if name == "t5_1_1_small" else 384
        results[name] = bench(name, args.steps, args.batch_size, lengths, vocab)
    print(json.dumps({
        "benchmark": "train_step",
        "device": jax.devices()[0].platform,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "batch_size": args.batch_size,
        "feature_lengths": lengths,
        "steps": args.steps,
        "results": results,
    }))


if __name__ == "__main__":
    main()
