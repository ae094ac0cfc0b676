"""Preemption (`ktx.runs.preemption`): SIGTERM to one of two processes, or to a lone one,
stops `ktx train` at a step boundary on every process with a checkpoint of that step and
exit status 75; relaunched, the run ends with the losses of a run never interrupted. A
signal with no step boundary in sight exits 75 within `preemption_timeout`; the launch
scripts treat 75 as "resume"."""

from __future__ import annotations

import os
import pathlib
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from tests import row_cache
from tests.multiprocess_runs import (
    KTX, REPO, flags, launch, sharded_reference, train_losses, wait_all,
)
from tests.xla_env import with_devices

from ktx.runs.preemption import EXIT_PREEMPTED, PreemptionGuard
from tests.tiny_t5_gin import tiny_t5_gin

STEPS, SIGNAL_AFTER, BOUND = 40, 12, 30


def _launch(model_gin, model_dir, logs, processes: int) -> list:
    train_flags = flags(model_gin, model_dir, STEPS,
                        "--gin.train_script.train.checkpoint_period=1000",
                        f"--gin.train_script.train.preemption_timeout={BOUND}")
    if processes == 2:
        return launch(train_flags, logs, heartbeat=20)
    # One process, and async checkpoints: the preemption save still completes.
    logs.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([KTX, "train", *train_flags, "--gin.train_script.train.async_checkpoints=True"],
                             cwd=REPO, env=with_devices(4), stdout=open(logs / "process_0.log", "w"),
                             stderr=subprocess.STDOUT)]


@pytest.fixture(scope="module")
def model_gin(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "model.gin"
    path.write_text(tiny_t5_gin())
    return path


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 1])
def test_sigterm_checkpoints_the_step_and_resumes_exactly(tmp_path, model_gin, processes):
    if processes == 2:  # the session's uninterrupted two-process run (tests/multiprocess_runs.py)
        reference = sharded_reference()[1][:STEPS]
    else:
        wait_all(_launch(model_gin, tmp_path / "reference", tmp_path / "logs_reference", 1),
                 tmp_path / "logs_reference")
        reference = train_losses(tmp_path / "reference")

    run, logs = tmp_path / "run", tmp_path / "logs"
    procs = _launch(model_gin, run, logs, processes)
    deadline = time.time() + 600
    while time.time() < deadline:
        if (run / "metrics.jsonl").is_file() and len(train_losses(run)) >= SIGNAL_AFTER:
            break
        assert all(p.poll() is None for p in procs), "a process ended before the signal"
        time.sleep(0.05)
    victim = procs[-1]  # process 1 of 2 (not the coordinator): the signal reaches it alone
    victim.send_signal(signal.SIGTERM)
    if processes == 1:  # a second signal, during the step or the save: still one clean save
        time.sleep(0.2)
        if victim.poll() is None:
            victim.send_signal(signal.SIGTERM)
    signalled = time.time()
    wait_all(procs, logs, expected=EXIT_PREEMPTED)
    seconds = time.time() - signalled
    print(f"{processes} process(es): exit status {EXIT_PREEMPTED} {seconds:.1f} s after SIGTERM")
    assert seconds < BOUND
    stopped = len(train_losses(run))
    assert SIGNAL_AFTER <= stopped < STEPS
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [stopped]  # the interrupted step, and no other (the period is 1000)
    for i in range(processes):  # the process signalled, and the one told through the flags
        log = (logs / f"process_{i}.log").read_text()
        who = "SIGTERM" if i == processes - 1 else "a preemption signal to process 1"
        assert (f"ktx train: stopped by {who} at step {stopped}; checkpoint step {stopped} is "
                f"saved in {run / 'checkpoints'}; exit status 75") in log, log[-2000:]

    wait_all(_launch(model_gin, run, tmp_path / "logs_resumed", processes), tmp_path / "logs_resumed")
    assert f"Resuming from checkpoint step {stopped}" in (
        tmp_path / "logs_resumed" / "process_0.log").read_text()
    assert len(reference) == STEPS
    assert train_losses(run) == reference


def test_guard_agrees_at_the_step_boundary_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGINT)
    with PreemptionGuard(timeout_seconds=None) as guard:
        assert not guard.should_stop(1)
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: a request to stop
        deadline = time.time() + 5
        while not guard.requested and time.time() < deadline:
            time.sleep(0.01)
        assert guard.requested and guard.reason == "SIGINT"
        assert guard.should_stop(2)
    assert signal.getsignal(signal.SIGINT) is before


_NO_BOUNDARY = textwrap.dedent("""
    import time
    from ktx.runs.preemption import PreemptionGuard
    with PreemptionGuard(timeout_seconds=1.5) as guard:
        guard.phase, guard.last_checkpoint = "the evaluation at step 20", 20
        print("ready", flush=True)
        time.sleep(60)  # no step boundary comes
""")


