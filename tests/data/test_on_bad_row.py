"""The bad-row policy is settable without code: gin (`ktx train`), the environment, Python.

A task over a file with one unreadable row raises by default, naming file and line and
the ways to skip; each of those ways then reads the file with the row skipped.
"""

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
    assert f"--gin.{BINDING}=\"'skip'\"" in message
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


def test_train_gin_accepts_the_recommended_flag(bad_task):
    from ktx import cli
    from tests.tiny_t5_gin import tiny_t5_gin

    model = bad_task.parent / "tiny.gin"
    model.write_text(tiny_t5_gin(), encoding="utf-8")
    cli.parse_gin([str(model), "runs/train.gin"], [(BINDING, "'skip'")])
    assert gin.query_parameter(f"ktx.data.{BINDING}") == "skip"


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
        with pytest.raises(files.DataFileError, match=r"quora-dev\.csv:2577:.*on_bad_row=\"'skip'\""):
            task.num_input_examples("validation")
        with files.on_bad_row_policy("skip"):
            # 20,214 rows; lines 2577 and 14222 have an empty label.
            assert task.num_input_examples("validation") == 20212
    finally:
        config.set_data_dir(None)
