"""The GLUE-subset encoder study from the pretrained all-MiniLM-L6-v2 (CoLA, SST-2, MRPC,
STS-B, RTE: the encoder mixture `glue_bert_v001`), run in pieces like `cs224n_study.py`:
each (method, mixing, seed) trains with `ktx train`, whose last evaluation scores every
task's validation split with GLUE's own metrics (`LabelEvaluator`), and leaves a small
record (flags, seed, budget, wall time, train loss every log period, the metrics) in
`docs/results/glue/<record>.json`; finished records are skipped, and `--table` rebuilds the
table between the `<!-- glue_encoders:begin -->` and `end` markers of docs/results.md from
the records alone (also written after every run).

    DIR=$(python -m ktx.convert.minilm)
    KTX_DATA_DIR=... python tests/benchmarks/glue_study.py --minilm "$DIR" \
        --methods plain,ca_mtl,pals --mixing equal --seeds 0 --work_dir runs/glue
    python tests/benchmarks/glue_study.py --table

`--mixing` sets how the five tasks share each batch (`pipeline.MultiTaskInput.mixing`, a
`ktx.data.mixing` kind): `mixture` (the default: the mixture's examples-proportional rates,
so RTE gets 2.8% of the rows) or `equal` (a fifth each). A record's name carries a
non-default mixing and budget (`pals-mixingequal-seed0.json`). The methods and the budget
flags are the CS224N study's (`cs224n_study.METHODS`, `--steps`, `--length`, `--peak_lr`),
as are `--work_dir`, `--resume` and `--checkpoint_period`.

The score column is GLUE's average: each task's metrics averaged (MRPC's F1 and accuracy,
STS-B's Pearson and Spearman), then the five tasks averaged.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from cs224n_study import (  # beside this script
    DEFAULT_BUDGET, METHODS, _model_dir, _per_seed, _recorded, _saving_flags, _seconds, add_run_arguments,
    check_run_arguments, compare, record_name)
from cs224n_study import _flags as _study_flags
from report_markers import write_between

REPO = pathlib.Path(__file__).resolve().parents[2]
RECORDS = REPO / "docs" / "results" / "glue"
RESULTS = REPO / "docs" / "results.md"
BEGIN, END = "<!-- glue_encoders:begin -->", "<!-- glue_encoders:end -->"
GLUE_METHODS = ("plain", "ca_mtl", "pals")
MIXINGS = ("mixture", "equal")
# task -> (column, its GLUE metrics as LabelEvaluator names them)
TASKS = {
    "glue_cola_bert_v001": ("CoLA MCC", ("matthews_corrcoef",)),
    "glue_sst2_bert_v001": ("SST-2 acc", ("accuracy",)),
    "glue_mrpc_bert_v001": ("MRPC F1 / acc", ("f1", "accuracy")),
    "glue_stsb_bert_v001": ("STS-B Pearson / Spearman", ("pearson_corrcoef", "spearman_corrcoef")),
    "glue_rte_bert_v001": ("RTE acc", ("accuracy",)),
}


def glue_average(metrics: dict) -> float:
    """GLUE's score: the mean over tasks of the mean of each task's metrics."""
    return sum(sum(metrics[t][m] for m in names) / len(names)
               for t, (_, names) in TASKS.items()) / len(TASKS)


def _name(method: str, mixing: str, seed: int, budget: dict) -> str:
    return record_name(method if mixing == "mixture" else f"{method}-mixing{mixing}", seed, budget)


def _flags(method: str, mixing: str, minilm: str, seed: int, budget: dict, model_dir: str) -> list[str]:
    return (_study_flags(method, minilm, seed, budget, model_dir,
                         experiment="experiments/glue_encoders/minilm_l6.gin")
            # the evaluation at the last step only (the gin file also runs the
            # teacher-forced loss), as in the study's first runs
            + ["--gin.train_script.train.evaluators=[@label_eval.LabelEvaluator()]"]
            + ([] if mixing == "mixture" else [f"--gin.pipeline.MultiTaskInput.mixing='{mixing}'"]))


def _read_run(model_dir: pathlib.Path, steps: int) -> tuple[dict, list]:
    """The last step's GLUE metrics per task and the train losses of `model_dir`'s
    metrics.jsonl; an error naming the file when the last step was not evaluated."""
    rows = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = {r["task"]: {k: v for k, v in r.items() if k not in ("step", "split", "task")}
               for r in rows if r.get("split") == "validation_metrics" and r["step"] == steps}
    missing = sorted(set(TASKS) - set(metrics))
    if missing:
        raise SystemExit(f"glue_study: {model_dir / 'metrics.jsonl'} has no step-{steps} "
                         f"validation_metrics row for {missing}")
    losses = [{"step": r["step"], "loss": r["loss"]} for r in rows
              if r.get("split") == "train" and r.get("task") == "all"]
    return metrics, losses


def run(method: str, mixing: str, seed: int, args) -> dict:
    budget = {"steps": args.steps, "max_seq_length": args.length, "peak_learning_rate": args.peak_lr}
    out = RECORDS / _name(method, mixing, seed, budget)
    if out.exists():
        print(f"{out.name}: cached", flush=True)
        return json.loads(out.read_text())
    model_dir, resumed = _model_dir(args, out.name.removesuffix(".json"))
    flags = _flags(method, mixing, args.minilm, seed, budget, model_dir) + _saving_flags(args)
    start = time.time()
    subprocess.run([sys.executable, "-m", "ktx", "train", *flags], check=True, cwd=REPO)
    seconds = round(time.time() - start, 1)
    metrics, losses = _read_run(pathlib.Path(model_dir), budget["steps"])
    record = {"method": method, "description": METHODS[method][0], "mixing": mixing, "seed": seed,
              **budget, "flags": _recorded(flags), "train_seconds": seconds, "train_loss": losses,
              "metrics": metrics, "glue_average": glue_average(metrics)}
    if resumed is not None:  # `seconds` timed this invocation only
        record.update(train_seconds=None, resumed_from_step=resumed, last_piece_seconds=seconds)
    RECORDS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({"method": method, "mixing": mixing, "seed": seed,
                      "glue_average": record["glue_average"]}), flush=True)
    return record


def _cell(records: list[dict], task: str) -> str:
    names = TASKS[task][1]
    return " / ".join(f"{sum(r['metrics'][task][m] for r in records) / len(records):.2f}"
                      for m in names)


def table() -> str:
    records = [json.loads(p.read_text()) for p in sorted(RECORDS.glob("*.json"))]
    head = " | ".join(column for column, _ in TASKS.values())
    lines = [f"| method | mixing | seeds | steps | {head} | GLUE average | average per seed | train s |",
             "|" + "---|" * (len(TASKS) + 7)]
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        key = (r["method"], r["mixing"], *(r.get(k, DEFAULT_BUDGET[k]) for k in DEFAULT_BUDGET))
        groups.setdefault(key, []).append(r)
    for mixing in MIXINGS:
        for method in GLUE_METHODS:
            for key in sorted(k for k in groups if k[:2] == (method, mixing)):
                mine = sorted(groups[key], key=lambda r: r["seed"])
                per_seed = _per_seed([{"seed": r["seed"], "scores": {"overall": r["glue_average"]}}
                                      for r in mine], digits=2)
                average = sum(r["glue_average"] for r in mine) / len(mine)
                cells = " | ".join(_cell(mine, task) for task in TASKS)
                lines.append(f"| {mine[0]['description']} | {mixing} | "
                             f"{','.join(str(r['seed']) for r in mine)} | {key[2]} | {cells} | "
                             f"**{average:.2f}** | {per_seed} | {_seconds(mine)} |")
    return "\n".join(lines)


def write_table(path: pathlib.Path = RESULTS) -> str:
    text = table()
    write_between(path, BEGIN, END, [text])
    return text


def main(argv):
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    parser.add_argument("--methods", default=",".join(GLUE_METHODS))
    parser.add_argument("--mixing", default="mixture",
                        help=f"how the tasks share a batch; accepted: {', '.join(MIXINGS)}")
    args = parser.parse_args(argv)
    if args.compare:
        compare(parser, args.compare, RECORDS, lambda r: r["glue_average"])
        return
    if args.table:
        print(write_table())
        return
    methods = args.methods.split(",")
    check_run_arguments(parser, args, methods, GLUE_METHODS)
    if args.mixing not in MIXINGS:
        parser.error(f"--mixing={args.mixing!r}; accepted: {', '.join(MIXINGS)}")
    for seed in (int(s) for s in args.seeds.split(",")):
        for method in methods:
            run(method, args.mixing, seed, args)
    print(write_table())


if __name__ == "__main__":
    main(sys.argv[1:])
