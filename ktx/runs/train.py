"""`train(...)`: the training loop behind `ktx train`, with explicit arguments.

The loop (T5X style): build the mesh and the sharded state; resume from the latest
checkpoint in `model_dir` (or start from `initial_checkpoint_path`'s params); then for
each step `s` take `train_input.get_batch(s)` (a pure function of the step, so resuming
at step s continues the data stream exactly) and run the compiled step. The periodic
actions after a step are `ktx.runs.hooks`: metrics every `log_period` steps (stopping on a
non-finite loss), checkpoints, and the run's evaluators with early stopping.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
import optax

from ktx import partitioning
from ktx.training.checkpoints import CheckpointManager
from ktx.training.initial_params import load_initial_params
from ktx.runs.preemption import Preempted, PreemptionGuard
from ktx.runs.profiling import ProfileWindow, check_profile_steps
from ktx.runs.hooks import (
    Checkpointing,
    EarlyStopping,
    Evaluation,
    NonFiniteLossError,
    TrainMetrics,
)
from ktx.models.base import BaseModel
from ktx.training.optimizers import TaskOptimizer
from ktx.runs.run_dir import RunDir
from ktx.training.summaries import MetricsWriter
from ktx.training.mt_uncertainty import check_proxies, proxy_indices
from ktx.training.throughput import Throughput, device_peak, token_counts
from ktx.training.trainer import Trainer, TrainState

__all__ = ["TrainInput", "check_train_input", "NonFiniteLossError", "Prefetcher", "EarlyStopping",
           "train"]

_log = logging.getLogger(__name__)


def _print_slots_advice(trainer: Trainer, train_input: Any, steps: int = 64) -> None:
    """Says so when a balanced step on this mesh takes per-task gradients of devices that
    hold several tasks' rows (`ktx.optim.device_slots.slots_advice`), from the counts of
    the input's first `steps` steps."""
    from ktx.optim.device_slots import slots_advice

    counts = getattr(train_input, "task_counts", lambda step: None)
    if not trainer.task_gradients_by_device or counts(0) is None:
        return
    advice = slots_advice([counts(s) for s in range(steps)],
                          int(trainer.mesh.shape[partitioning.DATA]))
    if advice:
        print(advice, flush=True)


@runtime_checkable
class TrainInput(Protocol):
    """What the training loop reads: this process's rows of the global batch of each step.

    `get_batch(step)` is a pure function of the step (a resumed run continues the data
    stream exactly) returning `{feature: [B_host, ...]}` with an int32 `task_id`;
    `task_counts(step)` gives the rows per task of a task-partitioned batch (rows of task
    t contiguous, tasks in id order; the balanced step's blocks), or None for a sampled
    batch. `task_names` are in `task_id` order. Optional: `steps_per_epoch` (periods in
    epochs), `eval_batches(task, split, batch_size)` (`ktx.runs.eval.TeacherForcedEvaluator`)
    and `process_grouped` (True: the global batch is each process's rows grouped by task,
    one process after another, with `task_counts` rows of each task in all; the Trainer
    regroups them, `StepOptions.regroup_by_task`).
    Implementations: `ktx.data.pipeline.MultiTaskInput` (SeqIO tasks and mixtures),
    `ktx.data.recsys.RecsysTrainInput`.
    """

    task_names: Sequence[str]
    num_tasks: int

    def get_batch(self, step: int) -> dict[str, np.ndarray]: ...

    def task_counts(self, step: int) -> Sequence[int] | None: ...


def check_train_input(train_input: Any) -> None:
    """Raises TypeError naming what `train_input` lacks from `TrainInput`."""
    missing = [name for name in ("task_names", "num_tasks", "get_batch", "task_counts")
               if not hasattr(train_input, name)]
    if missing:
        raise TypeError(
            f"train_input={train_input!r} lacks {missing}; a ktx.runs.train.TrainInput has "
            "task_names, num_tasks, get_batch(step) and task_counts(step)")


def _host_rows(batch) -> int:
    return int(np.shape(next(iter(batch.values())))[0])


