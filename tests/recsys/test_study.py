"""The study runner and the gin model file, on tiny synthetic data."""

import pathlib

import numpy as np
import pytest

from ktx.data import recsys as R
from ktx.studies import recsys as recsys_study

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


@pytest.mark.parametrize("balanced,rows", [(False, "per_task"), (True, "per_task"),
                                           (True, "shared")])
def test_run_config_trains_and_reports(balanced, rows):
    optim = pytest.importorskip("ktx.optim")
    data = _data()
    result = recsys_study.run_config(
        data, balancer=optim.metabalance(relax_factor=0.5, num_tasks=3) if balanced else None, seed=1,
        max_epochs=4, patience=2, batch_size=48, rows=rows,
        learning_rate=1e-2,
        model_kwargs={"embed_dim": 8, "mlp_dims": (8, 4, 2), "tower_dims": (8, 4),
                      "dropout_rate": 0.0}, verbose=False)
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


def test_capped_epochs_are_prefixes_of_full_epochs():
    data = _data()
    full = R.RecsysTrainInput(data, batch_size=12, seed=4)
    capped = R.RecsysTrainInput(data, batch_size=12, seed=4, max_steps_per_epoch=3)
    assert full.steps_per_epoch > 3 and capped.steps_per_epoch == 3
    for epoch in range(2):
        for i in range(3):
            a = capped.get_batch(epoch * 3 + i)
            b = full.get_batch(epoch * full.steps_per_epoch + i)
            assert all(np.array_equal(a[k], b[k]) for k in b)
    big = R.RecsysTrainInput(data, batch_size=12, max_steps_per_epoch=10 ** 6)
    assert big.steps_per_epoch == full.steps_per_epoch
    with pytest.raises(ValueError, match="max_steps_per_epoch=0"):
        R.RecsysTrainInput(data, batch_size=12, max_steps_per_epoch=0)


def test_run_config_is_a_ktx_train_run(tmp_path):
    """The study's run directory is `ktx train`'s: `ktx eval` (rank_eval.evaluate) of its
    kept checkpoints picks the same best epoch and the same test metrics."""
    optim = pytest.importorskip("ktx.optim")
    from ktx.runs import rank_eval

    data = _data()
    model_kwargs = {"embed_dim": 8, "mlp_dims": (8, 4, 2), "tower_dims": (8, 4), "dropout_rate": 0.0}
    result = recsys_study.run_config(
        data, balancer=optim.metabalance(relax_factor=0.5, num_tasks=3), seed=2, max_epochs=3,
        patience=3, batch_size=48, learning_rate=1e-2, steps_per_epoch=4,
        model_kwargs=model_kwargs, model_dir=tmp_path, verbose=False)
    assert result["steps_per_epoch"] == 4 and result["epochs"] == 3
    assert len(result["history"]) == len(result["train_loss"]) == 3
    summary = rank_eval.evaluate(model=recsys_study.build_model(data, **model_kwargs),
                                 model_dir=tmp_path, data=data)
    assert sorted(summary.metrics) == [4, 8, 12]
    best_step, best = summary.best_per_task()[data.target]
    assert best_step == 4 * result["best_epoch"]
    assert best == pytest.approx(result["validation"]["ndcg@10"], rel=1e-6)
    test = {k[5:]: v for k, v in summary.metrics[best_step][data.target].items()
            if k.startswith("test/")}
    assert test == pytest.approx(result["test"], rel=1e-6)


def test_interrupted_run_config_resumes_in_its_directory(tmp_path):
    """A study run stopped after its first epochs and run again on the same directory
    continues from its checkpoint and ends as the uninterrupted run does; the result says
    where it resumed and times only the epochs it trained."""
    optim = pytest.importorskip("ktx.optim")
    data = _data()

    def run(model_dir, max_epochs):
        return recsys_study.run_config(
            data, balancer=optim.metabalance(relax_factor=0.5, num_tasks=3), seed=3,
            max_epochs=max_epochs, patience=5, batch_size=48, learning_rate=1e-2,
            steps_per_epoch=3, model_kwargs={"embed_dim": 8, "mlp_dims": (8, 4, 2),
                                             "tower_dims": (8, 4), "dropout_rate": 0.0},
            model_dir=model_dir, verbose=False)

    straight = run(tmp_path / "straight", 3)
    first = run(tmp_path / "pieces", 1)
    resumed = run(tmp_path / "pieces", 3)
    assert (straight["resumed_from_epoch"], first["resumed_from_epoch"]) == (0, 0)
    assert resumed["resumed_from_epoch"] == 1 and resumed["epochs"] == 3
    np.testing.assert_allclose(resumed["history"], straight["history"], rtol=1e-6)
    np.testing.assert_allclose(resumed["train_loss"], straight["train_loss"], rtol=1e-6)
    assert resumed["test"] == pytest.approx(straight["test"], rel=1e-6)
