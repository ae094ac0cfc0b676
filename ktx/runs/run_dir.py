"""`RunDir`: the layout of a run directory (T5X's MODEL_DIR), known here and nowhere else.

    <root>/
      config.gin            the operative gin config of `ktx train` (written once the state exists)
      metrics.jsonl         train metrics, one JSON record per (step, split, task)
      events.out.tfevents.* the same values as TensorBoard scalars
      checkpoints/<step>/   orbax steps (`ktx.training.checkpoints`); `<step>.corrupt[.<n>]`: set aside
      eval/                 `ktx eval`: its own config.gin, metrics.jsonl and events
      ktx_error.log         the traceback of the last command that failed on this run

Every reader and writer of these files goes through a `RunDir`:

    run = RunDir("runs/quickstart")
    run.metrics          # PosixPath('.../runs/quickstart/metrics.jsonl')
    run.eval.metrics     # PosixPath('.../runs/quickstart/eval/metrics.jsonl')
    RunDir.containing("runs/quickstart/checkpoints/200")  # the run of a step directory
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

__all__ = ["RunDir"]


@dataclasses.dataclass(frozen=True)
class RunDir:
    """A run directory; `root` is made absolute (`~` expanded) when built."""

    root: pathlib.Path

    CONFIG = "config.gin"
    METRICS = "metrics.jsonl"
    CHECKPOINTS = "checkpoints"
    EVAL = "eval"
    ERROR_LOG = "ktx_error.log"

    def __post_init__(self):
        object.__setattr__(self, "root", pathlib.Path(os.fspath(self.root)).expanduser().absolute())

    def __fspath__(self) -> str:
        return str(self.root)

    @property
    def config(self) -> pathlib.Path:
        """`config.gin`: the operative gin config of the command that wrote this directory."""
        return self.root / self.CONFIG

    @property
    def metrics(self) -> pathlib.Path:
        """`metrics.jsonl` (`ktx.training.summaries.MetricsWriter` appends, `read_metrics` reads)."""
        return self.root / self.METRICS

    @property
    def checkpoints(self) -> pathlib.Path:
        """`checkpoints/`: one orbax step directory per saved step."""
        return self.root / self.CHECKPOINTS

    def step(self, step: int) -> pathlib.Path:
        """`checkpoints/<step>/`."""
        return self.checkpoints / str(int(step))

    @property
    def eval(self) -> RunDir:
        """`eval/`: where `ktx eval` writes its metrics, events and config (a `RunDir`)."""
        return RunDir(self.root / self.EVAL)

    @property
    def error_log(self) -> pathlib.Path:
        """`ktx_error.log`: the full traceback behind a one-line `ktx …:` error."""
        return self.root / self.ERROR_LOG

    def makedirs(self) -> RunDir:
        self.root.mkdir(parents=True, exist_ok=True)
        return self

    @classmethod
    def containing(cls, path: str | os.PathLike, levels: int = 2) -> RunDir | None:
        """The run directory of `path` (itself, or up to `levels` parents: a
        `checkpoints/` or step directory) recognised by its `config.gin`; None if none."""
        p = pathlib.Path(os.fspath(path)).expanduser().absolute()
        for d in (p, *p.parents[:levels]):
            if (d / cls.CONFIG).is_file():
                return cls(d)
        return None
