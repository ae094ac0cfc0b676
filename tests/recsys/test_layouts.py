"""The data layouts users bring (`gin/experiments/recsys/layouts/`): each reader on a
small file written here, its bad inputs (file:line errors, counted duplicates and
dropped test pairs), and `ktx train` + `ktx eval` through every layout file."""

import logging

import numpy as np
import pytest

from ktx import cli
from ktx.data import files
from ktx.data import recsys as R
from ktx.training.summaries import read_metrics

# A small multi-behaviour log: 30 users in 3 groups, each group buying its own 7 items.
_RNG = np.random.default_rng(1)
USERS = np.arange(100, 130)


def _log():
    """{behaviour: sorted unique raw (user, item) pairs}."""
    out = {}
    for b, n in (("buy", 12), ("cart", 6), ("collect", 8), ("click", 15)):
        pairs = [(u, 500 + (u % 3) * 7 + int(_RNG.integers(0, 7))) for u in USERS for _ in range(n)]
        out[b] = np.unique(np.array(pairs), axis=0)
    return out


LOG = _log()


def _write(path, text):
    path.write_text(text)
    return path


def _lists_text(pairs):
    return "".join(f"{u} " + " ".join(str(i) for i in pairs[pairs[:, 0] == u, 1]) + "\n"
                   for u in np.unique(pairs[:, 0]))


def _pairs_text(pairs):
    return "".join(f"{u} {i}\n" for u, i in pairs)


def _check(inter, behaviours):
    assert set(inter.behaviours()) == set(behaviours)
    for b in behaviours:
        np.testing.assert_array_equal(np.unique(inter.pairs[b], axis=0), LOG[b], err_msg=b)


# --- one writer per layout: (gin file, macro bindings, the behaviours it yields) ---------


def _user_behavior(tmp_path):
    names = {"buy": "buy", "cart": "cart", "collect": "fav", "click": "pv"}
    rows = [f"{u},{i},9,{names[b]},1511544070\n" for b, p in LOG.items() for u, i in p]
    path = _write(tmp_path / "UserBehavior.csv", "".join(rows))
    return "user_behavior", {"DATA_PATH": repr(str(path)), "MIN_USER_PURCHASES": "1",
                             "MIN_ITEM_BUYERS": "1"}, tuple(LOG)


def _ijcai15(tmp_path):
    action = {"click": 0, "cart": 1, "buy": 2, "collect": 3}
    rows = [f"{u},{i},1,2,3,1111,{action[b]}\n" for b, p in LOG.items() for u, i in p]
    path = _write(tmp_path / "user_log_format1.csv", ",".join(R.IJCAI15_HEADER) + "\n" + "".join(rows))
    return "ijcai15", {"DATA_PATH": repr(str(path)), "MIN_USER_PURCHASES": "1",
                       "MIN_ITEM_BUYERS": "1"}, tuple(LOG)


def _behaviour_lists(tmp_path):
    paths = {b: str(_write(tmp_path / f"{b}.txt", _lists_text(LOG[b]))) for b in ("buy", "cart", "click")}
    return "behaviour_lists", {"BEHAVIOUR_FILES": repr(paths)}, ("buy", "cart", "click")


def _behaviour_pairs(tmp_path):
    paths = {b: str(_write(tmp_path / f"{b}.txt", _pairs_text(LOG[b]))) for b in ("buy", "collect")}
    return "behaviour_pairs", {"BEHAVIOUR_FILES": repr(paths)}, ("buy", "collect")


def _movielens(tmp_path):
    rating = {"buy": 5, "cart": 3, "collect": 1}
    rows = [f"{u}::{i}::{rating[b]}::97830{k}\n" for b in rating for k, (u, i) in enumerate(LOG[b])]
    path = _write(tmp_path / "ratings.dat", "".join(rows))
    return "movielens", {"DATA_PATH": repr(str(path)), "TARGET_BEHAVIOUR": "'like'"}, None


LAYOUTS = [_user_behavior, _ijcai15, _behaviour_lists, _behaviour_pairs, _movielens]


def test_user_behavior_and_ijcai15_readers(tmp_path):
    _, macros, behaviours = _user_behavior(tmp_path)
    _check(R.read_user_behavior(eval(macros["DATA_PATH"])), behaviours)
    _, macros, behaviours = _ijcai15(tmp_path)
    _check(R.read_ijcai15_log(eval(macros["DATA_PATH"])), behaviours)


