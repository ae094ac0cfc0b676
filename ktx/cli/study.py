"""`ktx study run STUDY.gin` and `ktx study report STUDY_DIR`: the gin edge of ktx.studies.

    ktx study run gin/studies/cs224n_encoders.gin --shard=0/4 --max_runs=2
    ktx study run gin/studies/cs224n_encoders.gin --dry_run
    ktx study report runs/studies/cs224n

A study file is gin that configures `ktx.studies.spec.Study` (its arms as scoped
`Arm`s); `--gin.NAME=VALUE` flags apply to it as to any gin file (`--gin.STUDY_DIR=...`).
Each run is trained by the `ktx train` command's own code (`ktx.cli._run`) and, with
`Study.eval_gin_files`, evaluated by `ktx eval`'s. A mistake in the study file is one
line naming its file and line (or the `--gin.` flag) and what is accepted.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from collections.abc import Sequence

from ktx.studies.spec import Study, StudyError, parse_shard

__all__ = ["add_parser", "load_study", "study_command"]

STUDY_COPY = "study.gin"

_FIELD_PATTERNS = {  # a StudyError's field -> the study-file line that sets it
    "Study.seeds": r"\bseeds\s*=",
    "Study.baseline": r"\bbaseline\s*=",
    "Study.metrics": r"\bmetrics\s*=",
    "Study.budgets": r"\bbudgets\s*=",
    "Study.name": r"\bname\s*=",
    "Study.directory": r"\bdirectory\s*=",
    "Study.select_metric": r"\bselect_metric\s*=",
    "Study.reference_budget": r"\breference_budget\s*=",
    "Study.delta_metrics": r"\bdelta_metrics\s*=",
    "Study.derived_metrics": r"\bderived_metrics\s*=",
    "Study.sd_ddof": r"\bsd_ddof\s*=",
    "Study.arms": r"\barms\s*=",
    "Arm.budgets": r"\bbudgets\s*=",
    "Arm.tasks": r"\btasks\s*=",
}


def add_parser(sub) -> argparse.ArgumentParser:
    """The `study` sub-command (`ktx study run|report`)."""
    c = sub.add_parser("study", help="run a method-by-seed study from a gin study file, or report it",
                       description="ktx study run STUDY.gin [--shard I/N] [--max_runs K] [--dry_run] | "
                                   "ktx study report STUDY_DIR")
    c.add_argument("--debug", action="store_true", help="let a run-time error raise with its traceback")
    c.add_argument("action", choices=("run", "report"))
    c.add_argument("target", help="run: the study file; report: the study directory (or the study file)")
    c.add_argument("--shard", default=None, help="run: I/N, this worker's share of the runs")
    c.add_argument("--max_runs", type=int, default=None, help="run: train at most K runs, then stop")
    c.add_argument("--dry_run", action="store_true", help="run: list the runs and which are done")
    c.add_argument("--allow_changed", action="store_true",
                   help="accept records of arms whose definition changed since (they are mixed)")
    c.add_argument("--study", default=None,
                   help="report: the study file (default: STUDY_DIR/study.gin, written by run)")
    c.add_argument("--out", default=None,
                   help="report: folder for report.md, report.csv, report.png and curves.png "
                        "(default: STUDY_DIR)")
    c.add_argument("--gin_search_paths", default="", help="comma-separated folders")
    c.add_argument("--heartbeat", type=float, default=30.0, help=argparse.SUPPRESS)
    c.add_argument("--stale_after", type=float, default=600.0,
                   help="run: seconds after which a claim nobody touches is taken over")
    return c


def _line_of(path: pathlib.Path, pattern: str, value=None) -> str | None:
    """`file:line` of the study file line matching `pattern` (and quoting `value` when a
    string: the second such line for a repeated arm name)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    hits = [i for i, line in enumerate(lines, 1)
            if re.search(pattern, line, re.I) and not line.lstrip().startswith("#")]
    if isinstance(value, str):
        quoted = [i for i, line in enumerate(lines, 1)
                  if re.search(rf"""['"]{re.escape(value)}['"]""", line)
                  and not line.lstrip().startswith("#")]
        named = [i for i in quoted if i in hits] or quoted
        if named:
            repeated = len(named) > 1 and pattern == r"\bname\s*="  # the second arm of a name
            return f"{path}:{named[1] if repeated else named[0]}"
    return f"{path}:{hits[0]}" if hits else None


def _located(e: StudyError, path: pathlib.Path, bindings: Sequence[tuple[str, str]]) -> StudyError:
    """`e` with the study file line, or the `--gin.` flag, that set its field."""
    message = str(e).split("\n  In call to configurable")[0]  # gin's trailer
    e = StudyError(message, e.field, e.value)
    if e.field is None:
        return e
    attr = e.field.split(".")[-1]
    for name, value in bindings:
        if name.split(".")[-1] == attr or name.upper() == attr.upper():
            return StudyError(f"--gin.{name}={value}: {e}", e.field, e.value)
    pattern = r"\bname\s*=" if e.field == "Arm.name" else _FIELD_PATTERNS.get(e.field, rf"\b{attr}\s*=")
    where = _line_of(path, pattern, e.value)
    return StudyError(f"{where}: {e}" if where else str(e), e.field, e.value)


