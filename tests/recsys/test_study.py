"""The study runner and the gin model file, on tiny synthetic data."""

import pathlib

import numpy as np
import pytest

from ktx.studies import recsys as recsys_study
from ktx.data import recsys as R

REPO = pathlib.Path(__file__).resolve().parents[2]


def _data():
    # Two user groups with disjoint item sets, so a few epochs learn to rank them.
    rng = np.random.default_rng(0)
    users = rng.integers(0, 24, 300)
    items = (users % 2) * 10 + rng.integers(0, 10, 300)
    pairs = np.unique(np.stack([users, items], 1), axis=0)
    data = R.prepare_multibehavior(
        R.Interactions({"buy": pairs, "collect": pairs[::2], "cart": pairs[1::3]}),
        target="buy", auxiliaries=("collect", "cart"), seed=0)
    return data


@pytest.mark.parametrize("balanced", [False, True])
def test_run_config_trains_and_reports(balanced):
    optim = pytest.importorskip("ktx.optim")
    data = _data()
    result = recsys_study.run_config(
        data, balancer=optim.metabalance(relax_factor=0.5, num_tasks=3) if balanced else None, seed=1,
        max_epochs=4, patience=2, batch_size=48, learning_rate=1e-2,
        model_kwargs={"embed_dim": 8, "mlp_dims": (8, 4, 2), "tower_dims": (8, 4),
                      "dropout_rate": 0.0}, log=None)
    assert set(result["test"]) == {f"{m}@{k}" for m in ("ndcg", "recall", "precision") for k in (10, 20)}
    assert 1 <= result["best_epoch"] <= result["epochs"] <= 4
    assert result["validation"]["ndcg@10"] == max(result["history"])
    # Items of the other group are never bought: learning pushes them down, so the
    # ranking beats a random one (recall@10 of a random ranking of 20 items ~0.5).
    assert result["test"]["recall@10"] > 0.6


def test_gin_model_file_builds_the_model():
    gin = pytest.importorskip("gin")
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(
            [str(REPO / "gin/models/recsys_shared_bottom.gin")], ["NUM_USERS = 10", "NUM_ITEMS = 20"])
        model = gin.get_configurable("ktx.models.recsys.RecsysModel")()
        assert (model.num_users, model.num_items, model.num_tasks) == (10, 20, 3)
        assert model.mlp_dims == (32, 16, 8) and model.tower_dims == (64, 32)
        assert model.dropout_rate == 0.5 and model.loss_normalization == "per_task"
    finally:
        gin.clear_config()
