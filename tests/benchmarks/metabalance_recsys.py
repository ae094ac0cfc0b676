"""The MetaBalance study on the shared Tmall data (He et al., WWW 2022, Table 4.3).

Every method is one gin experiment file under `gin/experiments/recsys/` (parsed fresh for
each run, budget and seed passed as gin bindings). MetaBalance's strategy (both, reduce,
enlarge) and relax factor are chosen on VALIDATION NDCG@10 of the first seed only; the
chosen configuration is then run for every seed, like every other method. Writes, between
the `<!-- metabalance_recsys:begin -->` and `end` markers of `docs/results_recsys.md` (the
hand-written sections around them are kept), the report (methods x N@10, R@10, P@10, N@20, R@20, P@20 on test, mean
+- standard deviation over seeds, a popularity reference row, the budget used) and the
relax-factor curve `docs/results_recsys_relax.png`. The last output line is JSON with
each method's mean test NDCG@10.

    KTX_DATA_DIR=/work/shared/data python tests/benchmarks/metabalance_recsys.py \
        --seeds 0,1,2 --max_epochs 100 --patience 20          # the paper's budget
    ... --max_epochs 3 --patience 3 --eval_max_users 2000 --test_max_users 8000 \
        --relax_factors 0.1,0.3,0.5,0.7,0.9 --other_relax_factors 0.7   # a reduced run

`--records` (default `docs/results/recsys/`) keeps every finished run as one small JSON
record (experiment, seed, bindings and budget, validation NDCG@10 and training loss per
epoch, test metrics at the best epoch, times), named after its experiment, seed and a
hash of its bindings; a run whose record exists is not run again. So a study too long for
one sitting runs in pieces (`--methods`, `--seeds`, `--strategies` select them), each
piece commits its records, and the report is rebuilt from the records of the whole set.

`--table` runs nothing and needs no data: it writes every record in `--records`, one
table per budget (the records' bindings other than seed and relax factor), between the
`<!-- recsys_records:begin -->` and `end` markers of `--out`: per method the seeds, the
best and last epoch of each (fewer epochs than the maximum: early stopping fired), the
validation and test NDCG@10 at the best epoch and the time the runs took.

    python tests/benchmarks/metabalance_recsys.py --table
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import pathlib
import sys
import time

import gin
import numpy as np

from ktx import cli
from ktx.studies import recsys as recsys_study
from ktx.data import recsys as recsys_data
from ktx.models.recsys import PopularityScorer
from ktx.runs.rank_eval import RankingEvaluator
from report_markers import write_between  # beside this script

REPO = pathlib.Path(__file__).resolve().parents[2]
EXPERIMENTS = REPO / "gin" / "experiments" / "recsys"
METRICS = ("ndcg@10", "recall@10", "precision@10", "ndcg@20", "recall@20", "precision@20")
HEADERS = ("N@10", "R@10", "P@10", "N@20", "R@20", "P@20")
STRATEGY_FILES = {"both": "metabalance", "reduce": "metabalance_reduce", "enlarge": "metabalance_enlarge"}
NAMES = {
    "single_loss": "Single-Loss", "vanilla_multi": "Vanilla-Multi", "fixed_weights": "Fixed weights",
    "uncertainty": "Uncertainty", "dwa": "DWA", "gradnorm": "GradNorm", "mgda": "MGDA",
    "mtadam": "MTAdam", "grad_similarity": "GradSimilarity", "pcgrad": "PCGrad",
    "pcgrad_anchored": "PCGrad (anchored)", "olaux": "OL-AUX",
    "metabalance_no_ma": "MetaBalance w/o moving average",
}


def run_experiment(name: str, data, bindings: dict[str, object],
                   model_dir: pathlib.Path | None = None) -> dict:
    """Parses `gin/experiments/recsys/<name>.gin` with `bindings` and runs it on `data`
    (in `model_dir`, a `ktx train` run directory, when given; else a temporary one)."""
    path = EXPERIMENTS / f"{name}.gin"
    if not path.is_file():
        known = sorted(p.stem for p in EXPERIMENTS.glob("*.gin") if p.stem != "base")
        raise ValueError(f"--methods: no experiment {path}; known: {known}")
    gin.clear_config(clear_constants=True)
    try:
        cli.parse_gin([str(path)], [(k, repr(v)) for k, v in bindings.items()])
        return gin.get_configurable(recsys_study.run_config)(
            data=data, verbose=False, model_dir=model_dir)
    finally:
        gin.clear_config(clear_constants=True)


def _shown(path: pathlib.Path) -> str:
    """`path` relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _fmt(values: list[float]) -> str:
    v = np.asarray(values)
    return f"{v.mean():.4f} ± {v.std():.4f}" if len(v) > 1 else f"{v.mean():.4f}"


