"""The periodic actions of the training loop (`ktx.runs.train.train`), each testable alone.

* `TrainMetrics`: collects each step's device metrics, and every `log_period` steps (and
  before a checkpoint) fetches them, stops on a non-finite loss naming the step, writes
  `metrics.jsonl` / TensorBoard and prints the progress line.
* `Checkpointing`: saves the state every `period` steps (and at the end), only after the
  metrics of every step up to it were checked finite, so the last checkpoint of a run
  stopped by a NaN is a good one.
* `Evaluation`: runs the run's evaluators (`ktx.runs.eval.Evaluator`) every `period` steps,
  prints their results, and keeps the early-stopping record (`EarlyStopping`), which a
  resumed run continues from `metrics.jsonl`.

The loop calls them in that order after every step:

    metrics_hook.add(step, metrics)
    if metrics_hook.due(done): metrics_hook.flush(done)
    if checkpointing.due(done): metrics_hook.flush(done); checkpointing.save(state, done)
    if evaluation.due(done) and evaluation.run(trainer, state.params, done): stop
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ktx.runs.run_dir import RunDir
from ktx.training.summaries import (
    MetricsWriter,
    ProgressLogger,
    not_training,
    per_task_metrics,
    read_metrics,
)

__all__ = [
    "NonFiniteLossError",
    "TrainMetrics",
    "Checkpointing",
    "EarlyStopping",
    "Evaluation",
    "print_results",
]


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or Inf; the message names the step."""


def print_results(title: str, results: Mapping[str, Mapping[str, float]]) -> None:
    """`title:` then one line per task (process 0 only)."""
    if jax.process_index() != 0:
        return
    print(title + ":", flush=True)
    for task, metrics in results.items():
        shown = ", ".join(
            f"{k} {v:.4g}" for k, v in metrics.items() if k not in ("weight", "examples")
        )
        print(f"  {task}: {shown}", flush=True)


class TrainMetrics:
    """Pending per-step metrics, fetched and written every `log_period` steps.

    Args:
      writer: the run's `MetricsWriter` (split "train").
      task_names: tasks in `task_id` order.
      train_steps, start_step: for the progress line.
      log_period: steps between fetches.
      last_good: the latest checkpoint step (named when a loss is non-finite).
      throughput: a `ktx.training.throughput.Throughput` the loop adds each step's FLOPs
        and tokens to: its rates (tokens/s, TFLOP/s per device, MFU) join the period's
        metrics and the progress line.
    """

    def __init__(self, writer: MetricsWriter, task_names: Sequence[str], *, train_steps: int,
                 start_step: int, log_period: int, checkpoint_dir: Any = None,
                 last_good: int | None = None, throughput: Any = None):
        if isinstance(log_period, bool) or not isinstance(log_period, int) or log_period < 1:
            raise ValueError(f"log_period={log_period!r}; accepted: an integer >= 1")
        self.writer, self.task_names = writer, tuple(task_names)
        self.train_steps, self.log_period = train_steps, log_period
        self.progress = ProgressLogger(train_steps, start_step=start_step)
        self.checkpoint_dir, self.last_good = checkpoint_dir, last_good
        self.throughput = throughput
        self.pending: list[tuple[int, dict]] = []
        self.input_seconds = 0.0
        self._period_start = time.perf_counter()

    def add(self, step: int, metrics: Mapping[str, Any], input_seconds: float = 0.0) -> None:
        """Step `step`'s device metrics (not fetched yet) and the time spent waiting for
        its batch."""
        self.pending.append((step, metrics, None))
        self.input_seconds += input_seconds

    def add_stacked(self, first_step: int, steps: int, metrics: Mapping[str, Any],
                    input_seconds: float = 0.0) -> None:
        """The device metrics of steps `first_step .. first_step + steps - 1`, stacked
        `[steps, ...]` (`Trainer.train_steps`); written as `steps` single steps."""
        self.pending.append((first_step, metrics, steps))
        self.input_seconds += input_seconds

    def due(self, done: int) -> bool:
        return done % self.log_period == 0 or done == self.train_steps

    def flush(self, done: int) -> dict[str, dict[str, float]] | None:
        """Fetches the pending metrics; raises `NonFiniteLossError` naming the first bad
        step; writes the period's means and prints the progress line. Returns the
        written `{task: {metric: value}}` (None when nothing was pending)."""
        if not self.pending:
            return None
        fetched, steps = [], []
        for (first, _, n), m in zip(self.pending, jax.device_get([m for _, m, _ in self.pending])):
            if n is None:
                fetched.append(m)
                steps.append(first)
            else:  # a stacked block: one dict per step
                fetched += [jax.tree.map(lambda x, i=i: x[i], m) for i in range(n)]
                steps += range(first, first + n)
        for s, m in zip(steps, fetched):
            loss = float(m["loss"])
            if not math.isfinite(loss):
                good = "none" if self.last_good is None else f"step {self.last_good}"
                raise NonFiniteLossError(
                    f"loss is {loss} at step {s} (the update from batch {s}); stopping. "
                    f"Last good checkpoint: {good} in {self.checkpoint_dir}")
        elapsed = max(time.perf_counter() - self._period_start, 1e-9)
        sums = {k: np.sum([np.asarray(m["aux"][k]) for m in fetched], 0)
                for k in fetched[0]["aux"]}
        sums["examples"] = np.sum([m["examples"] for m in fetched], 0)
        by_task = per_task_metrics(sums, self.task_names)
        task_losses = np.mean([m["task_losses"] for m in fetched], 0)
        for t, name in enumerate(self.task_names):
            if name in by_task:
                by_task[name]["task_loss"] = float(task_losses[t])
        rows = float(np.sum(sums["examples"]))
        steps_per_s, examples_per_s = self.progress.rates(done, int(rows / len(fetched)))
        total = by_task.setdefault("all", {})
        total["objective"] = float(np.mean([m["loss"] for m in fetched]))
        if "learning_rate" in fetched[-1]:
            total["learning_rate"] = float(fetched[-1]["learning_rate"])
        for key in ("grad_norm", "update_norm"):
            if key in fetched[-1]:
                total[key] = float(np.mean([m[key] for m in fetched]))
        if "param_norm" in fetched[-1]:
            total["param_norm"] = float(fetched[-1]["param_norm"])
        total.update(steps_per_s=steps_per_s, examples_per_s=examples_per_s,
                     input_wait_fraction=self.input_seconds / elapsed)
        rates = {}
        if self.throughput is not None:  # over the period's training time
            rates = self.throughput.rates(len(fetched) / max(steps_per_s, 1e-9))
            total.update(rates)
        # Diagnostics are computed on log steps only (the last of the period).
        logged = [m for m in fetched if bool(m.get("diagnostics_logged", False))]
        for key in (logged[-1]["diagnostics"] if logged else {}):
            total[key] = float(logged[-1]["diagnostics"][key])
        self.writer.write_tasks(done, "train", by_task)
        self.progress.log(done, total["objective"], steps_per_s, examples_per_s,
                          self.throughput.describe(rates) if self.throughput is not None else "")
        self.pending, self.input_seconds = [], 0.0
        self._period_start = time.perf_counter()
        return by_task


