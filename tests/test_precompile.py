"""`ktx precompile`: the real train step compiled ahead of time, with XLA's per-device
memory and FLOPs. On this process's devices always; on a TPU topology when libtpu is
installed (`pip install 'ktx[tpu]'`)."""

from __future__ import annotations

import flax
import gin
import jax
import pytest

from ktx import cli, optim
from ktx.training import optimizers
from ktx.models import seq2seq, t5
from ktx.training.precompile import (
    FIBER_STACK_BYTES,
    TEST_CHILD_ENV,
    libtpu_init_args,
    precompile,
    topology_devices,
)
from tests.tiny_t5_gin import tiny_t5_gin


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config(clear_constants=True)
    yield
    gin.clear_config(clear_constants=True)


def _model(num_tasks=4):
    cfg = t5.T5Config(vocab_size=384, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                      num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0)
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
    # XLA's peak of live buffers: the arguments live throughout, and never more than the
    # compiler reserves (its total).
    for report in (plain, balanced):
        assert report.argument_bytes <= report.live_peak_bytes
        assert report.live_peak_bytes <= report.total_bytes
    assert "live peak" in plain.format()


def test_cli_precompile_on_local_devices(tmp_path, capsys):
    model = tmp_path / "model.gin"
    model.write_text(tiny_t5_gin(), encoding="utf-8")
    code = cli.main(["precompile", "--topology=cpu", "--gin_file=runs/train.gin",
                     f"--gin_file={model}", "--gin.NUM_TASKS=4", "--gin.BATCH_SIZE=8",
                     "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 4}",
                     "--gin_file=optim/metabalance.gin", "--gin.PRECOMPILE_TASK_COUNTS=[3, 1, 2, 2]"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "topology cpu" in out.out and "arguments" in out.out and "FLOPs/step" in out.out
    # The balanced step is compiled for the given rows per task: one row per device here.
    assert ("per-task    task counts (3, 1, 2, 2): device by device, one task on each device"
            in out.out), out.out


def test_cli_precompile_rejects_bad_task_counts(tmp_path, capsys):
    assert cli.main(_tiny_cli_args(tmp_path, "--gin.PRECOMPILE_TASK_COUNTS=[9, 0]")) == 2
    assert ("PRECOMPILE_TASK_COUNTS=[9, 0]; accepted: 2 row counts (one per task, ints >= 0) "
            "summing to BATCH_SIZE=8, e.g. [4, 4]") in capsys.readouterr().err


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
    # The child sleeps where it would compile, so it never ends on its own; the limit is
    # counted from the child's start and may stop it before the step is even traced, when
    # the line names the mesh as not built yet (a 2-core machine imports JAX in about 3 s).
    monkeypatch.setenv(TEST_CHILD_ENV, "hang")
    code = cli.main(_tiny_cli_args(tmp_path, "--timeout=2"))
    err = capsys.readouterr().err
    assert code == 4, err
    lines = [ln for ln in err.splitlines() if ln.startswith("ktx")]
    assert len(lines) == 1, err
    assert lines[0].startswith("ktx precompile: topology cpu (mesh "), err
    assert lines[0].endswith("the compile ran over the time limit of 2 s and was stopped"), err


def test_cli_precompile_rejects_a_non_positive_timeout(tmp_path, capsys):
    assert cli.main(_tiny_cli_args(tmp_path, "--timeout=0")) == 2
    assert "--timeout=0; accepted: seconds > 0" in capsys.readouterr().err


def test_cli_precompile_needs_a_topology(tmp_path, capsys):
    model = tmp_path / "model.gin"
    model.write_text(tiny_t5_gin(), encoding="utf-8")
    assert cli.main(["precompile", "--gin_file=runs/train.gin", f"--gin_file={model}"]) == 2
    assert "--topology" in capsys.readouterr().err


def test_libtpu_init_args_raise_the_compilers_fiber_stacks_and_keep_a_users_value():
    # libtpu's convolution emitter overflowed its default fiber stacks on XL/XXL steps
    # (SIGSEGV); precompile gives the compiler 64 MiB stacks unless the user set a size.
    flag = f"--fibers_default_thread_stack_size={FIBER_STACK_BYTES}"
    assert libtpu_init_args("") == flag
    assert libtpu_init_args("--xla_tpu_foo=1") == f"--xla_tpu_foo=1 {flag}"
    mine = "--xla_tpu_foo=1 --fibers_default_thread_stack_size=1048576"
    assert libtpu_init_args(mine) == mine
    assert libtpu_init_args(libtpu_init_args("")) == flag  # idempotent
    assert FIBER_STACK_BYTES == 64 * 2**20


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


def _recsys(num_users=1000, num_items=501, **kw):
    from ktx.models.recsys import RecsysModel

    return RecsysModel(num_users=num_users, num_items=num_items, num_tasks=3, embed_dim=16,
                       dropout_rate=0.5, **kw)


def test_balanced_recommendation_step_splits_its_task_blocks_over_data():
    """The task blocks of a balanced step are sliced from the batch at traced starts; the
    recommendation model has no activation constraints of its own, and without the
    engine's constraint on the blocks' rows XLA computed every block on every device
    (4.4x the plain step's FLOPs per device on 8 devices). Unequal counts (512 rows over
    3 tasks) take the blocks `ktx train` compiles: rounded up to the data axis."""
    plain = precompile(_recsys(), optimizers.adamw(1e-3), topology="cpu", batch_size=512,
                       task_feature_lengths=None)
    balanced = precompile(_recsys(), optimizers.adamw(1e-3), topology="cpu", batch_size=512,
                          task_feature_lengths=None, balancer=optim.vanilla_multi(),
                          weights_from_losses=False)  # per-task gradients from task blocks
    assert plain.mesh_shape == {"data": 8, "model": 1}
    ratio = balanced.flops_per_step / plain.flops_per_step
    assert ratio < 1.5, ratio


def test_recommendation_tables_padded_for_the_model_axis():
    """11,953 items do not split 2 ways: one line names the table, its logical axis and
    the fix; `table_rows_multiple` pads the tables, and padded rows are never ranked."""
    with pytest.raises(ValueError, match=r"item_embedding/embedding \(501, 16\).*'items'.*"
                                         r"model \(2 ways\).*table_rows_multiple"):
        precompile(_recsys(), optimizers.adamw(1e-3), topology="cpu", batch_size=64,
                   task_feature_lengths=None, num_partitions=2)
    report = precompile(_recsys(table_rows_multiple=128), optimizers.adamw(1e-3),
                        topology="cpu", batch_size=64, task_feature_lengths=None, num_partitions=2)
    assert report.mesh_shape == {"data": 4, "model": 2}
    model = _recsys(table_rows_multiple=128)
    batch = {k: jax.numpy.zeros(v.shape, v.dtype) for k, v in model.input_spec(4).items()}
    params = flax.linen.meta.unbox(model.init_variables(jax.random.key(0), batch)["params"])
    assert params["user_embedding"]["embedding"].shape == (1024, 16)
    assert params["item_embedding"]["embedding"].shape == (512, 16)
    assert model.rank_item_part(params)["emb"].shape == (501, 16)


def test_cli_precompile_of_the_recommendation_run_needs_no_lengths(tmp_path, capsys):
    """runs/recsys_train.gin names its batch size on its reader (RECSYS_BATCH_SIZE) and the
    model has no feature lengths: `ktx precompile` needs neither macro."""
    code = cli.main(["precompile", "--topology=cpu",
                     "--gin_file=experiments/recsys/metabalance.gin",
                     "--gin_file=runs/recsys_train.gin", f"--gin.MODEL_DIR='{tmp_path}'",
                     "--gin.RECSYS_BATCH_SIZE=64", "--gin.NUM_PARTITIONS=2",
                     "--gin.recsys.RecsysModel.table_rows_multiple=128"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "mesh data=4 x model=2" in out.out and "FLOPs/step" in out.out
