"""Checkpoints: keep-N and periods, restore onto another mesh, shape errors, partial
restore from INITIAL_CHECKPOINT_PATH, and kill -9 / resume equivalence."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import optax
import pytest
from tests.xla_env import with_devices

from ktx import partitioning
from ktx.training.initial_params import load_initial_params
from ktx.training.checkpoints import (
    CheckpointManager,
    CheckpointShapeError,
    CorruptCheckpointError,
    resolve_checkpoint,
    restore_params,
)
from ktx.training.trainer import Trainer
from tests.test_cli_paths import _corrupt
from tests.test_trainer import ToyInput, ToyModel

REPO = pathlib.Path(__file__).resolve().parent.parent


def _state(mesh_partitions=1, hidden=8, seed=0):
    tr = Trainer(ToyModel(hidden=hidden), optax.adam(1e-2), mesh=partitioning.create_mesh(mesh_partitions))
    return tr, tr.init_state(jax.random.key(seed), ToyInput().get_batch(0))


def test_save_period_keep_and_force(tmp_path):
    tr, state = _state()
    mgr = CheckpointManager(tmp_path, save_period=2, keep=2)
    for step in range(1, 6):
        state = state.replace(step=jax.numpy.int32(step))
        mgr.save(state)
    assert mgr.all_steps() == [2, 4]
    assert mgr.save(state.replace(step=jax.numpy.int32(5)), force=True)
    assert mgr.all_steps() == [4, 5]
    assert mgr.read_meta(5)["step"] == 5
    mgr.close()


def test_restore_onto_another_mesh(tmp_path):
    tr1, state = _state(mesh_partitions=1)
    state, _ = tr1.train_step(state, ToyInput().get_batch(0), jax.random.key(1))
    mgr = CheckpointManager(tmp_path, save_period=1)
    mgr.save(state)
    mgr.wait()
    tr2 = Trainer(ToyModel(), optax.adam(1e-2), mesh=partitioning.create_mesh(4))
    abstract, _ = tr2.create_abstract_state(ToyInput().get_batch(0))
    restored = CheckpointManager(tmp_path).restore(abstract)
    kernel = restored.params["Dense_0"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert kernel.sharding.mesh.shape == {"data": 2, "model": 4}
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(state))
    # And training continues identically on the new mesh.
    s1, m1 = tr1.train_step(state, ToyInput().get_batch(1), jax.random.key(1))
    s2, m2 = tr2.train_step(restored, ToyInput().get_batch(1), jax.random.key(1))
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-6)


def test_shape_mismatch_lists_paths(tmp_path):
    _, state = _state(hidden=8)
    mgr = CheckpointManager(tmp_path, save_period=1)
    mgr.save(state, force=True)
    mgr.wait()
    tr, _ = _state(hidden=16)
    abstract, _ = tr.create_abstract_state(ToyInput().get_batch(0))
    with pytest.raises(CheckpointShapeError) as e:
        CheckpointManager(tmp_path).restore(abstract)
    msg = str(e.value)
    assert "Dense_0/kernel: checkpoint (6, 8), model (6, 16)" in msg
    assert "Dense_0/bias: checkpoint (8,), model (16,)" in msg
    assert "Dense_1/kernel: checkpoint (8, 4), model (16, 4)" in msg
    with pytest.raises(CheckpointShapeError, match="Dense_0/kernel"):
        restore_params(tmp_path, abstract.params)


def test_initial_checkpoint_partial_restore_reports(tmp_path):
    _, state = _state(seed=0)
    mgr = CheckpointManager(tmp_path / "old", save_period=1)
    # Drop one parameter from the saved tree: it plays the role of a new prompt.
    saved = state.replace(params={"Dense_0": state.params["Dense_0"]})
    mgr.save(saved, force=True)
    mgr.close()
    tr, fresh = _state(seed=7)
    params, report = load_initial_params(tmp_path / "old", tr.abstract_state.params, fresh.params)
    assert report.restored == ("Dense_0/bias", "Dense_0/kernel")
    assert report.initialized == ("Dense_1/kernel",)
    np.testing.assert_array_equal(params["Dense_0"]["kernel"], state.params["Dense_0"]["kernel"])
    np.testing.assert_array_equal(params["Dense_1"]["kernel"], fresh.params["Dense_1"]["kernel"])
    assert "initialized: Dense_1/kernel" in report.summary()
    assert resolve_checkpoint(tmp_path / "old").name == "0"


def test_restore_latest_good_moves_aside_only_steps_newer_than_a_readable_one(tmp_path, capsys):
    tr, state = _state()
    mgr = CheckpointManager(tmp_path, save_period=2)
    for step in (2, 4):
        mgr.save(state.replace(step=jax.numpy.int32(step)))
    mgr.close()
    abstract, _ = tr.create_abstract_state(ToyInput().get_batch(0))
    _corrupt(tmp_path / "checkpoints" / "4")
    restored = CheckpointManager(tmp_path).restore_latest_good(abstract)
    assert int(restored.step) == 2
    out = capsys.readouterr().out
    assert "moved it to" in out and "found no array metadata in" in out, out
    assert (tmp_path / "checkpoints" / "4.corrupt").is_dir()
    # Step 4 saved again and broken again: set aside beside the first one.
    mgr = CheckpointManager(tmp_path, save_period=2)
    mgr.save(state.replace(step=jax.numpy.int32(4)))
    mgr.close()
    _corrupt(tmp_path / "checkpoints" / "4")
    assert int(CheckpointManager(tmp_path).restore_latest_good(abstract).step) == 2
    assert (tmp_path / "checkpoints" / "4.corrupt.1").is_dir()
    assert CheckpointManager(tmp_path).all_steps() == [2]

    # No step reads: the cause may be the machine, not the files, so nothing is moved.
    mgr = CheckpointManager(tmp_path, save_period=2)
    mgr.save(state.replace(step=jax.numpy.int32(4)))
    mgr.close()
    for step in ("2", "4"):
        _corrupt(tmp_path / "checkpoints" / step)
    with pytest.raises(CorruptCheckpointError, match=r"step 4 .*no step of .* \(4, 2\), so none was moved"):
        CheckpointManager(tmp_path).restore_latest_good(abstract)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "4", "4.corrupt", "4.corrupt.1"]


_ONE_DEVICE_LOAD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    import flax.linen as nn
    import jax, jax.numpy as jnp, numpy as np
    from ktx.training.initial_params import load_initial_params
    from tests.test_trainer import ToyInput, ToyModel

    assert jax.device_count() == 1, jax.devices()
    model = ToyModel()
    # Shapes without shardings, as `ktx analyze` builds them (jax.eval_shape).
    abstract = nn.meta.unbox(jax.eval_shape(
        lambda r: model.init_variables(r, ToyInput().get_batch(0))["params"], jax.random.key(0)))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    params, report = load_initial_params(sys.argv[1], abstract, zeros)
    assert not report.initialized, report.initialized
    flat = {{"/".join(str(k.key) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}}
    np.savez(sys.argv[2], **flat)
    """
)


