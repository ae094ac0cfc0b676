"""Cost of per-task gradients and every balancer relative to the plain step.

For T=4 tasks, on the multi-task recommendation model (`ktx.models.recsys`, Tmall-sized
tables, sparse table gradients) and on a T5.1.1-tiny encoder-decoder
(`ktx.models.seq2seq`); with `--models bert`, also on a small multi-task BERT
(`ktx.models.encoder`, `BERT_SMALL`, BERT's vocabulary, 64 tokens):

* `trainer_path`: the compiled step `ktx train` runs (`ktx.training.trainer.Trainer.train_step`,
  with the model's default `sparse_tables`: T5's token embedding, the recommendation tables,
  BERT's word table;
  Adam after the balancer, but a bare learning rate after MTAdam, which is itself the
  optimizer, as its gin files chain it; diagnostics at the default log period of 100 steps;
  the loss-weighting balancers take the step's loss-weighted shortcut, `ktx train`'s
  default, `StepOptions.weights_from_losses`), plain and with every
  balancer in `ktx.optim.BALANCERS`, each warmed up through the first diagnostics step
  (whose compile a timed block would take in), timed interleaved: each repeat times `--steps`
  steps of every configuration (more where the plain step needs them to fill
  `--repeat_seconds`, default 1 s: the recommendation step takes ~7 ms on a CPU, so a
  block of 5 steps is a few hiccups long; `trainer_path_ms.<model>.steps_per_repeat`),
  in an order rotated from repeat to repeat; the ratio is
  median balanced step time / median plain step time (min and median per config also
  reported; with `--ops`, `trainer_path_ms.<model>.ops`: each compiled step's instruction,
  fusion, sort and while-loop counts, what a launch-bound GPU step pays for;
  `trainer_path_ms.<model>.min_ratio`: min balanced / min plain, the figure
  least moved by other processes on a shared machine; `cpu_ratio`: the same median ratio of
  this process's CPU time per step, which waiting for a core does not inflate;
  `paired_ratio`: the median over repeats of balanced / plain within one repeat, which a
  drift of the machine's speed over the run does not move; `page_faults_per_step`: minor
  page faults per step, median over repeats, which the allocator's history moves and
  `ktx train`'s host malloc setting removes, applied here as there: `host_malloc` in the
  JSON, `KTX_HOST_MALLOC=system` for glibc's defaults; `block_ms`: every block's step
  time in the order run; `steal_share`: the share of the machine's CPU time the hypervisor
  took during a config's blocks (Linux guests); with
  `--cost`, `bytes_ratio`: XLA's estimate of the bytes the compiled step accesses,
  balanced / plain, which no load moves). Goals: MetaBalance and the
  loss-weighting balancers <= 1.05x, PCGrad, MGDA and MTAdam <= 1.10x.
* `engine`: the bare engine (`compute_task_gradients` blocks / vjp + MetaBalance) against
  `jax.value_and_grad(model.loss_fn)`, with XLA's temporary memory of each.

Last line: one JSON object.

    .venv/bin/python tests/benchmarks/per_task_grads.py [--steps 5 --repeats 7]
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ktx.optim as ko
from ktx.training import host_malloc, precompile

T = 4
DIAGNOSTICS_PERIOD = 100  # ktx train's default log period


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

    tx = optax.chain(ko.metabalance(relax_factor=0.7, num_tasks=T), adam)
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


def _balancer(name):
    import inspect

    factory = ko.BALANCERS[name]
    kwargs = {}
    params = inspect.signature(factory).parameters
    if "num_tasks" in params:
        kwargs["num_tasks"] = T
    if name == "fixed_weights":
        kwargs["weights"] = [1.0] + [0.5] * (T - 1)
    return factory(**kwargs)


def _optimizer(name):
    """Adam after every balancer but MTAdam, which is itself the optimizer: its gin files
    (gin/optim/mtadam.gin, the recsys study's) chain it with a bare learning rate."""
    return optax.scale_by_learning_rate(1e-3) if name == "mtadam" else optax.adam(1e-3)


def trainer(model, balancer, sparse=None, mesh=None, shared=None, grad_method="auto"):
    """The `Trainer` whose step the trainer path times, plain (`balancer=None`) or with a
    balancer of `ko.BALANCERS` by name (`gpu_launches.py` compiles the same step);
    `shared` replaces the model's shared-parameter patterns (`ktx.optim.selection`);
    `grad_method`: `StepOptions.grad_method`."""
    from ktx.training.trainer import Trainer

    return Trainer(model, _optimizer(balancer), mesh=mesh, grad_method=grad_method,
                   balancer=None if balancer is None else _balancer(balancer),
                   shared=shared if shared is not None
                   else getattr(model, "shared_param_patterns", None),
                   sparse_tables=sparse if balancer is not None else None,
                   diagnostics_period=DIAGNOSTICS_PERIOD)


def parse_shared_variants(text: str) -> dict[str, list[str]]:
    """`NAME=REGEX;NAME=REGEX` -> {NAME: [REGEX]}: MetaBalance configurations that balance
    only the parameters whose names match REGEX (`re.search`; the others' task gradients
    are summed), to see which parameters a balanced step's extra time goes to."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(";"))):
        name, sep, regex = item.partition("=")
        if not sep or not name or not regex:
            raise ValueError(f"--shared_variants item {item!r}; accepted: NAME=REGEX")
        if name in ko.BALANCERS or name == "plain" or name in out:
            raise ValueError(f"--shared_variants name {name!r} is taken (a balancer, 'plain' "
                             "or an earlier variant)")
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"--shared_variants item {item!r}: not a regular expression "
                             f"({e})") from None
        out[name] = [regex]
    return out


def _bytes_accessed(tr, state, host_batch, counts):
    """XLA's estimate of the bytes the compiled step reads and writes (load-independent;
    an in-place scatter counts its whole operand), for the step the timed loop runs: the
    one without diagnostics (the Trainer picks it on the host on every other step)."""
    compiled = tr.lower_train_step(state, tr.global_batch(host_batch, counts),
                                   jax.random.key(1), task_counts=counts,
                                   log_diagnostics=False).compile()
    analysis = precompile.cost_analysis(compiled)
    return float(analysis["bytes accessed"])


def _op_counts(tr, state, host_batch, counts):
    """Instructions of the compiled step's entry computation (the timed step, without
    diagnostics): all, fusions, and the sorts and while loops of the whole module, the
    counts that bound a launch-bound step (a GPU runs about one kernel per fusion)."""
    import collections
    import re

    text = tr.lower_train_step(state, tr.global_batch(host_batch, counts), jax.random.key(1),
                               task_counts=counts, log_diagnostics=False).compile().as_text()
    entry = collections.Counter(re.findall(r"= \S+ ([\w-]+)\(", text[text.index("ENTRY"):]))
    return {"entry_instructions": sum(entry.values()), "fusions": entry["fusion"],
            "sorts": text.count(" sort("), "while_loops": text.count(" while(")}


def _steal_and_total():
    """(steal, total) CPU ticks of the whole machine from /proc/stat; None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def trainer_path(model, batch, counts, steps, repeats, sparse=None, balancers=None, cost=False,
                 ops=False, repeat_seconds=0.0, shared_variants=None, blocks=False):
    """Interleaved timing of `Trainer.train_step`, plain and with every balancer (and every
    MetaBalance configuration of `shared_variants`, `parse_shared_variants`; with
    `blocks`, every balancer again with `grad_method="blocks"`, as `NAME@blocks`): each
    timed block is `steps` steps, or more if the plain step needs more to fill
    `repeat_seconds` (a block of a few milliseconds is at the mercy of one scheduling
    hiccup; a longer one also takes the diagnostics steps in at their period)."""
    host_batch = jax.device_get(batch)
    shared_variants = dict(shared_variants or {})
    balancers = list(balancers or ko.BALANCERS)
    # name -> (balancer, shared-parameter patterns: None for the model's own, grad_method)
    configs = {"plain": (None, None, "auto"),
               **{name: (name, None, "auto") for name in balancers},
               **{name: ("metabalance", shared, "auto") for name, shared in shared_variants.items()},
               **{f"{name}@blocks": (name, None, "blocks") for name in (balancers if blocks else ())}}
    names = [name for name in configs if name != "plain"]
    runs, nbytes, op_counts = {}, {}, {}
    for name, (balancer, shared, method) in configs.items():
        tr = trainer(model, balancer, sparse, shared=shared, grad_method=method)
        state = tr.init_state(jax.random.key(0), host_batch)
        # Warm-up through the first diagnostics step: a balanced Trainer compiles its step
        # with diagnostics there (once per run, as `ktx train` does), which a timed block
        # would otherwise take in: one block of every balanced config 6-10x its others,
        # and its median one rank up among the rest.
        for _ in range(DIAGNOSTICS_PERIOD):
            state, m = tr.train_step(state, host_batch, jax.random.key(1), task_counts=counts)
        jax.block_until_ready(m["loss"])
        runs[name] = [tr, state]
        if cost:
            nbytes[name] = _bytes_accessed(tr, state, host_batch, counts)
        if ops:
            op_counts[name] = _op_counts(tr, state, host_batch, counts)
    if repeat_seconds > 0:
        tr, state = runs["plain"]
        t0 = time.perf_counter()
        for _ in range(3):
            state, m = tr.train_step(state, host_batch, jax.random.key(1), task_counts=counts)
        jax.block_until_ready(m["loss"])
        runs["plain"][1] = state
        steps = max(steps, int(np.ceil(repeat_seconds / ((time.perf_counter() - t0) / 3))))
    times = {name: [] for name in configs}
    cpu = {name: [] for name in configs}
    faults = {name: [] for name in configs}
    stolen = {name: [] for name in configs}
    order = list(configs)
    for r in range(repeats):
        rotated = order[r % len(order):] + order[: r % len(order)]
        for name in rotated:
            tr, state = runs[name]
            f0, s0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, _steal_and_total()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                state, m = tr.train_step(state, host_batch, jax.random.key(1), task_counts=counts)
            jax.block_until_ready(m["loss"])
            times[name].append((time.perf_counter() - t0) / steps)
            cpu[name].append((time.process_time() - c0) / steps)
            faults[name].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps)
            s1 = _steal_and_total()
            if s0 and s1 and s1[1] > s0[1]:
                stolen[name].append((s1[0] - s0[0]) / (s1[1] - s0[1]))
            runs[name][1] = state
    base = statistics.median(times["plain"])
    out = {"plain_ms": {"median": round(base * 1e3, 3), "min": round(min(times["plain"]) * 1e3, 3)},
           "steps_per_repeat": steps}
    ratios, min_ratios = {}, {}
    for name in names:
        med = statistics.median(times[name])
        ratios[name] = round(med / base, 3)
        min_ratios[name] = round(min(times[name]) / min(times["plain"]), 3)
        out[f"{name}_ms"] = {"median": round(med * 1e3, 3), "min": round(min(times[name]) * 1e3, 3)}
    out["min_ratio"] = min_ratios
    # Each repeat's balanced block against the same repeat's plain block, then the median:
    # a drift of the machine's speed over the run (load, clocks) cancels within a repeat.
    out["paired_ratio"] = {
        name: round(statistics.median(b / p for b, p in zip(times[name], times["plain"])), 3)
        for name in names}
    base_cpu = statistics.median(cpu["plain"])
    out["cpu_ratio"] = {name: round(statistics.median(cpu[name]) / base_cpu, 3) for name in names}
    out["plain_cpu_ms"] = round(base_cpu * 1e3, 3)
    # Minor page faults per step (median over repeats): memory the allocator mapped afresh
    # (ktx.training.host_malloc), which costs system time on every step it happens.
    out["page_faults_per_step"] = {name: round(statistics.median(faults[name]))
                                   for name in configs}
    # Each block's step time, in the order the repeats ran them, and the share of the
    # machine's CPU time the hypervisor took from it (steal, /proc/stat; Linux guests),
    # mean over blocks: what moves a median between runs that no step change explains.
    out["block_ms"] = {name: [round(t * 1e3, 3) for t in times[name]] for name in configs}
    if all(stolen.values()):
        out["steal_share"] = {name: round(statistics.mean(stolen[name]), 4) for name in configs}
    if cost:
        out["plain_mb_accessed"] = round(nbytes["plain"] / 1e6, 1)
        out["bytes_ratio"] = {name: round(nbytes[name] / nbytes["plain"], 3) for name in names}
    if ops:
        out["ops"] = op_counts
    return ratios, out


