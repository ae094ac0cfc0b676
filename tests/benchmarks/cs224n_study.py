"""The CS224N encoder study from the pretrained all-MiniLM-L6-v2, run in pieces: each
(method, seed) trains with `ktx train`, is scored by `cs224n_scores.py`, and leaves a small
record (config flags, seed, steps, wall time, train loss every log period, dev scores) in
`docs/results/cs224n/<method>-seed<k>.json`; finished records are skipped, and `--table`
rebuilds the markdown table from the records alone (written between the
`<!-- cs224n_study:begin -->` and `end` markers of docs/results.md, as after every run).

    DIR=$(python -m ktx.convert.minilm)
    KTX_DATA_DIR=... python tests/benchmarks/cs224n_study.py --minilm "$DIR" \
        --methods plain,ca_mtl,pals,mt_uncertainty --seeds 0 --steps 600
    python tests/benchmarks/cs224n_study.py --table
    python tests/benchmarks/cs224n_study.py --compare pals-steps1800-lr0.0002,plain-steps1800-lr0.0002

`--compare A,B` prints two groups of records side by side on the seeds both have, with a
paired t-test (one JSON line; glue_study.py takes it too, on the GLUE average).

Every method shares the reduced budget the flags give (`--steps` of BATCH_SIZE rows,
`--length` tokens, mean pooling: all-MiniLM-L6-v2 was trained with it), AdamW with linear
decay to `--peak_lr` (runs/encoder_train.gin), and differs only by its gin files in
`METHODS`; `single_task` trains one model per task instead, each for `--steps`. The
default budget (600 steps, 64 tokens, 5e-5) names a record
`<method>-seed<k>.json`; any other budget adds itself to the name
(`slapbert-steps1800-lr0.0002-seed0.json`), so a record is never taken for another budget's.

With `--work_dir`, each run trains in `<work_dir>/<record name without .json>` (single-task:
one sub-folder per task), kept after the run with its latest two checkpoints; a run stopped
part-way (the end of a sitting, a `kill`) continues from its latest checkpoint when the same
command is given again with `--resume` (`ktx train` resumes exactly; `--checkpoint_period`
sets how many steps a stop can lose). A resumed run's record keeps the step it resumed from
and the wall time of its last piece only (`train_seconds` is then unknown: `n/a` in the
table). Without `--work_dir` every run trains in a fresh temporary folder.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

from cs224n_scores import TASKS, overall  # beside this script
from report_markers import write_between

REPO = pathlib.Path(__file__).resolve().parents[2]
RECORDS = REPO / "docs" / "results" / "cs224n"
RESULTS = REPO / "docs" / "results.md"
BEGIN, END = "<!-- cs224n_study:begin -->", "<!-- cs224n_study:end -->"
PROXY = "{'cs224n_sts_bert_v001': 'cs224n_quora_bert_v001'}"
DEFAULT_BUDGET = {"steps": 600, "max_seq_length": 64, "peak_learning_rate": 5e-5}


def _anneal_within(steps: int) -> list[str]:
    """The annealed schedule's 10 epochs squeezed into the run's budget (at 600 steps of 32
    rows, one real epoch of the three tasks' 32,774 rows would be 1,024 steps)."""
    return ["--gin.ANNEAL_EPOCHS=10", f"--gin.ANNEAL_STEPS_PER_EPOCH={max(1, steps // 10)}"]


# method -> (description, gin files after experiments/cs224n_encoders/minilm_l6.gin, flags or a
# function of the run's steps giving them)
METHODS = {
    "single_task": ("single-task fine-tuning (one model per task, --steps each)", [], []),
    "plain": ("plain multi-task", [], []),
    "ca_mtl": ("CA-MTL Base (bottom half and embeddings frozen)", ["conditioning/ca_mtl.gin"],
               ["--gin.CAMTL_VARIANT='base'"]),
    "pals": ("PALs (d_s = 102, 6 heads: 204 x 384 / 768)", ["conditioning/pals.gin"],
             ["--gin.PALS_SIZE=102"]),
    "tea_qkv": ("TEA-BERT, task Q/K/V embeddings", ["conditioning/tea_qkv.gin"], []),
    "tea_input": ("TEA-BERT, task embedding added to the input embeddings",
                  ["conditioning/tea_input.gin"], []),
    "tea_projected": ("TEA-BERT, task embedding projected into every layer's Q/K/V",
                      ["conditioning/tea_projected.gin"], []),
    "tea_projected_act": ("TEA-BERT, projected task Q/K/V with an activation",
                          ["conditioning/tea_projected_act.gin"], []),
    "cosine_sts": ("plain multi-task, STS on a cosine head (sentences encoded alone)",
                   ["experiments/cs224n_encoders/cosine_sts.gin"], []),
    "slapbert": ("shared top layer + PCGrad (mixed batches)",
                 ["conditioning/shared_layer.gin", "optim/pcgrad.gin"], []),
}


def _annealed(base: str, description: str) -> tuple:
    """`base`'s gin files and flags plus the annealed schedule fitted into the run's steps."""
    _, files, flags = METHODS[base]
    return (description, [*files, "runs/annealed_sampling.gin"],
            lambda steps: [*flags, *_anneal_within(steps)])


def _uncertain(base: str, description: str) -> tuple:
    """`base`'s gin files and flags plus MT-uncertainty sampling (CA-MTL Algorithm 1): 96
    candidate rows per batch, 32 from each task, of which the step keeps the 32 least
    certain; STS borrows the Quora rows' scores (it has no entropy)."""
    _, files, flags = METHODS[base]
    return (description, [*files, "runs/mt_uncertainty.gin"],
            [*flags, "--gin.BATCH_SIZE=96", "--gin.MT_UNCERTAINTY_ROWS=32",
             f"--gin.MT_UNCERTAINTY_PROXIES={PROXY}"])


METHODS.update(
    mt_uncertainty=_uncertain("plain", "plain + MT-uncertainty sampling (96 candidates, 32 kept)"),
    # CA-MTL as its paper trains it: its model with its own sampler.
    ca_mtl_uncertainty=_uncertain(
        "ca_mtl", "CA-MTL Base + MT-uncertainty sampling (96 candidates, 32 kept)"),
    annealed=_annealed("plain", "plain + annealed sampling (E = 10 epochs of steps / 10)"),
    slapbert_annealed=_annealed(
        "slapbert", "shared top layer + PCGrad + annealed sampling (E = 10 of steps / 10)"),
    ca_mtl_annealed=_annealed("ca_mtl", "CA-MTL Base + annealed sampling (E = 10 of steps / 10)"),
    pals_annealed=_annealed(
        "pals", "PALs (d_s = 102) + annealed sampling (E = 10 of steps / 10)"),
)


# Single-task fine-tuning trains one model per task (its own mixture of one, one head), each
# for the run's --steps of BATCH_SIZE rows: three times a multi-task run's rows and time.
SINGLE_TASK = "single_task"
SINGLE_TASKS = dict(zip(TASKS, (5, 2, 1)))  # task -> its head's labels (minilm_l6.gin's NUM_LABELS)


def _budget(record: dict) -> dict:
    """A record's budget; records written before the learning rate was a flag ran at the
    default one (runs/encoder_train.gin)."""
    return {k: record.get(k, DEFAULT_BUDGET[k]) for k in DEFAULT_BUDGET}


def record_name(method: str, seed: int, budget: dict) -> str:
    tags = {"steps": "steps", "max_seq_length": "len", "peak_learning_rate": "lr"}
    parts = [f"{tags[k]}{budget[k]:g}" for k in DEFAULT_BUDGET if budget[k] != DEFAULT_BUDGET[k]]
    return "-".join([method, *parts, f"seed{seed}"]) + ".json"


def _flags(method: str, minilm: str, seed: int, budget: dict, model_dir: str,
           experiment: str = "experiments/cs224n_encoders/minilm_l6.gin") -> list[str]:
    """`ktx train`'s flags for `method` on `experiment` (glue_study.py passes its own)."""
    _, files, extra = METHODS[method]
    steps = budget["steps"]
    extra = extra(steps) if callable(extra) else extra
    return ([f"--gin_file={experiment}",
             *[f"--gin_file={f}" for f in files], "--gin_file=conditioning/mean_pooling.gin",
             f"--gin.MODEL_DIR='{model_dir}'", f"--gin.INITIAL_CHECKPOINT_PATH='hf:{minilm}'",
             f"--gin.ENCODER_VOCAB='{minilm}'", f"--gin.TRAIN_STEPS={steps}",
             f"--gin.MAX_SEQ_LENGTH={budget['max_seq_length']}", f"--gin.SEED={seed}",
             "--gin.optimizers.linear_decay_schedule.peak_learning_rate="
             f"{budget['peak_learning_rate']:g}"] + extra)


def _latest_step(model_dir: pathlib.Path) -> int | None:
    """The newest complete checkpoint step under `model_dir` (None: it holds none)."""
    from ktx.training.checkpoints import resolve_checkpoint  # jax and orbax: training only
    try:
        return int(resolve_checkpoint(model_dir).name)
    except FileNotFoundError:
        return None


def _model_dir(args, name: str) -> tuple[str, int | None]:
    """A run's MODEL_DIR and the checkpoint step it resumes from (None: a fresh run):
    `<--work_dir>/<name>`, kept so `--resume` can continue it, else a temporary folder."""
    if args.work_dir is None:
        return tempfile.mkdtemp(prefix=f"cs224n_{name.replace('/', '_')}_"), None
    path = pathlib.Path(args.work_dir).resolve() / name
    step = _latest_step(path)
    if step is not None and not args.resume:
        raise SystemExit(f"{pathlib.Path(sys.argv[0]).stem}: {path} holds a checkpoint (step {step}) of an earlier "
                         "run of these flags; pass --resume to continue it, or remove the folder "
                         "to start over")
    path.mkdir(parents=True, exist_ok=True)
    return str(path), step


def _train_and_score(flags: list[str], model_dir: str, adopt: bool):
    """Trains one run (unless adopted), scores it; (train seconds or None, scores, train
    losses every log period)."""
    start = time.time()
    if not adopt:  # else: a finished run of exactly these flags, trained earlier
        subprocess.run([sys.executable, "-m", "ktx", "train", *flags], check=True, cwd=REPO)
    seconds = None if adopt else round(time.time() - start, 1)
    scored = subprocess.run([sys.executable, str(REPO / "tests/benchmarks/cs224n_scores.py"),
                             *flags], check=True, cwd=REPO, capture_output=True, text=True)
    scores = json.loads(scored.stdout.strip().splitlines()[-1])
    losses = [{"step": r["step"], "loss": r["loss"]}
              for r in map(json.loads, (pathlib.Path(model_dir) / "metrics.jsonl").read_text().splitlines())
              if r.get("split") == "train" and r.get("task") == "all"]
    return seconds, {k: v for k, v in scores.items() if k not in ("benchmark", "model_dir")}, losses


def _saving_flags(args) -> list[str]:
    """How often a run saves and how many checkpoints it keeps: they serve `--resume` and the
    scoring of the last step only, so the latest two (the newer one may be cut short by a
    stop) instead of every one (an 1,800-step MiniLM run's 18 would take 3.7 GB)."""
    return ["--gin.train_script.train.keep_checkpoints=2"] + (
        [] if args.checkpoint_period is None
        else [f"--gin.train_script.train.checkpoint_period={args.checkpoint_period}"])


def _recorded(flags: list[str]) -> list[str]:
    """The flags a record keeps: not the machine's paths, not the saving flags (they do not
    change what is trained)."""
    return [f for f in flags if "MODEL_DIR" not in f and "'hf:" not in f and "ENCODER_VOCAB" not in f
            and "checkpoint_period" not in f and "keep_checkpoints" not in f]


def run(method: str, seed: int, args) -> dict:
    budget = {"steps": args.steps, "max_seq_length": args.length, "peak_learning_rate": args.peak_lr}
    out = RECORDS / record_name(method, seed, budget)
    if out.exists():
        print(f"{out.name}: cached", flush=True)
        return json.loads(out.read_text())
    stem = out.name.removesuffix(".json")
    extra = _saving_flags(args)
    resumed: dict[str, int] = {}  # run (task for single-task) -> step it resumed from
    if method == SINGLE_TASK:
        flags, seconds, scores, losses = {}, 0.0, {}, {}
        for task, labels in SINGLE_TASKS.items():
            model_dir, step = _model_dir(args, f"{stem}/{task}")
            if step is not None:
                resumed[task] = step
            flags[task] = _flags(method, args.minilm, seed, budget, model_dir) + extra + [
                f"--gin.MIXTURE_OR_TASK_NAME='{task}'", "--gin.NUM_TASKS=1",
                f"--gin.NUM_LABELS=({labels},)"]
            took, scored, losses[task] = _train_and_score(flags[task], model_dir, False)
            seconds += took
            scores.update(scored)  # each task's own keys; `step`: the runs' common last step
        scores["overall"] = overall(scores)
        flags = {task: _recorded(f) for task, f in flags.items()}
    else:
        model_dir, step = (args.adopt, None) if args.adopt else _model_dir(args, stem)
        if step is not None:
            resumed[method] = step
        flags = _flags(method, args.minilm, seed, budget, model_dir) + extra
        seconds, scores, losses = _train_and_score(flags, model_dir, bool(args.adopt))
        flags = _recorded(flags)
    record = {"method": method, "description": METHODS[method][0], "seed": seed,
              **budget, "flags": flags, "train_seconds": seconds, "train_loss": losses,
              "scores": scores}
    if resumed:  # `seconds` timed this invocation only: the earlier pieces' time is unknown
        record.update(train_seconds=None, resumed_from_step=resumed, last_piece_seconds=seconds)
    RECORDS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({"method": method, "seed": seed, **record["scores"]}), flush=True)
    return record


