"""Where registered tasks read their data, resolved when a dataset is built, not at import.

`import ktx.tasks` must work on a machine without data, so the task registrations never
touch the file system: every source asks this module at read time. The CLI passes the gin
`DATA_DIR` macro through `set_data_dir`; without it the `KTX_DATA_DIR` environment variable
is used. `TFDS_DATA_DIR` (gin via `set_tfds_data_dir`, or the environment) makes the GLUE
and SuperGLUE tasks read a prepared TFDS copy instead of the official files; nothing is
ever downloaded. The bad-row policy ("raise" or "skip") is `ktx.data.files`'s process
default (`set_on_bad_row`, the `KTX_ON_BAD_ROW` environment variable, or
`pipeline.MultiTaskInput.on_bad_row` from gin for the reads of one input).
"""

from __future__ import annotations

import os
import pathlib

import seqio

from ktx.data import files
from ktx.data import vocab as vocab_lib

__all__ = [
    "TFDS_DATA_DIR_ENV",
    "set_data_dir",
    "get_data_dir",
    "set_tfds_data_dir",
    "get_tfds_data_dir",
    "set_on_bad_row",
    "get_on_bad_row",
    "LazyT5Vocabulary",
    "t5_output_features",
]

TFDS_DATA_DIR_ENV = "TFDS_DATA_DIR"

_state: dict[str, str | None] = {"data_dir": None, "tfds_data_dir": None}


def set_data_dir(path: str | os.PathLike | None) -> None:
    """Sets the data folder for every task (None: fall back to `$KTX_DATA_DIR`)."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"set_data_dir(path={path!r}): expected a str path or None")
    _state["data_dir"] = None if path in (None, "") else os.fspath(path)


def get_data_dir() -> pathlib.Path:
    """The data folder now in force; raises `DataFileError` naming DATA_DIR and KTX_DATA_DIR."""
    return files.resolve_data_dir(_state["data_dir"])


def set_tfds_data_dir(path: str | os.PathLike | None) -> None:
    """Sets the TFDS folder (None: fall back to `$TFDS_DATA_DIR`, else no TFDS)."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"set_tfds_data_dir(path={path!r}): expected a str path or None")
    _state["tfds_data_dir"] = None if path in (None, "") else os.fspath(path)


def get_tfds_data_dir() -> str | None:
    """The TFDS folder now in force, or None when neither gin nor the environment sets one."""
    return _state["tfds_data_dir"] or os.environ.get(TFDS_DATA_DIR_ENV) or None


def set_on_bad_row(policy: str | None) -> None:
    """"raise" (default): an unreadable row raises naming file and line; "skip": count it.

    The process-wide policy of `ktx.data.files.set_on_bad_row` (None: `$KTX_ON_BAD_ROW`).
    """
    files.set_on_bad_row(policy)


def get_on_bad_row() -> str:
    """The policy in force (`ktx.data.files.get_on_bad_row`)."""
    return files.get_on_bad_row()


class LazyT5Vocabulary(seqio.SentencePieceVocabulary):
    """The T5 SentencePiece vocabulary, located under the data folder at first use.

    Same ids as `ktx.data.vocab.default_vocabulary` (32,000 pieces + 100 sentinels); the
    path is resolved through `get_data_dir()` only when the model is first needed.
    """

    def __init__(self, extra_ids: int = vocab_lib.T5_EXTRA_IDS):
        super().__init__(sentencepiece_model_file="", extra_ids=extra_ids)

    def _model_context(self):
        if self._model is None:
            self._sentencepiece_model_file = vocab_lib.default_vocabulary(
                get_data_dir(), self._extra_ids
            ).sentencepiece_model_file
        return super()._model_context()

    @property
    def sentencepiece_model_file(self) -> str:
        self._model_context()
        return self._sentencepiece_model_file


_VOCABULARY = LazyT5Vocabulary()


def t5_output_features() -> dict[str, seqio.Feature]:
    """`inputs` / `targets` features with the T5 vocabulary and EOS, as T5's tasks use."""
    return {
        "inputs": seqio.Feature(vocabulary=_VOCABULARY, add_eos=True, required=False),
        "targets": seqio.Feature(vocabulary=_VOCABULARY, add_eos=True),
    }
