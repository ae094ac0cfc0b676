"""`ktx train | eval | infer | params | analyze | cache`: the gin edge of ktx (the only library module that
imports gin).

    ktx train --gin_file=runs/quickstart.gin --gin.MODEL_DIR="'/tmp/qs'"
    ktx eval  --gin_file=runs/quickstart.gin --gin_file=runs/eval.gin --gin.MODEL_DIR="'/tmp/qs'"
    python -m ktx infer --gin_file=... --gin.CHECKPOINT_STEP=200
    ktx cache --tasks=glue_rte_v002 --splits=train,validation --cache_dir=/data/seqio_cache

Flags: `--gin_file` (repeatable; later files override earlier ones), `--gin.NAME=VALUE`
(a binding, applied after every file: `--gin.TRAIN_STEPS=100`,
`--gin.train_script.train.log_period=10`), `--gin_search_paths` (comma-separated;
searched first, then ktx's own `gin/` folder, then the working directory: nothing a run
writes into the working directory can shadow ktx's gin files), `--multihost` (calls
`jax.distributed.initialize()` before anything else; off a managed cluster,
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I` say where), `--debug`
(a run-time error raises with its traceback instead of the one `ktx: ...` line).

Paths given in path macros (`PATH_MACROS`: MODEL_DIR, DATA_DIR, INITIAL_CHECKPOINT_PATH,
...) and flags are relative to the working directory; they are made absolute here, once.

Gin files use dynamic registration (`from __gin__ import dynamic_registration`) and T5X's
names: `import ktx.runs.train as train_script` then `train_script.train.model = %MODEL`. A gin
mistake is reported as a `GinConfigError` naming the file, line and binding, with close
names (difflib) for a misspelt parameter, configurable, module attribute or macro.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

from ktx.cli.commands import (
    _analyze,
    _cache_command,
    _check_precompile_flags,
    _check_run_macros,
    _convert_command,
    _params_command,
    _precompile_command,
)
from ktx.cli.gin_config import (
    DEFAULT_GIN_DIR,
    PATH_MACROS,
    GinConfigError,
    _call_entry,
    _first_line,
    _query_macro,
    _split_gin_flags,
    _write_config,
    absolute_path,
    check_required_macros,
    gin_search_path,
    macro_names,
    parse_gin,
)
from ktx.cli import quiet
from ktx.cli import study as study_cli
from ktx.runs.preemption import EXIT_PREEMPTED, Preempted
from ktx.runs.run_dir import RunDir

__all__ = [
    "GinConfigError", "main", "parse_gin", "build_parser", "check_required_macros", "DEFAULT_GIN_DIR",
    "PATH_MACROS", "absolute_path", "gin_search_path",
]


COMMANDS = ("train", "eval", "infer", "params", "analyze", "import", "export", "precompile", "cache")


_HELP = {
    "train": "train a gin-configured model (MODEL_DIR, MIXTURE_OR_TASK_NAME, TRAIN_STEPS, ...)",
    "eval": "evaluate every (or the selected) checkpoint of MODEL_DIR offline",
    "infer": "decode a split with a checkpoint and write the predictions",
    "params": "count a gin-configured model's parameters from shapes",
    "analyze": "`gradients RUN_DIR` (per-task gradient magnitudes) or `attention`",
    "import": "SRC OUT: a ktx checkpoint directory from hf:DIR, t5x:DIR, camtl:DIR or pals:DIR",
    "export": "SRC OUT: a run's checkpoint as hf:DIR, t5x:DIR or conditioning:FILE",
    "precompile": "compile the train step for a TPU topology; per-chip memory and FLOPs",
    "cache": "SeqIO's offline cache of tasks (Apache Beam): training reads it with use_cached",
}


_GIN_COMMANDS = ("train", "eval", "infer", "params", "analyze", "precompile", "cache")


def build_parser() -> argparse.ArgumentParser:
    """`ktx COMMAND [flags]`: one sub-parser per command with only its own flags
    (`ktx eval --help`); `--gin.NAME=VALUE` bindings are taken out before parsing."""
    parser = argparse.ArgumentParser(prog="ktx", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {}
    for name in COMMANDS:
        commands[name] = c = sub.add_parser(name, help=_HELP[name], description=_HELP[name])
        c.add_argument("--debug", action="store_true",
                       help="let a run-time error raise with its traceback")
        if name in _GIN_COMMANDS:
            c.add_argument("--gin_file", action="append", default=[],
                           help="gin file (repeatable; later files override)")
            c.add_argument("--gin_search_paths", default="", help="comma-separated folders")
        if name in ("train", "eval", "infer"):
            c.add_argument("--multihost", action="store_true", help="jax.distributed.initialize()")
            c.add_argument("--coordinator_address", default=None,
                           help="--multihost off a managed cluster: host:port of process 0")
            c.add_argument("--num_processes", type=int, default=None,
                           help="with --coordinator_address")
            c.add_argument("--process_id", type=int, default=None,
                           help="with --coordinator_address")
            c.add_argument("--heartbeat_timeout", type=int, default=100,
                           help="--multihost: seconds without a heartbeat after which a process "
                                "counts as dead and every other process exits non-zero "
                                "(jax.distributed's heartbeat_timeout_seconds)")
    commands["precompile"].add_argument(
        "--topology", default=None,
        help="a TPU topology as JAX names it (v4:4x4x4, v5e:16x16) or cpu")
    commands["precompile"].add_argument(
        "--timeout", type=float, default=None,
        help="seconds the compile (its child process: tracing, lowering, XLA) may take; "
             "over it, or if the compiler crashes, exit 4 (default: no limit)")
    study_cli.add_parser(sub)  # `ktx study run|report` (ktx.cli.study)
    c = commands["cache"]
    c.add_argument("--tasks", default="", help="tasks or mixtures to cache, comma-separated")
    c.add_argument("--cache_dir", default=None, help="the cache root (local or gs://)")
    c.add_argument("--splits", default="train,validation",
                   help="splits to cache, comma-separated; every task must have each")
    c.add_argument("--pipeline_options", default="--runner=DirectRunner",
                   help="Beam pipeline flags in one string (docs/data.md: Dataflow)")
    c.add_argument("--min_shards", type=int, default=64,
                   help="output files per split: max(input shards, min_shards)")
    c.add_argument("--overwrite", action="store_true",
                   help="remove a task's existing cache in --cache_dir and rebuild it")
    a = commands["analyze"]
    a.add_argument("args", nargs="+", help="`gradients RUN_DIR` or `attention`")
    a.add_argument("--out", default=None, help="gradients: output PNG")
    a.add_argument("--checkpoint", default=None,
                   help="attention: a step of MODEL_DIR, or a checkpoint path")
    a.add_argument("--task", default=None, help="attention: a task of the mixture")
    a.add_argument("--out_dir", default=None, help="attention: JSON + PNG folder")
    a.add_argument("--split", default="validation", help="attention: split")
    a.add_argument("--max_examples", type=int, default=100,
                   help="attention: examples averaged (He et al., 2022: 100)")
    commands["import"].add_argument("args", nargs="*", metavar="SRC OUT",
                                    help="hf:DIR|t5x:DIR|camtl:DIR|pals:DIR, then the output folder")
    e = commands["export"]
    e.add_argument("args", nargs="*", metavar="SRC OUT",
                   help="a run or checkpoint directory, then hf:DIR, t5x:DIR or conditioning:FILE")
    e.add_argument("--checkpoint", default=None, help="the step (default: the latest)")
    e.add_argument("--backbone_only", action="store_true",
                   help="leave out (and name) the parameters the target format has no place "
                        "for: task heads, task conditioning")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """`build_parser().parse_args(argv)`, with every command's namespace holding every
    attribute (flags of other commands at their defaults), so the runners need not ask."""
    args = build_parser().parse_args(argv)
    for name, value in _DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


_DEFAULTS = dict(args=[], gin_file=[], gin_search_paths="", multihost=False, topology=None, timeout=None,
                 coordinator_address=None, num_processes=None, process_id=None, heartbeat_timeout=100,
                 out=None,
                 checkpoint=None, backbone_only=False, task=None, out_dir=None, split="validation", max_examples=100,
                 tasks="", cache_dir=None, splits="train,validation", pipeline_options="--runner=DirectRunner",
                 min_shards=64, overwrite=False)


def _report_failure(e: BaseException, command: str) -> None:
    """One `ktx: ...` line on stderr; the traceback goes to MODEL_DIR/ktx_error.log
    (or a temporary file) and the line says where."""
    import tempfile
    import traceback

    trace = "".join(traceback.format_exception(e))
    model_dir = _query_macro("MODEL_DIR") if command != "analyze" else None
    log = None
    for folder in ([model_dir] if isinstance(model_dir, str) else []) + [tempfile.gettempdir()]:
        try:
            pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
            log = RunDir(folder).error_log
            log.write_text(trace)
            break
        except OSError:
            log = None
    kind = "" if isinstance(e, (ValueError, FileNotFoundError, TypeError)) else f"{type(e).__name__}: "
    where = f" (traceback in {log}; --debug shows it here)" if log else " (--debug shows the traceback)"
    line = f"{kind}{_first_line(e)}"
    if command != "analyze":
        line = macro_names(line)  # the macro a user sets, not the parameter it feeds
    print(f"ktx {command}: {line}{where}{_fix_for(e, command)}", file=sys.stderr)


def _fix_for(e: BaseException, command: str) -> str:
    """The fix the line names for a failure whose cause is known ('' otherwise). A full
    disk reaches here as an OSError or, from orbax's tensorstore writer, as a ValueError
    quoting the OS's message."""
    import errno

    if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
        again = ("; then give the same command again: it resumes from the latest complete "
                 "checkpoint" if command == "train" else "")
        return (". Fix: free disk space where MODEL_DIR lies (a run keeps every checkpoint "
                f"unless `train_script.train.keep_checkpoints = N` is bound){again}")
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    quiet.start()  # before anything imports TensorFlow (ktx.cli.quiet)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rest, bindings = _split_gin_flags(argv)
    except GinConfigError as e:
        print(f"ktx: {e}", file=sys.stderr)
        return 2
    args = parse_args(rest)
    try:
        return _run(args, bindings)
    except GinConfigError as e:
        print(f"ktx: {e}", file=sys.stderr)
        return 2
    except Preempted as e:  # SIGTERM / SIGINT: checkpoint saved; the launchers resume
        print(f"ktx {args.command}: {_first_line(e)}", file=sys.stderr)
        return EXIT_PREEMPTED
    except Exception as e:  # noqa: BLE001 - the CLI edge: one line, traceback to a file
        if args.debug:
            raise
        if args.command in ("analyze", "import", "export", "cache") and isinstance(
            e, (FileNotFoundError, ValueError)
        ):
            print(f"ktx: {_first_line(e)}", file=sys.stderr)  # a wrong argument or input
            return 2
        _report_failure(e, args.command)
        return 1


