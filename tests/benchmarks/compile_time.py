"""Compile time of the T5.1.1 train step on this machine, unrolled vs scanned layers
(`T5Config.scan_layers`), optionally with rematerialisation.

    python tests/benchmarks/compile_time.py [--models t5_1_1_base,t5_1_1_xl]
        [--batch_size 8] [--inputs 128] [--targets 32] [--remat none] [--repeats 1]

The step is the real one (`ktx.training.trainer.train_step`, Adafactor, bfloat16
activations, plain path) on one device, lowered from abstract shapes (nothing is
allocated, so XL fits any machine) and compiled by XLA for this machine's backend
(`jax.default_backend()`). Each measurement is `jit(...).lower(...)` (tracing + StableHLO)
plus `.compile()` (XLA), wall clock; the two layouts are measured alternately, `--repeats`
times each, and the fastest run is reported. The last line is one JSON object:
`{"compile_seconds": {"t5_1_1_base": {"unrolled": s, "scanned": s}, ...},
"lower_seconds": {...}, "speedup": {...}, ...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax

from ktx import partitioning
from ktx.models import seq2seq, t5
from ktx.training import optimizers, precompile
from ktx.training.trainer import Trainer

# Published T5.1.1 shapes (Raffel et al., 2020; gin/models/t5_1_1_*.gin).
SHAPES = {
    "t5_1_1_small": dict(emb_dim=512, num_heads=6, head_dim=64, mlp_dim=1024,
                         num_encoder_layers=8, num_decoder_layers=8),
    "t5_1_1_base": dict(emb_dim=768, num_heads=12, head_dim=64, mlp_dim=2048,
                        num_encoder_layers=12, num_decoder_layers=12),
    "t5_1_1_large": dict(emb_dim=1024, num_heads=16, head_dim=64, mlp_dim=2816,
                         num_encoder_layers=24, num_decoder_layers=24),
    "t5_1_1_xl": dict(emb_dim=2048, num_heads=32, head_dim=64, mlp_dim=5120,
                      num_encoder_layers=24, num_decoder_layers=24),
    "t5_1_1_xxl": dict(emb_dim=4096, num_heads=64, head_dim=64, mlp_dim=10240,
                       num_encoder_layers=24, num_decoder_layers=24),
}
LAYOUTS = ("unrolled", "scanned")


def measure(name: str, layout: str, batch_size: int, lengths: dict, remat: str) -> tuple[float, float]:
    """`(lower_seconds, compile_seconds)` of one train step."""
    config = t5.T5Config(vocab_size=32128, dropout_rate=0.1, dtype="bfloat16",
                         scan_layers=layout == "scanned", remat_policy=remat, **SHAPES[name])
    model = seq2seq.EncoderDecoderModel(config, num_tasks=1)
    mesh = partitioning.create_mesh(1, devices=jax.devices()[:1])
    trainer = Trainer(model, optimizers.adafactor(learning_rate=1e-3), mesh=mesh)
    spec = model.input_spec(batch_size, lengths)
    abstract_state, _ = trainer.create_abstract_state(spec)
    batch, rng = precompile.abstract_inputs(mesh, spec)
    start = time.perf_counter()
    lowered = trainer.lower_train_step(abstract_state, batch, rng)
    lowered_at = time.perf_counter()
    lowered.compile()
    done = time.perf_counter()
    return lowered_at - start, done - lowered_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="t5_1_1_base,t5_1_1_xl")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--inputs", type=int, default=128)
    parser.add_argument("--targets", type=int, default=32)
    parser.add_argument("--remat", default="none")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    lengths = {"inputs": args.inputs, "targets": args.targets}
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in SHAPES:
            raise SystemExit(f"--models: {m!r} unknown; accepted: {sorted(SHAPES)}")
    total: dict = {m: {} for m in models}
    lower: dict = {m: {} for m in models}
    for name in models:
        for _ in range(args.repeats):
            for layout in LAYOUTS:
                lo, co = measure(name, layout, args.batch_size, lengths, args.remat)
                print(json.dumps({"model": name, "layout": layout, "lower_s": round(lo, 2),
                                  "xla_compile_s": round(co, 2)}), flush=True)
                best = total[name].get(layout)
                if best is None or lo + co < best:
                    total[name][layout], lower[name][layout] = lo + co, lo
    result = {
        "compile_seconds": {m: {k: round(v, 2) for k, v in d.items()} for m, d in total.items()},
        "lower_seconds": {m: {k: round(v, 2) for k, v in d.items()} for m, d in lower.items()},
        "speedup": {m: round(d["unrolled"] / d["scanned"], 2) for m, d in total.items()},
        "batch_size": args.batch_size, "lengths": lengths, "remat_policy": args.remat,
        "repeats": args.repeats, "backend": jax.default_backend(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
        "jax": jax.__version__,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
