"""A study run's record: one small JSON file per finished (arm, seed, budget).

    {"format": "ktx-study-record/1", "study": "toy", "run": "pals-seed0", "arm": "pals",
     "seed": 0, "budget": "default", "budget_bindings": {...}, "definition": {...},
     "definition_digest": "...", "gin_files": [...], "bindings": {... as resolved ...},
     "wall_seconds": 81.2, "pieces": 1, "device": "cpu x 8",
     "evaluations": [{"step": 4, "metrics": {"validation/all/accuracy": 0.03, ...}}, ...],
     "selection": {"rule": "last", "step": 4},
     "metrics": {"validation/all/accuracy": 0.03, ...}}

`metrics` are the chosen evaluation's scores plus the study's derived metrics; `selection`
says how it was chosen (`last`, or `best` by a metric and direction). Records written by
the scripts before `ktx study` (docs/results/) are read as they are (`ktx.studies.legacy`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tempfile
from collections.abc import Mapping
from typing import Any

from ktx.studies import legacy

__all__ = ["FORMAT", "Record", "load_records", "write_json_atomic"]

FORMAT = "ktx-study-record/1"


@dataclasses.dataclass
class Record:
    """A finished run as the report reads it (new and legacy records alike)."""

    arm: str
    seed: int
    budget_bindings: dict[str, Any]
    metrics: dict[str, float]
    wall_seconds: float | None
    path: pathlib.Path | None = None
    budget: str | None = None
    study: str | None = None
    definition: dict | None = None
    data: dict = dataclasses.field(default_factory=dict)

    @property
    def legacy(self) -> bool:
        return self.data.get("format") != FORMAT


def write_json_atomic(path: pathlib.Path, value: Any) -> None:
    """`value` as JSON at `path`, written to a temporary file and renamed (a reader, or
    a worker killed half-way, never sees half a record)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(value, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def from_json(path: pathlib.Path, data: Mapping[str, Any]) -> Record:
    """A record file's contents as a `Record`; a ValueError names the file when it is
    neither a study record nor a known legacy record."""
    if data.get("format") == FORMAT:
        return Record(arm=data["arm"], seed=int(data["seed"]),
                      budget_bindings=dict(data["budget_bindings"]), metrics=dict(data["metrics"]),
                      wall_seconds=data.get("wall_seconds"), path=path, budget=data.get("budget"),
                      study=data.get("study"), definition=data.get("definition"), data=dict(data))
    adapted = legacy.adapt(data)
    if adapted is None:
        raise ValueError(f"{path}: neither a ktx study record (format {FORMAT!r}) nor a record "
                         "of the scripts before it (cs224n, GLUE, recsys)")
    return Record(path=path, data=dict(data), **adapted)


def load_records(directory: str | os.PathLike) -> list[Record]:
    """Every record (`*.json`) directly in `directory`, sorted by file name."""
    directory = pathlib.Path(directory)
    out = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        out.append(from_json(path, data))
    return out
