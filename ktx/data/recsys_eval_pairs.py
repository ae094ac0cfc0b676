"""What full-ranking evaluation reads from the prepared data: which held-out users are
ranked (`subsample_users`), which training pairs are excluded from their rankings
(`training_exclusions`), and per-user item lists in CSR form (`user_item_lists`)."""

from __future__ import annotations

import numpy as np

from ktx.data.recsys_prepare import MultiBehaviorData
from ktx.data.recsys_readers import unique_pairs

__all__ = ["subsample_users", "training_exclusions", "user_item_lists"]


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


def user_item_lists(pairs: np.ndarray, num_users: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR of `pairs`: `(indptr [num_users + 1], items [n])`, items sorted per user."""
    pairs = unique_pairs(np.asarray(pairs).reshape(-1, 2))
    counts = np.bincount(pairs[:, 0], minlength=num_users)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return indptr, pairs[:, 1].astype(np.int64)