def test_checkpoint_saved_on_a_mesh_loads_on_one_device_without_shardings(tmp_path):
    """A checkpoint written by a 2x4-mesh run is read by a one-device process that gives
    no shardings (`ktx analyze`'s case): the saved run's devices do not exist there, so
    the leaves go to the local device, with the saved values."""
    tr, state = _state(mesh_partitions=4)
    assert state.params["Dense_0"]["kernel"].sharding.mesh.shape == {"data": 2, "model": 4}
    mgr = CheckpointManager(tmp_path / "run", save_period=1)
    mgr.save(state, force=True)
    mgr.close()
    script = tmp_path / "load.py"
    script.write_text(_ONE_DEVICE_LOAD.format(repo=str(REPO)))
    env = {**with_devices(1), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), str(tmp_path / "out.npz")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(tmp_path / "out.npz", allow_pickle=False) as loaded:
        saved = {"/".join(str(k.key) for k in path): np.asarray(v)
                 for path, v in jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]}
        assert sorted(loaded.files) == sorted(saved)
        for name, value in saved.items():
            np.testing.assert_array_equal(loaded[name], value)


_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, {repo!r})
    import optax
    from ktx.runs.train import train
    from tests.test_trainer import ToyInput, ToyModel

    class SlowInput(ToyInput):
        def get_batch(self, step):
            if os.environ.get("SLOW_AFTER") and step >= int(os.environ["SLOW_AFTER"]):
                time.sleep(120)  # the run stalls here until it is killed
            return super().get_batch(step)

    train(model=ToyModel(dropout=0.3), train_input=SlowInput(), model_dir=sys.argv[1],
          optimizer=optax.adam(1e-2), train_steps=8, log_period=2, checkpoint_period=2,
          num_partitions=2)
    """
)


@pytest.mark.slow
def test_kill9_resume_matches_uninterrupted(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT.format(repo=str(REPO)))
    env = with_devices(8)
    killed = tmp_path / "killed"
    # Batches from step 5 on stall, so the run stops after step 5 with checkpoints 2 and
    # 4 finalized (orbax renames a step directory into place only once it is complete);
    # kill -9 it there.
    proc = subprocess.Popen(
        [sys.executable, str(script), str(killed)], env={**env, "SLOW_AFTER": "5"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "4").is_dir() and time.time() < deadline:
        assert proc.poll() is None, "the training process ended before it was killed"
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert CheckpointManager(killed).all_steps() == [2, 4]
    subprocess.run([sys.executable, str(script), str(killed)], env=env, check=True,
                   capture_output=True, timeout=300)
    straight = tmp_path / "straight"
    subprocess.run([sys.executable, str(script), str(straight)], env=env, check=True,
                   capture_output=True, timeout=300)
    tr = Trainer(ToyModel(dropout=0.3), optax.adam(1e-2))
    abstract, _ = tr.create_abstract_state(ToyInput().get_batch(0))
    a = CheckpointManager(killed).restore(abstract)
    b = CheckpointManager(straight).restore(abstract)
    assert int(a.step) == int(b.step) == 8
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), a.params, b.params)
