"""Cost of per-task gradients + MetaBalance relative to the plain summed-loss step.

For T=4 tasks, on the multi-task recommendation model (`ktx.models.recsys`) and on a
T5.1.1-tiny encoder-decoder (`ktx.models.seq2seq`), times one jitted train step
(Adam after the balancer) for: the plain step (`jax.value_and_grad(model.loss_fn)`),
`compute_task_gradients(method="blocks")` + MetaBalance and
`compute_task_gradients(method="vjp")` + MetaBalance; and reads each compiled step's
temporary memory from XLA's memory analysis. Target for blocks: <= 1.3x plain.
A model whose module is missing is reported as skipped. Last line: one JSON object.

    .venv/bin/python tests/benchmarks/per_task_grads.py [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ktx.optim as ko

T = 4


def _timed(fn, args, steps):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _temp_bytes(jitted, args):
    try:
        analysis = jitted.lower(*args).compile().memory_analysis()
        return int(analysis.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - memory analysis is optional per backend
        return None


def measure(model, batch, counts, steps, sparse=None):
    rng = jax.random.key(0)
    params = model.init_variables(rng, batch)["params"]
    shared = getattr(model, "shared_param_patterns", None)
    adam = optax.adam(1e-3)

    @jax.jit
    def plain(params, opt_state, batch):
        (loss, _), grads = jax.value_and_grad(
            lambda p: model.loss_fn(p, batch, rng, True), has_aux=True)(params)
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    tx = optax.chain(ko.metabalance(relax_factor=0.7), adam)
    with ko.num_tasks_scope(T):
        mb_state = tx.init(params)

    def balanced(method):
        @jax.jit
        def step(params, opt_state, batch):
            losses, _, tg = ko.compute_task_gradients(
                lambda p, b: model.loss_sums(p, b, rng, True), model.normalizer(batch),
                params, batch, num_tasks=T,
                task_counts=counts if method == "blocks" else None,
                method=method, shared=shared, sparse_tables=sparse)
            updates, opt_state = tx.update(tg, opt_state, params, task_losses=losses)
            return optax.apply_updates(params, updates), opt_state, losses.sum()

        return step

    out = {}
    args = (params, adam.init(params), batch)
    base = _timed(plain, args, steps)
    out["plain_ms"] = round(base * 1e3, 3)
    out["plain_temp_mib"] = _mib(_temp_bytes(plain, args))
    for method in ("blocks", "vjp"):
        fn = balanced(method)
        margs = (params, mb_state, batch)
        t = _timed(fn, margs, steps)
        out[f"{method}_ms"] = round(t * 1e3, 3)
        out[f"{method}_ratio"] = round(t / base, 3)
        out[f"{method}_temp_mib"] = _mib(_temp_bytes(fn, margs))
    return out


def _mib(b):
    return None if b is None else round(b / 2**20, 3)


def recsys_case(steps, per_task):
    try:
        from ktx.models.recsys import RecsysModel
    except ImportError as e:
        return {"skipped": f"ktx.models.recsys unavailable: {e}"}
    num_users, num_items = 41738, 11953  # Tmall sizes
    model = RecsysModel(num_users=num_users, num_items=num_items, num_tasks=T,
                        dropout_rate=0.0)
    r = np.random.default_rng(0)
    n = T * per_task
    batch = {
        "user": jnp.asarray(r.integers(0, num_users, n), jnp.int32),
        "item": jnp.asarray(r.integers(0, num_items, n), jnp.int32),
        "label": jnp.asarray(r.integers(0, 2, n), jnp.float32),
        "task_id": jnp.asarray(np.repeat(np.arange(T), per_task), jnp.int32),
    }
    res = measure(model, batch, (per_task,) * T, steps,
                  sparse=[r"^user_embedding/embedding$", r"^item_embedding/embedding$"])
    res["rows"] = n
    res["sparse_tables"] = True
    return res


def t5_case(steps, per_task):
    try:
        from ktx.models import t5
        from ktx.models.seq2seq import EncoderDecoderModel
    except ImportError as e:
        return {"skipped": f"ktx.models.t5/seq2seq unavailable: {e}"}
    config = getattr(t5, "t5_1_1_tiny", None)
    config = config() if callable(config) else config
    if config is None:  # T5.1.1 layout at tiny width (no named tiny config in t5.py yet)
        config = t5.T5Config(vocab_size=32128, emb_dim=32, num_heads=2, num_encoder_layers=2,
                             num_decoder_layers=2, head_dim=16, mlp_dim=64, dropout_rate=0.0)
    model = EncoderDecoderModel(config, num_tasks=T)
    r = np.random.default_rng(0)
    n, le, ld = T * per_task, 32, 8
    batch = {
        "encoder_input_tokens": jnp.asarray(r.integers(2, 1000, (n, le)), jnp.int32),
        "decoder_input_tokens": jnp.asarray(r.integers(2, 1000, (n, ld)), jnp.int32),
        "decoder_target_tokens": jnp.asarray(r.integers(2, 1000, (n, ld)), jnp.int32),
        "decoder_loss_weights": jnp.ones((n, ld), jnp.float32),
        "task_id": jnp.asarray(np.repeat(np.arange(T), per_task), jnp.int32),
    }
    res = measure(model, batch, (per_task,) * T, steps)
    res["rows"] = n
    res["config"] = {"emb_dim": config.emb_dim, "layers": config.num_encoder_layers,
                     "vocab": config.vocab_size}
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--recsys_rows_per_task", type=int, default=64)
    p.add_argument("--t5_rows_per_task", type=int, default=4)
    args = p.parse_args(argv)
    result = {
        "benchmark": "per_task_grads",
        "num_tasks": T,
        "device": jax.devices()[0].platform,
        "recsys": recsys_case(args.steps, args.recsys_rows_per_task),
        "t5_1_1_tiny": t5_case(args.steps, args.t5_rows_per_task),
        "target_blocks_ratio": 1.3,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
