"""The encoder studies' reports (tests/benchmarks/cs224n_study.py, glue_study.py): the tables
in docs/results.md are the ones their records rebuild, and `--compare` pairs seeds right."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent / "benchmarks"
sys.path.append(str(BENCHMARKS))  # after site-packages: no name there is shadowed

import cs224n_study  # noqa: E402
import glue_study  # noqa: E402


def _between(text: str, begin: str, end: str) -> str:
    assert text.count(begin) == 1 and text.count(end) == 1, (begin, end)
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


@pytest.mark.parametrize("study", [cs224n_study, glue_study], ids=["cs224n", "glue"])
def test_committed_table_is_the_one_its_records_rebuild(study):
    """A hand edit of a table, or a record committed without its table (or the reverse),
    fails here: the figures in docs/results.md must come from docs/results/<study>/."""
    committed = _between(study.RESULTS.read_text(), study.BEGIN, study.END)
    assert committed == study.table(), (
        f"docs/results.md's table between {study.BEGIN} and {study.END} differs from the one "
        f"{study.__name__}.py --table rebuilds from its records: run it and commit both")


def _record(directory: pathlib.Path, stem: str, seed: int, overall: float) -> None:
    (directory / f"{stem}-seed{seed}.json").write_text(
        json.dumps({"seed": seed, "scores": {"overall": overall}}))


def test_paired_compares_the_seeds_both_groups_have(tmp_path):
    for seed, value in enumerate([0.70, 0.73, 0.71, 0.90]):
        _record(tmp_path, "a", seed, value)
    for seed, value in zip([0, 1, 2], [0.69, 0.70, 0.70]):
        _record(tmp_path, "b", seed, value)
    # Another budget's group shares the prefix: never mixed into "a".
    _record(tmp_path, "a-steps1800-lr0.0002", 0, 0.1)
    out = cs224n_study.paired(tmp_path, "a", "b", lambda r: r["scores"]["overall"])
    assert out["seeds"] == [0, 1, 2]  # seed 3 has no partner
    assert out["scores_a"] == [0.70, 0.73, 0.71]
    d = [0.01, 0.03, 0.01]
    assert out["differences"] == pytest.approx(d)
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    assert out["mean_difference"] == pytest.approx(mean)
    assert out["t"] == pytest.approx(mean / (sd / math.sqrt(3)))
    assert 0 < out["p"] < 1

    one = cs224n_study.paired(tmp_path, "a-steps1800-lr0.0002", "b",
                              lambda r: r["scores"]["overall"])
    assert one["seeds"] == [0] and one["t"] is None and one["p"] is None


def test_paired_names_a_group_with_no_record(tmp_path):
    _record(tmp_path, "plain", 0, 0.7)
    with pytest.raises(ValueError, match=r"no record pals-seed<k>\.json .* the records there: plain"):
        cs224n_study.paired(tmp_path, "plain", "pals", lambda r: r["scores"]["overall"])
