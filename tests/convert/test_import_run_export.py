"""The whole path on the tiny Hugging Face T5.1.1 fixture, through the CLI with relative
paths: `ktx import` -> a HyperPrompt-Global run with the backbone frozen, initialised from
the import (INITIAL_CHECKPOINT_PATH) -> the backbone after training is bit-identical to
the imported parameters, the hyper-prompt parameters were freshly initialised and
trained; the same run started from `hf:DIR` directly is identical; `ktx export` of the
import reproduces the fixture, and of the HyperPrompt run names the parameters with no
Hugging Face counterpart."""

from __future__ import annotations

import gin
import numpy as np
import pytest

from ktx import cli, convert
from ktx.training.summaries import read_metrics
from tests import row_cache
from tests.convert.conftest import checkpoint_fixture


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config(clear_constants=True)
    yield
    gin.clear_config(clear_constants=True)


def _task_names():
    import ktx.tasks  # noqa: F401
    from ktx.data.pipeline import mixture_task_names

    return mixture_task_names("synthetic_quickstart")


def _train(run: str, initial: str, model_gin: str) -> list[str]:
    return [
        "train", "--gin_file=runs/train.gin", f"--gin_file={model_gin}",
        "--gin_file=conditioning/hyperprompt_global.gin",
        f"--gin.NUM_TASKS={len(_task_names())}", f"--gin.MODEL_DIR='{run}'",
        f"--gin.INITIAL_CHECKPOINT_PATH='{initial}'", "--gin.TRAIN_BACKBONE=False",
        "--gin.ENCODER_PROMPT_LENGTH=4", "--gin.DECODER_PROMPT_LENGTH=2",
        "--gin.TASK_EMBED_DIM=8", "--gin.TASK_HIDDEN_DIM=16", "--gin.PROJECTED_DIM=8",
        "--gin.MIXTURE_OR_TASK_NAME='synthetic_quickstart'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
        "--gin.TRAIN_STEPS=3", "--gin.BATCH_SIZE=8",
        "--gin.train_script.train.log_period=1", "--gin.train_script.train.checkpoint_period=3",
        "--gin.train_script.train.norm_metrics=True",
        "--gin.optimizers.rsqrt_schedule.warmup_steps=100",
        row_cache.flag(),
    ]


def _params(run) -> dict[str, np.ndarray]:
    return convert.read_ktx_checkpoint(run)[0]


def test_import_hyperprompt_run_export(tmp_path, monkeypatch, capsys):
    fixture = checkpoint_fixture("hf_t5_v1_1_tiny")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf_t5").symlink_to(fixture)
    assert cli.main(["import", "hf:hf_t5", "imported"]) == 0
    assert "wrote" in capsys.readouterr().out
    imported = convert.flatten(convert.read_hf_t5(fixture).params)

    assert cli.main(_train("run", "imported", "imported/model.gin")) == 0
    out = capsys.readouterr().out
    assert f"restored {len(imported)} parameters" in out
    trained = _params(tmp_path / "run")
    conditioning = sorted(p for p in trained if p.startswith("conditioning/"))
    assert conditioning and f"initialized {len(conditioning)}, unused 0" in out
    assert sorted(set(trained) - set(conditioning)) == sorted(imported)
    for path, value in imported.items():
        np.testing.assert_array_equal(trained[path], value, err_msg=path)

    # The updates all went into the (freshly initialised) conditioning parameters.
    norms = [r["update_norm"] for r in read_metrics(tmp_path / "run")
             if r["split"] == "train" and r["task"] == "all"]
    assert len(norms) == 3 and all(n > 0 for n in norms)

    # INITIAL_CHECKPOINT_PATH='hf:...' converts on the fly: the same run, bit for bit.
    gin.clear_config(clear_constants=True)
    assert cli.main(_train("run_hf", "hf:hf_t5", "imported/model.gin")) == 0
    direct = _params(tmp_path / "run_hf")
    assert sorted(direct) == sorted(trained)
    for path in trained:
        np.testing.assert_array_equal(direct[path], trained[path], err_msg=path)

    # Export: the import gives the fixture's tensors back; the HyperPrompt run has
    # parameters with no Hugging Face counterpart, and says which.
    gin.clear_config(clear_constants=True)
    assert cli.main(["export", "imported", "hf:exported"]) == 0
    for path, value in convert.flatten(convert.read_hf_t5(tmp_path / "exported").params).items():
        np.testing.assert_array_equal(value, imported[path], err_msg=path)
    gin.clear_config(clear_constants=True)
    capsys.readouterr()
    assert cli.main(["export", "run", "hf:run_hf_export", "--checkpoint", "3"]) == 2
    err = capsys.readouterr().err
    assert "no Hugging Face T5 counterpart: conditioning/" in err
    assert not (tmp_path / "run_hf_export").exists()
