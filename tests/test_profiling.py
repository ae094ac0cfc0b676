"""PROFILE_STEPS (`ktx.runs.profiling`): a jax.profiler trace of the chosen steps under
the run directory, TensorBoard- and Perfetto-readable, with the losses of an unprofiled
run; a window outside the run is one `ktx train: ...` line naming the binding."""

from __future__ import annotations

import gzip
import json

import optax
import pytest

from ktx import cli
from ktx.runs.profiling import check_profile_steps
from ktx.runs.train import train
from ktx.training import optimizers
from tests import row_cache
from tests.multiprocess_runs import train_losses
from tests.test_trainer import ToyInput, ToyModel
from tests.tiny_t5_gin import tiny_t5_gin


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_trace_of_the_steps_and_unchanged_losses(tmp_path, capsys, steps_per_call):
    kwargs = dict(model=ToyModel(), train_input=ToyInput(), optimizer=optax.adam(1e-2),
                  schedule=optimizers.constant_schedule(1e-2), train_steps=6, log_period=1,
                  checkpoint_period=100, steps_per_call=steps_per_call)
    train(model_dir=tmp_path / "plain", **kwargs)
    train(model_dir=tmp_path / "profiled", profile_steps=(2, 4), **kwargs)
    assert "Profile of steps 2..3: " in capsys.readouterr().out
    (xplane,) = (tmp_path / "profiled" / "profile").glob("plugins/profile/*/*.xplane.pb")
    assert xplane.stat().st_size > 0  # TensorBoard's profile plugin reads this
    (perfetto,) = xplane.parent.glob("perfetto_trace.json.gz")
    with gzip.open(perfetto) as f:
        assert json.load(f)["traceEvents"]  # Perfetto's (Chrome) trace format
    assert not (tmp_path / "plain" / "profile").exists()
    assert len(train_losses(tmp_path / "plain")) == 6
    assert train_losses(tmp_path / "profiled") == train_losses(tmp_path / "plain")


@pytest.mark.parametrize("steps", [(5, 12), (3, 3), (-1, 2), (1,), "1,2", (1.0, 2)])
def test_windows_outside_the_run_are_refused(steps):
    with pytest.raises(ValueError, match=r"profile_steps=.* is not a window of this run's "
                                         r"steps 0..10; accepted: None, or \(start, stop\)"):
        check_profile_steps(steps, 10)
    assert check_profile_steps((0, 10), 10) == (0, 10)
    assert check_profile_steps(None, 10) is None


def test_cli_names_the_binding(tmp_path, capsys):
    model = tmp_path / "model.gin"
    model.write_text(tiny_t5_gin())
    code = cli.main(["train", "--gin_file=runs/train.gin", f"--gin_file={model}",
                     "--gin.NUM_TASKS=4", f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
                     "--gin.MIXTURE_OR_TASK_NAME='synthetic_quickstart'",
                     "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
                     "--gin.TRAIN_STEPS=5", "--gin.PROFILE_STEPS=(10, 20)", row_cache.flag()])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert len(err.splitlines()) == 1, err
    # The CLI names the macro the user set (ktx.cli.gin_config.macro_names).
    assert err.startswith("ktx train: PROFILE_STEPS=(10, 20) is not a window of this run's "
                          "steps 0..5; accepted: None, or (start, stop) with "
                          "0 <= start < stop <= TRAIN_STEPS=5"), err
