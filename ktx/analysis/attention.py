"""Peeking into hyper-prompts: attention mass on prompts and entropy over tokens.

`ktx analyze attention` (He et al., 2022, HyperPrompt, the "peeking into hyper-prompts"
analysis). For every encoder self-attention layer and decoder self-attention layer:

* `prompt_mass`: the attention probability that falls on the `l` prompt keys, summed over
  the (valid) queries of an example, averaged over heads and examples;
* `token_entropy`: the entropy (nats) of the attention over the ordinary tokens, after
  removing the prompt keys and renormalising, averaged over valid queries, heads and
  examples.

Attention probabilities come from the `intermediates/.../attention_weights` that
`ktx.models.t5.MultiHeadAttention` sows (`[B, H, Lq, P + Lk]`, prompts first). The prompt
length of a side is the model's hyper-prompt length (HyperPrompt) or the input prompt
length (Prompt-Tuning, encoder only; there the prompts are also queries, which are left
out); 0 for a plain model, whose mass is 0.

`analyze_attention` returns and writes `attention_<task>.json` and `attention_<task>.png`
(matplotlib, Agg backend).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["prompt_lengths", "attention_statistics", "analyze_attention", "analyze_checkpoint",
           "plot_attention", "task_batches"]

_SIDES = {"encoder": "attention", "decoder": "self_attention"}


def prompt_lengths(model: Any) -> dict[str, int]:
    """Number of prompt keys in front of each side's self-attention keys."""
    cfg = getattr(model.module, "conditioning_config", None)
    if cfg is None or cfg.method not in ("hyperprompt", "prompt_tuning"):
        return {"encoder": 0, "decoder": 0}
    if cfg.method == "hyperprompt":
        return {"encoder": cfg.encoder_prompt_length, "decoder": cfg.decoder_prompt_length}
    return {"encoder": cfg.prompt_tuning_length, "decoder": 0}


