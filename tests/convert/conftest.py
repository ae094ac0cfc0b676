"""The reference checkpoints (`../shared/fixtures/checkpoints/`, or `$KTX_FIXTURES_DIR`)."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def fixtures_root() -> pathlib.Path:
    """`$KTX_FIXTURES_DIR` (the `fixtures` folder) or `../shared/fixtures` from the repo."""
    value = os.environ.get("KTX_FIXTURES_DIR")
    return pathlib.Path(value) if value else REPO_ROOT.parent / "shared" / "fixtures"


def checkpoint_fixture(name: str) -> pathlib.Path:
    """`<fixtures>/checkpoints/<name>`; the test skips, saying where it looked, when absent."""
    path = fixtures_root() / "checkpoints" / name
    if not path.is_dir():
        pytest.skip(
            f"checkpoint fixture {name!r} not found at {path} (set KTX_FIXTURES_DIR to the "
            "shared fixtures folder, made by tools/make_checkpoint_fixtures.py)"
        )
    return path


def load_inputs(folder: pathlib.Path) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, np.int32) for k, v in json.loads((folder / "inputs.json").read_text()).items()}


def load_expected(folder: pathlib.Path, name: str = "expected.npz") -> dict[str, np.ndarray]:
    with np.load(folder / name, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}
