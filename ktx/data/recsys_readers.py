"""Reading multi-behaviour interaction files into `(user, item)` pair arrays.

These layouts are read (each bad row raises or is counted naming its file and line,
through `ktx.data.files`; each has a gin file under gin/experiments/recsys/layouts/):

* UserBehavior (Taobao): headerless CSV `user,item,category,behavior,timestamp`,
  behaviours `pv`, `buy`, `cart`, `fav` (named `click`, `buy`, `cart`, `collect` here);
  `read_user_behavior`.
* IJCAI-15 / Tmall `user_log_format1.csv`: header
  `user_id,item_id,cat_id,seller_id,brand_id,time_stamp,action_type`, action types
  0 click, 1 add-to-cart, 2 purchase, 3 add-to-favourite; `read_ijcai15_log`.
* One `user item item ...` list file per behaviour; `read_behaviour_lists`.
* One `user item` pair file per behaviour; `read_behaviour_pairs`.
* MovieLens `user item rating timestamp` (`::` or tab separated), ratings turned into
  behaviours by thresholds; `read_movielens`.
* A given held-out test file of the target in any of these layouts; `read_heldout`.

Every reader's `on_bad_row` is "raise" or "skip"; None (the default) is the process's
policy (`ktx.data.files.get_on_bad_row`: the gin macro ON_BAD_ROW of a ktx command, else
the environment variable KTX_ON_BAD_ROW, else "raise"). Repeated (user, item) rows are
counted per behaviour (`Interactions.duplicates`) and logged.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import logging
import math
import os
import pathlib
from collections.abc import Iterable, Mapping

import numpy as np

from ktx.data import files

_log = logging.getLogger(__name__)  # ktx.cli prints it as `ktx: ...`

__all__ = [
    "USER_BEHAVIOR_ACTIONS",
    "IJCAI15_ACTIONS",
    "IJCAI15_HEADER",
    "MOVIELENS_RATING_THRESHOLDS",
    "HELDOUT_LAYOUTS",
    "Interactions",
    "read_user_behavior",
    "read_ijcai15_log",
    "read_pair_file",
    "read_list_file",
    "read_behaviour_pairs",
    "read_behaviour_lists",
    "read_movielens",
    "read_heldout",
    "pair_keys",
    "unique_pairs",
]

USER_BEHAVIOR_ACTIONS = {"pv": "click", "buy": "buy", "cart": "cart", "fav": "collect"}
IJCAI15_ACTIONS = {"0": "click", "1": "cart", "2": "buy", "3": "collect"}
IJCAI15_HEADER = ("user_id", "item_id", "cat_id", "seller_id", "brand_id", "time_stamp", "action_type")
_HOW = "see /work/shared/data/README.md (recsys/) for the expected layout"


def _parse_id(text: str, what: str, counter: files.BadRowCounter, line: int) -> int | None:
    try:
        value = int(text.strip())
    except ValueError:
        counter.bad(line, f"{what} {text!r} is not an integer id")
        return None
    if value < 0:
        counter.bad(line, f"{what} {value} is negative")
        return None
    if value >= 1 << 62:
        counter.bad(line, f"{what} {value} is too large (ids must be below 2**62)")
        return None
    return value


@dataclasses.dataclass
class Interactions:
    """Raw interactions per behaviour: `pairs[b]` is int64 `[n_b, 2]` of (user, item) ids.

    `sources[b]` names the file each behaviour came from (for error messages) and
    `duplicates[b]` counts its repeated (user, item) rows (kept once by the preparation).
    """

    pairs: dict[str, np.ndarray]
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    duplicates: dict[str, int] = dataclasses.field(default_factory=dict)

    def behaviours(self) -> tuple[str, ...]:
        return tuple(self.pairs)


def _count_duplicates(pairs: np.ndarray, source: str, what: str) -> int:
    """Repeated (user, item) rows of `pairs`, logged with the file they came from."""
    n = len(pairs) - len(unique_pairs(pairs))
    if n:
        _log.warning("%s: %d duplicate (user, item) rows of %s (each pair is kept once)",
                        source, n, what)
    return int(n)


def _pair_array(flat: array.array) -> np.ndarray:
    """`[user, item, user, item, ...]` (int64, 16 bytes a pair while reading) -> `[n, 2]`."""
    return np.frombuffer(flat, np.int64).reshape(-1, 2).copy() if len(flat) else np.zeros((0, 2), np.int64)


def _collect(rows: Iterable[tuple[str, int, int]], source: str) -> Interactions:
    acc: dict[str, array.array] = {}
    for behaviour, user, item in rows:
        flat = acc.get(behaviour)
        if flat is None:
            flat = acc[behaviour] = array.array("q")
        flat.append(user)
        flat.append(item)
    pairs = {b: _pair_array(v) for b, v in acc.items()}
    return Interactions(
        pairs, sources={b: source for b in pairs},
        duplicates={b: _count_duplicates(p, source, repr(b)) for b, p in pairs.items()},
    )


def read_user_behavior(
    path: str | os.PathLike, *, on_bad_row: str | None = None
) -> Interactions:
    """Reads the UserBehavior CSV (`user,item,category,behavior,timestamp`, no header)."""
    path = files.require_file(path, _HOW)
    counter = files.BadRowCounter(path, on_bad_row)

    def rows():
        for line, text in files.read_lines(path):
            if not text.strip():
                continue
            fields = text.split(",")
            if len(fields) != 5:
                counter.bad(line, f"expected 5 comma-separated fields "
                            f"(user,item,category,behavior,timestamp), found {len(fields)}")
                continue
            action = fields[3].strip()
            if action not in USER_BEHAVIOR_ACTIONS:
                counter.bad(line, f"unknown behaviour {action!r}; accepted: {sorted(USER_BEHAVIOR_ACTIONS)}")
                continue
            user = _parse_id(fields[0], "user", counter, line)
            item = _parse_id(fields[1], "item", counter, line) if user is not None else None
            if user is None or item is None:
                continue
            yield USER_BEHAVIOR_ACTIONS[action], user, item
        counter.report()

    return _collect(rows(), str(path))


def read_ijcai15_log(path: str | os.PathLike, *, on_bad_row: str | None = None) -> Interactions:
    """Reads IJCAI-15 `user_log_format1.csv` (header `user_id,...,action_type`)."""
    path = files.require_file(path, _HOW)
    counter = files.BadRowCounter(path, on_bad_row)

    def rows():
        for line, row in files.read_csv(path, header=IJCAI15_HEADER, counter=counter):
            action = row["action_type"].strip()
            if action not in IJCAI15_ACTIONS:
                counter.bad(line, f"unknown action_type {action!r}; accepted: "
                            f"{dict(IJCAI15_ACTIONS)}")
                continue
            user = _parse_id(row["user_id"], "user_id", counter, line)
            item = _parse_id(row["item_id"], "item_id", counter, line) if user is not None else None
            if user is None or item is None:
                continue
            yield IJCAI15_ACTIONS[action], user, item
        counter.report()

    return _collect(rows(), str(path))


def read_pair_file(path: str | os.PathLike, *, on_bad_row: str | None = None) -> np.ndarray:
    """Reads `user item` lines (whitespace-separated) -> int64 `[n, 2]`."""
    path = files.require_file(path, _HOW)
    counter = files.BadRowCounter(path, on_bad_row)
    out = array.array("q")
    for line, text in files.read_lines(path):
        fields = text.split()
        if not fields:
            continue
        if len(fields) != 2:
            counter.bad(line, f"expected 2 whitespace-separated ids 'user item', found {len(fields)} fields")
            continue
        user = _parse_id(fields[0], "user", counter, line)
        item = _parse_id(fields[1], "item", counter, line) if user is not None else None
        if user is not None and item is not None:
            out.append(user)
            out.append(item)
    counter.report()
    return _pair_array(out)


def _files_of(files: Mapping[str, str | os.PathLike], what: str) -> dict[str, pathlib.Path]:
    if not isinstance(files, Mapping) or not files:
        raise ValueError(f"{what}: files={files!r}; expected a non-empty dict behaviour -> path "
                         "(BEHAVIOUR_FILES)")
    return {str(b): pathlib.Path(path) for b, path in files.items()}


def _read_per_behaviour(files: Mapping[str, str | os.PathLike], reader, what: str,
                        on_bad_row: str) -> Interactions:
    """`reader(path)` of each behaviour's file, with its source and duplicate count."""
    out = Interactions({})
    for behaviour, path in _files_of(files, what).items():
        pairs = reader(path, on_bad_row=on_bad_row)
        out.pairs[behaviour] = pairs
        out.sources[behaviour] = str(path)
        out.duplicates[behaviour] = _count_duplicates(pairs, str(path), repr(behaviour))
    return out


