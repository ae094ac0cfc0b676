"""Preparing multi-behaviour data: filters, contiguous ids, splits, leakage removal.

Preprocessing follows the MetaBalance paper (He et al., 2022): keep users with at least
`min_user_purchases` target interactions and items bought by at least
`min_item_buyers` users, split each user's target interactions 70/10/20 into
train/validation/test, merge the auxiliary behaviours into training and remove from
them every user-item pair in the target's validation or test split (leakage).

A given held-out test file of the target (`ktx.data.recsys_readers.read_heldout`)
replaces the split's test part; test pairs the training data cannot rank are counted
and reported, an auxiliary behaviour with no user in common with the target is an
error. The shared Tmall folder (given splits `train.txt`, `validation.txt`, `test.txt`,
`<aux>.txt`, `data_size.txt`) is read by `load_tmall_pairs`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from collections.abc import Sequence

import numpy as np

from ktx.data import files
from ktx.data.recsys_readers import _HOW, Interactions, pair_keys, read_pair_file, unique_pairs

_log = logging.getLogger(__name__)  # ktx.cli prints it as `ktx: ...`

__all__ = [
    "MultiBehaviorData",
    "prepare_multibehavior",
    "load_tmall_pairs",
    "data_size",
]


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


def _remove_pairs(pairs: np.ndarray, drop: np.ndarray, num_items: int) -> np.ndarray:
    if not len(pairs) or not len(drop):
        return pairs
    return pairs[~np.isin(pair_keys(pairs, num_items), pair_keys(drop, num_items))]


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
    buys = unique_pairs(interactions.pairs[target])
    target_users = np.unique(buys[:, 0])
    for a in auxiliaries:
        aux = interactions.pairs[a].reshape(-1, 2)
        if not np.isin(aux[:, 0], target_users).any():
            raise ValueError(
                f"behaviour {a!r}{where(a)}: none of its {len(aux)} rows has a user of the "
                f"target {target!r}{where(target)}; the files must use the same user ids")
    if test is not None:
        test = unique_pairs(np.asarray(test, np.int64).reshape(-1, 2))
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
        pairs = unique_pairs(pairs)
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
    out_train = {target: unique_pairs(train[target])}
    removed = {}
    for a in auxiliaries:
        pairs = unique_pairs(train[a])
        kept = _remove_pairs(pairs, heldout, num_items)
        removed[a] = len(pairs) - len(kept)
        out_train[a] = kept
    return MultiBehaviorData(
        num_users=int(num_users),
        num_items=int(num_items),
        behaviours=(target, *auxiliaries),
        train=out_train,
        validation=unique_pairs(val),
        test=unique_pairs(test),
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


def data_size(data: MultiBehaviorData, what: str) -> int:
    """`data.num_users` (`what="users"`), `data.num_items` ("items") or the number of
    behaviours ("tasks"): lets gin size the model from the data it loads, e.g.
    `NUM_USERS = @users/recsys_data.data_size()` with `users/recsys_data.data_size.what =
    'users'` (see gin/experiments/recsys/layouts/common.gin)."""
    sizes = {"users": data.num_users, "items": data.num_items, "tasks": len(data.behaviours)}
    if what not in sizes:
        raise ValueError(f"data_size(what={what!r}); accepted: {sorted(sizes)}")
    return sizes[what]

