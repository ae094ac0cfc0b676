"""`train(...)`: the training loop behind `ktx train`, with explicit arguments.

The loop (T5X style): build the mesh and the sharded state; resume from the latest
checkpoint in `model_dir` (or start from `initial_checkpoint_path`'s params); then for
each step `s` take `train_input.get_batch(s)` (a pure function of the step, so resuming
at step s continues the data stream exactly), run the compiled step, and every
`log_period` steps fetch the metrics, stop on a non-finite loss (naming the first bad
step), write `metrics.jsonl`/TensorBoard and print the progress line. Checkpoints are
written only after the metrics of every step up to them were checked finite, so the
last checkpoint of a run stopped by a NaN is a good one.
"""

from __future__ import annotations

import logging
import math
import os
import pathlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from ktx import partitioning
from ktx.checkpoints import CheckpointManager, load_initial_params
from ktx.models.base import BaseModel
from ktx.summaries import MetricsWriter, ProgressLogger, per_task_metrics
from ktx.trainer import Trainer, TrainState

__all__ = ["NonFiniteLossError", "Prefetcher", "EarlyStopping", "train", "check_input"]

_log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or Inf; the message names the step."""


def check_input(train_input: Any) -> None:
    """Raises TypeError naming what `train_input` lacks from interface §3."""
    missing = [
        name for name in ("task_names", "num_tasks", "get_batch", "task_counts")
        if not hasattr(train_input, name)
    ]
    if missing:
        raise TypeError(
            f"train_input={train_input!r} lacks {missing}; a training input needs "
            f"task_names, num_tasks, get_batch(step) and task_counts(step)"
        )


def _host_rows(batch) -> int:
    return int(np.shape(next(iter(batch.values())))[0])


class Prefetcher:
    """Prepares the global batches of steps `[start, stop)` in a background thread,
    `depth` steps ahead (`get_batch`, `task_counts`, then `Trainer.global_batch`), so
    the host builds batch s+1 while the devices run step s. Batches are a function of
    the step, so prefetching changes nothing in what a step sees.

    Iterating yields `(step, global_batch, task_counts, wait_seconds)`, where
    `wait_seconds` is the time the loop blocked waiting for that batch.
    """

    def __init__(self, train_input: Any, trainer: Trainer, start: int, stop: int, depth: int = 2):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"prefetch depth={depth!r}; accepted: an integer >= 1")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._n = stop - start

        def produce():
            try:
                for step in range(start, stop):
                    if self._stop.is_set():
                        return
                    counts = train_input.task_counts(step)
                    batch = trainer.global_batch(train_input.get_batch(step), counts)
                    item = (step, batch, counts, None)
                    while not self._stop.is_set():
                        try:
                            self._queue.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
            except BaseException as e:  # re-raised in the training loop
                self._queue.put((None, None, None, e))

        self._thread = threading.Thread(target=produce, name="ktx-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self):
        for _ in range(self._n):
            t0 = time.perf_counter()
            step, batch, counts, error = self._queue.get()
            if error is not None:
                raise error
            yield step, batch, counts, time.perf_counter() - t0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _print_results(title: str, results: dict) -> None:
    if jax.process_index() != 0:
        return
    print(title + ":", flush=True)
    for task, metrics in results.items():
        shown = ", ".join(
            f"{k} {v:.4g}" for k, v in metrics.items() if k not in ("weight", "examples")
        )
        print(f"  {task}: {shown}", flush=True)


def train(
    *,
    model: BaseModel,
    train_input: Any,
    model_dir: str | os.PathLike,
    train_steps: int | None = None,
    optimizer: optax.GradientTransformation,
    train_epochs: int | None = None,
    schedule: Any = None,
    balancer: Any = None,
    num_partitions: int = 1,
    additional_rules: Sequence[tuple[str, str | None]] = (),
    num_microbatches: int = 1,
    grad_method: str = "auto",
    shared: Sequence[str] | None = None,
    sparse_tables: Sequence[str] | None = None,
    target_task: int = 0,
    log_diagnostics: bool = True,
    seed: int = 0,
    log_period: int = 100,
    checkpoint_period: int | str = 1000,
    keep_checkpoints: int | None = None,
    async_checkpoints: bool = False,
    initial_checkpoint_path: str | None = None,
    eval_period: int = 0,
    eval_split: str = "validation",
    eval_batch_size: int | None = None,
    eval_input: Any = None,
    decode_eval_period: int | str = 0,
    decode_evaluator_fn: Callable[..., Any] | None = None,
    early_stopping_metric: str | None = None,
    early_stopping_patience: int = 0,
    started_callback: Callable[[], None] | None = None,
    prefetch_depth: int = 2,
) -> TrainState:
    """Trains `model` on `train_input` for `train_steps` steps (total, resumed runs
    included) and returns the final state.

    Args:
      model: a `BaseModel`.
      train_input: interface §3 (`get_batch(step)`, `task_names`, `task_counts(step)`).
      model_dir: the run directory (checkpoints/, metrics.jsonl, TensorBoard events).
      train_steps: the step to stop at (T5X's TRAIN_STEPS).
      train_epochs: instead of `train_steps`, stop after this many epochs of an input
        that defines `steps_per_epoch` (e.g. `ktx.data.recsys.RecsysTrainInput`).
      optimizer, schedule: from `ktx.optimizers` (schedule only for reporting).
      balancer: optional `ktx.optim` balancer (per-task gradient path).
      num_partitions: model-parallel size (NUM_PARTITIONS); the rest is data-parallel.
      num_microbatches: gradient accumulation.
      sparse_tables: regexes of embedding tables whose per-task gradients stay sparse
        on the balanced path (see `ktx.trainer.Trainer`).
      seed: parameter init and dropout keys.
      log_period: steps between metric fetches / NaN checks / progress lines.
      target_task: the balancer's target task (gin: TARGET_TASK), which the logged
        per-task gradient cosines are taken against.
      log_diagnostics: balanced runs: log per-task gradient norms, cosines and MetaBalance
        weights at every log step (computed on those steps only).
      checkpoint_period, keep_checkpoints: save cadence (steps, or "epoch" for an input
        with `steps_per_epoch`) and how many to keep; a final checkpoint is always
        written at `train_steps` (and when training stops early).
      initial_checkpoint_path: start a *new* run from another run's parameters.
      eval_period: teacher-forced evaluation of every task every this many steps (0:
        off) on `eval_input` (default `train_input`) via `eval_batches(task, split, bs)`.
      decode_eval_period, decode_evaluator_fn: every this many steps (or "epoch") call
        `decode_evaluator_fn(trainer=..., params=..., step=..., writer=...)`, an
        in-run evaluator returning `{task: {metric: value}}`
        (`ktx.eval.DecodeEvaluator`, `ktx.ranking_eval.RankingEvaluator`).
      early_stopping_metric, early_stopping_patience: stop when the evaluator's
        `"task/metric"` (or `"metric"` if it reports one task; higher is better) has
        not improved for `early_stopping_patience` evaluations (0: never stop early).
        The stop writes a checkpoint; the bookkeeping is in `metrics.jsonl` (split
        `early_stopping`), so a resumed run continues it and a stopped run stays
        stopped.
      started_callback: called once the state exists (the CLI writes config.gin there).
      prefetch_depth: batches prepared ahead in a background thread (`Prefetcher`);
        `input_wait_fraction` in the train metrics is the share of wall time the loop
        blocked on input.
    """
    check_input(train_input)
    train_steps = _resolve_train_steps(train_input, train_steps, train_epochs)
    checkpoint_period = _resolve_period("checkpoint_period", checkpoint_period, train_input)
    decode_eval_period = _resolve_period("decode_eval_period", decode_eval_period, train_input)
    if not isinstance(early_stopping_patience, int) or early_stopping_patience < 0:
        raise ValueError(
            f"early_stopping_patience={early_stopping_patience!r}; accepted: an integer >= 0"
        )
    if early_stopping_patience and (
        not early_stopping_metric or decode_evaluator_fn is None or not decode_eval_period
    ):
        raise ValueError(
            f"early_stopping_patience={early_stopping_patience} needs early_stopping_metric "
            "('task/metric'), decode_evaluator_fn and decode_eval_period > 0"
        )
    if not isinstance(log_period, int) or log_period < 1:
        raise ValueError(f"log_period={log_period!r}; accepted: an integer >= 1")
    if train_input.num_tasks != model.num_tasks:
        raise ValueError(
            f"the input has {train_input.num_tasks} tasks {list(train_input.task_names)} but "
            f"model.num_tasks={model.num_tasks}; set NUM_TASKS to {train_input.num_tasks}"
        )
    task_names = tuple(train_input.task_names)
    model_dir = pathlib.Path(model_dir).expanduser()
    model_dir.mkdir(parents=True, exist_ok=True)

    mesh = partitioning.create_mesh(num_partitions)
    rules = partitioning.standard_logical_axis_rules(additional_rules)
    trainer = Trainer(
        model, optimizer, mesh=mesh, rules=rules, balancer=balancer, schedule=schedule,
        num_microbatches=num_microbatches, grad_method=grad_method, shared=shared,
        sparse_tables=sparse_tables, diagnostics_period=log_period if log_diagnostics else 0,
        target_task=target_task,
    )
    first_batch = train_input.get_batch(0)
    abstract, _ = trainer.create_abstract_state(first_batch)
    checkpoints = CheckpointManager(
        model_dir, save_period=checkpoint_period, keep=keep_checkpoints, async_save=async_checkpoints
    )
    rng = jax.random.key(seed)
    init_rng, dropout_rng = jax.random.split(rng)
    state = checkpoints.restore_latest_good(abstract)
    latest = None if state is None else int(jax.device_get(state.step))
    if latest is not None:
        _log.info("resumed from %s at step %d", checkpoints.directory, latest)
        print(f"Resuming from checkpoint step {latest} in {checkpoints.directory}", flush=True)
    else:
        state = trainer.init_state(init_rng, first_batch)
        if initial_checkpoint_path:
            params, report = load_initial_params(
                initial_checkpoint_path, abstract.params, state.params
            )
            print(report.summary(), flush=True)
            state = state.replace(params=params, opt_state=jax.jit(
                trainer.init_opt_state, out_shardings=trainer.state_shardings.opt_state)(params))
    if started_callback is not None:
        started_callback()

    writer = MetricsWriter(model_dir)
    start = int(jax.device_get(state.step))
    progress = ProgressLogger(train_steps, start_step=start)
    pending: list[tuple[int, dict]] = []
    input_time = 0.0
    period_start = time.perf_counter()
    last_good = checkpoints.latest_step()

    def flush(step: int) -> None:
        """Fetches pending metrics, stops on a non-finite loss, writes summaries."""
        nonlocal pending, input_time, period_start
        if not pending:
            return
        fetched = jax.device_get([m for _, m in pending])
        steps = [s for s, _ in pending]
        for s, m in zip(steps, fetched):
            loss = float(m["loss"])
            if not math.isfinite(loss):
                raise NonFiniteLossError(
                    f"loss is {loss} at step {s} (the update from batch {s}); stopping. "
                    f"Last good checkpoint: "
                    f"{'step ' + str(last_good) if last_good is not None else 'none'} in "
                    f"{checkpoints.directory}"
                )
        elapsed = max(time.perf_counter() - period_start, 1e-9)
        sums = {k: np.sum([np.asarray(m["aux"][k]) for m in fetched], 0) for k in fetched[0]["aux"]}
        sums["examples"] = np.sum([m["examples"] for m in fetched], 0)
        by_task = per_task_metrics(sums, task_names)
        task_losses = np.mean([m["task_losses"] for m in fetched], 0)
        for t, name in enumerate(task_names):
            if name in by_task:
                by_task[name]["task_loss"] = float(task_losses[t])
        rows = float(np.sum(sums["examples"]))
        steps_per_s, examples_per_s = progress.rates(step, int(rows / len(fetched)))
        total = by_task.setdefault("all", {})
        total.update(
            objective=float(np.mean([m["loss"] for m in fetched])),
            learning_rate=float(fetched[-1]["learning_rate"]),
            grad_norm=float(np.mean([m["grad_norm"] for m in fetched])),
            update_norm=float(np.mean([m["update_norm"] for m in fetched])),
            param_norm=float(fetched[-1]["param_norm"]),
            steps_per_s=steps_per_s,
            examples_per_s=examples_per_s,
            input_wait_fraction=input_time / elapsed,
        )
        # Diagnostics are computed on log steps only (the last of the period).
        logged = [m for m in fetched if bool(m.get("diagnostics_logged", False))]
        for key in (logged[-1]["diagnostics"] if logged else {}):
            total[key] = float(logged[-1]["diagnostics"][key])
        writer.write_tasks(step, "train", by_task)
        progress.log(step, total["objective"], steps_per_s, examples_per_s)
        pending, input_time, period_start = [], 0.0, time.perf_counter()

    stopper = (
        EarlyStopping(early_stopping_metric, early_stopping_patience)
        if early_stopping_patience else None
    )

    def run_evaluator(done: int) -> bool:
        """In-run evaluation at step `done`; True when early stopping says stop."""
        results = decode_evaluator_fn(trainer=trainer, params=state.params, step=done, writer=writer)
        if isinstance(results, dict):
            _print_results(f"evaluation at step {done}", results)
        if stopper is None:
            return False
        stop = stopper.update(done, results)
        writer.write(done, EarlyStopping.SPLIT, stopper.metric, stopper.record())
        if stop and jax.process_index() == 0:
            print(f"Early stopping at step {done}: {stopper.metric} has not improved for "
                  f"{stopper.since_best} evaluations (best {stopper.best_value:.6g} at step "
                  f"{stopper.best_step})", flush=True)
        return stop

    stopped = False
    if stopper is not None and start > 0:
        stopper.restore(model_dir, start)
        if stopper.stopped:
            print(f"This run stopped early at step {stopper.last_step} (best {stopper.metric} "
                  f"{stopper.best_value:.6g} at step {stopper.best_step}); nothing to do",
                  flush=True)
            stopped = True
        elif start % decode_eval_period == 0 and stopper.last_step != start:
            # The checkpoint of `start` was written but its evaluation was not.
            stopped = run_evaluator(start)
    if stopped:
        checkpoints.close()
        writer.close()
        return state

    prefetcher = Prefetcher(train_input, trainer, start, train_steps, depth=prefetch_depth)
    try:
        for step, batch, counts, wait in prefetcher:
            input_time += wait
            state, metrics = trainer.train_step(state, batch, dropout_rng, counts)
            pending.append((step, metrics))
            done = step + 1
            if done % log_period == 0 or done == train_steps:
                flush(done)
            if checkpoints.should_save(done) or done == train_steps:
                flush(done)
                if checkpoints.save(state, force=done == train_steps, meta={"task_names": task_names}):
                    last_good = done
            if eval_period and (done % eval_period == 0 or done == train_steps):
                from ktx.eval import teacher_forced_eval

                results = teacher_forced_eval(
                    trainer, state.params, eval_input or train_input, task_names,
                    split=eval_split,
                    batch_size=eval_batch_size or _host_rows(first_batch) * jax.process_count(),
                )
                writer.write_tasks(done, eval_split, results)
                _print_results(f"{eval_split} (teacher-forced) at step {done}", results)
            if decode_evaluator_fn is not None and decode_eval_period and (
                done % decode_eval_period == 0 or done == train_steps
            ):
                if run_evaluator(done):
                    flush(done)
                    checkpoints.save(state, force=True, meta={"task_names": task_names})
                    break
        if train_steps == start and start > 0:
            print(f"Checkpoint step {start} already reached TRAIN_STEPS={train_steps}", flush=True)
    finally:
        prefetcher.close()
        checkpoints.close()
        writer.close()
    return state


def _resolve_train_steps(train_input: Any, train_steps: Any, train_epochs: Any) -> int:
    if (train_steps is None) == (train_epochs is None):
        raise ValueError(
            f"train_steps={train_steps!r}, train_epochs={train_epochs!r}: give exactly one "
            "(TRAIN_STEPS, or epochs of an input with steps_per_epoch)"
        )
    if train_epochs is not None:
        if not isinstance(train_epochs, int) or isinstance(train_epochs, bool) or train_epochs < 0:
            raise ValueError(f"train_epochs={train_epochs!r}; accepted: an integer >= 0")
        return train_epochs * _steps_per_epoch(train_input, "train_epochs")
    if not isinstance(train_steps, int) or isinstance(train_steps, bool) or train_steps < 0:
        raise ValueError(f"train_steps={train_steps!r}; accepted: an integer >= 0")
    return train_steps


def _steps_per_epoch(train_input: Any, what: str) -> int:
    n = getattr(train_input, "steps_per_epoch", None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(
            f"{what} is given in epochs but train_input={type(train_input).__name__} has no "
            "positive integer `steps_per_epoch`; give it in steps"
        )
    return n


def _resolve_period(name: str, period: Any, train_input: Any) -> int:
    """A period in steps: an int >= 0, or "epoch" (the input's `steps_per_epoch`)."""
    if period == "epoch":
        return _steps_per_epoch(train_input, f"{name}='epoch'")
    if not isinstance(period, int) or isinstance(period, bool) or period < 0:
        raise ValueError(f"{name}={period!r}; accepted: an integer >= 0 or 'epoch'")
    return period


class EarlyStopping:
    """Best-so-far bookkeeping of one in-run metric (higher is better).

    Args:
      metric: `"task/metric"` in the evaluator's `{task: {metric: value}}` results, or
        `"metric"` when the evaluator reports a single task.
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
                f"early_stopping_metric={self.metric!r}: the evaluator returned {results!r}, "
                "not {task: {metric: value}}"
            )
        if "/" in self.metric:
            task, name = self.metric.split("/")
        elif len(results) == 1:
            task, name = next(iter(results)), self.metric
        else:
            raise ValueError(
                f"early_stopping_metric={self.metric!r}: the evaluator reports tasks "
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

    def restore(self, model_dir: str | os.PathLike, upto_step: int) -> None:
        """Continues from the last record of this metric at or before `upto_step` in
        `<model_dir>/metrics.jsonl` (a resumed run)."""
        from ktx.summaries import read_metrics

        path = pathlib.Path(model_dir) / "metrics.jsonl"
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