def attention_statistics(
    probs: jax.Array, num_prompts: int, query_valid: jax.Array, key_valid: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-example sums for one layer.

    Args:
      probs: `[B, H, Lq, P + Lk]` attention probabilities (prompt keys first).
      num_prompts: P.
      query_valid: `[B, Lq]` bool, the queries to count.
      key_valid: `[B, Lk]` bool, the ordinary keys (padding excluded from the entropy).

    Returns:
      `(mass [B], entropy_sum [B], num_queries [B])`: mass on prompts summed over valid
      queries and averaged over heads; entropy summed over valid queries, averaged over
      heads; and the number of valid queries.
    """
    probs = jnp.asarray(probs, jnp.float32)
    qv = jnp.asarray(query_valid, jnp.float32)  # [B, Lq]
    prompt_p = probs[..., :num_prompts].sum(-1)  # [B, H, Lq]
    mass = (prompt_p.mean(1) * qv).sum(-1)
    tokens = probs[..., num_prompts:] * jnp.asarray(key_valid, jnp.float32)[:, None, None, :]
    total = tokens.sum(-1, keepdims=True)
    p = tokens / jnp.maximum(total, 1e-30)
    entropy = -(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)).sum(-1)
    entropy_sum = (entropy.mean(1) * qv).sum(-1)
    return mass, entropy_sum, qv.sum(-1)


def _layer_probs(intermediates: Mapping[str, Any], side: str) -> list[jax.Array]:
    stack = intermediates.get(side, {})
    if "layers" in stack:  # a scanned stack (T5Config.scan_layers): sown [L, ...] at once
        sown = stack["layers"].get(_SIDES[side], {}).get("attention_weights")
        if sown is None:
            raise ValueError(f"no attention_weights sown for {side}/layers/{_SIDES[side]}")
        return list(sown[0])
    layers = sorted((k for k in stack if k.startswith("layers_")), key=lambda k: int(k[7:]))
    out = []
    for name in layers:
        sown = stack[name].get(_SIDES[side], {}).get("attention_weights")
        if sown is None:
            raise ValueError(f"no attention_weights sown for {side}/{name}/{_SIDES[side]}")
        out.append(sown[0])
    return out


def analyze_attention(
    model: Any,
    params: Any,
    batches: Iterable[Mapping[str, np.ndarray]],
    *,
    task: str,
    out_dir: str | pathlib.Path | None = None,
) -> dict[str, Any]:
    """Per-layer prompt mass and token entropy over `batches` (rows of task `task`).

    Returns `{"task", "num_examples", "prompt_lengths", "encoder": [...], "decoder": [...]}`
    with one `{"layer", "prompt_mass", "token_entropy"}` per layer; with `out_dir`, also
    writes `attention_<task>.json` and `attention_<task>.png` there.
    """
    lengths = prompt_lengths(model)
    n_prompt_queries = lengths["encoder"] if _is_prompt_tuning(model) else 0

    @jax.jit
    def stats(params, batch):
        _, state = model.logits(params, batch, None, False, mutable=["intermediates"])
        inter = state["intermediates"]
        enc_valid = batch["encoder_input_tokens"] > 0
        dec_valid = batch["decoder_loss_weights"] > 0
        result = {}
        for side in _SIDES:
            rows = []
            for probs in _layer_probs(inter, side):
                if side == "encoder":
                    keys = enc_valid
                    if n_prompt_queries:  # prompt-tuning prompts are queries too: skip them
                        probs = probs[:, :, n_prompt_queries:]
                    queries = enc_valid
                else:
                    keys = queries = dec_valid
                rows.append(jnp.stack(
                    [x.sum() for x in attention_statistics(probs, lengths[side], queries, keys)]
                ))
            result[side] = jnp.stack(rows)  # [layers, 3]
        return result

    totals: dict[str, np.ndarray] = {}
    num_examples = 0
    for batch in batches:
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        out = stats(params, batch)
        # Padding rows (no encoder token) add nothing to the sums and are not counted.
        num_examples += int(np.asarray((batch["encoder_input_tokens"] > 0).any(axis=1)).sum())
        for side, v in out.items():
            totals[side] = totals.get(side, 0) + np.asarray(v, np.float64)
    if num_examples == 0:
        raise ValueError(f"analyze_attention: no examples for task {task!r}")
    report: dict[str, Any] = {
        "task": task,
        "num_examples": num_examples,
        "prompt_lengths": lengths,
    }
    for side, v in totals.items():
        report[side] = [
            {
                "layer": i,
                "prompt_mass": float(mass / num_examples),
                "token_entropy": float(ent / max(nq, 1.0)),
            }
            for i, (mass, ent, nq) in enumerate(v)
        ]
    if out_dir is not None:
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"attention_{task}.json").write_text(json.dumps(report, indent=2) + "\n")
        plot_attention(report, out / f"attention_{task}.png")
    return report


def _is_prompt_tuning(model: Any) -> bool:
    cfg = getattr(model.module, "conditioning_config", None)
    return cfg is not None and cfg.method == "prompt_tuning"


def plot_attention(report: Mapping[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """Two panels per side (prompt mass, token entropy by layer) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = [s for s in _SIDES if s in report]
    fig, axes = plt.subplots(2, len(sides), figsize=(4.5 * len(sides), 6), squeeze=False)
    for j, side in enumerate(sides):
        layers = [r["layer"] for r in report[side]]
        for i, (key, label) in enumerate(
            (("prompt_mass", "attention mass on prompts"), ("token_entropy", "entropy (nats)"))
        ):
            ax = axes[i][j]
            ax.plot(layers, [r[key] for r in report[side]], marker="o")
            ax.set_xlabel(f"{side} layer")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0][j].set_title(f"{report['task']}: {side} (l={report['prompt_lengths'][side]})")
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def analyze_checkpoint(
    model: Any,
    checkpoint: str | pathlib.Path,
    batches: Iterable[Mapping[str, np.ndarray]],
    *,
    task: str,
    out_dir: str | pathlib.Path,
    step: int | None = None,
) -> dict[str, Any]:
    """`analyze_attention` on the parameters of a run's checkpoint (a run dir, its
    `checkpoints/` dir or a step dir); every parameter must be in the checkpoint."""
    from ktx.training import initial_params

    batches = list(batches)
    if not batches:
        raise ValueError(f"analyze_checkpoint: no batches for task {task!r}")
    example = {k: jnp.asarray(v) for k, v in batches[0].items()}
    init = lambda r: model.init_variables(r, example)["params"]  # noqa: E731
    import flax.linen as nn

    abstract = nn.meta.unbox(jax.eval_shape(init, jax.random.key(0)))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    params, report = initial_params.load_initial_params(checkpoint, abstract, zeros, step)
    if report.initialized:
        raise ValueError(
            f"checkpoint {checkpoint}: parameters missing for this model (wrong gin files?): "
            f"{list(report.initialized)[:5]}{' ...' if len(report.initialized) > 5 else ''}"
        )
    return analyze_attention(model, params, batches, task=task, out_dir=out_dir)


def task_batches(
    train_input: Any, task: str, *, split: str = "validation", max_examples: int = 100,
    batch_size: int | None = None,
) -> list[dict[str, np.ndarray]]:
    """Up to `max_examples` real rows of `task`'s `split` (He et al., 2022 average over
    100 validation examples) from a `ktx.data.pipeline.MultiTaskInput`, in batches."""
    if task not in tuple(train_input.task_names):
        raise ValueError(f"task={task!r} is not in the mixture; accepted: {list(train_input.task_names)}")
    if not isinstance(max_examples, int) or max_examples < 1:
        raise ValueError(f"max_examples={max_examples!r}; accepted: an int >= 1")
    out, seen = [], 0
    for batch, num_real in train_input.eval_batches(task, split, batch_size):
        take = min(num_real, max_examples - seen)
        out.append({k: v[:take] for k, v in batch.items()})
        seen += take
        if seen >= max_examples:
            break
    return out
