"""Per-task gradients device by device (`method="devices"`, `ktx.optim.device_slots`).

On the 8 fake CPU devices (tests/conftest.py), with a `data` axis wider than some tasks'
rows: the per-task gradients equal one device's, they add up to the plain gradient under
dropout, and every balancer's update through the `Trainer` equals the single-device
update, with 1-D and 2-D parameter partitioning.
"""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ktx import optim, partitioning
from ktx.optim.device_slots import default_scatter_dim, device_slots
from ktx.training import trainer as trainer_lib
from tests.models.t5_batches import random_t5_batch
from tests.test_trainer import ToyModel

COUNTS = (1, 3, 4, 8)  # 16 rows: on 8 data devices, 2 rows each; task 0 has 1 row


def _batch(counts=COUNTS, dim=6, seed=0):
    rng = np.random.default_rng(seed)
    b = sum(counts)
    return {
        "x": rng.normal(size=(b, dim)).astype(np.float32),
        "label": rng.integers(0, 4, b).astype(np.int32),
        "task_id": np.repeat(np.arange(len(counts)), counts).astype(np.int32),
        "row_id": np.arange(b, dtype=np.int32),
    }


def test_device_slots_counts_the_tasks_of_the_busiest_device():
    # Rows 0..15 in 8 pairs: (t0 t1) (t1 t1) (t2 t2) (t2 t2) (t3 ...): two tasks at most.
    assert device_slots((1, 3, 4, 8), 8) == 2
    assert device_slots((16, 16, 16, 16), 8) == 1  # boundaries on devices
    assert device_slots((1, 1, 1, 1), 2) == 2
    assert device_slots((1, 1, 1, 1), 1) == 4
    assert device_slots((3, 0, 1), 4) == 1  # one row per device
    assert device_slots((3, 0, 1), 2) == 2  # (t0 t0) (t0 t2)
    with pytest.raises(ValueError, match="do not split"):
        device_slots((3, 2), 4)


def test_default_scatter_dim_is_the_largest_divisible_dimension():
    assert default_scatter_dim((6, 16), 8) == 1
    assert default_scatter_dim((16, 8), 8) == 0
    assert default_scatter_dim((16, 8), 8, avoid=(0,)) == 1
    assert default_scatter_dim((6,), 8) is None
    assert default_scatter_dim((4,), 8) is None


def _toy():
    model = ToyModel(num_tasks=4, hidden=16)
    batch = _batch()
    params = jax.jit(lambda r: nn.meta.unbox(model.init_variables(r, batch)["params"]))(
        jax.random.key(0))  # jitted: one compile, not op by op
    return model, batch, params


# (model, mesh's model axis): the toy MLP on 8 x 1; T5 and the recommendation model, both
# with dropout keyed per row (tests/optim/test_dropout_paths.py's, counts (3, 5, 0, 8)),
# on 4 x 2 and 8 x 1.
CASES = [("toy", 1), ("t5", 2), ("recsys", 1)]


@pytest.mark.parametrize("name,num_partitions", CASES)
def test_device_gradients_equal_one_devices_and_sum_to_the_plain_gradient(name, num_partitions):
    from tests.optim.test_dropout_paths import model_batch_params

    model, batch, params = _toy() if name == "toy" else model_batch_params(name)
    counts = tuple(np.bincount(np.asarray(batch["task_id"]), minlength=4))
    norm = model.normalizer(batch)
    rng = jax.random.key(3)

    def loss_sums(p, b):
        return model.loss_sums(p, b, rng, name != "toy")

    ref_losses, ref_aux, ref = jax.jit(lambda p, b: optim.compute_task_gradients(
        loss_sums, norm, p, b, num_tasks=4, method="vjp"))(params, batch)
    mesh = partitioning.create_mesh(num_partitions)
    data = mesh.shape[partitioning.DATA]
    slots = device_slots(counts, data)
    assert slots == 2  # a task boundary inside some device's rows
    with jax.set_mesh(mesh), nn.logical_axis_rules(partitioning.standard_logical_axis_rules()):
        sharded = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(partitioning.DATA)))
        losses, aux, got = jax.jit(lambda p, b: optim.compute_task_gradients(
            loss_sums, norm, p, b, num_tasks=4, method="devices", slots=slots,
            check_layout=False))(params, sharded)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), aux, ref_aux)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):  # stacked and summed
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    if name == "toy":  # [4, 6, 16]: split over `data` along the kernel's dimension 1
        assert got.stacked["Dense_0"]["kernel"].sharding.spec[2] == partitioning.DATA
    # The task gradients add up to the gradient of the summed loss (dropout included).
    plain = jax.jit(jax.grad(lambda p: (loss_sums(p, batch)[0] / norm).sum()))(params)
    total = jax.tree.map(lambda g, u: np.asarray(u) if g is None else np.asarray(g).sum(0),
                         got.stacked, got.summed, is_leaf=lambda x: x is None)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 total, plain)


