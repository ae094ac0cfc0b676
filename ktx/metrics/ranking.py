"""Top-K ranking metrics and chunked full ranking over all items.

Definitions (per user with `R` held-out relevant items and ranked list `l_1..l_K`):

* Recall@K = |{l_1..l_K} ∩ relevant| / R
* Precision@K = |{l_1..l_K} ∩ relevant| / K
* NDCG@K = DCG / IDCG, DCG = Σ_j rel(l_j) / log2(j + 1), IDCG = Σ_{j ≤ min(R, K)} 1 / log2(j + 1)

averaged over users with `R > 0` (binary relevance, as in the MetaBalance paper's
evaluation, He et al., 2022).

`full_ranking` scores every item for every evaluated user, in chunks of users (and
blocks of items) so that memory stays bounded, masks each user's excluded items
(their training interactions) and keeps the top `max(ks)` with a jit-compiled
`lax.top_k`; the metrics are reduced on device. The model supplies a *scorer*
(`rank_user_part`, `rank_item_part`, `rank_scores`; see `RankingScorer`): per-user and
per-item factors are computed once and combined per pair, which is how
`ktx.models.recsys.RecsysModel` splits its first layers.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "RankingScorer",
    "topk_metrics",
    "metrics_from_ranked",
    "full_ranking",
    "METRIC_NAMES",
]

METRIC_NAMES = ("ndcg", "recall", "precision")


class RankingScorer(Protocol):
    def rank_user_part(self, params: Any, users: jax.Array) -> Mapping[str, jax.Array]: ...

    def rank_item_part(self, params: Any) -> Mapping[str, jax.Array]: ...

    def rank_scores(
        self, params: Any, user_part: Mapping[str, jax.Array], item_part: Mapping[str, jax.Array]
    ) -> jax.Array: ...


def _check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    ks = tuple(ks)
    if not ks or not all(isinstance(k, int) and k > 0 for k in ks):
        raise ValueError(f"ks={ks!r}: expected a non-empty sequence of positive ints")
    return ks


def topk_metrics(hits: jax.Array, num_relevant: jax.Array, ks: Sequence[int]) -> dict[str, jax.Array]:
    """Per-user metrics from ranked relevance.

    Args:
      hits: `[U, K_max]` 0/1, relevance of the ranked items (best first).
      num_relevant: `[U]` relevant items per user (R).
      ks: cut-offs, each `<= K_max`.
    Returns:
      `{"ndcg@K", "recall@K", "precision@K"}` -> `[U]` (0 where R == 0).
    """
    ks = _check_ks(ks)
    k_max = hits.shape[-1]
    if max(ks) > k_max:
        raise ValueError(f"ks={ks!r} exceed the {k_max} ranked items")
    hits = hits.astype(jnp.float32)
    discount = 1.0 / jnp.log2(jnp.arange(2, k_max + 2, dtype=jnp.float32))  # [K_max]
    ideal = jnp.concatenate([jnp.zeros(1), jnp.cumsum(discount)])  # ideal[r] = IDCG with r rel.
    r = num_relevant.astype(jnp.float32)
    valid = r > 0
    out = {}
    for k in ks:
        n_hit = hits[:, :k].sum(-1)
        dcg = (hits[:, :k] * discount[:k]).sum(-1)
        idcg = ideal[jnp.minimum(num_relevant, k).astype(jnp.int32)]
        out[f"ndcg@{k}"] = jnp.where(valid, dcg / jnp.maximum(idcg, 1e-12), 0.0)
        out[f"recall@{k}"] = jnp.where(valid, n_hit / jnp.maximum(r, 1.0), 0.0)
        out[f"precision@{k}"] = jnp.where(valid, n_hit / k, 0.0)
    return out


def metrics_from_ranked(
    ranked: np.ndarray, relevant: Sequence[Sequence[int]], ks: Sequence[int]
) -> dict[str, float]:
    """Mean metrics for explicit ranked lists (`[U, K_max]` item ids) and relevant sets."""
    ranked = np.asarray(ranked)
    hits = np.array([[item in set(rel) for item in row] for row, rel in zip(ranked, relevant)])
    nrel = np.array([len(set(r)) for r in relevant])
    per_user = topk_metrics(jnp.asarray(hits), jnp.asarray(nrel), ks)
    n = max(int((nrel > 0).sum()), 1)
    return {k: float(v.sum()) / n for k, v in per_user.items()}


def _bucket(n: int, minimum: int = 1024) -> int:
    return max(minimum, 1 << max(0, int(math.ceil(math.log2(max(n, 1))))))


def _chunk_pairs(indptr, items, users, num_items):
    """(rows, cols) of each chunk user's items, padded with col=num_items (dropped)."""
    starts, ends = indptr[users], indptr[users + 1]
    counts = ends - starts
    rows = np.repeat(np.arange(len(users)), counts)
    cols = items[np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])] if counts.sum() else np.zeros(0, np.int64)
    size = _bucket(len(rows))
    pad = size - len(rows)
    rows = np.concatenate([rows, np.zeros(pad, np.int64)]).astype(np.int32)
    cols = np.concatenate([cols, np.full(pad, num_items, np.int64)]).astype(np.int32)
    return rows, cols, counts


