"""The periods a user changes most are macros of every run file (LOG_PERIOD,
CHECKPOINT_PERIOD, EVAL_PERIOD), with the values the files bound before, and a flag
setting one reaches the training loop's parameter."""

import gin
import pytest

import ktx.runs.train
from ktx import cli
from ktx.cli.gin_config import _query_macro, _resolve_reference
from tests.tiny_t5_gin import tiny_t5_gin

RUNS = {  # run file, files before it, (LOG_PERIOD, CHECKPOINT_PERIOD, EVAL_PERIOD)
    "runs/train.gin": ("model", (100, 1000, 0)),
    "runs/quickstart.gin": (None, (50, 400, "TRAIN_STEPS")),
    "runs/encoder_train.gin": ("models/bert_tiny.gin", (100, 1000, "TRAIN_STEPS")),
    "runs/recsys_train.gin": ("experiments/recsys/metabalance.gin", (512, "epoch", "epoch")),
}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_period_macros_keep_the_run_files_values(run, tmp_path):
    before, periods = RUNS[run]
    model = tmp_path / "tiny.gin"
    model.write_text(tiny_t5_gin(), encoding="utf-8")
    files = [str(model)] if before == "model" else [before] if before else []
    cli.parse_gin([*files, run], [("TRAIN_STEPS", "7")] if run != "runs/recsys_train.gin" else [])
    for name, want in zip(("LOG_PERIOD", "CHECKPOINT_PERIOD", "EVAL_PERIOD"), periods):
        got = _query_macro(name)
        if want == "TRAIN_STEPS":  # the last step (%TRAIN_STEPS)
            assert repr(got) == "%TRAIN_STEPS", (run, name, got)
        else:
            assert got == want, (run, name, got)
    bound = gin.get_bindings(ktx.runs.train.train, resolve_references=False)
    for param in ("log_period", "checkpoint_period", "eval_period"):
        assert repr(bound[param]) == f"%{param.upper()}", (run, param)


def test_a_period_flag_reaches_the_loop(tmp_path):
    model = tmp_path / "tiny.gin"
    model.write_text(tiny_t5_gin(), encoding="utf-8")
    cli.parse_gin([str(model), "runs/train.gin"], [("CHECKPOINT_PERIOD", "30"), ("EVAL_PERIOD", "10"),
                                                   ("LOG_PERIOD", "5")])
    bound = gin.get_bindings(ktx.runs.train.train, resolve_references=False)
    assert [_resolve_reference(bound[p]) for p in ("checkpoint_period", "eval_period", "log_period")] \
        == [30, 10, 5]