def _recsys_setup(per_task, dropout_rate=0.5):
    from ktx.models.recsys import RecsysModel

    num_users, num_items = 41738, 11953  # Tmall sizes
    model = RecsysModel(num_users=num_users, num_items=num_items, num_tasks=T,
                        dropout_rate=dropout_rate)
    r = np.random.default_rng(0)
    n = T * per_task
    batch = {
        "user": r.integers(0, num_users, n).astype(np.int32),
        "item": r.integers(0, num_items, n).astype(np.int32),
        "label": r.integers(0, 2, n).astype(np.float32),
        "task_id": np.repeat(np.arange(T), per_task).astype(np.int32),
    }
    return model, batch, [r"^user_embedding/embedding$", r"^item_embedding/embedding$"]


# T5.1.1 layout at tiny width
T5_TINY = {"emb_dim": 32, "num_heads": 2, "num_encoder_layers": 2, "num_decoder_layers": 2,
           "head_dim": 16, "mlp_dim": 64}


def _t5_setup(per_task, dropout_rate=0.1, shapes=None, lengths=(32, 8)):
    """T5.1.1 of `shapes` (`T5Config` fields; default `T5_TINY`) on random tokens."""
    from ktx.models import t5
    from ktx.models.seq2seq import EncoderDecoderModel

    config = t5.T5Config(vocab_size=32128, dropout_rate=dropout_rate,
                         **(T5_TINY if shapes is None else shapes))
    model = EncoderDecoderModel(config, num_tasks=T)
    r = np.random.default_rng(0)
    n, (le, ld) = T * per_task, lengths
    batch = {
        "encoder_input_tokens": r.integers(2, 1000, (n, le)).astype(np.int32),
        "decoder_input_tokens": r.integers(2, 1000, (n, ld)).astype(np.int32),
        "decoder_target_tokens": r.integers(2, 1000, (n, ld)).astype(np.int32),
        "decoder_loss_weights": np.ones((n, ld), np.float32),
        "task_id": np.repeat(np.arange(T), per_task).astype(np.int32),
    }
    return model, batch, None


