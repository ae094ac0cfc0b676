"""What a study is: arms x seeds x budgets, the metrics reported and how they are read.

A study file (gin, `gin/studies/*.gin`) configures `Study` and its `Arm`s; `ktx study`
(ktx.cli.study) parses it and builds these plain objects, and everything below the CLI
works on them. Every (arm, seed, budget) is one `Run`: one ordinary `ktx train` run
directory under the study directory.

    study = Study(name="toy", directory="/tmp/toy", seeds=[0, 1],
                  arms=[Arm("plain"), Arm("pals", gin_files=["conditioning/pals.gin"])],
                  metrics={"validation/all/accuracy": "higher"}, baseline="plain")
    [run.name for run in study.runs()]   # ['plain-seed0', 'plain-seed1', 'pals-seed0', ...]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Arm", "DIRECTIONS", "Run", "Study", "StudyError", "arm_definition", "parse_shard"]

DIRECTIONS = ("higher", "lower")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


class StudyError(ValueError):
    """A study file, study directory or flag is wrong; `field` names the study field
    (`Study.seeds`, `Arm.name`) the message is about, so the CLI can point at its line."""

    def __init__(self, message: str, field: str | None = None, value: Any = None):
        super().__init__(message)
        self.field, self.value = field, value


@dataclasses.dataclass(frozen=True)
class Arm:
    """One method of a study: gin files and bindings added to the study's own.

    Args:
      name: the arm's name in run directories, records and reports (letters, digits,
        `_ . + -`).
      gin_files: gin files after the study's `gin_files` (later files override).
      bindings: `{gin name: Python value}` applied after every file, like `--gin.` flags
        (`{'PALS_SIZE': 102}`, `{'optimizers.adamw.weight_decay': 0.0}`).
      description: the arm's label in reports (default: the name).
      single_task: a single-task arm: the Δm reference of the metrics it reports.
      budgets: the names of the study budgets this arm runs at (default: every one).
      tasks: train one model per entry instead of one (single-task fine-tuning as one
        arm): `{label: bindings}`, each added to the arm's; the run's record holds every
        sub-run's metrics (the metric names say which task they are of).
    """

    name: str
    gin_files: Sequence[str] = ()
    bindings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    description: str = ""
    single_task: bool = False
    budgets: Sequence[str] | None = None
    tasks: Mapping[str, Mapping[str, Any]] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise StudyError(f"Arm.name={self.name!r}; accepted: letters, digits and _ . + - "
                             "(it names run directories)", "Arm.name", self.name)
        object.__setattr__(self, "gin_files", tuple(_strings(self.gin_files, f"arm {self.name}: gin_files")))
        object.__setattr__(self, "bindings", dict(_bindings(self.bindings, f"arm {self.name}: bindings")))
        if self.budgets is not None:
            object.__setattr__(self, "budgets", tuple(_strings(self.budgets, f"arm {self.name}: budgets")))
        if self.tasks is not None:
            if not isinstance(self.tasks, Mapping) or not self.tasks:
                raise StudyError(f"arm {self.name}: tasks={self.tasks!r}; accepted: a non-empty "
                                 "dict {label: {gin name: value}}", "Arm.tasks", self.tasks)
            tasks = {}
            for label, b in self.tasks.items():
                if not isinstance(label, str) or not _NAME.fullmatch(label):
                    raise StudyError(f"arm {self.name}: tasks label {label!r}; accepted: letters, "
                                     "digits and _ . + -", "Arm.tasks", label)
                tasks[label] = dict(_bindings(b, f"arm {self.name}: tasks[{label!r}]"))
            object.__setattr__(self, "tasks", tasks)

    @property
    def label(self) -> str:
        return self.description or self.name


@dataclasses.dataclass(frozen=True)
class Run:
    """One (arm, seed, budget) of a study: `name` names its run directory and record."""

    arm: Arm
    seed: int
    budget: str
    budget_bindings: Mapping[str, Any]
    name: str


@dataclasses.dataclass
class Study:
    """A method-by-seed comparison.

    Args:
      name: the study's name (records carry it; a directory holds one study's records).
      directory: the study directory: run directories, records, claims, reports.
      arms: the `Arm`s, each name once.
      seeds: integers; each arm runs once per seed (bound to `seed_binding`).
      metrics: `{metric: 'higher' | 'lower'}`, the figures reported, in order, with the
        direction that is better. A metric is `split/task/metric` as the run's evaluators
        write it to metrics.jsonl (`validation/all/accuracy`,
        `validation_metrics/glue_rte_bert_v001/accuracy`; `ktx eval`'s rows, when
        `eval_gin_files` are given, under the same names), or a `derived_metrics` name.
      gin_files, bindings: every arm's first gin files and bindings.
      budgets: `{name: bindings}` (`{'600': {'TRAIN_STEPS': 600}}`); None: one budget,
        `default`, with no bindings.
      baseline: the arm every other arm is tested against (paired t-test on the seeds
        both have); None: no tests.
      eval_gin_files, eval_bindings: when given, `ktx eval` runs after training with the
        run's files, these files and bindings (e.g. `runs/recsys_eval.gin`).
      select_metric: which evaluation's scores a record keeps: None, the last one; a
        metric, the evaluation where it is best (its direction from `metrics`, else
        higher).
      derived_metrics: `{name: fn(metrics) -> float}`, computed from each record's metrics
        in order (`ktx.studies.derived`); later ones may use earlier ones.
      delta_metrics: the metrics Δm averages (default: every metric in `metrics` that a
        single-task arm reports and that is not derived).
      reference_budget: the budget whose single-task arms are the Δm reference of every
        budget (default: each budget its own).
      seed_binding, model_dir_binding: the macros a run's seed and directory are bound to.
      metric_labels: `{metric: column label}` of the report (default: the metric name).
      machine_bindings: bindings whose values are this machine's (paths): they are not
        part of an arm's definition, so workers on machines with other paths share runs.
      digits: decimals of the report's figures.
      sd_ddof: the report's standard deviation: 1, the sample's (the default); 0, the
        population's.
    """

    name: str
    directory: str
    arms: Sequence[Arm]
    seeds: Sequence[int]
    metrics: Mapping[str, str]
    gin_files: Sequence[str] = ()
    bindings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    budgets: Mapping[str, Mapping[str, Any]] | None = None
    baseline: str | None = None
    eval_gin_files: Sequence[str] = ()
    eval_bindings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    select_metric: str | None = None
    derived_metrics: Mapping[str, Callable[[Mapping[str, float]], float]] = dataclasses.field(
        default_factory=dict)
    delta_metrics: Sequence[str] | None = None
    reference_budget: str | None = None
    seed_binding: str = "SEED"
    model_dir_binding: str = "MODEL_DIR"
    metric_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    machine_bindings: Sequence[str] = ("INITIAL_CHECKPOINT_PATH", "ENCODER_VOCAB", "DATA_DIR")
    digits: int = 4
    sd_ddof: int = 1

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise StudyError(f"Study.name={self.name!r}; accepted: letters, digits and _ . + -",
                             "Study.name", self.name)
        if not isinstance(self.directory, str) or not self.directory:
            raise StudyError(f"Study.directory={self.directory!r}; accepted: a folder path",
                             "Study.directory", self.directory)
        arms = list(self.arms or ())
        if not arms or not all(isinstance(a, Arm) for a in arms):
            raise StudyError(f"Study.arms={self.arms!r}; accepted: a non-empty list of "
                             "@name/study.Arm()", "Study.arms", self.arms)
        seen: dict[str, int] = {}
        for arm in arms:
            seen[arm.name] = seen.get(arm.name, 0) + 1
            if seen[arm.name] == 2:
                raise StudyError(f"two arms are named {arm.name!r}; each arm needs its own name",
                                 "Arm.name", arm.name)
        self.arms = tuple(arms)
        if isinstance(self.seeds, (str, bytes)) or not isinstance(self.seeds, Sequence) or not self.seeds:
            raise StudyError(f"Study.seeds={self.seeds!r}; accepted: a non-empty list of integers "
                             "([0, 1, 2])", "Study.seeds", self.seeds)
        bad = [s for s in self.seeds if isinstance(s, bool) or not isinstance(s, int)]
        if bad:
            raise StudyError(f"Study.seeds={list(self.seeds)!r}: {bad[0]!r} is not an integer; "
                             "accepted: a list of integers ([0, 1, 2])", "Study.seeds", self.seeds)
        if len(set(self.seeds)) != len(self.seeds):
            raise StudyError(f"Study.seeds={list(self.seeds)!r} repeats a seed", "Study.seeds", self.seeds)
        self.seeds = tuple(self.seeds)
        if not isinstance(self.metrics, Mapping) or not self.metrics:
            raise StudyError(f"Study.metrics={self.metrics!r}; accepted: a non-empty dict "
                             "{'split/task/metric': 'higher' | 'lower'}", "Study.metrics", self.metrics)
        for metric, direction in self.metrics.items():
            if direction not in DIRECTIONS:
                raise StudyError(f"Study.metrics[{metric!r}]={direction!r}; accepted: "
                                 f"{' or '.join(map(repr, DIRECTIONS))}", "Study.metrics", metric)
        self.metrics = dict(self.metrics)
        self.gin_files = tuple(_strings(self.gin_files, "Study.gin_files"))
        self.eval_gin_files = tuple(_strings(self.eval_gin_files, "Study.eval_gin_files"))
        self.bindings = dict(_bindings(self.bindings, "Study.bindings"))
        self.eval_bindings = dict(_bindings(self.eval_bindings, "Study.eval_bindings"))
        budgets = {"default": {}} if self.budgets is None else self.budgets
        if not isinstance(budgets, Mapping) or not budgets:
            raise StudyError(f"Study.budgets={self.budgets!r}; accepted: a non-empty dict "
                             "{name: {gin name: value}}", "Study.budgets", self.budgets)
        self.budgets = {}
        for name, b in budgets.items():
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise StudyError(f"Study.budgets name {name!r}; accepted: letters, digits and "
                                 "_ . + -", "Study.budgets", name)
            self.budgets[name] = dict(_bindings(b, f"Study.budgets[{name!r}]"))
        names = [a.name for a in self.arms]
        for arm in self.arms:
            unknown = [b for b in arm.budgets or () if b not in self.budgets]
            if unknown:
                raise StudyError(f"arm {arm.name}: budgets {unknown} are not Study.budgets "
                                 f"({sorted(self.budgets)})", "Arm.budgets", unknown[0])
        if self.baseline is not None and self.baseline not in names:
            raise StudyError(f"Study.baseline={self.baseline!r} is not an arm; arms: "
                             f"{', '.join(names)}", "Study.baseline", self.baseline)
        if self.reference_budget is not None and self.reference_budget not in self.budgets:
            raise StudyError(f"Study.reference_budget={self.reference_budget!r} is not a budget; "
                             f"budgets: {', '.join(self.budgets)}", "Study.reference_budget",
                             self.reference_budget)
        if not isinstance(self.derived_metrics, Mapping) or not all(
                callable(f) for f in self.derived_metrics.values()):
            raise StudyError(f"Study.derived_metrics={self.derived_metrics!r}; accepted: "
                             "{name: @function}", "Study.derived_metrics", self.derived_metrics)
        self.derived_metrics = dict(self.derived_metrics)
        if self.delta_metrics is not None:
            unknown = [m for m in self.delta_metrics if m not in self.metrics]
            if unknown:
                raise StudyError(f"Study.delta_metrics: {unknown} are not in Study.metrics",
                                 "Study.delta_metrics", unknown[0])
            self.delta_metrics = tuple(self.delta_metrics)
        if self.sd_ddof not in (0, 1):
            raise StudyError(f"Study.sd_ddof={self.sd_ddof!r}; accepted: 1 (sample) or 0 "
                             "(population)", "Study.sd_ddof", self.sd_ddof)
        if self.select_metric is not None and not isinstance(self.select_metric, str):
            raise StudyError(f"Study.select_metric={self.select_metric!r}; accepted: a metric "
                             "name or None (the last evaluation)", "Study.select_metric",
                             self.select_metric)

    def arm(self, name: str) -> Arm | None:
        return next((a for a in self.arms if a.name == name), None)

    def label(self, metric: str) -> str:
        return self.metric_labels.get(metric, metric)

    def direction(self, metric: str) -> str:
        return self.metrics.get(metric, "higher")

    def runs(self) -> list[Run]:
        """Every (arm, budget, seed) in a fixed order: arms as listed, then budgets, then
        seeds. Run names: `<arm>[-<budget>]-seed<k>` (the budget only when there are
        several)."""
        out = []
        for arm in self.arms:
            for budget in arm.budgets or tuple(self.budgets):
                for seed in self.seeds:
                    parts = [arm.name] + ([budget] if len(self.budgets) > 1 else []) + [f"seed{seed}"]
                    out.append(Run(arm, seed, budget, self.budgets[budget], "-".join(parts)))
        return out


def arm_definition(study: Study, arm: Arm, budget: str) -> dict:
    """What makes an arm's runs at `budget` the runs they are (its files and bindings with
    the study's and the budget's): records keep it, and a study directory refuses records
    whose definition differs from the study file's. Paths of the machine (the study
    directory, run directories) are not part of it."""
    local = set(study.machine_bindings)
    return {
        "gin_files": [*study.gin_files, *arm.gin_files],
        "bindings": _jsonable({k: v for k, v in {**study.bindings, **arm.bindings}.items()
                               if k not in local}),
        "budget_bindings": _jsonable(dict(study.budgets[budget])),
        "tasks": _jsonable(arm.tasks) if arm.tasks else None,
        "eval_gin_files": list(study.eval_gin_files),
        "eval_bindings": _jsonable(study.eval_bindings),
        "select_metric": study.select_metric,
    }


def definition_digest(definition: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(definition, sort_keys=True).encode()).hexdigest()[:16]


def parse_shard(text: str) -> tuple[int, int]:
    """`--shard I/N` -> (I, N), 0 <= I < N; a ValueError naming the flag otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not m or int(m.group(2)) < 1 or int(m.group(1)) >= int(m.group(2)):
        raise StudyError(f"--shard={text!r}; accepted: I/N with 0 <= I < N (--shard=0/4; a SLURM "
                         "array passes --shard=$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)")
    return int(m.group(1)), int(m.group(2))


def _strings(values: Any, what: str) -> list[str]:
    if isinstance(values, str) or not isinstance(values, Sequence) or not all(
            isinstance(v, str) for v in values):
        raise StudyError(f"{what}={values!r}; accepted: a list of strings", what.split(":")[0], values)
    return list(values)


def _bindings(values: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(values, Mapping) or not all(
            isinstance(k, str) and re.fullmatch(r"[A-Za-z_][\w./]*", k) for k in values):
        raise StudyError(f"{what}={values!r}; accepted: a dict {{gin name: value}} "
                         "({'TRAIN_STEPS': 600, 'optimizers.adamw.weight_decay': 0.0})",
                         what.split(":")[0], values)
    return values


def _jsonable(value: Any) -> Any:
    """`value` as JSON keeps it (tuples as lists), for comparing definitions."""
    return json.loads(json.dumps(value, default=repr))
