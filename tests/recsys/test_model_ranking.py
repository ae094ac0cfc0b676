"""The shared-bottom model, ranking metrics and chunked full ranking."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx import partitioning
from ktx.metrics import ranking
from ktx.models.recsys import RecsysModel


def _model(**kw):
    return RecsysModel(num_users=9, num_items=13, num_tasks=3, embed_dim=8,
                       mlp_dims=(6, 4, 2), tower_dims=(5, 4), **kw)


def _batch():
    return {"user": np.array([0, 1, 2, 3, 8], np.int32), "item": np.array([1, 2, 3, 12, 0], np.int32),
            "label": np.array([1, 0, 1, 0, 1], np.float32), "task_id": np.array([0, 0, 1, 2, 2], np.int32)}


def _params(model, seed=0):
    params = nn.unbox(model.init_variables(jax.random.key(seed), _batch())["params"])
    # Larger weights than the init so that scores differ clearly between items.
    return jax.tree.map(lambda x: x + jax.random.normal(jax.random.key(seed + 1), x.shape), params)


def test_loss_sums_are_per_task_bce():
    model = _model()
    params = _params(model)
    b = _batch()
    sums, aux = jax.jit(lambda p: model.loss_sums(p, b, None, False))(params)
    logits = model.module.apply({"params": params}, b["user"], b["item"], False)
    z = np.asarray(logits)[np.arange(5), b["task_id"]]
    bce = np.maximum(z, 0) - z * b["label"] + np.log1p(np.exp(-np.abs(z)))
    np.testing.assert_allclose(sums, [bce[:2].sum(), bce[2], bce[3:].sum()], rtol=1e-5)
    np.testing.assert_array_equal(aux["weight"], [2, 1, 2])
    correct = ((z > 0) == (b["label"] > 0)).astype(float)
    np.testing.assert_array_equal(aux["accuracy"], [correct[:2].sum(), correct[2], correct[3:].sum()])
    loss, _ = model.loss_fn(params, b, None, False)  # per-task means, summed
    np.testing.assert_allclose(loss, bce[:2].mean() + bce[2] + bce[3:].mean(), rtol=1e-5)
    # Dropout is on in training and needs a key.
    with pytest.raises(ValueError, match="needs an rng"):
        model.loss_sums(params, b, None, True)
    s1, _ = model.loss_sums(params, b, jax.random.key(0), True)
    assert not np.allclose(s1, sums)


def test_param_shapes_and_validation():
    model = RecsysModel(num_users=5, num_items=7, num_tasks=3)
    shapes = jax.eval_shape(model.init_variables, jax.random.key(0), _batch())["params"]
    shapes = nn.unbox(shapes)
    assert shapes["user_embedding"]["embedding"].shape == (5, 64)
    assert shapes["bottom"]["layer_0"]["kernel"].shape == (128, 32)
    assert shapes["bottom"]["layer_2"]["kernel"].shape == (16, 8)
    assert shapes["towers"]["layer_0_kernel"].shape == (3, 8 + 64, 64)
    assert shapes["towers"]["layer_1_kernel"].shape == (3, 64, 32)
    with pytest.raises(ValueError, match="mlp_dims"):
        RecsysModel(num_users=5, num_items=7, num_tasks=3, mlp_dims=())
    with pytest.raises(ValueError, match="target_task=3"):
        RecsysModel(num_users=5, num_items=7, num_tasks=3, target_task=3)


def test_embedding_tables_shard_on_model_axis():
    model = RecsysModel(num_users=16, num_items=24, num_tasks=3, embed_dim=8)
    mesh = partitioning.create_mesh(num_partitions=4)  # 2x4 over the 8 fake CPU devices
    rules = partitioning.standard_logical_axis_rules()
    boxed = jax.eval_shape(model.init_variables, jax.random.key(0), _batch())["params"]
    sh = partitioning.abstract_shardings(boxed, mesh, rules)
    assert sh["user_embedding"]["embedding"].spec == jax.sharding.PartitionSpec("model", None)
    assert sh["item_embedding"]["embedding"].spec == jax.sharding.PartitionSpec("model", None)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        params = jax.jit(lambda r: nn.unbox(model.init_variables(r, _batch())["params"]),
                         out_shardings=sh)(jax.random.key(0))
        b = partitioning.host_local_to_global({k: np.resize(v, 8) for k, v in _batch().items()}, mesh)
        loss, _ = jax.jit(lambda p, b: model.loss_fn(p, b, None, False))(params, b)
    ref, _ = model.loss_fn(jax.device_get(params), {k: np.resize(v, 8) for k, v in _batch().items()}, None, False)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


def test_rank_scores_match_the_network():
    model = _model(target_task=1)
    params = _params(model)
    users = jnp.arange(9)
    scores = model.rank_scores(params, model.rank_user_part(params, users), model.rank_item_part(params))
    uu, ii = np.meshgrid(np.arange(9), np.arange(13), indexing="ij")
    full = model.module.apply({"params": params}, uu.ravel(), ii.ravel(), False)[:, 1].reshape(9, 13)
    np.testing.assert_allclose(scores, full, rtol=1e-5, atol=1e-5)


def test_topk_metrics_hand_computed():
    hits = jnp.array([[1, 0, 1, 0], [0, 0, 0, 0], [0, 1, 0, 0]])
    nrel = jnp.array([3, 0, 1])
    out = ranking.topk_metrics(hits, nrel, ks=(2, 4))
    d = [1 / math.log2(j + 2) for j in range(4)]
    np.testing.assert_allclose(out["ndcg@2"], [d[0] / (d[0] + d[1]), 0, d[1] / d[0]], rtol=1e-6)
    np.testing.assert_allclose(out["ndcg@4"], [(d[0] + d[2]) / sum(d[:3]), 0, d[1] / d[0]], rtol=1e-6)
    np.testing.assert_allclose(out["recall@2"], [1 / 3, 0, 1])
    np.testing.assert_allclose(out["recall@4"], [2 / 3, 0, 1])
    np.testing.assert_allclose(out["precision@4"], [0.5, 0, 0.25])
    m = ranking.metrics_from_ranked(np.array([[5, 6], [7, 8]]), [[6], [9, 8]], ks=(1, 2))
    np.testing.assert_allclose(m["precision@1"], 0.0)
    np.testing.assert_allclose(m["recall@2"], (1 + 0.5) / 2)


@pytest.mark.parametrize("user_chunk,item_block", [(4, 13), (3, 5), (None, None)])
def test_full_ranking_equals_brute_force(user_chunk, item_block):
    model = _model()
    params = _params(model)
    rng = np.random.default_rng(0)
    train = np.unique(np.stack([rng.integers(0, 9, 40), rng.integers(0, 13, 40)], 1), axis=0)
    held = np.unique(np.stack([rng.integers(0, 8, 20), rng.integers(0, 13, 20)], 1), axis=0)
    held = held[~np.isin(held[:, 0] * 13 + held[:, 1], train[:, 0] * 13 + train[:, 1])]
    got = ranking.full_ranking(model, params, num_users=9, num_items=13, heldout=held,
                               exclude=[train], ks=(3, 5), user_chunk=user_chunk,
                               item_block=item_block)
    uu, ii = np.meshgrid(np.arange(9), np.arange(13), indexing="ij")
    scores = np.array(model.module.apply({"params": params}, uu.ravel(), ii.ravel(), False)[:, 0]).reshape(9, 13)
    scores[train[:, 0], train[:, 1]] = -np.inf
    users = np.unique(held[:, 0])
    ranked = np.argsort(-scores[users], axis=1, kind="stable")[:, :5]
    want = ranking.metrics_from_ranked(ranked, [held[held[:, 0] == u, 1] for u in users], ks=(3, 5))
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)
    # Excluded (training) items never appear: ranking the training pairs as held-out
    # with themselves excluded gives zero hits.
    zero = ranking.full_ranking(model, params, num_users=9, num_items=13, heldout=train,
                                exclude=[train], ks=(5,), user_chunk=user_chunk)
    assert zero["recall@5"] == 0.0


def test_popularity_scorer_ranks_by_training_counts():
    from ktx.models.recsys import PopularityScorer

    # Item 3 bought 3 times, item 1 twice, item 0 once; users 0 and 1 hold out items 1 and 0.
    train = np.array([[2, 3], [3, 3], [4, 3], [2, 1], [3, 1], [4, 0]])
    scorer = PopularityScorer()
    params = scorer.params(train, 5)
    np.testing.assert_array_equal(params["counts"], [1, 2, 0, 3, 0])
    got = ranking.full_ranking(scorer, params, num_users=5, num_items=5,
                               heldout=np.array([[0, 1], [1, 0]]), exclude=[np.array([[0, 3]])],
                               ks=(1, 2))
    # User 0 (item 3 excluded) ranks 1 first: a hit at 1; user 1 ranks 3, 1, 0: a miss at 2.
    assert got["recall@1"] == 0.5 and got["recall@2"] == 0.5
    np.testing.assert_allclose(got["ndcg@2"], 0.5)


def _ranking_case(seed=0, num_users=40, num_items=13):
    rng = np.random.default_rng(seed)
    train = np.unique(np.stack([rng.integers(0, num_users, 200), rng.integers(0, num_items, 200)], 1), axis=0)
    held = np.unique(np.stack([rng.integers(0, num_users, 90), rng.integers(0, num_items, 90)], 1), axis=0)
    held = held[~np.isin(held[:, 0] * num_items + held[:, 1], train[:, 0] * num_items + train[:, 1])]
    return train, held


@pytest.mark.parametrize("num_partitions", [1, 4])
def test_full_ranking_sharded_over_the_mesh_equals_one_device(num_partitions):
    """8 fake CPU devices: an 8x1 and a 2x4 (data, model) mesh, chunks split over the
    devices, give exactly the metrics of one device (per-user sums in float64)."""
    model = RecsysModel(num_users=40, num_items=13, num_tasks=3, embed_dim=8,
                        mlp_dims=(6, 4, 2), tower_dims=(5, 4))
    params = _params(model)
    train, held = _ranking_case()
    kw = dict(num_users=40, num_items=13, heldout=held, exclude=[train], ks=(3, 5),
              user_chunk=3, item_block=5)
    one = ranking.full_ranking(model, params, **kw)
    mesh = partitioning.create_mesh(num_partitions)
    assert mesh.devices.size == 8
    stats = {}
    many = ranking.full_ranking(model, params, mesh=mesh, stats=stats, **kw)
    assert stats["users"] == len(np.unique(held[:, 0]))
    assert many.keys() == one.keys()
    for k in one:
        assert many[k] == pytest.approx(one[k], rel=1e-12, abs=1e-12), k
    assert one["recall@5"] > 0


def test_full_ranking_rejects_ids_beyond_the_tables():
    model = _model()
    params = _params(model)
    with pytest.raises(ValueError, match=r"1 held-out pair\(s\) have ids outside the tables \(9 users x 13 items\), the first \(user 2, item 13\)"):
        ranking.full_ranking(model, params, num_users=9, num_items=13,
                             heldout=np.array([[0, 1], [2, 13]]), ks=(3,))
    with pytest.raises(ValueError, match="excluded pair"):
        ranking.full_ranking(model, params, num_users=9, num_items=13,
                             heldout=np.array([[0, 1]]), exclude=[np.array([[9, 0]])], ks=(3,))


def test_ranking_chunks_from_platform_and_memory():
    u, b = ranking.ranking_chunks(11953, 41314, bytes_per_pair=1120, platform="cpu")
    assert u == ranking.CPU_USER_CHUNK and u * b * 1120 <= ranking.CPU_BLOCK_BYTES
    # An accelerator with 1 GiB free: a quarter, split between scores and the block.
    u, b = ranking.ranking_chunks(11953, 41314, bytes_per_pair=1120, platform="gpu",
                                  memory_bytes=1 << 30)
    assert u * 11953 * 16 <= (1 << 27) and u * b * 1120 <= (1 << 27) and b <= 11953
    u, b = ranking.ranking_chunks(11953, 41314, bytes_per_pair=1120, platform="gpu",
                                  memory_bytes=80 << 30)
    assert u == 8192 and b > 500
    # Few users: the chunk shrinks to them (a power of two).
    assert ranking.ranking_chunks(13, 5, platform="gpu", memory_bytes=1 << 30)[0] == 8


def test_cpu_devices_ranking_side_by_side_share_the_cache_budget():
    one = ranking.ranking_chunks(11953, 41314, bytes_per_pair=1124, platform="cpu")
    two = ranking.ranking_chunks(11953, 41314, bytes_per_pair=1124, platform="cpu", host_devices=2)
    # Half the users per chunk, the same item block: half the pairs (and bytes) each.
    assert one == (64, 233) and two == (32, 233)
    assert two[0] * two[1] * 1124 <= ranking.CPU_BLOCK_BYTES // 2
    assert ranking.ranking_chunks(11953, 41314, platform="cpu", host_devices=64)[0] == 8
    # An accelerator's share comes from its own memory, not the host's cache.
    assert ranking.ranking_chunks(11953, 41314, bytes_per_pair=1124, platform="gpu",
                                  memory_bytes=1 << 30, host_devices=2) == ranking.ranking_chunks(
        11953, 41314, bytes_per_pair=1124, platform="gpu", memory_bytes=1 << 30)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="host_devices"):
            ranking.ranking_chunks(13, 5, platform="cpu", host_devices=bad)


def test_full_ranking_on_a_mesh_sizes_chunks_per_host_device():
    """Without explicit sizes, each CPU device of a mesh in this process takes its share of
    the chunk (here 2 devices: 32 users each, not 64), with the metrics of one device."""
    model = RecsysModel(num_users=300, num_items=13, num_tasks=3, embed_dim=8,
                        mlp_dims=(6, 4, 2), tower_dims=(5, 4))
    params = _params(model)
    rng = np.random.default_rng(1)
    held = np.unique(np.stack([np.arange(300), rng.integers(0, 13, 300)], 1), axis=0)
    train = np.stack([np.arange(300), (held[:, 1] + 1) % 13], 1)
    kw = dict(num_users=300, num_items=13, heldout=held, exclude=[train], ks=(3, 5))
    one_stats, two_stats = {}, {}
    one = ranking.full_ranking(model, params, stats=one_stats, **kw)
    mesh = partitioning.create_mesh(1, devices=jax.devices()[:2])
    two = ranking.full_ranking(model, params, mesh=mesh, stats=two_stats, **kw)
    assert one_stats["user_chunk"] == ranking.CPU_USER_CHUNK
    assert two_stats["user_chunk"] == ranking.CPU_USER_CHUNK // 2
    for k in one:
        assert two[k] == pytest.approx(one[k], rel=1e-12, abs=1e-12), k
