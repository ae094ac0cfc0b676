"""Every .gin file in the repository parses (dynamic registration, unknown names are
errors, includes resolved from gin/), and run files declare their required macros."""

from __future__ import annotations

import pathlib
import re

import gin
import pytest

from ktx import cli

REPO = pathlib.Path(__file__).resolve().parent.parent
_SKIP_DIRS = {".venv", ".git", "node_modules", "build", "dist"}


def _gin_files() -> list[pathlib.Path]:
    # ktx's gin files live under gin/; run directories (a quickstart's runs/, with its
    # operative config.gin) are outputs, not sources.
    return sorted(
        p for p in (REPO / "gin").rglob("*.gin")
        if not _SKIP_DIRS.intersection(p.relative_to(REPO).parts)
    )


GIN_FILES = _gin_files()


def test_found_the_run_files():
    names = {str(p.relative_to(REPO)) for p in GIN_FILES}
    assert {"gin/runs/train.gin", "gin/runs/eval.gin", "gin/runs/infer.gin"} <= names


@pytest.mark.parametrize("path", GIN_FILES, ids=[str(p.relative_to(REPO)) for p in GIN_FILES])
def test_gin_file_parses(path):
    gin.clear_config(clear_constants=True)
    gin.add_config_file_search_path(str(REPO / "gin"))
    try:
        cli.parse_gin([str(path)])
    finally:
        gin.clear_config(clear_constants=True)


@pytest.mark.parametrize(
    "path", [p for p in GIN_FILES if p.parent.name == "runs"],
    ids=lambda p: p.name,
)
def test_run_files_use_t5x_macro_names(path):
    text = path.read_text()
    if "train_script.train" in text and "include" not in text:
        # SeqIO runs need T5X's macros; recommendation runs take their data, sizes and
        # epochs from the experiment file and need only the run directory.
        required = ("MODEL_DIR",) if "RecsysTrainInput" in text else (
            "MODEL_DIR", "MIXTURE_OR_TASK_NAME", "TASK_FEATURE_LENGTHS", "TRAIN_STEPS")
        for macro in required:
            assert re.search(rf"^{macro} = %gin.REQUIRED", text, re.M), (path, macro)


def test_parse_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.gin"
    bad.write_text("from __gin__ import dynamic_registration\nimport ktx.training.optimizers as o\n"
                   "o.adamw.learnin_rate = 1.0\n")
    gin.clear_config(clear_constants=True)
    with pytest.raises(cli.GinConfigError, match=rf"(?s){re.escape(str(bad))}:3.*learning_rate"):
        try:
            cli.parse_gin([str(bad)])
        finally:
            gin.clear_config(clear_constants=True)