def test_behaviour_list_and_pair_readers(tmp_path):
    _, macros, behaviours = _behaviour_lists(tmp_path)
    inter = R.read_behaviour_lists(eval(macros["BEHAVIOUR_FILES"]))
    _check(inter, behaviours)
    assert inter.sources["cart"].endswith("cart.txt") and inter.duplicates == dict.fromkeys(behaviours, 0)
    _, macros, behaviours = _behaviour_pairs(tmp_path)
    _check(R.read_behaviour_pairs(eval(macros["BEHAVIOUR_FILES"])), behaviours)
    # A user alone on its line has no items; blank lines are skipped.
    p = _write(tmp_path / "l.txt", "1 2 3\n\n4\n5 6\n")
    np.testing.assert_array_equal(R.read_list_file(p), [[1, 2], [1, 3], [5, 6]])
    with pytest.raises(ValueError, match="BEHAVIOUR_FILES"):
        R.read_behaviour_lists({})


def test_movielens_reader_thresholds_and_separators(tmp_path):
    p = _write(tmp_path / "u.data", "1\t10\t5\t881250949\n1\t11\t3\t1\n2\t10\t1\t2\n2\t12\t4\t3\n")
    inter = R.read_movielens(p)
    np.testing.assert_array_equal(inter.pairs["like"], [[1, 10], [2, 12]])
    np.testing.assert_array_equal(inter.pairs["neutral"], [[1, 11]])
    np.testing.assert_array_equal(inter.pairs["dislike"], [[2, 10]])
    q = _write(tmp_path / "ratings.dat", "1::10::5::881250949\n2::10::2::1\n")
    inter = R.read_movielens(q, rating_thresholds={"like": 4})
    np.testing.assert_array_equal(inter.pairs["like"], [[1, 10]])
    assert inter.behaviours() == ("like",)  # the rating 2 is below every threshold
    with pytest.raises(ValueError, match="share a threshold"):
        R.read_movielens(q, rating_thresholds={"a": 4, "b": 4.0})


@pytest.mark.parametrize("reader,text,message", [
    (R.read_list_file, "1 2 3\n4 x5 6\n", r"bad.txt:2: item 1 'x5' is not an integer id"),
    (R.read_list_file, "1 2\n-3 4\n", r"bad.txt:2: user -3 is negative"),
    (R.read_pair_file, "1 2\n3 4.0\n", r"bad.txt:2: item '4.0' is not an integer id"),
    (R.read_pair_file, "1 2\n3 99999999999999999999\n", r"bad.txt:2: item 99999999999999999999 is too large"),
    (R.read_movielens, "1::2::5::0\n1::u2::5::0\n", r"bad.txt:2: item 'u2' is not an integer id"),
    (R.read_movielens, "1::2::five::0\n", r"bad.txt:1: rating 'five' is not a number"),
    (R.read_movielens, "1 2 5 0\n", r"bad.txt:1: expected 'user item rating timestamp'"),
])
def test_non_integer_ids_name_file_and_line(tmp_path, reader, text, message):
    p = _write(tmp_path / "bad.txt", text)
    with pytest.raises(files.DataFileError, match=message):
        reader(p)


def test_duplicates_are_counted_and_reported(tmp_path, caplog):
    buy = _write(tmp_path / "buy.txt", "1 10\n1 10\n2 10\n2 11\n1 11\n1 10\n")
    cart = _write(tmp_path / "cart.txt", "1 10 10 11\n")
    with caplog.at_level(logging.WARNING):
        inter = R.read_behaviour_lists({"buy": buy, "cart": cart})
    assert inter.duplicates == {"buy": 2, "cart": 1}
    assert "buy.txt: 2 duplicate (user, item) rows of 'buy'" in caplog.text
    data = R.prepare_multibehavior(inter, target="buy", auxiliaries=None,
                                   split_fractions=(1.0, 0.0, 0.0))
    assert data.summary()["duplicates/buy"] == 2 and data.report["duplicates/cart"] == 1
    assert len(data.train["buy"]) == 4  # each pair once


