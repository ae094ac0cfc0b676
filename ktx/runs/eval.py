"""Evaluation: teacher-forced per-task metrics, SeqIO decoding metrics, and `ktx eval`.

* `teacher_forced_eval`: the model's aux sums (loss, token accuracy, ...) over every
  example of each task's split, from the input's `eval_batches(task, split, bs)`.
* `DecodeEvaluator`: one `seqio.Evaluator` per task (so the predict function knows the
  task's `task_id`), decoding with the model's `predict_batch` and scoring with the
  task's postprocessor and metric fns.
* `evaluate`: offline evaluation of the checkpoints of a run directory (every one, the
  latest, or given steps): writes `<model_dir>/eval/metrics.jsonl` and TensorBoard
  events, and returns (and `format_table` prints) per task the best step and score and
  the single step with the best average score. A task's score is its first metric (in
  the order the task's metric fns report them).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
import optax

from ktx import partitioning
from ktx.data import feature_converter as fc
from ktx.training.checkpoints import restore_params_skipping_corrupt
from ktx.models.base import BaseModel
from ktx.models.decoding import check_sampling
from ktx.runs.eval_progress import EvalProgress
from ktx.runs.run_dir import RunDir
from ktx.training.summaries import MetricsWriter, per_task_metrics, quiet_absl, read_metrics
from ktx.training.trainer import Trainer

_log = logging.getLogger(__name__)  # ktx.cli prints it as `ktx: ...`

__all__ = [
    "teacher_forced_eval",
    "DecodeEvaluator",
    "Evaluator",
    "SplitEvaluator",
    "TeacherForcedEvaluator",
    "EvalSummary",
    "evaluate",
    "format_table",
    "checkpoint_steps_of",
    "make_predict_fn",
]


def _batch_and_rows(item: Any) -> tuple[Mapping[str, np.ndarray], int | None]:
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], Mapping):
        return item[0], int(item[1])
    if isinstance(item, Mapping):
        return item, None
    raise TypeError(
        f"eval_batches yielded {type(item).__name__}; expected a feature dict or "
        f"(feature dict, num_real_rows)"
    )


def teacher_forced_eval(
    trainer: Trainer,
    params: Any,
    eval_input: Any,
    task_names: Sequence[str],
    *,
    split: str = "validation",
    batch_size: int = 32,
) -> dict[str, dict[str, float]]:
    """`{task: {metric: mean}}` (plus `"all"`) over every example of each task's `split`.

    Padding rows must carry zero loss weight (they add nothing to the sums).
    """
    if not hasattr(eval_input, "eval_batches"):
        raise TypeError(
            f"eval_input={eval_input!r} has no eval_batches(task_name, split, batch_size)"
        )
    total: dict[str, np.ndarray] = {}
    for t, name in enumerate(task_names):
        for item in eval_input.eval_batches(name, split, batch_size):
            batch, num_real = _batch_and_rows(item)
            out = jax.device_get(trainer.eval_step(params, batch))
            if num_real is not None:  # padding rows are not examples
                out["examples"] = np.zeros(len(task_names)).astype(np.float64)
                out["examples"][t] = num_real
            for k, v in out.items():
                total[k] = total.get(k, 0) + np.asarray(v, np.float64)
    if not total:
        return {}
    by_task = per_task_metrics(total, task_names)
    for row in by_task.values():
        if "loss_sum" in row:
            row.pop("loss_sum")
    return by_task


class Evaluator(Protocol):
    """An in-run evaluation (`ktx.runs.train.train`'s `evaluators`, run every `eval_period`
    steps): scores `params` at `step`, writes its own split to `writer`, and returns
    `{task: {metric: value}}` (higher is better for early stopping). `title` names it
    in the console (`"<title> at step <n>:"`).

    Implementations: `DecodeEvaluator` (SeqIO decoding, each benchmark's metrics),
    `TeacherForcedEvaluator` (the model's own aux sums without decoding),
    `ktx.runs.rank_eval.RankingEvaluator` (full ranking of the recommendation model).
    """

    title: str

    def __call__(self, *, trainer: Trainer, params: Any, step: int,
                 writer: MetricsWriter | None = None) -> Mapping[str, Mapping[str, float]]:
        ...


class SplitEvaluator:
    """What the evaluators that score one split of the run's tasks share: `eval_input`
    (an input with `eval_batches(task, split, batch_size)`, e.g.
    `ktx.data.pipeline.MultiTaskInput`; None: the run's training input, set by
    `use_train_input`, which the train loop calls), `split`, and `batch_size` (global;
    None: the training batch size). `kind` names the scores in the title."""

    kind = "scores"

    def __init__(self, eval_input: Any = None, *, split: str = "validation",
                 batch_size: int | None = None):
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
                batch_size, int) or batch_size < 1):
            raise ValueError(f"{type(self).__name__}.batch_size={batch_size!r}; accepted: an "
                             "integer >= 1, or None (the training batch size)")
        self.eval_input, self.split, self.batch_size = eval_input, split, batch_size
        self.title = f"{split} ({self.kind})"

    def use_train_input(self, train_input: Any, global_batch_size: int) -> None:
        """Defaults from the run: its input (when none was given) and batch size."""
        if self.eval_input is None:
            self.eval_input = train_input
        if self.batch_size is None:
            self.batch_size = global_batch_size

    def _check_ready(self) -> None:
        if self.eval_input is None or self.batch_size is None:
            raise ValueError(f"{type(self).__name__}: no eval_input/batch_size; give them, or "
                             "run it inside ktx.runs.train.train (which supplies the run's)")

    def _device_fn(self, model: BaseModel):
        """`fn(params, batch)`: what the evaluator computes on the devices for one batch
        (its outputs come back replicated, to be read on the host). Subclasses that use
        `_on_mesh` define it."""
        raise NotImplementedError(f"{type(self).__name__} defines no _device_fn")

    def _on_mesh(self, trainer: Trainer) -> Any:
        """`_device_fn(trainer.model)` jitted for `trainer`'s mesh (`jit_on_mesh`), built
        once per trainer and reused at every later evaluation."""
        if getattr(self, "_mesh_trainer", None) is not trainer:
            self._mesh_fn = jit_on_mesh(trainer, self._device_fn(trainer.model))
            self._mesh_trainer = trainer
        return self._mesh_fn


class TeacherForcedEvaluator(SplitEvaluator):
    """Teacher-forced scores of every task's `split` (`teacher_forced_eval`): the model's
    aux sums (loss, accuracy, ...) without decoding. Arguments: `SplitEvaluator`'s."""

    kind = "teacher-forced"

    def __call__(self, *, trainer: Trainer, params: Any, step: int,
                 writer: MetricsWriter | None = None) -> dict[str, dict[str, float]]:
        self._check_ready()
        names = tuple(self.eval_input.task_names)
        results = teacher_forced_eval(trainer, params, self.eval_input, names,
                                      split=self.split, batch_size=self.batch_size)
        if writer is not None:
            writer.write_tasks(step, self.split, results)
        return results


def jit_on_mesh(trainer: Trainer, fn) -> Any:
    """`fn(params, batch)` jitted for `trainer`'s mesh: parameters sharded as the train
    state's, the batch over `data`, the outputs replicated (read on the host)."""
    return jax.jit(fn, in_shardings=(trainer.state_shardings.params,
                                     partitioning.data_sharding(trainer.mesh)),
                   out_shardings=partitioning.replicated_sharding(trainer.mesh))


def make_predict_fn(model: BaseModel, trainer: Trainer, **decode_kwargs):
    """A jitted `(params, batch) -> [B, Ld]` decode on the trainer's mesh."""
    if not hasattr(model, "predict_batch"):
        raise TypeError(f"{type(model).__name__} has no predict_batch: decoding needs a seq2seq model")
    fn = jit_on_mesh(trainer, functools.partial(model.predict_batch, **decode_kwargs))

    def predict(params, batch):
        global_batch = trainer.global_batch(batch)
        with trainer._context():
            return np.asarray(jax.device_get(fn(params, global_batch)))

    return predict


def _local_rows(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    n = jax.process_count()
    if n == 1:
        return dict(batch)
    rows = next(iter(batch.values())).shape[0] // n
    lo = jax.process_index() * rows
    return {k: v[lo:lo + rows] for k, v in batch.items()}


def _pad(batch: dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
    out = {}
    for k, v in batch.items():
        pad = size - v.shape[0]
        out[k] = np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) if pad else v
    return out


def _strip(tokens: np.ndarray) -> list[int]:
    ids = [int(t) for t in tokens]
    return ids[: ids.index(0)] if 0 in ids else ids


class DecodeEvaluator:
    """SeqIO decoding evaluation of each task of a mixture.

    Args:
      task_names: the mixture's tasks in `task_id` order.
      task_feature_lengths: `{"inputs": Le, "targets": Ld}`.
      split: the evaluation split.
      batch_size: global decode batch size (divisible by the data-parallel size).
      num_examples: evaluate at most this many examples per task (None: all).
      decode_method, num_beams, alpha: passed to `model.predict_batch`.
      temperature, top_k, top_p, seed: `decode_method="sample"`
        (`ktx.models.decoding.temperature_sample`; each example draws with the key of
        `(seed, its index in the split)`: an evaluation is reproducible and does not
        depend on the batch size).
    """

    def __init__(
        self,
        task_names: Sequence[str],
        task_feature_lengths: Mapping[str, int],
        *,
        split: str = "validation",
        batch_size: int = 32,
        num_examples: int | None = None,
        decode_method: str = "greedy",
        num_beams: int = 4,
        alpha: float = 0.6,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        seed: int = 0,
    ):
        if not task_names:
            raise ValueError("task_names is empty")
        if decode_method == "sample":
            check_sampling(temperature, top_k, top_p)
        self.task_names = tuple(task_names)
        self.task_feature_lengths = dict(task_feature_lengths)
        self.split = split
        self.batch_size = batch_size
        self.num_examples = num_examples
        self.decode_kwargs = dict(decode_method=decode_method)
        if decode_method == "beam":
            self.decode_kwargs.update(num_beams=num_beams, alpha=alpha)
        if decode_method == "sample":
            self.decode_kwargs.update(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        self._evaluators = None
        self._predict = None
        self._score = None
        self._trainer = None
        self.title = "evaluation"

    def _build(self):
        import seqio

        self._evaluators = {}
        # SeqIO notes that fixed eval lengths exceed some examples' (they are the run's
        # lengths on purpose) and that no SeqIO logger is set (ktx writes the metrics).
        notices = ("Given sequence lengths are longer than necessary", "'logger_cls' is empty")
        for name in self.task_names:
            with quiet_absl(*notices):
                self._evaluators[name] = seqio.Evaluator(
                    mixture_or_task_name=name,
                    feature_converter=seqio.EncDecFeatureConverter(pack=False),
                    eval_split=self.split,
                    sequence_length=self.task_feature_lengths,
                    num_examples=self.num_examples,
                    use_memory_cache=True,
                    async_compute_metrics=False,
                )

    def _batches(self, ds, task_id: int) -> Iterable[tuple[np.ndarray, dict[str, np.ndarray], int]]:
        for index, features in ds.batch(self.batch_size).as_numpy_iterator():
            n = len(index)
            batch = fc.add_task_id({k: np.asarray(v) for k, v in features.items()}, task_id,
                                   np.int32)
            if self.decode_kwargs["decode_method"] == "sample":  # keys the example's draws
                batch["decode_row"] = np.asarray(index, np.int32)
            yield np.asarray(index), _local_rows(_pad(batch, self.batch_size)), n

    def __call__(
        self, *, trainer: Trainer, params: Any, step: int, writer: MetricsWriter | None = None
    ) -> dict[str, dict[str, float]]:
        """Decodes every task, computes its SeqIO metrics, writes them under split
        `<split>_decode`, and returns `{task: {metric: value}}`."""
        if self._evaluators is None:
            self._build()
        if self._trainer is not trainer:
            self._trainer = trainer
            self._predict = make_predict_fn(trainer.model, trainer, **self.decode_kwargs)
            self._score = None
            if hasattr(trainer.model, "score_batch"):
                self._score = jax.jit(
                    trainer.model.score_batch,
                    in_shardings=(trainer.state_shardings.params, partitioning.data_sharding(trainer.mesh)),
                    out_shardings=partitioning.replicated_sharding(trainer.mesh),
                )
        results = {}
        for task_id, name in enumerate(self.task_names):
            evaluator = self._evaluators[name]

            def predict_fn(ds, task_id=task_id, name=name):
                out = []
                total = int(ds.cardinality())  # < 0: unknown
                progress = EvalProgress(f"decoding {name} ({self.split}) at step {step}",
                                        total if total > 0 else None, "examples")
                for index, batch, n in self._batches(ds, task_id):
                    tokens = self._predict(params, batch)[:n]
                    progress.add(n)
                    # Fixed-length rows (0 after EOS), as seqio stacks them.
                    out.extend((int(i), [int(x) for x in t]) for i, t in zip(index, tokens))
                return out

            def score_fn(ds, task_id=task_id):
                out = []
                for index, batch, n in self._batches(ds, task_id):
                    with trainer._context():
                        scores = np.asarray(jax.device_get(
                            self._score(params, trainer.global_batch(batch))))[:n]
                    out.extend((int(i), float(s)) for i, s in zip(index, scores))
                return out

            metrics, _ = evaluator.evaluate(
                compute_metrics=True, step=step, predict_fn=predict_fn,
                score_fn=score_fn if self._score is not None else None,
            )
            values = metrics.result()[name]
            results[name] = {}
            for k, v in values.items():
                v = getattr(v, "value", v)
                if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number):
                    results[name][k] = float(v)
                else:  # seqio Text / Histogram values are not scalars
                    _log.info("task %s: metric %s is not a scalar (%s); not logged",
                                 name, k, type(v).__name__)
        if writer is not None:
            writer.write_tasks(step, f"{self.split}_decode", results)
        return results


@dataclasses.dataclass
class EvalSummary:
    """`scores[step][task]` (each task's first metric), `metrics[step][task]` (all)."""

    metrics: dict[int, dict[str, dict[str, float]]]
    scores: dict[int, dict[str, float]]

    def best_per_task(self) -> dict[str, tuple[int, float]]:
        best: dict[str, tuple[int, float]] = {}
        for step, by_task in sorted(self.scores.items()):
            for task, score in by_task.items():
                if task not in best or score > best[task][1]:
                    best[task] = (step, score)
        return best

    def best_average(self) -> tuple[int, float] | None:
        averages = {s: float(np.mean(list(t.values()))) for s, t in self.scores.items() if t}
        if not averages:
            return None
        step = max(sorted(averages), key=lambda s: averages[s])
        return step, averages[step]


def format_table(summary: EvalSummary) -> str:
    """Per task: best step and score; then the step with the best average."""
    rows = [("task", "best step", "score", "metric")]
    first_step = min(summary.metrics) if summary.metrics else None
    for task, (step, score) in summary.best_per_task().items():
        metric = next(iter(summary.metrics[first_step][task])) if first_step is not None else ""
        rows.append((task, str(step), f"{score:.3f}", metric))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    best = summary.best_average()
    if best is not None:
        lines.append(f"best average: step {best[0]} (mean score {best[1]:.3f} over "
                     f"{len(summary.scores[best[0]])} tasks)")
    return "\n".join(lines)


def checkpoint_steps_of(model_dir: str | os.PathLike) -> list[int]:
    """Saved steps under `<model_dir>/checkpoints`, ascending."""
    d = RunDir(model_dir).checkpoints
    if not d.is_dir():
        raise FileNotFoundError(f"{str(d)!r} does not exist: MODEL_DIR={str(model_dir)!r} has no checkpoints")
    return sorted(int(c.name) for c in d.iterdir() if c.name.isdigit() and (c / "state").is_dir())


def select_checkpoint_steps(model_dir, checkpoint_steps) -> list[int]:
    saved = checkpoint_steps_of(model_dir)
    if not saved:
        raise FileNotFoundError(f"no checkpoints in {RunDir(model_dir).checkpoints}")
    if checkpoint_steps in ("all", None):
        return saved
    if checkpoint_steps == "latest":
        return saved[-1:]
    if checkpoint_steps == "best":
        return [_early_stopping_best(model_dir, saved)]
    wanted = [checkpoint_steps] if isinstance(checkpoint_steps, int) else list(checkpoint_steps)
    missing = [s for s in wanted if s not in saved]
    if missing:
        raise ValueError(f"checkpoint_steps={checkpoint_steps!r}: steps {missing} not saved; saved: {saved}")
    return wanted


def _early_stopping_best(model_dir, saved: Sequence[int]) -> int:
    """The step the training loop's early stopping last named best (its `early_stopping`
    row in `<model_dir>/metrics.jsonl`), which `ktx train` keeps among its checkpoints."""
    path = RunDir(model_dir).metrics
    rows = [r for r in read_metrics(path) if r.get("split") == "early_stopping"] \
        if path.is_file() else []
    if not rows:
        raise ValueError(
            f"checkpoint_steps='best': {path} has no early-stopping record (the run was not "
            "trained with early_stopping_metric); accepted instead: 'all', 'latest', a step "
            f"or a list of steps; saved: {list(saved)}")
    best = max(rows, key=lambda r: r["step"])["best_step"]
    if best not in saved:
        raise ValueError(f"checkpoint_steps='best': the best step {best} named in {path} is "
                         f"not among the saved checkpoints {list(saved)}")
    return int(best)


def abstract_params_for(model: BaseModel, trainer: Trainer, batch_size: int, feature_lengths):
    spec = model.input_spec(batch_size, feature_lengths)
    abstract, _ = trainer.create_abstract_state(spec)
    return abstract.params


def evaluate(
    *,
    model: BaseModel,
    model_dir: str | os.PathLike,
    mixture_or_task_name: str,
    task_feature_lengths: Mapping[str, int],
    checkpoint_steps: str | int | Sequence[int] = "all",
    split: str = "validation",
    batch_size: int = 32,
    num_partitions: int = 1,
    num_examples: int | None = None,
    decode_method: str = "greedy",
    num_beams: int = 4,
    alpha: float = 0.6,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int = 0,
    output_dir: str | os.PathLike | None = None,
    evaluators: Sequence[Evaluator] | None = None,
) -> EvalSummary:
    """Decodes and scores every selected checkpoint of `model_dir` offline.

    Args:
      checkpoint_steps: "all", "latest", "best" (the step the run's early stopping
        named best), a step, or a list of steps.
      output_dir: where metrics.jsonl and events go (default `<model_dir>/eval`).
      evaluators: `Evaluator`s to run on each checkpoint instead of SeqIO decoding (an
        encoder model has nothing to decode: e.g. `ktx.runs.tag_eval.TaggingEvaluator`,
        `TeacherForcedEvaluator`, each with its own input; gin `runs/encoder_eval.gin`);
        None: a `DecodeEvaluator` of the mixture's tasks.
    """
    from ktx.data.pipeline import mixture_task_names

    steps = select_checkpoint_steps(model_dir, checkpoint_steps)
    task_names = mixture_task_names(mixture_or_task_name)
    if model.num_tasks != len(task_names):
        raise ValueError(
            f"{mixture_or_task_name!r} has {len(task_names)} tasks but model.num_tasks="
            f"{model.num_tasks}; set NUM_TASKS to {len(task_names)}"
        )
    mesh = partitioning.create_mesh(num_partitions)
    trainer = Trainer(model, optax.identity(), mesh=mesh)
    abstract = abstract_params_for(model, trainer, batch_size, task_feature_lengths)
    if evaluators is None:
        evaluators = [DecodeEvaluator(
            task_names, task_feature_lengths, split=split, batch_size=batch_size,
            num_examples=num_examples, decode_method=decode_method, num_beams=num_beams,
            alpha=alpha, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)]
    elif not evaluators:
        raise ValueError("evaluate(evaluators=[]): give at least one Evaluator, or None "
                         "(SeqIO decoding)")
    writer = MetricsWriter(output_dir or RunDir(model_dir).eval)
    summary = EvalSummary(metrics={}, scores={})
    try:
        for step, params in restore_params_skipping_corrupt(model_dir, steps, abstract):
            results: dict[str, dict[str, float]] = {}
            for evaluator in evaluators:
                for task, values in evaluator(trainer=trainer, params=params, step=step,
                                              writer=writer).items():
                    results.setdefault(task, {}).update(values)
            summary.metrics[step] = results
            summary.scores[step] = {
                t: next(iter(m.values())) for t, m in results.items() if m
            }
            print(f"step {step}: " + ", ".join(
                f"{t} {s:.3f}" for t, s in summary.scores[step].items()), flush=True)
    finally:
        writer.close()
    return summary