def _seconds(records) -> str:
    known = [r["train_seconds"] for r in records if r["train_seconds"] is not None]
    return f"{sum(known) / len(known):.0f}" if known else "n/a"


def _per_seed(records: list[dict], digits: int = 3) -> str:
    """Each seed's overall, in seed order, with the sample standard deviation when there
    are several."""
    values = [r["scores"]["overall"] for r in sorted(records, key=lambda r: r["seed"])]
    text = " / ".join(f"{v:.{digits}f}" for v in values)
    if len(values) > 1:
        mean = sum(values) / len(values)
        sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        text += f" (sd {sd:.{digits + 1}f})"
    return text


def paired(directory: pathlib.Path, a: str, b: str, score) -> dict:
    """Two groups of records in `directory` compared seed by seed: `a` and `b` are record
    names without `-seed<k>.json` (`tea_input-steps1800-lr0.0002`), `score(record)` the
    figure compared. On the seeds both have: each side's scores, the differences a - b,
    their mean and a paired t-test (`scipy.stats.ttest_rel`; t and p are None below two
    seeds). A ValueError names a group with no record and the groups there are."""
    import scipy.stats

    def by_seed(stem: str) -> dict[int, float]:
        records = [json.loads(p.read_text()) for p in directory.glob(f"{stem}-seed*.json")
                   if p.name.removeprefix(f"{stem}-seed").removesuffix(".json").isdigit()]
        if not records:
            groups = sorted({p.name.rsplit("-seed", 1)[0] for p in directory.glob("*-seed*.json")})
            raise ValueError(f"no record {stem}-seed<k>.json in {directory}; "
                             f"the records there: {', '.join(groups)}")
        return {r["seed"]: score(r) for r in records}

    scores_a, scores_b = by_seed(a), by_seed(b)
    seeds = sorted(set(scores_a) & set(scores_b))
    left, right = [scores_a[s] for s in seeds], [scores_b[s] for s in seeds]
    differences = [x - y for x, y in zip(left, right)]
    t = p = None
    if len(seeds) > 1:
        test = scipy.stats.ttest_rel(left, right)
        t, p = float(test.statistic), float(test.pvalue)
    return {"a": a, "b": b, "seeds": seeds, "scores_a": left, "scores_b": right,
            "differences": differences,
            "mean_difference": sum(differences) / len(seeds) if seeds else None, "t": t, "p": p}