def read_behaviour_pairs(
    files: Mapping[str, str | os.PathLike], *, on_bad_row: str | None = None
) -> Interactions:
    """One `user item` pair file per behaviour (`{"buy": "buy.txt", "cart": ...}`)."""
    return _read_per_behaviour(files, read_pair_file, "read_behaviour_pairs", on_bad_row)


def read_list_file(path: str | os.PathLike, *, on_bad_row: str | None = None) -> np.ndarray:
    """Reads `user item item ...` lines (whitespace-separated; a user's interacted items
    after its id, a line with the user alone has none) -> int64 `[n, 2]` pairs."""
    path = files.require_file(path, _HOW)
    counter = files.BadRowCounter(path, on_bad_row)
    out = array.array("q")
    for line, text in files.read_lines(path):
        fields = text.split()
        if not fields:
            continue
        user = _parse_id(fields[0], "user", counter, line)
        if user is None:
            continue
        items = [_parse_id(f, f"item {k}", counter, line) for k, f in enumerate(fields[1:], start=1)]
        for i in items:
            if i is not None:
                out.append(user)
                out.append(i)
    counter.report()
    return _pair_array(out)


def read_behaviour_lists(
    files: Mapping[str, str | os.PathLike], *, on_bad_row: str | None = None
) -> Interactions:
    """One `user item item ...` list file per behaviour, as several public multi-behaviour
    benchmarks ship them (`{"buy": "buy.txt", "click": "pv.txt"}`)."""
    return _read_per_behaviour(files, read_list_file, "read_behaviour_lists", on_bad_row)


