"""A newcomer's commands: relative paths from any working directory, ktx's gin files never
shadowed by what a run writes, and run-time errors as one `ktx ...: ...` line."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import subprocess
import sys

import gin
import pytest

from ktx import cli
from tests import row_cache
from tests.tiny_t5_gin import tiny_t5_gin

REPO = pathlib.Path(__file__).resolve().parent.parent
LENGTHS = "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}"


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config(clear_constants=True)
    yield
    gin.clear_config(clear_constants=True)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory holding the user's model gin file and a `runs/` folder with a
    decoy `runs/train.gin` that must not shadow ktx's."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "train.gin").write_text("this is not gin\n")
    (tmp_path / "model.gin").write_text(tiny_t5_gin())
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _common(model_dir_flag: str) -> list[str]:
    return ["--gin_file=model.gin", "--gin.NUM_TASKS=4", model_dir_flag,
            "--gin.MIXTURE_OR_TASK_NAME='synthetic_quickstart'", LENGTHS]


def test_train_eval_infer_with_relative_paths(workdir, capsys):
    assert cli.main(["train", "--gin_file=runs/train.gin", *_common("--gin.MODEL_DIR='runs/rel'"),
                     "--gin.TRAIN_STEPS=2", "--gin.BATCH_SIZE=8",
                     "--gin.train_script.train.checkpoint_period=2", row_cache.flag()]) == 0
    run = workdir / "runs" / "rel"
    assert (run / "checkpoints" / "2" / "state").is_dir()
    # The operative config records the absolute run directory.
    config = re.sub(r"\\\n\s*", "", (run / "config.gin").read_text())  # gin wraps long lines
    assert f"MODEL_DIR = '{run}'" in config

    gin.clear_config(clear_constants=True)
    assert cli.main(["eval", "--gin_file=runs/eval.gin", *_common("--gin.MODEL_DIR='runs/rel'"),
                     "--gin.EVAL_BATCH_SIZE=8", "--gin.eval_script.evaluate.num_examples=4"]) == 0
    assert "best average: step 2" in capsys.readouterr().out

    gin.clear_config(clear_constants=True)
    assert cli.main(["infer", "--gin_file=runs/infer.gin", *_common("--gin.CHECKPOINT_PATH='runs/rel'"),
                     "--gin.INFER_BATCH_SIZE=8", "--gin.INFER_OUTPUT_FILE='preds/out.jsonl'",
                     "--gin.infer_script.infer.num_examples=2"]) == 0
    lines = (workdir / "preds" / "out.jsonl").read_text().splitlines()
    assert len(lines) == 8 and "prediction" in json.loads(lines[0])


def test_absolute_path_keeps_urls_and_source_prefixes(workdir):
    assert cli.absolute_path("a/b") == str(workdir / "a" / "b")
    assert cli.absolute_path("gs://bucket/run") == "gs://bucket/run"
    assert cli.absolute_path("hf:ckpt") == f"hf:{workdir / 'ckpt'}"
    assert cli.absolute_path("~/x") == os.path.expanduser("~/x")


def test_python_m_ktx_from_a_folder_with_runs(workdir):
    """`python -m ktx` puts the working directory on sys.path, where a `runs/` output
    folder is a namespace package: ktx's `include 'runs/train.gin'` still resolves."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "ktx", "train", "--gin_file=runs/train.gin",
         *_common("--gin.MODEL_DIR='runs/m'"), "--gin.TRAIN_STEPS=1", "--gin.BATCH_SIZE=8",
         row_cache.flag()],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (workdir / "runs" / "m" / "checkpoints" / "1").is_dir()


# -- errors ------------------------------------------------------------------------------


def _train(capsys, *flags) -> tuple[int, str]:
    code = cli.main(["train", "--gin_file=runs/train.gin", *_common("--gin.MODEL_DIR='runs/e'"),
                     *flags])
    return code, capsys.readouterr().err


def test_misspelt_configurable_in_a_flag(workdir, capsys):
    code, err = _train(capsys, "--gin.TRAIN_STEPS=1", "--gin.train_script.trian.log_period=3")
    assert code == 2
    assert "--gin.train_script.trian.log_period=3" in err and "train_script.train" in err


def test_bad_value_names_its_flag(workdir, capsys):
    code, err = _train(capsys, "--gin.TRAIN_STEPS=1", "--gin.BATCH_SIZE=eight")
    assert code == 2
    assert "--gin.BATCH_SIZE=eight" in err and "accepted: an integer (--gin.BATCH_SIZE=" in err
    code, err = _train(capsys, "--gin.TRAIN_STEPS=1", "--gin.MODEL_DIR=out")
    assert code == 2 and "quotes: --gin.MODEL_DIR=\"'out'\"" in err  # a string: quote it


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_train_steps_below_one(workdir, capsys, steps):
    code, err = _train(capsys, f"--gin.TRAIN_STEPS={steps}")
    assert code == 2
    assert f"TRAIN_STEPS={steps}" in err and ">= 1" in err


