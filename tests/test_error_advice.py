"""Every error's advice works when pasted: each test provokes an error through `ktx.cli.main`,
takes the flag (or environment variable) its one line recommends, adds it to the same
command and checks that the command then runs."""

import re
import shlex

import numpy as np
import pytest

from ktx import cli
from ktx.data import files
from ktx.data import recsys as R
from tests.recsys.test_recsys_cli import _flags, _write_tmall_folder


@pytest.fixture(autouse=True)
def _default_policy(monkeypatch):
    monkeypatch.delenv(files.ON_BAD_ROW_ENV, raising=False)
    files.set_on_bad_row(None)
    yield
    files.set_on_bad_row(None)


def _one_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, err
    return lines[0]


def _pasted(text: str, pattern: str) -> list[str]:
    """The flags `pattern`'s first group names in `text`, as a shell would pass them."""
    m = re.search(pattern, text)
    assert m, f"no advice matching {pattern!r} in: {text}"
    return shlex.split(m.group(1))


def test_bad_recommendation_row_advice_works_for_ktx_train(tmp_path, capsys, monkeypatch):
    """A non-integer user id in a recommendation file under runs/recsys_train.gin: the flag
    the error recommends, the environment variable it names and the Python call each make
    the same run skip the row (and say so as a `ktx:` line)."""
    data_dir = _write_tmall_folder(tmp_path / "tmall")
    with open(data_dir / "train.txt", "a") as f:
        f.write("u7 3\n")
    bad_line = len((data_dir / "train.txt").read_text().splitlines())

    def train(run, *extra):
        return cli.main(["train", "--gin_file=experiments/recsys/metabalance.gin",
                         "--gin_file=runs/recsys_train.gin",
                         *_flags(data_dir, tmp_path / run, "--gin.MAX_EPOCHS=1", *extra)])

    assert train("raise") == 1
    line = _one_line(capsys, "ktx train: ")
    assert f"train.txt:{bad_line}: user 'u7' is not an integer id" in line
    flag = _pasted(line, r"add `(--gin\.[^`]+)` to the ktx command")
    assert flag == ["--gin.ON_BAD_ROW='skip'"]
    assert train("flag", *flag) == 0
    err = capsys.readouterr().err
    assert f"ktx: skipping bad row {data_dir / 'train.txt'}:{bad_line}" in err
    assert not [ln for ln in err.splitlines() if not ln.startswith("ktx: ")], err  # quiet

    name, value = _pasted(line, r"set `([^`]+)` in the environment")[0].split("=")
    monkeypatch.setenv(name, value)
    assert train("env") == 0
    err = capsys.readouterr().err
    assert "ktx: skipping bad row" in err
    assert not [ln for ln in err.splitlines() if not ln.startswith("ktx: ")], err  # quiet
    monkeypatch.delenv(name)

    assert "call `ktx.data.files.set_on_bad_row('skip')` in Python" in line
    files.set_on_bad_row("skip")
    assert len(R.load_tmall_pairs(data_dir).train["buy"]) > 0


def test_every_run_file_accepts_the_recommended_flag(tmp_path):
    """`--gin.ON_BAD_ROW="'skip'"` is accepted under every run file, whether or not it
    defines the macro, and sets the policy the readers use."""
    from tests.tiny_t5_gin import tiny_t5_gin

    model = tmp_path / "tiny.gin"
    model.write_text(tiny_t5_gin(), encoding="utf-8")
    runs = {
        "runs/train.gin": [str(model)], "runs/eval.gin": [str(model)],
        "runs/infer.gin": [str(model)], "runs/quickstart.gin": [],
        "runs/recsys_train.gin": ["experiments/recsys/metabalance.gin"],
        "runs/recsys_eval.gin": ["experiments/recsys/metabalance.gin"],
    }
    for run, before in runs.items():
        cli.parse_gin([*before, run], [("ON_BAD_ROW", "'skip'")])
        assert cli.gin_config._query_macro("ON_BAD_ROW") == "skip", run


