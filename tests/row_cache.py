"""The test session's folder of converted input rows (`tests/conftest.py`), as a gin flag."""

from __future__ import annotations

import os


def folder() -> str:
    """The folder (`KTX_TEST_ROW_CACHE`, made by `tests/conftest.py`)."""
    return os.environ["KTX_TEST_ROW_CACHE"]


def flag() -> str:
    """`--gin.pipeline.MultiTaskInput.cache_dir=...`: the run keeps its converted rows in the
    session's folder and reads them from there when another run converted them first.
    Only for runs on `synthetic_quickstart` (rows generated, never read from files)."""
    return f"--gin.pipeline.MultiTaskInput.cache_dir='{folder()}'"
