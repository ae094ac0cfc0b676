"""Multi-behaviour interaction data for the MetaBalance recommendation study.

These layouts are read (each bad row raises or is counted naming its file and line,
through `ktx.data.files`; each has a gin file under gin/experiments/recsys/layouts/):

* UserBehavior (Taobao): headerless CSV `user,item,category,behavior,timestamp`,
  behaviours `pv`, `buy`, `cart`, `fav` (named `click`, `buy`, `cart`, `collect` here);
  `read_user_behavior`.
* IJCAI-15 / Tmall `user_log_format1.csv`: header
  `user_id,item_id,cat_id,seller_id,brand_id,time_stamp,action_type`, action types
  0 click, 1 add-to-cart, 2 purchase, 3 add-to-favourite; `read_ijcai15_log`.
* One `user item item ...` list file per behaviour; `read_behaviour_lists`.
* One `user item` pair file per behaviour; `read_behaviour_pairs`. The shared Tmall
  folder is this layout with given splits `validation.txt`, `test.txt` and
  `data_size.txt` (`num_users num_items`); `load_tmall_pairs`.
* MovieLens `user item rating timestamp` (`::` or tab separated), ratings turned into
  behaviours by thresholds; `read_movielens`.

Every reader's `on_bad_row` is "raise" or "skip"; None (the default) is the process's
policy (`ktx.data.files.get_on_bad_row`: the gin macro ON_BAD_ROW of a ktx command, else
the environment variable KTX_ON_BAD_ROW, else "raise").

A given held-out test file of the target (`read_heldout`, any of these layouts)
replaces the split's test part. Repeated (user, item) rows are counted and reported
(`MultiBehaviorData.report`), test pairs the training data cannot rank are counted and
reported, an auxiliary behaviour with no user in common with the target is an error.

Preprocessing follows the MetaBalance paper (He et al., 2022): keep users with at least
`min_user_purchases` target interactions and items bought by at least
`min_item_buyers` users, split each user's target interactions 70/10/20 into
train/validation/test, merge the auxiliary behaviours into training and remove from
them every user-item pair in the target's validation or test split (leakage).

`RecsysTrainInput` (a `ktx.runs.train.TrainInput`) yields task-partitioned batches: each step holds a
fixed block of rows per behaviour (target first), positives with label 1 and
`num_negatives` uniformly drawn non-interacted items per positive with label 0, the
negatives and order re-drawn every epoch from `(seed, epoch, task)` only, so a batch is
a pure function of `(seed, step)`.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import logging
import math
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence

import jax
import numpy as np

from ktx.data import files

_log = logging.getLogger(__name__)  # ktx.cli prints it as `ktx: ...`

__all__ = [
    "USER_BEHAVIOR_ACTIONS",
    "IJCAI15_ACTIONS",
    "Interactions",
    "MultiBehaviorData",
    "read_user_behavior",
    "read_ijcai15_log",
    "read_pair_file",
    "read_list_file",
    "read_behaviour_pairs",
    "read_behaviour_lists",
    "read_movielens",
    "read_heldout",
    "MOVIELENS_RATING_THRESHOLDS",
    "prepare_multibehavior",
    "load_tmall_pairs",
    "data_size",
    "subsample_users",
    "training_exclusions",
    "RecsysTrainInput",
    "user_item_lists",
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
    n = len(pairs) - len(_unique_pairs(pairs))
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


@dataclasses.dataclass
class MultiBehaviorData:
    """Preprocessed data; ids are contiguous in `[0, num_users)` x `[0, num_items)`.

    Attributes:
      behaviours: task names in task-id order, the target first.
      train: behaviour -> int64 `[n, 2]` unique (user, item) training pairs.
      validation, test: the target's held-out int64 `[n, 2]` pairs.
      leakage_removed: behaviour -> auxiliary pairs removed because they are in the
        target's validation or test split.
      report: counts of what the preparation removed, e.g. `duplicates/<behaviour>`
        (repeated rows), `test_pairs_dropped` (given test pairs whose user or item is not
        in the training data), `test_pairs_in_train` (given test pairs removed from the
        target's training pairs).
    """

    num_users: int
    num_items: int
    behaviours: tuple[str, ...]
    train: dict[str, np.ndarray]
    validation: np.ndarray
    test: np.ndarray
    leakage_removed: dict[str, int] = dataclasses.field(default_factory=dict)
    report: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def target(self) -> str:
        return self.behaviours[0]

    def summary(self) -> dict[str, int]:
        out = {"users": self.num_users, "items": self.num_items}
        out.update({f"train/{b}": len(p) for b, p in self.train.items()})
        out.update({"validation": len(self.validation), "test": len(self.test)})
        out.update({f"leakage_removed/{b}": n for b, n in self.leakage_removed.items()})
        out.update(self.report)
        return out


def _keys(pairs: np.ndarray, num_items: int) -> np.ndarray:
    return pairs[:, 0].astype(np.int64) * num_items + pairs[:, 1].astype(np.int64)


def _unique_pairs(pairs: np.ndarray) -> np.ndarray:
    return np.unique(pairs.reshape(-1, 2), axis=0) if len(pairs) else pairs.reshape(0, 2)


def _remove_pairs(pairs: np.ndarray, drop: np.ndarray, num_items: int) -> np.ndarray:
    if not len(pairs) or not len(drop):
        return pairs
    return pairs[~np.isin(_keys(pairs, num_items), _keys(drop, num_items))]


def _split_per_user(pairs: np.ndarray, fractions: Sequence[float], seed: int):
    """Each user's pairs shuffled and cut `fractions` (train, val, test); rounding to train."""
    rng = np.random.default_rng([seed, 7919])
    order = rng.permutation(len(pairs))
    pairs = pairs[order]
    pairs = pairs[np.argsort(pairs[:, 0], kind="stable")]
    users, starts, counts = np.unique(pairs[:, 0], return_index=True, return_counts=True)
    n_val = np.floor(counts * fractions[1] + 0.5).astype(np.int64)
    n_test = np.floor(counts * fractions[2] + 0.5).astype(np.int64)
    n_train = counts - n_val - n_test
    rank = np.arange(len(pairs)) - np.repeat(starts, counts)
    part = np.where(
        rank < np.repeat(n_train, counts), 0, np.where(rank < np.repeat(n_train + n_val, counts), 1, 2)
    )
    return pairs[part == 0], pairs[part == 1], pairs[part == 2]


def prepare_multibehavior(
    interactions: Interactions,
    *,
    target: str = "buy",
    auxiliaries: Sequence[str] | None = ("collect", "cart"),
    min_user_purchases: int = 0,
    min_item_buyers: int = 0,
    split_fractions: Sequence[float] = (0.7, 0.1, 0.2),
    seed: int = 0,
    test: np.ndarray | None = None,
) -> MultiBehaviorData:
    """Filters, re-indexes, splits the target 70/10/20 per user and removes leakage.

    Items bought by fewer than `min_item_buyers` users are dropped first, then users
    with fewer than `min_user_purchases` remaining purchases (one pass each). Users and
    items that survive are re-indexed contiguously (in increasing raw id order);
    auxiliary interactions of dropped users/items are dropped. `auxiliaries=None` takes
    every other behaviour of the data, in its order.

    `test` (raw-id pairs of a given held-out file, `read_heldout`) replaces the split's
    test part: those pairs leave the target's training pairs, each user's remaining
    ones are split train/validation in the ratio of `split_fractions[:2]`, and test
    pairs whose user or item is not in the filtered training data are dropped, counted
    in `report["test_pairs_dropped"]` and logged (all of them dropped is an error).
    Repeated rows are counted per behaviour in `report["duplicates/<b>"]`. An
    auxiliary behaviour with no user in common with the target is an error.
    """
    available = interactions.behaviours()
    if target not in available:
        raise ValueError(f"TARGET_BEHAVIOUR {target!r} is not in the data; found {list(available)}")
    if auxiliaries is None:
        auxiliaries = tuple(b for b in available if b != target)
    auxiliaries = tuple(auxiliaries)
    for name in auxiliaries:
        if name not in available:
            raise ValueError(f"behaviour {name!r} is not in the data; found {list(available)}")
    if target in auxiliaries:
        raise ValueError(f"auxiliaries={list(auxiliaries)!r} must not contain the target {target!r}")
    fr = tuple(float(f) for f in split_fractions)
    if len(fr) != 3 or min(fr) < 0 or abs(sum(fr) - 1.0) > 1e-6:
        raise ValueError(f"split_fractions={split_fractions!r}: expected 3 non-negative fractions summing to 1")
    for name, v in (("min_user_purchases", min_user_purchases), ("min_item_buyers", min_item_buyers)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}={v!r}: expected a non-negative int")

    def where(b):
        return f" ({interactions.sources[b]})" if b in interactions.sources else ""

    report = {f"duplicates/{b}": int(interactions.duplicates.get(b, 0)) for b in (target, *auxiliaries)}
    buys = _unique_pairs(interactions.pairs[target])
    target_users = np.unique(buys[:, 0])
    for a in auxiliaries:
        aux = interactions.pairs[a].reshape(-1, 2)
        if not np.isin(aux[:, 0], target_users).any():
            raise ValueError(
                f"behaviour {a!r}{where(a)}: none of its {len(aux)} rows has a user of the "
                f"target {target!r}{where(target)}; the files must use the same user ids")
    if test is not None:
        test = _unique_pairs(np.asarray(test, np.int64).reshape(-1, 2))
        if not len(test):
            raise ValueError("test: the given held-out test pairs are empty")
        _, pair_id = np.unique(np.concatenate([buys, test]), axis=0, return_inverse=True)
        pair_id = pair_id.reshape(-1)  # one id per distinct raw (user, item) pair
        kept = ~np.isin(pair_id[:len(buys)], pair_id[len(buys):])
        report["test_pairs_in_train"] = int((~kept).sum())
        if report["test_pairs_in_train"]:
            _log.warning("%d held-out test pairs are also %r interactions: removed from "
                            "training", report["test_pairs_in_train"], target)
        buys = buys[kept]
    items, buyers = np.unique(buys[:, 1], return_counts=True)
    buys = buys[np.isin(buys[:, 1], items[buyers >= min_item_buyers])]
    users, purchases = np.unique(buys[:, 0], return_counts=True)
    buys = buys[np.isin(buys[:, 0], users[purchases >= min_user_purchases])]
    if not len(buys):
        raise ValueError(
            f"no {target!r} interactions left after min_user_purchases={min_user_purchases}, "
            f"min_item_buyers={min_item_buyers}"
        )
    user_ids = np.unique(buys[:, 0])
    item_ids = np.unique(buys[:, 1])

    def reindex(pairs):
        pairs = _unique_pairs(pairs)
        keep = np.isin(pairs[:, 0], user_ids) & np.isin(pairs[:, 1], item_ids)
        pairs = pairs[keep]
        return np.stack(
            [np.searchsorted(user_ids, pairs[:, 0]), np.searchsorted(item_ids, pairs[:, 1])], axis=1
        ).astype(np.int64)

    if test is None:
        train, val, test_out = _split_per_user(reindex(buys), fr, seed)
    else:
        known = np.isin(test[:, 0], user_ids) & np.isin(test[:, 1], item_ids)
        report["test_pairs_dropped"] = int((~known).sum())
        if not known.any():
            raise ValueError(
                f"none of the {len(test)} held-out test pairs has a user and an item of the "
                f"{target!r} training data (after min_user_purchases={min_user_purchases}, "
                f"min_item_buyers={min_item_buyers}); check that the test file uses the same ids")
        if report["test_pairs_dropped"]:
            _log.warning(
                "%d of %d held-out test pairs name a user or item absent from the %r training "
                "data (after the filters): not ranked", report["test_pairs_dropped"], len(test), target)
        share = fr[1] / (fr[0] + fr[1]) if fr[0] + fr[1] > 0 else 0.0
        train, val, _ = _split_per_user(reindex(buys), (1.0 - share, share, 0.0), seed)
        test_out = reindex(test)
    aux_train = {}
    for a in auxiliaries:
        aux_train[a] = reindex(interactions.pairs[a])
        if not len(aux_train[a]):
            raise ValueError(
                f"behaviour {a!r}{where(a)}: no pair left with a user and an item of the "
                f"filtered {target!r} data (min_user_purchases={min_user_purchases}, "
                f"min_item_buyers={min_item_buyers})")
    data = _assemble(
        len(user_ids), len(item_ids), target, auxiliaries,
        {target: train, **aux_train}, val, test_out,
    )
    data.report.update(report)
    return data


def _assemble(num_users, num_items, target, auxiliaries, train, val, test) -> MultiBehaviorData:
    heldout = np.concatenate([val.reshape(-1, 2), test.reshape(-1, 2)])
    out_train = {target: _unique_pairs(train[target])}
    removed = {}
    for a in auxiliaries:
        pairs = _unique_pairs(train[a])
        kept = _remove_pairs(pairs, heldout, num_items)
        removed[a] = len(pairs) - len(kept)
        out_train[a] = kept
    return MultiBehaviorData(
        num_users=int(num_users),
        num_items=int(num_items),
        behaviours=(target, *auxiliaries),
        train=out_train,
        validation=_unique_pairs(val),
        test=_unique_pairs(test),
        leakage_removed=removed,
    )


def load_tmall_pairs(
    directory: str | os.PathLike | None = None,
    *,
    target: str = "buy",
    auxiliaries: Sequence[str] = ("collect", "cart"),
    on_bad_row: str | None = None,
) -> MultiBehaviorData:
    """The shared Tmall folder (given splits): `train.txt` (target train), `validation.txt`,
    `test.txt`, `<aux>.txt`, `data_size.txt`; leakage removed from the auxiliaries.

    `directory` defaults to `<data_dir>/recsys/tmall` (`KTX_DATA_DIR`).
    """
    if directory is None:
        directory = files.resolve_data_dir() / "recsys" / "tmall"
    directory = pathlib.Path(directory)
    size_path = files.require_file(directory / "data_size.txt", _HOW)
    fields = size_path.read_text().split()
    if len(fields) != 2 or not all(f.isdigit() for f in fields):
        raise files.DataFileError(f"{size_path}:1: expected 'num_users num_items', found {fields!r}")
    num_users, num_items = int(fields[0]), int(fields[1])
    train = {target: read_pair_file(directory / "train.txt", on_bad_row=on_bad_row)}
    for a in auxiliaries:
        train[a] = read_pair_file(directory / f"{a}.txt", on_bad_row=on_bad_row)
    val = read_pair_file(directory / "validation.txt", on_bad_row=on_bad_row)
    test = read_pair_file(directory / "test.txt", on_bad_row=on_bad_row)
    for name, pairs in [*train.items(), ("validation", val), ("test", test)]:
        if len(pairs) and (pairs[:, 0].max() >= num_users or pairs[:, 1].max() >= num_items):
            raise files.DataFileError(
                f"{directory / (name + '.txt')}: ids up to ({pairs[:, 0].max()}, {pairs[:, 1].max()}) "
                f"exceed data_size.txt ({num_users} users, {num_items} items)"
            )
    return _assemble(num_users, num_items, target, auxiliaries, train, val, test)


def subsample_users(pairs: np.ndarray, max_users: int | None, seed: int = 0) -> np.ndarray:
    """The held-out `pairs` of `max_users` users drawn without replacement (a fixed
    subset for a given seed); all pairs when `max_users` is None or covers every user."""
    if max_users is None:
        return pairs
    if not isinstance(max_users, int) or max_users < 1:
        raise ValueError(f"max_users={max_users!r}: expected None or a positive int")
    users = np.unique(pairs[:, 0])
    if max_users >= len(users):
        return pairs
    keep = np.random.default_rng(seed).choice(users, max_users, replace=False)
    return pairs[np.isin(pairs[:, 0], keep)]


def training_exclusions(data: MultiBehaviorData, exclude: str = "all") -> list[np.ndarray]:
    """The `(user, item)` pair arrays removed from every user's full ranking: every
    behaviour's training pairs (`"all"`) or the target's (`"target"`)."""
    if exclude == "all":
        return [data.train[b] for b in data.behaviours]
    if exclude == "target":
        return [data.train[data.target]]
    raise ValueError(f"exclude={exclude!r}; accepted: 'all', 'target'")


def data_size(data: MultiBehaviorData, what: str) -> int:
    """`data.num_users` (`what="users"`), `data.num_items` ("items") or the number of
    behaviours ("tasks"): lets gin size the model from the data it loads, e.g.
    `NUM_USERS = @users/recsys_data.data_size()` with `users/recsys_data.data_size.what =
    'users'` (see gin/experiments/recsys/layouts/common.gin)."""
    sizes = {"users": data.num_users, "items": data.num_items, "tasks": len(data.behaviours)}
    if what not in sizes:
        raise ValueError(f"data_size(what={what!r}); accepted: {sorted(sizes)}")
    return sizes[what]


def _largest_remainder(total: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """Splits `total` rows over tasks in proportion to `sizes`, at least one row each."""
    sizes = np.asarray(sizes, np.float64)
    T = len(sizes)
    if total < T:
        raise ValueError(f"batch_size={total} is smaller than the number of tasks ({T})")
    share = 1 + (total - T) * sizes / sizes.sum()
    counts = np.floor(share).astype(np.int64)
    rest = total - counts.sum()
    counts[np.argsort(-(share - counts), kind="stable")[:rest]] += 1
    return tuple(int(c) for c in counts)


class RecsysTrainInput:
    """Task-partitioned training batches over `MultiBehaviorData.train` (a `ktx.runs.train.TrainInput`).

    A task's epoch stream is its positives plus `num_negatives` negatives per positive,
    shuffled; negatives are uniform over items the user has not interacted with in that
    behaviour's training pairs (re-drawn on collision, up to 20 rounds). Every step takes
    `task_counts()[t]` consecutive rows of task t's stream, cycling if the task's stream
    is shorter than the epoch. `steps_per_epoch = max_t ceil(rows_t / count_t)`; with the
    default proportional counts that is one pass over all rows. `max_steps_per_epoch`
    shortens every epoch to its first steps (quick runs): epoch e is still drawn from
    epoch e's streams, so a shortened run sees a prefix of each full epoch.

    `rows="shared"` gives every task the same rows instead, each labelled for every
    behaviour, as the MetaBalance authors' training script feeds its model (every row
    carries all behaviours' labels and every task's loss is taken on it): the epoch
    stream is the union of all behaviours' training pairs (a pair is positive for the
    behaviours it occurs in) plus `num_negatives` negatives per pair, uniform over items
    the user has no training interaction with (labels 0 for every task). A step takes
    `batch_size / T` consecutive pairs and lays them out as T task blocks of the same
    pairs (task t's block labelled for behaviour t), so the per-task gradient engine and
    the losses are those of task-partitioned batches, and `batch_size` still counts the
    rows the model sees (the authors' 256 pairs per step with 3 behaviours: 768).

    Args:
      data: the preprocessed data.
      batch_size: global rows per step (interface: BATCH_SIZE); with `rows="shared"`,
        a multiple of the number of tasks.
      num_negatives: negatives per positive.
      seed: base seed; batch(step) depends only on (seed, step).
      task_batch_sizes: explicit rows per task (sum = batch_size); default proportional
        to each task's rows, at least 1.
      max_steps_per_epoch: cap each epoch at this many steps (None: full epochs;
        gin: STEPS_PER_EPOCH).
      rows: "per_task" (each task's own positives and negatives) or "shared" (the same
        pairs for every task, labelled for each behaviour).
      process_index, process_count: this process's contiguous slice of the global batch.
    """

    def __init__(
        self,
        data: MultiBehaviorData,
        *,
        batch_size: int = 256,
        num_negatives: int = 1,
        seed: int = 0,
        task_batch_sizes: Sequence[int] | None = None,
        max_steps_per_epoch: int | None = None,
        rows: str = "per_task",
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: expected a positive int")
        if rows not in ("per_task", "shared"):
            raise ValueError(f"rows={rows!r}; accepted: 'per_task' or 'shared'")
        if rows == "shared" and task_batch_sizes is not None:
            raise ValueError(
                f"task_batch_sizes={task_batch_sizes!r} with rows='shared': every task gets "
                "the same batch_size / T pairs; leave task_batch_sizes unset")
        self.rows = rows
        if not isinstance(num_negatives, int) or num_negatives < 0:
            raise ValueError(f"num_negatives={num_negatives!r}: expected a non-negative int")
        self.data = data
        self.task_names = tuple(data.behaviours)
        self.num_tasks = len(self.task_names)
        self.batch_size = batch_size
        self.num_negatives = num_negatives
        self.seed = int(seed)
        self._pos = [data.train[b] for b in self.task_names]
        for b, p in zip(self.task_names, self._pos):
            if not len(p):
                raise ValueError(f"behaviour {b!r} has no training pairs")
        if rows == "shared":
            self._union = _unique_pairs(np.concatenate(self._pos))
            self.rows_per_task = (len(self._union) * (1 + num_negatives),) * self.num_tasks
            if batch_size % self.num_tasks:
                raise ValueError(
                    f"batch_size={batch_size} with rows='shared': every one of the "
                    f"{self.num_tasks} tasks gets the same pairs, so batch_size (rows per step) "
                    f"must be a multiple of {self.num_tasks}, e.g. "
                    f"{self.num_tasks * max(1, round(batch_size / self.num_tasks))}")
            counts = (batch_size // self.num_tasks,) * self.num_tasks
        else:
            self.rows_per_task = tuple(len(p) * (1 + num_negatives) for p in self._pos)
            if task_batch_sizes is None:
                counts = _largest_remainder(batch_size, self.rows_per_task)
            else:
                counts = tuple(int(c) for c in task_batch_sizes)
                if len(counts) != self.num_tasks or min(counts) < 1 or sum(counts) != batch_size:
                    raise ValueError(
                        f"task_batch_sizes={task_batch_sizes!r}: expected {self.num_tasks} "
                        f"positive ints summing to batch_size={batch_size}"
                    )
        self._counts = counts
        self.full_steps_per_epoch = int(max(-(-r // c) for r, c in zip(self.rows_per_task, counts)))
        if max_steps_per_epoch is not None and (
                isinstance(max_steps_per_epoch, bool) or not isinstance(max_steps_per_epoch, int)
                or max_steps_per_epoch < 1):
            raise ValueError(
                f"max_steps_per_epoch={max_steps_per_epoch!r}; accepted: None (full epochs) or "
                "an integer >= 1")
        self.steps_per_epoch = self.full_steps_per_epoch if max_steps_per_epoch is None else min(
            max_steps_per_epoch, self.full_steps_per_epoch)
        pi = jax.process_index() if process_index is None else process_index
        pc = jax.process_count() if process_count is None else process_count
        if batch_size % pc or not 0 <= pi < pc:
            raise ValueError(
                f"batch_size={batch_size} must divide evenly over process_count={pc} "
                f"(process_index={pi})"
            )
        self.process_index, self.process_count = pi, pc
        self._sorted_keys = [np.sort(_keys(p, data.num_items)) for p in self._pos]
        if rows == "shared":
            self._union_keys = np.sort(_keys(self._union, data.num_items))
        self._cache: tuple[int, list[dict[str, np.ndarray]]] | None = None

    def task_counts(self, step: int) -> tuple[int, ...]:
        del step  # the layout is the same every step
        return self._counts

    def epoch_of(self, step: int) -> int:
        return int(step) // self.steps_per_epoch

    def _negatives(self, keys: np.ndarray, users: np.ndarray,
                   rng: np.random.Generator) -> np.ndarray:
        """Uniform items whose (user, item) key is not in the sorted `keys`."""
        n_items = self.data.num_items
        items = rng.integers(0, n_items, size=len(users))
        for _ in range(20):
            k = users * n_items + items
            pos = np.searchsorted(keys, k)
            hit = (pos < len(keys)) & (keys[np.minimum(pos, len(keys) - 1)] == k)
            if not hit.any():
                break
            items[hit] = rng.integers(0, n_items, size=int(hit.sum()))
        return items

    def epoch_rows(self, epoch: int) -> list[dict[str, np.ndarray]]:
        """Task t's shuffled stream for `epoch` (positives + fresh negatives)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        if self.rows == "shared":
            streams = [self._shared_stream(epoch)]
            self._cache = (int(epoch), streams)
            return streams
        streams = []
        for t, pos in enumerate(self._pos):
            rng = np.random.default_rng([self.seed, int(epoch), t])
            neg_users = np.repeat(pos[:, 0], self.num_negatives)
            users = np.concatenate([pos[:, 0], neg_users])
            items = np.concatenate([pos[:, 1], self._negatives(self._sorted_keys[t], neg_users, rng)])
            labels = np.concatenate([np.ones(len(pos), np.float32), np.zeros(len(neg_users), np.float32)])
            order = rng.permutation(len(users))
            streams.append({
                "user": users[order].astype(np.int32),
                "item": items[order].astype(np.int32),
                "label": labels[order],
            })
        self._cache = (int(epoch), streams)
        return streams

    def _shared_stream(self, epoch: int) -> dict[str, np.ndarray]:
        """The shuffled pairs of `rows="shared"`: every behaviour's training pairs (labels
        `[n, T]`, 1 where the pair is a training pair of that behaviour) and negatives."""
        rng = np.random.default_rng([self.seed, int(epoch), self.num_tasks, 1])
        pos = self._union
        neg_users = np.repeat(pos[:, 0], self.num_negatives)
        users = np.concatenate([pos[:, 0], neg_users])
        items = np.concatenate([pos[:, 1], self._negatives(self._union_keys, neg_users, rng)])
        keys = _keys(pos, self.data.num_items)
        labels = np.zeros((len(users), self.num_tasks), np.float32)
        for t, task_keys in enumerate(self._sorted_keys):
            labels[:len(pos), t] = np.isin(keys, task_keys)
        order = rng.permutation(len(users))
        return {"user": users[order].astype(np.int32), "item": items[order].astype(np.int32),
                "labels": labels[order]}

    def get_global_batch(self, step: int) -> dict[str, np.ndarray]:
        """All rows of `step`, task blocks contiguous in task order."""
        if int(step) < 0:
            raise ValueError(f"step={step!r}: expected >= 0")
        epoch, within = divmod(int(step), self.steps_per_epoch)
        streams = self.epoch_rows(epoch)
        parts: dict[str, list[np.ndarray]] = {"user": [], "item": [], "label": [], "task_id": []}
        if self.rows == "shared":
            stream, b = streams[0], self._counts[0]
            idx = (within * b + np.arange(b)) % len(stream["user"])
            for t in range(self.num_tasks):
                parts["user"].append(stream["user"][idx])
                parts["item"].append(stream["item"][idx])
                parts["label"].append(stream["labels"][idx, t])
                parts["task_id"].append(np.full(b, t, np.int32))
            return {k: np.concatenate(v) for k, v in parts.items()}
        for t, (stream, c) in enumerate(zip(streams, self._counts)):
            idx = (within * c + np.arange(c)) % len(stream["user"])
            for k in ("user", "item", "label"):
                parts[k].append(stream[k][idx])
            parts["task_id"].append(np.full(c, t, np.int32))
        return {k: np.concatenate(v) for k, v in parts.items()}

    def get_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's contiguous rows of the global batch of `step`."""
        batch = self.get_global_batch(step)
        n = self.batch_size // self.process_count
        lo = self.process_index * n
        return {k: v[lo:lo + n] for k, v in batch.items()}


def user_item_lists(pairs: np.ndarray, num_users: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR of `pairs`: `(indptr [num_users + 1], items [n])`, items sorted per user."""
    pairs = _unique_pairs(np.asarray(pairs).reshape(-1, 2))
    counts = np.bincount(pairs[:, 0], minlength=num_users)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return indptr, pairs[:, 1].astype(np.int64)

