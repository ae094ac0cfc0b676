"""Reading users' data files: locating them, and rows that name their file and line.

Every loader in ktx reads the official layout of its data set through these helpers, so
that a missing file says where it was expected and how to get it, and a malformed row
raises `DataFileError` naming the file and line, or, with `on_bad_row="skip"`, is
skipped and counted (and the count logged) instead of being silently dropped.

The policy of the registered tasks is this process's default (`set_on_bad_row`, else the
`KTX_ON_BAD_ROW` environment variable, else "raise"), read when a file is read. From gin
(every command, whatever its gin files): `ON_BAD_ROW = 'skip'` in a gin file or
`--gin.ON_BAD_ROW="'skip'"` sets it; for one
input, `pipeline.MultiTaskInput.on_bad_row = 'skip'` applies it to the reads of
that input (`--gin.pipeline.MultiTaskInput.on_bad_row="'skip'"`).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import logging
import os
import pathlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

_log = logging.getLogger(__name__)  # ktx.cli prints it as `ktx: ...`

__all__ = [
    "DATA_DIR_ENV",
    "set_data_dir",
    "ON_BAD_ROW_ENV",
    "BAD_ROW_POLICIES",
    "SKIP_HOW_TO",
    "set_on_bad_row",
    "get_on_bad_row",
    "on_bad_row_policy",
    "DataFileError",
    "BadRowCounter",
    "resolve_data_dir",
    "require_file",
    "read_lines",
    "read_tsv",
    "read_csv",
    "read_jsonl",
]

DATA_DIR_ENV = "KTX_DATA_DIR"
ON_BAD_ROW_ENV = "KTX_ON_BAD_ROW"
BAD_ROW_POLICIES = ("raise", "skip")
_BOM = "\ufeff"
# How to switch to "skip", in every way that reaches the readers (the error message).
SKIP_HOW_TO = (
    "to skip and count such rows instead, add `--gin.ON_BAD_ROW=\"'skip'\"` to the ktx "
    f"command (any run file), or set `{ON_BAD_ROW_ENV}=skip` in the environment, or call "
    "`ktx.data.files.set_on_bad_row('skip')` in Python"
)
_policy: dict[str, str | None] = {"default": None}
_data_dir: dict[str, pathlib.Path | None] = {"default": None}


def set_data_dir(data_dir: str | os.PathLike | None) -> None:
    """Sets this process's data folder (the CLI passes the gin macro DATA_DIR here);
    None: back to `$KTX_DATA_DIR`. Every loader resolves it through `resolve_data_dir`."""
    _data_dir["default"] = None if data_dir in (None, "") else pathlib.Path(data_dir).expanduser()


def _check_policy(policy: str, where: str) -> str:
    if policy not in BAD_ROW_POLICIES:
        raise ValueError(f"{where}={policy!r}; accepted: {BAD_ROW_POLICIES}")
    return policy


def set_on_bad_row(policy: str | None) -> None:
    """Sets this process's bad-row policy: "raise" (an unreadable row raises naming file
    and line) or "skip" (it is skipped and counted); None: back to `$KTX_ON_BAD_ROW`."""
    _policy["default"] = None if policy is None else _check_policy(policy, "set_on_bad_row(policy)")


def get_on_bad_row() -> str:
    """The policy in force: `set_on_bad_row`'s, else `$KTX_ON_BAD_ROW`, else "raise"."""
    if _policy["default"] is not None:
        return _policy["default"]
    value = os.environ.get(ON_BAD_ROW_ENV, "").strip()
    return _check_policy(value, f"${ON_BAD_ROW_ENV}") if value else "raise"


@contextlib.contextmanager
def settings_kept() -> Iterator[None]:
    """Restores this process's data folder and bad-row policy on exit: for code whose
    workers set them and may share the process (Beam's DirectRunner runs
    `ktx.data.seqio_cache`'s worker setup in the caller's process)."""
    saved = (_data_dir["default"], _policy["default"])
    try:
        yield
    finally:
        _data_dir["default"], _policy["default"] = saved


@contextlib.contextmanager
def on_bad_row_policy(policy: str | None) -> Iterator[None]:
    """Within the block the policy is `policy` (None: unchanged); restored afterwards."""
    if policy is None:
        yield
        return
    previous = _policy["default"]
    set_on_bad_row(policy)
    try:
        yield
    finally:
        _policy["default"] = previous


class DataFileError(ValueError):
    """A data file is missing, empty, or has a row that cannot be read."""


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The data folder: `data_dir` if given, else `set_data_dir`'s (the gin macro
    DATA_DIR of a ktx command), else `$KTX_DATA_DIR`.

    Raises:
      DataFileError: none is set, or the folder does not exist.
    """
    value = data_dir if data_dir not in (None, "") else (
        _data_dir["default"] or os.environ.get(DATA_DIR_ENV))
    if not value:
        raise DataFileError(
            f"No data directory: set the gin macro DATA_DIR (--gin.DATA_DIR=\"'/path'\"), the "
            f"environment variable {DATA_DIR_ENV}, or call ktx.data.files.set_data_dir(path): "
            "the folder holding glue/, super_glue/, biomed/, recsys/, vocab/"
        )
    path = pathlib.Path(value).expanduser()
    if not path.is_dir():
        raise DataFileError(f"data directory {str(path)!r} does not exist or is not a folder")
    return path


def require_file(path: str | os.PathLike, how_to_obtain: str) -> pathlib.Path:
    """Returns `path` if it is a non-empty file, else raises naming it and `how_to_obtain`."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise DataFileError(f"missing data file {str(path)!r}; {how_to_obtain}")
    if path.stat().st_size == 0:
        raise DataFileError(f"data file {str(path)!r} is empty; {how_to_obtain}")
    return path


