"""Device mesh and logical axis rules, in the style of T5X's `partitioning.py`.

Every ktx parameter is declared with logical axis names through
`nn.with_logical_partitioning`; the rules below map those names onto the two mesh
axes `data` and `model`. The mesh is (num_devices // num_partitions, num_partitions):
`num_partitions` devices hold shards of one model replica, the rest replicate it and
split the batch.

    mesh = create_mesh(num_partitions=2)
    rules = standard_logical_axis_rules()
    with mesh, nn.logical_axis_rules(rules):
      abstract = jax.eval_shape(init_fn, rng)
      shardings = logical_to_shardings(nn.get_partition_spec(abstract), mesh, rules)
      state = jax.jit(init_fn, out_shardings=shardings)(rng)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "AxisRules",
    "DATA",
    "MODEL",
    "BATCH",
    "VOCAB",
    "EMBED",
    "MLP",
    "HEADS",
    "KV",
    "JOINED_KV",
    "LENGTH",
    "RELPOS_BUCKETS",
    "LAYERS",
    "PARAMETER_PARTITIONING_DIMS",
    "TASKS",
    "PROMPT_LENGTH",
    "TASK_EMBED",
    "HYPER_BOTTLENECK",
    "USERS",
    "ITEMS",
    "create_mesh",
    "standard_logical_axis_rules",
    "logical_to_shardings",
    "abstract_shardings",
    "check_divisible",
    "data_sharding",
    "replicated_sharding",
    "entry_axes",
    "without_data",
    "host_local_to_global",
]

AxisRules = Sequence[tuple[str, str | None]]

# Mesh axes.
DATA = "data"
MODEL = "model"

# Logical axes: T5X's standard names.
BATCH = "batch"
VOCAB = "vocab"
EMBED = "embed"
MLP = "mlp"
HEADS = "heads"
KV = "kv"
JOINED_KV = "joined_kv"
LENGTH = "length"
RELPOS_BUCKETS = "relpos_buckets"
LAYERS = "layers"
MLP_ACTIVATIONS = "mlp_activations"
# Logical axes added by ktx: task conditioning and recommendation tables.
TASKS = "tasks"
PROMPT_LENGTH = "prompt_length"
TASK_EMBED = "task_embed"
HYPER_BOTTLENECK = "hyper_bottleneck"
USERS = "users"
ITEMS = "items"

_STANDARD_RULES: tuple[tuple[str, str | None], ...] = (
    (BATCH, DATA),
    (VOCAB, MODEL),
    (EMBED, None),
    (MLP, MODEL),
    (HEADS, MODEL),
    (KV, None),
    (JOINED_KV, MODEL),
    (LENGTH, None),
    (RELPOS_BUCKETS, None),
    (LAYERS, None),
    (MLP_ACTIVATIONS, None),
)

# Task-conditioning parameters are small: replicate them, except tables indexed by
# user or item id, which are the bulk of a recommendation model.
_KTX_RULES: tuple[tuple[str, str | None], ...] = (
    (TASKS, None),
    (PROMPT_LENGTH, None),
    (TASK_EMBED, None),
    (HYPER_BOTTLENECK, None),
    (USERS, MODEL),
    (ITEMS, MODEL),
)


PARAMETER_PARTITIONING_DIMS = (1, 2)


def standard_logical_axis_rules(
    additional_rules: AxisRules = (),
    parameter_partitioning_dims: int = 1,
) -> tuple[tuple[str, str | None], ...]:
    """T5X's standard parameter/activation rules plus ktx's task axes.

    `parameter_partitioning_dims=1`: parameters split over `model` only (T5X's 1-D
    rules). `2`: the `embed` axis (every T5 / BERT parameter's largest non-model axis)
    is also split over `data`, as T5X's `parameter_partitioning_dims=2` rules do, so each
    data-parallel replica holds `1 / data` of each such parameter (and of its optimizer
    state, which follows the parameter shardings); activations keep `batch` on `data`
    (a mesh axis is used once per array, so an activation's `embed` stays whole).

    `additional_rules` come first, so they override a standard rule for the same
    logical name (flax uses the first rule that matches). The `layers` axis (scanned
    layer stacks) is never sharded: a rule mapping it to a mesh axis is a ValueError.
    """
    if isinstance(parameter_partitioning_dims, bool) or (
        parameter_partitioning_dims not in PARAMETER_PARTITIONING_DIMS
    ):
        raise ValueError(
            f"parameter_partitioning_dims={parameter_partitioning_dims!r} (gin: "
            "train_script.train.parameter_partitioning_dims); accepted: "
            f"{PARAMETER_PARTITIONING_DIMS}"
        )
    for rule in additional_rules:
        if (
            not isinstance(rule, (tuple, list))
            or len(rule) != 2
            or not isinstance(rule[0], str)
            or rule[1] not in (None, DATA, MODEL)
        ):
            raise ValueError(
                f"additional_rules: {rule!r} is not a (logical_name, mesh_axis) pair; "
                f"mesh_axis must be one of None, {DATA!r}, {MODEL!r}"
            )
        if rule[0] == LAYERS and rule[1] is not None:
            raise ValueError(
                f"additional_rules: {tuple(rule)!r} maps the scanned layer axis {LAYERS!r} "
                f"to the mesh axis {rule[1]!r}; the layer stack of T5Config.scan_layers is "
                "never sharded: accepted for 'layers' is None (or no rule)"
            )
    standard = _STANDARD_RULES
    if parameter_partitioning_dims == 2:
        standard = tuple((EMBED, DATA) if name == EMBED else (name, axis)
                         for name, axis in standard)
    return tuple(tuple(r) for r in additional_rules) + standard + _KTX_RULES


def create_mesh(
    num_partitions: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A (`data`, `model`) mesh over all (global) devices.

    Args:
      num_partitions: model-parallel size; must divide the number of devices.
      devices: defaults to `jax.devices()` (every device of every process).
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if not isinstance(num_partitions, int) or num_partitions < 1 or n % num_partitions:
        raise ValueError(
            f"NUM_PARTITIONS={num_partitions!r} must be a positive integer dividing the "
            f"number of devices ({n}); accepted: "
            f"{[d for d in range(1, n + 1) if n % d == 0]}"
        )
    shape = (n // num_partitions, num_partitions)
    try:
        device_grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except (AssertionError, NotImplementedError, ValueError):
        device_grid = np.asarray(devices).reshape(shape)
    return Mesh(device_grid, (DATA, MODEL))


def logical_to_shardings(logical_specs: Any, mesh: Mesh, rules: AxisRules) -> Any:
    """Maps a tree of logical `PartitionSpec`s to `NamedSharding`s on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


def abstract_shardings(abstract_tree: Any, mesh: Mesh, rules: AxisRules) -> Any:
    """Shardings for an `eval_shape` tree whose leaves may be `nn.Partitioned`.

    Leaves without logical annotations (optimizer counters, step) are replicated.
    """
    return logical_to_shardings(nn.get_partition_spec(abstract_tree), mesh, rules)


def check_divisible(boxed: Any, shardings: Any) -> None:
    """Raises one ValueError naming the first parameter of `boxed` (an `eval_shape` tree
    of `nn.Partitioned` leaves) whose sharded dimension the mesh axes it maps to do not
    divide, with its logical axis and what to change; `shardings` are `boxed`'s."""
    from ktx import treepath

    flat = jax.tree_util.tree_flatten_with_path(
        boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
    for (path, leaf), sharding in zip(flat, jax.tree.leaves(shardings)):
        value = leaf.value if isinstance(leaf, nn.Partitioned) else leaf
        names = getattr(leaf, "names", None) or (None,) * value.ndim
        mesh_shape = dict(sharding.mesh.shape)
        for dim, (size, axes, logical) in enumerate(zip(value.shape, sharding.spec, names)):
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            ways = int(np.prod([mesh_shape[a] for a in axes])) if axes else 1
            if size % ways:
                raise ValueError(
                    f"parameter {treepath.name(path)} {tuple(value.shape)}: its dimension {dim} "
                    f"({size}, logical axis {logical!r}) is sharded over the mesh axes "
                    f"{'x'.join(axes)} ({ways} ways), which do not divide it; accepted: a size "
                    f"that is a multiple of {ways} (pad it in the model's configuration, e.g. "
                    f"RecsysModel.table_rows_multiple, T5's vocabulary), another NUM_PARTITIONS, "
                    f"or a rule mapping {logical!r} to None (additional_rules)")


def data_sharding(mesh: Mesh) -> NamedSharding:
    """Batch-major arrays: the leading axis split over `data`, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(DATA))


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def entry_axes(entry: Any) -> tuple:
    """The mesh axes of one `PartitionSpec` entry: None -> (), "model" -> ("model",),
    ("data", "model") as it is."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def without_data(spec: PartitionSpec, ndim: int) -> tuple:
    """`spec` of an `ndim`-D array with `data` removed, one entry per dimension (None:
    whole): its layout over the other mesh axes, e.g. inside a region manual over `data`."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    out = []
    for e in entries:
        kept = tuple(a for a in entry_axes(e) if a != DATA)
        out.append(kept[0] if len(kept) == 1 else (kept or None))
    return tuple(out)


def host_local_to_global(
    batch: Mapping[str, np.ndarray], mesh: Mesh, batch_axis: int = 0
) -> dict[str, jax.Array]:
    """Assembles each process's rows of a batch into global `jax.Array`s.

    Every process passes its own contiguous slice of the global batch (rows
    `[process_index * n, (process_index + 1) * n)` of axis `batch_axis`, split over the
    `data` mesh axis; `batch_axis=1` for `[K, B, ...]` blocks of K steps' batches); with
    one process this is the whole batch.
    """
    sharding = NamedSharding(mesh, PartitionSpec(*([None] * batch_axis), DATA))
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
        for k, v in batch.items()
    }
