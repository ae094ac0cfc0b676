"""`ktx study run`: each (arm, seed, budget) of a study trained and evaluated by `ktx
train` and `ktx eval` in its own run directory, one record when it finishes.

The study directory:

    study.gin                 the study file as last run (with its --gin. flags)
    <run>.json                a finished run's record (ktx.studies.records)
    runs/<run>/               the run's `ktx train` directory (checkpoints, metrics.jsonl)
    runs/<run>.claim          held while a worker trains the run

A run with a record is skipped; one without resumes from its latest checkpoint (`ktx
train` does). Workers divide the runs: `--shard I/N` gives worker I every N-th run of the
fixed order (`Study.runs`), and a worker trains a run only after creating its claim file
(`O_CREAT | O_EXCL`: one creator wins, on any file system that honours it, NFS v3+ and
GCS FUSE included), so two workers never train one run, shards or no shards. A claim
names its host and process and is touched every `heartbeat` seconds; a claim whose
process is gone (same host) or that has not been touched for `stale_after` seconds is
taken over by the next worker, which resumes the run from its checkpoint.

The training itself is the caller's (`train(gin_files, bindings)`, ktx.cli.study: the
`ktx train` command's own code), so there is one training path.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import pathlib
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ktx.studies.records import FORMAT, Record, load_records, write_json_atomic
from ktx.studies.report import budget_of, metric_values
from ktx.studies.spec import Run, Study, StudyError, arm_definition, definition_digest

__all__ = ["Claim", "RunStatus", "check_records", "gin_value", "plan", "run_bindings",
           "run_study", "statuses"]

Command = Callable[[Sequence[str], Sequence[tuple[str, str]]], Any]


def gin_value(value: Any) -> str:
    """A binding's value as gin text: Python literals as `repr` gives them; a string that
    starts with `@` or `%` (after an opening bracket) is a gin reference and kept as it is
    (`'[@label_eval.LabelEvaluator()]'`)."""
    if isinstance(value, str) and re.match(r"^\s*[\[(]*\s*[@%]", value):
        return value
    return repr(value)


def plan(study: Study, shard: tuple[int, int] | None = None) -> list[Run]:
    """The study's runs (`Study.runs` order), or shard I of N: every N-th from the I-th."""
    runs = study.runs()
    if shard is None:
        return runs
    i, n = shard
    return runs[i::n]


def _root(study: Study) -> pathlib.Path:
    return pathlib.Path(study.directory).expanduser().resolve()


def record_path(study: Study, run: Run) -> pathlib.Path:
    return _root(study) / f"{run.name}.json"


def run_dir(study: Study, run: Run) -> pathlib.Path:
    return _root(study) / "runs" / run.name


def run_bindings(study: Study, run: Run, model_dir: pathlib.Path,
                 task: str | None = None) -> list[tuple[str, str]]:
    """`ktx train`'s `--gin.` bindings of `run` (the study's, the budget's, the arm's, the
    task's, then the seed and the run directory)."""
    values: dict[str, Any] = {**study.bindings, **run.budget_bindings, **run.arm.bindings}
    if task is not None:
        values.update(run.arm.tasks[task])
    values[study.seed_binding] = run.seed
    values[study.model_dir_binding] = str(model_dir)
    return [(k, gin_value(v)) for k, v in values.items()]


def recorded(study: Study) -> set[tuple[str, int, str]]:
    """(arm, seed, budget) of every record in the study directory whose budget is one of the
    study's, under whatever file name it was written: the records of the scripts before
    `ktx study` (`ktx.studies.legacy`) count as done too."""
    root = _root(study)
    if not root.is_dir():
        return set()
    out = set()
    for record in load_records(root):
        budget = budget_of(study, record)
        if budget is not None:
            out.add((record.arm, record.seed, budget))
    return out


def is_done(study: Study, run: Run, done: set[tuple[str, int, str]]) -> bool:
    """Whether `run` has a record: its own file, or a record of its arm, seed and budget."""
    return record_path(study, run).is_file() or (run.arm.name, run.seed, run.budget) in done