@dataclasses.dataclass
class BadRowCounter:
    """Applies the bad-row policy for one file and counts what was skipped.

    `on_bad_row`: "raise" or "skip"; None: the process's policy (`get_on_bad_row`: the gin
    macro ON_BAD_ROW of a ktx command, else `$KTX_ON_BAD_ROW`, else "raise")."""

    path: pathlib.Path
    on_bad_row: str | None = None
    skipped: int = 0

    def __post_init__(self):
        if self.on_bad_row is None:
            self.on_bad_row = get_on_bad_row()
        if self.on_bad_row not in BAD_ROW_POLICIES:
            raise ValueError(f"on_bad_row={self.on_bad_row!r}; accepted: {BAD_ROW_POLICIES}")

    def bad(self, line: int, reason: str) -> None:
        """Raises (policy "raise") or counts (policy "skip") a bad row at `line` (1-based)."""
        message = f"{self.path}:{line}: {reason}"
        if self.on_bad_row == "raise":
            raise DataFileError(f"{message} ({SKIP_HOW_TO})")
        self.skipped += 1
        if self.skipped <= 5:
            _log.warning("skipping bad row %s", message)

    def report(self) -> None:
        if self.skipped:
            _log.warning("%s: skipped %d bad rows", self.path, self.skipped)


def read_lines(path: pathlib.Path) -> Iterator[tuple[int, str]]:
    """Yields `(line_number, text)` without the newline; strips a leading UTF-8 BOM."""
    with open(path, encoding="utf-8", newline="") as f:
        for number, text in enumerate(f, start=1):
            if number == 1 and text.startswith(_BOM):
                text = text[len(_BOM):]
            yield number, text.rstrip("\r\n")


def _rows(
    path: pathlib.Path,
    split: Callable[[str], list[str]],
    num_fields: int | None,
    header: Sequence[str] | bool,
    counter: BadRowCounter,
) -> Iterator[tuple[int, dict[str, str] | list[str]]]:
    names: Sequence[str] | None = None
    for number, text in read_lines(path):
        if not text.strip():
            continue
        fields = split(text)
        if names is None and header:
            names = fields if header is True else list(header)
            if header is not True and [f.strip() for f in fields] != list(header):
                raise DataFileError(
                    f"{path}:{number}: header {fields!r} does not match the expected {list(header)!r}"
                )
            continue
        expected = len(names) if names is not None else num_fields
        if expected is not None and len(fields) != expected:
            counter.bad(number, f"expected {expected} fields, found {len(fields)}")
            continue
        yield number, (dict(zip(names, fields)) if names is not None else fields)


def read_tsv(
    path: pathlib.Path,
    *,
    num_fields: int | None = None,
    header: Sequence[str] | bool = False,
    counter: BadRowCounter | None = None,
    quoting: bool = False,
) -> Iterator[tuple[int, Any]]:
    """Yields `(line, row)` of a tab-separated file; rows are dicts with a header.

    `header=True` takes names from the first line; a sequence checks the first line
    against it. Rows with the wrong number of fields go to `counter`'s policy.
    """
    counter = counter or BadRowCounter(path)
    if quoting:
        split = lambda t: next(csv.reader([t], delimiter="\t"))  # noqa: E731
    else:
        split = lambda t: t.split("\t")  # noqa: E731
    yield from _rows(path, split, num_fields, header, counter)
    counter.report()


def read_csv(
    path: pathlib.Path,
    *,
    header: Sequence[str] | bool = True,
    counter: BadRowCounter | None = None,
    delimiter: str = ",",
) -> Iterator[tuple[int, Any]]:
    """Like `read_tsv` for (quoted) comma-separated files; fields may not span lines."""
    counter = counter or BadRowCounter(path)
    split = lambda t: next(csv.reader([t], delimiter=delimiter))  # noqa: E731
    yield from _rows(path, split, None, header, counter)
    counter.report()


def read_jsonl(
    path: pathlib.Path,
    *,
    required: Sequence[str] = (),
    counter: BadRowCounter | None = None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields `(line, object)` of a JSON-lines file, checking `required` keys."""
    counter = counter or BadRowCounter(path)
    for number, text in read_lines(path):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            counter.bad(number, f"not valid JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(row, dict):
            counter.bad(number, f"expected a JSON object, found {type(row).__name__}")
            continue
        missing = [k for k in required if k not in row]
        if missing:
            counter.bad(number, f"missing keys {missing}; required: {list(required)}")
            continue
        yield number, row
    counter.report()