BEGIN, END = "<!-- metabalance_recsys:begin -->", "<!-- metabalance_recsys:end -->"
TABLE_BEGIN, TABLE_END = "<!-- recsys_records:begin -->", "<!-- recsys_records:end -->"


_BUDGET_NAMES = {
    "MAX_EPOCHS": "up to {} epochs", "recsys_study.run_config.patience": "patience {}",
    "STEPS_PER_EPOCH": "{} steps per epoch", "EVAL_MAX_USERS": "validation on {} users",
    "TEST_MAX_USERS": "test on {} users", "NUM_NEGATIVES": "{} negatives per positive",
}
_LABELS = {**NAMES, **{v: f"MetaBalance ({k})" for k, v in STRATEGY_FILES.items()}}


def _budget_text(budget: dict) -> str:
    """One line naming a group's budget (its bindings other than seed and relax factor)."""
    parts = []
    for name, value in budget.items():
        if name in _BUDGET_NAMES and value is not None:
            parts.append(_BUDGET_NAMES[name].format(value))
        elif name == "STEPS_PER_EPOCH":
            parts.append("full epochs")
        elif name in ("EVAL_MAX_USERS", "TEST_MAX_USERS"):
            parts.append(("validation" if name.startswith("EVAL") else "test") + " on all users")
        else:
            parts.append(f"`{name} = {value!r}`")
    return ", ".join(parts)