def test_more_tasks_on_a_device_than_slots_is_refused():
    model = ToyModel(num_tasks=4)
    batch = _batch()
    params = nn.meta.unbox(model.init_variables(jax.random.key(0), batch)["params"])
    mesh = partitioning.create_mesh(1)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="slots=1 but a device holds "
                                                             "rows of 2 tasks"):
        optim.compute_task_gradients(lambda p, b: model.loss_sums(p, b, None, False),
                                     model.normalizer(batch), params, batch, num_tasks=4,
                                     method="devices", slots=1)


BALANCERS = {
    "metabalance": lambda: optim.metabalance(relax_factor=0.7, num_tasks=4),
    "pcgrad": lambda: optim.pcgrad(),
    "mgda": lambda: optim.mgda(),
    "grad_similarity": lambda: optim.grad_similarity(),
    "gradnorm": lambda: optim.gradnorm(num_tasks=4),
    "mtadam": lambda: optim.mtadam(num_tasks=4),
    "olaux": lambda: optim.olaux(num_tasks=4),
    "uncertainty": lambda: optim.uncertainty(num_tasks=4),
    "dwa": lambda: optim.dwa(num_tasks=4),
}


def test_every_balancer_updates_as_on_one_device():
    """Three steps of each balancer on one device and on a 4 x 2 mesh (task 0's one row
    fewer than the `data` axis's 4 devices), device by device with 1-D and 2-D parameter
    partitioning and by task blocks: the same parameters (to 1e-6 of
    each parameter's largest entry)."""
    model = ToyModel(num_tasks=4, dim=8, hidden=16)  # 8: the embed axis splits 4 ways (dims 2)
    one = partitioning.create_mesh(1, devices=jax.devices()[:1])
    mesh = partitioning.create_mesh(2)

    initial = {}  # balancer -> its initial state (host arrays), the same on every mesh

    def run(make, m, dims, method, path):
        rules = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=dims)
        tr = trainer_lib.Trainer(model, optax.sgd(0.1), balancer=make(), mesh=m, rules=rules,
                                 weights_from_losses=False, grad_method=method)
        if make not in initial:
            initial[make] = jax.device_get(tr.init_state(jax.random.key(0), _batch(dim=8)))
        else:  # initialized once per balancer, placed on this trainer's shardings
            tr.create_abstract_state(_batch(dim=8))
        state = jax.device_put(initial[make], tr.state_shardings)
        for step in range(3):
            state, _ = tr.train_step(state, _batch(dim=8, seed=step), jax.random.key(1),
                                     task_counts=COUNTS)
        keys = [k[0] for k in tr._compiled if k[0] is not None]
        assert keys and all((k[0] == "devices") == (path == "devices") for k in keys), keys
        return jax.device_get(state.params)

    def close(a, b, msg):  # relative 1e-6 of the leaf's largest entry
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max(), err_msg=msg)

    for name, make in BALANCERS.items():
        expected = run(make, one, 1, "auto", "blocks")
        # COUNTS put two tasks on some devices: "auto" takes the cheaper blocks there.
        for dims, method, path in [(1, "devices", "devices"), (2, "devices", "devices"),
                                   (1, "auto", "blocks")]:
            jax.tree.map(lambda a, b: close(a, b, f"{name}, dims {dims}, {method}"),
                         run(make, mesh, dims, method, path), expected)


ONE_TASK_EACH = (4, 4, 0, 8)  # 16 rows on a 4-way data axis: one task's rows on each device


