"""`infer(...)`: decode a split of every task of a mixture and write JSONL predictions.

Each output line is `{"task": name, "index": i, "inputs": text, "targets": text,
"prediction": text, "prediction_tokens": [...]}`, where texts are the examples'
`*_pretokenized` strings when the task has them, else the detokenized ids.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax

from ktx import partitioning
from ktx.checkpoints import resolve_checkpoint, restore_params
from ktx.eval import _local_rows, _pad, _strip, abstract_params_for, make_predict_fn
from ktx.models.base import BaseModel
from ktx.trainer import Trainer

__all__ = ["infer", "encode_batch"]


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def encode_batch(examples: list[dict], task_id: int, lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
    """Model features for decoding: `encoder_input_tokens [B, Le]` (trimmed/padded with
    0), `decoder_target_tokens [B, Ld]` (only its length is used) and `task_id [B]`."""
    le, ld = lengths["inputs"], lengths["targets"]
    enc = np.zeros((len(examples), le), np.int32)
    dec = np.zeros((len(examples), ld), np.int32)
    for i, ex in enumerate(examples):
        ids = np.asarray(ex["inputs"], np.int32)[:le]
        enc[i, : len(ids)] = ids
        if "targets" in ex:
            t = np.asarray(ex["targets"], np.int32)[:ld]
            dec[i, : len(t)] = t
    return {
        "encoder_input_tokens": enc,
        "decoder_target_tokens": dec,
        "task_id": np.full((len(examples),), task_id, np.int32),
    }


def infer(
    *,
    model: BaseModel,
    checkpoint_path: str | os.PathLike,
    mixture_or_task_name: str,
    task_feature_lengths: Mapping[str, int],
    output_file: str | os.PathLike,
    split: str = "validation",
    checkpoint_step: int | None = None,
    batch_size: int = 32,
    num_partitions: int = 1,
    num_examples: int | None = None,
    decode_method: str = "greedy",
    num_beams: int = 4,
    alpha: float = 0.6,
) -> int:
    """Writes predictions of `checkpoint_path` (a run dir, checkpoints dir or step dir;
    latest step unless `checkpoint_step`) for `split` of each task; returns the number
    of lines written."""
    import seqio

    from ktx.data.pipeline import mixture_task_names

    task_names = mixture_task_names(mixture_or_task_name)
    if model.num_tasks != len(task_names):
        raise ValueError(
            f"{mixture_or_task_name!r} has {len(task_names)} tasks but model.num_tasks="
            f"{model.num_tasks}; set NUM_TASKS to {len(task_names)}"
        )
    trainer = Trainer(model, optax.identity(), mesh=partitioning.create_mesh(num_partitions))
    abstract = abstract_params_for(model, trainer, batch_size, task_feature_lengths)
    params, step = restore_params(resolve_checkpoint(checkpoint_path, checkpoint_step), abstract)
    kwargs = dict(decode_method=decode_method)
    if decode_method == "beam":
        kwargs.update(num_beams=num_beams, alpha=alpha)
    predict = make_predict_fn(model, trainer, **kwargs)
    output_file = pathlib.Path(output_file)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    chief = jax.process_index() == 0
    with open(output_file, "w", encoding="utf-8") if chief else open(os.devnull, "w") as f:
        for task_id, name in enumerate(task_names):
            task = seqio.get_mixture_or_task(name)
            vocab = task.output_features["targets"].vocabulary
            in_vocab = task.output_features["inputs"].vocabulary
            ds = task.get_dataset(task_feature_lengths, split=split, shuffle=False)
            if num_examples is not None:
                ds = ds.take(num_examples)
            examples = list(ds.as_numpy_iterator())
            for start in range(0, len(examples), batch_size):
                chunk = examples[start:start + batch_size]
                batch = _local_rows(_pad(encode_batch(chunk, task_id, task_feature_lengths), batch_size))
                tokens = predict(params, batch)[: len(chunk)]
                for i, (ex, toks) in enumerate(zip(chunk, tokens)):
                    ids = _strip(toks)
                    record = {
                        "task": name,
                        "index": start + i,
                        "inputs": _text(ex["inputs_pretokenized"]) if "inputs_pretokenized" in ex
                        else in_vocab.decode([int(t) for t in ex["inputs"]]),
                        "targets": _text(ex["targets_pretokenized"]) if "targets_pretokenized" in ex
                        else vocab.decode([int(t) for t in ex.get("targets", [])]),
                        "prediction": vocab.decode(ids),
                        "prediction_tokens": ids,
                    }
                    f.write(json.dumps(record) + "\n")
                    written += 1
    print(f"wrote {written} predictions of checkpoint step {step} to {output_file}", flush=True)
    return written
