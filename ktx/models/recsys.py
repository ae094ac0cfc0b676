"""The shared-bottom multi-behaviour recommender of the MetaBalance paper (He et al., 2022).

Its Figure 4.4: user and item embeddings feed a shared bottom that combines an MLP over
the concatenated embeddings (32, 16, 8) with a matrix-factorization layer (the
element-wise product of the two embeddings, as in NeuMF, He et al., 2017); the two
outputs are concatenated (`[batch, mlp_dims[-1] + embed_dim]`) and fed to one tower MLP
(64, 32) per behaviour, each ending in one logit. Every task's loss is binary
cross-entropy on its own rows (`task_id`), averaged per task (`loss_normalization=
"per_task"`), so `loss_fn` is the sum of task means that the paper optimises.

`gmf_dim` set gives the authors' NeuMF layout instead (the MetaBalance training script
builds the NCF model of He et al., 2017, as in its reference PyTorch port: `--factor_num`
32, 3 MLP layers): separate tables per side for the two branches, the MLP tables
(`user_embedding`, `item_embedding`, `embed_dim` wide: the script's 128) feeding the MLP
(128, 64, 32) and the GMF tables (`user_gmf`, `item_gmf`, `gmf_dim` wide: 32) feeding
the element-wise product, the tower input being `[mlp_out; u_gmf * i_gmf]`. `tower_dims=()`
makes each task's tower one linear layer to its logit (the script's
`predict_layer_<behaviour>`), `dropout_placement="before"` puts dropout on each MLP
layer's input as NCF does (the embeddings included, none after the last layer), and
`bottom_init="xavier_uniform"` is NCF's MLP init. gin/models/recsys_neumf.gin binds it.

Batches (`RecsysModel.input_spec`): `user` int32 `[B]`, `item` int32 `[B]`, `label` float32 `[B]`
(1 for an interaction, 0 for a sampled negative), `task_id` int32 `[B]`.

For full ranking, `RecsysModel` implements the scorer protocol of
`ktx.metrics.ranking`: the first MLP layer, `W [u; i] + b`, splits into a user part
`W_u u + b` and an item part `W_i i` computed once per user and once per item; the
tower's first layer splits the same way over `[mlp_out; u * i]`, the
matrix-factorization part being `i @ (u[:, None] * W_mf)` per user.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ktx import task_taps
from ktx import partitioning as P
from ktx.models.base import BaseModel, Batch, RowDropout, row_ids, segment_sum_by_task

__all__ = [
    "SharedBottomNet",
    "RecsysModel",
    "RECSYS_FEATURES",
    "SHARED_PARAM_PATTERNS",
    "PopularityScorer",
]

RECSYS_FEATURES = ("user", "item", "label", "task_id")
# Parameters every task's loss touches (the ones a balancer balances): the embedding
# tables and the shared bottom. The stacked per-task towers (`towers/...`) are touched
# by one task per slice and are not balanced.
SHARED_PARAM_PATTERNS = (
    r"^user_embedding/", r"^item_embedding/", r"^user_gmf/", r"^item_gmf/", r"^bottom/")
# Every embedding table (the GMF ones exist with `gmf_dim` only).
SPARSE_TABLE_PATTERNS = (r"^user_embedding/embedding$", r"^item_embedding/embedding$",
                         r"^user_gmf/embedding$", r"^item_gmf/embedding$")
DROPOUT_PLACEMENTS = ("after", "before")
BOTTOM_INITS = ("lecun_normal", "xavier_uniform")


def _check_dims(name: str, dims: Any, allow_empty: bool = False) -> tuple[int, ...]:
    dims = tuple(dims)
    if (not dims and not allow_empty) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        what = "a sequence" if allow_empty else "a non-empty sequence"
        raise ValueError(f"{name}={dims!r}: expected {what} of positive ints")
    return dims


class SharedBottomNet(nn.Module):
    """`(user [B], item [B]) -> logits [B, num_tasks]` (every task's tower on every row).

    Parameters (logical axes): `user_embedding/embedding [users, embed]`,
    `item_embedding/embedding [items, embed]`, with `gmf_dim` also
    `user_gmf/embedding [users, gmf]` and `item_gmf/embedding [items, gmf]`,
    `bottom/layer_k/{kernel, bias}` (`[in, mlp]`), `towers/layer_k_kernel [tasks, in,
    mlp]`, `towers/layer_k_bias [tasks, mlp]`, `towers/out_kernel [tasks, in]`,
    `towers/out_bias [tasks]`. The towers' input is `[B, mlp_dims[-1] + mf]` with `mf`
    the product's width (`gmf_dim`, else `embed_dim`).
    """

    num_users: int
    num_items: int
    num_tasks: int
    embed_dim: int = 64
    mlp_dims: Sequence[int] = (32, 16, 8)
    tower_dims: Sequence[int] = (64, 32)
    dropout_rate: float = 0.5
    embedding_init_stddev: float = 0.01
    table_rows_multiple: int = 1
    gmf_dim: int | None = None
    dropout_placement: str = "after"
    bottom_init: str = "lecun_normal"
    dtype: Any = jnp.float32

    def setup(self):
        init = nn.initializers.normal(stddev=self.embedding_init_stddev)
        rows = lambda n: -(-n // self.table_rows_multiple) * self.table_rows_multiple  # noqa: E731
        self.user_embedding = nn.Embed(
            rows(self.num_users),
            self.embed_dim,
            embedding_init=nn.with_logical_partitioning(init, (P.USERS, P.EMBED)),
            name="user_embedding",
        )
        self.item_embedding = nn.Embed(
            rows(self.num_items),
            self.embed_dim,
            embedding_init=nn.with_logical_partitioning(init, (P.ITEMS, P.EMBED)),
            name="item_embedding",
        )
        if self.gmf_dim is not None:
            self.user_gmf = nn.Embed(
                rows(self.num_users), self.gmf_dim,
                embedding_init=nn.with_logical_partitioning(init, (P.USERS, P.EMBED)),
                name="user_gmf",
            )
            self.item_gmf = nn.Embed(
                rows(self.num_items), self.gmf_dim,
                embedding_init=nn.with_logical_partitioning(init, (P.ITEMS, P.EMBED)),
                name="item_gmf",
            )
        self.bottom = _Mlp(tuple(self.mlp_dims), self.dropout_placement == "before",
                           self.bottom_init, name="bottom")
        self.towers = _StackedTowers(self.num_tasks, tuple(self.tower_dims), name="towers")
        self.dropout = RowDropout(self.dropout_rate)

    def embed(self, user: jax.Array, item: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`[B]` ids -> `([B, embed], [B, embed])`."""
        return self.user_embedding(user), self.item_embedding(item)

    def __call__(
        self, user: jax.Array, item: jax.Array, train: bool = False, ids: jax.Array | None = None
    ) -> jax.Array:
        """`ids`: `[B]` row numbers keying the dropout masks (default: positions)."""
        u, i = self.embed(user, item)
        if ids is None:
            ids = jnp.arange(user.shape[0], dtype=jnp.int32)

        def dropout(x):
            return self.dropout(x, ids, deterministic=not train)

        h = self.bottom(jnp.concatenate([u, i], axis=-1), dropout)
        if self.gmf_dim is not None:  # NeuMF: the product of the GMF tables' rows
            u, i = self.user_gmf(user), self.item_gmf(item)
        shared = jnp.concatenate([h, u * i], axis=-1)  # [B, mlp_dims[-1] + mf]
        return self.towers(shared, dropout)  # [B, T]


class _Dense(nn.Module):
    """`nn.Dense` (the same parameters, `kernel [in, out]` and `bias [out]`, and the same
    product) that reads them through task taps when a balanced step gives it some
    (`ktx.task_taps`)."""

    features: int
    kernel_init: Any
    bias_init: Any

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), jnp.float32)
        bias = self.param("bias", self.bias_init, (self.features,), jnp.float32)
        y = task_taps.param_contract(self, "kernel", x, kernel)
        return y + task_taps.param_rows(self, "bias", bias, y)