def _split_dims(params, mesh):
    """`(scatter_dims, split)` of `params` placed on `mesh` (as `Trainer._scatter_dims`)."""
    data = mesh.shape[partitioning.DATA]
    dims, split = [], []
    for x in jax.tree.leaves(params):
        spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        on = [k for k, e in enumerate(spec) if e == partitioning.DATA]
        model = [k for k, e in enumerate(spec) if e == partitioning.MODEL]
        split.append(bool(on))
        dims.append(on[0] if on else default_scatter_dim(x.shape, data, avoid=model))
    return dims, split


def test_parameters_split_over_data_are_gathered_layer_by_layer():
    """2-D parameter partitioning, one task on each device: the scanned T5's parameters
    enter the per-device region as shards, each layer's gathered inside the scan's body;
    the per-task gradients equal the one-hot VJP path's under dropout and stay split over
    `data` as the parameters are."""
    from ktx.models import seq2seq, t5
    from ktx.models.base import with_row_ids
    from ktx.optim.device_slots import per_device_task_gradients

    model = seq2seq.EncoderDecoderModel(
        config=t5.T5Config(vocab_size=64, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
                           num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.1,
                           scan_layers=True, remat_policy="minimal"),
        num_tasks=4)
    batch = with_row_ids(random_t5_batch(ONE_TASK_EACH))
    boxed = jax.jit(lambda r: model.init_variables(r, batch)["params"])(jax.random.key(0))
    params = nn.meta.unbox(boxed)
    norm = model.normalizer(batch)

    def loss_sums(p, b):
        return model.loss_sums(p, b, jax.random.key(3), True)

    ref_losses, _, ref = jax.jit(lambda p, b: optim.compute_task_gradients(
        loss_sums, norm, p, b, num_tasks=4, method="vjp"))(params, batch)
    mesh = partitioning.create_mesh(2)  # 4 x 2
    rules = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=2)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        placed = jax.device_put(params, partitioning.logical_to_shardings(
            nn.get_partition_spec(boxed), mesh, rules))
        dims, split = _split_dims(placed, mesh)
        assert sum(split) > len(split) // 2  # the kernels and embeddings
        layouts = [partitioning.without_data(x.sharding.spec, x.ndim)
                   for x in jax.tree.leaves(placed)]
        fn = jax.jit(lambda p, b: per_device_task_gradients(
            loss_sums, norm, p, b, num_tasks=4, slots=1, scatter_dims=dims, split=split,
            layouts=layouts))
        sharded = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(partitioning.DATA)))
        sums, _, got = fn(placed, sharded)
        hlo = fn.lower(placed, sharded).compile().as_text()
    np.testing.assert_allclose(sums / norm, ref_losses, rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                            jax.tree.leaves(ref.stacked)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))
    kernel = got["encoder"]["layers"]["attention"]["query"]["kernel"]  # [T, L, E, H, D]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    k = dims[paths.index("['encoder']['layers']['attention']['query']['kernel']")]
    assert kernel.sharding.spec[k + 1] == partitioning.DATA
    # The encoder's and decoder's layers are gathered inside their scans' bodies.
    gathers = [line for line in hlo.splitlines() if " all-gather(" in line]
    assert any("encoder/while/body" in line for line in gathers)
    assert any("decoder/while/body" in line for line in gathers)
    # The token table [vocab 64 / model, embed 16 / data] is looked up where it lies
    # (`param_gather.take`), never gathered; each attention kernel is gathered over `data`
    # only, one of its two heads [L, embed 16, heads / model, 8], never a layer's every
    # head (XLA gathers over `model` too without layouts).
    table = placed["token_embedder"]["embedding"]
    assert table.sharding.spec == PartitionSpec(partitioning.MODEL, partitioning.DATA)
    assert not any(re.search(r" f32\[(64|32),(16|4)\]", line) for line in gathers)
    assert not any(re.search(r" f32\[(\d+,)?16,2,8\]", line) for line in gathers)
    assert any(re.search(r" f32\[(\d+,)?16,1,8\]", line) for line in gathers)


def _region_gradients(loss_sums, norm, params, batch, specs, expected, **kwargs):
    """`per_device_task_gradients` of `params` placed on the 4 x 2 mesh by `specs` (one
    `PartitionSpec` per parameter), checked against `expected` (`[T, ...]` per parameter);
    returns them and the compiled step's HLO text. `kwargs`: its other arguments."""
    from ktx.optim.device_slots import per_device_task_gradients

    mesh = partitioning.create_mesh(2)
    with jax.set_mesh(mesh):
        placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        fn = jax.jit(lambda p, b: per_device_task_gradients(loss_sums, norm, p, b, slots=1,
                                                            **kwargs))
        sharded = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(partitioning.DATA)))
        _, _, got = fn(placed, sharded)
        hlo = fn.lower(placed, sharded).compile().as_text()
    for name in params:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(expected[name]),
                                   rtol=1e-5, atol=1e-6, err_msg=f"{name}, {specs}")
    return got, hlo


