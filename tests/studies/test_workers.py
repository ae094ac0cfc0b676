"""Several `ktx study run` processes on one study: they divide its runs through the claims
(no run trained by two), and a killed worker's run is resumed by the next worker from its
checkpoint. Subprocesses, SIGKILL: marked slow."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from tests.xla_env import with_devices

from tests.studies.tiny_study import write_tiny_study

REPO = pathlib.Path(__file__).resolve().parents[2]
KTX = str(pathlib.Path(sys.executable).parent / "ktx")
RUNS = ["plain-seed0", "plain-seed1", "fast-seed0", "fast-seed1"]


def _worker(path, log, *flags):
    env = with_devices(1)
    return subprocess.Popen([KTX, "study", "run", str(path), "--heartbeat=1", *flags], cwd=REPO,
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _started(log) -> list[str]:
    return [line.split()[2].rstrip(":") for line in pathlib.Path(log).read_text().splitlines()
            if " in /" in line and ("training in" in line or "resuming in" in line)]


@pytest.mark.slow
def test_workers_divide_the_runs_and_a_killed_run_is_resumed(tmp_path):
    # A checkpoint every 5 of the 30 steps: each is a save of its own (orbax), and the
    # test needs one before the kill and one run resumed from it.
    path = write_tiny_study(tmp_path, steps=30, checkpoint_period=5)
    runs = tmp_path / "study" / "runs"
    a = _worker(path, tmp_path / "a.log")
    b = _worker(path, tmp_path / "b.log")
    victim, deadline = None, time.time() + 600
    while victim is None and time.time() < deadline:  # A holds a run with a checkpoint: kill it
        for claim in runs.glob("*.claim") if runs.is_dir() else ():
            try:
                owner = json.loads(claim.read_text())
            except (OSError, ValueError):
                continue
            name = claim.name.removesuffix(".claim")
            ckpt = runs / name / "checkpoints"
            if owner.get("pid") == a.pid and ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir()):
                victim = name
        time.sleep(0.5)
    assert victim is not None, (tmp_path / "a.log").read_text()[-3000:]
    a.send_signal(signal.SIGKILL)
    a.wait()
    assert b.wait(timeout=900) == 0, (tmp_path / "b.log").read_text()[-3000:]
    c = _worker(path, tmp_path / "c.log")
    assert c.wait(timeout=900) == 0, (tmp_path / "c.log").read_text()[-3000:]

    started = {w: _started(tmp_path / f"{w}.log") for w in "abc"}
    # The killed run is resumed once: by B if B reached it after the kill (the claim's
    # process is gone), else by C.
    resumed = [w for w in "bc" if f"{victim}: resuming in" in (tmp_path / f"{w}.log").read_text()]
    assert victim in started["a"] and len(resumed) == 1
    # No other run was trained by two workers (the claims divided them), and B trained some.
    assert not (set(started["a"]) & set(started["b"])) - {victim} and started["b"]
    assert sorted(started["a"] + started["b"] + started["c"]) == sorted(RUNS + [victim])
    for name in RUNS:
        record = json.loads((tmp_path / "study" / f"{name}.json").read_text())
        assert record["pieces"] == (2 if name == victim else 1), name
    assert not list(runs.glob("*.claim*"))
