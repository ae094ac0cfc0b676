"""Progress and ETA: the training line's rate leaves evaluations out; long evaluations
(full ranking of users, decoding) print a line with rate and ETA at most every 30 s."""

import io
import time

import flax.linen as nn
import jax
import numpy as np
import pytest

from ktx import partitioning
from ktx.metrics import ranking
from ktx.models.recsys import RecsysModel
from ktx.runs.eval_progress import PROGRESS_EVERY_SECONDS, EvalProgress
from ktx.runs.hooks import Evaluation
from ktx.training.summaries import ProgressLogger, not_training


def test_step_rate_and_eta_leave_evaluation_out():
    progress = ProgressLogger(100, start_step=0, stream=io.StringIO())
    time.sleep(0.2)  # 10 training steps in 0.2 s
    with not_training():
        time.sleep(1.0)  # an evaluation five times as long as the steps
    steps_per_s, examples_per_s = progress.rates(10, 4)
    assert 30 < steps_per_s < 55  # 50 steps/s less overheads; with the evaluation: < 9
    assert examples_per_s == pytest.approx(4 * steps_per_s)
    eta = progress.line(10, 1.0, steps_per_s, examples_per_s).split("eta ")[1]
    minutes, seconds = map(int, eta.split(":"))
    assert minutes == 0 and seconds <= 3  # 90 steps at ~50/s, not 90 x 0.12 s = 11 s
    # The next window starts after the evaluation: nothing of it is left out twice.
    time.sleep(0.1)
    steps_per_s, _ = progress.rates(15, 4)
    assert 25 < steps_per_s < 55


def test_in_run_evaluation_is_not_training_time():
    class SlowEvaluator:
        title = "slow"

        def __call__(self, *, trainer, params, step, writer):
            time.sleep(0.5)
            return {"task": {"score": 1.0}}

    class NoWriter:
        def write(self, *args):
            pass

    progress = ProgressLogger(10, stream=io.StringIO())
    Evaluation([SlowEvaluator()], 1, NoWriter(), train_steps=10).run(None, None, 1)
    steps_per_s, _ = progress.rates(1, 1)
    assert steps_per_s > 10  # 1 step in ~0 s of training, not 1 step in 0.5 s


def test_eval_progress_prints_rate_and_eta_at_most_every_period():
    assert PROGRESS_EVERY_SECONDS == 30.0
    out = io.StringIO()
    quiet = EvalProgress("ranking validation", 1000, "users", stream=out)
    quiet.add(999)
    assert out.getvalue() == "" and quiet.lines == 0  # under 30 s: silent
    progress = EvalProgress("ranking validation at step 8", 1000, "users", every=0.1, stream=out)
    time.sleep(0.3)  # the first chunk's compilation
    progress.add(100)
    progress.add(100)  # within 0.1 s of the last line: not printed
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and progress.lines == 1
    # One report: no steady rate yet, so no ETA.
    assert lines[0].startswith("ranking validation at step 8: 100/1,000 users | warming up | elapsed 0:0")
    assert "eta" not in lines[0]
    time.sleep(0.15)
    progress.add(100)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("ranking validation at step 8: 300/1,000 users | ")
    # The rate counts from the first report: 200 users in ~0.15 s, not 300 in ~0.45 s
    # (which would put the ETA at 1.1 s instead of about 0.5).
    assert 700 < progress.rate() < 1500
    assert "users/s | elapsed 0:0" in lines[1] and lines[1].split("| eta ")[1] in ("0:00", "0:01")
    with pytest.raises(ValueError, match="every=0"):
        EvalProgress("x", 1, "users", every=0)


def test_full_ranking_reports_every_chunk_of_users():
    model = RecsysModel(num_users=40, num_items=13, num_tasks=3, embed_dim=8,
                        mlp_dims=(6, 4, 2), tower_dims=(5, 4))
    batch = {"user": np.array([0, 1], np.int32), "item": np.array([1, 2], np.int32),
             "label": np.array([1, 0], np.float32), "task_id": np.array([0, 0], np.int32)}
    params = nn.unbox(model.init_variables(jax.random.key(0), batch)["params"])
    rng = np.random.default_rng(0)
    held = np.unique(np.stack([rng.integers(0, 40, 60), rng.integers(0, 13, 60)], 1), axis=0)
    users = len(np.unique(held[:, 0]))
    kw = dict(num_users=40, num_items=13, heldout=held, ks=(3,), user_chunk=3, item_block=5)
    plain = ranking.full_ranking(model, params, **kw)
    for mesh in (None, partitioning.create_mesh(1)):  # one device; 8 fake CPU devices
        reported = []
        got = ranking.full_ranking(model, params, mesh=mesh, progress=reported.append, **kw)
        assert sum(reported) == users and max(reported) <= 3
        assert got == pytest.approx(plain, rel=1e-6)
    assert ranking._chunk_listener["fn"] is None  # noqa: SLF001 - released after the call