def records_table(records: pathlib.Path) -> list[str]:
    """The lines of one table per budget over every record in `records` (see `--table`)."""
    paths = sorted(records.glob("*.json"))
    if not paths:
        raise SystemExit(f"--records {records}: no records (*.json) there")
    groups: dict[str, dict[tuple, list[dict]]] = {}
    budgets: dict[str, dict] = {}
    for path in paths:
        try:
            record = json.loads(path.read_text())
            bindings = dict(record["bindings"])
            for split, metric in (("validation", "ndcg@10"), ("test", "ndcg@10"), ("test", "recall@10")):
                float(record["result"][split][metric])
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"{path}: not a study record ({type(e).__name__}: {e})") from None
        seed = bindings.pop("SEED")
        relax = bindings.pop("RELAX_FACTOR", None)
        key = json.dumps(bindings, sort_keys=True)
        budgets[key] = bindings
        row = (record["experiment"], relax)
        groups.setdefault(key, {}).setdefault(row, []).append({**record, "seed": seed})

    def order(row):  # Single-Loss first, MetaBalance last, as in the report
        name = row[0]
        return (name != "single_loss", name.startswith("metabalance"), name, row[1] or 0)

    lines = []
    for key in sorted(groups, key=lambda k: (-(budgets[k].get("MAX_EPOCHS") or 0), k)):
        budget = budgets[key]
        max_epochs = budget.get("MAX_EPOCHS")
        lines += ["", f"**{_budget_text(budget)}**", "",
                  "| method | seeds | epochs, best / run per seed | validation N@10 | test N@10 "
                  "| test R@10 | train s / epoch | wall h |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in sorted(groups[key], key=order):
            rs = sorted(groups[key][row], key=lambda r: r["seed"])
            name, relax = row
            label = _LABELS.get(name, name)
            if relax is not None:
                label = label[:-1] + f", r={relax})" if label.endswith(")") else f"{label} (r={relax})"
            epochs = []
            for r in rs:
                res = r["result"]
                mark = " es" if max_epochs and res["epochs"] < max_epochs else ""
                mark += " †" if res.get("resumed_from_epoch") else ""
                epochs.append(f"{res['best_epoch']}/{res['epochs']}{mark}")
            per_epoch = [r["result"]["train_seconds_per_epoch"] for r in rs
                         if r["result"].get("train_seconds_per_epoch")]
            lines.append(
                f"| {label} | {','.join(str(r['seed']) for r in rs)} | {', '.join(epochs)} "
                f"| {_fmt([r['result']['validation']['ndcg@10'] for r in rs])} "
                f"| {_fmt([r['result']['test']['ndcg@10'] for r in rs])} "
                f"| {_fmt([r['result']['test']['recall@10'] for r in rs])} "
                f"| {f'{np.mean(per_epoch):.1f}' if per_epoch else '-'} "
                f"| {sum(r['wall_seconds'] for r in rs) / 3600:.2f} |")
    return [
        f"Every run record in `{_shown(records)}`, one table per budget (written by "
        "`tests/benchmarks/metabalance_recsys.py --table`). Test metrics at the best validation "
        "epoch; mean ± standard deviation (population) where a row has several seeds. `es`: "
        "early stopping fired (fewer epochs than the budget's maximum); `†`: the run was "
        "resumed from a checkpoint, and its wall time counts only its last piece.",
        *lines,
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default="single_loss,vanilla_multi,fixed_weights,uncertainty,dwa,"
                    "gradnorm,mgda,mtadam,grad_similarity,pcgrad,pcgrad_anchored,olaux,"
                    "metabalance_no_ma")
    ap.add_argument("--strategies", default="both,reduce,enlarge")
    ap.add_argument("--relax_factors", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9")
    ap.add_argument("--max_epochs", type=int, default=100)
    ap.add_argument("--patience", type=int, default=20)
    ap.add_argument("--steps_per_epoch", type=int, default=0, help="0: full epochs")
    ap.add_argument("--eval_max_users", type=int, default=0,
                    help="validation users ranked per evaluation, a fixed random subset (0: all)")
    ap.add_argument("--test_max_users", type=int, default=0,
                    help="test users ranked at the best epoch, a fixed random subset (0: all)")
    ap.add_argument("--other_relax_factors", default=None,
                    help="relax factors tried for the strategies after the first "
                         "(default: --relax_factors)")
    ap.add_argument("--records", default=str(REPO / "docs" / "results" / "recsys"),
                    help="folder of finished runs' records (one JSON each, keyed by "
                         "experiment, seed, bindings and budget): reused, and added to")
    ap.add_argument("--data_dir", default=None)
    ap.add_argument("--work_dir", default=None,
                    help="keep each run's ktx train directory (checkpoints, metrics.jsonl, "
                         "TensorBoard) under this folder, named as its record; default: "
                         "temporary directories, removed after each run")
    ap.add_argument("--out", default=str(REPO / "docs" / "results_recsys.md"))
    ap.add_argument("--png", default=str(REPO / "docs" / "results_recsys_relax.png"))
    ap.add_argument("--table", action="store_true",
                    help="run nothing: write every record's budget table to --out (no data needed)")
    # Extra gin bindings for every run, as `ktx train` takes them (a Python literal value;
    # part of each record's key): --gin.NUM_NEGATIVES=4
    rest, extra_bindings = cli._split_gin_flags(sys.argv[1:])
    args = ap.parse_args(rest)
    if args.table:
        if extra_bindings:
            raise SystemExit("--table runs nothing: it takes no --gin. bindings")
        lines = records_table(pathlib.Path(args.records))
        write_between(pathlib.Path(args.out), TABLE_BEGIN, TABLE_END, lines)
        print("\n".join(lines))
        return
    seeds = [int(s) for s in args.seeds.split(",") if s]
    methods = [m for m in args.methods.split(",") if m]
    strategies = [s for s in args.strategies.split(",") if s]
    for s in strategies:
        if s not in STRATEGY_FILES:
            raise ValueError(f"--strategies: {s!r}; accepted: {sorted(STRATEGY_FILES)}")
    relax = [float(r) for r in args.relax_factors.split(",") if r]
    other_relax = relax if args.other_relax_factors is None else [
        float(r) for r in args.other_relax_factors.split(",") if r]
    budget = {"MAX_EPOCHS": args.max_epochs,
              "recsys_study.run_config.patience": args.patience,
              "STEPS_PER_EPOCH": args.steps_per_epoch or None,
              "EVAL_MAX_USERS": args.eval_max_users or None,
              "TEST_MAX_USERS": args.test_max_users or None}
    for name, value in extra_bindings:
        try:
            budget[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--gin.{name}={value}: the value must be a Python literal, "
                             "e.g. --gin.NUM_NEGATIVES=4") from None
    if args.data_dir:
        budget["recsys_data.load_tmall_pairs.directory"] = str(pathlib.Path(args.data_dir) / "recsys" / "tmall")
    data = recsys_data.load_tmall_pairs(budget.get("recsys_data.load_tmall_pairs.directory"))

    records = pathlib.Path(args.records)
    walls: list[float] = []

    def run(name, seed, extra=None):
        t = time.perf_counter()
        bindings = {**budget, "SEED": seed, **(extra or {})}
        key = json.dumps([name, bindings], sort_keys=True)
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        path = records / f"{name}-seed{seed}-{digest}.json"
        if path.is_file():
            record = json.loads(path.read_text())
            if record["key"] != key:
                raise ValueError(f"{path}: its key {record['key']} is not this run's {key}")
            r = record["result"]
        else:
            r = run_experiment(name, data, bindings, model_dir=pathlib.Path(
                args.work_dir).resolve() / path.stem if args.work_dir else None)
            r = json.loads(json.dumps(r, default=float))  # plain floats, as recorded
            records.mkdir(parents=True, exist_ok=True)
            record = {"experiment": name, "seed": seed, "bindings": bindings, "key": key,
                      "wall_seconds": round(time.perf_counter() - t, 1), "result": r}
            path.write_text(json.dumps(record, indent=1) + "\n")
        walls.append(record["wall_seconds"])
        print(f"{name} seed {seed} {extra or ''}: best epoch {r['best_epoch']}/{r['epochs']} "
              f"val N@10 {r['validation']['ndcg@10']:.4f} test N@10 {r['test']['ndcg@10']:.4f} "
              f"({time.perf_counter() - t:.0f}s)", flush=True)
        return r

    # 1. MetaBalance: strategy x relax factor on the first seed, chosen on validation.
    grid = {}
    for i, s in enumerate(strategies):
        for r in relax if i == 0 else other_relax:
            grid[(s, r)] = run(STRATEGY_FILES[s], seeds[0], {"RELAX_FACTOR": r})
    best_s, best_r = max(grid, key=lambda k: grid[k]["validation"]["ndcg@10"])
    results: dict[str, list[dict]] = {}
    results[f"MetaBalance ({best_s}, r={best_r})"] = [grid[(best_s, best_r)]] + [
        run(STRATEGY_FILES[best_s], seed, {"RELAX_FACTOR": best_r}) for seed in seeds[1:]
    ]
    # 2. Every other method, every seed.
    failed: dict[str, str] = {}
    for m in methods:
        extra = {"RELAX_FACTOR": best_r} if m == "metabalance_no_ma" else None
        label = NAMES.get(m, m) + (f" (r={best_r})" if extra else "")
        try:
            results[label] = [run(m, seed, extra) for seed in seeds]
        except Exception as e:  # reported in the results file, not dropped
            failed[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"{m} FAILED: {failed[label]}", flush=True)

    # The non-personalised reference: items by training purchases, same users and exclusions.
    pop = PopularityScorer()
    popularity = RankingEvaluator(data, split="test", max_users=args.test_max_users or None).rank(
        pop, pop.params(data.train[data.target], data.num_items))

    order = [k for k in results if not k.startswith("MetaBalance (")] + [
        k for k in results if k.startswith("MetaBalance (")]
    full_steps = next(iter(grid.values()))["steps_per_epoch"] if args.steps_per_epoch == 0 else None
    lines = [
        "# MetaBalance study on Tmall (ktx)",
        "",
        "Written by `tests/benchmarks/metabalance_recsys.py`. Data: `recsys/tmall` of the",
        f"shared data folder ({data.num_users} users, {data.num_items} items; target buy, "
        "auxiliaries collect and cart; given splits, leakage removed). Model and optimizer:",
        "`gin/models/recsys_shared_bottom.gin` (He et al., 2022: embeddings 64, bottom MLP",
        "(32, 16, 8) + MF, towers (64, 32), dropout 0.5, Adam 1e-3, L2 1e-7, batch 256, "
        f"{budget.get('NUM_NEGATIVES', 1)}",
        "negative(s) per positive). Test metrics at the epoch with the best validation NDCG@10,",
        f"mean ± standard deviation (population) over seeds {seeds}; every method is the gin",
        "file of its name under `gin/experiments/recsys/`.",
        "",
        "## Budget",
        "",
        f"* max epochs {args.max_epochs}, early-stopping patience {args.patience} evaluations, "
        "one evaluation per epoch",
        f"* steps per epoch: {args.steps_per_epoch or f'full epochs ({full_steps} steps of 256)'}",
        f"* ranked users: validation {args.eval_max_users or 'all'}, test "
        f"{args.test_max_users or 'all'} (fixed random subsets, the same for every run); all "
        f"{data.num_items} items ranked, each user's training items (every behaviour) excluded",
        f"* MetaBalance grid (seed {seeds[0]}, chosen on validation NDCG@10 only): "
        + "; ".join(f"{s_} r in {sorted(r for (s2, r) in grid if s2 == s_)}" for s_ in strategies)
        + f"; chosen: {best_s}, r={best_r}",
        f"* {len(walls)} runs, {sum(walls) / 3600:.1f} h of training and ranking in all on "
        f"this machine (the sum of their records' wall times; records in "
        f"`{_shown(records)}`)",
        "* epochs: `best/run` per seed; fewer run than the maximum means early stopping fired",
    ]
    if args.steps_per_epoch or args.eval_max_users or args.test_max_users or args.max_epochs < 100 \
            or args.patience < 20 or len(seeds) < 3:
        lines += ["", "This is a REDUCED study (the paper trains up to 100 full epochs with "
                  "patience 20 and ranks every user); numbers are not comparable with the "
                  "paper's Table 4.3, and a difference between two methods means little unless "
                  "it exceeds their spreads over seeds."]
    lines += ["", "## Test metrics (Table 4.3 layout)", "",
              "| method | " + " | ".join(HEADERS) + " | epochs (best/run) per seed |",
              "|---" * (len(HEADERS) + 2) + "|",
              "| Popularity (no training) | " + " | ".join(f"{popularity[m]:.4f}" for m in METRICS)
              + " | - |"]
    for k in order:
        rs = results[k]
        cells = [_fmt([r["test"][m] for r in rs]) for m in METRICS]
        lines.append(f"| {k} | " + " | ".join(cells) + " | "
                     + ", ".join(f"{r['best_epoch']}/{r['epochs']}" for r in rs) + " |")
    for k, err in failed.items():
        lines.append(f"| {k} | FAILED: {err} |" + " |" * len(HEADERS))
    lines += ["", "## MetaBalance grid (seed %d)" % seeds[0], "",
              "| strategy | relax factor | validation N@10 | test N@10 |", "|---|---|---|---|"]
    for (s_, r), res in sorted(grid.items()):
        lines.append(f"| {s_} | {r} | {res['validation']['ndcg@10']:.4f} | {res['test']['ndcg@10']:.4f} |")
    if extra_bindings:
        lines += ["", "Extra bindings of every run: " + ", ".join(
            f"`{name} = {value}`" for name, value in extra_bindings)]
    lines += ["", f"![relax factor curve]({pathlib.Path(args.png).name})"]
    write_between(pathlib.Path(args.out), BEGIN, END, lines)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for s_ in strategies:
        rs_ = sorted(r for (s2, r) in grid if s2 == s_)
        style = "o-" if len(rs_) > 1 else "s"
        ax.plot(rs_, [grid[(s_, r)]["validation"]["ndcg@10"] for r in rs_], style, label=f"{s_} (val)")
    rs_ = sorted(r for (s2, r) in grid if s2 == best_s)
    ax.plot(rs_, [grid[(best_s, r)]["test"]["ndcg@10"] for r in rs_], "k--", label=f"{best_s} (test)")
    ax.set_xlabel("relax factor r")
    ax.set_ylabel("NDCG@10")
    ax.set_title("MetaBalance on Tmall (seed %d)" % seeds[0])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print("\n".join(lines))
    print(json.dumps({"benchmark": "metabalance_recsys", "seeds": seeds,
                      "test_ndcg@10": {"Popularity (no training)": round(popularity["ndcg@10"], 5),
                                       **{k: round(float(np.mean([r["test"]["ndcg@10"] for r in results[k]])), 5)
                                          for k in order}},
                      "failed": sorted(failed)}))


if __name__ == "__main__":
    main()