MOVIELENS_RATING_THRESHOLDS = {"dislike": 0.0, "neutral": 3.0, "like": 4.0}


def _check_thresholds(thresholds: Mapping[str, float]) -> list[tuple[float, str]]:
    if not isinstance(thresholds, Mapping) or not thresholds:
        raise ValueError(f"rating_thresholds={thresholds!r}: expected a non-empty dict "
                         "behaviour -> lowest rating")
    try:
        out = sorted((float(v), str(b)) for b, v in thresholds.items())
    except (TypeError, ValueError) as e:
        raise ValueError(f"rating_thresholds={thresholds!r}: thresholds must be numbers") from e
    if len({v for v, _ in out}) != len(out):
        raise ValueError(f"rating_thresholds={thresholds!r}: two behaviours share a threshold")
    return out


def read_movielens(
    path: str | os.PathLike,
    *,
    rating_thresholds: Mapping[str, float] | None = None,
    on_bad_row: str | None = None,
) -> Interactions:
    """Reads MovieLens ratings, `user item rating [timestamp]` separated by `::`
    (ml-1m `ratings.dat`) or tabs (ml-100k `u.data`), one rating per line.

    A rating becomes the behaviour with the largest threshold at or below it
    (`rating_thresholds`, default `{"dislike": 0, "neutral": 3, "like": 4}`: 4 and 5 are
    "like"). A rating below every threshold is counted and reported, not a behaviour.
    """
    levels = _check_thresholds(MOVIELENS_RATING_THRESHOLDS if rating_thresholds is None
                               else rating_thresholds)
    path = files.require_file(path, _HOW)
    counter = files.BadRowCounter(path, on_bad_row)
    below = 0

    def rows():
        nonlocal below
        for line, text in files.read_lines(path):
            if not text.strip():
                continue
            fields = text.split("::") if "::" in text else text.split("\t")
            if len(fields) not in (3, 4):
                counter.bad(line, "expected 'user item rating timestamp' separated by '::' or "
                            f"tabs, found {len(fields)} field(s)")
                continue
            user = _parse_id(fields[0], "user", counter, line)
            item = _parse_id(fields[1], "item", counter, line) if user is not None else None
            if user is None or item is None:
                continue
            try:
                rating = float(fields[2])
            except ValueError:
                counter.bad(line, f"rating {fields[2].strip()!r} is not a number")
                continue
            if not math.isfinite(rating):
                counter.bad(line, f"rating {fields[2].strip()!r} is not finite")
                continue
            behaviour = None
            for threshold, name in levels:
                if rating >= threshold:
                    behaviour = name
            if behaviour is None:
                below += 1
                continue
            yield behaviour, user, item
        counter.report()

    out = _collect(rows(), str(path))
    if below:
        _log.warning("%s: %d ratings below every threshold of %s are not a behaviour",
                        path, below, dict((b, v) for v, b in levels))
    return out


