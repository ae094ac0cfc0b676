"""Training-step time of each task-conditioning method relative to plain multi-task T5.

Same model shapes (T5.1.1 small by default), same batch, same optimizer (Adam); one jitted
step (`value_and_grad(model.loss_fn)` + update) per method, compiled first, then timed
for `--steps` steps in alternation with the plain step; the ratio is the median method step
over the median plain step of the same window (robust to a drifting, shared machine). Target: HyperPrompt-Global
within 1.10x of plain T5 (He et al., 2022 report its training time close to an adapter's).

    python tests/benchmarks/conditioning_overhead.py [--steps 5] [--batch_size 8]
        [--inputs 64 --targets 16] [--num_tasks 8] [--tiny]

Prints one line per method, then one JSON object (the last line).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import flax.linen as nn
import jax
import numpy as np
import optax

from ktx.conditioning.model import ConditioningConfig, conditioned_model
from ktx.models import seq2seq, t5

METHODS = {
    "plain": dict(method="none"),
    "hyperprompt_share": dict(method="hyperprompt", hyperprompt_variant="share"),
    "hyperprompt_sep": dict(method="hyperprompt", hyperprompt_variant="sep"),
    "hyperprompt_global": dict(method="hyperprompt", hyperprompt_variant="global"),
    "prompt_tuning": dict(method="prompt_tuning"),
    "adapters": dict(method="adapters"),
    "hyperformer": dict(method="hyperformer"),
    "hyperformer++": dict(method="hyperformer++"),
}


def _config(tiny: bool) -> t5.T5Config:
    if tiny:
        return t5.T5Config(vocab_size=512, emb_dim=32, num_heads=2, num_encoder_layers=2,
                           num_decoder_layers=2, head_dim=16, mlp_dim=64, dropout_rate=0.0)
    # T5.1.1 small (gin/models/t5_1_1_small.gin), dropout off for a deterministic step.
    return t5.T5Config(vocab_size=32128, emb_dim=512, num_heads=6, num_encoder_layers=8,
                       num_decoder_layers=8, head_dim=64, mlp_dim=1024, dropout_rate=0.0)


def _batch(cfg, rows, le, ld, num_tasks, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "encoder_input_tokens": rng.integers(2, cfg.vocab_size, (rows, le)).astype(np.int32),
        "decoder_input_tokens": rng.integers(2, cfg.vocab_size, (rows, ld)).astype(np.int32),
        "decoder_target_tokens": rng.integers(2, cfg.vocab_size, (rows, ld)).astype(np.int32),
        "decoder_loss_weights": np.ones((rows, ld), np.float32),
        "task_id": (np.arange(rows) % num_tasks).astype(np.int32),
    }


def build_step(base, conditioning, batch):
    """A jitted train step of `base` with `conditioning`, compiled; returns (run, compile_s).

    `run()` performs one step (state kept inside) and blocks until it is done.
    """
    model = conditioned_model(base, conditioning)
    params = nn.meta.unbox(model.init_variables(jax.random.key(0), batch))["params"]
    tx = optax.adam(1e-3)
    state = [params, tx.init(params)]

    @jax.jit
    def step(params, opt_state, batch):
        (loss, _), grads = jax.value_and_grad(model.loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def run():
        params, opt_state, loss = step(state[0], state[1], batch)
        jax.block_until_ready(loss)
        state[0], state[1] = params, opt_state

    t0 = time.perf_counter()
    run()
    return run, time.perf_counter() - t0


def timed(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--targets", type=int, default=16)
    parser.add_argument("--num_tasks", type=int, default=8)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (smoke run)")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; accepted: {list(METHODS)}")
    if "plain" not in methods:
        methods = ["plain"] + methods
    cfg = _config(args.tiny)
    base = seq2seq.EncoderDecoderModel(cfg, num_tasks=args.num_tasks)
    batch = _batch(cfg, args.batch_size, args.inputs, args.targets, args.num_tasks)
    # A shared, loaded machine drifts: each method is timed in alternation with plain T5
    # (plain, method, plain, method, ...) and compared with the plain steps of its window.
    plain_run, compile_s = build_step(base, ConditioningConfig(**METHODS["plain"]), batch)
    print(f"plain: compile {compile_s:.1f} s", flush=True)
    seconds, ratios, plain_windows = {}, {}, []
    for name in methods:
        if name == "plain":
            continue
        run, compile_s = build_step(base, ConditioningConfig(**METHODS[name]), batch)
        plain_t, method_t = [], []
        for _ in range(args.steps):
            plain_t.append(timed(plain_run))
            method_t.append(timed(run))
        del run
        seconds[name] = statistics.median(method_t)
        plain_windows.append(statistics.median(plain_t))
        ratios[name] = seconds[name] / plain_windows[-1]
        print(f"{name}: {seconds[name] * 1000:.1f} ms/step vs plain {plain_windows[-1] * 1000:.1f}"
              f" ms/step -> {ratios[name]:.3f}x (compile {compile_s:.1f} s)", flush=True)
    seconds["plain"] = statistics.median(plain_windows)
    ratios["plain"] = 1.0
    result = {
        "benchmark": "conditioning_overhead",
        "model": "t5_1_1_tiny" if args.tiny else "t5_1_1_small",
        "device": jax.devices()[0].platform,
        "batch_size": args.batch_size,
        "feature_lengths": {"inputs": args.inputs, "targets": args.targets},
        "num_tasks": args.num_tasks,
        "steps": args.steps,
        "step_ms": {k: round(v * 1000, 2) for k, v in seconds.items()},
        "ratio_to_plain": {k: round(v, 3) for k, v in ratios.items()},
    }
    if "hyperprompt_global" in ratios:
        result["hyperprompt_global_within_1.10x"] = bool(ratios["hyperprompt_global"] <= 1.10)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