def test_contracted_parameters_stay_split_and_give_the_per_task_gradients():
    """A parameter its module reads through `param_gather.contract` (HyperPrompt-Global's
    generators) enters the region split and is never gathered: the product is gathered
    instead, and the per-task gradient shards, with and without a `model` layout, equal
    the per-task gradients of one device, as do those of the contracted operand's own
    parameter (its cotangent comes back from the shards' partial products)."""
    from ktx import param_gather

    T, t, d, h, k = 4, 3, 8, 2, 4
    rng = np.random.default_rng(0)
    params = {"emb": jnp.asarray(rng.normal(size=(T, t)), jnp.float32),
              "gen": jnp.asarray(rng.normal(size=(t, d, h, k)) / 3, jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(16, d)), jnp.float32),
             "task_id": jnp.asarray(np.repeat(np.arange(T), ONE_TASK_EACH), jnp.int32)}
    norm = jnp.float32(16.0)

    def loss_sums(p, b):
        # Each device's operand differs (the rows of the tasks it does not hold are zero),
        # as HyperPrompt's layer-task embeddings of the device's own tasks do.
        present = (jnp.bincount(b["task_id"], length=T) > 0).astype(jnp.float32)
        w = param_gather.contract(p["emb"] * present[:, None], p["gen"], ("gen",))
        out = jnp.einsum("bd,bdhk->bhk", b["x"], w[b["task_id"]])
        rows = jnp.tanh(out).sum((1, 2)) ** 2
        return jax.ops.segment_sum(rows, b["task_id"], num_segments=T), {}

    expected = jax.jacrev(lambda p: loss_sums(p, batch)[0] / norm)(params)  # [T, ...]
    D, M = partitioning.DATA, partitioning.MODEL
    for gen_spec, layouts in [(PartitionSpec(None, D, M, None), [None, (None, None, M, None)]),
                              (PartitionSpec(None, D), None)]:
        got, hlo = _region_gradients(
            loss_sums, norm, params, batch, {"emb": PartitionSpec(), "gen": gen_spec},
            expected, num_tasks=T, scatter_dims=[0, 1], split=[False, True], layouts=layouts)
        assert got["gen"].sharding.spec[2] == D  # [T, t, d / data, ...]
        # The generator is never gathered over `data` (its [t = 3, d = 8, ...] whole).
        gathers = [line for line in hlo.splitlines() if " all-gather(" in line]
        assert gathers and not any(re.search(r"f32\[3,8,", line) for line in gathers)


def test_embedding_tables_looked_up_split_give_the_per_task_gradients():
    """A table its module reads through `param_gather.take` (T5's token embedder) enters
    the region split over `data` along its features and is never gathered: each device
    looks up every device's ids in its shard. Its per-task gradient shards, with the rows
    split over `model` and without, and with the same table also read whole (tied logits,
    `gather`), equal the per-task gradients of one device."""
    from ktx import param_gather

    T, V, E, L = 4, 6, 8, 3
    rng = np.random.default_rng(1)
    params = {"table": jnp.asarray(rng.normal(size=(V, E)), jnp.float32),
              "w": jnp.asarray(rng.normal(size=(E,)), jnp.float32)}
    # Ids repeat within and across devices (and tasks), so rows' cotangents add up.
    batch = {"ids": jnp.asarray(rng.integers(0, V, size=(16, L)), jnp.int32),
             "task_id": jnp.asarray(np.repeat(np.arange(T), ONE_TASK_EACH), jnp.int32)}
    norm = jnp.float32(16.0)

    def loss_sums(p, b, tied):
        x = param_gather.take(p["table"], b["ids"], ("table",), jnp.float32)  # [B, L, E]
        rows = (jnp.tanh(x * p["w"]).sum(-1) ** 2).sum(-1)
        if tied:
            logits = x.mean(1) @ param_gather.gather(p["table"]).T  # [B, V]
            rows = rows + jax.nn.logsumexp(logits, -1)
        return jax.ops.segment_sum(rows, b["task_id"], num_segments=T), {}

    D, M = partitioning.DATA, partitioning.MODEL
    for tied in (False, True):
        expected = jax.jacrev(lambda p: loss_sums(p, batch, tied)[0] / norm)(params)
        for spec, layouts in [(PartitionSpec(M, D), [(M, None), None]),
                              (PartitionSpec(None, D), None)]:
            got, hlo = _region_gradients(
                functools.partial(loss_sums, tied=tied), norm, params, batch,
                {"table": spec, "w": PartitionSpec()}, expected, num_tasks=T,
                scatter_dims=[1, 0], split=[True, False], layouts=layouts)
            assert got["table"].sharding.spec[2] == D  # [T, V, E / data]
            if not tied:  # the table [V = 6, E = 8] is never gathered whole
                gathers = [line for line in hlo.splitlines() if " all-gather(" in line]
                assert not any(re.search(r"f32\[(3|6),8\]", line) for line in gathers)


