"""Run outputs: `metrics.jsonl`, TensorBoard scalars and the console progress line.

`MetricsWriter.write(step, split, task, metrics)` appends one JSON object
`{"step": s, "split": "train", "task": "<name>|all", "<metric>": value, ...}` to
`<dir>/metrics.jsonl` and writes the same values as TensorBoard scalars named
`<split>/<metric>` (task "all") or `<split>/<metric>/<task>`. Only process 0 writes.

`per_task_metrics` turns the trainer's `[T]` sums into per-task means: metric `m` of
task `t` is `aux[m][t] / aux["weight"][t]` (the `[T]` sums of `ktx.models.base.BaseModel.loss_sums`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pathlib
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import jax
import numpy as np

from ktx.runs.run_dir import RunDir

__all__ = [
    "MetricsWriter",
    "ProgressLogger",
    "not_training",
    "per_task_metrics",
    "quiet_absl",
    "read_metrics",
]

# Seconds this process spent in `not_training` blocks (evaluations): the progress line's
# step rate, and so its ETA, leaves them out.
_not_training = {"seconds": 0.0}


@contextlib.contextmanager
def not_training():
    """Time inside the block (an in-run evaluation) does not count in any
    `ProgressLogger`'s steps/s, examples/s or ETA: they are training rates."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _not_training["seconds"] += time.perf_counter() - start



class _DropPrefixes(logging.Filter):
    def __init__(self, prefixes: Sequence[str]):
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


@contextlib.contextmanager
def quiet_absl(*prefixes: str):
    """Inside the block, absl log records (orbax, SeqIO) starting with one of `prefixes`
    are not printed: library notices that say nothing to a ktx user."""
    dropped = _DropPrefixes(prefixes)
    logger = logging.getLogger("absl")
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


def _scalar(value: Any) -> float | int | str:
    if isinstance(value, str):
        return value
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"metric value of shape {arr.shape} is not a scalar")
    item = arr.reshape(()).item()
    return item if isinstance(item, (int, bool)) else float(item)


def per_task_metrics(
    sums: Mapping[str, Any], task_names: Sequence[str], *, weight_key: str = "weight"
) -> dict[str, dict[str, float]]:
    """`{task: {metric: sums[metric][t] / sums[weight_key][t]}}` for tasks with weight > 0,
    plus `"all"` (summed over tasks). `examples` (if present) is reported as a count."""
    if weight_key not in sums:
        raise ValueError(f"aux sums have no {weight_key!r} entry; keys: {sorted(sums)}")
    host = {k: np.asarray(jax.device_get(v), np.float64) for k, v in sums.items()}
    weight = host[weight_key]
    if weight.shape != (len(task_names),):
        raise ValueError(
            f"aux[{weight_key!r}] has shape {weight.shape}; expected ({len(task_names)},) for "
            f"tasks {list(task_names)}"
        )
    out: dict[str, dict[str, float]] = {}
    for t, name in enumerate(list(task_names) + ["all"]):
        w = weight.sum() if name == "all" else weight[t]
        if w <= 0:
            continue
        row = {}
        for k, v in host.items():
            if k == weight_key or v.ndim != 1:
                continue
            total = v.sum() if name == "all" else v[t]
            row[k] = float(total) if k == "examples" else float(total / w)
        row[weight_key] = float(w)
        out[name] = row
    return out