class Checkpointing:
    """Saves the train state through a `ktx.training.checkpoints.CheckpointManager`.

    `due(done)`: the manager's period, or the last step. `save` records the step as the
    last good one in `metrics` (flush the metrics first: a checkpoint is only written
    after every step up to it was checked finite).
    """

    def __init__(self, checkpoints: Any, task_names: Sequence[str], train_steps: int):
        self.checkpoints, self.train_steps = checkpoints, train_steps
        self.meta = {"task_names": tuple(task_names)}

    def due(self, done: int) -> bool:
        return self.checkpoints.should_save(done) or done == self.train_steps

    def save(self, state: Any, done: int, metrics: TrainMetrics, *, force: bool = False) -> None:
        metrics.flush(done)
        if self.checkpoints.save(state, force=force or done == self.train_steps, meta=self.meta):
            metrics.last_good = done


class EarlyStopping:
    """Best-so-far bookkeeping of one in-run metric (higher is better).

    Args:
      metric: `"task/metric"` in the evaluators' `{task: {metric: value}}` results, or
        `"metric"` when they report a single task.
      patience: evaluations without improvement before `update` says stop.
    """

    SPLIT = "early_stopping"

    def __init__(self, metric: str, patience: int):
        if not isinstance(metric, str) or not metric or metric.count("/") > 1:
            raise ValueError(f"early_stopping_metric={metric!r}; accepted: 'task/metric' or 'metric'")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"early_stopping_patience={patience!r}; accepted: an integer >= 1")
        self.metric, self.patience = metric, patience
        self.best_value = -math.inf
        self.best_step: int | None = None
        self.since_best = 0
        self.last_step: int | None = None

    @property
    def stopped(self) -> bool:
        return self.since_best >= self.patience

    def value_of(self, results: Any) -> float:
        if not isinstance(results, dict) or not results:
            raise ValueError(
                f"early_stopping_metric={self.metric!r}: the evaluators returned {results!r}, "
                "not {task: {metric: value}}"
            )
        if "/" in self.metric:
            task, name = self.metric.split("/")
        elif len(results) == 1:
            task, name = next(iter(results)), self.metric
        else:
            raise ValueError(
                f"early_stopping_metric={self.metric!r}: the evaluators report tasks "
                f"{sorted(results)}; name one as 'task/{self.metric}'"
            )
        if task not in results or name not in results[task]:
            known = [f"{t}/{m}" for t, ms in results.items() for m in ms]
            raise ValueError(f"early_stopping_metric={self.metric!r} is not reported; reported: {known}")
        return float(results[task][name])

    def update(self, step: int, results: Any) -> bool:
        """Records the evaluation of `step`; True when training should stop."""
        value = self.value_of(results)
        self.last_step = int(step)
        if value > self.best_value:
            self.best_value, self.best_step, self.since_best = value, int(step), 0
        else:
            self.since_best += 1
        return self.stopped

    def record(self) -> dict[str, float]:
        return {"best_value": self.best_value, "best_step": self.best_step,
                "since_best": self.since_best, "patience": self.patience}

    def restore(self, model_dir: Any, upto_step: int) -> None:
        """Continues from the last record of this metric at or before `upto_step` in the
        run's `metrics.jsonl` (a resumed run)."""
        path = RunDir(model_dir).metrics
        if not path.exists():
            return
        records = [
            r for r in read_metrics(path)
            if r.get("split") == self.SPLIT and r.get("task") == self.metric and r["step"] <= upto_step
        ]
        if records:
            last = max(records, key=lambda r: r["step"])
            self.best_value = float(last["best_value"])
            self.best_step = last["best_step"]
            self.since_best = int(last["since_best"])
            self.last_step = int(last["step"])


