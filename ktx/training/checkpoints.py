"""Orbax checkpoints of the ktx train state.

A run directory holds `checkpoints/<step>/` with two items: `state` (an orbax PyTree:
`step`, `params` by parameter path, `opt_state` as its flattened leaves `"0"`,
`"1"`, ..., and `model_state` the same way when the model carries one
(`BaseModel.init_model_state`, e.g. SMART's teacher; absent otherwise, so such
checkpoints are as before)) and `meta` (JSON: step, task names, anything the caller adds). The data
position is the step (`ktx.runs.train.TrainInput`: the input is a pure function of the step), so
restoring the state restores the data position.

* `CheckpointManager`: save every `save_period` steps, keep the newest `keep`, force a
  save at the end; restore the latest (or a given) step onto any mesh: arrays are read
  straight into the target `NamedSharding`s of the current trainer.
* Before restoring, saved shapes are compared with the model's; any difference raises
  `CheckpointShapeError` listing every mismatching parameter path and both shapes.

A new run's parameters from another run's checkpoint (T5X's `INITIAL_CHECKPOINT_PATH`,
or a Hugging Face / T5X checkpoint converted on the fly) are `ktx.training.initial_params`.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp

from ktx.models import scan_layout
from ktx.runs.run_dir import RunDir
from ktx.training.summaries import quiet_absl
from ktx.training.trainer import TrainState
from ktx.treepath import name as param_path

__all__ = [
    "CheckpointShapeError",
    "CorruptCheckpointError",
    "CheckpointManager",
    "restore_params_skipping_corrupt",
    "resolve_checkpoint",
    "restore_params",
    "saved_param_shapes",
]

_log = logging.getLogger(__name__)


class CheckpointShapeError(ValueError):
    """Saved parameter shapes differ from the model's."""


class CorruptCheckpointError(RuntimeError):
    """A saved step cannot be read (truncated or corrupted files); the message names
    the step and, where the storage layer says, the file."""

    def __init__(self, step_dir: pathlib.Path, cause: BaseException, note: str = ""):
        self.step_dir = pathlib.Path(step_dir)
        self.cause = cause
        # orbax wraps the storage error; the innermost one names the array and file.
        chain, e = [], cause
        while e is not None and len(chain) < 8:
            chain.append(e)
            e = e.__cause__ or e.__context__
        named = [c for c in reversed(chain) if str(self.step_dir) in str(c)] or [chain[0]]
        text = str(named[0]).strip()
        head = text.splitlines()[0][:400] if text else type(named[0]).__name__
        super().__init__(f"checkpoint step {self.step_dir.name} ({self.step_dir}) is unreadable: {head}"
                         + (f"; {note}" if note else ""))


def _reading(step_dir: pathlib.Path, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, an orbax/TensorStore read of `step_dir`; any failure but a
    shape mismatch becomes one `CorruptCheckpointError` naming the step and file."""
    try:
        return fn(*args, **kwargs)
    except (CheckpointShapeError, FileNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001 - orbax/TensorStore raise many types
        raise CorruptCheckpointError(step_dir, e) from e


def _state_to_tree(state: TrainState) -> dict:
    tree = {
        "step": state.step,
        "params": state.params,
        "opt_state": {str(i): leaf for i, leaf in enumerate(jax.tree.leaves(state.opt_state))},
    }
    model_leaves = jax.tree.leaves(state.model_state)
    if model_leaves:  # a model without state writes the checkpoint it always wrote
        tree["model_state"] = {str(i): leaf for i, leaf in enumerate(model_leaves)}
    return tree


def _unflatten_like(like: Any, flat: Mapping[str, Any] | None) -> Any:
    treedef = jax.tree.structure(like)
    return jax.tree.unflatten(treedef, [flat[str(i)] for i in range(treedef.num_leaves)])


def _tree_to_state(tree: Mapping[str, Any], like: TrainState) -> TrainState:
    return TrainState(
        step=tree["step"], params=tree["params"],
        opt_state=_unflatten_like(like.opt_state, tree["opt_state"]),
        model_state=_unflatten_like(like.model_state, tree.get("model_state")),
    )


def _saved_tree_metadata(step_dir: pathlib.Path) -> Mapping[str, Any]:
    """The metadata tree (shapes, dtypes) of a saved step's `state` item."""
    step_dir = pathlib.Path(step_dir).expanduser().absolute()
    # The step-level metadata file lives one folder up (CheckpointManager layout);
    # orbax's warning that `state/` has none is noise to the user.
    with quiet_absl("Metadata file does not exist"):
        metadata = ocp.StandardCheckpointer().metadata(step_dir / "state")
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)
    if tree is None:  # orbax answers None, not an error, when the step's metadata is damaged
        raise ValueError(f"orbax found no array metadata in {step_dir / 'state'} (its "
                         "array_metadatas/ or OCDBT manifest is missing or truncated)")
    return tree


