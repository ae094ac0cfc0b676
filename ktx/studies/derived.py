"""Metrics a study computes from a run's evaluated ones (`Study.derived_metrics`).

Each is `fn(metrics) -> float`, configured in the study file with a gin scope and passed
without calling it (`@overall/derived.mean_of`):

    Study.derived_metrics = {'sts_r01': @sts/derived.affine, 'overall': @overall/derived.mean_of}
    sts/derived.affine:
      metric = 'validation_metrics/cs224n_sts_bert_v001/pearson_corrcoef'
      scale = 0.005      # percent -> (r + 1) / 2
      offset = 0.5
    overall/derived.mean_of.groups = [['sst'], ['quora'], ['sts_r01']]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["affine", "mean_of"]


def _get(metrics: Mapping[str, float], name: str, fn: str) -> float:
    if name not in metrics:
        raise KeyError(f"{fn}: metric {name!r} is not among the run's metrics "
                       f"({', '.join(sorted(metrics)) or 'none'})")
    return float(metrics[name])


def affine(metrics: Mapping[str, float], *, metric: str, scale: float = 1.0,
           offset: float = 0.0) -> float:
    """`scale * metrics[metric] + offset` (a percentage as a fraction, r as (r + 1) / 2)."""
    return scale * _get(metrics, metric, "affine") + offset


def mean_of(metrics: Mapping[str, float], *, groups: Sequence[Sequence[str] | str]) -> float:
    """The mean over `groups` of each group's mean (GLUE's average: a task's metrics
    averaged, then the tasks); a group may be one metric name."""
    if not groups:
        raise ValueError("mean_of: groups is empty; accepted: [[metric, ...], ...]")
    means = []
    for group in groups:
        names = [group] if isinstance(group, str) else list(group)
        means.append(sum(_get(metrics, n, "mean_of") for n in names) / len(names))
    return sum(means) / len(means)
