"""`ktx` CLI: gin error reporting, and a tiny real run: train -> resume -> eval -> infer
on the synthetic quickstart suite with a tiny T5 (in-process, 8 fake CPU devices)."""

from __future__ import annotations

import json
import pathlib

import gin
import numpy as np
import pytest

from ktx import cli
from ktx.training.summaries import read_metrics
from tests import row_cache
from tests.tiny_t5_gin import tiny_t5_gin

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config(clear_constants=True)
    yield
    gin.clear_config(clear_constants=True)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_split_gin_flags():
    rest, bindings = cli._split_gin_flags(
        ["train", "--gin_file=a.gin", "--gin.TRAIN_STEPS=3", "--gin.MODEL_DIR", "'/x'"]
    )
    assert rest == ["train", "--gin_file=a.gin"]
    assert bindings == [("TRAIN_STEPS", "3"), ("MODEL_DIR", "'/x'")]
    with pytest.raises(cli.GinConfigError, match="has no value"):
        cli._split_gin_flags(["--gin.X"])


def test_unknown_parameter_names_file_line_and_close_name(tmp_path):
    f = _write(tmp_path, "bad.gin", (
        "from __gin__ import dynamic_registration\n"
        "import ktx.training.optimizers as optimizers\n"
        "\n"
        "optimizers.adafactor.decay_rat = 0.8\n"
    ))
    with pytest.raises(cli.GinConfigError) as e:
        cli.parse_gin([str(f)])
    msg = str(e.value)
    assert f"{f}:4" in msg
    assert "optimizers.adafactor.decay_rat = 0.8" in msg
    assert "decay_rate" in msg


def test_misspelt_configurable_suggests_close_name(tmp_path):
    f = _write(tmp_path, "bad.gin", (
        "from __gin__ import dynamic_registration\n"
        "import ktx.training.optimizers as optimizers\n"
        "optimizers.adafactr.decay_rate = 0.8\n"
    ))
    with pytest.raises(cli.GinConfigError) as e:
        cli.parse_gin([str(f)])
    msg = str(e.value)
    assert f"{f}:3" in msg and "adafactor" in msg


def test_unknown_macro_flag_suggests_close_macro(tmp_path):
    with pytest.raises(cli.GinConfigError) as e:
        cli.parse_gin(["runs/train.gin"], [("TRAIN_STEPSS", "3")])
    msg = str(e.value)
    assert "--gin.TRAIN_STEPSS=3" in msg and "TRAIN_STEPS" in msg


def test_slots_advice_bindings_work_when_pasted():
    """The balanced-step advice `ktx train` prints (`slots_advice`) names bindings that parse
    with runs/train.gin and give the input rows in blocks."""
    from ktx.optim.device_slots import slots_advice

    advice = slots_advice([(1, 9, 1, 49, 1, 53, 14, 0)], 32)
    flags = [a[len("--gin."):].split("=", 1) for a in advice.split() if a.startswith("--gin.")]
    assert len(flags) == 2
    cli.parse_gin(["runs/quickstart.gin"], [tuple(f) for f in flags])
    mixing = gin.query_parameter("pipeline.MultiTaskInput.mixing").scoped_configurable_fn()
    assert (mixing.kind, mixing.block_rows) == ("mixture", 4)


def test_missing_gin_file_suggests(tmp_path):
    with pytest.raises(cli.GinConfigError, match="runs/train.gin"):
        cli.parse_gin(["runs/trian.gin"])


