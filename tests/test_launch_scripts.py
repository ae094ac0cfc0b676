"""launch/*.sh, run here with stand-ins for the cluster tools (gcloud, srun) and for ktx
itself: each prints its arguments, and the tests check the exact per-worker commands."""

from __future__ import annotations

import os
import pathlib
import shlex
import stat
import subprocess

REPO = pathlib.Path(__file__).resolve().parent.parent
FLAGS = ["train", "--gin_file=runs/train.gin", "--gin.MODEL_DIR='gs://bucket/run 1'"]


def _stub(folder: pathlib.Path, name: str, log: pathlib.Path) -> pathlib.Path:
    """An executable `name` appending its arguments (one shell-quoted line) to `log`, in
    one write, so the concurrent processes of multiprocess.sh cannot interleave lines."""
    path = folder / name
    path.write_text('#!/usr/bin/env bash\nline="$(printf "%q " "$@")"\n'
                    f'echo "$line" >> {shlex.quote(str(log))}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _run(script: str, args, tmp_path, **env):
    environ = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", **env)
    return subprocess.run(["bash", f"launch/{script}", *args], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=60)


def _lines(log: pathlib.Path) -> list[list[str]]:
    return [shlex.split(line) for line in log.read_text().splitlines() if line.strip()]


def test_tpu_pod_runs_one_command_on_every_worker(tmp_path):
    log = tmp_path / "gcloud.log"
    _stub(tmp_path, "gcloud", log)
    out = _run("tpu_pod.sh", FLAGS, tmp_path, TPU="my-pod", ZONE="us-central2-b")
    assert out.returncode == 0, out.stderr
    (call,) = _lines(log)
    assert call[:8] == ["compute", "tpus", "tpu-vm", "ssh", "my-pod", "--zone", "us-central2-b",
                        "--worker=all"]
    assert call[8] == "--command"
    # What every worker runs, with the flags quoted as given:
    assert shlex.split(call[9]) == ["cd", "ktx", "&&", ".venv/bin/ktx", *FLAGS, "--multihost"]


def test_tpu_pod_needs_its_name_and_zone(tmp_path):
    _stub(tmp_path, "gcloud", tmp_path / "gcloud.log")
    out = _run("tpu_pod.sh", FLAGS, tmp_path, ZONE="z")
    assert out.returncode != 0 and "set TPU to the TPU VM name" in out.stderr
    assert not (tmp_path / "gcloud.log").exists()


def test_gpu_slurm_runs_ktx_under_srun(tmp_path):
    log = tmp_path / "srun.log"
    _stub(tmp_path, "srun", log)
    out = _run("gpu_slurm.sh", FLAGS, tmp_path, KTX="/opt/ktx/bin/ktx")
    assert out.returncode == 0, out.stderr
    assert _lines(log) == [["/opt/ktx/bin/ktx", *FLAGS, "--multihost"]]


def test_local_and_multiprocess(tmp_path):
    log = tmp_path / "ktx.log"
    ktx = _stub(tmp_path, "ktx_stub", log)
    out = _run("local.sh", FLAGS, tmp_path, KTX=str(ktx))
    assert out.returncode == 0, out.stderr
    assert _lines(log) == [FLAGS]
    log.unlink()
    out = _run("multiprocess.sh", ["3", *FLAGS], tmp_path, KTX=str(ktx), KTX_COORDINATOR_PORT="4321")
    assert out.returncode == 0, out.stderr
    assert sorted(_lines(log)) == [
        [*FLAGS, "--multihost", "--coordinator_address=localhost:4321", "--num_processes=3",
         f"--process_id={i}"] for i in range(3)]


def test_multiprocess_names_a_failed_process(tmp_path):
    failing = tmp_path / "ktx_fail"
    failing.write_text('#!/usr/bin/env bash\n[[ "$*" == *--process_id=1* ]] && exit 7\nexit 0\n')
    failing.chmod(failing.stat().st_mode | stat.S_IEXEC)
    out = _run("multiprocess.sh", ["2", *FLAGS], tmp_path, KTX=str(failing))
    assert out.returncode == 7
    assert "ktx: process 1 of 2 exited with status 7" in out.stderr
