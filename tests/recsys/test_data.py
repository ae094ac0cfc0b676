"""Readers, preprocessing and the training input of `ktx.data.recsys`."""

import numpy as np
import pytest

from ktx.data import files
from ktx.data import recsys as R


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_user_behavior_reader_maps_behaviours(tmp_path):
    p = _write(tmp_path, "UserBehavior.csv",
               "1,10,5,pv,1511544070\n1,11,5,buy,1511544071\n2,10,5,fav,1\n2,12,5,cart,2\n")
    inter = R.read_user_behavior(p)
    assert sorted(inter.behaviours()) == ["buy", "cart", "click", "collect"]
    np.testing.assert_array_equal(inter.pairs["buy"], [[1, 11]])
    np.testing.assert_array_equal(inter.pairs["collect"], [[2, 10]])


def test_user_behavior_bad_rows_name_file_and_line(tmp_path):
    p = _write(tmp_path, "ub.csv", "1,10,5,pv,1\n1,10,5,like,2\n")
    with pytest.raises(files.DataFileError, match=r"ub.csv:2: unknown behaviour 'like'"):
        R.read_user_behavior(p)
    p = _write(tmp_path, "ub2.csv", "1,10,5,pv,1\n\nx1,10,5,buy,2\n")
    with pytest.raises(files.DataFileError, match=r"ub2.csv:3: user 'x1' is not an integer"):
        R.read_user_behavior(p)
    inter = R.read_user_behavior(p, on_bad_row="skip")
    assert "buy" not in inter.pairs and len(inter.pairs["click"]) == 1


def test_ijcai15_reader(tmp_path):
    header = "user_id,item_id,cat_id,seller_id,brand_id,time_stamp,action_type\n"
    p = _write(tmp_path, "user_log_format1.csv",
               header + "7,100,1,2,,1111,0\n7,101,1,2,3,1111,2\n8,100,1,2,3,1111,3\n8,102,1,2,3,1,1\n")
    inter = R.read_ijcai15_log(p)
    np.testing.assert_array_equal(inter.pairs["buy"], [[7, 101]])
    np.testing.assert_array_equal(inter.pairs["click"], [[7, 100]])
    np.testing.assert_array_equal(inter.pairs["cart"], [[8, 102]])
    np.testing.assert_array_equal(inter.pairs["collect"], [[8, 100]])
    p = _write(tmp_path, "bad.csv", header + "7,100,1,2,,1111,9\n")
    with pytest.raises(files.DataFileError, match=r"bad.csv:2: unknown action_type '9'"):
        R.read_ijcai15_log(p)


def test_pair_reader_errors(tmp_path):
    p = _write(tmp_path, "buy.txt", "0 1\n0 x\n")
    with pytest.raises(files.DataFileError, match=r"buy.txt:2: item 'x'"):
        R.read_pair_file(p)
    p = _write(tmp_path, "cart.txt", "0 1 2\n")
    with pytest.raises(files.DataFileError, match=r"cart.txt:1: expected 2"):
        R.read_pair_file(p)


def test_prepare_filters_splits_and_removes_leakage():
    # Users 0..3; user 3 buys once (dropped at min 2 purchases); item 9 bought by one
    # user only (dropped at min 2 buyers).
    buy = [[u, i] for u in range(3) for i in range(10)] + [[3, 0], [0, 9]]
    buy = [p for p in buy if not (p[1] == 9 and p[0] != 0)]
    inter = R.Interactions({
        "buy": np.array(buy),
        "collect": np.array([[0, i] for i in range(10)] + [[3, 1], [1, 50]]),
    })
    data = R.prepare_multibehavior(inter, target="buy", auxiliaries=("collect",),
                                   min_user_purchases=2, min_item_buyers=2, seed=3)
    assert (data.num_users, data.num_items) == (3, 9)
    # Each user has 9 purchases: 2 test (round(1.8)), 1 validation (round(0.9)), 6 train.
    assert len(data.train["buy"]) == 18 and len(data.validation) == 3 and len(data.test) == 6
    all_buy = np.concatenate([data.train["buy"], data.validation, data.test])
    assert len(np.unique(all_buy, axis=0)) == 27
    # Collect of user 0 on the 9 kept items minus user 0's validation/test items.
    heldout0 = {tuple(p) for p in np.concatenate([data.validation, data.test]) if p[0] == 0}
    assert data.leakage_removed["collect"] == len(heldout0) == 3
    assert {tuple(p) for p in data.train["collect"]} == {(0, i) for i in range(9)} - heldout0
    assert data.behaviours == ("buy", "collect")
    with pytest.raises(ValueError, match="behaviour 'fav' is not in the data"):
        R.prepare_multibehavior(inter, auxiliaries=("fav",))


def _tiny_data():
    rng = np.random.default_rng(0)
    buy = np.unique(np.stack([rng.integers(0, 20, 60), rng.integers(0, 30, 60)], 1), axis=0)
    col = np.unique(np.stack([rng.integers(0, 20, 90), rng.integers(0, 30, 90)], 1), axis=0)
    return R.MultiBehaviorData(20, 30, ("buy", "collect", "cart"),
                               {"buy": buy, "collect": col, "cart": buy[:5]},
                               validation=buy[:3], test=buy[3:6])


