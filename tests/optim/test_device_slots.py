"""Per-task gradients device by device (`method="devices"`, `ktx.optim.device_slots`).

On the 8 fake CPU devices (tests/conftest.py), with a `data` axis wider than some tasks'
rows: the per-task gradients equal one device's, they add up to the plain gradient under
dropout, and every balancer's update through the `Trainer` equals the single-device
update, with 1-D and 2-D parameter partitioning.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ktx import optim, partitioning
from ktx.optim.device_slots import default_scatter_dim, device_slots
from ktx.training import trainer as trainer_lib
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
