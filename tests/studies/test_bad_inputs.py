"""A bad study file or study directory is one `ktx study: ...` line naming the study file
line or the `--gin.` flag, and what is accepted (no training: `--dry_run`)."""

from __future__ import annotations

import json

import gin
import pytest

from ktx import cli
from ktx.studies.records import FORMAT
from ktx.studies.spec import arm_definition
from tests.studies.tiny_study import write_tiny_study


@pytest.fixture(autouse=True)
def _clear_gin():
    yield
    gin.clear_config(clear_constants=True)


def _error(capsys, *argv) -> str:
    assert cli.main(["study", "run", *argv, "--dry_run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("ktx study: ")
    return err


def _line(path, text) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_two_arms_with_one_name(tmp_path, capsys):
    path = write_tiny_study(tmp_path)
    path.write_text(path.read_text().replace("name = 'fast'", "name = 'plain'"))
    err = _error(capsys, str(path))
    second = [i for i, line in enumerate(path.read_text().splitlines(), 1) if "'plain'" in line
              and "name" in line][1]
    assert f"{path}:{second}: two arms are named 'plain'" in err


def test_baseline_that_is_not_an_arm(tmp_path, capsys):
    path = write_tiny_study(tmp_path)
    path.write_text(path.read_text().replace("baseline = 'plain'", "baseline = 'plian'"))
    err = _error(capsys, str(path))
    assert f"{path}:{_line(path, 'baseline =')}: Study.baseline='plian' is not an arm; arms: plain, fast" in err


def test_seeds_that_are_not_integers(tmp_path, capsys):
    path = write_tiny_study(tmp_path)
    path.write_text(path.read_text().replace("seeds = [0, 1]", "seeds = [0, '1']"))
    err = _error(capsys, str(path))
    assert f"{path}:{_line(path, 'seeds =')}: Study.seeds=[0, '1']: '1' is not an integer" in err
    err = _error(capsys, str(write_tiny_study(tmp_path / "b")), "--gin.study.Study.seeds=[0.5]")
    assert err.startswith("ktx study: --gin.study.Study.seeds=[0.5]: ") and "0.5 is not an integer" in err


def _record(study_dir, definition, metrics):
    study_dir.mkdir(parents=True, exist_ok=True)
    (study_dir / "fast-seed0.json").write_text(json.dumps({
        "format": FORMAT, "study": "tiny", "run": "fast-seed0", "arm": "fast", "seed": 0,
        "budget": "default", "budget_bindings": {}, "definition": definition, "wall_seconds": 1.0,
        "metrics": metrics}))


def test_a_metric_the_evaluators_do_not_produce(tmp_path, capsys):
    path = write_tiny_study(tmp_path)
    from ktx.cli.study import load_study

    study = load_study(str(path))
    _record(tmp_path / "study", arm_definition(study, study.arm("fast"), "default"),
            {"validation/all/accuracy": 0.1, "validation/all/loss": 6.0})
    assert cli.main(["study", "run", str(path), "--dry_run"]) == 0
    assert "fast-seed0                               done" in capsys.readouterr().out
    path.write_text(path.read_text().replace("'validation/all/loss'", "'validation/all/los'"))
    err = _error(capsys, str(path))
    assert f"{path}:{_line(path, 'metrics =')}: Study.metrics: 'validation/all/los' is not a metric " \
           "the evaluators of run fast-seed0 produce; close names: validation/all/loss" in err


def test_records_of_a_changed_arm_are_refused_unless_asked(tmp_path, capsys):
    path = write_tiny_study(tmp_path)
    from ktx.cli.study import load_study

    study = load_study(str(path))
    _record(tmp_path / "study", arm_definition(study, study.arm("fast"), "default"),
            {"validation/all/accuracy": 0.1, "validation/all/loss": 6.0})
    path.write_text(path.read_text().replace("base_learning_rate': 3.0", "base_learning_rate': 2.0"))
    err = _error(capsys, str(path))
    assert "arm 'fast' changed since fast-seed0.json was written (bindings: " in err
    assert "'optimizers.rsqrt_schedule.base_learning_rate': 3.0} -> {" in err and "--allow_changed" in err
    fast = _line(path, "name = 'fast'")
    assert f"{path}:{fast}" in err
    assert cli.main(["study", "run", str(path), "--dry_run", "--allow_changed"]) == 0


def test_shards_split_the_runs_and_bad_shards_are_named(tmp_path, capsys):
    path = write_tiny_study(tmp_path)
    names = []
    for i in range(3):
        assert cli.main(["study", "run", str(path), "--dry_run", f"--shard={i}/3"]) == 0
        names += [line.split()[0] for line in capsys.readouterr().out.splitlines()[:-1]]
    assert sorted(names) == sorted(["plain-seed0", "plain-seed1", "fast-seed0", "fast-seed1"])
    err = _error(capsys, str(path), "--shard=3/3")
    assert "--shard='3/3'; accepted: I/N with 0 <= I < N" in err