def test_projected_kernels_give_the_per_task_gradients_a_slice_at_a_time(monkeypatch):
    """A kernel its module reads through `param_gather.project` (T5's untied logits),
    split over `data` along the contracted dimension: its per-task gradient shards, made a
    slice of the output at a time (three slices here, one with the default size), with
    the output split over `model` and without, equal the per-task gradients of one
    device, as does the projected input's own parameter; no device holds the kernel's
    whole gradient."""
    from ktx import param_gather

    T, E, V, L = 4, 8, 6, 3
    rng = np.random.default_rng(2)
    params = {"kernel": jnp.asarray(rng.normal(size=(E, V)) / 3, jnp.float32),
              "w": jnp.asarray(rng.normal(size=(E,)), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(16, L, E)), jnp.float32),
             "task_id": jnp.asarray(np.repeat(np.arange(T), ONE_TASK_EACH), jnp.int32)}
    norm = jnp.float32(16.0)

    def loss_sums(p, b):
        logits = param_gather.project(jnp.tanh(b["x"] * p["w"]), p["kernel"], ("kernel",))
        rows = jax.nn.logsumexp(logits, -1).sum(-1)  # [B]
        return jax.ops.segment_sum(rows, b["task_id"], num_segments=T), {}

    expected = jax.jacrev(lambda p: loss_sums(p, batch)[0] / norm)(params)
    D, M = partitioning.DATA, partitioning.MODEL
    default = param_gather.PROJECT_CHUNK_BYTES
    for chunk_bytes in (8 * 2 * 4, default):  # slices of 2 (or 1), then one slice
        monkeypatch.setattr(param_gather, "PROJECT_CHUNK_BYTES", chunk_bytes)
        for spec, layouts in [(PartitionSpec(D, M), [(None, M), None]),
                              (PartitionSpec(D), None)]:
            got, hlo = _region_gradients(
                loss_sums, norm, params, batch, {"kernel": spec, "w": PartitionSpec()},
                expected, num_tasks=T, scatter_dims=[0, 0], split=[True, False],
                layouts=layouts)
            assert got["kernel"].sharding.spec[1] == D  # [T, E / data, V]
            # Each device exchanges slices of its gradient, never the whole [E = 8, V = 6]
            # (or [8, 3] with V split over `model`) when sliced.
            exchanged = [line for line in hlo.splitlines() if " all-to-all(" in line]
            assert exchanged
            if chunk_bytes < default:
                assert not any(re.search(r"f32\[[^\]]*,(6|3)\]", line) for line in exchanged)


