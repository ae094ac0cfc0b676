"""A quiet, quick start: what a `ktx` command prints is ktx's (no TensorFlow, absl, CUDA or
libtpu line), commands without a data pipeline do not import TensorFlow, TensorFlow sees
no GPU, a user's TF_CPP_MIN_LOG_LEVEL wins, and ktx's warnings print as `ktx: ...`."""

import logging
import os
import pathlib
import subprocess
import sys

import pytest

from ktx.cli import quiet

ROOT = pathlib.Path(__file__).resolve().parents[1]
KTX = [sys.executable, "-m", "ktx"]
# Lines that are not ktx's: native log lines and what TensorFlow, absl, CUDA and libtpu
# print around them.
FOREIGN = ("tensorflow", "absl", "cuda", "cuinit", "onednn", "libtpu", "tpu_", "initgoogle",
           "source location trace")


def _run(args, env=None):
    """`args` in a fresh process whose environment has no TF_CPP_MIN_LOG_LEVEL but `env`'s
    (this process may have set one: ktx.cli.main runs in-process in other tests)."""
    base = {k: v for k, v in os.environ.items()
            if k != quiet.TF_LEVEL_ENV and not k.startswith("_KTX_")}
    return subprocess.run(args, cwd=ROOT, env={**base, **(env or {})}, capture_output=True,
                          text=True, timeout=300)


def _foreign(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if quiet._ABSL_LINE.match(line) or any(w in line.lower() for w in FOREIGN)]  # noqa: SLF001


def test_readme_tour_help_and_params_print_only_ktx_lines():
    """`ktx --help` and the README tour's `ktx params` line: stdout is ktx's, stderr is empty,
    and `ktx params` (shapes only) never imports TensorFlow."""
    help_ = _run(KTX + ["--help"])
    assert help_.returncode == 0 and help_.stderr == "" and not _foreign(help_.stdout)
    code = ("import sys; from ktx.cli import main; rc = main(sys.argv[1:]); "
            "print('tensorflow imported:', 'tensorflow' in sys.modules); sys.exit(rc)")
    params = _run([sys.executable, "-c", code, "params", "--gin_file=models/t5_1_1_base.gin",
                   "--gin_file=conditioning/hyperprompt_global.gin", "--gin.NUM_TASKS=8"])
    assert params.returncode == 0, params.stderr
    assert params.stderr == ""
    assert not _foreign(params.stdout.replace("tensorflow imported:", ""))
    assert "tensorflow imported: False" in params.stdout and "total:" in params.stdout


@pytest.mark.parametrize("command", [["import", "hf:/nonexistent"], ["precompile", "--timeout=0"]])
def test_argument_checks_do_not_import_tensorflow(command):
    code = ("import sys; from ktx.cli import main; rc = main(sys.argv[1:]); "
            "print('tensorflow imported:', 'tensorflow' in sys.modules); sys.exit(rc)")
    out = _run([sys.executable, "-c", code, *command])
    assert out.returncode == 2 and out.stderr.startswith("ktx: ") and len(out.stderr.splitlines()) == 1
    assert "tensorflow imported: False" in out.stdout


def test_tensorflow_import_is_quiet_and_sees_no_gpu():
    """The first `import tensorflow` after `quiet.start()` prints nothing (TensorFlow logs
    on this machine while loading, whatever TF_CPP_MIN_LOG_LEVEL says), leaves Python's own
    stderr lines, and hides the GPUs from TensorFlow; a user's level wins."""
    code = ("import os, sys; from ktx.cli import quiet; quiet.start(); "
            "print('python line', file=sys.stderr, flush=True); import tensorflow as tf; "
            "print(os.environ['TF_CPP_MIN_LOG_LEVEL'], tf.config.get_visible_devices('GPU'))")
    out = _run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2 []"
    assert out.stderr == "python line\n"
    user = _run([sys.executable, "-c", code], env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    assert user.returncode == 0 and user.stdout.strip() == "0 []"
    # What TensorFlow prints at the user's level 0 is shown (if it prints anything here).
    plain = _run([sys.executable, "-c", "import tensorflow"], env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    shown = lambda text: {line.split("] ", 1)[-1] for line in text.splitlines()}  # noqa: E731
    assert shown(plain.stderr) <= shown(user.stderr)


@pytest.mark.parametrize("line,level,held", [
    ("I0000 00:00:1796189708.809523    6032 port.cc:153] oneDNN custom operations are on.", 3, True),
    ("I0000 00:00:1796189708.809523    6032 port.cc:153] oneDNN custom operations are on.", 0, False),
    ("E0000 00:00:1796190017.593457   16914 cuda_platform.cc:52] failed call to cuInit", 3, True),
    ("E0000 00:00:1796190017.593457   16914 cuda_platform.cc:52] failed call to cuInit", 2, False),
    ("F1202 05:35:05.123456 12345 x.cc:1] fatal", 3, False),
    ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR", 1, True),
    ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR", 0, False),
    ("learning/45eac/tfrc/runtime/libtpu_init_utils.cc:327", 3, True),
    ("Traceback (most recent call last):", 3, False),
    ("ktx: a warning", 3, False),
])
def test_held_back_lines(line, level, held):
    assert quiet.held_back(line, level) is held


def test_a_line_written_just_before_the_process_dies_in_the_capture_is_shown():
    """A native library that prints an error and exits inside the capture (libtpu on a
    flag it does not know in LIBTPU_INIT_ARGS, during JAX's backend initialisation): its
    line reaches stderr, the native log lines around it stay held back."""
    code = ("import os; from ktx.cli import quiet\n"
            "with quiet.native_stderr():\n"
            "    os.write(2, b'W0000 00:00:1.5 1 x.cc:1] a probe\\n')\n"
            "    os.write(2, b\"ERROR: Unknown command line flag 'xla_dump_to'\\n\")\n"
            "    os._exit(1)\n")
    out = _run([sys.executable, "-c", code])
    assert out.returncode == 1
    assert out.stderr == "ERROR: Unknown command line flag 'xla_dump_to'\n"


def test_native_stderr_writes_back_all_but_native_log_lines(capfd):
    with quiet.native_stderr():
        os.write(2, b"I0000 00:00:1.5 1 port.cc:153] oneDNN custom operations are on.\n")
        os.write(2, b"a line of the user's\n")
    assert capfd.readouterr().err == "a line of the user's\n"


def test_ktx_warnings_print_with_the_ktx_prefix(capsys):
    quiet.start()
    logging.getLogger("ktx.data.files").warning("skipping bad row %s", "f.txt:3: bad")
    assert capsys.readouterr().err == "ktx: skipping bad row f.txt:3: bad\n"
