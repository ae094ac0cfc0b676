"""The statistics of a study report: mean and standard deviation over seeds, paired
t-tests on the seeds two arms share (scipy), and the multi-task Δm.

Δm (Maninis et al., 2019; LibMTL's `delta_m`) of an arm against single-task references:

    Δm = 100 / K * sum_k (-1)^{l_k} (M_arm,k - M_ref,k) / M_ref,k

over the K metrics both report, l_k = 1 where lower is better: the average relative gain
in percent (positive: better than training each task alone).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["delta_m", "mean_sd", "paired_test"]


def mean_sd(values: Sequence[float], ddof: int = 1) -> tuple[float, float | None]:
    """(mean, standard deviation with `ddof`); the deviation is None when there are not
    more values than `ddof`."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean_sd: no values")
    mean = sum(values) / len(values)
    if len(values) <= ddof:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - ddof))


def paired_test(a: Mapping[int, float], b: Mapping[int, float]) -> dict:
    """`a` against `b` (seed -> value) on the seeds both have: the seeds, the differences
    a - b, their mean, and `scipy.stats.ttest_rel`'s t and p (None below two seeds, and
    for differences that are all equal: t is undefined there)."""
    seeds = sorted(set(a) & set(b))
    differences = [float(a[s]) - float(b[s]) for s in seeds]
    t = p = None
    if len(seeds) > 1 and max(differences) - min(differences) > 0:
        import scipy.stats

        test = scipy.stats.ttest_rel([a[s] for s in seeds], [b[s] for s in seeds])
        t, p = float(test.statistic), float(test.pvalue)
    return {"seeds": seeds, "differences": differences,
            "mean_difference": sum(differences) / len(seeds) if seeds else None, "t": t, "p": p}


def delta_m(arm: Mapping[str, float], reference: Mapping[str, float],
            directions: Mapping[str, str], metrics: Sequence[str]) -> float | None:
    """Δm in percent of `arm`'s metric means against `reference`'s over `metrics` that both
    have (None: none; a reference of 0 is left out: its relative gain is undefined)."""
    gains = []
    for m in metrics:
        if m in arm and m in reference and reference[m] != 0:
            sign = -1.0 if directions.get(m, "higher") == "lower" else 1.0
            gains.append(sign * (arm[m] - reference[m]) / abs(reference[m]))
    return 100.0 * sum(gains) / len(gains) if gains else None