def _run(args, bindings) -> int:
    if args.command == "study":
        return study_cli.study_command(args, bindings)
    if args.command == "analyze":
        return _analyze(args, bindings)
    if args.command in ("import", "export"):
        quiet.quiet_backends()  # libtpu's and CUDA's probes on a machine without them
        return _convert_command(args)
    if args.command == "precompile":
        _check_precompile_flags(args)  # before the gin files import the data pipeline
    if args.multihost:
        import jax

        if args.heartbeat_timeout < 1:
            raise ValueError(f"--heartbeat_timeout={args.heartbeat_timeout}; accepted: seconds >= 1")

        # On TPU pods, SLURM and other managed clusters JAX finds the coordinator itself;
        # elsewhere (launch/multiprocess.sh) the three flags name it.
        jax.distributed.initialize(
            coordinator_address=args.coordinator_address,
            num_processes=args.num_processes,
            process_id=args.process_id,
            heartbeat_timeout_seconds=args.heartbeat_timeout,
        )
    if args.command != "cache":
        quiet.quiet_backends()  # libtpu's and CUDA's probes on a machine without them
    files = parse_gin(args.gin_file, bindings, [p for p in args.gin_search_paths.split(",") if p])
    from ktx.data import files as data_files

    # DATA_DIR (runs/*.gin): the data folder of every loader; None: $KTX_DATA_DIR.
    data_files.set_data_dir(_query_macro("DATA_DIR") or None)
    # ON_BAD_ROW (runs/*.gin): "raise" or "skip" for every file this command reads;
    # None: $KTX_ON_BAD_ROW, else "raise".
    data_files.set_on_bad_row(_query_macro("ON_BAD_ROW"))
    if args.command == "params":
        _params_command(files, bindings)
        return 0
    if args.command == "precompile":
        return _precompile_command(args, bindings)
    if args.command == "cache":
        return _cache_command(args)
    _check_run_macros(args.command)
    _configure_host_malloc()
    model_dir = _query_macro("MODEL_DIR")
    if args.command == "train":
        _call_entry(
            "train", files, bindings,
            {"started_callback": lambda: _write_config(model_dir)},
        )
        _write_config(model_dir)
    elif args.command == "eval":
        from ktx.runs.eval import format_table

        summary = _call_entry("eval", files, bindings)
        _write_config(RunDir(model_dir).eval if model_dir else None)
        print(format_table(summary))
    else:
        _call_entry("infer", files, bindings)
    return 0


def _configure_host_malloc() -> None:
    """On the CPU backend, glibc keeps the memory XLA frees for the next step
    (`ktx.training.host_malloc`; `$KTX_HOST_MALLOC`: keep, single_arena or system)."""
    import logging

    from ktx.training import host_malloc

    mode = host_malloc.configure_on_cpu()
    if mode is not None:
        logging.getLogger("ktx").info("host malloc: %s (%s)", mode, host_malloc.ENV)


if __name__ == "__main__":
    sys.exit(main())
