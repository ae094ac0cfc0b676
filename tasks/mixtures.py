"""GLUE / SuperGLUE benchmark mixtures, examples-proportional as in T5 (Raffel et al., 2020).

Each task's rate is its number of training examples capped at `MIXING_RATE_CAP` (the
artificial data set size limit K of T5's examples-proportional mixing, Sec. 3.5.2), read
from the files when the mixture is first sampled, not at import. Other rates (temperature,
equal, annealed) are chosen from gin by the mixing machinery in `ktx.data`; the MNLI
eval-only tasks are not in the mixtures (no train split).

`glue_super_glue_small_v1` is the seven small tasks whose full train and validation files
are in the shared data folder (SST-2, CoLA, MRPC, STS-B, RTE, CB, COPA), used by the
conditioning quality benchmark; every mixture has a `..._noprefix...` twin over the
tasks without T5's task prefixes (see `ktx.tasks.glue`).
"""

from __future__ import annotations

import functools

import seqio

from ktx.tasks import glue, super_glue

__all__ = [
    "MIXING_RATE_CAP",
    "examples_proportional_rate",
    "BENCHMARK_MIXTURES",
    "SMALL_TASKS",
]

MIXING_RATE_CAP = 2**19

examples_proportional_rate = functools.partial(
    seqio.mixing_rate_num_examples, maximum=MIXING_RATE_CAP)

SMALL_TASKS: tuple[str, ...] = (
    "glue_sst2_v002", "glue_cola_v002", "glue_mrpc_v002", "glue_stsb_v002",
    "glue_rte_v002", "super_glue_cb_v102", "super_glue_copa_v102",
)

BENCHMARK_MIXTURES: dict[str, tuple[str, ...]] = {
    "glue_v002_proportional": glue.GLUE_TASKS,
    "super_glue_v102_proportional": super_glue.SUPER_GLUE_TASKS,
    "glue_super_glue_proportional": glue.GLUE_TASKS + super_glue.SUPER_GLUE_TASKS,
    "glue_super_glue_small_v1": SMALL_TASKS,
    "glue_v002_noprefix_proportional": glue.GLUE_NOPREFIX_TASKS,
    "super_glue_v102_noprefix_proportional": super_glue.SUPER_GLUE_NOPREFIX_TASKS,
    "glue_super_glue_noprefix_proportional": (
        glue.GLUE_NOPREFIX_TASKS + super_glue.SUPER_GLUE_NOPREFIX_TASKS),
    "glue_super_glue_small_noprefix_v1": tuple(glue.noprefix_name(t) for t in SMALL_TASKS),
}

for _name, _tasks in BENCHMARK_MIXTURES.items():
    seqio.MixtureRegistry.add(_name, list(_tasks), default_rate=examples_proportional_rate)