def test_a_signal_far_from_a_step_boundary_exits_within_the_timeout():
    p = subprocess.Popen([sys.executable, "-c", _NO_BOUNDARY], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == EXIT_PREEMPTED and time.time() - t0 < 10
    assert ("ktx train: SIGTERM: no step boundary within 1.5 s "
            "(train_script.train.preemption_timeout) during the evaluation at step 20; exiting "
            "with status 75 without a new checkpoint: the run resumes from checkpoint step 20"
            ) in err, err


@pytest.mark.parametrize("kwargs, named", [
    ({"timeout_seconds": 0}, "preemption_timeout=0; accepted: seconds > 0 or None"),
    ({"check_period": 0}, "preemption_check_period=0; accepted: an integer >= 1"),
])
def test_bad_settings_name_the_binding(kwargs, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        PreemptionGuard(**kwargs)


# The launch scripts, with stand-ins for ktx, srun, scontrol and gcloud.

def _stub(folder: pathlib.Path, name: str, body: str) -> pathlib.Path:
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _script(name, args, tmp_path, **env):
    environ = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", **env)
    return subprocess.run(["bash", f"launch/{name}", *args], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=60)


def test_multiprocess_sh_passes_sigterm_on_and_exits_75(tmp_path):
    # Each stand-in waits for SIGTERM, then exits 75 as ktx train does.
    ktx = _stub(tmp_path, "ktx_stub", "trap 'exit 75' TERM\nwhile :; do sleep 0.05; done\n")
    p = subprocess.Popen(["bash", "launch/multiprocess.sh", "2", "train"], cwd=REPO,
                         env=dict(os.environ, KTX=str(ktx)), stderr=subprocess.PIPE, text=True)
    time.sleep(1)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 75, err
    assert "ktx: preempted: every process saved the checkpoint" in err


def test_gpu_slurm_requeues_a_preempted_job(tmp_path):
    _stub(tmp_path, "srun", "exit 75\n")
    log = tmp_path / "scontrol.log"
    _stub(tmp_path, "scontrol", f'echo "$@" >> {log}\n')
    out = _script("gpu_slurm.sh", ["train"], tmp_path, SLURM_JOB_ID="4242")
    assert out.returncode == 75 and log.read_text() == "requeue 4242\n", out.stderr
    log.unlink()
    _stub(tmp_path, "srun", "exit 1\n")  # a failure is not requeued
    assert _script("gpu_slurm.sh", ["train"], tmp_path, SLURM_JOB_ID="4242").returncode == 1
    assert not log.exists()


def test_tpu_pod_relaunches_after_preemption(tmp_path):
    calls = tmp_path / "calls"
    # Preempted twice, then the run completes.
    _stub(tmp_path, "gcloud", f'echo x >> {calls}\n[[ $(wc -l < {calls}) -lt 3 ]] && exit 75\nexit 0\n')
    out = _script("tpu_pod.sh", ["train"], tmp_path, TPU="pod", ZONE="z", KTX_RESUME_DELAY="0")
    assert out.returncode == 0 and calls.read_text().count("x") == 3, out.stderr
    assert "relaunch 2" in out.stderr
    calls.unlink()
    out = _script("tpu_pod.sh", ["train"], tmp_path, TPU="pod", ZONE="z", KTX_RESUME_DELAY="0",
                  KTX_MAX_RESUMES="1")
    assert out.returncode == 75 and calls.read_text().count("x") == 2


def test_sigterm_during_an_evaluation_exits_within_the_timeout(tmp_path):
    """The quickstart's decode evaluation at step 5 outlasts preemption_timeout=2: the
    process exits 75 about 2 s after the signal, without waiting for the evaluation."""
    log = tmp_path / "train.log"
    p = subprocess.Popen(
        [KTX, "train", "--gin_file=runs/quickstart.gin", f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
         "--gin.TRAIN_STEPS=40", "--gin.LOG_PERIOD=1", "--gin.EVAL_PERIOD=5",
         "--gin.train_script.train.preemption_timeout=2", row_cache.flag()],
        cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while "step 5/40" not in log.read_text():
        assert p.poll() is None and time.time() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)
    time.sleep(0.5)  # into the evaluation
    p.send_signal(signal.SIGTERM)
    signalled = time.time()
    assert p.wait(timeout=60) == EXIT_PREEMPTED, log.read_text()[-2000:]
    seconds = time.time() - signalled
    print(f"SIGTERM during an evaluation: exit status 75 {seconds:.1f} s after it")
    text = log.read_text()
    if "no step boundary within 2 s" in text:  # the evaluation outlasted the timeout
        assert seconds < 2 + 5
        assert ("during the evaluation at step 5; exiting with status 75 without a new "
                "checkpoint: the run resumes from its start") in text, text[-2000:]
    else:  # it ended first: the boundary after it saved step 5
        assert "stopped by SIGTERM at step 5; checkpoint step 5 is saved" in text, text[-2000:]
