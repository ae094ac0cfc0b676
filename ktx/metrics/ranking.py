"""Top-K ranking metrics and chunked full ranking over all items.

Definitions (per user with `R` held-out relevant items and ranked list `l_1..l_K`):

* Recall@K = |{l_1..l_K} ∩ relevant| / R
* Precision@K = |{l_1..l_K} ∩ relevant| / K
* NDCG@K = DCG / IDCG, DCG = Σ_j rel(l_j) / log2(j + 1), IDCG = Σ_{j ≤ min(R, K)} 1 / log2(j + 1)

averaged over users with `R > 0` (binary relevance, as in the MetaBalance paper's
evaluation, He et al., 2022).

`full_ranking` scores every item for every evaluated user: chunks of users, each
scored against all items in blocks (sizes from `ranking_chunks`: cache-sized blocks on a
CPU, memory-sized on an accelerator), each user's excluded items (their training
interactions) masked, the exact top `max(ks)` kept with `lax.top_k` (ties to the lower
item id). All chunks run in one compiled `lax.scan` that returns per-user metrics once;
with a mesh the chunks are split over its `data` axis. The model supplies a *scorer*
(`rank_user_part`, `rank_item_part`, `rank_scores`; see `RankingScorer`): per-user and
per-item factors are computed once and combined per pair, which is how
`ktx.models.recsys.RecsysModel` splits its first layers.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "RankingScorer",
    "topk_metrics",
    "metrics_from_ranked",
    "full_ranking",
    "ranking_chunks",
    "available_memory_bytes",
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


def _bucket(n: int, minimum: int = 64) -> int:
    return max(minimum, 1 << max(0, int(math.ceil(math.log2(max(n, 1))))))


# On a CPU the item block is sized to stay in cache (its intermediates: pairs x the
# model's bytes per pair). On the 2-core development machine (docs/results_recsys.md)
# 64 users x ~233 items (15k pairs, 16 MiB at the paper network's 1,124 bytes per pair)
# ran 1.3-1.6x faster than 256 x 256 in the same run, and 8k-pair blocks were no faster.
# CPU devices that rank side by side on one host (a mesh of one device per core) share
# its caches: each takes an equal share of both (per device of two, 32 x 233 ranked at
# 0.59 of the matmul peak against 0.57 for 64 x 233 in the same run, 0.62 in another).
# On accelerators the chunk and the block are sized from free device memory.
CPU_BLOCK_BYTES = 16 << 20
CPU_USER_CHUNK = 64
DEFAULT_BYTES_PER_PAIR = 1024


def available_memory_bytes(device: jax.Device | None = None) -> int:
    """Free memory of `device` (default: the first local device): its allocator's
    `bytes_limit - bytes_in_use` where it reports one, else the host's available RAM."""
    device = device or jax.local_devices()[0]
    try:
        st = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU clients may not implement memory_stats
        st = {}
    if st.get("bytes_limit"):
        return int(st["bytes_limit"]) - int(st.get("bytes_in_use", 0))
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def ranking_chunks(
    num_items: int,
    num_users: int,
    *,
    bytes_per_pair: int = DEFAULT_BYTES_PER_PAIR,
    platform: str | None = None,
    memory_bytes: int | None = None,
    host_devices: int = 1,
) -> tuple[int, int]:
    """`(user_chunk, item_block)` for ranking `num_users` users over `num_items` items.

    A compiled step scores `user_chunk` users against all items in blocks of
    `item_block` items, keeping `[user_chunk, num_items]` float32 scores plus masks and
    one block's intermediates (`user_chunk * item_block * bytes_per_pair`). On a CPU the
    block is cache-sized (`CPU_BLOCK_BYTES`) and the chunk `CPU_USER_CHUNK` users, both
    shared by the `host_devices` CPU devices of this host that rank at once (each gets
    `1 / host_devices` of them); on an accelerator a quarter of `memory_bytes` (default
    `available_memory_bytes()`) is split evenly between the scores and the block.
    """
    platform = platform or jax.local_devices()[0].platform
    if not isinstance(host_devices, int) or isinstance(host_devices, bool) or host_devices < 1:
        raise ValueError(f"ranking_chunks: host_devices={host_devices!r}; expected a positive int")
    if platform == "cpu":
        user_chunk = min(max(8, CPU_USER_CHUNK // host_devices), _bucket(num_users, 8))
        pairs = max(1, CPU_BLOCK_BYTES // host_devices // max(1, bytes_per_pair))
    else:
        budget = (available_memory_bytes() if memory_bytes is None else int(memory_bytes)) // 4
        per_user = num_items * 16  # scores f32, the exclusion and relevance masks, top-k work
        user_chunk = max(8, min(_bucket(num_users, 8), 8192, budget // 2 // per_user))
        pairs = max(1, budget // 2 // max(1, bytes_per_pair))
    item_block = max(8, min(num_items, pairs // user_chunk))
    return int(user_chunk), int(item_block)


def _chunk_pairs(indptr: np.ndarray, items: np.ndarray, users: np.ndarray, num_items: int):
    """The items of each user of `users [C, U]` (-1 = padding) as padded scatter indices:
    `rows [C, L]` (position in the chunk), `cols [C, L]` (item; `num_items` for padding,
    dropped by the scatter) and `counts [C, U]`."""
    C, U = users.shape
    flat = users.reshape(-1)
    real = flat >= 0
    safe = np.where(real, flat, 0)
    counts = np.where(real, indptr[safe + 1] - indptr[safe], 0)
    total = int(counts.sum())
    pos = np.repeat(np.arange(C * U), counts)
    offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    cols = items[np.repeat(indptr[safe], counts) + offsets] if total else np.zeros(0, np.int64)
    chunk = pos // U
    per_chunk = np.bincount(chunk, minlength=C)
    width = _bucket(int(per_chunk.max()) if total else 1)
    slot = np.arange(total) - np.repeat(np.cumsum(per_chunk) - per_chunk, per_chunk)
    rows_out = np.zeros((C, width), np.int32)
    cols_out = np.full((C, width), num_items, np.int32)
    rows_out[chunk, slot] = pos % U
    cols_out[chunk, slot] = cols
    return rows_out, cols_out, counts.reshape(C, U).astype(np.int32)


def _rank_chunk(params, blocks, users, ex_rows, ex_cols, rel_rows, rel_cols, num_rel, *,
                scorer, ks, num_items):
    """Per-user metrics `{name: [U]}` of one chunk of users (all items, masked, top-K)."""
    user_part = scorer.rank_user_part(params, users)
    per_block = jax.lax.map(lambda b: scorer.rank_scores(params, user_part, b), blocks)
    n_blocks, n_users, block = per_block.shape
    scores = jnp.moveaxis(per_block, 0, 1).reshape(n_users, n_blocks * block)[:, :num_items]
    scores = scores.astype(jnp.float32).at[ex_rows, ex_cols].set(-jnp.inf, mode="drop")
    _, top = jax.lax.top_k(scores, max(ks))  # [U, K_max], ties to the lower item id
    relevant = jnp.zeros(scores.shape, jnp.bool_).at[rel_rows, rel_cols].set(True, mode="drop")
    return topk_metrics(jnp.take_along_axis(relevant, top, axis=1), num_rel, ks)


# Where the per-chunk callback of a ranking compiled with `report=True` goes: the compiled
# function is cached, so its callback is this fixed function, and `full_ranking` points it
# at the caller's `progress` for the length of one call.
_chunk_listener: dict[str, Callable[[int], None] | None] = {"fn": None}


def _chunk_ranked(users, _) -> None:
    fn = _chunk_listener["fn"]
    if fn is not None:
        fn(int(users))


def _rank_all(params, users, ex_rows, ex_cols, rel_rows, rel_cols, num_rel, *,
              scorer, ks, num_items, item_block, axes, report=False):
    """Every chunk (`[C, ...]` inputs) in one `lax.scan`: `{name: [C, U]}` per-user metrics.
    Inside `shard_map` (`axes`) each device scans its own chunks; the results are gathered.
    With `report`, each chunk, once ranked, calls back the host with its number of users."""
    item_part = dict(scorer.rank_item_part(params))
    n_blocks = -(-num_items // item_block)
    padded = n_blocks * item_block
    blocks = jax.tree.map(
        lambda x: jnp.pad(x, [(0, padded - num_items)] + [(0, 0)] * (x.ndim - 1)).reshape(
            (n_blocks, item_block) + x.shape[1:]), item_part)

    def step(_, xs):
        out = _rank_chunk(params, blocks, *xs, scorer=scorer, ks=ks, num_items=num_items)
        if report:  # after the chunk's metrics (a data dependency), its real users' count
            jax.debug.callback(_chunk_ranked, jnp.sum(xs[-1] > 0), jax.tree.leaves(out)[0][0])
        return None, out

    _, out = jax.lax.scan(step, None, (users, ex_rows, ex_cols, rel_rows, rel_cols, num_rel))
    if axes:
        out = jax.tree.map(lambda x: jax.lax.all_gather(x, axes, tiled=True), out)
    return out


@functools.lru_cache(maxsize=32)
def _compiled(scorer, ks, num_items, item_block, mesh, axes, report=False):
    fn = functools.partial(_rank_all, scorer=scorer, ks=ks, num_items=num_items,
                           item_block=item_block, axes=axes, report=report)
    if axes:
        spec = PartitionSpec(axes)
        fn = jax.shard_map(fn, mesh=mesh, in_specs=(PartitionSpec(),) + (spec,) * 6,
                           out_specs=PartitionSpec(), check_vma=False)
    return jax.jit(fn)


def _check_ids(name: str, pairs: np.ndarray, num_users: int, num_items: int) -> None:
    if not len(pairs):
        return
    bad = (pairs[:, 0] < 0) | (pairs[:, 0] >= num_users) | (pairs[:, 1] < 0) | (pairs[:, 1] >= num_items)
    if bad.any():
        first = pairs[np.flatnonzero(bad)[0]]
        raise ValueError(
            f"full_ranking: {int(bad.sum())} {name} pair(s) have ids outside the tables "
            f"({num_users} users x {num_items} items), the first (user {first[0]}, item "
            f"{first[1]}); the model's NUM_USERS / NUM_ITEMS must cover the data's ids"
        )


def full_ranking(
    scorer: RankingScorer,
    params: Any,
    *,
    num_users: int,
    num_items: int,
    heldout: np.ndarray,
    exclude: Sequence[np.ndarray] = (),
    ks: Sequence[int] = (10, 20),
    user_chunk: int | None = None,
    item_block: int | None = None,
    mesh: Mesh | None = None,
    stats: dict | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Ranks all items for every user with held-out items; mean NDCG/Recall/Precision@K.

    The users are cut into chunks of `user_chunk`; one compiled call scans every chunk
    (a `lax.scan`, blocks of `item_block` items inside), keeps each user's metrics on
    the device and returns them once, so the host neither syncs nor transfers per
    chunk. With a `mesh`, the chunks are split over its `data` (and `model`) axes
    (`shard_map`), each device ranking its own users; the per-user metrics are summed
    on the host in float64, so the result does not depend on the number of devices.

    Args:
      scorer: the model (see `RankingScorer`); scores are its target-task logits.
      params: the model's parameters (plain arrays, not boxed).
      num_users, num_items: id ranges; a pair outside them is an error.
      heldout: int `[n, 2]` (user, item) relevant pairs (validation or test).
      exclude: int `[m, 2]` pair arrays whose items are removed from each user's ranking
        (the user's training items).
      ks: cut-offs (the top `max(ks)` is kept).
      user_chunk, item_block: users per scan step and items per scored block (None:
        `ranking_chunks`, from the platform and its free memory).
      mesh: a `(data, model)` mesh to shard the users over (None: one device).
      stats: if given, filled with `users`, `pairs`, `seconds`, `user_chunk`, `item_block`.
      progress: if given, called on the host with the number of users of each chunk as it
        is ranked (this process's devices; a device callback per chunk), e.g.
        `ktx.runs.eval_progress.EvalProgress.add`. None: no callback is compiled in.
    Returns:
      `{"ndcg@10": ..., "recall@10": ..., "precision@10": ..., ...}` averaged over
      users with at least one held-out item.
    """
    from ktx.data.recsys import user_item_lists

    ks = _check_ks(ks)
    if max(ks) > num_items:
        raise ValueError(f"ks={ks!r}: the largest exceeds num_items={num_items}")
    for name, v in (("user_chunk", user_chunk), ("item_block", item_block)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name}={v!r}: expected None or a positive int")
    heldout = np.asarray(heldout).reshape(-1, 2)
    ex = np.concatenate([np.asarray(e).reshape(-1, 2) for e in exclude]) if exclude else np.zeros((0, 2), np.int64)
    _check_ids("held-out", heldout, num_users, num_items)
    _check_ids("excluded", ex, num_users, num_items)
    rel_ptr, rel_items = user_item_lists(heldout, num_users)
    ex_ptr, ex_items = user_item_lists(ex, num_users)
    eval_users = np.flatnonzero(np.diff(rel_ptr) > 0)
    if not len(eval_users):
        raise ValueError("full_ranking: `heldout` has no (user, item) pair, so there is no user to rank")
    axes = tuple(a for a in ("data", "model") if mesh is not None and mesh.shape.get(a, 1) > 1)
    shards = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    # The mesh's devices of this process rank side by side (on a CPU: share its caches).
    here = sum(d.process_index == jax.process_index() for d in mesh.devices.flat) if axes else 1
    auto_chunk, auto_block = ranking_chunks(
        num_items, -(-len(eval_users) // shards),
        bytes_per_pair=getattr(scorer, "rank_bytes_per_pair", lambda: DEFAULT_BYTES_PER_PAIR)(),
        host_devices=max(1, int(here)))
    user_chunk = user_chunk or auto_chunk
    block = min(item_block or auto_block, num_items)
    t0 = time.perf_counter()
    n_chunks = -(-len(eval_users) // user_chunk)
    n_chunks = -(-n_chunks // shards) * shards
    users = np.full(n_chunks * user_chunk, -1, np.int64)
    users[:len(eval_users)] = eval_users
    users = users.reshape(n_chunks, user_chunk)
    er, ec, _ = _chunk_pairs(ex_ptr, ex_items, users, num_items)
    rr, rc, nrel = _chunk_pairs(rel_ptr, rel_items, users, num_items)
    inputs = (np.maximum(users, 0).astype(np.int32), er, ec, rr, rc, nrel)
    if axes:
        sharding = NamedSharding(mesh, PartitionSpec(axes))
        inputs = tuple(jax.make_array_from_callback(x.shape, sharding, lambda i, x=x: x[i])
                       for x in inputs)
    fn = _compiled(scorer, ks, num_items, block, mesh if axes else None, axes, progress is not None)
    _chunk_listener["fn"] = progress
    try:
        per_user = jax.device_get(fn(params, *inputs))
    finally:
        _chunk_listener["fn"] = None
    n_users = int((nrel > 0).sum())
    if stats is not None:
        stats.update(users=n_users, pairs=n_users * num_items, seconds=time.perf_counter() - t0,
                     user_chunk=user_chunk, item_block=block)
    return {k: float(np.asarray(v, np.float64).sum()) / max(n_users, 1) for k, v in per_user.items()}
