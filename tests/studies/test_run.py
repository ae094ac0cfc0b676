"""`ktx study run` on the tiny study, in-process: records, a started run resumed from its
checkpoint, finished runs skipped, `--max_runs`, `--dry_run`, and the report."""

from __future__ import annotations

import csv
import json

import gin
import pytest

from ktx import cli
from ktx.training.summaries import read_metrics
from tests.studies.tiny_study import write_tiny_study


@pytest.fixture(autouse=True)
def _clear_gin():
    yield
    gin.clear_config(clear_constants=True)


def test_run_resume_skip_and_report(tmp_path, capsys):
    path = write_tiny_study(tmp_path)
    study_dir = tmp_path / "study"
    # A run stopped after step 1 (its checkpoint kept): the study resumes it.
    started = study_dir / "runs" / "plain-seed0"
    assert cli.main(["train", f"--gin_file={tmp_path / 'model.gin'}", f"--gin_file={tmp_path / 'run.gin'}",
                     f"--gin.MODEL_DIR='{started}'", "--gin.TRAIN_STEPS=1"]) == 0
    capsys.readouterr()

    assert cli.main(["study", "run", str(path), "--max_runs=3"]) == 0
    out = capsys.readouterr().out
    assert "plain-seed0: resuming in" in out and "--max_runs=3 reached" in out
    assert "3 runs trained; 1 of 4 without a record" in out
    assert cli.main(["study", "run", str(path), "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "fast-seed1                               new" in out and "3 of 4 runs done" in out

    assert cli.main(["study", "run", str(path)]) == 0
    out = capsys.readouterr().out
    assert "plain-seed0: done" in out and "fast-seed1: training in" in out and "1 runs trained" in out

    record = json.loads((study_dir / "plain-seed0.json").read_text())
    assert record["arm"] == "plain" and record["seed"] == 0 and record["study"] == "tiny"
    assert record["selection"] == {"rule": "last", "step": 2}
    assert [e["step"] for e in record["evaluations"]] == [1, 2] or [
        e["step"] for e in record["evaluations"]] == [2]
    assert set(record["metrics"]) >= {"validation/all/accuracy", "validation/all/loss"}
    assert record["bindings"]["SEED"] == "0" and record["pieces"] == 1 and record["wall_seconds"] > 0
    assert record["device"].startswith("cpu")
    # Resumed, not retrained: the step-1 train row is the first piece's only.
    steps = [r["step"] for r in read_metrics(started) if r["split"] == "train" and r["task"] == "all"]
    assert steps == [1, 2]
    fast = json.loads((study_dir / "fast-seed0.json").read_text())
    assert fast["bindings"]["SEED"] == "0" and fast["metrics"] != record["metrics"]
    assert not list((study_dir / "runs").glob("*.claim"))

    assert cli.main(["study", "report", str(study_dir)]) == 0
    text = (study_dir / "report.md").read_text()
    assert "| plain (baseline) | 0,1 |" in text and "Paired t-tests against `plain`" in text
    with open(study_dir / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["arm"], r["metric"]) for r in rows} == {
        (a, m) for a in ("plain", "fast") for m in ("validation/all/accuracy", "validation/all/loss")}
    assert (study_dir / "report.png").stat().st_size > 0
