"""`ktx analyze attention` end to end: a 2-step HyperPrompt-Global checkpoint made by
`ktx train` on a synthetic task, analysed through the CLI (step or path), JSON + PNG,
and the errors for a wrong task / step / missing flag."""

from __future__ import annotations

import json
import math

import gin
import pytest

from ktx import cli
from tests.tiny_t5_gin import tiny_t5_gin

TINY_MODEL_GIN = tiny_t5_gin(num_encoder_layers=2)

TASK = "synthetic_majority_v001"  # the smallest synthetic task: a one-task "mixture"


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config(clear_constants=True)
    yield
    gin.clear_config(clear_constants=True)


def _flags(model_gin, run, conditioning=True):
    flags = ["--gin_file=runs/train.gin", f"--gin_file={model_gin}"]
    if conditioning:
        flags += [
            "--gin_file=conditioning/hyperprompt_global.gin",
            "--gin.ENCODER_PROMPT_LENGTH=3", "--gin.DECODER_PROMPT_LENGTH=2",
            "--gin.REDUCTION_FACTOR=4", "--gin.TASK_EMBED_DIM=4", "--gin.TASK_HIDDEN_DIM=8",
            "--gin.PROJECTED_DIM=4",
        ]
    return flags + [
        f"--gin.MODEL_DIR='{run}'", f"--gin.MIXTURE_OR_TASK_NAME='{TASK}'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", "--gin.TRAIN_STEPS=2",
        "--gin.BATCH_SIZE=8", "--gin.train_script.train.log_period=2",
    ]


def _analyze(flags, *extra):
    gin.clear_config(clear_constants=True)
    return cli.main(["analyze", "attention", *flags, *extra])


def test_analyze_attention_cli(tmp_path, capsys):
    model_gin = tmp_path / "model.gin"
    model_gin.write_text(TINY_MODEL_GIN)
    run = tmp_path / "run"
    flags = _flags(model_gin, run)
    assert cli.main(["train", *flags]) == 0
    capsys.readouterr()

    # --checkpoint as a step of MODEL_DIR.
    out_a = tmp_path / "a"
    assert _analyze(flags, "--checkpoint=2", f"--task={TASK}", f"--out_dir={out_a}",
                    "--max_examples=5") == 0
    printed = capsys.readouterr().out
    assert "encoder layer 0: prompt mass" in printed and "decoder layer 0" in printed
    report = json.loads((out_a / f"attention_{TASK}.json").read_text())
    assert (out_a / f"attention_{TASK}.png").stat().st_size > 0
    assert report["task"] == TASK and report["num_examples"] == 5
    assert report["prompt_lengths"] == {"encoder": 3, "decoder": 2}
    assert [x["layer"] for x in report["encoder"]] == [0, 1]
    assert [x["layer"] for x in report["decoder"]] == [0]
    for side, max_queries in (("encoder", 32), ("decoder", 8)):
        for layer in report[side]:
            # Mass is summed over the valid queries: positive, at most one per query.
            assert 0.0 < layer["prompt_mass"] <= max_queries
            # Entropy over at most max_queries token keys.
            assert 0.0 <= layer["token_entropy"] <= math.log(max_queries) + 1e-6

    # --checkpoint as a path to the step directory gives the same numbers.
    out_b = tmp_path / "b"
    assert _analyze(flags, f"--checkpoint={run / 'checkpoints' / '2'}", f"--task={TASK}",
                    f"--out_dir={out_b}", "--max_examples=5") == 0
    assert json.loads((out_b / f"attention_{TASK}.json").read_text()) == report

    # The plain T5 backbone of the same checkpoint has no prompts: mass exactly 0.
    out_c = tmp_path / "c"
    assert _analyze(_flags(model_gin, run, conditioning=False), "--checkpoint=2",
                    f"--task={TASK}", f"--out_dir={out_c}", "--max_examples=5") == 0
    plain = json.loads((out_c / f"attention_{TASK}.json").read_text())
    assert plain["prompt_lengths"] == {"encoder": 0, "decoder": 0}
    assert all(x["prompt_mass"] == 0.0 for side in ("encoder", "decoder") for x in plain[side])
    capsys.readouterr()

    # Errors: a task outside the mixture, a step that was not saved, a missing flag.
    assert _analyze(flags, "--checkpoint=2", "--task=synthetic_keyword_v001",
                    f"--out_dir={out_a}") == 2
    err = capsys.readouterr().err
    assert "synthetic_keyword_v001" in err and TASK in err
    assert _analyze(flags, "--checkpoint=7", f"--task={TASK}", f"--out_dir={out_a}") == 2
    assert "step 7" in capsys.readouterr().err
    assert _analyze(flags, f"--task={TASK}", f"--out_dir={out_a}") == 2
    assert "--checkpoint is required" in capsys.readouterr().err