class Prefetcher:
    """Prepares the global batches of steps `[start, stop)` in a background thread,
    `depth` steps ahead (`get_batch`, `task_counts`, then `Trainer.global_batch`), so
    the host builds batch s+1 while the devices run step s. Batches are a function of
    the step, so prefetching changes nothing in what a step sees.

    Iterating yields `(step, global_batch, task_counts, wait_seconds)`, where
    `wait_seconds` is the time the loop blocked waiting for that batch; `tokens.pop(step)`
    is then this process's `(non-padding, all)` tokens of the item
    (`ktx.training.throughput.token_counts`). With a `plan`
    (block lengths summing to `stop - start`, `steps_per_call`), an item of length
    `n > 1` holds the `n` batches of steps `step .. step + n - 1` stacked `[n, B, ...]`
    with their `n` count tuples (`Trainer.train_steps`).
    """

    def __init__(self, train_input: Any, trainer: Trainer, start: int, stop: int, depth: int = 2,
                 plan: Sequence[int] | None = None):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"prefetch depth={depth!r}; accepted: an integer >= 1")
        plan = [1] * (stop - start) if plan is None else [int(n) for n in plan]
        if sum(plan) != stop - start or any(n < 1 for n in plan):
            raise ValueError(f"plan={plan!r} must be positive block lengths summing to "
                             f"{stop - start} (steps {start}..{stop - 1})")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._n = len(plan)
        self.tokens: dict[int, tuple[int, int]] = {}

        def block(step, n):
            if n == 1:
                counts = train_input.task_counts(step)
                host = train_input.get_batch(step)
                self.tokens[step] = token_counts(host)
                return trainer.global_batch(host, counts), counts
            batches = [train_input.get_batch(s) for s in range(step, step + n)]
            self.tokens[step] = tuple(map(sum, zip(*(token_counts(b) for b in batches))))
            counts = [train_input.task_counts(s) for s in range(step, step + n)]
            counts = None if any(c is None for c in counts) else counts
            stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
            return trainer.global_batch(stacked, counts, batch_axis=1), counts

        def produce():
            try:
                step = start
                for n in plan:
                    if self._stop.is_set():
                        return
                    batch, counts = block(step, n)
                    item = (step, batch, counts, None)
                    step += n
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


