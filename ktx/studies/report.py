"""`ktx study report`: a study's records as tables, statistics and a plot.

Per budget and arm: every metric's mean ± standard deviation over seeds with each seed's
value, Δm against the single-task arms (`ktx.studies.stats.delta_m`), the wall time; per
arm and metric, a paired t-test against the baseline arm on the seeds both have; the total
compute of the records. `markdown`, `write_csv` and `write_png` (matplotlib, imported only
there) render one `build` result.

    report = build(study, load_records(study.directory))
    print(markdown(report))
"""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from ktx.studies.records import Record
from ktx.studies.spec import Study
from ktx.studies.stats import delta_m, mean_sd, paired_test

__all__ = ["ArmSummary", "Report", "build", "curves", "markdown", "metric_values", "write_csv",
           "write_curves_png", "write_png"]


@dataclasses.dataclass
class ArmSummary:
    """One arm at one budget: its records by seed and per metric its values by seed,
    (mean, sd), the paired test against the baseline, and Δm."""

    arm: str
    label: str
    budget: str
    records: dict[int, Record]
    values: dict[str, dict[int, float]]
    stats: dict[str, tuple[float, float | None]]
    tests: dict[str, dict] = dataclasses.field(default_factory=dict)
    delta_m: float | None = None

    @property
    def seeds(self) -> list[int]:
        return sorted(self.records)

    @property
    def wall_seconds(self) -> float | None:
        known = [r.wall_seconds for r in self.records.values() if r.wall_seconds is not None]
        return sum(known) / len(known) if known else None


@dataclasses.dataclass
class Report:
    study: Study
    budgets: dict[str, list[ArmSummary]]  # budget -> arms in the study's order
    total_seconds: float
    unknown_seconds: int  # records without a wall time
    ignored: list[str]  # records of arms or budgets the study file does not have
    records: int


def metric_values(study: Study, record: Record) -> dict[str, float]:
    """A record's metrics with the study's derived metrics added where missing (a derived
    metric whose inputs the record lacks is left out)."""
    values = dict(record.metrics)
    for name, fn in study.derived_metrics.items():
        if name not in values:
            try:
                values[name] = float(fn(values))
            except KeyError:
                continue
    return values


def _norm(value: Any) -> str:
    return json.dumps(json.loads(json.dumps(value, default=repr)), sort_keys=True)


def budget_of(study: Study, record: Record) -> str | None:
    """The study budget whose bindings are the record's (None: no budget has them)."""
    key = _norm(record.budget_bindings)
    return next((name for name, b in study.budgets.items() if _norm(b) == key), None)


def build(study: Study, records: Sequence[Record]) -> Report:
    """Groups `records` by budget and arm and computes the report's statistics. A
    ValueError names two records of one (arm, budget, seed)."""
    groups: dict[str, dict[str, dict[int, Record]]] = {}
    ignored = []
    for record in records:
        budget = budget_of(study, record)
        arm = study.arm(record.arm)
        if arm is None or budget is None or (arm.budgets and budget not in arm.budgets):
            why = (f"arm {record.arm!r} is not in the study" if arm is None else
                   f"its budget {record.budget_bindings} is not one of Study.budgets")
            ignored.append(f"{record.path.name if record.path else record.arm}: {why}")
            continue
        by_seed = groups.setdefault(budget, {}).setdefault(record.arm, {})
        if record.seed in by_seed:
            raise ValueError(f"{by_seed[record.seed].path} and {record.path} are both arm "
                             f"{record.arm!r}, budget {budget!r}, seed {record.seed}: keep one")
        by_seed[record.seed] = record
    out: dict[str, list[ArmSummary]] = {}
    for budget in study.budgets:
        if budget not in groups:
            continue
        summaries = []
        for arm in study.arms:
            recs = groups[budget].get(arm.name)
            if not recs:
                continue
            values: dict[str, dict[int, float]] = {}
            for seed in sorted(recs):
                for metric, v in metric_values(study, recs[seed]).items():
                    values.setdefault(metric, {})[seed] = v
            stats = {m: mean_sd(list(values[m].values()), study.sd_ddof)
                     for m in study.metrics if m in values}
            summaries.append(ArmSummary(arm.name, arm.label, budget, dict(sorted(recs.items())),
                                        values, stats))
        _tests_and_delta(study, budget, summaries, out)
        out[budget] = summaries
    for budget, summaries in out.items():  # Δm against another budget's references
        if study.reference_budget and budget != study.reference_budget:
            _delta(study, summaries, out.get(study.reference_budget, []))
    known = [r.wall_seconds for r in records if r.wall_seconds is not None]
    return Report(study, out, float(sum(known)), len(records) - len(known), ignored, len(records))