@dataclasses.dataclass
class RunStatus:
    run: Run
    state: str  # "done", "claimed", "started" (a run directory, no record) or "new"
    detail: str = ""


def statuses(study: Study, runs: Sequence[Run]) -> list[RunStatus]:
    """Each run's state, for `--dry_run`."""
    out = []
    done = recorded(study)
    for run in runs:
        claim = Claim(study, run)
        if is_done(study, run, done):
            out.append(RunStatus(run, "done"))
        elif claim.path.is_file():
            owner = claim.owner()
            out.append(RunStatus(run, "claimed", f"by {owner.get('host')}:{owner.get('pid')}"
                                 + (" (stale: the next worker takes it over)" if claim.stale() else "")))
        elif run_dir(study, run).is_dir():
            out.append(RunStatus(run, "started", "resumes from its latest checkpoint"))
        else:
            out.append(RunStatus(run, "new"))
    return out


class Claim:
    """A worker's claim on one run: `<study>/runs/<run>.claim`, created atomically."""

    def __init__(self, study: Study, run: Run, *, heartbeat: float = 30.0,
                 stale_after: float = 600.0):
        self.path = _root(study) / "runs" / f"{run.name}.claim"
        self.heartbeat, self.stale_after = heartbeat, stale_after
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def owner(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def stale(self) -> bool:
        """The claim's process is gone (this host) or it has not been touched for
        `stale_after` seconds."""
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return False
        owner = self.owner()
        if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
            try:
                os.kill(owner["pid"], 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                pass
        return age > self.stale_after

    def acquire(self) -> bool:
        """True if this process now holds the claim (taking over a stale one)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not self.stale():
                    return False
                # One worker wins the rename of the stale claim; the loser's rename fails.
                grave = self.path.with_name(f"{self.path.name}.stale-{socket.gethostname()}-{os.getpid()}")
                try:
                    os.rename(self.path, grave)
                    grave.unlink(missing_ok=True)
                except FileNotFoundError:
                    return False
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}, f)
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()
            return True
        return False

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.path.unlink(missing_ok=True)


def check_records(study: Study, records: Sequence[Record], allow_changed: bool = False) -> None:
    """Refuses a study directory holding records of another study or of an arm whose
    definition (files, bindings, budget, evaluation) differs from the study file's,
    naming the arm and what changed; `allow_changed` accepts them. Records written
    before `ktx study` carry no definition and are matched by arm name only."""
    if allow_changed:
        return
    for record in records:
        if record.legacy:
            continue
        if record.study != study.name:
            raise StudyError(
                f"{record.path} is a record of study {record.study!r}, not {study.name!r}: give "
                "this study its own Study.directory (or pass --allow_changed to mix them)",
                "Study.name", study.name)
        arm = study.arm(record.arm)
        budget = budget_of(study, record)
        if arm is None or budget is None:
            continue
        _check_metrics(study, metric_values(study, record), f"run {record.path.stem}")
        now = arm_definition(study, arm, budget)
        if record.definition != now:
            changes = [f"{k}: {record.definition.get(k)!r} -> {now[k]!r}" for k in now
                       if (record.definition or {}).get(k) != now[k]]
            raise StudyError(
                f"arm {arm.name!r} changed since {record.path.name} was written ({'; '.join(changes)}): "
                "its records would be mixed with runs of another configuration. Give the changed "
                "arm a new name, remove its records, or pass --allow_changed to mix them",
                "Arm.name", arm.name)


def _evaluations(metrics_files: Sequence[pathlib.Path]) -> dict[int, dict[str, float]]:
    """`{step: {split/task/metric: value}}` of every evaluation row (not `train`, not
    `early_stopping`) of the given metrics.jsonl files, later files overriding."""
    from ktx.training.summaries import read_metrics

    out: dict[int, dict[str, float]] = {}
    for path in metrics_files:
        if not path.is_file():
            continue
        for row in read_metrics(path):
            split, task = row.get("split"), row.get("task")
            if split in (None, "train", "early_stopping") or task is None:
                continue
            for key, value in row.items():
                if key in ("step", "split", "task", "examples", "weight") or isinstance(value, bool) \
                        or not isinstance(value, (int, float)):
                    continue
                out.setdefault(int(row["step"]), {})[f"{split}/{task}/{key}"] = float(value)
    return dict(sorted(out.items()))


def select(study: Study, evaluations: Mapping[int, Mapping[str, float]],
           where: str) -> tuple[int, dict]:
    """The chosen evaluation's step and how it was chosen (`Study.select_metric`)."""
    if not evaluations:
        raise StudyError(f"{where}: no evaluation in its metrics.jsonl: the study's metrics come "
                         "from the run's evaluators (train_script.train.evaluators and "
                         "EVAL_PERIOD) or from Study.eval_gin_files")
    metric = study.select_metric
    if metric is None:
        return max(evaluations), {"rule": "last"}
    steps = [s for s, m in evaluations.items() if metric in m]
    if not steps:
        known = sorted({k for m in evaluations.values() for k in m})
        close = difflib.get_close_matches(metric, known, n=3)
        raise StudyError(f"Study.select_metric={metric!r}: the evaluators of {where} do not produce "
                         f"it" + (f"; close names: {', '.join(close)}" if close else
                                  f"; they produce: {', '.join(known)}"), "Study.select_metric", metric)
    direction = study.direction(metric)
    pick = (max if direction == "higher" else min)(steps, key=lambda s: (evaluations[s][metric], -s))
    return pick, {"rule": "best", "metric": metric, "direction": direction}


def _check_metrics(study: Study, metrics: Mapping[str, float], where: str) -> None:
    missing = [m for m in study.metrics if m not in metrics]
    if missing:
        known = sorted(metrics)
        close = difflib.get_close_matches(missing[0], known, n=3)
        raise StudyError(
            f"Study.metrics: {missing[0]!r} is not a metric the evaluators of {where} produce"
            + (f"; close names: {', '.join(close)}" if close else f"; they produce: {', '.join(known)}"),
            "Study.metrics", missing[0])


def _resolved(config: pathlib.Path) -> dict[str, str]:
    """The macros of a run's operative config (`config.gin`): `{NAME: value as gin text}`."""
    if not config.is_file():
        return {}
    return dict(re.findall(r"^([A-Z_][A-Z0-9_]*) = (.*)$", config.read_text(), re.M))


def _device() -> str:
    import jax

    devices = jax.devices()
    return f"{devices[0].platform} {devices[0].device_kind} x {len(devices)}"


class _Clock:
    """The wall time of a run over its pieces: `<run>/study_progress.json` holds the
    earlier pieces' seconds, updated as this piece goes (a killed piece counts up to its
    last update)."""

    def __init__(self, directory: pathlib.Path, period: float):
        self.path = directory / "study_progress.json"
        try:
            earlier = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            earlier = {}
        self.earlier = float(earlier.get("seconds", 0.0))
        self.pieces = int(earlier.get("pieces", 0)) + 1
        self.start = time.time()
        self._stop = threading.Event()
        directory.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread = threading.Thread(target=self._tick, args=(period,), daemon=True)
        self._thread.start()

    @property
    def seconds(self) -> float:
        return self.earlier + time.time() - self.start

    def _write(self) -> None:
        write_json_atomic(self.path, {"seconds": round(self.seconds, 1), "pieces": self.pieces})

    def _tick(self, period: float) -> None:
        while not self._stop.wait(period):
            self._write()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._write()


def execute(study: Study, run: Run, train: Command, evaluate: Command, *,
            heartbeat: float = 30.0) -> dict:
    """Trains (or resumes) `run`, evaluates it, writes and returns its record."""
    directory = run_dir(study, run)
    clock = _Clock(directory, heartbeat)
    parts: dict[str | None, dict] = {}
    try:
        for task in (run.arm.tasks or {None: None}):
            model_dir = directory if task is None else directory / task
            files = [*study.gin_files, *run.arm.gin_files]
            bindings = run_bindings(study, run, model_dir, task)
            train(files, bindings)
            if study.eval_gin_files:
                evaluate([*files, *study.eval_gin_files],
                         bindings + [(k, gin_value(v)) for k, v in study.eval_bindings.items()])
            where = f"run {run.name}" + (f" (task {task})" if task else "")
            evaluations = _evaluations([model_dir / "metrics.jsonl", model_dir / "eval" / "metrics.jsonl"])
            step, selection = select(study, evaluations, where)
            parts[task] = {"model_dir": str(model_dir), "evaluations": evaluations,
                           "selection": {**selection, "step": step}, "metrics": evaluations[step],
                           "resolved": _resolved(model_dir / "config.gin")}
    finally:
        clock.stop()
    metrics: dict[str, float] = {}
    for part in parts.values():
        metrics.update(part["metrics"])
    definition = arm_definition(study, run.arm, run.budget)
    record = Record(arm=run.arm.name, seed=run.seed, budget_bindings=dict(run.budget_bindings),
                    metrics=metrics, wall_seconds=None)
    metrics = metric_values(study, record)
    _check_metrics(study, metrics, f"run {run.name}")
    single = parts.get(None)
    out = {
        "format": FORMAT, "study": study.name, "run": run.name, "arm": run.arm.name,
        "seed": run.seed, "budget": run.budget, "budget_bindings": definition["budget_bindings"],
        "definition": definition, "definition_digest": definition_digest(definition),
        "gin_files": definition["gin_files"],
        "bindings": single["resolved"] if single else {t: p["resolved"] for t, p in parts.items()},
        "wall_seconds": round(clock.seconds, 1), "pieces": clock.pieces, "device": _device(),
        "evaluations": _jsonable_evaluations(single["evaluations"]) if single else
        {t: _jsonable_evaluations(p["evaluations"]) for t, p in parts.items()},
        "selection": single["selection"] if single else {t: p["selection"] for t, p in parts.items()},
        "metrics": metrics,
    }
    write_json_atomic(record_path(study, run), out)
    return out


def _jsonable_evaluations(evaluations: Mapping[int, Mapping[str, float]]) -> list[dict]:
    return [{"step": step, "metrics": dict(m)} for step, m in evaluations.items()]


def run_study(study: Study, train: Command, evaluate: Command, *,
              shard: tuple[int, int] | None = None, max_runs: int | None = None,
              allow_changed: bool = False, heartbeat: float = 30.0, stale_after: float = 600.0,
              log: Callable[[str], None] = print) -> Iterator[dict]:
    """Trains this worker's runs that have no record, each under a claim; yields each
    record written. `max_runs`: stop after training that many."""
    check_records(study, load_records(_root(study)), allow_changed)
    done = recorded(study)
    trained = 0
    for run in plan(study, shard):
        if max_runs is not None and trained >= max_runs:
            log(f"--max_runs={max_runs} reached")
            return
        if is_done(study, run, done):
            log(f"{run.name}: done")
            continue
        claim = Claim(study, run, heartbeat=heartbeat, stale_after=stale_after)
        if not claim.acquire():
            log(f"{run.name}: claimed by {claim.owner().get('host')}:{claim.owner().get('pid')}")
            continue
        try:
            if record_path(study, run).is_file():  # finished by another worker meanwhile
                log(f"{run.name}: done")
                continue
            resumed = run_dir(study, run).is_dir()
            log(f"{run.name}: {'resuming' if resumed else 'training'} in {run_dir(study, run)}")
            record = execute(study, run, train, evaluate, heartbeat=heartbeat)
            trained += 1
            log(f"{run.name}: recorded in {record_path(study, run)} ({record['wall_seconds']:.0f} s)")
            yield record
        finally:
            claim.release()