def _model_state_message(where: str, saved: Mapping[str, Any] | None, expected: Any) -> str | None:
    """Why a saved `model_state` (flat leaves, or None) cannot restore `expected` (the
    abstract model state), or None when the leaves' count and shapes agree."""
    leaves = jax.tree_util.tree_flatten_with_path(expected)[0]
    saved = dict(saved or {})
    if not leaves and not saved:
        return None
    if not saved:
        return (f"checkpoint {where} holds no model state, but the model carries "
                f"{len(leaves)} arrays of it (BaseModel.init_model_state: e.g. SMART's teacher, "
                "smart.SmartModel.proximal_weight > 0); resume it with the model it was "
                "written with, or start a new run from its parameters "
                "(INITIAL_CHECKPOINT_PATH), which sets the model state from them")
    if not leaves:
        return (f"checkpoint {where} holds a model state of {len(saved)} arrays (e.g. SMART's "
                "teacher, smart.SmartModel.proximal_weight > 0), but the model carries none; "
                "resume it with the model it was written with, or start a new run from its "
                "parameters (INITIAL_CHECKPOINT_PATH)")
    lines = []
    for i, (path, leaf) in enumerate(leaves):
        got = saved.get(str(i))
        shape = tuple(getattr(got, "shape", ())) if got is not None else None
        if shape != tuple(leaf.shape):
            lines.append(f"  {param_path(path)}: checkpoint {shape}, model {tuple(leaf.shape)}")
    if len(saved) != len(leaves):
        lines.append(f"  checkpoint {len(saved)} arrays, model {len(leaves)}")
    if not lines:
        return None
    return f"checkpoint {where}: its model state does not match the model's:\n" + "\n".join(lines)


def _restore_args(abstract_tree: Any) -> Any:
    """Orbax restore arguments placing each leaf with its own sharding; a leaf without one
    (`jax.eval_shape`'s output, as `ktx analyze` builds) goes where `jnp` would put a new
    array, this process's first device. Never the sharding recorded in the checkpoint: it
    names the saving run's devices, which need not exist here (a checkpoint saved on a
    2x4 mesh read on one device)."""
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def arg(a):
        sharding = getattr(a, "sharding", None) or default
        return ocp.ArrayRestoreArgs(dtype=a.dtype, sharding=sharding, global_shape=a.shape)

    return jax.tree.map(arg, abstract_tree)


def _flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[param_path(path)] = tuple(getattr(leaf, "shape", ()))
    return out


def _mismatch_message(where: str, saved: dict, expected: dict, missing_ok: bool) -> str | None:
    # A scanned checkpoint and an unrolled model (or the reverse) share no layer names:
    # say so, instead of re-initialising every layer (missing_ok) or listing them all.
    layout = scan_layout.layout_mismatch(saved, expected, where)
    if layout:
        return layout
    lines = []
    for path, shape in expected.items():
        if path not in saved:
            if not missing_ok:
                lines.append(f"  {path}: model {shape}, missing in checkpoint")
        elif saved[path] != shape:
            lines.append(f"  {path}: checkpoint {saved[path]}, model {shape}")
    if not missing_ok:
        for path in saved:
            if path not in expected:
                lines.append(f"  {path}: checkpoint {saved[path]}, not in model")
    if not lines:
        return None
    return f"checkpoint {where} does not match the model ({len(lines)} parameters):\n" + "\n".join(lines)