def test_behaviour_without_common_users_is_an_error(tmp_path):
    buy = _write(tmp_path / "buy.txt", "1 10\n2 11\n")
    cart = _write(tmp_path / "cart.txt", "7 10\n8 11\n")
    inter = R.read_behaviour_pairs({"buy": buy, "cart": cart})
    with pytest.raises(ValueError, match=r"behaviour 'cart' \(.*cart.txt\): none of its 2 rows has a user of the target 'buy'"):
        R.prepare_multibehavior(inter, target="buy", auxiliaries=None)
    with pytest.raises(ValueError, match=r"TARGET_BEHAVIOUR 'like' is not in the data; found \['buy', 'cart'\]"):
        R.prepare_multibehavior(inter, target="like")


def test_given_test_file(tmp_path, caplog):
    pairs = LOG["buy"]
    held = pairs[::5]
    buy = _write(tmp_path / "buy.txt", _lists_text(pairs))
    cart = _write(tmp_path / "cart.txt", _lists_text(LOG["cart"]))
    # One test pair of an unknown user and one of an unknown item: dropped, counted.
    test = _write(tmp_path / "test.txt", _lists_text(held) + "999 500\n100 9999\n")
    inter = R.read_behaviour_lists({"buy": buy, "cart": cart})
    given = R.read_heldout(test, layout="lists")
    with caplog.at_level(logging.WARNING):
        data = R.prepare_multibehavior(inter, target="buy", auxiliaries=None, test=given)
    assert data.report["test_pairs_dropped"] == 2 and "2 of" in caplog.text
    assert data.report["test_pairs_in_train"] == len(held)
    assert len(data.test) == len(held)
    # No test pair is trained on or validated; train + validation = the rest (70:10).
    tr = {tuple(p) for p in data.train["buy"]}
    va = {tuple(p) for p in data.validation}
    te = {tuple(p) for p in data.test}
    assert not (tr & te or va & te or tr & va)
    assert len(tr) + len(va) == len(pairs) - len(held)
    rest = np.bincount(data.train["buy"][:, 0]) + np.bincount(data.validation[:, 0], minlength=data.num_users)
    assert len(va) == int(np.floor(rest * 0.125 + 0.5).sum())  # 0.1 / (0.7 + 0.1) per user
    # An empty file, or one without the target: a clear error.
    empty = _write(tmp_path / "empty.txt", "\n")
    with pytest.raises(files.DataFileError, match=r"empty.txt: the held-out test file has no \(user, item\) pair"):
        R.read_heldout(empty, layout="lists")
    ml = _write(tmp_path / "r.dat", "1::2::1::0\n")
    with pytest.raises(files.DataFileError, match="pair of the target 'like'"):
        R.read_heldout(ml, layout="movielens", target="like")
    assert R.read_heldout(None, layout="pairs") is None
    with pytest.raises(ValueError, match="none of the 1 held-out test pairs"):
        R.prepare_multibehavior(inter, target="buy", auxiliaries=None, test=np.array([[5, 5]]))


def _flags(macros, model_dir):
    return [f"--gin.{k}={v}" for k, v in macros.items()] + [
        f"--gin.MODEL_DIR='{model_dir}'", "--gin.MAX_EPOCHS=1", "--gin.RECSYS_BATCH_SIZE=64",
        "--gin.EMBED_DIM=8"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda f: f.__name__.strip("_"))
def test_ktx_train_and_eval_every_layout(tmp_path, capsys, layout):
    name, macros, _ = layout(tmp_path)
    model_dir = tmp_path / "run"
    gin_file = f"--gin_file=experiments/recsys/layouts/{name}.gin"
    if name == "behaviour_lists":  # with a given held-out test file
        macros["TEST_FILE"] = repr(str(_write(tmp_path / "test.txt", _lists_text(LOG["buy"][::4]))))
    assert cli.main(["train", gin_file, "--gin_file=runs/recsys_train.gin", *_flags(macros, model_dir)]) == 0
    ranked = [r for r in read_metrics(model_dir) if r["split"] == "validation_ranking"]
    assert len(ranked) == 1 and ranked[0]["task"] == ("like" if name == "movielens" else "buy")
    capsys.readouterr()
    assert cli.main(["eval", gin_file, "--gin_file=runs/recsys_eval.gin", *_flags(macros, model_dir)]) == 0
    assert "test at the best validation ndcg@10" in capsys.readouterr().out
    tested = [r for r in read_metrics(model_dir / "eval") if r["split"] == "test_ranking"]
    assert len(tested) == 1 and 0 <= tested[0]["ndcg@10"] <= 1