@pytest.mark.parametrize("files, model, other", [
    (["models/bert_tiny.gin", "conditioning/hyperprompt_global.gin"], "a T5", "BertConfig"),
    (["models/t5_1_1_tiny.gin", "conditioning/pals.gin"], "a BERT-family", "T5Config"),
    (["models/t5_1_1_tiny.gin", "conditioning/ca_mtl.gin"], "a BERT-family", "T5Config"),
    (["models/t5_1_1_tiny.gin", "conditioning/mean_pooling.gin"], "a T5", "EncoderClassifierModel"),
])
def test_conditioning_of_the_other_model_family_is_refused(files, model, other, capsys):
    """Before: bert_tiny + HyperPrompt built a T5-Base silently, t5 + CA-MTL a BERT-Base."""
    assert cli.main(["params", *(f"--gin_file={f}" for f in files)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ktx: gin files") and f"MODEL is {model}" in err and other in err
    assert "Accepted: gin/models/" in err
    for ok in (["models/bert_tiny.gin", "conditioning/pals.gin", "conditioning/mean_pooling.gin"],
               ["models/t5_1_1_tiny.gin", "conditioning/hyperformer.gin"]):
        cli.parse_gin(ok)


def test_main_reports_missing_required_macro(tmp_path, capsys):
    model = _write(tmp_path, "model.gin", TINY_MODEL_GIN)
    code = cli.main(["train", "--gin_file=runs/train.gin", f"--gin_file={model}",
                     "--gin.MIXTURE_OR_TASK_NAME='synthetic_quickstart'",
                     "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
                     "--gin.TRAIN_STEPS=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "MODEL_DIR" in err and "train.gin" in err


TINY_MODEL_GIN = tiny_t5_gin()


def _task_names():
    import ktx.tasks  # noqa: F401
    from ktx.data.pipeline import mixture_task_names

    return mixture_task_names("synthetic_quickstart")


def _flags(model_gin, model_dir, steps):
    return [
        "--gin_file=runs/train.gin", f"--gin_file={model_gin}",
        f"--gin.NUM_TASKS={len(_task_names())}",
        f"--gin.MODEL_DIR='{model_dir}'",
        "--gin.MIXTURE_OR_TASK_NAME='synthetic_quickstart'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
        f"--gin.TRAIN_STEPS={steps}", "--gin.BATCH_SIZE=8",
        "--gin.train_script.train.log_period=2",
        "--gin.train_script.train.checkpoint_period=2",
        "--gin.optimizers.rsqrt_schedule.warmup_steps=100",
        row_cache.flag(),
    ]


def test_train_resume_eval_infer_end_to_end(tmp_path, capsys):
    pytest.importorskip("ktx.data.pipeline")
    pytest.importorskip("ktx.models.seq2seq")
    model_gin = _write(tmp_path, "model.gin", TINY_MODEL_GIN)
    run = tmp_path / "run"
    assert cli.main(["train", *_flags(model_gin, run, 2)]) == 0
    assert (run / "config.gin").is_file()
    assert "train_script.train" in (run / "config.gin").read_text()
    gin.clear_config(clear_constants=True)
    assert cli.main(["train", *_flags(model_gin, run, 4)]) == 0
    out = capsys.readouterr().out
    assert "Resuming from checkpoint step 2" in out
    assert "step 4/4 | loss" in out and "eta" in out
    records = read_metrics(run)
    names = _task_names()
    tasks = {r["task"] for r in records if r["split"] == "train"}
    assert "all" in tasks and names[0] in tasks and tasks <= {"all", *names}
    assert sorted({r["step"] for r in records}) == [2, 4]

    # Resumed run == uninterrupted run (same seed).
    gin.clear_config(clear_constants=True)
    straight = tmp_path / "straight"
    assert cli.main(["train", *_flags(model_gin, straight, 4)]) == 0
    from ktx.convert import read_ktx_checkpoint

    a, b = read_ktx_checkpoint(run)[0], read_ktx_checkpoint(straight)[0]
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-6)

    # Offline eval over every checkpoint, a handful of examples per task.
    gin.clear_config(clear_constants=True)
    assert cli.main([
        "eval", "--gin_file=runs/eval.gin", f"--gin_file={model_gin}", f"--gin.NUM_TASKS={len(names)}",
        f"--gin.MODEL_DIR='{run}'", "--gin.MIXTURE_OR_TASK_NAME='synthetic_quickstart'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", "--gin.EVAL_BATCH_SIZE=8",
        "--gin.eval_script.evaluate.num_examples=8",
    ]) == 0
    out = capsys.readouterr().out
    assert "best average: step" in out
    eval_records = read_metrics(run / "eval")
    assert {r["step"] for r in eval_records} == {2, 4}
    assert {r["task"] for r in eval_records} == set(names)

    # Inference writes JSONL with inputs, targets, predictions, task.
    gin.clear_config(clear_constants=True)
    preds = tmp_path / "preds.jsonl"
    assert cli.main([
        "infer", "--gin_file=runs/infer.gin", f"--gin_file={model_gin}", f"--gin.NUM_TASKS={len(names)}",
        f"--gin.CHECKPOINT_PATH='{run}'", "--gin.MIXTURE_OR_TASK_NAME='synthetic_quickstart'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", "--gin.INFER_BATCH_SIZE=8",
        f"--gin.INFER_OUTPUT_FILE='{preds}'", "--gin.infer_script.infer.num_examples=3",
    ]) == 0
    lines = [json.loads(x) for x in preds.read_text().splitlines()]
    assert len(lines) == 3 * len(names)
    assert {"task", "inputs", "targets", "prediction"} <= set(lines[0])
    assert [x["task"] for x in lines[::3]] == list(names)
    assert all(isinstance(x["inputs"], str) and x["inputs"] for x in lines)


def test_eval_and_infer_do_not_require_training_only_macros(tmp_path):
    """An experiment file that requires INITIAL_CHECKPOINT_PATH (a pretrained start) is
    evaluated from MODEL_DIR without it; the other required macros are still named."""
    from ktx.cli import gin_config

    exp = _write(tmp_path, "exp.gin", "include 'runs/train.gin'\n"
                 "INITIAL_CHECKPOINT_PATH = %gin.REQUIRED\nMODEL_DIR = %gin.REQUIRED\n")
    cli.parse_gin([str(exp)])
    with pytest.raises(cli.GinConfigError, match=r"(?s)INITIAL_CHECKPOINT_PATH .*MODEL_DIR"):
        cli.check_required_macros([exp])
    with pytest.raises(cli.GinConfigError) as info:
        cli.check_required_macros([exp], skip=gin_config.TRAIN_ONLY_MACROS)
    assert "MODEL_DIR" in str(info.value) and "INITIAL_CHECKPOINT_PATH" not in str(info.value)


def test_balanced_train_on_a_data_x_model_mesh_with_uneven_task_blocks(tmp_path, capsys):
    """synthetic_quickstart's proportional mixing gives 16-row batches task blocks of 5-6
    rows (one task absent at step 0); on a 4 x 2 mesh such blocks gave NaN losses from
    step 1 under XLA's SPMD partitioner until the Trainer rounded them up to multiples of
    the data axis. The balanced run equals the VJP run, which has no blocks."""
    model_gin = _write(tmp_path, "model.gin", TINY_MODEL_GIN)
    flags = [f for f in _flags(model_gin, tmp_path / "blocks", 3) if "BATCH_SIZE" not in f
             and "log_period" not in f]
    common = ["--gin_file=optim/vanilla_multi.gin", "--gin.BATCH_SIZE=16",
              "--gin.NUM_PARTITIONS=2", "--gin.train_script.train.log_period=1",
              "--gin.train_script.train.weights_from_losses=False"]  # per-task gradients
    assert cli.main(["train", *flags, *common]) == 0
    blocks = [line for line in capsys.readouterr().out.splitlines() if "| loss" in line]
    gin.clear_config(clear_constants=True)
    vjp_flags = [f.replace("blocks", "vjp") for f in flags]
    assert cli.main(["train", *vjp_flags, *common,
                     "--gin.train_script.train.grad_method='vjp'"]) == 0
    vjp = [line for line in capsys.readouterr().out.splitlines() if "| loss" in line]
    assert len(blocks) == len(vjp) == 3
    for a, b in zip(blocks, vjp):
        la, lb = (float(x.split("| loss ")[1].split()[0]) for x in (a, b))
        assert np.isfinite(la) and la == pytest.approx(lb, rel=1e-4), (a, b)
