"""XLA's cost analysis of the compiled T5.1.1 train step: FLOPs and bytes accessed per step.

    .venv/bin/python tests/benchmarks/t5_step_cost.py [--shapes tiny,small] [--no_parts]

The step is `Trainer.train_step` as `ktx train` compiles it (Adafactor with T5X's defaults,
float32, dropout 0, one CPU device), on the batch `../shared/peers/t5x_side_by_side.py`
times against T5X: 8 rows x 128 input / 32 target tokens, vocabulary 32128, random tokens.
Besides the whole step (`step`: the default, reporting what T5X's step reports;
`step_norm_metrics`: `norm_metrics=True`, with the gradient, update and parameter norms)
it compiles its two parts on their
own: `grad` (the loss and its gradient) and `update` (Adafactor's update and
`apply_updates`). Nothing runs: the numbers are deterministic for a given jax / XLA
version, so a change that moves more bytes shows up here on any machine (docs/performance.md
has the reference values and T5X's).

Prints one JSON line: `{"jax": ..., "<shape>": {"<part>": {"gflops": ..., "gbytes": ...}}}`.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np
import optax

from ktx import partitioning
from ktx.models import seq2seq, t5
from ktx.models.base import with_row_ids
from ktx.training import optimizers
from ktx.training.trainer import Trainer

# T5.1.1-Small (Raffel et al., 2020; T5X's gin files) and the side-by-side script's tiny.
SHAPES = {
    "tiny": dict(emb_dim=64, num_heads=4, head_dim=16, mlp_dim=128,
                 num_encoder_layers=2, num_decoder_layers=2),
    "small": dict(emb_dim=512, num_heads=6, head_dim=64, mlp_dim=1024,
                  num_encoder_layers=8, num_decoder_layers=8),
}
VOCAB, BATCH, INPUT_LENGTH, TARGET_LENGTH = 32128, 8, 128, 32


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"gflops": round(float(cost.get("flops", 0.0)) / 1e9, 3),
            "gbytes": round(float(cost.get("bytes accessed", 0.0)) / 1e9, 3)}


def batch() -> dict:
    rs = np.random.RandomState(0)
    targets = rs.randint(2, VOCAB, size=(BATCH, TARGET_LENGTH)).astype(np.int32)
    return {
        "encoder_input_tokens": rs.randint(2, VOCAB, size=(BATCH, INPUT_LENGTH)).astype(np.int32),
        "decoder_input_tokens": np.concatenate(
            [np.zeros((BATCH, 1), np.int32), targets[:, :-1]], 1),
        "decoder_target_tokens": targets,
        "decoder_loss_weights": np.ones((BATCH, TARGET_LENGTH), np.float32),
        "task_id": np.zeros((BATCH,), np.int32),
    }


def step_cost(shape: str, parts: bool = True) -> dict:
    """Cost analysis of the compiled step (and its parts) at `shape`."""
    model = seq2seq.EncoderDecoderModel(
        t5.T5Config(vocab_size=VOCAB, dropout_rate=0.0, **SHAPES[shape]), num_tasks=1)
    rows, rng = batch(), jax.random.key(0)
    out = {}
    for name, norms in (("step", False), ("step_norm_metrics", True)):
        trainer = Trainer(model, optimizers.adafactor(learning_rate=1e-3),
                          mesh=partitioning.create_mesh(1), norm_metrics=norms)
        state = trainer.create_abstract_state(rows)[0]
        global_batch = trainer.global_batch(rows)
        out[name] = _cost(trainer.lower_train_step(state, global_batch, rng).compile())
    if not parts:
        return out

    def grad(params, b, r):
        b = with_row_ids(b)
        normalizer = model.normalizer(b)

        def loss(p):
            return model.task_losses(p, b, r, True, normalizer=normalizer)[0].sum()

        return jax.value_and_grad(loss)(params)

    optimizer = trainer.optimizer

    def update(grads, params, opt_state):  # donated in the order they are returned
        _, updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with trainer._context():
        out["grad"] = _cost(jax.jit(grad).lower(state.params, global_batch, rng).compile())
        out["update"] = _cost(jax.jit(update, donate_argnums=(1, 2)).lower(
            state.params, state.params, state.opt_state).compile())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny,small",
                        help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--no_parts", action="store_true",
                        help="the whole step only (not the gradient and update on their own)")
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; accepted: {sorted(SHAPES)}")
    result = {"jax": jax.__version__, "batch": f"{BATCH}x{INPUT_LENGTH}/{TARGET_LENGTH}"}
    for shape in shapes:
        result[shape] = step_cost(shape, parts=not args.no_parts)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
