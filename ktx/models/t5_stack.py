"""How a T5 layer stack runs: unrolled or scanned over layers, with or without
rematerialisation (the T5X scalable-T5 options).

* `remat_policy` (`T5Config.remat_policy`): `"none"` keeps every activation for the
  backward pass; `"minimal"` saves only the matmuls without batch dimensions
  (`jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims`, T5X's 'minimal') and
  recomputes the rest; `"dots"` saves every matmul output, attention scores included
  (`jax.checkpoint_policies.dots_saveable`), and recomputes only the elementwise work
  between them; `"full"` saves nothing but each layer's input. The dense layers' products
  (`ktx.linear.contract`, a custom VJP) are saved by name as well. Applied per layer
  (`nn.remat` on the layer module): the numbers are those of `"none"`. T5.1.1-Small on
  XLA:CPU (docs/scale.md): scanned 'none' runs at 0.97-1.03x the unrolled step without
  remat, scanned 'dots' and 'minimal' at 0.93-1.0x with 20-30% less memory.
* `scan_layers` (`T5Config.scan_layers`): the stack is one `nn.scan` over one layer
  definition, so XLA compiles one layer instead of `L`. Parameters (and the decode
  cache, and sown intermediates) are stacked on a leading `layers` axis under the scope
  `layers` (e.g. `encoder/layers/attention/query/kernel` `[L, E, H, D]`), annotated with
  the logical axis `ktx.partitioning.LAYERS`, which the standard rules never shard.
  `ktx.models.scan_layout` converts parameter trees between the two layouts.

Elementwise work between matmuls (activations, the gated product, RMSNorm, dropout's
select, and attention's softmax and dropout, recomputed from the raw scores) runs under
`recompute_elementwise`: the backward pass recomputes it from its inputs instead of
saving its intermediates. An unrolled stack gets this from XLA's
fusions anyway; a scanned one would otherwise carry every such intermediate (a tanh, a
broadcast zero, a normalised copy) as an `[L, ...]` residual stack across the loop.

Per-layer inputs of a scanned stack (`layer_inputs`, a pytree whose leaves have a
leading `[L]` axis; the layer index among them when a hook needs it) are sliced by the
scan and handed to layer `i`'s hooks; an unrolled stack passes None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax

from ktx import linear
from ktx.param_gather import gather_layer_params, stack_hook
from ktx.partitioning import LAYERS

__all__ = ["REMAT_POLICIES", "check_remat_policy", "layer_class", "recompute_elementwise",
           "remat_policy", "run_stack"]

REMAT_POLICIES = ("none", "minimal", "dots", "full")


def check_remat_policy(
    value: Any, where: str = "T5Config.remat_policy", macro: str = "REMAT_POLICY"
) -> str:
    """`value` if it is one of `REMAT_POLICIES`; else a ValueError naming `where` (the
    gin binding) and the gin macro of the model files that sets it."""
    if not isinstance(value, str) or value not in REMAT_POLICIES:
        raise ValueError(
            f"{where}={value!r} (gin macro {macro} of gin/models/*.gin); accepted: "
            f"{REMAT_POLICIES}")
    return value


def remat_policy(name: str) -> Any:
    """The `jax.checkpoint` policy of a `REMAT_POLICIES` name (None: save nothing).

    "minimal" saves the dots without batch dimensions (dense layers' products, not
    attention's), "dots" every dot; both also save the dense layers' products by name
    (`ktx.linear.SAVE_NAME`: a dot inside a custom VJP is not seen as one)."""
    check_remat_policy(name)
    policies = jax.checkpoint_policies
    if name == "minimal":
        dots = policies.checkpoint_dots_with_no_batch_dims
    elif name == "dots":
        dots = policies.dots_saveable
    else:
        return None
    return policies.save_from_both_policies(
        dots, policies.save_only_these_names(linear.SAVE_NAME))


def recompute_elementwise(fn: Any) -> Any:
    """`fn` (elementwise work: no matmul, no parameters created) whose intermediates the
    backward pass recomputes from `fn`'s inputs instead of saving: `jax.checkpoint` with
    `prevent_cse=False`, so in an unrolled stack XLA may still share the forward's values.
    The same numbers; only what is saved for the backward pass changes."""
    return jax.checkpoint(fn, prevent_cse=False)


def layer_class(cls: type, policy: str, static_argnums: Sequence[int], *, scanned: bool) -> type:
    """`cls`, rematerialised under `policy` unless it is "none".

    `static_argnums` index the layer's `__call__` arguments counting `self` as 0 (its
    Python bools, e.g. `deterministic`); inside a scan, common-subexpression elimination
    cannot undo the recomputation, so `prevent_cse` is off there (as T5X).
    """
    if check_remat_policy(policy) == "none":
        return cls
    return nn.remat(cls, policy=remat_policy(policy), prevent_cse=not scanned,
                    static_argnums=tuple(static_argnums))


def gathered_layers(cls: type, scope_path: tuple | None) -> type:
    """The layer class a scanned stack (scope `layers` under the module at `scope_path`)
    runs: inside a device-by-device region with parameters split over `data`
    (`ktx.param_gather`) one that gathers its layer's parameters in the scan's body, to be
    wrapped in remat after (so the backward pass gathers again); else `cls`."""
    return gather_layer_params(cls) if stack_hook(scope_path) else cls


def run_stack(
    make_layer: Any,
    cls: type,
    fields: dict[str, Any],
    *,
    num_layers: int,
    scan: bool,
    remat: str,
    static_argnums: Sequence[int],
    x: jax.Array,
    args: Sequence[Any],
    layer_inputs: Any = None,
    scope_path: tuple | None = None,
) -> jax.Array:
    """Runs `num_layers` layers on `x`: `layer(x, *args[, layer_inputs])`.

    Unrolled: `make_layer(i)` builds layer `i` (already rematerialised). Scanned: one
    `nn.scan` of `cls` (built with `fields`, plus `scanned=True`, scope `layers`) over
    `layer_inputs` (leaves `[L, ...]`), every one of `args` broadcast to every layer.
    Must be called inside the parent module's compact `__call__`, whose `scope.path` is
    `scope_path`: inside a device-by-device region with parameters split over `data`
    (`ktx.param_gather`), the scanned body gathers one layer's parameters at a time.
    """
    if not scan:
        for i in range(num_layers):
            x = make_layer(i)(x, *args)
        return x
    body = layer_class(gathered_layers(cls, scope_path), remat, static_argnums, scanned=True)
    stack = nn.scan(
        body,
        variable_axes={"params": 0, "cache": 0, "intermediates": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast,) * len(args) + (0,),
        length=num_layers,
        metadata_params={nn.PARTITION_NAME: LAYERS},
    )
    x, _ = stack(**fields, scanned=True, name="layers")(x, *args, layer_inputs)
    return x
