"""Shared helpers for the task tests: a temporary data folder, a tiny WordPiece vocabulary."""

import pathlib

import pytest
import seqio

from ktx.tasks import config


@pytest.fixture
def root(tmp_path, monkeypatch):
    """An empty data folder that the tasks read, reset afterwards."""
    monkeypatch.delenv("TFDS_DATA_DIR", raising=False)
    config.set_data_dir(tmp_path)
    config.set_on_bad_row("raise")
    yield tmp_path
    config.set_data_dir(None)
    config.set_tfds_data_dir(None)
    config.set_on_bad_row("raise")


@pytest.fixture
def vocab_dir(tmp_path):
    """A folder with a tiny `vocab.txt` (`tests.data.test_wordpiece.TOKENS`)."""
    from tests.data.test_wordpiece import write_vocab

    return write_vocab(tmp_path / "vocab")


def write(root: pathlib.Path, relpath: str, text: str) -> pathlib.Path:
    path = root / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def formatted(task_name: str, split: str):
    """The task's rows after its text preprocessor (before tokenization: no vocabulary)."""
    task = seqio.get_mixture_or_task(task_name)
    return task.preprocessors[0](task.source.get_dataset(split, shuffle=False))