def _tests_and_delta(study: Study, budget: str, summaries: list[ArmSummary], done: dict) -> None:
    base = next((s for s in summaries if s.arm == study.baseline), None)
    if base is not None:
        for s in summaries:
            if s is not base:
                s.tests = {m: paired_test(s.values[m], base.values[m])
                           for m in study.metrics if m in s.values and m in base.values}
    if not study.reference_budget or budget == study.reference_budget:
        _delta(study, summaries, summaries)


def _delta(study: Study, summaries: list[ArmSummary], references: list[ArmSummary]) -> None:
    reference: dict[str, float] = {}
    for s in references:
        if study.arm(s.arm).single_task:
            for m, (mean, _) in s.stats.items():
                reference.setdefault(m, mean)
    if not reference:
        return
    metrics = study.delta_metrics or [m for m in study.metrics if m not in study.derived_metrics]
    for s in summaries:
        if not study.arm(s.arm).single_task:
            s.delta_m = delta_m({m: v[0] for m, v in s.stats.items()}, reference,
                                study.metrics, metrics)


def _fmt(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _cell(s: ArmSummary, metric: str, digits: int) -> str:
    if metric not in s.stats:
        return "-"
    mean, sd = s.stats[metric]
    per_seed = ", ".join(_fmt(s.values[metric][k], digits) for k in sorted(s.values[metric]))
    text = _fmt(mean, digits) + (f" ± {_fmt(sd, digits)}" if sd is not None else "")
    return f"{text} ({per_seed})" if len(s.values[metric]) > 1 else text


def markdown(report: Report) -> str:
    """The report as markdown: per budget a table of arms x metrics, then the paired
    t-tests against the baseline."""
    study, digits = report.study, report.study.digits
    sd = "sample" if study.sd_ddof == 1 else "population"
    lines = [f"# Study `{study.name}`", "",
             f"{report.records} records; {report.total_seconds / 3600:.2f} h of compute "
             f"(their wall times" + (f"; {report.unknown_seconds} records have none" if
                                      report.unknown_seconds else "") + "). Cells: mean ± "
             f"standard deviation ({sd}) over seeds (each seed's value)."
             + (f" Baseline: `{study.baseline}`." if study.baseline else "")
             + (" Δm: average relative gain over the single-task arms, in percent." if any(
                 a.single_task for a in study.arms) else "")]
    metrics = list(study.metrics)
    show_delta = any(s.delta_m is not None for ss in report.budgets.values() for s in ss)
    for budget, summaries in report.budgets.items():
        bindings = ", ".join(f"`{k} = {v!r}`" for k, v in study.budgets[budget].items())
        lines += ["", f"## Budget `{budget}`" + (f": {bindings}" if bindings else ""), ""]
        head = ["arm", "seeds", *map(study.label, metrics)] + (["Δm %"] if show_delta else []) + ["wall s"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s in summaries:
            label = s.label + (" (baseline)" if s.arm == study.baseline else "")
            row = [label, ",".join(map(str, s.seeds)), *(_cell(s, m, digits) for m in metrics)]
            if show_delta:
                row.append("ref" if study.arm(s.arm).single_task else
                           ("n/a" if s.delta_m is None else f"{s.delta_m:+.2f}"))
            row.append(_fmt(s.wall_seconds, 0))
            lines.append("| " + " | ".join(row) + " |")
        tested = [s for s in summaries if s.tests]
        if tested:
            lines += ["", f"Paired t-tests against `{study.baseline}` (seeds both have):", "",
                      "| arm | metric | seeds | mean difference | t | p |", "|---|---|---|---|---|---|"]
            for s in tested:
                for m, t in s.tests.items():
                    lines.append(f"| {s.label} | {study.label(m)} | {','.join(map(str, t['seeds']))} | "
                                 f"{_fmt(t['mean_difference'], digits)} | {_fmt(t['t'], 2)} | "
                                 f"{_fmt(t['p'], 3)} |")
    if report.ignored:
        lines += ["", "Records not in this report (the study file has no such arm or budget):", ""]
        lines += [f"- {line}" for line in report.ignored]
    return "\n".join(lines) + "\n"


def write_csv(report: Report, path: str | pathlib.Path) -> None:
    """One row per (budget, arm, metric): seeds, values, mean, sd, the paired test and Δm."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["budget", "arm", "metric", "direction", "n", "seeds", "values", "mean", "sd",
                    "baseline", "mean_difference", "t", "p", "delta_m"])
        for budget, summaries in report.budgets.items():
            for s in summaries:
                for m in report.study.metrics:
                    if m not in s.stats:
                        continue
                    mean, sd = s.stats[m]
                    t = s.tests.get(m, {})
                    seeds = sorted(s.values[m])
                    w.writerow([budget, s.arm, m, report.study.direction(m), len(seeds),
                                " ".join(map(str, seeds)),
                                " ".join(repr(s.values[m][k]) for k in seeds), mean, sd,
                                report.study.baseline if t else "", t.get("mean_difference"),
                                t.get("t"), t.get("p"), s.delta_m])


def write_png(report: Report, path: str | pathlib.Path) -> None:
    """Per budget, every metric's mean per arm with the standard deviation as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = [b for b, ss in report.budgets.items() if ss]
    metrics = list(report.study.metrics)
    fig, axes = plt.subplots(len(budgets) or 1, 1, squeeze=False,
                             figsize=(max(6.0, 1.2 * len(metrics) + 2), 3.2 * max(len(budgets), 1)))
    for ax, budget in zip(axes[:, 0], budgets):
        summaries = report.budgets[budget]
        width = 0.8 / len(summaries)
        for i, s in enumerate(summaries):
            xs = [j + (i - (len(summaries) - 1) / 2) * width for j, m in enumerate(metrics)
                  if m in s.stats]
            means = [s.stats[m][0] for m in metrics if m in s.stats]
            errs = [s.stats[m][1] or 0.0 for m in metrics if m in s.stats]
            ax.bar(xs, means, width, yerr=errs, capsize=2, label=s.arm)
        ax.set_xticks(range(len(metrics)))
        ax.set_xticklabels([report.study.label(m) for m in metrics], rotation=20, ha="right", fontsize=7)
        ax.set_title(f"{report.study.name}: budget {budget}", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curves(report: Report, metric: str | None = None) -> dict[str, dict[str, dict[int, list]]]:
    """Every evaluation of `metric` (default: the study's `select_metric`) over each run:
    `{budget: {arm: {seed: [(step, value), ...]}}}`, from the records' `evaluations` (a
    single-task arm's records hold one list per task and are left out, as are records
    written before `ktx study`); an arm with no such evaluation is left out."""
    metric = metric or report.study.select_metric
    out: dict[str, dict[str, dict[int, list]]] = {}
    if metric is None:
        return out
    for budget, summaries in report.budgets.items():
        for s in summaries:
            for seed, record in s.records.items():
                evaluations = record.data.get("evaluations")
                if not isinstance(evaluations, list):
                    continue
                points = sorted((int(e["step"]), float(e["metrics"][metric]))
                                for e in evaluations if metric in e.get("metrics", {}))
                if points:
                    out.setdefault(budget, {}).setdefault(s.arm, {})[seed] = points
    return out


def write_curves_png(report: Report, path: str | pathlib.Path, metric: str | None = None) -> bool:
    """Per budget, `metric` (default: the study's `select_metric`) at every evaluation of
    every run: each seed a thin line, each arm's mean over the seeds evaluated at a step a
    thick one. False (nothing written) when no record holds such evaluations."""
    data = curves(report, metric)
    if not data:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = metric or report.study.select_metric
    fig, axes = plt.subplots(len(data), 1, squeeze=False, figsize=(8.0, 3.6 * len(data)))
    for ax, (budget, arms) in zip(axes[:, 0], data.items()):
        for i, (arm, seeds) in enumerate(arms.items()):
            color = f"C{i % 10}"
            by_step: dict[int, list[float]] = {}
            for points in seeds.values():
                ax.plot(*zip(*points), color=color, linewidth=0.6, alpha=0.4)
                for step, value in points:
                    by_step.setdefault(step, []).append(value)
            steps = sorted(by_step)
            ax.plot(steps, [sum(by_step[t]) / len(by_step[t]) for t in steps], color=color,
                    linewidth=1.8, label=f"{arm} ({len(seeds)} seed{'s' * (len(seeds) != 1)})")
        ax.set_xlabel("step")
        ax.set_ylabel(report.study.label(metric), fontsize=8)
        ax.set_title(f"{report.study.name}: budget {budget}", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

