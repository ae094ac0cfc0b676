"""Recommendation runs through `ktx train` / `ktx eval` (gin), on a tiny pair folder,
and the loop's epoch periods and early stopping."""

import json
import pathlib

import numpy as np
import optax
import pytest

from ktx import cli
from ktx.data import recsys as R
from ktx.models.recsys import RecsysModel
from ktx.training.summaries import read_metrics
from ktx.runs.train import EarlyStopping, train
from ktx.runs.eval import select_checkpoint_steps

NUM_USERS, NUM_ITEMS = 24, 20


def _write_tmall_folder(root: pathlib.Path) -> pathlib.Path:
    """A folder in the shared Tmall layout: two user groups with disjoint item sets."""
    rng = np.random.default_rng(0)
    users = rng.integers(0, NUM_USERS, 400)
    items = (users % 2) * 10 + rng.integers(0, 10, 400)
    pairs = np.unique(np.stack([users, items], 1), axis=0)
    rng.shuffle(pairs)
    n = len(pairs)
    parts = {"train": pairs[: n * 7 // 10], "validation": pairs[n * 7 // 10: n * 8 // 10],
             "test": pairs[n * 8 // 10:], "collect": pairs[::2], "cart": pairs[1::3]}
    root.mkdir(parents=True, exist_ok=True)
    for name, p in parts.items():
        (root / f"{name}.txt").write_text("".join(f"{u} {i}\n" for u, i in p))
    (root / "data_size.txt").write_text(f"{NUM_USERS} {NUM_ITEMS}\n")
    return root


def _flags(data_dir, model_dir, *extra):
    return [
        f"--gin.MODEL_DIR='{model_dir}'",
        f"--gin.recsys_data.load_tmall_pairs.directory='{data_dir}'",
        f"--gin.NUM_USERS={NUM_USERS}", f"--gin.NUM_ITEMS={NUM_ITEMS}",
        "--gin.RECSYS_BATCH_SIZE=48", "--gin.EMBED_DIM=8", "--gin.LEARNING_RATE=0.01",
        "--gin.DROPOUT_RATE=0.0", *extra,
    ]


def test_ktx_train_with_shared_rows_and_more_negatives(tmp_path):
    """TRAIN_ROWS='shared' and NUM_NEGATIVES reach ktx train's input (the authors' layout)."""
    data_dir = _write_tmall_folder(tmp_path / "tmall")
    model_dir = tmp_path / "run"
    rc = cli.main(["train", "--gin_file=experiments/recsys/metabalance.gin",
                   "--gin_file=runs/recsys_train.gin",
                   *_flags(data_dir, model_dir, "--gin.MAX_EPOCHS=1", "--gin.NUM_NEGATIVES=2",
                           "--gin.TRAIN_ROWS='shared'")])
    assert rc == 0
    shared = R.RecsysTrainInput(R.load_tmall_pairs(data_dir), batch_size=48, num_negatives=2,
                                rows="shared")
    saved = [int(p.name) for p in (model_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert saved == [shared.steps_per_epoch]
    train_rows = [r for r in read_metrics(model_dir) if r["split"] == "train" and r["task"] != "all"]
    # Every behaviour saw the same number of rows (16 pairs per step each).
    assert len({r["examples"] for r in train_rows}) == 1


def test_ktx_train_and_eval_a_recsys_experiment(tmp_path, capsys):
    data_dir = _write_tmall_folder(tmp_path / "tmall")
    model_dir = tmp_path / "run"
    gin_files = ["--gin_file=experiments/recsys/metabalance.gin"]
    rc = cli.main(["train", *gin_files, "--gin_file=runs/recsys_train.gin",
                   *_flags(data_dir, model_dir, "--gin.MAX_EPOCHS=3", "--gin.KEEP_CHECKPOINTS=None")])
    assert rc == 0
    steps_per_epoch = R.RecsysTrainInput(
        R.load_tmall_pairs(data_dir), batch_size=48, num_negatives=1).steps_per_epoch
    saved = sorted(int(p.name) for p in (model_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [steps_per_epoch * e for e in (1, 2, 3)]
    records = read_metrics(model_dir)
    ranked = [r for r in records if r["split"] == "validation_ranking"]
    assert [r["step"] for r in ranked] == saved and {r["task"] for r in ranked} == {"buy"}
    assert {"ndcg@10", "recall@20", "precision@10"} <= set(ranked[0])
    stops = [r for r in records if r["split"] == "early_stopping"]
    assert [r["step"] for r in stops] == saved
    assert stops[-1]["best_value"] == max(r["ndcg@10"] for r in ranked)
    # The balanced path logged MetaBalance's diagnostics.
    assert any(r["split"] == "train" and r["task"] == "all" for r in records)
    capsys.readouterr()

    rc = cli.main(["eval", *gin_files, "--gin_file=runs/recsys_eval.gin",
                   *_flags(data_dir, model_dir)])
    assert rc == 0
    out = capsys.readouterr().out
    best = max(ranked, key=lambda r: r["ndcg@10"])["step"]
    assert f"test at the best validation ndcg@10 (step {best})" in out
    evals = read_metrics(model_dir / "eval")
    assert {(r["split"], r["step"]) for r in evals} == {
        (s, st) for s in ("validation_ranking", "test_ranking") for st in saved}
    # Offline validation ranking reproduces the in-run one (same params, same users).
    offline = {r["step"]: r["ndcg@10"] for r in evals if r["split"] == "validation_ranking"}
    assert all(offline[r["step"]] == pytest.approx(r["ndcg@10"], abs=1e-6) for r in ranked)


class _Scripted:
    """An in-run evaluator returning a scripted metric per step (and counting calls)."""

    def __init__(self, values):
        self.values, self.calls = values, []

    def __call__(self, *, trainer, params, step, writer):
        self.calls.append(step)
        return {"buy": {"ndcg@10": self.values[step]}}


def _train(tmp_path, evaluator, epochs, patience, model_dir="run"):
    data = R.load_tmall_pairs(_write_tmall_folder(tmp_path / "tmall"))
    inp = R.RecsysTrainInput(data, batch_size=48, num_negatives=1)
    model = RecsysModel(num_users=NUM_USERS, num_items=NUM_ITEMS, num_tasks=3, embed_dim=4,
                        mlp_dims=(4, 2), tower_dims=(4,), dropout_rate=0.0)
    state = train(model=model, train_input=inp, model_dir=tmp_path / model_dir,
                  train_epochs=epochs, optimizer=optax.adam(1e-2), log_period=1000,
                  checkpoint_period="epoch", eval_period="epoch",
                  evaluators=[evaluator], early_stopping_metric="ndcg@10",
                  early_stopping_patience=patience)
    return int(state.step), inp.steps_per_epoch


def test_early_stopping_stops_saves_and_stays_stopped(tmp_path, capsys):
    n = R.RecsysTrainInput(R.load_tmall_pairs(_write_tmall_folder(tmp_path / "tmall")),
                           batch_size=48).steps_per_epoch
    values = {n * e: v for e, v in zip(range(1, 9), [0.1, 0.3, 0.2, 0.25, 0.29, 0.5, 0.6, 0.7])}
    ev = _Scripted(values)
    step, _ = _train(tmp_path, ev, epochs=8, patience=3)
    # Best at epoch 2; epochs 3, 4, 5 do not improve -> stop at epoch 5 with a checkpoint.
    assert step == 5 * n and ev.calls == [n * e for e in range(1, 6)]
    assert "Early stopping at step %d" % (5 * n) in capsys.readouterr().out
    saved = sorted(int(p.name) for p in (tmp_path / "run/checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == 5 * n
    # `ktx eval`'s CHECKPOINT_STEPS='best' names the checkpoint early stopping chose.
    assert select_checkpoint_steps(tmp_path / "run", "best") == [2 * n]
    # Launching the same run again does nothing: it stopped.
    ev2 = _Scripted(values)
    step, _ = _train(tmp_path, ev2, epochs=8, patience=3)
    assert step == 5 * n and ev2.calls == []
    assert "stopped early" in capsys.readouterr().out


def test_best_checkpoint_needs_an_early_stopping_record(tmp_path):
    data = R.load_tmall_pairs(_write_tmall_folder(tmp_path / "tmall"))
    model = RecsysModel(num_users=NUM_USERS, num_items=NUM_ITEMS, num_tasks=3, embed_dim=4,
                        mlp_dims=(4, 2), tower_dims=(4,), dropout_rate=0.0)
    train(model=model, train_input=R.RecsysTrainInput(data, batch_size=48), model_dir=tmp_path / "run",
          train_epochs=1, optimizer=optax.adam(1e-2), log_period=1000, checkpoint_period="epoch")
    with pytest.raises(ValueError, match="checkpoint_steps='best': .* no early-stopping record"):
        select_checkpoint_steps(tmp_path / "run", "best")


def test_early_stopping_resumes_its_count(tmp_path):
    n = R.RecsysTrainInput(R.load_tmall_pairs(_write_tmall_folder(tmp_path / "tmall")),
                           batch_size=48).steps_per_epoch
    values = {n * e: v for e, v in zip(range(1, 9), [0.4, 0.3, 0.2, 0.1, 0.5, 0.6, 0.7, 0.8])}
    ev = _Scripted(values)
    assert _train(tmp_path, ev, epochs=2, patience=3)[0] == 2 * n  # one miss so far
    ev2 = _Scripted(values)
    step, _ = _train(tmp_path, ev2, epochs=8, patience=3)
    # Misses at epochs 2 (before the restart), 3 and 4: the resumed run stops at 4.
    assert step == 4 * n and ev2.calls == [3 * n, 4 * n]
    # Same as one uninterrupted run.
    ev3 = _Scripted(values)
    assert _train(tmp_path, ev3, epochs=8, patience=3, model_dir="straight")[0] == 4 * n


def test_lost_evaluation_is_redone_on_resume(tmp_path):
    """A crash between a checkpoint and its evaluation: the resumed run evaluates that
    checkpoint first, so no evaluation is lost."""
    n = R.RecsysTrainInput(R.load_tmall_pairs(_write_tmall_folder(tmp_path / "tmall")),
                           batch_size=48).steps_per_epoch
    values = {n * e: 0.1 * e for e in range(1, 4)}
    _train(tmp_path, _Scripted(values), epochs=2, patience=3)
    # Drop the records of the last evaluation, as if the process died during it.
    path = tmp_path / "run/metrics.jsonl"
    lines = [line for line in path.read_text().splitlines()
             if not (json.loads(line)["step"] == 2 * n and json.loads(line)["split"] == "early_stopping")]
    path.write_text("\n".join(lines) + "\n")
    ev = _Scripted(values)
    step, _ = _train(tmp_path, ev, epochs=3, patience=3)
    assert step == 3 * n and ev.calls == [2 * n, 3 * n]


def test_epoch_arguments_are_checked(tmp_path):
    model = RecsysModel(num_users=2, num_items=3, num_tasks=1)

    class NoEpochs:
        task_names, num_tasks = ("buy",), 1

        def get_batch(self, step):
            raise AssertionError

        def task_counts(self, step):
            return (1,)

    with pytest.raises(ValueError, match="exactly one"):
        train(model=model, train_input=NoEpochs(), model_dir=tmp_path, train_steps=3,
              train_epochs=1, optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match="steps_per_epoch"):
        train(model=model, train_input=NoEpochs(), model_dir=tmp_path, train_epochs=1,
              optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match="checkpoint_period='epoch'"):
        train(model=model, train_input=NoEpochs(), model_dir=tmp_path, train_steps=1,
              checkpoint_period="epoch", optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match="needs early_stopping_metric"):
        train(model=model, train_input=NoEpochs(), model_dir=tmp_path, train_steps=1,
              early_stopping_patience=2, optimizer=optax.sgd(0.1))


def test_early_stopping_metric_names():
    es = EarlyStopping("buy/ndcg@10", 2)
    assert es.value_of({"buy": {"ndcg@10": 0.5}, "click": {"ndcg@10": 0.1}}) == 0.5
    with pytest.raises(ValueError, match="reported: "):
        es.value_of({"cart": {"ndcg@10": 0.5}})
    with pytest.raises(ValueError, match="name one as 'task/ndcg@10'"):
        EarlyStopping("ndcg@10", 2).value_of({"a": {"ndcg@10": 1.0}, "b": {"ndcg@10": 1.0}})
    with pytest.raises(ValueError, match="early_stopping_patience"):
        EarlyStopping("ndcg@10", 0)


def test_user_behavior_experiment_prepares_and_sizes_from_gin(tmp_path, capsys):
    """The raw-log experiment file: preprocessing bound in gin, model sized from the
    data, one epoch through `ktx train`."""
    rng = np.random.default_rng(1)
    rows = []
    for u in range(30):
        for _ in range(20):
            item = (u % 3) * 7 + int(rng.integers(0, 7))
            action = rng.choice(["pv", "buy", "cart", "fav"], p=[0.3, 0.5, 0.1, 0.1])
            rows.append(f"{100 + u},{500 + item},9,{action},1")
    csv = tmp_path / "UserBehavior.csv"
    csv.write_text("\n".join(rows) + "\n")
    model_dir = tmp_path / "ub"
    rc = cli.main(["train", "--gin_file=experiments/recsys/layouts/user_behavior.gin",
                   "--gin_file=runs/recsys_train.gin", f"--gin.DATA_PATH='{csv}'",
                   f"--gin.MODEL_DIR='{model_dir}'", "--gin.MIN_USER_PURCHASES=2",
                   "--gin.MIN_ITEM_BUYERS=1", "--gin.MAX_EPOCHS=1", "--gin.RECSYS_BATCH_SIZE=32",
                   "--gin.EMBED_DIM=8"])
    assert rc == 0
    data = R.prepare_multibehavior(
        R.read_user_behavior(csv), target="buy", auxiliaries=("click", "collect", "cart"),
        min_user_purchases=2, min_item_buyers=1, seed=0)
    state = sorted(p.name for p in (model_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert len(state) == 1
    from ktx.training.checkpoints import saved_param_shapes

    shapes = saved_param_shapes(model_dir / "checkpoints" / state[0])
    assert shapes["user_embedding/embedding"] == (data.num_users, 8)
    assert shapes["item_embedding/embedding"] == (data.num_items, 8)
    assert shapes["towers/layer_0_kernel"][0] == 4  # buy, click, collect, cart
    ranked = [r for r in read_metrics(model_dir) if r["split"] == "validation_ranking"]
    assert len(ranked) == 1 and ranked[0]["task"] == "buy"
    with pytest.raises(ValueError, match="accepted"):
        R.data_size(data, "rows")


def test_recsys_run_on_a_2x4_mesh_and_eval_on_one_device(tmp_path, capsys):
    """Tables split over the `model` axis (NUM_PARTITIONS=2 of 8 devices) through
    training, in-run ranking and offline ranking of the checkpoint on another mesh."""
    data_dir = _write_tmall_folder(tmp_path / "tmall")
    model_dir = tmp_path / "sharded"
    files = ["--gin_file=experiments/recsys/vanilla_multi.gin"]
    rc = cli.main(["train", *files, "--gin_file=runs/recsys_train.gin",
                   *_flags(data_dir, model_dir, "--gin.MAX_EPOCHS=1", "--gin.NUM_PARTITIONS=2")])
    assert rc == 0
    ranked = [r for r in read_metrics(model_dir) if r["split"] == "validation_ranking"]
    assert len(ranked) == 1
    capsys.readouterr()
    rc = cli.main(["eval", *files, "--gin_file=runs/recsys_eval.gin", *_flags(data_dir, model_dir)])
    assert rc == 0
    offline = [r for r in read_metrics(model_dir / "eval") if r["split"] == "validation_ranking"]
    assert offline[0]["ndcg@10"] == pytest.approx(ranked[0]["ndcg@10"], abs=1e-6)


def test_resumed_recsys_run_equals_an_uninterrupted_one(tmp_path):
    """Negatives are re-drawn per epoch from (seed, epoch, task): stopping after one epoch
    and resuming gives the parameters of one uninterrupted two-epoch run (balanced path,
    sparse table gradients, dropout on)."""
    import jax

    from ktx import optim

    data = R.load_tmall_pairs(_write_tmall_folder(tmp_path / "tmall"))

    def run(model_dir, epochs):
        inp = R.RecsysTrainInput(data, batch_size=48, num_negatives=2, seed=3)
        model = RecsysModel(num_users=NUM_USERS, num_items=NUM_ITEMS, num_tasks=3, embed_dim=4,
                            mlp_dims=(4, 2), tower_dims=(4,), dropout_rate=0.3)
        return train(model=model, train_input=inp, model_dir=tmp_path / model_dir,
                     train_epochs=epochs, optimizer=optax.adam(1e-2), log_period=1000,
                     checkpoint_period="epoch", balancer=optim.metabalance(relax_factor=0.5, num_tasks=3),
                     shared=model.shared_param_patterns,
                     sparse_tables=(r"_embedding/embedding$",), seed=5)

    run("resumed", 1)
    resumed = run("resumed", 2)
    straight = run("straight", 2)
    assert int(resumed.step) == int(straight.step)
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(straight.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