class _Mlp(nn.Module):
    """ReLU MLP `[B, in] -> [B, dims[-1]]`, dropout after every layer when training
    (`dropout_before`: on every layer's input instead, as NCF's MLP)."""

    dims: tuple[int, ...]
    dropout_before: bool = False
    kernel_init: str = "lecun_normal"

    @nn.compact
    def __call__(self, x, dropout):
        init = {"lecun_normal": nn.initializers.lecun_normal(),
                "xavier_uniform": nn.initializers.xavier_uniform()}[self.kernel_init]
        for k, d in enumerate(self.dims):
            if self.dropout_before:
                x = dropout(x)
            x = _Dense(
                d,
                kernel_init=nn.with_logical_partitioning(init, (P.EMBED, P.MLP)),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (P.MLP,)),
                name=f"layer_{k}",
            )(x)
            x = nn.relu(x)
            if not self.dropout_before:
                x = dropout(x)
        return x


class _StackedTowers(nn.Module):
    """One MLP + logit per task, stacked on a leading `tasks` axis: `[B, in] -> [B, T]`
    (no `dims`: one linear layer per task)."""

    num_tasks: int
    dims: tuple[int, ...]

    @nn.compact
    def __call__(self, x, dropout):
        T = self.num_tasks
        kinit = nn.initializers.lecun_normal(batch_axis=(0,))
        h = None
        for k, d in enumerate(self.dims):
            d_in = x.shape[-1] if h is None else h.shape[-1]
            w = self.param(
                f"layer_{k}_kernel",
                nn.with_logical_partitioning(kinit, (P.TASKS, P.EMBED, P.MLP)),
                (T, d_in, d),
            )
            b = self.param(
                f"layer_{k}_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (P.TASKS, P.MLP)),
                (T, d),
            )
            if h is None:  # the input is shared by all towers: one [B, in] x [in, T*d] matmul
                h = jnp.einsum("bi,tid->btd", x, w) + b
            else:
                h = jnp.einsum("bti,tid->btd", h, w) + b
            h = dropout(nn.relu(h))
        w = self.param(
            "out_kernel",
            nn.with_logical_partitioning(kinit, (P.TASKS, P.MLP)),
            (T, x.shape[-1] if h is None else h.shape[-1]),
        )
        b = self.param("out_bias", nn.with_logical_partitioning(nn.initializers.zeros, (P.TASKS,)), (T,))
        if h is None:  # no hidden layer: each tower is one linear layer (NCF's predict layer)
            return jnp.einsum("bi,ti->bt", x, w) + b
        return jnp.einsum("btd,td->bt", h, w) + b