def compare(parser: argparse.ArgumentParser, spec: str, directory: pathlib.Path, score) -> None:
    """`--compare A,B`: print `paired`'s comparison as one JSON line (`parser.error` for a
    bad spec or a group with no record)."""
    stems = spec.split(",")
    if len(stems) != 2 or not all(stems):
        parser.error(f"--compare={spec!r}: accepted: two record names without -seed<k>.json, "
                     "comma-separated (plain-steps1800-lr0.0002,pals-steps1800-lr0.0002)")
    try:
        print(json.dumps(paired(directory, *stems, score)))
    except ValueError as e:
        parser.error(f"--compare: {e}")


def table() -> str:
    records = [json.loads(p.read_text()) for p in sorted(RECORDS.glob("*.json"))]
    lines = ["| method | seeds | steps | length | peak lr | SST-5 acc | Quora acc* | STS r | overall "
             "| overall per seed | train s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}  # (method, steps, length, peak lr) -> its records
    for r in records:
        groups.setdefault((r["method"], *_budget(r).values()), []).append(r)
    for method in METHODS:
        for key in sorted(k for k in groups if k[0] == method):
            mine = groups[key]

            def mean(name, mine=mine):
                return sum(r["scores"][name] for r in mine) / len(mine)

            _, steps, length, peak_lr = key
            lines.append(
                f"| {mine[0]['description']} | {','.join(str(r['seed']) for r in mine)} | "
                f"{steps} | {length} | {peak_lr:g} | {mean('sst_accuracy'):.3f} | "
                f"{mean('quora_accuracy'):.3f} | {mean('sts_pearson'):.3f} | "
                f"**{mean('overall'):.3f}** | {_per_seed(mine)} | {_seconds(mine)} |")
    lines.append("| reference: the SlapBERT seeds' best dev overall (BERT-Base) | | | | | | | | 0.694 "
                 "| | |")
    return "\n".join(lines)


def write_table(path: pathlib.Path = RESULTS) -> str:
    """The table, also written between the study's markers in `path` (the text around
    them is kept)."""
    text = table()
    write_between(path, BEGIN, END, [text])
    return text


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every run of a study from all-MiniLM-L6-v2 takes (this one's and
    glue_study.py's): the checkpoint, seeds, budget, work folder and resuming, `--table`."""
    parser.add_argument("--minilm", help="the unpacked all-MiniLM-L6-v2 folder (python -m ktx.convert.minilm)")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=DEFAULT_BUDGET["steps"])
    parser.add_argument("--length", type=int, default=DEFAULT_BUDGET["max_seq_length"])
    parser.add_argument("--peak_lr", type=float, default=DEFAULT_BUDGET["peak_learning_rate"],
                        help="AdamW's peak learning rate (linear warm-up and decay)")
    parser.add_argument("--work_dir", default=None,
                        help="train each run in <work_dir>/<record name> and keep it (else a "
                             "temporary folder); see --resume")
    parser.add_argument("--resume", action="store_true",
                        help="continue runs stopped part-way in --work_dir from their latest "
                             "checkpoint (without it, a folder holding a checkpoint is an error)")
    parser.add_argument("--checkpoint_period", type=int, default=None,
                        help="steps between checkpoints (the most a stopped run can lose; "
                             "default: gin/runs/train.gin's)")
    parser.add_argument("--table", action="store_true",
                        help="only rebuild the table from the records")
    parser.add_argument("--compare", metavar="A,B", default=None,
                        help="only compare two groups of records seed by seed (record names "
                             "without -seed<k>.json): the scores, differences and a paired "
                             "t-test, as one JSON line")


def check_run_arguments(parser: argparse.ArgumentParser, args, methods: list[str], accepted) -> None:
    """`parser.error` for a training invocation's bad flags (`add_run_arguments`'s and a
    method outside `accepted`)."""
    if not args.minilm:
        parser.error("--minilm DIR is required to train (python -m ktx.convert.minilm prints it)")
    for method in methods:
        if method not in accepted:
            parser.error(f"--methods: {method!r}; accepted: {sorted(accepted)}")
    if args.resume and not args.work_dir:
        parser.error("--resume continues runs kept in --work_dir: pass --work_dir too")
    if args.checkpoint_period is not None and args.checkpoint_period < 1:
        parser.error(f"--checkpoint_period={args.checkpoint_period}: accepted: an int >= 1")


def main(argv):
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    parser.add_argument("--methods", default="plain")
    parser.add_argument("--adopt", default=None,
                        help="record an already trained MODEL_DIR of one --methods/--seeds run "
                             "(trained with the flags this script would give; wall time unknown)")
    args = parser.parse_args(argv)
    if args.compare:
        compare(parser, args.compare, RECORDS, lambda r: r["scores"]["overall"])
        return
    if args.table:
        print(write_table())
        return
    methods = args.methods.split(",")
    check_run_arguments(parser, args, methods, METHODS)
    if args.adopt and SINGLE_TASK in methods:
        parser.error("--adopt takes one run's MODEL_DIR; single_task trains three")
    for seed in (int(s) for s in args.seeds.split(",")):
        for method in methods:
            run(method, seed, args)
    print(write_table())


if __name__ == "__main__":
    main(sys.argv[1:])
