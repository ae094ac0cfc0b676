"""`ktx analyze gradients RUN_DIR`: per-group gradient magnitudes over training (PNG).

Reads the `grad_norm/<group>/task<k>` values that the trainer logged from
`ktx.optim.diagnostics` into `metrics.jsonl`, and draws one panel per group with one
line per task, as the MetaBalance paper's Figures 4.2 and 4.3 (He et al., 2022).
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Sequence

__all__ = ["read_gradient_magnitudes", "plot_gradient_magnitudes"]

_KEY = re.compile(r"^grad_norm/(?P<group>.+)/task(?P<task>\d+)$")


def read_gradient_magnitudes(metrics_jsonl_path: str | pathlib.Path) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """`{group: {task: [(step, norm), ...]}}` from a run's `metrics.jsonl`."""
    path = pathlib.Path(metrics_jsonl_path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file {path} does not exist")
    series: dict[str, dict[int, list[tuple[int, float]]]] = {}
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object: {e}") from e
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError(f"{path}:{lineno}: expected a JSON object with 'step'")
            for key, value in row.items():
                m = _KEY.match(key)
                if m:
                    series.setdefault(m["group"], {}).setdefault(int(m["task"]), []).append(
                        (int(row["step"]), float(value))
                    )
    return series


def plot_gradient_magnitudes(
    metrics_jsonl_path: str | pathlib.Path,
    out_png: str | pathlib.Path,
    *,
    groups: Sequence[str] | None = None,
    task_names: Sequence[str] | None = None,
) -> pathlib.Path:
    """Writes the magnitude plot; `groups` picks panels (default: every logged group)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_gradient_magnitudes(metrics_jsonl_path)
    if not series:
        raise ValueError(
            f"{metrics_jsonl_path}: no 'grad_norm/<group>/task<k>' values; log "
            "ktx.optim.diagnostics(...) during training"
        )
    chosen = list(groups) if groups is not None else sorted(series)
    missing = [g for g in chosen if g not in series]
    if missing:
        raise ValueError(f"groups {missing} not logged; logged groups: {sorted(series)}")
    fig, axes = plt.subplots(len(chosen), 1, figsize=(7, 2.6 * len(chosen)), squeeze=False)
    for ax, group in zip(axes[:, 0], chosen):
        for task, points in sorted(series[group].items()):
            points.sort()
            label = task_names[task] if task_names and task < len(task_names) else f"task{task}"
            ax.plot([p[0] for p in points], [p[1] for p in points], label=label)
        ax.set_title(group)
        ax.set_xlabel("step")
        ax.set_ylabel("gradient norm")
        ax.legend()
    fig.tight_layout()
    out = pathlib.Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
