"""`ktx study report`'s statistics on hand-written records, against hand-computed values."""

from __future__ import annotations

import csv
import json
import math

import pytest

from ktx.studies import report as report_lib
from ktx.studies.records import FORMAT, load_records
from ktx.studies.spec import Arm, Study, arm_definition
from ktx.studies.stats import delta_m, paired_test


def _study(tmp_path, **kwargs):
    return Study(name="toy", directory=str(tmp_path), seeds=[0, 1, 2],
                 arms=[Arm("stl", single_task=True), Arm("plain"), Arm("new")],
                 metrics={"acc": "higher", "err": "lower"}, baseline="plain", **kwargs)


def _write(study, arm, seed, metrics, seconds=10.0):
    definition = arm_definition(study, study.arm(arm), "default")
    record = {"format": FORMAT, "study": study.name, "run": f"{arm}-seed{seed}", "arm": arm,
              "seed": seed, "budget": "default", "budget_bindings": {}, "definition": definition,
              "wall_seconds": seconds, "metrics": metrics}
    (pathlib_dir(study) / f"{arm}-seed{seed}.json").write_text(json.dumps(record))


def pathlib_dir(study):
    import pathlib

    return pathlib.Path(study.directory)


def test_mean_sd_paired_test_and_delta_m_match_hand_computed(tmp_path):
    study = _study(tmp_path)
    for seed, (acc, err) in enumerate([(0.80, 0.30), (0.82, 0.28), (0.81, 0.29)]):
        _write(study, "stl", seed, {"acc": acc, "err": err})
    for seed, (acc, err) in enumerate([(0.70, 0.40), (0.73, 0.36), (0.71, 0.41)]):
        _write(study, "plain", seed, {"acc": acc, "err": err})
    # "new" has seeds 0 and 1 only: the test pairs those two with the baseline's.
    for seed, (acc, err) in enumerate([(0.72, 0.38), (0.76, 0.35)]):
        _write(study, "new", seed, {"acc": acc, "err": err}, seconds=30.0)
    report = report_lib.build(study, load_records(tmp_path))
    rows = {s.arm: s for s in report.budgets["default"]}

    plain = rows["plain"]
    assert plain.values["acc"] == {0: 0.70, 1: 0.73, 2: 0.71}
    mean = (0.70 + 0.73 + 0.71) / 3
    sd = math.sqrt(((0.70 - mean) ** 2 + (0.73 - mean) ** 2 + (0.71 - mean) ** 2) / 2)
    assert plain.stats["acc"] == pytest.approx((mean, sd))

    test = rows["new"].tests["acc"]
    assert test["seeds"] == [0, 1]
    d = [0.02, 0.03]
    assert test["differences"] == pytest.approx(d)
    dm, dsd = sum(d) / 2, math.sqrt(sum((x - sum(d) / 2) ** 2 for x in d))
    assert test["t"] == pytest.approx(dm / (dsd / math.sqrt(2)))
    # t = 5 on 1 degree of freedom (a Cauchy variable): two-sided p = 1 - 2 atan(5) / pi.
    assert test["t"] == pytest.approx(5.0)
    assert test["p"] == pytest.approx(1 - 2 * math.atan(5.0) / math.pi)

    # Δm: the mean relative gain over the single-task arm, err counted as lower-is-better.
    stl_acc, stl_err = 0.81, 0.29
    plain_err = (0.40 + 0.36 + 0.41) / 3
    want = 100 * ((mean - stl_acc) / stl_acc - (plain_err - stl_err) / stl_err) / 2
    assert plain.delta_m == pytest.approx(want)
    assert rows["stl"].delta_m is None and rows["stl"].tests  # the reference is tested, not Δm'd
    assert report.total_seconds == pytest.approx(6 * 10.0 + 2 * 30.0)

    text = report_lib.markdown(report)
    assert f"{mean:.4f} ± {sd:.4f} (0.7000, 0.7300, 0.7100)" in text
    assert f"{want:+.2f}" in text and "| new | acc | 0,1 | 0.0250 | 5.00 | 0.126 |" in text
    report_lib.write_csv(report, tmp_path / "r.csv")
    with open(tmp_path / "r.csv") as f:
        got = {(r["arm"], r["metric"]): r for r in csv.DictReader(f)}
    assert float(got[("new", "acc")]["t"]) == pytest.approx(5.0)
    assert got[("plain", "err")]["direction"] == "lower" and got[("plain", "acc")]["values"] == "0.7 0.73 0.71"
    report_lib.write_png(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_stats_edge_cases():
    assert paired_test({0: 1.0}, {0: 0.5})["t"] is None  # one seed: no test
    assert paired_test({0: 1.0, 1: 2.0}, {0: 0.0, 1: 1.0})["t"] is None  # equal differences
    assert delta_m({"a": 2.0}, {"a": 0.0}, {}, ["a"]) is None  # relative gain of 0 undefined
    assert delta_m({"a": 1.1, "b": 0.9}, {"a": 1.0, "b": 1.0}, {"b": "lower"}, ["a", "b"]) == \
        pytest.approx(10.0)


def test_duplicate_records_of_one_run_are_named(tmp_path):
    study = _study(tmp_path)
    _write(study, "plain", 0, {"acc": 0.7, "err": 0.3})
    data = json.loads((tmp_path / "plain-seed0.json").read_text())
    (tmp_path / "copy.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="both arm 'plain', budget 'default', seed 0"):
        report_lib.build(study, load_records(tmp_path))


def test_derived_metrics_are_computed_in_order(tmp_path):
    from ktx.studies.derived import Affine, MeanOf

    study = _study(tmp_path, derived_metrics={"acc": Affine("raw/acc", 0.01),
                                              "both": MeanOf([["acc"], ["err", "acc"]])})
    _write(study, "plain", 0, {"raw/acc": 70.0, "err": 0.3})
    report = report_lib.build(study, load_records(tmp_path))
    values = report.budgets["default"][0].values
    assert values["acc"][0] == pytest.approx(0.7)
    assert values["both"][0] == pytest.approx((0.7 + (0.3 + 0.7) / 2) / 2)


def test_curves_hold_every_evaluation_of_the_select_metric(tmp_path):
    study = _study(tmp_path, select_metric="acc")
    _write(study, "plain", 0, {"acc": 0.7, "err": 0.4})
    _write(study, "plain", 1, {"acc": 0.8, "err": 0.3})
    _write(study, "new", 0, {"acc": 0.9, "err": 0.2})
    report = report_lib.build(study, load_records(tmp_path))
    # Records without evaluations (or before `ktx study`): no curves, nothing written.
    assert report_lib.curves(report) == {}
    assert report_lib.write_curves_png(report, tmp_path / "none.png") is False
    assert not (tmp_path / "none.png").exists()

    def evaluations(path, points):
        data = json.loads(path.read_text())
        data["evaluations"] = [{"step": s, "metrics": {"acc": a, "err": 1 - a}} for s, a in points]
        path.write_text(json.dumps(data))

    # Written out of order, and seed 1 stopped early: each run keeps its own steps.
    evaluations(tmp_path / "plain-seed0.json", [(20, 0.7), (10, 0.6), (30, 0.65)])
    evaluations(tmp_path / "plain-seed1.json", [(10, 0.8), (20, 0.75)])
    report = report_lib.build(study, load_records(tmp_path))
    assert report_lib.curves(report) == {
        "default": {"plain": {0: [(10, 0.6), (20, 0.7), (30, 0.65)], 1: [(10, 0.8), (20, 0.75)]}}}
    assert report_lib.curves(report, "err")["default"]["plain"][1] == [
        (10, pytest.approx(0.2)), (20, pytest.approx(0.25))]
    assert report_lib.write_curves_png(report, tmp_path / "c.png") is True
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
