"""Training throughput: tokens/s, examples/s, model TFLOP/s per device and MFU.

* Tokens are counted on the host from each batch (`token_counts`): the token features
  the models read (`TOKEN_FEATURES`: T5's encoder inputs and decoder targets, BERT's
  `input_ids`), all positions (`tokens`) and those that are not padding (id 0,
  `nonpad_tokens`). Features absent from a batch count nothing (the recommendation
  model has no tokens: no token rates are reported).
* FLOPs are those of the compiled train step per device, after partitioning
  (`Trainer.last_step_flops`): the larger of XLA's cost analysis, which counts a loop's
  body once, and the matmuls of the optimized program with every loop counted by its trip
  count (`ktx.training.hlo_cost.step_flops`): a scanned layer stack counts every layer,
  microbatches every microbatch; a `lax.scan` over K steps (`steps_per_call`) is divided
  by K (`tests/test_throughput.py` checks both against a hand count).
* MFU is the model TFLOP/s per device over the device's peak (`device_peak`): the
  published dense bf16 peak of TPUs (`ktx.training.precompile.CHIPS`) and of GPUs
  (`GPU_PEAK_TFLOPS`), or a peak the user measured (`peak_tflops`); on a CPU there is
  none and MFU is reported as n/a.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["GPU_PEAK_TFLOPS", "TOKEN_FEATURES", "Throughput", "device_peak", "token_counts"]

TOKEN_FEATURES = ("encoder_input_tokens", "decoder_target_tokens", "input_ids", "input_ids_b")

# Dense bf16 tensor-core peaks per GPU (NVIDIA's data sheets, SXM parts).
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0}

# `device_kind` of a TPU device -> the generation's name in `precompile.CHIPS`.
_TPU_KINDS = (("v6 lite", "v6e"), ("v6e", "v6e"), ("v5 lite", "v5e"), ("v5e", "v5e"),
              ("v5p", "v5p"), ("v5", "v5p"), ("v4", "v4"))


def token_counts(batch: Mapping[str, Any]) -> tuple[int, int]:
    """`(non-padding tokens, tokens)` of a host batch (`{feature: [..., B, L]}`), over
    `TOKEN_FEATURES`."""
    nonpad = total = 0
    for name in TOKEN_FEATURES:
        if name in batch:
            ids = np.asarray(batch[name])
            total += ids.size
            nonpad += int(np.count_nonzero(ids))
    return nonpad, total


def device_peak(device: Any = None, peak_tflops: float | None = None
                ) -> tuple[float | None, str]:
    """`(peak FLOP/s of one device, which peak)`: the label the progress line shows
    beside MFU (`"v5e peak"`, `"H200 peak"`, `"measured peak"`, `"cpu: no peak"`).

    `peak_tflops` (a measured peak, TFLOP/s per device) wins; otherwise the published
    peak of the device's kind; `(None, ...)` when there is none (a CPU, an unknown chip:
    bind `train_script.train.peak_tflops` to a measured one).
    """
    if peak_tflops is not None:
        if isinstance(peak_tflops, bool) or not isinstance(peak_tflops, (int, float)) \
                or not peak_tflops > 0:
            raise ValueError(f"peak_tflops={peak_tflops!r}; accepted: None (the device's "
                             "published peak) or a measured TFLOP/s per device > 0")
        return float(peak_tflops) * 1e12, "measured peak"
    if device is None:
        import jax

        device = jax.devices()[0]
    kind = str(getattr(device, "device_kind", "")).lower()
    platform = getattr(device, "platform", "")
    if platform == "tpu":
        from ktx.training.precompile import CHIPS

        for marker, name in _TPU_KINDS:
            if marker in kind:
                return CHIPS[name].peak_tflops * 1e12, f"{name} peak"
    if platform == "gpu":
        for name, tflops in GPU_PEAK_TFLOPS.items():
            if name.lower() in kind:
                return tflops * 1e12, f"{name} peak"
    return None, f"{platform or kind or 'this device'}: no peak"


def _si(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


class Throughput:
    """One log period's FLOPs and tokens; `rates(seconds)` turns them into the period's
    `tokens_per_s`, `nonpad_tokens_per_s` (global, every process's rows),
    `tflops_per_device` and `mfu`, and starts the next period.

    Args:
      peak_flops, peak_source: `device_peak()`'s answer (peak None: MFU is n/a).
    """

    def __init__(self, peak_flops: float | None, peak_source: str):
        self.peak_flops, self.peak_source = peak_flops, peak_source
        self._reset()

    def _reset(self) -> None:
        self.flops, self.flops_known, self.tokens = 0.0, True, np.zeros(2, np.int64)

    def add(self, steps: int, flops_per_step: float | None, tokens: tuple[int, int] | None) -> None:
        """`steps` steps of `flops_per_step` FLOPs per device, this process's
        `(non-padding, all)` tokens of them."""
        if flops_per_step is None:
            self.flops_known = False
        else:
            self.flops += flops_per_step * steps
        if tokens is not None:
            self.tokens += np.asarray(tokens, np.int64)

    def rates(self, seconds: float) -> dict[str, float]:
        """The period's rates over `seconds` of training; every process calls it at the
        same steps (on many, the token counts are all-gathered)."""
        import jax

        tokens = self.tokens
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            tokens = np.asarray(multihost_utils.process_allgather(tokens)).reshape(-1, 2).sum(0)
        seconds = max(float(seconds), 1e-9)
        out: dict[str, float] = {}
        if tokens[1] > 0:
            out["tokens_per_s"] = float(tokens[1]) / seconds
            out["nonpad_tokens_per_s"] = float(tokens[0]) / seconds
        if self.flops_known and self.flops > 0:
            out["tflops_per_device"] = self.flops / seconds / 1e12
            if self.peak_flops:
                out["mfu"] = self.flops / seconds / self.peak_flops
        self._reset()
        return out

    def describe(self, rates: Mapping[str, float]) -> str:
        """The progress line's part: `8.3k tok/s (6.1k non-pad) | 0.012 TFLOP/s/device |
        MFU 41.2% (v5e peak)` (on a CPU `MFU n/a (cpu: no peak)`)."""
        parts = []
        if "tokens_per_s" in rates:
            parts.append(f"{_si(rates['tokens_per_s'])} tok/s "
                         f"({_si(rates['nonpad_tokens_per_s'])} non-pad)")
        if "tflops_per_device" in rates:
            parts.append(f"{rates['tflops_per_device']:.3g} TFLOP/s/device")
            parts.append(f"MFU {100 * rates['mfu']:.1f}% ({self.peak_source})" if "mfu" in rates
                         else f"MFU n/a ({self.peak_source})")
        return " | ".join(parts)
