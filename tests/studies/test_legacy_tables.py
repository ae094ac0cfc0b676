"""The committed records of the studies before `ktx study` (docs/results/{cs224n,glue,recsys})
give, through `ktx study report` and the study files in gin/studies/, the numbers of the
tables in docs/results.md and docs/results_recsys.md (read here, not written)."""

from __future__ import annotations

import math
import pathlib
import re

import pytest

from ktx.studies.records import load_records
from tests.studies.tables import between as _between
from tests.studies.tables import study_report as _report
from tests.studies.tables import close as _close

REPO = pathlib.Path(__file__).resolve().parents[2]


def _per_seed(cell: str) -> tuple[list[str], str | None]:
    m = re.fullmatch(r"(.*?)(?: \(sd ([\d.]+)\))?", cell)
    return [v.strip() for v in m.group(1).split("/")], m.group(2)


def _budget(study, **values) -> str:
    return next(name for name, b in study.budgets.items()
                if all(b.get(k) == v for k, v in values.items()))


def test_cs224n_table():
    study, report = _report("cs224n_encoders", "cs224n")
    rows = [r for r in _between(REPO / "docs" / "results.md", "cs224n_study")[1:] if r[1]]
    assert len(rows) == sum(len(s) for s in report.budgets.values()) == 26
    for label, seeds, steps, _, lr, sst, quora, sts, overall, per_seed, seconds in rows:
        budget = _budget(study, TRAIN_STEPS=int(steps),
                         **{"optimizers.linear_decay_schedule.peak_learning_rate": float(lr)})
        row = next(s for s in report.budgets[budget] if s.label == label)
        assert ",".join(map(str, row.seeds)) == seeds
        for metric, shown in (("sst_accuracy", sst), ("quora_accuracy", quora),
                              ("sts_pearson", sts), ("overall", overall.strip("*"))):
            assert _close(row.stats[metric][0], shown), (label, budget, metric)
        values, sd = _per_seed(per_seed)
        assert all(_close(row.values["overall"][k], v) for k, v in zip(row.seeds, values))
        if sd is not None:
            assert _close(row.stats["overall"][1], sd), (label, budget)
        if seconds == "n/a":
            assert row.wall_seconds is None
        else:
            assert _close(row.wall_seconds, seconds), (label, budget)


def test_glue_table():
    study, report = _report("glue_encoders", "glue")
    rows = _between(REPO / "docs" / "results.md", "glue_encoders")[1:]
    columns = [["matthews_corrcoef"], ["accuracy"], ["f1", "accuracy"],
               ["pearson_corrcoef", "spearman_corrcoef"], ["accuracy"]]
    tasks = ["cola", "sst2", "mrpc", "stsb", "rte"]
    assert len(rows) == len(report.budgets["steps600"]) == 6
    for label, mixing, seeds, steps, *cells, average, per_seed, seconds in rows:
        base = next(a.name for a in study.arms if a.label == label)
        arm = base if mixing == "mixture" else f"{base}_{mixing}"
        row = next(s for s in report.budgets["steps600"] if s.arm == arm)
        assert ",".join(map(str, row.seeds)) == seeds and steps == "600"
        for task, names, cell in zip(tasks, columns, cells):
            for name, shown in zip(names, cell.split(" / ")):
                metric = f"validation_metrics/glue_{task}_bert_v001/{name}"
                assert _close(row.stats[metric][0], shown), (arm, metric)
        assert _close(row.stats["glue_average"][0], average.strip("*"))
        values, sd = _per_seed(per_seed)
        assert all(_close(row.values["glue_average"][k], v) for k, v in zip(row.seeds, values))
        assert _close(row.stats["glue_average"][1], sd)
        assert _close(row.wall_seconds, seconds)


def test_tmall_table():
    study, report = _report("metabalance_tmall", "recsys")
    text = (REPO / "docs" / "results_recsys.md").read_text()
    block = text.split("<!-- recsys_records:begin -->", 1)[1].split("<!-- recsys_records:end -->", 1)[0]
    checked = 0
    for title, table in re.findall(r"\*\*(.+?)\*\*\n\n(\|.*?)(?:\n\n|\Z)", block, re.S):
        epochs = int(re.match(r"up to (\d+) epochs", title).group(1))
        shared = "TRAIN_ROWS" in title
        budget = next(n for n, b in study.budgets.items() if b["MAX_EPOCHS"] == epochs
                      and ("TRAIN_ROWS" in b) == shared)
        for line in table.splitlines()[2:]:
            label, seeds, _, val, test, recall, _, wall_h = [c.strip() for c in line.strip("|").split("|")]
            row = next(s for s in report.budgets[budget] if s.label == label)
            assert ",".join(map(str, row.seeds)) == seeds
            for metric, cell in (("validation_ranking/buy/ndcg@10", val),
                                 ("test_ranking/buy/ndcg@10", test), ("test_ranking/buy/recall@10", recall)):
                mean, _, sd = cell.partition(" ± ")
                assert _close(row.stats[metric][0], mean), (label, budget, metric)
                if sd:  # the population deviation (Study.sd_ddof = 0), as the table gave
                    assert _close(row.stats[metric][1], sd), (label, budget, metric)
            assert _close(row.wall_seconds * len(row.seeds) / 3600, wall_h)
            checked += 1
    assert checked == sum(len(s) for s in report.budgets.values()) == 14


@pytest.mark.parametrize("name, records", [("cs224n_encoders", "cs224n"), ("glue_encoders", "glue"),
                                           ("metabalance_tmall", "recsys")])
def test_every_committed_record_is_in_its_study(name, records):
    study, report = _report(name, records)
    assert report.ignored == [] and report.records == len(list((REPO / "docs/results" / records).glob("*.json")))
    assert math.isfinite(report.total_seconds) and report.total_seconds > 0


def test_the_runs_the_committed_records_hold_are_done_for_ktx_study_run():
    """`ktx study run` skips a run that a record of the scripts before it holds (another file
    name, same arm, seed and budget): the GLUE study is complete; every CS224N record is a
    done run."""
    from ktx.studies import runner

    study, _ = _report("glue_encoders", "glue")
    states = runner.statuses(study, runner.plan(study))
    assert len(states) == 18 and all(s.state == "done" for s in states), \
        [s.run.name for s in states if s.state != "done"]
    study, _ = _report("cs224n_encoders", "cs224n")
    done = runner.recorded(study)
    records = load_records(study.directory)
    assert len(done) == len(records) == 76
    assert sum(s.state == "done" for s in runner.statuses(study, runner.plan(study))) == 76
