"""`ktx train | eval | infer | params | analyze`: the gin edge of ktx (the only library module that
imports gin).

    ktx train --gin_file=runs/quickstart.gin --gin.MODEL_DIR="'/tmp/qs'"
    ktx eval  --gin_file=runs/quickstart.gin --gin_file=runs/eval.gin --gin.MODEL_DIR="'/tmp/qs'"
    python -m ktx infer --gin_file=... --gin.CHECKPOINT_STEP=200

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
names: `import ktx.train as train_script` then `train_script.train.model = %MODEL`. A gin
mistake is reported as a `GinConfigError` naming the file, line and binding, with close
names (difflib) for a misspelt parameter, configurable, module attribute or macro.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import logging
import os
import pathlib
import re
import sys
from collections.abc import Sequence

from ktx.run_dir import RunDir

__all__ = [
    "GinConfigError", "main", "parse_gin", "build_parser", "check_required_macros", "DEFAULT_GIN_DIR",
    "PATH_MACROS", "absolute_path", "gin_search_path",
]

DEFAULT_GIN_DIR = pathlib.Path(__file__).resolve().parent.parent / "gin"
COMMANDS = ("train", "eval", "infer", "params", "analyze", "import", "export", "precompile")
# Each command runs the first of its entry functions that the gin files configure
# (`ktx eval` decodes T5 runs with ktx.eval.evaluate and ranks recommendation runs with
# ktx.ranking_eval.evaluate).
_ENTRY = {
    "train": (("ktx.train", "train"),),
    "eval": (("ktx.eval", "evaluate"), ("ktx.ranking_eval", "evaluate")),
    "infer": (("ktx.infer", "infer"),),
}


class GinConfigError(ValueError):
    """A gin file or `--gin.` binding is wrong; the message says where and what."""


_HELP = {
    "train": "train a gin-configured model (MODEL_DIR, MIXTURE_OR_TASK_NAME, TRAIN_STEPS, ...)",
    "eval": "evaluate every (or the selected) checkpoint of MODEL_DIR offline",
    "infer": "decode a split with a checkpoint and write the predictions",
    "params": "count a gin-configured model's parameters from shapes",
    "analyze": "`gradients RUN_DIR` (per-task gradient magnitudes) or `attention`",
    "import": "SRC OUT: a ktx checkpoint directory from hf:DIR, t5x:DIR or camtl:DIR",
    "export": "SRC OUT: a run's checkpoint as hf:DIR or conditioning:FILE",
    "precompile": "compile the train step for a TPU topology; per-chip memory and FLOPs",
}
_GIN_COMMANDS = ("train", "eval", "infer", "params", "analyze", "precompile")


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
    commands["precompile"].add_argument(
        "--topology", default=None,
        help="a TPU topology as JAX names it (v4:4x4x4, v5e:16x16) or cpu")
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
                                    help="hf:DIR|t5x:DIR|camtl:DIR, then the output folder")
    e = commands["export"]
    e.add_argument("args", nargs="*", metavar="SRC OUT",
                   help="a run or checkpoint directory, then hf:DIR or conditioning:FILE")
    e.add_argument("--checkpoint", default=None, help="the step (default: the latest)")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """`build_parser().parse_args(argv)`, with every command's namespace holding every
    attribute (flags of other commands at their defaults), so the runners need not ask."""
    args = build_parser().parse_args(argv)
    for name, value in _DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


_DEFAULTS = dict(args=[], gin_file=[], gin_search_paths="", multihost=False, topology=None,
                 coordinator_address=None, num_processes=None, process_id=None, out=None,
                 checkpoint=None, task=None, out_dir=None, split="validation", max_examples=100)


_ANALYZE_USAGE = (
    "`ktx analyze gradients RUN_DIR [--out PNG]` or `ktx analyze attention --gin_file=... "
    "--checkpoint=STEP_OR_PATH --task=TASK --out_dir=DIR [--split=validation] [--max_examples=100]`"
)


def _analyze(args, bindings: Sequence[tuple[str, str]] = ()) -> int:
    """`ktx analyze gradients RUN_DIR [--out PNG]`: per-task gradient magnitudes over
    training (from the run's metrics.jsonl) as in the MetaBalance paper's figures.
    `ktx analyze attention ...`: see `_analyze_attention`."""
    if args.args == ["attention"]:
        return _analyze_attention(args, bindings)
    if len(args.args) != 2 or args.args[0] != "gradients":
        raise GinConfigError(f"ktx analyze {' '.join(args.args)}: accepted: {_ANALYZE_USAGE}")
    from ktx.optim import plot_gradient_magnitudes

    run_dir = pathlib.Path(absolute_path(args.args[1]))
    out = pathlib.Path(absolute_path(args.out)) if args.out else run_dir / "gradient_magnitudes.png"
    path = plot_gradient_magnitudes(RunDir(run_dir).metrics, out)
    print(f"wrote {path}")
    return 0


def _analyze_attention(args, bindings: Sequence[tuple[str, str]]) -> int:
    """`ktx analyze attention`: per-layer attention mass on the hyper-prompts and entropy
    over the tokens (`ktx.analysis.attention`) of the gin-configured MODEL restored from
    `--checkpoint` (a step of MODEL_DIR, or a run / checkpoints / step directory), on the
    first `--max_examples` rows of `--task`'s `--split` (the task's `task_id` is its
    index in MIXTURE_OR_TASK_NAME; TASK_FEATURE_LENGTHS as in training)."""
    for flag in ("checkpoint", "task", "out_dir"):
        if not getattr(args, flag):
            raise GinConfigError(f"ktx analyze attention: --{flag} is required; usage: {_ANALYZE_USAGE}")
    if args.max_examples < 1:
        raise GinConfigError(f"--max_examples={args.max_examples}; accepted: an int >= 1")
    args.out_dir = absolute_path(args.out_dir)
    import gin

    parse_gin(args.gin_file, bindings, [p for p in args.gin_search_paths.split(",") if p])
    if _query_macro("DATA_DIR"):
        os.environ["KTX_DATA_DIR"] = str(_query_macro("DATA_DIR"))
    values = {m: _query_macro(m) for m in ("MODEL", "MIXTURE_OR_TASK_NAME", "TASK_FEATURE_LENGTHS")}
    unset = [m for m, v in values.items() if v is None or repr(v) == "%gin.REQUIRED"]
    if unset:
        raise GinConfigError(f"ktx analyze attention needs the gin macros {unset} (include a model "
                             "file and runs/train.gin, set them with --gin.NAME=...)")
    import seqio

    import ktx.tasks  # noqa: F401  (registers the tasks)
    from ktx.analysis import attention
    from ktx.data import feature_converter as fc
    from ktx.data.pipeline import mixture_task_names

    names = mixture_task_names(values["MIXTURE_OR_TASK_NAME"])
    if args.task not in names:
        raise GinConfigError(f"--task={args.task!r} is not in {values['MIXTURE_OR_TASK_NAME']!r}; "
                             f"accepted: {list(names)}")
    try:
        configurable = gin.get_configurable("ktx_analyze_attention")
    except ValueError:
        configurable = gin.configurable("ktx_analyze_attention")(lambda model=gin.REQUIRED: model)
    gin.parse_config("ktx_analyze_attention.model = %MODEL")
    model = configurable()
    lengths = dict(values["TASK_FEATURE_LENGTHS"])
    ds = seqio.get_mixture_or_task(args.task).get_dataset(
        sequence_length=lengths, split=args.split, shuffle=False, num_epochs=1,
        trim_output_features=True)
    rows = fc.tokens_from_dataset(ds.take(args.max_examples).as_numpy_iterator(), lengths,
                                  source=f"{args.task}/{args.split}")
    features = fc.widen(fc.add_task_id(fc.convert_enc_dec(
        rows, lengths["inputs"], lengths["targets"]), names.index(args.task)))
    step, path = (int(args.checkpoint), _query_macro("MODEL_DIR")) if args.checkpoint.isdigit() \
        else (None, absolute_path(args.checkpoint))
    if path is None or repr(path) == "%gin.REQUIRED":
        raise GinConfigError(f"--checkpoint={args.checkpoint} is a step: set --gin.MODEL_DIR")
    batches = [{k: v[i:i + 32] for k, v in features.items()}
               for i in range(0, rows.num_examples, 32)]
    report = attention.analyze_checkpoint(model, path, batches, task=args.task,
                                          out_dir=args.out_dir, step=step)
    for side in ("encoder", "decoder"):
        for layer in report.get(side, []):
            print(f"{side} layer {layer['layer']}: prompt mass {layer['prompt_mass']:.4f}, "
                  f"token entropy {layer['token_entropy']:.4f}")
    print(f"wrote {pathlib.Path(args.out_dir) / f'attention_{args.task}.json'} and .png "
          f"({report['num_examples']} examples)")
    return 0


def _split_gin_flags(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Separates `--gin.NAME=VALUE` (or `--gin.NAME VALUE`) from the other flags."""
    rest, bindings = [], []
    argv = list(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--gin."):
            body = arg[len("--gin."):]
            if "=" in body:
                name, value = body.split("=", 1)
            elif i + 1 < len(argv):
                name, value = body, argv[i + 1]
                i += 1
            else:
                raise GinConfigError(f"flag {arg!r} has no value; write --gin.NAME=VALUE")
            if not re.fullmatch(r"[A-Za-z_][\w./]*", name):
                raise GinConfigError(f"flag {arg!r}: {name!r} is not a gin binding name")
            bindings.append((name, value))
        else:
            rest.append(arg)
        i += 1
    return rest, bindings


def _find_file(name: str, search_paths: Sequence[str]) -> pathlib.Path:
    p = pathlib.Path(name).expanduser()
    if p.is_absolute():
        if p.is_file():
            return p
        raise GinConfigError(f"--gin_file={name}: no such file")
    for base in search_paths:
        candidate = pathlib.Path(base) / p
        if candidate.is_file():
            return candidate.resolve()
    known = sorted(
        str(f.relative_to(DEFAULT_GIN_DIR)) for f in DEFAULT_GIN_DIR.rglob("*.gin")
    ) if DEFAULT_GIN_DIR.is_dir() else []
    close = difflib.get_close_matches(name, known, n=3)
    raise GinConfigError(
        f"--gin_file={name}: not found in the search paths {list(search_paths)}"
        + (f"; did you mean {close}?" if close else "")
    )


_LOCATION = re.compile(r'In (?:file "(?P<file>[^"]+)", line (?P<line>\d+)|bindings string line (?P<bline>\d+))')


def _import_aliases(files: Sequence[pathlib.Path]) -> dict[str, str]:
    """`{alias: module}` of the `import X as Y` lines of the files and their includes."""
    aliases: dict[str, str] = {}
    todo, seen = [pathlib.Path(f) for f in files], set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        try:
            text = f.read_text()
        except OSError:
            continue
        for mod, alias in re.findall(r"^\s*import\s+([\w.]+)(?:\s+as\s+(\w+))?", text, re.M):
            aliases[alias or mod] = mod
        for inc in re.findall(r"^\s*include\s+['\"]([^'\"]+)['\"]", text, re.M):
            for base in (f.parent, DEFAULT_GIN_DIR):
                if (base / inc).is_file():
                    todo.append(base / inc)
                    break
    return aliases


def _resolve_selector(selector: str, files: Sequence[pathlib.Path]):
    """The Python object a gin selector names, through the files' `import X as Y`
    lines (dynamic registration) or gin's registry (legacy registration)."""
    import gin

    aliases = _import_aliases(files)
    for alias, mod in sorted(aliases.items(), key=lambda kv: -len(kv[0])):
        if selector.startswith(alias + "."):
            obj = sys.modules.get(mod) or importlib.import_module(mod)
            for attr in selector[len(alias) + 1:].split("."):
                obj = getattr(obj, attr, None)
                if obj is None:
                    return None
            return obj
    try:
        return gin.get_configurable(selector)
    except ValueError:  # no match: no suggestion
        return None


def _close_names(message: str, files: Sequence[pathlib.Path] = ()) -> list[str]:
    """Close names for the unknown thing a gin error names."""

    m = re.search(r"No configurable matching '([^']+)'", message)
    if m:
        selector = m.group(1)
        module_alias, _, attr = selector.rpartition(".")
        candidates = []
        # Attributes of the module the gin files import under that alias.
        aliases = _import_aliases(files)
        if module_alias in aliases:
            try:
                mod = importlib.import_module(aliases[module_alias])
                candidates += [f"{module_alias}.{a}" for a in dir(mod) if not a.startswith("_")]
            except ImportError:
                pass
        # Attributes of the imported module (dynamic registration).
        for mod in list(sys.modules.values()):
            name = getattr(mod, "__name__", "")
            if module_alias and (name == module_alias or name.endswith("." + module_alias.split(".")[-1])):
                candidates += [f"{module_alias}.{a}" for a in dir(mod) if not a.startswith("_")]
        return difflib.get_close_matches(selector, candidates, n=3)
    m = re.search(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", message)
    if m:
        fn = _resolve_selector(m.group(1), files)
        if fn is None:
            return []
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return []
        return difflib.get_close_matches(m.group(2), params, n=3)
    m = re.search(r"'([^']+)' was not provided by an import statement", message)
    if m:
        return []
    m = re.search(r"<module '([^']+)' from [^>]*> has no attribute (\w+)", message)
    if m and m.group(1) in sys.modules:
        return difflib.get_close_matches(m.group(2), dir(sys.modules[m.group(1)]), n=3)
    m = re.search(r"has no attribute '([^']+)'", message)
    if m:
        mod = re.search(r"module '([^']+)' has no attribute", message)
        if mod and mod.group(1) in sys.modules:
            return difflib.get_close_matches(m.group(1), dir(sys.modules[mod.group(1)]), n=3)
    m = re.search(r"macro '?%?([A-Z_][A-Z0-9_]*)'?", message)
    if m:
        macros = [k for k in _known_macros()]
        return difflib.get_close_matches(m.group(1), macros, n=3)
    return []


_MACRO_LINE = re.compile(r"^([A-Z_][A-Z0-9_]*) = (.*)$", re.M)


def _macro_values() -> dict[str, str]:
    """`{macro: value as gin prints it}` of the current config (gin.config_str)."""
    import gin

    return dict(_MACRO_LINE.findall(gin.config_str()))


def _known_macros() -> list[str]:
    return list(_macro_values())


def _gin_error(e: Exception, files: Sequence[pathlib.Path], bindings: Sequence[tuple[str, str]]) -> GinConfigError:
    message = str(e)
    where = ""
    m = _LOCATION.search(message)
    if m and m.group("file"):
        where = f'{m.group("file")}:{m.group("line")}'
    elif m and m.group("bline"):
        index = int(m.group("bline")) - 1
        if 0 <= index < len(bindings):
            where = f"--gin.{bindings[index][0]}={bindings[index][1]}"
        else:
            where = "--gin bindings"
    binding = ""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if m:
        after = message[m.end():].strip().splitlines()
        if after:
            binding = after[0].strip()
    close = _close_names(message, files)
    head = lines[0] if lines else type(e).__name__
    text = f"gin error{' at ' + where if where else ''}: {type(e).__name__}: {head}"
    if binding:
        text += f"\n  binding: {binding}"
    if close:
        text += f"\n  close names: {', '.join(close)}"
    return GinConfigError(text)


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _set_gin_search_path(paths: Sequence[str]) -> None:
    """Makes gin resolve relative file names (`include 'runs/train.gin'`) in `paths`'
    order, then as gin itself does (working directory, Python packages).

    gin puts the working directory before every search path and gives no way to reorder
    them, so a user's output folder `runs/` would shadow ktx's `runs/*.gin` (and, when
    the working directory is on `sys.path`, break gin's package reader on the namespace
    package `runs`). The order is set here, at the only module that imports gin.
    """
    from gin import config as gin_config

    prefixes = list(dict.fromkeys(str(p) for p in paths)) + [""]
    gin_config._LOCATION_PREFIXES[:] = prefixes  # noqa: SLF001 - see the docstring


def gin_search_path(extra: Sequence[str] = ()) -> list[str]:
    """The gin search path: `extra` (`--gin_search_paths`), ktx's gin folder, then the
    working directory. ktx's own files come before the working directory, so nothing a
    run writes there (a `runs/` output folder) can shadow them."""
    return [str(pathlib.Path(p).expanduser().resolve()) for p in extra if p] + [
        str(DEFAULT_GIN_DIR), os.getcwd()]


# Macros that hold a path: a relative value is resolved against the working directory
# once, here, so every library function (orbax included) sees an absolute path.
PATH_MACROS = (
    "MODEL_DIR", "DATA_DIR", "INITIAL_CHECKPOINT_PATH", "CHECKPOINT_PATH", "INFER_OUTPUT_FILE",
    "USER_BEHAVIOR_CSV", "LEADERBOARD_DIR",
)
_URL = re.compile(r"^[A-Za-z][\w+.-]*://")
_SOURCE_PREFIX = re.compile(r"^(hf|t5x|camtl|conditioning):(.*)$", re.S)


def absolute_path(value: str) -> str:
    """`value` made absolute against the working directory (`~` expanded); URLs
    (`gs://...`) are kept as they are and `hf:`/`t5x:`/`camtl:`/`conditioning:` keep their prefix."""
    if _URL.match(value):
        return value
    m = _SOURCE_PREFIX.match(value)
    if m:
        return f"{m.group(1)}:{absolute_path(m.group(2))}"
    return os.path.abspath(os.path.expanduser(value))


def _absolutize_path_macros() -> None:
    import gin

    for name in PATH_MACROS:
        value = _query_macro(name)
        if isinstance(value, (str, os.PathLike)) and str(value):
            resolved = absolute_path(str(value))
            if resolved != str(value):
                gin.parse_config(f"{name} = {resolved!r}")


def parse_gin(
    gin_files: Sequence[str],
    bindings: Sequence[tuple[str, str]] = (),
    search_paths: Sequence[str] = (),
) -> list[pathlib.Path]:
    """Parses gin files then `NAME=VALUE` bindings (unknown names are errors) into a
    fresh config: bindings, macros and singletons of an earlier parse in this process
    (another `ktx.cli.main` call, a notebook cell) are cleared first.

    Files are looked up in `gin_search_path(search_paths)` order; path macros
    (`PATH_MACROS`) are made absolute against the working directory.

    Returns the resolved file paths. Raises GinConfigError naming file/line/binding.
    """
    import gin

    gin.clear_config()
    paths = gin_search_path(search_paths)
    _set_gin_search_path(paths)
    files = [_find_file(f, paths) for f in gin_files]
    errors = (
        ValueError, NameError, AttributeError, ImportError, TypeError, SyntaxError, KeyError, OSError,
    )
    # gin logs "Path not found" for every search path it tries before the one that has
    # an included file; a file missing everywhere still raises.
    quiet = _DropMessages("Path not found:")
    logging.getLogger().addFilter(quiet)
    try:
        gin.parse_config_files_and_bindings(
            [str(f) for f in files], None, finalize_config=False, skip_unknown=False
        )
    except errors as e:
        raise _gin_error(e, files, bindings) from e
    finally:
        logging.getLogger().removeFilter(quiet)
    # A misspelt macro flag would silently define a new macro: only known ones are allowed.
    macros = _known_macros()
    for name, value in bindings:
        if re.fullmatch(r"[A-Z][A-Z0-9_]*", name) and name not in macros:
            close = difflib.get_close_matches(name, macros, n=3)
            raise GinConfigError(
                f"gin error at --gin.{name}={value}: no gin file defines the macro {name}"
                + (f"\n  close names: {', '.join(close)}" if close else
                   f"\n  macros defined: {', '.join(sorted(macros))}")
            )
    # One binding at a time, so that an error names its flag.
    for i, (name, value) in enumerate(bindings):
        try:
            gin.parse_config(f"{name} = {value}")
        except SyntaxError as e:
            raise GinConfigError(
                f"gin error at --gin.{name}={value}: {value!r} is not a gin value; accepted: "
                f"a Python literal (a string needs quotes: --gin.{name}=\"'{value}'\"), "
                f"@configurable() or %MACRO"
            ) from e
        except errors as e:
            raise _gin_error(e, files, [(name, value)]) from e
    _absolutize_path_macros()
    return files


def _declarations(files: Sequence[pathlib.Path], search: Sequence[str]) -> dict[str, str]:
    """`{macro: "file:line"}` of every `NAME = %gin.REQUIRED` in the files and their
    includes."""
    out: dict[str, str] = {}
    seen: set[pathlib.Path] = set()
    todo = list(files)
    while todo:
        f = todo.pop(0)
        if f in seen or not f.is_file():
            continue
        seen.add(f)
        for lineno, line in enumerate(f.read_text().splitlines(), 1):
            m = re.match(r"\s*([A-Z_][A-Z0-9_]*)\s*=\s*%gin\.REQUIRED\b", line)
            if m:
                out[m.group(1)] = f"{f}:{lineno}"
            inc = re.match(r"\s*include\s+['\"]([^'\"]+)['\"]", line)
            if inc:
                for base in [f.parent, *map(pathlib.Path, search)]:
                    if (base / inc.group(1)).is_file():
                        todo.append((base / inc.group(1)).resolve())
                        break
    return out


def check_required_macros(files: Sequence[pathlib.Path], search: Sequence[str] = ()) -> None:
    """Raises GinConfigError naming every macro still bound to `%gin.REQUIRED`, the
    file and line declaring it, and the flag that sets it."""
    unset = [name for name, value in _macro_values().items() if value.strip() == "%gin.REQUIRED"]
    if not unset:
        return
    where = _declarations(files, [*search, str(DEFAULT_GIN_DIR)])
    lines = [f"  {name} (declared at {where.get(name, 'a gin file')}): set with --gin.{name}=..."
             for name in sorted(unset)]
    raise GinConfigError("missing required gin macros:\n" + "\n".join(lines))


def _query_macro(name: str, default=None):
    import gin

    try:
        return gin.query_parameter(f"%{name}")
    except (ValueError, KeyError):
        return default


def _call_entry(command: str, files, bindings, extra_kwargs=None):
    import gin

    candidates = []  # (has bindings in this config, configurable)
    for module_name, fn_name in _ENTRY[command]:
        fn = getattr(importlib.import_module(module_name), fn_name)
        try:
            configurable = gin.get_configurable(fn)
        except ValueError:  # not registered by any gin file
            continue
        bound = bool(gin.get_bindings(fn, resolve_references=False))
        candidates.append((bound, configurable))
    # A function registered by an earlier parse in this process but not bound now loses
    # to one the current files bind.
    configured = max(candidates, key=lambda c: c[0])[1] if candidates else None
    if configured is None:
        names = " or ".join(f"{m}.{f}" for m, f in _ENTRY[command])
        raise GinConfigError(
            f"no gin file configures {names}: include runs/{command}.gin (or "
            f"runs/recsys_{command}.gin for a recommendation run)"
        )
    check_required_macros(files)
    try:
        return configured(**(extra_kwargs or {}))
    except Exception as e:
        message = str(e)
        if "Required bindings" in message:
            raise GinConfigError(f"missing required gin binding for `ktx {command}`: {message}") from e
        raise


def _write_config(model_dir) -> None:
    import gin

    if model_dir is None:
        return
    import jax

    if jax.process_index() != 0:
        return
    RunDir(model_dir).makedirs().config.write_text(gin.operative_config_str())


def _resolve_reference(value):
    """A gin binding's value: a `@fn()` reference called, `%MACRO` resolved."""
    import gin

    if isinstance(value, gin.config.ConfigurableReference):
        return value.scoped_configurable_fn() if value.evaluate else value.scoped_configurable_fn
    return value


def _precompile_command(args) -> int:
    """`ktx precompile --topology=NAME`: the train step of the gin-configured run
    (`runs/train.gin` + model + conditioning + optim files) compiled ahead of time for a
    TPU topology (`ktx.precompile`); exit 3 when it does not fit the chips' HBM."""
    import gin
    import ktx.train
    from ktx import precompile as precompile_lib

    topology = args.topology or _query_macro("TOPOLOGY")
    if not topology:
        raise GinConfigError("ktx precompile needs --topology=NAME (e.g. v4:4x4x4, v5e:16x16) or a "
                             "gin file binding TOPOLOGY (gin/pods/*.gin)")
    try:
        bound = gin.get_bindings(ktx.train.train, resolve_references=False)
    except ValueError:
        bound = {}
    if "model" not in bound:
        raise GinConfigError("ktx precompile compiles the train step of a run: include runs/train.gin "
                             "and a model file (gin/models/*.gin)")
    lengths = _query_macro("TASK_FEATURE_LENGTHS")
    batch_size = _query_macro("BATCH_SIZE")
    for name, value in (("TASK_FEATURE_LENGTHS", lengths), ("BATCH_SIZE", batch_size)):
        if value is None or repr(value) == "%gin.REQUIRED":
            raise GinConfigError(f"ktx precompile needs --gin.{name}=...")
    kwargs = {k: _resolve_reference(bound[k]) for k in (
        "model", "optimizer", "balancer", "num_partitions", "num_microbatches", "grad_method",
        "shared", "additional_rules", "target_task") if k in bound}
    try:
        report = precompile_lib.precompile(
            topology=topology, batch_size=int(batch_size), task_feature_lengths=dict(lengths),
            **kwargs)
    except precompile_lib.DoesNotFitError as e:
        print(f"ktx precompile: {e}", file=sys.stderr)
        return 3
    print(report.format())
    return 3 if report.fits is False else 0


def _params_command(files, bindings) -> None:
    import gin
    from ktx import params as params_lib

    ref = _query_macro("MODEL")
    if ref is None:
        raise GinConfigError("`ktx params` needs a gin file binding the MODEL macro (gin/models/*.gin)")

    @gin.configurable("ktx_params_command")
    def _cmd(model=gin.REQUIRED):
        return model

    gin.parse_config("ktx_params_command.model = %MODEL")
    model = _cmd()
    report = params_lib.count_parameters(model)
    print(params_lib.format_report(report, name=type(model).__name__))


def _check_run_macros(command: str) -> None:
    """Edge checks whose library error would name an inner argument instead of the flag."""
    steps = _query_macro("TRAIN_STEPS")
    if command == "train" and steps is not None and repr(steps) != "%gin.REQUIRED":
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise GinConfigError(f"TRAIN_STEPS={steps!r}; accepted: an integer >= 1 "
                                 "(--gin.TRAIN_STEPS=1000)")
    name = _query_macro("MIXTURE_OR_TASK_NAME")
    if isinstance(name, str):
        import seqio

        import ktx.tasks  # noqa: F401  (registers the tasks)

        known = sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))
        if name not in known:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
            raise GinConfigError(
                f"MIXTURE_OR_TASK_NAME={name!r} is not a registered SeqIO task or mixture"
                + (f"; close names: {', '.join(close)}" if close else "")
                + " (register it in a module the gin file imports: docs/adding_a_task.md)")