@dataclasses.dataclass(eq=False)  # hashed by identity: a static jit argument
class RecsysModel(BaseModel):
    """`BaseModel` wrapper of `SharedBottomNet`: per-task BCE, aux loss/accuracy/weight.

    Args:
      num_users, num_items: table sizes (ids must lie in `[0, size)`).
      num_tasks: behaviours, the target first (task 0 is ranked by `ktx.metrics.ranking`).
      embed_dim, mlp_dims, tower_dims, dropout_rate: the network (paper: 64, (32, 16, 8),
        (64, 32), 0.5).
      target_task: the task whose tower full ranking scores.
      embedding_init_stddev: standard deviation of the normal init of both tables.
      table_rows_multiple: the tables' rows are padded up to a multiple of this (1: none).
        The tables' `users` / `items` axes shard over the mesh's `model` axis, whose size
        must divide them (e.g. 128, as vocabularies are padded, for any TPU split); padded
        rows are never looked up nor ranked, and change no loss or metric.
      gmf_dim: None (one table per side feeds both the MLP and the product) or the width
        of separate GMF tables for the product (NeuMF, the authors' script: 32, with
        `embed_dim` 128 for the MLP tables).
      dropout_placement: "after" every MLP layer's ReLU (bottom and towers), or "before"
        every bottom layer (its input; NCF's MLP), the towers' hidden layers keeping "after".
      bottom_init: the bottom's kernel init, "lecun_normal" or "xavier_uniform" (NCF's).
      tower_dims may be empty: each tower is then one linear layer to its logit.
    """

    num_users: int
    num_items: int
    num_tasks: int
    embed_dim: int = 64
    mlp_dims: Sequence[int] = (32, 16, 8)
    tower_dims: Sequence[int] = (64, 32)
    dropout_rate: float = 0.5
    target_task: int = 0
    loss_normalization: str = "per_task"
    embedding_init_stddev: float = 0.01
    table_rows_multiple: int = 1
    gmf_dim: int | None = None
    dropout_placement: str = "after"
    bottom_init: str = "lecun_normal"

    def __post_init__(self):
        for name in ("num_users", "num_items", "num_tasks", "embed_dim", "table_rows_multiple"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RecsysModel.{name}={v!r}: expected a positive int")
        self.mlp_dims = _check_dims("RecsysModel.mlp_dims", self.mlp_dims)
        self.tower_dims = _check_dims("RecsysModel.tower_dims", self.tower_dims, allow_empty=True)
        if self.gmf_dim is not None and (
                not isinstance(self.gmf_dim, int) or isinstance(self.gmf_dim, bool) or self.gmf_dim < 1):
            raise ValueError(f"RecsysModel.gmf_dim={self.gmf_dim!r}: expected None or a positive int")
        if self.dropout_placement not in DROPOUT_PLACEMENTS:
            raise ValueError(f"RecsysModel.dropout_placement={self.dropout_placement!r}; "
                             f"accepted: {DROPOUT_PLACEMENTS}")
        if self.bottom_init not in BOTTOM_INITS:
            raise ValueError(f"RecsysModel.bottom_init={self.bottom_init!r}; accepted: {BOTTOM_INITS}")
        if not 0.0 <= float(self.dropout_rate) < 1.0:
            raise ValueError(f"RecsysModel.dropout_rate={self.dropout_rate!r}: expected [0, 1)")
        if not float(self.embedding_init_stddev) > 0:
            raise ValueError(
                f"RecsysModel.embedding_init_stddev={self.embedding_init_stddev!r}: expected > 0"
            )
        if not 0 <= self.target_task < self.num_tasks:
            raise ValueError(
                f"RecsysModel.target_task={self.target_task!r}: expected 0..{self.num_tasks - 1}"
            )
        if self.loss_normalization not in ("global", "per_task"):
            raise ValueError(
                f"RecsysModel.loss_normalization={self.loss_normalization!r}; "
                "accepted: ('global', 'per_task')"
            )
        self.module = SharedBottomNet(
            num_users=self.num_users,
            num_items=self.num_items,
            num_tasks=self.num_tasks,
            embed_dim=self.embed_dim,
            mlp_dims=self.mlp_dims,
            tower_dims=self.tower_dims,
            dropout_rate=float(self.dropout_rate),
            embedding_init_stddev=float(self.embedding_init_stddev),
            table_rows_multiple=self.table_rows_multiple,
            gmf_dim=self.gmf_dim,
            dropout_placement=self.dropout_placement,
            bottom_init=self.bottom_init,
        )

    shared_param_patterns = SHARED_PARAM_PATTERNS
    # The Trainer's default `sparse_tables`: per-task gradients of the two tables stay
    # looked-up rows (`ktx.optim.sparse`).
    sparse_table_patterns = SPARSE_TABLE_PATTERNS

    # --- BaseModel -----------------------------------------------------------------
    def init_variables(self, rng: jax.Array, batch: Batch) -> Any:
        return self.module.init(
            {"params": rng}, jnp.asarray(batch["user"]), jnp.asarray(batch["item"]), False
        )

    def input_spec(
        self, batch_size: int, feature_lengths: Mapping[str, int] | None = None
    ) -> dict[str, jax.ShapeDtypeStruct]:
        del feature_lengths  # every feature is one value per row
        return {
            "user": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
            "item": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
            "label": jax.ShapeDtypeStruct((batch_size,), jnp.float32),
            "task_id": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        }

    def task_weights(self, batch: Batch) -> jax.Array:
        task_id = jnp.asarray(batch["task_id"])
        return segment_sum_by_task(jnp.ones(task_id.shape, jnp.float32), task_id, self.num_tasks)

    def logits(self, params: Any, batch: Batch, rng: jax.Array | None, train: bool) -> jax.Array:
        """`[B]` logit of each row's own task."""
        rngs = {"dropout": rng} if (train and rng is not None and self.dropout_rate > 0) else None
        if train and rngs is None and self.dropout_rate > 0:
            raise ValueError("RecsysModel.logits: train=True with dropout needs an rng")
        all_logits = self.module.apply(
            {"params": params}, batch["user"], batch["item"], train, row_ids(batch), rngs=rngs
        )  # [B, T]
        task_id = jnp.asarray(batch["task_id"])
        return jnp.take_along_axis(all_logits, task_id[:, None], axis=1)[:, 0]

    def loss_sums(
        self, params: Any, batch: Batch, rng: jax.Array | None, train: bool
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        logits = self.logits(params, batch, rng, train)
        label = jnp.asarray(batch["label"], jnp.float32)
        task_id = jnp.asarray(batch["task_id"])
        bce = optax.sigmoid_binary_cross_entropy(logits, label)
        correct = ((logits > 0).astype(jnp.float32) == label).astype(jnp.float32)
        sums = segment_sum_by_task(bce, task_id, self.num_tasks)
        aux = {
            "loss": sums,
            "accuracy": segment_sum_by_task(correct, task_id, self.num_tasks),
            "weight": self.task_weights(batch),
        }
        return sums, aux

    # --- scorer protocol of ktx.metrics.ranking ----------------------------------------
    def _mf_tables(self, params: Any) -> tuple[jax.Array, jax.Array]:
        """The user and item tables whose rows' product enters the towers."""
        if self.gmf_dim is None:
            return params["user_embedding"]["embedding"], params["item_embedding"]["embedding"]
        return params["user_gmf"]["embedding"], params["item_gmf"]["embedding"]

    def _first_tower_layer(self, params: Any) -> tuple[jax.Array, jax.Array]:
        """The target tower's first layer as `(kernel [m_last + mf, h0], bias [h0])`: its
        first hidden layer, or its output layer (`h0` = 1) when it has none."""
        towers, t = params["towers"], self.target_task
        if self.tower_dims:
            return towers["layer_0_kernel"][t], towers["layer_0_bias"][t]
        return towers["out_kernel"][t][:, None], towers["out_bias"][t][None]

    def rank_user_part(self, params: Any, users: jax.Array) -> dict[str, jax.Array]:
        """Per-user factors for full ranking: `users [U]` -> dict of `[U, ...]` arrays."""
        u = params["user_embedding"]["embedding"][users]
        d = self.embed_dim
        w0 = params["bottom"]["layer_0"]["kernel"]  # [2d, m0]
        u_mf = self._mf_tables(params)[0][users]  # [U, mf]
        tw, _ = self._first_tower_layer(params)  # [m_last + mf, h0]
        m_last = self.mlp_dims[-1]
        return {
            "bottom0": u @ w0[:d] + params["bottom"]["layer_0"]["bias"],  # [U, m0]
            # (u * i) @ W_mf = i @ (u[:, None] * W_mf): one [mf, h0] matrix per user, laid
            # out as one [mf, U * h0] matrix so that all users cost a single GEMM.
            "mf": (u_mf[:, :, None] * tw[m_last:][None]).transpose(1, 0, 2).reshape(u_mf.shape[1], -1),
        }

    def rank_item_part(self, params: Any) -> dict[str, jax.Array]:
        """Per-item factors for full ranking, computed once: dict of `[N, ...]` arrays."""
        i = params["item_embedding"]["embedding"][: self.num_items]  # without padded rows
        w0 = params["bottom"]["layer_0"]["kernel"]
        i_mf = self._mf_tables(params)[1][: self.num_items]
        return {"emb": i_mf, "bottom0": i @ w0[self.embed_dim:]}  # [N, mf], [N, m0]

    def rank_scores(
        self, params: Any, user_part: Mapping[str, jax.Array], item_part: Mapping[str, jax.Array]
    ) -> jax.Array:
        """Target-task logits `[U, N]` of every (user, item) pair from the two parts.

        Computed item-major (`[N, U, ...]`) so the matrix-factorization term is one GEMM.
        """
        n = item_part["emb"].shape[0]
        h = nn.relu(item_part["bottom0"][:, None, :] + user_part["bottom0"][None])  # [N, U, m0]
        n_users = user_part["bottom0"].shape[0]
        for k in range(1, len(self.mlp_dims)):
            layer = params["bottom"][f"layer_{k}"]
            h = nn.relu(h @ layer["kernel"] + layer["bias"])
        t = self.target_task
        towers = params["towers"]
        m_last = self.mlp_dims[-1]
        tw, tb = self._first_tower_layer(params)
        mf = (item_part["emb"] @ user_part["mf"]).reshape(n, n_users, -1)  # [N, U, h0]
        g = h @ tw[:m_last] + mf + tb
        if not self.tower_dims:  # the first layer was the output
            return g[..., 0].T  # [U, N]
        g = nn.relu(g)
        for k in range(1, len(self.tower_dims)):
            g = nn.relu(g @ towers[f"layer_{k}_kernel"][t] + towers[f"layer_{k}_bias"][t])
        return (g @ towers["out_kernel"][t] + towers["out_bias"][t]).T  # [U, N]

    def rank_bytes_per_pair(self) -> int:
        """Bytes of the float32 intermediates `rank_scores` holds per (user, item) pair
        (every layer's output and the matrix-factorization term): sizes its blocks."""
        h0 = self.tower_dims[0] if self.tower_dims else 1
        widths = sum(self.mlp_dims) + h0 * 3 + sum(self.tower_dims[1:]) + 1
        return 4 * int(widths)

    def rank_flops_per_pair(self) -> int:
        """Multiply-adds x2 that `rank_scores` spends per (user, item) pair."""
        m = (self.mlp_dims[0],) + tuple(self.mlp_dims[1:])
        flops = m[0] * 2  # add + relu of the split first layer
        flops += sum(2 * a * b for a, b in zip(m[:-1], m[1:]))
        h = self.tower_dims or (1,)
        mf = self.embed_dim if self.gmf_dim is None else self.gmf_dim
        flops += 2 * (self.mlp_dims[-1] + mf) * h[0]
        flops += sum(2 * a * b for a, b in zip(h[:-1], h[1:]))
        if self.tower_dims:
            flops += 2 * h[-1]
        return flops


@dataclasses.dataclass(eq=False)  # hashed by identity: a static jit argument
class PopularityScorer:
    """The non-personalised baseline in the scorer protocol of `ktx.metrics.ranking`:
    every user gets the items ranked by their number of training interactions.

        scorer = PopularityScorer()
        full_ranking(scorer, scorer.params(data.train[data.target], data.num_items), ...)
    """

    @staticmethod
    def params(pairs: Any, num_items: int) -> dict[str, jax.Array]:
        """`{"counts": [num_items]}`: interactions per item in `pairs` (`[n, 2]` user, item)."""
        import numpy as np

        items = np.asarray(pairs).reshape(-1, 2)[:, 1]
        return {"counts": jnp.asarray(np.bincount(items, minlength=num_items), jnp.float32)}

    def rank_user_part(self, params: Any, users: jax.Array) -> dict[str, jax.Array]:
        return {"ones": jnp.ones((users.shape[0], 1), jnp.float32)}

    def rank_item_part(self, params: Any) -> dict[str, jax.Array]:
        return {"counts": params["counts"][:, None]}

    def rank_scores(self, params: Any, user_part: Mapping[str, jax.Array],
                    item_part: Mapping[str, jax.Array]) -> jax.Array:
        return user_part["ones"] @ item_part["counts"].T  # [U, N]
