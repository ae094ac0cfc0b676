"""The gin edge of the command line: `--gin.` flags, gin files and their search path,
path macros made absolute, gin errors that name the file, line and binding (with close
names), and the entry functions a command calls (`ktx.runs.train.train`, ...).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import os
import pathlib
import re
import sys
from collections.abc import Sequence

from ktx.runs.run_dir import RunDir

DEFAULT_GIN_DIR = pathlib.Path(__file__).resolve().parents[2] / "gin"


class GinConfigError(ValueError):
    """A gin file or `--gin.` binding is wrong; the message says where and what."""


# Each command runs the first of its entry functions that the gin files configure
# (`ktx eval` decodes T5 runs with ktx.runs.eval.evaluate and ranks recommendation runs with
# ktx.runs.rank_eval.evaluate).
_ENTRY = {
    "train": (("ktx.runs.train", "train"),),
    "eval": (("ktx.runs.eval", "evaluate"), ("ktx.runs.rank_eval", "evaluate")),
    "infer": (("ktx.runs.infer", "infer"),),
}


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
    hint = _alias_hint(message, files, binding.replace(" = ", "=", 1))
    close = [] if hint else _close_names(message, files)
    head = lines[0] if lines else type(e).__name__
    text = f"gin error{' at ' + where if where else ''}: {type(e).__name__}: {head}"
    if binding:
        text += f"\n  binding: {binding}"
    if hint:
        text += f"\n  {hint}"
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


# Macros every command reads itself (ktx.cli: the data folder and the bad-row policy of every
# reader), accepted as flags whether or not the run's gin files define them.
CLI_MACROS = ("DATA_DIR", "ON_BAD_ROW")


# Macros that hold a path: a relative value is resolved against the working directory
# once, here, so every library function (orbax included) sees an absolute path.
PATH_MACROS = (
    "MODEL_DIR", "DATA_DIR", "INITIAL_CHECKPOINT_PATH", "CHECKPOINT_PATH", "INFER_OUTPUT_FILE",
    "DATA_PATH", "TEST_FILE", "LEADERBOARD_DIR",
)


_URL = re.compile(r"^[A-Za-z][\w+.-]*://")


_SOURCE_PREFIX = re.compile(r"^(hf|t5x|camtl|pals|conditioning):(.*)$", re.S)


def absolute_path(value: str) -> str:
    """`value` made absolute against the working directory (`~` expanded); URLs
    (`gs://...`) are kept as they are and `hf:`/`t5x:`/`camtl:`/`pals:`/`conditioning:` keep their prefix."""
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
    # A misspelt macro flag would silently define a new macro: only known ones are allowed
    # (and those the command line itself reads, whatever the run file).
    macros = _known_macros()
    for name, value in bindings:
        if re.fullmatch(r"[A-Z][A-Z0-9_]*", name) and name not in macros and name not in CLI_MACROS:
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
                + _accepted_like(name, value)
            ) from e
        except errors as e:
            raise _gin_error(e, files, [(name, value)]) from e
    _absolutize_path_macros()
    _check_model_family(files)
    return files


def _accepted_like(name: str, value: str) -> str:
    """What a non-literal flag value should have been, from the value the gin files give
    `name` (an int: an integer; a string: the value quoted; ...)."""
    import gin

    try:
        current = gin.query_parameter(f"%{name}" if re.fullmatch(r"[A-Z][A-Z0-9_]*", name) else name)
    except (ValueError, KeyError):
        current = None
    if isinstance(current, bool):
        return f"True or False (--gin.{name}={current})"
    if isinstance(current, int):
        return f"an integer (--gin.{name}={current})"
    if re.fullmatch(r"(NUM_\w+|\w+_STEPS|\w+_SIZE|\w+_EPOCHS|SEED)", name):  # required
        return f"an integer (--gin.{name}=8)"
    if isinstance(current, float):
        return f"a number (--gin.{name}={current!r})"
    return (f"a Python literal (a string needs quotes: --gin.{name}=\"'{value}'\"), "
            "@configurable() or %MACRO")


def _alias_hint(message: str, files: Sequence[pathlib.Path], binding: str) -> str:
    """For "No configurable matching 'a.b.c.fn'" where the gin files import module `a.b.c`
    under an alias: the name to write instead ('' otherwise)."""
    m = re.search(r"No configurable matching '([^']+)'", message)
    if not m:
        return ""
    selector = m.group(1)
    for alias, module in sorted(_import_aliases(files).items()):
        if alias != module and selector.startswith(module + "."):
            name = alias + selector[len(module):]
            fix = binding.replace(selector, name, 1) if binding.startswith(selector) else name
            return (f"the gin files import {module} as {alias}: write "
                    + (f"--gin.{fix}" if binding.startswith(selector) else name))
    return ""


def macro_names(message: str) -> str:
    """`message` with each `parameter=` of a configurable that the gin files bind to a macro
    (`min_user_purchases = %MIN_USER_PURCHASES`) written as that macro (`MIN_USER_PURCHASES=`),
    the name a user sets; a parameter bound to different macros is left as it is."""
    import gin

    macros: dict[str, set[str]] = {}
    for params in gin.config._CONFIG.values():  # noqa: SLF001 - read only
        for param, value in params.items():
            text = repr(value) if isinstance(value, gin.config.ConfigurableReference) else ""
            if re.fullmatch(r"%[A-Z][A-Z0-9_]*", text):
                macros.setdefault(param, set()).add(text[1:])
    for param, names in macros.items():
        if len(names) == 1 and re.fullmatch(r"[a-z][a-z0-9_]*", param):
            message = re.sub(rf"(?<![\w.%]){param}=", f"{next(iter(names))}=", message)
    return message


# Which family each model-building module belongs to, and the configurables whose
# bindings say a gin file configured that family.
_T5_MODULES = ("ktx.models.seq2seq", "ktx.conditioning.model")
_ENCODER_MODULES = ("ktx.models.encoder", "ktx.models.encoder_mlm", "ktx.models.camtl",
                    "ktx.models.pals", "ktx.models.tea")
_FAMILY_CONFIGURABLES = {
    "t5": ("ktx.models.t5.T5Config", "ktx.conditioning.model.ConditioningConfig",
           "ktx.conditioning.model.conditioned_model"),
    "encoder": ("ktx.models.bert.BertConfig", "ktx.models.encoder.EncoderClassifierModel",
                "ktx.models.pals.PalsClassifierModel", "ktx.models.tea.TeaClassifierModel",
                "ktx.models.camtl.CaMtlConfig"),
}
_FAMILY_FILES = {
    "t5": "gin/models/t5_1_1_*.gin with conditioning/{hyperprompt_*,prompt_tuning,adapters,"
          "hyperformer*}.gin",
    "encoder": "gin/models/bert_*.gin with conditioning/{ca_mtl,pals,tea_*,shared_layer,"
               "frozen_layers,mean_pooling,smart,task_warmup}.gin",
}


def _bound(selector: str) -> bool:
    """Whether any parameter of the configurable `selector` (a module path) is bound."""
    import importlib
    import inspect

    import gin

    module, _, name = selector.rpartition(".")
    try:
        target = getattr(importlib.import_module(module), name)
        params = inspect.signature(target).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return False
    for param in params:
        try:
            gin.query_parameter(f"{selector}.{param}")
            return True
        except ValueError:
            continue
    return False


def _check_model_family(files: Sequence[pathlib.Path]) -> None:
    """A T5 conditioning file over a BERT model file (or the other way round) would build
    the wrong model silently (the conditioning file's own default backbone) or fail deep
    in gin: one clear error instead, naming the families and the files that go together."""
    import gin

    try:
        model = gin.query_parameter("%MODEL")
    except ValueError:
        return
    wrapped = getattr(getattr(model, "configurable", None), "wrapped", None)
    module = getattr(wrapped, "__module__", "")
    family = "t5" if module in _T5_MODULES else "encoder" if module in _ENCODER_MODULES else None
    if family is None:
        return
    other = "encoder" if family == "t5" else "t5"
    stray = [s for s in _FAMILY_CONFIGURABLES[other] if _bound(s)]
    if stray:
        names = {"t5": "a T5 (encoder-decoder) model", "encoder": "a BERT-family encoder model"}
        raise GinConfigError(
            f"gin files {[str(f) for f in files]}: MODEL is {names[family]} "
            f"({module}.{getattr(wrapped, '__name__', wrapped)}) but the files also configure "
            f"{names[other]} ({', '.join(stray)}): a conditioning method exists for one family "
            f"only. Accepted: {_FAMILY_FILES[family]}; or {_FAMILY_FILES[other]}")


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


# Macros only a training run reads: `ktx eval` / `ktx infer` restore MODEL_DIR's
# checkpoints, so an experiment file that requires them still evaluates without them.
TRAIN_ONLY_MACROS = ("INITIAL_CHECKPOINT_PATH",)


def check_required_macros(files: Sequence[pathlib.Path], search: Sequence[str] = (),
                          skip: Sequence[str] = ()) -> None:
    """Raises GinConfigError naming every macro still bound to `%gin.REQUIRED` (but those
    in `skip`), the file and line declaring it, and the flag that sets it."""
    unset = [name for name, value in _macro_values().items()
             if value.strip() == "%gin.REQUIRED" and name not in skip]
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
    check_required_macros(files, skip=TRAIN_ONLY_MACROS if command in ("eval", "infer") else ())
    try:
        return configured(**(extra_kwargs or {}))
    except Exception as e:
        message = str(e)
        if "Required bindings" in message:
            raise GinConfigError(f"missing required gin binding for `ktx {command}`: {message}") from e
        raise


def _resolve_reference(value):
    """A gin binding's value: a `@fn()` reference called, `%MACRO` resolved."""
    import gin

    if isinstance(value, gin.config.ConfigurableReference):
        return value.scoped_configurable_fn() if value.evaluate else value.scoped_configurable_fn
    return value


def _write_config(model_dir) -> None:
    import gin

    if model_dir is None:
        return
    import jax

    if jax.process_index() != 0:
        return
    RunDir(model_dir).makedirs().config.write_text(gin.operative_config_str())


def _first_line(e: BaseException) -> str:
    """The user-facing part of an exception: gin's "In call to configurable" trailer
    and chained context dropped."""
    text = str(e).split("\n  In call to configurable")[0].strip()
    return text or type(e).__name__