def load_study(path: str, bindings: Sequence[tuple[str, str]] = (), search_paths: Sequence[str] = (),
               directory: str | None = None) -> Study:
    """The `Study` a study file configures (with `bindings`); `directory` overrides its
    `Study.directory`. StudyError names the file line or flag of a bad field."""
    import gin

    from ktx.cli.gin_config import parse_gin

    files = parse_gin([path], bindings, search_paths)
    try:
        study = gin.get_configurable(Study)()
    except StudyError as e:
        raise _located(e, files[0], bindings) from None
    except ValueError as e:
        if "Study" not in str(e) and "No configurable" not in str(e):
            raise
        raise StudyError(f"{files[0]}: configures no ktx.studies.spec.Study (a study file imports "
                         "ktx.studies.spec as study and binds study.Study.*; see gin/studies/)") from e
    finally:
        gin.clear_config()
    if directory is not None:
        study.directory = str(directory)
    study.source = files[0]  # for locating later errors
    return study


def _ktx(command: str):
    """`ktx train` / `ktx eval` as the CLI runs them, for one study run."""
    def call(gin_files: Sequence[str], bindings: Sequence[tuple[str, str]]) -> int:
        from ktx import cli

        args = cli.parse_args([command, *(f"--gin_file={f}" for f in gin_files)])
        return cli._run(args, list(bindings))  # noqa: SLF001 - the command's own code
    return call


def _run(args, bindings) -> int:
    from ktx.studies import runner

    search = [p for p in args.gin_search_paths.split(",") if p]
    study = load_study(args.target, bindings, search)
    shard = parse_shard(args.shard) if args.shard is not None else None
    if args.max_runs is not None and args.max_runs < 1:
        raise StudyError(f"--max_runs={args.max_runs}; accepted: an integer >= 1")
    runs = runner.plan(study, shard)
    if args.dry_run:
        from ktx.studies.records import load_records

        root = pathlib.Path(study.directory)
        if root.is_dir():
            _checked(lambda: runner.check_records(study, load_records(root), args.allow_changed), study, bindings)
        states = runner.statuses(study, runs)
        for s in states:
            print(f"{s.run.name:40s} {s.state}" + (f"  {s.detail}" if s.detail else ""))
        done = sum(s.state == "done" for s in states)
        print(f"{done} of {len(states)} runs done" + (f" (shard {args.shard})" if shard else "")
              + f"; study directory {pathlib.Path(study.directory).resolve()}")
        return 0
    root = pathlib.Path(study.directory).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    text = pathlib.Path(study.source).read_text()
    if bindings:
        text += "\n# --gin. flags of `ktx study run`\n" + "\n".join(f"{n} = {v}" for n, v in bindings) + "\n"
    (root / STUDY_COPY).write_text(text)
    records = _checked(lambda: list(runner.run_study(
        study, _ktx("train"), _ktx("eval"), shard=shard, max_runs=args.max_runs,
        allow_changed=args.allow_changed, heartbeat=args.heartbeat, stale_after=args.stale_after,
        log=lambda line: print(f"ktx study: {line}", flush=True))), study, bindings)
    left = sum(s.state != "done" for s in runner.statuses(study, runs))
    print(f"ktx study: {len(records)} runs trained; {left} of {len(runs)} "
          f"{'in this shard ' if shard else ''}without a record")
    return 0


def _checked(fn, study, bindings):
    try:
        return fn()
    except StudyError as e:
        raise _located(e, pathlib.Path(study.source), bindings) from None


def _report(args, bindings) -> int:
    from ktx.studies import report as report_lib
    from ktx.studies.records import load_records
    from ktx.studies.runner import check_records

    target = pathlib.Path(args.target)
    search = [p for p in args.gin_search_paths.split(",") if p]
    if target.suffix == ".gin" and target.is_file() or args.study is None and not target.is_dir():
        study = load_study(str(target), bindings, search)
        directory = pathlib.Path(study.directory)
    else:
        directory = target
        file = args.study or str(directory / STUDY_COPY)
        if not pathlib.Path(file).is_file() and args.study is None:
            raise StudyError(f"{directory} has no {STUDY_COPY} (`ktx study run` writes it): give the "
                             "study file with --study STUDY.gin")
        study = load_study(file, bindings, search, directory=str(directory))
    if not directory.is_dir():
        raise StudyError(f"study directory {directory} does not exist (Study.directory)")
    records = load_records(directory)
    if not records:
        raise StudyError(f"{directory} holds no records (*.json): `ktx study run` writes them")
    _checked(lambda: check_records(study, records, args.allow_changed), study, bindings)
    report = report_lib.build(study, records)
    out = pathlib.Path(args.out) if args.out else directory
    out.mkdir(parents=True, exist_ok=True)
    text = report_lib.markdown(report)
    (out / "report.md").write_text(text)
    report_lib.write_csv(report, out / "report.csv")
    report_lib.write_png(report, out / "report.png")
    curves = report_lib.write_curves_png(report, out / "curves.png")
    print(text)
    print(f"ktx study: wrote {out / 'report.md'}, report.csv, report.png"
          + (" and curves.png (every evaluation of the select metric)" if curves else ""))
    return 0


def study_command(args, bindings) -> int:
    """`ktx study ...` (StudyError: one `ktx study: ...` line, exit 2)."""
    try:
        return _run(args, bindings) if args.action == "run" else _report(args, bindings)
    except StudyError as e:
        if getattr(args, "debug", False):
            raise
        print(f"ktx study: {e}", file=sys.stderr)
        return 2