class MetricsWriter:
    """Appends to `<directory>/metrics.jsonl` and TensorBoard events in `directory`.

    Only process 0 writes (every process computes the same global metrics).

    Args:
      directory: where `metrics.jsonl` and the event files go.
      tensorboard: also write TensorBoard scalars (clu's SummaryWriter).
      resume_step: the step a run (re)starts from: records of later steps, written by a
        run that died before its next checkpoint, describe steps that will be computed
        again; they are removed (the count is printed) so that no step has two records.
    """

    def __init__(self, directory: str | os.PathLike, *, tensorboard: bool = True,
                 resume_step: int | None = None):
        self.directory = pathlib.Path(directory)
        self.is_chief = jax.process_index() == 0
        self._tb = None
        self._file: TextIO | None = None
        if self.is_chief:
            self.directory.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                _drop_records_after(RunDir(self.directory).metrics, resume_step)
            self._file = open(RunDir(self.directory).metrics, "a", encoding="utf-8")
            if tensorboard:
                from clu import metric_writers

                self._tb = metric_writers.SummaryWriter(str(self.directory))

    def write(self, step: int, split: str, task: str, metrics: Mapping[str, Any]) -> None:
        """One JSON line for `(step, split, task)` and the matching TensorBoard scalars."""
        if not self.is_chief:
            return
        values = {k: _scalar(v) for k, v in metrics.items()}
        record = {"step": int(step), "split": split, "task": task, **values}
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            scalars = {}
            for k, v in values.items():
                if isinstance(v, str):
                    continue
                name = f"{split}/{k}" if task == "all" else f"{split}/{k}/{task}"
                scalars[name] = v
            self._tb.write_scalars(int(step), scalars)

    def write_tasks(self, step: int, split: str, by_task: Mapping[str, Mapping[str, Any]]) -> None:
        for task, metrics in by_task.items():
            self.write(step, split, task, metrics)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._file is not None:
            self._file.close()
            self._file = None


def _drop_records_after(path: pathlib.Path, step: int) -> None:
    """Rewrites `metrics.jsonl` without the records of steps after `step` (atomically)."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines) and not line.endswith("\n"):
                continue  # cut short by the crash that ended the previous run
            raise ValueError(f"{path}:{lineno}: not a JSON record ({e})") from e
        if record.get("step", 0) <= step:
            kept.append(line)
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    print(f"{path}: removed {len(lines) - len(kept)} records of steps after {step} "
          "(written after the last checkpoint, computed again now)", flush=True)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a `metrics.jsonl` file (raises ValueError naming a bad line)."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = RunDir(path).metrics
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object: {e}") from e
    return records


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressLogger:
    """Console line: `step 120/500 | loss 1.234 | 8.1 steps/s 259 ex/s | elapsed 0:15 | eta 0:47`."""

    def __init__(self, total_steps: int, *, start_step: int = 0, stream: TextIO | None = None):
        self.total_steps = total_steps
        self.stream = stream if stream is not None else sys.stdout
        self._last_step = start_step
        self._start = self._last_time = time.perf_counter()
        self._last_excluded = _not_training["seconds"]

    def rates(self, step: int, examples_per_step: int) -> tuple[float, float]:
        """`(steps/s, examples/s)` of training since the previous call (time in
        `not_training` blocks left out); resets the window."""
        now = time.perf_counter()
        excluded = _not_training["seconds"] - self._last_excluded
        dt = max(now - self._last_time - excluded, 1e-9)
        steps = step - self._last_step
        self._last_step, self._last_time = step, now
        self._last_excluded = _not_training["seconds"]
        return steps / dt, steps * examples_per_step / dt

    def line(self, step: int, loss: float, steps_per_s: float, examples_per_s: float) -> str:
        remaining = (self.total_steps - step) / steps_per_s if steps_per_s > 0 else float("inf")
        return (
            f"step {step}/{self.total_steps} | loss {loss:.4f} | {steps_per_s:.2f} steps/s "
            f"{examples_per_s:.0f} ex/s | elapsed {_duration(time.perf_counter() - self._start)}"
            f" | eta {_duration(remaining)}"
        )

    def log(self, step: int, loss: float, steps_per_s: float, examples_per_s: float,
            extra: str = "") -> None:
        """Prints the line, then ` | extra` (the throughput: tokens/s, TFLOP/s, MFU)."""
        if jax.process_index() == 0:
            line = self.line(step, loss, steps_per_s, examples_per_s)
            print(line + (f" | {extra}" if extra else ""), file=self.stream, flush=True)
