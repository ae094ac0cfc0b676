"""launch/study_slurm_array.sh with a stand-in for ktx: each array task runs its shard."""

from __future__ import annotations

import os
import pathlib
import stat
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_each_array_task_runs_its_shard(tmp_path):
    ktx = tmp_path / "ktx"
    ktx.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    ktx.chmod(ktx.stat().st_mode | stat.S_IEXEC)
    seen = []
    for task in (4, 5, 6):  # sbatch --array=4-6
        env = dict(os.environ, KTX=str(ktx), SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_MIN="4",
                   SLURM_ARRAY_TASK_MAX="6", SLURM_ARRAY_TASK_COUNT="3")
        out = subprocess.run(["bash", "launch/study_slurm_array.sh", "gin/studies/x.gin", "--gin.A='b c'"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        seen.append(out.stdout.splitlines())
    assert seen == [["study", "run", "gin/studies/x.gin", f"--shard={i}/3", "--gin.A='b c'"] for i in range(3)]
    out = subprocess.run(["bash", "launch/study_slurm_array.sh", "x.gin"], cwd=REPO, capture_output=True,
                         text=True, env={k: v for k, v in os.environ.items() if not k.startswith("SLURM")})
    assert out.returncode != 0 and "not in a SLURM array job" in out.stderr