def saved_param_shapes(step_dir: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """`{'/'-joined param path: shape}` of a saved step directory (`.../checkpoints/<step>`)."""
    # orbax reads no metadata through a relative path: always hand it an absolute one.
    step_dir = pathlib.Path(step_dir).expanduser().absolute()

    return _reading(step_dir, lambda: _flat_shapes(_saved_tree_metadata(step_dir)["params"]))


def resolve_checkpoint(path: str | os.PathLike, step: int | None = None) -> pathlib.Path:
    """A step directory from a run dir, a `checkpoints/` dir or a step dir.

    Raises FileNotFoundError naming the path and what was looked for.
    """
    p = pathlib.Path(path).expanduser().absolute()
    if (p / "state").is_dir():
        return p
    if RunDir(p).checkpoints.is_dir():
        p = RunDir(p).checkpoints
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint path {str(path)!r} does not exist")
    steps = sorted(int(c.name) for c in p.iterdir() if c.name.isdigit() and (c / "state").is_dir())
    if not steps:
        raise FileNotFoundError(
            f"no checkpoint in {str(path)!r}: expected a run directory with "
            f"{RunDir.CHECKPOINTS}/<step>/state, a checkpoints directory, or a step directory"
        )
    if step is None:
        return p / str(steps[-1])
    if step not in steps:
        raise FileNotFoundError(f"step {step} not in {str(p)!r}; saved steps: {steps}")
    return p / str(step)


class CheckpointManager:
    """Periodic orbax checkpoints of a `TrainState` under `<model_dir>/checkpoints`.

    Args:
      model_dir: the run directory.
      save_period: save when `step % save_period == 0` (and whenever forced).
      keep: how many of the newest checkpoints to keep (None: all).
      async_save: write in a background thread (orbax async checkpointing).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        save_period: int = 1000,
        keep: int | None = None,
        async_save: bool = False,
    ):
        if not isinstance(save_period, int) or save_period < 1:
            raise ValueError(f"save_period={save_period!r}; accepted: an integer >= 1")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep={keep!r}; accepted: None (keep all) or an integer >= 1")
        self.directory = RunDir(model_dir).checkpoints
        self.save_period = save_period
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        return step % self.save_period == 0

    def save(self, state: TrainState, *, force: bool = False, meta: Mapping | None = None) -> bool:
        """Saves `state` at `int(state.step)` if due (or `force`); returns whether it did."""
        step = int(jax.device_get(state.step))
        if not (force or self.should_save(step)) or step in self._manager.all_steps():
            return False
        meta = {"step": step, **(dict(meta) if meta else {})}
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(_state_to_tree(state)), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        return True

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def read_meta(self, step: int) -> dict:
        return dict(
            self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        )

    def restore(self, abstract_state: TrainState, step: int | None = None) -> TrainState:
        """Restores `step` (default: latest) into `abstract_state`'s shapes and shardings
        (from `Trainer.create_abstract_state`), so it loads onto any mesh shape.

        Raises:
          FileNotFoundError: no checkpoint / no such step.
          CheckpointShapeError: saved parameter shapes differ; lists every mismatch.
        """
        step = self.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {str(self.directory)!r}; saved: {self.all_steps()}"
            )
        step_dir = self.directory / str(step)
        # Read inside `_reading`: a step whose metadata cannot be read (or reads as None, as
        # orbax returns for a damaged step) is a CorruptCheckpointError, skipped by
        # `restore_latest_good`, not a TypeError.
        saved_params, saved_model_state = _reading(step_dir, lambda: (
            lambda tree: (tree["params"], tree.get("model_state")))(_saved_tree_metadata(step_dir)))
        message = _mismatch_message(
            str(step_dir), _flat_shapes(saved_params), _flat_shapes(abstract_state.params), False,
        ) or _model_state_message(str(step_dir), saved_model_state, abstract_state.model_state)
        if message:
            raise CheckpointShapeError(message)
        target = _state_to_tree(abstract_state)
        restored = _reading(self.directory / str(step), self._manager.restore,
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=target, restore_args=_restore_args(target))
            ),
        )["state"]
        return _tree_to_state(restored, abstract_state)

    def restore_latest_good(self, abstract_state: TrainState) -> TrainState | None:
        """Restores the newest readable step (None when there is no checkpoint).

        Steps are tried newest first. When an older step reads, each newer one that did not
        is reported (step and file) and moved aside to `<step>.corrupt`, so that the resumed
        run can save that step again. When no step reads, none is moved (the cause may be
        this machine, not the files: memory, devices, library versions) and a
        CorruptCheckpointError names the newest step's error.
        """
        failed: list[CorruptCheckpointError] = []
        for step in reversed(self.all_steps()):
            try:
                state = self.restore(abstract_state, step)
            except CorruptCheckpointError as e:
                failed.append(e)
                continue
            for e in failed:
                aside = self.directory / f"{e.step_dir.name}.corrupt"
                n = 0
                while aside.exists():  # that step was set aside before (<step>.corrupt.<n>)
                    n += 1
                    aside = self.directory / f"{e.step_dir.name}.corrupt.{n}"
                e.step_dir.rename(aside)
                print(f"ktx: {e}; moved it to {aside}; resuming from step {step}", flush=True)
            if failed:
                self._manager.reload()
            return state
        if failed:
            newest = failed[0]
            raise CorruptCheckpointError(
                newest.step_dir, newest.cause,
                note=f"no step of {self.directory} can be read "
                     f"({', '.join(e.step_dir.name for e in failed)}), so none was moved aside: "
                     "if the files are sound, the cause is on this machine")
        return None


def host_params(step_dir: str | os.PathLike) -> Any:
    """The parameter tree of a ktx checkpoint step directory as host numpy arrays, read
    without a model, a mesh or the saving run's devices (`_reading`'s errors)."""
    import numpy as np

    step_dir = pathlib.Path(step_dir)

    def read():
        tree = _saved_tree_metadata(step_dir)
        item = {"params": jax.tree.map(lambda _: 0, tree["params"])}
        args = {"params": jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                       tree["params"])}
        return ocp.PyTreeCheckpointer().restore(
            step_dir / "state",
            args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True),
        )["params"]

    return _reading(step_dir, read)


def restore_params(path: str | os.PathLike, abstract_params: Any, step: int | None = None) -> tuple[Any, int]:
    """Only the parameters of a checkpoint (for `ktx eval` / `ktx infer`), onto the
    shardings of `abstract_params`; returns `(params, step)`.

    Raises CheckpointShapeError listing every parameter whose shape differs or that is
    missing on either side.
    """
    step_dir = resolve_checkpoint(path, step)
    message = _mismatch_message(
        str(step_dir), saved_param_shapes(step_dir), _flat_shapes(abstract_params), False
    )
    if message:
        raise CheckpointShapeError(message)
    target = {"params": abstract_params}
    restored = _reading(step_dir, ocp.PyTreeCheckpointer().restore,
        step_dir / "state",
        args=ocp.args.PyTreeRestore(
            item=target, restore_args=_restore_args(target), partial_restore=True
        ),
    )
    return restored["params"], int(step_dir.name)


def restore_params_skipping_corrupt(model_dir: str | os.PathLike, steps: Sequence[int], abstract_params: Any):
    """Yields `(step, params)` for each of `steps` of a run directory; an unreadable
    step is reported (step and file) and skipped. Raises CorruptCheckpointError when
    none of the steps could be read."""
    readable = 0
    for step in steps:
        try:
            params, _ = restore_params(resolve_checkpoint(model_dir, step), abstract_params)
        except CorruptCheckpointError as e:
            print(f"ktx: {e}; skipped", flush=True)
            last_error = e
            continue
        readable += 1
        yield step, params
    if steps and not readable:
        raise last_error