def test_gin_path_known_under_an_alias_names_the_alias(capsys):
    """`--gin.ktx.runs.train.train.checkpoint_period=30`: gin knows the function as
    `train_script.train` (the run file's import); the error says so, and that flag works."""
    base = ["params", "--gin_file=models/t5_1_1_tiny.gin", "--gin_file=runs/train.gin"]
    assert cli.main(base + ["--gin.ktx.runs.train.train.checkpoint_period=30"]) == 2
    err = capsys.readouterr().err
    assert "the gin files import ktx.runs.train as train_script" in err
    assert "close names" not in err
    flag = _pasted(err, r"write (--gin\.\S+)")
    assert flag == ["--gin.train_script.train.checkpoint_period=30"]
    assert cli.main(base + flag) == 0
    assert "total:" in capsys.readouterr().out


def test_non_literal_int_suggests_an_int(capsys):
    base = ["params", "--gin_file=models/t5_1_1_tiny.gin", "--gin_file=runs/train.gin"]
    assert cli.main(base + ["--gin.BATCH_SIZE=eight"]) == 2
    err = capsys.readouterr().err
    assert "accepted: an integer (--gin.BATCH_SIZE=32)" in err and "quotes" not in err
    assert cli.main(base + _pasted(err, r"an integer \((--gin\.\S+)\)")) == 0
    assert cli.main(base + ["--gin.TRAIN_STEPS=ten"]) == 2  # a required macro: no value yet
    assert "accepted: an integer (--gin.TRAIN_STEPS=8)" in capsys.readouterr().err


def test_error_names_the_macro_a_user_sets(tmp_path, capsys):
    """The UserBehavior filters' error names MIN_USER_PURCHASES / MIN_ITEM_BUYERS (the
    layout file's macros), not the parameters they feed; setting them makes it run."""
    rows = [f"{u},{u % 3},1,{b},1511544070" for u in range(6) for b in ("pv", "buy", "cart", "fav")]
    path = tmp_path / "UserBehavior.csv"
    path.write_text("\n".join(rows) + "\n")
    base = ["params", "--gin_file=experiments/recsys/layouts/user_behavior.gin",
            f"--gin.DATA_PATH='{path}'"]
    assert cli.main(base) == 1
    line = _one_line(capsys, "ktx params: ")
    assert "MIN_USER_PURCHASES=5, MIN_ITEM_BUYERS=5" in line and "min_user_purchases" not in line
    assert cli.main(base + ["--gin.MIN_USER_PURCHASES=1", "--gin.MIN_ITEM_BUYERS=1"]) == 0


READERS = {  # reader, file text with one bad row (line 2), rows read with it skipped
    "read_pair_file": (R.read_pair_file, "1 2\nu7 3\n4 5\n", 2),
    "read_list_file": (R.read_list_file, "1 2 3\nu7 3\n4 5\n", 3),
    "read_user_behavior": (R.read_user_behavior, "1,2,9,buy,1\nu7,3,9,buy,1\n4,5,9,pv,1\n", 2),
    "read_movielens": (R.read_movielens, "1::2::5::1\nu7::3::5::1\n4::5::4::1\n", 2),
}


@pytest.mark.parametrize("name", sorted(READERS))
def test_every_recommendation_reader_honours_the_environment(name, tmp_path, monkeypatch):
    """KTX_ON_BAD_ROW (named by the error) reaches the readers that default to the process
    policy; without it they raise naming the line."""
    reader, text, rows = READERS[name]
    path = tmp_path / "data.txt"
    path.write_text(text)
    with pytest.raises(files.DataFileError, match=r"data\.txt:2: .*KTX_ON_BAD_ROW=skip"):
        reader(path)
    monkeypatch.setenv(files.ON_BAD_ROW_ENV, "skip")
    out = reader(path)
    pairs = out if not isinstance(out, R.Interactions) else np.concatenate(list(out.pairs.values()))
    assert len(pairs) == rows
    with pytest.raises(files.DataFileError):  # an explicit policy still wins
        reader(path, on_bad_row="raise")
