"""A tiny study for the tests: two arms (the quickstart-sized tiny T5 at two learning
rates) x two seeds, 2 steps each on the synthetic quickstart suite, teacher-forced
validation at the last step."""

from __future__ import annotations

import pathlib

from tests import row_cache
from tests.tiny_t5_gin import tiny_t5_gin

RUN_GIN = """
from __gin__ import dynamic_registration
import ktx.runs.eval as eval_lib
import ktx.runs.train as train_script
import ktx.data.pipeline as pipeline
include 'runs/train.gin'
MIXTURE_OR_TASK_NAME = 'synthetic_quickstart'
TASK_FEATURE_LENGTHS = {{'inputs': 32, 'targets': 8}}
NUM_TASKS = 4
BATCH_SIZE = 8
TRAIN_STEPS = {steps}
LOG_PERIOD = 1
CHECKPOINT_PERIOD = {checkpoint_period}
EVAL_PERIOD = %TRAIN_STEPS
train_script.train.evaluators = [@eval_lib.TeacherForcedEvaluator()]
eval_lib.TeacherForcedEvaluator.batch_size = 256
pipeline.MultiTaskInput.cache_dir = '{rows}'
"""

STUDY_GIN = """
from __gin__ import dynamic_registration
import ktx.studies.spec as study

STUDY_DIR = '{directory}'
study.Study:
  name = 'tiny'
  directory = %STUDY_DIR
  seeds = [0, 1]
  gin_files = ['{model}', '{run}']
  arms = [@plain/study.Arm(), @fast/study.Arm()]
  baseline = 'plain'
  metrics = {{'validation/all/accuracy': 'higher', 'validation/all/loss': 'lower'}}
plain/study.Arm.name = 'plain'
fast/study.Arm:
  name = 'fast'
  bindings = {{'optimizers.rsqrt_schedule.base_learning_rate': 3.0}}
"""


def write_tiny_study(folder: pathlib.Path, steps: int = 2, extra: str = "",
                     checkpoint_period: int = 1) -> pathlib.Path:
    """The study file (and its model and run gin files) in `folder`; runs in folder/study."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.gin").write_text(tiny_t5_gin())
    # The runs share their converted rows (the study's runs read the same tasks; rows are
    # cached per seed), as a study on real data would; here the test session's folder.
    (folder / "run.gin").write_text(RUN_GIN.format(steps=steps, checkpoint_period=checkpoint_period,
                                                     rows=row_cache.folder()))
    path = folder / "tiny_study.gin"
    path.write_text(STUDY_GIN.format(directory=folder / "study", model=folder / "model.gin",
                                     run=folder / "run.gin") + extra)
    return path
