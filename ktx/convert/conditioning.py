"""The task-conditioned parameters of a run alone, as one small file.

Prompt-tuning users keep one small file of prompts per task set instead of a copy of the
backbone; the same holds for every ktx conditioning method. `export_conditioning` writes
the `conditioning/...` parameters of a ktx run or checkpoint (prompts, adapters,
hypernetworks, task embeddings) as a `.safetensors` file whose metadata records what they
belong to: the format, the source checkpoint and step, and the run's operative gin config
when there is one (the conditioning method, its sizes and the number of tasks).
`load_conditioning` puts them back into a parameter tree whose backbone comes from
anywhere (the imported checkpoint the run started from): with a frozen backbone that
reproduces the run's logits exactly.

    ktx export runs/hp conditioning:runs/hp_prompts.safetensors [--checkpoint STEP]
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import numpy as np

from ktx.convert import layout
from ktx.convert.safetensors_io import read_safetensors, write_safetensors
from ktx.runs.run_dir import RunDir

__all__ = ["CONDITIONING_FORMAT", "CONDITIONING_PREFIX", "export_conditioning", "load_conditioning"]

CONDITIONING_FORMAT = "ktx-conditioning-v1"
CONDITIONING_PREFIX = "conditioning/"


def export_conditioning(
    source: str | os.PathLike, out_file: str | os.PathLike, *, step: int | None = None
) -> pathlib.Path:
    """Writes the `conditioning/...` parameters of a ktx run / checkpoints / step
    directory (latest step unless `step`) to `out_file` (`.safetensors`); returns it.

    ValueError when the checkpoint has no conditioning parameters (a plain model) or the
    output exists.
    """
    from ktx.convert.ktx_dir import read_ktx_checkpoint

    out = pathlib.Path(out_file).expanduser()
    if out.exists():
        raise ValueError(f"{out} exists; choose a new file (nothing was written)")
    flat, _, step_dir = read_ktx_checkpoint(source, step)
    tensors = {k: v for k, v in flat.items() if k.startswith(CONDITIONING_PREFIX)}
    if not tensors:
        raise ValueError(f"{step_dir} holds no task-conditioned parameters ({CONDITIONING_PREFIX}...): "
                         "export the backbone with hf:DIR instead")
    metadata = {"format": CONDITIONING_FORMAT, "source": str(step_dir), "step": step_dir.name}
    run = RunDir.containing(step_dir)
    if run is not None:
        metadata["config_gin"] = run.config.read_text()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    write_safetensors(tmp, tensors, metadata)
    tmp.rename(out)
    return out


def load_conditioning(params: Any, file: str | os.PathLike) -> Any:
    """`params` (a nested parameter tree) with its `conditioning` subtree replaced by the
    file's tensors. Every conditioning parameter of `params` must be in the file with the
    same shape, and the file must hold nothing else: a mismatch is a ValueError naming
    the parameters and shapes."""
    from safetensors import safe_open

    path = pathlib.Path(file).expanduser()
    saved = dict(read_safetensors(path))
    with safe_open(str(path), framework="numpy") as f:
        fmt = (f.metadata() or {}).get("format")
    if fmt != CONDITIONING_FORMAT:
        raise ValueError(f"{path}: not a ktx conditioning file (format {fmt!r}, expected "
                         f"{CONDITIONING_FORMAT!r}); write one with `ktx export RUN conditioning:FILE`")
    flat = layout.flatten(params)
    wanted = {k: tuple(np.shape(v)) for k, v in flat.items() if k.startswith(CONDITIONING_PREFIX)}
    problems = [f"  {k}: model {shape}, missing in the file" for k, shape in wanted.items()
                if k not in saved]
    problems += [f"  {k}: file {tuple(saved[k].shape)}, model {wanted[k]}" for k in wanted
                 if k in saved and tuple(saved[k].shape) != wanted[k]]
    problems += [f"  {k}: in the file, not in the model" for k in saved if k not in wanted]
    if problems:
        raise ValueError(f"{path} does not match the model's task-conditioned parameters:\n"
                         + "\n".join(problems))
    merged: dict[str, Any] = dict(flat)
    for k in wanted:
        merged[k] = np.asarray(saved[k]).astype(np.asarray(flat[k]).dtype)
    return layout.unflatten(merged)