def test_train_input_layout_determinism_and_negatives():
    data = _tiny_data()
    inp = R.RecsysTrainInput(data, batch_size=16, num_negatives=2, seed=5)
    counts = inp.task_counts(0)
    assert sum(counts) == 16 and min(counts) >= 1 and len(counts) == 3
    b = inp.get_batch(3)
    np.testing.assert_array_equal(b["task_id"], np.repeat(np.arange(3), counts))
    # Pure function of (seed, step): a fresh object (resumed run) gives the same rows.
    again = R.RecsysTrainInput(data, batch_size=16, num_negatives=2, seed=5)
    for s in (3, 0, inp.steps_per_epoch + 1):
        for k in b:
            np.testing.assert_array_equal(inp.get_batch(s)[k], again.get_batch(s)[k])
    # An epoch is one pass over each task's positives and negatives.
    ep0 = inp.epoch_rows(0)
    ep1 = inp.epoch_rows(1)
    for t, name in enumerate(data.behaviours):
        pos = {tuple(p) for p in data.train[name]}
        assert len(ep0[t]["user"]) == 3 * len(pos)
        assert ep0[t]["label"].sum() == len(pos)
        negs = {(u, i) for u, i, l in zip(ep0[t]["user"], ep0[t]["item"], ep0[t]["label"]) if l == 0}
        assert not negs & pos  # negatives are never the user's positives of that behaviour
    # Negatives are re-drawn each epoch.
    assert not np.array_equal(ep0[1]["item"], ep1[1]["item"])
    # Rows of one epoch over all its steps: every positive of the largest task once.
    t = int(np.argmax(inp.rows_per_task))
    seen = np.concatenate([inp.get_batch(s)["item"][np.repeat(np.arange(3), counts) == t]
                           for s in range(inp.steps_per_epoch)])
    assert len(seen) >= inp.rows_per_task[t]


def test_train_input_process_slices():
    data = _tiny_data()
    full = R.RecsysTrainInput(data, batch_size=16, seed=1, process_index=0, process_count=1)
    parts = [R.RecsysTrainInput(data, batch_size=16, seed=1, process_index=p, process_count=2)
             for p in range(2)]
    glued = np.concatenate([p.get_batch(7)["item"] for p in parts])
    np.testing.assert_array_equal(glued, full.get_batch(7)["item"])
    with pytest.raises(ValueError, match="task_batch_sizes"):
        R.RecsysTrainInput(data, batch_size=16, task_batch_sizes=(8, 8))


def test_shared_rows_label_every_pair_for_every_behaviour():
    data = _tiny_data()
    T = len(data.behaviours)
    inp = R.RecsysTrainInput(data, batch_size=24, num_negatives=2, seed=3, rows="shared")
    assert T == 3 and inp.task_counts(0) == (8,) * T
    known = {name: {tuple(p) for p in data.train[name]} for name in data.behaviours}
    union = set().union(*known.values())
    assert inp.rows_per_task == (3 * len(union),) * T
    assert inp.steps_per_epoch == -(-3 * len(union) // 8)
    seen = []
    for step in range(inp.steps_per_epoch):
        b = inp.get_batch(step)
        np.testing.assert_array_equal(b["task_id"], np.repeat(np.arange(T), 8))
        blocks = [slice(8 * t, 8 * (t + 1)) for t in range(T)]
        for t, name in enumerate(data.behaviours):
            # Every task block holds the same pairs, labelled for its own behaviour.
            np.testing.assert_array_equal(b["user"][blocks[t]], b["user"][blocks[0]])
            np.testing.assert_array_equal(b["item"][blocks[t]], b["item"][blocks[0]])
            pairs = zip(b["user"][blocks[t]], b["item"][blocks[t]])
            expected = [float((u, i) in known[name]) for u, i in pairs]
            np.testing.assert_array_equal(b["label"][blocks[t]], expected)
        seen += list(zip(b["user"][blocks[0]], b["item"][blocks[0]]))
    # One epoch: every training pair of any behaviour, and two negatives per pair that
    # are no training pair of that user in any behaviour.
    one_epoch = seen[:3 * len(union)]
    assert {p for p in one_epoch if p in union} == union
    assert sum(p not in union for p in one_epoch) == 2 * len(union)
    # Pure function of (seed, step), and the process slices glue back to the batch.
    again = R.RecsysTrainInput(data, batch_size=24, num_negatives=2, seed=3, rows="shared")
    np.testing.assert_array_equal(again.get_batch(5)["item"], inp.get_batch(5)["item"])
    parts = [R.RecsysTrainInput(data, batch_size=24, num_negatives=2, seed=3, rows="shared",
                                process_index=p, process_count=2) for p in range(2)]
    np.testing.assert_array_equal(np.concatenate([p.get_batch(5)["label"] for p in parts]),
                                  inp.get_batch(5)["label"])
    with pytest.raises(ValueError, match="rows='sharded'"):
        R.RecsysTrainInput(data, rows="sharded")
    with pytest.raises(ValueError, match="task_batch_sizes"):
        R.RecsysTrainInput(data, batch_size=24, rows="shared", task_batch_sizes=(8, 8, 8))
    with pytest.raises(ValueError, match="multiple of 3, e.g. 255"):
        R.RecsysTrainInput(data, batch_size=256, rows="shared")


def test_tmall_real_data(data_dir):
    data = R.load_tmall_pairs(data_dir / "recsys" / "tmall")
    assert (data.num_users, data.num_items) == (41738, 11953)
    assert data.behaviours == ("buy", "collect", "cart")
    assert len(data.train["buy"]) == 181428 and len(data.test) == 74158
    # No auxiliary pair of the training data is a held-out target pair.
    held = set(map(tuple, np.concatenate([data.validation, data.test])))
    assert not held & set(map(tuple, data.train["collect"]))
    assert data.leakage_removed["collect"] > 0