@functools.partial(jax.jit, static_argnames=("scorer", "ks", "num_items", "item_block"))
def _rank_chunk(params, item_part, users, ex_rows, ex_cols, rel_rows, rel_cols, num_rel, *,
                scorer, ks, num_items, item_block):
    user_part = scorer.rank_user_part(params, users)
    n_blocks = -(-num_items // item_block)
    if n_blocks == 1:
        scores = scorer.rank_scores(params, user_part, item_part)
    else:
        padded = n_blocks * item_block
        blocks = jax.tree.map(
            lambda x: jnp.pad(x, [(0, padded - num_items)] + [(0, 0)] * (x.ndim - 1)).reshape(
                (n_blocks, item_block) + x.shape[1:]
            ),
            dict(item_part),
        )
        per_block = jax.lax.map(lambda b: scorer.rank_scores(params, user_part, b), blocks)
        scores = jnp.moveaxis(per_block, 0, 1).reshape(users.shape[0], padded)[:, :num_items]
    scores = scores.astype(jnp.float32)
    scores = scores.at[ex_rows, ex_cols].set(-jnp.inf, mode="drop")
    _, top = jax.lax.top_k(scores, max(ks))  # [U, K_max]
    relevant = jnp.zeros(scores.shape, jnp.bool_).at[rel_rows, rel_cols].set(True, mode="drop")
    hits = jnp.take_along_axis(relevant, top, axis=1)
    per_user = topk_metrics(hits, num_rel, ks)
    return {k: v.sum() for k, v in per_user.items()}, (num_rel > 0).sum()


def full_ranking(
    scorer: RankingScorer,
    params: Any,
    *,
    num_users: int,
    num_items: int,
    heldout: np.ndarray,
    exclude: Sequence[np.ndarray] = (),
    ks: Sequence[int] = (10, 20),
    user_chunk: int = 256,
    item_block: int | None = 256,
    stats: dict | None = None,
) -> dict[str, float]:
    """Ranks all items for every user with held-out items; mean NDCG/Recall/Precision@K.

    Args:
      scorer: the model (see `RankingScorer`); scores are its target-task logits.
      params: the model's parameters (plain arrays, not boxed).
      num_users, num_items: id ranges.
      heldout: int `[n, 2]` (user, item) relevant pairs (validation or test).
      exclude: int `[m, 2]` pair arrays whose items are removed from each user's ranking
        (the user's training items).
      ks: cut-offs (the top `max(ks)` is kept).
      user_chunk: users scored per compiled call (memory ~ user_chunk x item_block x
        the widest layer).
      item_block: items scored at once inside a call (None: all items).
      stats: if given, filled with `users`, `pairs`, `seconds`.
    Returns:
      `{"ndcg@10": ..., "recall@10": ..., "precision@10": ..., ...}` averaged over
      users with at least one held-out item.
    """
    from ktx.data.recsys import user_item_lists

    ks = _check_ks(ks)
    if max(ks) > num_items:
        raise ValueError(f"ks={ks!r}: the largest exceeds num_items={num_items}")
    if not isinstance(user_chunk, int) or user_chunk < 1:
        raise ValueError(f"user_chunk={user_chunk!r}: expected a positive int")
    heldout = np.asarray(heldout).reshape(-1, 2)
    rel_ptr, rel_items = user_item_lists(heldout, num_users)
    ex = np.concatenate([np.asarray(e).reshape(-1, 2) for e in exclude]) if exclude else np.zeros((0, 2), np.int64)
    ex_ptr, ex_items = user_item_lists(ex, num_users)
    eval_users = np.flatnonzero(np.diff(rel_ptr) > 0)
    if not len(eval_users):
        raise ValueError("full_ranking: `heldout` has no (user, item) pair, so there is no user to rank")
    block = num_items if item_block is None else min(int(item_block), num_items)
    t0 = time.perf_counter()
    item_part = jax.jit(scorer.rank_item_part)(params)
    totals: dict[str, float] = {}
    n_users = 0
    for lo in range(0, len(eval_users), user_chunk):
        users = eval_users[lo:lo + user_chunk]
        pad = user_chunk - len(users)
        users_p = np.concatenate([users, np.full(pad, users[0])])
        er, ec, _ = _chunk_pairs(ex_ptr, ex_items, users, num_items)
        rr, rc, nrel = _chunk_pairs(rel_ptr, rel_items, users, num_items)
        nrel = np.concatenate([nrel, np.zeros(pad, np.int64)]).astype(np.int32)
        sums, count = _rank_chunk(
            params, item_part, jnp.asarray(users_p, jnp.int32), er, ec, rr, rc, nrel,
            scorer=scorer, ks=ks, num_items=num_items, item_block=block,
        )
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + float(v)
        n_users += int(count)
    if stats is not None:
        stats.update(users=n_users, pairs=n_users * num_items, seconds=time.perf_counter() - t0)
    return {k: v / max(n_users, 1) for k, v in totals.items()}