def test_split_parameters_through_the_trainer_update_as_on_one_device():
    """2-D parameter partitioning with one task on each device: "auto" takes per-task
    gradients device by device with split parameters, and MetaBalance, PCGrad and MGDA
    update as on one device; with two tasks on a device it keeps the task blocks. Per-task
    gradients held in bfloat16 (`task_grad_dtype`) are made so in the gather's backward
    pass and update as the float32 ones do, to bfloat16's rounding."""
    model = ToyModel(num_tasks=4, dim=8, hidden=16)
    one = partitioning.create_mesh(1, devices=jax.devices()[:1])
    mesh = partitioning.create_mesh(2)
    batches = [_batch(ONE_TASK_EACH, dim=8, seed=step) for step in range(3)]

    def run(make, m, dims, **options):
        rules = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=dims)
        tr = trainer_lib.Trainer(model, optax.sgd(0.1), balancer=make(), mesh=m, rules=rules,
                                 weights_from_losses=False, **options)
        state = tr.init_state(jax.random.key(0), batches[0])
        for b in batches:
            state, _ = tr.train_step(state, b, jax.random.key(1), task_counts=ONE_TASK_EACH)
        return tr, jax.device_get(state.params)

    for name in ("metabalance", "pcgrad", "mgda"):
        _, expected = run(BALANCERS[name], one, 1)
        tr, got = run(BALANCERS[name], mesh, 2)
        assert [k[0] for k in tr._compiled] == [("devices", 1)], list(tr._compiled)
        (step,) = tr._compiled.values()
        split = step.__wrapped__.keywords["options"].split_params  # the compiled options
        assert split is not None and any(split) and tr._params_split_over_data()
        jax.tree.map(lambda a, b: np.testing.assert_allclose(
            a, b, rtol=0, atol=1e-6 * np.abs(b).max(), err_msg=name), got, expected)
        if name == "metabalance":
            tr, half = run(BALANCERS[name], mesh, 2, task_grad_dtype="bfloat16")
            jax.tree.map(lambda a, b: np.testing.assert_allclose(
                a, b, rtol=0, atol=2e-2 * np.abs(b).max(), err_msg=name), half, expected)
            moved = jax.tree.map(lambda a, b, c: np.abs(a - c).max() > 0, half, got, expected)
            assert any(jax.tree.leaves(moved))  # rounded: not the float32 step's numbers
    # Two tasks on a device (COUNTS): "auto" keeps the blocks for split parameters.
    rules = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=2)
    tr = trainer_lib.Trainer(model, optax.sgd(0.1), balancer=BALANCERS["pcgrad"](), mesh=mesh,
                             rules=rules, weights_from_losses=False)
    state = tr.init_state(jax.random.key(0), _batch(dim=8))
    tr.train_step(state, _batch(dim=8), jax.random.key(1), task_counts=COUNTS)
    assert [k[0][0] for k in tr._compiled] != ["devices"]


def test_split_per_task_gradients_in_bfloat16():
    """`dtype=bfloat16`: the per-task gradient shards of split parameters come out of the
    gather's backward pass in bfloat16 (and the whole ones' too), equal to the float32
    ones rounded."""
    from ktx.optim.device_slots import per_device_task_gradients

    model = ToyModel(num_tasks=4, dim=8, hidden=16)
    batch = _batch(ONE_TASK_EACH, dim=8)
    boxed = model.init_variables(jax.random.key(0), batch)["params"]
    params = nn.meta.unbox(boxed)
    norm = model.normalizer(batch)

    def loss_sums(p, b):
        return model.loss_sums(p, b, None, False)

    mesh = partitioning.create_mesh(2)
    rules = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=2)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        placed = jax.device_put(params, partitioning.logical_to_shardings(
            nn.get_partition_spec(boxed), mesh, rules))
        dims, split = _split_dims(placed, mesh)
        assert any(split) and not all(split)
        sharded = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(partitioning.DATA)))
        out = {dt: jax.jit(lambda p, b, dt=dt: per_device_task_gradients(
            loss_sums, norm, p, b, num_tasks=4, slots=1, scatter_dims=dims, split=split,
            dtype=dt))(placed, sharded)[2] for dt in (None, jnp.bfloat16)}
    for full, half in zip(jax.tree.leaves(out[None]), jax.tree.leaves(out[jnp.bfloat16])):
        assert full.dtype == jnp.float32 and half.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(half), np.asarray(full.astype(jnp.bfloat16)))