def test_unknown_task_is_one_line_with_close_names(workdir, capsys):
    code = cli.main(["train", "--gin_file=runs/train.gin", "--gin_file=model.gin",
                     "--gin.MODEL_DIR='runs/e'", "--gin.MIXTURE_OR_TASK_NAME='synthetic_quikstart'",
                     LENGTHS, "--gin.TRAIN_STEPS=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "synthetic_quickstart" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_missing_data_folder_is_one_line(workdir, capsys, monkeypatch):
    monkeypatch.setenv("KTX_DATA_DIR", str(workdir / "no_such_data"))
    code = cli.main(["train", "--gin_file=runs/train.gin", "--gin_file=model.gin", "--gin.NUM_TASKS=1",
                     "--gin.MODEL_DIR='runs/e'", "--gin.MIXTURE_OR_TASK_NAME='glue_rte_v002'",
                     "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 4}",
                     "--gin.TRAIN_STEPS=1"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("ktx train: ") and "no_such_data" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "Traceback" in (workdir / "runs" / "e" / "ktx_error.log").read_text()


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    ValueError('RESOURCE_EXHAUSTED: Error writing "opt_state.0/0" in OCDBT database: Failed to '
               "write 68440064 bytes to file 18: No space left on device [os_error_code='28']")])
def test_full_disk_names_the_fix(workdir, capsys, error):
    cli._report_failure(error, "train")
    err = capsys.readouterr().err
    assert err.startswith("ktx train: ") and len(err.strip().splitlines()) == 1
    assert "keep_checkpoints" in err and "resumes from the latest complete checkpoint" in err


def test_debug_flag_raises(workdir, monkeypatch):
    monkeypatch.setenv("KTX_DATA_DIR", str(workdir / "no_such_data"))
    with pytest.raises(Exception, match="no_such_data"):
        cli.main(["train", "--debug", "--gin_file=runs/train.gin", "--gin_file=model.gin",
                  "--gin.NUM_TASKS=1", "--gin.MODEL_DIR='runs/e'",
                  "--gin.MIXTURE_OR_TASK_NAME='glue_rte_v002'",
                  "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 4}", "--gin.TRAIN_STEPS=1"])


def test_learning_rate_as_a_number(workdir, capsys):
    """optax accepts a float learning rate; so does every ktx optimizer and the trainer."""
    code, err = _train(capsys, "--gin.TRAIN_STEPS=2", "--gin.BATCH_SIZE=8", "--gin.LEARNING_RATE=1e-3")
    assert code == 0, err
    from ktx.training.summaries import read_metrics

    lrs = {r["learning_rate"] for r in read_metrics(workdir / "runs" / "e")
           if r["split"] == "train" and "learning_rate" in r}
    assert len(lrs) == 1 and lrs.pop() == pytest.approx(1e-3)


# -- a corrupted checkpoint ----------------------------------------------------------------


def _corrupt(step_dir: pathlib.Path) -> None:
    """Truncates every data file of a saved step, as a full disk or a killed copy would."""
    files = [f for f in (step_dir / "state").rglob("*") if f.is_file() and "d" in f.parent.name]
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[:7])


def test_corrupt_checkpoint_resume_and_eval_use_the_last_good_step(workdir, capsys):
    flags = ["--gin_file=runs/train.gin", *_common("--gin.MODEL_DIR='runs/c'"), "--gin.BATCH_SIZE=8",
             "--gin.train_script.train.checkpoint_period=2", row_cache.flag()]
    assert cli.main(["train", *flags, "--gin.TRAIN_STEPS=4"]) == 0
    ckpts = workdir / "runs" / "c" / "checkpoints"
    _corrupt(ckpts / "4")
    capsys.readouterr()

    gin.clear_config(clear_constants=True)
    assert cli.main(["eval", "--gin_file=runs/eval.gin", *_common("--gin.MODEL_DIR='runs/c'"),
                     "--gin.EVAL_BATCH_SIZE=8", "--gin.eval_script.evaluate.num_examples=4"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint step 4 ({ckpts / '4'}) is unreadable" in out and "skipped" in out
    assert "best average: step 2" in out
    assert len(out) < 4000  # a line per problem, not pages of storage-layer output

    gin.clear_config(clear_constants=True)
    assert cli.main(["train", *flags, "--gin.TRAIN_STEPS=4"]) == 0
    out = capsys.readouterr().out
    assert "step 4 (" in out and "is unreadable" in out and "resuming from step 2" in out
    assert (ckpts / "4.corrupt").is_dir() and (ckpts / "4" / "state").is_dir()