def train(
    *,
    model: BaseModel,
    train_input: TrainInput,
    model_dir: str | os.PathLike,
    optimizer: TaskOptimizer | optax.GradientTransformation,
    train_steps: int | None = None,
    train_epochs: int | None = None,
    schedule: Any = None,
    balancer: Any = None,
    num_partitions: int = 1,
    additional_rules: Sequence[tuple[str, str | None]] = (),
    parameter_partitioning_dims: int = 1,
    num_microbatches: int = 1,
    grad_method: str = "auto",
    shared: Sequence[str] | None = None,
    sparse_tables: Sequence[str] | None = None,
    target_task: int = 0,
    log_diagnostics: bool = True,
    weights_from_losses: bool = True,
    task_grad_dtype: str | None = None,
    norm_metrics: bool = False,
    seed: int = 0,
    log_period: int = 100,
    checkpoint_period: int | str = 1000,
    keep_checkpoints: int | None = None,
    async_checkpoints: bool = False,
    initial_checkpoint_path: str | None = None,
    evaluators: Sequence[Any] = (),
    eval_period: int | str = 0,
    early_stopping_metric: str | None = None,
    early_stopping_patience: int = 0,
    started_callback: Callable[[], None] | None = None,
    prefetch_depth: int = 2,
    mt_uncertainty_rows: int = 0,
    mt_uncertainty_proxies: Mapping[str, str] | None = None,
    steps_per_call: int = 1,
    handle_preemption: bool = True,
    preemption_timeout: float | None = 60.0,
    preemption_check_period: int = 1,
    peak_tflops: float | None = None,
    profile_steps: Sequence[int] | None = None,
) -> TrainState:
    """Trains `model` on `train_input` for `train_steps` steps (total, resumed runs
    included) and returns the final state.

    Args:
      model: a `BaseModel`.
      train_input: a `ktx.data.pipeline.TrainInput`.
      model_dir: the run directory (`ktx.runs.run_dir.RunDir`).
      optimizer: a `ktx.training.optimizers.TaskOptimizer`, or an optax transformation completed
        by `schedule` (only reported) and `balancer` (a `ktx.optim` balancer: per-task
        gradient path).
      train_steps: the step to stop at (T5X's TRAIN_STEPS).
      train_epochs: instead of `train_steps`, stop after this many epochs of an input
        that defines `steps_per_epoch` (e.g. `ktx.data.recsys.RecsysTrainInput`).
      num_partitions: model-parallel size (NUM_PARTITIONS); the rest is data-parallel.
      additional_rules, parameter_partitioning_dims: the logical axis rules
        (`ktx.partitioning.standard_logical_axis_rules`; dims 2 also splits each
        parameter's `embed` axis over `data`).
      num_microbatches, grad_method, shared, sparse_tables, target_task: the step's
        `ktx.training.trainer.StepOptions`.
      log_diagnostics: balanced runs: log per-task gradient norms, cosines (against
        `target_task`) and MetaBalance weights at every log step.
      weights_from_losses: balanced runs whose balancer weighs the losses only
        (Single-Loss, Vanilla-Multi, fixed weights, Uncertainty, DWA): one backward pass
        of the weighted loss instead of per-task gradients (the same update); False:
        per-task gradients every step (`StepOptions.weights_from_losses`).
      task_grad_dtype: balanced runs: "bfloat16" holds the per-task gradients in bfloat16
        (`StepOptions.task_grad_dtype`), for a model whose T gradient shards do not fit
        in float32; None: the parameters' dtype.
      norm_metrics: also report `grad_norm`, `update_norm` and `param_norm` in every log
        line (`--gin.train_script.train.norm_metrics=True`); off by default, as in T5X:
        they read the gradient, the update and the parameters again every step.
      seed: parameter init and dropout keys.
      log_period: steps between metric fetches / NaN checks / progress lines.
      checkpoint_period, keep_checkpoints: save cadence (steps, or "epoch" for an input
        with `steps_per_epoch`) and how many to keep; a final checkpoint is always
        written at `train_steps` (and when training stops early).
      initial_checkpoint_path: start a *new* run from another run's parameters (or a
        Hugging Face / T5X checkpoint, `hf:DIR` / `t5x:DIR`).
      evaluators: `ktx.runs.eval.Evaluator`s run every `eval_period` steps (or "epoch") and
        at the last step: `DecodeEvaluator`, `TeacherForcedEvaluator` (its input and
        batch size default to the run's), `ktx.runs.rank_eval.RankingEvaluator`.
      early_stopping_metric, early_stopping_patience: stop when the evaluators'
        `"task/metric"` (or `"metric"` if they report one task; higher is better) has
        not improved for `early_stopping_patience` evaluations (0: never stop early).
        The stop writes a checkpoint; the bookkeeping is in `metrics.jsonl` (split
        `early_stopping`), so a resumed run continues it and a stopped run stays
        stopped.
      started_callback: called once the state exists (the CLI writes config.gin there).
      prefetch_depth: batches prepared ahead in a background thread (`Prefetcher`);
        `input_wait_fraction` in the train metrics is the share of wall time the loop
        blocked on input.
      mt_uncertainty_rows: MT-uncertainty sampling (CA-MTL; `ktx.training.mt_uncertainty`):
        each input batch holds candidates and the step trains on this many of them (0:
        off). `mt_uncertainty_proxies` `{regression task: classification task}` names
        whose entropies each regression task's rows borrow.
      steps_per_call: run up to this many steps in one compiled call (`Trainer.train_steps`,
        a `lax.scan` over `[K, B, ...]` blocks of batches), so the host neither dispatches
        nor waits per step: small models whose step is shorter than Python's per-step
        overhead (the recommendation model) train at the scanned loop's speed. A block
        ends at every log, checkpoint and evaluation step, so those happen at the same
        steps and a run's losses, checkpoints and resume are those of `steps_per_call=1`
        (each distinct block length compiles once).
      handle_preemption, preemption_timeout, preemption_check_period: SIGTERM and SIGINT
        stop the run at the next step boundary on every process (the flags agreed there,
        every `preemption_check_period` boundaries), after a synchronous checkpoint of
        that step, by raising `ktx.runs.preemption.Preempted` (`ktx train` exits 75); a
        boundary that does not come within `preemption_timeout` seconds of the signal (an
        evaluation, the first compile) is not waited for: the process exits 75 without a
        new checkpoint (`ktx.runs.preemption.PreemptionGuard`; docs/multihost.md).
      peak_tflops: a measured peak (TFLOP/s per device) for the MFU of the train metrics;
        None: the device's published peak (`ktx.training.throughput.device_peak`; on a
        CPU there is none and MFU is n/a). Every log step reports tokens/s (all and
        non-padding), examples/s, the step's TFLOP/s per device (XLA's cost analysis
        of the compiled step) and MFU.
      profile_steps: `(start, stop)`: a `jax.profiler` trace of steps `start .. stop - 1`
        under `<model_dir>/profile/` (PROFILE_STEPS; `ktx.runs.profiling`).
    """
    check_train_input(train_input)
    guard = PreemptionGuard(timeout_seconds=preemption_timeout,
                            check_period=preemption_check_period) if handle_preemption else None
    throughput = Throughput(*device_peak(peak_tflops=peak_tflops))
    if isinstance(steps_per_call, bool) or not isinstance(steps_per_call, int) \
            or steps_per_call < 1:
        raise ValueError(f"steps_per_call={steps_per_call!r}; accepted: an integer >= 1")
    train_steps = _resolve_train_steps(train_input, train_steps, train_epochs)
    profile_steps = check_profile_steps(profile_steps, train_steps)
    checkpoint_period = _resolve_period("checkpoint_period", checkpoint_period, train_input)
    eval_period = _resolve_period("eval_period", eval_period, train_input)
    evaluators = tuple(evaluators or ())
    if not isinstance(early_stopping_patience, int) or early_stopping_patience < 0:
        raise ValueError(
            f"early_stopping_patience={early_stopping_patience!r}; accepted: an integer >= 0"
        )
    if early_stopping_patience and (not early_stopping_metric or not evaluators or not eval_period):
        raise ValueError(
            f"early_stopping_patience={early_stopping_patience} needs early_stopping_metric "
            "('task/metric'), evaluators and eval_period > 0"
        )
    if train_input.num_tasks != model.num_tasks:
        raise ValueError(
            f"the input has {train_input.num_tasks} tasks {list(train_input.task_names)} but "
            f"model.num_tasks={model.num_tasks}; set NUM_TASKS to {train_input.num_tasks}"
        )
    task_names = tuple(train_input.task_names)
    run = RunDir(model_dir).makedirs()

    proxies = proxy_indices(mt_uncertainty_proxies, task_names)
    if mt_uncertainty_rows:
        check_proxies(model, proxies, task_names)
    trainer = Trainer(
        model, optimizer, balancer=balancer, schedule=schedule,
        mesh=partitioning.create_mesh(num_partitions),
        rules=partitioning.standard_logical_axis_rules(additional_rules,
                                                       parameter_partitioning_dims),
        num_microbatches=num_microbatches, grad_method=grad_method, shared=shared,
        sparse_tables=sparse_tables, diagnostics_period=log_period if log_diagnostics else 0,
        target_task=target_task, uncertainty_rows=mt_uncertainty_rows, norm_metrics=norm_metrics,
        weights_from_losses=weights_from_losses, task_grad_dtype=task_grad_dtype,
        uncertainty_proxies=proxies,
        # A sharded MultiTaskInput's process-grouped batches: the step regroups them by task.
        regroup_by_task=bool(getattr(train_input, "process_grouped", False)),
    )
    if trainer.options.regroup_by_task:
        print(f"Input: process {jax.process_index()} of {jax.process_count()} supplies its share "
              "of every task from its own shards (process-grouped batches; the balanced step "
              "regroups them by task)", flush=True)
    _print_slots_advice(trainer, train_input)
    first_batch = train_input.get_batch(0)
    candidates = _host_rows(first_batch) * jax.process_count()
    if mt_uncertainty_rows and mt_uncertainty_rows > candidates:
        raise ValueError(
            f"mt_uncertainty_rows={mt_uncertainty_rows} but a batch holds {candidates} candidate "
            "rows; MT-uncertainty sampling keeps a part of each batch: set BATCH_SIZE to "
            "(tasks x rows), as the authors draw one batch from every task")
    state, start = _restore_or_init(trainer, run, first_batch, seed, initial_checkpoint_path,
                                    checkpoints := CheckpointManager(
                                        run.root, save_period=checkpoint_period,
                                        keep=keep_checkpoints, async_save=async_checkpoints))
    if started_callback is not None:
        started_callback()
    dropout_rng = jax.random.split(jax.random.key(seed))[1]

    writer = MetricsWriter(run.root, resume_step=start)
    metrics = TrainMetrics(writer, task_names, train_steps=train_steps, start_step=start,
                           log_period=log_period, checkpoint_dir=checkpoints.directory,
                           last_good=checkpoints.latest_step(), throughput=throughput)
    checkpointing = Checkpointing(checkpoints, task_names, train_steps)
    for evaluator in evaluators:
        if hasattr(evaluator, "use_train_input"):
            evaluator.use_train_input(train_input, _host_rows(first_batch) * jax.process_count())
    evaluation = Evaluation(
        evaluators, eval_period, writer, train_steps=train_steps,
        stopper=EarlyStopping(early_stopping_metric, early_stopping_patience)
        if early_stopping_patience else None)

    prefetcher = None
    profile = ProfileWindow(profile_steps, run.root, process_index=jax.process_index(),
                            process_count=jax.process_count())
    # Signals before this point end the process as usual: nothing is trained yet.
    if guard is not None:
        guard.__enter__()
    try:
        if evaluation.resume(trainer, state.params, run.root, start):
            return state
        plan = _block_plan(start, train_steps, steps_per_call, lambda done: (
            metrics.due(done) or checkpointing.due(done) or evaluation.due(done)
            or profile.boundary(done)))
        prefetcher = Prefetcher(train_input, trainer, start, train_steps, depth=prefetch_depth,
                                plan=plan)
        _phase(guard, "the first compile", metrics.last_good)
        for (step, batch, counts, wait), n in zip(prefetcher, plan):
            profile.before(step)
            if n == 1:
                state, step_metrics = trainer.train_step(state, batch, dropout_rng, counts)
                metrics.add(step, step_metrics, wait)
            else:
                state, step_metrics = trainer.train_steps(state, batch, dropout_rng, counts)
                metrics.add_stacked(step, n, step_metrics, wait)
            throughput.add(n, trainer.last_step_flops, prefetcher.tokens.pop(step, None))
            done = step + n
            profile.after(done, state)
            if metrics.due(done):
                metrics.flush(done)
            if checkpointing.due(done):
                checkpointing.save(state, done, metrics)
            # The last step ends the run anyway (its checkpoint is written above).
            preemptible = guard is not None and done < train_steps
            _phase(guard, f"training (after step {done})", metrics.last_good)
            if preemptible and guard.should_stop(done):
                _preemption_save(guard, checkpointing, checkpoints, state, done, metrics)
            if evaluation.due(done):
                _phase(guard, f"the evaluation at step {done}", metrics.last_good)
                if evaluation.run(trainer, state.params, done):
                    checkpointing.save(state, done, metrics, force=True)
                    break
                _phase(guard, f"training (after step {done})", metrics.last_good)
                if preemptible and guard.should_stop(done):
                    _preemption_save(guard, checkpointing, checkpoints, state, done, metrics)
        if train_steps == start and start > 0:
            print(f"Checkpoint step {start} already reached TRAIN_STEPS={train_steps}", flush=True)
    finally:
        profile.close()
        if prefetcher is not None:
            prefetcher.close()
        checkpoints.close()
        writer.close()
        if guard is not None:
            guard.__exit__(None, None, None)
    return state


