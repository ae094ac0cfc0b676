"""Shared pytest fixtures for ktx."""

import os

# XLA flags for every test process and the `ktx` processes tests start (they inherit the
# environment); they must be set before JAX initialises its backends. A flag the user
# already gave in XLA_FLAGS wins.
# - 8 CPU devices, so that 2x4 mesh tests run in-process.
# - LLVM at -O0: the suite's time is mostly XLA:CPU compiling small programs, and for
#   programs of many small fusions (parameter initialisation: tens of thousands of HLO
#   lines of threefry) LLVM's optimisation passes are most of a compile. Measured in CPU
#   seconds: a tiny T5's initialisation 26.2 -> 9.5, its 2x4-mesh init and train step
#   36.7 -> 21.9, tests/models/test_bert.py 71.5 -> 63.5-67.3 (its compiles are mostly
#   XLA's own passes). The programs run slower, which tiny shapes do not notice; numerics
#   are the same (without fast-math LLVM may not reassociate floating point at any level).
# - XLA:CPU's elemental IR emitters instead of its MLIR fusion emitters
#   (`--xla_cpu_use_fusion_emitters=false`): the MLIR emitters lower each fusion through
#   MLIR's pattern rewriters (a third of a test's CPU seconds in them), which buys faster
#   kernels the tiny test programs do not need. Measured in CPU seconds of one test, no
#   compilation cache: tests/models/test_camtl.py frozen-half [base] 35.5 -> 24.3,
#   tests/conditioning/test_model.py 2x4 mesh [hyperprompt-sep] 33.9 -> 22.5,
#   tests/models/test_smart.py balancer + frozen layers 46.5 -> 36.5; over the fast tier
#   4,179 -> 2,809 compile seconds. The HLO is the same (the emitters only write its
#   loops) and every numerical check passes unchanged; `ktx` itself and the benchmarks
#   keep XLA's default emitters.
# - One LLVM module per program (`--xla_cpu_parallel_codegen_split_count=1`): XLA:CPU
#   splits a program's module into parts it compiles on a thread pool, a cost per part
#   that tiny programs do not repay, and both cores are busy with the two xdist workers
#   anyway. Measured as a whole process, 8 runs each in turn: the initialisation and the
#   balanced and shortcut train steps of the tiny T5 of tests/optim/test_dropout_paths.py
#   (with the imports) 22.4 -> 21.0 CPU seconds (median; every pair lower). The kernels
#   are the same code, only compiled in one piece.
_TEST_XLA_FLAGS = {"--xla_force_host_platform_device_count": "8",
                   "--xla_backend_optimization_level": "0",
                   "--xla_cpu_use_fusion_emitters": "false",
                   "--xla_cpu_parallel_codegen_split_count": "1"}
_given_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_given_flags] + [f"{k}={v}" for k, v in _TEST_XLA_FLAGS.items() if k not in _given_flags]
).strip()
# MLIR locations without Python traceback frames (`JAX_TRACEBACK_IN_LOCATIONS_LIMIT=0`;
# JAX's default keeps up to 100 frames per op, which lowering turns into HLO stack frames
# that every compile carries): measured as the flag above, 21.2 -> 19.4 CPU seconds
# (median of 6 runs each in turn). Ops keep their names (`op_name`, the name stack the
# tests that look for a gather inside a scan's body read); `ktx` itself keeps JAX's
# default (profilers show the frames).
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
# A pytest worker runs hundreds of in-process `ktx train`s: under the CLI's default host
# malloc mode ("keep") it would hold the largest one's peak to the end. The mode itself is
# tested in child processes (tests/test_host_malloc.py).
os.environ.setdefault("KTX_HOST_MALLOC", "system")
# A relative KTX_DATA_DIR (`KTX_DATA_DIR=../shared/data make test`) names a folder from
# where the session starts; tests run `ktx` from other folders (monkeypatch.chdir) and
# start processes there, so the session passes it on absolute.
if os.environ.get("KTX_DATA_DIR"):
    os.environ["KTX_DATA_DIR"] = os.path.abspath(os.environ["KTX_DATA_DIR"])
import pathlib
import re
import shutil
import tempfile


# One JAX persistent compilation cache per test session, shared by its xdist workers and
# by the `ktx` processes tests start (all inherit this process's environment): a program
# compiled in one process is read from disk in the others. Only programs whose compile
# took a second or more are written (JAX's default threshold; the eager ops' tiny programs
# cost more to write and read than to compile). `KTX_TEST_COMPILATION_CACHE=0` turns it
# off; a directory given there is used as it is and kept; JAX_COMPILATION_CACHE_DIR set by
# the user wins.
_CREATED_CACHE = None
if (os.environ.get("KTX_TEST_COMPILATION_CACHE") != "0"
        and "JAX_COMPILATION_CACHE_DIR" not in os.environ):
    _given = os.environ.get("KTX_TEST_COMPILATION_CACHE")
    if not _given:
        _given = _CREATED_CACHE = tempfile.mkdtemp(prefix="ktx-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _given
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")


# One folder of converted input rows per test session (`ktx.data.task_rows`'s npz cache),
# shared like the compilation cache: a test that trains on the deterministic built-in
# mixture `synthetic_quickstart` passes `tests.row_cache.flag()` to `ktx train`, and the
# same rows (same lengths, packing, seed and process shard) are converted from SeqIO once
# per session instead of in every run and every process a test starts (3.5-7 s of a
# tiny run's start). Only for tasks whose rows never change within a session: the cache
# key names the task, not its data files. `KTX_TEST_ROW_CACHE` is the folder.
_CREATED_ROW_CACHE = None
if not os.environ.get("KTX_TEST_ROW_CACHE"):
    os.environ["KTX_TEST_ROW_CACHE"] = _CREATED_ROW_CACHE = tempfile.mkdtemp(prefix="ktx-test-rows-")

# One folder per test session for runs that several slow tests only read
# (`tests.multiprocess_runs.sharded_reference`), trained by the first worker that asks.
_CREATED_SHARED_RUNS = None
if not os.environ.get("KTX_TEST_SHARED_RUNS"):
    os.environ["KTX_TEST_SHARED_RUNS"] = _CREATED_SHARED_RUNS = tempfile.mkdtemp(prefix="ktx-test-runs-")


# Per-test compile counts and seconds when KTX_TEST_COMPILE_STATS=FILE is set (inert
# otherwise): `KTX_TEST_COMPILE_STATS=/tmp/stats.jsonl make test`.
pytest_plugins = ["tests.compile_stats"]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: kills and relaunches processes (minutes each); `make test` runs "
        "these after the fast tier, `make test-fast` leaves them out")


def pytest_collection_modifyitems(config, items):
    # `make test`'s slow tier collects only the `test_*.py` modules that say `mark.slow`
    # (Makefile, SLOW_TEST_FILES): a slow test elsewhere would never run there.
    for path in sorted({item.path for item in items if item.get_closest_marker("slow")}):
        if not (path.name.startswith("test_") and re.search(r"mark\.slow", path.read_text())):
            raise pytest.UsageError(
                f"{path}: a slow test outside a test_*.py module that says `mark.slow`; "
                "mark it with `pytest.mark.slow` in such a module so that `make test`'s "
                "slow tier collects it")


def pytest_unconfigure(config):
    for created in (_CREATED_CACHE, _CREATED_ROW_CACHE, _CREATED_SHARED_RUNS):
        if created:  # the process that made it (xdist's controller): workers are done
            shutil.rmtree(created, ignore_errors=True)


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
