"""Metrics a study computes from a run's evaluated ones (`Study.derived_metrics`).

Each is an object called on a run's metrics, `fn(metrics) -> float`, configured in the
study file with a gin scope:

    Study.derived_metrics = {'sts_r01': @sts/derived.Affine(), 'overall': @overall/derived.MeanOf()}
    sts/derived.Affine:
      metric = 'validation_metrics/cs224n_sts_bert_v001/pearson_corrcoef'
      scale = 0.005      # percent -> (r + 1) / 2
      offset = 0.5
    overall/derived.MeanOf.groups = [['sst'], ['quora'], ['sts_r01']]

A metric the run lacks raises KeyError naming it and the metrics there are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

__all__ = ["Affine", "MeanOf"]


def _get(metrics: Mapping[str, float], name: str, fn: str) -> float:
    if name not in metrics:
        raise KeyError(f"{fn}: metric {name!r} is not among the run's metrics "
                       f"({', '.join(sorted(metrics)) or 'none'})")
    return float(metrics[name])


@dataclasses.dataclass(frozen=True)
class Affine:
    """`scale * metrics[metric] + offset` (a percentage as a fraction, r as (r + 1) / 2)."""

    metric: str
    scale: float = 1.0
    offset: float = 0.0

    def __call__(self, metrics: Mapping[str, float]) -> float:
        return self.scale * _get(metrics, self.metric, "Affine") + self.offset


@dataclasses.dataclass(frozen=True)
class MeanOf:
    """The mean over `groups` of each group's mean (GLUE's average: a task's metrics
    averaged, then the tasks); a group may be one metric name."""

    groups: Sequence[Sequence[str] | str]

    def __post_init__(self):
        if not self.groups:
            raise ValueError("MeanOf.groups is empty; accepted: [[metric, ...], ...]")

    def __call__(self, metrics: Mapping[str, float]) -> float:
        means = []
        for group in self.groups:
            names = [group] if isinstance(group, str) else list(group)
            means.append(sum(_get(metrics, n, "MeanOf") for n in names) / len(names))
        return sum(means) / len(means)