HELDOUT_LAYOUTS = ("pairs", "lists", "movielens", "user_behavior", "ijcai15")


def read_heldout(
    path: str | os.PathLike | None,
    *,
    layout: str,
    target: str = "buy",
    rating_thresholds: Mapping[str, float] | None = None,
    on_bad_row: str | None = None,
) -> np.ndarray | None:
    """A given held-out test file (TEST_FILE) of the target behaviour, in the layout of
    the data: `user item` pairs, `user item item ...` lists, or a MovieLens / UserBehavior
    / IJCAI-15 log of which the `target` rows are taken. None when `path` is None.
    A file without any (user, item) pair of the target is an error."""
    if path is None:
        return None
    if layout not in HELDOUT_LAYOUTS:
        raise ValueError(f"read_heldout(layout={layout!r}); accepted: {HELDOUT_LAYOUTS}")
    if layout == "pairs":
        pairs = read_pair_file(path, on_bad_row=on_bad_row)
    elif layout == "lists":
        pairs = read_list_file(path, on_bad_row=on_bad_row)
    else:
        read = {"movielens": functools.partial(read_movielens, rating_thresholds=rating_thresholds),
                "user_behavior": read_user_behavior, "ijcai15": read_ijcai15_log}[layout]
        inter = read(path, on_bad_row=on_bad_row)
        pairs = inter.pairs.get(target, np.zeros((0, 2), np.int64))
        others = {b: len(p) for b, p in inter.pairs.items() if b != target}
        if others:
            _log.warning("%s: held-out test file: only the %d %r rows are tested; the rows "
                            "of other behaviours %s are not", path, len(pairs), target, others)
    if not len(pairs):
        raise files.DataFileError(
            f"{path}: the held-out test file has no (user, item) pair"
            + ("" if layout in ("pairs", "lists") else f" of the target {target!r}")
            + "; give the target's test interactions or leave TEST_FILE = None for the "
            "70/10/20 split")
    return pairs



def pair_keys(pairs: np.ndarray, num_items: int) -> np.ndarray:
    """`[n, 2]` (user, item) pairs -> int64 `[n]` keys `user * num_items + item`."""
    return pairs[:, 0].astype(np.int64) * num_items + pairs[:, 1].astype(np.int64)


def unique_pairs(pairs: np.ndarray) -> np.ndarray:
    """The distinct rows of `pairs` as `[n, 2]`, sorted (empty input: `[0, 2]`)."""
    return np.unique(pairs.reshape(-1, 2), axis=0) if len(pairs) else pairs.reshape(0, 2)
