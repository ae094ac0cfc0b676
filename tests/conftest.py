"""Shared pytest fixtures for ktx."""

import os

# Every test process sees 8 CPU devices so that 2x4 mesh tests run in-process; this must
# happen before JAX initialises its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# A pytest worker runs hundreds of in-process `ktx train`s: under the CLI's default host
# malloc mode ("keep") it would hold the largest one's peak to the end. The mode itself is
# tested in child processes (tests/test_host_malloc.py).
os.environ.setdefault("KTX_HOST_MALLOC", "system")
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
