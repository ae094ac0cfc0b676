"""XLA's cost analysis of the compiled T5.1.1 train step: FLOPs and bytes accessed per step.

    .venv/bin/python tests/benchmarks/t5_step_cost.py [--shapes tiny,small] [--no_parts]
    PYTHONPATH=<libtpu> .venv/bin/python tests/benchmarks/t5_step_cost.py --topology=v4:2x2x1 [--t5x]

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

`--topology` compiles the two whole steps ahead of time for a TPU topology instead (libtpu
on the path, as for `ktx precompile`): the batch split over the topology's devices on
`data`, as `ktx precompile` lowers a step; the figures are per device. `--t5x` (T5X's
source and its stubs on the `PYTHONPATH`, as for `../shared/peers/t5x_side_by_side.py`)
adds T5X's step on the same devices: its `train_with_lr` partitioned as T5X's trainer
partitions it, its train state's shapes, tokens gathered (`--lookup` there).

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


def topology_step_cost(shape: str, topology: str, with_t5x: bool = False) -> dict:
    """Cost analysis per device of the step compiled ahead of time for `topology`."""
    from ktx.training import precompile

    devices = precompile.topology_devices(topology)
    mesh = partitioning.create_mesh(1, devices=devices)
    model = seq2seq.EncoderDecoderModel(
        t5.T5Config(vocab_size=VOCAB, dropout_rate=0.0, **SHAPES[shape]), num_tasks=1)
    spec = model.input_spec(BATCH, {"inputs": INPUT_LENGTH, "targets": TARGET_LENGTH})
    rows, rng = precompile.abstract_inputs(mesh, spec)
    out = {"devices": len(devices)}
    for name, norms in (("step", False), ("step_norm_metrics", True)):
        trainer = Trainer(model, optimizers.adafactor(learning_rate=1e-3), mesh=mesh,
                          norm_metrics=norms)
        state = trainer.create_abstract_state(spec)[0]
        out[name] = _cost(trainer.lower_train_step(state, rows, rng).compile())
    if with_t5x:
        out["t5x_step"] = _cost(t5x_step(shape, devices))
    return out


def t5x_step(shape: str, devices: list) -> object:
    """T5X's T5.1.1 train step (`train_with_lr`, partitioned as its `Trainer` does: state
    by its logical axes, batch over `data`) compiled for `devices`, Adafactor with its
    defaults, z-loss 1e-4, tokens gathered rather than embedded by a one-hot matmul."""
    import jax.numpy as jnp
    import seqio
    from jax.sharding import Mesh
    from t5x import adafactor, models, utils
    from t5x import partitioning as t5x_partitioning
    from t5x import trainer as t5x_trainer
    from t5x.examples.t5 import layers as t5x_layers
    from t5x.examples.t5 import network

    class LookupEmbed(t5x_layers.Embed):
        def __post_init__(self):
            object.__setattr__(self, "one_hot", False)
            super().__post_init__()

    network.layers.Embed = LookupEmbed
    module = network.Transformer(config=network.T5Config(
        vocab_size=VOCAB, dtype="float32", mlp_activations=("gelu", "linear"),
        dropout_rate=0.0, logits_via_embedding=False, **SHAPES[shape]))
    vocab = seqio.PassThroughVocabulary(size=VOCAB)
    model = models.EncoderDecoderModel(
        module=module, input_vocabulary=vocab, output_vocabulary=vocab, z_loss=1e-4,
        optimizer_def=adafactor.Adafactor(
            decay_rate=0.8, step_offset=0,
            logical_factor_rules=adafactor.standard_logical_factor_rules()))
    partitioner = t5x_partitioning.PjitPartitioner(
        num_partitions=1, logical_axis_rules=t5x_partitioning.standard_logical_axis_rules())
    partitioner.__dict__["mesh"] = Mesh(np.array(devices).reshape(-1, 1), ("data", "model"))
    shapes = {"encoder_input_tokens": (BATCH, INPUT_LENGTH),
              "decoder_input_tokens": (BATCH, TARGET_LENGTH),
              "decoder_target_tokens": (BATCH, TARGET_LENGTH),
              "decoder_loss_weights": (BATCH, TARGET_LENGTH)}
    initializer = utils.TrainStateInitializer(
        optimizer_def=model.optimizer_def, init_fn=model.get_initial_variables,
        input_shapes=shapes, input_types={k: jnp.int32 for k in shapes},
        partitioner=partitioner)
    rate = utils.create_learning_rate_scheduler(factors="constant", base_learning_rate=1e-3)

    def step(train_state, rows):
        return t5x_trainer.train_with_lr(
            train_state, rows, learning_rate=rate(train_state.step),
            dropout_rng=jax.random.fold_in(jax.random.PRNGKey(1), train_state.step),
            model=model, num_microbatches=None,
            data_partition_spec=partitioner.data_partition_spec)

    partitioned = partitioner.partition(
        step, in_axis_resources=(initializer.train_state_axes, partitioner.data_partition_spec),
        out_axis_resources=(initializer.train_state_axes, None), donate_argnums=(0,))
    rows = {k: jax.ShapeDtypeStruct(v, jnp.int32) for k, v in shapes.items()}
    return partitioned.lower(initializer.global_train_state_shape, rows).compile()


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
    parser.add_argument("--topology", default=None,
                        help="a TPU topology (e.g. v4:2x2x1): the whole steps compiled ahead "
                             "of time for it, per device (needs libtpu)")
    parser.add_argument("--t5x", action="store_true",
                        help="with --topology: T5X's step too (T5X's source on PYTHONPATH)")
    args = parser.parse_args()
    if args.t5x and not args.topology:
        parser.error("--t5x needs --topology; on this machine's CPU use "
                     "../shared/peers/t5x_side_by_side.py")
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; accepted: {sorted(SHAPES)}")
    result = {"jax": jax.__version__, "batch": f"{BATCH}x{INPUT_LENGTH}/{TARGET_LENGTH}"}
    if args.topology:
        result["topology"] = args.topology
    for shape in shapes:
        if not args.topology:
            result[shape] = step_cost(shape, parts=not args.no_parts)
            continue
        try:
            result[shape] = topology_step_cost(shape, args.topology, args.t5x)
        except (RuntimeError, ValueError) as e:  # no libtpu, or an unknown topology
            parser.error(f"--topology={args.topology}: {e}")
        except ImportError as e:
            parser.error(f"--t5x: {e}; put T5X's source and its stubs on PYTHONPATH "
                         "(../shared/peers/README.md)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