def _phase(guard: PreemptionGuard | None, phase: str, last_checkpoint: int | None) -> None:
    if guard is not None:
        guard.phase, guard.last_checkpoint = phase, last_checkpoint


def _preemption_save(guard: PreemptionGuard, checkpointing: Checkpointing,
                     checkpoints: CheckpointManager, state: TrainState, done: int,
                     metrics: TrainMetrics) -> None:
    """The checkpoint of step `done`, written synchronously; then `Preempted`."""
    guard.saving()
    checkpointing.save(state, done, metrics, force=True)
    checkpoints.wait()
    raise Preempted(done, guard.reason or "a preemption signal", checkpoints.directory)


def _restore_or_init(trainer: Trainer, run: RunDir, first_batch, seed: int,
                     initial_checkpoint_path: str | None,
                     checkpoints: CheckpointManager) -> tuple[TrainState, int]:
    """The latest good checkpoint of `run`, else a fresh state (with the parameters of
    `initial_checkpoint_path` when given); returns `(state, step)`."""
    abstract, _ = trainer.create_abstract_state(first_batch)
    state = checkpoints.restore_latest_good(abstract)
    if state is not None:
        step = int(jax.device_get(state.step))
        _log.info("resumed from %s at step %d", checkpoints.directory, step)
        print(f"Resuming from checkpoint step {step} in {checkpoints.directory}", flush=True)
        return state, step
    rng = jax.random.split(jax.random.key(seed))[0]
    if not initial_checkpoint_path:
        return trainer.init_state(rng, first_batch), 0
    # Only the parameters the checkpoint lacks are initialized: no random copy of the rest.
    params, report = load_initial_params(initial_checkpoint_path, abstract.params,
                                         lambda names: trainer.init_params(rng, first_batch, names))
    print(report.summary(), flush=True)
    # Optimizer state and the model's state (SMART's teacher = these parameters) of step 0.
    return trainer.init_rest_of_state(params), 0


def _block_plan(start: int, stop: int, steps_per_call: int,
                due: Callable[[int], bool]) -> list[int]:
    """Lengths of the blocks of steps `start .. stop - 1` run per call: at most
    `steps_per_call`, each ending at the first step after which `due(done)` (a log,
    checkpoint or evaluation step) or at `stop`."""
    plan, step = [], start
    while step < stop:
        n = 1
        while n < steps_per_call and step + n < stop and not due(step + n):
            n += 1
        plan.append(n)
        step += n
    return plan


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