# BERT's layout at a CPU-sized width (tests/benchmarks/encoder_step.py --small), BERT's
# vocabulary: its word table (7.8M of the 11M parameters) comes as sparse rows.
BERT_SMALL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 1024}


def _bert_setup(per_task, dropout_rate=0.1, length=64):
    """Multi-task BERT (`EncoderClassifierModel`, one head per task) on random tokens,
    every other row half padding."""
    from ktx.models import bert, encoder

    config = bert.BertConfig(dropout_rate=dropout_rate, attention_dropout_rate=dropout_rate,
                             **BERT_SMALL)
    model = encoder.EncoderClassifierModel(config, num_labels=(3, 2, 1, 2))  # T = 4 heads
    r = np.random.default_rng(0)
    n = T * per_task
    ids = r.integers(1, config.vocab_size, (n, length)).astype(np.int32)
    ids[1::2, length // 2:] = 0
    task = np.repeat(np.arange(T), per_task).astype(np.int32)
    batch = {
        "input_ids": ids,
        "token_type_ids": np.zeros_like(ids),
        "attention_mask": (ids > 0).astype(np.int32),
        "label": np.where(task == 2, r.random(n), task % 2).astype(np.float32),
        "task_id": task,
    }
    return model, batch, list(model.sparse_table_patterns)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="steps per timed block (at least)")
    p.add_argument("--repeat_seconds", type=float, default=1.0,
                   help="more steps per timed block where the plain step needs them to fill "
                        "this many seconds (0: exactly --steps)")
    p.add_argument("--repeats", type=int, default=7, help="interleaved repeats")
    p.add_argument("--recsys_rows_per_task", type=int, default=64)
    p.add_argument("--t5_rows_per_task", type=int, default=4)
    p.add_argument("--bert_rows_per_task", type=int, default=4)
    p.add_argument("--skip_engine", action="store_true", help="only the trainer path")
    p.add_argument("--models", default="t5_tiny,recsys",
                   help="comma-separated subset of t5_tiny, recsys, bert for the trainer path "
                        "(bert: BERT_SMALL, 64 tokens; its steps are ~10x T5-tiny's)")
    p.add_argument("--balancers", default="", help="comma-separated subset of ktx.optim.BALANCERS")
    p.add_argument("--cost", action="store_true",
                   help="also XLA's bytes accessed per step, balanced / plain (compiles twice)")
    p.add_argument("--ops", action="store_true",
                   help="also the compiled steps' instruction, fusion, sort and while-loop counts")
    p.add_argument("--shared_variants", default="",
                   help="NAME=REGEX;...: also time MetaBalance balancing only the parameters "
                        "matching REGEX (e.g. 'mb_logits=logits_dense'), under NAME")
    p.add_argument("--blocks", action="store_true",
                   help="also time every balancer with grad_method='blocks' (the task blocks, "
                        "not the taps), under NAME@blocks")
    args = p.parse_args(argv)
    try:
        shared_variants = parse_shared_variants(args.shared_variants)
    except ValueError as e:
        p.error(str(e))
    # As `ktx train` on a CPU: freed host memory is kept for the next step
    # ($KTX_HOST_MALLOC, ktx.training.host_malloc).
    malloc = host_malloc.configure_on_cpu()
    trainer_ratios, trainer_times = {}, {}
    models = [m for m in args.models.split(",") if m]
    if not models or set(models) - {"t5_tiny", "recsys", "bert"}:
        p.error(f"--models={args.models!r}; accepted: t5_tiny, recsys, bert (comma-separated)")
    for key, setup, per_task in (("t5_tiny", _t5_setup, args.t5_rows_per_task),
                                 ("recsys", _recsys_setup, args.recsys_rows_per_task),
                                 ("bert", _bert_setup, args.bert_rows_per_task)):
        if key not in models:
            continue
        model, batch, sparse = setup(per_task)
        counts = (per_task,) * T
        trainer_ratios[key], trainer_times[key] = trainer_path(
            model, batch, counts, args.steps, args.repeats, sparse,
            [b for b in args.balancers.split(",") if b] or None, args.cost, args.ops,
            args.repeat_seconds, shared_variants, args.blocks)
        print(json.dumps({"trainer_path": {key: trainer_ratios[key]}}), flush=True)
    result = {
        "benchmark": "per_task_grads",
        "num_tasks": T,
        "device": jax.devices()[0].platform,
        "host_malloc": malloc,
        "trainer_path": trainer_ratios,
        "trainer_path_ms": trainer_times,
        "goals": {"metabalance_and_loss_weighting": 1.05, "pcgrad_mgda_mtadam": 1.10},
    }
    if not args.skip_engine:
        result["engine"] = {
            "recsys": recsys_case(args.steps * args.repeats, args.recsys_rows_per_task),
            "t5_1_1_tiny": t5_case(args.steps * args.repeats, args.t5_rows_per_task),
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
