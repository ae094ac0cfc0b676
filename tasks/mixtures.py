"""GLUE / SuperGLUE benchmark mixtures, examples-proportional as in T5 (Raffel et al., 2020).

Each task's rate is its number of training examples capped at `MIXING_RATE_CAP` (the
artificial data set size limit K of T5's examples-proportional mixing, Sec. 3.5.2), read
from the files when the mixture is first sampled, not at import. Other rates (temperature,
equal, annealed) are chosen from gin by the mixing machinery in `ktx.data`; the MNLI
eval-only tasks are not in the mixtures (no train split).
"""

from __future__ import annotations

import functools

import seqio

from ktx.tasks import glue, super_glue

__all__ = ["MIXING_RATE_CAP", "examples_proportional_rate", "BENCHMARK_MIXTURES"]

MIXING_RATE_CAP = 2**19

examples_proportional_rate = functools.partial(
    seqio.mixing_rate_num_examples, maximum=MIXING_RATE_CAP)

BENCHMARK_MIXTURES: dict[str, tuple[str, ...]] = {
    "glue_v002_proportional": glue.GLUE_TASKS,
    "super_glue_v102_proportional": super_glue.SUPER_GLUE_TASKS,
    "glue_super_glue_proportional": glue.GLUE_TASKS + super_glue.SUPER_GLUE_TASKS,
}

for _name, _tasks in BENCHMARK_MIXTURES.items():
    seqio.MixtureRegistry.add(_name, list(_tasks), default_rate=examples_proportional_rate)
