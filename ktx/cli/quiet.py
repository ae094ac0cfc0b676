"""A quiet start for the command line: what a `ktx` command prints is ktx's.

`start()` runs first in `ktx.cli.main`, before anything imports TensorFlow or initialises
JAX's backends:

* `TF_CPP_MIN_LOG_LEVEL` is set to 2 (TensorFlow's native errors only) unless the user set
  it: theirs wins.
* The first `import tensorflow` of the process, from whichever module (a gin file's
  `import ktx.tasks`, SeqIO, clu), runs with file descriptor 2 captured
  (`native_stderr`): TensorFlow's native libraries log while they load, before their
  logging reads `TF_CPP_MIN_LOG_LEVEL` ("All log messages before absl::InitializeLog()",
  oneDNN, "Could not find cuda drivers"), and those lines are held back; every other line
  is written back. TensorFlow is then told to see no GPU (`tf.config.set_visible_devices`):
  ktx uses it for data only, and it never takes an accelerator JAX uses.
* `quiet_backends()` initialises JAX's backends under the same capture: with libtpu
  installed, a machine without a TPU gets its probe's lines ("Failed to find host bounds
  for accelerator type", "unexpected worker hostname") and TensorFlow's CUDA probe
  ("failed call to cuInit") otherwise.
* ktx's modules log through children of the `ktx` logger (`logging.getLogger(__name__)`),
  which prints `ktx: message` on stderr (records still propagate, so a handler on the root
  logger, pytest's included, sees them too); absl's and TensorFlow's Python loggers print
  errors only.

With a user's own `TF_CPP_MIN_LOG_LEVEL`, captured lines are held back only below that
level (0 shows everything; 3 holds back all but fatal lines), and the Python loggers keep
their levels.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from ktx.cli import stderr_filter

__all__ = ["start", "native_stderr", "quiet_backends", "held_back", "KTX_LOGGER", "TF_LEVEL_ENV"]

TF_LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
KTX_LOGGER = "ktx"
# TensorFlow's level while a command runs; the capture at start-up holds back errors too
# (device probes of a machine without that device).
_RUN_LEVEL = "2"
_START_LEVEL = 3

# The native log lines held back (`ktx.cli.stderr_filter`, also the filter process).
_ABSL_LINE = stderr_filter.ABSL_LINE
_FILTER = pathlib.Path(stderr_filter.__file__)


def _level() -> int:
    """Severities below this are held back: the user's `TF_CPP_MIN_LOG_LEVEL`, else 3."""
    user = os.environ.get("_KTX_USER_TF_LEVEL")
    if user is None:
        return _START_LEVEL
    try:
        return int(user)
    except ValueError:
        return 0


def held_back(line: str, level: int | None = None) -> bool:
    """Whether a captured stderr line is a native log line below `level` (default: the
    level in force)."""
    return stderr_filter.held_back(line, _level() if level is None else level)


@contextlib.contextmanager
def native_stderr() -> Iterator[None]:
    """Captures file descriptor 2 inside the block: every line that `held_back` does not
    hold back is written back, Python's own output included, in order. A filter process
    (`ktx.cli.stderr_filter`) reads the capture through a pipe, so that lines written just
    before this process dies inside the block (a native library's `exit`) are shown too;
    where it cannot start, the capture goes to a temporary file written back at the end."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real fd 2: nothing to capture
        yield
        return
    try:
        read, write = os.pipe()
    except OSError:
        read = write = None
    proc = None
    if read is not None:
        if sys.executable:
            with contextlib.suppress(OSError):
                proc = subprocess.Popen(
                    [sys.executable, "-S", "-E", str(_FILTER), str(_level())],
                    stdin=read, stdout=saved, stderr=saved)
        os.close(read)
        if proc is None:
            os.close(write)
    if proc is not None:
        os.dup2(write, 2)
        os.close(write)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)  # the pipe's last write end: the filter reads to its end
            os.close(saved)
            proc.wait()
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode("utf-8", "replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not held_back(line.rstrip("\n")))
            if kept:
                os.write(2, kept.encode())


def _hide_gpus(tf) -> None:
    """TensorFlow (data only) sees no GPU: it allocates nothing on JAX's accelerators."""
    with contextlib.suppress(Exception):  # devices already initialised: too late, harmless
        tf.config.set_visible_devices([], "GPU")


class _QuietLoader(importlib.abc.Loader):
    """The loader of `tensorflow`'s spec, run under `native_stderr`, then GPUs hidden."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        for finder in [f for f in sys.meta_path if isinstance(f, _QuietTensorFlow)]:
            sys.meta_path.remove(finder)  # once imported, tensorflow is found in sys.modules
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        with native_stderr():
            self._loader.exec_module(module)
            _hide_gpus(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _QuietTensorFlow(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` until it is imported (a lookup alone, `importlib.util.find_spec`
    as etils does, imports nothing) and wraps its loader in `_QuietLoader`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "tensorflow" or fullname in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader)
        return spec


class _StderrHandler(logging.StreamHandler):
    """Writes to `sys.stderr` as it is at each record (not as it was at start)."""

    def emit(self, record):
        self.stream = sys.stderr
        super().emit(record)


def _configure_logging(user_level: bool) -> None:
    logger = logging.getLogger(KTX_LOGGER)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(f"{KTX_LOGGER}: %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)
    if not user_level:
        for name in ("absl", "tensorflow", "jax._src.xla_bridge"):
            logging.getLogger(name).setLevel(logging.ERROR)


def start() -> None:
    """The quiet start of a `ktx` command (see the module docstring); call it before
    anything imports TensorFlow. Idempotent."""
    user = os.environ.get(TF_LEVEL_ENV)
    if "_KTX_USER_TF_LEVEL" not in os.environ:
        if user is not None and os.environ.get("_KTX_SET_TF_LEVEL") != user:
            os.environ["_KTX_USER_TF_LEVEL"] = user
        else:
            os.environ[TF_LEVEL_ENV] = _RUN_LEVEL
            os.environ["_KTX_SET_TF_LEVEL"] = _RUN_LEVEL
    _configure_logging("_KTX_USER_TF_LEVEL" in os.environ)
    if "tensorflow" not in sys.modules and not any(
            isinstance(f, _QuietTensorFlow) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietTensorFlow())


def quiet_backends() -> None:
    """Initialises JAX's backends (and so its device probes) under `native_stderr`."""
    with native_stderr():
        import jax

        jax.devices()
