"""Train-step time on this machine of one T5.1.1 model under the giant-model layer options:
unrolled vs scanned layers (`T5Config.scan_layers`) and remat 'none' / 'minimal' / 'dots' / 'full'
(`T5Config.remat_policy`).

    python tests/benchmarks/layer_options_step.py [--model t5_1_1_small] [--steps 5]
        [--rounds 2] [--batch_size 8] [--inputs 128] [--targets 32]
        [--variants unrolled/none,scanned/none,...]

Every variant trains the same parameters (converted to its layout) on the same batches
(random tokens, one task, Adafactor, float32 activations: this CPU has no fast bfloat16);
after one compiling step each, the variants' timed steps are interleaved in `--rounds`
rounds of `--steps` steps, so load on the shared cores hits them alike; each variant's
time is its median step. The last line is one JSON object:
`{"step_seconds": {variant: s}, "relative_to_unrolled_none": {variant: x}, ...}`.
`--memory` adds `"grad_temp_mib"`: XLA's temporary buffers of each variant's compiled loss
gradient (`memory_analysis().temp_size_in_bytes`; the activations kept for the backward pass
dominate it), one more compile per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import numpy as np

from ktx import partitioning
from ktx.models import scan_layout, seq2seq, t5
from ktx.training import optimizers
from ktx.training.trainer import Trainer

from compile_time import SHAPES as T5_1_1_SHAPES  # this folder is on sys.path

# The published T5.1.1 shapes (compile_time.py, run beside this script), plus a tiny one.
SHAPES = {
    "t5_1_1_tiny": dict(emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                        num_encoder_layers=2, num_decoder_layers=2),
    **T5_1_1_SHAPES,
}
VARIANTS = (("unrolled", "none"), ("scanned", "none"), ("unrolled", "minimal"),
            ("unrolled", "dots"), ("unrolled", "full"), ("scanned", "minimal"),
            ("scanned", "dots"), ("scanned", "full"))


def _batch(step: int, batch_size: int, lengths: dict, vocab: int) -> dict:
    rng = np.random.default_rng(step)
    le, ld = lengths["inputs"], lengths["targets"]
    tgt = rng.integers(2, vocab, size=(batch_size, ld)).astype(np.int32)
    return {
        "encoder_input_tokens": rng.integers(2, vocab, size=(batch_size, le)).astype(np.int32),
        "decoder_input_tokens": np.concatenate([np.zeros((batch_size, 1), np.int32), tgt[:, :-1]], 1),
        "decoder_target_tokens": tgt,
        "decoder_loss_weights": np.ones((batch_size, ld), np.float32),
        "task_id": np.zeros((batch_size,), np.int32),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="t5_1_1_small", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--inputs", type=int, default=128)
    parser.add_argument("--targets", type=int, default=32)
    parser.add_argument("--vocab_size", type=int, default=32128)
    parser.add_argument("--memory", action="store_true",
                        help="also report each variant's loss-gradient temporaries (MiB)")
    parser.add_argument("--variants", default=",".join(f"{a}/{b}" for a, b in VARIANTS),
                        help="comma-separated layout/remat names (unrolled/none is always run)")
    args = parser.parse_args()
    wanted = set(args.variants.split(",")) | {"unrolled/none"}
    unknown = wanted - {f"{a}/{b}" for a, b in VARIANTS}
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; accepted: "
                     f"{[f'{a}/{b}' for a, b in VARIANTS]}")
    lengths = {"inputs": args.inputs, "targets": args.targets}
    mesh = partitioning.create_mesh(1, devices=jax.devices()[:1])
    batches = [_batch(s, args.batch_size, lengths, args.vocab_size) for s in range(args.steps)]
    rng = jax.random.key(0)
    runs = {}
    params0 = None
    for layout, remat in [v for v in VARIANTS if f"{v[0]}/{v[1]}" in wanted]:
        config = t5.T5Config(vocab_size=args.vocab_size, dropout_rate=0.1,
                             scan_layers=layout == "scanned", remat_policy=remat,
                             **SHAPES[args.model])
        model = seq2seq.EncoderDecoderModel(config, num_tasks=1)
        trainer = Trainer(model, optimizers.adafactor(learning_rate=1e-3), mesh=mesh)
        state = trainer.init_state(rng, batches[0])
        if params0 is None:  # every variant starts from the first one's parameters
            params0 = jax.device_get(
                scan_layout.convert_layout(jax.device_get(state.params), scanned=False))
        params = scan_layout.convert_layout(params0, scanned=layout == "scanned")
        state = state.replace(params=jax.device_put(params, trainer.state_shardings.params))
        start = time.perf_counter()
        state, m = trainer.train_step(state, batches[0], rng)
        jax.block_until_ready(m["loss"])
        first_step_s = time.perf_counter() - start
        name = f"{layout}/{remat}"
        if args.memory:
            grad = jax.jit(jax.grad(lambda p, b, r: model.loss_fn(p, b, r)[0]))
            compiled = grad.lower(state.params, batches[0], rng).compile()
            temp_mib = compiled.memory_analysis().temp_size_in_bytes / 2**20
            print(json.dumps({"variant": name, "grad_temp_mib": round(temp_mib, 1)}), flush=True)
        runs[name] = {"temp_mib": temp_mib if args.memory else None,
                      "trainer": trainer, "state": state, "times": [], "losses": [],
                      "first_step_s": first_step_s}
        print(json.dumps({"variant": name, "first_step_s": round(runs[name]["first_step_s"], 2)}),
              flush=True)
    for _ in range(args.rounds):
        for name, run in runs.items():
            state = run["state"]
            for batch in batches:
                start = time.perf_counter()
                state, m = run["trainer"].train_step(state, batch, rng)
                jax.block_until_ready(m["loss"])
                run["times"].append(time.perf_counter() - start)
                run["losses"].append(float(m["loss"]))
            run["state"] = state
    step = {name: statistics.median(run["times"]) for name, run in runs.items()}
    base = step["unrolled/none"]
    result = {
        "step_seconds": {k: round(v, 4) for k, v in step.items()},
        "relative_to_unrolled_none": {k: round(v / base, 3) for k, v in step.items()},
        "first_step_seconds": {k: round(r["first_step_s"], 2) for k, r in runs.items()},
        "last_loss": {k: round(r["losses"][-1], 5) for k, r in runs.items()},
        **({"grad_temp_mib": {k: round(r["temp_mib"], 1) for k, r in runs.items()}}
           if args.memory else {}),
        "model": args.model, "batch_size": args.batch_size, "lengths": lengths,
        "steps_per_variant": args.steps * args.rounds, "backend": jax.default_backend(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
