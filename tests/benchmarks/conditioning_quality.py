"""Validation quality of task conditioning from scratch on the small GLUE/SuperGLUE tasks.

Plain multi-task T5.1.1, HyperPrompt-Global (He et al., 2022), HyperFormer++ (Karimi
Mahabadi et al., 2021) and multi-task Prompt-Tuning (Lester et al., 2021) are trained
with the same budget (model shapes, steps, batch, optimizer, data order per seed) on
the mixture `glue_super_glue_small_v1` (SST-2, CoLA, MRPC, STS-B, RTE, CB, COPA) from
the official files in the data folder, for each seed; each run is then decoded greedily
on (a prefix of) every task's validation split and scored by the task's SeqIO
postprocessor and metric fns (`ktx.runs.eval.DecodeEvaluator`). No pretrained weights exist
here, so every model starts from random initialization.

Writes the markdown table (per task: the mean of the task's metrics, GLUE-style; and the
average over tasks; mean and per-seed values) to `--results_md`, appends one JSON object
per finished run to `<work_dir>/runs.jsonl` (a rerun skips runs already there), and
prints one JSON object as its last line.

    KTX_DATA_DIR=../shared/data .venv/bin/python tests/benchmarks/conditioning_quality.py \
        --steps 300 --seeds 0,1 --eval_examples 300
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np

METHODS = {
    "plain": dict(method="none"),
    "hyperprompt_global": dict(method="hyperprompt", hyperprompt_variant="global"),
    "hyperformer++": dict(method="hyperformer++"),
    "prompt_tuning": dict(method="prompt_tuning"),
}
MIXTURE = "glue_super_glue_small_v1"
SHORT = {
    "glue_sst2_v002": "SST-2", "glue_cola_v002": "CoLA", "glue_mrpc_v002": "MRPC",
    "glue_stsb_v002": "STS-B", "glue_rte_v002": "RTE", "super_glue_cb_v102": "CB",
    "super_glue_copa_v102": "COPA",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data_dir", default=os.environ.get("KTX_DATA_DIR"))
    p.add_argument("--mixture", default=MIXTURE)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--inputs_length", type=int, default=128)
    p.add_argument("--targets_length", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--temperature", type=float, default=2.0,
                   help="temperature mixing T (rates ~ n_task^(1/T))")
    p.add_argument("--eval_examples", type=int, default=300,
                   help="validation examples per task (first N of the split; 0 = all)")
    p.add_argument("--eval_batch_size", type=int, default=64)
    p.add_argument("--emb_dim", type=int, default=64)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--head_dim", type=int, default=16)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--mlp_dim", type=int, default=128)
    p.add_argument("--reduction_factor", type=int, default=8)
    p.add_argument("--work_dir", default="/tmp/ktx_conditioning_quality")
    p.add_argument("--results_md", default=str(pathlib.Path(__file__).parents[2] / "docs" / "results.md"))
    args = p.parse_args(argv)
    if not args.data_dir:
        p.error("--data_dir or $KTX_DATA_DIR must name the folder with glue/ and super_glue/")
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        p.error(f"--methods: unknown {sorted(unknown)}; accepted: {sorted(METHODS)}")
    return args


def build_model(args, method: str, num_tasks: int):
    from ktx.conditioning import model as conditioning
    from ktx.models import seq2seq, t5

    config = t5.T5Config(
        emb_dim=args.emb_dim, num_heads=args.num_heads, head_dim=args.head_dim,
        num_encoder_layers=args.num_layers, num_decoder_layers=args.num_layers,
        mlp_dim=args.mlp_dim, dropout_rate=0.0,
    )
    base = seq2seq.EncoderDecoderModel(config=config, num_tasks=num_tasks, z_loss=1e-4)
    cond = conditioning.ConditioningConfig(
        **METHODS[method], reduction_factor=args.reduction_factor,
        encoder_prompt_length=16, decoder_prompt_length=6, prompt_tuning_length=16,
        task_embed_dim=32, task_hidden_dim=64, projected_dim=32,
    )
    return conditioning.conditioned_model(base, cond)


def task_score(metrics: dict[str, float]) -> float:
    """GLUE-style: the mean of a task's metrics (e.g. MRPC (F1 + accuracy) / 2)."""
    return float(np.mean(list(metrics.values())))


