"""Throughput and MFU (`ktx.training.throughput`): XLA's FLOPs of the compiled train step
against a hand count of a dense model, per device on one device and on 8; the rates,
the progress line and metrics.jsonl of a real `train()`."""

from __future__ import annotations

import math
import types

import jax
import numpy as np
import optax
import pytest

from ktx import partitioning
from ktx.runs.train import train
from ktx.training import optimizers
from ktx.training.summaries import read_metrics
from ktx.training.throughput import Throughput, device_peak, token_counts
from ktx.training.trainer import Trainer
from tests.test_trainer import ToyInput, ToyModel

B, D, H, CLASSES = 256, 256, 512, 4


def _hand_count(rows: int) -> int:
    """Matmul FLOPs of one SGD step of `ToyModel` (x @ W1 -> relu -> @ W2 -> 4 logits):
    forward 2·B·D·H + 2·B·H·C; backward dW2 and dh 2·B·H·C each, dW1 2·B·D·H (the input
    needs no gradient)."""
    return 4 * rows * D * H + 6 * rows * H * CLASSES


@pytest.mark.parametrize("devices", [1, 8])
def test_step_flops_match_a_hand_count(devices):
    mesh = partitioning.create_mesh(1, devices=jax.devices()[:devices])
    trainer = Trainer(ToyModel(dim=D, hidden=H), optax.sgd(0.1), mesh=mesh, norm_metrics=False)
    inp = ToyInput(batch_size=B, dim=D, counts=(B // 2, B // 2))
    state = trainer.init_state(jax.random.key(0), inp.get_batch(0))
    state, _ = trainer.train_step(state, inp.get_batch(0), jax.random.key(1))
    single = trainer.last_step_flops
    hand = _hand_count(B // devices)  # data-parallel: each device runs B / devices rows
    # The rest (bias, relu, softmax; the update of every parameter, whole on every device
    # of the data-parallel mesh) is under 1% of it on one device, 3% on 8.
    print(f"{devices} device(s): XLA {single:.6g} FLOPs/step/device, hand count {hand:.6g}")
    assert hand <= single <= (1.01 if devices == 1 else 1.03) * hand
    # K steps scanned in one call: per step, the same (the matmul count divided by K).
    batches = {k: np.stack([inp.get_batch(s)[k] for s in (1, 2, 3)]) for k in inp.get_batch(0)}
    state, _ = trainer.train_steps(state, batches, jax.random.key(1))
    assert trainer.last_step_flops == pytest.approx(single, rel=0.01)


def test_rates_and_progress_line_by_hand():
    meter = Throughput(2e12, "measured peak")
    meter.add(2, 1e12, (30, 40))
    meter.add(1, 1e12, (15, 20))
    rates = meter.rates(3.0)  # 3 steps of 1 TFLOP in 3 s: 1 TFLOP/s per device, MFU 0.5
    assert rates == pytest.approx({"tokens_per_s": 20.0, "nonpad_tokens_per_s": 15.0,
                                   "tflops_per_device": 1.0, "mfu": 0.5})
    assert meter.describe(rates) == "20 tok/s (15 non-pad) | 1 TFLOP/s/device | MFU 50.0% (measured peak)"
    assert meter.rates(1.0) == {}  # the period was reset
    cpu = Throughput(*device_peak(jax.devices("cpu")[0]))
    cpu.add(1, 5e9, (1500, 2000))
    rates = cpu.rates(0.5)
    assert "mfu" not in rates and rates["tflops_per_device"] == pytest.approx(0.01)
    assert cpu.describe(rates) == "4k tok/s (3k non-pad) | 0.01 TFLOP/s/device | MFU n/a (cpu: no peak)"


def test_device_peaks():
    def device(platform, kind):
        return types.SimpleNamespace(platform=platform, device_kind=kind)

    assert device_peak(device("tpu", "TPU v5 lite")) == (197e12, "v5e peak")
    assert device_peak(device("tpu", "TPU v4")) == (275e12, "v4 peak")
    assert device_peak(device("gpu", "NVIDIA H200")) == (989e12, "H200 peak")
    assert device_peak(device("cpu", "cpu")) == (None, "cpu: no peak")
    assert device_peak(device("cpu", "cpu"), peak_tflops=0.5) == (0.5e12, "measured peak")
    with pytest.raises(ValueError, match="peak_tflops=-1; accepted: None"):
        device_peak(peak_tflops=-1)


def test_token_counts():
    batch = {"encoder_input_tokens": np.array([[5, 6, 0, 0], [7, 0, 0, 0]]),
             "decoder_target_tokens": np.array([[3, 1], [1, 0]]),
             "decoder_input_tokens": np.array([[0, 3], [0, 1]]),  # the targets shifted: not counted
             "task_id": np.array([0, 1])}
    assert token_counts(batch) == (6, 12)
    assert token_counts({"x": np.ones((2, 3))}) == (0, 0)


def test_train_reports_throughput(tmp_path, capsys):
    train(model=ToyModel(), train_input=ToyInput(), model_dir=tmp_path, optimizer=optax.sgd(0.1),
          schedule=optimizers.constant_schedule(0.1), train_steps=4, log_period=2,
          checkpoint_period=100)
    rows = [r for r in read_metrics(tmp_path) if r["split"] == "train" and r["task"] == "all"]
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert r["tflops_per_device"] > 0 and math.isfinite(r["tflops_per_device"])
        assert "mfu" not in r  # a CPU has no peak
        assert "tokens_per_s" not in r  # ToyInput has no token features
    out = capsys.readouterr().out
    assert "TFLOP/s/device | MFU n/a (cpu: no peak)" in out, out