def test_bert_family_scanned_stacks_gather_their_layers():
    """BERT, PALs and CA-MTL with scanned layers and 2-D parameter partitioning, one task
    on each device: the split path's per-task gradients equal the one-hot VJP path's, and
    each model's layers are gathered inside its scan's body."""
    from ktx.models import bert, camtl, encoder, pals
    from ktx.optim.device_slots import per_device_task_gradients

    config = bert.BertConfig(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2,
                             intermediate_size=32, max_position=16, dropout_rate=0.0,
                             attention_dropout_rate=0.0, scan_layers=True,
                             remat_policy="minimal")
    labels = (3, 1, 3, 1)
    models = {
        "bert": encoder.EncoderClassifierModel(config, num_labels=labels),
        "pals": pals.PalsClassifierModel(config, num_labels=labels, pals_size=4, pals_heads=2),
        "camtl": camtl.CaMtlClassifierModel(config, camtl=camtl.CaMtlConfig("base", 8),
                                            num_labels=labels),
    }
    n = sum(ONE_TASK_EACH)
    rng = np.random.default_rng(0)
    task = np.repeat(np.arange(4), ONE_TASK_EACH).astype(np.int32)
    batch = {"input_ids": rng.integers(1, 40, (n, 8)).astype(np.int32),
             "token_type_ids": np.zeros((n, 8), np.int32),
             "label": np.where(task % 2 == 0, rng.integers(0, 3, n), rng.normal(size=n)
                               ).astype(np.float32),
             "task_id": task}
    mesh = partitioning.create_mesh(2)  # 4 x 2
    rules = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=2)
    for name, model in models.items():
        boxed = jax.jit(lambda r, model=model: model.init_variables(r, batch)["params"])(
            jax.random.key(0))  # jitted: one compile, not op by op
        params = nn.meta.unbox(boxed)
        norm = model.normalizer(batch)

        def loss_sums(p, b, model=model):
            return model.loss_sums(p, b, None, False)

        _, _, ref = jax.jit(lambda p, b: optim.compute_task_gradients(
            loss_sums, norm, p, b, num_tasks=4, method="vjp"))(params, batch)
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            placed = jax.device_put(params, partitioning.logical_to_shardings(
                nn.get_partition_spec(boxed), mesh, rules))
            dims, split = _split_dims(placed, mesh)
            fn = jax.jit(lambda p, b: per_device_task_gradients(
                loss_sums, norm, p, b, num_tasks=4, slots=1, scatter_dims=dims, split=split))
            sharded = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(partitioning.DATA)))
            compiled = fn.lower(placed, sharded).compile()
            got = compiled(placed, sharded)[2]
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                                jax.tree.leaves(ref.stacked)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name} {jax.tree_util.keystr(path)}")
        gathers = [line for line in compiled.as_text().splitlines() if " all-gather(" in line]
        assert any("while/body" in line for line in gathers), name


def test_hyperprompt_global_in_the_region_updates_as_on_one_device():
    """A task-conditioned T5 (HyperPrompt-Global, scanned) through the Trainer's device by
    device path with split parameters: each device computes the hyper-prompts of its one
    task only (`for_batch_tasks`), and MetaBalance updates as on one device."""
    from ktx.conditioning.model import ConditioningConfig, conditioned_model
    from ktx.models import seq2seq, t5

    base = seq2seq.EncoderDecoderModel(
        t5.T5Config(vocab_size=64, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
                    num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0,
                    scan_layers=True), num_tasks=4)
    model = conditioned_model(base, ConditioningConfig(
        method="hyperprompt", hyperprompt_variant="global", reduction_factor=4,
        task_embed_dim=4, task_hidden_dim=8, projected_dim=4, encoder_prompt_length=2,
        decoder_prompt_length=1))
    batch = random_t5_batch(ONE_TASK_EACH)

    def run(m, dims, initial=None):
        rules = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=dims)
        tr = trainer_lib.Trainer(model, optax.sgd(0.1), balancer=BALANCERS["metabalance"](),
                                 mesh=m, rules=rules, weights_from_losses=False)
        if initial is None:
            state = tr.init_state(jax.random.key(0), batch)
            initial = jax.device_get(state)  # read before the steps donate it
        else:  # the one-device run's initial state, placed on this trainer's shardings
            state = jax.device_put(initial, tr.create_abstract_state(batch)[1])
        for step in range(2):
            state, _ = tr.train_step(state, batch, jax.random.key(1), task_counts=ONE_TASK_EACH)
        return tr, initial, jax.device_get(state.params)

    _, start, expected = run(partitioning.create_mesh(1, devices=jax.devices()[:1]), 1)
    tr, _, got = run(partitioning.create_mesh(2), 2, start)
    assert [k[0] for k in tr._compiled] == [("devices", 1)], list(tr._compiled)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=0, atol=1e-6 * np.abs(b).max()), got, expected)
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(),
                         got["conditioning"], start.params["conditioning"])
    assert all(v > 0 for v in jax.tree.leaves(moved))  # every hyper-network trained