def run_one(args, train_input, method: str, seed: int) -> dict:
    import jax

    from ktx.training import optimizers
    from ktx.runs.eval import DecodeEvaluator
    from ktx.analysis.params import count_parameters
    from ktx.runs.train import train

    model = build_model(args, method, train_input.num_tasks)
    lengths = {"inputs": args.inputs_length, "targets": args.targets_length}
    counts = count_parameters(model, batch_size=args.batch_size, feature_lengths=lengths)
    evaluator = DecodeEvaluator(
        train_input.task_names, lengths, split="validation", batch_size=args.eval_batch_size,
        num_examples=args.eval_examples or None,
    )
    timings: dict[str, float] = {}
    results: dict[str, dict[str, float]] = {}

    def decode_eval(*, trainer, params, step, writer=None):
        timings["train_s"] = time.perf_counter() - timings["start"]
        t0 = time.perf_counter()
        results.update(evaluator(trainer=trainer, params=params, step=step, writer=writer))
        timings["eval_s"] = time.perf_counter() - t0
        return results

    model_dir = pathlib.Path(args.work_dir) / f"{method}_seed{seed}"
    if model_dir.exists():
        import shutil

        shutil.rmtree(model_dir)
    timings["start"] = time.perf_counter()
    state = train(
        model=model, train_input=train_input.replace(seed=seed), model_dir=model_dir,
        train_steps=args.steps, optimizer=optimizers.adamw(args.learning_rate, grad_clip_norm=1.0),
        seed=seed, log_period=max(1, args.steps // 4), checkpoint_period=10**9,
        eval_period=args.steps, evaluators=[decode_eval],
    )
    last = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    train_loss = [r for r in last if r.get("split") == "train" and r.get("task") == "all"]
    del state
    jax.clear_caches()
    return {
        "method": method, "seed": seed, "steps": args.steps,
        "params_total": int(counts["total"]), "params_task": int(counts["task_conditioned"]),
        "final_objective": train_loss[-1].get("objective") if train_loss else None,
        "train_s": round(timings["train_s"], 1), "eval_s": round(timings["eval_s"], 1),
        "metrics": results,
        "scores": {t: task_score(m) for t, m in results.items()},
    }


def constant_baseline(task_names, lengths, eval_examples: int) -> dict[str, dict[str, float]]:
    """Each task's metrics when every prediction is its most frequent train target (the
    majority class; for STS-B the most frequent score): the "chance" line of the table."""
    import collections

    import seqio

    out = {}
    for name in task_names:
        task = seqio.get_mixture_or_task(name)
        train = task.preprocessors[0](task.source.get_dataset("train", shuffle=False))
        counts = collections.Counter(ex["targets"] for ex in train.as_numpy_iterator())
        majority = counts.most_common(1)[0][0].decode()
        ds = task.get_dataset(lengths, split="validation", shuffle=False, num_epochs=1,
                              trim_output_features=True)
        if eval_examples:
            ds = ds.take(eval_examples)
        examples = list(ds.as_numpy_iterator())
        targets = [task.postprocess_fn(ex["targets_pretokenized"].decode(), example=ex,
                                       is_target=True) for ex in examples]
        predictions = [task.postprocess_fn(majority, example=ex, is_target=False) for ex in examples]
        out[name] = {}
        for fn in task.metric_fns:
            out[name].update({k: float(getattr(v, "value", v))
                              for k, v in fn(targets, predictions).items()})
    return out


def short(task: str) -> str:
    return SHORT.get(task.replace("_noprefix", ""), task)


def markdown(args, runs: list[dict], task_names, sizes) -> str:
    methods = [m for m in METHODS if any(r["method"] == m for r in runs)]
    seeds = sorted({r["seed"] for r in runs})
    header = ["method"] + [short(t) for t in task_names] + ["avg"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for m in methods:
        mine = sorted((r for r in runs if r["method"] == m), key=lambda r: r["seed"])
        cells = []
        for t in task_names:
            vals = [r["scores"][t] for r in mine]
            cells.append(f"{np.mean(vals):.1f} ({'/'.join(f'{v:.1f}' for v in vals)})")
        avgs = [np.mean([r["scores"][t] for t in task_names]) for r in mine]
        cells.append(f"**{np.mean(avgs):.1f}** ({'/'.join(f'{v:.1f}' for v in avgs)})")
        lines.append("| " + " | ".join([m] + cells) + " |")
    detail = ["| method | seed | " + " | ".join(
        f"{short(t)} {k}" for t in task_names for k in runs[0]["metrics"][t]) +
        " | final train objective | params (task-cond.) | train s | eval s |"]
    detail.append("|" + "---|" * (len(detail[0].split("|")) - 2))
    for r in sorted(runs, key=lambda r: (methods.index(r["method"]), r["seed"])):
        vals = [f"{r['metrics'][t][k]:.1f}" for t in task_names for k in r["metrics"][t]]
        obj = r["final_objective"]
        detail.append("| " + " | ".join(
            [r["method"], str(r["seed"])] + vals + [
                f"{obj:.3f}" if obj is not None else "-",
                f"{r['params_total']:,} ({r['params_task']:,})", str(r["train_s"]), str(r["eval_s"])]) + " |")
    return "\n".join(lines), "\n".join(detail), seeds


def main(argv=None):
    args = parse_args(argv)
    import seqio  # noqa: F401

    import ktx.tasks  # noqa: F401  (registers the tasks and mixtures)
    from ktx.data.mixing import Mixing
    from ktx.data.pipeline import MultiTaskInput
    from ktx.tasks import config

    config.set_data_dir(args.data_dir)
    work = pathlib.Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train_input = MultiTaskInput(
        args.mixture, {"inputs": args.inputs_length, "targets": args.targets_length},
        batch_size=args.batch_size, seed=0, mixing=Mixing(kind="temperature", temperature=args.temperature),
        min_rows_per_task=1, cache_dir=work / "cache",
    )
    load_s = time.perf_counter() - t0
    print(f"loaded {dict(zip(train_input.task_names, train_input.task_sizes))} in {load_s:.0f}s; "
          f"rows per task at step 0: {train_input.task_counts(0)}", flush=True)
    log = work / "runs.jsonl"
    done = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    key = lambda r: (r["method"], r["seed"], r["steps"], r.get("mixture", MIXTURE))  # noqa: E731
    seen = {key(r) for r in done}
    seeds = [int(s) for s in args.seeds.split(",")]
    for seed in seeds:
        for method in args.methods.split(","):
            if (method, seed, args.steps, args.mixture) in seen:
                continue
            print(f"=== {method} seed {seed}", flush=True)
            result = {"mixture": args.mixture, **run_one(args, train_input, method, seed)}
            print(json.dumps(result), flush=True)
            with log.open("a") as f:
                f.write(json.dumps(result) + "\n")
            done.append(result)
    runs = [r for r in done if r["steps"] == args.steps and r["seed"] in seeds
            and r["method"] in args.methods.split(",") and r.get("mixture", MIXTURE) == args.mixture]
    table, detail, seeds_done = markdown(args, runs, train_input.task_names, train_input.task_sizes)
    baseline = constant_baseline(train_input.task_names, train_input.task_feature_lengths,
                                 args.eval_examples)
    base_scores = [task_score(baseline[t]) for t in train_input.task_names]
    table += ("\n| majority train target (no model) | " + " | ".join(f"{v:.1f}" for v in base_scores)
              + f" | **{np.mean(base_scores):.1f}** |")
    setup = (
        f"mixture `{args.mixture}` ({', '.join(f'{short(t)} {n}' for t, n in zip(train_input.task_names, train_input.task_sizes))} "
        f"train rows), temperature mixing T={args.temperature} with >= 1 row per task per batch, "
        f"batch {args.batch_size}, lengths {args.inputs_length}/{args.targets_length}, "
        f"{args.steps} steps, AdamW lr {args.learning_rate} (clip 1.0), dropout 0, "
        f"T5.1.1 shape emb {args.emb_dim}, {args.num_heads} heads x {args.head_dim}, "
        f"{args.num_layers}+{args.num_layers} layers, MLP {args.mlp_dim}, T5 vocabulary; "
        f"conditioning: HyperPrompt-Global prompts 16 (enc) / 6 (dec), b = d/{args.reduction_factor}, "
        f"t' = t = 32, e = 64; HyperFormer++ same b and embeddings; Prompt-Tuning 16 input prompts. "
        f"Validation: greedy decoding of the first {args.eval_examples or 'all'} examples of each "
        f"validation split, seeds {seeds_done}"
    )
    summary = {
        "benchmark": "conditioning_quality", "setup": setup,
        "average": {m: float(np.mean([np.mean(list(r["scores"].values())) for r in runs if r["method"] == m]))
                    for m in METHODS if any(r["method"] == m for r in runs)},
        "per_task": {m: {short(t): float(np.mean([r["scores"][t] for r in runs if r["method"] == m]))
                         for t in train_input.task_names}
                     for m in METHODS if any(r["method"] == m for r in runs)},
        "runs": len(runs),
        "majority_baseline": {short(t): task_score(baseline[t]) for t in train_input.task_names},
    }
    if args.results_md:
        path = pathlib.Path(args.results_md)
        existing = path.read_text() if path.exists() else ""
        tag = "conditioning_quality" if args.mixture == MIXTURE else f"conditioning_quality:{args.mixture}"
        begin, end = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
        block = (f"{begin}\n**Setup.** {setup}.\n\n"
                 f"Per-task score (mean of the task's metrics; mean over seeds, per-seed in brackets):\n\n"
                 f"{table}\n\nAll metrics per run:\n\n{detail}\n{end}")
        if begin in existing and end in existing:
            existing = existing[:existing.index(begin)] + block + existing[existing.index(end) + len(end):]
        else:
            existing = (existing.rstrip() + "\n\n" if existing else "") + block + "\n"
        path.write_text(existing)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    sys.exit(main())