def merge_results(named: Sequence[tuple[str, Mapping[str, Mapping[str, float]]]]
                  ) -> dict[str, dict[str, float]]:
    """One `{task: {metric: value}}` from several evaluators' results; a metric reported
    by two evaluators for the same task is an error naming both."""
    merged: dict[str, dict[str, float]] = {}
    source: dict[tuple[str, str], str] = {}
    for name, results in named:
        for task, metrics in results.items():
            row = merged.setdefault(task, {})
            for metric, value in metrics.items():
                if (task, metric) in source:
                    raise ValueError(
                        f"evaluators {source[task, metric]!r} and {name!r} both report "
                        f"{task}/{metric}; give one of them another split or metric name")
                row[metric] = value
                source[task, metric] = name
    return merged


class Evaluation:
    """The run's evaluators every `period` steps (and at the last step), with optional
    early stopping on one of their metrics.

    Args:
      evaluators: `ktx.runs.eval.Evaluator`s (decode, teacher-forced score, ranking ...).
      period: steps between evaluations (0: never).
      writer: the run's `MetricsWriter` (each evaluator writes its own split).
      stopper: an `EarlyStopping`, or None.
      train_steps: the last step (always evaluated when `period > 0`).
    """

    def __init__(self, evaluators: Sequence[Any], period: int, writer: MetricsWriter, *,
                 stopper: EarlyStopping | None = None, train_steps: int):
        self.evaluators, self.period, self.writer = tuple(evaluators), period, writer
        self.stopper, self.train_steps = stopper, train_steps

    def due(self, done: int) -> bool:
        return bool(self.evaluators) and bool(self.period) and (
            done % self.period == 0 or done == self.train_steps)

    def run(self, trainer: Any, params: Any, done: int) -> bool:
        """Every evaluator at step `done`; True when early stopping says stop."""
        named = []
        for evaluator in self.evaluators:
            with not_training():  # the progress line's rate and ETA are training's
                results = evaluator(trainer=trainer, params=params, step=done, writer=self.writer)
            title = getattr(evaluator, "title", "evaluation")
            if isinstance(results, dict):
                print_results(f"{title} at step {done}", results)
                named.append((title, results))
        if self.stopper is None:
            return False
        stop = self.stopper.update(done, merge_results(named))
        self.writer.write(done, EarlyStopping.SPLIT, self.stopper.metric, self.stopper.record())
        if stop and jax.process_index() == 0:
            s = self.stopper
            print(f"Early stopping at step {done}: {s.metric} has not improved for "
                  f"{s.since_best} evaluations (best {s.best_value:.6g} at step "
                  f"{s.best_step})", flush=True)
        return stop

    def resume(self, trainer: Any, params: Any, model_dir: Any, start: int) -> bool:
        """A resumed run at `start`: continues the early-stopping record; runs the
        evaluation of `start` if its checkpoint was written but its evaluation was not.
        True when the run has already stopped (nothing left to do)."""
        s = self.stopper
        if s is None or start == 0:
            return False
        s.restore(model_dir, start)
        if s.stopped:
            print(f"This run stopped early at step {s.last_step} (best {s.metric} "
                  f"{s.best_value:.6g} at step {s.best_step}); nothing to do", flush=True)
            return True
        if self.due(start) and s.last_step != start:
            return self.run(trainer, params, start)
        return False
