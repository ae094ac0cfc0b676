"""Shared pytest fixtures for ktx."""

import os
import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def data_dir() -> pathlib.Path:
    """The real data folder (`KTX_DATA_DIR`); tests that need it skip without it."""
    value = os.environ.get("KTX_DATA_DIR")
    if not value:
        pytest.skip("KTX_DATA_DIR is not set: real-data tests need ../shared/data")
    path = pathlib.Path(value)
    if not path.is_dir():
        pytest.skip(f"KTX_DATA_DIR={value} is not a directory")
    return path
