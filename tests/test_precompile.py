"""`ktx precompile`: the real train step compiled ahead of time, with XLA's per-device
memory and FLOPs. On this process's devices always; on a TPU topology when libtpu is
installed (`pip install 'ktx[tpu]'`)."""

from __future__ import annotations

import gin
import jax
import pytest

from ktx import cli, optim
from ktx.training import optimizers
from ktx.models import seq2seq, t5
from ktx.training.precompile import TEST_CHILD_ENV, precompile, topology_devices
from tests.tiny_t5_gin import tiny_t5_gin


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config(clear_constants=True)
    yield
    gin.clear_config(clear_constants=True)


def _model(num_tasks=4):
    cfg = t5.T5Config(vocab_size=384, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                      num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.1)
    return seq2seq.EncoderDecoderModel(cfg, num_tasks=num_tasks)


def test_report_on_local_devices_counts_the_sharded_state():
    model = _model()
    lengths = {"inputs": 32, "targets": 8}
    plain = precompile(model, optimizers.adamw(1e-3), topology="cpu", batch_size=16,
                       task_feature_lengths=lengths, num_partitions=2)
    balanced = precompile(model, optimizers.adamw(1e-3), topology="cpu", batch_size=16,
                          task_feature_lengths=lengths, num_partitions=2,
                          balancer=optim.metabalance(num_tasks=4))
    n = len(jax.devices())
    assert plain.num_devices == n and plain.mesh_shape == {"data": n // 2, "model": 2}
    # AdamW: params + 2 moments; each device holds at least its share of them.
    from ktx.analysis import params as kparams

    total_params = kparams.count_parameters(model)["total"]
    assert plain.argument_bytes >= 3 * 4 * total_params / n
    assert plain.alias_bytes > 0 and plain.temp_bytes > 0 and plain.flops_per_step > 0
    assert balanced.argument_bytes > plain.argument_bytes  # MetaBalance's moving averages
    assert plain.hbm_bytes is None and plain.fits is None
    assert "temporaries" in plain.format()


def test_cli_precompile_on_local_devices(tmp_path, capsys):
    model = tmp_path / "model.gin"
    model.write_text(tiny_t5_gin(), encoding="utf-8")
    code = cli.main(["precompile", "--topology=cpu", "--gin_file=runs/train.gin",
                     f"--gin_file={model}", "--gin.NUM_TASKS=4", "--gin.BATCH_SIZE=8",
                     "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 4}",
                     "--gin_file=optim/metabalance.gin"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "topology cpu" in out.out and "arguments" in out.out and "FLOPs/step" in out.out


def _tiny_cli_args(tmp_path, *extra):
    model = tmp_path / "model.gin"
    model.write_text(tiny_t5_gin(), encoding="utf-8")
    return ["precompile", "--topology=cpu", "--gin_file=runs/train.gin", f"--gin_file={model}",
            "--gin.NUM_TASKS=2", "--gin.BATCH_SIZE=8", "--gin.NUM_PARTITIONS=2",
            "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 4}", *extra]


@pytest.mark.parametrize("signal_name,number", [("SIGSEGV", 11), ("SIGKILL", 9)])
def test_cli_precompile_survives_a_compiler_crash(tmp_path, capsys, monkeypatch, signal_name, number):
    # The test-only hook makes the compile's child process send itself the signal once the
    # step is lowered, as libtpu's compiler did (SIGSEGV) on XXL + HyperPrompt-Global.
    monkeypatch.setenv(TEST_CHILD_ENV, signal_name)
    code = cli.main(_tiny_cli_args(tmp_path))
    out = capsys.readouterr()
    n = len(jax.devices())
    assert code == 4, out.err
    lines = [ln for ln in out.err.splitlines() if ln.startswith("ktx")]
    assert lines == [f"ktx precompile: topology cpu (mesh data={n // 2} x model=2): the compiler's "
                     f"process was killed by {signal_name} (signal {number}): a compiler crash, "
                     "no figures"], out.err
    assert "arguments" not in out.out


def test_cli_precompile_stops_a_compile_over_its_timeout(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(TEST_CHILD_ENV, "hang")  # the child sleeps where it would compile
    code = cli.main(_tiny_cli_args(tmp_path, "--timeout=20"))
    err = capsys.readouterr().err
    assert code == 4, err
    assert "ktx precompile: topology cpu (mesh " in err
    assert "ran over the time limit of 20 s and was stopped" in err


def test_cli_precompile_rejects_a_non_positive_timeout(tmp_path, capsys):
    assert cli.main(_tiny_cli_args(tmp_path, "--timeout=0")) == 2
    assert "--timeout=0; accepted: seconds > 0" in capsys.readouterr().err


def test_cli_precompile_needs_a_topology(tmp_path, capsys):
    model = tmp_path / "model.gin"
    model.write_text(tiny_t5_gin(), encoding="utf-8")
    assert cli.main(["precompile", "--gin_file=runs/train.gin", f"--gin_file={model}"]) == 2
    assert "--topology" in capsys.readouterr().err


def _tpu_available():
    try:
        topology_devices("v5e:2x2")
        return True
    except RuntimeError:
        return False


@pytest.mark.skipif(not _tpu_available(), reason="libtpu is not installed (pip install 'ktx[tpu]')")
def test_tpu_topology_fits_and_overshoots():
    model = _model(num_tasks=2)
    ok = precompile(model, optimizers.adamw(1e-3), topology="v5e:2x2", batch_size=8,
                    task_feature_lengths={"inputs": 32, "targets": 8})
    assert ok.fits and ok.hbm_bytes == 16 * 2**30 * 4 // ok.num_devices
    assert ok.predicted_step_seconds > 0
    from ktx.training.precompile import DoesNotFitError

    with pytest.raises(DoesNotFitError, match=r"v5e:2x2.*does not fit.*HBM"):
        precompile(_model(num_tasks=2), optimizers.adamw(1e-3), topology="v5e:2x2",
                   batch_size=4096, task_feature_lengths={"inputs": 8192, "targets": 512})


@pytest.mark.skipif(not _tpu_available(), reason="libtpu is not installed (pip install 'ktx[tpu]')")
def test_cli_precompile_does_not_fit_exits_3_with_xla_figures(tmp_path, capsys):
    # Through the child process, the does-not-fit path is what it was: exit 3, one line.
    args = _tiny_cli_args(tmp_path, "--gin.BATCH_SIZE=4096",
                          "--gin.TASK_FEATURE_LENGTHS={'inputs': 8192, 'targets': 512}")
    args[1] = "--topology=v5e:2x2"
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 3, err
    assert "ktx precompile: topology v5e:2x2 (mesh {'data': 2, 'model': 2}, batch 4096): does not fit" in err
