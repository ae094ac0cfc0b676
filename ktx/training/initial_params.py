"""A new run's parameters from a checkpoint: T5X's `INITIAL_CHECKPOINT_PATH`.

`load_initial_params` restores the parameters found in another run's checkpoint and
keeps the fresh initialization of those missing there (e.g. new prompts); the returned
`InitReport` says which are which. The path may also be an `hf:DIR` / `t5x:DIR`
checkpoint, converted on the fly (`ktx.convert`), or a ktx checkpoint whose T5 layer
stacks are in the other layout (scanned vs unrolled), converted on the way in.

This sits above both `ktx.training.checkpoints` (reading a run's checkpoint) and
`ktx.convert` (reading other formats, which itself reads ktx checkpoints).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp

from ktx.models import scan_layout
from ktx.training.checkpoints import (
    CheckpointShapeError,
    _flat_shapes,
    _mismatch_message,
    _reading,
    _restore_args,
    host_params,
    resolve_checkpoint,
    saved_param_shapes,
)
from ktx.treepath import name as param_path

__all__ = ["InitReport", "load_initial_params"]

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class InitReport:
    """What `load_initial_params` did, by '/'-joined parameter path."""

    checkpoint: str
    restored: tuple[str, ...]
    initialized: tuple[str, ...]
    unused: tuple[str, ...]

    def summary(self) -> str:
        lines = [
            f"INITIAL_CHECKPOINT_PATH {self.checkpoint}: restored {len(self.restored)} "
            f"parameters, initialized {len(self.initialized)}, unused {len(self.unused)}"
        ]
        lines += [f"  initialized: {p}" for p in self.initialized]
        lines += [f"  unused in checkpoint: {p}" for p in self.unused]
        return "\n".join(lines)


def load_initial_params(
    path: str | os.PathLike, abstract_params: Any, init_params: Any, step: int | None = None,
    *, convert_layout: bool = True,
) -> tuple[Any, InitReport]:
    """Params for a new run starting from another run's checkpoint.

    Args:
      path: a run dir, its `checkpoints/` dir or one step dir (T5X's
        `INITIAL_CHECKPOINT_PATH`); the latest step unless `step` is given. Or
        `hf:DIR` / `t5x:DIR`: a Hugging Face or T5X T5 checkpoint converted on the fly
        (`_load_initial_params_from_source`).
      abstract_params: the model's params as ShapeDtypeStructs with shardings.
      init_params: freshly initialized params (same tree), used where the checkpoint
        has no such parameter; or a function `names -> {path: array}` giving only those
        (`Trainer.init_params`), so the restored ones are never initialized.
      convert_layout: a ktx checkpoint whose T5 layer stacks are in the other layout
        (scanned vs unrolled, `T5Config.scan_layers`) is converted on the way in
        (`ktx.models.scan_layout.convert_layout`, on the host); False: that is a
        CheckpointShapeError naming the layouts.

    Returns `(params, report)`. Raises CheckpointShapeError listing every parameter
    present in both with different shapes.
    """
    from ktx import convert

    if convert.is_source(path):
        return _load_initial_params_from_source(str(path), abstract_params, init_params)
    step_dir = resolve_checkpoint(path, step)
    saved = saved_param_shapes(step_dir)
    expected = _flat_shapes(abstract_params)
    if convert_layout and scan_layout.layout_mismatch(saved, expected, str(step_dir)):
        return _load_initial_params_converted(step_dir, abstract_params, init_params)
    message = _mismatch_message(str(step_dir), saved, expected, missing_ok=True)
    if message:
        raise CheckpointShapeError(message)
    flat_abstract, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    present = [param_path(p) in saved for p, _ in flat_abstract]
    restored_paths = tuple(param_path(p) for (p, _), ok in zip(flat_abstract, present) if ok)
    initialized = tuple(param_path(p) for (p, _), ok in zip(flat_abstract, present) if not ok)
    unused = tuple(sorted(set(saved) - set(expected)))
    # Partial restore: the subset of the params tree found in the checkpoint.
    subset = _subtree(abstract_params, set(restored_paths))
    target = {"params": subset}
    restored = _reading(step_dir, ocp.PyTreeCheckpointer().restore,
        step_dir / "state",
        args=ocp.args.PyTreeRestore(
            item=target, restore_args=_restore_args(target), partial_restore=True
        ),
    )["params"]
    restored_flat = {param_path(p): v for p, v in jax.tree_util.tree_flatten_with_path(restored)[0]}
    fresh = _fresh(init_params, flat_abstract, initialized)
    leaves = [restored_flat[param_path(p)] if ok else fresh[param_path(p)]
              for (p, _), ok in zip(flat_abstract, present)]
    report = InitReport(str(step_dir), restored_paths, initialized, unused)
    _log.info(report.summary())
    return jax.tree.unflatten(treedef, leaves), report


def _load_initial_params_converted(
    step_dir: pathlib.Path, abstract_params: Any, init_params: Any
) -> tuple[Any, InitReport]:
    """`load_initial_params` from a ktx checkpoint in the other layer layout: its
    parameters are read to the host, converted (`scan_layout.convert_layout`) and placed
    with the model's shardings (each process copies only its own shards)."""
    import numpy as np

    flat = {param_path(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(host_params(step_dir))[0]}
    expected = _flat_shapes(abstract_params)
    want = scan_layout.is_scanned(dict.fromkeys(expected, 0))
    flat = scan_layout.convert_layout(flat, scanned=bool(want))
    saved = {k: tuple(v.shape) for k, v in flat.items()}
    message = _mismatch_message(str(step_dir), saved, expected, missing_ok=True)
    if message:
        raise CheckpointShapeError(message)
    flat_abstract, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    initialized = tuple(param_path(p) for p, _ in flat_abstract if param_path(p) not in flat)
    fresh = _fresh(init_params, flat_abstract, initialized)
    leaves, restored = [], []
    for p, a in flat_abstract:
        name = param_path(p)
        if name in flat:
            value = flat[name].astype(a.dtype)
            sharding = getattr(a, "sharding", None)
            leaves.append(jax.device_put(value) if sharding is None else
                          jax.make_array_from_callback(value.shape, sharding, value.__getitem__))
            restored.append(name)
        else:
            leaves.append(fresh[name])
    unused = tuple(sorted(set(saved) - set(expected)))
    report = InitReport(f"{step_dir} (layer layout converted)", tuple(restored), initialized, unused)
    _log.info(report.summary())
    return jax.tree.unflatten(treedef, leaves), report


def _load_initial_params_from_source(
    source: str, abstract_params: Any, init_params: Any
) -> tuple[Any, InitReport]:
    """`load_initial_params` from `hf:DIR` / `t5x:DIR`, a whole T5 converted on the fly:
    every converted tensor must be used and every model parameter outside the
    conditioning scope must be in it (a missing backbone tensor would otherwise be left
    at its random init); else CheckpointShapeError naming them."""
    from ktx import convert
    from ktx.analysis.params import CONDITIONING_SCOPE
    from ktx.convert.lazy import place

    imported = convert.load_source(source, lazy=True)
    flat = convert.flatten(imported.params)
    # Scopes a checkpoint may lack or a model may not use (a BERT's MLM head, pooler, task heads).
    partial = tuple(getattr(imported, "partial_scopes", ()))
    saved = {k: tuple(v.shape) for k, v in flat.items()}
    expected = _flat_shapes(abstract_params)
    message = _mismatch_message(source, saved, expected, missing_ok=True)
    missing = [p for p in expected if p not in saved and not p.startswith(CONDITIONING_SCOPE + "/")
               and p.split("/")[0] not in partial]
    unused = sorted(p for p in set(saved) - set(expected) if p.split("/")[0] not in partial)
    if message or missing or unused:
        lines = [message] if message else [f"checkpoint {source} does not match the model:"]
        lines += [f"  {p}: model {expected[p]}, missing in checkpoint" for p in missing]
        lines += [f"  {p}: checkpoint {saved[p]}, not in model" for p in unused]
        raise CheckpointShapeError("\n".join(lines))
    flat_abstract, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    initialized = [param_path(p) for p, _ in flat_abstract if param_path(p) not in flat]
    fresh = _fresh(init_params, flat_abstract, initialized)
    leaves, restored = [], []
    for p, a in flat_abstract:
        name = param_path(p)
        if name in flat:  # read shard by shard: only this process's regions
            leaves.append(place(flat[name], getattr(a, "sharding", None), a.dtype))
            restored.append(name)
        else:
            leaves.append(fresh[name])
    report = InitReport(source, tuple(restored), tuple(initialized), ())
    _log.info(report.summary())
    return jax.tree.unflatten(treedef, leaves), report


def _fresh(init_params: Any, flat_abstract: Sequence, names: Sequence[str]) -> dict[str, Any]:
    """`{path: fresh value}` of the parameters `names` from `init_params` (a tree like the
    model's params, or a function of the names)."""
    if callable(init_params):
        return dict(init_params(tuple(names))) if names else {}
    wanted = set(names)
    leaves = jax.tree.leaves(init_params)
    return {name: v for (p, _), v in zip(flat_abstract, leaves) if (name := param_path(p)) in wanted}


def _subtree(tree: Any, keep: set[str], prefix: Sequence[str] = ()) -> Any:
    """Nested dicts of `tree` keeping only leaves whose path is in `keep`."""
    if isinstance(tree, Mapping):
        out = {}
        for k, v in tree.items():
            sub = _subtree(v, keep, (*prefix, str(k)))
            if sub is not None:
                out[k] = sub
        return out or None
    return tree if "/".join(prefix) in keep else None