def _first_line(e: BaseException) -> str:
    """The user-facing part of an exception: gin's "In call to configurable" trailer
    and chained context dropped."""
    text = str(e).split("\n  In call to configurable")[0].strip()
    return text or type(e).__name__


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
    print(f"ktx {command}: {kind}{_first_line(e)}{where}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
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
    except Exception as e:  # noqa: BLE001 - the CLI edge: one line, traceback to a file
        if args.debug:
            raise
        if args.command in ("analyze", "import", "export") and isinstance(
            e, (FileNotFoundError, ValueError)
        ):
            print(f"ktx: {_first_line(e)}", file=sys.stderr)  # a wrong argument or input
            return 2
        _report_failure(e, args.command)
        return 1


def _convert_command(args) -> int:
    """`ktx import hf:DIR|t5x:DIR OUT`: a ktx checkpoint directory (orbax step 0 +
    `model.gin`) from a Hugging Face or T5X checkpoint. `ktx export SRC hf:OUT
    [--checkpoint STEP]`: a ktx run / checkpoint directory as a Hugging Face T5
    directory; the model's T5Config comes from the run's `config.gin` when there is one
    (else what `ktx import` recorded, else the shapes). See ktx.convert and
    docs/checkpoints.md."""
    from ktx import convert

    usage = {"import": "ktx import hf:DIR|t5x:DIR|camtl:DIR OUT_DIR",
             "export": "ktx export RUN_OR_CHECKPOINT_DIR hf:OUT_DIR|conditioning:FILE "
                       "[--checkpoint STEP]"}
    if len(args.args) != 2:
        raise ValueError(f"ktx {args.command} takes 2 arguments, got {args.args}; "
                         f"usage: {usage[args.command]}")
    src, out = (absolute_path(a) for a in args.args)
    if args.command == "import":
        path = convert.import_checkpoint(src, out)
        print(f"wrote {path} (model.gin, checkpoints/0); start a run from it with "
              f"--gin_file={path}/model.gin --gin.INITIAL_CHECKPOINT_PATH=\"'{path}'\"")
        return 0
    if args.checkpoint is not None and not args.checkpoint.isdigit():
        raise ValueError(f"--checkpoint={args.checkpoint!r}; accepted: a step number")
    step = int(args.checkpoint) if args.checkpoint is not None else None
    if out.startswith("conditioning:"):  # the task-conditioned parameters alone
        from ktx.convert.conditioning import export_conditioning

        path = export_conditioning(src, out[len("conditioning:"):], step=step)
        print(f"wrote {path} (task-conditioned parameters; load them on a backbone with "
              "ktx.convert.conditioning.load_conditioning)")
        return 0
    config = None
    src_dir = pathlib.Path(src)
    run = RunDir.containing(src_dir)
    run_gin = None if run is None else run.config
    if run_gin is not None:  # the run's operative config: the model it trained
        import gin

        parse_gin([str(run_gin)])
        try:
            configurable = gin.get_configurable("ktx_export_command")
        except ValueError:
            configurable = gin.configurable("ktx_export_command")(lambda model=gin.REQUIRED: model)
        gin.parse_config("ktx_export_command.model = %MODEL")
        config = configurable().config
    path = convert.export_checkpoint(src, out, step=step, config=config)
    print(f"wrote {path}" + (f" (model from {run_gin})" if run_gin else ""))
    return 0


def _run(args, bindings) -> int:
    if args.command == "analyze":
        return _analyze(args, bindings)
    if args.command in ("import", "export"):
        return _convert_command(args)
    if args.multihost:
        import jax

        # On TPU pods, SLURM and other managed clusters JAX finds the coordinator itself;
        # elsewhere (launch/multiprocess.sh) the three flags name it.
        jax.distributed.initialize(
            coordinator_address=args.coordinator_address,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    files = parse_gin(args.gin_file, bindings, [p for p in args.gin_search_paths.split(",") if p])
    data_dir = _query_macro("DATA_DIR")
    if data_dir:
        os.environ["KTX_DATA_DIR"] = str(data_dir)
    from ktx.data import files as data_files

    # ON_BAD_ROW (runs/*.gin): "raise" or "skip" for every file this command reads;
    # None: $KTX_ON_BAD_ROW, else "raise".
    data_files.set_on_bad_row(_query_macro("ON_BAD_ROW"))
    if args.command == "params":
        _params_command(files, bindings)
        return 0
    if args.command == "precompile":
        return _precompile_command(args)
    _check_run_macros(args.command)
    model_dir = _query_macro("MODEL_DIR")
    if args.command == "train":
        _call_entry(
            "train", files, bindings,
            {"started_callback": lambda: _write_config(model_dir)},
        )
        _write_config(model_dir)
    elif args.command == "eval":
        from ktx.eval import format_table

        summary = _call_entry("eval", files, bindings)
        _write_config(RunDir(model_dir).eval if model_dir else None)
        print(format_table(summary))
    else:
        _call_entry("infer", files, bindings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
