"""Train-step time of each encoder method relative to plain multi-task BERT
(`EncoderClassifierModel`), through `ktx.training.trainer.Trainer`.

Methods: CA-MTL (Base variant, nothing frozen, so every method trains the same backbone),
PALs (d_s = 204 * E / 768 rounded to a multiple of 6 heads), and each TEA injection
(`input`, `qkv`, `projected`, `projected_act`); `--extra` adds plain BERT with one shared
top layer and with SMART (paper defaults). Same batch (T = 3 tasks with 5, 2 and 1 labels,
rows interleaved), same optimizer (AdamW), BERT's dropout 0.1 (the per-row dropout path
every ktx encoder trains with). Each method's step is compiled and run `--warmup` times
(excluded), then the methods are timed interleaved, one step each per round, for
`--repeats` rounds; the ratio is the method's median step over plain BERT's median step.
The issue's goal: every method <= 1.15x plain BERT.

    python tests/benchmarks/encoder_step.py            # BERT-Base shape: 12 x 768, L = 128, B = 8
    python tests/benchmarks/encoder_step.py --small    # 4 x 256, 4 heads, MLP 1024, L = 64, B = 8
    python tests/benchmarks/encoder_step.py --small --scan   # every stack scanned

`--cost` adds XLA's cost analysis of each method's compiled step (floating-point operations
and bytes accessed) relative to plain BERT's: what a method adds in arithmetic and in memory
traffic, independent of the machine's load. Only an unrolled stack gives whole-step figures
(XLA counts a scanned stack's body once), so `--cost` refuses `--scan`.

Prints one line per method, then one JSON object (the last line).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from ktx.models import bert, camtl, encoder, pals, smart, tea
from ktx.training import optimizers, precompile
from ktx.training.trainer import Trainer

NUM_LABELS = (5, 2, 1)
METHODS = ("camtl", "pals", "tea_input", "tea_qkv", "tea_projected", "tea_projected_act")
EXTRA = ("shared_layer", "smart")


def _config(args) -> bert.BertConfig:
    return bert.BertConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                           intermediate_size=args.intermediate, scan_layers=args.scan)


def build(name: str, config: bert.BertConfig, seq: int):
    common = {"num_labels": NUM_LABELS}
    if name == "plain":
        return encoder.EncoderClassifierModel(config, **common)
    if name == "shared_layer":
        return encoder.EncoderClassifierModel(config, shared_layers=1, **common)
    if name == "smart":
        return smart.SmartModel(encoder.EncoderClassifierModel(config, **common))
    if name == "camtl":
        return camtl.CaMtlClassifierModel(config, camtl=camtl.CaMtlConfig(max_seq_length=seq),
                                          **common)
    if name == "pals":
        size = max(6, round(204 * config.hidden_size / 768 / 6) * 6)
        return pals.PalsClassifierModel(config, pals_size=size, pals_heads=6, **common)
    return tea.TeaClassifierModel(config, injection=name[len("tea_"):], **common)


def _batch(config: bert.BertConfig, rows: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, config.vocab_size, (rows, seq)).astype(np.int32)
    ids[1::2, seq // 2:] = 0  # every other row half padding
    task_id = (np.arange(rows) % len(NUM_LABELS)).astype(np.int32)
    label = np.where(task_id == 2, rng.random(rows) * 5, task_id).astype(np.float32)
    return {"input_ids": ids, "token_type_ids": np.zeros_like(ids),
            "attention_mask": (ids > 0).astype(np.int32), "label": label, "task_id": task_id}


class Runner:
    """One method's Trainer and state; `step()` runs one blocking train step."""

    def __init__(self, model, batch):
        self.trainer = Trainer(model, optimizers.adamw(1e-4, weight_decay=0.01))
        self.state = self.trainer.init_state(jax.random.key(0), batch)
        self.batch = self.trainer.global_batch(batch)
        self.rng = jax.random.key(1)

    def cost(self) -> tuple[float, float]:
        """XLA's (flops, bytes accessed) of the compiled train step that `step` runs (no
        diagnostics: the optimizer is not a balancer)."""
        compiled = self.trainer.lower_train_step(self.state, self.batch, self.rng,
                                                 log_diagnostics=False).compile()
        analysis = precompile.cost_analysis(compiled)
        return float(analysis["flops"]), float(analysis["bytes accessed"])

    def step(self) -> float:
        t0 = time.perf_counter()
        self.state, metrics = self.trainer.train_step(self.state, self.batch, self.rng)
        jax.block_until_ready((self.state, metrics))
        return time.perf_counter() - t0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true",
                        help="4 layers x 256, 4 heads, MLP 1024, L = 64 (a CPU-sized run)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--extra", action="store_true", help=f"also time {list(EXTRA)}")
    parser.add_argument("--scan", action="store_true",
                        help="every model with a scanned layer stack (BertConfig.scan_layers), "
                             "plain BERT's scanned too")
    parser.add_argument("--cost", action="store_true",
                        help="also report XLA's flops and bytes accessed of each step over "
                             "plain BERT's (unrolled stacks only)")
    args = parser.parse_args(argv)
    if args.cost and args.scan:
        parser.error("--cost with --scan: XLA counts a scanned stack's body once, so its cost "
                     "analysis is not a whole step's; drop one of the two")
    if args.small:
        args.hidden, args.layers, args.heads, args.intermediate, args.seq = 256, 4, 4, 1024, 64
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS + EXTRA]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; accepted: {list(METHODS + EXTRA)}")
    methods = ["plain"] + methods + (list(EXTRA) if args.extra else [])
    config = _config(args)
    batch = _batch(config, args.batch_size, args.seq)

    runners, compile_s = {}, {}
    for name in methods:
        t0 = time.perf_counter()
        runners[name] = Runner(build(name, config, args.seq), batch)
        for _ in range(args.warmup):  # compilation and first steps: not timed
            runners[name].step()
        compile_s[name] = time.perf_counter() - t0
        print(f"{name}: built, compiled and warmed up in {compile_s[name]:.1f} s", flush=True)
    times = {name: [] for name in methods}
    for _ in range(args.repeats):  # interleaved: a drifting, shared machine hits all alike
        for name in methods:
            times[name].append(runners[name].step())
    median = {name: statistics.median(t) for name, t in times.items()}
    ratios = {name: median[name] / median["plain"] for name in methods}
    for name in methods:
        print(f"{name}: {median[name] * 1000:.1f} ms/step -> {ratios[name]:.3f}x plain BERT",
              flush=True)
    result = {
        "benchmark": "encoder_step",
        "device": f"{jax.devices()[0].platform} x{jax.device_count()}",
        "shape": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                  "intermediate": args.intermediate, "seq": args.seq,
                  "batch_size": args.batch_size, "num_labels": list(NUM_LABELS)},
        "scan_layers": args.scan,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "step_ms": {k: round(v * 1000, 2) for k, v in median.items()},
        "ratio_to_plain": {k: round(v, 3) for k, v in ratios.items()},
        "within_1.15x": {k: bool(v <= 1.15) for k, v in ratios.items() if k in METHODS},
    }
    if args.cost:
        costs = {name: runner.cost() for name, runner in runners.items()}
        base_flops, base_bytes = costs["plain"]
        result["xla_cost_ratio"] = {
            "flops": {k: round(f / base_flops, 3) for k, (f, _) in costs.items()},
            "bytes_accessed": {k: round(b / base_bytes, 3) for k, (_, b) in costs.items()}}
        result["plain_gflop"] = round(base_flops / 1e9, 2)
        for name, (f, b) in costs.items():
            print(f"{name}: XLA flops {f / base_flops:.3f}x, bytes accessed "
                  f"{b / base_bytes:.3f}x plain BERT", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
