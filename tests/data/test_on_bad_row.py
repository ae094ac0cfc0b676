"""The bad-row policy is settable without code: gin (`ktx train`), the environment, Python.

A task over a file with one unreadable row raises by default, naming file and line and
the ways to skip; each of those ways then reads the file with the row skipped.
"""

import pathlib

import gin
import pytest
import seqio

from ktx.data import files
from ktx.data import vocab as vocab_lib
from ktx.data.pipeline import MultiTaskInput
from ktx.tasks import biomed
from ktx.tasks import config

LENGTHS = {"inputs": 32, "targets": 16}
TASK = "ktx_test_bad_row_ner"
BINDING = "pipeline.MultiTaskInput.on_bad_row"  # as runs/train.gin imports ktx.data.pipeline
BYTES = {
    "inputs": seqio.Feature(vocab_lib.byte_vocabulary(), add_eos=True, required=False),
    "targets": seqio.Feature(vocab_lib.byte_vocabulary(), add_eos=True),
}


@pytest.fixture
def bad_task(tmp_path, monkeypatch):
    monkeypatch.delenv(files.ON_BAD_ROW_ENV, raising=False)
    files.set_on_bad_row(None)
    path = tmp_path / "train.tsv"
    # Line 4 has a tag of another entity type: a bad row.
    path.write_text("Gout\tB-Disease\n.\tO\n\nx\tI-Gene\n\nNo\tO\ndisease\tO\n", encoding="utf-8")
    seqio.TaskRegistry.remove(TASK)
    biomed.add_ner_task(TASK, "ncbi_disease", {"train": [path]}, output_features=BYTES)
    yield path
    seqio.TaskRegistry.remove(TASK)
    files.set_on_bad_row(None)
    gin.clear_config()


def test_default_raises_naming_line_and_every_way_to_skip(bad_task):
    with pytest.raises(files.DataFileError) as error:
        MultiTaskInput(TASK, LENGTHS, batch_size=2, process_index=0, process_count=1)
    message = str(error.value)
    assert f"{bad_task}:4: unknown tag 'I-Gene'" in message
    assert "--gin.ON_BAD_ROW=\"'skip'\"" in message
    assert "KTX_ON_BAD_ROW=skip" in message and "ktx.data.files.set_on_bad_row('skip')" in message


def test_gin_binding_skips_for_that_input_only(bad_task):
    # The line `ktx train ... --gin.pipeline.MultiTaskInput.on_bad_row="'skip'"` adds to
    # runs/train.gin, which imports ktx.data.pipeline as `pipeline` (dynamic registration).
    gin.clear_config()
    gin.parse_config("from __gin__ import dynamic_registration\n"
                     f"import ktx.data.pipeline as pipeline\n{BINDING} = 'skip'\n")
    inp = gin.get_configurable(MultiTaskInput)(TASK, LENGTHS, batch_size=2, process_index=0, process_count=1)
    assert inp.on_bad_row == "skip" and inp.task_sizes == (2,)
    assert files.get_on_bad_row() == "raise"  # scoped to the input's reads
    with pytest.raises(ValueError, match="on_bad_row='ignore'"):
        MultiTaskInput(TASK, LENGTHS, batch_size=2, on_bad_row="ignore")


def test_train_gin_accepts_the_input_binding(bad_task):
    from ktx import cli
    from tests.tiny_t5_gin import tiny_t5_gin

    model = bad_task.parent / "tiny.gin"
    model.write_text(tiny_t5_gin(), encoding="utf-8")
    cli.parse_gin([str(model), "runs/train.gin"], [(BINDING, "'skip'")])
    assert gin.query_parameter(f"ktx.data.{BINDING}") == "skip"


@pytest.mark.parametrize("run_file", ["runs/train.gin", "runs/eval.gin", "runs/infer.gin"])
def test_recommended_flag_sets_the_policy_of_every_command(bad_task, run_file, monkeypatch):
    """`--gin.ON_BAD_ROW="'skip'"` (the flag the error recommends) is what `ktx train`,
    `ktx eval` and `ktx infer` apply before reading any file."""
    from ktx import cli

    seen = {}
    monkeypatch.setattr(cli, "_call_entry", lambda *a, **k: seen.setdefault("policy", files.get_on_bad_row()))
    monkeypatch.setattr(cli, "_check_run_macros", lambda command: None)
    monkeypatch.setattr(cli, "_write_config", lambda *a, **k: None)
    import ktx.runs.eval

    monkeypatch.setattr(ktx.runs.eval, "format_table", lambda summary: "")
    from tests.tiny_t5_gin import tiny_t5_gin

    model = bad_task.parent / "tiny.gin"
    model.write_text(tiny_t5_gin(), encoding="utf-8")
    command = run_file.split("/")[1].split(".")[0]
    required = {"MODEL_DIR": "'/tmp/x'", "CHECKPOINT_PATH": "'/tmp/x'", "INFER_OUTPUT_FILE": "'/tmp/x.jsonl'",
                "MIXTURE_OR_TASK_NAME": f"'{TASK}'", "TASK_FEATURE_LENGTHS": str(LENGTHS), "TRAIN_STEPS": "1"}
    text = pathlib.Path(cli.DEFAULT_GIN_DIR / run_file).read_text()
    flags = [f"--gin.{k}={v}" for k, v in required.items() if f"\n{k} = " in text]
    assert cli.main([command, f"--gin_file={run_file}", f"--gin_file={model}",
                     "--gin.ON_BAD_ROW='skip'", *flags]) == 0
    assert seen["policy"] == "skip"
    seen.clear()
    gin.clear_config()
    assert cli.main([command, f"--gin_file={run_file}", f"--gin_file={model}", *flags]) == 0
    assert seen["policy"] == "raise"


def test_environment_and_python_setting(bad_task, monkeypatch):
    monkeypatch.setenv(files.ON_BAD_ROW_ENV, "skip")
    assert MultiTaskInput(TASK, LENGTHS, batch_size=2, process_index=0, process_count=1).task_sizes == (2,)
    monkeypatch.setenv(files.ON_BAD_ROW_ENV, "ignore")
    with pytest.raises(ValueError, match=r"\$KTX_ON_BAD_ROW='ignore'"):
        files.get_on_bad_row()
    monkeypatch.delenv(files.ON_BAD_ROW_ENV)
    files.set_on_bad_row("skip")
    assert config.get_on_bad_row() == "skip"
    assert seqio.get_mixture_or_task(TASK).num_input_examples("train") == 2
    with files.on_bad_row_policy("raise"):
        with pytest.raises(files.DataFileError, match="unknown tag"):
            seqio.get_mixture_or_task(TASK).num_input_examples("train")
    assert files.get_on_bad_row() == "skip"
    with pytest.raises(ValueError, match="set_on_bad_row"):
        files.set_on_bad_row("ignore")


def test_real_quora_validation_reads_with_skip(data_dir):
    """cs224n_quora_v001 validation has empty labels at lines 2577 and 14222 (real data)."""
    config.set_data_dir(data_dir)
    try:
        task = seqio.get_mixture_or_task("cs224n_quora_v001")
        with pytest.raises(files.DataFileError, match=r"quora-dev\.csv:2577:.*ON_BAD_ROW=\"'skip'\""):
            task.num_input_examples("validation")
        with files.on_bad_row_policy("skip"):
            # 20,214 rows; lines 2577 and 14222 have an empty label.
            assert task.num_input_examples("validation") == 20212
    finally:
        config.set_data_dir(None)
