"""The authors'-layout study's tables in docs/results_recsys.md are what `ktx study report`
gives from the committed records (docs/results/recsys_authors) and
gin/studies/metabalance_tmall_authors.gin: the summary (per arm, mean +- sample sd and the
paired t-tests against Single-Loss and against Vanilla-Multi) and the per-run rows."""

from __future__ import annotations

import pathlib
import re

import pytest

from ktx.studies.records import load_records
from tests.studies.tables import between, study_report
from tests.studies.tables import close as _close

REPO = pathlib.Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "results_recsys.md"
GRID = ("both_r0.1", "both_r0.3", "both_r0.5", "both_r0.7", "both_r0.9", "reduce_r0.7",
        "enlarge_r0.7")
METRICS = ("validation_ranking/buy/ndcg@10", "test_ranking/buy/ndcg@10",
           "test_ranking/buy/recall@10", "test_ranking/buy/ndcg@20")


def _report(baseline: str):
    _, report = study_report("metabalance_tmall_authors", "recsys_authors",
                             bindings=[("BASELINE", repr(baseline))])
    # The phase-1 grid's other six runs (its `both`, r = 0.3 run is phase 2's seed 0).
    assert sorted(i.split("-seed0.json")[0] for i in report.ignored) == sorted(
        f"metabalance_{g}" for g in GRID if g != "both_r0.3"), report.ignored
    (arms,) = report.budgets.values()
    return {s.arm: s for s in arms}


@pytest.fixture(scope="module")
def reports():
    return {"single_loss": _report("single_loss"), "vanilla_multi": _report("vanilla_multi")}


def _rows(marker: str) -> list[list[str]]:
    return between(DOC, marker)[1:]  # without the header


def _arm(reports, label):
    """The arm whose study label the table's is (the table spaces `r = 0.3`)."""
    return next(s for s in reports["single_loss"].values()
                if s.label.replace(" ", "") == label.replace(" ", ""))


def test_the_summary_is_the_report_of_the_records(reports):
    rows = _rows("authors_summary")
    assert len(rows) == len(reports["single_loss"]) == 5
    for label, seeds, *cells, against_sl, against_vm in rows:
        s = _arm(reports, label)
        assert seeds == ",".join(map(str, s.seeds)), label
        for metric, cell in zip(METRICS, cells):
            mean, _, sd = cell.partition(" +- ")
            got_mean, got_sd = s.stats[metric]
            assert _close(got_mean, mean), (label, metric)
            assert (got_sd is None) == (sd == "") and (not sd or _close(got_sd, sd)), (label, metric)
        for baseline, cell in (("single_loss", against_sl), ("vanilla_multi", against_vm)):
            if s.arm == baseline:
                assert cell == "-"
                continue
            test = reports[baseline][s.arm].tests["test_ranking/buy/ndcg@10"]
            m = re.fullmatch(r"([+-][\d.]+) \(t = ([-\d.]+), p = ([\d.]+)\)", cell)
            assert m, (label, cell)
            for got, shown in zip((test["mean_difference"], test["t"], test["p"]), m.groups()):
                assert _close(got, shown), (label, baseline, cell)


def _check_run(row, values, data):
    run, epochs, *cells, _wall = row
    for metric, cell in zip(METRICS, cells):
        assert _close(values[metric], cell.strip("*")), (run, metric)
    steps = [e["step"] for e in data["evaluations"]]
    best, total = (int(x) for x in re.match(r"(\d+) / (\d+)", epochs).groups())
    assert (steps.index(data["selection"]["step"]) + 1, len(steps)) == (best, total), run


def test_every_grid_row_is_its_record():
    rows = _rows("authors_grid")
    assert len(rows) == len(GRID)
    records = load_records(REPO / "docs" / "results" / "recsys_authors")
    for row in rows:
        strategy, r = re.fullmatch(r"MetaBalance, (\w+), r = ([\d.]+)", row[0]).groups()
        (record,) = [x for x in records if x.arm == f"metabalance_{strategy}_r{r}" and x.seed == 0]
        _check_run(row, record.metrics, record.data)


def test_every_run_row_is_its_record(reports):
    rows = _rows("authors_runs")
    assert len(rows) == 14  # five arms x three seeds, MetaBalance seed 0 being the grid's
    for row in rows:
        label, seed = re.fullmatch(r"(.+), seed (\d)", row[0]).groups()
        s = _arm(reports, label)
        _check_run(row, {m: v[int(seed)] for m, v in s.values.items()}, s.records[int(seed)].data)
